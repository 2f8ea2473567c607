//! Parking: a request that flow control queues waits outside Pingora.
//!
//! Pingora keeps a request in progress as one future with room for every
//! proxy phase, plus its session and a 4 KiB head buffer: ~30 KB, whatever
//! the request is doing. A request that waits minutes for a slot would keep
//! all of it. So a queued HTTP/1 request leaves the proxy instead:
//!
//! 1. `request_filter` tells Pingora the request was answered (nothing was
//!    written) and keeps the connection alive; the request, as a [`Parked`]
//!    (its context, its bytes as they came, its place in the queues),
//!    becomes the connection's user context.
//! 2. Pingora hands the connection back to [`crate::limits::Limited`], which
//!    waits there ([`Parked::wait`]) in the connection's own task: the queues
//!    are the same, only where the waiter sleeps changed.
//! 3. When the wait ends, the request re-enters the proxy as the next
//!    request on its connection ([`Resumed::into_session`]): its bytes are
//!    fed to Pingora's parser from memory, and its context, with the wait's
//!    outcome, replaces the new one (`on_connection_reuse`).
//!
//! Only requests that can be replayed exactly park: HTTP/1 on a connection
//! [`crate::limits::Limited`] serves and keeps alive, a body framed by
//! `Content-Length` (or none) of at most 64 KiB (Pingora's retry buffer),
//! no `Expect`. Others (HTTP/2, `Connection: close`, chunked or larger
//! bodies) wait in the proxy as before. Retries (a slot lost to a failed endpoint) wait in the proxy too:
//! their request is already past the point of return.

use std::fmt;

use bytes::{Bytes, BytesMut};
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::Stream;
use pingora_proxy::Session;
use tokio::io::AsyncReadExt;
use tracing::debug;

use super::RequestCtx;
use crate::gate::{AdmitError, Admitted, Waiting};

/// A queued request waiting outside the proxy.
pub struct Parked {
    ctx: Box<RequestCtx>,
    waiting: Unresumed,
    /// The request as it came: head, then body.
    replay: BytesMut,
}

/// The wait of a parked request, until it is taken to wait on. A parked
/// request that never waits (Pingora could not give its connection back:
/// the client sent bytes behind it) is counted as the client's leaving.
struct Unresumed(Option<Waiting>);

impl Drop for Unresumed {
    fn drop(&mut self) {
        if let Some(waiting) = self.0.take() {
            debug!("a parked request's connection could not be kept; counted as client-gone");
            waiting.abandon();
        }
    }
}

impl fmt::Debug for Parked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Parked")
            .field("request_id", &self.ctx.request_id)
            .field("bytes", &self.replay.len())
            .finish()
    }
}

/// A parked request whose wait ended, on its way back into the proxy.
pub struct Resumed {
    pub ctx: Box<RequestCtx>,
    pub outcome: Result<Admitted, AdmitError>,
}

/// The request's bytes to replay when it may park: an HTTP/1 request on a
/// guarded, kept-alive connection (one [`crate::limits::Limited`] serves,
/// which takes parked requests back), with `body` (all of it, as read) framed by
/// `Content-Length` and no `Expect` (a second session would answer it
/// again). The body must fit Pingora's retry buffer: replayed from memory
/// it is read in one piece, so the buffer can only be armed for all of it
/// ([`super::body`]).
pub fn replay(session: &Session, body: &Bytes) -> Option<BytesMut> {
    if body.len() > super::body::PINGORA_RETRY_BUFFER {
        return None;
    }
    // Pingora gives the connection back only if it is kept alive, which
    // the client's `Connection: close` (or HTTP/1.0) rules out.
    session.get_keepalive()?;
    crate::limits::guard(session)?;
    let h1 = session.downstream_session.as_http1()?;
    let headers = &session.req_header().headers;
    let framed_by_length = headers.get(http::header::TRANSFER_ENCODING).is_none()
        && (body.is_empty() || headers.contains_key(http::header::CONTENT_LENGTH));
    if !framed_by_length || headers.contains_key(http::header::EXPECT) {
        return None;
    }
    let head = h1.get_headers_raw_bytes();
    let mut replay = BytesMut::with_capacity(head.len() + body.len());
    replay.extend_from_slice(&head);
    replay.extend_from_slice(body);
    Some(replay)
}

impl Parked {
    /// Parks `ctx`'s request (its connection is kept alive, see
    /// [`replay`]): the proxy says it answered it, and `ctx` becomes a fresh context that only carries
    /// the parked one to [`ProxyHttp::persist_connection_context`].
    ///
    /// [`ProxyHttp::persist_connection_context`]: pingora_proxy::ProxyHttp::persist_connection_context
    pub fn park(ctx: &mut RequestCtx, fresh: RequestCtx, waiting: Waiting, replay: BytesMut) {
        let ctx_parked = std::mem::replace(ctx, fresh);
        *ctx.parked.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(Parked {
            ctx: Box::new(ctx_parked),
            waiting: Unresumed(Some(waiting)),
            replay,
        }));
    }

    /// Waits outside the proxy; a byte from the client, or its close, ends
    /// the wait as the client's leaving (as in the proxy).
    pub async fn wait(mut self: Box<Self>, stream: &mut Stream) -> (Resumed, BytesMut) {
        let client_gone = async {
            let mut byte = [0u8; 1];
            let _ = stream.read(&mut byte).await;
        };
        let outcome = match self.waiting.0.take() {
            Some(waiting) => waiting.wait(client_gone).await,
            None => Err(AdmitError::ClientGone),
        };
        let Parked { ctx, replay, .. } = *self;
        (Resumed { ctx, outcome }, replay)
    }
}

impl Resumed {
    /// The session that replays the request to the proxy, carrying this;
    /// `keepalive` as for any new request on the connection.
    pub fn into_session(
        self,
        stream: Stream,
        replay: BytesMut,
        keepalive: Option<u64>,
    ) -> ServerSession {
        let mut session = ServerSession::new_http1(stream);
        session.set_keepalive(keepalive);
        session.set_pipelined_prefix(replay);
        session.set_connection_user_context(Some(Box::new(self)));
        session
    }
}

/// Takes a parked request from a connection Pingora gave back, if it
/// carries one.
pub fn take_parked(
    settings: Option<&mut pingora_core::apps::HttpPersistentSettings>,
) -> Option<Box<Parked>> {
    settings?.take_user_context()?.downcast::<Parked>().ok()
}
