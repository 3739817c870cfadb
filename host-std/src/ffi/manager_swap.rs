//! Tier 2, host tier: swap plans of the manager over caller memory. The manager's host
//! pool (`kvpage_manager_config::host_blocks` blocks, standing for the caller's pinned
//! host memory) receives swapped-out sequences; each swap returns the block copies the
//! caller executes (device to host on swap-out, host to device on swap-in; all layers'
//! K and V of one block each). A manager built with `host_blocks = 0` answers
//! `KVPAGE_ERR_NO_HOST_POOL`.

use kvpage_core::{BlockCopy, HostPool};

use super::args::{out, out_opt, slice_mut};
use super::ids::kvpage_seq;
use super::manager::{kvpage_manager, manager_mut, manager_ref};
use super::plan::kvpage_block_copy;
use super::result::{kvpage_error, kvpage_result, run, Fail};

// The core's copies are written straight into the caller's array.
const _: () = assert!(
    size_of::<kvpage_block_copy>() == size_of::<BlockCopy>()
        && align_of::<kvpage_block_copy>() == align_of::<BlockCopy>()
);

/// The failure of a manager without a host tier.
const NO_HOST: Fail = Fail::new(
    kvpage_result::KVPAGE_ERR_NO_HOST_POOL,
    "the manager has no host tier (host_blocks = 0)",
);

/// The host pool, or [`NO_HOST`].
fn host<'a>(host: &'a mut Option<HostPool<'static>>) -> Result<&'a mut HostPool<'static>, Fail> {
    host.as_mut().ok_or(NO_HOST)
}

/// Which way a swap goes.
#[derive(Clone, Copy)]
enum Way {
    Out,
    In,
}

/// The body of both swaps: checks, plans into the caller's array, reports the count.
///
/// # Safety
/// As the exported functions.
unsafe fn swap(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    copies: *mut kvpage_block_copy,
    copies_len: usize,
    out_n: *mut usize,
    way: Way,
) -> Result<(), Fail> {
    // SAFETY: pointers and lengths checked by `args`; `kvpage_block_copy` and
    // `BlockCopy` are both `repr(C)` pairs of `u32` (asserted above).
    unsafe {
        let m = manager_mut(manager)?;
        let moves = slice_mut(copies.cast::<BlockCopy>(), copies_len, "copies")?;
        let n = out_opt(out_n, "out_n")?;
        let s = m.seq(seq);
        let pool = host(&mut m.host)?;
        let blocks = match way {
            Way::Out => m.manager.swap_out(s, pool, moves)?,
            Way::In => m.manager.swap_in(s, pool, moves)?,
        };
        if let Some(n) = n {
            n.set(blocks as usize);
        }
        Ok(())
    }
}

/// Moves `seq` to the host tier: each of its blocks gets a host block, and the copies
/// (`src` = device block, `dst` = host block), one per block in logical order, are
/// written to `copies[0..*out_n]` for the caller to execute before the device blocks are
/// reused (by the next allocating call). The id stays valid; until
/// `kvpage_manager_swap_in` every other operation on it is `KVPAGE_ERR_SEQ_SWAPPED`.
/// Committed blocks stay cached on the device. `*out_n` (NULL to ignore) receives the
/// number of copies (`ceil(len / block_size)`). O(blocks of `seq`).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_NO_HOST_POOL`, `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`,
/// `KVPAGE_ERR_HOST_FULL` (`needed`, `available` host blocks),
/// `KVPAGE_ERR_BUFFER_TOO_SMALL` (`needed` copies, `available` = `copies_len`).
///
/// # Safety
/// `manager` is null or a manager; `copies` writable for `copies_len` records (null
/// when 0); `out_n` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_swap_out(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    copies: *mut kvpage_block_copy,
    copies_len: usize,
    out_n: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: forwarded contract.
    unsafe {
        run(err, || {
            swap(manager, seq, copies, copies_len, out_n, Way::Out)
        })
    }
}

/// Brings swapped-out `seq` back: a device block per host block, the copies (`src` =
/// host block, `dst` = device block) written to `copies[0..*out_n]` in logical order for
/// the caller to execute before the sequence's K/V is read; the host blocks are free
/// again. The blocks come back unshared and outside the prefix cache. O(blocks).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_NO_HOST_POOL`, `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_NOT_SWAPPED`,
/// `KVPAGE_ERR_OUT_OF_BLOCKS` (`needed`, `available`), `KVPAGE_ERR_BUFFER_TOO_SMALL`
/// (`needed` copies, `available` = `copies_len`).
///
/// # Safety
/// As `kvpage_manager_swap_out`.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_swap_in(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    copies: *mut kvpage_block_copy,
    copies_len: usize,
    out_n: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: forwarded contract.
    unsafe {
        run(err, || {
            swap(manager, seq, copies, copies_len, out_n, Way::In)
        })
    }
}

/// Releases swapped-out `seq`, returning its host blocks; the id becomes stale.
/// O(blocks of `seq`).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_NO_HOST_POOL`, `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_NOT_SWAPPED` (use
/// `kvpage_manager_release`).
///
/// # Safety
/// `manager` is null or a manager.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_release_swapped(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the pointer is checked by `manager_mut`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let s = m.seq(seq);
            m.manager.release_swapped(s, host(&mut m.host)?)?;
            Ok(())
        })
    }
}

/// Whether `seq` is swapped out (1) or on the device (0), to `*out_swapped`. Works
/// without a host tier (always 0 there). O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`,
/// `KVPAGE_ERR_STALE_SEQ`.
///
/// # Safety
/// `manager` is null or a manager; `out_swapped` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_is_swapped(
    manager: *const kvpage_manager,
    seq: kvpage_seq,
    out_swapped: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_ref` / `out`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let dst = out(out_swapped, "out_swapped")?;
            dst.set(u32::from(m.manager.is_swapped(m.seq(seq))?));
            Ok(())
        })
    }
}

/// Free and total blocks of the host tier, to `*out_free` and `*out_total` (each NULL
/// to ignore). O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER` (manager), `KVPAGE_ERR_MISALIGNED`,
/// `KVPAGE_ERR_INVALID_ARGUMENT`, `KVPAGE_ERR_NO_HOST_POOL`.
///
/// # Safety
/// `manager` is null or a manager; each out-parameter is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_host_blocks(
    manager: *const kvpage_manager,
    out_free: *mut u32,
    out_total: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_ref` / `out_opt`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let free = out_opt(out_free, "out_free")?;
            let total = out_opt(out_total, "out_total")?;
            let pool = m.host.as_ref().ok_or(NO_HOST)?;
            if let Some(free) = free {
                free.set(pool.free_blocks());
            }
            if let Some(total) = total {
                total.set(pool.total_blocks());
            }
            Ok(())
        })
    }
}
