//! Tier 2, sequences: the sequence operations of the manager over caller memory. Each
//! writes the physical slot (`block * block_size + offset`) of every new token into the
//! caller's slot array, for the caller's kernels to write K/V there, and returns the
//! copy-on-write the caller must execute first. Nothing allocates.
//!
//! Every function takes the manager first (`kvpage_manager_init`) and validates the
//! sequence id: a released, never-issued or forged id, or one of another manager, is
//! `KVPAGE_ERR_STALE_SEQ`. A pointer that is not a manager is
//! `KVPAGE_ERR_INVALID_ARGUMENT` (null: `KVPAGE_ERR_NULL_POINTER`). A swapped-out
//! sequence is `KVPAGE_ERR_SEQ_SWAPPED` for everything but the swap functions.

use kvpage_core::{Appended, PrefixHit};

use super::args::{out, out_opt, slice, slice_mut};
use super::ids::{kvpage_seq, seq_to_c};
use super::manager::{kvpage_manager, manager_mut, manager_ref};
use super::plan::kvpage_block_copy;
use super::result::{kvpage_error, kvpage_result, run, Fail};

/// What an append did besides writing the slots.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct kvpage_appended {
    /// Non-zero when `copy` is set: the sequence's last block was partly filled and
    /// shared (after a fork or a prefix hit), so it was copied. Execute the copy (all
    /// layers' K and V of block `copy.src` into `copy.dst`) before writing K/V into the
    /// new slots.
    pub has_copy: u32,
    /// The copy-on-write; `{0, 0}` when `has_copy` is 0.
    pub copy: kvpage_block_copy,
    /// Blocks newly allocated for the tokens (not counting the copy's destination).
    pub new_blocks: u32,
}

impl From<Appended> for kvpage_appended {
    fn from(a: Appended) -> Self {
        Self {
            has_copy: u32::from(a.copy.is_some()),
            copy: a.copy.map(Into::into).unwrap_or_default(),
            new_blocks: a.new_blocks,
        }
    }
}

/// A sequence created from a prompt (`kvpage_manager_create_with_prompt`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct kvpage_prompt_start {
    /// The new sequence, holding the whole prompt.
    pub seq: kvpage_seq,
    /// Leading prompt tokens whose K/V is in the prefix cache already (a multiple of
    /// the block size, less than the prompt's length): compute only the rest.
    pub reused_tokens: u32,
    /// Slots written: `prompt_len - reused_tokens`, one per token after the reused ones.
    pub slots_written: u32,
    /// Non-zero when `copy` must be executed before writing K/V (as
    /// `kvpage_appended::has_copy`; a prompt never needs one today).
    pub has_copy: u32,
    /// The copy-on-write; `{0, 0}` when `has_copy` is 0.
    pub copy: kvpage_block_copy,
    /// Blocks newly allocated for the tokens after the reused ones.
    pub new_blocks: u32,
}

/// What the prefix cache holds for a prompt (`kvpage_manager_prefix_lookup`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct kvpage_prefix_hit {
    /// Leading prompt tokens found cached (a multiple of the block size).
    pub tokens: u32,
    /// Blocks of them that no sequence references now: they count as available until a
    /// sequence takes them.
    pub idle_blocks: u32,
}

impl From<PrefixHit> for kvpage_prefix_hit {
    fn from(h: PrefixHit) -> Self {
        Self {
            tokens: h.tokens,
            idle_blocks: h.idle_blocks,
        }
    }
}

/// Creates an empty sequence whose blocks are shared through the prefix cache only with
/// sequences of the same `namespace` (a tenant, a model adapter), and writes its id to
/// `*out_seq`. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a manager), `KVPAGE_ERR_NO_FREE_SEQ`.
///
/// # Safety
/// `manager` is null or a manager from `kvpage_manager_init`; `out_seq` is null or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_create(
    manager: *mut kvpage_manager,
    namespace: u64,
    out_seq: *mut kvpage_seq,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_mut` / `out`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let dst = out(out_seq, "out_seq")?;
            dst.set(seq_to_c(m.manager.create(namespace)?));
            Ok(())
        })
    }
}

/// Creates a sequence holding the prompt `prompt[0..prompt_len]`, sharing the longest
/// run of whole leading blocks already committed to the prefix cache of `namespace`
/// (verified token by token; at least one prompt token is always left to compute) and
/// allocating the rest. `slots[0..out->slots_written]` receives the slot of each prompt
/// token after the reused ones; `slots_len >= prompt_len` always suffices. Commit the
/// blocks (`kvpage_manager_commit`) once their K/V is written to share them.
/// O(prompt_len).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER` (`prompt` with `prompt_len > 0`, `slots` with
/// `slots_len > 0`, `out`), `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_NO_FREE_SEQ`, `KVPAGE_ERR_SEQ_TOO_LONG` (`needed` tokens, `available`
/// maximum), `KVPAGE_ERR_OUT_OF_BLOCKS` (`needed`, `available`),
/// `KVPAGE_ERR_BUFFER_TOO_SMALL` (`needed` slots, `available` = `slots_len`).
///
/// # Safety
/// `manager` is null or a manager; `prompt` is readable for `prompt_len` values and
/// `slots` writable for `slots_len` (either may be null when its length is 0); `out` is
/// null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_create_with_prompt(
    manager: *mut kvpage_manager,
    namespace: u64,
    prompt: *const u32,
    prompt_len: usize,
    slots: *mut u32,
    slots_len: usize,
    out_start: *mut kvpage_prompt_start,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers and lengths checked by `args`; contents by the caller's contract.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let prompt = slice(prompt, prompt_len, "prompt")?;
            let slots = slice_mut(slots, slots_len, "slots")?;
            let dst = out(out_start, "out_start")?;
            let start = m.manager.create_with_prompt(namespace, prompt, slots)?;
            let appended = kvpage_appended::from(start.appended);
            dst.set(kvpage_prompt_start {
                seq: seq_to_c(start.seq),
                reused_tokens: start.reused_tokens,
                // The core refuses prompts longer than `max_tokens_per_seq` (a u32).
                slots_written: (prompt.len() - start.reused_tokens as usize) as u32,
                has_copy: appended.has_copy,
                copy: appended.copy,
                new_blocks: appended.new_blocks,
            });
            Ok(())
        })
    }
}

/// Appends `n` tokens whose ids are not known (they never enter the prefix cache, nor do
/// later blocks of this sequence until it is truncated before them): allocates blocks as
/// needed, writes each new token's slot to `slots[0..n]`, and describes a copy-on-write
/// in `*out_appended`. The one-token decode append into an unshared block is O(1);
/// otherwise O(n).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`, `KVPAGE_ERR_SEQ_TOO_LONG`,
/// `KVPAGE_ERR_OUT_OF_BLOCKS`, `KVPAGE_ERR_BUFFER_TOO_SMALL` (`needed` = n,
/// `available` = `slots_len`).
///
/// # Safety
/// `manager` is null or a manager; `slots` is writable for `slots_len` values (null
/// when 0); `out_appended` is null or writable. It is required: a copy the caller does
/// not execute would corrupt the sequence.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_append(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    n: u32,
    slots: *mut u32,
    slots_len: usize,
    out_appended: *mut kvpage_appended,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers and lengths checked by `args`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let slots = slice_mut(slots, slots_len, "slots")?;
            let dst = out(out_appended, "out_appended")?;
            dst.set(m.manager.append(m.seq(seq), n, slots)?.into());
            Ok(())
        })
    }
}

/// Appends the tokens `tokens[0..n]`, as `kvpage_manager_append`, keeping their ids so
/// that full blocks enter the prefix cache once `kvpage_manager_commit` says their K/V
/// is written. O(n).
///
/// # Errors
/// As `kvpage_manager_append`.
///
/// # Safety
/// As `kvpage_manager_append`; `tokens` is readable for `n` values (null when 0).
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_append_tokens(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    tokens: *const u32,
    n: usize,
    slots: *mut u32,
    slots_len: usize,
    out_appended: *mut kvpage_appended,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers and lengths checked by `args`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let tokens = slice(tokens, n, "tokens")?;
            let slots = slice_mut(slots, slots_len, "slots")?;
            let dst = out(out_appended, "out_appended")?;
            dst.set(m.manager.append_tokens(m.seq(seq), tokens, slots)?.into());
            Ok(())
        })
    }
}

/// Declares the K/V of the first `computed_tokens` tokens of `seq` written: their full
/// blocks with known token ids become shareable through the prefix cache (before that
/// no other sequence can hit them, so nobody reads K/V that is not there yet). Writes
/// the number of blocks committed by this call to `*out_newly_cached` (NULL to ignore).
/// O(block_size) per newly committed block; committing the same tokens again is O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER` (manager), `KVPAGE_ERR_MISALIGNED`,
/// `KVPAGE_ERR_INVALID_ARGUMENT`, `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`,
/// `KVPAGE_ERR_BEYOND_LENGTH` (`needed` = computed_tokens, `available` = length).
///
/// # Safety
/// `manager` is null or a manager; `out_newly_cached` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_commit(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    computed_tokens: u32,
    out_newly_cached: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_mut` / `out_opt`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let dst = out_opt(out_newly_cached, "out_newly_cached")?;
            let blocks = m.manager.commit(m.seq(seq), computed_tokens)?;
            if let Some(dst) = dst {
                dst.set(blocks);
            }
            Ok(())
        })
    }
}

/// Creates a sequence sharing every block of `seq` (reference counts go up; a shared
/// partial block is copied on the first append to it, reported by that append) and
/// writes its id to `*out_seq`. O(blocks of `seq`).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`, `KVPAGE_ERR_NO_FREE_SEQ`.
///
/// # Safety
/// `manager` is null or a manager; `out_seq` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_fork(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    out_seq: *mut kvpage_seq,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_mut` / `out`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let dst = out(out_seq, "out_seq")?;
            dst.set(seq_to_c(m.manager.fork(m.seq(seq))?));
            Ok(())
        })
    }
}

/// Shortens `seq` to `new_len` tokens (rejected speculative tokens, a rewind),
/// releasing the blocks no longer needed. O(released blocks).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`, `KVPAGE_ERR_BEYOND_LENGTH`
/// (`needed` = new_len, `available` = length).
///
/// # Safety
/// `manager` is null or a manager.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_truncate(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    new_len: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the pointer is checked by `manager_mut`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            m.manager.truncate(m.seq(seq), new_len)?;
            Ok(())
        })
    }
}

/// Releases `seq`: its id (and every copy of it) becomes stale; full committed blocks
/// nobody else holds stay in the prefix cache for later prompts. A second release is
/// `KVPAGE_ERR_STALE_SEQ`. O(blocks of `seq`).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED` (use
/// `kvpage_manager_release_swapped`).
///
/// # Safety
/// `manager` is null or a manager.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_release(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the pointer is checked by `manager_mut`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            m.manager.release(m.seq(seq))?;
            Ok(())
        })
    }
}

/// Tokens held by `seq`, to `*out_len`. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`.
///
/// # Safety
/// `manager` is null or a manager; `out_len` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_len(
    manager: *const kvpage_manager,
    seq: kvpage_seq,
    out_len: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_ref` / `out`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let dst = out(out_len, "out_len")?;
            dst.set(m.manager.len(m.seq(seq))?);
            Ok(())
        })
    }
}

/// Physical block ids of `seq` in logical order (`ceil(len / block_size)` of them) into
/// `out_blocks[0..]`, their number to `*out_n` (NULL to ignore). O(blocks).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`, `KVPAGE_ERR_BUFFER_TOO_SMALL`
/// (`needed` blocks, `available` = `out_blocks_len`: call with length 0 to learn it).
///
/// # Safety
/// `manager` is null or a manager; `out_blocks` is writable for `out_blocks_len`
/// values (null when 0); `out_n` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_blocks(
    manager: *const kvpage_manager,
    seq: kvpage_seq,
    out_blocks: *mut u32,
    out_blocks_len: usize,
    out_n: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers and lengths checked by `args`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let dst = slice_mut(out_blocks, out_blocks_len, "out_blocks")?;
            let n = out_opt(out_n, "out_n")?;
            let blocks = m.manager.blocks(m.seq(seq))?;
            let dst = dst.get_mut(..blocks.len()).ok_or(Fail::short(
                "out_blocks",
                blocks.len(),
                out_blocks_len,
            ))?;
            dst.copy_from_slice(blocks);
            if let Some(n) = n {
                n.set(blocks.len());
            }
            Ok(())
        })
    }
}

/// What `kvpage_manager_create_with_prompt` would reuse from the prefix cache of
/// `namespace` for `prompt[0..prompt_len]` now, to `*out_hit`. Changes nothing.
/// O(prompt_len).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `manager` is null or a manager; `prompt` is readable for `prompt_len` values (null
/// when 0); `out_hit` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_prefix_lookup(
    manager: *const kvpage_manager,
    namespace: u64,
    prompt: *const u32,
    prompt_len: usize,
    out_hit: *mut kvpage_prefix_hit,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers and lengths checked by `args`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let prompt = slice(prompt, prompt_len, "prompt")?;
            let dst = out(out_hit, "out_hit")?;
            dst.set(m.manager.prefix_lookup(namespace, prompt).into());
            Ok(())
        })
    }
}
