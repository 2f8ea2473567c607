//! The order inside a flow: requests with a latency objective first,
//! earliest first token due first, then the others by their rank (their
//! arrival, FCFS, or their deadline, EDF).
//!
//! Session 39 had an overdue request give way to those still on time for
//! up to 2 s; once the kept slots' reference was fixed (session 40) it
//! showed no gain on the objectives bench and was removed (BENCHMARKS.md).

use std::time::Instant;

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
