//! Sessions as clients send them: every key source keeps a conversation on
//! one server although its prompts share nothing (so prefix affinity
//! cannot be what holds it there), a Responses chain follows
//! `previous_response_id`, a conversation whose server dies goes on
//! elsewhere and stays there, and ten thousand distinct keys keep the
//! balancer's table at its bound.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// Three one-process servers, 4 slots each, with their agents.
async fn three_servers(b: &Balancer) -> (Vec<Sim>, Vec<Proc>) {
    let sims: Vec<Sim> = (0..3)
        .map(|_| Sim::start(&["--slots", "4", "--ttft-ms", "5"]))
        .collect();
    let agents = sims.iter().map(|s| agent(s, b)).collect();
    b.wait_eligible(3).await;
    (sims, agents)
}

/// A prompt that shares nothing with any other (no prefix affinity).
fn unrelated_prompt(tag: &str, turn: usize) -> String {
    format!("{tag} turn {turn} {} ", turn * 7919).repeat(40)
}

/// How a conversation names itself.
#[derive(Clone, Copy)]
enum Key {
    None,
    Header(&'static str),
    Body(&'static str),
    /// `conversation: {"id": ...}`.
    ConversationObject,
}

/// Sends `turns` chat turns of one conversation, one after another.
async fn converse(b: &Balancer, key: Key, value: &str, tag: &str, turns: usize) {
    let c = client();
    for turn in 0..turns {
        let mut body = json!({"model": "sim-model",
            "messages": [{"role": "user", "content": unrelated_prompt(tag, turn)}]});
        let mut req = c
            .post(b.url("/v1/chat/completions"))
            .header("x-sim-tag", tag);
        match key {
            Key::None => {}
            Key::Header(name) => req = req.header(name, value),
            Key::Body(field) => body[field] = json!(value),
            Key::ConversationObject => body["conversation"] = json!({"id": value}),
        }
        let r = req.json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200, "{tag} turn {turn}");
        r.bytes().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_session_key_source_keeps_a_conversation_on_one_server() {
    let b = Balancer::start(&[]).await;
    let (sims, _agents) = three_servers(&b).await;
    let sources = [
        Key::Header("x-flowgate-session"),
        Key::Header("x-session-id"),
        Key::Header("x-session-affinity"),
        Key::Header("x-claude-code-session-id"),
        Key::Header("session_id"),
        Key::Header("session-id"),
        Key::Header("x-dynamo-session-id"),
        Key::Header("x-smg-routing-key"),
        Key::Body("prompt_cache_key"),
        Key::Body("conversation"),
        Key::ConversationObject,
    ];
    for (i, key) in sources.into_iter().enumerate() {
        for conv in 0..2 {
            let tag = format!("s{i}c{conv}");
            let value = format!("3f2c9a7e-{i}-{conv}");
            converse(&b, key, &value, &tag, 5).await;
            let counts = tagged_per_server(&sims, &tag).await;
            assert!(
                counts.contains(&5),
                "source {i}: {tag} was split: {counts:?}"
            );
        }
    }
    // Without a key the same conversations are placed by load: equal
    // servers take turns.
    let mut split = 0;
    for conv in 0..3 {
        let tag = format!("none{conv}");
        converse(&b, Key::None, "", &tag, 5).await;
        if !tagged_per_server(&sims, &tag).await.contains(&5) {
            split += 1;
        }
    }
    assert!(
        split > 0,
        "without a session key nothing held them together"
    );
    assert!(b.agents().await["sessions"].as_u64().unwrap() >= 22);
    // A key is never logged or exported in clear.
    let text = metrics_text(&b).await;
    assert!(!text.contains("3f2c9a7e"));
    assert!(text.contains("flowgate_sessions "));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_chain_follows_previous_response_id() {
    let b = Balancer::start(&[]).await;
    let (sims, _agents) = three_servers(&b).await;
    let c = client();
    for chain in 0..3 {
        let tag = format!("chain{chain}");
        let mut previous: Option<String> = None;
        for turn in 0..5 {
            let mut body = json!({"model": "sim-model", "input": unrelated_prompt(&tag, turn)});
            if let Some(id) = &previous {
                body["previous_response_id"] = json!(id);
            }
            let r = c
                .post(b.url("/v1/responses"))
                .header("x-sim-tag", &tag)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let answer: Value = r.json().await.unwrap();
            let id = answer["id"].as_str().unwrap().to_string();
            assert!(id.starts_with("resp_"), "{answer}");
            previous = Some(id);
        }
        let counts = tagged_per_server(&sims, &tag).await;
        assert!(counts.contains(&5), "{tag} was split: {counts:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_whose_server_dies_goes_on_elsewhere_and_stays() {
    let b = Balancer::start(&[]).await;
    let (mut sims, _agents) = three_servers(&b).await;
    converse(&b, Key::Header("x-session-id"), "dies", "before", 2).await;
    let home = tagged_per_server(&sims, "before")
        .await
        .iter()
        .position(|n| *n == 2)
        .expect("both turns on one server");
    // kill -9 the server of the conversation; its agent stays up and will
    // report it unreachable.
    drop(sims.remove(home));
    converse(&b, Key::Header("x-session-id"), "dies", "after", 5).await;
    let counts = tagged_per_server(&sims, "after").await;
    assert!(
        counts.contains(&5),
        "the conversation moved once and stayed: {counts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_distinct_keys_keep_the_table_at_its_bound() {
    let config = ConfigFile::new("scheduling:\n  sessions:\n    maxSessions: 100\n");
    let b = Balancer::start(&["--config", config.arg()]).await;
    let sim = Sim::start(&["--slots", "16"]);
    let _agent = agent(&sim, &b);
    b.wait_eligible(1).await;
    let c = client();
    let jobs: Vec<_> = (0..8)
        .map(|worker| {
            let c = c.clone();
            let url = b.url("/v1/chat/completions");
            tokio::spawn(async move {
                for i in 0..1_250 {
                    let r = c
                        .post(&url)
                        .header("x-session-id", format!("key-{worker}-{i}"))
                        .header("x-sim-output-tokens", "1")
                        .json(&chat_body())
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200);
                    r.bytes().await.unwrap();
                }
            })
        })
        .collect();
    for j in jobs {
        j.await.unwrap();
    }
    assert_eq!(b.agents().await["sessions"], 100);
    // Keys that are no keys (too long, not visible ASCII) are ignored, not
    // refused.
    let long = "k".repeat(300);
    for bad in [long.as_str(), "has space"] {
        let r = c
            .post(b.url("/v1/chat/completions"))
            .header("x-session-id", bad)
            .json(&chat_body())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    sim.wait_idle(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn why_this_endpoint_is_told_only_to_whom_it_is_allowed() {
    let keys = ConfigFile::new(
        "keys:\n  - key: sk-debug\n    tenant: ops\n    debug: true\n  - key: sk-plain\n    tenant: app\n",
    );
    let b = Balancer::start(&["--api-keys-file", keys.arg()]).await;
    let sims: Vec<Sim> = (0..2).map(|_| Sim::start(&["--slots", "2"])).collect();
    let _agents: Vec<_> = sims.iter().map(|s| agent(s, &b)).collect();
    b.wait_eligible(2).await;
    let c = client();
    let ask = |key: &'static str, debug: Option<&'static str>| {
        let c = c.clone();
        let url = b.url("/v1/chat/completions");
        async move {
            let mut req = c
                .post(url)
                .header("authorization", format!("Bearer {key}"))
                .header("x-session-id", "conv-1")
                .json(&chat_for(Some("sim-model"), &"why here? ".repeat(80)));
            if let Some(d) = debug {
                req = req.header("x-flowgate-debug", d);
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 200);
            let scores = r
                .headers()
                .get("x-flowgate-scores")
                .map(|v| v.to_str().unwrap().to_string());
            r.bytes().await.unwrap();
            scores
        }
    };
    // A key without the grant that asks is told no, and served.
    assert_eq!(
        ask("sk-plain", Some("scores")).await.as_deref(),
        Some("denied")
    );
    assert_eq!(ask("sk-debug", None).await, None, "only when asked");
    let told: Value =
        serde_json::from_str(&ask("sk-debug", Some("scores")).await.unwrap()).unwrap();
    let endpoint = told["endpoint"].as_str().unwrap();
    assert!(
        sims.iter().any(|s| s.addr.to_string() == endpoint),
        "{told}"
    );
    let x = &told["explanation"];
    assert_eq!(x["candidates"].as_array().unwrap().len(), 2, "{told}");
    for c in x["candidates"].as_array().unwrap() {
        let terms = &c["terms"];
        let sum: f64 = ["prefix_cache", "free_slots", "kv_cache", "queue"]
            .iter()
            .map(|t| terms[t].as_f64().unwrap())
            .sum();
        assert!((sum - c["score"].as_f64().unwrap()).abs() < 1e-9, "{c}");
    }
    assert!(told["session"].as_str().is_some_and(|s| s.len() == 16));
    assert!(
        !told.to_string().contains("conv-1"),
        "the key is never told"
    );

    // The probe scores a body against the live fleet and books nothing.
    // (The answers above end before their slots are given back: wait.)
    let before = wait_for(
        "the answered requests' slots back",
        Duration::from_secs(5),
        || async {
            let agents = b.agents().await;
            (agents["in_flight_requests"] == 0).then_some(agents)
        },
    )
    .await;
    let probe = |body: String| {
        let c = c.clone();
        let url = b.mgmt("/api/v1/route/probe");
        async move {
            let r = c
                .post(url)
                .header("x-session-id", "conv-1")
                .header("x-gateway-inference-fairness-id", "ops")
                .body(body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (status, p) =
        probe(chat_for(Some("sim-model"), &"why here? ".repeat(80)).to_string()).await;
    assert_eq!(status, 200, "{p}");
    let x = &p["explanation"];
    assert_eq!(x["candidates"].as_array().unwrap().len(), 2);
    assert!(x["prompt_blocks"].as_u64().unwrap() > 0);
    assert!(x["choice"].is_string());
    assert_eq!(p["served_model"], "sim-model");
    let after = b.agents().await;
    assert_eq!(after["sessions"], before["sessions"], "no session bound");
    assert_eq!(after["in_flight_requests"], 0, "no slot taken");
    let (status, refused) = probe("[not an object".into()).await;
    assert_eq!(status, 400, "{refused}");
    // A body past the probe's 4 MiB is refused before it is read whole.
    let (status, refused) = probe("x".repeat(5 * 1024 * 1024)).await;
    assert_eq!(status, 413, "{refused}");
    assert_eq!(b.agents().await["in_flight_requests"], 0);
}
