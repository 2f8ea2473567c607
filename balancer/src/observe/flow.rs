//! How requests' waits in flow control ended, by priority (the Gateway API
//! Inference Extension's `inference_extension_flow_control_*` names where
//! it has them).

use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

// Bounded (MAX_PRIORITY_LABELS): a fast hasher, looked up per request.
use foldhash::HashMap;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
};

use super::family::{register, WAIT_BUCKETS};

/// Distinct priority values that get their own metric label; later ones
/// read `other` (with `allowClientPriority` a client picks any integer).
pub const MAX_PRIORITY_LABELS: usize = 32;

/// The series of one priority label: made on its first request, then
/// reused, where a label look-up per request would format and hash it.
struct PrioritySeries {
    label: Box<str>,
    dispatches: IntCounter,
    dispatched_wait: Histogram,
}

/// The series of each priority a request chose, among at most
/// [`MAX_PRIORITY_LABELS`] distinct values; every later one counts under
/// `other`, so no client can grow the number of series without bound.
#[derive(Default)]
struct ByPriority {
    labelled: Mutex<HashMap<i32, Arc<PrioritySeries>>>,
    other: OnceLock<Arc<PrioritySeries>>,
}

pub struct FlowMetrics {
    by_priority: ByPriority,
    queue_duration: HistogramVec,
    dispatches: IntCounterVec,
    rejections: IntCounterVec,
}

impl FlowMetrics {
    pub fn new(registry: &Registry) -> Self {
        FlowMetrics {
            by_priority: ByPriority::default(),
            queue_duration: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "inference_extension_flow_control_request_queue_duration_seconds",
                        "Time from arrival to the end of the wait in flow control, by priority \
                     and outcome (dispatched, or the drop reason)",
                    )
                    .buckets(WAIT_BUCKETS.to_vec()),
                    &["priority", "outcome"],
                ),
            ),
            dispatches: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_flow_control_dispatches_total",
                        "Requests bound to an endpoint, by priority",
                    ),
                    &["priority"],
                ),
            ),
            rejections: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_flow_control_rejections_total",
                        "Requests that left flow control without an endpoint, by priority and \
                     reason (buffer-full, shed, no-endpoints, ttl-expired, client-gone)",
                    ),
                    &["priority", "reason"],
                ),
            ),
        }
    }

    /// Records how a request's wait in flow control ended.
    pub fn outcome(&self, priority: i32, outcome: Result<(), &str>, waited: Duration) {
        let series = self.series(priority);
        match outcome {
            Ok(()) => {
                series.dispatches.inc();
                series.dispatched_wait.observe(waited.as_secs_f64());
            }
            Err(reason) => {
                let label = [&*series.label, reason];
                self.rejections.with_label_values(&label).inc();
                (self.queue_duration.with_label_values(&label)).observe(waited.as_secs_f64());
            }
        }
    }

    /// The series of `priority` (or of `other`, past the bound).
    fn series(&self, priority: i32) -> Arc<PrioritySeries> {
        let of = |label: String| {
            Arc::new(PrioritySeries {
                dispatches: self.dispatches.with_label_values(&[&label]),
                dispatched_wait: (self.queue_duration).with_label_values(&[&label, "dispatched"]),
                label: label.into(),
            })
        };
        let by = &self.by_priority;
        let mut labelled = (by.labelled.lock()).unwrap_or_else(PoisonError::into_inner);
        if let Some(series) = labelled.get(&priority) {
            return Arc::clone(series);
        }
        if labelled.len() < MAX_PRIORITY_LABELS {
            let series = of(priority.to_string());
            labelled.insert(priority, Arc::clone(&series));
            return series;
        }
        drop(labelled);
        Arc::clone(by.other.get_or_init(|| of("other".to_string())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The label values of `name`'s `priority` in `registry`, with the
    /// sum of their counts.
    fn priorities(registry: &Registry, name: &str) -> (Vec<String>, u64) {
        let family = registry.gather().into_iter().find(|f| f.name() == name);
        let metrics = family.map(|f| f.get_metric().to_vec()).unwrap_or_default();
        let labels = metrics
            .iter()
            .map(|m| m.get_label()[0].value().to_string())
            .collect();
        let counted = metrics
            .iter()
            .map(|m| m.get_counter().get_value() as u64)
            .sum();
        (labels, counted)
    }

    #[test]
    fn a_client_choosing_priorities_cannot_grow_the_series() {
        let registry = Registry::new();
        let flow = FlowMetrics::new(&registry);
        for priority in (0..1_000).map(|p| p * 7 - 500) {
            flow.outcome(priority, Ok(()), Duration::from_millis(3));
        }
        flow.outcome(-500, Ok(()), Duration::ZERO);
        flow.outcome(10_000, Err("ttl-expired"), Duration::from_secs(1));
        let (labels, counted) = priorities(&registry, "flowgate_flow_control_dispatches_total");
        assert_eq!(labels.len(), MAX_PRIORITY_LABELS + 1);
        assert!(labels.iter().any(|l| l == "other"));
        assert!(labels.iter().any(|l| l == "-500"));
        assert_eq!(counted, 1_001, "every dispatch counted once");
        let (labels, counted) = priorities(&registry, "flowgate_flow_control_rejections_total");
        assert_eq!((labels, counted), (vec!["other".to_string()], 1));
    }
}
