//! The async path: a durable queue of inference requests that a dispatcher
//! feeds to the fleet only while the dispatch budget ([`flowgate::budget`])
//! allows; results are fetched later by id, long-poll, event stream or the
//! results feed. Its requests ([`job`]) live in a [`store::JobStore`]: the
//! embedded store or Redis (shared by several balancers); the OpenAI Batch
//! API's model ([`batch`]) is built on it. The inference port's
//! `async_api` and `batch_api` answer both APIs.
//!
//! The [`AsyncDispatcher`] sends each request to this balancer's own inference port
//! with a per-process token, so async work goes through the same flow
//! control and scheduling as interactive work, in its own low-priority band:
//! interactive requests always go first, async ones fill what is left.

pub mod batch;
mod dispatcher;
pub mod job;
pub mod store;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use prometheus::{Gauge, IntCounterVec, IntGaugeVec, Opts};
use serde_json::{json, Value};
use tokio::sync::Notify;

use crate::auth::Secret;
use crate::gate::FleetGate;
pub use dispatcher::AsyncDispatcher;
use job::{Job, NewJob, QueueConfig, Status, StoreError};
use store::{EmbeddedStore, JobStore, RedisStore};

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
    rounds: prometheus::IntCounter,
    readings: IntCounterVec,
}

impl AsyncMetrics {
    fn new(shared: &FleetGate) -> Self {
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
            rounds: prometheus::IntCounter::new(
                "flowgate_async_dispatcher_rounds_total",
                "Rounds of the async dispatcher (each reads the gate and takes what it \
                 allows): a dispatcher that stalls stops counting",
            )
            .expect("metric"),
            readings: IntCounterVec::new(
                Opts::new(
                    "flowgate_async_gate_readings_total",
                    "Readings of D from Prometheus by the async gate (--async-gate prometheus), \
                     by result: ok, or error (D = 0 until the next good one)",
                ),
                &["result"],
            )
            .expect("metric"),
        };
        for c in [
            Box::new(m.requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.rounds.clone()),
            Box::new(m.readings.clone()),
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
    store: Box<dyn JobStore>,
    config: AsyncConfig,
    /// Woken on a new request.
    submitted: Notify,
    /// Woken whenever a request changes state (dispatched, or final).
    changed: Notify,
    token: Secret,
    token_text: String,
    metrics: AsyncMetrics,
    shared: Arc<FleetGate>,
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
    pub fn open(config: AsyncConfig, shared: Arc<FleetGate>) -> Result<Arc<Self>, String> {
        let mut seed = [0u8; 16];
        getrandom::fill(&mut seed)
            .map_err(|e| format!("the OS gave no random bytes for the async token: {e}"))?;
        let store: Box<dyn JobStore> = match &config.redis_url {
            None => Box::new(
                EmbeddedStore::open(&config.dir, config.queue.clone()).map_err(|e| {
                    format!(
                        "cannot open the async queue in {}: {e}",
                        config.dir.display()
                    )
                })?,
            ),
            Some(url) => {
                let consumer: String = seed[8..].iter().map(|b| format!("{b:02x}")).collect();
                Box::new(
                    RedisStore::open(url, config.queue.clone(), format!("balancer-{consumer}"))
                        .map_err(|e| format!("cannot open the async queue at {url}: {e}"))?,
                )
            }
        };
        let token_text: String = seed.iter().map(|b| format!("{b:02x}")).collect();
        let metrics = AsyncMetrics::new(&shared);
        Ok(Arc::new(AsyncQueue {
            store,
            config,
            submitted: Notify::new(),
            changed: Notify::new(),
            token: Secret::new(&token_text),
            token_text,
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

    pub async fn submit(self: &Arc<Self>, job: NewJob) -> Result<(Job, bool), SubmitError> {
        let q = Arc::clone(self);
        let id = random_id("areq_", None).map_err(SubmitError::Storage)?;
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

    /// The request `id` if `caller` may see it; with `wait`, once it is
    /// final or `wait` passed.
    pub async fn get(
        self: &Arc<Self>,
        id: &str,
        wait: Duration,
        caller: Option<&str>,
    ) -> Result<Option<Job>, String> {
        self.wait_until(
            wait,
            |job: &Option<Job>| job.as_ref().is_none_or(|j| j.status.is_final()),
            read_visible(id, caller),
        )
        .await
        .map_err(|e| e.to_string())
    }

    /// The request `id` (if `caller` may see it) once its state differs
    /// from `seen` (or `wait` passed).
    pub async fn next_state(
        self: &Arc<Self>,
        id: &str,
        seen: Option<Status>,
        wait: Duration,
        caller: Option<&str>,
    ) -> Result<Option<Job>, String> {
        self.wait_until(
            wait,
            move |job: &Option<Job>| job.as_ref().is_none_or(|j| Some(j.status) != seen),
            read_visible(id, caller),
        )
        .await
        .map_err(|e| e.to_string())
    }

    /// Finished requests `caller` may see after the feed position `after`,
    /// in finish order, and the position to read on from; with `wait`, once
    /// there is one or `wait` passed. One call looks at no more than
    /// [`FEED_SCAN_LIMIT`] entries, so another tenant's many results cost a
    /// caller a bounded amount of work (it reads on from the cursor).
    pub async fn results(
        self: &Arc<Self>,
        after: Option<String>,
        limit: usize,
        wait: Duration,
        caller: Option<&str>,
    ) -> Result<FeedPage, StoreError> {
        let caller = caller.map(str::to_string);
        self.wait_until(
            wait,
            |page: &FeedPage| !page.found.is_empty(),
            move |q: &dyn JobStore| {
                let mut page = FeedPage {
                    found: Vec::new(),
                    next: after.clone(),
                };
                let mut scanned = 0;
                while page.found.len() < limit && scanned < FEED_SCAN_LIMIT {
                    let ask = (limit - page.found.len()).min(FEED_SCAN_LIMIT - scanned);
                    let batch = q.finished_since(page.next.as_deref(), ask)?;
                    let end = batch.len() < ask;
                    scanned += batch.len();
                    for (cursor, job) in batch {
                        page.next = Some(cursor.clone());
                        if visible_to(&job.fairness_id, caller.as_deref()) {
                            page.found.push((cursor, job));
                        }
                    }
                    if end {
                        break;
                    }
                }
                Ok(page)
            },
        )
        .await
    }

    /// Reads with `read` (off the async threads) until `done` holds or
    /// `wait` passed, waking on every state change.
    async fn wait_until<T: Send + 'static>(
        self: &Arc<Self>,
        wait: Duration,
        done: impl Fn(&T) -> bool,
        read: impl Fn(&dyn JobStore) -> Result<T, StoreError> + Send + Sync + Clone + 'static,
    ) -> Result<T, StoreError> {
        let deadline = Instant::now() + wait;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let q = Arc::clone(self);
            let read = read.clone();
            let found = tokio::task::spawn_blocking(move || read(q.store.as_ref()))
                .await
                .map_err(|e| StoreError::Storage(e.to_string()))??;
            if done(&found) || Instant::now() >= deadline {
                return Ok(found);
            }
            let _ = tokio::time::timeout_at(deadline.into(), changed).await;
        }
    }

    /// Cancels the request `id` if `caller` may see it (`None`: no such
    /// request, for this caller).
    pub async fn cancel(
        self: &Arc<Self>,
        id: &str,
        caller: Option<&str>,
    ) -> Result<Option<Job>, String> {
        let q = Arc::clone(self);
        let key = id.to_string();
        let caller = caller.map(str::to_string);
        let job = tokio::task::spawn_blocking(move || {
            // A request's tenant never changes: look, then cancel.
            match q.store.get(&key)? {
                Some(j) if visible_to(&j.fairness_id, caller.as_deref()) => {
                    q.store.cancel(&key, now_ms())
                }
                _ => Ok(None),
            }
        })
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

/// Results-feed entries one read looks at, at most.
pub const FEED_SCAN_LIMIT: usize = 10_000;

/// A page of the results feed.
pub struct FeedPage {
    /// (cursor, request), in finish order.
    pub found: Vec<(String, Job)>,
    /// Where the next read goes on from: past every entry looked at, the
    /// caller's or not.
    pub next: Option<String>,
}

/// Reads the request `id`, as `None` when `caller` may not see it.
fn read_visible(
    id: &str,
    caller: Option<&str>,
) -> impl Fn(&dyn JobStore) -> Result<Option<Job>, StoreError> + Send + Sync + Clone + 'static {
    let (id, caller) = (id.to_string(), caller.map(str::to_string));
    move |q: &dyn JobStore| {
        Ok(q.get(&id)?
            .filter(|j| visible_to(&j.fairness_id, caller.as_deref())))
    }
}

/// Who calls the async or Batch API.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The tenant what it creates belongs to: its API key's, else its
    /// fairness header's (or `default`).
    pub tenant: String,
    /// Whether the tenant is an identity (it came from an API key): only
    /// then are reads scoped to it.
    pub authenticated: bool,
}

impl Caller {
    /// The tenant to scope reads to, `None` without API keys.
    pub fn scope(&self) -> Option<&str> {
        self.authenticated.then_some(self.tenant.as_str())
    }

    /// Whether a record created under tenant `owner` is visible to it.
    pub fn sees(&self, owner: &str) -> bool {
        visible_to(owner, self.scope())
    }
}

/// Whether a record created under tenant `owner` is visible to `caller`.
///
/// With API keys every request carries the tenant of its key (`Some`), and
/// sees only what that tenant created: another tenant's id reads exactly as
/// an unknown one. Without keys there is no identity (`None`): nothing is
/// scoped.
pub fn visible_to(owner: &str, caller: Option<&str>) -> bool {
    caller.is_none_or(|c| c == owner)
}

/// The idempotency key as stored: with API keys, scoped to the caller's
/// tenant (the same key from two tenants names two requests; the tenant's
/// length first, so no tenant name can forge another's prefix); without
/// keys, as given.
pub fn scoped_idempotency_key(key: &str, caller: Option<&str>) -> String {
    match caller {
        Some(tenant) => format!("tenant:{}:{tenant}:{key}", tenant.len()),
        None => key.to_string(),
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

/// A new id: `prefix`, then (with `time_ms`) the time in 12 hex digits so
/// ids sort by creation, then 128 bits from the OS's random source (so an id
/// cannot be guessed from another: ids are the only key to a tenant's
/// requests, files and batches).
pub fn random_id(prefix: &str, time_ms: Option<u64>) -> Result<String, String> {
    use std::fmt::Write;
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| format!("the OS gave no random bytes: {e}"))?;
    let mut id = String::with_capacity(prefix.len() + 12 + 32);
    id.push_str(prefix);
    if let Some(t) = time_ms {
        let _ = write!(id, "{:012x}", t & 0xffff_ffff_ffff);
    }
    for b in bytes {
        let _ = write!(id, "{b:02x}");
    }
    Ok(id)
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
}
