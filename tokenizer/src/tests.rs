//! Against golden ids written by Hugging Face's own `tokenizers` and
//! `jinja2` (`scripts/golden/tokenizer.py`): a byte-level BPE with ChatML
//! turns, and a Metaspace BPE that prepends its space to the first piece
//! only, with a BOS post-processor and a Llama-2 template.

use std::path::PathBuf;

use proptest::prelude::*;
use serde_json::{json, Value};

use minijinja::Value as Jinja;

use super::*;

/// A file under `golden/`.
fn golden_file(path: &str) -> Vec<u8> {
    std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("golden")
            .join(path),
    )
    .unwrap()
}

fn golden(name: &str) -> ModelTokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("golden")
        .join(name);
    ModelTokenizer::from_dir(&dir).expect("a golden tokenizer")
}

fn cases() -> Vec<Value> {
    serde_json::from_slice(&golden_file("cases.json")).unwrap()
}

/// `body`'s tokens, read from its bytes as the balancer reads them.
fn tokens(t: &ModelTokenizer, body: &Value, max: usize) -> Result<Tokens, Unsupported> {
    let bytes = serde_json::to_vec(body).unwrap();
    t.tokens(&Request::parse(&bytes).unwrap(), max)
}

fn render(t: &ModelTokenizer, body: &Value) -> String {
    let bytes = serde_json::to_vec(body).unwrap();
    t.render(&Request::parse(&bytes).unwrap()).unwrap()
}

fn ids(t: &ModelTokenizer, body: &Value) -> Result<Vec<u32>, Unsupported> {
    match tokens(t, body, usize::MAX)? {
        Tokens::Ids(ids) => Ok(ids),
        Tokens::TooMuchToEncode(_) => unreachable!("no limit"),
    }
}

/// A request body as a client sends the golden case (the chat's tools
/// left out: those are the engine's to render).
fn body_of(case: &Value) -> Value {
    let mut body = json!({"model": "m"});
    for field in ["messages", "prompt", "chat_template_kwargs"] {
        if let Some(v) = case.get(field) {
            body[field] = v.clone();
        }
    }
    body
}

#[test]
fn every_golden_chat_and_prompt_gives_the_engines_ids_first_and_remembered() {
    let tokenizers = [("chatml", golden("chatml")), ("llama", golden("llama"))];
    let mut checked = 0;
    // Twice over: the second round reads pieces remembered by the first.
    for round in 0..2 {
        for case in cases() {
            if case.get("tools").is_some() {
                continue;
            }
            let name = case["tokenizer"].as_str().unwrap();
            let (_, t) = tokenizers.iter().find(|(n, _)| *n == name).unwrap();
            let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            assert_eq!(
                ids(t, &body_of(&case)).unwrap(),
                want,
                "{name}: {} (round {round})",
                case["case"]
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 2 * 2 * 9);
}

#[test]
fn a_prompt_gets_what_the_post_processor_adds_a_chat_does_not() {
    let llama = golden("llama");
    let bos = llama.tokenizer.token_to_id("<s>").unwrap();
    assert_eq!(llama.around, (vec![bos], vec![]));
    assert_eq!(golden("chatml").around, (vec![], vec![]));
    let chat = ids(
        &llama,
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .unwrap();
    // The template writes the BOS once; nothing adds a second.
    assert_eq!(chat.iter().filter(|&&id| id == bos).count(), 1);
}

#[test]
fn a_long_new_completion_prompt_left_unencoded_keeps_its_special_tokens() {
    let t = golden("llama");
    let body = json!({ "prompt": "the water and the farm ".repeat(200) });
    let Tokens::TooMuchToEncode(unencoded) = tokens(&t, &body, 100).unwrap() else {
        panic!("more than 100 new bytes encoded");
    };
    // Encoded first off the loop, then from memory: the same ids, the
    // post-processor's BOS first both times.
    let off_loop = t.encode_all(&unencoded).unwrap();
    assert_eq!(off_loop, ids(&t, &body).unwrap());
    assert!(!t.around.0.is_empty(), "the llama tokenizer adds a BOS");
    assert_eq!(off_loop[..t.around.0.len()], t.around.0[..]);
}

#[test]
fn a_conversations_next_turn_encodes_only_what_it_added() {
    let t = golden("chatml");
    let long = "the water and the farm ".repeat(200);
    let mut messages = vec![json!({"role": "user", "content": long})];
    let first = json!({ "messages": messages });
    let Tokens::TooMuchToEncode(unencoded) = tokens(&t, &first, 100).unwrap() else {
        panic!("more than 100 new bytes encoded");
    };
    let first_ids = ids(&t, &first).unwrap();
    // What was left unencoded encodes as the whole prompt does.
    assert_eq!(t.encode_all(&unencoded).unwrap(), first_ids);
    messages.push(json!({"role": "assistant", "content": "a star"}));
    messages.push(json!({"role": "user", "content": "and then?"}));
    let next = json!({ "messages": messages });
    // Only the two new turns are encoded (well under 100 bytes).
    let Tokens::Ids(next_ids) = tokens(&t, &next, 100).unwrap() else {
        panic!("the first turn was not remembered");
    };
    assert_eq!(
        next_ids,
        t.tokenizer
            .encode_fast(render(&t, &next), false)
            .unwrap()
            .get_ids()
    );
    // The first turn's ids, up to its generation prompt, begin the next's.
    let common = first_ids.len() - 3;
    assert_eq!(first_ids[..common], next_ids[..common]);
}

#[test]
fn what_the_engine_renders_its_own_way_is_left_to_it() {
    let t = golden("chatml");
    let user = json!([{"role": "user", "content": "hi"}]);
    let with = |field: &str, v: Value| {
        let mut body = json!({ "messages": user });
        body[field] = v;
        tokens(&t, &body, usize::MAX).unwrap_err()
    };
    assert_eq!(
        with("tools", json!([{"type": "function"}])),
        Unsupported::Field("tools")
    );
    assert_eq!(
        with("documents", json!([{"text": "x"}])),
        Unsupported::Field("documents")
    );
    assert_eq!(
        with("chat_template", json!("{{ x }}")),
        Unsupported::Field("chat_template")
    );
    assert_eq!(
        with("continue_final_message", json!(true)),
        Unsupported::Field("continue_final_message")
    );
    // Absent in all but name: served in process.
    let plain = ids(&t, &json!({ "messages": user })).unwrap();
    let absent =
        json!({"messages": user, "tools": [], "documents": null, "continue_final_message": false});
    assert_eq!(ids(&t, &absent).unwrap(), plain);
    let message = |m: Value| tokens(&t, &json!({ "messages": [m] }), usize::MAX).unwrap_err();
    assert!(matches!(
        message(json!({"role": "assistant", "content": null, "tool_calls": []})),
        Unsupported::Message(_)
    ));
    assert!(matches!(
        message(
            json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})
        ),
        Unsupported::Message(_)
    ));
    assert!(matches!(
        message(json!({"content": "no role"})),
        Unsupported::Message(_)
    ));
    assert_eq!(
        tokens(&t, &json!({"prompt": [1, 2, 3]}), 0).unwrap_err(),
        Unsupported::NoPrompt
    );
    assert_eq!(
        tokens(&t, &json!({"input": "x"}), 0).unwrap_err(),
        Unsupported::NoPrompt
    );
}

#[test]
fn a_template_that_raises_or_is_missing_leaves_chats_to_the_engine() {
    let llama = golden("llama");
    let twice =
        json!({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]});
    match tokens(&llama, &twice, usize::MAX) {
        Err(Unsupported::Render(why)) => assert!(why.contains("alternate"), "{why}"),
        other => panic!("{other:?}"),
    }
    let tokenizer_json = golden_file("chatml/tokenizer.json");
    let bare = ModelTokenizer::from_parts(&tokenizer_json, None, None).unwrap();
    assert!(bare.template_problem().is_some());
    let chat = json!({"messages": [{"role": "user", "content": "a"}]});
    assert_eq!(
        tokens(&bare, &chat, 0).unwrap_err(),
        Unsupported::NoTemplate
    );
    assert!(ids(&bare, &json!({"prompt": "still encoded"})).is_ok());
    let unreadable =
        ModelTokenizer::from_parts(&tokenizer_json, None, Some("{% generation %}".into())).unwrap();
    assert!(unreadable.template_problem().is_some());
}

#[test]
fn files_that_are_not_a_tokenizer_are_refused_by_name() {
    let err = |r: Result<ModelTokenizer, LoadError>| r.err().expect("refused").to_string();
    assert!(err(ModelTokenizer::from_parts(b"{}", None, None)).starts_with("tokenizer.json"));
    let tokenizer_json = golden_file("chatml/tokenizer.json");
    assert!(err(ModelTokenizer::from_parts(
        &tokenizer_json,
        Some(b"[1]"),
        None
    ))
    .starts_with("tokenizer_config.json"));
    let missing = err(ModelTokenizer::from_dir(&PathBuf::from(
        "/nonexistent/flowgate",
    )));
    assert!(
        missing.contains("/nonexistent/flowgate/tokenizer.json"),
        "{missing}"
    );
}

#[test]
fn python_json_spacing_and_non_ascii_are_kept() {
    let t = ChatTemplate::new(
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}".into(),
        &serde_json::Map::new(),
    )
    .unwrap();
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("x".into(), json!({"a": [1, "é\n"], "b": {}}));
    assert_eq!(
        String::from_utf8(t.render(Jinja::from(Vec::<Jinja>::new()), false, &kwargs, 0).unwrap())
            .unwrap(),
        "{\"a\": [1, \"é\\n\"], \"b\": {}}|{\n  \"a\": [\n    1,\n    \"é\\n\"\n  ],\n  \"b\": {}\n}"
    );
}

/// Text mixing each tokenizer's added tokens with words, spaces and
/// newlines at any place.
fn texts() -> impl Strategy<Value = String> {
    let part = prop_oneof![
        Just("<|im_start|>".to_string()),
        Just("<|im_end|>".to_string()),
        Just("<s>".to_string()),
        Just("</s>".to_string()),
        Just(" ".to_string()),
        Just("\n".to_string()),
        "[a-zA-Z ]{1,12}",
        "[é中🙂]{1,2}",
    ];
    prop::collection::vec(part, 0..24).prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn piece_by_piece_gives_the_whole_texts_ids(texts in prop::collection::vec(texts(), 1..4)) {
        for t in [golden("chatml"), golden("llama")] {
            for text in &texts {
                let whole = t.tokenizer.encode_fast(text.as_str(), false).unwrap().get_ids().to_vec();
                prop_assert_eq!(t.pieces.encode(&t.tokenizer, &t.cutter, text.as_bytes(), usize::MAX).unwrap(), Some(whole));
            }
        }
    }
}

#[test]
fn a_huge_message_is_encoded_to_a_bound_its_ids_a_prefix_of_the_whole() {
    let t = golden("chatml");
    let huge = "the water é ".repeat(MAX_PIECE_BYTES / 10);
    assert!(huge.len() > MAX_PIECE_BYTES);
    let Tokens::Ids(ids) = tokens(&t, &json!({ "prompt": huge }), usize::MAX).unwrap() else {
        unreachable!()
    };
    assert!(ids.len() <= MAX_IDS);
    let head = &huge[..MAX_PIECE_BYTES + 4_000];
    let whole = t
        .tokenizer
        .encode_fast(head, false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert!(
        ids.len() > whole.len() / 2,
        "{} of {}",
        ids.len(),
        whole.len()
    );
    assert_eq!(ids[..], whole[..ids.len()]);
}
