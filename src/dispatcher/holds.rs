//! Affinity holds: requests that wait for a busy endpoint holding their
//! prompt or session, their clocks, and the order in which a freed slot is
//! offered (held requests first, then requests at home there). See the
//! dispatcher's module docs for the rules.

use std::time::Instant;

use super::{Dispatcher, Done, LOOK_AHEAD, MAX_HOLDS_PER_PASS};
use crate::endpoint::{Home, Pick, Route, Waits};
use crate::flow::Ticket;

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
    /// Held requests go first to the endpoint they wait for: when it frees
    /// a slot, the held request takes it rather than the request next in
    /// turn, which would prefill its prompt there cold while the held one
    /// waits on for another slot. Only held requests of the highest waiting
    /// priority go ahead this way, the nearest to the end of its hold
    /// first.
    pub(super) fn place_held(&mut self, now: Instant, out: &mut Vec<Done<T>>) {
        let Some(top) = self.queues.top_priority() else {
            return;
        };
        // Entries of requests that left are skipped (and dropped later by
        // `next_hold_end`); tickets are never reused.
        let held: Vec<Ticket> = self
            .holds
            .values()
            .take(MAX_HOLDS_PER_PASS)
            .copied()
            .collect();
        let mut waits = Waits::default();
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
            match self.ledger.pick(&waiting.route, now, Some(&waits)) {
                Pick::Lease(lease) => {
                    self.grant(ticket, lease, now, out);
                }
                Pick::Hold(endpoint) => waits.add(endpoint),
                Pick::Busy => {}
            }
        }
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
            let end = now + hold.min(waiting.deadline.saturating_duration_since(now) / 2);
            waiting.hold_until = Some(end);
            self.holds.insert((end, ticket.seq()), ticket);
            self.new_holds.clocks += 1;
        }
        if chose && !waiting.counted {
            waiting.counted = true;
            self.new_holds.held += 1;
        }
    }

    /// Requests at home on a free endpoint (no busy one holds more of their
    /// prompt; their session's endpoint takes them) take its slots before
    /// the others of the highest waiting priority: the request next in
    /// turn may be cached elsewhere, and would take the slot to prefill its
    /// prompt there cold while they wait on (at saturation, the requests
    /// of a server's own conversations wait in the queue, not held: no slot
    /// was free when they came), once some request waits for another
    /// endpoint. A request passed this way starts its hold
    /// clock: once its hold is over it is passed no more and takes the next
    /// free slot. A request no endpoint can take is passed by none of the
    /// same targets, as in the main pass.
    pub(super) fn place_at_home(&mut self, now: Instant, out: &mut Vec<Done<T>>) {
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
        while self.ledger.any_available(now) {
            let ledger = &self.ledger;
            let mut stuck: Vec<Route> = Vec::new();
            let next = self.queues.peek_where(LOOK_AHEAD, |ticket, w| {
                if w.priority < top || stuck.iter().any(|r| r.same_targets(&w.route)) {
                    return false;
                }
                match ledger.at_home(&w.route, now) {
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
            let Some(ticket) = next else { break };
            // A request passed over by one from a tenant too far ahead of
            // its own takes the slot instead (to prefill elsewhere).
            if let Some(slow) = self.unfairly_passed(passed.iter().map(|&(t, _)| t), ticket) {
                if self.go_now(slow, now, out) {
                    passed.retain(|&(t, _)| t != slow);
                    continue;
                }
            }
            let waiting = self.queues.get(ticket).expect("peeked request is queued");
            let Pick::Lease(lease) = self.ledger.pick(&waiting.route, now, None) else {
                break;
            };
            self.grant(ticket, lease, now, out);
        }
        for (ticket, chose) in passed {
            self.start_hold(ticket, now, chose);
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
    /// Whether a queued request is in an affinity hold now.
    pub(crate) fn in_hold(&self, ticket: Ticket, now: Instant) -> bool {
        self.queues
            .get(ticket)
            .and_then(|w| w.hold_until)
            .is_some_and(|end| now < end)
    }
}
