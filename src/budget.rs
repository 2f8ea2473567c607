//! The async path's dispatch budget: how much queued async work may be out
//! on the fleet now.
//!
//! `D = 1 − S` is the fleet's spare capacity as a fraction (`S`, its
//! saturation, comes from the balancer's own view or a PromQL query), `B` a
//! reserved baseline kept free for interactive traffic, `max_sys` the
//! fleet's capacity in the budget's unit (requests, tokens or bytes):
//!
//! ```text
//! N = max_sys × (D − B)   when D > B: rounded down, but at least 1
//! N = 0                   when D ≤ B, when D cannot be read, and after the
//!                         fleet answered 429 until the next reading
//! ```
//!
//! `N` bounds the async work in flight: the dispatcher may start
//! `N − in_flight` more units.

/// The budget's fixed inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetConfig {
    /// The fleet's capacity in the budget's unit.
    pub max_sys: u64,
    /// Fraction of the fleet (0 to 1) kept for interactive traffic.
    pub baseline: f64,
}

impl BudgetConfig {
    /// `N` for a reading of `D` (`None`: unreadable).
    pub fn allowed(&self, spare: Option<f64>) -> u64 {
        let Some(d) = spare.filter(|d| d.is_finite()) else {
            return 0;
        };
        let d = d.clamp(0.0, 1.0);
        if d <= self.baseline || self.max_sys == 0 {
            return 0;
        }
        let n = (self.max_sys as f64 * (d - self.baseline)).floor() as u64;
        n.clamp(1, self.max_sys)
    }
}

/// The budget as the dispatcher keeps it between readings.
#[derive(Debug, Clone)]
pub struct Budget {
    config: BudgetConfig,
    spare: Option<f64>,
    throttled: bool,
}

impl Budget {
    /// A budget with no reading yet: closed.
    pub fn new(config: BudgetConfig) -> Self {
        Budget {
            config,
            spare: None,
            throttled: false,
        }
    }

    /// New fixed inputs (the fleet grew or shrank); keeps the reading.
    pub fn set_config(&mut self, config: BudgetConfig) {
        self.config = config;
    }

    /// A new reading of `D` (`None`: the metrics could not be read). Ends a
    /// 429 throttle.
    pub fn reading(&mut self, spare: Option<f64>) {
        self.spare = spare;
        self.throttled = false;
    }

    /// The fleet answered 429: closed until the next reading.
    pub fn throttled(&mut self) {
        self.throttled = true;
    }

    /// The last reading of `D` (0 while throttled or unreadable).
    pub fn spare(&self) -> f64 {
        if self.throttled {
            return 0.0;
        }
        self.spare.filter(|d| d.is_finite()).unwrap_or(0.0)
    }

    /// `N`, the most async work that may be in flight.
    pub fn allowed(&self) -> u64 {
        if self.throttled {
            return 0;
        }
        self.config.allowed(self.spare)
    }

    /// How much more may start with `in_flight` already out.
    pub fn available(&self, in_flight: u64) -> u64 {
        self.allowed().saturating_sub(in_flight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TEN: BudgetConfig = BudgetConfig {
        max_sys: 10,
        baseline: 0.2,
    };

    #[test]
    fn n_is_max_sys_times_spare_above_the_baseline() {
        assert_eq!(TEN.allowed(Some(1.0)), 8);
        assert_eq!(TEN.allowed(Some(0.75)), 5, "10 × 0.55 = 5.5, rounded down");
        assert_eq!(TEN.allowed(Some(0.21)), 1, "above the baseline: at least 1");
        assert_eq!(TEN.allowed(Some(0.2)), 0, "closed at the baseline");
        assert_eq!(TEN.allowed(Some(0.1)), 0);
        assert_eq!(TEN.allowed(None), 0, "unreadable metrics close the gate");
        assert_eq!(TEN.allowed(Some(f64::NAN)), 0);
        assert_eq!(TEN.allowed(Some(7.0)), 8, "D is clamped to 1");
    }

    #[test]
    fn a_429_closes_the_gate_until_the_next_reading() {
        let mut b = Budget::new(TEN);
        assert_eq!(b.allowed(), 0, "closed before the first reading");
        b.reading(Some(1.0));
        assert_eq!(b.available(3), 5);
        assert_eq!(b.available(9), 0);
        b.throttled();
        assert_eq!(b.allowed(), 0);
        assert_eq!(b.spare(), 0.0);
        b.reading(Some(0.5));
        assert_eq!(b.allowed(), 3);
        b.reading(None);
        assert_eq!(b.allowed(), 0);
    }

    proptest! {
        #[test]
        fn n_stays_within_zero_and_max_sys_and_grows_with_spare(
            max_sys in 0u64..10_000,
            baseline in 0.0f64..1.0,
            a in -1.0f64..2.0,
            b in -1.0f64..2.0,
        ) {
            let c = BudgetConfig { max_sys, baseline };
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            let (n_lo, n_hi) = (c.allowed(Some(lo)), c.allowed(Some(hi)));
            prop_assert!(n_hi <= max_sys);
            prop_assert!(n_lo <= n_hi, "monotonic in D");
            prop_assert_eq!(n_hi == 0, hi.clamp(0.0, 1.0) <= baseline || max_sys == 0);
        }
    }
}
