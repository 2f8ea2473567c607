//! Flowgate tried as a hostile or careless client would: another tenant's
//! ids and idempotency keys, numbers past their bounds, malformed framing,
//! requests every engine refuses, a client that leaves a non-streamed
//! request halfway, model names and agent reports without end.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const AUTH: &str = "authorization";

/// A balancer with the async path and two tenants' keys, and one simulator.
async fn two_tenants(dir: &TempDir, keys: &ConfigFile) -> (Balancer, Sim, Proc) {
    fleet(
        &["--async-dir", dir.arg(), "--api-keys-file", keys.arg()],
        &["--slots", "2"],
    )
    .await
}

async fn send(
    method: reqwest::Method,
    url: String,
    key: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = client()
        .request(method, url)
        .header(AUTH, format!("Bearer {key}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.expect("the balancer answers");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn upload(b: &Balancer, key: &str, lines: &str) -> String {
    let file = upload_batch_file(b, Some(key), lines).await;
    file["id"].as_str().unwrap().to_string()
}

/// Every async request, result, idempotency key, file and batch belongs to
/// the tenant whose key created it: another tenant's id reads exactly as an
/// unknown one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_never_reaches_another_tenants_async_work_or_files() {
    let dir = TempDir::new("trust-tenants");
    let keys = ConfigFile::new(
        "keys:\n  - key: sk-alpha\n    tenant: alpha\n  - key: sk-beta\n    tenant: beta\n",
    );
    let (b, _sim, _agent) = two_tenants(&dir, &keys).await;
    let submit = |key: &'static str, idem: &'static str| {
        let b = b.url("/v1/async/chat/completions");
        async move {
            send(
                reqwest::Method::POST,
                b,
                key,
                &[("idempotency-key", idem)],
                Some(chat_for(Some("sim-model"), key)),
            )
            .await
        }
    };
    let (status, alpha) = submit("sk-alpha", "k1").await;
    assert_eq!(status, 202, "{alpha}");
    let alpha_id = alpha["id"].as_str().unwrap().to_string();
    // 128 random bits after the prefix: nothing to guess from.
    let hex = alpha_id.strip_prefix("areq_").expect("areq_ prefix");
    assert_eq!(hex.len(), 32, "{alpha_id}");
    assert!(hex.bytes().all(|c| c.is_ascii_hexdigit()));

    // The same idempotency key from beta is beta's own request.
    let (status, beta) = submit("sk-beta", "k1").await;
    assert_eq!(status, 202);
    assert_ne!(beta["id"], alpha["id"], "beta must not get alpha's request");
    assert_eq!(beta["fairness_id"], "beta");
    // From alpha again: alpha's.
    let (_, again) = submit("sk-alpha", "k1").await;
    assert_eq!(again["id"], alpha["id"]);

    let req_url = |id: &str| b.url(&format!("/v1/async/requests/{id}"));
    let unknown = "areq_00000000000000000000000000000000";
    let (s_unknown, v_unknown) =
        send(reqwest::Method::GET, req_url(unknown), "sk-beta", &[], None).await;
    for method in [reqwest::Method::GET, reqwest::Method::DELETE] {
        let (s, v) = send(method, req_url(&alpha_id), "sk-beta", &[], None).await;
        assert_eq!((s, s_unknown), (404, 404));
        assert_eq!(v["error"]["code"], v_unknown["error"]["code"]);
    }
    let (s, _) = send(
        reqwest::Method::GET,
        b.url(&format!("/v1/async/requests/{alpha_id}/events")),
        "sk-beta",
        &[],
        None,
    )
    .await;
    assert_eq!(s, 404);

    // Both finish; each tenant's feed lists only its own.
    let (s, done) = send(
        reqwest::Method::GET,
        format!("{}?wait=20s", req_url(&alpha_id)),
        "sk-alpha",
        &[],
        None,
    )
    .await;
    assert_eq!((s, done["status"].as_str()), (200, Some("succeeded")));
    wait_for("beta's request to finish", Duration::from_secs(20), || {
        let url = req_url(beta["id"].as_str().unwrap());
        async move {
            let (_, v) = send(reqwest::Method::GET, url, "sk-beta", &[], None).await;
            (v["status"] == "succeeded").then_some(())
        }
    })
    .await;
    for (key, own) in [("sk-alpha", &alpha["id"]), ("sk-beta", &beta["id"])] {
        let (_, feed) = send(
            reqwest::Method::GET,
            b.url("/v1/async/results?limit=100"),
            key,
            &[],
            None,
        )
        .await;
        let ids: Vec<&Value> = feed["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| &v["id"])
            .collect();
        assert_eq!(ids, vec![own], "{key} sees only its own results: {feed}");
    }

    // Files and batches.
    let line = json!({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                      "body": chat_for(Some("sim-model"), "batched")});
    let file = upload(&b, "sk-alpha", &format!("{line}\n")).await;
    let file_url = |rest: &str| b.url(&format!("/v1/files/{file}{rest}"));
    for (method, rest) in [
        (reqwest::Method::GET, ""),
        (reqwest::Method::GET, "/content"),
        (reqwest::Method::DELETE, ""),
    ] {
        let (s, v) = send(method, file_url(rest), "sk-beta", &[], None).await;
        assert_eq!(s, 404, "{v}");
        assert_eq!(v["error"]["code"], "file_not_found");
    }
    let (s, v) = send(
        reqwest::Method::POST,
        b.url("/v1/batches"),
        "sk-beta",
        &[],
        Some(
            json!({"input_file_id": file, "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"}),
        ),
    )
    .await;
    assert_eq!(s, 404, "beta cannot batch alpha's file: {v}");
    let (s, batch) = send(
        reqwest::Method::POST,
        b.url("/v1/batches"),
        "sk-alpha",
        &[],
        Some(
            json!({"input_file_id": file, "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"}),
        ),
    )
    .await;
    assert_eq!(s, 200, "{batch}");
    for (key, n) in [("sk-alpha", 1), ("sk-beta", 0)] {
        let (_, list) = send(reqwest::Method::GET, b.url("/v1/batches"), key, &[], None).await;
        assert_eq!(list["data"].as_array().unwrap().len(), n, "{key}: {list}");
        let (_, files) = send(reqwest::Method::GET, b.url("/v1/files"), key, &[], None).await;
        assert_eq!(files["data"].as_array().unwrap().len(), n, "{key}: {files}");
    }
    let batch_id = batch["id"].as_str().unwrap();
    let (s, _) = send(
        reqwest::Method::GET,
        b.url(&format!("/v1/batches/{batch_id}")),
        "sk-beta",
        &[],
        None,
    )
    .await;
    assert_eq!(s, 404);
    let (s, _) = send(
        reqwest::Method::POST,
        b.url(&format!("/v1/batches/{batch_id}/cancel")),
        "sk-beta",
        &[],
        None,
    )
    .await;
    assert_eq!(s, 404);

    // The owner deletes its file (OpenAI's answer); then it is gone.
    let (s, v) = send(reqwest::Method::DELETE, file_url(""), "sk-alpha", &[], None).await;
    assert_eq!((s, &v["deleted"]), (200, &json!(true)), "{v}");
    let (s, _) = send(reqwest::Method::GET, file_url(""), "sk-alpha", &[], None).await;
    assert_eq!(s, 404);
}

/// Numbers past their stated maximum are a 400 with a drop reason, never a
/// panic; `1h` is a duration everywhere.
#[tokio::test]
async fn client_numbers_past_their_bounds_are_refused_and_1h_is_a_duration() {
    let dir = TempDir::new("trust-numbers");
    let (b, _sim, _agent) =
        fleet(&["--async-dir", dir.arg(), "--async-retention", "24h"], &[]).await;
    let c = client();
    let submit = |deadline: &'static str| {
        c.post(b.url("/v1/async/chat/completions"))
            .header("x-flowgate-async-deadline", deadline)
            .json(&chat_for(Some("sim-model"), "n"))
            .send()
    };
    for bad in [
        "18446744073709551615",
        "-1s",
        "31d",
        "1.5h",
        "9999999999999999999d",
    ] {
        let resp = submit(bad).await.unwrap();
        assert_eq!(resp.headers()["x-flowgate-drop-reason"], "bad_deadline");
        assert_openai_error(resp, 400).await;
    }
    assert_eq!(submit("1h").await.unwrap().status(), 202);
    for (query, reason) in [
        ("/v1/async/results?wait=18446744073709551615", "bad_wait"),
        ("/v1/async/results?wait=2h", "bad_wait"),
        ("/v1/async/results?limit=-5", "bad_limit"),
        ("/v1/async/results?limit=99999999999999999999", "bad_limit"),
    ] {
        let resp = c.get(b.url(query)).send().await.unwrap();
        assert_eq!(resp.headers()["x-flowgate-drop-reason"], reason, "{query}");
        assert_openai_error(resp, 400).await;
    }
    // Still serving.
    assert_eq!(chat(&b, &[]).await.status(), 200);
}

/// Writes `request` on a fresh connection and reads the answer's head.
fn raw_exchange(addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if out.windows(4).any(|w| w == b"\r\n\r\n") && out.ends_with(b"}") {
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A request the client framed wrong is the client's 400, never an upstream
/// 502 blamed on the model server.
#[tokio::test]
async fn client_framing_errors_are_the_clients_400() {
    let (b, _sim, _agent) = fleet(&[], &[]).await;
    let chunked = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\
        Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nhello\r\n0\r\n\r\n";
    let body = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
    let mut nominated = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, Host\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    nominated.extend_from_slice(body);
    for request in [&chunked[..], &nominated] {
        let answer = raw_exchange(b.inference, request);
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        assert!(
            answer.contains("x-flowgate-drop-reason: bad-framing"),
            "{answer}"
        );
    }
    let text = metrics_text(&b).await;
    assert!(
        !text.contains("flowgate_upstream_errors_total{"),
        "no upstream error counted:\n{text}"
    );
    assert!(text.contains(r#"flowgate_client_refusals_total{reason="bad_framing"} 2"#));
}

/// Requests every engine refuses (llama-server's 500 with its error object,
/// or a 5xx two servers repeat) are passed to the client and never open a
/// circuit, in a fleet of one or two; a good request then goes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_the_engines_refuse_never_open_a_circuit() {
    // A fleet of one: the engine's own error objects.
    let (b, sim, _agent) = fleet(&[], &["--slots", "2"]).await;
    for _ in 0..100 {
        let r = chat(&b, &[("x-sim-fault", "reject=500")]).await;
        assert_eq!(r.status(), 500);
        let v: Value = r.json().await.unwrap();
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("Failed to parse tools"),
            "the engine's own answer: {v}"
        );
    }
    let agents = b.agents().await;
    let ep = &agents["endpoints"][0];
    assert!(ep["circuit_open_ms"].is_null(), "{ep}");
    assert_eq!(ep["consecutive_failures"], 0, "{ep}");
    let r = chat(&b, &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-flowgate-wait-ms"], "0", "sent at once");
    drop(sim);

    // A fleet of two: a plain 5xx both servers give is the request's.
    let b = Balancer::start(&[]).await;
    let sims = [Sim::start(&["--slots", "2"]), Sim::start(&["--slots", "2"])];
    let _agents: Vec<Proc> = sims.iter().map(|s| agent(s, &b)).collect();
    b.wait_eligible(2).await;
    for _ in 0..30 {
        let r = chat(&b, &[("x-sim-fault", "status=500")]).await;
        assert_eq!(r.status(), 500, "the second server's answer, passed on");
    }
    for ep in b.agents().await["endpoints"].as_array().unwrap() {
        assert!(ep["circuit_open_ms"].is_null(), "{ep}");
        assert_eq!(ep["consecutive_failures"], 0, "{ep}");
    }
    assert_eq!(
        metric(&b, "flowgate_circuit_breaker_opened_total", &[]).await,
        0.0
    );
    assert_eq!(chat(&b, &[]).await.status(), 200);
}

/// llama-server finishes a non-streamed answer after its client left: the
/// slot is not free before the engine is, so a 1-slot server never gets a
/// second request meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_whose_client_left_is_free_only_when_the_engine_is() {
    let (b, sim, _agent) = fleet(
        &["--buffered-request-timeout", "20000"],
        &["--slots", "1", "--finish-after-disconnect"],
    )
    .await;
    // A client that gives up after 300 ms on a 2 s answer.
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let started = Instant::now();
    let gone = impatient
        .post(b.url("/v1/chat/completions"))
        .header("x-sim-ttft-ms", "2000")
        .json(&chat_body())
        .send()
        .await;
    assert!(gone.is_err(), "the client left");
    let next = chat(&b, &[]).await;
    assert_eq!(next.status(), 200);
    let stats = sim.stats().await;
    assert_eq!(
        stats["max_processing"], 1,
        "the 1-slot server never had two requests: {stats}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(2000),
        "the next request waited for the engine"
    );
    b.wait_in_flight(0, Duration::from_secs(5)).await;
}

/// Model names a client invents never become metric labels; agent reports
/// are bounded.
#[tokio::test]
async fn client_model_names_and_agent_reports_are_bounded() {
    let b = Balancer::start(&[]).await;
    let sim = Sim::start(&[]);
    // An agent that lists no models: its server answers any name.
    let report = |models: Vec<String>, padding: usize| {
        json!({
            "protocol_version": 1, "agent_id": "any-name", "name": "any-name",
            "backend": "llamacpp", "external_addr": sim.addr.to_string(), "models": models,
            "health": "ready", "slots_total": 4, "slots_busy": 0, "requests_waiting": 0,
            "monitoring_interval_ms": 60_000, "last_error": "x".repeat(padding),
        })
    };
    let url = b.mgmt("/api/v1/agents/any-name/report");
    let v = post_json(&url, &report(vec![], 0)).await;
    assert_eq!(v["status"], "registered", "{v}");
    let before = metrics_text(&b).await.lines().count();
    for i in 0..20 {
        let r = chat_with(
            &client(),
            &b,
            &[],
            chat_for(Some(&format!("made-up-{i}")), "x"),
        )
        .await;
        assert_eq!(r.status(), 200);
    }
    let text = metrics_text(&b).await;
    assert!(!text.contains("made-up-"), "client names are not labels");
    assert!(text.contains(r#"model="other""#));
    assert!(
        text.lines().count() < before + 60,
        "one `other` set of series, not one per name ({before} → {})",
        text.lines().count()
    );
    let c = client();
    let too_many: Vec<String> = (0..200).map(|i| format!("m{i}")).collect();
    let resp = c
        .post(&url)
        .json(&report(too_many, 0))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let resp = c
        .post(&url)
        .json(&report(vec![], 70_000))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_waits_for_a_request_whose_body_is_still_arriving() {
    let (mut b, _sim, _a) = fleet(&[], &["--slots", "1"]).await;
    let body = serde_json::to_vec(&chat_body()).unwrap();
    let (first, rest) = body.split_at(body.len() / 2);
    let mut conn = TcpStream::connect(b.inference).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        conn,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    conn.write_all(first).unwrap();
    conn.flush().unwrap();
    // The head is in: the balancer counts the request as under way.
    wait_for("the head to be read", Duration::from_secs(5), || async {
        (metric(&b, "flowgate_client_requests", &[]).await >= 1.0).then_some(())
    })
    .await;
    b.proc.signal("TERM");
    let term = Instant::now();
    // The client takes its time; the agents keep reporting meanwhile (were
    // the management port closed with the inference port, the endpoint
    // would turn stale after 200 ms and the request would wait in vain).
    wait_for(
        "a fresh report well into the drain",
        Duration::from_secs(3),
        || async {
            let agents = b.agents().await;
            let age = agents["endpoints"][0]["report_age_ms"].as_u64()?;
            (term.elapsed() > Duration::from_millis(500) && age < 150).then_some(())
        },
    )
    .await;
    conn.write_all(rest).unwrap();
    let mut answer = String::new();
    let _ = conn.read_to_string(&mut answer);
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "the request finished inside the grace period: {answer:?}"
    );
    let status = tokio::task::block_in_place(|| b.proc.wait_exit(Duration::from_secs(4)))
        .expect("exits once drained");
    assert!(status.success(), "{status:?}");
}
