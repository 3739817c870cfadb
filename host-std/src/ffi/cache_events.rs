//! Tier 1: KV cache events for KV-aware routers — draining the owned cache's event ring
//! (sized by `event_capacity` in `kvpage_cache_params`) into caller buffers, for a
//! service that publishes them itself (vLLM's `BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared`). A drain copies and never waits; events the ring overwrote
//! before a drain reached them are reported as `lost`, never skipped silently.

use kvpage_core::KvEvent;

use super::args::{out, out_opt, slice_mut, tagged_mut};
use super::cache::kvpage_cache;
use super::engine::kvpage_engine;
use super::result::{kvpage_error, kvpage_result, run, Fail};
use crate::KvCache;

/// `kvpage_kv_event.kind`: a block entered the prefix cache (vLLM's `BlockStored`).
pub const KVPAGE_EVENT_STORED: u32 = 1;
/// `kvpage_kv_event.kind`: a block left the prefix cache (vLLM's `BlockRemoved`).
pub const KVPAGE_EVENT_REMOVED: u32 = 2;
/// `kvpage_kv_event.kind`: every block left the prefix cache at once (vLLM's
/// `AllBlocksCleared`).
pub const KVPAGE_EVENT_CLEARED: u32 = 3;
/// `kvpage_kv_event.block` / `.parent` when there is none.
pub const KVPAGE_EVENT_NO_BLOCK: u32 = u32::MAX;

/// One KV cache event. Fields a kind does not use are 0 (`parent`:
/// `KVPAGE_EVENT_NO_BLOCK`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct kvpage_kv_event {
    /// Sequence number: one more than the previous event's, the first is 0.
    pub seq: u64,
    /// The block's chain hash (stored, removed); stable across runs and machines for a
    /// fixed `hash_key`.
    pub hash: u64,
    /// The parent's chain hash (stored; the namespace's seed hash for a chain's first
    /// block, whose `parent` is `KVPAGE_EVENT_NO_BLOCK`).
    pub parent_hash: u64,
    /// The block's namespace (stored, removed).
    pub namespace_id: u64,
    /// Index in the token buffer of the block's first token id (stored).
    pub tokens_offset: u64,
    /// `KVPAGE_EVENT_STORED`, `KVPAGE_EVENT_REMOVED` or `KVPAGE_EVENT_CLEARED`.
    pub kind: u32,
    /// The physical block (stored, removed).
    pub block: u32,
    /// The parent block when the block was stored; `KVPAGE_EVENT_NO_BLOCK` for none.
    pub parent: u32,
    /// Token ids of the block in the token buffer: the block size (stored), else 0.
    pub token_count: u32,
}

/// What `kvpage_cache_events_drain` did.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct kvpage_events_report {
    /// Sequence number of the first event written (where the drain started).
    pub first_seq: u64,
    /// Events before `first_seq` the ring overwrote before a drain reached them.
    pub lost: u64,
    /// Events written.
    pub events: usize,
    /// Token ids written.
    pub tokens: usize,
    /// Events still waiting in the ring (drain again).
    pub pending: u64,
}

/// Copies the events since the previous drain (sequence 0 for the first) into
/// `events[..n]`, with the token ids of stored blocks packed into `tokens` (each event
/// names its range), as many whole events as both buffers hold; moves past them and
/// writes the report to `*out_report`. Events the ring overwrote before this drain
/// reached them are skipped and counted in `lost` (also by a call with `events_len` 0,
/// which writes no event).
/// Allocates nothing. O(events × block size).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_BUFFER_TOO_SMALL` when the next event is a stored block
/// and `tokens_len` is under the block size (`needed`, `available`). Nothing changes
/// on error.
///
/// # Safety
/// `cache` is null or a live cache; `events` is null or writable for `events_len`
/// events, `tokens` for `tokens_len` ids; `out_report` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_events_drain(
    cache: *mut kvpage_cache,
    events: *mut kvpage_kv_event,
    events_len: usize,
    tokens: *mut u32,
    tokens_len: usize,
    out_report: *mut kvpage_events_report,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `slice_mut` / `out`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let events = slice_mut(events, events_len, "events")?;
            let tokens = slice_mut(tokens, tokens_len, "tokens")?;
            let report = out(out_report, "out_report")?;
            report.set(drain_into(&mut c.cache, events, tokens)?);
            Ok(())
        })
    }
}

/// `kvpage_cache_events_drain` on the engine's cache (sized by `cache.event_capacity` in
/// `kvpage_engine_params`). O(events × block size).
///
/// # Errors
/// As `kvpage_cache_events_drain` (`KVPAGE_ERR_INVALID_ARGUMENT`: not an engine).
///
/// # Safety
/// `engine` is null or a live engine; the buffers as for `kvpage_cache_events_drain`.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_events_drain(
    engine: *mut kvpage_engine,
    events: *mut kvpage_kv_event,
    events_len: usize,
    tokens: *mut u32,
    tokens_len: usize,
    out_report: *mut kvpage_events_report,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `slice_mut` / `out`.
    unsafe {
        run(err, || {
            let e = tagged_mut(engine)?;
            let events = slice_mut(events, events_len, "events")?;
            let tokens = slice_mut(tokens, tokens_len, "tokens")?;
            let report = out(out_report, "out_report")?;
            report.set(drain_into(e.engine.cache_mut(), events, tokens)?);
            Ok(())
        })
    }
}

/// The drain of both functions: whole events into `events` and their token ids into
/// `tokens`, checked first so that a refusal consumes nothing.
fn drain_into(
    cache: &mut KvCache,
    events: &mut [kvpage_kv_event],
    tokens: &mut [u32],
) -> Result<kvpage_events_report, Fail> {
    let block_size = cache.geometry().block_size() as usize;
    if !events.is_empty() && tokens.len() < block_size && next_is_stored(cache) {
        return Err(Fail::short("tokens", block_size, tokens.len()));
    }
    let (mut n, mut t) = (0, 0);
    let drained = cache.drain_events_with(|seq, e| {
        let need = match e {
            KvEvent::Stored(s) => s.tokens.len(),
            _ => 0,
        };
        if n == events.len() || t + need > tokens.len() {
            return false;
        }
        events[n] = to_c(seq, &e, t);
        if let KvEvent::Stored(s) = e {
            tokens[t..t + need].copy_from_slice(s.tokens);
        }
        (n, t) = (n + 1, t + need);
        true
    });
    Ok(kvpage_events_report {
        first_seq: drained.first_seq,
        lost: drained.lost,
        events: n,
        tokens: t,
        pending: drained.pending,
    })
}

/// Whether the next event a drain of `cache` offers is a stored block.
fn next_is_stored(cache: &KvCache) -> bool {
    let m = cache.block_manager();
    let from = cache.event_cursor().min(m.next_event_seq());
    m.events_since(from)
        .ok()
        .and_then(|mut e| e.next())
        .is_some_and(|(_, e)| matches!(e, KvEvent::Stored(_)))
}

/// The C form of event `seq`, its token ids at `tokens_offset`.
fn to_c(seq: u64, e: &KvEvent<'_>, tokens_offset: usize) -> kvpage_kv_event {
    let none = kvpage_kv_event {
        seq,
        parent: KVPAGE_EVENT_NO_BLOCK,
        block: KVPAGE_EVENT_NO_BLOCK,
        ..kvpage_kv_event::default()
    };
    match e {
        KvEvent::Stored(s) => kvpage_kv_event {
            hash: s.hash,
            parent_hash: s.parent_hash,
            namespace_id: s.namespace,
            tokens_offset: tokens_offset as u64,
            kind: KVPAGE_EVENT_STORED,
            block: s.block,
            parent: s.parent.unwrap_or(KVPAGE_EVENT_NO_BLOCK),
            token_count: s.tokens.len() as u32,
            ..none
        },
        KvEvent::Removed(r) => kvpage_kv_event {
            hash: r.hash,
            namespace_id: r.namespace,
            kind: KVPAGE_EVENT_REMOVED,
            block: r.block,
            ..none
        },
        KvEvent::Cleared => kvpage_kv_event {
            kind: KVPAGE_EVENT_CLEARED,
            ..none
        },
    }
}

/// Evicts every cached block of the prefix cache below `KVPAGE_PRIORITY_PINNED` and
/// writes how many to `*out_evicted` (NULL to ignore). When that empties the prefix
/// cache (no registered block held by a sequence or pinned) the event ring records one
/// `KVPAGE_EVENT_CLEARED` instead of a removal per block. O(evicted).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER` (cache), `KVPAGE_ERR_MISALIGNED`,
/// `KVPAGE_ERR_INVALID_ARGUMENT` (not a cache).
///
/// # Safety
/// `cache` is null or a live cache; `out_evicted` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_clear_prefix_cache(
    cache: *mut kvpage_cache,
    out_evicted: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `out_opt`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let dst = out_opt(out_evicted, "out_evicted")?;
            let n = c.cache.clear_prefix_cache();
            if let Some(dst) = dst {
                dst.set(n);
            }
            Ok(())
        })
    }
}
