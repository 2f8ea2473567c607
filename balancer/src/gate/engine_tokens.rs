//! A request's prompt in the engine's own tokens, for matching it against
//! the blocks the engines hold ([`super::blocks`]): asked of an engine's
//! `POST /tokenize` (vLLM applies its chat template to `messages` there;
//! llm-sim answers the same way), with the request's `model` and
//! `messages` (or `prompt`) only, within [`ASK_TIMEOUT`], and remembered
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
/// prefix cache can hold of it).
const MAX_TOKENS: usize = 131_072;

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

/// What `/tokenize` is asked of a request body: its model and prompt only
/// (an engine may refuse fields it does not know there); and its
/// `cache_salt`. `None` for a body with neither `messages` nor `prompt`.
fn question(body: &[u8]) -> Option<(Value, Option<String>)> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let model = v.get("model").cloned().unwrap_or(Value::Null);
    let salt = v
        .get("cache_salt")
        .and_then(Value::as_str)
        .map(str::to_string);
    if let Some(messages) = v.get("messages").filter(|m| m.is_array()) {
        return Some((json!({"model": model, "messages": messages}), salt));
    }
    let prompt = v.get("prompt").filter(|p| p.is_string())?;
    Some((json!({"model": model, "prompt": prompt}), salt))
}

impl EngineTokens {
    /// The tokens of the prompt in `body`, as the engine at `addr` counts
    /// them, and the body's `cache_salt` (which the engine keys its first
    /// block with); `None` when it cannot tell in time.
    pub async fn of(&self, addr: SocketAddr, body: &[u8]) -> Option<(Arc<[u32]>, Option<String>)> {
        let (question, salt) = question(body)?;
        let tokens = self.tokens(addr, question).await?;
        Some((tokens, salt))
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
    fn only_the_model_and_the_prompt_are_asked_and_the_salt_kept() {
        let chat =
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.2}"#;
        let asked = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(question(chat), Some((asked, None)));
        let completion = br#"{"model":"m","prompt":"hi","max_tokens":3,"cache_salt":"s"}"#;
        let asked = json!({"model": "m", "prompt": "hi"});
        assert_eq!(question(completion), Some((asked, Some("s".into()))));
        assert_eq!(question(br#"{"model":"m","input":"hi"}"#), None);
        assert_eq!(question(b"not json"), None);
    }
}
