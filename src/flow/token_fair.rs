//! Token fairness: what a dispatched request was charged, in virtual
//! tokens at its flow's weight, and its settlement to what it really used.

use super::{FlowKey, FlowQueues, Lane, Turns};

/// What a request dispatched from the queues was charged, to settle once
/// its answer ended ([`FlowQueues::settle`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    pub flow: FlowKey,
    pub lane: Lane,
    pub weight: u32,
    /// Its estimated tokens.
    pub tokens: u64,
}

/// Largest fairness weight: a flow's share against a weight-1 flow.
pub const MAX_WEIGHT: u32 = 1000;
/// Virtual units per token served at weight 1 (so small weights divide
/// without losing a token to rounding).
const VIRTUAL_SCALE: u64 = 1000;
/// Idle flows whose token-fair counters a band remembers at most.
pub(super) const MAX_IDLE_COUNTERS: usize = 65_536;

/// `tokens` served at `weight`, in virtual units.
pub(super) fn virtual_tokens(tokens: u64, weight: u32) -> u64 {
    tokens.saturating_mul(VIRTUAL_SCALE) / u64::from(weight.max(1))
}

impl<T> FlowQueues<T> {
    /// Settles a token-fair flow's counter once its request's answer ended:
    /// it was charged as `charge` says at dispatch and used `actual`
    /// tokens. Flows of other policies, and flows forgotten meanwhile (idle
    /// at or below the floor), are left alone.
    pub fn settle(&mut self, charge: &Charge, actual: u64) {
        let Charge {
            flow: key,
            lane,
            weight,
            tokens: estimated,
        } = charge;
        let (weight, estimated) = (*weight, *estimated);
        let Some(band) = self.bands.get_mut(&key.priority) else {
            return;
        };
        let Turns::Ordered {
            heads,
            by_tokens: true,
            idle,
            ..
        } = &mut band.turns
        else {
            return;
        };
        let weight = weight.clamp(1, MAX_WEIGHT);
        let settle = |served: u64| {
            served
                .saturating_sub(virtual_tokens(estimated, weight))
                .saturating_add(virtual_tokens(actual, weight))
        };
        let index_key = (key.clone(), lane.clone());
        if let Some(&idx) = self.flow_index.get(&index_key) {
            let flow = self.flows[idx.0 as usize]
                .as_mut()
                .expect("indexed flow exists");
            let settled = settle(flow.served);
            if let Some(&head) = flow.items.keys().next() {
                heads.remove(&(flow.served, head, idx));
                heads.insert((settled, head, idx));
            }
            flow.served = settled;
        } else if let Some(served) = idle.get_mut(&index_key) {
            *served = settle(*served);
        }
    }
}
