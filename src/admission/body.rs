//! What flow control reads of an inference request body.

use std::sync::Arc;

use std::borrow::Cow;

use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use crate::endpoint::Route;
use crate::openai::PromptJson;
use crate::prefix::{block_hashes, PrefixConfig};
use crate::session::{SessionKeys, SessionSource};
use crate::turn::TurnKeys;

/// Fields read from an inference request body, borrowed from it where they
/// can be ([`PromptJson`]). Deserialising into it also checks that the body
/// is one JSON object; the fields it does not name are skipped unbuilt.
#[derive(Debug, Deserialize)]
struct InferenceFields<'a> {
    #[serde(default, borrow)]
    model: Option<PromptJson<'a>>,
    /// Chat and Anthropic Messages: the conversation, whose text is hashed
    /// for prefix affinity.
    #[serde(default, borrow)]
    messages: Option<PromptJson<'a>>,
    /// Completions: the prompt (a string or a list of strings).
    #[serde(default, borrow)]
    prompt: Option<PromptJson<'a>>,
    /// Whether the answer is streamed (any other value than `true`: not).
    #[serde(default, borrow)]
    stream: Option<PromptJson<'a>>,
    /// The other routes' prompt fields ([`crate::openai::PromptFields`]).
    #[serde(default, borrow)]
    system: Option<PromptJson<'a>>,
    #[serde(default, borrow)]
    instructions: Option<PromptJson<'a>>,
    #[serde(default, borrow)]
    input: Option<PromptJson<'a>>,
    #[serde(default, borrow)]
    query: Option<PromptJson<'a>>,
    #[serde(default, borrow)]
    documents: Option<PromptJson<'a>>,
    #[serde(default, borrow)]
    content: Option<PromptJson<'a>>,
    #[serde(default, borrow)]
    text_1: Option<PromptJson<'a>>,
    /// The output bound, by route: chat and completions, OpenAI's newer
    /// chat name, Responses ([`crate::tokens::output_bound`]).
    #[serde(default)]
    max_tokens: Option<serde_json::Value>,
    #[serde(default)]
    max_completion_tokens: Option<serde_json::Value>,
    #[serde(default)]
    max_output_tokens: Option<serde_json::Value>,
    /// Session keys ([`crate::session::SessionSource`]): OpenAI's cache
    /// key, the Responses API's conversation (an id, or an object with
    /// one) and the response a turn continues.
    #[serde(default, borrow)]
    prompt_cache_key: Option<PromptJson<'a>>,
    #[serde(default, borrow)]
    conversation: Option<ConversationRef<'a>>,
    #[serde(default, borrow)]
    previous_response_id: Option<PromptJson<'a>>,
}

/// The Responses API's `conversation`: a string id, or an object whose
/// `id` is one; anything else names no conversation.
#[derive(Debug)]
struct ConversationRef<'a>(Option<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for ConversationRef<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ConversationVisitor)
    }
}

struct ConversationVisitor;

impl<'de> Visitor<'de> for ConversationVisitor {
    type Value = ConversationRef<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a conversation id, or an object with one")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(ConversationRef(Some(Cow::Borrowed(v))))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(ConversationRef(Some(Cow::Owned(v.to_owned()))))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut id = None;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if key == "id" {
                id = map.next_value::<PromptJson<'de>>()?.as_cow();
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(ConversationRef(id))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(ConversationRef(None))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(ConversationRef(None))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(ConversationRef(None))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(ConversationRef(None))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(ConversationRef(None))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(ConversationRef(None))
    }
}

impl InferenceFields<'_> {
    /// The requested model, if the body names one.
    fn model(&self) -> Option<&str> {
        let m = self.model.as_ref()?.as_str()?;
        (!m.trim().is_empty()).then_some(m)
    }

    /// The beginning of the prompt text, as much as prefix hashing uses.
    fn prompt_text(&self, prefix: &PrefixConfig) -> Vec<u8> {
        let limit = prefix.block_bytes.saturating_mul(prefix.max_blocks);
        crate::openai::prompt_text(&self.prompt_fields(), limit)
    }

    fn sessions(&self) -> SessionKeys {
        let mut keys = SessionKeys::default();
        if let Some(k) = self.prompt_cache_key.as_ref().and_then(PromptJson::as_str) {
            keys.set(SessionSource::PromptCacheKey, k.as_bytes());
        }
        if let Some(ConversationRef(Some(c))) = &self.conversation {
            keys.set(SessionSource::Conversation, c.as_bytes());
        }
        if let Some(r) = self
            .previous_response_id
            .as_ref()
            .and_then(PromptJson::as_str)
        {
            keys.set(SessionSource::PreviousResponseId, r.as_bytes());
        }
        keys
    }

    fn prompt_fields(&self) -> crate::openai::PromptFields<'_> {
        crate::openai::PromptFields {
            system: self.system.as_ref(),
            instructions: self.instructions.as_ref(),
            messages: self.messages.as_ref(),
            input: self.input.as_ref(),
            prompt: self.prompt.as_ref(),
            query: self.query.as_ref(),
            documents: self.documents.as_ref(),
            content: self.content.as_ref(),
            text_1: self.text_1.as_ref(),
        }
    }
}

fn parse_fields(body: &[u8]) -> Result<InferenceFields<'_>, String> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err("request body must be a JSON object".into());
    }
    // JSON is UTF-8: checked once over the body, its strings are then
    // borrowed unchecked, where a parse of bytes checks each string on its
    // own (about a hundred instructions apiece, most of a small request's
    // parse). A body that is not UTF-8 throughout is parsed as bytes, as
    // before: only the strings read must be.
    match std::str::from_utf8(body) {
        Ok(text) => serde_json::from_str(text),
        Err(_) => serde_json::from_slice(body),
    }
    .map_err(|e| format!("request body is not valid JSON: {e}"))
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
    /// The whole prompt text's length in bytes (for the token estimate).
    pub prompt_bytes: u64,
    /// The output tokens the request asks for at most, if it says.
    pub output_bound: Option<u64>,
    /// The session keys of the body, hashed.
    pub sessions: SessionKeys,
    /// Its conversation named by its prompts (unscoped), for a request
    /// that sends no session key ([`crate::turn`]).
    pub turn: Option<TurnKeys>,
}

/// The facts of an inference request body; the reason if it is not one
/// JSON object.
pub fn body_facts(body: &[u8], prefix: &PrefixConfig) -> Result<BodyFacts, String> {
    let fields = parse_fields(body)?;
    let text = fields.prompt_text(prefix);
    let blocks = block_hashes(&text, prefix);
    let length = crate::openai::prompt_length(&fields.prompt_fields());
    Ok(BodyFacts {
        model: fields.model().unwrap_or_default().to_string(),
        turn: TurnKeys::of(&text, &blocks, prefix, length),
        route: Route {
            model: fields.model().map(Arc::from),
            prefix: blocks,
            continues: length.last_answer_at.is_some(),
            ..Route::default()
        },
        stream: fields.stream == Some(PromptJson::True),
        prompt_bytes: length.bytes,
        output_bound: crate::tokens::output_bound([
            fields.max_tokens.as_ref(),
            fields.max_completion_tokens.as_ref(),
            fields.max_output_tokens.as_ref(),
        ]),
        sessions: fields.sessions(),
    })
}

/// The facts of a `multipart/form-data` body (the audio routes): its text
/// fields `model`, `stream` and `prompt` (the transcription's prompt, for
/// prefix affinity).
pub fn form_facts(
    content_type: &str,
    body: &[u8],
    prefix: &PrefixConfig,
) -> Result<BodyFacts, String> {
    let parts = crate::multipart::parse_multipart(content_type, body)?;
    let field = |name: &str| {
        parts
            .iter()
            .find(|p| p.name == name && p.filename.is_none())
            .and_then(|p| std::str::from_utf8(p.data).ok())
            .map(str::trim)
    };
    let model = field("model").filter(|m| !m.is_empty());
    let limit = prefix.block_bytes.saturating_mul(prefix.max_blocks);
    let prompt = field("prompt").unwrap_or_default().as_bytes();
    Ok(BodyFacts {
        model: model.unwrap_or_default().to_string(),
        route: Route {
            model: model.map(Arc::from),
            prefix: block_hashes(&prompt[..prompt.len().min(limit)], prefix),
            ..Route::default()
        },
        stream: field("stream") == Some("true"),
        prompt_bytes: prompt.len() as u64,
        output_bound: None,
        sessions: SessionKeys::default(),
        turn: None,
    })
}

/// `body` with its model renamed to `model`: the JSON field
/// ([`with_model`]) or, for a form (`form` is its content type), the
/// `model` field.
pub fn renamed(body: &[u8], form: Option<&str>, model: &str) -> Option<Vec<u8>> {
    match form {
        Some(content_type) => crate::multipart::with_field(content_type, body, "model", model),
        None => with_model(body, model),
    }
}

/// `body` (one JSON object, as [`body_facts`] accepted it) with its
/// top-level `model` set to `model`: the value replaced in place, or the
/// field added first when the body names none. Every other byte stays as
/// the client sent it. `None` if `body` is not a JSON object after all.
pub fn with_model(body: &[u8], model: &str) -> Option<Vec<u8>> {
    let name = serde_json::to_vec(model).expect("a string serialises");
    let open = skip_space(body, 0);
    if body.get(open) != Some(&b'{') {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() + name.len() + 10);
    match model_value(body, open + 1)? {
        Some(value) => {
            out.extend_from_slice(&body[..value.start]);
            out.extend_from_slice(&name);
            out.extend_from_slice(&body[value.end..]);
        }
        None => {
            let first = skip_space(body, open + 1);
            out.extend_from_slice(&body[..=open]);
            out.extend_from_slice(b"\"model\":");
            out.extend_from_slice(&name);
            if body.get(first) != Some(&b'}') {
                out.push(b',');
            }
            out.extend_from_slice(&body[open + 1..]);
        }
    }
    Some(out)
}

fn skip_space(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

/// The end of the string that starts at `i` (just past its closing quote).
fn skip_string(b: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    loop {
        match b.get(i)? {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
}

/// The end of the JSON value that starts at `i`.
fn skip_value(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b.get(j)? {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while b
                .get(j)
                .is_some_and(|c| !matches!(c, b',' | b'}' | b']') && !c.is_ascii_whitespace())
            {
                j += 1;
            }
            Some(j)
        }
    }
}

/// Where the top-level `model` value of the object whose members start at
/// `i` lies: `Some(None)` when it has none.
fn model_value(b: &[u8], mut i: usize) -> Option<Option<std::ops::Range<usize>>> {
    loop {
        i = skip_space(b, i);
        match b.get(i)? {
            b'}' => return Some(None),
            b'"' => {}
            _ => return None,
        }
        let key_end = skip_string(b, i)?;
        let key = &b[i..key_end];
        i = skip_space(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        let start = skip_space(b, i + 1);
        let end = skip_value(b, start)?;
        let is_model = key == b"\"model\""
            || (key.contains(&b'\\')
                && serde_json::from_slice::<String>(key).is_ok_and(|k| k == "model"));
        if is_model {
            return Some(Some(start..end));
        }
        i = skip_space(b, end);
        match b.get(i)? {
            b',' => i += 1,
            b'}' => return Some(None),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn forms_name_their_model_and_stream_flag() {
        let ct = "multipart/form-data; boundary=B";
        let body = b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n\
--B\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n whisper-1 \r\n\
--B\r\nContent-Disposition: form-data; name=\"stream\"\r\n\r\ntrue\r\n--B--\r\n";
        let f = form_facts(ct, body, &PrefixConfig::default()).unwrap();
        assert_eq!((f.model.as_str(), f.stream), ("whisper-1", true));
        assert!(form_facts(ct, b"not a form", &PrefixConfig::default()).is_err());
        let out = renamed(body, Some(ct), "big-whisper").unwrap();
        let f = form_facts(ct, &out, &PrefixConfig::default()).unwrap();
        assert_eq!(f.model, "big-whisper");
    }

    #[test]
    fn with_model_replaces_or_adds_the_model_and_keeps_the_rest() {
        let swap = |b: &str| String::from_utf8(with_model(b.as_bytes(), "new").unwrap()).unwrap();
        assert_eq!(
            swap(r#"{"messages":[{"model":"x"}], "model" : "old" ,"n":1}"#),
            r#"{"messages":[{"model":"x"}], "model" : "new" ,"n":1}"#
        );
        assert_eq!(
            swap(r#" {"a":"}\"{","model":"o"}"#),
            r#" {"a":"}\"{","model":"new"}"#
        );
        assert_eq!(swap(r#"{"mod\u0065l":"o"}"#), r#"{"mod\u0065l":"new"}"#);
        assert_eq!(
            swap(r#"{"stream":true}"#),
            r#"{"model":"new","stream":true}"#
        );
        assert_eq!(swap("{ }"), r#"{"model":"new" }"#);
        let quoted = with_model(br#"{"model":"a"}"#, "q\"uote").unwrap();
        assert_eq!(quoted, br#"{"model":"q\"uote"}"#);
        assert!(with_model(b"[1]", "new").is_none());
        assert!(with_model(br#"{"model":"#, "new").is_none());
    }

    proptest! {
        /// Any JSON object: the result is the same object with `model`
        /// set, nothing else changed.
        #[test]
        fn with_model_changes_only_the_model(
            fields in proptest::collection::btree_map(
                "[a-z\"\\\\]{0,6}",
                prop_oneof![
                    any::<i64>().prop_map(serde_json::Value::from),
                    ".{0,8}".prop_map(serde_json::Value::from),
                    proptest::collection::vec(".{0,4}", 0..3).prop_map(serde_json::Value::from),
                ],
                0..6,
            ),
            name in ".{0,20}",
        ) {
            let body = serde_json::to_vec_pretty(&fields).unwrap();
            let out = with_model(&body, &name).unwrap();
            let mut expected: serde_json::Map<String, serde_json::Value> =
                fields.into_iter().collect();
            expected.insert("model".into(), serde_json::Value::from(name));
            let got: serde_json::Map<String, serde_json::Value> =
                serde_json::from_slice(&out).unwrap();
            prop_assert_eq!(got, expected);
        }
    }

    #[test]
    fn only_json_objects_are_inference_requests() {
        assert!(parse_fields(br#" {"model":"m","messages":[]}"#).is_ok());
        assert!(parse_fields(br#"{"messages":[]}"#).unwrap().model.is_none());
        assert!(parse_fields(b"[1,2]").is_err());
        assert!(parse_fields(b"").is_err());
        assert!(parse_fields(br#"{"model":"#).is_err());
        // Bytes that are not UTF-8 where nothing is read, as before: the
        // model server judges them; where the balancer reads, refused.
        let odd = b"{\"model\":\"m\",\"tools\":\"\xff\"}";
        assert_eq!(parse_fields(odd).unwrap().model(), Some("m"));
        assert!(parse_fields(b"{\"model\":\"\xff\"}").is_err());
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
