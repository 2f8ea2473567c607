//! Scheduling: a request names a [`Route`] (its model and prompt prefix).
//! Only endpoints that serve the model, are eligible (ready, not draining,
//! not stale, circuit closed) and are not saturated are candidates; the
//! weighted scorers of [`crate::scorer`] pick among them, ties at random.
//! The chosen endpoint remembers the request's prompt blocks
//! ([`crate::prefix`]).
//!

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{BreakerConfig, Endpoint, EndpointId, EndpointLedger, Lease};
use crate::prefix::PrefixConfig;
use crate::scorer::{Candidate, ScorerWeights};
use crate::tokens::TokenEstimate;

/// Where a request may go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Route {
    /// The requested model; `None`: any endpoint.
    pub model: Option<Arc<str>>,
    /// Chained hashes of the prompt's leading blocks ([`crate::prefix`]).
    pub prefix: Vec<u64>,
    /// Not this endpoint (a retry after it failed).
    pub avoid: Option<SocketAddr>,
    /// Only these endpoints, sorted (EPP mode's subset hint); `None`: any.
    pub subset: Option<Arc<[SocketAddr]>>,
    /// What the request will cost, estimated: endpoints whose token budget
    /// it does not fit in are saturated for it.
    pub tokens: TokenEstimate,
}

impl Route {
    /// Whether two routes may go to the same endpoints.
    pub(crate) fn same_targets(&self, other: &Route) -> bool {
        self.model == other.model && self.avoid == other.avoid && self.subset == other.subset
    }
}

/// How endpoints are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulingConfig {
    pub scorers: ScorerWeights,
    pub prefix: PrefixConfig,
    pub breaker: BreakerConfig,
    /// How long a queued request may wait for a saturated endpoint that
    /// holds most of its prompt, rather than go to a free one that does not
    /// (see [`EndpointLedger::pick`]); zero: never.
    pub affinity_hold: Duration,
    /// Seed of the tie-breaking random source.
    pub seed: u64,
}

impl Default for SchedulingConfig {
    fn default() -> Self {
        SchedulingConfig {
            scorers: ScorerWeights::default(),
            prefix: PrefixConfig::default(),
            breaker: BreakerConfig::default(),
            affinity_hold: Duration::from_millis(200),
            seed: 0x5eed,
        }
    }
}

/// What [`EndpointLedger::choose`] found for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Choice {
    Endpoint(EndpointId),
    /// Better wait: a saturated endpoint holds most of the prompt.
    Hold,
    /// No endpoint can take it now.
    Busy,
}

/// What [`EndpointLedger::pick`] found for a request.
#[derive(Debug)]
pub(crate) enum Pick {
    /// A slot on the chosen endpoint.
    Lease(Lease),
    /// Better wait: a saturated endpoint holds most of the prompt.
    Hold,
    /// No endpoint can take it now.
    Busy,
}

impl Endpoint {
    /// Serves the route's model, is not the endpoint it avoids, and is in
    /// its subset if it has one.
    pub(super) fn fits(&self, route: &Route) -> bool {
        Some(self.addr) != route.avoid
            && route
                .subset
                .as_ref()
                .is_none_or(|s| s.binary_search(&self.addr).is_ok())
            && self.serves(route.model.as_deref())
    }
}

impl EndpointLedger {
    /// The best endpoint for `route` among those that serve its model and
    /// are eligible and not saturated (see the module docs); takes no slot
    /// (that is the ledger's: [`EndpointLedger::pick`]). With `may_hold`, a
    /// request whose prompt is better cached on a saturated endpoint is
    /// told to wait for it ([`Choice::Hold`]): when that endpoint holds at
    /// least half of the request's prompt blocks and more than any
    /// candidate does. Waiting a little for the server that already has the
    /// prompt beats prefilling it again elsewhere; the caller bounds the
    /// wait.
    pub(super) fn choose(&mut self, route: &Route, now: Instant, may_hold: bool) -> Choice {
        let config = self.saturation;
        self.candidates.clear();
        self.candidates.extend(
            self.endpoints
                .values()
                .filter(|e| {
                    e.fits(route)
                        && e.available(now, &config)
                        && e.fits_token_budget(&route.tokens, &config)
                })
                .map(|e| e.id),
        );
        if self.candidates.is_empty() {
            return Choice::Busy;
        }
        if may_hold && self.better_cached_elsewhere(route, now) {
            return Choice::Hold;
        }
        Choice::Endpoint(match self.candidates.len() {
            // The usual case at saturation: the one endpoint a slot freed on.
            1 => self.candidates[0],
            _ => self.best_candidate(route),
        })
    }

    /// Whether an eligible but saturated endpoint that serves the route
    /// holds at least half of its prompt blocks, and more than every
    /// candidate (filled in by `pick`). Busy endpoints are looked at
    /// first: with none, nothing more is matched.
    fn better_cached_elsewhere(&self, route: &Route, now: Instant) -> bool {
        let blocks = route.prefix.len();
        if self.scheduling.scorers.prefix_cache <= 0.0 || blocks == 0 {
            return false;
        }
        let config = self.saturation;
        let busy = self
            .endpoints
            .values()
            .filter(|e| {
                e.fits(route)
                    && e.eligible(now)
                    && !(e.available(now, &config) && e.fits_token_budget(&route.tokens, &config))
            })
            .map(|e| e.prefix.matched(&route.prefix))
            .max()
            .unwrap_or(0);
        if busy * 2 < blocks {
            return false;
        }
        let free = self
            .candidates
            .iter()
            .map(|id| self.endpoints[id].prefix.matched(&route.prefix))
            .max()
            .unwrap_or(0);
        busy > free
    }

    /// The highest-scoring of several candidates, ties at random.
    fn best_candidate(&mut self, route: &Route) -> EndpointId {
        let weights = self.scheduling.scorers;
        let blocks = route.prefix.len();
        let score_prefix = weights.prefix_cache > 0.0 && blocks > 0;
        let mut best_score = f64::NEG_INFINITY;
        self.best.clear();
        for id in &self.candidates {
            let e = &self.endpoints[id];
            let report = &e
                .agent
                .as_ref()
                .expect("eligible endpoints have an agent")
                .report;
            let score = weights.score(&Candidate {
                prefix_matched: if score_prefix {
                    e.prefix.matched(&route.prefix)
                } else {
                    0
                },
                prefix_blocks: blocks,
                free_slots: e.free_slots(),
                slots_total: e.slots_total(),
                kv_cache_usage: report.kv_cache_usage,
                requests_waiting: report.requests_waiting,
                queue_depth_threshold: self.saturation.queue_depth_threshold,
            });
            // Scores are sums of a few ratios: closer than this is a tie.
            const TIE: f64 = 1e-9;
            if score > best_score + TIE {
                best_score = score;
                self.best.clear();
                self.best.push(e.id);
            } else if score >= best_score - TIE {
                self.best.push(e.id);
            }
        }
        match self.best.len() {
            1 => self.best[0],
            n => {
                // HashMap order varies: sort so the seed alone decides.
                self.best.sort_unstable();
                self.best[self.ties.below(n)]
            }
        }
    }

    /// A live endpoint for a request that takes no slot on the engine
    /// (tokenize, count tokens): one that serves the route's model and is
    /// eligible, saturated or not, the least loaded by the balancer's own
    /// count (then the oldest registered). Takes nothing.
    pub(crate) fn live(&self, route: &Route, now: Instant) -> Option<SocketAddr> {
        self.endpoints
            .values()
            .filter(|e| e.fits(route) && e.eligible(now))
            .min_by_key(|e| (e.in_flight, e.id))
            .map(|e| e.addr)
    }
}
