//! Latency objectives as `/metrics` shows them ([`flowgate::objective`]):
//! per model and tenant, the answered requests with an objective that met
//! or missed each part of it, and those that met every part (their rate is
//! the goodput). Tenants are bounded as in [`super::tenants`]: the first
//! [`super::tenants::MAX_TENANT_LABELS`] get their own series, later ones
//! count as [`flowgate::usage::OTHER`].

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use prometheus::{IntCounterVec, Opts, Registry};

use super::family::register;
use super::tenants::MAX_TENANT_LABELS;
use flowgate::objective::Objective;

pub struct ObjectiveMetrics {
    attainment: IntCounterVec,
    goodput: IntCounterVec,
    /// Answered requests with an objective, and those that met every part
    /// of it, over all models and tenants: the dashboard's history.
    answered: AtomicU64,
    met: AtomicU64,
    /// Tenants with series of their own.
    labelled: Mutex<HashSet<Box<str>>>,
}

impl ObjectiveMetrics {
    pub fn new(registry: &Registry) -> Self {
        let attainment = register(
            registry,
            IntCounterVec::new(
                Opts::new(
                    "flowgate_objective_requests_total",
                    "Answered requests with a latency objective, by part (ttft: time to first \
                     token from arrival; tpot: time per output token) and whether they met it \
                     (met, missed); tenants beyond the first 256 are counted as (other)",
                ),
                &["model", "tenant", "part", "result"],
            ),
        );
        let goodput = register(
            registry,
            IntCounterVec::new(
                Opts::new(
                    "flowgate_objective_goodput_total",
                    "Answered requests with a latency objective that met every part of it \
                     (its rate: the goodput)",
                ),
                &["model", "tenant"],
            ),
        );
        ObjectiveMetrics {
            attainment,
            goodput,
            answered: AtomicU64::new(0),
            met: AtomicU64::new(0),
            labelled: Mutex::new(HashSet::new()),
        }
    }

    /// Counts one answered request of `tenant` for `model` with objective
    /// `objective`: its first token came `ttft` after it arrived (a whole
    /// answer's: when it came; `None`: nothing came, a miss), the others
    /// `tpot` apart (`None`: a whole answer, which does not tell: the part
    /// is not counted).
    pub fn record(
        &self,
        model: &str,
        tenant: &str,
        objective: Objective,
        ttft: Option<Duration>,
        tpot: Option<Duration>,
    ) {
        if objective.is_none() {
            return;
        }
        let tenant = self.label(tenant);
        let mut all_met = true;
        for (part, limit, took) in [
            ("ttft", objective.ttft_ms, ttft),
            ("tpot", objective.tpot_ms, tpot),
        ] {
            let Some(limit) = limit else {
                continue;
            };
            if part == "tpot" && took.is_none() {
                continue;
            }
            let met = took.is_some_and(|t| t <= Duration::from_millis(u64::from(limit)));
            all_met &= met;
            let result = if met { "met" } else { "missed" };
            self.attainment
                .with_label_values(&[model, tenant, part, result])
                .inc();
        }
        self.answered.fetch_add(1, Ordering::Relaxed);
        if all_met {
            self.goodput.with_label_values(&[model, tenant]).inc();
            self.met.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Answered requests with an objective so far, and those that met it.
    pub fn totals(&self) -> (u64, u64) {
        (
            self.answered.load(Ordering::Relaxed),
            self.met.load(Ordering::Relaxed),
        )
    }

    /// `tenant`'s label: its own while the bound allows.
    fn label<'a>(&self, tenant: &'a str) -> &'a str {
        let mut labelled = self
            .labelled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if labelled.contains(tenant) {
            return tenant;
        }
        if labelled.len() < MAX_TENANT_LABELS {
            labelled.insert(tenant.into());
            return tenant;
        }
        flowgate::usage::OTHER
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_part_is_met_or_missed_and_goodput_counts_requests_that_met_all() {
        let registry = Registry::new();
        let m = ObjectiveMetrics::new(&registry);
        let o = Objective {
            ttft_ms: Some(500),
            tpot_ms: Some(50),
        };
        let ms = Duration::from_millis;
        m.record("m", "a", o, Some(ms(400)), Some(ms(40)));
        m.record("m", "a", o, Some(ms(600)), Some(ms(40)));
        m.record("m", "a", o, None, None);
        m.record("m", "a", Objective::default(), Some(ms(1)), None);
        let count = |part, result| {
            m.attainment
                .with_label_values(&["m", "a", part, result])
                .get()
        };
        assert_eq!((count("ttft", "met"), count("ttft", "missed")), (1, 2));
        assert_eq!(
            (count("tpot", "met"), count("tpot", "missed")),
            (2, 0),
            "a whole answer does not tell its time per token"
        );
        assert_eq!(m.goodput.with_label_values(&["m", "a"]).get(), 1);
        for i in 0..MAX_TENANT_LABELS + 5 {
            m.record("m", &format!("t{i}"), o, Some(ms(1)), Some(ms(1)));
        }
        assert_eq!(m.labelled.lock().unwrap().len(), MAX_TENANT_LABELS);
        assert!(
            m.goodput
                .with_label_values(&["m", flowgate::usage::OTHER])
                .get()
                >= 5
        );
    }
}
