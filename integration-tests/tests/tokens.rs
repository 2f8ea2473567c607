//! Tokens, not requests: every request gets a token estimate at admission,
//! and the estimate's bytes-per-token ratio is learned per model from the
//! `usage` the engines report.

mod common;

use std::time::Duration;

use common::*;

/// An engine whose tokenizer packs 2 bytes per token (the balancer starts
/// from 4): after a few answers the balancer's ratio for its model is 2.
#[tokio::test]
async fn the_prompt_ratio_is_learned_from_the_engines_usage() {
    let (b, _sim, _agent) = fleet(&[], &["--bytes-per-token", "2", "--output-tokens", "1"]).await;
    let ratio = || async {
        metric(
            &b,
            "flowgate_model_prompt_bytes_per_token",
            &[("model", "sim-model")],
        )
        .await
    };
    let prompt = "tokens ".repeat(600);
    for _ in 0..5 {
        let r = chat_with(&client(), &b, &[], chat_for(Some("sim-model"), &prompt)).await;
        assert_eq!(r.status(), 200);
    }
    wait_for("the learned ratio", Duration::from_secs(5), || async {
        let r = ratio().await;
        ((r - 2.0).abs() < 0.01).then_some(())
    })
    .await;
    // A model no agent reports is never learned (no series a client adds).
    let r = chat_with(&client(), &b, &[], chat_for(Some("nobody-serves-me"), "hi")).await;
    assert_eq!(r.status(), 404);
    let text = metrics_text(&b).await;
    assert!(!text.contains("nobody-serves-me"), "{text}");
}

#[test]
fn a_default_output_bound_out_of_range_is_refused_at_start() {
    for bad in ["0", "10000001", "-1"] {
        let out = std::process::Command::new(bin("balancer"))
            .arg(format!("--default-output-tokens={bad}"))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("default-output-tokens") || stderr.contains("default_output_tokens"),
            "{stderr}"
        );
    }
}

/// A vLLM-like engine with 8,192 tokens of KV cache and 8 slots, its agent
/// reporting the capacity (`vllm:cache_config_info`), and a balancer.
async fn kv_fleet(ttft_ms: &str) -> (Balancer, Sim, Proc) {
    let b = Balancer::start(&[]).await;
    let sim = Sim::start(&[
        "--engine",
        "vllm",
        "--slots",
        "8",
        "--kv-capacity-tokens",
        "8192",
        "--ttft-ms",
        ttft_ms,
    ]);
    let agent = agent_at(
        &sim.addr.to_string(),
        &b,
        &["--backend", "vllm", "--max-concurrency", "8"],
    );
    b.wait_eligible(1).await;
    let capacity = &b.agents().await["endpoints"][0]["agent"]["kv_capacity_tokens"];
    assert_eq!(capacity, 8192);
    (b, sim, agent)
}

/// A chat of `prompt_tokens` tokens (at the balancer's starting 4 bytes
/// per token) asking for `max_tokens`.
fn sized_chat(prompt_tokens: usize, max_tokens: Option<u64>) -> serde_json::Value {
    let mut body = chat_for(Some("sim-model"), &"abcd".repeat(prompt_tokens));
    if let Some(n) = max_tokens {
        body["max_tokens"] = n.into();
    }
    body
}

/// A request whose tokens do not fit in what is left of the server's KV
/// capacity waits, slots free or not, and so does everything of its model
/// behind it; it goes once room is made, and every answer is a 200.
#[tokio::test]
async fn a_large_request_waits_for_token_room_instead_of_filling_a_busy_server() {
    let (b, _sim, _agent) = kv_fleet("1500").await;
    let send = |body: serde_json::Value| {
        let b_url = b.url("/v1/chat/completions");
        tokio::spawn(async move {
            let r = client().post(b_url).json(&body).send().await.unwrap();
            r.status().as_u16()
        })
    };
    // 4,000 + 1,000 tokens go; 4,000 + 1,000 more would be 10,000 > 8,192.
    let first = send(sized_chat(4000, Some(1000)));
    b.wait_in_flight(1, Duration::from_secs(5)).await;
    let second = send(sized_chat(4000, Some(1000)));
    b.wait_buffered(1).await;
    let tiny = send(sized_chat(1, Some(1)));
    b.wait_buffered(2).await;
    let a = b.agents().await;
    let ep = &a["endpoints"][0];
    // The prompt text counts its role too: a token or two more.
    let in_flight = ep["in_flight_tokens"].as_u64().unwrap();
    assert!((5_000..5_010).contains(&in_flight), "{ep}");
    assert!(ep["free_slots"].as_u64().unwrap() >= 6, "{ep}");
    assert!(a["buffered_tokens"].as_u64().unwrap() >= 5_002, "{a}");
    assert_eq!(
        metric(&b, "flowgate_endpoint_in_flight_tokens", &[]).await,
        in_flight as f64
    );
    for (name, h) in [("first", first), ("second", second), ("tiny", tiny)] {
        assert_eq!(h.await.unwrap(), 200, "{name}");
    }
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    assert_eq!(b.agents().await["endpoints"][0]["in_flight_tokens"], 0);
}

/// A request that no server of its model can ever hold is refused at once
/// with 413, not held until its TTL; an output bound the client did not
/// ask for is no reason to refuse.
#[tokio::test]
async fn a_request_that_can_never_fit_is_refused_413_at_once() {
    let (b, _sim, _agent) = kv_fleet("20").await;
    let started = std::time::Instant::now();
    for body in [sized_chat(8000, Some(500)), sized_chat(9000, None)] {
        let r = chat_with(&client(), &b, &[], body).await;
        assert_eq!(
            r.headers()["x-flowgate-drop-reason"],
            "exceeds-token-capacity"
        );
        let e = assert_openai_error(r, 413).await;
        assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused at once, not after the 10 s TTL"
    );
    // 6,000 prompt tokens and no bound: the default 1,024 would overflow,
    // but the engine stops at its context; it is served.
    let r = chat_with(&client(), &b, &[], sized_chat(6000, None)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        metric(
            &b,
            "flowgate_requests_total",
            &[("reason", "exceeds-token-capacity")]
        )
        .await,
        2.0
    );
}

/// What each tenant and key spent is counted from the answers' usage:
/// `GET /api/v1/usage` per tenant and key over a window, the tenant
/// metrics, with their series bounded whatever fairness ids clients send.
#[tokio::test]
async fn usage_is_accounted_per_tenant_and_key() {
    let keys = ConfigFile::new(
        "keys:\n  - key: sk-acme\n    tenant: acme\n    name: acme-prod\n  \
         - key: sk-beta\n    tenant: beta\n",
    );
    let (b, _sim, _agent) = fleet(
        &["--api-keys-file", keys.arg()],
        &["--output-tokens", "5", "--ttft-ms", "1", "--tpot-ms", "0"],
    )
    .await;
    let send = |key: &'static str, fairness: String, prompt_bytes: usize| {
        let b_url = b.url("/v1/chat/completions");
        async move {
            let r = client()
                .post(b_url)
                .bearer_auth(key)
                .header("x-gateway-inference-fairness-id", fairness)
                .json(&chat_for(
                    Some("sim-model"),
                    &"abcd".repeat(prompt_bytes / 4),
                ))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let v: serde_json::Value = r.json().await.unwrap();
            v["usage"]["prompt_tokens"].as_u64().unwrap()
                + v["usage"]["completion_tokens"].as_u64().unwrap()
        }
    };
    let mut acme = 0;
    for _ in 0..3 {
        acme += send("sk-acme", "ignored".into(), 400).await;
    }
    let beta = send("sk-beta", "ignored".into(), 40).await;
    // Accounted once each request has given its slot back.
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    let usage = |query: &'static str| {
        let url = b.mgmt(&format!("/api/v1/usage{query}"));
        async move { get_json(&url).await }
    };
    let u = usage("").await;
    assert_eq!(u["window_s"], 3600);
    let tenants = u["tenants"].as_array().unwrap();
    assert_eq!(tenants[0]["tenant"], "acme", "{u}");
    assert_eq!(tenants[0]["requests"], 3);
    let total = |t: &serde_json::Value| {
        t["prompt_tokens"].as_u64().unwrap() + t["completion_tokens"].as_u64().unwrap()
    };
    assert_eq!(total(&tenants[0]), acme);
    assert_eq!(tenants[0]["completion_tokens"], 15);
    assert_eq!(tenants[0]["keys"]["acme-prod"]["requests"], 3);
    assert_eq!(total(&tenants[1]), beta);
    // A key without a name is its digest's first 12 hex digits.
    let beta_keys: Vec<&String> = tenants[1]["keys"].as_object().unwrap().keys().collect();
    assert_eq!(beta_keys.len(), 1);
    assert_eq!(beta_keys[0].len(), 12);
    assert!(!u.to_string().contains("sk-"), "no key in the answer: {u}");
    // Filters and bad queries.
    let only = usage("?tenant=beta&window=5m").await;
    assert_eq!(only["tenants"].as_array().unwrap().len(), 1);
    assert_eq!(only["window_s"], 300);
    for bad in ["?window=soon", "?window=0s", "?limit=-1"] {
        let r = client()
            .get(b.mgmt(&format!("/api/v1/usage{bad}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{bad}");
    }
    // The metrics say the same.
    let acme_metric = metric(&b, "flowgate_tenant_tokens_total", &[("tenant", "acme")]).await;
    assert_eq!(acme_metric as u64, acme);
    assert_eq!(
        metric(&b, "flowgate_tenant_requests_total", &[("tenant", "beta")]).await,
        1.0
    );
}

/// Fairness ids are the client's to choose: however many it invents, the
/// tenant series stay bounded, and the counts stay true.
#[tokio::test]
async fn tenant_series_are_bounded() {
    let (b, _sim, _agent) =
        fleet(&[], &["--ttft-ms", "0", "--tpot-ms", "0", "--slots", "16"]).await;
    let c = client();
    let sends = (0..300).map(|i| {
        let c = c.clone();
        let url = b.url("/v1/chat/completions");
        async move {
            let r = c
                .post(url)
                .header("x-gateway-inference-fairness-id", format!("t{i}"))
                .json(&chat_body())
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
    });
    // 16 at a time: within the slots and the buffer.
    use futures_util::StreamExt;
    futures_util::stream::iter(sends)
        .buffer_unordered(16)
        .collect::<Vec<()>>()
        .await;
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    let text = metrics_text(&b).await;
    let series = text
        .lines()
        .filter(|l| l.starts_with("flowgate_tenant_requests_total{"))
        .count();
    assert_eq!(series, 257, "256 tenants and (other)");
    assert_eq!(
        metric(&b, "flowgate_tenant_requests_total", &[]).await,
        300.0
    );
    let u = get_json(&b.mgmt("/api/v1/usage?limit=5")).await;
    assert_eq!(u["tenants_total"], 300);
    assert_eq!(u["tenants"].as_array().unwrap().len(), 5);
}
