//! Flow-control hot path: one enqueue plus one dispatch decision with
//! 10,000 requests queued across 1,000 flows, for each fairness and ordering
//! policy. Run with `cargo bench -p flowgate --bench flow_control`.
//!
//! Each step is what the balancer does per request at saturation: a slot is
//! released, a new request is submitted (it queues: every endpoint is busy),
//! and `dispatch` picks the next request and binds it to the freed slot. The
//! queue stays at 10,000. Steps are timed in batches of 1,000; the report
//! gives the median and p99 of the per-step mean over 200 batches, next to a
//! baseline in the same run: the same step with a single flow and FCFS.
//! Every request names the model. The last rows add what scheduling costs
//! on top: requests carry 16 prompt blocks (a 4 KiB prompt: 12 blocks shared
//! by the tenant, 4 its own) that the chosen endpoint's prefix index
//! records.

use std::hint::black_box;
use std::time::{Duration, Instant};

use flowgate::{
    Dispatcher, DispatcherConfig, FairnessPolicy, FlowKey, Lease, OrderingPolicy, RequestMeta,
    Route,
};

mod support;
use std::sync::Arc;

const QUEUED: usize = 10_000;
const BATCH: usize = 1_000;
const BATCHES: usize = 200;
const ENDPOINTS: u32 = 8;
const SLOTS: u32 = 8;

/// Median and p99 nanoseconds per step.
fn run(
    flows: u32,
    fairness: FairnessPolicy,
    ordering: OrderingPolicy,
    prefix_blocks: u64,
) -> (f64, f64) {
    let mut config = DispatcherConfig::default();
    config.flow.max_requests = QUEUED + 1;
    config.flow.max_bytes = u64::MAX;
    config.flow.default_band.fairness = fairness;
    config.flow.default_band.ordering = ordering;
    config.max_ttl = Duration::from_secs(3_600);
    let mut d: Dispatcher<u64> = Dispatcher::new(config);
    let now = Instant::now();
    for i in 0..ENDPOINTS {
        d.report(support::report(i, SLOTS), now).unwrap();
    }
    let keys: Vec<FlowKey> = (0..flows)
        .map(|f| FlowKey::new(format!("tenant-{f}"), 0))
        .collect();
    let model: Arc<str> = Arc::from("m");
    let request = |n: u64| {
        let tenant = n % u64::from(flows);
        RequestMeta {
            flow: keys[tenant as usize].clone(),
            bytes: 1_024,
            // Varied deadlines so EDF has something to order.
            ttl: Some(Duration::from_millis(60_000 + (n * 7_919) % 60_000)),
            route: Route {
                model: Some(Arc::clone(&model)),
                prefix: (0..prefix_blocks)
                    .map(|b| if b < 12 { tenant << 8 | b } else { n << 8 | b })
                    .collect(),
                ..Route::default()
            },
            weight: 1,
        }
    };
    let mut leases: Vec<Lease> = Vec::new();
    let mut n = 0u64;
    // Fill every slot, then the queues.
    while leases.len() < (ENDPOINTS * SLOTS) as usize {
        match d.submit(request(n), n, now) {
            flowgate::Admission::Ready(l) => leases.push(l),
            other => panic!("expected a free slot, got {other:?}"),
        }
        n += 1;
    }
    while d.buffered() < QUEUED {
        assert!(matches!(
            d.submit(request(n), n, now),
            flowgate::Admission::Queued { .. }
        ));
        n += 1;
    }
    let mut per_step = Vec::with_capacity(BATCHES);
    for _ in 0..BATCHES {
        let start = Instant::now();
        for _ in 0..BATCH {
            let lease = leases.pop().expect("a slot is busy");
            d.release(lease, now);
            let admission = d.submit(request(n), n, now);
            black_box(&admission);
            n += 1;
            let mut done = d.dispatch(now);
            let granted = done.pop().expect("the freed slot is granted");
            leases.push(granted.result.expect("granted"));
        }
        per_step.push(start.elapsed().as_nanos() as f64 / BATCH as f64);
    }
    assert_eq!(d.buffered(), QUEUED);
    per_step.sort_by(f64::total_cmp);
    (
        per_step[BATCHES / 2],
        per_step[(BATCHES as f64 * 0.99) as usize],
    )
}

fn main() {
    println!(
        "flow control: release + enqueue + dispatch, {QUEUED} queued, {ENDPOINTS} endpoints x \
         {SLOTS} slots, {BATCHES} batches of {BATCH} steps"
    );
    let (baseline, _) = run(1, FairnessPolicy::GlobalStrict, OrderingPolicy::Fcfs, 0);
    println!(
        "{:<40} {:>10} {:>10} {:>8}",
        "case", "median ns", "p99 ns", "ratio"
    );
    println!(
        "{:<40} {:>10.0} {:>10} {:>8}",
        "baseline: 1 flow, global-strict, fcfs", baseline, "", "1.00"
    );
    for fairness in [FairnessPolicy::RoundRobin, FairnessPolicy::GlobalStrict] {
        for ordering in [OrderingPolicy::Fcfs, OrderingPolicy::Edf] {
            let (median, p99) = run(1_000, fairness, ordering, 0);
            println!(
                "{:<40} {:>10.0} {:>10.0} {:>8.2}",
                format!("1000 flows, {fairness}, {ordering}"),
                median,
                p99,
                median / baseline
            );
        }
    }
    for fairness in [FairnessPolicy::RoundRobin, FairnessPolicy::GlobalStrict] {
        let (median, p99) = run(1_000, fairness, OrderingPolicy::Fcfs, 16);
        println!(
            "{:<40} {:>10.0} {:>10.0} {:>8.2}",
            format!("+ prefix index: {fairness}, 16 blocks"),
            median,
            p99,
            median / baseline
        );
    }
}
