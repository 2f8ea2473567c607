//! What a flow is (its key: fairness id and priority) and the policies and
//! limits its band is configured with.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Fairness id of requests that name none.
pub const DEFAULT_FAIRNESS_ID: &str = "default";
/// Longest accepted fairness id, in bytes.
pub const MAX_FAIRNESS_ID_LEN: usize = 128;

/// Identifies a flow: who sent the request and how urgent it is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    pub fairness_id: Arc<str>,
    pub priority: i32,
}

impl FlowKey {
    pub fn new(fairness_id: impl Into<Arc<str>>, priority: i32) -> Self {
        FlowKey {
            fairness_id: fairness_id.into(),
            priority,
        }
    }
}

/// Whether `id` may be used as a fairness id: 1..=128 visible ASCII bytes.
pub fn valid_fairness_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_FAIRNESS_ID_LEN && id.bytes().all(|b| b.is_ascii_graphic())
}

/// How a band shares dispatch turns between its flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FairnessPolicy {
    /// One order across all flows of the band (GIE's default).
    #[serde(rename = "global-strict", alias = "global-strict-fairness-policy")]
    GlobalStrict,
    /// Flows with queued work take turns, one request each.
    #[serde(rename = "round-robin", alias = "round-robin-fairness-policy")]
    RoundRobin,
    /// The flow served the fewest weighted tokens goes next.
    #[serde(rename = "token-fair", alias = "vtc")]
    TokenFair,
}

/// How a flow orders its own requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OrderingPolicy {
    /// First come, first served.
    #[serde(rename = "fcfs", alias = "fcfs-ordering-policy")]
    Fcfs,
    /// Earliest deadline first.
    #[serde(rename = "edf", alias = "edf-ordering-policy")]
    Edf,
}

/// Limits and policies of one priority band.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BandConfig {
    /// Most requests the band may hold; `None`: only the global limit.
    pub max_requests: Option<usize>,
    /// Most body bytes the band may hold; `None`: only the global limit.
    pub max_bytes: Option<u64>,
    /// Most estimated tokens the band may hold; `None`: only the global
    /// limit.
    pub max_tokens: Option<u64>,
    pub fairness: FairnessPolicy,
    pub ordering: OrderingPolicy,
}

impl Default for BandConfig {
    fn default() -> Self {
        BandConfig {
            max_requests: None,
            max_bytes: None,
            max_tokens: None,
            fairness: FairnessPolicy::TokenFair,
            ordering: OrderingPolicy::Fcfs,
        }
    }
}

/// Flow control settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowControlConfig {
    /// Most requests that may wait in all bands; 0 disables buffering.
    pub max_requests: usize,
    /// Most body bytes that may wait in all bands.
    pub max_bytes: u64,
    /// Most estimated tokens that may wait in all bands; `None`: no limit.
    pub max_tokens: Option<u64>,
    /// Bands with their own limits or policies, by priority.
    pub bands: BTreeMap<i32, BandConfig>,
    /// Policies of any priority not listed in `bands` (no band limits).
    pub default_band: BandConfig,
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        FlowControlConfig {
            max_requests: 30,
            max_bytes: 256 << 20,
            max_tokens: None,
            bands: BTreeMap::new(),
            default_band: BandConfig::default(),
        }
    }
}

impl FlowControlConfig {
    pub fn band(&self, priority: i32) -> BandConfig {
        self.bands
            .get(&priority)
            .copied()
            .unwrap_or(self.default_band)
    }
}

impl fmt::Display for FairnessPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FairnessPolicy::GlobalStrict => "global-strict",
            FairnessPolicy::RoundRobin => "round-robin",
            FairnessPolicy::TokenFair => "token-fair",
        })
    }
}

impl fmt::Display for OrderingPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OrderingPolicy::Fcfs => "fcfs",
            OrderingPolicy::Edf => "edf",
        })
    }
}
