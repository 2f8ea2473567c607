//! Property tests of the dispatcher: arbitrary sequences of submissions,
//! cancellations, releases, reports and clock steps, checked against its
//! invariants.

use super::*;

// ---- property tests -------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    Submit {
        tenant: u8,
        priority: i8,
        bytes: u16,
        ttl_ms: Option<u16>,
        /// Index into [`MODELS`].
        model: u8,
        /// A conversation's key, a few of them so turns repeat.
        session: Option<u8>,
    },
    Cancel(usize),
    Release(usize),
    Advance(u16),
    Report {
        /// Server `i` listens on port `i + 1` and serves `MODELS[i]` only.
        server: u8,
        slots: u8,
        waiting: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (
            (0u8..6, -2i8..3, 1u16..2_000),
            (proptest::option::of(1u16..3_000), 0u8..2, proptest::option::of(0u8..8)),
        )
            .prop_map(|((tenant, priority, bytes), (ttl_ms, model, session))| Op::Submit {
                tenant,
                priority,
                bytes,
                ttl_ms,
                model,
                session,
            }),
        1 => any::<usize>().prop_map(Op::Cancel),
        3 => any::<usize>().prop_map(Op::Release),
        2 => (0u16..500).prop_map(Op::Advance),
        1 => (0u8..2, 0u8..4, 0u8..7).prop_map(|(server, slots, waiting)| Op::Report { server, slots, waiting }),
    ]
}

fn band_policy() -> impl Strategy<Value = (FairnessPolicy, OrderingPolicy)> {
    (
        prop_oneof![
            Just(FairnessPolicy::RoundRobin),
            Just(FairnessPolicy::GlobalStrict),
            Just(FairnessPolicy::TokenFair)
        ],
        prop_oneof![Just(OrderingPolicy::Fcfs), Just(OrderingPolicy::Edf)],
    )
}

/// Everything a request went through, to check each ends exactly once.
#[derive(Debug, Default)]
struct Ledger {
    ended: HashSet<usize>,
    /// id → (priority, deadline, model index) of requests queued now.
    waiting: BTreeMap<usize, (i32, Instant, u8)>,
    tickets: HashMap<usize, Ticket>,
}

impl Ledger {
    fn end(&mut self, id: usize) {
        assert!(self.ended.insert(id), "request {id} ended twice");
        self.waiting.remove(&id);
    }
}

const MODELS: [&str; 2] = ["a", "b"];

fn check_dispatch(
    ledger: &mut Ledger,
    done: Vec<Done<usize>>,
    leases: &mut Vec<Lease>,
    now: Instant,
) {
    let mut last_expired: Option<Instant> = None;
    // Per model: requests of different models do not compete.
    let mut last_granted_priority = [i32::MAX; 2];
    for d in done {
        let (priority, deadline, model) = ledger.waiting[&d.waiter];
        let m = usize::from(model);
        assert_eq!(priority, d.flow.priority);
        match d.result {
            Ok(lease) => {
                assert!(deadline > now, "an expired request was served");
                assert_eq!(
                    usize::from(lease.addr.port()),
                    m + 1,
                    "sent to a server without its model"
                );
                assert!(
                    priority <= last_granted_priority[m],
                    "priority inverted within a dispatch"
                );
                last_granted_priority[m] = priority;
                leases.push(lease);
            }
            Err(Reject::Timeout) => {
                assert!(deadline <= now, "expired before its deadline");
                assert!(
                    last_expired.is_none_or(|l| l <= deadline),
                    "expiry out of deadline order"
                );
                last_expired = Some(deadline);
            }
            Err(Reject::Evicted) => {}
            Err(other) => panic!("unexpected {other:?} from dispatch"),
        }
        ledger.end(d.waiter);
    }
    for (m, &last) in last_granted_priority.iter().enumerate() {
        if last == i32::MAX {
            continue;
        }
        // Nothing of the model of higher priority than its last grant may
        // be left behind.
        let max_left = ledger
            .waiting
            .values()
            .filter(|w| usize::from(w.2) == m)
            .map(|w| w.0)
            .max();
        assert!(
            max_left.is_none_or(|p| p <= last),
            "a request of priority {max_left:?} was passed by one of {last}"
        );
    }
}

/// Work conservation per model: a model with waiting requests has no
/// endpoint that could take one.
fn check_nothing_waits_needlessly(ledger: &Ledger, d: &Dispatcher<usize>, now: Instant) {
    let endpoints = d.endpoints(now);
    for m in 0..MODELS.len() {
        // What its agent hears of: the requests waiting for its model.
        let waiting = ledger
            .waiting
            .values()
            .filter(|w| usize::from(w.2) == m)
            .count();
        for e in endpoints
            .iter()
            .filter(|e| usize::from(e.addr.port()) == m + 1)
        {
            assert_eq!(
                d.demand_of(e.id).queued as usize,
                waiting,
                "model {m}'s demand"
            );
        }
        if waiting == 0 {
            continue;
        }
        let free = endpoints
            .iter()
            .find(|e| usize::from(e.addr.port()) == m + 1 && e.eligible && e.saturation.is_none());
        assert!(free.is_none(), "model {m} waits while {free:?} is free");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn no_request_is_lost_served_twice_or_passed_by_lower_priority(
        ops in proptest::collection::vec(op(), 1..300),
        (fairness, ordering) in band_policy(),
        max_requests in 0usize..20,
        band_limit in proptest::option::of(0usize..6),
    ) {
        let t0 = Instant::now();
        let mut c = config(max_requests);
        c.flow.max_bytes = 20_000;
        c.flow.default_band.fairness = fairness;
        c.flow.default_band.ordering = ordering;
        c.flow.bands.insert(-1, BandConfig { max_requests: band_limit, ..c.flow.default_band });
        let mut d: Dispatcher<usize> = Dispatcher::new(c);
        let mut now = t0;
        let mut ledger = Ledger::default();
        let mut leases: Vec<Lease> = Vec::new();
        let mut next_id = 0;
        for op in ops {
            match op {
                Op::Submit { tenant, priority, bytes, ttl_ms, model, session } => {
                    let id = next_id;
                    next_id += 1;
                    let meta = RequestMeta {
                        flow: FlowKey::new(format!("t{tenant}"), i32::from(priority)),
                        bytes: u64::from(bytes),
                        ttl: ttl_ms.map(|t| Duration::from_millis(u64::from(t))),
                        route: Route {
                            model: Some(Arc::from(MODELS[usize::from(model)])),
                            tokens: crate::tokens::TokenEstimate {
                                prompt: u64::from(bytes),
                                output: 10,
                                output_asked: true,
                            },
                            session: session.map(u64::from),
                            ..Route::default()
                        },
                        weight: u32::from(tenant) + 1,
                    };
                    let deadline = now + d.ttl(meta.ttl);
                    match d.submit(meta, id, now) {
                        Admission::Ready(lease) => {
                            prop_assert!(ledger.waiting.is_empty(), "went ahead of waiters");
                            prop_assert_eq!(usize::from(lease.addr.port()), usize::from(model) + 1);
                            ledger.ended.insert(id);
                            leases.push(lease);
                        }
                        Admission::Queued { ticket, deadline: dl, .. } => {
                            prop_assert_eq!(dl, deadline);
                            ledger.waiting.insert(id, (i32::from(priority), deadline, model));
                            ledger.tickets.insert(id, ticket);
                        }
                        Admission::Rejected(_) => {
                            ledger.ended.insert(id);
                        }
                    }
                }
                Op::Cancel(i) => {
                    if let Some(&id) = ledger.waiting.keys().nth(i % ledger.waiting.len().max(1)) {
                        prop_assert!(d.cancel(ledger.tickets[&id]));
                        ledger.end(id);
                    }
                }
                Op::Release(i) => {
                    if !leases.is_empty() {
                        let l = leases.swap_remove(i % leases.len());
                        d.release(l, now);
                    }
                }
                Op::Advance(ms) => now += Duration::from_millis(u64::from(ms)),
                Op::Report { server, slots, waiting } => {
                    let mut r = model_server(
                        ["s0", "s1"][usize::from(server)],
                        u16::from(server) + 1,
                        u32::from(slots),
                        &[MODELS[usize::from(server)]],
                    );
                    r.requests_waiting = u32::from(waiting);
                    d.report(r, now).unwrap();
                }
            }
            let done = d.dispatch(now);
            check_dispatch(&mut ledger, done, &mut leases, now);
            check_nothing_waits_needlessly(&ledger, &d, now);
            prop_assert_eq!(d.buffered(), ledger.waiting.len());
            prop_assert_eq!(d.in_flight(), leases.len() as u64);
        }
        // Let everything finish: all that waits is either served or expires.
        for l in leases.drain(..) {
            d.release(l, now);
        }
        now += Duration::from_secs(3_600);
        let done = d.dispatch(now);
        check_dispatch(&mut ledger, done, &mut leases, now);
        prop_assert!(ledger.waiting.is_empty());
        prop_assert_eq!(ledger.ended.len(), next_id, "every request ended exactly once");
        prop_assert_eq!(d.buffered(), 0);
        prop_assert_eq!(d.buffered_bytes(), 0);
        prop_assert!(d.flows().is_empty());
    }
}

#[test]
fn slotless_requests_go_to_the_least_loaded_live_endpoint_without_a_slot() {
    let mut d = dispatcher(4);
    let t0 = Instant::now();
    let route = |model: &str| Route {
        model: Some(Arc::from(model)),
        ..Route::default()
    };
    // No agent yet: any model may come, but nobody serves it.
    assert_eq!(d.slotless(&route("m"), t0), Err(Reject::NoEndpoints));
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    d.report(report("b", "127.0.0.1:2", 1), t0).unwrap();
    let busy = ready(d.submit(req("t", 0), "w", t0));
    let other: SocketAddr = if busy.addr.port() == 1 {
        "127.0.0.1:2"
    } else {
        "127.0.0.1:1"
    }
    .parse()
    .unwrap();
    assert_eq!(d.slotless(&route("m"), t0), Ok(other), "the idle one");
    let full = ready(d.submit(req("t", 0), "x", t0));
    // Both saturated: still answered, and nothing was taken.
    let picked = d.slotless(&route("m"), t0).unwrap();
    assert!(picked == busy.addr || picked == full.addr);
    assert_eq!(d.in_flight(), 2);
    assert_eq!(d.slotless(&route("nope"), t0), Err(Reject::UnknownModel));
    d.release(busy, t0);
    d.release(full, t0);
}

#[test]
fn served_models_are_the_live_agents_names_sorted_once() {
    let mut d = dispatcher(4);
    let t0 = Instant::now();
    let mut a = report("a", "127.0.0.1:1", 1);
    a.models = vec!["m".into(), "alias".into()];
    let mut b = report("b", "127.0.0.1:2", 1);
    b.models = vec!["m".into(), "other".into()];
    b.monitoring_interval_ms = 100;
    d.report(a, t0).unwrap();
    d.report(b, t0).unwrap();
    assert_eq!(d.served_models(t0), ["alias", "m", "other"]);
    // b stops reporting: its names go once it is stale (3 intervals).
    assert_eq!(
        d.served_models(t0 + Duration::from_millis(400)),
        ["alias", "m"]
    );
}

#[test]
fn fallbacks_are_taken_only_while_the_model_has_no_eligible_endpoint() {
    let mut d = dispatcher(4);
    let t0 = Instant::now();
    let chain: Vec<Arc<str>> = vec![Arc::from("b"), Arc::from("c")];
    // Nothing registered: nowhere to fall back to either.
    assert_eq!(d.fallback_for("a", &chain, t0), None);
    let mut c = report("c", "127.0.0.1:3", 1);
    c.models = vec!["c".into()];
    d.report(c, t0).unwrap();
    assert_eq!(d.fallback_for("a", &chain, t0).map(|m| &**m), Some("c"));
    let mut b = report("b", "127.0.0.1:2", 1);
    b.models = vec!["b".into()];
    b.monitoring_interval_ms = 100;
    d.report(b, t0).unwrap();
    assert_eq!(
        d.fallback_for("a", &chain, t0).map(|m| &**m),
        Some("b"),
        "in order"
    );
    let mut a = report("a", "127.0.0.1:1", 1);
    a.models = vec!["a".into()];
    d.report(a, t0).unwrap();
    // Busy is not down: a request waits for its own model's endpoint.
    let _busy = ready(d.submit(
        RequestMeta {
            route: Route {
                model: Some(Arc::from("a")),
                ..Route::default()
            },
            ..anon()
        },
        "w",
        t0,
    ));
    assert_eq!(d.fallback_for("a", &chain, t0), None);
    // b goes stale (3 intervals): c is next.
    let later = t0 + Duration::from_millis(400);
    assert_eq!(d.first_live(&chain, later).map(|m| &**m), Some("c"));
}

#[test]
fn a_reload_changes_limits_for_new_requests_and_drops_nothing() {
    let mut d = dispatcher(4);
    let t0 = Instant::now();
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let lease = ready(d.submit(anon(), "first", t0));
    for w in ["w1", "w2", "w3"] {
        queued(d.submit(anon(), w, t0));
    }
    let mut smaller = d.config().clone();
    smaller.flow.max_requests = 2;
    d.reconfigure(smaller);
    assert_eq!(d.buffered(), 3, "nothing queued is dropped");
    assert_eq!(rejected(d.submit(anon(), "w4", t0)), Reject::BufferFull);
    let mut larger = d.config().clone();
    larger.flow.max_requests = 10;
    d.reconfigure(larger);
    queued(d.submit(anon(), "w4", t0));
    d.release(lease, t0);
    let done = d.dispatch(t0);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].waiter, "w1", "in order as before");
    d.release(done.into_iter().next().unwrap().result.unwrap(), t0);
}

fn costing(tenant: &str, prompt: u64, output: u64, asked: bool) -> RequestMeta {
    RequestMeta {
        route: Route {
            tokens: crate::tokens::TokenEstimate {
                prompt,
                output,
                output_asked: asked,
            },
            ..Route::default()
        },
        ..req(tenant, 0)
    }
}

/// A vLLM-like server (one shared KV pool) of `capacity` tokens.
fn pooled_server(port: u16, slots: u32, capacity: u64) -> AgentReport {
    let mut r = report("v", &format!("127.0.0.1:{port}"), slots);
    r.backend = crate::protocol::BackendKind::Vllm;
    r.kv_capacity_tokens = Some(capacity);
    r
}

#[test]
fn a_request_waits_for_token_room_rather_than_fill_a_nearly_full_server() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    d.report(pooled_server(1, 8, 10_000), t0).unwrap();
    // 6,000 of 10,000 tokens in flight, slots free.
    let big = ready(d.submit(costing("t", 5_000, 1_000, true), "big", t0));
    assert_eq!(big.tokens, 6_000);
    assert_eq!(d.endpoints(t0)[0].in_flight_tokens, 6_000);
    // 3,000 more fit; 5,000 more do not: it waits, though slots are free.
    let small = ready(d.submit(costing("t", 2_000, 1_000, true), "small", t0));
    let huge = queued(d.submit(costing("t", 4_000, 1_000, true), "huge", t0));
    assert_eq!(d.endpoints(t0)[0].free_slots, 6);
    // Nothing of the same model passes it, however small.
    queued(d.submit(costing("t", 10, 10, true), "tiny", t0));
    assert!(d.dispatch(t0).is_empty());
    d.release(small, t0);
    assert!(d.dispatch(t0).is_empty(), "9,000 + 5,000 still do not fit");
    d.release(big, t0);
    assert_eq!(granted(&d.dispatch(t0)), ["huge", "tiny"]);
    assert!(!d.cancel(huge), "it was granted");
    assert_eq!(d.endpoints(t0)[0].in_flight_tokens, 5_020);
}

#[test]
fn the_token_budget_is_a_share_of_capacity_and_saturates_the_endpoint() {
    let t0 = Instant::now();
    let mut config = config(30);
    config.saturation.token_budget = 0.5;
    let mut d: Dispatcher<&str> = Dispatcher::new(config);
    d.report(pooled_server(1, 8, 10_000), t0).unwrap();
    let _a = ready(d.submit(costing("t", 4_000, 1_000, true), "a", t0));
    assert_eq!(
        d.endpoints(t0)[0].saturation,
        Some(crate::Saturation::TokenBudget),
        "5,000 of a 5,000-token budget"
    );
    queued(d.submit(costing("t", 1, 1, true), "b", t0));
    // Turned off: tokens do not count.
    let mut off = DispatcherConfig::default();
    off.saturation.token_budget = 0.0;
    d.reconfigure(off);
    assert_eq!(granted(&d.dispatch(t0)), ["b"]);
}

#[test]
fn an_idle_endpoint_takes_a_request_larger_than_its_budget() {
    let t0 = Instant::now();
    let mut config = config(30);
    config.saturation.token_budget = 0.5;
    let mut d: Dispatcher<&str> = Dispatcher::new(config);
    d.report(pooled_server(1, 8, 10_000), t0).unwrap();
    // 8,000 is over the 5,000 budget but within capacity: it goes alone.
    let l = ready(d.submit(costing("t", 7_000, 1_000, true), "a", t0));
    queued(d.submit(costing("t", 1, 1, true), "b", t0));
    d.release(l, t0);
    assert_eq!(granted(&d.dispatch(t0)), ["b"]);
}

#[test]
fn a_request_that_can_never_fit_is_refused_413_at_once() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    // No agent: nothing is known, it waits.
    let early = queued(d.submit(costing("t", 50_000, 10, true), "early", t0));
    assert!(d.cancel(early));
    d.report(pooled_server(1, 8, 10_000), t0).unwrap();
    let r = rejected(d.submit(costing("t", 9_000, 2_000, true), "x", t0));
    assert_eq!(
        (r, r.http_status(), r.reason()),
        (Reject::TooManyTokens, 413, "exceeds-token-capacity")
    );
    // An output bound the operator assumed (none asked) is no reason to
    // refuse: the request goes, counted for what the server can hold.
    let l = ready(d.submit(costing("t", 9_000, 2_000, false), "y", t0));
    assert_eq!(l.tokens, 10_000);
    d.release(l, t0);
    // Another endpoint of unknown capacity might take it: it is admitted.
    d.report(report("u", "127.0.0.1:2", 1), t0).unwrap();
    let _z = ready(d.submit(costing("t", 9_000, 2_000, true), "z", t0));
}

#[test]
fn llamacpp_slots_each_hold_their_share_of_the_context() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    // -c 2048 -np 2: each slot holds 1,024 tokens.
    let mut r = report("l", "127.0.0.1:1", 2);
    r.kv_capacity_tokens = Some(2048);
    d.report(r, t0).unwrap();
    // Unbounded chats (default output 1,024) count one slot's context
    // each, so both slots fill.
    let a = ready(d.submit(costing("t", 20, 1024, false), "a", t0));
    let b = ready(d.submit(costing("t", 20, 1024, false), "b", t0));
    assert_eq!((a.tokens, b.tokens), (1024, 1024));
    // llama-server stops a larger max_tokens at the context's end: only a
    // prompt beyond a slot's context can never be served.
    d.release(a, t0);
    d.release(b, t0);
    let c = ready(d.submit(costing("t", 1000, 5000, true), "c", t0));
    d.release(c, t0);
    let r = rejected(d.submit(costing("t", 1025, 1, true), "d", t0));
    assert_eq!(r, Reject::TooManyTokens);
}

#[test]
fn orphaned_slots_keep_their_tokens_until_freed() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let mut r = report("l", "127.0.0.1:1", 2);
    r.kv_capacity_tokens = Some(4096);
    d.report(r.clone(), t0).unwrap();
    let l = ready(d.submit(costing("t", 500, 500, true), "a", t0));
    d.orphan(l, false, t0);
    assert_eq!(d.endpoints(t0)[0].in_flight_tokens, 1000);
    // The engine finished it: the next report frees slot and tokens.
    d.report(r, t0 + MS).unwrap();
    assert_eq!(d.endpoints(t0)[0].in_flight_tokens, 0);
}

proptest! {
    /// Whatever requests come and go, in-flight tokens are the sum of the
    /// live leases' tokens and never exceed the budget unless a single
    /// request holds the endpoint.
    #[test]
    fn in_flight_tokens_are_the_leases_tokens(
        ops in proptest::collection::vec((0u8..3, 0u64..6_000, 0u64..3_000), 1..80)
    ) {
        let t0 = Instant::now();
        let mut d = dispatcher(1000);
        d.report(pooled_server(1, 16, 10_000), t0).unwrap();
        let mut leases: Vec<Lease> = Vec::new();
        for (op, prompt, output) in ops {
            match op {
                0 | 1 => {
                    if let Admission::Ready(l) = d.submit(costing("t", prompt, output, true), "r", t0) {
                        leases.push(l);
                    }
                }
                _ => {
                    if !leases.is_empty() {
                        let l = leases.remove(prompt as usize % leases.len());
                        d.release(l, t0);
                    }
                }
            }
            for done in d.dispatch(t0) {
                if let Ok(l) = done.result {
                    leases.push(l);
                }
            }
            let sum: u64 = leases.iter().map(|l| l.tokens).sum();
            let snap = &d.endpoints(t0)[0];
            prop_assert_eq!(snap.in_flight_tokens, sum);
            prop_assert!(sum <= 10_000 || leases.len() == 1, "{} tokens in {} leases", sum, leases.len());
        }
    }
}

#[test]
fn token_limits_shed_and_evict_like_byte_limits() {
    let t0 = Instant::now();
    let mut config = config(100);
    config.flow.max_tokens = Some(10_000);
    config.flow.bands.insert(
        1,
        BandConfig {
            max_tokens: Some(3_000),
            ..BandConfig::default()
        },
    );
    let mut d: Dispatcher<&str> = Dispatcher::new(config);
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let _busy = ready(d.submit(costing("t", 1, 1, true), "busy", t0));
    let at = |p: i32, tokens: u64| RequestMeta {
        flow: FlowKey::new("t", p),
        ..costing("t", tokens, 0, true)
    };
    // The band holds 3,000 tokens: the next one is shed.
    queued(d.submit(at(1, 2_500), "b1", t0));
    assert_eq!(rejected(d.submit(at(1, 600), "b2", t0)), Reject::Shed);
    // 10,000 in all: a priority-0 request beyond is refused (nothing lower
    // to evict), a priority-5 one evicts priority-0 work.
    queued(d.submit(at(0, 7_000), "low", t0));
    assert_eq!(d.buffered_tokens(), 9_500);
    assert_eq!(
        rejected(d.submit(at(0, 600), "low2", t0)),
        Reject::BufferFull
    );
    queued(d.submit(at(5, 600), "high", t0));
    let done = d.dispatch(t0);
    assert_eq!(done.len(), 1);
    assert_eq!(
        (done[0].waiter, done[0].result.as_ref().unwrap_err()),
        ("low", &Reject::Evicted)
    );
    assert_eq!(d.buffered_tokens(), 3_100);
    // A request larger than the whole buffer can never be queued.
    assert_eq!(
        rejected(d.submit(at(9, 10_001), "x", t0)),
        Reject::BufferFull
    );
}

/// A dispatcher whose default band is token-fair, with one single-slot
/// endpoint, the slot taken (returned).
fn token_fair() -> (Dispatcher<&'static str>, Lease) {
    let t0 = Instant::now();
    let mut config = config(10_000);
    config.flow.default_band.fairness = FairnessPolicy::TokenFair;
    let mut d = Dispatcher::new(config);
    d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
    let busy = ready(d.submit(costing("x", 1, 0, true), "busy", t0));
    (d, busy)
}

fn weighted(tenant: &str, tokens: u64, weight: u32) -> RequestMeta {
    RequestMeta {
        weight,
        ..costing(tenant, tokens, 0, true)
    }
}

/// Serves one request through the single slot: releases `lease`, returns
/// the next grant (settled to `actual` tokens when given).
fn serve_next(
    d: &mut Dispatcher<&'static str>,
    lease: Lease,
    actual: Option<u64>,
) -> (&'static str, Lease) {
    let now = Instant::now();
    d.release(lease, now);
    let mut done = d.dispatch(now);
    assert_eq!(done.len(), 1, "one freed slot, one grant");
    let g = done.pop().unwrap();
    if let (Some(actual), Some(charge)) = (actual, &g.charge) {
        d.settle(charge, actual);
    }
    (g.waiter, g.result.unwrap())
}

/// Tenants H (1,000-token requests) and L (100-token requests), both
/// backlogged, weights `wh` and `wl`: tokens served per tenant after
/// `n` grants.
fn token_shares(wh: u32, wl: u32, n: usize) -> (u64, u64, Vec<&'static str>) {
    let (mut d, mut lease) = token_fair();
    let t0 = Instant::now();
    for _ in 0..200 {
        queued(d.submit(weighted("H", 1000, wh), "H", t0));
    }
    for _ in 0..2000 {
        queued(d.submit(weighted("L", 100, wl), "L", t0));
    }
    let (mut h, mut l) = (0, 0);
    let mut order = Vec::new();
    for _ in 0..n {
        let (w, next) = serve_next(&mut d, lease, None);
        lease = next;
        order.push(w);
        match w {
            "H" => h += 1000,
            _ => l += 100,
        }
        // Never more than one request's worth apart (weighted).
        let (vh, vl) = (h * 1000 / u64::from(wh), l * 1000 / u64::from(wl));
        assert!(
            vh.abs_diff(vl) <= 1000 * 1000,
            "H {h} L {l} after {order:?}"
        );
    }
    d.release(lease, t0);
    (h, l, order)
}

#[test]
fn token_fairness_serves_tenants_equal_tokens_not_equal_requests() {
    let (h, l, order) = token_shares(1, 1, 220);
    // Round-robin would give L 110 turns of 100 tokens against H's 110 of
    // 1,000; tokens make it 20 H requests against 200 L.
    assert_eq!(order.iter().filter(|w| **w == "H").count(), 20);
    assert_eq!((h, l), (20_000, 20_000));
}

#[test]
fn token_fairness_follows_weights() {
    let (h, l, _) = token_shares(2, 1, 330);
    let ratio = h as f64 / l as f64;
    assert!((1.8..2.2).contains(&ratio), "H {h} L {l}");
}

#[test]
fn a_flow_back_from_idle_banks_no_credit() {
    let (mut d, mut lease) = token_fair();
    let t0 = Instant::now();
    // H alone for 10 requests: its counter runs ahead of L's (which was
    // idle, not waiting).
    for _ in 0..12 {
        queued(d.submit(weighted("H", 1000, 1), "H", t0));
    }
    for _ in 0..10 {
        (_, lease) = serve_next(&mut d, lease, None);
    }
    // L comes back with plenty: lifted to the floor, it does not get ten
    // turns in a row for the time it was away.
    for _ in 0..20 {
        queued(d.submit(weighted("L", 1000, 1), "L", t0));
    }
    let mut order = Vec::new();
    for _ in 0..4 {
        let (w, next) = serve_next(&mut d, lease, None);
        order.push(w);
        lease = next;
    }
    assert!(order.contains(&"H"), "{order:?}");
    d.release(lease, t0);
}

#[test]
fn a_flow_that_idles_while_ahead_keeps_its_lead() {
    let (mut d, mut lease) = token_fair();
    let t0 = Instant::now();
    queued(d.submit(weighted("H", 5000, 1), "H", t0));
    for _ in 0..100 {
        queued(d.submit(weighted("L", 100, 1), "L", t0));
    }
    let (w, next) = serve_next(&mut d, lease, None);
    assert_eq!(w, "H", "first come at equal counters");
    lease = next;
    // H's queue emptied (its flow was freed) 5,000 tokens ahead; it comes
    // right back: L still gets 50 requests first (and the 51st: at equal
    // counters the older head goes first).
    queued(d.submit(weighted("H", 5000, 1), "H", t0));
    let mut l_first = 0;
    loop {
        let (w, next) = serve_next(&mut d, lease, None);
        lease = next;
        if w == "H" {
            break;
        }
        l_first += 1;
    }
    assert_eq!(l_first, 51);
    d.release(lease, t0);
}

#[test]
fn settling_to_actual_usage_refunds_the_unused_estimate() {
    let (mut d, mut lease) = token_fair();
    let t0 = Instant::now();
    // H asks for 1,000 but each answer uses 100: settled, H and L (100
    // each) alternate instead of L getting ten turns per H.
    for _ in 0..20 {
        queued(d.submit(weighted("H", 1000, 1), "H", t0));
        queued(d.submit(weighted("L", 100, 1), "L", t0));
    }
    let mut order = Vec::new();
    for _ in 0..10 {
        let (w, next) = serve_next(&mut d, lease, Some(100));
        order.push(w);
        lease = next;
    }
    let h = order.iter().filter(|w| **w == "H").count();
    assert!((4..=6).contains(&h), "{order:?}");
    d.release(lease, t0);
}
