//! How requests' waits in flow control ended, by priority (the Gateway API
//! Inference Extension's `inference_extension_flow_control_*` names where
//! it has them).

use std::time::Duration;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

use super::metrics::{register, WAIT_BUCKETS};

/// Distinct priority values that get their own metric label; later ones
/// read `other` (with `allowClientPriority` a client picks any integer).
pub const MAX_PRIORITY_LABELS: usize = 32;

/// The label for a value a request chose, among at most `cap` distinct
/// values; every later one is `other`, so no client can grow the number of
/// series without bound.
struct BoundedLabels {
    cap: usize,
    seen: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl BoundedLabels {
    fn new(cap: usize) -> Self {
        BoundedLabels {
            cap,
            seen: Default::default(),
        }
    }

    fn label(&self, value: String) -> String {
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.contains(&value) {
            return value;
        }
        if seen.len() < self.cap {
            seen.insert(value.clone());
            return value;
        }
        "other".to_string()
    }
}

pub struct FlowMetrics {
    priority_labels: BoundedLabels,
    queue_duration: HistogramVec,
    dispatches: IntCounterVec,
    rejections: IntCounterVec,
}

impl FlowMetrics {
    pub fn new(registry: &Registry) -> Self {
        FlowMetrics {
            priority_labels: BoundedLabels::new(MAX_PRIORITY_LABELS),
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
        let priority = self.priority_labels.label(priority.to_string());
        let label = match outcome {
            Ok(()) => {
                self.dispatches.with_label_values(&[&priority]).inc();
                "dispatched"
            }
            Err(reason) => {
                self.rejections
                    .with_label_values(&[&priority, reason])
                    .inc();
                reason
            }
        };
        self.queue_duration
            .with_label_values(&[&priority, label])
            .observe(waited.as_secs_f64());
    }
}
