//! Stage 4, evening out: which spills may pass the requests that wait for
//! the free endpoint.
//!
//! A conversation's turns re-send its history, so each turn waits for the
//! endpoint that served the one before (its cache, or its session): where
//! its first turn lands, its whole life waits. The wait-or-go rule
//! ([`super::patience`]) weighs one turn's own time; which spill takes a
//! free slot first then decides where conversations live. Compared by
//! queues of the moment (the rule before this one), a burst of unequal
//! groups (one system prompt shared by half of them) ended with 10, 6, 8
//! and 8 conversations on four servers under a controlled clock, where 8
//! each was possible: the second group, its fair share, spilled onto a
//! small group's server because its queue was the longer, while the
//! largest group stayed on its own. So a held request whose spill delay
//! is over passes the requests waiting for a free endpoint only to even
//! out the work: from an endpoint carrying at least one request per slot
//! more than the mean of those serving its model (its [`super::load`],
//! and the queued requests waiting for each or not placed yet, over their
//! slots) to one carrying at least one fewer. A free slot none of them
//! wants still goes to the spill, in the dispatcher's main pass.

use std::time::Instant;

use super::load::{Load, Waits};
use crate::endpoint::{Endpoint, EndpointId, EndpointLedger, Route};

/// Slack for the comparisons of loads (sums of fractions of a request).
const EPSILON: f64 = 1e-9;

/// Queued requests by the endpoint each waits for: the one it was held
/// for, or the one holding most of its prompt; `unplaced`: the requests
/// none of those is known for (their prompt cached nowhere yet), work that
/// lands somewhere all the same.
#[derive(Debug, Default)]
pub(crate) struct QueuedWork {
    pub by_endpoint: Waits,
    pub unplaced: u32,
}

/// The endpoint serving `route` that holds the most of its leading prompt
/// blocks, if one holds any: the one a queued request not yet held for an
/// endpoint waits for. Its blocks are chained hashes, and an endpoint
/// forgets a prompt from its end, so the holders of its deepest block held
/// anywhere hold the most: found in a few lookups, whatever the fleet's
/// size. Where engines say what they hold (their KV-cache events), the one
/// holding the largest share, before any guess.
pub(crate) fn prompt_holder(
    fleet: &EndpointLedger,
    route: &Route,
    now: Instant,
) -> Option<EndpointId> {
    if fleet.scheduling().scorers.prefix_cache <= 0.0 {
        return None;
    }
    let usable = |e: &&Endpoint| e.fits(route) && e.eligible(now);
    if let Some(e) = engines_holder(fleet, route, now) {
        return Some(e.id);
    }
    // Else the guess, for the endpoints without events.
    let guessed = |e: &&Endpoint| {
        (route.engine_held.as_ref()).is_none_or(|held| held.share(e.addr).is_none())
    };
    let held = route
        .prefix
        .partition_point(|block| !fleet.holders_of(*block).is_empty());
    let deepest = route.prefix.get(held.checked_sub(1)?)?;
    fleet
        .holders_of(*deepest)
        .iter()
        .filter_map(|id| fleet.endpoint(*id))
        .find(|e| usable(e) && guessed(e))
        .map(|e| e.id)
}

/// Of the endpoints serving `route` (eligible) whose engines say what they
/// hold (KV-cache events), the one holding the largest share of its
/// prompt, if one holds any; equal shares: the lowest address, the same on
/// every balancer.
pub(crate) fn engines_holder<'f>(
    fleet: &'f EndpointLedger,
    route: &Route,
    now: Instant,
) -> Option<&'f Endpoint> {
    let held = route.engine_held.as_ref()?;
    held.shares()
        .filter(|(_, share)| *share > 0.0)
        .filter_map(|(addr, share)| Some((share, fleet.endpoint_at(addr)?)))
        .filter(|(_, e)| e.fits(route) && e.eligible(now))
        .max_by(|a, b| a.0.total_cmp(&b.0).then(b.1.addr.cmp(&a.1.addr)))
        .map(|(_, e)| e)
}

/// Whether a spill of `route` from `holder` evens out the work (module
/// docs): `holder` carries at least one request per slot more than the
/// mean of the endpoints serving the route (their loads with `queued`),
/// and one of them that takes work now at least one fewer.
pub(crate) fn spill_evens_out(
    fleet: &EndpointLedger,
    route: &Route,
    holder: EndpointId,
    queued: &QueuedWork,
    now: Instant,
) -> bool {
    let balance = Balance::of(
        fleet,
        route,
        &queued.by_endpoint,
        queued.unplaced,
        Some(holder),
        now,
    );
    balance.holder.is_some_and(|h| balance.moving_evens_out(&h))
}

/// The work of the endpoints serving a route, as evening out weighs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Balance {
    /// Requests per slot over them all.
    mean: f64,
    /// The least a free endpoint would carry with one request more.
    least_free: f64,
    /// The load of the holder [`Balance::of`] was asked about, if it is
    /// one of them.
    holder: Option<Load>,
}

impl Balance {
    /// Over the eligible endpoints serving `route`, with the requests
    /// `waits` holds for each and `unplaced` more; `holder`, if one of
    /// them, is not counted as a free one and its load is kept. One pass
    /// over the endpoints: asked once per decision, however many endpoints
    /// it weighs.
    pub(crate) fn of(
        fleet: &EndpointLedger,
        route: &Route,
        waits: &Waits,
        unplaced: u32,
        holder: Option<EndpointId>,
        now: Instant,
    ) -> Balance {
        let config = fleet.saturation();
        let (mut requests, mut slots) = (u64::from(unplaced), 0);
        let mut least_free = f64::INFINITY;
        let mut holder_load = None;
        for e in fleet.serving(route).filter(|e| e.eligible(now)) {
            let load = Load::of(e, waits);
            requests += load.requests();
            slots += load.slots();
            if Some(e.id) == holder {
                holder_load = Some(load);
            } else if e.available(now, config) {
                least_free = least_free.min(load.per_slot() + load.one_request());
            }
        }
        Balance {
            mean: requests as f64 / slots.max(1) as f64,
            least_free,
            holder: holder_load,
        }
    }

    /// Whether moving a request from an endpoint carrying `holder` to the
    /// freest one evens out the work: it carries at least one request per
    /// slot more than the mean, the free one with it no more than the
    /// mean. Stage 3 asks it too: a conversation's first turn does not
    /// wait for a busy endpoint where going evens out the work
    /// ([`super::patience`]).
    pub(crate) fn moving_evens_out(&self, holder: &Load) -> bool {
        holder.per_slot() - holder.one_request() >= self.mean - EPSILON
            && self.least_free <= self.mean + EPSILON
    }
}
