//! The config file's `quotas:` section, the keys file's `quota:` entries
//! and the quota store flags, resolved into the core's [`QuotaRules`] and
//! [`QuotaStore`] (README "Quotas").
//!
//! ```yaml
//! quotas:
//!   tenants:                       # by fairness id (an API key's tenant)
//!     acme: {requestsPerMinute: 600, tokensPerMinute: 100000, tokens: total, maxConcurrent: 20}
//!   defaultTenant: {tokensPerMinute: 20000}   # each tenant not listed
//!   redisUrl: redis://127.0.0.1:6379/0        # share them between balancers
//!   onRedisError: open                        # or closed
//! ```

use std::collections::BTreeMap;

use flowgate::quota::QuotaRules;
use serde::Deserialize;

use super::Cli;
pub use crate::quotas::{LimitsSpec, OnStoreError, QuotaStore};

/// `quotas:` in the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct QuotasSection {
    #[serde(default)]
    pub tenants: BTreeMap<String, LimitsSpec>,
    pub default_tenant: Option<LimitsSpec>,
    pub redis_url: Option<String>,
    pub on_redis_error: Option<OnStoreError>,
}

/// The rules and the store from the file and the flags (a flag wins).
pub fn build(cli: &Cli, file: &QuotasSection) -> Result<(QuotaRules, QuotaStore), String> {
    let mut tenants = std::collections::HashMap::new();
    for (tenant, spec) in &file.tenants {
        if !flowgate::flow::valid_fairness_id(tenant) {
            return Err(format!(
                "quotas.tenants: {tenant:?} is not a valid fairness id (1-128 visible ASCII \
                 characters)"
            ));
        }
        tenants.insert(
            tenant.clone(),
            spec.resolve(&format!("quotas.tenants.{tenant}"))?,
        );
    }
    let default_tenant = file
        .default_tenant
        .as_ref()
        .map(|s| s.resolve("quotas.defaultTenant"))
        .transpose()?;
    let redis_url = cli.quota_redis_url.clone().or(file.redis_url.clone());
    if let Some(url) = &redis_url {
        if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
            return Err(format!(
                "quota Redis URL {url:?} (--quota-redis-url, quotas.redisUrl) must start with \
                 redis:// or rediss://"
            ));
        }
    }
    let store = QuotaStore {
        redis_url,
        on_error: cli
            .quota_on_redis_error
            .or(file.on_redis_error)
            .unwrap_or_default(),
    };
    Ok((
        QuotaRules {
            tenants,
            default_tenant,
        },
        store,
    ))
}
