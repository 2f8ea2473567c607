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

use flowgate_tokenizer::{ModelTokenizer, Request, Tokens};

/// Bytes of a prompt not yet remembered that are encoded on the event
/// loop (about 500 tokens: well under a millisecond); a request with more
/// is encoded on tokio's blocking threads, so one long new prompt never
/// stalls the requests beside it.
const INLINE_BYTES: usize = 2_048;

/// The operator's tokenizers, by the served model's name.
pub struct Tokenizers {
    by_model: HashMap<String, Arc<ModelTokenizer>>,
    /// Encodes running off the event loop. Bounded so that many new long
    /// prompts at once cannot take every core: past it a prompt is asked
    /// of the engine's `/tokenize` instead (reason `busy`).
    off_loop: Arc<tokio::sync::Semaphore>,
}

impl Default for Tokenizers {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Tokenizers {
            by_model: HashMap::new(),
            off_loop: Arc::new(tokio::sync::Semaphore::new((cores / 2).max(1))),
        }
    }
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
        Ok(Tokenizers {
            by_model,
            ..Tokenizers::default()
        })
    }

    /// The tokens of the prompt in the request `body`, and its
    /// `cache_salt`; or why the balancer cannot count them (a label of
    /// `flowgate_prompt_tokenizations_total`). At most
    /// [`flowgate_tokenizer::MAX_IDS`], as of an engine's answer.
    pub async fn tokens(
        &self,
        model: &str,
        body: &[u8],
    ) -> Result<(Vec<u32>, Option<String>), &'static str> {
        let tokenizer = self.by_model.get(model).ok_or("no_tokenizer")?;
        let request = Request::parse(body).map_err(|_| "body")?;
        let salt = request.cache_salt().map(str::to_string);
        self.ids(tokenizer, &request).await.map(|ids| (ids, salt))
    }

    async fn ids(
        &self,
        tokenizer: &Arc<ModelTokenizer>,
        request: &Request<'_>,
    ) -> Result<Vec<u32>, &'static str> {
        match tokenizer.tokens(request, INLINE_BYTES) {
            Ok(Tokens::Ids(ids)) => Ok(ids),
            Ok(Tokens::TooMuchToEncode(prompt)) => {
                let Ok(turn) = Arc::clone(&self.off_loop).try_acquire_owned() else {
                    return Err("busy");
                };
                // Rendered here once; only the encoding moves off the loop.
                let tokenizer = Arc::clone(tokenizer);
                let all = tokio::task::spawn_blocking(move || {
                    let _turn = turn;
                    tokenizer.encode_all(&prompt)
                });
                match all.await {
                    Ok(Ok(ids)) => Ok(ids),
                    Ok(Err(why)) => Err(why.kind()),
                    Err(_) => Err("encode"),
                }
            }
            Err(why) => Err(why.kind()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn chatml() -> Tokenizers {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tokenizer/golden/chatml");
        Tokenizers::load(&BTreeMap::from([("m".to_string(), dir)])).unwrap()
    }

    #[tokio::test]
    async fn long_new_prompts_go_off_the_loop_while_a_turn_is_free_else_to_the_engine() {
        let mut t = chatml();
        let json = |v: Value| serde_json::to_vec(&v).unwrap();
        let long =
            json(json!({"messages": [{"role": "user", "content": "the farm ".repeat(1_000)}]}));
        let short = json(json!({"messages": [{"role": "user", "content": "hi"}]}));
        assert_eq!(t.tokens("other", &short).await, Err("no_tokenizer"));
        t.off_loop = Arc::new(tokio::sync::Semaphore::new(0));
        // Short enough for the event loop: no turn needed.
        assert!(t.tokens("m", &short).await.is_ok());
        assert_eq!(t.tokens("m", &long).await, Err("busy"));
        t.off_loop.add_permits(1);
        let (ids, _) = t.tokens("m", &long).await.unwrap();
        assert!(ids.len() > 1_000);
        // The turn is given back.
        assert_eq!(t.off_loop.available_permits(), 1);
        let tools = json(json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}));
        assert_eq!(t.tokens("m", &tools).await, Err("field"));
        // The salt comes with the ids; a body that is no request is refused.
        let salted = json(json!({"prompt": "hi", "cache_salt": "s"}));
        assert_eq!(
            t.tokens("m", &salted).await.unwrap().1.as_deref(),
            Some("s")
        );
        assert_eq!(t.tokens("m", b"[1]").await, Err("body"));
    }
}
