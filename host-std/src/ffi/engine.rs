//! Tier 1's engine step: continuous batching over an owned cache, where kvpage also
//! executes the block copies and runs attention (the Rust [`crate::Engine`]).
//!
//! One step, as a model runs it:
//! 1. `kvpage_engine_step` plans and executes the step (its swap and copy-on-write
//!    copies included) and returns a `kvpage_step`; `kvpage_engine_step_seqs` copies
//!    its scheduled sequences.
//! 2. Per layer: compute q, k, v of the step's tokens as one batch (`[num_tokens]
//!    [heads][head_dim]`, in step order), store k and v with `kvpage_engine_write_kv`,
//!    attend with `kvpage_engine_attention`.
//! 3. Sample a token for every sequence that `emits` and report them with
//!    `kvpage_engine_commit_step`, which returns the finished requests.
//!
//! Everything is allocated in `kvpage_engine_new`; no later call allocates.

use kvpage_core::Sampled;

use super::args::{free_boxed, obj, out, out_opt, slice, slice_mut, tagged, tagged_mut, Tagged};
use super::cache::{capacity_from_c, kvpage_cache_default_params, kvpage_cache_params};
use super::geometry::kvpage_geometry;
use super::ids::{kvpage_request, request_from_c, request_to_c};
use super::manager_retain::priority_from_c;
use super::plan::{
    kvpage_finished, kvpage_sampled, kvpage_scheduler_params, kvpage_step_seq,
    KVPAGE_PREEMPT_RECOMPUTE,
};
use super::result::{kvpage_error, kvpage_result, run, Fail};
use super::stats::{kvpage_engine_counters, kvpage_stats};
use super::step::{
    check_limits, commit_into, kvpage_step, last_token_from_c, max_new_from_c, state_to_c,
    write_step_seqs, write_tokens, NO_SAMPLE,
};
use crate::engine::{Engine, EngineConfig};
use crate::tables::try_filled;

/// What `kvpage_engine_new` builds. Start from `kvpage_engine_default_params`. The
/// backend is the cache's (`cache.backend`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct kvpage_engine_params {
    /// The cache: geometry, device capacity, sequences (forks included), longest
    /// sequence (prompt plus generated), kernel threads.
    pub cache: kvpage_cache_params,
    /// Requests in flight at once (waiting, running, swapped out).
    pub max_requests: u32,
    /// Token budget, running limit, watermark and preemption mode of every step.
    pub scheduler: kvpage_scheduler_params,
    /// Host tier for swapped-out sequences in blocks; at most one of the two host
    /// capacities is non-zero, both 0 = no host tier (preemption then recomputes).
    pub host_capacity_blocks: u32,
    /// Host tier in bytes (whole blocks).
    pub host_capacity_bytes: u64,
}

impl kvpage_engine_params {
    /// The checked Rust configuration.
    fn to_rust(self) -> Result<EngineConfig, Fail> {
        Ok(EngineConfig {
            cache: self.cache.to_rust()?,
            max_requests: self.max_requests,
            scheduler: check_limits(self.max_requests, self.scheduler)?,
            host_capacity: capacity_from_c(
                self.host_capacity_blocks,
                self.host_capacity_bytes,
                true,
            )?,
        })
    }
}

/// Parameters of an engine for `geometry`: the cache of
/// `kvpage_cache_default_params(geometry)`, 256 requests, steps of at most 2048 tokens
/// and 64 running sequences, a watermark of 1 block, preemption by recompute, no host
/// tier. O(1); thread-safe; cannot fail (the geometry is checked by `_new`).
#[no_mangle]
pub extern "C" fn kvpage_engine_default_params(geometry: kvpage_geometry) -> kvpage_engine_params {
    kvpage_engine_params {
        cache: kvpage_cache_default_params(geometry),
        max_requests: 256,
        scheduler: kvpage_scheduler_params {
            token_budget: 2048,
            max_running: 64,
            watermark_blocks: 1,
            preemption: KVPAGE_PREEMPT_RECOMPUTE,
        },
        host_capacity_blocks: 0,
        host_capacity_bytes: 0,
    }
}

/// Marks a live engine.
const MAGIC: u64 = u64::from_le_bytes(*b"kvpgENG1");

/// The tier-1 engine: opaque to C, created by `kvpage_engine_new`, freed by
/// `kvpage_engine_free`.
///
/// `repr(C)` with the magic word first, so a pointer to any 8 readable bytes is
/// checked safely; declared opaque in the header (cbindgen.toml), its fields are not
/// C types.
/// cbindgen:ignore
#[repr(C)]
pub struct kvpage_engine {
    magic: u64,
    pub(super) engine: Engine,
    /// The commit's samples converted from C (`max_requests` entries).
    samples: Vec<Sampled>,
}

// SAFETY: `repr(C)` with `magic: u64` first, holding MAGIC in every live object.
unsafe impl Tagged for kvpage_engine {
    const MAGIC: u64 = MAGIC;
    const WHAT: &'static str = "engine";
    const NOT_LIVE: &'static str = "not a kvpage_engine (uninitialised, freed or corrupted)";
}

/// Allocates an engine: its cache (arena, tables, kernel threads), host tier and
/// request table. All memory is allocated here; no later call allocates. The caller
/// frees it with `kvpage_engine_free`. O(arena bytes + host arena + tables).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`; `KVPAGE_ERR_INVALID_ARGUMENT` (unknown dtype or
/// preemption mode); `KVPAGE_ERR_BAD_CONFIG` (zero geometry, both or neither capacity,
/// zero `max_seqs`, `max_seq_len`, `max_requests`, `token_budget` or `max_running`,
/// head dim over the kernels' maximum); `KVPAGE_ERR_OUT_OF_MEMORY`; the backend's
/// errors as `kvpage_cache_new`'s.
///
/// # Safety
/// `params` is null or readable; `out_engine` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_new(
    params: *const kvpage_engine_params,
    out_engine: *mut *mut kvpage_engine,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `obj` / `out`.
    unsafe {
        run(err, || {
            let params = obj(params, "params")?;
            let (config, backend) = (params.to_rust()?, params.cache.backend()?);
            let dst = out(out_engine, "out_engine")?;
            let samples = try_filled(config.max_requests as usize, NO_SAMPLE)?;
            let engine = Engine::with_backend(config, backend)?;
            dst.set(Box::into_raw(Box::new(kvpage_engine {
                magic: MAGIC,
                engine,
                samples,
            })));
            Ok(())
        })
    }
}

/// Frees an engine and everything it allocated (joins its kernel threads). NULL is a
/// no-op (`KVPAGE_OK`). Request ids and step pointers of the engine are invalid
/// afterwards. Not concurrently with any other call on the engine; freeing twice is
/// undefined (a freed pointer is usually, not always, refused with
/// `KVPAGE_ERR_INVALID_ARGUMENT`). O(threads + memory).
///
/// # Errors
/// `KVPAGE_ERR_MISALIGNED`; `KVPAGE_ERR_INVALID_ARGUMENT` for a pointer that is not a
/// live engine (nothing is freed).
///
/// # Safety
/// `engine` is null or from `kvpage_engine_new` and not freed yet, used by no other
/// call now or later.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_free(
    engine: *mut kvpage_engine,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the caller's contract is `free_boxed`'s; `_new` boxed the engine.
    unsafe { run(err, || free_boxed(engine)) }
}

/// Queues a request: `prompt` (`n` token ids, copied), its prefix-cache namespace
/// `ns` (requests share cached prompt blocks only within one namespace), and at most
/// `max_new_tokens` to generate (0: no limit, until a sample says stop or the
/// sequence is full). It waits for admission by a step. O(n).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_INVALID_ARGUMENT` (empty prompt),
/// `KVPAGE_ERR_STEP_IN_PROGRESS`, `KVPAGE_ERR_SEQ_TOO_LONG` (prompt longer than a
/// sequence holds), `KVPAGE_ERR_UNSCHEDULABLE` (its blocks plus the watermark exceed
/// the pool), `KVPAGE_ERR_QUEUE_FULL`.
///
/// # Safety
/// `engine` is null or a live engine; `prompt` null or readable for `n` ids;
/// `out_request` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_add_request(
    engine: *mut kvpage_engine,
    ns: u64,
    prompt: *const u32,
    n: usize,
    max_new_tokens: u32,
    out_request: *mut kvpage_request,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let e = tagged_mut(engine)?;
            let prompt = slice(prompt, n, "prompt")?;
            let dst = out(out_request, "out_request")?;
            let id = e
                .engine
                .add_request(prompt, ns, max_new_from_c(max_new_tokens))?;
            dst.set(request_to_c(id));
            Ok(())
        })
    }
}

/// `kvpage_engine_add_request` for a request of retention `priority` (a
/// `KVPAGE_PRIORITY_*` level): the prompt blocks it computes or reuses stay cached at
/// least that long; `KVPAGE_PRIORITY_PINNED` keeps a hot system prompt for every later
/// request. O(n).
///
/// # Errors
/// As `kvpage_engine_add_request`, and `KVPAGE_ERR_INVALID_ARGUMENT` for a level above
/// `KVPAGE_PRIORITY_PINNED` (`value` = level).
///
/// # Safety
/// As `kvpage_engine_add_request`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_engine_add_request_at(
    engine: *mut kvpage_engine,
    ns: u64,
    prompt: *const u32,
    n: usize,
    max_new_tokens: u32,
    priority: u32,
    out_request: *mut kvpage_request,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let e = tagged_mut(engine)?;
            let prompt = slice(prompt, n, "prompt")?;
            let dst = out(out_request, "out_request")?;
            let priority = priority_from_c(priority)?;
            let id =
                e.engine
                    .add_request_at(prompt, ns, max_new_from_c(max_new_tokens), priority)?;
            dst.set(request_to_c(id));
            Ok(())
        })
    }
}

/// Plans and executes one step — preemptions, growth, swap-ins, admissions — and its
/// block copies, and writes it to `*out_step` (pointers borrowed from the engine, see
/// `kvpage_step`; its block table is the cache's). A step may schedule nothing. Then
/// run the model (`kvpage_engine_write_kv`, `kvpage_engine_attention`) and call
/// `kvpage_engine_commit_step`. O(requests in flight + tokens and blocks touched +
/// copied bytes).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_STEP_IN_PROGRESS` (commit the previous step
/// first), `KVPAGE_ERR_UNSCHEDULABLE` (nothing runs and the next request can never
/// fit: cancel it, `value` names it); nothing changes on these. `KVPAGE_ERR_INTERNAL`
/// would be a bug.
///
/// # Safety
/// `engine` is null or a live engine; `out_step` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_step(
    engine: *mut kvpage_engine,
    out_step: *mut kvpage_step,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let e = tagged_mut(engine)?;
            let dst = out(out_step, "out_step")?;
            e.engine.step()?;
            let step = super::step::pending(e.engine.pending_step())?;
            dst.set(kvpage_step::new(&step, e.engine.cache().block_manager()));
            Ok(())
        })
    }
}

/// Copies the scheduled sequences of the pending step into `out` (`out_len` records,
/// at least the step's `num_seqs`) and writes their number to `*n_out`.
/// O(scheduled sequences).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_NO_STEP_IN_PROGRESS`,
/// `KVPAGE_ERR_BUFFER_TOO_SMALL` (`needed` = `num_seqs`).
///
/// # Safety
/// `engine` is null or a live engine; `out` null or writable for `out_len` records;
/// `n_out` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_step_seqs(
    engine: *const kvpage_engine,
    out_seqs: *mut kvpage_step_seq,
    out_len: usize,
    n_out: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let e = tagged(engine)?;
            write_step_seqs(e.engine.pending_step(), out_seqs, out_len, n_out)
        })
    }
}

/// Stores the K and V of layer `layer` for every token of the pending step: `k` and
/// `v` are `[num_tokens][kv_heads][head_dim]` f32 each (`k_len`, `v_len` elements,
/// exactly that many), in step order; they are converted to the cache's dtype.
/// O(num_tokens × kv_heads × head_dim).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_NO_STEP_IN_PROGRESS`,
/// `KVPAGE_ERR_BUFFER_TOO_SMALL` (a length other than the step's, `needed` = it),
/// `KVPAGE_ERR_BAD_LAYER`. Nothing is written on error.
///
/// # Safety
/// `engine` is null or a live engine; `k`, `v` null or readable for their lengths.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_write_kv(
    engine: *mut kvpage_engine,
    layer: u32,
    k: *const f32,
    k_len: usize,
    v: *const f32,
    v_len: usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let e = tagged_mut(engine)?;
            let (k, v) = (slice(k, k_len, "k")?, slice(v, v_len, "v")?);
            Ok(e.engine.write_kv(layer, k, v)?)
        })
    }
}

/// Attention of layer `layer` for every sequence of the pending step: its new tokens
/// are the queries, causal over its whole context (cached positions and this step's,
/// stored by `kvpage_engine_write_kv`). `q` and `out` are `[num_tokens][q_heads]
/// [head_dim]` f32 (`q_len`, `out_len` elements, exactly that many), in step order;
/// `scale` multiplies the scores (usually `1/sqrt(head_dim)`).
/// O(Σ queries × context × q_heads × head_dim), on the engine's kernel threads.
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_NO_STEP_IN_PROGRESS`,
/// `KVPAGE_ERR_BUFFER_TOO_SMALL` (a length other than the step's), `KVPAGE_ERR_BAD_LAYER`,
/// `KVPAGE_ERR_BAD_HEADS`, `KVPAGE_ERR_BAD_SCALE`. Nothing is written on error.
///
/// # Safety
/// `engine` is null or a live engine; `q` null or readable for `q_len` floats; `out`
/// null or writable for `out_len` floats, not overlapping `q`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_engine_attention(
    engine: *mut kvpage_engine,
    layer: u32,
    q: *const f32,
    q_len: usize,
    out: *mut f32,
    out_len: usize,
    q_heads: u32,
    scale: f32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let e = tagged_mut(engine)?;
            let (q, out) = (slice(q, q_len, "q")?, slice_mut(out, out_len, "out")?);
            Ok(e.engine.attention(layer, q, out, q_heads, scale)?)
        })
    }
}

/// Ends the pending step with `n` samples, exactly one per scheduled sequence that
/// `emits` (any order): the computed blocks become shareable, each sampled token is
/// appended to its request, and requests that stop, reach `max_new_tokens` or fill
/// their sequence finish (their ids become stale). The finished requests are written
/// to `finished` and their number to `*n_finished`. The commit cannot be undone, so
/// `finished` is checked first: it must have room for `out_len >= n` records (at most
/// one request finishes per sample). O(n + scheduled + blocks committed or released).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_NO_STEP_IN_PROGRESS`,
/// `KVPAGE_ERR_BUFFER_TOO_SMALL` (`out_len < n`), `KVPAGE_ERR_INVALID_ARGUMENT`
/// (`n > max_requests`), `KVPAGE_ERR_STALE_REQUEST`, `KVPAGE_ERR_WRONG_STATE` (a
/// sample for a sequence that does not emit), `KVPAGE_ERR_DUPLICATE_SAMPLE`,
/// `KVPAGE_ERR_MISSING_SAMPLE`. Nothing changes on error.
///
/// # Safety
/// `engine` is null or a live engine; `sampled` null or readable for `n` records;
/// `finished` null or writable for `out_len` records; `n_finished` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_commit_step(
    engine: *mut kvpage_engine,
    sampled: *const kvpage_sampled,
    n: usize,
    finished: *mut kvpage_finished,
    out_len: usize,
    n_finished: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let e = tagged_mut(engine)?;
            let pending = e.engine.pending_step().is_some();
            let engine = &mut e.engine;
            commit_into(
                pending,
                sampled,
                n,
                &mut e.samples,
                finished,
                out_len,
                n_finished,
                |s| Ok(engine.commit_step(s)?),
            )
        })
    }
}

/// Cancels a request in any state between steps: its blocks are released (or its
/// host blocks, swapped out) and its id becomes stale. O(its blocks + requests).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_STEP_IN_PROGRESS`,
/// `KVPAGE_ERR_STALE_REQUEST`. Nothing changes on error.
///
/// # Safety
/// `engine` is null or a live engine.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_cancel(
    engine: *mut kvpage_engine,
    request: kvpage_request,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let e = tagged_mut(engine)?;
            Ok(e.engine.cancel(request_from_c(request))?)
        })
    }
}

/// Forks a running request between steps (parallel sampling, beams): the child
/// shares the parent's blocks (copy-on-write on the first write into a shared
/// partial block), tokens, generated count, namespace and limit, and its id is
/// written to `*out_request`. With `has_last_token` non-zero, the child's last token —
/// sampled and not yet computed — is `last_token` instead (another sample from the
/// same logits). O(blocks + tokens of the parent).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_STEP_IN_PROGRESS`,
/// `KVPAGE_ERR_STALE_REQUEST`, `KVPAGE_ERR_WRONG_STATE` (not running, or
/// `has_last_token` before its first sample), `KVPAGE_ERR_QUEUE_FULL`,
/// `KVPAGE_ERR_NO_FREE_SEQ`. Nothing changes on error.
///
/// # Safety
/// `engine` is null or a live engine; `out_request` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_fork(
    engine: *mut kvpage_engine,
    request: kvpage_request,
    has_last_token: u32,
    last_token: u32,
    out_request: *mut kvpage_request,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let e = tagged_mut(engine)?;
            let dst = out(out_request, "out_request")?;
            let child = e.engine.fork(
                request_from_c(request),
                last_token_from_c(has_last_token, last_token),
            )?;
            dst.set(request_to_c(child));
            Ok(())
        })
    }
}

/// Writes where a request is to `*out_state`: `KVPAGE_REQUEST_WAITING`,
/// `KVPAGE_REQUEST_RUNNING` or `KVPAGE_REQUEST_SWAPPED`. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_STALE_REQUEST` (finished, cancelled, never
/// issued).
///
/// # Safety
/// `engine` is null or a live engine; `out_state` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_request_state(
    engine: *const kvpage_engine,
    request: kvpage_request,
    out_state: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let e = tagged(engine)?;
            let dst = out(out_state, "out_state")?;
            dst.set(state_to_c(e.engine.state(request_from_c(request))?));
            Ok(())
        })
    }
}

/// Copies a request's token ids — its prompt, then the tokens sampled so far — into
/// `out` (`out_len` entries) and writes their number to `*n_out`. On
/// `KVPAGE_ERR_BUFFER_TOO_SMALL`, `err->needed` is the number of tokens (pass
/// `out_len` 0 to ask). O(tokens).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_STALE_REQUEST`, `KVPAGE_ERR_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `engine` is null or a live engine; `out` null or writable for `out_len` ids;
/// `n_out` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_request_tokens(
    engine: *const kvpage_engine,
    request: kvpage_request,
    out_tokens: *mut u32,
    out_len: usize,
    n_out: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let e = tagged(engine)?;
            let tokens = e.engine.tokens(request_from_c(request)).map_err(Fail::from);
            write_tokens(tokens, out_tokens, out_len, n_out)
        })
    }
}

/// Writes the engine's counters to `*out_stats` and, when `cache_stats` is non-null,
/// a snapshot of its cache's pool. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER` (`engine`, `out_stats`).
///
/// # Safety
/// `engine` is null or a live engine; `out_stats` null or writable; `cache_stats` null
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_stats(
    engine: *const kvpage_engine,
    out_stats: *mut kvpage_engine_counters,
    cache_stats: *mut kvpage_stats,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let e = tagged(engine)?;
            let dst = out(out_stats, "out_stats")?;
            let cache_dst = out_opt(cache_stats, "cache_stats")?;
            dst.set(e.engine.stats().into());
            if let Some(c) = cache_dst {
                c.set(e.engine.cache().stats().into());
            }
            Ok(())
        })
    }
}
