//! Stage 2½ for a request without a latency objective: a free slot kept
//! for the requests with one.
//!
//! A request with a tight TTFT objective and a long prompt is served in
//! time only by a fast endpoint with a free slot (a slow one's prefill
//! alone overshoots it). Under load, work without an objective (a batch
//! class) takes every slot the moment it frees, so such a request finds
//! the fast endpoints full and waits or misses. So while requests with a
//! TTFT objective come for the model ([`Reference`]: the hardest seen in
//! the last [`REFERENCE_WINDOW`], the most prompt tokens per millisecond
//! of objective), a request without one does not take the last free slot
//! of the endpoints predicted to meet that reference (its prompt prefilled
//! cold, at the endpoint's 90th-percentile time to first token): it goes
//! to the best-scored endpoint that leaves one, else waits in the queues
//! like any request no endpoint takes. One slot of the model's fleet is
//! kept, never more; none where no endpoint could meet the reference even
//! idle, and none in a fleet of fewer than [`RESERVE_MIN_SLOTS`] slots.
//! Work without an objective keeps every other slot (the objectives
//! bench: attainment of the interactive class at full load 0.843 and
//! 0.896 against 0.791 and 0.809 without the kept slot, at 80 % 0.979
//! against 0.938, the batch class's throughput ×0.99–1.01; BENCHMARKS.md,
//! session 37).

use std::time::{Duration, Instant};

use super::objective::OBJECTIVE_SCAN;
use super::score::{candidates, route_score};
use crate::endpoint::{Endpoint, EndpointId, EndpointLedger, Route, Wanted};

/// How long the hardest request with a TTFT objective stays the reference
/// after it came: past it, with none since, no slot is kept. Long against
/// the gaps between interactive requests at any load worth keeping a slot
/// for, short against a class that stopped coming.
pub(crate) const REFERENCE_WINDOW: Duration = Duration::from_secs(10);

/// Slots the model's eligible endpoints must have in all for one to be
/// kept: the kept slot is at most a quarter of the capacity, so a small
/// fleet's work without objectives is never held back by much.
pub(crate) const RESERVE_MIN_SLOTS: u32 = 4;

/// The hardest request with a TTFT objective seen lately for a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Reference {
    /// Its prompt tokens.
    pub tokens: u64,
    /// Its TTFT objective.
    pub ttft_ms: u32,
    /// When it came.
    pub at: Instant,
}

impl Reference {
    /// Whether it still counts at `now`.
    pub(crate) fn live(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.at) <= REFERENCE_WINDOW
    }

    /// Whether `other` replaces it at `now`: it is over, or `other` asks
    /// at least as many tokens per millisecond.
    pub(crate) fn yields_to(&self, other: &Reference, now: Instant) -> bool {
        !self.live(now)
            || u128::from(other.tokens) * u128::from(self.ttft_ms)
                >= u128::from(self.tokens) * u128::from(other.ttft_ms)
    }

    /// Whether `e` is predicted to serve it in time from a free slot.
    fn met_by(&self, e: &Endpoint) -> bool {
        e.ttft_tail_ms(self.tokens) <= f64::from(self.ttft_ms)
    }
}

/// Whether, with one more slot taken on `taking`, some endpoint for
/// `route` still has a free slot and is predicted to meet `reference`.
fn kept(
    fleet: &EndpointLedger,
    route: &Route,
    reference: &Reference,
    taking: EndpointId,
    now: Instant,
) -> bool {
    candidates(fleet, route, now)
        .take(OBJECTIVE_SCAN)
        .any(|e| e.free_slots() > u32::from(e.id == taking) && reference.met_by(e))
}

/// Where `route`, without an objective, goes instead of stage 2's `go`
/// (module docs): `go` itself while that keeps the slot, else the
/// best-scored endpoint that does; `None`: it waits.
pub(super) fn keep(
    fleet: &EndpointLedger,
    route: &Route,
    wanted: Option<&Wanted>,
    go: EndpointId,
    now: Instant,
) -> Option<EndpointId> {
    let Some(reference) = fleet.objective_reference(route, now) else {
        return Some(go);
    };
    if kept(fleet, route, &reference, go, now) {
        return Some(go);
    }
    let (mut slots, mut reachable) = (0, false);
    for e in fleet.serving(route).take(OBJECTIVE_SCAN) {
        if e.eligible(now) {
            slots += e.slots_total();
            reachable |= reference.met_by(e);
        }
    }
    if slots < RESERVE_MIN_SLOTS || !reachable {
        return Some(go);
    }
    let mut best: Option<(f64, EndpointId)> = None;
    for e in candidates(fleet, route, now).take(OBJECTIVE_SCAN) {
        if e.id != go && kept(fleet, route, &reference, e.id, now) {
            let score = route_score(fleet, e, route, wanted);
            if best.is_none_or(|(b, _)| score > b) {
                best = Some((score, e.id));
            }
        }
    }
    best.map(|(_, id)| id)
}
