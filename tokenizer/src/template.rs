//! A model's chat template, rendered as `transformers`' `apply_chat_template`
//! renders it for vLLM: Jinja with `trim_blocks` and `lstrip_blocks` and
//! loop controls; `raise_exception(message)`; `strftime_now(format)`;
//! `tojson` written as Python's `json.dumps(ensure_ascii=False)` writes
//! (`", "` and `": "` between items); Python's string and dict methods
//! (`.strip()`, `.startswith()`, `.items()`, …); in context the special
//! tokens by name, then the request's `chat_template_kwargs`, then
//! `messages`, `tools` and `documents` (none) and `add_generation_prompt`.

use std::collections::BTreeMap;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, Error, ErrorKind, Value as Jinja};
use serde_json::{Map, Value};

/// The template's name in its environment.
const NAME: &str = "chat";
/// The special tokens a template reads by name (`transformers`' special
/// tokens map).
const SPECIAL_TOKENS: [&str; 4] = ["bos_token", "eos_token", "unk_token", "pad_token"];

pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: Vec<(&'static str, String)>,
}

/// The chat template in `tokenizer_config.json`: a string, or a list of
/// named ones of which the one named `default` is a chat's.
pub fn source_in(config: &Map<String, Value>) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(source) => Some(source.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// A special token in the config: its text, or an object with `content`.
fn special_token(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl ChatTemplate {
    pub fn new(source: String, config: &Map<String, Value>) -> Result<Self, String> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Jinja, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", |format: String| -> Result<String, Error> {
            crate::strftime::now(&format).map_err(|e| Error::new(ErrorKind::InvalidOperation, e))
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source)
            .map_err(|e| e.to_string())?;
        let special_tokens = SPECIAL_TOKENS
            .iter()
            .filter_map(|name| Some((*name, special_token(config.get(*name)?)?)))
            .collect();
        Ok(ChatTemplate {
            env,
            special_tokens,
        })
    }

    /// The template rendered, as UTF-8 (minijinja writes only text; it is
    /// checked where it is encoded, [`crate::pieces`]); `expected_len`:
    /// about how long the text will be (written into a buffer that long
    /// from the start: growing one to a conversation's 33 KB cost a tenth
    /// of the render).
    pub fn render(
        &self,
        messages: Jinja,
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
        expected_len: usize,
    ) -> Result<Vec<u8>, String> {
        let mut context: BTreeMap<String, Jinja> = BTreeMap::new();
        for (name, token) in &self.special_tokens {
            context.insert((*name).to_string(), Jinja::from(token.as_str()));
        }
        for (name, v) in kwargs {
            context.insert(name.clone(), Jinja::from(Serde(v)));
        }
        context.insert("messages".into(), messages);
        context.insert("tools".into(), Jinja::from(()));
        context.insert("documents".into(), Jinja::from(()));
        context.insert(
            "add_generation_prompt".into(),
            Jinja::from(add_generation_prompt),
        );
        let template = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        let mut text = Vec::with_capacity(expected_len);
        template
            .render_captured_to(context, &mut text)
            .map_err(|e| e.to_string())?;
        Ok(text)
    }
}

/// `tojson`, as `transformers` defines it: `json.dumps(x,
/// ensure_ascii=False, indent=indent)`, `indent` given by name or first.
fn tojson(value: Jinja, indent: Option<Jinja>, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match kwargs.get::<Option<usize>>("indent")? {
        Some(width) => Some(width),
        None => indent.map(usize::try_from).transpose()?,
    };
    kwargs.assert_all_used()?;
    let value = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&value, indent, 0, &mut out);
    Ok(out)
}

/// Writes `v` as Python's `json.dumps` does.
fn python_json(v: &Value, indent: Option<usize>, depth: usize, out: &mut String) {
    let (open, close, items): (char, char, Vec<(Option<&String>, &Value)>) = match v {
        Value::Array(a) => ('[', ']', a.iter().map(|v| (None, v)).collect()),
        Value::Object(o) => ('{', '}', o.iter().map(|(k, v)| (Some(k), v)).collect()),
        scalar => {
            out.push_str(&scalar.to_string());
            return;
        }
    };
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return;
    }
    let newline = |out: &mut String, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    };
    for (i, (key, item)) in items.into_iter().enumerate() {
        if i > 0 {
            out.push_str(if indent.is_some() { "," } else { ", " });
        }
        newline(out, depth + 1);
        if let Some(key) = key {
            out.push_str(&Value::String(key.clone()).to_string());
            out.push_str(": ");
        }
        python_json(item, indent, depth + 1, out);
    }
    newline(out, depth);
    out.push(close);
}
