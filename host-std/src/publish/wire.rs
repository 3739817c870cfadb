//! The payload of one published batch: vLLM's KV event batch in MessagePack, in either
//! of the two forms its consumers read.
//!
//! - [`WireFormat::TaggedMap`], what vLLM writes now: the batch is a map `{"ts": f64,
//!   "events": [...], "data_parallel_rank": u32}` and each event a map tagged by its
//!   `"type"`: `{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": h |
//!   nil, "token_ids": [...], "block_size": n, "lora_id": ns | nil, "medium": nil,
//!   "lora_name": nil}`, `{"type": "BlockRemoved", "block_hashes": [h], "medium": nil}`,
//!   `{"type": "AllBlocksCleared"}`.
//! - [`WireFormat::PositionalArray`], what earlier vLLM releases wrote (and consumers
//!   built against them read): the batch is `[ts, [events], data_parallel_rank]` and
//!   each event an array whose first element is its tag: `["BlockStored", [h], parent |
//!   nil, [token ids], block_size, lora_id | nil, medium]`, `["BlockRemoved", [h],
//!   medium]`, `["AllBlocksCleared"]`.
//!
//! One event per block: `block_hashes` always has one hash. A chain's first block has
//! no parent hash (`nil`), as in vLLM. A block of namespace `ns != 0` carries `ns` as its
//! `lora_id` (namespaces never share blocks, as LoRA adapters never do); namespace 0
//! carries `nil`.

use rmp::encode;

use crate::cache::{CacheEvent, StoredEvent};

/// Which MessagePack form the publisher writes. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WireFormat {
    /// Maps, each event tagged by `"type"` (vLLM's current form).
    #[default]
    TaggedMap,
    /// Arrays, each event's tag first (earlier vLLM releases).
    PositionalArray,
}

/// Encodes a batch of `events` at time `ts` (seconds since the Unix epoch) from data
/// parallel rank `rank`. O(events × block size).
pub(crate) fn encode_batch(
    format: WireFormat,
    ts: f64,
    events: &[CacheEvent],
    rank: u32,
) -> Vec<u8> {
    let mut out = Vec::new();
    // Writes into a `Vec` cannot fail.
    let _ = write_batch(&mut out, format, ts, events, rank);
    out
}

type Result = core::result::Result<(), encode::ValueWriteError<std::io::Error>>;

fn write_batch(
    out: &mut Vec<u8>,
    format: WireFormat,
    ts: f64,
    events: &[CacheEvent],
    rank: u32,
) -> Result {
    let map = format == WireFormat::TaggedMap;
    start(out, map, 3)?;
    out.field("ts", map)?;
    encode::write_f64(out, ts)?;
    out.field("events", map)?;
    encode::write_array_len(out, events.len() as u32)?;
    for e in events {
        write_event(out, map, e)?;
    }
    out.field("data_parallel_rank", map)?;
    encode::write_u32(out, rank)
}

fn write_event(out: &mut Vec<u8>, map: bool, e: &CacheEvent) -> Result {
    match e {
        CacheEvent::Stored(s) => write_stored(out, map, s),
        CacheEvent::Removed(r) => {
            tag(out, map, "BlockRemoved", 2)?;
            out.field("block_hashes", map)?;
            encode::write_array_len(out, 1)?;
            encode::write_uint(out, r.hash)?;
            out.field("medium", map)?;
            nil(out)
        }
        CacheEvent::Cleared => tag(out, map, "AllBlocksCleared", 0),
    }
}

fn write_stored(out: &mut Vec<u8>, map: bool, s: &StoredEvent) -> Result {
    // The map form also has `lora_name` (vLLM added it after the array form).
    tag(out, map, "BlockStored", if map { 7 } else { 6 })?;
    out.field("block_hashes", map)?;
    encode::write_array_len(out, 1)?;
    encode::write_uint(out, s.hash)?;
    out.field("parent_block_hash", map)?;
    match s.parent {
        Some(_) => encode::write_uint(out, s.parent_hash).map(drop)?,
        None => nil(out)?,
    }
    out.field("token_ids", map)?;
    encode::write_array_len(out, s.tokens.len() as u32)?;
    for &t in &s.tokens {
        encode::write_uint(out, u64::from(t))?;
    }
    out.field("block_size", map)?;
    encode::write_uint(out, s.tokens.len() as u64)?;
    out.field("lora_id", map)?;
    match s.namespace {
        0 => nil(out)?,
        ns => encode::write_uint(out, ns).map(drop)?,
    }
    out.field("medium", map)?;
    nil(out)?;
    if map {
        out.field("lora_name", map)?;
        nil(out)?;
    }
    Ok(())
}

/// Starts an event of `fields` fields after its tag: a map with a `"type"` entry, or
/// an array whose first element is the tag.
fn tag(out: &mut Vec<u8>, map: bool, name: &str, fields: u32) -> Result {
    start(out, map, fields + 1)?;
    out.field("type", map)?;
    encode::write_str(out, name)
}

/// Writes `nil`.
fn nil(out: &mut Vec<u8>) -> Result {
    encode::write_nil(out).map_err(encode::ValueWriteError::InvalidMarkerWrite)
}

/// Starts a struct of `n` fields: a map, or an array.
fn start(out: &mut Vec<u8>, map: bool, n: u32) -> Result {
    match map {
        true => encode::write_map_len(out, n).map(drop),
        false => encode::write_array_len(out, n).map(drop),
    }
}

/// Writing a field's key in the map form (nothing in the array form).
trait Field {
    fn field(&mut self, key: &str, map: bool) -> Result;
}

impl Field for Vec<u8> {
    fn field(&mut self, key: &str, map: bool) -> Result {
        match map {
            true => encode::write_str(self, key),
            false => Ok(()),
        }
    }
}
