//! EPP mode as Envoy sees it: a test client plays Envoy's side of the
//! external-processing stream (request headers → body → response headers →
//! response body, or a cancelled stream) against a real balancer started
//! with `--epp-addr`, and forwards each request to the simulated model
//! server the balancer picked, as Envoy's ORIGINAL_DST cluster would.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, HttpTrailers, ProcessingRequest,
    ProcessingResponse, ProtocolConfiguration,
};
use flowgate_integration_tests::envoy::*;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// How long a test waits for an answer Envoy would get at once.
const PROMPTLY: Duration = Duration::from_secs(10);

/// A balancer serving EPP mode, with its own gRPC connection (Envoy keeps
/// one connection and multiplexes streams on it).
struct Epp {
    b: Balancer,
    channel: Channel,
}

impl Epp {
    async fn start(args: &[&str]) -> Epp {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut all = vec!["--epp-addr", &addr];
        all.extend_from_slice(args);
        let b = Balancer::start(&all).await;
        let url = format!("http://{addr}");
        let channel = wait_for("the EPP port to accept", PROMPTLY, || {
            let url = url.clone();
            async move { Channel::from_shared(url).ok()?.connect().await.ok() }
        })
        .await;
        Epp { b, channel }
    }

    async fn open(&self) -> Exchange {
        EppClient(self.channel.clone()).open().await
    }
}

/// One HTTP request's stream, from Envoy's side.
struct Exchange {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Exchange {
    async fn send(&self, m: ProcessingRequest) {
        self.tx.send(m).await.expect("stream open");
    }

    async fn recv(&mut self) -> processing_response::Response {
        self.recv_full().await.response.expect("a response")
    }

    async fn recv_full(&mut self) -> ProcessingResponse {
        tokio::time::timeout(PROMPTLY, self.rx.message())
            .await
            .expect("the EPP answers in time")
            .expect("no gRPC error")
            .expect("the stream is still open")
    }

    /// Sends request headers and a buffered body; returns the answer to
    /// the body (after checking the headers were answered CONTINUE).
    async fn request(&mut self, headers: &[(&str, &str)], body: &Value) -> ProcessingResponse {
        self.send(request_headers(headers, false)).await;
        match self.recv().await {
            processing_response::Response::RequestHeaders(h) => {
                assert_eq!(h.response.unwrap_or_default().header_mutation, None)
            }
            other => panic!("expected a headers answer, got {other:?}"),
        }
        self.send(body_message(body.to_string().into_bytes(), true))
            .await;
        self.recv_full().await
    }

    /// Plays the upstream response: headers with `status`, then one body
    /// message that ends the response.
    async fn respond(&mut self, status: u16, body: &[u8]) {
        self.send(response_headers(status, false)).await;
        assert!(matches!(
            self.recv().await,
            processing_response::Response::ResponseHeaders(_)
        ));
        self.send(response_body(body.to_vec(), true)).await;
        assert!(matches!(
            self.recv().await,
            processing_response::Response::ResponseBody(_)
        ));
    }
}

/// Sends the request to where the EPP pointed, as Envoy would.
async fn forward(to: SocketAddr, body: &Value) -> (u16, Vec<u8>) {
    let r = client()
        .post(format!("http://{to}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .expect("the model server answers");
    let status = r.status().as_u16();
    (status, r.bytes().await.unwrap().to_vec())
}

/// Buffered mode: the destination comes with the body's answer, the slot is
/// held until the response ends, and a request that finds every slot taken
/// waits in flow control for the first one that frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_learns_where_each_request_goes_and_the_slot_lasts_until_the_response_ends() {
    let epp = Epp::start(&[]).await;
    // gRPC health answers beside the processor, as the GIE's EPP does.
    let mut health = HealthClient::new(epp.channel.clone());
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .expect("health answers")
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "{service}");
    }
    let one = Sim::start(&["--model", "m", "--slots", "1"]);
    let two = Sim::start(&["--model", "m", "--slots", "1"]);
    let (_a1, _a2) = (agent(&one, &epp.b), agent(&two, &epp.b));
    epp.b.wait_eligible(2).await;
    let body = chat_for(Some("m"), "hello");
    let tenant = [("x-gateway-inference-fairness-id", "tenant-a")];

    let mut first = epp.open().await;
    let to_first = destination(&first.request(&tenant, &body).await);
    let mut second = epp.open().await;
    let to_second = destination(&second.request(&tenant, &body).await);
    let mut both = [to_first, to_second];
    both.sort();
    let mut sims = [one.addr, two.addr];
    sims.sort();
    assert_eq!(both, sims, "one request on each free server");
    epp.b.wait_in_flight(2, PROMPTLY).await;

    // Every slot is taken: the third request waits in the balancer.
    let mut third = epp.open().await;
    third.send(request_headers(&tenant, false)).await;
    third.recv().await;
    third
        .send(body_message(body.to_string().into_bytes(), true))
        .await;
    epp.b.wait_buffered(1).await;

    // The first response ends: its slot goes to the third request.
    let (status, answer) = forward(to_first, &body).await;
    assert_eq!(status, 200);
    first.respond(200, &answer).await;
    let to_third = destination(&third.recv_full().await);
    assert_eq!(to_third, to_first);
    epp.b.wait_in_flight(2, PROMPTLY).await;

    for (mut x, to) in [(second, to_second), (third, to_third)] {
        let (status, answer) = forward(to, &body).await;
        assert_eq!(status, 200);
        x.respond(status, &answer).await;
    }
    epp.b.wait_in_flight(0, PROMPTLY).await;
    assert_eq!(
        metric(
            &epp.b,
            "flowgate_epp_requests_total",
            &[("outcome", "picked")]
        )
        .await,
        3.0
    );
    assert_eq!(
        metric(&epp.b, "flowgate_requests_total", &[("code", "200")]).await,
        3.0,
        "response statuses reported by Envoy are counted"
    );
}

/// Full-duplex mode (the GIE's): nothing is answered until the body is in;
/// then the headers answer carries the destination and the body comes back
/// whole in 62,000-byte chunks. Response bodies are echoed back likewise.
/// A request without a body is placed from its headers alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_bodies_come_back_whole_after_the_destination() {
    let epp = Epp::start(&[]).await;
    let sim = Sim::start(&["--model", "m", "--slots", "2"]);
    let _a = agent(&sim, &epp.b);
    epp.b.wait_eligible(1).await;

    let mut x = epp.open().await;
    let mut headers = request_headers(&[], false);
    let full_duplex = BodySendMode::FullDuplexStreamed as i32;
    headers.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: full_duplex,
        response_body_mode: full_duplex,
        ..ProtocolConfiguration::default()
    });
    x.send(headers).await;
    let long = "a long shared system prompt ".repeat(5_000); // ~140 KB
    let body = chat_for(Some("m"), &long).to_string().into_bytes();
    let pieces: Vec<&[u8]> = body.chunks(50_000).collect();
    for (i, piece) in pieces.iter().enumerate() {
        x.send(body_message(piece.to_vec(), i + 1 == pieces.len()))
            .await;
    }
    let first = x.recv_full().await;
    assert!(matches!(
        first.response,
        Some(processing_response::Response::RequestHeaders(_))
    ));
    assert_eq!(destination(&first), sim.addr);
    let mut echoed = Vec::new();
    let mut sizes = Vec::new();
    loop {
        let processing_response::Response::RequestBody(b) = x.recv().await else {
            panic!("expected the body streamed back");
        };
        let Some(body_mutation::Mutation::StreamedResponse(chunk)) =
            b.response.unwrap().body_mutation.unwrap().mutation
        else {
            panic!("expected a streamed body chunk");
        };
        sizes.push(chunk.body.len());
        echoed.extend_from_slice(&chunk.body);
        if chunk.end_of_stream {
            break;
        }
    }
    assert_eq!(echoed, body, "the body comes back unchanged");
    assert!(sizes.len() >= 3 && sizes[..sizes.len() - 1].iter().all(|&n| n == 62_000));

    x.send(response_headers(200, false)).await;
    x.recv().await;
    for (i, piece) in [&b"data: 1\n\n"[..], b"data: [DONE]\n\n"]
        .iter()
        .enumerate()
    {
        x.send(response_body(piece.to_vec(), i == 1)).await;
        let processing_response::Response::ResponseBody(b) = x.recv().await else {
            panic!("expected a response body answer");
        };
        let Some(body_mutation::Mutation::StreamedResponse(chunk)) =
            b.response.unwrap().body_mutation.unwrap().mutation
        else {
            panic!("expected the response chunk streamed back");
        };
        assert_eq!(
            (chunk.body.as_slice(), chunk.end_of_stream),
            (*piece, i == 1)
        );
    }
    epp.b.wait_in_flight(0, PROMPTLY).await;

    // Headers only (e.g. a GET): placed at once; its trailers-free response
    // ends with the headers.
    let mut get = epp.open().await;
    get.send(request_headers(&[(":method", "GET")], true)).await;
    let answer = get.recv_full().await;
    assert_eq!(destination(&answer), sim.addr);
    epp.b.wait_in_flight(1, PROMPTLY).await;
    get.send(response_headers(204, true)).await;
    get.recv().await;
    epp.b.wait_in_flight(0, PROMPTLY).await;

    // Request trailers end a full-duplex body too.
    let mut t = epp.open().await;
    let mut headers = request_headers(&[], false);
    headers.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: full_duplex,
        response_body_mode: full_duplex,
        ..ProtocolConfiguration::default()
    });
    t.send(headers).await;
    t.send(body_message(
        chat_for(Some("m"), "hi").to_string().into_bytes(),
        false,
    ))
    .await;
    t.send(message(processing_request::Request::RequestTrailers(
        HttpTrailers::default(),
    )))
    .await;
    assert_eq!(destination(&t.recv_full().await), sim.addr);
    let processing_response::Response::RequestBody(_) = t.recv().await else {
        panic!("expected the body streamed back");
    };
    assert!(matches!(
        t.recv().await,
        processing_response::Response::RequestTrailers(_)
    ));
}

/// The subset hint narrows the choice; an empty or dead subset is 503; an
/// unknown model 404; a shed request 429; one that waited past its TTL
/// 504; bad bodies and headers 400: each as an immediate response with the
/// proxy's error body and drop reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subset_hints_narrow_the_choice_and_every_refusal_is_an_immediate_response() {
    let config = ConfigFile::new(
        "flowControl:\n  maxRequests: 4\n  priorityBands:\n  - priority: -1\n    \
         maxRequests: 1\nobjectives:\n  batch: -1\n",
    );
    let epp = Epp::start(&["--config", config.arg()]).await;
    let one = Sim::start(&["--model", "m", "--slots", "1"]);
    let two = Sim::start(&["--model", "m", "--slots", "1"]);
    let (_a1, _a2) = (agent(&one, &epp.b), agent(&two, &epp.b));
    epp.b.wait_eligible(2).await;
    let body = chat_for(Some("m"), "hello");

    // The hint names `two`: every request goes there, one at a time.
    let hint = two.addr.to_string();
    for _ in 0..3 {
        let mut x = epp.open().await;
        x.send(with_subset(request_headers(&[], false), &[&hint]))
            .await;
        x.recv().await;
        x.send(body_message(body.to_string().into_bytes(), true))
            .await;
        assert_eq!(destination(&x.recv_full().await), two.addr);
        x.respond(200, b"{}").await;
    }

    let refused = |extra: &'static [(&'static str, &'static str)], body: Vec<u8>| {
        let epp = &epp;
        async move {
            let mut x = epp.open().await;
            x.send(request_headers(extra, false)).await;
            x.recv().await;
            x.send(body_message(body, true)).await;
            immediate(x.recv().await)
        }
    };
    let hinted = |subset: &'static [&'static str]| {
        let epp = &epp;
        let body = body.to_string().into_bytes();
        async move {
            let mut x = epp.open().await;
            x.send(with_subset(request_headers(&[], false), subset))
                .await;
            x.recv().await;
            x.send(body_message(body, true)).await;
            immediate(x.recv().await)
        }
    };
    for subset in [&[][..], &["127.0.0.1:1"], &["not an address"]] {
        let (status, headers, _) = hinted(subset).await;
        assert_eq!(status, 503, "subset {subset:?}");
        assert_eq!(headers["x-flowgate-drop-reason"], "no-endpoints");
        assert!(headers.contains_key("retry-after"));
    }
    let (status, headers, err) =
        refused(&[], chat_for(Some("nope"), "hi").to_string().into_bytes()).await;
    assert_eq!(
        (status, headers["x-flowgate-drop-reason"].as_str()),
        (404, "model_not_found")
    );
    assert_eq!(err["error"]["code"], "model_not_found");
    let (status, _, err) = refused(&[], b"not json".to_vec()).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (400, Some("invalid_json"))
    );
    let (status, _, err) = refused(
        &[("x-gateway-inference-fairness-id", "has spaces")],
        body.to_string().into_bytes(),
    )
    .await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (400, Some("invalid_header"))
    );

    // Fill both servers, then: 504 after the request's own TTL, and 429
    // for a second batch request over its band's limit of 1.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut x = epp.open().await;
        let answer = x.request(&[], &body).await;
        destination(&answer);
        held.push(x);
    }
    let (status, headers, _) = refused(
        &[("x-flowgate-request-ttl", "200ms")],
        body.to_string().into_bytes(),
    )
    .await;
    assert_eq!(
        (status, headers["x-flowgate-drop-reason"].as_str()),
        (504, "ttl-expired")
    );
    let mut batch = epp.open().await;
    batch
        .send(request_headers(
            &[("x-gateway-inference-objective", "batch")],
            false,
        ))
        .await;
    batch.recv().await;
    batch
        .send(body_message(body.to_string().into_bytes(), true))
        .await;
    epp.b.wait_buffered(1).await;
    let (status, headers, _) = refused(
        &[("x-gateway-inference-objective", "batch")],
        body.to_string().into_bytes(),
    )
    .await;
    assert_eq!(
        (status, headers["x-flowgate-drop-reason"].as_str()),
        (429, "shed")
    );
    assert!(headers.contains_key("retry-after"));
    // The waiting batch request gets the first slot that frees.
    let mut first = held.remove(0);
    first.respond(200, b"{}").await;
    destination(&batch.recv_full().await);
}

/// Envoy dropping streams (a client gone, a timeout) leaks nothing: a
/// waiting request leaves the queue, a placed one gives its slot back. Then
/// 100 concurrent streams, a tenth of them cancelled after placement, go
/// through two 4-slot servers: never more than 4 at a time on either, all
/// the others answered 200, and nothing left in flight or queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_streams_and_a_hundred_concurrent_ones_leak_no_slot() {
    let epp = Epp::start(&["--max-buffered-requests", "200"]).await;
    let one = Sim::start(&["--model", "m", "--slots", "4"]);
    let two = Sim::start(&["--model", "m", "--slots", "4"]);
    let (_a1, _a2) = (agent(&one, &epp.b), agent(&two, &epp.b));
    epp.b.wait_eligible(2).await;
    let body = chat_for(Some("m"), "hello");

    let mut placed = Vec::new();
    for _ in 0..8 {
        let mut x = epp.open().await;
        destination(&x.request(&[], &body).await);
        placed.push(x);
    }
    let mut waiting = epp.open().await;
    // A TTL far beyond the test's deadlines: only the drop can end its wait.
    waiting
        .send(request_headers(&[("x-flowgate-request-ttl", "60s")], false))
        .await;
    waiting.recv().await;
    waiting
        .send(body_message(body.to_string().into_bytes(), true))
        .await;
    epp.b.wait_buffered(1).await;
    drop(waiting);
    epp.b.wait_buffered(0).await;
    assert_eq!(epp.b.in_flight().await, 8);
    placed.truncate(3);
    epp.b.wait_in_flight(3, PROMPTLY).await;
    drop(placed);
    epp.b.wait_in_flight(0, PROMPTLY).await;

    let mut streams = Vec::new();
    for i in 0..100 {
        let epp_channel = epp.channel.clone();
        let body = body.clone();
        streams.push(tokio::spawn(async move {
            let e = EppClient(epp_channel);
            let mut x = e.open().await;
            let answer = x.request(&[], &body).await;
            let to = destination(&answer);
            if i % 10 == 0 {
                return None; // Envoy drops the stream
            }
            let (status, reply) = forward(to, &body).await;
            x.respond(status, &reply).await;
            Some(status)
        }));
    }
    let mut served = 0;
    for s in streams {
        if let Some(status) = s.await.expect("stream task") {
            assert_eq!(status, 200);
            served += 1;
        }
    }
    assert_eq!(served, 90);
    epp.b.wait_in_flight(0, PROMPTLY).await;
    assert_eq!(epp.b.buffered().await, 0);
    for sim in [&one, &two] {
        let stats = sim.stats().await;
        assert!(
            stats["max_processing"].as_u64().unwrap() <= 4,
            "a server got more than its slots: {stats}"
        );
        assert_eq!(stats["max_deferred"], 0, "nothing queued inside a server");
    }
    assert_eq!(
        metric(
            &epp.b,
            "flowgate_epp_requests_total",
            &[("outcome", "picked")]
        )
        .await,
        108.0,
        "8 placed, 100 concurrent; the one dropped while waiting was never placed"
    );
}

/// A stream opener usable from spawned tasks.
struct EppClient(Channel);

impl EppClient {
    async fn open(&self) -> Exchange {
        let (tx, rx) = mpsc::channel(16);
        let rx = ExternalProcessorClient::new(self.0.clone())
            .process(ReceiverStream::new(rx))
            .await
            .expect("the EPP accepts the stream")
            .into_inner();
        Exchange { tx, rx }
    }
}

/// With API keys, EPP mode admits requests as the proxy does: no key or an
/// unknown one is a 401 immediate response, a valid one is placed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_api_keys_envoy_requests_need_a_key_as_at_the_proxy() {
    let keys = ConfigFile::new("keys:\n  - key: sk-alpha\n    tenant: alpha\n");
    let epp = Epp::start(&["--api-keys-file", keys.arg()]).await;
    let sim = Sim::start(&["--model", "m", "--slots", "1"]);
    let _a = agent(&sim, &epp.b);
    epp.b.wait_eligible(1).await;
    let body = chat_for(Some("m"), "hello");
    for (headers, code) in [
        (vec![], "missing_api_key"),
        (vec![("authorization", "Bearer sk-beta")], "invalid_api_key"),
    ] {
        let mut x = epp.open().await;
        x.send(request_headers(&headers, false)).await;
        let _ = x.recv().await;
        x.send(body_message(serde_json::to_vec(&body).unwrap(), true))
            .await;
        let (status, h, err) = immediate(x.recv().await);
        assert_eq!(status, 401, "{err}");
        assert_eq!(err["error"]["code"], code, "{err}");
        assert_eq!(h["www-authenticate"], "Bearer");
    }
    let mut x = epp.open().await;
    let placed = x
        .request(&[("authorization", "Bearer sk-alpha")], &body)
        .await;
    assert_eq!(destination(&placed), sim.addr);
    x.respond(200, b"{}").await;
}

/// The model rules hold behind Envoy as at the proxy: an alias reaches an
/// engine that checks names under the served name — the body streamed back
/// renamed (full duplex, with its new length) or replaced (buffered) — and
/// the response says which model served it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_aliases_rename_the_body_envoy_sends_on() {
    let epp = Epp::start(&["--model-alias", "gpt-4o-mini=m"]).await;
    let sim = Sim::start(&["--model", "m", "--strict-model", "--slots", "2"]);
    let _a = agent(&sim, &epp.b);
    epp.b.wait_eligible(1).await;
    let asked = chat_for(Some("gpt-4o-mini"), "hi");
    let mut sent = asked.clone();
    sent["model"] = "m".into();

    // Full duplex: the new length with the destination, the body after.
    let mut x = epp.open().await;
    let mut headers = request_headers(&[], false);
    let full_duplex = BodySendMode::FullDuplexStreamed as i32;
    headers.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: full_duplex,
        response_body_mode: BodySendMode::None as i32,
        ..ProtocolConfiguration::default()
    });
    x.send(headers).await;
    x.send(body_message(asked.to_string().into_bytes(), true))
        .await;
    let first = x.recv_full().await;
    assert_eq!(destination(&first), sim.addr);
    let set = set_headers(common_of(&first).header_mutation.as_ref());
    let processing_response::Response::RequestBody(b) = x.recv().await else {
        panic!("expected the body streamed back");
    };
    let Some(body_mutation::Mutation::StreamedResponse(chunk)) =
        b.response.unwrap().body_mutation.unwrap().mutation
    else {
        panic!("expected a streamed body chunk");
    };
    let body: Value = serde_json::from_slice(&chunk.body).unwrap();
    assert_eq!(body, sent);
    assert_eq!(set["content-length"], chunk.body.len().to_string());
    assert_eq!(forward(sim.addr, &body).await.0, 200, "the engine takes it");
    x.send(response_headers(200, true)).await;
    let processing_response::Response::ResponseHeaders(h) = x.recv().await else {
        panic!("expected the response headers' answer");
    };
    let set = set_headers(h.response.and_then(|c| c.header_mutation).as_ref());
    assert_eq!(set["x-flowgate-served-model"], "m");

    // Buffered: the whole new body in the body's answer.
    let mut y = epp.open().await;
    y.send(request_headers(&[], false)).await;
    y.recv().await;
    y.send(body_message(asked.to_string().into_bytes(), true))
        .await;
    let answer = y.recv_full().await;
    assert_eq!(destination(&answer), sim.addr);
    let Some(body_mutation::Mutation::Body(replaced)) = common_of(&answer)
        .body_mutation
        .clone()
        .and_then(|m| m.mutation)
    else {
        panic!("expected the body replaced: {answer:?}");
    };
    assert_eq!(serde_json::from_slice::<Value>(&replaced).unwrap(), sent);
    y.send(response_headers(200, true)).await;
    y.recv().await;
    epp.b.wait_in_flight(0, PROMPTLY).await;
    // Without the alias the engine refuses the name: the rename is what
    // made it pass.
    assert_eq!(forward(sim.addr, &asked).await.0, 404);
}

/// Quotas hold behind Envoy as at the proxy: the response carries the
/// quota's headers, and a request over it is an immediate 429
/// `quota_exceeded` with `Retry-After` and the same headers; what an
/// answer's body says it used is accounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_hold_behind_envoy() {
    let config = ConfigFile::new("quotas:\n  tenants:\n    alpha: {requestsPerMinute: 1}\n");
    let epp = Epp::start(&["--config", config.arg()]).await;
    let sim = Sim::start(&["--model", "m", "--slots", "2"]);
    let _a = agent(&sim, &epp.b);
    epp.b.wait_eligible(1).await;
    let tenant = [("x-gateway-inference-fairness-id", "alpha")];
    let body = chat_for(Some("m"), "hello");
    let mut x = epp.open().await;
    let placed = x.request(&tenant, &body).await;
    assert_eq!(destination(&placed), sim.addr);
    x.send(response_headers(200, true)).await;
    let processing_response::Response::ResponseHeaders(h) = x.recv().await else {
        panic!("expected the response headers' answer");
    };
    let set = set_headers(h.response.and_then(|c| c.header_mutation).as_ref());
    assert_eq!(set["x-ratelimit-limit-requests"], "1");
    assert_eq!(set["x-ratelimit-remaining-requests"], "0");

    let mut y = epp.open().await;
    y.send(request_headers(&tenant, false)).await;
    let _ = y.recv().await;
    y.send(body_message(serde_json::to_vec(&body).unwrap(), true))
        .await;
    let (status, h, err) = immediate(y.recv().await);
    assert_eq!(status, 429, "{err}");
    assert_eq!(err["error"]["code"], "quota_exceeded", "{err}");
    assert_eq!(h["x-ratelimit-remaining-requests"], "0");
    assert!(h["retry-after"].parse::<u64>().unwrap() >= 1);
    // Another tenant is not touched; the usage its answer's body reports
    // (Envoy sends response bodies) is accounted as at the proxy.
    let mut z = epp.open().await;
    let placed = z.request(&[], &body).await;
    assert_eq!(destination(&placed), sim.addr);
    z.respond(
        200,
        br#"{"usage":{"prompt_tokens":7,"completion_tokens":3}}"#,
    )
    .await;
    let usage = wait_for("the usage accounted", Duration::from_secs(5), || async {
        let u = get_json(&epp.b.mgmt("/api/v1/usage?tenant=default")).await;
        (u["tenants"][0]["completion_tokens"] == 3).then_some(u)
    })
    .await;
    assert_eq!(usage["tenants"][0]["prompt_tokens"], 7, "{usage}");
}

/// A session key read from Envoy's headers (Codex's `session_id` here) or
/// the body keeps a conversation on one endpoint as at the proxy, although
/// its prompts share nothing; without one, equal endpoints take turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_hold_behind_envoy_too() {
    let epp = Epp::start(&[]).await;
    let sims: Vec<Sim> = (0..3)
        .map(|_| Sim::start(&["--model", "m", "--slots", "4"]))
        .collect();
    let _agents: Vec<_> = sims.iter().map(|s| agent(s, &epp.b)).collect();
    epp.b.wait_eligible(3).await;
    let destinations = |headers: &'static [(&'static str, &'static str)], cache_key: bool| {
        let epp = &epp;
        async move {
            let mut seen = Vec::new();
            for turn in 0..5 {
                let mut body =
                    chat_for(Some("m"), &format!("turn {turn} {}", turn * 31).repeat(30));
                if cache_key {
                    body["prompt_cache_key"] = "conv-7".into();
                }
                let mut x = epp.open().await;
                let to = destination(&x.request(headers, &body).await);
                x.respond(200, b"{}").await;
                seen.push(to);
            }
            seen.dedup();
            seen
        }
    };
    assert_eq!(
        destinations(&[("session_id", "codex-1")], false)
            .await
            .len(),
        1
    );
    assert_eq!(destinations(&[], true).await.len(), 1);
    assert!(
        destinations(&[], false).await.len() > 1,
        "no key: turns spread"
    );
}

/// Two balancers in EPP mode sharing session bindings through Redis: a
/// conversation without a key whose first turn one of them sent to a
/// server (chosen by a subset hint here) has its next turn sent there by
/// the other, which never saw it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_envoy_a_conversation_is_followed_across_balancers_through_redis() {
    let redis = Redis::start().await;
    let args = ["--sessions-redis-url", redis.url.as_str()];
    let (one, two) = (Epp::start(&args).await, Epp::start(&args).await);
    let sims: Vec<Sim> = (0..3)
        .map(|_| Sim::start(&["--model", "m", "--slots", "4"]))
        .collect();
    let _agents = agents_for_both(sims.iter().map(|s| s.addr), &one.b, &two.b, &[]).await;
    // Neither one fixed choice nor taking turns sends the second turns to
    // these servers.
    for (conv, k) in [2usize, 2, 0, 0].into_iter().enumerate() {
        let tag = format!("conversation {conv}");
        let hint = sims[k].addr.to_string();
        let mut x = one.open().await;
        x.send(with_subset(request_headers(&[], false), &[&hint]))
            .await;
        x.recv().await;
        let first = conversation_turn("m", &tag, 0);
        x.send(body_message(first.to_string().into_bytes(), true))
            .await;
        assert_eq!(destination(&x.recv_full().await), sims[k].addr);
        x.respond(200, b"{}").await;
        // Each turn so far is shared (the writes are queued).
        wait_for("the turns shared", PROMPTLY, || async {
            (redis.session_bindings().len() > 2 * conv).then_some(())
        })
        .await;
        let mut x = two.open().await;
        let to = destination(&x.request(&[], &conversation_turn("m", &tag, 1)).await);
        x.respond(200, b"{}").await;
        assert_eq!(
            to, sims[k].addr,
            "{tag} went elsewhere at the other balancer"
        );
    }
}
