//! OpenAI-compatible request and error bodies: the prompt text of a
//! request, and `{"error":{"message","type","code"}}`.

use serde::Serialize;
use serde_json::Value;

/// The prompt as the model server will see it, near enough for prefix
/// hashing: each chat message's role and text in order (`messages`), or the
/// completion prompt (`prompt`, a string or a list of strings). Shapes this
/// does not know add nothing: the model server judges the request.
pub fn prompt_text(messages: Option<&Value>, prompt: Option<&Value>) -> Vec<u8> {
    fn push_text(out: &mut Vec<u8>, v: &Value) {
        match v {
            Value::String(t) => out.extend_from_slice(t.as_bytes()),
            // Content parts: [{"type": "text", "text": "..."}, ...].
            Value::Array(parts) => {
                for part in parts {
                    match part.get("text") {
                        Some(t) => push_text(out, t),
                        None => push_text(out, part),
                    }
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    if let Some(Value::Array(messages)) = messages {
        for m in messages {
            if let Some(Value::String(role)) = m.get("role") {
                out.extend_from_slice(role.as_bytes());
            }
            out.push(0x1f);
            if let Some(content) = m.get("content") {
                push_text(&mut out, content);
            }
            out.push(0x1e);
        }
    } else if let Some(prompt) = prompt {
        push_text(&mut out, prompt);
    }
    out
}

#[derive(Debug, Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Debug, Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    code: &'a str,
}

/// Serialises an error body. `kind` is the OpenAI error type (for example
/// `invalid_request_error`), `code` a stable machine-readable code.
pub fn error_body(message: &str, kind: &str, code: &str) -> Vec<u8> {
    serde_json::to_vec(&ErrorBody {
        error: ErrorDetail {
            message,
            kind,
            code,
        },
    })
    .expect("error body serialises")
}

#[cfg(test)]
mod tests {
    #[test]
    fn body_has_the_openai_shape() {
        let v: serde_json::Value = serde_json::from_slice(&super::error_body(
            "too \"big\"",
            "invalid_request_error",
            "x",
        ))
        .unwrap();
        assert_eq!(v["error"]["message"], "too \"big\"");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "x");
    }
}
