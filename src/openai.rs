//! OpenAI-compatible request and error bodies: the prompt text of a
//! request, and `{"error":{"message","type","code"}}`.

use serde::Serialize;
use serde_json::Value;

/// The prompt as the model server will see it, near enough for prefix
/// hashing: each chat message's role and text in order (`messages`), or the
/// completion prompt (`prompt`, a string or a list of strings), cut at
/// `limit` bytes (only the beginning is hashed, so a huge prompt is not
/// copied whole). Shapes this does not know add nothing: the model server
/// judges the request.
pub fn prompt_text(messages: Option<&Value>, prompt: Option<&Value>, limit: usize) -> Vec<u8> {
    fn put(out: &mut Vec<u8>, bytes: &[u8], limit: usize) {
        let room = limit.saturating_sub(out.len());
        out.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }
    fn push_text(out: &mut Vec<u8>, v: &Value, limit: usize) {
        match v {
            Value::String(t) => put(out, t.as_bytes(), limit),
            // Content parts: [{"type": "text", "text": "..."}, ...].
            Value::Array(parts) => {
                for part in parts {
                    if out.len() >= limit {
                        return;
                    }
                    push_text(out, part.get("text").unwrap_or(part), limit);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    if let Some(Value::Array(messages)) = messages {
        for m in messages {
            if out.len() >= limit {
                break;
            }
            if let Some(Value::String(role)) = m.get("role") {
                put(&mut out, role.as_bytes(), limit);
            }
            put(&mut out, &[0x1f], limit);
            if let Some(content) = m.get("content") {
                push_text(&mut out, content, limit);
            }
            put(&mut out, &[0x1e], limit);
        }
    } else if let Some(prompt) = prompt {
        push_text(&mut out, prompt, limit);
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
    fn prompt_text_stops_at_the_limit() {
        let messages = serde_json::json!([
            {"role": "system", "content": "abcdef"},
            {"role": "user", "content": [{"type": "text", "text": "ghij"}]}
        ]);
        let full = super::prompt_text(Some(&messages), None, usize::MAX);
        assert_eq!(full, b"system\x1fabcdef\x1euser\x1fghij\x1e");
        for limit in [0, 3, 9, 15, 20, full.len()] {
            assert_eq!(
                super::prompt_text(Some(&messages), None, limit),
                full[..limit.min(full.len())]
            );
        }
    }

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
