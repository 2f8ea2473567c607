//! The rules every door admits requests by — API keys, priorities,
//! model names — held so that a config reload swaps them whole
//! ([`crate::reload`]). A request reads them once, when it arrives, and
//! keeps that copy to its end: it never sees half of an old and half of a
//! new config.

use std::sync::{Arc, RwLock};

use flowgate::admission::AdmissionRules;

use crate::auth::ApiKeys;

/// One version of the doors' rules.
#[derive(Debug, Default)]
pub struct DoorRules {
    pub admission: AdmissionRules,
    /// When set, every route but `/health` needs one of these keys.
    pub api_keys: Option<Arc<ApiKeys>>,
    /// Quotas per tenant (keys carry their own).
    pub quotas: flowgate::quota::QuotaRules,
    /// Who is told why their endpoint was chosen.
    pub explain: ExplainScores,
}

/// Who gets the `x-flowgate-scores` answer header (`scheduling.explain`):
/// a key whose grant says `debug: true` may always ask.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExplainScores {
    /// Only requests with such a key that ask (`x-flowgate-debug: scores`).
    #[default]
    Off,
    /// Any request that asks: for a trusted network only.
    Request,
    /// Every inference answer, asked or not.
    Always,
}

impl ExplainScores {
    /// Whether a request that `asked`, sent with `grant`, gets the scores.
    pub fn allows(self, asked: bool, grant: Option<&flowgate::admission::Grant>) -> bool {
        match self {
            ExplainScores::Always => true,
            ExplainScores::Request => asked,
            ExplainScores::Off => asked && grant.is_some_and(|g| g.debug),
        }
    }
}

/// The current [`DoorRules`].
#[derive(Debug, Default)]
pub struct LiveRules(RwLock<Arc<DoorRules>>);

impl LiveRules {
    pub fn new(rules: DoorRules) -> Arc<Self> {
        Arc::new(LiveRules(RwLock::new(Arc::new(rules))))
    }

    /// The rules now (a request keeps this copy).
    pub fn get(&self) -> Arc<DoorRules> {
        // Writers only swap an `Arc`: a poisoned lock still holds a whole one.
        Arc::clone(
            &self
                .0
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Replaces the rules for requests that arrive from now on.
    pub fn set(&self, rules: DoorRules) {
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(rules);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowgate::admission::Grant;

    #[test]
    fn scores_are_told_by_config_or_by_a_keys_grant_only() {
        let grant = |debug| Grant {
            tenant: Arc::from("t"),
            max_priority: None,
            weight: None,
            key_id: Arc::from("k"),
            quota: None,
            debug,
            objective: Default::default(),
        };
        let (plain, debug) = (grant(false), grant(true));
        for (mode, asked, g, want) in [
            (ExplainScores::Off, true, None, false),
            (ExplainScores::Off, true, Some(&plain), false),
            (ExplainScores::Off, true, Some(&debug), true),
            (ExplainScores::Off, false, Some(&debug), false),
            (ExplainScores::Request, true, None, true),
            (ExplainScores::Request, false, None, false),
            (ExplainScores::Always, false, None, true),
        ] {
            assert_eq!(mode.allows(asked, g), want, "{mode:?} asked={asked}");
        }
        assert_eq!(ExplainScores::default(), ExplainScores::Off);
    }
}
