//! Stage 2½, kept slots: free slots kept for the requests with a latency
//! objective.
//!
//! A request with a tight TTFT objective and a long prompt is served in
//! time only by a fast endpoint with a free slot (a slow one's prefill
//! alone overshoots it). Under load, work without an objective (a batch
//! class) takes every slot the moment it frees, so such a request finds
//! the fast endpoints full and waits or misses. So while requests with a
//! TTFT objective come for the model ([`Reference`]: the hardest seen in
//! the last 5 to 10 s, [`crate::objective::Hardest`], the most prompt
//! tokens per millisecond of objective), a request without one goes only
//! where, once it took its slot, `scheduling.keptSlots`
//! ([`crate::endpoint::KEPT_SLOTS`] by default) free slots are left on the
//! endpoints predicted to serve that reference in time (its prompt
//! prefilled cold, at the endpoint's 90th-percentile time to first
//! token), and [`KEPT_ELSEWHERE`] free slot on the other endpoints: the
//! best-scored such endpoint, else it waits in the queues like any request
//! no endpoint takes. While the fast slots are scarce it waits even where
//! a slow endpoint is free. The slow endpoints' free slots serve the short
//! interactive prompts: a request with an objective of its own takes none
//! of the kept fast slots where an endpoint that would not serve the
//! reference in time is predicted to meet its own (the long ones take
//! them). At most a quarter of the model's slots is kept, and of the slow
//! ones' (none in a fleet of fewer than 4), none where no endpoint could
//! meet the reference even idle or every one could (a loose objective,
//! such as an async job's deadline: any free slot serves it), none once no
//! request with a TTFT objective came for 5 to 10 s
//! ([`crate::objective::REFERENCE_WINDOW`]). Measured on the objectives
//! bench: attainment of the interactive class at full load 0.86–0.94
//! against 0.73–0.81 without (session 37); with the slow slot kept and
//! the short prompts sent there 0.91–0.98 (mean 0.943 over eleven runs)
//! against 0.85–0.94 (mean 0.894), the batch class's throughput
//! ×0.99–1.01 below 80 % and ×0.97–0.99 at full load (BENCHMARKS.md,
//! session 38); with the reference the hardest of the last 5 to 10 s,
//! 0.98–0.99 (session 40).

use std::time::Instant;

use super::objective::OBJECTIVE_SCAN;
use super::score::{best_where, candidates};
use crate::endpoint::{Endpoint, EndpointId, EndpointLedger, Route, Wanted};
use crate::objective::Reference;

/// Free slots kept besides on the endpoints that would not serve the
/// reference in time (at most a quarter of theirs), while requests with
/// objectives come: work without an objective leaves them to the short
/// interactive prompts, which such an endpoint serves in time and which
/// then take none of the fast ones. At full load on the objectives bench
/// (8 such slots of 16), with those prompts sent there, attainment mean
/// 0.943 against 0.920 without this slot, in paired runs +0.035 to +0.052
/// (BENCHMARKS.md, session 38).
const KEPT_ELSEWHERE: u32 = 1;

/// Whether `e` is predicted to serve `reference` in time from a free
/// slot.
fn met_by(reference: &Reference, e: &Endpoint) -> bool {
    e.ttft_tail_ms(reference.tokens) <= f64::from(reference.ttft_ms)
}

/// Where `route` goes instead of `go` (module docs): `go` itself while it
/// takes none of the kept slots, else the best-scored endpoint that takes
/// none and `serves` it (meets its own objective, if it has one); `None`:
/// none does.
pub(super) fn keep(
    fleet: &EndpointLedger,
    route: &Route,
    wanted: Option<&Wanted>,
    go: EndpointId,
    now: Instant,
    serves: impl Fn(&Endpoint) -> bool,
) -> Option<EndpointId> {
    let most = fleet.scheduling().kept_slots;
    if most == 0 {
        return Some(go);
    }
    let Some(reference) = fleet.objective_reference(route, now) else {
        return Some(go);
    };
    let (mut slots, mut slow_slots, mut meet) = (0, 0, false);
    for e in fleet.serving(route).take(OBJECTIVE_SCAN) {
        if e.eligible(now) {
            slots += e.slots_total();
            if met_by(&reference, e) {
                meet = true;
            } else {
                slow_slots += e.slots_total();
            }
        }
    }
    let kept = most.min(slots / 4);
    if kept == 0 || !meet || slow_slots == 0 {
        return Some(go);
    }
    let kept_elsewhere = KEPT_ELSEWHERE.min(slow_slots / 4);
    // The free slots that would serve the reference in time, and the
    // others.
    let (mut free, mut free_elsewhere) = (0, 0);
    for e in candidates(fleet, route, now).take(OBJECTIVE_SCAN) {
        if met_by(&reference, e) {
            free += e.free_slots();
        } else {
            free_elsewhere += e.free_slots();
        }
    }
    // A slot on `e` that takes none of the kept ones: a fast slot past
    // `kept`; any other for a request with an objective (due itself, it
    // waits for none of them); for one without, only while `kept` fast
    // slots are free and past `kept_elsewhere`.
    let has_objective = !route.objective.is_none();
    let spares = |e: &Endpoint| {
        if met_by(&reference, e) {
            free > kept
        } else {
            has_objective || (free >= kept && free_elsewhere > kept_elsewhere)
        }
    };
    if fleet.endpoint(go).is_some_and(spares) {
        return Some(go);
    }
    best_where(fleet, route, wanted, now, OBJECTIVE_SCAN, |e| {
        spares(e) && serves(e)
    })
}
