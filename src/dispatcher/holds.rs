//! Affinity holds: requests that wait for a busy endpoint holding their
//! prompt or session, their clocks, and the order in which a freed slot is
//! offered (held requests first, then requests at home there). See the
//! dispatcher's module docs for the rules.

use std::time::{Duration, Instant};

use super::offers::{May, Offered, BEHIND_HOLDS, LOOK_AHEAD, MAX_HOLDS_PER_PASS};
use super::{Dispatcher, Done};
use crate::endpoint::{EndpointId, Route};
use crate::flow::Ticket;
use crate::placement::evening::{prompt_holder, spill_evens_out, QueuedWork};
use crate::placement::{self, Home, Waits};

/// Queued requests a dispatch pass asks where they are at home, or which
/// endpoint they wait for, at most, in each of its steps that do
/// ([`Dispatcher::offer_at_home`], [`Dispatcher::queued_work`]): as many
/// as a pass may hold, from the queues' head, where the slots that free
/// soon go. Each question is a placement
/// query; unbounded, with 1,000 tenants 10,000 requests deep, a pass
/// asked up to 36,000 (2.7 ms a request at 1,000 endpoints,
/// `benches/scale.rs`). The slots this step leaves go in the queues'
/// order.
const HOME_SCAN: usize = MAX_HOLDS_PER_PASS;

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
    /// Offer 2: held requests go first to the endpoint they wait for: when
    /// it frees a slot, the held request takes it rather than the request
    /// next in turn, which would prefill its prompt there cold while the
    /// held one waits on for another slot. Only held requests of the
    /// highest waiting priority go ahead this way, the nearest to the end
    /// of its hold first.
    pub(super) fn offer_held(&mut self, now: Instant, out: &mut Vec<Done<T>>) {
        let Some(top) = self.queues.top_priority() else {
            return;
        };
        // Entries of requests that left are skipped (and dropped later by
        // `next_hold_end`); tickets are never reused.
        // A request may have two clocks (its hold's and its spill delay's):
        // it is offered once.
        let mut held: Vec<Ticket> = Vec::new();
        for &ticket in self.holds.values() {
            if held.len() == MAX_HOLDS_PER_PASS {
                break;
            }
            if !held.contains(&ticket) {
                held.push(ticket);
            }
        }
        let mut waits = Waits::default();
        let mut queued: Option<QueuedWork> = None;
        for ticket in held {
            let Some(waiting) = self.queues.get(ticket) else {
                continue;
            };
            if waiting.priority < top {
                continue;
            }
            if !self.ledger.any_available(now) {
                return;
            }
            // A held request that would now spill (prefill cold what the
            // endpoint it waited for holds) goes once its spill delay is
            // over, before the requests waiting for the free endpoint only
            // where that evens out the work
            // ([`crate::placement::evening`]).
            let spill_over = waiting.spill_at.is_some_and(|at| at <= now);
            let may_spill = spill_over
                && waiting.held.is_none_or(|holder| {
                    let queued = queued.get_or_insert_with(|| self.queued_work(top, now));
                    let route = &self.queues.get(ticket).expect("offered just above").route;
                    spill_evens_out(&self.ledger, route, holder, queued, now)
                });
            let may = May::Wait { spill: may_spill };
            self.offer(ticket, may, &mut waits, now, out);
        }
    }

    /// The requests of priority `top` among the first [`BEHIND_HOLDS`] of
    /// each flow, at most [`HOME_SCAN`] of them, by the endpoint each waits
    /// for: the one it was held for, or the one holding most of its prompt
    /// (none: unplaced).
    fn queued_work(&mut self, top: i32, now: Instant) -> QueuedWork {
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

    /// Offer 3: requests at home on a free endpoint (no busy one holds more
    /// of their prompt; their session's endpoint takes them) take its slots
    /// before
    /// the others of the highest waiting priority: the request next in
    /// turn may be cached elsewhere, and would take the slot to prefill its
    /// prompt there cold while they wait on (at saturation, the requests
    /// of a server's own conversations wait in the queue, not held: no slot
    /// was free when they came), once some request waits for another
    /// endpoint. A request passed this way starts its hold
    /// clock: once its hold is over it is passed no more and takes the next
    /// free slot. A request no endpoint can take is passed by none of the
    /// same targets, as in the main pass.
    pub(super) fn offer_at_home(&mut self, now: Instant, out: &mut Vec<Done<T>>) {
        if self.config.scheduling.affinity_hold.is_zero() {
            return;
        }
        // Only while some request waits for another endpoint (held, or
        // passed over before): then the request next in turn may well be
        // cached elsewhere. With none, the queue's own order stands, at no
        // cost to a fleet without prefix affinity.
        if self.holds.is_empty() {
            return;
        }
        let Some(top) = self.queues.top_priority() else {
            return;
        };
        let hard = self.config.scheduling.sessions.hard;
        let mut passed: Vec<(Ticket, bool)> = Vec::new();
        let mut depth = LOOK_AHEAD;
        let mut looks_left = HOME_SCAN;
        while self.ledger.any_available(now) {
            let ledger = &self.ledger;
            let mut stuck: Vec<Route> = Vec::new();
            let mut out_of_looks = false;
            let next = self.queues.peek_where(depth, |ticket, w| {
                // Stops the scan; the request is not taken.
                if looks_left == 0 {
                    out_of_looks = true;
                    return true;
                }
                looks_left -= 1;
                if w.priority < top || stuck.iter().any(|r| r.same_targets(&w.route)) {
                    return false;
                }
                match placement::at_home(ledger, &w.route, now) {
                    Home::Yes => true,
                    Home::Elsewhere { waits } => {
                        let over = w.hold_until.is_some_and(|end| end <= now);
                        if over && !w.route.waits_hard(hard) {
                            return true;
                        }
                        passed.push((ticket, waits));
                        false
                    }
                    Home::Busy => {
                        stuck.push(w.route.targets());
                        false
                    }
                }
            });
            // The slots left go in the queues' order, in the main pass.
            if out_of_looks {
                break;
            }
            let Some(ticket) = next else {
                // None of the first few of any flow is at home on a free
                // endpoint: one behind them may be (a burst's other
                // groups, behind one group's turns held for their cache).
                if depth == LOOK_AHEAD {
                    depth = BEHIND_HOLDS;
                    continue;
                }
                break;
            };
            // A request passed over by one from a tenant too far ahead of
            // its own takes the slot instead (to prefill elsewhere).
            if let Some(slow) = self.unfairly_passed(passed.iter().map(|&(t, _)| t), ticket) {
                if self.go_now(slow, now, out) {
                    passed.retain(|&(t, _)| t != slow);
                    continue;
                }
            }
            if !self.go_now(ticket, now, out) {
                break;
            }
        }
        for (ticket, chose) in passed {
            self.start_hold(ticket, now, chose);
        }
    }

    /// `ticket` is held for `endpoint` (the wait-or-go rule). The requests
    /// behind it in this pass wait behind it there: counted in `waits`.
    pub(super) fn held_for(&mut self, ticket: Ticket, endpoint: EndpointId, waits: &mut Waits) {
        let Some(waiting) = self.queues.get_mut(ticket) else {
            return;
        };
        waiting.held = Some(endpoint);
        waits.add(endpoint);
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
