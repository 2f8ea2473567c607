//! Why an endpoint: the decision [`super::place`] makes for a request now,
//! rendered with every endpoint that may serve it and each scorer's part
//! of its score. The same path as the request's own placement, read only:
//! nothing is booked and no session moved. For the
//! `x-flowgate-debug: scores` answer header, the management port's route
//! probe and the `endpoint.choice` span.

use std::net::SocketAddr;
use std::time::Instant;

use serde::Serialize;

use super::load::{Load, Waits};
use super::objective;
use super::patience::{cached_tokens, prompt_tokens, WaitOrGo};
use super::{place, Outcome, Pass, Pin};
use crate::endpoint::{Endpoint, EndpointLedger, Route};
use crate::objective::Objective;
use crate::scorer::ScoreTerms;

/// Candidates listed at most (the best ones); the rest are counted.
pub const MAX_EXPLAINED: usize = 16;

/// The scoring of one request against the fleet.
#[derive(Debug, Clone, Serialize)]
pub struct Explanation {
    /// Leading prompt blocks hashed for prefix affinity.
    pub prompt_blocks: usize,
    /// The endpoint stage 1 pinned the request's session to, if any: its
    /// last turn's, or for a later turn not bound here (or bound where
    /// its engine holds less) the engine holding the most of its prompt.
    pub session_endpoint: Option<SocketAddr>,
    /// Where it would go now ([`super::place`]: its session's endpoint or
    /// rendezvous home when that takes it, else the best score that can);
    /// `None`: no endpoint takes it now.
    pub choice: Option<SocketAddr>,
    /// The saturated endpoint a queued request would wait for rather than
    /// go to `choice` (stage 3, [`super::patience`]: predicted sooner
    /// there); `None`: it would go.
    pub waits_for: Option<SocketAddr>,
    /// A busy endpoint holding more of its prompt that it would leave
    /// (a spill, after its delay); `None`: none.
    pub spills_from: Option<SocketAddr>,
    /// Its latency objective, if it has one ([`crate::objective`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub objective: Option<Objective>,
    /// How stage 2½ chose for it ([`super::objective`]): `meets`, `idle`,
    /// `least-miss`, or `shed` (refused: sheddable, out of reach);
    /// `reserve` where it leaves the slots kept for objectives
    /// ([`super::reserve`]: it goes elsewhere, where its own objective, if
    /// any, is met too, or, without one, waits).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub objective_choice: Option<&'static str>,
    /// Those that can take it first, best score first.
    pub candidates: Vec<CandidateScore>,
    /// Endpoints of the request's model not listed (beyond
    /// [`MAX_EXPLAINED`]).
    pub more: usize,
}

/// One endpoint as the scorers see it for one request.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateScore {
    pub addr: SocketAddr,
    /// It can take the request now (eligible, not saturated, room in its
    /// token budget).
    pub takes: bool,
    /// Why it cannot: `ineligible` (not ready, draining, stale, circuit
    /// open) or why it is saturated.
    pub reason: Option<&'static str>,
    /// Leading prompt blocks it holds (in the units of the prompt's
    /// byte blocks), and where that comes from: `engine` (its KV-cache
    /// events, [`crate::kv_events`]) or `guess` (its prefix index).
    pub prefix_matched: usize,
    pub prefix_source: &'static str,
    /// Each scorer's weighted part, and their sum.
    pub terms: ScoreTerms,
    pub score: f64,
    /// Predicted time to its first token there, from its learned costs
    /// ([`crate::endpoint::CostModel`]): the wait for a slot (0 when it
    /// takes the request now, else by its [`super::load`]) plus the
    /// prefill of the prompt tokens not cached there (its session's
    /// endpoint counts the conversation as cached): what stage 3 weighs.
    pub predicted_wait_ms: f64,
    pub predicted_prefill_ms: f64,
    /// For a request with a latency objective: its predicted
    /// 90th-percentile time to first token there (the wait for a slot
    /// included) and per output token ([`super::objective`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_ttft_p90_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_tpot_p90_ms: Option<f64>,
}

/// How `route` is placed at `now` (see the module docs).
pub(crate) fn explain(fleet: &EndpointLedger, route: &Route, now: Instant) -> Explanation {
    let config = fleet.saturation();
    let scheduling = fleet.scheduling();
    let weights = scheduling.scorers;
    let blocks = route.prefix.len();
    // As a request from the queues is placed (it may wait) when holds are
    // on or its session is hard; as one that may not wait otherwise.
    let may_wait =
        !scheduling.affinity_hold.is_zero() || route.waits_hard(scheduling.sessions.hard);
    let none = Waits::default();
    let pass = Pass {
        waits: &none,
        may_spill: false,
    };
    let decision = place(fleet, route, may_wait.then_some(pass), now);
    let addr = |id| fleet.endpoint(id).map(|e| e.addr);
    // Where stage 1 pinned its session: its conversation counts as cached
    // there, as stage 3 counts it.
    let session_endpoint = match decision.pin {
        Pin::Session(id) | Pin::SessionBusy(id) => addr(id),
        Pin::Free | Pin::SessionGone | Pin::Home(_) => None,
    };
    let wanted = fleet.adapter_wanted(route, now);
    let prompt = prompt_tokens(fleet, route);
    let score = |e: &Endpoint| {
        let prefix_matched = e.prefix_matched(route);
        let terms = e
            .candidate(prefix_matched, blocks, wanted.as_ref(), config)
            .map_or_else(ScoreTerms::default, |c| weights.terms(&c));
        let takes = e.takes(route, now, config);
        let reason = if takes {
            None
        } else if !e.eligible(now) {
            Some("ineligible")
        } else {
            Some(
                e.saturation(now, config)
                    .map_or("token-budget", |s| s.as_str()),
            )
        };
        let cached = if session_endpoint == Some(e.addr) {
            if e.keeps_conversations() {
                prompt
            } else {
                0
            }
        } else {
            cached_tokens(fleet, route, prefix_matched)
        };
        let predicted_wait_ms = if takes {
            0.0
        } else {
            Load::of(e, &none).wait_ms(e.service_ms())
        };
        let tails = (!route.objective.is_none()).then(|| objective::tails(fleet, e, route));
        let engine = route.engine_held.as_ref().and_then(|h| h.share(e.addr));
        CandidateScore {
            addr: e.addr,
            takes,
            reason,
            prefix_matched,
            prefix_source: if engine.is_some() { "engine" } else { "guess" },
            terms,
            score: terms.total(),
            predicted_wait_ms,
            predicted_prefill_ms: e.predicted_prefill_ms(prompt - cached),
            predicted_ttft_p90_ms: tails.map(|t| predicted_wait_ms + t.ttft_ms),
            predicted_tpot_p90_ms: tails.map(|t| t.tpot_ms),
        }
    };
    let mut candidates: Vec<CandidateScore> = fleet.serving(route).map(score).collect();
    candidates.sort_by(|a, b| {
        b.takes
            .cmp(&a.takes)
            .then(b.score.total_cmp(&a.score))
            .then(a.addr.cmp(&b.addr))
    });
    let choice = match decision.outcome {
        Outcome::Go(id) => addr(id),
        Outcome::Wait(_) | Outcome::Delay(..) => decision
            .objective
            .map(|c| c.id)
            .or(decision.reserved.flatten())
            .or(decision.scored)
            .and_then(addr),
        Outcome::Busy | Outcome::Shed => None,
    };
    let waits_for = match decision.outcome {
        Outcome::Wait(id) => addr(id),
        _ => None,
    };
    let spills_from = match decision.patience {
        Some(WaitOrGo::Spill { holder, .. }) => addr(holder),
        _ => None,
    };
    let objective_choice = match (decision.outcome, decision.objective) {
        (Outcome::Shed, _) => Some("shed"),
        _ if decision.reserved.is_some() => Some("reserve"),
        (_, Some(c)) => Some(c.met.as_str()),
        _ => None,
    };
    let more = candidates.len().saturating_sub(MAX_EXPLAINED);
    candidates.truncate(MAX_EXPLAINED);
    Explanation {
        prompt_blocks: blocks,
        session_endpoint,
        choice,
        waits_for,
        spills_from,
        objective: (!route.objective.is_none()).then_some(route.objective),
        objective_choice,
        candidates,
        more,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{pick, Pick};
    use crate::protocol::tests::report;

    #[test]
    fn every_endpoint_of_the_model_is_scored_and_nothing_is_booked() {
        let now = Instant::now();
        let mut ledger = EndpointLedger::default();
        for (id, port, slots) in [("a", 1, 2), ("b", 2, 1), ("c", 3, 2)] {
            let addr = format!("127.0.0.1:{port}");
            ledger.apply_report(report(id, &addr, slots), addr.parse().unwrap(), now);
        }
        let route = Route {
            prefix: vec![11, 12],
            ..Route::default()
        };
        // b holds the prompt, then is full.
        let Pick::Lease(on_b) = pick(
            &mut ledger,
            &Route {
                avoid: Some("127.0.0.1:1".parse().unwrap()),
                subset: Some(vec!["127.0.0.1:2".parse().unwrap()].into()),
                ..route.clone()
            },
            now,
            None,
        ) else {
            panic!("b takes it")
        };
        assert_eq!(on_b.addr.port(), 2);
        let before = ledger.snapshot(now);
        let x = explain(&ledger, &route, now);
        assert_eq!(x.prompt_blocks, 2);
        assert_eq!(x.candidates.len(), 3);
        let b = x.candidates.iter().find(|c| c.addr.port() == 2).unwrap();
        assert!(!b.takes);
        assert_eq!(b.reason, Some("slots-full"));
        assert_eq!(b.prefix_matched, 2);
        assert_eq!(b.terms.prefix_cache, 3.0, "the whole prompt, weight 3");
        assert!(
            x.candidates[..2].iter().all(|c| c.takes),
            "those that take it first"
        );
        let choice = x.choice.unwrap();
        assert!(choice.port() == 1 || choice.port() == 3);
        for c in &x.candidates {
            assert!((c.score - c.terms.total()).abs() < 1e-12);
            // No tokens estimated: the prompt is what its 2 blocks hold
            // (128 tokens), all cached on b; 1 ms per token by default.
            let uncached = if c.addr.port() == 2 { 0.0 } else { 128.0 };
            assert_eq!(c.predicted_prefill_ms, uncached);
        }
        assert_eq!(
            b.predicted_wait_ms, 1_000.0,
            "the default service time, 1 slot"
        );
        let with_tokens = Route {
            tokens: crate::tokens::TokenEstimate {
                prompt: 1_000,
                ..Default::default()
            },
            ..route.clone()
        };
        let x = explain(&ledger, &with_tokens, now);
        let b = x.candidates.iter().find(|c| c.addr.port() == 2).unwrap();
        let other = x.candidates.iter().find(|c| c.addr.port() == 1).unwrap();
        // b holds 2 blocks of 256 bytes: 128 of 1,000 tokens; 1 ms each.
        assert_eq!(b.predicted_prefill_ms, 872.0);
        assert_eq!(
            (other.predicted_prefill_ms, other.predicted_wait_ms),
            (1_000.0, 0.0)
        );
        assert_eq!(
            x.waits_for, None,
            "1,000 + 872 ms on b is later than 1,000 elsewhere"
        );
        assert_eq!(
            format!("{:?}", ledger.snapshot(now)),
            format!("{before:?}"),
            "nothing booked"
        );
        ledger.release(on_b, now);
    }
}
