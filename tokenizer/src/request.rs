//! The fields of a request body that decide its prompt's tokens, read
//! straight from the body's bytes: a message's content kept as sent (read
//! by [`Texts`], which remembers the contents of a conversation's earlier
//! turns), every other field skipped unbuilt. (Built into a
//! `serde_json::Value` first, a conversation of 33 KB took 14 µs, a
//! quarter of its next turn's cost.)
//!
//! Lenient where the engine would be: a message's fields other than
//! `role`, `content` and `name`, a content that is no text, are read as
//! what they are and refused later by [`crate::ModelTokenizer`] with their
//! reason; only a body whose shape no chat has (not an object, `messages`
//! not a list of objects) fails to parse.

use std::borrow::Cow;
use std::fmt;

use std::sync::Arc;

use minijinja::value::{Enumerator, Object, ObjectRepr};
use minijinja::Value as Jinja;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::texts::{Reader, Texts};
use crate::Unsupported;

/// What a request body says of its prompt.
#[derive(Debug, Deserialize)]
pub struct Request<'a> {
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<Loose<'a>>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    documents: Option<Value>,
    #[serde(default)]
    chat_template: Option<Value>,
    #[serde(default)]
    continue_final_message: Option<Value>,
    #[serde(default)]
    add_generation_prompt: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    #[serde(borrow, default)]
    cache_salt: Option<Loose<'a>>,
}

impl<'a> Request<'a> {
    /// Reads `body` (module docs).
    pub fn parse(body: &'a [u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(body)
    }

    /// The request's `cache_salt`, where it is a string.
    pub fn cache_salt(&self) -> Option<&str> {
        self.cache_salt.as_ref()?.text()
    }

    /// A completion's prompt, where it is a string.
    pub(crate) fn prompt(&self) -> Option<&str> {
        self.prompt.as_ref()?.text()
    }

    pub(crate) fn is_chat(&self) -> bool {
        self.messages.is_some()
    }

    /// The first field that makes the engine render the chat its own way
    /// (crate docs): sent, and not null, false or an empty list.
    pub(crate) fn engine_rendered(&self) -> Option<&'static str> {
        let sent = |v: &Option<Value>| match v {
            None | Some(Value::Null | Value::Bool(false)) => false,
            Some(Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
        };
        [
            ("tools", &self.tools),
            ("documents", &self.documents),
            ("chat_template", &self.chat_template),
            ("continue_final_message", &self.continue_final_message),
        ]
        .into_iter()
        .find_map(|(name, v)| sent(v).then_some(name))
    }

    /// `add_generation_prompt`: true unless the request says otherwise.
    pub(crate) fn generation_prompt(&self) -> bool {
        self.add_generation_prompt
            .as_ref()
            .and_then(Value::as_bool)
            .unwrap_or(true)
    }

    pub(crate) fn chat_template_kwargs(&self) -> Result<Option<&Map<String, Value>>, Unsupported> {
        match &self.chat_template_kwargs {
            Some(Value::Object(m)) => Ok(Some(m)),
            None | Some(Value::Null) => Ok(None),
            Some(_) => Err(Unsupported::Field("chat_template_kwargs that is no object")),
        }
    }

    /// The bytes of the messages' contents, with room for what a
    /// template writes around each.
    pub(crate) fn messages_len(&self) -> usize {
        let messages = self.messages.as_deref().unwrap_or_default();
        messages
            .iter()
            .map(|m| m.content.map_or(0, |c| c.get().len()) + 64)
            .sum()
    }

    /// The messages as the template is given them, when they are plain: a
    /// `role`, a `content` (text parts joined by newlines) and a `name`.
    pub(crate) fn plain_messages(&self, texts: &Texts) -> Result<Jinja, Unsupported> {
        let messages = self.messages.as_deref().unwrap_or_default();
        let mut reader = texts.reader();
        messages.iter().map(|m| m.plain(&mut reader)).collect()
    }
}

/// A plain message as a template reads it: a map of its `role`, its
/// `content` and, where it has one, its `name` (a struct rather than a
/// map of values: building and reading 36 maps was a sixth of rendering a
/// conversation).
#[derive(Debug)]
struct PlainMessage {
    role: Jinja,
    content: Jinja,
    name: Option<Jinja>,
}

impl Object for PlainMessage {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Jinja) -> Option<Jinja> {
        match key.as_str()? {
            "role" => Some(self.role.clone()),
            "content" => Some(self.content.clone()),
            "name" => self.name.clone(),
            _ => None,
        }
    }

    /// In the order a map of values iterates: its keys sorted.
    fn enumerate(self: &Arc<Self>) -> Enumerator {
        match self.name {
            Some(_) => Enumerator::Str(&["content", "name", "role"]),
            None => Enumerator::Str(&["content", "role"]),
        }
    }
}

/// A string, or anything else (skipped).
#[derive(Debug)]
enum Loose<'a> {
    Text(Cow<'a, str>),
    Other,
}

impl Loose<'_> {
    fn text(&self) -> Option<&str> {
        match self {
            Loose::Text(t) => Some(t),
            Loose::Other => None,
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Loose<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(LooseVisitor)
    }
}

struct LooseVisitor;

impl<'de> Visitor<'de> for LooseVisitor {
    type Value = Loose<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Loose::Text(Cow::Borrowed(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Loose::Text(Cow::Owned(v.to_string())))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Loose::Text(Cow::Owned(v)))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Loose::Other)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Loose::Other)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Loose::Other)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Loose::Other)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Loose::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Loose::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Loose::Other)
    }
}

/// One message as read, and the first reason it is not plain.
#[derive(Debug, Default)]
struct Message<'a> {
    role: Option<Cow<'a, str>>,
    /// As sent: read by [`Texts`], which remembers it.
    content: Option<&'a RawValue>,
    name: Option<Cow<'a, str>>,
    not_plain: Option<&'static str>,
}

impl Message<'_> {
    fn plain(&self, texts: &mut Reader) -> Result<Jinja, Unsupported> {
        if let Some(why) = self.not_plain {
            return Err(Unsupported::Message(why));
        }
        let (Some(role), Some(content)) = (&self.role, self.content) else {
            let missing = if self.role.is_none() {
                "no role"
            } else {
                "no content"
            };
            return Err(Unsupported::Message(missing));
        };
        Ok(Jinja::from_object(PlainMessage {
            role: Jinja::from(&**role),
            content: texts.content(content)?,
            name: self.name.as_deref().map(Jinja::from),
        }))
    }

    fn refuse(&mut self, why: &'static str) {
        self.not_plain.get_or_insert(why);
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Message<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(MessageVisitor)
    }
}

struct MessageVisitor;

impl<'de> Visitor<'de> for MessageVisitor {
    type Value = Message<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut m = Message::default();
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            match &*key {
                "role" => match map.next_value()? {
                    Loose::Text(role) => m.role = Some(role),
                    Loose::Other => m.refuse("no role"),
                },
                "name" => match map.next_value()? {
                    Loose::Text(name) => m.name = Some(name),
                    Loose::Other => m.refuse("fields other than role, content and name"),
                },
                "content" => m.content = Some(map.next_value()?),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    m.refuse("fields other than role, content and name");
                }
            }
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<Request<'_>, serde_json::Error> {
        Request::parse(body.as_bytes())
    }

    #[test]
    fn a_body_no_chat_has_fails_to_parse_and_odd_fields_are_read_as_what_they_are() {
        assert!(parse("[1]").is_err());
        assert!(parse(r#"{"messages": "hi"}"#).is_err());
        assert!(parse(r#"{"messages": ["hi"]}"#).is_err());
        let odd =
            parse(r#"{"prompt": [1, 2], "cache_salt": 7, "add_generation_prompt": "no"}"#).unwrap();
        assert_eq!((odd.prompt(), odd.cache_salt()), (None, None));
        assert!(odd.generation_prompt() && !odd.is_chat());
        let salted = parse(r#"{"prompt": "a\nb", "cache_salt": "s\"alt"}"#).unwrap();
        assert_eq!(
            (salted.prompt(), salted.cache_salt()),
            (Some("a\nb"), Some("s\"alt"))
        );
    }

    #[test]
    fn a_message_with_more_than_plain_fields_is_refused_with_its_reason() {
        let texts = Texts::default();
        let why = |messages: &str| {
            let body = format!(r#"{{"messages": [{messages}]}}"#);
            parse(&body).unwrap().plain_messages(&texts).unwrap_err()
        };
        let message = Unsupported::Message;
        assert_eq!(why(r#"{"content": "x"}"#), message("no role"));
        assert_eq!(why(r#"{"role": "user"}"#), message("no content"));
        assert_eq!(why(r#"{"role": 1, "content": "x"}"#), message("no role"));
        assert_eq!(
            why(r#"{"role": "user", "content": null}"#),
            message("no content")
        );
        let tool = r#"{"role": "assistant", "content": "x", "tool_calls": []}"#;
        assert_eq!(
            why(tool),
            message("fields other than role, content and name")
        );
        let image = r#"{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}"#;
        assert_eq!(why(image), message("a part that is not text"));
    }

    #[test]
    fn a_plain_message_reads_as_a_map_of_its_fields() {
        let texts = Texts::default();
        let body = r#"{"messages": [{"name": "ann", "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}"#;
        let messages = parse(body).unwrap().plain_messages(&texts).unwrap();
        let env = minijinja::Environment::new();
        let read = |source: &str| {
            env.render_str(source, minijinja::context! { messages => messages.clone() })
                .unwrap()
        };
        assert_eq!(read("{{ messages[0].content }}"), "a\nb");
        assert_eq!(
            read("{{ messages[0]['role'] }}|{{ messages[0].name }}"),
            "user|ann"
        );
        assert_eq!(
            read("{% for k, v in messages[0]|items %}{{ k }};{% endfor %}"),
            "content;name;role;"
        );
        assert_eq!(
            read("{{ 'name' in messages[0] }}|{{ messages[0].other is defined }}"),
            "True|False"
        );
    }
}
