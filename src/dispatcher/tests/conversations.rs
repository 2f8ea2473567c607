//! Conversations in a closed loop under a controlled clock (issue 37's
//! sessions bench, small): four servers of two slots with a prefix cache,
//! groups of conversations sharing a 1,024-token system prompt, eight
//! turns each, every turn re-sending the conversation so far plus 448
//! tokens; prefill 1 ms a token not cached, 210 ms of decode; each client
//! sends its next turn 1 ms after its answer ends.

use super::burst::{answer, four_servers, group_of, ORDERS};
use super::*;
use crate::endpoint::{CacheSeen, Timing};
use std::collections::{BTreeMap, HashSet};

const TURNS: usize = 8;
const TOKENS_PER_BLOCK: u64 = 64;

/// What a run of conversations gave.
#[derive(Debug)]
struct Run {
    /// Time to first token of the turns sent 5 s after the first (past
    /// the burst), sorted, in ms.
    late_ms: Vec<u64>,
    /// Conversations whose last turn each server served.
    last_on: BTreeMap<u16, usize>,
    /// Σ cached / Σ prompt tokens, as the engines counted them.
    hit: f64,
}

impl Run {
    fn late(&self, q: f64) -> u64 {
        let i = ((self.late_ms.len() as f64 - 1.0) * q).round() as usize;
        self.late_ms[i]
    }
}

struct Conversation {
    blocks: Vec<u64>,
    turn: usize,
}

impl Conversation {
    fn tokens(&self) -> u64 {
        self.blocks.len() as u64 * TOKENS_PER_BLOCK + 20
    }
}

/// Runs the conversations whose first turns come in `order` (groups of
/// the sizes in `groups`), 70 µs apart, to the end.
fn converse(order: &[u64], groups: &[u64], keyed: bool) -> Run {
    let t0 = Instant::now();
    let mut cfg = config(1_000);
    cfg.scheduling.prefix.block_bytes = (TOKENS_PER_BLOCK * 4) as usize;
    cfg.default_ttl = Duration::from_secs(60);
    cfg.scheduling.affinity_hold = SchedulingConfig::default().affinity_hold;
    let mut d = four_servers(cfg, t0);
    let mut convs: BTreeMap<u64, Conversation> = order
        .iter()
        .map(|&c| {
            let group = group_of(groups, c);
            let mut blocks: Vec<u64> = (0..16).map(|b| 0x5157_0000 + group * 1_000 + b).collect();
            blocks.extend((0..4).map(|b| 0xC0DE_0000_0000 ^ (c << 16) ^ b));
            (c, Conversation { blocks, turn: 0 })
        })
        .collect();
    let request = |c: u64, conv: &Conversation| {
        let mut r = req(&format!("t{}", c % 4), 0);
        if keyed {
            r.route.session = Some(1_000 + c);
        }
        r.route.tokens.prompt = conv.tokens();
        r.route.prefix = conv.blocks.clone();
        r
    };
    let mut caches: BTreeMap<u16, HashSet<u64>> = BTreeMap::new();
    let mut arrivals: Vec<(Instant, u64)> = order
        .iter()
        .enumerate()
        .map(|(i, &c)| (t0 + Duration::from_micros(70 * i as u64), c))
        .collect();
    let mut arrived_at: BTreeMap<u64, Instant> = BTreeMap::new();
    let mut running: Vec<(Instant, u64, Lease, Timing, CacheSeen)> = Vec::new();
    let mut turns = 0;
    let mut late_ms = Vec::new();
    let mut last_on: BTreeMap<u16, usize> = BTreeMap::new();
    let (mut prompt_sum, mut cached_sum) = (0u64, 0u64);
    let mut now = t0;
    loop {
        // The next event: an arrival, an answer's end, a hold's end.
        arrivals.sort();
        running.sort_by_key(|r| r.0);
        let next = [
            arrivals.first().map(|a| a.0),
            running.first().map(|r| r.0),
            d.next_hold_end(),
        ]
        .into_iter()
        .flatten()
        .min();
        let Some(next) = next else { break };
        now = next.max(now);
        let mut leases: Vec<(Lease, u64)> = Vec::new();
        if arrivals.first().is_some_and(|a| a.0 <= now) {
            let (_, c) = arrivals.remove(0);
            arrived_at.insert(c, now);
            if let Admission::Ready(lease) = d.submit(request(c, &convs[&c]), c, now) {
                leases.push((lease, c));
            }
        } else if running.first().is_some_and(|r| r.0 <= now) {
            let (_, c, lease, timing, seen) = running.remove(0);
            d.observe_cache(&lease, seen);
            d.observe_timing(&lease, &timing);
            d.release(lease, now);
            let conv = convs.get_mut(&c).expect("known");
            conv.turn += 1;
            if conv.turn < TURNS {
                let n = conv.blocks.len() as u64;
                conv.blocks
                    .extend((0..7).map(|b| 0xC0DE_0000_0000 ^ (c << 16) ^ (n + b)));
                arrivals.push((now + MS, c));
            }
        }
        for done in d.dispatch(now) {
            leases.push((done.result.expect("served"), done.waiter));
        }
        for (lease, c) in leases {
            let conv = &convs[&c];
            let port = lease.addr.port();
            let cache = caches.entry(port).or_default();
            let cached_blocks = conv.blocks.iter().take_while(|b| cache.contains(b)).count();
            cache.extend(conv.blocks.iter().copied());
            let prompt = conv.tokens();
            let cached = cached_blocks as u64 * TOKENS_PER_BLOCK;
            let prefill = prompt - cached;
            prompt_sum += prompt;
            cached_sum += cached;
            let ttft = (now - arrived_at[&c]).as_millis() as u64 + prefill;
            turns += 1;
            if arrived_at[&c] >= t0 + Duration::from_secs(5) {
                late_ms.push(ttft);
            }
            if conv.turn + 1 == TURNS {
                *last_on.entry(port).or_default() += 1;
            }
            let timing = answer(prefill, prefill);
            let seen = CacheSeen {
                prompt_tokens: prompt,
                cached_tokens: cached,
                prompt_bytes: prompt * 4,
            };
            running.push((now + timing.service.expect("set"), c, lease, timing, seen));
        }
    }
    assert_eq!(d.buffered(), 0);
    assert_eq!(turns, order.len() * TURNS);
    late_ms.sort_unstable();
    Run {
        late_ms,
        last_on,
        hit: cached_sum as f64 / prompt_sum as f64,
    }
}

/// The bench's arrival orders and one more: the conversations in turn.
fn orders() -> Vec<Vec<u64>> {
    let mut orders: Vec<Vec<u64>> = ORDERS.iter().map(|o| o.to_vec()).collect();
    orders.push((0..32).collect());
    orders
}

#[test]
fn keyless_conversations_end_eight_to_a_server_whatever_their_groups() {
    for order in orders() {
        let equal = converse(&order, &[8, 8, 8, 8], false);
        // The largest group's spills even out the work; the second's stay
        // on its server, which carries its share (spills from it passed
        // the small groups' requests, and 10, 6, 8 and 8 conversations
        // ended on the four servers in one order, 9, 7, 8, 8 in another).
        let skewed = converse(&order, &[16, 8, 4, 4], false);
        for run in [&equal, &skewed] {
            let on: Vec<usize> = run.last_on.values().copied().collect();
            assert_eq!(on, [8, 8, 8, 8], "{order:?}: {run:?}");
            assert!(run.hit > 0.83, "{order:?}: {run:?}");
        }
        // Past the burst, no turn waits longer than on equal groups.
        assert!(
            skewed.late(0.99) <= equal.late(0.99),
            "{order:?}: {skewed:?}"
        );
    }
}

#[test]
fn keyed_conversations_of_equal_groups_end_within_one_of_eight_to_a_server() {
    for order in orders() {
        // Each session is bound to the server of its last turn once it
        // was served; a first turn placed while the burst is still coming
        // may leave a server one conversation over.
        let run = converse(&order, &[8, 8, 8, 8], true);
        assert!(
            run.last_on.values().all(|&n| (7..=9).contains(&n)),
            "{order:?}: {run:?}"
        );
        assert!(run.hit > 0.83, "{order:?}: {run:?}");
    }
}
