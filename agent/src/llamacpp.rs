//! llama.cpp `llama-server` adapter.
//!
//! Reads `/health` (503 while the model loads), `/slots` (one entry per slot
//! with `is_processing`), `/metrics` (`llamacpp:requests_deferred`, needs
//! `--metrics`) and `/v1/models`. Without `/slots` (server started with
//! `--no-slots`) the slot count comes from `/props` `total_slots` and the
//! busy count from `llamacpp:requests_processing`. The KV capacity in
//! tokens is the context of every slot (`n_ctx` of each `/slots` entry, or
//! `/props` `default_generation_settings.n_ctx` × `total_slots`). Its LoRA
//! adapters from `/lora-adapters` ([`crate::lora::llamacpp_adapters`]).

use async_trait::async_trait;
use flowgate::BackendHealth;
use reqwest::StatusCode;
use serde::Deserialize;

use crate::backend::{Backend, BackendStatus};
use crate::http::BackendHttp;
use crate::prom;

pub struct LlamaCpp {
    http: BackendHttp,
}

#[derive(Debug, Deserialize)]
struct Slot {
    #[serde(default)]
    is_processing: bool,
    #[serde(default)]
    n_ctx: u64,
}

#[derive(Debug, Deserialize)]
struct Props {
    total_slots: u32,
    #[serde(default)]
    default_generation_settings: Option<SlotSettings>,
}

#[derive(Debug, Deserialize)]
struct SlotSettings {
    #[serde(default)]
    n_ctx: u64,
}

/// Slots of a llama-server: (total, busy, KV capacity in tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slots {
    pub total: u32,
    pub busy: u32,
    pub kv_capacity_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct Models {
    data: Vec<ModelEntry>,
}

#[derive(Debug, Deserialize)]
struct ModelEntry {
    id: String,
}

/// Counts slots from a `/slots` body; the capacity is their contexts' sum.
pub fn parse_slots(body: &[u8]) -> Result<Slots, String> {
    let slots: Vec<Slot> =
        serde_json::from_slice(body).map_err(|e| format!("/slots is not a slot list: {e}"))?;
    let total = u32::try_from(slots.len()).map_err(|_| "too many slots".to_string())?;
    let busy = slots.iter().filter(|s| s.is_processing).count() as u32;
    let context: u64 = slots.iter().map(|s| s.n_ctx).fold(0, u64::saturating_add);
    Ok(Slots {
        total,
        busy,
        kv_capacity_tokens: (context > 0).then_some(context),
    })
}

/// Model ids from a `/v1/models` body.
pub fn parse_models(body: &[u8]) -> Result<Vec<String>, String> {
    let m: Models =
        serde_json::from_slice(body).map_err(|e| format!("/v1/models is not a model list: {e}"))?;
    Ok(m.data.into_iter().map(|e| e.id).collect())
}

/// Reads a gauge that must be a small non-negative count.
fn count(samples: &[prom::Sample], name: &str) -> Option<u32> {
    prom::first(samples, name).map(prom::to_count)
}

impl LlamaCpp {
    pub fn new(http: BackendHttp) -> Self {
        LlamaCpp { http }
    }

    async fn slots(&self, metrics: &[prom::Sample]) -> Result<Slots, String> {
        match self.http.get("/slots").await? {
            (s, body) if s.is_success() => parse_slots(&body),
            // `--no-slots`: fall back to /props and the metrics.
            (StatusCode::NOT_IMPLEMENTED, _) => {
                let body = self.http.get_ok("/props").await?;
                let props: Props = serde_json::from_slice(&body)
                    .map_err(|e| format!("/props has no total_slots: {e}"))?;
                let busy = count(metrics, "llamacpp:requests_processing").unwrap_or(0);
                let per_slot = props.default_generation_settings.map_or(0, |s| s.n_ctx);
                let context = per_slot.saturating_mul(u64::from(props.total_slots));
                Ok(Slots {
                    total: props.total_slots,
                    busy: busy.min(props.total_slots),
                    kv_capacity_tokens: (context > 0).then_some(context),
                })
            }
            (s, _) => Err(format!("GET /slots: HTTP {s}")),
        }
    }
}

#[async_trait]
impl Backend for LlamaCpp {
    async fn poll(&self) -> BackendStatus {
        let health = match self.http.get("/health").await {
            Ok((s, _)) if s.is_success() => BackendHealth::Ready,
            Ok((StatusCode::SERVICE_UNAVAILABLE, _)) => BackendHealth::Loading,
            Ok((s, _)) => return BackendStatus::unreachable(format!("GET /health: HTTP {s}")),
            Err(e) => return BackendStatus::unreachable(e),
        };
        if health == BackendHealth::Loading {
            let mut st = BackendStatus::unreachable("model is loading".into());
            st.health = BackendHealth::Loading;
            return st;
        }
        let (metrics, models, adapters) = tokio::join!(
            self.http.get("/metrics"),
            self.http.get_ok("/v1/models"),
            self.http.get_ok("/lora-adapters")
        );
        // Metrics are optional (`--metrics`); without them nothing waits.
        let samples = match metrics {
            Ok((s, body)) if s.is_success() => prom::parse(&String::from_utf8_lossy(&body)),
            _ => Vec::new(),
        };
        let slots = match self.slots(&samples).await {
            Ok(v) => v,
            Err(e) => return BackendStatus::unreachable(e),
        };
        let models = match models.and_then(|b| parse_models(&b)) {
            Ok(m) => m,
            Err(e) => return BackendStatus::unreachable(e),
        };
        BackendStatus {
            health,
            models,
            slots_total: slots.total,
            slots_busy: slots.busy,
            requests_waiting: count(&samples, "llamacpp:requests_deferred").unwrap_or(0),
            kv_cache_usage: None,
            kv_capacity_tokens: slots.kv_capacity_tokens,
            last_error: None,
            // Older servers answer 404: no adapters said.
            adapters: adapters
                .ok()
                .and_then(|b| crate::lora::llamacpp_adapters(&b)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prom::tests::fixture;

    #[test]
    fn slots_from_the_fixtures() {
        let slots = |total, busy, kv_capacity_tokens| {
            Ok(Slots {
                total,
                busy,
                kv_capacity_tokens,
            })
        };
        // Four slots of 1,024 tokens of context each.
        assert_eq!(
            parse_slots(fixture("llamacpp/slots_idle.txt").as_bytes()),
            slots(4, 0, Some(4096))
        );
        assert_eq!(
            parse_slots(fixture("llamacpp/slots_busy.txt").as_bytes()),
            slots(4, 4, Some(4096))
        );
        assert_eq!(
            parse_slots(br#"[{"id":0,"is_processing":true},{"id":1,"is_processing":false}]"#),
            slots(2, 1, None),
            "no n_ctx: no capacity"
        );
        assert!(parse_slots(br#"{"error":1}"#).is_err());
    }

    #[test]
    fn props_give_slots_and_context_without_slots() {
        let props: Props = serde_json::from_str(&fixture("llamacpp/props.txt")).unwrap();
        assert_eq!(props.total_slots, 4);
        assert_eq!(props.default_generation_settings.unwrap().n_ctx, 1024);
    }

    #[test]
    fn models_from_the_fixture() {
        let m = parse_models(fixture("llamacpp/v1_models.txt").as_bytes()).unwrap();
        assert_eq!(m, ["models/SmolLM2-135M-Instruct.Q4_1.gguf"]);
    }

    #[test]
    fn deferred_requests_from_the_metrics_fixture() {
        let s = prom::parse(&fixture("llamacpp/metrics_busy.txt"));
        assert_eq!(count(&s, "llamacpp:requests_deferred"), Some(3));
        assert_eq!(count(&[], "llamacpp:requests_deferred"), None);
    }
}
