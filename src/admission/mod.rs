//! What a request is, gathered once at the edge.
//!
//! Every front door (the proxy, EPP mode, the async API and the Batch API)
//! hands this its headers, body and caller and gets back the request's
//! facts — model, flow key, TTL, size, route — or a refusal. The doors only
//! read bytes and write answers; the rules live here, once, so a new header
//! rule is one edit and holds for every door.
//!
//! - [`headers`]: the header names and their raw values.
//! - [`priority`]: headers + model → tenant, priority, TTL.
//! - [`caller`]: API key grants and the async dispatcher's standing.
//! - [`body`]: model, stream flag and prompt prefix of a JSON body.
//! - [`crate::models`]: the served model a requested name goes to.

pub mod body;
pub mod caller;
pub mod headers;
pub mod priority;

use std::collections::HashMap;
use std::time::Duration;

pub use body::{body_facts, form_facts, renamed, with_model, BodyFacts};
pub use caller::{Caller, Grant};
pub use headers::{
    FlowHeaders, DEBUG_HEADER, DELIVERED_SESSION_HEADER, FAIRNESS_ID_HEADER, OBJECTIVE_HEADER,
    PRIORITY_HEADER, TTL_HEADER,
};
pub use priority::{BadHeader, PriorityRules};

use crate::dispatcher::RequestMeta;
use crate::flow::FlowKey;
use crate::models::{ModelRules, Resolved};
use crate::objective::{
    self, Objective, ObjectiveDefaults, LLMD_TPOT_HEADER, LLMD_TTFT_HEADER, TPOT_HEADER,
    TTFT_HEADER,
};
use crate::prefix::PrefixConfig;
use crate::session::SessionRules;
use crate::tokens::TokenEstimate;
use crate::turn::TurnKeys;

/// What admission needs to know of the fleet: which model names are
/// served, and what the engines taught about tokens.
pub trait FleetView {
    /// Whether an agent reports serving `model` (lately).
    fn is_served(&self, model: &str) -> bool;
    /// A new draw for a weighted rewrite (a counter will do).
    fn draw(&self) -> u64;
    /// Bytes of prompt text per token for `model`, as learned
    /// ([`crate::tokens::TokenRatios`]).
    fn bytes_per_token(&self, model: Option<&str>) -> f64;
}

/// Why a request is refused before it reaches flow control (each a 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The body is not one JSON object.
    #[error("{0}")]
    BadBody(String),
    /// A `multipart/form-data` body (the audio routes) does not parse.
    #[error("{0}")]
    BadForm(String),
    /// A flow-control header is malformed.
    #[error(transparent)]
    BadHeader(#[from] BadHeader),
}

/// An inference request's facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFacts {
    /// The requested model (empty when the body names none).
    pub model: String,
    /// The model it goes to (`meta.route.model`) and how it was chosen.
    pub resolved: Resolved,
    /// `"stream": true`.
    pub stream: bool,
    /// What it will cost in tokens, estimated ([`crate::tokens`]).
    pub tokens: TokenEstimate,
    /// The prompt text's length, to learn from the answer's usage.
    pub prompt_bytes: u64,
    /// What flow control and the scheduler need.
    pub meta: RequestMeta,
    /// A request without a session: its conversation named by its
    /// prompts, scoped to its tenant ([`crate::turn`]); `None` with a
    /// session, with sessions off, or for a prompt too short to follow.
    pub turn: Option<TurnKeys>,
}

/// The operator's rules every door admits requests by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionRules {
    pub priorities: PriorityRules,
    pub prefix: PrefixConfig,
    pub models: ModelRules,
    /// Output tokens assumed for a request that names no bound.
    pub default_output_tokens: u64,
    /// Token-fairness weights by fairness id (1 when not listed); an API
    /// key's own weight wins.
    pub weights: HashMap<String, u32>,
    /// Which session keys name a request's conversation.
    pub sessions: SessionRules,
    /// Latency objectives of requests that name none.
    pub objectives: ObjectiveDefaults,
}

impl Default for AdmissionRules {
    fn default() -> Self {
        AdmissionRules {
            priorities: PriorityRules::default(),
            prefix: PrefixConfig::default(),
            models: ModelRules::default(),
            default_output_tokens: crate::tokens::DEFAULT_OUTPUT_TOKENS,
            weights: HashMap::new(),
            sessions: SessionRules::default(),
            objectives: ObjectiveDefaults::default(),
        }
    }
}

impl AdmissionRules {
    /// The facts of an inference request. `body` is `None` for a request
    /// that has none (EPP mode's headers-only requests): no model named.
    /// The model it goes to follows the [`ModelRules`].
    pub fn inference(
        &self,
        headers: FlowHeaders<'_>,
        body: Option<&[u8]>,
        caller: Caller<'_>,
        fleet: &dyn FleetView,
    ) -> Result<RequestFacts, Refused> {
        let mut facts = match (body, headers.form()) {
            (Some(body), Some(form)) => {
                form_facts(form, body, &self.prefix).map_err(Refused::BadForm)?
            }
            (Some(body), None) => body_facts(body, &self.prefix).map_err(Refused::BadBody)?,
            (None, _) => BodyFacts::default(),
        };
        let (flow, ttl) = self.flow(headers, &facts.model, caller)?;
        let weight = self.weight(&flow, caller);
        facts.route.objective = self.objective(headers, &facts.model, caller)?;
        let resolved = self
            .models
            .resolve(&facts.model, fleet.draw(), |m| fleet.is_served(m));
        facts.route.model.clone_from(&resolved.model);
        let per_token = fleet.bytes_per_token(resolved.model.as_deref());
        let tokens = TokenEstimate {
            prompt: crate::tokens::prompt_tokens(facts.prompt_bytes, per_token),
            output: facts.output_bound.unwrap_or(self.default_output_tokens),
            output_asked: facts.output_bound.is_some(),
        };
        facts.route.tokens = tokens;
        facts.route.session = match caller {
            // A queued request: its session was read when it was submitted.
            Caller::AsyncDispatcher { .. } => headers
                .delivered_session
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
                .or_else(|| self.session_of(&facts, headers, &flow.fairness_id)),
            _ => self.session_of(&facts, headers, &flow.fairness_id),
        };
        let turn = match facts.route.session {
            None if !self.sessions.order.is_empty() => {
                facts.turn.map(|t| t.scoped(&flow.fairness_id))
            }
            _ => None,
        };
        Ok(RequestFacts {
            turn,
            model: facts.model,
            resolved,
            tokens,
            prompt_bytes: facts.prompt_bytes,
            stream: facts.stream,
            meta: RequestMeta {
                flow,
                bytes: body.map_or(0, |b| b.len() as u64),
                ttl,
                route: facts.route,
                weight,
            },
        })
    }

    /// The session of a request of `tenant` with these body facts and
    /// headers (hashed and scoped), if it names one.
    pub fn session_of(
        &self,
        body: &BodyFacts,
        headers: FlowHeaders<'_>,
        tenant: &str,
    ) -> Option<u64> {
        let mut keys = body.sessions;
        keys.merge(&headers.sessions);
        self.sessions.session(&keys, tenant)
    }

    /// The flow and TTL of a request for `model` from `caller`: the
    /// headers' asks, then the caller's standing (an API key's tenant and
    /// ceiling, the async dispatcher's band), which always wins.
    pub fn flow(
        &self,
        headers: FlowHeaders<'_>,
        model: &str,
        caller: Caller<'_>,
    ) -> Result<(FlowKey, Option<Duration>), BadHeader> {
        let (asked, ttl) = self.priorities.classify(headers, model)?;
        let flow = match caller {
            Caller::Anonymous => asked,
            Caller::Key(grant) => FlowKey::new(
                std::sync::Arc::clone(&grant.tenant),
                grant.priority(asked.priority),
            ),
            Caller::AsyncDispatcher { band } => FlowKey::new(asked.fairness_id, band),
        };
        Ok((flow, ttl))
    }

    /// A request's latency objective: its headers' (ours, else llm-d's
    /// names), then its API key's, its named objective's and its model's
    /// defaults, part by part ([`ObjectiveDefaults::resolve`]).
    pub fn objective(
        &self,
        headers: FlowHeaders<'_>,
        model: &str,
        caller: Caller<'_>,
    ) -> Result<Objective, BadHeader> {
        let part = |ours: Option<&[u8]>,
                    ours_name: &'static str,
                    theirs: Option<&[u8]>,
                    theirs_name: &'static str|
         -> Result<Option<u32>, BadHeader> {
            let (header, value) = match (ours, theirs) {
                (Some(v), _) => (ours_name, v),
                (None, Some(v)) => (theirs_name, v),
                (None, None) => return Ok(None),
            };
            objective::parse_ms(value)
                .map(Some)
                .map_err(|reason| BadHeader { header, reason })
        };
        let asked = Objective {
            ttft_ms: part(
                headers.slo_ttft,
                TTFT_HEADER,
                headers.llmd_slo_ttft,
                LLMD_TTFT_HEADER,
            )?,
            tpot_ms: part(
                headers.slo_tpot,
                TPOT_HEADER,
                headers.llmd_slo_tpot,
                LLMD_TPOT_HEADER,
            )?,
        };
        let key = match caller {
            Caller::Key(grant) => grant.objective,
            _ => Objective::default(),
        };
        let named = headers
            .objective
            .and_then(|v| std::str::from_utf8(v).ok())
            .map(str::trim);
        Ok(self.objectives.resolve(asked, key, named, model))
    }

    /// The share of a request's tenant under token fairness: its API
    /// key's weight, else the configured weight of its fairness id, else 1.
    pub fn weight(&self, flow: &FlowKey, caller: Caller<'_>) -> u32 {
        match caller {
            Caller::Key(Grant {
                weight: Some(w), ..
            }) => *w,
            _ => self.weights.get(&*flow.fairness_id).copied().unwrap_or(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;
    use std::sync::Arc;

    /// A fleet that serves `m`.
    struct Fleet;

    impl FleetView for Fleet {
        fn is_served(&self, model: &str) -> bool {
            model == "m"
        }
        fn draw(&self) -> u64 {
            0
        }
        fn bytes_per_token(&self, model: Option<&str>) -> f64 {
            if model == Some("m") {
                2.0
            } else {
                4.0
            }
        }
    }

    /// The facts of an anonymous request with `body` and no headers.
    fn anonymous_facts(r: &AdmissionRules, body: &[u8]) -> Result<RequestFacts, Refused> {
        r.inference(
            FlowHeaders::default(),
            Some(body),
            Caller::Anonymous,
            &Fleet,
        )
    }

    fn rules() -> AdmissionRules {
        AdmissionRules {
            priorities: PriorityRules {
                default_priority: 0,
                objectives: HashMap::from([("chat".into(), 10)]),
                models: HashMap::new(),
                allow_client_priority: true,
            },
            prefix: PrefixConfig::default(),
            models: ModelRules::builder()
                .alias("gpt-4o-mini", "m")
                .unwrap()
                .build()
                .unwrap(),
            weights: HashMap::new(),
            default_output_tokens: 100,
            sessions: SessionRules::default(),
            objectives: ObjectiveDefaults::default(),
        }
    }

    #[test]
    fn every_request_gets_a_token_estimate_in_its_models_ratio() {
        let r = rules();
        let estimate = |body: &[u8]| anonymous_facts(&r, body).unwrap().tokens;
        let prompt = "x".repeat(400);
        let chat = format!(
            r#"{{"model":"gpt-4o-mini","max_tokens":32,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
        );
        // "user" + separators + 400 bytes at 2 bytes per token (model m).
        assert_eq!(estimate(chat.as_bytes()).prompt, 203);
        assert_eq!(estimate(chat.as_bytes()).output, 32);
        let responses = format!(r#"{{"model":"other","input":"{prompt}","max_output_tokens":-3}}"#);
        let e = estimate(responses.as_bytes());
        assert_eq!(
            (e.prompt, e.output),
            (100, 100),
            "4 bytes per token; a bad bound: the default"
        );
        let newer = br#"{"messages":[],"max_completion_tokens":7}"#;
        assert_eq!(estimate(newer).output, 7);
    }

    #[test]
    fn the_model_rules_place_the_request() {
        let r = rules();
        let f = anonymous_facts(&r, br#"{"model":"gpt-4o-mini"}"#).unwrap();
        assert_eq!(
            f.model, "gpt-4o-mini",
            "the access log keeps what was asked"
        );
        assert_eq!(f.meta.route.model.as_deref(), Some("m"));
        assert_eq!(f.resolved.rewritten_name(&f.model), Some("m"));
    }

    fn headers<'a>(fairness: &'a [u8], objective: &'a [u8]) -> FlowHeaders<'a> {
        FlowHeaders {
            fairness_id: Some(fairness),
            objective: Some(objective),
            ..FlowHeaders::default()
        }
    }

    #[test]
    fn a_key_beats_the_headers_and_the_dispatcher_keeps_its_band() {
        let r = rules();
        let body = br#"{"model":"m","messages":[]}"#;
        let h = headers(b"someone-else", b"chat");
        let anonymous = r
            .inference(h, Some(body), Caller::Anonymous, &Fleet)
            .unwrap();
        assert_eq!(&*anonymous.meta.flow.fairness_id, "someone-else");
        assert_eq!(anonymous.meta.flow.priority, 10);
        assert_eq!(anonymous.meta.bytes, body.len() as u64);
        assert_eq!(anonymous.model, "m");

        let grant = Grant {
            tenant: Arc::from("alpha"),
            max_priority: Some(3),
            weight: None,
            key_id: Arc::from("k"),
            quota: None,
            debug: false,
            objective: Objective::default(),
        };
        let keyed = r
            .inference(h, Some(body), Caller::Key(&grant), &Fleet)
            .unwrap();
        assert_eq!(&*keyed.meta.flow.fairness_id, "alpha");
        assert_eq!(keyed.meta.flow.priority, 3, "capped at the key's ceiling");

        let delivered = r
            .inference(h, Some(body), Caller::AsyncDispatcher { band: -5 }, &Fleet)
            .unwrap();
        assert_eq!(&*delivered.meta.flow.fairness_id, "someone-else");
        assert_eq!(delivered.meta.flow.priority, -5);
    }

    #[test]
    fn refusals_name_what_was_wrong() {
        let r = rules();
        assert!(matches!(
            anonymous_facts(&r, b"[]"),
            Err(Refused::BadBody(_))
        ));
        let bad = headers(b"has space", b"chat");
        let grant = Grant {
            tenant: Arc::from("alpha"),
            max_priority: None,
            weight: None,
            key_id: Arc::from("k"),
            quota: None,
            debug: false,
            objective: Objective::default(),
        };
        // A malformed header is refused even when a key fixes the tenant.
        assert!(matches!(
            r.inference(bad, Some(b"{}"), Caller::Key(&grant), &Fleet),
            Err(Refused::BadHeader(_))
        ));
        let none = r
            .inference(FlowHeaders::default(), None, Caller::Anonymous, &Fleet)
            .unwrap();
        assert_eq!((none.model.as_str(), none.meta.bytes), ("", 0));
    }

    #[test]
    fn a_keyless_conversation_is_named_by_its_prompts() {
        let mut r = rules();
        let conversation = |turns: &[&str], key: bool| {
            let mut messages =
                vec![serde_json::json!({"role": "system", "content": "x".repeat(300)})];
            for (i, t) in turns.iter().enumerate() {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                messages.push(serde_json::json!({"role": role, "content": t}));
            }
            let mut body = serde_json::json!({"model": "m", "messages": messages});
            if key {
                body["prompt_cache_key"] = "conv-1".into();
            }
            serde_json::to_vec(&body).unwrap()
        };
        let turn = |r: &AdmissionRules, body: &[u8]| anonymous_facts(r, body).unwrap().turn;
        let first = turn(&r, &conversation(&["Q1"], false)).expect("a long enough prompt");
        assert_eq!(first.previous, None);
        let second = turn(&r, &conversation(&["Q1", "A1", "Q2"], false)).unwrap();
        assert_eq!(
            second.previous,
            Some(first.this),
            "the second turn finds the first"
        );
        assert_eq!(
            turn(&r, &conversation(&["Q1", "A1", "Q2"], true)),
            None,
            "a session key names the conversation"
        );
        r.sessions.order.clear();
        assert_eq!(
            turn(&r, &conversation(&["Q1"], false)),
            None,
            "sessions off"
        );
    }

    #[test]
    fn a_session_key_is_scoped_to_its_tenant_from_any_source() {
        let r = rules();
        let session = |headers: FlowHeaders<'_>, body: &[u8], caller: Caller<'_>| {
            r.inference(headers, Some(body), caller, &Fleet)
                .unwrap()
                .meta
                .route
                .session
        };
        let plain = br#"{"model":"m"}"#;
        let cache_key = br#"{"model":"m","prompt_cache_key":"conv-1"}"#;
        let header = FlowHeaders::from_pairs([("x-session-id", &b"conv-1"[..])]);
        let anonymous = session(FlowHeaders::default(), cache_key, Caller::Anonymous);
        assert!(anonymous.is_some());
        assert_eq!(
            session(FlowHeaders::default(), plain, Caller::Anonymous),
            None
        );
        assert_eq!(
            session(header, plain, Caller::Anonymous),
            anonymous,
            "the same key in a header names the same session"
        );
        let grant = |tenant: &str| Grant {
            tenant: Arc::from(tenant),
            max_priority: None,
            weight: None,
            key_id: Arc::from("k"),
            quota: None,
            debug: false,
            objective: Objective::default(),
        };
        let (alpha, beta) = (grant("alpha"), grant("beta"));
        let a = session(FlowHeaders::default(), cache_key, Caller::Key(&alpha));
        let b = session(FlowHeaders::default(), cache_key, Caller::Key(&beta));
        assert!(a.is_some() && b.is_some());
        assert_ne!(a, b, "another tenant's key steers nothing of alpha's");
        assert_ne!(a, anonymous);
        for body in [
            &br#"{"conversation":"conv-1"}"#[..],
            br#"{"conversation":{"id":"conv-1","x":[1]}}"#,
        ] {
            assert_eq!(
                session(FlowHeaders::default(), body, Caller::Anonymous),
                anonymous
            );
        }
        let continued = session(
            FlowHeaders::default(),
            br#"{"previous_response_id":"resp_1"}"#,
            Caller::Anonymous,
        );
        assert_eq!(
            continued,
            crate::session::response_key("default", b"resp_1"),
            "a response id names where that response was served"
        );
        for odd in [
            &br#"{"prompt_cache_key":7}"#[..],
            br#"{"prompt_cache_key":""}"#,
            br#"{"conversation":[1,2]}"#,
            br#"{"conversation":{"id":{"no":1}}}"#,
        ] {
            assert_eq!(
                session(FlowHeaders::default(), odd, Caller::Anonymous),
                None
            );
        }
        // A session delivered by the async dispatcher is taken as it was
        // read at submit; from anyone else the header means nothing.
        let delivered =
            FlowHeaders::from_pairs([(DELIVERED_SESSION_HEADER, &b"00000000000000ff"[..])]);
        assert_eq!(
            session(delivered, plain, Caller::AsyncDispatcher { band: -1 }),
            Some(255)
        );
        assert_eq!(session(delivered, plain, Caller::Anonymous), None);
        assert_eq!(
            session(delivered, cache_key, Caller::Anonymous),
            anonymous,
            "a client's own key stands"
        );
        let off = AdmissionRules {
            sessions: SessionRules { order: Vec::new() },
            ..rules()
        };
        let f = anonymous_facts(&off, cache_key).unwrap();
        assert_eq!(f.meta.route.session, None, "no source: sessions off");
    }

    proptest! {
        /// Whatever a client sends, admission answers (never panics), and a
        /// key's tenant and ceiling always hold.
        #[test]
        fn any_input_is_answered_and_a_key_always_binds(
            fairness in proptest::collection::vec(any::<u8>(), 0..160),
            priority in proptest::collection::vec(any::<u8>(), 0..24),
            ttl in proptest::collection::vec(any::<u8>(), 0..24),
            slo in proptest::collection::vec(any::<u8>(), 0..24),
            body in proptest::collection::vec(any::<u8>(), 0..64),
            as_form in any::<bool>(),
            ceiling in -100i32..100,
        ) {
            let r = rules();
            let h = FlowHeaders {
                fairness_id: Some(&fairness),
                objective: None,
                priority: Some(&priority),
                ttl: Some(&ttl),
                content_type: None,
                slo_ttft: Some(&slo),
                ..FlowHeaders::default()
            };
            let grant = Grant { tenant: Arc::from("alpha"), max_priority: Some(ceiling), weight: None, key_id: Arc::from("k"), quota: None, debug: false, objective: Objective::default() };
            let form = FlowHeaders { content_type: Some(&b"multipart/form-data; boundary=x"[..]), ..h };
            let _ = r.inference(if as_form { form } else { h }, Some(&body), Caller::Anonymous, &Fleet);
            if let Ok(f) = r.inference(h, Some(br#"{"model":"m"}"#), Caller::Key(&grant), &Fleet) {
                prop_assert_eq!(&*f.meta.flow.fairness_id, "alpha");
                prop_assert!(f.meta.flow.priority <= ceiling);
                let asked = f.meta.route.objective.ttft_ms;
                prop_assert!(asked.is_some_and(|ms| (1..=objective::MAX_OBJECTIVE_MS).contains(&ms)));
            }
        }
    }
}
