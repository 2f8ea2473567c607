//! Why an endpoint: every endpoint that may serve a request, with each
//! scorer's part of its score, and where the request would go now. Read
//! only: nothing is booked, no tie-breaker is advanced, no session moved.
//! For the `x-flowgate-debug: scores` answer header and the management
//! port's route probe.

use std::net::SocketAddr;
use std::time::Instant;

use serde::Serialize;

use super::{Endpoint, EndpointLedger, Route};
use crate::scorer::{Candidate, ScoreTerms};

/// Candidates listed at most (the best ones); the rest are counted.
pub const MAX_EXPLAINED: usize = 16;

/// The scoring of one request against the fleet.
#[derive(Debug, Clone, Serialize)]
pub struct Explanation {
    /// Leading prompt blocks hashed for prefix affinity.
    pub prompt_blocks: usize,
    /// The endpoint the request's session was last served by, if any.
    pub session_endpoint: Option<SocketAddr>,
    /// Where it would go now: its session's endpoint when that can take
    /// it, else the best score that can (equal scores take turns, so
    /// another of them may be chosen); `None`: it would wait.
    pub choice: Option<SocketAddr>,
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
    /// Leading prompt blocks its prefix index holds.
    pub prefix_matched: usize,
    /// Each scorer's weighted part, and their sum.
    pub terms: ScoreTerms,
    pub score: f64,
}

impl EndpointLedger {
    /// How `route` is scored against the fleet at `now` (see the module
    /// docs).
    pub(crate) fn explain(&self, route: &Route, now: Instant) -> Explanation {
        let config = self.saturation;
        let weights = self.scheduling.scorers;
        let blocks = route.prefix.len();
        let score = |e: &Endpoint| {
            let prefix_matched = e.prefix.matched(&route.prefix);
            let agent = e.agent.as_ref();
            let terms = weights.terms(&Candidate {
                prefix_matched,
                prefix_blocks: blocks,
                free_slots: e.free_slots(),
                slots_total: e.slots_total(),
                kv_cache_usage: agent.and_then(|a| a.report.kv_cache_usage),
                requests_waiting: agent.map_or(0, |a| a.report.requests_waiting),
                queue_depth_threshold: config.queue_depth_threshold,
            });
            let takes = e.takes(route, now, &config);
            let reason = if takes {
                None
            } else if !e.eligible(now) {
                Some("ineligible")
            } else {
                Some(
                    e.saturation(now, &config)
                        .map_or("token-budget", |s| s.as_str()),
                )
            };
            CandidateScore {
                addr: e.addr,
                takes,
                reason,
                prefix_matched,
                terms,
                score: terms.total(),
            }
        };
        let mut candidates: Vec<CandidateScore> = self.serving(route).map(score).collect();
        candidates.sort_by(|a, b| {
            b.takes
                .cmp(&a.takes)
                .then(b.score.total_cmp(&a.score))
                .then(a.addr.cmp(&b.addr))
        });
        let session_endpoint = route
            .session
            .and_then(|s| self.sessions.endpoint(s, now))
            .filter(|addr| candidates.iter().any(|c| c.addr == *addr));
        let choice = session_endpoint
            .filter(|addr| candidates.iter().any(|c| c.addr == *addr && c.takes))
            .or_else(|| candidates.first().filter(|c| c.takes).map(|c| c.addr));
        let more = candidates.len().saturating_sub(MAX_EXPLAINED);
        candidates.truncate(MAX_EXPLAINED);
        Explanation {
            prompt_blocks: blocks,
            session_endpoint,
            choice,
            candidates,
            more,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Pick;
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
        let Pick::Lease(on_b) = ledger.pick(
            &Route {
                avoid: Some("127.0.0.1:1".parse().unwrap()),
                subset: Some(vec!["127.0.0.1:2".parse().unwrap()].into()),
                ..route.clone()
            },
            now,
            false,
        ) else {
            panic!("b takes it")
        };
        assert_eq!(on_b.addr.port(), 2);
        let before = ledger.snapshot(now);
        let x = ledger.explain(&route, now);
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
        }
        assert_eq!(
            format!("{:?}", ledger.snapshot(now)),
            format!("{before:?}"),
            "nothing booked"
        );
        ledger.release(on_b);
    }
}
