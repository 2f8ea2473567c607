//! The async dispatch budget read by PromQL from a real Prometheus server
//! (Debian's `prometheus` package, installed by `scripts/test`) scraping the
//! balancer: while Prometheus cannot be read, D = 0 and nothing is
//! dispatched; once it scrapes, D is the query's value and the backlog
//! drains.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

const QUERY: &str = "sum(flowgate_endpoint_slots{state=\"idle\"}) / sum(flowgate_endpoint_slots)";

#[tokio::test]
async fn the_prometheus_gate_reads_d_by_promql_and_closes_when_it_cannot() {
    let dir = TempDir::new("async-prom");
    let prom_port = free_port();
    let prom_url = format!("http://127.0.0.1:{prom_port}");
    let (b, _sim, _agent) = fleet(
        &[
            "--async-dir",
            dir.arg(),
            "--async-gate",
            "prometheus",
            "--async-prometheus-url",
            &prom_url,
            "--async-promql",
            QUERY,
            "--async-gate-interval",
            "300ms",
        ],
        &["--output-tokens", "2"],
    )
    .await;
    let mut ids = Vec::new();
    for i in 0..10 {
        let resp = client()
            .post(b.url("/v1/async/chat/completions"))
            .json(&chat_for(Some("sim-model"), &format!("job {i}")))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 202);
        ids.push(
            resp.json::<Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    // No Prometheus yet: D = 0. Once the gate has failed to read it a few
    // more times and the dispatcher has gone round after those readings,
    // nothing may have left the queue.
    let failed = || async {
        metric(
            &b,
            "flowgate_async_gate_readings_total",
            &[("result", "error")],
        )
        .await
    };
    let rounds = || async { metric(&b, "flowgate_async_dispatcher_rounds_total", &[]).await };
    let (failed_before, rounds_before) = (failed().await, rounds().await);
    wait_for(
        "three more failed readings of Prometheus",
        Duration::from_secs(30),
        || async { (failed().await >= failed_before + 3.0).then_some(()) },
    )
    .await;
    let rounds_after_readings = rounds().await.max(rounds_before);
    wait_for(
        "two dispatcher rounds after those readings",
        Duration::from_secs(30),
        || async { (rounds().await >= rounds_after_readings + 2.0).then_some(()) },
    )
    .await;
    assert_eq!(
        metric(&b, "flowgate_async_budget_spare_ratio", &[]).await,
        0.0
    );
    assert_eq!(
        metric(&b, "flowgate_async_deliveries_total", &[]).await,
        0.0
    );
    assert_eq!(
        metric(
            &b,
            "flowgate_async_gate_readings_total",
            &[("result", "ok")]
        )
        .await,
        0.0
    );

    let _prom = Prometheus::start(prom_port, &b.management.to_string());
    // Prometheus scrapes the balancer; D becomes the query's value (all 4
    // slots idle: 1) and the backlog drains.
    wait_for(
        "D read from Prometheus",
        Duration::from_secs(30),
        || async {
            (metric(&b, "flowgate_async_budget_spare_ratio", &[]).await > 0.0).then_some(())
        },
    )
    .await;
    let answer = get_json(&format!(
        "{prom_url}/api/v1/query?query={}",
        QUERY
            .replace('{', "%7B")
            .replace('}', "%7D")
            .replace('"', "%22")
            .replace('=', "%3D")
    ))
    .await;
    assert_eq!(answer["status"], "success", "{answer}");
    wait_for("the backlog to drain", Duration::from_secs(30), || async {
        for id in &ids {
            let v = get_json(&b.url(&format!("/v1/async/requests/{id}"))).await;
            if v["status"] != "succeeded" {
                return None;
            }
        }
        Some(())
    })
    .await;
    assert_eq!(
        metric(
            &b,
            "flowgate_async_outcomes_total",
            &[("status", "succeeded")]
        )
        .await,
        10.0
    );
}
