//! A prompt's token ids as the engine counts them, computed in process from
//! the model's own files (a Hugging Face snapshot's `tokenizer.json`, its
//! `tokenizer_config.json` and, where it has one, `chat_template.jinja`),
//! so that the balancer can match a request against the KV-cache blocks an
//! engine reports without asking the engine first.
//!
//! What vLLM does with a request, restated:
//! - a chat (`messages`): the chat template is rendered as `transformers`'
//!   `apply_chat_template` renders it (Jinja with `trim_blocks` and
//!   `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a
//!   `tojson` that keeps non-ASCII, Python's string methods; in context the
//!   messages, `add_generation_prompt` (true unless the request says
//!   otherwise), the special tokens by name and the request's
//!   `chat_template_kwargs`), then encoded *without* special tokens added
//!   (the template writes them);
//! - a completion (`prompt` as a string): encoded *with* them (the
//!   post-processor's BOS / EOS).
//!
//! What it leaves to the engine's own `/tokenize` (an [`Unsupported`]):
//! requests with `tools` or `documents`, a request's own `chat_template`,
//! `continue_final_message`, messages carrying more than a `role`, a
//! `content` (a string, or parts that are all text: joined by newlines, as
//! vLLM's "string" content format does) and a `name`, prompts given as
//! token ids or as lists, and a template that fails or that this Jinja
//! cannot read. vLLM renders those with its own types (a tool as its
//! pydantic model dumps it) that a restatement would get subtly wrong, and
//! a wrong token is worse than none: the blocks would match nowhere.
//!
//! Speed: the rendered text is cut where the tokenizer cuts it anyway (at
//! its added tokens: `<|im_start|>`, `<s>`, …) and the ids of each piece
//! between two are remembered ([`pieces`]), so a conversation's next turn
//! encodes only what it added; rendering and cutting are linear in the
//! prompt and cheap beside encoding. A byte-level BPE tokenizer's ASCII
//! piece is cut into words here and only the words go to its BPE model
//! ([`words`]: five times faster than `tokenizers`' whole pipeline).

mod memo;
mod pieces;
mod request;
mod strftime;
mod template;
mod texts;
mod words;

use std::path::Path;

use serde_json::{Map, Value};
use tokenizers::{Encoding, Token, Tokenizer};

use pieces::{Cutter, Pieces};
pub use pieces::{MAX_IDS, MAX_PIECE_BYTES};
pub use request::Request;
use template::ChatTemplate;
use texts::Texts;

/// Why a model's files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("tokenizer.json: {0}")]
    Tokenizer(String),
    #[error("tokenizer_config.json: {0}")]
    Config(String),
}

/// Why a request's tokens are left to the engine (module docs).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsupported {
    #[error("the model has no chat template that could be read")]
    NoTemplate,
    #[error("the request has {0}, which the engine renders its own way")]
    Field(&'static str),
    #[error("a message has {0}")]
    Message(&'static str),
    #[error("neither messages nor a prompt given as a string")]
    NoPrompt,
    #[error("the chat template failed: {0}")]
    Render(String),
    #[error("the tokenizer failed: {0}")]
    Encode(String),
}

impl Unsupported {
    /// A short name of the reason, for a metric's label.
    pub fn kind(&self) -> &'static str {
        match self {
            Unsupported::NoTemplate => "no_template",
            Unsupported::Field(_) => "field",
            Unsupported::Message(_) => "message",
            Unsupported::NoPrompt => "no_prompt",
            Unsupported::Render(_) => "render",
            Unsupported::Encode(_) => "encode",
        }
    }
}

/// A request's tokens, or its prompt rendered but not encoded: it has more
/// than the allowed bytes still to encode (see [`ModelTokenizer::tokens`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tokens {
    Ids(Vec<u32>),
    TooMuchToEncode(Unencoded),
}

/// A prompt's text as the engine encodes it (a chat's template rendered),
/// left for [`ModelTokenizer::encode_all`] to encode: off the caller's
/// event loop, without rendering it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unencoded {
    /// UTF-8, checked where encoded.
    text: Vec<u8>,
    /// Whether the post-processor's special tokens are added (a
    /// completion's prompt; a chat's template writes its own).
    specials: bool,
}

/// One model's tokenizer and chat template (module docs).
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    template: Result<ChatTemplate, String>,
    /// The ids the post-processor puts before and after a prompt when
    /// special tokens are added (a BOS, an EOS).
    around: (Vec<u32>, Vec<u32>),
    cutter: Cutter,
    pieces: Pieces,
    texts: Texts,
}

impl ModelTokenizer {
    /// Reads a Hugging Face snapshot directory: `tokenizer.json` (needed),
    /// `tokenizer_config.json` (special tokens, chat template) and
    /// `chat_template.jinja` (the template, where present: newer snapshots
    /// keep it there).
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let read = |name: &str, needed: bool| -> Result<Option<Vec<u8>>, LoadError> {
            let path = dir.join(name);
            match std::fs::read(&path) {
                Ok(bytes) => Ok(Some(bytes)),
                Err(e) if !needed && e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(LoadError::File {
                    path: path.display().to_string(),
                    message: e.to_string(),
                }),
            }
        };
        let tokenizer = read("tokenizer.json", true)?.unwrap_or_default();
        let config = read("tokenizer_config.json", false)?;
        let template =
            read("chat_template.jinja", false)?.map(|t| String::from_utf8_lossy(&t).into_owned());
        Self::from_parts(&tokenizer, config.as_deref(), template)
    }

    /// The same from the files' contents.
    pub fn from_parts(
        tokenizer_json: &[u8],
        config_json: Option<&[u8]>,
        template: Option<String>,
    ) -> Result<Self, LoadError> {
        let mut tokenizer = Tokenizer::from_bytes(tokenizer_json)
            .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
        // `transformers` turns the file's truncation and padding off unless
        // a call asks for them; vLLM's calls do not.
        tokenizer
            .with_truncation(None)
            .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
        tokenizer.with_padding(None);
        let config: Map<String, Value> = match config_json {
            Some(bytes) => match serde_json::from_slice(bytes) {
                Ok(Value::Object(m)) => m,
                Ok(_) => return Err(LoadError::Config("not a JSON object".into())),
                Err(e) => return Err(LoadError::Config(e.to_string())),
            },
            None => Map::new(),
        };
        let template = match template.or_else(|| template::source_in(&config)) {
            Some(source) => ChatTemplate::new(source, &config),
            None => Err("none in tokenizer_config.json or chat_template.jinja".into()),
        };
        let around = around(&tokenizer)?;
        let cutter = Cutter::new(&tokenizer).map_err(LoadError::Tokenizer)?;
        Ok(ModelTokenizer {
            tokenizer,
            template,
            around,
            cutter,
            pieces: Pieces::default(),
            texts: Texts::default(),
        })
    }

    /// Why chats are left to the engine, if they are: the chat template is
    /// missing or this Jinja cannot read it.
    pub fn template_problem(&self) -> Option<&str> {
        self.template.as_ref().err().map(String::as_str)
    }

    /// The token ids of a request's prompt (module docs), or
    /// [`Tokens::TooMuchToEncode`] when more than `max_unremembered` of
    /// its bytes are not remembered from earlier prompts: the caller
    /// encodes that off its event loop ([`ModelTokenizer::encode_all`]).
    pub fn tokens(
        &self,
        request: &Request,
        max_unremembered: usize,
    ) -> Result<Tokens, Unsupported> {
        let (text, specials) = if request.is_chat() {
            (std::borrow::Cow::Owned(self.rendered(request)?), false)
        } else {
            match request.prompt() {
                Some(prompt) => (std::borrow::Cow::Borrowed(prompt.as_bytes()), true),
                None => return Err(Unsupported::NoPrompt),
            }
        };
        match self.encode(&text, specials, max_unremembered)? {
            Some(ids) => Ok(Tokens::Ids(ids)),
            None => Ok(Tokens::TooMuchToEncode(Unencoded {
                text: text.into_owned(),
                specials,
            })),
        }
    }

    /// The ids of a prompt [`ModelTokenizer::tokens`] left unencoded,
    /// however much of it is new.
    pub fn encode_all(&self, prompt: &Unencoded) -> Result<Vec<u32>, Unsupported> {
        let ids = self.encode(&prompt.text, prompt.specials, usize::MAX)?;
        Ok(ids.expect("no limit on what is encoded"))
    }

    /// The chat template rendered for a request, as vLLM renders it.
    pub fn render(&self, request: &Request) -> Result<String, Unsupported> {
        String::from_utf8(self.rendered(request)?).map_err(|e| Unsupported::Render(e.to_string()))
    }

    /// [`ModelTokenizer::render`]'s text as UTF-8 bytes, not checked.
    fn rendered(&self, request: &Request) -> Result<Vec<u8>, Unsupported> {
        if let Some(field) = request.engine_rendered() {
            return Err(Unsupported::Field(field));
        }
        let template = self
            .template
            .as_ref()
            .map_err(|_| Unsupported::NoTemplate)?;
        let messages = request.plain_messages(&self.texts)?;
        let empty = Map::new();
        let kwargs = request.chat_template_kwargs()?.unwrap_or(&empty);
        template
            .render(
                messages,
                request.generation_prompt(),
                kwargs,
                request.messages_len(),
            )
            .map_err(Unsupported::Render)
    }

    /// `text`'s ids, or `None` when more than `max` of its bytes are not
    /// remembered.
    fn encode(
        &self,
        text: &[u8],
        specials: bool,
        max: usize,
    ) -> Result<Option<Vec<u32>>, Unsupported> {
        let Some(ids) = self
            .pieces
            .encode(&self.tokenizer, &self.cutter, text, max)?
        else {
            return Ok(None);
        };
        if !specials {
            return Ok(Some(ids));
        }
        let (before, after) = &self.around;
        let mut all = Vec::with_capacity(before.len() + ids.len() + after.len());
        all.extend_from_slice(before);
        all.extend_from_slice(&ids);
        all.extend_from_slice(after);
        Ok(Some(all))
    }
}

/// What the post-processor adds around one sequence: found by running it
/// on a one-token probe and reading which ids are not the probe's.
fn around(tokenizer: &Tokenizer) -> Result<(Vec<u32>, Vec<u32>), LoadError> {
    let probe = Encoding::from_tokens(vec![Token::new(0, String::new(), (0, 0))], 0);
    let done = tokenizer
        .post_process(probe, None, true)
        .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
    let sequence = done.get_sequence_ids();
    let at = sequence.iter().position(Option::is_some).ok_or_else(|| {
        LoadError::Tokenizer("the post-processor drops the sequence it is given".into())
    })?;
    let ids = done.get_ids();
    Ok((ids[..at].to_vec(), ids[at + 1..].to_vec()))
}

#[cfg(test)]
mod tests;
