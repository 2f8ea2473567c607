//! The management port, served until the process exits.
//!
//! Pingora's listening services stop accepting at SIGTERM and close each
//! keep-alive connection after its next answer. For the inference port that
//! is the point of a graceful shutdown; for the management port it would cut
//! the agents off while the requests it waits for are still running: their
//! reports stop, every endpoint turns stale within a few hundred
//! milliseconds, and a request still sending its body at SIGTERM would wait
//! for a slot no endpoint can give. So the management app gets its own
//! accept loop that ignores the shutdown signal; the process's exit (once
//! drained, or at the end of the grace period) closes it.

use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use pingora_core::apps::ServerApp;
use pingora_core::protocols::l4::stream::Stream as TcpStream;
use pingora_core::protocols::Stream;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use tokio::sync::watch;
use tracing::{error, warn};

pub struct ServeUntilExit<A> {
    app: Arc<A>,
    /// Taken by `start`, which runs once.
    listener: Mutex<Option<TcpListener>>,
}

impl<A> ServeUntilExit<A> {
    /// `listener` is bound by the caller, so that a busy port is reported
    /// before the server starts.
    pub fn new(app: A, listener: TcpListener) -> Self {
        ServeUntilExit {
            app: Arc::new(app),
            listener: Mutex::new(Some(listener)),
        }
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> BackgroundService for ServeUntilExit<A> {
    async fn start(&self, _shutdown: ShutdownWatch) {
        let Some(listener) = self.listener.lock().ok().and_then(|mut l| l.take()) else {
            return;
        };
        let listener = match listener
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpListener::from_std(listener))
        {
            Ok(l) => l,
            Err(e) => {
                error!("management port: {e}");
                std::process::exit(1);
            }
        };
        // A shutdown signal that never fires: connections stay keep-alive
        // until the process ends.
        let (_keep, never) = watch::channel(false);
        loop {
            let tcp = match listener.accept().await {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors and the like: pause instead
                    // of spinning.
                    warn!("management port: accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let app = Arc::clone(&self.app);
            let never = never.clone();
            tokio::spawn(async move {
                let mut next: Option<Stream> = Some(Box::new(TcpStream::from(tcp)));
                while let Some(stream) = next {
                    next = app.process_new(stream, &never).await;
                }
            });
        }
    }
}
