use super::*;

const MS: Duration = Duration::from_millis(1);

/// A stream's meter after `pieces`, each a chunk.
fn streamed<'a>(pieces: impl IntoIterator<Item = &'a [u8]>) -> ResponseMeter {
    let mut m = ResponseMeter {
        streaming: true,
        ..ResponseMeter::default()
    };
    let t0 = Instant::now();
    for p in pieces {
        m.on_chunk(&Bytes::copy_from_slice(p), t0);
    }
    m
}

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
fn events_are_the_data_lines_wherever_the_chunks_split() {
    let stream: &[u8] = b"data: {\"text\":\"say data: x\\n\"}\n\nevent: e\ndata: {}\r\n\r\n\
data:{}\r\rdata: [DONE]\n\n";
    let count = |cuts: &[usize]| {
        let ends = cuts.iter().copied().chain([stream.len()]);
        let starts = [0].into_iter().chain(cuts.iter().copied());
        streamed(starts.zip(ends).map(|(from, to)| &stream[from..to])).events
    };
    assert_eq!(
        count(&[]),
        3,
        "`data:` inside a line is no event, nor [DONE]"
    );
    // Cut at every line end, and inside lines (not inside a `data:`).
    let ends: Vec<usize> = (1..stream.len())
        .filter(|&i| matches!(stream[i - 1], b'\n' | b'\r'))
        .collect();
    assert_eq!(count(&ends), 3);
    assert_eq!(count(&[10, 30, 52]), 3);
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
        &br#"{"object":"response","usage":{"input_tokens":9,"output_tokens":4,"total_tokens":13}}"#
            [..],
        &br#"{"type":"message","usage":{"input_tokens":9,"output_tokens":4}}"#[..],
    ] {
        let mut m = ResponseMeter::default();
        m.on_chunk(&Bytes::copy_from_slice(body), Instant::now());
        assert_eq!(
            m.usage(),
            Some(TokenUsage {
                prompt: 9,
                completion: 4,
                cached: 0,
                cache_said: false
            })
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
fn a_streams_usage_is_read_from_its_last_events_wherever_they_split() {
    let meter = |pieces: &[&[u8]]| {
        let usage = streamed(pieces.iter().copied()).usage();
        usage.map(|u| (u.prompt, u.completion))
    };
    // Anthropic Messages: the usage in `message_delta`, then
    // `message_stop`.
    let messages: &[u8] = b"event: message_delta\ndata: {\"type\":\"message_delta\",\
\"usage\":{\"input_tokens\":9,\"output_tokens\":4}}\n\n\
event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
    let mut events = vec![&b"data: {\"delta\":\"a\"}\n\n"[..]; 3];
    events.push(messages);
    assert_eq!(meter(&events), Some((9, 4)));
    // The usage event cut anywhere, in two chunks or three.
    let chat: &[u8] = b"data: {\"choices\":[]}\n\ndata: {\"choices\":[],\
\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n";
    for a in 1..chat.len() {
        assert_eq!(meter(&[&chat[..a], &chat[a..]]), Some((7, 3)), "cut at {a}");
        let b = (a + 9).min(chat.len());
        let three = [&chat[..a], &chat[a..b], &chat[b..]];
        assert_eq!(meter(&three), Some((7, 3)), "cut at {a}, {b}");
    }
    // A usage that more than three events follow is not the stream's.
    let mut early = vec![&b"data: {\"usage\":{\"prompt_tokens\":1}}\n\n"[..]];
    early.extend([&b"data: {}\n\n"[..]; 3]);
    assert_eq!(meter(&early), None);
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
        &Bytes::from_static(br#"{"timings":{"prompt_n":100,"prompt_ms":-5,"predicted_ms":1e300}}"#),
        t0,
    );
    let t = m.timing(&m.said(), Some(t0), t0).unwrap();
    assert_eq!((t.prefill, t.decode), (None, None));
}

#[test]
fn llamacpp_timings_after_its_usage_are_read_with_it() {
    // llama-server's answers, whole and streamed: usage, then timings
    // (as captured from a real one, trimmed).
    let whole = &br#"{"choices":[],"object":"chat.completion","usage":{"completion_tokens":20,"prompt_tokens":23,"total_tokens":43,"prompt_tokens_details":{"cached_tokens":3}},"id":"chatcmpl-1","timings":{"cache_n":3,"prompt_n":20,"prompt_ms":417.3,"predicted_n":20,"predicted_ms":1014.5}}"#[..];
    let streamed = &b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":20,\"prompt_tokens\":23,\"prompt_tokens_details\":{\"cached_tokens\":3}},\"timings\":{\"cache_n\":3,\"prompt_n\":20,\"prompt_ms\":417.3,\"predicted_n\":20,\"predicted_ms\":1014.5}}\n\ndata: [DONE]\n\n"[..];
    for body in [whole, streamed] {
        let mut m = ResponseMeter::default();
        m.on_chunk(&Bytes::copy_from_slice(body), Instant::now());
        let said = m.said();
        let u = said.usage.expect("usage");
        assert_eq!((u.prompt, u.completion, u.cached), (23, 20, 3));
        let t = said.timings.expect("timings");
        assert_eq!((t.prompt_n, t.predicted_n, t.cache_n), (20, 20, Some(3)));
    }
}
