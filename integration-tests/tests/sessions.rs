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

/// How many requests tagged `tag` each server received.
async fn spread(sims: &[Sim], tag: &str) -> Vec<usize> {
    let mut counts = Vec::new();
    for s in sims {
        let arrivals = s.stats().await["arrivals"].as_array().unwrap().clone();
        counts.push(arrivals.iter().filter(|t| *t == tag).count());
    }
    counts
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
            let counts = spread(&sims, &tag).await;
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
        if !spread(&sims, &tag).await.contains(&5) {
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
        let counts = spread(&sims, &tag).await;
        assert!(counts.contains(&5), "{tag} was split: {counts:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_whose_server_dies_goes_on_elsewhere_and_stays() {
    let b = Balancer::start(&[]).await;
    let (mut sims, _agents) = three_servers(&b).await;
    converse(&b, Key::Header("x-session-id"), "dies", "before", 2).await;
    let home = spread(&sims, "before")
        .await
        .iter()
        .position(|n| *n == 2)
        .expect("both turns on one server");
    // kill -9 the server of the conversation; its agent stays up and will
    // report it unreachable.
    drop(sims.remove(home));
    converse(&b, Key::Header("x-session-id"), "dies", "after", 5).await;
    let counts = spread(&sims, "after").await;
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
