//! One dispatch pass. Expired requests are answered first; then the free
//! slots are offered to the queued requests in a fixed order of offers,
//! each a rule of its own, stated once:
//!
//! 1. **Held** ([`super::holds`]): requests waiting for a busy endpoint
//!    (its cache or session, stage 3 of [`crate::placement`]) to that
//!    endpoint once it frees a slot; one whose spill delay is over
//!    elsewhere, where that evens out the load.
//! 2. **At home** ([`super::holds`]), while some request waits for another
//!    endpoint: requests at home on a free endpoint (nothing would serve
//!    them better by their cache) before requests that would prefill their
//!    prompt there cold.
//! 3. **Fair order** (this file): every request in the queues' order
//!    (strict priority, tenant fairness, the band's ordering), looking a
//!    few requests deep into each flow past the ones that wait for a busy
//!    endpoint ([`LOOK_AHEAD`], [`BEHIND_HOLDS`]); a route no endpoint
//!    takes stops the requests with the same targets, a held request stops
//!    lower priorities, and a request passed by a tenant too far ahead of
//!    its own takes the slot instead.
//!
//! Whatever the offer, a request is placed one way ([`Dispatcher::offer`]):
//! placement decides, and the outcome is booked here once.

use std::collections::HashSet;
use std::time::Instant;

use super::{done, Dispatcher, Done, Reject};
use crate::endpoint::Route;
use crate::flow::Ticket;
use crate::placement::{self, Pass, Pick, Waits};

/// How many requests of each flow a dispatch pass looks at when the ones
/// ahead of them cannot go now (held for affinity, or their route is busy).
/// Deeper lets more of a tenant's requests pass its held ones, which costs
/// the other tenants their fair share (16 did, in the scheduling bench).
pub(super) const LOOK_AHEAD: usize = 4;

/// Affinity holds per dispatch pass, which bounds its cost; past it,
/// requests go where there is room.
pub(super) const MAX_HOLDS_PER_PASS: usize = 32;

/// How many requests of each flow a pass looks at once the first
/// [`LOOK_AHEAD`] of every flow found no request to take a free slot (all
/// held for a busy endpoint, or busy): past every request a pass may hold,
/// so a slot no request looked at wants does not idle while a request
/// behind them would take it. Only then: a tenant's requests pass its
/// held ones no further while others could go.
pub(super) const BEHIND_HOLDS: usize = LOOK_AHEAD + MAX_HOLDS_PER_PASS;

/// The offers of a dispatch pass (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Offer {
    Held,
    AtHome,
    FairOrder,
}

/// Their order: the requests that chose to wait, then those at home, then
/// everyone in turn. (A fourth offer, a server's own conversations first
/// in arrival order, earned no place: BENCHMARKS.md, session 32.)
const OFFERS: [Offer; 3] = [Offer::Held, Offer::AtHome, Offer::FairOrder];

/// How a request offered the free slots may be placed.
#[derive(Debug, Clone, Copy)]
pub(super) enum May {
    /// Go to whichever endpoint takes it now.
    Go,
    /// Go, or wait for a busy endpoint predicted sooner (placement's
    /// stage 3); `spill`: its spill delay is over.
    Wait { spill: bool },
}

/// What became of a request offered the free slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Offered {
    /// It took a slot and left the queues.
    Granted,
    /// It waits for a busy endpoint (for its cache, or out its spill
    /// delay beside it).
    Held,
    /// No endpoint takes it now.
    Busy,
}

impl<T> Dispatcher<T> {
    /// Ends waits: answers evicted and expired requests, then offers the
    /// free slots to the queued requests, offer by offer (module docs),
    /// while any endpoint takes work. The caller wakes each waiter; if a
    /// granted waiter is gone, it releases the lease.
    pub fn dispatch(&mut self, now: Instant) -> Vec<Done<T>> {
        let mut out = std::mem::take(&mut self.evicted);
        for r in self.queues.expire(now) {
            out.push(done(r, Err(Reject::Timeout), now));
        }
        // Holds that end now are over: this pass places those requests.
        while let Some(entry) = self.holds.first_entry() {
            if entry.key().0 > now {
                break;
            }
            entry.remove();
        }
        for offer in OFFERS {
            match offer {
                Offer::Held => self.offer_held(now, &mut out),
                Offer::AtHome => self.offer_at_home(now, &mut out),
                Offer::FairOrder => self.offer_in_fair_order(now, &mut out),
            }
        }
        out
    }

    /// Offers the free slots to `ticket` as `may` allows, and books what
    /// placement decided: granted, it leaves the queues with its lease;
    /// held for a busy endpoint (or waiting out its spill delay beside
    /// one), its clock starts and the requests offered after it in this
    /// offer wait behind it there (`waits`).
    pub(super) fn offer(
        &mut self,
        ticket: Ticket,
        may: May,
        waits: &mut Waits,
        now: Instant,
        out: &mut Vec<Done<T>>,
    ) -> Offered {
        let Some(waiting) = self.queues.get(ticket) else {
            return Offered::Busy;
        };
        let pass = match may {
            May::Go => None,
            May::Wait { spill } => Some(Pass {
                waits: &*waits,
                may_spill: spill,
            }),
        };
        match placement::pick(&mut self.ledger, &waiting.route, now, pass) {
            Pick::Lease(lease) => {
                self.grant(ticket, lease, now, out);
                Offered::Granted
            }
            Pick::Hold(endpoint) => {
                self.start_hold(ticket, now, true);
                self.held_for(ticket, endpoint, waits);
                Offered::Held
            }
            Pick::Delay(after, holder) => {
                self.start_spill_clock(ticket, after, now);
                self.held_for(ticket, holder, waits);
                Offered::Held
            }
            Pick::Busy => Offered::Busy,
        }
    }

    /// Offer 4: every request in the queues' fair order (module docs).
    fn offer_in_fair_order(&mut self, now: Instant, out: &mut Vec<Done<T>>) {
        let hold = self.config.scheduling.affinity_hold;
        // Routes that found no endpoint in this pass: every later request
        // with the same targets waits too (same model, exclusion, subset).
        let mut stuck: Vec<Route> = Vec::new();
        // Requests waiting for the endpoint that caches their prompt: the
        // requests behind them in their flows may pass them, lower
        // priorities may not (`floor`).
        let mut held: HashSet<Ticket> = HashSet::new();
        let mut floor = i32::MIN;
        // Requests held for each endpoint in this pass: the next one held
        // for it waits behind them.
        let mut waits = Waits::default();
        let mut depth = LOOK_AHEAD;
        loop {
            let next = if stuck.is_empty() && held.is_empty() {
                self.queues.peek()
            } else {
                self.queues.peek_where(depth, |ticket, w| {
                    w.priority >= floor
                        && !held.contains(&ticket)
                        && !stuck.iter().any(|r| r.same_targets(&w.route))
                })
            };
            let Some(ticket) = next else {
                // Every request looked at waits for another endpoint, yet
                // a slot is free: one behind them takes it rather than
                // let it idle (no request looked at wants it).
                if depth == LOOK_AHEAD && !held.is_empty() && self.ledger.any_available(now) {
                    depth = BEHIND_HOLDS;
                    continue;
                }
                break;
            };
            if !held.is_empty() {
                if let Some(slow) = self.unfairly_passed(held.iter().copied(), ticket) {
                    held.remove(&slow);
                    if self.go_now(slow, now, out) {
                        continue;
                    }
                    held.insert(slow);
                }
            }
            let waiting = self.queues.get(ticket).expect("peeked request is queued");
            // A hard session waits for its endpoint until its TTL, however
            // many others are held.
            let may_hold = self.hard_session(&waiting.route)
                || (!hold.is_zero()
                    && waiting.hold_until.is_none_or(|end| now < end)
                    && held.len() < MAX_HOLDS_PER_PASS);
            let may = if may_hold {
                May::Wait {
                    spill: waiting.spill_at.is_some_and(|at| at <= now),
                }
            } else {
                May::Go
            };
            let priority = waiting.priority;
            match self.offer(ticket, may, &mut waits, now, out) {
                Offered::Granted => {}
                Offered::Held => {
                    floor = floor.max(priority);
                    held.insert(ticket);
                }
                Offered::Busy => {
                    // Nothing free at all: no other request can go either.
                    if !self.ledger.any_available(now) {
                        break;
                    }
                    let waiting = self.queues.get(ticket).expect("a busy request is queued");
                    stuck.push(waiting.route.targets());
                }
            }
        }
    }
}
