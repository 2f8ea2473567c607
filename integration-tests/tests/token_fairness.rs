//! Token fairness against a tenant that repeats one long prompt, on engines
//! without a prefix cache (their answers say they reused nothing): the
//! heavy tenant's requests spread over both servers, since there is no
//! cache to follow, and the light tenant's tail latency is at least twice
//! as short under token fairness as under request round-robin.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

/// How long each policy's load runs.
const RUN: Duration = Duration::from_secs(8);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_light_tenant_is_served_first_and_the_heavy_one_uses_every_server() {
    let (rr_p99, rr_spread) = run("round-robin").await;
    let (tf_p99, tf_spread) = run("token-fair").await;
    eprintln!(
        "L p99: round-robin {rr_p99:?}, token-fair {tf_p99:?}; \
         H per server: round-robin {rr_spread:?}, token-fair {tf_spread:?}"
    );
    for spread in [&rr_spread, &tf_spread] {
        assert!(
            spread.iter().all(|&n| n > 0),
            "the heavy tenant's identical prompts piled on one server: {spread:?}"
        );
    }
    assert!(
        tf_p99 * 2 <= rr_p99,
        "the light tenant's p99: {tf_p99:?} under token fairness, {rr_p99:?} under round-robin"
    );
}

/// Runs the workload for [`RUN`] under the fairness `policy`:
/// returns the light tenant's p99 latency and how many of the heavy
/// tenant's requests each server got.
async fn run(policy: &str) -> (Duration, Vec<usize>) {
    let config = ConfigFile::new(&format!(
        "flowControl:\n  defaultBand:\n    fairnessPolicyRef: {policy}\n"
    ));
    let b = Balancer::start(&["--config", config.arg()]).await;
    // Two 2-slot engines without a prefix cache whose cost is linear in
    // tokens: H's request (~2,050 prompt tokens, 512 out) takes ~1.2 s,
    // L's (~50 in, 32 out) ~70 ms.
    let sims: Vec<Sim> = (0..2)
        .map(|_| {
            Sim::start(&[
                "--slots",
                "2",
                "--ttft-ms",
                "0",
                "--tpot-ms",
                "2",
                "--prefill-us-per-token",
                "100",
                "--honor-max-tokens",
                "--say-cached-tokens",
            ])
        })
        .collect();
    let _agents: Vec<Proc> = sims.iter().map(|s| agent(s, &b)).collect();
    b.wait_eligible(2).await;

    let heavy = "lorem ipsum dolor sit amet ".repeat(8192 / 27 + 1)[..8192].to_string();
    let light = "lorem ipsum dolor sit amet ".repeat(8)[..200].to_string();
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let end = Instant::now() + RUN;
    let clients: Vec<_> = (0..30)
        .map(|i| {
            let (tenant, prompt, max_tokens) = if i < 6 {
                ("H", heavy.clone(), 512)
            } else {
                ("L", light.clone(), 32)
            };
            let url = b.url("/v1/chat/completions");
            let latencies = Arc::clone(&latencies);
            tokio::spawn(async move {
                let c = client();
                while Instant::now() < end {
                    let sent = Instant::now();
                    let r = c
                        .post(&url)
                        .header("x-gateway-inference-fairness-id", tenant)
                        .header("x-sim-tag", tenant)
                        .json(&serde_json::json!({
                            "model": "sim-model", "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": prompt}]}))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200, "{tenant}");
                    r.bytes().await.unwrap();
                    if tenant == "L" {
                        latencies.lock().unwrap().push(sent.elapsed());
                    }
                }
            })
        })
        .collect();
    for c in clients {
        c.await.unwrap();
    }
    let mut l = latencies.lock().unwrap().clone();
    assert!(
        l.len() >= 20,
        "the light tenant was served {} times",
        l.len()
    );
    l.sort();
    let p99 = l[(l.len() * 99).div_ceil(100) - 1];
    (p99, tagged_per_server(&sims, "H").await)
}
