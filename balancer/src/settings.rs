//! Command-line flags, the optional YAML config file, and their merge.
//!
//! Precedence: a flag given on the command line beats the config file, which
//! beats the built-in default. Every setting has the same name in both
//! places, kebab-case as a flag and camelCase in YAML
//! (`--max-buffered-requests` ⇔ `maxBufferedRequests`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use flowgate::DispatcherConfig;
use serde::Deserialize;

use crate::asyncq::store::{DeadLetter, QueueConfig};
use crate::asyncq::{AsyncConfig, CapacityUnit, Gate, PromQuery};
use crate::auth::{ApiKeys, Secret};
use crate::limits::{self, ClientLimits, MAX_MAX_HEADER_BYTES};
use crate::policy::{self, ConfigDuration, FlowControlSection, PriorityRules, SaturationSection};
use crate::scheduling::{self, SchedulingSection};
use crate::tls::TlsFiles;

pub const DEFAULT_INFERENCE_ADDR: &str = "127.0.0.1:8061";
pub const DEFAULT_MANAGEMENT_ADDR: &str = "127.0.0.1:8060";
pub const DEFAULT_MAX_BUFFERED_REQUESTS: usize = 30;
pub const DEFAULT_BUFFERED_REQUEST_TIMEOUT_MS: u64 = 10_000;
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;
pub const DEFAULT_SHUTDOWN_GRACE_PERIOD_S: u64 = 30;
pub const DEFAULT_UPSTREAM_CONNECT_TIMEOUT_MS: u64 = 5_000;
pub const DEFAULT_SCALE_UP_WEBHOOK_INTERVAL: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Flowgate balancer: an OpenAI-compatible reverse proxy that holds requests
/// in a buffer until a model server reported by an agent has a free slot.
#[derive(Debug, Parser)]
#[command(name = "balancer", version, about, long_about = None)]
pub struct Cli {
    /// YAML file with any of the settings below (camelCase keys, e.g.
    /// `maxBufferedRequests: 30`); flags given on the command line override it
    #[arg(long, value_name = "FILE", env = "FLOWGATE_CONFIG")]
    pub config: Option<PathBuf>,

    /// Address of the OpenAI-compatible inference API [default: 127.0.0.1:8061]
    #[arg(long, value_name = "IP:PORT")]
    pub inference_addr: Option<SocketAddr>,

    /// Address of the management API (agent reports, /api/v1/agents,
    /// /metrics) [default: 127.0.0.1:8060]
    #[arg(long, value_name = "IP:PORT")]
    pub management_addr: Option<SocketAddr>,

    /// Also serve EPP mode here: Envoy's external-processing gRPC protocol
    /// (`envoy.service.ext_proc.v3.ExternalProcessor`), so an Envoy in front
    /// of the model servers asks Flowgate which endpoint each request goes
    /// to, with the same flow control and scheduling as the proxy; plus gRPC
    /// health. Off unless given
    #[arg(long, value_name = "IP:PORT")]
    pub epp_addr: Option<SocketAddr>,

    /// Most requests that may wait for a free slot, all priorities together;
    /// more are answered 503 (or evict lower-priority waiters, answered
    /// 429). 0 disables buffering. Same as `flowControl.maxRequests`
    /// [default: 30]
    #[arg(long, value_name = "N")]
    pub max_buffered_requests: Option<usize>,

    /// Most request-body bytes that may wait, all priorities together; same
    /// as `flowControl.maxBytes` [default: 268435456 (256 MiB)]
    #[arg(long, value_name = "BYTES")]
    pub max_buffered_bytes: Option<u64>,

    /// Milliseconds a request may wait for a free slot before it is
    /// answered 504, unless it asks for another TTL with the
    /// `x-flowgate-request-ttl` header. Same as `flowControl.defaultRequestTTL`
    /// [default: 10000]
    #[arg(long, value_name = "MS")]
    pub buffered_request_timeout: Option<u64>,

    /// Largest accepted request body in bytes; larger ones are answered 413
    /// [default: 16777216 (16 MiB)]
    #[arg(long, value_name = "BYTES")]
    pub max_request_bytes: Option<usize>,

    /// Seconds to let in-flight and buffered requests finish after SIGTERM;
    /// the process exits as soon as none are left [default: 30]
    #[arg(long, value_name = "SECONDS")]
    pub shutdown_grace_period: Option<u64>,

    /// Milliseconds to wait for a TCP connection to a model server
    /// [default: 5000]
    #[arg(long, value_name = "MS")]
    pub upstream_connect_timeout: Option<u64>,

    /// Worker threads for the proxy [default: number of CPUs]
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,

    /// Log filter: error, warn, info, debug, trace, or a tracing directive
    /// such as `info,pingora_core=warn` [default: info; env RUST_LOG wins]
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,

    /// Log line format [default: text]
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,

    /// YAML file of API keys for the inference port, each bound to a tenant
    /// (its fairness id) and optionally a priority ceiling; with it, every
    /// route but /health needs `Authorization: Bearer <key>` (401
    /// otherwise). Keys may be stored as SHA-256 digests. See the README
    /// [default: no keys required]
    #[arg(long, value_name = "FILE")]
    pub api_keys_file: Option<PathBuf>,

    /// Token agents must send (`Authorization: Bearer`) to register, report
    /// and deregister on the management port; reads (agent list, metrics,
    /// health) stay open. Prefer the environment variable: flags are visible
    /// in `ps` [default: none]
    #[arg(
        long,
        value_name = "TOKEN",
        env = "FLOWGATE_MANAGEMENT_TOKEN",
        hide_env_values = true
    )]
    pub management_token: Option<String>,

    /// Serve the management port on a non-loopback address without a
    /// management token, so that anyone who reaches it may register a
    /// model server. Refused unless given
    #[arg(long)]
    pub allow_open_management: bool,

    /// `http://` URL to POST `{"event":"scale_up","model","queued_requests"}`
    /// to when requests wait for a model that no live server serves (scale
    /// from zero); at most once per interval per model [default: off]
    #[arg(long, value_name = "URL")]
    pub scale_up_webhook: Option<String>,

    /// Least time between two scale-up webhook calls for one model: `30s`,
    /// `2m`, or milliseconds [default: 30s]
    #[arg(long, value_name = "DURATION", value_parser = flowgate::duration::parse_duration)]
    pub scale_up_webhook_interval: Option<Duration>,

    /// Client connections the inference port holds open at once; a
    /// connection over the limit is answered 503 (`too_many_connections`,
    /// `retry-after: 1`) and closed. Keep it under the process's open-file
    /// limit (`ulimit -n`) [default: 4096]
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,

    /// Time a request head (request line and headers) may take from its
    /// first byte, or from the accept on a new connection; a slower client
    /// gets 408 (`header_timeout`) and is disconnected: `10s`, `500ms`, or
    /// milliseconds [default: 10s]
    #[arg(long, value_name = "DURATION", value_parser = flowgate::duration::parse_duration)]
    pub client_header_timeout: Option<Duration>,

    /// Time the whole request body may take to arrive after its head; a
    /// slower client gets 408 (`body_timeout`) [default: 60s]
    #[arg(long, value_name = "DURATION", value_parser = flowgate::duration::parse_duration)]
    pub client_body_timeout: Option<Duration>,

    /// Largest request head (request line and headers) in bytes, 1024 to
    /// 1048575; a larger one is answered 431 (`header_too_large`)
    /// [default: 32768]
    #[arg(long, value_name = "BYTES")]
    pub max_header_bytes: Option<usize>,

    /// PEM certificate chain for TLS on the inference port (rustls; TLS 1.2
    /// and 1.3, HTTP/1.1). With --tls-key, the port serves HTTPS only
    /// [default: plain HTTP]
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of --tls-cert
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Directory of the async queue's embedded store; turns the async path
    /// on (`POST /v1/async/...`, see the README) [default: off]
    #[arg(long, value_name = "DIR")]
    pub async_dir: Option<PathBuf>,

    /// Keep the async queue in Redis instead (`redis://host:6379/0`; Streams
    /// with a consumer group), so several balancers share it; turns the
    /// async path on
    #[arg(long, value_name = "URL")]
    pub queue_url: Option<String>,

    /// Where the async dispatch budget's D comes from: `balancer` (1 − the
    /// share of the fleet's slots taken by interactive work), `prometheus`
    /// (--async-promql against --async-prometheus-url) or `always-open` (1)
    /// [default: balancer]
    #[arg(long, value_enum, value_name = "GATE")]
    pub async_gate: Option<Gate>,

    /// The fleet's capacity for the budget N = max_sys × (D − B), in
    /// --async-capacity-unit [default: the eligible servers' slots, as
    /// reported; required with tokens or bytes]
    #[arg(long, value_name = "N")]
    pub async_max_sys: Option<u64>,

    /// What max_sys and N count: `requests`, `tokens` (a request's prompt
    /// bytes / 4 plus its max_tokens, 256 if unset) or `bytes` (its body)
    /// [default: requests]
    #[arg(long, value_enum, value_name = "UNIT")]
    pub async_capacity_unit: Option<CapacityUnit>,

    /// B, the share of the fleet (0 to 1) kept for interactive work; no
    /// async work is dispatched while D ≤ B [default: 0]
    #[arg(long, value_name = "FRACTION")]
    pub async_baseline: Option<f64>,

    /// Flow-control priority of async work; keep it below every interactive
    /// band [default: -1000]
    #[arg(long, value_name = "INT", allow_negative_numbers = true)]
    pub async_priority: Option<i32>,

    /// Queued async requests at most; more are refused 429 (or evict the
    /// oldest with --async-auto-evict) [default: 100000]
    #[arg(long, value_name = "N")]
    pub async_max_length: Option<usize>,

    /// Evict the oldest queued async request (marked `evicted`) instead of
    /// refusing a new one when the queue is full
    #[arg(long)]
    pub async_auto_evict: bool,

    /// Deliveries of one async request before the dead-letter policy
    /// [default: 5]
    #[arg(long, value_name = "N")]
    pub async_max_delivery: Option<u32>,

    /// Visibility lease: an async delivery not finished within it is made
    /// again: `5m`, `30s` [default: 5m]
    #[arg(long, value_name = "DURATION", value_parser = flowgate::duration::parse_duration)]
    pub async_max_idle: Option<Duration>,

    /// After --async-max-delivery deliveries: `drop` (kept, marked
    /// `dead_lettered`) or `rear` (back of the queue, count reset)
    /// [default: drop]
    #[arg(long, value_enum, value_name = "POLICY")]
    pub async_dead_letter: Option<DeadLetter>,

    /// Finished async requests kept at most; while the result store holds
    /// as many, the dispatcher takes no new work [default: 1000000]
    #[arg(long, value_name = "N")]
    pub async_max_results: Option<u64>,

    /// How long finished async requests and their answers are kept: `24h`
    /// [default: 24h]
    #[arg(long, value_name = "DURATION", value_parser = flowgate::duration::parse_duration)]
    pub async_retention: Option<Duration>,

    /// How long Batch API files are kept: uploads that set no
    /// `expires_after`, batch output and error files, and finished batch
    /// records (from their creation) [default: 30d]
    #[arg(long, value_name = "DURATION", value_parser = flowgate::duration::parse_duration)]
    pub async_file_retention: Option<Duration>,

    /// The balancer gate: D is the lowest of its readings (taken every
    /// ≤ 100 ms) over this window, so a moment when interactive clients are
    /// between requests is not mistaken for spare capacity. The prometheus
    /// gate: how often the query runs. After a 429 from the fleet the gate
    /// stays closed this long [default: 1s; 2s with --async-gate
    /// prometheus]
    #[arg(long, value_name = "DURATION", value_parser = flowgate::duration::parse_duration)]
    pub async_gate_interval: Option<Duration>,

    /// Prometheus server for --async-gate prometheus: `http://host:9090`
    #[arg(long, value_name = "URL")]
    pub async_prometheus_url: Option<String>,

    /// PromQL instant query giving D (0 to 1) for --async-gate prometheus,
    /// e.g. `sum(flowgate_endpoint_slots{state="idle"}) /
    /// sum(flowgate_endpoint_slots)`; an error, an empty answer or NaN
    /// reads as D = 0
    #[arg(long, value_name = "QUERY")]
    pub async_promql: Option<String>,
}

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
    pub upstream_connect_timeout: Option<u64>,
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
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
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
    /// Scorer weights, prefix index, retries, circuit breaker.
    pub scheduling: Option<SchedulingSection>,
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

/// The async path's settings: flags over the file's `async:` section over
/// defaults; `None` when neither a directory nor a queue URL is given.
fn async_settings(
    cli: &Cli,
    file: AsyncSection,
    max_payload_bytes: usize,
) -> Result<Option<AsyncConfig>, SettingsError> {
    let invalid = |m: String| Err(SettingsError::Invalid(m));
    let (dir, redis_url) = match (
        cli.async_dir.clone().or(file.dir),
        cli.queue_url.clone().or(file.queue_url),
    ) {
        (None, None) => return Ok(None),
        (dir, url) => (dir.unwrap_or_default(), url),
    };
    if redis_url
        .as_ref()
        .is_some_and(|u| !(u.starts_with("redis://") || u.starts_with("unix://")))
    {
        return invalid("queue_url must be a redis:// (or unix://) URL".into());
    }
    let gate = cli.async_gate.or(file.gate).unwrap_or(Gate::Balancer);
    let url = cli.async_prometheus_url.clone().or(file.prometheus_url);
    let query = cli.async_promql.clone().or(file.promql);
    let prometheus = match (gate, url, query) {
        (Gate::Prometheus, Some(url), Some(query)) => {
            if !url.starts_with("http://") {
                return invalid(format!(
                    "async prometheus_url {url:?} must be an http:// URL"
                ));
            }
            Some(PromQuery { url, query })
        }
        (Gate::Prometheus, _, _) => {
            return invalid(
                "the prometheus async gate needs a Prometheus URL and a PromQL query \
                 (--async-prometheus-url, --async-promql)"
                    .into(),
            )
        }
        _ => None,
    };
    let unit = cli
        .async_capacity_unit
        .or(file.capacity_unit)
        .unwrap_or(CapacityUnit::Requests);
    let max_sys = cli.async_max_sys.or(file.max_sys);
    if unit != CapacityUnit::Requests && max_sys.is_none() {
        return invalid(
            "an async capacity in tokens or bytes needs max_sys (--async-max-sys) in that unit"
                .into(),
        );
    }
    let d = QueueConfig::default();
    let duration = |flag: Option<Duration>, key: Option<ConfigDuration>, default: Duration| {
        flag.or(key.map(|d| d.0)).unwrap_or(default)
    };
    Ok(Some(AsyncConfig {
        dir,
        redis_url,
        queue: QueueConfig {
            max_length: cli
                .async_max_length
                .or(file.max_length)
                .unwrap_or(d.max_length),
            max_payload_bytes,
            max_delivery: cli
                .async_max_delivery
                .or(file.max_delivery)
                .unwrap_or(d.max_delivery),
            max_idle: duration(cli.async_max_idle, file.max_idle, d.max_idle),
            dead_letter: cli
                .async_dead_letter
                .or(file.dead_letter)
                .unwrap_or(d.dead_letter),
            retention: duration(cli.async_retention, file.retention, d.retention),
            file_retention: duration(
                cli.async_file_retention,
                file.file_retention,
                d.file_retention,
            ),
            auto_evict: cli.async_auto_evict || file.auto_evict.unwrap_or(false),
            max_results: cli
                .async_max_results
                .or(file.max_results)
                .unwrap_or(d.max_results),
        },
        gate,
        gate_interval: duration(
            cli.async_gate_interval,
            file.gate_interval,
            match gate {
                Gate::Prometheus => Duration::from_secs(2),
                _ => Duration::from_secs(1),
            },
        ),
        prometheus,
        max_sys,
        unit,
        baseline: cli.async_baseline.or(file.baseline).unwrap_or(0.0),
        priority: cli.async_priority.or(file.priority).unwrap_or(-1000),
    }))
}

/// Effective settings after merging flags, file and defaults.
#[derive(Debug, Clone)]
pub struct Settings {
    pub inference_addr: SocketAddr,
    pub management_addr: SocketAddr,
    /// EPP mode's gRPC address, when enabled.
    pub epp_addr: Option<SocketAddr>,
    /// Flow control and saturation detection.
    pub dispatcher: DispatcherConfig,
    /// How requests get their priority.
    pub priorities: PriorityRules,
    /// Retries on another endpoint after a failure before the first byte.
    pub retries: u32,
    pub max_request_bytes: usize,
    pub shutdown_grace_period: Duration,
    pub upstream_connect_timeout: Duration,
    pub threads: usize,
    pub log_level: String,
    pub log_format: LogFormat,
    /// API keys required on the inference port, when configured.
    pub api_keys: Option<Arc<ApiKeys>>,
    /// Token required for writes on the management port, when set.
    pub management_token: Option<Secret>,
    /// Scale-up webhook URL and least interval between calls per model.
    pub scale_up_webhook: Option<(String, Duration)>,
    /// What a client connection may hold.
    pub client_limits: ClientLimits,
    /// TLS on the inference port, when configured.
    pub tls: Option<TlsFiles>,
    /// The async path, when on.
    pub async_queue: Option<AsyncConfig>,
}

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: Box<serde_saphyr::Error>,
    },
    #[error("{0}")]
    Invalid(String),
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

impl Settings {
    /// Loads the config file named by `cli` (if any) and merges.
    pub fn from_cli(cli: Cli) -> Result<Self, SettingsError> {
        let file = match &cli.config {
            Some(p) => FileConfig::load(p)?,
            None => FileConfig::default(),
        };
        Self::merge(cli, file)
    }

    pub fn merge(cli: Cli, mut file: FileConfig) -> Result<Self, SettingsError> {
        let async_queue = async_settings(
            &cli,
            file.async_queue.take().unwrap_or_default(),
            cli.max_request_bytes
                .or(file.max_request_bytes)
                .unwrap_or(DEFAULT_MAX_REQUEST_BYTES),
        )?;
        let default_addr = |s: &str| s.parse::<SocketAddr>().expect("valid default address");
        let fc = file.flow_control.unwrap_or_default();
        let either = |top: &str, nested: &str, a: bool, b: bool| {
            if a && b {
                Err(SettingsError::Invalid(format!(
                    "{top} and flowControl.{nested} are the same setting: give only one"
                )))
            } else {
                Ok(())
            }
        };
        either(
            "maxBufferedRequests",
            "maxRequests",
            file.max_buffered_requests.is_some(),
            fc.max_requests.is_some(),
        )?;
        either(
            "bufferedRequestTimeout",
            "defaultRequestTTL",
            file.buffered_request_timeout.is_some(),
            fc.default_request_ttl.is_some(),
        )?;
        either(
            "maxBufferedBytes",
            "maxBytes",
            file.max_buffered_bytes.is_some(),
            fc.max_bytes.is_some(),
        )?;
        let max_requests = cli
            .max_buffered_requests
            .or(file.max_buffered_requests)
            .or(fc.max_requests)
            .unwrap_or(DEFAULT_MAX_BUFFERED_REQUESTS);
        let max_bytes = cli
            .max_buffered_bytes
            .or(file.max_buffered_bytes)
            .or(fc.max_bytes)
            .unwrap_or(policy::DEFAULT_MAX_BUFFERED_BYTES);
        let default_ttl = cli
            .buffered_request_timeout
            .or(file.buffered_request_timeout)
            .map(Duration::from_millis)
            .or(fc.default_request_ttl.map(|d| d.0))
            .unwrap_or(Duration::from_millis(DEFAULT_BUFFERED_REQUEST_TIMEOUT_MS));
        if default_ttl.is_zero() {
            return Err(SettingsError::Invalid(
                "buffered_request_timeout (flowControl.defaultRequestTTL) must be at least 1 ms"
                    .into(),
            ));
        }
        let (mut dispatcher, priorities) = policy::build(
            &fc,
            &file.saturation_detector.unwrap_or_default(),
            &file.objectives,
            &file.model_priorities,
            max_requests,
            max_bytes,
            default_ttl,
        )
        .map_err(SettingsError::Invalid)?;
        // Tie-breaking only needs to differ between runs, not be secret.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let (sched, retries) = scheduling::build(&file.scheduling.unwrap_or_default(), seed)
            .map_err(SettingsError::Invalid)?;
        dispatcher.scheduling = sched;
        let api_keys = match cli.api_keys_file.or(file.api_keys_file) {
            Some(path) => Some(Arc::new(
                ApiKeys::load(&path).map_err(SettingsError::Invalid)?,
            )),
            None => None,
        };
        let management_token = match cli.management_token.or(file.management_token) {
            Some(t) if t.trim().is_empty() => {
                return Err(SettingsError::Invalid(
                    "management token is empty: set a token or leave it out".into(),
                ))
            }
            t => t.map(|t| Secret::new(t.trim())),
        };
        let allow_open_management =
            cli.allow_open_management || file.allow_open_management.unwrap_or(false);
        let interval = cli
            .scale_up_webhook_interval
            .or(file.scale_up_webhook_interval.map(|d| d.0))
            .unwrap_or(DEFAULT_SCALE_UP_WEBHOOK_INTERVAL);
        let scale_up_webhook = match cli.scale_up_webhook.or(file.scale_up_webhook) {
            Some(url) => {
                let url = url.trim().to_string();
                let host = url.strip_prefix("http://").unwrap_or("");
                if host.is_empty() || host.starts_with('/') {
                    return Err(SettingsError::Invalid(format!(
                        "scale-up webhook {url:?} must be an http:// URL (https is not supported)"
                    )));
                }
                if interval.is_zero() {
                    return Err(SettingsError::Invalid(
                        "scale-up webhook interval must be at least 1 ms".into(),
                    ));
                }
                Some((url, interval))
            }
            None => None,
        };
        let s = Settings {
            scale_up_webhook,
            async_queue,
            tls: match (cli.tls_cert.or(file.tls_cert), cli.tls_key.or(file.tls_key)) {
                (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
                (None, None) => None,
                _ => {
                    return Err(SettingsError::Invalid(
                        "tls_cert and tls_key go together: give both or neither".into(),
                    ))
                }
            },
            client_limits: ClientLimits {
                max_connections: cli
                    .max_connections
                    .or(file.max_connections)
                    .unwrap_or(limits::DEFAULT_MAX_CONNECTIONS),
                header_timeout: cli
                    .client_header_timeout
                    .or(file.client_header_timeout.map(|d| d.0))
                    .unwrap_or(limits::DEFAULT_HEADER_TIMEOUT),
                body_timeout: cli
                    .client_body_timeout
                    .or(file.client_body_timeout.map(|d| d.0))
                    .unwrap_or(limits::DEFAULT_BODY_TIMEOUT),
                max_header_bytes: cli
                    .max_header_bytes
                    .or(file.max_header_bytes)
                    .unwrap_or(limits::DEFAULT_MAX_HEADER_BYTES),
            },
            api_keys,
            management_token,
            inference_addr: cli
                .inference_addr
                .or(file.inference_addr)
                .unwrap_or_else(|| default_addr(DEFAULT_INFERENCE_ADDR)),
            management_addr: cli
                .management_addr
                .or(file.management_addr)
                .unwrap_or_else(|| default_addr(DEFAULT_MANAGEMENT_ADDR)),
            epp_addr: cli.epp_addr.or(file.epp_addr),
            dispatcher,
            priorities,
            retries,
            max_request_bytes: cli
                .max_request_bytes
                .or(file.max_request_bytes)
                .unwrap_or(DEFAULT_MAX_REQUEST_BYTES),
            shutdown_grace_period: Duration::from_secs(
                cli.shutdown_grace_period
                    .or(file.shutdown_grace_period)
                    .unwrap_or(DEFAULT_SHUTDOWN_GRACE_PERIOD_S),
            ),
            upstream_connect_timeout: Duration::from_millis(
                cli.upstream_connect_timeout
                    .or(file.upstream_connect_timeout)
                    .unwrap_or(DEFAULT_UPSTREAM_CONNECT_TIMEOUT_MS),
            ),
            threads: cli.threads.or(file.threads).unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
            }),
            log_level: cli
                .log_level
                .or(file.log_level)
                .unwrap_or_else(|| "info".to_string()),
            log_format: cli
                .log_format
                .or(file.log_format)
                .unwrap_or(LogFormat::Text),
        };
        s.validate()?;
        if s.management_token.is_none()
            && !s.management_addr.ip().is_loopback()
            && !allow_open_management
        {
            return Err(SettingsError::Invalid(format!(
                "the management port would listen on {} without a token, so anyone who reaches \
                 it could register a model server and receive traffic: set --management-token \
                 (or FLOWGATE_MANAGEMENT_TOKEN), or pass --allow-open-management to accept that",
                s.management_addr
            )));
        }
        Ok(s)
    }

    fn validate(&self) -> Result<(), SettingsError> {
        let invalid = |m: &str| Err(SettingsError::Invalid(m.to_string()));
        if self.inference_addr == self.management_addr {
            return invalid("inference_addr and management_addr must differ");
        }
        if self
            .epp_addr
            .is_some_and(|a| a == self.inference_addr || a == self.management_addr)
        {
            return invalid("epp_addr must differ from inference_addr and management_addr");
        }
        if self.max_request_bytes == 0 {
            return invalid("max_request_bytes must be at least 1");
        }
        if self.upstream_connect_timeout.is_zero() {
            return invalid("upstream_connect_timeout must be at least 1 ms");
        }
        if self.threads == 0 {
            return invalid("threads must be at least 1");
        }
        if let Some(a) = &self.async_queue {
            if !(0.0..1.0).contains(&a.baseline) {
                return invalid("async_baseline must be at least 0 and below 1");
            }
            if a.queue.max_length == 0 || a.queue.max_delivery == 0 {
                return invalid("async_max_length and async_max_delivery must be at least 1");
            }
            if a.queue.max_idle.is_zero() || a.gate_interval.is_zero() {
                return invalid("async_max_idle and async_gate_interval must be above 0");
            }
            if self.tls.is_some() {
                return invalid(
                    "the async path delivers through the plain inference port: it cannot be \
                     used with tls_cert yet",
                );
            }
        }
        let limits = &self.client_limits;
        if limits.max_connections == 0 {
            return invalid("max_connections must be at least 1");
        }
        if limits.header_timeout.is_zero() || limits.body_timeout.is_zero() {
            return invalid("client_header_timeout and client_body_timeout must be above 0");
        }
        if !(1024..=MAX_MAX_HEADER_BYTES).contains(&limits.max_header_bytes) {
            return invalid(&format!(
                "max_header_bytes must be 1024 to {MAX_MAX_HEADER_BYTES} \
                 (Pingora's own ceiling)"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("balancer").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn an_open_management_port_needs_a_token_or_an_explicit_flag() {
        let open = ["--management-addr", "0.0.0.0:8060"];
        let err = Settings::merge(cli(&open), FileConfig::default()).unwrap_err();
        assert!(err.to_string().contains("--management-token"), "{err}");
        let with_token = cli(&[&open[..], &["--management-token", "t0k"]].concat());
        let s = Settings::merge(with_token, FileConfig::default()).unwrap();
        assert!(s.management_token.unwrap().matches(b"t0k"));
        let allowed = cli(&[&open[..], &["--allow-open-management"]].concat());
        let s = Settings::merge(allowed, FileConfig::default()).unwrap();
        assert!(s.management_token.is_none());
        let empty = cli(&["--management-token", " "]);
        let err = Settings::merge(empty, FileConfig::default()).unwrap_err();
        assert!(err.to_string().contains("empty"), "{err}");
    }

    #[test]
    fn the_scale_up_webhook_needs_an_http_url() {
        let hook = |args: &[&str]| Settings::merge(cli(args), FileConfig::default());
        let s = hook(&["--scale-up-webhook", "http://10.0.0.1:9000/hook"]).unwrap();
        assert_eq!(
            s.scale_up_webhook,
            Some(("http://10.0.0.1:9000/hook".into(), Duration::from_secs(30)))
        );
        let s = hook(&[
            "--scale-up-webhook",
            "http://h:1",
            "--scale-up-webhook-interval",
            "2m",
        ])
        .unwrap();
        assert_eq!(s.scale_up_webhook.unwrap().1, Duration::from_secs(120));
        for bad in ["https://h/hook", "h:1", "http://", "http:///x"] {
            let err = hook(&["--scale-up-webhook", bad]).unwrap_err();
            assert!(err.to_string().contains("http://"), "{bad}: {err}");
        }
        let zero = [
            "--scale-up-webhook",
            "http://h:1",
            "--scale-up-webhook-interval",
            "0s",
        ];
        assert!(hook(&zero).is_err());
        // The same settings, and the security ones, from the config file.
        let file = FileConfig::parse(
            "scaleUpWebhook: http://h:1/x\nscaleUpWebhookInterval: 5s\n\
             managementToken: t0k\nallowOpenManagement: true\nmanagementAddr: 0.0.0.0:8060\n",
        )
        .unwrap();
        let s = Settings::merge(cli(&[]), file).unwrap();
        assert_eq!(
            s.scale_up_webhook,
            Some(("http://h:1/x".into(), Duration::from_secs(5)))
        );
        assert!(s.management_token.unwrap().matches(b"t0k"));
    }

    #[test]
    fn defaults_match_the_documentation() {
        let s = Settings::merge(cli(&[]), FileConfig::default()).unwrap();
        assert_eq!(s.inference_addr.to_string(), "127.0.0.1:8061");
        assert_eq!(s.management_addr.to_string(), "127.0.0.1:8060");
        assert_eq!(s.dispatcher.flow.max_requests, 30);
        assert_eq!(s.dispatcher.flow.max_bytes, 256 << 20);
        assert_eq!(s.dispatcher.default_ttl, Duration::from_secs(10));
        assert_eq!(s.dispatcher.max_ttl, Duration::from_secs(60));
        assert_eq!(
            s.dispatcher.saturation,
            flowgate::SaturationConfig::default()
        );
        assert_eq!(
            s.dispatcher.flow.default_band.fairness,
            flowgate::FairnessPolicy::RoundRobin
        );
        assert!(!s.priorities.allow_client_priority);
        assert_eq!(s.max_request_bytes, 16 << 20);
        assert_eq!(s.shutdown_grace_period, Duration::from_secs(30));
        assert_eq!(s.epp_addr, None, "EPP mode is off unless asked for");
        assert_eq!(
            s.client_limits,
            ClientLimits {
                max_connections: 4096,
                header_timeout: Duration::from_secs(10),
                body_timeout: Duration::from_secs(60),
                max_header_bytes: 32 * 1024,
            }
        );
    }

    #[test]
    fn the_async_section_is_read_and_flags_win() {
        let file = FileConfig::parse(
            "async:\n  dir: /var/lib/flowgate\n  gate: always-open\n  maxDelivery: 3\n  \
             maxIdle: 2m\n  deadLetter: rear\n  priority: -50\n",
        )
        .unwrap();
        let s = Settings::merge(cli(&["--async-max-delivery", "7"]), file).unwrap();
        let a = s.async_queue.expect("on");
        assert_eq!(a.dir, PathBuf::from("/var/lib/flowgate"));
        assert_eq!(a.gate, Gate::AlwaysOpen);
        assert_eq!(a.queue.max_delivery, 7, "the flag wins");
        assert_eq!(a.queue.max_idle, Duration::from_secs(120));
        assert_eq!(a.queue.dead_letter, DeadLetter::Rear);
        assert_eq!(a.priority, -50);
        assert!(Settings::merge(cli(&[]), FileConfig::default())
            .unwrap()
            .async_queue
            .is_none());

        let err = FileConfig::parse("async:\n  gates: balancer\n").unwrap_err();
        assert!(err.to_string().contains("gates"), "{err}");
        let prom = FileConfig::parse("async:\n  dir: /tmp/q\n  gate: prometheus\n").unwrap();
        let err = Settings::merge(cli(&[]), prom).unwrap_err();
        assert!(err.to_string().contains("PromQL"), "{err}");
        let err =
            Settings::merge(cli(&["--queue-url", "http://x"]), FileConfig::default()).unwrap_err();
        assert!(err.to_string().contains("redis://"), "{err}");
    }

    #[test]
    fn client_limits_are_read_and_checked() {
        let file = FileConfig::parse("maxConnections: 7\nclientHeaderTimeout: 2s\n").unwrap();
        let s = Settings::merge(cli(&["--client-body-timeout", "500ms"]), file).unwrap();
        assert_eq!(s.client_limits.max_connections, 7);
        assert_eq!(s.client_limits.header_timeout, Duration::from_secs(2));
        assert_eq!(s.client_limits.body_timeout, Duration::from_millis(500));
        for (args, want) in [
            (&["--max-connections", "0"][..], "max_connections"),
            (&["--max-header-bytes", "100"][..], "max_header_bytes"),
            (&["--max-header-bytes", "2000000"][..], "max_header_bytes"),
            (
                &["--client-header-timeout", "0"][..],
                "client_header_timeout",
            ),
        ] {
            let err = Settings::merge(cli(args), FileConfig::default()).unwrap_err();
            assert!(err.to_string().contains(want), "{args:?}: {err}");
        }
    }

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let file =
            FileConfig::parse("maxBufferedRequests: 5\nbufferedRequestTimeout: 250\n").unwrap();
        let s = Settings::merge(cli(&["--max-buffered-requests", "7"]), file).unwrap();
        assert_eq!(s.dispatcher.flow.max_requests, 7);
        assert_eq!(s.dispatcher.default_ttl, Duration::from_millis(250));
        let file = FileConfig::parse("eppAddr: 127.0.0.1:9002\n").unwrap();
        let s = Settings::merge(cli(&[]), file).unwrap();
        assert_eq!(s.epp_addr, Some("127.0.0.1:9002".parse().unwrap()));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_clear_errors() {
        let err = FileConfig::parse("maxBuferedRequests: 5").unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
        let err = FileConfig::parse("maxBufferedRequests: many").unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
        assert!(FileConfig::parse("").is_ok());
        let err = Settings::merge(
            cli(&[
                "--inference-addr",
                "127.0.0.1:9",
                "--management-addr",
                "127.0.0.1:9",
            ]),
            FileConfig::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("must differ"));
        let err = Settings::merge(
            cli(&["--epp-addr", "127.0.0.1:8061"]),
            FileConfig::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("epp_addr must differ"), "{err}");
        assert!(
            Settings::merge(cli(&["--max-request-bytes", "0"]), FileConfig::default()).is_err()
        );
    }

    #[test]
    fn flow_control_section_is_read_and_checked() {
        let file = FileConfig::parse(
            "flowControl:\n  maxRequests: 100\n  maxBytes: 1000000\n  defaultRequestTTL: 5s\n  \
             maxRequestTTL: 2m\n  defaultPriority: 1\n  priorityBands:\n  - priority: 10\n    \
             fairnessPolicyRef: global-strict-fairness-policy\n    orderingPolicyRef: edf\n  \
             - priority: -1\n    maxRequests: 20\n    maxBytes: 50000\n\
             saturationDetector:\n  queueDepthThreshold: 3\n  kvCacheUtilThreshold: 0.9\n  \
             metricsStalenessThreshold: 150ms\nobjectives:\n  chat: 10\n  batch: -1\n",
        )
        .unwrap();
        let s = Settings::merge(cli(&[]), file).unwrap();
        let d = &s.dispatcher;
        assert_eq!((d.flow.max_requests, d.flow.max_bytes), (100, 1_000_000));
        assert_eq!(d.default_ttl, Duration::from_secs(5));
        assert_eq!(d.max_ttl, Duration::from_secs(120));
        let high = d.flow.band(10);
        assert_eq!(high.fairness, flowgate::FairnessPolicy::GlobalStrict);
        assert_eq!(high.ordering, flowgate::OrderingPolicy::Edf);
        let low = d.flow.band(-1);
        assert_eq!((low.max_requests, low.max_bytes), (Some(20), Some(50_000)));
        assert_eq!(low.fairness, flowgate::FairnessPolicy::RoundRobin);
        assert_eq!(d.saturation.queue_depth_threshold, 3);
        assert_eq!(
            d.saturation.metrics_staleness_threshold,
            Duration::from_millis(150)
        );
        assert_eq!(s.priorities.objectives["batch"], -1);
        assert_eq!(s.priorities.default_priority, 1);
    }

    #[test]
    fn bad_flow_control_config_names_the_field() {
        let bad = |yaml: &str, want: &str| {
            let msg = match FileConfig::parse(yaml) {
                Err(e) => e.to_string(),
                Ok(file) => Settings::merge(cli(&[]), file).unwrap_err().to_string(),
            };
            assert!(msg.contains(want), "{yaml:?}: {msg}");
        };
        bad(
            "flowControl:\n  priorityBands:\n  - priority: 1\n    fairnessPolicyRef: lottery\n",
            "lottery",
        );
        bad(
            "flowControl:\n  priorityBands:\n  - priority: 1\n  - priority: 1\n",
            "flowControl.priorityBands[1].priority",
        );
        bad(
            "flowControl:\n  priorityBands:\n  - priority: 1\n    maxRequests: 0\n",
            "flowControl.priorityBands[0].maxRequests",
        );
        bad(
            "saturationDetector:\n  kvCacheUtilThreshold: 1.5\n",
            "saturationDetector.kvCacheUtilThreshold",
        );
        bad(
            "flowControl:\n  defaultRequestTTL: 90s\n  maxRequestTTL: 1s\n",
            "flowControl.maxRequestTTL",
        );
        bad(
            "maxBufferedRequests: 3\nflowControl:\n  maxRequests: 4\n",
            "give only one",
        );
        bad("flowControl:\n  maxQueue: 4\n", "unknown field");
        bad(
            "saturationDetector:\n  metricsStalenessThreshold: soon\n",
            "duration",
        );
        bad(
            "scheduling:\n  scorers:\n    kvCache: -1\n",
            "scheduling.scorers.kvCache",
        );
        bad("scheduling:\n  scorers:\n    latency: 1\n", "unknown field");
        bad(
            "scheduling:\n  prefixCache:\n    blockBytes: 0\n",
            "scheduling.prefixCache.blockBytes",
        );
        bad(
            "scheduling:\n  circuitBreaker:\n    backoff: 10s\n    maxBackoff: 1s\n",
            "scheduling.circuitBreaker.maxBackoff",
        );
        bad("scheduling:\n  retries: 9\n", "scheduling.retries");
    }

    #[test]
    fn scheduling_section_is_read() {
        let file = FileConfig::parse(
            "scheduling:\n  scorers:\n    prefixCache: 5\n    queue: 0\n  prefixCache:\n    \
             blockBytes: 128\n    capacityBlocks: 100\n  retries: 0\n  circuitBreaker:\n    \
             failures: 2\n    backoff: 1s\n  affinityHold: 50ms\n",
        )
        .unwrap();
        let s = Settings::merge(cli(&[]), file).unwrap();
        let sc = &s.dispatcher.scheduling;
        assert_eq!(sc.scorers.prefix_cache, 5.0);
        assert_eq!(sc.scorers.queue, 0.0);
        assert_eq!(sc.scorers.free_slots, 2.0, "left out: default");
        assert_eq!(
            (sc.prefix.block_bytes, sc.prefix.capacity_blocks),
            (128, 100)
        );
        assert_eq!(s.retries, 0);
        assert_eq!(sc.breaker.failures, 2);
        assert_eq!(sc.breaker.backoff, Duration::from_secs(1));
        assert_eq!(sc.affinity_hold, Duration::from_millis(50));
        let d = Settings::merge(cli(&[]), FileConfig::default()).unwrap();
        assert_eq!(d.retries, 1);
        assert_eq!(
            d.dispatcher.scheduling.affinity_hold,
            Duration::from_millis(200)
        );
    }

    #[test]
    fn example_configs_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("balancer")
            {
                let file = FileConfig::load(&path).unwrap();
                Settings::merge(cli(&[]), file).unwrap();
                n += 1;
            }
        }
        assert!(n > 0, "config/ holds at least one balancer example");
    }
}
