//! The async path's HTTP API on the inference port: `/v1/async/...`
//! (submit, status with long-poll, cancel) and the OpenAI Batch API
//! (`/v1/files`, `/v1/batches`), answered by the proxy itself.

use std::time::Duration;

use bytes::Bytes;
use flowgate::openai::error_body;
use http::{Method, StatusCode};
use pingora_core::Result;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;
use serde_json::Value;

use super::batch::ApiError;
use super::Caller;
use crate::asyncq;
use crate::policy::{FlowHeaders, FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, PRIORITY_HEADER};
use crate::proxy::{Inference, RequestCtx, INFERENCE_PATHS};
use crate::request::{route_of, Refusal};

/// Longest `?wait=` of an async status request or results read.
const ASYNC_MAX_WAIT: Duration = Duration::from_secs(60);
/// A comment line on an idle event stream this often.
const EVENTS_KEEPALIVE: Duration = Duration::from_secs(15);
/// How long a submitted async request may stay queued (`1h`, `30m`).
const ASYNC_DEADLINE_HEADER: &str = "x-flowgate-async-deadline";
/// The longest `x-flowgate-async-deadline`.
const ASYNC_MAX_DEADLINE: Duration = Duration::from_secs(30 * 24 * 3600);
/// Longest `idempotency-key`, in bytes.
const MAX_IDEMPOTENCY_KEY: usize = 256;
/// OpenAI's bounds on a file's `expires_after[seconds]`: 1 hour to 30 days.
const FILE_EXPIRY_SECONDS: std::ops::RangeInclusive<u64> = 3600..=2_592_000;

/// A 400 for a malformed or out-of-range client value; its code is also
/// the drop reason.
fn bad_input(code: &'static str, message: String) -> Refusal {
    Refusal::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        code,
        message,
    )
}

/// The query parameter `name`, if present.
fn query_param(query: &str, name: &str) -> Option<String> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        .map(str::to_string)
}

/// `?limit=`: `default` when absent, else a number in `1..=max` (400 beyond).
fn parse_limit(query: &str, default: usize, max: usize) -> std::result::Result<usize, Refusal> {
    match query_param(query, "limit") {
        None => Ok(default),
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| bad_input("bad_limit", format!("limit must be 1 to {max}"))),
    }
}

/// `?wait=`: zero when absent, else a duration up to [`ASYNC_MAX_WAIT`].
fn parse_wait(query: &str) -> std::result::Result<Duration, Refusal> {
    match query_param(query, "wait") {
        None => Ok(Duration::ZERO),
        Some(w) => flowgate::duration::parse_duration_at_most(&w, ASYNC_MAX_WAIT)
            .map_err(|e| bad_input("bad_wait", format!("wait: {e}"))),
    }
}

/// `x-flowgate-async-deadline` as a Unix-ms instant from `now_ms`.
fn parse_deadline(value: &str, now_ms: u64) -> std::result::Result<u64, Refusal> {
    flowgate::duration::parse_duration_at_most(value, ASYNC_MAX_DEADLINE)
        .map(|d| now_ms.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
        .map_err(|e| bad_input("bad_deadline", format!("{ASYNC_DEADLINE_HEADER}: {e}")))
}

/// A file's `expires_after` form fields (`anchor` must be `created_at`).
fn parse_file_expiry(
    anchor: Option<&str>,
    seconds: Option<&str>,
) -> std::result::Result<Option<u64>, ApiError> {
    let bad = |m: String| ApiError(400, "invalid_expires_after", m);
    match (anchor, seconds) {
        (None, None) => Ok(None),
        (Some("created_at"), Some(s)) => s
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|n| FILE_EXPIRY_SECONDS.contains(n))
            .map(Some)
            .ok_or_else(|| {
                bad(format!(
                    "expires_after[seconds] must be {} to {}",
                    FILE_EXPIRY_SECONDS.start(),
                    FILE_EXPIRY_SECONDS.end()
                ))
            }),
        _ => Err(bad(
            "expires_after needs anchor \"created_at\" and seconds".into()
        )),
    }
}

impl Inference {
    /// Who calls, and the priority of what it submits: the same headers and
    /// rules as an interactive request (an API key's tenant and ceiling
    /// win). The priority orders the async queue; on the fleet all async
    /// work runs in the async band.
    fn async_caller(
        &self,
        session: &Session,
        ctx: &RequestCtx,
        model: &str,
    ) -> std::result::Result<(Caller, i32), Refusal> {
        let headers = &session.req_header().headers;
        let header = |name: &str| headers.get(name).map(|v| v.as_bytes());
        let (flow, _) = self
            .priorities
            .classify(
                FlowHeaders {
                    fairness_id: header(FAIRNESS_ID_HEADER),
                    objective: header(OBJECTIVE_HEADER),
                    priority: header(PRIORITY_HEADER),
                    ttl: None,
                },
                model,
            )
            .map_err(Refusal::from)?;
        Ok(match &ctx.grant {
            Some(g) => (
                Caller {
                    tenant: g.tenant.to_string(),
                    authenticated: true,
                },
                g.priority(flow.priority),
            ),
            None => (
                Caller {
                    tenant: flow.fairness_id.to_string(),
                    authenticated: false,
                },
                flow.priority,
            ),
        })
    }

    /// The tenant reads are scoped to: the API key's, `None` without keys.
    fn async_scope(ctx: &RequestCtx) -> Option<&str> {
        ctx.grant.as_ref().map(|g| &*g.tenant)
    }

    /// `GET /v1/async/requests/{id}/events`: the request's view as an SSE
    /// `status` event now and at every change, until it is final.
    async fn async_events(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        queue: &std::sync::Arc<asyncq::AsyncQueue>,
        id: &str,
    ) -> Result<bool> {
        let mut seen = None;
        let mut started = false;
        loop {
            let scope = Self::async_scope(ctx);
            let job = match queue.next_state(id, seen, EVENTS_KEEPALIVE, scope).await {
                Ok(job) => job,
                Err(e) => {
                    if started {
                        // End the stream cleanly: the client reconnects.
                        session.write_response_body(None, true).await?;
                        return Ok(true);
                    }
                    let body = error_body(&e, "server_error", "queue_error");
                    self.send_json(session, ctx, StatusCode::INTERNAL_SERVER_ERROR, body, &[])
                        .await?;
                    return Ok(true);
                }
            };
            let Some(job) = job else {
                if !started {
                    let body = error_body(
                        &format!("no async request {id}"),
                        "invalid_request_error",
                        "unknown_request",
                    );
                    self.send_json(session, ctx, StatusCode::NOT_FOUND, body, &[])
                        .await?;
                } else {
                    // Purged while watched (retention ended).
                    session.write_response_body(None, true).await?;
                }
                return Ok(true);
            };
            if !started {
                started = true;
                let mut h = ResponseHeader::build(StatusCode::OK, Some(4))?;
                h.insert_header("content-type", "text/event-stream")?;
                h.insert_header("cache-control", "no-cache")?;
                if !ctx.request_id.is_empty() {
                    h.insert_header(crate::proxy::REQUEST_ID_HEADER, ctx.request_id.as_str())?;
                }
                session.write_response_header(Box::new(h), false).await?;
            }
            let chunk = if Some(job.status) == seen {
                // Nothing new within the keep-alive interval.
                ": keep-alive\n\n".to_string()
            } else {
                seen = Some(job.status);
                format!("event: status\ndata: {}\n\n", asyncq::view(&job))
            };
            let last = job.status.is_final();
            session
                .write_response_body(Some(Bytes::from(chunk)), last)
                .await?;
            if last {
                return Ok(true);
            }
        }
    }

    /// The OpenAI Batch API (files and batches) on the async queue.
    pub(crate) async fn route_batch(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        method: &Method,
        path: &str,
    ) -> Result<bool> {
        let Some(queue) = self.async_queue.clone() else {
            let off = Refusal::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "async_disabled",
                "the Batch API needs the async path: start the balancer with --async-dir".into(),
            );
            return self.refuse(session, ctx, off).await;
        };
        let segs: Vec<String> = path
            .trim_start_matches("/v1/")
            .split('/')
            .map(str::to_string)
            .collect();
        let body = if *method == Method::POST {
            match self.read_body_timed(session).await? {
                Ok((body, _)) => body,
                Err(refusal) => return self.refuse_unread(session, ctx, refusal).await,
            }
        } else {
            Bytes::new()
        };
        let headers = &session.req_header().headers;
        let content_type = headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let query = session.req_header().uri.query().unwrap_or("").to_string();
        // A batch's tenant and priority come from its creation request
        // (its lines may name several models: model priorities do not apply).
        let (caller, priority) = match self.async_caller(session, ctx, "") {
            Ok(found) => found,
            Err(r) => return self.refuse(session, ctx, r).await,
        };
        let limit = match parse_limit(&query, 20, 100) {
            Ok(limit) => limit,
            Err(r) => return self.refuse(session, ctx, r).await,
        };
        let method = method.clone();
        // The store syncs to disk: off the proxy's threads.
        let answer = tokio::task::spawn_blocking(
            move || -> std::result::Result<(Value, Option<Vec<u8>>), ApiError> {
                let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
                let bad = |m: String| ApiError(400, "invalid_request", m);
                match (&method, segs.as_slice()) {
                    (&Method::POST, ["files"]) => {
                        let parts =
                            asyncq::batch::parse_multipart(&content_type, &body).map_err(bad)?;
                        let field = |name: &str| parts.iter().find(|p| p.name == name);
                        let text = |name: &str| {
                            field(name).map(|p| String::from_utf8_lossy(p.data).trim().to_string())
                        };
                        let file = field("file")
                            .ok_or_else(|| bad("the form has no file field".into()))?;
                        let purpose = text("purpose")
                            .ok_or_else(|| bad("the form has no purpose field".into()))?;
                        let expires_after = parse_file_expiry(
                            text("expires_after[anchor]").as_deref(),
                            text("expires_after[seconds]").as_deref(),
                        )?;
                        let name = file
                            .filename
                            .clone()
                            .unwrap_or_else(|| "upload.jsonl".into());
                        let meta = queue.create_file(
                            &name,
                            &purpose,
                            file.data,
                            expires_after,
                            &caller,
                        )?;
                        Ok((meta.view(), None))
                    }
                    (&Method::GET, ["files"]) => Ok((queue.list_files(limit, &caller)?, None)),
                    (&Method::GET, ["files", id]) => {
                        Ok((queue.file_meta(id, &caller)?.view(), None))
                    }
                    (&Method::DELETE, ["files", id]) => Ok((queue.delete_file(id, &caller)?, None)),
                    (&Method::GET, ["files", id, "content"]) => {
                        Ok((Value::Null, Some(queue.file_content(id, &caller)?)))
                    }
                    (&Method::POST, ["batches"]) => {
                        let v: Value = serde_json::from_slice(&body)
                            .map_err(|e| bad(format!("the body is not JSON: {e}")))?;
                        let field = |k: &str| {
                            v[k].as_str()
                                .map(str::to_string)
                                .ok_or_else(|| bad(format!("{k} is required")))
                        };
                        let batch = queue.create_batch(
                            &field("input_file_id")?,
                            &field("endpoint")?,
                            &field("completion_window")?,
                            v.get("metadata").cloned().filter(|m| !m.is_null()),
                            &caller,
                            priority,
                        )?;
                        Ok((batch, None))
                    }
                    (&Method::GET, ["batches"]) => {
                        let after = query_param(&query, "after");
                        Ok((queue.list_batches(limit, after.as_deref(), &caller)?, None))
                    }
                    (&Method::GET, ["batches", id]) => Ok((queue.batch(id, &caller)?, None)),
                    (&Method::POST, ["batches", id, "cancel"]) => {
                        Ok((queue.cancel_batch(id, &caller)?, None))
                    }
                    _ => Err(ApiError(
                        404,
                        "not_found",
                        format!("no route for {method} /v1/{}", segs.join("/")),
                    )),
                }
            },
        )
        .await;
        match answer {
            Ok(Ok((v, None))) => {
                let body = v.to_string().into_bytes();
                self.send_json(session, ctx, StatusCode::OK, body, &[])
                    .await?
            }
            Ok(Ok((_, Some(content)))) => {
                let octets = "application/octet-stream";
                self.send_body(session, ctx, StatusCode::OK, octets, content, &[])
                    .await?
            }
            Ok(Err(ApiError(status, code, message))) => {
                let status =
                    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                let kind = if status.is_server_error() {
                    "server_error"
                } else {
                    "invalid_request_error"
                };
                let refusal = Refusal::new(status, kind, code, message);
                return self.refuse(session, ctx, refusal).await;
            }
            Err(e) => {
                let refusal = Refusal::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "queue_error",
                    e.to_string(),
                );
                return self.refuse(session, ctx, refusal).await;
            }
        }
        Ok(true)
    }

    /// The async path's API: submit, status (long-poll), events, cancel,
    /// the results feed.
    pub(crate) async fn route_async(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        method: &Method,
        path: &str,
    ) -> Result<bool> {
        match self.async_answer(session, ctx, method, path).await? {
            AsyncAnswer::Done => Ok(true),
            AsyncAnswer::Json(status, body) => {
                self.send_json(session, ctx, status, body, &[]).await?;
                Ok(true)
            }
            AsyncAnswer::Refused(r) => self.refuse(session, ctx, r).await,
        }
    }

    async fn async_answer(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        method: &Method,
        path: &str,
    ) -> Result<AsyncAnswer> {
        let refused = |status: StatusCode, code: &'static str, message: String| {
            let kind = if status.is_server_error() {
                "server_error"
            } else {
                "invalid_request_error"
            };
            Ok(AsyncAnswer::Refused(Refusal::new(
                status, kind, code, message,
            )))
        };
        let Some(queue) = self.async_queue.clone() else {
            return refused(
                StatusCode::NOT_FOUND,
                "async_disabled",
                "the async path is off: start the balancer with --async-dir".into(),
            );
        };
        let rest = &path["/v1/async".len()..];
        // `/v1/async/chat/completions` is for `/v1/chat/completions`.
        let target = format!("/v1{rest}");
        let query = session.req_header().uri.query().unwrap_or("").to_string();
        let wait = match parse_wait(&query) {
            Ok(wait) => wait,
            Err(r) => return Ok(AsyncAnswer::Refused(r)),
        };
        let scope = Self::async_scope(ctx).map(str::to_string);
        let scope = scope.as_deref();
        if let (&Method::GET, Some(id)) = (
            method,
            rest.strip_prefix("/requests/")
                .and_then(|r| r.strip_suffix("/events")),
        ) {
            self.async_events(session, ctx, &queue, id).await?;
            return Ok(AsyncAnswer::Done);
        }
        if rest == "/results" && *method == Method::GET {
            let limit = match parse_limit(&query, 100, 1000) {
                Ok(limit) => limit,
                Err(r) => return Ok(AsyncAnswer::Refused(r)),
            };
            let after = query_param(&query, "after");
            return match queue.results(after, limit, wait, scope).await {
                Ok(page) => {
                    let data: Vec<Value> = page
                        .found
                        .iter()
                        .map(|(n, job)| {
                            let mut v = asyncq::view(job);
                            v["cursor"] = Value::from(n.as_str());
                            v
                        })
                        .collect();
                    let page = serde_json::json!({
                        "object": "list",
                        "data": data,
                        "next_cursor": page.next,
                    });
                    Ok(AsyncAnswer::Json(
                        StatusCode::OK,
                        page.to_string().into_bytes(),
                    ))
                }
                Err(asyncq::store::StoreError::BadCursor) => refused(
                    StatusCode::BAD_REQUEST,
                    "bad_cursor",
                    "after must be a cursor from next_cursor".into(),
                ),
                Err(e) => refused(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "queue_error",
                    e.to_string(),
                ),
            };
        }
        if let Some(id) = rest.strip_prefix("/requests/") {
            let found = match *method {
                Method::GET => queue.get(id, wait, scope).await,
                Method::DELETE => queue.cancel(id, scope).await,
                _ => {
                    let (status, body) = (
                        StatusCode::METHOD_NOT_ALLOWED,
                        error_body(
                            &format!("{method} is not allowed on {path}"),
                            "invalid_request_error",
                            "method_not_allowed",
                        ),
                    );
                    let allow = [("allow", "GET, DELETE".to_string())];
                    self.send_json(session, ctx, status, body, &allow).await?;
                    return Ok(AsyncAnswer::Done);
                }
            };
            return match found {
                Ok(Some(job)) => Ok(AsyncAnswer::Json(
                    StatusCode::OK,
                    asyncq::view(&job).to_string().into_bytes(),
                )),
                // Another tenant's request reads exactly as an unknown one.
                Ok(None) => refused(
                    StatusCode::NOT_FOUND,
                    "unknown_request",
                    format!("no async request {id}"),
                ),
                Err(e) => refused(StatusCode::INTERNAL_SERVER_ERROR, "queue_error", e),
            };
        }
        if !(INFERENCE_PATHS.contains(&target.as_str()) && *method == Method::POST) {
            return refused(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no route for {method} {path}"),
            );
        }
        let body = match self.read_body_timed(session).await? {
            Ok((body, _)) => body,
            Err(refusal) => {
                self.refuse_unread(session, ctx, refusal).await?;
                return Ok(AsyncAnswer::Done);
            }
        };
        let model = match route_of(&body, &self.prefix) {
            Ok(facts) => facts.model,
            Err(r) => return Ok(AsyncAnswer::Refused(r)),
        };
        let (caller, priority) = match self.async_caller(session, ctx, &model) {
            Ok(found) => found,
            Err(r) => return Ok(AsyncAnswer::Refused(r)),
        };
        let headers = &session.req_header().headers;
        let text = |name: &str| -> std::result::Result<Option<String>, Refusal> {
            match headers.get(name) {
                None => Ok(None),
                Some(v) => v
                    .to_str()
                    .map(|v| Some(v.trim().to_string()))
                    .map_err(|_| bad_input("bad_header", format!("{name}: not visible ASCII"))),
            }
        };
        let deadline_ms = match text(ASYNC_DEADLINE_HEADER)
            .and_then(|d| d.map(|d| parse_deadline(&d, asyncq::now_ms())).transpose())
        {
            Ok(d) => d,
            Err(r) => return Ok(AsyncAnswer::Refused(r)),
        };
        let idempotency_key = match text("idempotency-key") {
            Ok(Some(k)) if k.len() > MAX_IDEMPOTENCY_KEY => {
                return Ok(AsyncAnswer::Refused(bad_input(
                    "bad_idempotency_key",
                    format!("idempotency-key: longer than {MAX_IDEMPOTENCY_KEY} bytes"),
                )))
            }
            Ok(k) => k
                .filter(|k| !k.is_empty())
                .map(|k| asyncq::scoped_idempotency_key(&k, caller.scope())),
            Err(r) => return Ok(AsyncAnswer::Refused(r)),
        };
        let job = asyncq::store::NewJob {
            path: target,
            body: String::from_utf8_lossy(&body).into_owned(),
            fairness_id: caller.tenant,
            priority,
            idempotency_key,
            deadline_ms,
        };
        match queue.submit(job).await {
            Ok((job, _)) => Ok(AsyncAnswer::Json(
                StatusCode::ACCEPTED,
                asyncq::view(&job).to_string().into_bytes(),
            )),
            Err(asyncq::SubmitError::Full(n)) => refused(
                StatusCode::TOO_MANY_REQUESTS,
                "async_queue_full",
                format!("the async queue holds its maximum of {n} requests"),
            ),
            Err(asyncq::SubmitError::TooLarge(n)) => refused(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                format!("the request body exceeds {n} bytes"),
            ),
            Err(asyncq::SubmitError::Storage(e)) => {
                refused(StatusCode::INTERNAL_SERVER_ERROR, "queue_error", e)
            }
        }
    }
}

/// What an async API request gets.
enum AsyncAnswer {
    /// Already answered (an event stream, a refusal of an unread body).
    Done,
    Json(StatusCode, Vec<u8>),
    Refused(Refusal),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn client_numbers_are_bounded_and_never_overflow() {
        let now = u64::MAX - 10;
        assert!(parse_deadline("18446744073709551615", now).is_err());
        assert!(parse_deadline("31d", 0).is_err(), "over 30 days");
        assert_eq!(parse_deadline("1h", 1_000).ok(), Some(3_601_000));
        assert_eq!(parse_deadline("30d", now).ok(), Some(u64::MAX), "saturates");
        assert!(parse_wait("wait=61s").is_err());
        assert_eq!(parse_wait("wait=2s").ok(), Some(Duration::from_secs(2)));
        assert_eq!(parse_wait("a=1").ok(), Some(Duration::ZERO));
        assert!(parse_limit("limit=0", 5, 10).is_err());
        assert!(parse_limit("limit=-1", 5, 10).is_err());
        assert!(parse_limit("limit=99999999999999999999999", 5, 10).is_err());
        assert_eq!(parse_limit("limit=10", 5, 10).ok(), Some(10));
        assert_eq!(parse_limit("", 5, 10).ok(), Some(5));
        assert_eq!(parse_file_expiry(None, None), Ok(None));
        assert_eq!(
            parse_file_expiry(Some("created_at"), Some("3600")),
            Ok(Some(3600))
        );
        for bad in ["0", "-1", "2592001", "1e9", "18446744073709551616"] {
            assert!(parse_file_expiry(Some("created_at"), Some(bad)).is_err());
        }
        assert!(parse_file_expiry(Some("last_active_at"), Some("3600")).is_err());
        assert!(parse_file_expiry(None, Some("3600")).is_err());
    }

    proptest! {
        #[test]
        fn any_deadline_wait_or_limit_parses_or_is_refused(v in ".{0,40}", now in any::<u64>()) {
            let _ = parse_deadline(&v, now);
            let _ = parse_wait(&format!("wait={v}"));
            let _ = parse_limit(&format!("limit={v}"), 1, 100);
            let _ = parse_file_expiry(Some("created_at"), Some(&v));
        }
    }
}
