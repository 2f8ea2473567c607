//! Requests queued for their session's endpoint take its freed slots in
//! arrival order.
//!
//! At saturation a server's conversations wait in the queues, each turn
//! for the server its conversation is on ([`crate::placement::queued_for`]).
//! The engine's own queue would serve them first come, first served, so
//! each turn waits for the same number of turns before it; offered in the
//! queues' fair order instead, some wait a round longer than others, and
//! that round is the time to first token's tail. So a freed slot goes to
//! the oldest request of the highest waiting priority queued for that
//! endpoint, unless that would pass the request next in fair order
//! unfairly: one that came first and may go anywhere (no session to wait
//! for), or by more than token fairness allows
//! ([`crate::flow::FlowQueues::passing_is_unfair`]); then the queues' order
//! decides, as for every other request.

use std::time::Instant;

use super::offers::{May, Offered};
use super::{Dispatcher, Done};
use crate::flow::Ticket;
use crate::placement::{self, Waits};

/// Requests looked at per endpoint for one of the highest priority: a
/// bound on a pass's cost (an endpoint's queue is served in arrival order;
/// one of a lower priority among its first 16 is passed, the rest wait for
/// a later pass, when the ones ahead of them went).
const SCAN: usize = 16;

impl<T> Dispatcher<T> {
    /// Offer 1 (module docs).
    pub(super) fn offer_homed(&mut self, now: Instant, out: &mut Vec<Done<T>>) {
        if self.homed.is_empty() {
            return;
        }
        for id in self.ledger.available_ids(now) {
            loop {
                let Some(top) = self.queues.top_priority() else {
                    return;
                };
                let oldest = self
                    .homed
                    .range((id, 0)..=(id, u64::MAX))
                    .take(SCAN)
                    .map(|(_, &ticket)| ticket)
                    .find(|&ticket| {
                        self.queues.get(ticket).is_some_and(|w| {
                            w.priority >= top
                                && placement::takes_at_home(&self.ledger, id, &w.route, now)
                        })
                    });
                let Some(ticket) = oldest else { break };
                if self.passes_unfairly(ticket) {
                    return;
                }
                let mut none = Waits::default();
                if self.offer(ticket, May::Go, &mut none, now, out) != Offered::Granted {
                    break;
                }
            }
        }
    }

    /// Whether dispatching `ticket` now would pass the request next in the
    /// queues' fair order unfairly: one that may go anywhere and came
    /// first (a request of no session, or a conversation's first turn sent
    /// without a key, would wait behind every conversation's turns), or by
    /// more than token fairness allows.
    fn passes_unfairly(&mut self, ticket: Ticket) -> bool {
        let Some(next) = self.queues.peek().filter(|&next| next != ticket) else {
            return false;
        };
        let older_and_free =
            next.seq() < ticket.seq() && self.queues.get(next).is_some_and(|w| w.home.is_none());
        older_and_free || self.queues.passing_is_unfair(next, ticket)
    }
}
