//! A request's state as it passes the proxy's hooks.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use flowgate::admission::Grant;
use flowgate::tokens::TokenEstimate;
use flowgate::{EndpointId, RequestMeta};

use crate::connection::parking;
use crate::gate::{ActiveRequest, AdmitError, Admitted, LeaseGuard, Served};
use crate::observe::meter::ResponseMeter;
use crate::observe::traces::RequestTrace;
use crate::rules::DoorRules;

/// Whether an answer carries the scoring of its endpoint
/// ([`super::SCORES_HEADER`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Explain {
    No,
    Yes,
    /// It asked and may not know.
    Denied,
}

/// How a request ended, when not simply proxied: its `reason` in the
/// access log, the outcome metrics and its trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Proxied (or not yet ended): no reason.
    Proxied,
    /// A route the balancer answers itself (health, models, the async
    /// and Batch APIs).
    Local,
    /// The client left before its answer ended.
    ClientGone,
    /// The engines refused the request itself (a client error they
    /// answered, or the same failure from two of them).
    RequestRejected,
    /// The balancer refused it ([`crate::reply::Refusal::reason`]).
    Refused(&'static str),
}

impl Ending {
    /// Its label: empty for a proxied request.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Ending::Proxied => "",
            Ending::Local => "local",
            Ending::ClientGone => "client-gone",
            Ending::RequestRejected => "request-rejected",
            Ending::Refused(reason) => reason,
        }
    }
}

/// A request's retries on other endpoints ([`super::retry`]).
#[derive(Debug, Default)]
pub(crate) struct Retries {
    /// Retries done so far.
    pub(super) done: u32,
    /// The endpoint failed and the request goes to another one.
    pub(super) pending: bool,
    /// A stale pooled connection was retried on a fresh one.
    pub(super) stale_retried: bool,
    /// An endpoint whose 5xx awaits a second endpoint's answer to the same
    /// request before it counts against it ([`flowgate::blame`]).
    pub(super) suspect: Option<(EndpointId, SocketAddr)>,
}

/// The engine's answer to a request, as it comes.
#[derive(Debug, Default)]
pub(crate) struct EngineAnswer {
    /// When the request (its last attempt) went to the engine.
    pub(super) sent_at: Option<Instant>,
    /// Status of the upstream response header, once it arrived.
    pub(super) status: Option<u16>,
    /// This answer is an engine's refusal of the request, passed on
    /// uncounted; its body (the first [`super::MAX_ERROR_BODY`] bytes) is
    /// checked once it has arrived.
    pub(super) rejected: bool,
    pub(super) error_body: Vec<u8>,
}

/// The request's facts as admission found them, and what the model rules
/// made of its model: what the access log, the metrics, its trace and the
/// session store name it by.
#[derive(Debug, Default)]
pub(super) struct Facts {
    /// The request's `model` field.
    pub(super) model: String,
    /// The model it was sent for after the model rules (`None`: any
    /// endpoint's), told to the client in [`super::SERVED_MODEL_HEADER`].
    pub(super) served_model: Option<Arc<str>>,
    /// The fallback model it went to instead of its own, if it did.
    pub(super) fallback: Option<Arc<str>>,
    /// The request asked for a streamed answer.
    pub(super) stream: bool,
    /// Its token estimate, and its prompt text's length (learned from
    /// against the answer's usage).
    pub(super) tokens: TokenEstimate,
    pub(super) prompt_bytes: u64,
    /// Its flow.
    pub(super) fairness_id: Option<Arc<str>>,
    pub(super) priority: i32,
    /// Its session, hashed ([`flowgate::session`]).
    pub(super) session: Option<u64>,
    /// What the session store records where it went once served: its
    /// session, or its prompt for a keyless conversation
    /// ([`flowgate::turn::StoreKeys`]).
    pub(super) store_key: Option<u64>,
}

/// The request's body as the balancer holds it.
#[derive(Debug, Default)]
pub(super) struct Body {
    /// The whole body when it is longer than Pingora's retry buffer
    /// (which then holds only its tail), sent by `request_body_filter`.
    pub(super) whole: Option<Bytes>,
    /// It was rewritten (its `model`): its length changed.
    pub(super) rewritten: bool,
    /// Its `multipart/form-data` content type, when it is a form.
    pub(super) form: Option<String>,
}

/// Per-request state.
pub struct RequestCtx {
    pub(super) start: Instant,
    pub(super) body: Body,
    /// What it holds once let in (its quotas' reservation, its slot),
    /// settled when it ends.
    pub(super) served: Option<Served>,
    pub(super) upstream: Option<SocketAddr>,
    pub(super) waited: Duration,
    /// Set for requests that count as inference outcomes in metrics.
    pub(super) inference: bool,
    /// How the request ended when not simply proxied, for metrics, the
    /// access log and its trace.
    pub(crate) ending: Ending,
    pub(super) facts: Facts,
    /// Whether its answer tells why its endpoint was chosen.
    pub(super) explain: Explain,
    /// Its trace, when traces are on ([`crate::observe::traces`]).
    /// Boxed: a request without one (traces off) carries only a pointer.
    pub(super) trace: Option<Box<RequestTrace>>,
    /// Requests waiting in the buffer when it was admitted (traced ones).
    pub(super) waiting_ahead: usize,
    /// What it asked of flow control, kept to ask again on a retry.
    pub(super) meta: Option<RequestMeta>,
    /// Its retries on other endpoints.
    pub(super) retry: Retries,
    /// The engine's answer as it comes.
    pub(super) answer: EngineAnswer,
    /// `x-request-id`, and whether the client sent it.
    pub(crate) request_id: super::RequestId,
    pub(super) request_id_given: bool,
    /// What the request's API key grants, when keys are required.
    pub(crate) grant: Option<Grant>,
    /// Its quotas' state, for the `x-ratelimit-*` headers.
    pub(super) rate_headers: Vec<(&'static str, String)>,
    /// The rules as they were when the request arrived.
    pub(crate) rules: Arc<DoorRules>,
    /// Timing and usage of the answer as it passes.
    pub(super) meter: ResponseMeter,
    /// Counts the request as under way until the context is dropped.
    pub(super) active: Option<ActiveRequest>,
    /// This context only carries a parked request to the connection
    /// (taken by `persist_connection_context`, which gets `&RequestCtx`).
    pub(super) parked: std::sync::Mutex<Option<Box<parking::Parked>>>,
    /// A parked request is back: how its wait ended.
    pub(super) resume: Option<std::result::Result<Admitted, AdmitError>>,
}

impl RequestCtx {
    /// A new request's context under `rules` (the rules as it arrives).
    pub(super) fn new(rules: Arc<DoorRules>) -> RequestCtx {
        RequestCtx {
            start: Instant::now(),
            body: Body::default(),
            served: None,
            upstream: None,
            waited: Duration::ZERO,
            inference: false,
            ending: Ending::Proxied,
            facts: Facts::default(),
            explain: Explain::No,
            trace: None,
            waiting_ahead: 0,
            meta: None,
            retry: Retries::default(),
            answer: EngineAnswer::default(),
            request_id: super::RequestId::default(),
            request_id_given: false,
            grant: None,
            rate_headers: Vec::new(),
            rules,
            meter: ResponseMeter::default(),
            active: None,
            parked: std::sync::Mutex::new(None),
            resume: None,
        }
    }

    /// Its slot, while it holds one.
    pub(super) fn lease(&self) -> Option<&LeaseGuard> {
        self.served.as_ref()?.lease()
    }
}
