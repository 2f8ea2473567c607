//! Stage 2½, latency objectives, on a ledger: the choice among endpoints
//! by their predicted tails, and the refusal of sheddable work.

use std::time::{Duration, Instant};

use super::acquire;
use crate::endpoint::ledger_fixtures::{report_for, route};
use crate::endpoint::{EndpointLedger, Route, Timing};
use crate::objective::Objective;
use crate::placement::{pick, Pick};

/// Teaches the endpoint on `port` answers of 1,000 prefilled tokens at
/// `prefill_ms`, 100 output tokens `tpot_ms` apart, and first tokens
/// `extra_ms` later than their prefill.
fn teach(r: &mut EndpointLedger, port: u16, prefill_ms: u64, tpot_ms: u64, extra_ms: u64) {
    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    for _ in 0..16 {
        r.learn_cost(
            addr,
            &Timing {
                prefilled_tokens: 1_000,
                prefill: Some(Duration::from_millis(prefill_ms)),
                output_tokens: 100,
                decode: Some(Duration::from_millis(100 * tpot_ms)),
                service: Some(Duration::from_millis(prefill_ms + 100 * tpot_ms)),
                first_token: Some(Duration::from_millis(prefill_ms + extra_ms)),
            },
        );
    }
}

/// A ledger of servers on `ports` of `slots` each.
fn servers(ports: &[u16], slots: u32, now: Instant) -> EndpointLedger {
    let mut r = EndpointLedger::default();
    for &port in ports {
        let (rep, a) = report_for(&format!("e{port}"), port, slots, &[]);
        r.apply_report(rep, a, now);
    }
    r
}

fn with(objective: Objective, now: Instant) -> Route {
    Route {
        objective,
        due: objective.deadline(now),
        ..route(None, &[1, 2, 3, 4])
    }
}

fn tpot(ms: u32) -> Objective {
    Objective {
        ttft_ms: None,
        tpot_ms: Some(ms),
    }
}

#[test]
fn a_tight_objective_goes_where_the_tails_meet_it_and_none_changes_nothing() {
    let now = Instant::now();
    let mut r = servers(&[1, 2], 4, now);
    // The prompt's first request goes to `home`, which caches it...
    let first = acquire(&mut r, &route(None, &[1, 2, 3, 4]), now).unwrap();
    let home = first.addr.port();
    r.release(first, now);
    // ... and is the slow one: 40 ms an output token against 10.
    let other = 3 - home;
    teach(&mut r, home, 200, 40, 40);
    teach(&mut r, other, 100, 10, 20);
    let plain = acquire(&mut r, &route(None, &[1, 2, 3, 4]), now).unwrap();
    assert_eq!(plain.addr.port(), home, "no objective: its cache wins");
    assert_eq!(plain.ttft_p90_ms, None, "nothing predicted without one");
    r.release(plain, now);
    let tight = acquire(&mut r, &with(tpot(20), now), now).unwrap();
    assert_eq!(tight.addr.port(), other, "40 ms misses 20 ms; 10 meets it");
    assert!(tight.ttft_p90_ms.is_some(), "its prediction is kept");
    r.release(tight, now);
    // Both meet a loose one: the usual choice stands.
    let loose = acquire(&mut r, &with(tpot(100), now), now).unwrap();
    assert_eq!(loose.addr.port(), home);
    r.release(loose, now);
}

#[test]
fn when_none_meets_it_an_idle_endpoint_then_the_least_miss() {
    let now = Instant::now();
    let mut r = servers(&[1, 2], 4, now);
    teach(&mut r, 1, 100, 30, 20);
    teach(&mut r, 2, 200, 60, 40);
    // Port 1 is busier (two running), port 2 idle: neither meets 10 ms.
    let a = acquire(&mut r, &route(None, &[7]), now).unwrap();
    let b = acquire(&mut r, &route(None, &[8]), now).unwrap();
    assert_eq!((a.addr.port(), b.addr.port()), (1, 2));
    r.release(b, now);
    let c = acquire(&mut r, &route(None, &[9]), now).unwrap();
    assert_eq!(c.addr.port(), 2);
    r.release(c, now);
    let on_idle = acquire(&mut r, &with(tpot(10), now), now).unwrap();
    assert_eq!(on_idle.addr.port(), 2, "the idle one, though slower");
    // Neither idle now: the one missing by least (port 1, 30 ms).
    let least = acquire(&mut r, &with(tpot(10), now), now).unwrap();
    assert_eq!(least.addr.port(), 1);
    for l in [a, on_idle, least] {
        r.release(l, now);
    }
}

#[test]
fn sheddable_work_none_can_serve_in_time_is_refused_the_rest_is_served() {
    let now = Instant::now();
    let mut r = servers(&[1], 4, now);
    teach(&mut r, 1, 100, 30, 20);
    let sheddable = Route {
        sheddable: true,
        ..with(tpot(10), now)
    };
    assert!(matches!(pick(&mut r, &sheddable, now, None), Pick::Shed));
    // Not sheddable: served late rather than refused.
    assert!(matches!(
        pick(&mut r, &with(tpot(10), now), now, None),
        Pick::Lease(_)
    ));
    // Sheddable but within reach: served.
    let reachable = Route {
        sheddable: true,
        ..with(tpot(100), now)
    };
    assert!(matches!(
        pick(&mut r, &reachable, now, None),
        Pick::Lease(_)
    ));
    // A TTFT deadline already past is out of reach.
    let late = Route {
        sheddable: true,
        objective: Objective {
            ttft_ms: Some(50),
            tpot_ms: None,
        },
        due: Some(now),
        ..route(None, &[5])
    };
    assert!(matches!(
        pick(&mut r, &late, now + Duration::from_millis(1), None),
        Pick::Shed
    ));
}

#[test]
fn a_queued_request_no_free_server_serves_in_time_waits_for_a_busy_one_that_will() {
    let now = Instant::now();
    let mut r = servers(&[1, 2], 1, now);
    // Port 1 is busy; port 2 is free but 40 ms a token misses 20 ms.
    let first = acquire(&mut r, &route(None, &[7]), now).unwrap();
    let (busy, free) = (first.addr.port(), 3 - first.addr.port());
    teach(&mut r, busy, 100, 10, 20);
    teach(&mut r, free, 200, 40, 40);
    let tight = with(tpot(20), now);
    let waits = crate::placement::Waits::default();
    let pass = crate::placement::Pass {
        waits: &waits,
        may_spill: false,
    };
    let outcome = crate::placement::place(&r, &tight, Some(pass), now).outcome;
    let busy_id = r.endpoint_at(first.addr).unwrap().id;
    assert_eq!(outcome, crate::placement::Outcome::Wait(busy_id));
    // A request that may not wait goes where it misses by least.
    let lease = acquire(&mut r, &tight, now).unwrap();
    assert_eq!(lease.addr.port(), free);
    r.release(lease, now);
    r.release(first, now);
}

#[test]
fn a_queued_request_waits_for_a_busy_server_while_a_slot_there_would_still_serve_it_in_time() {
    use crate::placement::{place, Outcome, Pass, Waits};
    let t0 = Instant::now();
    let mut r = fast_and_slow(1, t0);
    let _fast = fill(&mut r, 1, 1, t0);
    let id = |port: u16| {
        let addr = format!("127.0.0.1:{port}").parse().unwrap();
        r.endpoint_at(addr).unwrap().id
    };
    let (fast, slow) = (id(1), id(2));
    let waits = Waits::default();
    let pass = Some(Pass {
        waits: &waits,
        may_spill: false,
    });
    // 4,000 tokens due in 500 ms: the free slow server misses (800 ms of
    // prefill); the fast one's slot is predicted to free in a service time
    // (1.1 s, too late), but were it to free now, 420 ms would meet it.
    let long = prompt_of(4_000, Some(500), t0);
    assert_eq!(place(&r, &long, pass, t0).outcome, Outcome::Wait(fast));
    // Sheddable, it is refused: its wait there is predicted to miss.
    let sheddable = Route {
        sheddable: true,
        ..long.clone()
    };
    assert_eq!(place(&r, &sheddable, pass, t0).outcome, Outcome::Shed);
    // 100 ms later even a free fast slot would miss (420 ms of the 400
    // left): it goes where it misses by least, the free server.
    let later = t0 + Duration::from_millis(100);
    assert_eq!(place(&r, &long, pass, later).outcome, Outcome::Go(slow));
}

/// A route of `tokens` prompt tokens with a TTFT objective of `ttft_ms`
/// (`None`: without an objective).
fn prompt_of(tokens: u64, ttft_ms: Option<u32>, now: Instant) -> Route {
    let objective = Objective {
        ttft_ms,
        tpot_ms: None,
    };
    Route {
        tokens: crate::tokens::TokenEstimate {
            prompt: tokens,
            ..Default::default()
        },
        ..with(objective, now)
    }
}

/// Port 1, fast: a 4,000-token prompt prefilled in 400 ms (+20); port 2,
/// slow: in 800 ms. `slots` each.
fn fast_and_slow(slots: u32, now: Instant) -> EndpointLedger {
    let mut r = servers(&[1, 2], slots, now);
    teach(&mut r, 1, 100, 10, 20);
    teach(&mut r, 2, 200, 20, 20);
    r
}

/// Takes `n` slots on the endpoint at `port`.
fn fill(r: &mut EndpointLedger, port: u16, n: usize, now: Instant) -> Vec<crate::endpoint::Lease> {
    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    let id = r.endpoint_at(addr).unwrap().id;
    (0..n).map(|_| r.book(&route(None, &[]), id, now)).collect()
}

#[test]
fn work_without_an_objective_leaves_the_last_slot_that_meets_one_and_waits_rather_than_take_it() {
    let t0 = Instant::now();
    let mut r = fast_and_slow(2, t0);
    let _fast = fill(&mut r, 1, 1, t0);
    let plain = || prompt_of(100, None, t0);
    // No request with an objective yet: the fast endpoint's last slot is
    // anyone's (it scores better: fewer taken).
    let explained = crate::placement::explain(&r, &plain(), t0);
    assert_eq!(explained.objective_choice, None);
    // A request of 4,000 tokens due in 500 ms came: only port 1 meets it.
    r.note_objective(&prompt_of(4_000, Some(500), t0), t0);
    let _slow = fill(&mut r, 2, 1, t0);
    // Port 1 has a slot, port 2 one: the plain request leaves port 1's.
    let elsewhere = acquire(&mut r, &plain(), t0).unwrap();
    assert_eq!(elsewhere.addr.port(), 2);
    // Only port 1's slot is left: it waits rather than take it...
    assert!(matches!(pick(&mut r, &plain(), t0, None), Pick::Busy));
    let explained = crate::placement::explain(&r, &plain(), t0);
    assert_eq!(
        (explained.choice, explained.objective_choice),
        (None, Some("reserve"))
    );
    // ... which a request with an objective takes.
    let interactive = acquire(&mut r, &prompt_of(4_000, Some(500), t0), t0).unwrap();
    assert_eq!(interactive.addr.port(), 1);
    r.release(interactive, t0);
    // Ten seconds with no request with an objective: no slot is kept.
    let later = t0 + crate::objective::REFERENCE_WINDOW + Duration::from_millis(1);
    for port in [1, 2] {
        let (rep, a) = report_for(&format!("e{port}"), port, 2, &[]);
        r.apply_report(rep, a, later);
    }
    let taken = acquire(&mut r, &prompt_of(100, None, later), later).unwrap();
    assert_eq!(taken.addr.port(), 1);
}

#[test]
fn the_kept_slot_stays_while_a_hard_request_came_lately_though_the_hardest_is_over() {
    let t0 = Instant::now();
    let mut r = fast_and_slow(2, t0);
    let at = |ms| t0 + Duration::from_millis(ms);
    // The hardest (4,000 tokens due in 500 ms) at 0 s, one nearly as hard
    // (3,000: only the fast endpoint meets it) at 5.5 s, then a short one
    // (every endpoint meets it) at 10.5 s, the hardest's ten seconds over.
    r.note_objective(&prompt_of(4_000, Some(500), t0), t0);
    r.note_objective(&prompt_of(3_000, Some(500), at(5_500)), at(5_500));
    let now = at(10_500);
    for port in [1, 2] {
        let (rep, a) = report_for(&format!("e{port}"), port, 2, &[]);
        r.apply_report(rep, a, now);
    }
    r.note_objective(&prompt_of(100, Some(500), now), now);
    let _taken = [fill(&mut r, 1, 1, now), fill(&mut r, 2, 2, now)];
    // The 3,000 tokens of 5.5 s are the reference, not the 100 of now: the
    // fast endpoint's last slot is kept.
    assert!(matches!(
        pick(&mut r, &prompt_of(100, None, now), now, None),
        Pick::Busy
    ));
}

#[test]
fn an_operator_who_keeps_no_slots_lets_work_without_an_objective_take_the_last_fast_one() {
    let t0 = Instant::now();
    let mut r = fast_and_slow(2, t0);
    let saturation = *r.saturation();
    let scheduling = crate::SchedulingConfig {
        kept_slots: 0,
        ..crate::SchedulingConfig::default()
    };
    r.reconfigure(saturation, scheduling);
    let _taken = [fill(&mut r, 1, 1, t0), fill(&mut r, 2, 2, t0)];
    r.note_objective(&prompt_of(4_000, Some(500), t0), t0);
    let plain = acquire(&mut r, &prompt_of(100, None, t0), t0).unwrap();
    assert_eq!(plain.addr.port(), 1, "scheduling.keptSlots 0: anyone's");
}

#[test]
fn a_fleet_of_fewer_than_four_slots_keeps_none() {
    let t0 = Instant::now();
    let mut r = fast_and_slow(1, t0);
    let _slow = fill(&mut r, 2, 1, t0);
    r.note_objective(&prompt_of(4_000, Some(500), t0), t0);
    let plain = acquire(&mut r, &prompt_of(100, None, t0), t0).unwrap();
    assert_eq!(
        plain.addr.port(),
        1,
        "two slots in all: the last is anyone's"
    );
}

/// Ports 1 and 2 fast, 3 and 4 slow, 2 slots each (eight: two fast ones
/// kept, one slow one), with a request of 4,000 tokens due in 500 ms
/// lately.
fn two_fast_two_slow(t0: Instant) -> EndpointLedger {
    let mut r = servers(&[1, 2, 3, 4], 2, t0);
    for port in [1, 2] {
        teach(&mut r, port, 100, 10, 20);
    }
    for port in [3, 4] {
        teach(&mut r, port, 200, 20, 20);
    }
    r.note_objective(&prompt_of(4_000, Some(500), t0), t0);
    r
}

#[test]
fn while_fast_slots_are_scarce_work_without_an_objective_waits_and_short_interactive_work_takes_a_slow_slot(
) {
    let t0 = Instant::now();
    let mut r = two_fast_two_slow(t0);
    let _fast = [fill(&mut r, 1, 1, t0), fill(&mut r, 2, 1, t0)];
    // Two fast slots free: taking a slow one leaves both.
    let plain = acquire(&mut r, &prompt_of(100, None, t0), t0).unwrap();
    assert!(plain.addr.port() >= 3, "{plain:?}");
    let _more = fill(&mut r, 1, 1, t0);
    // One fast slot free, slow ones too: the slow slots serve the short
    // interactive prompts meanwhile, so work without an objective waits.
    assert!(matches!(
        pick(&mut r, &prompt_of(100, None, t0), t0, None),
        Pick::Busy
    ));
    // A short interactive prompt, which a slow endpoint serves in time,
    // leaves it too; a long one, which only a fast one does, takes it.
    let short = acquire(&mut r, &prompt_of(100, Some(500), t0), t0).unwrap();
    assert!(short.addr.port() >= 3, "{short:?}");
    let long = acquire(&mut r, &prompt_of(4_000, Some(500), t0), t0).unwrap();
    assert_eq!(long.addr.port(), 2);
}

#[test]
fn work_without_an_objective_leaves_a_slow_slot_to_the_short_interactive_prompts() {
    let t0 = Instant::now();
    let mut r = two_fast_two_slow(t0);
    // Both fast slots of port 2 free (the two kept), one slow slot.
    let _taken = [fill(&mut r, 1, 2, t0), fill(&mut r, 4, 1, t0)];
    let on_3 = fill(&mut r, 3, 2, t0);
    let plain = || prompt_of(100, None, t0);
    assert!(matches!(pick(&mut r, &plain(), t0, None), Pick::Busy));
    // Port 2's free slots score best, but they are the kept ones: a short
    // interactive prompt takes the slow slot, and says so.
    let short = || prompt_of(100, Some(500), t0);
    let explained = crate::placement::explain(&r, &short(), t0);
    assert_eq!(
        (
            explained.choice.map(|a| a.port()),
            explained.objective_choice
        ),
        (Some(4), Some("reserve"))
    );
    // Due in 55 ms, which only a fast endpoint meets (its prompt blocks
    // prefilled in 26 ms + 20 against 51 + 20): it takes a kept slot.
    let tight = crate::placement::explain(&r, &prompt_of(100, Some(55), t0), t0);
    assert_eq!(
        (tight.choice.map(|a| a.port()), tight.objective_choice),
        (Some(2), Some("meets"))
    );
    assert_eq!(acquire(&mut r, &short(), t0).unwrap().addr.port(), 4);
    // Two slow slots free: work without an objective takes one of them.
    for lease in on_3 {
        r.release(lease, t0);
    }
    assert_eq!(acquire(&mut r, &plain(), t0).unwrap().addr.port(), 3);
}

#[test]
fn no_slot_is_kept_for_an_objective_no_endpoint_could_meet_or_every_one_meets() {
    // 4,000 tokens in 100 ms: even idle, neither prefills it in time. An
    // async job's deadline an hour away: any free slot serves it.
    for ttft_ms in [100, 3_600_000] {
        let t0 = Instant::now();
        let mut r = fast_and_slow(2, t0);
        let _taken = [fill(&mut r, 1, 1, t0), fill(&mut r, 2, 2, t0)];
        r.note_objective(&prompt_of(4_000, Some(ttft_ms), t0), t0);
        let plain = acquire(&mut r, &prompt_of(100, None, t0), t0).unwrap();
        assert_eq!(plain.addr.port(), 1, "objective {ttft_ms} ms");
    }
}
