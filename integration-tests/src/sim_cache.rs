//! llm-sim's prefix cache arithmetic, shared by llm-sim (which counts what
//! it reused) and loadgen (which counts what the best possible placement
//! could have reused: the workload's ceiling).

use std::collections::HashSet;

use flowgate::prefix::{block_hashes, PrefixConfig};
use serde::Deserialize;

/// Bytes per simulated token.
pub const BYTES_PER_TOKEN: u64 = 4;
/// Prefix cache block: 64 bytes = 16 tokens.
pub const BLOCK_BYTES: usize = 64;

/// The chained hashes of every whole block of `prompt`: what the cache
/// keeps of it.
pub fn blocks(prompt: &[u8]) -> Vec<u64> {
    let config = PrefixConfig {
        block_bytes: BLOCK_BYTES,
        max_blocks: usize::MAX,
        capacity_blocks: usize::MAX,
    };
    block_hashes(prompt, &config)
}

/// The prompt text of a request body as the balancer reads it (its
/// blocks are the cache's keys): `messages`, `prompt` or `input`.
pub fn prompt_text(body: &serde_json::Value) -> Vec<u8> {
    let field = |name| flowgate::openai::PromptJson::deserialize(body.get(name)?).ok();
    let (messages, prompt, input) = (field("messages"), field("prompt"), field("input"));
    let fields = flowgate::openai::PromptFields {
        messages: messages.as_ref(),
        prompt: prompt.as_ref(),
        input: input.as_ref(),
        ..Default::default()
    };
    flowgate::openai::prompt_text(&fields, usize::MAX)
}

/// Prompt tokens a prompt of `bytes` counts for.
pub fn tokens(bytes: usize) -> u64 {
    (bytes as u64 / BYTES_PER_TOKEN).max(1)
}

/// Tokens that `matched` leading blocks hold.
pub fn cached_tokens(matched: usize) -> u64 {
    (matched * BLOCK_BYTES) as u64 / BYTES_PER_TOKEN
}

/// The hit ratio no placement can beat on a workload: every prompt looked
/// up in one cache that holds every block ever sent (a fleet's caches each
/// hold a part of those, so none matches more of a prompt). What a router
/// measures against this is what its placement and the caches' sizes
/// cost; the rest is what the workload itself sends anew each turn.
#[derive(Debug, Default)]
pub struct Ceiling {
    seen: HashSet<u64>,
    prompt_tokens: u64,
    cached_tokens: u64,
}

impl Ceiling {
    /// A prompt sent: counted, then remembered.
    pub fn add(&mut self, prompt: &[u8]) {
        let blocks = blocks(prompt);
        // Chained hashes: a block is held only if every one before it is.
        let matched = blocks.iter().take_while(|b| self.seen.contains(b)).count();
        self.seen.extend(blocks);
        self.prompt_tokens += tokens(prompt.len());
        self.cached_tokens += cached_tokens(matched);
    }

    /// Σ cached / Σ prompt tokens so far (0 before any prompt).
    pub fn hit_ratio(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_counts_what_any_earlier_prompt_began_with() {
        let mut c = Ceiling::default();
        let first = vec![b'a'; BLOCK_BYTES * 4];
        c.add(&first);
        assert_eq!(c.hit_ratio(), 0.0);
        // The same four blocks and four new ones: half of it was seen.
        let mut longer = first.clone();
        longer.extend(vec![b'b'; BLOCK_BYTES * 4]);
        c.add(&longer);
        let (prompt, cached) = (tokens(first.len() + longer.len()), cached_tokens(4));
        assert_eq!(c.hit_ratio(), cached as f64 / prompt as f64);
        // A prompt that differs in its first block matches nothing.
        let mut other = longer.clone();
        other[0] = b'z';
        c.add(&other);
        assert_eq!(c.cached_tokens, cached_tokens(4));
    }

    #[test]
    fn a_body_reads_as_the_balancer_reads_it() {
        let body = serde_json::json!({"messages": [{"role": "user", "content": "Hi"}]});
        assert_eq!(prompt_text(&body), b"user\x1fHi\x1e");
    }
}
