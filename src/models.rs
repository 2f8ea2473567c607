//! Model names like a user expects: which served model a requested name
//! goes to.
//!
//! The operator's `models:` rules, applied in one step at every door:
//!
//! 1. A name the client sent that the rules know, either an **alias**
//!    (many names → one model, e.g. `gpt-4o-mini` → `smollm`) or a weighted
//!    **rewrite** (a canary: `chat` → 90 % `model-a`, 10 % `model-b`, as
//!    the Gateway API Inference Extension's InferenceModelRewrite), becomes
//!    the model it stands for. Targets are never looked up again, so the
//!    rules cannot loop.
//! 2. A name no agent reports serving (and that is not a configured target)
//!    goes to the **default model** when one is set, or, under the
//!    **any-name** setting, to any endpoint — what a lone llama-server does
//!    with every name. A request that names no model goes to the default
//!    model too.
//! 3. Otherwise the name stands, and flow control answers an unknown one
//!    with 404 (a typo must not silently reach another model).
//!
//! A **fallback chain** per model says where a request goes when no
//! endpoint of its model is live, or when it has waited longer than the
//! chain's `after` for one ([`ModelRules::fallback`]; the balancer applies
//! it, since it needs the fleet's state).
//!
//! Weighted rewrites take a `draw` from the caller (a counter): the pick is
//! a low-discrepancy (Weyl) sequence over the weights, so 1,000 draws split
//! within a few requests of the exact ratio, with no lock and no random
//! source.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

/// Longest model name the rules take (the agents' limit too).
pub const MAX_MODEL_NAME: usize = 256;
/// Most names (aliases and rewrites) and most fallback chains.
pub const MAX_RULES: usize = 4096;
/// Most targets of one rewrite and most models of one fallback chain.
pub const MAX_TARGETS: usize = 16;
/// Largest weight of one rewrite target.
pub const MAX_WEIGHT: u32 = 1_000_000;

/// Where a requested name goes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    One(Arc<str>),
    /// Targets with cumulative weights (strictly increasing), and their sum.
    Weighted(Vec<(Arc<str>, u64)>, u64),
}

/// What happens to a request whose chosen model has no live endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    /// Tried in this order; the first with a live endpoint wins.
    pub models: Vec<Arc<str>>,
    /// A request that has waited this long for its model moves on to the
    /// chain as well (`None`: only when no endpoint is live).
    pub after: Option<Duration>,
}

/// How a request's model was chosen (for the access log and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chosen {
    /// The name as the client sent it.
    AsAsked,
    /// An alias's model.
    Alias,
    /// One target of a weighted rewrite.
    Rewrite,
    /// The default model (no name, or one nothing serves).
    Default,
    /// Any endpoint (the any-name setting, or no name and no default).
    AnyEndpoint,
}

/// The model a request goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// `None`: any endpoint will do.
    pub model: Option<Arc<str>>,
    pub chosen: Chosen,
}

impl Resolved {
    /// The name to write into the request body's `model` field when it
    /// differs from what the client sent (the engine may check it: vLLM
    /// answers 404 to a name it was not started with).
    pub fn rewritten_name(&self, asked: &str) -> Option<&str> {
        match (&self.model, self.chosen) {
            (Some(m), Chosen::Alias | Chosen::Rewrite | Chosen::Default) if **m != *asked => {
                Some(m)
            }
            _ => None,
        }
    }
}

/// A mistake in the `models:` rules, named for the operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("models: {0}")]
pub struct BadRules(pub String);

/// The operator's model-name rules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelRules {
    names: HashMap<Arc<str>, Target>,
    default: Option<Arc<str>>,
    any_name: bool,
    fallbacks: HashMap<Arc<str>, Fallback>,
    /// Every model the rules name as a target: known even before an agent
    /// reports it (a fleet scaling up from zero).
    targets: HashSet<Arc<str>>,
}

/// Builds [`ModelRules`], checking each rule as it is added.
#[derive(Debug, Default)]
pub struct ModelRulesBuilder {
    rules: ModelRules,
}

fn check_name(what: &str, name: &str) -> Result<Arc<str>, BadRules> {
    let trimmed = name.trim();
    if trimmed.is_empty() || trimmed.len() > MAX_MODEL_NAME || trimmed.len() != name.len() {
        return Err(BadRules(format!(
            "{what} {name:?} must be 1 to {MAX_MODEL_NAME} bytes without surrounding spaces"
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(BadRules(format!(
            "{what} {name:?} contains a control character"
        )));
    }
    Ok(Arc::from(name))
}

impl ModelRulesBuilder {
    fn add_name(&mut self, name: &str, target: Target) -> Result<(), BadRules> {
        let name = check_name("model name", name)?;
        if self.rules.names.len() >= MAX_RULES {
            return Err(BadRules(format!(
                "at most {MAX_RULES} aliases and rewrites"
            )));
        }
        if self.rules.names.contains_key(&name) {
            return Err(BadRules(format!(
                "{name:?} is given twice (as an alias or a rewrite)"
            )));
        }
        self.rules.names.insert(name, target);
        Ok(())
    }

    /// `name` stands for `model`.
    pub fn alias(mut self, name: &str, model: &str) -> Result<Self, BadRules> {
        let model = check_name("alias target", model)?;
        self.rules.targets.insert(Arc::clone(&model));
        self.add_name(name, Target::One(model))?;
        Ok(self)
    }

    /// `name` goes to one of `targets` in proportion to their weights.
    pub fn rewrite(mut self, name: &str, targets: &[(&str, u32)]) -> Result<Self, BadRules> {
        if targets.is_empty() || targets.len() > MAX_TARGETS {
            return Err(BadRules(format!(
                "rewrite {name:?} needs 1 to {MAX_TARGETS} targets"
            )));
        }
        let mut cumulative = Vec::with_capacity(targets.len());
        let mut total = 0u64;
        for &(model, weight) in targets {
            let model = check_name("rewrite target", model)?;
            if weight > MAX_WEIGHT {
                return Err(BadRules(format!(
                    "rewrite {name:?}: weight {weight} of {model:?} is over {MAX_WEIGHT}"
                )));
            }
            if weight == 0 {
                // A target at weight 0 is switched off (a canary at 0 %).
                continue;
            }
            if cumulative.iter().any(|(m, _)| m == &model) {
                return Err(BadRules(format!("rewrite {name:?} names {model:?} twice")));
            }
            total += u64::from(weight);
            self.rules.targets.insert(Arc::clone(&model));
            cumulative.push((model, total));
        }
        if total == 0 {
            return Err(BadRules(format!(
                "rewrite {name:?}: the weights add up to 0"
            )));
        }
        self.add_name(name, Target::Weighted(cumulative, total))?;
        Ok(self)
    }

    /// Requests that name no model, or one nothing serves, go to `model`.
    pub fn default_model(mut self, model: &str) -> Result<Self, BadRules> {
        let model = check_name("default model", model)?;
        self.rules.targets.insert(Arc::clone(&model));
        self.rules.default = Some(model);
        Ok(self)
    }

    /// Names nothing serves go to any endpoint (when no default is set).
    pub fn any_name(mut self, on: bool) -> Self {
        self.rules.any_name = on;
        self
    }

    /// Where requests for `model` go when it has no live endpoint.
    pub fn fallback(
        mut self,
        model: &str,
        chain: &[&str],
        after: Option<Duration>,
    ) -> Result<Self, BadRules> {
        let model = check_name("fallback model", model)?;
        if chain.is_empty() || chain.len() > MAX_TARGETS {
            return Err(BadRules(format!(
                "the fallbacks of {model:?} need 1 to {MAX_TARGETS} models"
            )));
        }
        if self.rules.fallbacks.len() >= MAX_RULES {
            return Err(BadRules(format!("at most {MAX_RULES} fallback chains")));
        }
        if self.rules.fallbacks.contains_key(&model) {
            return Err(BadRules(format!(
                "the fallbacks of {model:?} are given twice"
            )));
        }
        let mut models: Vec<Arc<str>> = Vec::with_capacity(chain.len());
        for m in chain {
            let m = check_name("fallback", m)?;
            if m == model || models.contains(&m) {
                return Err(BadRules(format!(
                    "the fallbacks of {model:?} name {m:?} twice (or the model itself)"
                )));
            }
            self.rules.targets.insert(Arc::clone(&m));
            models.push(m);
        }
        if after.is_some_and(|a| a.is_zero()) {
            return Err(BadRules(format!(
                "the fallbacks of {model:?}: `after` must be longer than 0"
            )));
        }
        self.rules.targets.insert(Arc::clone(&model));
        self.rules
            .fallbacks
            .insert(model, Fallback { models, after });
        Ok(self)
    }

    /// The rules, once a target is never itself a rewritten name (a chain
    /// of names would hide where a request goes).
    pub fn build(self) -> Result<ModelRules, BadRules> {
        let r = &self.rules;
        for (name, target) in &r.names {
            let models: Vec<&Arc<str>> = match target {
                Target::One(m) => vec![m],
                Target::Weighted(ts, _) => ts.iter().map(|(m, _)| m).collect(),
            };
            if let Some(m) = models.into_iter().find(|m| r.names.contains_key(*m)) {
                return Err(BadRules(format!(
                    "{name:?} goes to {m:?}, which is itself an alias or a rewrite: \
                     name the served model"
                )));
            }
        }
        if let Some(d) = &r.default {
            if r.names.contains_key(d) {
                return Err(BadRules(format!(
                    "the default model {d:?} is an alias or a rewrite: name the served model"
                )));
            }
        }
        Ok(self.rules)
    }
}

impl ModelRules {
    pub fn builder() -> ModelRulesBuilder {
        ModelRulesBuilder::default()
    }

    /// The model a request that asked for `asked` (empty: none) goes to.
    /// `is_served` says whether an agent reports serving a name; `draw`
    /// picks among a rewrite's targets (pass a counter).
    pub fn resolve(&self, asked: &str, draw: u64, is_served: impl Fn(&str) -> bool) -> Resolved {
        let otherwise = || match (&self.default, self.any_name) {
            (Some(d), _) => Resolved {
                model: Some(Arc::clone(d)),
                chosen: Chosen::Default,
            },
            (None, true) => Resolved {
                model: None,
                chosen: Chosen::AnyEndpoint,
            },
            (None, false) => Resolved {
                model: (!asked.is_empty()).then(|| Arc::from(asked)),
                chosen: if asked.is_empty() {
                    Chosen::AnyEndpoint
                } else {
                    Chosen::AsAsked
                },
            },
        };
        if asked.is_empty() {
            return otherwise();
        }
        match self.names.get(asked) {
            Some(Target::One(m)) => Resolved {
                model: Some(Arc::clone(m)),
                chosen: Chosen::Alias,
            },
            Some(Target::Weighted(targets, total)) => Resolved {
                model: Some(pick(targets, *total, draw)),
                chosen: Chosen::Rewrite,
            },
            None if is_served(asked) || self.targets.contains(asked) => Resolved {
                model: Some(Arc::from(asked)),
                chosen: Chosen::AsAsked,
            },
            None => otherwise(),
        }
    }

    /// The fallback chain of `model`, if it has one.
    pub fn fallback(&self, model: &str) -> Option<&Fallback> {
        self.fallbacks.get(model)
    }

    /// The names the rules answer to (aliases and rewrites): `/v1/models`
    /// lists them and a 404 names them.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.names.keys().map(|n| &**n)
    }
}

/// The target the draw lands on: the draw times the golden ratio, as a
/// fraction of the total weight (a Weyl sequence: consecutive draws spread
/// evenly over the weights).
fn pick(targets: &[(Arc<str>, u64)], total: u64, draw: u64) -> Arc<str> {
    const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
    let fraction = draw.wrapping_mul(GOLDEN);
    let point = ((u128::from(fraction) * u128::from(total)) >> 64) as u64;
    let i = targets.partition_point(|(_, upto)| *upto <= point);
    Arc::clone(&targets[i.min(targets.len() - 1)].0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn served(names: &'static [&'static str]) -> impl Fn(&str) -> bool {
        move |m| names.contains(&m)
    }

    #[test]
    fn aliases_rewrites_and_known_names() {
        let rules = ModelRules::builder()
            .alias("gpt-4o-mini", "smollm")
            .unwrap()
            .alias("gpt-4o", "smollm")
            .unwrap()
            .rewrite("chat", &[("model-a", 9), ("model-b", 1)])
            .unwrap()
            .build()
            .unwrap();
        let s = served(&["smollm", "model-a"]);
        let r = rules.resolve("gpt-4o-mini", 0, &s);
        assert_eq!(
            (r.model.as_deref(), r.chosen),
            (Some("smollm"), Chosen::Alias)
        );
        assert_eq!(r.rewritten_name("gpt-4o-mini"), Some("smollm"));
        let r = rules.resolve("smollm", 0, &s);
        assert_eq!(
            (r.model.as_deref(), r.chosen),
            (Some("smollm"), Chosen::AsAsked)
        );
        assert_eq!(r.rewritten_name("smollm"), None);
        // Unknown names stand (flow control answers 404), no name: any.
        let r = rules.resolve("typo", 0, &s);
        assert_eq!(
            (r.model.as_deref(), r.chosen),
            (Some("typo"), Chosen::AsAsked)
        );
        let r = rules.resolve("", 0, &s);
        assert_eq!((r.model, r.chosen), (None, Chosen::AnyEndpoint));
        // A rewrite target is known even while nothing serves it.
        let r = rules.resolve("model-b", 0, served(&[]));
        assert_eq!(r.chosen, Chosen::AsAsked);
    }

    #[test]
    fn the_default_takes_no_name_and_unknown_names_and_any_name_takes_the_rest() {
        let rules = ModelRules::builder()
            .default_model("smollm")
            .unwrap()
            .build()
            .unwrap();
        let s = served(&["smollm", "other"]);
        for asked in ["", "gpt-4o-mini"] {
            let r = rules.resolve(asked, 0, &s);
            assert_eq!(
                (r.model.as_deref(), r.chosen),
                (Some("smollm"), Chosen::Default)
            );
        }
        assert_eq!(rules.resolve("other", 0, &s).chosen, Chosen::AsAsked);
        assert_eq!(
            rules
                .resolve("gpt-4o-mini", 0, &s)
                .rewritten_name("gpt-4o-mini"),
            Some("smollm")
        );
        let any = ModelRules::builder().any_name(true).build().unwrap();
        let r = any.resolve("gpt-4o-mini", 0, &s);
        assert_eq!((r.model.clone(), r.chosen), (None, Chosen::AnyEndpoint));
        assert_eq!(
            r.rewritten_name("gpt-4o-mini"),
            None,
            "the engine gets it as sent"
        );
    }

    #[test]
    fn a_thousand_rewrites_split_within_a_few_of_the_weights() {
        let rules = ModelRules::builder()
            .rewrite("chat", &[("a", 90), ("b", 10), ("off", 0)])
            .unwrap()
            .build()
            .unwrap();
        let s = served(&[]);
        let b = (0..1000u64)
            .filter(|&n| rules.resolve("chat", n, &s).model.as_deref() == Some("b"))
            .count();
        assert!((95..=105).contains(&b), "{b} of 1000 went to b");
        assert!((0..1000u64).all(|n| rules.resolve("chat", n, &s).model.as_deref() != Some("off")));
    }

    #[test]
    fn bad_rules_are_refused_with_the_name() {
        let e = |r: Result<ModelRulesBuilder, BadRules>| r.unwrap_err().0;
        assert!(e(ModelRules::builder().alias("", "m")).contains("1 to 256"));
        assert!(e(ModelRules::builder().alias(" x", "m")).contains("spaces"));
        assert!(e(ModelRules::builder().alias("x", &"m".repeat(300))).contains("1 to 256"));
        assert!(e(ModelRules::builder().rewrite("x", &[])).contains("1 to 16"));
        assert!(e(ModelRules::builder().rewrite("x", &[("a", 0)])).contains("add up to 0"));
        assert!(e(ModelRules::builder().rewrite("x", &[("a", 2_000_000)])).contains("over"));
        assert!(e(ModelRules::builder().rewrite("x", &[("a", 1), ("a", 1)])).contains("twice"));
        assert!(e(ModelRules::builder()
            .alias("x", "a")
            .unwrap()
            .alias("x", "b"))
        .contains("twice"));
        assert!(e(ModelRules::builder().fallback("a", &["a"], None)).contains("twice"));
        assert!(
            e(ModelRules::builder().fallback("a", &["b"], Some(Duration::ZERO)))
                .contains("longer than 0")
        );
        let chained = ModelRules::builder()
            .alias("x", "y")
            .unwrap()
            .alias("y", "z")
            .unwrap()
            .build();
        assert!(chained.unwrap_err().0.contains("itself an alias"));
        let default_alias = ModelRules::builder()
            .alias("x", "y")
            .unwrap()
            .default_model("x")
            .unwrap()
            .build();
        assert!(default_alias.is_err());
    }

    #[test]
    fn fallback_chains_are_kept_in_order() {
        let rules = ModelRules::builder()
            .fallback("a", &["b", "c"], Some(Duration::from_secs(2)))
            .unwrap()
            .build()
            .unwrap();
        let f = rules.fallback("a").unwrap();
        assert_eq!(f.models, [Arc::from("b"), Arc::from("c")]);
        assert_eq!(f.after, Some(Duration::from_secs(2)));
        assert!(rules.fallback("b").is_none());
        // Fallback models are known names.
        assert_eq!(rules.resolve("c", 0, served(&[])).chosen, Chosen::AsAsked);
    }

    proptest! {
        /// Any weights: every draw lands on a target with weight > 0, and
        /// the split of `n` consecutive draws is within a small bound of
        /// the weights' ratio.
        #[test]
        fn rewrites_follow_their_weights(
            weights in proptest::collection::vec(0u32..1000, 1..6),
            start in any::<u64>(),
        ) {
            prop_assume!(weights.iter().any(|&w| w > 0));
            let names: Vec<String> = (0..weights.len()).map(|i| format!("m{i}")).collect();
            let targets: Vec<(&str, u32)> =
                names.iter().map(String::as_str).zip(weights.iter().copied()).collect();
            let rules = ModelRules::builder().rewrite("x", &targets).unwrap().build().unwrap();
            let total: u32 = weights.iter().sum();
            let n = 2000u64;
            let mut counts = vec![0u64; weights.len()];
            for d in start..start.wrapping_add(n).max(start) {
                let m = rules.resolve("x", d, |_| false).model.unwrap();
                let i: usize = m[1..].parse().unwrap();
                prop_assert!(weights[i] > 0);
                counts[i] += 1;
            }
            let drawn: u64 = counts.iter().sum();
            for (i, &w) in weights.iter().enumerate() {
                let expected = drawn as f64 * f64::from(w) / f64::from(total);
                prop_assert!((counts[i] as f64 - expected).abs() <= 0.02 * drawn as f64 + 5.0,
                    "target {i}: {} of {drawn}, expected {expected}", counts[i]);
            }
        }

        /// Whatever name a client sends, resolving answers without panic
        /// and never invents a model the rules and the fleet do not name.
        #[test]
        fn any_name_resolves(asked in ".{0,300}", draw in any::<u64>()) {
            let rules = ModelRules::builder()
                .alias("gpt-4o-mini", "smollm").unwrap()
                .build().unwrap();
            let r = rules.resolve(&asked, draw, |m| m == "smollm");
            if let Some(m) = r.model {
                prop_assert!(&*m == "smollm" || *m == *asked);
            }
        }
    }
}
