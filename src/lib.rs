//! Flowgate core: the pure logic of the LLM traffic manager.
//!
//! Nothing here opens a socket or reads a clock: every function takes the
//! current [`std::time::Instant`] as an argument, so the policies are tested
//! with a controlled clock. The `balancer` binary wraps this in Pingora.
//!
//! - [`protocol`]: the agent → balancer report format.
//! - [`adapter`]: LoRA adapters: how ready an endpoint is to serve one,
//!   and where one goes that no endpoint holds.
//! - [`admission`]: a request's facts (model, flow, TTL, route) from its
//!   headers, body and caller, the same for every front door.
//! - [`endpoint`]: per-endpoint capacity accounting and circuit breaker:
//!   the fleet as the balancer counts it.
//! - [`placement`]: which endpoint a request goes to, or whether it waits:
//!   the whole rule, stage by stage.
//! - [`scorer`]: the weighted scorers that pick an endpoint.
//! - [`prefix`]: prompt block hashing and the per-endpoint prefix index.
//! - [`kv_events`]: the engines' own KV-cache events: decoded, keyed by
//!   their tokens, and indexed per engine.
//! - [`session`]: session keys clients send and the endpoint each
//!   conversation was last served by.
//! - [`turn`]: a conversation sent without a key, named turn by turn by
//!   its prompts (followed across balancers through the session store).
//! - [`flow`]: flow-controlled queues (priority bands, tenant fairness,
//!   ordering, capacity limits, deadlines).
//! - [`blame`]: whose fault a failed answer is (the endpoint's or the
//!   request's).
//! - [`dispatcher`]: the queues in front of the endpoints: admission,
//!   dispatch, expiry.
//! - [`duration`]: `250ms` / `10s` / `2m` / `1h` / `7d` parsing for flags, config and
//!   headers.
//! - [`models`]: which served model a requested name goes to (aliases,
//!   weighted rewrites, a default model, fallback chains).
//! - [`objective`]: a request's latency objective (time to first token,
//!   time per output token), from its headers or the operator's defaults.
//! - [`multipart`]: `multipart/form-data` bodies (uploads, audio requests).
//! - [`openai`]: OpenAI-style error bodies shared by the binaries.
//! - [`tokens`]: a request's cost in tokens, estimated at admission and
//!   learned per model from the engines' answers.
//! - [`usage`]: tokens and requests spent per tenant and API key, by minute.
//! - [`quota`]: requests and tokens per minute and requests in flight per
//!   tenant and key, reserved at admission and settled at the end.

pub mod adapter;
pub mod admission;
pub mod blame;
pub mod budget;
pub mod dispatcher;
pub mod duration;
pub mod endpoint;
pub mod flow;
pub mod kv_events;
pub(crate) mod lru;
pub mod models;
pub mod multipart;
pub mod objective;
pub mod openai;
pub mod placement;
pub mod prefix;
pub mod protocol;
pub mod quota;
pub mod scorer;
pub mod session;
pub mod shares;
pub mod tokens;
pub mod turn;
pub mod usage;

pub use dispatcher::{
    Admission, Dispatcher, DispatcherConfig, Done, HoldsBegun, Reject, RequestMeta, Snapshot,
    Ticket,
};
pub use endpoint::{
    BreakerConfig, EndpointId, EndpointSnapshot, Lease, ReportOutcome, Route, Saturation,
    SaturationConfig, SchedulingConfig,
};
pub use flow::{
    BandConfig, FairnessPolicy, FlowControlConfig, FlowKey, FlowSnapshot, OrderingPolicy,
};
pub use prefix::PrefixConfig;
pub use protocol::{AgentReport, BackendHealth, BackendKind, PROTOCOL_VERSION};
pub use scorer::ScorerWeights;
pub use session::{SessionConfig, SessionRules, SessionSource};
