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
/// after it came, at most (at least half of it): past it, with none since,
/// placement keeps no slot for objectives (`placement::reserve`). Long
/// against the gaps between interactive requests at any load worth keeping
/// a slot for, short against a class that stopped coming.
pub const REFERENCE_WINDOW: Duration = Duration::from_secs(10);

/// A request with a TTFT objective, by how hard it is to serve in time:
/// what placement keeps free slots for (`placement::reserve`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reference {
    /// Its prompt tokens.
    pub tokens: u64,
    /// Its TTFT objective.
    pub ttft_ms: u32,
}

impl Reference {
    /// Whether it asks at least as many prompt tokens per millisecond of
    /// objective as `other`.
    pub fn at_least_as_hard(&self, other: &Reference) -> bool {
        u128::from(self.tokens) * u128::from(other.ttft_ms)
            >= u128::from(other.tokens) * u128::from(self.ttft_ms)
    }
}

/// The hardest request with a TTFT objective for a model lately: the
/// hardest of the current half of [`REFERENCE_WINDOW`] and of the half
/// before it, so of the last 5 to 10 s. One hardest request kept until it
/// expired gave way, the moment it did, to whichever came next: often a
/// short prompt that every endpoint serves in time, for which no slot is
/// kept, so for a second or so in every ten, work without an objective
/// took every fast slot as it freed (BENCHMARKS.md, session 40).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hardest {
    /// When the current half began.
    since: Instant,
    /// The hardest of the current half, and of the half before it.
    current: Option<Reference>,
    previous: Option<Reference>,
}

impl Hardest {
    pub fn new(now: Instant) -> Self {
        Hardest {
            since: now,
            current: None,
            previous: None,
        }
    }

    /// A request `seen` came at `now` (times never go back).
    pub fn note(&mut self, seen: Reference, now: Instant) {
        let half = REFERENCE_WINDOW / 2;
        let elapsed = now.saturating_duration_since(self.since);
        if elapsed >= half {
            self.previous = if elapsed < 2 * half {
                self.current
            } else {
                None
            };
            self.current = None;
            self.since = if elapsed < 2 * half {
                self.since + half
            } else {
                now
            };
        }
        if self.current.is_none_or(|c| seen.at_least_as_hard(&c)) {
            self.current = Some(seen);
        }
    }

    /// The hardest at `now`, if any came in the last half window at least.
    pub fn get(&self, now: Instant) -> Option<Reference> {
        let half = REFERENCE_WINDOW / 2;
        let elapsed = now.saturating_duration_since(self.since);
        let candidates = if elapsed < half {
            [self.current, self.previous]
        } else if elapsed < 2 * half {
            [self.current, None]
        } else {
            [None, None]
        };
        candidates
            .into_iter()
            .flatten()
            .reduce(|a, b| if a.at_least_as_hard(&b) { a } else { b })
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
    fn the_reference_is_the_hardest_of_the_last_five_to_ten_seconds() {
        let t0 = Instant::now();
        let of = |tokens, ttft_ms| Reference { tokens, ttft_ms };
        let at = |ms| t0 + Duration::from_millis(ms);
        assert!(of(2_000, 250).at_least_as_hard(&of(4_000, 500)), "as hard");
        assert!(!of(8_000, 2_000).at_least_as_hard(&of(4_000, 500)));
        assert!(of(u64::MAX, 1).at_least_as_hard(&of(4_000, 500)));
        let mut hardest = Hardest::new(t0);
        assert_eq!(hardest.get(t0), None);
        hardest.note(of(4_000, 500), t0);
        hardest.note(of(1_000, 500), at(1_000));
        assert_eq!(hardest.get(at(1_000)), Some(of(4_000, 500)));
        // Easier requests keep coming: the hard one stands until 10 s
        // after it came, never falling to an easy one sooner...
        for ms in [6_000, 9_000, 9_900] {
            hardest.note(of(300, 500), at(ms));
            assert_eq!(hardest.get(at(ms)), Some(of(4_000, 500)), "{ms} ms");
        }
        // ... then the hardest of the last five to ten seconds (here of
        // the half that began at 5 s: the 1,000 tokens of 1 s are before).
        assert_eq!(hardest.get(at(10_001)), Some(of(300, 500)));
        hardest.note(of(200, 500), at(12_000));
        assert_eq!(hardest.get(at(12_000)), Some(of(300, 500)));
        // None for a whole window: none.
        assert_eq!(hardest.get(at(25_000)), None);
        hardest.note(of(100, 500), at(40_000));
        assert_eq!(hardest.get(at(40_000)), Some(of(100, 500)));
    }
}
