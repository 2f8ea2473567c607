//! The answers the balancer gives itself instead of proxying, written the
//! same way by every HTTP door: an OpenAI-style error object, the request
//! id, the drop reason, `retry-after` where waiting helps.

use std::time::Duration;

use bytes::Bytes;
use flowgate::admission::{BadHeader, Refused};
use flowgate::openai::error_body;
use flowgate::Reject;
use http::StatusCode;
use pingora_core::Result;
use pingora_http::ResponseHeader;
use pingora_proxy::Session;

/// Request id: kept from the client when usable, else generated; sent to
/// the model server, returned to the client, written to the access log.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Why the balancer answered itself (also a metric label).
pub const DROP_REASON_HEADER: &str = "x-flowgate-drop-reason";

/// The drop reason of a request over its tenant's or key's quota (the
/// async dispatcher reads it back).
pub const QUOTA_EXCEEDED: &str = "quota-exceeded";

/// After refusing a request whose body is unread, how long to keep reading
/// (and discarding) what the client still sends, so it gets to read the
/// refusal instead of a reset.
const LINGER: Duration = Duration::from_secs(2);

/// Served models a `model_not_found` answer names; `/v1/models` has them all.
const MAX_NAMED_MODELS: usize = 20;

/// A reply the balancer gives itself instead of proxying.
pub struct Refusal {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub reason: &'static str,
    /// When a retry may succeed, if the refusal knows better than the
    /// default `Retry-After` (a quota's window).
    pub retry_after: Option<Duration>,
    /// More headers (a quota's `x-ratelimit-*`).
    pub headers: Vec<(&'static str, String)>,
}

impl Refusal {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: String,
    ) -> Self {
        Refusal {
            status,
            kind,
            code,
            message,
            reason: code,
            retry_after: None,
            headers: Vec::new(),
        }
    }

    /// 429: a tenant's or key's quota is used up.
    pub fn quota_exceeded(e: &flowgate::quota::Exceeded) -> Self {
        let who = match &e.subject {
            flowgate::quota::Subject::Tenant(t) => format!("tenant `{t}`"),
            flowgate::quota::Subject::Key(_) => "this API key".to_string(),
        };
        let mut r = Refusal::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "quota_exceeded",
            format!(
                "the quota of {who} ({}) is used up; retry in {} s",
                e.limit.as_str(),
                e.retry_after.as_secs().max(1)
            ),
        );
        r.reason = QUOTA_EXCEEDED;
        r.retry_after = Some(e.retry_after);
        r.headers = e.status.headers();
        r
    }

    /// 503: quotas are shared through a Redis that does not answer, and
    /// the operator chose to refuse requests it cannot check.
    pub fn quota_unavailable() -> Self {
        let mut r = Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "quota_unavailable",
            "quotas cannot be checked now (their store does not answer); retry later".into(),
        );
        r.reason = "quota-unavailable";
        r
    }

    /// 413: a body over `max` bytes.
    pub fn too_large(max: usize) -> Self {
        Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("request body exceeds the limit of {max} bytes"),
        )
    }

    /// The answer to a refusal by flow control of a request for `model`;
    /// `served` names the models (and aliases) the fleet does serve, for a
    /// request naming another.
    pub fn from_reject(r: Reject, model: &str, served: impl FnOnce() -> Vec<String>) -> Self {
        if r == Reject::UnknownModel {
            let served = served();
            let known = match served.len() {
                0 => String::new(),
                n if n <= MAX_NAMED_MODELS => format!("; served: {}", served.join(", ")),
                n => format!(
                    "; served: {} and {} more (GET /v1/models)",
                    served[..MAX_NAMED_MODELS].join(", "),
                    n - MAX_NAMED_MODELS
                ),
            };
            return Refusal::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!(
                    "the model `{model}` does not exist or is not served by any model server{known}"
                ),
            );
        }
        let (kind, code) = match r {
            Reject::BufferFull | Reject::NoEndpoints => ("server_error", "service_unavailable"),
            Reject::Shed | Reject::Evicted => ("rate_limit_error", "rate_limit_exceeded"),
            Reject::ObjectiveUnmet => ("rate_limit_error", "objective_unmet"),
            Reject::Timeout => ("server_error", "timeout"),
            Reject::TooManyTokens => ("invalid_request_error", "context_length_exceeded"),
            Reject::AdapterLoadFailed => ("server_error", "adapter_load_failed"),
            Reject::UnknownModel => unreachable!("answered above"),
        };
        let message = match r {
            Reject::AdapterLoadFailed => format!("`{model}`: {r}"),
            _ => r.to_string(),
        };
        Refusal {
            status: StatusCode::from_u16(r.http_status()).expect("valid status"),
            kind,
            code,
            message,
            reason: r.reason(),
            // What the engines predict can change within a second.
            retry_after: (r == Reject::ObjectiveUnmet).then_some(Duration::from_secs(1)),
            headers: Vec::new(),
        }
    }
}

/// 400: a malformed flow-control header.
impl From<BadHeader> for Refusal {
    fn from(bad: BadHeader) -> Self {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_header",
            bad.to_string(),
        )
    }
}

/// 400: what admission refused.
impl From<Refused> for Refusal {
    fn from(r: Refused) -> Self {
        match r {
            Refused::BadBody(message) => Refusal::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_json",
                message,
            ),
            Refused::BadForm(message) => Refusal::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_form",
                message,
            ),
            Refused::BadHeader(bad) => bad.into(),
        }
    }
}

/// An answer the balancer writes itself.
pub struct Answer {
    pub status: StatusCode,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub headers: Vec<(&'static str, String)>,
}

impl Answer {
    pub fn json(status: StatusCode, body: Vec<u8>) -> Self {
        Answer {
            status,
            content_type: "application/json",
            body,
            headers: Vec::new(),
        }
    }

    pub fn with_header(mut self, name: &'static str, value: String) -> Self {
        self.headers.push((name, value));
        self
    }

    /// A refusal's answer: its error object, drop reason, `retry-after`
    /// (503 and 429: a retry may succeed) and `www-authenticate` (401).
    pub fn refusal(r: &Refusal, retry_after: Duration) -> Self {
        let mut a = Answer::json(r.status, error_body(&r.message, r.kind, r.code))
            .with_header(DROP_REASON_HEADER, r.reason.to_string());
        if r.status == StatusCode::SERVICE_UNAVAILABLE || r.status == StatusCode::TOO_MANY_REQUESTS
        {
            let after = r.retry_after.unwrap_or(retry_after);
            // Whole seconds, rounded up: never earlier than the window.
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            a = a.with_header("retry-after", secs.max(1).to_string());
        }
        for (name, value) in &r.headers {
            a = a.with_header(name, value.clone());
        }
        if r.status == StatusCode::UNAUTHORIZED {
            a = a.with_header("www-authenticate", "Bearer".to_string());
        }
        a
    }

    /// Writes the answer with the request id. A request whose body was not
    /// read to its end is answered, its remaining body drained for a short
    /// while (closing on unread data would reset the connection and lose
    /// the answer), and its connection closed.
    pub async fn write(self, session: &mut Session, request_id: &str) -> Result<()> {
        let unread = !session.is_body_done();
        if unread {
            session.set_keepalive(None);
        }
        let mut h = ResponseHeader::build(self.status, Some(3 + self.headers.len()))?;
        h.insert_header("content-type", self.content_type)?;
        h.insert_header("content-length", self.body.len().to_string())?;
        if !request_id.is_empty() {
            h.insert_header(REQUEST_ID_HEADER, request_id)?;
        }
        for (k, v) in self.headers {
            h.insert_header(k, v)?;
        }
        session.write_response_header(Box::new(h), false).await?;
        let written = session
            .write_response_body(Some(Bytes::from(self.body)), true)
            .await;
        if unread && !session.is_body_done() {
            let _ = tokio::time::timeout(LINGER, session.drain_request_body()).await;
        }
        written
    }
}
