//! Placement: which endpoint a request goes to, or whether it waits. The
//! whole rule, in the order [`place`] runs it (each stage is a file with
//! its rule, its knobs and its tests):
//!
//! 1. **Pin** ([`pin`]). A turn of a session goes back to the endpoint its
//!    last turn went to while that one takes it; while it is saturated,
//!    stage 3 weighs waiting for it (its conversation is cached there). A
//!    binding to an endpoint that is gone is released. A session is
//!    pinned only once a turn of it was served: its first turn goes
//!    through the stages as any request, except that where other balancers
//!    share the fleet it goes to its rendezvous home (the highest hash of
//!    session and address) while that takes it, so every balancer finds
//!    it there (not where every endpoint publishes its KV-cache events).
//!    A later turn not bound here (another balancer placed the turns
//!    before), or bound where its engine holds less of the prompt than
//!    another engine, is pinned to the engine holding the most of it.
//!    Knobs: `scheduling.sessions.*`.
//! 2. **Score** ([`score`]). The candidates are the endpoints that serve
//!    the model, are eligible (ready, not draining, reported lately,
//!    circuit closed: `scheduling.circuitBreaker.*`), not saturated (free
//!    slot, queue, KV cache and token budget under `saturationDetector.*`),
//!    in the request's subset (EPP) and not the one a retry avoids. One
//!    scorer sum picks among them: free slots, KV cache, queue, cached
//!    prompt blocks (`scheduling.prefixCache.*`), resident LoRA adapter
//!    (`scheduling.adapterReplicas`), weighted by `scheduling.scorers.*`;
//!    equal sums take turns. None: the request is busy and waits in the
//!    queues.
//!
//!    **Objectives** ([`objective`], stage 2½), only for a request with a
//!    latency objective ([`crate::objective`]): the best score stands if
//!    it is predicted to meet the objective (90th-percentile time to first
//!    token for this request, and per output token, learned from the
//!    engines' answers); else the best-scored candidate predicted to; else,
//!    for a request from the queues, a saturated one that would meet it
//!    were a slot to free now, the one predicted to meet it after its wait
//!    for a slot first, else the one predicted to free a slot soonest (it
//!    waits there, as stage 3's waits do, while that one still could);
//!    else an idle one; else the one missing by least. A sheddable request
//!    (priority below 0) none is predicted to serve in time, its wait
//!    included, is refused instead. Knobs: `latencyObjectives.*` and the
//!    request's headers.
//!
//!    **Slots kept for objectives** ([`reserve`]): while requests with a
//!    TTFT objective come for the model, a request without one goes only
//!    where 3 free slots are left on the endpoints predicted to serve the
//!    hardest of them in time and 1 on the others (at most a quarter of
//!    each's slots): the best-scored such endpoint, else it is busy. One
//!    with an objective met by an endpoint that would not serve the
//!    hardest in time goes there rather than take a kept fast slot. Knob:
//!    `scheduling.keptSlots` (the 3; 0 keeps none).
//! 3. **Patience** ([`patience`]). With a free endpoint chosen, a request
//!    placed from the queues waits for a saturated endpoint instead while
//!    that is predicted to give it its first token sooner: its wait for a
//!    slot there ([`load`], behind every request held for it in the
//!    dispatch pass; a session's turn weighs the wait for its own endpoint
//!    one turn at a slot long) plus the prefill of what that one does not
//!    cache, against the prefill of what the free one does not cache (plus
//!    an adapter load where the adapter is not resident), on each engine's
//!    learned costs. Going while a busy endpoint holds more of the prompt
//!    is a spill: it waits 1 % of its cold prefill first (a burst's other
//!    groups take the free slot meanwhile). A conversation's first turn
//!    does not wait where its going evens out the work (stage 4's rule):
//!    its later turns will wait where it lands. `scheduling.affinityHold`
//!    bounds any wait (0: never wait; hard sessions wait to their TTL),
//!    and so does a TTFT objective: a request does not wait where that is
//!    predicted to miss its deadline and going meets it.
//! 4. **Evening out** ([`evening`], the dispatcher asks it): a held request
//!    whose spill delay is over passes the requests waiting for the free
//!    endpoint only from an endpoint a request per slot above the mean load
//!    to one a request below it.
//!
//! Besides: [`load`] is the one measure of an endpoint's load every stage
//! weighs; [`explain`] renders a decision's record for
//! `x-flowgate-debug: scores` and the route probe. Which queued request is
//! offered a free slot first is the dispatcher's (`dispatcher/offers.rs`:
//! held requests, then those at home, then the queues' fair order); each
//! is placed here.
//!
//! Placement only reads the fleet ([`crate::endpoint`]'s view); [`pick`]
//! books what it decided into a lease.

use std::time::{Duration, Instant};

use crate::endpoint::{Endpoint, EndpointId, EndpointLedger, Lease, Route};

pub(crate) mod evening;
mod explain;
mod load;
pub(crate) mod objective;
mod patience;
mod pin;
pub(crate) mod reserve;
mod score;

pub(crate) use explain::explain;
pub use explain::{CandidateScore, Explanation, MAX_EXPLAINED};
pub(crate) use load::Waits;
use patience::WaitOrGo;
use pin::Pin;

/// What a dispatch pass lets a request placed from the queues do.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pass<'a> {
    /// The requests held for each endpoint so far in the pass: one held
    /// for an endpoint waits behind them.
    pub waits: &'a Waits,
    /// Its spill delay is over: it may prefill cold now what a busy
    /// endpoint holds ([`patience::spill_delay`]).
    pub may_spill: bool,
}

/// What placement decided for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Go to this endpoint now.
    Go(EndpointId),
    /// Wait for this saturated endpoint (stage 3).
    Wait(EndpointId),
    /// Go where it would prefill cold what the busy endpoint (the second)
    /// holds, but not before this spill delay.
    Delay(Duration, EndpointId),
    /// No endpoint can take it now.
    Busy,
    /// Refuse it: it is sheddable and no endpoint is predicted to meet its
    /// latency objective (stage 2½).
    Shed,
}

/// A decision and what each stage saw on the way: what explain renders.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Decision {
    pub outcome: Outcome,
    /// Stage 1: where its session or home put it.
    pin: Pin,
    /// Stage 2: the best free endpoint by score, if one was looked for.
    scored: Option<EndpointId>,
    /// Stage 2½: for a request with a latency objective, where it goes
    /// instead and how that was chosen.
    objective: Option<objective::Chosen>,
    /// Stage 2½: the slots kept for objectives sent it elsewhere
    /// (`Some(Some(id))`) or, without an objective, made it wait
    /// (`Some(None)`).
    reserved: Option<Option<EndpointId>>,
    /// Stage 3: the wait-or-go verdict, if it was asked.
    patience: Option<WaitOrGo>,
}

/// Places `route` at `now` (the module docs' stages 1–3). Without `pass`
/// (a request that may not wait: it comes with nothing queued, or its
/// hold is over) stage 3 is skipped. Reads only.
pub(crate) fn place(
    fleet: &EndpointLedger,
    route: &Route,
    pass: Option<Pass<'_>>,
    now: Instant,
) -> Decision {
    let pin = pin::pin(fleet, route, now);
    let mut decision = Decision {
        outcome: Outcome::Busy,
        pin,
        scored: None,
        objective: None,
        reserved: None,
        patience: None,
    };
    let bound = match pin {
        Pin::Session(id) | Pin::Home(id) => {
            decision.outcome = Outcome::Go(id);
            return decision;
        }
        Pin::SessionBusy(id) => Some(id),
        Pin::Free | Pin::SessionGone => None,
    };
    let wanted = fleet.adapter_wanted(route, now);
    decision.scored = score::best(fleet, route, wanted.as_ref(), now);
    let Some(mut go) = decision.scored else {
        return decision;
    };
    if route.objective.is_none() {
        match reserve::keep(fleet, route, wanted.as_ref(), go, now, |_| true) {
            Some(id) if id == go => {}
            Some(id) => {
                decision.reserved = Some(Some(id));
                go = id;
            }
            None => {
                decision.reserved = Some(None);
                return decision;
            }
        }
    } else {
        let mut chosen = objective::choose(fleet, route, wanted.as_ref(), go, now);
        if chosen.met == objective::Met::Meets {
            // Met elsewhere too: it leaves the slots kept for harder ones.
            let meets = |e: &Endpoint| objective::meets(fleet, route, e, now);
            let kept = reserve::keep(fleet, route, wanted.as_ref(), chosen.id, now, meets);
            if let Some(e) = kept
                .filter(|id| *id != chosen.id)
                .and_then(|id| fleet.endpoint(id))
            {
                chosen.id = e.id;
                chosen.tails = objective::tails(fleet, e, route);
                decision.reserved = Some(Some(e.id));
            }
        }
        go = chosen.id;
        decision.objective = Some(chosen);
        if chosen.met != objective::Met::Meets {
            // No free endpoint meets it: a busy one that still could is
            // waited for (a request from the queues); by a sheddable
            // request only where it is predicted to, its wait included.
            let awaited = pass.and_then(|p| objective::awaited(fleet, route, p.waits, now));
            if let Some(at) = awaited.filter(|a| a.in_time || !route.sheddable) {
                decision.outcome = Outcome::Wait(at.id);
                return decision;
            }
            if route.sheddable {
                decision.outcome = Outcome::Shed;
                return decision;
            }
        }
    }
    let Some(pass) = pass else {
        decision.outcome = Outcome::Go(go);
        return decision;
    };
    let verdict = patience::wait_or_go(fleet, route, go, bound, pass.waits, wanted.as_ref(), now);
    decision.patience = Some(verdict);
    decision.outcome = match verdict {
        WaitOrGo::Wait { at }
            if route.due.is_some()
                && objective::waiting_misses(fleet, route, at, go, pass.waits, now) =>
        {
            Outcome::Go(go)
        }
        WaitOrGo::Wait { at } => Outcome::Wait(at),
        WaitOrGo::Spill { cold_ms, holder } if !pass.may_spill => {
            Outcome::Delay(patience::spill_delay(cold_ms), holder)
        }
        WaitOrGo::Spill { .. } | WaitOrGo::Go => Outcome::Go(go),
    };
    decision
}

/// What [`pick`] did for a request.
#[derive(Debug)]
pub(crate) enum Pick {
    /// A slot on the chosen endpoint.
    Lease(Lease),
    /// Better wait for this saturated endpoint.
    Hold(EndpointId),
    /// It would prefill cold what a busy endpoint (the second) holds: not
    /// before this spill delay.
    Delay(Duration, EndpointId),
    /// No endpoint can take it now.
    Busy,
    /// Refuse it (stage 2½).
    Shed,
}

/// Places `route` and books the decision: a lease on the endpoint chosen,
/// and a session bound to an endpoint that is gone released.
pub(crate) fn pick(
    ledger: &mut EndpointLedger,
    route: &Route,
    now: Instant,
    pass: Option<Pass<'_>>,
) -> Pick {
    let decision = place(ledger, route, pass, now);
    if let (Pin::SessionGone, Some(session)) = (decision.pin, route.session) {
        ledger.release_session(session);
    }
    match decision.outcome {
        Outcome::Go(id) => {
            let mut lease = ledger.book(route, id, now);
            lease.ttft_p90_ms = decision
                .objective
                .filter(|c| c.id == id && c.tails.ttft_ms.is_finite())
                .map(|c| c.tails.ttft_ms.round().min(f64::from(u32::MAX)) as u32);
            Pick::Lease(lease)
        }
        Outcome::Wait(id) => Pick::Hold(id),
        Outcome::Delay(after, holder) => Pick::Delay(after, holder),
        Outcome::Busy => Pick::Busy,
        Outcome::Shed => Pick::Shed,
    }
}

/// Where a queued request stands when a slot is free ([`at_home`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Home {
    /// It can go now where nothing would serve it better by its cache.
    Yes,
    /// It can go now, but a saturated endpoint has more of its prompt (or
    /// its session); `waits`: stage 3 would wait for it.
    Elsewhere { waits: bool },
    /// No endpoint can take it now.
    Busy,
}

/// Whether `route` can go now to an endpoint where it is at home: its
/// decision, asked as in a dispatch pass before its spill delay, goes
/// and no saturated endpoint holds more of its prompt or its session. Such
/// a request loses nothing by going now, so a free slot should be its
/// before it is a request's that would prefill its prompt there cold (the
/// dispatcher places these first). A route limited to a subset is never
/// at home here (it is placed in turn). Reads only.
pub(crate) fn at_home(fleet: &EndpointLedger, route: &Route, now: Instant) -> Home {
    if route.subset.is_some() {
        return Home::Elsewhere { waits: false };
    }
    let waits = Waits::default();
    let pass = Pass {
        waits: &waits,
        may_spill: false,
    };
    let decision = place(fleet, route, Some(pass), now);
    match decision.outcome {
        // A request to refuse is answered at once, wherever it stands.
        Outcome::Go(_) | Outcome::Shed => Home::Yes,
        Outcome::Wait(_) => Home::Elsewhere {
            waits: !fleet.scheduling().affinity_hold.is_zero(),
        },
        Outcome::Delay(..) => Home::Elsewhere { waits: false },
        Outcome::Busy => Home::Busy,
    }
}

#[cfg(test)]
mod tests;
