//! Stage 2½, objectives: for a request with a latency objective
//! ([`crate::objective`]), an endpoint predicted to meet it.
//!
//! Each candidate's tails are predicted for this request ([`tails`]): its
//! 90th-percentile time to first token (the prefill of what that endpoint
//! does not cache, at its learned rate, plus the 90th percentile of how
//! much later than that its first tokens came lately: the running batch,
//! the engine's queue) and its 90th-percentile time per output token, all
//! learned from its answers ([`crate::endpoint::CostModel`]). The TTFT
//! objective counts from the request's arrival: what it waited in the
//! queues is spent.
//!
//! Stage 2's choice stands when it is predicted to meet both parts; else
//! the best-scored candidate predicted to; else, for a request from the
//! queues, a saturated endpoint that would still meet it were a slot to
//! free now ([`awaited`]: it waits for that one, the one predicted to meet
//! it soonest after its wait first); else, none being, an idle one
//! (nothing running there: the best a tail can be), the best scored first;
//! else the one missing by least (the larger of its two overshoots, as a
//! ratio of the objective). A request without an objective skips the stage
//! and costs nothing here.

use std::time::Instant;

use super::load::{Load, Waits};
use super::patience::{cached_tokens, matched_blocks, prompt_tokens};
use super::score::{candidates, route_score};
use crate::endpoint::{Endpoint, EndpointId, EndpointLedger, Route, Wanted};

/// Endpoints this stage looks at, at most, when stage 2's choice misses
/// (and when it asks whether any busy one, or any at all, would meet the
/// objective): the first of the model's lane, least loaded first. Each
/// look is a prefix-index match and two tails; unbounded, a flood of
/// requests with objectives none meets would scan a 1,000-endpoint fleet
/// under the dispatcher's lock each time. Past the 64 least loaded, an
/// endpoint is rarely the one to meet a deadline the first 64 miss.
pub(crate) const OBJECTIVE_SCAN: usize = 64;

/// An endpoint's predicted tails for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tails {
    /// 90th-percentile time to first token if it starts now, ms.
    pub ttft_ms: f64,
    /// 90th-percentile time per output token, ms.
    pub tpot_ms: f64,
}

/// How stage 2½ chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Met {
    /// The endpoint is predicted to meet the objective.
    Meets,
    /// None is; this one runs nothing.
    Idle,
    /// None is, none is idle; this one misses by least.
    LeastMiss,
}

impl Met {
    /// Its name in `x-flowgate-scores` and the access log.
    pub fn as_str(self) -> &'static str {
        match self {
            Met::Meets => "meets",
            Met::Idle => "idle",
            Met::LeastMiss => "least-miss",
        }
    }
}

/// `route`'s predicted tails on `e`, starting now.
pub(crate) fn tails(fleet: &EndpointLedger, e: &Endpoint, route: &Route) -> Tails {
    let matched = matched_blocks(fleet, route, e);
    let uncached = prompt_tokens(fleet, route) - cached_tokens(fleet, route, matched);
    Tails {
        ttft_ms: e.ttft_tail_ms(uncached),
        tpot_ms: e.tpot_tail_ms(),
    }
}

/// `route`'s predicted tails on saturated `e` carrying `load`: its wait
/// for a slot there first.
fn tails_behind(fleet: &EndpointLedger, e: &Endpoint, route: &Route, load: Load) -> Tails {
    behind(tails(fleet, e, route), e, load)
}

/// `t`, `route`'s tails on a free slot of `e`, after its wait for a slot
/// there behind `load`.
fn behind(mut t: Tails, e: &Endpoint, load: Load) -> Tails {
    t.ttft_ms += load.wait_ms(e.service_ms());
    t
}

/// Milliseconds left for `route`'s first token at `now` (none: no TTFT
/// objective).
pub(crate) fn ttft_budget_ms(route: &Route, now: Instant) -> Option<f64> {
    let due = route.due?;
    Some(due.saturating_duration_since(now).as_secs_f64() * 1_000.0)
}

/// How far `tails` miss `route`'s objective at `now`: the larger of the
/// two overshoots as a ratio of the objective; at most 1 meets it.
pub(crate) fn miss(route: &Route, tails: Tails, now: Instant) -> f64 {
    // A deadline already past: every endpoint misses, the soonest least.
    let ttft = ttft_budget_ms(route, now).map_or(0.0, |left| tails.ttft_ms / left.max(1.0));
    let tpot = route
        .objective
        .tpot_ms
        .map_or(0.0, |o| tails.tpot_ms / f64::from(o));
    ttft.max(tpot)
}

/// Whether `e`, free, is predicted to meet `route`'s objective at `now`.
pub(crate) fn meets(fleet: &EndpointLedger, route: &Route, e: &Endpoint, now: Instant) -> bool {
    miss(route, tails(fleet, e, route), now) <= 1.0
}

/// What stage 2½ chose.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Chosen {
    pub id: EndpointId,
    pub met: Met,
    /// Its predicted tails.
    pub tails: Tails,
}

/// Stage 2½ (module docs): where `route` goes given stage 2's choice
/// `scored`, and how it was chosen.
pub(crate) fn choose(
    fleet: &EndpointLedger,
    route: &Route,
    wanted: Option<&Wanted>,
    scored: EndpointId,
    now: Instant,
) -> Chosen {
    if let Some(e) = fleet.endpoint(scored) {
        let t = tails(fleet, e, route);
        if miss(route, t, now) <= 1.0 {
            return Chosen {
                id: e.id,
                met: Met::Meets,
                tails: t,
            };
        }
    }
    // The best candidate by the module's rule: the highest key.
    type Key = (bool, bool, f64, f64); // (meets, idle, −miss, score)
    let mut best: Option<(Key, EndpointId, Tails)> = None;
    for e in candidates(fleet, route, now).take(OBJECTIVE_SCAN) {
        let t = tails(fleet, e, route);
        let miss = miss(route, t, now);
        let score = route_score(fleet, e, route, wanted);
        let key = if miss <= 1.0 {
            (true, false, 0.0, score)
        } else {
            (false, e.idle(), -miss, score)
        };
        if best.is_none_or(|(b, ..)| key.partial_cmp(&b) == Some(std::cmp::Ordering::Greater)) {
            best = Some((key, e.id, t));
        }
    }
    let met = |key: Key| match key {
        (true, ..) => Met::Meets,
        (false, true, ..) => Met::Idle,
        _ => Met::LeastMiss,
    };
    match best {
        Some((key, id, tails)) => Chosen {
            id,
            met: met(key),
            tails,
        },
        None => Chosen {
            id: scored,
            met: Met::LeastMiss,
            tails: Tails {
                ttft_ms: f64::INFINITY,
                tpot_ms: f64::INFINITY,
            },
        },
    }
}

/// Stage 3 weighs the objective: waiting for saturated `at` (behind the
/// requests `waits` holds for it) is predicted to miss `route`'s TTFT
/// deadline where going to `go` now is predicted to meet it. Then it
/// goes: a cache is not worth a missed deadline.
pub(crate) fn waiting_misses(
    fleet: &EndpointLedger,
    route: &Route,
    at: EndpointId,
    go: EndpointId,
    waits: &Waits,
    now: Instant,
) -> bool {
    let Some(left) = ttft_budget_ms(route, now) else {
        return false;
    };
    let (Some(at), Some(go)) = (fleet.endpoint(at), fleet.endpoint(go)) else {
        return false;
    };
    let waiting = tails_behind(fleet, at, route, Load::of(at, waits)).ttft_ms;
    waiting > left && tails(fleet, go, route).ttft_ms <= left
}

/// A saturated endpoint a request no free endpoint serves in time waits
/// for ([`awaited`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Awaited {
    pub id: EndpointId,
    /// Predicted to meet the objective after its wait for a slot there;
    /// else only were a slot to free now.
    pub in_time: bool,
}

/// The saturated endpoint a request no free endpoint serves in time waits
/// for, if any: the one predicted to meet `route`'s objective soonest, its
/// wait for a slot (behind the requests `waits` holds for it) included;
/// else the one whose slot is predicted to free soonest among those that
/// would still meet it were a slot to free now. The predicted wait is a
/// mean (a service time per slot), and a slot often frees sooner; the
/// request misses anyway where it goes now, so it waits while it still
/// can meet its objective there (each dispatch pass asks again: once no
/// busy endpoint could, it goes where it misses by least). Sent at once
/// instead, a long prompt takes a slot of a slow server that a short one
/// would have been served in time from. On the objectives bench, in
/// paired runs at full load, attainment +0.003 to +0.024 (six of six
/// higher; at 120 % −0.002 and −0.015, within a run's spread), and in the
/// offline model of that bench (`scripts/bench/ceiling`: exact prefill
/// times) 0.988 against 0.985 at full load, 0.990 against 0.975 at 120 %
/// (BENCHMARKS.md, session 40).
pub(crate) fn awaited(
    fleet: &EndpointLedger,
    route: &Route,
    waits: &Waits,
    now: Instant,
) -> Option<Awaited> {
    let config = fleet.saturation();
    // (in time, −predicted TTFT behind its wait), the highest first.
    let mut best: Option<((bool, f64), EndpointId)> = None;
    for e in fleet.serving(route).take(OBJECTIVE_SCAN) {
        if !e.eligible(now) || e.takes(route, now, config) {
            continue;
        }
        let free = tails(fleet, e, route);
        if miss(route, free, now) > 1.0 {
            continue;
        }
        let t = behind(free, e, Load::of(e, waits));
        let key = (miss(route, t, now) <= 1.0, -t.ttft_ms);
        if best.is_none_or(|(b, _)| key.partial_cmp(&b) == Some(std::cmp::Ordering::Greater)) {
            best = Some((key, e.id));
        }
    }
    best.map(|((in_time, _), id)| Awaited { id, in_time })
}

/// Whether any endpoint serving `route` is predicted to meet its objective
/// at `now`, waiting for a slot where it must (a saturated one behind its
/// load): a sheddable request none can serve in time is refused at once
/// rather than queued to miss. With no eligible endpoint to predict from
/// (a fleet scaling up from zero, every server down) nothing is known: it
/// waits as any request does.
pub(crate) fn reachable(fleet: &EndpointLedger, route: &Route, now: Instant) -> bool {
    let config = fleet.saturation();
    let none = Waits::default();
    let mut eligible = fleet
        .serving(route)
        .take(OBJECTIVE_SCAN)
        .filter(|e| e.eligible(now))
        .peekable();
    if eligible.peek().is_none() {
        return true;
    }
    eligible.any(|e| {
        let t = if e.takes(route, now, config) {
            tails(fleet, e, route)
        } else {
            tails_behind(fleet, e, route, Load::of(e, &none))
        };
        miss(route, t, now) <= 1.0
    })
}
