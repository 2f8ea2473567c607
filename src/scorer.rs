//! Endpoint scoring: among the endpoints that may take a request now, which
//! one should.
//!
//! Each scorer rates an endpoint from 0 (worst) to 1 (best); the picker
//! takes the highest weighted sum; equal sums take turns
//! ([`crate::placement`]'s score stage). A weight of 0
//! turns a scorer off. Only endpoints that are eligible, serve the model and
//! are not saturated are ever scored, so no weight can send work to a full
//! endpoint: affinity cannot create a hot spot past the saturation
//! thresholds.
//!
//! | scorer | score |
//! |---|---|
//! | `prefix-cache` | share of the request's leading prompt blocks the endpoint was sent recently ([`crate::prefix`]) |
//! | `free-slots` | free slots / total slots, by the balancer's own count plus foreign load |
//! | `kv-cache` | 1 − KV-cache use (1 when the engine does not report it) |
//! | `queue` | 1 − waiting requests / `queueDepthThreshold` |
//! | `adapter` | for a request naming a LoRA adapter: its residency there, running > loaded > room to load > must evict ([`crate::adapter`]); 0 for other requests |

use serde::{Deserialize, Serialize};

/// Weights of the scorers (config file: `scheduling.scorers`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ScorerWeights {
    #[serde(default = "ScorerWeights::default_prefix_cache")]
    pub prefix_cache: f64,
    #[serde(default = "ScorerWeights::default_free_slots")]
    pub free_slots: f64,
    #[serde(default = "ScorerWeights::default_kv_cache")]
    pub kv_cache: f64,
    #[serde(default = "ScorerWeights::default_queue")]
    pub queue: f64,
    #[serde(default = "ScorerWeights::default_adapter")]
    pub adapter: f64,
}

impl ScorerWeights {
    fn default_prefix_cache() -> f64 {
        3.0
    }
    fn default_free_slots() -> f64 {
        2.0
    }
    fn default_kv_cache() -> f64 {
        1.0
    }
    fn default_queue() -> f64 {
        1.0
    }
    /// Above the others' spread between a full and an idle endpoint (3):
    /// an adapter load costs more than a busier engine.
    fn default_adapter() -> f64 {
        4.0
    }

    /// The first weight that is negative or not a number, by config name.
    pub fn invalid(&self) -> Option<(&'static str, f64)> {
        [
            ("prefixCache", self.prefix_cache),
            ("freeSlots", self.free_slots),
            ("kvCache", self.kv_cache),
            ("queue", self.queue),
            ("adapter", self.adapter),
        ]
        .into_iter()
        .find(|(_, w)| !w.is_finite() || *w < 0.0)
    }
}

impl Default for ScorerWeights {
    fn default() -> Self {
        ScorerWeights {
            prefix_cache: Self::default_prefix_cache(),
            free_slots: Self::default_free_slots(),
            kv_cache: Self::default_kv_cache(),
            queue: Self::default_queue(),
            adapter: Self::default_adapter(),
        }
    }
}

/// What the scorers know of one candidate endpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Leading prompt blocks the endpoint holds, of `prefix_blocks`.
    pub prefix_matched: usize,
    pub prefix_blocks: usize,
    pub free_slots: u32,
    pub slots_total: u32,
    pub kv_cache_usage: Option<f64>,
    pub requests_waiting: u32,
    /// The saturation detector's queue threshold (the queue scorer's scale).
    pub queue_depth_threshold: u32,
    /// The `adapter` scorer's value, for a request naming an adapter
    /// ([`crate::adapter::Residency::score`]).
    pub adapter: Option<f64>,
}

/// Each scorer's weighted part of a candidate's score.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ScoreTerms {
    pub prefix_cache: f64,
    pub free_slots: f64,
    pub kv_cache: f64,
    pub queue: f64,
    pub adapter: f64,
}

impl ScoreTerms {
    pub fn total(&self) -> f64 {
        self.prefix_cache + self.free_slots + self.kv_cache + self.queue + self.adapter
    }
}

impl ScorerWeights {
    /// The weighted score of a candidate.
    pub fn score(&self, c: &Candidate) -> f64 {
        self.terms(c).total()
    }

    /// Each scorer's weighted part of a candidate's score.
    pub fn terms(&self, c: &Candidate) -> ScoreTerms {
        let prefix = if c.prefix_blocks == 0 {
            0.0
        } else {
            c.prefix_matched as f64 / c.prefix_blocks as f64
        };
        let free = if c.slots_total == 0 {
            0.0
        } else {
            f64::from(c.free_slots) / f64::from(c.slots_total)
        };
        let kv = 1.0 - c.kv_cache_usage.unwrap_or(0.0).clamp(0.0, 1.0);
        let threshold = c.queue_depth_threshold.max(1);
        let queue = 1.0 - f64::from(c.requests_waiting.min(threshold)) / f64::from(threshold);
        ScoreTerms {
            prefix_cache: self.prefix_cache * prefix,
            free_slots: self.free_slots * free,
            kv_cache: self.kv_cache * kv,
            queue: self.queue * queue,
            adapter: self.adapter * c.adapter.unwrap_or(0.0).clamp(0.0, 1.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate() -> Candidate {
        Candidate {
            prefix_matched: 0,
            prefix_blocks: 0,
            free_slots: 4,
            slots_total: 4,
            kv_cache_usage: None,
            requests_waiting: 0,
            queue_depth_threshold: 5,
            adapter: None,
        }
    }

    #[test]
    fn each_scorer_prefers_what_it_should() {
        let w = ScorerWeights::default();
        let base = w.score(&candidate());
        let better_prefix = Candidate {
            prefix_matched: 3,
            prefix_blocks: 4,
            ..candidate()
        };
        assert!((w.score(&better_prefix) - base - 3.0 * 0.75).abs() < 1e-9);
        let busier = Candidate {
            free_slots: 1,
            ..candidate()
        };
        assert!((base - w.score(&busier) - 2.0 * 0.75).abs() < 1e-9);
        let fuller_kv = Candidate {
            kv_cache_usage: Some(0.5),
            ..candidate()
        };
        assert!((base - w.score(&fuller_kv) - 0.5).abs() < 1e-9);
        let queued = Candidate {
            requests_waiting: 10,
            ..candidate()
        };
        assert!((base - w.score(&queued) - 1.0).abs() < 1e-9);
        let adapter_loaded = Candidate {
            adapter: Some(0.8),
            ..candidate()
        };
        assert!((w.score(&adapter_loaded) - base - 4.0 * 0.8).abs() < 1e-9);
    }

    #[test]
    fn zero_weights_turn_scorers_off() {
        let w = ScorerWeights {
            prefix_cache: 0.0,
            free_slots: 1.0,
            kv_cache: 0.0,
            queue: 0.0,
            adapter: 0.0,
        };
        let a = Candidate {
            prefix_matched: 4,
            prefix_blocks: 4,
            kv_cache_usage: Some(0.9),
            ..candidate()
        };
        assert_eq!(w.score(&a), w.score(&candidate()));
    }

    #[test]
    fn bad_weights_are_named() {
        let w = ScorerWeights {
            kv_cache: -1.0,
            ..ScorerWeights::default()
        };
        assert_eq!(w.invalid(), Some(("kvCache", -1.0)));
        assert_eq!(ScorerWeights::default().invalid(), None);
        let w = ScorerWeights {
            queue: f64::NAN,
            ..ScorerWeights::default()
        };
        assert_eq!(w.invalid().map(|(n, _)| n), Some("queue"));
    }
}
