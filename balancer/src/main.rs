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
    let (server, drain_first) = match assemble(cli, &settings) {
        Ok(started) => started,
        Err(e) => {
            error!("{e}");
            return ExitCode::from(1);
        }
    };
    log_start(&settings);
    server.run(pingora_core::server::RunArgs {
        shutdown_signal: Box::new(drain_first),
    });
    ExitCode::SUCCESS
}

/// What every door and service shares: the gate in front of the fleet, the
/// doors' rules and the parts the settings turn on.
struct Parts {
    shared: Arc<FleetGate>,
    rules: Arc<rules::LiveRules>,
    scale_up: Option<scaleup::ScaleUpWebhook>,
    async_queue: Option<Arc<asyncq::AsyncQueue>>,
    quotas: Arc<quotas::Quotas>,
    session_store: Option<Arc<session_store::SessionStore>>,
    traces: Option<Arc<Traces>>,
}

/// The server with every service added, and what a shutdown signal does:
/// the ports are checked, the parts opened, the doors and background
/// services built. An error is one line for the operator.
fn assemble(cli: Cli, settings: &Settings) -> Result<(Server, housekeeping::DrainFirst), String> {
    let management_listener = check_ports(settings)?;
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
    let mut parts = open_parts(settings)?;
    server.add_service(inference_service(&server, settings, &parts)?);
    add_background_services(&mut server, cli, settings, &mut parts, management_listener);
    let Parts { shared, traces, .. } = parts;
    let drain_first = housekeeping::DrainFirst {
        shared: Arc::clone(&shared),
        drain_delay: settings.drain_delay,
    };
    housekeeping::exit_when_drained(&server, shared, settings.shutdown_grace_period, traces);
    Ok((server, drain_first))
}

/// The inference and EPP ports are free, the TLS files usable; the
/// management port is bound (and handed to its service).
fn check_ports(settings: &Settings) -> Result<TcpListener, String> {
    let epp_addr = settings.epp_addr.map(|a| ("--epp-addr", a));
    for (what, addr) in [("--inference-addr", settings.inference_addr)]
        .into_iter()
        .chain(epp_addr)
    {
        check_bindable(what, addr)?;
    }
    let management_listener = TcpListener::bind(settings.management_addr).map_err(|e| {
        format!(
            "cannot listen on --management-addr {}: {e}",
            settings.management_addr
        )
    })?;
    if let Some(files) = &settings.tls {
        files.check().map_err(|e| e.to_string())?;
    }
    Ok(management_listener)
}

/// The gate and the parts the settings turn on, each opened or refused.
fn open_parts(settings: &Settings) -> Result<Parts, String> {
    let tokenizers = gate::prompt_tokens::Tokenizers::load(&settings.tokenizers)?;
    let shared = FleetGate::with_tokenizers(settings.dispatcher.clone(), tokenizers);
    let rules = rules::LiveRules::new(settings.door_rules());
    let scale_up = (settings.scale_up_webhook.as_ref())
        .map(|(url, interval)| {
            scaleup::ScaleUpWebhook::new(url.clone(), *interval, &shared.metrics)
        })
        .transpose()
        .map_err(|e| e.to_string())?;
    let async_queue = (settings.async_queue.as_ref())
        .map(|config| asyncq::AsyncQueue::open(config.clone(), Arc::clone(&shared)))
        .transpose()
        .map_err(|e| e.to_string())?;
    let quotas = quotas::Quotas::new(&settings.quota_store, &shared.metrics)
        .map(Arc::new)
        .map_err(|e| e.to_string())?;
    let session_store = (settings.session_redis_url.as_deref())
        .map(|url| {
            let idle = settings.dispatcher.scheduling.sessions.idle_timeout;
            session_store::SessionStore::new(url, idle, &shared.metrics)
        })
        .transpose()
        .map_err(|e| e.to_string())?;
    let traces = (settings.traces.as_ref())
        .map(Traces::start)
        .transpose()
        .map_err(|e| e.to_string())?
        .map(Arc::new);
    Ok(Parts {
        shared,
        rules,
        scale_up,
        async_queue,
        quotas,
        session_store,
        traces,
    })
}

/// Every door lets requests in the same way, with the same parts.
fn door(parts: &Parts) -> door::Door {
    door::Door {
        gate: Arc::clone(&parts.shared),
        rules: Arc::clone(&parts.rules),
        quotas: Arc::clone(&parts.quotas),
        session_store: parts.session_store.clone(),
    }
}

/// The inference port: the Pingora proxy behind the connection limits, on
/// its listener (TLS when configured).
fn inference_service(
    server: &Server,
    settings: &Settings,
    parts: &Parts,
) -> Result<Service<connection::Limited<pingora_proxy::HttpProxy<inference::Inference>>>, String> {
    let proxy = pingora_proxy::http_proxy(
        &server.configuration,
        inference::Inference {
            door: door(parts),
            body_limits: inference::BodyLimits {
                max_bytes: settings.max_request_bytes,
                timeout: settings.client_limits.body_timeout,
            },
            connect_timeout: settings.upstream_connect_timeout,
            retry_after: Duration::from_secs(1),
            retries: settings.retries,
            request_ids: inference::RequestIds::new(),
            async_queue: parts.async_queue.clone(),
            traces: parts.traces.clone(),
        },
    );
    let mut inference = Service::new(
        "inference".to_string(),
        connection::Limited::new(proxy, settings.client_limits, Arc::clone(&parts.shared)),
    );
    // No L4 read buffer on the plaintext inference port: Pingora reads the
    // request head into its own header buffer and bodies into the body
    // buffer anyway, so its default 64 KiB read buffer only added a copy,
    // and ~8 KiB of resident memory to every request waiting for a slot.
    // Under TLS, rustls reads records from the socket, so it keeps it.
    let listener = ListenerConfig::tcp(settings.inference_addr.to_string());
    let listener = match &settings.tls {
        None => listener.l4_buffer(L4BufferSettings::default().read(0)),
        Some(files) => listener.tls(files.settings().map_err(|e| e.to_string())?),
    };
    inference.add_listener(listener);
    Ok(inference)
}

/// The management port, housekeeping, config reloads, and, when
/// configured, the async dispatcher and EPP mode.
fn add_background_services(
    server: &mut Server,
    cli: Cli,
    settings: &Settings,
    parts: &mut Parts,
    management_listener: TcpListener,
) {
    let shared = &Arc::clone(&parts.shared);
    // Agents keep reporting while a graceful shutdown drains requests.
    server.add_service(background_service(
        "management",
        serve_until_exit::ServeUntilExit::new(
            pingora_core::apps::http_app::HttpServer::new_app(management::Management {
                shared: Arc::clone(shared),
                token: settings.management_token.clone(),
                rules: Arc::clone(&parts.rules),
            }),
            management_listener,
        ),
    ));
    server.add_service(background_service(
        "housekeeping",
        housekeeping::Housekeeping {
            shared: Arc::clone(shared),
            scale_up: parts.scale_up.take(),
        },
    ));
    server.add_service(background_service(
        "config reload",
        reload::Reload::new(
            cli,
            settings.clone(),
            Arc::clone(&parts.rules),
            Arc::clone(shared),
        ),
    ));
    if let Some(queue) = parts.async_queue.clone() {
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
            door: door(parts),
            max_request_bytes: settings.max_request_bytes,
            retry_after: Duration::from_secs(1),
            decisions: epp::decisions_metric(&shared.metrics),
        });
        let mut service = background_service("epp", EppService { epp, addr });
        service.threads = Some(settings.threads);
        server.add_service(service);
    }
}

/// One line saying what the balancer starts with.
fn log_start(settings: &Settings) {
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
}
