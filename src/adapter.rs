//! LoRA adapters: how ready an endpoint is to serve a request's adapter,
//! and where an adapter goes that no endpoint holds.
//!
//! A request names an adapter as its `model` (the OpenAI convention). An
//! engine holds a few adapters loaded at once (vLLM's `--max-loras`); a
//! request for one it does not hold waits for a load (hundreds of
//! milliseconds to seconds) that evicts another. So the `adapter` scorer
//! rates each candidate by the adapter's [`Residency`] there, best first:
//!
//! | residency | score | preferred endpoint |
//! |---|---|---|
//! | running: requests for it run there | 1.0 | 1.0 |
//! | loaded, idle | 0.8 | 0.8 |
//! | not loaded, room to load it | 0.4 | 0.6 |
//! | not loaded, a load evicts another | 0.0 | 0.2 |
//!
//! An adapter's *preferred* endpoints are the [`SchedulingConfig`]'s
//! `adapterReplicas` endpoints serving it with the highest rendezvous
//! hash of (adapter, address) ([`preferred`]): every balancer computes
//! the same from the same fleet, so balancers sharing it load an adapter
//! in the same places without sharing any state, and the adapters spread
//! evenly over the fleet. Residency outranks preference: a load into free
//! room evicts nobody's adapter, where a preferred but full endpoint
//! would.
//!
//! What an endpoint holds is its agent's last report ([`AdapterReport`]:
//! vLLM's `vllm:lora_requests_info` and `vllm:lora_adapter_loaded`) and
//! what this balancer sent there since ([`Sent`]): an adapter sent there
//! is being loaded or is loaded, whatever a report read before it says,
//! so the next requests for it follow it there instead of loading it on
//! a third endpoint.
//!
//! [`SchedulingConfig`]: crate::endpoint::SchedulingConfig

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::protocol::AdapterReport;

/// How ready an endpoint is to serve an adapter, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Residency {
    /// Requests for it run there now.
    Running,
    /// Loaded, no request running.
    Loaded,
    /// Not loaded; the engine has room to load it without an eviction.
    Room,
    /// Not loaded; loading it evicts another adapter.
    Evict,
}

impl Residency {
    /// The `adapter` scorer's value (module docs), before its weight.
    pub fn score(self, preferred: bool) -> f64 {
        let bonus = if preferred { 0.2 } else { 0.0 };
        match self {
            Residency::Running => 1.0,
            Residency::Loaded => 0.8,
            Residency::Room => 0.4 + bonus,
            Residency::Evict => bonus,
        }
    }

    /// Whether a request sent there waits for the adapter to load first.
    pub fn loads(self) -> bool {
        matches!(self, Residency::Room | Residency::Evict)
    }
}

/// Adapters this balancer sent to one endpoint: those with requests in
/// flight there, and those sent since the engine read behind its last
/// report began (that read may not show them yet). Bounded: one entry per
/// adapter in flight plus at most [`Sent::MAX_SETTLED`] others.
#[derive(Debug, Default, Clone)]
pub struct Sent {
    entries: Vec<SentAdapter>,
}

#[derive(Debug, Clone)]
struct SentAdapter {
    name: Arc<str>,
    in_flight: u32,
    last_sent: Instant,
}

impl Sent {
    /// Adapters with nothing in flight kept at most between reports (the
    /// oldest go first): more than an engine holds loaded at once.
    pub const MAX_SETTLED: usize = 64;

    /// A request for `name` was sent there at `now`.
    pub fn sent(&mut self, name: &Arc<str>, now: Instant) {
        match self.entries.iter_mut().find(|e| e.name == *name) {
            Some(e) => {
                e.in_flight += 1;
                e.last_sent = now;
            }
            None => self.entries.push(SentAdapter {
                name: Arc::clone(name),
                in_flight: 1,
                last_sent: now,
            }),
        }
        self.trim();
    }

    /// A request for `name` there ended (or its client left).
    pub fn ended(&mut self, name: &str) {
        if let Some(e) = self.entries.iter_mut().find(|e| &*e.name == name) {
            e.in_flight = e.in_flight.saturating_sub(1);
        }
        self.trim();
    }

    /// A report whose engine read began at `read_began` came: what was
    /// sent before and has nothing in flight is the report's to tell.
    pub fn reported(&mut self, read_began: Instant) {
        self.entries
            .retain(|e| e.in_flight > 0 || e.last_sent >= read_began);
    }

    fn in_flight(&self, name: &str) -> bool {
        self.entries
            .iter()
            .any(|e| &*e.name == name && e.in_flight > 0)
    }

    fn has(&self, name: &str) -> bool {
        self.entries.iter().any(|e| &*e.name == name)
    }

    fn trim(&mut self) {
        let settled = self.entries.iter().filter(|e| e.in_flight == 0).count();
        if settled > Self::MAX_SETTLED {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.in_flight == 0)
                .min_by_key(|(_, e)| e.last_sent)
                .map(|(i, _)| i);
            if let Some(i) = oldest {
                self.entries.swap_remove(i);
            }
        }
    }
}

/// The residency of adapter `name` on an endpoint whose agent said
/// `report` (`None`: it says nothing of adapters) and to which this
/// balancer sent `sent`. An engine that does not say what it holds
/// loaded is taken to hold what runs there; one that does not say how
/// many it holds has room.
pub fn residency(report: Option<&AdapterReport>, sent: &Sent, name: &str) -> Residency {
    let listed = |names: &[String]| names.iter().any(|n| n == name);
    let running = report.is_some_and(|r| listed(&r.running));
    if running || sent.in_flight(name) {
        return Residency::Running;
    }
    let loaded_list = report.map(|r| r.loaded.as_deref().unwrap_or(&r.running));
    if sent.has(name) || loaded_list.is_some_and(listed) {
        return Residency::Loaded;
    }
    let Some(max) = report.and_then(|r| r.max_loaded) else {
        return Residency::Room;
    };
    let loaded = loaded_list.unwrap_or_default();
    let also_sent = sent
        .entries
        .iter()
        .filter(|e| !loaded.iter().any(|n| *n == *e.name))
        .count();
    if loaded.len() + also_sent < max as usize {
        Residency::Room
    } else {
        Residency::Evict
    }
}

/// The key an adapter's rendezvous hashes are taken with.
fn key(adapter: &str) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    adapter.hash(&mut h);
    h.finish()
}

/// Adapter `name`'s preferred endpoints among `serving` (module docs):
/// the `replicas` with the highest rendezvous hash, best first.
pub fn preferred(
    name: &str,
    serving: impl Iterator<Item = SocketAddr>,
    replicas: usize,
) -> Vec<SocketAddr> {
    if replicas == 0 {
        return Vec::new();
    }
    let key = key(name);
    let mut top: Vec<(u64, SocketAddr)> = Vec::with_capacity(replicas + 1);
    for addr in serving {
        let h = crate::session::rendezvous(key, addr);
        if top.len() == replicas && top.last().is_some_and(|&low| (h, addr) <= low) {
            continue;
        }
        let at = top.partition_point(|&(x, a)| (x, a) > (h, addr));
        top.insert(at, (h, addr));
        top.truncate(replicas);
    }
    top.into_iter().map(|(_, a)| a).collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    fn report(running: &[&str], loaded: Option<&[&str]>, max: Option<u32>) -> AdapterReport {
        let names = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        AdapterReport {
            servable: names(&["a", "b", "c", "d"]),
            running: names(running),
            waiting: Vec::new(),
            loaded: loaded.map(names),
            max_loaded: max,
            ..AdapterReport::default()
        }
    }

    #[test]
    fn residency_reads_the_report() {
        let none = Sent::default();
        let r = report(&["a"], Some(&["a", "b"]), Some(3));
        assert_eq!(residency(Some(&r), &none, "a"), Residency::Running);
        assert_eq!(residency(Some(&r), &none, "b"), Residency::Loaded);
        assert_eq!(residency(Some(&r), &none, "c"), Residency::Room);
        let full = report(&["a"], Some(&["a", "b", "c"]), Some(3));
        assert_eq!(residency(Some(&full), &none, "d"), Residency::Evict);
        // No `loaded` list: what runs is what is loaded.
        let running_only = report(&["a", "b"], None, Some(2));
        assert_eq!(
            residency(Some(&running_only), &none, "b"),
            Residency::Running
        );
        assert_eq!(residency(Some(&running_only), &none, "c"), Residency::Evict);
        // Nothing said of the capacity: room.
        assert_eq!(residency(None, &none, "a"), Residency::Room);
        let no_max = report(&["a"], None, None);
        assert_eq!(residency(Some(&no_max), &none, "c"), Residency::Room);
    }

    #[test]
    fn what_was_sent_counts_until_a_later_read() {
        let t0 = Instant::now();
        let r = report(&[], Some(&["a"]), Some(2));
        let mut sent = Sent::default();
        let c: Arc<str> = "c".into();
        sent.sent(&c, t0);
        assert_eq!(residency(Some(&r), &sent, "c"), Residency::Running);
        // `a` and `c` fill the engine's two places.
        assert_eq!(residency(Some(&r), &sent, "d"), Residency::Evict);
        sent.ended("c");
        assert_eq!(residency(Some(&r), &sent, "c"), Residency::Loaded);
        // A read that began before it was sent does not tell.
        sent.reported(t0 - Duration::from_millis(1));
        assert_eq!(residency(Some(&r), &sent, "c"), Residency::Loaded);
        // A later one does (the report says what became of it).
        sent.reported(t0 + Duration::from_millis(1));
        assert_eq!(residency(Some(&r), &sent, "c"), Residency::Room);
        // In flight, it stays whatever the reports.
        sent.sent(&c, t0);
        sent.reported(t0 + Duration::from_secs(1));
        assert_eq!(residency(Some(&r), &sent, "c"), Residency::Running);
    }

    #[test]
    fn sent_is_bounded() {
        let t0 = Instant::now();
        let mut sent = Sent::default();
        for i in 0..1_000u64 {
            let name: Arc<str> = format!("adapter-{i}").into();
            sent.sent(&name, t0 + Duration::from_millis(i));
            sent.ended(&name);
        }
        assert_eq!(sent.entries.len(), Sent::MAX_SETTLED);
        // The newest are kept.
        assert!(sent.has("adapter-999"));
        assert!(!sent.has("adapter-0"));
    }

    #[test]
    fn scores_rank_residency_before_preference() {
        use Residency::*;
        let order = [
            (Running, false),
            (Loaded, true),
            (Room, true),
            (Room, false),
            (Evict, true),
            (Evict, false),
        ];
        for w in order.windows(2) {
            assert!(w[0].0.score(w[0].1) > w[1].0.score(w[1].1), "{w:?}");
        }
        assert_eq!(Running.score(true), Running.score(false));
        assert!(Room.loads() && Evict.loads() && !Loaded.loads() && !Running.loads());
    }

    fn fleet(n: u16) -> Vec<SocketAddr> {
        (1..=n)
            .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
            .collect()
    }

    #[test]
    fn preferred_endpoints_spread_adapters_evenly() {
        let servers = fleet(4);
        let mut count = [0u32; 4];
        for i in 0..4_000 {
            let first = preferred(&format!("adapter-{i}"), servers.iter().copied(), 1)[0];
            count[usize::from(first.port() - 1)] += 1;
        }
        assert!(
            count.iter().all(|&n| (800..1_200).contains(&n)),
            "{count:?}"
        );
    }

    proptest! {
        /// Any order of the fleet gives the same preferred endpoints, a
        /// prefix of the longer list for fewer replicas; losing a server
        /// moves only the adapters it was preferred for.
        #[test]
        fn preferred_is_stable(n in 1u16..40, replicas in 0usize..6, name in "[a-z]{1,12}", rot in 0usize..40) {
            let mut servers = fleet(n);
            let best = preferred(&name, servers.iter().copied(), replicas);
            prop_assert_eq!(best.len(), replicas.min(usize::from(n)));
            servers.rotate_left(rot % usize::from(n));
            prop_assert_eq!(&preferred(&name, servers.iter().copied(), replicas), &best);
            let fewer = preferred(&name, servers.iter().copied(), replicas.saturating_sub(1));
            prop_assert_eq!(&best[..fewer.len()], &fewer[..]);
            if let Some(&gone) = servers.last() {
                if !best.contains(&gone) {
                    let without = preferred(&name, servers[..servers.len() - 1].iter().copied(), replicas);
                    prop_assert_eq!(without, best);
                }
            }
        }
    }
}
