//! Against the real llama.cpp `llama-server` with the tiny SmolLM2 model
//! (built and fetched by scripts/setup; scripts/test exports their paths in
//! FLOWGATE_LLAMA_SERVER and FLOWGATE_MODEL).

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

fn required_path(var: &str) -> PathBuf {
    let p = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        panic!("{var} is not set: run the tests with scripts/test, which builds llama-server and fetches the model")
    });
    assert!(
        p.exists(),
        "{var}={} does not exist: run scripts/setup",
        p.display()
    );
    p
}

struct Llama {
    proc: Proc,
    addr: String,
}

impl Llama {
    /// Starts llama-server with `slots` parallel slots, one thread.
    async fn start(slots: u32) -> Llama {
        Self::start_with(slots, &[]).await
    }

    /// [`Llama::start`] with more llama-server arguments.
    async fn start_with(slots: u32, extra: &[&str]) -> Llama {
        let port = free_port();
        let args: Vec<String> = [
            "-m",
            required_path("FLOWGATE_MODEL").to_str().unwrap(),
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--metrics",
            "-np",
            &slots.to_string(),
            "-c",
            &(1024 * slots).to_string(),
            "-t",
            "1",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
        let child = std::process::Command::new(required_path("FLOWGATE_LLAMA_SERVER"))
            .args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn llama-server");
        let l = Llama {
            proc: Proc {
                child,
                name: "llama-server",
            },
            addr: format!("127.0.0.1:{port}"),
        };
        let c = client();
        let url = format!("http://{}/health", l.addr);
        wait_for(
            "llama-server to load the model",
            Duration::from_secs(60),
            || {
                let c = c.clone();
                let url = url.clone();
                async move {
                    c.get(url)
                        .send()
                        .await
                        .ok()?
                        .status()
                        .is_success()
                        .then_some(())
                }
            },
        )
        .await;
        l
    }
}

/// `llamacpp:requests_deferred` of the llama-server at `addr`.
async fn deferred(c: &reqwest::Client, addr: &str) -> Option<u64> {
    {
        let text = c
            .get(format!("http://{addr}/metrics"))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("llamacpp:requests_deferred "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map(|v| v as u64)
    }
}

fn chat_req(content: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_llama_server_end_to_end() {
    let b = Balancer::start(&[]).await;
    let l1 = Llama::start(2).await;
    let l2 = Llama::start(2).await;
    let _a1 = agent_at(&l1.addr, &b, &[]);
    let _a2 = agent_at(&l2.addr, &b, &[]);
    b.wait_eligible(2).await;
    let c = client();

    // The agent reports the real slot count and model.
    let agents = b.agents().await;
    for e in agents["endpoints"].as_array().unwrap() {
        assert_eq!(e["agent"]["slots_total"], 2, "{e}");
        // `-c 2048` over 2 slots: the KV cache holds 2,048 tokens in all.
        assert_eq!(e["agent"]["kv_capacity_tokens"], 2048, "{e}");
        assert_eq!(e["agent"]["health"], "ready");
    }
    let models = get_json(&b.url("/v1/models")).await;
    let model = models["data"][0]["id"].as_str().unwrap().to_string();
    assert!(model.contains("SmolLM2"), "{models}");

    // Chat.
    let r = post_json(
        &b.url("/v1/chat/completions"),
        &chat_req("Name a colour.", 16, false),
    )
    .await;
    let answer = r["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!answer.trim().is_empty(), "{r}");
    assert!(r["usage"]["completion_tokens"].as_u64().unwrap() > 0);

    // Streamed chat: several SSE events, then [DONE].
    let resp = c
        .post(b.url("/v1/chat/completions"))
        .json(&chat_req("Count to five.", 16, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut text = String::new();
    let mut chunks = 0;
    let mut s = resp.bytes_stream();
    while let Some(chunk) = s.next().await {
        chunks += 1;
        text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    assert!(text.matches("data: {").count() >= 3, "{text}");
    assert!(chunks >= 2, "the stream arrived in one piece: not streamed");
    assert!(text.trim_end().ends_with("data: [DONE]"));

    // Completions.
    let r = post_json(
        &b.url("/v1/completions"),
        &json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
    )
    .await;
    assert!(r["choices"][0]["text"].is_string(), "{r}");

    // More concurrent requests than slots: the extra ones wait in the
    // balancer, never inside llama-server.
    let max_deferred = Arc::new(AtomicU64::new(0));
    let max_buffered = Arc::new(AtomicU64::new(0));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (max_deferred, max_buffered, done) = (
            Arc::clone(&max_deferred),
            Arc::clone(&max_buffered),
            Arc::clone(&done),
        );
        let addrs = [l1.addr.clone(), l2.addr.clone()];
        let mgmt = b.mgmt("/api/v1/agents");
        tokio::spawn(async move {
            let c = client();
            while !done.load(Ordering::SeqCst) {
                for addr in &addrs {
                    if let Some(d) = deferred(&c, addr).await {
                        max_deferred.fetch_max(d, Ordering::SeqCst);
                    }
                }
                if let Ok(r) = c.get(&mgmt).send().await {
                    if let Ok(v) = r.json::<Value>().await {
                        let n = v["buffered_requests"].as_u64().unwrap_or(0);
                        max_buffered.fetch_max(n, Ordering::SeqCst);
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let c = c.clone();
            let url = b.url("/v1/chat/completions");
            tokio::spawn(async move {
                let body = chat_req(&format!("Tell me about the number {i}."), 24, false);
                c.post(url)
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    done.store(true, Ordering::SeqCst);
    watcher.await.unwrap();
    assert_eq!(
        max_deferred.load(Ordering::SeqCst),
        0,
        "llama-server queued requests itself"
    );
    assert!(
        max_buffered.load(Ordering::SeqCst) > 0,
        "the extra requests waited in the balancer"
    );
    b.wait_in_flight(0, Duration::from_secs(5)).await;

    // Kill one server mid-run: the balancer stops routing to it within the
    // staleness window and the other server serves the rest.
    let mut l1 = l1;
    l1.proc.child.kill().unwrap();
    let killed = Instant::now();
    b.wait_eligible(1).await;
    assert!(
        killed.elapsed() < Duration::from_millis(1500),
        "noticed after {:?}",
        killed.elapsed()
    );
    for i in 0..4 {
        let r = c
            .post(b.url("/v1/chat/completions"))
            .json(&chat_req(&format!("Say {i}."), 8, false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let agents = b.agents().await;
    let survivor = agents["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["eligible"] == true)
        .unwrap();
    assert_eq!(survivor["addr"].as_str().unwrap(), l2.addr);
}

/// The highest `llamacpp:requests_deferred` the servers at `addrs` show
/// while polled, every 10 ms until `done`.
fn watch_deferred(
    addrs: Vec<String>,
    done: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let c = client();
        let mut peak = 0;
        while !done.load(Ordering::SeqCst) {
            for addr in &addrs {
                peak = peak.max(deferred(&c, addr).await.unwrap_or(0));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        peak
    })
}

/// Two balancers, two real llama-servers whose agents report to both and
/// divide their slots: five times what the four slots take, sent to both
/// balancers at once, never makes a llama-server queue a request (with
/// `--share-slots false` they queue 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_balancers_never_overcommit_real_llama_servers() {
    let one = Balancer::start(&["--max-buffered-requests", "100"]).await;
    let two = Balancer::start(&["--max-buffered-requests", "100"]).await;
    let l1 = Llama::start(2).await;
    let l2 = Llama::start(2).await;
    let _agents = agents_for_both([&l1.addr, &l2.addr], &one, &two, &[]).await;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = watch_deferred(vec![l1.addr.clone(), l2.addr.clone()], Arc::clone(&done));
    let c = client();
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let c = c.clone();
            let url = if i % 2 == 0 { &one } else { &two }.url("/v1/chat/completions");
            tokio::spawn(async move {
                let body = chat_req(&format!("Tell me about the number {i}."), 16, false);
                let r = c.post(url).json(&body).send().await.unwrap();
                r.status().as_u16()
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    done.store(true, Ordering::SeqCst);
    assert_eq!(
        watcher.await.unwrap(),
        0,
        "a llama-server queued requests itself: the balancers over-committed it"
    );
}

/// What the real llama-server does with a client's mistakes and with a
/// client that leaves: its 500s for a bad request are the request's, never
/// the server's, and a non-streamed answer it goes on computing after the
/// client left keeps the slot busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_llama_server_client_mistakes_and_departures() {
    let b = Balancer::start(&["--buffered-request-timeout", "30000"]).await;
    let l1 = Llama::start(1).await;
    let l2 = Llama::start(1).await;
    let _a1 = agent_at(&l1.addr, &b, &[]);
    let _a2 = agent_at(&l2.addr, &b, &[]);
    b.wait_eligible(2).await;
    let c = client();

    // Requests llama-server refuses with a 500 of its own: passed on as
    // they are, and no circuit opens however many come.
    let mistakes = [
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": 5}),
            "Failed to parse tools",
        ),
        (
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
            ]}]}),
            "image input is not supported",
        ),
    ];
    for _ in 0..5 {
        for (body, says) in &mistakes {
            let r = chat_with(&c, &b, &[], body.clone()).await;
            assert_eq!(r.status(), 500);
            let v: Value = r.json().await.unwrap();
            let message = v["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains(says), "llama-server's own answer: {v}");
        }
    }
    for ep in b.agents().await["endpoints"].as_array().unwrap() {
        assert!(ep["circuit_open_ms"].is_null(), "{ep}");
        assert_eq!(ep["consecutive_failures"], 0, "{ep}");
        assert_eq!(ep["eligible"], true, "{ep}");
    }
    assert_eq!(
        metric(&b, "flowgate_circuit_breaker_opened_total", &[]).await,
        0.0
    );
    let r = chat_with(&c, &b, &[], chat_req("Name a colour.", 8, false)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-flowgate-wait-ms"], "0", "sent at once");

    // Two non-streamed answers of 300 tokens whose clients leave after
    // they started: llama-server finishes them anyway, so both 1-slot
    // servers stay busy, and the next requests wait in the balancer, never
    // inside llama-server. The work is bounded so that the requests waiting
    // behind it are served well inside the buffer timeout even when the
    // real-server tests share two loaded cores (800 tokens did not).
    let long = json!({
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_tokens": 300, "temperature": 0, "ignore_eos": true,
    });
    let leavers: Vec<_> = (0..2)
        .map(|_| {
            let c = c.clone();
            let url = b.url("/v1/chat/completions");
            let long = long.clone();
            tokio::spawn(async move { c.post(url).json(&long).send().await })
        })
        .collect();
    b.wait_in_flight(2, Duration::from_secs(5)).await;
    // Leave only once llama-server is generating both: a request it had not
    // started yet is dropped with its connection, and its slot is rightly
    // free at once.
    wait_for(
        "both servers generating",
        Duration::from_secs(10),
        || async {
            let agents = b.agents().await;
            let busy = agents["endpoints"]
                .as_array()?
                .iter()
                .filter(|e| e["agent"]["slots_busy"] == 1)
                .count();
            (busy == 2).then_some(())
        },
    )
    .await;
    let left = Instant::now();
    for l in &leavers {
        l.abort();
    }
    wait_for("two orphaned slots", Duration::from_secs(5), || async {
        let agents = b.agents().await;
        let orphaned: u64 = agents["endpoints"]
            .as_array()?
            .iter()
            .filter_map(|e| e["orphaned"].as_u64())
            .sum();
        (orphaned == 2).then_some(())
    })
    .await;
    let next: Vec<_> = (0..2)
        .map(|i| {
            let c = c.clone();
            let url = b.url("/v1/chat/completions");
            tokio::spawn(async move {
                let r = c
                    .post(url)
                    .json(&chat_req(&format!("Say {i}."), 4, false))
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), left.elapsed())
            })
        })
        .collect();
    for n in next {
        let (status, after) = n.await.unwrap();
        assert_eq!(status, 200);
        // 300 tokens take llama-server seconds; a slot freed at the
        // disconnect would have taken the request at once.
        assert!(
            after > Duration::from_secs(1),
            "answered {after:?} after the departure"
        );
    }
    for addr in [&l1.addr, &l2.addr] {
        assert_eq!(
            deferred(&c, addr).await,
            Some(0),
            "llama-server at {addr} never queued a request itself"
        );
    }
    b.wait_in_flight(0, Duration::from_secs(5)).await;
}

/// The top-level keys of a JSON answer (its shape, not its words).
fn shape(body: &[u8]) -> Vec<String> {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let mut keys: Vec<String> = v
        .as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default();
    if let Some(e) = v.get("error") {
        keys.extend(
            e.as_object()
                .into_iter()
                .flatten()
                .map(|(k, _)| format!("error.{k}")),
        );
    }
    keys.sort();
    keys
}

/// The SSE event names of a stream, in order, repeats folded, and without
/// `message_start`: this llama-server sometimes leaves out a Messages
/// stream's `message_start` and repeats `response.created` and
/// `response.in_progress` mid-stream, directly as through Flowgate (seen in
/// 2 of 12 direct Messages streams and 1 of 24 Responses streams, 4 at a
/// time on 2 slots), so neither can tell a proxy apart.
fn events(body: &[u8]) -> Vec<String> {
    let mut names: Vec<String> = String::from_utf8_lossy(body)
        .lines()
        .filter_map(|l| l.strip_prefix("event: ").map(str::to_string))
        .filter(|name| name != "message_start")
        .collect();
    names.dedup();
    names
}

/// Every route llama-server serves answers the same through Flowgate as
/// directly (status, JSON shape, SSE event names), and the routes that take
/// no slot are answered while every slot is busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_llama_server_routes_answer_through_flowgate_as_directly() {
    let b = Balancer::start(&[]).await;
    let l = Llama::start(1).await;
    let _a = agent_at(&l.addr, &b, &[]);
    b.wait_eligible(1).await;
    let c = client();
    let user = json!([{"role": "user", "content": "Say hi."}]);
    let cases = [
        (
            "/v1/responses",
            json!({"input": "Say hi.", "max_output_tokens": 4, "temperature": 0}),
        ),
        (
            "/v1/responses",
            json!({"input": "Say hi.", "max_output_tokens": 4, "stream": true}),
        ),
        (
            "/v1/messages",
            json!({"messages": user, "max_tokens": 4, "temperature": 0}),
        ),
        (
            "/v1/messages",
            json!({"messages": user, "max_tokens": 4, "stream": true}),
        ),
        ("/v1/messages/count_tokens", json!({"messages": user})),
        ("/completion", json!({"prompt": "Hi", "n_predict": 4})),
        ("/tokenize", json!({"content": "hello world"})),
        ("/detokenize", json!({"tokens": [28120, 905]})),
        ("/apply-template", json!({"messages": user})),
        // Served by the route, refused by this model or these flags (501):
        // the engine's own refusal, passed on as it is.
        (
            "/infill",
            json!({"input_prefix": "def f(", "input_suffix": "):", "n_predict": 4}),
        ),
        ("/v1/embeddings", json!({"input": "hi"})),
        ("/v1/rerank", json!({"query": "q", "documents": ["a"]})),
    ];
    for (path, body) in &cases {
        let mut answers = Vec::new();
        for url in [format!("http://{}{path}", l.addr), b.url(path)] {
            let r = c.post(url).json(body).send().await.unwrap();
            let status = r.status().as_u16();
            let bytes = r.bytes().await.unwrap();
            answers.push((status, bytes));
        }
        let (direct, via) = (&answers[0], &answers[1]);
        assert_eq!(direct.0, via.0, "{path} {body}: status");
        if body["stream"] == true {
            // The same event names, the same first and last (see `events`
            // for what llama-server itself does not always send alike); the
            // order between is not compared.
            let (d, v) = (events(&direct.1), events(&via.1));
            let names = |e: &[String]| e.iter().cloned().collect::<std::collections::BTreeSet<_>>();
            assert_eq!(names(&d), names(&v), "{path}: SSE event names");
            assert_eq!(
                (d.first(), d.last()),
                (v.first(), v.last()),
                "{path}: {v:?}"
            );
            assert!(!v.is_empty(), "{path}: a stream");
        } else {
            assert_eq!(shape(&direct.1), shape(&via.1), "{path} {body}: JSON shape");
        }
    }
    // A long answer holds the only slot; tokenizing does not wait for it.
    let long = {
        let c = c.clone();
        let url = b.url("/v1/chat/completions");
        tokio::spawn(async move {
            let body = json!({"messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 300, "ignore_eos": true});
            c.post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    };
    b.wait_in_flight(1, Duration::from_secs(5)).await;
    let r = c
        .post(b.url("/tokenize"))
        .json(&json!({"content": "hello world"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap()["tokens"],
        json!([28120, 905])
    );
    assert_eq!(b.in_flight().await, 1, "tokenizing took no slot");
    assert_eq!(long.await.unwrap(), 200);
}

/// Runs `integration-tests/scripts/dropin_clients.py` (the official
/// `openai` and `anthropic` clients) against `base`; its JSON report.
async fn python_clients(base: String, model: String, embedding_base: String) -> Value {
    let target = format!("{base} for {model}");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/dropin_clients.py");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg(script)
            .args([&base, &model, &embedding_base, "smollm-embed"])
            .output()
            .expect("python3")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "the official clients failed against {target} (scripts/test installs openai and \
         anthropic):\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script's JSON")
}

/// What the official `openai` (chat, streamed chat with usage, responses,
/// streamed responses, embeddings) and `anthropic` (messages, streamed
/// messages, count_tokens) Python clients see through Flowgate is what
/// they see from llama-server directly — with the served model's id, with
/// a balancer alias, with any name under `--default-model`, and with any
/// name under `--any-model-name`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_clients_see_through_flowgate_what_they_see_directly() {
    let chat = Llama::start(2).await;
    let embed = Llama::start_with(
        1,
        &[
            "--embeddings",
            "--pooling",
            "mean",
            "--alias",
            "smollm-embed",
        ],
    )
    .await;
    let models = get_json(&format!("http://{}/v1/models", chat.addr)).await;
    let model = models["data"][0]["id"].as_str().unwrap().to_string();
    let b = Balancer::start(&[
        "--model-alias",
        &format!("gpt-4o-mini={model}"),
        "--default-model",
        &model,
    ])
    .await;
    let _a1 = agent_at(&chat.addr, &b, &[]);
    let _a2 = agent_at(&embed.addr, &b, &[]);
    b.wait_eligible(2).await;

    let direct = python_clients(
        format!("http://{}", chat.addr),
        model.clone(),
        format!("http://{}", embed.addr),
    )
    .await;
    assert_eq!(direct["served_model"], Value::Null);
    assert_eq!(
        direct["responses_stream"]["first"], "response.created",
        "{direct}"
    );
    assert_eq!(
        direct["responses_stream"]["last"], "response.completed",
        "{direct}"
    );
    assert_eq!(
        direct["messages_stream"]["first"], "content_block_start",
        "{direct}"
    );
    assert_eq!(
        direct["messages_stream"]["last"], "message_stop",
        "{direct}"
    );
    let via = format!("http://{}", b.inference);
    for name in [model.as_str(), "gpt-4o-mini", "a-hard-coded-name"] {
        let mut seen = python_clients(via.clone(), name.to_string(), via.clone()).await;
        assert_eq!(seen["served_model"], model.as_str(), "{name}: {seen}");
        seen["served_model"] = Value::Null;
        assert_eq!(seen, direct, "{name}: through Flowgate vs directly");
    }
    // `--any-model-name` in front of the chat server alone: any name is
    // answered, as by a lone llama-server.
    let any = Balancer::start(&["--any-model-name"]).await;
    let _a3 = agent_at(&chat.addr, &any, &[]);
    any.wait_eligible(1).await;
    let any_url = format!("http://{}", any.inference);
    let mut seen = python_clients(any_url, "qwen3".into(), via).await;
    assert_eq!(seen["served_model"], model.as_str(), "{seen}");
    seen["served_model"] = Value::Null;
    assert_eq!(seen, direct, "any name through Flowgate vs directly");
}
