//! The engines' blocks, as their agents send them from the engines'
//! KV-cache events (`POST /api/v1/agents/{id}/blocks`): one copy per
//! registered agent ([`flowgate::kv_events::BlocksCopy`]), kept apart from
//! the dispatcher's lock (a snapshot of a million blocks is built beside
//! the copy it replaces, then swapped in), with what the agent's last
//! report said of its engine (its address, models, and whether its blocks
//! stand for its whole cache), so that a request's prompt is matched
//! against the engines that serve its model before it is placed
//! ([`EngineBlocks::held_of`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, PoisonError, RwLock};

use flowgate::kv_events::key::{extra_digest, prompt_keys};
use flowgate::kv_events::{
    BlocksCopy, BlocksUpdate, BlocksVersion, EngineHeld, Matched, Medium, KEY_VERSION,
};
use flowgate::protocol::KvEventsReport;
use serde::Serialize;

/// Blocks of a prompt matched at most (a prefix cache holds no more of
/// one prompt than its first blocks).
const MAX_PROMPT_BLOCKS: usize = 8_192;

/// What the agent's last report said of its engine: where it serves, the
/// models it answers for (of which the LoRA adapters it can serve), and its
/// events' state.
#[derive(Debug, Clone, Default)]
pub struct Engine {
    pub addr: Option<SocketAddr>,
    pub models: Vec<String>,
    pub adapters: Vec<String>,
    pub events: Option<KvEventsReport>,
}

impl Engine {
    /// Whether its blocks may be matched against a prompt of `model`: it
    /// serves the model and its blocks are whole and of this key version.
    /// Its address, and its block size once a stored block said (before,
    /// it holds nothing).
    fn usable(&self, model: &str) -> Option<(SocketAddr, Option<u32>)> {
        let events = self
            .events
            .filter(|e| e.whole && e.key_version == KEY_VERSION)?;
        self.models.iter().any(|m| m == model).then_some(())?;
        Some((self.addr?, events.block_size))
    }
}

#[derive(Default)]
struct AgentBlocks {
    engine: Engine,
    copy: Arc<RwLock<BlocksCopy>>,
}

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
    by_agent: RwLock<HashMap<String, AgentBlocks>>,
}

impl EngineBlocks {
    /// What `agent`'s report (accepted) says of its engine. An agent that
    /// follows no events has no copy.
    pub fn reported(&self, agent: &str, engine: Engine) {
        let mut write = self
            .by_agent
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if engine.events.is_none() {
            write.remove(agent);
            return;
        }
        write.entry(agent.to_string()).or_default().engine = engine;
    }

    /// An engine that serves `model` and whose blocks can be matched:
    /// where to ask for a prompt's tokens, and its block size.
    pub fn tokenizer_for(&self, model: &str) -> Option<(SocketAddr, u32)> {
        let read = self.by_agent.read().unwrap_or_else(PoisonError::into_inner);
        let mut usable: Vec<(SocketAddr, u32)> = read
            .values()
            .filter_map(|a| {
                let (addr, size) = a.engine.usable(model)?;
                Some((addr, size?))
            })
            .collect();
        // The same engine every time for the same fleet: its answers are
        // remembered.
        usable.sort();
        usable.first().copied()
    }

    /// What the engines serving `model` in blocks of `block_size` hold of
    /// a prompt of `tokens` sent with `cache_salt`. Its blocks are keyed as
    /// the engines key them: with the adapter's name when `model` is a
    /// LoRA adapter an engine serves (every block), and the salt (the
    /// first block).
    pub fn held_of(
        &self,
        model: &str,
        tokens: &[u32],
        block_size: u32,
        cache_salt: Option<&str>,
    ) -> EngineHeld {
        let read = self.by_agent.read().unwrap_or_else(PoisonError::into_inner);
        let adapter = read
            .values()
            .any(|a| a.engine.adapters.iter().any(|n| n == model))
            .then_some(model);
        let extra = |i: usize| extra_digest(adapter, cache_salt.filter(|_| i == 0));
        let keys = prompt_keys(tokens, block_size as usize, MAX_PROMPT_BLOCKS, extra);
        let by_endpoint = read
            .values()
            .filter_map(|a| {
                let (addr, size) = a.engine.usable(model)?;
                let copy = a.copy.read().unwrap_or_else(PoisonError::into_inner);
                copy.held()?;
                match size {
                    Some(size) if size == block_size => Some((addr, copy.matched(&keys))),
                    // Blocks of another size: not comparable.
                    Some(_) => None,
                    // No block stored yet: it holds none of the prompt.
                    None => Some((addr, Matched::default())),
                }
            })
            .collect();
        EngineHeld {
            blocks: keys.len(),
            by_endpoint,
            keys: keys.into(),
        }
    }

    /// `agent`'s engine address and its copy, to read after a change.
    pub fn copy_of(&self, agent: &str) -> Option<(SocketAddr, Arc<RwLock<BlocksCopy>>)> {
        let read = self.by_agent.read().unwrap_or_else(PoisonError::into_inner);
        let a = read.get(agent)?;
        Some((a.engine.addr?, Arc::clone(&a.copy)))
    }

    /// Applies `update` from `agent` (the caller checked it is registered).
    pub fn apply(&self, agent: &str, update: &BlocksUpdate) -> Applied {
        let copy = {
            let read = self.by_agent.read().unwrap_or_else(PoisonError::into_inner);
            read.get(agent).map(|a| Arc::clone(&a.copy))
        };
        let copy = match copy {
            Some(c) => c,
            None => {
                let mut write = self
                    .by_agent
                    .write()
                    .unwrap_or_else(PoisonError::into_inner);
                Arc::clone(&write.entry(agent.to_string()).or_default().copy)
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
        let agent = read.get(agent)?;
        let held = agent
            .copy
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .held();
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
            .map(|(agent, a)| {
                let copy = a.copy.read().unwrap_or_else(PoisonError::into_inner);
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

#[cfg(test)]
mod tests {
    use flowgate::kv_events::{Change, Holdings};

    use super::*;

    /// One agent's engine serving `base` and the adapter `sql`, holding
    /// `keys`, in blocks of 4.
    fn one_engine(keys: &[u64]) -> (EngineBlocks, SocketAddr) {
        let blocks = EngineBlocks::default();
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let events = KvEventsReport {
            key_version: KEY_VERSION,
            block_size: Some(4),
            whole: true,
            ..KvEventsReport::default()
        };
        let engine = Engine {
            addr: Some(addr),
            models: vec!["base".into(), "sql".into()],
            adapters: vec!["sql".into()],
            events: Some(events),
        };
        blocks.reported("a", engine);
        let mut h = Holdings::new(1);
        for &k in keys {
            h.change(Change::Stored(k, Medium::Gpu));
        }
        assert!(matches!(
            blocks.apply("a", &h.since(None).unwrap()),
            Applied::Now(_)
        ));
        (blocks, addr)
    }

    #[test]
    fn an_adapters_and_a_salted_prompts_blocks_are_keyed_as_the_engine_keys_them() {
        let tokens: Vec<u32> = (0..8).collect();
        let extra = |i: usize| extra_digest(Some("sql"), Some("s").filter(|_| i == 0));
        let keys = prompt_keys(&tokens, 4, 16, extra);
        let (blocks, addr) = one_engine(&keys);
        let held = |model: &str, salt: Option<&str>| {
            let held = blocks.held_of(model, &tokens, 4, salt);
            held.share(addr)
        };
        assert_eq!(held("sql", Some("s")), Some(1.0));
        assert_eq!(held("sql", None), Some(0.0), "another salt, other blocks");
        assert_eq!(
            held("base", Some("s")),
            Some(0.0),
            "the base model's are others"
        );
        assert_eq!(blocks.tokenizer_for("sql"), Some((addr, 4)));
        assert_eq!(blocks.tokenizer_for("other"), None);
        // An agent that stops following events loses its copy.
        blocks.reported("a", Engine::default());
        assert!(blocks.states().is_empty());
    }
}
