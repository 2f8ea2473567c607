//! Stage 2, score: the best endpoint that takes a request now.
//!
//! Candidates: the endpoints that serve its model, eligible, not saturated
//! (by `saturation.*`, the request's tokens included), in its subset if it
//! has one (EPP's hint), not the one a retry avoids. Each is scored by one
//! sum, the weighted scorers of [`crate::scorer`] (`scheduling.scorers`):
//! free slots, KV cache, queue, the share of the prompt's leading blocks
//! its prefix index holds, and for a LoRA adapter's request its residency
//! there ([`crate::adapter`]). The highest sum wins; within [`TIE`] the
//! endpoint whose turn comes first (the ranking's order: equal endpoints
//! take turns, [`crate::endpoint`]'s ranking).
//!
//! The cost does not grow with the fleet: the best by the scorers without
//! the prefix term is the first of the model's ranked lane that takes the
//! request; only endpoints that hold the prompt's blocks
//! ([`crate::prefix::PrefixHolders`]) can beat it with their prefix term,
//! and they are looked at deepest match first until none could; so can
//! the endpoints whose engines say (their KV-cache events) they hold some
//! of it, each scored. A subset
//! and an adapter's route (whose residency term no ranking can order) are
//! scored in full: both are a few endpoints.

use std::time::Instant;

use crate::endpoint::{Endpoint, EndpointId, EndpointLedger, Route, Wanted};

/// Scores are sums of a few ratios: closer than this is a tie.
pub(crate) const TIE: f64 = 1e-9;

/// The best candidate so far.
struct Best {
    score: f64,
    id: Option<EndpointId>,
}

impl Best {
    fn new() -> Self {
        Best {
            score: f64::NEG_INFINITY,
            id: None,
        }
    }

    /// Offers `e`, scored `score`: it wins on a higher score, or on an
    /// equal one when its turn comes first. `in_turn`: the candidates are
    /// offered in turn order (a ranked lane's), so an equal one offered
    /// later never wins and no turn is looked up.
    fn offer(&mut self, fleet: &EndpointLedger, e: &Endpoint, score: f64, in_turn: bool) {
        let Some(best) = self.id else {
            *self = Best {
                score,
                id: Some(e.id),
            };
            return;
        };
        let better = score > self.score + TIE
            || (!in_turn && score >= self.score - TIE && sooner(fleet, e.id, best));
        if better {
            *self = Best {
                score,
                id: Some(e.id),
            };
        }
    }
}

/// Whether `a`'s turn comes before `b`'s (an endpoint not ranked, which
/// takes no work, comes last).
fn sooner(fleet: &EndpointLedger, a: EndpointId, b: EndpointId) -> bool {
    match (fleet.turn(a), fleet.turn(b)) {
        (Some(a), Some(b)) => a < b,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// Every scorer's sum for `route` on `e`: its static score (the ranking's),
/// its prefix term and its adapter's (`wanted`).
pub(crate) fn route_score(
    fleet: &EndpointLedger,
    e: &Endpoint,
    route: &Route,
    wanted: Option<&Wanted>,
) -> f64 {
    let weights = &fleet.scheduling().scorers;
    let blocks = route.prefix.len();
    let prefix = if weights.prefix_cache > 0.0 && blocks > 0 {
        weights.prefix_cache * e.prefix_matched(route) as f64 / blocks as f64
    } else {
        0.0
    };
    let adapter = e.adapter_score(wanted).map_or(0.0, |s| weights.adapter * s);
    e.static_score(weights, fleet.saturation()) + prefix + adapter
}

/// Every candidate for `route` now (module docs), in turn order where
/// there is one: what a stage that must look at each one scans.
pub(crate) fn candidates<'a>(
    fleet: &'a EndpointLedger,
    route: &'a Route,
    now: Instant,
) -> Box<dyn Iterator<Item = &'a Endpoint> + 'a> {
    let config = fleet.saturation();
    match &route.subset {
        Some(subset) => Box::new(
            subset
                .iter()
                .filter_map(|a| fleet.endpoint_at(*a))
                .filter(move |e| e.fits(route) && e.takes(route, now, config)),
        ),
        None => Box::new(
            fleet
                .ranked(route.model.as_deref())
                .filter(move |e| e.takes(route, now, config)),
        ),
    }
}

/// The best-scored candidate for `route` now that `wanted_here` accepts,
/// ties by stage 2's rule (turn order): for a stage that must leave some
/// candidates out ([`super::reserve`]). Scans at most `scan` candidates.
pub(crate) fn best_where(
    fleet: &EndpointLedger,
    route: &Route,
    wanted: Option<&Wanted>,
    now: Instant,
    scan: usize,
    mut wanted_here: impl FnMut(&Endpoint) -> bool,
) -> Option<EndpointId> {
    let in_turn = route.subset.is_none();
    let mut best = Best::new();
    for e in candidates(fleet, route, now).take(scan) {
        if wanted_here(e) {
            best.offer(fleet, e, route_score(fleet, e, route, wanted), in_turn);
        }
    }
    best.id
}

/// The best endpoint that takes `route` now, if any (module docs);
/// `wanted`: its adapter ([`EndpointLedger::adapter_wanted`]).
pub(crate) fn best(
    fleet: &EndpointLedger,
    route: &Route,
    wanted: Option<&Wanted>,
    now: Instant,
) -> Option<EndpointId> {
    let config = fleet.saturation();
    let takes = |e: &&Endpoint| e.takes(route, now, config);
    let mut best = Best::new();
    let offer = |best: &mut Best, e: &Endpoint, in_turn: bool| {
        best.offer(fleet, e, route_score(fleet, e, route, wanted), in_turn);
    };
    let model = route.model.as_deref();
    if let Some(subset) = &route.subset {
        subset
            .iter()
            .filter_map(|a| fleet.endpoint_at(*a))
            .filter(|e| e.fits(route))
            .filter(takes)
            .for_each(|e| offer(&mut best, e, false));
        return best.id;
    }
    if wanted.is_some() {
        fleet
            .ranked(model)
            .filter(takes)
            .for_each(|e| offer(&mut best, e, true));
        return best.id;
    }
    let top = fleet.ranked(model).find(takes)?;
    let weight = fleet.scheduling().scorers.prefix_cache;
    let blocks = route.prefix.len();
    // The endpoints whose engines say they hold some of the prompt (their
    // KV-cache events: a few) are scored each.
    if let Some(held) = route.engine_held.as_ref().filter(|_| weight > 0.0) {
        offer(&mut best, top, true);
        held.by_endpoint
            .iter()
            .filter(|(addr, _)| held.share(*addr) > Some(0.0))
            .filter_map(|(addr, _)| fleet.endpoint_at(*addr))
            .filter(|e| e.fits(route))
            .filter(takes)
            .for_each(|e| offer(&mut best, e, false));
    }
    // Blocks are chained, and an LRU touches a prompt's first block last:
    // an endpoint holding block `d` holds every block before it.
    let depth = route
        .prefix
        .iter()
        .take_while(|h| !fleet.holders_of(**h).is_empty())
        .count();
    if weight <= 0.0 || depth == 0 {
        return best.id.or(Some(top.id));
    }
    offer(&mut best, top, true);
    let held: usize = route.prefix[..depth]
        .iter()
        .map(|h| fleet.holders_of(*h).len())
        .sum();
    if held > fleet.ranked_len(model) {
        // More holders than candidates (a prompt many endpoints saw):
        // scoring every candidate is the cheaper way.
        fleet
            .ranked(model)
            .filter(takes)
            .for_each(|e| offer(&mut best, e, true));
        return best.id;
    }
    let top_static = top.static_score(&fleet.scheduling().scorers, config);
    let prefix_term = |matched: usize| weight * matched as f64 / blocks as f64;
    for d in (0..depth).rev() {
        // No endpoint whose deepest block is `d` can beat the best.
        if top_static + prefix_term(d + 1) <= best.score + TIE {
            break;
        }
        fleet
            .holders_of(route.prefix[d])
            .iter()
            .filter_map(|id| fleet.endpoint(*id))
            .filter(|e| e.fits(route))
            .filter(takes)
            .for_each(|e| offer(&mut best, e, false));
    }
    best.id
}
