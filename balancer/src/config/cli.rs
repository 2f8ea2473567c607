//! The command-line flags (`--help` text included). Every flag is also a
//! config file key ([`super::file`]); [`super`] merges the two.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::asyncq::job::DeadLetter;
use crate::asyncq::{CapacityUnit, Gate};
use flowgate_logging::LogFormat;

/// Flowgate balancer: an OpenAI-compatible reverse proxy that holds requests
/// in a buffer until a model server reported by an agent has a free slot.
#[derive(Debug, Clone, Parser)]
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

    /// After SIGTERM, how long the balancer answers its readiness checks
    /// 503 while it still accepts and serves new requests, so a front load
    /// balancer or a Kubernetes Service stops sending before it stops
    /// listening (then the grace period begins): `5s`, or milliseconds, at
    /// most 10m [default: 0s]
    #[arg(long, value_name = "DURATION", value_parser = flowgate::duration::parse_duration)]
    pub drain_delay: Option<Duration>,

    /// Milliseconds to wait for a TCP connection to a model server
    /// [default: 5000]
    #[arg(long, value_name = "MS")]
    pub upstream_connect_timeout: Option<u64>,

    /// Idle connections to model servers kept open for reuse, all servers
    /// together, 1 to 1048576; past it the least recently used is closed.
    /// Each server holds at most as many as were once busy at the same time
    /// (the engine's own keep-alive timeout closes them too), so the total
    /// matters for large fleets: below the number of endpoints, most
    /// requests open a new connection [default: 4096]
    #[arg(long, value_name = "N")]
    pub upstream_idle_connections: Option<usize>,

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

    /// A model name the balancer answers to, for a model the fleet serves:
    /// `NAME=MODEL`, e.g. `gpt-4o-mini=smollm` (repeatable; beats the same
    /// name in the config file's `models.aliases`). The engine gets MODEL
    /// in the body's `model` field
    #[arg(long = "model-alias", value_name = "NAME=MODEL", value_parser = parse_pair)]
    pub model_aliases: Vec<(String, String)>,

    /// Requests that name no model, or one no server serves, go to this
    /// model instead of being answered 404 [default: none]
    #[arg(long, value_name = "MODEL")]
    pub default_model: Option<String>,

    /// Answer any model name the way a lone llama-server does: a name no
    /// server serves goes to any live endpoint, body unchanged (with
    /// `--default-model`, to that model) [default: off: such names get 404]
    #[arg(long)]
    pub any_model_name: bool,

    /// Where requests for MODEL go when no endpoint of it is live, in
    /// order: `MODEL=FALLBACK[,FALLBACK...]` (repeatable). Waiting longer
    /// than a time first needs the config file's `models.fallbacks`
    #[arg(long = "model-fallback", value_name = "MODEL=FALLBACKS", value_parser = parse_pair)]
    pub model_fallbacks: Vec<(String, String)>,

    /// A model's tokenizer, counted in process to match prompts against
    /// the KV-cache blocks engines report (`--kv-events` on their agents):
    /// `MODEL=DIR`, DIR a Hugging Face snapshot holding `tokenizer.json`
    /// (and `tokenizer_config.json` / `chat_template.jinja` for chats)
    /// (repeatable; beats the config file's `models.tokenizers`). Without
    /// one, prompts are tokenized by the engine's `/tokenize` [default: none]
    #[arg(long = "tokenizer", value_name = "MODEL=DIR", value_parser = parse_pair)]
    pub tokenizers: Vec<(String, String)>,

    /// Output tokens a request is assumed to produce when it names no
    /// bound (`max_tokens`, `max_completion_tokens`, `max_output_tokens`):
    /// part of its token estimate [default: 1024]
    #[arg(long, value_name = "N")]
    pub default_output_tokens: Option<u64>,

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

    /// Send OpenTelemetry traces of the inference port to this OTLP/HTTP
    /// collector (protobuf): a base URL gets `/v1/traces`
    /// (`http://127.0.0.1:4318`), a URL with a path is used as it is.
    /// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT wins over it [default: off]
    #[arg(long, value_name = "URL", env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// Share (0 to 1) of the traces the balancer starts that are kept; a
    /// client's own sampling decision (its traceparent) holds unless
    /// OTEL_TRACES_SAMPLER says otherwise [default: 1]
    #[arg(long, value_name = "RATIO", env = "OTEL_TRACES_SAMPLER_ARG")]
    pub trace_sample_ratio: Option<f64>,

    /// Directory of the async queue's embedded store; turns the async path
    /// on (`POST /v1/async/...`, see the README) [default: off]
    #[arg(long, value_name = "DIR")]
    pub async_dir: Option<PathBuf>,

    /// Share quota windows between balancers in this Redis
    /// (`redis://host:6379/0`; `quotas.redisUrl`) [default: each balancer
    /// keeps its own]
    #[arg(long, value_name = "URL")]
    pub quota_redis_url: Option<String>,

    /// Share session bindings between balancers in this Redis
    /// (`redis://host:6379/0`; `scheduling.sessions.redisUrl`), so a
    /// conversation's turns, with a session key or without (followed by
    /// their prompts), follow it whichever balancer they reach [default:
    /// each balancer keeps its own]
    #[arg(long, value_name = "URL")]
    pub sessions_redis_url: Option<String>,

    /// When the quota Redis does not answer: `open` admits the request
    /// (logged, counted in flowgate_quota_store_errors_total), `closed`
    /// refuses it with 503 (`quotas.onRedisError`) [default: open]
    #[arg(long, value_enum, value_name = "POLICY")]
    pub quota_on_redis_error: Option<super::quotas::OnStoreError>,

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

/// `NAME=VALUE`, both sides non-empty.
fn parse_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, value)) if !name.trim().is_empty() && !value.trim().is_empty() => {
            Ok((name.trim().to_string(), value.trim().to_string()))
        }
        _ => Err(format!("{s:?} is not NAME=VALUE")),
    }
}
