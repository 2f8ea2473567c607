//! Quota enforcement (README "Quotas"): the core's sliding windows
//! ([`flowgate::quota`]) kept in this process, or in Redis when balancers
//! share quotas.
//!
//! Shared windows run the same arithmetic in two Lua scripts, one per
//! reserve and one per settle, each atomic on the Redis server and timed
//! by its clock (`TIME`), so balancers whose clocks differ still agree.
//! Per subject (`tenant:NAME` or `key:ID`) under `flowgate:quota:`: `:w`
//! (admitted request ids by millisecond), `:t` (each id's tokens), `:s`
//! (the window's running sums) and `:c` (requests in flight, each with an
//! expiry, so a balancer that died cannot hold a concurrency slot
//! forever). Every key expires after two idle minutes. With Redis Cluster
//! a request's subjects must share a slot: use a single Redis.
//!
//! A store that does not answer within [`STORE_TIMEOUT`] is an error: the
//! request is admitted (`open`) or refused 503 (`closed`), as configured,
//! logged and counted in `flowgate_quota_store_errors_total` — never
//! silently.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flowgate::quota::{
    Exceeded, Limit, QuotaBook, QuotaLimits, RateStatus, Reservation, Subject, TokenKind,
};
use flowgate::tokens::{TokenEstimate, TokenUsage};
use prometheus::{IntCounterVec, Opts};
use redis::aio::ConnectionManager;
use serde::Deserialize;
use tracing::warn;

use crate::observe::metrics::Metrics;
use crate::reply::Refusal;
use flowgate::admission::Grant;
use flowgate::quota::QuotaRules;

/// One subject's limits as written in YAML.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LimitsSpec {
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    /// Which tokens `tokensPerMinute` counts [default: total].
    pub tokens: Option<TokenKindSpec>,
    pub max_concurrent: Option<u32>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenKindSpec {
    Input,
    Output,
    Total,
}

impl LimitsSpec {
    /// Checked: every limit given is at least 1 (`at` names the entry).
    pub fn resolve(&self, at: &str) -> Result<QuotaLimits, String> {
        for (name, value) in [
            ("requestsPerMinute", self.requests_per_minute),
            ("tokensPerMinute", self.tokens_per_minute),
            ("maxConcurrent", self.max_concurrent.map(u64::from)),
        ] {
            if value == Some(0) {
                return Err(format!(
                    "{at}.{name} must be at least 1 (leave it out for no limit)"
                ));
            }
        }
        Ok(QuotaLimits {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            tokens: match self.tokens {
                None | Some(TokenKindSpec::Total) => TokenKind::Total,
                Some(TokenKindSpec::Input) => TokenKind::Input,
                Some(TokenKindSpec::Output) => TokenKind::Output,
            },
            max_concurrent: self.max_concurrent,
        })
    }
}

/// What a balancer does with a request whose quota it cannot check
/// because the shared store does not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    /// Admit it (logged and counted).
    #[default]
    Open,
    /// Refuse it with 503 `quota_unavailable`.
    Closed,
}

/// Where quota windows live.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuotaStore {
    /// Shared between balancers in this Redis; `None`: per balancer.
    pub redis_url: Option<String>,
    pub on_error: OnStoreError,
}

/// Longest a quota store call may take before it counts as failed.
pub const STORE_TIMEOUT: Duration = Duration::from_millis(250);
/// How long a shared concurrency slot outlives a balancer that never
/// settled it (it died).
const SHARED_SLOT_LEASE: Duration = Duration::from_secs(600);
const KEY_PREFIX: &str = "flowgate:quota:";

/// Admits a request when every subject's window has room; counts it in
/// all of them.
const RESERVE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, lease = ARGV[1], tonumber(ARGV[2])
local n = #KEYS / 4
local sums = {}
for i = 1, n do
  local w, th, s, c = KEYS[4*i-3], KEYS[4*i-2], KEYS[4*i-1], KEYS[4*i]
  local b = 2 + 4 * (i - 1)
  local rpm, tpm, maxc = tonumber(ARGV[b+1]), tonumber(ARGV[b+2]), tonumber(ARGV[b+3])
  local old = redis.call('ZRANGEBYSCORE', w, '-inf', now - 60000)
  for _, m in ipairs(old) do
    redis.call('HINCRBY', s, 'tokens', -tonumber(redis.call('HGET', th, m) or '0'))
    redis.call('HINCRBY', s, 'requests', -1)
    redis.call('HDEL', th, m)
  end
  if #old > 0 then redis.call('ZREMRANGEBYSCORE', w, '-inf', now - 60000) end
  redis.call('ZREMRANGEBYSCORE', c, '-inf', now)
  local req = tonumber(redis.call('HGET', s, 'requests') or '0')
  local tok = tonumber(redis.call('HGET', s, 'tokens') or '0')
  local newest = redis.call('ZRANGE', w, -1, -1, 'WITHSCORES')
  local reset = 0
  if #newest > 0 then reset = tonumber(newest[2]) + 60000 - now end
  sums[i] = {req, tok}
  if rpm > 0 and req >= rpm then
    local e = redis.call('ZRANGE', w, req - rpm, req - rpm, 'WITHSCORES')
    return {0, i, 1, tonumber(e[2]) + 60000 - now, req, tok, reset}
  end
  if tpm > 0 and tok >= tpm then
    local members = redis.call('ZRANGE', w, 0, -1, 'WITHSCORES')
    local left, retry = tok, 60000
    for j = 1, #members, 2 do
      left = left - tonumber(redis.call('HGET', th, members[j]) or '0')
      if left < tpm then retry = tonumber(members[j+1]) + 60000 - now break end
    end
    return {0, i, 2, retry, req, tok, reset}
  end
  if maxc > 0 and redis.call('ZCARD', c) >= maxc then
    return {0, i, 3, 1000, req, tok, reset}
  end
end
local out = {1, 0, 0, 0, 0, 0, 0}
for i = 1, n do
  local w, th, s, c = KEYS[4*i-3], KEYS[4*i-2], KEYS[4*i-1], KEYS[4*i]
  local b = 2 + 4 * (i - 1)
  local maxc, tokens = tonumber(ARGV[b+3]), tonumber(ARGV[b+4])
  redis.call('ZADD', w, now, id)
  redis.call('HSET', th, id, tokens)
  redis.call('HINCRBY', s, 'requests', 1)
  redis.call('HINCRBY', s, 'tokens', tokens)
  if maxc > 0 then redis.call('ZADD', c, now + lease, id) end
  for _, k in ipairs({w, th, s}) do redis.call('PEXPIRE', k, 120000) end
  redis.call('PEXPIRE', c, lease + 60000)
  table.insert(out, sums[i][1] + 1)
  table.insert(out, sums[i][2] + tokens)
end
return out
";

/// Replaces a request's estimate by its actual tokens (or takes it out
/// when it was never served) and frees its concurrency slot.
const SETTLE: &str = r"
local id = ARGV[1]
local n = #KEYS / 4
for i = 1, n do
  local w, th, s, c = KEYS[4*i-3], KEYS[4*i-2], KEYS[4*i-1], KEYS[4*i]
  local actual, cancel = tonumber(ARGV[2*i]), ARGV[2*i+1] == '1'
  redis.call('ZREM', c, id)
  local old = redis.call('HGET', th, id)
  if old then
    if cancel then
      redis.call('HDEL', th, id)
      redis.call('ZREM', w, id)
      redis.call('HINCRBY', s, 'tokens', -tonumber(old))
      redis.call('HINCRBY', s, 'requests', -1)
    else
      redis.call('HSET', th, id, actual)
      redis.call('HINCRBY', s, 'tokens', actual - tonumber(old))
    end
  end
end
return 1
";

/// A request's reservation, settled exactly once: by
/// [`Reserved::settle`] when the request ends, or, should the request end
/// without that (its task dropped), as never served, so that no
/// concurrency slot is held forever.
pub struct Reserved {
    quotas: Arc<Quotas>,
    held: Option<Held>,
}

impl Reserved {
    /// The request ended having used `used` tokens (`None`: it was never
    /// served; it leaves the windows).
    pub fn settle(mut self, used: Option<TokenUsage>) {
        if let Some(held) = self.held.take() {
            self.quotas.settle(held, used);
        }
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            self.quotas.settle(held, None);
        }
    }
}

/// What a reservation holds.
#[derive(Debug)]
enum Held {
    Local(Reservation),
    Shared {
        id: String,
        subjects: Vec<(Subject, QuotaLimits)>,
    },
    /// The store failed and the request was let through (`open`):
    /// nothing to settle.
    Unchecked,
}

/// Why a request was not admitted by its quotas.
#[derive(Debug)]
enum QuotaRefusal {
    Exceeded(Exceeded),
    /// The shared store failed and the policy is `closed`.
    StoreUnavailable,
}

struct Shared {
    client: redis::Client,
    /// Made on first use, on the runtime that serves requests (its driver
    /// task lives there); reconnects by itself.
    conn: tokio::sync::OnceCell<ConnectionManager>,
    reserve: redis::Script,
    settle: redis::Script,
    /// Unique per process, so two balancers' request ids never collide.
    instance: u64,
}

pub struct Quotas {
    local: Mutex<QuotaBook>,
    shared: Option<Shared>,
    on_error: OnStoreError,
    next_id: AtomicU64,
    store_errors: IntCounterVec,
    last_warning: Mutex<Option<Instant>>,
}

impl Quotas {
    /// Checks the shared store, if one is configured: a clear error at
    /// start-up when it cannot be reached.
    pub fn new(store: &QuotaStore, metrics: &Metrics) -> Result<Quotas, String> {
        let shared = match &store.redis_url {
            None => None,
            Some(url) => {
                let client = redis::Client::open(url.as_str())
                    .map_err(|e| format!("bad quota Redis URL {url}: {e}"))?;
                client
                    .get_connection_with_timeout(Duration::from_secs(5))
                    .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                    .map_err(|e| format!("cannot reach quota Redis {url}: {e}"))?;
                let mut instance = [0u8; 8];
                getrandom::fill(&mut instance).map_err(|e| format!("random id: {e}"))?;
                Some(Shared {
                    client,
                    conn: tokio::sync::OnceCell::new(),
                    reserve: redis::Script::new(RESERVE),
                    settle: redis::Script::new(SETTLE),
                    instance: u64::from_le_bytes(instance),
                })
            }
        };
        let store_errors = IntCounterVec::new(
            Opts::new(
                "flowgate_quota_store_errors_total",
                "Quota Redis calls that failed or timed out, by what the request got: \
                         admitted (onRedisError: open), refused (closed), or settle (its \
                         settlement was lost)",
            ),
            &["result"],
        )
        .expect("valid metric");
        metrics.register(Box::new(store_errors.clone()));
        Ok(Quotas {
            local: Mutex::new(QuotaBook::default()),
            shared,
            on_error: store.on_error,
            next_id: AtomicU64::new(0),
            store_errors,
            last_warning: Mutex::new(None),
        })
    }

    /// The shared store's connection, made on first use.
    async fn connection(shared: &Shared) -> Result<ConnectionManager, String> {
        let made = shared.conn.get_or_try_init(|| async {
            tokio::time::timeout(
                STORE_TIMEOUT * 4,
                ConnectionManager::new(shared.client.clone()),
            )
            .await
            .map_err(|_| "no connection within 1 s".to_string())?
            .map_err(|e| e.to_string())
        });
        made.await.cloned()
    }

    fn book(&self) -> std::sync::MutexGuard<'_, QuotaBook> {
        self.local
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Reserves a request's `estimate` against the quotas of its `tenant`
    /// and of its API key (`grant`) under `rules`, for every door: `None`
    /// when neither has a quota, else the reservation and the
    /// `x-ratelimit-*` headers of its answers; refused: 429
    /// `quota_exceeded` (503 `quota_unavailable` when the shared store
    /// fails closed).
    pub async fn admit(
        self: &Arc<Self>,
        rules: &QuotaRules,
        tenant: &Arc<str>,
        grant: Option<&Grant>,
        estimate: TokenEstimate,
    ) -> Result<Option<(Reserved, Vec<(&'static str, String)>)>, Refusal> {
        let key = grant.and_then(|g| g.quota.as_ref().map(|q| (&g.key_id, q)));
        let subjects = rules.subjects(tenant, key);
        if subjects.is_empty() {
            return Ok(None);
        }
        // Boxed: the shared store's round trip makes a large future, which
        // every request's (that Pingora boxes and moves whole) would carry.
        match Box::pin(self.hold(subjects, estimate)).await {
            Ok((held, status)) => {
                let reserved = Reserved {
                    quotas: Arc::clone(self),
                    held: Some(held),
                };
                Ok(Some((reserved, status.headers())))
            }
            Err(QuotaRefusal::Exceeded(e)) => Err(Refusal::quota_exceeded(&e)),
            Err(QuotaRefusal::StoreUnavailable) => Err(Refusal::quota_unavailable()),
        }
    }

    async fn hold(
        &self,
        subjects: Vec<(Subject, QuotaLimits)>,
        estimate: TokenEstimate,
    ) -> Result<(Held, RateStatus), QuotaRefusal> {
        let Some(shared) = &self.shared else {
            return self
                .book()
                .reserve(&subjects, estimate, Instant::now())
                .map(|(r, status)| (Held::Local(r), status))
                .map_err(QuotaRefusal::Exceeded);
        };
        let id = format!(
            "{:016x}-{:x}",
            shared.instance,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        );
        let mut call = shared.reserve.prepare_invoke();
        call.arg(&id).arg(SHARED_SLOT_LEASE.as_millis() as u64);
        for (subject, limits) in &subjects {
            for k in keys(subject) {
                call.key(k);
            }
            call.arg(limits.requests_per_minute.unwrap_or(0))
                .arg(limits.tokens_per_minute.unwrap_or(0))
                .arg(limits.max_concurrent.unwrap_or(0))
                .arg(limits.tokens.estimated(&estimate));
        }
        let mut conn = match Self::connection(shared).await {
            Ok(c) => c,
            Err(e) => return self.store_failed(&e),
        };
        let answer =
            tokio::time::timeout(STORE_TIMEOUT, call.invoke_async::<Vec<i64>>(&mut conn)).await;
        let out = match answer {
            Ok(Ok(out)) if out.len() >= 7 => out,
            Ok(Ok(_)) => return self.store_failed("an unexpected answer"),
            Ok(Err(e)) => return self.store_failed(&e.to_string()),
            Err(_) => return self.store_failed("no answer within 250 ms"),
        };
        let ms = |v: i64| Duration::from_millis(v.max(0) as u64);
        if out[0] == 0 {
            let i = (out[1].max(1) as usize - 1).min(subjects.len() - 1);
            let (subject, limits) = &subjects[i];
            let limit = match out[2] {
                1 => Limit::Requests,
                2 => Limit::Tokens,
                _ => Limit::Concurrency,
            };
            let status = RateStatus::of(
                limits,
                out[4].max(0) as u64,
                out[5].max(0) as u64,
                ms(out[6]),
            );
            return Err(QuotaRefusal::Exceeded(Exceeded {
                subject: subject.clone(),
                limit,
                retry_after: ms(out[3]).max(Duration::from_secs(1)),
                status,
            }));
        }
        let mut status = RateStatus::default();
        for (i, (_, limits)) in subjects.iter().enumerate() {
            let (requests, tokens) = (out.get(7 + 2 * i), out.get(8 + 2 * i));
            let s = RateStatus::of(
                limits,
                requests.copied().unwrap_or(0).max(0) as u64,
                tokens.copied().unwrap_or(0).max(0) as u64,
                flowgate::quota::WINDOW,
            );
            status.tighten(s.requests, s.tokens);
        }
        Ok((Held::Shared { id, subjects }, status))
    }

    fn settle(&self, held: Held, used: Option<TokenUsage>) {
        match held {
            Held::Unchecked => {}
            Held::Local(r) => {
                let now = Instant::now();
                match used {
                    Some(u) => self.book().settle(&r, u, now),
                    None => self.book().cancel(&r, now),
                }
            }
            Held::Shared { id, subjects, .. } => {
                let Some(shared) = &self.shared else { return };
                let Some(conn) = shared.conn.get() else {
                    return;
                };
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    self.store_errors.with_label_values(&["settle"]).inc();
                    return;
                };
                let mut conn = conn.clone();
                let script = shared.settle.clone();
                let errors = self.store_errors.clone();
                // Off the request's path: the answer is already sent.
                runtime.spawn(async move {
                    let mut call = script.prepare_invoke();
                    call.arg(&id);
                    for (subject, limits) in &subjects {
                        for k in keys(subject) {
                            call.key(k);
                        }
                        let actual = used.map_or(0, |u| limits.tokens.used(&u));
                        call.arg(actual).arg(u8::from(used.is_none()));
                    }
                    let done = tokio::time::timeout(
                        STORE_TIMEOUT * 4,
                        call.invoke_async::<i64>(&mut conn),
                    )
                    .await;
                    if !matches!(done, Ok(Ok(_))) {
                        errors.with_label_values(&["settle"]).inc();
                    }
                });
            }
        }
    }

    fn store_failed(&self, why: &str) -> Result<(Held, RateStatus), QuotaRefusal> {
        let result = match self.on_error {
            OnStoreError::Open => "admitted",
            OnStoreError::Closed => "refused",
        };
        self.store_errors.with_label_values(&[result]).inc();
        let mut last = self
            .last_warning
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
            *last = Some(Instant::now());
            warn!(
                "quota Redis failed ({why}): requests are {result} without a quota check \
                 (quotas.onRedisError); repeated failures are counted in \
                 flowgate_quota_store_errors_total"
            );
        }
        match self.on_error {
            OnStoreError::Open => Ok((Held::Unchecked, RateStatus::default())),
            OnStoreError::Closed => Err(QuotaRefusal::StoreUnavailable),
        }
    }
}

/// A subject's four keys: window, tokens, sums, in flight.
fn keys(subject: &Subject) -> [String; 4] {
    let base = format!("{KEY_PREFIX}{}", subject.label());
    ["w", "t", "s", "c"].map(|k| format!("{base}:{k}"))
}
