//! OpenTelemetry traces as a collector sees them: an OTLP/HTTP receiver in
//! the test decodes each export with the official protobuf definitions
//! (`opentelemetry-proto`) and the test asserts the span tree of a request
//! that waited in the queue (request → admission, queue.wait,
//! endpoint.choice, upstream), the client's trace id kept, and the
//! upstream span's context sent on to the engine. A collector that never
//! answers costs the requests nothing.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use http_body_util::BodyExt;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

/// Every span the receiver got, decoded.
type Received = Arc<Mutex<Vec<Span>>>;

/// An OTLP/HTTP traces receiver on a port of its own.
async fn receiver() -> (String, Received) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let spans: Received = Arc::default();
    let kept = Arc::clone(&spans);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let kept = Arc::clone(&kept);
            tokio::spawn(async move {
                let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let kept = Arc::clone(&kept);
                    async move {
                        assert_eq!(req.uri().path(), "/v1/traces");
                        assert_eq!(req.headers()["content-type"], "application/x-protobuf");
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let export =
                            ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                        let mut all = kept.lock().unwrap();
                        for resource in export.resource_spans {
                            for scope in resource.scope_spans {
                                all.extend(scope.spans);
                            }
                        }
                        Ok::<_, hyper::Error>(hyper::Response::new(http_body_util::Full::new(
                            bytes::Bytes::new(),
                        )))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (url, spans)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_is_one_trace_from_the_client_to_the_engine() {
    let (collector, spans) = receiver().await;
    let b = Balancer::start(&["--otlp-endpoint", &collector]).await;
    let sim = Sim::start(&["--slots", "1"]);
    let _agent = agent(&sim, &b);
    b.wait_eligible(1).await;
    // The one slot is busy for a while: the traced request waits.
    let busy = {
        let c = client();
        let url = b.url("/v1/chat/completions");
        tokio::spawn(async move {
            c.post(url)
                .header("x-sim-ttft-ms", "300")
                .json(&chat_body())
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    b.wait_in_flight(1, Duration::from_secs(5)).await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let r = client()
        .post(b.url("/v1/chat/completions"))
        .header("traceparent", format!("00-{trace_id}-{client_span}-01"))
        .header("x-gateway-inference-fairness-id", "tenant-t")
        .json(&chat_body())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    assert_eq!(busy.await.unwrap(), 200);

    let mine = wait_for(
        "the request's five spans",
        Duration::from_secs(10),
        || async {
            let all = spans.lock().unwrap();
            let mine: Vec<Span> = all
                .iter()
                .filter(|s| hex(&s.trace_id) == trace_id)
                .cloned()
                .collect();
            (mine.len() >= 5).then_some(mine)
        },
    )
    .await;
    let by_name: HashMap<&str, &Span> = mine.iter().map(|s| (s.name.as_str(), s)).collect();
    let root = by_name["flowgate.request"];
    assert_eq!(
        hex(&root.parent_span_id),
        client_span,
        "child of the client's span"
    );
    for child in ["admission", "queue.wait", "endpoint.choice", "upstream"] {
        let span = by_name
            .get(child)
            .unwrap_or_else(|| panic!("no {child} span in {mine:?}"));
        assert_eq!(
            span.parent_span_id, root.span_id,
            "{child} under the request"
        );
        assert!(
            span.start_time_unix_nano >= root.start_time_unix_nano,
            "{child}"
        );
        assert!(
            span.end_time_unix_nano <= root.end_time_unix_nano,
            "{child}"
        );
    }
    let attr = |span: &Span, key: &str| {
        span.attributes
            .iter()
            .find(|a| a.key == key)
            .and_then(|a| a.value.clone())
            .and_then(|v| v.value)
            .unwrap_or_else(|| panic!("no {key} on {}", span.name))
    };
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    let wait = by_name["queue.wait"];
    assert!(
        wait.end_time_unix_nano - wait.start_time_unix_nano > 100_000_000,
        "it waited for the busy slot"
    );
    assert_eq!(
        attr(wait, "flowgate.fairness_id"),
        Value::StringValue("tenant-t".into())
    );
    assert!(matches!(
        attr(wait, "flowgate.priority"),
        Value::IntValue(0)
    ));
    assert!(matches!(
        attr(wait, "flowgate.queue.waiting_ahead"),
        Value::IntValue(_)
    ));
    let choice = by_name["endpoint.choice"];
    assert_eq!(
        attr(choice, "flowgate.endpoint"),
        Value::StringValue(sim.addr.to_string())
    );
    assert!(matches!(
        attr(choice, "flowgate.score"),
        Value::DoubleValue(_)
    ));
    assert!(matches!(
        attr(by_name["upstream"], "flowgate.time_to_first_token_ms"),
        Value::DoubleValue(_)
    ));
    assert!(matches!(
        attr(root, "http.response.status_code"),
        Value::IntValue(200)
    ));
    // The engine got the upstream span's context: same trace, that span.
    let parents = sim.stats().await["traceparents"].clone();
    let upstream = by_name["upstream"];
    let sent = format!("00-{trace_id}-{}-01", hex(&upstream.span_id));
    assert!(
        parents.as_array().unwrap().iter().any(|p| p == &sent),
        "{sent} not among {parents}"
    );
}

/// Sends `n` chats one after another; how long they took.
async fn timed(b: &Balancer, n: usize) -> Duration {
    let t = Instant::now();
    for _ in 0..n {
        assert_eq!(chat(b, &[]).await.status(), 200);
    }
    t.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_costs_the_requests_nothing() {
    // Accepts connections and never answers a byte.
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", hole.local_addr().unwrap());
    let held = Arc::new(Mutex::new(Vec::new()));
    let keep = Arc::clone(&held);
    tokio::spawn(async move {
        while let Ok((s, _)) = hole.accept().await {
            keep.lock().unwrap().push(s);
        }
    });
    let traced = Balancer::start(&["--otlp-endpoint", &url]).await;
    let plain = Balancer::start(&[]).await;
    let sim = Sim::start(&["--slots", "4"]);
    let _agents = (agent(&sim, &traced), agent(&sim, &plain));
    traced.wait_eligible(1).await;
    plain.wait_eligible(1).await;
    // Warm both, then measure in turns.
    timed(&traced, 5).await;
    timed(&plain, 5).await;
    let (mut with, mut without) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..3 {
        with += timed(&traced, 40).await;
        without += timed(&plain, 40).await;
    }
    let ratio = with.as_secs_f64() / without.as_secs_f64();
    assert!(
        ratio < 1.5,
        "traced requests took x{ratio:.2} of untraced ones"
    );
    assert!(
        !held.lock().unwrap().is_empty(),
        "the exporter did try the collector"
    );
}
