//! One test suite for both stores: each behaviour is a function over a
//! [`Harness`] that opens stores of one backend, run against the embedded
//! store (a fresh folder per test) and against Redis (a fresh
//! `redis-server` per test, which `scripts/test` installs). Where the two
//! differ by design, the harness says so and the test checks each side.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{EmbeddedStore, JobStore, RedisStore};
use crate::asyncq::job::{
    Answer, DeadLetter, NewJob, QueueConfig, Reclaimed, Result, Status, StoreError,
};

/// Opens stores of one backend, all over the same data.
pub(super) trait Harness {
    fn open(&self, config: QueueConfig) -> Result<Box<dyn JobStore>>;
    /// A harness over other, empty data.
    fn another(&self) -> Self;
    /// A request delivered again keeps its place (embedded), or goes to
    /// the back of its priority (Redis).
    fn retry_keeps_place(&self) -> bool;
    /// `Counts::oldest_queued_ms` is kept (embedded; Redis leaves it out).
    fn tracks_oldest_queued(&self) -> bool;
    /// Leases run out and finished requests age out by the `now_ms` the
    /// caller passes (embedded), or by the server's own clock (Redis: the
    /// integration tests cover those with real time).
    fn times_by_caller_clock(&self) -> bool;
}

/// The embedded store in a folder of its own, removed at the end.
pub(super) struct Embedded(std::path::PathBuf);

impl Embedded {
    pub(super) fn new(name: &str) -> Self {
        Embedded(std::env::temp_dir().join(format!("flowgate-store-{}-{name}", std::process::id())))
    }
}

impl Drop for Embedded {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Harness for Embedded {
    fn open(&self, config: QueueConfig) -> Result<Box<dyn JobStore>> {
        Ok(Box::new(EmbeddedStore::open(&self.0, config)?))
    }
    fn another(&self) -> Self {
        Embedded(self.0.with_extension("another"))
    }
    fn retry_keeps_place(&self) -> bool {
        true
    }
    fn tracks_oldest_queued(&self) -> bool {
        true
    }
    fn times_by_caller_clock(&self) -> bool {
        true
    }
}

/// A redis-server of its own on a free port, killed at the end.
pub(super) struct Redis {
    child: Child,
    url: String,
}

impl Redis {
    /// Another test's server may take the port picked between the pick and
    /// the bind: then this one exits and another port is tried. The server
    /// counts as up once the one on the port names this process.
    pub(super) fn start() -> Self {
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let mut child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server (Debian's redis-server package; scripts/test installs it)");
            let url = format!("redis://127.0.0.1:{port}/0");
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while std::time::Instant::now() < deadline {
                if child.try_wait().ok().flatten().is_some() {
                    break;
                }
                if names_process(&url, child.id()) {
                    return Redis { child, url };
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("redis-server did not start on any of 5 ports");
    }
}

/// Whether the Redis at `url` is the process `pid`.
fn names_process(url: &str, pid: u32) -> bool {
    let info = ::redis::Client::open(url)
        .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(500)))
        .and_then(|mut c| ::redis::cmd("INFO").arg("server").query::<String>(&mut c));
    info.is_ok_and(|i| i.contains(&format!("process_id:{pid}\r\n")))
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Harness for Redis {
    fn open(&self, config: QueueConfig) -> Result<Box<dyn JobStore>> {
        Ok(Box::new(RedisStore::open(
            &self.url,
            config,
            "test".into(),
        )?))
    }
    fn another(&self) -> Self {
        Redis::start()
    }
    fn retry_keeps_place(&self) -> bool {
        false
    }
    fn tracks_oldest_queued(&self) -> bool {
        false
    }
    fn times_by_caller_clock(&self) -> bool {
        false
    }
}

/// Runs every behaviour below against one backend.
macro_rules! run_suite {
    ($backend:ident, $harness:expr) => {
        mod $backend {
            use super::*;
            run_suite!(@tests $harness;
                requests_survive_a_reopen_and_come_out_in_order,
                an_idempotency_key_gives_the_same_request,
                limits_refuse_or_evict,
                lost_leases_are_delivered_again_then_dead_lettered,
                cancel_expiry_and_retention,
                higher_priority_requests_are_leased_first,
                the_results_feed_lists_finished_requests_in_finish_order,
                a_request_queued_again_after_its_deadline_expires,
                a_retry_keeps_its_place_or_goes_to_the_back,
                blobs_are_kept_listed_and_deleted,
            );
        }
    };
    (@tests $harness:expr; $($name:ident,)*) => {
        $(
            #[test]
            fn $name() {
                #[allow(clippy::redundant_closure_call)]
                let h = ($harness)(stringify!($name));
                super::$name(&h);
            }
        )*
    };
}

run_suite!(embedded, Embedded::new);
run_suite!(redis, |_: &str| Redis::start());

fn new_job(body: &str) -> NewJob {
    NewJob {
        path: "/v1/chat/completions".into(),
        body: body.into(),
        fairness_id: "t".into(),
        ..NewJob::default()
    }
}

/// The ids `store.lease(n, now_ms)` hands out, in order.
fn leased_ids(store: &dyn JobStore, n: usize, now_ms: u64) -> Vec<String> {
    let leased = store.lease(n, now_ms).unwrap();
    leased.into_iter().map(|j| j.id).collect()
}

fn ok(status: u16) -> Answer {
    Answer {
        status,
        body: "{}".into(),
    }
}

pub(super) fn requests_survive_a_reopen_and_come_out_in_order(h: &impl Harness) {
    {
        let store = h.open(QueueConfig::default()).unwrap();
        for i in 0..3 {
            store
                .submit(new_job(&format!("{i}")), format!("id{i}"), 1)
                .unwrap();
        }
        let leased = store.lease(1, 2).unwrap();
        assert_eq!(leased[0].id, "id0");
        assert_eq!(leased[0].status, Status::Dispatched);
    }
    let store = h.open(QueueConfig::default()).unwrap();
    let c = store.counts().unwrap();
    assert_eq!((c.queued, c.dispatched), (2, 1));
    if h.tracks_oldest_queued() {
        assert_eq!(c.oldest_queued_ms, Some(1));
    }
    let ids = leased_ids(&*store, 5, 3);
    assert_eq!(ids, ["id1", "id2"]);
    let done = store.finish("id1", 1, ok(200), 4).unwrap().unwrap();
    assert_eq!(done.status, Status::Succeeded);
    assert_eq!(store.get("id1").unwrap().unwrap().answer, Some(ok(200)));
    assert_eq!(
        store.finish("id2", 1, ok(400), 4).unwrap().unwrap().status,
        Status::Failed
    );
}

pub(super) fn an_idempotency_key_gives_the_same_request(h: &impl Harness) {
    let store = h.open(QueueConfig::default()).unwrap();
    let mut job = new_job("a");
    job.idempotency_key = Some("k".into());
    let (first, created) = store.submit(job.clone(), "id1".into(), 1).unwrap();
    assert!(created);
    let (again, created) = store.submit(job, "id2".into(), 2).unwrap();
    assert!(!created);
    assert_eq!(again.id, first.id);
    assert_eq!(store.counts().unwrap().queued, 1);
}

pub(super) fn limits_refuse_or_evict(h: &impl Harness) {
    let config = QueueConfig {
        max_length: 2,
        max_payload_bytes: 4,
        ..QueueConfig::default()
    };
    let store = h.open(config.clone()).unwrap();
    assert!(matches!(
        store.submit(new_job("12345"), "big".into(), 1),
        Err(StoreError::TooLarge(4))
    ));
    store.submit(new_job("a"), "a".into(), 1).unwrap();
    store.submit(new_job("b"), "b".into(), 1).unwrap();
    assert!(matches!(
        store.submit(new_job("c"), "c".into(), 1),
        Err(StoreError::Full(2))
    ));
    drop(store);
    let store = h
        .open(QueueConfig {
            auto_evict: true,
            ..config
        })
        .unwrap();
    store.submit(new_job("c"), "c".into(), 2).unwrap();
    assert_eq!(store.get("a").unwrap().unwrap().status, Status::Evicted);
    let ids = leased_ids(&*store, 5, 3);
    assert_eq!(ids, ["b", "c"]);
}

pub(super) fn lost_leases_are_delivered_again_then_dead_lettered(h: &impl Harness) {
    let config = QueueConfig {
        max_delivery: 2,
        max_idle: Duration::from_millis(100),
        ..QueueConfig::default()
    };
    if h.times_by_caller_clock() {
        let store = h.open(config.clone()).unwrap();
        store.submit(new_job("a"), "a".into(), 0).unwrap();
        store.lease(1, 0).unwrap();
        assert_eq!(
            store.reclaim(99).unwrap(),
            Reclaimed::default(),
            "lease still held"
        );
        let r = store.reclaim(100).unwrap();
        assert_eq!(r.redelivered, ["a"]);
        // The late answer of the lost delivery is ignored.
        assert_eq!(store.finish("a", 1, ok(200), 101).unwrap(), None);
        let again = store.lease(1, 200).unwrap();
        assert_eq!(again[0].attempts, 2);
        let r = store.reclaim(300).unwrap();
        assert_eq!(r.dead_lettered, ["a"]);
        assert_eq!(
            store.get("a").unwrap().unwrap().status,
            Status::DeadLettered
        );
    }

    // `rear`: back at the end with a fresh count.
    let h2 = h.another();
    let rear = h2
        .open(QueueConfig {
            dead_letter: DeadLetter::Rear,
            ..config
        })
        .unwrap();
    rear.submit(new_job("x"), "x".into(), 0).unwrap();
    let x = rear.lease(1, 0).unwrap();
    rear.retry("x", x[0].attempts, "500", true, 1).unwrap();
    let x = rear.lease(1, 2).unwrap();
    assert_eq!((x[0].id.as_str(), x[0].attempts), ("x", 2));
    let uncounted = rear.retry("x", 2, "429", false, 3).unwrap().unwrap();
    assert_eq!(uncounted.attempts, 1, "no room is not a failed delivery");
    let x = rear.lease(1, 3).unwrap();
    rear.submit(new_job("y"), "y".into(), 3).unwrap();
    let after = rear
        .retry("x", x[0].attempts, "500", true, 3)
        .unwrap()
        .unwrap();
    assert_eq!((after.status, after.attempts), (Status::Queued, 0));
    let ids = leased_ids(&*rear, 5, 4);
    assert_eq!(ids, ["y", "x"], "dead-lettered to the rear");
}

pub(super) fn a_retry_keeps_its_place_or_goes_to_the_back(h: &impl Harness) {
    let store = h.open(QueueConfig::default()).unwrap();
    store.submit(new_job("x"), "x".into(), 0).unwrap();
    store.submit(new_job("y"), "y".into(), 0).unwrap();
    store.lease(1, 0).unwrap();
    store.retry("x", 1, "500", true, 1).unwrap();
    let next = if h.retry_keeps_place() { "x" } else { "y" };
    assert_eq!(leased_ids(&*store, 1, 2), [next]);
}

pub(super) fn cancel_expiry_and_retention(h: &impl Harness) {
    let config = QueueConfig {
        retention: Duration::from_millis(1000),
        ..QueueConfig::default()
    };
    let store = h.open(config).unwrap();
    store.submit(new_job("a"), "a".into(), 0).unwrap();
    let mut late = new_job("b");
    late.deadline_ms = Some(50);
    late.idempotency_key = Some("kb".into());
    store.submit(late, "b".into(), 0).unwrap();
    assert_eq!(
        store.cancel("a", 10).unwrap().unwrap().status,
        Status::Cancelled
    );
    assert_eq!(store.reclaim(50).unwrap().expired, ["b"]);
    assert_eq!(store.get("b").unwrap().unwrap().status, Status::Expired);
    assert!(store.lease(5, 60).unwrap().is_empty());
    if !h.times_by_caller_clock() {
        return;
    }
    assert_eq!(store.reclaim(1000).unwrap().purged, 0);
    assert_eq!(store.reclaim(1049).unwrap().purged, 1, "a, finished at 10");
    assert_eq!(store.get("b").unwrap().unwrap().status, Status::Expired);
    assert_eq!(store.reclaim(1051).unwrap().purged, 1, "b, finished at 50");
    assert_eq!(store.get("a").unwrap(), None);
    // The key is free again.
    let mut again = new_job("b");
    again.idempotency_key = Some("kb".into());
    assert!(store.submit(again, "b2".into(), 1100).unwrap().1);
}

pub(super) fn higher_priority_requests_are_leased_first(h: &impl Harness) {
    let store = h.open(QueueConfig::default()).unwrap();
    for (id, priority) in [("low", -5), ("first", 0), ("high", 10), ("second", 0)] {
        let job = NewJob {
            priority,
            ..new_job(id)
        };
        store.submit(job, id.into(), 0).unwrap();
    }
    let order = leased_ids(&*store, 4, 1);
    assert_eq!(order, ["high", "first", "second", "low"]);
    // A retried request keeps its place among its priority.
    store.retry("first", 1, "500", true, 2).unwrap();
    store
        .submit(
            NewJob {
                priority: 0,
                ..new_job("third")
            },
            "third".into(),
            3,
        )
        .unwrap();
    let order = leased_ids(&*store, 4, 4);
    assert_eq!(order, ["first", "third"]);
}

pub(super) fn the_results_feed_lists_finished_requests_in_finish_order(h: &impl Harness) {
    let store = h.open(QueueConfig::default()).unwrap();
    for id in ["a", "b", "c"] {
        store.submit(new_job(id), id.into(), 0).unwrap();
    }
    store.lease(3, 1).unwrap();
    store.finish("c", 1, ok(200), 2).unwrap();
    store.finish("a", 1, ok(200), 2).unwrap();
    let feed = store.finished_since(None, 10).unwrap();
    let ids: Vec<_> = feed.iter().map(|(_, j)| j.id.as_str()).collect();
    assert_eq!(ids, ["c", "a"], "finish order, not id or time order");
    let cursor = feed[1].0.clone();
    assert!(store.finished_since(Some(&cursor), 10).unwrap().is_empty());
    store.finish("b", 1, ok(500), 3).unwrap();
    let more = store.finished_since(Some(&cursor), 10).unwrap();
    assert_eq!(more.len(), 1);
    assert_eq!(
        (more[0].1.id.as_str(), more[0].1.status),
        ("b", Status::Failed)
    );
    assert_eq!(store.finished_since(None, 1).unwrap().len(), 1, "limit");
    assert!(matches!(
        store.finished_since(Some("x"), 1),
        Err(StoreError::BadCursor)
    ));
}

pub(super) fn a_request_queued_again_after_its_deadline_expires(h: &impl Harness) {
    let store = h.open(QueueConfig::default()).unwrap();
    let mut job = new_job("a");
    job.deadline_ms = Some(100);
    store.submit(job, "a".into(), 0).unwrap();
    store.lease(1, 10).unwrap();
    // The deadline passes while it is under way: no expiry then.
    assert!(store.reclaim(150).unwrap().expired.is_empty());
    let retried = store.retry("a", 1, "500", true, 160).unwrap().unwrap();
    assert_eq!(retried.status, Status::Expired);
    assert!(store.lease(1, 170).unwrap().is_empty());
}

pub(super) fn blobs_are_kept_listed_and_deleted(h: &impl Harness) {
    let store = h.open(QueueConfig::default()).unwrap();
    assert_eq!(store.get_blob("file", "a").unwrap(), None);
    store.put_blob("file", "a", b"one").unwrap();
    store.put_blob("file", "b", b"two").unwrap();
    store.put_blob("batch", "a", b"other kind").unwrap();
    assert_eq!(
        store.get_blob("file", "a").unwrap().as_deref(),
        Some(&b"one"[..])
    );
    let mut ids = store.blob_ids("file").unwrap();
    ids.sort();
    assert_eq!(ids, ["a", "b"]);
    store.delete_blob("file", "a").unwrap();
    store.delete_blob("file", "never").unwrap();
    assert_eq!(store.get_blob("file", "a").unwrap(), None);
    assert_eq!(store.blob_ids("file").unwrap(), ["b"]);
    assert_eq!(store.blob_ids("batch").unwrap(), ["a"]);
}
