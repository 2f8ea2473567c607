//! Saturation detector: an eligible endpoint takes new work only while it
//! is not saturated ([`Saturation`]): a free slot by the balancer's own
//! count, fewer waiting requests than `queue_depth_threshold`, KV-cache use
//! below `kv_cache_util_threshold`, and metrics younger than the staleness
//! threshold. The threshold is never shorter than two of the agent's own
//! report intervals, so an agent that reports less often than the threshold
//! slows dispatch down instead of freezing it.
//!
//! The token budget is the one per-request test: an endpoint whose agent
//! reports its KV capacity in tokens takes a request only while the
//! estimated tokens in flight there plus the request's
//! ([`Endpoint::token_need`]) stay within `token_budget` × capacity. An
//! endpoint with nothing of the balancer's in flight takes any request
//! (else one larger than the budget would wait forever); one that needs
//! more than a single request may use there never goes to it
//! ([`Endpoint::never_fits`]: the dispatcher refuses it 413 when no
//! endpoint can take it).

use std::time::{Duration, Instant};

use serde::Serialize;

use super::Endpoint;
use crate::protocol::{BackendHealth, BackendKind};
use crate::tokens::TokenEstimate;

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
    /// Share of an endpoint's reported KV capacity (in tokens) the
    /// estimated tokens in flight may fill; above 1 overcommits (estimates
    /// count every output bound in full, most answers end sooner). 0
    /// turns the token budget off.
    pub token_budget: f64,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        SaturationConfig {
            queue_depth_threshold: 5,
            kv_cache_util_threshold: 0.8,
            metrics_staleness_threshold: Duration::from_millis(200),
            token_budget: 1.0,
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
    /// The estimated tokens in flight fill the endpoint's token budget
    /// (for a given request: its tokens do not fit in what is left).
    TokenBudget,
}

impl Saturation {
    /// The reason as a metric label (same as its JSON form).
    pub fn as_str(self) -> &'static str {
        match self {
            Saturation::SlotsFull => "slots-full",
            Saturation::QueueDepth => "queue-depth",
            Saturation::KvCache => "kv-cache",
            Saturation::StaleMetrics => "stale-metrics",
            Saturation::TokenBudget => "token-budget",
        }
    }
}

impl Endpoint {
    /// Eligible and not saturated.
    pub(crate) fn available(&self, now: Instant, config: &SaturationConfig) -> bool {
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
        } else {
            self.load_saturation(config)
        }
    }

    /// Why the endpoint cannot take work by its load alone (what it last
    /// reported and the balancer's own counts; not the clock).
    fn load_saturation(&self, config: &SaturationConfig) -> Option<Saturation> {
        let a = self.agent.as_ref()?;
        if self.free_slots() == 0 {
            Some(Saturation::SlotsFull)
        } else if a.report.requests_waiting >= config.queue_depth_threshold {
            Some(Saturation::QueueDepth)
        } else if a
            .report
            .kv_cache_usage
            .is_some_and(|kv| kv >= config.kv_cache_util_threshold)
        {
            Some(Saturation::KvCache)
        } else if self
            .token_budget(config)
            .is_some_and(|budget| self.in_flight_tokens >= budget)
        {
            Some(Saturation::TokenBudget)
        } else {
            None
        }
    }

    /// Whether the endpoint could take work by everything but the clock:
    /// an agent, ready, not draining, not saturated by its load. Only
    /// these are ranked ([`super::ranking`]).
    pub(super) fn rankable(&self, config: &SaturationConfig) -> bool {
        self.agent
            .as_ref()
            .is_some_and(|a| a.report.health == BackendHealth::Ready && !a.report.draining)
            && self.load_saturation(config).is_none()
    }

    /// Tokens the balancer may have in flight here: the configured share
    /// of the reported KV capacity (`None`: no budget, the capacity is
    /// unknown or the budget is off).
    pub(crate) fn token_budget(&self, config: &SaturationConfig) -> Option<u64> {
        let capacity = self.agent.as_ref()?.report.kv_capacity_tokens?;
        (config.token_budget > 0.0).then_some((capacity as f64 * config.token_budget) as u64)
    }

    /// The most tokens one request may hold here: a slot's context on
    /// llama.cpp (it splits its KV cache evenly between slots), the whole
    /// cache on engines that share it between requests (vLLM, SGLang).
    fn request_capacity(&self) -> Option<u64> {
        let report = &self.agent.as_ref()?.report;
        let capacity = report.kv_capacity_tokens?;
        Some(match report.backend {
            BackendKind::Llamacpp => capacity / u64::from(report.slots_total.max(1)),
            _ => capacity,
        })
    }

    /// The tokens a request is counted for here: its estimate, cut to what
    /// one request can hold (llama.cpp stops an answer at its slot's
    /// context end).
    pub(crate) fn token_need(&self, tokens: &TokenEstimate) -> u64 {
        let total = tokens.total();
        self.request_capacity().map_or(total, |cap| total.min(cap))
    }

    /// Whether a request can never be served here: what it needs at least
    /// is more than one request may hold. llama-server refuses only a
    /// prompt beyond the slot's context (a larger `max_tokens` stops at
    /// the context end); vLLM and SGLang refuse a prompt plus `max_tokens`
    /// beyond their context.
    pub(crate) fn never_fits(&self, tokens: &TokenEstimate) -> bool {
        let Some(cap) = self.request_capacity() else {
            return false;
        };
        let least = match self.agent.as_ref().map(|a| a.report.backend) {
            Some(BackendKind::Llamacpp) => tokens.prompt,
            _ => tokens.least(),
        };
        least > cap
    }

    /// Whether this request's tokens fit in what is left of the token
    /// budget. An endpoint with nothing of the balancer's in flight takes
    /// any request that does not [`Endpoint::never_fits`].
    pub(crate) fn fits_token_budget(
        &self,
        tokens: &TokenEstimate,
        config: &SaturationConfig,
    ) -> bool {
        match self.token_budget(config) {
            None => true,
            Some(_) if self.in_flight_tokens == 0 => true,
            Some(budget) => {
                self.in_flight_tokens
                    .saturating_add(self.token_need(tokens))
                    <= budget
            }
        }
    }
}
