//! What each tenant spent, as Prometheus counters: tokens by kind and
//! answered requests per tenant. Tenants are named by clients (the fairness
//! header) as well as by API keys, so the label set is bounded: the first
//! [`MAX_TENANT_LABELS`] tenants seen get their own series, any later one
//! is counted as [`flowgate::usage::OTHER`]. `GET /api/v1/usage` has
//! the full picture by window.

use std::collections::HashSet;
use std::sync::Mutex;

use prometheus::{IntCounterVec, Opts, Registry};

use super::metrics::register;
use flowgate::tokens::TokenUsage;

/// Tenants with series of their own.
pub const MAX_TENANT_LABELS: usize = 256;

pub struct TenantMetrics {
    tokens: IntCounterVec,
    requests: IntCounterVec,
    labelled: Mutex<HashSet<String>>,
}

impl TenantMetrics {
    pub fn new(registry: &Registry) -> Self {
        TenantMetrics {
            tokens: register(
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
            ),
            requests: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_tenant_requests_total",
                        "Answered inference requests per tenant (tenants beyond the first 256: \
                         (other))",
                    ),
                    &["tenant"],
                ),
            ),
            labelled: Mutex::new(HashSet::new()),
        }
    }

    /// Counts one answered request of `tenant` that used `usage`.
    pub fn record(&self, tenant: &str, usage: &TokenUsage) {
        let label = {
            let mut labelled = self
                .labelled
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if labelled.contains(tenant) || labelled.len() < MAX_TENANT_LABELS {
                labelled.insert(tenant.to_string());
                tenant
            } else {
                flowgate::usage::OTHER
            }
        };
        self.requests.with_label_values(&[label]).inc();
        for (kind, n) in [
            ("prompt", usage.prompt),
            ("completion", usage.completion),
            ("cached", usage.cached),
        ] {
            self.tokens.with_label_values(&[label, kind]).inc_by(n);
        }
    }
}
