//! API keys for the inference port (`--api-keys-file`) and the management
//! token (`--management-token`).
//!
//! The file is YAML: a list of keys, each bound to a tenant (the fairness id
//! of every request made with it, whatever headers the client sends) and
//! optionally to a priority ceiling:
//!
//! ```yaml
//! keys:
//!   - sha256: 2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
//!     tenant: acme
//!     maxPriority: 0      # optional: higher priorities are cut to this
//!     weight: 2           # optional: token-fairness weight (else the tenant's)
//!     name: acme-prod     # optional: the key's name in usage accounting
//!     quota: {requestsPerMinute: 60, tokensPerMinute: 10000}  # optional, see quotas
//!     debug: true         # optional: may ask `x-flowgate-debug: scores`
//!     ttftMs: 500         # optional: latency objective of its requests that name none
//!     tpotMs: 50
//!   - key: sk-test-only   # the key itself; prefer sha256 so nothing secret is at rest
//!     tenant: tests
//! ```
//!
//! Clients send `Authorization: Bearer <key>`. The presented key is hashed
//! and its digest compared with every stored digest in constant time (no
//! early exit), so response timing says nothing about how close a guess was.

pub use flowgate::admission::Grant;
use std::path::Path;

use flowgate::flow::valid_fairness_id;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::reply::Refusal;

/// Why a request was refused 401.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A key that is not in the file.
    Invalid,
}

impl AuthError {
    pub fn message(self) -> &'static str {
        match self {
            AuthError::Missing => {
                "this balancer requires an API key: send `Authorization: Bearer <key>`"
            }
            AuthError::Invalid => "invalid API key",
        }
    }
}

/// A secret kept only as its SHA-256 digest, compared in constant time.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; 32]);

impl Secret {
    pub fn new(secret: &str) -> Secret {
        Secret(sha256(secret.as_bytes()))
    }

    /// Whether `token` is this secret; takes as long whatever it is.
    pub fn matches(&self, token: &[u8]) -> bool {
        constant_time_eq(&self.0, &sha256(token))
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// The token of an `Authorization: Bearer <token>` header value; `None`
/// for no header, another scheme or an empty token.
pub fn bearer_token(authorization: Option<&[u8]>) -> Option<&[u8]> {
    let token = match authorization?.split_at_checked(7) {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case(b"bearer ") => rest.trim_ascii(),
        _ => return None,
    };
    (!token.is_empty()).then_some(token)
}

#[derive(Debug)]
struct Entry {
    digest: [u8; 32],
    grant: Grant,
}

/// The keys of `--api-keys-file`.
#[derive(Debug)]
pub struct ApiKeys {
    entries: Vec<Entry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    keys: Vec<KeyEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct KeyEntry {
    key: Option<String>,
    sha256: Option<String>,
    tenant: String,
    max_priority: Option<i32>,
    /// Token-fairness weight of the key's requests (else its tenant's).
    weight: Option<u32>,
    /// The key's name in usage accounting (default: its digest's first 12
    /// hex digits).
    name: Option<String>,
    /// The key's own quota, besides its tenant's.
    quota: Option<crate::quotas::LimitsSpec>,
    /// Its requests may ask why their endpoint was chosen
    /// (`x-flowgate-debug: scores`).
    #[serde(default)]
    debug: bool,
    /// The latency objective of the key's requests that name none
    /// (README "Latency objectives").
    ttft_ms: Option<u32>,
    tpot_ms: Option<u32>,
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

fn parse_hex_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Equality that looks at every byte whatever the first difference.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

impl ApiKeys {
    pub fn parse(text: &str) -> Result<ApiKeys, String> {
        let file: KeysFile = serde_saphyr::from_str(text).map_err(|e| e.to_string())?;
        if file.keys.is_empty() {
            return Err("`keys` is empty: every request would be refused".into());
        }
        let mut entries: Vec<Entry> = Vec::with_capacity(file.keys.len());
        for (i, k) in file.keys.into_iter().enumerate() {
            let at = format!("keys[{i}]");
            let digest = match (&k.key, &k.sha256) {
                (Some(key), None) if key.trim().is_empty() => {
                    return Err(format!("{at}: `key` is empty"))
                }
                (Some(key), None) => sha256(key.as_bytes()),
                (None, Some(hex)) => parse_hex_digest(hex.trim()).ok_or_else(|| {
                    format!(
                        "{at}: `sha256` must be 64 hex digits (e.g. `printf %s KEY | sha256sum`)"
                    )
                })?,
                _ => return Err(format!("{at}: give exactly one of `key` and `sha256`")),
            };
            if !valid_fairness_id(&k.tenant) {
                return Err(format!(
                    "{at}: tenant {:?} is not a valid fairness id (1-128 visible ASCII characters)",
                    k.tenant
                ));
            }
            if let Some(w) = k
                .weight
                .filter(|w| !(1..=flowgate::flow::MAX_WEIGHT).contains(w))
            {
                return Err(format!(
                    "{at}: weight must be 1..={}, not {w}",
                    flowgate::flow::MAX_WEIGHT
                ));
            }
            let key_id = match k.name {
                Some(name) if valid_fairness_id(&name) => name,
                Some(name) => {
                    return Err(format!(
                        "{at}: name {name:?} is not 1-128 visible ASCII characters"
                    ))
                }
                None => digest[..6].iter().map(|b| format!("{b:02x}")).collect(),
            };
            let quota = k
                .quota
                .as_ref()
                .map(|q| q.resolve(&format!("{at}.quota")))
                .transpose()?;
            if entries.iter().any(|e| e.digest == digest) {
                return Err(format!("{at}: the same key is listed twice"));
            }
            let objective = flowgate::objective::Objective {
                ttft_ms: k.ttft_ms,
                tpot_ms: k.tpot_ms,
            };
            objective.check().map_err(|e| format!("{at}: {e}"))?;
            entries.push(Entry {
                digest,
                grant: Grant {
                    tenant: k.tenant.into(),
                    max_priority: k.max_priority,
                    weight: k.weight,
                    key_id: key_id.into(),
                    quota,
                    debug: k.debug,
                    objective,
                },
            });
        }
        Ok(ApiKeys { entries })
    }

    pub fn load(path: &Path) -> Result<ApiKeys, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read API keys file {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("invalid API keys file {}: {e}", path.display()))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Checks an `Authorization` header value.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<&Grant, AuthError> {
        let token = bearer_token(authorization).ok_or(AuthError::Missing)?;
        let digest = sha256(token);
        let mut found = None;
        for e in &self.entries {
            if constant_time_eq(&e.digest, &digest) {
                found = Some(&e.grant);
            }
        }
        found.ok_or(AuthError::Invalid)
    }
}

/// 401, the code saying whether the key was missing or wrong.
impl From<AuthError> for Refusal {
    fn from(e: AuthError) -> Self {
        let code = match e {
            AuthError::Missing => "missing_api_key",
            AuthError::Invalid => "invalid_api_key",
        };
        Refusal::new(
            http::StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            code,
            e.message().to_string(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "
keys:
  - sha256: 2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
    tenant: acme
    maxPriority: 0
  - key: sk-other
    tenant: tests
    weight: 3
    name: ci
";

    #[test]
    fn hashed_and_plain_keys_grant_their_tenant_and_ceiling() {
        let keys = ApiKeys::parse(FILE).unwrap();
        assert_eq!(keys.len(), 2);
        // sha256("foo") is the digest above.
        let acme = keys.authenticate(Some(b"Bearer foo")).unwrap();
        assert_eq!(&*acme.tenant, "acme");
        assert_eq!(acme.priority(5), 0);
        assert_eq!(acme.priority(-1), -1);
        let tests = keys.authenticate(Some(b"bearer  sk-other ")).unwrap();
        assert_eq!(&*tests.tenant, "tests");
        assert_eq!(tests.priority(5), 5);
        assert_eq!((acme.weight, tests.weight), (None, Some(3)));
        assert_eq!(
            &*acme.key_id, "2c26b46b68ff",
            "the digest's first 12 hex digits"
        );
        assert_eq!(&*tests.key_id, "ci");
    }

    #[test]
    fn missing_malformed_and_unknown_keys_are_refused() {
        let keys = ApiKeys::parse(FILE).unwrap();
        assert_eq!(keys.authenticate(None), Err(AuthError::Missing));
        assert_eq!(
            keys.authenticate(Some(b"Basic Zm9v")),
            Err(AuthError::Missing)
        );
        assert_eq!(keys.authenticate(Some(b"Bearer ")), Err(AuthError::Missing));
        assert_eq!(keys.authenticate(Some(b"Bear")), Err(AuthError::Missing));
        assert_eq!(
            keys.authenticate(Some(b"Bearer fo")),
            Err(AuthError::Invalid)
        );
        assert_eq!(
            keys.authenticate(Some("Bearer fôo".as_bytes())),
            Err(AuthError::Invalid)
        );
    }

    #[test]
    fn a_secret_matches_only_itself() {
        let s = Secret::new("mgmt-token");
        assert!(s.matches(b"mgmt-token"));
        assert!(!s.matches(b"mgmt-toke"));
        assert!(!s.matches(b""));
        assert_eq!(format!("{s:?}"), "Secret(..)");
        assert_eq!(
            bearer_token(Some(b"Bearer mgmt-token")),
            Some(&b"mgmt-token"[..])
        );
        assert_eq!(bearer_token(Some(b"Token mgmt-token")), None);
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let err = |text: &str| ApiKeys::parse(text).unwrap_err();
        assert!(err("keys: []").contains("empty"));
        for w in ["0", "1001", "-1"] {
            let e = ApiKeys::parse(&format!(
                "keys:\n  - key: k\n    tenant: a\n    weight: {w}\n"
            ));
            assert!(e.is_err(), "weight {w}");
        }
        assert!(err("keys:\n  - tenant: a\n").contains("exactly one"));
        assert!(err("keys:\n  - key: k\n    tenant: a\n    ttftMs: 0\n").contains("ttftMs"));
        let keys = ApiKeys::parse("keys:\n  - key: k\n    tenant: a\n    tpotMs: 40\n").unwrap();
        let grant = keys.authenticate(Some(&b"Bearer k"[..])).unwrap();
        assert_eq!(grant.objective.tpot_ms, Some(40));
        assert!(err("keys:\n  - key: k\n    sha256: ab\n    tenant: a\n").contains("exactly one"));
        assert!(err("keys:\n  - sha256: xyz\n    tenant: a\n").contains("64 hex"));
        assert!(err("keys:\n  - key: ''\n    tenant: a\n").contains("empty"));
        assert!(err("keys:\n  - key: k\n    tenant: 'a b'\n").contains("fairness id"));
        assert!(
            err("keys:\n  - key: k\n    tenant: a\n  - key: k\n    tenant: b\n").contains("twice")
        );
        assert!(err("keys:\n  - key: k\n    tenant: a\n    extra: 1\n").contains("extra"));
    }
}
