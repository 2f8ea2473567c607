//! EPP mode: the scheduler behind Envoy's external-processing protocol
//! (`envoy.service.ext_proc.v3.ExternalProcessor`), as the Gateway API
//! Inference Extension's Endpoint Picker Protocol uses it.
//!
//! Envoy opens one `Process` stream per HTTP request. Flowgate reads the
//! request headers (fairness id, objective, priority, TTL) and the buffered
//! body (model, prompt for prefix affinity), holds the request in the same
//! flow control as the proxy, then answers with the chosen endpoint, both as
//! the request header `x-gateway-destination-endpoint` and in the dynamic
//! metadata namespace `envoy.lb` under the same key; Envoy's
//! `ORIGINAL_DST` cluster sends the request there. The endpoint's slot is
//! held until Envoy reports the end of the response (or of the stream).
//!
//! Request body modes (from the stream's `protocol_config`; `BUFFERED` when
//! Envoy sends none):
//! - `BUFFERED` / `BUFFERED_PARTIAL`: the headers are answered CONTINUE, the
//!   answer to the (last) body message carries the destination.
//! - `FULL_DUPLEX_STREAMED`: nothing is answered until the body ended; then
//!   the headers answer carries the destination and the body is streamed
//!   back in 62,000-byte chunks, as the GIE's reference EPP does.
//! - `NONE`, or headers with `end_of_stream`: the request is placed from
//!   its headers alone (no model, no prompt).
//!
//! `STREAMED` request bodies cannot be routed (the headers go upstream
//! before the body is seen) and are treated like `BUFFERED` chunk by chunk:
//! configure Envoy with `BUFFERED` or `FULL_DUPLEX_STREAMED`.
//!
//! Refusals are `ImmediateResponse`s with the proxy's status codes and
//! bodies: 404 unknown model, 429 shed, 503 no endpoint (or an empty subset
//! hint), 504 waited past the TTL, 400 / 413 bad requests.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use flowgate::admission::{AdmissionRules, Caller, FlowHeaders};
use flowgate::RequestMeta;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info};

use crate::auth::ApiKeys;
use crate::gate::{AdmitError, FleetGate, LeaseGuard};
use crate::reply::{Answer, Refusal};
use flowgate::blame::{self, Verdict};

/// Request header (and `envoy.lb` metadata key) naming the chosen endpoint.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Dynamic metadata namespace Envoy's load balancer reads.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Filter metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset hint: a list of `ip:port` (or bare `ip`) strings.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Size of the body chunks streamed back in `FULL_DUPLEX_STREAMED` mode.
const BODY_CHUNK: usize = 62_000;
/// Names the gRPC health service reports as serving.
const HEALTH_NAMES: [&str; 3] = [
    "liveness",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

/// The EPP gRPC service, sharing the proxy's state.
pub struct Epp {
    pub shared: Arc<FleetGate>,
    /// How a request's facts are read (the same rules at every door).
    pub admission: AdmissionRules,
    /// When set, every request needs one of these keys (in
    /// `authorization`, as Envoy passes it on).
    pub api_keys: Option<Arc<ApiKeys>>,
    pub max_request_bytes: usize,
    pub retry_after: std::time::Duration,
}

type Reply = Result<ProcessingResponse, Status>;

/// The gRPC face of [`Epp`].
pub struct Processor(pub Arc<Epp>);

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = ReceiverStream<Reply>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // Envoy waits for each answer before it sends more, except in
        // full-duplex mode where the body is echoed back chunk by chunk.
        let (tx, rx) = mpsc::channel(8);
        let exchange = Exchange::new(Arc::clone(&self.0), tx);
        tokio::spawn(exchange.run(request.into_inner()));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The request headers admission reads (flow control's and
/// `authorization`), lower-cased names with their values.
#[derive(Default)]
struct KeptHeaders(Vec<(&'static str, Vec<u8>)>);

impl KeptHeaders {
    fn keep(&mut self, name: &str, value: &[u8]) {
        let wanted = FlowHeaders::NAMES
            .iter()
            .chain(&[AUTHORIZATION])
            .find(|n| n.eq_ignore_ascii_case(name));
        if let Some(n) = wanted {
            self.0.retain(|(k, _)| k != n);
            self.0.push((n, value.to_vec()));
        }
    }

    fn get(&self, name: &str) -> Option<&[u8]> {
        self.0
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }
}

const AUTHORIZATION: &str = "authorization";

/// Envoy went away (the stream ended or broke): nothing more to answer.
struct Gone;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyMode {
    /// No body is sent.
    None,
    /// Envoy waits for an answer to each body message.
    Buffered,
    /// The body is streamed and must be streamed back.
    FullDuplex,
}

impl BodyMode {
    fn from_wire(mode: i32) -> Self {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::None) => BodyMode::None,
            Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
            _ => BodyMode::Buffered,
        }
    }
}

/// One `Process` stream: one HTTP request through Envoy.
struct Exchange {
    epp: Arc<Epp>,
    tx: mpsc::Sender<Reply>,
    request_mode: BodyMode,
    response_mode: BodyMode,
    headers: KeptHeaders,
    /// The subset hint's entries, if the request carried one.
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    /// The slot on the chosen endpoint, held until the response ends.
    lease: Option<LeaseGuard>,
    /// Whether the request was placed (or refused).
    decided: bool,
    /// The request or its answer is streamed (the engine stops when the
    /// client leaves).
    streamed: bool,
    /// The response headers came through.
    answered: bool,
}

impl Exchange {
    fn new(epp: Arc<Epp>, tx: mpsc::Sender<Reply>) -> Self {
        Exchange {
            epp,
            tx,
            // Until Envoy says otherwise (protocol_config).
            request_mode: BodyMode::Buffered,
            response_mode: BodyMode::Buffered,
            headers: KeptHeaders::default(),
            subset: None,
            body: Vec::new(),
            lease: None,
            decided: false,
            streamed: false,
            answered: false,
        }
    }

    /// Answers Envoy's messages until the stream ends. A lease still held
    /// then is a request whose answer did not end (its client or Envoy
    /// left): its slot is orphaned, free once the engine is done with it.
    async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
        loop {
            let message = match inbound.message().await {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(status) => {
                    debug!(%status, "EPP stream ended by an error");
                    break;
                }
            };
            if self.step(message).await.is_err() {
                break;
            }
        }
        if let Some(lease) = self.lease.take() {
            if self.answered && self.response_mode == BodyMode::None {
                // Envoy sends no response body: the stream's end is the
                // answer's, as far as this side can tell.
                lease.release();
            } else {
                lease.orphan(self.streamed);
            }
        }
    }

    async fn step(&mut self, message: ProcessingRequest) -> Result<(), Gone> {
        if let Some(config) = &message.protocol_config {
            self.request_mode = BodyMode::from_wire(config.request_body_mode);
            self.response_mode = BodyMode::from_wire(config.response_body_mode);
        }
        if let Some(metadata) = &message.metadata_context {
            if let Some(hint) = subset_hint(metadata) {
                self.subset = Some(hint);
            }
        }
        use processing_request::Request as In;
        match message.request {
            Some(In::RequestHeaders(h)) => self.on_request_headers(h).await,
            Some(In::RequestBody(b)) => self.on_request_body(b).await,
            Some(In::RequestTrailers(_)) => {
                if !self.decided {
                    // Full duplex: trailers mark the end of the body.
                    self.decide(Phase::Body {
                        ended_by_trailers: true,
                    })
                    .await?;
                }
                self.send(reply(processing_response::Response::RequestTrailers(
                    TrailersResponse::default(),
                )))
                .await
            }
            Some(In::ResponseHeaders(h)) => self.on_response_headers(h).await,
            Some(In::ResponseBody(b)) => self.on_response_body(b).await,
            Some(In::ResponseTrailers(_)) => {
                self.finish();
                self.send(reply(processing_response::Response::ResponseTrailers(
                    TrailersResponse::default(),
                )))
                .await
            }
            // Flow-control window updates and the like: nothing to answer.
            None => Ok(()),
        }
    }

    async fn on_request_headers(&mut self, h: HttpHeaders) -> Result<(), Gone> {
        for (name, value) in header_pairs(h.headers.as_ref()) {
            self.headers.keep(name, value);
        }
        if h.end_of_stream || self.request_mode == BodyMode::None {
            return self.decide(Phase::Headers).await;
        }
        match self.request_mode {
            // The destination goes with the headers answer, once the body
            // is in.
            BodyMode::FullDuplex => Ok(()),
            _ => {
                self.send(reply(processing_response::Response::RequestHeaders(
                    HeadersResponse::default(),
                )))
                .await
            }
        }
    }

    async fn on_request_body(&mut self, b: HttpBody) -> Result<(), Gone> {
        if self.decided {
            // Past the decision (a body after a headers-only decision):
            // let it through.
            return self.send(continue_body()).await;
        }
        if self.body.len() + b.body.len() > self.epp.max_request_bytes {
            return self
                .refuse(Refusal::too_large(self.epp.max_request_bytes))
                .await;
        }
        self.body.extend_from_slice(&b.body);
        if b.end_of_stream {
            return self
                .decide(Phase::Body {
                    ended_by_trailers: false,
                })
                .await;
        }
        match self.request_mode {
            BodyMode::FullDuplex => Ok(()),
            // STREAMED: Envoy wants an answer per chunk.
            _ => self.send(continue_body()).await,
        }
    }

    async fn on_response_headers(&mut self, h: HttpHeaders) -> Result<(), Gone> {
        self.answered = true;
        let mut status = None;
        let mut json = false;
        for (name, value) in header_pairs(h.headers.as_ref()) {
            if name == ":status" {
                status = std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.parse::<u16>().ok());
            } else if name.eq_ignore_ascii_case("content-type") {
                json = blame::is_json_content_type(value);
                self.streamed |= value.starts_with(b"text/event-stream");
            }
        }
        if let (Some(code), Some(lease)) = (status, &self.lease) {
            // Whose fault, as in the proxy ([`flowgate::blame`]); Envoy
            // retries on its own, so a suspect 5xx counts here.
            let reason = match blame::verdict(code, json) {
                Verdict::Fine => {
                    self.epp.shared.record_outcome(lease, true);
                    ""
                }
                Verdict::RequestRejected => "request-rejected",
                Verdict::Suspect => {
                    self.epp.shared.record_outcome(lease, false);
                    ""
                }
            };
            self.epp.shared.metrics.record_outcome(code, reason);
        }
        if h.end_of_stream {
            self.finish();
        }
        self.send(reply(processing_response::Response::ResponseHeaders(
            HeadersResponse::default(),
        )))
        .await
    }

    async fn on_response_body(&mut self, b: HttpBody) -> Result<(), Gone> {
        if b.end_of_stream {
            self.finish();
        }
        let answer = match self.response_mode {
            BodyMode::FullDuplex => streamed_body(
                processing_response::Response::ResponseBody,
                b.body,
                b.end_of_stream,
            ),
            _ => reply(processing_response::Response::ResponseBody(
                BodyResponse::default(),
            )),
        };
        self.send(answer).await
    }

    /// The response ended: the endpoint's slot is free again.
    fn finish(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.release();
        }
    }

    /// Places the request (waiting in flow control as long as it must) and
    /// answers Envoy with the destination, or refuses it.
    async fn decide(&mut self, phase: Phase) -> Result<(), Gone> {
        self.decided = true;
        let request = match self.request_meta() {
            Ok(r) => r,
            Err(refusal) => return self.refuse(refusal).await,
        };
        let model = request.route.model.as_deref().unwrap_or("").to_string();
        let tx = self.tx.clone();
        let gone = async move { tx.closed().await };
        let (lease, waited) = match self.epp.shared.admit(request, gone).await {
            Ok(granted) => granted,
            Err(AdmitError::Rejected(r)) => {
                return self.refuse(Refusal::from_reject(r, &model)).await
            }
            Err(AdmitError::ClientGone) => {
                self.epp.shared.metrics.epp_request("client-gone");
                return Err(Gone);
            }
        };
        let destination = lease.addr().to_string();
        self.lease = Some(lease);
        self.epp.shared.metrics.epp_request("picked");
        debug!(
            endpoint = %destination,
            model,
            wait_ms = waited.as_millis() as u64,
            "EPP picked an endpoint"
        );
        let common = CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: vec![header(DESTINATION, &destination)],
                remove_headers: Vec::new(),
            }),
            clear_route_cache: true,
            ..CommonResponse::default()
        };
        use processing_response::Response as Out;
        // Full duplex, and requests without a body, learn the destination
        // with the headers answer; buffered bodies with the body answer.
        let full_duplex = self.request_mode == BodyMode::FullDuplex;
        let mut answer = reply(match phase {
            Phase::Body { .. } if !full_duplex => Out::RequestBody(BodyResponse {
                response: Some(common),
            }),
            _ => Out::RequestHeaders(HeadersResponse {
                response: Some(common),
            }),
        });
        answer.dynamic_metadata = Some(destination_metadata(&destination));
        self.send(answer).await?;
        let body = std::mem::take(&mut self.body);
        let (Phase::Body { ended_by_trailers }, true) = (phase, full_duplex) else {
            return Ok(());
        };
        // Stream the body back; an empty one still needs its one (last)
        // message.
        let mut chunks: Vec<&[u8]> = body.chunks(BODY_CHUNK).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        let n = chunks.len();
        for (i, chunk) in chunks.into_iter().enumerate() {
            // With trailers still to answer, the body does not end here.
            let last = i + 1 == n && !ended_by_trailers;
            self.send(streamed_body(Out::RequestBody, chunk.to_vec(), last))
                .await?;
        }
        Ok(())
    }

    /// What flow control needs to know of the request: the admission step
    /// every door shares (an API key, when keys are on, fixes the tenant
    /// and caps the priority, as at the proxy).
    fn request_meta(&mut self) -> Result<RequestMeta, Refusal> {
        let grant = match &self.epp.api_keys {
            Some(keys) => Some(
                keys.authenticate(self.headers.get(AUTHORIZATION))
                    .map_err(Refusal::unauthorized)?
                    .clone(),
            ),
            None => None,
        };
        let caller = grant.as_ref().map_or(Caller::Anonymous, Caller::Key);
        let body = (!self.body.is_empty()).then_some(self.body.as_slice());
        let headers = &self.headers;
        let facts = self.epp.admission.inference(
            FlowHeaders::read(|name| headers.get(name)),
            body,
            caller,
        )?;
        self.streamed = facts.stream;
        let mut meta = facts.meta;
        if let Some(entries) = &self.subset {
            meta.route.subset = Some(self.resolve_subset(entries).into());
        }
        Ok(meta)
    }

    /// The subset hint as sorted endpoint addresses: `ip:port` entries as
    /// they are, a bare `ip` as every registered endpoint at that address.
    /// Entries that are neither are ignored (none left: 503).
    fn resolve_subset(&self, entries: &[String]) -> Vec<SocketAddr> {
        let mut addrs = Vec::with_capacity(entries.len());
        let mut bare = Vec::new();
        for e in entries {
            let e = e.trim();
            if let Ok(a) = e.parse::<SocketAddr>() {
                addrs.push(a);
            } else if let Ok(ip) = e.parse::<IpAddr>() {
                bare.push(ip);
            } else {
                debug!(entry = e, "EPP subset hint: not an ip:port, ignored");
            }
        }
        if !bare.is_empty() {
            addrs.extend(
                self.epp
                    .shared
                    .endpoint_addrs()
                    .into_iter()
                    .filter(|a| bare.contains(&a.ip())),
            );
        }
        addrs.sort_unstable();
        addrs.dedup();
        addrs
    }

    /// Answers the request itself (Envoy sends this to the client).
    async fn refuse(&mut self, r: Refusal) -> Result<(), Gone> {
        self.decided = true;
        let m = &self.epp.shared.metrics;
        m.epp_request(r.reason);
        m.record_outcome(r.status.as_u16(), r.reason);
        info!(
            status = r.status.as_u16(),
            reason = r.reason,
            "EPP answered the request itself"
        );
        // The same answer the proxy gives, carried by Envoy.
        let a = Answer::refusal(&r, self.epp.retry_after);
        let mut headers = vec![header("content-type", a.content_type)];
        headers.extend(a.headers.iter().map(|(k, v)| header(k, v)));
        let answer = ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(r.status.as_u16()),
            }),
            headers: Some(HeaderMutation {
                set_headers: headers,
                remove_headers: Vec::new(),
            }),
            body: a.body,
            grpc_status: None,
            details: format!("flowgate_{}", r.reason.replace('-', "_")),
        };
        self.send(reply(processing_response::Response::ImmediateResponse(
            answer,
        )))
        .await?;
        // Envoy ends the exchange after an immediate response.
        Err(Gone)
    }

    async fn send(&self, r: ProcessingResponse) -> Result<(), Gone> {
        self.tx.send(Ok(r)).await.map_err(|_| Gone)
    }
}

/// Where the request was placed from.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Its headers (no body).
    Headers,
    /// The end of its body.
    Body { ended_by_trailers: bool },
}

fn reply(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

fn continue_body() -> ProcessingResponse {
    reply(processing_response::Response::RequestBody(
        BodyResponse::default(),
    ))
}

/// A body chunk streamed back (full-duplex mode).
fn streamed_body(
    wrap: fn(BodyResponse) -> processing_response::Response,
    body: Vec<u8>,
    end_of_stream: bool,
) -> ProcessingResponse {
    reply(wrap(BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..StreamedBodyResponse::default()
                    },
                )),
            }),
            ..CommonResponse::default()
        }),
    }))
}

/// A header to set, replacing any value it had.
fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// `envoy.lb: { x-gateway-destination-endpoint: <destination> }`.
fn destination_metadata(destination: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION.to_string(),
            Value {
                kind: Some(Kind::StringValue(destination.to_string())),
            },
        )]
        .into(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

/// Header names and values; Envoy sends values in `raw_value`, some
/// clients in `value`.
fn header_pairs(map: Option<&HeaderMap>) -> impl Iterator<Item = (&str, &[u8])> {
    map.into_iter().flat_map(|m| m.headers.iter()).map(|h| {
        let value = if h.raw_value.is_empty() {
            h.value.as_bytes()
        } else {
            &h.raw_value
        };
        (h.key.as_str(), value)
    })
}

/// The subset hint's entries, if the metadata carries one (a list of
/// strings, or one comma-separated string).
fn subset_hint(metadata: &Metadata) -> Option<Vec<String>> {
    let value = metadata
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET_KEY)?;
    match value.kind.as_ref()? {
        Kind::ListValue(list) => Some(
            list.values
                .iter()
                .filter_map(|v| match v.kind.as_ref()? {
                    Kind::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
        ),
        Kind::StringValue(s) => Some(
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
        ),
        _ => Some(Vec::new()),
    }
}

/// Serves EPP mode and gRPC health on `addr` until `shutdown` resolves.
pub async fn serve(
    epp: Arc<Epp>,
    addr: SocketAddr,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let (health, health_service) = tonic_health::server::health_reporter();
    for name in HEALTH_NAMES {
        health
            .set_service_status(name, tonic_health::ServingStatus::Serving)
            .await;
    }
    // Envoy buffers the whole body into one message.
    let max_message = epp.max_request_bytes.saturating_add(64 * 1024);
    let processor =
        ExternalProcessorServer::new(Processor(epp)).max_decoding_message_size(max_message);
    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(processor)
        .serve_with_shutdown(addr, shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    fn string(s: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.into())),
        }
    }

    fn metadata(hint: Value) -> Metadata {
        Metadata {
            filter_metadata: [(
                SUBSET_NAMESPACE.to_string(),
                Struct {
                    fields: [(SUBSET_KEY.to_string(), hint)].into(),
                },
            )]
            .into(),
            ..Metadata::default()
        }
    }

    #[test]
    fn the_subset_hint_is_read_as_a_list_or_a_comma_separated_string() {
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string("10.0.0.1:8000"), string("10.0.0.2:8000")],
            })),
        };
        assert_eq!(
            subset_hint(&metadata(list)).unwrap(),
            ["10.0.0.1:8000", "10.0.0.2:8000"]
        );
        assert_eq!(
            subset_hint(&metadata(string("10.0.0.1:8000, 10.0.0.3:8000"))).unwrap(),
            ["10.0.0.1:8000", "10.0.0.3:8000"]
        );
        // A hint of the wrong shape is an empty hint (503), not no hint.
        let odd = Value {
            kind: Some(Kind::NumberValue(1.0)),
        };
        assert_eq!(subset_hint(&metadata(odd)).unwrap(), Vec::<String>::new());
        assert!(subset_hint(&Metadata::default()).is_none());
    }

    #[test]
    fn the_destination_is_the_same_in_the_header_and_the_metadata() {
        let h = header(DESTINATION, "127.0.0.1:9");
        let value = h.header.unwrap().raw_value;
        let m = destination_metadata("127.0.0.1:9");
        let Some(Kind::StructValue(lb)) = &m.fields[LB_NAMESPACE].kind else {
            panic!("envoy.lb is a struct");
        };
        let Some(Kind::StringValue(v)) = &lb.fields[DESTINATION].kind else {
            panic!("the destination is a string");
        };
        assert_eq!(v.as_bytes(), value.as_slice());
        assert_eq!(
            h.append_action,
            HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            "a client's own destination header is replaced, not appended to"
        );
    }
}
