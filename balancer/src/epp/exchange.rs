//! One HTTP request's `Process` stream: its headers and body in, the
//! request let in by the same door as at the proxy ([`crate::door`]) and
//! placed by the same flow control, the destination (or a refusal) out,
//! the slot held until the response ends.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use flowgate::admission::{Caller, FlowHeaders, Grant, RequestFacts};
use tokio::sync::mpsc;
use tonic::Streaming;
use tracing::{debug, info};

use crate::door::Door;
use crate::gate::{AdmitError, AnswerEnd, LeaseGuard, Served, SlotEnd};
use crate::inference::SERVED_MODEL_HEADER;
use crate::reply::{Answer, Refusal};
use crate::rules::DoorRules;
use flowgate::blame::{self, Verdict};
use flowgate::tokens::TokenEstimate;

use crate::observe::meter::ResponseMeter;

/// Request header (and `envoy.lb` metadata key) naming the chosen endpoint.
use super::wire::{
    continue_body, destination_metadata, header, header_pairs, reply, streamed_body, subset_hint,
};
use super::{Epp, Reply, BODY_CHUNK, DESTINATION};

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
    /// Envoy waits for an answer to the whole body (one message).
    Buffered,
    /// Envoy waits for an answer to each body message (a chunk each).
    Streamed,
    /// The body is streamed and must be streamed back.
    FullDuplex,
}

impl BodyMode {
    fn from_wire(mode: i32) -> Self {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::None) => BodyMode::None,
            Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
            Ok(BodySendMode::Streamed) => BodyMode::Streamed,
            _ => BodyMode::Buffered,
        }
    }
}

/// One `Process` stream: one HTTP request through Envoy.
pub(super) struct Exchange {
    epp: Arc<Epp>,
    /// The rules as they were when the request arrived.
    rules: Arc<DoorRules>,
    tx: mpsc::Sender<Reply>,
    request_mode: BodyMode,
    response_mode: BodyMode,
    headers: KeptHeaders,
    /// The subset hint's entries, if the request carried one.
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    /// The body's `model` was rewritten by the model rules: Envoy must
    /// send the new body (full duplex and buffered modes; in streamed mode
    /// the body already went on).
    body_rewritten: bool,
    /// The model the request was sent for (`x-flowgate-served-model`).
    served_model: Option<Arc<str>>,
    /// What it holds once let in (its quotas' reservation; the slot on
    /// the chosen endpoint), held until the response ends.
    served: Option<Served>,
    /// Whether the request was placed (or refused).
    decided: bool,
    /// The request or its answer is streamed (the engine stops when the
    /// client leaves).
    streamed: bool,
    /// The response headers came through.
    answered: bool,
    /// Its token estimate (what a cut answer's prompt counts).
    tokens: TokenEstimate,
    /// The `x-ratelimit-*` headers for the response.
    rate_headers: Vec<(&'static str, String)>,
    /// What the session store records where it went once answered (with a
    /// store: [`crate::session_store::SessionStore::follow`]).
    store_key: Option<u64>,
    /// The answer's status and what its body said of its usage (when Envoy
    /// sends response bodies).
    status: Option<u16>,
    meter: ResponseMeter,
}

impl Exchange {
    pub(super) fn new(epp: Arc<Epp>, tx: mpsc::Sender<Reply>) -> Self {
        Exchange {
            rules: epp.door.rules.get(),
            epp,
            tx,
            // Until Envoy says otherwise (protocol_config).
            request_mode: BodyMode::Buffered,
            response_mode: BodyMode::Buffered,
            headers: KeptHeaders::default(),
            subset: None,
            body: Vec::new(),
            body_rewritten: false,
            served_model: None,
            served: None,
            decided: false,
            streamed: false,
            answered: false,
            tokens: TokenEstimate::default(),
            rate_headers: Vec::new(),
            store_key: None,
            status: None,
            meter: ResponseMeter::default(),
        }
    }

    /// Answers Envoy's messages until the stream ends. A lease still held
    /// then is a request whose answer did not end (its client or Envoy
    /// left): its slot is orphaned, free once the engine is done with it.
    pub(super) async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
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
        // The stream ended before the response did (or Envoy sends no
        // response body): settled as every door settles a request, with
        // what its answer said so far. One never sent leaves its quotas.
        if self.served.is_some() {
            let slot = if self.answered && self.response_mode == BodyMode::None {
                // Envoy sends no response body: the stream's end is the
                // answer's, as far as this side can tell.
                SlotEnd::Free
            } else {
                SlotEnd::Orphaned {
                    streamed: self.streamed,
                }
            };
            self.settle(self.lease().is_some() || self.answered, slot);
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
                self.meter.streaming = value.starts_with(b"text/event-stream");
            }
        }
        self.status = status;
        if let (Some(code), Some(lease)) = (status, self.lease()) {
            // Whose fault, as in the proxy ([`flowgate::blame`]); Envoy
            // retries on its own, so a suspect 5xx counts here.
            let reason = match blame::verdict(code, json) {
                Verdict::Fine => {
                    self.epp.door.gate.record_outcome(lease, true);
                    if let (Some(store), Some(key)) = (&self.epp.door.session_store, self.store_key)
                    {
                        store.record(key, lease.addr());
                    }
                    ""
                }
                Verdict::RequestRejected => "request-rejected",
                Verdict::Suspect => {
                    self.epp.door.gate.record_outcome(lease, false);
                    ""
                }
            };
            self.epp.door.gate.metrics.record_outcome(code, reason);
        }
        if h.end_of_stream {
            self.finish();
        }
        // Which model answered, as the proxy says it, and the quotas'
        // state.
        let mut set_headers: Vec<_> = self
            .rate_headers
            .iter()
            .map(|(name, value)| header(name, value))
            .collect();
        if let Some(m) = self.served_model.as_deref() {
            set_headers.push(header(SERVED_MODEL_HEADER, m));
        }
        let served = (!set_headers.is_empty()).then(|| HeaderMutation {
            set_headers,
            remove_headers: Vec::new(),
        });
        self.send(reply(processing_response::Response::ResponseHeaders(
            HeadersResponse {
                response: served.map(|m| CommonResponse {
                    header_mutation: Some(m),
                    ..CommonResponse::default()
                }),
            },
        )))
        .await
    }

    async fn on_response_body(&mut self, b: HttpBody) -> Result<(), Gone> {
        if !b.body.is_empty() {
            self.meter.on_chunk(
                &bytes::Bytes::copy_from_slice(&b.body),
                std::time::Instant::now(),
            );
        }
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

    /// The response ended: its usage is accounted and its quotas and
    /// flow settled, then the endpoint's slot is free again.
    fn finish(&mut self) {
        self.settle(true, SlotEnd::Free);
    }

    /// Settles the request ([`Served::finish`]) with what its answer said
    /// it spent (Envoy sent the response body), else its estimate.
    fn settle(&mut self, sent: bool, slot: SlotEnd) {
        let Some(served) = self.served.take() else {
            return;
        };
        let usage = self.meter.usage();
        served.finish(AnswerEnd {
            sent,
            said: self.meter.spent(usage, self.tokens.prompt, self.status),
            // Envoy sends the request: when it did is not seen here.
            timing: None,
            slot,
        });
    }

    /// Its slot, while it holds one.
    fn lease(&self) -> Option<&LeaseGuard> {
        self.served.as_ref()?.lease()
    }

    /// Places the request (waiting in flow control as long as it must) and
    /// answers Envoy with the destination, or refuses it.
    async fn decide(&mut self, phase: Phase) -> Result<(), Gone> {
        self.decided = true;
        let (epp, rules) = (Arc::clone(&self.epp), Arc::clone(&self.rules));
        let door = &epp.door;
        let (mut facts, grant) = match self.request_facts() {
            Ok(r) => r,
            Err(refusal) => return self.refuse(refusal).await,
        };
        let body = (!self.body.is_empty()).then_some(self.body.as_slice());
        let entry = match door.enter(&rules, &mut facts, grant.as_ref(), body).await {
            Ok(entry) => entry,
            Err(refusal) => return self.refuse(refusal).await,
        };
        self.served = Some(entry.served);
        self.rate_headers = entry.rate_headers;
        self.store_key = entry.store_key;
        let request = facts.meta;
        let model = request.route.model.as_deref().unwrap_or("").to_string();
        let tx = self.tx.clone();
        let gone = async move { tx.closed().await };
        let fallback = Door::fallback(&rules, &request);
        let (lease, waited) = match door.gate.admit(request, fallback, gone).await {
            Ok(granted) => {
                if let Some(m) = granted.fell_back {
                    self.fell_back(m);
                }
                (granted.lease, granted.waited)
            }
            Err(AdmitError::Rejected(r)) => {
                // Never sent: it leaves its quotas' windows.
                if let Some(served) = self.served.take() {
                    served.finish(AnswerEnd::NEVER_SENT);
                }
                return self.refuse(door.turned_away(&rules, r, &model)).await;
            }
            Err(AdmitError::ClientGone) => {
                self.epp.decisions.with_label_values(&["client-gone"]).inc();
                return Err(Gone);
            }
        };
        let destination = lease.addr().to_string();
        if let Some(served) = &mut self.served {
            served.bind(lease);
        }
        self.epp.decisions.with_label_values(&["picked"]).inc();
        debug!(
            endpoint = %destination,
            model,
            wait_ms = waited.as_millis() as u64,
            "EPP picked an endpoint"
        );
        let full_duplex = self.request_mode == BodyMode::FullDuplex;
        let mut set_headers = vec![header(DESTINATION, &destination)];
        let mut body_mutation = None;
        if self.body_rewritten {
            if full_duplex {
                // The headers go before the body: they announce its size.
                set_headers.push(header("content-length", &self.body.len().to_string()));
            } else {
                body_mutation = Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::Body(self.body.clone())),
                });
            }
        }
        let common = CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers,
                remove_headers: Vec::new(),
            }),
            body_mutation,
            clear_route_cache: true,
            ..CommonResponse::default()
        };
        use processing_response::Response as Out;
        // Full duplex, and requests without a body, learn the destination
        // with the headers answer; buffered bodies with the body answer.
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

    /// The request goes to fallback model `m`: the engine gets that name
    /// (where Envoy lets the body change).
    fn fell_back(&mut self, m: Arc<str>) {
        self.rename_body(&m);
        self.served_model = Some(m);
    }

    /// Renames the model in the body to `model`, where Envoy takes a new
    /// body from us: full duplex (we stream it back) and buffered (one
    /// body answer); in streamed mode the body's chunks already went on.
    fn rename_body(&mut self, model: &str) {
        if !matches!(self.request_mode, BodyMode::FullDuplex | BodyMode::Buffered) {
            return;
        }
        let form = FlowHeaders::read(|name| self.headers.get(name)).form();
        if let Some(body) = flowgate::admission::renamed(&self.body, form, model) {
            self.body = body;
            self.body_rewritten = true;
        }
    }

    /// The request's facts, read as at every door (an API key, when keys
    /// are on, fixes the tenant and caps the priority, as at the proxy),
    /// with the API key's grant; its subset hint narrows its route.
    fn request_facts(&mut self) -> Result<(RequestFacts, Option<Grant>), Refusal> {
        let headers = &self.headers;
        let grant = Door::authenticate(&self.rules, || headers.get(AUTHORIZATION))?;
        let caller = grant.as_ref().map_or(Caller::Anonymous, Caller::Key);
        let body = (!self.body.is_empty()).then_some(self.body.as_slice());
        let flow_headers = FlowHeaders::read(|name| headers.get(name));
        let mut facts = (self.epp.door).facts(&self.rules, flow_headers, body, caller)?;
        self.streamed = facts.stream;
        self.tokens = facts.tokens;
        self.served_model.clone_from(&facts.resolved.model);
        if let Some(name) = facts.resolved.rewritten_name(&facts.model) {
            self.rename_body(name);
        }
        if let Some(entries) = &self.subset {
            facts.meta.route.subset = Some(self.resolve_subset(entries).into());
        }
        Ok((facts, grant))
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
                    .door
                    .gate
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
        let m = &self.epp.door.gate.metrics;
        self.epp.decisions.with_label_values(&[r.reason]).inc();
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
