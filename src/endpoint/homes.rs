//! Homes for conversations that start while the fleet is full, and the
//! order in which a server's own conversations take its slots.
//!
//! A conversation's turns go back to the endpoint that served its last one
//! ([`crate::session`]), so where its first turn lands decides where its
//! whole life waits: an endpoint given one conversation more than the
//! others makes every turn of each of its conversations wait longer (9
//! against 7 conversations per server: ×1.22 the mean wait, BENCHMARKS.md).
//! When a slot is free the first turn goes to the session's rendezvous home
//! ([`super::selection`]; on a balancer alone in the fleet, beside its
//! cached prompt when an endpoint holds its beginning) or wherever a slot
//! is. When none is, the slot that
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
    fn one_request(&self) -> f64 {
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
    /// session named by its client that none serves yet, the least loaded
    /// endpoint of its model, to which the session is bound now (module
    /// docs). `None`: no session, sessions off, or nowhere to go.
    pub(crate) fn queued_for(&mut self, route: &Route, now: Instant) -> Option<EndpointId> {
        let session = route.session?;
        let bound = match self.session_endpoint(route, session, now) {
            SessionPlace::Takes(id) | SessionPlace::Saturated(id) => Some(id),
            SessionPlace::Gone | SessionPlace::None => None,
        };
        let id = match bound {
            Some(id) => id,
            None if route.session_by_prompt || self.scheduling.sessions.max_sessions == 0 => {
                return None;
            }
            // Its rendezvous home could take it: the dispatch places it
            // (there, or by its prompt on a balancer alone in the fleet).
            None if self.session_home(route, session, now).is_some() => return None,
            None => {
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
                    .map(|(_, e)| e)?;
                let (id, addr) = (home.id, home.addr);
                self.sessions.bind(session, addr, now);
                id
            }
        };
        if let Some(e) = self.endpoints.get_mut(&id) {
            e.queued_home += 1;
        }
        Some(id)
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
