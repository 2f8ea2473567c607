//! Sessions under a controlled clock: a conversation goes back to the
//! endpoint of its last turn, yields to saturation after the affinity hold
//! (or waits until its TTL in hard mode), and lets go of an endpoint that
//! is gone or of a session idle too long.

use super::*;
use crate::session::SessionConfig;

/// A turn of a long conversation: prefilling its 8,000 tokens elsewhere
/// costs seconds at the engines' default costs, so waiting for the endpoint
/// that has them pays.
fn in_session(tenant: &str, session: u64) -> RequestMeta {
    RequestMeta {
        route: Route {
            session: Some(session),
            tokens: crate::tokens::TokenEstimate {
                prompt: 8_000,
                ..Default::default()
            },
            ..Route::default()
        },
        ..req(tenant, 0)
    }
}

fn with_sessions(sessions: SessionConfig) -> Dispatcher<&'static str> {
    let mut c = config(1_000);
    c.scheduling.sessions = sessions;
    Dispatcher::new(c)
}

/// Two one-slot endpoints; the session's first turn took `a` and still
/// runs; `b` is free.
fn first_turn_running(d: &mut Dispatcher<&'static str>, t0: Instant) -> Lease {
    d.report(model_server("a", 1, 1, &[]), t0).unwrap();
    let first = ready(d.submit(in_session("t", 7), "turn-1", t0));
    d.report(model_server("b", 2, 1, &[]), t0).unwrap();
    assert_eq!(first.addr.port(), 1);
    first
}

#[test]
fn a_session_goes_back_to_the_endpoint_of_its_last_turn() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    for (id, port) in [("a", 1), ("b", 2), ("c", 3)] {
        d.report(model_server(id, port, 4, &[]), t0).unwrap();
    }
    let mut ports_of = |session: u64| -> Vec<u16> {
        (0..6)
            .map(|_| {
                let l = ready(d.submit(in_session("t", session), "turn", t0));
                let port = l.addr.port();
                d.release(l, t0);
                port
            })
            .collect()
    };
    let one = ports_of(1);
    assert!(one.iter().all(|p| *p == one[0]), "{one:?}");
    // Without a session, equal endpoints take turns.
    let mut anonymous: Vec<u16> = (0..6)
        .map(|_| {
            let l = ready(d.submit(anon(), "x", t0));
            let port = l.addr.port();
            d.release(l, t0);
            port
        })
        .collect();
    anonymous.dedup();
    assert!(anonymous.len() > 1, "{anonymous:?}");
    assert_eq!(d.sessions_bound(), 1);
}

#[test]
fn a_session_waits_for_its_saturated_endpoint_at_most_the_hold_then_moves() {
    let t0 = Instant::now();
    let mut d = with_sessions(SessionConfig::default());
    let first = first_turn_running(&mut d, t0);
    queued(d.submit(in_session("t", 7), "turn-2", t0));
    assert!(d.dispatch(t0).is_empty(), "held for a");
    assert_eq!(d.next_hold_end(), Some(t0 + 200 * MS));
    assert!(d.dispatch(t0 + 199 * MS).is_empty());
    let done = d.dispatch(t0 + 200 * MS);
    assert_eq!(granted(&done), ["turn-2"]);
    let second = done.into_iter().next().unwrap().result.unwrap();
    assert_eq!(second.addr.port(), 2, "the hold is over: the free server");
    d.release(first, t0);
    d.release(second, t0);
    // Re-bound where it went: the third turn follows it to b.
    let third = ready(d.submit(in_session("t", 7), "turn-3", t0 + 300 * MS));
    assert_eq!(third.addr.port(), 2);
}

#[test]
fn a_session_does_not_wait_for_an_engine_whose_answers_say_it_keeps_no_cache() {
    use crate::endpoint::{CacheSeen, COLD_MISSES};
    let t0 = Instant::now();
    let mut d = with_sessions(SessionConfig::default());
    let mut turn = first_turn_running(&mut d, t0);
    // Turns whose prompt the prefix index follows; its engine answers
    // each one: nothing of the prompt reused, though the index expected it.
    let with_blocks = || {
        let mut t = in_session("t", 7);
        t.route.prefix = vec![1, 2, 3, 4];
        t
    };
    let nothing = CacheSeen {
        prompt_tokens: 8_000,
        cached_tokens: 0,
        prompt_bytes: 32_000,
    };
    for n in 0..COLD_MISSES + 2 {
        d.observe_cache(&turn, nothing);
        d.release(turn, t0);
        turn = ready(d.submit(with_blocks(), "turn", t0));
        assert_eq!(turn.addr.port(), 1, "turn {n} goes back while a is free");
    }
    // a runs the latest turn; the next one has nothing cached to wait
    // for there (the same turn waits while a's engine reuses: see above):
    // it takes the free server at once.
    let next = match d.submit(with_blocks(), "next", t0) {
        Admission::Ready(lease) => lease,
        _ => {
            let done = d.dispatch(t0);
            assert_eq!(granted(&done), ["next"], "not held for a");
            done.into_iter().next().unwrap().result.unwrap()
        }
    };
    assert_eq!(next.addr.port(), 2);
    d.release(turn, t0);
    d.release(next, t0);
}

#[test]
fn a_session_goes_back_as_soon_as_its_endpoint_frees() {
    let t0 = Instant::now();
    let mut d = with_sessions(SessionConfig::default());
    let first = first_turn_running(&mut d, t0);
    queued(d.submit(in_session("t", 7), "turn-2", t0));
    queued(d.submit(anon(), "other", t0));
    assert_eq!(granted(&d.dispatch(t0)), ["other"], "others pass it");
    d.release(first, t0);
    let done = d.dispatch(t0 + 50 * MS);
    assert_eq!(granted(&done), ["turn-2"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr.port(), 1);
}

#[test]
fn a_hard_session_waits_for_its_endpoint_until_its_ttl() {
    let t0 = Instant::now();
    let mut d = with_sessions(SessionConfig {
        hard: true,
        ..SessionConfig::default()
    });
    let first = first_turn_running(&mut d, t0);
    let mut late = in_session("t", 7);
    late.ttl = Some(Duration::from_secs(5));
    queued(d.submit(late, "turn-2", t0));
    queued(d.submit(in_session("t", 7), "turn-2b", t0));
    for ms in [0, 200, 1_000, 2_000, 3_000, 4_000, 4_999] {
        // The agents report every second.
        d.report(model_server("a", 1, 1, &[]), t0 + ms * MS)
            .unwrap();
        d.report(model_server("b", 2, 1, &[]), t0 + ms * MS)
            .unwrap();
        let done = d.dispatch(t0 + ms * MS);
        assert!(done.is_empty(), "still waiting for a at {ms} ms");
    }
    let done = d.dispatch(t0 + 5_000 * MS);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].result.as_ref().unwrap_err(), &Reject::Timeout);
    d.release(first, t0);
    let done = d.dispatch(t0 + 5_001 * MS);
    assert_eq!(granted(&done), ["turn-2b"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr.port(), 1);
}

#[test]
fn a_conversation_found_by_its_prompt_is_followed_softly_even_in_hard_mode() {
    let t0 = Instant::now();
    let mut d = with_sessions(SessionConfig {
        hard: true,
        ..SessionConfig::default()
    });
    let _first = first_turn_running(&mut d, t0);
    let mut found = in_session("t", 7);
    found.route.session_by_prompt = true;
    found.ttl = Some(Duration::from_secs(30));
    queued(d.submit(found, "turn-2", t0));
    // The affinity hold (these tests' 200 ms), not the 30 s TTL, bounds
    // its wait.
    assert!(d.dispatch(t0).is_empty(), "held for a");
    assert!(d.dispatch(t0 + 199 * MS).is_empty());
    let done = d.dispatch(t0 + 200 * MS);
    assert_eq!(granted(&done), ["turn-2"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr.port(), 2);
}

#[test]
fn a_conversation_found_by_its_prompt_but_not_bound_here_goes_by_its_prompt() {
    let t0 = Instant::now();
    let mut d = with_sessions(SessionConfig::default());
    for (id, port) in [("a", 1), ("b", 2), ("c", 3)] {
        d.report(model_server(id, port, 4, &[]), t0).unwrap();
    }
    let turn = |session: u64, by_prompt: bool| {
        let mut meta = in_session("t", session);
        meta.route.prefix = vec![1, 2, 3];
        meta.route.session_by_prompt = by_prompt;
        meta
    };
    // A first request leaves the prompt's blocks on one server.
    let mut keyless = turn(0, false);
    keyless.route.session = None;
    let first = ready(d.submit(keyless, "first", t0));
    let cached = first.addr.port();
    d.release(first, t0);
    let mut keyed_homes = Vec::new();
    for session in 10..18 {
        // Its binding did not take (the store named an address this
        // balancer does not know): the prompt's server, not a hash's.
        let found = ready(d.submit(turn(session, true), "found", t0));
        assert_eq!(found.addr.port(), cached, "session {session}");
        d.release(found, t0);
        // A named session not bound here goes to its rendezvous home
        // (another prompt, not to spread this one's blocks).
        let mut named = turn(session + 100, false);
        named.route.prefix = vec![7, 8, 9];
        let named = ready(d.submit(named, "named", t0));
        keyed_homes.push(named.addr.port());
        d.release(named, t0);
    }
    assert!(keyed_homes.iter().any(|p| *p != cached), "{keyed_homes:?}");
}

#[test]
fn a_zero_hold_sends_a_soft_session_elsewhere_at_once() {
    let t0 = Instant::now();
    let mut c = config(30);
    c.scheduling.affinity_hold = Duration::ZERO;
    let mut d = Dispatcher::new(c);
    let _first = first_turn_running(&mut d, t0);
    let second = ready(d.submit(in_session("t", 7), "turn-2", t0));
    assert_eq!(second.addr.port(), 2);
}

#[test]
fn a_gone_endpoint_releases_its_sessions() {
    let t0 = Instant::now();
    let mut d = with_sessions(SessionConfig::default());
    let first = first_turn_running(&mut d, t0);
    d.release(first, t0);
    assert!(d.deregister("a"));
    let second = ready(d.submit(in_session("t", 7), "turn-2", t0));
    assert_eq!(second.addr.port(), 2, "not held for a server that is gone");
    d.release(second, t0);
    // a comes back: the session stays where it was re-bound.
    d.report(model_server("a", 1, 1, &[]), t0).unwrap();
    let third = ready(d.submit(in_session("t", 7), "turn-3", t0));
    assert_eq!(third.addr.port(), 2);
}

#[test]
fn an_idle_session_is_forgotten() {
    let t0 = Instant::now();
    let mut d = with_sessions(SessionConfig {
        idle_timeout: Duration::from_secs(60),
        ..SessionConfig::default()
    });
    let first = first_turn_running(&mut d, t0);
    d.release(first, t0);
    let at = |s: u64| t0 + Duration::from_secs(s);
    // Reports at `now`; a's KV cache is half full from now on, so a
    // scores lower than b: only the session sends turns to a.
    let report = |d: &mut Dispatcher<&'static str>, now: Instant| {
        let mut a = model_server("a", 1, 2, &[]);
        a.kv_cache_usage = Some(0.5);
        d.report(a, now).unwrap();
        d.report(model_server("b", 2, 2, &[]), now).unwrap();
    };
    report(&mut d, at(59));
    let second = ready(d.submit(in_session("t", 7), "turn-2", at(59)));
    assert_eq!(second.addr.port(), 1, "still bound");
    d.release(second, t0);
    report(&mut d, at(119));
    let third = ready(d.submit(in_session("t", 7), "turn-3", at(119)));
    assert_eq!(third.addr.port(), 2, "idle: placed by score");
    d.release(third, t0);
    let fourth = ready(d.submit(in_session("t", 7), "turn-4", at(120)));
    assert_eq!(fourth.addr.port(), 2, "and bound there");
}

#[test]
fn sessions_stay_bounded_whatever_clients_send() {
    let t0 = Instant::now();
    let mut d = with_sessions(SessionConfig {
        max_sessions: 1_000,
        ..SessionConfig::default()
    });
    d.report(model_server("a", 1, 4, &[]), t0).unwrap();
    for session in 0..20_000u64 {
        let l = ready(d.submit(in_session("t", session), "x", t0));
        d.release(l, t0);
    }
    assert_eq!(d.sessions_bound(), 1_000);
}

#[test]
fn a_response_id_binds_the_turn_that_continues_it() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    for (id, port) in [("a", 1), ("b", 2), ("c", 3)] {
        d.report(model_server(id, port, 4, &[]), t0).unwrap();
    }
    let key = crate::session::response_key("t", b"resp_1").unwrap();
    for port in [3, 1, 2] {
        d.bind_session(key, SocketAddr::from(([127, 0, 0, 1], port)), t0);
        let l = ready(d.submit(in_session("t", key), "next", t0));
        assert_eq!(l.addr.port(), port);
        d.release(l, t0);
    }
    // An address no agent reports is not bound.
    d.bind_session(99, SocketAddr::from(([127, 0, 0, 1], 9)), t0);
    assert_eq!(d.sessions_bound(), 1);
}

/// Four 4-slot endpoints, reported to `d`.
fn four_servers(d: &mut Dispatcher<&'static str>, t0: Instant) {
    for (id, port) in [("a", 1), ("b", 2), ("c", 3), ("d", 4)] {
        d.report(model_server(id, port, 4, &[]), t0).unwrap();
    }
}

#[test]
fn two_balancers_send_a_new_session_to_the_same_home() {
    let t0 = Instant::now();
    let (mut one, mut two) = (dispatcher(30), dispatcher(30));
    four_servers(&mut one, t0);
    four_servers(&mut two, t0);
    // Different histories: the second balancer served other work first,
    // so its scores and turns differ.
    for _ in 0..3 {
        let l = ready(two.submit(anon(), "other", t0));
        two.release(l, t0);
    }
    let mut per_port = [0usize; 5];
    for session in 0..200u64 {
        let a = ready(one.submit(in_session("t", session), "turn", t0));
        let b = ready(two.submit(in_session("t", session), "turn", t0));
        assert_eq!(a.addr, b.addr, "session {session}");
        per_port[usize::from(a.addr.port())] += 1;
        one.release(a, t0);
        two.release(b, t0);
    }
    // Homes spread over the fleet.
    assert!(
        per_port[1..].iter().all(|n| (25..=75).contains(n)),
        "{per_port:?}"
    );
}

/// Four 4-slot endpoints whose agents each report to `balancers`
/// balancers.
fn four_servers_of(d: &mut Dispatcher<&'static str>, balancers: u32, now: Instant) {
    for (id, port) in [("a", 1), ("b", 2), ("c", 3), ("d", 4)] {
        let mut r = model_server(id, port, 4, &[]);
        r.balancers = Some(balancers);
        d.report(r, now).unwrap();
    }
}

/// The first turn of a conversation of a group: the group's system
/// prompt, then the conversation's own first message.
fn first_turn(session: u64) -> RequestMeta {
    let mut r = in_session("t", session);
    r.route.prefix = vec![0x5157, 0x5e55 ^ session];
    r
}

#[test]
fn alone_a_new_session_goes_beside_its_cached_prompt_and_with_others_home() {
    let t0 = Instant::now();
    for balancers in [1, 2] {
        let mut d = dispatcher(30);
        four_servers_of(&mut d, balancers, t0);
        // The group's first conversation caches the system prompt, and
        // runs on.
        let running = ready(d.submit(first_turn(0), "first", t0));
        let beside = (1..41u64)
            .filter(|&session| {
                let l = ready(d.submit(first_turn(session), "turn", t0));
                let there = l.addr == running.addr;
                d.release(l, t0);
                there
            })
            .count();
        if balancers == 1 {
            assert_eq!(beside, 40, "alone: every one beside the cached prompt");
        } else {
            // Rendezvous homes, the same on every balancer: a quarter.
            assert!((4..=20).contains(&beside), "{beside} of 40 at home");
        }
        d.release(running, t0);
    }
    // Another balancer named by one agent makes the fleet shared until that
    // agent's report goes stale (three intervals of 1 s).
    let mut d = dispatcher(30);
    four_servers_of(&mut d, 1, t0);
    assert!(d.ledger.alone(t0));
    let mut r = model_server("a", 1, 4, &[]);
    r.balancers = Some(2);
    d.report(r, t0).unwrap();
    assert!(!d.ledger.alone(t0 + Duration::from_millis(2_900)));
    assert!(d.ledger.alone(t0 + Duration::from_secs(3)));
    // An agent that does not say counts as one with others.
    d.report(model_server("b", 2, 4, &[]), t0).unwrap();
    assert!(!d.ledger.alone(t0 + Duration::from_secs(1)));
}

/// On a balancer alone in the fleet, a new conversation whose group's
/// prompt a busy endpoint holds waits for it when that is predicted
/// quicker, even while its rendezvous home is free: the dispatch pass that
/// serves requests at home first does not take it for one.
#[test]
fn alone_a_first_turn_held_for_its_cached_prompt_is_not_at_its_home() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    for (id, port) in [("a", 1), ("b", 2), ("c", 3)] {
        let mut r = model_server(id, port, 1, &[]);
        r.balancers = Some(1);
        d.report(r, t0).unwrap();
    }
    // The group's first conversation caches the system prompt, and runs.
    let running = ready(d.submit(first_turn(0), "first", t0));
    // A conversation of the same group whose rendezvous home is free.
    let session = (1..100u64)
        .find(|&s| {
            let home = (1..=3u16)
                .map(|port| std::net::SocketAddr::from(([127, 0, 0, 1], port)))
                .max_by_key(|&addr| crate::session::rendezvous(s, addr));
            home != Some(running.addr)
        })
        .expect("some session's home is another endpoint");
    assert!(matches!(
        d.submit(first_turn(session), "second", t0),
        Admission::Queued { .. }
    ));
    assert!(d.dispatch(t0).is_empty(), "held for the cached prompt");
    // A request of no session comes; the pass that serves requests at home
    // first runs (some request is held).
    assert!(matches!(
        d.submit(anon(), "other", t0 + 10 * MS),
        Admission::Queued { .. }
    ));
    let done = d.dispatch(t0 + 10 * MS);
    let waiters: Vec<&str> = done.iter().map(|d| d.waiter).collect();
    assert_eq!(waiters, ["other"], "the held first turn still waits");
    let other = done.into_iter().next().unwrap().result.unwrap();
    d.release(running, t0);
    let done = d.dispatch(t0 + 20 * MS);
    assert_eq!(done.len(), 1);
    let lease = done.into_iter().next().unwrap().result.unwrap();
    assert_eq!(lease.addr.port(), 1, "served beside its group's prompt");
    d.release(lease, t0);
    d.release(other, t0);
}

#[test]
fn a_saturated_home_is_not_waited_for_and_one_leaving_moves_only_its_sessions() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    four_servers(&mut d, t0);
    let home_of = |d: &mut Dispatcher<&'static str>, session: u64| {
        let l = ready(d.submit(in_session("t", session), "turn", t0));
        let port = l.addr.port();
        d.release(l, t0);
        port
    };
    let homes: Vec<u16> = (0..40).map(|s| home_of(&mut d, 1_000 + s)).collect();
    // Fill one home: a new session whose home it is goes elsewhere at once.
    let mut full = dispatcher(30);
    four_servers(&mut full, t0);
    let busy_port = homes[0];
    let taken: Vec<Lease> = (0..4)
        .map(|_| {
            let mut r = anon();
            r.route.subset = Some(Arc::from(vec![SocketAddr::from((
                [127, 0, 0, 1],
                busy_port,
            ))]));
            ready(full.submit(r, "filler", t0))
        })
        .collect();
    let went = ready(full.submit(in_session("t", 1_000), "turn", t0));
    assert_ne!(
        went.addr.port(),
        busy_port,
        "not held for a home with no cache yet"
    );
    drop(taken);
    // An endpoint leaves: only the sessions whose home it was move.
    let gone = homes[1];
    let id = ["a", "b", "c", "d"][usize::from(gone) - 1];
    let mut fresh = dispatcher(30);
    four_servers(&mut fresh, t0);
    assert!(fresh.deregister(id));
    for (s, before) in (0..40).zip(&homes) {
        let now_home = home_of(&mut fresh, 1_000 + s);
        if *before != gone {
            assert_eq!(now_home, *before, "session {s} moved");
        }
    }
}

/// Releases `lease` and serves one waiting request after another on its
/// slot until none takes it: their names, in order.
fn serve_on_one_slot(
    d: &mut Dispatcher<&'static str>,
    mut lease: Lease,
    now: Instant,
) -> Vec<&'static str> {
    let port = lease.addr.port();
    let mut served = Vec::new();
    loop {
        d.release(lease, now);
        let mut done = d.dispatch(now);
        let Some(next) = done.pop() else {
            return served;
        };
        assert!(done.is_empty(), "one slot, one request");
        lease = next.result.expect("granted");
        assert_eq!(lease.addr.port(), port, "{} went elsewhere", next.waiter);
        served.push(next.waiter);
    }
}

#[test]
fn a_first_turn_that_must_queue_waits_as_any_request_and_is_pinned_once_served() {
    let t0 = Instant::now();
    let mut d = with_sessions(SessionConfig::default());
    d.report(model_server("a", 1, 1, &[]), t0).unwrap();
    d.report(model_server("b", 2, 1, &[]), t0).unwrap();
    let first = ready(d.submit(anon(), "busy", t0));
    let second = ready(d.submit(anon(), "busy", t0));
    let (on_a, on_b) = if first.addr.port() == 1 {
        (first, second)
    } else {
        (second, first)
    };
    // Two tenants' first turns: none is pinned anywhere before it was
    // served, so none waits for b, which stays busy.
    let turns = ["t1-s1", "t1-s2", "t1-s3", "t2-s4", "t2-s5", "t2-s6"];
    for (session, name) in (1..).zip(turns) {
        queued(d.submit(in_session(&name[..2], session), name, t0));
    }
    let at_a = serve_on_one_slot(&mut d, on_a, t0 + 10 * MS);
    assert_eq!(at_a.len(), 6, "{at_a:?}");
    // Each tenant's turns in arrival order.
    for tenant in ["t1", "t2"] {
        let own: Vec<_> = at_a.iter().filter(|n| n.starts_with(tenant)).collect();
        assert!(own.windows(2).all(|w| w[0] < w[1]), "{own:?}");
    }
    assert_eq!(d.buffered(), 0);
    // Served on a, each is pinned there: with both free, a next turn goes
    // back to a, and the one after it waits for a (its 8,000 tokens are
    // cached there) rather than take b's free slot.
    d.release(on_b, t0 + 20 * MS);
    let next = ready(d.submit(in_session("t1", 1), "t1-s1-again", t0 + 20 * MS));
    assert_eq!(next.addr.port(), 1);
    queued(d.submit(in_session("t2", 4), "t2-s4-again", t0 + 20 * MS));
    d.release(next, t0 + 30 * MS);
    let done = d.dispatch(t0 + 30 * MS);
    assert_eq!(granted(&done), ["t2-s4-again"]);
    assert_eq!(done[0].result.as_ref().unwrap().addr.port(), 1);
}

#[test]
fn a_request_of_no_session_is_not_passed_by_a_servers_conversations() {
    let t0 = Instant::now();
    let mut d = with_sessions(SessionConfig::default());
    d.report(model_server("a", 1, 1, &[]), t0).unwrap();
    let busy = ready(d.submit(anon(), "busy", t0));
    queued(d.submit(in_session("t", 1), "turn-1", t0));
    queued(d.submit(req("t", 0), "no-session", t0));
    queued(d.submit(in_session("t", 2), "turn-2", t0));
    queued(d.submit(in_session("t", 3), "turn-3", t0));
    // Arrival order: the conversations' turns go first only over requests
    // that came after them.
    assert_eq!(
        serve_on_one_slot(&mut d, busy, t0),
        ["turn-1", "no-session", "turn-2", "turn-3"]
    );
}

/// A turn of `session` for `tenant` whose prompt is `tokens` long.
fn turn_of(tenant: &str, session: u64, tokens: u64) -> RequestMeta {
    let mut r = in_session(tenant, session);
    r.route.tokens.prompt = tokens;
    r
}

#[test]
fn an_endpoint_serves_its_conversations_turns_in_the_order_they_came_within_fairness() {
    let t0 = Instant::now();
    let mut d = dispatcher(30);
    // Conversations 1 (tenant x) and 2 (y) live on a, 3 (z) and 4 (y) on
    // c; their first turns still run. Every later turn is long: none would
    // prefill it cold elsewhere.
    d.report(model_server("a", 1, 2, &[]), t0).unwrap();
    let x1 = ready(d.submit(turn_of("x", 1, 8_000), "x-1", t0));
    let y1 = ready(d.submit(turn_of("y", 2, 8_000), "y-1", t0));
    d.report(model_server("c", 3, 2, &[]), t0).unwrap();
    let z1 = ready(d.submit(turn_of("z", 3, 8_000), "z-1", t0));
    let w1 = ready(d.submit(turn_of("y", 4, 8_000), "w-1", t0));
    let ports = [&x1, &y1, &z1, &w1].map(|l| l.addr.port());
    assert_eq!(ports, [1, 1, 3, 3]);
    // c's next turns wait for it beside a free b, which x's request
    // without a session takes: the queues' token fairness now has x ahead.
    queued(d.submit(turn_of("z", 3, 8_000), "z-2", t0 + MS));
    queued(d.submit(turn_of("y", 4, 8_000), "w-2", t0 + MS));
    queued(d.submit(req("x", 0), "x-a", t0 + MS));
    d.report(model_server("b", 2, 1, &[]), t0 + MS).unwrap();
    assert_eq!(granted(&d.dispatch(t0 + MS)), ["x-a"]);
    // x's next turn on a comes before y's.
    queued(d.submit(turn_of("x", 1, 8_000), "x-2", t0 + 2 * MS));
    queued(d.submit(turn_of("y", 2, 8_000), "y-2", t0 + 3 * MS));
    // a frees a slot: the turn that came first takes it, though y is the
    // tenant behind (one turn ahead is within fairness); then y's.
    d.release(y1, t0 + 4 * MS);
    let mut done = d.dispatch(t0 + 4 * MS);
    assert_eq!(granted(&done), ["x-2"]);
    d.release(done.pop().unwrap().result.unwrap(), t0 + 5 * MS);
    assert_eq!(granted(&d.dispatch(t0 + 5 * MS)), ["y-2"]);
}

/// What the engines with events hold of a prompt of 8 blocks: all of it
/// on the endpoint at `port`, none on the others of `ports`.
fn held_at(port: u16, ports: &[u16]) -> Arc<crate::kv_events::EngineHeld> {
    use crate::kv_events::{EngineHeld, Matched};
    let at = |p: u16| std::net::SocketAddr::from(([127, 0, 0, 1], p));
    Arc::new(EngineHeld {
        blocks: 8,
        by_endpoint: (ports.iter())
            .map(|&p| {
                let gpu = if p == port { 8 } else { 0 };
                (at(p), Matched { gpu, cpu: 0 })
            })
            .collect(),
        keys: (1..=8).collect(),
    })
}

/// Two balancers behind a front take turns at a conversation, neither
/// sharing its bindings: a later turn this balancer placed none of the
/// turns before of goes where the engines say its conversation is cached,
/// not to its rendezvous home, and waits for that endpoint while it is
/// busy. A first turn goes home while an endpoint publishes no events
/// (its later turns could not be found there), and by the stages, beside
/// the cache, once all do.
#[test]
fn with_others_a_later_turn_follows_the_engine_holding_its_conversation() {
    let t0 = Instant::now();
    let ports = [1, 2, 3, 4];
    let mut d = dispatcher(30);
    four_servers_of(&mut d, 2, t0);
    let session = 11;
    let home = (ports.iter())
        .map(|&p| std::net::SocketAddr::from(([127, 0, 0, 1], p)))
        .max_by_key(|&addr| crate::session::rendezvous(session, addr))
        .unwrap()
        .port();
    let cached = ports.into_iter().find(|&p| p != home).unwrap();
    let plain = ports
        .into_iter()
        .find(|&p| p != home && p != cached)
        .unwrap();
    let with_events: Vec<u16> = ports.into_iter().filter(|&p| p != plain).collect();
    let mut turn = in_session("t", session);
    turn.route.prefix = vec![1, 2, 3, 4];
    turn.route.engine_held = Some(held_at(cached, &with_events));
    let place = |d: &mut Dispatcher<&'static str>, turn: &RequestMeta| {
        let lease = ready(d.submit(turn.clone(), "turn", t0));
        let port = lease.addr.port();
        d.release(lease, t0);
        d.ledger.release_session(session);
        port
    };
    assert_eq!(
        place(&mut d, &turn),
        home,
        "a first turn, one endpoint without events"
    );
    turn.route.continues = true;
    assert_eq!(place(&mut d, &turn), cached, "a later turn");
    turn.route.continues = false;
    turn.route.engine_held = Some(held_at(cached, &ports));
    assert_eq!(
        place(&mut d, &turn),
        cached,
        "a first turn, all with events"
    );
    // Busy there: a later turn waits for it, though three endpoints are
    // free.
    turn.route.continues = true;
    let there = std::net::SocketAddr::from(([127, 0, 0, 1], cached));
    let fill: Vec<Lease> = (0..4)
        .map(|_| {
            let mut other = anon();
            other.route.subset = Some(Arc::from([there]));
            ready(d.submit(other, "other", t0))
        })
        .collect();
    assert!(matches!(
        d.submit(turn, "later", t0),
        Admission::Queued { .. }
    ));
    assert!(d.dispatch(t0 + MS).is_empty(), "held for its cache");
    let mut fill = fill.into_iter();
    d.release(fill.next().unwrap(), t0 + 2 * MS);
    let done = d.dispatch(t0 + 2 * MS);
    assert_eq!(granted(&done), ["later"]);
    let lease = done.into_iter().next().unwrap().result.unwrap();
    assert_eq!(lease.addr.port(), cached);
}
