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
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::protocol::{AgentReport, BackendHealth};

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
    /// Dispatch sequence number of the last lease, for fair tie-breaking.
    last_dispatch: u64,
}

impl Endpoint {
    fn stale_deadline(agent: &AgentState) -> Instant {
        agent.received_at + agent.report.monitoring_interval() * STALE_AFTER_INTERVALS
    }

    /// Whether the endpoint may receive new work at `now`.
    pub(crate) fn eligible(&self, now: Instant) -> bool {
        match &self.agent {
            Some(a) => {
                a.report.health == BackendHealth::Ready
                    && !a.report.draining
                    && now < Self::stale_deadline(a)
            }
            None => false,
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
    pub foreign_busy: u32,
    pub free_slots: u32,
}

/// What happened to a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportOutcome {
    /// First report of this agent for this endpoint.
    Registered(EndpointId),
    Updated(EndpointId),
    /// This agent took the endpoint over from another agent id.
    TookOver(EndpointId),
}

/// All endpoints the balancer knows.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    saturation: SaturationConfig,
    endpoints: HashMap<EndpointId, Endpoint>,
    by_addr: HashMap<SocketAddr, EndpointId>,
    by_agent: HashMap<String, EndpointId>,
    next_id: u64,
    dispatch_seq: u64,
}

impl Registry {
    pub(crate) fn new(saturation: SaturationConfig) -> Self {
        Registry {
            saturation,
            ..Registry::default()
        }
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
                        last_dispatch: 0,
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
                ReportOutcome::TookOver(id)
            }
        };
        ep.foreign_busy = report.slots_busy.saturating_sub(ep.in_flight_peak);
        ep.in_flight_peak = ep.in_flight;
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

    /// Drops agents whose last report is older than three intervals.
    /// Returns the ids of the agents dropped.
    pub(crate) fn drop_stale(&mut self, now: Instant) -> Vec<String> {
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

    /// Picks the eligible, unsaturated endpoint with the most free slots;
    /// ties go to the one that got work least recently, so equal servers
    /// share the load.
    pub(crate) fn acquire(&mut self, now: Instant) -> Option<Lease> {
        let config = self.saturation;
        let ep = self
            .endpoints
            .values_mut()
            .filter(|e| e.eligible(now) && e.saturation(now, &config).is_none())
            .max_by(|a, b| {
                a.free_slots()
                    .cmp(&b.free_slots())
                    .then(b.last_dispatch.cmp(&a.last_dispatch))
            })?;
        self.dispatch_seq += 1;
        ep.last_dispatch = self.dispatch_seq;
        ep.in_flight += 1;
        ep.in_flight_peak = ep.in_flight_peak.max(ep.in_flight);
        Some(Lease {
            endpoint: ep.id,
            addr: ep.addr,
        })
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
                foreign_busy: e.foreign_busy,
                free_slots: e.free_slots(),
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
        let l1 = r.acquire(now).unwrap();
        let l2 = r.acquire(now).unwrap();
        assert!(r.acquire(now).is_none());
        r.release(l1);
        let l3 = r.acquire(now).unwrap();
        r.release(l2);
        r.release(l3);
        assert_eq!(r.total_in_flight(), 0);
    }

    #[test]
    fn a_report_never_resets_the_in_flight_count() {
        let now = Instant::now();
        let mut r = registry_with(4, now);
        let leases: Vec<_> = (0..3).map(|_| r.acquire(now).unwrap()).collect();
        // The agent scraped before our requests arrived: it says 0 busy.
        r.apply_report(report("a", "127.0.0.1:1", 4), addr("127.0.0.1:1"), now);
        assert_eq!(r.total_in_flight(), 3);
        assert!(r.acquire(now).is_some(), "one slot left");
        assert!(r.acquire(now).is_none(), "and only one");
        for l in leases {
            r.release(l);
        }
    }

    #[test]
    fn a_lagging_report_does_not_hide_a_slot_just_freed() {
        let now = Instant::now();
        let mut r = registry_with(2, now);
        let l1 = r.acquire(now).unwrap();
        let l2 = r.acquire(now).unwrap();
        r.release(l1);
        // Scraped while both of ours were busy.
        let mut busy = report("a", "127.0.0.1:1", 2);
        busy.slots_busy = 2;
        r.apply_report(busy, addr("127.0.0.1:1"), now);
        assert!(r.acquire(now).is_some(), "the freed slot is usable at once");
        let _ = l2;
    }

    #[test]
    fn load_from_other_clients_reduces_free_slots() {
        let now = Instant::now();
        let mut r = registry_with(4, now);
        let mut busy = report("a", "127.0.0.1:1", 4);
        busy.slots_busy = 3; // none of them ours
        r.apply_report(busy, addr("127.0.0.1:1"), now);
        assert!(r.acquire(now).is_some());
        assert!(r.acquire(now).is_none());
    }

    #[test]
    fn two_agents_on_one_server_do_not_double_its_capacity() {
        let now = Instant::now();
        let mut r = registry_with(2, now);
        let out = r.apply_report(report("b", "127.0.0.1:1", 2), addr("127.0.0.1:1"), now);
        assert!(matches!(out, ReportOutcome::TookOver(_)));
        assert!(r.acquire(now).is_some());
        assert!(r.acquire(now).is_some());
        assert!(r.acquire(now).is_none());
        assert_eq!(r.snapshot(now).len(), 1);
    }

    #[test]
    fn stale_agents_get_no_work_and_are_dropped_after_in_flight_finishes() {
        let t0 = Instant::now();
        let mut r = registry_with(2, t0);
        let lease = r.acquire(t0).unwrap();
        let stale = t0 + Duration::from_secs(3);
        assert!(r.acquire(t0 + Duration::from_millis(1999)).is_some());
        assert!(
            r.acquire(t0 + Duration::from_millis(2001)).is_none(),
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
        let lease = r.acquire(now).unwrap();
        assert!(r.deregister("a"));
        assert!(!r.any_eligible(now));
        // It comes back before the request finished: the slot is still taken.
        r.apply_report(report("a2", "127.0.0.1:1", 1), addr("127.0.0.1:1"), now);
        assert!(r.acquire(now).is_none());
        r.release(lease);
        assert!(r.acquire(now).is_some());
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
            assert!(r.acquire(now).is_none());
        }
    }

    #[test]
    fn equal_endpoints_share_the_load() {
        let now = Instant::now();
        let mut r = Registry::default();
        r.apply_report(report("a", "127.0.0.1:1", 4), addr("127.0.0.1:1"), now);
        r.apply_report(report("b", "127.0.0.1:2", 4), addr("127.0.0.1:2"), now);
        let leases: Vec<_> = (0..4).map(|_| r.acquire(now).unwrap()).collect();
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
}
