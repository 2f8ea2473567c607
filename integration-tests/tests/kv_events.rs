//! Engine KV-cache events end to end: llm-sim publishes its prefix cache's
//! changes as vLLM and SGLang do (each layout), the agent follows them
//! (replaying a gap, dropping and rebuilding what a gap it cannot replay
//! left unknown, surviving garbage and a restart), and the balancer holds
//! the blocks each engine holds.

mod common;

use std::io::{BufRead, BufReader};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// An llm-sim with a prefix cache publishing events in `layout`, and the
/// addresses of its PUB and replay sockets.
fn sim_with_events(layout: &str) -> (Sim, String, String) {
    sim_with_events_and(layout, &[])
}

/// The same, with `extra` arguments.
fn sim_with_events_and(layout: &str, extra: &[&str]) -> (Sim, String, String) {
    let args: Vec<String> = [
        "--listen",
        "127.0.0.1:0",
        "--engine",
        "vllm",
        "--prefix-cache-tokens",
        "100000",
        "--kv-events-port",
        "0",
        "--kv-events-layout",
        layout,
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    let mut proc = Proc::spawn("llm-sim", &args);
    let stdout = proc.child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut next = || {
        lines
            .next()
            .expect("a banner line")
            .expect("read llm-sim banner")
    };
    let addr = next()
        .strip_prefix("listening on ")
        .expect("the address first")
        .parse()
        .expect("llm-sim address");
    let kv = next();
    let rest = kv
        .strip_prefix("kv events on ")
        .expect("the events' sockets");
    let (publisher, replay) = rest.split_once(" replay ").expect("both sockets");
    (
        Sim { proc, addr },
        publisher.to_string(),
        replay.to_string(),
    )
}

/// An agent watching `sim` as a vLLM server of 4 slots and following its
/// events at `publisher` (and its replay socket, when given), reporting to
/// `b` (and to the balancers `also` names).
fn events_agent(
    sim: &Sim,
    b: &Balancer,
    publisher: &str,
    replay: Option<&str>,
    also: &[&str],
) -> Proc {
    let mut args = vec![
        "--backend",
        "vllm",
        "--max-concurrency",
        "4",
        "--kv-events",
        publisher,
    ];
    if let Some(replay) = replay {
        args.extend(["--kv-events-replay", replay]);
    }
    args.extend_from_slice(also);
    agent_at(&sim.addr.to_string(), b, &args)
}

/// A prompt of `blocks` whole cache blocks (64 bytes each), named by `tag`.
fn prompt(tag: &str, blocks: usize) -> Value {
    let mut text = format!("{tag}: ");
    while text.len() < blocks * 64 + 32 {
        text.push_str("the quick brown fox jumps over the lazy dog. ");
    }
    text.truncate(blocks * 64 + 32);
    json!({"model": "sim-model", "messages": [{"role": "user", "content": text}]})
}

async fn fault(sim: &Sim, body: Value) {
    let r = client()
        .post(format!("http://{}/sim/kv-events", sim.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// The agent's report of the events, and the balancer's copy of the
/// blocks, once `cond` holds of them.
async fn wait_blocks(
    b: &Balancer,
    what: &str,
    cond: impl Fn(&Value, &Value) -> bool,
) -> (Value, Value) {
    wait_for(what, Duration::from_secs(10), || async {
        let agents = b.agents().await;
        let report = agents["endpoints"][0]["agent"]["kv_events"].clone();
        let copy = agents["engine_blocks"][0].clone();
        cond(&report, &copy).then_some((report, copy))
    })
    .await
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

async fn follows(layout: &str) {
    let b = Balancer::start(&[]).await;
    let (sim, publisher, replay) = sim_with_events(layout);
    let _agent = events_agent(&sim, &b, &publisher, Some(&replay), &[]);
    b.wait_eligible(1).await;
    // Nothing cached yet: no blocks, but the copy exists once the agent
    // sent its first snapshot.
    wait_blocks(&b, "the first snapshot", |r, c| {
        r["whole"] == true && c["version"].is_u64()
    })
    .await;

    // A prompt of 8 blocks is cached: the balancer holds its 8 blocks.
    served_by(&b, &prompt("first", 8)).await;
    let (report, _) = wait_blocks(&b, "8 blocks", |r, c| {
        n(&c["blocks_gpu"]) == 8 && n(&r["blocks_gpu"]) == 8
    })
    .await;
    assert_eq!(
        report["block_size"], 16,
        "{layout}: 16 tokens of 4 bytes a block"
    );

    // Two batches never sent: the agent sees the gap at the next one sent
    // (the next prompt's) and replays it from the ring.
    fault(&sim, json!({"drop": 2})).await;
    served_by(&b, &prompt("second", 4)).await;
    served_by(&b, &prompt("nudge-1", 1)).await;
    let (report, _) = wait_blocks(&b, "the replayed gap", |r, c| {
        n(&c["blocks_gpu"]) == 13 && n(&r["replays"]) >= 1
    })
    .await;
    assert_eq!(report["resyncs"], 0, "{layout}: {report}");
    assert_eq!(report["whole"], true);

    // Garbage is counted and skipped; the events after it still apply.
    fault(&sim, json!({"garbage": 3})).await;
    served_by(&b, &prompt("third", 2)).await;
    let (report, _) = wait_blocks(&b, "garbage skipped", |_, c| n(&c["blocks_gpu"]) == 15).await;
    assert!(n(&report["skipped"]) >= 3, "{layout}: {report}");

    // Batches lost from the ring too: the index is dropped and partial.
    fault(&sim, json!({"lose": 2})).await;
    served_by(&b, &prompt("fourth", 2)).await;
    served_by(&b, &prompt("nudge-2", 1)).await;
    let (report, _) = wait_blocks(&b, "the lost gap", |r, _| n(&r["resyncs"]) >= 1).await;
    assert_eq!(report["whole"], false, "{layout}: {report}");

    // The engine restarts (numbering from 0, cache empty): nothing held,
    // whole again.
    fault(&sim, json!({"restart": true})).await;
    served_by(&b, &prompt("fifth", 3)).await;
    let (report, _) = wait_blocks(&b, "the restart", |r, c| {
        n(&r["restarts"]) >= 1 && n(&c["blocks_gpu"]) == 3
    })
    .await;
    assert_eq!(report["whole"], true, "{layout}: {report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_follows_vllms_tagged_events() {
    follows("tagged").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_follows_vllms_positional_events() {
    follows("positional").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_follows_sglangs_events() {
    follows("sglang").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_balancer_that_restarts_gets_a_snapshot() {
    let b = Balancer::start(&[]).await;
    let (sim, publisher, _) = sim_with_events("tagged");
    let _agent = events_agent(&sim, &b, &publisher, None, &[]);
    b.wait_eligible(1).await;
    served_by(&b, &prompt("kept", 5)).await;
    wait_blocks(&b, "5 blocks", |_, c| n(&c["blocks_gpu"]) == 5).await;
    let (inference, management) = (b.inference, b.management);
    drop(b);
    let b = Balancer::start_on(inference, management, &[]).await;
    b.wait_eligible(1).await;
    wait_blocks(&b, "the snapshot after the restart", |_, c| {
        n(&c["blocks_gpu"]) == 5
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_from_an_unknown_agent_or_garbage_are_refused() {
    let b = Balancer::start(&[]).await;
    let r = client()
        .post(b.mgmt("/api/v1/agents/nobody/blocks"))
        .body(vec![0u8; 64])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let sim = Sim::start(&[]);
    let _agent = agent(&sim, &b);
    b.wait_eligible(1).await;
    let id = b.agents().await["endpoints"][0]["agent"]["agent_id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = client()
        .post(b.mgmt(&format!("/api/v1/agents/{id}/blocks")))
        .body(b"{\"not\": \"blocks\"}".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

/// Two engines publishing their caches behind one balancer, each with its
/// agent following the events.
async fn two_engines(b: &Balancer) -> (Vec<Sim>, Vec<Proc>) {
    two_engines_with(b, &[]).await
}

/// The same, each llm-sim given `extra` arguments.
async fn two_engines_with(b: &Balancer, extra: &[&str]) -> (Vec<Sim>, Vec<Proc>) {
    let mut sims = Vec::new();
    let mut agents = Vec::new();
    for _ in 0..2 {
        let (sim, publisher, replay) = sim_with_events_and("tagged", extra);
        agents.push(events_agent(&sim, b, &publisher, Some(&replay), &[]));
        sims.push(sim);
    }
    b.wait_eligible(2).await;
    (sims, agents)
}

/// Where the balancer sends `body`.
async fn served_by(b: &Balancer, body: &Value) -> String {
    turn_via(b, None, body).await
}

/// Where `b` sends `body`, a turn of the conversation `session` names.
async fn turn_via(b: &Balancer, session: Option<&str>, body: &Value) -> String {
    let mut request = client().post(b.url("/v1/chat/completions"));
    if let Some(session) = session {
        request = request.header("x-session-id", session);
    }
    let r = request.json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.headers()["x-sim-server"].to_str().unwrap().to_string()
}

/// Sends `body` straight to `sim`, behind the balancer's back.
async fn warm(sim: &Sim, body: &Value) {
    let r = client()
        .post(format!("http://{}/v1/chat/completions", sim.addr))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// Blocks the balancer's copy of `sim`'s engine holds.
async fn copy_of(b: &Balancer, sim: &Sim) -> u64 {
    let agents = b.agents().await;
    let agent_id = endpoint_of(&agents, sim)["agent"]["agent_id"].clone();
    let copies = agents["engine_blocks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    copies
        .iter()
        .find(|c| c["agent"] == agent_id)
        .map_or(0, |c| n(&c["blocks_gpu"]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_warmed_behind_the_balancers_back_draws_its_requests() {
    let b = Balancer::start(&[]).await;
    let (sims, _agents) = two_engines(&b).await;
    let p = prompt("warmed behind the back", 8);
    // Each engine in turn holds the prompt (sent straight to it), and the
    // next three requests for it all go there.
    for (i, sim) in sims.iter().enumerate() {
        let other = &sims[1 - i];
        let r = client()
            .post(format!("http://{}/sim/reset", other.addr))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        warm(sim, &p).await;
        wait_for("the copies to show it", Duration::from_secs(10), || async {
            (copy_of(&b, sim).await >= 8 && copy_of(&b, other).await == 0).then_some(())
        })
        .await;
        // The route probe says why, for each candidate.
        let probe = post_json(&b.mgmt("/api/v1/route/probe"), &p).await;
        let x = &probe["explanation"];
        assert_eq!(x["choice"], sim.addr.to_string(), "round {i}: {x}");
        for c in x["candidates"].as_array().unwrap() {
            assert_eq!(c["prefix_source"], "engine", "{c}");
        }
        for _ in 0..3 {
            assert_eq!(served_by(&b, &p).await, sim.addr.to_string(), "round {i}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_balancers_agree_on_the_engines_blocks_without_a_shared_store() {
    let a = Balancer::start(&[]).await;
    let b = Balancer::start(&[]).await;
    let both = format!("{},{}", a.management, b.management);
    let mut sims = Vec::new();
    let mut agents = Vec::new();
    for _ in 0..2 {
        let (sim, publisher, replay) = sim_with_events("positional");
        let also = ["--management-addr", both.as_str()];
        agents.push(events_agent(&sim, &a, &publisher, Some(&replay), &also));
        sims.push(sim);
    }
    a.wait_eligible(2).await;
    b.wait_eligible(2).await;
    // A prompt warmed on the second engine behind both balancers' backs:
    // both hold the same blocks for it, and both send it there.
    let p = prompt("shared by both", 6);
    warm(&sims[1], &p).await;
    for balancer in [&a, &b] {
        wait_for("both copies", Duration::from_secs(10), || async {
            (copy_of(balancer, &sims[1]).await >= 6).then_some(())
        })
        .await;
    }
    for balancer in [&a, &b, &a, &b] {
        assert_eq!(served_by(balancer, &p).await, sims[1].addr.to_string());
    }
}

/// Conversations whose turns a front spreads over two balancers, no store
/// shared between them, stay on the engine that holds them: a server joins
/// after their first turns (on the only one there was), and each next turn
/// that reaches the balancer that placed none of their turns goes where
/// the engines' events say the conversation is, not to its rendezvous
/// home (the new server for about half of them: six conversations would
/// all stay by chance one time in 64).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_spread_over_two_balancers_stay_where_their_engine_holds_them() {
    let a = Balancer::start(&[]).await;
    let b = Balancer::start(&[]).await;
    let both = format!("{},{}", a.management, b.management);
    let also = ["--management-addr", both.as_str()];
    let (first, publisher, replay) = sim_with_events("tagged");
    let _first_agent = events_agent(&first, &a, &publisher, Some(&replay), &also);
    a.wait_eligible(1).await;
    b.wait_eligible(1).await;
    let sessions: Vec<String> = (0..6).map(|i| format!("conversation-{i}")).collect();
    let mut bodies = Vec::new();
    for session in &sessions {
        let body = prompt(session, 6);
        assert_eq!(
            turn_via(&a, Some(session.as_str()), &body).await,
            first.addr.to_string()
        );
        bodies.push(body);
    }
    wait_for(
        "the other balancer's copy",
        Duration::from_secs(10),
        || async { (copy_of(&b, &first).await >= 36).then_some(()) },
    )
    .await;
    let (second, publisher, replay) = sim_with_events("tagged");
    let _second_agent = events_agent(&second, &a, &publisher, Some(&replay), &also);
    for balancer in [&a, &b] {
        balancer.wait_eligible(2).await;
        // Its slots are shared out: it takes requests (it would take a
        // turn sent to its rendezvous home).
        wait_for(
            "the new server's slots",
            Duration::from_secs(10),
            || async {
                let agents = balancer.agents().await;
                (n(&endpoint_of(&agents, &second)["free_slots"]) > 0).then_some(())
            },
        )
        .await;
    }
    for (turn, (via, then)) in [(&b, "and then?"), (&a, "go on")].into_iter().enumerate() {
        for (session, body) in sessions.iter().zip(&mut bodies) {
            let messages = body["messages"].as_array_mut().unwrap();
            messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
            messages.push(json!({"role": "user", "content": then}));
            let at = turn_via(via, Some(session.as_str()), body).await;
            assert_eq!(at, first.addr.to_string(), "{session}, turn {}", turn + 2);
        }
    }
}

/// A small byte-level BPE tokenizer with a ChatML template, written by
/// Hugging Face's own `tokenizers` (the tokenizer crate's golden files).
fn chatml_tokenizer() -> String {
    format!("{}/../tokenizer/golden/chatml", env!("CARGO_MANIFEST_DIR"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_balancers_own_tokenizer_matches_the_engines_blocks_without_asking_them() {
    let dir = chatml_tokenizer();
    let b = Balancer::start(&["--tokenizer", &format!("sim-model={dir}")]).await;
    // The engines count prompts in the same model's tokens.
    let (sims, _agents) = two_engines_with(&b, &["--tokenizer", &dir]).await;
    let mut p = prompt("counted by the balancer", 12);
    warm(&sims[1], &p).await;
    wait_for("the copy to show it", Duration::from_secs(10), || async {
        (copy_of(&b, &sims[1]).await >= 8).then_some(())
    })
    .await;
    for _ in 0..3 {
        assert_eq!(served_by(&b, &p).await, sims[1].addr.to_string());
    }
    // The conversation's next turn goes there too.
    let turns = p["messages"].as_array_mut().unwrap();
    turns.push(json!({"role": "assistant", "content": "a fox, quick"}));
    turns.push(json!({"role": "user", "content": "and the dog?"}));
    assert_eq!(served_by(&b, &p).await, sims[1].addr.to_string());
    let by = |by: &'static str, reason: &'static str| {
        let b = &b;
        async move {
            metric(
                b,
                "flowgate_prompt_tokenizations_total",
                &[("by", by), ("reason", reason)],
            )
            .await
        }
    };
    assert_eq!(by("tokenizer", "").await, 4.0);
    assert_eq!(by("engine", "field").await, 0.0);
    // A chat with tools is the engine's to render: its /tokenize is asked.
    p["tools"] = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    served_by(&b, &p).await;
    assert_eq!(by("engine", "field").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_that_cannot_be_read_stops_the_balancer_naming_the_model() {
    let (inference, management) = (free_port(), free_port());
    let out = std::process::Command::new(bin("balancer"))
        .args(["--tokenizer", "chat-model=/nonexistent/flowgate-model"])
        .args(["--inference-addr", &format!("127.0.0.1:{inference}")])
        .args(["--management-addr", &format!("127.0.0.1:{management}")])
        .output()
        .expect("run the balancer");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("chat-model") && err.contains("/nonexistent/flowgate-model/tokenizer.json"),
        "{err}"
    );
}
