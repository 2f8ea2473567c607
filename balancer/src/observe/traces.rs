//! OpenTelemetry traces of the inference port, over OTLP/HTTP (protobuf).
//!
//! Off unless an endpoint is configured (`--otlp-endpoint`, or the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`).
//! Each request gets one span, `flowgate.request`, child of the client's
//! W3C `traceparent` (and `tracestate`) when it sent one, with children
//! for what happened to it: `admission`, `queue.wait` (its flow, priority
//! and the requests waiting ahead when it arrived), `endpoint.choice` (the
//! endpoint and its score) and `upstream` (the call to the engine, with its
//! time to first byte), whose context is sent on to the engine in
//! `traceparent`. Sampling is parent-based: a client's sampling decision
//! holds; a trace the balancer starts is kept with the configured ratio.
//!
//! Never slows a request: spans are handed to the SDK's batch processor
//! (a bounded queue, drained by its own thread; spans beyond it are
//! dropped), and the export runs on a small runtime of its own with a
//! timeout, so a collector that is down or slow costs the request path
//! nothing but the spans.

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    Span as _, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_http::{Bytes, HeaderExtractor, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};
use opentelemetry_sdk::Resource;

/// Spans waiting for export at most; beyond it new spans are dropped.
const MAX_QUEUED_SPANS: usize = 8_192;
/// The longest an export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where and how traces are sent.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSettings {
    /// The OTLP/HTTP traces URL (`…/v1/traces`).
    pub endpoint: String,
    /// Share of the traces the balancer starts that are kept (0 to 1).
    pub sample_ratio: f64,
    /// A client's sampling decision (its `traceparent`) holds.
    pub parent_based: bool,
}

impl TraceSettings {
    /// The traces URL for an endpoint as configured: a base URL (nothing
    /// after the host, as `OTEL_EXPORTER_OTLP_ENDPOINT` is) gets
    /// `/v1/traces`; a URL with a path is used as it is. Only `http` and
    /// `https` URLs are taken.
    pub fn traces_url(endpoint: &str) -> Result<String, String> {
        let url: http::Uri = endpoint
            .parse()
            .map_err(|e| format!("OTLP endpoint {endpoint:?} is not a URL: {e}"))?;
        if !matches!(url.scheme_str(), Some("http" | "https")) || url.host().is_none() {
            return Err(format!(
                "OTLP endpoint {endpoint:?} must be an http:// or https:// URL"
            ));
        }
        Ok(if matches!(url.path(), "" | "/") {
            format!("{}/v1/traces", endpoint.trim_end_matches('/'))
        } else {
            endpoint.to_string()
        })
    }
}

/// The exporter's HTTP client: the balancer's reqwest, run on the traces'
/// own runtime (the SDK's batch thread has none).
#[derive(Debug)]
struct ExportClient {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let request = reqwest::Request::try_from(request)?;
        let client = self.client.clone();
        let sent = self.runtime.spawn(async move {
            let response = client.execute(request).await?;
            let mut out = Response::builder().status(response.status());
            let body = response.bytes().await?;
            out = out.header("content-length", body.len());
            Ok::<_, HttpError>(out.body(body)?)
        });
        sent.await?
    }
}

/// The tracer, when traces are on.
pub struct Traces {
    tracer: SdkTracer,
    provider: SdkTracerProvider,
    propagator: TraceContextPropagator,
    /// Runs the exports (kept alive with the provider).
    _runtime: tokio::runtime::Runtime,
}

impl Traces {
    /// Starts the exporter for `settings`.
    pub fn start(settings: &TraceSettings) -> Result<Traces, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("otlp-export")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the trace exporter's runtime: {e}"))?;
        let client = reqwest::Client::builder()
            .timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| format!("cannot build the trace exporter's client: {e}"))?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(ExportClient {
                client,
                runtime: runtime.handle().clone(),
            })
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(&settings.endpoint)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| format!("cannot build the OTLP exporter: {e}"))?;
        let batch = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(MAX_QUEUED_SPANS)
                    .with_scheduled_delay(Duration::from_millis(500))
                    .build(),
            )
            .build();
        let mut resource = Resource::builder();
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name("flowgate-balancer");
        }
        let ratio = Sampler::TraceIdRatioBased(settings.sample_ratio);
        let sampler = if settings.parent_based {
            Sampler::ParentBased(Box::new(ratio))
        } else {
            ratio
        };
        let provider = SdkTracerProvider::builder()
            .with_span_processor(batch)
            .with_sampler(sampler)
            .with_resource(resource.build())
            .build();
        Ok(Traces {
            tracer: provider.tracer("flowgate"),
            provider,
            propagator: TraceContextPropagator::new(),
            _runtime: runtime,
        })
    }

    /// A request's trace, begun at `start` under the client's trace
    /// context (if its headers carry one).
    pub fn begin(&self, headers: &http::HeaderMap, method: &str, path: &str) -> RequestTrace {
        let parent = self.propagator.extract(&HeaderExtractor(headers));
        let now = (Instant::now(), SystemTime::now());
        let span = self
            .tracer
            .span_builder("flowgate.request")
            .with_kind(SpanKind::Server)
            .with_start_time(now.1)
            .with_attributes([
                KeyValue::new("http.request.method", method.to_string()),
                KeyValue::new("url.path", path.to_string()),
            ])
            .start_with_context(&self.tracer, &parent);
        RequestTrace {
            cx: parent.with_span(span),
            origin: now,
            upstream: None,
        }
    }

    /// Sends the spans still queued (at shutdown), waiting at most the
    /// export timeout.
    pub fn shutdown(&self) {
        let _ = self.provider.shutdown_with_timeout(EXPORT_TIMEOUT);
    }
}

/// One request's spans while it is under way.
pub struct RequestTrace {
    /// The request's span, in its context.
    cx: Context,
    /// When the trace began, as an instant and as wall-clock time: a
    /// child's times are instants, turned into wall-clock time from here.
    origin: (Instant, SystemTime),
    /// The call to the engine while it runs, and when it began.
    upstream: Option<(Context, Instant)>,
}

impl RequestTrace {
    fn wall(&self, at: Instant) -> SystemTime {
        self.origin.1 + at.saturating_duration_since(self.origin.0)
    }

    /// Whether the spans are kept (sampled).
    pub fn is_recording(&self) -> bool {
        self.cx.span().is_recording()
    }

    /// A finished child span from `start` to `end`.
    pub fn child(
        &self,
        traces: &Traces,
        name: &'static str,
        start: Instant,
        end: Instant,
        attributes: Vec<KeyValue>,
    ) {
        if !self.is_recording() {
            return;
        }
        let mut span = traces
            .tracer
            .span_builder(name)
            .with_start_time(self.wall(start))
            .with_attributes(attributes)
            .start_with_context(&traces.tracer, &self.cx);
        span.end_with_timestamp(self.wall(end));
    }

    /// Begins the call to the engine at `to`; returns the `traceparent`
    /// (and `tracestate`) headers that carry its context upstream.
    pub fn begin_upstream(
        &mut self,
        traces: &Traces,
        to: Option<SocketAddr>,
    ) -> Vec<(String, String)> {
        let mut attributes = Vec::new();
        if let Some(addr) = to {
            attributes.push(KeyValue::new("server.address", addr.ip().to_string()));
            attributes.push(KeyValue::new("server.port", i64::from(addr.port())));
        }
        let span = traces
            .tracer
            .span_builder("upstream")
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .start_with_context(&traces.tracer, &self.cx);
        let cx = self.cx.with_span(span);
        let mut headers = Vec::new();
        traces
            .propagator
            .inject_context(&cx, &mut HeaderList(&mut headers));
        // A retry begins a new call: the one before it ended there.
        if let Some((previous, _)) = self.upstream.replace((cx, Instant::now())) {
            previous.span().set_status(Status::error("retried"));
            previous.span().end();
        }
        headers
    }

    /// Ends the trace: the upstream call (with its time to first token:
    /// from its start to the answer's first byte at `first_byte`) and the
    /// request, with its `status` and `attributes`.
    pub fn end(mut self, status: u16, first_byte: Option<Instant>, attributes: Vec<KeyValue>) {
        if let Some((upstream, started)) = self.upstream.take() {
            let span = upstream.span();
            if let Some(first) = first_byte {
                let ttft = first.saturating_duration_since(started);
                span.set_attribute(KeyValue::new(
                    "flowgate.time_to_first_token_ms",
                    ttft.as_secs_f64() * 1000.0,
                ));
            }
            span.end();
        }
        let span = self.cx.span();
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        span.set_attributes(attributes);
        if status >= 500 || status == 0 {
            span.set_status(Status::error(format!("status {status}")));
        }
        span.end();
    }
}

/// `opentelemetry`'s injector for a list of headers.
impl opentelemetry::propagation::Injector for HeaderList<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_string(), value));
    }
}

/// Headers collected to be set on the upstream request.
struct HeaderList<'a>(&'a mut Vec<(String, String)>);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_url_gets_the_traces_path() {
        let url = |s| TraceSettings::traces_url(s);
        assert_eq!(
            url("http://127.0.0.1:4318").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(url("http://c:4318/").unwrap(), "http://c:4318/v1/traces");
        assert_eq!(
            url("https://c/otlp/v1/traces").unwrap(),
            "https://c/otlp/v1/traces"
        );
        for bad in ["", "127.0.0.1:4318", "grpc://c:4317", "http://"] {
            assert!(url(bad).is_err(), "{bad:?}");
        }
    }
}
