//! LoRA adapters, as vLLM tells them:
//! - `/v1/models` lists each adapter it can serve beside its base model,
//!   with the base as its `parent`;
//! - `vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters,
//!   max_lora}` (comma-separated names) says which have requests running
//!   and waiting; vLLM writes a new series at each change, its value the
//!   time it was written, so the newest series is the one to read.
//!
//! - `vllm:lora_adapter_loaded{adapter_name, level, pinned}` (newer vLLM):
//!   one series per loaded adapter, running or idle; those at
//!   `level="gpu"` are reported as loaded (`"cpu"` ones still cost a copy
//!   to the GPU).
//!
//! llama.cpp loads its adapters at start (`--lora`) and applies them per
//! request by id and scale (`"lora": [{"id", "scale"}]` in the body), not
//! by a request's `model`: `GET /lora-adapters` is reported as adapters
//! all loaded, none servable by name (the operator sees them; placement
//! does not change). SGLang: adapters its `/v1/models` lists with a
//! `parent`, as vLLM's; it publishes no adapter metrics.

use flowgate::protocol::{
    valid_model_name, AdapterReport, MAX_ADAPTERS_PER_REPORT, MAX_ADAPTER_NAME_BYTES,
};
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
    let residency: Vec<&Sample> = (samples.iter())
        .filter(|s| s.name == "vllm:lora_adapter_loaded")
        .collect();
    if servable.is_empty() && newest.is_none() && residency.is_empty() {
        return None;
    }
    let loaded = (!residency.is_empty()).then(|| {
        bounded(
            residency
                .iter()
                .filter(|s| s.value > 0.0 && s.label("level").is_none_or(|l| l == "gpu"))
                .filter_map(|s| s.label("adapter_name").map(str::to_string)),
        )
    });
    let label = |k: &str| newest.and_then(|s| s.label(k));
    let names = |k: &str| {
        bounded(
            label(k)
                .unwrap_or("")
                .split(',')
                .map(str::trim)
                .map(str::to_string),
        )
    };
    let mut report = AdapterReport {
        servable,
        running: names("running_lora_adapters"),
        waiting: names("waiting_lora_adapters"),
        loaded,
        max_loaded: label("max_lora").and_then(|v| v.parse().ok()),
        ..AdapterReport::default()
    };
    fit(&mut report);
    Some(report)
}

#[derive(Debug, Deserialize)]
struct LlamaAdapter {
    #[serde(default)]
    id: u64,
    #[serde(default)]
    path: String,
}

/// What llama.cpp's `GET /lora-adapters` says (`[{"id", "path",
/// "scale"}]`): each adapter loaded, named by its file's stem (else
/// `lora-{id}`), none servable by name (module docs); `None` for none.
pub fn llamacpp_adapters(body: &[u8]) -> Option<AdapterReport> {
    let list: Vec<LlamaAdapter> = serde_json::from_slice(body).ok()?;
    if list.is_empty() {
        return None;
    }
    let names = bounded(list.iter().map(|a| {
        std::path::Path::new(&a.path)
            .file_stem()
            .and_then(|s| s.to_str())
            .filter(|s| !s.is_empty())
            .map_or_else(|| format!("lora-{}", a.id), str::to_string)
    }));
    let mut report = AdapterReport {
        max_loaded: u32::try_from(names.len()).ok(),
        loaded: Some(names),
        ..AdapterReport::default()
    };
    fit(&mut report);
    Some(report)
}

/// Counts the adapters that come into and leave an engine's `loaded`
/// list from one poll to the next: loads and evictions as the engine
/// does not count them. One poll may miss an adapter loaded and evicted
/// between two: a floor, not an exact count.
#[derive(Debug, Default)]
pub struct LoadCounter {
    previous: Option<std::collections::BTreeSet<String>>,
    /// Polls made before the first list (vLLM writes no
    /// `vllm:lora_adapter_loaded` series while none is loaded).
    polled: bool,
    loads: u64,
    evictions: u64,
}

impl LoadCounter {
    /// Counts what changed since the last report and says the totals in
    /// this one (nothing when it does not say what is loaded).
    pub fn count(&mut self, report: &mut AdapterReport) {
        let now: std::collections::BTreeSet<String> = match &report.loaded {
            Some(loaded) => loaded.iter().cloned().collect(),
            // Once it said, no list is an empty one.
            None if self.previous.is_some() => Default::default(),
            // Not said yet: none loaded, or an engine that never says.
            None => {
                self.polled = true;
                return;
            }
        };
        match &self.previous {
            Some(before) => {
                self.loads += now.difference(before).count() as u64;
                self.evictions += before.difference(&now).count() as u64;
            }
            // Loaded since polls that saw none.
            None if self.polled => self.loads += now.len() as u64,
            // What the first poll finds was loaded before the agent came.
            None => {}
        }
        self.polled = true;
        self.previous = Some(now);
        report.loads = Some(self.loads);
        report.evictions = Some(self.evictions);
    }
}

/// Drops names until the report's fit [`MAX_ADAPTER_NAME_BYTES`] (a report
/// beyond is refused whole, and the server goes unused): the loadable ones
/// first, then the servable ones, from the end (the engine's few loaded,
/// running and waiting adapters say more), then loaded, waiting, running.
pub fn fit(report: &mut AdapterReport) {
    let mut over = report.name_bytes().saturating_sub(MAX_ADAPTER_NAME_BYTES);
    let mut drop_from = |names: &mut Vec<String>| {
        while over > 0 {
            let Some(n) = names.pop() else { return };
            over = over.saturating_sub(n.len());
        }
    };
    drop_from(&mut report.loadable);
    drop_from(&mut report.servable);
    if let Some(loaded) = report.loaded.as_mut() {
        drop_from(loaded);
    }
    drop_from(&mut report.waiting);
    drop_from(&mut report.running);
}

/// Names a report may carry: non-empty, not too long, not too many.
fn bounded(names: impl Iterator<Item = String>) -> Vec<String> {
    names
        .filter(|n| valid_model_name(n))
        .take(MAX_ADAPTERS_PER_REPORT)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prom;

    /// One poll whose engine said `loaded` (`None`: said nothing): the
    /// counter's totals in its report.
    fn poll_with(counter: &mut LoadCounter, loaded: Option<&[&str]>) -> (Option<u64>, Option<u64>) {
        let mut r = AdapterReport {
            loaded: loaded.map(|l| l.iter().map(|s| s.to_string()).collect()),
            ..AdapterReport::default()
        };
        counter.count(&mut r);
        (r.loads, r.evictions)
    }

    #[test]
    fn loads_and_evictions_are_counted_from_poll_to_poll() {
        let mut counter = LoadCounter::default();
        assert_eq!(
            poll_with(&mut counter, Some(&["a", "b"])),
            (Some(0), Some(0)),
            "there before"
        );
        assert_eq!(
            poll_with(&mut counter, Some(&["a", "c"])),
            (Some(1), Some(1))
        );
        assert_eq!(
            poll_with(&mut counter, Some(&["a", "c"])),
            (Some(1), Some(1))
        );
        assert_eq!(
            poll_with(&mut counter, Some(&["d", "e", "f"])),
            (Some(4), Some(3))
        );
        assert_eq!(
            poll_with(&mut counter, None),
            (Some(4), Some(6)),
            "none loaded now"
        );
        // vLLM writes no series while none is loaded: the first list after
        // polls without one is loads.
        let mut counter = LoadCounter::default();
        assert_eq!(poll_with(&mut counter, None), (None, None), "not said");
        assert_eq!(poll_with(&mut counter, Some(&["a"])), (Some(1), Some(0)));
    }

    #[test]
    fn llamacpp_adapters_are_all_loaded_and_named_by_file() {
        let r = llamacpp_adapters(
            br#"[{"id":0,"path":"adapters/sql-lora.gguf","scale":0.0},{"id":1,"path":"","scale":1.0}]"#,
        )
        .unwrap();
        assert_eq!(r.loaded, Some(vec!["sql-lora".into(), "lora-1".into()]));
        assert_eq!(r.max_loaded, Some(2));
        assert!(r.servable.is_empty(), "not by name");
        assert_eq!(llamacpp_adapters(b"[]"), None);
        assert_eq!(llamacpp_adapters(b"<html>not found</html>"), None);
    }

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
        assert_eq!(r.loaded, None, "no residency series: not said");
        let residency = "vllm:lora_adapter_loaded{adapter_name=\"sql-lora\",level=\"gpu\",pinned=\"false\"} 1\n\
            vllm:lora_adapter_loaded{adapter_name=\"old-lora\",level=\"cpu\",pinned=\"false\"} 1\n";
        let r = report(Vec::new(), &prom::parse(residency)).unwrap();
        assert_eq!(r.loaded, Some(vec!["sql-lora".to_string()]));
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
        // Long names: the servable ones are cut to what a report carries,
        // the running one kept.
        let long: Vec<String> = (0..1000).map(|i| format!("{i:0>200}")).collect();
        let running = "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"hot\"} 1\n";
        let r = report(long, &prom::parse(running)).unwrap();
        assert!(r.name_bytes() <= MAX_ADAPTER_NAME_BYTES);
        assert!(r.servable.len() >= MAX_ADAPTER_NAME_BYTES / 200 - 1);
        assert_eq!(r.running, ["hot"]);
    }
}
