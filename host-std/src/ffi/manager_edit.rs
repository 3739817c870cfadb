//! Tier 2, sequence edits: the `llama.h`-style edits of the manager over caller memory.
//! An edit writes the block copies (`kvpage_block_copy`) and token-row moves
//! (`kvpage_row_move`) the caller's kernels must execute — copies first, then moves in
//! order, before the next call that allocates — into the caller's arrays, and says how
//! many in a `kvpage_edit`. Arrays of `max_blocks_per_seq` copies and
//! `2 * max_blocks_per_seq + 1` moves always suffice. Nothing allocates; a failed edit
//! changes nothing and writes no out-parameter.

use kvpage_core::{BlockCopy, Edited, RowMove};

use super::args::{out, out_opt, slice, slice_mut};
use super::cache_edit::kvpage_context_shift;
use super::ids::{kvpage_seq, seq_to_c};
use super::manager::{kvpage_manager, manager_mut, manager_ref};
use super::plan::{kvpage_block_copy, kvpage_row_move};
use super::result::{kvpage_error, kvpage_result, run, Fail};

// The core's copies and moves are written straight into the caller's arrays.
const _: () = assert!(
    size_of::<kvpage_row_move>() == size_of::<RowMove>()
        && align_of::<kvpage_row_move>() == align_of::<RowMove>()
        && size_of::<kvpage_block_copy>() == size_of::<BlockCopy>()
        && align_of::<kvpage_block_copy>() == align_of::<BlockCopy>()
);

/// What an edit wrote and did.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct kvpage_edit {
    /// Block copies written to the front of `copies`: execute them first.
    pub copies: u32,
    /// Row moves written to the front of `moves`: execute them next, in order.
    pub moves: u32,
    /// Blocks allocated (copy destinations, blocks of a copied range).
    pub new_blocks: u32,
    /// Block references dropped.
    pub released_blocks: u32,
}

impl From<Edited> for kvpage_edit {
    fn from(e: Edited) -> Self {
        Self {
            copies: e.copies,
            moves: e.moves,
            new_blocks: e.new_blocks,
            released_blocks: e.released_blocks,
        }
    }
}

/// The caller's copy and move arrays as the core's types.
///
/// # Safety
/// As the exported functions: each pointer is writable for its length (null when 0).
unsafe fn buffers<'a>(
    copies: *mut kvpage_block_copy,
    copies_len: usize,
    moves: *mut kvpage_row_move,
    moves_len: usize,
) -> Result<(&'a mut [BlockCopy], &'a mut [RowMove]), Fail> {
    // SAFETY: checked by `slice_mut`; the record types match (asserted above).
    unsafe {
        Ok((
            slice_mut(copies.cast::<BlockCopy>(), copies_len, "copies")?,
            slice_mut(moves.cast::<RowMove>(), moves_len, "moves")?,
        ))
    }
}

/// Removes tokens `first..end` of `seq` and moves the later ones down (llama's `seq_rm`);
/// they keep their positions. Writes the copies and moves to execute, and their numbers
/// to `*out_edit` (NULL to ignore). A block-aligned range only edits the block table.
/// O(blocks of `seq`).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`, `KVPAGE_ERR_BEYOND_LENGTH` (range
/// reversed or past the length: `needed` = `end`, `available` = length, `value` =
/// `first`), `KVPAGE_ERR_OUT_OF_BLOCKS`, `KVPAGE_ERR_BUFFER_TOO_SMALL` (`copies` or
/// `moves`), `KVPAGE_ERR_TOO_MANY_POSITION_RUNS`.
///
/// # Safety
/// `manager` is null or a manager; `copies` / `moves` writable for their lengths (null
/// when 0); `out_edit` null or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_manager_seq_rm(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    first: u32,
    end: u32,
    copies: *mut kvpage_block_copy,
    copies_len: usize,
    moves: *mut kvpage_row_move,
    moves_len: usize,
    out_edit: *mut kvpage_edit,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_mut` / `buffers` / `out_opt`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let (c, mv) = buffers(copies, copies_len, moves, moves_len)?;
            let dst = out_opt(out_edit, "out_edit")?;
            let s = m.seq(seq);
            let edited = m.manager.remove_range(s, first, end, c, mv)?;
            if let Some(dst) = dst {
                dst.set(edited.into());
            }
            Ok(())
        })
    }
}

/// Context shift: keeps the first `n_keep` tokens of `seq`, drops the next `n_discard`,
/// moves the rest down and lowers their positions by `n_discard`; every block of a moved
/// token becomes the sequence's own (shared ones are copied). Writes the copies and
/// moves to execute and, to `*out_shift`, their numbers and the tokens whose keys to
/// re-rotate (by `delta`) after them. O(blocks of `seq`).
///
/// # Errors
/// As `kvpage_manager_seq_rm` (`KVPAGE_ERR_BEYOND_LENGTH` also for `n_discard` over
/// `INT32_MAX`).
///
/// # Safety
/// As `kvpage_manager_seq_rm`; `out_shift` null or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_manager_context_shift(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    n_keep: u32,
    n_discard: u32,
    copies: *mut kvpage_block_copy,
    copies_len: usize,
    moves: *mut kvpage_row_move,
    moves_len: usize,
    out_shift: *mut kvpage_context_shift,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_mut` / `buffers` / `out`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let (c, mv) = buffers(copies, copies_len, moves, moves_len)?;
            let dst = out(out_shift, "out_shift")?;
            let s = m.seq(seq);
            let shift = m.manager.context_shift(s, n_keep, n_discard, c, mv)?;
            dst.set(kvpage_context_shift {
                rotate_first: shift.rotate_first,
                rotate_end: shift.rotate_end,
                delta: shift.delta,
                copied_blocks: shift.edited.copies,
                row_moves: shift.edited.moves,
            });
            Ok(())
        })
    }
}

/// Adds `delta` to the positions of tokens `first..end` of `seq` (llama's `seq_add`).
/// Only positions change: to re-rotate the keys in place, first own their blocks with
/// `kvpage_manager_make_exclusive`. O(position runs).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`, `KVPAGE_ERR_BEYOND_LENGTH`,
/// `KVPAGE_ERR_BAD_POSITIONS`, `KVPAGE_ERR_TOO_MANY_POSITION_RUNS`.
///
/// # Safety
/// `manager` is null or a manager.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_seq_add(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    first: u32,
    end: u32,
    delta: i32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: checked by `manager_mut`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let s = m.seq(seq);
            m.manager.shift_positions(s, first, end, delta)?;
            Ok(())
        })
    }
}

/// Makes the blocks holding tokens `first..end` of `seq` its own so their K/V may be
/// rewritten in place (to re-rotate keys after `kvpage_manager_seq_add`): each shared one
/// is copied (`copies[0..*out_n]`, execute before writing). O(blocks in the range).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`, `KVPAGE_ERR_BEYOND_LENGTH`,
/// `KVPAGE_ERR_OUT_OF_BLOCKS`, `KVPAGE_ERR_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `manager` is null or a manager; `copies` writable for `copies_len` records (null
/// when 0); `out_n` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_make_exclusive(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    first: u32,
    end: u32,
    copies: *mut kvpage_block_copy,
    copies_len: usize,
    out_n: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_mut` / `buffers` / `out_opt`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let (c, _) = buffers(copies, copies_len, core::ptr::null_mut(), 0)?;
            let dst = out_opt(out_n, "out_n")?;
            let s = m.seq(seq);
            let n = m.manager.make_exclusive(s, first, end, c)?;
            if let Some(dst) = dst {
                dst.set(n as usize);
            }
            Ok(())
        })
    }
}

/// Creates a sequence in `namespace` holding tokens `first..end` of `seq` at their
/// positions (llama's `seq_cp` into a new sequence), its id to `*out_seq`. From a block
/// boundary it shares the blocks; otherwise it gets new blocks and the rows to copy into
/// them are written to `moves[0..*out_moves]` (`out_moves` NULL to ignore).
/// O(blocks of the range).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`, `KVPAGE_ERR_BEYOND_LENGTH`,
/// `KVPAGE_ERR_NO_FREE_SEQ`, `KVPAGE_ERR_OUT_OF_BLOCKS`, `KVPAGE_ERR_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `manager` is null or a manager; `moves` writable for `moves_len` records (null when
/// 0); `out_seq` null or writable; `out_moves` null or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_manager_seq_cp(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    first: u32,
    end: u32,
    namespace: u64,
    moves: *mut kvpage_row_move,
    moves_len: usize,
    out_seq: *mut kvpage_seq,
    out_moves: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_mut` / `buffers` / `out` / `out_opt`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let (_, mv) = buffers(core::ptr::null_mut(), 0, moves, moves_len)?;
            let dst = out(out_seq, "out_seq")?;
            let n = out_opt(out_moves, "out_moves")?;
            let s = m.seq(seq);
            let copied = m.manager.copy_range(s, first, end, namespace, mv)?;
            dst.set(seq_to_c(copied.seq));
            if let Some(n) = n {
                n.set(copied.edited.moves as usize);
            }
            Ok(())
        })
    }
}

/// Releases every sequence of `others[0..n_others]` except `keep` (llama's `seq_keep`
/// over the caller's set; a sequence listed twice is released once), their number to
/// `*out_released` (NULL to ignore). O(n_others + their blocks).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ` for `keep` or any of `others`, `KVPAGE_ERR_SEQ_SWAPPED` for
/// a swapped-out one of `others` (release it with `kvpage_manager_release_swapped`):
/// then nothing is released.
///
/// # Safety
/// `manager` is null or a manager; `others` readable for `n_others` ids (null when 0);
/// `out_released` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_seq_keep(
    manager: *mut kvpage_manager,
    keep: kvpage_seq,
    others: *const kvpage_seq,
    n_others: usize,
    out_released: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_mut` / `slice` / `out_opt`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let others = slice(others, n_others, "others")?;
            let dst = out_opt(out_released, "out_released")?;
            let keep = m.seq(keep);
            let instance = m.manager.config().instance;
            let handle = |&id: &kvpage_seq| super::ids::seq_from_c(id, instance);
            let n = m
                .manager
                .release_all_except(keep, others.iter().map(handle))?;
            if let Some(dst) = dst {
                dst.set(n);
            }
            Ok(())
        })
    }
}

/// Writes the first (`last` false) or last position of `seq` to `*out_pos`, -1 when it
/// is empty.
///
/// # Safety
/// As [`kvpage_manager_seq_pos_min`].
unsafe fn pos_end(
    manager: *const kvpage_manager,
    seq: kvpage_seq,
    last: bool,
    out_pos: *mut i64,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_ref` / `out`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let dst = out(out_pos, "out_pos")?;
            let s = m.seq(seq);
            let pos = match last {
                false => m.manager.pos_min(s)?,
                true => m.manager.pos_max(s)?,
            };
            dst.set(pos.map_or(-1, i64::from));
            Ok(())
        })
    }
}

/// Writes the position of the first token of `seq` to `*out_pos`, -1 when it is empty
/// (llama's `seq_pos_min`). O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`.
///
/// # Safety
/// `manager` is null or a manager; `out_pos` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_seq_pos_min(
    manager: *const kvpage_manager,
    seq: kvpage_seq,
    out_pos: *mut i64,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: forwarded under the same contract.
    unsafe { pos_end(manager, seq, false, out_pos, err) }
}

/// Writes the position of the last token of `seq` to `*out_pos`, -1 when it is empty
/// (llama's `seq_pos_max`). O(1).
///
/// # Errors
/// As [`kvpage_manager_seq_pos_min`].
///
/// # Safety
/// As [`kvpage_manager_seq_pos_min`].
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_seq_pos_max(
    manager: *const kvpage_manager,
    seq: kvpage_seq,
    out_pos: *mut i64,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: forwarded under the same contract.
    unsafe { pos_end(manager, seq, true, out_pos, err) }
}
