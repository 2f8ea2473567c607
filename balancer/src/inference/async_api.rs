//! The async path's API on the inference port: `/v1/async/...` (submit,
//! status with long-poll, events, cancel, the results feed). The queue
//! itself is [`crate::asyncq`]; this is only its door.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use flowgate::admission::{self, AdmissionRules, FlowHeaders, Grant};
use http::{Method, StatusCode};
use pingora_http::ResponseHeader;
use pingora_proxy::Session;
use serde_json::Value;

use super::body::{self, BodyLimits};
use super::halt::Flow;
use super::routes::{self, RouteKind};
use super::Step;
use crate::asyncq::{self, AsyncQueue};
use crate::observe::metrics::Metrics;
use crate::reply::{Answer, Refusal, REQUEST_ID_HEADER};

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

/// What the async and Batch API routes need of the inference port.
pub(super) struct AsyncDoor<'a> {
    pub queue: &'a Arc<AsyncQueue>,
    pub admission: &'a AdmissionRules,
    pub body: BodyLimits,
    pub metrics: &'a Metrics,
    /// The caller's API key grant (keys on).
    pub grant: Option<&'a Grant>,
    pub request_id: &'a str,
}

impl AsyncDoor<'_> {
    /// Who calls, and the priority of what it submits: the admission rules
    /// of an interactive request (an API key's tenant and ceiling win).
    /// The priority orders the async queue; on the fleet all async work
    /// runs in the async band.
    pub(super) fn caller(
        &self,
        session: &Session,
        model: &str,
    ) -> Result<(asyncq::Caller, i32), Refusal> {
        let headers = &session.req_header().headers;
        let caller = self
            .grant
            .map_or(admission::Caller::Anonymous, admission::Caller::Key);
        let (flow, _) = self.admission.flow(
            FlowHeaders::read(|name| headers.get(name).map(|v| v.as_bytes())),
            model,
            caller,
        )?;
        let caller = asyncq::Caller {
            tenant: flow.fairness_id.to_string(),
            authenticated: self.grant.is_some(),
        };
        Ok((caller, flow.priority))
    }

    /// The tenant reads are scoped to: the API key's, `None` without keys.
    fn scope(&self) -> Option<&str> {
        self.grant.map(|g| &*g.tenant)
    }

    /// The request body, read whole.
    pub(super) async fn read_body(&self, session: &mut Session) -> Flow<Bytes> {
        Ok(body::read_body(session, self.body, self.metrics)
            .await?
            .bytes)
    }

    /// `GET /v1/async/requests/{id}/events`: the request's view as an SSE
    /// `status` event now and at every change, until it is final.
    async fn events(&self, session: &mut Session, id: &str) -> Flow<Step> {
        let mut seen = None;
        let mut started = false;
        loop {
            let job = match self
                .queue
                .next_state(id, seen, EVENTS_KEEPALIVE, self.scope())
                .await
            {
                Ok(job) => job,
                Err(e) => {
                    if started {
                        // End the stream cleanly: the client reconnects.
                        session.write_response_body(None, true).await?;
                        return Ok(Step::Answered);
                    }
                    return Err(Refusal::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "queue_error",
                        e,
                    )
                    .into());
                }
            };
            let Some(job) = job else {
                if !started {
                    return Err(unknown_request(id).into());
                }
                // Purged while watched (retention ended).
                session.write_response_body(None, true).await?;
                return Ok(Step::Answered);
            };
            if !started {
                started = true;
                let mut h = ResponseHeader::build(StatusCode::OK, Some(4))?;
                h.insert_header("content-type", "text/event-stream")?;
                h.insert_header("cache-control", "no-cache")?;
                if !self.request_id.is_empty() {
                    h.insert_header(REQUEST_ID_HEADER, self.request_id)?;
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
                return Ok(Step::Answered);
            }
        }
    }
}

/// A 400 for a malformed or out-of-range client value; its code is also
/// the drop reason.
pub(super) fn bad_input(code: &'static str, message: String) -> Refusal {
    Refusal::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        code,
        message,
    )
}

/// The query parameter `name`, if present.
pub(super) fn query_param(query: &str, name: &str) -> Option<String> {
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        .map(str::to_string)
}

/// `?limit=`: `default` when absent, else a number in `1..=max` (400 beyond).
pub(super) fn parse_limit(query: &str, default: usize, max: usize) -> Result<usize, Refusal> {
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
fn parse_wait(query: &str) -> Result<Duration, Refusal> {
    match query_param(query, "wait") {
        None => Ok(Duration::ZERO),
        Some(w) => flowgate::duration::parse_duration_at_most(&w, ASYNC_MAX_WAIT)
            .map_err(|e| bad_input("bad_wait", format!("wait: {e}"))),
    }
}

/// `x-flowgate-async-deadline` as a Unix-ms instant from `now_ms`.
fn parse_deadline(value: &str, now_ms: u64) -> Result<u64, Refusal> {
    flowgate::duration::parse_duration_at_most(value, ASYNC_MAX_DEADLINE)
        .map(|d| now_ms.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
        .map_err(|e| bad_input("bad_deadline", format!("{ASYNC_DEADLINE_HEADER}: {e}")))
}

/// A refusal with the OpenAI error kind its status implies.
pub(super) fn api_error(status: StatusCode, code: &'static str, message: String) -> Refusal {
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    Refusal::new(status, kind, code, message)
}

fn unknown_request(id: &str) -> Refusal {
    api_error(
        StatusCode::NOT_FOUND,
        "unknown_request",
        format!("no async request {id}"),
    )
}

fn json(status: StatusCode, v: &Value) -> Step {
    Step::Answer(Answer::json(status, v.to_string().into_bytes()))
}

/// The async path's API: submit, status (long-poll), events, cancel, the
/// results feed.
pub(super) async fn route(
    door: &AsyncDoor<'_>,
    session: &mut Session,
    method: &Method,
    path: &str,
) -> Flow<Step> {
    let rest = &path["/v1/async".len()..];
    let query = session.req_header().uri.query().unwrap_or("").to_string();
    let wait = parse_wait(&query)?;
    let scope = door.scope();
    if let (&Method::GET, Some(id)) = (
        method,
        rest.strip_prefix("/requests/")
            .and_then(|r| r.strip_suffix("/events")),
    ) {
        return door.events(session, id).await;
    }
    if rest == "/results" && *method == Method::GET {
        let limit = parse_limit(&query, 100, 1000)?;
        let after = query_param(&query, "after");
        return match door.queue.results(after, limit, wait, scope).await {
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
                Ok(json(StatusCode::OK, &page))
            }
            Err(asyncq::job::StoreError::BadCursor) => Err(api_error(
                StatusCode::BAD_REQUEST,
                "bad_cursor",
                "after must be a cursor from next_cursor".into(),
            )
            .into()),
            Err(e) => Err(api_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "queue_error",
                e.to_string(),
            )
            .into()),
        };
    }
    if let Some(id) = rest.strip_prefix("/requests/") {
        let found = match *method {
            Method::GET => door.queue.get(id, wait, scope).await,
            Method::DELETE => door.queue.cancel(id, scope).await,
            _ => {
                let not_allowed = Answer::json(
                    StatusCode::METHOD_NOT_ALLOWED,
                    flowgate::openai::error_body(
                        &format!("{method} is not allowed on {path}"),
                        "invalid_request_error",
                        "method_not_allowed",
                    ),
                )
                .with_header("allow", "GET, DELETE".to_string());
                return Ok(Step::Answer(not_allowed));
            }
        };
        return match found {
            Ok(Some(job)) => Ok(json(StatusCode::OK, &asyncq::view(&job))),
            // Another tenant's request reads exactly as an unknown one.
            Ok(None) => Err(unknown_request(id).into()),
            Err(e) => Err(api_error(StatusCode::INTERNAL_SERVER_ERROR, "queue_error", e).into()),
        };
    }
    // `/v1/async/chat/completions` is for `/v1/chat/completions`.
    let target = format!("/v1{rest}");
    // Only what takes a slot is worth queueing.
    if !(routes::kind(&target) == Some(RouteKind::Slot) && *method == Method::POST) {
        return Err(api_error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no route for {method} {path}"),
        )
        .into());
    }
    submit(door, session, target).await
}

/// `POST /v1/async/{inference path}`: queues the request.
async fn submit(door: &AsyncDoor<'_>, session: &mut Session, target: String) -> Flow<Step> {
    let body = door.read_body(session).await?;
    let facts = admission::body_facts(&body, &door.admission.prefix)
        .map_err(|bad| Refusal::from(admission::Refused::BadBody(bad)))?;
    let model = facts.model.clone();
    let (caller, priority) = door.caller(session, &model)?;
    let headers = &session.req_header().headers;
    let text = |name: &str| -> Result<Option<String>, Refusal> {
        match headers.get(name) {
            None => Ok(None),
            Some(v) => v
                .to_str()
                .map(|v| Some(v.trim().to_string()))
                .map_err(|_| bad_input("bad_header", format!("{name}: not visible ASCII"))),
        }
    };
    let deadline_ms = text(ASYNC_DEADLINE_HEADER)?
        .map(|d| parse_deadline(&d, asyncq::now_ms()))
        .transpose()?;
    let idempotency_key = match text("idempotency-key")? {
        Some(k) if k.len() > MAX_IDEMPOTENCY_KEY => {
            return Err(bad_input(
                "bad_idempotency_key",
                format!("idempotency-key: longer than {MAX_IDEMPOTENCY_KEY} bytes"),
            )
            .into())
        }
        k => k
            .filter(|k| !k.is_empty())
            .map(|k| asyncq::scoped_idempotency_key(&k, caller.scope())),
    };
    // Its session, from the headers of the submit and the body, scoped to
    // the tenant it is delivered under: stored hashed, delivered with it.
    let flow_headers = FlowHeaders::read(|name| headers.get(name).map(|v| v.as_bytes()));
    let session = door
        .admission
        .session_of(&facts, flow_headers, &caller.tenant)
        .map(|s| format!("{s:016x}"));
    let job = asyncq::job::NewJob {
        path: target,
        body: String::from_utf8_lossy(&body).into_owned(),
        fairness_id: caller.tenant,
        priority,
        idempotency_key,
        deadline_ms,
        session,
    };
    let refused = match door.queue.submit(job).await {
        Ok((job, _)) => return Ok(json(StatusCode::ACCEPTED, &asyncq::view(&job))),
        Err(asyncq::SubmitError::Full(n)) => api_error(
            StatusCode::TOO_MANY_REQUESTS,
            "async_queue_full",
            format!("the async queue holds its maximum of {n} requests"),
        ),
        Err(asyncq::SubmitError::TooLarge(n)) => api_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("the request body exceeds {n} bytes"),
        ),
        Err(asyncq::SubmitError::Storage(e)) => {
            api_error(StatusCode::INTERNAL_SERVER_ERROR, "queue_error", e)
        }
    };
    Err(refused.into())
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
    }

    proptest! {
        #[test]
        fn any_deadline_wait_or_limit_parses_or_is_refused(v in ".{0,40}", now in any::<u64>()) {
            let _ = parse_deadline(&v, now);
            let _ = parse_wait(&format!("wait={v}"));
            let _ = parse_limit(&format!("limit={v}"), 1, 100);
        }
    }
}
