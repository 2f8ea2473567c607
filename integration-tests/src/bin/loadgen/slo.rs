//! `loadgen slo`: two classes of open-loop traffic at a total request rate
//! (Poisson arrivals), streamed: interactive requests with a latency
//! objective (sent as `x-slo-ttft-ms` / `x-slo-tpot-ms` with `--objectives`)
//! and batch requests with none (objective `batch`, which the bench maps to
//! priority −1). Prompts of random length, nothing shared. Prints one JSON
//! line: the interactive class's attainment (met both parts, of those sent:
//! a refusal or an error is a miss), the goodput (interactive requests a
//! second that met their objective), the batch class's throughput, TTFT
//! percentiles and errors by status (`scripts/bench/objectives`). Every
//! request sent is waited for; the rates are over the whole run, from the
//! first send to the last answer.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::json;

use super::{last_usage, pct_or_nan, sorted, Rng};

#[derive(Debug, clap::Args)]
pub struct SloArgs {
    /// The router's base URL
    #[arg(long)]
    target: String,
    /// Seconds to send for (every answer is waited for)
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Requests a second, both classes together
    #[arg(long)]
    rate: f64,
    /// Share of the requests that are interactive
    #[arg(long, default_value_t = 0.5)]
    interactive_share: f64,
    /// The interactive class's objective, milliseconds
    #[arg(long, default_value_t = 500)]
    ttft_ms: u64,
    #[arg(long, default_value_t = 50)]
    tpot_ms: u64,
    /// Send the objective in headers (else it is only measured)
    #[arg(long)]
    objectives: bool,
    /// Prompt length range, in tokens (4 bytes each)
    #[arg(long, default_value_t = 200)]
    prompt_min: u64,
    #[arg(long, default_value_t = 4000)]
    prompt_max: u64,
    /// `max_tokens` of each class
    #[arg(long, default_value_t = 32)]
    interactive_tokens: u32,
    #[arg(long, default_value_t = 128)]
    batch_tokens: u32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write one JSON line per request to this file: its class, prompt
    /// tokens, when it was sent (seconds into the run), its TTFT, TPOT and
    /// whether it met its objective, or the status that refused it, and
    /// where it went and how long it waited in the balancer (the request
    /// asks `x-flowgate-debug: scores`; the balancer must allow it)
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
}

#[derive(Default)]
struct Class {
    sent: u64,
    ok: u64,
    met: u64,
    completion_tokens: u64,
    ttft: Vec<f64>,
    errors: BTreeMap<u16, u64>,
}

/// What one streamed answer showed: TTFT, TPOT, completion tokens.
async fn stream(
    req: reqwest::RequestBuilder,
    went: &mut serde_json::Value,
) -> Result<(f64, f64, u64), u16> {
    let sent = Instant::now();
    let resp = req.send().await.map_err(|_| 0u16)?;
    if !resp.status().is_success() {
        return Err(resp.status().as_u16());
    }
    let header = |name| resp.headers().get(name).and_then(|v| v.to_str().ok());
    if let Some(scores) = header("x-flowgate-scores") {
        went["endpoint"] = serde_json::from_str::<serde_json::Value>(scores)
            .map(|v| v["endpoint"].clone())
            .unwrap_or_default();
    }
    if let Some(wait) = header("x-flowgate-wait-ms").and_then(|v| v.parse::<u64>().ok()) {
        went["wait_ms"] = json!(wait);
    }
    let mut body = resp.bytes_stream();
    let (mut first, mut text) = (None, Vec::new());
    while let Some(chunk) = body.next().await {
        let c = chunk.map_err(|_| 0u16)?;
        if first.is_none() && !c.is_empty() {
            first = Some(sent.elapsed());
        }
        text.extend_from_slice(&c);
    }
    let first = first.ok_or(0u16)?;
    let total = sent.elapsed();
    let tokens = last_usage(&text).map_or(0, |(_, completion)| completion);
    let tpot = if tokens >= 2 {
        (total - first).as_secs_f64() / (tokens - 1) as f64
    } else {
        0.0
    };
    Ok((first.as_secs_f64(), tpot, tokens))
}

pub async fn slo(args: SloArgs) {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .build()
        .expect("http client");
    let url = format!("{}/v1/chat/completions", args.target.trim_end_matches('/'));
    let classes: Arc<Mutex<[Class; 2]>> = Arc::default();
    let trace: Arc<Mutex<Vec<String>>> = Arc::default();
    let start = Instant::now();
    let until = start + Duration::from_secs(args.seconds);
    let mut rng = Rng(args.seed.max(1));
    let (ttft_limit, tpot_limit) = (args.ttft_ms as f64 / 1e3, args.tpot_ms as f64 / 1e3);
    let mut inflight = Vec::new();
    let mut next = start;
    let mut n = 0u64;
    loop {
        // Exponential gaps: a Poisson process of `rate` a second.
        let u = (rng.below(1 << 30) as f64 + 1.0) / (1u64 << 30) as f64;
        next += Duration::from_secs_f64(-u.ln() / args.rate);
        if next >= until {
            break;
        }
        tokio::time::sleep_until(next.into()).await;
        n += 1;
        let interactive = (rng.below(1_000) as f64) < args.interactive_share * 1_000.0;
        let tokens = args.prompt_min + rng.below(args.prompt_max - args.prompt_min + 1);
        let filler = "lorem ipsum dolor sit amet ".repeat((tokens as usize * 4) / 27 + 1);
        let content = format!("{n} {}", &filler[..tokens as usize * 4]);
        let max_tokens = if interactive {
            args.interactive_tokens
        } else {
            args.batch_tokens
        };
        let mut req = client
            .post(&url)
            .header("x-flowgate-request-ttl", "60s")
            .json(&json!({"model": "sim-model", "stream": true,
                "stream_options": {"include_usage": true}, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": content}]}));
        if interactive {
            req = req.header("x-gateway-inference-fairness-id", "interactive");
            if args.objectives {
                req = req
                    .header("x-slo-ttft-ms", args.ttft_ms.to_string())
                    .header("x-slo-tpot-ms", args.tpot_ms.to_string());
            }
        } else {
            req = req
                .header("x-gateway-inference-fairness-id", "batch")
                .header("x-gateway-inference-objective", "batch");
        }
        if args.trace.is_some() {
            req = req.header("x-flowgate-debug", "scores");
        }
        let class = usize::from(!interactive);
        classes.lock().unwrap()[class].sent += 1;
        let (classes, trace) = (Arc::clone(&classes), Arc::clone(&trace));
        let (sent_s, tracing) = ((next - start).as_secs_f64(), args.trace.is_some());
        inflight.push(tokio::spawn(async move {
            let mut line = json!({"class": if interactive { "interactive" } else { "batch" },
                "prompt_tokens": tokens, "sent_s": sent_s});
            let outcome = stream(req, &mut line).await;
            let mut all = classes.lock().unwrap();
            let c = &mut all[class];
            match outcome {
                Ok((ttft, tpot, tokens)) => {
                    let met = ttft <= ttft_limit && tpot <= tpot_limit;
                    c.ok += 1;
                    c.completion_tokens += tokens;
                    c.ttft.push(ttft);
                    c.met += u64::from(met);
                    line["ttft_s"] = json!(ttft);
                    line["tpot_s"] = json!(tpot);
                    line["met"] = json!(met);
                }
                Err(code) => {
                    *c.errors.entry(code).or_default() += 1;
                    line["status"] = json!(code);
                }
            }
            if tracing {
                trace.lock().unwrap().push(line.to_string());
            }
        }));
    }
    // Every request sent is waited for (its TTL bounds it): one cut short
    // at the end would count as a miss it was not.
    for t in inflight {
        let _ = t.await;
    }
    let secs = start.elapsed().as_secs_f64();
    if let Some(path) = &args.trace {
        let lines = trace.lock().unwrap();
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(path, text).expect("write the trace");
    }
    let all = classes.lock().unwrap();
    let report = |c: &Class| {
        let ttft = sorted(&c.ttft);
        let p = |q| pct_or_nan(&ttft, q);
        let errors: BTreeMap<String, u64> =
            c.errors.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        json!({"sent": c.sent, "ok": c.ok, "met": c.met,
               "attainment": c.met as f64 / c.sent.max(1) as f64,
               "requests_per_s": c.ok as f64 / secs,
               "tokens_per_s": c.completion_tokens as f64 / secs,
               "ttft_p50_s": p(0.5), "ttft_p90_s": p(0.9), "ttft_p99_s": p(0.99),
               "errors": errors})
    };
    println!(
        "{}",
        json!({"seconds": secs, "rate": args.rate,
               "goodput": all[0].met as f64 / secs,
               "interactive": report(&all[0]), "batch": report(&all[1])})
    );
}
