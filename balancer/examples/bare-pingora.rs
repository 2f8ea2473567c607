//! The floor for `scripts/bench/proxy`: the smallest Pingora reverse proxy
//! (round robin over fixed backends, no filters, no body handling), built
//! with the same Pingora version and settings as the balancer. The distance
//! between this and the balancer is what Flowgate adds; the distance between
//! this and nginx is Pingora's.
//!
//! `cargo run --release -p flowgate-balancer --example bare-pingora -- LISTEN BACKEND...`

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use pingora_core::server::configuration::{Opt, ServerConf};
use pingora_core::server::Server;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::Result;
use pingora_proxy::{ProxyHttp, Session};

/// The balancer's allocator, so that the distance between the two is what
/// Flowgate's own code adds.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct RoundRobin {
    backends: Vec<SocketAddr>,
    next: AtomicUsize,
}

#[async_trait]
impl ProxyHttp for RoundRobin {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.backends.len();
        Ok(Box::new(HttpPeer::new(
            self.backends[i],
            false,
            String::new(),
        )))
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: bare-pingora LISTEN_ADDR BACKEND_ADDR...";
    let listen = args.next().expect(usage);
    let backends: Vec<SocketAddr> = args
        .map(|a| a.parse().unwrap_or_else(|e| panic!("{a}: {e}")))
        .collect();
    assert!(!backends.is_empty(), "{usage}");
    let conf = ServerConf {
        threads: 1,
        // Stop at once on SIGTERM: nothing here is worth draining.
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(0),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(Opt::default(), conf);
    server.bootstrap();
    let proxy = RoundRobin {
        backends,
        next: AtomicUsize::new(0),
    };
    let mut service = pingora_proxy::http_proxy_service(&server.configuration, proxy);
    service.add_tcp(&listen);
    server.add_service(service);
    server.run_forever()
}
