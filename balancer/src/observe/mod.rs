//! What the balancer measures and shows: Prometheus metrics ([`metrics`]:
//! the request path; [`fleet`]: the buffer and endpoints; [`clients`]:
//! client connections and limits; [`tenants`]: what each tenant spent; a component with metrics of its own
//! registers them beside itself, as the async queue, EPP mode and the
//! scale-up webhook do), the timing and
//! usage of an answer as it passes ([`meter`]), and the dashboard's last
//! minutes of traffic ([`history`]).

pub mod adapters;
pub mod cache;
pub mod clients;
pub mod cost;
pub mod family;
pub mod fleet;
pub mod flow;
pub mod history;
pub mod kv_events;
pub mod meter;
pub mod metrics;
pub mod objectives;
pub mod tenants;
pub mod traces;
