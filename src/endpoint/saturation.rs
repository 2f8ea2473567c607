//! Saturation detector: an eligible endpoint takes new work only while it
//! is not saturated ([`Saturation`]): a free slot by the balancer's own
//! count, fewer waiting requests than `queue_depth_threshold`, KV-cache use
//! below `kv_cache_util_threshold`, and metrics younger than the staleness
//! threshold. The threshold is never shorter than two of the agent's own
//! report intervals, so an agent that reports less often than the threshold
//! slows dispatch down instead of freezing it.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::Endpoint;

/// When an endpoint counts as saturated (GIE's `saturationDetector`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationConfig {
    /// Saturated when the server reports at least this many waiting requests.
    pub queue_depth_threshold: u32,
    /// Saturated when the server reports at least this KV-cache use (0..=1).
    pub kv_cache_util_threshold: f64,
    /// Saturated when the last report is older than this (or than two of the
    /// agent's intervals, whichever is longer).
    pub metrics_staleness_threshold: Duration,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        SaturationConfig {
            queue_depth_threshold: 5,
            kv_cache_util_threshold: 0.8,
            metrics_staleness_threshold: Duration::from_millis(200),
        }
    }
}

/// Why an endpoint takes no new work for now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Saturation {
    /// Every slot is in use (by the balancer's count plus foreign load).
    SlotsFull,
    /// The server's own waiting queue reached the threshold.
    QueueDepth,
    /// KV-cache use reached the threshold.
    KvCache,
    /// The last report is too old to trust.
    StaleMetrics,
}

impl Saturation {
    /// The reason as a metric label (same as its JSON form).
    pub fn as_str(self) -> &'static str {
        match self {
            Saturation::SlotsFull => "slots-full",
            Saturation::QueueDepth => "queue-depth",
            Saturation::KvCache => "kv-cache",
            Saturation::StaleMetrics => "stale-metrics",
        }
    }
}

impl Endpoint {
    /// Eligible and not saturated.
    pub(super) fn available(&self, now: Instant, config: &SaturationConfig) -> bool {
        self.eligible(now) && self.saturation(now, config).is_none()
    }

    /// Why the endpoint cannot take work now, if it cannot (checked on
    /// eligible endpoints).
    pub(crate) fn saturation(&self, now: Instant, config: &SaturationConfig) -> Option<Saturation> {
        let a = self.agent.as_ref()?;
        let staleness = config
            .metrics_staleness_threshold
            .max(a.report.monitoring_interval() * 2);
        if now.saturating_duration_since(a.received_at) > staleness {
            Some(Saturation::StaleMetrics)
        } else if self.free_slots() == 0 {
            Some(Saturation::SlotsFull)
        } else if a.report.requests_waiting >= config.queue_depth_threshold {
            Some(Saturation::QueueDepth)
        } else if a
            .report
            .kv_cache_usage
            .is_some_and(|kv| kv >= config.kv_cache_util_threshold)
        {
            Some(Saturation::KvCache)
        } else {
            None
        }
    }
}
