//! Tier 1: the owned cache, for an application that lets kvpage store K/V and run
//! attention. `kvpage_cache_new` allocates everything (the Rust `KvCache`: tables,
//! arena, kernel threads; and two batch buffers of `max_seqs` entries); no later call
//! allocates or starts a thread. `kvpage_cache_free` releases it all.
//!
//! A step of a model, per sequence: append its new tokens (`kvpage_cache_append_tokens`,
//! or `kvpage_cache_create_with_prompt` for a prompt), write their K/V in every layer
//! (`kvpage_cache_write_kv`), run attention per layer (`kvpage_cache_decode` /
//! `kvpage_cache_prefill`), then `kvpage_cache_commit` so full blocks become shareable.
//! After a context shift moved tokens to new positions, `kvpage_cache_rotate_keys`
//! turns their stored keys to match instead of recomputing them.

use core::ffi::c_void;

use crate::cache::{CacheConfig, CacheError, Capacity, KvCache, Seq};
use crate::dtype::for_dtype;
use crate::storage::{Backend, CudaOptions};
use crate::tables::try_with_capacity;

use super::args::{free_boxed, obj, out, out_opt, slice, slice_mut, tagged, tagged_mut, Tagged};
use super::cache_retain::KVPAGE_CACHE_NAMESPACES;
use super::geometry::{dtype_from_c, kvpage_geometry};
use super::ids::{kvpage_seq, seq_from_c, seq_to_c};
use super::result::{kvpage_error, kvpage_result, run, Fail};
use super::rope::kvpage_rope_params;
use super::stats::kvpage_stats;

/// What a cache is built from; start from `kvpage_cache_default_params` and change
/// fields.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct kvpage_cache_params {
    /// The model's KV geometry and storage dtype.
    pub geometry: kvpage_geometry,
    /// Size of the arena in blocks; exactly one of `capacity_blocks` and
    /// `capacity_bytes` is non-zero.
    pub capacity_blocks: u32,
    /// Size of the arena in bytes (as many whole blocks as fit); exactly one of
    /// `capacity_blocks` and `capacity_bytes` is non-zero.
    pub capacity_bytes: u64,
    /// Sequences live at once (also the largest batch of one attention call).
    pub max_seqs: u32,
    /// Tokens one sequence may hold.
    pub max_seq_len: u32,
    /// Threads of the attention kernels, the calling thread included; 0 = one per
    /// available core. Results do not depend on it.
    pub threads: u32,
    /// Entries of the KV event ring (`kvpage_cache_events_drain`), for KV-aware
    /// routers; 0 (the default) = no events. Each costs about `40 + 4 * block_size`
    /// bytes.
    pub event_capacity: u32,
    /// Key of the prefix cache's block hash; 0 (the default) = a random secret key per
    /// cache. A fixed key makes block hashes (in KV events and persisted caches) the
    /// same on every run and machine; keep it secret in a multi-tenant service.
    pub hash_key: u64,
    /// Where the K/V lives and attention runs: `KVPAGE_BACKEND_CPU` (0, the default) or
    /// `KVPAGE_BACKEND_CUDA` (1; a library built without the `cuda` feature refuses it
    /// with `KVPAGE_ERR_UNSUPPORTED`). An engine's cache takes it from here too. The
    /// `device_*` fields below are read for CUDA only.
    pub backend: u32,
    /// CUDA: the device's ordinal.
    pub device: u32,
    /// CUDA: the arena takes this fraction of the device's free memory, in `(0, 1]`;
    /// 0 (the default) = the capacity above.
    pub device_memory_fraction: f64,
    /// CUDA: query heads of the model (every attention call passes this many); needed
    /// for CUDA (0 is refused).
    pub device_q_heads: u32,
    /// CUDA: query tokens one attention call may carry; 0 (the default) = 2048.
    pub device_max_step_tokens: u32,
    /// Namespaces that can have a quota (`kvpage_cache_set_namespace_quota`,
    /// `kvpage_engine_set_namespace_quota`); `KVPAGE_CACHE_NAMESPACES` (8, the default);
    /// 0 = none (every quota is refused with `KVPAGE_ERR_QUOTA_REFUSED`); at most 256
    /// (more is `KVPAGE_ERR_BAD_CONFIG` from `kvpage_cache_new`). Namespaces without a
    /// quota need no slot. Eviction compares one list per slot, O(max_namespaces + 1)
    /// per evicted block; a slot costs a few bytes, and a non-zero value 12 bytes per
    /// block.
    pub max_namespaces: u32,
}

/// `backend` of `kvpage_cache_params`: the CPU kernels over a host arena.
pub const KVPAGE_BACKEND_CPU: u32 = 0;
/// `backend` of `kvpage_cache_params`: a CUDA device (feature `cuda`).
pub const KVPAGE_BACKEND_CUDA: u32 = 1;
/// `device_max_step_tokens` when 0.
pub const KVPAGE_DEVICE_DEFAULT_STEP_TOKENS: u32 = 2048;

/// Default arena size of `kvpage_cache_default_params`: 256 MiB.
pub const KVPAGE_CACHE_DEFAULT_BYTES: u64 = 256 << 20;
/// Default `max_seqs` of `kvpage_cache_default_params`.
pub const KVPAGE_CACHE_DEFAULT_MAX_SEQS: u32 = 64;
/// Default `max_seq_len` of `kvpage_cache_default_params`.
pub const KVPAGE_CACHE_DEFAULT_MAX_SEQ_LEN: u32 = 4096;

/// The capacity of a (blocks, bytes) pair of parameters: exactly one non-zero, or both
/// zero when `zero_is_none` (then `Capacity::Blocks(0)`).
pub(crate) fn capacity_from_c(
    blocks: u32,
    bytes: u64,
    zero_is_none: bool,
) -> Result<Capacity, Fail> {
    match (blocks, bytes) {
        (0, 0) if zero_is_none => Ok(Capacity::Blocks(0)),
        (b, 0) if b > 0 => Ok(Capacity::Blocks(b)),
        (0, b) if b > 0 => Ok(Capacity::Bytes(b)),
        _ => Err(Fail::invalid(
            "set exactly one of a capacity in blocks and a capacity in bytes",
        )),
    }
}

impl kvpage_cache_params {
    /// The checked backend selection.
    pub(crate) fn backend(&self) -> Result<Backend, Fail> {
        match self.backend {
            KVPAGE_BACKEND_CPU => Ok(Backend::Cpu),
            KVPAGE_BACKEND_CUDA => {
                let f = self.device_memory_fraction;
                if !(f == 0.0 || (f > 0.0 && f <= 1.0)) {
                    return Err(Fail::invalid(
                        "device_memory_fraction is not 0 or in (0, 1]",
                    ));
                }
                if self.device_q_heads == 0 {
                    return Err(Fail::invalid(
                        "device_q_heads must be set for the CUDA backend",
                    ));
                }
                Ok(Backend::Cuda(CudaOptions {
                    device: self.device,
                    memory_fraction: (f > 0.0).then_some(f),
                    reserve_bytes: 0,
                    q_heads: self.device_q_heads,
                    max_step_tokens: match self.device_max_step_tokens {
                        0 => KVPAGE_DEVICE_DEFAULT_STEP_TOKENS,
                        n => n,
                    },
                }))
            }
            other => Err(Fail::invalid("unknown backend").with_value(u64::from(other))),
        }
    }

    /// The checked Rust configuration.
    pub(crate) fn to_rust(self) -> Result<CacheConfig, Fail> {
        Ok(CacheConfig {
            geometry: self.geometry.to_core()?,
            capacity: capacity_from_c(self.capacity_blocks, self.capacity_bytes, false)?,
            max_seqs: self.max_seqs,
            max_seq_len: self.max_seq_len,
            threads: self.threads as usize,
            event_capacity: self.event_capacity,
            hash_key: (self.hash_key != 0).then_some(self.hash_key),
            max_namespaces: self.max_namespaces,
        })
    }
}

/// Marks a live cache, so a pointer to anything else is refused.
const MAGIC: u64 = u64::from_le_bytes(*b"kvpgCACH");

/// The owned cache: opaque to C, created by `kvpage_cache_new`, freed by
/// `kvpage_cache_free`.
///
/// `repr(C)` with the magic word first, so a pointer to any 8 readable bytes is
/// checked safely; declared opaque in the header (cbindgen.toml), its fields are not
/// C types.
/// cbindgen:ignore
#[repr(C)]
pub struct kvpage_cache {
    magic: u64,
    pub(crate) cache: KvCache,
    /// The sequences of a decode call (capacity `max_seqs`, never grown).
    decode: Vec<Seq>,
    /// The sequences and query counts of a prefill call (capacity `max_seqs`).
    prefill: Vec<(Seq, u32)>,
}

// SAFETY: `repr(C)` with `magic: u64` first, holding MAGIC in every live object.
unsafe impl Tagged for kvpage_cache {
    const MAGIC: u64 = MAGIC;
    const WHAT: &'static str = "cache";
    const NOT_LIVE: &'static str = "not a kvpage_cache (freed, uninitialised or corrupted)";
}

impl kvpage_cache {
    /// The Rust handle of a C id (checked by every operation).
    pub(crate) fn seq(&self, id: kvpage_seq) -> Seq {
        Seq::from_id(seq_from_c(id, self.cache.block_manager().config().instance))
    }

    /// Elements of `tokens` rows of `heads × head_dim`, or an error when that overflows.
    fn elems(&self, tokens: u64, heads: u32) -> Result<usize, Fail> {
        let hd = u64::from(self.cache.geometry().head_dim());
        tokens
            .checked_mul(u64::from(heads))
            .and_then(|x| x.checked_mul(hd))
            .and_then(|x| usize::try_from(x).ok())
            .filter(|&x| x <= isize::MAX as usize)
            .ok_or(Fail::invalid("tokens × heads × head_dim overflows").with_value(tokens))
    }

    /// Refuses a batch larger than the buffers made at `_new` (`max_seqs`).
    fn check_batch(&self, n: usize) -> Result<(), Fail> {
        let max = self.cache.block_manager().config().max_seqs as usize;
        if n > max {
            return Err(CacheError::BatchTooLarge { seqs: n, max }.into());
        }
        Ok(())
    }

    /// The K and V inputs of a write of `n_tokens` tokens: `needed` elements each, the
    /// given buffers checked and cut to that.
    ///
    /// # Safety
    /// As `kvpage_cache_write_kv` for `k` and `v`.
    unsafe fn kv_inputs<'a, T>(
        &self,
        n_tokens: u32,
        (k, k_len): (*const T, usize),
        (v, v_len): (*const T, usize),
    ) -> Result<(&'a [T], &'a [T]), Fail> {
        let needed = self.elems(u64::from(n_tokens), self.cache.geometry().kv_heads())?;
        // SAFETY: forwarded contract.
        let (k, v) = unsafe { (slice(k, k_len, "k")?, slice(v, v_len, "v")?) };
        Ok((head(k, needed, "k")?, head(v, needed, "v")?))
    }
}

/// The first `needed` elements of a caller buffer, or `KVPAGE_ERR_BUFFER_TOO_SMALL`.
fn head<'a, T>(buf: &'a [T], needed: usize, what: &'static str) -> Result<&'a [T], Fail> {
    buf.get(..needed)
        .ok_or(Fail::short(what, needed, buf.len()))
}

/// [`head`] of an output buffer.
fn head_mut<'a, T>(
    buf: &'a mut [T],
    needed: usize,
    what: &'static str,
) -> Result<&'a mut [T], Fail> {
    let got = buf.len();
    buf.get_mut(..needed).ok_or(Fail::short(what, needed, got))
}

/// Parameters for a cache of `geometry` with sane defaults: capacity 256 MiB in bytes
/// (`KVPAGE_CACHE_DEFAULT_BYTES`, `capacity_blocks` 0), 64 sequences
/// (`KVPAGE_CACHE_DEFAULT_MAX_SEQS`) of up to 4096 tokens
/// (`KVPAGE_CACHE_DEFAULT_MAX_SEQ_LEN`), one kernel thread per core (`threads` 0), no
/// KV events and a random hash key (`event_capacity` and `hash_key` 0), the CPU backend
/// (`backend` `KVPAGE_BACKEND_CPU`, the `device_*` fields 0), quota slots for
/// `KVPAGE_CACHE_NAMESPACES` (8) namespaces (`max_namespaces`). The geometry is copied as
/// given and checked by `kvpage_cache_new`. O(1); cannot fail; thread-safe.
#[no_mangle]
pub extern "C" fn kvpage_cache_default_params(geometry: kvpage_geometry) -> kvpage_cache_params {
    kvpage_cache_params {
        geometry,
        capacity_blocks: 0,
        capacity_bytes: KVPAGE_CACHE_DEFAULT_BYTES,
        max_seqs: KVPAGE_CACHE_DEFAULT_MAX_SEQS,
        max_seq_len: KVPAGE_CACHE_DEFAULT_MAX_SEQ_LEN,
        threads: 0,
        event_capacity: 0,
        hash_key: 0,
        backend: KVPAGE_BACKEND_CPU,
        device: 0,
        device_memory_fraction: 0.0,
        device_q_heads: 0,
        device_max_step_tokens: 0,
        max_namespaces: KVPAGE_CACHE_NAMESPACES,
    }
}

/// Builds a cache from `params` and writes it to `*out_cache`: allocates the arena
/// (zeroed, every page touched), the tables and the batch buffers, and starts
/// `threads - 1` kernel worker threads (a thread the OS refuses means fewer workers,
/// no error). The caller owns the cache and frees it with `kvpage_cache_free`.
/// O(arena bytes + tables + threads).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`; `KVPAGE_ERR_INVALID_ARGUMENT`
/// (unknown dtype, both or neither capacity set); `KVPAGE_ERR_BAD_CONFIG` (zero
/// dimension or limit, capacity under one block or over 2^32-1 blocks, head dim over
/// the kernels' maximum, lengths that overflow, `max_namespaces` over 256);
/// `KVPAGE_ERR_OUT_OF_MEMORY` (`needed` bytes of tables when known); for `backend`:
/// `KVPAGE_ERR_INVALID_ARGUMENT` (unknown
/// backend, `value` = it; CUDA with `device_q_heads` 0 or a fraction outside
/// `(0, 1]`), `KVPAGE_ERR_UNSUPPORTED` (CUDA in a build without the `cuda` feature),
/// `KVPAGE_ERR_DEVICE` (no NVIDIA driver, no such device, a driver error).
///
/// # Safety
/// `params` is null or readable; `out_cache` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_new(
    params: *const kvpage_cache_params,
    out_cache: *mut *mut kvpage_cache,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `obj` / `out`.
    unsafe {
        run(err, || {
            let params = obj(params, "params")?;
            let (config, backend) = (params.to_rust()?, params.backend()?);
            let dst = out(out_cache, "out_cache")?;
            // The cache first: it validates `max_seqs` before anything is sized by it.
            let cache = KvCache::with_backend(config, backend)?;
            let max = config.max_seqs as usize;
            let (decode, prefill) = (try_with_capacity(max)?, try_with_capacity(max)?);
            dst.set(Box::into_raw(Box::new(kvpage_cache {
                magic: MAGIC,
                cache,
                decode,
                prefill,
            })));
            Ok(())
        })
    }
}

/// Frees `cache` and everything it owns (arena, tables, joins its threads); every id
/// it issued becomes meaningless. NULL is a no-op returning `KVPAGE_OK`. Not
/// concurrently with any other call on the same cache; freeing twice is undefined
/// (a freed pointer is usually, not always, refused with `KVPAGE_ERR_INVALID_ARGUMENT`).
/// O(arena pages + threads).
///
/// # Errors
/// `KVPAGE_ERR_MISALIGNED`; `KVPAGE_ERR_INVALID_ARGUMENT` for a pointer that is not a
/// live cache (nothing is freed).
///
/// # Safety
/// `cache` is null or a cache from `kvpage_cache_new` not yet freed, used by no other
/// call now or later.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_free(
    cache: *mut kvpage_cache,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the caller's contract is `free_boxed`'s; `_new` boxed the cache.
    unsafe { run(err, || free_boxed(cache)) }
}

/// Writes the cache's geometry to `*out_geometry`. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache).
///
/// # Safety
/// `cache` is null or a live cache; `out_geometry` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_geometry(
    cache: *const kvpage_cache,
    out_geometry: *mut kvpage_geometry,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` / `out`.
    unsafe {
        run(err, || {
            let c = tagged(cache)?;
            let dst = out(out_geometry, "out_geometry")?;
            dst.set(kvpage_geometry::from_core(c.cache.geometry()));
            Ok(())
        })
    }
}

/// Writes counters of the pool and the sequences to `*out_stats`. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache).
///
/// # Safety
/// `cache` is null or a live cache; `out_stats` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_stats(
    cache: *const kvpage_cache,
    out_stats: *mut kvpage_stats,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` / `out`.
    unsafe {
        run(err, || {
            let c = tagged(cache)?;
            let dst = out(out_stats, "out_stats")?;
            dst.set(c.cache.stats().into());
            Ok(())
        })
    }
}

/// Evicts up to `max_blocks` blocks of the prefix cache that no sequence references
/// (they become free); writes how many to `*out_evicted` when non-null. Appends evict
/// on their own when blocks run out; this frees memory ahead of time. O(evicted).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache).
///
/// # Safety
/// `cache` is null or a live cache; `out_evicted` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_evict_cached(
    cache: *mut kvpage_cache,
    max_blocks: u32,
    out_evicted: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `out_opt`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let dst = out_opt(out_evicted, "out_evicted")?;
            let n = c.cache.evict_cached(max_blocks);
            if let Some(dst) = dst {
                dst.set(n);
            }
            Ok(())
        })
    }
}

/// Creates an empty sequence and writes its id to `*out_seq`. Its blocks are shared
/// through the prefix cache only with sequences of the same `namespace` (e.g. one per
/// tenant or per model adapter). Release it with `kvpage_cache_release`. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_NO_FREE_SEQ`.
///
/// # Safety
/// `cache` is null or a live cache; `out_seq` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_create(
    cache: *mut kvpage_cache,
    namespace: u64,
    out_seq: *mut kvpage_seq,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `out`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let dst = out(out_seq, "out_seq")?;
            dst.set(seq_to_c(c.cache.create(namespace)?.id()));
            Ok(())
        })
    }
}

/// Creates a sequence holding the `prompt_len` tokens of `prompt`, reusing the longest
/// run of cached whole blocks of `namespace` that match the prompt, and writes its id
/// to `*out_seq` and, when `out_reused` is non-null, the number of leading tokens whose
/// K/V came from the cache to `*out_reused`. Write K/V (and run attention) for
/// positions `reused..prompt_len` only, then `kvpage_cache_commit`. An empty prompt
/// (`prompt` may then be NULL) gives an empty sequence. O(prompt_len).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_NO_FREE_SEQ`, `KVPAGE_ERR_SEQ_TOO_LONG` (`needed` tokens,
/// `available` = max), `KVPAGE_ERR_OUT_OF_BLOCKS` (`needed`, `available` blocks).
///
/// # Safety
/// `cache` is null or a live cache; `prompt` is null or readable for `prompt_len`
/// tokens; `out_seq` and `out_reused` are null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_create_with_prompt(
    cache: *mut kvpage_cache,
    namespace: u64,
    prompt: *const u32,
    prompt_len: usize,
    out_seq: *mut kvpage_seq,
    out_reused: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: forwarded contract (the same pointers).
    unsafe {
        super::cache_retain::kvpage_cache_create_with_prompt_at(
            cache,
            namespace,
            super::manager_retain::KVPAGE_PRIORITY_NORMAL,
            prompt,
            prompt_len,
            out_seq,
            out_reused,
            err,
        )
    }
}

/// Appends the `n_tokens` token ids of `tokens` to `seq` (copying a shared last block
/// first if needed). Write their K/V in every layer, then `kvpage_cache_commit`: their
/// full blocks then become shareable through the prefix cache. `n_tokens` 0 does
/// nothing (`tokens` may then be NULL). O(n_tokens).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`,
/// `KVPAGE_ERR_SEQ_TOO_LONG`, `KVPAGE_ERR_OUT_OF_BLOCKS` (`needed`, `available`).
///
/// # Safety
/// `cache` is null or a live cache; `tokens` is null or readable for `n_tokens` ids.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_append_tokens(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    tokens: *const u32,
    n_tokens: usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `slice`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let tokens = slice(tokens, n_tokens, "tokens")?;
            let s = c.seq(seq);
            c.cache.append_tokens(s, tokens)?;
            Ok(())
        })
    }
}

/// Appends `n` tokens whose ids are unknown (never shared through the prefix cache);
/// otherwise as `kvpage_cache_append_tokens`. `n` 0 does nothing. O(n).
///
/// # Errors
/// As `kvpage_cache_append_tokens`.
///
/// # Safety
/// `cache` is null or a live cache.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_append(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    n: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: checked by `tagged_mut`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let s = c.seq(seq);
            c.cache.append(s, n)?;
            Ok(())
        })
    }
}

/// Declares the K/V of every token of `seq` written in every layer: its full blocks
/// with known token ids become shareable through the prefix cache, and its positions
/// stop being writable. Call it once a step, after the last layer's write. Writes the
/// number of blocks newly offered to the cache to `*out_blocks` when non-null.
/// O(block_size) per such block.
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`.
///
/// # Safety
/// `cache` is null or a live cache; `out_blocks` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_commit(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    out_blocks: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `out_opt`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let dst = out_opt(out_blocks, "out_blocks")?;
            let s = c.seq(seq);
            let n = c.cache.commit(s)?;
            if let Some(dst) = dst {
                dst.set(n);
            }
            Ok(())
        })
    }
}

/// Creates a sequence sharing every block of `seq` (nothing is copied now: the first
/// append into a shared partial block copies that block) and writes its id to
/// `*out_child`. The positions of both stop being writable. O(blocks of `seq`).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`,
/// `KVPAGE_ERR_NO_FREE_SEQ`.
///
/// # Safety
/// `cache` is null or a live cache; `out_child` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_fork(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    out_child: *mut kvpage_seq,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `out`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let dst = out(out_child, "out_child")?;
            let s = c.seq(seq);
            dst.set(seq_to_c(c.cache.fork(s)?.id()));
            Ok(())
        })
    }
}

/// Shortens `seq` to `new_len` tokens (e.g. to drop rejected draft tokens), releasing
/// blocks it no longer needs. O(released blocks).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`,
/// `KVPAGE_ERR_BEYOND_LENGTH` (`needed` = `new_len`, `available` = length).
///
/// # Safety
/// `cache` is null or a live cache.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_truncate(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    new_len: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: checked by `tagged_mut`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let s = c.seq(seq);
            c.cache.truncate(s, new_len)?;
            Ok(())
        })
    }
}

/// Releases `seq`: its id becomes stale (every later use is `KVPAGE_ERR_STALE_SEQ`,
/// releasing it again included); its committed full blocks stay in the prefix cache
/// until evicted. O(blocks of `seq`).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`.
///
/// # Safety
/// `cache` is null or a live cache.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_release(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: checked by `tagged_mut`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let s = c.seq(seq);
            c.cache.release(s)?;
            Ok(())
        })
    }
}

/// Writes the number of tokens `seq` holds to `*out_len`. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`.
///
/// # Safety
/// `cache` is null or a live cache; `out_len` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_len(
    cache: *const kvpage_cache,
    seq: kvpage_seq,
    out_len: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` / `out`.
    unsafe {
        run(err, || {
            let c = tagged(cache)?;
            let dst = out(out_len, "out_len")?;
            dst.set(c.cache.len(c.seq(seq))?);
            Ok(())
        })
    }
}

/// Stores the K and V of layer `layer` for the `n_tokens` positions `first..first +
/// n_tokens` of `seq`, rounded to the storage dtype. `k` and `v` are
/// `[n_tokens][kv_heads][head_dim]` floats; `k_len` / `v_len` are their lengths in
/// elements (at least `n_tokens × kv_heads × head_dim`; only that many are read). The
/// positions must have been appended since the sequence last became shareable (last
/// commit or fork). `n_tokens` 0 writes nothing (`k`, `v` may then be NULL).
/// O(n_tokens × kv_heads × head_dim).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache, sizes that overflow), `KVPAGE_ERR_BUFFER_TOO_SMALL` (`needed` /
/// `available` elements), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`,
/// `KVPAGE_ERR_NOT_WRITABLE`, `KVPAGE_ERR_BAD_LAYER`.
///
/// # Safety
/// `cache` is null or a live cache; `k` and `v` are null or readable for `k_len` /
/// `v_len` floats.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_cache_write_kv(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    layer: u32,
    first: u32,
    n_tokens: u32,
    k: *const f32,
    k_len: usize,
    v: *const f32,
    v_len: usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `kv_inputs`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let (k, v) = c.kv_inputs(n_tokens, (k, k_len), (v, v_len))?;
            let s = c.seq(seq);
            c.cache.write_kv(s, layer, first, k, v)?;
            Ok(())
        })
    }
}

/// `kvpage_cache_write_kv` with `k` and `v` already in the cache's storage dtype
/// `dtype` (`KVPAGE_DTYPE_*`; f16 and bf16 as their 16-bit patterns), copied without
/// conversion, so a model computing in f16 does not convert twice. `k_len` / `v_len`
/// count elements of `dtype`; the pointers are aligned for it (4 bytes for f32, 2 for
/// f16 / bf16). O(n_tokens × kv_heads × head_dim).
///
/// # Errors
/// As `kvpage_cache_write_kv`; `KVPAGE_ERR_INVALID_ARGUMENT` for an unknown dtype
/// (`value` = the code), `KVPAGE_ERR_DTYPE_MISMATCH` when `dtype` is not the cache's or
/// is an 8-bit dtype (its codes carry no scale: write such a cache from `float`).
///
/// # Safety
/// `cache` is null or a live cache; `k` and `v` are null or readable for `k_len` /
/// `v_len` elements of `dtype`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_cache_write_kv_raw(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    layer: u32,
    first: u32,
    n_tokens: u32,
    dtype: u32,
    k: *const c_void,
    k_len: usize,
    v: *const c_void,
    v_len: usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `kv_inputs` for the element type of
    // `dtype`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let dtype = dtype_from_c(dtype)?;
            let s = c.seq(seq);
            for_dtype!(dtype, T => {
                c.cache.layout().check_element::<T>()?;
                let (k, v) = c.kv_inputs::<T>(n_tokens, (k.cast(), k_len), (v.cast(), v_len))?;
                c.cache.write_kv_as(s, layer, first, k, v)?;
            });
            Ok(())
        })
    }
}

/// Decode attention for layer `layer`: one query token per sequence (its last one,
/// whose K/V is written), over its whole context. `seqs` holds `n_seqs` ids (at most
/// `max_seqs`); `q` and `out` are `[n_seqs][q_heads][head_dim]` floats, `q_len` /
/// `out_len` their lengths in elements (at least `n_seqs × q_heads × head_dim`; only
/// that many are read / written). `q_heads` is a multiple of the KV heads (GQA);
/// `scale` multiplies the scores (usually `1/sqrt(head_dim)`). `n_seqs` 0 does
/// nothing. Runs on the cache's kernel threads; the result does not depend on their
/// number. O(Σ context × q_heads × head_dim).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache, sizes that overflow), `KVPAGE_ERR_BATCH_TOO_LARGE` (`needed` = n_seqs,
/// `available` = max_seqs), `KVPAGE_ERR_BUFFER_TOO_SMALL` (`needed` / `available`
/// elements), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`, `KVPAGE_ERR_BAD_LAYER`,
/// `KVPAGE_ERR_BAD_HEADS`, `KVPAGE_ERR_BAD_SCALE`. `out` is untouched on error.
///
/// # Safety
/// `cache` is null or a live cache; `seqs`, `q` are null or readable and `out` null or
/// writable for their lengths; `out` overlaps neither `q` nor `seqs`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_cache_decode(
    cache: *mut kvpage_cache,
    layer: u32,
    seqs: *const kvpage_seq,
    n_seqs: usize,
    q: *const f32,
    q_len: usize,
    out: *mut f32,
    out_len: usize,
    q_heads: u32,
    scale: f32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `slice` / `slice_mut`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let ids = slice(seqs, n_seqs, "seqs")?;
            let (q, out) = (slice(q, q_len, "q")?, slice_mut(out, out_len, "out")?);
            c.check_batch(n_seqs)?;
            let needed = c.elems(n_seqs as u64, q_heads)?;
            let (q, out) = (head(q, needed, "q")?, head_mut(out, needed, "out")?);
            c.decode.clear();
            for &id in ids {
                let s = c.seq(id);
                c.decode.push(s);
            }
            c.cache.decode(layer, &c.decode, q, out, q_heads, scale)?;
            Ok(())
        })
    }
}

/// Chunked-prefill attention for layer `layer`: for sequence `seqs[i]` its last
/// `n_queries[i]` tokens are queries (causal over its whole context; their K/V is
/// written). `seqs` and `n_queries` both hold `n_seqs` entries (at most `max_seqs`);
/// `q` and `out` are `[Σ n_queries][q_heads][head_dim]` floats in the order of
/// `seqs`, `q_len` / `out_len` their lengths in elements (at least that many; only
/// that many are read / written). Decode is the case of every `n_queries[i]` = 1.
/// O(Σ queries × context × q_heads × head_dim).
///
/// # Errors
/// As `kvpage_cache_decode`, plus `KVPAGE_ERR_QUERIES_EXCEED_CONTEXT` (`needed`
/// queries, `available` context). `out` is untouched on error.
///
/// # Safety
/// As `kvpage_cache_decode`; `n_queries` is null or readable for `n_seqs` counts.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_cache_prefill(
    cache: *mut kvpage_cache,
    layer: u32,
    seqs: *const kvpage_seq,
    n_queries: *const u32,
    n_seqs: usize,
    q: *const f32,
    q_len: usize,
    out: *mut f32,
    out_len: usize,
    q_heads: u32,
    scale: f32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `slice` / `slice_mut`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let ids = slice(seqs, n_seqs, "seqs")?;
            let counts = slice(n_queries, n_seqs, "n_queries")?;
            let (q, out) = (slice(q, q_len, "q")?, slice_mut(out, out_len, "out")?);
            c.check_batch(n_seqs)?;
            let tokens: u64 = counts.iter().map(|&n| u64::from(n)).sum();
            let needed = c.elems(tokens, q_heads)?;
            let (q, out) = (head(q, needed, "q")?, head_mut(out, needed, "out")?);
            c.prefill.clear();
            for (&id, &n) in ids.iter().zip(counts) {
                let s = c.seq(id);
                c.prefill.push((s, n));
            }
            c.cache.prefill(layer, &c.prefill, q, out, q_heads, scale)?;
            Ok(())
        })
    }
}

/// Rotates in place the stored keys of tokens `first..end` of `seq`, in every layer and
/// KV head, by `delta` positions under the rotary embedding `*params`: after a context
/// shift moved those tokens by `delta` (negative: towards the start), their keys read
/// as if computed at the new positions, without recomputing them. Values, the length
/// and the pending range are untouched; `first == end` or `delta == 0` writes nothing
/// (the checks below still apply).
/// The angles are computed in double precision, each key rounded once to the storage
/// dtype. Runs on the cache's kernel threads; the result does not depend on their
/// number. O((end - first) × layers × kv_heads × rotary_dims).
///
/// Every block holding one of the tokens must belong to `seq` alone: a block another
/// sequence shares (a fork, a prefix hit) or one registered in the prefix cache (a
/// committed full block with token ids) is refused, since rotating it would change
/// what others read.
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache; an unknown pairing, `value` = the code; rotary dims zero, odd or over
/// the head dim, `value` = rotary dims; a base that is not finite and above 1;
/// `first > end`), `KVPAGE_ERR_BEYOND_LENGTH` (`needed` = `end`, `available` = length),
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`,
/// `KVPAGE_ERR_BLOCK_SHARED` (`value` = the first such block, `needed` = its reference
/// count). Nothing is written on error.
///
/// # Safety
/// `cache` is null or a live cache; `params` is null or readable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_rotate_keys(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    first: u32,
    end: u32,
    delta: i64,
    params: *const kvpage_rope_params,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `obj`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let rope = obj(params, "params")?.to_rust()?;
            let s = c.seq(seq);
            c.cache.rotate_keys(s, first, end, delta, rope)?;
            Ok(())
        })
    }
}
