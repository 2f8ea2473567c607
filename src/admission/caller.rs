//! Who sends a request, as the door authenticated them.

use std::sync::Arc;

/// What an API key grants its requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Fairness id of the key's requests.
    pub tenant: Arc<str>,
    /// Highest priority the key's requests may have.
    pub max_priority: Option<i32>,
    /// The key's token-fairness weight (else its tenant's).
    pub weight: Option<u32>,
    /// How usage accounting names the key: its `name`, else the first 12
    /// hex digits of its SHA-256 (never the key itself).
    pub key_id: Arc<str>,
    /// The key's own quota (besides its tenant's).
    pub quota: Option<crate::quota::QuotaLimits>,
    /// Its requests may ask why their endpoint was chosen
    /// (`x-flowgate-debug: scores`).
    pub debug: bool,
    /// The latency objective of its requests that name none
    /// ([`crate::objective`]).
    pub objective: crate::objective::Objective,
}

impl Grant {
    /// The priority a request of this key gets when it asks for `asked`.
    pub fn priority(&self, asked: i32) -> i32 {
        self.max_priority
            .map_or(asked, |ceiling| asked.min(ceiling))
    }
}

/// Who sends a request.
#[derive(Debug, Clone, Copy)]
pub enum Caller<'a> {
    /// No identity (the balancer has no API keys): the headers name the
    /// tenant and ask for the priority.
    Anonymous,
    /// An API key: its tenant and priority ceiling beat the headers.
    Key(&'a Grant),
    /// The balancer's own async dispatcher delivering queued work: the
    /// tenant it was submitted under (its fairness header), in the async
    /// band whatever the headers say.
    AsyncDispatcher { band: i32 },
}

impl Caller<'_> {
    /// The tenant an API key fixes, if any.
    pub fn tenant(&self) -> Option<&Arc<str>> {
        match self {
            Caller::Key(g) => Some(&g.tenant),
            _ => None,
        }
    }
}
