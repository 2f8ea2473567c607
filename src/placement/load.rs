//! The one measure of an endpoint's load that every placement rule weighs:
//! the requests it must serve before one more, per slot, and the wait
//! for a slot that makes.
//!
//! Counted ahead of a new request: the balancer's requests running there,
//! the busy slots no request of this balancer explains (a client that
//! bypasses the balancers, another balancer: how far along that work is,
//! nothing says, so each is taken as a whole service), the requests held
//! for it in the current dispatch pass ([`Waits`]) and its engine's own
//! queue.

use crate::endpoint::{Endpoint, EndpointId};

/// Requests held for each endpoint so far in one dispatch pass (or
/// queued for it, [`super::evening`]): a request held for an endpoint
/// waits behind them. Every offer of the pass counts: the held offer
/// gives an endpoint's next slot to the requests held for it before any
/// later offer's, so a request first placed in the queues' order waits
/// behind them too (one count, where there were an offer's and a pass's:
/// the sessions and objectives benches alike, BENCHMARKS.md session 36).
/// A request offered again later in the pass
/// is counted once, where it was held last, and never ahead of itself
/// ([`Waits::forget`] before it is placed again). Few entries (holds per
/// pass are bounded), so a list.
#[derive(Debug, Default)]
pub(crate) struct Waits {
    /// (the request, when the dispatcher names it; the endpoint it is
    /// held for).
    held: Vec<(Option<u64>, EndpointId)>,
}

impl Waits {
    /// Requests held for `id` so far in this pass.
    pub(crate) fn ahead(&self, id: EndpointId) -> u32 {
        self.held.iter().filter(|(_, e)| *e == id).count() as u32
    }

    /// Counts one more request waiting for `id`.
    pub(crate) fn add(&mut self, id: EndpointId) {
        self.held.push((None, id));
    }

    /// Request `seq` is held for `id` (and no longer for where it was held
    /// before in this pass).
    pub(crate) fn hold(&mut self, seq: u64, id: EndpointId) {
        self.forget(seq);
        self.held.push((Some(seq), id));
    }

    /// Request `seq` is placed again: it is not ahead of itself.
    pub(crate) fn forget(&mut self, seq: u64) {
        self.held.retain(|(s, _)| *s != Some(seq));
    }
}

/// An endpoint's load (module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Load {
    /// The balancer's requests running there.
    running: u64,
    /// Busy slots no request of this balancer explains.
    foreign: u64,
    /// Requests waiting for it: held in this pass, and in its engine's
    /// queue.
    queued: u64,
    slots: u64,
}

impl Load {
    /// `e`'s load, with the requests `held` for it in this pass.
    pub(crate) fn of(e: &Endpoint, held: &Waits) -> Load {
        Load {
            running: u64::from(e.in_flight),
            foreign: u64::from(e.foreign_busy()),
            queued: u64::from(held.ahead(e.id)) + u64::from(e.engine_waiting()),
            slots: u64::from(e.slots_total().max(1)),
        }
    }

    /// Requests ahead of one more: running, foreign and queued.
    pub(crate) fn requests(&self) -> u64 {
        self.running + self.foreign + self.queued
    }

    /// Its slots (at least one).
    pub(crate) fn slots(&self) -> u64 {
        self.slots
    }

    /// Requests per slot: what evening out compares.
    pub(crate) fn per_slot(&self) -> f64 {
        self.requests() as f64 / self.slots as f64
    }

    /// One request's share of [`Load::per_slot`].
    pub(crate) fn one_request(&self) -> f64 {
        1.0 / self.slots as f64
    }

    /// Predicted wait for a slot of one more request that cannot start now
    /// (the endpoint is saturated): one service time per slot for each
    /// request that must start before it (foreign work and the queued
    /// ones) and for itself; the running ones are what frees the slots.
    pub(crate) fn wait_ms(&self, service_ms: f64) -> f64 {
        (self.foreign + self.queued + 1) as f64 * self.turn_ms(service_ms)
    }

    /// One request's turn at a slot: a service time shared by the slots
    /// (the time one more request ahead adds to a wait).
    pub(crate) fn turn_ms(&self, service_ms: f64) -> f64 {
        service_ms / self.slots as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_ahead_counts_once_per_slot() {
        let load = Load {
            running: 2,
            foreign: 1,
            queued: 3,
            slots: 4,
        };
        assert_eq!(load.per_slot(), 1.5);
        assert_eq!(load.one_request(), 0.25);
        // Foreign work, three queued and itself: five services over four
        // slots.
        assert_eq!(load.wait_ms(400.0), 500.0);
    }

    #[test]
    fn holds_are_counted_per_endpoint_once_each_and_never_ahead_of_themselves() {
        let (a, b) = (EndpointId(1), EndpointId(2));
        let mut waits = Waits::default();
        waits.hold(10, a);
        waits.hold(11, a);
        waits.add(b);
        assert_eq!((waits.ahead(a), waits.ahead(b)), (2, 1));
        assert_eq!(waits.ahead(EndpointId(3)), 0);
        // Request 10 is offered again later in the pass: while it is
        // placed only 11 is ahead of it at a; held for b now, it counts
        // there alone.
        waits.forget(10);
        assert_eq!(waits.ahead(a), 1);
        waits.hold(10, b);
        assert_eq!((waits.ahead(a), waits.ahead(b)), (1, 2));
        waits.hold(10, b);
        assert_eq!(waits.ahead(b), 2, "held twice for b, counted once");
    }
}
