//! How a request's headers and model become its flow (tenant, priority)
//! and TTL.

use std::collections::HashMap;
use std::time::Duration;

use super::headers::{
    FlowHeaders, FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, PRIORITY_HEADER, TTL_HEADER,
};
use crate::duration::parse_duration;
use crate::flow::{valid_fairness_id, FlowKey, DEFAULT_FAIRNESS_ID};

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
}
