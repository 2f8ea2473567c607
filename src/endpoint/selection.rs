//! Scheduling: a request names a [`Route`] (its model and prompt prefix).
//! Only endpoints that serve the model, are eligible (ready, not draining,
//! not stale, circuit closed) and are not saturated are candidates; the
//! weighted scorers of [`crate::scorer`] pick among them; equal endpoints
//! take turns (see [`super::ranking`], which also keeps this cheap in a
//! large fleet).
//! The chosen endpoint remembers the request's prompt blocks
//! ([`crate::prefix`]).
//!

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::adapters::Wanted;
use super::placement::{spill_delay, Holding, WaitOrGo};
use super::{BreakerConfig, Endpoint, EndpointId, EndpointLedger, Lease, SaturationConfig};
use crate::prefix::PrefixConfig;
use crate::scorer::{Candidate, ScorerWeights};
use crate::session::SessionConfig;
use crate::tokens::TokenEstimate;

/// Where a request may go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Route {
    /// The requested model; `None`: any endpoint.
    pub model: Option<Arc<str>>,
    /// Chained hashes of the prompt's leading blocks ([`crate::prefix`]).
    pub prefix: Vec<u64>,
    /// Not this endpoint (a retry after it failed).
    pub avoid: Option<SocketAddr>,
    /// Only these endpoints, sorted (EPP mode's subset hint); `None`: any.
    pub subset: Option<Arc<[SocketAddr]>>,
    /// What the request will cost, estimated: endpoints whose token budget
    /// it does not fit in are saturated for it.
    pub tokens: TokenEstimate,
    /// Its session, hashed and scoped to its tenant ([`crate::session`]).
    pub session: Option<u64>,
    /// Its session was found by its prompt in the balancers' shared store
    /// ([`crate::turn`]), not named by its client: it is followed softly,
    /// even in hard mode.
    pub session_by_prompt: bool,
}

impl Route {
    /// Whether two routes may go to the same endpoints.
    pub(crate) fn same_targets(&self, other: &Route) -> bool {
        self.model == other.model && self.avoid == other.avoid && self.subset == other.subset
    }

    /// Whether it waits for its session's endpoint until its TTL: in hard
    /// mode, a session its client named.
    pub(crate) fn waits_hard(&self, hard: bool) -> bool {
        hard && self.session.is_some() && !self.session_by_prompt
    }

    /// Only its targets (the prompt is not needed to compare them).
    pub(crate) fn targets(&self) -> Route {
        Route {
            model: self.model.clone(),
            avoid: self.avoid,
            subset: self.subset.clone(),
            ..Route::default()
        }
    }
}

/// How endpoints are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulingConfig {
    pub scorers: ScorerWeights,
    pub prefix: PrefixConfig,
    pub breaker: BreakerConfig,
    /// The longest a queued request may wait for a saturated endpoint
    /// that would serve it sooner than a free one ([`super::placement`]'s
    /// wait-or-go rule decides; this only bounds it); zero: never.
    pub affinity_hold: Duration,
    /// How sessions are kept and honoured.
    pub sessions: SessionConfig,
    /// Endpoints each LoRA adapter prefers where it is resident nowhere
    /// ([`crate::adapter::preferred`]); 0: none preferred.
    pub adapter_replicas: u32,
    /// Seed of the tie-breaking random source.
    pub seed: u64,
}

impl Default for SchedulingConfig {
    fn default() -> Self {
        SchedulingConfig {
            scorers: ScorerWeights::default(),
            prefix: PrefixConfig::default(),
            breaker: BreakerConfig::default(),
            affinity_hold: Duration::from_secs(5),
            sessions: SessionConfig::default(),
            adapter_replicas: 1,
            seed: 0x5eed,
        }
    }
}

/// What [`EndpointLedger::choose`] found for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Choice {
    Endpoint(EndpointId),
    /// Better wait for this saturated endpoint ([`super::placement`]).
    Hold(EndpointId),
    /// Go where it would prefill cold what a busy endpoint (the second)
    /// holds, but not before this spill delay
    /// ([`super::placement::spill_delay`]).
    Delay(Duration, EndpointId),
    /// No endpoint can take it now.
    Busy,
}

/// Where a request's session stands.
pub(super) enum SessionPlace {
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

/// What [`EndpointLedger::pick`] found for a request.
#[derive(Debug)]
pub(crate) enum Pick {
    /// A slot on the chosen endpoint.
    Lease(Lease),
    /// Better wait for this saturated endpoint ([`super::placement`]).
    Hold(EndpointId),
    /// It would prefill cold what a busy endpoint (the second) holds: not
    /// before this spill delay ([`super::placement::spill_delay`]).
    Delay(Duration, EndpointId),
    /// No endpoint can take it now.
    Busy,
}

impl Endpoint {
    /// Serves the route's model, is not the endpoint it avoids, and is in
    /// its subset if it has one.
    pub(super) fn fits(&self, route: &Route) -> bool {
        self.fits_targets(route) && self.serves(route.model.as_deref())
    }

    /// Is not the endpoint the route avoids, and is in its subset if it has
    /// one (the model is the caller's to check).
    fn fits_targets(&self, route: &Route) -> bool {
        Some(self.addr) != route.avoid
            && route
                .subset
                .as_ref()
                .is_none_or(|s| s.binary_search(&self.addr).is_ok())
    }

    /// Can take this request now: fits its targets, eligible, not
    /// saturated, room in its token budget (the model is the caller's to
    /// check).
    pub(super) fn takes(&self, route: &Route, now: Instant, config: &SaturationConfig) -> bool {
        self.fits_targets(route)
            && self.available(now, config)
            && self.fits_token_budget(&route.tokens, config)
    }

    /// The scorers' sum without the prefix term: what ranks the endpoint
    /// in its lanes ([`super::ranking`]).
    pub(super) fn static_score(&self, weights: &ScorerWeights, config: &SaturationConfig) -> f64 {
        self.candidate(0, 0, None, config)
            .map_or(0.0, |c| weights.score(&c))
    }

    /// What the scorers know of this endpoint for a prompt of
    /// `prefix_blocks` blocks of which it holds `prefix_matched`, and the
    /// request's adapter (`wanted`); `None` without an agent.
    pub(super) fn candidate(
        &self,
        prefix_matched: usize,
        prefix_blocks: usize,
        wanted: Option<&Wanted>,
        config: &SaturationConfig,
    ) -> Option<Candidate> {
        let agent = self.agent.as_ref()?;
        Some(Candidate {
            prefix_matched,
            prefix_blocks,
            free_slots: self.free_slots(),
            slots_total: self.slots_total(),
            kv_cache_usage: agent.report.kv_cache_usage,
            requests_waiting: agent.report.requests_waiting,
            queue_depth_threshold: config.queue_depth_threshold,
            adapter: self.adapter_score(wanted),
        })
    }
}

/// Scores are sums of a few ratios: closer than this is a tie.
pub(super) const TIE: f64 = 1e-9;

impl EndpointLedger {
    /// The best endpoint for `route` among those that serve its model and
    /// are eligible and not saturated (see the module docs); takes no slot
    /// (that is the ledger's: [`EndpointLedger::pick`]). With `hold` (the
    /// requests already held in this dispatch pass), a request that a
    /// saturated endpoint is predicted to serve sooner than the chosen one
    /// is told to wait for it ([`Choice::Hold`], the wait-or-go rule of
    /// [`super::placement`]); the caller bounds the wait. A request of a
    /// session goes back to the endpoint its last turn went to while that
    /// can take it; while that is saturated, the same rule (its
    /// conversation cached there) says whether to wait for it (see
    /// [`crate::session`]).
    ///
    /// The cost does not grow with the fleet: the best candidate by its
    /// static score is the first of its model's ranked lane that can take
    /// the request ([`super::ranking`]); only endpoints that hold the
    /// prompt's blocks ([`crate::prefix::PrefixHolders`]) can beat it with
    /// their prefix term, and they are looked at deepest match first until
    /// none could.
    pub(super) fn choose(
        &mut self,
        route: &Route,
        now: Instant,
        hold: Option<Holding<'_>>,
    ) -> Choice {
        let bound = match route.session {
            None => None,
            Some(session) => match self.session_endpoint(route, session, now) {
                SessionPlace::Takes(id) => return Choice::Endpoint(id),
                SessionPlace::Saturated(id) => Some(id),
                place @ (SessionPlace::Gone | SessionPlace::None) => {
                    if matches!(place, SessionPlace::Gone) {
                        self.sessions.release(session);
                    }
                    // A conversation found by its prompt, no longer where
                    // it was, goes by its prompt as any keyless request;
                    // so does a first turn on a balancer alone in the
                    // fleet.
                    if !route.session_by_prompt {
                        if let Some(home) = self.goes_home(route, session, now) {
                            return Choice::Endpoint(home);
                        }
                    }
                    None
                }
            },
        };
        let wanted = self.adapter_wanted(route, now);
        let go = match &route.subset {
            Some(subset) => self.choose_in_subset(route, &Arc::clone(subset), wanted.as_ref(), now),
            None => self.choose_by_score(route, wanted.as_ref(), now),
        };
        // Nothing is free: no reason to hold yet.
        let Some(go) = go else { return Choice::Busy };
        let Some(hold) = hold else {
            return Choice::Endpoint(go);
        };
        match self.wait_target(route, go, bound, hold.waits, wanted.as_ref(), now) {
            WaitOrGo::Wait(id) => Choice::Hold(id),
            WaitOrGo::Spill { cold_ms, holder } if !hold.may_spill => {
                Choice::Delay(spill_delay(cold_ms), holder)
            }
            WaitOrGo::Spill { .. } | WaitOrGo::Go => Choice::Endpoint(go),
        }
    }

    /// Where a session goes that this balancer has not bound (its first
    /// turn, or a turn that reached this balancer after another took the
    /// ones before): its home, the endpoint that serves its model with the
    /// highest rendezvous hash of (session, address), when that one can
    /// take it. Every balancer of the fleet computes the same home from the
    /// same fleet, so a conversation spread over several balancers by a
    /// front load balancer lands on one endpoint without any state shared
    /// between them. A saturated home is not waited for (no cache is known
    /// there yet): the turn is placed by score and bound where it goes. A
    /// balancer alone in the fleet places every first turn by score
    /// ([`EndpointLedger::goes_home`]).
    pub(super) fn session_home(
        &self,
        route: &Route,
        session: u64,
        now: Instant,
    ) -> Option<EndpointId> {
        let home = self
            .serving(route)
            .filter(|e| e.eligible(now))
            .max_by_key(|e| crate::session::rendezvous(session, e.addr))?;
        home.takes(route, now, &self.saturation).then_some(home.id)
    }

    /// The rendezvous home the first turn of a session named by its
    /// client goes to now, if any: while the home takes it, where other
    /// balancers share the fleet (each must find the conversation where
    /// the others send it). A balancer alone in the fleet has no one to
    /// agree with: it places the turn as a keyless one, by the scorers and
    /// the wait-or-go rule, beside its group's cached prompt or on the
    /// freest endpoint, so groups that start at once start apart rather
    /// than where their hashes happen to meet.
    fn goes_home(&self, route: &Route, session: u64, now: Instant) -> Option<EndpointId> {
        if self.alone(now) {
            return None;
        }
        self.session_home(route, session, now)
    }

    /// Whether a session this balancer has not bound is at home now, for
    /// the dispatch step that serves requests at home first: a client's
    /// first turn where it goes ([`EndpointLedger::goes_home`]); a
    /// conversation found by its prompt while its rendezvous home takes it.
    pub(super) fn at_rendezvous_home(&self, route: &Route, session: u64, now: Instant) -> bool {
        if route.session_by_prompt {
            self.session_home(route, session, now).is_some()
        } else {
            self.goes_home(route, session, now).is_some()
        }
    }

    /// Whether `route` is a turn of a session named by its client (not one
    /// found by its prompt), sessions on.
    pub(super) fn names_a_session(&self, route: &Route) -> bool {
        route.session.is_some()
            && !route.session_by_prompt
            && self.scheduling.sessions.max_sessions > 0
    }

    /// Where `session`'s last turn went, as its next turn sees it (read
    /// only: [`EndpointLedger::choose`] releases a binding to an endpoint
    /// that is [`SessionPlace::Gone`], and the turn goes elsewhere and is
    /// bound there).
    pub(super) fn session_endpoint(
        &self,
        route: &Route,
        session: u64,
        now: Instant,
    ) -> SessionPlace {
        let Some(addr) = self.sessions.endpoint(session, now) else {
            return SessionPlace::None;
        };
        let Some(e) = self
            .by_addr
            .get(&addr)
            .and_then(|id| self.endpoints.get(id))
            .filter(|e| e.eligible(now))
        else {
            return SessionPlace::Gone;
        };
        if !e.fits(route) {
            // Another model, or the endpoint a retry avoids.
            SessionPlace::None
        } else if e.takes(route, now, &self.saturation) {
            SessionPlace::Takes(e.id)
        } else {
            SessionPlace::Saturated(e.id)
        }
    }

    /// The best endpoint by the scorers that takes `route` now, if any
    /// (no session, no subset); `wanted`: its adapter
    /// ([`EndpointLedger::adapter_wanted`]).
    pub(super) fn choose_by_score(
        &self,
        route: &Route,
        wanted: Option<&Wanted>,
        now: Instant,
    ) -> Option<EndpointId> {
        if let Some(wanted) = wanted {
            return self.choose_for_adapter(route, wanted, now);
        }
        let config = self.saturation;
        let model = route.model.as_deref();
        let top = self
            .ranking
            .ranked(model)
            .find(|r| self.endpoints[&r.id].takes(route, now, &config))?;
        let weight = self.scheduling.scorers.prefix_cache;
        let blocks = route.prefix.len();
        if weight <= 0.0 || blocks == 0 {
            return Some(top.id);
        }
        // Blocks are chained, and an LRU touches a prompt's first block
        // last: an endpoint holding block `d` holds every block before it.
        let depth = route
            .prefix
            .iter()
            .take_while(|h| !self.holders.of(**h).is_empty())
            .count();
        if depth == 0 {
            return Some(top.id);
        }
        let prefix_term = |matched: usize| weight * matched as f64 / blocks as f64;
        let score_of = |e: &Endpoint| self.route_score(e, route, None);
        let top_endpoint = &self.endpoints[&top.id];
        let mut best = (score_of(top_endpoint), top.id);
        let held: usize = route.prefix[..depth]
            .iter()
            .map(|h| self.holders.of(*h).len())
            .sum();
        if held > self.ranking.ranked_len(model) {
            // More holders than candidates (a prompt many endpoints saw):
            // scoring every candidate is the cheaper way.
            for r in self.ranking.ranked(model) {
                let e = &self.endpoints[&r.id];
                if e.takes(route, now, &config) {
                    let score = score_of(e);
                    if score > best.0 + TIE {
                        best = (score, r.id);
                    }
                }
            }
            return Some(best.1);
        }
        for d in (0..depth).rev() {
            // No endpoint whose deepest block is `d` can beat `best`.
            if top.score() + prefix_term(d + 1) <= best.0 + TIE {
                break;
            }
            for id in self.holders.of(route.prefix[d]) {
                let Some(e) = self.endpoints.get(id) else {
                    continue;
                };
                if e.serves(model) && e.takes(route, now, &config) {
                    let score = score_of(e);
                    if score > best.0 + TIE {
                        best = (score, *id);
                    }
                }
            }
        }
        Some(best.1)
    }

    /// [`EndpointLedger::choose`] for a route limited to a subset of
    /// endpoints (EPP's hint): the subset is looked at in full.
    fn choose_in_subset(
        &mut self,
        route: &Route,
        subset: &[SocketAddr],
        wanted: Option<&Wanted>,
        now: Instant,
    ) -> Option<EndpointId> {
        let config = self.saturation;
        let free = subset
            .iter()
            .filter_map(|a| self.by_addr.get(a))
            .filter_map(|id| self.endpoints.get(id))
            .filter(|e| e.fits(route) && e.takes(route, now, &config));
        let mut best_score = f64::NEG_INFINITY;
        let mut best: Vec<EndpointId> = Vec::new();
        for e in free {
            let score = self.route_score(e, route, wanted);
            if score > best_score + TIE {
                best_score = score;
                best.clear();
                best.push(e.id);
            } else if score >= best_score - TIE {
                best.push(e.id);
            }
        }
        if best.is_empty() {
            return None;
        }
        best.sort_unstable();
        Some(best[self.ties.below(best.len())])
    }

    /// Every scorer's sum for `route` on `e`: its static score, its
    /// prefix term and its adapter's (`wanted`).
    pub(super) fn route_score(&self, e: &Endpoint, route: &Route, wanted: Option<&Wanted>) -> f64 {
        let weights = &self.scheduling.scorers;
        let blocks = route.prefix.len();
        let prefix = if weights.prefix_cache > 0.0 && blocks > 0 {
            weights.prefix_cache * e.prefix.matched(&route.prefix) as f64 / blocks as f64
        } else {
            0.0
        };
        let adapter = e.adapter_score(wanted).map_or(0.0, |s| weights.adapter * s);
        e.static_score(weights, &self.saturation) + prefix + adapter
    }

    /// A live endpoint for a request that takes no slot on the engine
    /// (tokenize, count tokens): one that serves the route's model and is
    /// eligible, saturated or not, the least loaded by the balancer's own
    /// count (then the oldest registered). Takes nothing.
    pub(crate) fn live(&self, route: &Route, now: Instant) -> Option<SocketAddr> {
        self.endpoints
            .values()
            .filter(|e| e.fits(route) && e.eligible(now))
            .min_by_key(|e| (e.in_flight, e.id))
            .map(|e| e.addr)
    }
}
