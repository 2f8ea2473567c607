//! Proxying seen from a client: routes, bodies of any size, streaming,
//! errors, agents coming and going, metrics, graceful shutdown.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

async fn fleet_with(slots: &str) -> (Balancer, Sim, Proc) {
    fleet(&["--max-request-bytes", "8388608"], &["--slots", slots]).await
}

#[tokio::test]
async fn openai_routes_are_proxied_and_models_come_from_agents() {
    let (b, _sim, _a) = fleet_with("2").await;
    let c = client();
    let v: Value = chat(&b, &[]).await.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    for (path, body) in [
        ("/v1/completions", json!({"prompt": "x"})),
        ("/completion", json!({"prompt": "x"})),
        ("/v1/embeddings", json!({"input": "x"})),
    ] {
        let r = c.post(b.url(path)).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    let models = get_json(&b.url("/v1/models")).await;
    assert_eq!(models["data"][0]["id"], "sim-model");
    assert_eq!(models["object"], "list");

    let agents = b.agents().await;
    assert_eq!(agents["endpoints"][0]["agent"]["slots_total"], 2);
    assert_eq!(agents["endpoints"][0]["in_flight"], 0);

    let health = c.get(b.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let (b, sim, _a) = fleet_with("2").await;
    let c = client();
    for malformed in ["{not json", "[1]"] {
        let r = c
            .post(b.url("/v1/chat/completions"))
            .body(malformed)
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.headers()["x-flowgate-drop-reason"],
            "invalid_json",
            "{malformed}"
        );
        assert_openai_error(r, 400).await;
    }
    let r = c.get(b.url("/v1/nope")).send().await.unwrap();
    assert_openai_error(r, 404).await;
    let r = c.get(b.url("/v1/chat/completions")).send().await.unwrap();
    assert_eq!(r.headers()["allow"], "POST");
    assert_openai_error(r, 405).await;
    let r = c
        .post(b.mgmt("/api/v1/agents/x/report"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_openai_error(r, 400).await;
    assert_eq!(
        sim.stats().await["requests_total"],
        0,
        "nothing reached the backend"
    );
}

#[tokio::test]
async fn multi_mib_bodies_reach_the_backend_intact_and_oversized_get_413() {
    let (b, _sim, _a) = fleet_with("2").await;
    let c = client();
    // 5 MiB of varied text, so a lost or reordered chunk changes the hash.
    let prompt: String = (0..5 * 1024 * 1024 / 16)
        .map(|i| format!("{i:015x} "))
        .collect();
    for body in [
        json!({"prompt": prompt}),
        json!({"prompt": "small"}),
        json!({"prompt": "x".repeat(64 * 1024 - 20)}),
        json!({"prompt": "y".repeat(64 * 1024 + 20)}),
    ] {
        let bytes = serde_json::to_vec(&body).unwrap();
        let r = c
            .post(b.url("/v1/completions"))
            .body(bytes.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()["x-sim-body-bytes"],
            bytes.len().to_string().as_str()
        );
        let want: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(r.headers()["x-sim-body-sha256"], want.as_str());
    }
    // A chunked body (no Content-Length) within 64 KiB is proxied too.
    let small = serde_json::to_vec(&json!({"prompt": "chunked"})).unwrap();
    let stream = futures_util::stream::iter([Ok::<_, std::io::Error>(small.clone())]);
    let r = c
        .post(b.url("/v1/completions"))
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-sim-body-bytes"],
        small.len().to_string().as_str()
    );
    // One over 64 KiB cannot be replayed upstream: 411, asking for a length.
    let chunks = (0..3).map(|_| Ok::<_, std::io::Error>(vec![b' '; 30 * 1024]));
    let r = c
        .post(b.url("/v1/completions"))
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks,
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-flowgate-drop-reason"], "length_required");
    assert_openai_error(r, 411).await;

    let over = vec![b' '; 8 * 1024 * 1024 + 1];
    let r = c
        .post(b.url("/v1/completions"))
        .body(over)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-flowgate-drop-reason"], "request_too_large");
    assert_openai_error(r, 413).await;
    b.wait_in_flight(0, Duration::from_secs(2)).await;
}

#[tokio::test]
async fn streams_pass_through_chunk_by_chunk() {
    let (b, _sim, _a) = fleet_with("2").await;
    let start = Instant::now();
    let resp = client()
        .post(b.url("/v1/chat/completions"))
        .header("x-sim-ttft-ms", "50")
        .header("x-sim-tpot-ms", "100")
        .header("x-sim-output-tokens", "15")
        .json(&json!({"stream": true, "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut stream = resp.bytes_stream();
    let mut first_chunk_at = None;
    let mut body = Vec::new();
    while let Some(chunk) = stream.next().await {
        first_chunk_at.get_or_insert_with(|| start.elapsed());
        body.extend_from_slice(&chunk.unwrap());
    }
    let total = start.elapsed();
    let first = first_chunk_at.unwrap();
    assert!(
        first.as_secs_f64() < total.as_secs_f64() * 0.25,
        "first chunk after {first:?} of {total:?}: the stream was buffered"
    );
    let text = String::from_utf8(body).unwrap();
    assert_eq!(text.matches("data: {").count(), 15);
    assert!(text.ends_with("data: [DONE]\n\n"));
}

/// The value of the exposition line that starts with `series` (name and
/// labels as the balancer writes them).
fn series(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in the exposition"))
}

/// Time to first token and per output token are measured on the stream at
/// the proxy (as ratios of the simulated ones), tokens come from the
/// answers' usage objects, and the access log's numbers match.
#[tokio::test]
async fn answers_are_metered_from_their_streams_and_usage() {
    let (b, _sim, _a) = fleet_with("2").await;
    let resp = client()
        .post(b.url("/v1/chat/completions"))
        .header("x-sim-ttft-ms", "200")
        .header("x-sim-tpot-ms", "40")
        .header("x-sim-output-tokens", "6")
        .json(
            &json!({"model": "sim-model", "stream": true, "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "a prompt of some length"}]}),
        )
        .send()
        .await
        .unwrap();
    let text = resp.text().await.unwrap();
    let last: Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .next_back()
        .unwrap();
    let streamed_prompt = last["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 6);
    let answer: Value = chat(&b, &[("x-sim-output-tokens", "4")])
        .await
        .json()
        .await
        .unwrap();
    let prompt = streamed_prompt + answer["usage"]["prompt_tokens"].as_u64().unwrap();

    // The balancer meters an answer when it logs it, which may be just after
    // the client has read the last byte.
    let completion = "flowgate_tokens_total{kind=\"completion\",model=\"sim-model\"}";
    let text = wait_for("both answers metered", Duration::from_secs(5), || async {
        let text = metrics_text(&b).await;
        let done = text
            .lines()
            .any(|l| l.strip_prefix(completion).is_some_and(|v| v.trim() == "10"));
        done.then_some(text)
    })
    .await;
    let m = |name: &str| series(&text, &format!("{name}{{model=\"sim-model\"}}"));
    assert_eq!(
        m("flowgate_time_to_first_token_seconds_count"),
        1.0,
        "streams only"
    );
    let ttft = m("flowgate_time_to_first_token_seconds_sum") / 0.2;
    assert!(
        (1.0..2.0).contains(&ttft),
        "TTFT {ttft:.2}x the simulated one"
    );
    assert_eq!(m("flowgate_time_per_output_token_seconds_count"), 1.0);
    let tpot = m("flowgate_time_per_output_token_seconds_sum") / 0.04;
    assert!(
        (0.8..2.0).contains(&tpot),
        "TPOT {tpot:.2}x the simulated one"
    );
    let tokens = |kind: &str| {
        series(
            &text,
            &format!("flowgate_tokens_total{{kind=\"{kind}\",model=\"sim-model\"}}"),
        )
    };
    assert_eq!(tokens("completion"), 10.0);
    assert_eq!(tokens("prompt"), prompt as f64);
}

/// `flowgate_upstream_errors_total` of one kind.
async fn upstream_errors(b: &Balancer, kind: &str) -> f64 {
    metric(b, "flowgate_upstream_errors_total", &[("kind", kind)]).await
}

#[tokio::test]
async fn backend_errors_pass_through_and_unreachable_backends_get_502() {
    let (b, _sim, _a) = fleet_with("2").await;
    let r = chat(&b, &[("x-sim-fault", "status=500")]).await;
    assert_eq!(
        r.status(),
        500,
        "the backend's own answer is passed through"
    );
    b.wait_in_flight(0, Duration::from_secs(2)).await;

    // An agent that points the balancer at a port nobody listens on.
    let b2 = Balancer::start(&[]).await;
    let sim = Sim::start(&["--slots", "1"]);
    let dead = format!("127.0.0.1:{}", free_port());
    let _a = agent_at(&sim.addr.to_string(), &b2, &["--external-addr", &dead]);
    b2.wait_eligible(1).await;
    let r = chat(&b2, &[]).await;
    assert_eq!(r.headers()["x-flowgate-drop-reason"], "upstream-error");
    assert_openai_error(r, 502).await;
    b2.wait_in_flight(0, Duration::from_secs(2)).await;
    let connect = upstream_errors(&b2, "connect").await;
    assert!(connect >= 1.0, "connect errors counted: {connect}");
    let five = upstream_errors(&b, "status-5xx").await;
    assert_eq!(five, 1.0);
}

#[tokio::test]
async fn a_backend_that_drops_mid_stream_frees_the_slot_and_cuts_the_stream() {
    let (b, sim, _a) = fleet_with("1").await;
    let resp = chat_with(
        &client(),
        &b,
        &[
            ("x-sim-fault", "drop-mid-stream"),
            ("x-sim-output-tokens", "10"),
        ],
        json!({"stream": true, "messages": []}),
    )
    .await;
    assert_eq!(resp.status(), 200, "headers were already sent");
    let mut stream = resp.bytes_stream();
    let mut text = String::new();
    let mut broken = false;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(c) => text.push_str(&String::from_utf8_lossy(&c)),
            Err(_) => {
                broken = true;
                break;
            }
        }
    }
    assert!(
        broken,
        "the client must see an error, not a clean end: {text}"
    );
    assert!(!text.contains("[DONE]"));
    b.wait_in_flight(0, Duration::from_secs(2)).await;
    let cut = upstream_errors(&b, "mid-response").await;
    assert_eq!(cut, 1.0);
    wait_for(
        "the backend slot to be free",
        Duration::from_secs(2),
        || async { (sim.stats().await["processing"] == 0).then_some(()) },
    )
    .await;
    assert_eq!(
        chat(&b, &[]).await.status(),
        200,
        "the slot is usable again"
    );
}

#[tokio::test]
async fn a_lost_agent_gets_no_new_work_and_its_requests_finish() {
    let b = Balancer::start(&[]).await;
    let sim1 = Sim::start(&["--slots", "1"]);
    let sim2 = Sim::start(&["--slots", "1"]);
    let mut a1 = agent(&sim1, &b);
    let _a2 = agent(&sim2, &b);
    b.wait_eligible(2).await;

    // One long request on each server.
    let long = |tag| spawn_chat(&b, &[("x-sim-ttft-ms", "700"), ("x-sim-tag", tag)]);
    let r1 = long("a");
    let r2 = long("b");
    b.wait_in_flight(2, Duration::from_secs(3)).await;
    a1.child.kill().unwrap(); // no deregistration: the reports just stop
    let lost = Instant::now();
    b.wait_eligible(1).await;
    let noticed = lost.elapsed();
    assert!(
        noticed < Duration::from_millis(1000),
        "stale after {noticed:?} (3 × 100 ms interval)"
    );
    assert_eq!(
        r1.await.unwrap(),
        200,
        "in-flight requests to a lost agent finish"
    );
    assert_eq!(r2.await.unwrap(), 200);

    let before = sim1.stats().await["requests_total"].as_u64().unwrap();
    for _ in 0..4 {
        assert_eq!(chat(&b, &[]).await.status(), 200);
    }
    assert_eq!(
        sim1.stats().await["requests_total"].as_u64().unwrap(),
        before,
        "no new work for the lost server"
    );
    wait_for(
        "the lost agent to be dropped",
        Duration::from_secs(3),
        || async { (b.agents().await["endpoints"].as_array().unwrap().len() == 1).then_some(()) },
    )
    .await;
}

#[tokio::test]
async fn a_deregistered_agent_is_gone_at_once() {
    let (b, _sim, a) = fleet_with("1").await;
    a.signal("TERM");
    wait_for(
        "the agent to deregister",
        Duration::from_secs(3),
        || async {
            b.agents().await["endpoints"]
                .as_array()
                .unwrap()
                .is_empty()
                .then_some(())
        },
    )
    .await;
}

#[tokio::test]
async fn metrics_are_valid_prometheus_text() {
    let (b, _sim, _a) = fleet_with("2").await;
    assert_eq!(chat(&b, &[]).await.status(), 200);
    let _ = client().get(b.url("/v1/nope")).send().await.unwrap();
    let resp = client().get(b.mgmt("/metrics")).send().await.unwrap();
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let text = resp.text().await.unwrap();
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    fn find<'a>(
        scrape: &'a prometheus_parse::Scrape,
        name: &'a str,
    ) -> impl Iterator<Item = &'a prometheus_parse::Sample> {
        scrape.samples.iter().filter(move |s| s.metric == name)
    }
    let served = find(&scrape, "flowgate_requests_total")
        .find(|s| s.labels.get("code") == Some("200"))
        .expect("a 200 outcome");
    assert!(matches!(served.value, prometheus_parse::Value::Counter(v) if v >= 1.0));
    for name in [
        "flowgate_buffered_requests",
        "flowgate_in_flight_requests",
        "flowgate_endpoint_in_flight_requests",
        "flowgate_endpoint_slots",
        "flowgate_agents",
    ] {
        assert!(find(&scrape, name).next().is_some(), "{name} is exported");
    }
    let idle = find(&scrape, "flowgate_endpoint_slots")
        .find(|s| s.labels.get("state") == Some("idle"))
        .unwrap();
    assert!(matches!(idle.value, prometheus_parse::Value::Gauge(v) if v == 2.0));
    assert!(text.contains("flowgate_buffer_wait_seconds_bucket"));
    assert!(text.contains("# TYPE flowgate_buffer_wait_seconds histogram"));
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_in_flight_requests_finish_then_exits() {
    let (mut b, _sim, _a) = fleet_with("1").await;
    let running = spawn_chat(&b, &[("x-sim-ttft-ms", "800")]);
    b.wait_in_flight(1, Duration::from_secs(3)).await;
    b.proc.signal("TERM");
    let sent = Instant::now();
    assert_eq!(
        running.await.unwrap(),
        200,
        "the in-flight request finished"
    );
    let status = tokio::task::block_in_place(|| b.proc.wait_exit(Duration::from_secs(4)))
        .expect("exits well before the 5 s grace period once drained");
    assert!(status.success(), "{status:?}");
    assert!(sent.elapsed() < Duration::from_secs(4));
}

/// A model server that answers the first request on each connection and
/// closes the connection, silently, when a second one arrives on it: what
/// a pooled connection whose keep-alive the server ended (llama-server's
/// after 5 s idle) looks like to the next request sent on it.
fn one_request_per_connection_server() -> std::net::SocketAddr {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut read_request = || -> Option<()> {
                    let mut length = 0usize;
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).ok()? == 0 {
                            return None;
                        }
                        let lower = line.to_ascii_lowercase();
                        if let Some(v) = lower.strip_prefix("content-length:") {
                            length = v.trim().parse().ok()?;
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; length];
                    reader.read_exact(&mut body).ok()
                };
                if read_request().is_none() {
                    return;
                }
                let body = r#"{"object":"chat.completion","choices":[]}"#;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                     content-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let mut conn = conn;
                if conn.write_all(answer.as_bytes()).is_err() {
                    return;
                }
                // The second request on this connection: closed unanswered.
                let _ = read_request();
            });
        }
    });
    addr
}

/// A request sent on a pooled connection the server had already closed is
/// sent again on a fresh one, answered, and not blamed on the endpoint.
#[tokio::test]
async fn a_stale_pooled_connection_is_retried_on_a_fresh_one() {
    let b = Balancer::start(&[]).await;
    let server = one_request_per_connection_server();
    let report = json!({
        "protocol_version": 1, "agent_id": "stale", "name": "stale",
        "backend": "llamacpp", "external_addr": server.to_string(), "models": ["m"],
        "health": "ready", "slots_total": 4, "slots_busy": 0,
        "monitoring_interval_ms": 60_000,
    });
    let v = post_json(&b.mgmt("/api/v1/agents/stale/report"), &report).await;
    assert!(v["status"].is_string(), "{v}");
    let c = client();
    for i in 0..5 {
        let r = chat_with(&c, &b, &[], chat_for(Some("m"), "hi")).await;
        assert_eq!(r.status(), 200, "request {i}");
    }
    let stale = metric(
        &b,
        "flowgate_upstream_retries_total",
        &[("reason", "stale-connection")],
    )
    .await;
    assert!(stale >= 4.0, "{stale} stale connections retried");
    assert_eq!(
        metric(&b, "flowgate_circuit_breaker_opened_total", &[]).await,
        0.0
    );
}
