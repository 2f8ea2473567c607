//! What a request that was let in holds until it ends ([`Served`]), and
//! its end, settled in one order for every door (the proxy's `logging`
//! hook, an EPP stream's response end or its stream's end) and for one
//! that no door finished (its task dropped).

use std::sync::Arc;

use flowgate::endpoint::{CacheSeen, Timing};
use flowgate::tokens::{TokenEstimate, TokenUsage};

use super::{AnswerSeen, LeaseGuard, SlotEnd};
use crate::quotas::Reserved;

/// A request let in at a door: its quotas' reservation and, once it has
/// one, its slot, with what settling them needs (its tenant, its API
/// key's id, its estimate). Settled exactly once: by [`Served::finish`]
/// with what its answer said, or, dropped unfinished, as never sent — it
/// leaves its quotas' windows and gives its slot back.
pub struct Served {
    tenant: Arc<str>,
    key: Option<Arc<str>>,
    /// What a sent request counts for when its answer did not say.
    estimate: TokenUsage,
    /// Its prompt text's length (to place the engine's cached tokens in
    /// the prompt: cache truth).
    prompt_bytes: u64,
    quota: Option<Reserved>,
    lease: Option<LeaseGuard>,
}

/// How a request's answer ended.
#[derive(Debug, Clone, Copy)]
pub struct AnswerEnd {
    /// It reached an engine (an answer, or part of one, came back).
    pub sent: bool,
    /// What the answer said it spent (for one cut short: what was sent);
    /// `None` when it did not say.
    pub said: Option<TokenUsage>,
    /// How long the engine took, as the answer showed it.
    pub timing: Option<Timing>,
    /// How its slot comes back.
    pub slot: SlotEnd,
}

impl AnswerEnd {
    /// It never reached an engine.
    pub const NEVER_SENT: AnswerEnd = AnswerEnd {
        sent: false,
        said: None,
        timing: None,
        slot: SlotEnd::Free,
    };
}

impl Served {
    /// A request of `tenant` (and API key `key`) let in with its token
    /// `estimate`; it holds nothing yet.
    pub fn new(
        tenant: &Arc<str>,
        key: Option<&Arc<str>>,
        estimate: TokenEstimate,
        prompt_bytes: u64,
    ) -> Served {
        Served {
            tenant: Arc::clone(tenant),
            key: key.cloned(),
            estimate: estimate.as_used(),
            prompt_bytes,
            quota: None,
            lease: None,
        }
    }

    /// It holds its quotas' reservation.
    pub fn reserved(&mut self, quota: Reserved) {
        self.quota = Some(quota);
    }

    /// It holds a slot (a retry's next one, once the last was given back).
    pub fn bind(&mut self, lease: LeaseGuard) {
        self.lease = Some(lease);
    }

    pub fn lease(&self) -> Option<&LeaseGuard> {
        self.lease.as_ref()
    }

    /// Its slot, taken to give back early (a failed attempt before a retry).
    pub fn take_lease(&mut self) -> Option<LeaseGuard> {
        self.lease.take()
    }

    /// The request ended as `end` says.
    pub fn finish(mut self, end: AnswerEnd) {
        self.settle(end);
    }

    /// Settles in the order that keeps every number true at every instant:
    /// the usage it spent is accounted, its quotas count what it spent (a
    /// request never sent leaves their windows), its flow's token-fair
    /// charge becomes what it spent, and only then is its slot given back
    /// — once a request no longer counts in flight, its usage and quotas
    /// are up to date. Whatever it held is taken: a second call settles
    /// nothing.
    fn settle(&mut self, end: AnswerEnd) {
        let AnswerEnd {
            sent,
            said,
            timing,
            slot,
        } = end;
        let said = said.filter(|_| sent);
        // Only a request that held a slot was sent.
        if let (Some(said), Some(lease)) = (said, &self.lease) {
            (lease.shared).record_usage(&self.tenant, self.key.as_ref(), said);
        }
        let spent = sent.then(|| said.unwrap_or(self.estimate));
        if let Some(quota) = self.quota.take() {
            quota.settle(spent);
        }
        if let Some(lease) = self.lease.take() {
            let seen = AnswerSeen {
                cache: said.filter(|s| s.cache_said).map(|said| CacheSeen {
                    prompt_tokens: said.prompt,
                    cached_tokens: said.cached,
                    prompt_bytes: self.prompt_bytes,
                }),
                timing,
            };
            lease.end(spent.map(|s| s.total()), seen, slot);
        }
    }
}

impl Drop for Served {
    /// No door finished it (refused before it was sent, or its task was
    /// dropped): settled as never sent.
    fn drop(&mut self) {
        self.settle(AnswerEnd::NEVER_SENT);
    }
}
