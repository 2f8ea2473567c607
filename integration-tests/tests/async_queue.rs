//! The async path with its embedded store: requests accepted with 202 survive
//! a SIGKILL of the balancer and are answered after the restart; an
//! idempotency key gives the same request; long-polling returns when the
//! answer is in; cancel, unknown ids, a full queue; a request whose delivery
//! keeps failing is delivered `max_delivery` times and dead-lettered.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

async fn submit(b: &Balancer, content: &str, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut req = client()
        .post(b.url("/v1/async/chat/completions"))
        .json(&chat_for(Some("sim-model"), content));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.expect("the balancer answers")
}

async fn accepted(b: &Balancer, content: &str, headers: &[(&str, &str)]) -> String {
    let resp = submit(b, content, headers).await;
    assert_eq!(resp.status(), 202);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["status"], "queued", "{v}");
    assert_eq!(v["object"], "async.request");
    v["id"].as_str().unwrap().to_string()
}

async fn status(b: &Balancer, id: &str, wait: &str) -> Value {
    get_json(&b.url(&format!("/v1/async/requests/{id}?wait={wait}"))).await
}

/// Waits until every id reached a final state; returns their views.
async fn wait_final(b: &Balancer, ids: &[String], within: Duration) -> Vec<Value> {
    wait_for("async requests to finish", within, || async {
        let mut views = Vec::new();
        for id in ids {
            let v = status(b, id, "0").await;
            if v["status"] == "queued" || v["status"] == "dispatched" {
                return None;
            }
            views.push(v);
        }
        Some(views)
    })
    .await
}

#[tokio::test]
async fn accepted_requests_survive_sigkill_and_are_answered_after_restart() {
    let dir = TempDir::new("async-kill");
    // No model server yet: the gate stays closed, everything stays queued.
    let b = Balancer::start(&["--async-dir", dir.arg()]).await;
    let mut ids = Vec::new();
    for i in 0..40 {
        ids.push(
            accepted(
                &b,
                &format!("job {i}"),
                &[("x-gateway-inference-fairness-id", "batch")],
            )
            .await,
        );
    }
    let keyed = accepted(&b, "keyed", &[("idempotency-key", "job-41")]).await;
    ids.push(keyed.clone());
    wait_for("41 queued in the gauge", Duration::from_secs(5), || async {
        (metric(&b, "flowgate_async_requests", &[("state", "queued")]).await == 41.0).then_some(())
    })
    .await;
    b.proc.signal("KILL");
    drop(b);

    let (b, _sim, _agent) = fleet(&["--async-dir", dir.arg()], &[]).await;
    // The same key after the restart: the same request, nothing new.
    assert_eq!(
        accepted(&b, "keyed", &[("idempotency-key", "job-41")]).await,
        keyed
    );
    let views = wait_final(&b, &ids, Duration::from_secs(30)).await;
    for v in &views {
        assert_eq!(v["status"], "succeeded", "{v}");
        assert_eq!(v["response_status"], 200);
        assert_eq!(v["response"]["object"], "chat.completion", "{v}");
        assert_eq!(v["attempts"], 1);
    }
    assert_eq!(views[0]["fairness_id"], "batch");
    assert_eq!(
        metric(
            &b,
            "flowgate_async_outcomes_total",
            &[("status", "succeeded")]
        )
        .await,
        41.0
    );
    assert_eq!(
        metric(&b, "flowgate_requests_total", &[("code", "200")]).await,
        41.0,
        "each delivered once"
    );
}

#[tokio::test]
async fn long_poll_cancel_and_refusals() {
    let dir = TempDir::new("async-api");
    let (b, _sim, _agent) = fleet(
        &["--async-dir", dir.arg(), "--async-max-length", "3"],
        &["--ttft-ms", "600", "--output-tokens", "1"],
    )
    .await;

    // Long-poll: answered once the request is done (~600 ms), not at the
    // end of the 20 s wait.
    let id = accepted(&b, "poll", &[]).await;
    let started = Instant::now();
    let v = status(&b, &id, "20s").await;
    let took = started.elapsed();
    assert_eq!(v["status"], "succeeded", "{v}");
    assert!(
        took < Duration::from_secs(5),
        "long-poll returned after {took:?}"
    );

    // Unknown id, bad wait, bad JSON, an async path of no OpenAI route.
    let r = client()
        .get(b.url("/v1/async/requests/areq_nope"))
        .send()
        .await
        .unwrap();
    assert_openai_error(r, 404).await;
    let r = client()
        .get(b.url(&format!("/v1/async/requests/{id}?wait=soon")))
        .send()
        .await
        .unwrap();
    assert_openai_error(r, 400).await;
    let r = client()
        .post(b.url("/v1/async/chat/completions"))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_openai_error(r, 400).await;
    let r = client()
        .post(b.url("/v1/async/nothing"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_openai_error(r, 404).await;

    // Cancel: a cancelled request is never answered; cancelling a finished
    // one changes nothing.
    let r = client()
        .delete(b.url(&format!("/v1/async/requests/{id}")))
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["status"], "succeeded");
}

#[tokio::test]
async fn a_full_queue_refuses_and_cancelled_requests_are_not_sent() {
    let dir = TempDir::new("async-full");
    // No server: everything stays queued.
    let b = Balancer::start(&["--async-dir", dir.arg(), "--async-max-length", "2"]).await;
    let first = accepted(&b, "a", &[]).await;
    accepted(&b, "b", &[]).await;
    let body = assert_openai_error(submit(&b, "c", &[]).await, 429).await;
    assert_eq!(body["error"]["code"], "async_queue_full");
    let r = client()
        .delete(b.url(&format!("/v1/async/requests/{first}")))
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["status"], "cancelled");
    // Room again.
    accepted(&b, "c", &[]).await;
}

#[tokio::test]
async fn failing_deliveries_are_retried_then_dead_lettered() {
    let dir = TempDir::new("async-dead");
    let (b, _sim, _agent) = fleet(
        &["--async-dir", dir.arg(), "--async-max-delivery", "2"],
        &["--fault", "status=500"],
    )
    .await;
    let id = accepted(&b, "doomed", &[]).await;
    let views = wait_final(&b, std::slice::from_ref(&id), Duration::from_secs(20)).await;
    let v = &views[0];
    assert_eq!(v["status"], "dead_lettered", "{v}");
    assert_eq!(v["attempts"], 2);
    assert!(v["last_error"].as_str().unwrap().contains("500"), "{v}");
    assert_eq!(
        metric(
            &b,
            "flowgate_async_deliveries_total",
            &[("kind", "redelivery")]
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(
            &b,
            "flowgate_async_outcomes_total",
            &[("status", "dead_lettered")]
        )
        .await,
        1.0
    );
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[tokio::test]
async fn interactive_requests_go_before_the_async_backlog() {
    let dir = TempDir::new("async-priority");
    // One slot, 300 ms per request.
    let (b, _sim, _agent) = fleet(
        &["--async-dir", dir.arg()],
        &["--slots", "1", "--ttft-ms", "300", "--output-tokens", "1"],
    )
    .await;
    let mut ids = Vec::new();
    for i in 0..6 {
        ids.push(accepted(&b, &format!("async {i}"), &[]).await);
    }
    b.wait_in_flight(1, Duration::from_secs(5)).await;
    let started = Instant::now();
    let interactive: Vec<_> = (0..3).map(|_| spawn_chat(&b, &[])).collect();
    let mut last_interactive_ms = 0;
    for h in interactive {
        assert_eq!(h.await.unwrap(), 200);
        last_interactive_ms = last_interactive_ms.max(unix_ms());
    }
    let interactive_took = started.elapsed();
    // At most the async request already on the server goes first: 4
    // services of 300 ms, not 9.
    assert!(
        interactive_took < Duration::from_millis(300 * 6),
        "interactive requests took {interactive_took:?}"
    );
    let views = wait_final(&b, &ids, Duration::from_secs(20)).await;
    let before = views
        .iter()
        .filter(|v| v["updated_at_ms"].as_u64().unwrap() < last_interactive_ms)
        .count();
    assert!(
        before <= 1,
        "{before} async requests finished before the interactive ones"
    );
    assert!(views.iter().all(|v| v["status"] == "succeeded"));
}

#[tokio::test]
async fn a_worker_consumes_results_from_the_feed_and_events_stream_each_change() {
    let dir = TempDir::new("async-feed");
    let (b, _sim, _agent) = fleet(
        &["--async-dir", dir.arg()],
        &["--ttft-ms", "300", "--output-tokens", "1"],
    )
    .await;

    // One request's status changes as server-sent events, until final.
    let id = accepted(&b, "watched", &[]).await;
    let stream = client()
        .get(b.url(&format!("/v1/async/requests/{id}/events")))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    assert_eq!(stream.headers()["content-type"], "text/event-stream");
    let text = stream.text().await.unwrap();
    let statuses: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["status"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        statuses.last().map(String::as_str),
        Some("succeeded"),
        "{text}"
    );
    assert!(statuses.contains(&"dispatched".to_string()), "{statuses:?}");
    assert!(
        statuses.windows(2).all(|w| w[0] != w[1]),
        "one event per change: {statuses:?}"
    );

    // A worker follows the results feed with its cursor: every request once.
    let mut ids = Vec::new();
    for i in 0..6 {
        ids.push(accepted(&b, &format!("feed {i}"), &[]).await);
    }
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen.len() < 7 {
        assert!(Instant::now() < deadline, "feed gave {seen:?}");
        let url = match &cursor {
            Some(c) => b.url(&format!("/v1/async/results?after={c}&wait=5s&limit=4")),
            None => b.url("/v1/async/results?wait=5s&limit=4"),
        };
        let page = get_json(&url).await;
        for v in page["data"].as_array().unwrap() {
            assert_eq!(v["status"], "succeeded");
            seen.push(v["id"].as_str().unwrap().to_string());
        }
        cursor = page["next_cursor"].as_str().map(str::to_string);
    }
    let mut want = ids.clone();
    want.push(id);
    want.sort();
    seen.sort();
    assert_eq!(seen, want, "each finished request exactly once");
    // Nothing new: an empty page after the wait, the cursor unchanged.
    let started = Instant::now();
    let c = cursor.clone().unwrap();
    let page = get_json(&b.url(&format!("/v1/async/results?after={c}&wait=300ms"))).await;
    assert!(page["data"].as_array().unwrap().is_empty());
    assert_eq!(page["next_cursor"].as_str(), Some(c.as_str()));
    assert!(started.elapsed() >= Duration::from_millis(300));
}

#[tokio::test]
async fn a_budget_in_bytes_bounds_the_async_bytes_in_flight() {
    let dir = TempDir::new("async-bytes");
    // Every request's body is the same size; N = 2.5 bodies: while less
    // than N is out another may go, so at most 3 are in flight (4 slots).
    let body_len = chat_for(Some("sim-model"), "sized job 0").to_string().len();
    let max_sys = (body_len * 5 / 2).to_string();
    let (b, sim, _agent) = fleet(
        &[
            "--async-dir",
            dir.arg(),
            "--async-gate",
            "always-open",
            "--async-capacity-unit",
            "bytes",
            "--async-max-sys",
            &max_sys,
        ],
        &["--ttft-ms", "400", "--output-tokens", "1"],
    )
    .await;
    let mut ids = Vec::new();
    for i in 0..8 {
        ids.push(accepted(&b, &format!("sized job {i}"), &[]).await);
    }
    let mut most = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        most = most.max(sim.stats().await["processing"].as_u64().unwrap());
        let mut done = 0;
        for id in &ids {
            if status(&b, id, "0").await["status"] == "succeeded" {
                done += 1;
            }
        }
        if done == ids.len() {
            break;
        }
        assert!(Instant::now() < deadline, "{done} of 8 done");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(most, 3, "async requests on the server at once");
}

#[tokio::test]
async fn a_full_result_store_holds_dispatching_until_results_age_out() {
    let dir = TempDir::new("async-results");
    let (b, _sim, _agent) = fleet(
        &[
            "--async-dir",
            dir.arg(),
            "--async-max-results",
            "2",
            "--async-retention",
            "4s",
        ],
        &["--output-tokens", "1"],
    )
    .await;
    let first = [accepted(&b, "a", &[]).await, accepted(&b, "b", &[]).await];
    wait_final(&b, &first, Duration::from_secs(10)).await;
    wait_for(
        "the result store to count 2",
        Duration::from_secs(5),
        || async { (metric(&b, "flowgate_async_results_stored", &[]).await == 2.0).then_some(()) },
    )
    .await;
    let held = [accepted(&b, "c", &[]).await, accepted(&b, "d", &[]).await];
    // The store is full: once the dispatcher has gone round three times
    // with both held requests queued, it has taken neither.
    let rounds = || async { metric(&b, "flowgate_async_dispatcher_rounds_total", &[]).await };
    let rounds_before = rounds().await;
    wait_for(
        "three dispatcher rounds with the store full",
        Duration::from_secs(30),
        || async { (rounds().await >= rounds_before + 3.0).then_some(()) },
    )
    .await;
    for id in &held {
        assert_eq!(status(&b, id, "0").await["status"], "queued");
    }
    // The first two age out after 4 s; then the others are served.
    let views = wait_final(&b, &held, Duration::from_secs(15)).await;
    assert!(views.iter().all(|v| v["status"] == "succeeded"));
    let gone = client()
        .get(b.url(&format!("/v1/async/requests/{}", first[0])))
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 404, "purged after retention");
}

/// A session key sent with async submits (a header, or the body's
/// `prompt_cache_key`) keeps their deliveries on one server, as it does
/// for interactive requests; the key is not stored in clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_requests_of_one_session_are_delivered_to_one_server() {
    let dir = TempDir::new("async-sessions");
    let b = Balancer::start(&["--async-dir", dir.arg()]).await;
    // Room for all six at once on any server: the session, not a hold for
    // a saturated server (short prompts are not worth waiting for), is
    // what keeps them together.
    let sims: Vec<Sim> = (0..3).map(|_| Sim::start(&["--slots", "8"])).collect();
    let _agents: Vec<Proc> = sims.iter().map(|s| agent(s, &b)).collect();
    b.wait_eligible(3).await;
    let mut ids = Vec::new();
    for i in 0..6 {
        let prompt = format!("unrelated task {i} ").repeat(30);
        ids.push(accepted(&b, &prompt, &[("x-session-id", "async-conv-1")]).await);
    }
    for view in wait_final(&b, &ids, Duration::from_secs(20)).await {
        assert_eq!(view["status"], "succeeded", "{view}");
    }
    let mut counts = Vec::new();
    for s in &sims {
        counts.push(s.stats().await["requests_total"].as_u64().unwrap());
    }
    assert!(counts.contains(&6), "spread over the servers: {counts:?}");
    // The store holds the session hashed, never the key.
    let mut stored = Vec::new();
    for entry in std::fs::read_dir(dir.path("")).unwrap().flatten() {
        if entry.path().is_file() {
            stored.extend(std::fs::read(entry.path()).unwrap());
        }
    }
    let text = String::from_utf8_lossy(&stored);
    assert!(!text.contains("async-conv-1"), "the key is stored in clear");
}
