//! The gate in front of the fleet ([`FleetGate`]), shared by every door, the
//! management API and housekeeping: the core [`Dispatcher`] (queues and
//! endpoint ledger) behind one mutex, plus metrics. Requests are admitted
//! here and hold their slot as a [`LeaseGuard`].
//!
//! Invariant that makes waiting race-free: the end of every wait (a grant,
//! an eviction, an expiry) is delivered to its waiter *while the lock is
//! held*. So once a waiter, holding the lock, finds that it is no longer
//! queued, its answer is already in its channel.
//!
//! A grant travels as a [`LeaseGuard`], so a grant that nobody reads (its
//! waiter was dropped) still gives its slot back, and a waiter dropped while
//! queued leaves the buffer at once ([`QueuedTicket`]).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use flowgate::kv_events::EngineHeld;
use flowgate::models::Fallback;
use flowgate::tokens::{TokenRatios, TokenUsage};
use flowgate::usage::{TenantUsage, UsageLedger};
use flowgate::{
    Admission, AgentReport, Dispatcher, DispatcherConfig, EndpointId, Reject, ReportOutcome,
    RequestMeta, Route, Snapshot,
};
use tokio::sync::{oneshot, Notify};
use tracing::warn;

mod blocks;
mod engine_tokens;
mod lease;
pub mod prompt_tokens;
mod served;

pub use blocks::{Applied, Engine, EngineBlocks};
use engine_tokens::EngineTokens;
pub use lease::{AnswerSeen, LeaseGuard, SlotEnd};
pub use served::{AnswerEnd, Served};

use crate::observe::history::History;
use crate::observe::metrics::{FallbackReason, Metrics};

/// Block keys looked up at most when the queued requests are matched
/// again after an engine's blocks changed, under the dispatcher's lock
/// (about a quarter of a millisecond: 32 requests matched 512 blocks
/// deep; an agent sends an update per report, 10 a second by default).
const REMATCH_KEYS: usize = 16_384;

type Waker = oneshot::Sender<Result<LeaseGuard, Reject>>;

/// The gate's clock: tokio's, which its wait timers use too, so that its
/// tests run on a paused clock instead of sleeping (outside tests it is
/// the system's monotonic clock).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

pub struct FleetGate {
    dispatcher: Mutex<Dispatcher<Waker>>,
    /// The engines' blocks their agents sent from the engines' KV-cache
    /// events, off the dispatcher's lock.
    pub blocks: EngineBlocks,
    /// Prompts in those engines' tokens: counted here where the operator
    /// gave the model's tokenizer, else asked of an engine.
    tokenizers: prompt_tokens::Tokenizers,
    engine_tokens: EngineTokens,
    pub metrics: Metrics,
    /// The last minutes of traffic, for the dashboard.
    pub history: History,
    shutting_down: AtomicBool,
    /// SIGTERM arrived: readiness is 503 (requests are still served).
    draining: AtomicBool,
    /// Woken when an affinity hold began, which may end before
    /// housekeeping's next planned wake-up.
    timers: Notify,
    /// Draws for weighted model rewrites ([`flowgate::models`]).
    draws: AtomicU64,
    /// Bytes of prompt per token, learned per model from the answers.
    token_ratios: Mutex<TokenRatios>,
    /// Tokens and requests spent per tenant and key, by minute.
    usage: Mutex<UsageLedger>,
    /// The model names agents reported, copied out of the dispatcher when
    /// a report adds one: a request asks whether its model is one (for
    /// the model rules, its metric label, its token ratio) without taking
    /// the dispatcher's lock, which every request already takes twice.
    reported_models: RwLock<foldhash::HashSet<Arc<str>>>,
    /// The dispatcher's count of endpoints whose circuit breaker remembers
    /// a failure, as of the last outcome recorded (an endpoint forgotten
    /// since may leave it high, never low).
    failing: AtomicUsize,
}

impl flowgate::admission::FleetView for FleetGate {
    fn is_served(&self, model: &str) -> bool {
        self.is_reported(model)
    }

    fn draw(&self) -> u64 {
        self.draws.fetch_add(1, Ordering::Relaxed)
    }

    fn bytes_per_token(&self, model: Option<&str>) -> f64 {
        self.ratios().bytes_per_token(model)
    }
}

/// A slot, how long the request waited for it, and the fallback model it
/// went to instead of its own, if it did.
pub struct Admitted {
    pub lease: LeaseGuard,
    pub waited: Duration,
    pub fell_back: Option<Arc<str>>,
}

/// What moving a waiting request to a fallback model did.
enum Moved {
    /// No fallback can take it now (or it was answered meanwhile).
    Stay,
    /// Answered at once, for this model.
    Done(Result<LeaseGuard, Reject>, Arc<str>),
    /// Queued again, for this model.
    Queued(
        flowgate::Ticket,
        oneshot::Receiver<Result<LeaseGuard, Reject>>,
        Arc<str>,
    ),
}

/// Why a request did not get a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmitError {
    Rejected(Reject),
    /// The client disconnected while waiting.
    ClientGone,
}

impl FleetGate {
    #[cfg(test)]
    pub fn new(config: DispatcherConfig) -> Arc<Self> {
        Self::with_tokenizers(config, prompt_tokens::Tokenizers::default())
    }

    /// A gate that counts the prompts of the models in `tokenizers` itself.
    pub fn with_tokenizers(
        config: DispatcherConfig,
        tokenizers: prompt_tokens::Tokenizers,
    ) -> Arc<Self> {
        Arc::new(FleetGate {
            tokenizers,
            dispatcher: Mutex::new(Dispatcher::new(config)),
            blocks: EngineBlocks::default(),
            engine_tokens: EngineTokens::default(),
            metrics: Metrics::new(),
            history: History::default(),
            shutting_down: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            timers: Notify::new(),
            draws: AtomicU64::new(0),
            token_ratios: Mutex::new(TokenRatios::default()),
            usage: Mutex::new(UsageLedger::new(now())),
            reported_models: RwLock::default(),
            failing: AtomicUsize::new(0),
        })
    }

    /// Whether an agent reported serving `model` ([`Dispatcher::reported_models`]).
    fn is_reported(&self, model: &str) -> bool {
        (self.reported_models.read())
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(model)
    }

    fn lock(&self) -> MutexGuard<'_, Dispatcher<Waker>> {
        // A panic while holding the lock cannot leave the dispatcher half
        // updated (its methods do not panic midway), so poisoning is ignored.
        self.dispatcher
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `f` on the dispatcher, then hands free slots to waiters.
    fn with_dispatch<R>(self: &Arc<Self>, f: impl FnOnce(&mut Dispatcher<Waker>) -> R) -> R {
        let mut d = self.lock();
        let r = f(&mut d);
        self.deliver(&mut d);
        r
    }

    /// Delivers the ends of waits under the lock; a lease whose waiter
    /// vanished (the receiver was dropped) goes straight back into the pool.
    fn deliver(self: &Arc<Self>, d: &mut Dispatcher<Waker>) {
        loop {
            let now = now();
            let done = d.dispatch(now);
            if done.is_empty() {
                let holds = d.take_new_holds();
                if holds.clocks > 0 {
                    self.metrics.fleet.affinity_holds.inc_by(holds.held);
                    self.timers.notify_one();
                }
                return;
            }
            for w in done {
                let charge = w.charge;
                let answer = w.result.map(|lease| {
                    let mut guard = LeaseGuard::new(self, lease);
                    guard.charge = charge;
                    guard
                });
                if let Err(Ok(mut unsent)) = w.waiter.send(answer) {
                    // Release under the lock we hold (the guard's own Drop
                    // would take it again).
                    if let Some(lease) = unsent.lease.take() {
                        d.release(lease, now);
                    }
                }
            }
        }
    }

    /// Waits for a slot. Resolves when a slot is granted, flow control
    /// refuses or evicts the request, its deadline passes, or `client_gone`
    /// resolves (then the request leaves the queues at once and holds
    /// nothing). With a `fallback` chain, a request whose model has no
    /// eligible endpoint goes to the chain's first model that has one, at
    /// once or once it has waited the chain's `after`.
    pub async fn admit(
        self: &Arc<Self>,
        request: RequestMeta,
        fallback: Option<&Fallback>,
        client_gone: impl Future<Output = ()>,
    ) -> Result<Admitted, AdmitError> {
        match self.submit(request, fallback) {
            Submitted::Done(result) => result,
            Submitted::Queued(waiting) => waiting.wait(client_gone).await,
        }
    }

    /// [`FleetGate::admit`]'s first half: a slot at once, a refusal, or a
    /// place in the queues to [`Waiting::wait`] on, wherever the caller
    /// chooses to wait.
    pub fn submit(
        self: &Arc<Self>,
        request: RequestMeta,
        fallback: Option<&Fallback>,
    ) -> Submitted {
        let priority = request.flow.priority;
        let (tx, rx) = oneshot::channel();
        let start = now();
        // Kept to move the request to a fallback after it waited.
        let spare = fallback
            .filter(|f| f.after.is_some())
            .map(|f| (request.clone(), f.clone()));
        let mut fell_back = None;
        let admission = self.with_dispatch(|d| {
            let mut request = request;
            let asked = request.route.model.clone();
            if let (Some(f), Some(model)) = (fallback, asked) {
                if let Some(m) = d.fallback_for(&model, &f.models, start) {
                    self.metrics
                        .fallback(&model, m, FallbackReason::Unavailable);
                    request.route.model = Some(Arc::clone(m));
                    fell_back = Some(Arc::clone(m));
                }
            }
            d.submit(request, tx, start)
        });
        let (ticket, deadline) = match admission {
            Admission::Ready(lease) => {
                self.metrics.flow.outcome(priority, Ok(()), Duration::ZERO);
                return Submitted::Done(Ok(Admitted {
                    lease: LeaseGuard::new(self, lease),
                    waited: Duration::ZERO,
                    fell_back,
                }));
            }
            Admission::Rejected(r) => {
                self.metrics
                    .flow
                    .outcome(priority, Err(r.reason()), Duration::ZERO);
                return Submitted::Done(Err(AdmitError::Rejected(r)));
            }
            Admission::Queued { ticket, deadline } => (ticket, deadline),
        };
        self.metrics.buffered_total.inc();
        let move_at = match (&spare, &fell_back) {
            (Some((_, f)), None) => f.after.map(|after| start + after),
            _ => None,
        };
        Submitted::Queued(Waiting {
            queued: QueuedTicket {
                shared: Arc::clone(self),
                ticket,
            },
            rx,
            start,
            deadline,
            move_at,
            spare: spare.filter(|_| move_at.is_some()).map(Box::new),
            fell_back,
            priority,
        })
    }

    /// A queued request waited its chain's `after`: if a fallback model
    /// has an eligible endpoint, the request leaves its queue for that
    /// model's, keeping its deadline; all under one lock, so it is never
    /// in two queues nor in none.
    fn move_to_fallback(
        self: &Arc<Self>,
        ticket: flowgate::Ticket,
        mut request: RequestMeta,
        fallback: &Fallback,
        deadline: Instant,
    ) -> Moved {
        self.with_dispatch(|d| {
            let now = now();
            let Some(m) = d.first_live(&fallback.models, now) else {
                return Moved::Stay;
            };
            if !d.cancel(ticket) {
                // Answered meanwhile: the answer is in the channel.
                return Moved::Stay;
            }
            let model = request.route.model.replace(Arc::clone(m));
            self.metrics
                .fallback(model.as_deref().unwrap_or(""), m, FallbackReason::Waited);
            request.ttl = Some(
                deadline
                    .saturating_duration_since(now)
                    .max(Duration::from_millis(1)),
            );
            let (tx, rx) = oneshot::channel();
            match d.submit(request, tx, now) {
                Admission::Ready(lease) => {
                    Moved::Done(Ok(LeaseGuard::new(self, lease)), Arc::clone(m))
                }
                Admission::Rejected(r) => Moved::Done(Err(r), Arc::clone(m)),
                Admission::Queued { ticket, .. } => Moved::Queued(ticket, rx, Arc::clone(m)),
            }
        })
    }

    /// Every model name a client may ask for, sorted: what live
    /// endpoints' agents report (served models and their aliases) and the
    /// names the operator's model rules answer to.
    pub fn model_names(&self, rules: &flowgate::models::ModelRules) -> Vec<String> {
        let mut names = self.lock().served_models(now());
        names.extend(rules.names().map(str::to_string));
        names.sort_unstable();
        names.dedup();
        names
    }

    fn ratios(&self) -> MutexGuard<'_, TokenRatios> {
        // Updates are one assignment: a panic cannot leave half of one.
        self.token_ratios
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Learns `model`'s bytes per token from an answer whose `usage` said
    /// its `prompt_bytes` of prompt text were `prompt_tokens` tokens. Only
    /// models an agent reports are learned (a client cannot add entries).
    pub fn learn_tokens(&self, model: &str, prompt_bytes: u64, prompt_tokens: u64) {
        if self.is_reported(model) {
            let mut ratios = self.ratios();
            ratios.learn(model, prompt_bytes, prompt_tokens);
            let ratio = ratios.bytes_per_token(Some(model));
            drop(ratios);
            self.metrics.learned_bytes_per_token(model, ratio);
        }
    }

    /// Accounts an answered request of `tenant`, sent with API key `key`
    /// (its id), that spent `spent`: `/api/v1/usage` and the tenant
    /// metrics.
    pub fn record_usage(&self, tenant: &Arc<str>, key: Option<&Arc<str>>, spent: TokenUsage) {
        self.metrics.tenants.record(tenant, &spent);
        self.usage
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .record(tenant, key, spent, now());
    }

    /// What each tenant spent over the last `window`, biggest first.
    pub fn usage(&self, window: Duration) -> Vec<TenantUsage> {
        self.usage
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .window(window, now())
    }

    /// Requests waiting in the buffer now.
    pub fn buffered(&self) -> usize {
        self.lock().buffered()
    }

    /// How `route` is scored against the fleet now, booking nothing.
    pub fn explain(&self, route: &Route) -> flowgate::placement::Explanation {
        self.lock().explain(route, now())
    }

    /// Binds `session` to the endpoint at `addr` (see
    /// [`flowgate::Dispatcher::bind_session`]).
    pub fn bind_session(&self, session: u64, addr: SocketAddr) {
        self.lock().bind_session(session, addr, now());
    }

    /// Where a request that takes no slot goes now (see
    /// [`flowgate::Dispatcher::slotless`]).
    pub fn slotless(&self, route: &Route) -> Result<SocketAddr, Reject> {
        self.lock().slotless(route, now())
    }

    /// The TTL a request gets (its own, cut to the maximum, or the default).
    pub fn ttl(&self, asked: Option<Duration>) -> Duration {
        self.lock().ttl(asked)
    }

    /// Feeds the circuit breaker of the endpoint `lease` is on: `ok` is
    /// `false` for a failure that is the endpoint's fault
    /// ([`flowgate::blame`]). Counts and logs the circuit opening.
    pub fn record_outcome(&self, lease: &LeaseGuard, ok: bool) {
        self.record_endpoint_outcome(lease.endpoint(), lease.addr(), ok);
    }

    /// [`FleetGate::record_outcome`] for an endpoint whose slot was already
    /// given back (a failure counted only once a retry elsewhere ended).
    pub fn record_endpoint_outcome(&self, endpoint: EndpointId, addr: SocketAddr, ok: bool) {
        if ok && self.failing.load(Ordering::Relaxed) == 0 {
            // No breaker remembers a failure: the lock is not worth taking.
            // (A failure being recorded meanwhile orders after this.)
            return;
        }
        let opened = {
            let mut d = self.lock();
            let opened = d.record_outcome(endpoint, ok, now());
            self.failing.store(d.failing_endpoints(), Ordering::Relaxed);
            opened
        };
        if opened {
            self.metrics.fleet.circuit_opened.inc();
            warn!(
                endpoint = %addr,
                "circuit breaker opened: the endpoint failed repeatedly and gets no work for a while"
            );
        }
    }

    /// The metric label for a request's model: the name when an agent
    /// reports serving it, else `other` (a client cannot add series).
    pub fn model_label<'a>(&self, model: &'a str) -> &'a str {
        if self.is_reported(model) {
            model
        } else {
            "other"
        }
    }

    /// Whether an eligible endpoint other than `failed` fits `route`.
    pub fn has_alternative(&self, route: &Route, failed: Option<SocketAddr>) -> bool {
        self.lock().has_alternative(route, failed, now())
    }

    pub fn report(
        self: &Arc<Self>,
        report: AgentReport,
    ) -> Result<ReportOutcome, flowgate::protocol::ReportError> {
        self.with_dispatch(|d| {
            let outcome = d.report(report, now());
            let names = d.reported_models();
            // Read first: requests read the copy, a report rarely adds a name.
            if names.len() != self.reported_models.read().map_or(0, |k| k.len()) {
                let mut copy = (self.reported_models.write())
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                *copy = names.cloned().collect();
            }
            outcome
        })
    }

    /// Addresses of the registered endpoints.
    pub fn endpoint_addrs(&self) -> Vec<SocketAddr> {
        self.lock()
            .endpoints(now())
            .into_iter()
            .map(|e| e.addr)
            .collect()
    }

    /// What this balancer answers `endpoint`'s agent, read under one
    /// lock: its demand on the endpoint
    /// ([`flowgate::Dispatcher::demand_of`]) and the LoRA adapters the
    /// agent should load now.
    pub fn answer_for(
        &self,
        endpoint: EndpointId,
    ) -> (flowgate::shares::Demand, Vec<std::sync::Arc<str>>) {
        let d = self.lock();
        (d.demand_of(endpoint), d.adapters_to_load(endpoint, now()))
    }

    pub fn deregister(self: &Arc<Self>, agent_id: &str) -> bool {
        self.blocks.forget(agent_id);
        self.with_dispatch(|d| d.deregister(agent_id))
    }

    /// What the engines that publish their caches and serve `model` hold
    /// of the prompt in `body`, its tokens counted by the model's
    /// tokenizer or else asked of the engine at `source` (with its block
    /// size: [`EngineBlocks::tokenizer_for`]); `None` when the prompt's
    /// tokens cannot be had in time.
    pub async fn engine_held(
        &self,
        model: &str,
        body: &[u8],
        (addr, block_size): (SocketAddr, u32),
    ) -> Option<Arc<EngineHeld>> {
        let (tokens, salt): (Arc<[u32]>, Option<String>) =
            match self.tokenizers.tokens(model, body).await {
                Ok((ids, salt)) => {
                    self.metrics.prompt_tokenized("tokenizer", "");
                    (ids.into(), salt)
                }
                Err(why) => {
                    let body: serde_json::Value = serde_json::from_slice(body).ok()?;
                    let salt = body.get("cache_salt").and_then(serde_json::Value::as_str);
                    let salt = salt.map(str::to_string);
                    match self.engine_tokens.of(addr, &body).await {
                        Some(tokens) => {
                            self.metrics.prompt_tokenized("engine", why);
                            (tokens, salt)
                        }
                        None => {
                            self.metrics.prompt_tokenized("none", why);
                            return None;
                        }
                    }
                }
            };
        // A prompt shorter than a block matches nothing anywhere.
        if tokens.len() < block_size as usize {
            return None;
        }
        let held = self
            .blocks
            .held_of(model, &tokens, block_size, salt.as_deref());
        Some(Arc::new(held))
    }

    /// After `agent`'s blocks changed: the queued requests' prompts
    /// matched again against them ([`flowgate::Dispatcher::rematch`]).
    pub fn rematch_queued(&self, agent: &str) {
        let Some((addr, copy)) = self.blocks.copy_of(agent) else {
            return;
        };
        let mut d = self.lock();
        if d.buffered() == 0 {
            return;
        }
        let copy = copy
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        d.rematch(addr, |keys| copy.matched(keys), REMATCH_KEYS);
    }

    /// Whether `agent_id` is registered (reports an endpoint now).
    pub fn is_registered(&self, agent_id: &str) -> bool {
        self.lock().endpoint_of_agent(agent_id).is_some()
    }

    /// Housekeeping's round: drops stale agents and places the requests
    /// whose affinity hold ended. Returns the dropped agents' ids and when
    /// the next agent turns stale or the next hold ends.
    pub fn housekeeping(self: &Arc<Self>) -> (Vec<String>, Option<Instant>) {
        let mut d = self.lock();
        let dropped = d.drop_stale(now());
        self.deliver(&mut d);
        // Blocks of agents no longer registered (dropped, or displaced by
        // another agent of their endpoint) go.
        self.blocks
            .retain(|agent| d.endpoint_of_agent(agent).is_some());
        let next = [d.next_stale_deadline(), d.next_hold_end()]
            .into_iter()
            .flatten()
            .min();
        (dropped, next)
    }

    /// Resolves when an affinity hold began (housekeeping may have to wake
    /// up sooner than it planned).
    pub async fn timers_changed(&self) {
        self.timers.notified().await;
    }

    /// Applies a reloaded configuration (see
    /// [`flowgate::Dispatcher::reconfigure`]); a raised limit may let
    /// queued requests go at once.
    pub fn reconfigure(self: &Arc<Self>, config: DispatcherConfig) {
        self.with_dispatch(|d| d.reconfigure(config));
    }

    /// Buffered and in-flight counts, and a view of every endpoint.
    pub fn snapshot(&self) -> Snapshot {
        self.lock().snapshot(now())
    }

    /// Queued requests per model that no live endpoint serves (see
    /// [`flowgate::Dispatcher::unserved_demand`]).
    pub fn unserved_demand(&self) -> Vec<(Option<Arc<str>>, usize)> {
        self.lock().unserved_demand(now())
    }

    /// SIGTERM arrived: readiness checks answer 503 from now on, while
    /// requests are still accepted and served (the drain delay).
    pub fn begin_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Whether the balancer wants new traffic: not draining, not shutting
    /// down.
    pub fn is_ready(&self) -> bool {
        !self.draining.load(Ordering::SeqCst) && !self.is_shutting_down()
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Counts a client request from its head to its end (the guard's drop).
    pub fn request_started(self: &Arc<Self>) -> ActiveRequest {
        self.metrics.clients.requests.inc();
        ActiveRequest(Arc::clone(self))
    }

    /// Whether a graceful shutdown has nothing left to finish: no client
    /// request under way, none buffered, no live lease (an orphaned slot
    /// has no client left to answer).
    pub fn is_drained(&self) -> bool {
        if self.metrics.clients.requests.get() > 0 {
            return false;
        }
        let d = self.lock();
        d.buffered() == 0 && d.in_flight() <= d.orphaned()
    }
}

/// A client request under way ([`FleetGate::request_started`]).
pub struct ActiveRequest(Arc<FleetGate>);

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        self.0.metrics.clients.requests.dec();
    }
}

/// What [`FleetGate::submit`] did with a request.
pub enum Submitted {
    /// Answered at once: a slot or a refusal.
    Done(Result<Admitted, AdmitError>),
    /// In the queues.
    Queued(Waiting),
}

/// A request in the queues, and everything its wait needs. Dropping it
/// takes the request out of the queues (and gives back a slot granted
/// meanwhile), so it may be moved and awaited anywhere: in the proxy, or
/// parked outside it ([`crate::connection::parking`]).
pub struct Waiting {
    queued: QueuedTicket,
    rx: oneshot::Receiver<Result<LeaseGuard, Reject>>,
    start: Instant,
    deadline: Instant,
    /// When it moves to its fallback chain's first live model, and what
    /// it moves with (boxed: rare, and waiting requests are many).
    move_at: Option<Instant>,
    spare: Option<Box<(RequestMeta, Fallback)>>,
    fell_back: Option<Arc<str>>,
    priority: i32,
}

impl Waiting {
    /// Leaves the queues unanswered because the client cannot be answered
    /// any more: counted as the client's leaving.
    pub fn abandon(self) {
        let shared = Arc::clone(&self.queued.shared);
        let waited = now().saturating_duration_since(self.start);
        shared.metrics.buffer_wait.observe(waited.as_secs_f64());
        shared
            .metrics
            .flow
            .outcome(self.priority, Err("client-gone"), waited);
        shared.metrics.record_outcome(499, "client-gone");
    }

    /// Waits for the end of the wait: a slot, a refusal, an eviction, the
    /// deadline, or `client_gone` resolving (then it leaves the queues
    /// at once and holds nothing).
    pub async fn wait(self, client_gone: impl Future<Output = ()>) -> Result<Admitted, AdmitError> {
        let Waiting {
            mut queued,
            mut rx,
            start,
            deadline,
            mut move_at,
            mut spare,
            mut fell_back,
            priority,
        } = self;
        let shared = Arc::clone(&queued.shared);
        tokio::pin!(client_gone);
        let outcome = loop {
            let moving = move_at.unwrap_or(deadline);
            tokio::select! {
                answer = &mut rx => break answer
                    .unwrap_or(Err(Reject::Timeout))
                    .map_err(AdmitError::Rejected),
                () = tokio::time::sleep_until(deadline.into()) => {
                    let cancelled = shared.lock().cancel(queued.ticket);
                    break if cancelled {
                        Err(AdmitError::Rejected(Reject::Timeout))
                    } else {
                        // Answered just before the timer fired.
                        rx.try_recv()
                            .unwrap_or(Err(Reject::Timeout))
                            .map_err(AdmitError::Rejected)
                    };
                }
                () = tokio::time::sleep_until(moving.into()), if move_at.is_some() => {
                    move_at = None;
                    let Some(spare) = spare.take() else { continue };
                    let (request, f) = *spare;
                    match shared.move_to_fallback(queued.ticket, request, &f, deadline) {
                        Moved::Stay => continue,
                        Moved::Done(result, m) => {
                            fell_back = Some(m);
                            break result.map_err(AdmitError::Rejected);
                        }
                        Moved::Queued(ticket, next, m) => {
                            fell_back = Some(m);
                            queued.ticket = ticket;
                            rx = next;
                        }
                    }
                }
                // A grant that raced with the disconnect is dropped with `rx`,
                // which releases its slot.
                () = &mut client_gone => break Err(AdmitError::ClientGone),
            }
        };
        let waited = now().saturating_duration_since(start);
        shared.metrics.buffer_wait.observe(waited.as_secs_f64());
        let label = match &outcome {
            Ok(_) => Ok(()),
            Err(AdmitError::Rejected(r)) => Err(r.reason()),
            Err(AdmitError::ClientGone) => Err("client-gone"),
        };
        shared.metrics.flow.outcome(priority, label, waited);
        outcome.map(|lease| Admitted {
            lease,
            waited,
            fell_back,
        })
    }
}

/// Removes a queued request from the buffer when its waiter ends, however
/// it ends (a no-op once it was granted or expired).
struct QueuedTicket {
    shared: Arc<FleetGate>,
    ticket: flowgate::Ticket,
}

impl Drop for QueuedTicket {
    fn drop(&mut self) {
        self.shared.lock().cancel(self.ticket);
    }
}

#[cfg(test)]
mod tests;
