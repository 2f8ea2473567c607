//! Prometheus metrics of the balancer (text exposition on `GET /metrics`).
//!
//! Counters and the wait histogram are updated on the request path; gauges
//! that describe current state (buffer, endpoints) are filled from a
//! snapshot at scrape time, so a departed endpoint leaves no stale series.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::state::Snapshot;

pub struct Metrics {
    registry: Registry,
    /// Requests by final HTTP status and drop reason (empty when served).
    pub requests: IntCounterVec,
    /// Requests that had to wait in the buffer.
    pub buffered_total: IntCounter,
    /// Seconds spent waiting in the buffer, for requests that waited.
    pub buffer_wait: Histogram,
    /// Agent reports accepted / refused.
    pub reports: IntCounterVec,
    buffered: IntGauge,
    buffer_capacity: IntGauge,
    in_flight: IntGauge,
    agents: IntGauge,
    endpoint_in_flight: IntGaugeVec,
    endpoint_slots: IntGaugeVec,
    endpoint_waiting: IntGaugeVec,
    endpoint_report_age: prometheus::GaugeVec,
    endpoint_eligible: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        macro_rules! register {
            ($metric:expr) => {{
                let m = $metric.expect("valid metric definition");
                registry
                    .register(Box::new(m.clone()))
                    .expect("metric registered once");
                m
            }};
        }
        let ep = &["endpoint", "agent"];
        Metrics {
            requests: register!(IntCounterVec::new(
                Opts::new(
                    "flowgate_requests_total",
                    "Inference requests by final HTTP status and drop reason"
                ),
                &["code", "reason"]
            )),
            buffered_total: register!(IntCounter::new(
                "flowgate_buffered_requests_total",
                "Requests that waited in the buffer for a free slot"
            )),
            buffer_wait: register!(Histogram::with_opts(
                HistogramOpts::new(
                    "flowgate_buffer_wait_seconds",
                    "Time requests spent waiting in the buffer"
                )
                .buckets(vec![
                    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0
                ])
            )),
            reports: register!(IntCounterVec::new(
                Opts::new("flowgate_agent_reports_total", "Agent reports by result"),
                &["result"]
            )),
            buffered: register!(IntGauge::new(
                "flowgate_buffered_requests",
                "Requests waiting in the buffer now"
            )),
            buffer_capacity: register!(IntGauge::new(
                "flowgate_buffer_capacity",
                "Most requests that may wait (--max-buffered-requests)"
            )),
            in_flight: register!(IntGauge::new(
                "flowgate_in_flight_requests",
                "Requests sent to model servers and not finished"
            )),
            agents: register!(IntGauge::new(
                "flowgate_agents",
                "Agents currently registered"
            )),
            endpoint_in_flight: register!(IntGaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_in_flight_requests",
                    "Requests in flight per endpoint (the balancer's own count)"
                ),
                ep
            )),
            endpoint_slots: register!(IntGaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_slots",
                    "Slots per endpoint: idle (free for the balancer) or busy"
                ),
                &["endpoint", "agent", "state"]
            )),
            endpoint_waiting: register!(IntGaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_waiting_requests",
                    "Requests waiting inside the model server, as its agent reported"
                ),
                ep
            )),
            endpoint_report_age: register!(prometheus::GaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_report_age_seconds",
                    "Age of the last agent report per endpoint"
                ),
                ep
            )),
            endpoint_eligible: register!(IntGaugeVec::new(
                Opts::new(
                    "flowgate_endpoint_eligible",
                    "1 when the endpoint may receive new requests"
                ),
                ep
            )),
            registry,
        }
    }

    /// Counts a finished inference request.
    pub fn record_outcome(&self, code: u16, reason: &str) {
        self.requests
            .with_label_values(&[&code.to_string(), reason])
            .inc();
    }

    /// Renders the text exposition, refreshing state gauges from `snap`.
    pub fn render(&self, snap: &Snapshot) -> Vec<u8> {
        self.buffered.set(snap.buffered as i64);
        self.buffer_capacity.set(snap.config.max_buffered as i64);
        self.in_flight.set(snap.in_flight as i64);
        self.agents
            .set(snap.endpoints.iter().filter(|e| e.agent.is_some()).count() as i64);
        for v in [
            &self.endpoint_in_flight,
            &self.endpoint_slots,
            &self.endpoint_waiting,
            &self.endpoint_eligible,
        ] {
            v.reset();
        }
        self.endpoint_report_age.reset();
        for e in &snap.endpoints {
            let endpoint = e.addr.to_string();
            let agent = e.agent.as_ref().map_or("", |a| a.agent_id.as_str());
            let labels = [endpoint.as_str(), agent];
            self.endpoint_in_flight
                .with_label_values(&labels)
                .set(i64::from(e.in_flight));
            let total = e.agent.as_ref().map_or(0, |a| a.slots_total);
            let idle = e.free_slots;
            self.endpoint_slots
                .with_label_values(&[&endpoint, agent, "idle"])
                .set(i64::from(idle));
            self.endpoint_slots
                .with_label_values(&[&endpoint, agent, "busy"])
                .set(i64::from(total.saturating_sub(idle)));
            if let Some(a) = &e.agent {
                self.endpoint_waiting
                    .with_label_values(&labels)
                    .set(i64::from(a.requests_waiting));
            }
            if let Some(age) = e.report_age_ms {
                self.endpoint_report_age
                    .with_label_values(&labels)
                    .set(age as f64 / 1000.0);
            }
            self.endpoint_eligible
                .with_label_values(&labels)
                .set(i64::from(e.eligible));
        }
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding into a Vec cannot fail");
        out
    }
}
