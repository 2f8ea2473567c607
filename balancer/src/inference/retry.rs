//! Retry rules: which failure sends a request to another endpoint, and
//! whose fault a failure is (what feeds an endpoint's circuit breaker,
//! [`flowgate::blame`]'s rule).

use pingora_core::{Error, ErrorSource};

use super::{Inference, RequestCtx};
use crate::gate::Served;
use crate::observe::metrics::RetryReason;

impl Inference {
    /// Feeds the circuit breaker of the endpoint the request holds.
    pub(super) fn record_outcome(&self, ctx: &RequestCtx, ok: bool) {
        if let Some(lease) = ctx.lease() {
            self.door.gate.record_outcome(lease, ok);
        }
    }

    /// A suspect 5xx that no second endpoint repeated counts against the
    /// endpoint that gave it.
    pub(super) fn blame_suspect(&self, ctx: &mut RequestCtx) {
        if let Some((endpoint, addr)) = ctx.retry.suspect.take() {
            self.door
                .gate
                .record_endpoint_outcome(endpoint, addr, false);
        }
    }

    /// After a failed attempt: if the request may go again to another
    /// endpoint, gives its slot back, counts the retry (`reason` labels the
    /// metric) and returns `true`; `upstream_peer` then waits for the next
    /// slot.
    pub(super) fn begin_retry(&self, ctx: &mut RequestCtx, reason: RetryReason) -> bool {
        if ctx.retry.done >= self.retries {
            return false;
        }
        let Some(meta) = &ctx.meta else { return false };
        if !self.door.gate.has_alternative(&meta.route, ctx.upstream) {
            return false;
        }
        ctx.retry.done += 1;
        ctx.retry.pending = true;
        if let Some(lease) = ctx.served.as_mut().and_then(Served::take_lease) {
            lease.release();
        }
        self.door.gate.metrics.upstream_retry(reason);
        true
    }
}

/// Whether `e` is what a reused upstream connection that the server had
/// already closed gives: an upstream error before any response byte, of the
/// kind Pingora marks retryable on reused connections only.
pub(super) fn reused_connection_went_stale(e: &Error, before_answer: bool, reused: bool) -> bool {
    reused
        && before_answer
        && e.esource() == &ErrorSource::Upstream
        && e.retry == pingora_core::RetryType::ReusedOnly
}
