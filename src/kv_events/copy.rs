//! A balancer's copy of the blocks one endpoint's engines hold, kept from
//! its agent's updates ([`super::holdings`]), and asked how much of a
//! request's prompt the endpoint holds.
//!
//! An update applies only to the version it was made from: a delta from
//! another version (a lost update, a balancer restarted) or of another
//! epoch (the agent restarted) is refused, and the agent, told what the
//! copy holds, sends a snapshot. A snapshot is built apart and swapped in
//! ([`BlocksCopy::replaced`]) so that whoever reads the copy waits for a
//! swap, not for a million inserts. Memory: a key and its media in a hash
//! table, about 36 bytes a block (36 MB for a million: `benches/kv_events.rs`).

use super::holdings::{BlocksUpdate, BlocksVersion};
use super::key::BlockKey;
use super::wire::Medium;
use crate::lru::HashIndex;

const GPU: u8 = 1;
const CPU: u8 = 2;

/// How much of a prompt an endpoint holds: its leading blocks, on the GPU
/// and (after those) offloaded to the CPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Matched {
    pub gpu: usize,
    pub cpu: usize,
}

/// One endpoint's blocks (module docs).
#[derive(Debug, Clone, Default)]
pub struct BlocksCopy {
    held: Option<BlocksVersion>,
    media: HashIndex<u8>,
    /// Blocks held per medium (`Medium as usize`), kept as keys come and
    /// go: `/api/v1/agents` reads them without counting a million keys.
    on: [usize; 2],
}

impl BlocksCopy {
    /// The version it holds; none before the first snapshot.
    pub fn held(&self) -> Option<BlocksVersion> {
        self.held
    }

    pub fn len(&self) -> usize {
        self.media.len()
    }

    pub fn is_empty(&self) -> bool {
        self.media.is_empty()
    }

    /// Blocks held on `medium`.
    pub fn len_on(&self, medium: Medium) -> usize {
        self.on[medium as usize]
    }

    /// Sets whether `key` is held on `medium`.
    fn set(&mut self, key: BlockKey, medium: Medium, present: bool) {
        let bit = bit(medium);
        let m = self.media.entry(key).or_insert(0);
        if (*m & bit != 0) != present {
            *m ^= bit;
            if present {
                self.on[medium as usize] += 1;
            } else {
                self.on[medium as usize] -= 1;
            }
        }
        if *m == 0 {
            self.media.remove(&key);
        }
    }

    /// Applies a delta made from the version it holds; false when the
    /// delta is not for it (nor a snapshot: [`BlocksCopy::replaced`]), and
    /// it is left as it was.
    pub fn apply(&mut self, update: &BlocksUpdate) -> bool {
        let fits = update.from.is_some_and(|from| {
            self.held
                .is_some_and(|h| h.epoch == update.epoch && h.version == from)
        });
        if !fits {
            return false;
        }
        self.take(update);
        true
    }

    /// Applies `update`'s keys (removals first) and takes its version.
    fn take(&mut self, update: &BlocksUpdate) {
        for (keys, medium, present) in [
            (&update.removed_gpu, Medium::Gpu, false),
            (&update.removed_cpu, Medium::Cpu, false),
            (&update.stored_gpu, Medium::Gpu, true),
            (&update.stored_cpu, Medium::Cpu, true),
        ] {
            for &key in keys {
                self.set(key, medium, present);
            }
        }
        self.held = Some(BlocksVersion {
            epoch: update.epoch,
            version: update.to,
        });
    }

    /// The copy a snapshot makes, built apart from the one it replaces.
    /// `None` for a delta.
    pub fn replaced(update: &BlocksUpdate) -> Option<BlocksCopy> {
        if update.from.is_some() {
            return None;
        }
        let mut copy = BlocksCopy::default();
        (copy.media).reserve(update.stored_gpu.len() + update.stored_cpu.len());
        copy.take(update);
        Some(copy)
    }

    /// How many of `keys` (a prompt's blocks, first to last) the endpoint
    /// holds from the first on: on the GPU, then on the CPU after those
    /// (a prefix is used only as far as it runs unbroken).
    pub fn matched(&self, keys: &[BlockKey]) -> Matched {
        let mut held = Matched::default();
        for key in keys {
            match self.media.get(key) {
                Some(m) if m & GPU != 0 && held.cpu == 0 => held.gpu += 1,
                Some(m) if m & (GPU | CPU) != 0 => held.cpu += 1,
                _ => break,
            }
        }
        held
    }
}

fn bit(medium: Medium) -> u8 {
    match medium {
        Medium::Gpu => GPU,
        Medium::Cpu => CPU,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::holdings::Holdings;
    use crate::kv_events::Change;

    fn catch_up(copy: &mut BlocksCopy, h: &Holdings) {
        if let Some(update) = h.since(copy.held()) {
            match BlocksCopy::replaced(&update) {
                Some(fresh) => *copy = fresh,
                None => assert!(copy.apply(&update), "a delta from what it holds"),
            }
        }
    }

    #[test]
    fn a_prompt_matches_as_far_as_its_blocks_run_unbroken() {
        let mut h = Holdings::new(1);
        for k in [1, 2] {
            h.change(Change::Stored(k, Medium::Gpu));
        }
        h.change(Change::Stored(3, Medium::Cpu));
        h.change(Change::Stored(5, Medium::Gpu));
        let mut copy = BlocksCopy::default();
        catch_up(&mut copy, &h);
        assert_eq!(copy.matched(&[1, 2, 3, 4, 5]), Matched { gpu: 2, cpu: 1 });
        assert_eq!(copy.matched(&[9, 1]), Matched::default());
        h.change(Change::Removed(1, Medium::Gpu));
        catch_up(&mut copy, &h);
        assert_eq!(copy.matched(&[1, 2]), Matched::default());
        assert_eq!((copy.len_on(Medium::Gpu), copy.len_on(Medium::Cpu)), (2, 1));
    }

    #[test]
    fn a_delta_for_another_version_or_epoch_is_refused_and_changes_nothing() {
        let mut h = Holdings::new(1);
        h.change(Change::Stored(1, Medium::Gpu));
        let mut copy = BlocksCopy::default();
        let delta = h
            .since(Some(BlocksVersion {
                epoch: 1,
                version: 0,
            }))
            .unwrap();
        assert!(!copy.apply(&delta), "holds nothing yet");
        catch_up(&mut copy, &h);
        h.change(Change::Stored(2, Medium::Gpu));
        h.change(Change::Stored(3, Medium::Gpu));
        let skipped = h
            .since(Some(BlocksVersion {
                epoch: 1,
                version: 2,
            }))
            .unwrap();
        assert!(!copy.apply(&skipped), "version 2 was never applied");
        let other = BlocksUpdate {
            epoch: 9,
            ..h.since(copy.held()).unwrap()
        };
        assert!(!copy.apply(&other));
        assert_eq!(copy.len(), 1);
        catch_up(&mut copy, &h);
        assert_eq!(copy.len(), 3);
    }
}
