//! Homes for conversations that start while the fleet is full, and the
//! order in which a server's own conversations take its slots.
//!
//! A conversation's turns go back to the endpoint that served its last one
//! ([`crate::session`]), so where its first turn lands decides where its
//! whole life waits: an endpoint given one conversation more than the
//! others makes every turn of each of its conversations wait longer (9
//! against 7 conversations per server: ×1.22 the mean wait, BENCHMARKS.md).
//! When a slot is free the first turn goes to the session's rendezvous home
//! ([`super::selection`]; on a balancer alone in the fleet, by the scorers
//! and the wait-or-go rule, as a keyless request: beside its cached prompt,
//! or on the freest endpoint) or wherever a slot is; held for a busy
//! endpoint's cache by that rule, or waiting out its spill delay, it is
//! given that endpoint as its home ([`EndpointLedger::home_held`]). When
//! no endpoint can take it, the slot that
//! frees first would be luck; instead, a session named by its client whose
//! first turn must queue is given its home as it arrives: among the
//! endpoints of its model within one request of the least work per slot
//! (requests in flight there and queued for it), the one predicted to give
//! it its first token soonest ([`super::placement`]'s costs: the wait for a
//! slot there, and the prefill of what it does not cache, so a shared
//! system prompt draws a conversation to where it is cached), ties to the
//! rendezvous home. Its turns then wait for that endpoint as any bound
//! session's do, by the wait-or-go rule, which may still send one
//! elsewhere when waiting costs more.
//!
//! Requests queued for an endpoint by their session are counted there as
//! they enter and leave the queues ([`EndpointLedger::queued_for`],
//! [`EndpointLedger::left_queue`]), so choosing costs one pass over the
//! model's endpoints, and only for a session's first turn under
//! saturation; the dispatcher serves them in arrival order when the
//! endpoint frees a slot (`dispatcher::homed`).

use std::time::Instant;

use super::selection::SessionPlace;
use super::{Endpoint, EndpointId, EndpointLedger, Route};

impl Endpoint {
    /// Work per slot: the requests in flight here and queued for it.
    fn load(&self) -> f64 {
        f64::from(self.in_flight + self.queued_home) / f64::from(self.slots_total().max(1))
    }

    /// One request's share of this endpoint's work per slot.
    pub(super) fn one_request(&self) -> f64 {
        1.0 / f64::from(self.slots_total().max(1))
    }

    /// Predicted wait for a slot here of a request queued for it now:
    /// one service time per slot for each request that must start before
    /// it (those in flight past its slots, those queued for it, its
    /// engine's own queue).
    fn predicted_queued_wait_ms(&self) -> f64 {
        let queued = self.agent.as_ref().map_or(0, |a| a.report.requests_waiting);
        let before =
            (u64::from(self.in_flight) + u64::from(self.queued_home) + u64::from(queued) + 1)
                .saturating_sub(u64::from(self.slots_total()));
        before as f64 * self.cost.service_ms.ms() / f64::from(self.slots_total().max(1))
    }
}

impl EndpointLedger {
    /// The endpoint a request entering the queues waits for by its
    /// session, counted there until it leaves them
    /// ([`EndpointLedger::left_queue`]): its session's endpoint, or, for a
    /// session named by its client that none serves yet and that the
    /// dispatch cannot place now ([`EndpointLedger::places_now`]), the
    /// home [`EndpointLedger::home_by_load`] gives it. `None`: no session,
    /// sessions off, or no home yet (the wait-or-go rule may give it one:
    /// [`EndpointLedger::home_held`]).
    pub(crate) fn queued_for(&mut self, route: &Route, now: Instant) -> Option<EndpointId> {
        let session = route.session?;
        match self.session_endpoint(route, session, now) {
            SessionPlace::Takes(id) | SessionPlace::Saturated(id) => {
                if let Some(e) = self.endpoints.get_mut(&id) {
                    e.queued_home += 1;
                }
                Some(id)
            }
            SessionPlace::Gone | SessionPlace::None => {
                if !self.names_a_session(route) || self.places_now(route, session, now) {
                    return None;
                }
                self.home_by_load(route, now)
            }
        }
    }

    /// Whether the dispatch places a queued first turn without a home: on
    /// a balancer alone in the fleet while some endpoint takes it (it
    /// queued behind others, or waits for a busy endpoint's cache by the
    /// wait-or-go rule, or its spill delay: a home by load now would
    /// overrule that rule with whichever slot is free this instant); with
    /// other balancers, while its rendezvous home takes it.
    fn places_now(&self, route: &Route, session: u64, now: Instant) -> bool {
        if self.alone(now) {
            let wanted = self.adapter_wanted(route, now);
            self.choose_by_score(route, wanted.as_ref(), now).is_some()
        } else {
            self.session_home(route, session, now).is_some()
        }
    }

    /// Whether `route` is the first turn of a session named by its client
    /// that no endpoint serves (sessions on): one a home is given to.
    fn wants_home(&self, route: &Route, now: Instant) -> bool {
        self.names_a_session(route)
            && route.session.is_some_and(|session| {
                matches!(
                    self.session_endpoint(route, session, now),
                    SessionPlace::None | SessionPlace::Gone
                )
            })
    }

    /// The home of a first turn named by its client that must queue:
    /// among the endpoints of its model within one request of the least
    /// work per slot, the one predicted to give it its first token soonest
    /// (module docs); the session is bound to it and the turn counted
    /// there. `None`: nowhere to go.
    fn home_by_load(&mut self, route: &Route, now: Instant) -> Option<EndpointId> {
        let session = route.session?;
        let prompt = self.prompt_tokens(route);
        let scored = self.scheduling.scorers.prefix_cache > 0.0;
        let ttft = |e: &Endpoint| {
            let matched = if scored {
                e.prefix.matched(&route.prefix)
            } else {
                0
            };
            e.predicted_queued_wait_ms()
                + e.predicted_prefill_ms(prompt - self.cached_tokens(route, matched))
        };
        let candidates = || {
            self.serving(route)
                .filter(|e| e.eligible(now) && e.agent.is_some())
        };
        let least = candidates().map(Endpoint::load).min_by(f64::total_cmp)?;
        // Within one request of the least loaded, the quickest.
        let home = candidates()
            .filter(|e| e.load() - e.one_request() <= least + 1e-9)
            .map(|e| (ttft(e), e))
            .min_by(|(a_ms, a), (b_ms, b)| {
                a_ms.total_cmp(b_ms).then_with(|| {
                    crate::session::rendezvous(session, b.addr)
                        .cmp(&crate::session::rendezvous(session, a.addr))
                })
            })
            .map(|(_, e)| e.id)?;
        self.home_at(route, home, now).then_some(home)
    }

    /// A first turn of a session named by its client, queued without a
    /// home, is held for `id` by the wait-or-go rule (its group's prompt is
    /// cached there): `id` becomes its home, and it is counted there as
    /// queued for it, so homes given by load meanwhile see the requests
    /// already waiting for that endpoint. False when it is no such turn.
    pub(crate) fn home_held(&mut self, route: &Route, id: EndpointId, now: Instant) -> bool {
        self.wants_home(route, now) && self.home_at(route, id, now)
    }

    /// Binds `route`'s session to `id` and counts the turn queued there.
    fn home_at(&mut self, route: &Route, id: EndpointId, now: Instant) -> bool {
        let (Some(session), Some(e)) = (route.session, self.endpoints.get_mut(&id)) else {
            return false;
        };
        e.queued_home += 1;
        self.sessions.bind(session, e.addr, now);
        true
    }

    /// The endpoints that can take work now (of any model): few at
    /// saturation.
    pub(crate) fn available_ids(&self, now: Instant) -> Vec<EndpointId> {
        let config = self.saturation;
        self.ranking
            .ranked(None)
            .filter(|r| self.endpoints[&r.id].available(now, &config))
            .map(|r| r.id)
            .collect()
    }

    /// Whether `route`'s session is bound to `id` and `id` takes it now.
    pub(crate) fn takes_at_home(&self, id: EndpointId, route: &Route, now: Instant) -> bool {
        route.session.is_some_and(|session| {
            matches!(self.session_endpoint(route, session, now), SessionPlace::Takes(e) if e == id)
        })
    }

    /// A request counted by [`EndpointLedger::queued_for`] left the queues
    /// (served, expired, evicted or cancelled).
    pub(crate) fn left_queue(&mut self, id: EndpointId) {
        if let Some(e) = self.endpoints.get_mut(&id) {
            e.queued_home = e.queued_home.saturating_sub(1);
        }
    }
}

#[cfg(test)]
impl EndpointLedger {
    /// Requests counted as queued for an endpoint, over all endpoints.
    pub(crate) fn queued_homes(&self) -> u64 {
        self.endpoints
            .values()
            .map(|e| u64::from(e.queued_home))
            .sum()
    }
}
