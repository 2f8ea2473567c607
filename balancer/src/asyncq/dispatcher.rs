//! The dispatcher: takes queued async requests while the dispatch budget
//! allows, sends them through this balancer's own inference port, and
//! records what the fleet answered.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use flowgate::budget::{DispatchGate, GateConfig, SpareSource};
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use serde_json::Value;
use tracing::{info, warn};

use super::job::{Answer, Job, Status};
use super::{now_ms, AsyncQueue, CapacityUnit, Gate, PromQuery, TOKEN_HEADER};

/// How often expired Batch API files and batches are looked for.
const FILE_PURGE_INTERVAL: Duration = Duration::from_secs(10);

/// Sends queued requests to the fleet while the budget allows.
pub struct AsyncDispatcher {
    pub queue: Arc<AsyncQueue>,
    /// The balancer's own inference port.
    pub inference: SocketAddr,
}

impl AsyncDispatcher {
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

    async fn deliver(
        queue: Arc<AsyncQueue>,
        client: reqwest::Client,
        url: String,
        job: Job,
        _under_way: DeliveryUnderWay,
    ) {
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
        let mut request = client
            .post(format!("{url}{}", job.path))
            .header("content-type", "application/json")
            .header(TOKEN_HEADER, queue.token_text.as_str())
            .header(
                flowgate::admission::FAIRNESS_ID_HEADER,
                job.fairness_id.as_str(),
            )
            .header(flowgate::admission::TTL_HEADER, "60s");
        if let Some(session) = &job.session {
            request = request.header(
                flowgate::admission::DELIVERED_SESSION_HEADER,
                session.as_str(),
            );
        }
        if let Some(ms) = deadline_objective_ms(job.deadline_ms, now_ms()) {
            request = request.header(flowgate::objective::TTFT_HEADER, ms.to_string());
        }
        let sent = request.body(job.body.clone()).send().await;
        let (id, attempt) = (job.id.clone(), job.attempts);
        let q = Arc::clone(&queue);
        let outcome = match sent {
            Ok(resp) => {
                // Over its tenant's quota is the request's own answer, not
                // a fleet without room: it ends with it (retried at once it
                // would only meet the same window again), and other
                // tenants' work is not held back.
                let over_quota = resp
                    .headers()
                    .get(crate::reply::DROP_REASON_HEADER)
                    .is_some_and(|v| v == crate::reply::QUOTA_EXCEEDED);
                let status = resp.status().as_u16();
                match resp.text().await {
                    Ok(body) => Ok((status, body, over_quota)),
                    Err(e) => Err(format!("answer cut: {e}")),
                }
            }
            Err(e) => Err(format!("cannot reach the inference port: {e}")),
        };
        let ended = tokio::task::spawn_blocking(move || match outcome {
            Ok((status, _, false)) if matches!(status, 429 | 503 | 504) => q
                .store
                .retry(
                    &id,
                    attempt,
                    &format!("the fleet had no room ({status})"),
                    false,
                    now_ms(),
                )
                .map(|j| (j, Some(status))),
            Ok((status, _, _)) if status >= 500 => q
                .store
                .retry(
                    &id,
                    attempt,
                    &format!("the fleet answered {status}"),
                    true,
                    now_ms(),
                )
                .map(|j| (j, None)),
            Ok((status, body, _)) => q
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
    }
}

/// A delivery counted in the queue's in-flight totals (which the budget
/// and the result store's bound read) from its lease until this is
/// dropped, however the delivery ends: answered, failed, panicked or its
/// task dropped. Then the dispatcher looks at the queue again.
struct DeliveryUnderWay {
    queue: Arc<AsyncQueue>,
    cost: u64,
}

impl DeliveryUnderWay {
    fn new(queue: &Arc<AsyncQueue>, job: &Job) -> Self {
        let cost = queue.config.unit.cost(job);
        queue.in_flight.fetch_add(1, Ordering::Relaxed);
        queue.in_flight_cost.fetch_add(cost, Ordering::Relaxed);
        DeliveryUnderWay {
            queue: Arc::clone(queue),
            cost,
        }
    }
}

impl Drop for DeliveryUnderWay {
    fn drop(&mut self) {
        self.queue.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.queue
            .in_flight_cost
            .fetch_sub(self.cost, Ordering::Relaxed);
        self.queue.submitted.notify_one();
    }
}

impl AsyncDispatcher {
    /// Deletes the Batch API files and batches whose retention ended.
    async fn purge_files(&self) {
        let q = Arc::clone(&self.queue);
        match tokio::task::spawn_blocking(move || q.purge_expired_files(now_ms() / 1000)).await {
            Ok(Ok((0, 0))) => {}
            Ok(Ok((files, batches))) => {
                info!(
                    files,
                    batches, "Batch API: expired files and batches deleted"
                )
            }
            Ok(Err(e)) => warn!("Batch API retention: {}", e.2),
            Err(e) => warn!("Batch API retention task: {e}"),
        }
    }

    /// Lost leases delivered again, deadlines expired, then the queue's
    /// gauges; warns once when the result store fills (`results_full`).
    async fn reclaim(&self, results_full: &mut bool) {
        let queue = &self.queue;
        let q = Arc::clone(queue);
        if let Ok(Ok(r)) = tokio::task::spawn_blocking(move || q.store.reclaim(now_ms())).await {
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
            if full && !*results_full {
                warn!(
                    kept = c.finished,
                    "async result store full: no new dispatches until results age out"
                );
            }
            *results_full = full;
        }
    }

    /// Gives the gate this round's readings (this balancer's own view every
    /// round, exported for a PromQL gate to read; Prometheus when due; a
    /// 429 since the last round) and exports what it allows.
    async fn read_gate(&self, gate: &mut DispatchGate, client: &reqwest::Client) {
        let queue = &self.queue;
        let now = Instant::now();
        let (local, slots) = self.interactive_spare(queue.in_flight.load(Ordering::Relaxed));
        queue.metrics.interactive_spare.set(local);
        if let (true, Some(q)) = (gate.prometheus_due(now), &queue.config.prometheus) {
            let read = match query_prometheus(client, q).await {
                Ok(d) => Some(d),
                Err(e) => {
                    warn!("async gate: {e}; D = 0 until it can be read");
                    None
                }
            };
            let result = if read.is_some() { "ok" } else { "error" };
            queue.metrics.readings.with_label_values(&[result]).inc();
            gate.prometheus_reading(read, now);
        }
        gate.round(local, slots, now);
        if queue.throttled.swap(false, Ordering::Relaxed) {
            gate.throttled(now);
        }
        queue.metrics.spare.set(gate.budget().spare());
        queue.metrics.allowed.set(gate.budget().allowed() as f64);
    }

    /// Leases up to `n` queued requests. The result store's bound holds at
    /// every instant: what is kept now plus every delivery under way (each
    /// may add an answer) never passes it.
    async fn lease(&self, n: usize) -> Vec<Job> {
        let max_results = self.queue.config.queue.max_results;
        let q = Arc::clone(&self.queue);
        let leased = tokio::task::spawn_blocking(move || {
            let kept = q.store.counts()?.finished;
            let under_way = q.in_flight.load(Ordering::Relaxed);
            let room = max_results.saturating_sub(kept.saturating_add(under_way));
            let n = n.min(usize::try_from(room).unwrap_or(usize::MAX));
            if n == 0 {
                return Ok(Vec::new());
            }
            q.store.lease(n, now_ms())
        })
        .await;
        match leased {
            Ok(Ok(jobs)) => jobs,
            Ok(Err(e)) => {
                warn!("async queue store: {e}");
                Vec::new()
            }
            Err(e) => {
                warn!("async lease task: {e}");
                Vec::new()
            }
        }
    }
}

#[async_trait]
impl BackgroundService for AsyncDispatcher {
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
        let mut gate = DispatchGate::new(GateConfig {
            source: match queue.config.gate {
                Gate::AlwaysOpen => SpareSource::AlwaysOpen,
                Gate::Balancer => SpareSource::Local,
                Gate::Prometheus => SpareSource::Prometheus,
            },
            interval: queue.config.gate_interval,
            max_sys: queue.config.max_sys,
            baseline: queue.config.baseline,
        });
        let mut last_reclaim = Instant::now() - Duration::from_secs(1);
        let mut last_file_purge = Instant::now() - FILE_PURGE_INTERVAL;
        let mut results_full = false;
        info!(dir = %queue.config.dir.display(), "async dispatcher started");
        loop {
            if last_file_purge.elapsed() >= FILE_PURGE_INTERVAL {
                last_file_purge = Instant::now();
                self.purge_files().await;
            }
            if last_reclaim.elapsed() >= Duration::from_millis(500) {
                last_reclaim = Instant::now();
                self.reclaim(&mut results_full).await;
            }
            self.read_gate(&mut gate, &client).await;
            let cost = queue.in_flight_cost.load(Ordering::Relaxed);
            let available = gate.budget().available(cost);
            // In requests, take all that fit at once; in tokens or bytes,
            // one at a time (its cost is known once it is read; the last
            // one may overshoot N).
            let n = match queue.config.unit {
                CapacityUnit::Requests => available as usize,
                _ => usize::from(available > 0),
            };
            let mut more_may_fit = false;
            if n > 0 && !queue.shared.is_shutting_down() {
                let jobs = self.lease(n).await;
                if !jobs.is_empty() {
                    queue.changed.notify_waiters();
                }
                let leased_any = !jobs.is_empty();
                for job in jobs {
                    let under_way = DeliveryUnderWay::new(queue, &job);
                    tokio::spawn(Self::deliver(
                        Arc::clone(queue),
                        client.clone(),
                        url.clone(),
                        job,
                        under_way,
                    ));
                }
                more_may_fit = leased_any && n < available as usize;
            }
            queue.metrics.rounds.inc();
            if more_may_fit {
                // Look again at once.
                continue;
            }
            tokio::select! {
                () = queue.submitted.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
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

/// An async job's latency objective: its first token by its deadline
/// (`deadline_ms`, Unix ms), what is left of it at `now_ms`, within the
/// objectives' range; none without a deadline, or once it passed (the job
/// expires).
fn deadline_objective_ms(deadline_ms: Option<u64>, now_ms: u64) -> Option<u32> {
    let left = deadline_ms?.checked_sub(now_ms).filter(|&ms| ms > 0)?;
    Some(left.min(u64::from(flowgate::objective::MAX_OBJECTIVE_MS)) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_async_job_is_due_by_its_deadline() {
        assert_eq!(deadline_objective_ms(None, 1_000), None);
        assert_eq!(deadline_objective_ms(Some(1_500), 1_000), Some(500));
        assert_eq!(deadline_objective_ms(Some(1_000), 1_000), None, "passed");
        assert_eq!(deadline_objective_ms(Some(900), 1_000), None);
        assert_eq!(
            deadline_objective_ms(Some(u64::MAX), 0),
            Some(flowgate::objective::MAX_OBJECTIVE_MS),
            "an hour at most"
        );
    }
    use crate::asyncq::job::NewJob;
    use crate::asyncq::AsyncConfig;
    use serde_json::json;

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

    #[tokio::test]
    async fn a_delivery_gives_its_budget_back_however_it_ends() {
        let dir = std::env::temp_dir().join(format!("flowgate-delivery-{}", std::process::id()));
        let config = AsyncConfig {
            dir: dir.clone(),
            redis_url: None,
            queue: Default::default(),
            gate: Gate::AlwaysOpen,
            max_sys: None,
            unit: CapacityUnit::Bytes,
            baseline: 0.0,
            priority: -10,
            gate_interval: Duration::from_secs(1),
            prometheus: None,
        };
        let shared = crate::gate::FleetGate::new(Default::default());
        let queue = AsyncQueue::open(config, shared).unwrap();
        let job = Job::new(
            NewJob {
                body: "0123456789".into(),
                ..NewJob::default()
            },
            "a".into(),
            0,
        );
        let totals = |q: &AsyncQueue| {
            (
                q.in_flight.load(Ordering::Relaxed),
                q.in_flight_cost.load(Ordering::Relaxed),
            )
        };
        let ended = DeliveryUnderWay::new(&queue, &job);
        let panicked = DeliveryUnderWay::new(&queue, &job);
        let dropped = DeliveryUnderWay::new(&queue, &job);
        assert_eq!(totals(&queue), (3, 30));
        drop(ended);
        let task = tokio::spawn(async move {
            let _under_way = panicked;
            panic!("a delivery that panics");
        });
        assert!(task.await.is_err());
        let never = tokio::spawn(async move {
            let _under_way = dropped;
            std::future::pending::<()>().await;
        });
        never.abort();
        let _ = never.await;
        assert_eq!(totals(&queue), (0, 0), "nothing leaked");
        let _ = std::fs::remove_dir_all(dir);
    }
}
