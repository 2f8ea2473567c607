//! What flow control reads of an inference request body.

use std::sync::Arc;

use serde::Deserialize;

use crate::endpoint::Route;
use crate::prefix::{block_hashes, PrefixConfig};

/// Fields read from an inference request body. Deserialising into it also
/// checks that the body is one JSON object.
#[derive(Debug, Deserialize)]
struct InferenceFields {
    #[serde(default)]
    model: Option<serde_json::Value>,
    /// Chat and Anthropic Messages: the conversation, whose text is hashed
    /// for prefix affinity.
    #[serde(default)]
    messages: Option<serde_json::Value>,
    /// Completions: the prompt (a string or a list of strings).
    #[serde(default)]
    prompt: Option<serde_json::Value>,
    /// Whether the answer is streamed (any other value than `true`: not).
    #[serde(default)]
    stream: Option<serde_json::Value>,
    /// The other routes' prompt fields ([`crate::openai::PromptFields`]).
    #[serde(default)]
    system: Option<serde_json::Value>,
    #[serde(default)]
    instructions: Option<serde_json::Value>,
    #[serde(default)]
    input: Option<serde_json::Value>,
    #[serde(default)]
    query: Option<serde_json::Value>,
    #[serde(default)]
    documents: Option<serde_json::Value>,
    #[serde(default)]
    content: Option<serde_json::Value>,
    #[serde(default)]
    text_1: Option<serde_json::Value>,
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
        let fields = crate::openai::PromptFields {
            system: self.system.as_ref(),
            instructions: self.instructions.as_ref(),
            messages: self.messages.as_ref(),
            input: self.input.as_ref(),
            prompt: self.prompt.as_ref(),
            query: self.query.as_ref(),
            documents: self.documents.as_ref(),
            content: self.content.as_ref(),
            text_1: self.text_1.as_ref(),
        };
        crate::openai::prompt_text(&fields, limit)
    }
}

fn parse_fields(body: &[u8]) -> Result<InferenceFields, String> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err("request body must be a JSON object".into());
    }
    serde_json::from_slice(body).map_err(|e| format!("request body is not valid JSON: {e}"))
}

/// What the balancer reads of an inference request body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodyFacts {
    /// The requested model (empty when the body names none).
    pub model: String,
    /// Where the request may go.
    pub route: Route,
    /// `"stream": true`.
    pub stream: bool,
}

/// The facts of an inference request body; the reason if it is not one
/// JSON object.
pub fn body_facts(body: &[u8], prefix: &PrefixConfig) -> Result<BodyFacts, String> {
    let fields = parse_fields(body)?;
    Ok(BodyFacts {
        model: fields.model().unwrap_or_default().to_string(),
        route: Route {
            model: fields.model().map(Arc::from),
            prefix: block_hashes(&fields.prompt_text(prefix), prefix),
            avoid: None,
            subset: None,
        },
        stream: fields.stream == Some(serde_json::Value::Bool(true)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn facts_name_the_model_and_the_stream_flag() {
        let f = body_facts(
            br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
            &PrefixConfig::default(),
        )
        .unwrap();
        assert_eq!(f.model, "m");
        assert_eq!(f.route.model.as_deref(), Some("m"));
        assert!(f.stream);
        let f = body_facts(br#"{"stream":"yes"}"#, &PrefixConfig::default()).unwrap();
        assert_eq!(
            (f.model.as_str(), f.stream, f.route.model),
            ("", false, None)
        );
    }
}
