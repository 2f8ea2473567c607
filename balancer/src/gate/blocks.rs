//! The engines' blocks, as their agents send them from the engines'
//! KV-cache events (`POST /api/v1/agents/{id}/blocks`): one copy per
//! registered agent ([`flowgate::kv_events::BlocksCopy`]), kept apart from
//! the dispatcher's lock (a snapshot of a million blocks is built beside
//! the copy it replaces, then swapped in).

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use flowgate::kv_events::{BlocksCopy, BlocksUpdate, BlocksVersion, Medium};
use serde::Serialize;

/// What became of an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Applied: the copy holds this now.
    Now(BlocksVersion),
    /// A delta for another version than the copy holds (`None`: it holds
    /// nothing yet): the agent sends a snapshot.
    NotForIt(Option<BlocksVersion>),
}

/// One agent's copy, as `/api/v1/agents` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct BlocksState {
    pub agent: String,
    pub epoch: Option<u64>,
    pub version: Option<u64>,
    pub blocks_gpu: usize,
    pub blocks_cpu: usize,
}

/// Every registered agent's copy.
#[derive(Default)]
pub struct EngineBlocks {
    by_agent: RwLock<HashMap<String, Arc<RwLock<BlocksCopy>>>>,
}

impl EngineBlocks {
    /// Applies `update` from `agent` (the caller checked it is registered).
    pub fn apply(&self, agent: &str, update: &BlocksUpdate) -> Applied {
        let copy = {
            let read = self.by_agent.read().unwrap_or_else(PoisonError::into_inner);
            read.get(agent).cloned()
        };
        let copy = match copy {
            Some(c) => c,
            None => {
                let mut write = self
                    .by_agent
                    .write()
                    .unwrap_or_else(PoisonError::into_inner);
                write.entry(agent.to_string()).or_default().clone()
            }
        };
        // A snapshot is built before the copy is locked.
        if let Some(fresh) = BlocksCopy::replaced(update) {
            let held = fresh.held();
            *copy.write().unwrap_or_else(PoisonError::into_inner) = fresh;
            return held.map_or(Applied::NotForIt(None), Applied::Now);
        }
        let mut copy = copy.write().unwrap_or_else(PoisonError::into_inner);
        if copy.apply(update) {
            copy.held().map_or(Applied::NotForIt(None), Applied::Now)
        } else {
            Applied::NotForIt(copy.held())
        }
    }

    /// The version of `agent`'s copy, if it has one.
    pub fn held(&self, agent: &str) -> Option<BlocksVersion> {
        let read = self.by_agent.read().unwrap_or_else(PoisonError::into_inner);
        let copy = read.get(agent)?;
        let held = copy.read().unwrap_or_else(PoisonError::into_inner).held();
        held
    }

    /// Forgets a deregistered or dropped agent's copy.
    pub fn forget(&self, agent: &str) {
        self.by_agent
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(agent);
    }

    /// Keeps only the copies of the agents `registered` says are.
    pub fn retain(&self, mut registered: impl FnMut(&str) -> bool) {
        self.by_agent
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|agent, _| registered(agent));
    }

    /// Every copy's state, by agent.
    pub fn states(&self) -> Vec<BlocksState> {
        let read = self.by_agent.read().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<BlocksState> = read
            .iter()
            .map(|(agent, copy)| {
                let copy = copy.read().unwrap_or_else(PoisonError::into_inner);
                let held = copy.held();
                BlocksState {
                    agent: agent.clone(),
                    epoch: held.map(|h| h.epoch),
                    version: held.map(|h| h.version),
                    blocks_gpu: copy.len_on(Medium::Gpu),
                    blocks_cpu: copy.len_on(Medium::Cpu),
                }
            })
            .collect();
        out.sort_by(|a, b| a.agent.cmp(&b.agent));
        out
    }
}
