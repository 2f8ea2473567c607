//! `--report-to`: each simulated server reported to a balancer as its agent
//! would.

use super::*;

/// Reports each server to the balancer as an agent beside it would, one
/// report per server per interval, spread over the interval.
pub(crate) async fn report_loop(base: String, cli: Cli, sims: Vec<(SocketAddr, Arc<Sim>)>) {
    let client = reqwest::Client::new();
    let interval = Duration::from_millis(cli.report_interval_ms);
    let gap = interval / sims.len().max(1) as u32;
    let mut failing = false;
    loop {
        for (addr, sim) in &sims {
            let agent_id = format!("llm-sim-{}", addr.port());
            let report = flowgate::AgentReport {
                protocol_version: flowgate::PROTOCOL_VERSION,
                agent_id: agent_id.clone(),
                name: agent_id.clone(),
                backend: flowgate::BackendKind::Llamacpp,
                external_addr: addr.to_string(),
                models: vec![cli.model.clone()],
                health: flowgate::BackendHealth::Ready,
                slots_total: cli.slots,
                slots_busy: u32::try_from(sim.processing.load(Ordering::Relaxed))
                    .unwrap_or(u32::MAX),
                requests_waiting: u32::try_from(sim.deferred.load(Ordering::Relaxed))
                    .unwrap_or(u32::MAX),
                kv_cache_usage: None,
                kv_capacity_tokens: (cli.kv_capacity_tokens > 0).then_some(cli.kv_capacity_tokens),
                monitoring_interval_ms: cli.report_interval_ms,
                draining: false,
                last_error: None,
                slot_share: None,
                // `--report-to` names one balancer.
                balancers: Some(1),
                // Read as it is sent.
                read_began_ms_ago: Some(0),
                read_ended_ms_ago: Some(0),
                adapters: None,
                kv_events: None,
            };
            let mut req = client
                .post(format!("{base}/api/v1/agents/{agent_id}/report"))
                .timeout(interval)
                .json(&report);
            if let Some(token) = &cli.management_token {
                req = req.bearer_auth(token);
            }
            let ok = matches!(req.send().await, Ok(r) if r.status().is_success());
            if !ok && !failing {
                eprintln!("llm-sim: reporting {addr} to {base} failed (will keep trying)");
            }
            failing = !ok;
            tokio::time::sleep(gap).await;
        }
    }
}
