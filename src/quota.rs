//! Quotas per tenant and per API key: requests per minute, tokens per
//! minute and requests in flight, reserved at admission and settled when
//! the answer ends.
//!
//! Each per-minute limit is a sliding window: the requests a subject was
//! admitted in the last 60 s, with their tokens. Exact in any minute, not
//! just in calendar minutes (a token bucket would let a full burst through
//! at the end of one minute and a refill's worth after it):
//!
//! - **Reserve** ([`QuotaBook::reserve`]): a request is admitted when every
//!   subject it answers to (its tenant, its key) has admitted fewer
//!   requests than its requests-per-minute and fewer tokens than its
//!   tokens-per-minute in the last minute, and fewer requests are in
//!   flight than its concurrency limit; it then counts its estimate for
//!   each, all or nothing. So in any minute a subject is served at most its
//!   token quota plus one request's estimate (the last one admitted).
//! - **Settle** ([`QuotaBook::settle`]): when the answer ends, the tokens it
//!   really used replace its estimate in the window (what was not used is
//!   given back; an answer longer than estimated is charged), and its
//!   concurrency slot is free. [`QuotaBook::cancel`] takes a request that
//!   was never served out of the window altogether.
//! - **Refused**: [`Exceeded`] says which limit and when the window will
//!   have room again (`Retry-After`): when enough of the oldest requests
//!   leave it.
//!
//! The balancer keeps this book per process, or the same arithmetic in
//! Redis when balancers share quotas. Pure: every call takes `now`.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::tokens::{TokenEstimate, TokenUsage};

/// The window of a per-minute limit.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Subjects (tenants and keys) the book keeps at most before it forgets
/// those with nothing in their window.
pub const MAX_SUBJECTS: usize = 100_000;
/// Requests one subject's window holds at most: beyond, the two oldest are
/// merged (their tokens kept, counted until the later one leaves), so the
/// window errs on the strict side.
pub const MAX_ENTRIES: usize = 65_536;

/// Which tokens a tokens-per-minute limit counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TokenKind {
    /// Prompt tokens.
    Input,
    /// Completion tokens.
    Output,
    /// Both.
    #[default]
    Total,
}

/// The most tokens one request counts for in a window: an engine that
/// reports more is not believed, and a window's sums cannot overflow.
pub const MAX_REQUEST_TOKENS: u64 = 1 << 40;

impl TokenKind {
    /// What `estimate` counts for under this kind.
    pub fn estimated(self, estimate: &TokenEstimate) -> u64 {
        let n = match self {
            TokenKind::Input => estimate.prompt,
            TokenKind::Output => estimate.output,
            TokenKind::Total => estimate.total(),
        };
        n.min(MAX_REQUEST_TOKENS)
    }

    /// What `usage` counts for under this kind.
    pub fn used(self, usage: &TokenUsage) -> u64 {
        let n = match self {
            TokenKind::Input => usage.prompt,
            TokenKind::Output => usage.completion,
            TokenKind::Total => usage.total(),
        };
        n.min(MAX_REQUEST_TOKENS)
    }
}

/// One subject's limits; `None`: no limit of that kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QuotaLimits {
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    pub tokens: TokenKind,
    pub max_concurrent: Option<u32>,
}

impl QuotaLimits {
    pub fn is_empty(&self) -> bool {
        self.requests_per_minute.is_none()
            && self.tokens_per_minute.is_none()
            && self.max_concurrent.is_none()
    }
}

/// The operator's quotas: per tenant (by fairness id), a default for
/// tenants not listed, and per API key (on the key's grant).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuotaRules {
    pub tenants: HashMap<String, QuotaLimits>,
    /// Limits of each tenant not listed (each its own, not shared).
    pub default_tenant: Option<QuotaLimits>,
}

impl QuotaRules {
    /// The subjects a request of `tenant`, sent with a key of id `key`
    /// and `key_limits`, counts against.
    pub fn subjects(
        &self,
        tenant: &Arc<str>,
        key: Option<(&Arc<str>, &QuotaLimits)>,
    ) -> Vec<(Subject, QuotaLimits)> {
        let mut out = Vec::new();
        let own = self.tenants.get(&**tenant).or(self.default_tenant.as_ref());
        if let Some(limits) = own.filter(|l| !l.is_empty()) {
            out.push((Subject::Tenant(Arc::clone(tenant)), *limits));
        }
        if let Some((id, limits)) = key.filter(|(_, l)| !l.is_empty()) {
            out.push((Subject::Key(Arc::clone(id)), *limits));
        }
        out
    }
}

/// Whose quota a request counts against.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Subject {
    Tenant(Arc<str>),
    /// An API key, by its id (never the key itself).
    Key(Arc<str>),
}

impl Subject {
    /// `tenant:NAME` / `key:ID`, for messages and the shared store's keys.
    pub fn label(&self) -> String {
        match self {
            Subject::Tenant(t) => format!("tenant:{t}"),
            Subject::Key(k) => format!("key:{k}"),
        }
    }
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Requests,
    Tokens,
    Concurrency,
}

impl Limit {
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::Requests => "requests per minute",
            Limit::Tokens => "tokens per minute",
            Limit::Concurrency => "requests in flight",
        }
    }
}

/// A request refused by a quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exceeded {
    pub subject: Subject,
    pub limit: Limit,
    /// When trying again can succeed (at least 1 s for the header; a
    /// concurrency limit frees when another request ends: 1 s).
    pub retry_after: Duration,
    /// The state of the limits, for the `x-ratelimit-*` headers.
    pub status: RateStatus,
}

/// The `x-ratelimit-*` headers' numbers: for each of requests and tokens,
/// the limit, what is left and when the window is empty again, of the most
/// constrained subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateStatus {
    pub requests: Option<LimitStatus>,
    pub tokens: Option<LimitStatus>,
}

impl RateStatus {
    /// OpenAI's `x-ratelimit-*` headers of this state, names and formats
    /// (every door answers them the same).
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(r) = self.requests {
            out.push(("x-ratelimit-limit-requests", r.limit.to_string()));
            out.push(("x-ratelimit-remaining-requests", r.remaining.to_string()));
            out.push(("x-ratelimit-reset-requests", reset_header(r.reset)));
        }
        if let Some(t) = self.tokens {
            out.push(("x-ratelimit-limit-tokens", t.limit.to_string()));
            out.push(("x-ratelimit-remaining-tokens", t.remaining.to_string()));
            out.push(("x-ratelimit-reset-tokens", reset_header(t.reset)));
        }
        out
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitStatus {
    pub limit: u64,
    pub remaining: u64,
    /// Until the window is empty again.
    pub reset: Duration,
}

impl RateStatus {
    /// The state of `limits` for a window that holds `requests` and
    /// `tokens` and is empty again after `reset`.
    pub fn of(limits: &QuotaLimits, requests: u64, tokens: u64, reset: Duration) -> Self {
        RateStatus {
            requests: limits.requests_per_minute.map(|limit| LimitStatus {
                limit,
                remaining: limit.saturating_sub(requests),
                reset,
            }),
            tokens: limits.tokens_per_minute.map(|limit| LimitStatus {
                limit,
                remaining: limit.saturating_sub(tokens),
                reset,
            }),
        }
    }

    /// Keeps, for each kind, the status with the least remaining.
    pub fn tighten(&mut self, requests: Option<LimitStatus>, tokens: Option<LimitStatus>) {
        fn pick(a: Option<LimitStatus>, b: Option<LimitStatus>) -> Option<LimitStatus> {
            match (a, b) {
                (Some(a), Some(b)) => Some(if b.remaining < a.remaining { b } else { a }),
                (a, b) => a.or(b),
            }
        }
        self.requests = pick(self.requests, requests);
        self.tokens = pick(self.tokens, tokens);
    }
}

/// One admitted request in a subject's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    at: Instant,
    id: u64,
    /// Requests this entry stands for (more than one once merged).
    requests: u64,
    tokens: u64,
}

/// One subject's window and requests in flight.
#[derive(Debug, Default)]
struct State {
    /// Oldest first.
    window: VecDeque<Entry>,
    requests: u64,
    tokens: u64,
    in_flight: u32,
}

impl State {
    /// Drops what left the window by `now`.
    fn expire(&mut self, now: Instant) {
        while let Some(e) = self.window.front() {
            if now.saturating_duration_since(e.at) < WINDOW {
                break;
            }
            self.requests -= e.requests;
            self.tokens -= e.tokens;
            self.window.pop_front();
        }
    }

    /// When the window's requests drop below `limit` (`count` of them
    /// now), or its tokens below `limit` (`by_tokens`).
    fn room_at(&self, limit: u64, by_tokens: bool, now: Instant) -> Duration {
        let mut left = if by_tokens {
            self.tokens
        } else {
            self.requests
        };
        for e in &self.window {
            left -= if by_tokens { e.tokens } else { e.requests };
            if left < limit {
                return (e.at + WINDOW).saturating_duration_since(now);
            }
        }
        Duration::ZERO
    }

    /// When the window is empty again.
    fn clear_at(&self, now: Instant) -> Duration {
        self.window.back().map_or(Duration::ZERO, |e| {
            (e.at + WINDOW).saturating_duration_since(now)
        })
    }

    fn status(&self, limits: &QuotaLimits, now: Instant) -> RateStatus {
        RateStatus::of(limits, self.requests, self.tokens, self.clear_at(now))
    }

    fn push(&mut self, entry: Entry) {
        if self.window.len() >= MAX_ENTRIES {
            let oldest = self.window.pop_front().expect("full");
            let next = self.window.front_mut().expect("full");
            next.requests += oldest.requests;
            next.tokens += oldest.tokens;
        }
        self.requests += entry.requests;
        self.tokens += entry.tokens;
        self.window.push_back(entry);
    }

    /// The entry of request `id` admitted at `at`, if still in the window
    /// (entries are in (at, id) order).
    fn entry_mut(&mut self, at: Instant, id: u64) -> Option<&mut Entry> {
        let i = self
            .window
            .binary_search_by(|e| (e.at, e.id).cmp(&(at, id)))
            .ok()?;
        self.window.get_mut(i)
    }
}

/// What a request reserved, to settle when its answer ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub subjects: Vec<(Subject, QuotaLimits)>,
    id: u64,
    at: Instant,
}

/// The quotas' state for one balancer.
#[derive(Debug, Default)]
pub struct QuotaBook {
    states: HashMap<Subject, State>,
    next_id: u64,
}

impl QuotaBook {
    /// Counts `estimate` in every subject's window and takes a concurrency
    /// slot, if all have room; else nothing, and which limit refused.
    /// Returns the limits' state after the reservation, for the headers.
    pub fn reserve(
        &mut self,
        subjects: &[(Subject, QuotaLimits)],
        estimate: TokenEstimate,
        now: Instant,
    ) -> Result<(Reservation, RateStatus), Exceeded> {
        self.trim(now);
        // Check everything first: all or nothing.
        for (subject, limits) in subjects {
            let state = self.states.entry(subject.clone()).or_default();
            state.expire(now);
            let refused = |limit, retry_after: Duration| Exceeded {
                subject: subject.clone(),
                limit,
                retry_after: retry_after.max(Duration::from_secs(1)),
                status: state.status(limits, now),
            };
            if let Some(rpm) = limits.requests_per_minute {
                if state.requests >= rpm {
                    return Err(refused(Limit::Requests, state.room_at(rpm, false, now)));
                }
            }
            if let Some(tpm) = limits.tokens_per_minute {
                if state.tokens >= tpm {
                    return Err(refused(Limit::Tokens, state.room_at(tpm, true, now)));
                }
            }
            if limits
                .max_concurrent
                .is_some_and(|max| state.in_flight >= max)
            {
                return Err(refused(Limit::Concurrency, Duration::from_secs(1)));
            }
        }
        self.next_id += 1;
        let id = self.next_id;
        let mut status = RateStatus::default();
        for (subject, limits) in subjects {
            let state = self.states.get_mut(subject).expect("made above");
            state.push(Entry {
                at: now,
                id,
                requests: 1,
                tokens: limits.tokens.estimated(&estimate),
            });
            if limits.max_concurrent.is_some() {
                state.in_flight += 1;
            }
            let s = state.status(limits, now);
            status.tighten(s.requests, s.tokens);
        }
        Ok((
            Reservation {
                subjects: subjects.to_vec(),
                id,
                at: now,
            },
            status,
        ))
    }

    /// The request `reservation` was made for ended having used `used`
    /// tokens: they replace its estimate in the windows it is still in,
    /// and its concurrency slot is free.
    pub fn settle(&mut self, reservation: &Reservation, used: TokenUsage, now: Instant) {
        self.release(reservation, now, |limits, entry, state| {
            let actual = limits.tokens.used(&used);
            state.tokens = state.tokens - entry.tokens + actual;
            entry.tokens = actual;
        });
    }

    /// The request `reservation` was made for was never served (flow
    /// control refused it, its client left while it waited): it leaves the
    /// windows altogether.
    pub fn cancel(&mut self, reservation: &Reservation, now: Instant) {
        self.release(reservation, now, |_, entry, state| {
            state.tokens -= entry.tokens;
            state.requests -= entry.requests.min(1);
            entry.tokens = 0;
            entry.requests -= entry.requests.min(1);
        });
    }

    fn release(
        &mut self,
        reservation: &Reservation,
        now: Instant,
        mut change: impl FnMut(&QuotaLimits, &mut Entry, &mut Counts),
    ) {
        for (subject, limits) in &reservation.subjects {
            let Some(state) = self.states.get_mut(subject) else {
                continue;
            };
            if limits.max_concurrent.is_some() {
                state.in_flight = state.in_flight.saturating_sub(1);
            }
            state.expire(now);
            let mut counts = Counts {
                requests: state.requests,
                tokens: state.tokens,
            };
            if let Some(entry) = state.entry_mut(reservation.at, reservation.id) {
                change(limits, entry, &mut counts);
                state.requests = counts.requests;
                state.tokens = counts.tokens;
            }
        }
    }

    /// Forgets subjects with nothing in flight and nothing in their window
    /// (they would start empty anyway), once the book is at its bound.
    fn trim(&mut self, now: Instant) {
        if self.states.len() < MAX_SUBJECTS {
            return;
        }
        self.states.retain(|_, s| {
            s.expire(now);
            s.in_flight > 0 || !s.window.is_empty()
        });
    }
}

/// A window's totals while one of its entries changes.
struct Counts {
    requests: u64,
    tokens: u64,
}

/// A duration as OpenAI's `x-ratelimit-reset-*` headers write it: `20ms`,
/// `1s`, `6m0s`.
pub fn reset_header(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = d.as_secs_f64().ceil() as u64;
    match secs / 60 {
        0 => format!("{secs}s"),
        m => format!("{m}m{}s", secs % 60),
    }
}

#[cfg(test)]
mod tests;
