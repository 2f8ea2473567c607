//! Who spent what: tokens and requests per tenant and API key over the
//! last hour, in one-minute buckets.
//!
//! The balancer records every answered inference request here (its
//! tenant, the key that sent it, the tokens its answer used) and
//! `GET /api/v1/usage` reads a window of it. Pure: every call takes `now`.
//!
//! Bounded whatever clients send: a bucket keeps at most
//! [`MAX_ENTRIES_PER_BUCKET`] distinct (tenant, key) pairs; further pairs
//! are counted under the tenant [`OTHER`], so totals stay true while the
//! memory does not grow with the number of distinct fairness ids.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::tokens::TokenUsage;

/// Length of one bucket.
pub const BUCKET: Duration = Duration::from_secs(60);
/// Buckets kept: the longest window that can be asked for is this many
/// minutes.
pub const BUCKETS: usize = 60;
/// Distinct (tenant, key) pairs one bucket keeps before counting the rest
/// as [`OTHER`].
pub const MAX_ENTRIES_PER_BUCKET: usize = 4096;
/// The tenant that stands for all pairs beyond the bound.
pub const OTHER: &str = "(other)";

/// The window a query for `window` covers: whole buckets, at least one,
/// at most all of them.
pub fn covered(window: Duration) -> Duration {
    let minutes = window
        .as_secs()
        .saturating_add(u64::from(window.subsec_nanos() > 0))
        .div_ceil(BUCKET.as_secs())
        .clamp(1, BUCKETS as u64);
    BUCKET * minutes as u32
}

/// What one tenant or key spent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Spent {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Of `prompt_tokens`: found in the engine's prefix cache.
    pub cached_tokens: u64,
}

impl Spent {
    fn add(&mut self, other: &Spent) {
        self.requests = self.requests.saturating_add(other.requests);
        self.prompt_tokens = self.prompt_tokens.saturating_add(other.prompt_tokens);
        self.completion_tokens = self
            .completion_tokens
            .saturating_add(other.completion_tokens);
        self.cached_tokens = self.cached_tokens.saturating_add(other.cached_tokens);
    }

    pub fn total_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// One tenant's spending over a window, and its keys'.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TenantUsage {
    pub tenant: String,
    #[serde(flatten)]
    pub spent: Spent,
    /// Per API key id (requests sent without a key are not listed here).
    pub keys: BTreeMap<String, Spent>,
}

type Entry = (Arc<str>, Option<Arc<str>>);

#[derive(Debug)]
struct Bucket {
    /// Minutes since the ledger's origin.
    minute: u64,
    spent: HashMap<Entry, Spent>,
}

/// Tokens and requests per tenant and key, by minute.
#[derive(Debug)]
pub struct UsageLedger {
    origin: Instant,
    buckets: VecDeque<Bucket>,
}

impl UsageLedger {
    pub fn new(now: Instant) -> Self {
        UsageLedger {
            origin: now,
            buckets: VecDeque::new(),
        }
    }

    fn minute(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.origin).as_secs() / BUCKET.as_secs()
    }

    /// Records one answered request of `tenant` sent with `key` (an API
    /// key's id, `None` without one) that used `tokens`.
    pub fn record(
        &mut self,
        tenant: &Arc<str>,
        key: Option<&Arc<str>>,
        tokens: TokenUsage,
        now: Instant,
    ) {
        let minute = self.minute(now);
        if self.buckets.back().is_none_or(|b| b.minute != minute) {
            self.buckets.push_back(Bucket {
                minute,
                spent: HashMap::new(),
            });
        }
        while self
            .buckets
            .front()
            .is_some_and(|b| b.minute + BUCKETS as u64 <= minute)
        {
            self.buckets.pop_front();
        }
        let bucket = self.buckets.back_mut().expect("pushed above");
        let spent = Spent {
            requests: 1,
            prompt_tokens: tokens.prompt,
            completion_tokens: tokens.completion,
            cached_tokens: tokens.cached.min(tokens.prompt),
        };
        let entry: Entry = (Arc::clone(tenant), key.cloned());
        // A pair seen this minute (most answers) is found with one hash.
        if let Some(pair) = bucket.spent.get_mut(&entry) {
            pair.add(&spent);
            return;
        }
        let entry = if bucket.spent.len() < MAX_ENTRIES_PER_BUCKET - 1 {
            entry
        } else {
            (Arc::from(OTHER), None)
        };
        bucket.spent.entry(entry).or_default().add(&spent);
    }

    /// Spending per tenant over the last `window` ([`covered`]: whole
    /// minutes, at most the hour kept), the biggest spenders (total
    /// tokens, then requests) first.
    pub fn window(&self, window: Duration, now: Instant) -> Vec<TenantUsage> {
        let minutes = covered(window).as_secs() / BUCKET.as_secs();
        let current = self.minute(now);
        let mut tenants: HashMap<&Arc<str>, TenantUsage> = HashMap::new();
        for bucket in self.buckets.iter().filter(|b| b.minute + minutes > current) {
            for ((tenant, key), spent) in &bucket.spent {
                let t = tenants.entry(tenant).or_insert_with(|| TenantUsage {
                    tenant: tenant.to_string(),
                    spent: Spent::default(),
                    keys: BTreeMap::new(),
                });
                t.spent.add(spent);
                if let Some(key) = key {
                    t.keys.entry(key.to_string()).or_default().add(spent);
                }
            }
        }
        let mut out: Vec<TenantUsage> = tenants.into_values().collect();
        out.sort_by(|a, b| {
            (b.spent.total_tokens(), b.spent.requests, &a.tenant).cmp(&(
                a.spent.total_tokens(),
                a.spent.requests,
                &b.tenant,
            ))
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn used(prompt: u64, completion: u64, cached: u64) -> TokenUsage {
        TokenUsage {
            prompt,
            completion,
            cached,
            cache_said: true,
        }
    }

    #[test]
    fn spending_is_summed_per_tenant_and_key_over_the_window() {
        let t0 = Instant::now();
        let mut u = UsageLedger::new(t0);
        let (acme, dev) = (Arc::from("acme"), Arc::from("dev"));
        let key = Arc::from("k1");
        u.record(&acme, Some(&key), used(100, 10, 40), t0);
        u.record(&acme, None, used(50, 5, 0), t0 + Duration::from_secs(30));
        u.record(&dev, None, used(10, 1, 0), t0 + Duration::from_secs(90));
        let now = t0 + Duration::from_secs(100);
        let all = u.window(Duration::from_secs(3600), now);
        assert_eq!(all[0].tenant, "acme", "the biggest spender first");
        assert_eq!(
            all[0].spent,
            Spent {
                requests: 2,
                prompt_tokens: 150,
                completion_tokens: 15,
                cached_tokens: 40
            }
        );
        assert_eq!(all[0].keys["k1"].requests, 1);
        assert_eq!(all[1].spent.total_tokens(), 11);
        // The last minute holds only dev's request.
        let last = u.window(Duration::from_secs(60), now);
        assert_eq!(last.len(), 1);
        assert_eq!(last[0].tenant, "dev");
        // An hour later nothing is left.
        let later = t0 + Duration::from_secs(3 * 3600);
        u.record(&dev, None, used(1, 1, 0), later);
        assert_eq!(
            u.window(Duration::from_secs(3600), later)[0].spent.requests,
            1
        );
        assert_eq!(u.buckets.len(), 1);
    }

    #[test]
    fn a_window_covers_whole_minutes_of_the_hour() {
        assert_eq!(covered(Duration::from_millis(1)), BUCKET);
        assert_eq!(covered(Duration::from_secs(61)), 2 * BUCKET);
        assert_eq!(covered(Duration::from_secs(60)), BUCKET);
        assert_eq!(covered(Duration::from_secs(86_400)), 60 * BUCKET);
    }

    #[test]
    fn ten_thousand_tenants_fit_in_bounded_memory_and_true_totals() {
        let t0 = Instant::now();
        let mut u = UsageLedger::new(t0);
        for i in 0..10_000 {
            u.record(&Arc::from(format!("t{i}")), None, used(1, 1, 0), t0);
        }
        assert!(u.buckets[0].spent.len() <= MAX_ENTRIES_PER_BUCKET);
        let all = u.window(Duration::from_secs(60), t0);
        let requests: u64 = all.iter().map(|t| t.spent.requests).sum();
        assert_eq!(requests, 10_000);
        assert_eq!(all[0].tenant, OTHER);
    }

    proptest! {
        /// Whatever is recorded, the window's totals are what was recorded
        /// within it.
        #[test]
        fn totals_are_what_was_recorded(
            records in proptest::collection::vec((0u8..20, 0u64..5000, 0u64..1000, 0u64..10_000), 0..200)
        ) {
            let t0 = Instant::now();
            let mut u = UsageLedger::new(t0);
            // Records in time order.
            let mut at = t0;
            let mut times = Vec::new();
            for &(tenant, prompt, completion, at_s) in &records {
                at = at.max(t0 + Duration::from_secs(at_s));
                times.push(at);
                u.record(&Arc::from(format!("t{tenant}")), None, used(prompt, completion, prompt), at);
            }
            // What fell in the last hour of the last record.
            let cutoff = u.minute(at).saturating_sub(BUCKETS as u64 - 1);
            let expected: u64 = records
                .iter()
                .zip(&times)
                .filter(|(_, t)| u.minute(**t) >= cutoff)
                .map(|((_, p, c, _), _)| p + c)
                .sum();
            let got: u64 = u.window(Duration::from_secs(3600), at).iter().map(|t| t.spent.total_tokens()).sum();
            prop_assert_eq!(got, expected);
        }
    }
}
