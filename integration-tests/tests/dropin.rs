//! Drop-in for clients with their own idea of model names: an agent's
//! `--model-alias` names route like the served model, `/v1/models` lists
//! them, and a name nobody serves gets a 404 that says what is served.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

/// The ids `/v1/models` lists, in its order.
async fn model_ids(b: &Balancer) -> Vec<String> {
    let models = get_json(&b.url("/v1/models")).await;
    models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test]
async fn model_aliases_route_and_unknown_names_are_told_what_is_served() {
    let b = Balancer::start(&[]).await;
    let sim = Sim::start(&["--model", "served-model"]);
    let _agent = agent_at(
        &sim.addr.to_string(),
        &b,
        &["--model-alias", "gpt-4o-mini", "--model-alias", "chat"],
    );
    b.wait_eligible(1).await;
    for name in ["served-model", "gpt-4o-mini", "chat"] {
        let r = chat_with(&client(), &b, &[], chat_for(Some(name), "hi")).await;
        assert_eq!(r.status(), 200, "{name}");
    }
    assert_eq!(model_ids(&b).await, ["chat", "gpt-4o-mini", "served-model"]);
    let r = chat_with(&client(), &b, &[], chat_for(Some("gpt-5"), "hi")).await;
    let err: Value = assert_openai_error(r, 404).await;
    let message = err["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("gpt-5") && message.contains("served: chat, gpt-4o-mini, served-model"),
        "{message}"
    );
    b.wait_in_flight(0, Duration::from_secs(5)).await;
}

#[test]
fn the_agent_refuses_an_empty_or_huge_alias() {
    for bad in ["", &"x".repeat(257)] {
        let out = std::process::Command::new(bin("agent"))
            .args(["--backend-addr", "127.0.0.1:1", "--model-alias", bad])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("model alias"));
    }
}

/// A batch may target the Responses API, as OpenAI's Batch API allows.
#[tokio::test]
async fn a_batch_may_target_the_responses_api() {
    let dir = TempDir::new("dropin-batch");
    let (b, _sim, _agent) = fleet(&["--async-dir", dir.arg()], &[]).await;
    let line = r#"{"custom_id":"r1","method":"POST","url":"/v1/responses","body":{"input":"hi"}}"#;
    let file = upload_batch_file(&b, None, line).await;
    let batch = post_json(
        &b.url("/v1/batches"),
        &serde_json::json!({"input_file_id": file["id"], "endpoint": "/v1/responses",
            "completion_window": "24h"}),
    )
    .await;
    assert_eq!(batch["status"], "in_progress", "{batch}");
    let id = batch["id"].as_str().unwrap().to_string();
    let done = wait_for("the batch to complete", Duration::from_secs(10), || async {
        let v = get_json(&b.url(&format!("/v1/batches/{id}"))).await;
        (v["status"] == "completed").then_some(v)
    })
    .await;
    assert_eq!(done["request_counts"]["completed"], 1, "{done}");
}

/// The `model` field the engine got, from a strict simulator's answer
/// (it refuses any other name, as vLLM does), and the served-model header.
async fn served(b: &Balancer, model: Option<&str>) -> (u16, String) {
    let r = chat_with(&client(), b, &[], chat_for(model, "hi")).await;
    let status = r.status().as_u16();
    let header = r
        .headers()
        .get("x-flowgate-served-model")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, header)
}

/// Two strict engines (`model-a`, `model-b`) behind the balancer's model
/// rules: an alias, a default model, a 90/10 rewrite, each reaching the
/// engine under the name it serves.
#[tokio::test]
async fn the_balancers_model_rules_reach_engines_that_check_the_name() {
    let dir = TempDir::new("dropin-models");
    let config = dir.path("models.yaml");
    std::fs::write(
        &config,
        "models:\n  default: model-a\n  aliases:\n    model-a: [gpt-4o-mini, gpt-4o]\n  \
         rewrites:\n    chat:\n      - {model: model-a, weight: 90}\n      - {model: model-b, weight: 10}\n",
    )
    .unwrap();
    let b = Balancer::start(&[
        "--config",
        &config,
        "--max-buffered-requests",
        "2000",
        "--async-dir",
        &dir.path("async"),
    ])
    .await;
    let fast = [
        "--ttft-ms",
        "0",
        "--tpot-ms",
        "0",
        "--output-tokens",
        "1",
        "--slots",
        "64",
    ];
    let sims: Vec<Sim> = ["model-a", "model-b"]
        .iter()
        .map(|m| Sim::start(&[&["--model", m, "--strict-model"][..], &fast[..]].concat()))
        .collect();
    let _agents: Vec<Proc> = sims.iter().map(|s| agent(s, &b)).collect();
    b.wait_eligible(2).await;

    assert_eq!(served(&b, Some("model-b")).await, (200, "model-b".into()));
    assert_eq!(
        served(&b, Some("gpt-4o-mini")).await,
        (200, "model-a".into())
    );
    // No name, and a name nothing serves: the default model.
    assert_eq!(served(&b, None).await, (200, "model-a".into()));
    assert_eq!(served(&b, Some("gpt-5")).await, (200, "model-a".into()));
    // The answer's own `model` is the engine's, passed through.
    let r = chat_with(&client(), &b, &[], chat_for(Some("gpt-4o"), "hi")).await;
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["model"], "model-a");

    // A chunked body (no Content-Length) is renamed too, and stays chunked.
    let json = chat_for(Some("gpt-4o-mini"), "in pieces")
        .to_string()
        .into_bytes();
    let (head, tail) = json.split_at(json.len() / 2);
    let pieces = vec![Ok::<_, std::io::Error>(head.to_vec()), Ok(tail.to_vec())];
    let r = client()
        .post(b.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            pieces,
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-flowgate-served-model"], "model-a");

    // The async door: delivered through the same rules.
    let queued = post_json(
        &b.url("/v1/async/chat/completions"),
        &chat_for(Some("gpt-4o-mini"), "later"),
    )
    .await;
    let id = queued["id"].as_str().unwrap().to_string();
    let done = wait_for("the async request", Duration::from_secs(10), || async {
        let v = get_json(&b.url(&format!("/v1/async/requests/{id}?wait=5s"))).await;
        (v["status"] != "queued" && v["status"] != "dispatched").then_some(v)
    })
    .await;
    assert_eq!(done["response_status"], 200, "{done}");
    assert_eq!(done["response"]["model"], "model-a", "{done}");

    // 1,000 requests for the canary name split 90/10 within ±3 %.
    let c = client();
    let mut to_b = 0;
    for round in 0..25 {
        let answers = futures_util::future::join_all(
            (0..40).map(|_| chat_with(&c, &b, &[], chat_for(Some("chat"), "canary"))),
        )
        .await;
        for r in answers {
            assert_eq!(r.status(), 200, "round {round}");
            to_b += usize::from(r.headers()["x-flowgate-served-model"] == "model-b");
        }
    }
    assert!((70..=130).contains(&to_b), "{to_b} of 1000 went to model-b");

    assert_eq!(
        model_ids(&b).await,
        ["chat", "gpt-4o", "gpt-4o-mini", "model-a", "model-b"]
    );
    b.wait_in_flight(0, Duration::from_secs(5)).await;
}

/// Under `--any-model-name` a fleet answers any name, as one llama-server
/// does; without it the same name is a 404.
#[tokio::test]
async fn any_model_name_lets_hard_coded_names_through() {
    let (b, _sim, _agent) = fleet(&["--any-model-name"], &[]).await;
    assert_eq!(
        served(&b, Some("gpt-4o-mini")).await,
        (200, "sim-model".into())
    );
    assert_eq!(served(&b, None).await, (200, "sim-model".into()));
    let (strict, _sim2, _agent2) = fleet(&[], &[]).await;
    assert_eq!(served(&strict, Some("gpt-4o-mini")).await.0, 404);
}

/// A `models:` rule that cannot work is refused at start, naming it.
#[test]
fn bad_model_rules_are_refused_at_start() {
    let dir = TempDir::new("dropin-bad-models");
    for (yaml, says) in [
        (
            "models:\n  aliases:\n    a: [x]\n    b: [x]\n",
            "alias of both",
        ),
        ("models:\n  rewrites:\n    chat: []\n", "1 to 16 targets"),
        (
            "models:\n  rewrites:\n    chat: [{model: a, weight: -1}]\n",
            "weight",
        ),
        (
            "models:\n  aliases:\n    a: [b]\n    b: [c]\n",
            "itself an alias",
        ),
        ("models:\n  fallbacks:\n    a: {models: [a]}\n", "twice"),
    ] {
        let config = dir.path("bad.yaml");
        std::fs::write(&config, yaml).unwrap();
        let out = std::process::Command::new(bin("balancer"))
            .args(["--config", &config])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(says),
            "{yaml}: {stderr}"
        );
    }
    let out = std::process::Command::new(bin("balancer"))
        .args(["--model-alias", "no-equals-sign"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// A fallback chain: requests for a model whose endpoints are down go to
/// the fallback at once; requests that waited longer than `after` for a
/// busy one move to it. Each is counted per (model, fallback) and the
/// engine gets the fallback's name.
#[tokio::test]
async fn fallbacks_take_requests_a_model_cannot() {
    let dir = TempDir::new("dropin-fallback");
    let config = dir.path("models.yaml");
    std::fs::write(
        &config,
        "models:\n  fallbacks:\n    model-a: {models: [model-b], after: 300ms}\n",
    )
    .unwrap();
    let b = Balancer::start(&["--config", &config]).await;
    let a = Sim::start(&["--model", "model-a", "--strict-model", "--slots", "1"]);
    let sim_b = Sim::start(&["--model", "model-b", "--strict-model", "--slots", "4"]);
    let agent_a = agent(&a, &b);
    let _agent_b = agent(&sim_b, &b);
    b.wait_eligible(2).await;
    let counted = |reason: &'static str| {
        let b = &b;
        async move {
            metric(
                b,
                "flowgate_model_fallbacks_total",
                &[
                    ("model", "model-a"),
                    ("fallback", "model-b"),
                    ("reason", reason),
                ],
            )
            .await
        }
    };
    assert_eq!(served(&b, Some("model-a")).await, (200, "model-a".into()));
    // The client has its answer before the balancer gives the slot back:
    // wait for that, so that the one in flight below is the slow request.
    b.wait_in_flight(0, Duration::from_secs(5)).await;

    // model-a's one slot is busy for 3 s: the next request waits 300 ms,
    // then model-b answers it.
    let c = client();
    let slow = {
        let (c, url) = (c.clone(), b.url("/v1/chat/completions"));
        tokio::spawn(async move {
            c.post(url)
                .header("x-sim-ttft-ms", "3000")
                .json(&chat_for(Some("model-a"), "slow"))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    b.wait_in_flight(1, Duration::from_secs(5)).await;
    let r = chat_with(&c, &b, &[], chat_for(Some("model-a"), "hi")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-flowgate-served-model"], "model-b");
    let waited: u64 = r.headers()["x-flowgate-wait-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((300..3000).contains(&waited), "waited {waited} ms");
    assert_eq!(counted("waited").await, 1.0);
    assert_eq!(slow.await.unwrap(), 200);

    // model-a's agent leaves: model-b answers at once.
    drop(agent_a);
    b.wait_eligible(1).await;
    let r = chat_with(&c, &b, &[], chat_for(Some("model-a"), "hi")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-flowgate-served-model"], "model-b");
    assert_eq!(r.headers()["x-flowgate-wait-ms"], "0");
    assert_eq!(counted("unavailable").await, 1.0);
}

/// `/v1/audio/transcriptions` (vLLM's, a `multipart/form-data` body) from
/// the official `openai` client: its form's `model` follows the model rules
/// like a JSON body's, renamed for an engine that checks it.
#[tokio::test]
async fn audio_transcriptions_are_forms_under_the_same_model_rules() {
    let (b, _sim, _agent) = fleet(
        &["--model-alias", "whisper-1=whisper-large"],
        &["--model", "whisper-large", "--strict-model"],
    )
    .await;
    let script = "import sys\nfrom openai import OpenAI, NotFoundError\n\
        c = OpenAI(base_url=sys.argv[1], api_key='unused', max_retries=0)\n\
        r = c.audio.transcriptions.with_raw_response.create(model='whisper-1', file=('a.wav', b'RIFF' * 1000))\n\
        print(r.headers.get('x-flowgate-served-model'), r.parse().text)\n\
        try:\n    c.audio.transcriptions.create(model='whisper-9', file=('a.wav', b'RIFF'))\n\
        except NotFoundError as e:\n    print('404', 'whisper-1' in str(e))\n";
    let base = b.url("/v1");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .args(["-c", script, &base])
            .output()
            .expect("python3")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout, "whisper-large simulated transcript\n404 True\n");
    // A form that does not parse is the client's 400, said as such.
    let r = client()
        .post(b.url("/v1/audio/transcriptions"))
        .header("content-type", "multipart/form-data; boundary=XyZ")
        .body("not a form")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-flowgate-drop-reason"], "invalid_form");
    assert_openai_error(r, 400).await;
}
