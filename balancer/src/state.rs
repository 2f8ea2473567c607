//! State shared by the proxy, the management API and housekeeping: the core
//! [`Dispatcher`] behind one mutex, plus metrics.
//!
//! Invariant that makes waiting race-free: grants are delivered to waiters
//! *while the lock is held*. So once a waiter, holding the lock, finds that
//! it is no longer in the buffer, its grant (or the closed channel that means
//! "expired") is already in its channel.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use flowgate::{Admission, AgentReport, BufferConfig, Dispatcher, Lease, Reject, ReportOutcome};
use tokio::sync::oneshot;

use crate::metrics::Metrics;

type Waker = oneshot::Sender<Lease>;

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
    fn with_dispatch<R>(&self, f: impl FnOnce(&mut Dispatcher<Waker>) -> R) -> R {
        let mut d = self.lock();
        let r = f(&mut d);
        Self::deliver(&mut d);
        r
    }

    /// Delivers grants under the lock; a lease whose waiter vanished (the
    /// receiver was dropped without cancelling) goes back into the pool.
    fn deliver(d: &mut Dispatcher<Waker>) {
        loop {
            let now = Instant::now();
            let grants = d.dispatch(now);
            if grants.is_empty() {
                return;
            }
            for g in grants {
                if let Err(lease) = g.waiter.send(g.lease) {
                    d.release(lease);
                }
            }
        }
    }

    fn release(&self, lease: Lease) {
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
        let guard = |lease| LeaseGuard {
            shared: Arc::clone(self),
            lease: Some(lease),
        };
        let (ticket, deadline) = match admission {
            Admission::Ready(lease) => return Ok((guard(lease), Duration::ZERO)),
            Admission::Rejected(r) => return Err(AdmitError::Rejected(r)),
            Admission::Queued { ticket, deadline } => (ticket, deadline),
        };
        self.metrics.buffered_total.inc();
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
            () = &mut client_gone => {
                let cancelled = self.lock().cancel(ticket);
                if !cancelled {
                    if let Ok(lease) = rx.try_recv() {
                        self.release(lease);
                    }
                }
                Err(AdmitError::ClientGone)
            }
        };
        let waited = start.elapsed();
        self.metrics.buffer_wait.observe(waited.as_secs_f64());
        outcome.map(|lease| (guard(lease), waited))
    }

    pub fn report(
        &self,
        report: AgentReport,
    ) -> Result<ReportOutcome, flowgate::protocol::ReportError> {
        self.with_dispatch(|d| d.report(report, Instant::now()))
    }

    pub fn deregister(&self, agent_id: &str) -> bool {
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

pub struct Snapshot {
    pub buffered: usize,
    pub in_flight: u64,
    pub endpoints: Vec<flowgate::EndpointSnapshot>,
    pub config: BufferConfig,
}
