//! The inference port's client connections: the limits on what a client may
//! hold, and the HTTP/1 loop that serves a connection's requests, where a
//! queued request waits outside the proxy ([`parking`]).
//!
//! Limits on what clients of the inference port may hold: open connections,
//! the time and bytes a request head may take (slow or oversized heads), and
//! the time a request body may take (enforced by the proxy, see
//! [`ClientLimits::body_timeout`]).
//!
//! [`Limited`] wraps Pingora's proxy application. It holds one permit per
//! open connection (over the cap a connection gets a 503 and is closed) and
//! wraps each connection's stream in a [`Guarded`] stream that watches the
//! request head: from its first byte (or from the accept, for a connection
//! that sends nothing) the head must be complete within the header timeout
//! (else 408) and within the byte cap (else 431). The proxy tells the guard
//! when a head was parsed ([`head_done`]) and when the request ended
//! ([`request_done`]), so bodies, waits in the buffer and answers are never
//! under the header deadline, and each keep-alive request gets its own.
//!
//! [`Limited`] also serves an HTTP/1 connection's requests one after the
//! other (as Pingora's own loop does), which is where a queued request that
//! left the proxy waits and comes back ([`parking`]).

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::apps::{HttpServerApp, ServerApp};
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::raw_connect::ProxyDigest;
use pingora_core::protocols::ALPN;
use pingora_core::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream,
    TimingDigest, UniqueID, UniqueIDType,
};
use pingora_core::server::ShutdownWatch;
use pingora_proxy::Session;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tracing::debug;

use crate::gate::FleetGate;
use crate::observe::clients::OpenConnection;
use parking::Parked;

pub mod parking;

/// Keep-alive of an idle HTTP/1 client connection (Pingora's own default).
const HTTP1_KEEPALIVE_SECS: u64 = 60;

pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(60);
pub const DEFAULT_MAX_HEADER_BYTES: usize = 32 * 1024;
/// Pingora refuses heads over 1 MiB on its own.
pub const MAX_MAX_HEADER_BYTES: usize = 1024 * 1024 - 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientLimits {
    /// Open client connections at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Time from a request head's first byte to its end (408 after).
    pub header_timeout: Duration,
    /// Time to read a whole request body (408 after).
    pub body_timeout: Duration,
    /// Largest request head (request line and headers, 431 over).
    pub max_header_bytes: usize,
}

impl Default for ClientLimits {
    fn default() -> Self {
        ClientLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
        }
    }
}

/// A complete HTTP/1.1 answer with an OpenAI-style error body, for the
/// refusals made before Pingora has a request to answer.
fn raw_response(status: &str, code: &str, message: &str) -> Vec<u8> {
    let body = flowgate::openai::error_body(message, "invalid_request_error", code);
    let mut out = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\nx-flowgate-drop-reason: {code}\r\n",
        body.len()
    );
    if status.starts_with("503") {
        out.push_str("retry-after: 1\r\n");
    }
    out.push_str("\r\n");
    let mut out = out.into_bytes();
    out.extend_from_slice(&body);
    out
}

/// Pingora's proxy application behind the connection cap and head guard.
pub struct Limited<A> {
    inner: Arc<A>,
    limits: ClientLimits,
    permits: Arc<Semaphore>,
    shared: Arc<FleetGate>,
}

impl<A> Limited<A> {
    pub fn new(inner: A, limits: ClientLimits, shared: Arc<FleetGate>) -> Self {
        Limited {
            inner: Arc::new(inner),
            permits: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
            shared,
        }
    }
}

/// Answers a connection over the limit 503, closes our side, then takes
/// what the client still sends for up to a second: closing with unread
/// bytes would reset the connection and could destroy the answer before it
/// is read.
async fn refuse_connection(mut stream: Stream, max_connections: usize) {
    let answer = raw_response(
        "503 Service Unavailable",
        "too_many_connections",
        &format!(
            "this balancer holds its maximum of {max_connections} client connections; retry \
             shortly"
        ),
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(&answer).await?;
        stream.flush().await?;
        AsyncWriteExt::shutdown(&mut stream).await?;
        let mut sink = [0u8; 1024];
        while stream.read(&mut sink).await? > 0 {}
        io::Result::Ok(())
    })
    .await;
}

/// What an open client connection holds until it closes, whichever task
/// serves it: its permit under the connection cap, and its count.
struct Held {
    _permit: OwnedSemaphorePermit,
    _open: OpenConnection,
}

/// The keep-alive of the next request on a connection: none once the
/// balancer is shutting down.
fn keepalive(shutdown: &ShutdownWatch) -> Option<u64> {
    (!*shutdown.borrow()).then_some(HTTP1_KEEPALIVE_SECS)
}

impl<A: HttpServerApp + Send + Sync + 'static> Limited<A> {
    /// An HTTP/1 connection's requests, one after the other, as Pingora's
    /// own loop serves them, until the connection closes (`None`) or one
    /// of its requests parks to wait for a slot ([`parking`]): then the
    /// connection and its parked request are returned.
    async fn serve_http1(
        &self,
        mut session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<(Stream, Box<Parked>)> {
        loop {
            let reused = self.inner.process_new_http(session, shutdown).await?;
            let (stream, mut settings) = reused.consume();
            if let Some(parked) = parking::take_parked(settings.as_mut()) {
                return Some((stream, parked));
            }
            session = ServerSession::new_http1(stream);
            if let Some(settings) = settings {
                settings.apply_to_session(&mut session);
            }
        }
    }

    /// A connection whose request parked, in a task of its own: the
    /// request waits for its slot, comes back into the proxy, and the
    /// connection's next requests are served here, parking again as they
    /// must. The task is the size of what it holds (~1 KB), where
    /// Pingora's task for a connection is sized for a TLS handshake and
    /// its whole connection loop (~8.8 KB) and now ends: what a waiting
    /// request costs is what it holds.
    async fn wait_parked(
        self: Arc<Self>,
        mut stream: Stream,
        mut parked: Box<Parked>,
        shutdown: ShutdownWatch,
        _held: Held,
    ) {
        loop {
            let (resumed, replay) = parked.wait(&mut stream).await;
            let session = resumed.into_session(stream, replay, keepalive(&shutdown));
            // Boxed: the task keeps only what a waiting request needs.
            let Some(next) = Box::pin(self.serve_http1(session, &shutdown)).await else {
                return;
            };
            (stream, parked) = next;
        }
    }
}

#[async_trait]
impl<A: HttpServerApp + Send + Sync + 'static> ServerApp for Limited<A> {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let metrics = &self.shared.metrics;
        let Ok(permit) = Arc::clone(&self.permits).try_acquire_owned() else {
            metrics.clients.refusal("too_many_connections");
            // Boxed: this future lives as long as the connection, and the
            // refusal's buffers would otherwise be part of every one.
            Box::pin(refuse_connection(stream, self.limits.max_connections)).await;
            return None;
        };
        let held = Held {
            _permit: permit,
            _open: metrics.clients.opened(),
        };
        let guarded: Stream = Box::new(Guarded::new(stream, self.limits, Arc::clone(&self.shared)));
        if matches!(guarded.selected_alpn_proto(), Some(ALPN::H2)) {
            // HTTP/2 (by ALPN): Pingora's connection loop, its streams'
            // requests wait in the proxy.
            let mut next = self.inner.process_new(guarded, shutdown).await;
            while let Some(stream) = next {
                next = self.inner.process_new(stream, shutdown).await;
            }
        } else {
            let mut session = ServerSession::new_http1(guarded);
            session.set_keepalive(keepalive(shutdown));
            if let Some((stream, parked)) = self.serve_http1(session, shutdown).await {
                let serve = Arc::clone(self).wait_parked(stream, parked, shutdown.clone(), held);
                tokio::spawn(serve);
                // Pingora's task for the connection ends here.
                return None;
            }
        }
        drop(held);
        None
    }

    async fn cleanup(&self) {
        self.inner.cleanup().await;
    }
}

/// The guard of `session`'s connection, if it has one (HTTP/1 on the
/// inference port).
pub(crate) fn guard(session: &Session) -> Option<&Guarded> {
    let stream = session.downstream_session.stream()?;
    (**stream).as_any().downcast_ref::<Guarded>()
}

/// The request head was parsed: lift the header deadline.
pub fn head_done(session: &Session) {
    if let Some(g) = guard(session) {
        g.head_parsed.store(true, Ordering::Relaxed);
    }
}

/// The request is over: the next read on the connection is a new head.
pub fn request_done(session: &Session) {
    if let Some(g) = guard(session) {
        g.head_parsed.store(false, Ordering::Relaxed);
        g.requests_done.fetch_add(1, Ordering::Relaxed);
    }
}

/// A client connection whose request heads are held to the limits.
pub struct Guarded {
    inner: Stream,
    /// Set by the proxy (see [`head_done`], [`request_done`]): the current
    /// request's head is in, reads are its body or the wait for the answer.
    head_parsed: AtomicBool,
    /// Requests finished on this connection, counted by the proxy.
    requests_done: AtomicU32,
    /// `requests_done` as the last read saw it: a change starts a new head.
    seen_done: u32,
    /// Bytes read since the current head began.
    head_bytes: usize,
    /// When the current head must be complete; `None` until its first byte
    /// (a fresh connection starts its clock at once).
    deadline: Option<Pin<Box<Sleep>>>,
    /// Answered and closed: every further read fails.
    refused: bool,
    limits: ClientLimits,
    shared: Arc<FleetGate>,
}

impl fmt::Debug for Guarded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guarded")
            .field("inner", &self.inner)
            .field("head_bytes", &self.head_bytes)
            .finish_non_exhaustive()
    }
}

impl Guarded {
    fn new(inner: Stream, limits: ClientLimits, shared: Arc<FleetGate>) -> Self {
        let deadline = Box::pin(tokio::time::sleep(limits.header_timeout));
        Guarded {
            inner,
            head_parsed: AtomicBool::new(false),
            requests_done: AtomicU32::new(0),
            seen_done: 0,
            head_bytes: 0,
            deadline: Some(deadline),
            refused: false,
            limits,
            shared,
        }
    }

    /// Writes `answer` if the socket takes it now, and fails the read.
    fn refuse(
        &mut self,
        cx: &mut Context<'_>,
        reason: &'static str,
        answer: Vec<u8>,
        kind: io::ErrorKind,
    ) -> Poll<io::Result<()>> {
        self.refused = true;
        self.shared.metrics.clients.refusal(reason);
        debug!(reason, "refused a client's request head");
        // A fresh socket's send buffer takes a few hundred bytes at once;
        // if it does not, the client was not reading anyway.
        if let Poll::Ready(Ok(_)) = Pin::new(&mut self.inner).poll_write(cx, &answer) {
            let _ = Pin::new(&mut self.inner).poll_flush(cx);
        }
        Poll::Ready(Err(io::Error::new(kind, reason)))
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.refused {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "request refused",
            )));
        }
        let done = this.requests_done.load(Ordering::Relaxed);
        if done != this.seen_done {
            // The next head on a kept-alive connection: its clock starts at
            // its first byte (idleness between requests is Pingora's
            // keep-alive timeout).
            this.seen_done = done;
            this.head_bytes = 0;
            this.deadline = None;
        }
        if this.head_parsed.load(Ordering::Relaxed) {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        // A head is being read. Pingora reads again only while the head is
        // incomplete, so a read past the cap means the head is too large
        // (bytes of a body that came with a small head are never re-read).
        if this.head_bytes >= this.limits.max_header_bytes {
            let answer = raw_response(
                "431 Request Header Fields Too Large",
                "header_too_large",
                &format!(
                    "the request line and headers exceed {} bytes",
                    this.limits.max_header_bytes
                ),
            );
            return this.refuse(cx, "header_too_large", answer, io::ErrorKind::InvalidData);
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        match polled {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len() - before;
                if n > 0 && this.deadline.is_none() {
                    this.deadline = Some(Box::pin(tokio::time::sleep(this.limits.header_timeout)));
                }
                this.head_bytes += n;
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                let expired = this
                    .deadline
                    .as_mut()
                    .is_some_and(|d| d.as_mut().poll(cx).is_ready());
                if !expired {
                    return Poll::Pending;
                }
                let answer = raw_response(
                    "408 Request Timeout",
                    "header_timeout",
                    &format!(
                        "the request head did not arrive within {:?}",
                        this.limits.header_timeout
                    ),
                );
                this.refuse(cx, "header_timeout", answer, io::ErrorKind::TimedOut)
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

// The rest of Pingora's stream interface is the wrapped stream's.

#[async_trait]
impl Shutdown for Guarded {
    async fn shutdown(&mut self) {
        Shutdown::shutdown(&mut *self.inner).await;
    }
}

impl UniqueID for Guarded {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for Guarded {
    fn get_ssl(&self) -> Option<&pingora_core::protocols::tls::TlsRef> {
        self.inner.get_ssl()
    }

    fn get_ssl_digest(&self) -> Option<Arc<pingora_core::protocols::tls::SslDigest>> {
        self.inner.get_ssl_digest()
    }

    fn selected_alpn_proto(&self) -> Option<pingora_core::protocols::ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for Guarded {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }

    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }

    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for Guarded {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }

    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.inner.set_proxy_digest(digest);
    }
}

impl GetSocketDigest for Guarded {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }

    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest);
    }
}

#[async_trait]
impl Peek for Guarded {
    async fn try_peek(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        self.inner.try_peek(buf).await
    }
}
