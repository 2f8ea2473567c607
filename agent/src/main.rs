//! `agent`: watches one model server and reports its capacity to the
//! balancer every monitoring interval. See the README for flags.

mod backend;
mod balancers;
mod engines;
mod http;
mod kv_events;
mod llamacpp;
mod loader;
mod lora;
mod prom;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use flowgate::protocol::{
    valid_model_name, MAX_MODELS_PER_REPORT, MAX_MODEL_NAME_LEN, MAX_MONITORING_INTERVAL,
    MIN_MONITORING_INTERVAL,
};
use flowgate::{AgentReport, BackendKind, PROTOCOL_VERSION};
use flowgate_logging::LogFormat;
use reqwest::Client;
use tracing::{error, info, warn};

use crate::backend::Backend;
use crate::balancers::Balancers;
use crate::engines::EngineMetrics;
use crate::http::BackendHttp;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendArg {
    /// llama.cpp's llama-server (needs `--metrics` for the deferred count)
    Llamacpp,
    /// vLLM's OpenAI server (needs `--max-concurrency`)
    Vllm,
    /// SGLang started with `--enable-metrics` (needs `--max-concurrency`)
    Sglang,
}

impl BackendArg {
    fn kind(self) -> BackendKind {
        match self {
            BackendArg::Llamacpp => BackendKind::Llamacpp,
            BackendArg::Vllm => BackendKind::Vllm,
            BackendArg::Sglang => BackendKind::Sglang,
        }
    }
}

/// Flowgate agent: polls one model server (health, slots, queue, models) and
/// reports it to the balancer's management API.
#[derive(Debug, Parser)]
#[command(name = "agent", version, about, long_about = None)]
struct Cli {
    /// Kind of model server
    #[arg(long, value_enum, default_value = "llamacpp")]
    backend: BackendArg,

    /// Requests the server runs at once: vLLM's `--max-num-seqs`, SGLang's
    /// `--max-running-requests` (required for them: neither exposes it).
    /// With llama.cpp it caps the slot count the server reports
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_concurrency: Option<u32>,

    /// Address the agent polls: `host:port` or `http://host:port`
    #[arg(long, value_name = "ADDR")]
    backend_addr: String,

    /// `ip:port` the balancer should send inference traffic to
    /// [default: --backend-addr, resolved]
    #[arg(long, value_name = "IP:PORT")]
    external_addr: Option<SocketAddr>,

    /// A balancer's management address: `host:port` or `http://host:port`.
    /// Repeatable, or a comma-separated list: the agent reports to every
    /// one. A name that resolves to several addresses (a Kubernetes
    /// headless Service) is one balancer per address, resolved again every
    /// 5 s. A slow or dead balancer never delays the reports to the others
    #[arg(
        long,
        value_name = "ADDR",
        default_value = "127.0.0.1:8060",
        num_args = 1
    )]
    management_addr: Vec<String>,

    /// Name shown in the balancer's agent list [default: the backend address]
    #[arg(long)]
    name: Option<String>,

    /// Another model name this server answers to (repeatable): reported
    /// beside the models the server lists, so requests naming it are sent
    /// here. llama-server answers any name; its own `--alias` is already
    /// what it lists. Up to 64 names of at most 256 bytes
    #[arg(long = "model-alias", value_name = "NAME", value_parser = parse_alias)]
    model_aliases: Vec<String>,

    /// A LoRA adapter the agent may have the server load when a balancer
    /// asks for it (its requests wait and no server serves it): NAME as
    /// requests give it in `model`, PATH as the server reads it.
    /// Repeatable, or comma-separated. vLLM only, started with
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; each load is tried once, a
    /// failure reported to the balancers for a minute
    #[arg(long = "lora-adapter", value_name = "NAME=PATH", value_delimiter = ',',
        value_parser = loader::parse_adapter)]
    lora_adapters: Vec<(String, String)>,

    /// Divide the server's slots between the balancers this agent reports
    /// to, each told its share in its reports, so that together they never
    /// send the server more than its slots. `false`: every balancer fills
    /// every slot it sees free, and two may fill the same one between two
    /// reports (the server queues the extra request)
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    share_slots: bool,

    /// How often to poll and report: `100ms`, `1s`, or milliseconds. The
    /// balancer treats an endpoint as saturated once its metrics are older
    /// than its staleness threshold (200 ms, or two intervals if longer) and
    /// drops the agent after 3 missed reports. Allowed: 50ms..=60s
    #[arg(long, value_name = "DURATION", default_value = "100ms", value_parser = parse_interval)]
    monitoring_interval: Duration,

    /// The balancer's management token (its `--management-token`), sent as
    /// `Authorization: Bearer` with every report. Prefer the environment
    /// variable: flags are visible in `ps`
    #[arg(
        long,
        value_name = "TOKEN",
        env = "FLOWGATE_MANAGEMENT_TOKEN",
        hide_env_values = true
    )]
    management_token: Option<String>,

    /// API key sent to the model server as `Authorization: Bearer`
    #[arg(long, env = "FLOWGATE_BACKEND_API_KEY", hide_env_values = true)]
    backend_api_key: Option<String>,

    /// Follow the engine's KV-cache events (vLLM `--kv-events-config` with
    /// `"publisher": "zmq"`, SGLang `--kv-events-config`): the address of
    /// its ZeroMQ PUB socket, `host:port` or `tcp://host:port` (rank 0;
    /// rank r publishes on the port plus r). The agent keeps the blocks the
    /// engine holds and sends them to every balancer, which then routes on
    /// what the engine really caches. vLLM and SGLang only
    #[arg(long, value_name = "ADDR", value_parser = parse_zmq_addr)]
    kv_events: Option<(String, u16)>,

    /// The engine's event replay socket (vLLM's `replay_endpoint`), rank 0,
    /// to fill a gap in the events; without one a gap drops the engine's
    /// blocks until they rebuild
    #[arg(long, value_name = "ADDR", value_parser = parse_zmq_addr, requires = "kv_events")]
    kv_events_replay: Option<(String, u16)>,

    /// The events' topic to subscribe to (vLLM's `topic`; empty: all)
    #[arg(long, value_name = "TOPIC", default_value = "", requires = "kv_events")]
    kv_events_topic: String,

    /// Data-parallel ranks of the engine, each publishing on its own port
    /// (the port plus its rank)
    #[arg(long, value_name = "N", default_value_t = 1, requires = "kv_events",
        value_parser = clap::value_parser!(u16).range(1..=64))]
    kv_events_ranks: u16,

    /// Blocks the agent keeps per rank, least recently stored forgotten
    /// first: about 110 bytes each (1,000,000 blocks: 111 MB)
    #[arg(long, value_name = "BLOCKS", default_value_t = 1_000_000, requires = "kv_events",
        value_parser = clap::value_parser!(u64).range(1..=4_000_000))]
    kv_events_capacity: u64,

    /// Log filter (error, warn, info, debug, trace or a tracing directive);
    /// env RUST_LOG wins
    #[arg(long, default_value = "info")]
    log_level: String,

    /// Log line format
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,

    /// On SIGTERM or Ctrl-C the agent marks its server draining (the
    /// balancer sends it no new work), waits until the balancer has no
    /// request in flight to it, then deregisters and exits. This is the
    /// longest it waits: `30s`, `2m`, or milliseconds. A second signal exits
    /// at once
    #[arg(long, value_name = "DURATION", default_value = "30s",
        value_parser = flowgate::duration::parse_duration)]
    drain_timeout: Duration,
}

/// Longest model alias (the balancer's limit on a reported model name).
const MAX_ALIAS_BYTES: usize = 256;
/// Most aliases (the balancer takes at most 128 models per report).
const MAX_ALIASES: usize = 64;

fn parse_alias(s: &str) -> Result<String, String> {
    let name = s.trim();
    if name.is_empty() || name.len() > MAX_ALIAS_BYTES {
        return Err(format!("a model alias is 1 to {MAX_ALIAS_BYTES} bytes"));
    }
    Ok(name.to_string())
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = flowgate::duration::parse_duration(s)?;
    if !(MIN_MONITORING_INTERVAL..=MAX_MONITORING_INTERVAL).contains(&d) {
        return Err(format!("{} is outside 50ms..=60s", s.trim()));
    }
    Ok(d)
}

/// `host:port` or `tcp://host:port` → (host, port): where the agent
/// connects to an engine's ZeroMQ socket.
fn parse_zmq_addr(s: &str) -> Result<(String, u16), String> {
    let hostport = s.trim().strip_prefix("tcp://").unwrap_or(s.trim());
    let (host, port) = hostport
        .rsplit_once(':')
        .ok_or_else(|| format!("{s:?} is not host:port or tcp://host:port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host == "*" || host.contains('/') {
        return Err(format!(
            "{s:?}: name the engine's host (not *) to connect to"
        ));
    }
    let port: u16 = port
        .parse()
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| format!("{s:?}: the port is 1..=65535"))?;
    Ok((host.to_string(), port))
}

/// `host:port` or `http://host:port[/]` → `http://host:port`.
fn base_url(addr: &str) -> Result<String, String> {
    let trimmed = addr.trim().trim_end_matches('/');
    if trimmed.starts_with("https://") {
        return Err(format!("{addr}: https is not supported yet; use http"));
    }
    let hostport = trimmed.strip_prefix("http://").unwrap_or(trimmed);
    if hostport.is_empty() || hostport.contains('/') || !hostport.contains(':') {
        return Err(format!("{addr:?} is not host:port or http://host:port"));
    }
    Ok(format!("http://{hostport}"))
}

async fn resolve(base: &str) -> Result<SocketAddr, String> {
    let hostport = base.trim_start_matches("http://");
    tokio::net::lookup_host(hostport)
        .await
        .map_err(|e| format!("cannot resolve {hostport}: {e}"))?
        .next()
        .ok_or_else(|| format!("{hostport} resolves to no address"))
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Whether a long model list was cut already (said once).
static MODELS_DROPPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// What one poll of the engine tells the balancer (slots capped at
/// `--max-concurrency`, busy never above total).
fn report_of(
    cli: &Cli,
    agent_id: &str,
    name: &str,
    external_addr: std::net::SocketAddr,
    mut status: backend::BackendStatus,
    draining: bool,
) -> AgentReport {
    if let Some(cap) = cli.max_concurrency {
        status.slots_total = status.slots_total.min(cap);
    }
    // The engine's list may be long (vLLM lists every LoRA adapter), and a
    // report naming more models than the balancer takes would be refused
    // whole, the server unused: the engine's first names are kept (the
    // first is the one a request naming none is served as), room is left
    // for the aliases, and the rest is dropped, said once.
    let listed = status.models.len();
    let room = MAX_MODELS_PER_REPORT.saturating_sub(cli.model_aliases.len());
    let mut models: Vec<String> = (status.models.into_iter())
        .filter(|m| valid_model_name(m))
        .take(room)
        .collect();
    if models.len() < listed && !MODELS_DROPPED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        warn!(
            listed,
            reported = models.len(),
            "the server lists more models than a report carries (or names that are empty or over \
             {MAX_MODEL_NAME_LEN} bytes): the rest are not reported"
        );
    }
    for alias in &cli.model_aliases {
        if !models.contains(alias) {
            models.push(alias.clone());
        }
    }
    status.models = models;
    AgentReport {
        protocol_version: PROTOCOL_VERSION,
        agent_id: agent_id.to_string(),
        name: name.to_string(),
        backend: cli.backend.kind(),
        external_addr: external_addr.to_string(),
        models: status.models,
        health: status.health,
        slots_total: status.slots_total,
        slots_busy: status.slots_busy.min(status.slots_total),
        requests_waiting: status.requests_waiting,
        kv_cache_usage: status.kv_cache_usage,
        kv_capacity_tokens: status
            .kv_capacity_tokens
            .map(|c| c.clamp(1, flowgate::protocol::MAX_KV_CAPACITY_TOKENS)),
        monitoring_interval_ms: cli.monitoring_interval.as_millis() as u64,
        draining,
        last_error: status.last_error,
        slot_share: None,
        balancers: None,
        read_began_ms_ago: None,
        read_ended_ms_ago: None,
        adapters: status.adapters,
        kv_events: None,
    }
}

/// Logs a problem once when it appears, and once when it clears.
fn log_problem_change(problem: Option<&str>, report: &AgentReport) {
    match problem {
        Some(p) => warn!("{p}"),
        None => info!(
            slots = report.slots_total,
            busy = report.slots_busy,
            "reporting to the balancer"
        ),
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    let backend_base = base_url(&cli.backend_addr)?;
    let balancer_names = balancers::names(&cli.management_addr)?;
    let external_addr = match cli.external_addr {
        Some(a) => a,
        None => resolve(&backend_base).await?,
    };
    let poll_timeout = cli.monitoring_interval.max(Duration::from_secs(2));
    let client = Client::builder()
        .timeout(poll_timeout)
        .connect_timeout(Duration::from_secs(1))
        .build()
        .map_err(|e| format!("http client: {e}"))?;
    let http = BackendHttp::new(
        client.clone(),
        backend_base.clone(),
        cli.backend_api_key.clone(),
    );
    let loader = (!cli.lora_adapters.is_empty())
        .then(|| loader::AdapterLoader::new(http.clone(), cli.lora_adapters.clone()));
    let backend: Box<dyn Backend> = match EngineMetrics::for_kind(cli.backend.kind()) {
        None => Box::new(llamacpp::LlamaCpp::new(http)),
        Some(metrics) => {
            // main() refused to start these engines without it.
            let n = cli.max_concurrency.unwrap_or(1);
            Box::new(engines::MetricsEngine::new(http, metrics, n))
        }
    };
    let agent_id = format!("agent-{}", uuid::Uuid::new_v4().simple());
    let name = cli.name.clone().unwrap_or_else(|| backend_base.clone());
    let kv = cli.kv_events.clone().map(|publisher| {
        kv_events::spawn(kv_events::KvEventsConfig {
            publisher,
            replay: cli.kv_events_replay.clone(),
            topic: cli.kv_events_topic.clone(),
            ranks: cli.kv_events_ranks,
            capacity_blocks: cli.kv_events_capacity as usize,
        })
    });
    let mut balancers = Balancers::new(
        client,
        agent_id.clone(),
        cli.management_token.clone(),
        cli.share_slots,
        balancers::EngineSide {
            loader: loader.clone(),
            kv: kv.clone(),
        },
    );
    info!(
        agent = agent_id,
        backend = backend_base,
        external = %external_addr,
        balancers = balancer_names.join(","),
        interval_ms = cli.monitoring_interval.as_millis() as u64,
        "agent starting"
    );
    let mut resolved = balancers::resolver(balancer_names.clone());
    // The first lookups, before the first report (bounded: a name that
    // does not resolve yet gets reports once it does).
    let _ = tokio::time::timeout(Duration::from_secs(3), resolved.changed()).await;
    balancers.apply(&resolved.borrow_and_update());

    let mut ticker = tokio::time::interval(cli.monitoring_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let mut last_problem: Option<String> = None;
    // Set by the first signal: stop taking work, leave by this deadline;
    // and the first report that said so.
    let mut drain_until: Option<tokio::time::Instant> = None;
    let mut drain_report: Option<u64> = None;
    loop {
        let drain_deadline = async {
            match drain_until {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = &mut shutdown => {
                if drain_until.is_some() {
                    warn!("second signal: leaving without waiting for in-flight requests");
                    break;
                }
                info!(timeout_ms = cli.drain_timeout.as_millis() as u64,
                    "draining: no new work; waiting for in-flight requests to finish");
                drain_until = Some(tokio::time::Instant::now() + cli.drain_timeout);
                shutdown.set(shutdown_signal());
                ticker.reset_immediately();
                continue;
            }
            () = drain_deadline => {
                warn!("drain timeout: leaving with requests still in flight");
                break;
            }
            Ok(()) = resolved.changed() => {
                balancers.apply(&resolved.borrow_and_update());
                continue;
            }
            _ = ticker.tick() => {}
        }
        if drain_report.is_some_and(|n| balancers.all_idle_since(n)) {
            info!("drained: no request in flight");
            break;
        }
        let read_began = tokio::time::Instant::now();
        let status = backend.poll().await;
        let read = (read_began, tokio::time::Instant::now());
        let mut report = report_of(
            &cli,
            &agent_id,
            &name,
            external_addr,
            status,
            drain_until.is_some(),
        );
        if let Some(l) = loader.as_ref().filter(|_| report.last_error.is_none()) {
            l.annotate(&mut report.adapters, std::time::Instant::now());
        }
        if let Some(kv) = &kv {
            let mut state = kv.lock().unwrap_or_else(|e| e.into_inner());
            state.set_capacity_tokens(report.kv_capacity_tokens);
            report.kv_events = Some(state.report(std::time::Instant::now()));
        }
        let problem = report
            .last_error
            .as_ref()
            .map(|e| format!("backend not ready: {e}"));
        let draining = report.draining;
        let published = balancers.publish(report.clone(), read);
        if draining && drain_report.is_none() {
            drain_report = Some(published);
        }
        if problem != last_problem {
            log_problem_change(problem.as_deref(), &report);
            last_problem = problem;
        }
    }
    balancers.deregister(Duration::from_secs(2)).await;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.max_concurrency.is_none() && EngineMetrics::for_kind(cli.backend.kind()).is_some() {
        use clap::CommandFactory;
        let msg = format!(
            "--backend {} needs --max-concurrency N: the server does not expose how many \
             requests it runs at once (vLLM --max-num-seqs, SGLang --max-running-requests)",
            cli.backend.kind().as_str()
        );
        Cli::command()
            .error(clap::error::ErrorKind::MissingRequiredArgument, msg)
            .exit();
    }
    if !cli.lora_adapters.is_empty() && !matches!(cli.backend, BackendArg::Vllm) {
        use clap::CommandFactory;
        Cli::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "--lora-adapter needs --backend vllm: only vLLM loads adapters at run time",
            )
            .exit();
    }
    if cli.kv_events.is_some() && matches!(cli.backend, BackendArg::Llamacpp) {
        use clap::CommandFactory;
        Cli::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "--kv-events needs --backend vllm or sglang: llama.cpp publishes no cache events",
            )
            .exit();
    }
    if cli.lora_adapters.len() > loader::MAX_LOADABLE {
        use clap::CommandFactory;
        Cli::command()
            .error(
                clap::error::ErrorKind::TooManyValues,
                format!("at most {} --lora-adapter names", loader::MAX_LOADABLE),
            )
            .exit();
    }
    if cli.model_aliases.len() > MAX_ALIASES {
        use clap::CommandFactory;
        Cli::command()
            .error(
                clap::error::ErrorKind::TooManyValues,
                format!("at most {MAX_ALIASES} --model-alias names"),
            )
            .exit();
    }
    flowgate_logging::init("agent", &cli.log_level, cli.log_format);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals() {
        assert_eq!(parse_interval("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_interval("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_interval("50"), Ok(Duration::from_millis(50)));
        assert!(parse_interval("10ms").is_err());
        assert!(parse_interval("2h").is_err());
        assert!(parse_interval("fast").is_err());
    }

    #[test]
    fn zmq_addresses() {
        assert_eq!(
            parse_zmq_addr("tcp://10.0.0.1:5557"),
            Ok(("10.0.0.1".into(), 5557))
        );
        assert_eq!(parse_zmq_addr("vllm:5557"), Ok(("vllm".into(), 5557)));
        assert_eq!(parse_zmq_addr("[::1]:5557"), Ok(("::1".into(), 5557)));
        assert!(parse_zmq_addr("tcp://*:5557").is_err(), "a bind address");
        assert!(parse_zmq_addr("vllm").is_err());
        assert!(parse_zmq_addr("vllm:0").is_err());
        assert!(parse_zmq_addr("vllm:99999").is_err());
    }

    #[test]
    fn addresses() {
        assert_eq!(
            base_url("127.0.0.1:8080"),
            Ok("http://127.0.0.1:8080".into())
        );
        assert_eq!(base_url("http://h:1/"), Ok("http://h:1".into()));
        assert!(base_url("https://h:1").is_err());
        assert!(base_url("h").is_err());
        assert!(base_url("http://h:1/x").is_err());
    }

    #[test]
    fn a_long_model_list_is_cut_to_what_a_report_carries_aliases_kept() {
        let cli = Cli::parse_from([
            "agent",
            "--backend-addr",
            "127.0.0.1:1",
            "--management-addr",
            "127.0.0.1:2",
            "--model-alias",
            "alias-a",
            "--model-alias",
            "alias-b",
        ]);
        let mut status = backend::BackendStatus::unreachable(String::new());
        status.health = flowgate::BackendHealth::Ready;
        status.last_error = None;
        status.models = (0..300).map(|i| format!("m{i}")).collect();
        status.models.insert(1, String::new());
        let addr = "127.0.0.1:1".parse().unwrap();
        let r = report_of(&cli, "a", "a", addr, status, false);
        assert_eq!(r.models.len(), MAX_MODELS_PER_REPORT);
        assert_eq!(r.models[0], "m0", "the engine's own name first");
        assert!(r.models.ends_with(&["alias-a".into(), "alias-b".into()]));
        assert!(r.validate().is_ok());
    }
}
