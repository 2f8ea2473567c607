//! What each endpoint's engine costs, as `/metrics` shows it: the running
//! medians the ledger learns from the answers
//! ([`flowgate::endpoint::CostModel`]). Refreshed from the snapshot at
//! scrape time, so a departed endpoint leaves no series.

use prometheus::{GaugeVec, Opts, Registry};

use super::family::{endpoint_labels, register};
use flowgate::EndpointSnapshot;

pub struct CostMetrics {
    prefill: GaugeVec,
    decode: GaugeVec,
    service: GaugeVec,
    adapter_load: GaugeVec,
}

impl CostMetrics {
    pub fn new(registry: &Registry) -> Self {
        let gauge = |name: &str, help: &str| {
            register(
                registry,
                GaugeVec::new(Opts::new(name, help), &["endpoint", "agent", "model"]),
            )
        };
        CostMetrics {
            prefill: gauge(
                "flowgate_endpoint_prefill_seconds_per_token",
                "Prefill time per uncached prompt token, learned from the endpoint's answers \
                 (median of the last 16; a default before any)",
            ),
            decode: gauge(
                "flowgate_endpoint_decode_seconds_per_token",
                "Decode time per output token, learned from the endpoint's answers",
            ),
            service: gauge(
                "flowgate_endpoint_service_seconds",
                "Time a request holds a slot there, learned from the endpoint's answers",
            ),
            adapter_load: gauge(
                "flowgate_endpoint_adapter_load_seconds",
                "Time loading a LoRA adapter adds to a first token there, learned from the \
                 answers of requests that waited for one (a default before any)",
            ),
        }
    }

    /// Resets every series and sets those of the endpoints known now.
    pub fn refresh(&self, endpoints: &[EndpointSnapshot]) {
        for g in [
            &self.prefill,
            &self.decode,
            &self.service,
            &self.adapter_load,
        ] {
            g.reset();
        }
        for e in endpoints {
            if e.agent.is_none() {
                continue;
            }
            let (endpoint, agent, model) = endpoint_labels(e);
            let labels = [endpoint.as_str(), agent, model];
            let c = &e.cost;
            self.prefill
                .with_label_values(&labels)
                .set(c.prefill_ms_per_token / 1_000.0);
            self.decode
                .with_label_values(&labels)
                .set(c.decode_ms_per_token / 1_000.0);
            self.service
                .with_label_values(&labels)
                .set(c.service_ms / 1_000.0);
            if e.agent.as_ref().is_some_and(|a| a.adapters.is_some()) {
                self.adapter_load
                    .with_label_values(&labels)
                    .set(c.adapter_load_ms / 1_000.0);
            }
        }
    }
}
