//! Sessions: a conversation named by its client, and the endpoint that
//! served its last turn.
//!
//! Agents and chat apps re-send a growing conversation every turn; the
//! engine's KV cache makes the next turn cheap only where the last one
//! ran. Clients name their conversations in many ways ([`SessionSource`]:
//! OpenAI's `prompt_cache_key`, the Responses API's `conversation` and
//! `previous_response_id`, the headers coding agents and other gateways
//! send); [`SessionRules`] reads them in the operator's order.
//!
//! A key is client input: it is bounded ([`MAX_KEY_BYTES`], visible ASCII
//! only; anything else is no key), hashed at once and scoped to its tenant
//! ([`scoped`]), so the balancer never stores, logs or exports it in clear
//! and one tenant cannot steer another's placement by sending its key.
//!
//! [`SessionTable`] binds a key's hash to the endpoint that served its last
//! turn, least recently used forgotten first and idle ones expired, so its
//! memory is bounded whatever clients send: about [`BYTES_PER_SESSION`]
//! bytes per session, at most [`SessionConfig::max_sessions`] of them.
//! How a bound request is placed is the ledger's
//! ([`crate::endpoint::EndpointLedger`]): back to its endpoint while that
//! is live and can take it; while it is saturated the request waits for
//! it as long as the affinity hold allows (hard mode: until its TTL), then
//! goes elsewhere and is bound there.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::lru::LruMap;

/// The longest key read; a longer one is no key.
pub const MAX_KEY_BYTES: usize = 256;

/// Memory one bound session takes (its node and its index entry).
pub const BYTES_PER_SESSION: usize = 96;

/// Where a session key may come from, named as clients send it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SessionSource {
    /// Header `x-flowgate-session`: Flowgate's own.
    FlowgateHeader,
    /// Body field `prompt_cache_key` (OpenAI chat completions and
    /// Responses; Codex puts its conversation id there).
    PromptCacheKey,
    /// Body field `conversation` (Responses API): an id, or an object with
    /// an `id`.
    Conversation,
    /// Body field `previous_response_id` (Responses API): the turn goes
    /// where the response it continues was served.
    PreviousResponseId,
    /// Header `x-session-id` (vllm-router, LiteLLM).
    SessionIdHeader,
    /// Header `x-session-affinity`.
    SessionAffinityHeader,
    /// Header `x-claude-code-session-id` (Claude Code).
    ClaudeCodeHeader,
    /// Header `session_id` or `session-id` (Codex CLI).
    CodexHeader,
    /// Header `x-dynamo-session-id` (Dynamo).
    DynamoHeader,
    /// Header `x-smg-routing-key` (SGLang's gateway).
    SmgHeader,
}

impl SessionSource {
    /// Every source, in the default order: Flowgate's own header, then
    /// what OpenAI clients put in the body, then other clients' headers.
    pub const ALL: [SessionSource; 10] = [
        SessionSource::FlowgateHeader,
        SessionSource::PromptCacheKey,
        SessionSource::Conversation,
        SessionSource::PreviousResponseId,
        SessionSource::SessionIdHeader,
        SessionSource::SessionAffinityHeader,
        SessionSource::ClaudeCodeHeader,
        SessionSource::CodexHeader,
        SessionSource::DynamoHeader,
        SessionSource::SmgHeader,
    ];

    /// The name it is configured by: the header's or the body field's.
    pub fn name(self) -> &'static str {
        match self {
            SessionSource::FlowgateHeader => "x-flowgate-session",
            SessionSource::PromptCacheKey => "prompt_cache_key",
            SessionSource::Conversation => "conversation",
            SessionSource::PreviousResponseId => "previous_response_id",
            SessionSource::SessionIdHeader => "x-session-id",
            SessionSource::SessionAffinityHeader => "x-session-affinity",
            SessionSource::ClaudeCodeHeader => "x-claude-code-session-id",
            SessionSource::CodexHeader => "session-id",
            SessionSource::DynamoHeader => "x-dynamo-session-id",
            SessionSource::SmgHeader => "x-smg-routing-key",
        }
    }

    /// The source a request header (lower-case name) is, if it is one.
    /// Codex spells its header with an underscore, which is legal HTTP.
    pub fn of_header(name: &str) -> Option<SessionSource> {
        Some(match name {
            "x-flowgate-session" => SessionSource::FlowgateHeader,
            "x-session-id" => SessionSource::SessionIdHeader,
            "x-session-affinity" => SessionSource::SessionAffinityHeader,
            "x-claude-code-session-id" => SessionSource::ClaudeCodeHeader,
            "session-id" | "session_id" => SessionSource::CodexHeader,
            "x-dynamo-session-id" => SessionSource::DynamoHeader,
            "x-smg-routing-key" => SessionSource::SmgHeader,
            _ => return None,
        })
    }

    /// Every header name a source is read from, lower case.
    pub const HEADER_NAMES: [&'static str; 8] = [
        "x-flowgate-session",
        "x-session-id",
        "x-session-affinity",
        "x-claude-code-session-id",
        "session-id",
        "session_id",
        "x-dynamo-session-id",
        "x-smg-routing-key",
    ];

    fn index(self) -> usize {
        self as usize
    }
}

impl FromStr for SessionSource {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.trim().to_ascii_lowercase();
        SessionSource::ALL
            .into_iter()
            .find(|source| source.name() == lower)
            .or_else(|| SessionSource::of_header(&lower))
            .ok_or_else(|| {
                let names: Vec<&str> = SessionSource::ALL.iter().map(|s| s.name()).collect();
                format!(
                    "unknown session key source {s:?} (known: {})",
                    names.join(", ")
                )
            })
    }
}

/// A session key's hash, before it is scoped to a tenant; `None` when the
/// raw value is no key (empty, longer than [`MAX_KEY_BYTES`], or with a
/// byte that is not visible ASCII). A response id and a session key never
/// collide: they are hashed apart.
pub fn key_hash(source: SessionSource, raw: &[u8]) -> Option<u64> {
    let key = raw.trim_ascii();
    if key.is_empty() || key.len() > MAX_KEY_BYTES || !key.iter().all(|b| b.is_ascii_graphic()) {
        return None;
    }
    let mut h = DefaultHasher::new();
    (source == SessionSource::PreviousResponseId).hash(&mut h);
    key.hash(&mut h);
    Some(h.finish())
}

/// A key's hash scoped to its tenant: the same key sent by two tenants
/// names two sessions.
pub fn scoped(tenant: &str, key: u64) -> u64 {
    let mut h = DefaultHasher::new();
    tenant.hash(&mut h);
    key.hash(&mut h);
    h.finish()
}

/// A session's rendezvous weight on the endpoint at `addr`: the endpoint
/// with the highest weight is the session's home
/// ([`crate::endpoint::EndpointLedger`]). Any two processes of one build
/// compute the same weights; an endpoint that joins or leaves moves only
/// the sessions whose home it is or becomes.
pub fn rendezvous(session: u64, addr: SocketAddr) -> u64 {
    let mut h = DefaultHasher::new();
    session.hash(&mut h);
    addr.hash(&mut h);
    h.finish()
}

/// The key of the session a response continues: where the response with
/// id `response_id` was served, for a later `previous_response_id`.
pub fn response_key(tenant: &str, response_id: &[u8]) -> Option<u64> {
    key_hash(SessionSource::PreviousResponseId, response_id).map(|k| scoped(tenant, k))
}

/// How a session is named where people read it (the access log): its
/// hash in hex, never the key; empty for none.
#[derive(Debug, Clone, Copy)]
pub struct SessionLabel(pub Option<u64>);

impl std::fmt::Display for SessionLabel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(h) => write!(f, "{h:016x}"),
            None => Ok(()),
        }
    }
}

/// The session keys one request carries, hashed, by source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionKeys {
    hashes: [Option<u64>; SessionSource::ALL.len()],
}

impl SessionKeys {
    /// Records `raw` as the key from `source` (the first one sent counts).
    pub fn set(&mut self, source: SessionSource, raw: &[u8]) {
        let slot = &mut self.hashes[source.index()];
        if slot.is_none() {
            *slot = key_hash(source, raw);
        }
    }

    /// Takes the keys `other` has and this has not.
    pub fn merge(&mut self, other: &SessionKeys) {
        for (mine, theirs) in self.hashes.iter_mut().zip(other.hashes) {
            if mine.is_none() {
                *mine = theirs;
            }
        }
    }

    fn get(&self, source: SessionSource) -> Option<u64> {
        self.hashes[source.index()]
    }
}

/// Which sources name a request's session, in the operator's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRules {
    /// Read in this order; the first present wins. Empty: sessions off.
    pub order: Vec<SessionSource>,
}

impl Default for SessionRules {
    fn default() -> Self {
        SessionRules {
            order: SessionSource::ALL.to_vec(),
        }
    }
}

impl SessionRules {
    /// The session of a request of `tenant` carrying `keys`: the first
    /// source in order that it sent, scoped to the tenant.
    pub fn session(&self, keys: &SessionKeys, tenant: &str) -> Option<u64> {
        self.order
            .iter()
            .find_map(|s| keys.get(*s))
            .map(|k| scoped(tenant, k))
    }

    /// Whether the body field `source` is read at all.
    pub fn reads(&self, source: SessionSource) -> bool {
        self.order.contains(&source)
    }
}

/// How sessions are kept and honoured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionConfig {
    /// Sessions bound at most; the least recently used is forgotten first.
    /// 0: no session is kept (keys are read and ignored).
    pub max_sessions: usize,
    /// A session not used for this long is forgotten.
    pub idle_timeout: Duration,
    /// A request waits for its session's saturated endpoint until its TTL
    /// instead of at most the affinity hold.
    pub hard: bool,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            max_sessions: 100_000,
            idle_timeout: Duration::from_secs(30 * 60),
            hard: false,
        }
    }
}

/// Session → the endpoint that served its last turn.
#[derive(Debug, Clone)]
pub struct SessionTable {
    bound: LruMap<(SocketAddr, Instant)>,
    idle_timeout: Duration,
}

impl SessionTable {
    pub fn new(config: &SessionConfig) -> Self {
        SessionTable {
            bound: LruMap::new(config.max_sessions),
            idle_timeout: config.idle_timeout,
        }
    }

    /// New limits (a config reload): the table starts over when its size
    /// changes (a session lost costs one cold prefill), and keeps its
    /// bindings otherwise.
    pub fn reconfigure(&mut self, config: &SessionConfig) {
        if self.bound.capacity() != config.max_sessions.min(u32::MAX as usize - 1) {
            self.bound = LruMap::new(config.max_sessions);
        }
        self.idle_timeout = config.idle_timeout;
    }

    /// Sessions bound (idle ones not yet swept included).
    pub fn len(&self) -> usize {
        self.bound.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bound.is_empty()
    }

    /// The endpoint `session` is bound to, unless it was idle too long.
    pub fn endpoint(&self, session: u64, now: Instant) -> Option<SocketAddr> {
        let &(addr, used) = self.bound.peek(session)?;
        (now.saturating_duration_since(used) < self.idle_timeout).then_some(addr)
    }

    /// Binds `session` to `addr` as of `now` (its turn went there), and
    /// forgets sessions idle too long.
    pub fn bind(&mut self, session: u64, addr: SocketAddr, now: Instant) {
        self.bound.insert(session, (addr, now));
        self.expire(now);
    }

    /// Forgets `session` (its endpoint is gone).
    pub fn release(&mut self, session: u64) {
        self.bound.remove(session);
    }

    /// Forgets the sessions idle for the timeout: the oldest first, so the
    /// cost is what expires.
    pub fn expire(&mut self, now: Instant) {
        while let Some((key, &(_, used))) = self.bound.oldest() {
            if now.saturating_duration_since(used) < self.idle_timeout {
                break;
            }
            self.bound.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn keys_are_bounded_and_scoped() {
        let k = |raw: &[u8]| key_hash(SessionSource::SessionIdHeader, raw);
        assert!(k(b"").is_none());
        assert!(k(b"   ").is_none());
        assert!(k(b"has space").is_none(), "visible ASCII only");
        assert!(k("caf\u{e9}".as_bytes()).is_none());
        assert!(k(&[b'a'; MAX_KEY_BYTES + 1]).is_none());
        assert!(k(&[b'a'; MAX_KEY_BYTES]).is_some());
        assert_eq!(k(b" abc "), k(b"abc"), "surrounding blanks do not count");
        // The same key from another header names the same session...
        assert_eq!(k(b"abc"), key_hash(SessionSource::PromptCacheKey, b"abc"));
        // ...a response id does not.
        assert_ne!(
            k(b"abc"),
            key_hash(SessionSource::PreviousResponseId, b"abc")
        );
        let h = k(b"abc").unwrap();
        assert_ne!(scoped("alpha", h), scoped("beta", h));
    }

    #[test]
    fn the_first_source_in_order_wins() {
        let mut keys = SessionKeys::default();
        keys.set(SessionSource::SessionIdHeader, b"from-header");
        keys.set(SessionSource::PromptCacheKey, b"from-body");
        keys.set(SessionSource::PromptCacheKey, b"a second value");
        let rules = SessionRules::default();
        let body = key_hash(SessionSource::PromptCacheKey, b"from-body").unwrap();
        assert_eq!(rules.session(&keys, "t"), Some(scoped("t", body)));
        let header_first = SessionRules {
            order: vec![
                SessionSource::SessionIdHeader,
                SessionSource::PromptCacheKey,
            ],
        };
        let header = key_hash(SessionSource::SessionIdHeader, b"from-header").unwrap();
        assert_eq!(header_first.session(&keys, "t"), Some(scoped("t", header)));
        let off = SessionRules { order: Vec::new() };
        assert_eq!(off.session(&keys, "t"), None);
    }

    #[test]
    fn sources_parse_by_the_names_clients_send() {
        for source in SessionSource::ALL {
            assert_eq!(source.name().parse::<SessionSource>(), Ok(source));
        }
        assert_eq!("session_id".parse(), Ok(SessionSource::CodexHeader));
        assert_eq!("X-Session-ID".parse(), Ok(SessionSource::SessionIdHeader));
        assert!("x-nope"
            .parse::<SessionSource>()
            .unwrap_err()
            .contains("known:"));
        for name in SessionSource::HEADER_NAMES {
            assert!(SessionSource::of_header(name).is_some(), "{name}");
        }
    }

    #[test]
    fn bindings_expire_when_idle_and_stay_bounded() {
        let config = SessionConfig {
            max_sessions: 3,
            idle_timeout: Duration::from_secs(60),
            hard: false,
        };
        let mut table = SessionTable::new(&config);
        let t0 = Instant::now();
        table.bind(1, addr(1), t0);
        assert_eq!(
            table.endpoint(1, t0 + Duration::from_secs(59)),
            Some(addr(1))
        );
        assert_eq!(table.endpoint(1, t0 + Duration::from_secs(60)), None);
        table.bind(1, addr(2), t0 + Duration::from_secs(30));
        assert_eq!(
            table.endpoint(1, t0 + Duration::from_secs(80)),
            Some(addr(2)),
            "a turn rebinds and renews"
        );
        for k in 2..1_000u64 {
            table.bind(k, addr(3), t0 + Duration::from_secs(31));
        }
        assert_eq!(table.len(), 3, "bounded by max_sessions");
        assert_eq!(table.endpoint(1, t0 + Duration::from_secs(31)), None);
        table.bind(5_000, addr(4), t0 + Duration::from_secs(200));
        assert_eq!(table.len(), 1, "idle sessions are swept");
        table.release(5_000);
        assert!(table.is_empty());
    }

    proptest::proptest! {
        /// Against a plain model: a session is found exactly when it was
        /// bound within the idle timeout and is among the `max_sessions`
        /// most recently bound, and the table never holds more.
        #[test]
        fn the_table_is_a_bounded_idle_expiring_map(
            ops in proptest::collection::vec((0u64..8, 0u16..3, 0u64..40), 1..200),
            max_sessions in 1usize..5,
        ) {
            let config = SessionConfig {
                max_sessions,
                idle_timeout: Duration::from_secs(60),
                hard: false,
            };
            let mut table = SessionTable::new(&config);
            let t0 = Instant::now();
            let mut now = t0;
            // (key, port, bound at), most recent last.
            let mut model: Vec<(u64, u16, Instant)> = Vec::new();
            for (key, port, wait) in ops {
                now += Duration::from_secs(wait);
                table.bind(key, addr(port), now);
                model.retain(|(k, _, _)| *k != key);
                model.push((key, port, now));
                let first = model.len().saturating_sub(max_sessions);
                model.drain(..first);
                proptest::prop_assert!(table.len() <= max_sessions);
                for probe in 0..8u64 {
                    let want = model
                        .iter()
                        .find(|(k, _, at)| *k == probe && now.duration_since(*at) < Duration::from_secs(60))
                        .map(|(_, p, _)| addr(*p));
                    proptest::prop_assert_eq!(table.endpoint(probe, now), want);
                }
            }
        }
    }
}
