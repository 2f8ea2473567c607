//! The blocks an endpoint holds, over all its engines (one per
//! data-parallel rank), as the agent reports them to every balancer.
//!
//! The union is kept with a count of holders per key and medium, so a key
//! two ranks hold leaves only when both dropped it. Each change to the
//! union is numbered ([`Holdings::version`]) and kept in a bounded journal,
//! so the agent sends each balancer only what changed since the version
//! that balancer last acknowledged ([`Holdings::since`]): a balancer that
//! is new, restarted, fell behind the journal or holds another epoch (the
//! agent restarted) gets a snapshot instead, and a delta nets each key to
//! its last state, so it carries each key at most once per medium.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::index::Change;
use super::key::BlockKey;
use super::wire::Medium;
use crate::lru::HashIndex;

/// Changes the journal keeps: a balancer further behind gets a snapshot.
pub const JOURNAL: usize = 262_144;

/// What a balancer holds of an endpoint's blocks: the agent's epoch and
/// the version it applied last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlocksVersion {
    pub epoch: u64,
    pub version: u64,
}

/// The blocks that changed since `from` (a delta), or every block held
/// (`from: None`, a snapshot), bringing a balancer to `to`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlocksUpdate {
    pub epoch: u64,
    /// The version a delta applies to; none for a snapshot.
    pub from: Option<u64>,
    pub to: u64,
    /// The blocks below replace every block held (a snapshot).
    pub cleared: bool,
    pub stored_gpu: Vec<BlockKey>,
    pub stored_cpu: Vec<BlockKey>,
    pub removed_gpu: Vec<BlockKey>,
    pub removed_cpu: Vec<BlockKey>,
}

/// Why a body is no [`BlocksUpdate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpdateError {
    #[error("not a blocks update (bad magic or version)")]
    NotAnUpdate,
    #[error("blocks update cut short or with bytes after its end")]
    BadLength,
    #[error("a blocks update names at most {MAX_UPDATE_KEYS} blocks")]
    TooLarge,
}

/// Blocks one update may name: a snapshot of the largest index the agent
/// keeps per rank ([`crate::kv_events::index`]'s bound), 8 bytes each.
pub const MAX_UPDATE_KEYS: usize = 4_000_000;

const MAGIC: &[u8; 4] = b"FGB1";
/// Magic, epoch, from (`u64::MAX`: none), to, flags, four counts.
const HEADER: usize = 4 + 8 + 8 + 8 + 1 + 4 * 4;

impl BlocksUpdate {
    /// Its body on the wire: a fixed header, then the four lists of keys,
    /// each key 8 bytes little-endian (a snapshot of a million blocks is 8
    /// MB; JSON would be 20).
    pub fn encode(&self) -> Vec<u8> {
        let lists = self.lists();
        let mut out = Vec::with_capacity(HEADER + 8 * self.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.from.unwrap_or(u64::MAX).to_le_bytes());
        out.extend_from_slice(&self.to.to_le_bytes());
        out.push(u8::from(self.cleared));
        for list in lists {
            out.extend_from_slice(&(list.len() as u32).to_le_bytes());
        }
        for list in lists {
            for key in list {
                out.extend_from_slice(&key.to_le_bytes());
            }
        }
        out
    }

    /// Reads a body [`BlocksUpdate::encode`] wrote.
    pub fn decode(body: &[u8]) -> Result<BlocksUpdate, UpdateError> {
        if body.len() < HEADER || &body[..4] != MAGIC {
            return Err(UpdateError::NotAnUpdate);
        }
        let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8"));
        let count_at = |i: usize| {
            let at = 29 + 4 * i;
            u32::from_le_bytes(body[at..at + 4].try_into().expect("4")) as usize
        };
        let counts = [count_at(0), count_at(1), count_at(2), count_at(3)];
        let total: usize = counts.iter().sum();
        if total > MAX_UPDATE_KEYS {
            return Err(UpdateError::TooLarge);
        }
        if body.len() != HEADER + 8 * total {
            return Err(UpdateError::BadLength);
        }
        let mut keys = body[HEADER..]
            .chunks_exact(8)
            .map(|k| u64::from_le_bytes(k.try_into().expect("8")));
        let mut take = |n: usize| keys.by_ref().take(n).collect::<Vec<_>>();
        Ok(BlocksUpdate {
            epoch: u64_at(4),
            from: Some(u64_at(12)).filter(|&f| f != u64::MAX),
            to: u64_at(20),
            cleared: body[28] != 0,
            stored_gpu: take(counts[0]),
            stored_cpu: take(counts[1]),
            removed_gpu: take(counts[2]),
            removed_cpu: take(counts[3]),
        })
    }

    fn lists(&self) -> [&Vec<BlockKey>; 4] {
        [
            &self.stored_gpu,
            &self.stored_cpu,
            &self.removed_gpu,
            &self.removed_cpu,
        ]
    }

    /// Blocks it names, stored and removed.
    pub fn len(&self) -> usize {
        self.stored_gpu.len()
            + self.stored_cpu.len()
            + self.removed_gpu.len()
            + self.removed_cpu.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0 && !self.cleared
    }
}

/// An endpoint's blocks over all its engines (module docs).
#[derive(Debug, Clone)]
pub struct Holdings {
    epoch: u64,
    /// Holders of each key, per medium (`Medium as usize`).
    held: HashIndex<[u32; 2]>,
    /// Keys held per medium: every report says them, and counting a
    /// million keys each time would hold the lock the events wait on.
    on: [usize; 2],
    version: u64,
    /// The last changes, each with the version it made.
    journal: VecDeque<(u64, Change)>,
    journal_cap: usize,
}

impl Holdings {
    /// `epoch` names this agent's run (random at its start): versions of
    /// another run mean nothing here.
    pub fn new(epoch: u64) -> Self {
        Self::with_journal(epoch, JOURNAL)
    }

    pub fn with_journal(epoch: u64, journal_cap: usize) -> Self {
        Holdings {
            epoch,
            held: HashIndex::default(),
            on: [0; 2],
            version: 0,
            journal: VecDeque::new(),
            journal_cap: journal_cap.max(1),
        }
    }

    pub fn version(&self) -> BlocksVersion {
        BlocksVersion {
            epoch: self.epoch,
            version: self.version,
        }
    }

    /// Keys held on `medium`.
    pub fn len_on(&self, medium: Medium) -> usize {
        self.on[medium as usize]
    }

    /// Applies a change one engine's index made.
    pub fn change(&mut self, change: Change) {
        let effective = match change {
            Change::Stored(key, medium) => {
                let count = &mut self.held.entry(key).or_insert([0; 2])[medium as usize];
                *count += 1;
                (*count == 1).then_some(change)
            }
            Change::Removed(key, medium) => {
                let Some(counts) = self.held.get_mut(&key) else {
                    return;
                };
                let count = &mut counts[medium as usize];
                if *count == 0 {
                    return;
                }
                *count -= 1;
                let gone = *count == 0;
                if *counts == [0; 2] {
                    self.held.remove(&key);
                }
                gone.then_some(change)
            }
        };
        if let Some(change) = effective {
            match change {
                Change::Stored(_, medium) => self.on[medium as usize] += 1,
                Change::Removed(_, medium) => self.on[medium as usize] -= 1,
            }
            self.version += 1;
            if self.journal.len() == self.journal_cap {
                self.journal.pop_front();
            }
            self.journal.push_back((self.version, change));
        }
    }

    /// What a balancer holding `seen` needs to catch up: a delta since its
    /// version, or a snapshot. `None`: it is up to date.
    pub fn since(&self, seen: Option<BlocksVersion>) -> Option<BlocksUpdate> {
        let from = seen
            .filter(|s| s.epoch == self.epoch && s.version <= self.version)
            .map(|s| s.version);
        if from == Some(self.version) {
            return None;
        }
        let oldest = self.journal.front().map_or(self.version + 1, |(v, _)| *v);
        match from {
            // Every change after `from` is still in the journal.
            Some(from) if from + 1 >= oldest => Some(self.delta(from)),
            _ => Some(self.snapshot()),
        }
    }

    fn delta(&self, from: u64) -> BlocksUpdate {
        // Each key's last state, in the order first changed.
        let mut last: HashIndex<usize> = HashIndex::default();
        let mut net: Vec<(BlockKey, Medium, bool)> = Vec::new();
        for (_, change) in self.journal.iter().filter(|(v, _)| *v > from) {
            let (Change::Stored(key, medium) | Change::Removed(key, medium)) = *change;
            let present = matches!(change, Change::Stored(..));
            let slot = key ^ (medium as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            match last.get(&slot) {
                Some(&i) => net[i].2 = present,
                None => {
                    last.insert(slot, net.len());
                    net.push((key, medium, present));
                }
            }
        }
        let mut update = BlocksUpdate {
            epoch: self.epoch,
            from: Some(from),
            to: self.version,
            ..BlocksUpdate::default()
        };
        for (key, medium, present) in net {
            // Its last state: a removal the balancer finds nothing to
            // remove for is nothing.
            let list = match (medium, present) {
                (Medium::Gpu, true) => &mut update.stored_gpu,
                (Medium::Cpu, true) => &mut update.stored_cpu,
                (Medium::Gpu, false) => &mut update.removed_gpu,
                (Medium::Cpu, false) => &mut update.removed_cpu,
            };
            list.push(key);
        }
        update
    }

    fn snapshot(&self) -> BlocksUpdate {
        let mut update = BlocksUpdate {
            epoch: self.epoch,
            from: None,
            to: self.version,
            cleared: true,
            ..BlocksUpdate::default()
        };
        for (&key, counts) in &self.held {
            if counts[Medium::Gpu as usize] > 0 {
                update.stored_gpu.push(key);
            }
            if counts[Medium::Cpu as usize] > 0 {
                update.stored_cpu.push(key);
            }
        }
        update
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: Medium = Medium::Gpu;
    const CPU: Medium = Medium::Cpu;

    /// A balancer's copy, kept by applying updates.
    #[derive(Default)]
    struct Replica {
        seen: Option<BlocksVersion>,
        gpu: std::collections::BTreeSet<u64>,
        cpu: std::collections::BTreeSet<u64>,
    }

    impl Replica {
        fn catch_up(&mut self, h: &Holdings) -> Option<BlocksUpdate> {
            let update = h.since(self.seen)?;
            if update.cleared {
                self.gpu.clear();
                self.cpu.clear();
            }
            self.gpu.extend(&update.stored_gpu);
            self.cpu.extend(&update.stored_cpu);
            for k in &update.removed_gpu {
                self.gpu.remove(k);
            }
            for k in &update.removed_cpu {
                self.cpu.remove(k);
            }
            self.seen = Some(BlocksVersion {
                epoch: update.epoch,
                version: update.to,
            });
            Some(update)
        }

        fn is_copy_of(&self, h: &Holdings) -> bool {
            let on = |m: Medium| -> std::collections::BTreeSet<u64> {
                h.held
                    .iter()
                    .filter(|(_, c)| c[m as usize] > 0)
                    .map(|(&k, _)| k)
                    .collect()
            };
            self.gpu == on(GPU) && self.cpu == on(CPU)
        }
    }

    #[test]
    fn a_new_balancer_gets_a_snapshot_then_deltas_netted_per_key() {
        let mut h = Holdings::new(7);
        h.change(Change::Stored(1, GPU));
        h.change(Change::Stored(2, CPU));
        let mut b = Replica::default();
        let first = b.catch_up(&h).expect("new: a snapshot");
        assert_eq!((first.from, first.cleared), (None, true));
        assert!(b.is_copy_of(&h));
        assert!(b.catch_up(&h).is_none(), "up to date");
        h.change(Change::Stored(3, GPU));
        h.change(Change::Removed(3, GPU));
        h.change(Change::Stored(3, GPU));
        h.change(Change::Removed(1, GPU));
        let delta = b.catch_up(&h).expect("a delta");
        assert_eq!(delta.from, Some(2));
        assert_eq!((delta.stored_gpu, delta.removed_gpu), (vec![3], vec![1]));
        assert!(b.is_copy_of(&h));
    }

    #[test]
    fn an_update_reads_back_as_written_and_garbage_is_refused() {
        let update = BlocksUpdate {
            epoch: 3,
            from: Some(4),
            to: 9,
            cleared: false,
            stored_gpu: vec![1, u64::MAX],
            stored_cpu: vec![],
            removed_gpu: vec![7],
            removed_cpu: vec![8, 9, 10],
        };
        let body = update.encode();
        assert_eq!(BlocksUpdate::decode(&body), Ok(update.clone()));
        let snapshot = BlocksUpdate {
            from: None,
            cleared: true,
            ..update
        };
        assert_eq!(BlocksUpdate::decode(&snapshot.encode()), Ok(snapshot));
        assert_eq!(BlocksUpdate::decode(b"{}"), Err(UpdateError::NotAnUpdate));
        assert_eq!(
            BlocksUpdate::decode(&body[..body.len() - 1]),
            Err(UpdateError::BadLength)
        );
        let mut longer = body.clone();
        longer.push(0);
        assert_eq!(BlocksUpdate::decode(&longer), Err(UpdateError::BadLength));
        let mut huge = body;
        huge[29..33].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(BlocksUpdate::decode(&huge), Err(UpdateError::TooLarge));
    }

    proptest::proptest! {
        #[test]
        fn no_body_panics_the_decoder(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..128)) {
            let _ = BlocksUpdate::decode(&body);
        }
    }

    #[test]
    fn a_key_two_engines_hold_leaves_when_both_dropped_it() {
        let mut h = Holdings::new(1);
        h.change(Change::Stored(5, GPU));
        h.change(Change::Stored(5, GPU));
        let v = h.version();
        h.change(Change::Removed(5, GPU));
        assert_eq!(h.version(), v, "one engine still holds it");
        assert_eq!(h.len_on(GPU), 1);
        h.change(Change::Removed(5, GPU));
        h.change(Change::Removed(5, GPU));
        assert_eq!(h.len_on(GPU), 0);
        assert_eq!(h.version().version, 2);
    }

    #[test]
    fn behind_the_journal_or_of_another_epoch_gets_a_snapshot() {
        let mut h = Holdings::with_journal(1, 4);
        let mut b = Replica::default();
        b.catch_up(&h);
        for k in 0..10 {
            h.change(Change::Stored(k, GPU));
        }
        let update = b.catch_up(&h).expect("behind");
        assert_eq!(update.from, None, "the journal lost changes it needs");
        assert!(b.is_copy_of(&h));
        // The agent restarted: a new epoch, versions from 0 again.
        let h2 = Holdings::new(2);
        let update = b.catch_up(&h2).expect("another epoch");
        assert_eq!((update.from, update.cleared, update.len()), (None, true, 0));
        assert!(b.is_copy_of(&h2));
        // A version from the future (a balancer confused) is resynced too.
        let ahead = Some(BlocksVersion {
            epoch: 2,
            version: 99,
        });
        assert_eq!(h2.since(ahead).map(|u| u.from), Some(None));
    }
}
