//! `scheduling:` in the config file: scorer weights, the prefix index,
//! upstream retries, the circuit breaker, the affinity hold and sessions.

use flowgate::{
    BreakerConfig, PrefixConfig, SchedulingConfig, ScorerWeights, SessionConfig, SessionRules,
    SessionSource,
};
use serde::Deserialize;

use super::flow::ConfigDuration;

/// Most servers an adapter may prefer: each is hashed per adapter
/// request, and more than a fleet's servers of one model says nothing.
pub const MAX_ADAPTER_REPLICAS: u32 = 64;

/// Most free slots that may be kept for requests with objectives: a
/// quarter of the model's slots bounds them anyway.
pub const MAX_KEPT_SLOTS: u32 = 1_024;

/// Retries of a request whose endpoint failed before answering.
pub const DEFAULT_RETRIES: u32 = 1;

/// `scheduling:` in the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SchedulingSection {
    /// Scorer weights; a scorer left out keeps its default weight.
    pub scorers: Option<ScorerWeights>,
    pub prefix_cache: Option<PrefixSection>,
    /// How many times a request is sent to another endpoint after a
    /// connection failure or a 5xx answer, before any byte reached the
    /// client.
    pub retries: Option<u32>,
    pub circuit_breaker: Option<BreakerSection>,
    /// The longest a queued request may wait for a busy server predicted
    /// to serve it sooner than a free one (the wait-or-go rule decides;
    /// 0s: never wait).
    pub affinity_hold: Option<ConfigDuration>,
    pub sessions: Option<SessionsSection>,
    /// Servers each LoRA adapter prefers where no server holds it loaded
    /// (rendezvous hashing: every balancer picks the same ones).
    pub adapter_replicas: Option<u32>,
    /// Free slots kept for requests with a TTFT objective while they come
    /// (README "Latency objectives"); 0: none.
    pub kept_slots: Option<u32>,
    /// Who gets the `x-flowgate-scores` answer header.
    pub explain: Option<crate::rules::ExplainScores>,
}

/// `scheduling.sessions`: which session keys are read, in what order, and
/// how sessions are kept.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SessionsSection {
    /// Header and body field names, first present wins; `[]`: off.
    pub keys: Option<Vec<String>>,
    /// `soft` (default): wait for the session's saturated endpoint while
    /// the wait-or-go rule says so, at most `affinityHold`; `hard`: until
    /// the request's TTL.
    pub mode: Option<SessionMode>,
    pub idle_timeout: Option<ConfigDuration>,
    pub max_sessions: Option<usize>,
    /// Share bindings between balancers in this Redis
    /// (`--sessions-redis-url`).
    pub redis_url: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionMode {
    Soft,
    Hard,
}

/// The most sessions one balancer may keep (about 96 MiB of memory).
pub const MAX_SESSIONS: usize = 1_000_000;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PrefixSection {
    pub block_bytes: Option<usize>,
    pub max_blocks: Option<usize>,
    pub capacity_blocks: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BreakerSection {
    pub failures: Option<u32>,
    pub backoff: Option<ConfigDuration>,
    pub max_backoff: Option<ConfigDuration>,
}

/// The checked scheduling settings, the retry count and which session keys
/// admission reads.
pub fn build(section: &SchedulingSection) -> Result<(SchedulingConfig, u32, SessionRules), String> {
    let scorers = section.scorers.unwrap_or_default();
    if let Some((name, w)) = scorers.invalid() {
        return Err(format!(
            "scheduling.scorers.{name} must be a number of at least 0, not {w}"
        ));
    }
    let pd = PrefixConfig::default();
    let p = section.prefix_cache.as_ref();
    let prefix = PrefixConfig {
        block_bytes: p.and_then(|p| p.block_bytes).unwrap_or(pd.block_bytes),
        max_blocks: p.and_then(|p| p.max_blocks).unwrap_or(pd.max_blocks),
        capacity_blocks: p
            .and_then(|p| p.capacity_blocks)
            .unwrap_or(pd.capacity_blocks),
    };
    if prefix.block_bytes == 0 {
        return Err("scheduling.prefixCache.blockBytes must be at least 1".into());
    }
    if prefix.max_blocks == 0 {
        return Err("scheduling.prefixCache.maxBlocks must be at least 1".into());
    }
    let bd = BreakerConfig::default();
    let b = section.circuit_breaker.as_ref();
    let breaker = BreakerConfig {
        failures: b.and_then(|b| b.failures).unwrap_or(bd.failures),
        backoff: b.and_then(|b| b.backoff).map_or(bd.backoff, |d| d.0),
        max_backoff: b
            .and_then(|b| b.max_backoff)
            .map_or(bd.max_backoff, |d| d.0),
    };
    if breaker.backoff.is_zero() {
        return Err("scheduling.circuitBreaker.backoff must be at least 1ms".into());
    }
    if breaker.max_backoff < breaker.backoff {
        return Err(
            "scheduling.circuitBreaker.maxBackoff must not be shorter than its backoff".into(),
        );
    }
    let retries = at_most("retries", section.retries, DEFAULT_RETRIES, 5)?;
    let affinity_hold = section
        .affinity_hold
        .map_or(SchedulingConfig::default().affinity_hold, |d| d.0);
    let (sessions, session_rules) = sessions(section.sessions.as_ref())?;
    let d = SchedulingConfig::default();
    let adapter_replicas = at_most(
        "adapterReplicas",
        section.adapter_replicas,
        d.adapter_replicas,
        MAX_ADAPTER_REPLICAS,
    )?;
    let kept_slots = at_most(
        "keptSlots",
        section.kept_slots,
        d.kept_slots,
        MAX_KEPT_SLOTS,
    )?;
    Ok((
        SchedulingConfig {
            scorers,
            prefix,
            breaker,
            affinity_hold,
            sessions,
            adapter_replicas,
            kept_slots,
        },
        retries,
        session_rules,
    ))
}

/// `scheduling.<name>`: its value, else `default`; more than `max` is an
/// error naming it.
fn at_most(name: &str, value: Option<u32>, default: u32, max: u32) -> Result<u32, String> {
    let v = value.unwrap_or(default);
    if v > max {
        return Err(format!("scheduling.{name} must be at most {max}, not {v}"));
    }
    Ok(v)
}

/// The checked `scheduling.sessions`.
fn sessions(section: Option<&SessionsSection>) -> Result<(SessionConfig, SessionRules), String> {
    let d = SessionConfig::default();
    let Some(s) = section else {
        return Ok((d, SessionRules::default()));
    };
    let rules = match &s.keys {
        None => SessionRules::default(),
        Some(keys) => {
            let mut order: Vec<SessionSource> = Vec::with_capacity(keys.len());
            for k in keys {
                let source: SessionSource = k
                    .parse()
                    .map_err(|e| format!("scheduling.sessions.keys: {e}"))?;
                if order.contains(&source) {
                    return Err(format!(
                        "scheduling.sessions.keys names {k:?} twice (session_id and session-id are one source)"
                    ));
                }
                order.push(source);
            }
            SessionRules { order }
        }
    };
    let max_sessions = s.max_sessions.unwrap_or(d.max_sessions);
    if max_sessions > MAX_SESSIONS {
        return Err(format!(
            "scheduling.sessions.maxSessions must be at most {MAX_SESSIONS}, not {max_sessions}"
        ));
    }
    let idle_timeout = s.idle_timeout.map_or(d.idle_timeout, |t| t.0);
    if idle_timeout.is_zero() {
        return Err("scheduling.sessions.idleTimeout must be at least 1ms".into());
    }
    Ok((
        SessionConfig {
            max_sessions,
            idle_timeout,
            hard: s.mode == Some(SessionMode::Hard),
        },
        rules,
    ))
}

/// The session Redis URL (`--sessions-redis-url` over
/// `scheduling.sessions.redisUrl`), checked.
pub fn session_redis_url(
    cli: Option<String>,
    section: &SchedulingSection,
) -> Result<Option<String>, String> {
    let url = cli.or_else(|| section.sessions.as_ref()?.redis_url.clone());
    if let Some(url) = &url {
        if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
            return Err(format!(
                "session Redis URL {url:?} (--sessions-redis-url, scheduling.sessions.redisUrl) \
                 must start with redis:// or rediss://"
            ));
        }
    }
    Ok(url)
}
