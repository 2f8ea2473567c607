//! The dispatcher: flow-controlled queues ([`crate::flow`]) in front of the
//! endpoint ledger ([`crate::endpoint`]), under one lock.
//!
//! A synchronous state machine with no clock of its own: every call takes
//! `now`, so tests drive time by hand. The balancer keeps one `Dispatcher`
//! behind a mutex and stores a wake-up handle (`T`) with each waiter.
//!
//! Rules:
//! - A request goes at once when nothing is queued and an endpoint is not
//!   saturated; otherwise it is queued in its flow (or refused, see
//!   [`Reject`]).
//! - Every freed slot, new report or new request runs
//!   [`Dispatcher::dispatch`], which offers the free slots to the queued
//!   requests in three ordered offers ([`offers`]: held requests, requests
//!   at home, then the fair order of strict priority, fairness and
//!   ordering) and binds each to an endpoint by [`crate::placement`],
//!   until nothing can be placed. A request whose model has no unsaturated endpoint is
//!   held, and nothing of the same model, of any priority, passes it;
//!   requests for other models may (flows keep one lane per model, offered
//!   in dispatch order by [`FlowQueues::peek_where`]). A freed slot wakes
//!   exactly one waiter.
//! - Affinity hold: a request that a saturated endpoint is predicted to
//!   serve sooner than a free one (its prompt cached there: the wait-or-go
//!   rule, stage 3 of [`crate::placement`], on the engines' learned
//!   costs, with the requests held for that endpoint before it in the same
//!   pass counted in its wait) waits for that endpoint rather than be
//!   prefilled again elsewhere, at most `scheduling.affinity_hold` and half
//!   its time left to its deadline from the first time it was passed over;
//!   meanwhile the next requests of its flow (up to [`offers::LOOK_AHEAD`], or
//!   [`offers::BEHIND_HOLDS`] when none of those takes it) and other flows of its
//!   band may take the free slot.
//! - At home first: a free slot goes first to a queued request of the
//!   highest waiting priority that is at home there (no busy endpoint holds
//!   more of its prompt, its session's endpoint takes it), before a request
//!   cached elsewhere would take it and prefill cold; a request passed so
//!   starts the same hold clock and, once it is over, is passed no more
//!   (this step asks at most [`offers::MAX_HOLDS_PER_PASS`] requests a pass).
//!   When that endpoint frees a slot, the held request takes it before any
//!   other request of its priority. A request that would now spill
//!   (prefill cold what the busy endpoint holds) first waits out its spill
//!   delay, a clock of its own like a hold's, and then passes the requests
//!   waiting for the free endpoint only where that evens out the work
//!   ([`crate::placement::evening`]). A hold never lets lower
//!   priority pass,
//!   nor a tenant get more than a few of its requests ahead of the waiting
//!   request's tenant under token fairness
//!   ([`FlowQueues::passing_is_unfair`]: then the waiting request takes the
//!   free slot), and a request whose hold ended goes wherever there is
//!   room. The owner runs
//!   `dispatch` at [`Dispatcher::next_hold_end`] (and learns of new holds
//!   from [`Dispatcher::take_new_holds`]), so no request waits on an idle
//!   endpoint longer than its hold.
//! - Sessions ([`crate::session`]): a request whose conversation was last
//!   served by an endpoint goes back there while it can take it; while it
//!   is saturated the request is held for it like an affinity hold (in
//!   hard mode until its TTL), then goes elsewhere and is bound there. A
//!   session is pinned only once a turn of it was served: a first turn
//!   that must queue waits as any request does.
//! - A request for a model no endpoint serves (nor served lately) is refused
//!   404 at once, unless no agent is registered at all: then it waits for
//!   the fleet to come up.
//! - A request that needs more tokens than any endpoint of its model can
//!   give one request is refused 413 at once
//!   ([`crate::endpoint::Saturation::TokenBudget`]); one that fits but not
//!   now waits like any other.
//! - A request past its deadline is never served: `dispatch` answers it
//!   504 first. Its owner may also remove it with [`Dispatcher::cancel`],
//!   as when its client leaves. Neither holds a slot.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::endpoint::{
    EndpointId, EndpointLedger, EndpointSnapshot, Lease, ReportOutcome, Route, SaturationConfig,
    SchedulingConfig,
};
use crate::flow::{
    Charge, FlowControlConfig, FlowKey, FlowQueues, FlowSnapshot, Place, QueueFull, Removed, Size,
};
use crate::placement::{self, Pass, Pick, Waits};
use crate::protocol::{AgentReport, ReportError};

pub use crate::flow::Ticket;
pub use holds::HoldsBegun;

mod holds;
mod offers;
mod reject;

pub use reject::Reject;

/// Everything the dispatcher needs to know.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatcherConfig {
    pub flow: FlowControlConfig,
    pub saturation: SaturationConfig,
    pub scheduling: SchedulingConfig,
    /// Deadline of a request that names none.
    pub default_ttl: Duration,
    /// Longest deadline a request may ask for; longer ones are cut to it.
    pub max_ttl: Duration,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        DispatcherConfig {
            flow: FlowControlConfig::default(),
            saturation: SaturationConfig::default(),
            scheduling: SchedulingConfig::default(),
            default_ttl: Duration::from_secs(10),
            max_ttl: Duration::from_secs(60),
        }
    }
}

/// What a request asks of flow control.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestMeta {
    pub flow: FlowKey,
    /// Body size, counted against the byte limits.
    pub bytes: u64,
    /// How long it may wait; `None`: the default. Cut to the maximum.
    pub ttl: Option<Duration>,
    /// Where it may go and what the scorers look at.
    pub route: Route,
    /// Its tenant's share against the other tenants of its band under
    /// token fairness (1 ..= [`crate::flow::MAX_WEIGHT`]).
    pub weight: u32,
}

/// Outcome of [`Dispatcher::submit`].
#[derive(Debug)]
pub enum Admission {
    /// Go now.
    Ready(Lease),
    /// Wait for a [`Done`]; the request must be expired by this deadline.
    Queued {
        ticket: Ticket,
        deadline: Instant,
    },
    Rejected(Reject),
}

/// The end of a request's wait: a lease, or the reason it gets none.
#[derive(Debug)]
pub struct Done<T> {
    pub waiter: T,
    pub flow: FlowKey,
    pub result: Result<Lease, Reject>,
    /// How long the request waited in the queues.
    pub waited: Duration,
    /// What a granted request was charged, for [`Dispatcher::settle`].
    pub charge: Option<Charge>,
}

/// A queued request: the caller's handle and where the request may go.
#[derive(Debug)]
struct Waiting<T> {
    handle: T,
    route: Route,
    /// Set when it is first held for affinity: it may wait for the endpoint
    /// that caches its prompt until then.
    hold_until: Option<Instant>,
    /// When it must be answered: a hold ends well before.
    deadline: Instant,
    /// Set when it would first spill (prefill cold what a busy endpoint
    /// holds): it may from then on ([`crate::endpoint`]'s spill delay).
    spill_at: Option<Instant>,
    /// Counted among the affinity holds.
    counted: bool,
    priority: i32,
    /// The busy endpoint it was last held for by the wait-or-go rule (or
    /// waited out its spill delay beside): the one it spills from, and
    /// where it counts in the work a spill evens out (`holds`'
    /// `queued_work`).
    held: Option<EndpointId>,
}

impl<T> Waiting<T> {
    /// When a clock started now that runs at most `longest` ends (a hold,
    /// a spill delay): never past half the time the request has left, so
    /// it still has time to be served elsewhere.
    fn clock_end(&self, now: Instant, longest: Duration) -> Instant {
        now + longest.min(self.deadline.saturating_duration_since(now) / 2)
    }
}

/// The queues plus the endpoint ledger.
#[derive(Debug)]
pub struct Dispatcher<T> {
    config: DispatcherConfig,
    ledger: EndpointLedger,
    queues: FlowQueues<Waiting<T>>,
    /// Requests evicted by `submit`, answered by the next `dispatch`.
    evicted: Vec<Done<T>>,
    /// When affinity holds end, keyed by end and arrival; entries of
    /// requests that left are dropped lazily.
    holds: BTreeMap<(Instant, u64), Ticket>,
    /// Holds begun since the last `take_new_holds`.
    new_holds: HoldsBegun,
}

impl<T> Dispatcher<T> {
    pub fn new(config: DispatcherConfig) -> Self {
        Dispatcher {
            ledger: EndpointLedger::new(config.saturation, config.scheduling),
            queues: FlowQueues::new(config.flow.clone()),
            config,
            evicted: Vec::new(),
            holds: BTreeMap::new(),
            new_holds: HoldsBegun::default(),
        }
    }

    pub fn config(&self) -> &DispatcherConfig {
        &self.config
    }

    /// Applies a reloaded configuration: limits, policies, TTLs,
    /// saturation thresholds and scheduling weights. Nothing queued or in
    /// flight is dropped ([`FlowQueues::reconfigure`]).
    pub fn reconfigure(&mut self, config: DispatcherConfig) {
        self.queues.reconfigure(config.flow.clone());
        self.ledger
            .reconfigure(config.saturation, config.scheduling);
        self.config = config;
    }

    /// The deadline a request gets: its own TTL cut to the maximum, or the
    /// default.
    pub fn ttl(&self, asked: Option<Duration>) -> Duration {
        asked.map_or(self.config.default_ttl, |t| t.min(self.config.max_ttl))
    }

    /// Admits a request: a lease now, a place in the queues, or a refusal.
    /// `handle` is kept with the waiter and given back in its [`Done`].
    /// Follow with [`Dispatcher::dispatch`]: a newcomer may evict waiters.
    pub fn submit(&mut self, mut request: RequestMeta, handle: T, now: Instant) -> Admission {
        request.route.due = request.route.objective.deadline(now);
        request.route.sheddable = request.flow.priority < 0 && !request.route.objective.is_none();
        if !self.ledger.model_known(request.route.model.as_deref(), now) {
            return Admission::Rejected(Reject::UnknownModel);
        }
        if self.ledger.never_fits(&request.route, now) {
            return Admission::Rejected(Reject::TooManyTokens);
        }
        if self.ledger.adapter_failed_everywhere(&request.route, now) {
            return Admission::Rejected(Reject::AdapterLoadFailed);
        }
        self.ledger.note_objective(&request.route, now);
        let hold = self.config.scheduling.affinity_hold;
        if self.queues.is_empty() {
            let waits = Waits::default();
            let may_hold = self.hard_session(&request.route) || !hold.is_zero();
            let pass = Pass {
                waits: &waits,
                may_spill: false,
            };
            match placement::pick(
                &mut self.ledger,
                &request.route,
                now,
                may_hold.then_some(pass),
            ) {
                Pick::Lease(lease) => return Admission::Ready(lease),
                Pick::Shed => return Admission::Rejected(Reject::ObjectiveUnmet),
                _ => {}
            }
        }
        if request.route.sheddable
            && !placement::objective::reachable(&self.ledger, &request.route, now)
        {
            return Admission::Rejected(Reject::ObjectiveUnmet);
        }
        if self.config.flow.max_requests == 0 && !self.ledger.any_eligible(now) {
            return Admission::Rejected(Reject::NoEndpoints);
        }
        // A subset hint names the only endpoints the request may use: with
        // none of them up, waiting cannot help.
        if request.route.subset.is_some() && !self.ledger.has_eligible(&request.route, None, now) {
            return Admission::Rejected(Reject::NoEndpoints);
        }
        let deadline = now + self.ttl(request.ttl);
        let place = Place {
            key: request.flow,
            lane: request.route.model.clone(),
            weight: request.weight,
            due: request.route.due,
        };
        let size = Size {
            bytes: request.bytes,
            tokens: request.route.tokens.total(),
        };
        let waiting = Waiting {
            handle,
            route: request.route,
            hold_until: None,
            spill_at: None,
            held: None,
            deadline,
            counted: false,
            priority: place.key.priority,
        };
        match self.queues.push(place, size, waiting, now, deadline) {
            Ok((ticket, evicted)) => {
                for r in evicted {
                    let evicted = done(r, Err(Reject::Evicted), now);
                    self.evicted.push(evicted);
                }
                Admission::Queued { ticket, deadline }
            }
            Err((full, _)) => Admission::Rejected(match full {
                QueueFull::Band => Reject::Shed,
                QueueFull::Global => Reject::BufferFull,
            }),
        }
    }

    /// Takes a granted request out of the queues, with its lease.
    fn grant(&mut self, ticket: Ticket, lease: Lease, now: Instant, out: &mut Vec<Done<T>>) {
        let removed = self
            .queues
            .pop(ticket)
            .expect("a granted request is queued");
        out.push(done(removed, Ok(lease), now));
    }

    /// Whether `route` is of a session that waits for its endpoint until
    /// its TTL (`sessions.hard`) rather than at most the affinity hold.
    fn hard_session(&self, route: &Route) -> bool {
        route.waits_hard(self.config.scheduling.sessions.hard)
    }

    /// Matches the queued requests' prompts again against the blocks the
    /// engine at `addr` holds now (its agent's update changed them:
    /// `matched` counts a prompt's leading keys in that copy), so that a
    /// request placed after a wait weighs what the engines hold then, not
    /// what they held when it came. Stops once `max_keys` keys were looked
    /// up. Returns how many requests' match changed.
    pub fn rematch(
        &mut self,
        addr: SocketAddr,
        mut matched: impl FnMut(&[crate::kv_events::BlockKey]) -> crate::kv_events::Matched,
        max_keys: usize,
    ) -> usize {
        let mut looked = 0;
        let mut changed = 0;
        for waiting in self.queues.handles_mut() {
            if looked >= max_keys {
                break;
            }
            let Some(held) = &waiting.route.engine_held else {
                continue;
            };
            let mut counting = |keys: &[crate::kv_events::BlockKey]| {
                let m = matched(keys);
                looked += m.gpu + m.cpu + 1;
                m
            };
            if let Some(fresh) = held.rematched(addr, &mut counting) {
                waiting.route.engine_held = Some(Arc::new(fresh));
                changed += 1;
            }
        }
        changed
    }

    /// Settles the token-fair charge of a request dispatched from the
    /// queues ([`Done::charge`]) once its answer ended: it used `actual`
    /// tokens.
    pub fn settle(&mut self, charge: &Charge, actual: u64) {
        self.queues.settle(charge, actual);
    }

    /// Removes a waiter whose client went away. `false` if it is no longer
    /// waiting (it was granted a lease, evicted or expired meanwhile).
    pub fn cancel(&mut self, ticket: Ticket) -> bool {
        self.queues.cancel(ticket).is_some()
    }

    /// Binds `session` to the endpoint at `addr`: a response id whose
    /// answer came from there ([`crate::session::response_key`]), so the
    /// turn that continues it goes there too.
    pub fn bind_session(&mut self, session: u64, addr: SocketAddr, now: Instant) {
        self.ledger.bind_session(session, addr, now);
    }

    /// Sessions bound to an endpoint now.
    pub fn sessions_bound(&self) -> usize {
        self.ledger.sessions_bound()
    }

    /// Returns a slot at `now`; follow with [`Dispatcher::dispatch`].
    pub fn release(&mut self, lease: Lease, now: Instant) {
        self.ledger.release(lease, now);
    }

    /// Gives back the slot of a request whose client left before its answer
    /// ended: kept busy while the engine may still work on it
    /// ([`crate::endpoint`]'s accounting rules); follow with `dispatch`.
    pub fn orphan(&mut self, lease: Lease, streamed: bool, now: Instant) {
        self.ledger.orphan(lease, streamed, now);
    }

    /// How `route` is placed now and scored against the fleet, booking
    /// nothing (see [`crate::placement::Explanation`]).
    pub fn explain(&self, route: &Route, now: Instant) -> crate::placement::Explanation {
        placement::explain(&self.ledger, route, now)
    }

    /// Records what the answer to `lease`'s request said of its engine's
    /// prefix cache (see [`crate::endpoint::CacheTruth`]); before the lease
    /// is given back.
    pub fn observe_cache(&mut self, lease: &Lease, seen: crate::endpoint::CacheSeen) {
        self.ledger.observe_cache(lease, seen);
    }

    /// Learns the engine's costs from the timing of the answer to
    /// `lease`'s request (see [`crate::endpoint::CostModel`]); before the
    /// lease is given back.
    pub fn observe_timing(&mut self, lease: &Lease, timing: &crate::endpoint::Timing) {
        self.ledger.observe_timing(lease, timing);
    }

    /// Records how a request to `endpoint` ended for its circuit breaker:
    /// `ok` is `false` for a connection failure or a 5xx answer only.
    /// Returns `true` when this failure opened the circuit.
    pub fn record_outcome(&mut self, endpoint: EndpointId, ok: bool, now: Instant) -> bool {
        self.ledger.record_outcome(endpoint, ok, now)
    }

    /// Endpoints whose circuit breaker remembers a failure: while there
    /// are none, a success has nothing to record (a caller may skip it).
    pub fn failing_endpoints(&self) -> usize {
        self.ledger.failing()
    }

    /// Whether a retry has somewhere to go: an eligible endpoint other than
    /// `failed` that fits `route` (it may be busy).
    pub fn has_alternative(&self, route: &Route, failed: Option<SocketAddr>, now: Instant) -> bool {
        self.ledger.has_eligible(route, failed, now)
    }

    /// Validates and applies an agent report; follow with `dispatch`.
    pub fn report(
        &mut self,
        report: AgentReport,
        now: Instant,
    ) -> Result<ReportOutcome, ReportError> {
        let addr: SocketAddr = report.validate()?;
        self.ledger.check_bounds(&report)?;
        let failed: Vec<String> = (report.adapters.iter())
            .flat_map(|a| &a.load_failed)
            .map(|f| f.name.clone())
            .collect();
        let outcome = self.ledger.apply_report(report, addr, now);
        for adapter in failed {
            self.refuse_unloadable(adapter, now);
        }
        Ok(outcome)
    }

    /// Removes an agent; `false` if it was not registered.
    pub fn deregister(&mut self, agent_id: &str) -> bool {
        self.ledger.deregister(agent_id)
    }

    /// The endpoint a registered agent reports; none for an agent not
    /// registered (never, deregistered, dropped or displaced).
    pub fn endpoint_of_agent(&self, agent_id: &str) -> Option<EndpointId> {
        self.ledger.endpoint_of_agent(agent_id)
    }

    /// Drops agents that missed three reports; returns their ids.
    pub fn drop_stale(&mut self, now: Instant) -> Vec<String> {
        self.ledger.drop_stale(now)
    }

    /// When the next agent turns stale, for the balancer's housekeeping timer.
    pub fn next_stale_deadline(&self) -> Option<Instant> {
        self.ledger.next_stale_deadline()
    }

    /// Queued requests.
    pub fn buffered(&self) -> usize {
        self.queues.len()
    }

    /// Queued body bytes.
    pub fn buffered_bytes(&self) -> u64 {
        self.queues.bytes()
    }

    /// Queued estimated tokens.
    pub fn buffered_tokens(&self) -> u64 {
        self.queues.tokens()
    }

    /// Demand with nowhere to go: queued requests whose model no eligible
    /// endpoint serves, busy or not (none registered, all draining, stale
    /// or failing), per model (`None`: requests that name none). Only more
    /// servers help these, which is what an autoscaler wants to know.
    pub fn unserved_demand(&self, now: Instant) -> Vec<(Option<Arc<str>>, usize)> {
        self.queues
            .lanes()
            .into_iter()
            .filter(|(model, _)| {
                let route = Route {
                    model: model.clone(),
                    ..Route::default()
                };
                !self.ledger.has_eligible(&route, None, now)
            })
            .collect()
    }

    /// Flows with queued requests.
    pub fn flows(&self) -> Vec<FlowSnapshot> {
        self.queues.flows()
    }

    /// Every model name an agent reported: only such names become metric
    /// labels or learn token ratios. A report may add to them, nothing
    /// takes one away, so a copy taken when their number changes stays the
    /// same set.
    pub fn reported_models(&self) -> impl ExactSizeIterator<Item = &Arc<str>> {
        self.ledger.reported_models()
    }

    /// Where a request for `model` falls back to, now: `None` while an
    /// eligible endpoint (busy or not) serves `model` itself, else the
    /// first model of `chain` that has one (none has: `None`, it waits
    /// for its own). See [`crate::models::Fallback`].
    pub fn fallback_for<'a>(
        &self,
        model: &str,
        chain: &'a [Arc<str>],
        now: Instant,
    ) -> Option<&'a Arc<str>> {
        if self.ledger.model_live(model, now) {
            return None;
        }
        self.first_live(chain, now)
    }

    /// The first model of `chain` an eligible endpoint serves.
    pub fn first_live<'a>(&self, chain: &'a [Arc<str>], now: Instant) -> Option<&'a Arc<str>> {
        chain.iter().find(|m| self.ledger.model_live(m, now))
    }

    /// What this balancer tells an endpoint's agent in its answer to a
    /// report, for the agent to divide the server's slots between
    /// balancers ([`crate::shares`]): its requests in flight there, the
    /// share it applies, and its queued requests for models the server
    /// serves (a balancer queueing for another model claims none of it).
    pub fn demand_of(&self, endpoint: EndpointId) -> crate::shares::Demand {
        self.ledger.demand_of(endpoint, self.queues.lane_lens())
    }

    /// The LoRA adapters `endpoint`'s agent should load for the requests
    /// waiting ([`crate::endpoint`]'s `adapters_to_load`).
    pub fn adapters_to_load(&self, endpoint: EndpointId, now: Instant) -> Vec<Arc<str>> {
        (self.ledger).adapters_to_load(endpoint, self.queues.lane_lens(), now)
    }

    pub fn in_flight(&self) -> u64 {
        self.ledger.total_in_flight()
    }

    /// Of [`Dispatcher::in_flight`]: slots whose client left while the
    /// engine may still work on them.
    pub fn orphaned(&self) -> u64 {
        self.ledger.total_orphaned()
    }

    pub fn endpoints(&self, now: Instant) -> Vec<EndpointSnapshot> {
        self.ledger.snapshot(now)
    }

    /// Where a request that takes no slot on the engine (tokenize, count
    /// tokens) goes now: a live endpoint of its model, without waiting in
    /// the queues or taking a slot. Refused like [`Dispatcher::submit`]
    /// when the model is unknown, and `NoEndpoints` when none is live.
    pub fn slotless(&self, route: &Route, now: Instant) -> Result<SocketAddr, Reject> {
        if !self.ledger.model_known(route.model.as_deref(), now) {
            return Err(Reject::UnknownModel);
        }
        self.ledger.live(route, now).ok_or(Reject::NoEndpoints)
    }

    /// Every model name (served models and aliases) a live agent reports,
    /// sorted: `/v1/models`, and what a `model_not_found` answer names.
    pub fn served_models(&self, now: Instant) -> Vec<String> {
        self.ledger.served_models(now)
    }

    /// Everything at once, for the management API, metrics and the
    /// dashboard.
    pub fn snapshot(&self, now: Instant) -> Snapshot {
        Snapshot {
            buffered: self.buffered(),
            buffered_bytes: self.buffered_bytes(),
            buffered_tokens: self.buffered_tokens(),
            flows: self.flows(),
            in_flight: self.in_flight(),
            endpoints: self.endpoints(now),
            max_buffered_requests: self.config.flow.max_requests,
            max_buffered_bytes: self.config.flow.max_bytes,
            unserved: self.unserved_demand(now),
            sessions: self.sessions_bound(),
        }
    }
}

/// A read-only view of the queues and the endpoints ([`Dispatcher::snapshot`]).
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub buffered: usize,
    pub buffered_bytes: u64,
    /// Estimated tokens of the queued requests.
    pub buffered_tokens: u64,
    pub flows: Vec<FlowSnapshot>,
    pub in_flight: u64,
    pub endpoints: Vec<EndpointSnapshot>,
    pub max_buffered_requests: usize,
    pub max_buffered_bytes: u64,
    /// Queued requests per model that no live endpoint serves.
    pub unserved: Vec<(Option<Arc<str>>, usize)>,
    /// Sessions bound to an endpoint ([`crate::session`]).
    pub sessions: usize,
}

fn done<T>(r: Removed<Waiting<T>>, result: Result<Lease, Reject>, now: Instant) -> Done<T> {
    let charge = result.is_ok().then(|| Charge {
        flow: r.key.clone(),
        lane: r.handle.route.model.clone(),
        weight: r.weight,
        tokens: r.tokens,
    });
    Done {
        waiter: r.handle.handle,
        flow: r.key,
        result,
        waited: now.saturating_duration_since(r.enqueued_at),
        charge,
    }
}

#[cfg(test)]
mod tests;
