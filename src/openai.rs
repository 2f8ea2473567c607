//! OpenAI-compatible request and error bodies: the prompt text of a
//! request, and `{"error":{"message","type","code"}}`.

use serde::Serialize;
use serde_json::Value;

/// The fields of a request body that carry its prompt, whatever the route:
/// chat (`messages`), completions and infill (`prompt`), Responses
/// (`instructions`, `input`), Anthropic Messages (`system`, `messages`),
/// rerank (`query`, `documents`), embeddings and tokenize (`input`,
/// `content`), score (`text_1`).
#[derive(Debug, Default, Clone, Copy)]
pub struct PromptFields<'a> {
    pub system: Option<&'a Value>,
    pub instructions: Option<&'a Value>,
    pub messages: Option<&'a Value>,
    pub input: Option<&'a Value>,
    pub prompt: Option<&'a Value>,
    pub query: Option<&'a Value>,
    pub documents: Option<&'a Value>,
    pub content: Option<&'a Value>,
    pub text_1: Option<&'a Value>,
}

/// The prompt as the model server will see it, near enough for prefix
/// hashing: the fields of [`PromptFields`] in that order; a list of
/// messages (`messages`, or a Responses `input` list) as each message's
/// role and text, anything else as its text (a string, a list of strings
/// or of `{"text": …}` parts); cut at `limit` bytes (only the beginning is
/// hashed, so a huge prompt is not copied whole). Shapes this does not
/// know add nothing: the model server judges the request.
pub fn prompt_text(fields: &PromptFields<'_>, limit: usize) -> Vec<u8> {
    let mut out = Cut {
        text: Vec::new(),
        limit,
    };
    walk_prompt(fields, &mut out);
    out.text
}

/// The length in bytes of the whole prompt [`prompt_text`] would give
/// uncut, counted without copying it: what a token estimate starts from.
pub fn prompt_bytes(fields: &PromptFields<'_>) -> u64 {
    let mut n = Count(0);
    walk_prompt(fields, &mut n);
    n.0
}

/// Where the prompt's pieces go.
trait Sink {
    fn put(&mut self, bytes: &[u8]);
    /// Nothing more is wanted.
    fn full(&self) -> bool;
}

/// The prompt's first `limit` bytes.
struct Cut {
    text: Vec<u8>,
    limit: usize,
}

impl Sink for Cut {
    fn put(&mut self, bytes: &[u8]) {
        let room = self.limit.saturating_sub(self.text.len());
        self.text.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }
    fn full(&self) -> bool {
        self.text.len() >= self.limit
    }
}

/// The prompt's length.
struct Count(u64);

impl Sink for Count {
    fn put(&mut self, bytes: &[u8]) {
        self.0 = self.0.saturating_add(bytes.len() as u64);
    }
    fn full(&self) -> bool {
        false
    }
}

fn walk_prompt(fields: &PromptFields<'_>, out: &mut impl Sink) {
    fn push_text(out: &mut impl Sink, v: &Value) {
        match v {
            Value::String(t) => out.put(t.as_bytes()),
            // Content parts: [{"type": "text", "text": "..."}, ...].
            Value::Array(parts) => {
                for part in parts {
                    if out.full() {
                        return;
                    }
                    push_text(out, part.get("text").unwrap_or(part));
                }
            }
            _ => {}
        }
    }
    /// Messages: `[{"role": …, "content": …}, …]`.
    fn push_messages(out: &mut impl Sink, messages: &[Value]) {
        for m in messages {
            if out.full() {
                break;
            }
            if let Some(Value::String(role)) = m.get("role") {
                out.put(role.as_bytes());
            }
            out.put(&[0x1f]);
            if let Some(content) = m.get("content") {
                push_text(out, content);
            }
            out.put(&[0x1e]);
        }
    }
    let is_messages = |v: &Value| matches!(v, Value::Array(items) if items.first().is_some_and(|m| m.get("role").is_some()));
    let ordered = [
        fields.system,
        fields.instructions,
        // A conversation is a list; anything else there is not one.
        fields.messages.filter(|m| m.is_array()),
        fields.input,
        fields.prompt,
        fields.query,
        fields.documents,
        fields.content,
        fields.text_1,
    ];
    for v in ordered.into_iter().flatten() {
        if out.full() {
            break;
        }
        match v {
            Value::Array(items) if is_messages(v) => push_messages(out, items),
            _ => push_text(out, v),
        }
    }
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
    use super::{prompt_text, PromptFields};
    use serde_json::json;

    #[test]
    fn prompt_text_stops_at_the_limit() {
        let messages = json!([
            {"role": "system", "content": "abcdef"},
            {"role": "user", "content": [{"type": "text", "text": "ghij"}]}
        ]);
        let fields = PromptFields {
            messages: Some(&messages),
            ..PromptFields::default()
        };
        let full = prompt_text(&fields, usize::MAX);
        assert_eq!(full, b"system\x1fabcdef\x1euser\x1fghij\x1e");
        for limit in [0, 3, 9, 15, 20, full.len()] {
            assert_eq!(prompt_text(&fields, limit), full[..limit.min(full.len())]);
        }
    }

    #[test]
    fn every_route_s_prompt_is_read() {
        // Responses: instructions, then input as text or as messages.
        let instructions = json!("Be brief.");
        let input = json!([{"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Hi"}]}]);
        let responses = PromptFields {
            instructions: Some(&instructions),
            input: Some(&input),
            ..PromptFields::default()
        };
        assert_eq!(prompt_text(&responses, 100), b"Be brief.user\x1fHi\x1e");
        let plain = json!("Hi");
        let responses = PromptFields {
            input: Some(&plain),
            ..PromptFields::default()
        };
        assert_eq!(prompt_text(&responses, 100), b"Hi");
        // Anthropic Messages: system (a string or text blocks), messages.
        let system = json!([{"type": "text", "text": "S"}]);
        let messages = json!([{"role": "user", "content": "Q"}]);
        let anthropic = PromptFields {
            system: Some(&system),
            messages: Some(&messages),
            ..PromptFields::default()
        };
        assert_eq!(prompt_text(&anthropic, 100), b"Suser\x1fQ\x1e");
        // Rerank: the query, then the documents.
        let query = json!("q");
        let documents = json!(["d1", {"text": "d2"}]);
        let rerank = PromptFields {
            query: Some(&query),
            documents: Some(&documents),
            ..PromptFields::default()
        };
        assert_eq!(prompt_text(&rerank, 100), b"qd1d2");
        // Shapes nobody knows add nothing.
        let odd = json!({"a": 1});
        let nothing = PromptFields {
            input: Some(&odd),
            prompt: Some(&json!(7)),
            ..PromptFields::default()
        };
        assert!(prompt_text(&nothing, 100).is_empty());
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
