//! Cache truth as an operator sees it: what the engine said it reused is
//! summed per endpoint (Σcached / Σprompt), the balancer's expected hits
//! are counted by whether the engine had them, and an engine that lost its
//! cache (restarted) shrinks the balancer's prefix index for it.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

/// Sends one chat of `prompt`; returns the cached tokens the answer said.
async fn ask(b: &Balancer, prompt: &str) -> u64 {
    let r = client()
        .post(b.url("/v1/chat/completions"))
        .json(&json!({"model": "sim-model", "messages": [{"role": "user", "content": prompt}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let answer: serde_json::Value = r.json().await.unwrap();
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("the engine says what it reused")
}

/// Waits until the balancer counted `n` expected hits with `outcome`
/// (it settles an answer just after the client read its last byte).
async fn predictions(b: &Balancer, outcome: &str, n: f64) {
    wait_for("the answers settled", Duration::from_secs(5), || async {
        let seen = metric(
            b,
            "flowgate_endpoint_cache_predictions_total",
            &[("outcome", outcome)],
        )
        .await;
        (seen == n).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_word_is_counted_and_a_lost_cache_corrects_the_index() {
    let (b, sim, _agent) = fleet(&[], &["--slots", "4", "--prefix-cache-tokens", "100000"]).await;
    let prompt = "A long shared system prompt for cache truth. ".repeat(100);
    assert_eq!(ask(&b, &prompt).await, 0, "cold");
    let warm = ask(&b, &prompt).await;
    assert!(warm > 0, "the second time the engine has it");
    // The second request was expected to hit, and did.
    predictions(&b, "hit", 1.0).await;
    let cached = metric(&b, "flowgate_endpoint_cached_tokens_total", &[]).await;
    let prompted = metric(&b, "flowgate_endpoint_prompt_tokens_total", &[]).await;
    assert_eq!(cached, warm as f64);
    let ratio = metric(
        &b,
        "flowgate_endpoint_cache_hit_ratio",
        &[("model", "sim-model")],
    )
    .await;
    assert!(
        (ratio - cached / prompted).abs() < 1e-9,
        "Σcached / Σprompt"
    );
    let capacity = |agents: serde_json::Value| agents["endpoints"][0]["prefix_capacity"].as_u64();
    assert_eq!(capacity(b.agents().await), Some(4096));

    // The engine restarts and forgets everything: the balancer still
    // expects a hit, the engine says otherwise.
    client()
        .post(format!("http://{}/sim/reset", sim.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(ask(&b, &prompt).await, 0);
    predictions(&b, "miss", 1.0).await;
    let agents = b.agents().await;
    assert!(capacity(agents.clone()).unwrap() < 4096, "{agents}");
    assert!(agents["endpoints"][0]["cache"]["predicted_misses"] == 1);
    // Every answer taught the endpoint's service time.
    let cost = &agents["endpoints"][0]["cost"];
    assert_eq!(cost["samples"], 3, "{cost}");
    assert!(cost["service_ms"].as_f64().unwrap() > 0.0);
    assert!(metric(&b, "flowgate_endpoint_service_seconds", &[]).await > 0.0);
    // An engine's error teaches nothing of its speed.
    let refused = client()
        .post(b.url("/v1/chat/completions"))
        .header("x-sim-fault", "reject=500")
        .json(&chat_body())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 500);
    refused.bytes().await.unwrap();
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    assert_eq!(b.agents().await["endpoints"][0]["cost"]["samples"], 3);
}

/// Two engines, one prefilling ten times slower than the other: the
/// balancer learns each one's rate from its streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_engines_prefill_rate_is_learned_from_its_answers() {
    let b = Balancer::start(&[]).await;
    let slow = Sim::start(&["--slots", "2", "--prefill-us-per-token", "2000"]);
    let fast = Sim::start(&["--slots", "2", "--prefill-us-per-token", "200"]);
    let _agents = (agent(&slow, &b), agent(&fast, &b));
    b.wait_eligible(2).await;
    let c = client();
    for i in 0..8 {
        let body = json!({"model": "sim-model", "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": format!("{i} unrelated ").repeat(40)}]});
        let r = c
            .post(b.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    let rate = |agents: &serde_json::Value, sim: &Sim| {
        let cost = &endpoint_of(agents, sim)["cost"];
        (
            cost["samples"].as_u64().unwrap(),
            cost["prefill_ms_per_token"].as_f64().unwrap(),
        )
    };
    let (slow_rate, fast_rate) = wait_for("both learned", Duration::from_secs(5), || async {
        let agents = b.agents().await;
        let (s, f) = (rate(&agents, &slow), rate(&agents, &fast));
        (s.0 >= 2 && f.0 >= 2).then_some((s.1, f.1))
    })
    .await;
    let ratio = slow_rate / fast_rate;
    assert!(
        ratio > 4.0,
        "slow {slow_rate} ms/token, fast {fast_rate} ms/token"
    );
    assert!(
        (1.0..4.0).contains(&slow_rate),
        "about 2 ms per token: {slow_rate}"
    );
}
