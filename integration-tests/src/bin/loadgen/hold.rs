//! `loadgen hold`: many requests at once, each on its own connection.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};

#[derive(Debug, clap::Args)]
pub struct HoldArgs {
    /// Router base URL, e.g. http://127.0.0.1:8061
    #[arg(long)]
    pub target: String,
    /// Requests to send, each on its own connection
    #[arg(long, default_value_t = 10_000)]
    pub requests: usize,
    /// Size of each request body
    #[arg(long, default_value_t = 1024)]
    pub body_bytes: usize,
    /// Microseconds between two sends, so they arrive in order (tokio's
    /// timer rounds up to whole milliseconds)
    #[arg(long, default_value_t = 1000)]
    pub pace_us: u64,
    /// A Flowgate management URL (`http://HOST:PORT`): before sending the
    /// next request, wait until the balancer reports this one buffered
    /// (`buffered_requests` in `/api/v1/agents`), so the order the requests
    /// joined its queue is exactly the order they were sent
    #[arg(long)]
    pub confirm_buffered: Option<String>,
}

/// `buffered_requests` from a balancer's `/api/v1/agents` at `url`.
async fn buffered_requests(client: &reqwest::Client, url: &str) -> Option<u64> {
    let v: Value = client.get(url).send().await.ok()?.json().await.ok()?;
    v["buffered_requests"].as_u64()
}

/// Sends `requests` non-streamed chats, each on its own connection and
/// tagged with its index (`x-sim-tag`), waits for all, and prints one JSON
/// line: answers by status and seconds until the last one.
pub async fn hold(args: HoldArgs) {
    let url = format!("{}/v1/chat/completions", args.target.trim_end_matches('/'));
    // Pad the prompt so the whole body is `body_bytes` long.
    let empty = json!({"messages": [{"role": "user", "content": ""}]}).to_string();
    let pad = "x".repeat(args.body_bytes.saturating_sub(empty.len()));
    let body = Bytes::from(json!({"messages": [{"role": "user", "content": pad}]}).to_string());
    let start = Instant::now();
    let agents_url = args
        .confirm_buffered
        .as_ref()
        .map(|m| format!("{}/api/v1/agents", m.trim_end_matches('/')));
    let poller = reqwest::Client::new();
    let base = match &agents_url {
        Some(url) => buffered_requests(&poller, url)
            .await
            .expect("the management URL answers /api/v1/agents"),
        None => 0,
    };
    let mut tasks = Vec::with_capacity(args.requests);
    for i in 0..args.requests {
        // One client per request: a connection of its own, as real
        // clients waiting for an answer each hold one.
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .expect("http client");
        let req = client
            .post(&url)
            .header("content-type", "application/json")
            .header("x-sim-tag", i.to_string())
            .body(body.clone());
        tasks.push(tokio::spawn(async move {
            match req.send().await {
                Ok(r) => {
                    let code = r.status().as_u16();
                    let _ = r.bytes().await;
                    code
                }
                Err(_) => 0,
            }
        }));
        match &agents_url {
            Some(url) => {
                let want = base + i as u64 + 1;
                let deadline = Instant::now() + Duration::from_secs(10);
                while buffered_requests(&poller, url).await.unwrap_or(0) < want {
                    assert!(
                        Instant::now() < deadline,
                        "request {i} was not buffered within 10 s"
                    );
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
            }
            None => tokio::time::sleep(Duration::from_micros(args.pace_us)).await,
        }
    }
    let mut statuses: BTreeMap<String, u64> = BTreeMap::new();
    for t in tasks {
        let code = t.await.unwrap_or(0);
        *statuses.entry(code.to_string()).or_default() += 1;
    }
    println!(
        "{}",
        json!({"requests": args.requests, "statuses": statuses,
               "seconds": start.elapsed().as_secs_f64()})
    );
}
