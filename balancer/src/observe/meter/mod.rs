//! What the proxy learns from a response body on its way to the client,
//! without holding it back: when the first and last bytes passed, how many
//! SSE events a stream carried, and the `usage` object (prompt and
//! completion tokens) that OpenAI-style answers end with: the last one of a
//! JSON body, or of a stream's last three events (OpenAI's chat sends one
//! only when asked with `stream_options.include_usage`).

use std::borrow::Cow;
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
    /// The last chunk ended inside a line (the next does not start one).
    mid_line: bool,
    /// Where the last [`LAST_EVENTS`] events began (offsets in the body;
    /// the newest last): a stream's usage is in them.
    event_starts: [u64; LAST_EVENTS],
    /// The body's bytes so far.
    seen: u64,
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
            let base = self.seen;
            data_lines(chunk, !self.mid_line, |at| {
                self.events = self.events.saturating_add(1);
                self.event_starts.rotate_left(1);
                self.event_starts[LAST_EVENTS - 1] = base + at as u64;
            });
            self.mid_line = !chunk.ends_with(b"\n") && !chunk.ends_with(b"\r");
        }
        self.seen += chunk.len() as u64;
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
    /// From `start` to the answer's first byte: a stream's first token, a
    /// whole answer's end (its first token came no later).
    pub fn time_to_first_byte(&self, start: Instant) -> Option<Duration> {
        self.first
            .map(|first| first.saturating_duration_since(start))
    }

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
    /// A stream's are in its last events (OpenAI's usage chunk and
    /// llama.cpp's timings the last before `[DONE]`, Anthropic's
    /// `message_delta` the last before `message_stop`, the Responses API's
    /// `response.completed` the last): only those are searched, not the
    /// whole tail of a stream that has none.
    pub fn said(&self) -> Said {
        let Some(last) = self.tail.back() else {
            return Said::default();
        };
        if let Some(events) = self.last_events() {
            // At most the tail's worth, as for any body: an event can be
            // as long as an upstream makes it.
            let text = &events[events.len().saturating_sub(TAIL)..];
            let (usage, timings) = usage_and_timings(text);
            return said_in(usage, timings);
        }
        let last = &last[last.len().saturating_sub(TAIL)..];
        let (mut usage, mut timings) = usage_and_timings(last);
        // A usage object the last chunk alone holds is the last one of the
        // joined tail too (and llama.cpp sends its timings in that chunk):
        // only one that began in an earlier chunk needs the chunks joined,
        // a copy of up to 8 KiB, once.
        if usage.is_none() && self.tail.len() > 1 {
            let mut joined = Vec::with_capacity(self.tail_len);
            self.tail.iter().for_each(|c| joined.extend_from_slice(c));
            let text = &joined[joined.len().saturating_sub(TAIL)..];
            let (joined_usage, joined_timings) = usage_and_timings(text);
            usage = joined_usage;
            timings = timings.or(joined_timings);
        }
        said_in(usage, timings)
    }

    /// A stream's bytes from the start of its last [`LAST_EVENTS`] events
    /// to its end, when the tail still holds them (borrowed when they are
    /// all in the last chunk, as they mostly are).
    fn last_events(&self) -> Option<Cow<'_, [u8]>> {
        if !self.streaming || self.events == 0 {
            return None;
        }
        let recorded = (self.events as usize).min(LAST_EVENTS);
        let from = self.event_starts[LAST_EVENTS - recorded];
        let tail_start = self.seen - self.tail_len as u64;
        let mut skip = usize::try_from(from.checked_sub(tail_start)?).ok()?;
        let mut chunks = self.tail.iter();
        let mut first = chunks.next()?;
        while skip >= first.len() {
            skip -= first.len();
            first = chunks.next()?;
        }
        if chunks.len() == 0 {
            return Some(Cow::Borrowed(&first[skip..]));
        }
        let mut joined = Vec::with_capacity(self.tail_len);
        joined.extend_from_slice(&first[skip..]);
        chunks.for_each(|c| joined.extend_from_slice(c));
        Some(Cow::Owned(joined))
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
        // A streamed answer's first byte is its first token.
        let first_token = self
            .first
            .filter(|_| self.streaming)
            .map(|first| first.saturating_duration_since(sent_at));
        if let Some(t) = said.timings {
            return Some(Timing {
                prefilled_tokens: t.prompt_n,
                prefill: engine_ms(t.prompt_ms),
                output_tokens: t.predicted_n,
                decode: engine_ms(t.predicted_ms),
                service,
                first_token,
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
            first_token,
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

/// How many of a stream's last events its usage is looked for in.
const LAST_EVENTS: usize = 3;

/// Calls `event_at` with the offset of each SSE `data:` line that begins
/// in `chunk`, other than `data: [DONE]`: each an event (a field is a
/// line's start; `line_start`: the chunk begins one). Line ends found with
/// `memchr2`, a few a chunk: a substring search for `data:` cost more to
/// start than to run on a chunk of one event (~280 instructions a call,
/// two a chunk), and found it inside lines too.
fn data_lines(chunk: &[u8], line_start: bool, mut event_at: impl FnMut(usize)) {
    let is_event = |line: &[u8]| line.starts_with(b"data:") && !line.starts_with(b"data: [DONE]");
    if line_start && is_event(chunk) {
        event_at(0);
    }
    for end in memchr::memchr2_iter(b'\n', b'\r', chunk) {
        if is_event(&chunk[end + 1..]) {
            event_at(end + 1);
        }
    }
}

/// What an answer said, from its usage and timings objects.
fn said_in(usage: Option<WireUsage>, timings: Option<Timings>) -> Said {
    Said {
        usage: usage
            .map(TokenUsage::from)
            .or_else(|| timings.map(TokenUsage::from)),
        timings,
    }
}

/// The searchers of an answer's tail, built once (building one costs more
/// than searching it).
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

/// The last usage object of `text` and llama.cpp's `timings`. llama.cpp
/// writes `timings` after `usage`, in its answers and in its last stream
/// event alike, so once a usage object is found only what follows it is
/// searched for them (the tail searched once, not twice); without one,
/// all of it (llama.cpp's native routes and streams without usage).
fn usage_and_timings(text: &[u8]) -> (Option<WireUsage>, Option<Timings>) {
    match find_usage_at::<WireUsage>(text, &USAGE) {
        Some((at, usage)) => (Some(usage), find_usage(&text[at..], &TIMINGS)),
        None => (None, find_usage(text, &TIMINGS)),
    }
}

/// The last `"usage": {...}` (or other `key`) object in `text` that
/// parses; `"usage": null` (stream chunks before the last) is skipped.
/// The keys are found forwards (memmem's forward search is vectorised,
/// its reverse one goes byte by byte: 4 instructions a byte over the 8 KiB
/// tail of every stream); the last is tried first, and only when it does
/// not parse are the ones before it gathered, from the last.
fn find_usage<T: serde::de::DeserializeOwned>(text: &[u8], key: &Finder<'_>) -> Option<T> {
    find_usage_at(text, key).map(|(_, found)| found)
}

/// [`find_usage`], with where in `text` its key was found.
fn find_usage_at<T: serde::de::DeserializeOwned>(
    text: &[u8],
    key: &Finder<'_>,
) -> Option<(usize, T)> {
    let last = key.find_iter(text).last()?;
    if let Some(found) = object_after(text, last, key) {
        return Some((last, found));
    }
    // The key cannot overlap itself (it starts with a quote): every one
    // before the last ends before it.
    let before: Vec<usize> = key.find_iter(&text[..last]).collect();
    before
        .into_iter()
        .rev()
        .find_map(|at| Some((at, object_after(text, at, key)?)))
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
mod tests;
