//! The async queue in Redis (`--queue-url`), against a real redis-server
//! (Debian's `redis-server` package, installed by `scripts/test`, started
//! here on a port of the test's own): balancers share one queue, a request
//! accepted by one is answered through another, and a request leased by a
//! balancer that is SIGKILLed mid-dispatch is delivered again by another
//! once its lease runs out.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

async fn accepted(b: &Balancer, content: &str, headers: &[(&str, &str)]) -> String {
    let mut req = client()
        .post(b.url("/v1/async/chat/completions"))
        .json(&chat_for(Some("sim-model"), content));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 202);
    resp.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn view(b: &Balancer, id: &str) -> Value {
    get_json(&b.url(&format!("/v1/async/requests/{id}"))).await
}

#[tokio::test]
async fn balancers_share_one_queue_in_redis() {
    let redis = Redis::start().await;
    // A has no model server: what it accepts, B's fleet answers.
    let a = Balancer::start(&["--queue-url", &redis.url]).await;
    let mut ids = Vec::new();
    for i in 0..12 {
        ids.push(accepted(&a, &format!("shared {i}"), &[]).await);
    }
    let keyed = accepted(&a, "keyed", &[("idempotency-key", "k-1")]).await;
    ids.push(keyed.clone());
    a.proc.signal("KILL");
    drop(a);

    let (b, _sim, _agent) = fleet(&["--queue-url", &redis.url], &[]).await;
    assert_eq!(
        accepted(&b, "keyed", &[("idempotency-key", "k-1")]).await,
        keyed,
        "the key is shared too"
    );
    wait_for(
        "the shared backlog to drain",
        Duration::from_secs(30),
        || async {
            for id in &ids {
                if view(&b, id).await["status"] != "succeeded" {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    for id in &ids {
        let v = view(&b, id).await;
        assert_eq!(v["attempts"], 1, "{v}");
        assert_eq!(v["response"]["object"], "chat.completion");
    }
    // The results feed lists each once.
    let page = get_json(&b.url("/v1/async/results?limit=100")).await;
    let mut fed: Vec<String> = page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_str().unwrap().to_string())
        .collect();
    fed.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(fed, want);
    assert_eq!(
        metric(&b, "flowgate_requests_total", &[("code", "200")]).await,
        13.0
    );
}

#[tokio::test]
async fn a_lease_lost_with_its_balancer_is_delivered_again_by_another() {
    let redis = Redis::start().await;
    // C leases the request, its server takes 20 s to answer, and C dies.
    let (c, _slow_sim, _slow_agent) = fleet(
        &["--queue-url", &redis.url, "--async-max-idle", "1s"],
        &["--ttft-ms", "20000"],
    )
    .await;
    let id = accepted(&c, "survivor", &[]).await;
    wait_for("C to dispatch it", Duration::from_secs(10), || async {
        (view(&c, &id).await["status"] == "dispatched").then_some(())
    })
    .await;
    c.proc.signal("KILL");
    drop(c);

    // B takes it over once the 1 s lease has run out.
    let (b, _sim, _agent) =
        fleet(&["--queue-url", &redis.url, "--async-max-idle", "1s"], &[]).await;
    let v = wait_for("B to deliver it again", Duration::from_secs(20), || async {
        let v = view(&b, &id).await;
        (v["status"] == "succeeded").then_some(v)
    })
    .await;
    assert_eq!(v["attempts"], 2, "{v}");
    assert_eq!(
        metric(
            &b,
            "flowgate_async_deliveries_total",
            &[("kind", "redelivery")]
        )
        .await,
        1.0
    );
}

/// Queued async requests go out highest priority first, first come first
/// within a priority, in both stores.
#[tokio::test]
async fn async_requests_go_out_by_priority_in_both_stores() {
    let redis = Redis::start().await;
    let dir = TempDir::new("async-prio");
    let config =
        ConfigFile::new("flowControl:\n  allowClientPriority: true\nobjectives:\n  nightly: 5\n");
    for store in [
        ["--async-dir", dir.arg()],
        ["--queue-url", redis.url.as_str()],
    ] {
        // No server yet: everything waits, then one slot serves them in
        // lease order.
        let b = Balancer::start(&["--config", config.arg(), store[0], store[1]]).await;
        let submissions: [(&str, &[(&str, &str)]); 5] = [
            ("low", &[("x-flowgate-priority", "-3")]),
            ("plain-1", &[]),
            ("objective", &[("x-gateway-inference-objective", "nightly")]),
            ("plain-2", &[]),
            ("high", &[("x-flowgate-priority", "9")]),
        ];
        let mut names = std::collections::HashMap::new();
        for (name, headers) in submissions {
            names.insert(accepted(&b, name, headers).await, name);
        }
        let sim = Sim::start(&["--slots", "1", "--output-tokens", "1"]);
        let _agent = agent(&sim, &b);
        let mut order = Vec::new();
        let mut cursor: Option<String> = None;
        let deadline = Instant::now() + Duration::from_secs(20);
        while order.len() < 5 {
            assert!(Instant::now() < deadline, "answered so far: {order:?}");
            let url = match &cursor {
                Some(c) => b.url(&format!("/v1/async/results?after={c}&wait=2s")),
                None => b.url("/v1/async/results?wait=2s"),
            };
            let page = get_json(&url).await;
            for v in page["data"].as_array().unwrap() {
                order.push(names[v["id"].as_str().unwrap()]);
            }
            cursor = page["next_cursor"].as_str().map(str::to_string);
        }
        assert_eq!(
            order,
            ["high", "objective", "plain-1", "plain-2", "low"],
            "{}",
            store[0]
        );
    }
}

#[tokio::test]
async fn a_full_redis_queue_evicts_its_oldest_lowest_priority_request() {
    let redis = Redis::start().await;
    let b = Balancer::start(&[
        "--queue-url",
        &redis.url,
        "--async-max-length",
        "2",
        "--async-auto-evict",
    ])
    .await;
    let first = accepted(&b, "a", &[]).await;
    let second = accepted(&b, "b", &[]).await;
    let third = accepted(&b, "c", &[]).await;
    assert_eq!(view(&b, &first).await["status"], "evicted");
    assert_eq!(view(&b, &second).await["status"], "queued");
    assert_eq!(view(&b, &third).await["status"], "queued");
}
