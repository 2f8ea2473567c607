//! LoRA adapters, as vLLM tells them:
//! - `/v1/models` lists each adapter it can serve beside its base model,
//!   with the base as its `parent`;
//! - `vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters,
//!   max_lora}` (comma-separated names) says which have requests running
//!   and waiting; vLLM writes a new series at each change, its value the
//!   time it was written, so the newest series is the one to read.
//!
//! Not read (yet): vLLM's `vllm:lora_adapter_loaded` (which adapters are
//! loaded with nothing running), llama.cpp's `GET /lora-adapters`, SGLang.

use flowgate::protocol::{AdapterReport, MAX_ADAPTERS_PER_REPORT, MAX_MODEL_NAME_LEN};
use serde::Deserialize;

use crate::prom::Sample;

#[derive(Debug, Deserialize)]
struct Models {
    data: Vec<Entry>,
}

#[derive(Debug, Deserialize)]
struct Entry {
    id: String,
    #[serde(default)]
    parent: Option<String>,
}

/// The adapters a `/v1/models` body lists (entries with a `parent`).
pub fn servable(models: &[u8]) -> Vec<String> {
    let Ok(m) = serde_json::from_slice::<Models>(models) else {
        return Vec::new();
    };
    bounded(
        m.data
            .into_iter()
            .filter(|e| e.parent.is_some())
            .map(|e| e.id),
    )
}

/// What the engine says of its adapters, `None` when it serves none and
/// its metrics say nothing of them.
pub fn report(servable: Vec<String>, samples: &[Sample]) -> Option<AdapterReport> {
    let newest = samples
        .iter()
        .filter(|s| s.name == "vllm:lora_requests_info")
        .max_by(|a, b| a.value.total_cmp(&b.value));
    if servable.is_empty() && newest.is_none() {
        return None;
    }
    let label = |k: &str| {
        newest.and_then(|s| {
            s.labels
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
        })
    };
    let names = |k: &str| {
        bounded(
            label(k)
                .unwrap_or("")
                .split(',')
                .map(str::trim)
                .map(str::to_string),
        )
    };
    Some(AdapterReport {
        servable,
        running: names("running_lora_adapters"),
        waiting: names("waiting_lora_adapters"),
        max_loaded: label("max_lora").and_then(|v| v.parse().ok()),
    })
}

/// Names a report may carry: non-empty, not too long, not too many.
fn bounded(names: impl Iterator<Item = String>) -> Vec<String> {
    names
        .filter(|n| !n.is_empty() && n.len() <= MAX_MODEL_NAME_LEN)
        .take(MAX_ADAPTERS_PER_REPORT)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prom;

    #[test]
    fn adapters_are_read_from_the_models_and_the_newest_info_series() {
        let models = br#"{"object":"list","data":[
            {"id":"base","object":"model","parent":null},
            {"id":"sql-lora","object":"model","root":"/a/sql","parent":"base"},
            {"id":"chat-lora","object":"model","parent":"base"}]}"#;
        let servable = servable(models);
        assert_eq!(servable, ["sql-lora", "chat-lora"]);
        let metrics = "# TYPE vllm:lora_requests_info gauge\n\
            vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"} 1.7e9\n\
            vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"sql-lora,chat-lora\",waiting_lora_adapters=\"x\"} 1.8e9\n";
        let r = report(servable, &prom::parse(metrics)).unwrap();
        assert_eq!(r.running, ["sql-lora", "chat-lora"]);
        assert_eq!(r.waiting, ["x"]);
        assert_eq!(r.max_loaded, Some(4));
        // No adapter and no series: nothing to say.
        assert_eq!(report(Vec::new(), &[]), None);
        // Not a model list, or huge lists: no panic, bounded.
        assert!(self::servable(b"garbage").is_empty());
        let many = format!(
            "{{\"data\":[{}]}}",
            (0..5000)
                .map(|i| format!("{{\"id\":\"a{i}\",\"parent\":\"b\"}}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        assert_eq!(
            self::servable(many.as_bytes()).len(),
            MAX_ADAPTERS_PER_REPORT
        );
    }
}
