//! `balancer`: Flowgate's reverse proxy. See the README for flags and routes.

mod asyncq;
mod auth;
mod config;
mod connection;
mod door;
mod epp;
#[cfg(test)]
mod fuzz_tests;
mod gate;
mod housekeeping;
mod inference;
mod management;
mod observe;
mod quotas;
mod reload;
mod reply;
mod rules;
mod scaleup;
mod serve_until_exit;
mod session_store;
mod tls;

use std::net::{SocketAddr, TcpListener};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use pingora_core::listeners::{L4BufferSettings, ListenerConfig};
use pingora_core::server::configuration::{Opt, ServerConf};
use pingora_core::server::Server;
use pingora_core::services::background::background_service;
use pingora_core::services::listening::Service;
use tracing::{error, info};

use crate::config::{Cli, Settings};
use crate::gate::FleetGate;
use crate::observe::traces::Traces;

/// mimalloc: a request's many small allocations (headers, its context,
/// Pingora's per-request futures) cost about a third of glibc's here.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Pingora reports a busy port only deep in its start-up; check first so the
/// operator gets one clear line.
fn check_bindable(what: &str, addr: SocketAddr) -> Result<(), String> {
    TcpListener::bind(addr)
        .map(drop)
        .map_err(|e| format!("cannot listen on {what} {addr}: {e}"))
}

/// EPP mode's gRPC server, run by Pingora beside the proxy.
struct EppService {
    epp: Arc<epp::Epp>,
    addr: std::net::SocketAddr,
}

#[async_trait::async_trait]
impl pingora_core::services::background::BackgroundService for EppService {
    async fn start(&self, mut shutdown: pingora_core::server::ShutdownWatch) {
        let stop = async move {
            let _ = shutdown.changed().await;
        };
        if let Err(e) = epp::serve(Arc::clone(&self.epp), self.addr, stop).await {
            // The port was checked at start-up; losing it later is fatal.
            error!(addr = %self.addr, "EPP server failed: {e}");
            std::process::exit(1);
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match Settings::from_cli(cli.clone()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("balancer: {e}");
            return ExitCode::from(2);
        }
    };
    flowgate_logging::init("balancer", &settings.log_level, settings.log_format);
    let epp_addr = settings.epp_addr.map(|a| ("--epp-addr", a));
    for (what, addr) in [("--inference-addr", settings.inference_addr)]
        .into_iter()
        .chain(epp_addr)
    {
        if let Err(e) = check_bindable(what, addr) {
            error!("{e}");
            return ExitCode::from(1);
        }
    }
    let management_listener = match TcpListener::bind(settings.management_addr) {
        Ok(l) => l,
        Err(e) => {
            error!(
                "cannot listen on --management-addr {}: {e}",
                settings.management_addr
            );
            return ExitCode::from(1);
        }
    };

    if let Some(files) = &settings.tls {
        if let Err(e) = files.check() {
            error!("{e}");
            return ExitCode::from(1);
        }
    }

    let conf = ServerConf {
        threads: settings.threads,
        grace_period_seconds: Some(settings.shutdown_grace_period.as_secs()),
        graceful_shutdown_timeout_seconds: Some(1),
        // Pingora keeps one pool of threads × this (a global LRU).
        upstream_keepalive_pool_size: settings
            .upstream_idle_connections
            .div_ceil(settings.threads),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(Opt::default(), conf);
    server.bootstrap();

    let shared = FleetGate::new(settings.dispatcher.clone());
    let rules = rules::LiveRules::new(settings.door_rules());
    let scale_up = match &settings.scale_up_webhook {
        Some((url, interval)) => {
            match scaleup::ScaleUpWebhook::new(url.clone(), *interval, &shared.metrics) {
                Ok(hook) => Some(hook),
                Err(e) => {
                    error!("{e}");
                    return ExitCode::from(1);
                }
            }
        }
        None => None,
    };

    let async_queue = match &settings.async_queue {
        Some(config) => match asyncq::AsyncQueue::open(config.clone(), Arc::clone(&shared)) {
            Ok(q) => Some(q),
            Err(e) => {
                error!("{e}");
                return ExitCode::from(1);
            }
        },
        None => None,
    };

    let quotas = match quotas::Quotas::new(&settings.quota_store, &shared.metrics) {
        Ok(q) => Arc::new(q),
        Err(e) => {
            error!("{e}");
            return ExitCode::from(1);
        }
    };

    let session_store = match settings.session_redis_url.as_deref().map(|url| {
        let idle = settings.dispatcher.scheduling.sessions.idle_timeout;
        session_store::SessionStore::new(url, idle, &shared.metrics)
    }) {
        None => None,
        Some(Ok(store)) => Some(store),
        Some(Err(e)) => {
            error!("{e}");
            return ExitCode::from(1);
        }
    };

    let traces = match settings.traces.as_ref().map(Traces::start).transpose() {
        Ok(t) => t.map(Arc::new),
        Err(e) => {
            error!("{e}");
            return ExitCode::from(1);
        }
    };

    // Every door lets requests in the same way, with the same parts.
    let door = || door::Door {
        gate: Arc::clone(&shared),
        rules: Arc::clone(&rules),
        quotas: Arc::clone(&quotas),
        session_store: session_store.clone(),
    };
    let proxy = pingora_proxy::http_proxy(
        &server.configuration,
        inference::Inference {
            door: door(),
            body_limits: inference::BodyLimits {
                max_bytes: settings.max_request_bytes,
                timeout: settings.client_limits.body_timeout,
            },
            connect_timeout: settings.upstream_connect_timeout,
            retry_after: Duration::from_secs(1),
            retries: settings.retries,
            request_ids: inference::RequestIds::new(),
            async_queue: async_queue.clone(),
            traces: traces.clone(),
        },
    );
    let mut inference = Service::new(
        "inference".to_string(),
        connection::Limited::new(proxy, settings.client_limits, Arc::clone(&shared)),
    );
    // No L4 read buffer on the plaintext inference port: Pingora reads the
    // request head into its own header buffer and bodies into the body
    // buffer anyway, so its default 64 KiB read buffer only added a copy,
    // and ~8 KiB of resident memory to every request waiting for a slot.
    // Under TLS, rustls reads records from the socket, so it keeps it.
    let listener = ListenerConfig::tcp(settings.inference_addr.to_string());
    let listener = match &settings.tls {
        None => listener.l4_buffer(L4BufferSettings::default().read(0)),
        Some(files) => match files.settings() {
            Ok(tls) => listener.tls(tls),
            Err(e) => {
                error!("{e}");
                return ExitCode::from(1);
            }
        },
    };
    inference.add_listener(listener);

    // Agents keep reporting while a graceful shutdown drains requests.
    let management = background_service(
        "management",
        serve_until_exit::ServeUntilExit::new(
            pingora_core::apps::http_app::HttpServer::new_app(management::Management {
                shared: Arc::clone(&shared),
                token: settings.management_token.clone(),
                rules: Arc::clone(&rules),
            }),
            management_listener,
        ),
    );

    let housekeeping = background_service(
        "housekeeping",
        housekeeping::Housekeeping {
            shared: Arc::clone(&shared),
            scale_up,
        },
    );

    server.add_service(inference);
    server.add_service(management);
    server.add_service(housekeeping);
    server.add_service(background_service(
        "config reload",
        reload::Reload::new(
            cli,
            settings.clone(),
            Arc::clone(&rules),
            Arc::clone(&shared),
        ),
    ));
    if let Some(queue) = async_queue {
        server.add_service(background_service(
            "async dispatcher",
            asyncq::AsyncDispatcher {
                queue,
                inference: settings.inference_addr,
            },
        ));
    }
    if let Some(addr) = settings.epp_addr {
        let epp = Arc::new(epp::Epp {
            door: door(),
            max_request_bytes: settings.max_request_bytes,
            retry_after: Duration::from_secs(1),
            decisions: epp::decisions_metric(&shared.metrics),
        });
        let mut service = background_service("epp", EppService { epp, addr });
        service.threads = Some(settings.threads);
        server.add_service(service);
    }

    let shared_for_signals = Arc::clone(&shared);
    housekeeping::exit_when_drained(&server, shared, settings.shutdown_grace_period, traces);
    info!(
        inference = %settings.inference_addr,
        management = %settings.management_addr,
        max_buffered_requests = settings.dispatcher.flow.max_requests,
        max_buffered_bytes = settings.dispatcher.flow.max_bytes,
        default_request_ttl_ms = settings.dispatcher.default_ttl.as_millis() as u64,
        priority_bands = settings.dispatcher.flow.bands.len(),
        max_request_bytes = settings.max_request_bytes,
        max_connections = settings.client_limits.max_connections,
        tls = settings.tls.is_some(),
        epp = settings.epp_addr.map(|a| a.to_string()).unwrap_or_default(),
        api_keys = settings.api_keys.as_ref().map_or(0, |k| k.len()),
        "flowgate balancer starting"
    );
    let drain_first = housekeeping::DrainFirst {
        shared: Arc::clone(&shared_for_signals),
        drain_delay: settings.drain_delay,
    };
    server.run(pingora_core::server::RunArgs {
        shutdown_signal: Box::new(drain_first),
    });
    ExitCode::SUCCESS
}
