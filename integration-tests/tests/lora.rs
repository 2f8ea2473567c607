//! LoRA adapters: requests naming an adapter go where it is loaded, a hot
//! adapter spreads, a server that drops one stops getting its requests
//! first, and an adapter no server serves gets a 404 naming what is
//! served. Three vLLM-speaking llm-sims with eight adapters, two loaded
//! at once.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const ADAPTERS: &str = "a1,a2,a3,a4,a5,a6,a7,a8";

struct Fleet {
    b: Balancer,
    sims: Vec<Sim>,
    _agents: Vec<Proc>,
}

/// Three servers of `slots` slots, two adapters loaded at once, a load
/// taking 300 ms; their agents report every 100 ms.
async fn fleet_of_three(slots: &str, ttft_ms: &str) -> Fleet {
    let b = Balancer::start(&[]).await;
    let sims: Vec<Sim> = (0..3)
        .map(|_| {
            Sim::start(&[
                "--engine",
                "vllm",
                "--slots",
                slots,
                "--lora",
                ADAPTERS,
                "--max-loras",
                "2",
                "--lora-load-ms",
                "300",
                "--ttft-ms",
                ttft_ms,
            ])
        })
        .collect();
    let agents = sims
        .iter()
        .map(|s| {
            agent_at(
                &s.addr.to_string(),
                &b,
                &["--backend", "vllm", "--max-concurrency", slots],
            )
        })
        .collect();
    b.wait_eligible(3).await;
    Fleet {
        b,
        sims,
        _agents: agents,
    }
}

impl Fleet {
    /// Serves a request for `adapter` on `server` directly (the balancer
    /// not involved), so that it loads there, and waits until the
    /// balancer's report of that server shows it loaded.
    async fn load_directly(&self, server: usize, adapter: &str) {
        let sim = &self.sims[server];
        let r = client()
            .post(format!("http://{}/v1/chat/completions", sim.addr))
            .json(&chat_for(Some(adapter), "warm"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        self.wait_reported(server, |a| {
            a["loaded"]
                .as_array()
                .is_some_and(|l| l.iter().any(|n| n == adapter))
        })
        .await;
    }

    /// Waits until the report of `server` says what `ok` wants of its
    /// adapters.
    async fn wait_reported(&self, server: usize, ok: impl Fn(&Value) -> bool) {
        let sim = &self.sims[server];
        wait_for(
            "the server's adapters reported",
            Duration::from_secs(5),
            || async {
                let agents = self.b.agents().await;
                ok(&endpoint_of(&agents, sim)["agent"]["adapters"]).then_some(())
            },
        )
        .await;
    }

    async fn loads(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for s in &self.sims {
            out.push(s.stats().await["lora_loads"].as_u64().unwrap());
        }
        out
    }

    /// Sends `n` requests for `adapter` at once (each prompt its own) and
    /// asserts every one is answered 200.
    async fn all_answered(&self, adapter: &str, n: usize) {
        let chats: Vec<_> = (0..n)
            .map(|i| {
                let c = client();
                let url = self.b.url("/v1/chat/completions");
                let body = chat_for(Some(adapter), &format!("{adapter} {i}"));
                tokio::spawn(async move {
                    let r = c.post(url).json(&body).send().await.unwrap();
                    let status = r.status();
                    let reason = r.headers().get("x-flowgate-drop-reason").cloned();
                    (
                        status,
                        format!("{reason:?} {}", r.text().await.unwrap_or_default()),
                    )
                })
            })
            .collect();
        for c in chats {
            let (status, why) = c.await.unwrap();
            assert_eq!(status, 200, "{why}");
        }
    }

    async fn chat(&self, adapter: &str) -> reqwest::Response {
        client()
            .post(self.b.url("/v1/chat/completions"))
            .json(&chat_for(Some(adapter), "hello"))
            .send()
            .await
            .unwrap()
    }
}

/// Requests for an adapter loaded on one server go there, one after
/// another, and load it nowhere else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_requests_go_where_it_is_loaded() {
    let f = fleet_of_three("4", "20").await;
    f.load_directly(1, "a3").await;
    assert_eq!(f.loads().await, [0, 1, 0]);
    for _ in 0..10 {
        let r = f.chat("a3").await;
        assert_eq!(r.status(), 200);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["model"], "a3");
    }
    assert_eq!(f.loads().await, [0, 1, 0], "no other server loaded it");
    assert_eq!(
        f.sims[1].stats().await["requests_total"],
        11,
        "every request went where it was loaded"
    );
    // The scores say why.
    let x = post_json(
        &f.b.mgmt("/api/v1/route/probe"),
        &chat_for(Some("a3"), "why"),
    )
    .await;
    let best = &x["explanation"]["candidates"][0];
    assert_eq!(best["addr"], f.sims[1].addr.to_string(), "{x}");
    assert!(best["terms"]["adapter"].as_f64().unwrap() >= 3.2, "{x}");
}

/// Many requests at once for one adapter loaded on one server: its queue
/// soon costs more than a load, and the adapter spreads to another
/// server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_adapter_spreads() {
    let f = fleet_of_three("2", "400").await;
    f.load_directly(0, "a1").await;
    f.all_answered("a1", 24).await;
    let loads = f.loads().await;
    let serving = loads.iter().filter(|&&n| n > 0).count();
    assert!(serving >= 2, "the hot adapter spread: loads {loads:?}");
    // But not load after load: each server loaded it once.
    assert!(loads.iter().all(|&n| n <= 1), "loads {loads:?}");
    // Each agent saw its server's load (its polls began before any), and
    // the balancer shows them.
    let total: u64 = loads.iter().sum();
    wait_for("the loads in /metrics", Duration::from_secs(5), || async {
        let seen = metric(&f.b, "flowgate_endpoint_adapter_loads", &[]).await;
        let loaded = metric(&f.b, "flowgate_endpoint_adapters_loaded", &[]).await;
        (seen == total as f64 && loaded == total as f64).then_some(())
    })
    .await;
}

/// A server that evicts an adapter stops getting its requests first:
/// they go to the server that holds it now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_drops_an_adapter_stops_getting_its_requests_first() {
    let f = fleet_of_three("4", "20").await;
    f.load_directly(0, "a5").await;
    let r = f.chat("a5").await;
    assert_eq!(r.status(), 200);
    assert_eq!(f.sims[0].stats().await["requests_total"], 2);
    // Server 0 loads two others (two at most: a5 is evicted); server 2
    // loads a5.
    f.load_directly(0, "a6").await;
    f.load_directly(0, "a7").await;
    f.wait_reported(0, |a| {
        a["loaded"]
            .as_array()
            .is_some_and(|l| !l.iter().any(|n| n == "a5"))
    })
    .await;
    f.load_directly(2, "a5").await;
    let before = f.sims[2].stats().await["requests_total"].as_u64().unwrap();
    for _ in 0..3 {
        assert_eq!(f.chat("a5").await.status(), 200);
    }
    assert_eq!(
        f.sims[2].stats().await["requests_total"].as_u64().unwrap(),
        before + 3,
        "where it is loaded now"
    );
    assert_eq!(f.loads().await, [3, 0, 1], "no load for them");
}

/// An adapter no server serves: 404, naming what is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_no_server_serves_is_a_404_naming_what_is() {
    let f = fleet_of_three("2", "20").await;
    let r = f.chat("no-such-adapter").await;
    let body = assert_openai_error(r, 404).await;
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("no-such-adapter"), "{message}");
    assert!(message.contains("a1"), "names what is served: {message}");
    assert_eq!(body["error"]["code"], json!("model_not_found"));
}

/// Three servers of `slots` slots, the first serving `served` (the
/// others nothing), whose agents may load `name` from `path` when a
/// balancer asks.
async fn loadable_fleet(name: &str, path: &str, served: &str, slots: &str, more: &[&str]) -> Fleet {
    let b = Balancer::start(&["--max-buffered-requests", "100"]).await;
    let sims: Vec<Sim> = (0..3)
        .map(|i| {
            let mut args = vec![
                "--engine",
                "vllm",
                "--slots",
                slots,
                "--max-loras",
                "2",
                "--lora-load-ms",
                "100",
            ];
            args.extend_from_slice(more);
            if i == 0 && !served.is_empty() {
                args.extend(["--lora", served]);
            }
            Sim::start(&args)
        })
        .collect();
    let adapter = format!("{name}={path}");
    let agents = sims
        .iter()
        .map(|s| {
            agent_at(
                &s.addr.to_string(),
                &b,
                &[
                    "--backend",
                    "vllm",
                    "--max-concurrency",
                    slots,
                    "--lora-adapter",
                    &adapter,
                ],
            )
        })
        .collect();
    b.wait_eligible(3).await;
    Fleet {
        b,
        sims,
        _agents: agents,
    }
}

/// Fifty requests at once for an adapter no server serves, which the
/// agents may load: it is loaded once, on one server, and every request
/// is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_opt_in_load_happens_once_under_50_concurrent_first_requests() {
    let dir = TempDir::new("lora-opt-in");
    std::fs::create_dir_all(dir.0.join("fresh")).unwrap();
    // Quick answers: the queue drains sooner than a second load would.
    let quick = ["--ttft-ms", "5", "--tpot-ms", "1", "--output-tokens", "4"];
    let f = loadable_fleet("fresh", &dir.path("fresh"), "", "4", &quick).await;
    f.all_answered("fresh", 50).await;
    let mut registered = Vec::new();
    for s in &f.sims {
        registered.push(s.stats().await["lora_registrations"].as_u64().unwrap());
    }
    assert_eq!(
        registered.iter().sum::<u64>(),
        1,
        "loaded once: {registered:?}"
    );
}

/// A load that fails is a clear error: the request waiting for it, and
/// later ones at once, are refused with 502 naming the adapter (long
/// before the waiting one's TTL); the agent does not try again in a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_is_a_clear_error_not_a_loop() {
    let f = loadable_fleet("broken", "/nonexistent/flowgate-adapter", "", "4", &[]).await;
    let first = client()
        .post(f.b.url("/v1/chat/completions"))
        .header("x-flowgate-request-ttl", "30s")
        .json(&chat_for(Some("broken"), "first"))
        .send()
        .await
        .unwrap();
    let body = assert_openai_error(first, 502).await;
    assert_eq!(body["error"]["code"], "adapter_load_failed");
    wait_for(
        "every agent to report the failure",
        Duration::from_secs(5),
        || async {
            let agents = f.b.agents().await;
            let failed = agents["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| {
                    e["agent"]["adapters"]["load_failed"][0]["name"] == "broken"
                        || e["agent"]["adapters"]["loadable"][0] != "broken"
                })
                .count();
            (failed == 3).then_some(())
        },
    )
    .await;
    let r = f.chat("broken").await;
    let body = assert_openai_error(r, 502).await;
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("broken"), "{message}");
    assert_eq!(body["error"]["code"], "adapter_load_failed");
    let agents = f.b.agents().await;
    let error = agents["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|e| e["agent"]["adapters"]["load_failed"][0]["error"].as_str())
        .unwrap()
        .to_string();
    assert!(
        error.contains("No adapter found"),
        "the engine's word: {error}"
    );
    for s in &f.sims {
        assert_eq!(s.stats().await["lora_registrations"], 0);
    }
}

/// An adapter one server serves, busy with a long queue for it: the queue
/// costs more than a load, so another server whose agent may load it is
/// asked to, and serves some of its requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_adapter_is_loaded_on_another_server_when_its_queue_costs_more_than_a_load() {
    let dir = TempDir::new("lora-spread");
    std::fs::create_dir_all(dir.0.join("hot")).unwrap();
    let f = loadable_fleet("hot", &dir.path("hot"), "hot", "2", &["--ttft-ms", "300"]).await;
    f.all_answered("hot", 24).await;
    let mut served_elsewhere = 0;
    let mut registered = 0;
    for s in &f.sims[1..] {
        let stats = s.stats().await;
        served_elsewhere += stats["requests_total"].as_u64().unwrap();
        registered += stats["lora_registrations"].as_u64().unwrap();
    }
    assert!(registered >= 1, "loaded on another server");
    assert!(served_elsewhere >= 1, "which served some of the queue");
    assert_eq!(
        f.sims[0].stats().await["lora_registrations"],
        0,
        "it had it"
    );
}
