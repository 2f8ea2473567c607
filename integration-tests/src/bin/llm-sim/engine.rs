//! What the simulated engine does that matters for scheduling:
//!
//! - Admission: a request runs when a slot is free and its tokens (prompt +
//!   output) fit in the KV capacity; otherwise it waits, first come first
//!   served (vLLM's and llama.cpp's waiting queue).
//! - Prefix cache: the server remembers the prompt blocks it prefilled
//!   (64-byte blocks, 16 tokens each, LRU); prefill costs only the tokens
//!   after the cached prefix.
//! - Decode slows down with batch size: each token takes
//!   `tpot × (1 + slowdown × (running − 1))`.
//!
//! Tokens are counted as prompt bytes / 4. Every knob defaults to off, so
//! the plain simulator behaves as before: slots only, fixed timings.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flowgate::prefix::PrefixLru;
use flowgate_integration_tests::sim_cache::{self, BLOCK_BYTES};
use tokio::sync::oneshot;

use crate::kv_events::{events_of, Publisher, SimEvent};

pub use sim_cache::BYTES_PER_TOKEN;

#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    pub slots: u32,
    /// KV capacity in tokens; 0: unlimited.
    pub kv_capacity_tokens: u64,
    /// Prefix cache capacity in tokens; 0: no cache.
    pub prefix_cache_tokens: u64,
    /// Prefill time per uncached prompt token.
    pub prefill_per_token: Duration,
    /// Decode slowdown per extra running request.
    pub decode_slowdown: f64,
}

#[derive(Debug, Default)]
struct State {
    running: u32,
    kv_used: u64,
    queue: VecDeque<Waiter>,
    next_waiter: u64,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    need: u64,
    tx: oneshot::Sender<()>,
}

pub struct Engine {
    config: EngineConfig,
    state: Mutex<State>,
    cache: Mutex<PrefixLru>,
    /// Where the cache's changes go as KV-cache events (`--kv-events-port`).
    events: Option<Arc<Publisher>>,
    pub prompt_tokens_total: AtomicU64,
    pub cached_tokens_total: AtomicU64,
}

/// A running request: holds its slot and KV tokens until dropped.
pub struct Running {
    engine: Arc<Engine>,
    need: u64,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.engine.release(self.need);
    }
}

/// A place in the queue. Dropped before its grant was taken (the client
/// left), it leaves the queue, or gives back a grant it never used. It owns
/// the receiver, so a grant is never sent to a waiter that is gone.
struct Queued<'a> {
    engine: &'a Engine,
    id: u64,
    need: u64,
    rx: oneshot::Receiver<()>,
    taken: bool,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        let mut st = self.engine.state.lock().unwrap();
        let before = st.queue.len();
        st.queue.retain(|w| w.id != self.id);
        let granted = st.queue.len() == before;
        drop(st);
        if granted {
            self.engine.release(self.need);
        }
    }
}

impl Engine {
    pub fn new(config: EngineConfig, events: Option<Arc<Publisher>>) -> Arc<Self> {
        let blocks = (config.prefix_cache_tokens * BYTES_PER_TOKEN) as usize / BLOCK_BYTES;
        Arc::new(Engine {
            config,
            state: Mutex::new(State::default()),
            cache: Mutex::new(PrefixLru::new(blocks)),
            events,
            prompt_tokens_total: AtomicU64::new(0),
            cached_tokens_total: AtomicU64::new(0),
        })
    }

    /// KV tokens a request holds while it runs (never more than the whole
    /// capacity, so every request can run alone).
    fn need(&self, tokens: u64) -> u64 {
        match self.config.kv_capacity_tokens {
            0 => tokens,
            cap => tokens.min(cap),
        }
    }

    fn fits(&self, st: &State, need: u64) -> bool {
        st.running < self.config.slots
            && (self.config.kv_capacity_tokens == 0
                || st.kv_used + need <= self.config.kv_capacity_tokens)
    }

    /// Runs at once if nothing waits and the request fits.
    pub fn try_admit(self: &Arc<Self>, tokens: u64) -> Option<Running> {
        let need = self.need(tokens);
        let mut st = self.state.lock().unwrap();
        if !st.queue.is_empty() || !self.fits(&st, need) {
            return None;
        }
        st.running += 1;
        st.kv_used += need;
        Some(Running {
            engine: Arc::clone(self),
            need,
        })
    }

    /// Waits in the queue until the request fits (FIFO).
    pub async fn admit(self: &Arc<Self>, tokens: u64) -> Running {
        if let Some(r) = self.try_admit(tokens) {
            return r;
        }
        let need = self.need(tokens);
        let (tx, rx) = oneshot::channel();
        let id = {
            let mut st = self.state.lock().unwrap();
            st.next_waiter += 1;
            let id = st.next_waiter;
            st.queue.push_back(Waiter { id, need, tx });
            id
        };
        let mut queued = Queued {
            engine: self,
            id,
            need,
            rx,
            taken: false,
        };
        // `release` counted us as running before it sent.
        (&mut queued.rx)
            .await
            .expect("a queued waiter is granted or removed");
        queued.taken = true;
        Running {
            engine: Arc::clone(self),
            need,
        }
    }

    fn release(&self, need: u64) {
        let mut st = self.state.lock().unwrap();
        st.running -= 1;
        st.kv_used -= need;
        while let Some(front) = st.queue.front() {
            if !self.fits(&st, front.need) {
                break;
            }
            let w = st.queue.pop_front().expect("front exists");
            st.running += 1;
            st.kv_used += w.need;
            // Cannot fail: the receiver lives in `Queued`, which takes the
            // waiter out of the queue before it lets the receiver go.
            let _ = w.tx.send(());
        }
    }

    pub fn running(&self) -> u32 {
        self.state.lock().unwrap().running
    }

    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        self.state.lock().unwrap().queue.len()
    }

    /// KV use 0..=1, when a capacity is set.
    pub fn kv_usage(&self) -> Option<f64> {
        let cap = self.config.kv_capacity_tokens;
        (cap > 0).then(|| self.state.lock().unwrap().kv_used as f64 / cap as f64)
    }

    /// Forgets every cached prompt (a restarted engine, or a cache reset:
    /// `AllBlocksCleared`).
    pub fn clear_cache(&self) {
        let mut cache = self.cache.lock().unwrap();
        *cache = PrefixLru::new(cache.capacity());
        if let Some(events) = &self.events {
            events.push(SimEvent::Cleared);
        }
    }

    /// Looks the prompt up in the prefix cache, then caches it. Returns the
    /// prompt tokens, the cached ones, and the extra prefill time.
    pub fn prefill(&self, prompt: &[u8]) -> (u64, u64, Duration) {
        let tokens = sim_cache::tokens(prompt.len());
        let cached = if self.config.prefix_cache_tokens > 0 {
            let blocks = sim_cache::blocks(prompt);
            let mut cache = self.cache.lock().unwrap();
            let matched = cache.matched(&blocks);
            match &self.events {
                None => cache.insert(&blocks),
                Some(events) => {
                    let mut stored = Vec::new();
                    let mut evicted = Vec::new();
                    cache.insert_tracked(&blocks, |h, holds| {
                        if holds {
                            stored.push(h);
                        } else {
                            evicted.push(h);
                        }
                    });
                    let stored: std::collections::HashSet<u64> = stored.into_iter().collect();
                    let new: Vec<bool> = blocks.iter().map(|h| stored.contains(h)).collect();
                    for e in events_of(prompt, &blocks, &new, evicted) {
                        events.push(e);
                    }
                }
            }
            sim_cache::cached_tokens(matched)
        } else {
            0
        };
        self.prompt_tokens_total
            .fetch_add(tokens, Ordering::Relaxed);
        self.cached_tokens_total
            .fetch_add(cached, Ordering::Relaxed);
        let uncached = tokens.saturating_sub(cached);
        let extra = self
            .config
            .prefill_per_token
            .saturating_mul(u32::try_from(uncached).unwrap_or(u32::MAX));
        (tokens, cached, extra)
    }

    /// Time for the next output token given the current batch.
    pub fn tpot(&self, base: Duration) -> Duration {
        if self.config.decode_slowdown <= 0.0 {
            return base;
        }
        let extra = f64::from(self.running().saturating_sub(1)) * self.config.decode_slowdown;
        base.mul_f64(1.0 + extra)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(slots: u32, kv: u64) -> Arc<Engine> {
        Engine::new(
            EngineConfig {
                slots,
                kv_capacity_tokens: kv,
                prefix_cache_tokens: 1_000,
                prefill_per_token: Duration::from_millis(1),
                decode_slowdown: 0.5,
            },
            None,
        )
    }

    #[tokio::test]
    async fn kv_capacity_holds_requests_back_in_arrival_order() {
        let e = engine(8, 100);
        let a = e.try_admit(60).unwrap();
        assert!(e.try_admit(50).is_none(), "does not fit");
        let e2 = Arc::clone(&e);
        let waiting = tokio::spawn(async move { e2.admit(50).await });
        while e.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        assert!(e.try_admit(10).is_none(), "nobody passes the queue");
        assert_eq!(e.kv_usage(), Some(0.6));
        drop(a);
        let b = waiting.await.unwrap();
        assert_eq!((e.running(), e.kv_usage()), (1, Some(0.5)));
        drop(b);
        assert_eq!(e.running(), 0);
        // A request larger than the cache still runs, alone.
        let huge = e.try_admit(1_000).unwrap();
        assert_eq!(e.kv_usage(), Some(1.0));
        drop(huge);
    }

    #[test]
    fn cached_prefixes_prefill_faster() {
        let e = engine(1, 0);
        let prompt = vec![b'a'; 640];
        let (tokens, cached, cold) = e.prefill(&prompt);
        assert_eq!((tokens, cached), (160, 0));
        assert_eq!(cold, Duration::from_millis(160));
        let mut longer = prompt.clone();
        longer.extend_from_slice(&[b'b'; 64]);
        let (tokens, cached, warm) = e.prefill(&longer);
        assert_eq!((tokens, cached), (176, 160));
        assert_eq!(warm, Duration::from_millis(16));
    }

    #[test]
    fn decode_slows_down_with_the_batch() {
        let e = engine(4, 0);
        let base = Duration::from_millis(10);
        let _one = e.try_admit(1).unwrap();
        assert_eq!(e.tpot(base), base);
        let _two = e.try_admit(1).unwrap();
        let _three = e.try_admit(1).unwrap();
        assert_eq!(e.tpot(base), Duration::from_millis(20));
    }
}
