//! The inference port: a Pingora `ProxyHttp` that reads the request body,
//! waits for a slot, then proxies the request unchanged to the endpoint the
//! slot belongs to and streams the response back.
//!
//! Request bodies and Pingora: the body must be read before an endpoint is
//! chosen, which consumes it. Pingora replays a consumed body upstream only
//! from its retry buffer (64 KiB). So the body is read in `request_filter`
//! with the retry buffer armed just for its last ≤ 64 KiB; that makes Pingora
//! enter its replay path. A body of up to 64 KiB is all in the retry buffer
//! and goes upstream from there; for a longer one `request_body_filter`
//! swaps in the whole body, kept in the request's context. Chunked bodies
//! (no `Content-Length`) over 64 KiB cannot be armed that way and are refused
//! with 411 and a clear message.
//!
//! Retries: a connection failure, an upstream error before the response
//! header, or a suspect 5xx response header sends the request again (up to
//! `scheduling.retries` times) through flow control to another endpoint
//! serving its model, if one is eligible. Nothing has reached the client
//! then, and the same replay path resends the body. Once a response header
//! went to the client nothing is retried. Whose fault a failure is, and so
//! what feeds the endpoint's circuit breaker, is [`flowgate::blame`]'s rule:
//! an engine's own error object, or a 5xx that a second endpoint repeats, is
//! the request's and is passed to the client uncounted.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use flowgate::blame::{self, Verdict};
use flowgate::openai::error_body;
use flowgate::prefix::PrefixConfig;
use flowgate::{EndpointId, RequestMeta};
use http::{Method, StatusCode};
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::upstreams::peer::Peer;
use pingora_core::{Error, ErrorSource, ErrorType, Result};
use pingora_http::ResponseHeader;
use pingora_proxy::{FailToProxy, ProxyHttp, Session};
use tracing::{debug, info, warn};

use crate::asyncq::{self, AsyncQueue};
use crate::auth::{ApiKeys, Grant};
use crate::limits::{self, ClientLimits};
use crate::meter::ResponseMeter;
use crate::policy::{
    FlowHeaders, PriorityRules, FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, PRIORITY_HEADER, TTL_HEADER,
};
use crate::request::{route_of, Refusal};
use crate::state::{ActiveRequest, AdmitError, LeaseGuard, Shared};

/// Whether a downstream error means the client's connection is gone (as
/// opposed to a request it framed wrong).
fn client_went_away(e: &Error) -> bool {
    matches!(
        e.etype(),
        ErrorType::WriteError
            | ErrorType::ReadError
            | ErrorType::ConnectionClosed
            | ErrorType::ReadTimedout
            | ErrorType::WriteTimedout
    )
}

/// Pingora's retry buffer size (`BODY_BUF_LIMIT` in pingora-core).
const PINGORA_RETRY_BUFFER: usize = 64 * 1024;

/// After refusing a body, how long to keep reading (and discarding) what the
/// client still sends, so it gets to read the refusal instead of a reset.
const LINGER: Duration = Duration::from_secs(2);

/// Response header: milliseconds the request waited for an endpoint.
const WAIT_HEADER: &str = "x-flowgate-wait-ms";

/// Request id: kept from the client when usable, else generated; sent to
/// the model server, returned to the client, written to the access log.
pub(crate) const REQUEST_ID_HEADER: &str = "x-request-id";

/// Bytes of an engine's error answer kept to check its shape.
const MAX_ERROR_BODY: usize = 16 * 1024;

/// Longest client-supplied request id kept; longer ones are replaced.
const MAX_REQUEST_ID_LEN: usize = 128;

/// Paths proxied to model servers (POST only).
pub(crate) const INFERENCE_PATHS: [&str; 4] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/completion",
];

pub struct Inference {
    pub shared: Arc<Shared>,
    pub max_request_bytes: usize,
    /// Client limits; the proxy enforces the body timeout.
    pub limits: ClientLimits,
    /// The async path, when on.
    pub async_queue: Option<Arc<AsyncQueue>>,
    pub priorities: PriorityRules,
    pub connect_timeout: Duration,
    pub retry_after: Duration,
    /// Attempts on other endpoints after a failure before the first byte.
    pub retries: u32,
    /// How prompts are hashed for prefix affinity.
    pub prefix: PrefixConfig,
    /// When set, every route but `/health` needs one of these keys.
    pub api_keys: Option<Arc<ApiKeys>>,
    /// Generates request ids.
    pub request_ids: RequestIds,
}

/// Request ids unique to this process run: a random-enough prefix fixed at
/// start-up and a counter, cheaper than a UUID per request.
pub struct RequestIds {
    prefix: u64,
    next: std::sync::atomic::AtomicU64,
}

impl Default for RequestIds {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestIds {
    pub fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        RequestIds {
            prefix: nanos ^ (u64::from(std::process::id()) << 32),
            next: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn next(&self) -> String {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{:016x}{n:08x}", self.prefix)
    }

    /// The client's id when it is 1-128 visible ASCII characters, else a
    /// new one.
    fn for_request(&self, given: Option<&http::HeaderValue>) -> (String, bool) {
        match given.map(|v| v.as_bytes()) {
            Some(id)
                if !id.is_empty()
                    && id.len() <= MAX_REQUEST_ID_LEN
                    && id.iter().all(u8::is_ascii_graphic) =>
            {
                (String::from_utf8_lossy(id).into_owned(), true)
            }
            _ => (self.next(), false),
        }
    }
}

/// Per-request state.
pub struct RequestCtx {
    start: Instant,
    /// The whole request body when it is longer than Pingora's retry buffer
    /// (which then holds only its tail), sent by `request_body_filter`.
    body: Option<Bytes>,
    lease: Option<LeaseGuard>,
    upstream: Option<SocketAddr>,
    waited: Duration,
    /// Set for requests that count as inference outcomes in metrics.
    inference: bool,
    /// Why the balancer answered itself, for metrics and the access log.
    pub(crate) reason: &'static str,
    /// The request's `model` field, for the access log.
    model: String,
    /// The request asked for a streamed answer.
    stream: bool,
    /// The request's flow, for the access log.
    fairness_id: String,
    priority: i32,
    /// What it asked of flow control, kept to ask again on a retry.
    meta: Option<RequestMeta>,
    /// Retries done so far.
    retries: u32,
    /// The endpoint failed and the request goes to another one.
    retry_pending: bool,
    /// Status of the upstream response header, once it arrived.
    upstream_status: Option<u16>,
    /// An endpoint whose 5xx awaits a second endpoint's answer to the same
    /// request before it counts against it ([`flowgate::blame`]).
    suspect: Option<(EndpointId, SocketAddr)>,
    /// This answer is an engine's refusal of the request, passed on
    /// uncounted; its body (the first [`MAX_ERROR_BODY`] bytes) is checked
    /// once it has arrived.
    rejected: bool,
    error_body: Vec<u8>,
    /// `x-request-id`, and whether the client sent it.
    pub(crate) request_id: String,
    request_id_given: bool,
    /// What the request's API key grants, when keys are required.
    pub(crate) grant: Option<Grant>,
    /// Timing and usage of the answer as it passes.
    meter: ResponseMeter,
    /// Counts the request as under way until the context is dropped.
    active: Option<ActiveRequest>,
}

impl Inference {
    /// Waits in flow control for a slot. `None`: the request holds a lease
    /// for `ctx.upstream`; `Some(answered)`: the balancer answered the client
    /// itself (or the client left) and the request ends here.
    async fn wait_for_slot(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        request: RequestMeta,
    ) -> Result<Option<bool>> {
        let shared = Arc::clone(&self.shared);
        let client_gone = async {
            // Resolves when the client closes the connection (or sends bytes
            // it should not while waiting for its answer).
            let _ = session.downstream_session.read_body_or_idle(true).await;
        };
        match shared.admit(request, client_gone).await {
            Ok((lease, waited)) => {
                ctx.upstream = Some(lease.addr());
                ctx.lease = Some(lease);
                ctx.waited += waited;
                ctx.upstream_status = None;
                Ok(None)
            }
            Err(AdmitError::Rejected(r)) => {
                let refusal = Refusal::from_reject(r, &ctx.model);
                self.refuse(session, ctx, refusal).await.map(Some)
            }
            Err(AdmitError::ClientGone) => {
                ctx.reason = "client-gone";
                Err(Error::explain(
                    ErrorType::ConnectionClosed,
                    "client disconnected while its request was buffered",
                )
                .into_down())
            }
        }
    }

    /// Feeds the circuit breaker of the endpoint the request holds.
    fn record_outcome(&self, ctx: &RequestCtx, ok: bool) {
        if let Some(lease) = &ctx.lease {
            self.shared.record_outcome(lease, ok);
        }
    }

    /// A suspect 5xx that no second endpoint repeated counts against the
    /// endpoint that gave it.
    fn blame_suspect(&self, ctx: &mut RequestCtx) {
        if let Some((endpoint, addr)) = ctx.suspect.take() {
            self.shared.record_endpoint_outcome(endpoint, addr, false);
        }
    }

    /// After a failed attempt: if the request may go again to another
    /// endpoint, gives its slot back, counts the retry (`reason` labels the
    /// metric) and returns `true`; `upstream_peer` then waits for the next
    /// slot.
    fn begin_retry(&self, ctx: &mut RequestCtx, reason: &str) -> bool {
        if ctx.retries >= self.retries {
            return false;
        }
        let Some(meta) = &ctx.meta else { return false };
        if !self.shared.has_alternative(&meta.route, ctx.upstream) {
            return false;
        }
        ctx.retries += 1;
        ctx.retry_pending = true;
        if let Some(lease) = ctx.lease.take() {
            lease.release();
        }
        self.shared.metrics.upstream_retry(reason);
        true
    }

    pub(crate) async fn send_json(
        &self,
        session: &mut Session,
        ctx: &RequestCtx,
        status: StatusCode,
        body: Vec<u8>,
        extra: &[(&'static str, String)],
    ) -> Result<()> {
        self.send_body(session, ctx, status, "application/json", body, extra)
            .await
    }

    /// Answers with `body` of `content_type` and the request id.
    pub(crate) async fn send_body(
        &self,
        session: &mut Session,
        ctx: &RequestCtx,
        status: StatusCode,
        content_type: &'static str,
        body: Vec<u8>,
        extra: &[(&'static str, String)],
    ) -> Result<()> {
        let mut h = ResponseHeader::build(status, Some(5 + extra.len()))?;
        h.insert_header("content-type", content_type)?;
        h.insert_header("content-length", body.len().to_string())?;
        if !ctx.request_id.is_empty() {
            h.insert_header(REQUEST_ID_HEADER, ctx.request_id.as_str())?;
        }
        for (k, v) in extra {
            h.insert_header(*k, v.as_str())?;
        }
        session.write_response_header(Box::new(h), false).await?;
        session
            .write_response_body(Some(Bytes::from(body)), true)
            .await
    }

    pub(crate) async fn refuse(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        r: Refusal,
    ) -> Result<bool> {
        let mut extra = vec![("x-flowgate-drop-reason", r.reason.to_string())];
        if r.status == StatusCode::SERVICE_UNAVAILABLE || r.status == StatusCode::TOO_MANY_REQUESTS
        {
            extra.push(("retry-after", self.retry_after.as_secs().max(1).to_string()));
        }
        if r.status == StatusCode::UNAUTHORIZED {
            extra.push(("www-authenticate", "Bearer".to_string()));
        }
        ctx.reason = r.reason;
        let body = error_body(&r.message, r.kind, r.code);
        self.send_json(session, ctx, r.status, body, &extra).await?;
        Ok(true)
    }

    /// Refuses a request whose body may still be unread: answers, drains
    /// what the client still sends for a short while (closing on unread
    /// data would reset the connection and lose the answer), then closes.
    pub(crate) async fn refuse_unread(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        r: Refusal,
    ) -> Result<bool> {
        session.set_keepalive(None);
        let answered = self.refuse(session, ctx, r).await;
        if !session.is_body_done() {
            let _ = tokio::time::timeout(LINGER, session.drain_request_body()).await;
        }
        answered
    }

    /// [`Self::read_body`] within the client body timeout (408 after).
    pub(crate) async fn read_body_timed(
        &self,
        session: &mut Session,
    ) -> Result<std::result::Result<(Bytes, bool), Refusal>> {
        let body_timeout = self.limits.body_timeout;
        match tokio::time::timeout(body_timeout, self.read_body(session)).await {
            Ok(read) => read,
            Err(_) => {
                self.shared.metrics.client_refusal("body_timeout");
                Ok(Err(Refusal::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    "body_timeout",
                    format!("the request body did not arrive within {body_timeout:?}"),
                )))
            }
        }
    }

    /// Reads the whole request body (see the module docs for the replay
    /// trick) and says whether Pingora's retry buffer holds all of it.
    /// Refuses bodies over the limit before reading them if the client
    /// announced the size.
    async fn read_body(
        &self,
        session: &mut Session,
    ) -> Result<std::result::Result<(Bytes, bool), Refusal>> {
        let max = self.max_request_bytes;
        let declared = match session
            .req_header()
            .headers
            .get(http::header::CONTENT_LENGTH)
        {
            Some(v) => match v.to_str().ok().and_then(|s| s.trim().parse::<usize>().ok()) {
                Some(n) => Some(n),
                None => {
                    return Ok(Err(Refusal::new(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        "bad_content_length",
                        "Content-Length is not a number".into(),
                    )))
                }
            },
            None => None,
        };
        if declared.is_some_and(|n| n > max) {
            return Ok(Err(Refusal::too_large(max)));
        }
        let expects_continue = session
            .req_header()
            .headers
            .get(http::header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if expects_continue {
            session.write_continue_response().await?;
        }
        let mut buf = BytesMut::with_capacity(declared.unwrap_or(0));
        let mut armed = false;
        // The retry buffer is armed before the first byte (and so holds the
        // whole body) when the body is short or its length unknown.
        let whole = declared.is_none_or(|n| n <= PINGORA_RETRY_BUFFER);
        loop {
            let remaining = declared.map_or(0, |n| n.saturating_sub(buf.len()));
            if !armed && (declared.is_none() || remaining <= PINGORA_RETRY_BUFFER) {
                session.enable_retry_buffering();
                armed = true;
            }
            let read = match session.read_request_body().await {
                Ok(read) => read,
                // The client went away: nobody to answer.
                Err(e) if client_went_away(&e) => return Err(e),
                Err(e) => return Ok(Err(self.bad_framing(&e))),
            };
            match read {
                Some(chunk) => {
                    if buf.len() + chunk.len() > max {
                        return Ok(Err(Refusal::too_large(max)));
                    }
                    buf.extend_from_slice(&chunk);
                }
                None => break,
            }
        }
        // Pingora drops a retry buffer that overflows, which only a chunked
        // body (armed from its first byte, length unknown) can make it do.
        if declared.is_none() && buf.len() > PINGORA_RETRY_BUFFER {
            return Ok(Err(Refusal::new(
                StatusCode::LENGTH_REQUIRED,
                "invalid_request_error",
                "length_required",
                format!(
                    "chunked request bodies over {PINGORA_RETRY_BUFFER} bytes are not supported: \
                     send a Content-Length header"
                ),
            )));
        }
        Ok(Ok((buf.freeze(), whole)))
    }

    /// 400 for a request the client framed wrong (a malformed chunked
    /// body, a `Connection` header that nominates a protected header): the
    /// client's mistake, counted as a client refusal, never an upstream
    /// error.
    fn bad_framing(&self, e: &Error) -> Refusal {
        self.shared.metrics.client_refusal("bad_framing");
        let mut r = Refusal::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "bad_request",
            format!("the request is malformed ({})", e.etype().as_str()),
        );
        r.reason = "bad-framing";
        r
    }

    fn models_body(&self) -> Vec<u8> {
        let snap = self.shared.snapshot();
        let mut models: Vec<&str> = snap
            .endpoints
            .iter()
            .filter(|e| !e.stale)
            .filter_map(|e| e.agent.as_ref())
            .flat_map(|a| a.models.iter().map(String::as_str))
            .collect();
        models.sort_unstable();
        models.dedup();
        let data: Vec<serde_json::Value> = models
            .into_iter()
            .map(|id| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "flowgate"}))
            .collect();
        serde_json::to_vec(&serde_json::json!({"object": "list", "data": data}))
            .expect("json serialises")
    }

    /// Answers `/health`, `/v1/models` and unknown routes; `None` means
    /// "proxy this request".
    async fn route_local(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Option<bool>> {
        let req = session.req_header();
        // The hot path first, without copying the method and path.
        if req.method == Method::POST && INFERENCE_PATHS.contains(&req.uri.path()) {
            return Ok(None);
        }
        let method = req.method.clone();
        let path = req.uri.path().to_string();
        if path == "/v1/files"
            || path.starts_with("/v1/files/")
            || path == "/v1/batches"
            || path.starts_with("/v1/batches/")
        {
            ctx.reason = "local";
            return self
                .route_batch(session, ctx, &method, &path)
                .await
                .map(Some);
        }
        if path.starts_with("/v1/async/") {
            ctx.reason = "local";
            return self
                .route_async(session, ctx, &method, &path)
                .await
                .map(Some);
        }
        let not_allowed = |allow: &'static str| {
            (
                StatusCode::METHOD_NOT_ALLOWED,
                error_body(
                    &format!("{method} is not allowed on {path}"),
                    "invalid_request_error",
                    "method_not_allowed",
                ),
                vec![("allow", allow.to_string())],
            )
        };
        let (status, body, extra) = match path.as_str() {
            "/health" if method == Method::GET => {
                if self.shared.is_shutting_down() {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        br#"{"status":"shutting_down"}"#.to_vec(),
                        vec![],
                    )
                } else {
                    (StatusCode::OK, br#"{"status":"ok"}"#.to_vec(), vec![])
                }
            }
            "/health" => not_allowed("GET"),
            "/v1/models" if method == Method::GET => (StatusCode::OK, self.models_body(), vec![]),
            "/v1/models" => not_allowed("GET"),
            p if INFERENCE_PATHS.contains(&p) => not_allowed("POST"),
            _ => (
                StatusCode::NOT_FOUND,
                error_body(
                    &format!("no route for {method} {path}"),
                    "invalid_request_error",
                    "not_found",
                ),
                vec![],
            ),
        };
        ctx.reason = "local";
        self.send_json(session, ctx, status, body, &extra).await?;
        Ok(Some(true))
    }
}

#[async_trait]
impl ProxyHttp for Inference {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx {
            start: Instant::now(),
            body: None,
            lease: None,
            upstream: None,
            waited: Duration::ZERO,
            inference: false,
            reason: "",
            model: String::new(),
            stream: false,
            fairness_id: String::new(),
            priority: 0,
            meta: None,
            retries: 0,
            retry_pending: false,
            upstream_status: None,
            suspect: None,
            rejected: false,
            error_body: Vec::new(),
            request_id: String::new(),
            request_id_given: false,
            grant: None,
            meter: ResponseMeter::default(),
            active: None,
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        limits::head_done(session);
        ctx.active = Some(self.shared.request_started());
        let req = session.req_header();
        (ctx.request_id, ctx.request_id_given) = self
            .request_ids
            .for_request(req.headers.get(REQUEST_ID_HEADER));
        let from_dispatcher = self.async_queue.as_ref().is_some_and(|q| {
            q.is_dispatcher(req.headers.get(asyncq::TOKEN_HEADER).map(|v| v.as_bytes()))
        });
        if let (Some(keys), false) = (&self.api_keys, from_dispatcher) {
            if req.uri.path() != "/health" {
                let authorization = req.headers.get(http::header::AUTHORIZATION);
                match keys.authenticate(authorization.map(|v| v.as_bytes())) {
                    Ok(grant) => ctx.grant = Some(grant.clone()),
                    Err(e) => {
                        ctx.inference = true;
                        return self
                            .refuse_unread(session, ctx, Refusal::unauthorized(e))
                            .await;
                    }
                }
            }
        }
        if let Some(done) = self.route_local(session, ctx).await? {
            return Ok(done);
        }
        ctx.inference = true;
        let (body, in_retry_buffer) = match self.read_body_timed(session).await? {
            Ok(read) => read,
            Err(refusal) => return self.refuse_unread(session, ctx, refusal).await,
        };
        let route = match route_of(&body, &self.prefix) {
            Ok(facts) => {
                ctx.model = facts.model;
                ctx.stream = facts.stream;
                facts.route
            }
            Err(r) => return self.refuse(session, ctx, r).await,
        };
        let headers = &session.req_header().headers;
        let header = |name: &str| headers.get(name).map(|v| v.as_bytes());
        let classified = self.priorities.classify(
            FlowHeaders {
                fairness_id: header(FAIRNESS_ID_HEADER),
                objective: header(OBJECTIVE_HEADER),
                priority: header(PRIORITY_HEADER),
                ttl: header(TTL_HEADER),
            },
            &ctx.model,
        );
        let (flow, ttl) = match classified {
            Ok(c) => c,
            Err(bad) => return self.refuse(session, ctx, bad.into()).await,
        };
        // A key's tenant and ceiling beat whatever the headers asked for.
        let flow = match (&ctx.grant, &self.async_queue) {
            // The async dispatcher: the tenant it submitted under, in the
            // async band.
            (_, Some(q)) if from_dispatcher => {
                flowgate::FlowKey::new(flow.fairness_id, q.priority())
            }
            (Some(g), _) => {
                flowgate::FlowKey::new(Arc::clone(&g.tenant), g.priority(flow.priority))
            }
            (None, _) => flow,
        };
        ctx.fairness_id = flow.fairness_id.to_string();
        ctx.priority = flow.priority;
        let request = RequestMeta {
            flow,
            bytes: body.len() as u64,
            ttl,
            route,
        };
        // Keep a second copy only when the retry buffer cannot replay it all.
        ctx.body = (!in_retry_buffer).then_some(body);
        ctx.meta = Some(request.clone());
        match self.wait_for_slot(session, ctx, request).await? {
            None => Ok(false),
            Some(answered) => Ok(answered),
        }
    }

    async fn upstream_peer(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        if ctx.retry_pending {
            ctx.retry_pending = false;
            let mut request = ctx.meta.clone().ok_or_else(|| {
                Error::explain(ErrorType::InternalError, "retry without a request")
            })?;
            // The retry waits no longer than the request had left.
            let ttl = self.shared.ttl(request.ttl);
            request.ttl = Some(
                ttl.saturating_sub(ctx.start.elapsed())
                    .max(Duration::from_millis(1)),
            );
            request.route.avoid = ctx.upstream;
            if self.wait_for_slot(session, ctx, request).await?.is_some() {
                // The balancer answered the client itself (503/504/...).
                return Err(Error::explain(
                    ErrorType::HTTPStatus(0),
                    "retry refused by flow control; the client was answered",
                ));
            }
        }
        let addr = ctx.upstream.ok_or_else(|| {
            Error::explain(
                ErrorType::InternalError,
                "no endpoint lease for this request",
            )
        })?;
        let mut peer = HttpPeer::new(addr, false, String::new());
        peer.options.connection_timeout = Some(self.connect_timeout);
        Ok(Box::new(peer))
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream_request: &mut pingora_http::RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        // The balancer already answered `100 Continue` and holds the body.
        upstream_request.remove_header(&http::header::EXPECT);
        // The key was the balancer's; the model server has its own.
        if self.api_keys.is_some() {
            upstream_request.remove_header(&http::header::AUTHORIZATION);
        }
        if self.async_queue.is_some() {
            upstream_request.remove_header(asyncq::TOKEN_HEADER);
        }
        if !ctx.request_id_given {
            upstream_request.insert_header(REQUEST_ID_HEADER, ctx.request_id.as_str())?;
        }
        Ok(())
    }

    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let status = upstream_response.status.as_u16();
        ctx.upstream_status = Some(status);
        let content_type = upstream_response
            .headers
            .get(http::header::CONTENT_TYPE)
            .map_or(&b""[..], |v| v.as_bytes());
        ctx.meter.streaming = content_type.starts_with(b"text/event-stream");
        let json = blame::is_json_content_type(content_type);
        let verdict = blame::verdict(status, json);
        if verdict == Verdict::Fine {
            self.blame_suspect(ctx);
            self.record_outcome(ctx, true);
            return Ok(());
        }
        if ctx.suspect.is_some() && blame::corroborates(status) {
            // A second endpoint failed the same request: the request's
            // fault. Neither endpoint counts; this answer is the client's.
            ctx.suspect = None;
            ctx.reason = "request-rejected";
            self.shared.metrics.upstream_error("request-rejected");
            return Ok(());
        }
        if verdict == Verdict::RequestRejected {
            ctx.rejected = true;
            ctx.reason = "request-rejected";
            self.shared.metrics.upstream_error("request-rejected");
            return Ok(());
        }
        self.shared.metrics.upstream_error("status-5xx");
        let failed = ctx.lease.as_ref().map(|l| (l.endpoint(), l.addr()));
        if self.begin_retry(ctx, "status-5xx") {
            // Nothing went to the client yet: drop this answer and try
            // another endpoint (see `error_while_proxy`); this one counts
            // unless that one fails the same way.
            ctx.suspect = failed;
            return Err(Error::explain(
                ErrorType::HTTPStatus(status),
                format!("model server answered {status}; retrying on another endpoint"),
            )
            .into_up());
        }
        // Nowhere else to ask: the endpoint's.
        self.record_outcome(ctx, false);
        Ok(())
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut RequestCtx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        self.blame_suspect(ctx);
        self.record_outcome(ctx, false);
        self.shared.metrics.upstream_error("connect");
        let retry = self.begin_retry(ctx, "connect");
        e.set_retry(retry);
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut RequestCtx,
        _client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {}", peer.address()));
        if ctx.retry_pending {
            // A 5xx header turned into this error by `upstream_response_filter`.
            e.set_retry(true);
            return e;
        }
        // An upstream failure before any response header: the endpoint
        // failed; after it, the client already has part of the answer.
        let before_answer = ctx.upstream_status.is_none() && session.response_written().is_none();
        if e.esource() == &ErrorSource::Upstream {
            let kind = if before_answer {
                "before-response"
            } else {
                "mid-response"
            };
            self.shared.metrics.upstream_error(kind);
        }
        if e.esource() == &ErrorSource::Upstream && before_answer {
            self.blame_suspect(ctx);
            self.record_outcome(ctx, false);
            if self.begin_retry(ctx, "upstream-error") {
                e.set_retry(true);
                return e;
            }
        }
        e.set_retry(false);
        e
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        // How long the request waited in flow control before it was sent.
        upstream_response.insert_header(WAIT_HEADER, ctx.waited.as_millis().to_string())?;
        upstream_response.insert_header(REQUEST_ID_HEADER, ctx.request_id.as_str())?;
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        _end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<Duration>> {
        if let Some(chunk) = body {
            ctx.meter.on_chunk(chunk, Instant::now());
            if ctx.rejected && ctx.error_body.len() < MAX_ERROR_BODY {
                let room = MAX_ERROR_BODY - ctx.error_body.len();
                ctx.error_body
                    .extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
        }
        Ok(None)
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        // Pingora hands us the retry buffer once, with end_of_stream set, on
        // every attempt; when that is only the body's tail, send the whole
        // body instead.
        if let Some(full) = &ctx.body {
            *body = end_of_stream.then(|| full.clone());
        }
        Ok(())
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy {
        let downstream = e.esource() == &ErrorSource::Downstream;
        let code = if (downstream && client_went_away(e)) || session.response_written().is_some() {
            0
        } else if downstream {
            // The client's request could not be sent as it was framed.
            let refusal = self.bad_framing(e);
            if let Err(we) = self.refuse(session, ctx, refusal).await {
                debug!("could not send the 400 to the client: {we}");
            }
            400
        } else {
            ctx.reason = "upstream-error";
            let msg = format!("the model server failed: {e}");
            let body = error_body(&msg, "server_error", "upstream_error");
            let extra = [("x-flowgate-drop-reason", "upstream-error".to_string())];
            if let Err(we) = self
                .send_json(session, ctx, StatusCode::BAD_GATEWAY, body, &extra)
                .await
            {
                warn!("could not send the 502 to the client: {we}");
            }
            502
        };
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    fn suppress_error_log(&self, _session: &Session, ctx: &RequestCtx, e: &Error) -> bool {
        // The client's doing (it left, or framed its request wrong) is not
        // the balancer's error: the access log line says what happened,
        // with the request id.
        let clients = e.esource() == &ErrorSource::Downstream || ctx.reason == "client-gone";
        if clients {
            debug!(request_id = ctx.request_id.as_str(), error = %e, "request ended by its client");
        }
        clients
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        limits::request_done(session);
        // A retry that never got an answer cannot clear its suspect.
        self.blame_suspect(ctx);
        if ctx.rejected && e.is_none() && !blame::is_engine_error(&ctx.error_body) {
            // JSON, but not an engine's error object: the endpoint's.
            self.record_outcome(ctx, false);
        }
        if let Some(lease) = ctx.lease.take() {
            // The client left before its answer ended: the engine may still
            // be working on it, so its slot is not free yet.
            let client_left = e.is_some_and(|e| e.esource() == &ErrorSource::Downstream);
            if client_left {
                lease.orphan(ctx.stream || ctx.meter.streaming);
            } else {
                lease.release();
            }
        }
        let status = session
            .response_written()
            .map(|h| h.status.as_u16())
            .unwrap_or(if ctx.reason == "client-gone" || e.is_some() {
                499
            } else {
                0
            });
        let reason = if ctx.reason.is_empty() && e.is_some() {
            "client-gone"
        } else {
            ctx.reason
        };
        let ttft = ctx.meter.time_to_first_token(ctx.start);
        let usage = ctx.meter.usage();
        if ctx.inference {
            self.shared.metrics.record_outcome(status, reason);
            if ctx.upstream_status.is_some_and(|s| s < 400) {
                let tpot = ctx.meter.time_per_output_token(usage);
                let model = self.shared.model_label(&ctx.model);
                self.shared.metrics.answer(model, ttft, tpot, usage);
            }
        }
        info!(
            target: "access",
            request_id = ctx.request_id.as_str(),
            method = %session.req_header().method,
            path = session.req_header().uri.path(),
            model = ctx.model.as_str(),
            fairness_id = ctx.fairness_id.as_str(),
            priority = ctx.priority,
            status,
            reason,
            upstream = ctx.upstream.map(|a| a.to_string()).unwrap_or_default(),
            retries = ctx.retries,
            wait_ms = ctx.waited.as_millis() as u64,
            ttft_ms = ttft.map(|t| t.as_millis() as u64),
            prompt_tokens = usage.map(|u| u.prompt_tokens),
            completion_tokens = usage.map(|u| u.completion_tokens),
            duration_ms = ctx.start.elapsed().as_millis() as u64,
            error = e.map(|e| e.to_string()).unwrap_or_default(),
        );
    }
}
