//! What the benches share: the agent report of one simulated endpoint.

use flowgate::{AgentReport, BackendHealth, BackendKind, PROTOCOL_VERSION};

/// Endpoint `i` (a distinct address for any `i`) serving model `m` with
/// `slots` free slots; reports are never stale within a bench.
pub fn report(i: u32, slots: u32) -> AgentReport {
    AgentReport {
        protocol_version: PROTOCOL_VERSION,
        agent_id: format!("a{i}"),
        name: format!("a{i}"),
        backend: BackendKind::Llamacpp,
        external_addr: format!("10.{}.{}.{}:8080", i >> 16 & 0xff, i >> 8 & 0xff, i & 0xff),
        models: vec!["m".into()],
        health: BackendHealth::Ready,
        slots_total: slots,
        slots_busy: 0,
        requests_waiting: 0,
        kv_cache_usage: None,
        kv_capacity_tokens: None,
        monitoring_interval_ms: 60_000,
        draining: false,
        last_error: None,
        slot_share: None,
        balancers: None,
        read_began_ms_ago: None,
        read_ended_ms_ago: None,
        adapters: None,
        kv_events: None,
    }
}
