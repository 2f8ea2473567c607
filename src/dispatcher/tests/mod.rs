//! Unit and property tests of the dispatcher, with a controlled clock.

use super::*;
use crate::flow::{BandConfig, FairnessPolicy, OrderingPolicy};
use crate::protocol::tests::report;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

const MS: Duration = Duration::from_millis(1);

/// Block size of the prompts in these tests: a prompt of a few blocks is a
/// long one (4,096 tokens a block), so prefilling it again elsewhere costs
/// seconds at the engines' default costs, and waiting for its cache pays.
const BLOCK_BYTES: usize = 16 * 1024;

fn config(max: usize) -> DispatcherConfig {
    let mut c = DispatcherConfig {
        flow: FlowControlConfig {
            max_requests: max,
            ..FlowControlConfig::default()
        },
        ..DispatcherConfig::default()
    };
    c.scheduling.prefix.block_bytes = BLOCK_BYTES;
    // A short bound, so that tests see a hold end.
    c.scheduling.affinity_hold = 200 * MS;
    c
}

fn dispatcher(max: usize) -> Dispatcher<&'static str> {
    Dispatcher::new(config(max))
}

/// Request round-robin between flows (the default is token-fair).
fn round_robin(max: usize) -> DispatcherConfig {
    let mut c = config(max);
    c.flow.default_band.fairness = FairnessPolicy::RoundRobin;
    c
}

fn req(tenant: &str, priority: i32) -> RequestMeta {
    RequestMeta {
        flow: FlowKey::new(tenant, priority),
        bytes: 100,
        ttl: None,
        route: Default::default(),
        weight: 1,
    }
}

fn anon() -> RequestMeta {
    req("default", 0)
}

fn queued(a: Admission) -> Ticket {
    match a {
        Admission::Queued { ticket, .. } => ticket,
        other => panic!("expected Queued, got {other:?}"),
    }
}

fn ready(a: Admission) -> Lease {
    match a {
        Admission::Ready(l) => l,
        other => panic!("expected Ready, got {other:?}"),
    }
}

fn rejected(a: Admission) -> Reject {
    match a {
        Admission::Rejected(r) => r,
        other => panic!("expected Rejected, got {other:?}"),
    }
}

/// Waiters granted by a dispatch, in order; panics on a refusal.
fn granted<T: Copy + std::fmt::Debug>(done: &[Done<T>]) -> Vec<T> {
    done.iter()
        .map(|d| match &d.result {
            Ok(_) => d.waiter,
            Err(r) => panic!("{:?} refused: {r:?}", d.waiter),
        })
        .collect()
}

/// Serves `n` requests one at a time through a single slot, returning the
/// order in which waiters got it.
fn serve_one_by_one(d: &mut Dispatcher<&'static str>, first: Lease, n: usize) -> Vec<&'static str> {
    let now = Instant::now();
    let mut lease = first;
    let mut order = Vec::new();
    for _ in 0..n {
        d.release(lease, now);
        let mut done = d.dispatch(now);
        assert_eq!(done.len(), 1, "one freed slot, one wake-up");
        let g = done.pop().unwrap();
        order.push(g.waiter);
        lease = g.result.unwrap();
    }
    d.release(lease, now);
    order
}

#[test]
fn requests_wait_when_no_agent_exists_and_run_once_one_registers() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    queued(d.submit(anon(), "first", t0));
    queued(d.submit(anon(), "second", t0));
    assert!(d.dispatch(t0).is_empty());
    d.report(report("a", "127.0.0.1:1", 4), t0 + MS).unwrap();
    let done = d.dispatch(t0 + MS);
    assert_eq!(granted(&done), ["first", "second"]);
    assert_eq!(done[0].waited, MS);
    assert_eq!(d.buffered(), 0);
    assert_eq!(d.buffered_bytes(), 0);
}

#[test]
fn fifo_in_a_flow_and_exactly_one_wakeup_per_freed_slot() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let running = ready(d.submit(anon(), "running", t0));
    for name in ["w1", "w2", "w3"] {
        queued(d.submit(anon(), name, t0));
    }
    assert_eq!(serve_one_by_one(&mut d, running, 3), ["w1", "w2", "w3"]);
}

#[test]
fn newcomers_do_not_overtake_waiters() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    queued(d.submit(anon(), "old", t0));
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    // A slot is free but "old" has not been dispatched yet.
    queued(d.submit(anon(), "new", t0));
    assert_eq!(granted(&d.dispatch(t0)), ["old"]);
}

#[test]
fn higher_priority_always_goes_first() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let running = ready(d.submit(anon(), "running", t0));
    queued(d.submit(req("batch", -1), "background", t0));
    queued(d.submit(req("x", 0), "normal", t0 + MS));
    queued(d.submit(req("y", 10), "urgent", t0 + 2 * MS));
    queued(d.submit(req("x", 0), "normal2", t0 + 3 * MS));
    assert_eq!(
        serve_one_by_one(&mut d, running, 4),
        ["urgent", "normal", "normal2", "background"]
    );
}

#[test]
fn round_robin_gives_flows_equal_turns_whatever_they_queued() {
    let t0 = Instant::now();
    let mut d = Dispatcher::new(round_robin(30));
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let running = ready(d.submit(anon(), "running", t0));
    for name in ["n1", "n2", "n3", "n4"] {
        queued(d.submit(req("noisy", 0), name, t0));
    }
    queued(d.submit(req("quiet", 0), "q1", t0 + MS));
    queued(d.submit(req("quiet", 0), "q2", t0 + MS));
    assert_eq!(
        serve_one_by_one(&mut d, running, 6),
        ["n1", "q1", "n2", "q2", "n3", "n4"]
    );
}

#[test]
fn global_strict_serves_all_flows_of_a_band_in_arrival_order() {
    let t0 = Instant::now();
    let mut c = config(30);
    c.flow.default_band.fairness = FairnessPolicy::GlobalStrict;
    let mut d = Dispatcher::new(c);
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let running = ready(d.submit(anon(), "running", t0));
    for (i, (tenant, name)) in [
        ("noisy", "n1"),
        ("noisy", "n2"),
        ("quiet", "q1"),
        ("noisy", "n3"),
    ]
    .into_iter()
    .enumerate()
    {
        queued(d.submit(req(tenant, 0), name, t0 + MS * i as u32));
    }
    assert_eq!(
        serve_one_by_one(&mut d, running, 4),
        ["n1", "n2", "q1", "n3"]
    );
}

#[test]
fn edf_serves_the_earliest_deadline_first() {
    let t0 = Instant::now();
    let mut c = config(30);
    c.flow.default_band.ordering = OrderingPolicy::Edf;
    let mut d = Dispatcher::new(c);
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let running = ready(d.submit(anon(), "running", t0));
    for (name, ttl_ms) in [
        ("slow", 5_000),
        ("fast", 100),
        ("default", 10_000),
        ("mid", 1_000),
    ] {
        let mut r = anon();
        r.ttl = Some(Duration::from_millis(ttl_ms));
        queued(d.submit(r, name, t0));
    }
    assert_eq!(
        serve_one_by_one(&mut d, running, 4),
        ["fast", "mid", "slow", "default"]
    );
}

#[test]
fn a_band_over_its_own_limit_sheds_and_a_full_buffer_refuses() {
    let t0 = Instant::now();
    let mut c = config(4);
    c.flow.bands.insert(
        -1,
        BandConfig {
            max_requests: Some(2),
            ..BandConfig::default()
        },
    );
    let mut d = Dispatcher::new(c);
    queued(d.submit(req("b", -1), "b1", t0));
    queued(d.submit(req("b", -1), "b2", t0));
    assert_eq!(rejected(d.submit(req("b", -1), "b3", t0)), Reject::Shed);
    assert_eq!(Reject::Shed.http_status(), 429);
    queued(d.submit(req("x", 0), "x1", t0));
    queued(d.submit(req("x", 0), "x2", t0));
    // Full, and nothing below priority 0 ... except band -1: evicts.
    assert_eq!(
        rejected(d.submit(req("y", -5), "y", t0)),
        Reject::BufferFull
    );
    assert_eq!(Reject::BufferFull.http_status(), 503);
}

#[test]
fn a_full_buffer_evicts_the_newest_request_of_the_largest_lower_flow() {
    let t0 = Instant::now();
    let mut d = dispatcher(5);
    queued(d.submit(req("small", -1), "s1", t0));
    queued(d.submit(req("big", -1), "b1", t0));
    queued(d.submit(req("big", -1), "b2", t0 + MS));
    queued(d.submit(req("big", -1), "b3", t0 + MS));
    queued(d.submit(req("x", 0), "x1", t0));
    queued(d.submit(req("urgent", 10), "u1", t0));
    queued(d.submit(req("urgent", 10), "u2", t0));
    let done = d.dispatch(t0);
    let evicted: Vec<_> = done
        .iter()
        .map(|d| (d.waiter, d.result.as_ref().err().copied()))
        .collect();
    assert_eq!(
        evicted,
        [("b3", Some(Reject::Evicted)), ("b2", Some(Reject::Evicted))]
    );
    assert_eq!(Reject::Evicted.http_status(), 429);
    assert_eq!(d.buffered(), 5);
    // Equal priority never evicts.
    assert_eq!(
        rejected(d.submit(req("y", -1), "y", t0)),
        Reject::BufferFull
    );
}

#[test]
fn byte_limits_count_bodies_globally_and_per_band() {
    let t0 = Instant::now();
    let mut c = config(100);
    c.flow.max_bytes = 1_000;
    c.flow.bands.insert(
        5,
        BandConfig {
            max_bytes: Some(300),
            ..BandConfig::default()
        },
    );
    let mut d = Dispatcher::new(c);
    let sized = |p: i32, bytes: u64| RequestMeta {
        flow: FlowKey::new("t", p),
        bytes,
        ttl: None,
        route: Default::default(),
        weight: 1,
    };
    queued(d.submit(sized(5, 300), "a", t0));
    assert_eq!(rejected(d.submit(sized(5, 1), "b", t0)), Reject::Shed);
    queued(d.submit(sized(0, 700), "c", t0));
    assert_eq!(rejected(d.submit(sized(0, 1), "d", t0)), Reject::BufferFull);
    assert_eq!(d.buffered_bytes(), 1_000);
    d.report(report("a", "127.0.0.1:1", 2), t0).unwrap();
    assert_eq!(granted(&d.dispatch(t0)), ["a", "c"]);
    assert_eq!(d.buffered_bytes(), 0);
}

#[test]
fn zero_capacity_disables_buffering() {
    let t0 = Instant::now();
    let mut d = dispatcher(0);
    assert_eq!(rejected(d.submit(anon(), "x", t0)), Reject::NoEndpoints);
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let _lease = ready(d.submit(anon(), "x", t0));
    assert_eq!(rejected(d.submit(anon(), "y", t0)), Reject::BufferFull);
}

#[test]
fn expired_requests_are_answered_504_and_never_block_the_ones_behind() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let old = queued(d.submit(anon(), "old", t0));
    let mut short = req("other", 0);
    short.ttl = Some(Duration::from_secs(3));
    queued(d.submit(short, "short", t0 + Duration::from_secs(1)));
    queued(d.submit(anon(), "young", t0 + Duration::from_secs(5)));
    let due = t0 + Duration::from_secs(10);
    d.report(report("a", "127.0.0.1:1", 1), due).unwrap();
    let done = d.dispatch(due);
    let seen: Vec<_> = done
        .iter()
        .map(|d| (d.waiter, d.result.as_ref().err().copied()))
        .collect();
    assert_eq!(
        seen,
        [
            ("short", Some(Reject::Timeout)),
            ("old", Some(Reject::Timeout)),
            ("young", None)
        ],
        "expired in deadline order, then the live one served"
    );
    assert!(!d.cancel(old), "the expired waiter was removed");
}

#[test]
fn ttls_are_cut_to_the_maximum() {
    let d = dispatcher(30);
    assert_eq!(d.ttl(None), Duration::from_secs(10));
    assert_eq!(d.ttl(Some(MS)), MS);
    assert_eq!(
        d.ttl(Some(Duration::from_secs(3600))),
        Duration::from_secs(60)
    );
}

#[test]
fn cancelled_waiters_leave_at_once_and_take_nothing() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let gone = queued(d.submit(anon(), "gone", t0));
    queued(d.submit(anon(), "stays", t0));
    assert!(d.cancel(gone));
    assert!(!d.cancel(gone));
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    assert_eq!(granted(&d.dispatch(t0)), ["stays"]);
    assert_eq!(d.in_flight(), 1);
}

#[test]
fn a_round_robin_flow_emptied_by_cancel_loses_its_turn_cleanly() {
    let t0 = Instant::now();
    let mut d = Dispatcher::new(round_robin(30));
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let running = ready(d.submit(anon(), "running", t0));
    let b = queued(d.submit(req("b", 0), "b1", t0));
    queued(d.submit(req("a", 0), "a1", t0));
    queued(d.submit(req("a", 0), "a2", t0));
    assert!(d.cancel(b));
    // b emptied and lost its turn: back of the ring with its new request.
    queued(d.submit(req("b", 0), "b2", t0));
    assert_eq!(serve_one_by_one(&mut d, running, 3), ["a1", "b2", "a2"]);
    assert!(d.flows().is_empty());
}

#[test]
fn a_granted_waiter_cannot_be_cancelled_so_its_lease_must_be_released() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let t = queued(d.submit(anon(), "w", t0));
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let g = d.dispatch(t0).pop().unwrap();
    assert!(!d.cancel(t));
    d.release(g.result.unwrap(), t0);
    assert_eq!(d.in_flight(), 0);
}

#[test]
fn bad_reports_are_refused_and_change_nothing() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let mut r = report("a", "127.0.0.1:1", 1);
    r.slots_busy = 9;
    assert!(d.report(r, t0).is_err());
    assert!(d.endpoints(t0).is_empty());
}

#[test]
fn saturated_endpoints_hold_the_head_and_nothing_passes_it() {
    use crate::endpoint::Saturation;
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let mut r = report("a", "127.0.0.1:1", 4);
    r.requests_waiting = 5;
    d.report(r.clone(), t0).unwrap();
    assert_eq!(d.endpoints(t0)[0].saturation, Some(Saturation::QueueDepth));
    queued(d.submit(req("x", 10), "high", t0));
    queued(d.submit(req("x", -1), "low", t0));
    assert!(d.dispatch(t0).is_empty());

    r.requests_waiting = 0;
    r.kv_cache_usage = Some(0.8);
    d.report(r.clone(), t0).unwrap();
    assert_eq!(d.endpoints(t0)[0].saturation, Some(Saturation::KvCache));
    assert!(d.dispatch(t0).is_empty());

    r.kv_cache_usage = Some(0.79);
    d.report(r.clone(), t0).unwrap();
    assert_eq!(d.endpoints(t0)[0].saturation, None);
    assert_eq!(granted(&d.dispatch(t0)), ["high", "low"]);
}

fn for_model(tenant: &str, priority: i32, model: &str) -> RequestMeta {
    RequestMeta {
        route: Route {
            model: Some(Arc::from(model)),
            ..Route::default()
        },
        ..req(tenant, priority)
    }
}

fn model_server(id: &str, port: u16, slots: u32, models: &[&str]) -> AgentReport {
    let mut r = report(id, &format!("127.0.0.1:{port}"), slots);
    r.models = models.iter().map(|m| m.to_string()).collect();
    r
}

#[test]
fn unknown_models_are_refused_404_unless_the_fleet_is_empty() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    // No agent yet: the request waits for the fleet.
    queued(d.submit(for_model("t", 0, "small"), "early", t0));
    d.report(model_server("a", 1, 2, &["small"]), t0).unwrap();
    assert_eq!(granted(&d.dispatch(t0)), ["early"]);
    assert_eq!(
        rejected(d.submit(for_model("t", 0, "huge"), "x", t0)),
        Reject::UnknownModel
    );
    assert_eq!(Reject::UnknownModel.http_status(), 404);
    let lease = ready(d.submit(for_model("t", 0, "small"), "y", t0));
    d.release(lease, t0);
}

#[test]
fn a_saturated_model_holds_only_its_own_requests() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    d.report(model_server("a", 1, 1, &["small"]), t0).unwrap();
    d.report(model_server("b", 2, 1, &["large"]), t0).unwrap();
    let small = ready(d.submit(for_model("t", 0, "small"), "s0", t0));
    assert_eq!(small.addr.port(), 1);
    // "small" is full: its requests queue, high priority first ...
    queued(d.submit(for_model("t", 5, "small"), "s-high", t0));
    queued(d.submit(for_model("u", 0, "small"), "s-low", t0));
    // ... and a "large" request of lower priority still goes at once.
    queued(d.submit(for_model("v", -3, "large"), "l-low", t0));
    assert_eq!(granted(&d.dispatch(t0)), ["l-low"]);
    queued(d.submit(for_model("v", 9, "large"), "l-high", t0));
    assert!(d.dispatch(t0).is_empty());
    // A freed "small" slot goes to the best "small" waiter, never to "large".
    d.release(small, t0);
    let done = d.dispatch(t0);
    assert_eq!(granted(&done), ["s-high"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr.port(), 1);
    assert_eq!(d.buffered(), 2);
}

#[test]
fn a_retry_waits_for_another_endpoint_without_holding_the_others() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    d.report(model_server("a", 1, 1, &["m"]), t0).unwrap();
    d.report(model_server("b", 2, 1, &["m"]), t0).unwrap();
    let on_b = ready(d.submit(for_model("t", 0, "m"), "b", t0));
    let b_addr = on_b.addr;
    let mut retry = for_model("t", 0, "m");
    retry.route.avoid = Some(if b_addr.port() == 1 {
        "127.0.0.1:2".parse().unwrap()
    } else {
        "127.0.0.1:1".parse().unwrap()
    });
    // The only free endpoint is the one the retry avoids: it waits, and a
    // request of another flow behind it takes that endpoint.
    queued(d.submit(retry, "retry", t0));
    queued(d.submit(for_model("u", 0, "m"), "plain", t0));
    assert_eq!(granted(&d.dispatch(t0)), ["plain"]);
    d.release(on_b, t0);
    let done = d.dispatch(t0);
    assert_eq!(granted(&done), ["retry"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr, b_addr);
}

fn in_subset(tenant: &str, model: &str, ports: &[u16]) -> RequestMeta {
    let mut r = for_model(tenant, 0, model);
    let mut subset: Vec<SocketAddr> = ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}").parse().unwrap())
        .collect();
    subset.sort_unstable();
    r.route.subset = Some(subset.into());
    r
}

#[test]
fn a_subset_hint_picks_only_from_its_endpoints() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    d.report(model_server("a", 1, 4, &["m"]), t0).unwrap();
    d.report(model_server("b", 2, 1, &["m"]), t0).unwrap();
    // b has one slot, a has four: without the hint a would be chosen.
    let on_b = ready(d.submit(in_subset("t", "m", &[2]), "first", t0));
    assert_eq!(on_b.addr.port(), 2);
    // b is now full: the next request for b waits, while one without a
    // hint, queued behind it, takes a at once.
    queued(d.submit(in_subset("t", "m", &[2]), "for-b", t0));
    queued(d.submit(for_model("u", 0, "m"), "any", t0));
    let done = d.dispatch(t0);
    assert_eq!(granted(&done), ["any"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr.port(), 1);
    d.release(on_b, t0);
    let done = d.dispatch(t0);
    assert_eq!(granted(&done), ["for-b"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr.port(), 2);
}

#[test]
fn a_subset_with_no_live_endpoint_is_refused_at_once() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    d.report(model_server("a", 1, 1, &["m"]), t0).unwrap();
    // Nobody at port 9, an empty list, an endpoint of another model.
    d.report(model_server("b", 2, 1, &["other"]), t0).unwrap();
    for ports in [&[9][..], &[], &[2]] {
        let r = rejected(d.submit(in_subset("t", "m", ports), "x", t0));
        assert_eq!(r, Reject::NoEndpoints, "subset {ports:?}");
    }
    // A model nobody serves is still a 404, hint or not.
    let r = rejected(d.submit(in_subset("t", "nope", &[1]), "x", t0));
    assert_eq!(r, Reject::UnknownModel);
    assert_eq!(d.buffered(), 0);
}

#[test]
fn unserved_demand_counts_requests_no_live_endpoint_could_take() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    // No agent at all: everything waits, and all of it is unserved.
    queued(d.submit(for_model("t", 0, "m1"), "a", t0));
    queued(d.submit(for_model("u", 0, "m1"), "b", t0));
    queued(d.submit(anon(), "c", t0));
    let unserved = d.unserved_demand(t0);
    assert_eq!(unserved, [(None, 1), (Some("m1".into()), 2)]);
    // A busy server for m2 only: m1 is still unserved, the anonymous
    // request (any model) is not.
    d.report(model_server("s", 1, 1, &["m2"]), t0).unwrap();
    assert_eq!(d.unserved_demand(t0), [(Some("m1".into()), 2)]);
    // A server for m1 comes up: they go to it, nothing is unserved.
    d.report(model_server("m", 2, 4, &["m1"]), t0).unwrap();
    let mut served = granted(&d.dispatch(t0));
    served.sort_unstable();
    assert_eq!(served, ["a", "b", "c"]);
    assert!(d.unserved_demand(t0).is_empty());
}

#[test]
fn an_agent_hears_only_of_the_queued_requests_its_server_could_serve() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let registered = |o: Result<ReportOutcome, _>| match o {
        Ok(ReportOutcome::Registered(id)) => id,
        other => panic!("{other:?}"),
    };
    let one = registered(d.report(model_server("one", 1, 1, &["m1"]), t0));
    let two = registered(d.report(model_server("two", 2, 1, &["m2"]), t0));
    // Both slots taken, then three requests for m1 and one for any model
    // wait.
    let _running = ready(d.submit(for_model("t", 0, "m1"), "run-1", t0));
    let on_two = ready(d.submit(for_model("t", 0, "m2"), "run-2", t0));
    let waiting: Vec<Ticket> = ["a", "b", "c"]
        .into_iter()
        .map(|name| queued(d.submit(for_model("t", 0, "m1"), name, t0)))
        .collect();
    queued(d.submit(anon(), "any", t0));
    let queued_at = |d: &Dispatcher<&str>, id| d.demand_of(id).queued;
    assert_eq!((queued_at(&d, one), queued_at(&d, two)), (4, 1));
    assert_eq!(d.demand_of(one).in_flight, 1);
    // A request that leaves is no demand any more.
    assert!(d.cancel(waiting[0]));
    assert_eq!((queued_at(&d, one), queued_at(&d, two)), (3, 1));
    // m2's server frees: the request for any model goes there.
    d.release(on_two, t0);
    assert_eq!(granted(&d.dispatch(t0)), ["any"]);
    assert_eq!((queued_at(&d, one), queued_at(&d, two)), (2, 0));
    assert_eq!(d.buffered(), 2);
}

#[test]
fn stale_metrics_saturate_after_the_threshold_or_two_agent_intervals() {
    use crate::endpoint::Saturation;
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let mut r = report("fast", "127.0.0.1:1", 4);
    r.monitoring_interval_ms = 100;
    d.report(r, t0).unwrap();
    let mut r = report("slow", "127.0.0.1:2", 4);
    r.monitoring_interval_ms = 1_000;
    d.report(r, t0).unwrap();
    let at = |ms: u64| {
        d.endpoints(t0 + Duration::from_millis(ms))
            .into_iter()
            .map(|e| (e.eligible, e.saturation))
            .collect::<Vec<_>>()
    };
    assert_eq!(at(200), [(true, None), (true, None)]);
    assert_eq!(
        at(201),
        [(true, Some(Saturation::StaleMetrics)), (true, None)],
        "200 ms threshold"
    );
    assert_eq!(
        at(2_001),
        [(false, None), (true, Some(Saturation::StaleMetrics))],
        "two intervals of a slow agent; the fast one missed three and is out"
    );
}

#[test]
fn round_robin_shares_are_equal_between_greedy_flows() {
    // Three tenants keep 50, 200 and 1,000 requests queued at all times.
    let t0 = Instant::now();
    let mut d: Dispatcher<usize> = Dispatcher::new(round_robin(10_000));
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let mut lease = match d.submit(anon(), usize::MAX, t0) {
        Admission::Ready(l) => Some(l),
        other => panic!("{other:?}"),
    };
    let depth = [50, 200, 1_000];
    let mut queued_now = [0; 3];
    let refill = |d: &mut Dispatcher<usize>, q: &mut [usize; 3]| {
        for (i, &want) in depth.iter().enumerate() {
            while q[i] < want {
                let r = req(["a", "b", "c"][i], 0);
                assert!(matches!(d.submit(r, i, t0), Admission::Queued { .. }));
                q[i] += 1;
            }
        }
    };
    refill(&mut d, &mut queued_now);
    let mut served = [0usize; 3];
    for _ in 0..3_000 {
        if let Some(l) = lease.take() {
            d.release(l, t0);
        }
        let done = d.dispatch(t0).pop().unwrap();
        served[done.waiter] += 1;
        queued_now[done.waiter] -= 1;
        lease = Some(done.result.unwrap());
        refill(&mut d, &mut queued_now);
    }
    for s in served {
        let share = s as f64 / 3_000.0;
        assert!((share - 1.0 / 3.0).abs() <= 0.05 / 3.0, "shares {served:?}");
    }
}

mod burst;
mod conversations;
mod holds;
mod objectives;
mod properties;
mod sessions;

/// Requests waiting for a LoRA adapter no server serves are refused, and
/// so are new ones, once every server whose agent could load it says the
/// load failed; a server that only fails it on one of two keeps them.
#[test]
fn an_adapter_that_failed_to_load_everywhere_refuses_its_waiting_requests() {
    use crate::protocol::{AdapterReport, LoadFailure};
    let t0 = Instant::now();
    let mut d = dispatcher(10);
    let agent = |id: &str, port: u16, failed: bool| {
        let mut r = report(id, &format!("127.0.0.1:{port}"), 1);
        r.adapters = Some(AdapterReport {
            loadable: vec!["x".into()],
            load_failed: if failed {
                vec![LoadFailure {
                    name: "x".into(),
                    error: "HTTP 400".into(),
                }]
            } else {
                Vec::new()
            },
            ..AdapterReport::default()
        });
        r
    };
    d.report(agent("a", 1, false), t0).unwrap();
    d.report(agent("b", 2, false), t0).unwrap();
    let for_x = RequestMeta {
        route: Route {
            model: Some("x".into()),
            ..Route::default()
        },
        ..anon()
    };
    queued(d.submit(for_x.clone(), "waits", t0));
    assert!(d.dispatch(t0).is_empty());
    d.report(agent("a", 1, true), t0).unwrap();
    assert!(d.dispatch(t0).is_empty(), "b may still load it");
    d.report(agent("b", 2, true), t0).unwrap();
    let done = d.dispatch(t0);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].result, Err(Reject::AdapterLoadFailed));
    assert_eq!(d.buffered(), 0);
    assert_eq!(
        rejected(d.submit(for_x, "new", t0)),
        Reject::AdapterLoadFailed
    );
}
