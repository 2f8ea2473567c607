//! Flow control settings from the config file (`flowControl`,
//! `saturationDetector`, `objectives`, `modelPriorities`) and the rules that
//! turn a request's headers into its flow (fairness id, priority, TTL).
//!
//! Names follow the Gateway API Inference Extension's EndpointPickerConfig
//! where it has them.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

use flowgate::duration::parse_duration;
use flowgate::flow::{valid_fairness_id, DEFAULT_FAIRNESS_ID};
use flowgate::{
    BandConfig, DispatcherConfig, FairnessPolicy, FlowControlConfig, FlowKey, OrderingPolicy,
    SaturationConfig,
};
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

/// Header naming the tenant a request belongs to (its fairness id).
pub const FAIRNESS_ID_HEADER: &str = "x-gateway-inference-fairness-id";
/// Header naming the request's objective, which maps to a priority.
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// Header with a numeric priority, honoured only with `allowClientPriority`.
pub const PRIORITY_HEADER: &str = "x-flowgate-priority";
/// Header with the longest time the request may wait (`500ms`, `5s`, or
/// milliseconds), cut to `maxRequestTTL`.
pub const TTL_HEADER: &str = "x-flowgate-request-ttl";

pub const DEFAULT_MAX_BUFFERED_BYTES: u64 = 256 << 20;
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
}

/// How a request's priority is chosen.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PriorityRules {
    /// Priority of requests no rule matches.
    pub default_priority: i32,
    /// Objective name (header `x-gateway-inference-objective`) → priority.
    pub objectives: HashMap<String, i32>,
    /// Model name → priority, when no objective matched.
    pub models: HashMap<String, i32>,
    /// Whether the `x-flowgate-priority` header is honoured.
    pub allow_client_priority: bool,
}

/// A request header that flow control refuses (answered 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{header}: {reason}")]
pub struct BadHeader {
    pub header: &'static str,
    pub reason: String,
}

/// The flow-control view of a request's headers.
#[derive(Debug, Default, Clone, Copy)]
pub struct FlowHeaders<'a> {
    pub fairness_id: Option<&'a [u8]>,
    pub objective: Option<&'a [u8]>,
    pub priority: Option<&'a [u8]>,
    pub ttl: Option<&'a [u8]>,
}

impl PriorityRules {
    /// The flow and TTL of a request for `model`. A header that is present
    /// but malformed is an error, never silently ignored — except the
    /// priority header when the operator does not allow it, which is
    /// ignored so clients cannot pick their own priority.
    pub fn classify(
        &self,
        h: FlowHeaders<'_>,
        model: &str,
    ) -> Result<(FlowKey, Option<Duration>), BadHeader> {
        let text = |header: &'static str, v: &[u8]| -> Result<String, BadHeader> {
            std::str::from_utf8(v)
                .map(|s| s.trim().to_string())
                .map_err(|_| BadHeader {
                    header,
                    reason: "not valid UTF-8".into(),
                })
        };
        let fairness_id = match h.fairness_id {
            None => DEFAULT_FAIRNESS_ID.to_string(),
            Some(v) => {
                let id = text(FAIRNESS_ID_HEADER, v)?;
                if !valid_fairness_id(&id) {
                    return Err(BadHeader {
                        header: FAIRNESS_ID_HEADER,
                        reason: "must be 1 to 128 visible ASCII characters".into(),
                    });
                }
                id
            }
        };
        let mut priority = None;
        if let Some(v) = h.objective {
            priority = self.objectives.get(&text(OBJECTIVE_HEADER, v)?).copied();
        }
        let mut priority = priority
            .or_else(|| self.models.get(model).copied())
            .unwrap_or(self.default_priority);
        if let (Some(v), true) = (h.priority, self.allow_client_priority) {
            priority = text(PRIORITY_HEADER, v)?.parse().map_err(|_| BadHeader {
                header: PRIORITY_HEADER,
                reason: "must be an integer".into(),
            })?;
        }
        let ttl = match h.ttl {
            None => None,
            Some(v) => {
                let ttl = parse_duration(&text(TTL_HEADER, v)?).map_err(|reason| BadHeader {
                    header: TTL_HEADER,
                    reason,
                })?;
                if ttl.is_zero() {
                    return Err(BadHeader {
                        header: TTL_HEADER,
                        reason: "must be at least 1ms".into(),
                    });
                }
                Some(ttl)
            }
        };
        Ok((FlowKey::new(fairness_id, priority), ttl))
    }
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
) -> Result<(DispatcherConfig, PriorityRules), String> {
    let max_ttl = fc
        .max_request_ttl
        .map_or(DEFAULT_MAX_REQUEST_TTL.max(default_ttl), |d| d.0);
    if max_bytes == 0 {
        return Err("flowControl.maxBytes (--max-buffered-bytes) must be at least 1".into());
    }
    if max_ttl < default_ttl {
        return Err(format!(
            "flowControl.maxRequestTTL ({} ms) must not be shorter than the default request \
             TTL ({} ms)",
            max_ttl.as_millis(),
            default_ttl.as_millis()
        ));
    }
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
        let band = BandConfig {
            max_requests: b.max_requests,
            max_bytes: b.max_bytes,
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
    if saturation.metrics_staleness_threshold.is_zero() {
        return Err("saturationDetector.metricsStalenessThreshold must be at least 1ms".into());
    }
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
    Ok((dispatcher, rules))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> PriorityRules {
        PriorityRules {
            default_priority: 1,
            objectives: HashMap::from([("chat".into(), 10), ("batch".into(), -1)]),
            models: HashMap::from([("big".into(), 5)]),
            allow_client_priority: false,
        }
    }

    #[test]
    fn objective_beats_model_beats_default() {
        let r = rules();
        let h = |objective: Option<&'static str>| FlowHeaders {
            objective: objective.map(str::as_bytes),
            ..FlowHeaders::default()
        };
        let p = |h, model| r.classify(h, model).unwrap().0.priority;
        assert_eq!(p(h(Some("chat")), "big"), 10);
        assert_eq!(p(h(Some("batch")), "small"), -1);
        assert_eq!(p(h(Some("unknown")), "big"), 5);
        assert_eq!(p(h(None), "small"), 1);
    }

    #[test]
    fn client_priority_only_when_allowed() {
        let mut r = rules();
        let h = FlowHeaders {
            priority: Some(b"99"),
            ..FlowHeaders::default()
        };
        assert_eq!(r.classify(h, "m").unwrap().0.priority, 1, "ignored");
        r.allow_client_priority = true;
        assert_eq!(r.classify(h, "m").unwrap().0.priority, 99);
        let bad = FlowHeaders {
            priority: Some(b"high"),
            ..FlowHeaders::default()
        };
        assert_eq!(r.classify(bad, "m").unwrap_err().header, PRIORITY_HEADER);
    }

    #[test]
    fn fairness_id_and_ttl_are_checked() {
        let r = rules();
        let (key, ttl) = r.classify(FlowHeaders::default(), "m").unwrap();
        assert_eq!(&*key.fairness_id, DEFAULT_FAIRNESS_ID);
        assert_eq!(ttl, None);
        let h = FlowHeaders {
            fairness_id: Some(b"tenant-a"),
            ttl: Some(b"1500ms"),
            ..FlowHeaders::default()
        };
        let (key, ttl) = r.classify(h, "m").unwrap();
        assert_eq!(&*key.fairness_id, "tenant-a");
        assert_eq!(ttl, Some(Duration::from_millis(1500)));
        for (fairness, ttl) in [
            (Some(&b"has space"[..]), None),
            (Some(&[b'a'; 129][..]), None),
            (None, Some(&b"soon"[..])),
            (None, Some(&b"0"[..])),
        ] {
            let h = FlowHeaders {
                fairness_id: fairness,
                ttl,
                ..FlowHeaders::default()
            };
            assert!(r.classify(h, "m").is_err(), "{fairness:?} {ttl:?}");
        }
    }

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
