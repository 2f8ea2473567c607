use super::*;
use crate::protocol::tests::report;
use std::time::Duration;

impl EndpointLedger {
    /// Books `route` on the first endpoint of its lane that takes it now
    /// (which one placement chooses is [`crate::placement`]'s to test).
    pub(crate) fn acquire(&mut self, route: &Route, now: Instant) -> Option<Lease> {
        let id = self
            .ranked(route.model.as_deref())
            .find(|e| e.takes(route, now, &self.saturation))?
            .id;
        Some(self.book(route, id, now))
    }

    /// Teaches the endpoint at `addr` its engine's costs.
    pub(crate) fn learn_cost(&mut self, addr: SocketAddr, timing: &Timing) {
        if let Some(id) = self.by_addr.get(&addr) {
            self.endpoints.get_mut(id).unwrap().cost.learn(timing);
        }
    }

    /// Whether the ranking holds exactly the endpoints that could take
    /// work, at their current static scores.
    pub(crate) fn ranking_is_current(&self) -> Result<(), String> {
        for e in self.endpoints.values() {
            let rank = self.ranking.rank_of(e.id);
            if rank.is_some() != e.rankable(&self.saturation) {
                return Err(format!("{:?} ranked: {}", e.id, rank.is_some()));
            }
            if let Some(rank) = rank {
                let score = e.static_score(&self.scheduling.scorers, &self.saturation);
                if rank.score() != score {
                    return Err(format!("{:?} at {} for {score}", e.id, rank.score()));
                }
            }
        }
        Ok(())
    }
}

pub(crate) fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn registry_with(slots: u32, now: Instant) -> EndpointLedger {
    let mut r = EndpointLedger::default();
    r.apply_report(report("a", "127.0.0.1:1", slots), addr("127.0.0.1:1"), now);
    r
}

#[test]
fn leases_never_exceed_reported_slots() {
    let now = Instant::now();
    let mut r = registry_with(2, now);
    let l1 = r.acquire(&Route::default(), now).unwrap();
    let l2 = r.acquire(&Route::default(), now).unwrap();
    assert!(r.acquire(&Route::default(), now).is_none());
    r.release(l1, now);
    let l3 = r.acquire(&Route::default(), now).unwrap();
    r.release(l2, now);
    r.release(l3, now);
    assert_eq!(r.total_in_flight(), 0);
}

#[test]
fn a_report_never_resets_the_in_flight_count() {
    let now = Instant::now();
    let mut r = registry_with(4, now);
    let leases: Vec<_> = (0..3)
        .map(|_| r.acquire(&Route::default(), now).unwrap())
        .collect();
    // The agent scraped before our requests arrived: it says 0 busy.
    r.apply_report(report("a", "127.0.0.1:1", 4), addr("127.0.0.1:1"), now);
    assert_eq!(r.total_in_flight(), 3);
    assert!(r.acquire(&Route::default(), now).is_some(), "one slot left");
    assert!(r.acquire(&Route::default(), now).is_none(), "and only one");
    for l in leases {
        r.release(l, now);
    }
}

#[test]
fn a_lagging_report_does_not_hide_a_slot_just_freed() {
    let now = Instant::now();
    let mut r = registry_with(2, now);
    let l1 = r.acquire(&Route::default(), now).unwrap();
    let l2 = r.acquire(&Route::default(), now).unwrap();
    r.release(l1, now);
    // Scraped while both of ours were busy.
    let mut busy = report("a", "127.0.0.1:1", 2);
    busy.slots_busy = 2;
    r.apply_report(busy, addr("127.0.0.1:1"), now);
    assert!(
        r.acquire(&Route::default(), now).is_some(),
        "the freed slot is usable at once"
    );
    let _ = l2;
}

#[test]
fn a_slot_whose_client_left_stays_busy_until_the_engine_is_done() {
    let t0 = Instant::now();
    let mut r = registry_with(1, t0);
    let lease = r.acquire(&Route::default(), t0).unwrap();
    // llama-server goes on with a non-streamed answer after its client
    // left: the slot is not free.
    r.orphan(lease, false, t0);
    assert!(r.acquire(&Route::default(), t0).is_none(), "still busy");
    assert_eq!(r.snapshot(t0)[0].orphaned, 1);
    let mut busy = report("a", "127.0.0.1:1", 1);
    busy.slots_busy = 1;
    let t1 = t0 + Duration::from_millis(100);
    r.apply_report(busy.clone(), addr("127.0.0.1:1"), t1);
    assert!(
        r.acquire(&Route::default(), t1).is_none(),
        "the engine says busy"
    );
    // The engine finished: the next report shows the slot idle.
    busy.slots_busy = 0;
    let t2 = t1 + Duration::from_millis(100);
    r.apply_report(busy, addr("127.0.0.1:1"), t2);
    assert_eq!(r.snapshot(t2)[0].orphaned, 0);
    let next = r.acquire(&Route::default(), t2).expect("free now");
    r.release(next, t0);
    assert_eq!(r.total_in_flight(), 0);
}

#[test]
fn orphans_beside_live_requests_are_freed_only_by_what_the_engine_shows() {
    let t0 = Instant::now();
    let mut r = registry_with(3, t0);
    let live = r.acquire(&Route::default(), t0).unwrap();
    let gone = r.acquire(&Route::default(), t0).unwrap();
    r.orphan(gone, false, t0);
    let mut rep = report("a", "127.0.0.1:1", 3);
    // Our live request and the orphan both run.
    rep.slots_busy = 2;
    r.apply_report(rep.clone(), addr("127.0.0.1:1"), t0);
    assert_eq!(r.total_in_flight(), 2);
    // One busy slot: the live request explains it; the orphan is done.
    rep.slots_busy = 1;
    r.apply_report(rep, addr("127.0.0.1:1"), t0);
    assert_eq!(r.total_in_flight(), 1);
    r.release(live, t0);
    assert_eq!(r.total_in_flight(), 0);
}

#[test]
fn an_orphan_is_freed_at_once_when_the_engine_stops_with_its_client() {
    let t0 = Instant::now();
    let mut r = registry_with(1, t0);
    let streamed = r.acquire(&Route::default(), t0).unwrap();
    r.orphan(streamed, true, t0);
    assert_eq!(r.total_in_flight(), 0, "a streamed llama.cpp answer stops");
    let mut vllm = report("v", "127.0.0.1:2", 1);
    vllm.backend = crate::protocol::BackendKind::Vllm;
    r.apply_report(vllm, addr("127.0.0.1:2"), t0);
    let on_vllm = r
        .acquire(
            &Route {
                subset: Some(vec![addr("127.0.0.1:2")].into()),
                ..Route::default()
            },
            t0,
        )
        .unwrap();
    r.orphan(on_vllm, false, t0);
    assert_eq!(r.total_in_flight(), 0, "vLLM aborts on disconnect");
}

#[test]
fn a_lost_agent_cannot_hold_an_orphan_forever() {
    let t0 = Instant::now();
    let mut r = registry_with(1, t0);
    let lease = r.acquire(&Route::default(), t0).unwrap();
    r.orphan(lease, false, t0);
    let mut busy = report("a", "127.0.0.1:1", 1);
    busy.slots_busy = 1;
    // The agent keeps saying busy (or is confused): the bound frees it.
    let late = t0 + ORPHAN_MAX_AGE - Duration::from_millis(1);
    r.apply_report(busy, addr("127.0.0.1:1"), late);
    r.drop_stale(late);
    assert_eq!(r.total_in_flight(), 1);
    r.drop_stale(t0 + ORPHAN_MAX_AGE);
    assert_eq!(r.total_in_flight(), 0);
    // An agent that goes away frees them too (nothing can report them).
    let l = r.acquire(&Route::default(), late).unwrap();
    r.orphan(l, false, late);
    r.deregister("a");
    assert_eq!(r.total_in_flight(), 0);
}

#[test]
fn load_from_other_clients_reduces_free_slots() {
    let now = Instant::now();
    let mut r = registry_with(4, now);
    let mut busy = report("a", "127.0.0.1:1", 4);
    busy.slots_busy = 3; // none of them ours
    r.apply_report(busy, addr("127.0.0.1:1"), now);
    assert!(r.acquire(&Route::default(), now).is_some());
    assert!(r.acquire(&Route::default(), now).is_none());
}

#[test]
fn a_share_never_lets_the_balancer_fill_slots_the_engine_says_are_busy() {
    // The agent's share is a report old: it may still count free the
    // slots a client that bypasses the balancers just took.
    let now = Instant::now();
    let mut r = registry_with(4, now);
    let mut rep = report("a", "127.0.0.1:1", 4);
    rep.slot_share = Some(4);
    rep.slots_busy = 4; // none of them ours
    r.apply_report(rep.clone(), addr("127.0.0.1:1"), now);
    assert!(
        r.acquire(&Route::default(), now).is_none(),
        "every slot taken"
    );
    // Two of the client's requests end; the share is the smaller bound.
    rep.slots_busy = 2;
    rep.slot_share = Some(1);
    r.apply_report(rep.clone(), addr("127.0.0.1:1"), now);
    let l = r.acquire(&Route::default(), now).unwrap();
    assert!(
        r.acquire(&Route::default(), now).is_none(),
        "its share is 1"
    );
    // Its own request is no stranger's: a report that counts it leaves
    // the slot the share gives.
    rep.slots_busy = 3;
    rep.slot_share = Some(2);
    r.apply_report(rep, addr("127.0.0.1:1"), now);
    let l2 = r.acquire(&Route::default(), now).unwrap();
    assert!(r.acquire(&Route::default(), now).is_none());
    r.release(l, now);
    r.release(l2, now);
}

#[test]
fn two_agents_on_one_server_do_not_double_its_capacity() {
    let now = Instant::now();
    let mut r = registry_with(2, now);
    let out = r.apply_report(report("b", "127.0.0.1:1", 2), addr("127.0.0.1:1"), now);
    assert!(matches!(out, ReportOutcome::TookOver(_)));
    assert!(r.acquire(&Route::default(), now).is_some());
    assert!(r.acquire(&Route::default(), now).is_some());
    assert!(r.acquire(&Route::default(), now).is_none());
    assert_eq!(r.snapshot(now).len(), 1);
    // Taking turns is one change of owner, reported once.
    for _ in 0..3 {
        let a = r.apply_report(report("a", "127.0.0.1:1", 2), addr("127.0.0.1:1"), now);
        assert!(matches!(a, ReportOutcome::TookBack(_)), "{a:?}");
        let b = r.apply_report(report("b", "127.0.0.1:1", 2), addr("127.0.0.1:1"), now);
        assert!(matches!(b, ReportOutcome::TookBack(_)), "{b:?}");
    }
    let c = r.apply_report(report("c", "127.0.0.1:1", 2), addr("127.0.0.1:1"), now);
    assert!(matches!(c, ReportOutcome::TookOver(_)), "a new owner is");
}

#[test]
fn stale_agents_get_no_work_and_are_dropped_after_in_flight_finishes() {
    let t0 = Instant::now();
    let mut r = registry_with(2, t0);
    let lease = r.acquire(&Route::default(), t0).unwrap();
    let stale = t0 + Duration::from_secs(3);
    assert!(r
        .acquire(&Route::default(), t0 + Duration::from_millis(1999))
        .is_some());
    assert!(
        r.acquire(&Route::default(), t0 + Duration::from_millis(2001))
            .is_none(),
        "metrics older than 2 intervals saturate"
    );
    assert!(r.snapshot(stale - Duration::from_millis(1))[0].eligible);
    assert!(!r.snapshot(stale)[0].eligible, "stale after 3 intervals");
    assert_eq!(r.drop_stale(stale), vec!["a".to_string()]);
    assert_eq!(
        r.snapshot(stale).len(),
        1,
        "kept while requests are in flight"
    );
    r.release(lease, t0);
    assert_eq!(r.snapshot(stale).len(), 1, "one more lease is out");
}

/// The count of endpoints whose breaker remembers a failure (what lets a
/// success skip the lock while it is 0) follows failures, successes, and
/// endpoints forgotten.
#[test]
fn endpoints_remembering_a_failure_are_counted() {
    let t0 = Instant::now();
    let mut r = EndpointLedger::default();
    for (agent, port) in [("a", 1), ("b", 2)] {
        let (rep, at) = report_for(agent, port, 4, &[]);
        r.apply_report(rep, at, t0);
    }
    let snapshot = r.snapshot(t0);
    let ids: Vec<EndpointId> = snapshot.iter().map(|e| e.id).collect();
    let first_agent = snapshot[0].agent.as_ref().unwrap().agent_id.clone();
    assert_eq!(r.failing(), 0);
    r.record_outcome(ids[0], true, t0);
    assert_eq!(
        r.failing(),
        0,
        "a success on a clear breaker changes nothing"
    );
    r.record_outcome(ids[0], false, t0);
    r.record_outcome(ids[0], false, t0);
    r.record_outcome(ids[1], false, t0);
    assert_eq!(r.failing(), 2);
    r.record_outcome(ids[1], true, t0);
    assert_eq!(r.failing(), 1);
    // Open, then back after its backoff: still remembered until a success.
    r.record_outcome(ids[0], false, t0);
    assert_eq!(r.failing(), 1);
    assert!(r.deregister(&first_agent));
    assert_eq!(r.failing(), 0, "a forgotten endpoint is not counted");
}

#[test]
fn deregistered_endpoint_is_forgotten_when_idle_and_rejoins_with_its_count() {
    let now = Instant::now();
    let mut r = registry_with(1, now);
    let lease = r.acquire(&Route::default(), now).unwrap();
    assert!(r.deregister("a"));
    assert!(!r.any_eligible(now));
    // It comes back before the request finished: the slot is still taken.
    r.apply_report(report("a2", "127.0.0.1:1", 1), addr("127.0.0.1:1"), now);
    assert!(r.acquire(&Route::default(), now).is_none());
    r.release(lease, now);
    assert!(r.acquire(&Route::default(), now).is_some());
    let mut r = registry_with(1, now);
    assert!(r.deregister("a"));
    assert!(r.snapshot(now).is_empty());
    assert!(!r.deregister("a"));
}

#[test]
fn loading_unreachable_and_draining_endpoints_get_no_work() {
    let now = Instant::now();
    for f in [
        |r: &mut AgentReport| r.health = BackendHealth::Loading,
        |r: &mut AgentReport| r.health = BackendHealth::Unreachable,
        |r: &mut AgentReport| r.draining = true,
    ] {
        let mut rep = report("a", "127.0.0.1:1", 4);
        f(&mut rep);
        let mut r = EndpointLedger::default();
        r.apply_report(rep, addr("127.0.0.1:1"), now);
        assert!(r.acquire(&Route::default(), now).is_none());
    }
}

#[test]
fn moving_agent_frees_its_old_address() {
    let now = Instant::now();
    let mut r = registry_with(1, now);
    r.apply_report(report("a", "127.0.0.1:2", 1), addr("127.0.0.1:2"), now);
    let snap = r.snapshot(now);
    assert_eq!(snap.len(), 1);
    assert_eq!(snap[0].addr.port(), 2);
}

/// A report of agent `id` for `127.0.0.1:port`, with `slots` and `models`.
pub(crate) fn report_for(
    id: &str,
    port: u16,
    slots: u32,
    models: &[&str],
) -> (AgentReport, SocketAddr) {
    let a = format!("127.0.0.1:{port}");
    let mut rep = report(id, &a, slots);
    rep.models = models.iter().map(|m| m.to_string()).collect();
    (rep, addr(&a))
}

/// A route for `model` with these prompt blocks.
pub(crate) fn route(model: Option<&str>, prefix: &[u64]) -> Route {
    Route {
        model: model.map(Arc::from),
        prefix: prefix.to_vec(),
        ..Route::default()
    }
}

#[test]
fn only_endpoints_serving_the_model_are_chosen() {
    let now = Instant::now();
    let mut r = EndpointLedger::default();
    for (id, port, models) in [
        ("a", 1, &["x"][..]),
        ("b", 2, &["y"][..]),
        ("c", 3, &[][..]),
    ] {
        let (rep, a) = report_for(id, port, 8, models);
        r.apply_report(rep, a, now);
    }
    for _ in 0..6 {
        let l = r.acquire(&route(Some("x"), &[]), now).unwrap();
        assert!(l.addr.port() == 1 || l.addr.port() == 3, "{l:?}");
        r.release(l, now);
    }
    assert!(r.model_known(Some("y"), now));
    assert!(r.model_known(Some("anything"), now), "c lists no models");
    r.deregister("c");
    assert!(!r.model_known(Some("anything"), now));
    assert!(r.model_known(None, now));
    // A model whose servers went away stays known for a while.
    r.deregister("b");
    assert!(r.model_known(Some("y"), now));
    assert!(r.acquire(&route(Some("y"), &[]), now).is_none());
    let later = now + MODEL_MEMORY;
    r.drop_stale(later);
    let (rep, a) = report_for("a", 1, 8, &["x"]);
    r.apply_report(rep, a, later);
    assert!(!r.model_known(Some("y"), later));
    // With no agent at all, every model waits for the fleet.
    r.deregister("a");
    assert!(r.model_known(Some("y"), later));
}

#[test]
fn a_retry_avoids_the_endpoint_that_failed() {
    let now = Instant::now();
    let mut r = EndpointLedger::default();
    for (id, port) in [("a", 1), ("b", 2)] {
        let (rep, a) = report_for(id, port, 4, &["m"]);
        r.apply_report(rep, a, now);
    }
    let mut retry = route(Some("m"), &[]);
    retry.avoid = Some(addr("127.0.0.1:1"));
    assert!(r.has_eligible(&retry, None, now));
    for _ in 0..4 {
        let l = r.acquire(&retry, now).unwrap();
        assert_eq!(l.addr.port(), 2);
        r.release(l, now);
    }
    r.deregister("b");
    assert!(!r.has_eligible(&retry, None, now));
    assert!(r.acquire(&retry, now).is_none());
}

#[test]
fn the_circuit_opens_after_repeated_failures_and_closes_on_its_own() {
    let t0 = Instant::now();
    let mut r = EndpointLedger::default();
    let (mut rep, a) = report_for("a", 1, 4, &[]);
    rep.monitoring_interval_ms = 60_000;
    r.apply_report(rep, a, t0);
    let id = r.snapshot(t0)[0].id;
    assert!(!r.record_outcome(id, false, t0));
    assert!(
        !r.record_outcome(id, true, t0),
        "a success resets the count"
    );
    assert!(!r.record_outcome(id, false, t0));
    assert!(!r.record_outcome(id, false, t0));
    assert!(r.record_outcome(id, false, t0), "third failure in a row");
    assert!(r.acquire(&Route::default(), t0).is_none());
    assert_eq!(r.snapshot(t0)[0].circuit_open_ms, Some(5000));
    let back = t0 + Duration::from_secs(5);
    let l = r.acquire(&Route::default(), back).unwrap();
    r.release(l, t0);
    // It fails again at once: open twice as long.
    assert!(r.record_outcome(id, false, back));
    assert!(r
        .acquire(&Route::default(), back + Duration::from_millis(9999))
        .is_none());
    let l = r
        .acquire(&Route::default(), back + Duration::from_secs(10))
        .unwrap();
    r.release(l, t0);
    // A success closes it for good.
    assert!(!r.record_outcome(id, true, back + Duration::from_secs(10)));
    assert!(!r.record_outcome(id, false, back + Duration::from_secs(10)));
    assert!(r
        .acquire(&Route::default(), back + Duration::from_secs(10))
        .is_some());
}
