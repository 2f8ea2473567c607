//! Soak: 200 concurrent clients for 10 seconds against 4 simulated slots.
//! Every request must end 200, 503 (buffer full) or 504 (waited too long);
//! no slot may leak, the backends must never queue, and the balancer's
//! memory must stay bounded.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

const CLIENTS: usize = 200;
const RUN_FOR: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_against_four_slots() {
    let b = Balancer::start(&[
        "--max-buffered-requests",
        "30",
        "--buffered-request-timeout",
        "300",
    ])
    .await;
    let sims = [
        Sim::start(&["--slots", "2", "--ttft-ms", "15", "--tpot-ms", "2"]),
        Sim::start(&["--slots", "2", "--ttft-ms", "15", "--tpot-ms", "2"]),
    ];
    let _agents: Vec<_> = sims.iter().map(|s| agent(s, &b)).collect();
    b.wait_eligible(2).await;

    let outcomes: Arc<Mutex<BTreeMap<u16, u64>>> = Arc::default();
    let start = Instant::now();
    let mut rss_samples = Vec::new();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let c = reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap();
            let url = b.url("/v1/chat/completions");
            let outcomes = Arc::clone(&outcomes);
            tokio::spawn(async move {
                let stream = i % 4 == 0;
                let body = serde_json::json!({"stream": stream, "messages": []});
                while start.elapsed() < RUN_FOR {
                    let resp = c
                        .post(&url)
                        .json(&body)
                        .send()
                        .await
                        .expect("balancer answers");
                    let status = resp.status().as_u16();
                    // Read the whole body: a 200 stream must complete.
                    let bytes = resp.bytes().await.expect("complete body");
                    if status == 200 && stream {
                        assert!(bytes.ends_with(b"data: [DONE]\n\n"), "stream cut short");
                    }
                    *outcomes.lock().unwrap().entry(status).or_default() += 1;
                    if status != 200 {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect();
    while start.elapsed() < RUN_FOR {
        tokio::time::sleep(Duration::from_millis(500)).await;
        rss_samples.push(b.proc.rss_kib());
    }
    for c in clients {
        c.await.unwrap();
    }

    let outcomes = outcomes.lock().unwrap().clone();
    eprintln!("soak outcomes: {outcomes:?}, balancer RSS KiB samples: {rss_samples:?}");
    assert!(
        outcomes.keys().all(|s| [200, 503, 504].contains(s)),
        "only 200, 503 and 504 are allowed: {outcomes:?}"
    );
    let served = outcomes.get(&200).copied().unwrap_or(0);
    assert!(served > 200, "the fleet kept serving: {outcomes:?}");
    assert!(
        outcomes.get(&503).copied().unwrap_or(0) > 0,
        "overload was shed with 503"
    );

    b.wait_in_flight(0, Duration::from_secs(3)).await;
    assert_eq!(b.buffered().await, 0);
    for s in &sims {
        let st = s.stats().await;
        assert!(st["max_processing"].as_u64().unwrap() <= 2, "{st}");
        assert_eq!(
            st["max_deferred"], 0,
            "the balancer never overfilled a backend: {st}"
        );
        assert_eq!(st["processing"], 0);
    }
    // Memory: after warm-up, RSS must not keep growing.
    let warm = rss_samples[2];
    let last = *rss_samples.last().unwrap();
    assert!(
        last <= warm + warm / 2 + 4096,
        "balancer RSS grew from {warm} KiB to {last} KiB"
    );
}
