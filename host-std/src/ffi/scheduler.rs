//! Tier 3: the engine step over a tier-2 manager, for an engine that owns its K/V and
//! kernels. The scheduler (the core `Engine`) lives inside caller storage like the
//! manager: ask the size and alignment for a manager configuration and a scheduler
//! configuration, hand in one buffer, and nothing is allocated after that.
//!
//! A scheduler is bound to the manager it was initialised for: every call that
//! changes blocks (`step`, `commit_step`, `cancel`, `fork`) takes that manager and
//! refuses any other with `KVPAGE_ERR_FOREIGN_MANAGER`. Between steps the manager must
//! only be changed through the scheduler (its sequences are the scheduler's).
//!
//! One step: `kvpage_scheduler_step` returns a `kvpage_step` (block table = the
//! manager's); the caller executes its block copies — `swap_out`, then `swap_in`, then
//! `copies` — writes the K/V of token `i` at `slots[i]`, runs attention (sequences from
//! `kvpage_scheduler_step_seqs`), samples, and calls `kvpage_scheduler_commit_step`.

use core::ffi::c_void;
use core::mem::{align_of, size_of};

use kvpage_core::{Config, Engine, EngineConfig, EngineError, Sampled};

use super::args::{obj, out, slice, tagged, tagged_mut, Tagged};
use super::ids::{kvpage_request, request_from_c, request_to_c};
use super::manager::{kvpage_manager, kvpage_manager_config, manager_mut, manager_ref};
use super::plan::{kvpage_finished, kvpage_sampled, kvpage_scheduler_params, kvpage_step_seq};
use super::result::{kvpage_error, kvpage_result, run, Fail};
use super::stats::kvpage_engine_counters;
use super::step::{
    check_limits, commit_into, kvpage_step, last_token_from_c, max_new_from_c, pending, state_to_c,
    write_step_seqs, write_tokens, NO_SAMPLE,
};

/// What a tier-3 scheduler is sized for, next to its manager's configuration.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct kvpage_scheduler_config {
    /// Requests in flight at once (waiting, running, swapped out); > 0.
    pub max_requests: u32,
    /// Token budget, running limit, watermark and preemption mode of every step.
    pub scheduler: kvpage_scheduler_params,
}

/// Marks a live scheduler.
const MAGIC: u64 = u64::from_le_bytes(*b"kvpgSCH3");

/// The tier-3 scheduler: opaque to C, placed at the start of the caller's storage.
///
/// `repr(C)` with the magic word first, so a pointer to any 8 readable bytes is
/// checked safely; declared opaque in the header (cbindgen.toml), its fields are not
/// C types.
/// cbindgen:ignore
#[repr(C)]
pub struct kvpage_scheduler {
    magic: u64,
    /// The core engine over the storage after this struct.
    engine: Engine<'static>,
    /// The manager it drives (its address; managers never move).
    manager: *const kvpage_manager,
    /// The commit's samples converted from C (`max_requests` entries, in the storage).
    samples: &'static mut [Sampled],
}

// SAFETY: `repr(C)` with `magic: u64` first, holding MAGIC in every live object.
unsafe impl Tagged for kvpage_scheduler {
    const MAGIC: u64 = MAGIC;
    const WHAT: &'static str = "scheduler";
    const NOT_LIVE: &'static str = "not a kvpage_scheduler (uninitialised or corrupted)";
}

/// Bytes of the struct at the start of the storage, rounded to whole `u64` words.
const HEADER_BYTES: usize = size_of::<kvpage_scheduler>().next_multiple_of(8);

// The sample scratch follows the engine's words, so it is 8-aligned.
const _: () = assert!(align_of::<Sampled>() <= 8);

/// How a scheduler's storage is laid out.
struct Layout {
    engine: EngineConfig,
    engine_words: usize,
    bytes: usize,
}

/// The checked layout of a scheduler for a manager configured by `kv` with
/// `host_blocks` host blocks.
fn layout(kv: &Config, host_blocks: u32, config: &kvpage_scheduler_config) -> Result<Layout, Fail> {
    kv.validate()?;
    let engine = EngineConfig {
        max_requests: config.max_requests,
        scheduler: check_limits(config.max_requests, config.scheduler)?,
        host_blocks,
    };
    let engine_words = engine.storage_words(kv);
    let too_large = || Fail::from(kvpage_core::InitError::TooLarge);
    if engine_words == usize::MAX {
        return Err(too_large());
    }
    let sample_bytes = (config.max_requests as usize)
        .checked_mul(size_of::<Sampled>())
        .ok_or_else(too_large)?;
    let bytes = engine_words
        .checked_mul(8)
        .and_then(|b| b.checked_add(HEADER_BYTES))
        .and_then(|b| b.checked_add(sample_bytes.next_multiple_of(8)))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(too_large)?;
    Ok(Layout {
        engine,
        engine_words,
        bytes,
    })
}

/// Alignment in bytes the storage of a scheduler needs. O(1); thread-safe.
#[no_mangle]
pub extern "C" fn kvpage_scheduler_storage_align() -> usize {
    align_of::<kvpage_scheduler>().max(8)
}

/// Bytes of storage a scheduler needs for a manager configured by `manager_config`
/// (its `host_blocks` included) and `config` (to pass to `kvpage_scheduler_init`).
/// O(1); thread-safe.
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`; `KVPAGE_ERR_INVALID_ARGUMENT` (unknown preemption mode);
/// `KVPAGE_ERR_BAD_CONFIG` (an invalid manager configuration, zero `max_requests`,
/// `token_budget` or `max_running`, an unaddressable size).
///
/// # Safety
/// `manager_config` and `config` are null or readable; `out_bytes` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_scheduler_storage_size(
    manager_config: *const kvpage_manager_config,
    config: *const kvpage_scheduler_config,
    out_bytes: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `obj` / `out`.
    unsafe {
        run(err, || {
            let mc = obj(manager_config, "manager_config")?;
            let config = obj(config, "config")?;
            let dst = out(out_bytes, "out_bytes")?;
            dst.set(layout(&mc.to_core(), mc.host_blocks, config)?.bytes);
            Ok(())
        })
    }
}

/// Builds a scheduler for `manager` (a live tier-2 manager, which it is bound to for
/// good) inside `storage` (`storage_bytes` long, aligned to
/// `kvpage_scheduler_storage_align()`, size from `kvpage_scheduler_storage_size` with
/// the manager's configuration; its contents are ignored) and writes its address (=
/// `storage`) to `*out_scheduler`. No request is in flight. The caller keeps the
/// storage alive and untouched while the scheduler is used, and frees it afterwards
/// (after the manager's storage or before, as it likes); nothing is allocated, now or
/// later. The manager should hold no sequence of its own: the scheduler plans with
/// the whole pool. O(storage bytes / 8).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a manager, unknown preemption mode), `KVPAGE_ERR_BAD_CONFIG`,
/// `KVPAGE_ERR_STORAGE_TOO_SMALL` (`needed` / `available` bytes).
///
/// # Safety
/// `manager` is null or a live manager; `config` null or readable; `storage` null or
/// writable for `storage_bytes` bytes, used by nothing else while the scheduler lives;
/// `out_scheduler` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_scheduler_init(
    manager: *const kvpage_manager,
    config: *const kvpage_scheduler_config,
    storage: *mut c_void,
    storage_bytes: usize,
    out_scheduler: *mut *mut kvpage_scheduler,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use; the storage contract is the caller's.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let config = obj(config, "config")?;
            let dst = out(out_scheduler, "out_scheduler")?;
            let base = storage.cast::<u64>();
            if base.is_null() {
                return Err(Fail::null("storage"));
            }
            if !(base as usize).is_multiple_of(kvpage_scheduler_storage_align()) {
                return Err(Fail::new(kvpage_result::KVPAGE_ERR_MISALIGNED, "storage"));
            }
            let kv = *m.manager.config();
            let host_blocks = m.host.as_ref().map_or(0, |h| h.total_blocks());
            let layout = layout(&kv, host_blocks, config)?;
            if storage_bytes < layout.bytes {
                return Err(Fail::new(
                    kvpage_result::KVPAGE_ERR_STORAGE_TOO_SMALL,
                    "storage too small for the scheduler",
                )
                .with_sizes(layout.bytes as u64, storage_bytes as u64));
            }
            // SAFETY: `layout.bytes` bytes from `base` are writable and exclusive
            // (contract); the words start after the header, 8-aligned since `base` is.
            let words: &'static mut [u64] =
                core::slice::from_raw_parts_mut(base.add(HEADER_BYTES / 8), layout.engine_words);
            let engine = Engine::new(layout.engine, &kv, words)?;
            let n = config.max_requests as usize;
            let samples = base
                .add(HEADER_BYTES / 8 + layout.engine_words)
                .cast::<Sampled>();
            for i in 0..n {
                // SAFETY: within the storage (the layout counted `n` samples), aligned
                // (8-aligned start, `Sampled` aligned to at most 8); nothing live there.
                samples.add(i).write(NO_SAMPLE);
            }
            // SAFETY: `n` initialised samples, exclusive to the scheduler.
            let samples: &'static mut [Sampled] = core::slice::from_raw_parts_mut(samples, n);
            let s = base.cast::<kvpage_scheduler>();
            // SAFETY: the header bytes are writable, aligned for the struct, and hold
            // no live value (their contents are ignored).
            s.write(kvpage_scheduler {
                magic: MAGIC,
                engine,
                manager,
                samples,
            });
            dst.set(s);
            Ok(())
        })
    }
}

/// The scheduler and its own manager, checked: `KVPAGE_ERR_FOREIGN_MANAGER` for any
/// other manager (the core also compares configurations).
///
/// # Safety
/// As `tagged_mut` and `manager_mut`.
unsafe fn with_manager<'a>(
    scheduler: *mut kvpage_scheduler,
    manager: *mut kvpage_manager,
) -> Result<(&'a mut kvpage_scheduler, &'a mut kvpage_manager), Fail> {
    // SAFETY: forwarded contract.
    let (s, m) = unsafe { (tagged_mut(scheduler)?, manager_mut(manager)?) };
    if !core::ptr::eq(s.manager, manager) {
        return Err(EngineError::ForeignManager.into());
    }
    Ok((s, m))
}

/// Queues a request: `prompt` (`n` token ids, copied into the scheduler's storage),
/// its prefix-cache namespace `ns`, and at most `max_new_tokens` to generate (0: no
/// limit). It waits for admission by a step. O(n).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_INVALID_ARGUMENT` (empty prompt),
/// `KVPAGE_ERR_STEP_IN_PROGRESS`, `KVPAGE_ERR_SEQ_TOO_LONG`, `KVPAGE_ERR_UNSCHEDULABLE`,
/// `KVPAGE_ERR_QUEUE_FULL`. Nothing changes on error.
///
/// # Safety
/// `scheduler` is null or a live scheduler; `prompt` null or readable for `n` ids;
/// `out_request` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_scheduler_add_request(
    scheduler: *mut kvpage_scheduler,
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
            let s = tagged_mut(scheduler)?;
            let prompt = slice(prompt, n, "prompt")?;
            let dst = out(out_request, "out_request")?;
            let id = s
                .engine
                .add_request(prompt, ns, max_new_from_c(max_new_tokens))?;
            dst.set(request_to_c(id));
            Ok(())
        })
    }
}

/// Plans and executes one step on `manager` (and its host tier) and writes it to
/// `*out_step` (pointers borrowed from the scheduler and the manager, see
/// `kvpage_step`). The caller executes the step's block copies (`swap_out`, then
/// `swap_in`, then `copies`) before the model writes K/V, then calls
/// `kvpage_scheduler_commit_step`. O(requests in flight + tokens and blocks touched).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_INVALID_ARGUMENT` (not a scheduler or
/// manager), `KVPAGE_ERR_FOREIGN_MANAGER`, `KVPAGE_ERR_STEP_IN_PROGRESS`,
/// `KVPAGE_ERR_UNSCHEDULABLE` (`value` names the request to cancel); nothing changes
/// on these. `KVPAGE_ERR_INTERNAL` would be a bug (or a manager changed behind the
/// scheduler's back).
///
/// # Safety
/// `scheduler` is null or a live scheduler; `manager` null or a live manager;
/// `out_step` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_scheduler_step(
    scheduler: *mut kvpage_scheduler,
    manager: *mut kvpage_manager,
    out_step: *mut kvpage_step,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let (s, m) = with_manager(scheduler, manager)?;
            let dst = out(out_step, "out_step")?;
            s.engine.step(&mut m.manager, m.host.as_mut())?;
            let step = pending(s.engine.pending_step())?;
            dst.set(kvpage_step::new(&step, &m.manager));
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
/// `scheduler` is null or a live scheduler; `out` null or writable for `out_len`
/// records; `n_out` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_scheduler_step_seqs(
    scheduler: *const kvpage_scheduler,
    out_seqs: *mut kvpage_step_seq,
    out_len: usize,
    n_out: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let s = tagged(scheduler)?;
            write_step_seqs(s.engine.pending_step(), out_seqs, out_len, n_out)
        })
    }
}

/// Ends the pending step with `n` samples, exactly one per scheduled sequence that
/// `emits`: the model has written the K/V of every scheduled token, so their full
/// blocks become shareable through the manager's prefix cache; sampled tokens are
/// appended, and requests that stop, reach `max_new_tokens` or fill their sequence
/// finish (their sequences are released in `manager`, their ids become stale). The
/// finished requests are written to `finished` and their number to `*n_finished`.
/// The commit cannot be undone, so `finished` is checked first: `out_len >= n`.
/// O(n + scheduled + blocks committed or released).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_FOREIGN_MANAGER`,
/// `KVPAGE_ERR_NO_STEP_IN_PROGRESS`, `KVPAGE_ERR_BUFFER_TOO_SMALL` (`out_len < n`),
/// `KVPAGE_ERR_INVALID_ARGUMENT` (`n > max_requests`), `KVPAGE_ERR_STALE_REQUEST`,
/// `KVPAGE_ERR_WRONG_STATE`, `KVPAGE_ERR_DUPLICATE_SAMPLE`, `KVPAGE_ERR_MISSING_SAMPLE`.
/// Nothing changes on error.
///
/// # Safety
/// `scheduler` is null or a live scheduler; `manager` null or a live manager;
/// `sampled` null or readable for `n` records; `finished` null or writable for
/// `out_len` records; `n_finished` null or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_scheduler_commit_step(
    scheduler: *mut kvpage_scheduler,
    manager: *mut kvpage_manager,
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
            let (s, m) = with_manager(scheduler, manager)?;
            let pending = s.engine.pending_step().is_some();
            let engine = &mut s.engine;
            commit_into(
                pending,
                sampled,
                n,
                s.samples,
                finished,
                out_len,
                n_finished,
                |samples| Ok(engine.commit_step(&mut m.manager, samples)?),
            )
        })
    }
}

/// Cancels a request in any state between steps: its sequence is released in
/// `manager` (or, swapped out, its host blocks freed) and its id becomes stale.
/// O(its blocks + requests).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_FOREIGN_MANAGER`,
/// `KVPAGE_ERR_STEP_IN_PROGRESS`, `KVPAGE_ERR_STALE_REQUEST`. Nothing changes on error.
///
/// # Safety
/// `scheduler` is null or a live scheduler; `manager` null or a live manager.
#[no_mangle]
pub unsafe extern "C" fn kvpage_scheduler_cancel(
    scheduler: *mut kvpage_scheduler,
    manager: *mut kvpage_manager,
    request: kvpage_request,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let (s, m) = with_manager(scheduler, manager)?;
            let id = request_from_c(request);
            Ok(s.engine.cancel(&mut m.manager, m.host.as_mut(), id)?)
        })
    }
}

/// Forks a running request between steps (see `kvpage_engine_fork`): the child
/// shares the parent's blocks in `manager` and its id is written to `*out_request`.
/// With `has_last_token` non-zero the child's last, not yet computed token is
/// `last_token`. O(blocks + tokens of the parent).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_FOREIGN_MANAGER`,
/// `KVPAGE_ERR_STEP_IN_PROGRESS`, `KVPAGE_ERR_STALE_REQUEST`, `KVPAGE_ERR_WRONG_STATE`,
/// `KVPAGE_ERR_QUEUE_FULL`, `KVPAGE_ERR_NO_FREE_SEQ`. Nothing changes on error.
///
/// # Safety
/// `scheduler` is null or a live scheduler; `manager` null or a live manager;
/// `out_request` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_scheduler_fork(
    scheduler: *mut kvpage_scheduler,
    manager: *mut kvpage_manager,
    request: kvpage_request,
    has_last_token: u32,
    last_token: u32,
    out_request: *mut kvpage_request,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let (s, m) = with_manager(scheduler, manager)?;
            let dst = out(out_request, "out_request")?;
            let child = s.engine.fork(
                &mut m.manager,
                request_from_c(request),
                last_token_from_c(has_last_token, last_token),
            )?;
            dst.set(request_to_c(child));
            Ok(())
        })
    }
}

/// Writes where a request is to `*out_state` (`KVPAGE_REQUEST_*`). O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_STALE_REQUEST`.
///
/// # Safety
/// `scheduler` is null or a live scheduler; `out_state` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_scheduler_request_state(
    scheduler: *const kvpage_scheduler,
    request: kvpage_request,
    out_state: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let s = tagged(scheduler)?;
            let dst = out(out_state, "out_state")?;
            dst.set(state_to_c(s.engine.state(request_from_c(request))?));
            Ok(())
        })
    }
}

/// Copies a request's token ids (prompt, then sampled tokens) into `out` (`out_len`
/// entries) and writes their number to `*n_out`; on `KVPAGE_ERR_BUFFER_TOO_SMALL`,
/// `err->needed` is the number of tokens. O(tokens).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_STALE_REQUEST`, `KVPAGE_ERR_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `scheduler` is null or a live scheduler; `out` null or writable for `out_len` ids;
/// `n_out` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_scheduler_request_tokens(
    scheduler: *const kvpage_scheduler,
    request: kvpage_request,
    out_tokens: *mut u32,
    out_len: usize,
    n_out: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let s = tagged(scheduler)?;
            let tokens = s.engine.tokens(request_from_c(request)).map_err(Fail::from);
            write_tokens(tokens, out_tokens, out_len, n_out)
        })
    }
}

/// Writes the scheduler's counters to `*out_stats` (the pool's are the manager's
/// statistics). O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`.
///
/// # Safety
/// `scheduler` is null or a live scheduler; `out_stats` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_scheduler_stats(
    scheduler: *const kvpage_scheduler,
    out_stats: *mut kvpage_engine_counters,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use.
    unsafe {
        run(err, || {
            let s = tagged(scheduler)?;
            let dst = out(out_stats, "out_stats")?;
            dst.set(s.engine.stats().into());
            Ok(())
        })
    }
}
