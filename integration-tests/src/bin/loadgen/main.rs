//! `loadgen`: the scheduling benchmark's load generator and baseline
//! routers (see `scripts/bench/scheduling`). Not a test.
//!
//! - `loadgen run`: closed-loop clients send streamed chat requests to a
//!   router for a while and print one JSON line: throughput, TTFT
//!   percentiles by class, requests per tenant, and the hit ratio no
//!   placement could beat on the prompts it sent (`ceiling_hit_ratio`,
//!   llm-sim's cache arithmetic: `flowgate_integration_tests::sim_cache`).
//! - `loadgen proxy`: a minimal reverse proxy with `round-robin` or
//!   `least-in-flight` balancing and no queue of its own, the baselines
//!   (see `proxy.rs`).
//! - `loadgen hold`: sends many requests at once, each on its own
//!   connection, and reports how they ended (the proxy benchmark's buffered
//!   requests, `scripts/bench/proxy`).
//! - `loadgen tenants`: open-loop tenants, each at its own request rate
//!   with its own prompt size and `max_tokens`, and prints tokens served
//!   and TTFT per tenant (the token-fairness benchmark,
//!   `scripts/bench/fairness`).
//! - `loadgen epp`: Envoy's side of EPP mode at a fixed request rate, and
//!   the decision latency it sees (`scripts/bench/epp`; see `epp.rs`).
//! - `loadgen lora`: requests for Zipf-popular LoRA adapters
//!   (`scripts/bench/lora`; see `lora.rs`).
//! - `loadgen slo`: interactive requests with a latency objective beside
//!   batch work, open loop (`scripts/bench/objectives`; see `slo.rs`).

mod agentic;
mod epp;
mod hold;
mod lora;
mod proxy;
mod slo;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use flowgate_integration_tests::sim_cache::{self, Ceiling};

use agentic::Conversation;
use futures_util::StreamExt;
use serde_json::{json, Value};

#[derive(Debug, Parser)]
#[command(
    name = "loadgen",
    about = "Scheduling benchmark: load generator and baseline routers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Send a workload to a router and print the results as one JSON line
    Run(RunArgs),
    /// A baseline router without a queue of its own
    Proxy(proxy::ProxyArgs),
    /// Send many requests at once and wait for all of them
    Hold(hold::HoldArgs),
    /// Open-loop tenants at fixed request rates; tokens and TTFT per tenant
    Tenants(TenantsArgs),
    /// Envoy's side of EPP mode at a fixed request rate: decision latency
    Epp(epp::EppArgs),
    /// Requests for Zipf-popular LoRA adapters of one base model
    Lora(lora::LoraArgs),
    /// Interactive requests with a latency objective beside batch work
    Slo(slo::SloArgs),
}

#[derive(Debug, clap::Args)]
struct TenantsArgs {
    /// Router base URL, e.g. http://127.0.0.1:8061; repeat to spread the
    /// requests over several (in turn)
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    /// Seconds to send for (answers that end later are not counted)
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// A tenant: NAME:RATE:PROMPT_BYTES:MAX_TOKENS (requests per second,
    /// evenly spaced); repeat for each
    #[arg(long = "tenant", value_parser = parse_tenant, required = true)]
    tenants: Vec<Tenant>,
    #[arg(long, default_value = "sim-model")]
    model: String,
}

#[derive(Debug, Clone)]
struct Tenant {
    name: String,
    rate: f64,
    prompt_bytes: usize,
    max_tokens: u64,
}

fn parse_tenant(s: &str) -> Result<Tenant, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let [name, rate, prompt_bytes, max_tokens] = parts[..] else {
        return Err(format!("{s:?}: want NAME:RATE:PROMPT_BYTES:MAX_TOKENS"));
    };
    let num = |v: &str| v.parse::<f64>().map_err(|e| format!("{v:?}: {e}"));
    Ok(Tenant {
        name: name.to_string(),
        rate: num(rate)?.max(0.001),
        prompt_bytes: num(prompt_bytes)? as usize,
        max_tokens: num(max_tokens)? as u64,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Workload {
    /// Multi-turn chats of 4 tenants over 8 long shared system prompts
    Chat,
    /// `chat` plus as many batch clients (objective `batch`, own tenant)
    /// sending long unique prompts
    ChatBatch,
    /// Unique prompts of random length, nothing shared
    Random,
    /// One short fixed prompt: what a proxy adds, nothing else
    Fixed,
    /// Coding-agent sessions: each client is a conversation over a ~4 KB
    /// system prompt shared by groups of 8, a ~1 KB first message of its
    /// own, and 8-12 turns, each appending the answer and 1-2 KB of tool
    /// output; then it starts a new conversation. Sends its session key in
    /// `--session-header` when one is named
    Agentic,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Router base URL, e.g. http://127.0.0.1:8061
    #[arg(long)]
    target: String,
    #[arg(long, value_enum)]
    workload: Workload,
    /// Interactive clients (closed loop: one request at a time each)
    #[arg(long, default_value_t = 48)]
    clients: usize,
    /// Seconds to send for
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Seed of the prompt choices
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The requests' `model` field (empty: none)
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// The requests' `max_tokens` (default: none, the server decides)
    #[arg(long)]
    max_tokens: Option<u32>,
    /// Size of each system prompt, in repetitions of a 52-byte rule
    #[arg(long, default_value_t = 70)]
    system_repeat: usize,
    /// `agentic` and `chat`: the header that carries each conversation's
    /// key (e.g. x-session-id); none when empty
    #[arg(long, default_value = "")]
    session_header: String,
    /// `agentic`: sizes of the groups of clients that share a system
    /// prompt, in order (e.g. 16,8,4,4); clients past them form groups of
    /// the last size. Default: groups of 8
    #[arg(long, value_delimiter = ',')]
    groups: Vec<usize>,
    /// `agentic`: open loop, conversations started at this rate per
    /// second (Poisson arrivals), each running its turns and ending; the
    /// groups are as `--clients` closed-loop clients would hold them.
    /// Default: closed loop, `--clients` conversations at a time
    #[arg(long, value_parser = positive_rate)]
    conversation_rate: Option<f64>,
    /// Tenants the clients (or conversations) take in turn, in
    /// `x-gateway-inference-fairness-id`: `tenant-0` ..
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..))]
    tenants: u16,
    /// Write one JSON line per answered request to this file: when it was
    /// sent (seconds into the run), its TTFT and total time, its session
    /// key, its message count, and where it went: the endpoint Flowgate
    /// names (the request asks `x-flowgate-debug: scores`; the balancer
    /// must allow it, `scheduling.explain`), else llm-sim's `x-sim-server`
    /// when the router passes it on
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Servers some closed-loop clients send to straight, bypassing the
    /// router (comma-separated base URLs): every `--bypass-every`th client,
    /// each to one of them in turn. Their requests are measured apart
    /// (class `bypass`); they warm and evict the servers' caches behind the
    /// router's back
    #[arg(long, value_delimiter = ',')]
    bypass: Vec<String>,
    /// With `--bypass`: one client in this many bypasses the router
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    bypass_every: u64,
}

/// A rate of conversations per second: finite and above zero.
fn positive_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!("{s:?} is not a rate above zero")),
    }
}

/// The system-prompt group of client `i` (see `RunArgs::groups`).
fn group_of(i: usize, groups: &[usize]) -> usize {
    let mut start = 0;
    for (g, &size) in groups.iter().enumerate() {
        if i < start + size.max(1) {
            return g;
        }
        start += size.max(1);
    }
    groups.len() + (i - start) / groups.last().map_or(8, |l| *l.max(&1))
}

fn main() {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    match cli.command {
        Command::Run(args) => rt.block_on(run(args)),
        Command::Proxy(args) => rt.block_on(proxy::proxy(args)),
        Command::Hold(args) => rt.block_on(hold::hold(args)),
        Command::Tenants(args) => rt.block_on(tenants(args)),
        Command::Epp(args) => rt.block_on(epp::epp(args)),
        Command::Lora(args) => rt.block_on(lora::lora(args)),
        Command::Slo(args) => rt.block_on(slo::slo(args)),
    }
}

/// Per tenant: requests answered, tokens served (from each answer's
/// `usage`), TTFT of each, and failures by status.
#[derive(Debug, Default)]
struct TenantSamples {
    ok: u64,
    tokens: u64,
    ttft: Vec<f64>,
    errors: BTreeMap<u16, u64>,
    /// (seconds from the start when sent, tokens) of each answered request.
    served: Vec<(f64, u64)>,
}

/// The most tokens answered for requests sent within any 60 s.
fn max_tokens_per_minute(served: &[(f64, u64)]) -> u64 {
    let mut sorted = served.to_vec();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut best, mut sum, mut first) = (0, 0, 0);
    for &(at, tokens) in &sorted {
        sum += tokens;
        while sorted[first].0 <= at - 60.0 {
            sum -= sorted[first].1;
            first += 1;
        }
        best = best.max(sum);
    }
    best
}

async fn tenants(args: TenantsArgs) {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .build()
        .expect("http client");
    let urls: Vec<String> = args
        .targets
        .iter()
        .map(|t| format!("{}/v1/chat/completions", t.trim_end_matches('/')))
        .collect();
    let samples: Arc<Mutex<BTreeMap<String, TenantSamples>>> = Arc::default();
    let start = Instant::now();
    let until = start + Duration::from_secs(args.seconds);
    let mut senders = Vec::new();
    for (t, tenant) in args.tenants.iter().cloned().enumerate() {
        let (client, urls, samples, model) = (
            client.clone(),
            urls.clone(),
            Arc::clone(&samples),
            args.model.clone(),
        );
        senders.push(tokio::spawn(async move {
            let gap = Duration::from_secs_f64(1.0 / tenant.rate);
            let mut inflight = Vec::new();
            let mut n = 0u64;
            // Staggered so the tenants' arrivals interleave.
            let mut next = start + gap.mul_f64(t as f64 / 7.0);
            while next < until {
                tokio::time::sleep_until(next.into()).await;
                next += gap;
                n += 1;
                let filler = "lorem ipsum dolor sit amet ".repeat(tenant.prompt_bytes / 27 + 1);
                let content = format!("{} {n}: {filler}", tenant.name);
                let body = json!({"model": model, "stream": true,
                    "stream_options": {"include_usage": true},
                    "max_tokens": tenant.max_tokens,
                    "messages": [{"role": "user", "content": &content[..tenant.prompt_bytes.min(content.len())]}]});
                let req = client
                    .post(&urls[n as usize % urls.len()])
                    .header("x-gateway-inference-fairness-id", &tenant.name)
                    .header("x-flowgate-request-ttl", "60s")
                    .json(&body);
                let (samples, name) = (Arc::clone(&samples), tenant.name.clone());
                inflight.push(tokio::spawn(async move {
                    let sent = Instant::now();
                    let sent_s = sent.duration_since(start).as_secs_f64();
                    let outcome = match req.send().await {
                        Ok(resp) if resp.status().is_success() => {
                            let mut body = resp.bytes_stream();
                            let mut ttft = None;
                            let mut text = Vec::new();
                            let mut ok = true;
                            while let Some(chunk) = body.next().await {
                                match chunk {
                                    Ok(c) => {
                                        if ttft.is_none() && !c.is_empty() {
                                            ttft = Some(sent.elapsed().as_secs_f64());
                                        }
                                        text.extend_from_slice(&c);
                                    }
                                    Err(_) => ok = false,
                                }
                            }
                            match (ttft, ok) {
                                (Some(t), true) => Ok((t, usage_tokens(&text))),
                                _ => Err(0),
                            }
                        }
                        Ok(resp) => Err(resp.status().as_u16()),
                        Err(_) => Err(0),
                    };
                    let mut s = samples.lock().unwrap();
                    let s = s.entry(name).or_default();
                    match outcome {
                        Ok((ttft, tokens)) if Instant::now() <= until => {
                            s.ok += 1;
                            s.tokens += tokens;
                            s.ttft.push(ttft);
                            s.served.push((sent_s, tokens));
                        }
                        Ok(_) => {}
                        Err(code) => *s.errors.entry(code).or_default() += 1,
                    }
                }));
            }
            // Answers that end later do not count: the rest are dropped
            // (their clients leave) when the time is up.
            tokio::time::sleep_until(until.into()).await;
            for t in inflight {
                t.abort();
            }
        }));
    }
    for s in senders {
        let _ = s.await;
    }
    let secs = args.seconds as f64;
    let s = samples.lock().unwrap();
    let mut out = serde_json::Map::new();
    let total: u64 = s.values().map(|t| t.tokens).sum();
    for (name, t) in s.iter() {
        let ttft = sorted(&t.ttft);
        let p = |q| pct_or_nan(&ttft, q);
        let errors: BTreeMap<String, u64> =
            t.errors.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        out.insert(
            name.clone(),
            json!({"requests": t.ok, "tokens": t.tokens,
                   "max_tokens_per_minute": max_tokens_per_minute(&t.served),
                   "token_share": t.tokens as f64 / total.max(1) as f64,
                   "ttft_p50_s": p(0.5), "ttft_p99_s": p(0.99), "errors": errors}),
        );
    }
    println!(
        "{}",
        json!({"seconds": secs, "tokens_per_s": total as f64 / secs, "tenants": out})
    );
}

/// Prompt plus completion tokens of the last `usage` in an SSE body (0 if
/// none).
fn usage_tokens(body: &[u8]) -> u64 {
    last_usage(body).map_or(0, |(prompt, completion)| prompt + completion)
}

/// The (prompt, completion) tokens of a stream's last `usage` object.
fn last_usage(body: &[u8]) -> Option<(u64, u64)> {
    let text = String::from_utf8_lossy(body);
    text.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| {
            let u = v.get("usage")?;
            Some((
                u["prompt_tokens"].as_u64()?,
                u["completion_tokens"].as_u64()?,
            ))
        })
}

// ---- load generator ---------------------------------------------------

/// xorshift64*: prompt choices reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

const SYSTEM_PROMPTS: usize = 8;
const TURNS: usize = 6;

fn system_prompt(k: usize, repeat: usize) -> String {
    format!(
        "You are assistant {k} of the support team. Follow policy {k} exactly. {}",
        format!("Rule {k}: be precise, cite the manual, never guess. ").repeat(repeat)
    )
}

#[derive(Default)]
struct Samples {
    /// class → TTFT seconds of successful requests.
    ttft: BTreeMap<&'static str, Vec<f64>>,
    /// class → seconds to the end of the response.
    total: BTreeMap<&'static str, Vec<f64>>,
    /// tenant → successful requests.
    per_tenant: BTreeMap<String, u64>,
    errors: BTreeMap<u16, u64>,
    /// The hit ratio no placement can beat on the prompts sent.
    ceiling: Ceiling,
    /// `--trace`: one JSON line per answered request.
    trace: Vec<String>,
}

/// What every request of a run shares: where it goes, how it is built,
/// where its outcome is recorded.
struct Sender {
    client: reqwest::Client,
    url: String,
    model: String,
    max_tokens: Option<u32>,
    session_header: String,
    samples: Arc<Mutex<Samples>>,
    /// Requests that finish after it do not count.
    until: Instant,
    /// When the run started (`--trace` times are from it).
    start: Instant,
    tenants: usize,
    trace: bool,
}

impl Sender {
    /// The tenant of the `k`th client or conversation.
    fn tenant(&self, k: usize) -> String {
        format!("tenant-{}", k % self.tenants)
    }

    /// Sends one streamed chat request of `messages` for `tenant` (a batch
    /// request with `batch`; its conversation's `key` in the session
    /// header, when both are set), reads the answer to its end and records
    /// it.
    async fn send(&self, messages: Vec<Value>, tenant: &str, batch: bool, key: &str) {
        self.send_to(&self.url, messages, tenant, batch, key).await;
    }

    /// [`Sender::send`] to `url` (a server straight, when it is not the
    /// router's: measured as class `bypass`).
    async fn send_to(&self, url: &str, messages: Vec<Value>, tenant: &str, batch: bool, key: &str) {
        let mut body = json!({"stream": true, "messages": messages});
        if !self.model.is_empty() {
            body["model"] = json!(self.model);
        }
        if let Some(n) = self.max_tokens {
            body["max_tokens"] = json!(n);
        }
        let prompt_text = sim_cache::prompt_text(&body);
        self.samples.lock().unwrap().ceiling.add(&prompt_text);
        let mut req = self
            .client
            .post(url)
            .header("x-gateway-inference-fairness-id", tenant)
            .json(&body);
        if batch {
            req = req.header("x-gateway-inference-objective", "batch");
        }
        if !key.is_empty() && !self.session_header.is_empty() {
            req = req.header(self.session_header.as_str(), key);
        }
        if self.trace {
            req = req.header("x-flowgate-debug", "scores");
        }
        let turn_messages = body["messages"].as_array().map_or(0, Vec::len);
        let prompt_bytes = prompt_text.len();
        let sent = Instant::now();
        let mut went = (Value::Null, Value::Null);
        let outcome = match req.send().await {
            Ok(resp) if resp.status().is_success() => {
                if self.trace {
                    let header = |name| resp.headers().get(name).and_then(|v| v.to_str().ok());
                    went = (
                        header("x-flowgate-scores")
                            .and_then(|v| serde_json::from_str::<Value>(v).ok())
                            .map(|v| v["endpoint"].clone())
                            .or_else(|| header("x-sim-server").map(Value::from))
                            .unwrap_or(Value::Null),
                        header("x-flowgate-wait-ms")
                            .and_then(|v| v.parse::<u64>().ok())
                            .map_or(Value::Null, Value::from),
                    );
                }
                first_byte(resp, sent)
                    .await
                    .map(|t| (t, sent.elapsed().as_secs_f64()))
                    .ok_or(0)
            }
            Ok(resp) => Err(resp.status().as_u16()),
            Err(_) => Err(0),
        };
        let mut s = self.samples.lock().unwrap();
        match outcome {
            Ok((ttft, total)) => {
                if self.trace {
                    let line = json!({"sent_s": (sent - self.start).as_secs_f64(), "ttft_s": ttft,
                        "total_s": total, "session": key, "messages": turn_messages,
                        "prompt_bytes": prompt_bytes,
                        "endpoint": went.0, "wait_ms": went.1});
                    s.trace.push(line.to_string());
                }
                if Instant::now() <= self.until {
                    let class = match (batch, url == self.url) {
                        (true, _) => "batch",
                        (false, true) => "interactive",
                        (false, false) => "bypass",
                    };
                    s.ttft.entry(class).or_default().push(ttft);
                    s.total.entry(class).or_default().push(total);
                    // The router's throughput: not what went around it.
                    if class != "bypass" {
                        *s.per_tenant.entry(tenant.to_string()).or_default() += 1;
                    }
                }
            }
            Err(code) => *s.errors.entry(code).or_default() += 1,
        }
    }
}

async fn run(args: RunArgs) {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .expect("http client");
    let samples = Arc::new(Mutex::new(Samples::default()));
    let start = Instant::now();
    let until = start + Duration::from_secs(args.seconds);
    let sender = Arc::new(Sender {
        client,
        url: format!("{}/v1/chat/completions", args.target.trim_end_matches('/')),
        model: args.model.clone(),
        max_tokens: args.max_tokens,
        session_header: args.session_header.clone(),
        samples: Arc::clone(&samples),
        until,
        start,
        tenants: usize::from(args.tenants),
        trace: args.trace.is_some(),
    });
    let mut tasks = Vec::new();
    let batch_clients = if args.workload == Workload::ChatBatch {
        args.clients
    } else {
        0
    };
    let open_rate = args
        .conversation_rate
        .filter(|_| args.workload == Workload::Agentic);
    if let Some(rate) = open_rate {
        let open = agentic::open_loop(
            Arc::clone(&sender),
            rate,
            args.clients,
            args.groups.clone(),
            args.seed,
            until,
        );
        tasks.push(tokio::spawn(open));
    }
    let closed_clients = if open_rate.is_some() { 0 } else { args.clients };
    for i in 0..closed_clients + batch_clients {
        let batch = i >= args.clients;
        let sender = Arc::clone(&sender);
        let (workload, repeat) = (args.workload, args.system_repeat);
        let group = group_of(i, &args.groups);
        let mut rng = Rng((args.seed << 16) ^ ((i as u64 + 1) * 0x9E37_79B9));
        let every = args.bypass_every as usize;
        let url = match args.bypass.len() {
            n if n > 0 && !batch && i % every == every - 1 => format!(
                "{}/v1/chat/completions",
                args.bypass[(i / every) % n].trim_end_matches('/')
            ),
            _ => sender.url.clone(),
        };
        tasks.push(tokio::spawn(async move {
            let tenant = if batch {
                "batch".to_string()
            } else {
                sender.tenant(i)
            };
            let mut messages: Vec<serde_json::Value> = Vec::new();
            let mut n = 0u64;
            // This client's conversations so far, and the one it holds.
            let (mut conversations, mut key) = (0u64, String::new());
            let mut agent: Option<Conversation> = None;
            while Instant::now() < until {
                n += 1;
                let prompt = if workload == Workload::Agentic {
                    let turn = agent.as_mut().and_then(Conversation::next_turn);
                    match turn {
                        Some(turn) => turn,
                        None => {
                            conversations += 1;
                            let name = format!("{i}-{conversations}");
                            let started = agent.insert(Conversation::new(&name, group, &mut rng));
                            key.clone_from(&started.key);
                            started.next_turn().expect("a new conversation has turns")
                        }
                    }
                } else if workload == Workload::Fixed {
                    vec![json!({"role": "user", "content": "hi"})]
                } else if batch || workload == Workload::Random {
                    let len = 500 + rng.below(3_500) as usize;
                    let unique = format!("Document {i}-{n}-{}: ", rng.below(u64::MAX));
                    vec![json!({"role": "user",
                        "content": format!("{unique}{}", "lorem ipsum dolor ".repeat(len / 18))})]
                } else {
                    if messages.is_empty() || messages.len() > 2 * TURNS {
                        conversations += 1;
                        key = format!("chat-{i}-{conversations}-{}", rng.below(1 << 32));
                        let k = (i + rng.below(2) as usize) % SYSTEM_PROMPTS;
                        messages =
                            vec![json!({"role": "system", "content": system_prompt(k, repeat)})];
                    }
                    messages.push(json!({"role": "user",
                        "content": format!("Question {n} from client {i}?")}));
                    messages.clone()
                };
                sender.send_to(&url, prompt, &tenant, batch, &key).await;
                if !batch && matches!(workload, Workload::Chat | Workload::ChatBatch) {
                    messages.push(json!({"role": "assistant", "content": "Noted."}));
                }
                if let Some(agent) = agent.as_mut() {
                    agent.answered(n, &mut rng);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let s = samples.lock().unwrap();
    if let Some(path) = &args.trace {
        let mut lines = s.trace.join("\n");
        lines.push('\n');
        if let Err(e) = std::fs::write(path, lines) {
            eprintln!("loadgen: cannot write the trace to {}: {e}", path.display());
            std::process::exit(1);
        }
    }
    let secs = args.seconds as f64;
    let mut classes = serde_json::Map::new();
    for (class, v) in &s.ttft {
        let ttft = sorted(v);
        let total = sorted(&s.total[class]);
        classes.insert(
            class.to_string(),
            json!({"requests": v.len(), "throughput_rps": v.len() as f64 / secs,
                   "ttft_p50_s": pct(&ttft, 0.5), "ttft_p99_s": pct(&ttft, 0.99),
                   "total_p50_s": pct(&total, 0.5), "total_p99_s": pct(&total, 0.99)}),
        );
    }
    let total: u64 = s.per_tenant.values().sum();
    let errors: BTreeMap<String, u64> = s.errors.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    println!(
        "{}",
        json!({"workload": format!("{:?}", args.workload), "seconds": secs,
               "throughput_rps": total as f64 / secs, "classes": classes,
               "per_tenant": s.per_tenant, "errors": errors,
               "ceiling_hit_ratio": s.ceiling.hit_ratio()})
    );
}

/// Reads a streamed answer to its end: seconds from `sent` to its first
/// bytes, `None` when it broke off or sent nothing.
async fn first_byte(resp: reqwest::Response, sent: Instant) -> Option<f64> {
    let mut body = resp.bytes_stream();
    let mut ttft = None;
    let mut ok = true;
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(c) if ttft.is_none() && !c.is_empty() => ttft = Some(sent.elapsed().as_secs_f64()),
            Ok(_) => {}
            Err(_) => ok = false,
        }
    }
    ttft.filter(|_| ok)
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

/// The `p` quantile of sorted, non-empty samples.
fn pct(v: &[f64], p: f64) -> f64 {
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
}

/// [`pct`], or NaN (`null` in the JSON line) when there are no samples.
fn pct_or_nan(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        pct(v, p)
    }
}
