//! llm-sim's KV-cache events (`--kv-events`), published from its real
//! prefix cache the way vLLM and SGLang publish theirs: a ZeroMQ PUB socket
//! sending `[topic, seq (8 bytes, big endian), msgpack batch]` every
//! [`EVERY`] while blocks changed, and a ROUTER replay socket answering
//! `[b"", start]` with every batch its ring still holds from there, then
//! `[b"", -1, b""]`. In the layout `--kv-events-layout` names: vLLM's
//! tagged maps (byte hashes), its older positional arrays, or SGLang's
//! (positional, integer hashes, trailing fields left off).
//!
//! Its tokenizer is a word of 4 prompt bytes per token (little-endian), so
//! a cache block of 64 bytes is a block of 16 tokens; `POST /tokenize`
//! answers the same token ids for a request body. With `--tokenizer`, a
//! prompt's bytes are its token ids from the model's own tokenizer (4
//! bytes each, [`prompt_bytes`]), so the same holds of the real ids.
//!
//! For tests, `POST /sim/kv-events` breaks the stream on purpose:
//! `{"drop": N}` leaves the next N batches unsent (the ring keeps them: a
//! gap a replay fills), `{"lose": N}` loses them from the ring too (a gap
//! no replay fills), `{"garbage": N}` sends N frames that are no msgpack,
//! `{"restart": true}` numbers from 0 again with an empty ring, as a
//! restarted engine does (the cache is cleared too).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rmpv::Value;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::cli::KvLayout;

/// How often pending events go out as one batch.
const EVERY: Duration = Duration::from_millis(10);
/// Batches the replay ring keeps (vLLM's `buffer_steps`).
const RING: usize = 10_000;
/// Tokens per block: a cache block of 64 bytes, 4 bytes a token.
pub(crate) const BLOCK_TOKENS: usize = 16;

/// One change to the cache.
#[derive(Debug, Clone)]
pub(crate) enum SimEvent {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    Removed {
        hashes: Vec<u64>,
    },
    Cleared,
}

/// Faults asked for by `POST /sim/kv-events`.
#[derive(Debug, Default, Clone, Copy, serde::Deserialize)]
pub(crate) struct Faults {
    #[serde(default)]
    pub(crate) drop: u32,
    #[serde(default)]
    pub(crate) lose: u32,
    #[serde(default)]
    pub(crate) garbage: u32,
    #[serde(default)]
    pub(crate) restart: bool,
}

/// Events waiting for the next batch, and the faults asked for.
#[derive(Default)]
pub(crate) struct Publisher {
    pending: Mutex<Vec<SimEvent>>,
    faults: Mutex<Faults>,
}

impl Publisher {
    pub(crate) fn push(&self, event: SimEvent) {
        self.pending.lock().unwrap().push(event);
    }

    /// Takes faults asked for; a restart empties the cache (`engine`)
    /// and drops the events not sent yet at once, so the events of a
    /// request that comes after it go out numbered from 0.
    pub(crate) fn fault(&self, f: Faults, engine: &crate::engine::Engine) {
        if f.restart {
            engine.clear_cache();
            self.pending.lock().unwrap().clear();
        }
        let mut faults = self.faults.lock().unwrap();
        faults.drop += f.drop;
        faults.lose += f.lose;
        faults.garbage += f.garbage;
        faults.restart |= f.restart;
    }
}

/// The token ids of a prompt: one per 4 bytes, the last zero-padded.
pub(crate) fn token_ids(prompt: &[u8]) -> Vec<u32> {
    prompt
        .chunks(4)
        .map(|w| {
            let mut word = [0u8; 4];
            word[..w.len()].copy_from_slice(w);
            u32::from_le_bytes(word)
        })
        .collect()
}

/// A request's prompt as the cache keys it: its text, or with a model's
/// tokenizer its token ids (little-endian words: [`token_ids`] reads them
/// back). A request the tokenizer leaves to the engine is read as text.
pub(crate) fn prompt_bytes(
    tokenizer: Option<&flowgate_tokenizer::ModelTokenizer>,
    body: &serde_json::Value,
) -> Vec<u8> {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let request = flowgate_tokenizer::Request::parse(&bytes);
    let counted = tokenizer
        .zip(request.ok())
        .map(|(t, r)| t.tokens(&r, usize::MAX));
    match counted {
        Some(Ok(flowgate_tokenizer::Tokens::Ids(ids))) => {
            ids.iter().flat_map(|id| id.to_le_bytes()).collect()
        }
        _ => flowgate_integration_tests::sim_cache::prompt_text(body),
    }
}

/// The events of one prompt's insertion into the cache: each run of new
/// blocks (chained to the block before it) stored, then the evicted ones
/// removed.
pub(crate) fn events_of(
    prompt: &[u8],
    blocks: &[u64],
    new: &[bool],
    evicted: Vec<u64>,
) -> Vec<SimEvent> {
    let tokens = token_ids(prompt);
    let mut out = Vec::new();
    let mut i = 0;
    while i < blocks.len() {
        if !new[i] {
            i += 1;
            continue;
        }
        let start = i;
        while i < blocks.len() && new[i] {
            i += 1;
        }
        out.push(SimEvent::Stored {
            hashes: blocks[start..i].to_vec(),
            parent: start.checked_sub(1).map(|p| blocks[p]),
            tokens: tokens[start * BLOCK_TOKENS..i * BLOCK_TOKENS].to_vec(),
        });
    }
    if !evicted.is_empty() {
        out.push(SimEvent::Removed { hashes: evicted });
    }
    out
}

fn hash_value(layout: KvLayout, h: u64) -> Value {
    match layout {
        KvLayout::Tagged => Value::Binary(h.to_be_bytes().to_vec()),
        KvLayout::Positional | KvLayout::Sglang => Value::from(h),
    }
}

fn encode_event(layout: KvLayout, event: &SimEvent) -> Value {
    let hashes = |hs: &[u64]| Value::Array(hs.iter().map(|&h| hash_value(layout, h)).collect());
    let s = |t: &str| Value::from(t);
    match (layout, event) {
        (
            KvLayout::Tagged,
            SimEvent::Stored {
                hashes: hs,
                parent,
                tokens,
            },
        ) => Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), hashes(hs)),
            (
                s("parent_block_hash"),
                parent.map_or(Value::Nil, |p| hash_value(layout, p)),
            ),
            (
                s("token_ids"),
                Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
            ),
            (s("block_size"), Value::from(BLOCK_TOKENS as u64)),
            (s("medium"), s("GPU")),
        ]),
        (KvLayout::Tagged, SimEvent::Removed { hashes: hs }) => Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), hashes(hs)),
            (s("medium"), s("GPU")),
        ]),
        (KvLayout::Tagged, SimEvent::Cleared) => {
            Value::Map(vec![(s("type"), s("AllBlocksCleared"))])
        }
        (
            _,
            SimEvent::Stored {
                hashes: hs,
                parent,
                tokens,
            },
        ) => {
            let mut fields = vec![
                s("BlockStored"),
                hashes(hs),
                parent.map_or(Value::Nil, |p| hash_value(layout, p)),
                Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
                Value::from(BLOCK_TOKENS as u64),
                Value::Nil,
            ];
            // vLLM's older layout goes on with the medium; SGLang stops.
            if layout == KvLayout::Positional {
                fields.push(s("GPU"));
            }
            Value::Array(fields)
        }
        (_, SimEvent::Removed { hashes: hs }) => {
            let mut fields = vec![s("BlockRemoved"), hashes(hs)];
            if layout == KvLayout::Positional {
                fields.push(s("GPU"));
            }
            Value::Array(fields)
        }
        (_, SimEvent::Cleared) => Value::Array(vec![s("AllBlocksCleared")]),
    }
}

fn encode_batch(layout: KvLayout, events: &[SimEvent]) -> Vec<u8> {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let events = Value::Array(events.iter().map(|e| encode_event(layout, e)).collect());
    let batch = match layout {
        KvLayout::Tagged => Value::Map(vec![
            (Value::from("ts"), Value::F64(ts)),
            (Value::from("events"), events),
            (Value::from("data_parallel_rank"), Value::from(0)),
        ]),
        KvLayout::Positional => Value::Array(vec![Value::F64(ts), events, Value::from(0)]),
        KvLayout::Sglang => Value::Array(vec![Value::F64(ts), events]),
    };
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("writes to a vector");
    out
}

/// `POST /sim/kv-events` (faults, module docs) and `POST /tokenize` (the
/// token ids of a request body, as vLLM's `/tokenize` answers them).
pub(crate) async fn route(
    publisher: Option<&Publisher>,
    tokenizer: Option<&flowgate_tokenizer::ModelTokenizer>,
    engine: &crate::engine::Engine,
    path: &str,
    req: hyper::Request<hyper::body::Incoming>,
) -> hyper::Response<crate::Body> {
    use http_body_util::BodyExt;
    use hyper::StatusCode;
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return crate::json_resp(
                StatusCode::BAD_REQUEST,
                serde_json::json!({"error": e.to_string()}),
            )
        }
    };
    if path == "/tokenize" {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else {
            return crate::json_resp(
                StatusCode::BAD_REQUEST,
                serde_json::json!({"error": "not JSON"}),
            );
        };
        let tokens = token_ids(&prompt_bytes(tokenizer, &v));
        return crate::json_resp(
            StatusCode::OK,
            serde_json::json!({"count": tokens.len(), "max_model_len": 131_072, "tokens": tokens}),
        );
    }
    let Some(publisher) = publisher else {
        return crate::json_resp(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "no --kv-events-port"}),
        );
    };
    match serde_json::from_slice::<Faults>(&body) {
        Ok(f) => {
            publisher.fault(f, engine);
            crate::json_resp(StatusCode::OK, serde_json::json!({"status": "ok"}))
        }
        Err(e) => crate::json_resp(
            StatusCode::BAD_REQUEST,
            serde_json::json!({"error": e.to_string()}),
        ),
    }
}

fn frames(topic: &str, seq: i64, payload: Bytes) -> ZmqMessage {
    let mut m = ZmqMessage::from(Bytes::copy_from_slice(topic.as_bytes()));
    m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
    m.push_back(payload);
    m
}

/// Binds `socket` at `host:port`, or says why not and exits.
async fn bind(socket: &mut impl Socket, host: std::net::IpAddr, port: u16, what: &str) -> String {
    match socket.bind(&format!("tcp://{host}:{port}")).await {
        Ok(endpoint) => endpoint.to_string(),
        Err(e) => {
            eprintln!("llm-sim: cannot bind the {what} socket: {e}");
            std::process::exit(1)
        }
    }
}

/// Binds the PUB and replay sockets on `host` (port 0: free ports) and
/// says where; then publishes for the life of the process.
pub(crate) async fn serve(
    publisher: Arc<Publisher>,
    host: std::net::IpAddr,
    port: u16,
    layout: KvLayout,
    topic: String,
) {
    let mut socket = PubSocket::new();
    let bound = bind(&mut socket, host, port, "kv events").await;
    let mut router = RouterSocket::new();
    let replay_port = if port == 0 { 0 } else { port.saturating_add(1) };
    let replay_bound = bind(&mut router, host, replay_port, "kv events replay").await;
    println!("kv events on {bound} replay {replay_bound}");
    let ring: Arc<Mutex<VecDeque<(i64, Bytes)>>> = Arc::default();
    let replay_ring = ring.clone();
    tokio::spawn(async move {
        while let Ok(request) = router.recv().await {
            let mut frames_in = request.into_vec();
            let Some(identity) = (!frames_in.is_empty()).then(|| frames_in.remove(0)) else {
                continue;
            };
            let start = frames_in
                .last()
                .and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok())
                .map_or(0, i64::from_be_bytes);
            let batches: Vec<(i64, Bytes)> = replay_ring
                .lock()
                .unwrap()
                .iter()
                .filter(|(seq, _)| *seq >= start)
                .cloned()
                .collect();
            let reply = |seq: i64, payload: Bytes| {
                let mut m = ZmqMessage::from(identity.clone());
                m.push_back(Bytes::new());
                m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                m.push_back(payload);
                m
            };
            for (seq, payload) in batches {
                if router.send(reply(seq, payload)).await.is_err() {
                    break;
                }
            }
            let _ = router.send(reply(-1, Bytes::new())).await;
        }
    });
    let mut seq: i64 = 0;
    let mut tick = tokio::time::interval(EVERY);
    loop {
        tick.tick().await;
        let faults = std::mem::take(&mut *publisher.faults.lock().unwrap());
        if faults.restart {
            ring.lock().unwrap().clear();
            seq = 0;
        }
        for _ in 0..faults.garbage {
            let _ = socket
                .send(frames(&topic, seq, Bytes::from_static(b"\xc1 not msgpack")))
                .await;
            seq += 1;
        }
        let mut lose = faults.lose;
        let mut unsent = faults.drop;
        let events = std::mem::take(&mut *publisher.pending.lock().unwrap());
        // A fault asks for batches: empty ones stand in when nothing changed.
        let batches = if events.is_empty() {
            (lose + unsent) as usize
        } else {
            1.max((lose + unsent) as usize)
        };
        let mut events = Some(events);
        for _ in 0..batches {
            let payload = Bytes::from(encode_batch(layout, &events.take().unwrap_or_default()));
            if lose > 0 {
                lose -= 1;
            } else {
                {
                    let mut ring = ring.lock().unwrap();
                    if ring.len() == RING {
                        ring.pop_front();
                    }
                    ring.push_back((seq, payload.clone()));
                }
                if unsent > 0 {
                    unsent -= 1;
                } else {
                    let _ = socket.send(frames(&topic, seq, payload)).await;
                }
            }
            seq += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_stores_its_runs_of_new_blocks_chained_in_order() {
        let prompt: Vec<u8> = (0..192u8).collect();
        let blocks = [10, 20, 30];
        let events = events_of(&prompt, &blocks, &[true, false, true], vec![7]);
        assert_eq!(events.len(), 3);
        let SimEvent::Stored {
            hashes,
            parent,
            tokens,
        } = &events[1]
        else {
            panic!("{events:?}")
        };
        assert_eq!((hashes.as_slice(), *parent), (&[30][..], Some(20)));
        assert_eq!(tokens.len(), BLOCK_TOKENS);
        assert_eq!(tokens[0], u32::from_le_bytes([128, 129, 130, 131]));
        assert!(matches!(&events[2], SimEvent::Removed { hashes } if hashes == &[7]));
    }

    #[test]
    fn every_layout_decodes_as_the_agent_reads_it() {
        let events = vec![
            SimEvent::Stored {
                hashes: vec![1],
                parent: None,
                tokens: vec![5; BLOCK_TOKENS],
            },
            SimEvent::Removed { hashes: vec![1] },
            SimEvent::Cleared,
        ];
        for layout in [KvLayout::Tagged, KvLayout::Positional, KvLayout::Sglang] {
            let batch = flowgate::kv_events::decode_batch(&encode_batch(layout, &events))
                .unwrap_or_else(|e| panic!("{layout:?}: {e}"));
            assert_eq!(batch.events.len(), 3, "{layout:?}: {batch:?}");
            assert!(batch.skipped.is_empty(), "{layout:?}");
        }
    }
}
