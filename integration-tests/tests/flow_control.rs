//! Flow control seen from outside: tenant fairness, strict priority, and
//! each refusal (429 / 503 / 504 / 400) reached by the rule that should
//! reach it. Waits are read from the `x-flowgate-wait-ms` response header.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Writes a balancer config file the test removes when dropped.
/// Closed-loop client: sends chat requests one after another until `until`,
/// returning the wait (ms) of each, as the balancer reports it.
fn client_loop(
    b: &Balancer,
    headers: Vec<(&'static str, String)>,
    until: Instant,
) -> tokio::task::JoinHandle<Vec<u64>> {
    let c = client();
    let url = b.url("/v1/chat/completions");
    tokio::spawn(async move {
        let mut waits = Vec::new();
        while Instant::now() < until {
            let mut req = c.post(&url).json(&chat_body());
            for (k, v) in &headers {
                req = req.header(*k, v);
            }
            let resp = req.send().await.expect("request reaches the balancer");
            assert_eq!(resp.status(), 200, "closed-loop clients are never refused");
            let wait = resp.headers()["x-flowgate-wait-ms"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            resp.bytes().await.unwrap();
            waits.push(wait);
        }
        waits
    })
}

fn percentile(mut v: Vec<u64>, p: f64) -> u64 {
    assert!(!v.is_empty());
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

async fn collect(handles: Vec<tokio::task::JoinHandle<Vec<u64>>>) -> Vec<u64> {
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    all
}

fn tenant(id: &str) -> Vec<(&'static str, String)> {
    vec![("x-gateway-inference-fairness-id", id.to_string())]
}

/// A tenant sending 20× the traffic of another, against saturated backends,
/// leaves the quiet tenant's median wait within 2× of what it is when the
/// other tenant sends no more than the quiet one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_noisy_tenant_does_not_starve_a_quiet_one() {
    let (b, sim, _agent) = fleet(
        &[
            "--max-buffered-requests",
            "500",
            "--buffered-request-timeout",
            "60000",
        ],
        &["--slots", "2", "--ttft-ms", "100", "--output-tokens", "1"],
    )
    .await;
    let phase = Duration::from_secs(3);

    // Baseline: two tenants with two clients each keep 2 slots saturated.
    let until = Instant::now() + phase;
    let quiet: Vec<_> = (0..2)
        .map(|_| client_loop(&b, tenant("quiet"), until))
        .collect();
    let peer: Vec<_> = (0..2)
        .map(|_| client_loop(&b, tenant("peer"), until))
        .collect();
    let quiet_alone = collect(quiet).await;
    collect(peer).await;
    b.wait_in_flight(0, Duration::from_secs(5)).await;

    // The other tenant now runs 20× the quiet tenant's clients.
    let until = Instant::now() + phase;
    let noisy: Vec<_> = (0..40)
        .map(|_| client_loop(&b, tenant("noisy"), until + Duration::from_secs(60)))
        .collect();
    b.wait_buffered(38).await;
    let quiet = (0..2)
        .map(|_| client_loop(&b, tenant("quiet"), until))
        .collect();
    let quiet_flooded = collect(quiet).await;
    let noisy_waiting = b.buffered().await;
    for h in &noisy {
        h.abort();
    }
    b.wait_buffered(0).await;
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    sim.wait_idle(Duration::from_secs(5)).await;

    let (alone, flooded) = (
        percentile(quiet_alone.clone(), 0.5),
        percentile(quiet_flooded.clone(), 0.5),
    );
    eprintln!(
        "quiet tenant median wait: {alone} ms with an equal peer ({} requests), {flooded} ms \
         against a 20x tenant ({} requests); {noisy_waiting} noisy requests queued at the end",
        quiet_alone.len(),
        quiet_flooded.len()
    );
    assert!(alone >= 50, "the baseline really waited: {alone} ms");
    assert!(noisy_waiting >= 30, "the flood was queued: {noisy_waiting}");
    assert!(
        flooded <= 2 * alone,
        "quiet median wait {flooded} ms vs {alone} ms with an equal peer"
    );
    assert!(
        quiet_flooded.len() >= 10,
        "the quiet tenant kept being served"
    );
}

/// A flood of priority -1 requests does not raise the p99 wait of priority
/// 10 requests by more than one service time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn background_floods_never_delay_interactive_work_by_more_than_one_service() {
    let config = ConfigFile::new(
        "flowControl:\n  maxRequests: 500\n  defaultRequestTTL: 60s\nobjectives:\n  \
         interactive: 10\n  batch: -1\n",
    );
    let (b, sim, _agent) = fleet(
        &["--config", config.arg()],
        &["--slots", "2", "--ttft-ms", "200", "--output-tokens", "1"],
    )
    .await;
    let interactive = vec![("x-gateway-inference-objective", "interactive".to_string())];

    // Alone: one interactive client; measure its wait and its service time.
    let start = Instant::now();
    let alone = client_loop(&b, interactive.clone(), start + Duration::from_secs(2))
        .await
        .unwrap();
    let service = start.elapsed() / alone.len() as u32;

    // A flood of 40 batch clients keeps both slots busy and 38 queued. Its
    // second slot starts half a service later: slots that finish in
    // lockstep (all started by one burst) put the worst case at exactly one
    // service time, with nothing left for measurement noise; real slots
    // drift apart.
    let batch = vec![("x-gateway-inference-objective", "batch".to_string())];
    let until = Instant::now() + Duration::from_secs(60);
    let mut flood = vec![client_loop(&b, batch.clone(), until)];
    b.wait_in_flight(1, Duration::from_secs(5)).await;
    tokio::time::sleep(service / 2).await;
    flood.extend((0..39).map(|_| client_loop(&b, batch.clone(), until)));
    b.wait_buffered(38).await;
    let flooded = client_loop(&b, interactive, Instant::now() + Duration::from_secs(4))
        .await
        .unwrap();
    let batch_waiting = b.buffered().await;
    for h in &flood {
        h.abort();
    }
    b.wait_buffered(0).await;
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    sim.wait_idle(Duration::from_secs(5)).await;

    let service_ms = service.as_millis() as u64;
    let (p99_alone, p99_flooded) = (
        percentile(alone.clone(), 0.99),
        percentile(flooded.clone(), 0.99),
    );
    eprintln!(
        "interactive p99 wait {p99_alone} ms alone ({} requests), {p99_flooded} ms under a \
         batch flood ({} requests); service time {service_ms} ms; {batch_waiting} batch queued",
        alone.len(),
        flooded.len()
    );
    assert!(batch_waiting >= 30, "the flood was queued: {batch_waiting}");
    assert!(
        p99_flooded <= p99_alone + service_ms,
        "interactive p99 wait {p99_flooded} ms > {p99_alone} ms + one service ({service_ms} ms)"
    );
    assert!(flooded.len() >= 8, "interactive work kept flowing");
}

fn objective(name: &'static str) -> (&'static str, &'static str) {
    ("x-gateway-inference-objective", name)
}

/// 429 when a band is over its own limit or its request is evicted by
/// higher-priority work, 503 when the whole buffer is full, 504 after the
/// request's own TTL, 400 for malformed flow-control headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_refusal_is_reached_by_its_own_rule() {
    let config = ConfigFile::new(
        "flowControl:\n  maxRequests: 4\n  priorityBands:\n  - priority: -1\n    \
         maxRequests: 2\nobjectives:\n  interactive: 10\n  normal: 0\n  batch: -1\n",
    );
    let (b, _sim, _agent) = fleet(&["--config", config.arg()], &["--slots", "1"]).await;
    let hold = ("x-sim-ttft-ms", "60000");
    let running = spawn_chat(&b, &[hold]);
    b.wait_in_flight(1, Duration::from_secs(5)).await;

    // 504 after the request's own TTL, measured as a ratio of it.
    let start = Instant::now();
    let resp = chat(&b, &[("x-flowgate-request-ttl", "300ms")]).await;
    let ratio = start.elapsed().as_secs_f64() / 0.3;
    assert_eq!(resp.headers()["x-flowgate-drop-reason"], "ttl-expired");
    assert_openai_error(resp, 504).await;
    assert!((1.0..3.0).contains(&ratio), "504 after {ratio:.2}x the TTL");

    // 400 for a malformed fairness id or TTL.
    for (h, v) in [
        ("x-gateway-inference-fairness-id", "has spaces"),
        ("x-flowgate-request-ttl", "soon"),
    ] {
        let err = assert_openai_error(chat(&b, &[(h, v)]).await, 400).await;
        assert!(
            err["error"]["message"].as_str().unwrap().contains(h),
            "{err}"
        );
    }

    // 429: band -1 holds at most 2.
    let b1 = spawn_chat(&b, &[objective("batch")]);
    b.wait_buffered(1).await;
    let b2 = spawn_chat(&b, &[objective("batch")]);
    b.wait_buffered(2).await;
    let resp = chat(&b, &[objective("batch")]).await;
    assert_eq!(resp.headers()["x-flowgate-drop-reason"], "shed");
    assert!(resp.headers().contains_key("retry-after"));
    let err = assert_openai_error(resp, 429).await;
    assert_eq!(err["error"]["type"], "rate_limit_error");

    // The buffer (4) fills with normal work; then interactive requests
    // evict batch ones, newest first, each answered 429.
    let mut waiting = vec![running];
    waiting.push(spawn_chat(&b, &[objective("normal")]));
    waiting.push(spawn_chat(&b, &[objective("normal")]));
    b.wait_buffered(4).await;
    waiting.push(spawn_chat(&b, &[objective("interactive")]));
    assert_eq!(
        b2.await.unwrap(),
        429,
        "the newest batch request is evicted"
    );
    waiting.push(spawn_chat(&b, &[objective("interactive")]));
    assert_eq!(b1.await.unwrap(), 429);
    b.wait_buffered(4).await;

    // 503: full, and nothing of lower priority left to evict.
    let resp = chat(&b, &[objective("normal")]).await;
    assert_eq!(resp.headers()["x-flowgate-drop-reason"], "buffer-full");
    assert!(resp.headers().contains_key("retry-after"));
    assert_openai_error(resp, 503).await;

    let agents: Value = b.agents().await;
    assert_eq!(agents["buffered_requests"], 4);
    let flows = agents["flows"].as_array().unwrap();
    assert_eq!(
        flows[0]["priority"], 10,
        "flows listed highest priority first"
    );
    assert_eq!(flows[0]["requests"], 2);

    let gauge = metric(
        &b,
        "inference_extension_flow_control_queue_size",
        &[("fairness_id", "default"), ("priority", "10")],
    )
    .await;
    assert_eq!(gauge, 2.0);
    let rejections = "flowgate_flow_control_rejections_total";
    for (reason, n) in [("shed", 3.0), ("buffer-full", 1.0), ("ttl-expired", 1.0)] {
        let got = metric(&b, rejections, &[("reason", reason)]).await;
        assert_eq!(got, n, "{reason} (shed: 1 band limit + 2 evictions)");
    }
    for h in waiting {
        h.abort();
    }
}
