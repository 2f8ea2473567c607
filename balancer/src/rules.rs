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
