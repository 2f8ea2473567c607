//! The config file's `models:` section and the model flags, resolved into
//! the core's [`ModelRules`] (README "Drop-in: model names").
//!
//! ```yaml
//! models:
//!   default: smollm            # no name, or one no server serves
//!   anyName: false             # names no server serves go to any endpoint
//!   aliases:                   # served model -> names it also answers to
//!     smollm: [gpt-4o-mini, gpt-4o]
//!   rewrites:                  # a name split between models by weight
//!     chat:
//!       - {model: model-a, weight: 90}
//!       - {model: model-b, weight: 10}
//!   fallbacks:                 # where requests go when their model is down
//!     model-a: {models: [model-b], after: 5s}
//!   tokenizers:                # served model -> its Hugging Face snapshot
//!     model-a: /models/model-a # (README "Engine KV events")
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use flowgate::models::ModelRules;
use serde::Deserialize;

use super::flow::ConfigDuration;
use super::Cli;

/// `models:` in the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ModelsSection {
    pub default: Option<String>,
    pub any_name: Option<bool>,
    #[serde(default)]
    pub aliases: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    pub rewrites: BTreeMap<String, Vec<RewriteTarget>>,
    #[serde(default)]
    pub fallbacks: BTreeMap<String, FallbackChain>,
    #[serde(default)]
    pub tokenizers: BTreeMap<String, PathBuf>,
}

/// Each model's tokenizer directory: a flag beats the file's entry for
/// the same model.
pub fn tokenizers(cli: &Cli, file: &ModelsSection) -> Result<BTreeMap<String, PathBuf>, String> {
    let mut dirs = file.tokenizers.clone();
    for (model, dir) in &cli.tokenizers {
        dirs.insert(model.clone(), PathBuf::from(dir));
    }
    match dirs.iter().find(|(model, _)| model.trim().is_empty()) {
        Some(_) => Err("models.tokenizers: a model name is empty".into()),
        None => Ok(dirs),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RewriteTarget {
    pub model: String,
    pub weight: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FallbackChain {
    pub models: Vec<String>,
    /// Also fall back once a request has waited this long for its model.
    pub after: Option<ConfigDuration>,
}

/// The rules from the flags and the file: a flag beats the file's entry
/// for the same name.
pub fn build(cli: &Cli, file: &ModelsSection) -> Result<ModelRules, String> {
    // Alias name -> served model.
    let mut aliases: BTreeMap<&str, &str> = BTreeMap::new();
    for (model, names) in &file.aliases {
        for name in names {
            if let Some(other) = aliases.insert(name, model) {
                return Err(format!(
                    "models.aliases: {name:?} is an alias of both {other:?} and {model:?}"
                ));
            }
        }
    }
    for (name, model) in &cli.model_aliases {
        aliases.insert(name, model);
    }
    let mut fallbacks: BTreeMap<&str, (Vec<&str>, Option<ConfigDuration>)> = file
        .fallbacks
        .iter()
        .map(|(m, c)| {
            (
                m.as_str(),
                (c.models.iter().map(String::as_str).collect(), c.after),
            )
        })
        .collect();
    for (model, chain) in &cli.model_fallbacks {
        let after = fallbacks.get(model.as_str()).and_then(|(_, a)| *a);
        fallbacks.insert(model, (chain.split(',').map(str::trim).collect(), after));
    }
    let mut b = ModelRules::builder();
    let e = |e: flowgate::models::BadRules| e.to_string();
    for (name, model) in aliases {
        b = b.alias(name, model).map_err(e)?;
    }
    for (name, targets) in &file.rewrites {
        let targets: Vec<(&str, u32)> = targets
            .iter()
            .map(|t| (t.model.as_str(), t.weight))
            .collect();
        b = b.rewrite(name, &targets).map_err(e)?;
    }
    for (model, (chain, after)) in fallbacks {
        b = b.fallback(model, &chain, after.map(|a| a.0)).map_err(e)?;
    }
    if let Some(d) = cli.default_model.as_ref().or(file.default.as_ref()) {
        b = b.default_model(d).map_err(e)?;
    }
    b.any_name(cli.any_model_name || file.any_name.unwrap_or(false))
        .build()
        .map_err(e)
}
