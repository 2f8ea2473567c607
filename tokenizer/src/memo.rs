//! A bounded memo with no per-entry bookkeeping: values in a young and an
//! old generation, each holding up to a budget of weight (ids, bytes); a
//! value found in the old one moves to the young one, and when the young
//! one is full the old one is dropped. Keys are seeded 64-bit hashes — a
//! collision costs a request its prefix match, nothing more.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// What a value costs the memo's budget.
pub trait Weight {
    fn weight(&self) -> usize;
}

impl Weight for Box<[u32]> {
    fn weight(&self) -> usize {
        self.len()
    }
}

/// A memo: its generations behind a lock, and the seed of its keys.
pub struct Memo<V> {
    hasher: foldhash::quality::RandomState,
    generations: Mutex<Generations<V>>,
}

impl<V: Weight> Memo<V> {
    /// A memo holding up to `budget` weight in each generation.
    pub fn new(budget: usize) -> Self {
        Memo {
            hasher: Default::default(),
            generations: Mutex::new(Generations::new(budget)),
        }
    }

    /// The key of a value made from `of`.
    pub fn key(&self, of: impl Hash) -> u64 {
        self.hasher.hash_one(of)
    }

    pub fn lock(&self) -> MutexGuard<'_, Generations<V>> {
        self.generations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Lookups of one request, which take the lock once for all of them
    /// and let go of it only while a value not found is made: a
    /// conversation's next turn takes it a few times, not once a piece.
    pub fn held(&self) -> Held<'_, V> {
        Held {
            memo: self,
            guard: None,
        }
    }
}

/// See [`Memo::held`].
pub struct Held<'m, V> {
    memo: &'m Memo<V>,
    guard: Option<MutexGuard<'m, Generations<V>>>,
}

impl<V: Weight> Held<'_, V> {
    pub fn key(&self, of: impl Hash) -> u64 {
        self.memo.key(of)
    }

    pub fn get(&mut self, key: u64) -> Option<&V> {
        let memo = self.memo;
        self.guard.get_or_insert_with(|| memo.lock()).get(key)
    }

    /// Lets go of the lock, before a value not found is made.
    pub fn release(&mut self) {
        self.guard = None;
    }

    pub fn insert(&mut self, key: u64, v: V) {
        let memo = self.memo;
        self.guard.get_or_insert_with(|| memo.lock()).insert(key, v);
    }
}

pub struct Generations<V> {
    young: HashMap<u64, V, foldhash::fast::FixedState>,
    old: HashMap<u64, V, foldhash::fast::FixedState>,
    young_weight: usize,
    /// The most weight a generation holds.
    budget: usize,
}

impl<V: Weight> Generations<V> {
    pub fn new(budget: usize) -> Self {
        Generations {
            young: HashMap::default(),
            old: HashMap::default(),
            young_weight: 0,
            budget,
        }
    }

    pub fn get(&mut self, key: u64) -> Option<&V> {
        if !self.young.contains_key(&key) {
            let v = self.old.remove(&key)?;
            self.insert(key, v);
        }
        self.young.get(&key)
    }

    /// How many values are held.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.young.len() + self.old.len()
    }

    pub fn contains(&self, key: u64) -> bool {
        self.young.contains_key(&key) || self.old.contains_key(&key)
    }

    pub fn insert(&mut self, key: u64, v: V) {
        if self.young_weight + v.weight() > self.budget {
            self.old = std::mem::take(&mut self.young);
            self.young_weight = 0;
        }
        self.young_weight += v.weight();
        if let Some(before) = self.young.insert(key, v) {
            self.young_weight -= before.weight();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_held_stays_within_two_generations_and_a_used_value_survives() {
        let budget = 1 << 20;
        let mut g = Generations::new(budget);
        let piece = budget / 4;
        g.insert(0, vec![7; piece].into_boxed_slice());
        for key in 1..=3 {
            g.insert(key, vec![1; piece].into());
        }
        // The young generation is full: the next value starts a new one.
        g.insert(4, vec![1; piece].into());
        assert!(g.contains(0) && g.young.len() == 1);
        // Read from the old generation, value 0 moves to the young one...
        assert_eq!(g.get(0).map(|v| v.len()), Some(piece));
        for key in 5..=7 {
            g.insert(key, vec![1; piece].into());
        }
        // ...so it outlives the old generation's end, which 1 does not.
        assert!(g.contains(0) && !g.contains(1));
        let held: usize = g
            .young
            .values()
            .chain(g.old.values())
            .map(|v| v.len())
            .sum();
        assert!(held <= 2 * budget);
        // The same value again counts once.
        let before = g.young_weight;
        g.insert(7, vec![1; piece].into());
        assert_eq!(g.young_weight, before);
    }
}
