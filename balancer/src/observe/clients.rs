//! Client connections and requests on the inference port, and what the
//! client limits ([`crate::connection`]) refused.

use prometheus::{IntCounterVec, IntGauge, Opts, Registry};

use super::family::register;

/// Client connections and requests on the inference port, and what the
/// client limits refused.
pub struct ClientMetrics {
    connections: IntGauge,
    /// Client requests from their head to the end of their answer.
    pub requests: IntGauge,
    refusals: IntCounterVec,
}

impl ClientMetrics {
    pub fn new(registry: &Registry) -> Self {
        ClientMetrics {
            connections: register(
                registry,
                IntGauge::new(
                    "flowgate_client_connections",
                    "Client connections open on the inference port",
                ),
            ),
            requests: register(
                registry,
                IntGauge::new(
                    "flowgate_client_requests",
                    "Client requests under way on the inference port, from their head to the end \
                 of their answer (a graceful shutdown waits for them)",
                ),
            ),
            refusals: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "flowgate_client_refusals_total",
                        "Client connections or requests refused by a client limit, by reason \
                     (too_many_connections, header_timeout, header_too_large, body_timeout)",
                    ),
                    &["reason"],
                ),
            ),
        }
    }

    /// Counts an open client connection until the guard is dropped.
    pub fn opened(&self) -> OpenConnection {
        self.connections.inc();
        OpenConnection(self.connections.clone())
    }

    /// Counts a connection or request a client limit refused.
    pub fn refusal(&self, reason: &str) {
        self.refusals.with_label_values(&[reason]).inc();
    }
}

/// Counts an open client connection until dropped (it may move to another
/// task with its connection).
pub struct OpenConnection(IntGauge);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}
