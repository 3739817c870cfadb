//! The engine step as C sees it, written once for the owned engine (tier 1,
//! `kvpage_engine_*`) and the scheduler over caller memory (tier 3,
//! `kvpage_scheduler_*`): the step record with borrowed arrays, the copy of the scheduled
//! sequences, the commit that writes finished requests into a caller buffer, request
//! states and token lists.

use core::mem::{align_of, size_of};

use kvpage_core::{
    BlockCopy, BlockManager, FinishedRequests, RequestState, Sampled, SchedulerConfig, Step,
};

use super::args::{out, slice, slice_mut};
use super::plan::{kvpage_block_copy, kvpage_finished, kvpage_sampled, kvpage_step_seq};
use super::result::{kvpage_result, Fail};

/// The request waits: not admitted yet, or preempted by recompute.
pub const KVPAGE_REQUEST_WAITING: u32 = 0;
/// The request holds device blocks (it is scheduled by the steps).
pub const KVPAGE_REQUEST_RUNNING: u32 = 1;
/// The request's blocks are swapped out to the host tier.
pub const KVPAGE_REQUEST_SWAPPED: u32 = 2;

/// The C code of a request state.
pub(crate) fn state_to_c(state: RequestState) -> u32 {
    match state {
        RequestState::Waiting => KVPAGE_REQUEST_WAITING,
        RequestState::Running => KVPAGE_REQUEST_RUNNING,
        RequestState::Swapped => KVPAGE_REQUEST_SWAPPED,
    }
}

/// `max_new_tokens` as C passes it: 0 is "no limit".
pub(crate) fn max_new_from_c(max_new_tokens: u32) -> Option<u32> {
    (max_new_tokens != 0).then_some(max_new_tokens)
}

/// The replacement last token of a fork as C passes it.
pub(crate) fn last_token_from_c(has_last_token: u32, last_token: u32) -> Option<u32> {
    (has_last_token != 0).then_some(last_token)
}

/// One step: what the backend copies and the model computes.
///
/// Every pointer BORROWS the storage of the engine (tier 1) or of the scheduler and
/// the manager (tier 3). They stay valid, and their contents unchanged, until the next
/// call that mutates that engine, scheduler or manager (`*_step`, `*_commit_step`,
/// `*_add_request`, `*_cancel`, `*_fork`, any tier-2 operation on the manager, or
/// freeing it); read-only calls (`*_step_seqs`, `*_request_state`, `*_request_tokens`,
/// `*_stats`, `kvpage_engine_write_kv`, `kvpage_engine_attention`) leave them valid.
/// An array whose count is 0 is NULL.
///
/// Execution order for a backend that owns its K/V (tier 3; tier 1 has done it
/// already): the block copies of `swap_out` (device to host), then `swap_in` (host to
/// device), then `copies` (device to device, copy-on-write); then the model writes
/// the K/V of token `i` at `slots[i]` and runs attention over `block_table`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvpage_step {
    /// Scheduled sequences (copy them with `*_step_seqs`); 0 when nothing runs.
    pub num_seqs: usize,
    /// Query tokens of the step, all sequences together.
    pub num_tokens: usize,
    /// `num_tokens` input token ids, sequence after sequence (sequence `s` at
    /// `offset .. offset + tokens` of its `kvpage_step_seq`).
    pub input_tokens: *const u32,
    /// `num_tokens` slots (`block * block_size + offset in block`), in the order of
    /// `input_tokens`: where the K/V of each query token is written.
    pub slots: *const u32,
    /// Swap-out copies (`src` device block, `dst` host block): execute first.
    pub swap_out: *const kvpage_block_copy,
    /// Entries of `swap_out`.
    pub num_swap_out: usize,
    /// Swap-in copies (`src` host block, `dst` device block): execute second.
    pub swap_in: *const kvpage_block_copy,
    /// Entries of `swap_in`.
    pub num_swap_in: usize,
    /// Copy-on-write copies (device to device): execute third, before writing K/V.
    pub copies: *const kvpage_block_copy,
    /// Entries of `copies`.
    pub num_copies: usize,
    /// Requests preempted by this step (recomputed later or swapped out).
    pub num_preempted: usize,
    /// The dense block table, `block_table_rows` × `block_table_stride` `uint32_t`s,
    /// row-major, row = `seq_row` of a `kvpage_step_seq`: tier 1 the cache's, tier 3
    /// the manager's. Entries past a row's `ceil(context / block_size)` are
    /// unspecified.
    pub block_table: *const u32,
    /// Rows of `block_table` (`max_seqs`).
    pub block_table_rows: u32,
    /// Entries per row of `block_table` (`max_blocks_per_seq`).
    pub block_table_stride: u32,
}

// SAFETY of the casts in `copies_to_c`: the two records are the same `repr(C)` pair of
// `u32`s (src, dst), so their size and alignment agree, checked here at compile time.
const _: () = {
    assert!(size_of::<BlockCopy>() == size_of::<kvpage_block_copy>());
    assert!(align_of::<BlockCopy>() == align_of::<kvpage_block_copy>());
};

/// The C pointer of borrowed block copies; NULL for none.
fn copies_to_c(copies: &[BlockCopy]) -> *const kvpage_block_copy {
    if copies.is_empty() {
        return core::ptr::null();
    }
    // SAFETY (of later reads through the pointer): `BlockCopy` and `kvpage_block_copy`
    // are both `repr(C)` {u32 src, u32 dst} with equal size and alignment (asserted
    // above), so the array reads as `kvpage_block_copy`s.
    copies.as_ptr().cast()
}

/// The C pointer of borrowed `u32`s; NULL for none.
fn words_to_c(words: &[u32]) -> *const u32 {
    if words.is_empty() {
        core::ptr::null()
    } else {
        words.as_ptr()
    }
}

impl kvpage_step {
    /// The C view of `step`, whose block-table rows index `kv`'s table. O(1).
    pub(crate) fn new(step: &Step<'_>, kv: &BlockManager<'_>) -> Self {
        let config = kv.config();
        Self {
            num_seqs: step.len(),
            num_tokens: step.slots().len(),
            input_tokens: words_to_c(step.input_tokens()),
            slots: words_to_c(step.slots()),
            swap_out: copies_to_c(step.swap_out()),
            num_swap_out: step.swap_out().len(),
            swap_in: copies_to_c(step.swap_in()),
            num_swap_in: step.swap_in().len(),
            copies: copies_to_c(step.copies()),
            num_copies: step.copies().len(),
            num_preempted: step.preempted().len(),
            block_table: words_to_c(kv.block_table()),
            block_table_rows: config.max_seqs,
            block_table_stride: config.max_blocks_per_seq,
        }
    }
}

/// The step waiting for its commit, or `KVPAGE_ERR_NO_STEP_IN_PROGRESS`.
pub(crate) fn pending<'s>(step: Option<Step<'s>>) -> Result<Step<'s>, Fail> {
    step.ok_or(Fail::from(kvpage_core::EngineError::NoStepInProgress))
}

/// Copies the scheduled sequences of the pending `step` into `out` (`out_len`
/// entries) and writes their number to `n_out`. O(scheduled sequences).
///
/// # Safety
/// `out` is null or writable for `out_len` records; `n_out` is null or writable.
pub(crate) unsafe fn write_step_seqs(
    step: Option<Step<'_>>,
    dst: *mut kvpage_step_seq,
    out_len: usize,
    n_out: *mut usize,
) -> Result<(), Fail> {
    // SAFETY: forwarded contract; the pointers are checked before use.
    let (dst, n_out) = unsafe { (slice_mut(dst, out_len, "out")?, out(n_out, "n_out")?) };
    let step = pending(step)?;
    if dst.len() < step.len() {
        return Err(Fail::short("out", step.len(), dst.len()));
    }
    for (d, s) in dst.iter_mut().zip(step.seqs()) {
        *d = s.into();
    }
    n_out.set(step.len());
    Ok(())
}

/// Ends the pending step with the `n` samples at `sampled`: checks everything the
/// commit cannot undo first — a pending step, the pointers, `n` within `scratch`
/// (`max_requests`), and room for one finished record per sample in `finished`
/// (`out_len >= n`) — converts the samples into `scratch`, runs `commit`, and copies
/// the finished requests out. O(n + the commit).
///
/// # Safety
/// `sampled` is null or readable for `n` records; `finished` is null or writable for
/// `out_len` records; `n_finished` is null or writable.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn commit_into<'e>(
    has_pending: bool,
    sampled: *const kvpage_sampled,
    n: usize,
    scratch: &mut [Sampled],
    finished: *mut kvpage_finished,
    out_len: usize,
    n_finished: *mut usize,
    commit: impl FnOnce(&[Sampled]) -> Result<FinishedRequests<'e>, Fail>,
) -> Result<(), Fail> {
    if !has_pending {
        return Err(Fail::from(kvpage_core::EngineError::NoStepInProgress));
    }
    // SAFETY: forwarded contract; the pointers are checked before use.
    let (sampled, dst, n_finished) = unsafe {
        (
            slice(sampled, n, "sampled")?,
            slice_mut(finished, out_len, "finished")?,
            out(n_finished, "n_finished")?,
        )
    };
    if dst.len() < sampled.len() {
        return Err(Fail::short("finished", sampled.len(), dst.len()));
    }
    if sampled.len() > scratch.len() {
        return Err(Fail::new(
            kvpage_result::KVPAGE_ERR_INVALID_ARGUMENT,
            "more samples than max_requests",
        )
        .with_sizes(scratch.len() as u64, sampled.len() as u64));
    }
    let scratch = &mut scratch[..sampled.len()];
    for (d, &s) in scratch.iter_mut().zip(sampled) {
        *d = s.into();
    }
    let done = commit(scratch)?;
    for (d, f) in dst.iter_mut().zip(done.iter()) {
        *d = f.into();
    }
    n_finished.set(done.len());
    Ok(())
}

/// A filler for the sample scratch buffers (overwritten before every use).
pub(crate) const NO_SAMPLE: Sampled = Sampled {
    request: kvpage_core::RequestId::from_parts(u32::MAX, 0),
    token: 0,
    stop: false,
};

/// Copies a request's token ids into `out` (`out_len` entries) and writes their
/// number to `n_out`. O(tokens).
///
/// # Safety
/// `out` is null or writable for `out_len` `u32`s; `n_out` is null or writable.
pub(crate) unsafe fn write_tokens(
    tokens: Result<&[u32], Fail>,
    dst: *mut u32,
    out_len: usize,
    n_out: *mut usize,
) -> Result<(), Fail> {
    // SAFETY: forwarded contract; the pointers are checked before use.
    let (dst, n_out) = unsafe { (slice_mut(dst, out_len, "out")?, out(n_out, "n_out")?) };
    let tokens = tokens?;
    if dst.len() < tokens.len() {
        return Err(Fail::short("out", tokens.len(), dst.len()));
    }
    dst[..tokens.len()].copy_from_slice(tokens);
    n_out.set(tokens.len());
    Ok(())
}

/// The checked scheduler limits with `max_requests`: both tiers refuse zeros the same
/// way.
pub(crate) fn check_limits(
    max_requests: u32,
    params: super::plan::kvpage_scheduler_params,
) -> Result<SchedulerConfig, Fail> {
    let sched = params.to_core()?;
    if max_requests == 0 || sched.token_budget == 0 || sched.max_running == 0 {
        return Err(Fail::new(
            kvpage_result::KVPAGE_ERR_BAD_CONFIG,
            "max_requests, token_budget and max_running must be non-zero",
        ));
    }
    Ok(sched)
}
