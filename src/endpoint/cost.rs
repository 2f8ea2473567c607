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
//! memory is fixed (five windows of `f32` per endpoint). Before its first
//! sample an estimate is a cautious default ([`CostModel::default`]).
//!
//! Latency objectives need tails, not medians ([`CostModel::ttft_tail_ms`],
//! [`CostModel::tpot_tail_ms`]): the 90th percentile of the same windows,
//! and of how much later than its predicted prefill each streamed first
//! token came (the running batch's slowdown, the engine's own queue).

use std::time::Duration;

use serde::Serialize;

/// Samples each estimate keeps.
pub const WINDOW: usize = 16;

/// The quantile a tail estimate gives: the 90th percentile, as llm-d's
/// latency predictor trains for (of 16 samples, the 15th smallest).
pub const TAIL: f64 = 0.9;

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

    /// `pick` of the samples kept, sorted (never empty), or the default
    /// before any.
    fn of_sorted(&self, pick: impl FnOnce(&[f32]) -> f32) -> f64 {
        let n = usize::from(self.len);
        if n == 0 {
            return f64::from(self.default_ms);
        }
        let mut kept = self.samples;
        let kept = &mut kept[..n];
        kept.sort_unstable_by(f32::total_cmp);
        f64::from(pick(kept))
    }

    /// The median of the samples kept, or the default before any.
    pub fn ms(&self) -> f64 {
        self.of_sorted(|kept| {
            let n = kept.len();
            if n % 2 == 1 {
                kept[n / 2]
            } else {
                (kept[n / 2 - 1] + kept[n / 2]) / 2.0
            }
        })
    }

    /// The [`TAIL`] quantile of the samples kept (the nearest rank), or
    /// the default before any.
    pub fn tail_ms(&self) -> f64 {
        self.of_sorted(|kept| {
            let n = kept.len();
            kept[((TAIL * n as f64).ceil() as usize).clamp(1, n) - 1]
        })
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
    /// From the call to the first byte of a streamed answer (a whole
    /// answer's first byte says nothing of its first token).
    pub first_token: Option<Duration>,
}

/// One endpoint's learned costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    pub prefill_ms_per_token: Estimate,
    pub decode_ms_per_token: Estimate,
    pub service_ms: Estimate,
    /// How long loading a LoRA adapter delays a request's first token.
    pub adapter_load_ms: Estimate,
    /// How much later than its predicted prefill a streamed first token
    /// came: what the running batch and the engine's queue add.
    pub first_token_extra_ms: Estimate,
    /// How the tail predictions fared against what came.
    pub checked: PredictionCheck,
}

/// Predicted 90th-percentile times to first token against the observed
/// ones, of the requests with a latency objective: a calibrated
/// prediction is exceeded by about one in ten.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PredictionCheck {
    /// Predictions checked against a streamed first token.
    pub checked: u64,
    /// Of those, the first token came later than predicted.
    pub exceeded: u64,
    /// Sums of the predicted and of the observed times, ms.
    pub predicted_ms: f64,
    pub observed_ms: f64,
}

impl PredictionCheck {
    fn record(&mut self, predicted_ms: f64, observed_ms: f64) {
        if !(predicted_ms.is_finite() && observed_ms.is_finite()) {
            return;
        }
        self.checked += 1;
        self.exceeded += u64::from(observed_ms > predicted_ms);
        self.predicted_ms += predicted_ms;
        self.observed_ms += observed_ms;
    }
}

impl Default for CostModel {
    /// Before any answer: a CPU-class prefill (1 ms per token, so a long
    /// prompt is worth waiting a little for its cache), 20 ms per output
    /// token, a second per request, half a second to load an adapter
    /// (vLLM from local disk: a few hundred milliseconds), a first token
    /// one output token later than its prefill.
    fn default() -> Self {
        CostModel {
            prefill_ms_per_token: Estimate::new(1.0),
            decode_ms_per_token: Estimate::new(20.0),
            service_ms: Estimate::new(1_000.0),
            adapter_load_ms: Estimate::new(500.0),
            first_token_extra_ms: Estimate::new(20.0),
            checked: PredictionCheck::default(),
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
        if let Some(first) = t.first_token {
            let prefill = t.prefilled_tokens as f64 * self.prefill_ms_per_token.ms();
            self.first_token_extra_ms
                .record((ms(first) - prefill).max(0.0));
        }
    }

    /// Predicted 90th-percentile time to the first token of a request that
    /// starts now and prefills `uncached` prompt tokens: the prefill at the
    /// median rate, and the 90th percentile of how much later than that
    /// prediction first tokens came (the residuals of the same prediction:
    /// a tail learned for the very estimate it corrects, so nine in ten
    /// first tokens come within it; the tail rate on top of it would count
    /// the spread twice).
    pub fn ttft_tail_ms(&self, uncached: u64) -> f64 {
        uncached as f64 * self.prefill_ms_per_token.ms() + self.first_token_extra_ms.tail_ms()
    }

    /// Predicted 90th-percentile time per output token.
    pub fn tpot_tail_ms(&self) -> f64 {
        self.decode_ms_per_token.tail_ms()
    }

    /// What the model says now.
    pub fn snapshot(&self) -> CostSnapshot {
        CostSnapshot {
            prefill_ms_per_token: self.prefill_ms_per_token.ms(),
            decode_ms_per_token: self.decode_ms_per_token.ms(),
            service_ms: self.service_ms.ms(),
            adapter_load_ms: self.adapter_load_ms.ms(),
            samples: self.service_ms.samples(),
            first_token_extra_p90_ms: self.first_token_extra_ms.tail_ms(),
            tpot_p90_ms: self.tpot_tail_ms(),
            ttft_predictions: self.checked,
        }
    }
}

impl super::EndpointLedger {
    /// Learns from the timing of the answer to `lease`'s request. Call
    /// before the lease is given back.
    pub(crate) fn observe_timing(&mut self, lease: &super::Lease, timing: &Timing) {
        if let Some(ep) = self.endpoints.get_mut(&lease.endpoint) {
            if let (Some(predicted), Some(first)) = (lease.ttft_p90_ms, timing.first_token) {
                ep.cost.checked.record(f64::from(predicted), ms(first));
            }
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
    /// The 90th percentile of how much later than their prefill first
    /// tokens came, and of the time per output token.
    pub first_token_extra_p90_ms: f64,
    pub tpot_p90_ms: f64,
    /// How the predicted TTFT tails fared.
    pub ttft_predictions: PredictionCheck,
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
            first_token: None,
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

    #[test]
    fn a_tail_is_the_ninetieth_percentile_of_the_window_and_follows_a_slowdown() {
        let mut e = Estimate::new(7.0);
        assert_eq!(e.tail_ms(), 7.0, "the prior before any sample");
        for ms in 1..=10 {
            e.record(f64::from(ms));
        }
        assert_eq!(e.tail_ms(), 9.0);
        assert_eq!(e.ms(), 5.5);
        for _ in 0..WINDOW {
            e.record(30.0);
        }
        assert_eq!(e.tail_ms(), 30.0, "the window forgets");
    }

    #[test]
    fn predictions_are_checked_against_the_first_tokens_that_came() {
        let mut c = PredictionCheck::default();
        c.record(100.0, 80.0);
        c.record(100.0, 120.0);
        c.record(f64::NAN, 1.0);
        assert_eq!((c.checked, c.exceeded), (2, 1));
        assert_eq!((c.predicted_ms, c.observed_ms), (200.0, 200.0));
    }

    #[test]
    fn a_first_token_later_than_its_prefill_teaches_the_tail_of_that_delay() {
        let mut m = CostModel::default();
        for i in 0..10u64 {
            // 1,000 tokens at 0.1 ms; first tokens 100-190 ms later.
            let mut t = timing(1_000, 100, 10, 100);
            t.first_token = Some(Duration::from_millis(200 + 10 * i));
            m.learn(&t);
        }
        assert!((m.first_token_extra_ms.tail_ms() - 180.0).abs() < 1e-3);
        // 500 uncached tokens at the median rate (0.1 ms) and that delay.
        assert!((m.ttft_tail_ms(500) - 230.0).abs() < 1e-3);
        assert!((m.tpot_tail_ms() - 10.0).abs() < 1e-6);
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
