//! Agent → balancer report protocol (JSON over HTTP on the management port).
//!
//! An agent sends `POST /api/v1/agents/{agent_id}/report` with an
//! [`AgentReport`] body every monitoring interval; the first report registers
//! the agent. `DELETE /api/v1/agents/{agent_id}` deregisters it. The format is
//! versioned by [`PROTOCOL_VERSION`]; unknown fields are ignored so newer
//! agents can add optional data without breaking older balancers.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The report format version this build speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// The shortest monitoring interval an agent may announce.
pub const MIN_MONITORING_INTERVAL: Duration = Duration::from_millis(50);
/// The longest monitoring interval an agent may announce.
pub const MAX_MONITORING_INTERVAL: Duration = Duration::from_secs(60);

/// Longest accepted agent id / name, in bytes.
pub const MAX_ID_LEN: usize = 128;

/// The kind of model server an agent watches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Llamacpp,
    Vllm,
    Sglang,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Llamacpp => "llamacpp",
            BackendKind::Vllm => "vllm",
            BackendKind::Sglang => "sglang",
        }
    }
}

/// What the agent last saw of its model server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendHealth {
    /// The server answers and is loading its model: no traffic yet.
    Loading,
    /// The server is ready to take requests.
    Ready,
    /// The server could not be reached or answered garbage: no traffic.
    Unreachable,
}

/// One report from an agent about one model server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentReport {
    pub protocol_version: u32,
    /// Stable for the life of the agent process.
    pub agent_id: String,
    /// Human-readable name (defaults to the agent id).
    pub name: String,
    pub backend: BackendKind,
    /// `ip:port` the balancer sends inference traffic to.
    pub external_addr: String,
    /// Model ids the server answers for.
    #[serde(default)]
    pub models: Vec<String>,
    pub health: BackendHealth,
    /// Parallel request slots of the server.
    pub slots_total: u32,
    /// Slots the server reported busy (all clients, not only this balancer).
    pub slots_busy: u32,
    /// Requests waiting inside the server (llama.cpp: `requests_deferred`).
    #[serde(default)]
    pub requests_waiting: u32,
    /// KV-cache use 0..=1 when the engine exposes it.
    #[serde(default)]
    pub kv_cache_usage: Option<f64>,
    /// Tokens the server's KV cache holds in all (llama.cpp: the context of
    /// every slot; vLLM: GPU blocks × block size; SGLang:
    /// `max_total_num_tokens`), when the agent can tell.
    #[serde(default)]
    pub kv_capacity_tokens: Option<u64>,
    /// How often the agent reports, in milliseconds. The balancer treats the
    /// agent as stale after three missed intervals.
    pub monitoring_interval_ms: u64,
    /// The agent asks for no new work (in-flight requests finish).
    #[serde(default)]
    pub draining: bool,
    /// Why the backend is not ready, when it is not.
    #[serde(default)]
    pub last_error: Option<String>,
    /// The slots this balancer may fill on the server: its share of them,
    /// divided by the agent between the balancers it reports to (see
    /// [`crate::shares`]); `None` (an agent that divides nothing): all of
    /// them, less the busy ones the balancer did not send.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot_share: Option<u32>,
    /// How many balancers the agent reports to. A balancer that every
    /// agent names as the only one places a conversation's first turn
    /// beside its prompt's cached beginning; with others (or an agent
    /// that does not say) at its session's rendezvous home, which every
    /// balancer computes alike (see [`crate::session`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balancers: Option<u32>,
    /// When the agent's read of the engine behind this report began and
    /// ended, in milliseconds before the report was sent (the first
    /// rounded up, the second down): lets the balancer count its own
    /// requests as they stood at the read (see `src/endpoint/foreign.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_began_ms_ago: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_ended_ms_ago: Option<u64>,
    /// The server's LoRA adapters, when its engine serves any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters: Option<AdapterReport>,
    /// The engine's KV-cache events, when the agent follows them
    /// (`--kv-events`): their state. The blocks themselves go on their own
    /// route (`POST /api/v1/agents/{agent_id}/blocks`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsReport>,
}

/// What an agent says of the engine's KV-cache events it follows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventsReport {
    /// The version of the blocks' keys ([`crate::kv_events::KEY_VERSION`]):
    /// a balancer routes only on keys of its own version.
    pub key_version: u32,
    /// Tokens per block, once a stored block said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// Whether the blocks stand for the engine's whole cache: false after
    /// events were lost, until the engine's cache turned over (then the
    /// balancer routes on its own guess, as for an engine without events).
    pub whole: bool,
    pub blocks_gpu: u64,
    pub blocks_cpu: u64,
    /// Batches and events applied, since the agent started.
    pub batches: u64,
    pub events: u64,
    /// Gaps in the batches' numbering, replays asked, gaps no replay
    /// covered (the index dropped: resyncs), engine restarts seen.
    pub gaps: u64,
    pub replays: u64,
    pub resyncs: u64,
    pub restarts: u64,
    /// Frames and events skipped: undecodable, of an unknown type or
    /// medium, malformed, or after a parent the agent does not hold.
    pub skipped: u64,
    /// How long ago the last batch came.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_batch_ms_ago: Option<u64>,
}

/// Largest block an engine may report, in tokens.
pub const MAX_BLOCK_SIZE: u32 = 65_536;

/// What a server says of its LoRA adapters (vLLM: `/v1/models` entries
/// with a `parent`, and `vllm:lora_requests_info`). Names are the ones a
/// request gives as its `model`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdapterReport {
    /// Adapters it can serve.
    #[serde(default)]
    pub servable: Vec<String>,
    /// Adapters with requests running now (loaded, then).
    #[serde(default)]
    pub running: Vec<String>,
    /// Adapters with requests waiting for room to load.
    #[serde(default)]
    pub waiting: Vec<String>,
    /// Adapters loaded on the GPU now, running or not, when the engine
    /// says (vLLM's `vllm:lora_adapter_loaded`; `None`: it does not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loaded: Option<Vec<String>>,
    /// Adapters it holds loaded at once at most (vLLM's `max_lora`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_loaded: Option<u32>,
    /// Adapters the agent can have the server load when a balancer asks
    /// (its `--lora-adapter NAME=PATH`), not servable now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loadable: Vec<String>,
    /// Loads the agent asked for that failed lately, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub load_failed: Vec<LoadFailure>,
    /// Adapters loaded and evicted since the agent started, as it saw
    /// them come into and leave `loaded` from one poll to the next (an
    /// engine that does not say what it holds: `None`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loads: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evictions: Option<u64>,
}

/// A load of an adapter that failed, and the engine's word on it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadFailure {
    pub name: String,
    pub error: String,
}

/// Failed loads one report may carry, and the bytes of each one's error.
pub const MAX_LOAD_FAILURES: usize = 16;
pub const MAX_LOAD_ERROR_LEN: usize = 256;

/// Adapter names one report may list in each of its lists.
pub const MAX_ADAPTERS_PER_REPORT: usize = 1024;

/// Bytes of adapter names one report may carry in all its lists: with the
/// models (at most 128 names of 256 bytes) and the rest, a report stays
/// within the 64 KiB the management port reads.
pub const MAX_ADAPTER_NAME_BYTES: usize = 16 * 1024;

impl AdapterReport {
    /// Every list, `loaded` when said.
    fn lists(&self) -> impl Iterator<Item = &Vec<String>> {
        [&self.servable, &self.running, &self.waiting, &self.loadable]
            .into_iter()
            .chain(self.loaded.as_ref())
    }

    /// Bytes of all its names.
    pub fn name_bytes(&self) -> usize {
        self.lists().flatten().map(String::len).sum()
    }

    fn valid(&self) -> bool {
        self.load_failed.len() <= MAX_LOAD_FAILURES
            && self
                .load_failed
                .iter()
                .all(|f| valid_model_name(&f.name) && f.error.len() <= MAX_LOAD_ERROR_LEN)
            && self.name_bytes() <= MAX_ADAPTER_NAME_BYTES
            && self.lists().all(|names| {
                names.len() <= MAX_ADAPTERS_PER_REPORT && names.iter().all(|n| valid_model_name(n))
            })
    }
}

/// Why a report was refused. Mapped to HTTP 400 at the edge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    #[error("unsupported protocol_version {0} (this balancer speaks {PROTOCOL_VERSION})")]
    UnsupportedVersion(u32),
    #[error("agent_id must be 1..={MAX_ID_LEN} bytes of [A-Za-z0-9._-]")]
    BadAgentId,
    #[error("agent_id in the body ({body}) differs from the one in the path ({path})")]
    AgentIdMismatch { path: String, body: String },
    #[error("name must be at most {MAX_ID_LEN} bytes")]
    NameTooLong,
    #[error("external_addr {0:?} is not an ip:port socket address")]
    BadExternalAddr(String),
    #[error("monitoring_interval_ms {0} is outside 50..=60000")]
    BadInterval(u64),
    #[error("slots_busy {busy} exceeds slots_total {total}")]
    BusyOverTotal { busy: u32, total: u32 },
    #[error("kv_cache_usage {0} is not a number in 0..=1")]
    BadKvUsage(String),
    #[error("kv_capacity_tokens {0} is not 1..={MAX_KV_CAPACITY_TOKENS}")]
    BadKvCapacity(u64),
    #[error("a report lists at most {MAX_MODELS_PER_REPORT} models ({0} given)")]
    TooManyModels(usize),
    #[error("model names are 1..={MAX_MODEL_NAME_LEN} bytes")]
    BadModelName,
    #[error("adapters: each list holds at most {MAX_ADAPTERS_PER_REPORT} names of 1..={MAX_MODEL_NAME_LEN} bytes, {MAX_ADAPTER_NAME_BYTES} bytes of names in all; load_failed at most {MAX_LOAD_FAILURES} entries with errors of at most {MAX_LOAD_ERROR_LEN} bytes")]
    BadAdapters,
    #[error("kv_events.block_size {0} is not 1..={MAX_BLOCK_SIZE}")]
    BadBlockSize(u32),
    #[error("last_error is at most {MAX_LAST_ERROR_LEN} bytes")]
    LastErrorTooLong,
    #[error("this balancer takes at most {0} agents: refused a new one")]
    TooManyAgents(usize),
    #[error("this balancer knows at most {0} distinct model names: refused a new one")]
    TooManyModelNames(usize),
}

/// Models one report may list (a server and its adapters).
pub const MAX_MODELS_PER_REPORT: usize = 128;
/// Longest model name.
pub const MAX_MODEL_NAME_LEN: usize = 256;

/// Whether a report may carry `name` as a model or adapter name: 1 to
/// [`MAX_MODEL_NAME_LEN`] bytes.
pub fn valid_model_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_MODEL_NAME_LEN
}
/// Largest KV capacity a report may claim (2^40 tokens: far beyond any
/// server, small enough that sums of them cannot overflow).
pub const MAX_KV_CAPACITY_TOKENS: u64 = 1 << 40;
/// Longest `last_error`.
pub const MAX_LAST_ERROR_LEN: usize = 4096;

/// Whether `id` is acceptable as an agent id (it appears in URL paths).
pub fn valid_agent_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl AgentReport {
    /// Checks every field; returns the parsed traffic address.
    pub fn validate(&self) -> Result<SocketAddr, ReportError> {
        if self.protocol_version != PROTOCOL_VERSION {
            return Err(ReportError::UnsupportedVersion(self.protocol_version));
        }
        if !valid_agent_id(&self.agent_id) {
            return Err(ReportError::BadAgentId);
        }
        if self.name.len() > MAX_ID_LEN {
            return Err(ReportError::NameTooLong);
        }
        let addr: SocketAddr = self
            .external_addr
            .parse()
            .map_err(|_| ReportError::BadExternalAddr(self.external_addr.clone()))?;
        let interval = Duration::from_millis(self.monitoring_interval_ms);
        if !(MIN_MONITORING_INTERVAL..=MAX_MONITORING_INTERVAL).contains(&interval) {
            return Err(ReportError::BadInterval(self.monitoring_interval_ms));
        }
        if self.slots_busy > self.slots_total {
            return Err(ReportError::BusyOverTotal {
                busy: self.slots_busy,
                total: self.slots_total,
            });
        }
        if let Some(kv) = self.kv_cache_usage {
            if !(0.0..=1.0).contains(&kv) {
                return Err(ReportError::BadKvUsage(kv.to_string()));
            }
        }
        if let Some(c) = self.kv_capacity_tokens {
            if !(1..=MAX_KV_CAPACITY_TOKENS).contains(&c) {
                return Err(ReportError::BadKvCapacity(c));
            }
        }
        if self.models.len() > MAX_MODELS_PER_REPORT {
            return Err(ReportError::TooManyModels(self.models.len()));
        }
        if self.models.iter().any(|m| !valid_model_name(m)) {
            return Err(ReportError::BadModelName);
        }
        if self.adapters.as_ref().is_some_and(|a| !a.valid()) {
            return Err(ReportError::BadAdapters);
        }
        if let Some(size) = self.kv_events.and_then(|k| k.block_size) {
            if !(1..=MAX_BLOCK_SIZE).contains(&size) {
                return Err(ReportError::BadBlockSize(size));
            }
        }
        if self
            .last_error
            .as_ref()
            .is_some_and(|e| e.len() > MAX_LAST_ERROR_LEN)
        {
            return Err(ReportError::LastErrorTooLong);
        }
        Ok(addr)
    }

    pub fn monitoring_interval(&self) -> Duration {
        Duration::from_millis(self.monitoring_interval_ms)
    }

    /// When the engine read behind the report began and ended, as ages
    /// at its sending (`None`: the agent does not say). Any numbers are
    /// taken: a read older than the previous report counts the balancer's
    /// requests as they stood then; an end said before the beginning is
    /// taken as the beginning.
    pub fn read_window(&self) -> Option<(Duration, Duration)> {
        let began = self.read_began_ms_ago?;
        let ended = self.read_ended_ms_ago.unwrap_or(0).min(began);
        Some((Duration::from_millis(began), Duration::from_millis(ended)))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn report(id: &str, addr: &str, slots: u32) -> AgentReport {
        AgentReport {
            protocol_version: PROTOCOL_VERSION,
            agent_id: id.to_string(),
            name: id.to_string(),
            backend: BackendKind::Llamacpp,
            external_addr: addr.to_string(),
            models: vec!["m".into()],
            health: BackendHealth::Ready,
            slots_total: slots,
            slots_busy: 0,
            requests_waiting: 0,
            kv_cache_usage: None,
            kv_capacity_tokens: None,
            monitoring_interval_ms: 1000,
            draining: false,
            last_error: None,
            slot_share: None,
            balancers: None,
            read_began_ms_ago: None,
            read_ended_ms_ago: None,
            adapters: None,
            kv_events: None,
        }
    }

    #[test]
    fn valid_report_round_trips_through_json() {
        let r = report("a-1", "127.0.0.1:8080", 4);
        let json = serde_json::to_string(&r).unwrap();
        let back: AgentReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.validate().unwrap(), "127.0.0.1:8080".parse().unwrap());
    }

    #[test]
    fn unknown_fields_are_ignored_and_optional_fields_default() {
        let json = r#"{"protocol_version":1,"agent_id":"x","name":"x","backend":"vllm",
            "external_addr":"[::1]:9","health":"loading","slots_total":2,"slots_busy":1,
            "monitoring_interval_ms":50,"future_field":{"a":1}}"#;
        let r: AgentReport = serde_json::from_str(json).unwrap();
        assert_eq!(r.requests_waiting, 0);
        assert!(!r.draining);
        assert!(r.validate().is_ok());
    }

    #[test]
    fn each_bad_field_has_its_own_error() {
        let ok = report("a", "127.0.0.1:1", 4);
        for bad in [
            vec![String::new()],
            vec!["a".repeat(MAX_MODEL_NAME_LEN + 1)],
            vec!["a".to_string(); MAX_ADAPTERS_PER_REPORT + 1],
            vec!["a".repeat(MAX_MODEL_NAME_LEN); MAX_ADAPTER_NAME_BYTES / MAX_MODEL_NAME_LEN + 1],
        ] {
            let mut r = ok.clone();
            r.adapters = Some(AdapterReport {
                waiting: bad,
                ..AdapterReport::default()
            });
            assert_eq!(r.validate(), Err(ReportError::BadAdapters));
        }
        let failure = |error: String| LoadFailure {
            name: "a".into(),
            error,
        };
        for bad in [
            vec![failure("x".repeat(MAX_LOAD_ERROR_LEN + 1))],
            vec![failure(String::new()); MAX_LOAD_FAILURES + 1],
        ] {
            let mut r = ok.clone();
            r.adapters = Some(AdapterReport {
                load_failed: bad,
                ..AdapterReport::default()
            });
            assert_eq!(r.validate(), Err(ReportError::BadAdapters));
        }
        let mut r = ok.clone();
        r.protocol_version = 2;
        assert_eq!(r.validate(), Err(ReportError::UnsupportedVersion(2)));
        let mut r = ok.clone();
        r.agent_id = "has space".into();
        assert_eq!(r.validate(), Err(ReportError::BadAgentId));
        let mut r = ok.clone();
        r.agent_id = "x".repeat(MAX_ID_LEN + 1);
        assert_eq!(r.validate(), Err(ReportError::BadAgentId));
        let mut r = ok.clone();
        r.external_addr = "localhost:80".into();
        assert!(matches!(r.validate(), Err(ReportError::BadExternalAddr(_))));
        let mut r = ok.clone();
        r.monitoring_interval_ms = 10;
        assert_eq!(r.validate(), Err(ReportError::BadInterval(10)));
        let mut r = ok.clone();
        r.slots_busy = 5;
        assert!(matches!(
            r.validate(),
            Err(ReportError::BusyOverTotal { .. })
        ));
        let mut r = ok.clone();
        r.kv_cache_usage = Some(f64::NAN);
        assert!(matches!(r.validate(), Err(ReportError::BadKvUsage(_))));
        let mut r = ok.clone();
        r.kv_cache_usage = Some(1.5);
        assert!(matches!(r.validate(), Err(ReportError::BadKvUsage(_))));
        for bad in [0, MAX_KV_CAPACITY_TOKENS + 1, u64::MAX] {
            let mut r = ok.clone();
            r.kv_capacity_tokens = Some(bad);
            assert_eq!(r.validate(), Err(ReportError::BadKvCapacity(bad)));
        }
        let mut r = ok;
        r.kv_capacity_tokens = Some(4096);
        assert!(r.validate().is_ok());
    }
}
