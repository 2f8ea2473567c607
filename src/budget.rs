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
//! `N − in_flight` more units. [`DispatchGate`] keeps the readings of `D`
//! (a window's lowest local reading, or Prometheus capped by it) and the
//! 429 throttle; the dispatcher only does the I/O.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

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

/// Where the gate's `D` comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpareSource {
    /// `D = 1`: only `max_sys` bounds async work.
    AlwaysOpen,
    /// This balancer's own view: the lowest reading of the last interval
    /// (a moment when interactive clients happen to be between requests is
    /// not spare capacity).
    Local,
    /// A PromQL query read every interval, capped by the lowest local
    /// reading of the last second: this balancer's own interactive load
    /// shows there at once, in Prometheus only a scrape later.
    Prometheus,
}

/// The gate's fixed settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GateConfig {
    pub source: SpareSource,
    /// The local window ([`SpareSource::Local`]), how often Prometheus is
    /// read, and how long a 429 closes the gate.
    pub interval: Duration,
    /// The fleet's capacity in the budget's unit; `None`: its slots, as
    /// reported.
    pub max_sys: Option<u64>,
    /// Fraction of the fleet kept for interactive traffic.
    pub baseline: f64,
}

/// The async path's gate: the [`Budget`] fed with readings of `D` as
/// [`GateConfig::source`] says, and closed for an interval after the fleet
/// answered 429. The dispatcher gives it a local reading every round and a
/// Prometheus reading when [`DispatchGate::prometheus_due`].
#[derive(Debug, Clone)]
pub struct DispatchGate {
    config: GateConfig,
    budget: Budget,
    /// Local readings of the window, oldest first.
    window: VecDeque<(Instant, f64)>,
    prometheus: Option<f64>,
    last_prometheus: Option<Instant>,
    throttled_until: Option<Instant>,
}

impl DispatchGate {
    /// A gate with no reading yet: closed.
    pub fn new(config: GateConfig) -> Self {
        DispatchGate {
            budget: Budget::new(BudgetConfig {
                max_sys: 0,
                baseline: config.baseline,
            }),
            config,
            window: VecDeque::new(),
            prometheus: None,
            last_prometheus: None,
            throttled_until: None,
        }
    }

    /// Whether Prometheus is to be read now.
    pub fn prometheus_due(&self, now: Instant) -> bool {
        self.config.source == SpareSource::Prometheus
            && self
                .last_prometheus
                .is_none_or(|t| now.saturating_duration_since(t) >= self.config.interval)
    }

    /// What Prometheus said (`None`: it could not be read, and `D` is 0
    /// until it can).
    pub fn prometheus_reading(&mut self, spare: Option<f64>, now: Instant) {
        self.prometheus = spare.filter(|d| d.is_finite());
        self.last_prometheus = Some(now);
    }

    /// This balancer's own reading of `D` and the fleet's `slots`, every
    /// round. Sets the budget from the readings unless a 429 still closes
    /// it.
    pub fn round(&mut self, local: f64, slots: u64, now: Instant) {
        let window = match self.config.source {
            SpareSource::Local => self.config.interval,
            _ => Duration::from_secs(1),
        };
        self.window.push_back((now, local));
        while self
            .window
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > window)
        {
            self.window.pop_front();
        }
        if self.throttled_until.is_some_and(|t| now < t) {
            return;
        }
        self.throttled_until = None;
        let local_min = self.window.iter().map(|(_, d)| *d).fold(local, f64::min);
        self.budget.set_config(BudgetConfig {
            max_sys: self.config.max_sys.unwrap_or(slots),
            baseline: self.config.baseline,
        });
        self.budget.reading(match self.config.source {
            SpareSource::AlwaysOpen => Some(1.0),
            SpareSource::Local => Some(local_min),
            SpareSource::Prometheus => self.prometheus.map(|d| d.min(local_min)),
        });
    }

    /// The fleet answered 429: closed for one interval.
    pub fn throttled(&mut self, now: Instant) {
        self.budget.throttled();
        self.throttled_until = Some(now + self.config.interval);
    }

    pub fn budget(&self) -> &Budget {
        &self.budget
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

    fn gate(source: SpareSource) -> DispatchGate {
        DispatchGate::new(GateConfig {
            source,
            interval: Duration::from_secs(2),
            max_sys: None,
            baseline: 0.0,
        })
    }

    #[test]
    fn the_local_gate_keeps_the_lowest_reading_of_its_window() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut g = gate(SpareSource::Local);
        assert_eq!(g.budget().allowed(), 0, "closed before a reading");
        g.round(1.0, 10, at(0));
        assert_eq!(g.budget().allowed(), 10);
        g.round(0.3, 10, at(500));
        g.round(1.0, 10, at(1000));
        assert_eq!(
            g.budget().allowed(),
            3,
            "a busy moment counts for the window"
        );
        g.round(1.0, 10, at(2600));
        assert_eq!(g.budget().allowed(), 10, "and is forgotten after it");
        g.round(1.0, 4, at(2700));
        assert_eq!(g.budget().allowed(), 4, "the fleet's slots, as reported");
    }

    #[test]
    fn a_429_closes_the_gate_for_one_interval() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut g = gate(SpareSource::AlwaysOpen);
        g.round(0.0, 10, at(0));
        assert_eq!(g.budget().allowed(), 10);
        g.throttled(at(100));
        g.round(0.0, 10, at(1000));
        assert_eq!(g.budget().allowed(), 0);
        g.round(0.0, 10, at(2100));
        assert_eq!(g.budget().allowed(), 10, "open again after the interval");
    }

    #[test]
    fn prometheus_is_read_every_interval_and_capped_by_the_local_view() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut g = gate(SpareSource::Prometheus);
        assert!(g.prometheus_due(at(0)));
        g.round(1.0, 10, at(0));
        assert_eq!(g.budget().allowed(), 0, "nothing read yet: closed");
        g.prometheus_reading(Some(0.9), at(0));
        assert!(!g.prometheus_due(at(1000)));
        assert!(g.prometheus_due(at(2000)));
        g.round(0.5, 10, at(100));
        assert_eq!(
            g.budget().allowed(),
            5,
            "this balancer's load shows at once"
        );
        g.round(1.0, 10, at(1200));
        assert_eq!(g.budget().allowed(), 9);
        g.prometheus_reading(None, at(2000));
        g.round(1.0, 10, at(2000));
        assert_eq!(g.budget().allowed(), 0, "unreadable: closed");
        g.prometheus_reading(Some(f64::NAN), at(4000));
        g.round(1.0, 10, at(4000));
        assert_eq!(g.budget().allowed(), 0);
        assert!(!gate(SpareSource::Local).prometheus_due(at(0)));
    }

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
