//! Latency objectives: how fast a request must be served, as its time to
//! first token (TTFT) and time per output token (TPOT), in milliseconds.
//!
//! A request names its own in headers (`x-slo-ttft-ms`, `x-slo-tpot-ms`,
//! or llm-d's `x-llm-d-slo-ttft-ms`, `x-llm-d-slo-tpot-ms`); what it does
//! not name comes from the operator's defaults, each field on its own: its
//! API key's, then its named objective's (`x-gateway-inference-objective`),
//! then its model's ([`ObjectiveDefaults`]). A request with neither is
//! served as before objectives existed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Header with the request's time-to-first-token objective (ms).
pub const TTFT_HEADER: &str = "x-slo-ttft-ms";
/// Header with the request's time-per-output-token objective (ms).
pub const TPOT_HEADER: &str = "x-slo-tpot-ms";
/// llm-d's name for [`TTFT_HEADER`] (read when ours is absent).
pub const LLMD_TTFT_HEADER: &str = "x-llm-d-slo-ttft-ms";
/// llm-d's name for [`TPOT_HEADER`] (read when ours is absent).
pub const LLMD_TPOT_HEADER: &str = "x-llm-d-slo-tpot-ms";

/// The longest objective accepted: an hour. Past it no router decision
/// matters, and a bound keeps deadlines from overflowing.
pub const MAX_OBJECTIVE_MS: u32 = 3_600_000;

/// A request's latency objective; each part optional.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Objective {
    /// Its first token within this many milliseconds of its arrival.
    pub ttft_ms: Option<u32>,
    /// Each further token within this many milliseconds, on average.
    pub tpot_ms: Option<u32>,
}

impl Objective {
    /// Whether it asks for nothing.
    pub fn is_none(&self) -> bool {
        self.ttft_ms.is_none() && self.tpot_ms.is_none()
    }

    /// Each part its own, else `fallback`'s.
    #[must_use]
    pub fn or(self, fallback: Objective) -> Objective {
        Objective {
            ttft_ms: self.ttft_ms.or(fallback.ttft_ms),
            tpot_ms: self.tpot_ms.or(fallback.tpot_ms),
        }
    }

    /// When its first token is due, for a request that arrived at
    /// `arrival`; `None` without a TTFT objective.
    pub fn deadline(&self, arrival: Instant) -> Option<Instant> {
        self.ttft_ms
            .map(|ms| arrival + Duration::from_millis(u64::from(ms)))
    }

    /// Checks a configured objective: each part 1 ..= [`MAX_OBJECTIVE_MS`].
    pub fn check(&self) -> Result<(), String> {
        for (name, v) in [("ttftMs", self.ttft_ms), ("tpotMs", self.tpot_ms)] {
            if let Some(v) = v {
                if v == 0 || v > MAX_OBJECTIVE_MS {
                    return Err(format!("{name} must be 1 to {MAX_OBJECTIVE_MS}, not {v}"));
                }
            }
        }
        Ok(())
    }
}

/// Parses an objective header's value: whole milliseconds, 1 ..=
/// [`MAX_OBJECTIVE_MS`], optional surrounding spaces.
pub fn parse_ms(value: &[u8]) -> Result<u32, String> {
    let text = std::str::from_utf8(value).map_err(|_| "not valid UTF-8".to_string())?;
    let text = text.trim();
    match text.parse::<u64>() {
        Ok(ms) if (1..=u64::from(MAX_OBJECTIVE_MS)).contains(&ms) => Ok(ms as u32),
        Ok(_) => Err(format!(
            "must be whole milliseconds from 1 to {MAX_OBJECTIVE_MS}"
        )),
        Err(_) => Err(format!(
            "must be whole milliseconds from 1 to {MAX_OBJECTIVE_MS}, not {text:?}"
        )),
    }
}

/// The operator's default objectives (config `latencyObjectives`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ObjectiveDefaults {
    /// By the `x-gateway-inference-objective` header's name.
    pub objectives: HashMap<String, Objective>,
    /// By the requested model.
    pub models: HashMap<String, Objective>,
}

impl ObjectiveDefaults {
    /// A request's objective: what its headers ask, then its API key's
    /// (`key`), its named objective's and its model's, part by part.
    pub fn resolve(
        &self,
        asked: Objective,
        key: Objective,
        objective: Option<&str>,
        model: &str,
    ) -> Objective {
        // Most fleets set no defaults: no look-ups then.
        if self.objectives.is_empty() && self.models.is_empty() {
            return asked.or(key);
        }
        let named = objective
            .and_then(|o| self.objectives.get(o))
            .copied()
            .unwrap_or_default();
        let by_model = self.models.get(model).copied().unwrap_or_default();
        asked.or(key).or(named).or(by_model)
    }
}

/// How long the hardest request with a TTFT objective stays the reference
/// after it came: past it, with none since, placement keeps no slot for
/// objectives (`placement::reserve`). Long against
/// the gaps between interactive requests at any load worth keeping a slot
/// for, short against a class that stopped coming.
pub const REFERENCE_WINDOW: Duration = Duration::from_secs(10);

/// The hardest request with a TTFT objective seen lately for a model: what
/// placement keeps free slots for (`placement::reserve`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reference {
    /// Its prompt tokens.
    pub tokens: u64,
    /// Its TTFT objective.
    pub ttft_ms: u32,
    /// When it came.
    pub at: Instant,
}

impl Reference {
    /// Whether it still counts at `now`.
    pub fn live(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.at) <= REFERENCE_WINDOW
    }

    /// Whether `other` replaces it at `now`: it is over, or `other` asks
    /// at least as many tokens per millisecond.
    pub fn yields_to(&self, other: &Reference, now: Instant) -> bool {
        !self.live(now)
            || u128::from(other.tokens) * u128::from(self.ttft_ms)
                >= u128::from(self.tokens) * u128::from(other.ttft_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_value_is_whole_milliseconds_within_an_hour() {
        assert_eq!(parse_ms(b"500"), Ok(500));
        assert_eq!(parse_ms(b" 20 "), Ok(20));
        assert_eq!(parse_ms(b"3600000"), Ok(MAX_OBJECTIVE_MS));
        for bad in [
            &b"0"[..],
            b"-5",
            b"3600001",
            b"1.5",
            b"500ms",
            b"",
            b"99999999999999999999999",
            b"\xff",
        ] {
            assert!(parse_ms(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn each_part_falls_back_on_its_own() {
        let defaults = ObjectiveDefaults {
            objectives: HashMap::from([(
                "chat".into(),
                Objective {
                    ttft_ms: Some(500),
                    tpot_ms: Some(50),
                },
            )]),
            models: HashMap::from([(
                "m".into(),
                Objective {
                    ttft_ms: Some(9_000),
                    tpot_ms: Some(90),
                },
            )]),
        };
        let asked = Objective {
            ttft_ms: Some(200),
            tpot_ms: None,
        };
        let key = Objective::default();
        assert_eq!(
            defaults.resolve(asked, key, Some("chat"), "m"),
            Objective {
                ttft_ms: Some(200),
                tpot_ms: Some(50)
            }
        );
        let key = Objective {
            ttft_ms: None,
            tpot_ms: Some(30),
        };
        assert_eq!(
            defaults.resolve(Objective::default(), key, Some("nope"), "m"),
            Objective {
                ttft_ms: Some(9_000),
                tpot_ms: Some(30)
            }
        );
        assert!(defaults
            .resolve(Objective::default(), Objective::default(), None, "other")
            .is_none());
    }

    #[test]
    fn the_deadline_is_arrival_plus_the_ttft_objective() {
        let t0 = Instant::now();
        let o = Objective {
            ttft_ms: Some(250),
            tpot_ms: None,
        };
        assert_eq!(o.deadline(t0), Some(t0 + Duration::from_millis(250)));
        assert_eq!(Objective::default().deadline(t0), None);
        assert!(Objective {
            ttft_ms: Some(0),
            tpot_ms: None
        }
        .check()
        .is_err());
    }

    #[test]
    fn the_reference_is_the_most_tokens_per_millisecond_until_it_is_over() {
        let t0 = Instant::now();
        let of = |tokens, ttft_ms, at| Reference {
            tokens,
            ttft_ms,
            at,
        };
        let hard = of(4_000, 500, t0);
        assert!(!hard.yields_to(&of(1_000, 500, t0), t0));
        assert!(
            !hard.yields_to(&of(8_000, 2_000, t0), t0),
            "4 a ms against 8"
        );
        assert!(hard.yields_to(&of(2_000, 250, t0), t0), "as hard");
        assert!(hard.yields_to(&of(u64::MAX, 1, t0), t0));
        let over = t0 + REFERENCE_WINDOW + Duration::from_millis(1);
        assert!(!hard.live(over));
        assert!(hard.yields_to(&of(1, 3_600_000, over), over));
    }
}
