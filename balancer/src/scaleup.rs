//! The scale-up webhook (`--scale-up-webhook URL`): when requests wait for
//! a model that no live endpoint serves (no server registered, or all of
//! them draining, stale or failing), the balancer POSTs
//!
//! ```json
//! {"event":"scale_up","model":"smollm2","queued_requests":3}
//! ```
//!
//! (`model` is `null` for requests that name none) so an autoscaler can
//! start a server. Debounced per model: at most one call per interval
//! (`--scale-up-webhook-interval`, default 30 s) while the demand lasts. A
//! failed call is logged, counted, and made again at the next interval.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use tracing::{info, warn};

use crate::observe::metrics::Metrics;

/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

type Model = Option<Arc<str>>;

pub struct ScaleUpWebhook {
    url: String,
    interval: Duration,
    client: reqwest::Client,
    /// When each model's last call was made.
    last: Mutex<HashMap<Model, Instant>>,
    /// `flowgate_scale_up_webhooks_total`, by result.
    calls: prometheus::IntCounterVec,
}

impl ScaleUpWebhook {
    /// A webhook at `url` called at most every `interval` per model; its
    /// calls are counted in `metrics`.
    pub fn new(url: String, interval: Duration, metrics: &Metrics) -> Result<Self, String> {
        let calls = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "flowgate_scale_up_webhooks_total",
                "Scale-up webhook calls by result (ok, failed)",
            ),
            &["result"],
        )
        .expect("valid metric");
        metrics.register(Box::new(calls.clone()));
        let client = reqwest::Client::builder()
            .timeout(CALL_TIMEOUT)
            .build()
            .map_err(|e| format!("scale-up webhook client: {e}"))?;
        Ok(ScaleUpWebhook {
            url,
            interval,
            client,
            last: Mutex::new(HashMap::new()),
            calls,
        })
    }

    /// The models to call about now, given the unserved demand, and
    /// records the calls as made.
    fn due(&self, demand: &[(Model, usize)], now: Instant) -> Vec<(Model, usize)> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        // Forget models with no demand left, so the map stays small; their
        // next burst still waits out the interval from the last call.
        last.retain(|m, at| {
            demand.iter().any(|(d, _)| d == m) || now.duration_since(*at) < self.interval
        });
        let mut out = Vec::new();
        for (model, n) in demand.iter().filter(|(_, n)| *n > 0) {
            let due = last
                .get(model)
                .is_none_or(|at| now.duration_since(*at) >= self.interval);
            if due {
                last.insert(model.clone(), now);
                out.push((model.clone(), *n));
            }
        }
        out
    }

    /// Calls the webhook for every model that is due, in the background.
    pub fn notify(&self, demand: &[(Model, usize)]) {
        for (model, queued) in self.due(demand, Instant::now()) {
            let body = json!({
                "event": "scale_up",
                "model": model.as_deref(),
                "queued_requests": queued,
            });
            let request = self.client.post(&self.url).json(&body);
            let calls = self.calls.clone();
            let url = self.url.clone();
            tokio::spawn(async move {
                let model = model.as_deref().unwrap_or("");
                let failure = match request.send().await {
                    Ok(r) if r.status().is_success() => None,
                    Ok(r) => Some(format!("answered HTTP {}", r.status().as_u16())),
                    Err(e) => Some(e.to_string()),
                };
                let result = if failure.is_none() { "ok" } else { "failed" };
                calls.with_label_values(&[result]).inc();
                match failure {
                    None => info!(model, queued, "scale-up webhook called"),
                    Some(why) => warn!(model, url, "scale-up webhook failed: {why}"),
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_debounced_per_model() {
        let hook = ScaleUpWebhook::new(
            "http://127.0.0.1:9/".into(),
            Duration::from_secs(30),
            &Metrics::new(),
        )
        .unwrap();
        let m1: Model = Some("m1".into());
        let m2: Model = Some("m2".into());
        let t0 = Instant::now();
        assert_eq!(hook.due(&[(m1.clone(), 2)], t0), [(m1.clone(), 2)]);
        // Within the interval: only the new model is due.
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!(
            hook.due(&[(m1.clone(), 5), (m2.clone(), 1)], t1),
            [(m2.clone(), 1)]
        );
        // Demand gone and back within the interval: still quiet.
        assert!(hook.due(&[], t1).is_empty());
        assert!(hook.due(&[(m1.clone(), 1)], t1).is_empty());
        // After the interval, it is called again.
        let t2 = t0 + Duration::from_secs(30);
        assert_eq!(hook.due(&[(m1.clone(), 1)], t2), [(m1, 1)]);
        assert!(hook.due(&[(None, 0)], t2).is_empty());
    }
}
