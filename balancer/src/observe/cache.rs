//! Cache truth as `/metrics` shows it, per endpoint and model: the prompt
//! tokens its engine's answers counted and the cached ones (rate them and
//! divide for the hit ratio the engine saw), the ratio since the endpoint
//! registered, and how often the balancer's expected hits came true
//! ([`flowgate::endpoint::CacheTruth`]). Refreshed from the snapshot at
//! scrape time like the other endpoint series, so a departed endpoint
//! leaves none behind; the counters restart when an endpoint re-registers.

use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use super::family::{endpoint_labels, register};
use flowgate::EndpointSnapshot;

pub struct CacheMetrics {
    prompt_tokens: IntCounterVec,
    cached_tokens: IntCounterVec,
    hit_ratio: GaugeVec,
    predictions: IntCounterVec,
    prefix_capacity: IntGaugeVec,
}

impl CacheMetrics {
    pub fn new(registry: &Registry) -> Self {
        let labels = &["endpoint", "agent", "model"];
        CacheMetrics {
            prompt_tokens: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_endpoint_prompt_tokens_total",
                        "Prompt tokens of the answers whose engine said what it reused, per \
                         endpoint",
                    ),
                    labels,
                ),
            ),
            cached_tokens: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_endpoint_cached_tokens_total",
                        "Of those, tokens the engine found in its prefix cache (usage \
                         cached_tokens, llama.cpp timings.cache_n)",
                    ),
                    labels,
                ),
            ),
            hit_ratio: register(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_cache_hit_ratio",
                        "Cached / prompt tokens per endpoint since it registered, as its \
                         engine counted them",
                    ),
                    labels,
                ),
            ),
            predictions: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_endpoint_cache_predictions_total",
                        "Requests sent expecting a prefix-cache hit, by whether the engine \
                         had at least half the expected blocks (hit) or not (miss)",
                    ),
                    &["endpoint", "agent", "model", "outcome"],
                ),
            ),
            prefix_capacity: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_prefix_capacity_blocks",
                        "Prompt blocks the endpoint's prefix index may hold now: \
                         capacityBlocks, less what its engine showed it does not keep",
                    ),
                    &["endpoint", "agent"],
                ),
            ),
        }
    }

    /// Resets every series and sets those of the endpoints known now.
    pub fn refresh(&self, endpoints: &[EndpointSnapshot]) {
        self.prompt_tokens.reset();
        self.cached_tokens.reset();
        self.hit_ratio.reset();
        self.predictions.reset();
        self.prefix_capacity.reset();
        for e in endpoints {
            let (endpoint, agent, model) = endpoint_labels(e);
            let labels = [endpoint.as_str(), agent, model];
            self.prefix_capacity
                .with_label_values(&[&endpoint, agent])
                .set(i64::try_from(e.prefix_capacity).unwrap_or(i64::MAX));
            let c = &e.cache;
            if c.prompt_tokens == 0 && c.predicted_hits + c.predicted_misses == 0 {
                continue;
            }
            self.prompt_tokens
                .with_label_values(&labels)
                .inc_by(c.prompt_tokens);
            self.cached_tokens
                .with_label_values(&labels)
                .inc_by(c.cached_tokens);
            if let Some(ratio) = c.hit_ratio() {
                self.hit_ratio.with_label_values(&labels).set(ratio);
            }
            for (outcome, n) in [("hit", c.predicted_hits), ("miss", c.predicted_misses)] {
                self.predictions
                    .with_label_values(&[&endpoint, agent, model, outcome])
                    .inc_by(n);
            }
        }
    }
}
