//! Flow control settings from the config file (`flowControl`,
//! `saturationDetector`, `objectives`, `modelPriorities`), checked and
//! resolved into the core's configuration and
//! [`flowgate::admission::PriorityRules`].
//!
//! Names follow the Gateway API Inference Extension's EndpointPickerConfig
//! where it has them.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

use flowgate::admission::PriorityRules;
use flowgate::duration::parse_duration;
use flowgate::flow::MAX_WEIGHT;
use flowgate::{
    BandConfig, DispatcherConfig, FairnessPolicy, FlowControlConfig, OrderingPolicy,
    SaturationConfig,
};
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

pub const DEFAULT_MAX_BUFFERED_BYTES: u64 = 256 << 20;
/// Most a token budget may overcommit a server's KV capacity.
pub const MAX_TOKEN_BUDGET: f64 = 10.0;
pub const DEFAULT_MAX_REQUEST_TTL: Duration = Duration::from_secs(60);

/// A duration in the config file: `250ms`, `10s`, `2m`, or a number of
/// milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigDuration(pub Duration);

impl<'de> Deserialize<'de> for ConfigDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ConfigDuration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration such as 250ms, 10s or 2m, or a number of milliseconds")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ConfigDuration, E> {
                Ok(ConfigDuration(Duration::from_millis(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ConfigDuration, E> {
                u64::try_from(v)
                    .map(|v| ConfigDuration(Duration::from_millis(v)))
                    .map_err(|_| E::custom(format!("{v} is negative")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ConfigDuration, E> {
                parse_duration(v).map(ConfigDuration).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// `flowControl:` in the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FlowControlSection {
    /// Same as the top-level `maxBufferedRequests`.
    pub max_requests: Option<usize>,
    pub max_bytes: Option<u64>,
    /// Most estimated tokens that may wait (no limit when absent).
    pub max_tokens: Option<u64>,
    /// Same as the top-level `bufferedRequestTimeout`.
    #[serde(rename = "defaultRequestTTL")]
    pub default_request_ttl: Option<ConfigDuration>,
    #[serde(rename = "maxRequestTTL")]
    pub max_request_ttl: Option<ConfigDuration>,
    pub default_priority: Option<i32>,
    pub allow_client_priority: Option<bool>,
    pub default_band: Option<BandPolicies>,
    #[serde(default)]
    pub priority_bands: Vec<PriorityBand>,
    /// Token-fairness weights by fairness id (1 when not listed).
    #[serde(default)]
    pub tenant_weights: BTreeMap<String, u32>,
}

/// Policies of bands not listed in `priorityBands`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BandPolicies {
    pub fairness_policy_ref: Option<FairnessPolicy>,
    pub ordering_policy_ref: Option<OrderingPolicy>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PriorityBand {
    pub priority: i32,
    pub max_requests: Option<usize>,
    pub max_bytes: Option<u64>,
    pub max_tokens: Option<u64>,
    pub fairness_policy_ref: Option<FairnessPolicy>,
    pub ordering_policy_ref: Option<OrderingPolicy>,
}

/// `saturationDetector:` in the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SaturationSection {
    pub queue_depth_threshold: Option<u32>,
    pub kv_cache_util_threshold: Option<f64>,
    pub metrics_staleness_threshold: Option<ConfigDuration>,
    /// Share of an endpoint's KV capacity the estimated tokens in flight
    /// may fill (0: off; above 1 overcommits).
    pub token_budget: Option<f64>,
}

/// Everything the file says about flow control, checked and resolved.
/// `max_requests` / `default_ttl` come from the merged top-level settings.
pub fn build(
    fc: &FlowControlSection,
    sat: &SaturationSection,
    objectives: &BTreeMap<String, i32>,
    model_priorities: &BTreeMap<String, i32>,
    max_requests: usize,
    max_bytes: u64,
    default_ttl: Duration,
) -> Result<(DispatcherConfig, PriorityRules, HashMap<String, u32>), String> {
    let max_ttl = fc
        .max_request_ttl
        .map_or(DEFAULT_MAX_REQUEST_TTL.max(default_ttl), |d| d.0);
    if max_bytes == 0 {
        return Err("flowControl.maxBytes (--max-buffered-bytes) must be at least 1".into());
    }
    if fc.max_tokens == Some(0) {
        return Err("flowControl.maxTokens must be at least 1 (leave it out for no limit)".into());
    }
    if max_ttl < default_ttl {
        return Err(format!(
            "flowControl.maxRequestTTL ({} ms) must not be shorter than the default request \
             TTL ({} ms)",
            max_ttl.as_millis(),
            default_ttl.as_millis()
        ));
    }
    let (default_band, bands) = bands(fc)?;
    let saturation = saturation(sat)?;
    for (what, map) in [
        ("objectives", objectives),
        ("modelPriorities", model_priorities),
    ] {
        if let Some(name) = map.keys().find(|k| k.trim().is_empty()) {
            return Err(format!("{what}: the name {name:?} is empty"));
        }
    }
    let dispatcher = DispatcherConfig {
        flow: FlowControlConfig {
            max_requests,
            max_bytes,
            max_tokens: fc.max_tokens,
            bands,
            default_band,
        },
        saturation,
        // Filled in from `scheduling:` by the caller.
        scheduling: Default::default(),
        default_ttl,
        max_ttl,
    };
    let rules = PriorityRules {
        default_priority: fc.default_priority.unwrap_or(0),
        objectives: objectives.clone().into_iter().collect(),
        models: model_priorities.clone().into_iter().collect(),
        allow_client_priority: fc.allow_client_priority.unwrap_or(false),
    };
    let weights = weights(&fc.tenant_weights)?;
    Ok((dispatcher, rules, weights))
}

/// `flowControl.tenantWeights`, checked.
fn weights(weights: &BTreeMap<String, u32>) -> Result<HashMap<String, u32>, String> {
    for (tenant, &w) in weights {
        if !flowgate::flow::valid_fairness_id(tenant) {
            return Err(format!(
                "flowControl.tenantWeights: {tenant:?} is not a valid fairness id (1-128 visible \
                 ASCII characters)"
            ));
        }
        if !(1..=MAX_WEIGHT).contains(&w) {
            return Err(format!(
                "flowControl.tenantWeights.{tenant} must be 1..={MAX_WEIGHT}, not {w}"
            ));
        }
    }
    Ok(weights.clone().into_iter().collect())
}

/// The default band's policies and the listed bands, checked.
fn bands(fc: &FlowControlSection) -> Result<(BandConfig, BTreeMap<i32, BandConfig>), String> {
    let defaults = BandConfig::default();
    let default_band = BandConfig {
        fairness: fc
            .default_band
            .as_ref()
            .and_then(|b| b.fairness_policy_ref)
            .unwrap_or(defaults.fairness),
        ordering: fc
            .default_band
            .as_ref()
            .and_then(|b| b.ordering_policy_ref)
            .unwrap_or(defaults.ordering),
        ..defaults
    };
    let mut bands = BTreeMap::new();
    for (i, b) in fc.priority_bands.iter().enumerate() {
        let field = format!("flowControl.priorityBands[{i}]");
        if b.max_requests == Some(0) {
            return Err(format!(
                "{field}.maxRequests must be at least 1 (leave it out for no band limit)"
            ));
        }
        if b.max_bytes == Some(0) {
            return Err(format!(
                "{field}.maxBytes must be at least 1 (leave it out for no band limit)"
            ));
        }
        if b.max_tokens == Some(0) {
            return Err(format!(
                "{field}.maxTokens must be at least 1 (leave it out for no band limit)"
            ));
        }
        let band = BandConfig {
            max_requests: b.max_requests,
            max_bytes: b.max_bytes,
            max_tokens: b.max_tokens,
            fairness: b.fairness_policy_ref.unwrap_or(default_band.fairness),
            ordering: b.ordering_policy_ref.unwrap_or(default_band.ordering),
        };
        if bands.insert(b.priority, band).is_some() {
            return Err(format!(
                "{field}.priority: band {} is listed twice",
                b.priority
            ));
        }
    }
    Ok((default_band, bands))
}

/// `saturationDetector:`, checked.
fn saturation(sat: &SaturationSection) -> Result<SaturationConfig, String> {
    let sd = SaturationConfig::default();
    let saturation = SaturationConfig {
        queue_depth_threshold: sat
            .queue_depth_threshold
            .unwrap_or(sd.queue_depth_threshold),
        kv_cache_util_threshold: sat
            .kv_cache_util_threshold
            .unwrap_or(sd.kv_cache_util_threshold),
        metrics_staleness_threshold: sat
            .metrics_staleness_threshold
            .map_or(sd.metrics_staleness_threshold, |d| d.0),
        token_budget: sat.token_budget.unwrap_or(sd.token_budget),
    };
    if saturation.queue_depth_threshold == 0 {
        return Err("saturationDetector.queueDepthThreshold must be at least 1".into());
    }
    let kv = saturation.kv_cache_util_threshold;
    if !(kv > 0.0 && kv <= 1.0) {
        return Err(format!(
            "saturationDetector.kvCacheUtilThreshold must be in (0, 1], not {kv}"
        ));
    }
    let budget = saturation.token_budget;
    if !(0.0..=MAX_TOKEN_BUDGET).contains(&budget) {
        return Err(format!(
            "saturationDetector.tokenBudget must be in [0, {MAX_TOKEN_BUDGET}] (a share of each \
             server's KV capacity; 0 turns it off), not {budget}"
        ));
    }
    if saturation.metrics_staleness_threshold.is_zero() {
        return Err("saturationDetector.metricsStalenessThreshold must be at least 1ms".into());
    }
    Ok(saturation)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_units_or_milliseconds() {
        #[derive(Deserialize)]
        struct D {
            d: ConfigDuration,
        }
        for (yaml, ms) in [
            ("d: 250", 250),
            ("d: 250ms", 250),
            ("d: 2s", 2000),
            ("d: 1m", 60_000),
        ] {
            let d: D = serde_saphyr::from_str(yaml).unwrap();
            assert_eq!(d.d.0, Duration::from_millis(ms), "{yaml}");
        }
        assert!(serde_saphyr::from_str::<D>("d: soon").is_err());
        assert!(serde_saphyr::from_str::<D>("d: -5").is_err());
    }
}
