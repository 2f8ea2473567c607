//! A request's prompt in the engine's own tokens, for matching it against
//! the blocks the engines hold ([`super::blocks`]): asked of an engine's
//! `POST /tokenize` (vLLM applies its chat template to `messages` there;
//! llm-sim answers the same way), with the request's `model`, `messages`
//! (or `prompt`) and what vLLM renders a chat with ([`RENDERED_WITH`])
//! only, within [`ASK_TIMEOUT`], and remembered
//! by the prompt's hash so a prompt sent again is not asked twice. Any
//! failure (no answer in time, an error, an answer that is no token list)
//! leaves the request to placement's own guess.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use flowgate::kv_events::key::fold_bytes;
use serde_json::{json, Value};

/// The longest a request waits for its tokens.
pub const ASK_TIMEOUT: Duration = Duration::from_millis(250);
/// Prompts remembered, the oldest forgotten first.
const REMEMBERED: usize = 1_024;
/// Longest prompt asked for, in tokens kept (its first ones: what a
/// prefix cache can hold of it), as the balancer's own tokenizer keeps.
const MAX_TOKENS: usize = flowgate_tokenizer::MAX_IDS;

/// Asks engines for prompts' tokens (module docs).
pub struct EngineTokens {
    client: reqwest::Client,
    remembered: Mutex<Remembered>,
}

#[derive(Default)]
struct Remembered {
    tokens: HashMap<u64, Arc<[u32]>>,
    order: VecDeque<u64>,
}

impl Default for EngineTokens {
    fn default() -> Self {
        EngineTokens {
            client: reqwest::Client::builder()
                .timeout(ASK_TIMEOUT)
                .build()
                .expect("an HTTP client"),
            remembered: Mutex::default(),
        }
    }
}

/// The fields of a chat request that vLLM's `/tokenize` takes too and
/// renders the chat with.
const RENDERED_WITH: [&str; 6] = [
    "tools",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
];

/// What `/tokenize` is asked of a request body: its model and prompt and
/// what the chat is rendered with, nothing else (an engine may refuse
/// fields it does not know there). `None` for a body with neither
/// `messages` nor `prompt`.
fn question(v: &Value) -> Option<Value> {
    let model = v.get("model").cloned().unwrap_or(Value::Null);
    if let Some(messages) = v.get("messages").filter(|m| m.is_array()) {
        let mut asked = json!({"model": model, "messages": messages});
        for field in RENDERED_WITH {
            if let Some(x) = v.get(field).filter(|x| !x.is_null()) {
                asked[field] = x.clone();
            }
        }
        return Some(asked);
    }
    let prompt = v.get("prompt").filter(|p| p.is_string())?;
    Some(json!({"model": model, "prompt": prompt}))
}

impl EngineTokens {
    /// The tokens of the prompt in the request `body`, as the engine at
    /// `addr` counts them; `None` when it cannot tell in time.
    pub async fn of(&self, addr: SocketAddr, body: &Value) -> Option<Arc<[u32]>> {
        self.tokens(addr, question(body)?).await
    }

    async fn tokens(&self, addr: SocketAddr, question: Value) -> Option<Arc<[u32]>> {
        let asked = serde_json::to_vec(&question).ok()?;
        let key = fold_bytes(&asked);
        if let Some(t) = self.remembered().tokens.get(&key) {
            return Some(Arc::clone(t));
        }
        let answer = self
            .client
            .post(format!("http://{addr}/tokenize"))
            .header("content-type", "application/json")
            .body(asked)
            .send()
            .await
            .ok()?;
        if !answer.status().is_success() {
            return None;
        }
        let v: Value = answer.json().await.ok()?;
        let tokens: Arc<[u32]> = v
            .get("tokens")?
            .as_array()?
            .iter()
            .take(MAX_TOKENS)
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()?
            .into();
        let mut remembered = self.remembered();
        if remembered.tokens.insert(key, Arc::clone(&tokens)).is_none() {
            remembered.order.push_back(key);
            if remembered.order.len() > REMEMBERED {
                if let Some(old) = remembered.order.pop_front() {
                    remembered.tokens.remove(&old);
                }
            }
        }
        Some(tokens)
    }

    fn remembered(&self) -> std::sync::MutexGuard<'_, Remembered> {
        self.remembered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_model_the_prompt_and_what_renders_it_are_asked() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let chat = json!({"model": "m", "messages": user, "temperature": 0.2, "tools": null});
        assert_eq!(
            question(&chat),
            Some(json!({"model": "m", "messages": user}))
        );
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let with = json!({"model": "m", "messages": user, "tools": tools, "stream": true,
            "chat_template_kwargs": {"enable_thinking": false}});
        assert_eq!(
            question(&with),
            Some(json!({"model": "m", "messages": user, "tools": tools,
                "chat_template_kwargs": {"enable_thinking": false}}))
        );
        let completion = json!({"model": "m", "prompt": "hi", "max_tokens": 3, "cache_salt": "s"});
        assert_eq!(
            question(&completion),
            Some(json!({"model": "m", "prompt": "hi"}))
        );
        assert_eq!(question(&json!({"model": "m", "input": "hi"})), None);
    }
}
