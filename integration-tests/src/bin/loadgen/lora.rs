//! `loadgen lora`: closed-loop clients, each request for one of many LoRA
//! adapters of one base model, drawn Zipf-popular (a few hot adapters, a
//! long tail), streamed; prints one JSON line: throughput, TTFT p50/p99,
//! errors (`scripts/bench/lora`, which counts the engines' loads).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use super::{first_byte, pct, sorted, Rng};

#[derive(Debug, clap::Args)]
pub struct LoraArgs {
    /// The router's chat completions URL
    #[arg(long)]
    target: String,
    /// Seconds to send for
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Concurrent clients (closed loop)
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Adapters, named `{prefix}{i}` for i in 1..=adapters
    #[arg(long, default_value_t = 32)]
    adapters: usize,
    #[arg(long, default_value = "adapter-")]
    prefix: String,
    /// Zipf exponent of the adapters' popularity (adapter i drawn with
    /// weight 1 / i^s)
    #[arg(long, default_value_t = 1.1)]
    zipf: f64,
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Cumulative weights of a Zipf law over `n` ranks.
fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let mut cdf = Vec::with_capacity(n);
    let mut sum = 0.0;
    for i in 1..=n {
        sum += 1.0 / (i as f64).powf(s);
        cdf.push(sum);
    }
    cdf.iter_mut().for_each(|c| *c /= sum);
    cdf
}

#[derive(Default)]
struct Samples {
    ttft: Vec<f64>,
    errors: u64,
}

pub async fn lora(args: LoraArgs) {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .expect("http client");
    let cdf = Arc::new(zipf_cdf(args.adapters.max(1), args.zipf));
    let samples = Arc::new(Mutex::new(Samples::default()));
    let start = Instant::now();
    let until = start + Duration::from_secs(args.seconds);
    let args = Arc::new(args);
    let tasks: Vec<_> = (0..args.clients)
        .map(|c| {
            let (client, cdf, samples, args) = (
                client.clone(),
                Arc::clone(&cdf),
                Arc::clone(&samples),
                Arc::clone(&args),
            );
            tokio::spawn(async move {
                let mut rng = Rng(args.seed.wrapping_mul(0x9E37_79B9) ^ (c as u64 + 1) | 1);
                let mut n = 0u64;
                while Instant::now() < until {
                    let u = rng.below(1 << 30) as f64 / f64::from(1u32 << 30);
                    let rank = cdf.partition_point(|&x| x < u).min(cdf.len() - 1) + 1;
                    let body = json!({
                        "model": format!("{}{rank}", args.prefix),
                        "stream": true,
                        "max_tokens": args.max_tokens,
                        "messages": [{"role": "user", "content": format!("client {c} request {n}")}],
                    });
                    n += 1;
                    let sent = Instant::now();
                    let ttft = match client.post(&args.target).json(&body).send().await {
                        Ok(resp) if resp.status().is_success() => first_byte(resp, sent).await,
                        _ => None,
                    };
                    let mut s = samples.lock().unwrap();
                    match ttft {
                        Some(t) if Instant::now() <= until => s.ttft.push(t),
                        Some(_) => {}
                        None => s.errors += 1,
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    let s = samples.lock().unwrap();
    let ttft = sorted(&s.ttft);
    let (p50, p99) = if ttft.is_empty() {
        (0.0, 0.0)
    } else {
        (pct(&ttft, 0.5), pct(&ttft, 0.99))
    };
    println!(
        "{}",
        json!({
            "requests": ttft.len(),
            "req_per_s": ttft.len() as f64 / args.seconds as f64,
            "ttft_p50_s": p50,
            "ttft_p99_s": p99,
            "errors": s.errors,
        })
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_is_skewed_and_sums_to_one() {
        let cdf = zipf_cdf(32, 1.1);
        assert!((cdf[31] - 1.0).abs() < 1e-12);
        // The most popular adapter alone draws about a quarter.
        assert!((0.2..0.3).contains(&cdf[0]), "{}", cdf[0]);
        assert!(cdf.windows(2).all(|w| w[1] > w[0]));
    }
}
