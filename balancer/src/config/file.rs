//! The optional YAML config file: the same settings as the flags, camelCase,
//! unknown keys refused.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::flow::{ConfigDuration, FlowControlSection, SaturationSection};
use super::models::ModelsSection;
use super::quotas::QuotasSection;
use super::scheduling::SchedulingSection;
use super::SettingsError;
use crate::asyncq::job::DeadLetter;
use crate::asyncq::{CapacityUnit, Gate};
use flowgate_logging::LogFormat;

/// The config file: the same settings as the flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FileConfig {
    pub inference_addr: Option<SocketAddr>,
    pub management_addr: Option<SocketAddr>,
    pub epp_addr: Option<SocketAddr>,
    pub max_buffered_requests: Option<usize>,
    pub buffered_request_timeout: Option<u64>,
    pub max_request_bytes: Option<usize>,
    pub shutdown_grace_period: Option<u64>,
    /// See `--drain-delay`.
    pub drain_delay: Option<super::flow::ConfigDuration>,
    pub upstream_connect_timeout: Option<u64>,
    pub upstream_idle_connections: Option<usize>,
    pub threads: Option<usize>,
    pub log_level: Option<String>,
    pub log_format: Option<LogFormat>,
    pub max_buffered_bytes: Option<u64>,
    pub api_keys_file: Option<PathBuf>,
    pub management_token: Option<String>,
    pub allow_open_management: Option<bool>,
    pub scale_up_webhook: Option<String>,
    pub scale_up_webhook_interval: Option<ConfigDuration>,
    pub max_connections: Option<usize>,
    pub client_header_timeout: Option<ConfigDuration>,
    pub client_body_timeout: Option<ConfigDuration>,
    pub max_header_bytes: Option<usize>,
    pub default_output_tokens: Option<u64>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// OpenTelemetry traces (README "Traces").
    pub traces: Option<TracesSection>,
    /// The async path (README "Async path").
    #[serde(rename = "async")]
    pub async_queue: Option<AsyncSection>,
    /// Priority bands, fairness and ordering policies, limits, TTLs.
    pub flow_control: Option<FlowControlSection>,
    /// When an endpoint stops taking new work.
    pub saturation_detector: Option<SaturationSection>,
    /// Objective name (header `x-gateway-inference-objective`) → priority.
    #[serde(default)]
    pub objectives: BTreeMap<String, i32>,
    /// Model name → priority for requests that name no known objective.
    #[serde(default)]
    pub model_priorities: BTreeMap<String, i32>,
    /// Default latency objectives (README "Latency objectives").
    pub latency_objectives: Option<LatencyObjectivesSection>,
    /// Scorer weights, prefix index, retries, circuit breaker.
    pub scheduling: Option<SchedulingSection>,
    /// Aliases, default model, rewrites, fallbacks.
    pub models: Option<ModelsSection>,
    /// Quotas per tenant, and where they are kept.
    pub quotas: Option<QuotasSection>,
}

/// `latencyObjectives:` in the config file: the objectives of requests
/// whose headers name none, by objective name and by model.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LatencyObjectivesSection {
    #[serde(default)]
    pub objectives: BTreeMap<String, flowgate::objective::Objective>,
    #[serde(default)]
    pub models: BTreeMap<String, flowgate::objective::Objective>,
}

impl LatencyObjectivesSection {
    /// Checked: names not empty, every part 1 ms to an hour.
    pub fn build(self) -> Result<flowgate::objective::ObjectiveDefaults, String> {
        for (what, map) in [("objectives", &self.objectives), ("models", &self.models)] {
            for (name, objective) in map {
                if name.trim().is_empty() {
                    return Err(format!("latencyObjectives.{what}: a name is empty"));
                }
                objective
                    .check()
                    .map_err(|e| format!("latencyObjectives.{what}.{name}: {e}"))?;
            }
        }
        Ok(flowgate::objective::ObjectiveDefaults {
            objectives: self.objectives.into_iter().collect(),
            models: self.models.into_iter().collect(),
        })
    }
}

/// The config file's `async:` section: the `--async-*` flags (and
/// `--queue-url`) without their prefix, camelCase.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AsyncSection {
    pub dir: Option<PathBuf>,
    pub queue_url: Option<String>,
    pub gate: Option<Gate>,
    pub gate_interval: Option<ConfigDuration>,
    pub prometheus_url: Option<String>,
    pub promql: Option<String>,
    pub max_sys: Option<u64>,
    pub capacity_unit: Option<CapacityUnit>,
    pub baseline: Option<f64>,
    pub priority: Option<i32>,
    pub max_length: Option<usize>,
    pub max_results: Option<u64>,
    pub auto_evict: Option<bool>,
    pub max_delivery: Option<u32>,
    pub max_idle: Option<ConfigDuration>,
    pub dead_letter: Option<DeadLetter>,
    pub retention: Option<ConfigDuration>,
    pub file_retention: Option<ConfigDuration>,
}

impl FileConfig {
    pub fn parse(text: &str) -> Result<Self, serde_saphyr::Error> {
        if text.trim().is_empty() {
            return Ok(FileConfig::default());
        }
        serde_saphyr::from_str(text)
    }

    pub fn load(path: &Path) -> Result<Self, SettingsError> {
        let text = std::fs::read_to_string(path).map_err(|source| SettingsError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|source| SettingsError::Parse {
            path: path.to_owned(),
            source: Box::new(source),
        })
    }
}

/// `traces:` in the config file (flags and the `OTEL_*` environment win).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TracesSection {
    /// The OTLP/HTTP collector (see `--otlp-endpoint`).
    pub endpoint: Option<String>,
    /// Share of the traces the balancer starts that are kept.
    pub sample_ratio: Option<f64>,
}
