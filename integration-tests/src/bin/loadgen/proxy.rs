//! `loadgen proxy`: a minimal reverse proxy with `round-robin` or
//! `least-in-flight` balancing and no queue of its own, the scheduling
//! benchmark's baselines.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use clap::ValueEnum;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = http_body_util::combinators::BoxBody<Bytes, BoxError>;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Policy {
    RoundRobin,
    LeastInFlight,
}

#[derive(Debug, clap::Args)]
pub struct ProxyArgs {
    #[arg(long)]
    listen: SocketAddr,
    /// Comma-separated backend ip:port list
    #[arg(long, value_delimiter = ',')]
    backends: Vec<SocketAddr>,
    #[arg(long, value_enum)]
    policy: Policy,
}

struct Backends {
    addrs: Vec<SocketAddr>,
    in_flight: Vec<AtomicUsize>,
    next: AtomicUsize,
    policy: Policy,
    client: reqwest::Client,
}

impl Backends {
    fn pick(&self) -> usize {
        match self.policy {
            Policy::RoundRobin => self.next.fetch_add(1, Ordering::Relaxed) % self.addrs.len(),
            Policy::LeastInFlight => {
                // Rotate the start so ties spread out.
                let start = self.next.fetch_add(1, Ordering::Relaxed);
                (0..self.addrs.len())
                    .map(|k| (start + k) % self.addrs.len())
                    .min_by_key(|&i| self.in_flight[i].load(Ordering::Relaxed))
                    .expect("at least one backend")
            }
        }
    }
}

/// Counts a request in flight on a backend until dropped (with its body).
struct InFlight(Arc<Backends>, usize);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight[self.1].fetch_sub(1, Ordering::Relaxed);
    }
}

async fn forward(b: Arc<Backends>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let i = b.pick();
    b.in_flight[i].fetch_add(1, Ordering::Relaxed);
    let guard = InFlight(Arc::clone(&b), i);
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let method = req.method().clone();
    let headers = req.headers().clone();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Ok(status(StatusCode::BAD_REQUEST)),
    };
    let mut upstream = b
        .client
        .request(method, format!("http://{}{path}", b.addrs[i]))
        .body(body);
    for (k, v) in &headers {
        if k != "host" && k != "content-length" {
            upstream = upstream.header(k, v);
        }
    }
    match upstream.send().await {
        Ok(resp) => {
            let code = resp.status();
            let ct = resp.headers().get("content-type").cloned();
            let stream = resp.bytes_stream().map(move |c| {
                let _hold = &guard;
                c.map(Frame::data).map_err(|e| Box::new(e) as BoxError)
            });
            let mut r = Response::new(BodyExt::boxed(StreamBody::new(stream)));
            *r.status_mut() = code;
            if let Some(ct) = ct {
                r.headers_mut().insert("content-type", ct);
            }
            Ok(r)
        }
        Err(_) => Ok(status(StatusCode::BAD_GATEWAY)),
    }
}

fn status(code: StatusCode) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::new()).map_err(|n| match n {}).boxed());
    *r.status_mut() = code;
    r
}

pub async fn proxy(args: ProxyArgs) {
    assert!(!args.backends.is_empty(), "--backends is empty");
    let backends = Arc::new(Backends {
        in_flight: args.backends.iter().map(|_| AtomicUsize::new(0)).collect(),
        addrs: args.backends,
        next: AtomicUsize::new(0),
        policy: args.policy,
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(1024)
            .build()
            .expect("http client"),
    });
    let listener = TcpListener::bind(args.listen).await.expect("bind");
    println!("listening on {}", listener.local_addr().expect("addr"));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let b = Arc::clone(&backends);
        tokio::spawn(async move {
            let svc = service_fn(move |req| forward(Arc::clone(&b), req));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
