//! Whose fault a failed answer is: the endpoint's (it counts towards the
//! endpoint's circuit breaker) or the request's (it is passed to the client
//! and counts against nobody).
//!
//! The rule, in the order it is applied to one request:
//! 1. A connection failure, a timeout or a reset is the endpoint's fault.
//! 2. A 5xx whose body is the engine's own error object (llama.cpp's and
//!    OpenAI's `{"error":{"message",…}}`, vLLM's and SGLang's
//!    `{"object":"error","message",…}`) is the request's fault, except 503:
//!    the engine answered, parsed the request and refused *it* (llama-server
//!    answers 500 to a malformed `tools` or an image sent to a text model),
//!    while a broken engine stops answering, resets, or fails its health
//!    check, which the agent reports. 503 is the engine's state (loading,
//!    no free slot), never the request's. The decision is taken on the
//!    response header (`content-type: application/json`), so the answer is
//!    passed on without a retry, and checked against the body once it has
//!    arrived: a JSON 5xx that is not an engine error object counts after
//!    all.
//! 3. Any other 5xx is suspect: the request is retried on another endpoint
//!    if there is one. If that one answers 5xx too, the same request failed
//!    on two servers: it is the request's fault, neither endpoint is
//!    counted, the second answer goes to the client and nothing more is
//!    tried. If it does not (a success, a transport failure), the first
//!    endpoint is counted. With no endpoint to retry on, it is counted.
//!
//! So in a fleet of one, a server that keeps answering HTTP with its own
//! error objects is alive and serves every good request; one that answers
//! anything else (an HTML 500 from a broken proxy, resets) still opens its
//! circuit.

use serde_json::Value;

/// What one answer says about the endpoint that gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Below 500: the endpoint works.
    Fine,
    /// The engine refused the request with its own error object: pass the
    /// answer on, count nothing (subject to [`is_engine_error`] on the body).
    RequestRejected,
    /// A 5xx that may be the endpoint's: retry elsewhere, count it unless
    /// another endpoint fails the same request.
    Suspect,
}

/// The verdict on a response header: its status and whether its body is
/// JSON.
pub fn verdict(status: u16, json_body: bool) -> Verdict {
    match status {
        s if s < 500 => Verdict::Fine,
        503 => Verdict::Suspect,
        _ if json_body => Verdict::RequestRejected,
        _ => Verdict::Suspect,
    }
}

/// Whether a `content-type` value names JSON (`application/json`, with or
/// without parameters, or a `+json` type).
pub fn is_json_content_type(value: &[u8]) -> bool {
    let essence = value.split(|b| *b == b';').next().unwrap_or_default();
    let essence = essence.trim_ascii();
    essence.eq_ignore_ascii_case(b"application/json")
        || (essence.len() > 5 && essence[essence.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

/// Whether `body` is an engine's error object: `{"error": {"message": …}}`
/// (OpenAI, llama.cpp, newer vLLM), `{"error": "…"}`, or
/// `{"object": "error", "message": …}` (vLLM, SGLang).
pub fn is_engine_error(body: &[u8]) -> bool {
    let Ok(Value::Object(v)) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    match v.get("error") {
        Some(Value::Object(e)) => e.get("message").is_some_and(Value::is_string),
        Some(Value::String(m)) => !m.is_empty(),
        _ => {
            v.get("object").and_then(Value::as_str) == Some("error")
                && v.get("message").is_some_and(Value::is_string)
        }
    }
}

/// Whether a second endpoint's answer to a request whose first answer was
/// [`Verdict::Suspect`] corroborates it: a 5xx from both means the request
/// is at fault.
pub fn corroborates(second_status: u16) -> bool {
    second_status >= 500
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn engine_error_objects_blame_the_request() {
        // llama-server's answer to `"tools": 5` (pinned build).
        let llama = br#"{"error":{"code":500,"message":"Failed to parse tools: [json.exception.type_error.302] type must be array, but is number","type":"server_error"}}"#;
        assert!(is_engine_error(llama));
        // vLLM and SGLang (ErrorResponse).
        let vllm = br#"{"object":"error","message":"The model does not support image input","type":"BadRequestError","param":null,"code":400}"#;
        assert!(is_engine_error(vllm));
        let newer_vllm =
            br#"{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}"#;
        assert!(is_engine_error(newer_vllm));
        assert!(is_engine_error(br#"{"error":"boom"}"#));
        for not in [
            &b"<html>500 Internal Server Error</html>"[..],
            b"",
            b"{}",
            b"[]",
            br#"{"detail":"x"}"#,
            br#"{"error":{"code":500}}"#,
            br#"{"object":"error"}"#,
            br#"{"error":""}"#,
        ] {
            assert!(!is_engine_error(not), "{}", String::from_utf8_lossy(not));
        }
    }

    #[test]
    fn verdicts_by_status_and_body_type() {
        assert_eq!(verdict(200, true), Verdict::Fine);
        assert_eq!(verdict(404, false), Verdict::Fine);
        assert_eq!(verdict(500, true), Verdict::RequestRejected);
        assert_eq!(verdict(501, true), Verdict::RequestRejected);
        assert_eq!(verdict(500, false), Verdict::Suspect);
        assert_eq!(verdict(502, false), Verdict::Suspect);
        // Loading or out of slots: the engine's state, never the request's.
        assert_eq!(verdict(503, true), Verdict::Suspect);
        assert!(corroborates(500) && corroborates(503) && !corroborates(200));
    }

    #[test]
    fn json_content_types() {
        assert!(is_json_content_type(b"application/json"));
        assert!(is_json_content_type(b"Application/JSON; charset=utf-8"));
        assert!(is_json_content_type(b"application/problem+json"));
        assert!(!is_json_content_type(b"text/html"));
        assert!(!is_json_content_type(b"text/event-stream"));
        assert!(!is_json_content_type(b"+json"));
    }

    proptest! {
        #[test]
        fn any_body_is_judged_without_panic(body in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = is_engine_error(&body);
            let _ = is_json_content_type(&body);
        }
    }
}
