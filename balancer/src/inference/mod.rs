//! The inference port: a Pingora `ProxyHttp` that reads the request body,
//! waits for a slot, then proxies the request unchanged to the endpoint the
//! slot belongs to and streams the response back. This file only wires
//! Pingora's hooks; each room of the door is its own file:
//!
//! - [`body`]: reading the body (and Pingora's replay of it).
//! - [`context`]: a request's state between the hooks.
//! - [`retry`]: which failure goes to another endpoint, and whose fault
//!   it is.
//! - [`finish`]: the end of a request: settled in the one right order, then
//!   logged.
//! - [`local`]: what the port answers itself (health, models, 404/405).
//! - [`async_api`] and [`batch_api`]: the async path's and the Batch API's
//!   routes.
//! - [`request_id`]: the `x-request-id` of each request.
//! - [`routes`]: which paths are inference routes, and which take a slot.
//!
//! A request comes in as at every door ([`crate::door`]: who calls, its
//! facts, its session and quotas, then a slot, held by one
//! [`crate::gate::Served`] that settles its end); every answer the
//! balancer gives itself goes through
//! [`crate::reply::Answer`] in one place ([`Inference::answer`]).
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

mod async_api;
mod batch_api;
mod body;
mod context;
mod finish;
mod halt;
mod local;
mod request_id;
mod retry;
mod routes;
mod trace;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use flowgate::admission::{renamed, Caller, FlowHeaders};
use flowgate::blame::{self, Verdict};
use flowgate::session::SessionLabel;
use flowgate::RequestMeta;
use flowgate::SessionSource;
use http::StatusCode;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::upstreams::peer::Peer;
use pingora_core::{Error, ErrorSource, ErrorType, Result};
use pingora_http::ResponseHeader;
use pingora_proxy::{FailToProxy, ProxyHttp, Session};
use tracing::debug;

pub use body::BodyLimits;
pub use context::RequestCtx;
use context::{Ending, Explain};
use halt::{Flow, Halt};
pub use request_id::{RequestId, RequestIds};
use routes::PathRoute;
pub(crate) use routes::RouteKind;

use crate::asyncq::{self, AsyncQueue};
use crate::connection;
use crate::connection::parking::{Parked, Resumed};
use crate::door::Door;
use crate::gate::{AdmitError, Admitted, AnswerEnd, Submitted};
use crate::observe::metrics::RetryReason;
use crate::observe::traces::Traces;
use crate::reply::{Answer, Refusal, REQUEST_ID_HEADER};

/// [`REQUEST_ID_HEADER`] as a name the header map looks up without
/// parsing it first.
static REQUEST_ID_NAME: http::HeaderName = http::HeaderName::from_static(REQUEST_ID_HEADER);

/// Response header: milliseconds the request waited for an endpoint.
const WAIT_HEADER: &str = "x-flowgate-wait-ms";

/// Response header: the model that answered (after aliases, rewrites,
/// the default model and fallbacks).
pub(crate) const SERVED_MODEL_HEADER: &str = "x-flowgate-served-model";
/// Answer header with the scoring of the request's endpoint (JSON), when
/// asked and allowed ([`crate::rules::ExplainScores`]).
pub(crate) const SCORES_HEADER: &str = "x-flowgate-scores";

/// Bytes of an engine's error answer kept to check its shape.
const MAX_ERROR_BODY: usize = 16 * 1024;

pub struct Inference {
    /// The way in every door shares: the gate, the rules, quotas and the
    /// session store.
    pub door: Door,
    /// The largest body and how long it may take to arrive.
    pub body_limits: BodyLimits,
    /// The async path, when on.
    pub async_queue: Option<Arc<AsyncQueue>>,
    pub connect_timeout: Duration,
    pub retry_after: Duration,
    /// Attempts on other endpoints after a failure before the first byte.
    pub retries: u32,
    /// Generates request ids.
    pub request_ids: RequestIds,
    /// OpenTelemetry traces, when on.
    pub traces: Option<Arc<Traces>>,
}

/// What a request's first step decided.
pub(crate) enum Step {
    /// Proxy it: it holds a lease.
    Proxy,
    /// Answer it with this.
    Answer(Answer),
    /// Already answered (an event stream).
    Answered,
    /// Queued, and waits outside the proxy ([`crate::connection::parking`]): Pingora is told
    /// it was answered, and gets it back when its wait ends.
    Parked,
}

impl Inference {
    /// Waits in flow control for a slot: `Ok`, the request holds a lease
    /// for `ctx.upstream`; else flow control refused it, or the client left
    /// while it waited.
    async fn wait_for_slot(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        request: RequestMeta,
    ) -> Flow<()> {
        let fallback = Door::fallback(&ctx.rules, &request);
        let outcome = self
            .door
            .gate
            .admit(request, fallback, client_gone(session))
            .await;
        self.admitted(ctx, outcome)
    }

    /// A request's first wait for a slot: as [`Inference::wait_for_slot`],
    /// except that a queued request that can be replayed (`body` is all of
    /// its body) parks: [`Step::Parked`].
    async fn first_slot(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        request: RequestMeta,
        body: &Bytes,
    ) -> Flow<Step> {
        let fallback = Door::fallback(&ctx.rules, &request);
        let outcome = match self.door.gate.submit(request, fallback) {
            Submitted::Done(outcome) => outcome,
            Submitted::Queued(waiting) => match body::replay(session, body) {
                Some(replay) => {
                    // The proxy's context now only carries the parked
                    // request to `persist_connection_context`.
                    let parked = std::mem::replace(ctx, RequestCtx::new(self.door.rules.get()));
                    let parked = Parked::new(Box::new(parked), waiting, replay);
                    *ctx.parked.get_mut().unwrap_or_else(|e| e.into_inner()) =
                        Some(Box::new(parked));
                    return Ok(Step::Parked);
                }
                // Boxed, as every wait that is not the hot path.
                None => Box::pin(waiting.wait(client_gone(session))).await,
            },
        };
        self.admitted(ctx, outcome).map(|()| Step::Proxy)
    }

    /// A parked request is back in the proxy with the outcome of its wait.
    /// Its body is read again (from memory) so that Pingora can send it.
    async fn resume(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        outcome: std::result::Result<Admitted, AdmitError>,
    ) -> Flow<Step> {
        body::read_body(session, self.body_limits, &self.door.gate.metrics).await?;
        self.admitted(ctx, outcome).map(|()| Step::Proxy)
    }

    /// What the end of a wait means for the request: `Ok`, it holds a
    /// lease for `ctx.upstream`; else flow control refused it, or the
    /// client left while it waited.
    fn admitted(
        &self,
        ctx: &mut RequestCtx,
        outcome: std::result::Result<Admitted, AdmitError>,
    ) -> Flow<()> {
        match outcome {
            Ok(admitted) => {
                ctx.upstream = Some(admitted.lease.addr());
                match &mut ctx.served {
                    Some(served) => served.bind(admitted.lease),
                    // Never: a request waits for a slot once it entered.
                    None => admitted.lease.release(),
                }
                ctx.waited += admitted.waited;
                ctx.answer.status = None;
                if let Some(m) = admitted.fell_back {
                    self.fell_back(ctx, m);
                }
                self.trace_bound(ctx, admitted.waited);
                Ok(())
            }
            Err(AdmitError::Rejected(r)) => Err(self
                .door
                .turned_away(&ctx.rules, r, &ctx.facts.model)
                .into()),
            Err(AdmitError::ClientGone) => {
                ctx.ending = Ending::ClientGone;
                Err(Error::explain(
                    ErrorType::ConnectionClosed,
                    "client disconnected while its request was buffered",
                )
                .into_down()
                .into())
            }
        }
    }

    /// The request goes to fallback model `m`: the engine gets that name,
    /// and a retry stays with it.
    fn fell_back(&self, ctx: &mut RequestCtx, m: Arc<str>) {
        if let Some(meta) = &mut ctx.meta {
            meta.route.model = Some(Arc::clone(&m));
        }
        rename_body(ctx, &m);
        ctx.facts.served_model = Some(Arc::clone(&m));
        ctx.facts.fallback = Some(m);
    }

    /// The one place the balancer answers a request itself.
    async fn answer(&self, session: &mut Session, ctx: &mut RequestCtx, step: Step) -> Result<()> {
        let answer = match step {
            Step::Proxy | Step::Answered | Step::Parked => return Ok(()),
            Step::Answer(a) => a,
        };
        // Boxed: a proxied request never writes one, and its future would
        // otherwise carry the write's.
        Box::pin(answer.write(session, ctx.request_id.as_str())).await
    }

    /// A refusal's answer; its reason labels the metrics and access log.
    /// A request under a quota tells its state on every answer.
    fn refusal(&self, ctx: &mut RequestCtx, r: &Refusal) -> Step {
        ctx.ending = Ending::Refused(r.reason);
        let mut answer = Answer::refusal(r, self.retry_after);
        if r.headers.is_empty() {
            for (name, value) in &ctx.rate_headers {
                answer = answer.with_header(name, value.clone());
            }
        }
        Step::Answer(answer)
    }

    /// Everything before the proxying: who calls, the local routes, the
    /// body, the request's facts, a slot.
    async fn first_step(&self, session: &mut Session, ctx: &mut RequestCtx) -> Flow<Step> {
        let req = session.req_header();
        let from_dispatcher = self.async_queue.as_ref().is_some_and(|q| {
            q.is_dispatcher(req.headers.get(asyncq::TOKEN_HEADER).map(|v| v.as_bytes()))
        });
        let route = PathRoute::of(req.uri.path());
        if !from_dispatcher && !route.is_health() {
            let authorization = || {
                let value = req.headers.get(http::header::AUTHORIZATION);
                value.map(|v| v.as_bytes())
            };
            match Door::authenticate(&ctx.rules, authorization) {
                Ok(grant) => ctx.grant = grant,
                Err(refusal) => {
                    ctx.inference = true;
                    return Err(refusal.into());
                }
            }
        }
        if session.req_header().method != http::Method::POST || route.inference().is_none() {
            // Boxed: the async and Batch APIs' futures are large, and every
            // request's future (which Pingora boxes) would carry them.
            return Box::pin(local::route(self, session, ctx, route)).await;
        }
        ctx.inference = true;
        let body = body::read_body(session, self.body_limits, &self.door.gate.metrics).await?;
        let caller = match (&ctx.grant, &self.async_queue) {
            (_, Some(q)) if from_dispatcher => Caller::AsyncDispatcher { band: q.priority() },
            (Some(g), _) => Caller::Key(g),
            (None, _) => Caller::Anonymous,
        };
        let headers = &session.req_header().headers;
        let flow_headers =
            FlowHeaders::from_pairs(headers.iter().map(|(n, v)| (n.as_str(), v.as_bytes())));
        ctx.body.form = flow_headers.form().map(str::to_string);
        let asked = flow_headers.asks_scores();
        ctx.explain = if ctx.rules.explain.allows(asked, ctx.grant.as_ref()) {
            Explain::Yes
        } else if asked {
            Explain::Denied
        } else {
            Explain::No
        };
        let door = &self.door;
        let mut facts = door.facts(&ctx.rules, flow_headers, Some(&body.bytes), caller)?;
        ctx.facts.model = std::mem::take(&mut facts.model);
        ctx.facts.served_model.clone_from(&facts.resolved.model);
        ctx.facts.stream = facts.stream;
        ctx.facts.tokens = facts.tokens;
        ctx.facts.prompt_bytes = facts.prompt_bytes;
        ctx.facts.fairness_id = Some(Arc::clone(&facts.meta.flow.fairness_id));
        ctx.facts.priority = facts.meta.flow.priority;
        ctx.facts.session = facts.meta.route.session;
        // A Responses answer's id names where a later turn continuing it
        // (`previous_response_id`) should go.
        ctx.meter.want_id = matches!(
            route,
            PathRoute::Inference {
                responses: true,
                ..
            }
        ) && (ctx.rules.admission.sessions)
            .reads(SessionSource::PreviousResponseId);
        // Keep a second copy only when the retry buffer cannot replay it
        // all, or the model in it is (or may be, by a fallback) renamed.
        let rename_to = facts.resolved.rewritten_name(&ctx.facts.model);
        // (The route's model is the resolved one.)
        let may_fall_back = Door::fallback(&ctx.rules, &facts.meta).is_some();
        let keep = !body.in_retry_buffer || rename_to.is_some() || may_fall_back;
        let replay_body = body.bytes.clone();
        ctx.body.whole = keep.then_some(body.bytes);
        if let Some(name) = rename_to {
            // The engine gets the name of the model it serves, not an alias.
            rename_body(ctx, name);
        }
        if route.inference() == Some(RouteKind::Slotless) {
            // No slot, no queue, no retry: a live server of the model
            // answers it at once.
            return match door.gate.slotless(&facts.meta.route) {
                Ok(addr) => {
                    ctx.upstream = Some(addr);
                    Ok(Step::Proxy)
                }
                Err(r) => Err(door.turned_away(&ctx.rules, r, &ctx.facts.model).into()),
            };
        }
        let entry = door
            .enter(
                &ctx.rules,
                &mut facts,
                ctx.grant.as_ref(),
                Some(&replay_body),
            )
            .await?;
        ctx.served = Some(entry.served);
        ctx.rate_headers = entry.rate_headers;
        ctx.facts.store_key = entry.store_key;
        ctx.meta = Some(facts.meta.clone());
        self.trace_admitted(ctx);
        self.first_slot(session, ctx, facts.meta, &replay_body)
            .await
    }
}

/// Resolves when the client closes the connection (or sends bytes it
/// should not while waiting for its answer).
async fn client_gone(session: &mut Session) {
    let _ = session.downstream_session.read_body_or_idle(true).await;
}

/// Renames the model in the request's kept body to `model` (the engine
/// may check it); the new body replaces the retry buffer's.
fn rename_body(ctx: &mut RequestCtx, model: &str) {
    let renamed = |b: &Bytes| renamed(b, ctx.body.form.as_deref(), model);
    if let Some(body) = ctx.body.whole.as_ref().and_then(renamed) {
        ctx.body.whole = Some(body.into());
        ctx.body.rewritten = true;
    }
}

#[async_trait]
impl ProxyHttp for Inference {
    /// Boxed: Pingora keeps the context inside each request's future and
    /// copies that future whole several times per request; a pointer
    /// there is 1.4 KB less to copy (BENCHMARKS.md, session 23).
    type CTX = Box<RequestCtx>;

    fn new_ctx(&self) -> Self::CTX {
        Box::new(RequestCtx::new(self.door.rules.get()))
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Self::CTX) -> Result<bool> {
        connection::head_done(session);
        let step = match ctx.resume.take() {
            Some(outcome) => Box::pin(self.resume(session, ctx, outcome)).await,
            None => {
                ctx.active = Some(self.door.gate.request_started());
                (ctx.request_id, ctx.request_id_given) = self
                    .request_ids
                    .for_request(session.req_header().headers.get(&REQUEST_ID_NAME));
                self.trace_begin(session, ctx);
                self.first_step(session, ctx).await
            }
        };
        let step = match step {
            Ok(step) => step,
            Err(Halt::Refused(refusal)) => self.refusal(ctx, &refusal),
            Err(Halt::Failed(e)) => return Err(e),
        };
        let proxy = matches!(step, Step::Proxy);
        if matches!(step, Step::Parked) {
            // Nothing was answered: the request waits outside the proxy
            // and comes back on this connection.
            return Ok(true);
        }
        if !proxy {
            // Answered here, never served: it leaves its quotas' windows
            // before the client sees the answer.
            if let Some(served) = ctx.served.take() {
                served.finish(AnswerEnd::NEVER_SENT);
            }
        }
        self.answer(session, ctx, step).await?;
        Ok(!proxy)
    }

    async fn upstream_peer(
        &self,
        session: &mut Session,
        ctx: &mut Self::CTX,
    ) -> Result<Box<HttpPeer>> {
        if ctx.retry.pending {
            ctx.retry.pending = false;
            let mut request = ctx.meta.clone().ok_or_else(|| {
                Error::explain(ErrorType::InternalError, "retry without a request")
            })?;
            // The retry waits no longer than the request had left.
            let ttl = self.door.gate.ttl(request.ttl);
            request.ttl = Some(
                ttl.saturating_sub(ctx.start.elapsed())
                    .max(Duration::from_millis(1)),
            );
            request.route.avoid = ctx.upstream;
            // Boxed: a retry's wait is rare, and its future would make
            // every request's `upstream_peer` future (boxed by Pingora) large.
            match Box::pin(self.wait_for_slot(session, ctx, request)).await {
                Ok(()) => {}
                Err(Halt::Failed(e)) => return Err(e),
                Err(Halt::Refused(refusal)) => {
                    // The balancer answers the client itself (503/504/...).
                    let step = self.refusal(ctx, &refusal);
                    self.answer(session, ctx, step).await?;
                    return Err(Error::explain(
                        ErrorType::HTTPStatus(0),
                        "retry refused by flow control; the client was answered",
                    ));
                }
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
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        // The balancer already answered `100 Continue` and holds the body.
        upstream_request.remove_header(&http::header::EXPECT);
        // The key was the balancer's; the model server has its own.
        if ctx.rules.api_keys.is_some() {
            upstream_request.remove_header(&http::header::AUTHORIZATION);
        }
        if self.async_queue.is_some() {
            upstream_request.remove_header(asyncq::TOKEN_HEADER);
        }
        if !ctx.request_id_given {
            upstream_request.insert_header(REQUEST_ID_HEADER, ctx.request_id.header())?;
        }
        ctx.answer.sent_at = Some(Instant::now());
        self.trace_upstream(upstream_request, ctx)?;
        if let (true, Some(body)) = (ctx.body.rewritten, &ctx.body.whole) {
            // A chunked body stays chunked; a sized one has a new size.
            if upstream_request
                .headers
                .contains_key(http::header::CONTENT_LENGTH)
            {
                upstream_request
                    .insert_header(http::header::CONTENT_LENGTH, body.len().to_string())?;
            }
        }
        Ok(())
    }

    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        let status = upstream_response.status.as_u16();
        ctx.answer.status = Some(status);
        let content_type = upstream_response
            .headers
            .get(http::header::CONTENT_TYPE)
            .map_or(&b""[..], |v| v.as_bytes());
        ctx.meter.streaming = content_type.starts_with(b"text/event-stream");
        // Only a 5xx's verdict reads its content type.
        let json = status >= 500 && blame::is_json_content_type(content_type);
        let verdict = blame::verdict(status, json);
        if verdict == Verdict::Fine {
            self.blame_suspect(ctx);
            self.record_outcome(ctx, true);
            return Ok(());
        }
        if ctx.retry.suspect.is_some() && blame::corroborates(status) {
            // A second endpoint failed the same request: the request's
            // fault. Neither endpoint counts; this answer is the client's.
            ctx.retry.suspect = None;
            ctx.ending = Ending::RequestRejected;
            self.door
                .gate
                .metrics
                .upstream_error(Ending::RequestRejected.as_str());
            return Ok(());
        }
        if verdict == Verdict::RequestRejected {
            ctx.answer.rejected = true;
            ctx.ending = Ending::RequestRejected;
            self.door
                .gate
                .metrics
                .upstream_error(Ending::RequestRejected.as_str());
            return Ok(());
        }
        self.door.gate.metrics.upstream_error("status-5xx");
        let failed = ctx.lease().map(|l| (l.endpoint(), l.addr()));
        if self.begin_retry(ctx, RetryReason::Status5xx) {
            // Nothing went to the client yet: drop this answer and try
            // another endpoint (see `error_while_proxy`); this one counts
            // unless that one fails the same way.
            ctx.retry.suspect = failed;
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
        ctx: &mut Self::CTX,
        mut e: Box<Error>,
    ) -> Box<Error> {
        self.blame_suspect(ctx);
        self.record_outcome(ctx, false);
        self.door.gate.metrics.upstream_error("connect");
        let retry = self.begin_retry(ctx, RetryReason::Connect);
        e.set_retry(retry);
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Self::CTX,
        upstream_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {}", peer.address()));
        if ctx.retry.pending {
            // A 5xx header turned into this error by `upstream_response_filter`.
            e.set_retry(true);
            return e;
        }
        // An upstream failure before any response header: the endpoint
        // failed; after it, the client already has part of the answer.
        let before_answer = ctx.answer.status.is_none() && session.response_written().is_none();
        if retry::reused_connection_went_stale(&e, before_answer, upstream_reused)
            && !ctx.retry.stale_retried
        {
            // A pooled connection the server had already closed (its
            // keep-alive ran out: llama-server's after 5 s idle). Not the
            // endpoint's failure: once more on a fresh connection to the
            // same endpoint, with the slot it holds.
            ctx.retry.stale_retried = true;
            self.door
                .gate
                .metrics
                .upstream_retry(RetryReason::StaleConnection);
            e.set_retry(true);
            return e;
        }
        if e.esource() == &ErrorSource::Upstream {
            let kind = if before_answer {
                "before-response"
            } else {
                "mid-response"
            };
            self.door.gate.metrics.upstream_error(kind);
        }
        if e.esource() == &ErrorSource::Upstream && before_answer {
            self.blame_suspect(ctx);
            self.record_outcome(ctx, false);
            if self.begin_retry(ctx, RetryReason::UpstreamError) {
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
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        // How long the request waited in flow control before it was sent.
        let waited = u64::try_from(ctx.waited.as_millis()).unwrap_or(u64::MAX);
        upstream_response.insert_header(WAIT_HEADER, http::HeaderValue::from(waited))?;
        upstream_response.insert_header(REQUEST_ID_HEADER, ctx.request_id.header())?;
        for (name, value) in &ctx.rate_headers {
            upstream_response.insert_header(*name, value.as_str())?;
        }
        // The model the rules chose, else the one its endpoint reports. A
        // name the header cannot carry is left out, not an error.
        let served = (ctx.facts.served_model.as_deref())
            .or_else(|| ctx.lease()?.served_model())
            .and_then(|m| http::HeaderValue::from_str(m).ok());
        if let Some(served) = served {
            upstream_response.insert_header(SERVED_MODEL_HEADER, served)?;
        }
        match ctx.explain {
            Explain::No => {}
            Explain::Denied => upstream_response.insert_header(SCORES_HEADER, "denied")?,
            Explain::Yes => {
                if let Some(meta) = &ctx.meta {
                    let x = self.door.gate.explain(&meta.route);
                    let scores = serde_json::json!({
                        "endpoint": ctx.upstream,
                        "session": ctx.facts.session.map(|s| SessionLabel(Some(s)).to_string()),
                        "explanation": x,
                    });
                    upstream_response.insert_header(SCORES_HEADER, scores.to_string())?;
                }
            }
        }
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        _end_of_stream: bool,
        ctx: &mut Self::CTX,
    ) -> Result<Option<Duration>> {
        if let Some(chunk) = body {
            ctx.meter.on_chunk(chunk, Instant::now());
            if ctx.answer.rejected && ctx.answer.error_body.len() < MAX_ERROR_BODY {
                let room = MAX_ERROR_BODY - ctx.answer.error_body.len();
                ctx.answer
                    .error_body
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
        ctx: &mut Self::CTX,
    ) -> Result<()> {
        // Pingora hands us the retry buffer once, with end_of_stream set, on
        // every attempt; when that is only the body's tail, send the whole
        // body instead.
        if let Some(full) = &ctx.body.whole {
            *body = end_of_stream.then(|| full.clone());
        }
        Ok(())
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut Self::CTX,
    ) -> FailToProxy {
        let downstream = e.esource() == &ErrorSource::Downstream;
        let code =
            if (downstream && body::client_went_away(e)) || session.response_written().is_some() {
                0
            } else {
                let refusal = if downstream {
                    // The client's request could not be sent as it was framed.
                    body::bad_framing(&self.door.gate.metrics, e)
                } else {
                    let mut r = Refusal::new(
                        StatusCode::BAD_GATEWAY,
                        "server_error",
                        "upstream_error",
                        format!("the model server failed: {e}"),
                    );
                    r.reason = "upstream-error";
                    r
                };
                let step = self.refusal(ctx, &refusal);
                if let Err(we) = self.answer(session, ctx, step).await {
                    debug!("could not send the {} to the client: {we}", refusal.status);
                }
                refusal.status.as_u16()
            };
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    fn suppress_error_log(&self, _session: &Session, ctx: &Self::CTX, e: &Error) -> bool {
        // The client's doing (it left, or framed its request wrong) is not
        // the balancer's error: the access log line says what happened,
        // with the request id.
        let clients = e.esource() == &ErrorSource::Downstream || ctx.ending == Ending::ClientGone;
        if clients {
            debug!(request_id = ctx.request_id.as_str(), error = %e, "request ended by its client");
        }
        clients
    }

    fn persist_connection_context(
        &self,
        _session: &Session,
        ctx: &Self::CTX,
    ) -> Option<Box<dyn std::any::Any + Send + Sync>> {
        let parked = ctx
            .parked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        Some(parked)
    }

    fn on_connection_reuse(
        &self,
        _session: &mut Session,
        ctx: &mut Self::CTX,
        prev: Box<dyn std::any::Any + Send + Sync>,
    ) {
        if let Ok(resumed) = prev.downcast::<Resumed>() {
            let Resumed {
                ctx: parked,
                outcome,
            } = *resumed;
            if let Ok(parked) = parked.downcast::<RequestCtx>() {
                *ctx = parked;
                ctx.resume = Some(outcome);
            }
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Self::CTX) {
        self.finish(session, e, ctx);
    }
}
