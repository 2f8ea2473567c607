//! The affinity hold under a controlled clock: a request waits for the
//! busy server that has its prompt exactly while that is predicted to be
//! sooner than a prefill elsewhere (the wait-or-go rule), never past its
//! bound or half its time left, never letting lower priorities pass; and a
//! property test that a free slot idles only while every request that
//! may take it is held.

use super::*;

fn with_prompt(tenant: &str, priority: i32, prefix: &[u64]) -> RequestMeta {
    RequestMeta {
        route: Route {
            prefix: prefix.to_vec(),
            ..Route::default()
        },
        ..req(tenant, priority)
    }
}

/// Two one-slot endpoints, both busy: a conversation's first turn on one
/// (returned first), an unrelated request on the other.
fn two_busy_endpoints(d: &mut Dispatcher<&'static str>, t0: Instant) -> (Lease, Lease) {
    d.report(model_server("a", 1, 1, &[]), t0).unwrap();
    d.report(model_server("b", 2, 1, &[]), t0).unwrap();
    let home = ready(d.submit(with_prompt("t", 0, &[1, 2, 3]), "turn-1", t0));
    let other = ready(d.submit(with_prompt("u", 0, &[90]), "other", t0));
    assert_ne!(home.addr, other.addr);
    (home, other)
}

#[test]
fn a_conversation_waits_for_its_busy_server_while_others_pass_it() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let (home, other) = two_busy_endpoints(&mut d, t0);
    let home_addr = home.addr;
    queued(d.submit(with_prompt("t", 0, &[1, 2, 3, 4]), "turn-2", t0));
    assert_eq!(d.next_hold_end(), None);
    // The other server frees: the next turn would prefill its whole prompt
    // again there, so it keeps waiting.
    d.release(other, t0);
    assert!(d.dispatch(t0 + 10 * MS).is_empty());
    assert_eq!(d.take_new_holds().held, 1);
    assert_eq!(d.take_new_holds().held, 0);
    assert_eq!(d.next_hold_end(), Some(t0 + 210 * MS), "200 ms from then");
    // Same tenant, behind it, nothing cached anywhere: it passes.
    queued(d.submit(with_prompt("t", 0, &[70]), "fresh", t0 + 15 * MS));
    assert_eq!(granted(&d.dispatch(t0 + 15 * MS)), ["fresh"]);
    d.release(home, t0);
    let done = d.dispatch(t0 + 20 * MS);
    assert_eq!(granted(&done), ["turn-2"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr, home_addr);
    assert_eq!(d.next_hold_end(), None, "it left");
}

#[test]
fn a_waiting_turn_lets_another_tenant_pass_it_only_a_few_requests_ahead() {
    let t0 = Instant::now();
    let mut c = config(30);
    c.scheduling.affinity_hold = Duration::from_secs(30);
    let mut d = Dispatcher::new(c);
    let (home, mut other) = two_busy_endpoints(&mut d, t0);
    let other_addr = other.addr;
    // Tenant u keeps a request queued for every slot b frees: each one
    // passes turn-2 (waiting for a is cheaper than prefilling on b) until
    // u is eight of t's requests ahead; then turn-2 takes b's slot.
    // Token fairness counts estimated tokens: 100 each here.
    let sized = |tenant, prefix: &[u64]| {
        let mut meta = with_prompt(tenant, 0, prefix);
        meta.route.tokens.output = 100;
        meta
    };
    queued(d.submit(sized("t", &[1, 2, 3, 4]), "turn-2", t0));
    let mut passed = 0;
    for i in 0..20u64 {
        let now = t0 + MS * i as u32;
        queued(d.submit(sized("u", &[70 + i]), "fresh", now));
        d.release(other, now);
        let done = d.dispatch(now);
        assert_eq!(done.len(), 1, "b's slot never idles");
        let name = done[0].waiter;
        other = done.into_iter().next().unwrap().result.unwrap();
        assert_eq!(other.addr, other_addr);
        if name == "turn-2" {
            break;
        }
        passed += 1;
    }
    assert_eq!(passed, 8, "u passed {passed} times");
    d.release(other, t0);
    d.release(home, t0);
}

#[test]
fn a_freed_server_goes_to_the_request_held_for_it_before_the_next_in_turn() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    d.report(model_server("a", 1, 1, &[]), t0).unwrap();
    d.report(model_server("b", 2, 1, &[]), t0).unwrap();
    d.report(model_server("c", 3, 1, &[]), t0).unwrap();
    let _on_a = ready(d.submit(with_prompt("x", 0, &[1, 2, 3]), "a-1", t0));
    let on_b = ready(d.submit(with_prompt("y", 0, &[11, 12, 13]), "b-1", t0));
    let on_c = ready(d.submit(with_prompt("z", 0, &[90]), "c-1", t0));
    let b_addr = on_b.addr;
    queued(d.submit(with_prompt("t", 0, &[1, 2, 3, 4]), "a-2", t0));
    queued(d.submit(with_prompt("u", 0, &[11, 12, 13, 14]), "b-2", t0));
    d.release(on_c, t0);
    assert!(d.dispatch(t0).is_empty(), "both wait for their servers");
    queued(d.submit(with_prompt("v", 0, &[70]), "fresh", t0));
    assert_eq!(granted(&d.dispatch(t0)), ["fresh"]);
    // Tenant t's turn comes first and its second request has nothing
    // cached anywhere, but b's slot is what b-2 has been waiting for.
    queued(d.submit(with_prompt("t", 0, &[71]), "t-next", t0));
    d.release(on_b, t0);
    let done = d.dispatch(t0 + 10 * MS);
    assert_eq!(granted(&done), ["b-2"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr, b_addr);
}

#[test]
fn a_freed_server_goes_to_its_own_conversation_before_one_cached_elsewhere() {
    let t0 = Instant::now();
    let mut d = Dispatcher::new(round_robin(30));
    let mut a = model_server("a", 1, 1, &[]);
    d.report(a.clone(), t0).unwrap();
    d.report(model_server("b", 2, 1, &[]), t0).unwrap();
    d.report(model_server("c", 3, 1, &[]), t0).unwrap();
    let on_a = ready(d.submit(with_prompt("t", 0, &[1]), "a-1", t0));
    let on_b = ready(d.submit(with_prompt("u", 0, &[11, 12]), "b-1", t0));
    let on_c = ready(d.submit(with_prompt("v", 0, &[21, 22, 23]), "c-1", t0));
    assert_eq!(
        (on_a.addr.port(), on_b.addr.port(), on_c.addr.port()),
        (1, 2, 3)
    );
    // b frees with only c-2 waiting: it is held for c (its long prompt).
    queued(d.submit(with_prompt("v", 0, &[21, 22, 23, 24]), "c-2", t0));
    d.release(on_b, t0);
    assert!(d.dispatch(t0).is_empty());
    assert_eq!(d.take_new_holds().held, 1);
    // a's engine has five requests of its own queued: for a-2, waiting
    // there (6 × 1,000 ms + 4,096 ms) costs more than prefilling all of it
    // on b (8,192 ms), so the wait-or-go rule alone would send it to b.
    a.requests_waiting = 5;
    d.report(a, t0).unwrap();
    queued(d.submit(with_prompt("t", 0, &[1, 2]), "a-2", t0));
    queued(d.submit(with_prompt("u", 0, &[11, 12, 13]), "b-2", t0));
    // a-2 is next in turn, but b-2's conversation is on b.
    let done = d.dispatch(t0);
    assert_eq!(granted(&done), ["b-2"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr.port(), 2);
    // a-2 was passed, not held by choice: its clock runs, the affinity
    // holds do not count it; once its hold is over it takes the next free
    // slot, wherever.
    assert_eq!(d.take_new_holds(), HoldsBegun { held: 0, clocks: 1 });
    d.release(done.into_iter().next().unwrap().result.unwrap(), t0);
    for (id, port) in [("a", 1), ("b", 2), ("c", 3)] {
        d.report(model_server(id, port, 1, &[]), t0 + 150 * MS)
            .unwrap();
    }
    // c frees too; b-3 of b's conversation comes after a-2's hold is
    // over: c-2 goes home to c, a-2 is passed no more and takes b.
    d.release(on_c, t0);
    queued(d.submit(with_prompt("u", 0, &[11, 12, 13, 14]), "b-3", t0 + 200 * MS));
    let done = d.dispatch(t0 + 200 * MS);
    let mut went: Vec<(&str, u16)> = done
        .iter()
        .map(|d| (d.waiter, d.result.as_ref().unwrap().addr.port()))
        .collect();
    went.sort_unstable();
    assert_eq!(went, [("a-2", 2), ("c-2", 3)]);
    d.release(on_a, t0);
}

#[test]
fn a_held_request_takes_any_server_once_its_hold_ends() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let (home, other) = two_busy_endpoints(&mut d, t0);
    queued(d.submit(with_prompt("t", 0, &[1, 2, 3, 4]), "turn-2", t0));
    let other_addr = other.addr;
    d.release(other, t0);
    assert!(d.dispatch(t0 + 50 * MS).is_empty(), "held");
    assert_eq!(d.next_hold_end(), Some(t0 + 250 * MS));
    assert!(d.dispatch(t0 + 249 * MS).is_empty(), "still held");
    let done = d.dispatch(t0 + 250 * MS);
    assert_eq!(granted(&done), ["turn-2"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr, other_addr);
    d.release(home, t0);
}

#[test]
fn a_hold_ends_with_half_the_time_left_to_the_deadline() {
    let t0 = Instant::now();
    let mut c = config(30);
    c.scheduling.affinity_hold = Duration::from_secs(30);
    let mut d = Dispatcher::new(c);
    let (home, other) = two_busy_endpoints(&mut d, t0);
    let mut turn = with_prompt("t", 0, &[1, 2, 3, 4]);
    turn.ttl = Some(Duration::from_secs(4));
    queued(d.submit(turn, "turn-2", t0));
    let other_addr = other.addr;
    d.release(other, t0);
    assert!(d.dispatch(t0 + 1_000 * MS).is_empty(), "held");
    // 3 s left at the first hold: it ends 1.5 s later, not 30 s.
    assert_eq!(d.next_hold_end(), Some(t0 + 2_500 * MS));
    // The agents report every second: both are still there.
    for (id, port) in [("a", 1), ("b", 2)] {
        d.report(model_server(id, port, 1, &[]), t0 + 2_000 * MS)
            .unwrap();
    }
    assert!(d.dispatch(t0 + 2_499 * MS).is_empty(), "still held");
    let done = d.dispatch(t0 + 2_500 * MS);
    assert_eq!(granted(&done), ["turn-2"], "served, not expired");
    assert_eq!(done[0].result.as_ref().unwrap().addr, other_addr);
    d.release(home, t0);
}

#[test]
fn requests_for_one_busy_server_wait_only_while_its_queue_beats_a_prefill() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    d.report(model_server("a", 1, 1, &[]), t0).unwrap();
    let home = ready(d.submit(with_prompt("t", 0, &[1, 2, 3]), "first", t0));
    d.report(model_server("b", 2, 8, &[]), t0).unwrap();
    // Each prompt: 4 blocks of 4,096 tokens, 3 cached on a. Going to b
    // costs 16,384 ms of prefill (1 ms per token, the default); waiting
    // for a costs 4,096 ms plus 1,000 ms (its default service time, one
    // slot) for itself and each request held for a before it: the first
    // twelve wait, the thirteenth goes.
    let tenants = [
        "t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7", "t8", "t9", "t10", "t11", "t12",
    ];
    for t in tenants {
        queued(d.submit(with_prompt(t, 0, &[1, 2, 3, 4]), t, t0));
    }
    // b was busy until now: the pass sees all thirteen. The thirteenth
    // waits 1 % of its prefill before it spills (164 ms), then goes: more
    // wait for a than for b.
    assert!(d.dispatch(t0).is_empty());
    let spill_at = t0 + Duration::from_micros(163_840);
    assert_eq!(d.next_hold_end(), Some(spill_at));
    let done = d.dispatch(spill_at);
    assert_eq!(granted(&done), ["t12"]);
    d.release(done.into_iter().next().unwrap().result.unwrap(), t0);
    d.release(home, t0);
    assert_eq!(granted(&d.dispatch(t0)).len(), 9, "a's slot and b's eight");
}

#[test]
fn a_spill_passes_the_requests_waiting_for_the_free_server_only_to_even_out_the_work() {
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    let lease = |done: Vec<Done<&'static str>>| done.into_iter().next().unwrap().result.unwrap();
    // Holds as long as the default's; round robin: token fairness would
    // let a request passed too often take the slot (another rule).
    let mut c = round_robin(60);
    c.scheduling.affinity_hold = Duration::from_secs(5);
    let mut d = Dispatcher::new(c);
    // a caches p's prompt, b q's; both busy.
    d.report(model_server("a", 1, 1, &[]), t0).unwrap();
    let on_a = ready(d.submit(with_prompt("p", 0, &[1, 2, 3]), "first-p", t0));
    d.report(model_server("b", 2, 1, &[]), t0).unwrap();
    let mut on_b = ready(d.submit(with_prompt("q", 0, &[70, 71, 72]), "first-q", t0));
    assert_eq!(on_b.addr.port(), 2);
    // Thirteen requests for p's prompt (the thirteenth would spill, as in
    // the test above), fifteen for q's: each tenant its own.
    const P: [&str; 13] = [
        "p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8", "p9", "p10", "p11", "p12",
    ];
    const Q: [&str; 15] = [
        "q0", "q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8", "q9", "q10", "q11", "q12", "q13",
        "q14",
    ];
    for p in P {
        queued(d.submit(with_prompt(p, 0, &[1, 2, 3, 4]), p, t0));
    }
    for q in Q {
        queued(d.submit(with_prompt(q, 0, &[70, 71, 72, 73]), q, t0));
    }
    // b frees: the first twelve are held for a, the thirteenth waits out
    // its spill delay, b serves its own.
    d.release(on_b, t0);
    let done = d.dispatch(ms(0));
    assert_eq!(granted(&done), ["q0"]);
    on_b = lease(done);
    assert_eq!(d.next_hold_end(), Some(t0 + Duration::from_micros(163_840)));
    assert!(d.dispatch(ms(164)).is_empty(), "nothing is free");
    // Its delay is over, but a carries no more than its share (the mean
    // of requests in flight and waiting, a's and b's) until b's queue is
    // two shorter: b's own take its slot, each a cached prefill there.
    for (at, next) in [(200, "q1"), (300, "q2")] {
        d.release(on_b, t0);
        let done = d.dispatch(ms(at));
        assert_eq!(granted(&done), [next], "at {at} ms");
        on_b = lease(done);
    }
    // Fourteen on a, twelve on b: the spill goes.
    d.release(on_b, t0);
    assert_eq!(granted(&d.dispatch(ms(400))), ["p12"]);
    d.release(on_a, t0);
}

#[test]
fn a_slot_no_held_request_wants_goes_to_a_request_behind_them_in_their_flow() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    d.report(model_server("a", 1, 1, &[]), t0).unwrap();
    let home = ready(d.submit(with_prompt("t", 0, &[1, 2, 3]), "first", t0));
    // One tenant: more of its requests wait for a's cache (each is
    // quicker there than prefilling again, as in the test above) than a
    // pass looks at in a flow before it gives up.
    let turns = ["turn-1", "turn-2", "turn-3", "turn-4", "turn-5", "turn-6"];
    for turn in turns {
        queued(d.submit(with_prompt("t", 0, &[1, 2, 3, 4]), turn, t0));
    }
    queued(d.submit(with_prompt("t", 0, &[70]), "fresh", t0));
    d.report(model_server("b", 2, 1, &[]), t0).unwrap();
    // b frees: none of the held turns wants it, the request behind them
    // does, and b does not idle until a's hold ends.
    assert_eq!(granted(&d.dispatch(t0)), ["fresh"]);
    d.release(home, t0);
    assert_eq!(
        granted(&d.dispatch(t0)),
        ["turn-1"],
        "a's cache still waited for"
    );
}

#[test]
fn a_held_request_keeps_lower_priorities_waiting() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let (home, other) = two_busy_endpoints(&mut d, t0);
    queued(d.submit(with_prompt("t", 5, &[1, 2, 3, 4]), "urgent", t0));
    queued(d.submit(with_prompt("u", 0, &[70]), "low", t0));
    d.release(other, t0);
    assert!(
        d.dispatch(t0).is_empty(),
        "the free slot is kept for priority 5"
    );
    d.release(home, t0);
    assert_eq!(granted(&d.dispatch(t0)), ["urgent", "low"]);
}

#[test]
fn a_zero_affinity_hold_never_holds() {
    let t0 = Instant::now();
    let mut config = config(30);
    config.scheduling.affinity_hold = Duration::ZERO;
    let mut d = Dispatcher::new(config);
    let (home, other) = two_busy_endpoints(&mut d, t0);
    queued(d.submit(with_prompt("t", 0, &[1, 2, 3, 4]), "turn-2", t0));
    let other_addr = other.addr;
    d.release(other, t0);
    let done = d.dispatch(t0);
    assert_eq!(granted(&done), ["turn-2"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr, other_addr);
    assert_eq!(d.next_hold_end(), None);
    d.release(home, t0);
}

mod properties {
    use super::*;
    use crate::endpoint::Timing;

    #[derive(Debug, Clone)]
    enum Op {
        /// Turn `turns` of conversation `conversation`: its prompt is the
        /// conversation's first `turns` blocks.
        Submit {
            tenant: u8,
            priority: i8,
            conversation: u8,
            turns: u8,
            ttl_ms: Option<u16>,
        },
        /// Ends a request that took `service_ms` on its engine.
        Release(usize, u16),
        Advance(u16),
        Report {
            server: u8,
            slots: u8,
            waiting: u8,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u8..4, -1i8..2, 0u8..3, 1u8..6, proptest::option::of(1u16..8_000)).prop_map(
                |(tenant, priority, conversation, turns, ttl_ms)| Op::Submit {
                    tenant, priority, conversation, turns, ttl_ms
                }
            ),
            3 => (any::<usize>(), 1u16..5_000).prop_map(|(i, ms)| Op::Release(i, ms)),
            2 => (0u16..800).prop_map(Op::Advance),
            1 => (0u8..3, 0u8..3, 0u8..3).prop_map(|(server, slots, waiting)| Op::Report { server, slots, waiting }),
        ]
    }

    fn server(i: u8, slots: u8, waiting: u8) -> AgentReport {
        let mut r = model_server(
            ["s0", "s1", "s2"][usize::from(i)],
            u16::from(i) + 1,
            u32::from(slots),
            &[],
        );
        r.requests_waiting = u32::from(waiting);
        r
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Three servers of one model, conversations that share prefixes,
        /// engines whose costs change: whatever happens, every request
        /// ends once, none is served after its deadline, none passes a
        /// waiting request of higher priority, a free slot idles only
        /// while every request of the highest waiting priority is held
        /// for another server, and no hold lasts past its bound.
        #[test]
        fn a_free_slot_idles_only_for_a_held_request_and_priorities_stay_strict(
            ops in proptest::collection::vec(op(), 1..200),
            hold_ms in prop_oneof![Just(0u64), Just(200), Just(5_000)],
        ) {
            let t0 = Instant::now();
            let mut c = config(20);
            c.scheduling.affinity_hold = Duration::from_millis(hold_ms);
            let mut d: Dispatcher<usize> = Dispatcher::new(c);
            for i in 0..3 {
                d.report(server(i, 1, 0), t0).unwrap();
            }
            let mut now = t0;
            let mut next_id = 0;
            let mut ended: HashSet<usize> = HashSet::new();
            // id → (priority, deadline) of requests queued now.
            let mut waiting: BTreeMap<usize, (i32, Instant)> = BTreeMap::new();
            let mut tickets: HashMap<usize, Ticket> = HashMap::new();
            let mut leases: Vec<Lease> = Vec::new();
            for op in ops {
                match op {
                    Op::Submit { tenant, priority, conversation, turns, ttl_ms } => {
                        let id = next_id;
                        next_id += 1;
                        let base = u64::from(conversation) * 100;
                        let prefix: Vec<u64> = (1..=u64::from(turns)).map(|b| base + b).collect();
                        let mut meta = with_prompt(&format!("t{tenant}"), i32::from(priority), &prefix);
                        meta.ttl = ttl_ms.map(|t| Duration::from_millis(u64::from(t)));
                        let deadline = now + d.ttl(meta.ttl);
                        match d.submit(meta, id, now) {
                            Admission::Ready(lease) => {
                                prop_assert!(waiting.is_empty(), "went ahead of waiters");
                                ended.insert(id);
                                leases.push(lease);
                            }
                            Admission::Queued { ticket, .. } => {
                                waiting.insert(id, (i32::from(priority), deadline));
                                tickets.insert(id, ticket);
                            }
                            Admission::Rejected(_) => {
                                ended.insert(id);
                            }
                        }
                    }
                    Op::Release(i, ms) => {
                        if !leases.is_empty() {
                            let l = leases.swap_remove(i % leases.len());
                            d.observe_timing(&l, &Timing {
                                prefilled_tokens: 1_000,
                                prefill: Some(Duration::from_millis(u64::from(ms) / 2)),
                                service: Some(Duration::from_millis(u64::from(ms))),
                                ..Timing::default()
                            });
                            d.release(l, now);
                        }
                    }
                    Op::Advance(ms) => now += Duration::from_millis(u64::from(ms)),
                    Op::Report { server: i, slots, waiting: w } => {
                        d.report(server(i, slots, w), now).unwrap();
                    }
                }
                let mut lowest_granted = i32::MAX;
                for done in d.dispatch(now) {
                    let (priority, deadline) = waiting.remove(&done.waiter).expect("waiting");
                    prop_assert!(ended.insert(done.waiter), "ended twice");
                    match done.result {
                        Ok(lease) => {
                            prop_assert!(deadline > now, "served after its deadline");
                            lowest_granted = lowest_granted.min(priority);
                            leases.push(lease);
                        }
                        Err(Reject::Timeout) => prop_assert!(deadline <= now),
                        Err(Reject::Evicted) => {}
                        Err(other) => prop_assert!(false, "unexpected {:?}", other),
                    }
                }
                let highest_waiting = waiting.values().map(|w| w.0).max();
                prop_assert!(
                    highest_waiting.is_none_or(|p| p <= lowest_granted),
                    "priority {:?} passed by {}", highest_waiting, lowest_granted
                );
                let hold_end = d.next_hold_end();
                prop_assert!(hold_end.is_none_or(|end| end > now && end <= now + Duration::from_millis(hold_ms)));
                let free = d
                    .endpoints(now)
                    .into_iter()
                    .find(|e| e.eligible && e.saturation.is_none());
                // Of the requests that may take it (the highest waiting
                // priority), each one waits for another server's cache.
                if free.is_some() {
                    for (id, (priority, _)) in &waiting {
                        prop_assert!(
                            Some(*priority) < highest_waiting || d.in_hold(tickets[id], now),
                            "request {} waits, not held, while {:?} is free", id, free
                        );
                    }
                }
                prop_assert_eq!(d.buffered(), waiting.len());
            }
            for l in leases.drain(..) {
                d.release(l, now);
            }
            now += Duration::from_secs(3_600);
            for done in d.dispatch(now) {
                prop_assert!(ended.insert(done.waiter), "ended twice");
                waiting.remove(&done.waiter);
            }
            prop_assert!(waiting.is_empty());
            prop_assert_eq!(ended.len(), next_id, "every request ended exactly once");
        }
    }
}

/// A request held for the busy server whose engine says (its KV-cache
/// events) it holds the prompt is matched again when that engine's blocks
/// change: once they are evicted, it no longer waits for them and takes
/// the free server.
#[test]
fn a_request_held_for_an_engines_blocks_goes_once_the_engine_evicts_them() {
    use crate::kv_events::{EngineHeld, Matched};
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let (home, other) = two_busy_endpoints(&mut d, t0);
    let (cached, free) = (home.addr, other.addr);
    let mut turn = with_prompt("t", 0, &[50]);
    turn.route.tokens.prompt = 8_000;
    turn.route.engine_held = Some(Arc::new(EngineHeld {
        blocks: 8,
        by_endpoint: vec![
            (cached, Matched { gpu: 8, cpu: 0 }),
            (free, Matched::default()),
        ],
        keys: (1..=8).collect(),
    }));
    queued(d.submit(turn, "turn-2", t0));
    d.release(other, t0);
    assert!(d.dispatch(t0 + 10 * MS).is_empty(), "held for its blocks");
    // Another engine's change, or one that leaves the prompt held, changes
    // nothing.
    assert_eq!(d.rematch(free, |_| Matched::default(), usize::MAX), 0);
    let all = |keys: &[u64]| Matched {
        gpu: keys.len(),
        cpu: 0,
    };
    assert_eq!(d.rematch(cached, all, usize::MAX), 0);
    assert!(d.dispatch(t0 + 20 * MS).is_empty(), "still held");
    // The engine evicted the prompt's blocks.
    assert_eq!(d.rematch(cached, |_| Matched::default(), usize::MAX), 1);
    let done = d.dispatch(t0 + 30 * MS);
    assert_eq!(granted(&done), ["turn-2"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr, free);
    d.release(home, t0);
}

#[test]
fn matching_again_stops_at_its_bound_of_keys_looked_up() {
    use crate::kv_events::{EngineHeld, Matched};
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    let (home, _other) = two_busy_endpoints(&mut d, t0);
    let cached = home.addr;
    for i in 0..10 {
        let mut turn = with_prompt("t", 0, &[60 + i]);
        turn.route.engine_held = Some(Arc::new(EngineHeld {
            blocks: 8,
            by_endpoint: vec![(cached, Matched { gpu: 8, cpu: 0 })],
            keys: (1..=8).collect(),
        }));
        queued(d.submit(turn, "turn", t0));
    }
    // Each request looks up one key (it holds none: the first misses): a
    // bound of 3 keys matches 3 of them again.
    let mut asked = 0;
    let changed = d.rematch(
        cached,
        |_| {
            asked += 1;
            Matched::default()
        },
        3,
    );
    assert_eq!((changed, asked), (3, 3));
}
