//! `loadgen epp`: EPP decision latency under load. Plays Envoy's side of
//! the external-processing protocol against a balancer's `--epp-addr`,
//! open loop at a fixed rate: per request one bidirectional `Process`
//! stream, as Envoy opens one per HTTP request, on a few shared HTTP/2
//! connections, as Envoy multiplexes them.
//!
//! Per request: request headers (fairness id, TTL), answered CONTINUE;
//! the buffered body (model, a tenant's system prompt plus a unique
//! question, so the prefix scorer has work), answered with the
//! destination. The decision latency is from opening the stream to that
//! answer, what Envoy waits before it can send the request upstream. The
//! "upstream" then answers after `--hold-ms` (response headers, then a
//! body with `usage` that ends the response), which is when the slot is
//! given back, as Envoy would report it.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_response, ProcessingRequest, ProcessingResponse,
};
use flowgate_integration_tests::envoy::{
    body_message, request_headers, response_body, response_headers,
};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;

use super::{pct_or_nan, sorted, system_prompt, Rng};

/// The header (and `envoy.lb` key) that names the chosen endpoint.
const DESTINATION: &str = "x-gateway-destination-endpoint";

#[derive(Debug, clap::Args)]
pub struct EppArgs {
    /// The balancer's EPP address (its `--epp-addr`), e.g.
    /// http://127.0.0.1:9002
    #[arg(long)]
    target: String,
    /// Requests per second, evenly spaced (open loop: a slow answer does
    /// not delay the next request)
    #[arg(long, default_value_t = 500.0)]
    qps: f64,
    /// Seconds to send for
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// HTTP/2 connections the streams are spread over (Envoy keeps one per
    /// worker thread)
    #[arg(long, default_value_t = 2)]
    connections: usize,
    /// Tenants (fairness ids), each its own flow, taking turns
    #[arg(long, default_value_t = 100)]
    tenants: usize,
    /// Distinct system prompts; tenant i uses prompt i % this, so requests
    /// share prefixes the prefix scorer can find
    #[arg(long, default_value_t = 16)]
    system_prompts: usize,
    /// Size of each system prompt, in repetitions of a 52-byte rule
    #[arg(long, default_value_t = 20)]
    system_repeat: usize,
    /// How long the upstream takes to answer once the destination is
    /// known: the slot is held that long
    #[arg(long, default_value_t = 20)]
    hold_ms: u64,
    /// The requests' `model` field
    #[arg(long, default_value = "sim-model")]
    model: String,
}

/// How one request's decision ended.
enum Decision {
    /// An endpoint was chosen after this long.
    Picked(Duration, String),
    /// Flowgate answered itself (an `ImmediateResponse` with this status).
    Refused(u16),
    /// The stream failed (a gRPC error, or an answer Envoy would not expect).
    Failed(String),
}

#[derive(Default)]
struct Tally {
    latency_ms: Vec<f64>,
    destinations: HashSet<String>,
    refused: BTreeMap<u16, u64>,
    failed: BTreeMap<String, u64>,
}

pub async fn epp(args: EppArgs) {
    if !(args.qps > 0.0 && args.qps.is_finite()) || args.connections == 0 || args.tenants == 0 {
        eprintln!("loadgen epp: --qps, --connections and --tenants must be positive");
        std::process::exit(2);
    }
    let mut channels = Vec::new();
    for _ in 0..args.connections {
        let channel = Channel::from_shared(args.target.clone())
            .unwrap_or_else(|e| {
                eprintln!("loadgen epp: bad --target: {e}");
                std::process::exit(2)
            })
            .connect()
            .await
            .unwrap_or_else(|e| {
                eprintln!("loadgen epp: cannot connect to {}: {e}", args.target);
                std::process::exit(1)
            });
        channels.push(channel);
    }
    let prompts: Arc<Vec<String>> = Arc::new(
        (0..args.system_prompts.max(1))
            .map(|k| system_prompt(k, args.system_repeat))
            .collect(),
    );
    let tally = Arc::new(Mutex::new(Tally::default()));
    let gap = Duration::from_secs_f64(1.0 / args.qps);
    let start = Instant::now();
    let until = start + Duration::from_secs(args.seconds);
    let hold = Duration::from_millis(args.hold_ms);
    let mut rng = Rng(0x5EED);
    let mut inflight = Vec::new();
    let mut next = start;
    let mut n = 0u64;
    while next < until {
        tokio::time::sleep_until(next.into()).await;
        next += gap;
        let tenant = n as usize % args.tenants;
        let body = json!({
            "model": args.model,
            "max_tokens": 16,
            "messages": [
                {"role": "system", "content": prompts[tenant % prompts.len()]},
                {"role": "user", "content": format!("question {n} ({})", rng.below(1 << 40))},
            ],
        });
        let channel = channels[n as usize % channels.len()].clone();
        let tally = Arc::clone(&tally);
        n += 1;
        inflight.push(tokio::spawn(async move {
            let decision = one_request(channel, &format!("tenant-{tenant}"), body, hold).await;
            let mut t = tally.lock().unwrap();
            match decision {
                Decision::Picked(d, to) => {
                    t.latency_ms.push(d.as_secs_f64() * 1000.0);
                    t.destinations.insert(to);
                }
                Decision::Refused(status) => *t.refused.entry(status).or_default() += 1,
                Decision::Failed(why) => *t.failed.entry(why).or_default() += 1,
            }
        }));
    }
    let sending = start.elapsed().as_secs_f64();
    for task in inflight {
        let _ = task.await;
    }
    let t = tally.lock().unwrap();
    let latency = sorted(&t.latency_ms);
    let p = |q| pct_or_nan(&latency, q);
    println!(
        "{}",
        json!({
            "qps_asked": args.qps,
            "qps_sent": n as f64 / sending,
            "sent": n,
            "picked": latency.len(),
            "destinations": t.destinations.len(),
            "refused": t.refused,
            "failed": t.failed,
            "decision_ms": {"p50": p(0.50), "p95": p(0.95), "p99": p(0.99),
                            "max": latency.last().copied().unwrap_or(f64::NAN)},
        })
    );
}

/// One request's stream, from headers to the end of the response.
async fn one_request(
    channel: Channel,
    tenant: &str,
    body: serde_json::Value,
    hold: Duration,
) -> Decision {
    let (tx, rx) = mpsc::channel(4);
    let opened = Instant::now();
    // Queued before the stream opens: Envoy sends the headers at once.
    let headers = request_headers(
        &[
            ("x-gateway-inference-fairness-id", tenant),
            ("x-flowgate-request-ttl", "30s"),
        ],
        false,
    );
    let _ = tx.send(headers).await;
    let rx = match ExternalProcessorClient::new(channel)
        .process(ReceiverStream::new(rx))
        .await
    {
        Ok(r) => r.into_inner(),
        Err(e) => return Decision::Failed(format!("open: {}", e.code())),
    };
    let mut exchange = Exchange { tx, rx };
    match exchange.ask(None).await {
        Ok(processing_response::Response::RequestHeaders(_)) => {}
        Ok(other) => return settled_early(other),
        Err(why) => return Decision::Failed(why),
    }
    let body = body_message(body.to_string().into_bytes(), true);
    let to = match exchange.ask(Some(body)).await {
        Ok(processing_response::Response::RequestBody(b)) => b
            .response
            .and_then(|c| c.header_mutation)
            .and_then(|m| {
                m.set_headers
                    .into_iter()
                    .filter_map(|h| h.header)
                    .find(|h| h.key == DESTINATION)
            })
            .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned()),
        Ok(other) => return settled_early(other),
        Err(why) => return Decision::Failed(why),
    };
    let decided = opened.elapsed();
    let Some(to) = to else {
        return Decision::Failed("no destination".into());
    };
    // The upstream answers; Envoy reports its response, which ends the
    // request's hold on the slot.
    tokio::time::sleep(hold).await;
    let answer = json!({"usage": {"prompt_tokens": 300, "completion_tokens": 16}});
    for m in [
        response_headers(200, false),
        response_body(answer.to_string().into_bytes(), true),
    ] {
        if let Err(why) = exchange.ask(Some(m)).await {
            return Decision::Failed(format!("response: {why}"));
        }
    }
    Decision::Picked(decided, to)
}

/// One stream: send a message (or none, when it was queued already) and
/// wait for the next answer. Envoy sends one message at a time and waits.
struct Exchange {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Exchange {
    async fn ask(
        &mut self,
        message: Option<ProcessingRequest>,
    ) -> Result<processing_response::Response, String> {
        if let Some(m) = message {
            self.tx
                .send(m)
                .await
                .map_err(|_| "stream closed".to_string())?;
        }
        match self.rx.message().await {
            Ok(Some(ProcessingResponse {
                response: Some(r), ..
            })) => Ok(r),
            Ok(Some(_)) => Err("an empty answer".into()),
            Ok(None) => Err("stream ended".into()),
            Err(status) => Err(format!("grpc {}", status.code())),
        }
    }
}

/// An answer before the destination: an immediate response is a refusal.
fn settled_early(r: processing_response::Response) -> Decision {
    match r {
        processing_response::Response::ImmediateResponse(i) => {
            Decision::Refused(i.status.map_or(0, |s| s.code as u16))
        }
        other => Decision::Failed(format!("unexpected answer: {other:?}")),
    }
}
