//! What the proxy learns from a response body on its way to the client,
//! without holding it back: when the first and last bytes passed, how many
//! SSE events a stream carried, and the `usage` object (prompt and
//! completion tokens) that OpenAI-style answers end with: the last one of a
//! JSON body, or the final chunk of a stream asked for with
//! `stream_options.include_usage`.

use std::collections::VecDeque;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use flowgate::endpoint::Timing;
use flowgate::tokens::TokenUsage;
use memchr::memmem::Finder;
use serde::Deserialize;

/// Bytes kept from the end of a body to find `usage` in: it sits in the
/// last few hundred bytes of every known server's answer.
const TAIL: usize = 8 * 1024;

/// A `usage` object as the APIs write it: Chat Completions
/// (`prompt_tokens_details.cached_tokens`), Responses (`input_tokens`,
/// `input_tokens_details.cached_tokens`), Anthropic Messages
/// (`cache_read_input_tokens`).
#[derive(Deserialize)]
struct WireUsage {
    #[serde(default, alias = "input_tokens")]
    prompt_tokens: u64,
    #[serde(default, alias = "output_tokens")]
    completion_tokens: u64,
    #[serde(default, alias = "input_tokens_details")]
    prompt_tokens_details: Option<CachedDetails>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

/// llama.cpp's `timings`: `prompt_n` prompt tokens evaluated (in
/// `prompt_ms`) beyond the `cache_n` it found cached, `predicted_n`
/// generated (in `predicted_ms`).
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct Timings {
    #[serde(default)]
    prompt_n: u64,
    #[serde(default)]
    prompt_ms: Option<f64>,
    #[serde(default)]
    predicted_n: u64,
    #[serde(default)]
    predicted_ms: Option<f64>,
    #[serde(default)]
    cache_n: Option<u64>,
}

impl From<Timings> for TokenUsage {
    fn from(t: Timings) -> Self {
        TokenUsage {
            prompt: t.prompt_n.saturating_add(t.cache_n.unwrap_or(0)),
            completion: t.predicted_n,
            cached: t.cache_n.unwrap_or(0),
            cache_said: t.cache_n.is_some(),
        }
    }
}

/// What the end of an answer says: its usage (else what llama.cpp's
/// `timings` count, which its native routes end with), and the timings.
#[derive(Debug, Clone, Copy, Default)]
pub struct Said {
    pub usage: Option<TokenUsage>,
    pub timings: Option<Timings>,
}

/// A duration from an engine's milliseconds; nothing for a value that is
/// not one (negative, not finite, over a day).
fn engine_ms(ms: Option<f64>) -> Option<Duration> {
    ms.filter(|m| m.is_finite() && (0.0..86_400_000.0).contains(m))
        .map(|m| Duration::from_secs_f64(m / 1_000.0))
}

#[derive(Deserialize)]
struct CachedDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl From<WireUsage> for TokenUsage {
    fn from(w: WireUsage) -> Self {
        let details = w.prompt_tokens_details.and_then(|d| d.cached_tokens);
        let said = details.or(w.cache_read_input_tokens);
        TokenUsage {
            prompt: w.prompt_tokens,
            completion: w.completion_tokens,
            cached: said.unwrap_or(0).min(w.prompt_tokens),
            cache_said: said.is_some(),
        }
    }
}

/// Watches one response body.
#[derive(Debug, Default)]
pub struct ResponseMeter {
    /// `text/event-stream`: time to first token and per output token are
    /// measured on streams only.
    pub streaming: bool,
    first: Option<Instant>,
    last: Option<Instant>,
    /// SSE `data:` events other than `[DONE]`.
    events: u32,
    /// The last chunks, at least `TAIL` bytes of them when the body is that
    /// long: shared with the body, not copied.
    tail: VecDeque<Bytes>,
    tail_len: usize,
    /// Keep the answer's id (a Responses API answer, for the turn that
    /// continues it with `previous_response_id`).
    pub want_id: bool,
    response_id: Option<Box<[u8]>>,
}

impl ResponseMeter {
    /// Records a chunk going to the client at `now`.
    pub fn on_chunk(&mut self, chunk: &Bytes, now: Instant) {
        if chunk.is_empty() {
            return;
        }
        if self.want_id && self.first.is_none() {
            // The id comes first: the answer object's first key, or in a
            // stream the `response.created` event's response.
            self.response_id = first_id(chunk);
        }
        self.first.get_or_insert(now);
        self.last = Some(now);
        if self.streaming {
            // One pass: each `data:` is an event unless it is `[DONE]`.
            let events = (DATA.find_iter(chunk))
                .filter(|&at| !chunk[at..].starts_with(b"data: [DONE]"))
                .count();
            self.events = self.events.saturating_add(events as u32);
        }
        self.tail.push_back(chunk.clone());
        self.tail_len += chunk.len();
        while let Some(front) = self.tail.front() {
            if self.tail_len - front.len() < TAIL {
                break;
            }
            self.tail_len -= front.len();
            self.tail.pop_front();
        }
    }

    /// The answer's id, when [`ResponseMeter::want_id`] asked for it and
    /// its first chunk had one.
    pub fn response_id(&self) -> Option<&[u8]> {
        self.response_id.as_deref()
    }

    /// When the answer's first byte passed.
    pub fn first_byte_at(&self) -> Option<Instant> {
        self.first
    }

    /// From `start` to the first byte of a stream.
    pub fn time_to_first_token(&self, start: Instant) -> Option<Duration> {
        self.streaming
            .then_some(self.first?)
            .map(|first| first.saturating_duration_since(start))
    }

    /// The last usage object of the body, if it had one (else llama.cpp's
    /// `timings`, which its native routes end with).
    pub fn usage(&self) -> Option<TokenUsage> {
        self.said().usage
    }

    /// The body's last usage object and llama.cpp's `timings`, read once.
    pub fn said(&self) -> Said {
        let Some(last) = self.tail.back() else {
            return Said::default();
        };
        let last = &last[last.len().saturating_sub(TAIL)..];
        let mut usage = find_usage::<WireUsage>(last, &USAGE);
        let mut timings = find_usage::<Timings>(last, &TIMINGS);
        // A usage object the last chunk alone holds is the last one of the
        // joined tail too (and llama.cpp sends its timings in that chunk):
        // only one that began in an earlier chunk needs the chunks joined,
        // a copy of up to 8 KiB, once.
        if usage.is_none() && self.tail.len() > 1 {
            let mut joined = Vec::with_capacity(self.tail_len);
            self.tail.iter().for_each(|c| joined.extend_from_slice(c));
            let text = &joined[joined.len().saturating_sub(TAIL)..];
            usage = find_usage::<WireUsage>(text, &USAGE);
            if timings.is_none() {
                timings = find_usage::<Timings>(text, &TIMINGS);
            }
        }
        Said {
            usage: usage
                .map(TokenUsage::from)
                .or_else(|| timings.map(TokenUsage::from)),
            timings,
        }
    }

    /// What the answer showed of its engine's speed ([`Timing`]): the
    /// engine's own `timings` when it sent them (llama.cpp), else what the
    /// stream showed: prefill up to the first byte over the prompt tokens
    /// not cached, decode from the first byte to the last over the tokens
    /// after the first. `sent_at`: when the request went to the engine;
    /// `ended`: now.
    pub fn timing(&self, said: &Said, sent_at: Option<Instant>, ended: Instant) -> Option<Timing> {
        let sent_at = sent_at?;
        let service = Some(ended.saturating_duration_since(sent_at));
        if let Some(t) = said.timings {
            return Some(Timing {
                prefilled_tokens: t.prompt_n,
                prefill: engine_ms(t.prompt_ms),
                output_tokens: t.predicted_n,
                decode: engine_ms(t.predicted_ms),
                service,
            });
        }
        let (first, last) = (self.first?, self.last?);
        if !self.streaming {
            // A whole answer's first byte comes after its last token.
            return Some(Timing {
                service,
                ..Timing::default()
            });
        }
        let Some(usage) = said.usage else {
            // A stream that did not say its tokens: its service time only.
            return Some(Timing {
                service,
                ..Timing::default()
            });
        };
        Some(Timing {
            prefilled_tokens: usage.prompt.saturating_sub(usage.cached),
            prefill: Some(first.saturating_duration_since(sent_at)),
            output_tokens: usage.completion.saturating_sub(1),
            decode: Some(last.saturating_duration_since(first)),
            service,
        })
    }

    /// The tokens an answer spent, to settle its estimate and account its
    /// tenant with: its usage; for a stream cut short without one, the
    /// prompt (`prompt_estimate`) and one token per event sent; nothing
    /// for an engine's error (`status` 4xx/5xx, no usage). `None` when the
    /// body does not tell.
    pub fn spent(
        &self,
        usage: Option<TokenUsage>,
        prompt_estimate: u64,
        status: Option<u16>,
    ) -> Option<TokenUsage> {
        if usage.is_some() {
            return usage;
        }
        if status.is_some_and(|s| s >= 400) {
            return Some(TokenUsage::default());
        }
        (self.streaming && self.events > 0).then(|| TokenUsage {
            prompt: prompt_estimate,
            completion: u64::from(self.events),
            cached: 0,
            cache_said: false,
        })
    }

    /// Time per output token of a stream after the first:
    /// (last − first byte) / (tokens − 1), with the completion tokens from
    /// `usage` or else one per SSE event.
    pub fn time_per_output_token(&self, usage: Option<TokenUsage>) -> Option<Duration> {
        if !self.streaming {
            return None;
        }
        let tokens = usage.map_or(u64::from(self.events), |u| u.completion);
        let span = self.last?.saturating_duration_since(self.first?);
        (tokens >= 2).then(|| span / (tokens - 1).min(u64::from(u32::MAX)) as u32)
    }
}

/// The searchers of every chunk of a stream, built once (building one
/// costs more than searching a chunk).
static DATA: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"data:"));

static USAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\""));
static TIMINGS: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"timings\""));
static ID: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"id\""));

/// The string value of the first `"id"` key in `text` (at most
/// [`flowgate::session::MAX_KEY_BYTES`] bytes, no escapes), if it has one.
fn first_id(text: &[u8]) -> Option<Box<[u8]>> {
    let at = ID.find(text)? + 4;
    let rest = text[at..].trim_ascii_start().strip_prefix(b":")?;
    let rest = rest.trim_ascii_start().strip_prefix(b"\"")?;
    let end = rest
        .iter()
        .take(flowgate::session::MAX_KEY_BYTES + 1)
        .position(|&b| b == b'"' || b == b'\\')?;
    (end > 0 && rest[end] == b'"').then(|| rest[..end].into())
}

/// The last `"usage": {...}` (or other `key`) object in `text` that
/// parses; `"usage": null` (stream chunks before the last) is skipped.
/// The keys are found forwards (memmem's forward search is vectorised,
/// its reverse one goes byte by byte: 4 instructions a byte over the 8 KiB
/// tail of every stream); the last is tried first, and only when it does
/// not parse are the ones before it gathered, from the last.
fn find_usage<T: serde::de::DeserializeOwned>(text: &[u8], key: &Finder<'_>) -> Option<T> {
    let last = key.find_iter(text).last()?;
    if let Some(found) = object_after(text, last, key) {
        return Some(found);
    }
    // The key cannot overlap itself (it starts with a quote): every one
    // before the last ends before it.
    let before: Vec<usize> = key.find_iter(&text[..last]).collect();
    before
        .into_iter()
        .rev()
        .find_map(|at| object_after(text, at, key))
}

/// The object after `key` found at `at` in `text`, if one follows it and
/// parses.
fn object_after<T: serde::de::DeserializeOwned>(
    text: &[u8],
    at: usize,
    key: &Finder<'_>,
) -> Option<T> {
    let rest = text[at + key.needle().len()..].trim_ascii_start();
    let rest = rest.strip_prefix(b":")?.trim_ascii_start();
    if rest.first() != Some(&b'{') {
        return None;
    }
    // One value from the start of `rest`; what follows it is not read (a
    // whole-slice parse would need the object's end found first). Its
    // UTF-8 checked once, not key by key (as for a request body).
    match std::str::from_utf8(rest) {
        Ok(text) => T::deserialize(&mut serde_json::Deserializer::from_str(text)).ok(),
        Err(_) => T::deserialize(&mut serde_json::Deserializer::from_slice(rest)).ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn usage_is_found_at_the_end_of_a_json_answer() {
        let body = br#"{"choices":[{"message":{"content":"usage: {not this}"}}],
            "usage":{"completion_tokens":12,"prompt_tokens":30,"total_tokens":42},"timings":{}}"#;
        let mut m = ResponseMeter::default();
        let t0 = Instant::now();
        // Split anywhere: the tail joins the pieces.
        m.on_chunk(&Bytes::copy_from_slice(&body[..50]), t0);
        m.on_chunk(&Bytes::copy_from_slice(&body[50..]), t0);
        assert_eq!(
            m.usage(),
            Some(TokenUsage {
                prompt: 30,
                completion: 12,
                cached: 0,
                cache_said: false,
            })
        );
        assert_eq!(m.time_to_first_token(t0), None, "not a stream");
        assert_eq!(m.time_per_output_token(m.usage()), None);
    }

    #[test]
    fn the_last_usage_that_parses_is_the_one_read() {
        let whole = br#"{"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#;
        let read = |text: &[u8]| find_usage::<WireUsage>(text, &USAGE).map(TokenUsage::from);
        let five = read(whole).expect("a whole usage object");
        assert_eq!((five.prompt, five.completion), (5, 1));
        // After it: a null one, a cut-off one, a key that is no object.
        for after in [
            &br#"data: {"usage": null}"#[..],
            br#"data: {"usage":{"prompt_tokens":9"#,
            br#"{"content":""usage" alone"}"#,
        ] {
            let text = [&whole[..], b"\n\n", after].concat();
            assert_eq!(
                read(&text),
                Some(five),
                "{}",
                String::from_utf8_lossy(after)
            );
        }
        // Before it: the later one wins.
        let later = br#"{"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}"#;
        let seven = read(&[&whole[..], later].concat()).expect("two objects");
        assert_eq!((seven.prompt, seven.completion), (7, 2));
        assert_eq!(read(br#"{"usage": null}"#), None);
    }

    #[test]
    fn a_body_in_chunks_gives_what_it_gives_whole() {
        let body = br#"{"usage":{"prompt_tokens":7,"completion_tokens":1},"x":"usage",
            "timings":{"prompt_n":1,"predicted_n":2,"cache_n":3},"usage":null,
            "usage":{"prompt_tokens":30,"completion_tokens":12}}"#;
        let whole = {
            let mut m = ResponseMeter::default();
            m.on_chunk(&Bytes::copy_from_slice(body), Instant::now());
            m.usage()
        };
        assert_eq!(whole.map(|u| u.total()), Some(42));
        // Every split into two and three chunks: the object straddling a
        // split, `timings` alone in the last chunk, a usage only earlier.
        for a in 1..body.len() {
            for b in [a, (a + 17).min(body.len() - 1), body.len() - 1] {
                let mut m = ResponseMeter::default();
                for piece in [&body[..a], &body[a..b.max(a)], &body[b.max(a)..]] {
                    m.on_chunk(&Bytes::copy_from_slice(piece), Instant::now());
                }
                assert_eq!(m.usage(), whole, "split at {a} and {b}");
            }
        }
        let timings_last = [
            &br#"{"usage":{"prompt_tokens":5}"#[..],
            br#","timings":{"predicted_n":2}}"#,
        ];
        let mut m = ResponseMeter::default();
        for piece in timings_last {
            m.on_chunk(&Bytes::copy_from_slice(piece), Instant::now());
        }
        assert_eq!(
            m.usage().map(|u| u.prompt),
            Some(5),
            "usage counts before timings"
        );
    }

    #[test]
    fn responses_and_messages_usage_is_read_too() {
        for body in [
            &br#"{"object":"response","usage":{"input_tokens":9,"output_tokens":4,"total_tokens":13}}"#[..],
            &br#"{"type":"message","usage":{"input_tokens":9,"output_tokens":4}}"#[..],
        ] {
            let mut m = ResponseMeter::default();
            m.on_chunk(&Bytes::copy_from_slice(body), Instant::now());
            assert_eq!(
                m.usage(),
                Some(TokenUsage { prompt: 9, completion: 4, cached: 0, cache_said: false })
            );
        }
    }

    #[test]
    fn streams_give_ttft_tpot_and_their_final_usage() {
        let mut m = ResponseMeter {
            streaming: true,
            ..ResponseMeter::default()
        };
        let t0 = Instant::now();
        m.on_chunk(
            &Bytes::from_static(b"data: {\"choices\":[],\"usage\":null}\n\n"),
            t0 + 100 * MS,
        );
        for i in 1..=4 {
            let event = Bytes::from_static(b"data: {\"choices\":[{\"delta\":{}}]}\n\n");
            m.on_chunk(&event, t0 + (100 + 10 * i) * MS);
        }
        assert_eq!(m.time_to_first_token(t0), Some(100 * MS));
        // 5 events over 40 ms, no usage: 10 ms per token after the first.
        assert_eq!(m.usage(), None);
        assert_eq!(m.time_per_output_token(None), Some(10 * MS));
        m.on_chunk(
            &Bytes::from_static(
                b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n",
            ),
            t0 + 160 * MS,
        );
        let usage = m.usage().unwrap();
        assert_eq!(usage.completion, 3);
        // usage wins over the event count: 60 ms / 2.
        assert_eq!(m.time_per_output_token(Some(usage)), Some(30 * MS));
    }

    #[test]
    fn cached_tokens_and_llamacpp_timings_are_read() {
        for (body, want) in [
            (
                &br#"{"usage":{"prompt_tokens":50,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":32}}}"#[..],
                (50, 5, 32),
            ),
            (
                br#"{"usage":{"input_tokens":50,"output_tokens":5,"input_tokens_details":{"cached_tokens":16}}}"#,
                (50, 5, 16),
            ),
            (
                br#"{"type":"message","usage":{"input_tokens":50,"output_tokens":5,"cache_read_input_tokens":48}}"#,
                (50, 5, 48),
            ),
            // llama.cpp's native /completion: no usage, its timings.
            (
                br#"{"content":"hi","tokens_predicted":5,"timings":{"cache_n":40,"prompt_n":10,"predicted_n":5}}"#,
                (50, 5, 40),
            ),
            // More cached than prompted is not believed.
            (
                br#"{"usage":{"prompt_tokens":4,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":9}}}"#,
                (4, 1, 4),
            ),
        ] {
            let mut m = ResponseMeter::default();
            m.on_chunk(&Bytes::copy_from_slice(body), Instant::now());
            let u = m.usage().unwrap();
            assert_eq!((u.prompt, u.completion, u.cached), want);
            assert!(u.cache_said, "the engine said");
        }
        let mut m = ResponseMeter::default();
        m.on_chunk(
            &Bytes::from_static(br#"{"usage":{"prompt_tokens":50,"completion_tokens":5}}"#),
            Instant::now(),
        );
        assert!(
            !m.usage().unwrap().cache_said,
            "an engine that does not say"
        );
    }

    #[test]
    fn spent_tokens_settle_on_what_was_sent() {
        let spent = |m: &ResponseMeter, u, status| m.spent(u, 100, status).map(|u| u.total());
        let mut m = ResponseMeter {
            streaming: true,
            ..ResponseMeter::default()
        };
        assert_eq!(spent(&m, None, Some(200)), None, "nothing sent");
        for _ in 0..3 {
            m.on_chunk(
                &Bytes::from_static(b"data: {\"choices\":[{\"delta\":{}}]}\n\n"),
                Instant::now(),
            );
        }
        // Cut short: the prompt and one token per event.
        assert_eq!(spent(&m, None, Some(200)), Some(103));
        let usage = TokenUsage {
            prompt: 90,
            completion: 7,
            cached: 0,
            cache_said: false,
        };
        assert_eq!(spent(&m, Some(usage), Some(200)), Some(97));
        let plain = ResponseMeter::default();
        assert_eq!(spent(&plain, None, Some(500)), Some(0), "an engine error");
        assert_eq!(spent(&plain, None, None), None);
    }

    #[test]
    fn odd_bodies_give_nothing_and_never_panic() {
        for body in [
            &b""[..],
            b"\"usage\"",
            b"\"usage\":",
            b"\"usage\": {\"prompt_tokens\": 1",
            b"\"usage\": {\"prompt_tokens\": \"x\"}",
            b"}}}\"usage\":{}}}",
            b"\"usage\" : [1]",
        ] {
            let mut m = ResponseMeter::default();
            m.on_chunk(&Bytes::copy_from_slice(body), Instant::now());
            let u = m.usage();
            assert!(
                u.is_none() || u == Some(TokenUsage::default()),
                "{body:?}: {u:?}"
            );
        }
        let mut m = ResponseMeter::default();
        for _ in 0..5 {
            m.on_chunk(&Bytes::from(vec![b'x'; TAIL / 2 + 1]), Instant::now());
        }
        m.on_chunk(
            &Bytes::from_static(br#","usage":{"prompt_tokens":2}}"#),
            Instant::now(),
        );
        assert_eq!(m.usage().unwrap().prompt, 2);
        assert!(
            m.tail.len() <= 3,
            "only the chunks of the last {TAIL} bytes are kept"
        );
    }

    #[test]
    fn a_responses_answer_gives_its_id_from_its_first_chunk() {
        let now = Instant::now();
        let id_of = |chunks: &[&[u8]]| {
            let mut m = ResponseMeter {
                want_id: true,
                ..ResponseMeter::default()
            };
            for c in chunks {
                m.on_chunk(&Bytes::copy_from_slice(c), now);
            }
            m.response_id().map(<[u8]>::to_vec)
        };
        assert_eq!(
            id_of(&[br#"{"id": "resp_1","object":"response","output":[{"id":"msg_2"}]}"#]),
            Some(b"resp_1".to_vec())
        );
        let stream: &[u8] = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_9\"}}\n\n";
        assert_eq!(
            id_of(&[stream, br#"{"id":"later"}"#]),
            Some(b"resp_9".to_vec())
        );
        for odd in [
            &br#"{"object":"response"}"#[..],
            br#"{"id":7}"#,
            br#"{"id":"a\"b"}"#,
            br#"{"id":""}"#,
            br#"{"id":"unterminated"#,
        ] {
            assert_eq!(id_of(&[odd]), None, "{}", String::from_utf8_lossy(odd));
        }
        let long = format!(r#"{{"id":"{}"}}"#, "x".repeat(300));
        assert_eq!(id_of(&[long.as_bytes()]), None, "too long to be a key");
        let mut off = ResponseMeter::default();
        off.on_chunk(&Bytes::from_static(br#"{"id":"resp_1"}"#), now);
        assert_eq!(off.response_id(), None, "only when asked");
    }

    #[test]
    fn an_answer_shows_its_engines_speed() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // llama.cpp says it itself.
        let mut m = ResponseMeter::default();
        m.on_chunk(
            &Bytes::from_static(
                br#"{"content":"x","timings":{"prompt_n":100,"prompt_ms":50.5,"predicted_n":8,"predicted_ms":80,"cache_n":20}}"#,
            ),
            t0 + ms(200),
        );
        let t = m.timing(&m.said(), Some(t0), t0 + ms(210)).unwrap();
        assert_eq!((t.prefilled_tokens, t.output_tokens), (100, 8));
        assert_eq!(t.prefill, Some(Duration::from_micros(50_500)));
        assert_eq!(t.decode, Some(ms(80)));
        assert_eq!(t.service, Some(ms(210)));
        // A stream without timings: measured at the proxy.
        let mut m = ResponseMeter {
            streaming: true,
            ..ResponseMeter::default()
        };
        m.on_chunk(
            &Bytes::from_static(b"data: {\"choices\":[]}\n\n"),
            t0 + ms(300),
        );
        m.on_chunk(
            &Bytes::from_static(
                b"data: {\"usage\":{\"prompt_tokens\":500,\"completion_tokens\":11,\"prompt_tokens_details\":{\"cached_tokens\":100}}}\n\n",
            ),
            t0 + ms(400),
        );
        let t = m.timing(&m.said(), Some(t0), t0 + ms(401)).unwrap();
        assert_eq!((t.prefilled_tokens, t.prefill), (400, Some(ms(300))));
        assert_eq!((t.output_tokens, t.decode), (10, Some(ms(100))));
        // A stream that never says its tokens: only the service time.
        let mut m = ResponseMeter {
            streaming: true,
            ..ResponseMeter::default()
        };
        m.on_chunk(
            &Bytes::from_static(b"data: {\"choices\":[]}\n\n"),
            t0 + ms(30),
        );
        let t = m.timing(&m.said(), Some(t0), t0 + ms(60)).unwrap();
        assert_eq!((t.prefill, t.decode, t.service), (None, None, Some(ms(60))));
        // A whole answer without timings: only the service time.
        let mut m = ResponseMeter::default();
        m.on_chunk(
            &Bytes::from_static(br#"{"usage":{"prompt_tokens":5}}"#),
            t0 + ms(90),
        );
        let t = m.timing(&m.said(), Some(t0), t0 + ms(95)).unwrap();
        assert_eq!((t.prefill, t.decode, t.service), (None, None, Some(ms(95))));
        assert_eq!(m.timing(&Said::default(), None, t0), None, "never sent");
        // Nonsense from an engine teaches nothing.
        let mut m = ResponseMeter::default();
        m.on_chunk(
            &Bytes::from_static(
                br#"{"timings":{"prompt_n":100,"prompt_ms":-5,"predicted_ms":1e300}}"#,
            ),
            t0,
        );
        let t = m.timing(&m.said(), Some(t0), t0).unwrap();
        assert_eq!((t.prefill, t.decode), (None, None));
    }
}
