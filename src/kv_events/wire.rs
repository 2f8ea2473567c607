//! An engine's KV-cache event batch as it comes off the wire: one msgpack
//! payload, in either layout vLLM and SGLang send.
//!
//! - **Tagged maps** (vLLM since PR #42892, May 2026): a batch is a map
//!   `{"ts", "events", "data_parallel_rank"}` (a `"type"` key, if any, is
//!   ignored), each event a map tagged `"type"`: `BlockStored`,
//!   `BlockRemoved` or `AllBlocksCleared`.
//! - **Positional arrays** (vLLM before, SGLang today): a batch is
//!   `[ts, events, data_parallel_rank]`, an event `["BlockStored",
//!   block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//!   medium, lora_name, extra_keys, …]`, `["BlockRemoved", block_hashes,
//!   medium, …]` or `["AllBlocksCleared"]`. Fields equal to their default
//!   may be left off the end.
//!
//! Hashes are 64-bit integers or bytes (vLLM's sha256 digests); either is
//! folded to the 64 bits an [`EngineHash`] keeps, which name a block only
//! to its removal: blocks are keyed by their tokens ([`super::key`]).
//!
//! Nothing an engine sends panics the decoder: a payload that is no
//! msgpack or no batch is an error; an event of an unknown type, on an
//! unknown medium or missing a field it needs is skipped and counted
//! ([`Skipped`]); fields it does not know are ignored.

use rmpv::ValueRef;

use super::key::{extra_digest, fold_bytes};

/// An engine's own name for a block, folded to 64 bits: what its later
/// removal names.
pub type EngineHash = u64;

/// Where an engine keeps a block: a GPU block is prefilled from at once, a
/// CPU-offloaded one must be copied back first, so it is worth less.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    Gpu,
    Cpu,
}

impl Medium {
    pub const ALL: [Medium; 2] = [Medium::Gpu, Medium::Cpu];

    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "gpu",
            Medium::Cpu => "cpu",
        }
    }

    /// The medium an event names; none (engines before media were
    /// reported) is the GPU. `None` for a medium Flowgate does not know
    /// (a disk tier, a connector's own): its blocks are skipped.
    fn parse(name: Option<&str>) -> Option<Medium> {
        match name {
            None => Some(Medium::Gpu),
            Some(n) if n.eq_ignore_ascii_case("gpu") || n.eq_ignore_ascii_case("cuda") => {
                Some(Medium::Gpu)
            }
            Some(n) if n.eq_ignore_ascii_case("cpu") => Some(Medium::Cpu),
            Some(_) => None,
        }
    }
}

/// Blocks an engine stored: `hashes[i]` holds tokens `token_ids[i *
/// block_size ..][.. block_size]`, chained to `parent` (the block before
/// the first, none for a prompt's first block).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub hashes: Vec<EngineHash>,
    pub parent: Option<EngineHash>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub medium: Medium,
    /// Per block, what besides its tokens names it (the adapter, a cache
    /// salt, an image's hash) folded by [`extra_digest`]; 0 for none.
    pub extras: Vec<u64>,
}

/// One event of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Stored(Stored),
    Removed {
        hashes: Vec<EngineHash>,
        medium: Medium,
    },
    /// The engine dropped every block (a cache reset).
    Cleared,
}

/// Why an event of a batch was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skipped {
    /// An event type Flowgate does not know.
    UnknownType,
    /// A medium Flowgate does not know.
    UnknownMedium,
    /// A field the event needs is missing or of the wrong kind.
    Malformed,
}

/// A decoded batch: its events in order, and those skipped.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    /// The engine's clock when it sent the batch (seconds).
    pub ts: f64,
    pub events: Vec<Event>,
    pub skipped: Vec<Skipped>,
    /// The data-parallel rank that sent it, when said.
    pub rank: Option<u32>,
}

/// A payload that is no event batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("not msgpack: {0}")]
    NotMsgpack(String),
    #[error("not an event batch: {0}")]
    NotABatch(&'static str),
}

/// Decodes one batch payload (module docs).
pub fn decode_batch(payload: &[u8]) -> Result<Batch, FrameError> {
    let mut rest = payload;
    let value = rmpv::decode::read_value_ref(&mut rest)
        .map_err(|e| FrameError::NotMsgpack(e.to_string()))?;
    let (ts, events, rank) = match &value {
        ValueRef::Array(items) => (items.first(), items.get(1), items.get(2)),
        ValueRef::Map(entries) => (
            field(entries, "ts"),
            field(entries, "events"),
            field(entries, "data_parallel_rank"),
        ),
        _ => return Err(FrameError::NotABatch("neither an array nor a map")),
    };
    let Some(ValueRef::Array(events)) = events else {
        return Err(FrameError::NotABatch("no list of events"));
    };
    let mut batch = Batch {
        ts: ts.and_then(as_f64).unwrap_or(0.0),
        rank: rank.and_then(as_u64).and_then(|r| u32::try_from(r).ok()),
        events: Vec::with_capacity(events.len()),
        skipped: Vec::new(),
    };
    for event in events {
        match decode_event(event) {
            Ok(e) => batch.events.push(e),
            Err(s) => batch.skipped.push(s),
        }
    }
    Ok(batch)
}

/// The fields of an event, by name whichever its layout.
enum Fields<'a> {
    Tagged(&'a [(ValueRef<'a>, ValueRef<'a>)]),
    /// After the tag: the positions of `BlockStored`'s or `BlockRemoved`'s
    /// fields.
    Positional(&'a [ValueRef<'a>], &'static [&'static str]),
}

const STORED_FIELDS: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
];
const REMOVED_FIELDS: &[&str] = &["block_hashes", "medium"];

impl<'a> Fields<'a> {
    /// The field `name`; absent, or nil, is `None`.
    fn get(&self, name: &str) -> Option<&'a ValueRef<'a>> {
        let value = match self {
            Fields::Tagged(entries) => field(entries, name),
            Fields::Positional(items, names) => {
                let at = names.iter().position(|n| *n == name)?;
                items.get(at)
            }
        };
        value.filter(|v| !matches!(v, ValueRef::Nil))
    }
}

fn decode_event(event: &ValueRef<'_>) -> Result<Event, Skipped> {
    let (tag, tagged) = match event {
        ValueRef::Map(entries) => (field(entries, "type"), Some(entries.as_slice())),
        ValueRef::Array(items) => (items.first(), None),
        _ => return Err(Skipped::Malformed),
    };
    let tag = tag.and_then(as_str).ok_or(Skipped::Malformed)?;
    let names = match tag {
        "BlockStored" => STORED_FIELDS,
        "BlockRemoved" => REMOVED_FIELDS,
        "AllBlocksCleared" => return Ok(Event::Cleared),
        _ => return Err(Skipped::UnknownType),
    };
    let fields = match (tagged, event) {
        (Some(entries), _) => Fields::Tagged(entries),
        (None, ValueRef::Array(items)) => Fields::Positional(&items[1..], names),
        (None, _) => unreachable!("an event is a map or an array"),
    };
    let medium = match fields.get("medium") {
        None => Medium::Gpu,
        Some(v) => Medium::parse(Some(as_str(v).ok_or(Skipped::Malformed)?))
            .ok_or(Skipped::UnknownMedium)?,
    };
    let hashes = match fields.get("block_hashes") {
        Some(ValueRef::Array(items)) => items
            .iter()
            .map(engine_hash)
            .collect::<Option<Vec<_>>>()
            .ok_or(Skipped::Malformed)?,
        _ => return Err(Skipped::Malformed),
    };
    if tag == "BlockRemoved" {
        return Ok(Event::Removed { hashes, medium });
    }
    let parent = match fields.get("parent_block_hash") {
        None => None,
        Some(v) => Some(engine_hash(v).ok_or(Skipped::Malformed)?),
    };
    let token_ids = match fields.get("token_ids") {
        Some(ValueRef::Array(items)) => items
            .iter()
            .map(|t| as_u64(t).and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<_>>>()
            .ok_or(Skipped::Malformed)?,
        _ => return Err(Skipped::Malformed),
    };
    let block_size = fields
        .get("block_size")
        .and_then(as_u64)
        .and_then(|b| u32::try_from(b).ok())
        .filter(|&b| b > 0)
        .ok_or(Skipped::Malformed)?;
    // Every block full: the token ids cover the hashes exactly.
    if token_ids.len() as u64 != hashes.len() as u64 * u64::from(block_size) {
        return Err(Skipped::Malformed);
    }
    let lora = fields.get("lora_name").and_then(as_str);
    let extras = block_extras(fields.get("extra_keys"), lora, hashes.len())?;
    Ok(Event::Stored(Stored {
        hashes,
        parent,
        token_ids,
        block_size,
        medium,
        extras,
    }))
}

/// Each block's extra keys folded with the adapter's name: vLLM sends one
/// tuple (or nil) per block, of strings (the adapter's name, an image's
/// hash, a cache salt) and numbers; the adapter's name, given on its own,
/// is not counted twice.
fn block_extras(
    keys: Option<&ValueRef<'_>>,
    lora: Option<&str>,
    blocks: usize,
) -> Result<Vec<u64>, Skipped> {
    let per_block: &[ValueRef<'_>] = match keys {
        None => &[],
        Some(ValueRef::Array(items)) => items,
        Some(_) => return Err(Skipped::Malformed),
    };
    let mut out = Vec::with_capacity(blocks);
    let mut parts: Vec<String> = Vec::new();
    for i in 0..blocks {
        parts.clear();
        match per_block.get(i) {
            None | Some(ValueRef::Nil) => {}
            Some(ValueRef::Array(items)) => {
                for item in items {
                    match item {
                        ValueRef::String(s) => {
                            let s = s.as_str().unwrap_or_default();
                            if Some(s) != lora {
                                parts.push(s.to_owned());
                            }
                        }
                        ValueRef::Integer(n) => parts.push(n.to_string()),
                        ValueRef::Binary(b) => parts.push(format!("{:016x}", fold_bytes(b))),
                        _ => return Err(Skipped::Malformed),
                    }
                }
            }
            Some(_) => return Err(Skipped::Malformed),
        }
        out.push(extra_digest(lora, parts.iter().map(String::as_str)));
    }
    Ok(out)
}

fn field<'a>(entries: &'a [(ValueRef<'a>, ValueRef<'a>)], name: &str) -> Option<&'a ValueRef<'a>> {
    entries
        .iter()
        .find(|(k, _)| as_str(k) == Some(name))
        .map(|(_, v)| v)
}

fn as_str<'a>(v: &ValueRef<'a>) -> Option<&'a str> {
    match v {
        ValueRef::String(s) => s.into_str(),
        _ => None,
    }
}

fn as_u64(v: &ValueRef<'_>) -> Option<u64> {
    match v {
        ValueRef::Integer(n) => n.as_u64(),
        _ => None,
    }
}

fn as_f64(v: &ValueRef<'_>) -> Option<f64> {
    match v {
        ValueRef::F64(f) => Some(*f),
        ValueRef::F32(f) => Some(f64::from(*f)),
        ValueRef::Integer(n) => n.as_f64(),
        _ => None,
    }
}

/// A block hash as an engine sends it: an integer (its bits, signed or
/// not), or bytes folded to 64 bits.
fn engine_hash(v: &ValueRef<'_>) -> Option<EngineHash> {
    match v {
        ValueRef::Integer(n) => n.as_u64().or_else(|| n.as_i64().map(|i| i as u64)),
        ValueRef::Binary(b) => Some(fold_bytes(b)),
        ValueRef::String(s) => Some(fold_bytes(s.as_bytes())),
        _ => None,
    }
}
