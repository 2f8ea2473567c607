//! The management port: agent reports, the agent list, metrics, health, the
//! dashboard.
//!
//! - `POST   /api/v1/agents/{id}/report`  register or update (JSON `AgentReport`);
//!   answers `{"status", "endpoint_id", "in_flight"}` (the balancer's
//!   requests in flight to that endpoint, which a draining agent waits on)
//! - `POST   /api/v1/agents/{id}/blocks`  the blocks its engine holds, from
//!   the engine's KV-cache events (a binary `BlocksUpdate`: a delta or a
//!   snapshot); answers `{"held": {"epoch", "version"}}`, 409 with what it
//!   holds when a delta is not for that
//! - `DELETE /api/v1/agents/{id}`         deregister
//! - `GET    /`                           the dashboard (`/dashboard.js`, `/dashboard.css`)
//! - `GET    /api/v1/agents`              reports + the balancer's in-flight view
//! - `GET    /api/v1/history`             the last 10 minutes: rates, TTFT, wait
//! - `GET    /api/v1/usage`               tokens and requests per tenant and API
//!   key over a window (`?window=15m`, default and longest `1h`; `&tenant=`;
//!   `&limit=`, default 100)
//! - `POST   /api/v1/route/probe`         scores an inference request body
//!   against the live fleet, booking nothing: where it would go and why
//! - `GET    /metrics`                    Prometheus text exposition
//! - `GET    /health`                     liveness
//! - `GET    /ready`                      readiness (503 from SIGTERM on)
//!
//! With a management token, the writes, the probe and the usage read (what
//! each tenant spent) need `Authorization: Bearer <token>` (401
//! otherwise); other reads stay open.

use std::sync::Arc;

use async_trait::async_trait;
use flowgate::admission::{Caller, FlowHeaders};
use flowgate::openai::error_body;
use flowgate::protocol::{valid_agent_id, ReportError};
use flowgate::session::SessionLabel;
use flowgate::{AgentReport, ReportOutcome};
use http::{Method, Response, StatusCode};
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;
use serde_json::json;
use tracing::{info, warn};

use crate::auth::{bearer_token, Secret};
use crate::gate::FleetGate;
use crate::observe::history;
use crate::rules::LiveRules;

/// Largest accepted report body.
const MAX_REPORT_BYTES: usize = 64 * 1024;
/// Largest blocks update: a snapshot of the most blocks one names.
const MAX_BLOCKS_BYTES: usize = 64 + 8 * flowgate::kv_events::holdings::MAX_UPDATE_KEYS;
/// Largest request body the route probe scores.
const MAX_PROBE_BYTES: usize = 4 * 1024 * 1024;

pub struct Management {
    pub shared: Arc<FleetGate>,
    /// Required for registering, reporting and deregistering, when set.
    pub token: Option<Secret>,
    /// The doors' rules, for the route probe's admission step.
    pub rules: Arc<LiveRules>,
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("content-length", body.len())
        .body(body)
        .expect("valid response")
}

// The dashboard, embedded: nothing is fetched from anywhere else.
const DASHBOARD_HTML: &str = include_str!("../assets/dashboard.html");
const DASHBOARD_JS: &str = include_str!("../assets/dashboard.js");
const DASHBOARD_CSS: &str = include_str!("../assets/dashboard.css");

/// One of the dashboard's files. The policy keeps the page to this origin
/// and to its own script and style files.
fn asset(content_type: &str, body: &str) -> Response<Vec<u8>> {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .header(
            "content-security-policy",
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
             img-src 'self'; frame-ancestors 'none'",
        )
        .header("x-content-type-options", "nosniff")
        .header("cache-control", "no-cache")
        .body(body.as_bytes().to_vec())
        .expect("valid response")
}

fn error(status: StatusCode, code: &str, message: &str) -> Response<Vec<u8>> {
    json_response(status, error_body(message, "invalid_request_error", code))
}

async fn read_body(
    session: &mut ServerSession,
    limit: usize,
) -> Result<Vec<u8>, Response<Vec<u8>>> {
    let mut body = Vec::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > limit {
                    warn!(path = %session.req_header().uri.path(), "refused a body over {limit} bytes");
                    // Read on (and drop) what the client is still sending,
                    // up to as much again, so that it gets to read the
                    // answer: closing on an unread body resets the
                    // connection under a client still writing it.
                    drain_body(session, limit).await;
                    return Err(error(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "request_too_large",
                        &format!("body exceeds {limit} bytes"),
                    ));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body),
            Err(e) => {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    "bad_body",
                    &format!("could not read the body: {e}"),
                ))
            }
        }
    }
}

/// Reads and drops up to `most` more bytes of a refused body; stops at its
/// end, at an error, or past `most` (then the connection closes on it).
async fn drain_body(session: &mut ServerSession, most: usize) {
    let mut dropped = 0;
    while dropped <= most {
        match session.read_request_body().await {
            Ok(Some(chunk)) => dropped += chunk.len(),
            Ok(None) | Err(_) => return,
        }
    }
}

impl Management {
    /// `None` when the request may write; else the 401 to answer.
    fn check_token(&self, session: &ServerSession) -> Option<Response<Vec<u8>>> {
        let secret = self.token.as_ref()?;
        let authorization = session
            .req_header()
            .headers
            .get(http::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        let (code, message) = match bearer_token(authorization) {
            Some(token) if secret.matches(token) => return None,
            Some(_) => ("invalid_management_token", "invalid management token"),
            None => (
                "missing_management_token",
                "this balancer requires its management token: send `Authorization: Bearer <token>`",
            ),
        };
        let mut resp = error(StatusCode::UNAUTHORIZED, code, message);
        resp.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            http::HeaderValue::from_static("Bearer"),
        );
        Some(resp)
    }

    /// Scores an inference request body (with the session and tenant
    /// headers sent along) against the live fleet as the inference port
    /// would, booking nothing: no slot, no session bound, no queue.
    async fn probe(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let body = match read_body(session, MAX_PROBE_BYTES).await {
            Ok(b) => b,
            Err(resp) => return resp,
        };
        let rules = self.rules.get();
        let headers = &session.req_header().headers;
        let flow_headers =
            FlowHeaders::from_pairs(headers.iter().map(|(n, v)| (n.as_str(), v.as_bytes())));
        let mut facts = match (rules.admission).inference(
            flow_headers,
            Some(&body),
            Caller::Anonymous,
            &*self.shared,
        ) {
            Ok(facts) => facts,
            Err(refused) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    &refused.to_string(),
                )
            }
        };
        // What the engines with events hold of it, as a request is matched.
        let model = facts.meta.route.model.clone();
        let source = model
            .as_deref()
            .and_then(|m| self.shared.blocks.tokenizer_for(m));
        if let (Some(model), Some(source)) = (model, source) {
            facts.meta.route.engine_held = self.shared.engine_held(&model, &body, source).await;
        }
        let route = &facts.meta.route;
        let x = self.shared.explain(route);
        let body = json!({
            "model": facts.model,
            "served_model": route.model.as_deref(),
            "tenant": &*facts.meta.flow.fairness_id,
            "session": route.session.map(|s| SessionLabel(Some(s)).to_string()),
            "estimated_prompt_tokens": facts.tokens.prompt,
            "explanation": x,
        });
        json_response(StatusCode::OK, body.to_string().into_bytes())
    }

    /// `POST /api/v1/agents/{id}/blocks`: an update of the blocks the
    /// agent's engine holds (module docs).
    async fn blocks(&self, session: &mut ServerSession, agent_id: &str) -> Response<Vec<u8>> {
        let body = match read_body(session, MAX_BLOCKS_BYTES).await {
            Ok(b) => b,
            Err(resp) => return resp,
        };
        if !self.shared.is_registered(agent_id) {
            return error(
                StatusCode::NOT_FOUND,
                "unknown_agent",
                &format!("no agent {agent_id}: its report registers it first"),
            );
        }
        let update = match flowgate::kv_events::BlocksUpdate::decode(&body) {
            Ok(u) => u,
            Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_blocks", &e.to_string()),
        };
        let (status, held) = match self.shared.blocks.apply(agent_id, &update) {
            crate::gate::Applied::Now(held) => {
                if !update.is_empty() {
                    self.shared.rematch_queued(agent_id);
                }
                (StatusCode::OK, Some(held))
            }
            crate::gate::Applied::NotForIt(held) => (StatusCode::CONFLICT, held),
        };
        json_response(status, json!({ "held": held }).to_string().into_bytes())
    }

    async fn report(&self, session: &mut ServerSession, agent_id: &str) -> Response<Vec<u8>> {
        let body = match read_body(session, MAX_REPORT_BYTES).await {
            Ok(b) => b,
            Err(resp) => return resp,
        };
        let invalid = |msg: String| (StatusCode::BAD_REQUEST, "invalid_report", msg);
        let result = serde_json::from_slice::<AgentReport>(&body)
            .map_err(|e| invalid(format!("invalid report: {e}")))
            .and_then(|report| {
                if report.agent_id != agent_id {
                    return Err(invalid(
                        ReportError::AgentIdMismatch {
                            path: agent_id.to_string(),
                            body: report.agent_id,
                        }
                        .to_string(),
                    ));
                }
                // What the report says of the engine's events, kept beside
                // its blocks once the report is taken.
                let engine = match report.kv_events {
                    Some(events) => crate::gate::Engine {
                        addr: report.external_addr.parse().ok(),
                        models: report.models.clone(),
                        adapters: (report.adapters.as_ref())
                            .map_or_else(Vec::new, |a| a.servable.clone()),
                        events: Some(events),
                    },
                    None => crate::gate::Engine::default(),
                };
                let taken = self.shared.report(report);
                if taken.is_ok() {
                    self.shared.blocks.reported(agent_id, engine);
                }
                taken.map_err(|e| match e {
                    // Full, not malformed: the agent may try again later.
                    ReportError::TooManyAgents(_) | ReportError::TooManyModelNames(_) => (
                        StatusCode::TOO_MANY_REQUESTS,
                        "registry_full",
                        e.to_string(),
                    ),
                    e => invalid(e.to_string()),
                })
            });
        let metrics = &self.shared.metrics.fleet.reports;
        match result {
            Ok(outcome) => {
                metrics.with_label_values(&["accepted"]).inc();
                let (status, endpoint) = match outcome {
                    ReportOutcome::Registered(id) => {
                        info!(agent = agent_id, endpoint = id.0, "agent registered");
                        ("registered", id)
                    }
                    ReportOutcome::Updated(id) => ("updated", id),
                    // Two agents taking turns: logged once, at the first.
                    ReportOutcome::TookBack(id) => ("took_over", id),
                    ReportOutcome::TookOver(id) => {
                        warn!(
                            agent = agent_id,
                            endpoint = id.0,
                            "agent took over an endpoint another agent reported"
                        );
                        ("took_over", id)
                    }
                };
                // `in_flight` lets a draining agent know when it may leave;
                // with `queued`, `slot_share` (the share applied now) and
                // `in_flight_at_read` (the most of its requests the engine
                // may have counted in this report) it is what the agent
                // divides the server's slots by.
                let (demand, load) = self.shared.answer_for(endpoint);
                let mut body = json!({
                    "status": status,
                    "endpoint_id": endpoint.0,
                    "in_flight": demand.in_flight,
                    "queued": demand.queued,
                    "slot_share": demand.applied,
                    "in_flight_at_read": demand.at_read,
                });
                // Adapters its requests wait for that want one more server,
                // this one (its agent may load them).
                if !load.is_empty() {
                    body["load_adapters"] = json!(load.iter().map(|a| &**a).collect::<Vec<_>>());
                }
                // The engine's blocks it holds from this agent: the agent
                // sends what changed since (a restarted balancer: all).
                if let Some(held) = self.shared.blocks.held(agent_id) {
                    body["blocks_held"] = json!(held);
                }
                json_response(StatusCode::OK, body.to_string().into_bytes())
            }
            Err((status, code, msg)) => {
                metrics.with_label_values(&["refused"]).inc();
                warn!(agent = agent_id, "refused report: {msg}");
                error(status, code, &msg)
            }
        }
    }

    fn agents(&self) -> Response<Vec<u8>> {
        let snap = self.shared.snapshot();
        let body = json!({
            "buffered_requests": snap.buffered,
            "buffered_bytes": snap.buffered_bytes,
            "buffered_tokens": snap.buffered_tokens,
            "max_buffered_requests": snap.max_buffered_requests,
            "max_buffered_bytes": snap.max_buffered_bytes,
            "flows": snap.flows,
            "in_flight_requests": snap.in_flight,
            "sessions": snap.sessions,
            "unserved_demand": snap.unserved.iter()
                .map(|(model, n)| json!({"model": model.as_deref(), "requests": n}))
                .collect::<Vec<_>>(),
            "endpoints": snap.endpoints,
            "engine_blocks": self.shared.blocks.states(),
        });
        json_response(StatusCode::OK, body.to_string().into_bytes())
    }

    /// `GET /api/v1/usage?window=15m&tenant=acme&limit=10`.
    fn usage(&self, query: &str) -> Response<Vec<u8>> {
        let mut window = flowgate::usage::BUCKET * flowgate::usage::BUCKETS as u32;
        let longest = window;
        let (mut tenant, mut limit) = (None, 100usize);
        for (k, v) in form_urlencoded::parse(query.as_bytes()) {
            match &*k {
                "window" => match flowgate::duration::parse_duration(&v) {
                    Ok(d) if !d.is_zero() => window = d.min(longest),
                    _ => {
                        return error(
                            StatusCode::BAD_REQUEST,
                            "bad_window",
                            &format!("window {v:?} is not a duration such as 15m or 1h"),
                        )
                    }
                },
                "tenant" => tenant = Some(v.into_owned()),
                "limit" => match v.parse::<usize>() {
                    Ok(n) if n > 0 => limit = n,
                    _ => {
                        return error(
                            StatusCode::BAD_REQUEST,
                            "bad_limit",
                            "limit must be a positive integer",
                        )
                    }
                },
                _ => {}
            }
        }
        let all = self.shared.usage(window);
        let total = all.len();
        let tenants: Vec<_> = all
            .into_iter()
            .filter(|t| tenant.as_deref().is_none_or(|want| t.tenant == want))
            .take(limit)
            .collect();
        let body = json!({
            "window_s": flowgate::usage::covered(window).as_secs(),
            "tenants_total": total,
            "tenants": tenants,
        });
        json_response(StatusCode::OK, body.to_string().into_bytes())
    }

    fn history(&self) -> Response<Vec<u8>> {
        let body = json!({
            "interval_s": history::INTERVAL.as_secs_f64(),
            "outcomes": history::OUTCOMES,
            "points": self.shared.history.points(),
        });
        json_response(StatusCode::OK, body.to_string().into_bytes())
    }

    fn metrics(&self) -> Response<Vec<u8>> {
        let body = self.shared.metrics.render(&self.shared.snapshot());
        Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "text/plain; version=0.0.4")
            .header("content-length", body.len())
            .body(body)
            .expect("valid response")
    }
}

#[async_trait]
impl ServeHttp for Management {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let method = session.req_header().method.clone();
        let path = session.req_header().uri.path().to_string();
        if method == Method::POST || method == Method::DELETE || path == "/api/v1/usage" {
            if let Some(refused) = self.check_token(session) {
                return refused;
            }
        }
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (&method, segments.as_slice()) {
            // Liveness: 200 while the process runs (it drains, then exits).
            (&Method::GET, ["health"]) => {
                json_response(StatusCode::OK, br#"{"status":"ok"}"#.to_vec())
            }
            // Readiness: 503 from SIGTERM on.
            (&Method::GET, ["ready"]) => {
                if self.shared.is_ready() {
                    json_response(StatusCode::OK, br#"{"status":"ok"}"#.to_vec())
                } else {
                    json_response(
                        StatusCode::SERVICE_UNAVAILABLE,
                        br#"{"status":"shutting_down"}"#.to_vec(),
                    )
                }
            }
            (&Method::GET, ["metrics"]) => self.metrics(),
            (&Method::GET, [""] | ["dashboard"]) => {
                asset("text/html; charset=utf-8", DASHBOARD_HTML)
            }
            (&Method::GET, ["dashboard.js"]) => {
                asset("text/javascript; charset=utf-8", DASHBOARD_JS)
            }
            (&Method::GET, ["dashboard.css"]) => asset("text/css; charset=utf-8", DASHBOARD_CSS),
            (&Method::GET, ["api", "v1", "agents"]) => self.agents(),
            (&Method::GET, ["api", "v1", "history"]) => self.history(),
            (&Method::GET, ["api", "v1", "usage"]) => {
                self.usage(session.req_header().uri.query().unwrap_or(""))
            }
            (_, ["api", "v1", "agents", id, ..]) if !valid_agent_id(id) => error(
                StatusCode::BAD_REQUEST,
                "bad_agent_id",
                "agent id must be 1..=128 bytes of [A-Za-z0-9._-]",
            ),
            (&Method::POST, ["api", "v1", "route", "probe"]) => self.probe(session).await,
            (&Method::POST, ["api", "v1", "agents", id, "report"]) => {
                let id = id.to_string();
                self.report(session, &id).await
            }
            (&Method::POST, ["api", "v1", "agents", id, "blocks"]) => {
                let id = id.to_string();
                self.blocks(session, &id).await
            }
            (&Method::DELETE, ["api", "v1", "agents", id]) => {
                if self.shared.deregister(id) {
                    info!(agent = *id, "agent deregistered");
                    json_response(StatusCode::OK, br#"{"status":"deregistered"}"#.to_vec())
                } else {
                    error(
                        StatusCode::NOT_FOUND,
                        "unknown_agent",
                        &format!("no agent {id}"),
                    )
                }
            }
            _ => error(
                StatusCode::NOT_FOUND,
                "not_found",
                &format!("no route for {method} {path}"),
            ),
        }
    }
}
