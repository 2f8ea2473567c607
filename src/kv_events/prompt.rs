//! What the engines that publish their caches hold of one request's
//! prompt: its token blocks matched against each one's blocks
//! ([`super::BlocksCopy::matched`]), gathered by the balancer before the
//! request is placed. Placement weighs these instead of its own guess (the
//! byte-block index) for those endpoints; every other endpoint keeps the
//! guess.

use std::net::SocketAddr;
use std::sync::Arc;

use super::copy::Matched;
use super::key::BlockKey;

/// A block offloaded to the CPU is worth this much of one on the GPU (it
/// must be copied back before it is used).
pub const CPU_BLOCK_WORTH: f64 = 0.5;

/// The prompt's blocks the endpoints with events hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineHeld {
    /// The prompt's whole blocks, in the engines' tokens.
    pub blocks: usize,
    /// Each endpoint with events (a whole index) and what it holds.
    pub by_endpoint: Vec<(SocketAddr, Matched)>,
    /// The prompt's block keys, to match it again while it waits
    /// ([`EngineHeld::rematched`]).
    pub keys: Arc<[BlockKey]>,
}

impl EngineHeld {
    /// The share of the prompt `addr` holds (a CPU block worth
    /// [`CPU_BLOCK_WORTH`]); `None` for an endpoint without events.
    pub fn share(&self, addr: SocketAddr) -> Option<f64> {
        let (_, m) = self.by_endpoint.iter().find(|(a, _)| *a == addr)?;
        Some(self.share_of(m))
    }

    /// Each endpoint with events and the share of the prompt it holds.
    pub fn shares(&self) -> impl Iterator<Item = (SocketAddr, f64)> + '_ {
        (self.by_endpoint.iter()).map(|(addr, m)| (*addr, self.share_of(m)))
    }

    fn share_of(&self, m: &Matched) -> f64 {
        if self.blocks == 0 {
            return 0.0;
        }
        let worth = m.gpu as f64 + CPU_BLOCK_WORTH * m.cpu as f64;
        (worth / self.blocks as f64).min(1.0)
    }

    /// The same with what `addr` holds matched again by `matched`; `None`
    /// when `addr` is not among its endpoints or holds the same.
    pub fn rematched(
        &self,
        addr: SocketAddr,
        matched: &mut impl FnMut(&[BlockKey]) -> Matched,
    ) -> Option<EngineHeld> {
        let at = self.by_endpoint.iter().position(|(a, _)| *a == addr)?;
        let now = matched(&self.keys);
        if now == self.by_endpoint[at].1 {
            return None;
        }
        let mut fresh = self.clone();
        fresh.by_endpoint[at].1 = now;
        Some(fresh)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_counts_cpu_blocks_at_half_and_unknown_endpoints_not_at_all() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let held = EngineHeld {
            blocks: 4,
            by_endpoint: vec![(a, Matched { gpu: 2, cpu: 2 })],
            ..EngineHeld::default()
        };
        assert_eq!(held.share(a), Some(0.75));
        assert_eq!(held.share(b), None, "no events: placement guesses");
    }
}
