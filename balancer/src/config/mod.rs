//! The balancer's configuration: command-line flags ([`cli`]), the optional
//! YAML config file ([`file`]), and their merge into checked [`Settings`].
//!
//! The one layering rule: a flag given on the command line beats the config
//! file, which beats the built-in default ([`layer`]). Every setting has
//! the same name in both places, kebab-case as a flag and camelCase in YAML
//! (`--max-buffered-requests` ⇔ `maxBufferedRequests`). Errors name the
//! setting that is wrong.
//!
//! - [`flow`]: `flowControl`, `saturationDetector`, `objectives`,
//!   `modelPriorities`.
//! - [`scheduling`]: `scheduling` (scorers, prefix affinity, breaker).
//! - [`async_queue`]: the `--async-*` flags and the `async:` section.
//! - [`models`]: `models:` and the model flags (aliases, default model,
//!   rewrites, fallbacks).
//! - [`quotas`]: `quotas:`, the keys' `quota:` and the quota store flags.

mod async_queue;
mod cli;
mod file;
pub mod flow;
mod models;
pub mod quotas;
pub mod scheduling;

#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use flowgate::DispatcherConfig;

use crate::asyncq::AsyncConfig;
use crate::auth::{ApiKeys, Secret};
use crate::connection::{self, ClientLimits, MAX_MAX_HEADER_BYTES};
use crate::tls::TlsFiles;
use flowgate::admission::PriorityRules;

pub use cli::Cli;
pub use file::FileConfig;
pub use flowgate_logging::LogFormat;

use async_queue::async_settings;

/// The one layering rule: the flag, else the file, else the default.
fn layer<T>(flag: Option<T>, file: Option<T>, default: T) -> T {
    flag.or(file).unwrap_or(default)
}

pub const DEFAULT_INFERENCE_ADDR: &str = "127.0.0.1:8061";
pub const DEFAULT_MANAGEMENT_ADDR: &str = "127.0.0.1:8060";
pub const DEFAULT_MAX_BUFFERED_REQUESTS: usize = 30;
pub const DEFAULT_BUFFERED_REQUEST_TIMEOUT_MS: u64 = 10_000;
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;
pub const DEFAULT_SHUTDOWN_GRACE_PERIOD_S: u64 = 30;
/// The longest `drainDelay`.
pub const MAX_DRAIN_DELAY: Duration = Duration::from_secs(600);
pub const DEFAULT_UPSTREAM_CONNECT_TIMEOUT_MS: u64 = 5_000;
pub const DEFAULT_UPSTREAM_IDLE_CONNECTIONS: usize = 4096;
/// Bound of `--upstream-idle-connections`: Pingora sizes its pool's maps
/// up front.
pub const MAX_UPSTREAM_IDLE_CONNECTIONS: usize = 1 << 20;
pub const DEFAULT_SCALE_UP_WEBHOOK_INTERVAL: Duration = Duration::from_secs(30);

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
    /// Latency objectives of requests that name none.
    pub objectives: flowgate::objective::ObjectiveDefaults,
    /// Token-fairness weights by fairness id.
    pub weights: std::collections::HashMap<String, u32>,
    /// Which session keys name a conversation, in order.
    pub sessions: flowgate::SessionRules,
    /// Where session bindings are shared between balancers, if anywhere.
    pub session_redis_url: Option<String>,
    /// Who gets the `x-flowgate-scores` answer header.
    pub explain: crate::rules::ExplainScores,
    /// Quotas per tenant (keys carry their own).
    pub quotas: flowgate::quota::QuotaRules,
    /// Where quota windows are kept.
    pub quota_store: quotas::QuotaStore,
    /// Which served model a requested name goes to.
    pub models: flowgate::models::ModelRules,
    /// Each served model's tokenizer directory, for those given one.
    pub tokenizers: std::collections::BTreeMap<String, PathBuf>,
    /// Output tokens assumed for a request that names no bound.
    pub default_output_tokens: u64,
    /// Retries on another endpoint after a failure before the first byte.
    pub retries: u32,
    pub max_request_bytes: usize,
    pub shutdown_grace_period: Duration,
    /// After SIGTERM: readiness 503 while still serving, this long.
    pub drain_delay: Duration,
    pub upstream_connect_timeout: Duration,
    /// Idle upstream connections kept for reuse, all servers together.
    pub upstream_idle_connections: usize,
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
    /// OpenTelemetry traces, when on.
    pub traces: Option<crate::observe::traces::TraceSettings>,
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

impl Settings {
    /// The rules every front door admits requests by.
    pub fn admission(&self) -> flowgate::admission::AdmissionRules {
        flowgate::admission::AdmissionRules {
            priorities: self.priorities.clone(),
            prefix: self.dispatcher.scheduling.prefix,
            models: self.models.clone(),
            default_output_tokens: self.default_output_tokens,
            weights: self.weights.clone(),
            sessions: self.sessions.clone(),
            objectives: self.objectives.clone(),
        }
    }

    /// The doors' rules: API keys and admission.
    pub fn door_rules(&self) -> crate::rules::DoorRules {
        crate::rules::DoorRules {
            admission: self.admission(),
            api_keys: self.api_keys.clone(),
            quotas: self.quotas.clone(),
            explain: self.explain,
        }
    }

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
            layer(
                cli.max_request_bytes,
                file.max_request_bytes,
                DEFAULT_MAX_REQUEST_BYTES,
            ),
        )?;
        let default_addr = |s: &str| s.parse::<SocketAddr>().expect("valid default address");
        let fc = file.flow_control.take().unwrap_or_default();
        let (max_requests, max_bytes, default_ttl) = buffer_limits(&cli, &file, &fc)?;
        let scale_up_webhook = scale_up_webhook(&cli, &file)?;
        let tls = tls_files(cli.tls_cert.clone(), cli.tls_key.clone(), &file)?;
        let client_limits = client_limits(&cli, &file);
        let drain_delay = drain_delay(&cli, &file)?;
        let (mut dispatcher, priorities, weights) = flow::build(
            &fc,
            &file.saturation_detector.unwrap_or_default(),
            &file.objectives,
            &file.model_priorities,
            max_requests,
            max_bytes,
            default_ttl,
        )
        .map_err(SettingsError::Invalid)?;
        let objectives = file
            .latency_objectives
            .take()
            .unwrap_or_default()
            .build()
            .map_err(SettingsError::Invalid)?;
        let scheduling_section = file.scheduling.unwrap_or_default();
        let explain = scheduling_section.explain.unwrap_or_default();
        let (sched, retries, sessions) =
            scheduling::build(&scheduling_section).map_err(SettingsError::Invalid)?;
        let session_redis_url =
            scheduling::session_redis_url(cli.sessions_redis_url.clone(), &scheduling_section)
                .map_err(SettingsError::Invalid)?;
        dispatcher.scheduling = sched;
        let (quota_rules, quota_store) =
            quotas::build(&cli, &file.quotas.take().unwrap_or_default())
                .map_err(SettingsError::Invalid)?;
        let models_section = file.models.take().unwrap_or_default();
        let models = models::build(&cli, &models_section).map_err(SettingsError::Invalid)?;
        let tokenizers =
            models::tokenizers(&cli, &models_section).map_err(SettingsError::Invalid)?;
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
        let traces = traces(
            cli.otlp_endpoint.clone(),
            cli.trace_sample_ratio,
            file.traces.take().unwrap_or_default(),
        )
        .map_err(SettingsError::Invalid)?;
        let s = Settings {
            scale_up_webhook,
            async_queue,
            traces,
            tls,
            client_limits,
            api_keys,
            management_token,
            inference_addr: layer(
                cli.inference_addr,
                file.inference_addr,
                default_addr(DEFAULT_INFERENCE_ADDR),
            ),
            management_addr: layer(
                cli.management_addr,
                file.management_addr,
                default_addr(DEFAULT_MANAGEMENT_ADDR),
            ),
            epp_addr: cli.epp_addr.or(file.epp_addr),
            dispatcher,
            priorities,
            objectives,
            weights,
            sessions,
            session_redis_url,
            explain,
            quotas: quota_rules,
            quota_store,
            models,
            tokenizers,
            default_output_tokens: layer(
                cli.default_output_tokens,
                file.default_output_tokens,
                flowgate::tokens::DEFAULT_OUTPUT_TOKENS,
            ),
            retries,
            max_request_bytes: layer(
                cli.max_request_bytes,
                file.max_request_bytes,
                DEFAULT_MAX_REQUEST_BYTES,
            ),
            shutdown_grace_period: Duration::from_secs(layer(
                cli.shutdown_grace_period,
                file.shutdown_grace_period,
                DEFAULT_SHUTDOWN_GRACE_PERIOD_S,
            )),
            drain_delay,
            upstream_connect_timeout: Duration::from_millis(layer(
                cli.upstream_connect_timeout,
                file.upstream_connect_timeout,
                DEFAULT_UPSTREAM_CONNECT_TIMEOUT_MS,
            )),
            upstream_idle_connections: layer(
                cli.upstream_idle_connections,
                file.upstream_idle_connections,
                DEFAULT_UPSTREAM_IDLE_CONNECTIONS,
            ),
            threads: cli.threads.or(file.threads).unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
            }),
            log_level: layer(cli.log_level, file.log_level, "info".to_string()),
            log_format: layer(cli.log_format, file.log_format, LogFormat::Text),
        };
        s.validate()?;
        s.check_management_access(allow_open_management)?;
        Ok(s)
    }

    /// A management port off loopback needs a token, or the operator's
    /// word that it is open on purpose.
    fn check_management_access(&self, allow_open: bool) -> Result<(), SettingsError> {
        if self.management_token.is_none()
            && !self.management_addr.ip().is_loopback()
            && !allow_open
        {
            return Err(SettingsError::Invalid(format!(
                "the management port would listen on {} without a token, so anyone who reaches \
                 it could register a model server and receive traffic: set --management-token \
                 (or FLOWGATE_MANAGEMENT_TOKEN), or pass --allow-open-management to accept that",
                self.management_addr
            )));
        }
        Ok(())
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
        if !(1..=MAX_UPSTREAM_IDLE_CONNECTIONS).contains(&self.upstream_idle_connections) {
            return invalid(&format!(
                "upstream_idle_connections must be 1 to {MAX_UPSTREAM_IDLE_CONNECTIONS}"
            ));
        }
        if self.threads == 0 {
            return invalid("threads must be at least 1");
        }
        if !(1..=flowgate::tokens::MAX_OUTPUT_TOKENS).contains(&self.default_output_tokens) {
            return invalid(&format!(
                "default_output_tokens must be 1 to {}",
                flowgate::tokens::MAX_OUTPUT_TOKENS
            ));
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

/// The checked trace settings: an endpoint from the signal's own
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else the flag (or
/// `OTEL_EXPORTER_OTLP_ENDPOINT`), else the file; off without one. Only
/// `http/protobuf` is spoken: another `OTEL_EXPORTER_OTLP_PROTOCOL` is an
/// error rather than traces silently lost.
fn traces(
    endpoint_flag: Option<String>,
    ratio_flag: Option<f64>,
    file: file::TracesSection,
) -> Result<Option<crate::observe::traces::TraceSettings>, String> {
    use crate::observe::traces::TraceSettings;
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let endpoint = match env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
        Some(url) => Some(url),
        None => endpoint_flag.or(file.endpoint),
    };
    let Some(endpoint) = endpoint.filter(|e| !e.trim().is_empty()) else {
        return Ok(None);
    };
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Some(p) = env(name) {
            if p.trim() != "http/protobuf" {
                return Err(format!(
                    "{name}={p}: the balancer sends traces over http/protobuf only"
                ));
            }
            break;
        }
    }
    // OTEL_TRACES_SAMPLER: always_on / always_off / traceidratio, each
    // also parentbased_ (the default: a client's decision holds).
    let sampler = env("OTEL_TRACES_SAMPLER").map(|s| s.trim().to_ascii_lowercase());
    let (parent_based, fixed) = match sampler.as_deref() {
        None | Some("parentbased_traceidratio") => (true, None),
        Some("traceidratio") => (false, None),
        Some("parentbased_always_on") => (true, Some(1.0)),
        Some("always_on") => (false, Some(1.0)),
        Some("parentbased_always_off") => (true, Some(0.0)),
        Some("always_off") => (false, Some(0.0)),
        Some(other) => {
            return Err(format!(
                "OTEL_TRACES_SAMPLER={other}: the balancer knows always_on, always_off, \
                 traceidratio and their parentbased_ forms"
            ))
        }
    };
    let sample_ratio = match fixed {
        Some(r) => r,
        None => ratio_flag.or(file.sample_ratio).unwrap_or(1.0),
    };
    if !(0.0..=1.0).contains(&sample_ratio) {
        return Err(format!(
            "the trace sample ratio must be between 0 and 1, not {sample_ratio}"
        ));
    }
    Ok(Some(TraceSettings {
        endpoint: TraceSettings::traces_url(endpoint.trim())?,
        sample_ratio,
        parent_based,
    }))
}

/// The buffer's limits: requests, bytes and the default TTL, each given
/// once (a top-level key or its `flowControl` twin, not both).
fn buffer_limits(
    cli: &Cli,
    file: &FileConfig,
    fc: &flow::FlowControlSection,
) -> Result<(usize, u64, Duration), SettingsError> {
    for (top, nested, in_file, in_section) in [
        (
            "maxBufferedRequests",
            "maxRequests",
            file.max_buffered_requests.is_some(),
            fc.max_requests.is_some(),
        ),
        (
            "bufferedRequestTimeout",
            "defaultRequestTTL",
            file.buffered_request_timeout.is_some(),
            fc.default_request_ttl.is_some(),
        ),
        (
            "maxBufferedBytes",
            "maxBytes",
            file.max_buffered_bytes.is_some(),
            fc.max_bytes.is_some(),
        ),
    ] {
        if in_file && in_section {
            return Err(SettingsError::Invalid(format!(
                "{top} and flowControl.{nested} are the same setting: give only one"
            )));
        }
    }
    let max_requests = (cli.max_buffered_requests)
        .or(file.max_buffered_requests)
        .or(fc.max_requests)
        .unwrap_or(DEFAULT_MAX_BUFFERED_REQUESTS);
    let max_bytes = (cli.max_buffered_bytes)
        .or(file.max_buffered_bytes)
        .or(fc.max_bytes)
        .unwrap_or(flow::DEFAULT_MAX_BUFFERED_BYTES);
    let default_ttl = (cli.buffered_request_timeout)
        .or(file.buffered_request_timeout)
        .map(Duration::from_millis)
        .or(fc.default_request_ttl.map(|d| d.0))
        .unwrap_or(Duration::from_millis(DEFAULT_BUFFERED_REQUEST_TIMEOUT_MS));
    if default_ttl.is_zero() {
        return Err(SettingsError::Invalid(
            "buffered_request_timeout (flowControl.defaultRequestTTL) must be at least 1 ms".into(),
        ));
    }
    Ok((max_requests, max_bytes, default_ttl))
}

/// The scale-up webhook (an http:// URL) and how often it is called.
fn scale_up_webhook(
    cli: &Cli,
    file: &FileConfig,
) -> Result<Option<(String, Duration)>, SettingsError> {
    let interval = layer(
        cli.scale_up_webhook_interval,
        file.scale_up_webhook_interval.map(|d| d.0),
        DEFAULT_SCALE_UP_WEBHOOK_INTERVAL,
    );
    let Some(url) = cli
        .scale_up_webhook
        .clone()
        .or(file.scale_up_webhook.clone())
    else {
        return Ok(None);
    };
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
    Ok(Some((url, interval)))
}

/// The inference port's certificate and key: both or neither.
fn tls_files(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    file: &FileConfig,
) -> Result<Option<TlsFiles>, SettingsError> {
    match (cert.or(file.tls_cert.clone()), key.or(file.tls_key.clone())) {
        (Some(cert), Some(key)) => Ok(Some(TlsFiles { cert, key })),
        (None, None) => Ok(None),
        _ => Err(SettingsError::Invalid(
            "tls_cert and tls_key go together: give both or neither".into(),
        )),
    }
}

/// What one client connection may hold and take.
fn client_limits(cli: &Cli, file: &FileConfig) -> ClientLimits {
    ClientLimits {
        max_connections: layer(
            cli.max_connections,
            file.max_connections,
            connection::DEFAULT_MAX_CONNECTIONS,
        ),
        header_timeout: layer(
            cli.client_header_timeout,
            file.client_header_timeout.map(|d| d.0),
            connection::DEFAULT_HEADER_TIMEOUT,
        ),
        body_timeout: layer(
            cli.client_body_timeout,
            file.client_body_timeout.map(|d| d.0),
            connection::DEFAULT_BODY_TIMEOUT,
        ),
        max_header_bytes: layer(
            cli.max_header_bytes,
            file.max_header_bytes,
            connection::DEFAULT_MAX_HEADER_BYTES,
        ),
    }
}

/// How long a draining balancer keeps taking requests before it stops
/// (at most [`MAX_DRAIN_DELAY`]).
fn drain_delay(cli: &Cli, file: &FileConfig) -> Result<Duration, SettingsError> {
    let d = (cli.drain_delay)
        .or(file.drain_delay.map(|d| d.0))
        .unwrap_or(Duration::ZERO);
    if d > MAX_DRAIN_DELAY {
        return Err(SettingsError::Invalid(format!(
            "drainDelay must be at most 10m, not {}s",
            d.as_secs()
        )));
    }
    Ok(d)
}
