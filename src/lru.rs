//! A bounded map from hashes to small values that forgets the least
//! recently used entry first: what the prefix index ([`crate::prefix`]) and
//! the session table ([`crate::session`]) are built on.
//!
//! A hash index over an intrusive doubly linked list kept in a vector:
//! every operation is O(1), nothing is allocated once the map is full (the
//! oldest node is reused), and removed nodes are reused before the vector
//! grows, so its memory is bounded by the capacity whatever the keys.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Keys are already hashes: one multiply-xorshift spreads them over the
/// high bits (the hash table's tags) and the low bits (its buckets) even if
/// a caller hands in poorly mixed values.
#[derive(Default)]
pub(crate) struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by `u64` keys; fold anything else in.
        for &b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        let x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = x ^ (x >> 29);
    }
}

impl std::fmt::Debug for PassThrough {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PassThrough")
    }
}

/// A hash map for keys that are hashes already.
pub(crate) type HashIndex<V> = HashMap<u64, V, BuildHasherDefault<PassThrough>>;

/// Hash → value, at most `capacity` entries, least recently used evicted
/// first.
#[derive(Debug, Clone)]
pub struct LruMap<V> {
    capacity: usize,
    index: HashIndex<u32>,
    nodes: Vec<Node<V>>,
    /// Nodes of removed entries, reused before the vector grows.
    free: Vec<u32>,
    /// Most recently used node, or `NIL`.
    head: u32,
    /// Least recently used node, or `NIL`.
    tail: u32,
}

#[derive(Debug, Clone, Copy)]
struct Node<V> {
    key: u64,
    value: V,
    prev: u32,
    next: u32,
}

const NIL: u32 = u32::MAX;

impl<V: Copy> LruMap<V> {
    pub fn new(capacity: usize) -> Self {
        LruMap {
            // Node indices are u32 (with one value reserved).
            capacity: capacity.min(NIL as usize - 1),
            index: HashIndex::default(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Nodes allocated: never more than the capacity.
    #[cfg(test)]
    pub fn allocated(&self) -> usize {
        self.nodes.len()
    }

    pub fn contains(&self, key: u64) -> bool {
        self.index.contains_key(&key)
    }

    /// The value of `key`, without making it recent.
    pub fn peek(&self, key: u64) -> Option<&V> {
        self.index.get(&key).map(|&i| &self.nodes[i as usize].value)
    }

    /// Sets `key` to `value` as the most recent entry; returns the entry
    /// evicted to make room, if one was.
    pub fn insert(&mut self, key: u64, value: V) -> Option<(u64, V)> {
        if self.capacity == 0 {
            return None;
        }
        if let Some(&i) = self.index.get(&key) {
            self.nodes[i as usize].value = value;
            self.unlink(i);
            self.push_front(i);
            return None;
        }
        let node = Node {
            key,
            value,
            prev: NIL,
            next: NIL,
        };
        let (i, evicted) = if self.index.len() >= self.capacity {
            // Full: the least recently used node takes the new entry.
            let i = self.tail;
            self.unlink(i);
            let old = std::mem::replace(&mut self.nodes[i as usize], node);
            self.index.remove(&old.key);
            (i, Some((old.key, old.value)))
        } else if let Some(i) = self.free.pop() {
            self.nodes[i as usize] = node;
            (i, None)
        } else {
            self.nodes.push(node);
            ((self.nodes.len() - 1) as u32, None)
        };
        self.push_front(i);
        self.index.insert(key, i);
        evicted
    }

    /// Holds at most `capacity` entries from now on, forgetting the least
    /// recently used beyond it (each told to `evicted`). Memory already
    /// allocated is kept for reuse.
    pub fn set_capacity(&mut self, capacity: usize, mut evicted: impl FnMut(u64, V)) {
        self.capacity = capacity.min(NIL as usize - 1);
        while self.index.len() > self.capacity {
            let (key, &value) = self.oldest().expect("not empty");
            self.remove(key);
            evicted(key, value);
        }
    }

    /// Forgets `key`; its value if it was held.
    pub fn remove(&mut self, key: u64) -> Option<V> {
        let i = self.index.remove(&key)?;
        self.unlink(i);
        self.free.push(i);
        Some(self.nodes[i as usize].value)
    }

    /// The least recently used entry.
    pub fn oldest(&self) -> Option<(u64, &V)> {
        (self.tail != NIL).then(|| {
            let n = &self.nodes[self.tail as usize];
            (n.key, &n.value)
        })
    }

    /// Every key held, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.index.keys().copied()
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, i: u32) {
        let old = self.head;
        self.nodes[i as usize].prev = NIL;
        self.nodes[i as usize].next = old;
        match old {
            NIL => self.tail = i,
            o => self.nodes[o as usize].prev = i,
        }
        self.head = i;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    #[test]
    fn the_least_recently_used_goes_first() {
        let mut m = LruMap::new(2);
        assert_eq!(m.insert(1, 'a'), None);
        assert_eq!(m.insert(2, 'b'), None);
        assert_eq!(m.insert(1, 'A'), None, "an update makes it recent");
        assert_eq!(m.insert(3, 'c'), Some((2, 'b')));
        assert_eq!(m.peek(1), Some(&'A'));
        assert_eq!(m.oldest(), Some((1, &'A')));
        assert_eq!(m.remove(1), Some('A'));
        assert_eq!(m.remove(1), None);
        assert_eq!(m.insert(4, 'd'), None, "a removed node is reused");
        assert_eq!((m.len(), m.allocated()), (2, 2));
    }

    proptest! {
        /// Against a plain model: same entries, same evictions, and never
        /// more nodes than the capacity.
        #[test]
        fn behaves_as_a_list_ordered_by_use(
            ops in proptest::collection::vec((0u8..4, 0u64..12), 0..300),
            max_capacity in 0usize..6,
        ) {
            let mut capacity = max_capacity;
            let mut m = LruMap::new(capacity);
            let mut model: VecDeque<(u64, u64)> = VecDeque::new();
            for (step, (op, key)) in ops.into_iter().enumerate() {
                let value = step as u64;
                match op {
                    0 | 1 => {
                        let evicted = m.insert(key, value);
                        let want = if capacity == 0 {
                            None
                        } else if let Some(p) = model.iter().position(|(k, _)| *k == key) {
                            model.remove(p);
                            model.push_front((key, value));
                            None
                        } else {
                            model.push_front((key, value));
                            (model.len() > capacity).then(|| model.pop_back().unwrap())
                        };
                        prop_assert_eq!(evicted, want);
                    }
                    2 => {
                        let want = model.iter().position(|(k, _)| *k == key)
                            .map(|p| model.remove(p).unwrap().1);
                        prop_assert_eq!(m.remove(key), want);
                    }
                    _ => {
                        let new = (key as usize) % (max_capacity + 1);
                        let mut gone = Vec::new();
                        m.set_capacity(new, |k, v| gone.push((k, v)));
                        let mut want = Vec::new();
                        while model.len() > new {
                            want.push(model.pop_back().unwrap());
                        }
                        prop_assert_eq!(gone, want);
                        capacity = new;
                    }
                }
                prop_assert_eq!(m.len(), model.len());
                prop_assert!(m.allocated() <= max_capacity);
                prop_assert!(m.len() <= capacity);
                prop_assert_eq!(m.oldest().map(|(k, v)| (k, *v)), model.back().copied());
            }
        }
    }
}
