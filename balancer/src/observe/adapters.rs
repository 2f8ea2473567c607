//! Each endpoint's LoRA adapters, as `/metrics` shows them: those loaded
//! now, and the loads and evictions its agent saw
//! ([`flowgate::protocol::AdapterReport`]). Refreshed from the snapshot at
//! scrape time, so a departed endpoint leaves no series; only endpoints
//! whose agent reports adapters have them.

use prometheus::{IntGaugeVec, Opts, Registry};

use super::family::{endpoint_labels, register};
use flowgate::EndpointSnapshot;

pub struct AdapterMetrics {
    loaded: IntGaugeVec,
    loads: IntGaugeVec,
    evictions: IntGaugeVec,
}

impl AdapterMetrics {
    pub fn new(registry: &Registry) -> Self {
        let gauge = |name: &str, help: &str| {
            register(
                registry,
                IntGaugeVec::new(Opts::new(name, help), &["endpoint", "agent", "model"]),
            )
        };
        AdapterMetrics {
            loaded: gauge(
                "flowgate_endpoint_adapters_loaded",
                "LoRA adapters the engine holds loaded now (those running where it does not say)",
            ),
            loads: gauge(
                "flowgate_endpoint_adapter_loads",
                "LoRA adapter loads since the endpoint's agent started, as it saw adapters \
                 come into the engine's loaded list (engines that say what they hold)",
            ),
            evictions: gauge(
                "flowgate_endpoint_adapter_evictions",
                "LoRA adapters evicted since the endpoint's agent started, as it saw them \
                 leave the engine's loaded list",
            ),
        }
    }

    /// Resets every series and sets those of the endpoints known now.
    pub fn refresh(&self, endpoints: &[EndpointSnapshot]) {
        for g in [&self.loaded, &self.loads, &self.evictions] {
            g.reset();
        }
        for e in endpoints {
            let Some(a) = e.agent.as_ref().and_then(|r| r.adapters.as_ref()) else {
                continue;
            };
            let (endpoint, agent, model) = endpoint_labels(e);
            let labels = [endpoint.as_str(), agent, model];
            let held = a.loaded.as_ref().unwrap_or(&a.running).len();
            self.loaded
                .with_label_values(&labels)
                .set(i64::try_from(held).unwrap_or(i64::MAX));
            let set = |g: &IntGaugeVec, n: Option<u64>| {
                if let Some(n) = n {
                    g.with_label_values(&labels)
                        .set(i64::try_from(n).unwrap_or(i64::MAX));
                }
            };
            set(&self.loads, a.loads);
            set(&self.evictions, a.evictions);
        }
    }
}
