//! The last minutes of traffic, for the dashboard: request rates by outcome,
//! TTFT / buffer-wait percentiles and latency objectives met per interval.
//!
//! Nothing is added to the request path: every [`INTERVAL`] the housekeeping
//! task reads the cumulative Prometheus counters and histograms
//! ([`Tallies`]) and keeps the last [`KEEP`] readings; an interval's rates
//! and percentiles are the difference of two neighbouring readings.
//! Percentiles are interpolated inside the histogram's buckets, as
//! Prometheus' `histogram_quantile` does, so they are as fine as the buckets.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Time between two readings.
pub const INTERVAL: Duration = Duration::from_secs(2);
/// Readings kept: ten minutes.
pub const KEEP: usize = 300;

/// The outcome classes the dashboard charts, in chart order.
pub const OUTCOMES: [&str; 5] = ["200", "429", "503", "504", "other"];

/// Cumulative counts read off the metrics at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tallies {
    /// Finished requests per [`OUTCOMES`] class.
    pub outcomes: [u64; OUTCOMES.len()],
    /// Answered requests with a latency objective, and those that met every
    /// part of it.
    pub objective_answered: u64,
    pub objective_met: u64,
    /// Time to first token: cumulative count per bucket of [`Tallies::bounds`]
    /// (upper bounds, seconds), then the total (the `+Inf` bucket).
    pub ttft: Vec<u64>,
    /// Buffer wait of requests that waited, as `ttft`.
    pub wait: Vec<u64>,
    /// The buckets' upper bounds, shared by both histograms.
    pub bounds: Vec<f64>,
}

impl Tallies {
    /// The outcome class of an HTTP status.
    pub fn class(code: u16) -> usize {
        match code {
            200..=299 => 0,
            429 => 1,
            503 => 2,
            504 => 3,
            _ => 4,
        }
    }
}

struct Reading {
    at: Instant,
    unix_ms: u64,
    tallies: Tallies,
}

/// One interval, as the dashboard reads it.
#[derive(Debug, Serialize, PartialEq)]
pub struct Point {
    /// End of the interval, Unix milliseconds.
    pub t: u64,
    /// Requests finished in the interval, per [`OUTCOMES`] class.
    pub counts: [u64; OUTCOMES.len()],
    /// The same per second.
    pub rates: [f64; OUTCOMES.len()],
    /// Time to first token (streamed answers), seconds; `null` when no
    /// stream started in the interval.
    pub ttft_p50: Option<f64>,
    pub ttft_p99: Option<f64>,
    /// Buffer wait of the requests that waited, seconds.
    pub wait_p50: Option<f64>,
    pub wait_p99: Option<f64>,
    /// Requests with a latency objective answered in the interval, and
    /// those that met every part of it.
    pub objectives_answered: u64,
    pub objectives_met: u64,
    /// The latter a second: the goodput.
    pub goodput: f64,
}

#[derive(Default)]
pub struct History {
    readings: Mutex<VecDeque<Reading>>,
}

impl History {
    /// Whether a reading is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        let readings = self.readings.lock().expect("history lock");
        readings
            .back()
            .is_none_or(|last| now.duration_since(last.at) >= INTERVAL)
    }

    pub fn record(&self, now: Instant, tallies: Tallies) {
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut readings = self.readings.lock().expect("history lock");
        if readings.len() > KEEP {
            readings.pop_front();
        }
        readings.push_back(Reading {
            at: now,
            unix_ms,
            tallies,
        });
    }

    /// The intervals between neighbouring readings, oldest first.
    pub fn points(&self) -> Vec<Point> {
        let readings = self.readings.lock().expect("history lock");
        readings
            .iter()
            .zip(readings.iter().skip(1))
            .map(|(a, b)| point(a, b))
            .collect()
    }
}

fn point(a: &Reading, b: &Reading) -> Point {
    let secs = b.at.duration_since(a.at).as_secs_f64().max(1e-3);
    let mut counts = [0; OUTCOMES.len()];
    for (i, count) in counts.iter_mut().enumerate() {
        *count = b.tallies.outcomes[i].saturating_sub(a.tallies.outcomes[i]);
    }
    let rates = counts.map(|c| c as f64 / secs);
    let ttft = delta(&a.tallies.ttft, &b.tallies.ttft);
    let wait = delta(&a.tallies.wait, &b.tallies.wait);
    let bounds = &b.tallies.bounds;
    let answered = b
        .tallies
        .objective_answered
        .saturating_sub(a.tallies.objective_answered);
    let met = b
        .tallies
        .objective_met
        .saturating_sub(a.tallies.objective_met);
    Point {
        t: b.unix_ms,
        counts,
        rates,
        ttft_p50: quantile(0.5, bounds, &ttft),
        ttft_p99: quantile(0.99, bounds, &ttft),
        wait_p50: quantile(0.5, bounds, &wait),
        wait_p99: quantile(0.99, bounds, &wait),
        objectives_answered: answered,
        objectives_met: met,
        goodput: met as f64 / secs,
    }
}

fn delta(a: &[u64], b: &[u64]) -> Vec<u64> {
    if a.len() != b.len() {
        return b.to_vec();
    }
    a.iter().zip(b).map(|(x, y)| y.saturating_sub(*x)).collect()
}

/// The `q` quantile of a histogram given as cumulative bucket counts (the
/// last one the total), interpolated linearly inside the bucket it falls in.
/// A quantile in the `+Inf` bucket is the largest finite bound. `None` when
/// the histogram is empty.
pub fn quantile(q: f64, bounds: &[f64], cumulative: &[u64]) -> Option<f64> {
    let total = *cumulative.last()?;
    if total == 0 || cumulative.len() != bounds.len() + 1 {
        return None;
    }
    let rank = q * total as f64;
    let bucket = cumulative.iter().position(|&c| c as f64 >= rank)?;
    let Some(&upper) = bounds.get(bucket) else {
        return bounds.last().copied();
    };
    let (lower, below) = match bucket {
        0 => (0.0, 0),
        i => (bounds[i - 1], cumulative[i - 1]),
    };
    let inside = cumulative[bucket] - below;
    if inside == 0 {
        return Some(upper);
    }
    Some(lower + (upper - lower) * (rank - below as f64) / inside as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: [f64; 3] = [0.1, 0.5, 1.0];

    fn tallies(outcomes: [u64; 5], ttft: [u64; 4], wait: [u64; 4]) -> Tallies {
        Tallies {
            outcomes,
            objective_answered: 0,
            objective_met: 0,
            ttft: ttft.to_vec(),
            wait: wait.to_vec(),
            bounds: BOUNDS.to_vec(),
        }
    }

    #[test]
    fn quantiles_interpolate_inside_the_bucket_like_prometheus() {
        // 10 observations <= 0.1, 10 more in (0.1, 0.5].
        let cumulative = [10, 20, 20, 20];
        assert_eq!(quantile(0.5, &BOUNDS, &cumulative), Some(0.1));
        let p75 = quantile(0.75, &BOUNDS, &cumulative).unwrap();
        assert!((p75 - 0.3).abs() < 1e-9, "{p75}");
        let p25 = quantile(0.25, &BOUNDS, &cumulative).unwrap();
        assert!((p25 - 0.05).abs() < 1e-9, "{p25}");
        // Beyond the last bound: the last bound.
        assert_eq!(quantile(0.99, &BOUNDS, &[0, 0, 0, 5]), Some(1.0));
        assert_eq!(quantile(0.5, &BOUNDS, &[0, 0, 0, 0]), None);
        assert_eq!(quantile(0.5, &BOUNDS, &[1, 2]), None, "mismatched bounds");
    }

    #[test]
    fn points_are_rates_and_percentiles_of_each_interval() {
        let history = History::default();
        let t0 = Instant::now();
        history.record(t0, tallies([0; 5], [0; 4], [0; 4]));
        assert!(history.points().is_empty(), "one reading is no interval");
        assert!(!history.due(t0 + INTERVAL / 2));
        assert!(history.due(t0 + INTERVAL));
        history.record(
            t0 + Duration::from_secs(2),
            tallies([20, 4, 0, 2, 0], [0, 8, 8, 8], [0; 4]),
        );
        // Second interval: only what happened in it counts.
        history.record(
            t0 + Duration::from_secs(4),
            tallies([30, 4, 0, 2, 1], [8, 8, 8, 8], [2, 2, 4, 4]),
        );
        let points = history.points();
        assert_eq!(points.len(), 2);
        assert_eq!(points[0].counts, [20, 4, 0, 2, 0]);
        assert_eq!(points[0].rates, [10.0, 2.0, 0.0, 1.0, 0.0]);
        let p50 = points[0].ttft_p50.unwrap();
        assert!((p50 - 0.3).abs() < 1e-9, "{p50}");
        assert_eq!(points[0].wait_p50, None, "nobody waited");
        assert_eq!(points[1].rates, [5.0, 0.0, 0.0, 0.0, 0.5]);
        assert_eq!(points[1].ttft_p99, None, "no stream started");
        assert_eq!(points[1].wait_p50, Some(0.1));
        assert!(points[1].wait_p99.unwrap() > 0.1);
    }

    #[test]
    fn objectives_met_are_counted_per_interval_with_their_rate() {
        let history = History::default();
        let t0 = Instant::now();
        let with = |answered, met| Tallies {
            objective_answered: answered,
            objective_met: met,
            ..Tallies::default()
        };
        history.record(t0, with(0, 0));
        history.record(t0 + Duration::from_secs(2), with(10, 8));
        history.record(t0 + Duration::from_secs(4), with(10, 8));
        let points = history.points();
        let of = |p: &Point| (p.objectives_answered, p.objectives_met, p.goodput);
        assert_eq!(of(&points[0]), (10, 8, 4.0));
        assert_eq!(of(&points[1]), (0, 0, 0.0), "only the interval's");
    }

    #[test]
    fn keeps_ten_minutes() {
        let history = History::default();
        let t0 = Instant::now();
        for i in 0..(KEEP as u64 + 50) {
            history.record(t0 + INTERVAL * i as u32, Tallies::default());
        }
        assert_eq!(history.points().len(), KEEP);
    }

    #[test]
    fn statuses_fall_into_the_charted_classes() {
        assert_eq!(Tallies::class(200), 0);
        assert_eq!(Tallies::class(201), 0);
        assert_eq!(Tallies::class(429), 1);
        assert_eq!(Tallies::class(503), 2);
        assert_eq!(Tallies::class(504), 3);
        assert_eq!(Tallies::class(400), 4);
        assert_eq!(Tallies::class(502), 4);
    }
}
