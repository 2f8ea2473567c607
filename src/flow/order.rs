//! The order inside a flow: requests with a latency objective first,
//! earliest first token due first, then the others by their rank (their
//! arrival, FCFS, or their deadline, EDF).
//!
//! One exception, for a burst of requests with objectives that finds every
//! slot busy: earliest due first gives each freed slot to the request that
//! waited longest, which has already missed its objective, so every request
//! of the burst misses in turn. A request whose first token is overdue
//! therefore gives way to the requests of its flow still on time — for at
//! most [`OVERDUE_GIVES_WAY`], after which it goes first again (earliest
//! due first), so under lasting overload it is served late, not starved to
//! its TTL. The order is read at `now`; the keys do not change.

use std::collections::{btree_map, BTreeMap};
use std::time::{Duration, Instant};

/// Position inside a flow (and across the flows of a `global-strict` band,
/// by each flow's first key): requests with a latency objective first by
/// `rank` = when their first token is due; then the others by `rank`,
/// their arrival (FCFS) or their deadline (EDF). `seq` breaks ties and
/// makes every key unique (it starts at 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct OrderKey {
    /// No objective: after every request that has one.
    pub(super) unhurried: bool,
    pub(super) rank: Instant,
    pub(super) seq: u64,
}

/// How long an overdue request gives way to the requests of its flow
/// still on time: the most this rule delays one. The bursts of
/// interactive requests that missed on the objectives bench lasted about
/// 2 s each (BENCHMARKS.md, session 39); a burst shorter than this is
/// served freshest first where that is on time.
pub(super) const OVERDUE_GIVES_WAY: Duration = Duration::from_secs(2);

/// The first key of requests with an objective due at `at` or later.
fn due_from(at: Instant) -> OrderKey {
    OrderKey {
        unhurried: false,
        rank: at,
        seq: 0,
    }
}

/// `items` in the order they go at `now` (module docs): overdue past
/// [`OVERDUE_GIVES_WAY`], on time, overdue lately, then those without an
/// objective. Overdue keys are the least, so while the first is not
/// overdue the order is the keys' own (what every flow without objectives
/// pays: one look at its first key). O(log n) to start, then one step a
/// request.
pub(super) fn in_order<V>(items: &BTreeMap<OrderKey, V>, now: Instant) -> InOrder<'_, V> {
    let overdue = items
        .keys()
        .next()
        .is_some_and(|k| !k.unhurried && k.rank < now);
    if overdue {
        InOrder::GivingWay(Box::new(giving_way(items, now)))
    } else {
        InOrder::Keyed(items.iter())
    }
}

/// The iterator [`in_order`] returns.
pub(super) enum InOrder<'a, V> {
    /// Nothing overdue: the keys' order.
    Keyed(btree_map::Iter<'a, OrderKey, V>),
    /// Some request overdue (rare: a box is worth not paying the rule's
    /// chain of ranges on every flow).
    GivingWay(Box<dyn Iterator<Item = (&'a OrderKey, &'a V)> + 'a>),
}

impl<'a, V> Iterator for InOrder<'a, V> {
    type Item = (&'a OrderKey, &'a V);

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            InOrder::Keyed(it) => it.next(),
            InOrder::GivingWay(it) => it.next(),
        }
    }
}

/// [`in_order`] where some request is overdue.
fn giving_way<V>(
    items: &BTreeMap<OrderKey, V>,
    now: Instant,
) -> impl Iterator<Item = (&OrderKey, &V)> {
    let on_time = due_from(now);
    // None: nothing can be overdue that long yet.
    let gave_way = now.checked_sub(OVERDUE_GIVES_WAY).map(due_from);
    let long_overdue = gave_way.into_iter().flat_map(move |k| items.range(..k));
    let overdue = match gave_way {
        Some(k) => items.range(k..on_time),
        None => items.range(..on_time),
    };
    let rest = || items.range(on_time..);
    long_overdue
        .chain(rest().take_while(|(k, _)| !k.unhurried))
        .chain(overdue)
        .chain(rest().skip_while(|(k, _)| !k.unhurried))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overdue_requests_give_way_to_those_on_time_for_a_while_then_go_first() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let key = |unhurried, rank, seq| OrderKey {
            unhurried,
            rank,
            seq,
        };
        let mut items = BTreeMap::new();
        for (name, k) in [
            ("plain", key(true, t0, 1)),
            ("due at 500", key(false, t0 + ms(500), 2)),
            ("due at 100", key(false, t0 + ms(100), 3)),
            ("due at 900", key(false, t0 + ms(900), 4)),
            ("due at 0", key(false, t0, 5)),
        ] {
            items.insert(k, name);
        }
        let at = |now| in_order(&items, now).map(|(_, v)| *v).collect::<Vec<_>>();
        // Nothing overdue yet: earliest due first, then the others.
        assert_eq!(
            at(t0),
            [
                "due at 0",
                "due at 100",
                "due at 500",
                "due at 900",
                "plain"
            ]
        );
        // At 600 ms three are overdue: the one still on time goes first.
        assert_eq!(
            at(t0 + ms(600)),
            [
                "due at 900",
                "due at 0",
                "due at 100",
                "due at 500",
                "plain"
            ]
        );
        // At 2.2 s two are overdue by more than 2 s: they go first again.
        assert_eq!(
            at(t0 + ms(2_200)),
            [
                "due at 0",
                "due at 100",
                "due at 500",
                "due at 900",
                "plain"
            ]
        );
    }
}
