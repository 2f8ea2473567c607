//! What each tenant spent, as Prometheus counters: tokens by kind and
//! answered requests per tenant. Tenants are named by clients (the fairness
//! header) as well as by API keys, so the label set is bounded: the first
//! [`MAX_TENANT_LABELS`] tenants seen get their own series, any later one
//! is counted as [`flowgate::usage::OTHER`]. `GET /api/v1/usage` has
//! the full picture by window.

// Bounded (MAX_TENANT_LABELS): a fast hasher, looked up per answer.
use foldhash::HashMap;
use std::sync::{Mutex, OnceLock};

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

use super::family::register;
use flowgate::tokens::TokenUsage;

/// Tenants with series of their own.
pub const MAX_TENANT_LABELS: usize = 256;

pub struct TenantMetrics {
    tokens: IntCounterVec,
    requests: IntCounterVec,
    /// The series of each labelled tenant, looked up once per answer
    /// instead of four label look-ups.
    labelled: Mutex<HashMap<String, TenantSeries>>,
    /// The series of the tenants beyond the bound (made when first needed,
    /// so that it is exported only once there are such tenants).
    other: OnceLock<TenantSeries>,
}

/// One tenant's series.
struct TenantSeries {
    requests: IntCounter,
    prompt: IntCounter,
    completion: IntCounter,
    cached: IntCounter,
}

impl TenantSeries {
    fn of(tokens: &IntCounterVec, requests: &IntCounterVec, label: &str) -> Self {
        TenantSeries {
            requests: requests.with_label_values(&[label]),
            prompt: tokens.with_label_values(&[label, "prompt"]),
            completion: tokens.with_label_values(&[label, "completion"]),
            cached: tokens.with_label_values(&[label, "cached"]),
        }
    }

    fn record(&self, usage: &TokenUsage) {
        self.requests.inc();
        self.prompt.inc_by(usage.prompt);
        self.completion.inc_by(usage.completion);
        self.cached.inc_by(usage.cached);
    }
}

impl TenantMetrics {
    pub fn new(registry: &Registry) -> Self {
        let tokens = register(
            registry,
            IntCounterVec::new(
                Opts::new(
                    "flowgate_tenant_tokens_total",
                    "Tokens the answers of a tenant's requests used, by kind (prompt, \
                     completion, cached: of the prompt, found in the engine's cache); \
                     tenants beyond the first 256 are counted as (other)",
                ),
                &["tenant", "kind"],
            ),
        );
        let requests = register(
            registry,
            IntCounterVec::new(
                Opts::new(
                    "flowgate_tenant_requests_total",
                    "Answered inference requests per tenant (tenants beyond the first 256: \
                     (other))",
                ),
                &["tenant"],
            ),
        );
        TenantMetrics {
            other: OnceLock::new(),
            tokens,
            requests,
            labelled: Mutex::new(HashMap::default()),
        }
    }

    /// Counts one answered request of `tenant` that used `usage`.
    pub fn record(&self, tenant: &str, usage: &TokenUsage) {
        let mut labelled = self
            .labelled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(series) = labelled.get(tenant) {
            series.record(usage);
        } else if labelled.len() < MAX_TENANT_LABELS {
            let series = TenantSeries::of(&self.tokens, &self.requests, tenant);
            series.record(usage);
            labelled.insert(tenant.to_string(), series);
        } else {
            let other = flowgate::usage::OTHER;
            (self
                .other
                .get_or_init(|| TenantSeries::of(&self.tokens, &self.requests, other)))
            .record(usage);
        }
    }
}
