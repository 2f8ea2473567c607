//! vLLM and SGLang adapters. Both engines expose their load only as
//! Prometheus gauges and neither tells its batch size limit, so slots come
//! from `--max-concurrency` (vLLM's `--max-num-seqs`, SGLang's
//! `--max-running-requests`).
//!
//! - vLLM: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//!   `vllm:kv_cache_usage_perc` (older servers: `vllm:gpu_cache_usage_perc`).
//! - SGLang (`--enable-metrics`): `sglang:num_running_reqs`,
//!   `sglang:num_queue_reqs`, `sglang:token_usage`.
//!
//! Counts are summed over every series (data-parallel engines, several
//! served models); KV use is the largest, the one that saturates first.
//! `/health` answering 200 means ready, 503 loading; `/v1/models` lists the
//! served model names.

use async_trait::async_trait;
use flowgate::{BackendHealth, BackendKind};
use reqwest::StatusCode;

use crate::backend::{Backend, BackendStatus};
use crate::http::BackendHttp;
use crate::llamacpp::parse_models;
use crate::lora;
use crate::prom;

/// The metric names an engine uses.
#[derive(Debug, Clone, Copy)]
pub struct EngineMetrics {
    pub running: &'static str,
    pub waiting: &'static str,
    /// KV-cache use 0..=1, first name found wins.
    pub kv_cache: &'static [&'static str],
    /// Where its KV capacity in tokens is read.
    pub kv_capacity: KvCapacity,
}

/// How an engine tells its KV capacity in tokens.
#[derive(Debug, Clone, Copy)]
pub enum KvCapacity {
    /// vLLM: an info gauge whose labels carry `num_gpu_blocks` and
    /// `block_size` (their product).
    BlockLabels(&'static str),
    /// SGLang: a gauge of tokens.
    Gauge(&'static str),
}

pub const VLLM: EngineMetrics = EngineMetrics {
    running: "vllm:num_requests_running",
    waiting: "vllm:num_requests_waiting",
    kv_cache: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    kv_capacity: KvCapacity::BlockLabels("vllm:cache_config_info"),
};

pub const SGLANG: EngineMetrics = EngineMetrics {
    running: "sglang:num_running_reqs",
    waiting: "sglang:num_queue_reqs",
    kv_cache: &["sglang:token_usage"],
    kv_capacity: KvCapacity::Gauge("sglang:max_total_num_tokens"),
};

/// What the metrics say: (running, waiting, KV use, KV capacity).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineLoad {
    pub running: u32,
    pub waiting: u32,
    pub kv_cache_usage: Option<f64>,
    pub kv_capacity_tokens: Option<u64>,
}

impl EngineMetrics {
    pub fn for_kind(kind: BackendKind) -> Option<Self> {
        match kind {
            BackendKind::Vllm => Some(VLLM),
            BackendKind::Sglang => Some(SGLANG),
            BackendKind::Llamacpp => None,
        }
    }

    /// Reads a scrape's samples; an error when the running gauge is
    /// missing (wrong engine, or SGLang without `--enable-metrics`).
    pub fn read(&self, samples: &[prom::Sample]) -> Result<EngineLoad, String> {
        let running = prom::sum(samples, self.running)
            .ok_or_else(|| format!("/metrics has no {}", self.running))?;
        let waiting = prom::sum(samples, self.waiting).unwrap_or(0.0);
        let kv_cache_usage = self
            .kv_cache
            .iter()
            .find_map(|name| prom::max(samples, name))
            .filter(|v| v.is_finite())
            .map(|v| v.clamp(0.0, 1.0));
        Ok(EngineLoad {
            running: prom::to_count(running),
            waiting: prom::to_count(waiting),
            kv_cache_usage,
            kv_capacity_tokens: self.kv_capacity_tokens(samples),
        })
    }

    /// The KV capacity in tokens, summed over the engine's series (data
    /// parallel ranks each hold their own cache).
    fn kv_capacity_tokens(&self, samples: &[prom::Sample]) -> Option<u64> {
        let tokens = |v: f64| (v.is_finite() && v >= 1.0).then(|| v.min(1e15) as u64);
        let total = match self.kv_capacity {
            KvCapacity::Gauge(name) => samples
                .iter()
                .filter(|s| s.name == name)
                .filter_map(|s| tokens(s.value))
                .fold(0u64, u64::saturating_add),
            KvCapacity::BlockLabels(name) => samples
                .iter()
                .filter(|s| s.name == name)
                .filter_map(|s| {
                    let label = |k: &str| s.label(k)?.parse::<f64>().ok().and_then(tokens);
                    Some(label("num_gpu_blocks")?.saturating_mul(label("block_size")?))
                })
                .fold(0u64, u64::saturating_add),
        };
        (total > 0).then_some(total)
    }
}

/// An engine polled through `/health`, `/metrics` and `/v1/models`.
pub struct MetricsEngine {
    http: BackendHttp,
    metrics: EngineMetrics,
    max_concurrency: u32,
    /// Adapter loads and evictions, seen from poll to poll.
    loads: std::sync::Mutex<lora::LoadCounter>,
}

impl MetricsEngine {
    pub fn new(http: BackendHttp, metrics: EngineMetrics, max_concurrency: u32) -> Self {
        MetricsEngine {
            http,
            metrics,
            max_concurrency,
            loads: Default::default(),
        }
    }
}

#[async_trait]
impl Backend for MetricsEngine {
    async fn poll(&self) -> BackendStatus {
        match self.http.get("/health").await {
            Ok((s, _)) if s.is_success() => {}
            Ok((StatusCode::SERVICE_UNAVAILABLE, _)) => {
                let mut st = BackendStatus::unreachable("model is loading".into());
                st.health = BackendHealth::Loading;
                return st;
            }
            Ok((s, _)) => return BackendStatus::unreachable(format!("GET /health: HTTP {s}")),
            Err(e) => return BackendStatus::unreachable(e),
        }
        let (metrics, models) =
            tokio::join!(self.http.get_ok("/metrics"), self.http.get_ok("/v1/models"));
        // Parsed once, for the load and the adapters.
        let samples = metrics.map(|b| prom::parse(&String::from_utf8_lossy(&b)));
        let load = match samples
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|s| self.metrics.read(s))
        {
            Ok(l) => l,
            Err(e) => return BackendStatus::unreachable(e),
        };
        let mut adapters = match (&models, &samples) {
            (Ok(body), Ok(samples)) => lora::report(lora::servable(body), samples),
            _ => None,
        };
        if let Some(a) = adapters.as_mut() {
            (self.loads.lock().unwrap_or_else(|e| e.into_inner())).count(a);
        }
        let models = match models.and_then(|b| parse_models(&b)) {
            Ok(m) => m,
            Err(e) => return BackendStatus::unreachable(e),
        };
        BackendStatus {
            health: BackendHealth::Ready,
            models,
            slots_total: self.max_concurrency,
            slots_busy: load.running.min(self.max_concurrency),
            requests_waiting: load.waiting,
            kv_cache_usage: load.kv_cache_usage,
            kv_capacity_tokens: load.kv_capacity_tokens,
            last_error: None,
            adapters,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prom::tests::fixture;

    impl EngineMetrics {
        /// [`EngineMetrics::read`] of a scrape's text.
        pub(crate) fn read_text(&self, text: &str) -> Result<EngineLoad, String> {
            self.read(&prom::parse(text))
        }
    }

    #[test]
    fn reads_the_vllm_fixture() {
        let load = VLLM.read_text(&fixture("vllm/metrics.txt")).unwrap();
        assert_eq!(
            load,
            EngineLoad {
                running: 3,
                waiting: 2,
                kv_cache_usage: Some(0.4375),
                kv_capacity_tokens: None,
            }
        );
        // vLLM's info gauge (its labels as vLLM writes them): 2,048 blocks
        // of 16 tokens on each of two data-parallel engines.
        let info = |engine: u32| {
            format!(
                "vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",engine=\"{engine}\",\
                 gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"2048\"}} 1.0\n"
            )
        };
        let text = format!("{}{}{}", fixture("vllm/metrics.txt"), info(0), info(1));
        assert_eq!(
            VLLM.read_text(&text).unwrap().kv_capacity_tokens,
            Some(65_536)
        );
        let odd = "vllm:num_requests_running 1\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1\n";
        assert_eq!(VLLM.read_text(odd).unwrap().kv_capacity_tokens, None);
    }

    #[test]
    fn reads_the_sglang_fixture() {
        let load = SGLANG.read_text(&fixture("sglang/metrics.txt")).unwrap();
        assert_eq!(
            load,
            EngineLoad {
                running: 3,
                waiting: 2,
                kv_cache_usage: Some(0.11),
                kv_capacity_tokens: Some(16_384),
            }
        );
    }

    #[test]
    fn older_vllm_kv_name_and_data_parallel_engines() {
        let text = "vllm:num_requests_running{engine=\"0\"} 2\n\
                    vllm:num_requests_running{engine=\"1\"} 5\n\
                    vllm:num_requests_waiting{engine=\"0\"} 1\n\
                    vllm:gpu_cache_usage_perc{engine=\"0\"} 0.2\n\
                    vllm:gpu_cache_usage_perc{engine=\"1\"} 0.9\n";
        let load = VLLM.read_text(text).unwrap();
        assert_eq!((load.running, load.waiting), (7, 1));
        assert_eq!(load.kv_cache_usage, Some(0.9));
    }

    #[test]
    fn missing_metrics_are_an_error_and_odd_values_are_tamed() {
        let err = SGLANG
            .read_text("# sglang without --enable-metrics\n")
            .unwrap_err();
        assert!(err.contains("sglang:num_running_reqs"), "{err}");
        let load = VLLM
            .read_text("vllm:num_requests_running -3\nvllm:kv_cache_usage_perc NaN\n")
            .unwrap();
        assert_eq!(load.running, 0);
        assert_eq!(load.kv_cache_usage, None);
        // The wrong engine's metrics: clearly not this one.
        assert!(VLLM.read_text(&fixture("sglang/metrics.txt")).is_err());
    }
}

/// Whatever a model server answers, reading it never panics.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// Metric lines: real names with odd labels and values, and noise.
    fn exposition() -> impl Strategy<Value = String> {
        let name = prop_oneof![
            Just("vllm:num_requests_running"),
            Just("vllm:num_requests_waiting"),
            Just("vllm:kv_cache_usage_perc"),
            Just("sglang:num_running_reqs"),
            Just("sglang:token_usage"),
            Just("llamacpp:requests_deferred"),
        ];
        let value = prop_oneof![
            any::<f64>().prop_map(|v| v.to_string()),
            Just("NaN".to_string()),
            Just("+Inf".to_string()),
            Just("-1e400".to_string()),
            "\\PC{0,8}",
        ];
        let line = prop_oneof![
            (name, "\\PC{0,20}", value).prop_map(|(n, labels, v)| format!("{n}{{{labels}}} {v}")),
            "\\PC{0,60}",
        ];
        prop::collection::vec(line, 0..12).prop_map(|lines| lines.join("\n"))
    }

    proptest! {
        #[test]
        fn engine_metrics_are_read_or_refused(text in exposition()) {
            for kind in [BackendKind::Vllm, BackendKind::Sglang] {
                let engine = EngineMetrics::for_kind(kind).unwrap();
                if let Ok(load) = engine.read_text(&text) {
                    prop_assert!(load.kv_cache_usage.is_none_or(|v| (0.0..=1.0).contains(&v)));
                }
            }
        }

        #[test]
        fn llamacpp_answers_are_parsed_or_refused(raw in prop::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(slots) = crate::llamacpp::parse_slots(&raw) {
                prop_assert!(slots.busy <= slots.total);
            }
            let _ = crate::llamacpp::parse_models(&raw);
            let _ = prom::parse(&String::from_utf8_lossy(&raw));
        }
    }
}
