//! Stage 2½ for a request without a latency objective: free slots kept
//! for the requests with one.
//!
//! A request with a tight TTFT objective and a long prompt is served in
//! time only by a fast endpoint with a free slot (a slow one's prefill
//! alone overshoots it). Under load, work without an objective (a batch
//! class) takes every slot the moment it frees, so such a request finds
//! the fast endpoints full and waits or misses. So while requests with a
//! TTFT objective come for the model ([`Reference`]: the hardest seen in
//! the last [`crate::objective::REFERENCE_WINDOW`], the most prompt
//! tokens per millisecond of objective), a request without one goes only
//! where, once it took its slot, [`KEPT_SLOTS`] free slots are left on the
//! endpoints predicted to serve that reference in time (its prompt
//! prefilled cold, at the endpoint's 90th-percentile time to first
//! token): the best-scored such endpoint, else it waits in the queues like
//! any request no endpoint takes. While those slots are scarce it waits
//! even where a slow endpoint is free: that slot serves the short
//! interactive prompts, which would otherwise take the fast ones. At most
//! a quarter of the model's slots is kept (none in a fleet of fewer than
//! 4), none where no endpoint could meet the reference even idle or every
//! one could (a loose objective, such as an async job's deadline: any free
//! slot serves it), none once no request with a TTFT objective came for
//! [`crate::objective::REFERENCE_WINDOW`]. Measured on the objectives
//! bench: attainment of the interactive class at full load 0.86–0.94
//! against 0.73–0.81 without, 0.99–1.00 at 80 %, the batch class's
//! throughput ×0.98–1.00 (BENCHMARKS.md, session 37).

use std::time::Instant;

use super::objective::OBJECTIVE_SCAN;
use super::score::{best_where, candidates};
use crate::endpoint::{Endpoint, EndpointId, EndpointLedger, Route, Wanted};
use crate::objective::Reference;

/// Free slots kept for the reference, at most (and at most a quarter of
/// the model's slots): on the objectives bench (16 slots, 8 of them fast
/// enough) 1 gave attainment 0.84–0.90 at full load, 3 gave 0.86–0.94,
/// 4 the same at ×0.95 the batch class's throughput (BENCHMARKS.md,
/// session 37).
const KEPT_SLOTS: u32 = 3;

/// Whether `e` is predicted to serve `reference` in time from a free
/// slot.
fn met_by(reference: &Reference, e: &Endpoint) -> bool {
    e.ttft_tail_ms(reference.tokens) <= f64::from(reference.ttft_ms)
}

/// Where `route`, without an objective, goes instead of stage 2's `go`
/// (module docs): `go` itself while that keeps the slots, else the
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
    let (mut slots, mut meet, mut miss) = (0, false, false);
    for e in fleet.serving(route).take(OBJECTIVE_SCAN) {
        if e.eligible(now) {
            slots += e.slots_total();
            if met_by(&reference, e) {
                meet = true;
            } else {
                miss = true;
            }
        }
    }
    let kept = KEPT_SLOTS.min(slots / 4);
    if kept == 0 || !meet || !miss {
        return Some(go);
    }
    // The free slots that would serve the reference in time, and what
    // taking one on `e` leaves of them.
    let free: u32 = candidates(fleet, route, now)
        .take(OBJECTIVE_SCAN)
        .filter(|e| met_by(&reference, e))
        .map(Endpoint::free_slots)
        .sum();
    let keeps = |e: &Endpoint| free.saturating_sub(u32::from(met_by(&reference, e))) >= kept;
    if fleet.endpoint(go).is_some_and(keeps) {
        return Some(go);
    }
    best_where(fleet, route, wanted, now, OBJECTIVE_SCAN, keeps)
}
