//! Prometheus metrics of the balancer (text exposition on `GET /metrics`).
//!
//! Counters and the wait histogram are updated on the request path; gauges
//! that describe current state (buffer, endpoints) are filled from a
//! snapshot at scrape time, so a departed endpoint leaves no stale series.

use std::time::Duration;

use prometheus::core::Collector;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::observe::history::{Tallies, OUTCOMES};
use flowgate::Snapshot;

/// Distinct priority values that get their own metric label; later ones
/// read `other` (with `allowClientPriority` a client picks any integer).
pub const MAX_PRIORITY_LABELS: usize = 32;

/// The label for a value a request chose, among at most `cap` distinct
/// values; every later one is `other`, so no client can grow the number of
/// series without bound.
struct BoundedLabels {
    cap: usize,
    seen: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl BoundedLabels {
    fn new(cap: usize) -> Self {
        BoundedLabels {
            cap,
            seen: Default::default(),
        }
    }

    fn label(&self, value: String) -> String {
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.contains(&value) {
            return value;
        }
        if seen.len() < self.cap {
            seen.insert(value.clone());
            return value;
        }
        "other".to_string()
    }
}

pub struct Metrics {
    registry: Registry,
    priority_labels: BoundedLabels,
    /// Requests by final HTTP status and drop reason (empty when served).
    pub requests: IntCounterVec,
    /// Requests that had to wait in the buffer.
    pub buffered_total: IntCounter,
    /// Seconds spent waiting in the buffer, for requests that waited.
    pub buffer_wait: Histogram,
    /// Agent reports accepted / refused.
    pub reports: IntCounterVec,
    buffered: IntGauge,
    buffer_capacity: IntGauge,
    in_flight: IntGauge,
    agents: IntGauge,
    endpoint_in_flight: IntGaugeVec,
    endpoint_slots: IntGaugeVec,
    endpoint_waiting: IntGaugeVec,
    endpoint_report_age: prometheus::GaugeVec,
    endpoint_kv_cache: prometheus::GaugeVec,
    endpoint_eligible: IntGaugeVec,
    endpoint_saturated: IntGaugeVec,
    buffered_bytes: IntGauge,
    flow_queue_size: IntGaugeVec,
    flow_queue_bytes: IntGaugeVec,
    flow_queue_duration: HistogramVec,
    flow_dispatches: IntCounterVec,
    flow_rejections: IntCounterVec,
    pool_saturation: Gauge,
    /// Requests sent again to another endpoint, by what failed.
    upstream_retries: IntCounterVec,
    /// Times an endpoint's circuit breaker opened.
    pub circuit_opened: IntCounter,
    endpoint_circuit_open: IntGaugeVec,
    /// Requests that waited for a busy endpoint caching their prompt.
    pub affinity_holds: IntCounter,
    unserved_demand: IntGaugeVec,
    ttft: HistogramVec,
    tpot: HistogramVec,
    tokens: IntCounterVec,
    upstream_errors: IntCounterVec,
    client_connections: IntGauge,
    /// Client requests from their head to the end of their answer.
    pub client_requests: IntGauge,
    client_refusals: IntCounterVec,
}

/// Counts an open client connection until dropped.
pub struct OpenConnection<'a>(&'a IntGauge);

impl Drop for OpenConnection<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

const WAIT_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

const TPOT_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0,
];

/// A histogram's cumulative bucket counts summed over all its label sets,
/// then its total (see [`Tallies`]).
fn cumulative_buckets(families: &[prometheus::proto::MetricFamily]) -> Vec<u64> {
    let mut sums = vec![0; WAIT_BUCKETS.len() + 1];
    for m in families.iter().flat_map(|f| f.get_metric()) {
        let h = m.get_histogram();
        for (sum, bucket) in sums.iter_mut().zip(h.get_bucket()) {
            *sum += bucket.cumulative_count();
        }
        sums[WAIT_BUCKETS.len()] += h.get_sample_count();
    }
    sums
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        macro_rules! register {
            ($metric:expr) => {{
                let m = $metric.expect("valid metric definition");
                registry
                    .register(Box::new(m.clone()))
                    .expect("metric registered once");
                m
            }};
        }
        let ep = &["endpoint", "agent"];
        Metrics {
            priority_labels: BoundedLabels::new(MAX_PRIORITY_LABELS),
            requests: register!(IntCounterVec::new(
                Opts::new(
                    "flowgate_requests_total",
                    "Inference requests by final HTTP status and drop reason"
                ),
                &["code", "reason"]
            )),
            buffered_total: register!(IntCounter::new(
                "flowgate_buffered_requests_total",
                "Requests that waited in the buffer for a free slot"
            )),
            buffer_wait: register!(Histogram::with_opts(
                HistogramOpts::new(
                    "flowgate_buffer_wait_seconds",
                    "Time requests spent waiting in the buffer"
                )
                .buckets(WAIT_BUCKETS.to_vec())
            )),
            reports: register!(IntCounterVec::new(
                Opts::new("flowgate_agent_reports_total", "Agent reports by result"),
                &["result"]
            )),
            buffered: register!(IntGauge::new(
                "flowgate_buffered_requests",
                "Requests waiting in the buffer now"
            )),
            buffer_capacity: register!(IntGauge::new(
                "flowgate_buffer_capacity",
                "Most requests that may wait (--max-buffered-requests)"
            )),
            in_flight: register!(IntGauge::new(
                "flowgate_in_flight_requests",
                "Requests sent to model servers and not finished"
            )),
            agents: register!(IntGauge::new(
                "flowgate_agents",
                "Agents currently registered"
            )),
            unserved_demand: register!(IntGaugeVec::new(
                Opts::new(
                    "flowgate_unserved_demand_requests",
                    "Requests waiting for a model that no live endpoint serves \
                     (scale-up signal; model \"\" = requests naming no model)"
                ),
                &["model"]
            )),
            ttft: register!(HistogramVec::new(
                HistogramOpts::new(
                    "flowgate_time_to_first_token_seconds",
                    "Streamed answers: arrival at the balancer (queueing included) to the \
                     first byte of the stream, by model"
                )
                .buckets(WAIT_BUCKETS.to_vec()),
                &["model"]
            )),
            tpot: register!(HistogramVec::new(
                HistogramOpts::new(
                    "flowgate_time_per_output_token_seconds",
                    "Streamed answers: time per output token after the first, by model"
                )
                .buckets(TPOT_BUCKETS.to_vec()),
                &["model"]
            )),
            tokens: register!(IntCounterVec::new(
                Opts::new(
                    "flowgate_tokens_total",
                    "Tokens from the answers' usage objects, by model and kind \
                     (prompt, completion)"
                ),
                &["model", "kind"]
            )),
            upstream_errors: register!(IntCounterVec::new(
                Opts::new(
                    "flowgate_upstream_errors_total",
                    "Model server failures by kind: connect, status-5xx, \
                     before-response, mid-response"
                ),
                &["kind"]
            )),
            endpoint_in_flight: register!(IntGaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_in_flight_requests",
                    "Requests in flight per endpoint (the balancer's own count)"
                ),
                ep
            )),
            endpoint_slots: register!(IntGaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_slots",
                    "Slots per endpoint: idle (free for the balancer) or busy"
                ),
                &["endpoint", "agent", "state"]
            )),
            endpoint_waiting: register!(IntGaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_waiting_requests",
                    "Requests waiting inside the model server, as its agent reported"
                ),
                ep
            )),
            endpoint_report_age: register!(prometheus::GaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_report_age_seconds",
                    "Age of the last agent report per endpoint"
                ),
                ep
            )),
            endpoint_kv_cache: register!(prometheus::GaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_kv_cache_usage_ratio",
                    "KV-cache use per endpoint (0 to 1), as its agent reported; absent when \
                     the engine does not say"
                ),
                ep
            )),
            endpoint_eligible: register!(IntGaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_eligible",
                    "1 when the endpoint may receive new requests"
                ),
                ep
            )),
            endpoint_saturated: register!(IntGaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_saturated",
                    "1 when an eligible endpoint takes no new work, by reason \
                     (slots-full, queue-depth, kv-cache, stale-metrics)"
                ),
                &["endpoint", "agent", "reason"]
            )),
            buffered_bytes: register!(IntGauge::new(
                "flowgate_buffered_bytes",
                "Request-body bytes waiting in the buffer now"
            )),
            flow_queue_size: register!(IntGaugeVec::new(
                Opts::new(
                    "inference_extension_flow_control_queue_size",
                    "Requests waiting in flow control, per flow"
                ),
                &["fairness_id", "priority"]
            )),
            flow_queue_bytes: register!(IntGaugeVec::new(
                Opts::new(
                    "inference_extension_flow_control_queue_bytes",
                    "Request-body bytes waiting in flow control, per flow"
                ),
                &["fairness_id", "priority"]
            )),
            flow_queue_duration: register!(HistogramVec::new(
                HistogramOpts::new(
                    "inference_extension_flow_control_request_queue_duration_seconds",
                    "Time from arrival to the end of the wait in flow control, by priority \
                     and outcome (dispatched, or the drop reason)"
                )
                .buckets(WAIT_BUCKETS.to_vec()),
                &["priority", "outcome"]
            )),
            flow_dispatches: register!(IntCounterVec::new(
                Opts::new(
                    "flowgate_flow_control_dispatches_total",
                    "Requests bound to an endpoint, by priority"
                ),
                &["priority"]
            )),
            flow_rejections: register!(IntCounterVec::new(
                Opts::new(
                    "flowgate_flow_control_rejections_total",
                    "Requests that left flow control without an endpoint, by priority and \
                     reason (buffer-full, shed, no-endpoints, ttl-expired, client-gone)"
                ),
                &["priority", "reason"]
            )),
            pool_saturation: register!(Gauge::new(
                "inference_extension_flow_control_pool_saturation",
                "Share of eligible endpoints that are saturated (1 when none is eligible)"
            )),
            upstream_retries: register!(IntCounterVec::new(
                Opts::new(
                    "flowgate_upstream_retries_total",
                    "Requests sent again to another endpoint before any byte reached the \
                     client, by what failed (connect, upstream-error, status-5xx)"
                ),
                &["reason"]
            )),
            circuit_opened: register!(IntCounter::new(
                "flowgate_circuit_breaker_opened_total",
                "Times an endpoint's circuit breaker opened after repeated failures"
            )),
            affinity_holds: register!(IntCounter::new(
                "flowgate_affinity_holds_total",
                "Queued requests that waited for a busy endpoint caching their prompt \
                 instead of taking a free one (scheduling.affinityHold)"
            )),
            endpoint_circuit_open: register!(IntGaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_circuit_open",
                    "1 while the endpoint's circuit breaker keeps it out of rotation"
                ),
                &["endpoint", "agent"]
            )),
            client_connections: register!(IntGauge::new(
                "flowgate_client_connections",
                "Client connections open on the inference port"
            )),
            client_requests: register!(IntGauge::new(
                "flowgate_client_requests",
                "Client requests under way on the inference port, from their head to the end \
                 of their answer (a graceful shutdown waits for them)"
            )),
            client_refusals: register!(IntCounterVec::new(
                Opts::new(
                    "flowgate_client_refusals_total",
                    "Client connections or requests refused by a client limit, by reason \
                     (too_many_connections, header_timeout, header_too_large, body_timeout)"
                ),
                &["reason"]
            )),
            registry,
        }
    }

    /// Adds another module's metric to the exposition.
    pub fn register(&self, collector: Box<dyn Collector>) {
        self.registry
            .register(collector)
            .expect("metric registered once");
    }

    pub fn client_connection_opened(&self) -> OpenConnection<'_> {
        self.client_connections.inc();
        OpenConnection(&self.client_connections)
    }

    pub fn client_refusal(&self, reason: &str) {
        self.client_refusals.with_label_values(&[reason]).inc();
    }

    /// The cumulative counts the dashboard's history is made of.
    pub fn tallies(&self) -> Tallies {
        let mut outcomes = [0; OUTCOMES.len()];
        for family in self.requests.collect() {
            for m in family.get_metric() {
                let code = m
                    .get_label()
                    .iter()
                    .find(|l| l.name() == "code")
                    .and_then(|l| l.value().parse().ok())
                    .unwrap_or(0);
                outcomes[Tallies::class(code)] += m.get_counter().get_value() as u64;
            }
        }
        Tallies {
            outcomes,
            ttft: cumulative_buckets(&self.ttft.collect()),
            wait: cumulative_buckets(&self.buffer_wait.collect()),
            bounds: WAIT_BUCKETS.to_vec(),
        }
    }

    pub fn upstream_error(&self, kind: &str) {
        self.upstream_errors.with_label_values(&[kind]).inc();
    }

    /// Records what a proxied answer carried: time to first token and per
    /// output token (streams), and its usage.
    pub fn answer(
        &self,
        model: &str,
        ttft: Option<Duration>,
        tpot: Option<Duration>,
        usage: Option<crate::observe::meter::Usage>,
    ) {
        if let Some(t) = ttft {
            self.ttft
                .with_label_values(&[model])
                .observe(t.as_secs_f64());
        }
        if let Some(t) = tpot {
            self.tpot
                .with_label_values(&[model])
                .observe(t.as_secs_f64());
        }
        if let Some(u) = usage {
            self.tokens
                .with_label_values(&[model, "prompt"])
                .inc_by(u.prompt_tokens);
            self.tokens
                .with_label_values(&[model, "completion"])
                .inc_by(u.completion_tokens);
        }
    }

    pub fn upstream_retry(&self, reason: &str) {
        self.upstream_retries.with_label_values(&[reason]).inc();
    }

    /// Records how a request's wait in flow control ended.
    pub fn flow_outcome(&self, priority: i32, outcome: Result<(), &str>, waited: Duration) {
        let priority = self.priority_labels.label(priority.to_string());
        let label = match outcome {
            Ok(()) => {
                self.flow_dispatches.with_label_values(&[&priority]).inc();
                "dispatched"
            }
            Err(reason) => {
                self.flow_rejections
                    .with_label_values(&[&priority, reason])
                    .inc();
                reason
            }
        };
        self.flow_queue_duration
            .with_label_values(&[&priority, label])
            .observe(waited.as_secs_f64());
    }

    /// Counts a finished inference request.
    pub fn record_outcome(&self, code: u16, reason: &str) {
        self.requests
            .with_label_values(&[&code.to_string(), reason])
            .inc();
    }

    /// Renders the text exposition, refreshing state gauges from `snap`.
    pub fn render(&self, snap: &Snapshot) -> Vec<u8> {
        self.buffered.set(snap.buffered as i64);
        self.buffered_bytes.set(snap.buffered_bytes as i64);
        self.buffer_capacity.set(snap.max_buffered_requests as i64);
        self.flow_queue_size.reset();
        self.flow_queue_bytes.reset();
        for f in &snap.flows {
            let labels = [f.fairness_id.as_str(), &f.priority.to_string()];
            self.flow_queue_size
                .with_label_values(&labels)
                .set(f.requests as i64);
            self.flow_queue_bytes
                .with_label_values(&labels)
                .set(f.bytes as i64);
        }
        let eligible = snap.endpoints.iter().filter(|e| e.eligible).count();
        let saturated = snap
            .endpoints
            .iter()
            .filter(|e| e.eligible && e.saturation.is_some())
            .count();
        self.pool_saturation.set(if eligible == 0 {
            1.0
        } else {
            saturated as f64 / eligible as f64
        });
        self.in_flight.set(snap.in_flight as i64);
        self.unserved_demand.reset();
        for (model, n) in &snap.unserved {
            self.unserved_demand
                .with_label_values(&[model.as_deref().unwrap_or("")])
                .set(*n as i64);
        }
        self.agents
            .set(snap.endpoints.iter().filter(|e| e.agent.is_some()).count() as i64);
        for v in [
            &self.endpoint_in_flight,
            &self.endpoint_slots,
            &self.endpoint_waiting,
            &self.endpoint_eligible,
            &self.endpoint_saturated,
            &self.endpoint_circuit_open,
        ] {
            v.reset();
        }
        self.endpoint_report_age.reset();
        self.endpoint_kv_cache.reset();
        for e in &snap.endpoints {
            let endpoint = e.addr.to_string();
            let agent = e.agent.as_ref().map_or("", |a| a.agent_id.as_str());
            let labels = [endpoint.as_str(), agent];
            self.endpoint_in_flight
                .with_label_values(&labels)
                .set(i64::from(e.in_flight));
            let total = e.agent.as_ref().map_or(0, |a| a.slots_total);
            let idle = e.free_slots;
            self.endpoint_slots
                .with_label_values(&[&endpoint, agent, "idle"])
                .set(i64::from(idle));
            self.endpoint_slots
                .with_label_values(&[&endpoint, agent, "busy"])
                .set(i64::from(total.saturating_sub(idle)));
            if let Some(a) = &e.agent {
                self.endpoint_waiting
                    .with_label_values(&labels)
                    .set(i64::from(a.requests_waiting));
                if let Some(kv) = a.kv_cache_usage {
                    self.endpoint_kv_cache.with_label_values(&labels).set(kv);
                }
            }
            if let Some(age) = e.report_age_ms {
                self.endpoint_report_age
                    .with_label_values(&labels)
                    .set(age as f64 / 1000.0);
            }
            self.endpoint_eligible
                .with_label_values(&labels)
                .set(i64::from(e.eligible));
            self.endpoint_circuit_open
                .with_label_values(&labels)
                .set(i64::from(e.circuit_open_ms.is_some()));
            if let Some(reason) = e.saturation {
                self.endpoint_saturated
                    .with_label_values(&[&endpoint, agent, reason.as_str()])
                    .set(1);
            }
        }
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding into a Vec cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tallies_sum_outcomes_by_class_and_histograms_over_models() {
        let m = Metrics::new();
        m.requests.with_label_values(&["200", ""]).inc_by(3);
        m.requests.with_label_values(&["503", "no-endpoint"]).inc();
        m.requests.with_label_values(&["503", "queue-full"]).inc();
        m.requests.with_label_values(&["400", "bad-request"]).inc();
        m.answer("a", Some(Duration::from_millis(3)), None, None);
        m.answer("b", Some(Duration::from_secs(100)), None, None);
        m.buffer_wait.observe(0.02);
        let t = m.tallies();
        assert_eq!(t.outcomes, [3, 0, 2, 0, 1]);
        assert_eq!(t.bounds, WAIT_BUCKETS.to_vec());
        assert_eq!(t.ttft.len(), WAIT_BUCKETS.len() + 1);
        // 3 ms falls in the 5 ms bucket; 100 s only in +Inf.
        assert_eq!(t.ttft[0], 0);
        assert_eq!(t.ttft[1], 1);
        assert_eq!(t.ttft[WAIT_BUCKETS.len() - 1], 1);
        assert_eq!(t.ttft[WAIT_BUCKETS.len()], 2);
        assert_eq!(t.wait[2], 0);
        assert_eq!(t.wait[3], 1, "20 ms is under the 25 ms bound");
    }
}
