//! Tier 1, sequence edits in `llama.h`'s words: remove a token range
//! (`kvpage_cache_seq_rm`), shift positions (`kvpage_cache_seq_add`), copy a range into a
//! new sequence (`kvpage_cache_seq_cp`), keep one sequence of a set
//! (`kvpage_cache_seq_keep`), first and last position (`kvpage_cache_seq_pos_min` /
//! `_max`), and the context shift (`kvpage_cache_context_shift`). Token ranges are token
//! indices `[first, end)` of the sequence (a fresh sequence's positions equal its
//! indices). The cache executes the block copies and row moves an edit needs before the
//! call returns; none of these calls allocates.

use crate::cache::Seq;

use super::args::{obj, out, out_opt, slice, tagged, tagged_mut};
use super::cache::kvpage_cache;
use super::ids::{kvpage_seq, seq_from_c, seq_to_c};
use super::result::{kvpage_error, kvpage_result, run};
use super::rope::kvpage_rope_params;

/// What `kvpage_cache_context_shift` did.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct kvpage_context_shift {
    /// Tokens `rotate_first..rotate_end` (indices after the shift) were moved: without
    /// rope parameters their keys are still rotated at their old positions (rotate them
    /// by `delta`); with them, they were rotated. Empty when nothing moved.
    pub rotate_first: u32,
    /// End (exclusive) of the tokens to rotate.
    pub rotate_end: u32,
    /// Their position change: `-n_discard` (0 when nothing moved).
    pub delta: i32,
    /// Blocks copied (shared blocks the rotation must not touch in place).
    pub copied_blocks: u32,
    /// Row moves executed (0 for a block-aligned shift).
    pub row_moves: u32,
}

/// Removes tokens `first..end` of `seq` and moves the later ones down (llama's
/// `seq_rm`); they keep their positions. Block-aligned ranges drop whole blocks and copy
/// nothing. O(blocks of `seq` + moved rows × layers × kv_heads × head_dim).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`,
/// `KVPAGE_ERR_BEYOND_LENGTH` (range reversed or past the length: `needed` = `end`,
/// `available` = length, `value` = `first`), `KVPAGE_ERR_OUT_OF_BLOCKS` (a shared block
/// to copy), `KVPAGE_ERR_TOO_MANY_POSITION_RUNS`.
///
/// # Safety
/// `cache` is null or a live cache.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_seq_rm(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    first: u32,
    end: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: checked by `tagged_mut`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let s = c.seq(seq);
            c.cache.remove_range(s, first, end)?;
            Ok(())
        })
    }
}

/// Adds `delta` to the positions of tokens `first..end` of `seq` (llama's `seq_add`).
/// Only positions change; the keys stay rotated at the old ones. O(position runs).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`,
/// `KVPAGE_ERR_BEYOND_LENGTH`, `KVPAGE_ERR_BAD_POSITIONS` (positions would not stay
/// strictly increasing or would leave `0..=UINT32_MAX`),
/// `KVPAGE_ERR_TOO_MANY_POSITION_RUNS`.
///
/// # Safety
/// `cache` is null or a live cache.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_seq_add(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    first: u32,
    end: u32,
    delta: i32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: checked by `tagged_mut`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let s = c.seq(seq);
            c.cache.shift_positions(s, first, end, delta)?;
            Ok(())
        })
    }
}

/// Creates a sequence in `namespace` holding tokens `first..end` of `seq` at their
/// positions (llama's `seq_cp`, into a new sequence), written to `*out_seq`. From a
/// block boundary the blocks are shared (copy-on-write later); otherwise the rows are
/// copied into new blocks. O(blocks of the range, + copied rows).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`,
/// `KVPAGE_ERR_BEYOND_LENGTH`, `KVPAGE_ERR_NO_FREE_SEQ`, `KVPAGE_ERR_OUT_OF_BLOCKS`.
///
/// # Safety
/// `cache` is null or a live cache; `out_seq` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_seq_cp(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    first: u32,
    end: u32,
    namespace: u64,
    out_seq: *mut kvpage_seq,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `out`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let dst = out(out_seq, "out_seq")?;
            let s = c.seq(seq);
            dst.set(seq_to_c(c.cache.copy_range(s, first, end, namespace)?.id()));
            Ok(())
        })
    }
}

/// Releases every sequence of `others[0..n_others]` except `keep` (llama's `seq_keep`
/// over the caller's set; `keep` may be listed, a sequence listed twice is released
/// once). Writes how many were released to `*out_released` when it is not null.
/// O(n_others + their blocks).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER` (`others` null with `n_others > 0`),
/// `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT` (not a cache),
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ` for `keep` or any of `others`: then
/// nothing is released.
///
/// # Safety
/// `cache` is null or a live cache; `others` is null or `n_others` readable ids;
/// `out_released` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_seq_keep(
    cache: *mut kvpage_cache,
    keep: kvpage_seq,
    others: *const kvpage_seq,
    n_others: usize,
    out_released: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `slice` / `out`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let others = slice(others, n_others, "others")?;
            let released = out_opt(out_released, "out_released")?;
            let instance = c.cache.block_manager().config().instance;
            let handle = |&id: &kvpage_seq| Seq::from_id(seq_from_c(id, instance));
            let keep = handle(&keep);
            let n = c
                .cache
                .release_all_except(keep, others.iter().map(handle))?;
            if let Some(r) = released {
                r.set(n);
            }
            Ok(())
        })
    }
}

/// Context shift: keeps the first `n_keep` tokens of `seq`, drops the next `n_discard`,
/// moves the rest down and lowers their positions by `n_discard`, without recomputing
/// anything; the blocks of the moved tokens become this sequence's alone. Writes to
/// `*out_shift` which tokens were moved (`rotate_first..rotate_end`) and their position
/// change `delta`. With `params` NULL their keys are still rotated at their old
/// positions: rotate them by `delta` (`kvpage_cache_rotate_keys`). With `params`
/// non-null the call rotates them too, under that rotary embedding, so the sequence
/// reads as if computed at the new positions; `params` is checked before anything
/// changes. O(blocks of `seq` + moved rows × layers × kv_heads × head_dim, plus moved
/// tokens × layers × kv_heads × rotary_dims with `params`).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache; with `params`: an unknown pairing, `value` = the code; rotary dims
/// zero, odd or over the head dim, `value` = rotary dims; a base that is not finite and
/// above 1), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`,
/// `KVPAGE_ERR_BEYOND_LENGTH` (`n_keep + n_discard` past the length, or `n_discard`
/// over `INT32_MAX`), `KVPAGE_ERR_OUT_OF_BLOCKS`, `KVPAGE_ERR_TOO_MANY_POSITION_RUNS`.
/// Nothing changes on error.
///
/// # Safety
/// `cache` is null or a live cache; `params` is null or readable; `out_shift` is null or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_context_shift(
    cache: *mut kvpage_cache,
    seq: kvpage_seq,
    n_keep: u32,
    n_discard: u32,
    params: *const kvpage_rope_params,
    out_shift: *mut kvpage_context_shift,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `obj` / `out`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let rope = if params.is_null() {
                None
            } else {
                Some(obj(params, "params")?.to_rust()?)
            };
            let dst = out(out_shift, "out_shift")?;
            let s = c.seq(seq);
            let shift = match rope {
                Some(rope) => c.cache.context_shift_rotated(s, n_keep, n_discard, rope)?,
                None => c.cache.context_shift(s, n_keep, n_discard)?,
            };
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

/// The first (`last` = 0) or last (`last` != 0) position of `seq`, or -1 when it is
/// empty.
///
/// # Safety
/// As [`kvpage_cache_seq_pos_min`].
unsafe fn pos_end(
    cache: *const kvpage_cache,
    seq: kvpage_seq,
    last: bool,
    out_pos: *mut i64,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` / `out`.
    unsafe {
        run(err, || {
            let c = tagged(cache)?;
            let dst = out(out_pos, "out_pos")?;
            let range = c.cache.pos_range(c.seq(seq))?;
            let pos = range.map(|(min, max)| if last { max } else { min });
            dst.set(pos.map_or(-1, i64::from));
            Ok(())
        })
    }
}

/// Writes the position of the first token of `seq` to `*out_pos`, or -1 when it is empty
/// (llama's `seq_pos_min`). O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`.
///
/// # Safety
/// `cache` is null or a live cache; `out_pos` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_seq_pos_min(
    cache: *const kvpage_cache,
    seq: kvpage_seq,
    out_pos: *mut i64,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: forwarded under the same contract.
    unsafe { pos_end(cache, seq, false, out_pos, err) }
}

/// Writes the position of the last token of `seq` to `*out_pos`, or -1 when it is empty
/// (llama's `seq_pos_max`). O(1).
///
/// # Errors
/// As [`kvpage_cache_seq_pos_min`].
///
/// # Safety
/// As [`kvpage_cache_seq_pos_min`].
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_seq_pos_max(
    cache: *const kvpage_cache,
    seq: kvpage_seq,
    out_pos: *mut i64,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: forwarded under the same contract.
    unsafe { pos_end(cache, seq, true, out_pos, err) }
}
