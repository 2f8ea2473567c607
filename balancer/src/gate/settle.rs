//! The end of a request, settled in one order for every door (the proxy's
//! `logging` hook, an EPP stream's response end or its stream's end).

use std::sync::Arc;

use flowgate::endpoint::{CacheSeen, Timing};
use flowgate::tokens::TokenUsage;

use super::{AnswerSeen, FleetGate, LeaseGuard};
use crate::quotas::Reserved;

/// What a request that was admitted leaves to settle when it ends.
pub struct RequestEnd<'a> {
    /// Its tenant and its API key's id, for usage accounting.
    pub tenant: Option<&'a Arc<str>>,
    pub key: Option<&'a Arc<str>>,
    /// It reached an engine (an answer, or part of one, came back).
    pub sent: bool,
    /// What the answer said it spent (for one cut short: what was sent);
    /// `None` when it did not say.
    pub said: Option<TokenUsage>,
    /// What a sent request counts for when its answer did not say.
    pub estimate: TokenUsage,
    /// Its prompt text's length (to place the engine's cached tokens in
    /// the prompt: cache truth).
    pub prompt_bytes: u64,
    /// How long the engine took, as the answer showed it.
    pub timing: Option<Timing>,
    pub quota: Option<Reserved>,
    pub lease: Option<LeaseGuard>,
    /// How its slot comes back.
    pub slot: SlotEnd,
}

/// How a request's slot comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotEnd {
    /// The answer ended: free now.
    Free,
    /// Its client left before the answer ended: the engine may still work
    /// on it, so it stays busy until the engine is done (`streamed` answers
    /// stop with their client).
    Orphaned { streamed: bool },
}

impl FleetGate {
    /// Settles `end` in the order that keeps every number true at every
    /// instant: the usage it spent is accounted, its quotas count what it
    /// spent (a request never sent leaves their windows), its flow's
    /// token-fair charge becomes what it spent, and only then is its slot
    /// given back — once a request no longer counts in flight, its usage
    /// and quotas are up to date.
    pub fn settle(&self, end: RequestEnd<'_>) {
        let RequestEnd {
            tenant,
            key,
            sent,
            said,
            estimate,
            prompt_bytes,
            timing,
            quota,
            lease,
            slot,
        } = end;
        let said = said.filter(|_| sent);
        if let (Some(tenant), Some(said)) = (tenant, said) {
            self.record_usage(tenant, key, said);
        }
        let spent = sent.then(|| said.unwrap_or(estimate));
        if let Some(quota) = quota {
            quota.settle(spent);
        }
        if let Some(mut lease) = lease {
            if let Some(spent) = spent {
                lease.settle(spent.total());
            }
            lease.saw(AnswerSeen {
                cache: said.filter(|s| s.cache_said).map(|said| CacheSeen {
                    prompt_tokens: said.prompt,
                    cached_tokens: said.cached,
                    prompt_bytes,
                }),
                timing,
            });
            match slot {
                SlotEnd::Free => lease.release(),
                SlotEnd::Orphaned { streamed } => lease.orphan(streamed),
            }
        }
    }
}
