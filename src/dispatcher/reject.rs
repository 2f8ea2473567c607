//! Why a request was turned away without being served, as the client is
//! told it, and the sweep that turns away requests waiting for what can
//! never come.

use std::time::Instant;

use super::{Dispatcher, Route};

/// Why a request was turned away without being served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    #[error("all model servers are busy and the request buffer is full")]
    BufferFull,
    #[error("the request's priority band is at its queue limit; retry later")]
    Shed,
    #[error("the request was evicted from the queue by higher-priority work; retry later")]
    Evicted,
    #[error("no model server is available and buffering is disabled")]
    NoEndpoints,
    #[error("the request waited too long for a free model server")]
    Timeout,
    #[error("the requested model is not served by any model server")]
    UnknownModel,
    #[error("the request needs more tokens (prompt plus max_tokens, estimated) than any model server of its model can hold")]
    TooManyTokens,
    #[error("the requested LoRA adapter is served by no model server and failed to load on every one that could load it (see load_failed in /api/v1/agents)")]
    AdapterLoadFailed,
    #[error("no model server is predicted to meet the request's latency objective (x-slo-ttft-ms / x-slo-tpot-ms) now, and its priority is below 0 (sheddable); retry later or relax the objective")]
    ObjectiveUnmet,
}

impl Reject {
    /// Value of the `x-flowgate-drop-reason` header and metric label.
    pub fn reason(self) -> &'static str {
        match self {
            Reject::BufferFull => "buffer-full",
            Reject::Shed | Reject::Evicted => "shed",
            Reject::NoEndpoints => "no-endpoints",
            Reject::Timeout => "ttl-expired",
            Reject::UnknownModel => "model-not-found",
            Reject::TooManyTokens => "exceeds-token-capacity",
            Reject::AdapterLoadFailed => "adapter-load-failed",
            Reject::ObjectiveUnmet => "objective-unmet",
        }
    }

    pub fn http_status(self) -> u16 {
        match self {
            Reject::BufferFull | Reject::NoEndpoints => 503,
            Reject::Shed | Reject::Evicted | Reject::ObjectiveUnmet => 429,
            Reject::Timeout => 504,
            Reject::UnknownModel => 404,
            Reject::TooManyTokens => 413,
            Reject::AdapterLoadFailed => 502,
        }
    }
}

impl<T> Dispatcher<T> {
    /// Answers the requests waiting for LoRA adapter `name` with
    /// [`Reject::AdapterLoadFailed`] (at the next [`Dispatcher::dispatch`])
    /// once it failed to load on every server able to and none serves it:
    /// waiting cannot help them.
    pub(super) fn refuse_unloadable(&mut self, name: String, now: Instant) {
        let route = Route {
            model: Some(name.into()),
            ..Route::default()
        };
        if !self.ledger.adapter_failed_everywhere(&route, now) {
            return;
        }
        for ticket in self.queues.tickets_in(&route.model) {
            if let Some(r) = self.queues.cancel(ticket) {
                let done = super::done(r, Err(Reject::AdapterLoadFailed), now);
                self.evicted.push(done);
            }
        }
    }
}
