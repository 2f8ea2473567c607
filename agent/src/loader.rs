//! Loading LoRA adapters on the server when a balancer asks
//! (`--lora-adapter NAME=PATH`, vLLM only).
//!
//! Each report lists the configured adapters the server does not serve
//! now as `loadable`. A balancer whose requests wait for one that no
//! server serves asks the agent of the server it prefers for it (the
//! `load_adapters` of its answer, repeated at every report until the
//! server lists the adapter); the agent then calls vLLM's
//! `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` (vLLM needs
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`) once, however many balancers
//! ask and however often: not again while that load runs, nor for
//! [`SETTLE`] after it succeeded (the next polls show the adapter
//! servable), nor for [`FAILED_FOR`] after it failed. A failure is logged
//! and reported (`load_failed`, with the engine's word) for
//! [`FAILED_FOR`], and the balancers refuse requests for an adapter that
//! failed everywhere it could load, rather than have the agent retry it
//! in a loop.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flowgate::protocol::{
    valid_model_name, AdapterReport, LoadFailure, MAX_LOAD_ERROR_LEN, MAX_LOAD_FAILURES,
};
use serde_json::json;
use tracing::{info, warn};

use crate::http::BackendHttp;

/// How long a failed load is reported, and not tried again.
pub const FAILED_FOR: Duration = Duration::from_secs(60);
/// How long a load that succeeded is not asked again (the polls since
/// show the adapter servable).
pub const SETTLE: Duration = Duration::from_secs(10);
/// The longest one load may take (a large adapter from a slow disk).
const LOAD_TIMEOUT: Duration = Duration::from_secs(300);
/// Most adapters one balancer's answer may ask for that are heeded.
const MAX_ASKED: usize = 16;
/// Most adapters an agent may be given (`--lora-adapter`): a report
/// lists them all.
pub const MAX_LOADABLE: usize = flowgate::protocol::MAX_ADAPTERS_PER_REPORT;

#[derive(Debug)]
enum Load {
    Running,
    Done(Instant),
    Failed(Instant, String),
}

/// The adapters the agent may load, and what became of each load.
pub struct AdapterLoader {
    http: BackendHttp,
    paths: BTreeMap<String, String>,
    loads: Mutex<HashMap<String, Load>>,
}

/// `NAME=PATH` of `--lora-adapter`.
pub fn parse_adapter(s: &str) -> Result<(String, String), String> {
    let (name, path) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=PATH"))?;
    let (name, path) = (name.trim(), path.trim());
    if !valid_model_name(name) {
        return Err(format!("{name:?}: an adapter name is 1 to 256 bytes"));
    }
    if path.is_empty() {
        return Err(format!("{name}: the adapter's path is empty"));
    }
    Ok((name.to_string(), path.to_string()))
}

impl AdapterLoader {
    pub fn new(http: BackendHttp, adapters: Vec<(String, String)>) -> Arc<Self> {
        Arc::new(AdapterLoader {
            http,
            paths: adapters.into_iter().collect(),
            loads: Mutex::new(HashMap::new()),
        })
    }

    fn loads(&self) -> std::sync::MutexGuard<'_, HashMap<String, Load>> {
        self.loads.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds to a report's `adapters` the configured adapters the server
    /// does not serve (`loadable`) and the loads that failed lately.
    pub fn annotate(&self, adapters: &mut Option<AdapterReport>, now: Instant) {
        let report = adapters.get_or_insert_with(AdapterReport::default);
        let mut loads = self.loads();
        loads.retain(|_, l| match l {
            Load::Running => true,
            Load::Done(at) => now.duration_since(*at) < SETTLE,
            Load::Failed(at, _) => now.duration_since(*at) < FAILED_FOR,
        });
        report.loadable = (self.paths.keys())
            .filter(|n| !report.servable.contains(n))
            .cloned()
            .collect();
        report.load_failed = (loads.iter())
            .filter_map(|(name, l)| match l {
                Load::Failed(_, error) => Some(LoadFailure {
                    name: name.clone(),
                    error: error.clone(),
                }),
                _ => None,
            })
            .take(MAX_LOAD_FAILURES)
            .collect();
        crate::lora::fit(report);
    }

    /// A balancer asked for `names`: each configured one not loading, not
    /// loaded lately and not failed lately is loaded, in the background.
    pub fn ask(self: &Arc<Self>, names: &[String]) {
        let now = Instant::now();
        for name in names.iter().take(MAX_ASKED) {
            let Some(path) = self.paths.get(name) else {
                continue;
            };
            {
                let mut loads = self.loads();
                let busy = match loads.get(name) {
                    None => false,
                    Some(Load::Running) => true,
                    Some(Load::Done(at)) => now.duration_since(*at) < SETTLE,
                    Some(Load::Failed(at, _)) => now.duration_since(*at) < FAILED_FOR,
                };
                if busy {
                    continue;
                }
                loads.insert(name.clone(), Load::Running);
            }
            let (me, name, path) = (Arc::clone(self), name.clone(), path.clone());
            tokio::spawn(async move {
                let outcome = me.load(&name, &path).await;
                let now = Instant::now();
                let load = match outcome {
                    Ok(()) => {
                        info!(adapter = name, "LoRA adapter loaded");
                        Load::Done(now)
                    }
                    Err(e) => {
                        warn!(adapter = name, "loading the LoRA adapter failed: {e}");
                        Load::Failed(now, truncated(e))
                    }
                };
                me.loads().insert(name, load);
            });
        }
    }

    async fn load(&self, name: &str, path: &str) -> Result<(), String> {
        let body = json!({"lora_name": name, "lora_path": path});
        let (status, answer) = (self.http)
            .post_json("/v1/load_lora_adapter", &body, LOAD_TIMEOUT)
            .await?;
        let answer = String::from_utf8_lossy(&answer);
        // vLLM answers 400 to an adapter it has already: that is loaded.
        if status.is_success() || answer.contains("already been loaded") {
            Ok(())
        } else {
            Err(format!(
                "POST /v1/load_lora_adapter: HTTP {status}: {}",
                answer.trim()
            ))
        }
    }
}

/// An error cut to what a report carries, on a character boundary.
fn truncated(mut e: String) -> String {
    if e.len() > MAX_LOAD_ERROR_LEN {
        let mut end = MAX_LOAD_ERROR_LEN;
        while !e.is_char_boundary(end) {
            end -= 1;
        }
        e.truncate(end);
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_are_name_equals_path() {
        assert_eq!(
            parse_adapter(" sql = /models/sql-lora ").unwrap(),
            ("sql".to_string(), "/models/sql-lora".to_string())
        );
        assert!(parse_adapter("sql").is_err());
        assert!(parse_adapter("=/p").is_err());
        assert!(parse_adapter("sql=").is_err());
        assert!(parse_adapter(&format!("{}=/p", "x".repeat(257))).is_err());
    }

    #[test]
    fn errors_are_cut_on_a_character_boundary() {
        let e = truncated("é".repeat(MAX_LOAD_ERROR_LEN));
        assert!(e.len() <= MAX_LOAD_ERROR_LEN && e.chars().all(|c| c == 'é'));
    }

    #[tokio::test]
    async fn the_report_lists_what_it_may_load_and_what_failed() {
        let http = BackendHttp::new(reqwest::Client::new(), "http://127.0.0.1:9".into(), None);
        let loader = AdapterLoader::new(
            http,
            vec![("a".into(), "/a".into()), ("b".into(), "/b".into())],
        );
        let mut adapters = Some(AdapterReport {
            servable: vec!["a".into()],
            ..AdapterReport::default()
        });
        let now = Instant::now();
        loader.annotate(&mut adapters, now);
        assert_eq!(adapters.as_ref().unwrap().loadable, ["b"]);
        loader
            .loads()
            .insert("b".into(), Load::Failed(now, "HTTP 404".into()));
        loader.annotate(&mut adapters, now);
        let failed = &adapters.as_ref().unwrap().load_failed;
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].name, "b");
        // Not asked again while it counts as failed; reported no more after.
        loader.ask(&["b".into()]);
        assert!(matches!(loader.loads().get("b"), Some(Load::Failed(..))));
        loader.annotate(&mut adapters, now + FAILED_FOR);
        assert!(adapters.as_ref().unwrap().load_failed.is_empty());
        // An engine that says nothing of adapters still gets a report.
        let mut none = None;
        loader.annotate(&mut none, now);
        assert_eq!(none.unwrap().loadable, ["a", "b"]);
        // As many as allowed, of the longest names: the report still fits.
        let http = BackendHttp::new(reqwest::Client::new(), "http://127.0.0.1:9".into(), None);
        let many = (0..MAX_LOADABLE)
            .map(|i| (format!("{i:0>256}"), "/p".to_string()))
            .collect();
        let loader = AdapterLoader::new(http, many);
        let mut adapters = None;
        loader.annotate(&mut adapters, now);
        let a = adapters.unwrap();
        assert!(a.name_bytes() <= flowgate::protocol::MAX_ADAPTER_NAME_BYTES);
        assert!(!a.loadable.is_empty());
    }
}
