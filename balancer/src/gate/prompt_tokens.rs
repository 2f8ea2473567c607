//! A request's prompt in the engine's tokens, counted by the balancer itself
//! for the models the operator gave a tokenizer (`models.tokenizers` in the
//! config, `--tokenizer MODEL=DIR`: [`flowgate_tokenizer`]), so that
//! matching it against the engines' blocks costs no round trip. A request
//! the tokenizer leaves to the engine (a chat with tools, a template that
//! fails, …) and a model without one are asked of an engine's `/tokenize`
//! instead ([`super::engine_tokens`]).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use flowgate_tokenizer::{ModelTokenizer, Tokens};
use serde_json::Value;

use super::engine_tokens::MAX_TOKENS;

/// Bytes of a prompt not yet remembered that are encoded on the event
/// loop (about 500 tokens: well under a millisecond); a request with more
/// is encoded on tokio's blocking threads, so one long new prompt never
/// stalls the requests beside it.
const INLINE_BYTES: usize = 2_048;

/// The operator's tokenizers, by the served model's name.
#[derive(Default)]
pub struct Tokenizers {
    by_model: HashMap<String, Arc<ModelTokenizer>>,
}

impl Tokenizers {
    /// Reads each model's directory; an unreadable one is an error naming
    /// the model. A chat template this balancer cannot read is not: that
    /// model's chats go to the engine's `/tokenize` (logged once here).
    pub fn load(dirs: &BTreeMap<String, PathBuf>) -> Result<Self, String> {
        let mut by_model = HashMap::new();
        for (model, dir) in dirs {
            let tokenizer = ModelTokenizer::from_dir(dir)
                .map_err(|e| format!("the tokenizer of model {model:?}: {e}"))?;
            if let Some(problem) = tokenizer.template_problem() {
                tracing::warn!(
                    model = %model,
                    dir = %dir.display(),
                    "chat template not used ({problem}): this model's chats are tokenized by the engine's /tokenize"
                );
            }
            by_model.insert(model.clone(), Arc::new(tokenizer));
        }
        Ok(Tokenizers { by_model })
    }

    /// The tokens of the prompt in `body`, or why the balancer cannot
    /// count them (a label of `flowgate_prompt_tokenizations_total`).
    /// Only the first [`MAX_TOKENS`] are kept, as of an engine's answer.
    pub async fn tokens(&self, model: &str, body: &Value) -> Result<Vec<u32>, &'static str> {
        let mut ids = self.all_tokens(model, body).await?;
        ids.truncate(MAX_TOKENS);
        Ok(ids)
    }

    async fn all_tokens(&self, model: &str, body: &Value) -> Result<Vec<u32>, &'static str> {
        let tokenizer = self.by_model.get(model).ok_or("no_tokenizer")?;
        match tokenizer.tokens(body, INLINE_BYTES) {
            Ok(Tokens::Ids(ids)) => Ok(ids),
            Ok(Tokens::TooMuchToEncode) => {
                let (tokenizer, body) = (Arc::clone(tokenizer), body.clone());
                let all = tokio::task::spawn_blocking(move || tokenizer.tokens(&body, usize::MAX));
                match all.await {
                    Ok(Ok(Tokens::Ids(ids))) => Ok(ids),
                    Ok(Ok(Tokens::TooMuchToEncode)) | Err(_) => Err("encode"),
                    Ok(Err(why)) => Err(why.kind()),
                }
            }
            Err(why) => Err(why.kind()),
        }
    }
}
