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
use crate::asyncq;
use crate::policy::{FlowHeaders, FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, PRIORITY_HEADER};
use crate::proxy::{Inference, RequestCtx, INFERENCE_PATHS};
use crate::request::{route_of, Refusal};

/// Longest `?wait=` of an async status request.
const ASYNC_MAX_WAIT: Duration = Duration::from_secs(60);
/// A comment line on an idle event stream this often.
const EVENTS_KEEPALIVE: Duration = Duration::from_secs(15);
/// How long a submitted async request may stay queued (`1h`, `30m`).
const ASYNC_DEADLINE_HEADER: &str = "x-flowgate-async-deadline";

impl Inference {
    /// The tenant and priority of an async submission: the same headers and
    /// rules as an interactive request (an API key's tenant and ceiling
    /// win). The priority orders the async queue; on the fleet all async
    /// work runs in the async band.
    fn async_flow(
        &self,
        session: &Session,
        ctx: &RequestCtx,
        model: &str,
    ) -> std::result::Result<(String, i32), Refusal> {
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
            Some(g) => (g.tenant.to_string(), g.priority(flow.priority)),
            None => (flow.fairness_id.to_string(), flow.priority),
        })
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
            let job = match queue.next_state(id, seen, EVENTS_KEEPALIVE).await {
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
            let body = error_body(
                "the Batch API needs the async path: start the balancer with --async-dir",
                "invalid_request_error",
                "async_disabled",
            );
            self.send_json(session, ctx, StatusCode::NOT_FOUND, body, &[])
                .await?;
            return Ok(true);
        };
        let segments: Vec<String> = path
            .trim_start_matches("/v1/")
            .split('/')
            .map(str::to_string)
            .collect();
        let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
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
        let (tenant, priority) = match self.async_flow(session, ctx, "") {
            Ok(flow) => flow,
            Err(r) => return self.refuse(session, ctx, r).await,
        };
        let (method, segs) = (
            method.clone(),
            segments.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        );
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
                        let file = field("file")
                            .ok_or_else(|| bad("the form has no file field".into()))?;
                        let purpose = field("purpose")
                            .map(|p| String::from_utf8_lossy(p.data).trim().to_string())
                            .ok_or_else(|| bad("the form has no purpose field".into()))?;
                        let name = file
                            .filename
                            .clone()
                            .unwrap_or_else(|| "upload.jsonl".into());
                        Ok((queue.create_file(&name, &purpose, file.data)?.view(), None))
                    }
                    (&Method::GET, ["files", id]) => Ok((queue.file(id)?.0.view(), None)),
                    (&Method::GET, ["files", id, "content"]) => {
                        Ok((Value::Null, Some(queue.file(id)?.1)))
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
                            &tenant,
                            priority,
                        )?;
                        Ok((batch, None))
                    }
                    (&Method::GET, ["batches"]) => {
                        let param = |k: &str| {
                            query.split('&').find_map(|kv| {
                                kv.strip_prefix(&format!("{k}=")[..]).map(str::to_string)
                            })
                        };
                        let limit = param("limit")
                            .and_then(|l| l.parse().ok())
                            .unwrap_or(20usize)
                            .clamp(1, 100);
                        Ok((queue.list_batches(limit, param("after").as_deref())?, None))
                    }
                    (&Method::GET, ["batches", id]) => Ok((queue.batch(id)?, None)),
                    (&Method::POST, ["batches", id, "cancel"]) => {
                        Ok((queue.cancel_batch(id)?, None))
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
        let (status, body, raw) = match answer {
            Ok(Ok((v, raw))) => (StatusCode::OK, v.to_string().into_bytes(), raw),
            Ok(Err(ApiError(status, code, message))) => (
                StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                error_body(&message, "invalid_request_error", code),
                None,
            ),
            Err(e) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                error_body(&e.to_string(), "server_error", "queue_error"),
                None,
            ),
        };
        match raw {
            None => self.send_json(session, ctx, status, body, &[]).await?,
            Some(content) => {
                let octets = "application/octet-stream";
                self.send_body(session, ctx, StatusCode::OK, octets, content, &[])
                    .await?
            }
        }
        Ok(true)
    }

    /// The async path's API: submit, status (long-poll), cancel.
    pub(crate) async fn route_async(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        method: &Method,
        path: &str,
    ) -> Result<bool> {
        let error = |status: StatusCode, code: &str, message: String| {
            (status, error_body(&message, "invalid_request_error", code))
        };
        let Some(queue) = self.async_queue.clone() else {
            let (status, body) = error(
                StatusCode::NOT_FOUND,
                "async_disabled",
                "the async path is off: start the balancer with --async-dir".into(),
            );
            self.send_json(session, ctx, status, body, &[]).await?;
            return Ok(true);
        };
        let rest = &path["/v1/async".len()..];
        // `/v1/async/chat/completions` is for `/v1/chat/completions`.
        let target = format!("/v1{rest}");
        let query = session.req_header().uri.query().unwrap_or("").to_string();
        let param = |name: &str| {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .map(str::to_string)
        };
        let wait = match param("wait").map(|w| flowgate::duration::parse_duration(&w)) {
            None => Duration::ZERO,
            Some(Ok(w)) => w.min(ASYNC_MAX_WAIT),
            Some(Err(e)) => {
                let (status, body) =
                    error(StatusCode::BAD_REQUEST, "bad_wait", format!("wait: {e}"));
                self.send_json(session, ctx, status, body, &[]).await?;
                return Ok(true);
            }
        };
        if let (&Method::GET, Some(id)) = (
            method,
            rest.strip_prefix("/requests/")
                .and_then(|r| r.strip_suffix("/events")),
        ) {
            return self.async_events(session, ctx, &queue, id).await;
        }
        let (status, body) = if rest == "/results" && *method == Method::GET {
            let after = param("after");
            let limit = param("limit")
                .and_then(|l| l.parse().ok())
                .unwrap_or(100usize)
                .clamp(1, 1000);
            match queue.results(after.clone(), limit, wait).await {
                Ok(found) => {
                    let next = found.last().map(|(n, _)| n.clone()).or(after);
                    let data: Vec<Value> = found
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
                        "next_cursor": next,
                    });
                    (StatusCode::OK, page.to_string().into_bytes())
                }
                Err(asyncq::store::StoreError::BadCursor) => error(
                    StatusCode::BAD_REQUEST,
                    "bad_cursor",
                    "after must be a cursor from next_cursor".into(),
                ),
                Err(e) => error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "queue_error",
                    e.to_string(),
                ),
            }
        } else if let Some(id) = rest.strip_prefix("/requests/") {
            let id = id.to_string();
            let found = match *method {
                Method::GET => queue.get(&id, wait).await,
                Method::DELETE => queue.cancel(&id).await,
                _ => {
                    let (status, body) = error(
                        StatusCode::METHOD_NOT_ALLOWED,
                        "method_not_allowed",
                        format!("{method} is not allowed on {path}"),
                    );
                    let allow = [("allow", "GET, DELETE".to_string())];
                    self.send_json(session, ctx, status, body, &allow).await?;
                    return Ok(true);
                }
            };
            match found {
                Ok(Some(job)) => (StatusCode::OK, asyncq::view(&job).to_string().into_bytes()),
                Ok(None) => error(
                    StatusCode::NOT_FOUND,
                    "unknown_request",
                    format!("no async request {id}"),
                ),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "queue_error", e),
            }
        } else if INFERENCE_PATHS.contains(&target.as_str()) && *method == Method::POST {
            let body = match self.read_body_timed(session).await? {
                Ok((body, _)) => body,
                Err(refusal) => return self.refuse_unread(session, ctx, refusal).await,
            };
            let model = match route_of(&body, &self.prefix) {
                Ok((model, _)) => model,
                Err(r) => return self.refuse(session, ctx, r).await,
            };
            let (fairness_id, priority) = match self.async_flow(session, ctx, &model) {
                Ok(flow) => flow,
                Err(r) => return self.refuse(session, ctx, r).await,
            };
            let headers = &session.req_header().headers;
            let text = |name: &str| {
                headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(|v| v.trim().to_string())
            };
            let deadline_ms =
                match text(ASYNC_DEADLINE_HEADER).map(|d| flowgate::duration::parse_duration(&d)) {
                    None => None,
                    Some(Ok(d)) => Some(asyncq::now_ms() + d.as_millis() as u64),
                    Some(Err(e)) => {
                        let (status, body) = error(
                            StatusCode::BAD_REQUEST,
                            "bad_deadline",
                            format!("{ASYNC_DEADLINE_HEADER}: {e}"),
                        );
                        self.send_json(session, ctx, status, body, &[]).await?;
                        return Ok(true);
                    }
                };
            let job = asyncq::store::NewJob {
                path: target,
                body: String::from_utf8_lossy(&body).into_owned(),
                fairness_id,
                priority,
                idempotency_key: text("idempotency-key").filter(|k| !k.is_empty()),
                deadline_ms,
            };
            match queue.submit(job).await {
                Ok((job, _)) => (
                    StatusCode::ACCEPTED,
                    asyncq::view(&job).to_string().into_bytes(),
                ),
                Err(asyncq::SubmitError::Full(n)) => error(
                    StatusCode::TOO_MANY_REQUESTS,
                    "async_queue_full",
                    format!("the async queue holds its maximum of {n} requests"),
                ),
                Err(asyncq::SubmitError::TooLarge(n)) => error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "request_too_large",
                    format!("the request body exceeds {n} bytes"),
                ),
                Err(asyncq::SubmitError::Storage(e)) => {
                    error(StatusCode::INTERNAL_SERVER_ERROR, "queue_error", e)
                }
            }
        } else {
            error(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no route for {method} {path}"),
            )
        };
        self.send_json(session, ctx, status, body, &[]).await?;
        Ok(true)
    }
}
