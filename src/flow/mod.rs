//! Flow-controlled queues: where requests wait while no endpoint can take them.
//!
//! Model: the Gateway API Inference Extension's flow control layer.
//!
//! - Every request belongs to a flow, [`FlowKey`] = (fairness id, priority).
//!   A flow is split into *lanes*, one per model, each queued and taking
//!   turns on its own: a request never waits behind its tenant's request for
//!   another model (whose servers may be saturated). Snapshots count a
//!   flow's lanes together; eviction (below) picks the largest lane.
//! - Flows of the same priority form a *band*. Bands are strict: every queued
//!   request of a higher band is dispatched before any of a lower band.
//! - Inside a band a [`FairnessPolicy`] picks the flow that goes next:
//!   `global-strict` (the best head across all flows, a single FIFO when
//!   ordering is FCFS) or `round-robin` (each flow with work gets one turn in
//!   rotation, so a noisy tenant cannot starve a quiet one) or `token-fair`
//!   (the flow that has been served the fewest weighted tokens goes next:
//!   a virtual token counter per flow, as in VTC, "Fairness in Serving
//!   Large Language Models", OSDI '24). All are work-conserving: a lone
//!   flow may use every turn.
//! - Token fairness: a flow's counter grows by its request's estimated
//!   tokens ÷ its weight when the request is dispatched, and is settled to
//!   the tokens the answer really used ([`FlowQueues::settle`]). A flow
//!   that comes back from idle is lifted to the band's floor (the counter
//!   of the last flow served), so idling banks no credit; one that went
//!   idle while ahead keeps its lead (its counter is remembered while it is
//!   above the floor).
//! - Inside a flow, requests with a latency objective go first, earliest
//!   first token due first ([`crate::objective`]); the others in the order
//!   its [`OrderingPolicy`] says: `fcfs` (arrival order) or `edf` (earliest
//!   deadline first). Between flows fairness decides, as without
//!   objectives.
//! - Capacity: `maxRequests` / `maxBytes` / `maxTokens` (estimated tokens,
//!   [`crate::tokens`]) globally and per band. A band over
//!   its own limit sheds the newcomer ([`Reject::Shed`], 429). When the whole
//!   buffer is full, a newcomer evicts queued work of strictly lower
//!   priority (the newest request of that band's largest flow, answered 429)
//!   if that frees enough room; otherwise it is refused
//!   ([`Reject::BufferFull`], 503).
//! - Every request has a deadline; [`FlowQueues::expire`] removes the ones
//!   past it, earliest first.
//!
//! All operations are O(log n) in the number of queued requests, except
//! eviction (only when the whole buffer is full), which scans the flows.
//!
//! [`Reject::Shed`]: crate::Reject::Shed
//! [`Reject::BufferFull`]: crate::Reject::BufferFull

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

mod capacity;
mod order;
mod policy;
mod token_fair;

use order::OrderKey;
pub use policy::{
    valid_fairness_id, BandConfig, FairnessPolicy, FlowControlConfig, FlowKey, OrderingPolicy,
    DEFAULT_FAIRNESS_ID, MAX_FAIRNESS_ID_LEN,
};
use token_fair::{virtual_tokens, MAX_IDLE_COUNTERS};
pub use token_fair::{Charge, MAX_WEIGHT};

/// Why a request could not be queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueFull {
    /// The band's own limit: shed (429).
    Band,
    /// The global limit, with nothing of lower priority to evict (503).
    Global,
}

/// A queued request's place; used to take it out again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    flow: FlowIdx,
    key: OrderKey,
}

impl Ticket {
    /// Arrival number, unique for the life of the queues.
    pub fn seq(&self) -> u64 {
        self.key.seq
    }
}

/// A request taken out of the queues.
#[derive(Debug)]
pub struct Removed<T> {
    pub handle: T,
    pub key: FlowKey,
    /// Its arrival number ([`Ticket::seq`]).
    pub seq: u64,
    pub enqueued_at: Instant,
    /// Its estimated tokens, as queued.
    pub tokens: u64,
    /// Its token-fairness weight (what it was charged at).
    pub weight: u32,
}

/// One flow's current queue, for metrics and the management API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FlowSnapshot {
    pub fairness_id: String,
    pub priority: i32,
    pub requests: usize,
    pub bytes: u64,
    /// Estimated tokens of its queued requests.
    pub tokens: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct FlowIdx(u32);

#[derive(Debug)]
struct Item<T> {
    handle: T,
    bytes: u64,
    tokens: u64,
    /// Its token-fairness weight, 1 ..= [`MAX_WEIGHT`].
    weight: u32,
    enqueued_at: Instant,
    deadline: Instant,
}

/// The flow a request joins (its key and lane), and the weight it is
/// charged at there under token fairness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub key: FlowKey,
    pub lane: Lane,
    pub weight: u32,
    /// When its first token is due, by its latency objective
    /// ([`crate::objective::Objective::deadline`]): it is served before the
    /// requests of its flow without one, earliest due first.
    pub due: Option<Instant>,
}

/// What a queued request counts for against the limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Size {
    /// Its body.
    pub bytes: u64,
    /// Its estimated tokens ([`crate::tokens::TokenEstimate::total`]).
    pub tokens: u64,
}

/// What a flow is split by: the requested model (`None`: any).
pub type Lane = Option<Arc<str>>;

#[derive(Debug)]
struct Flow<T> {
    key: FlowKey,
    lane: Lane,
    items: BTreeMap<OrderKey, Item<T>>,
    bytes: u64,
    tokens: u64,
    /// Round-robin only: the token of this flow's live entry in its band's
    /// ring, if it has one.
    ring_token: Option<u64>,
    /// Token-fair only: weighted tokens served ([`VIRTUAL_SCALE`] per
    /// token at weight 1).
    served: u64,
}

#[derive(Debug)]
enum Turns {
    /// Heads of the band's non-empty flows, best first: by the head's
    /// order (global-strict, `served` is 0 for all), or by weighted tokens
    /// served, then the head's order (token-fair).
    Ordered {
        heads: BTreeSet<(u64, OrderKey, FlowIdx)>,
        by_tokens: bool,
        /// Token-fair: the counter of the flow served last; a flow that
        /// joins is lifted to it.
        floor: u64,
        /// Token-fair: counters of idle flows still above the floor, so a
        /// flow cannot shed its lead by going idle.
        idle: HashMap<(FlowKey, Lane), u64>,
    },
    /// Flows waiting for a turn, as (flow, token). An entry is live while
    /// the flow's `ring_token` equals its token; a flow emptied by a cancel
    /// leaves a dead entry behind, skipped when its turn comes (and swept
    /// when dead entries outnumber live ones), so a flow that empties always
    /// loses its place.
    RoundRobin {
        ring: VecDeque<(FlowIdx, u64)>,
        dead: usize,
    },
}

#[derive(Debug)]
struct Band {
    requests: usize,
    bytes: u64,
    tokens: u64,
    turns: Turns,
    /// Flows of this band that exist (empty ones included).
    flows: usize,
}

impl Band {
    fn new(config: BandConfig) -> Self {
        Band {
            requests: 0,
            bytes: 0,
            tokens: 0,
            turns: match config.fairness {
                FairnessPolicy::GlobalStrict | FairnessPolicy::TokenFair => Turns::Ordered {
                    heads: BTreeSet::new(),
                    by_tokens: config.fairness == FairnessPolicy::TokenFair,
                    floor: 0,
                    idle: HashMap::new(),
                },
                FairnessPolicy::RoundRobin => Turns::RoundRobin {
                    ring: VecDeque::new(),
                    dead: 0,
                },
            },
            flows: 0,
        }
    }
}

/// The queues of all bands. `T` is the caller's handle for each request
/// (the balancer stores the channel that wakes the waiting request).
#[derive(Debug)]
pub struct FlowQueues<T> {
    config: FlowControlConfig,
    bands: BTreeMap<i32, Band>,
    flows: Vec<Option<Flow<T>>>,
    free_flows: Vec<FlowIdx>,
    flow_index: HashMap<(FlowKey, Lane), FlowIdx>,
    /// (deadline, order key, flow) of every queued request.
    deadlines: BTreeSet<(Instant, OrderKey, FlowIdx)>,
    /// Queued requests per lane with any (kept as requests come and go,
    /// so each agent's report answer counts its server's models cheaply).
    lanes: HashMap<Lane, usize>,
    requests: usize,
    bytes: u64,
    tokens: u64,
    next_seq: u64,
    next_ring_token: u64,
}

impl<T> FlowQueues<T> {
    /// New limits and policies (a config reload). Nothing queued is
    /// dropped: limits hold for the next request; a band's fairness policy
    /// changes once it has emptied, its ordering policy for requests queued
    /// from now on.
    pub fn reconfigure(&mut self, config: FlowControlConfig) {
        self.config = config;
    }

    pub fn new(config: FlowControlConfig) -> Self {
        FlowQueues {
            config,
            bands: BTreeMap::new(),
            flows: Vec::new(),
            free_flows: Vec::new(),
            flow_index: HashMap::new(),
            deadlines: BTreeSet::new(),
            lanes: HashMap::new(),
            requests: 0,
            bytes: 0,
            tokens: 0,
            next_seq: 0,
            next_ring_token: 0,
        }
    }

    /// Queued requests in all bands.
    pub fn len(&self) -> usize {
        self.requests
    }

    pub fn is_empty(&self) -> bool {
        self.requests == 0
    }

    /// Queued body bytes in all bands.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Queued estimated tokens in all bands.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Queues a request, evicting lower-priority work if the buffer is full
    /// (the evicted requests are returned; answer them 429).
    #[allow(clippy::type_complexity)]
    pub fn push(
        &mut self,
        place: Place,
        size: Size,
        handle: T,
        now: Instant,
        deadline: Instant,
    ) -> Result<(Ticket, Vec<Removed<T>>), (QueueFull, T)> {
        let Place {
            key,
            lane,
            weight,
            due,
        } = place;
        let Size { bytes, tokens } = size;
        let band_config = self.config.band(key.priority);
        let (band_requests, band_bytes, band_tokens) = self
            .bands
            .get(&key.priority)
            .map_or((0, 0, 0), |b| (b.requests, b.bytes, b.tokens));
        let band_fits = band_config.max_requests.is_none_or(|m| band_requests < m)
            && band_config
                .max_bytes
                .is_none_or(|m| band_bytes.saturating_add(bytes) <= m)
            && band_config
                .max_tokens
                .is_none_or(|m| band_tokens.saturating_add(tokens) <= m);
        if !band_fits {
            return Err((QueueFull::Band, handle));
        }
        let evicted = match self.make_room(key.priority, size) {
            Some(evicted) => evicted,
            None => return Err((QueueFull::Global, handle)),
        };

        self.next_seq += 1;
        let rank = match band_config.ordering {
            OrderingPolicy::Fcfs => now,
            OrderingPolicy::Edf => deadline,
        };
        let order = OrderKey {
            unhurried: due.is_none(),
            rank: due.unwrap_or(rank),
            seq: self.next_seq,
        };
        let priority = key.priority;
        *self.lanes.entry(lane.clone()).or_default() += 1;
        let idx = self.flow_for(key, lane, band_config);
        let flow = self.flows[idx.0 as usize]
            .as_mut()
            .expect("indexed flow exists");
        let old_head = flow.items.keys().next().copied();
        flow.items.insert(
            order,
            Item {
                handle,
                bytes,
                tokens,
                weight: weight.clamp(1, MAX_WEIGHT),
                enqueued_at: now,
                deadline,
            },
        );
        flow.bytes += bytes;
        flow.tokens += tokens;
        let band = self
            .bands
            .get_mut(&priority)
            .expect("flow_for made the band");
        band.requests += 1;
        band.bytes += bytes;
        band.tokens += tokens;
        match &mut band.turns {
            Turns::Ordered {
                heads,
                by_tokens,
                floor,
                ..
            } => {
                if old_head.is_none() && *by_tokens {
                    // Back from idle: no credit banked while away.
                    flow.served = flow.served.max(*floor);
                }
                if old_head.is_none_or(|h| order < h) {
                    if let Some(h) = old_head {
                        heads.remove(&(flow.served, h, idx));
                    }
                    heads.insert((flow.served, order, idx));
                }
            }
            Turns::RoundRobin { ring, .. } => {
                if flow.ring_token.is_none() {
                    self.next_ring_token += 1;
                    flow.ring_token = Some(self.next_ring_token);
                    ring.push_back((idx, self.next_ring_token));
                }
            }
        }
        self.deadlines.insert((deadline, order, idx));
        self.requests += 1;
        self.bytes += bytes;
        self.tokens += tokens;
        Ok((
            Ticket {
                flow: idx,
                key: order,
            },
            evicted,
        ))
    }

    /// The highest priority with queued requests.
    pub fn top_priority(&self) -> Option<i32> {
        self.bands
            .iter()
            .rev()
            .find(|(_, band)| band.requests > 0)
            .map(|(&priority, _)| priority)
    }

    /// The request that goes next: highest band first, then the band's
    /// fairness policy, then the order inside the flow ([`OrderKey`]:
    /// objectives first, earliest due first; then the ordering policy).
    pub fn peek(&mut self) -> Option<Ticket> {
        self.peek_where(1, |_, _| true)
    }

    /// The first request, in [`FlowQueues::peek`] order, that satisfies
    /// `ready`, looking at the first `depth` requests of each flow (at least
    /// one): flows are offered in turn order, and within a flow its
    /// requests in order, so a request passes the ones ahead of it in its
    /// flow only when those are not ready. Flows passed over keep their
    /// turn. Costs one call of `ready` per request offered before the
    /// answer.
    pub fn peek_where(
        &mut self,
        depth: usize,
        mut ready: impl FnMut(Ticket, &T) -> bool,
    ) -> Option<Ticket> {
        let depth = depth.max(1);
        let flows = &self.flows;
        // The first ready request of a flow among its first `depth`.
        let mut first_ready = |flow: FlowIdx| -> Option<Ticket> {
            let f = flows.get(flow.0 as usize)?.as_ref()?;
            f.items
                .iter()
                .take(depth)
                .map(|(&key, item)| (Ticket { flow, key }, &item.handle))
                .find(|&(ticket, handle)| ready(ticket, handle))
                .map(|(ticket, _)| ticket)
        };
        for band in self.bands.values_mut().rev() {
            if band.requests == 0 {
                continue;
            }
            match &mut band.turns {
                Turns::Ordered { heads, .. } => {
                    for &(_, _, flow) in heads.iter() {
                        if let Some(ticket) = first_ready(flow) {
                            return Some(ticket);
                        }
                    }
                }
                Turns::RoundRobin { ring, dead } => {
                    // Dead entries at the front are dropped on the way.
                    while let Some(&(idx, token)) = ring.front() {
                        if live_head(flows, idx, token).is_some() {
                            break;
                        }
                        ring.pop_front();
                        *dead -= 1;
                    }
                    for &(idx, token) in ring.iter() {
                        if live_head(flows, idx, token).is_some() {
                            if let Some(ticket) = first_ready(idx) {
                                return Some(ticket);
                            }
                        }
                    }
                }
            }
        }
        None
    }

    /// The handle of a queued request.
    pub fn get(&self, ticket: Ticket) -> Option<&T> {
        let flow = self.flows.get(ticket.flow.0 as usize)?.as_ref()?;
        flow.items.get(&ticket.key).map(|i| &i.handle)
    }

    pub fn get_mut(&mut self, ticket: Ticket) -> Option<&mut T> {
        let flow = self.flows.get_mut(ticket.flow.0 as usize)?.as_mut()?;
        flow.items.get_mut(&ticket.key).map(|i| &mut i.handle)
    }

    /// Takes the request [`FlowQueues::peek`] returned; the flow's turn ends.
    pub fn pop(&mut self, ticket: Ticket) -> Option<Removed<T>> {
        let removed = self.take(ticket)?;
        let band = self
            .bands
            .get_mut(&removed.key.priority)
            .expect("band of a queued request exists");
        if let Turns::Ordered {
            heads,
            by_tokens: true,
            floor,
            ..
        } = &mut band.turns
        {
            // The flow is served: it had the least weighted service of the
            // band (or passed ones that could not go), so its counter is
            // the floor newcomers are lifted to.
            let flow = self.flows[ticket.flow.0 as usize]
                .as_mut()
                .expect("a popped request's flow exists until freed");
            *floor = (*floor).max(flow.served);
            let charged = flow
                .served
                .saturating_add(virtual_tokens(removed.tokens, removed.weight));
            if let Some(&head) = flow.items.keys().next() {
                heads.remove(&(flow.served, head, ticket.flow));
                heads.insert((charged, head, ticket.flow));
            }
            flow.served = charged;
        }
        if let Turns::RoundRobin { ring, dead } = &mut band.turns {
            // The turn ends: a flow with more work goes to the back. Its
            // entry is usually the front one; a flow chosen by `peek_where`
            // past others keeps them ahead of it.
            let live = self.flows[ticket.flow.0 as usize]
                .as_ref()
                .and_then(|f| f.ring_token);
            match live {
                Some(token) => {
                    if let Some(pos) = ring.iter().position(|&e| e == (ticket.flow, token)) {
                        ring.remove(pos);
                        ring.push_back((ticket.flow, token));
                    }
                }
                None => {
                    // The flow emptied: `take` counted its entry dead; drop
                    // it now if it is at the front.
                    if ring.front().is_some_and(|&(idx, _)| idx == ticket.flow) {
                        ring.pop_front();
                        *dead -= 1;
                    }
                }
            }
        }
        self.free_flow_if_idle(ticket.flow);
        Some(removed)
    }

    /// Removes a request (its client left); `None` if it is not queued.
    pub fn cancel(&mut self, ticket: Ticket) -> Option<Removed<T>> {
        let removed = self.take(ticket)?;
        self.free_flow_if_idle(ticket.flow);
        Some(removed)
    }

    /// Removes every request whose deadline is at or before `now`, earliest
    /// deadline first.
    pub fn expire(&mut self, now: Instant) -> Vec<Removed<T>> {
        let mut out = Vec::new();
        while let Some(&(deadline, key, flow)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            match self.cancel(Ticket { flow, key }) {
                Some(r) => out.push(r),
                None => unreachable!("deadline index entry without a queued request"),
            }
        }
        out
    }

    /// Every queued request's handle, in no order.
    pub fn handles_mut(&mut self) -> impl Iterator<Item = &mut T> {
        (self.flows.iter_mut().flatten()).flat_map(|f| f.items.values_mut().map(|i| &mut i.handle))
    }

    /// Every request queued in `lane` (a requested model), for a sweep
    /// when that lane can never be served; costs a pass over the flows.
    pub fn tickets_in(&self, lane: &Lane) -> Vec<Ticket> {
        (self.flows.iter().enumerate())
            .filter_map(|(i, f)| f.as_ref().filter(|f| f.lane == *lane).map(|f| (i, f)))
            .flat_map(|(i, f)| {
                let flow = FlowIdx(i as u32);
                f.items.keys().map(move |&key| Ticket { flow, key })
            })
            .collect()
    }

    /// Queued requests per lane (requested model), all flows together,
    /// sorted by lane.
    pub fn lanes(&self) -> Vec<(Lane, usize)> {
        let mut lanes: Vec<(Lane, usize)> =
            self.lanes.iter().map(|(l, &n)| (l.clone(), n)).collect();
        lanes.sort_unstable();
        lanes
    }

    /// Queued requests per lane, in no order, without copying: one entry
    /// per model with queued requests.
    pub fn lane_lens(&self) -> impl Iterator<Item = (&Lane, usize)> {
        self.lanes.iter().map(|(l, &n)| (l, n))
    }

    /// Every flow with queued requests (its lanes counted together).
    pub fn flows(&self) -> Vec<FlowSnapshot> {
        let mut by_key: HashMap<&FlowKey, FlowSnapshot> = HashMap::new();
        for f in self.flows.iter().flatten().filter(|f| !f.items.is_empty()) {
            let snap = by_key.entry(&f.key).or_insert_with(|| FlowSnapshot {
                fairness_id: f.key.fairness_id.to_string(),
                priority: f.key.priority,
                requests: 0,
                bytes: 0,
                tokens: 0,
            });
            snap.requests += f.items.len();
            snap.bytes += f.bytes;
            snap.tokens += f.tokens;
        }
        let mut out: Vec<FlowSnapshot> = by_key.into_values().collect();
        out.sort_by(|a, b| {
            b.priority
                .cmp(&a.priority)
                .then_with(|| a.fairness_id.cmp(&b.fairness_id))
        });
        out
    }

    /// Removes one request and fixes every index. A round-robin flow
    /// emptied here leaves a dead ring entry behind (skipped by `peek`,
    /// popped by `pop`, swept once dead entries outnumber live ones).
    fn take(&mut self, ticket: Ticket) -> Option<Removed<T>> {
        let flow = self.flows.get_mut(ticket.flow.0 as usize)?.as_mut()?;
        let item = flow.items.remove(&ticket.key)?;
        let served = flow.served;
        flow.bytes -= item.bytes;
        flow.tokens -= item.tokens;
        let new_head = flow.items.keys().next().copied();
        let left_ring = new_head.is_none() && flow.ring_token.take().is_some();
        let key = flow.key.clone();
        if let Some(n) = self.lanes.get_mut(&flow.lane) {
            *n -= 1;
            if *n == 0 {
                self.lanes.remove(&flow.lane);
            }
        }
        let band = self
            .bands
            .get_mut(&key.priority)
            .expect("band of a queued request exists");
        band.requests -= 1;
        band.bytes -= item.bytes;
        band.tokens -= item.tokens;
        match &mut band.turns {
            Turns::Ordered { heads, .. } => {
                if heads.remove(&(served, ticket.key, ticket.flow)) {
                    if let Some(h) = new_head {
                        heads.insert((served, h, ticket.flow));
                    }
                }
            }
            Turns::RoundRobin { ring, dead } => {
                if left_ring {
                    *dead += 1;
                    if *dead > 32 && *dead * 2 > ring.len() {
                        let flows = &self.flows;
                        ring.retain(|&(idx, token)| live_head(flows, idx, token).is_some());
                        *dead = 0;
                    }
                }
            }
        }
        self.deadlines
            .remove(&(item.deadline, ticket.key, ticket.flow));
        self.requests -= 1;
        self.bytes -= item.bytes;
        self.tokens -= item.tokens;
        Some(Removed {
            handle: item.handle,
            key,
            seq: ticket.seq(),
            enqueued_at: item.enqueued_at,
            tokens: item.tokens,
            weight: item.weight,
        })
    }

    fn flow_for(&mut self, key: FlowKey, lane: Lane, band_config: BandConfig) -> FlowIdx {
        let index_key = (key, lane);
        if let Some(&idx) = self.flow_index.get(&index_key) {
            return idx;
        }
        let (key, lane) = index_key;
        let band = self
            .bands
            .entry(key.priority)
            .or_insert_with(|| Band::new(band_config));
        band.flows += 1;
        let served = match &mut band.turns {
            Turns::Ordered { idle, .. } => idle.remove(&(key.clone(), lane.clone())).unwrap_or(0),
            Turns::RoundRobin { .. } => 0,
        };
        let flow = Flow {
            key: key.clone(),
            lane: lane.clone(),
            items: BTreeMap::new(),
            bytes: 0,
            tokens: 0,
            ring_token: None,
            served,
        };
        let idx = match self.free_flows.pop() {
            Some(idx) => {
                self.flows[idx.0 as usize] = Some(flow);
                idx
            }
            None => {
                let idx = FlowIdx(u32::try_from(self.flows.len()).expect("under 2^32 flows"));
                self.flows.push(Some(flow));
                idx
            }
        };
        self.flow_index.insert((key, lane), idx);
        idx
    }

    /// Frees a flow that has no requests, and its band once the band has
    /// no flows left, so idle tenants cost nothing.
    fn free_flow_if_idle(&mut self, idx: FlowIdx) {
        let idle = self.flows[idx.0 as usize]
            .as_ref()
            .is_some_and(|f| f.items.is_empty());
        if !idle {
            return;
        }
        let flow = self.flows[idx.0 as usize].take().expect("checked above");
        debug_assert!(flow.ring_token.is_none());
        let priority = flow.key.priority;
        self.flow_index
            .remove(&(flow.key.clone(), flow.lane.clone()));
        self.free_flows.push(idx);
        let band = self
            .bands
            .get_mut(&priority)
            .expect("band of a flow exists");
        band.flows -= 1;
        if let Turns::Ordered {
            by_tokens: true,
            floor,
            idle,
            ..
        } = &mut band.turns
        {
            if flow.served > *floor {
                if idle.len() >= MAX_IDLE_COUNTERS {
                    // Counters at or below the floor would be lifted to it
                    // anyway; past the bound, the oldest leads are lost
                    // rather than memory.
                    let floor = *floor;
                    idle.retain(|_, served| *served > floor);
                    if idle.len() >= MAX_IDLE_COUNTERS {
                        idle.clear();
                    }
                }
                idle.insert((flow.key, flow.lane), flow.served);
            }
        }
        if band.flows == 0 {
            self.bands.remove(&priority);
        }
    }
}

/// The head of flow `idx` if `token` is its live ring entry.
fn live_head<T>(flows: &[Option<Flow<T>>], idx: FlowIdx, token: u64) -> Option<OrderKey> {
    let flow = flows.get(idx.0 as usize)?.as_ref()?;
    if flow.ring_token != Some(token) {
        return None;
    }
    flow.items.keys().next().copied()
}
