//! What the balancer reads from an inference request, and the answers it
//! gives itself instead of proxying: shared by the proxy and EPP mode.

use std::sync::Arc;

use flowgate::prefix::{block_hashes, PrefixConfig};
use flowgate::{Reject, Route};
use http::StatusCode;
use serde::Deserialize;

use crate::auth::AuthError;
use crate::policy::BadHeader;

/// Fields the balancer reads from an inference request body. Deserialising
/// into it also checks that the body is one JSON object.
#[derive(Debug, Deserialize)]
struct InferenceFields {
    #[serde(default)]
    model: Option<serde_json::Value>,
    /// Chat: the conversation, whose text is hashed for prefix affinity.
    #[serde(default)]
    messages: Option<serde_json::Value>,
    /// Completions: the prompt (a string or a list of strings).
    #[serde(default)]
    prompt: Option<serde_json::Value>,
    /// Whether the answer is streamed (any other value than `true`: not).
    #[serde(default)]
    stream: Option<serde_json::Value>,
}

impl InferenceFields {
    /// The requested model, if the body names one.
    fn model(&self) -> Option<&str> {
        match &self.model {
            Some(serde_json::Value::String(m)) if !m.trim().is_empty() => Some(m),
            _ => None,
        }
    }

    /// The beginning of the prompt text, as much as prefix hashing uses.
    fn prompt_text(&self, prefix: &PrefixConfig) -> Vec<u8> {
        let limit = prefix.block_bytes.saturating_mul(prefix.max_blocks);
        flowgate::openai::prompt_text(self.messages.as_ref(), self.prompt.as_ref(), limit)
    }
}

fn parse_fields(body: &[u8]) -> std::result::Result<InferenceFields, String> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err("request body must be a JSON object".into());
    }
    serde_json::from_slice(body).map_err(|e| format!("request body is not valid JSON: {e}"))
}

/// A reply the balancer gives itself instead of proxying.
pub struct Refusal {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub reason: &'static str,
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
        }
    }

    /// 401: no API key or an unknown one.
    pub fn unauthorized(e: AuthError) -> Self {
        let code = match e {
            AuthError::Missing => "missing_api_key",
            AuthError::Invalid => "invalid_api_key",
        };
        Refusal::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            code,
            e.message().to_string(),
        )
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

    /// The answer to a refusal by flow control of a request for `model`.
    pub fn from_reject(r: Reject, model: &str) -> Self {
        if r == Reject::UnknownModel {
            return Refusal::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!("the model `{model}` does not exist or is not served by any model server"),
            );
        }
        let (kind, code) = match r {
            Reject::BufferFull | Reject::NoEndpoints => ("server_error", "service_unavailable"),
            Reject::Shed | Reject::Evicted => ("rate_limit_error", "rate_limit_exceeded"),
            Reject::Timeout => ("server_error", "timeout"),
            Reject::UnknownModel => unreachable!("answered above"),
        };
        Refusal {
            status: StatusCode::from_u16(r.http_status()).expect("valid status"),
            kind,
            code,
            message: r.to_string(),
            reason: r.reason(),
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

/// What the balancer reads of an inference request body.
pub struct BodyFacts {
    /// The requested model (empty when the body names none).
    pub model: String,
    /// Where the request may go.
    pub route: Route,
    /// `"stream": true`.
    pub stream: bool,
}

/// The facts of an inference request body; a 400 if the body is not one
/// JSON object.
pub fn route_of(body: &[u8], prefix: &PrefixConfig) -> Result<BodyFacts, Refusal> {
    let fields = parse_fields(body).map_err(|message| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_json",
            message,
        )
    })?;
    let route = Route {
        model: fields.model().map(Arc::from),
        prefix: block_hashes(&fields.prompt_text(prefix), prefix),
        avoid: None,
        subset: None,
    };
    Ok(BodyFacts {
        model: fields.model().unwrap_or_default().to_string(),
        route,
        stream: fields.stream == Some(serde_json::Value::Bool(true)),
    })
}

#[cfg(test)]
mod tests {
    use super::parse_fields;
    use flowgate::prefix::PrefixConfig;

    #[test]
    fn only_json_objects_are_inference_requests() {
        assert!(parse_fields(br#" {"model":"m","messages":[]}"#).is_ok());
        assert!(parse_fields(br#"{"messages":[]}"#).unwrap().model.is_none());
        assert!(parse_fields(b"[1,2]").is_err());
        assert!(parse_fields(b"").is_err());
        assert!(parse_fields(br#"{"model":"#).is_err());
    }

    #[test]
    fn prompt_text_follows_the_conversation_whatever_the_field_order() {
        let p = PrefixConfig::default();
        let a = parse_fields(
            br#"{"max_tokens":5,"model":"m","messages":[{"role":"system","content":"S"},
                {"role":"user","content":[{"type":"text","text":"Q"}]}]}"#,
        )
        .unwrap();
        let b = parse_fields(
            br#"{"messages":[{"content":"S","role":"system"},{"role":"user","content":"Q"}],
                "stream":true,"model":"m"}"#,
        )
        .unwrap();
        assert_eq!(a.prompt_text(&p), b.prompt_text(&p));
        assert_eq!(a.prompt_text(&p), b"system\x1fS\x1euser\x1fQ\x1e");
        assert_eq!(a.model(), Some("m"));
        let c = parse_fields(br#"{"prompt":["one","two"],"model":" "}"#).unwrap();
        assert_eq!(c.prompt_text(&p), b"onetwo");
        assert_eq!(c.model(), None, "a blank model names none");
        // Shapes the balancer does not know add nothing, and never fail.
        let d = parse_fields(br#"{"messages":"odd","prompt":7,"model":3}"#).unwrap();
        assert!(d.prompt_text(&p).is_empty());
        assert_eq!(d.model(), None);
    }
}
