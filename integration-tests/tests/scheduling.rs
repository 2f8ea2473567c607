//! Late binding as a client sees it: requests go only to servers of their
//! model (404 for a model nobody serves), conversations stay on the server
//! that holds their prefix (also when the fleet is full), failed attempts are retried elsewhere before the
//! client sees a byte, failing servers leave rotation and come back, and a
//! draining agent's server gets no new work while its requests finish.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// Requests the simulator received, tagged or not.
async fn received(sim: &Sim) -> u64 {
    sim.stats().await["requests_total"].as_u64().unwrap()
}

async fn arrivals(sim: &Sim) -> Vec<String> {
    sim.stats().await["arrivals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_only_to_servers_of_their_model() {
    let b = Balancer::start(&[]).await;
    let alpha = Sim::start(&["--model", "alpha", "--slots", "1"]);
    let beta = Sim::start(&["--model", "beta", "--slots", "2"]);
    let _aa = agent(&alpha, &b);
    let _ab = agent(&beta, &b);
    b.wait_eligible(2).await;
    let c = client();
    for i in 0..4 {
        for model in ["alpha", "beta"] {
            let tag = format!("{model}-{i}");
            let r = chat_with(&c, &b, &[("x-sim-tag", &tag)], chat_for(Some(model), "hi")).await;
            assert_eq!(r.status(), 200);
        }
    }
    assert!(arrivals(&alpha)
        .await
        .iter()
        .all(|t| t.starts_with("alpha")));
    assert!(arrivals(&beta).await.iter().all(|t| t.starts_with("beta")));
    assert_eq!(arrivals(&alpha).await.len(), 4);

    // A model nobody serves: 404, OpenAI style, naming the model.
    let r = chat_with(&c, &b, &[], chat_for(Some("gamma"), "hi")).await;
    let err = assert_openai_error(r, 404).await;
    assert_eq!(err["error"]["code"], "model_not_found");
    assert!(err["error"]["message"].as_str().unwrap().contains("gamma"));
    // No model named: any server.
    let r = chat_with(&c, &b, &[], chat_for(None, "hi")).await;
    assert_eq!(r.status(), 200);

    // A saturated model holds only its own requests: with alpha's one slot
    // busy and an alpha request queued, beta requests still go at once.
    let slow = [("x-sim-ttft-ms", "1500")];
    let c1 = c.clone();
    let url = b.url("/v1/chat/completions");
    let alpha_jobs: Vec<_> = (0..2)
        .map(|_| {
            let (c, url) = (c1.clone(), url.clone());
            tokio::spawn(async move {
                let mut req = c.post(url).json(&chat_for(Some("alpha"), "slow"));
                for (k, v) in slow {
                    req = req.header(k, v);
                }
                req.send().await.unwrap().status().as_u16()
            })
        })
        .collect();
    b.wait_buffered(1).await;
    let start = Instant::now();
    let r = chat_with(&c, &b, &[], chat_for(Some("beta"), "quick")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-flowgate-wait-ms"], "0");
    assert!(
        start.elapsed() < Duration::from_millis(1000),
        "beta waited {:?} behind alpha",
        start.elapsed()
    );
    for j in alpha_jobs {
        assert_eq!(j.await.unwrap(), 200);
    }
}

/// Holds `n` conversations at once, each of `turns` turns over its own long
/// system prompt, requests tagged `conv{i}`; every answer must be 200.
async fn converse(b: &Balancer, n: usize, turns: usize) {
    converse_with(b, 0..n, turns, false).await
}

/// [`converse`] with conversations `ids` (each its own system prompt and
/// tag), streamed answers or not.
async fn converse_with(b: &Balancer, ids: std::ops::Range<usize>, turns: usize, stream: bool) {
    let c = client();
    let conversations: Vec<_> = ids
        .map(|i| {
            let c = c.clone();
            let url = b.url("/v1/chat/completions");
            tokio::spawn(async move {
                let system = format!("You are assistant number {i}. ").repeat(60);
                let mut messages = vec![json!({"role": "system", "content": system})];
                for turn in 0..turns {
                    messages.push(json!({"role": "user", "content": format!("question {turn}")}));
                    let r = c
                        .post(&url)
                        .header("x-sim-tag", format!("conv{i}"))
                        .json(&json!({
                            "model": "sim-model",
                            "messages": messages,
                            "stream": stream,
                            "stream_options": {"include_usage": stream},
                        }))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200);
                    r.bytes().await.unwrap();
                    messages.push(json!({"role": "assistant", "content": "answer"}));
                }
            })
        })
        .collect();
    for conv in conversations {
        conv.await.unwrap();
    }
}

/// Every conversation's turns all reached one server.
fn assert_conversations_whole(per_sim: &[Vec<String>], n: usize, turns: usize) {
    for i in 0..n {
        let tag = format!("conv{i}");
        let counts: Vec<usize> = per_sim
            .iter()
            .map(|a| a.iter().filter(|t| **t == tag).count())
            .collect();
        assert!(
            counts.contains(&turns) && counts.iter().sum::<usize>() == turns,
            "conversation {i} was split: {counts:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_stay_on_the_server_that_holds_their_prefix() {
    let b = Balancer::start(&["--max-buffered-requests", "100"]).await;
    let sims = [
        Sim::start(&["--slots", "4", "--ttft-ms", "100"]),
        Sim::start(&["--slots", "4", "--ttft-ms", "100"]),
    ];
    let _agents: Vec<_> = sims.iter().map(|s| agent(s, &b)).collect();
    b.wait_eligible(2).await;
    // Six conversations, each with its own long system prompt; their first
    // turns arrive together, so free slots spread them over both servers.
    converse(&b, 6, 4).await;
    let per_sim = [arrivals(&sims[0]).await, arrivals(&sims[1]).await];
    assert_conversations_whole(&per_sim, 6, 4);
    assert!(
        per_sim.iter().all(|a| !a.is_empty()),
        "affinity made a hot spot: {per_sim:?}"
    );
    let agents = b.agents().await;
    assert!(agents["endpoints"][0]["prefix_blocks"].as_u64().unwrap() > 0);
    let c = client();

    // Prompts that share nothing are balanced by load.
    for s in &sims {
        client()
            .post(format!("http://{}/sim/reset", s.addr))
            .send()
            .await
            .unwrap();
    }
    let jobs: Vec<_> = (0..40)
        .map(|i| {
            let c = c.clone();
            let url = b.url("/v1/chat/completions");
            tokio::spawn(async move {
                let body = chat_for(Some("sim-model"), &format!("{i} unique ").repeat(40));
                let r = c
                    .post(&url)
                    .header("x-sim-tag", "u")
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                r.status().as_u16()
            })
        })
        .collect();
    for j in jobs {
        assert_eq!(j.await.unwrap(), 200);
    }
    let first = arrivals(&sims[0]).await.len();
    assert!(
        (12..=28).contains(&first),
        "unbalanced without shared prefixes: {first} of 40 on one server"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_saturation_conversations_wait_for_their_own_server_when_prefill_is_slow() {
    // Default settings. A slow prefill (1 ms per uncached token, as a CPU
    // engine): prefilling a conversation's ~500 tokens elsewhere costs
    // ~0.5 s, waiting for its own server's slot about a cached turn's
    // ~50 ms per request before it.
    let b = Balancer::start(&["--max-buffered-requests", "100"]).await;
    let slow = [
        "--slots",
        "2",
        "--ttft-ms",
        "40",
        "--prefill-us-per-token",
        "1000",
        "--prefix-cache-tokens",
        "100000",
    ];
    let sims = [Sim::start(&slow), Sim::start(&slow)];
    let _agents: Vec<_> = sims.iter().map(|s| agent(s, &b)).collect();
    b.wait_eligible(2).await;
    // A few other conversations first: the engines' service times are
    // learned (until then a slot is assumed to take a second).
    converse_with(&b, 100..104, 6, false).await;
    // Six conversations on four slots: some turns always wait in the
    // balancer, and whenever a slot frees on the other server they are
    // passed over for it (held) rather than moved away from their cache.
    converse(&b, 6, 5).await;
    let per_sim = [arrivals(&sims[0]).await, arrivals(&sims[1]).await];
    assert_conversations_whole(&per_sim, 6, 5);
    let holds = metric(&b, "flowgate_affinity_holds_total", &[]).await;
    assert!(holds >= 1.0, "no request was ever held: {per_sim:?}");
    assert_eq!(b.buffered().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_saturation_turns_take_any_free_server_when_prefill_is_fast() {
    // Default settings. A fast prefill (1 µs per token, learned from the
    // streamed answers' first bytes) and long answers (~200 ms a slot):
    // prefilling a conversation again elsewhere is cheaper than any wait,
    // so no turn is ever held for its server.
    let b = Balancer::start(&["--max-buffered-requests", "100"]).await;
    let fast = [
        "--slots",
        "2",
        "--ttft-ms",
        "2",
        "--tpot-ms",
        "10",
        "--output-tokens",
        "20",
        "--prefill-us-per-token",
        "1",
        "--prefix-cache-tokens",
        "100000",
    ];
    let sims = [Sim::start(&fast), Sim::start(&fast)];
    let _agents: Vec<_> = sims.iter().map(|s| agent(s, &b)).collect();
    b.wait_eligible(2).await;
    // A few conversations first (four on four slots: both servers see
    // cold prompts): the engines' costs are learned.
    converse_with(&b, 100..104, 2, true).await;
    let costs = b.agents().await;
    for e in costs["endpoints"].as_array().unwrap() {
        let prefill = e["cost"]["prefill_ms_per_token"].as_f64().unwrap();
        assert!(prefill < 0.2, "prefill not learned: {e}");
    }
    converse_with(&b, 0..6, 5, true).await;
    let holds = metric(&b, "flowgate_affinity_holds_total", &[]).await;
    assert_eq!(holds, 0.0, "a turn waited although a prefill was cheaper");
    assert!(
        !arrivals(&sims[0]).await.is_empty() && !arrivals(&sims[1]).await.is_empty(),
        "both servers serve"
    );
    assert_eq!(b.buffered().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_attempts_are_retried_elsewhere_and_failing_servers_leave_rotation() {
    let config =
        ConfigFile::new("scheduling:\n  circuitBreaker:\n    failures: 3\n    backoff: 1s\n");
    let b = Balancer::start(&["--config", config.arg()]).await;
    let bad = Sim::start(&["--fault", "status=500"]);
    let good = Sim::start(&[]);
    let _ab = agent(&bad, &b);
    let _ag = agent(&good, &b);
    b.wait_eligible(2).await;
    let c = client();
    // Until its circuit opens, the failing server gets about half of the
    // requests; each is retried on the good one before the client sees it.
    let mut sent = 0;
    while endpoint_of(&b.agents().await, &bad)["circuit_open_ms"].is_null() {
        let tag = format!("r{sent}");
        let r = chat_with(
            &c,
            &b,
            &[("x-sim-tag", &tag)],
            chat_for(Some("sim-model"), &tag),
        )
        .await;
        assert_eq!(r.status(), 200, "a retried request answered {}", r.status());
        sent += 1;
        assert!(sent < 60, "the circuit never opened");
    }
    assert_eq!(received(&bad).await, 3, "three failures open the circuit");
    assert_eq!(
        metric(
            &b,
            "flowgate_upstream_retries_total",
            &[("reason", "status-5xx")]
        )
        .await,
        3.0
    );
    assert_eq!(
        arrivals(&good).await.len(),
        sent,
        "every request ended on the good server"
    );
    // Out of rotation: nothing reaches it while the circuit is open.
    for i in 0..5 {
        let r = chat_with(&c, &b, &[], chat_for(None, &format!("open {i}"))).await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(received(&bad).await, 3);
    // It comes back on its own after the back-off; failing again at once
    // opens the circuit for twice as long.
    wait_for("the circuit to close", Duration::from_secs(3), || async {
        endpoint_of(&b.agents().await, &bad)["circuit_open_ms"]
            .is_null()
            .then_some(())
    })
    .await;
    let mut tries = 0;
    while received(&bad).await == 3 {
        let r = chat_with(&c, &b, &[], chat_for(None, &format!("back {tries}"))).await;
        assert_eq!(r.status(), 200);
        tries += 1;
        assert!(tries < 40, "the endpoint never came back");
    }
    let open_ms = endpoint_of(&b.agents().await, &bad)["circuit_open_ms"].as_u64();
    assert!(
        open_ms.is_some_and(|ms| ms > 1000),
        "reopened for {open_ms:?} ms"
    );
    assert!(metric(&b, "flowgate_circuit_breaker_opened_total", &[]).await >= 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_failures_are_retried_elsewhere() {
    let b = Balancer::start(&[]).await;
    let good = Sim::start(&[]);
    let _ag = agent(&good, &b);
    // A server that registered and then died: nothing listens on its port.
    let dead = format!("127.0.0.1:{}", free_port());
    let reporter = {
        let url = b.mgmt("/api/v1/agents/ghost/report");
        let dead = dead.clone();
        tokio::spawn(async move {
            let c = client();
            loop {
                let report = json!({"protocol_version": 1, "agent_id": "ghost", "name": "ghost",
                    "backend": "llamacpp", "external_addr": dead, "models": ["sim-model"],
                    "health": "ready", "slots_total": 4, "slots_busy": 0,
                    "monitoring_interval_ms": 100});
                let _ = c.post(&url).json(&report).send().await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    b.wait_eligible(2).await;
    let c = client();
    for i in 0..20 {
        let r = chat_with(&c, &b, &[], chat_for(Some("sim-model"), &format!("c{i}"))).await;
        assert_eq!(r.status(), 200);
    }
    let retried = metric(
        &b,
        "flowgate_upstream_retries_total",
        &[("reason", "connect")],
    )
    .await;
    assert!((1.0..=3.0).contains(&retried), "{retried} connect retries");
    reporter.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_errors_pass_through_and_a_lone_failing_server_answers_itself() {
    let config =
        ConfigFile::new("scheduling:\n  circuitBreaker:\n    failures: 2\n    backoff: 1s\n");
    let b = Balancer::start(&["--config", config.arg()]).await;
    let sim = Sim::start(&[]);
    let _a = agent(&sim, &b);
    b.wait_eligible(1).await;
    let c = client();
    // 4xx is the client's problem: passed through, never a breaker failure.
    for _ in 0..4 {
        let r = chat(&b, &[("x-sim-fault", "status=400")]).await;
        assert_eq!(r.status(), 400);
    }
    let ep = endpoint_of(&b.agents().await, &sim).clone();
    assert_eq!(ep["consecutive_failures"], 0, "{ep}");
    // With nowhere else to go, a 5xx reaches the client as it is.
    for _ in 0..2 {
        let r = chat(&b, &[("x-sim-fault", "status=503")]).await;
        assert_eq!(r.status(), 503);
    }
    assert!(!endpoint_of(&b.agents().await, &sim)["circuit_open_ms"].is_null());
    // While the circuit is open, requests wait for it instead of failing.
    let r = chat_with(&c, &b, &[], chat_for(None, "after")).await;
    assert_eq!(r.status(), 200);
    let waited: u64 = r.headers()["x-flowgate-wait-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(waited >= 300, "waited {waited} ms for the circuit");
    assert_eq!(
        metric(&b, "flowgate_upstream_retries_total", &[]).await,
        0.0,
        "nothing to retry on"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_agent_gets_no_new_work_and_leaves_when_its_requests_finish() {
    let b = Balancer::start(&[]).await;
    let leaving = Sim::start(&["--slots", "4"]);
    let staying = Sim::start(&["--slots", "4"]);
    let mut agent_leaving = agent(&leaving, &b);
    let _agent_staying = agent(&staying, &b);
    b.wait_eligible(2).await;
    // Two long requests at once: one lands on each server.
    let long: Vec<_> = (0..2)
        .map(|_| spawn_chat(&b, &[("x-sim-ttft-ms", "2000"), ("x-sim-tag", "long")]))
        .collect();
    wait_for(
        "a long request on the leaving server",
        Duration::from_secs(5),
        || async { (leaving.stats().await["processing"] == 1).then_some(()) },
    )
    .await;
    agent_leaving.signal("TERM");
    wait_for("the endpoint to drain", Duration::from_secs(5), || async {
        (endpoint_of(&b.agents().await, &leaving)["agent"]["draining"] == true).then_some(())
    })
    .await;
    let c = client();
    for i in 0..6 {
        let r = chat_with(
            &c,
            &b,
            &[("x-sim-tag", "new")],
            chat_for(None, &format!("d{i}")),
        )
        .await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(
        arrivals(&leaving).await,
        ["long"],
        "new work went to a draining server"
    );
    assert!(
        agent_leaving
            .wait_exit(Duration::from_millis(300))
            .is_none(),
        "the agent left before its request finished"
    );
    for l in long {
        assert_eq!(l.await.unwrap(), 200);
    }
    let status = agent_leaving
        .wait_exit(Duration::from_secs(5))
        .expect("the agent exits once drained");
    assert!(status.success(), "{status:?}");
    wait_for(
        "the endpoint to be forgotten",
        Duration::from_secs(5),
        || async { (b.agents().await["endpoints"].as_array().unwrap().len() == 1).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn affinity_lands_follow_up_turns_on_a_warm_prefix_cache() {
    let b = Balancer::start(&[]).await;
    // 200 µs of prefill per uncached token: a 1,000-token prompt costs
    // 200 ms cold and next to nothing when its prefix is cached.
    let sim_args = [
        "--prefix-cache-tokens",
        "100000",
        "--prefill-us-per-token",
        "200",
        "--ttft-ms",
        "5",
    ];
    let sims = [Sim::start(&sim_args), Sim::start(&sim_args)];
    let _agents: Vec<_> = sims.iter().map(|s| agent(s, &b)).collect();
    b.wait_eligible(2).await;
    let c = client();
    let system = "Answer briefly and cite your sources. ".repeat(110);
    let mut messages = vec![json!({"role": "system", "content": system})];
    let mut latencies = Vec::new();
    let mut cached = Vec::new();
    for turn in 0..4 {
        messages.push(json!({"role": "user", "content": format!("question {turn}")}));
        let start = Instant::now();
        let r = c
            .post(b.url("/v1/chat/completions"))
            .json(&json!({"model": "sim-model", "messages": messages}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        cached.push(
            r.headers()["x-sim-cached-tokens"]
                .to_str()
                .unwrap()
                .parse::<u64>()
                .unwrap(),
        );
        r.bytes().await.unwrap();
        latencies.push(start.elapsed());
        messages.push(json!({"role": "assistant", "content": "ok"}));
    }
    assert_eq!(cached[0], 0, "{cached:?}");
    assert!(cached[1..].iter().all(|&t| t >= 1_000), "{cached:?}");
    let cold = latencies[0].as_secs_f64();
    let warm = latencies[1..]
        .iter()
        .map(Duration::as_secs_f64)
        .fold(0.0, f64::max);
    assert!(
        warm / cold < 0.6,
        "warm turns took {warm:.3} s vs {cold:.3} s cold"
    );
}

/// A fleet of 60 simulated servers in one process, each reported to the
/// balancer by the simulator itself as its agent would: all become
/// eligible, and one client sending requests one after another is spread
/// over all of them (equal endpoints take turns), each answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_in_one_process_is_reported_and_shares_the_load() {
    const SERVERS: usize = 60;
    let b = Balancer::start(&[]).await;
    let mgmt = format!("http://{}", b.management);
    let (_fleet, addrs) = Sim::start_fleet(
        SERVERS,
        &[
            "--slots",
            "2",
            "--ttft-ms",
            "0",
            "--tpot-ms",
            "0",
            "--report-to",
            &mgmt,
            "--report-interval-ms",
            "200",
        ],
    );
    b.wait_eligible(SERVERS).await;
    let c = client();
    for i in 0..3 * SERVERS {
        // Prompts that share nothing: no prefix affinity, only load.
        let resp = c
            .post(b.url("/v1/chat/completions"))
            .json(&chat_for(None, &format!("question number {i}")))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.bytes().await.unwrap();
    }
    let mut idle = Vec::new();
    for a in &addrs {
        let stats = get_json(&format!("http://{a}/sim/stats")).await;
        if stats["requests_total"] == 0 {
            idle.push(*a);
        }
    }
    assert!(idle.is_empty(), "servers that got nothing: {idle:?}");
}
