//! What a request will cost in tokens, estimated at admission and learned
//! from what the engines report.
//!
//! An LLM request's cost is its tokens, not its count: a 100k-token prompt
//! or an unbounded `max_tokens` holds far more KV cache and GPU time than a
//! short chat. Every request gets a [`TokenEstimate`] when it is admitted:
//!
//! - **prompt tokens**: the prompt text's length in bytes
//!   ([`crate::openai::prompt_bytes`]) divided by the model's bytes per
//!   token. That ratio starts at [`DEFAULT_BYTES_PER_TOKEN`] and is learned
//!   per model from the `usage.prompt_tokens` the engines return
//!   ([`TokenRatios::learn`]: decayed sums of bytes and tokens, so long
//!   prompts weigh more than short chats whose template tokens blur the
//!   ratio), kept within [`MIN_BYTES_PER_TOKEN`] ..= [`MAX_BYTES_PER_TOKEN`]
//!   so one odd answer (an image, a tool list the prompt text leaves out)
//!   cannot swing it far;
//! - **output tokens**: the request's own bound (`max_tokens`,
//!   `max_completion_tokens`, `max_output_tokens`, [`output_bound`]), else
//!   the operator's default (`--default-output-tokens`, in
//!   [`crate::admission::AdmissionRules`]).
//!
//! The access log shows the estimate beside the answer's actual usage.

// Keyed by the fleet's model names: a fast hasher.
use foldhash::HashMap;
use std::sync::Arc;

/// Bytes of prompt text per token before a model's answers taught better:
/// about four for English text with the common BPE vocabularies.
pub const DEFAULT_BYTES_PER_TOKEN: f64 = 4.0;
/// The learned ratio stays within these (no tokenizer packs more than 16
/// bytes into a token on average, none fewer than 1 for text).
pub const MIN_BYTES_PER_TOKEN: f64 = 1.0;
pub const MAX_BYTES_PER_TOKEN: f64 = 16.0;
/// Output tokens assumed for a request that names no bound.
pub const DEFAULT_OUTPUT_TOKENS: u64 = 1024;
/// Largest output bound taken from a request (larger asks are cut to it).
pub const MAX_OUTPUT_TOKENS: u64 = 10_000_000;
/// Models whose ratio is learned; names beyond share the default (an
/// agent or client cannot grow this without bound).
pub const MAX_LEARNED_MODELS: usize = 1024;
/// How much of the learned sums each new answer forgets: the last few
/// hundred answers count.
const DECAY: f64 = 0.01;

/// A request's cost in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct TokenEstimate {
    pub prompt: u64,
    pub output: u64,
    /// `output` is the request's own bound, not the operator's default:
    /// the request cannot be served in fewer tokens than
    /// [`TokenEstimate::least`].
    pub output_asked: bool,
}

impl TokenEstimate {
    /// Prompt and output together: what the request may hold of a
    /// server's KV cache at its end.
    pub fn total(&self) -> u64 {
        self.prompt.saturating_add(self.output)
    }

    /// The fewest tokens the request needs to be served as asked: its
    /// prompt, plus its output bound when it named one (an engine refuses
    /// a prompt plus `max_tokens` beyond its context; a default output is
    /// only a guess).
    pub fn least(&self) -> u64 {
        if self.output_asked {
            self.total()
        } else {
            self.prompt
        }
    }

    /// The estimate counted as if the answer had used it: what a served
    /// request counts for when its answer does not say.
    pub fn as_used(&self) -> TokenUsage {
        TokenUsage {
            prompt: self.prompt,
            completion: self.output,
            cached: 0,
            cache_said: false,
        }
    }
}

/// Tokens an answer actually used, as its `usage` reports them (or, for an
/// answer cut short, what was sent).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenUsage {
    pub prompt: u64,
    pub completion: u64,
    /// Of `prompt`: tokens the engine found in its prefix cache.
    pub cached: u64,
    /// The engine said how many it found (`cached` is its word, not a
    /// default): only then does it count as cache truth.
    pub cache_said: bool,
}

impl TokenUsage {
    pub fn total(&self) -> u64 {
        self.prompt.saturating_add(self.completion)
    }
}

/// `prompt_bytes` of prompt text at `bytes_per_token`, rounded up: at
/// least one token for any prompt at all.
pub fn prompt_tokens(prompt_bytes: u64, bytes_per_token: f64) -> u64 {
    let per_token = bytes_per_token.clamp(MIN_BYTES_PER_TOKEN, MAX_BYTES_PER_TOKEN);
    // Never more tokens than bytes (f64 rounds huge byte counts up).
    ((prompt_bytes as f64 / per_token).ceil() as u64)
        .clamp(u64::from(prompt_bytes > 0), prompt_bytes)
}

/// The output bound a request body asks for: the first of `max_tokens`,
/// `max_completion_tokens` and `max_output_tokens` that is a non-negative
/// integer, cut to [`MAX_OUTPUT_TOKENS`]; anything else (absent, negative,
/// fractional, a string) is no bound.
pub fn output_bound(values: [Option<&serde_json::Value>; 3]) -> Option<u64> {
    values
        .into_iter()
        .flatten()
        .find_map(serde_json::Value::as_u64)
        .map(|n| n.min(MAX_OUTPUT_TOKENS))
}

/// Exponentially decayed sums of the prompt bytes and prompt tokens of a
/// model's answers: their ratio weighs each answer by its size, so a long
/// prompt (where the ratio matters) counts for more than a short chat
/// (where the chat template's own tokens blur it).
#[derive(Debug, Clone, Copy)]
struct Learned {
    bytes: f64,
    tokens: f64,
}

impl Learned {
    fn ratio(&self) -> f64 {
        (self.bytes / self.tokens).clamp(MIN_BYTES_PER_TOKEN, MAX_BYTES_PER_TOKEN)
    }
}

/// Bytes of prompt text per token, learned per model.
#[derive(Debug, Clone, Default)]
pub struct TokenRatios {
    by_model: HashMap<Arc<str>, Learned>,
}

impl TokenRatios {
    /// The model's bytes per token now.
    pub fn bytes_per_token(&self, model: Option<&str>) -> f64 {
        model
            .and_then(|m| self.by_model.get(m))
            .map_or(DEFAULT_BYTES_PER_TOKEN, Learned::ratio)
    }

    /// The prompt tokens of `prompt_bytes` of prompt text for `model`.
    pub fn prompt_tokens(&self, model: Option<&str>, prompt_bytes: u64) -> u64 {
        prompt_tokens(prompt_bytes, self.bytes_per_token(model))
    }

    /// Learns from an answer: `prompt_bytes` of prompt text were
    /// `prompt_tokens` tokens for `model`. Answers that say nothing (no
    /// text, no tokens) teach nothing; one answer's tokens count within
    /// the ratio's bounds, so no single odd answer swings it far.
    pub fn learn(&mut self, model: &str, prompt_bytes: u64, prompt_tokens: u64) {
        if prompt_bytes == 0 || prompt_tokens == 0 {
            return;
        }
        let bytes = prompt_bytes as f64;
        let tokens =
            (prompt_tokens as f64).clamp(bytes / MAX_BYTES_PER_TOKEN, bytes / MIN_BYTES_PER_TOKEN);
        if let Some(l) = self.by_model.get_mut(model) {
            l.bytes = l.bytes * (1.0 - DECAY) + bytes;
            l.tokens = l.tokens * (1.0 - DECAY) + tokens;
            return;
        }
        if self.by_model.len() < MAX_LEARNED_MODELS {
            self.by_model
                .insert(Arc::from(model), Learned { bytes, tokens });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn prompt_tokens_start_from_the_default_ratio() {
        let r = TokenRatios::default();
        assert_eq!(r.prompt_tokens(Some("m"), 4000), 1000);
        assert_eq!(r.prompt_tokens(None, 1), 1, "any prompt is a token");
        assert_eq!(r.prompt_tokens(None, 0), 0);
        assert_eq!(
            prompt_tokens(10, 0.0),
            10,
            "a ratio out of bounds is clamped"
        );
    }

    #[test]
    fn the_ratio_is_learned_per_model_and_bounded() {
        let mut r = TokenRatios::default();
        // A model whose tokenizer packs 3 bytes per token.
        for _ in 0..50 {
            r.learn("m", 3000, 1000);
        }
        assert!((r.bytes_per_token(Some("m")) - 3.0).abs() < 1e-9);
        assert_eq!(r.prompt_tokens(Some("m"), 3000), 1000);
        // Other models keep the default.
        assert_eq!(r.bytes_per_token(Some("other")), DEFAULT_BYTES_PER_TOKEN);
        // One absurd answer barely moves it: its tokens count within the
        // bounds, and a tiny prompt weighs little.
        r.learn("m", 1, 1_000_000);
        let after = r.bytes_per_token(Some("m"));
        assert!((2.99..3.0).contains(&after), "{after}");
        // Short chats whose template adds tokens weigh less than long
        // prompts: 100 chats of 20 bytes / 30 tokens beside 100 prompts of
        // 30,000 bytes / 10,000 tokens still learn about 3.
        let mut mixed = TokenRatios::default();
        for _ in 0..100 {
            mixed.learn("m", 20, 30);
            mixed.learn("m", 30_000, 10_000);
        }
        let ratio = mixed.bytes_per_token(Some("m"));
        assert!((2.9..3.0).contains(&ratio), "{ratio}");
        // Answers that say nothing teach nothing.
        r.learn("m", 0, 10);
        r.learn("m", 10, 0);
        assert_eq!(r.bytes_per_token(Some("m")), after);
    }

    #[test]
    fn learned_models_are_bounded() {
        let mut r = TokenRatios::default();
        for i in 0..MAX_LEARNED_MODELS + 10 {
            r.learn(&format!("m{i}"), 200, 100);
        }
        assert_eq!(r.by_model.len(), MAX_LEARNED_MODELS);
        assert_eq!(
            r.bytes_per_token(Some(&format!("m{}", MAX_LEARNED_MODELS + 5))),
            DEFAULT_BYTES_PER_TOKEN
        );
    }

    #[test]
    fn output_bounds_come_from_the_first_sane_field() {
        let (a, b, c) = (json!(64), json!(-5), json!(1e30));
        assert_eq!(output_bound([Some(&a), None, None]), Some(64));
        assert_eq!(
            output_bound([Some(&b), Some(&a), None]),
            Some(64),
            "negative: skipped"
        );
        assert_eq!(output_bound([Some(&c), None, None]), None, "not an integer");
        let huge = json!(u64::MAX);
        assert_eq!(
            output_bound([None, None, Some(&huge)]),
            Some(MAX_OUTPUT_TOKENS)
        );
        assert_eq!(output_bound([None, None, None]), None);
    }

    proptest! {
        /// Whatever answers arrive, the ratio stays within its bounds and
        /// an estimate never overflows.
        #[test]
        fn ratios_stay_bounded(answers in proptest::collection::vec((any::<u64>(), any::<u64>()), 0..50),
                               bytes in any::<u64>()) {
            let mut r = TokenRatios::default();
            for (b, t) in answers {
                r.learn("m", b, t);
            }
            let ratio = r.bytes_per_token(Some("m"));
            prop_assert!((MIN_BYTES_PER_TOKEN..=MAX_BYTES_PER_TOKEN).contains(&ratio));
            prop_assert!(r.prompt_tokens(Some("m"), bytes) <= bytes);
        }
    }
}
