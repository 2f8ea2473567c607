//! Which models the fleet serves, as its agents report them: the names a
//! request may ask for, the ones that may become metric labels, the ones
//! served now.

use std::sync::Arc;
use std::time::Instant;

use super::{Endpoint, EndpointLedger};

impl EndpointLedger {
    /// Whether an eligible endpoint (it may be busy) serves `model`.
    pub(crate) fn model_live(&self, model: &str, now: Instant) -> bool {
        self.live_serving(model, now).next().is_some()
    }

    /// The eligible endpoints (busy or not) that serve `model`.
    pub(super) fn live_serving<'a>(
        &'a self,
        model: &'a str,
        now: Instant,
    ) -> impl Iterator<Item = &'a Endpoint> + 'a {
        (self.ranking.members(Some(model)))
            .filter_map(|id| self.endpoints.get(&id))
            .filter(move |e| e.eligible(now))
    }

    /// Whether requests for `model` are accepted: it is served or was
    /// lately, any endpoint will do (`None`, or an agent listing no models),
    /// or no agent is registered at all (the fleet may be scaling up from
    /// zero, so requests wait for it).
    pub(crate) fn model_known(&self, model: Option<&str>, now: Instant) -> bool {
        let Some(m) = model else { return true };
        if self.ranking.is_empty() {
            return true;
        }
        self.ranking.members(Some(m)).next().is_some()
            || self
                .models
                .get(m)
                .is_some_and(|seen| now.saturating_duration_since(*seen) < super::MODEL_MEMORY)
    }

    /// Every model name an agent reported (names are never forgotten: at
    /// most [`super::MAX_MODEL_NAMES`] are kept).
    pub(crate) fn reported_models(&self) -> impl ExactSizeIterator<Item = &Arc<str>> {
        self.models.keys()
    }

    /// Every model name (served models and aliases) the agents that are
    /// not stale report, sorted, each once.
    pub(crate) fn served_models(&self, now: Instant) -> Vec<String> {
        let mut models: Vec<String> = self
            .endpoints
            .values()
            .filter_map(|e| e.agent.as_ref())
            .filter(|a| now < Endpoint::stale_deadline(a))
            .flat_map(|a| a.report.models.iter().cloned())
            .collect();
        models.sort_unstable();
        models.dedup();
        models
    }
}
