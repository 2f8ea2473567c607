//! What counting a prompt's tokens in process costs the balancer per
//! request. Run with `cargo bench -p flowgate-tokenizer --bench next_turn`.
//!
//! A conversation grown turn by turn to about 32 KiB of text (8,192
//! tokens at the 4 bytes a token of a large vocabulary; more ids with the
//! golden files' 800-token vocabulary), its chat template rendered and its
//! text encoded, with the golden ChatML tokenizer:
//! - **next turn**: the conversation's next request (the body parsed, as
//!   the balancer parses it), everything but the answer and the new user
//!   turn (400 bytes) remembered from the request before (the issue's
//!   bar: ≤ 50 µs at 8k tokens, cached prefix);
//! - **same prompt again**: every piece remembered;
//! - **cold**: the whole prompt encoded, nothing remembered (done off the
//!   event loop by the balancer past 2 KiB).
//!
//! Medians of 200 runs each, on the balancer's allocator (mimalloc).

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use flowgate_tokenizer::{ModelTokenizer, Request, Tokens};
use serde_json::{json, Value};

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const WORDS: [&str; 16] = [
    "the", "water", "farm", "city", "tree", "learn", "study", "country", "answer", "school",
    "grow", "plant", "cover", "food", "thought", "cross",
];

fn turn(seed: usize, bytes: usize) -> String {
    let mut text = String::new();
    let mut i = seed;
    while text.len() < bytes {
        text.push_str(WORDS[i % WORDS.len()]);
        text.push(if i % 11 == 0 { '\n' } else { ' ' });
        i = i.wrapping_mul(31).wrapping_add(7);
    }
    text
}

/// A conversation of `turns` user/assistant pairs of about `bytes` each,
/// ending on a user turn.
fn conversation(turns: usize, bytes: usize) -> Vec<Value> {
    let mut messages = vec![json!({"role": "system", "content": "You answer briefly."})];
    for t in 0..turns {
        messages.push(json!({"role": "user", "content": turn(2 * t, bytes)}));
        messages.push(json!({"role": "assistant", "content": turn(2 * t + 1, bytes)}));
    }
    messages.push(json!({"role": "user", "content": turn(999, bytes)}));
    messages
}

fn median(mut runs: Vec<Duration>) -> Duration {
    runs.sort();
    runs[runs.len() / 2]
}

fn ids(t: &ModelTokenizer, body: &[u8]) -> usize {
    let request = Request::parse(body).expect("a request");
    match t.tokens(&request, usize::MAX).expect("supported") {
        Tokens::Ids(ids) => black_box(ids).len(),
        Tokens::TooMuchToEncode(_) => unreachable!(),
    }
}

fn main() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("golden/chatml");
    let load = Instant::now();
    let t = ModelTokenizer::from_dir(&dir).expect("the golden tokenizer");
    println!("load: {:?}", load.elapsed());
    let messages = conversation(16, 1_000);
    let before = serde_json::to_vec(&json!({"model": "m", "messages": messages})).unwrap();
    // The next request: the answer (new to the balancer) and a short
    // user turn added.
    let mut messages = messages;
    messages.push(json!({"role": "assistant", "content": turn(1_001, 300)}));
    messages.push(json!({"role": "user", "content": turn(1_002, 100)}));
    let body = json!({"model": "m", "messages": messages});
    let sent = serde_json::to_vec(&body).unwrap();
    let text_bytes: usize = messages
        .iter()
        .map(|m| m["content"].as_str().unwrap().len())
        .sum();
    let count = ids(&t, &sent);
    println!(
        "prompt: {} messages, {text_bytes} bytes of text, {count} ids",
        messages.len()
    );

    let cold: Vec<Duration> = (0..200)
        .map(|_| {
            let fresh = ModelTokenizer::from_dir(&dir).unwrap();
            let at = Instant::now();
            ids(&fresh, &sent);
            at.elapsed()
        })
        .collect();
    let next_turn: Vec<Duration> = (0..200)
        .map(|_| {
            let fresh = ModelTokenizer::from_dir(&dir).unwrap();
            ids(&fresh, &before);
            let at = Instant::now();
            ids(&fresh, &sent);
            at.elapsed()
        })
        .collect();
    let again: Vec<Duration> = (0..200)
        .map(|_| {
            let at = Instant::now();
            ids(&t, &sent);
            at.elapsed()
        })
        .collect();
    let request = Request::parse(&sent).unwrap();
    let render: Vec<Duration> = (0..200)
        .map(|_| {
            let at = Instant::now();
            black_box(t.render(&request).unwrap());
            at.elapsed()
        })
        .collect();
    println!("cold (nothing remembered): {:?}", median(cold));
    println!(
        "next turn (body parsed, 400 new bytes encoded, the rest remembered): {:?}",
        median(next_turn)
    );
    println!("same prompt again: {:?}", median(again));
    println!("of which rendering the template: {:?}", median(render));
}
