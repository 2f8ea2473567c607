//! The async path's promise to interactive users, on its own (a test binary
//! runs alone, so no other test's load blurs the timing): with a fleet of
//! four simulated slots and two closed-loop interactive clients, the
//! interactive p99 latency while a 1,000-request async batch drains stays
//! within 1.2x of its value without it, and the batch then drains fully on
//! the idle fleet.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// Latency of `n` chat requests per client from `clients` closed-loop
/// clients, sorted.
async fn interactive_latencies(b: &Balancer, clients: usize, n: usize) -> Vec<Duration> {
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let c = client();
            let url = b.url("/v1/chat/completions");
            tokio::spawn(async move {
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    let started = Instant::now();
                    let resp = c
                        .post(&url)
                        .json(&chat_for(Some("sim-model"), "interactive"))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(resp.status(), 200);
                    resp.bytes().await.unwrap();
                    out.push(started.elapsed());
                }
                out
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort();
    all
}

fn p99(sorted: &[Duration]) -> Duration {
    sorted[(sorted.len() * 99).div_ceil(100) - 1]
}

/// Two closed-loop interactive clients on four simulated slots: their p99
/// alone, then beside a 1,000-request batch that the balancer started with
/// `gate_args` drains; asserts the ratio and that the batch then completes.
async fn backlog_scenario(gate: &str, gate_args: &[&str]) {
    let _alone = SERIAL.lock().await;
    let dir = TempDir::new(&format!("async-p99-{gate}"));
    let mut args = vec!["--async-dir", dir.arg()];
    args.extend_from_slice(gate_args);
    let (b, _sim, _agent) = fleet(
        &args,
        &[
            "--ttft-ms",
            "40",
            "--tpot-ms",
            "5",
            "--output-tokens",
            "2",
            "--threads",
            "2",
        ],
    )
    .await;
    backlog_ratio_and_drain(&b, gate).await;
}

async fn backlog_ratio_and_drain(b: &Balancer, gate: &str) {
    let base = interactive_latencies(b, 2, 100).await;

    // 1,000 requests in one batch (one transaction).
    let lines: String = (0..1000)
        .map(|i| {
            format!(
                "{}\n",
                json!({"custom_id": format!("r{i}"), "method": "POST", "url": "/v1/chat/completions",
                       "body": chat_for(Some("sim-model"), "async")})
            )
        })
        .collect();
    let file = upload_batch_file(b, None, &lines).await;
    let batch: Value = client()
        .post(b.url("/v1/batches"))
        .json(
            &json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                      "completion_window": "24h"}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(batch["status"], "in_progress", "{batch}");
    wait_for("async work under way", Duration::from_secs(10), || async {
        (metric(b, "flowgate_async_deliveries_total", &[]).await > 0.0).then_some(())
    })
    .await;

    let with_backlog = interactive_latencies(b, 2, 100).await;
    let done = metric(b, "flowgate_async_outcomes_total", &[]).await;
    assert!(
        done < 1000.0,
        "the backlog was still draining ({done} done)"
    );
    let ratio = p99(&with_backlog).as_secs_f64() / p99(&base).as_secs_f64();
    eprintln!(
        "{gate} gate: interactive p99 {:?} alone, {:?} beside the backlog: x{ratio:.2}",
        p99(&base),
        p99(&with_backlog)
    );
    assert!(
        ratio <= 1.2,
        "{gate} gate: p99 x{ratio:.2} with the async backlog"
    );

    // With the fleet idle the backlog drains fully.
    let id = batch["id"].as_str().unwrap().to_string();
    let batch = wait_for(
        "the batch to complete",
        Duration::from_secs(120),
        || async {
            let v = get_json(&b.url(&format!("/v1/batches/{id}"))).await;
            (v["status"] == "completed").then_some(v)
        },
    )
    .await;
    assert_eq!(batch["request_counts"]["completed"], 1000, "{batch}");
}

/// The two scenarios share the machine's two cores: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn interactive_p99_holds_while_a_1000_request_backlog_drains() {
    // The default gate: balancer, B = 0.
    backlog_scenario("balancer", &[]).await;
}

#[tokio::test]
async fn the_same_holds_with_the_budget_read_from_prometheus() {
    // D by PromQL: the lowest spare share the balancer exported over 3 s.
    let _alone = SERIAL.lock().await;
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let dir = TempDir::new("async-p99-prometheus");
    let (b, _sim, _agent) = fleet(
        &[
            "--async-dir",
            dir.arg(),
            "--async-gate",
            "prometheus",
            "--async-prometheus-url",
            &url,
            "--async-promql",
            "min_over_time(flowgate_async_interactive_spare_ratio[3s])",
            "--async-gate-interval",
            "500ms",
        ],
        &[
            "--ttft-ms",
            "40",
            "--tpot-ms",
            "5",
            "--output-tokens",
            "2",
            "--threads",
            "2",
        ],
    )
    .await;
    let _prometheus = Prometheus::start(port, &b.management.to_string());
    wait_for("Prometheus to have 3 s of samples", Duration::from_secs(30), || async {
        let q = format!("{url}/api/v1/query?query=count_over_time(flowgate_async_interactive_spare_ratio%5B3s%5D)");
        let v: Value = client().get(&q).send().await.ok()?.json().await.ok()?;
        let n: f64 = v["data"]["result"][0]["value"][1].as_str()?.parse().ok()?;
        (n >= 5.0).then_some(())
    })
    .await;
    backlog_ratio_and_drain(&b, "prometheus").await;
}
