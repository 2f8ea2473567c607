//! Flowgate core: the pure logic of the LLM traffic manager.
//!
//! Nothing here opens a socket or reads a clock: every function takes the
//! current [`std::time::Instant`] as an argument, so the policies are tested
//! with a controlled clock. The `balancer` binary wraps this in Pingora.
//!
//! - [`protocol`]: the agent → balancer report format.
//! - [`endpoint`]: per-endpoint capacity accounting and selection.
//! - [`dispatcher`]: the FIFO request buffer in front of the endpoints.
//! - [`openai`]: OpenAI-style error bodies shared by the binaries.

pub mod dispatcher;
pub mod endpoint;
pub mod openai;
pub mod protocol;

pub use dispatcher::{Admission, BufferConfig, Dispatcher, Grant, Reject, Ticket};
pub use endpoint::{EndpointId, EndpointSnapshot, Lease, ReportOutcome};
pub use protocol::{AgentReport, BackendHealth, BackendKind, PROTOCOL_VERSION};
