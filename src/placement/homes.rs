//! Homes for conversations that start while the fleet is full, and the
//! order in which a server's own conversations take its slots.
//!
//! A conversation's turns go back to the endpoint that served its last one
//! ([`crate::session`]), so where its first turn lands decides where its
//! whole life waits: an endpoint given one conversation more than the
//! others makes every turn of each of its conversations wait longer (9
//! against 7 conversations per server: ×1.22 the mean wait, BENCHMARKS.md).
//! When a slot is free the first turn goes to the session's rendezvous home
//! ([`super::pin`]; on a balancer alone in the fleet, by the scorers and
//! the wait-or-go rule, as a keyless request: beside its cached prompt, or
//! on the freest endpoint) or wherever a slot is; held for a busy
//! endpoint's cache by that rule, or waiting out its spill delay, it is
//! given that endpoint as its home ([`home_held`]). When
//! no endpoint can take it, the slot that
//! frees first would be luck; instead, a session named by its client whose
//! first turn must queue is given its home as it arrives: among the
//! endpoints of its model within one request of the least load per slot
//! ([`super::load`]), the one predicted to give it its first token soonest
//! ([`super::patience`]'s costs: the wait for a slot there, and the prefill of what it does not cache, so a shared
//! system prompt draws a conversation to where it is cached), ties to the
//! rendezvous home. Its turns then wait for that endpoint as any bound
//! session's do, by the wait-or-go rule, which may still send one
//! elsewhere when waiting costs more.
//!
//! Requests queued for an endpoint by their session are counted there as
//! they enter and leave the queues ([`queued_for`],
//! [`EndpointLedger::left_queue`]), so choosing costs one pass over the
//! model's endpoints, and only for a session's first turn under
//! saturation; the dispatcher serves them in arrival order when the
//! endpoint frees a slot (`dispatcher::homed`).

use std::time::Instant;

use super::load::{Load, Waits};
use super::patience::{busy_ttft_ms, cached_tokens, prompt_tokens};
use super::pin::{names_a_session, session_home, session_place, SessionPlace};
use crate::endpoint::{Endpoint, EndpointId, EndpointLedger, Route};

/// Slack for the comparisons of loads (sums of fractions of a request).
const EPSILON: f64 = 1e-9;

/// The endpoint a request entering the queues waits for by its session,
/// counted there until it leaves them ([`EndpointLedger::left_queue`]):
/// its session's endpoint, or, for a session named by its client that none
/// serves yet and that the dispatch cannot place now ([`places_now`]), the
/// home [`home_by_load`] gives it. `None`: no session, sessions off, or no
/// home yet (the wait-or-go rule may give it one: [`home_held`]).
pub(crate) fn queued_for(
    ledger: &mut EndpointLedger,
    route: &Route,
    now: Instant,
) -> Option<EndpointId> {
    let session = route.session?;
    match session_place(ledger, route, session, now) {
        SessionPlace::Takes(id) | SessionPlace::Saturated(id) => {
            ledger.count_queued(id);
            Some(id)
        }
        SessionPlace::Gone | SessionPlace::None => {
            if !names_a_session(ledger, route) || places_now(ledger, route, session, now) {
                return None;
            }
            let home = home_by_load(ledger, route, now)?;
            ledger.queue_home(route, home, now).then_some(home)
        }
    }
}

/// Whether the dispatch places a queued first turn without a home: on a
/// balancer alone in the fleet while some endpoint takes it (it queued
/// behind others, or waits for a busy endpoint's cache by the wait-or-go
/// rule, or its spill delay: a home by load now would overrule that rule
/// with whichever slot is free this instant); with other balancers, while
/// its rendezvous home takes it.
fn places_now(fleet: &EndpointLedger, route: &Route, session: u64, now: Instant) -> bool {
    if fleet.alone(now) {
        let wanted = fleet.adapter_wanted(route, now);
        super::score::best(fleet, route, wanted.as_ref(), now).is_some()
    } else {
        session_home(fleet, route, session, now).is_some()
    }
}

/// Whether `route` is the first turn of a session named by its client that
/// no endpoint serves (sessions on): one a home is given to.
fn wants_home(fleet: &EndpointLedger, route: &Route, now: Instant) -> bool {
    names_a_session(fleet, route)
        && route.session.is_some_and(|session| {
            matches!(
                session_place(fleet, route, session, now),
                SessionPlace::None | SessionPlace::Gone
            )
        })
}

/// The home of a first turn named by its client that must queue: among
/// the endpoints of its model within one request of the least load per
/// slot, the one predicted to give it its first token soonest (module
/// docs), ties to the rendezvous home. `None`: nowhere to go.
fn home_by_load(fleet: &EndpointLedger, route: &Route, now: Instant) -> Option<EndpointId> {
    let session = route.session?;
    let prompt = prompt_tokens(fleet, route);
    let scored = fleet.scheduling().scorers.prefix_cache > 0.0;
    let none = Waits::default();
    let ttft = |e: &Endpoint| {
        let matched = if scored {
            e.prefix_matched(&route.prefix)
        } else {
            0
        };
        busy_ttft_ms(e, &none, prompt, cached_tokens(fleet, route, matched), 0.0)
    };
    let candidates = || {
        fleet
            .serving(route)
            .filter(|e| e.eligible(now) && e.agent.is_some())
    };
    let least = candidates()
        .map(|e| Load::of(e, &none).per_slot())
        .min_by(f64::total_cmp)?;
    // Within one request of the least loaded, the quickest.
    candidates()
        .filter(|e| {
            let load = Load::of(e, &none);
            load.per_slot() - load.one_request() <= least + EPSILON
        })
        .map(|e| (ttft(e), e))
        .min_by(|(a_ms, a), (b_ms, b)| {
            a_ms.total_cmp(b_ms).then_with(|| {
                crate::session::rendezvous(session, b.addr)
                    .cmp(&crate::session::rendezvous(session, a.addr))
            })
        })
        .map(|(_, e)| e.id)
}

/// A first turn of a session named by its client, queued without a home,
/// is held for `id` by the wait-or-go rule (its group's prompt is cached
/// there): `id` becomes its home, and it is counted there as queued for
/// it, so homes given by load meanwhile see the requests already waiting
/// for that endpoint. False when it is no such turn.
pub(crate) fn home_held(
    ledger: &mut EndpointLedger,
    route: &Route,
    id: EndpointId,
    now: Instant,
) -> bool {
    wants_home(ledger, route, now) && ledger.queue_home(route, id, now)
}
