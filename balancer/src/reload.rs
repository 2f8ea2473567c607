//! Hot reload: on SIGHUP the balancer reads its config file again (the
//! command-line flags it started with still beat the file) and applies what
//! can change while it runs — API keys, objectives and model priorities,
//! model names, aliases and fallbacks ([`crate::rules`]), band and buffer
//! limits, TTLs, saturation thresholds and scheduling weights
//! ([`flowgate::Dispatcher::reconfigure`]) — without dropping a request,
//! queued or in flight. A file that does not load keeps the running config
//! and logs why (the parser names the line); a setting that only a restart
//! can change (listen addresses, threads, TLS, the async path, ...) is
//! named in a warning and keeps its running value. Every attempt counts in
//! `flowgate_config_reloads_total{result}`.

use std::sync::Arc;

use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use prometheus::{IntCounterVec, Opts};
use tokio::signal::unix::{signal, SignalKind};
use tracing::{error, info, warn};

use crate::config::{Cli, Settings};
use crate::gate::FleetGate;
use crate::rules::LiveRules;

pub struct Reload {
    cli: Cli,
    /// The settings the process runs with (what a restart would change).
    running: Settings,
    rules: Arc<LiveRules>,
    shared: Arc<FleetGate>,
    reloads: IntCounterVec,
}

impl Reload {
    pub fn new(cli: Cli, running: Settings, rules: Arc<LiveRules>, shared: Arc<FleetGate>) -> Self {
        let reloads = IntCounterVec::new(
            Opts::new(
                "flowgate_config_reloads_total",
                "Config reloads (SIGHUP), by result: ok, or error (the running config stayed)",
            ),
            &["result"],
        )
        .expect("valid metric definition");
        shared.metrics.register(Box::new(reloads.clone()));
        for result in ["ok", "error"] {
            reloads.with_label_values(&[result]);
        }
        Reload {
            cli,
            running,
            rules,
            shared,
            reloads,
        }
    }

    /// Reads the config again and applies it, or keeps the running one.
    pub fn reload(&self) -> Result<(), String> {
        let new = match Settings::from_cli(self.cli.clone()) {
            Ok(s) => s,
            Err(e) => {
                self.reloads.with_label_values(&["error"]).inc();
                error!("config reload failed, the running config stays: {e}");
                return Err(e.to_string());
            }
        };
        for setting in needs_restart(&self.running, &new) {
            warn!(
                setting,
                "config reload: this setting changed but takes effect only after a restart; \
                 it keeps its running value"
            );
        }
        self.rules.set(new.door_rules());
        self.shared.reconfigure(new.dispatcher);
        self.reloads.with_label_values(&["ok"]).inc();
        info!(
            api_keys = new.api_keys.as_ref().map_or(0, |k| k.len()),
            "config reloaded"
        );
        Ok(())
    }
}

/// The settings that differ between `a` and `b` but cannot change while
/// the balancer runs.
fn needs_restart(a: &Settings, b: &Settings) -> Vec<&'static str> {
    let differ =
        |x: &dyn std::fmt::Debug, y: &dyn std::fmt::Debug| format!("{x:?}") != format!("{y:?}");
    [
        (
            "inferenceAddr",
            differ(&a.inference_addr, &b.inference_addr),
        ),
        (
            "managementAddr",
            differ(&a.management_addr, &b.management_addr),
        ),
        ("eppAddr", differ(&a.epp_addr, &b.epp_addr)),
        ("threads", differ(&a.threads, &b.threads)),
        (
            "maxRequestBytes",
            differ(&a.max_request_bytes, &b.max_request_bytes),
        ),
        ("retries", differ(&a.retries, &b.retries)),
        (
            "shutdownGracePeriod",
            differ(&a.shutdown_grace_period, &b.shutdown_grace_period),
        ),
        (
            "upstreamConnectTimeout",
            differ(&a.upstream_connect_timeout, &b.upstream_connect_timeout),
        ),
        (
            "upstreamIdleConnections",
            differ(&a.upstream_idle_connections, &b.upstream_idle_connections),
        ),
        (
            "client limits (maxConnections, timeouts, maxHeaderBytes)",
            differ(&a.client_limits, &b.client_limits),
        ),
        ("tlsCert / tlsKey", differ(&a.tls, &b.tls)),
        ("traces", differ(&a.traces, &b.traces)),
        ("drainDelay", differ(&a.drain_delay, &b.drain_delay)),
        ("async", differ(&a.async_queue, &b.async_queue)),
        (
            "quotas.redisUrl / onRedisError",
            differ(&a.quota_store, &b.quota_store),
        ),
        (
            "scaleUpWebhook",
            differ(&a.scale_up_webhook, &b.scale_up_webhook),
        ),
        (
            "logLevel / logFormat",
            differ(&(&a.log_level, a.log_format), &(&b.log_level, b.log_format)),
        ),
        (
            "managementToken",
            differ(&a.management_token, &b.management_token),
        ),
        (
            "models.tokenizers / --tokenizer",
            differ(&a.tokenizers, &b.tokenizers),
        ),
    ]
    .into_iter()
    .filter_map(|(name, changed)| changed.then_some(name))
    .collect()
}

#[async_trait::async_trait]
impl BackgroundService for Reload {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut hangups = match signal(SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                error!("cannot listen for SIGHUP, config reload is off: {e}");
                return;
            }
        };
        loop {
            tokio::select! {
                Some(()) = hangups.recv() => {
                    let _ = self.reload();
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}
