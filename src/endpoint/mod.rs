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
//!   the reported busy slots less the balancer's own requests running when
//!   the agent read the engine ([`foreign`]).
//! - An endpoint whose agent went away stays known while requests are in
//!   flight to it (ineligible for new work) and is forgotten when they finish.
//! - A slot is free only when the engine's slot is free. llama-server goes
//!   on generating a non-streamed answer after its client left (measured:
//!   1,500 tokens ran on for 28.8 s), so a lease whose client left before
//!   the answer ended is *orphaned* ([`EndpointLedger::orphan`]), not released: it
//!   stays in `in_flight` until a later report shows the engine with no more
//!   busy slots than the balancer's live requests explain
//!   (`slots_busy ≤ in_flight − orphans`, oldest orphans first), or
//!   [`ORPHAN_MAX_AGE`] passed, or the agent went away. Streamed llama.cpp
//!   requests stop within 0.05 s of the disconnect, and vLLM and SGLang
//!   abort on disconnect: those leases are released at once.
//!
//! This module keeps the accounting only; which endpoint a request goes
//! to is [`crate::placement`]'s, which reads the fleet through [`view`]
//! and books what it decided here ([`EndpointLedger::book`]). The rooms:
//! [`route`] says what an endpoint makes of a request, [`saturation`] who
//! takes no new work, [`breaker`] takes failing endpoints out for a while,
//! [`ranking`] keeps the endpoints that may take work in order; this file
//! keeps the ledger.

mod adapters;
mod breaker;
mod cache_truth;
mod cost;
mod foreign;
mod models;
mod ranking;
mod route;
mod saturation;
mod snapshot;
mod view;

pub use snapshot::EndpointSnapshot;

pub(crate) use adapters::Wanted;
pub use breaker::BreakerConfig;
pub use route::{Route, SchedulingConfig, KEPT_SLOTS};
pub use saturation::{Saturation, SaturationConfig};

#[cfg(test)]
pub(crate) use adapters::tests as adapter_fixtures;
use breaker::Breaker;
pub use cache_truth::{CacheSeen, CacheTruth, COLD_MISSES};
#[cfg(test)]
pub(crate) use cost::WINDOW as COST_WINDOW;
pub use cost::{CostModel, CostSnapshot, Estimate, PredictionCheck, Timing};
use ranking::{Rank, Ranking};
#[cfg(test)]
pub(crate) use tests as ledger_fixtures;

// Keyed by endpoint ids, addresses, agents' and models' names (the fleet's,
// not clients'): a fast hasher, looked up several times per request.
use foldhash::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::prefix::{PrefixHolders, PrefixLru};
use crate::protocol::{AgentReport, BackendHealth, ReportError};
use crate::session::SessionTable;

/// Reports older than this many monitoring intervals make an agent stale.
pub const STALE_AFTER_INTERVALS: u32 = 3;

/// Agents one balancer takes: a report from a new agent beyond is refused.
pub const MAX_AGENTS: usize = 2048;
/// Distinct model names the balancer remembers: a report naming a new one
/// beyond is refused (they become `/v1/models` entries and metric labels).
pub const MAX_MODEL_NAMES: usize = 4096;

/// The longest an orphaned slot ([`EndpointLedger::orphan`]) stays counted busy
/// when no report frees it: a lost or confused agent cannot hold a slot
/// forever.
pub const ORPHAN_MAX_AGE: Duration = Duration::from_secs(300);

/// How long a model stays known (requests for it are queued, not refused
/// with 404) after the last endpoint serving it went away, so a rolling
/// restart does not turn into errors.
pub const MODEL_MEMORY: Duration = Duration::from_secs(300);

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
    /// Tokens counted in flight on the endpoint for this request (its
    /// estimate, see [`Endpoint::token_need`]), given back with the slot.
    pub tokens: u64,
    /// Leading prompt blocks the endpoint's prefix index held when it was
    /// chosen: the cache hit the balancer expected ([`CacheTruth`]).
    pub predicted_blocks: u32,
    /// The first model its agent reports (the engine's own id): which model
    /// answers a request that named none.
    pub model: Option<Arc<str>>,
    /// The LoRA adapter the request named, if any ([`crate::adapter`]).
    pub adapter: Option<Arc<str>>,
    /// The endpoint was not known to hold the adapter: the request waits
    /// for it to load (what its answer's first token says of load times).
    pub loads_adapter: bool,
    /// Its predicted 90th-percentile time to first token there, for a
    /// request with a latency objective (checked against its answer).
    pub ttft_p90_ms: Option<u32>,
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
    /// Estimated tokens of the balancer's requests in flight here (orphans
    /// included): what the token budget counts.
    pub(crate) in_flight_tokens: u64,
    /// Slots taken and given back since the last report ([`foreign`]).
    slot_log: foreign::SlotLog,
    /// Of its requests, the most that may have been running at the
    /// engine read behind the last report: told to the agent.
    own_at_read: u32,
    /// Busy slots the balancer did not cause, from the last report.
    foreign_busy: u32,
    /// The agent the last take-over displaced (to tell two agents taking
    /// turns from a new owner).
    displaced: Option<String>,
    /// When each orphaned slot (counted in `in_flight`) was orphaned, and
    /// its tokens, oldest first.
    orphans: std::collections::VecDeque<(Instant, u64)>,
    breaker: Breaker,
    /// Prompt blocks recently sent here.
    prefix: PrefixLru,
    /// What its engine said it reused.
    cache: CacheTruth,
    /// What its engine costs, learned from its answers.
    cost: CostModel,
    /// LoRA adapters this balancer sent here lately ([`adapters`]).
    adapters_sent: crate::adapter::Sent,
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

    /// Gives back the `n` oldest orphaned slots.
    fn free_orphans(&mut self, n: usize) {
        let n = n.min(self.orphans.len());
        let tokens: u64 = self.orphans.drain(..n).map(|(_, t)| t).sum();
        self.in_flight -= n as u32;
        self.in_flight_tokens = self.in_flight_tokens.saturating_sub(tokens);
    }

    /// Slots the balancer may still fill: every slot less its own
    /// requests in flight and the busy ones it did not send
    /// (`foreign_busy`, as the engine last said), and, when the agent
    /// divides the slots between balancers ([`crate::shares`]), no more
    /// than what its share leaves, whichever is smaller. A share is the
    /// agent's division, a report old; the engine's busy slots are its own
    /// word: a client that bypasses the balancers fills slots a share
    /// still counts free until the agent sees it.
    pub(crate) fn free_slots(&self) -> u32 {
        let seen_free = self
            .slots_total()
            .saturating_sub(self.in_flight)
            .saturating_sub(self.foreign_busy);
        match self.agent.as_ref().and_then(|a| a.report.slot_share) {
            Some(share) => seen_free.min(share.saturating_sub(self.in_flight)),
            None => seen_free,
        }
    }
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

/// All endpoints the balancer knows.
#[derive(Debug)]
pub(crate) struct EndpointLedger {
    saturation: SaturationConfig,
    scheduling: SchedulingConfig,
    endpoints: HashMap<EndpointId, Endpoint>,
    by_addr: HashMap<SocketAddr, EndpointId>,
    by_agent: HashMap<String, EndpointId>,
    /// Every model an agent reported, with when it last did.
    models: HashMap<Arc<str>, Instant>,
    /// Of those, the ones an agent lists as a LoRA adapter ([`adapters`]).
    adapter_models: foldhash::HashSet<Arc<str>>,
    next_id: u64,
    /// Endpoints with an agent by model, those that may take work best
    /// first: kept in step by [`EndpointLedger::rerank`] at every change.
    ranking: Ranking,
    /// Re-rankings so far: an endpoint's tie key ([`Rank`]).
    reranks: u64,
    /// Which endpoints' prefix indexes hold each prompt block.
    holders: PrefixHolders<EndpointId>,
    /// The endpoint each session's last turn went to.
    sessions: SessionTable,
    /// Endpoints whose circuit breaker remembers a failure ([`breaker`]):
    /// while there are none, a success has nothing to record.
    failing: usize,
    /// Until when some agent said it reports to other balancers too, or
    /// did not say ([`EndpointLedger::alone`]).
    shared_until: Option<Instant>,
    /// By model, the hardest request with a TTFT objective lately
    /// ([`models`]' `note_objective`).
    objective_references: HashMap<Option<Arc<str>>, crate::objective::Hardest>,
}

impl Default for EndpointLedger {
    fn default() -> Self {
        EndpointLedger::new(SaturationConfig::default(), SchedulingConfig::default())
    }
}

impl EndpointLedger {
    pub(crate) fn new(saturation: SaturationConfig, scheduling: SchedulingConfig) -> Self {
        EndpointLedger {
            saturation,
            scheduling,
            endpoints: HashMap::default(),
            by_addr: HashMap::default(),
            by_agent: HashMap::default(),
            models: HashMap::default(),
            adapter_models: Default::default(),
            next_id: 0,
            ranking: Ranking::default(),
            reranks: 0,
            holders: PrefixHolders::default(),
            sessions: SessionTable::new(&scheduling.sessions),
            failing: 0,
            shared_until: None,
            objective_references: HashMap::default(),
        }
    }

    /// New saturation thresholds and scheduling weights (a config reload).
    /// A new prefix-index size holds for endpoints registered from now on.
    pub(crate) fn reconfigure(
        &mut self,
        saturation: SaturationConfig,
        scheduling: SchedulingConfig,
    ) {
        self.saturation = saturation;
        self.sessions.reconfigure(&scheduling.sessions);
        self.scheduling = scheduling;
        // Thresholds and weights place every endpoint anew.
        let ids: Vec<EndpointId> = self.endpoints.keys().copied().collect();
        for id in ids {
            self.rerank(id);
        }
    }

    /// Puts an endpoint where it now belongs in the ranking: called after
    /// every change to what ranks it (a report, a slot taken or given
    /// back, its agent gone, new thresholds).
    fn rerank(&mut self, id: EndpointId) {
        let Some(ep) = self.endpoints.get(&id) else {
            self.ranking.remove(id);
            return;
        };
        self.reranks += 1;
        let rank = ep.rankable(&self.saturation).then(|| {
            Rank::new(
                ep.static_score(&self.scheduling.scorers, &self.saturation),
                self.reranks,
                id,
            )
        });
        self.ranking.rerank(id, rank);
    }

    /// Refuses a report that would grow the registry past its bounds: a new
    /// agent beyond [`MAX_AGENTS`], a new model name beyond
    /// [`MAX_MODEL_NAMES`].
    pub(crate) fn check_bounds(&self, report: &AgentReport) -> Result<(), ReportError> {
        if !self.by_agent.contains_key(&report.agent_id) && self.by_agent.len() >= MAX_AGENTS {
            return Err(ReportError::TooManyAgents(MAX_AGENTS));
        }
        let loadable = report.adapters.iter().flat_map(|a| &a.loadable);
        let new_names = (report.models.iter().chain(loadable))
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
                        in_flight_tokens: 0,
                        slot_log: Default::default(),
                        own_at_read: 0,
                        foreign_busy: 0,
                        displaced: None,
                        orphans: Default::default(),
                        breaker: Breaker::default(),
                        prefix: PrefixLru::new(self.scheduling.prefix.capacity_blocks),
                        cache: CacheTruth::default(),
                        cost: CostModel::default(),
                        adapters_sent: Default::default(),
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
        let own = ep
            .slot_log
            .own_at_read(now, report.read_window(), ep.in_flight);
        ep.foreign_busy = report.slots_busy.saturating_sub(own);
        ep.own_at_read = own;
        // Orphans the engine no longer works on: busy slots beyond what the
        // balancer's live requests explain are still orphans; the rest are
        // free (oldest first).
        let live = ep.in_flight.saturating_sub(ep.orphans.len() as u32);
        let running_orphans = report.slots_busy.saturating_sub(live);
        let done = (ep.orphans.len() as u32).saturating_sub(running_orphans);
        ep.free_orphans(done as usize);
        ep.adapters_reported(&report, now);
        let loadable = report.adapters.iter().flat_map(|a| &a.loadable);
        for m in report.models.iter().chain(loadable) {
            match self.models.get_mut(m.as_str()) {
                Some(seen) => *seen = now,
                None => {
                    self.models.insert(Arc::from(m.as_str()), now);
                }
            }
        }
        self.by_agent.insert(report.agent_id.clone(), id);
        self.ranking.set_models(id, &report.models);
        adapters::learn_adapters(&mut self.adapter_models, &self.models, &report);
        let agent = AgentState {
            report,
            received_at: now,
        };
        if agent.report.balancers != Some(1) {
            // As long as this agent is not stale.
            let until = Endpoint::stale_deadline(&agent);
            self.shared_until = Some(self.shared_until.map_or(until, |t| t.max(until)));
        }
        ep.agent = Some(agent);
        self.rerank(id);
        outcome
    }

    /// Whether this balancer is the fleet's only one: every agent that
    /// reported within its staleness window names no other. Then no other
    /// balancer needs to find a conversation where it would look for it.
    pub(crate) fn alone(&self, now: Instant) -> bool {
        self.shared_until.is_none_or(|until| now >= until)
    }

    fn detach_agent_from(&mut self, id: EndpointId) {
        if let Some(ep) = self.endpoints.get_mut(&id) {
            if let Some(a) = ep.agent.take() {
                self.by_agent.remove(&a.report.agent_id);
            }
            self.ranking.remove(id);
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
        self.ranking.remove(id);
        if let Some(ep) = self.endpoints.remove(&id) {
            self.by_addr.remove(&ep.addr);
            self.failing -= usize::from(!ep.breaker.is_clear());
            for h in ep.prefix.hashes() {
                self.holders.change(h, id, false);
            }
        }
    }

    /// The endpoint a registered agent reports.
    pub(crate) fn endpoint_of_agent(&self, agent_id: &str) -> Option<EndpointId> {
        self.by_agent.get(agent_id).copied()
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
        let mut freed = Vec::new();
        for ep in self.endpoints.values_mut() {
            let old = ep
                .orphans
                .iter()
                .take_while(|(t, _)| now.saturating_duration_since(*t) >= ORPHAN_MAX_AGE)
                .count();
            if old > 0 {
                ep.free_orphans(old);
                freed.push(ep.id);
            }
        }
        for id in freed {
            self.rerank(id);
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

    /// Takes a slot on `chosen` for `route` (placement chose it:
    /// [`crate::placement`]): counts the request in flight there, notes
    /// its prompt blocks and adapter as sent there, and binds its session
    /// to it.
    pub(crate) fn book(&mut self, route: &Route, chosen: EndpointId, now: Instant) -> Lease {
        let adapter = self
            .adapter_models
            .get(route.model.as_deref().unwrap_or(""))
            .cloned();
        let ep = self.endpoints.get_mut(&chosen).expect("candidate exists");
        let loads_adapter = adapter.as_ref().is_some_and(|a| ep.residency(a).loads());
        if let Some(a) = &adapter {
            ep.adapter_sent(a, now);
        }
        let tokens = ep.token_need(&route.tokens);
        ep.in_flight += 1;
        ep.in_flight_tokens = ep.in_flight_tokens.saturating_add(tokens);
        ep.slot_log.taken(now, ep.in_flight);
        let predicted_blocks = ep.prefix.matched(&route.prefix) as u32;
        let holders = &mut self.holders;
        ep.prefix
            .insert_tracked(&route.prefix, |h, holds| holders.change(h, chosen, holds));
        if let Some(session) = route.session {
            self.sessions.bind(session, ep.addr, now);
        }
        let model = ep.agent.as_ref().and_then(|a| a.report.models.first());
        let model = model.and_then(|m| self.models.get_key_value(m.as_str()));
        let lease = Lease {
            endpoint: ep.id,
            addr: ep.addr,
            tokens,
            predicted_blocks,
            // The name as kept among the reported ones: shared, not copied.
            model: model.map(|(name, _)| Arc::clone(name)),
            adapter,
            loads_adapter,
            ttft_p90_ms: None,
        };
        self.rerank(chosen);
        lease
    }

    /// Forgets where `session`'s last turn went (its endpoint is gone):
    /// its next turn is placed anew.
    pub(crate) fn release_session(&mut self, session: u64) {
        self.sessions.release(session);
    }

    /// Binds `session` to the endpoint at `addr` (a response id whose
    /// answer came from there, for the turn that continues it).
    pub(crate) fn bind_session(&mut self, session: u64, addr: SocketAddr, now: Instant) {
        if self.by_addr.contains_key(&addr) {
            self.sessions.bind(session, addr, now);
        }
    }

    /// Sessions bound now (idle ones not yet swept included).
    pub(crate) fn sessions_bound(&self) -> usize {
        self.sessions.len()
    }

    /// Whether some endpoint could take work now, for any model.
    pub(crate) fn any_available(&self, now: Instant) -> bool {
        let config = self.saturation;
        self.ranking
            .ranked(None)
            .any(|r| self.endpoints[&r.id].available(now, &config))
    }

    /// Whether an eligible endpoint fits `route` and is not `except` (it
    /// may be busy): waiting can help, or a retry has somewhere to go.
    pub(crate) fn has_eligible(
        &self,
        route: &Route,
        except: Option<SocketAddr>,
        now: Instant,
    ) -> bool {
        self.serving(route)
            .any(|e| Some(e.addr) != except && e.eligible(now))
    }

    /// Gives a slot back. Consuming the lease makes a double release a
    /// compile error rather than an accounting bug.
    pub(crate) fn release(&mut self, lease: Lease, now: Instant) {
        let Some(ep) = self.endpoints.get_mut(&lease.endpoint) else {
            debug_assert!(false, "lease for an unknown endpoint {:?}", lease.endpoint);
            return;
        };
        debug_assert!(ep.in_flight > 0, "release without an in-flight request");
        ep.in_flight = ep.in_flight.saturating_sub(1);
        ep.slot_log.given_back(now);
        if let Some(a) = &lease.adapter {
            ep.adapter_ended(a);
        }
        ep.in_flight_tokens = ep.in_flight_tokens.saturating_sub(lease.tokens);
        if ep.in_flight == 0 && ep.agent.is_none() {
            self.forget(lease.endpoint);
        } else {
            self.rerank(lease.endpoint);
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
            self.release(lease, now);
            return;
        }
        let ep = self
            .endpoints
            .get_mut(&lease.endpoint)
            .expect("checked above");
        ep.orphans.push_back((now, lease.tokens));
        if let Some(a) = &lease.adapter {
            ep.adapter_ended(a);
        }
    }

    /// What this balancer tells `id`'s agent of its demand
    /// ([`crate::shares`]): of the requests `queued` per lane (model),
    /// those for a model it serves.
    pub(crate) fn demand_of<'a>(
        &self,
        id: EndpointId,
        queued: impl Iterator<Item = (&'a Option<Arc<str>>, usize)>,
    ) -> crate::shares::Demand {
        let e = self.endpoints.get(&id);
        let queued: usize = queued
            .filter(|(model, _)| e.is_some_and(|e| e.serves(model.as_deref())))
            .map(|(_, n)| n)
            .sum();
        crate::shares::Demand {
            in_flight: e.map_or(0, |e| e.in_flight),
            queued: u32::try_from(queued).unwrap_or(u32::MAX),
            applied: e.and_then(|e| e.agent.as_ref()?.report.slot_share),
            at_read: e.map(|e| e.own_at_read),
        }
    }

    /// Whether any endpoint could take work now or after its load drains.
    pub(crate) fn any_eligible(&self, now: Instant) -> bool {
        self.ranking
            .members(None)
            .any(|id| self.endpoints.get(&id).is_some_and(|e| e.eligible(now)))
    }

    /// The earliest instant at which some agent turns stale, if any.
    pub(crate) fn next_stale_deadline(&self) -> Option<Instant> {
        self.endpoints
            .values()
            .filter_map(|e| e.agent.as_ref().map(Endpoint::stale_deadline))
            .min()
    }

    /// Of [`EndpointLedger::total_in_flight`]: orphaned slots, whose clients left.
    pub(crate) fn total_orphaned(&self) -> u64 {
        self.endpoints
            .values()
            .map(|e| e.orphans.len() as u64)
            .sum()
    }

    /// Whether no endpoint that could serve `route` now or later (eligible,
    /// busy or not) can ever take it: each has a known token capacity and
    /// the request needs more than one request may use there
    /// ([`Endpoint::never_fits`]). `false` while none is eligible (the
    /// fleet may still come up).
    pub(crate) fn never_fits(&self, route: &Route, now: Instant) -> bool {
        let mut eligible = self.serving(route).filter(|e| e.eligible(now)).peekable();
        eligible.peek().is_some() && eligible.all(|e| e.never_fits(&route.tokens))
    }

    pub(crate) fn total_in_flight(&self) -> u64 {
        self.endpoints
            .values()
            .map(|e| u64::from(e.in_flight))
            .sum()
    }
}

#[cfg(test)]
pub(crate) mod tests;
