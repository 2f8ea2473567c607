//! Placement's rules end to end on a ledger: the choice among endpoints,
//! and a property that the ranked choice is as good as looking at every
//! endpoint.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::load::Load;
use super::patience::{cached_tokens, prompt_tokens};
use super::*;
use crate::endpoint::ledger_fixtures::{addr, report_for, route};
use crate::endpoint::{
    Endpoint, EndpointLedger, Lease, Route, SaturationConfig, SchedulingConfig, Timing,
};
use crate::protocol::tests::report;
use crate::protocol::BackendHealth;
use crate::tokens::TokenEstimate;

mod adapters;
mod objectives;

/// [`pick`] without holding: a lease, or none.
fn acquire(r: &mut EndpointLedger, route: &Route, now: Instant) -> Option<Lease> {
    match pick(r, route, now, None) {
        Pick::Lease(lease) => Some(lease),
        Pick::Hold(_) | Pick::Delay(..) | Pick::Busy | Pick::Shed => None,
    }
}

#[test]
fn equal_endpoints_share_the_load() {
    let now = Instant::now();
    let mut r = EndpointLedger::default();
    r.apply_report(report("a", "127.0.0.1:1", 4), addr("127.0.0.1:1"), now);
    r.apply_report(report("b", "127.0.0.1:2", 4), addr("127.0.0.1:2"), now);
    let leases: Vec<_> = (0..4)
        .map(|_| acquire(&mut r, &Route::default(), now).unwrap())
        .collect();
    let on_a = leases.iter().filter(|l| l.addr.port() == 1).count();
    assert_eq!(on_a, 2);
}

#[test]
fn prefix_affinity_wins_until_the_endpoint_saturates() {
    let now = Instant::now();
    let mut r = EndpointLedger::default();
    for (id, port) in [("a", 1), ("b", 2)] {
        let (rep, a) = report_for(id, port, 2, &[]);
        r.apply_report(rep, a, now);
    }
    let conversation = route(None, &[11, 12, 13, 14]);
    let first = acquire(&mut r, &conversation, now).unwrap();
    let home = first.addr;
    // Same prefix: same endpoint, although the other has more free slots.
    let second = acquire(&mut r, &conversation, now).unwrap();
    assert_eq!(second.addr, home);
    // Full: the next one spills to the other endpoint, never waits.
    let third = acquire(&mut r, &conversation, now).unwrap();
    assert_ne!(third.addr, home);
    for l in [first, second, third] {
        r.release(l, now);
    }
}

#[test]
fn what_an_engine_says_it_holds_outweighs_the_guess_and_only_for_it() {
    use crate::kv_events::{EngineHeld, Matched};
    let now = Instant::now();
    let mut r = EndpointLedger::default();
    for (id, port) in [("a", 1), ("b", 2), ("c", 3)] {
        let (rep, a) = report_for(id, port, 4, &[]);
        r.apply_report(rep, a, now);
    }
    // The balancer sent the prompt to a: its guess says a holds it.
    let mut prompt = route(None, &[21, 22, 23, 24]);
    let first = acquire(&mut r, &prompt, now).unwrap();
    let guessed = first.addr;
    r.release(first, now);
    assert_eq!(acquire_and_release(&mut r, &prompt, now), guessed);
    // The engines with events say otherwise: another one holds all of it,
    // the guessed one none (it was evicted, or another client warmed the
    // other): the request goes where the prompt is.
    let holder = [
        addr("127.0.0.1:1"),
        addr("127.0.0.1:2"),
        addr("127.0.0.1:3"),
    ]
    .into_iter()
    .find(|a| *a != guessed)
    .unwrap();
    prompt.engine_held = Some(Arc::new(EngineHeld {
        blocks: 16,
        by_endpoint: vec![
            (guessed, Matched::default()),
            (holder, Matched { gpu: 16, cpu: 0 }),
        ],
        ..EngineHeld::default()
    }));
    assert_eq!(acquire_and_release(&mut r, &prompt, now), holder);
    // An endpoint without events keeps its guess: listed for none but
    // the holder, which holds a quarter, the guessed one's whole prefix
    // wins.
    prompt.engine_held = Some(Arc::new(EngineHeld {
        blocks: 16,
        by_endpoint: vec![(holder, Matched { gpu: 4, cpu: 0 })],
        ..EngineHeld::default()
    }));
    assert_eq!(acquire_and_release(&mut r, &prompt, now), guessed);
}

#[test]
fn a_soft_session_follows_its_prompt_once_its_engine_says_the_cache_is_gone() {
    use crate::kv_events::{EngineHeld, Matched};
    let now = Instant::now();
    let mut r = EndpointLedger::default();
    for (id, port) in [("a", 1), ("b", 2)] {
        let (rep, a) = report_for(id, port, 4, &[]);
        r.apply_report(rep, a, now);
    }
    let (a, b) = (addr("127.0.0.1:1"), addr("127.0.0.1:2"));
    let mut turn = route(None, &[31, 32]);
    turn.session = Some(7);
    r.bind_session(7, a, now);
    assert_eq!(acquire_and_release(&mut r, &turn, now), a, "bound there");
    // a's engine holds none of the prompt (evicted), b's all of it.
    let gone = Arc::new(EngineHeld {
        blocks: 8,
        by_endpoint: vec![(a, Matched::default()), (b, Matched { gpu: 8, cpu: 0 })],
        ..EngineHeld::default()
    });
    turn.engine_held = Some(Arc::clone(&gone));
    assert_eq!(
        acquire_and_release(&mut r, &turn, now),
        b,
        "follows the prompt"
    );
    // Bound where it went; an engine that holds nothing anywhere (a new
    // prompt) leaves the binding alone.
    turn.engine_held = Some(Arc::new(EngineHeld {
        blocks: 8,
        by_endpoint: vec![(a, Matched::default()), (b, Matched::default())],
        ..EngineHeld::default()
    }));
    assert_eq!(acquire_and_release(&mut r, &turn, now), b);
}

#[test]
fn a_queued_requests_holder_is_the_engine_that_says_it_holds_its_prompt() {
    use super::evening::prompt_holder;
    use crate::kv_events::{EngineHeld, Matched};
    let now = Instant::now();
    let mut r = EndpointLedger::default();
    for (id, port) in [("a", 1), ("b", 2)] {
        let (rep, a) = report_for(id, port, 4, &[]);
        r.apply_report(rep, a, now);
    }
    let mut prompt = route(None, &[41, 42]);
    let guessed = acquire_and_release(&mut r, &prompt, now);
    let holder = |r: &EndpointLedger, p: &Route| {
        prompt_holder(r, p, now).and_then(|id| r.endpoint(id).map(|e| e.addr))
    };
    assert_eq!(holder(&r, &prompt), Some(guessed), "the guess");
    let other = [addr("127.0.0.1:1"), addr("127.0.0.1:2")]
        .into_iter()
        .find(|a| *a != guessed)
        .unwrap();
    prompt.engine_held = Some(Arc::new(EngineHeld {
        blocks: 4,
        by_endpoint: vec![
            (guessed, Matched::default()),
            (other, Matched { gpu: 3, cpu: 0 }),
        ],
        ..EngineHeld::default()
    }));
    assert_eq!(holder(&r, &prompt), Some(other), "the engine's word");
    prompt.engine_held = Some(Arc::new(EngineHeld {
        blocks: 4,
        by_endpoint: vec![(guessed, Matched::default()), (other, Matched::default())],
        ..EngineHeld::default()
    }));
    assert_eq!(holder(&r, &prompt), None, "both say they hold none");
}

/// Where `route` goes now; its slot given back at once.
fn acquire_and_release(r: &mut EndpointLedger, route: &Route, now: Instant) -> SocketAddr {
    let lease = acquire(r, route, now).unwrap();
    let at = lease.addr;
    r.release(lease, now);
    at
}

#[test]
fn without_shared_prefixes_load_stays_balanced() {
    let now = Instant::now();
    let mut r = EndpointLedger::default();
    for (id, port) in [("a", 1), ("b", 2), ("c", 3), ("d", 4)] {
        let (rep, a) = report_for(id, port, 8, &[]);
        r.apply_report(rep, a, now);
    }
    let mut per_port = [0u32; 5];
    let mut leases = Vec::new();
    for i in 0..32u64 {
        let l = acquire(&mut r, &route(None, &[i * 1000, i * 1000 + 1]), now).unwrap();
        per_port[l.addr.port() as usize] += 1;
        leases.push(l);
    }
    assert_eq!(&per_port[1..], &[8, 8, 8, 8]);
    // Equal endpoints take turns: single requests on idle equal
    // endpoints do not always land on the same one.
    for l in leases {
        r.release(l, now);
    }
    let mut seen = std::collections::HashSet::new();
    for i in 0..40u64 {
        let l = acquire(&mut r, &route(None, &[i + 1_000_000]), now).unwrap();
        seen.insert(l.addr.port());
        r.release(l, now);
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
}

/// What the choice must be, computed the plain way: every endpoint looked
/// at (as choosing was before the ranking). `Some(score)`: the best score.
#[derive(Debug, PartialEq)]
enum Expected {
    Busy,
    Hold,
    Best(f64),
    /// Equal best scores, of which some would hold and some not.
    HoldOrBest(f64),
}

fn expected(r: &EndpointLedger, route: &Route, now: Instant, may_hold: bool) -> Expected {
    let config = *r.saturation();
    let weights = r.scheduling().scorers;
    let blocks = route.prefix.len();
    let score_prefix = weights.prefix_cache > 0.0 && blocks > 0;
    let matched = |e: &Endpoint| {
        if score_prefix {
            e.prefix_matched(route)
        } else {
            0
        }
    };
    let takes =
        |e: &Endpoint| e.available(now, &config) && e.fits_token_budget(&route.tokens, &config);
    let candidates: Vec<&Endpoint> = r
        .endpoints()
        .filter(|e| e.fits(route) && takes(e))
        .collect();
    if candidates.is_empty() {
        return Expected::Busy;
    }
    let best = candidates
        .iter()
        .map(|e| score_of(r, e, route))
        .fold(f64::NEG_INFINITY, f64::max);
    if !may_hold {
        return Expected::Best(best);
    }
    // The wait-or-go rule, every endpoint looked at: some saturated one
    // holding more of the prompt than the chosen one is predicted sooner.
    let prompt = prompt_tokens(r, route);
    let holds = |go: &Endpoint| {
        let go_ms = go.predicted_prefill_ms(prompt - cached_tokens(r, route, matched(go)));
        r.endpoints().any(|e| {
            e.fits(route)
                && e.eligible(now)
                && !takes(e)
                && matched(e) > matched(go)
                && Load::of(e, &Waits::default()).wait_ms(e.service_ms())
                    + e.predicted_prefill_ms(prompt - cached_tokens(r, route, matched(e)))
                    < go_ms
        })
    };
    let ties: Vec<bool> = candidates
        .iter()
        .filter(|e| (score_of(r, e, route) - best).abs() < 1e-6)
        .map(|e| holds(e))
        .collect();
    if ties.iter().all(|h| *h) {
        Expected::Hold
    } else if ties.iter().any(|h| *h) {
        Expected::HoldOrBest(best)
    } else {
        Expected::Best(best)
    }
}

fn score_of(r: &EndpointLedger, e: &Endpoint, route: &Route) -> f64 {
    let blocks = route.prefix.len();
    let weights = r.scheduling().scorers;
    e.static_score(&weights, r.saturation())
        + if blocks > 0 && weights.prefix_cache > 0.0 {
            weights.prefix_cache * e.prefix_matched(route) as f64 / blocks as f64
        } else {
            0.0
        }
}

#[derive(Debug, Clone)]
enum Op {
    Report {
        agent: u8,
        slots: u32,
        waiting: u32,
        kv: Option<u8>,
        capacity: Option<u64>,
        models: u8,
        ready: bool,
        draining: bool,
    },
    Pick {
        model: u8,
        path: Vec<u8>,
        tokens: u64,
        avoid: Option<u8>,
        may_hold: bool,
    },
    Release(usize),
    Orphan(usize),
    Deregister(u8),
    /// The endpoint's engine answered this fast.
    Learn {
        agent: u8,
        prefill_us_per_token: u64,
        service_ms: u64,
    },
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        (
            0u8..6,
            0u32..4,
            0u32..7,
            proptest::option::of(0u8..=10),
            proptest::option::of(100u64..2_000),
            0u8..4,
            proptest::bool::weighted(0.9),
            proptest::bool::weighted(0.1),
        )
            .prop_map(
                |(agent, slots, waiting, kv, capacity, models, ready, draining)| Op::Report {
                    agent,
                    slots,
                    waiting,
                    kv,
                    capacity,
                    models,
                    ready,
                    draining,
                }
            ),
        (
            0u8..4,
            proptest::collection::vec(0u8..3, 0..7),
            0u64..800,
            proptest::option::of(0u8..6),
            any::<bool>(),
        )
            .prop_map(|(model, path, tokens, avoid, may_hold)| Op::Pick {
                model,
                path,
                tokens,
                avoid,
                may_hold,
            }),
        (0usize..64).prop_map(Op::Release),
        (0usize..64).prop_map(Op::Orphan),
        (0u8..6).prop_map(Op::Deregister),
        (0u8..6, 10u64..2_000, 1u64..3_000).prop_map(
            |(agent, prefill_us_per_token, service_ms)| {
                Op::Learn {
                    agent,
                    prefill_us_per_token,
                    service_ms,
                }
            }
        ),
    ]
}

fn port_addr(agent: u8) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 1 + u16::from(agent)))
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
    /// Whatever reports, picks, releases and departures happen, the ranked
    /// choice is as good as looking at every endpoint: busy, hold or the
    /// best score alike; and the ranking holds exactly the endpoints that
    /// could take work, at their current scores.
    #[test]
    fn the_ranked_choice_is_the_best_of_all(ops in proptest::collection::vec(op(), 1..120)) {
        let now = Instant::now();
        let mut r = EndpointLedger::new(
            SaturationConfig::default(),
            SchedulingConfig {
                prefix: crate::prefix::PrefixConfig {
                    capacity_blocks: 6,
                    ..Default::default()
                },
                ..Default::default()
            },
        );
        let mut leases: Vec<Lease> = Vec::new();
        for op in ops {
            match op {
                Op::Report { agent, slots, waiting, kv, capacity, models, ready, draining } => {
                    let a = port_addr(agent);
                    let mut rep = report(&format!("agent-{agent}"), &a.to_string(), slots);
                    rep.requests_waiting = waiting;
                    rep.kv_cache_usage = kv.map(|k| f64::from(k) / 10.0);
                    rep.kv_capacity_tokens = capacity;
                    rep.models = match models {
                        0 => vec![],
                        1 => vec!["x".into()],
                        2 => vec!["y".into()],
                        _ => vec!["x".into(), "y".into()],
                    };
                    rep.health = if ready { BackendHealth::Ready } else { BackendHealth::Loading };
                    rep.draining = draining;
                    r.apply_report(rep, a, now);
                }
                Op::Pick { model, path, tokens, avoid, may_hold } => {
                    // Chained like real block hashes: a value names its
                    // whole prefix.
                    let mut h = 0u64;
                    let prefix: Vec<u64> = path
                        .iter()
                        .map(|&c| {
                            h = h * 4 + u64::from(c) + 1;
                            h
                        })
                        .collect();
                    let route = Route {
                        model: match model {
                            0 => None,
                            1 => Some(Arc::from("x")),
                            2 => Some(Arc::from("y")),
                            _ => Some(Arc::from("z")),
                        },
                        prefix,
                        avoid: avoid.map(port_addr),
                        subset: None,
                        tokens: TokenEstimate { prompt: tokens, output: tokens / 2, output_asked: true },
                        session: None,
                        session_by_prompt: false,
                        ..Route::default()
                    };
                    let want = expected(&r, &route, now, may_hold);
                    let waits = Waits::default();
                    let hold = may_hold.then_some(Pass { waits: &waits, may_spill: true });
                    match place(&r, &route, hold, now).outcome {
                        Outcome::Busy => proptest::prop_assert_eq!(want, Expected::Busy),
                        Outcome::Delay(..) => proptest::prop_assert!(false, "a spill is allowed"),
                        Outcome::Shed => proptest::prop_assert!(false, "no objective, nothing shed"),
                        Outcome::Wait(id) => {
                            proptest::prop_assert!(
                                matches!(want, Expected::Hold | Expected::HoldOrBest(_)),
                                "held for {id:?}, expected {want:?}"
                            );
                            let e = r.endpoint(id).unwrap();
                            proptest::prop_assert!(e.eligible(now) && !e.takes(&route, now, r.saturation()));
                        }
                        Outcome::Go(id) => {
                            let (Expected::Best(best) | Expected::HoldOrBest(best)) = want else {
                                return Err(proptest::test_runner::TestCaseError::fail(
                                    format!("chose {id:?}, expected {want:?}"),
                                ));
                            };
                            let got = score_of(&r, r.endpoint(id).unwrap(), &route);
                            proptest::prop_assert!((got - best).abs() < 1e-6, "score {got}, best {best}");
                        }
                    }
                    if let Pick::Lease(l) = pick(&mut r, &route, now, hold) {
                        leases.push(l);
                    }
                }
                Op::Release(i) if !leases.is_empty() => {
                    let l = leases.swap_remove(i % leases.len());
                    r.release(l, now);
                }
                Op::Orphan(i) if !leases.is_empty() => {
                    let l = leases.swap_remove(i % leases.len());
                    r.orphan(l, false, now);
                }
                Op::Deregister(agent) => {
                    r.deregister(&format!("agent-{agent}"));
                }
                Op::Learn { agent, prefill_us_per_token, service_ms } => {
                    let prefill = Duration::from_micros(prefill_us_per_token * 1_000);
                    r.learn_cost(port_addr(agent), &Timing {
                        prefilled_tokens: 1_000,
                        prefill: Some(prefill),
                        service: Some(Duration::from_millis(service_ms)),
                        ..Timing::default()
                    });
                }
                Op::Release(_) | Op::Orphan(_) => {}
            }
            // The ranking is exactly the endpoints that could take work.
            if let Err(e) = r.ranking_is_current() {
                return Err(proptest::test_runner::TestCaseError::fail(e));
            }
        }
    }
}

#[test]
fn equal_endpoints_of_a_subset_take_turns() {
    let now = Instant::now();
    let mut r = EndpointLedger::default();
    for (id, port) in [("a", 1), ("b", 2), ("c", 3)] {
        let (rep, a) = report_for(id, port, 4, &[]);
        r.apply_report(rep, a, now);
    }
    let mut hinted = route(None, &[]);
    hinted.subset = Some(vec![addr("127.0.0.1:1"), addr("127.0.0.1:3")].into());
    // Each lease changes its endpoint's score: released at once, the two
    // stay equal and the one that went longest ago goes next.
    let mut ports = Vec::new();
    for _ in 0..6 {
        let l = acquire(&mut r, &hinted, now).unwrap();
        ports.push(l.addr.port());
        r.release(l, now);
    }
    assert!(ports.iter().all(|p| *p == 1 || *p == 3), "{ports:?}");
    assert!(ports.windows(2).all(|w| w[0] != w[1]), "{ports:?}");
}
