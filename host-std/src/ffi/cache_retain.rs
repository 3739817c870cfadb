//! Tier 1: retention priorities and namespace quotas on the owned cache and the engine
//! (`KvCache::set_priority` and the rest): priorities are the `KVPAGE_PRIORITY_*`
//! levels; an owned cache has quota slots for the `max_namespaces` of its
//! `kvpage_cache_params` (by default `KVPAGE_CACHE_NAMESPACES`).

use kvpage_core::NamespaceQuota;

use super::args::{out, out_opt, slice, tagged, tagged_mut};
use super::cache::kvpage_cache;
use super::engine::kvpage_engine;
use super::ids::{kvpage_seq, seq_to_c};
use super::manager_retain::priority_from_c;
use super::result::{kvpage_error, kvpage_result, run};

/// The default `max_namespaces` of `kvpage_cache_params` (`kvpage_cache_default_params`):
/// namespaces an owned cache (or an engine's cache) can give a quota, and the fixed
/// number every cache had before the field existed.
pub const KVPAGE_CACHE_NAMESPACES: u32 = 8;
const _: () = assert!(KVPAGE_CACHE_NAMESPACES == crate::CACHE_NAMESPACES);

/// `kvpage_cache_create_with_prompt` for a sequence of retention `priority` (a
/// `KVPAGE_PRIORITY_*` level): the cached blocks it reuses and the blocks it commits
/// are raised to at least it; `KVPAGE_PRIORITY_PINNED` keeps a hot system prompt cached
/// for every later request. O(prompt_len).
///
/// # Errors
/// As `kvpage_cache_create_with_prompt`, and `KVPAGE_ERR_INVALID_ARGUMENT` for a level
/// above `KVPAGE_PRIORITY_PINNED` (`value` = level), `KVPAGE_ERR_QUOTA_EXCEEDED` (the
/// namespace's quota cannot take the prompt's blocks).
///
/// # Safety
/// As `kvpage_cache_create_with_prompt`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_cache_create_with_prompt_at(
    cache: *mut kvpage_cache,
    namespace: u64,
    priority: u32,
    prompt: *const u32,
    prompt_len: usize,
    out_seq: *mut kvpage_seq,
    out_reused: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `slice` / `out` / `out_opt`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let priority = priority_from_c(priority)?;
            let prompt = slice(prompt, prompt_len, "prompt")?;
            let dst = out(out_seq, "out_seq")?;
            let reused = out_opt(out_reused, "out_reused")?;
            let start = c.cache.create_with_prompt_at(namespace, priority, prompt)?;
            dst.set(seq_to_c(start.seq.id()));
            if let Some(r) = reused {
                r.set(start.reused_tokens);
            }
            Ok(())
        })
    }
}

/// Sets the retention priority of `seq` (a `KVPAGE_PRIORITY_*` level) and of every
/// block it holds now, exactly (lowering included); the blocks it commits later are
/// raised to at least it. O(blocks of `seq`).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache; a level above `KVPAGE_PRIORITY_PINNED`: `value` = level),
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`.
///
/// # Safety
/// `cache` is null or a live cache.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_set_priority(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    priority: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the pointer is checked by `tagged_mut`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let p = priority_from_c(priority)?;
            let s = c.seq(seq);
            Ok(c.cache.set_priority(s, p)?)
        })
    }
}

/// Sets the priority of the blocks of `seq` holding tokens `first..end` to `priority`,
/// raises its blocks before the range to at least it and lowers those after it to at
/// most it. An empty range changes nothing. O(blocks of `seq`).
///
/// # Errors
/// As `kvpage_cache_set_priority`, and `KVPAGE_ERR_BEYOND_LENGTH` (range reversed or
/// past the length).
///
/// # Safety
/// `cache` is null or a live cache.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_set_range_priority(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    first: u32,
    end: u32,
    priority: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the pointer is checked by `tagged_mut`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let p = priority_from_c(priority)?;
            let s = c.seq(seq);
            Ok(c.cache.set_range_priority(s, first, end, p)?)
        })
    }
}

/// Lowers every cached pinned block that no sequence holds to `KVPAGE_PRIORITY_NORMAL`
/// (so eviction may take it) and writes how many to `*out_unpinned` (NULL to ignore).
/// O(unpinned blocks).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER` (cache), `KVPAGE_ERR_MISALIGNED`,
/// `KVPAGE_ERR_INVALID_ARGUMENT` (not a cache).
///
/// # Safety
/// `cache` is null or a live cache; `out_unpinned` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_unpin_cached(
    cache: *mut kvpage_cache,
    out_unpinned: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `out_opt`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let dst = out_opt(out_unpinned, "out_unpinned")?;
            let n = c.cache.unpin_cached();
            if let Some(dst) = dst {
                dst.set(n);
            }
            Ok(())
        })
    }
}

/// Sets the quota of namespace `ns` on an owned cache: at most `max_blocks` blocks held
/// or cached by its sequences (at the limit it evicts its own cached blocks first, else
/// fails with `KVPAGE_ERR_QUOTA_EXCEEDED`), and `reserved_blocks` kept for it from other
/// namespaces. Takes one of the cache's `max_namespaces` slots (`kvpage_cache_params`)
/// for good (`max_blocks` = `UINT32_MAX` and no reservation lifts a quota). Lowering a
/// limit evicts the namespace's own cached blocks down to it. O(max_namespaces +
/// evicted).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_QUOTA_REFUSED` (reservation above the limit, every slot
/// taken or `max_namespaces` 0, used blocks above the new limit: `needed` = held,
/// `available` = limit; free blocks short of the reservations: `needed`, `available` =
/// free).
///
/// # Safety
/// `cache` is null or a live cache.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_set_namespace_quota(
    cache: *mut kvpage_cache,
    ns: u64,
    max_blocks: u32,
    reserved_blocks: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the pointer is checked by `tagged_mut`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let quota = NamespaceQuota {
                max_blocks,
                reserved_blocks,
            };
            Ok(c.cache.set_namespace_quota(ns, quota)?)
        })
    }
}

/// Blocks held or cached that are charged to namespace `ns` of an owned cache (0
/// without a quota), to `*out_blocks`. O(namespaces).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache).
///
/// # Safety
/// `cache` is null or a live cache; `out_blocks` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_namespace_blocks(
    cache: *const kvpage_cache,
    ns: u64,
    out_blocks: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` / `out`.
    unsafe {
        run(err, || {
            let c = tagged(cache)?;
            out(out_blocks, "out_blocks")?.set(c.cache.namespace_blocks(ns));
            Ok(())
        })
    }
}

/// `kvpage_cache_set_namespace_quota` on the cache an engine drives: the engine's
/// scheduler keeps each namespace within its quota (a request its limit cannot take
/// waits while others go ahead). O(namespaces + evicted).
///
/// # Errors
/// As `kvpage_cache_set_namespace_quota` (`KVPAGE_ERR_INVALID_ARGUMENT`: not an
/// engine).
///
/// # Safety
/// `engine` is null or a live engine.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_set_namespace_quota(
    engine: *mut kvpage_engine,
    ns: u64,
    max_blocks: u32,
    reserved_blocks: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the pointer is checked by `tagged_mut`.
    unsafe {
        run(err, || {
            let e = tagged_mut(engine)?;
            let quota = NamespaceQuota {
                max_blocks,
                reserved_blocks,
            };
            Ok(e.engine.set_namespace_quota(ns, quota)?)
        })
    }
}
