//! The request headers flow control reads, under one set of names for
//! every front door: the flow's, and the session keys clients send
//! ([`crate::session::SessionSource`]).

use crate::objective::{LLMD_TPOT_HEADER, LLMD_TTFT_HEADER, TPOT_HEADER, TTFT_HEADER};
use crate::session::{SessionKeys, SessionSource};

/// Header naming the tenant a request belongs to (its fairness id).
pub const FAIRNESS_ID_HEADER: &str = "x-gateway-inference-fairness-id";
/// Header naming the request's objective, which maps to a priority.
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// Header with a numeric priority, honoured only with `allowClientPriority`.
pub const PRIORITY_HEADER: &str = "x-flowgate-priority";
/// Header with the longest time the request may wait (`500ms`, `5s`, or
/// milliseconds), cut to `maxRequestTTL`.
pub const TTL_HEADER: &str = "x-flowgate-request-ttl";
/// Header with which the balancer's own async dispatcher delivers a queued
/// request's session, hashed and scoped when it was submitted (16 hex
/// digits); honoured only from the dispatcher.
pub const DELIVERED_SESSION_HEADER: &str = "x-flowgate-delivered-session";
/// Header asking why the request's endpoint was chosen (`scores`),
/// answered only where the operator allows it.
pub const DEBUG_HEADER: &str = "x-flowgate-debug";
/// The body's type: a `multipart/form-data` body (the audio routes) is read
/// as a form, anything else as JSON.
pub const CONTENT_TYPE_HEADER: &str = "content-type";

/// The flow-control view of a request's headers (raw values: checking them
/// is [`crate::admission::PriorityRules::classify`]'s job).
#[derive(Debug, Default, Clone, Copy)]
pub struct FlowHeaders<'a> {
    pub fairness_id: Option<&'a [u8]>,
    pub objective: Option<&'a [u8]>,
    pub priority: Option<&'a [u8]>,
    pub ttl: Option<&'a [u8]>,
    pub content_type: Option<&'a [u8]>,
    /// The latency objective's parts ([`crate::objective`]): ours, and
    /// llm-d's names (read when ours is absent).
    pub slo_ttft: Option<&'a [u8]>,
    pub slo_tpot: Option<&'a [u8]>,
    pub llmd_slo_ttft: Option<&'a [u8]>,
    pub llmd_slo_tpot: Option<&'a [u8]>,
    /// The session keys of the headers, hashed.
    pub sessions: SessionKeys,
    /// What the request asks to be told ([`DEBUG_HEADER`]).
    pub debug: Option<&'a [u8]>,
    /// A queued request's session as delivered ([`DELIVERED_SESSION_HEADER`]).
    pub delivered_session: Option<&'a [u8]>,
}

impl<'a> FlowHeaders<'a> {
    /// Every header name this reads, lower case: a door that collects
    /// headers itself (EPP mode gets them as a list) keeps these.
    pub const NAMES: [&'static str; 17] = [
        FAIRNESS_ID_HEADER,
        OBJECTIVE_HEADER,
        PRIORITY_HEADER,
        TTL_HEADER,
        CONTENT_TYPE_HEADER,
        TTFT_HEADER,
        TPOT_HEADER,
        LLMD_TTFT_HEADER,
        LLMD_TPOT_HEADER,
        SessionSource::HEADER_NAMES[0],
        SessionSource::HEADER_NAMES[1],
        SessionSource::HEADER_NAMES[2],
        SessionSource::HEADER_NAMES[3],
        SessionSource::HEADER_NAMES[4],
        SessionSource::HEADER_NAMES[5],
        SessionSource::HEADER_NAMES[6],
        SessionSource::HEADER_NAMES[7],
    ];

    /// Whether the request asks why its endpoint was chosen
    /// (`x-flowgate-debug: scores`, one of a comma-separated list).
    pub fn asks_scores(&self) -> bool {
        self.debug.is_some_and(|v| {
            v.split(|&b| b == b',')
                .any(|item| item.trim_ascii().eq_ignore_ascii_case(b"scores"))
        })
    }

    /// The body's `multipart/form-data` content type, if it is a form.
    pub fn form(&self) -> Option<&'a str> {
        let ct = std::str::from_utf8(self.content_type?).ok()?;
        ct.trim_start()
            .get(..19)
            .is_some_and(|t| t.eq_ignore_ascii_case("multipart/form-data"))
            .then_some(ct)
    }

    /// Reads the flow headers through `get`, a case-insensitive lookup of
    /// one header's value. A new header rule is one field here and one
    /// name in [`Self::NAMES`].
    pub fn read(get: impl Fn(&str) -> Option<&'a [u8]>) -> Self {
        let mut sessions = SessionKeys::default();
        for name in SessionSource::HEADER_NAMES {
            if let (Some(value), Some(source)) = (get(name), SessionSource::of_header(name)) {
                sessions.set(source, value);
            }
        }
        FlowHeaders {
            fairness_id: get(FAIRNESS_ID_HEADER),
            objective: get(OBJECTIVE_HEADER),
            priority: get(PRIORITY_HEADER),
            ttl: get(TTL_HEADER),
            content_type: get(CONTENT_TYPE_HEADER),
            slo_ttft: get(TTFT_HEADER),
            slo_tpot: get(TPOT_HEADER),
            llmd_slo_ttft: get(LLMD_TTFT_HEADER),
            llmd_slo_tpot: get(LLMD_TPOT_HEADER),
            sessions,
            debug: get(DEBUG_HEADER),
            delivered_session: get(DELIVERED_SESSION_HEADER),
        }
    }

    /// Reads the flow headers in one pass over a request's headers, given
    /// as (lower-case name, value) pairs as `http::HeaderMap::iter` gives
    /// them; of a repeated header the first counts, as a lookup by name
    /// gives it. Cheaper on the request path than [`Self::read`]'s five
    /// lookups, each of which parses and hashes its name.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Self {
        let mut h = FlowHeaders::default();
        for (name, value) in pairs {
            let slot = match name {
                FAIRNESS_ID_HEADER => &mut h.fairness_id,
                OBJECTIVE_HEADER => &mut h.objective,
                PRIORITY_HEADER => &mut h.priority,
                TTL_HEADER => &mut h.ttl,
                CONTENT_TYPE_HEADER => &mut h.content_type,
                TTFT_HEADER => &mut h.slo_ttft,
                TPOT_HEADER => &mut h.slo_tpot,
                LLMD_TTFT_HEADER => &mut h.llmd_slo_ttft,
                LLMD_TPOT_HEADER => &mut h.llmd_slo_tpot,
                DEBUG_HEADER => &mut h.debug,
                DELIVERED_SESSION_HEADER => &mut h.delivered_session,
                _ => {
                    if let Some(source) = SessionSource::of_header(name) {
                        h.sessions.set(source, value);
                    }
                    continue;
                }
            };
            slot.get_or_insert(value);
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_name_it_lists() {
        let h = FlowHeaders::read(|name| {
            FlowHeaders::NAMES
                .iter()
                .find(|n| n.eq_ignore_ascii_case(name))
                .map(|n| n.as_bytes())
        });
        let got = [
            h.fairness_id,
            h.objective,
            h.priority,
            h.ttl,
            h.content_type,
            h.slo_ttft,
            h.slo_tpot,
            h.llmd_slo_ttft,
            h.llmd_slo_tpot,
        ];
        for (name, value) in FlowHeaders::NAMES.iter().zip(got) {
            assert_eq!(value, Some(name.as_bytes()));
            assert_eq!(*name, name.to_ascii_lowercase());
        }
    }

    #[test]
    fn one_pass_reads_what_lookups_read() {
        let pairs = [
            ("accept", &b"*/*"[..]),
            (TTL_HEADER, b"5s"),
            (FAIRNESS_ID_HEADER, b"acme"),
            (FAIRNESS_ID_HEADER, b"second"),
            (CONTENT_TYPE_HEADER, b"application/json"),
            ("session_id", b"codex-1"),
            ("x-smg-routing-key", b"k"),
            (TTFT_HEADER, b"500"),
            (LLMD_TPOT_HEADER, b"50"),
        ];
        let one_pass = FlowHeaders::from_pairs(pairs);
        let looked_up =
            FlowHeaders::read(|name| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| *v));
        fn fields<'a>(h: &FlowHeaders<'a>) -> [Option<&'a [u8]>; 9] {
            [
                h.fairness_id,
                h.objective,
                h.priority,
                h.ttl,
                h.content_type,
                h.slo_ttft,
                h.slo_tpot,
                h.llmd_slo_ttft,
                h.llmd_slo_tpot,
            ]
        }
        assert_eq!(fields(&one_pass), fields(&looked_up));
        assert_eq!(one_pass.sessions, looked_up.sessions);
        assert_ne!(one_pass.sessions, SessionKeys::default());
        let asks = |v: &'static [u8]| FlowHeaders::from_pairs([(DEBUG_HEADER, v)]).asks_scores();
        assert!(asks(b"scores") && asks(b"timing, Scores ") && !asks(b"score") && !asks(b""));
        assert_eq!(
            one_pass.fairness_id,
            Some(&b"acme"[..]),
            "the first of a repeated header"
        );
        assert_eq!(one_pass.objective, None);
    }
}
