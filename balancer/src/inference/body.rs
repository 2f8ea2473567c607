//! Reading a request body on the inference port.
//!
//! The body must be read before an endpoint is chosen, which consumes it.
//! Pingora replays a consumed body upstream only from its retry buffer
//! (64 KiB). So the body is read with the retry buffer armed just for its
//! last ≤ 64 KiB; that makes Pingora enter its replay path. A body of up to
//! 64 KiB is all in the retry buffer and goes upstream from there; for a
//! longer one the proxy's `request_body_filter` swaps in the whole body,
//! kept in the request's context. Chunked bodies (no `Content-Length`) over
//! 64 KiB cannot be armed that way and are refused with 411.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::StatusCode;
use pingora_core::{Error, ErrorType};
use pingora_proxy::Session;

use super::halt::Flow;
use crate::observe::metrics::Metrics;
use crate::reply::Refusal;

/// Pingora's retry buffer size (`BODY_BUF_LIMIT` in pingora-core).
pub(super) const PINGORA_RETRY_BUFFER: usize = 64 * 1024;

/// How much of a body, and how long for it.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    pub max_bytes: usize,
    pub timeout: Duration,
}

/// A body read whole.
pub struct Body {
    pub bytes: Bytes,
    /// Pingora's retry buffer holds all of it (else the proxy keeps a copy
    /// to replay).
    pub in_retry_buffer: bool,
}

/// Whether a downstream error means the client's connection is gone (as
/// opposed to a request it framed wrong).
pub fn client_went_away(e: &Error) -> bool {
    matches!(
        e.etype(),
        ErrorType::WriteError
            | ErrorType::ReadError
            | ErrorType::ConnectionClosed
            | ErrorType::ReadTimedout
            | ErrorType::WriteTimedout
    )
}

/// 400 for a request the client framed wrong (a malformed chunked body, a
/// `Connection` header that nominates a protected header): the client's
/// mistake, counted as a client refusal, never an upstream error.
pub fn bad_framing(metrics: &Metrics, e: &Error) -> Refusal {
    metrics.clients.refusal("bad_framing");
    let mut r = Refusal::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "bad_request",
        format!("the request is malformed ({})", e.etype().as_str()),
    );
    r.reason = "bad-framing";
    r
}

/// Reads the whole request body within the client body timeout (408
/// after): a client that went away (nobody to answer), or a refusal.
pub async fn read_body(session: &mut Session, limits: BodyLimits, metrics: &Metrics) -> Flow<Body> {
    match tokio::time::timeout(limits.timeout, read_all(session, limits.max_bytes, metrics)).await {
        Ok(read) => read,
        Err(_) => {
            metrics.clients.refusal("body_timeout");
            Err(Refusal::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                "body_timeout",
                format!(
                    "the request body did not arrive within {:?}",
                    limits.timeout
                ),
            )
            .into())
        }
    }
}

/// Refuses bodies over `max` before reading them if the client announced
/// the size.
async fn read_all(session: &mut Session, max: usize, metrics: &Metrics) -> Flow<Body> {
    let declared = match session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
    {
        Some(v) => match v.to_str().ok().and_then(|s| s.trim().parse::<usize>().ok()) {
            Some(n) => Some(n),
            None => {
                return Err(Refusal::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    "bad_content_length",
                    "Content-Length is not a number".into(),
                )
                .into())
            }
        },
        None => None,
    };
    if declared.is_some_and(|n| n > max) {
        return Err(Refusal::too_large(max).into());
    }
    let expects_continue = session
        .req_header()
        .headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects_continue {
        session.write_continue_response().await?;
    }
    // A body that comes in one chunk (most: Pingora reads it with the
    // head) is kept as that chunk; only a second one makes a copy.
    let mut first: Option<Bytes> = None;
    let mut buf = BytesMut::new();
    let mut armed = false;
    // The retry buffer is armed before the first byte (and so holds the
    // whole body) when the body is short or its length unknown.
    let whole = declared.is_none_or(|n| n <= PINGORA_RETRY_BUFFER);
    loop {
        let read_so_far = first.as_ref().map_or(buf.len(), Bytes::len);
        let remaining = declared.map_or(0, |n| n.saturating_sub(read_so_far));
        if !armed && (declared.is_none() || remaining <= PINGORA_RETRY_BUFFER) {
            session.enable_retry_buffering();
            armed = true;
        }
        let read = match session.read_request_body().await {
            Ok(read) => read,
            // The client went away: nobody to answer.
            Err(e) if client_went_away(&e) => return Err(e.into()),
            Err(e) => return Err(bad_framing(metrics, &e).into()),
        };
        match read {
            Some(chunk) => {
                if read_so_far + chunk.len() > max {
                    return Err(Refusal::too_large(max).into());
                }
                if let Some(earlier) = first.take() {
                    buf.reserve(declared.unwrap_or(0).max(earlier.len() + chunk.len()));
                    buf.extend_from_slice(&earlier);
                    buf.extend_from_slice(&chunk);
                } else if buf.is_empty() {
                    first = Some(chunk);
                } else {
                    buf.extend_from_slice(&chunk);
                }
            }
            None => break,
        }
    }
    let bytes = first.unwrap_or_else(|| buf.freeze());
    // Pingora drops a retry buffer that overflows, which only a chunked
    // body (armed from its first byte, length unknown) can make it do.
    if declared.is_none() && bytes.len() > PINGORA_RETRY_BUFFER {
        return Err(Refusal::new(
            StatusCode::LENGTH_REQUIRED,
            "invalid_request_error",
            "length_required",
            format!(
                "chunked request bodies over {PINGORA_RETRY_BUFFER} bytes are not supported: \
                 send a Content-Length header"
            ),
        )
        .into());
    }
    Ok(Body {
        bytes,
        in_retry_buffer: whole,
    })
}

/// The request's bytes to replay when it may park
/// ([`crate::connection::parking`]): an HTTP/1 request on a
/// guarded, kept-alive connection (one [`crate::connection::Limited`] serves,
/// which takes parked requests back), with `body` (all of it, as read) framed by
/// `Content-Length` and no `Expect` (a second session would answer it
/// again). The body must fit Pingora's retry buffer: replayed from memory
/// it is read in one piece, so the buffer can only be armed for all of it
/// (see the top of this file).
pub fn replay(session: &Session, body: &Bytes) -> Option<BytesMut> {
    if body.len() > PINGORA_RETRY_BUFFER {
        return None;
    }
    // Pingora gives the connection back only if it is kept alive, which
    // the client's `Connection: close` (or HTTP/1.0) rules out.
    session.get_keepalive()?;
    crate::connection::guard(session)?;
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
