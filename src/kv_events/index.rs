//! One engine's blocks as its events say (one per data-parallel rank),
//! kept by the agent beside the engine.
//!
//! Batches come numbered. The index applies them in order and says what
//! to do with one that is not next ([`EngineIndex::order`]): a gap is
//! replayed from the engine's ring, and one the ring no longer covers
//! (or an engine without a replay socket) is lost: the index drops every
//! block and stays *partial* until the engine has stored as many blocks
//! as it can hold (its cache turned over since) or cleared its cache
//! (`AllBlocksCleared`) — until then the balancers treat the engine as
//! one without events. A number lower than the last one is an engine that
//! restarted: its cache is empty, and so is the index.
//!
//! Each block is held under its engine hash and medium (what a removal
//! names) with its key ([`super::key`]), least recently stored forgotten
//! first past `capacity_blocks` (the agent's memory bound: with the union
//! it reports, [`super::holdings`], about 110 bytes a block, so 1,000,000
//! blocks take about 111 MB: `benches/kv_events.rs`). Every change to the
//! keys held is told to the caller ([`Change`]) for the balancers.

use std::time::Instant;

use super::key::{chain, BlockKey};
use super::wire::{Batch, EngineHash, Event, Medium, Skipped, Stored};
use crate::lru::LruMap;

/// A change to the keys an engine holds (a cleared cache is every block
/// removed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Stored(BlockKey, Medium),
    Removed(BlockKey, Medium),
}

/// Where a batch numbered `seq` stands against the ones applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// The next one: apply it.
    Next,
    /// Batches `from..seq` were missed: replay them first (or, if they
    /// cannot be, [`EngineIndex::lost`]).
    Missed { from: u64 },
    /// Lower than the last one: the engine restarted
    /// ([`EngineIndex::restarted`], then ask again).
    Restarted,
}

/// Counters of what an engine's events did, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    pub batches: u64,
    pub events: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub clears: u64,
    pub skipped_unknown_type: u64,
    pub skipped_unknown_medium: u64,
    pub skipped_malformed: u64,
    /// Blocks stored after a parent the index does not hold (lost, or
    /// forgotten past the capacity): no key can be chained for them.
    pub orphans: u64,
    /// Gaps in the numbering seen.
    pub gaps: u64,
    /// Gaps no replay covered: the index was dropped.
    pub lost: u64,
    pub restarts: u64,
}

#[derive(Debug, Clone, Copy)]
struct Held {
    key: BlockKey,
    medium: Medium,
}

/// One engine's blocks (module docs).
#[derive(Debug, Clone)]
pub struct EngineIndex {
    blocks: LruMap<Held>,
    next_seq: Option<u64>,
    block_size: Option<u32>,
    /// Blocks the engine must still store before an index that lost
    /// events counts as whole again; `None`: whole.
    partial_for: Option<u64>,
    /// The engine's capacity in blocks, when known: how many stores turn
    /// its cache over.
    engine_blocks: Option<u64>,
    last_batch: Option<Instant>,
    /// Blocks held per medium (by `Medium as usize`).
    held: [usize; 2],
    stats: IndexStats,
}

/// The slot a block takes: its engine hash on its medium (a block offloaded
/// to the CPU keeps its GPU hash).
fn slot(hash: EngineHash, medium: Medium) -> u64 {
    match medium {
        Medium::Gpu => hash,
        Medium::Cpu => hash ^ 0xC0FF_EE00_C0FF_EE00,
    }
}

impl EngineIndex {
    pub fn new(capacity_blocks: usize) -> Self {
        EngineIndex {
            blocks: LruMap::new(capacity_blocks),
            next_seq: None,
            block_size: None,
            partial_for: None,
            engine_blocks: None,
            last_batch: None,
            held: [0; 2],
            stats: IndexStats::default(),
        }
    }

    /// Where batch `seq` stands (module docs). The first batch seen
    /// after the agent starts is a gap from 0 unless it is 0: the blocks
    /// stored before are in the ring, if it still has them.
    pub fn order(&self, seq: u64) -> Order {
        match self.next_seq {
            None if seq == 0 => Order::Next,
            None => Order::Missed { from: 0 },
            Some(next) if seq == next => Order::Next,
            Some(next) if seq > next => Order::Missed { from: next },
            Some(_) => Order::Restarted,
        }
    }

    /// Whether a replayed batch `seq` is still wanted (not applied yet).
    pub fn wants(&self, seq: u64) -> bool {
        self.next_seq.is_none_or(|next| seq >= next)
    }

    /// Applies batch `seq` (the caller asked [`EngineIndex::order`]).
    pub fn apply(
        &mut self,
        seq: u64,
        batch: &Batch,
        now: Instant,
        changed: &mut impl FnMut(Change),
    ) {
        if self.next_seq.is_some_and(|next| seq > next) {
            self.stats.gaps += 1;
        }
        self.next_seq = Some(seq.saturating_add(1));
        self.last_batch = Some(now);
        self.stats.batches += 1;
        for skipped in &batch.skipped {
            match skipped {
                Skipped::UnknownType => self.stats.skipped_unknown_type += 1,
                Skipped::UnknownMedium => self.stats.skipped_unknown_medium += 1,
                Skipped::Malformed => self.stats.skipped_malformed += 1,
            }
        }
        for event in &batch.events {
            self.stats.events += 1;
            match event {
                Event::Stored(stored) => self.store(stored, changed),
                Event::Removed { hashes, medium } => {
                    for &hash in hashes {
                        if let Some(held) = self.blocks.remove(slot(hash, *medium)) {
                            self.held[held.medium as usize] -= 1;
                            self.stats.blocks_removed += 1;
                            changed(Change::Removed(held.key, held.medium));
                        }
                    }
                }
                Event::Cleared => {
                    self.stats.clears += 1;
                    self.clear(changed);
                    // The engine holds nothing we do not know of.
                    self.partial_for = None;
                }
            }
        }
    }

    fn store(&mut self, stored: &Stored, changed: &mut impl FnMut(Change)) {
        let mut parent = match stored.parent {
            None => None,
            // The parent's key is its tokens', on whichever medium it is
            // (an offloaded block may follow one still on the GPU).
            Some(hash) => match Medium::ALL
                .iter()
                .find_map(|&m| self.blocks.peek(slot(hash, m)))
            {
                Some(held) => Some(held.key),
                None => {
                    self.stats.orphans += stored.hashes.len() as u64;
                    return;
                }
            },
        };
        self.block_size = Some(stored.block_size);
        let size = stored.block_size as usize;
        for (i, (&hash, tokens)) in stored
            .hashes
            .iter()
            .zip(stored.token_ids.chunks_exact(size))
            .enumerate()
        {
            let key = chain(parent, tokens, stored.extras.get(i).copied().unwrap_or(0));
            parent = Some(key);
            let at = slot(hash, stored.medium);
            let before = self.blocks.peek(at).map(|h| h.key);
            let held = Held {
                key,
                medium: stored.medium,
            };
            if let Some((_, old)) = self.blocks.insert(at, held) {
                self.held[old.medium as usize] -= 1;
                changed(Change::Removed(old.key, old.medium));
            }
            match before {
                None => {
                    self.held[stored.medium as usize] += 1;
                    changed(Change::Stored(key, stored.medium));
                }
                // The engine reused a hash for other tokens.
                Some(old) if old != key => {
                    changed(Change::Removed(old, stored.medium));
                    changed(Change::Stored(key, stored.medium));
                }
                Some(_) => {}
            }
            self.stats.blocks_stored += 1;
            if let Some(left) = &mut self.partial_for {
                *left = left.saturating_sub(1);
                if *left == 0 {
                    self.partial_for = None;
                }
            }
        }
    }

    fn clear(&mut self, changed: &mut impl FnMut(Change)) {
        if self.blocks.is_empty() {
            return;
        }
        for (key, medium) in self.keys() {
            changed(Change::Removed(key, medium));
        }
        let capacity = self.blocks.capacity();
        self.blocks = LruMap::new(capacity);
        self.held = [0; 2];
    }

    /// Batch `seq` did not decode: it is passed over (its events, if any,
    /// are unknown; the caller counts it), so the ones after it apply.
    pub fn skip(&mut self, seq: u64) {
        self.next_seq = Some(seq.saturating_add(1));
    }

    /// Batches `from..` could not be replayed: what the engine stored and
    /// removed meanwhile is unknown, so the index drops every block and is
    /// partial (module docs) from batch `resume_at` on.
    pub fn lost(&mut self, resume_at: u64, changed: &mut impl FnMut(Change)) {
        self.stats.lost += 1;
        self.clear(changed);
        self.next_seq = Some(resume_at);
        self.partial_for = Some(self.turnover());
    }

    /// The engine restarted (its numbering went back): its cache is empty.
    pub fn restarted(&mut self, changed: &mut impl FnMut(Change)) {
        self.stats.restarts += 1;
        self.clear(changed);
        self.next_seq = None;
        self.partial_for = None;
    }

    /// The engine's KV capacity in blocks, when the agent learns it.
    pub fn set_engine_blocks(&mut self, blocks: Option<u64>) {
        self.engine_blocks = blocks;
    }

    /// Stores that turn the engine's cache over: its capacity, else as
    /// many as the index holds.
    fn turnover(&self) -> u64 {
        self.engine_blocks
            .unwrap_or(self.blocks.capacity() as u64)
            .max(1)
    }

    /// Whether the index stands for the engine's whole cache (no events
    /// lost since its cache last turned over).
    pub fn is_whole(&self) -> bool {
        self.partial_for.is_none()
    }

    /// Tokens per block, once a stored block said.
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    /// Blocks held on `medium`.
    pub fn blocks_on(&self, medium: Medium) -> usize {
        self.held[medium as usize]
    }

    /// Every key held, with its medium.
    pub fn keys(&self) -> impl Iterator<Item = (BlockKey, Medium)> + '_ {
        self.blocks
            .keys()
            .filter_map(|k| self.blocks.peek(k).map(|h| (h.key, h.medium)))
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// When the last batch was applied.
    pub fn last_batch(&self) -> Option<Instant> {
        self.last_batch
    }

    pub fn stats(&self) -> IndexStats {
        self.stats
    }
}
