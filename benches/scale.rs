//! How the per-request scheduling cost grows with the fleet, the tenants
//! and the queue. Run with `cargo bench -p flowgate --bench scale`.
//!
//! Two steps are timed, each in batches of 1,000 (median and p99 of the
//! per-step mean over the batches):
//! - **saturated**: what the balancer does per request when every slot is
//!   busy: a slot is released, a new request is submitted (it queues) and
//!   `dispatch` binds the next queued request to the freed slot;
//! - **idle fleet**: a request is submitted while every endpoint has free
//!   slots (it is bound at once, the scorers choosing among all of them),
//!   then its slot is released — one client in front of a large fleet.
//!
//! The clock moves 100 µs per step (10,000 requests a second), so
//! requests held for the endpoint that caches their prompt are placed when
//! their hold ends. Each axis is varied alone from a base of 8 endpoints × 8 slots, 1,000
//! flows (round-robin) and 10,000 queued requests; each row's ratio is
//! against the smallest value of its axis, measured in the same run. A
//! counting allocator gives the heap held per queued request and per flow
//! at 100,000.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flowgate::{
    Admission, Dispatcher, DispatcherConfig, FairnessPolicy, FlowKey, Lease, OrderingPolicy,
    RequestMeta, Route,
};

mod support;

/// The system allocator, counting the bytes it holds.
struct Counting;

static HELD: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HELD.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HELD.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        HELD.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn held() -> isize {
    HELD.load(Ordering::Relaxed)
}

const BATCH: usize = 1_000;
const SLOTS: u32 = 8;

#[derive(Clone, Copy)]
struct Case {
    endpoints: u32,
    flows: u32,
    queued: usize,
    prefix_blocks: u64,
}

const BASE: Case = Case {
    endpoints: 8,
    flows: 1_000,
    queued: 10_000,
    prefix_blocks: 0,
};

struct Bench {
    dispatcher: Dispatcher<u64>,
    keys: Vec<FlowKey>,
    model: Arc<str>,
    case: Case,
    n: u64,
    now: Instant,
}

impl Bench {
    fn new(case: Case) -> Self {
        let mut config = DispatcherConfig::default();
        config.flow.max_requests = case.queued + 1;
        config.flow.max_bytes = u64::MAX;
        config.flow.default_band.fairness = FairnessPolicy::RoundRobin;
        config.flow.default_band.ordering = OrderingPolicy::Fcfs;
        config.max_ttl = Duration::from_secs(3_600);
        config.default_ttl = Duration::from_secs(3_600);
        let mut dispatcher: Dispatcher<u64> = Dispatcher::new(config);
        let now = Instant::now();
        for i in 0..case.endpoints {
            dispatcher.report(support::report(i, SLOTS), now).unwrap();
        }
        Bench {
            dispatcher,
            keys: (0..case.flows)
                .map(|f| FlowKey::new(format!("tenant-{f}"), 0))
                .collect(),
            model: Arc::from("m"),
            case,
            n: 0,
            now,
        }
    }

    fn request(&mut self) -> RequestMeta {
        let n = self.n;
        self.n += 1;
        let tenant = n % u64::from(self.case.flows);
        RequestMeta {
            flow: self.keys[tenant as usize].clone(),
            bytes: 1_024,
            ttl: None,
            route: Route {
                model: Some(Arc::clone(&self.model)),
                // 12 blocks shared by the tenant, the rest the request's own.
                prefix: (0..self.case.prefix_blocks)
                    .map(|b| if b < 12 { tenant << 8 | b } else { n << 8 | b })
                    .collect(),
                ..Route::default()
            },
            weight: 1,
        }
    }

    fn submit(&mut self) -> Admission {
        let request = self.request();
        let handle = self.n;
        self.dispatcher.submit(request, handle, self.now)
    }
}

/// Median and p99 of the per-step mean, in ns.
fn summarize(mut per_step: Vec<f64>) -> (f64, f64) {
    per_step.sort_by(f64::total_cmp);
    let n = per_step.len();
    (per_step[n / 2], per_step[(n as f64 * 0.99) as usize])
}

/// Every slot busy, `case.queued` waiting: release + submit + dispatch.
/// Also returns the heap held per queued request once the queue is full.
fn saturated(case: Case, batches: usize) -> ((f64, f64), f64) {
    let mut b = Bench::new(case);
    let mut leases: Vec<Lease> = Vec::new();
    while leases.len() < (case.endpoints * SLOTS) as usize {
        match b.submit() {
            Admission::Ready(l) => leases.push(l),
            other => panic!("expected a free slot, got {other:?}"),
        }
    }
    let fleet = held();
    while b.dispatcher.buffered() < case.queued {
        assert!(matches!(b.submit(), Admission::Queued { .. }));
    }
    let per_request = (held() - fleet) as f64 / case.queued as f64;
    let mut per_step = Vec::with_capacity(batches);
    for _ in 0..batches {
        let start = Instant::now();
        for _ in 0..BATCH {
            // 10,000 requests a second: affinity holds (200 ms) end.
            b.now += Duration::from_micros(100);
            let lease = leases.pop().expect("a slot is busy");
            b.dispatcher.release(lease, b.now);
            black_box(b.submit());
            let mut done = b.dispatcher.dispatch(b.now);
            let granted = done.pop().expect("the freed slot is granted");
            leases.push(granted.result.expect("granted"));
        }
        per_step.push(start.elapsed().as_nanos() as f64 / BATCH as f64);
    }
    assert_eq!(b.dispatcher.buffered(), case.queued);
    (summarize(per_step), per_request)
}

/// Every endpoint has free slots: submit (bound at once) + release.
fn idle_fleet(case: Case, batches: usize) -> (f64, f64) {
    let mut b = Bench::new(case);
    let mut per_step = Vec::with_capacity(batches);
    for _ in 0..batches {
        let start = Instant::now();
        for _ in 0..BATCH {
            match b.submit() {
                Admission::Ready(lease) => b.dispatcher.release(lease, b.now),
                other => panic!("expected a free slot, got {other:?}"),
            }
        }
        per_step.push(start.elapsed().as_nanos() as f64 / BATCH as f64);
    }
    summarize(per_step)
}

fn row(label: &str, (median, p99): (f64, f64), base: f64) {
    println!(
        "{label:<46} {median:>10.0} {p99:>10.0} {:>8.2}",
        median / base
    );
}

fn main() {
    // `cargo bench` passes `--bench`; a number sets the batches per case.
    let batches: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100);
    println!("scheduling cost at scale: {batches} batches of {BATCH} steps per case");
    println!(
        "{:<46} {:>10} {:>10} {:>8}",
        "case", "median ns", "p99 ns", "ratio"
    );

    let mut base = 0.0;
    for (i, endpoints) in [10, 100, 1_000].into_iter().enumerate() {
        let r = idle_fleet(Case { endpoints, ..BASE }, batches);
        if i == 0 {
            base = r.0;
        }
        row(&format!("idle fleet: {endpoints} endpoints"), r, base);
    }
    for (i, endpoints) in [10, 100, 1_000].into_iter().enumerate() {
        let (r, _) = saturated(Case { endpoints, ..BASE }, batches);
        if i == 0 {
            base = r.0;
        }
        row(&format!("saturated: {endpoints} endpoints"), r, base);
    }
    let mut memory = Vec::new();
    for (i, flows) in [10, 1_000, 100_000].into_iter().enumerate() {
        let case = Case {
            flows,
            queued: 100_000,
            ..BASE
        };
        let (r, per_request) = saturated(case, batches);
        if i == 0 {
            base = r.0;
        }
        memory.push((flows, per_request));
        row(&format!("saturated: {flows} flows, 100000 queued"), r, base);
    }
    for (i, queued) in [1_000, 10_000, 100_000].into_iter().enumerate() {
        let (r, _) = saturated(Case { queued, ..BASE }, batches);
        if i == 0 {
            base = r.0;
        }
        row(&format!("saturated: {queued} queued"), r, base);
    }
    for (i, endpoints) in [10, 1_000].into_iter().enumerate() {
        let case = Case {
            endpoints,
            prefix_blocks: 16,
            ..BASE
        };
        let r = idle_fleet(case, batches);
        if i == 0 {
            base = r.0;
        }
        row(
            &format!("idle fleet, 16 prefix blocks: {endpoints} endpoints"),
            r,
            base,
        );
    }
    for (i, endpoints) in [10, 1_000].into_iter().enumerate() {
        let case = Case {
            endpoints,
            prefix_blocks: 16,
            ..BASE
        };
        let (r, _) = saturated(case, batches);
        if i == 0 {
            base = r.0;
        }
        row(
            &format!("saturated, 16 prefix blocks: {endpoints} endpoints"),
            r,
            base,
        );
    }
    println!();
    println!("heap held per queued request (1 KiB bodies are the caller's, not counted):");
    for (flows, per_request) in memory {
        println!("  100000 queued over {flows:>6} flows: {per_request:>6.0} B per request");
    }
    println!(
        "  per flow at 100000 flows (one request each, minus the same requests in one flow): {:.0} B",
        memory_probe(100_000)
    );
}

/// Heap per flow: 100,000 requests in 100,000 flows minus 100,000 in one.
fn memory_probe(n: usize) -> f64 {
    let per = |flows: u32| {
        let mut b = Bench::new(Case {
            endpoints: 1,
            flows,
            queued: n,
            prefix_blocks: 0,
        });
        for _ in 0..SLOTS {
            assert!(matches!(b.submit(), Admission::Ready(_)));
        }
        let start = held();
        while b.dispatcher.buffered() < n {
            assert!(matches!(b.submit(), Admission::Queued { .. }));
        }
        (held() - start) as f64 / n as f64
    };
    per(n as u32) - per(1)
}
