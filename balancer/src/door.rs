//! The one way in, for every door (the proxy and EPP; the async path's
//! dispatcher comes in through the proxy): who calls, the request's facts,
//! where its conversation was served last, its quotas — in that order,
//! each refusal the same answer at every door — and then a slot from the
//! gate, held with everything else the request holds by one [`Served`]
//! guard that settles its end:
//!
//! ```text
//! authenticate → facts → (the door's own steps: local routes, the body's
//! rename, slot-less routes) → enter → the gate's wait → Served::finish
//! ```
//!
//! The doors differ only in how they read a request (Pingora's session,
//! Envoy's ext_proc messages), how they wait (the proxy parks a queued
//! request outside Pingora) and how they answer.

use std::sync::Arc;

use flowgate::admission::{Caller, FlowHeaders, Grant, RequestFacts};
use flowgate::models::Fallback;
use flowgate::{Reject, RequestMeta};

use crate::gate::{FleetGate, Served};
use crate::quotas::Quotas;
use crate::reply::Refusal;
use crate::rules::{DoorRules, LiveRules};
use crate::session_store::SessionStore;

/// What every door lets requests in by.
pub struct Door {
    pub gate: Arc<FleetGate>,
    /// API keys and how a request's facts are read, reloaded on SIGHUP;
    /// a request keeps the rules it arrived under.
    pub rules: Arc<LiveRules>,
    /// Quotas per tenant and key.
    pub quotas: Arc<Quotas>,
    /// Session bindings shared with the other balancers, when configured.
    pub session_store: Option<Arc<SessionStore>>,
}

/// A request let in.
pub struct Entry {
    /// What it holds (its quotas' reservation; its slot, once it has
    /// one), settled when it ends.
    pub served: Served,
    /// Its quotas' state, told on every answer (`x-ratelimit-*`).
    pub rate_headers: Vec<(&'static str, String)>,
    /// What the session store records where it went, once served.
    pub store_key: Option<u64>,
}

impl Door {
    /// Who calls, when API keys are on: the key's grant, or 401 without a
    /// valid one (its `authorization` header, read only then). `Ok(None)`:
    /// keys are off.
    pub fn authenticate<'h>(
        rules: &DoorRules,
        authorization: impl FnOnce() -> Option<&'h [u8]>,
    ) -> Result<Option<Grant>, Refusal> {
        match &rules.api_keys {
            Some(keys) => Ok(Some(keys.authenticate(authorization())?.clone())),
            None => Ok(None),
        }
    }

    /// The request's facts (model, flow, tokens, route) under `rules`.
    pub fn facts(
        &self,
        rules: &DoorRules,
        headers: FlowHeaders<'_>,
        body: Option<&[u8]>,
        caller: Caller<'_>,
    ) -> Result<RequestFacts, Refusal> {
        Ok((rules.admission).inference(headers, body, caller, &*self.gate)?)
    }

    /// Lets in a request of these `facts`, sent with `grant` and `body`:
    /// where another balancer served its conversation last becomes its
    /// session here (`facts.meta.route`), what the engines that publish
    /// their caches hold of its prompt is matched, then its quotas reserve
    /// its estimate (429 when one is spent).
    pub async fn enter(
        &self,
        rules: &DoorRules,
        facts: &mut RequestFacts,
        grant: Option<&Grant>,
        body: Option<&[u8]>,
    ) -> Result<Entry, Refusal> {
        let store_key = match &self.session_store {
            // Boxed: a Redis round trip's future, which a request's future
            // (that Pingora boxes and moves whole) would otherwise carry
            // with no store configured too.
            Some(store) => {
                let route = &mut facts.meta.route;
                Box::pin(store.follow(facts.turn.take(), &self.gate, route)).await
            }
            None => None,
        };
        // Only where an engine with events serves the model (a read of an
        // empty map for every other request).
        let model = facts.meta.route.model.as_deref();
        let source = model.and_then(|m| self.gate.blocks.tokenizer_for(m));
        if let (Some(body), Some(model), Some(source)) = (body, model, source) {
            // Boxed as the store's round trip is: an engine's `/tokenize`.
            let held = Box::pin(self.gate.engine_held(model, body, source)).await;
            facts.meta.route.engine_held = held;
        }
        let tenant = &facts.meta.flow.fairness_id;
        let key = grant.map(|g| &g.key_id);
        let mut served = Served::new(tenant, key, facts.tokens, facts.prompt_bytes);
        let quota = self
            .quotas
            .admit(&rules.quotas, tenant, grant, facts.tokens);
        let rate_headers = match quota.await? {
            Some((reserved, headers)) => {
                served.reserved(reserved);
                headers
            }
            None => Vec::new(),
        };
        Ok(Entry {
            served,
            rate_headers,
            store_key,
        })
    }

    /// The fallback chain of the model `request` goes to, if it has one.
    pub fn fallback<'r>(rules: &'r DoorRules, request: &RequestMeta) -> Option<&'r Fallback> {
        rules
            .admission
            .models
            .fallback(request.route.model.as_deref()?)
    }

    /// The answer to a request for `model` that the gate turned away.
    pub fn turned_away(&self, rules: &DoorRules, reject: Reject, model: &str) -> Refusal {
        Refusal::from_reject(reject, model, || {
            self.gate.model_names(&rules.admission.models)
        })
    }
}
