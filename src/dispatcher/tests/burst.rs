//! A burst of conversations starting at once on an idle fleet, under a
//! controlled clock: four servers of two slots, groups of conversations
//! sharing a system prompt, each first turn a cold prefill of 1.3 s where
//! its group's prompt is not cached and 0.29 s where it is (as an engine
//! serves a second request of a prompt it is prefilling), then 0.21 s of
//! decode, each answer telling the balancer its timings. The peers that
//! commit each request on arrival put every group on one server; first
//! turns placed one by one by their sessions' homes used to start three or
//! four groups cold on every server, and keyless ones, whose spills took
//! every free server before the other groups' first turns came, two or
//! three.

use super::*;
use crate::endpoint::Timing;
use std::collections::BTreeMap;

/// Orders in which 32 first turns (conversation `c` of group `c / 8`)
/// reached a balancer in bench runs: one group first, groups interleaved.
pub(super) const ORDERS: [[u64; 32]; 4] = [
    [
        13, 0, 14, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 23, 24, 25, 26, 27, 28, 29, 30, 31, 19,
        16, 17, 18, 21, 20, 22, 15,
    ],
    [
        9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 0, 23, 24, 1, 25, 2, 26, 3, 27, 4,
        28, 5, 29, 6, 30, 7, 31, 8,
    ],
    [
        0, 4, 5, 1, 6, 2, 7, 3, 8, 19, 9, 20, 10, 21, 22, 11, 23, 24, 12, 25, 26, 13, 27, 28, 14,
        29, 30, 15, 31, 17, 18, 16,
    ],
    [
        0, 13, 1, 14, 2, 15, 3, 16, 4, 17, 5, 18, 6, 19, 20, 21, 22, 7, 23, 24, 25, 26, 8, 9, 10,
        11, 12, 28, 29, 30, 31, 27,
    ],
];

/// The group of conversation `c`, of groups of the sizes in `groups`.
pub(super) fn group_of(groups: &[u64], c: u64) -> u64 {
    let mut end = 0;
    groups
        .iter()
        .position(|n| {
            end += n;
            c < end
        })
        .expect("in a group") as u64
}

/// A dispatcher in front of four servers of two slots (ports 1 to 4), on
/// a balancer alone, whose agents report once a minute.
pub(super) fn four_servers(c: DispatcherConfig, t0: Instant) -> Dispatcher<u64> {
    let mut d = Dispatcher::new(c);
    for (id, port) in [("a", 1), ("b", 2), ("c", 3), ("d", 4)] {
        let mut r = model_server(id, port, 2, &[]);
        r.balancers = Some(1);
        r.monitoring_interval_ms = 60_000;
        d.report(r, t0).unwrap();
    }
    d
}

/// What an engine says of an answer that prefilled `tokens` in
/// `prefill_ms`, then decoded 11 tokens in 210 ms.
pub(super) fn answer(tokens: u64, prefill_ms: u64) -> Timing {
    Timing {
        prefilled_tokens: tokens,
        prefill: Some(Duration::from_millis(prefill_ms)),
        output_tokens: 11,
        decode: Some(Duration::from_millis(210)),
        service: Some(Duration::from_millis(prefill_ms + 210)),
        first_token: None,
    }
}

/// Where each server's first turns came from: (group, cold) in the order
/// it started them.
type Served = BTreeMap<u16, Vec<(u64, bool)>>;

/// Runs the first turns of the conversations in `order` (groups of the
/// sizes in `groups`, tenants in turn as the bench's clients), 70 µs
/// apart, until every one has had its first token (asserted).
fn burst(order: &[u64], groups: &[u64], keyed: bool) -> Served {
    let t0 = Instant::now();
    let group_of = |c: u64| group_of(groups, c);
    let mut c = config(100);
    c.scheduling.prefix.block_bytes = 256;
    c.scheduling.affinity_hold = Duration::from_secs(5);
    let mut d = four_servers(c, t0);
    // A 4 KB system prompt (16 blocks) and a 1 KB first message: 1,300
    // tokens, 1,024 of them the group's.
    let first_turn = |c: u64| {
        let group = group_of(c);
        let mut r = req(&format!("t{}", c % 4), 0);
        if keyed {
            r.route.session = Some(1_000 + c);
        }
        r.route.tokens.prompt = 1_300;
        r.route.prefix = (0..16).map(|b| 0x5157_0000 + group * 1_000 + b).collect();
        r.route
            .prefix
            .extend((0..4).map(|b| 0xC0DE_0000 ^ (c << 8) ^ b));
        r
    };
    let mut served = Served::new();
    // (end, lease, what its engine will say it took)
    let mut running: Vec<(Instant, Lease, Timing)> = Vec::new();
    let mut start = |lease: Lease, c: u64, now: Instant, running: &mut Vec<_>| {
        let cold = lease.predicted_blocks < 16;
        let (tokens, prefill) = if cold { (1_300, 1_300) } else { (276, 290) };
        served
            .entry(lease.addr.port())
            .or_default()
            .push((group_of(c), cold));
        let timing = answer(tokens, prefill);
        running.push((now + timing.service.expect("set"), lease, timing));
    };
    let mut now = t0;
    for (i, &c) in order.iter().enumerate() {
        now = t0 + Duration::from_micros(70 * i as u64);
        if let Admission::Ready(lease) = d.submit(first_turn(c), c, now) {
            start(lease, c, now, &mut running);
        }
        for done in d.dispatch(now) {
            start(done.result.expect("served"), done.waiter, now, &mut running);
        }
    }
    while d.buffered() > 0 {
        running.sort_by_key(|r| r.0);
        let end = running.first().map(|r| r.0);
        now = [end, d.next_hold_end()]
            .into_iter()
            .flatten()
            .min()
            .expect("a request waits for a running one or a clock")
            .max(now);
        if end == Some(now) {
            let (_, lease, timing) = running.remove(0);
            d.observe_timing(&lease, &timing);
            d.release(lease, now);
        }
        for done in d.dispatch(now) {
            start(done.result.expect("served"), done.waiter, now, &mut running);
        }
    }
    // Every first turn started, once.
    assert_eq!(served.values().map(Vec::len).sum::<usize>(), order.len());
    served
}

fn colds_per_server(served: &Served) -> Vec<usize> {
    served
        .values()
        .map(|starts| starts.iter().filter(|(_, cold)| *cold).count())
        .collect()
}

#[test]
fn in_a_burst_of_keyed_conversations_no_server_prefills_more_than_two_groups() {
    for order in &ORDERS {
        let served = burst(order, &[8, 8, 8, 8], true);
        // Each first turn used to go to its session's rendezvous home or
        // the least loaded server of the moment: three or four groups'
        // prompts prefilled cold on every server. Placed by their cached
        // prompts, with spills delayed and the turns held for a server
        // counted there, most groups start once; the turns that came once
        // every slot was taken may still start a group on a second
        // server.
        let colds = colds_per_server(&served);
        assert!(colds.iter().all(|&c| c <= 2), "{order:?}: {served:?}");
    }
}

#[test]
fn in_a_skewed_burst_of_keyed_conversations_the_small_groups_start_once() {
    let order: Vec<u64> = (0..32).collect();
    let served = burst(&order, &[16, 8, 4, 4], true);
    // The small groups (4 conversations, half a server's share) each
    // start on one server, once; the large ones spread to the servers
    // where their prompt is worth prefilling again.
    for group in 2..4 {
        let cold = served
            .values()
            .flatten()
            .filter(|&&(g, cold)| g == group && cold)
            .count();
        assert_eq!(cold, 1, "group {group}: {served:?}");
    }
    let colds = colds_per_server(&served);
    assert!(colds.iter().all(|&c| c <= 2), "{served:?}");
}

#[test]
fn in_a_burst_of_keyless_conversations_each_server_prefills_one_group() {
    for order in &ORDERS {
        let served = burst(order, &[8, 8, 8, 8], false);
        // Each group's first turn starts it on the freest server; its
        // other turns wait for it (or out their spill delay) while the
        // other groups' first turns come, and spill later only past a
        // server's own, shorter queue.
        let colds = colds_per_server(&served);
        assert_eq!(colds, [1, 1, 1, 1], "{order:?}: {served:?}");
    }
}

#[test]
fn in_a_skewed_burst_of_keyless_conversations_the_largest_group_spreads() {
    let order: Vec<u64> = (0..32).collect();
    let served = burst(&order, &[16, 8, 4, 4], false);
    // Its queue is the longest: it spills past the others' (waiting for
    // its server only, it would keep one server busy while three idled,
    // as `cache_aware` does); no server prefills more than two groups.
    let servers_of_largest = served
        .values()
        .filter(|starts| starts.iter().any(|&(g, cold)| g == 0 && cold))
        .count();
    assert!(servers_of_largest >= 2, "{served:?}");
    let colds = colds_per_server(&served);
    assert!(colds.iter().all(|&c| c <= 2), "{served:?}");
}
