//! Where a request may go ([`Route`]: its model, prompt blocks, subset,
//! session), how endpoints are chosen ([`SchedulingConfig`], read by
//! [`crate::placement`]), and what an endpoint says of a route: whether it
//! fits it, takes it now, and what the scorers see of it.

use crate::objective::Objective;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::adapters::Wanted;
use super::{BreakerConfig, Endpoint, EndpointLedger, SaturationConfig};
use crate::kv_events::EngineHeld;
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
    /// What the endpoints that publish their caches hold of the prompt
    /// ([`crate::kv_events::prompt`]): weighed for them instead of
    /// `prefix`'s guess.
    pub engine_held: Option<Arc<EngineHeld>>,
    /// Not this endpoint (a retry after it failed).
    pub avoid: Option<SocketAddr>,
    /// Only these endpoints, sorted (EPP mode's subset hint); `None`: any.
    pub subset: Option<Arc<[SocketAddr]>>,
    /// What the request will cost, estimated: endpoints whose token budget
    /// it does not fit in are saturated for it.
    pub tokens: TokenEstimate,
    /// Its session, hashed and scoped to its tenant ([`crate::session`]).
    pub session: Option<u64>,
    /// Its prompt carries an earlier answer (an assistant message): a
    /// later turn of its conversation, not its first.
    pub continues: bool,
    /// Its session was found by its prompt in the balancers' shared store
    /// ([`crate::turn`]), not named by its client: it is followed softly,
    /// even in hard mode.
    pub session_by_prompt: bool,
    /// How fast it must be served ([`crate::objective`]).
    pub objective: Objective,
    /// When its first token is due by that objective, once it was
    /// submitted ([`Objective::deadline`]).
    pub due: Option<Instant>,
    /// Of negative priority (sheddable, as GIE's objectives say): refused
    /// rather than served late when no endpoint is predicted to meet its
    /// objective.
    pub sheddable: bool,
}

impl Route {
    /// Whether two routes may go to the same endpoints.
    pub(crate) fn same_targets(&self, other: &Route) -> bool {
        self.model == other.model
            && self.avoid == other.avoid
            && self.subset == other.subset
            && self.objective.is_none() == other.objective.is_none()
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
            // A request without an objective may leave a slot that one
            // with an objective takes (`placement::reserve`).
            objective: self.objective,
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
    /// that would serve it sooner than a free one ([`crate::placement`]'s
    /// stage 3 decides; this only bounds it); zero: never.
    pub affinity_hold: Duration,
    /// How sessions are kept and honoured.
    pub sessions: SessionConfig,
    /// Endpoints each LoRA adapter prefers where it is resident nowhere
    /// ([`crate::adapter::preferred`]); 0: none preferred.
    pub adapter_replicas: u32,
    /// Free slots kept for requests with a TTFT objective on the endpoints
    /// fast enough for the hardest of them ([`crate::placement`]'s stage
    /// 2½); 0: none kept, anywhere.
    pub kept_slots: u32,
}

/// Free slots kept for requests with a TTFT objective, at most (and at
/// most a quarter of the model's slots), by default
/// (`scheduling.keptSlots`; [`crate::placement`]'s stage 2½): on the
/// objectives bench (16 slots, 8 of them fast enough) 1 gave attainment
/// 0.84–0.90 at full load, 3 gave 0.86–0.94, 4 the same at ×0.95 the
/// batch class's throughput (BENCHMARKS.md, session 37).
pub const KEPT_SLOTS: u32 = 3;

impl Default for SchedulingConfig {
    fn default() -> Self {
        SchedulingConfig {
            scorers: ScorerWeights::default(),
            prefix: PrefixConfig::default(),
            breaker: BreakerConfig::default(),
            affinity_hold: Duration::from_secs(5),
            sessions: SessionConfig::default(),
            adapter_replicas: 1,
            kept_slots: KEPT_SLOTS,
        }
    }
}

impl Endpoint {
    /// Serves the route's model, is not the endpoint it avoids, and is in
    /// its subset if it has one.
    pub(crate) fn fits(&self, route: &Route) -> bool {
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
    pub(crate) fn takes(&self, route: &Route, now: Instant, config: &SaturationConfig) -> bool {
        self.fits_targets(route)
            && self.available(now, config)
            && self.fits_token_budget(&route.tokens, config)
    }

    /// The scorers' sum without the prefix term: what ranks the endpoint
    /// in its lanes ([`super::ranking`]).
    pub(crate) fn static_score(&self, weights: &ScorerWeights, config: &SaturationConfig) -> f64 {
        self.candidate(0, 0, None, config)
            .map_or(0.0, |c| weights.score(&c))
    }

    /// What the scorers know of this endpoint for a prompt of
    /// `prefix_blocks` blocks of which it holds `prefix_matched`, and the
    /// request's adapter (`wanted`); `None` without an agent.
    pub(crate) fn candidate(
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

impl EndpointLedger {
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
