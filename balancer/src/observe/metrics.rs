//! Prometheus metrics of the balancer (text exposition on `GET /metrics`).
//!
//! Counters and the wait histogram are updated on the request path; gauges
//! that describe current state (buffer, endpoints) are filled from a
//! snapshot at scrape time, so a departed endpoint leaves no stale series.

// Bounded (known models' labels): a fast hasher, looked up per answer.
use foldhash::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use prometheus::core::Collector;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts,
    Registry, TextEncoder,
};

use super::clients::ClientMetrics;
use super::family::{register, WAIT_BUCKETS};
use super::fleet::FleetMetrics;
use super::flow::FlowMetrics;
use crate::observe::history::{Tallies, OUTCOMES};
use flowgate::Snapshot;

/// Why a request went to a fallback model: the `reason` label of
/// `flowgate_model_fallbacks_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    /// No live endpoint served its model when it came.
    Unavailable,
    /// It waited its `fallbackAfter` for its own model.
    Waited,
}

impl FallbackReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FallbackReason::Unavailable => "unavailable",
            FallbackReason::Waited => "waited",
        }
    }
}

/// Why a request was sent again: the `reason` label of
/// `flowgate_upstream_retries_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryReason {
    /// The endpoint answered a suspect 5xx header.
    Status5xx,
    /// The connection to the endpoint failed.
    Connect,
    /// The endpoint failed before the response header.
    UpstreamError,
    /// A pooled connection the server had closed: sent again on a fresh
    /// one to the same endpoint.
    StaleConnection,
}

impl RetryReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RetryReason::Status5xx => "status-5xx",
            RetryReason::Connect => "connect",
            RetryReason::UpstreamError => "upstream-error",
            RetryReason::StaleConnection => "stale-connection",
        }
    }
}

pub struct Metrics {
    registry: Registry,
    /// Requests by final HTTP status and drop reason (empty when served).
    pub requests: IntCounterVec,
    /// Requests that had to wait in the buffer.
    pub buffered_total: IntCounter,
    /// Seconds spent waiting in the buffer, for requests that waited.
    pub buffer_wait: Histogram,
    ttft: HistogramVec,
    tpot: HistogramVec,
    tokens: IntCounterVec,
    upstream_errors: IntCounterVec,
    /// Requests sent again to another endpoint, by what failed.
    upstream_retries: IntCounterVec,
    /// Requests sent to a fallback model (names from the config only).
    model_fallbacks: IntCounterVec,
    /// Prompts matched against engines' blocks, by who counted their tokens.
    tokenizations: IntCounterVec,
    /// Learned bytes of prompt text per token, by reported model.
    bytes_per_token: prometheus::GaugeVec,
    /// How waits in flow control ended.
    pub flow: FlowMetrics,
    /// The buffer, flows and endpoints.
    pub fleet: FleetMetrics,
    /// Client connections and requests on the inference port.
    pub clients: ClientMetrics,
    /// Tokens and requests per tenant.
    pub tenants: super::tenants::TenantMetrics,
    /// Latency objectives met and missed.
    pub objectives: super::objectives::ObjectiveMetrics,
    /// The series an answer of each model updates, found with one look-up
    /// per answer instead of one per series (the labels are bounded by the
    /// callers: reported models, or `other`).
    models: Mutex<HashMap<Box<str>, ModelSeries>>,
    /// `requests{code="200",reason=""}`, the outcome of nearly every request.
    served: OnceLock<IntCounter>,
}

/// One model's series, each made when first used (as a labelled series is).
#[derive(Default)]
struct ModelSeries {
    ttft: OnceLock<Histogram>,
    tpot: OnceLock<Histogram>,
    prompt_tokens: OnceLock<IntCounter>,
    completion_tokens: OnceLock<IntCounter>,
    bytes_per_token: OnceLock<Gauge>,
}

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
        Metrics {
            requests: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_requests_total",
                        "Inference requests by final HTTP status and drop reason",
                    ),
                    &["code", "reason"],
                ),
            ),
            buffered_total: register(
                &registry,
                IntCounter::new(
                    "flowgate_buffered_requests_total",
                    "Requests that waited in the buffer for a free slot",
                ),
            ),
            buffer_wait: register(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "flowgate_buffer_wait_seconds",
                        "Time requests spent waiting in the buffer",
                    )
                    .buckets(WAIT_BUCKETS.to_vec()),
                ),
            ),
            ttft: register(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "flowgate_time_to_first_token_seconds",
                        "Streamed answers: arrival at the balancer (queueing included) to the \
                     first byte of the stream, by model",
                    )
                    .buckets(WAIT_BUCKETS.to_vec()),
                    &["model"],
                ),
            ),
            tpot: register(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "flowgate_time_per_output_token_seconds",
                        "Streamed answers: time per output token after the first, by model",
                    )
                    .buckets(TPOT_BUCKETS.to_vec()),
                    &["model"],
                ),
            ),
            tokens: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_tokens_total",
                        "Tokens from the answers' usage objects, by model and kind \
                     (prompt, completion)",
                    ),
                    &["model", "kind"],
                ),
            ),
            upstream_errors: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_upstream_errors_total",
                        "Model server failures by kind: connect, status-5xx, \
                     before-response, mid-response",
                    ),
                    &["kind"],
                ),
            ),
            bytes_per_token: register(
                &registry,
                prometheus::GaugeVec::new(
                    Opts::new(
                        "flowgate_model_prompt_bytes_per_token",
                        "Bytes of prompt text per prompt token, learned per model from the \
                     answers' usage (the token estimate's ratio; 4 until a model answered)",
                    ),
                    &["model"],
                ),
            ),
            model_fallbacks: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_model_fallbacks_total",
                        "Requests sent to a fallback model of the one they asked for, by model, \
                     fallback and why (unavailable: no live endpoint; waited: longer than the \
                     chain's `after`)",
                    ),
                    &["model", "fallback", "reason"],
                ),
            ),
            tokenizations: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_prompt_tokenizations_total",
                        "Prompts matched against the blocks engines report, by who counted \
                     their tokens (tokenizer: the balancer's own, engine: the engine's \
                     /tokenize, none: neither in time) and why the balancer's own did not \
                     (no_tokenizer, body: no request object, no_template, field, message, \
                     no_prompt, render, encode, busy: its encodes off the event loop all taken)",
                    ),
                    &["by", "reason"],
                ),
            ),
            upstream_retries: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_upstream_retries_total",
                        "Requests sent again to another endpoint before any byte reached the \
                     client, by what failed (connect, upstream-error, status-5xx)",
                    ),
                    &["reason"],
                ),
            ),
            flow: FlowMetrics::new(&registry),
            fleet: FleetMetrics::new(&registry),
            clients: ClientMetrics::new(&registry),
            tenants: super::tenants::TenantMetrics::new(&registry),
            objectives: super::objectives::ObjectiveMetrics::new(&registry),
            registry,
            models: Mutex::new(HashMap::default()),
            served: OnceLock::new(),
        }
    }

    /// Runs `f` on `model`'s series.
    fn with_model<R>(&self, model: &str, f: impl FnOnce(&ModelSeries) -> R) -> R {
        let mut models = self
            .models
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(series) = models.get(model) {
            return f(series);
        }
        f(models.entry(model.into()).or_default())
    }

    /// Adds another module's metric to the exposition.
    pub fn register(&self, collector: Box<dyn Collector>) {
        self.registry
            .register(collector)
            .expect("metric registered once");
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
        let (objective_answered, objective_met) = self.objectives.totals();
        Tallies {
            outcomes,
            objective_answered,
            objective_met,
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
        usage: Option<flowgate::tokens::TokenUsage>,
    ) {
        let label = [model];
        self.with_model(model, |series| {
            if let Some(t) = ttft {
                let h = series
                    .ttft
                    .get_or_init(|| self.ttft.with_label_values(&label));
                h.observe(t.as_secs_f64());
            }
            if let Some(t) = tpot {
                let h = series
                    .tpot
                    .get_or_init(|| self.tpot.with_label_values(&label));
                h.observe(t.as_secs_f64());
            }
            if let Some(u) = usage {
                let tokens = |kind| self.tokens.with_label_values(&[model, kind]);
                (series.prompt_tokens.get_or_init(|| tokens("prompt"))).inc_by(u.prompt);
                (series
                    .completion_tokens
                    .get_or_init(|| tokens("completion")))
                .inc_by(u.completion);
            }
        });
    }

    /// The learned bytes per token of `model` (a reported model: the
    /// series are bounded by the agents' names).
    pub fn learned_bytes_per_token(&self, model: &str, ratio: f64) {
        self.with_model(model, |series| {
            let gauge = series
                .bytes_per_token
                .get_or_init(|| self.bytes_per_token.with_label_values(&[model]));
            gauge.set(ratio);
        });
    }

    /// Counts a request sent to `fallback` instead of `model`. Both names
    /// come from the operator's fallback chains, so the series are bounded.
    pub fn fallback(&self, model: &str, fallback: &str, why: FallbackReason) {
        self.model_fallbacks
            .with_label_values(&[model, fallback, why.as_str()])
            .inc();
    }

    /// Counts a prompt whose tokens were counted `by` (`tokenizer`,
    /// `engine`, `none`), with why the balancer's tokenizer did not, if
    /// it did not (both from fixed sets).
    pub fn prompt_tokenized(&self, by: &str, reason: &str) {
        self.tokenizations.with_label_values(&[by, reason]).inc();
    }

    /// Counts a request sent again to another endpoint.
    pub fn upstream_retry(&self, why: RetryReason) {
        self.upstream_retries
            .with_label_values(&[why.as_str()])
            .inc();
    }

    /// Counts a finished inference request.
    pub fn record_outcome(&self, code: u16, reason: &str) {
        if code == 200 && reason.is_empty() {
            let served = self
                .served
                .get_or_init(|| self.requests.with_label_values(&["200", ""]));
            served.inc();
            return;
        }
        self.requests
            .with_label_values(&[&code.to_string(), reason])
            .inc();
    }

    /// Renders the text exposition, refreshing state gauges from `snap`.
    pub fn render(&self, snap: &Snapshot) -> Vec<u8> {
        self.fleet.refresh(snap);
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
