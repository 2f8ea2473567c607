//! Buffering rules seen from a client: 503 when full, 504 after the timeout,
//! FIFO order, one wake-up per freed slot, disconnects, scale from zero; and
//! that a request which waited (outside the proxy, then replayed to it)
//! reaches the backend byte for byte on a connection that lives on.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One slot held by a slow request, so the next ones must wait.
async fn hold_slot(
    b: &Balancer,
    ttft_ms: &'static str,
    tag: &'static str,
) -> tokio::task::JoinHandle<u16> {
    let h = spawn_chat(b, &[("x-sim-ttft-ms", ttft_ms), ("x-sim-tag", tag)]);
    b.wait_in_flight(1, Duration::from_secs(5)).await;
    h
}

#[tokio::test]
async fn full_buffer_answers_503_with_retry_after() {
    let (b, sim, _agent) = fleet(&["--max-buffered-requests", "2"], &["--slots", "1"]).await;

    let holder = hold_slot(&b, "1500", "holder").await;
    let waiters: Vec<_> = (0..2).map(|_| spawn_chat(&b, &[])).collect();
    b.wait_buffered(2).await;

    let start = Instant::now();
    let resp = chat(&b, &[]).await;
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "refused at once"
    );
    assert_eq!(resp.headers()["retry-after"], "1");
    assert_eq!(resp.headers()["x-flowgate-drop-reason"], "buffer-full");
    let err = assert_openai_error(resp, 503).await;
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("buffer is full"));

    assert_eq!(holder.await.unwrap(), 200);
    for w in waiters {
        assert_eq!(w.await.unwrap(), 200, "buffered requests are served");
    }
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    assert_eq!(
        sim.stats().await["max_deferred"],
        0,
        "they waited in the balancer"
    );
}

#[tokio::test]
async fn buffering_disabled_refuses_at_once() {
    let b = Balancer::start(&["--max-buffered-requests", "0"]).await;
    let resp = chat(&b, &[]).await;
    assert_eq!(resp.headers()["x-flowgate-drop-reason"], "no-endpoints");
    assert_openai_error(resp, 503).await;

    let sim = Sim::start(&["--slots", "1"]);
    let _agent = agent(&sim, &b);
    b.wait_eligible(1).await;
    let holder = hold_slot(&b, "800", "holder").await;
    let resp = chat(&b, &[]).await;
    assert_eq!(resp.headers()["x-flowgate-drop-reason"], "buffer-full");
    assert_openai_error(resp, 503).await;
    assert_eq!(holder.await.unwrap(), 200);
}

#[tokio::test]
async fn waiting_past_the_timeout_answers_504() {
    let timeout_ms = 400u64;
    let (b, sim, _agent) = fleet(
        &["--buffered-request-timeout", &timeout_ms.to_string()],
        &["--slots", "1"],
    )
    .await;

    let holder = hold_slot(&b, "2000", "holder").await;
    let start = Instant::now();
    let resp = chat(&b, &[("x-sim-tag", "late")]).await;
    let waited = start.elapsed().as_secs_f64() / (timeout_ms as f64 / 1000.0);
    assert_eq!(resp.headers()["x-flowgate-drop-reason"], "ttl-expired");
    assert_openai_error(resp, 504).await;
    assert!(
        (0.95..2.5).contains(&waited),
        "waited {waited:.2}× the timeout"
    );
    assert_eq!(b.buffered().await, 0, "the expired request left the buffer");

    assert_eq!(holder.await.unwrap(), 200);
    let stats = sim.stats().await;
    assert_eq!(
        stats["arrivals"],
        serde_json::json!(["holder"]),
        "the 504 never reached the backend"
    );
}

#[tokio::test]
async fn waiters_are_served_in_arrival_order_one_per_freed_slot() {
    let (b, sim, _agent) = fleet(&[], &["--slots", "1", "--ttft-ms", "30", "--tpot-ms", "1"]).await;

    let holder = hold_slot(&b, "500", "holder").await;
    let mut waiters = Vec::new();
    for i in 0..6u64 {
        waiters.push(spawn_chat(&b, &[("x-sim-tag", &format!("w{i}"))]));
        // Fix the arrival order before sending the next one.
        b.wait_buffered(i + 1).await;
    }
    assert_eq!(holder.await.unwrap(), 200);
    for w in waiters {
        assert_eq!(w.await.unwrap(), 200);
    }
    let stats = sim.stats().await;
    assert_eq!(
        stats["arrivals"],
        serde_json::json!(["holder", "w0", "w1", "w2", "w3", "w4", "w5"])
    );
    assert_eq!(
        stats["max_processing"], 1,
        "one freed slot woke exactly one waiter"
    );
    assert_eq!(
        stats["max_deferred"], 0,
        "nothing queued inside the backend"
    );
}

#[tokio::test]
async fn a_client_that_leaves_the_buffer_takes_nothing() {
    let (b, sim, _agent) = fleet(&[], &["--slots", "1"]).await;

    let holder = hold_slot(&b, "1500", "holder").await;
    let body = serde_json::to_vec(&chat_body()).unwrap();
    let mut raw = tokio::net::TcpStream::connect(b.inference).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-sim-tag: leaver\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    raw.write_all(head.as_bytes()).await.unwrap();
    raw.write_all(&body).await.unwrap();
    b.wait_buffered(1).await;
    let left = Instant::now();
    drop(raw);
    b.wait_buffered(0).await;
    assert!(
        left.elapsed() < Duration::from_millis(500),
        "left the buffer at once"
    );
    assert_eq!(holder.await.unwrap(), 200);
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    // The freed slot went to nobody: the next request is served at once.
    assert_eq!(chat(&b, &[("x-sim-tag", "next")]).await.status(), 200);
    assert_eq!(
        sim.stats().await["arrivals"],
        serde_json::json!(["holder", "next"])
    );
}

/// A raw HTTP/1.1 chat completion carrying `body`, tagged `tag` for the
/// simulator, with `extra` header lines.
fn raw_chat(tag: &str, body: &[u8], extra: &str) -> Vec<u8> {
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         x-sim-tag: {tag}\r\n{extra}content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    req
}

#[tokio::test]
async fn a_request_that_waited_reaches_the_backend_whole_on_a_connection_that_lives_on() {
    let (b, sim, _agent) = fleet(&[], &["--slots", "1"]).await;
    let holder = hold_slot(&b, "800", "holder").await;
    let body =
        |bytes| serde_json::to_vec(&chat_for(Some("sim-model"), &"x".repeat(bytes))).unwrap();
    // Just under Pingora's 64 KiB retry buffer (waits outside the proxy),
    // over it (waits inside), and small (with `Connection: close`: inside).
    let (mid, big, small) = (body(60_000), body(100_000), body(10));
    let mut kept = tokio::net::TcpStream::connect(b.inference).await.unwrap();
    kept.write_all(&raw_chat("mid", &mid, "")).await.unwrap();
    b.wait_buffered(1).await;
    let mut closing = tokio::net::TcpStream::connect(b.inference).await.unwrap();
    closing
        .write_all(&raw_chat("closing", &small, "connection: close\r\n"))
        .await
        .unwrap();
    b.wait_buffered(2).await;
    let mut large = tokio::net::TcpStream::connect(b.inference).await.unwrap();
    large.write_all(&raw_chat("big", &big, "")).await.unwrap();
    b.wait_buffered(3).await;

    assert_eq!(holder.await.unwrap(), 200);
    let first = read_response(&mut kept).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert!(first.contains("x-flowgate-wait-ms"), "{first}");
    // `Connection: close` still closes, after the answer.
    let closed = read_to_close(&mut closing).await;
    assert!(closed.starts_with("HTTP/1.1 200"), "{closed}");
    let large_answer = read_response(&mut large).await;
    assert!(large_answer.starts_with("HTTP/1.1 200"), "{large_answer}");
    // The connection serves its next request as if nothing happened.
    kept.write_all(&raw_chat("again", &small, ""))
        .await
        .unwrap();
    let again = read_response(&mut kept).await;
    assert!(again.starts_with("HTTP/1.1 200"), "{again}");

    b.wait_in_flight(0, Duration::from_secs(5)).await;
    let stats = sim.stats().await;
    assert_eq!(
        stats["arrivals"],
        serde_json::json!(["holder", "mid", "closing", "big", "again"])
    );
    let holder_bytes = serde_json::to_vec(&chat_body()).unwrap().len();
    assert_eq!(
        stats["bytes_received_total"].as_u64().unwrap() as usize,
        holder_bytes + mid.len() + 2 * small.len() + big.len(),
        "every body arrived once and whole"
    );
}

#[tokio::test]
async fn a_request_pipelined_behind_a_waiting_one_closes_the_connection_and_leaks_nothing() {
    let (b, sim, _agent) = fleet(&[], &["--slots", "1"]).await;
    let holder = hold_slot(&b, "800", "holder").await;
    let small = serde_json::to_vec(&chat_body()).unwrap();
    let mut both = raw_chat("first", &small, "");
    both.extend_from_slice(&raw_chat("second", &small, ""));
    let mut raw = tokio::net::TcpStream::connect(b.inference).await.unwrap();
    raw.write_all(&both).await.unwrap();
    // HTTP/1.1 pipelining is not served (as Pingora): the connection
    // closes without an answer, and nothing stays buffered or held.
    let answer = read_to_close(&mut raw).await;
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 "),
        "{answer}"
    );
    b.wait_buffered(0).await;
    assert_eq!(holder.await.unwrap(), 200);
    b.wait_in_flight(0, Duration::from_secs(5)).await;
    assert_eq!(chat(&b, &[("x-sim-tag", "next")]).await.status(), 200);
    let arrivals = sim.stats().await["arrivals"].clone();
    assert_eq!(arrivals[arrivals.as_array().unwrap().len() - 1], "next");
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_frees_its_slot() {
    let (b, sim, _agent) = fleet(&[], &["--slots", "1"]).await;

    let body = serde_json::json!({"stream": true, "messages": []}).to_string();
    let mut raw = tokio::net::TcpStream::connect(b.inference).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-sim-tpot-ms: 100\r\nx-sim-output-tokens: 100\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    raw.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = raw.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("200 OK"));
    assert_eq!(b.in_flight().await, 1);
    let left = Instant::now();
    drop(raw);
    // The stream had ~10 s to go; the slot must come back long before.
    b.wait_in_flight(0, Duration::from_secs(3)).await;
    wait_for(
        "the backend to stop generating",
        Duration::from_secs(3),
        || async { (sim.stats().await["processing"] == 0).then_some(()) },
    )
    .await;
    assert!(left.elapsed() < Duration::from_secs(3));
    assert_eq!(
        chat(&b, &[]).await.status(),
        200,
        "the slot is usable again"
    );
}

#[tokio::test]
async fn requests_sent_before_any_agent_are_served_once_one_registers() {
    let b = Balancer::start(&[]).await;
    let tasks: Vec<_> = (0..3).map(|_| spawn_chat(&b, &[])).collect();
    b.wait_buffered(3).await;
    let sim = Sim::start(&["--slots", "2"]);
    let _agent = agent(&sim, &b);
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(sim.stats().await["max_deferred"], 0);
}

#[tokio::test]
async fn a_loading_backend_gets_no_traffic_until_ready() {
    let b = Balancer::start(&[]).await;
    let sim = Sim::start(&["--slots", "2", "--loading-ms", "1200"]);
    let _agent = agent(&sim, &b);
    wait_for(
        "the agent to report loading",
        Duration::from_secs(5),
        || async {
            let a = b.agents().await;
            (a["endpoints"][0]["agent"]["health"] == "loading").then_some(())
        },
    )
    .await;
    let start = Instant::now();
    let resp = chat(&b, &[]).await;
    assert_eq!(resp.status(), 200);
    assert!(
        start.elapsed() > Duration::from_millis(300),
        "it waited for the model to load"
    );
}
