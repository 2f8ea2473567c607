//! Slot shares: how an agent divides its server's slots between the
//! balancers that send it work, so that all of them together never send
//! the server more than its slots.
//!
//! Slots belong to the server, and only its agent sees all of them. Each
//! balancer tells the agent, in its answer to every report, how many of its
//! requests run on the server (`in_flight`), how many it has queued that
//! the server could take (`queued`), and the share it applies now
//! (`applied`); the agent's next report to it carries its new share, and the
//! balancer fills no more slots than that share.
//!
//! The rule ([`divide`]):
//! - What is divided is the server's slots less those busy with work no
//!   balancer said it runs (clients that bypass the balancers, or a
//!   balancer the agent gave up on whose requests still run): the busy
//!   slots beyond what the balancers say may have been theirs when the
//!   engine was read (`at_read`; else their `in_flight`), counted on the
//!   engine's count of the report they answered, or the newer one if
//!   lower. The
//!   report a balancer answers was read from the engine before the
//!   balancer answered it, so the requests it sent since are not in it,
//!   and a busy balancer's new requests never count as someone else's
//!   (which would shrink its share under load); and a busy slot no
//!   balancer claims counts as foreign however large the idle
//!   balancers' shares are.
//! - Each balancer first keeps what it has in flight (a share never takes
//!   a running request's slot away); the rest goes to the balancers with
//!   queued work, in proportion to it; what no one wants is shared evenly,
//!   so a request that arrives at an idle balancer need not wait a report
//!   interval for a slot.
//! - A share shrinks at once but grows only into slots no balancer may be
//!   using: a balancer may fill up to the larger of the share it applies
//!   and the last one it was sent (it may apply that any moment), so slots
//!   move from one balancer to another only once the first said it applies
//!   the smaller share. Hence, at every moment, the slots all balancers may
//!   fill add up to at most what is divided: no over-commit, whatever the
//!   order in which reports and answers cross.
//!
//! Pure: the agent keeps one [`Ledger`] per server and calls
//! [`Ledger::divide`] before each round of reports.

use std::collections::BTreeMap;

/// What one balancer said in its last answer to a report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Demand {
    /// Its requests running on the server.
    pub in_flight: u32,
    /// Its queued requests the server could serve.
    pub queued: u32,
    /// The share it applies now; `None` before it applied any.
    pub applied: Option<u32>,
    /// Of its requests, the most that may have been running when the
    /// engine was read for the report it answers (`None`: it does not say,
    /// and `in_flight` stands for it). What the engine's busy count may
    /// hold of its own: the rest is foreign.
    pub at_read: Option<u32>,
}

/// One balancer's state at the agent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Balancer {
    demand: Demand,
    /// The engine's busy slots in the report its demand answered (`None`:
    /// it answered none yet).
    busy_seen: Option<u32>,
    /// The last share sent to it.
    sent: Option<u32>,
}

impl Balancer {
    /// The most slots it may be filling now, or any moment: it may apply
    /// the last share it was sent before it answers.
    fn committed(&self) -> u32 {
        self.demand
            .in_flight
            .max(self.demand.applied.unwrap_or(0))
            .max(self.sent.unwrap_or(0))
    }
}

/// The shares of one server, keyed by balancer (`K`: its address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ledger<K: Ord> {
    balancers: BTreeMap<K, Balancer>,
}

impl<K: Ord> Default for Ledger<K> {
    fn default() -> Self {
        Ledger {
            balancers: BTreeMap::new(),
        }
    }
}

impl<K: Ord + Clone> Ledger<K> {
    /// Records a balancer's answer to a report that said `busy_seen` of
    /// the server's slots were busy (a balancer not seen before joins).
    pub fn answered(&mut self, balancer: &K, busy_seen: u32, demand: Demand) {
        let b = self.balancers.entry(balancer.clone()).or_default();
        b.demand = demand;
        b.busy_seen = Some(busy_seen);
    }

    /// A balancer joins before it answered any report: it claims nothing.
    pub fn joined(&mut self, balancer: &K) {
        self.balancers.entry(balancer.clone()).or_default();
    }

    /// Forgets a balancer (it stopped answering, or left): its requests
    /// still running count as busy slots no balancer sent until they end.
    pub fn forget(&mut self, balancer: &K) {
        self.balancers.remove(balancer);
    }

    /// Busy slots no balancer says it runs, when the engine says `busy`
    /// run now (module docs): counted on the lowest of the engine's counts
    /// the answers saw and `busy`, all read before any balancer sent the
    /// requests it has not told of yet.
    pub fn foreign(&self, busy: u32) -> u32 {
        let before_answers = self
            .balancers
            .values()
            .filter_map(|b| b.busy_seen)
            .fold(busy, u32::min);
        let said: u32 = self
            .balancers
            .values()
            .map(|b| b.demand.at_read.unwrap_or(b.demand.in_flight))
            .fold(0, u32::saturating_add);
        before_answers.saturating_sub(said)
    }

    /// Divides the server's `slots`, of which `busy` run now (as the
    /// engine says), among the known balancers, and records each share as
    /// sent (see the module docs). Returns the shares, by balancer.
    pub fn divide(&mut self, slots: u32, busy: u32) -> Vec<(K, u32)> {
        let divided = slots.saturating_sub(self.foreign(busy));
        let targets = targets(
            divided,
            &self
                .balancers
                .values()
                .map(|b| b.demand)
                .collect::<Vec<_>>(),
        );
        // Slots no balancer may be filling: what shares may grow into.
        let committed: u32 = self
            .balancers
            .values()
            .map(Balancer::committed)
            .fold(0, u32::saturating_add);
        let mut pool = divided.saturating_sub(committed);
        let mut out = Vec::with_capacity(self.balancers.len());
        for (b, target) in self.balancers.values_mut().zip(targets) {
            let now = b.committed();
            let share = if target <= now {
                target
            } else {
                let grow = (target - now).min(pool);
                pool -= grow;
                now + grow
            };
            b.sent = Some(share);
            out.push(share);
        }
        self.balancers.keys().cloned().zip(out).collect()
    }
}

/// The shares `divided` slots would ideally be cut into: each balancer's
/// in-flight first, then the rest in proportion to the queued requests
/// (largest remainders, ties to the first), then what no queue wants
/// evenly. Never more in all than `divided`.
fn targets(divided: u32, demands: &[Demand]) -> Vec<u32> {
    let n = demands.len();
    if n == 0 {
        return Vec::new();
    }
    let mut shares: Vec<u32> = Vec::with_capacity(n);
    let mut left = divided;
    for d in demands {
        let keep = d.in_flight.min(left);
        shares.push(keep);
        left -= keep;
    }
    // The queued beyond what each already has.
    let wants: Vec<u64> = demands.iter().map(|d| u64::from(d.queued)).collect();
    let total: u64 = wants.iter().sum();
    if total > 0 && left > 0 {
        let give = u64::from(left).min(total);
        let mut given = 0u64;
        let mut remainders: Vec<(u64, usize)> = Vec::with_capacity(n);
        for (i, w) in wants.iter().enumerate() {
            let exact = give * w;
            let whole = exact / total;
            shares[i] += whole as u32;
            given += whole;
            remainders.push((exact % total, i));
        }
        remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(_, i) in remainders.iter().take((give - given) as usize) {
            shares[i] += 1;
        }
        left -= give as u32;
    }
    // Spare slots, evenly (the first ones get the remainder).
    let each = left / n as u32;
    let extra = (left % n as u32) as usize;
    for (i, s) in shares.iter_mut().enumerate() {
        *s += each + u32::from(i < extra);
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn demand(in_flight: u32, queued: u32, applied: Option<u32>) -> Demand {
        Demand {
            in_flight,
            queued,
            applied,
            at_read: None,
        }
    }

    #[test]
    fn one_balancer_gets_every_slot() {
        let mut l = Ledger::default();
        l.joined(&"a");
        assert_eq!(l.divide(8, 0), [("a", 8)]);
        l.answered(&"a", 0, demand(0, 0, Some(8)));
        assert_eq!(l.divide(8, 0), [("a", 8)]);
    }

    #[test]
    fn queued_work_draws_the_slots_and_an_idle_balancer_keeps_its_running_ones() {
        let mut l = Ledger::default();
        l.answered(&"a", 0, demand(0, 0, None));
        l.answered(&"b", 0, demand(0, 0, None));
        assert_eq!(l.divide(8, 0), [("a", 4), ("b", 4)], "evenly while idle");
        // a has 2 running and nothing queued, b 4 running and 6 queued.
        l.answered(&"a", 6, demand(2, 0, Some(4)));
        l.answered(&"b", 6, demand(4, 6, Some(4)));
        // a shrinks to its running 2 at once; b may not grow into a's
        // old share before a says it applies the smaller one.
        assert_eq!(l.divide(8, 6), [("a", 2), ("b", 4)]);
        l.answered(&"a", 6, demand(2, 0, Some(2)));
        assert_eq!(l.divide(8, 6), [("a", 2), ("b", 6)]);
    }

    #[test]
    fn busy_slots_no_balancer_sent_are_not_divided() {
        let mut l = Ledger::default();
        l.answered(&"a", 3, demand(1, 5, Some(1)));
        // 3 busy, 1 of them a's: 2 belong to someone else.
        assert_eq!(l.divide(8, 3), [("a", 6)]);
        // A balancer that is forgotten with requests still running: they
        // count against the server until they end.
        l.answered(&"b", 3, demand(0, 0, None));
        l.forget(&"a");
        assert_eq!(l.divide(8, 3), [("b", 5)]);
    }

    #[test]
    fn an_idle_balancers_share_hides_no_foreign_work() {
        // The case: one idle balancer holds every slot of a 4-slot
        // server when a client that bypasses it takes all four.
        let mut l = Ledger::default();
        l.answered(&"a", 0, demand(0, 0, Some(4)));
        assert_eq!(l.divide(4, 0), [("a", 4)]);
        // The next read sees 4 busy; a's answer is to the report before.
        l.answered(&"a", 0, demand(0, 0, Some(4)));
        assert_eq!(l.foreign(4), 0, "not yet: a may have sent them since");
        // a answered the report that said 4 busy, with nothing in flight:
        // the 4 are someone else's, and a's share is gone.
        l.answered(&"a", 4, demand(0, 0, Some(4)));
        assert_eq!(l.divide(4, 4), [("a", 0)]);
        // Two idle balancers, the same.
        l.answered(&"b", 4, demand(0, 3, Some(0)));
        assert_eq!(l.divide(4, 4), [("a", 0), ("b", 0)]);
        // The foreign work ends: the slots come back at once (once a
        // said it applies its share of 0, which b may then grow into).
        l.answered(&"a", 4, demand(0, 0, Some(0)));
        assert_eq!(l.divide(4, 0), [("a", 1), ("b", 3)], "b has queued work");
    }

    #[test]
    fn a_busy_balancers_new_requests_are_not_counted_foreign() {
        let mut l = Ledger::default();
        l.answered(&"a", 2, demand(2, 0, Some(4)));
        assert_eq!(l.divide(4, 2), [("a", 4)]);
        // a sent two more after it answered: the engine now runs 4, of
        // which a said it ran 2. They are a's, not a stranger's.
        l.answered(&"a", 2, demand(2, 2, Some(4)));
        assert_eq!(l.foreign(4), 0);
        assert_eq!(l.divide(4, 4), [("a", 4)]);
        // Beside a client that holds one slot throughout.
        let mut l = Ledger::default();
        l.answered(&"a", 1, demand(0, 0, Some(3)));
        l.answered(&"a", 2, demand(1, 0, Some(3)));
        assert_eq!(l.foreign(4), 1);
        assert_eq!(l.divide(4, 4), [("a", 3)]);
    }

    #[test]
    fn a_request_that_ended_after_the_read_is_the_balancers() {
        // The engine read 4 busy, all a's; one ended before a answered.
        let mut l = Ledger::default();
        l.answered(&"a", 4, demand(3, 0, Some(4)));
        assert_eq!(l.foreign(4), 1, "by in_flight alone: one looks foreign");
        let said = Demand {
            at_read: Some(4),
            ..demand(3, 0, Some(4))
        };
        l.answered(&"a", 4, said);
        assert_eq!(l.foreign(4), 0);
        assert_eq!(l.divide(4, 4), [("a", 4)]);
    }

    proptest! {
        /// Whatever the balancers and a client that bypasses them do, and
        /// whenever: the slots the balancers may all be filling (each: the
        /// larger of what it applies and what it was last sent) never add
        /// up to more than the server's slots; no request a balancer sent
        /// counts as foreign (the estimate never exceeds the foreign work
        /// in the engine's read its answer saw); foreign work that lasted
        /// over two reads is left out of the shares whenever the balancers
        /// did not shrink meanwhile; and each balancer keeps its running
        /// requests' slots when there is room for them.
        #[test]
        fn the_balancers_together_never_fill_more_than_the_server_has(
            slots in 0u32..16,
            rounds in proptest::collection::vec(
                (proptest::collection::vec((0u32..8, 0u32..20, any::<bool>()), 3), 0u32..6),
                1..30,
            ),
        ) {
            let mut l: Ledger<usize> = Ledger::default();
            // What each balancer really applies, and what it was sent.
            let mut applied: [Option<u32>; 3] = [None; 3];
            let mut sent: [Option<u32>; 3] = [None; 3];
            // Each balancer's requests running at the last read, the
            // foreign work then, and the engine's count then.
            let mut running = [0u32; 3];
            let mut foreign_before = 0u32;
            let mut busy_before = 0u32;
            for (round, foreign) in rounds {
                for (i, &(_, queued, applies)) in round.iter().enumerate() {
                    // A balancer answers the last report with what it
                    // runs, then applies the share sent (or not yet), and
                    // sends or ends requests before the next read, never
                    // running more than it applies.
                    l.answered(&i, busy_before, demand(running[i], queued, applied[i]));
                    if applies && sent[i].is_some() {
                        applied[i] = sent[i];
                    }
                }
                let said: u32 = running.iter().sum();
                for (i, &(wants, _, _)) in round.iter().enumerate() {
                    running[i] = wants.min(applied[i].unwrap_or(0));
                }
                let ours: u32 = running.iter().sum();
                let busy = ours + foreign;
                let estimate = l.foreign(busy);
                prop_assert!(estimate <= foreign_before, "{estimate} > {foreign_before}");
                let shares = l.divide(slots, busy);
                for (i, share) in shares {
                    sent[i] = Some(share);
                }
                if ours >= said {
                    let lasted = foreign.min(foreign_before);
                    let total: u32 = sent.iter().map(|s| s.unwrap()).sum();
                    prop_assert!(total <= slots.saturating_sub(lasted), "{total} beside {lasted}");
                }
                let may_fill: u32 = (0..3)
                    .map(|i| applied[i].unwrap_or(0).max(sent[i].unwrap_or(0)))
                    .sum();
                prop_assert!(may_fill <= slots.max(said), "{may_fill} > {slots}");
                for (i, share) in sent.iter().enumerate() {
                    let kept = l.balancers[&i].demand.in_flight;
                    prop_assert!(share.unwrap() >= kept.min(slots) || said + foreign_before > slots);
                }
                foreign_before = foreign;
                busy_before = busy;
            }
        }
    }
}
