//! The fleet as placement reads it ([`crate::placement`]): every read it
//! needs of the ledger and its endpoints, and nothing that books. What a
//! placement decided is written back only through the ledger's booking
//! calls (`book`, `release_session`).

use std::net::SocketAddr;
use std::time::Instant;

use super::ranking::Rank;
use super::{Endpoint, EndpointId, EndpointLedger, Route, SaturationConfig, SchedulingConfig};

/// An endpoint's turn among equals: lower goes first (a higher static
/// score, then the one re-ranked longest ago: equal endpoints take turns,
/// [`super::ranking`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Turn(Rank);

impl EndpointLedger {
    /// How endpoints are chosen (the configuration).
    pub(crate) fn scheduling(&self) -> &SchedulingConfig {
        &self.scheduling
    }

    /// When an endpoint takes no new work.
    pub(crate) fn saturation(&self) -> &SaturationConfig {
        &self.saturation
    }

    /// The endpoint `id`, if it is known.
    pub(crate) fn endpoint(&self, id: EndpointId) -> Option<&Endpoint> {
        self.endpoints.get(&id)
    }

    /// Every endpoint known, with an agent or lingering without one.
    #[cfg(test)]
    pub(crate) fn endpoints(&self) -> impl Iterator<Item = &Endpoint> + '_ {
        self.endpoints.values()
    }

    /// The endpoint at `addr`, if it is known.
    pub(crate) fn endpoint_at(&self, addr: SocketAddr) -> Option<&Endpoint> {
        self.by_addr
            .get(&addr)
            .and_then(|id| self.endpoints.get(id))
    }

    /// The endpoints of `model` (`None`: all) that may take work by what
    /// they last reported, best static score first, equals in turn
    /// ([`super::ranking`]).
    pub(crate) fn ranked(&self, model: Option<&str>) -> impl Iterator<Item = &Endpoint> + '_ {
        self.ranking
            .ranked(model)
            .filter_map(|r| self.endpoints.get(&r.id))
    }

    /// How many endpoints have an agent that lists `model`, ranked or not.
    pub(crate) fn lane_len(&self, model: Option<&str>) -> usize {
        self.ranking.ranked_len(model) + self.ranking.unranked_len(model)
    }

    /// How many endpoints [`EndpointLedger::ranked`] yields for `model`.
    pub(crate) fn ranked_len(&self, model: Option<&str>) -> usize {
        self.ranking.ranked_len(model)
    }

    /// `id`'s turn among endpoints of equal score; `None` while it is
    /// not ranked (it takes no work).
    pub(crate) fn turn(&self, id: EndpointId) -> Option<Turn> {
        self.ranking.rank_of(id).map(Turn)
    }

    /// The endpoints whose prefix index holds prompt block `hash`.
    pub(crate) fn holders_of(&self, hash: u64) -> &[EndpointId] {
        self.holders.of(hash)
    }

    /// Where `session`'s last turn went, if it is still bound.
    pub(crate) fn session_addr(&self, session: u64, now: Instant) -> Option<SocketAddr> {
        self.sessions.endpoint(session, now)
    }

    /// The endpoints that may serve `route`, busy or not: its subset, or
    /// its model's lane.
    pub(crate) fn serving<'a>(
        &'a self,
        route: &'a Route,
    ) -> impl Iterator<Item = &'a Endpoint> + 'a {
        let subset = route
            .subset
            .iter()
            .flat_map(|s| s.iter())
            .filter_map(|a| self.by_addr.get(a).copied());
        let lane = route
            .subset
            .is_none()
            .then(|| self.ranking.members(route.model.as_deref()))
            .into_iter()
            .flatten();
        subset
            .chain(lane)
            .filter_map(|id| self.endpoints.get(&id))
            .filter(|e| e.fits(route))
    }
}

impl Endpoint {
    /// Leading blocks of the route's prompt it holds, in the units of
    /// the route's `prefix`: as its engine's events say, when they do
    /// (the share of the prompt's token blocks it holds), else as its
    /// prefix index guesses.
    pub(crate) fn prefix_matched(&self, route: &Route) -> usize {
        match route.engine_held.as_ref().and_then(|h| h.share(self.addr)) {
            Some(share) => (share * route.prefix.len() as f64).round() as usize,
            None => self.prefix.matched(&route.prefix),
        }
    }

    /// Busy slots no request of this balancer explains, as last reported.
    pub(crate) fn foreign_busy(&self) -> u32 {
        self.foreign_busy
    }

    /// Requests waiting in its engine's own queue, as last reported.
    pub(crate) fn engine_waiting(&self) -> u32 {
        self.agent.as_ref().map_or(0, |a| a.report.requests_waiting)
    }

    /// How long a request holds a slot here, learned from its answers.
    pub(crate) fn service_ms(&self) -> f64 {
        self.cost.service_ms.ms()
    }

    /// Whether a conversation whose last turn ran here finds it cached
    /// here: unless its engine's answers say it keeps no cache
    /// ([`super::CacheTruth::keeps_nothing`]), and then nothing here is
    /// worth waiting for.
    pub(crate) fn keeps_conversations(&self) -> bool {
        !self.cache.keeps_nothing()
    }

    /// Predicted 90th-percentile time to the first token of a request that
    /// starts here now and prefills `uncached` prompt tokens
    /// ([`super::CostModel::ttft_tail_ms`]).
    pub(crate) fn ttft_tail_ms(&self, uncached: u64) -> f64 {
        self.cost.ttft_tail_ms(uncached)
    }

    /// Predicted 90th-percentile time per output token here.
    pub(crate) fn tpot_tail_ms(&self) -> f64 {
        self.cost.tpot_tail_ms()
    }

    /// Whether it runs nothing: no request of this balancer, no foreign
    /// work.
    pub(crate) fn idle(&self) -> bool {
        self.in_flight == 0 && self.foreign_busy == 0
    }

    /// Predicted time to load a LoRA adapter here.
    pub(crate) fn predicted_adapter_load_ms(&self) -> f64 {
        self.cost.adapter_load_ms.ms()
    }

    /// Predicted prefill of `uncached` prompt tokens here.
    pub(crate) fn predicted_prefill_ms(&self, uncached: u64) -> f64 {
        uncached as f64 * self.cost.prefill_ms_per_token.ms()
    }
}
