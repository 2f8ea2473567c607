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
/// waits behind them. Counted twice: in the current offer of the pass
/// (what the wait-or-go rule weighs, [`Waits::ahead`]) and in the whole
/// pass (every request held for it, by whichever offer: what a latency
/// objective weighs, [`Waits::ahead_in_pass`]). Few entries (holds per
/// pass are bounded), so a list.
#[derive(Debug, Default)]
pub(crate) struct Waits {
    /// (endpoint, held in this offer, held in this pass).
    held: Vec<(EndpointId, u32, u32)>,
}

impl Waits {
    /// Requests held for `id` so far in this offer.
    pub(crate) fn ahead(&self, id: EndpointId) -> u32 {
        self.held
            .iter()
            .find(|(e, ..)| *e == id)
            .map_or(0, |(_, n, _)| *n)
    }

    /// Requests held for `id` so far in this pass.
    pub(crate) fn ahead_in_pass(&self, id: EndpointId) -> u32 {
        self.held
            .iter()
            .find(|(e, ..)| *e == id)
            .map_or(0, |(.., n)| *n)
    }

    /// Counts one more request held for `id`.
    pub(crate) fn add(&mut self, id: EndpointId) {
        match self.held.iter_mut().find(|(e, ..)| *e == id) {
            Some((_, n, p)) => {
                *n += 1;
                *p += 1;
            }
            None => self.held.push((id, 1, 1)),
        }
    }

    /// The pass goes on to its next offer: that one's counts start over.
    pub(crate) fn next_offer(&mut self) {
        self.held.iter_mut().for_each(|(_, n, _)| *n = 0);
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

    /// `e`'s load with every request held for it in this pass, by
    /// whichever offer ([`Waits::ahead_in_pass`]).
    pub(crate) fn of_pass(e: &Endpoint, held: &Waits) -> Load {
        Load {
            queued: u64::from(held.ahead_in_pass(e.id)) + u64::from(e.engine_waiting()),
            ..Load::of(e, held)
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
        (self.foreign + self.queued + 1) as f64 * service_ms / self.slots as f64
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
    fn holds_are_counted_per_endpoint() {
        let mut waits = Waits::default();
        waits.add(EndpointId(1));
        waits.add(EndpointId(1));
        waits.add(EndpointId(2));
        assert_eq!(
            (waits.ahead(EndpointId(1)), waits.ahead(EndpointId(2))),
            (2, 1)
        );
        assert_eq!(waits.ahead(EndpointId(3)), 0);
        waits.next_offer();
        waits.add(EndpointId(2));
        assert_eq!(
            (waits.ahead(EndpointId(1)), waits.ahead(EndpointId(2))),
            (0, 1),
            "a new offer counts its own"
        );
        assert_eq!(
            (
                waits.ahead_in_pass(EndpointId(1)),
                waits.ahead_in_pass(EndpointId(2))
            ),
            (2, 2),
            "the pass counts them all"
        );
    }
}
