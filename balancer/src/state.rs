//! State shared by the proxy, the management API and housekeeping: the core
//! [`Dispatcher`] behind one mutex, plus metrics.
//!
//! Invariant that makes waiting race-free: grants are delivered to waiters
//! *while the lock is held*. So once a waiter, holding the lock, finds that
//! it is no longer in the buffer, its grant (or the closed channel that means
//! "expired") is already in its channel.
//!
//! A grant travels as a [`LeaseGuard`], so a grant that nobody reads (its
//! waiter was dropped) still gives its slot back, and a waiter dropped while
//! queued leaves the buffer at once ([`QueuedTicket`]).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use flowgate::{Admission, AgentReport, BufferConfig, Dispatcher, Lease, Reject, ReportOutcome};
use tokio::sync::oneshot;

use crate::metrics::Metrics;

type Waker = oneshot::Sender<LeaseGuard>;

pub struct Shared {
    dispatcher: Mutex<Dispatcher<Waker>>,
    pub metrics: Metrics,
    shutting_down: AtomicBool,
}

/// Why a request did not get a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmitError {
    Rejected(Reject),
    /// The client disconnected while waiting.
    ClientGone,
}

/// A slot on one endpoint, given back exactly once: by [`LeaseGuard::release`]
/// or, if the request task is dropped, by `Drop`.
pub struct LeaseGuard {
    shared: Arc<Shared>,
    lease: Option<Lease>,
}

impl LeaseGuard {
    fn new(shared: &Arc<Shared>, lease: Lease) -> Self {
        LeaseGuard {
            shared: Arc::clone(shared),
            lease: Some(lease),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.lease.as_ref().expect("lease held until release").addr
    }

    pub fn release(mut self) {
        self.release_inner();
    }

    fn release_inner(&mut self) {
        if let Some(lease) = self.lease.take() {
            self.shared.release(lease);
        }
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.release_inner();
    }
}

impl Shared {
    pub fn new(config: BufferConfig) -> Arc<Self> {
        Arc::new(Shared {
            dispatcher: Mutex::new(Dispatcher::new(config)),
            metrics: Metrics::new(),
            shutting_down: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Dispatcher<Waker>> {
        // A panic while holding the lock cannot leave the dispatcher half
        // updated (its methods do not panic midway), so poisoning is ignored.
        self.dispatcher
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `f` on the dispatcher, then hands free slots to waiters.
    fn with_dispatch<R>(self: &Arc<Self>, f: impl FnOnce(&mut Dispatcher<Waker>) -> R) -> R {
        let mut d = self.lock();
        let r = f(&mut d);
        self.deliver(&mut d);
        r
    }

    /// Delivers grants under the lock; a lease whose waiter vanished (the
    /// receiver was dropped) goes straight back into the pool.
    fn deliver(self: &Arc<Self>, d: &mut Dispatcher<Waker>) {
        loop {
            let now = Instant::now();
            let grants = d.dispatch(now);
            if grants.is_empty() {
                return;
            }
            for g in grants {
                if let Err(mut unsent) = g.waiter.send(LeaseGuard::new(self, g.lease)) {
                    // Release under the lock we hold (the guard's own Drop
                    // would take it again).
                    if let Some(lease) = unsent.lease.take() {
                        d.release(lease);
                    }
                }
            }
        }
    }

    fn release(self: &Arc<Self>, lease: Lease) {
        self.with_dispatch(|d| d.release(lease));
    }

    /// Waits for a slot. Resolves when a slot is granted, the buffer refuses
    /// the request, its deadline passes, or `client_gone` resolves (then the
    /// request leaves the buffer at once and holds nothing).
    pub async fn admit(
        self: &Arc<Self>,
        client_gone: impl Future<Output = ()>,
    ) -> Result<(LeaseGuard, Duration), AdmitError> {
        let (tx, mut rx) = oneshot::channel();
        let start = Instant::now();
        let admission = self.lock().submit(tx, start);
        let (ticket, deadline) = match admission {
            Admission::Ready(lease) => return Ok((LeaseGuard::new(self, lease), Duration::ZERO)),
            Admission::Rejected(r) => return Err(AdmitError::Rejected(r)),
            Admission::Queued { ticket, deadline } => (ticket, deadline),
        };
        self.metrics.buffered_total.inc();
        // Leaves the buffer however this future ends, dropped included.
        let _queued = QueuedTicket {
            shared: self,
            ticket,
        };
        tokio::pin!(client_gone);
        let outcome = tokio::select! {
            granted = &mut rx => granted.map_err(|_| AdmitError::Rejected(Reject::Timeout)),
            () = tokio::time::sleep_until(deadline.into()) => {
                let cancelled = self.lock().cancel(ticket);
                if cancelled {
                    Err(AdmitError::Rejected(Reject::Timeout))
                } else {
                    // Granted (or dropped as expired) just before the timer fired.
                    rx.try_recv().map_err(|_| AdmitError::Rejected(Reject::Timeout))
                }
            }
            // A grant that raced with the disconnect is dropped with `rx`,
            // which releases its slot.
            () = &mut client_gone => Err(AdmitError::ClientGone),
        };
        let waited = start.elapsed();
        self.metrics.buffer_wait.observe(waited.as_secs_f64());
        outcome.map(|lease| (lease, waited))
    }

    pub fn report(
        self: &Arc<Self>,
        report: AgentReport,
    ) -> Result<ReportOutcome, flowgate::protocol::ReportError> {
        self.with_dispatch(|d| d.report(report, Instant::now()))
    }

    pub fn deregister(self: &Arc<Self>, agent_id: &str) -> bool {
        self.with_dispatch(|d| d.deregister(agent_id))
    }

    /// Drops stale agents; returns their ids and when to look again.
    pub fn drop_stale(&self) -> (Vec<String>, Option<Instant>) {
        let mut d = self.lock();
        let dropped = d.drop_stale(Instant::now());
        (dropped, d.next_stale_deadline())
    }

    /// Buffered and in-flight counts, and a view of every endpoint.
    pub fn snapshot(&self) -> Snapshot {
        let d = self.lock();
        Snapshot {
            buffered: d.buffered(),
            in_flight: d.in_flight(),
            endpoints: d.endpoints(Instant::now()),
            config: d.config(),
        }
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }
}

/// Removes a queued request from the buffer when its waiter ends, however
/// it ends (a no-op once it was granted or expired).
struct QueuedTicket<'a> {
    shared: &'a Shared,
    ticket: flowgate::Ticket,
}

impl Drop for QueuedTicket<'_> {
    fn drop(&mut self) {
        self.shared.lock().cancel(self.ticket);
    }
}

pub struct Snapshot {
    pub buffered: usize,
    pub in_flight: u64,
    pub endpoints: Vec<flowgate::EndpointSnapshot>,
    pub config: BufferConfig,
}

#[cfg(test)]
mod tests {
    use super::*;
    use flowgate::{BackendHealth, BackendKind, PROTOCOL_VERSION};

    fn shared_with_one_slot() -> Arc<Shared> {
        let shared = Shared::new(BufferConfig {
            max_buffered: 4,
            timeout: Duration::from_secs(10),
        });
        shared
            .report(AgentReport {
                protocol_version: PROTOCOL_VERSION,
                agent_id: "a".into(),
                name: "a".into(),
                backend: BackendKind::Llamacpp,
                external_addr: "127.0.0.1:1".into(),
                models: vec![],
                health: BackendHealth::Ready,
                slots_total: 1,
                slots_busy: 0,
                requests_waiting: 0,
                kv_cache_usage: None,
                monitoring_interval_ms: 1000,
                draining: false,
                last_error: None,
            })
            .unwrap();
        shared
    }

    /// Polls `fut` briefly so it enqueues itself, leaving it pending.
    async fn enqueue<F: Future>(fut: &mut std::pin::Pin<Box<F>>) {
        assert!(
            tokio::time::timeout(Duration::from_millis(20), fut.as_mut())
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn a_waiter_dropped_after_its_grant_gives_the_slot_back() {
        let shared = shared_with_one_slot();
        let (first, _) = shared.admit(std::future::pending()).await.unwrap();
        let mut waiting = Box::pin(shared.admit(std::future::pending()));
        enqueue(&mut waiting).await;
        assert_eq!(shared.snapshot().buffered, 1);
        first.release(); // the grant goes into the waiter's channel
        assert_eq!(shared.snapshot().in_flight, 1);
        drop(waiting); // ... and the waiter never reads it
        let snap = shared.snapshot();
        assert_eq!((snap.in_flight, snap.buffered), (0, 0));
    }

    #[tokio::test]
    async fn a_waiter_dropped_while_queued_leaves_the_buffer() {
        let shared = shared_with_one_slot();
        let (first, _) = shared.admit(std::future::pending()).await.unwrap();
        let mut waiting = Box::pin(shared.admit(std::future::pending()));
        enqueue(&mut waiting).await;
        drop(waiting);
        assert_eq!(shared.snapshot().buffered, 0);
        first.release();
        assert_eq!(shared.snapshot().in_flight, 0);
    }

    #[tokio::test]
    async fn a_client_gone_while_queued_takes_nothing() {
        let shared = shared_with_one_slot();
        let (first, _) = shared.admit(std::future::pending()).await.unwrap();
        let gone = shared.admit(async {}).await;
        assert_eq!(gone.err(), Some(AdmitError::ClientGone));
        let snap = shared.snapshot();
        assert_eq!((snap.in_flight, snap.buffered), (1, 0));
        first.release();
        assert_eq!(shared.snapshot().in_flight, 0);
    }
}
