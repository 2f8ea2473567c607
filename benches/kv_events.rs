//! What following an engine's KV-cache events costs the agent, and
//! matching a prompt the balancer. Run with `cargo bench -p flowgate
//! --bench kv_events`.
//!
//! - **intake**: batches of 64 events (BlockStored of one 16-token block
//!   chained to the one before, and every fourth event a BlockRemoved of
//!   an old block), msgpack-encoded as vLLM's tagged maps, decoded and
//!   applied to one engine's index and the endpoint's holdings: events a
//!   second on one core (the bar: 100,000).
//! - **index at a million blocks**: the heap held per block once the index
//!   holds 1,000,000 (the agent's default capacity), and by a balancer's
//!   copy of them, from a counting allocator; the snapshot's size.
//! - **match**: a prompt of 8,192 tokens (512 blocks of 16) keyed and
//!   matched against a copy holding it, per request (the balancer's cost
//!   with the tokens in hand).

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use flowgate::kv_events::key::prompt_keys;
use flowgate::kv_events::{decode_batch, BlocksCopy, EngineIndex, Holdings};
use rmpv::Value;

struct Counting;

static HELD: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HELD.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HELD.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const BLOCK: u64 = 16;

/// A tagged-map batch of `n` events from block number `first` on; with
/// `removals`, every fourth removes an old block instead.
fn batch(first: u64, n: u64, removals: bool) -> Vec<u8> {
    let s = |t: &str| Value::from(t);
    let events = (first..first + n)
        .map(|b| {
            if removals && b % 4 == 3 && b > 64 {
                Value::Map(vec![
                    (s("type"), s("BlockRemoved")),
                    (s("block_hashes"), Value::Array(vec![Value::from(b - 64)])),
                    (s("medium"), s("GPU")),
                ])
            } else {
                let parent = if b == 0 {
                    Value::Nil
                } else {
                    Value::from(b - 1)
                };
                let tokens = (0..BLOCK).map(|t| Value::from(b * BLOCK + t)).collect();
                Value::Map(vec![
                    (s("type"), s("BlockStored")),
                    (s("block_hashes"), Value::Array(vec![Value::from(b)])),
                    (s("parent_block_hash"), parent),
                    (s("token_ids"), Value::Array(tokens)),
                    (s("block_size"), Value::from(BLOCK)),
                    (s("medium"), s("GPU")),
                ])
            }
        })
        .collect();
    let batch = Value::Map(vec![
        (s("ts"), Value::F64(0.0)),
        (s("events"), Value::Array(events)),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

fn intake() {
    const PER_BATCH: u64 = 64;
    const BATCHES: u64 = 4_000;
    let frames: Vec<Vec<u8>> = (0..BATCHES)
        .map(|i| batch(i * PER_BATCH, PER_BATCH, true))
        .collect();
    let mut rates = Vec::new();
    for _ in 0..5 {
        let mut index = EngineIndex::new(1_000_000);
        let mut holdings = Holdings::new(1);
        let began = Instant::now();
        for (seq, frame) in frames.iter().enumerate() {
            let decoded = decode_batch(frame).unwrap();
            index.apply(seq as u64, &decoded, began, &mut |c| holdings.change(c));
        }
        let secs = began.elapsed().as_secs_f64();
        rates.push((BATCHES * PER_BATCH) as f64 / secs);
        black_box(holdings.version());
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "intake: {:.0} events/s median of 5 ({:.0}..{:.0}), decode + index + holdings, one core",
        rates[2], rates[0], rates[4]
    );
}

fn million() {
    let before = HELD.load(Ordering::Relaxed);
    let mut index = EngineIndex::new(1_000_000);
    let mut holdings = Holdings::new(1);
    let now = Instant::now();
    for (seq, first) in (0..1_000_000u64).step_by(1_000).enumerate() {
        let decoded = decode_batch(&batch(first, 1_000, false)).unwrap();
        index.apply(seq as u64, &decoded, now, &mut |c| holdings.change(c));
    }
    let held = HELD.load(Ordering::Relaxed) - before;
    println!(
        "a million blocks: {} held by the index, {:.0} bytes a block for index and holdings ({:.0} MB)",
        index.len(),
        held as f64 / index.len() as f64,
        held as f64 / 1e6
    );
    let update = holdings.since(None).unwrap();
    let before = HELD.load(Ordering::Relaxed);
    let copy = BlocksCopy::replaced(&update).unwrap();
    let held = HELD.load(Ordering::Relaxed) - before;
    println!(
        "a balancer's copy of them: {:.0} bytes a block ({:.0} MB); the snapshot sent: {:.0} MB",
        held as f64 / copy.len() as f64,
        held as f64 / 1e6,
        update.encode().len() as f64 / 1e6
    );
}

fn matching() {
    let tokens: Vec<u32> = (0..8_192).collect();
    let keys = prompt_keys(&tokens, 16, 8_192, |_| 0);
    let mut h = Holdings::new(1);
    for &k in &keys {
        h.change(flowgate::kv_events::Change::Stored(
            k,
            flowgate::kv_events::Medium::Gpu,
        ));
    }
    let copy = BlocksCopy::replaced(&h.since(None).unwrap()).unwrap();
    let rounds = 2_000;
    let began = Instant::now();
    for _ in 0..rounds {
        let keys = prompt_keys(black_box(&tokens), 16, 8_192, |_| 0);
        black_box(copy.matched(&keys));
    }
    let us = began.elapsed().as_secs_f64() * 1e6 / rounds as f64;
    println!(
        "match: {us:.1} µs to key and match a prompt of 8,192 tokens (512 blocks) on one copy"
    );
}

fn main() {
    intake();
    million();
    matching();
}
