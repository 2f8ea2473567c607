//! What the management API and the metrics show of each endpoint.

use std::net::SocketAddr;
use std::time::Instant;

use serde::Serialize;

use super::{CacheTruth, CostSnapshot, Endpoint, EndpointId, EndpointLedger, Saturation};
use crate::protocol::AgentReport;

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
    /// Estimated tokens of the requests in flight (the token budget's
    /// count).
    pub in_flight_tokens: u64,
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
    /// Blocks it may remember now: `capacityBlocks`, less what the
    /// engine's answers showed it does not keep ([`CacheTruth`]).
    pub prefix_capacity: usize,
    /// What the engine said it reused.
    pub cache: CacheTruth,
    /// What the engine costs, learned from its answers.
    pub cost: CostSnapshot,
}

impl EndpointLedger {
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
                in_flight_tokens: e.in_flight_tokens,
                orphaned: e.orphans.len() as u32,
                foreign_busy: e.foreign_busy,
                free_slots: e.free_slots(),
                circuit_open_ms: e.breaker.open_until.and_then(|t| {
                    (now < t).then(|| u64::try_from((t - now).as_millis()).unwrap_or(u64::MAX))
                }),
                consecutive_failures: e.breaker.consecutive_failures,
                prefix_blocks: e.prefix.len(),
                prefix_capacity: e.prefix.capacity(),
                cache: e.cache,
                cost: e.cost.snapshot(),
            })
            .collect();
        out.sort_by_key(|s| s.id);
        out
    }
}
