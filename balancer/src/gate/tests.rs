//! Unit tests of the gate: admission, waiting, leases, fallback. They run
//! on a paused clock (the gate reads tokio's): a wait of 80 ms takes none.

use super::*;
use flowgate::{BackendHealth, BackendKind, PROTOCOL_VERSION};

fn shared_with_one_slot() -> Arc<FleetGate> {
    let mut config = DispatcherConfig::default();
    config.flow.max_requests = 4;
    let shared = FleetGate::new(config);
    // An agent that lists no models serves any.
    let mut a = agent("a", 1, "");
    a.models.clear();
    shared.report(a).unwrap();
    shared
}

/// A ready agent with one slot, serving `model`.
fn agent(id: &str, port: u16, model: &str) -> AgentReport {
    AgentReport {
        protocol_version: PROTOCOL_VERSION,
        agent_id: id.into(),
        name: id.into(),
        backend: BackendKind::Llamacpp,
        external_addr: format!("127.0.0.1:{port}"),
        models: vec![model.into()],
        health: BackendHealth::Ready,
        slots_total: 1,
        slots_busy: 0,
        requests_waiting: 0,
        kv_cache_usage: None,
        kv_capacity_tokens: None,
        monitoring_interval_ms: 1000,
        draining: false,
        last_error: None,
        slot_share: None,
        balancers: None,
        read_began_ms_ago: None,
        read_ended_ms_ago: None,
        adapters: None,
        kv_events: None,
    }
}

fn for_model(model: &str) -> RequestMeta {
    let mut r = request();
    r.route.model = Some(Arc::from(model));
    r
}

/// A request that waited its chain's `after` moves to the fallback
/// model's queue: never in two queues, never in none, its slot on the
/// fallback's endpoint.
#[tokio::test(start_paused = true)]
async fn a_request_that_waited_too_long_moves_to_its_fallback() {
    let mut config = DispatcherConfig::default();
    config.flow.max_requests = 4;
    let shared = FleetGate::new(config);
    shared.report(agent("a", 1, "a")).unwrap();
    shared.report(agent("b", 2, "b")).unwrap();
    let chain = Fallback {
        models: vec![Arc::from("b")],
        after: Some(Duration::from_millis(50)),
    };
    let on_a = shared.admit(for_model("a"), Some(&chain), std::future::pending());
    let on_a = on_a.await.unwrap();
    assert!(on_a.fell_back.is_none(), "a is free: no fallback");
    let on_b = shared.admit(for_model("b"), None, std::future::pending());
    let on_b = on_b.await.unwrap();
    // Both busy: the next request for a waits, then moves to b's queue.
    let mut waiting = Box::pin(shared.admit(for_model("a"), Some(&chain), std::future::pending()));
    enqueue(&mut waiting).await;
    assert_eq!(shared.snapshot().buffered, 1);
    tokio::time::sleep(Duration::from_millis(80)).await;
    enqueue(&mut waiting).await;
    assert_eq!(shared.snapshot().buffered, 1, "moved, not copied");
    on_b.lease.release();
    let moved = waiting.await.unwrap();
    assert_eq!(moved.fell_back.as_deref(), Some("b"));
    // Timed by the gate's clock: the 80 ms that passed, paused or not.
    assert!(
        moved.waited >= Duration::from_millis(80),
        "{:?}",
        moved.waited
    );
    assert_eq!(moved.lease.addr().port(), 2);
    let snap = shared.snapshot();
    assert_eq!((snap.in_flight, snap.buffered), (2, 0));
    on_a.lease.release();
    moved.lease.release();
    // A model with no live endpoint at all falls back at once.
    shared.deregister("a");
    let at_once = shared.admit(for_model("a"), Some(&chain), std::future::pending());
    let at_once = at_once.await.unwrap();
    assert_eq!(at_once.fell_back.as_deref(), Some("b"));
    assert_eq!(at_once.waited, Duration::ZERO);
}

fn request() -> RequestMeta {
    RequestMeta {
        flow: flowgate::FlowKey::new("t", 0),
        bytes: 10,
        ttl: None,
        route: Default::default(),
        weight: 1,
    }
}

/// Takes the only slot of [`shared_with_one_slot`].
async fn take_the_slot(shared: &Arc<FleetGate>) -> LeaseGuard {
    shared
        .admit(request(), None, std::future::pending())
        .await
        .expect("the free slot is given at once")
        .lease
}

/// Polls `fut` briefly so it enqueues itself, leaving it pending.
async fn enqueue<F: Future>(fut: &mut std::pin::Pin<Box<F>>) {
    assert!(
        tokio::time::timeout(Duration::from_millis(20), fut.as_mut())
            .await
            .is_err()
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_after_its_grant_gives_the_slot_back() {
    let shared = shared_with_one_slot();
    let first = take_the_slot(&shared).await;
    let mut waiting = Box::pin(shared.admit(request(), None, std::future::pending()));
    enqueue(&mut waiting).await;
    assert_eq!(shared.snapshot().buffered, 1);
    first.release(); // the grant goes into the waiter's channel
    assert_eq!(shared.snapshot().in_flight, 1);
    drop(waiting); // ... and the waiter never reads it
    let snap = shared.snapshot();
    assert_eq!((snap.in_flight, snap.buffered), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_while_queued_leaves_the_buffer() {
    let shared = shared_with_one_slot();
    let first = take_the_slot(&shared).await;
    let mut waiting = Box::pin(shared.admit(request(), None, std::future::pending()));
    enqueue(&mut waiting).await;
    drop(waiting);
    assert_eq!(shared.snapshot().buffered, 0);
    first.release();
    assert_eq!(shared.snapshot().in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_waits_wherever_its_waiting_is_taken() {
    let shared = shared_with_one_slot();
    let first = match shared.submit(request(), None) {
        Submitted::Done(Ok(admitted)) => admitted.lease,
        _ => panic!("the free slot is given at once"),
    };
    let Submitted::Queued(waiting) = shared.submit(request(), None) else {
        panic!("the second request queues");
    };
    assert_eq!(shared.snapshot().buffered, 1);
    // Moved to another task (as a parked request is), it still gets
    // the next free slot.
    let elsewhere = tokio::spawn(waiting.wait(std::future::pending()));
    first.release();
    let admitted = elsewhere.await.unwrap().expect("granted");
    let snap = shared.snapshot();
    assert_eq!((snap.in_flight, snap.buffered), (1, 0));
    admitted.lease.release();
    assert_eq!(shared.snapshot().in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn an_abandoned_waiting_request_leaves_the_queue_counted_as_gone() {
    let shared = shared_with_one_slot();
    let first = take_the_slot(&shared).await;
    let Submitted::Queued(waiting) = shared.submit(request(), None) else {
        panic!("the second request queues");
    };
    waiting.abandon();
    assert_eq!(shared.snapshot().buffered, 0);
    let gone = shared
        .metrics
        .requests
        .with_label_values(&["499", "client-gone"])
        .get();
    assert_eq!(gone, 1, "counted as the client's leaving");
    first.release();
    let snap = shared.snapshot();
    assert_eq!((snap.in_flight, snap.buffered), (0, 0));
}

/// A queued request waits exactly its time to live, then is refused
/// (504): five minutes of the paused clock, none of the test's.
#[tokio::test(start_paused = true)]
async fn a_queued_request_waits_its_time_to_live_then_times_out() {
    let shared = FleetGate::new(DispatcherConfig {
        max_ttl: Duration::from_secs(600),
        ..DispatcherConfig::default()
    });
    let mut a = agent("a", 1, "");
    a.models.clear();
    shared.report(a).unwrap();
    let first = take_the_slot(&shared).await;
    let mut r = request();
    r.ttl = Some(Duration::from_secs(300));
    let mut waiting = Box::pin(shared.admit(r, None, std::future::pending()));
    enqueue(&mut waiting).await;
    tokio::time::advance(Duration::from_secs(299)).await;
    enqueue(&mut waiting).await;
    assert_eq!(
        shared.snapshot().buffered,
        1,
        "still within its time to live"
    );
    let start = tokio::time::Instant::now();
    let timed_out = waiting.await;
    assert_eq!(
        timed_out.err(),
        Some(AdmitError::Rejected(Reject::Timeout)),
        "refused once its time to live passed"
    );
    assert!(
        start.elapsed() <= Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    let snap = shared.snapshot();
    assert_eq!(
        (snap.in_flight, snap.buffered),
        (1, 0),
        "it left the buffer"
    );
    first.release();
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_while_queued_takes_nothing() {
    let shared = shared_with_one_slot();
    let first = take_the_slot(&shared).await;
    let gone = shared.admit(request(), None, async {}).await;
    assert_eq!(gone.err(), Some(AdmitError::ClientGone));
    let snap = shared.snapshot();
    assert_eq!((snap.in_flight, snap.buffered), (1, 0));
    first.release();
    assert_eq!(shared.snapshot().in_flight, 0);
}

/// A request's end is settled alike at every door: what a sent request's
/// answer said is accounted to its tenant before its slot is free; one
/// never sent accounts nothing; an orphaned slot stays busy.
#[tokio::test(start_paused = true)]
async fn a_requests_end_accounts_what_was_sent_then_frees_its_slot() {
    let shared = shared_with_one_slot();
    let tenant: Arc<str> = Arc::from("acme");
    let used = TokenUsage {
        prompt: 7,
        completion: 3,
        cached: 0,
        cache_said: false,
    };
    let estimate = flowgate::tokens::TokenEstimate::default();
    let served = |lease| {
        let mut served = Served::new(&tenant, None, estimate, 28);
        served.bind(lease);
        served
    };
    let end = |sent, slot| AnswerEnd {
        sent,
        said: Some(used),
        timing: None,
        slot,
    };
    served(take_the_slot(&shared).await).finish(end(false, SlotEnd::Free));
    assert!(
        shared.usage(Duration::from_secs(60)).is_empty(),
        "never sent"
    );
    served(take_the_slot(&shared).await).finish(end(true, SlotEnd::Free));
    let usage = shared.usage(Duration::from_secs(60));
    assert_eq!(usage.len(), 1);
    let spent = &usage[0].spent;
    assert_eq!(
        (spent.requests, spent.prompt_tokens, spent.completion_tokens),
        (1, 7, 3),
        "{usage:?}"
    );
    // Dropped unfinished (refused, or its task gone): never sent, so it
    // accounts nothing, and its slot is free again.
    drop(served(take_the_slot(&shared).await));
    let usage = shared.usage(Duration::from_secs(60));
    assert_eq!(usage[0].spent.requests, 1, "{usage:?}");
    // Freed: the one slot is taken again at once; orphaned, it is not.
    served(take_the_slot(&shared).await).finish(end(true, SlotEnd::Orphaned { streamed: false }));
    let waiting = shared.admit(request(), None, std::future::pending());
    assert!(
        tokio::time::timeout(Duration::from_millis(50), waiting)
            .await
            .is_err(),
        "the engine may still be working on the orphaned request"
    );
}

/// The models agents report are known to a request without the
/// dispatcher's lock: a name reported once stays known (also after its
/// agent left), an unreported one is a metric's `other`; a lease names the
/// model of the endpoint it was taken on.
#[tokio::test(start_paused = true)]
async fn reported_models_are_known_without_the_dispatchers_lock() {
    let shared = FleetGate::new(DispatcherConfig::default());
    assert_eq!(shared.model_label("m1"), "other");
    shared.report(agent("a", 1, "m1")).unwrap();
    assert_eq!(shared.model_label("m1"), "m1");
    assert!(!flowgate::admission::FleetView::is_served(&*shared, "m2"));
    shared.report(agent("b", 2, "m2")).unwrap();
    assert!(flowgate::admission::FleetView::is_served(&*shared, "m2"));
    let lease = shared
        .admit(for_model("m2"), None, std::future::pending())
        .await
        .expect("b's slot is free")
        .lease;
    assert_eq!(lease.served_model(), Some("m2"));
    drop(lease);
    assert!(shared.deregister("a"));
    assert_eq!(shared.model_label("m1"), "m1", "names are never forgotten");
    assert_eq!(shared.model_label("m3"), "other");
}
