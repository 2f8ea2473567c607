//! The request buffer: a FIFO of waiting requests in front of the endpoints.
//!
//! A synchronous state machine with no clock of its own: every call takes
//! `now`, so tests drive time by hand. The proxy keeps one `Dispatcher`
//! behind a mutex and stores a wake-up handle (`T`) with each waiter.
//!
//! Rules:
//! - A request is dispatched at once when no one is waiting and a slot is
//!   free; otherwise it waits at the back of the buffer.
//! - Buffer full → [`Reject::BufferFull`]; buffering disabled and no endpoint
//!   at all → [`Reject::NoEndpoints`].
//! - Every freed slot or new report runs [`Dispatcher::dispatch`], which hands
//!   out exactly as many leases as there are free slots, head of the buffer
//!   first: a freed slot wakes exactly one waiter.
//! - A waiter past its deadline is never served: its owner's timer removes it
//!   with [`Dispatcher::cancel`], and `dispatch` drops any it meets first. A
//!   waiter whose client left is removed by `cancel` too. Neither holds a slot.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::endpoint::{EndpointSnapshot, Lease, Registry, ReportOutcome};
use crate::protocol::{AgentReport, ReportError};

/// Buffer limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferConfig {
    /// Most requests that may wait; 0 disables buffering.
    pub max_buffered: usize,
    /// Longest a request may wait before it is answered 504.
    pub timeout: Duration,
}

/// Position of a waiting request; also its FIFO order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(u64);

/// Why a request was turned away without being served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    #[error("all model servers are busy and the request buffer is full")]
    BufferFull,
    #[error("no model server is available and buffering is disabled")]
    NoEndpoints,
    #[error("the request waited too long for a free model server")]
    Timeout,
}

impl Reject {
    /// Value of the `x-flowgate-drop-reason` header and metric label.
    pub fn reason(self) -> &'static str {
        match self {
            Reject::BufferFull => "buffer-full",
            Reject::NoEndpoints => "no-endpoints",
            Reject::Timeout => "ttl-expired",
        }
    }

    pub fn http_status(self) -> u16 {
        match self {
            Reject::BufferFull | Reject::NoEndpoints => 503,
            Reject::Timeout => 504,
        }
    }
}

/// Outcome of [`Dispatcher::submit`].
#[derive(Debug)]
pub enum Admission {
    /// Go now.
    Ready(Lease),
    /// Wait for a grant; the request must be expired by this deadline.
    Queued {
        ticket: Ticket,
        deadline: Instant,
    },
    Rejected(Reject),
}

/// A lease handed to a waiting request.
#[derive(Debug)]
pub struct Grant<T> {
    pub ticket: Ticket,
    pub waiter: T,
    pub lease: Lease,
    /// How long the request waited in the buffer.
    pub waited: Duration,
}

#[derive(Debug)]
struct Waiter<T> {
    handle: T,
    enqueued_at: Instant,
    deadline: Instant,
}

/// The buffer plus the endpoint registry, under one lock.
#[derive(Debug)]
pub struct Dispatcher<T> {
    config: BufferConfig,
    registry: Registry,
    waiting: BTreeMap<Ticket, Waiter<T>>,
    next_ticket: u64,
}

impl<T> Dispatcher<T> {
    pub fn new(config: BufferConfig) -> Self {
        Dispatcher {
            config,
            registry: Registry::default(),
            waiting: BTreeMap::new(),
            next_ticket: 0,
        }
    }

    pub fn config(&self) -> BufferConfig {
        self.config
    }

    /// Admits a request: a lease now, a place in the buffer, or a refusal.
    /// `handle` is kept with the waiter and given back in its [`Grant`].
    pub fn submit(&mut self, handle: T, now: Instant) -> Admission {
        if self.waiting.is_empty() {
            if let Some(lease) = self.registry.acquire(now) {
                return Admission::Ready(lease);
            }
        }
        if self.config.max_buffered == 0 {
            return Admission::Rejected(if self.registry.any_eligible(now) {
                Reject::BufferFull
            } else {
                Reject::NoEndpoints
            });
        }
        if self.waiting.len() >= self.config.max_buffered {
            return Admission::Rejected(Reject::BufferFull);
        }
        self.next_ticket += 1;
        let ticket = Ticket(self.next_ticket);
        let deadline = now + self.config.timeout;
        self.waiting.insert(
            ticket,
            Waiter {
                handle,
                enqueued_at: now,
                deadline,
            },
        );
        Admission::Queued { ticket, deadline }
    }

    /// Hands free slots to waiters, oldest first. The caller wakes each
    /// grant's waiter; if that waiter is gone, it releases the lease again.
    ///
    /// Waiters found past their deadline are removed and their handle is
    /// dropped: dropping it is how their owner learns of the timeout when
    /// its own timer has not fired yet. An expired waiter never blocks the
    /// ones behind it.
    pub fn dispatch(&mut self, now: Instant) -> Vec<Grant<T>> {
        let mut grants = Vec::new();
        while let Some(entry) = self.waiting.first_entry() {
            if entry.get().deadline <= now {
                drop(entry.remove());
                continue;
            }
            let Some(lease) = self.registry.acquire(now) else {
                break;
            };
            let (ticket, w) = entry.remove_entry();
            grants.push(Grant {
                ticket,
                waiter: w.handle,
                lease,
                waited: now.saturating_duration_since(w.enqueued_at),
            });
        }
        grants
    }

    /// Removes a waiter whose client went away. `false` if it is no longer
    /// waiting (it was granted a lease or expired meanwhile).
    pub fn cancel(&mut self, ticket: Ticket) -> bool {
        self.waiting.remove(&ticket).is_some()
    }

    /// Returns a slot; follow with [`Dispatcher::dispatch`].
    pub fn release(&mut self, lease: Lease) {
        self.registry.release(lease);
    }

    /// Validates and applies an agent report; follow with `dispatch`.
    pub fn report(
        &mut self,
        report: AgentReport,
        now: Instant,
    ) -> Result<ReportOutcome, ReportError> {
        let addr: SocketAddr = report.validate()?;
        Ok(self.registry.apply_report(report, addr, now))
    }

    /// Removes an agent; `false` if it was not registered.
    pub fn deregister(&mut self, agent_id: &str) -> bool {
        self.registry.deregister(agent_id)
    }

    /// Drops agents that missed three reports; returns their ids.
    pub fn drop_stale(&mut self, now: Instant) -> Vec<String> {
        self.registry.drop_stale(now)
    }

    /// When the next agent turns stale, for the balancer's housekeeping timer.
    pub fn next_stale_deadline(&self) -> Option<Instant> {
        self.registry.next_stale_deadline()
    }

    pub fn buffered(&self) -> usize {
        self.waiting.len()
    }

    pub fn in_flight(&self) -> u64 {
        self.registry.total_in_flight()
    }

    pub fn endpoints(&self, now: Instant) -> Vec<EndpointSnapshot> {
        self.registry.snapshot(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::tests::report;

    const MS: Duration = Duration::from_millis(1);

    fn dispatcher(max: usize) -> Dispatcher<&'static str> {
        Dispatcher::new(BufferConfig {
            max_buffered: max,
            timeout: Duration::from_secs(10),
        })
    }

    fn queued(a: Admission) -> Ticket {
        match a {
            Admission::Queued { ticket, .. } => ticket,
            other => panic!("expected Queued, got {other:?}"),
        }
    }

    fn ready(a: Admission) -> Lease {
        match a {
            Admission::Ready(l) => l,
            other => panic!("expected Ready, got {other:?}"),
        }
    }

    #[test]
    fn requests_wait_when_no_agent_exists_and_run_once_one_registers() {
        let t0 = Instant::now();
        let mut d = dispatcher(30);
        let t1 = queued(d.submit("first", t0));
        let t2 = queued(d.submit("second", t0));
        assert!(t1 < t2);
        assert!(d.dispatch(t0).is_empty());
        d.report(report("a", "127.0.0.1:1", 4), t0 + MS).unwrap();
        let grants = d.dispatch(t0 + MS);
        let order: Vec<_> = grants.iter().map(|g| g.waiter).collect();
        assert_eq!(order, ["first", "second"]);
        assert_eq!(grants[0].waited, MS);
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn fifo_order_and_exactly_one_wakeup_per_freed_slot() {
        let t0 = Instant::now();
        let mut d = dispatcher(30);
        d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
        let running = ready(d.submit("running", t0));
        for name in ["w1", "w2", "w3"] {
            queued(d.submit(name, t0));
        }
        d.release(running);
        let g = d.dispatch(t0);
        assert_eq!(g.len(), 1, "one slot, one wake-up");
        assert_eq!(g[0].waiter, "w1");
        d.release(g.into_iter().next().unwrap().lease);
        let g = d.dispatch(t0);
        assert_eq!(g.iter().map(|g| g.waiter).collect::<Vec<_>>(), ["w2"]);
    }

    #[test]
    fn newcomers_do_not_overtake_waiters() {
        let t0 = Instant::now();
        let mut d = dispatcher(30);
        queued(d.submit("old", t0));
        d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
        // A slot is free but "old" has not been dispatched yet.
        queued(d.submit("new", t0));
        let g = d.dispatch(t0);
        assert_eq!(g.iter().map(|g| g.waiter).collect::<Vec<_>>(), ["old"]);
    }

    #[test]
    fn full_buffer_rejects_and_zero_disables_buffering() {
        let t0 = Instant::now();
        let mut d = dispatcher(2);
        queued(d.submit("a", t0));
        queued(d.submit("b", t0));
        assert!(matches!(
            d.submit("c", t0),
            Admission::Rejected(Reject::BufferFull)
        ));

        let mut d = dispatcher(0);
        assert!(matches!(
            d.submit("x", t0),
            Admission::Rejected(Reject::NoEndpoints)
        ));
        d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
        let _lease = ready(d.submit("x", t0));
        assert!(matches!(
            d.submit("y", t0),
            Admission::Rejected(Reject::BufferFull)
        ));
    }

    #[test]
    fn dispatch_drops_expired_waiters_and_serves_the_ones_behind() {
        let t0 = Instant::now();
        let mut d = dispatcher(30);
        let old = queued(d.submit("old", t0));
        let young = queued(d.submit("young", t0 + Duration::from_secs(5)));
        let due = t0 + Duration::from_secs(10);
        d.report(report("a", "127.0.0.1:1", 1), due).unwrap();
        let g = d.dispatch(due);
        assert_eq!(g.iter().map(|g| g.waiter).collect::<Vec<_>>(), ["young"]);
        assert_eq!(g[0].ticket, young);
        assert!(!d.cancel(old), "the expired waiter was removed");
    }

    #[test]
    fn cancelled_waiters_leave_at_once_and_take_nothing() {
        let t0 = Instant::now();
        let mut d = dispatcher(30);
        let gone = queued(d.submit("gone", t0));
        queued(d.submit("stays", t0));
        assert!(d.cancel(gone));
        assert!(!d.cancel(gone));
        d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
        let g = d.dispatch(t0);
        assert_eq!(g.iter().map(|g| g.waiter).collect::<Vec<_>>(), ["stays"]);
        assert_eq!(d.in_flight(), 1);
    }

    #[test]
    fn a_granted_waiter_cannot_be_cancelled_so_its_lease_must_be_released() {
        let t0 = Instant::now();
        let mut d = dispatcher(30);
        let t = queued(d.submit("w", t0));
        d.report(report("a", "127.0.0.1:1", 1), t0).unwrap();
        let g = d.dispatch(t0).pop().unwrap();
        assert!(!d.cancel(t));
        d.release(g.lease);
        assert_eq!(d.in_flight(), 0);
    }

    #[test]
    fn bad_reports_are_refused_and_change_nothing() {
        let t0 = Instant::now();
        let mut d = dispatcher(30);
        let mut r = report("a", "127.0.0.1:1", 1);
        r.slots_busy = 9;
        assert!(d.report(r, t0).is_err());
        assert!(d.endpoints(t0).is_empty());
    }
}
