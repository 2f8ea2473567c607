//! The vLLM and SGLang agents against llm-sim speaking each engine's
//! metrics: slots from `--max-concurrency`, busy and waiting from the
//! engine's gauges, KV use reported, and the balancer never sending more
//! than the slots.

mod common;

use std::time::Duration;

use common::*;

/// An llm-sim speaking `engine` with `slots` slots (and `more` flags),
/// and its agent for that engine, once `b` sees it eligible.
async fn engine_behind(b: &Balancer, engine: &str, slots: &str, more: &[&str]) -> (Sim, Proc) {
    let mut args = vec!["--engine", engine, "--slots", slots];
    args.extend_from_slice(more);
    let sim = Sim::start(&args);
    let agent = agent_at(
        &sim.addr.to_string(),
        b,
        &["--backend", engine, "--max-concurrency", slots],
    );
    b.wait_eligible(1).await;
    (sim, agent)
}

async fn engine_agent_reports_and_limits(engine: &str) {
    let b = Balancer::start(&[]).await;
    let (sim, _agent) = engine_behind(&b, engine, "3", &["--ttft-ms", "300"]).await;
    let ep = &b.agents().await["endpoints"][0];
    assert_eq!(ep["agent"]["backend"], engine);
    assert_eq!(ep["agent"]["slots_total"], 3);
    assert_eq!(ep["agent"]["models"][0], "sim-model");

    let chats: Vec<_> = (0..5).map(|_| spawn_chat(&b, &[])).collect();
    b.wait_in_flight(3, Duration::from_secs(5)).await;
    b.wait_buffered(2).await;
    // The agent sees the engine's own running gauge and KV use.
    wait_for(
        "the agent to report 3 busy slots",
        Duration::from_secs(5),
        || async {
            let a = b.agents().await;
            let report = &a["endpoints"][0]["agent"];
            (report["slots_busy"] == 3 && report["kv_cache_usage"].as_f64() == Some(0.5))
                .then_some(())
        },
    )
    .await;
    for c in chats {
        assert_eq!(c.await.unwrap(), 200);
    }
    assert_eq!(
        sim.stats().await["max_deferred"],
        0,
        "the engine never queued: the balancer held the extra requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_agent() {
    engine_agent_reports_and_limits("vllm").await;
}

/// The vLLM agent reports the server's LoRA adapters (`/v1/models`
/// entries with a parent), those with requests running
/// (`vllm:lora_requests_info`) and those loaded
/// (`vllm:lora_adapter_loaded`), shown in `/api/v1/agents`; a request
/// naming an adapter is served by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_agent_reports_lora_adapters() {
    let b = Balancer::start(&[]).await;
    let (sim, _agent) = engine_behind(
        &b,
        "vllm",
        "2",
        &[
            "--lora",
            "sql,chat",
            "--max-loras",
            "1",
            "--lora-load-ms",
            "50",
            "--ttft-ms",
            "1500",
        ],
    )
    .await;
    let adapters = |a: serde_json::Value| a["endpoints"][0]["agent"]["adapters"].clone();
    let first = adapters(b.agents().await);
    assert_eq!(
        first["servable"],
        serde_json::json!(["chat", "sql"]),
        "{first}"
    );
    assert_eq!(first["max_loaded"], 1, "{first}");
    let r = tokio::spawn(
        client()
            .post(b.url("/v1/chat/completions"))
            .json(&chat_for(Some("sql"), "select"))
            .send(),
    );
    wait_for("sql running", Duration::from_secs(5), || async {
        (adapters(b.agents().await)["running"] == serde_json::json!(["sql"])).then_some(())
    })
    .await;
    let r = r.await.unwrap().unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["model"], "sql");
    assert_eq!(sim.stats().await["lora_loads"], 1);
    // Idle, still loaded (`vllm:lora_adapter_loaded`).
    wait_for("sql loaded and idle", Duration::from_secs(5), || async {
        let a = adapters(b.agents().await);
        (a["loaded"] == serde_json::json!(["sql"]) && a["running"] == serde_json::json!([]))
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_agent() {
    engine_agent_reports_and_limits("sglang").await;
}

/// With a KV capacity, llm-sim reports real KV use; the balancer stops
/// sending work to a server whose KV cache is past the threshold even
/// though it has free slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_cache_use_saturates_an_endpoint() {
    let b = Balancer::start(&[]).await;
    let (sim, _agent) = engine_behind(
        &b,
        "vllm",
        "8",
        &["--kv-capacity-tokens", "1000", "--ttft-ms", "1500"],
    )
    .await;
    // ~900 prompt tokens: 90% of the KV cache while it runs.
    let big = serde_json::json!({"model": "sim-model",
        "messages": [{"role": "user", "content": "x".repeat(3_600)}]});
    let c = client();
    let url = b.url("/v1/chat/completions");
    let first = tokio::spawn({
        let (c, url, big) = (c.clone(), url.clone(), big.clone());
        async move {
            c.post(url)
                .json(&big)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    });
    wait_for(
        "the endpoint to saturate on KV use",
        Duration::from_secs(5),
        || async {
            let a = b.agents().await;
            (a["endpoints"][0]["saturation"] == "kv-cache").then_some(())
        },
    )
    .await;
    // A small request now waits in the balancer, not in the server.
    let second = spawn_chat(&b, &[]);
    b.wait_buffered(1).await;
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(second.await.unwrap(), 200);
    assert_eq!(sim.stats().await["max_deferred"], 0);
}

#[test]
fn engines_without_max_concurrency_are_a_usage_error() {
    let out = std::process::Command::new(bin("agent"))
        .args(["--backend", "vllm", "--backend-addr", "127.0.0.1:9"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--max-concurrency"), "{stderr}");
}
