//! OpenAI-compatible request and error bodies: the prompt text of a
//! request, and `{"error":{"message","type","code"}}`.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Serialize;

/// A JSON value as the prompt walk sees it, borrowed from the body where it
/// can be: a string (borrowed unless it has escapes), a list, `true`, and of
/// an object only the keys the walk reads (`role`, `content`, `text`);
/// anything else is [`PromptJson::Other`]. Reading a request into these
/// instead of `serde_json::Value`s builds no maps and copies no plain
/// string: it is done once per request, on the request path.
#[derive(Debug, Default, Clone, PartialEq)]
pub enum PromptJson<'a> {
    Str(Cow<'a, str>),
    List(Vec<PromptJson<'a>>),
    Object(Box<PromptObject<'a>>),
    True,
    #[default]
    Other,
}

/// The keys of a JSON object the prompt walk reads (the last of a
/// repeated key, as `serde_json::Value` keeps it).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct PromptObject<'a> {
    pub role: Option<PromptJson<'a>>,
    pub content: Option<PromptJson<'a>>,
    pub text: Option<PromptJson<'a>>,
}

impl<'a> PromptJson<'a> {
    /// The same value, owning its strings.
    pub fn into_owned(self) -> PromptJson<'static> {
        let owned = |v: Option<PromptJson<'a>>| v.map(PromptJson::into_owned);
        match self {
            PromptJson::Str(s) => PromptJson::Str(Cow::Owned(s.into_owned())),
            PromptJson::List(items) => {
                PromptJson::List(items.into_iter().map(PromptJson::into_owned).collect())
            }
            PromptJson::Object(o) => PromptJson::Object(Box::new(PromptObject {
                role: owned(o.role),
                content: owned(o.content),
                text: owned(o.text),
            })),
            PromptJson::True => PromptJson::True,
            PromptJson::Other => PromptJson::Other,
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            PromptJson::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The string, if this is one, as it was read.
    pub fn as_cow(self) -> Option<Cow<'a, str>> {
        match self {
            PromptJson::Str(s) => Some(s),
            _ => None,
        }
    }

    fn object(&self) -> Option<&PromptObject<'a>> {
        match self {
            PromptJson::Object(o) => Some(o),
            _ => None,
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptJson<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptJsonVisitor)
    }
}

struct PromptJsonVisitor;

impl<'de> Visitor<'de> for PromptJsonVisitor {
    type Value = PromptJson<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(if v {
            PromptJson::True
        } else {
            PromptJson::Other
        })
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(PromptJson::Other)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(PromptJson::Other)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(PromptJson::Other)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(PromptJson::Other)
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(PromptJson::Other)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        PromptJson::deserialize(d)
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(PromptJson::Str(Cow::Borrowed(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(PromptJson::Str(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(PromptJson::Str(Cow::Owned(v)))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(PromptJson::List(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut object = PromptObject::default();
        while let Some(key) = map.next_key::<PromptKey>()? {
            let slot = match key {
                PromptKey::Role => &mut object.role,
                PromptKey::Content => &mut object.content,
                PromptKey::Text => &mut object.text,
                PromptKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            *slot = Some(map.next_value()?);
        }
        // An object with none of the keys the walk reads is nothing to it:
        // kept unboxed, so a hostile body of a million `{}` costs no more
        // than a million numbers.
        if object == PromptObject::default() {
            return Ok(PromptJson::Other);
        }
        Ok(PromptJson::Object(Box::new(object)))
    }
}

/// An object key, read without copying it.
enum PromptKey {
    Role,
    Content,
    Text,
    Other,
}

impl<'de> Deserialize<'de> for PromptKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = PromptKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptKey, E> {
                Ok(match v {
                    "role" => PromptKey::Role,
                    "content" => PromptKey::Content,
                    "text" => PromptKey::Text,
                    _ => PromptKey::Other,
                })
            }
        }
        deserializer.deserialize_identifier(KeyVisitor)
    }
}

/// The fields of a request body that carry its prompt, whatever the route:
/// chat (`messages`), completions and infill (`prompt`), Responses
/// (`instructions`, `input`), Anthropic Messages (`system`, `messages`),
/// rerank (`query`, `documents`), embeddings and tokenize (`input`,
/// `content`), score (`text_1`).
#[derive(Debug, Default, Clone, Copy)]
pub struct PromptFields<'a> {
    pub system: Option<&'a PromptJson<'a>>,
    pub instructions: Option<&'a PromptJson<'a>>,
    pub messages: Option<&'a PromptJson<'a>>,
    pub input: Option<&'a PromptJson<'a>>,
    pub prompt: Option<&'a PromptJson<'a>>,
    pub query: Option<&'a PromptJson<'a>>,
    pub documents: Option<&'a PromptJson<'a>>,
    pub content: Option<&'a PromptJson<'a>>,
    pub text_1: Option<&'a PromptJson<'a>>,
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

/// The whole prompt [`prompt_text`] would give uncut, measured without
/// copying it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptLength {
    /// Its length in bytes: what a token estimate starts from.
    pub bytes: u64,
    /// Where its last assistant message begins. A client re-sends the
    /// whole conversation every turn, with the answer it got and what
    /// followed it appended: the text before that answer is the prompt of
    /// the conversation's previous turn. `None`: no assistant message.
    pub last_answer_at: Option<u64>,
}

/// Measures the whole prompt ([`PromptLength`]).
pub fn prompt_length(fields: &PromptFields<'_>) -> PromptLength {
    let mut n = Count(PromptLength::default());
    walk_prompt(fields, &mut n);
    n.0
}

/// Where the prompt's pieces go.
trait Sink {
    fn put(&mut self, bytes: &[u8]);
    /// Nothing more is wanted.
    fn full(&self) -> bool;
    /// A message with this role begins here.
    fn message(&mut self, _role: &str) {}
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
struct Count(PromptLength);

impl Sink for Count {
    fn put(&mut self, bytes: &[u8]) {
        self.0.bytes = self.0.bytes.saturating_add(bytes.len() as u64);
    }
    fn full(&self) -> bool {
        false
    }
    fn message(&mut self, role: &str) {
        if role == "assistant" {
            self.0.last_answer_at = Some(self.0.bytes);
        }
    }
}

fn walk_prompt(fields: &PromptFields<'_>, out: &mut impl Sink) {
    fn push_text(out: &mut impl Sink, v: &PromptJson<'_>) {
        match v {
            PromptJson::Str(t) => out.put(t.as_bytes()),
            // Content parts: [{"type": "text", "text": "..."}, ...].
            PromptJson::List(parts) => {
                for part in parts {
                    if out.full() {
                        return;
                    }
                    let text = part.object().and_then(|o| o.text.as_ref());
                    push_text(out, text.unwrap_or(part));
                }
            }
            _ => {}
        }
    }
    /// Messages: `[{"role": …, "content": …}, …]`.
    fn push_messages(out: &mut impl Sink, messages: &[PromptJson<'_>]) {
        for m in messages {
            if out.full() {
                break;
            }
            let m = m.object();
            if let Some(role) = m.and_then(|m| m.role.as_ref()?.as_str()) {
                out.message(role);
                out.put(role.as_bytes());
            }
            out.put(&[0x1f]);
            if let Some(content) = m.and_then(|m| m.content.as_ref()) {
                push_text(out, content);
            }
            out.put(&[0x1e]);
        }
    }
    let is_messages = |items: &[PromptJson<'_>]| {
        (items.first().and_then(PromptJson::object)).is_some_and(|m| m.role.is_some())
    };
    let ordered = [
        fields.system,
        fields.instructions,
        // A conversation is a list; anything else there is not one.
        fields.messages.filter(|m| matches!(m, PromptJson::List(_))),
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
            PromptJson::List(items) if is_messages(items) => push_messages(out, items),
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
    use super::{prompt_length, prompt_text, PromptFields, PromptJson};

    /// The prompt walk's view of a JSON value.
    fn pj(v: serde_json::Value) -> PromptJson<'static> {
        use serde::Deserialize;
        PromptJson::deserialize(&v).unwrap().into_owned()
    }

    macro_rules! json {
        ($($t:tt)+) => {
            pj(serde_json::json!($($t)+))
        };
    }

    #[test]
    fn objects_without_the_walks_keys_are_nothing_to_it() {
        assert_eq!(json!({"a": 1, "type": "image_url"}), PromptJson::Other);
        assert_eq!(
            json!([{}, {}]),
            PromptJson::List(vec![PromptJson::Other; 2])
        );
        assert!(matches!(json!({"role": null}), PromptJson::Object(_)));
    }

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
    fn the_previous_turn_ends_where_the_last_answer_begins() {
        let turn = |messages: PromptJson<'static>| {
            let fields = PromptFields {
                messages: Some(&messages),
                ..PromptFields::default()
            };
            (prompt_text(&fields, usize::MAX), prompt_length(&fields))
        };
        let (first, length) = turn(json!([
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Q1"}
        ]));
        assert_eq!(length.bytes, first.len() as u64);
        assert_eq!(
            length.last_answer_at, None,
            "a first turn continues nothing"
        );
        // The next turn re-sends the first with the answer and a tool's
        // output appended.
        let (second, length) = turn(json!([
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"},
            {"role": "tool", "content": "out"},
            {"role": "user", "content": "Q2"}
        ]));
        assert_eq!(length.bytes, second.len() as u64);
        let at = length.last_answer_at.expect("an answer") as usize;
        assert_eq!(second[..at], first[..], "before the answer: the first turn");
        let (_, length) = turn(json!([
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2"},
            {"role": "user", "content": "Q3"}
        ]));
        assert_eq!(
            length.last_answer_at,
            Some(b"user\x1fQ1\x1eassistant\x1fA1\x1euser\x1fQ2\x1e".len() as u64),
            "the last answer counts"
        );
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
