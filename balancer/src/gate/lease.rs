//! A slot taken on one endpoint ([`LeaseGuard`]): given back exactly once,
//! with what its answer showed and its flow's charge settled under the
//! same lock.

use std::net::SocketAddr;
use std::sync::Arc;

use flowgate::endpoint::{CacheSeen, Timing};
use flowgate::flow::Charge;
use flowgate::{Dispatcher, EndpointId, Lease};

use super::{now, FleetGate, Waker};

/// A slot on one endpoint, given back exactly once: by [`LeaseGuard::end`]
/// or [`LeaseGuard::release`], or, if the request task is dropped, by
/// `Drop`.
pub struct LeaseGuard {
    pub(super) shared: Arc<FleetGate>,
    pub(super) lease: Option<Lease>,
    /// What its flow was charged when it left the queues (token fairness).
    pub(super) charge: Option<Charge>,
}

/// How a request's slot comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotEnd {
    /// The answer ended: free now.
    Free,
    /// Its client left before the answer ended: the engine may still work
    /// on it, so it stays counted busy (`streamed` answers stop with their
    /// client; see [`flowgate::endpoint`]'s accounting rules).
    Orphaned { streamed: bool },
}

/// What a slot's end records, under the lock that gives it back: its
/// flow's charge settled to the tokens the answer used, then what the
/// answer showed of the engine.
#[derive(Default)]
struct SlotEnding {
    settle: Option<(Charge, u64)>,
    seen: AnswerSeen,
}

impl SlotEnding {
    fn record(self, d: &mut Dispatcher<Waker>, lease: &Lease) {
        if let Some((charge, used)) = self.settle {
            d.settle(&charge, used);
        }
        self.seen.record(d, lease);
    }
}

/// What an answer showed of its engine.
#[derive(Debug, Clone, Copy, Default)]
pub struct AnswerSeen {
    /// What it said it found in its prefix cache, when it said.
    pub cache: Option<CacheSeen>,
    /// How long its parts took.
    pub timing: Option<Timing>,
}

impl AnswerSeen {
    /// Records it in the ledger (before `lease` is given back).
    fn record(self, d: &mut Dispatcher<Waker>, lease: &Lease) {
        if let Some(cache) = self.cache {
            d.observe_cache(lease, cache);
        }
        if let Some(timing) = &self.timing {
            d.observe_timing(lease, timing);
        }
    }
}

impl LeaseGuard {
    pub(super) fn new(shared: &Arc<FleetGate>, lease: Lease) -> Self {
        LeaseGuard {
            shared: Arc::clone(shared),
            lease: Some(lease),
            charge: None,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.lease.as_ref().expect("lease held until release").addr
    }

    pub fn endpoint(&self) -> EndpointId {
        self.lease
            .as_ref()
            .expect("lease held until release")
            .endpoint
    }

    /// The model that answers a request that named none: the first its
    /// endpoint's agent reported when the slot was taken.
    /// The predicted 90th-percentile time to first token there, for a
    /// request with a latency objective.
    pub fn ttft_p90_ms(&self) -> Option<u32> {
        self.lease.as_ref()?.ttft_p90_ms
    }

    pub fn served_model(&self) -> Option<&str> {
        self.lease.as_ref()?.model.as_deref()
    }

    /// Gives the slot back once its answer ended, under one lock: its
    /// flow's token-fair charge settled to the tokens the answer `used`
    /// (what was sent, for one cut short; `None`: unsettled), what it
    /// showed of the engine recorded, then the slot freed or orphaned.
    pub fn end(mut self, used: Option<u64>, seen: AnswerSeen, slot: SlotEnd) {
        let settle = self.charge.take().zip(used);
        self.give_back(SlotEnding { settle, seen }, slot);
    }

    /// Gives the slot back with nothing to settle or record.
    pub fn release(mut self) {
        self.give_back(SlotEnding::default(), SlotEnd::Free);
    }

    fn give_back(&mut self, ending: SlotEnding, slot: SlotEnd) {
        if let Some(lease) = self.lease.take() {
            self.shared.with_dispatch(|d| {
                ending.record(d, &lease);
                match slot {
                    SlotEnd::Free => d.release(lease, now()),
                    SlotEnd::Orphaned { streamed } => d.orphan(lease, streamed, now()),
                }
            });
        }
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.give_back(SlotEnding::default(), SlotEnd::Free);
    }
}
