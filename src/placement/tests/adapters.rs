//! LoRA adapters in placement: a request goes where its adapter is
//! loaded, an adapter loaded nowhere to its preferred server with room,
//! and a hot adapter waits for its server while that is sooner than a
//! load elsewhere.

use std::time::{Duration, Instant};

use crate::adapter::preferred;
use crate::endpoint::adapter_fixtures::{adapter, fleet, learn_service, with_adapters};
use crate::endpoint::{EndpointLedger, Lease, Route};
use crate::placement::{explain, pick, place, Outcome, Pass, Pick, Waits};

fn take(ledger: &mut EndpointLedger, route: &Route, now: Instant) -> Lease {
    match pick(ledger, route, now, None) {
        Pick::Lease(l) => l,
        other => panic!("no lease: {other:?}"),
    }
}

#[test]
fn an_adapters_requests_go_where_it_is_loaded() {
    let now = Instant::now();
    let mut ledger = fleet([&[], &["a2"], &["a1", "a3"]], 4, now);
    for _ in 0..3 {
        let lease = take(&mut ledger, &adapter("a2"), now);
        assert_eq!(lease.addr.port(), 2);
        assert!(!lease.loads_adapter);
        ledger.release(lease, now);
    }
    let x = explain(&ledger, &adapter("a2"), now);
    assert_eq!(x.choice.map(|a| a.port()), Some(2));
    assert_eq!(x.candidates[0].terms.adapter, 3.2, "loaded: 0.8, weight 4");
    // The base model is placed as before: no adapter term.
    let x = explain(&ledger, &adapter("m"), now);
    assert!(x.candidates.iter().all(|c| c.terms.adapter == 0.0));
}

#[test]
fn an_adapter_loaded_nowhere_goes_to_its_preferred_server_with_room_and_stays() {
    let now = Instant::now();
    // Servers 1 and 2 have room; 3 is full.
    let mut ledger = fleet([&[], &["a1"], &["a1", "a3"]], 4, now);
    let home = preferred("a4", ledger.endpoints().map(|e| e.addr), 1)[0];
    let lease = take(&mut ledger, &adapter("a4"), now);
    assert!(lease.loads_adapter);
    if home.port() != 3 {
        assert_eq!(lease.addr, home, "its preferred server, which has room");
    } else {
        assert_ne!(lease.addr.port(), 3, "room beats preference");
    }
    // Before any report says so, the next ones follow it there.
    let first = lease.addr;
    for _ in 0..3 {
        let next = take(&mut ledger, &adapter("a4"), now);
        assert_eq!(next.addr, first);
        assert!(!next.loads_adapter, "one load");
        ledger.release(next, now);
    }
    ledger.release(lease, now);
    // Every balancer prefers the same servers.
    let again = fleet([&[], &["a1"], &["a1", "a3"]], 4, now);
    assert_eq!(
        again.adapter_wanted(&adapter("a4"), now).unwrap().preferred,
        vec![home]
    );
}

#[test]
fn a_server_that_drops_an_adapter_stops_getting_its_requests_first() {
    let now = Instant::now();
    let mut ledger = fleet([&[], &["a2"], &[]], 4, now);
    assert_eq!(
        explain(&ledger, &adapter("a2"), now)
            .choice
            .map(|a| a.port()),
        Some(2)
    );
    // Server 2 evicts a2 and fills up with two others; server 1 now
    // holds it.
    let later = now + Duration::from_millis(1_500);
    let (r, addr) = with_adapters("e1", 2, 4, &["a3", "a4"]);
    ledger.apply_report(r, addr, later);
    let (r, addr) = with_adapters("e0", 1, 4, &["a2"]);
    ledger.apply_report(r, addr, later);
    let lease = take(&mut ledger, &adapter("a2"), later);
    assert_eq!(lease.addr.port(), 1);
    ledger.release(lease, later);
}

#[test]
fn a_hot_adapter_waits_for_its_server_until_its_queue_costs_more_than_a_load() {
    let now = Instant::now();
    let mut ledger = fleet([&["a1"], &[], &[]], 1, now);
    let busy = take(&mut ledger, &adapter("a1"), now);
    assert_eq!(busy.addr.port(), 1);
    // Server 1: 200 ms per request. A load costs 500 ms by default.
    learn_service(&mut ledger, &busy, 200);
    let mut waits = Waits::default();
    let mut held = 0;
    loop {
        let pass = Pass {
            waits: &waits,
            may_spill: true,
        };
        match place(&ledger, &adapter("a1"), Some(pass), now).outcome {
            Outcome::Wait(id) => {
                assert_eq!(id, busy.endpoint);
                waits.add(id);
                held += 1;
            }
            Outcome::Go(id) => {
                assert_ne!(id, busy.endpoint);
                break;
            }
            other => panic!("{other:?}"),
        }
        assert!(held < 10, "never spreads");
    }
    // Waits of 200, 400 ms beat a 500 ms load; the third (600 ms) goes.
    assert_eq!(held, 2);
    ledger.release(busy, now);
}
