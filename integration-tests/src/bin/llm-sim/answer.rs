//! What the simulated engine answers: a whole body or a stream of SSE
//! chunks, in each route's shape (chat, completions, Responses, Anthropic
//! Messages), with its usage.

use super::*;

pub(crate) fn text(tokens: u32) -> String {
    (0..tokens).map(|i| format!("tok{i} ")).collect()
}

/// Ids of Responses answers: unique across every simulated server of every
/// process, as a client chaining turns by `previous_response_id` needs.
static RESPONSES: AtomicU64 = AtomicU64::new(0);

/// The whole answer; its usage says `prompt` tokens of which `cached` came
/// from the prefix cache (OpenAI's `prompt_tokens_details`, which vLLM and
/// recent llama-server send too; only with a cache, `--prefix-cache-tokens`).
pub(crate) fn final_body(
    path: &str,
    id: u64,
    model: &str,
    tokens: u32,
    (prompt, cached): (u64, Option<u64>),
) -> serde_json::Value {
    let mut usage = json!({"prompt_tokens": prompt, "completion_tokens": tokens,
        "total_tokens": prompt + u64::from(tokens)});
    if let Some(cached) = cached {
        usage["prompt_tokens_details"] = json!({"cached_tokens": cached});
    }
    match path {
        "/v1/responses" => json!({
            "id": format!("resp_{}_{}", std::process::id(), RESPONSES.fetch_add(1, Ordering::Relaxed)),
            "object": "response", "created_at": 0, "status": "completed", "model": model,
            "output": [{"type": "message", "id": format!("msg_sim_{id}"), "role": "assistant",
                "content": [{"type": "output_text", "text": text(tokens)}]}],
            "usage": {"input_tokens": prompt, "output_tokens": tokens,
                "total_tokens": prompt + u64::from(tokens),
                "input_tokens_details": {"cached_tokens": cached.unwrap_or(0)}},
        }),
        "/v1/chat/completions" => json!({
            "id": format!("chatcmpl-sim-{id}"), "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text(tokens)}, "finish_reason": "length"}],
            "usage": usage,
        }),
        "/v1/embeddings" => json!({
            "object": "list", "model": model,
            "data": [{"object": "embedding", "index": 0, "embedding": [0.1, -0.2, 0.3, 0.0]}],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
        }),
        "/completion" => {
            json!({"content": text(tokens), "tokens_predicted": tokens, "stop": true, "model": model})
        }
        _ => json!({
            "id": format!("cmpl-sim-{id}"), "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": text(tokens), "finish_reason": "length"}],
            "usage": usage,
        }),
    }
}

pub(crate) fn chunk(path: &str, id: u64, model: &str, i: u32) -> String {
    let v = match path {
        "/v1/chat/completions" => json!({
            "id": format!("chatcmpl-sim-{id}"), "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": {"content": format!("tok{i} ")}, "finish_reason": null}],
        }),
        "/completion" => json!({"content": format!("tok{i} "), "stop": false}),
        _ => json!({
            "id": format!("cmpl-sim-{id}"), "object": "text_completion", "created": 0, "model": model,
            "choices": [{"index": 0, "text": format!("tok{i} "), "finish_reason": null}],
        }),
    };
    format!("data: {v}\n\n")
}

/// Sleeps for `d`; a zero delay returns at once (tokio's timer would round
/// it up to its next millisecond tick).
pub(crate) async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn stream_response(
    sim: Arc<Sim>,
    processing: Processing,
    path: String,
    id: u64,
    model: String,
    tokens: u32,
    ttft: Duration,
    tpot: Duration,
    fault: Option<Fault>,
    // Prompt tokens and the cached ones (with a cache), when the client
    // asked for a final usage chunk.
    usage: Option<(u64, Option<u64>)>,
) -> Response<Body> {
    let tpot = if fault == Some(Fault::SlowStream) {
        tpot.max(Duration::from_millis(200))
    } else {
        tpot
    };
    // State: (next token index, slot guard). The guard lives as long as the
    // body: a client that goes away drops it and frees the slot.
    let frames = futures_util::stream::unfold((0u32, Some(processing)), move |(i, guard)| {
        let sim = Arc::clone(&sim);
        let path = path.clone();
        let model = model.clone();
        let fault = fault.clone();
        async move {
            let guard = guard?;
            if i > tokens {
                return None;
            }
            if i == tokens {
                sim.tokens_total
                    .fetch_add(u64::from(tokens), Ordering::Relaxed);
                drop(guard);
                let mut last = String::new();
                if let Some((prompt_tokens, cached)) = usage {
                    let mut chunk = json!({
                        "id": format!("chatcmpl-sim-{id}"), "object": "chat.completion.chunk",
                        "created": 0, "model": model, "choices": [],
                        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                            "total_tokens": prompt_tokens + u64::from(tokens)},
                    });
                    if let Some(cached) = cached {
                        chunk["usage"]["prompt_tokens_details"] = json!({"cached_tokens": cached});
                    }
                    last = format!("data: {chunk}\n\n");
                }
                last.push_str("data: [DONE]\n\n");
                let done: Result<Frame<Bytes>, BoxError> = Ok(Frame::data(Bytes::from(last)));
                return Some((done, (i + 1, None)));
            }
            pause(if i == 0 { ttft } else { sim.engine.tpot(tpot) }).await;
            if fault == Some(Fault::DropMidStream) && i == tokens / 2 {
                let err: BoxError = "simulated connection drop".into();
                return Some((Err(err), (tokens + 1, None)));
            }
            let frame = Ok(Frame::data(Bytes::from(chunk(&path, id, &model, i))));
            Some((frame, (i + 1, Some(guard))))
        }
    });
    let mut r = Response::new(BodyExt::boxed(StreamBody::new(frames)));
    r.headers_mut().insert(
        "content-type",
        HeaderValue::from_static("text/event-stream"),
    );
    r
}
