//! Client limits on the inference port, seen from raw TCP clients: a slow
//! request head (408), an oversized one (431), a slow body (408), too many
//! connections (503), each with its JSON error and drop reason, counted in
//! `flowgate_client_refusals_total`; and none of them touching a kept-alive
//! client or a request that waits in the buffer longer than the timeouts.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const HEADER_TIMEOUT: Duration = Duration::from_millis(600);
const BODY_TIMEOUT: Duration = Duration::from_millis(600);

fn assert_refused(response: &str, status: &str, code: &str) {
    assert!(
        response.starts_with(&format!("HTTP/1.1 {status}")),
        "want {status}: {response}"
    );
    assert!(
        response
            .to_ascii_lowercase()
            .contains(&format!("x-flowgate-drop-reason: {code}")),
        "drop reason {code}: {response}"
    );
    assert!(
        response.contains(&format!("\"code\":\"{code}\"")),
        "JSON error code {code}: {response}"
    );
}

async fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect(addr).await.expect("connect")
}

const HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n";

#[tokio::test]
async fn slow_and_oversized_requests_are_refused_with_clear_errors() {
    let b = Balancer::start(&[
        "--client-header-timeout",
        "600ms",
        "--client-body-timeout",
        "600ms",
        "--max-header-bytes",
        "4096",
    ])
    .await;

    // A head that stops half-way: 408 after the header timeout, then closed.
    let started = Instant::now();
    let mut s = connect(b.inference).await;
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let answer = read_to_close(&mut s).await;
    let took = started.elapsed();
    assert_refused(&answer, "408", "header_timeout");
    assert!(
        took >= HEADER_TIMEOUT && took < HEADER_TIMEOUT * 4,
        "refused after {took:?} (timeout {HEADER_TIMEOUT:?})"
    );

    // A connection that sends nothing at all is closed the same way.
    let started = Instant::now();
    let mut s = connect(b.inference).await;
    assert_refused(&read_to_close(&mut s).await, "408", "header_timeout");
    assert!(started.elapsed() < HEADER_TIMEOUT * 4);

    // A head over 4 KiB: 431.
    let mut s = connect(b.inference).await;
    let mut head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ".to_vec();
    head.extend(std::iter::repeat_n(b'a', 8000));
    head.extend_from_slice(b"\r\n\r\n");
    s.write_all(&head).await.unwrap();
    assert_refused(&read_to_close(&mut s).await, "431", "header_too_large");

    // A body that stops half-way: 408 after the body timeout.
    let started = Instant::now();
    let mut s = connect(b.inference).await;
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    let answer = read_response(&mut s).await;
    let took = started.elapsed();
    assert_refused(&answer, "408", "body_timeout");
    assert!(
        took >= BODY_TIMEOUT && took < BODY_TIMEOUT * 4,
        "refused after {took:?} (timeout {BODY_TIMEOUT:?})"
    );

    // A head just under the cap, and a kept-alive client whose requests
    // span several header timeouts, are served.
    let mut s = connect(b.inference).await;
    let mut head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ".to_vec();
    head.extend(std::iter::repeat_n(b'a', 3000));
    head.extend_from_slice(b"\r\n\r\n");
    s.write_all(&head).await.unwrap();
    assert!(read_response(&mut s).await.starts_with("HTTP/1.1 200"));
    for _ in 0..4 {
        tokio::time::sleep(HEADER_TIMEOUT / 2).await;
        s.write_all(HEALTH).await.unwrap();
        let answer = read_response(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "kept alive: {answer}");
    }

    for (reason, n) in [
        ("header_timeout", 2.0),
        ("header_too_large", 1.0),
        ("body_timeout", 1.0),
    ] {
        assert_eq!(
            metric(&b, "flowgate_client_refusals_total", &[("reason", reason)]).await,
            n,
            "{reason}"
        );
    }
}

#[tokio::test]
async fn a_request_waiting_longer_than_the_timeouts_is_still_served() {
    // One slot, answers after 1.5 s: the second request waits ~1.5 s in the
    // buffer, more than twice the header and body timeouts.
    let (b, _sim, _agent) = fleet(
        &[
            "--client-header-timeout",
            "600ms",
            "--client-body-timeout",
            "600ms",
        ],
        &["--slots", "1", "--ttft-ms", "1500", "--output-tokens", "1"],
    )
    .await;
    let first = spawn_chat(&b, &[]);
    b.wait_in_flight(1, Duration::from_secs(5)).await;
    let started = Instant::now();
    let second = spawn_chat(&b, &[]);
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(second.await.unwrap(), 200);
    assert!(started.elapsed() > HEADER_TIMEOUT * 2);
    assert_eq!(
        metric(&b, "flowgate_client_refusals_total", &[]).await,
        0.0,
        "nothing refused"
    );
}

#[tokio::test]
async fn connections_over_the_cap_get_503_until_one_closes() {
    let b = Balancer::start(&["--max-connections", "2"]).await;
    // The start-up check's connections may still be closing.
    wait_for("no client connection", Duration::from_secs(5), || async {
        (metric(&b, "flowgate_client_connections", &[]).await == 0.0).then_some(())
    })
    .await;
    let mut held = vec![connect(b.inference).await, connect(b.inference).await];
    for s in &mut held {
        s.write_all(HEALTH).await.unwrap();
        assert!(read_response(s).await.starts_with("HTTP/1.1 200"));
    }
    assert_eq!(metric(&b, "flowgate_client_connections", &[]).await, 2.0);

    let mut third = connect(b.inference).await;
    third.write_all(HEALTH).await.unwrap();
    let answer = read_to_close(&mut third).await;
    assert_refused(&answer, "503", "too_many_connections");
    assert!(answer.to_ascii_lowercase().contains("retry-after: 1"));
    assert_eq!(
        metric(
            &b,
            "flowgate_client_refusals_total",
            &[("reason", "too_many_connections")]
        )
        .await,
        1.0
    );

    // The held connections still work; once one closes, a new one gets in.
    held[0].write_all(HEALTH).await.unwrap();
    assert!(read_response(&mut held[0])
        .await
        .starts_with("HTTP/1.1 200"));
    drop(held.pop());
    wait_for("a freed connection", Duration::from_secs(5), || async {
        let mut s = connect(b.inference).await;
        s.write_all(HEALTH).await.ok()?;
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf).await.ok()?;
        (&buf == b"HTTP/1.1 200").then_some(())
    })
    .await;
}

/// A connection whose request waits for a slot (parked outside the proxy,
/// in a task of its own) keeps its place under the connection cap while it
/// waits, is answered on that connection once the slot frees, serves its
/// next request there, and gives its place back when it closes.
#[tokio::test]
async fn a_connection_whose_request_waits_keeps_its_place_under_the_cap() {
    let (b, _sim, _agent) = fleet(
        &["--max-connections", "2"],
        &["--slots", "1", "--ttft-ms", "800", "--output-tokens", "1"],
    )
    .await;
    wait_for("no client connection", Duration::from_secs(5), || async {
        (metric(&b, "flowgate_client_connections", &[]).await == 0.0).then_some(())
    })
    .await;
    let body = chat_body().to_string();
    let chat = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut serving = connect(b.inference).await;
    serving.write_all(chat.as_bytes()).await.unwrap();
    b.wait_in_flight(1, Duration::from_secs(5)).await;
    let mut waiting = connect(b.inference).await;
    waiting.write_all(chat.as_bytes()).await.unwrap();
    b.wait_buffered(1).await;
    assert_eq!(metric(&b, "flowgate_client_connections", &[]).await, 2.0);

    let mut third = connect(b.inference).await;
    third.write_all(HEALTH).await.unwrap();
    assert_refused(
        &read_to_close(&mut third).await,
        "503",
        "too_many_connections",
    );

    assert!(read_response(&mut serving)
        .await
        .starts_with("HTTP/1.1 200"));
    assert!(read_response(&mut waiting)
        .await
        .starts_with("HTTP/1.1 200"));
    waiting.write_all(HEALTH).await.unwrap();
    assert!(read_response(&mut waiting)
        .await
        .starts_with("HTTP/1.1 200"));
    assert_eq!(metric(&b, "flowgate_client_connections", &[]).await, 2.0);
    drop(waiting);
    wait_for(
        "the waited connection's place back",
        Duration::from_secs(5),
        || async { (metric(&b, "flowgate_client_connections", &[]).await == 1.0).then_some(()) },
    )
    .await;
}
