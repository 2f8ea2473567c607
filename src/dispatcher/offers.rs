//! One dispatch pass. Expired requests are answered first; then the free
//! slots are offered to the queued requests in a fixed order of offers,
//! each a rule of its own, stated once in this file:
//!
//! 1. **Held** ([`Dispatcher::next_held`]): requests waiting for a busy
//!    endpoint (its cache or session, stage 3 of [`crate::placement`]) to
//!    that endpoint once it frees a slot; one whose spill delay is over
//!    elsewhere, where that evens out the load.
//! 2. **At home** ([`Dispatcher::next_at_home`]), while some request waits
//!    for another endpoint: requests at home on a free endpoint (nothing
//!    would serve them better by their cache) before requests that would
//!    prefill their prompt there cold; of the turns of sessions, the one
//!    that came first unless that passes a tenant behind unfairly.
//!
//! So an endpoint serves its conversations' turns in the order they came:
//! taken in the queues' order (flow by flow, a few deep in each), a turn
//! that came later often went first and the server's waits spread (issue
//! 34's workload: about 1,300 such passes in 22 s where first come first
//! served had none, TTFT p99 ×1.2; BENCHMARKS.md, session 41). Requests
//! without a session keep the queues' order: taken first come first
//! served, their conversations moved more often and lost hits.
//! 3. **Fair order** ([`Dispatcher::next_in_fair_order`]): every request in
//!    the queues' order (strict priority, tenant fairness, the band's
//!    ordering), looking a few requests deep into each flow past the ones
//!    that wait for a busy endpoint ([`LOOK_AHEAD`], [`BEHIND_HOLDS`]); a
//!    route no endpoint takes stops the requests with the same targets, and
//!    a held request stops lower priorities.
//!
//! Each rule earns its place: without the held offer's evening out, the
//! spill delay or the look [`BEHIND_HOLDS`], the controlled-clock
//! conversation and burst tests fail (BENCHMARKS.md, session 33); without
//! the at-home offer the sessions bench's p99 rose ×1.02–1.26 (session 32).
//!
//! One loop runs every offer ([`Dispatcher::run`]), while an endpoint is
//! free: the offer names the next request it offers the slots to and how
//! that one may be placed; a request the offer passed over earlier in its
//! round (held for a busy endpoint, or passed by one at home) whose tenant
//! that next request's would pass by more than fairness allows
//! ([`crate::flow::FlowQueues::passing_is_unfair`]) takes a slot first;
//! the request is placed one way ([`Dispatcher::offer`]: placement decides,
//! and the outcome is booked here once), and the offer notes what became
//! of it.

use std::collections::HashMap;
use std::time::Instant;

use super::{done, Dispatcher, Done, Reject};
use crate::endpoint::Route;
use crate::flow::Ticket;
use crate::placement::evening::{spill_evens_out, QueuedWork};
use crate::placement::{self, Home, Pass, Pick, Waits};

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

/// Queued requests the at-home offer asks where they are at home, at most,
/// in a pass (and [`Dispatcher::queued_work`] which endpoint they wait
/// for): as many as a pass may hold, from the queues' head, where the
/// slots that free soon go. Each question is a placement query;
/// unbounded, with 1,000 tenants 10,000 requests deep, a pass asked up to
/// 36,000 (2.7 ms a request at 1,000 endpoints, `benches/scale.rs`). The
/// slots this offer leaves go in the queues' order.
pub(super) const HOME_SCAN: usize = MAX_HOLDS_PER_PASS;

/// How many of a waiting request's own requests a turn that came before
/// it may put its tenant ahead when the at-home offer serves turns first
/// come first served ([`Dispatcher::earliest_fairly`]): well inside the
/// fairness bound, so that bound seldom forces a waiting turn off its
/// cache (at the bound itself, 8, issue 34's workload moved 21 to 53
/// conversations in 30 s and lost 0.6 % of its hits; BENCHMARKS.md,
/// session 41).
const FIRST_COME_LEAD: u64 = 2;

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
    /// It was refused: sheddable, its objective out of reach.
    Refused,
}

/// An offer's state through one dispatch pass: its round.
struct Round {
    offer: Offer,
    /// The highest priority waiting when the round began.
    top: i32,
    /// Requests the round passed over: held for a busy endpoint (fair
    /// order), or passed by requests at home (their hold clocks start when
    /// the round ends; `true`: the wait-or-go rule has them wait).
    passed: HashMap<Ticket, bool>,
    /// Routes no endpoint takes: a later request with the same targets
    /// (model, exclusion, subset) is not offered.
    stuck: Vec<Route>,
    /// No request below this priority goes: one of it is held (fair order).
    floor: i32,
    /// How deep into each flow the round looks.
    depth: usize,
    /// The held requests left to offer, in the order their clocks end.
    held: std::vec::IntoIter<Ticket>,
    /// What waits for each endpoint, counted once, when first asked.
    queued: Option<QueuedWork>,
    /// How many more queued requests the at-home offer may ask.
    looks_left: usize,
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
        // Requests held for each endpoint so far in the pass ([`Waits`]):
        // the next one held for it waits behind them.
        let mut waits = Waits::default();
        for offer in OFFERS {
            self.run(offer, &mut waits, now, &mut out);
        }
        out
    }

    /// Runs one offer's round (module docs): the one loop of a pass.
    fn run(&mut self, offer: Offer, waits: &mut Waits, now: Instant, out: &mut Vec<Done<T>>) {
        let Some(mut round) = self.open(offer) else {
            return;
        };
        // Each offer stops when nothing is free ([`Dispatcher::next_offered`]).
        while let Some((ticket, may)) = self.next_offered(&mut round, now) {
            if let Some(slow) = self.unfairly_passed(round.passed.keys().copied(), ticket) {
                let chose = round.passed.remove(&slow).unwrap_or_default();
                if self.go_now(slow, now, out) {
                    continue;
                }
                round.passed.insert(slow, chose);
            }
            let offered = self.offer(ticket, may, waits, now, out);
            if !self.note(&mut round, ticket, offered, now) {
                break;
            }
        }
        if offer == Offer::AtHome {
            for (ticket, chose) in round.passed {
                self.start_hold(ticket, now, chose);
            }
        }
    }

    /// Opens an offer's round; `None` when it has nothing to offer.
    fn open(&self, offer: Offer) -> Option<Round> {
        let top = self.queues.top_priority()?;
        let mut held = Vec::new();
        match offer {
            Offer::Held => {
                // A request may have two clocks (its hold's and its spill
                // delay's): it is offered once. Entries of requests that
                // left are skipped (and dropped by `next_hold_end`).
                for &ticket in self.holds.values() {
                    if held.len() == MAX_HOLDS_PER_PASS {
                        break;
                    }
                    if !held.contains(&ticket) {
                        held.push(ticket);
                    }
                }
                if held.is_empty() {
                    return None;
                }
            }
            // Only while some request waits for another endpoint (held, or
            // passed over before): then the request next in turn may well
            // be cached elsewhere. With none, the queues' own order stands,
            // at no cost to a fleet without prefix affinity.
            Offer::AtHome => {
                if self.config.scheduling.affinity_hold.is_zero() || self.holds.is_empty() {
                    return None;
                }
            }
            Offer::FairOrder => {}
        }
        Some(Round {
            offer,
            top,
            passed: HashMap::new(),
            stuck: Vec::new(),
            floor: i32::MIN,
            depth: LOOK_AHEAD,
            held: held.into_iter(),
            queued: None,
            looks_left: HOME_SCAN,
        })
    }

    /// The next request the round's offer offers the free slots to, and
    /// how it may be placed; none once no endpoint is free (the fair order
    /// finds that out from a busy request, [`Dispatcher::note`]: most of
    /// its passes place a request or two, and the check costs a look at
    /// the fleet).
    fn next_offered(&mut self, round: &mut Round, now: Instant) -> Option<(Ticket, May)> {
        match round.offer {
            Offer::Held => self.next_held(round, now),
            Offer::AtHome if self.ledger.any_available(now) => {
                self.next_at_home(round, now).map(|t| (t, May::Go))
            }
            Offer::AtHome => None,
            Offer::FairOrder => self.next_in_fair_order(round, now),
        }
    }

    /// Notes what became of a request the round offered the slots to;
    /// false: the round is over.
    fn note(&self, round: &mut Round, ticket: Ticket, offered: Offered, now: Instant) -> bool {
        match (round.offer, offered) {
            (Offer::Held, _) | (_, Offered::Granted | Offered::Refused) => true,
            // No request at home goes where the one at home could not.
            (Offer::AtHome, _) => false,
            (Offer::FairOrder, Offered::Held) => {
                let waiting = self.queues.get(ticket).expect("a held request is queued");
                round.floor = round.floor.max(waiting.priority);
                round.passed.insert(ticket, true);
                true
            }
            (Offer::FairOrder, Offered::Busy) => {
                // Nothing free at all: no other request can go either.
                if !self.ledger.any_available(now) {
                    return false;
                }
                let waiting = self.queues.get(ticket).expect("a busy request is queued");
                round.stuck.push(waiting.route.targets());
                true
            }
        }
    }

    /// Offer 1, held: the next held request of the top priority, the
    /// nearest to the end of its clock first. When the endpoint it waits
    /// for frees a slot it takes it rather than the request next in turn,
    /// which would prefill its prompt there cold while the held one waits
    /// on for another slot. One whose spill delay is over may go elsewhere
    /// ahead of the requests waiting for the free endpoint only where that
    /// evens out the work ([`crate::placement::evening`]).
    fn next_held(&mut self, round: &mut Round, now: Instant) -> Option<(Ticket, May)> {
        while let Some(ticket) = round.held.next() {
            let Some(waiting) = self.queues.get(ticket) else {
                continue;
            };
            if waiting.priority < round.top {
                continue;
            }
            if !self.ledger.any_available(now) {
                return None;
            }
            let waiting = self.queues.get(ticket).expect("looked at just above");
            let spill_over = waiting.spill_at.is_some_and(|at| at <= now);
            let holder = waiting.held;
            let may_spill = spill_over
                && holder.is_none_or(|holder| {
                    let top = round.top;
                    let queued = round
                        .queued
                        .get_or_insert_with(|| self.queued_work(top, now));
                    let route = &self.queues.get(ticket).expect("looked at just above").route;
                    spill_evens_out(&self.ledger, route, holder, queued, now)
                });
            return Some((ticket, May::Wait { spill: may_spill }));
        }
        None
    }

    /// Offer 2, at home (while some request waits for another endpoint):
    /// the first request of the top priority, in the queues' order, at
    /// home on a free endpoint (no busy one holds more of its prompt; its
    /// session's endpoint takes it) — where that is a turn of a session,
    /// the first to arrive of such turns among the first [`HOME_SCAN`]
    /// ([`Dispatcher::earliest_fairly`]). The request next in turn may be
    /// cached elsewhere, and would take the slot to prefill its prompt
    /// there cold while they wait on (at saturation a server's own
    /// conversations wait in the queue, not held: no slot was free when
    /// they came). The requests it passes start their hold clocks: once a
    /// hold is over the request is passed no more and takes the next free
    /// slot.
    fn next_at_home(&mut self, round: &mut Round, now: Instant) -> Option<Ticket> {
        let hard = self.config.scheduling.sessions.hard;
        loop {
            let ledger = &self.ledger;
            let Round {
                top,
                stuck,
                looks_left,
                ..
            } = round;
            let mut out_of_looks = false;
            // The requests at home on a free endpoint among those looked
            // at, in the queues' order; and those at home elsewhere.
            let mut at_home: Vec<Ticket> = Vec::new();
            let mut elsewhere: Vec<(Ticket, bool)> = Vec::new();
            // A request the scan stops at to take it (or, out of looks,
            // not to).
            let taken = self.queues.peek_where(round.depth, |ticket, w| {
                // Stops the scan; the request is not taken.
                if *looks_left == 0 {
                    out_of_looks = true;
                    return true;
                }
                *looks_left -= 1;
                if w.priority < *top || stuck.iter().any(|r| r.same_targets(&w.route)) {
                    return false;
                }
                match placement::at_home(ledger, &w.route, now) {
                    // A turn of a session: the earliest of them goes.
                    Home::Yes if w.route.session.is_some() => {
                        at_home.push(ticket);
                        false
                    }
                    // A request without one, first in turn: it goes (the
                    // queues' order; taken so, keyless conversations kept
                    // their hits, BENCHMARKS.md session 41).
                    Home::Yes => at_home.is_empty(),
                    Home::Elsewhere { waits } => {
                        let over = w.hold_until.is_some_and(|end| end <= now);
                        if over && !w.route.waits_hard(hard) {
                            return true;
                        }
                        elsewhere.push((ticket, waits));
                        false
                    }
                    Home::Busy => {
                        stuck.push(w.route.targets());
                        false
                    }
                }
            });
            // The scan stopped at the one that goes: it passed every one
            // looked at; else the earliest turn passes those before it.
            let (next, stopped) = match taken.filter(|_| !out_of_looks) {
                Some(ticket) => (Some(ticket), true),
                None => (
                    self.earliest_fairly(&at_home, &elsewhere, &round.passed),
                    false,
                ),
            };
            for &(ticket, waits) in &elsewhere {
                if stopped || next.is_none_or(|n| ticket.seq() < n.seq()) {
                    *round.passed.entry(ticket).or_default() |= waits;
                }
            }
            // Out of looks: the slots left go in the queues' order, in
            // the fair order.
            if out_of_looks && next.is_none() {
                return None;
            }
            match next {
                Some(ticket) => return Some(ticket),
                // None of the first few of any flow is at home on a free
                // endpoint: one behind them may be (a burst's other
                // groups, behind one group's turns held for their cache).
                None if round.depth == LOOK_AHEAD => round.depth = BEHIND_HOLDS,
                None => return None,
            }
        }
    }

    /// Of the requests at home on a free endpoint (`at_home`, in the
    /// queues' order), the earliest to arrive whose going puts its tenant
    /// no more than [`FIRST_COME_LEAD`] requests ahead of any that came
    /// before it and waits (those `passed` earlier in the round and those
    /// at home `elsewhere`);
    /// else the first in the queues' order. An endpoint serves its
    /// conversations' turns in the order they came, within fairness.
    fn earliest_fairly(
        &self,
        at_home: &[Ticket],
        elsewhere: &[(Ticket, bool)],
        passed: &HashMap<Ticket, bool>,
    ) -> Option<Ticket> {
        let mut by_arrival = at_home.to_vec();
        by_arrival.sort_unstable_by_key(|t| t.seq());
        let before = |t: Ticket| {
            let earlier = move |p: &Ticket| p.seq() < t.seq();
            passed
                .keys()
                .copied()
                .filter(earlier)
                .chain(elsewhere.iter().map(|(p, _)| *p).filter(earlier))
        };
        let fair = |t: Ticket| {
            !before(t).any(|slow| self.queues.passing_is_unfair_by(slow, t, FIRST_COME_LEAD))
        };
        by_arrival
            .into_iter()
            .find(|&t| fair(t))
            .or_else(|| at_home.first().copied())
    }

    /// Offer 3, fair order: the next request in the queues' order (strict
    /// priority, tenant fairness, the band's ordering), looking past the
    /// ones held in this round ([`LOOK_AHEAD`], then [`BEHIND_HOLDS`]); a
    /// route no endpoint takes stops the requests with the same targets,
    /// and a held request stops lower priorities.
    fn next_in_fair_order(&mut self, round: &mut Round, now: Instant) -> Option<(Ticket, May)> {
        loop {
            let next = if round.stuck.is_empty() && round.passed.is_empty() {
                self.queues.peek()
            } else {
                let Round {
                    passed,
                    stuck,
                    floor,
                    ..
                } = &*round;
                self.queues.peek_where(round.depth, |ticket, w| {
                    w.priority >= *floor
                        && !passed.contains_key(&ticket)
                        && !stuck.iter().any(|r| r.same_targets(&w.route))
                })
            };
            let Some(ticket) = next else {
                // Every request looked at waits for another endpoint, yet
                // a slot is free: one behind them takes it rather than
                // let it idle (no request looked at wants it).
                if round.depth == LOOK_AHEAD
                    && !round.passed.is_empty()
                    && self.ledger.any_available(now)
                {
                    round.depth = BEHIND_HOLDS;
                    continue;
                }
                return None;
            };
            let waiting = self.queues.get(ticket).expect("peeked request is queued");
            // A hard session waits for its endpoint until its TTL, however
            // many others are held.
            let hold = self.config.scheduling.affinity_hold;
            let may_hold = self.hard_session(&waiting.route)
                || (!hold.is_zero()
                    && waiting.hold_until.is_none_or(|end| now < end)
                    && round.passed.len() < MAX_HOLDS_PER_PASS);
            let may = if may_hold {
                May::Wait {
                    spill: waiting.spill_at.is_some_and(|at| at <= now),
                }
            } else {
                May::Go
            };
            return Some((ticket, may));
        }
    }

    /// Offers the free slots to `ticket` as `may` allows, and books what
    /// placement decided: granted, it leaves the queues with its lease;
    /// held for a busy endpoint (or waiting out its spill delay beside
    /// one), its clock starts and the requests offered after it in this
    /// pass wait behind it there (`waits`).
    pub(super) fn offer(
        &mut self,
        ticket: Ticket,
        may: May,
        waits: &mut Waits,
        now: Instant,
        out: &mut Vec<Done<T>>,
    ) -> Offered {
        waits.forget(ticket.seq());
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
            Pick::Shed => {
                if let Some(r) = self.queues.cancel(ticket) {
                    out.push(done(r, Err(Reject::ObjectiveUnmet), now));
                }
                Offered::Refused
            }
        }
    }
}
