//! LoRA adapters, served as vLLM serves them: a request names an adapter
//! as its `model`; the engine holds at most `--max-loras` adapters loaded
//! at once, and one that is not loaded is loaded first (`--lora-load-ms`,
//! its requests waiting), evicting the least recently used adapter that no
//! request runs on. When every loaded adapter has requests running, a
//! request for another waits (vLLM's `waiting_lora_adapters`).
//!
//! Requests for the same adapter that arrive while it loads share the one
//! load. Loads and evictions are counted for `/sim/stats`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Residency {
    Loading,
    Loaded,
}

#[derive(Debug, Default)]
struct State {
    /// Adapters this server can serve (by name).
    servable: BTreeMap<String, ()>,
    /// Loaded or loading adapters, least recently used first.
    resident: VecDeque<(String, Residency)>,
    /// Requests running, per adapter.
    running: BTreeMap<String, u32>,
    /// Requests waiting for room to load their adapter, per adapter.
    waiting: BTreeMap<String, u32>,
    loads: u64,
    evictions: u64,
    /// Adapters added by `POST /v1/load_lora_adapter`.
    registrations: u64,
}

/// One server's adapters.
#[derive(Debug)]
pub(crate) struct Adapters {
    state: Mutex<State>,
    changed: Notify,
    max_loaded: usize,
    load_time: Duration,
}

/// An adapter's request while it runs: counted in `running` until dropped.
pub(crate) struct Running {
    adapters: Arc<Adapters>,
    name: String,
}

impl Drop for Running {
    fn drop(&mut self) {
        uncount(&mut self.adapters.lock().running, &self.name);
        // An adapter with nothing running may now be evicted.
        self.adapters.changed.notify_waiters();
    }
}

/// What `/metrics` and `/sim/stats` show of the adapters.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub(crate) servable: Vec<String>,
    pub(crate) loaded: Vec<String>,
    pub(crate) running: Vec<String>,
    pub(crate) waiting: Vec<String>,
    pub(crate) loads: u64,
    pub(crate) evictions: u64,
    pub(crate) registrations: u64,
}

impl Adapters {
    pub(crate) fn new(servable: &[String], max_loaded: u32, load_time: Duration) -> Self {
        let state = State {
            servable: servable.iter().map(|n| (n.clone(), ())).collect(),
            ..State::default()
        };
        Adapters {
            state: Mutex::new(state),
            changed: Notify::new(),
            max_loaded: max_loaded.max(1) as usize,
            load_time,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `name` is an adapter this server serves.
    pub(crate) fn serves(&self, name: &str) -> bool {
        self.lock().servable.contains_key(name)
    }

    /// Adds an adapter it can serve (`POST /v1/load_lora_adapter`): false
    /// when it already serves it.
    pub(crate) fn add(&self, name: &str) -> bool {
        let mut st = self.lock();
        let added = st.servable.insert(name.to_string(), ()).is_none();
        st.registrations += u64::from(added);
        added
    }

    /// Stops serving an adapter (`POST /v1/unload_lora_adapter`): false
    /// when it did not serve it. A loaded one is unloaded.
    pub(crate) fn remove(&self, name: &str) -> bool {
        let mut st = self.lock();
        st.resident.retain(|(n, _)| n != name);
        st.servable.remove(name).is_some()
    }

    /// Waits until `name` is loaded (loading it, once, if need be) and
    /// counts a request running on it until the guard is dropped.
    pub(crate) async fn run(self: &Arc<Self>, name: &str) -> Running {
        let mut counted_waiting = false;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let load = {
                let mut st = self.lock();
                let at = st.resident.iter().position(|(n, _)| n == name);
                match at.map(|i| (i, st.resident[i].1)) {
                    Some((i, Residency::Loaded)) => {
                        return self.start(&mut st, i, name, counted_waiting);
                    }
                    Some((_, Residency::Loading)) => false,
                    None => {
                        let room = st.resident.len() < self.max_loaded || evict(&mut st);
                        if room {
                            st.resident
                                .push_back((name.to_string(), Residency::Loading));
                            st.loads += 1;
                        } else if !counted_waiting {
                            counted_waiting = true;
                            *st.waiting.entry(name.to_string()).or_default() += 1;
                        }
                        room
                    }
                }
            };
            if load {
                tokio::time::sleep(self.load_time).await;
                let mut st = self.lock();
                // Gone only if unloaded meanwhile: then it starts over.
                if let Some(i) = st.resident.iter().position(|(n, _)| n == name) {
                    st.resident[i].1 = Residency::Loaded;
                    let running = self.start(&mut st, i, name, counted_waiting);
                    drop(st);
                    self.changed.notify_waiters();
                    return running;
                }
            } else {
                changed.await;
            }
        }
    }

    /// Runs a request on the loaded adapter at `i` of the residents,
    /// which becomes the most recently used.
    fn start(
        self: &Arc<Self>,
        st: &mut State,
        i: usize,
        name: &str,
        counted_waiting: bool,
    ) -> Running {
        let entry = st.resident.remove(i).expect("a resident");
        st.resident.push_back(entry);
        *st.running.entry(name.to_string()).or_default() += 1;
        if counted_waiting {
            uncount(&mut st.waiting, name);
        }
        Running {
            adapters: Arc::clone(self),
            name: name.to_string(),
        }
    }

    pub(crate) fn snapshot(&self) -> Snapshot {
        let st = self.lock();
        Snapshot {
            servable: st.servable.keys().cloned().collect(),
            loaded: (st.resident.iter())
                .filter(|(_, r)| *r == Residency::Loaded)
                .map(|(n, _)| n.clone())
                .collect(),
            running: st.running.keys().cloned().collect(),
            waiting: st.waiting.keys().cloned().collect(),
            loads: st.loads,
            evictions: st.evictions,
            registrations: st.registrations,
        }
    }
}

fn uncount(counts: &mut BTreeMap<String, u32>, name: &str) {
    if let Some(n) = counts.get_mut(name) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            counts.remove(name);
        }
    }
}

/// Evicts the least recently used loaded adapter no request runs on;
/// false when there is none.
fn evict(st: &mut State) -> bool {
    let victim = st
        .resident
        .iter()
        .position(|(n, r)| *r == Residency::Loaded && !st.running.contains_key(n));
    match victim {
        Some(i) => {
            st.resident.remove(i);
            st.evictions += 1;
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn one_load_for_many_requests_and_the_least_recently_used_goes() {
        let a = Arc::new(Adapters::new(
            &names(&["x", "y", "z"]),
            2,
            Duration::from_millis(500),
        ));
        // Ten requests for x at once: one load.
        let runs: Vec<_> = (0..10)
            .map(|_| {
                let a = Arc::clone(&a);
                tokio::spawn(async move {
                    let _r = a.run("x").await;
                })
            })
            .collect();
        for r in runs {
            r.await.unwrap();
        }
        assert_eq!(a.snapshot().loads, 1);
        drop(a.run("y").await);
        // x is the least recently used of x, y: z evicts it.
        drop(a.run("z").await);
        let s = a.snapshot();
        assert_eq!((s.loads, s.evictions), (3, 1));
        assert_eq!(s.loaded, ["y", "z"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_waits_while_every_loaded_adapter_runs() {
        let a = Arc::new(Adapters::new(
            &names(&["x", "y"]),
            1,
            Duration::from_millis(100),
        ));
        let on_x = a.run("x").await;
        let waiter = {
            let a = Arc::clone(&a);
            tokio::spawn(async move {
                let _r = a.run("y").await;
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(a.snapshot().waiting, ["y"]);
        assert!(!waiter.is_finished());
        drop(on_x);
        waiter.await.unwrap();
        let s = a.snapshot();
        assert_eq!((s.loads, s.evictions), (2, 1));
        assert!(s.waiting.is_empty());
    }
}
