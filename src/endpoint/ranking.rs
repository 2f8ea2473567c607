//! The endpoints that may take work, best first, per model: choosing one
//! costs O(log n) in the fleet's size instead of a look at every endpoint.
//!
//! An endpoint's place in its lanes is its *static* score, the scorers'
//! sum without the prefix term (free slots, KV-cache use, waiting queue:
//! [`crate::scorer::ScorerWeights::score`]), which only changes when the
//! ledger changes the endpoint: a report, a slot taken or given back. The
//! ledger re-ranks the endpoint at each of those moments; the prefix term
//! depends on the request and is added by [`super::selection`] for the few
//! endpoints that hold the prompt ([`crate::prefix::PrefixHolders`]).
//!
//! Only endpoints that could take work by what they last reported and the
//! balancer's own counts are ranked (an agent, ready, not draining, a free
//! slot, queue and KV cache under their thresholds, token budget not
//! full): at saturation the lanes hold just the few with room, so finding
//! none is O(1). What depends on the clock (a report too old, an open
//! circuit) and on the request (token budget, an address to avoid) is
//! checked on the way down the lane.
//!
//! Among equal scores the endpoint re-ranked longest ago goes first (its
//! tie key is the ledger's count of re-rankings): equal endpoints take
//! turns, as a random choice would on average, without looking at each.

use std::cmp::Reverse;
use std::collections::BTreeSet;

// Keyed by endpoint ids and models' names (the fleet's): a fast hasher.
use foldhash::HashMap;
use std::iter::Peekable;
use std::sync::Arc;

use super::EndpointId;

/// An endpoint's place: higher static score first, then the one re-ranked
/// longest ago.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Rank {
    /// The static score's bits: for non-negative floats their order.
    score: Reverse<u64>,
    tie: u64,
    pub(super) id: EndpointId,
}

impl Rank {
    pub(super) fn new(score: f64, tie: u64, id: EndpointId) -> Self {
        // Scores are sums of non-negative terms; a NaN from a hostile
        // report ranks last rather than anywhere.
        let score = if score >= 0.0 { score } else { 0.0 };
        Rank {
            score: Reverse(score.to_bits()),
            tie,
            id,
        }
    }

    #[cfg(test)]
    pub(super) fn score(&self) -> f64 {
        f64::from_bits(self.score.0)
    }
}

/// The endpoints of one model (or of all).
#[derive(Debug, Default)]
struct Lane {
    /// Endpoints with an agent listing the model.
    members: BTreeSet<EndpointId>,
    /// Of those, the ones that may take work, best first.
    ranked: BTreeSet<Rank>,
    /// The others: those that are busy (or have just registered).
    unranked: BTreeSet<EndpointId>,
}

#[derive(Debug)]
struct Entry {
    /// The lanes it is in besides `all`: its models, or none for an agent
    /// that lists no models (it serves any: the `any_model` lane).
    models: Vec<Arc<str>>,
    rank: Option<Rank>,
}

/// Every endpoint with an agent, in lanes by model.
#[derive(Debug, Default)]
pub(super) struct Ranking {
    all: Lane,
    any_model: Lane,
    by_model: HashMap<Arc<str>, Lane>,
    entries: HashMap<EndpointId, Entry>,
}

impl Ranking {
    /// The endpoint's agent lists `models` (the lanes it belongs to). Keeps
    /// its rank.
    pub(super) fn set_models(&mut self, id: EndpointId, models: &[String]) {
        if let Some(e) = self.entries.get(&id) {
            if e.models.len() == models.len()
                && e.models.iter().zip(models).all(|(a, b)| **a == **b)
            {
                return;
            }
        }
        let rank = self.remove(id);
        let mut names: Vec<Arc<str>> = Vec::with_capacity(models.len());
        for m in models {
            if names.iter().any(|n| **n == **m) {
                continue;
            }
            let key = match self.by_model.get_key_value(m.as_str()) {
                Some((k, _)) => Arc::clone(k),
                None => Arc::from(m.as_str()),
            };
            names.push(key);
        }
        each_lane(
            &mut self.all,
            &mut self.any_model,
            &mut self.by_model,
            &names,
            |lane| {
                lane.members.insert(id);
                lane.unranked.insert(id);
            },
        );
        self.entries.insert(
            id,
            Entry {
                models: names,
                rank: None,
            },
        );
        self.rerank(id, rank);
    }

    /// Puts the endpoint at `rank` in its lanes (`None`: takes no work).
    pub(super) fn rerank(&mut self, id: EndpointId, rank: Option<Rank>) {
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        if entry.rank == rank {
            return;
        }
        let old = std::mem::replace(&mut entry.rank, rank);
        each_lane(
            &mut self.all,
            &mut self.any_model,
            &mut self.by_model,
            &entry.models,
            |lane| {
                match old {
                    Some(old) => lane.ranked.remove(&old),
                    None => lane.unranked.remove(&id),
                };
                match rank {
                    Some(new) => lane.ranked.insert(new),
                    None => lane.unranked.insert(id),
                };
            },
        );
    }

    /// Takes the endpoint out of every lane (its agent went away); returns
    /// the rank it had.
    pub(super) fn remove(&mut self, id: EndpointId) -> Option<Rank> {
        let entry = self.entries.remove(&id)?;
        each_lane(
            &mut self.all,
            &mut self.any_model,
            &mut self.by_model,
            &entry.models,
            |lane| {
                lane.members.remove(&id);
                lane.unranked.remove(&id);
                if let Some(r) = entry.rank {
                    lane.ranked.remove(&r);
                }
            },
        );
        for m in &entry.models {
            if self.by_model.get(m).is_some_and(|l| l.members.is_empty()) {
                self.by_model.remove(m);
            }
        }
        entry.rank
    }

    /// The ranked endpoints that serve `model` (`None`: all), best first.
    pub(super) fn ranked(&self, model: Option<&str>) -> impl Iterator<Item = Rank> + '_ {
        let (a, b) = self.pair(model);
        Merge {
            a: a.ranked.iter().copied().peekable(),
            b: b.map(|l| l.ranked.iter().copied().peekable()),
        }
    }

    /// The endpoints with an agent that serve `model` (`None`: all),
    /// ranked or not.
    pub(super) fn members(&self, model: Option<&str>) -> impl Iterator<Item = EndpointId> + '_ {
        self.ids(model, |l| &l.members)
    }

    /// How many endpoints [`Ranking::ranked`] yields for `model`.
    pub(super) fn ranked_len(&self, model: Option<&str>) -> usize {
        let (a, b) = self.pair(model);
        a.ranked.len() + b.map_or(0, |l| l.ranked.len())
    }

    /// One set of ids of each lane that serves `model`, one after the other.
    fn ids(
        &self,
        model: Option<&str>,
        set: fn(&Lane) -> &BTreeSet<EndpointId>,
    ) -> impl Iterator<Item = EndpointId> + '_ {
        let (a, b) = self.pair(model);
        set(a)
            .iter()
            .chain(b.into_iter().flat_map(move |l| set(l).iter()))
            .copied()
    }

    /// How many endpoints [`Ranking::unranked`] yields for `model`.
    pub(super) fn unranked_len(&self, model: Option<&str>) -> usize {
        let (a, b) = self.pair(model);
        a.unranked.len() + b.map_or(0, |l| l.unranked.len())
    }

    /// Whether no endpoint has an agent.
    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The lanes that serve `model`: its own and the endpoints that serve
    /// any model (they never share a member), or the whole fleet.
    fn pair(&self, model: Option<&str>) -> (&Lane, Option<&Lane>) {
        static EMPTY: std::sync::OnceLock<Lane> = std::sync::OnceLock::new();
        match model {
            None => (&self.all, None),
            Some(m) => (
                self.by_model
                    .get(m)
                    .unwrap_or_else(|| EMPTY.get_or_init(Lane::default)),
                Some(&self.any_model),
            ),
        }
    }

    /// The rank an endpoint has now; `None` while it is not ranked.
    pub(super) fn rank_of(&self, id: EndpointId) -> Option<Rank> {
        self.entries.get(&id).and_then(|e| e.rank)
    }
}

/// Applies `f` to each lane of an endpoint listing `models`.
fn each_lane(
    all: &mut Lane,
    any_model: &mut Lane,
    by_model: &mut HashMap<Arc<str>, Lane>,
    models: &[Arc<str>],
    mut f: impl FnMut(&mut Lane),
) {
    f(all);
    if models.is_empty() {
        f(any_model);
    }
    for m in models {
        match by_model.get_mut(m) {
            Some(lane) => f(lane),
            None => f(by_model.entry(Arc::clone(m)).or_default()),
        }
    }
}

/// Two best-first rank iterators merged into one.
struct Merge<I: Iterator<Item = Rank>> {
    a: Peekable<I>,
    b: Option<Peekable<I>>,
}

impl<I: Iterator<Item = Rank>> Iterator for Merge<I> {
    type Item = Rank;

    fn next(&mut self) -> Option<Rank> {
        let Some(b) = self.b.as_mut() else {
            return self.a.next();
        };
        match (self.a.peek(), b.peek()) {
            (Some(x), Some(y)) if y < x => b.next(),
            (Some(_), _) => self.a.next(),
            (None, _) => b.next(),
        }
    }
}
