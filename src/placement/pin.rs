//! Stage 1, pin: where a request's session puts it before any score.
//!
//! - A turn of a session goes back to the endpoint its last turn went to
//!   ([`crate::session`]) while that one takes it. While it is saturated,
//!   stage 3 ([`super::patience`]) weighs waiting for it, its conversation
//!   counted as cached there (in hard mode, `scheduling.sessions.hard`, a
//!   session its client named always waits, to its TTL). A binding to an
//!   endpoint that is gone, draining or otherwise not eligible is released
//!   and the turn placed anew (and bound where it goes).
//! - A later turn of a conversation (its prompt carries an answer) that
//!   this balancer holds no binding of — another balancer behind the same
//!   front placed the turns before, or the binding ended — goes where the
//!   engines say (their KV-cache events, [`crate::kv_events`]) the most of
//!   its prompt is cached, as if bound there: every balancer reads the
//!   same engines, so they agree without sharing their bindings. So does
//!   a soft session whose endpoint's engine holds less of the prompt than
//!   another engine does (evicted there, the engine restarted, or another
//!   balancer placed its last turn elsewhere). A session that waits hard
//!   stays.
//! - The first turn of a session its client named (or a later turn no
//!   engine with events holds any of) goes to its home, the endpoint of
//!   its model with the highest rendezvous hash of (session, address),
//!   while that takes it. Every balancer computes the same home from the
//!   same fleet, so a conversation spread over several balancers by a
//!   front load balancer lands on one endpoint without any state shared
//!   between them. A saturated home is not waited for (no cache is known
//!   there yet). A balancer alone in the fleet has no one to agree with:
//!   it places the first turn as any request, beside its group's cached
//!   prompt or on the freest endpoint, so groups that start at once start
//!   apart rather than where their hashes meet (measured: BENCHMARKS.md,
//!   sessions). So does a balancer whose every endpoint that may serve the
//!   request publishes its cache: the engines tell every balancer where
//!   the later turns are, so there is nothing to agree on beforehand.
//! - A conversation found by its prompt in the balancers' shared store
//!   ([`crate::turn`]), no longer where it was, goes by its prompt as any
//!   keyless request.

use std::time::Instant;

use crate::endpoint::{Endpoint, EndpointId, EndpointLedger, Route};

/// What stage 1 found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pin {
    /// No session, or none to go back to: placed by score.
    Free,
    /// Its session's endpoint (where its last turn went, or for a later
    /// turn not bound here the engine holding most of its prompt) takes
    /// it: it goes there.
    Session(EndpointId),
    /// That endpoint is saturated: stage 3 weighs waiting for it.
    SessionBusy(EndpointId),
    /// Its session's endpoint is gone: the binding is released, and it is
    /// placed by score.
    SessionGone,
    /// Its first turn's rendezvous home takes it: it goes there.
    Home(EndpointId),
}

/// Where a request's session stands.
enum SessionPlace {
    /// Its endpoint can take the request.
    Takes(EndpointId),
    /// Its endpoint is live but cannot take it now.
    Saturated(EndpointId),
    /// Bound to an endpoint that is gone, draining or otherwise not
    /// eligible: the binding is to be released.
    Gone,
    /// No endpoint to go back to (none bound, or not for this request).
    None,
}

/// Stage 1 for `route` (module docs).
pub(super) fn pin(fleet: &EndpointLedger, route: &Route, now: Instant) -> Pin {
    let Some(session) = route.session else {
        return Pin::Free;
    };
    match session_place(fleet, route, session, now) {
        SessionPlace::Takes(id) => Pin::Session(id),
        SessionPlace::Saturated(id) => Pin::SessionBusy(id),
        place @ (SessionPlace::Gone | SessionPlace::None) => {
            if let Some(e) = conversation_holder(fleet, route, now) {
                return if e.takes(route, now, fleet.saturation()) {
                    Pin::Session(e.id)
                } else {
                    Pin::SessionBusy(e.id)
                };
            }
            if !route.session_by_prompt && !engines_agree(fleet, route) {
                if let Some(home) = goes_home(fleet, route, session, now) {
                    // Bound there when it goes: the old binding is
                    // replaced.
                    return Pin::Home(home);
                }
            }
            match place {
                SessionPlace::Gone => Pin::SessionGone,
                _ => Pin::Free,
            }
        }
    }
}

/// Where `session`'s last turn went, as its next turn sees it.
fn session_place(
    fleet: &EndpointLedger,
    route: &Route,
    session: u64,
    now: Instant,
) -> SessionPlace {
    let Some(addr) = fleet.session_addr(session, now) else {
        return SessionPlace::None;
    };
    let Some(e) = fleet.endpoint_at(addr).filter(|e| e.eligible(now)) else {
        return SessionPlace::Gone;
    };
    if !e.fits(route) {
        // Another model, or the endpoint a retry avoids.
        SessionPlace::None
    } else if cached_elsewhere(fleet, route, addr) {
        SessionPlace::None
    } else if e.takes(route, now, fleet.saturation()) {
        SessionPlace::Takes(e.id)
    } else {
        SessionPlace::Saturated(e.id)
    }
}

/// Whether the engine at `addr` says (its KV-cache events) it holds less
/// of the prompt than another engine does: the conversation's cache is
/// elsewhere now (evicted here, the engine restarted, or another balancer
/// placed its last turn there), so a soft session follows the prompt. A
/// session that waits hard stays.
fn cached_elsewhere(fleet: &EndpointLedger, route: &Route, addr: std::net::SocketAddr) -> bool {
    let Some(held) = &route.engine_held else {
        return false;
    };
    let Some(here) = held.share(addr) else {
        return false;
    };
    let hard = fleet.scheduling().sessions.hard;
    !route.waits_hard(hard) && held.shares().any(|(_, share)| share > here)
}

/// For a later turn of a conversation this balancer holds no binding of
/// (another balancer placed the turns before, or the binding ended), the
/// endpoint whose engine says (its KV-cache events) it holds the most of
/// the prompt: the conversation's cache, wherever the turns before went.
fn conversation_holder<'f>(
    fleet: &'f EndpointLedger,
    route: &Route,
    now: Instant,
) -> Option<&'f Endpoint> {
    if !route.continues {
        return None;
    }
    super::evening::engines_holder(fleet, route, now)
}

/// Whether every endpoint that may serve `route` publishes its cache (its
/// KV-cache events matched the prompt): then every balancer finds a
/// conversation's later turns where the engines hold them, and its first
/// turn needs no rendezvous home to agree on.
fn engines_agree(fleet: &EndpointLedger, route: &Route) -> bool {
    route
        .engine_held
        .as_ref()
        .is_some_and(|held| fleet.serving(route).all(|e| held.share(e.addr).is_some()))
}

/// `session`'s rendezvous home for `route`, when it takes the request now.
fn session_home(
    fleet: &EndpointLedger,
    route: &Route,
    session: u64,
    now: Instant,
) -> Option<EndpointId> {
    let home = fleet
        .serving(route)
        .filter(|e| e.eligible(now))
        .max_by_key(|e| crate::session::rendezvous(session, e.addr))?;
    home.takes(route, now, fleet.saturation())
        .then_some(home.id)
}

/// The rendezvous home the first turn of a session named by its client
/// goes to now, if any: where other balancers share the fleet, while the
/// home takes it (module docs).
fn goes_home(
    fleet: &EndpointLedger,
    route: &Route,
    session: u64,
    now: Instant,
) -> Option<EndpointId> {
    if fleet.alone(now) {
        return None;
    }
    session_home(fleet, route, session, now)
}
