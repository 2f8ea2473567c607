//! Affinity holds: requests that wait for a busy endpoint holding their
//! prompt or session, and their clocks (a hold's, a spill delay's), which
//! the offers of a dispatch pass ([`super::offers`]) start and read. See
//! the dispatcher's module docs for the rules.

use std::time::{Duration, Instant};

use super::offers::{May, Offered, BEHIND_HOLDS, HOME_SCAN};
use super::{Dispatcher, Done};
use crate::endpoint::EndpointId;
use crate::flow::Ticket;
use crate::placement::evening::{prompt_holder, QueuedWork};
use crate::placement::Waits;

/// Holds begun since the last [`Dispatcher::take_new_holds`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HoldsBegun {
    /// Requests that chose to wait for a busy endpoint that has their
    /// prompt or session (the wait-or-go rule): the affinity holds.
    pub held: u64,
    /// Hold clocks started, those and the requests passed over by
    /// requests at home on a free endpoint: the owner's timer must learn
    /// of them (a new one may end before the one it waits for).
    pub clocks: u64,
}

impl<T> Dispatcher<T> {
    /// The requests of priority `top` among the first [`BEHIND_HOLDS`] of
    /// each flow, at most [`HOME_SCAN`] of them, by the endpoint each waits
    /// for: the one it was held for, or the one holding most of its prompt
    /// (none: unplaced).
    pub(super) fn queued_work(&mut self, top: i32, now: Instant) -> QueuedWork {
        let mut work = QueuedWork::default();
        let mut looked = 0;
        let ledger = &self.ledger;
        self.queues.peek_where(BEHIND_HOLDS, |_, w| {
            if w.priority >= top {
                match w.held.or_else(|| prompt_holder(ledger, &w.route, now)) {
                    Some(e) => work.by_endpoint.add(e),
                    None => work.unplaced += 1,
                }
            }
            looked += 1;
            // Counted, not taken: every one is looked at, up to the bound.
            looked == HOME_SCAN
        });
        work
    }

    /// The earliest of `waiting` (requests waiting for a busy endpoint's
    /// cache) whose tenant `ahead` would pass by more than fairness allows
    /// ([`crate::flow::FlowQueues::passing_is_unfair`]): it should take the
    /// free slot instead.
    pub(super) fn unfairly_passed(
        &self,
        waiting: impl Iterator<Item = Ticket>,
        ahead: Ticket,
    ) -> Option<Ticket> {
        waiting
            .filter(|&slow| self.queues.passing_is_unfair(slow, ahead))
            .min_by_key(|t| t.seq())
    }

    /// Dispatches a request to whichever endpoint takes it now, without
    /// waiting for another; false when none can.
    pub(super) fn go_now(&mut self, ticket: Ticket, now: Instant, out: &mut Vec<Done<T>>) -> bool {
        let mut none = Waits::default();
        self.offer(ticket, May::Go, &mut none, now, out) == Offered::Granted
    }

    /// Starts the hold of a request passed over for the endpoint that has
    /// its prompt, unless it began before: it ends after
    /// `scheduling.affinity_hold` or half the time the request has left,
    /// whichever is first, so it still has time to be served elsewhere.
    /// `chose`: the request chose to wait (the wait-or-go rule), rather
    /// than was passed by requests at home on the free endpoint.
    pub(super) fn start_hold(&mut self, ticket: Ticket, now: Instant, chose: bool) {
        let hold = self.config.scheduling.affinity_hold;
        let Some(waiting) = self.queues.get_mut(ticket) else {
            return;
        };
        if waiting.hold_until.is_none() {
            let end = waiting.clock_end(now, hold);
            waiting.hold_until = Some(end);
            self.holds.insert((end, ticket.seq()), ticket);
            self.new_holds.clocks += 1;
        }
        if chose && !waiting.counted {
            waiting.counted = true;
            self.new_holds.held += 1;
        }
    }

    /// `ticket` is held for `endpoint` (the wait-or-go rule). The requests
    /// behind it in this pass wait behind it there: counted in `waits`.
    pub(super) fn held_for(&mut self, ticket: Ticket, endpoint: EndpointId, waits: &mut Waits) {
        let Some(waiting) = self.queues.get_mut(ticket) else {
            return;
        };
        waiting.held = Some(endpoint);
        waits.hold(ticket.seq(), endpoint);
    }

    /// Starts the spill clock of a request that would prefill cold what a
    /// busy endpoint holds, unless it began before: it may spill `after`
    /// from now, bounded as a hold is (the owner's timer runs the pass
    /// then).
    pub(super) fn start_spill_clock(&mut self, ticket: Ticket, after: Duration, now: Instant) {
        let hold = self.config.scheduling.affinity_hold;
        let Some(waiting) = self.queues.get_mut(ticket) else {
            return;
        };
        if waiting.spill_at.is_none() {
            let at = waiting.clock_end(now, after.min(hold));
            waiting.spill_at = Some(at);
            self.holds.insert((at, ticket.seq()), ticket);
            self.new_holds.clocks += 1;
        }
    }

    /// When the earliest affinity hold of a waiting request ends: run
    /// [`Dispatcher::dispatch`] then.
    pub fn next_hold_end(&mut self) -> Option<Instant> {
        while let Some(entry) = self.holds.first_entry() {
            if self.queues.get(*entry.get()).is_some() {
                return Some(entry.key().0);
            }
            entry.remove();
        }
        None
    }

    /// The holds begun since the last call.
    pub fn take_new_holds(&mut self) -> HoldsBegun {
        std::mem::take(&mut self.new_holds)
    }
}

#[cfg(test)]
impl<T> Dispatcher<T> {
    /// Whether a queued request is in an affinity hold, or waits out its
    /// spill delay, now.
    pub(crate) fn in_hold(&self, ticket: Ticket, now: Instant) -> bool {
        self.queues.get(ticket).is_some_and(|w| {
            [w.hold_until, w.spill_at]
                .into_iter()
                .flatten()
                .any(|end| now < end)
        })
    }
}
