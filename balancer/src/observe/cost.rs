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
    first_token_extra: GaugeVec,
    tpot_tail: GaugeVec,
    predictions: GaugeVec,
    predicted: GaugeVec,
    observed: GaugeVec,
}

impl CostMetrics {
    pub fn new(registry: &Registry) -> Self {
        let gauge = |name: &str, help: &str| {
            register(
                registry,
                GaugeVec::new(Opts::new(name, help), &["endpoint", "agent", "model"]),
            )
        };
        let with_outcome = |name: &str, help: &str| {
            register(
                registry,
                GaugeVec::new(
                    Opts::new(name, help),
                    &["endpoint", "agent", "model", "outcome"],
                ),
            )
        };
        CostMetrics {
            first_token_extra: gauge(
                "flowgate_endpoint_first_token_delay_p90_seconds",
                "90th percentile of how much later than their predicted prefill streamed first                  tokens came there (the running batch, the engine's queue), of the last 16",
            ),
            tpot_tail: gauge(
                "flowgate_endpoint_tpot_p90_seconds",
                "90th percentile of the time per output token there, of the last 16 answers",
            ),
            predictions: with_outcome(
                "flowgate_endpoint_ttft_predictions",
                "Requests with a latency objective whose predicted 90th-percentile time to                  first token there was checked against their streamed first token, by outcome                  (within, exceeded: about one in ten when the prediction is calibrated)",
            ),
            predicted: gauge(
                "flowgate_endpoint_ttft_predicted_seconds_sum",
                "Sum of those predicted 90th-percentile times to first token",
            ),
            observed: gauge(
                "flowgate_endpoint_ttft_observed_seconds_sum",
                "Sum of those requests' observed times to first token (from the call)",
            ),
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
            &self.first_token_extra,
            &self.tpot_tail,
            &self.predictions,
            &self.predicted,
            &self.observed,
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
            self.first_token_extra
                .with_label_values(&labels)
                .set(c.first_token_extra_p90_ms / 1_000.0);
            self.tpot_tail
                .with_label_values(&labels)
                .set(c.tpot_p90_ms / 1_000.0);
            let p = &c.ttft_predictions;
            if p.checked > 0 {
                for (outcome, n) in [("within", p.checked - p.exceeded), ("exceeded", p.exceeded)] {
                    self.predictions
                        .with_label_values(&[labels[0], labels[1], labels[2], outcome])
                        .set(n as f64);
                }
                self.predicted
                    .with_label_values(&labels)
                    .set(p.predicted_ms / 1_000.0);
                self.observed
                    .with_label_values(&labels)
                    .set(p.observed_ms / 1_000.0);
            }
            if e.agent.as_ref().is_some_and(|a| a.adapters.is_some()) {
                self.adapter_load
                    .with_label_values(&labels)
                    .set(c.adapter_load_ms / 1_000.0);
            }
        }
    }
}
