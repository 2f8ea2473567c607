//! What every metric family of the balancer is made with: registering one,
//! the labels of a per-endpoint series, the buckets of a wait. Depends on
//! nothing else in `observe/`, so each family's module and the exposition
//! ([`super::metrics`]) use it without using each other.

use prometheus::core::Collector;
use prometheus::Registry;

/// Registers `metric` (its definition checked) and returns it.
pub fn register<M: Collector + Clone + 'static>(
    registry: &Registry,
    metric: prometheus::Result<M>,
) -> M {
    let m = metric.expect("valid metric definition");
    registry
        .register(Box::new(m.clone()))
        .expect("metric registered once");
    m
}

/// Buckets of every wait histogram (seconds): a millisecond to a minute.
pub const WAIT_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// An endpoint's labels in every per-endpoint series: its address, its
/// agent's id (`""` once the agent is gone) and the model it answers as
/// (its agent's first reported model, `""` for none).
pub fn endpoint_labels(e: &flowgate::EndpointSnapshot) -> (String, &str, &str) {
    let agent = e.agent.as_ref();
    (
        e.addr.to_string(),
        agent.map_or("", |a| a.agent_id.as_str()),
        agent
            .and_then(|a| a.models.first())
            .map_or("", String::as_str),
    )
}
