//! Messages' texts as a chat template reads them, remembered by their JSON.
//!
//! A conversation's next request sends every earlier turn again, byte for
//! byte. Unescaping and copying those turns' contents was most of reading
//! a 33 KB request; a content seen before is found here by a seeded hash
//! of its JSON instead, the template value it became shared
//! ([`crate::memo`]: up to [`TEXT_BYTES_PER_GENERATION`] bytes in each of
//! two generations per model).

use minijinja::Value as Jinja;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::memo::{Held, Memo, Weight};
use crate::Unsupported;

/// Text remembered per generation: a few hundred conversations of 8k
/// tokens.
pub const TEXT_BYTES_PER_GENERATION: usize = 8 << 20;
/// Contents shorter than this are read again rather than looked up.
const REMEMBERED_FROM: usize = 256;
/// Nor is a content longer than this remembered: one huge message would
/// push every conversation's turns out of the memo.
const REMEMBERED_TO: usize = TEXT_BYTES_PER_GENERATION / 16;

impl Weight for Jinja {
    fn weight(&self) -> usize {
        self.as_str().map_or(0, str::len)
    }
}

/// Contents remembered (module docs).
pub struct Texts {
    memo: Memo<Jinja>,
}

impl Default for Texts {
    fn default() -> Self {
        Texts {
            memo: Memo::new(TEXT_BYTES_PER_GENERATION),
        }
    }
}

impl Texts {
    /// Reads a request's contents one after another, taking the memo's
    /// lock once for all of them (let go only while a new one is read).
    pub fn reader(&self) -> Reader<'_> {
        Reader(self.memo.held())
    }
}

/// See [`Texts::reader`].
pub struct Reader<'t>(Held<'t, Jinja>);

impl Reader<'_> {
    /// A message's `content` as the template reads it: a string, or text
    /// parts joined by newlines (vLLM's "string" content format).
    pub fn content(&mut self, raw: &RawValue) -> Result<Jinja, Unsupported> {
        let json = raw.get();
        match json.as_bytes().first() {
            Some(b'"') => {}
            Some(b'[') => return text_parts(json),
            _ => return Err(Unsupported::Message("no content")),
        }
        if !(REMEMBERED_FROM..=REMEMBERED_TO).contains(&json.len()) {
            return string(json);
        }
        let held = &mut self.0;
        let key = held.key(json.as_bytes());
        if let Some(known) = held.get(key) {
            return Ok(known.clone());
        }
        held.release();
        let text = string(json)?;
        held.insert(key, text.clone());
        Ok(text)
    }
}

fn string(json: &str) -> Result<Jinja, Unsupported> {
    let text: String =
        serde_json::from_str(json).map_err(|_| Unsupported::Message("no content"))?;
    Ok(Jinja::from(text))
}

fn text_parts(json: &str) -> Result<Jinja, Unsupported> {
    let parts: Vec<Value> =
        serde_json::from_str(json).map_err(|_| Unsupported::Message("no content"))?;
    let texts = parts
        .iter()
        .map(
            |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                _ => Err(Unsupported::Message("a part that is not text")),
            },
        )
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Jinja::from(texts.join("\n")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(v: serde_json::Value) -> Box<RawValue> {
        serde_json::value::to_raw_value(&v).unwrap()
    }

    #[test]
    fn a_long_content_is_read_once_and_its_text_shared_after() {
        let texts = Texts::default();
        let read = |raw: &RawValue| texts.reader().content(raw);
        let long = raw(serde_json::json!("a line\n\"quoted\" é ".repeat(20)));
        let first = read(&long).unwrap();
        assert_eq!(
            first.as_str(),
            Some("a line\n\"quoted\" é ".repeat(20).as_str())
        );
        assert_eq!(texts.memo.lock().held(), 1);
        // Found again: the same text, nothing more remembered.
        assert_eq!(read(&long).unwrap(), first);
        assert_eq!(texts.memo.lock().held(), 1);
        // A short one is read each time, never remembered; nor a huge one.
        let short = read(&raw(serde_json::json!("hi"))).unwrap();
        assert_eq!(short.as_str(), Some("hi"));
        let huge = "x".repeat(REMEMBERED_TO + 1);
        let whole = read(&raw(serde_json::json!(huge))).unwrap();
        assert_eq!(whole.as_str().map(str::len), Some(huge.len()));
        assert_eq!(texts.memo.lock().held(), 1);
        assert_eq!(
            read(&raw(serde_json::json!(3))),
            Err(Unsupported::Message("no content"))
        );
    }
}
