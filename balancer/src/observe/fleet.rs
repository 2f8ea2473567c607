//! The fleet as `/metrics` shows it: the buffer, the flows, every
//! endpoint's slots and state (gauges refreshed from a snapshot at scrape
//! time, so a departed endpoint leaves no stale series), and what happened
//! to the fleet (reports, circuit breakers, affinity holds).

use prometheus::{
    Gauge, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use super::adapters::AdapterMetrics;
use super::cache::CacheMetrics;
use super::cost::CostMetrics;
use super::family::{endpoint_labels, register};
use super::kv_events::KvEventMetrics;
use flowgate::{EndpointSnapshot, Snapshot};

pub struct FleetMetrics {
    /// Agent reports accepted / refused.
    pub reports: IntCounterVec,
    buffered: IntGauge,
    buffer_capacity: IntGauge,
    buffered_bytes: IntGauge,
    buffered_tokens: IntGauge,
    in_flight: IntGauge,
    sessions: IntGauge,
    unserved_demand: IntGaugeVec,
    flow_queue_size: IntGaugeVec,
    flow_queue_bytes: IntGaugeVec,
    pool_saturation: Gauge,
    /// Times an endpoint's circuit breaker opened.
    pub circuit_opened: IntCounter,
    /// Requests that waited for a busy endpoint caching their prompt.
    pub affinity_holds: IntCounter,
    /// Every endpoint's slots and state.
    endpoints: EndpointGauges,
    /// What every endpoint's engine said it reused.
    cache: CacheMetrics,
    /// What every endpoint's engine costs, as learned.
    cost: CostMetrics,
    adapters: AdapterMetrics,
    kv_events: KvEventMetrics,
}

impl FleetMetrics {
    pub fn new(registry: &Registry) -> Self {
        FleetMetrics {
            reports: register(
                registry,
                IntCounterVec::new(
                    Opts::new("flowgate_agent_reports_total", "Agent reports by result"),
                    &["result"],
                ),
            ),
            buffered: register(
                registry,
                IntGauge::new(
                    "flowgate_buffered_requests",
                    "Requests waiting in the buffer now",
                ),
            ),
            buffer_capacity: register(
                registry,
                IntGauge::new(
                    "flowgate_buffer_capacity",
                    "Most requests that may wait (--max-buffered-requests)",
                ),
            ),
            buffered_bytes: register(
                registry,
                IntGauge::new(
                    "flowgate_buffered_bytes",
                    "Request-body bytes waiting in the buffer now",
                ),
            ),
            buffered_tokens: register(
                registry,
                IntGauge::new(
                    "flowgate_buffered_tokens",
                    "Estimated tokens (prompt + output bound) of the requests waiting in the \
                     buffer now",
                ),
            ),
            in_flight: register(
                registry,
                IntGauge::new(
                    "flowgate_in_flight_requests",
                    "Requests sent to model servers and not finished",
                ),
            ),
            sessions: register(
                registry,
                IntGauge::new(
                    "flowgate_sessions",
                    "Sessions bound to the endpoint of their last turn (scheduling.sessions)",
                ),
            ),
            unserved_demand: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_unserved_demand_requests",
                        "Requests waiting for a model that no live endpoint serves \
                     (scale-up signal; model \"\" = requests naming no model)",
                    ),
                    &["model"],
                ),
            ),
            flow_queue_size: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "inference_extension_flow_control_queue_size",
                        "Requests waiting in flow control, per flow",
                    ),
                    &["fairness_id", "priority"],
                ),
            ),
            flow_queue_bytes: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "inference_extension_flow_control_queue_bytes",
                        "Request-body bytes waiting in flow control, per flow",
                    ),
                    &["fairness_id", "priority"],
                ),
            ),
            pool_saturation: register(
                registry,
                Gauge::new(
                    "inference_extension_flow_control_pool_saturation",
                    "Share of eligible endpoints that are saturated (1 when none is eligible)",
                ),
            ),
            circuit_opened: register(
                registry,
                IntCounter::new(
                    "flowgate_circuit_breaker_opened_total",
                    "Times an endpoint's circuit breaker opened after repeated failures",
                ),
            ),
            affinity_holds: register(
                registry,
                IntCounter::new(
                    "flowgate_affinity_holds_total",
                    "Queued requests that chose to wait for a busy endpoint caching their \
                 prompt or holding their session instead of taking a free one (the \
                 wait-or-go rule, bounded by scheduling.affinityHold)",
                ),
            ),
            endpoints: EndpointGauges::new(registry),
            cache: CacheMetrics::new(registry),
            cost: CostMetrics::new(registry),
            adapters: AdapterMetrics::new(registry),
            kv_events: KvEventMetrics::new(registry),
        }
    }

    /// Sets the state gauges from `snap`.
    pub fn refresh(&self, snap: &Snapshot) {
        self.buffered.set(snap.buffered as i64);
        self.buffered_bytes.set(snap.buffered_bytes as i64);
        self.buffered_tokens
            .set(i64::try_from(snap.buffered_tokens).unwrap_or(i64::MAX));
        self.buffer_capacity.set(snap.max_buffered_requests as i64);
        self.flow_queue_size.reset();
        self.flow_queue_bytes.reset();
        for f in &snap.flows {
            let labels = [f.fairness_id.as_str(), &f.priority.to_string()];
            self.flow_queue_size
                .with_label_values(&labels)
                .set(f.requests as i64);
            self.flow_queue_bytes
                .with_label_values(&labels)
                .set(f.bytes as i64);
        }
        let eligible = snap.endpoints.iter().filter(|e| e.eligible).count();
        let saturated = snap
            .endpoints
            .iter()
            .filter(|e| e.eligible && e.saturation.is_some())
            .count();
        self.pool_saturation.set(if eligible == 0 {
            1.0
        } else {
            saturated as f64 / eligible as f64
        });
        self.in_flight.set(snap.in_flight as i64);
        self.sessions.set(snap.sessions as i64);
        self.unserved_demand.reset();
        for (model, n) in &snap.unserved {
            self.unserved_demand
                .with_label_values(&[model.as_deref().unwrap_or("")])
                .set(*n as i64);
        }
        self.endpoints.refresh(&snap.endpoints);
        self.cache.refresh(&snap.endpoints);
        self.cost.refresh(&snap.endpoints);
        self.adapters.refresh(&snap.endpoints);
        self.kv_events.refresh(&snap.endpoints);
    }
}

/// Per-endpoint gauges, one series per endpoint (and agent) now known.
struct EndpointGauges {
    agents: IntGauge,
    endpoint_in_flight: IntGaugeVec,
    endpoint_in_flight_tokens: IntGaugeVec,
    endpoint_slots: IntGaugeVec,
    endpoint_waiting: IntGaugeVec,
    endpoint_report_age: GaugeVec,
    endpoint_kv_cache: GaugeVec,
    endpoint_kv_capacity: IntGaugeVec,
    endpoint_eligible: IntGaugeVec,
    endpoint_saturated: IntGaugeVec,
    endpoint_circuit_open: IntGaugeVec,
}

impl EndpointGauges {
    fn new(registry: &Registry) -> Self {
        let ep = &["endpoint", "agent"];
        EndpointGauges {
            agents: register(
                registry,
                IntGauge::new("flowgate_agents", "Agents currently registered"),
            ),
            endpoint_in_flight: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_in_flight_requests",
                        "Requests in flight per endpoint (the balancer's own count)",
                    ),
                    ep,
                ),
            ),
            endpoint_in_flight_tokens: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_in_flight_tokens",
                        "Estimated tokens of the requests in flight per endpoint (what \
                     saturationDetector.tokenBudget counts)",
                    ),
                    ep,
                ),
            ),
            endpoint_slots: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_slots",
                        "Slots per endpoint: idle (free for the balancer) or busy",
                    ),
                    &["endpoint", "agent", "state"],
                ),
            ),
            endpoint_waiting: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_waiting_requests",
                        "Requests waiting inside the model server, as its agent reported",
                    ),
                    ep,
                ),
            ),
            endpoint_report_age: register(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_report_age_seconds",
                        "Age of the last agent report per endpoint",
                    ),
                    ep,
                ),
            ),
            endpoint_kv_cache: register(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_kv_cache_usage_ratio",
                        "KV-cache use per endpoint (0 to 1), as its agent reported; absent when \
                     the engine does not say",
                    ),
                    ep,
                ),
            ),
            endpoint_kv_capacity: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_kv_capacity_tokens",
                        "Tokens the endpoint's KV cache holds in all, as its agent reported \
                     (llama.cpp: every slot's context; vLLM: GPU blocks x block size; SGLang: \
                     max_total_num_tokens); absent when the engine does not say",
                    ),
                    ep,
                ),
            ),
            endpoint_eligible: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_eligible",
                        "1 when the endpoint may receive new requests",
                    ),
                    ep,
                ),
            ),
            endpoint_saturated: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_saturated",
                        "1 when an eligible endpoint takes no new work, by reason \
                     (slots-full, queue-depth, kv-cache, token-budget, stale-metrics)",
                    ),
                    &["endpoint", "agent", "reason"],
                ),
            ),
            endpoint_circuit_open: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "flowgate_endpoint_circuit_open",
                        "1 while the endpoint's circuit breaker keeps it out of rotation",
                    ),
                    &["endpoint", "agent"],
                ),
            ),
        }
    }

    /// Resets every series and sets those of the endpoints known now.
    fn refresh(&self, endpoints: &[EndpointSnapshot]) {
        self.agents
            .set(endpoints.iter().filter(|e| e.agent.is_some()).count() as i64);
        for v in [
            &self.endpoint_in_flight,
            &self.endpoint_in_flight_tokens,
            &self.endpoint_slots,
            &self.endpoint_waiting,
            &self.endpoint_eligible,
            &self.endpoint_saturated,
            &self.endpoint_circuit_open,
        ] {
            v.reset();
        }
        self.endpoint_report_age.reset();
        self.endpoint_kv_cache.reset();
        self.endpoint_kv_capacity.reset();
        for e in endpoints {
            let (endpoint, agent, _) = endpoint_labels(e);
            let labels = [endpoint.as_str(), agent];
            self.endpoint_in_flight
                .with_label_values(&labels)
                .set(i64::from(e.in_flight));
            self.endpoint_in_flight_tokens
                .with_label_values(&labels)
                .set(i64::try_from(e.in_flight_tokens).unwrap_or(i64::MAX));
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
                if let Some(kv) = a.kv_cache_usage {
                    self.endpoint_kv_cache.with_label_values(&labels).set(kv);
                }
                if let Some(tokens) = a.kv_capacity_tokens {
                    // Reports are bounded to 2^40 tokens: fits an i64.
                    self.endpoint_kv_capacity
                        .with_label_values(&labels)
                        .set(i64::try_from(tokens).unwrap_or(i64::MAX));
                }
            }
            if let Some(age) = e.report_age_ms {
                self.endpoint_report_age
                    .with_label_values(&labels)
                    .set(age as f64 / 1000.0);
            }
            self.endpoint_eligible
                .with_label_values(&labels)
                .set(i64::from(e.eligible));
            self.endpoint_circuit_open
                .with_label_values(&labels)
                .set(i64::from(e.circuit_open_ms.is_some()));
            if let Some(reason) = e.saturation {
                self.endpoint_saturated
                    .with_label_values(&[&endpoint, agent, reason.as_str()])
                    .set(1);
            }
        }
    }
}
