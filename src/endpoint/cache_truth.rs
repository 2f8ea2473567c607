//! Cache truth: what each endpoint's engine said it reused, against what
//! the balancer predicted, and the prefix index corrected by it.
//!
//! The engine's answer is the only witness of its cache (its usage's
//! `cached_tokens`, llama.cpp's `timings.cache_n`). Per endpoint the
//! ledger sums the prompt tokens and the cached ones (a hit ratio is
//! Σcached / Σprompt, as the engine saw it, not a mean of per-request
//! ratios), and counts the requests the balancer sent expecting a hit (the
//! endpoint's prefix index held some of the prompt's leading blocks) by
//! whether the engine had at least half of those blocks.
//!
//! A predicted hit the engine did not have means the engine keeps less than
//! the index assumed (it evicted that prompt, and with an LRU cache every
//! prompt used less recently): the endpoint's index shrinks by a quarter,
//! least recently used blocks first (see
//! [`crate::prefix::PrefixLru::shrink_tracked`]), not below one request's
//! blocks. An engine that answered [`COLD_MISSES`] predicted hits in a
//! row reusing nothing at all of them (and nothing of any other prompt
//! meanwhile) keeps no cache worth following (prefix caching off, or a
//! cache too small for one prompt): its index empties, so no prompt and
//! no conversation draws a request to it, nor makes one wait for it.
//! Every reused block the engine reports lets the index grow back by that
//! much toward `capacityBlocks` (a hit it predicted, or one it did not: an
//! emptied index predicts none). So the index follows the engine's real
//! cache size instead of a configured guess, and stops steering requests
//! toward prompts the engine does not have.

use serde::Serialize;

use super::{EndpointLedger, Lease};

/// Predicted hits in a row that the engine answered reusing nothing (and
/// no reuse between them), after which it counts as keeping no cache
/// (module docs). Not one: the slot that held a prompt may have been busy,
/// or the same prompt prefilled at once in another; a cold start with
/// conversations arriving together misses a few before the first prefill
/// ends. Few enough that a tenant's repeated prompt does not pile onto one
/// server for long.
pub const COLD_MISSES: u32 = 4;

/// What an engine's answer said of its prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheSeen {
    /// Prompt tokens, as the engine counted them.
    pub prompt_tokens: u64,
    /// Of them, found in its cache.
    pub cached_tokens: u64,
    /// The prompt text's length in bytes (to turn cached tokens into
    /// prompt blocks).
    pub prompt_bytes: u64,
}

/// One endpoint's cache, as its engine told it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CacheTruth {
    /// Prompt tokens of the answers that said what they reused.
    pub prompt_tokens: u64,
    /// Of them, found in the engine's cache.
    pub cached_tokens: u64,
    /// Requests sent expecting a hit that the engine confirmed.
    pub predicted_hits: u64,
    /// Requests sent expecting a hit that the engine did not have.
    pub predicted_misses: u64,
    /// Predicted hits answered in a row reusing nothing, no reuse between.
    pub cold_misses_in_a_row: u32,
}

impl CacheTruth {
    /// Σcached / Σprompt; `None` before any answer said.
    pub fn hit_ratio(&self) -> Option<f64> {
        (self.prompt_tokens > 0).then(|| self.cached_tokens as f64 / self.prompt_tokens as f64)
    }

    /// Whether the engine's latest answers say it keeps no cache: nothing
    /// is cached there to wait for.
    pub fn keeps_nothing(&self) -> bool {
        self.cold_misses_in_a_row >= COLD_MISSES
    }
}

impl EndpointLedger {
    /// Records what the answer to `lease`'s request said of the engine's
    /// cache, and corrects the endpoint's prefix index by it (see the
    /// module docs). Call before the lease is given back.
    pub(crate) fn observe_cache(&mut self, lease: &Lease, seen: CacheSeen) {
        let block_bytes = self.scheduling.prefix.block_bytes.max(1) as u64;
        let floor = self.scheduling.prefix.max_blocks;
        let Some(ep) = self.endpoints.get_mut(&lease.endpoint) else {
            return;
        };
        let cached = seen.cached_tokens.min(seen.prompt_tokens);
        let truth = &mut ep.cache;
        truth.prompt_tokens = truth.prompt_tokens.saturating_add(seen.prompt_tokens);
        truth.cached_tokens = truth.cached_tokens.saturating_add(cached);
        if seen.prompt_tokens == 0 {
            return;
        }
        let predicted = u64::from(lease.predicted_blocks);
        if cached > 0 {
            truth.cold_misses_in_a_row = 0;
        } else if predicted > 0 {
            truth.cold_misses_in_a_row = truth.cold_misses_in_a_row.saturating_add(1);
        }
        // The cached share of the prompt, in blocks of its text.
        let cached_bytes = (u128::from(seen.prompt_bytes) * u128::from(cached)
            / u128::from(seen.prompt_tokens)) as u64;
        let cached_blocks = cached_bytes / block_bytes;
        if predicted == 0 {
            // Reuse the index did not predict: it keeps less than the
            // engine does.
            ep.prefix.grow(cached_blocks as usize);
        } else if cached_blocks * 2 >= predicted {
            truth.predicted_hits += 1;
            ep.prefix.grow(predicted as usize);
        } else {
            truth.predicted_misses += 1;
            let (id, holders) = (ep.id, &mut self.holders);
            let changed = |h, holds| holders.change(h, id, holds);
            if truth.keeps_nothing() {
                ep.prefix.empty_tracked(changed);
            } else {
                ep.prefix.shrink_tracked(floor, changed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Route;
    use crate::prefix::PrefixConfig;
    use crate::protocol::tests::report;
    use crate::{SaturationConfig, SchedulingConfig};
    use std::time::Instant;

    fn take(ledger: &mut EndpointLedger, prefix: &[u64], now: Instant) -> Lease {
        let route = Route {
            prefix: prefix.to_vec(),
            ..Route::default()
        };
        ledger.acquire(&route, now).expect("a lease")
    }

    /// A ledger of one 4-slot endpoint whose prefix index holds 100
    /// four-byte blocks, at most 4 of a request's.
    fn one_endpoint(now: Instant) -> EndpointLedger {
        let scheduling = SchedulingConfig {
            prefix: PrefixConfig {
                block_bytes: 4,
                max_blocks: 4,
                capacity_blocks: 100,
            },
            ..SchedulingConfig::default()
        };
        let mut ledger = EndpointLedger::new(SaturationConfig::default(), scheduling);
        let addr = "127.0.0.1:1".parse().unwrap();
        ledger.apply_report(report("a", "127.0.0.1:1", 4), addr, now);
        ledger
    }

    /// Four-byte blocks; `blocks` of them, each worth one token.
    fn seen(blocks: u64, cached_blocks: u64) -> CacheSeen {
        CacheSeen {
            prompt_tokens: blocks,
            cached_tokens: cached_blocks,
            prompt_bytes: blocks * 4,
        }
    }

    #[test]
    fn the_engines_word_counts_and_a_missed_prediction_shrinks_the_index() {
        let now = Instant::now();
        let mut ledger = one_endpoint(now);
        let prompt: Vec<u64> = (1..=40).collect();

        // First time: nothing expected, only the tokens count.
        let first = take(&mut ledger, &prompt, now);
        assert_eq!(first.predicted_blocks, 0);
        ledger.observe_cache(&first, seen(40, 0));
        ledger.release(first, now);
        // Again: the whole prompt expected, and the engine had it.
        let second = take(&mut ledger, &prompt, now);
        assert_eq!(second.predicted_blocks, 40);
        ledger.observe_cache(&second, seen(40, 38));
        ledger.release(second, now);
        // The engine lost it: a miss, and the index shrinks.
        let third = take(&mut ledger, &prompt, now);
        ledger.observe_cache(&third, seen(40, 4));
        ledger.release(third, now);
        let snap = &ledger.snapshot(now)[0];
        assert_eq!(
            snap.cache,
            CacheTruth {
                prompt_tokens: 120,
                cached_tokens: 42,
                predicted_hits: 1,
                predicted_misses: 1,
                cold_misses_in_a_row: 0,
            }
        );
        assert_eq!(
            snap.cache.hit_ratio(),
            Some(42.0 / 120.0),
            "Σcached / Σprompt"
        );
        assert_eq!((snap.prefix_blocks, snap.prefix_capacity), (30, 30));
        // Misses keep shrinking it, never below one request's blocks
        // while the engine reuses something...
        for _ in 0..20 {
            let l = take(&mut ledger, &prompt, now);
            ledger.observe_cache(&l, seen(40, 1));
            ledger.release(l, now);
        }
        assert_eq!(ledger.snapshot(now)[0].prefix_capacity, 4);
        // ...and confirmed hits let it grow back to the configured size.
        for _ in 0..40 {
            let l = take(&mut ledger, &prompt[..4], now);
            ledger.observe_cache(&l, seen(4, 4));
            ledger.release(l, now);
        }
        assert_eq!(ledger.snapshot(now)[0].prefix_capacity, 100);
        // A cached count beyond the prompt is not believed.
        let l = take(&mut ledger, &prompt, now);
        ledger.observe_cache(&l, seen(40, 1_000));
        ledger.release(l, now);
        let c = ledger.snapshot(now)[0].cache;
        assert!(c.cached_tokens <= c.prompt_tokens);
    }

    #[test]
    fn an_engine_that_reuses_nothing_draws_no_request_until_it_reuses_again() {
        let now = Instant::now();
        let mut ledger = one_endpoint(now);
        // One tenant's prompt, the same every time, on an engine without a
        // prefix cache: every answer says it reused nothing.
        let prompt = [1, 2, 3, 4];
        let mut predicted = Vec::new();
        for _ in 0..=COLD_MISSES {
            let l = take(&mut ledger, &prompt, now);
            predicted.push(l.predicted_blocks);
            ledger.observe_cache(&l, seen(4, 0));
            ledger.release(l, now);
        }
        assert_eq!(predicted, [0, 4, 4, 4, 4], "the index expected the prompt");
        let snap = &ledger.snapshot(now)[0];
        assert!(snap.cache.keeps_nothing());
        assert_eq!((snap.prefix_blocks, snap.prefix_capacity), (0, 0));
        // It draws the prompt no more, however often it is sent there.
        for _ in 0..3 {
            let l = take(&mut ledger, &prompt, now);
            assert_eq!(l.predicted_blocks, 0);
            ledger.observe_cache(&l, seen(4, 0));
            ledger.release(l, now);
        }
        // The engine reuses the whole prompt (its cache was turned on):
        // the index grows back by what it reused, and follows it again.
        let l = take(&mut ledger, &prompt, now);
        ledger.observe_cache(&l, seen(4, 4));
        ledger.release(l, now);
        assert!(!ledger.snapshot(now)[0].cache.keeps_nothing());
        let l = take(&mut ledger, &prompt, now);
        assert_eq!(l.predicted_blocks, 0, "not recorded while it kept nothing");
        ledger.release(l, now);
        let l = take(&mut ledger, &prompt, now);
        assert_eq!(l.predicted_blocks, 4);
        ledger.release(l, now);
    }
}
