//! The async path: a durable queue of inference requests that a dispatcher
//! feeds to the fleet only while the dispatch budget ([`flowgate::budget`])
//! allows; results are fetched later by id, long-poll, event stream or the
//! results feed. The queue lives in the embedded [`store`] or in Redis
//! (`redis_store`, shared by several balancers), behind one `Backend`; the
//! OpenAI Batch API ([`batch`]) is built on it, and `http` answers both
//! APIs on the inference port.
//!
//! The dispatcher sends each request to this balancer's own inference port
//! with a per-process token, so async work goes through the same flow
//! control and scheduling as interactive work, in its own low-priority band:
//! interactive requests always go first, async ones fill what is left.

mod backend;
pub mod batch;
mod http;
mod redis_store;
pub mod store;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use flowgate::budget::{Budget, BudgetConfig};
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use prometheus::{Gauge, IntCounterVec, IntGaugeVec, Opts};
use serde_json::{json, Value};
use tokio::sync::Notify;
use tracing::{info, warn};

use crate::auth::Secret;
use crate::state::Shared;
use backend::Backend;
use store::{Answer, Job, NewJob, QueueConfig, Status, Store, StoreError};

/// The token header that marks the dispatcher's own requests.
pub const TOKEN_HEADER: &str = "x-flowgate-async-token";

/// Where the dispatch budget's `D` comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Gate {
    /// `D = 1`: dispatch whenever the budget's `max_sys` allows.
    AlwaysOpen,
    /// `D = 1 − S`, `S` the share of the fleet's slots taken by
    /// interactive work (busy or waiting in the buffer).
    Balancer,
    /// `D` is the value of a PromQL query against a Prometheus server.
    Prometheus,
}

/// What the budget's `max_sys` and `N` count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CapacityUnit {
    /// Each request counts 1.
    Requests,
    /// A request counts its estimated tokens: prompt bytes / 4 plus its
    /// `max_tokens` (or `max_completion_tokens`; 256 when it names none).
    Tokens,
    /// A request counts its body's bytes.
    Bytes,
}

/// Output tokens assumed for a request that names no `max_tokens`.
const DEFAULT_OUTPUT_TOKENS: u64 = 256;

impl CapacityUnit {
    /// What `job` counts against the budget.
    pub fn cost(self, job: &Job) -> u64 {
        match self {
            CapacityUnit::Requests => 1,
            CapacityUnit::Bytes => job.body.len().max(1) as u64,
            CapacityUnit::Tokens => {
                let body: Value = serde_json::from_str(&job.body).unwrap_or(Value::Null);
                let output = ["max_completion_tokens", "max_tokens"]
                    .iter()
                    .find_map(|k| body[*k].as_u64())
                    .unwrap_or(DEFAULT_OUTPUT_TOKENS);
                (job.body.len() as u64).div_ceil(4) + output
            }
        }
    }
}

/// Where the `prometheus` gate reads `D`.
#[derive(Debug, Clone, PartialEq)]
pub struct PromQuery {
    /// The server's base URL, `http://host:9090`.
    pub url: String,
    /// An instant query whose first sample is `D` (0 to 1).
    pub query: String,
}

#[derive(Debug, Clone)]
pub struct AsyncConfig {
    /// The embedded store's directory.
    pub dir: PathBuf,
    /// `redis://…`: the queue lives in Redis instead, shared by balancers.
    pub redis_url: Option<String>,
    pub queue: QueueConfig,
    pub gate: Gate,
    /// The fleet's capacity in `unit`; `None`: its slots, as reported
    /// (requests only).
    pub max_sys: Option<u64>,
    pub unit: CapacityUnit,
    /// Share of the fleet kept for interactive work.
    pub baseline: f64,
    /// The flow-control priority of async work.
    pub priority: i32,
    /// The balancer gate: the window whose lowest D counts. The
    /// prometheus gate: how often it is read. A 429 closes either for one
    /// interval.
    pub gate_interval: Duration,
    /// The `prometheus` gate's server and query.
    pub prometheus: Option<PromQuery>,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

struct AsyncMetrics {
    requests: IntGaugeVec,
    interactive_spare: Gauge,
    results: prometheus::IntGauge,
    oldest_age: Gauge,
    spare: Gauge,
    allowed: Gauge,
    deliveries: IntCounterVec,
    outcomes: IntCounterVec,
}

impl AsyncMetrics {
    fn new(shared: &Shared) -> Self {
        let m = AsyncMetrics {
            requests: IntGaugeVec::new(
                Opts::new(
                    "flowgate_async_requests",
                    "Async requests by state (queued, dispatched)",
                ),
                &["queue", "state"],
            )
            .expect("metric"),
            interactive_spare: Gauge::new(
                "flowgate_async_interactive_spare_ratio",
                "Share of the eligible slots not taken by interactive work (busy or \
                 buffered), this balancer's view, updated every dispatcher round",
            )
            .expect("metric"),
            results: prometheus::IntGauge::new(
                "flowgate_async_results_stored",
                "Finished async requests kept with their answers (queue default)",
            )
            .expect("metric"),
            oldest_age: Gauge::new(
                "flowgate_async_oldest_queued_age_seconds",
                "Age of the oldest queued async request (queue default)",
            )
            .expect("metric"),
            spare: Gauge::new(
                "flowgate_async_budget_spare_ratio",
                "Dispatch budget D: the fleet's spare share as the gate reads it",
            )
            .expect("metric"),
            allowed: Gauge::new(
                "flowgate_async_budget_allowed_requests",
                "Dispatch budget N: async requests that may be in flight",
            )
            .expect("metric"),
            deliveries: IntCounterVec::new(
                Opts::new(
                    "flowgate_async_deliveries_total",
                    "Async deliveries to the fleet: first, or redelivery",
                ),
                &["queue", "kind"],
            )
            .expect("metric"),
            outcomes: IntCounterVec::new(
                Opts::new(
                    "flowgate_async_outcomes_total",
                    "Async requests ended, by final status",
                ),
                &["queue", "status"],
            )
            .expect("metric"),
        };
        for c in [
            Box::new(m.requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.results.clone()),
            Box::new(m.interactive_spare.clone()),
            Box::new(m.oldest_age.clone()),
            Box::new(m.spare.clone()),
            Box::new(m.allowed.clone()),
            Box::new(m.deliveries.clone()),
            Box::new(m.outcomes.clone()),
        ] {
            shared.metrics.register(c);
        }
        m
    }

    fn ended(&self, status: Status) {
        let label = serde_json::to_value(status)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        self.outcomes.with_label_values(&["default", &label]).inc();
    }
}

/// The queue, shared by the API and the dispatcher.
pub struct AsyncQueue {
    store: Backend,
    config: AsyncConfig,
    /// Woken on a new request.
    submitted: Notify,
    /// Woken whenever a request changes state (dispatched, or final).
    changed: Notify,
    token: Secret,
    token_text: String,
    next_id: AtomicU64,
    id_prefix: String,
    metrics: AsyncMetrics,
    shared: Arc<Shared>,
    /// Deliveries under way.
    in_flight: AtomicU64,
    /// What they count against the budget, in the configured unit.
    in_flight_cost: AtomicU64,
    /// The fleet answered 429 since the last reading.
    throttled: AtomicBool,
}

/// Why a submission was refused.
pub enum SubmitError {
    Full(usize),
    TooLarge(usize),
    Storage(String),
}

impl AsyncQueue {
    pub fn open(config: AsyncConfig, shared: Arc<Shared>) -> Result<Arc<Self>, String> {
        let mut seed = [0u8; 16];
        getrandom(&mut seed);
        let store = match &config.redis_url {
            None => {
                Backend::Embedded(Store::open(&config.dir, config.queue.clone()).map_err(|e| {
                    format!(
                        "cannot open the async queue in {}: {e}",
                        config.dir.display()
                    )
                })?)
            }
            Some(url) => {
                let consumer: String = seed[8..].iter().map(|b| format!("{b:02x}")).collect();
                Backend::Redis(Box::new(
                    redis_store::RedisStore::open(
                        url,
                        config.queue.clone(),
                        format!("balancer-{consumer}"),
                    )
                    .map_err(|e| format!("cannot open the async queue at {url}: {e}"))?,
                ))
            }
        };
        let token_text: String = seed.iter().map(|b| format!("{b:02x}")).collect();
        let id_prefix: String = seed[..6].iter().map(|b| format!("{b:02x}")).collect();
        let metrics = AsyncMetrics::new(&shared);
        Ok(Arc::new(AsyncQueue {
            store,
            config,
            submitted: Notify::new(),
            changed: Notify::new(),
            token: Secret::new(&token_text),
            token_text,
            next_id: AtomicU64::new(0),
            id_prefix,
            metrics,
            shared,
            in_flight: AtomicU64::new(0),
            in_flight_cost: AtomicU64::new(0),
            throttled: AtomicBool::new(false),
        }))
    }

    pub fn priority(&self) -> i32 {
        self.config.priority
    }

    /// Whether a request carries the dispatcher's token.
    pub fn is_dispatcher(&self, token: Option<&[u8]>) -> bool {
        token.is_some_and(|t| self.token.matches(t))
    }

    fn new_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("areq_{}{:016x}{n:08x}", self.id_prefix, now_ms())
    }

    pub async fn submit(self: &Arc<Self>, job: NewJob) -> Result<(Job, bool), SubmitError> {
        let q = Arc::clone(self);
        let id = self.new_id();
        let result = tokio::task::spawn_blocking(move || q.store.submit(job, id, now_ms()))
            .await
            .map_err(|e| SubmitError::Storage(e.to_string()))?;
        match result {
            Ok(done) => {
                self.submitted.notify_one();
                Ok(done)
            }
            Err(StoreError::Full(n)) => Err(SubmitError::Full(n)),
            Err(StoreError::TooLarge(n)) => Err(SubmitError::TooLarge(n)),
            Err(e) => Err(SubmitError::Storage(e.to_string())),
        }
    }

    /// The request `id`; with `wait`, once it is final or `wait` passed.
    pub async fn get(self: &Arc<Self>, id: &str, wait: Duration) -> Result<Option<Job>, String> {
        self.wait_until(
            wait,
            |job: &Option<Job>| job.as_ref().is_none_or(|j| j.status.is_final()),
            {
                let id = id.to_string();
                move |q: &Backend| q.get(&id)
            },
        )
        .await
        .map_err(|e| e.to_string())
    }

    /// The request `id` once its state differs from `seen` (or `wait` passed).
    pub async fn next_state(
        self: &Arc<Self>,
        id: &str,
        seen: Option<Status>,
        wait: Duration,
    ) -> Result<Option<Job>, String> {
        self.wait_until(
            wait,
            move |job: &Option<Job>| job.as_ref().is_none_or(|j| Some(j.status) != seen),
            {
                let id = id.to_string();
                move |q: &Backend| q.get(&id)
            },
        )
        .await
        .map_err(|e| e.to_string())
    }

    /// Finished requests after the feed position `after`, in finish order;
    /// with `wait`, once there is one or `wait` passed.
    pub async fn results(
        self: &Arc<Self>,
        after: Option<String>,
        limit: usize,
        wait: Duration,
    ) -> Result<Vec<(String, Job)>, StoreError> {
        self.wait_until(
            wait,
            |found: &Vec<(String, Job)>| !found.is_empty(),
            move |q: &Backend| q.finished_since(after.as_deref(), limit),
        )
        .await
    }

    /// Reads with `read` (off the async threads) until `done` holds or
    /// `wait` passed, waking on every state change.
    async fn wait_until<T: Send + 'static>(
        self: &Arc<Self>,
        wait: Duration,
        done: impl Fn(&T) -> bool,
        read: impl Fn(&Backend) -> Result<T, StoreError> + Send + Sync + Clone + 'static,
    ) -> Result<T, StoreError> {
        let deadline = Instant::now() + wait;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let q = Arc::clone(self);
            let read = read.clone();
            let found = tokio::task::spawn_blocking(move || read(&q.store))
                .await
                .map_err(|e| StoreError::Storage(e.to_string()))??;
            if done(&found) || Instant::now() >= deadline {
                return Ok(found);
            }
            let _ = tokio::time::timeout_at(deadline.into(), changed).await;
        }
    }

    pub async fn cancel(self: &Arc<Self>, id: &str) -> Result<Option<Job>, String> {
        let q = Arc::clone(self);
        let key = id.to_string();
        let job = tokio::task::spawn_blocking(move || q.store.cancel(&key, now_ms()))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        if job.as_ref().is_some_and(|j| j.status == Status::Cancelled) {
            self.metrics.ended(Status::Cancelled);
            self.changed.notify_waiters();
        }
        Ok(job)
    }
}

/// A request as the API shows it.
pub fn view(job: &Job) -> Value {
    let result = job.answer.as_ref().map(|a| {
        serde_json::from_str::<Value>(&a.body).unwrap_or_else(|_| Value::String(a.body.clone()))
    });
    json!({
        "id": job.id,
        "object": "async.request",
        "status": job.status,
        "path": job.path,
        "fairness_id": job.fairness_id,
        "attempts": job.attempts,
        "created_at": job.created_ms / 1000,
        "created_at_ms": job.created_ms,
        "updated_at_ms": job.updated_ms,
        "response_status": job.answer.as_ref().map(|a| a.status),
        "response": result,
        "last_error": job.last_error,
    })
}

/// Runs an instant query; its first sample (a vector's or a scalar) is `D`.
async fn query_prometheus(client: &reqwest::Client, q: &PromQuery) -> Result<f64, String> {
    let url = format!("{}/api/v1/query", q.url.trim_end_matches('/'));
    let resp = client
        .get(&url)
        .query(&[("query", q.query.as_str())])
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|e| format!("cannot query Prometheus at {url}: {e}"))?;
    let status = resp.status();
    let body: Value = resp
        .json()
        .await
        .map_err(|e| format!("Prometheus answered {status} with no JSON: {e}"))?;
    prometheus_value(&body)
}

/// `D` from a Prometheus query answer.
fn prometheus_value(body: &Value) -> Result<f64, String> {
    if body["status"] != "success" {
        return Err(format!("Prometheus refused the query: {}", body["error"]));
    }
    let result = &body["data"]["result"];
    let sample = match body["data"]["resultType"].as_str() {
        Some("vector") => &result[0]["value"],
        Some("scalar") => result,
        other => {
            return Err(format!(
                "the query gave a {other:?}, not a vector or scalar"
            ))
        }
    };
    sample[1]
        .as_str()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| v.is_finite())
        .ok_or_else(|| "the query gave no number (an empty vector or NaN)".to_string())
}

/// Random bytes for ids and the token, from the OS.
fn getrandom(buf: &mut [u8]) {
    use std::io::Read;
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .is_err()
    {
        // Not secret then, but unique enough for ids; the token is only
        // ever compared, never guessable from outside the process's port.
        let t = now_ms().to_le_bytes();
        for (i, b) in buf.iter_mut().enumerate() {
            *b = t[i % 8] ^ (i as u8).wrapping_mul(97);
        }
    }
}

/// Sends queued requests to the fleet while the budget allows.
pub struct Dispatcher {
    pub queue: Arc<AsyncQueue>,
    /// The balancer's own inference port.
    pub inference: SocketAddr,
}

impl Dispatcher {
    /// `D` for the configured gate, and `max_sys`.
    /// The share of the eligible servers' slots not taken by interactive
    /// work (busy, or waiting in the buffer; the dispatcher's own requests
    /// excluded), and those slots. No slots: no share.
    fn interactive_spare(&self, async_in_flight: u64) -> (f64, u64) {
        let snap = self.queue.shared.snapshot();
        let (mut slots, mut busy) = (0u64, 0u64);
        for e in snap.endpoints.iter().filter(|e| e.eligible) {
            if let Some(a) = &e.agent {
                slots += u64::from(a.slots_total);
                busy += u64::from(a.slots_total.saturating_sub(e.free_slots));
            }
        }
        if slots == 0 {
            return (0.0, 0);
        }
        let interactive = (busy + snap.buffered as u64).saturating_sub(async_in_flight);
        (1.0 - (interactive as f64 / slots as f64).min(1.0), slots)
    }

    /// `D` for the configured gate, and `max_sys`.
    async fn spare(&self, client: &reqwest::Client, async_in_flight: u64) -> (Option<f64>, u64) {
        let (interactive, slots) = self.interactive_spare(async_in_flight);
        let max_sys = self.queue.config.max_sys.unwrap_or(slots);
        let spare = match (self.queue.config.gate, &self.queue.config.prometheus) {
            (Gate::AlwaysOpen, _) => Some(1.0),
            (Gate::Prometheus, Some(q)) => match query_prometheus(client, q).await {
                Ok(d) => Some(d),
                Err(e) => {
                    warn!("async gate: {e}; D = 0 until it can be read");
                    None
                }
            },
            (Gate::Prometheus, None) | (Gate::Balancer, _) => Some(interactive),
        };
        (spare, max_sys)
    }

    async fn deliver(queue: Arc<AsyncQueue>, client: reqwest::Client, url: String, job: Job) {
        if job.attempts > 1 {
            queue
                .metrics
                .deliveries
                .with_label_values(&["default", "redelivery"])
                .inc();
        } else {
            queue
                .metrics
                .deliveries
                .with_label_values(&["default", "first"])
                .inc();
        }
        let sent = client
            .post(format!("{url}{}", job.path))
            .header("content-type", "application/json")
            .header(TOKEN_HEADER, queue.token_text.as_str())
            .header(crate::policy::FAIRNESS_ID_HEADER, job.fairness_id.as_str())
            .header(crate::policy::TTL_HEADER, "60s")
            .body(job.body.clone())
            .send()
            .await;
        let (id, attempt) = (job.id.clone(), job.attempts);
        let q = Arc::clone(&queue);
        let outcome = match sent {
            Ok(resp) => {
                let status = resp.status().as_u16();
                match resp.text().await {
                    Ok(body) => Ok((status, body)),
                    Err(e) => Err(format!("answer cut: {e}")),
                }
            }
            Err(e) => Err(format!("cannot reach the inference port: {e}")),
        };
        let ended = tokio::task::spawn_blocking(move || match outcome {
            Ok((status, _)) if matches!(status, 429 | 503 | 504) => q
                .store
                .retry(
                    &id,
                    attempt,
                    &format!("the fleet had no room ({status})"),
                    false,
                    now_ms(),
                )
                .map(|j| (j, Some(status))),
            Ok((status, _)) if status >= 500 => q
                .store
                .retry(
                    &id,
                    attempt,
                    &format!("the fleet answered {status}"),
                    true,
                    now_ms(),
                )
                .map(|j| (j, None)),
            Ok((status, body)) => q
                .store
                .finish(&id, attempt, Answer { status, body }, now_ms())
                .map(|j| (j, None)),
            Err(e) => q
                .store
                .retry(&id, attempt, &e, true, now_ms())
                .map(|j| (j, None)),
        })
        .await;
        match ended {
            Ok(Ok((Some(job), no_room))) => {
                if no_room == Some(429) {
                    queue.throttled.store(true, Ordering::Relaxed);
                }
                if job.status.is_final() {
                    queue.metrics.ended(job.status);
                    queue.changed.notify_waiters();
                }
            }
            Ok(Ok((None, _))) => {}
            Ok(Err(e)) => warn!(request = job.id, "async queue store: {e}"),
            Err(e) => warn!(request = job.id, "async delivery task: {e}"),
        }
        queue.in_flight.fetch_sub(1, Ordering::Relaxed);
        queue
            .in_flight_cost
            .fetch_sub(queue.config.unit.cost(&job), Ordering::Relaxed);
        queue.submitted.notify_one();
    }
}

#[async_trait]
impl BackgroundService for Dispatcher {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let queue = &self.queue;
        let client = match reqwest::Client::builder()
            .timeout(Duration::from_secs(600))
            .build()
        {
            Ok(c) => c,
            Err(e) => {
                warn!("async dispatcher cannot build its HTTP client: {e}");
                return;
            }
        };
        let host = if self.inference.ip().is_unspecified() {
            SocketAddr::from(([127, 0, 0, 1], self.inference.port()))
        } else {
            self.inference
        };
        let url = format!("http://{host}");
        let mut budget = Budget::new(BudgetConfig {
            max_sys: 0,
            baseline: queue.config.baseline,
        });
        let mut last_reclaim = Instant::now() - Duration::from_secs(1);
        let interval = queue.config.gate_interval;
        let mut last_reading = Instant::now() - interval;
        let mut throttled_until: Option<Instant> = None;
        let mut results_full = false;
        let mut window: std::collections::VecDeque<(Instant, f64)> = Default::default();
        info!(dir = %queue.config.dir.display(), "async dispatcher started");
        loop {
            if last_reclaim.elapsed() >= Duration::from_millis(500) {
                last_reclaim = Instant::now();
                let q = Arc::clone(queue);
                if let Ok(Ok(r)) =
                    tokio::task::spawn_blocking(move || q.store.reclaim(now_ms())).await
                {
                    for _ in &r.dead_lettered {
                        queue.metrics.ended(Status::DeadLettered);
                    }
                    for _ in &r.expired {
                        queue.metrics.ended(Status::Expired);
                    }
                    if !r.dead_lettered.is_empty() || !r.expired.is_empty() {
                        queue.changed.notify_waiters();
                    }
                }
                let q = Arc::clone(queue);
                if let Ok(Ok(c)) = tokio::task::spawn_blocking(move || q.store.counts()).await {
                    let m = &queue.metrics;
                    m.requests
                        .with_label_values(&["default", "queued"])
                        .set(c.queued as i64);
                    m.requests
                        .with_label_values(&["default", "dispatched"])
                        .set(c.dispatched as i64);
                    m.oldest_age.set(
                        c.oldest_queued_ms
                            .map_or(0.0, |t| now_ms().saturating_sub(t) as f64 / 1000.0),
                    );
                    m.results.set(c.finished as i64);
                    let full = c.finished >= queue.config.queue.max_results;
                    if full && !results_full {
                        warn!(
                            kept = c.finished,
                            "async result store full: no new dispatches until results age out"
                        );
                    }
                    results_full = full;
                }
            }
            let in_flight = queue.in_flight.load(Ordering::Relaxed);
            let now = Instant::now();
            // Exported every round, for a PromQL gate to read (see the
            // README): what the balancer gate would see now.
            queue
                .metrics
                .interactive_spare
                .set(self.interactive_spare(in_flight).0);
            // The balancer gate is sampled on every round and the lowest D
            // of the last interval counts: a moment when interactive
            // clients happen to be between requests is not spare capacity.
            let sample = match queue.config.gate {
                Gate::Balancer => true,
                _ => now.duration_since(last_reading) >= interval,
            };
            if sample && throttled_until.is_none_or(|t| now >= t) {
                last_reading = now;
                throttled_until = None;
                let (spare, max_sys) = self.spare(&client, in_flight).await;
                budget.set_config(BudgetConfig {
                    max_sys,
                    baseline: queue.config.baseline,
                });
                let reading = match queue.config.gate {
                    Gate::Balancer => {
                        window.push_back((now, spare.unwrap_or(0.0)));
                        while window
                            .front()
                            .is_some_and(|(t, _)| now.duration_since(*t) > interval)
                        {
                            window.pop_front();
                        }
                        window.iter().map(|(_, d)| *d).reduce(f64::min)
                    }
                    _ => spare,
                };
                budget.reading(reading);
            }
            if queue.throttled.swap(false, Ordering::Relaxed) {
                budget.throttled();
                throttled_until = Some(now + interval);
            }
            queue.metrics.spare.set(budget.spare());
            queue.metrics.allowed.set(budget.allowed() as f64);
            let cost = queue.in_flight_cost.load(Ordering::Relaxed);
            let available = budget.available(cost);
            // In requests, take all that fit at once; in tokens or bytes,
            // one at a time (its cost is known once it is read; the last
            // one may overshoot N).
            let n = match queue.config.unit {
                CapacityUnit::Requests => available as usize,
                _ => usize::from(available > 0),
            };
            if n > 0 && !results_full && !self.queue.shared.is_shutting_down() {
                let q = Arc::clone(queue);
                let leased = tokio::task::spawn_blocking(move || q.store.lease(n, now_ms())).await;
                match leased {
                    Ok(Ok(jobs)) => {
                        if !jobs.is_empty() {
                            queue.changed.notify_waiters();
                        }
                        let leased_any = !jobs.is_empty();
                        for job in jobs {
                            queue.in_flight.fetch_add(1, Ordering::Relaxed);
                            queue
                                .in_flight_cost
                                .fetch_add(queue.config.unit.cost(&job), Ordering::Relaxed);
                            tokio::spawn(Self::deliver(
                                Arc::clone(queue),
                                client.clone(),
                                url.clone(),
                                job,
                            ));
                        }
                        if leased_any && n < available as usize {
                            // More may fit: look again at once.
                            continue;
                        }
                    }
                    Ok(Err(e)) => warn!("async queue store: {e}"),
                    Err(e) => warn!("async lease task: {e}"),
                }
            }
            tokio::select! {
                () = queue.submitted.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_cost_one_their_bytes_or_their_estimated_tokens() {
        let body = r#"{"messages":[{"role":"user","content":"hello there"}],"max_tokens":100}"#;
        let mut job = Job::new(
            NewJob {
                body: body.into(),
                ..NewJob::default()
            },
            "a".into(),
            0,
        );
        assert_eq!(CapacityUnit::Requests.cost(&job), 1);
        assert_eq!(CapacityUnit::Bytes.cost(&job), body.len() as u64);
        assert_eq!(
            CapacityUnit::Tokens.cost(&job),
            (body.len() as u64).div_ceil(4) + 100
        );
        job.body = "{}".into();
        assert_eq!(CapacityUnit::Tokens.cost(&job), 1 + DEFAULT_OUTPUT_TOKENS);
    }

    #[test]
    fn prometheus_answers_give_d_or_a_reason() {
        let vector = json!({"status": "success", "data": {"resultType": "vector",
            "result": [{"metric": {}, "value": [1.7e9, "0.75"]}]}});
        assert_eq!(prometheus_value(&vector), Ok(0.75));
        let scalar = json!({"status": "success", "data": {"resultType": "scalar",
            "result": [1.7e9, "0.5"]}});
        assert_eq!(prometheus_value(&scalar), Ok(0.5));
        let empty = json!({"status": "success", "data": {"resultType": "vector", "result": []}});
        assert!(prometheus_value(&empty).unwrap_err().contains("no number"));
        let nan =
            json!({"status": "success", "data": {"resultType": "scalar", "result": [1, "NaN"]}});
        assert!(prometheus_value(&nan).is_err());
        let refused = json!({"status": "error", "error": "parse error"});
        assert!(prometheus_value(&refused)
            .unwrap_err()
            .contains("parse error"));
        let matrix = json!({"status": "success", "data": {"resultType": "matrix", "result": []}});
        assert!(prometheus_value(&matrix).is_err());
    }
}
