//! What an endpoint's engine costs, learned online from its own answers:
//! prefill time per uncached prompt token, decode time per output token
//! and service time per request (how long a slot stays taken).
//!
//! The engines say how long they took: llama.cpp ends every answer with
//! `timings` (`prompt_ms` for `prompt_n` uncached tokens, `predicted_ms`
//! for `predicted_n` output tokens). For the others the balancer measures:
//! prefill from the call to the answer's first byte over the tokens that
//! were not cached, decode from the first byte to the last over the output
//! tokens after the first, service from the call to the end.
//!
//! Each estimate is the median of the last [`WINDOW`] samples: one slow
//! answer (a cold start, a preempted request) moves it not at all, an
//! engine that slows down for good moves it within half a window, and the
//! memory is fixed (three windows of `f32` per endpoint). Before its first
//! sample an estimate is a cautious default ([`CostModel::default`]).

use std::time::Duration;

use serde::Serialize;

/// Samples each estimate keeps.
pub const WINDOW: usize = 16;

/// A running median of the last [`WINDOW`] samples, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    samples: [f32; WINDOW],
    len: u8,
    next: u8,
    default_ms: f32,
}

impl Estimate {
    pub const fn new(default_ms: f32) -> Self {
        Estimate {
            samples: [0.0; WINDOW],
            len: 0,
            next: 0,
            default_ms,
        }
    }

    /// Records a sample; a non-finite or negative one is no sample.
    pub fn record(&mut self, ms: f64) {
        if !ms.is_finite() || ms < 0.0 {
            return;
        }
        self.samples[usize::from(self.next)] = ms as f32;
        self.next = ((usize::from(self.next) + 1) % WINDOW) as u8;
        self.len = (usize::from(self.len) + 1).min(WINDOW) as u8;
    }

    /// Samples recorded, up to [`WINDOW`].
    pub fn samples(&self) -> usize {
        usize::from(self.len)
    }

    /// The median of the samples kept, or the default before any.
    pub fn ms(&self) -> f64 {
        let n = usize::from(self.len);
        if n == 0 {
            return f64::from(self.default_ms);
        }
        let mut kept = self.samples;
        let kept = &mut kept[..n];
        kept.sort_unstable_by(f32::total_cmp);
        let mid = if n % 2 == 1 {
            kept[n / 2]
        } else {
            (kept[n / 2 - 1] + kept[n / 2]) / 2.0
        };
        f64::from(mid)
    }
}

/// What one answer showed of its engine's speed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timing {
    /// Prompt tokens the engine processed (not found cached), and how long
    /// that took: the engine's own `prompt_ms`, else the time to the
    /// first byte.
    pub prefilled_tokens: u64,
    pub prefill: Option<Duration>,
    /// Output tokens, and how long generating them took (the engine's
    /// `predicted_ms`, else first to last byte, over the tokens after the
    /// first).
    pub output_tokens: u64,
    pub decode: Option<Duration>,
    /// From the call to the end of the answer.
    pub service: Option<Duration>,
}

/// One endpoint's learned costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    pub prefill_ms_per_token: Estimate,
    pub decode_ms_per_token: Estimate,
    pub service_ms: Estimate,
    /// How long loading a LoRA adapter delays a request's first token.
    pub adapter_load_ms: Estimate,
}

impl Default for CostModel {
    /// Before any answer: a CPU-class prefill (1 ms per token, so a long
    /// prompt is worth waiting a little for its cache), 20 ms per output
    /// token, a second per request, half a second to load an adapter
    /// (vLLM from local disk: a few hundred milliseconds).
    fn default() -> Self {
        CostModel {
            prefill_ms_per_token: Estimate::new(1.0),
            decode_ms_per_token: Estimate::new(20.0),
            service_ms: Estimate::new(1_000.0),
            adapter_load_ms: Estimate::new(500.0),
        }
    }
}

/// Fewer tokens than this say too little about a per-token rate (a
/// template's few tokens, a cached prompt's tail).
const MIN_TOKENS_FOR_RATE: u64 = 16;

impl CostModel {
    /// Learns from one answer of a request that waited for its LoRA
    /// adapter to load: the time to its first token beyond the predicted
    /// prefill is the load's (and says nothing of the prefill rate).
    pub fn learn_after_load(&mut self, t: &Timing) {
        if let Some(prefill) = t.prefill {
            let predicted = t.prefilled_tokens as f64 * self.prefill_ms_per_token.ms();
            self.adapter_load_ms
                .record((ms(prefill) - predicted).max(0.0));
        }
        self.learn(&Timing {
            prefill: None,
            ..*t
        });
    }

    /// Learns from one answer.
    pub fn learn(&mut self, t: &Timing) {
        if let Some(prefill) = t.prefill {
            if t.prefilled_tokens >= MIN_TOKENS_FOR_RATE {
                self.prefill_ms_per_token
                    .record(ms(prefill) / t.prefilled_tokens as f64);
            }
        }
        if let Some(decode) = t.decode {
            if t.output_tokens >= 2 {
                self.decode_ms_per_token
                    .record(ms(decode) / t.output_tokens as f64);
            }
        }
        if let Some(service) = t.service {
            self.service_ms.record(ms(service));
        }
    }

    /// What the model says now.
    pub fn snapshot(&self) -> CostSnapshot {
        CostSnapshot {
            prefill_ms_per_token: self.prefill_ms_per_token.ms(),
            decode_ms_per_token: self.decode_ms_per_token.ms(),
            service_ms: self.service_ms.ms(),
            adapter_load_ms: self.adapter_load_ms.ms(),
            samples: self.service_ms.samples(),
        }
    }
}

impl super::EndpointLedger {
    /// Learns from the timing of the answer to `lease`'s request. Call
    /// before the lease is given back.
    pub(crate) fn observe_timing(&mut self, lease: &super::Lease, timing: &Timing) {
        if let Some(ep) = self.endpoints.get_mut(&lease.endpoint) {
            if lease.loads_adapter {
                ep.cost.learn_after_load(timing);
            } else {
                ep.cost.learn(timing);
            }
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}

/// An endpoint's learned costs, for the management API and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CostSnapshot {
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_token: f64,
    pub service_ms: f64,
    pub adapter_load_ms: f64,
    /// Answers the service time was learned from (up to the window): 0
    /// means every figure is still the default.
    pub samples: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn timing(prefilled: u64, prefill_ms: u64, out: u64, decode_ms: u64) -> Timing {
        Timing {
            prefilled_tokens: prefilled,
            prefill: Some(Duration::from_millis(prefill_ms)),
            output_tokens: out,
            decode: Some(Duration::from_millis(decode_ms)),
            service: Some(Duration::from_millis(prefill_ms + decode_ms)),
        }
    }

    #[test]
    fn defaults_until_the_first_answer_then_what_the_engine_showed() {
        let mut m = CostModel::default();
        assert_eq!(m.snapshot().prefill_ms_per_token, 1.0);
        assert_eq!(m.snapshot().samples, 0);
        m.learn(&timing(1_000, 150, 24, 240));
        let s = m.snapshot();
        assert!((s.prefill_ms_per_token - 0.15).abs() < 1e-6);
        assert!((s.decode_ms_per_token - 10.0).abs() < 1e-6);
        assert!((s.service_ms - 390.0).abs() < 1e-3);
        assert_eq!(s.samples, 1);
    }

    #[test]
    fn one_outlier_moves_nothing_and_a_lasting_change_moves_it_within_half_a_window() {
        let mut m = CostModel::default();
        for _ in 0..WINDOW {
            m.learn(&timing(1_000, 100, 10, 100));
        }
        m.learn(&timing(1_000, 60_000, 10, 100));
        assert!(
            (m.snapshot().prefill_ms_per_token - 0.1).abs() < 1e-6,
            "one slow answer"
        );
        // The engine slows down three times for good.
        let mut moved_after = None;
        for i in 1..=WINDOW {
            m.learn(&timing(1_000, 300, 10, 100));
            if moved_after.is_none() && m.snapshot().prefill_ms_per_token > 0.2 {
                moved_after = Some(i);
            }
        }
        assert!(moved_after.unwrap() <= WINDOW / 2, "{moved_after:?}");
        assert!((m.snapshot().prefill_ms_per_token - 0.3).abs() < 1e-6);
    }

    #[test]
    fn too_few_tokens_teach_no_rate() {
        let mut m = CostModel::default();
        m.learn(&timing(3, 300, 1, 500));
        let s = m.snapshot();
        assert_eq!((s.prefill_ms_per_token, s.decode_ms_per_token), (1.0, 20.0));
        assert_eq!(s.samples, 1, "the service time still counts");
    }

    proptest! {
        /// Whatever answers say, the estimates stay finite, non-negative
        /// and between the smallest and largest sample.
        #[test]
        fn estimates_stay_within_their_samples(
            samples in proptest::collection::vec(
                (0u64..1_000_000, 0u64..10_000_000, 0u64..100_000, 0u64..10_000_000), 1..64),
        ) {
            let mut m = CostModel::default();
            for (p, pm, o, om) in &samples {
                m.learn(&timing(*p, *pm, *o, *om));
            }
            let s = m.snapshot();
            for v in [s.prefill_ms_per_token, s.decode_ms_per_token, s.service_ms] {
                prop_assert!(v.is_finite() && v >= 0.0);
            }
            let services: Vec<f64> = samples.iter().map(|(_, pm, _, om)| (pm + om) as f64).collect();
            let lo = services.iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = services.iter().cloned().fold(0.0, f64::max);
            prop_assert!(s.service_ms >= lo * 0.999 && s.service_ms <= hi * 1.001);
        }
    }
}
