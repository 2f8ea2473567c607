//! EPP mode: the scheduler behind Envoy's external-processing protocol
//! (`envoy.service.ext_proc.v3.ExternalProcessor`), as the Gateway API
//! Inference Extension's Endpoint Picker Protocol uses it.
//!
//! Envoy opens one `Process` stream per HTTP request. Flowgate reads the
//! request headers (fairness id, objective, priority, TTL) and the buffered
//! body (model, prompt for prefix affinity), holds the request in the same
//! flow control as the proxy, then answers with the chosen endpoint, both as
//! the request header `x-gateway-destination-endpoint` and in the dynamic
//! metadata namespace `envoy.lb` under the same key; Envoy's
//! `ORIGINAL_DST` cluster sends the request there. The endpoint's slot is
//! held until Envoy reports the end of the response (or of the stream).
//!
//! Request body modes (from the stream's `protocol_config`; `BUFFERED` when
//! Envoy sends none):
//! - `BUFFERED` / `BUFFERED_PARTIAL`: the headers are answered CONTINUE, the
//!   answer to the (last) body message carries the destination.
//! - `FULL_DUPLEX_STREAMED`: nothing is answered until the body ended; then
//!   the headers answer carries the destination and the body is streamed
//!   back in 62,000-byte chunks, as the GIE's reference EPP does.
//! - `NONE`, or headers with `end_of_stream`: the request is placed from
//!   its headers alone (no model, no prompt).
//!
//! `STREAMED` request bodies cannot be routed (the headers go upstream
//! before the body is seen) and are treated like `BUFFERED` chunk by chunk:
//! configure Envoy with `BUFFERED` or `FULL_DUPLEX_STREAMED`.
//!
//! Refusals are `ImmediateResponse`s with the proxy's status codes and
//! bodies: 404 unknown model, 429 shed or over a quota, 503 no endpoint (or
//! an empty subset hint), 504 waited past the TTL, 400 / 413 bad requests.
//!
//! Quotas hold as at the proxy, reserved before the request waits. When
//! Envoy sends response bodies, their `usage` settles the quotas and the
//! token-fair charge and is accounted (`/api/v1/usage`), as at the proxy;
//! without them a served request counts its estimate.
//!
//! The rooms: [`exchange`] answers one request's stream (the state machine),
//! [`wire`] builds Envoy's messages.

mod exchange;
mod wire;

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::door::Door;

/// Request header (and `envoy.lb` metadata key) naming the chosen endpoint.
use exchange::Exchange;

pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Dynamic metadata namespace Envoy's load balancer reads.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Filter metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset hint: a list of `ip:port` (or bare `ip`) strings.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Size of the body chunks streamed back in `FULL_DUPLEX_STREAMED` mode.
const BODY_CHUNK: usize = 62_000;
/// Names the gRPC health service reports as serving.
const HEALTH_NAMES: [&str; 3] = [
    "liveness",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

/// The EPP gRPC service, sharing the proxy's state.
pub struct Epp {
    /// The way in every door shares (API keys in `authorization`, as
    /// Envoy passes it on; the rules, quotas and session store as at the
    /// proxy).
    pub door: Door,
    pub max_request_bytes: usize,
    pub retry_after: std::time::Duration,
    /// `flowgate_epp_requests_total`: `picked`, or why the request was
    /// answered by Flowgate itself ([`decisions_metric`]).
    pub decisions: prometheus::IntCounterVec,
}

/// `flowgate_epp_requests_total`, registered with the balancer's metrics.
pub fn decisions_metric(metrics: &crate::observe::metrics::Metrics) -> prometheus::IntCounterVec {
    let decisions = prometheus::IntCounterVec::new(
        prometheus::Opts::new(
            "flowgate_epp_requests_total",
            "EPP mode requests by outcome: picked (an endpoint was chosen) or the reason \
             Flowgate answered itself",
        ),
        &["outcome"],
    )
    .expect("valid metric");
    metrics.register(Box::new(decisions.clone()));
    decisions
}

type Reply = Result<ProcessingResponse, Status>;

/// The gRPC face of [`Epp`].
pub struct Processor(pub Arc<Epp>);

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = ReceiverStream<Reply>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // Envoy waits for each answer before it sends more, except in
        // full-duplex mode where the body is echoed back chunk by chunk.
        let (tx, rx) = mpsc::channel(8);
        let exchange = Exchange::new(Arc::clone(&self.0), tx);
        tokio::spawn(exchange.run(request.into_inner()));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The request headers admission reads (flow control's and
/// `authorization`), lower-cased names with their values.
pub async fn serve(
    epp: Arc<Epp>,
    addr: SocketAddr,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let (health, health_service) = tonic_health::server::health_reporter();
    for name in HEALTH_NAMES {
        health
            .set_service_status(name, tonic_health::ServingStatus::Serving)
            .await;
    }
    // Envoy buffers the whole body into one message.
    let max_message = epp.max_request_bytes.saturating_add(64 * 1024);
    let processor =
        ExternalProcessorServer::new(Processor(epp)).max_decoding_message_size(max_message);
    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(processor)
        .serve_with_shutdown(addr, shutdown)
        .await
}
