//! llm-sim's flags.

use std::net::SocketAddr;

use clap::Parser;

/// A fake llama-server for tests and benchmarks.
#[derive(Debug, Clone, Parser)]
#[command(name = "llm-sim", version, about)]
pub(crate) struct Cli {
    /// Address to listen on (port 0 picks a free port; the chosen address is
    /// printed as `listening on IP:PORT`)
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) listen: SocketAddr,
    /// Simulated servers in this process, each on its own port (`--listen`'s
    /// port and the next ones; port 0: free ports), each with its own slots,
    /// cache and counters: a whole fleet on one machine
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub(crate) servers: u32,
    /// Report every server to this balancer's management API
    /// (`http://HOST:PORT`) as its agent would, so a fleet of `--servers`
    /// needs no agent processes: slots, busy slots and waiting requests
    #[arg(long)]
    pub(crate) report_to: Option<String>,
    /// Milliseconds between two reports of one server (`--report-to`)
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(50..=60_000))]
    pub(crate) report_interval_ms: u64,
    /// Bearer token of the balancer's management API (`--report-to`)
    #[arg(long, env = "FLOWGATE_MANAGEMENT_TOKEN", hide_env_values = true)]
    pub(crate) management_token: Option<String>,
    /// Parallel request slots
    #[arg(long, default_value_t = 4)]
    pub(crate) slots: u32,
    /// Model id served
    #[arg(long, default_value = "sim-model")]
    pub(crate) model: String,
    /// Bytes of prompt text per prompt token in the `usage` it reports
    /// (its tokenizer, as far as a balancer learning ratios can tell)
    #[arg(long, default_value_t = crate::engine::BYTES_PER_TOKEN, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) bytes_per_token: u64,
    /// Answer 404 `model_not_found` to a request whose `model` is another
    /// name, as vLLM does (llama-server answers any name)
    #[arg(long)]
    pub(crate) strict_model: bool,
    /// Milliseconds to first token
    #[arg(long, default_value_t = 20)]
    pub(crate) ttft_ms: u64,
    /// Milliseconds per further output token
    #[arg(long, default_value_t = 5)]
    pub(crate) tpot_ms: u64,
    /// Output tokens per request
    #[arg(long, default_value_t = 8)]
    pub(crate) output_tokens: u32,
    /// Generate as many tokens as the request's `max_tokens` (or
    /// `max_completion_tokens`) asks, instead of --output-tokens
    #[arg(long)]
    pub(crate) honor_max_tokens: bool,
    /// Milliseconds after start during which /health answers 503 (loading)
    #[arg(long, default_value_t = 0)]
    pub(crate) loading_ms: u64,
    /// Fault applied to every inference request unless a header says
    /// otherwise: status=CODE, hang, drop-mid-stream, slow-stream
    #[arg(long)]
    pub(crate) fault: Option<String>,
    /// Worker threads (1 = a single core)
    #[arg(long, default_value_t = 1)]
    pub(crate) threads: usize,
    /// Which engine's monitoring API to speak: llamacpp (`/slots`, `/props`,
    /// `llamacpp:*` metrics), vllm (`vllm:*` metrics) or sglang (`sglang:*`
    /// metrics); vllm and sglang have no `/slots` or `/props`
    #[arg(long, value_enum, default_value = "llamacpp")]
    pub(crate) engine: EngineKind,
    /// KV-cache capacity in tokens (prompt + output of the running
    /// requests); a request that does not fit waits. 0: unlimited. With vllm
    /// and sglang the KV gauge reports its use
    #[arg(long, value_name = "TOKENS", default_value_t = 0)]
    pub(crate) kv_capacity_tokens: u64,
    /// Prefix cache capacity in tokens (least recently used forgotten);
    /// cached prompt tokens cost no prefill time. 0: no cache
    #[arg(long, value_name = "TOKENS", default_value_t = 0)]
    pub(crate) prefix_cache_tokens: u64,
    /// Say `cached_tokens` in every answer's usage even without a prefix
    /// cache (then always 0), as vLLM with `--enable-prompt-tokens-details`
    /// and prefix caching off does
    #[arg(long)]
    pub(crate) say_cached_tokens: bool,
    /// Microseconds of prefill per uncached prompt token (4 bytes = 1 token),
    /// added to the time to first token
    #[arg(long, value_name = "US", default_value_t = 0)]
    pub(crate) prefill_us_per_token: u64,
    /// Decode slowdown per extra running request: each token takes
    /// tpot × (1 + F × (running − 1))
    #[arg(long, value_name = "F", default_value_t = 0.0)]
    pub(crate) decode_slowdown: f64,
    /// Finish a non-streamed answer (its slot busy) even after its client
    /// left, as llama-server does
    #[arg(long)]
    pub(crate) finish_after_disconnect: bool,
    /// LoRA adapters of `--model` it can serve (repeatable, or a comma-
    /// separated list): a request naming one as its `model` is served once
    /// the adapter is loaded, as vLLM serves them (`/v1/models` lists each
    /// with its `parent`; `POST /v1/load_lora_adapter` adds more)
    #[arg(long = "lora", value_name = "NAME", value_delimiter = ',')]
    pub(crate) loras: Vec<String>,
    /// Adapters loaded at once at most (vLLM's `--max-loras`); loading one
    /// more evicts the least recently used adapter no request runs on
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub(crate) max_loras: u32,
    /// Publish KV-cache events from the prefix cache as vLLM and SGLang do,
    /// on a ZeroMQ PUB socket at this port of `--listen`'s address (its
    /// replay socket on the next port; 0: free ports, printed as `kv
    /// events on tcp://IP:PORT replay tcp://IP:PORT`; with `--servers`, each
    /// server the next pair of ports)
    #[arg(long, value_name = "PORT")]
    pub(crate) kv_events_port: Option<u16>,
    /// The events' layout: vLLM's tagged maps, its older positional
    /// arrays, or SGLang's
    #[arg(long, value_enum, default_value = "tagged")]
    pub(crate) kv_events_layout: KvLayout,
    /// The events' topic
    #[arg(long, default_value = "")]
    pub(crate) kv_events_topic: String,
    /// Count prompts in this model's tokens (a Hugging Face snapshot
    /// directory, as the balancer's `--tokenizer`): the prefix cache, its
    /// events and `/tokenize` then go by the rendered chat's token ids
    /// instead of a token per 4 bytes of text
    #[arg(long, value_name = "DIR")]
    pub(crate) tokenizer: Option<std::path::PathBuf>,
    /// Milliseconds an adapter takes to load, its requests waiting
    #[arg(long, value_name = "MS", default_value_t = 500)]
    pub(crate) lora_load_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum EngineKind {
    Llamacpp,
    Vllm,
    Sglang,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum KvLayout {
    Tagged,
    Positional,
    Sglang,
}
