//! Which models the fleet serves, as its agents report them: the names a
//! request may ask for, the ones that may become metric labels, the ones
//! served now.

use std::sync::Arc;
use std::time::Instant;

use super::{Endpoint, EndpointLedger, Route};
use crate::objective::{Hardest, Reference};

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

/// Models whose hardest request with a TTFT objective the ledger
/// remembers at most ([`EndpointLedger::note_objective`]): while no agent
/// is registered any model name is accepted, so the names are bounded here.
const MAX_REFERENCES: usize = 256;

impl EndpointLedger {
    /// A request with a TTFT objective came for `route`'s model
    /// (`placement::reserve`): it becomes the model's reference if it is the
    /// hardest lately.
    pub(crate) fn note_objective(&mut self, route: &Route, now: Instant) {
        let Some(ttft_ms) = route.objective.ttft_ms else {
            return;
        };
        let seen = Reference {
            tokens: route.tokens.prompt,
            ttft_ms,
        };
        let references = &mut self.objective_references;
        if let Some(hardest) = references.get_mut(&route.model) {
            hardest.note(seen, now);
            return;
        }
        if references.len() >= MAX_REFERENCES {
            references.retain(|_, h| h.get(now).is_some());
        }
        if references.len() < MAX_REFERENCES {
            let mut hardest = Hardest::new(now);
            hardest.note(seen, now);
            references.insert(route.model.clone(), hardest);
        }
    }

    /// The hardest request with a TTFT objective for `route`'s model in the
    /// last 5 to 10 s ([`Hardest`]), if any (while no request
    /// has had one, the empty map answers without hashing the model).
    pub(crate) fn objective_reference(&self, route: &Route, now: Instant) -> Option<Reference> {
        self.objective_references
            .get(&route.model)
            .and_then(|h| h.get(now))
    }
}
