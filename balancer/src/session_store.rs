//! Session bindings shared between balancers through Redis
//! (`scheduling.sessions.redisUrl`), so a conversation that a front load
//! balancer spreads over several balancers goes where its last turn went
//! whichever balancer it reaches, also after one of them moved it.
//!
//! A keyed turn looks its session up before it is admitted (one `GET`,
//! bounded to [`LOOKUP_TIMEOUT`]); what Redis names becomes the session's
//! binding on this balancer. Once the turn is served, where it went is
//! written back (`SET … PX idle timeout`, which also starts its idle time
//! again) by a task of its own, so no request waits for a write. A turn
//! of a conversation sent without a key does the same under the names of
//! its prompts ([`flowgate::turn`]): it looks up its previous turn's and
//! records its own. Redis is a hint, never a dependency: a lookup that fails or takes too long leaves the
//! balancer on its own bindings (counted in
//! `flowgate_session_store_errors_total`, and lookups skipped for
//! [`BACK_OFF`] after), and a write that fails or cannot be queued is
//! dropped. Keys are the sessions' hashes (tenant included), never the
//! keys clients sent.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus::{IntCounterVec, Opts};
use redis::aio::ConnectionManager;
use tokio::sync::mpsc;
use tracing::warn;

use flowgate::turn::{StoreKeys, TurnKeys};
use flowgate::Route;

use crate::gate::FleetGate;
use crate::observe::metrics::Metrics;

/// The longest a turn waits for its session's lookup.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_millis(50);
/// The longest one write may take.
const WRITE_TIMEOUT: Duration = Duration::from_millis(500);
/// Writes waiting for the writer task at most; more are dropped.
const PENDING_WRITES: usize = 4096;
/// After a failed call, lookups are skipped this long: a Redis that hangs
/// costs a turn [`LOOKUP_TIMEOUT`] at most once a second.
const BACK_OFF: Duration = Duration::from_secs(1);
/// At most one warning per this long.
const WARN_EVERY: Duration = Duration::from_secs(10);

pub struct SessionStore {
    client: redis::Client,
    /// Made on first use, on the runtime that serves requests; reconnects
    /// by itself.
    conn: tokio::sync::OnceCell<ConnectionManager>,
    writes: mpsc::Sender<(u64, SocketAddr)>,
    errors: IntCounterVec,
    /// No lookups before this (a recent failure).
    skip_until: Mutex<Option<Instant>>,
    last_warning: Mutex<Option<Instant>>,
}

fn key(session: u64) -> String {
    format!("flowgate:session:{session:016x}")
}

impl SessionStore {
    /// Checks that Redis answers (a clear error at start-up when it does
    /// not), and starts the writer task on the current runtime the first
    /// time a write is queued. Bindings expire after `idle_timeout`.
    pub fn new(
        url: &str,
        idle_timeout: Duration,
        metrics: &Metrics,
    ) -> Result<std::sync::Arc<SessionStore>, String> {
        let client =
            redis::Client::open(url).map_err(|e| format!("bad session Redis URL {url}: {e}"))?;
        client
            .get_connection_with_timeout(Duration::from_secs(5))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .map_err(|e| format!("cannot reach session Redis {url}: {e}"))?;
        let errors = IntCounterVec::new(
            Opts::new(
                "flowgate_session_store_errors_total",
                "Session Redis calls that failed or timed out: lookup (the turn went by this \
                 balancer's own bindings), write (the binding was not shared)",
            ),
            &["op"],
        )
        .expect("valid metric");
        metrics.register(Box::new(errors.clone()));
        let (writes, rx) = mpsc::channel(PENDING_WRITES);
        let store = std::sync::Arc::new(SessionStore {
            client,
            conn: tokio::sync::OnceCell::new(),
            writes,
            errors,
            skip_until: Mutex::new(None),
            last_warning: Mutex::new(None),
        });
        let writer = std::sync::Arc::downgrade(&store);
        std::thread::Builder::new()
            .name("session-store".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("session store runtime");
                rt.block_on(write_all(writer, rx, idle_timeout));
            })
            .map_err(|e| format!("session store thread: {e}"))?;
        Ok(store)
    }

    async fn connection(&self) -> Result<ConnectionManager, String> {
        let made = self.conn.get_or_try_init(|| async {
            tokio::time::timeout(
                Duration::from_secs(1),
                ConnectionManager::new(self.client.clone()),
            )
            .await
            .map_err(|_| "no connection within 1 s".to_string())?
            .map_err(|e| e.to_string())
        });
        made.await.cloned()
    }

    /// Where `session`'s last turn went, as the balancers wrote it; `None`
    /// when unknown, or when Redis does not answer within
    /// [`LOOKUP_TIMEOUT`].
    pub async fn endpoint(&self, session: u64) -> Option<SocketAddr> {
        let skip = *self.skip_until.lock().unwrap_or_else(|e| e.into_inner());
        if skip.is_some_and(|until| Instant::now() < until) {
            return None;
        }
        let lookup = async {
            let mut conn = self.connection().await?;
            redis::cmd("GET")
                .arg(key(session))
                .query_async::<Option<String>>(&mut conn)
                .await
                .map_err(|e| e.to_string())
        };
        match tokio::time::timeout(LOOKUP_TIMEOUT, lookup).await {
            Ok(Ok(found)) => found?.parse().ok(),
            Ok(Err(e)) => {
                self.failed("lookup", &e);
                None
            }
            Err(_) => {
                self.failed("lookup", "no answer in time");
                None
            }
        }
    }

    /// Before a request is placed, for every door: where another balancer
    /// sent its conversation last (its session's, or a keyless one's
    /// previous turn's: [`StoreKeys`]) becomes the conversation's binding
    /// on this balancer and the request's session, so it is placed as a
    /// bound session is. Returns the key to [`SessionStore::record`] where
    /// it went once served.
    pub async fn follow(
        &self,
        turn: Option<TurnKeys>,
        gate: &FleetGate,
        route: &mut Route,
    ) -> Option<u64> {
        let keys = StoreKeys::of(route.session, turn);
        if let Some(key) = keys.look_up {
            if let Some(addr) = self.endpoint(key).await {
                gate.bind_session(key, addr);
                // A keyless conversation's previous turn: followed softly.
                route.session_by_prompt = route.session.is_none();
                route.session = Some(key);
            }
        }
        keys.record
    }

    /// Shares that `session`'s turn went to `addr` (queued; dropped when
    /// too many wait).
    pub fn record(&self, session: u64, addr: SocketAddr) {
        if self.writes.try_send((session, addr)).is_err() {
            self.failed("write", "too many writes waiting");
        }
    }

    fn failed(&self, op: &str, why: &str) {
        self.errors.with_label_values(&[op]).inc();
        let now = Instant::now();
        *self.skip_until.lock().unwrap_or_else(|e| e.into_inner()) = Some(now + BACK_OFF);
        let mut last = self.last_warning.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|at| now.duration_since(at) >= WARN_EVERY) {
            *last = Some(now);
            warn!(
                op,
                "session Redis: {why} (counted in flowgate_session_store_errors_total)"
            );
        }
    }
}

/// The most writes sent in one pipeline.
const WRITES_PER_BATCH: usize = 256;

/// The writer task: every binding recorded since the last round trip,
/// one `SET` each, in order and in one pipeline (so writes keep up with
/// any request rate Redis can take, one round trip per batch).
async fn write_all(
    store: std::sync::Weak<SessionStore>,
    mut rx: mpsc::Receiver<(u64, SocketAddr)>,
    idle_timeout: Duration,
) {
    let ttl_ms = u64::try_from(idle_timeout.as_millis()).unwrap_or(u64::MAX);
    let mut batch = Vec::with_capacity(WRITES_PER_BATCH);
    while rx.recv_many(&mut batch, WRITES_PER_BATCH).await > 0 {
        let Some(store) = store.upgrade() else { return };
        let mut pipe = redis::pipe();
        for (session, addr) in batch.drain(..) {
            pipe.cmd("SET")
                .arg(key(session))
                .arg(addr.to_string())
                .arg("PX")
                .arg(ttl_ms)
                .ignore();
        }
        let write = async {
            let mut conn = store.connection().await?;
            pipe.query_async::<()>(&mut conn)
                .await
                .map_err(|e| e.to_string())
        };
        match tokio::time::timeout(WRITE_TIMEOUT, write).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => store.failed("write", &e),
            Err(_) => store.failed("write", "no answer in time"),
        }
    }
}
