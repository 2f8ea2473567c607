//! What an agent learns from its model server, and the adapter trait each
//! engine (llama.cpp, vLLM, SGLang) implements.

use async_trait::async_trait;
use flowgate::BackendHealth;

/// One poll of a model server.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendStatus {
    pub health: BackendHealth,
    pub models: Vec<String>,
    pub slots_total: u32,
    pub slots_busy: u32,
    pub requests_waiting: u32,
    pub kv_cache_usage: Option<f64>,
    /// Tokens its KV cache holds in all, when the engine tells.
    pub kv_capacity_tokens: Option<u64>,
    /// Why the server is not ready, when it is not.
    pub last_error: Option<String>,
    /// Its LoRA adapters, when it says ([`crate::lora`]).
    pub adapters: Option<flowgate::protocol::AdapterReport>,
}

impl BackendStatus {
    pub fn unreachable(error: String) -> Self {
        BackendStatus {
            health: BackendHealth::Unreachable,
            models: Vec::new(),
            slots_total: 0,
            slots_busy: 0,
            requests_waiting: 0,
            kv_cache_usage: None,
            kv_capacity_tokens: None,
            last_error: Some(error),
            adapters: None,
        }
    }
}

/// An engine adapter. `poll` never fails: problems are reported as health.
#[async_trait]
pub trait Backend: Send + Sync {
    async fn poll(&self) -> BackendStatus;
}
