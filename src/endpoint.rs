//! Endpoints (model servers) as the balancer sees them: what their agent
//! reported plus the balancer's own in-flight count.
//!
//! Accounting rules, each one covered by a test below:
//! - An endpoint is keyed by its traffic address, so two agents that watch
//!   the same server cannot double its capacity: the latest reporter owns it.
//! - The in-flight count only moves through [`Lease`]s: acquiring one adds
//!   one, releasing it (by value, so only once) subtracts one. A report never
//!   touches it, so the count cannot underflow or be forgotten.
//! - Slots used by clients that bypass the balancer ("foreign" load) are
//!   estimated conservatively from reports: `reported_busy` minus the most the
//!   balancer had in flight since the previous report. A report that lags
//!   behind a release therefore never hides a slot the balancer just freed.
//! - An endpoint whose agent went away stays known while requests are in
//!   flight to it (ineligible for new work) and is forgotten when they finish.
//! - A slot is free only when the engine's slot is free. llama-server goes
//!   on generating a non-streamed answer after its client left (measured:
//!   1,500 tokens ran on for 28.8 s), so a lease whose client left before
//!   the answer ended is *orphaned* ([`Registry::orphan`]), not released: it
//!   stays in `in_flight` until a later report shows the engine with no more
//!   busy slots than the balancer's live requests explain
//!   (`slots_busy ≤ in_flight − orphans`, oldest orphans first), or
//!   [`ORPHAN_MAX_AGE`] passed, or the agent went away. Streamed llama.cpp
//!   requests stop within 0.05 s of the disconnect, and vLLM and SGLang
//!   abort on disconnect: those leases are released at once.
//!
//! Scheduling: a request names a [`Route`] (its model and prompt prefix).
//! Only endpoints that serve the model, are eligible (ready, not draining,
//! not stale, circuit closed) and are not saturated are candidates; the
//! weighted scorers of [`crate::scorer`] pick among them, ties at random.
//! The chosen endpoint remembers the request's prompt blocks
//! ([`crate::prefix`]).
//!
//! Circuit breaker: `failures` consecutive upstream failures (connection
//! errors and 5xx answers, never 4xx) open the circuit for `backoff`; the
//! endpoint then comes back on its own. A failure right after it comes back
//! opens it again for twice as long (up to `max_backoff`); a success closes it
//! and forgets the failures.
//!
//! Saturation detector: an eligible endpoint takes new work only while it
//! is not saturated ([`Saturation`]): a free slot by the balancer's own
//! count, fewer waiting requests than `queue_depth_threshold`, KV-cache use
//! below `kv_cache_util_threshold`, and metrics younger than the staleness
//! threshold. The threshold is never shorter than two of the agent's own
//! report intervals, so an agent that reports less often than the threshold
//! slows dispatch down instead of freezing it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::prefix::{PrefixConfig, PrefixLru};
use crate::protocol::{AgentReport, BackendHealth, ReportError};
use crate::scorer::{Candidate, ScorerWeights, TieBreaker};

/// Reports older than this many monitoring intervals make an agent stale.
pub const STALE_AFTER_INTERVALS: u32 = 3;

/// When an endpoint counts as saturated (GIE's `saturationDetector`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationConfig {
    /// Saturated when the server reports at least this many waiting requests.
    pub queue_depth_threshold: u32,
    /// Saturated when the server reports at least this KV-cache use (0..=1).
    pub kv_cache_util_threshold: f64,
    /// Saturated when the last report is older than this (or than two of the
    /// agent's intervals, whichever is longer).
    pub metrics_staleness_threshold: Duration,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        SaturationConfig {
            queue_depth_threshold: 5,
            kv_cache_util_threshold: 0.8,
            metrics_staleness_threshold: Duration::from_millis(200),
        }
    }
}

/// Why an endpoint takes no new work for now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Saturation {
    /// Every slot is in use (by the balancer's count plus foreign load).
    SlotsFull,
    /// The server's own waiting queue reached the threshold.
    QueueDepth,
    /// KV-cache use reached the threshold.
    KvCache,
    /// The last report is too old to trust.
    StaleMetrics,
}

impl Saturation {
    /// The reason as a metric label (same as its JSON form).
    pub fn as_str(self) -> &'static str {
        match self {
            Saturation::SlotsFull => "slots-full",
            Saturation::QueueDepth => "queue-depth",
            Saturation::KvCache => "kv-cache",
            Saturation::StaleMetrics => "stale-metrics",
        }
    }
}

/// Agents one balancer takes: a report from a new agent beyond is refused.
pub const MAX_AGENTS: usize = 2048;
/// Distinct model names the balancer remembers: a report naming a new one
/// beyond is refused (they become `/v1/models` entries and metric labels).
pub const MAX_MODEL_NAMES: usize = 4096;

/// The longest an orphaned slot ([`Registry::orphan`]) stays counted busy
/// when no report frees it: a lost or confused agent cannot hold a slot
/// forever.
pub const ORPHAN_MAX_AGE: Duration = Duration::from_secs(300);

/// How long a model stays known (requests for it are queued, not refused
/// with 404) after the last endpoint serving it went away, so a rolling
/// restart does not turn into errors.
pub const MODEL_MEMORY: Duration = Duration::from_secs(300);

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
}

impl Route {
    /// Whether two routes may go to the same endpoints.
    pub(crate) fn same_targets(&self, other: &Route) -> bool {
        self.model == other.model && self.avoid == other.avoid && self.subset == other.subset
    }
}

/// The circuit breaker's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the circuit; 0 disables the breaker.
    pub failures: u32,
    /// How long the circuit stays open the first time.
    pub backoff: Duration,
    /// The longest it stays open after repeated trips.
    pub max_backoff: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures: 3,
            backoff: Duration::from_secs(5),
            max_backoff: Duration::from_secs(60),
        }
    }
}

/// How endpoints are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulingConfig {
    pub scorers: ScorerWeights,
    pub prefix: PrefixConfig,
    pub breaker: BreakerConfig,
    /// How long a queued request may wait for a saturated endpoint that
    /// holds most of its prompt, rather than go to a free one that does not
    /// (see [`Registry::pick`]); zero: never.
    pub affinity_hold: Duration,
    /// Seed of the tie-breaking random source.
    pub seed: u64,
}

impl Default for SchedulingConfig {
    fn default() -> Self {
        SchedulingConfig {
            scorers: ScorerWeights::default(),
            prefix: PrefixConfig::default(),
            breaker: BreakerConfig::default(),
            affinity_hold: Duration::from_millis(200),
            seed: 0x5eed,
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Breaker {
    consecutive_failures: u32,
    /// Times the circuit opened since the last success.
    trips: u32,
    open_until: Option<Instant>,
}

impl Breaker {
    fn is_open(&self, now: Instant) -> bool {
        self.open_until.is_some_and(|t| now < t)
    }

    /// Counts a failure; `true` when it opened the circuit.
    fn failure(&mut self, now: Instant, config: &BreakerConfig) -> bool {
        if config.failures == 0 || self.is_open(now) {
            return false;
        }
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        if self.consecutive_failures < config.failures {
            return false;
        }
        let backoff = config
            .backoff
            .saturating_mul(1u32 << self.trips.min(16))
            .min(config.max_backoff);
        self.open_until = Some(now + backoff);
        self.trips = self.trips.saturating_add(1);
        true
    }

    fn success(&mut self) {
        *self = Breaker::default();
    }
}

/// Identifies an endpoint for the life of the process (never reused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct EndpointId(pub u64);

/// The right to send one request to one endpoint. Not `Clone`: the slot is
/// given back by passing the lease to [`crate::Dispatcher::release`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a lease holds an endpoint slot until it is released"]
pub struct Lease {
    pub endpoint: EndpointId,
    pub addr: SocketAddr,
}

#[derive(Debug, Clone)]
pub(crate) struct AgentState {
    pub(crate) report: AgentReport,
    pub(crate) received_at: Instant,
}

#[derive(Debug)]
pub(crate) struct Endpoint {
    pub(crate) id: EndpointId,
    pub(crate) addr: SocketAddr,
    /// `None` once the agent deregistered or was dropped as stale.
    pub(crate) agent: Option<AgentState>,
    pub(crate) in_flight: u32,
    /// Highest `in_flight` since the last report (see module docs).
    in_flight_peak: u32,
    /// Busy slots the balancer did not cause, from the last report.
    foreign_busy: u32,
    /// The agent the last take-over displaced (to tell two agents taking
    /// turns from a new owner).
    displaced: Option<String>,
    /// When each orphaned slot (counted in `in_flight`) was orphaned,
    /// oldest first.
    orphans: std::collections::VecDeque<Instant>,
    breaker: Breaker,
    /// Prompt blocks recently sent here.
    prefix: PrefixLru,
}

impl Endpoint {
    fn stale_deadline(agent: &AgentState) -> Instant {
        agent.received_at + agent.report.monitoring_interval() * STALE_AFTER_INTERVALS
    }

    /// Whether the endpoint may receive new work at `now` (once it is not
    /// saturated).
    pub(crate) fn eligible(&self, now: Instant) -> bool {
        match &self.agent {
            Some(a) => {
                a.report.health == BackendHealth::Ready
                    && !a.report.draining
                    && now < Self::stale_deadline(a)
                    && !self.breaker.is_open(now)
            }
            None => false,
        }
    }

    /// Serves the route's model, is not the endpoint it avoids, and is in
    /// its subset if it has one.
    fn fits(&self, route: &Route) -> bool {
        Some(self.addr) != route.avoid
            && route
                .subset
                .as_ref()
                .is_none_or(|s| s.binary_search(&self.addr).is_ok())
            && self.serves(route.model.as_deref())
    }

    /// Eligible and not saturated.
    fn available(&self, now: Instant, config: &SaturationConfig) -> bool {
        self.eligible(now) && self.saturation(now, config).is_none()
    }

    /// Whether the endpoint answers for `model` (an agent that lists no
    /// models is taken to serve any).
    fn serves(&self, model: Option<&str>) -> bool {
        match (&self.agent, model) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(a), Some(m)) => {
                a.report.models.is_empty() || a.report.models.iter().any(|x| x == m)
            }
        }
    }

    pub(crate) fn slots_total(&self) -> u32 {
        self.agent.as_ref().map_or(0, |a| a.report.slots_total)
    }

    /// Why the endpoint cannot take work now, if it cannot (checked on
    /// eligible endpoints).
    pub(crate) fn saturation(&self, now: Instant, config: &SaturationConfig) -> Option<Saturation> {
        let a = self.agent.as_ref()?;
        let staleness = config
            .metrics_staleness_threshold
            .max(a.report.monitoring_interval() * 2);
        if now.saturating_duration_since(a.received_at) > staleness {
            Some(Saturation::StaleMetrics)
        } else if self.free_slots() == 0 {
            Some(Saturation::SlotsFull)
        } else if a.report.requests_waiting >= config.queue_depth_threshold {
            Some(Saturation::QueueDepth)
        } else if a
            .report
            .kv_cache_usage
            .is_some_and(|kv| kv >= config.kv_cache_util_threshold)
        {
            Some(Saturation::KvCache)
        } else {
            None
        }
    }

    /// Gives back the `n` oldest orphaned slots.
    fn free_orphans(&mut self, n: usize) {
        let n = n.min(self.orphans.len());
        self.orphans.drain(..n);
        self.in_flight -= n as u32;
    }

    /// Slots the balancer may still fill.
    pub(crate) fn free_slots(&self) -> u32 {
        self.slots_total()
            .saturating_sub(self.in_flight)
            .saturating_sub(self.foreign_busy)
    }
}

/// Read-only view of one endpoint, for the management API and metrics.
#[derive(Debug, Clone, Serialize)]
pub struct EndpointSnapshot {
    pub id: EndpointId,
    pub addr: SocketAddr,
    /// `None` when the agent is gone and in-flight requests are finishing.
    pub agent: Option<AgentReport>,
    /// Milliseconds since the last report.
    pub report_age_ms: Option<u64>,
    pub stale: bool,
    pub eligible: bool,
    /// Why an eligible endpoint takes no new work now (`null`: it does).
    pub saturation: Option<Saturation>,
    pub in_flight: u32,
    /// Of `in_flight`: slots whose client left while the engine still works
    /// on them.
    pub orphaned: u32,
    pub foreign_busy: u32,
    pub free_slots: u32,
    /// Milliseconds until the circuit breaker lets work through again
    /// (`null`: closed).
    pub circuit_open_ms: Option<u64>,
    pub consecutive_failures: u32,
    /// Prompt blocks the prefix index remembers for this endpoint.
    pub prefix_blocks: usize,
}

/// What happened to a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportOutcome {
    /// First report of this agent for this endpoint.
    Registered(EndpointId),
    Updated(EndpointId),
    /// This agent took the endpoint over from another agent id.
    TookOver(EndpointId),
    /// Two agents watch one server and report in turn: this one took it
    /// back from the agent that last took it from this one (counted as an
    /// update; the first take-over of the pair was already reported).
    TookBack(EndpointId),
}

/// What [`Registry::pick`] found for a request.
#[derive(Debug)]
pub(crate) enum Pick {
    /// A slot on the chosen endpoint.
    Lease(Lease),
    /// Better wait: a saturated endpoint holds most of the prompt.
    Hold,
    /// No endpoint can take it now.
    Busy,
}

/// All endpoints the balancer knows.
#[derive(Debug)]
pub(crate) struct Registry {
    saturation: SaturationConfig,
    scheduling: SchedulingConfig,
    endpoints: HashMap<EndpointId, Endpoint>,
    by_addr: HashMap<SocketAddr, EndpointId>,
    by_agent: HashMap<String, EndpointId>,
    /// Every model an agent reported, with when it last did.
    models: HashMap<Arc<str>, Instant>,
    next_id: u64,
    ties: TieBreaker,
    /// Scratch space of `acquire`: candidates, and the best of them.
    candidates: Vec<EndpointId>,
    best: Vec<EndpointId>,
}

impl Default for Registry {
    fn default() -> Self {
        Registry::new(SaturationConfig::default(), SchedulingConfig::default())
    }
}

impl Registry {
    pub(crate) fn new(saturation: SaturationConfig, scheduling: SchedulingConfig) -> Self {
        Registry {
            saturation,
            scheduling,
            endpoints: HashMap::new(),
            by_addr: HashMap::new(),
            by_agent: HashMap::new(),
            models: HashMap::new(),
            next_id: 0,
            ties: TieBreaker::new(scheduling.seed),
            candidates: Vec::new(),
            best: Vec::new(),
        }
    }

    /// Refuses a report that would grow the registry past its bounds: a new
    /// agent beyond [`MAX_AGENTS`], a new model name beyond
    /// [`MAX_MODEL_NAMES`].
    pub(crate) fn check_bounds(&self, report: &AgentReport) -> Result<(), ReportError> {
        if !self.by_agent.contains_key(&report.agent_id) && self.by_agent.len() >= MAX_AGENTS {
            return Err(ReportError::TooManyAgents(MAX_AGENTS));
        }
        let new_names = report
            .models
            .iter()
            .filter(|m| !self.models.contains_key(m.as_str()))
            .count();
        if self.models.len() + new_names > MAX_MODEL_NAMES {
            return Err(ReportError::TooManyModelNames(MAX_MODEL_NAMES));
        }
        Ok(())
    }

    /// Applies a validated report (`addr` is its parsed `external_addr`).
    pub(crate) fn apply_report(
        &mut self,
        report: AgentReport,
        addr: SocketAddr,
        now: Instant,
    ) -> ReportOutcome {
        // The agent moved to another address: detach it from the old one.
        if let Some(&old) = self.by_agent.get(&report.agent_id) {
            if self.endpoints.get(&old).map(|e| e.addr) != Some(addr) {
                self.detach_agent_from(old);
            }
        }
        let id = match self.by_addr.get(&addr) {
            Some(&id) => id,
            None => {
                self.next_id += 1;
                let id = EndpointId(self.next_id);
                self.endpoints.insert(
                    id,
                    Endpoint {
                        id,
                        addr,
                        agent: None,
                        in_flight: 0,
                        in_flight_peak: 0,
                        foreign_busy: 0,
                        displaced: None,
                        orphans: Default::default(),
                        breaker: Breaker::default(),
                        prefix: PrefixLru::new(self.scheduling.prefix.capacity_blocks),
                    },
                );
                self.by_addr.insert(addr, id);
                id
            }
        };
        let ep = self
            .endpoints
            .get_mut(&id)
            .expect("indexed endpoint exists");
        let outcome = match &ep.agent {
            None => ReportOutcome::Registered(id),
            Some(a) if a.report.agent_id == report.agent_id => ReportOutcome::Updated(id),
            Some(a) => {
                let previous = a.report.agent_id.clone();
                self.by_agent.remove(&previous);
                let back = ep.displaced.as_deref() == Some(report.agent_id.as_str());
                ep.displaced = Some(previous);
                if back {
                    ReportOutcome::TookBack(id)
                } else {
                    ReportOutcome::TookOver(id)
                }
            }
        };
        ep.foreign_busy = report.slots_busy.saturating_sub(ep.in_flight_peak);
        // Orphans the engine no longer works on: busy slots beyond what the
        // balancer's live requests explain are still orphans; the rest are
        // free (oldest first).
        let live = ep.in_flight.saturating_sub(ep.orphans.len() as u32);
        let running_orphans = report.slots_busy.saturating_sub(live);
        let done = (ep.orphans.len() as u32).saturating_sub(running_orphans);
        ep.free_orphans(done as usize);
        ep.in_flight_peak = ep.in_flight;
        for m in &report.models {
            match self.models.get_mut(m.as_str()) {
                Some(seen) => *seen = now,
                None => {
                    self.models.insert(Arc::from(m.as_str()), now);
                }
            }
        }
        self.by_agent.insert(report.agent_id.clone(), id);
        ep.agent = Some(AgentState {
            report,
            received_at: now,
        });
        outcome
    }

    fn detach_agent_from(&mut self, id: EndpointId) {
        if let Some(ep) = self.endpoints.get_mut(&id) {
            if let Some(a) = ep.agent.take() {
                self.by_agent.remove(&a.report.agent_id);
            }
            ep.foreign_busy = 0;
            // No report can free them any more, and the endpoint takes no
            // new work: nothing is left to protect.
            ep.free_orphans(ep.orphans.len());
            if ep.in_flight == 0 {
                self.forget(id);
            }
        }
    }

    fn forget(&mut self, id: EndpointId) {
        if let Some(ep) = self.endpoints.remove(&id) {
            self.by_addr.remove(&ep.addr);
        }
    }

    /// Removes an agent; its endpoint lingers while requests are in flight.
    pub(crate) fn deregister(&mut self, agent_id: &str) -> bool {
        match self.by_agent.get(agent_id).copied() {
            Some(id) => {
                self.detach_agent_from(id);
                true
            }
            None => false,
        }
    }

    /// Drops agents whose last report is older than three intervals, and
    /// models not reported for [`MODEL_MEMORY`]. Returns the ids of the
    /// agents dropped.
    pub(crate) fn drop_stale(&mut self, now: Instant) -> Vec<String> {
        self.models
            .retain(|_, seen| now.saturating_duration_since(*seen) < MODEL_MEMORY);
        for ep in self.endpoints.values_mut() {
            let old = ep
                .orphans
                .iter()
                .take_while(|t| now.saturating_duration_since(**t) >= ORPHAN_MAX_AGE)
                .count();
            ep.free_orphans(old);
        }
        let stale: Vec<(EndpointId, String)> = self
            .endpoints
            .values()
            .filter_map(|e| {
                let a = e.agent.as_ref()?;
                (now >= Endpoint::stale_deadline(a)).then(|| (e.id, a.report.agent_id.clone()))
            })
            .collect();
        stale
            .into_iter()
            .map(|(id, agent)| {
                self.detach_agent_from(id);
                agent
            })
            .collect()
    }

    /// Picks the best endpoint for `route` among those that serve its
    /// model and are eligible and not saturated (see the module docs), and
    /// takes one of its slots.
    #[cfg(test)]
    pub(crate) fn acquire(&mut self, route: &Route, now: Instant) -> Option<Lease> {
        match self.pick(route, now, false) {
            Pick::Lease(lease) => Some(lease),
            Pick::Hold | Pick::Busy => None,
        }
    }

    /// [`Registry::acquire`], except that with `may_hold` a request whose
    /// prompt is better cached on a saturated endpoint is told to wait for
    /// it ([`Pick::Hold`]): when that endpoint holds at least half of the
    /// request's prompt blocks and more than any candidate does. Waiting a
    /// little for the server that already has the prompt beats prefilling
    /// it again elsewhere; the caller bounds the wait.
    pub(crate) fn pick(&mut self, route: &Route, now: Instant, may_hold: bool) -> Pick {
        let config = self.saturation;
        self.candidates.clear();
        self.candidates.extend(
            self.endpoints
                .values()
                .filter(|e| e.fits(route) && e.available(now, &config))
                .map(|e| e.id),
        );
        if self.candidates.is_empty() {
            return Pick::Busy;
        }
        if may_hold && self.better_cached_elsewhere(route, now) {
            return Pick::Hold;
        }
        let chosen = match self.candidates.len() {
            // The usual case at saturation: the one endpoint a slot freed on.
            1 => self.candidates[0],
            _ => self.best_candidate(route),
        };
        let ep = self.endpoints.get_mut(&chosen).expect("candidate exists");
        ep.in_flight += 1;
        ep.in_flight_peak = ep.in_flight_peak.max(ep.in_flight);
        ep.prefix.insert(&route.prefix);
        Pick::Lease(Lease {
            endpoint: ep.id,
            addr: ep.addr,
        })
    }

    /// Whether an eligible but saturated endpoint that serves the route
    /// holds at least half of its prompt blocks, and more than every
    /// candidate (filled in by `pick`). Busy endpoints are looked at
    /// first: with none, nothing more is matched.
    fn better_cached_elsewhere(&self, route: &Route, now: Instant) -> bool {
        let blocks = route.prefix.len();
        if self.scheduling.scorers.prefix_cache <= 0.0 || blocks == 0 {
            return false;
        }
        let config = self.saturation;
        let busy = self
            .endpoints
            .values()
            .filter(|e| e.fits(route) && e.eligible(now) && !e.available(now, &config))
            .map(|e| e.prefix.matched(&route.prefix))
            .max()
            .unwrap_or(0);
        if busy * 2 < blocks {
            return false;
        }
        let free = self
            .candidates
            .iter()
            .map(|id| self.endpoints[id].prefix.matched(&route.prefix))
            .max()
            .unwrap_or(0);
        busy > free
    }

    /// The highest-scoring of several candidates, ties at random.
    fn best_candidate(&mut self, route: &Route) -> EndpointId {
        let weights = self.scheduling.scorers;
        let blocks = route.prefix.len();
        let score_prefix = weights.prefix_cache > 0.0 && blocks > 0;
        let mut best_score = f64::NEG_INFINITY;
        self.best.clear();
        for id in &self.candidates {
            let e = &self.endpoints[id];
            let report = &e
                .agent
                .as_ref()
                .expect("eligible endpoints have an agent")
                .report;
            let score = weights.score(&Candidate {
                prefix_matched: if score_prefix {
                    e.prefix.matched(&route.prefix)
                } else {
                    0
                },
                prefix_blocks: blocks,
                free_slots: e.free_slots(),
                slots_total: e.slots_total(),
                kv_cache_usage: report.kv_cache_usage,
                requests_waiting: report.requests_waiting,
                queue_depth_threshold: self.saturation.queue_depth_threshold,
            });
            // Scores are sums of a few ratios: closer than this is a tie.
            const TIE: f64 = 1e-9;
            if score > best_score + TIE {
                best_score = score;
                self.best.clear();
                self.best.push(e.id);
            } else if score >= best_score - TIE {
                self.best.push(e.id);
            }
        }
        match self.best.len() {
            1 => self.best[0],
            n => {
                // HashMap order varies: sort so the seed alone decides.
                self.best.sort_unstable();
                self.best[self.ties.below(n)]
            }
        }
    }

    /// Whether some endpoint could take work now, for any model.
    pub(crate) fn any_available(&self, now: Instant) -> bool {
        let config = self.saturation;
        self.endpoints.values().any(|e| e.available(now, &config))
    }

    /// Whether an eligible endpoint fits `route` and is not `except` (it
    /// may be busy): waiting can help, or a retry has somewhere to go.
    pub(crate) fn has_eligible(
        &self,
        route: &Route,
        except: Option<SocketAddr>,
        now: Instant,
    ) -> bool {
        self.endpoints
            .values()
            .any(|e| Some(e.addr) != except && e.fits(route) && e.eligible(now))
    }

    /// Whether requests for `model` are accepted: it is served or was
    /// lately, any endpoint will do (`None`, or an agent listing no models),
    /// or no agent is registered at all (the fleet may be scaling up from
    /// zero, so requests wait for it).
    pub(crate) fn model_known(&self, model: Option<&str>, now: Instant) -> bool {
        let Some(m) = model else { return true };
        let mut agents = self
            .endpoints
            .values()
            .filter(|e| e.agent.is_some())
            .peekable();
        if agents.peek().is_none() {
            return true;
        }
        agents.any(|e| e.serves(Some(m)))
            || self
                .models
                .get(m)
                .is_some_and(|seen| now.saturating_duration_since(*seen) < MODEL_MEMORY)
    }

    /// Whether some agent reported serving `model` within [`MODEL_MEMORY`].
    pub(crate) fn model_reported(&self, model: &str) -> bool {
        self.models.contains_key(model)
    }

    /// Records how a request to `endpoint` ended: `false` for a connection
    /// failure or a 5xx answer. `true` when this failure opened the circuit.
    pub(crate) fn record_outcome(&mut self, endpoint: EndpointId, ok: bool, now: Instant) -> bool {
        let Some(ep) = self.endpoints.get_mut(&endpoint) else {
            return false;
        };
        if ok {
            ep.breaker.success();
            false
        } else {
            ep.breaker.failure(now, &self.scheduling.breaker)
        }
    }

    /// Gives a slot back. Consuming the lease makes a double release a
    /// compile error rather than an accounting bug.
    pub(crate) fn release(&mut self, lease: Lease) {
        let Some(ep) = self.endpoints.get_mut(&lease.endpoint) else {
            debug_assert!(false, "lease for an unknown endpoint {:?}", lease.endpoint);
            return;
        };
        debug_assert!(ep.in_flight > 0, "release without an in-flight request");
        ep.in_flight = ep.in_flight.saturating_sub(1);
        if ep.in_flight == 0 && ep.agent.is_none() {
            self.forget(lease.endpoint);
        }
    }

    /// Gives back the slot of a request whose client left before its
    /// answer ended: at once when the engine stops on a disconnect (a
    /// streamed request, or vLLM and SGLang), else it stays counted busy as
    /// an orphan until a report shows it free (see the module docs).
    pub(crate) fn orphan(&mut self, lease: Lease, streamed: bool, now: Instant) {
        let keeps_working = self.endpoints.get(&lease.endpoint).is_some_and(|ep| {
            !streamed
                && ep
                    .agent
                    .as_ref()
                    .is_some_and(|a| a.report.backend == crate::protocol::BackendKind::Llamacpp)
        });
        if !keeps_working {
            self.release(lease);
            return;
        }
        let ep = self
            .endpoints
            .get_mut(&lease.endpoint)
            .expect("checked above");
        ep.orphans.push_back(now);
    }

    /// Requests the balancer has in flight to an endpoint.
    pub(crate) fn in_flight_of(&self, id: EndpointId) -> u32 {
        self.endpoints.get(&id).map_or(0, |e| e.in_flight)
    }

    /// Whether any endpoint could take work now or after its load drains.
    pub(crate) fn any_eligible(&self, now: Instant) -> bool {
        self.endpoints.values().any(|e| e.eligible(now))
    }

    /// The earliest instant at which some agent turns stale, if any.
    pub(crate) fn next_stale_deadline(&self) -> Option<Instant> {
        self.endpoints
            .values()
            .filter_map(|e| e.agent.as_ref().map(Endpoint::stale_deadline))
            .min()
    }

    /// Of [`Registry::total_in_flight`]: orphaned slots, whose clients left.
    pub(crate) fn total_orphaned(&self) -> u64 {
        self.endpoints
            .values()
            .map(|e| e.orphans.len() as u64)
            .sum()
    }

    pub(crate) fn total_in_flight(&self) -> u64 {
        self.endpoints
            .values()
            .map(|e| u64::from(e.in_flight))
            .sum()
    }

    pub(crate) fn snapshot(&self, now: Instant) -> Vec<EndpointSnapshot> {
        let mut out: Vec<EndpointSnapshot> = self
            .endpoints
            .values()
            .map(|e| EndpointSnapshot {
                id: e.id,
                addr: e.addr,
                agent: e.agent.as_ref().map(|a| a.report.clone()),
                report_age_ms: e.agent.as_ref().map(|a| {
                    u64::try_from(now.saturating_duration_since(a.received_at).as_millis())
                        .unwrap_or(u64::MAX)
                }),
                stale: e
                    .agent
                    .as_ref()
                    .is_some_and(|a| now >= Endpoint::stale_deadline(a)),
                eligible: e.eligible(now),
                saturation: if e.eligible(now) {
                    e.saturation(now, &self.saturation)
                } else {
                    None
                },
                in_flight: e.in_flight,
                orphaned: e.orphans.len() as u32,
                foreign_busy: e.foreign_busy,
                free_slots: e.free_slots(),
                circuit_open_ms: e.breaker.open_until.and_then(|t| {
                    (now < t).then(|| u64::try_from((t - now).as_millis()).unwrap_or(u64::MAX))
                }),
                consecutive_failures: e.breaker.consecutive_failures,
                prefix_blocks: e.prefix.len(),
            })
            .collect();
        out.sort_by_key(|s| s.id);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::tests::report;
    use std::time::Duration;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn registry_with(slots: u32, now: Instant) -> Registry {
        let mut r = Registry::default();
        r.apply_report(report("a", "127.0.0.1:1", slots), addr("127.0.0.1:1"), now);
        r
    }

    #[test]
    fn leases_never_exceed_reported_slots() {
        let now = Instant::now();
        let mut r = registry_with(2, now);
        let l1 = r.acquire(&Route::default(), now).unwrap();
        let l2 = r.acquire(&Route::default(), now).unwrap();
        assert!(r.acquire(&Route::default(), now).is_none());
        r.release(l1);
        let l3 = r.acquire(&Route::default(), now).unwrap();
        r.release(l2);
        r.release(l3);
        assert_eq!(r.total_in_flight(), 0);
    }

    #[test]
    fn a_report_never_resets_the_in_flight_count() {
        let now = Instant::now();
        let mut r = registry_with(4, now);
        let leases: Vec<_> = (0..3)
            .map(|_| r.acquire(&Route::default(), now).unwrap())
            .collect();
        // The agent scraped before our requests arrived: it says 0 busy.
        r.apply_report(report("a", "127.0.0.1:1", 4), addr("127.0.0.1:1"), now);
        assert_eq!(r.total_in_flight(), 3);
        assert!(r.acquire(&Route::default(), now).is_some(), "one slot left");
        assert!(r.acquire(&Route::default(), now).is_none(), "and only one");
        for l in leases {
            r.release(l);
        }
    }

    #[test]
    fn a_lagging_report_does_not_hide_a_slot_just_freed() {
        let now = Instant::now();
        let mut r = registry_with(2, now);
        let l1 = r.acquire(&Route::default(), now).unwrap();
        let l2 = r.acquire(&Route::default(), now).unwrap();
        r.release(l1);
        // Scraped while both of ours were busy.
        let mut busy = report("a", "127.0.0.1:1", 2);
        busy.slots_busy = 2;
        r.apply_report(busy, addr("127.0.0.1:1"), now);
        assert!(
            r.acquire(&Route::default(), now).is_some(),
            "the freed slot is usable at once"
        );
        let _ = l2;
    }

    #[test]
    fn a_slot_whose_client_left_stays_busy_until_the_engine_is_done() {
        let t0 = Instant::now();
        let mut r = registry_with(1, t0);
        let lease = r.acquire(&Route::default(), t0).unwrap();
        // llama-server goes on with a non-streamed answer after its client
        // left: the slot is not free.
        r.orphan(lease, false, t0);
        assert!(r.acquire(&Route::default(), t0).is_none(), "still busy");
        assert_eq!(r.snapshot(t0)[0].orphaned, 1);
        let mut busy = report("a", "127.0.0.1:1", 1);
        busy.slots_busy = 1;
        let t1 = t0 + Duration::from_millis(100);
        r.apply_report(busy.clone(), addr("127.0.0.1:1"), t1);
        assert!(
            r.acquire(&Route::default(), t1).is_none(),
            "the engine says busy"
        );
        // The engine finished: the next report shows the slot idle.
        busy.slots_busy = 0;
        let t2 = t1 + Duration::from_millis(100);
        r.apply_report(busy, addr("127.0.0.1:1"), t2);
        assert_eq!(r.snapshot(t2)[0].orphaned, 0);
        let next = r.acquire(&Route::default(), t2).expect("free now");
        r.release(next);
        assert_eq!(r.total_in_flight(), 0);
    }

    #[test]
    fn orphans_beside_live_requests_are_freed_only_by_what_the_engine_shows() {
        let t0 = Instant::now();
        let mut r = registry_with(3, t0);
        let live = r.acquire(&Route::default(), t0).unwrap();
        let gone = r.acquire(&Route::default(), t0).unwrap();
        r.orphan(gone, false, t0);
        let mut rep = report("a", "127.0.0.1:1", 3);
        // Our live request and the orphan both run.
        rep.slots_busy = 2;
        r.apply_report(rep.clone(), addr("127.0.0.1:1"), t0);
        assert_eq!(r.total_in_flight(), 2);
        // One busy slot: the live request explains it; the orphan is done.
        rep.slots_busy = 1;
        r.apply_report(rep, addr("127.0.0.1:1"), t0);
        assert_eq!(r.total_in_flight(), 1);
        r.release(live);
        assert_eq!(r.total_in_flight(), 0);
    }

    #[test]
    fn an_orphan_is_freed_at_once_when_the_engine_stops_with_its_client() {
        let t0 = Instant::now();
        let mut r = registry_with(1, t0);
        let streamed = r.acquire(&Route::default(), t0).unwrap();
        r.orphan(streamed, true, t0);
        assert_eq!(r.total_in_flight(), 0, "a streamed llama.cpp answer stops");
        let mut vllm = report("v", "127.0.0.1:2", 1);
        vllm.backend = crate::protocol::BackendKind::Vllm;
        r.apply_report(vllm, addr("127.0.0.1:2"), t0);
        let on_vllm = r
            .acquire(
                &Route {
                    subset: Some(vec![addr("127.0.0.1:2")].into()),
                    ..Route::default()
                },
                t0,
            )
            .unwrap();
        r.orphan(on_vllm, false, t0);
        assert_eq!(r.total_in_flight(), 0, "vLLM aborts on disconnect");
    }

    #[test]
    fn a_lost_agent_cannot_hold_an_orphan_forever() {
        let t0 = Instant::now();
        let mut r = registry_with(1, t0);
        let lease = r.acquire(&Route::default(), t0).unwrap();
        r.orphan(lease, false, t0);
        let mut busy = report("a", "127.0.0.1:1", 1);
        busy.slots_busy = 1;
        // The agent keeps saying busy (or is confused): the bound frees it.
        let late = t0 + ORPHAN_MAX_AGE - Duration::from_millis(1);
        r.apply_report(busy, addr("127.0.0.1:1"), late);
        r.drop_stale(late);
        assert_eq!(r.total_in_flight(), 1);
        r.drop_stale(t0 + ORPHAN_MAX_AGE);
        assert_eq!(r.total_in_flight(), 0);
        // An agent that goes away frees them too (nothing can report them).
        let l = r.acquire(&Route::default(), late).unwrap();
        r.orphan(l, false, late);
        r.deregister("a");
        assert_eq!(r.total_in_flight(), 0);
    }

    #[test]
    fn load_from_other_clients_reduces_free_slots() {
        let now = Instant::now();
        let mut r = registry_with(4, now);
        let mut busy = report("a", "127.0.0.1:1", 4);
        busy.slots_busy = 3; // none of them ours
        r.apply_report(busy, addr("127.0.0.1:1"), now);
        assert!(r.acquire(&Route::default(), now).is_some());
        assert!(r.acquire(&Route::default(), now).is_none());
    }

    #[test]
    fn two_agents_on_one_server_do_not_double_its_capacity() {
        let now = Instant::now();
        let mut r = registry_with(2, now);
        let out = r.apply_report(report("b", "127.0.0.1:1", 2), addr("127.0.0.1:1"), now);
        assert!(matches!(out, ReportOutcome::TookOver(_)));
        assert!(r.acquire(&Route::default(), now).is_some());
        assert!(r.acquire(&Route::default(), now).is_some());
        assert!(r.acquire(&Route::default(), now).is_none());
        assert_eq!(r.snapshot(now).len(), 1);
        // Taking turns is one change of owner, reported once.
        for _ in 0..3 {
            let a = r.apply_report(report("a", "127.0.0.1:1", 2), addr("127.0.0.1:1"), now);
            assert!(matches!(a, ReportOutcome::TookBack(_)), "{a:?}");
            let b = r.apply_report(report("b", "127.0.0.1:1", 2), addr("127.0.0.1:1"), now);
            assert!(matches!(b, ReportOutcome::TookBack(_)), "{b:?}");
        }
        let c = r.apply_report(report("c", "127.0.0.1:1", 2), addr("127.0.0.1:1"), now);
        assert!(matches!(c, ReportOutcome::TookOver(_)), "a new owner is");
    }

    #[test]
    fn stale_agents_get_no_work_and_are_dropped_after_in_flight_finishes() {
        let t0 = Instant::now();
        let mut r = registry_with(2, t0);
        let lease = r.acquire(&Route::default(), t0).unwrap();
        let stale = t0 + Duration::from_secs(3);
        assert!(r
            .acquire(&Route::default(), t0 + Duration::from_millis(1999))
            .is_some());
        assert!(
            r.acquire(&Route::default(), t0 + Duration::from_millis(2001))
                .is_none(),
            "metrics older than 2 intervals saturate"
        );
        assert!(r.snapshot(stale - Duration::from_millis(1))[0].eligible);
        assert!(!r.snapshot(stale)[0].eligible, "stale after 3 intervals");
        assert_eq!(r.drop_stale(stale), vec!["a".to_string()]);
        assert_eq!(
            r.snapshot(stale).len(),
            1,
            "kept while requests are in flight"
        );
        r.release(lease);
        assert_eq!(r.snapshot(stale).len(), 1, "one more lease is out");
    }

    #[test]
    fn deregistered_endpoint_is_forgotten_when_idle_and_rejoins_with_its_count() {
        let now = Instant::now();
        let mut r = registry_with(1, now);
        let lease = r.acquire(&Route::default(), now).unwrap();
        assert!(r.deregister("a"));
        assert!(!r.any_eligible(now));
        // It comes back before the request finished: the slot is still taken.
        r.apply_report(report("a2", "127.0.0.1:1", 1), addr("127.0.0.1:1"), now);
        assert!(r.acquire(&Route::default(), now).is_none());
        r.release(lease);
        assert!(r.acquire(&Route::default(), now).is_some());
        let mut r = registry_with(1, now);
        assert!(r.deregister("a"));
        assert!(r.snapshot(now).is_empty());
        assert!(!r.deregister("a"));
    }

    #[test]
    fn loading_unreachable_and_draining_endpoints_get_no_work() {
        let now = Instant::now();
        for f in [
            |r: &mut AgentReport| r.health = BackendHealth::Loading,
            |r: &mut AgentReport| r.health = BackendHealth::Unreachable,
            |r: &mut AgentReport| r.draining = true,
        ] {
            let mut rep = report("a", "127.0.0.1:1", 4);
            f(&mut rep);
            let mut r = Registry::default();
            r.apply_report(rep, addr("127.0.0.1:1"), now);
            assert!(r.acquire(&Route::default(), now).is_none());
        }
    }

    #[test]
    fn equal_endpoints_share_the_load() {
        let now = Instant::now();
        let mut r = Registry::default();
        r.apply_report(report("a", "127.0.0.1:1", 4), addr("127.0.0.1:1"), now);
        r.apply_report(report("b", "127.0.0.1:2", 4), addr("127.0.0.1:2"), now);
        let leases: Vec<_> = (0..4)
            .map(|_| r.acquire(&Route::default(), now).unwrap())
            .collect();
        let on_a = leases.iter().filter(|l| l.addr.port() == 1).count();
        assert_eq!(on_a, 2);
    }

    #[test]
    fn moving_agent_frees_its_old_address() {
        let now = Instant::now();
        let mut r = registry_with(1, now);
        r.apply_report(report("a", "127.0.0.1:2", 1), addr("127.0.0.1:2"), now);
        let snap = r.snapshot(now);
        assert_eq!(snap.len(), 1);
        assert_eq!(snap[0].addr.port(), 2);
    }

    fn report_for(id: &str, port: u16, slots: u32, models: &[&str]) -> (AgentReport, SocketAddr) {
        let a = format!("127.0.0.1:{port}");
        let mut rep = report(id, &a, slots);
        rep.models = models.iter().map(|m| m.to_string()).collect();
        (rep, addr(&a))
    }

    fn route(model: Option<&str>, prefix: &[u64]) -> Route {
        Route {
            model: model.map(Arc::from),
            prefix: prefix.to_vec(),
            avoid: None,
            subset: None,
        }
    }

    #[test]
    fn only_endpoints_serving_the_model_are_chosen() {
        let now = Instant::now();
        let mut r = Registry::default();
        for (id, port, models) in [
            ("a", 1, &["x"][..]),
            ("b", 2, &["y"][..]),
            ("c", 3, &[][..]),
        ] {
            let (rep, a) = report_for(id, port, 8, models);
            r.apply_report(rep, a, now);
        }
        for _ in 0..6 {
            let l = r.acquire(&route(Some("x"), &[]), now).unwrap();
            assert!(l.addr.port() == 1 || l.addr.port() == 3, "{l:?}");
            r.release(l);
        }
        assert!(r.model_known(Some("y"), now));
        assert!(r.model_known(Some("anything"), now), "c lists no models");
        r.deregister("c");
        assert!(!r.model_known(Some("anything"), now));
        assert!(r.model_known(None, now));
        // A model whose servers went away stays known for a while.
        r.deregister("b");
        assert!(r.model_known(Some("y"), now));
        assert!(r.acquire(&route(Some("y"), &[]), now).is_none());
        let later = now + MODEL_MEMORY;
        r.drop_stale(later);
        let (rep, a) = report_for("a", 1, 8, &["x"]);
        r.apply_report(rep, a, later);
        assert!(!r.model_known(Some("y"), later));
        // With no agent at all, every model waits for the fleet.
        r.deregister("a");
        assert!(r.model_known(Some("y"), later));
    }

    #[test]
    fn a_request_is_held_only_for_a_busy_endpoint_caching_most_of_its_prompt() {
        let now = Instant::now();
        let mut r = Registry::default();
        for (id, port) in [("a", 1), ("b", 2)] {
            let (rep, a) = report_for(id, port, 1, &[]);
            r.apply_report(rep, a, now);
        }
        let home = r.acquire(&route(None, &[1, 2, 3, 4]), now).unwrap();
        // The other endpoint is free: without a hold the request goes there.
        let turn = route(None, &[1, 2, 3, 4, 5, 6]);
        assert!(matches!(r.pick(&turn, now, true), Pick::Hold));
        // Less than half of the prompt cached there: not worth the wait.
        let long = route(None, &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        let Pick::Lease(elsewhere) = r.pick(&long, now, true) else {
            panic!("a request with a weak affinity must not be held");
        };
        assert_ne!(elsewhere.addr, home.addr);
        r.release(elsewhere);
        // The free endpoint now caches it too: nothing to wait for.
        let Pick::Lease(l) = r.pick(&turn, now, true) else {
            panic!("equally cached elsewhere: no hold");
        };
        assert_ne!(l.addr, home.addr);
        r.release(l);
        r.release(home);
    }

    #[test]
    fn prefix_affinity_wins_until_the_endpoint_saturates() {
        let now = Instant::now();
        let mut r = Registry::default();
        for (id, port) in [("a", 1), ("b", 2)] {
            let (rep, a) = report_for(id, port, 2, &[]);
            r.apply_report(rep, a, now);
        }
        let conversation = route(None, &[11, 12, 13, 14]);
        let first = r.acquire(&conversation, now).unwrap();
        let home = first.addr;
        // Same prefix: same endpoint, although the other has more free slots.
        let second = r.acquire(&conversation, now).unwrap();
        assert_eq!(second.addr, home);
        // Full: the next one spills to the other endpoint, never waits.
        let third = r.acquire(&conversation, now).unwrap();
        assert_ne!(third.addr, home);
        for l in [first, second, third] {
            r.release(l);
        }
    }

    #[test]
    fn without_shared_prefixes_load_stays_balanced() {
        let now = Instant::now();
        let mut r = Registry::default();
        for (id, port) in [("a", 1), ("b", 2), ("c", 3), ("d", 4)] {
            let (rep, a) = report_for(id, port, 8, &[]);
            r.apply_report(rep, a, now);
        }
        let mut per_port = [0u32; 5];
        let mut leases = Vec::new();
        for i in 0..32u64 {
            let l = r
                .acquire(&route(None, &[i * 1000, i * 1000 + 1]), now)
                .unwrap();
            per_port[l.addr.port() as usize] += 1;
            leases.push(l);
        }
        assert_eq!(&per_port[1..], &[8, 8, 8, 8]);
        // Ties are broken at random: single requests on idle equal
        // endpoints do not always land on the same one.
        for l in leases {
            r.release(l);
        }
        let mut seen = std::collections::HashSet::new();
        for i in 0..40u64 {
            let l = r.acquire(&route(None, &[i + 1_000_000]), now).unwrap();
            seen.insert(l.addr.port());
            r.release(l);
        }
        assert_eq!(seen.len(), 4, "{seen:?}");
    }

    #[test]
    fn a_retry_avoids_the_endpoint_that_failed() {
        let now = Instant::now();
        let mut r = Registry::default();
        for (id, port) in [("a", 1), ("b", 2)] {
            let (rep, a) = report_for(id, port, 4, &["m"]);
            r.apply_report(rep, a, now);
        }
        let mut retry = route(Some("m"), &[]);
        retry.avoid = Some(addr("127.0.0.1:1"));
        assert!(r.has_eligible(&retry, None, now));
        for _ in 0..4 {
            let l = r.acquire(&retry, now).unwrap();
            assert_eq!(l.addr.port(), 2);
            r.release(l);
        }
        r.deregister("b");
        assert!(!r.has_eligible(&retry, None, now));
        assert!(r.acquire(&retry, now).is_none());
    }

    #[test]
    fn the_circuit_opens_after_repeated_failures_and_closes_on_its_own() {
        let t0 = Instant::now();
        let mut r = Registry::default();
        let (mut rep, a) = report_for("a", 1, 4, &[]);
        rep.monitoring_interval_ms = 60_000;
        r.apply_report(rep, a, t0);
        let id = r.snapshot(t0)[0].id;
        assert!(!r.record_outcome(id, false, t0));
        assert!(
            !r.record_outcome(id, true, t0),
            "a success resets the count"
        );
        assert!(!r.record_outcome(id, false, t0));
        assert!(!r.record_outcome(id, false, t0));
        assert!(r.record_outcome(id, false, t0), "third failure in a row");
        assert!(r.acquire(&Route::default(), t0).is_none());
        assert_eq!(r.snapshot(t0)[0].circuit_open_ms, Some(5000));
        let back = t0 + Duration::from_secs(5);
        let l = r.acquire(&Route::default(), back).unwrap();
        r.release(l);
        // It fails again at once: open twice as long.
        assert!(r.record_outcome(id, false, back));
        assert!(r
            .acquire(&Route::default(), back + Duration::from_millis(9999))
            .is_none());
        let l = r
            .acquire(&Route::default(), back + Duration::from_secs(10))
            .unwrap();
        r.release(l);
        // A success closes it for good.
        assert!(!r.record_outcome(id, true, back + Duration::from_secs(10)));
        assert!(!r.record_outcome(id, false, back + Duration::from_secs(10)));
        assert!(r
            .acquire(&Route::default(), back + Duration::from_secs(10))
            .is_some());
    }
}
