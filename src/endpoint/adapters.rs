//! A request's LoRA adapter on the ledger: where it is resident, the
//! `adapter` scorer's term, and its preferred endpoints
//! ([`crate::adapter`] holds the rule).
//!
//! A route whose model some agent lists as an adapter is an adapter's
//! route. Its candidates are scored over its whole lane (the residency
//! term varies by adapter, so no ranking made for every model can order
//! them); a lane is its model's endpoints, a few where adapters are
//! served. Every other route is placed as before, at no extra cost.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use foldhash::{HashMap, HashSet};

use super::{Endpoint, EndpointId, EndpointLedger, Route};
use crate::adapter::{preferred, residency, Residency};
use crate::protocol::{AdapterReport, AgentReport};

/// A route's adapter, as its candidates are scored.
#[derive(Debug, Clone)]
pub(crate) struct Wanted {
    pub(crate) name: Arc<str>,
    /// Its preferred endpoints ([`crate::adapter::preferred`]).
    pub(crate) preferred: Vec<SocketAddr>,
}

impl Endpoint {
    /// The residency of adapter `name` here.
    pub(crate) fn residency(&self, name: &str) -> Residency {
        residency(self.adapter_report(), &self.adapters_sent, name)
    }

    /// The `adapter` scorer's value here for `wanted` (unweighted);
    /// `None` for a route that names no adapter.
    pub(crate) fn adapter_score(&self, wanted: Option<&Wanted>) -> Option<f64> {
        let w = wanted?;
        Some(
            self.residency(&w.name)
                .score(w.preferred.contains(&self.addr)),
        )
    }

    /// Notes a request for `adapter` sent here at `now`.
    pub(super) fn adapter_sent(&mut self, adapter: &Arc<str>, now: Instant) {
        self.adapters_sent.sent(adapter, now);
    }

    /// Notes that a request for `adapter` here ended.
    pub(super) fn adapter_ended(&mut self, adapter: &str) {
        self.adapters_sent.ended(adapter);
    }

    /// A report came at `now`: what it read of the engine supersedes what
    /// was sent before its read began (a report that does not say when
    /// it read is taken as read one interval before it came).
    pub(super) fn adapters_reported(&mut self, report: &AgentReport, now: Instant) {
        let age = report
            .read_window()
            .map_or(report.monitoring_interval(), |(began, _)| began);
        let began = now
            .checked_sub(age.min(Duration::from_secs(3600)))
            .unwrap_or(now);
        self.adapters_sent.reported(began);
    }
}

/// Notes in `adapter_models` which of a report's models are adapters
/// (`models`: every model name reported; the set is as bounded).
pub(super) fn learn_adapters(
    adapter_models: &mut HashSet<Arc<str>>,
    models: &HashMap<Arc<str>, Instant>,
    report: &AgentReport,
) {
    let Some(adapters) = &report.adapters else {
        return;
    };
    for name in adapters.servable.iter().chain(&adapters.loadable) {
        if adapter_models.contains(name.as_str()) {
            continue;
        }
        if let Some((known, _)) = models.get_key_value(name.as_str()) {
            adapter_models.insert(Arc::clone(known));
        }
    }
}

/// Adapters one answer asks an agent to load at most.
pub const MAX_LOADS_ASKED: usize = 4;

impl Endpoint {
    /// What its agent last said of its adapters.
    fn adapter_report(&self) -> Option<&AdapterReport> {
        self.agent.as_ref().and_then(|a| a.report.adapters.as_ref())
    }

    /// Whether its agent may have its server load `adapter` (lists it
    /// `loadable`).
    fn may_load(&self, adapter: &str) -> bool {
        (self.adapter_report()).is_some_and(|a| a.loadable.iter().any(|n| n == adapter))
    }

    /// Whether a load of `adapter` failed here lately.
    fn failed_to_load(&self, adapter: &str) -> bool {
        (self.adapter_report()).is_some_and(|a| a.load_failed.iter().any(|f| f.name == adapter))
    }

    /// Whether its agent can have its server load `adapter` now: it may,
    /// and no load of it failed lately.
    fn can_load(&self, adapter: &str) -> bool {
        self.may_load(adapter) && !self.failed_to_load(adapter)
    }
}

impl EndpointLedger {
    /// Whether the `queued` requests waiting for adapter `m` want one
    /// more server to load it (`me`, where a load is predicted to take
    /// its learned time): no eligible endpoint serves it, or every one
    /// that does is saturated and its queue is predicted to take longer
    /// to reach the last of them than a load there (the wait-or-go rule's
    /// reasoning: (queued + 1) × service time over those servers' slots),
    /// on service times learned from their answers (the cautious prior
    /// would load an adapter again for every burst of first requests).
    fn wants_another_server(&self, m: &str, queued: usize, me: &Endpoint, now: Instant) -> bool {
        let serving: Vec<&Endpoint> = self.live_serving(m, now).collect();
        if serving.is_empty() {
            return true;
        }
        if serving
            .iter()
            .any(|e| e.available(now, &self.saturation) || e.cost.service_ms.samples() == 0)
        {
            return false;
        }
        let slots: u32 = serving.iter().map(|e| e.slots_total()).sum();
        let service_ms: f64 =
            serving.iter().map(|e| e.cost.service_ms.ms()).sum::<f64>() / serving.len() as f64;
        let wait_ms = (queued as f64 + 1.0) * service_ms / f64::from(slots.max(1));
        wait_ms > me.predicted_adapter_load_ms()
    }

    /// The adapters `id`'s agent should have its server load now, for
    /// the requests `queued` per lane (model): adapters that requests
    /// wait for, that want one more server
    /// ([`EndpointLedger::wants_another_server`]: none serves them, or
    /// their queue costs more than a load), and that of the eligible
    /// endpoints able to load them prefer this one (the first by
    /// rendezvous hash, as [`crate::adapter::preferred`]: every balancer
    /// asks the same agent). Asked again at every report while that
    /// holds; the agent loads each once.
    pub(crate) fn adapters_to_load<'a>(
        &self,
        id: EndpointId,
        queued: impl Iterator<Item = (&'a Option<Arc<str>>, usize)>,
        now: Instant,
    ) -> Vec<Arc<str>> {
        let Some(me) = self.endpoints.get(&id).filter(|e| e.eligible(now)) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (model, n) in queued {
            let Some(m) = (model.as_deref()).filter(|m| n > 0 && self.adapter_models.contains(*m))
            else {
                continue;
            };
            if out.len() == MAX_LOADS_ASKED {
                break;
            }
            if !me.can_load(m) || !self.wants_another_server(m, n, me, now) {
                continue;
            }
            let able = self
                .endpoints
                .values()
                .filter(|e| e.eligible(now) && e.can_load(m))
                .map(|e| e.addr);
            if preferred(m, able, 1).first() == Some(&me.addr) {
                out.extend(self.adapter_models.get(m).cloned());
            }
        }
        out
    }

    /// Whether `route` names an adapter that no eligible endpoint serves
    /// and that every eligible endpoint able to load it failed to load
    /// lately (at least one): waiting cannot help.
    pub(crate) fn adapter_failed_everywhere(&self, route: &Route, now: Instant) -> bool {
        let Some(m) = route.model.as_deref() else {
            return false;
        };
        if !self.adapter_models.contains(m) || self.model_live(m, now) {
            return false;
        }
        let mut able = (self.endpoints.values())
            .filter(|e| e.eligible(now) && e.may_load(m))
            .peekable();
        able.peek().is_some() && able.all(|e| e.failed_to_load(m))
    }

    /// The route's adapter, when its model is one and the `adapter`
    /// scorer is on; its preferred endpoints among the eligible ones
    /// serving it.
    pub(crate) fn adapter_wanted(&self, route: &Route, now: Instant) -> Option<Wanted> {
        let model = route.model.as_deref()?;
        if self.scheduling.scorers.adapter <= 0.0 {
            return None;
        }
        let name = Arc::clone(self.adapter_models.get(model)?);
        let serving = self.live_serving(model, now).map(|e| e.addr);
        let preferred = preferred(model, serving, self.scheduling.adapter_replicas as usize);
        Some(Wanted { name, preferred })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::endpoint::{Timing, COST_WINDOW};
    use crate::protocol::tests::report;

    pub(crate) const ADAPTERS: [&str; 4] = ["a1", "a2", "a3", "a4"];

    /// A vLLM-like report: base model `m` and four adapters, `loaded`
    /// of them loaded (none running), two at most.
    pub(crate) fn with_adapters(
        id: &str,
        port: u16,
        slots: u32,
        loaded: &[&str],
    ) -> (AgentReport, SocketAddr) {
        let addr = format!("127.0.0.1:{port}");
        let mut r = report(id, &addr, slots);
        r.models.extend(ADAPTERS.iter().map(|a| a.to_string()));
        r.adapters = Some(AdapterReport {
            servable: ADAPTERS.iter().map(|a| a.to_string()).collect(),
            running: Vec::new(),
            waiting: Vec::new(),
            loaded: Some(loaded.iter().map(|a| a.to_string()).collect()),
            max_loaded: Some(2),
            ..AdapterReport::default()
        });
        (r, addr.parse().unwrap())
    }

    pub(crate) fn fleet(loaded: [&[&str]; 3], slots: u32, now: Instant) -> EndpointLedger {
        let mut ledger = EndpointLedger::default();
        for (i, l) in loaded.into_iter().enumerate() {
            let (r, addr) = with_adapters(&format!("e{i}"), 1 + i as u16, slots, l);
            ledger.apply_report(r, addr, now);
        }
        ledger
    }

    pub(crate) fn adapter(name: &str) -> Route {
        Route {
            model: Some(name.into()),
            ..Route::default()
        }
    }

    /// Teaches the endpoint of `lease` that a request holds a slot
    /// `service_ms` there.
    pub(crate) fn learn_service(
        ledger: &mut EndpointLedger,
        lease: &crate::endpoint::Lease,
        service_ms: u64,
    ) {
        for _ in 0..COST_WINDOW {
            ledger.observe_timing(
                lease,
                &Timing {
                    service: Some(Duration::from_millis(service_ms)),
                    ..Timing::default()
                },
            );
        }
    }

    fn take(ledger: &mut EndpointLedger, route: &Route, now: Instant) -> crate::endpoint::Lease {
        ledger.acquire(route, now).expect("a lease")
    }

    #[test]
    fn the_preferred_able_server_is_asked_to_load_an_adapter_no_server_serves() {
        let now = Instant::now();
        let mut ledger = EndpointLedger::default();
        // Three servers of base model `m` only, whose agents may load `x`.
        let mut ids = Vec::new();
        for port in 1..=3u16 {
            let addr = format!("127.0.0.1:{port}");
            let mut r = report(&format!("e{port}"), &addr, 1);
            r.adapters = Some(AdapterReport {
                loadable: vec!["x".into()],
                ..AdapterReport::default()
            });
            match ledger.apply_report(r, addr.parse().unwrap(), now) {
                crate::endpoint::ReportOutcome::Registered(id) => ids.push(id),
                other => panic!("{other:?}"),
            }
        }
        let x: Option<Arc<str>> = Some("x".into());
        let asked = |ledger: &EndpointLedger, n: usize| -> Vec<u16> {
            ids.iter()
                .filter(|id| {
                    !ledger
                        .adapters_to_load(**id, [(&x, n)].into_iter(), now)
                        .is_empty()
                })
                .map(|id| ledger.endpoints[id].addr.port())
                .collect()
        };
        assert!(asked(&ledger, 0).is_empty(), "no request waits");
        let first = asked(&ledger, 5);
        assert_eq!(first.len(), 1, "one server asked: {first:?}");
        let able = ledger.endpoints.values().map(|e| e.addr);
        assert_eq!(preferred("x", able, 1)[0].port(), first[0]);
        // Once it serves `x` and takes requests, nobody is asked.
        let addr = format!("127.0.0.1:{}", first[0]);
        let mut r = report("serving", &addr, 1);
        r.agent_id = format!("e{}", first[0]);
        r.models.push("x".into());
        r.adapters = Some(AdapterReport {
            servable: vec!["x".into()],
            ..AdapterReport::default()
        });
        ledger.apply_report(r, addr.parse().unwrap(), now);
        assert!(asked(&ledger, 5).is_empty());
        // Busy, with its service time learned: a queue that costs more
        // than a load (500 ms) asks another server; a short one does not.
        let busy = take(&mut ledger, &adapter("x"), now);
        learn_service(&mut ledger, &busy, 200);
        assert!(asked(&ledger, 1).is_empty(), "400 ms to serve two");
        let more = asked(&ledger, 5);
        assert_eq!(more.len(), 1, "{more:?}");
        assert_ne!(more[0], first[0]);
        ledger.release(busy, now);
    }

    #[test]
    fn load_times_are_learned_from_first_tokens() {
        let now = Instant::now();
        let mut ledger = fleet([&[], &[], &[]], 4, now);
        let lease = take(&mut ledger, &adapter("a1"), now);
        assert!(lease.loads_adapter);
        // 100 tokens at the default 1 ms each, and a 300 ms load.
        ledger.observe_timing(
            &lease,
            &Timing {
                prefilled_tokens: 100,
                prefill: Some(Duration::from_millis(400)),
                ..Timing::default()
            },
        );
        let e = &ledger.endpoints[&lease.endpoint];
        assert_eq!(e.predicted_adapter_load_ms(), 300.0);
        assert_eq!(
            e.cost.prefill_ms_per_token.samples(),
            0,
            "not a prefill rate"
        );
        ledger.release(lease, now);
    }
}
