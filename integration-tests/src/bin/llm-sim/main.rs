//! `llm-sim`: an OpenAI-compatible fake model server that looks like
//! llama.cpp's `llama-server` to the agent. For tests and benchmarks only.
//!
//! It has `--slots` parallel slots; requests beyond them wait inside the
//! simulator (reported as `llamacpp:requests_deferred`, as llama-server
//! does). Every knob can be set per request with a header:
//!
//! | header               | meaning                                         |
//! |----------------------|-------------------------------------------------|
//! | `x-sim-ttft-ms`      | time to first token                             |
//! | `x-sim-tpot-ms`      | time per output token                           |
//! | `x-sim-output-tokens`| tokens to generate                              |
//! | `x-sim-fault`        | `status=CODE` (a broken server: plain text), `reject=CODE` (the engine's JSON error object, as llama-server answers a malformed request), `hang`, `drop-mid-stream`, `slow-stream` |
//! | `x-sim-tag`          | recorded in arrival order at `GET /sim/stats`   |
//! | `traceparent`        | recorded at `GET /sim/stats` (`traceparents`)   |
//!
//! Responses carry `x-sim-body-bytes` and `x-sim-body-sha256` of the request
//! body received, so tests can check that bodies arrive intact, and
//! `x-sim-cached-tokens`, the prompt tokens its prefix cache served.
//!
//! For scheduling experiments it can also model KV capacity, a prefix cache
//! and decode slowing down with batch size (see [`engine`]); all off by
//! default.
//!
//! For scale experiments one process can be a whole fleet: `--servers N`
//! serves N independent simulated servers on N ports, and `--report-to`
//! reports each of them to a balancer as its agent would.

mod answer;
mod cli;
mod engine;
mod fault;
mod kv_events;
mod lora;
mod report;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::HeaderValue;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;

use crate::answer::{final_body, pause, stream_response};
use crate::cli::{Cli, EngineKind};
use crate::engine::{Engine, EngineConfig, Running};
use crate::fault::{parse_fault, Fault};
use crate::report::report_loop;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = http_body_util::combinators::BoxBody<Bytes, BoxError>;

#[derive(Default)]
struct Stats {
    arrivals: Vec<String>,
    /// The W3C `traceparent` of each request that carried one.
    traceparents: Vec<String>,
    max_processing: u64,
    max_deferred: u64,
}

struct Sim {
    cli: Cli,
    /// `x-sim-server` on every answer: the address this server listens on,
    /// so a load generator sees where any router sent a request.
    server: hyper::header::HeaderValue,
    started: Instant,
    engine: Arc<Engine>,
    processing: AtomicU64,
    deferred: AtomicU64,
    requests_total: AtomicU64,
    tokens_total: AtomicU64,
    bytes_received: AtomicU64,
    next_id: AtomicU64,
    stats: Mutex<Stats>,
    adapters: Arc<lora::Adapters>,
    kv_events: Option<Arc<kv_events::Publisher>>,
    tokenizer: Option<Arc<flowgate_tokenizer::ModelTokenizer>>,
}

/// Counts a request as processing while alive (it holds a slot).
struct Processing {
    sim: Arc<Sim>,
    _running: Running,
    /// The LoRA adapter it runs on, if it named one.
    _adapter: Option<lora::Running>,
}

/// Counts a request as deferred while it waits, however the wait ends.
struct Deferred<'a>(&'a AtomicU64);

impl Drop for Deferred<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Processing {
    fn new(sim: Arc<Sim>, running: Running) -> Self {
        let now = sim.processing.fetch_add(1, Ordering::SeqCst) + 1;
        let mut st = sim.stats.lock().unwrap();
        st.max_processing = st.max_processing.max(now);
        drop(st);
        Processing {
            sim,
            _running: running,
            _adapter: None,
        }
    }
}

impl Drop for Processing {
    fn drop(&mut self) {
        self.sim.processing.fetch_sub(1, Ordering::SeqCst);
    }
}

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(
        Full::new(body.into())
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r.headers_mut()
        .insert("content-type", HeaderValue::from_str(content_type).unwrap());
    r
}

fn json_resp(status: StatusCode, v: serde_json::Value) -> Response<Body> {
    full(status, "application/json; charset=utf-8", v.to_string())
}

fn header<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

fn header_num(req: &Request<Incoming>, name: &str, default: u64) -> u64 {
    header(req, name)
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

impl Sim {
    /// `/v1/models`: the model, and each adapter with its `parent` (vLLM).
    fn models_json(&self) -> serde_json::Value {
        let mut data = vec![
            json!({"id": self.cli.model, "object": "model", "created": 0, "owned_by": "llamacpp"}),
        ];
        for name in self.adapters.snapshot().servable {
            data.push(
                json!({"id": name, "object": "model", "created": 0, "owned_by": "vllm",
                "root": format!("/adapters/{name}"), "parent": self.cli.model}),
            );
        }
        json!({"object": "list", "data": data})
    }

    /// vLLM / SGLang style gauges: running, waiting, and KV use (half the
    /// cache per fully busy server, so load alone never saturates it).
    fn engine_metrics(&self, engine: EngineKind) -> String {
        let (running, waiting, kv) = match engine {
            EngineKind::Vllm => (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            ),
            EngineKind::Sglang => (
                "sglang:num_running_reqs",
                "sglang:num_queue_reqs",
                "sglang:token_usage",
            ),
            EngineKind::Llamacpp => unreachable!("llama.cpp metrics are rendered by metrics()"),
        };
        let busy = self.processing.load(Ordering::SeqCst);
        // Without a KV capacity: half the cache per fully busy server.
        let kv_use = self
            .engine
            .kv_usage()
            .unwrap_or(busy as f64 / f64::from(self.cli.slots.max(1)) * 0.5);
        let labels = format!("{{engine=\"0\",model_name=\"{}\"}}", self.cli.model);
        let queries = self.engine.prompt_tokens_total.load(Ordering::Relaxed);
        let hits = self.engine.cached_tokens_total.load(Ordering::Relaxed);
        let cache = match engine {
            EngineKind::Vllm => format!(
                "# TYPE vllm:prefix_cache_queries_total counter\n\
                 vllm:prefix_cache_queries_total{labels} {queries}.0\n\
                 # TYPE vllm:prefix_cache_hits_total counter\n\
                 vllm:prefix_cache_hits_total{labels} {hits}.0\n"
            ),
            _ => format!(
                "# TYPE sglang:cache_hit_rate gauge\nsglang:cache_hit_rate{labels} {}\n",
                if queries == 0 {
                    0.0
                } else {
                    hits as f64 / queries as f64
                }
            ),
        };
        // The KV capacity, as each engine states it (vLLM: an info gauge
        // whose labels count blocks of 16 tokens).
        let capacity = match (self.cli.kv_capacity_tokens, engine) {
            (0, _) => String::new(),
            (tokens, EngineKind::Vllm) => format!(
                "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"16\",\
                 engine=\"0\",num_gpu_blocks=\"{}\"}} 1.0\n",
                tokens / 16
            ),
            (tokens, _) => format!(
                "# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens{labels} {tokens}.0\n"
            ),
        };
        format!(
            "# TYPE {running} gauge\n{running}{labels} {busy}.0\n\
             # TYPE {waiting} gauge\n{waiting}{labels} {}.0\n\
             # TYPE {kv} gauge\n{kv}{labels} {kv_use}\n{cache}{capacity}{lora}",
            self.deferred.load(Ordering::SeqCst),
            lora = match engine {
                EngineKind::Vllm => self.lora_metrics(),
                _ => String::new(),
            },
        )
    }

    /// vLLM's `vllm:lora_requests_info`, with LoRA on (adapters given):
    /// the adapters with requests running and waiting, and `max_lora`; its
    /// value is the time of the reading. And newer vLLM's
    /// `vllm:lora_adapter_loaded`: a series per loaded adapter.
    fn lora_metrics(&self) -> String {
        let a = self.adapters.snapshot();
        if a.servable.is_empty() {
            return String::new();
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let loaded: String = (a.loaded.iter())
            .map(|n| {
                format!(
                    "vllm:lora_adapter_loaded{{adapter_name=\"{n}\",level=\"gpu\",pinned=\"false\"}} 1\n"
                )
            })
            .collect();
        format!(
            "# TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{{max_lora=\"{}\",\
             running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {now}\n\
             # TYPE vllm:lora_adapter_loaded gauge\n{loaded}",
            self.cli.max_loras,
            a.running.join(","),
            a.waiting.join(",")
        )
    }

    fn metrics(&self) -> String {
        if self.cli.engine != EngineKind::Llamacpp {
            return self.engine_metrics(self.cli.engine);
        }
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, v: u64| {
            out.push_str(&format!(
                "# HELP llamacpp:{name} {help}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {v}\n"
            ));
        };
        metric(
            "prompt_tokens_total",
            "counter",
            "Number of prompt tokens processed",
            self.engine.prompt_tokens_total.load(Ordering::Relaxed),
        );
        metric(
            "tokens_predicted_total",
            "counter",
            "Number of generation tokens processed",
            self.tokens_total.load(Ordering::Relaxed),
        );
        metric(
            "requests_processing",
            "gauge",
            "Number of requests processing",
            self.processing.load(Ordering::SeqCst),
        );
        metric(
            "requests_deferred",
            "gauge",
            "Number of requests deferred",
            self.deferred.load(Ordering::SeqCst),
        );
        out
    }

    fn slots_json(&self) -> serde_json::Value {
        let busy = self.processing.load(Ordering::SeqCst) as u32;
        // llama-server splits its context evenly between slots. Without a
        // KV capacity the simulator holds any prompt, and says no context
        // (its agent then reports no capacity: no token budget applies).
        let slots: Vec<_> = (0..self.cli.slots)
            .map(|i| {
                let mut slot = json!({"id": i, "speculative": false, "is_processing": i < busy});
                if self.cli.kv_capacity_tokens > 0 {
                    slot["n_ctx"] =
                        json!(self.cli.kv_capacity_tokens / u64::from(self.cli.slots.max(1)));
                }
                slot
            })
            .collect();
        json!(slots)
    }

    fn stats_json(&self) -> serde_json::Value {
        let lora = self.adapters.snapshot();
        let st = self.stats.lock().unwrap();
        json!({
            "requests_total": self.requests_total.load(Ordering::SeqCst),
            "processing": self.processing.load(Ordering::SeqCst),
            "deferred": self.deferred.load(Ordering::SeqCst),
            "max_processing": st.max_processing,
            "max_deferred": st.max_deferred,
            "bytes_received_total": self.bytes_received.load(Ordering::SeqCst),
            "prompt_tokens_total": self.engine.prompt_tokens_total.load(Ordering::Relaxed),
            "cached_prompt_tokens_total": self.engine.cached_tokens_total.load(Ordering::Relaxed),
            "arrivals": st.arrivals,
            "traceparents": st.traceparents,
            "lora_loads": lora.loads,
            "lora_evictions": lora.evictions,
            "lora_registrations": lora.registrations,
            "lora_loaded": lora.loaded,
        })
    }

    fn reset(&self) {
        let mut st = self.stats.lock().unwrap();
        *st = Stats::default();
        self.requests_total.store(0, Ordering::SeqCst);
        self.bytes_received.store(0, Ordering::SeqCst);
        self.engine.prompt_tokens_total.store(0, Ordering::Relaxed);
        self.engine.cached_tokens_total.store(0, Ordering::Relaxed);
        self.engine.clear_cache();
    }
}

async fn route(sim: Arc<Sim>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    let server = sim.server.clone();
    let mut resp = match (req.method(), path.as_str()) {
        (&Method::GET, "/health") => {
            if sim.started.elapsed() < Duration::from_millis(sim.cli.loading_ms) {
                json_resp(
                    StatusCode::SERVICE_UNAVAILABLE,
                    json!({"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}),
                )
            } else {
                json_resp(StatusCode::OK, json!({"status": "ok"}))
            }
        }
        (&Method::GET, "/slots") if sim.cli.engine == EngineKind::Llamacpp => {
            json_resp(StatusCode::OK, sim.slots_json())
        }
        (&Method::GET, "/props") if sim.cli.engine == EngineKind::Llamacpp => json_resp(
            StatusCode::OK,
            json!({"total_slots": sim.cli.slots, "model_alias": sim.cli.model, "model_path": sim.cli.model}),
        ),
        (&Method::GET, "/metrics") => {
            full(StatusCode::OK, "text/plain; version=0.0.4", sim.metrics())
        }
        (&Method::GET, "/v1/models") => json_resp(StatusCode::OK, sim.models_json()),
        (&Method::POST, "/v1/load_lora_adapter") => lora_admin(sim, req, true).await,
        (&Method::POST, "/v1/unload_lora_adapter") => lora_admin(sim, req, false).await,
        (&Method::GET, "/sim/stats") => json_resp(StatusCode::OK, sim.stats_json()),
        (&Method::POST, "/sim/kv-events" | "/tokenize") => {
            let tokenizer = sim.tokenizer.as_deref();
            kv_events::route(sim.kv_events.as_deref(), tokenizer, &sim.engine, &path, req).await
        }
        (&Method::POST, "/sim/reset") => {
            sim.reset();
            json_resp(StatusCode::OK, json!({"status": "reset"}))
        }
        (
            &Method::POST,
            "/v1/chat/completions"
            | "/v1/completions"
            | "/completion"
            | "/v1/embeddings"
            | "/v1/responses",
        ) => inference(sim, req, path).await,
        (&Method::POST, "/v1/audio/transcriptions") => transcription(sim, req).await,
        _ => json_resp(
            StatusCode::NOT_FOUND,
            json!({"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}),
        ),
    };
    resp.headers_mut().insert("x-sim-server", server);
    Ok(resp)
}

/// vLLM's `/v1/audio/transcriptions`: a `multipart/form-data` body with a
/// `file` and a `model`; answered at once with a fixed text.
async fn transcription(sim: Arc<Sim>, req: Request<Incoming>) -> Response<Body> {
    let content_type = header(&req, "content-type").unwrap_or_default().to_string();
    sim.requests_total.fetch_add(1, Ordering::SeqCst);
    let body = req.into_body().collect().await.map(|b| b.to_bytes());
    let bad = |message: String| {
        json_resp(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": message, "type": "invalid_request_error", "code": 400}}),
        )
    };
    let body = match body {
        Ok(b) => b,
        Err(e) => return bad(format!("body: {e}")),
    };
    let parts = match flowgate::multipart::parse_multipart(&content_type, &body) {
        Ok(p) => p,
        Err(e) => return bad(e),
    };
    let field = |name: &str| parts.iter().find(|p| p.name == name).map(|p| p.data);
    if field("file").is_none() {
        return bad("a transcription needs a file".into());
    }
    let asked = field("model").map(|m| String::from_utf8_lossy(m).trim().to_string());
    if sim.cli.strict_model && asked.as_deref().is_some_and(|m| m != sim.cli.model) {
        return json_resp(
            StatusCode::NOT_FOUND,
            json!({"error": {"message": format!("The model `{}` does not exist.", asked.unwrap_or_default()),
                "type": "NotFoundError", "code": 404}}),
        );
    }
    json_resp(StatusCode::OK, json!({"text": "simulated transcript"}))
}

async fn inference(sim: Arc<Sim>, req: Request<Incoming>, path: String) -> Response<Body> {
    let ttft = Duration::from_millis(header_num(&req, "x-sim-ttft-ms", sim.cli.ttft_ms));
    let tpot = Duration::from_millis(header_num(&req, "x-sim-tpot-ms", sim.cli.tpot_ms));
    let tokens = header_num(
        &req,
        "x-sim-output-tokens",
        u64::from(sim.cli.output_tokens),
    ) as u32;
    let fault = header(&req, "x-sim-fault")
        .and_then(parse_fault)
        .or_else(|| sim.cli.fault.as_deref().and_then(parse_fault));
    let tag = header(&req, "x-sim-tag").map(str::to_string);
    if let Some(tag) = tag {
        let mut st = sim.stats.lock().unwrap();
        if st.arrivals.len() < 100_000 {
            st.arrivals.push(tag);
        }
    }
    if let Some(parent) = header(&req, "traceparent") {
        let mut st = sim.stats.lock().unwrap();
        if st.traceparents.len() < 10_000 {
            st.traceparents.push(parent.to_string());
        }
    }
    sim.requests_total.fetch_add(1, Ordering::SeqCst);

    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return json_resp(
                StatusCode::BAD_REQUEST,
                json!({"error": {"message": format!("body: {e}"), "type": "invalid_request_error", "code": 400}}),
            )
        }
    };
    sim.bytes_received
        .fetch_add(body.len() as u64, Ordering::SeqCst);
    let digest = hex(&Sha256::digest(&body));
    let parsed: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return json_resp(
                StatusCode::BAD_REQUEST,
                json!({"error": {"message": format!("invalid JSON: {e}"), "type": "invalid_request_error", "code": 400}}),
            )
        }
    };
    let stream = parsed
        .get("stream")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let asked = parsed.get("model").and_then(|m| m.as_str());
    // A LoRA adapter it serves, named as the model (vLLM's way).
    let adapter = asked.filter(|m| sim.adapters.serves(m)).map(str::to_string);
    if sim.cli.strict_model && adapter.is_none() && asked.is_some_and(|m| m != sim.cli.model) {
        return json_resp(
            StatusCode::NOT_FOUND,
            json!({"error": {"message": format!("The model `{}` does not exist.", asked.unwrap_or("")),
                "type": "NotFoundError", "code": 404}}),
        );
    }

    // The prompt as the balancer reads it (its hash is the prefix cache's
    // key), or its token ids with `--tokenizer`.
    let prompt = kv_events::prompt_bytes(sim.tokenizer.as_deref(), &parsed);
    let asked_tokens = ["max_tokens", "max_completion_tokens"]
        .iter()
        .find_map(|k| parsed.get(*k).and_then(serde_json::Value::as_u64));
    let tokens = match asked_tokens {
        Some(n) if sim.cli.honor_max_tokens => n.min(1_000_000) as u32,
        _ => tokens,
    };
    let kv_tokens = prompt.len() as u64 / engine::BYTES_PER_TOKEN + u64::from(tokens);
    // Wait for a slot (and KV room) like llama-server does (FIFO), counted
    // as deferred.
    let running = match sim.engine.try_admit(kv_tokens) {
        Some(r) => r,
        None => {
            let now = sim.deferred.fetch_add(1, Ordering::SeqCst) + 1;
            let _deferred = Deferred(&sim.deferred);
            {
                let mut st = sim.stats.lock().unwrap();
                st.max_deferred = st.max_deferred.max(now);
            }
            sim.engine.admit(kv_tokens).await
        }
    };
    let mut processing = Processing::new(Arc::clone(&sim), running);
    if let Some(name) = &adapter {
        // Loaded first if it is not (its slot held meanwhile).
        processing._adapter = Some(sim.adapters.run(name).await);
    }
    let (prompt_tokens, cached_tokens, prefill) = sim.engine.prefill(&prompt);
    let prompt_tokens = if sim.cli.bytes_per_token == engine::BYTES_PER_TOKEN {
        prompt_tokens
    } else {
        (prompt.len() as u64 / sim.cli.bytes_per_token).max(1)
    };
    let ttft = ttft + prefill;

    match fault {
        Some(Fault::Status(code)) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return full(status, "text/plain", "simulated failure\n".to_string());
        }
        Some(Fault::Reject(code)) => {
            // llama-server's shape for a request it cannot take.
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return json_resp(
                status,
                json!({"error": {"message": "Failed to parse tools: simulated", "type": "server_error", "code": code}}),
            );
        }
        Some(Fault::Hang) => {
            let _hold = processing;
            std::future::pending::<()>().await;
            unreachable!()
        }
        _ => {}
    }

    let id = sim.next_id.fetch_add(1, Ordering::Relaxed);
    let model = adapter.unwrap_or_else(|| sim.cli.model.clone());
    // An engine with a prefix cache says what it reused.
    let said_cached =
        (sim.cli.prefix_cache_tokens > 0 || sim.cli.say_cached_tokens).then_some(cached_tokens);
    let mut resp = if stream {
        // OpenAI's `stream_options.include_usage`: a last chunk with usage.
        let usage = parsed
            .pointer("/stream_options/include_usage")
            .and_then(|v| v.as_bool())
            .unwrap_or(false)
            .then_some((prompt_tokens, said_cached));
        stream_response(
            sim, processing, path, id, model, tokens, ttft, tpot, fault, usage,
        )
    } else {
        let generate = {
            let sim = Arc::clone(&sim);
            async move {
                pause(ttft).await;
                if sim.cli.decode_slowdown > 0.0 {
                    for _ in 1..tokens {
                        pause(sim.engine.tpot(tpot)).await;
                    }
                } else {
                    pause(tpot * tokens.saturating_sub(1)).await;
                }
                sim.tokens_total
                    .fetch_add(u64::from(tokens), Ordering::Relaxed);
                drop(processing);
            }
        };
        if sim.cli.finish_after_disconnect {
            // llama-server finishes a non-streamed answer (its slot stays
            // busy) even when the client has left.
            let _ = tokio::spawn(generate).await;
        } else {
            generate.await;
        }
        let body = final_body(&path, id, &model, tokens, (prompt_tokens, said_cached));
        json_resp(StatusCode::OK, body)
    };
    let h = resp.headers_mut();
    h.insert("x-sim-cached-tokens", HeaderValue::from(cached_tokens));
    h.insert("x-sim-body-bytes", HeaderValue::from(body.len() as u64));
    h.insert("x-sim-body-sha256", HeaderValue::from_str(&digest).unwrap());
    resp
}

/// vLLM's `POST /v1/load_lora_adapter` (`load`) and
/// `/v1/unload_lora_adapter`: `{"lora_name", "lora_path"}`, answered in
/// plain text as vLLM does.
async fn lora_admin(sim: Arc<Sim>, req: Request<Incoming>, load: bool) -> Response<Body> {
    let body = req.into_body().collect().await.map(|b| b.to_bytes());
    let parsed: Option<serde_json::Value> = body.ok().and_then(|b| serde_json::from_slice(&b).ok());
    let Some(name) = parsed.as_ref().and_then(|v| v["lora_name"].as_str()) else {
        return json_resp(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": "lora_name is required", "type": "BadRequestError", "code": 400}}),
        );
    };
    // vLLM reads the adapter from its path: one that is not there fails.
    let path = parsed.as_ref().and_then(|v| v["lora_path"].as_str());
    if load && !path.is_some_and(|p| std::path::Path::new(p).exists()) {
        return json_resp(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": format!("Loading lora {name} failed: No adapter found for {}", path.unwrap_or("")), "type": "BadRequestError", "code": 400}}),
        );
    }
    match (
        load,
        load && sim.adapters.add(name) || !load && sim.adapters.remove(name),
    ) {
        (true, true) => full(
            StatusCode::OK,
            "text/plain",
            format!("Success: LoRA adapter '{name}' added successfully."),
        ),
        (false, true) => full(
            StatusCode::OK,
            "text/plain",
            format!("Success: LoRA adapter '{name}' removed successfully."),
        ),
        (true, false) => json_resp(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": format!("The lora adapter '{name}' has already been loaded."), "type": "InvalidUserInput", "code": 400}}),
        ),
        (false, false) => json_resp(
            StatusCode::NOT_FOUND,
            json!({"error": {"message": format!("The lora adapter '{name}' cannot be found."), "type": "NotFoundError", "code": 404}}),
        ),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn main() {
    let cli = Cli::parse();
    let runtime = if cli.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(cli.threads);
        b
    }
    .enable_all()
    .build()
    .expect("tokio runtime");
    runtime.block_on(serve(cli));
}

async fn serve(cli: Cli) {
    let mut sims = Vec::new();
    let tokenizer = cli.tokenizer.as_deref().map(|dir| {
        Arc::new(flowgate_tokenizer::ModelTokenizer::from_dir(dir).expect("--tokenizer"))
    });
    for i in 0..cli.servers {
        let mut at = cli.listen;
        if at.port() != 0 {
            match u16::try_from(u32::from(at.port()) + i) {
                Ok(port) => at.set_port(port),
                Err(_) => {
                    eprintln!(
                        "llm-sim: {} servers from port {} run past 65535",
                        cli.servers,
                        at.port()
                    );
                    std::process::exit(2);
                }
            }
        }
        let listener = match TcpListener::bind(at).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("llm-sim: cannot listen on {at}: {e}");
                std::process::exit(1);
            }
        };
        let addr = listener.local_addr().expect("local addr");
        println!("listening on {addr}");
        let events = cli
            .kv_events_port
            .map(|_| Arc::new(kv_events::Publisher::default()));
        let sim = Arc::new(Sim {
            engine: Engine::new(
                EngineConfig {
                    slots: cli.slots,
                    kv_capacity_tokens: cli.kv_capacity_tokens,
                    prefix_cache_tokens: cli.prefix_cache_tokens,
                    prefill_per_token: Duration::from_micros(cli.prefill_us_per_token),
                    decode_slowdown: cli.decode_slowdown,
                },
                events.clone(),
            ),
            kv_events: events.clone(),
            tokenizer: tokenizer.clone(),
            cli: cli.clone(),
            server: hyper::header::HeaderValue::from_str(&addr.to_string())
                .expect("a socket address is a header value"),
            started: Instant::now(),
            processing: AtomicU64::new(0),
            deferred: AtomicU64::new(0),
            requests_total: AtomicU64::new(0),
            tokens_total: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
            stats: Mutex::new(Stats::default()),
            adapters: Arc::new(lora::Adapters::new(
                &cli.loras,
                cli.max_loras,
                Duration::from_millis(cli.lora_load_ms),
            )),
        });
        if let (Some(events), Some(first)) = (events, cli.kv_events_port) {
            // Server i publishes on the i-th pair of ports after the first.
            let port = if first == 0 {
                0
            } else {
                first.saturating_add(2 * i as u16)
            };
            let (layout, topic) = (cli.kv_events_layout, cli.kv_events_topic.clone());
            tokio::spawn(kv_events::serve(events, addr.ip(), port, layout, topic));
        }
        sims.push((addr, Arc::clone(&sim)));
        tokio::spawn(accept_loop(listener, sim));
    }
    if let Some(base) = &cli.report_to {
        tokio::spawn(report_loop(
            base.trim_end_matches('/').to_string(),
            cli.clone(),
            sims,
        ));
    }
    std::future::pending::<()>().await;
}

async fn accept_loop(listener: TcpListener, sim: Arc<Sim>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("llm-sim: accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let sim = Arc::clone(&sim);
        tokio::spawn(async move {
            let svc = service_fn(move |req| route(Arc::clone(&sim), req));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
