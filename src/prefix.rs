//! Prefix-cache affinity: which endpoint recently saw a prompt's beginning.
//!
//! Model servers keep the KV cache of prompts they processed (vLLM's
//! automatic prefix caching, SGLang's radix cache, llama.cpp's per-slot
//! prompt cache), so a prompt whose beginning a server saw recently is
//! prefilled far faster there. The balancer cannot look into those caches;
//! it keeps its own approximation:
//!
//! - The prompt text is cut into blocks of [`PrefixConfig::block_bytes`]
//!   bytes. Block `i` is hashed together with the hash of block `i - 1`, so
//!   one hash names a whole prefix, as vLLM-style block caches do. Only full
//!   blocks count, and at most [`PrefixConfig::max_blocks`] per request.
//! - Each endpoint remembers the hashes of the blocks it was sent in a
//!   [`PrefixLru`] of at most [`PrefixConfig::capacity_blocks`] entries,
//!   least recently used evicted first. The blocks of one request are
//!   touched last-to-first, so a prefix's first block is always the most
//!   recent one and the cache forgets prompts from their ends.
//! - The affinity score of an endpoint is the share of the request's
//!   leading blocks it holds ([`PrefixLru::matched`] / blocks).
//!
//! Defaults: 256-byte blocks (about 64 tokens), the first 128 of a prompt
//! (32 KiB), 4,096 blocks per endpoint. Memory: about 40 bytes per
//! remembered block (a 16-byte list node plus a hash map entry), so the
//! default costs about 160 KiB per endpoint and stands for 1 MiB of prompt
//! text (roughly 250,000 tokens, more than most servers' KV caches hold).

use std::hash::{DefaultHasher, Hash, Hasher};

use crate::lru::{HashIndex, LruMap};

/// How prompts are cut into blocks and how much each endpoint remembers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixConfig {
    /// Bytes of prompt text per block (roughly 4 bytes per token).
    pub block_bytes: usize,
    /// Blocks hashed per request at most (its first `max_blocks`).
    pub max_blocks: usize,
    /// Blocks remembered per endpoint; 0 disables the index.
    pub capacity_blocks: usize,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            block_bytes: 256,
            max_blocks: 128,
            capacity_blocks: 4_096,
        }
    }
}

/// Chained hashes of the full leading blocks of `text` (at most
/// `config.max_blocks`). Deterministic for the life of the process.
pub fn block_hashes(text: &[u8], config: &PrefixConfig) -> Vec<u64> {
    if config.block_bytes == 0 || config.capacity_blocks == 0 {
        return Vec::new();
    }
    let mut previous = 0u64;
    text.chunks_exact(config.block_bytes)
        .take(config.max_blocks)
        .map(|block| {
            let mut h = DefaultHasher::new();
            previous.hash(&mut h);
            block.hash(&mut h);
            previous = h.finish();
            previous
        })
        .collect()
}

/// The block hashes one endpoint was sent, least recently used forgotten
/// first ([`LruMap`]: O(1) per block, nothing allocated once full).
#[derive(Debug, Clone)]
pub struct PrefixLru {
    blocks: LruMap<()>,
    /// The configured size; the map's own capacity is what the engine
    /// showed it keeps ([`PrefixLru::shrink_tracked`]).
    limit: usize,
}

impl PrefixLru {
    pub fn new(capacity: usize) -> Self {
        PrefixLru {
            blocks: LruMap::new(capacity),
            limit: capacity,
        }
    }

    /// Blocks remembered at most now.
    pub fn capacity(&self) -> usize {
        self.blocks.capacity()
    }

    /// The engine did not have blocks this index said it had: it keeps
    /// less than the index assumed, and an LRU cache that lost them lost
    /// every block used less recently too. The index shrinks by a quarter
    /// (not below `floor`), forgetting its least recently used blocks
    /// first, each told to `changed`.
    pub fn shrink_tracked(&mut self, floor: usize, mut changed: impl FnMut(u64, bool)) {
        let to = (self.blocks.len() * 3 / 4).max(floor.min(self.limit));
        if to < self.blocks.capacity() {
            self.blocks.set_capacity(to, |h, ()| changed(h, false));
        }
    }

    /// The engine keeps no cache: the index forgets every block and
    /// remembers none until it grows back ([`PrefixLru::grow`]).
    pub fn empty_tracked(&mut self, mut changed: impl FnMut(u64, bool)) {
        self.blocks.set_capacity(0, |h, ()| changed(h, false));
    }

    /// The engine had what the index predicted: the index may grow back
    /// by `blocks` toward its configured size.
    pub fn grow(&mut self, blocks: usize) {
        let to = self
            .blocks
            .capacity()
            .saturating_add(blocks)
            .min(self.limit);
        self.blocks.set_capacity(to, |_, ()| {});
    }

    /// Blocks remembered.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// How many of `blocks`, from the first, are remembered.
    pub fn matched(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|h| self.blocks.contains(**h))
            .count()
    }

    /// Remembers `blocks` (sent to this endpoint just now), the first block
    /// as the most recent.
    pub fn insert(&mut self, blocks: &[u64]) {
        self.insert_tracked(blocks, |_, _| {});
    }

    /// [`PrefixLru::insert`], telling `changed` of each hash it starts
    /// (`true`) or stops (`false`) remembering, so a [`PrefixHolders`]
    /// can follow.
    pub fn insert_tracked(&mut self, blocks: &[u64], mut changed: impl FnMut(u64, bool)) {
        if self.blocks.capacity() == 0 {
            return;
        }
        for &h in blocks.iter().rev() {
            let new = !self.blocks.contains(h);
            if let Some((old, ())) = self.blocks.insert(h, ()) {
                changed(old, false);
            }
            if new {
                changed(h, true);
            }
        }
    }

    /// Every hash remembered, in no particular order.
    pub fn hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.blocks.keys()
    }
}

/// Which owners (endpoints) remember each block hash: the reverse of all
/// their [`PrefixLru`]s, kept in step through
/// [`PrefixLru::insert_tracked`], so the endpoints that hold a prompt's
/// blocks are found without asking every endpoint. Most blocks are held by
/// one endpoint (prefix affinity sends a conversation back where it was),
/// so one holder is stored inline.
#[derive(Debug)]
pub struct PrefixHolders<K> {
    map: HashIndex<Holders<K>>,
}

#[derive(Debug)]
enum Holders<K> {
    One(K),
    Many(Vec<K>),
}

impl<K> Default for PrefixHolders<K> {
    fn default() -> Self {
        PrefixHolders {
            map: HashIndex::default(),
        }
    }
}

impl<K: Copy + Eq> PrefixHolders<K> {
    /// The owners that remember `hash`.
    pub fn of(&self, hash: u64) -> &[K] {
        match self.map.get(&hash) {
            None => &[],
            Some(Holders::One(k)) => std::slice::from_ref(k),
            Some(Holders::Many(v)) => v,
        }
    }

    /// `owner` started (`true`) or stopped remembering `hash`.
    pub fn change(&mut self, hash: u64, owner: K, holds: bool) {
        use std::collections::hash_map::Entry;
        match (self.map.entry(hash), holds) {
            (Entry::Vacant(v), true) => {
                v.insert(Holders::One(owner));
            }
            (Entry::Vacant(_), false) => {}
            (Entry::Occupied(mut o), true) => match o.get_mut() {
                Holders::One(k) if *k == owner => {}
                Holders::One(k) => {
                    let first = *k;
                    o.insert(Holders::Many(vec![first, owner]));
                }
                Holders::Many(v) => {
                    if !v.contains(&owner) {
                        v.push(owner);
                    }
                }
            },
            (Entry::Occupied(mut o), false) => match o.get_mut() {
                Holders::One(k) if *k == owner => {
                    o.remove();
                }
                Holders::One(_) => {}
                Holders::Many(v) => {
                    if let Some(i) = v.iter().position(|k| *k == owner) {
                        v.swap_remove(i);
                    }
                    match v.len() {
                        0 => {
                            o.remove();
                        }
                        1 => {
                            let last = v[0];
                            o.insert(Holders::One(last));
                        }
                        _ => {}
                    }
                }
            },
        }
    }

    /// Hashes with at least one owner.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(block_bytes: usize, max_blocks: usize) -> PrefixConfig {
        PrefixConfig {
            block_bytes,
            max_blocks,
            capacity_blocks: 100,
        }
    }

    #[test]
    fn hashes_name_whole_prefixes() {
        let c = config(4, 10);
        let a = block_hashes(b"aaaabbbbcccc", &c);
        let b = block_hashes(b"aaaabbbbdddd", &c);
        let shifted = block_hashes(b"xxxxbbbbcccc", &c);
        assert_eq!(a.len(), 3);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(a[1], shifted[1], "same block after another prefix");
        assert_eq!(block_hashes(b"aaaabbbbcc", &c).len(), 2, "full blocks only");
        assert_eq!(
            block_hashes(&[b'a'; 400], &c).len(),
            10,
            "at most max_blocks"
        );
        assert!(block_hashes(b"aaa", &c).is_empty());
    }

    #[test]
    fn matched_counts_leading_blocks_only() {
        let c = config(4, 10);
        let mut lru = PrefixLru::new(100);
        lru.insert(&block_hashes(b"aaaabbbbcccc", &c));
        assert_eq!(lru.matched(&block_hashes(b"aaaabbbbcccc", &c)), 3);
        assert_eq!(lru.matched(&block_hashes(b"aaaabbbbzzzzcccc", &c)), 2);
        assert_eq!(lru.matched(&block_hashes(b"zzzzbbbbcccc", &c)), 0);
        assert_eq!(lru.matched(&[]), 0);
    }

    #[test]
    fn least_recently_used_prompts_are_forgotten_from_their_ends() {
        let c = config(1, 100);
        let mut lru = PrefixLru::new(6);
        let old = block_hashes(b"abcd", &c);
        let new = block_hashes(b"wxyz", &c);
        lru.insert(&old);
        lru.insert(&new);
        assert_eq!(lru.len(), 6);
        assert_eq!(lru.matched(&new), 4);
        assert_eq!(lru.matched(&old), 2, "the old prompt lost its last blocks");
        // Using the old prompt again makes it the most recent.
        lru.insert(&old);
        assert_eq!(lru.matched(&old), 4);
        assert_eq!(lru.matched(&new), 2);
    }

    #[test]
    fn memory_stays_bounded_under_reuse() {
        let c = config(1, 100);
        let mut lru = PrefixLru::new(8);
        let prompt = block_hashes(b"abcdefgh", &c);
        for _ in 0..10_000 {
            lru.insert(&prompt);
        }
        assert_eq!(lru.len(), 8);
        assert_eq!(lru.blocks.allocated(), 8);
        assert_eq!(lru.matched(&prompt), 8);
        for round in 0..1_000u64 {
            lru.insert(&[round * 2 + 1_000, round * 2 + 1_001]);
        }
        assert_eq!((lru.len(), lru.blocks.allocated()), (8, 8));
    }

    #[test]
    fn a_missed_prediction_shrinks_the_index_and_hits_grow_it_back() {
        let mut lru = PrefixLru::new(100);
        let mut holders: PrefixHolders<u8> = PrefixHolders::default();
        let blocks: Vec<u64> = (0..80).collect();
        lru.insert_tracked(&blocks, |h, holds| holders.change(h, 0, holds));
        lru.shrink_tracked(8, |h, holds| holders.change(h, 0, holds));
        assert_eq!((lru.len(), lru.capacity()), (60, 60));
        assert_eq!(holders.len(), 60, "the holders follow");
        assert_eq!(lru.matched(&blocks), 60, "the most recent blocks stay");
        for _ in 0..20 {
            lru.shrink_tracked(8, |h, holds| holders.change(h, 0, holds));
        }
        assert_eq!(lru.capacity(), 8, "never below the floor");
        lru.insert(&(100..120).collect::<Vec<u64>>());
        assert_eq!(lru.len(), 8, "new blocks fit the smaller index");
        for _ in 0..10 {
            lru.grow(20);
        }
        assert_eq!(lru.capacity(), 100, "back to the configured size, no more");
    }

    #[test]
    fn zero_capacity_disables_the_index() {
        let c = PrefixConfig {
            capacity_blocks: 0,
            ..PrefixConfig::default()
        };
        assert!(block_hashes(&[b'a'; 1000], &c).is_empty());
        let mut lru = PrefixLru::new(0);
        lru.insert(&[1, 2, 3]);
        assert!(lru.is_empty());
    }

    /// The holders index is the exact reverse of the LRUs it follows,
    /// through inserts that evict.
    #[test]
    fn holders_follow_every_lru() {
        let mut lrus: Vec<PrefixLru> = (0..3).map(|_| PrefixLru::new(5)).collect();
        let mut holders: PrefixHolders<usize> = PrefixHolders::default();
        let mut x = 7u64;
        for step in 0..2_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let owner = step % 3;
            let first = x % 4;
            let blocks: Vec<u64> = (0..1 + x % 3).map(|b| first * 10 + b).collect();
            lrus[owner].insert_tracked(&blocks, |h, holds| holders.change(h, owner, holds));
        }
        let mut all: Vec<u64> = lrus.iter().flat_map(PrefixLru::hashes).collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(holders.len(), all.len());
        for h in all {
            let mut expected: Vec<usize> = (0..3).filter(|&o| lrus[o].matched(&[h]) == 1).collect();
            let mut got = holders.of(h).to_vec();
            got.sort_unstable();
            expected.sort_unstable();
            assert_eq!(got, expected, "holders of {h}");
        }
        assert!(holders.of(999).is_empty());
    }
}
