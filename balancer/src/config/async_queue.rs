//! The async path's settings: `--async-*` flags over the file's `async:`
//! section over defaults.

use std::time::Duration;

use super::cli::Cli;
use super::file::AsyncSection;
use super::flow::ConfigDuration;
use super::{layer, SettingsError};
use crate::asyncq::job::QueueConfig;
use crate::asyncq::{AsyncConfig, CapacityUnit, Gate, PromQuery};

/// The async path's settings: flags over the file's `async:` section over
/// defaults; `None` when neither a directory nor a queue URL is given.
pub(super) fn async_settings(
    cli: &Cli,
    file: AsyncSection,
    max_payload_bytes: usize,
) -> Result<Option<AsyncConfig>, SettingsError> {
    let invalid = |m: String| Err(SettingsError::Invalid(m));
    let (dir, redis_url) = match (
        cli.async_dir.clone().or(file.dir),
        cli.queue_url.clone().or(file.queue_url),
    ) {
        (None, None) => return Ok(None),
        (dir, url) => (dir.unwrap_or_default(), url),
    };
    if redis_url
        .as_ref()
        .is_some_and(|u| !(u.starts_with("redis://") || u.starts_with("unix://")))
    {
        return invalid("queue_url must be a redis:// (or unix://) URL".into());
    }
    let gate = layer(cli.async_gate, file.gate, Gate::Balancer);
    let url = cli.async_prometheus_url.clone().or(file.prometheus_url);
    let query = cli.async_promql.clone().or(file.promql);
    let prometheus = match (gate, url, query) {
        (Gate::Prometheus, Some(url), Some(query)) => {
            if !url.starts_with("http://") {
                return invalid(format!(
                    "async prometheus_url {url:?} must be an http:// URL"
                ));
            }
            Some(PromQuery { url, query })
        }
        (Gate::Prometheus, _, _) => {
            return invalid(
                "the prometheus async gate needs a Prometheus URL and a PromQL query \
                 (--async-prometheus-url, --async-promql)"
                    .into(),
            )
        }
        _ => None,
    };
    let unit = layer(
        cli.async_capacity_unit,
        file.capacity_unit,
        CapacityUnit::Requests,
    );
    let max_sys = cli.async_max_sys.or(file.max_sys);
    if unit != CapacityUnit::Requests && max_sys.is_none() {
        return invalid(
            "an async capacity in tokens or bytes needs max_sys (--async-max-sys) in that unit"
                .into(),
        );
    }
    let d = QueueConfig::default();
    let duration = |flag: Option<Duration>, key: Option<ConfigDuration>, default: Duration| {
        layer(flag, key.map(|d| d.0), default)
    };
    Ok(Some(AsyncConfig {
        dir,
        redis_url,
        queue: QueueConfig {
            max_length: layer(cli.async_max_length, file.max_length, d.max_length),
            max_payload_bytes,
            max_delivery: layer(cli.async_max_delivery, file.max_delivery, d.max_delivery),
            max_idle: duration(cli.async_max_idle, file.max_idle, d.max_idle),
            dead_letter: layer(cli.async_dead_letter, file.dead_letter, d.dead_letter),
            retention: duration(cli.async_retention, file.retention, d.retention),
            file_retention: duration(
                cli.async_file_retention,
                file.file_retention,
                d.file_retention,
            ),
            auto_evict: cli.async_auto_evict || file.auto_evict.unwrap_or(false),
            max_results: layer(cli.async_max_results, file.max_results, d.max_results),
        },
        gate,
        gate_interval: duration(
            cli.async_gate_interval,
            file.gate_interval,
            match gate {
                Gate::Prometheus => Duration::from_secs(2),
                _ => Duration::from_secs(1),
            },
        ),
        prometheus,
        max_sys,
        unit,
        baseline: layer(cli.async_baseline, file.baseline, 0.0),
        priority: layer(cli.async_priority, file.priority, -1000),
    }))
}
