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
//! 2. Pingora hands the connection back to [`super::Limited`], which
//!    moves it to a task of its own, the size of what it holds, and lets
//!    Pingora's task for the connection end; the request waits there
//!    ([`Parked::wait`]): the queues are the same, only where the waiter
//!    sleeps changed.
//! 3. When the wait ends, the request re-enters the proxy as the next
//!    request on its connection ([`Resumed::into_session`]): its bytes are
//!    fed to Pingora's parser from memory, and its context, with the wait's
//!    outcome, replaces the new one (`on_connection_reuse`).
//!
//! Only requests that can be replayed exactly park: HTTP/1 on a connection
//! [`super::Limited`] serves and keeps alive, a body framed by
//! `Content-Length` (or none) of at most 64 KiB (Pingora's retry buffer),
//! no `Expect`. Others (HTTP/2, `Connection: close`, chunked or larger
//! bodies) wait in the proxy as before. Retries (a slot lost to a failed endpoint) wait in the proxy too:
//! their request is already past the point of return.

use std::any::Any;
use std::fmt;

use bytes::BytesMut;
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::Stream;
use tokio::io::AsyncReadExt;
use tracing::debug;

use crate::gate::{AdmitError, Admitted, Waiting};

/// A request's context, opaque to the connection (the door that parked it
/// knows its type and takes it back).
pub type Context = Box<dyn Any + Send + Sync>;

/// A queued request waiting outside the proxy.
pub struct Parked {
    ctx: Context,
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
            .field("bytes", &self.replay.len())
            .finish()
    }
}

/// A parked request whose wait ended, on its way back into the proxy.
pub struct Resumed {
    pub ctx: Context,
    pub outcome: Result<Admitted, AdmitError>,
}

impl Parked {
    /// A request that waits outside the proxy: its context, its place in
    /// the queues, and its bytes as they came (head, then body), to replay
    /// once the wait ends.
    pub fn new(ctx: Context, waiting: Waiting, replay: BytesMut) -> Parked {
        Parked {
            ctx,
            waiting: Unresumed(Some(waiting)),
            replay,
        }
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
