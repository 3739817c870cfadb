//! Tier 2, retention: priorities of sequences (and token ranges of them) in the prefix
//! cache, and per-namespace quotas. Eviction takes lower priorities first, least
//! recently used within one, and never `KVPAGE_PRIORITY_PINNED` blocks; a namespace
//! with a quota holds at most its limit and keeps its reservation (see the Rust
//! `kvpage_core::BlockManager::set_priority` and `set_namespace_quota`). Nothing
//! allocates; a failed call changes nothing.

use kvpage_core::{NamespaceQuota, Priority};

use super::args::{out, out_opt};
use super::ids::kvpage_seq;
use super::manager::{kvpage_manager, manager_mut, manager_ref};
use super::result::{kvpage_error, kvpage_result, run, Fail};

/// Evicted first.
pub const KVPAGE_PRIORITY_LOW: u32 = 0;
/// The default.
pub const KVPAGE_PRIORITY_NORMAL: u32 = 1;
/// Evicted only when no lower-priority block is cached.
pub const KVPAGE_PRIORITY_HIGH: u32 = 2;
/// Never evicted while registered (a hot system prompt).
pub const KVPAGE_PRIORITY_PINNED: u32 = 3;

/// The priority of a C level, or `KVPAGE_ERR_INVALID_ARGUMENT`.
pub(crate) fn priority_from_c(level: u32) -> Result<Priority, Fail> {
    u8::try_from(level)
        .ok()
        .and_then(Priority::from_level)
        .ok_or(Fail::invalid("priority").with_value(u64::from(level)))
}

/// Sets the retention priority of `seq` (a `KVPAGE_PRIORITY_*` level) and of every
/// block it holds now, exactly (lowering included); the blocks it commits later are
/// raised to at least it. O(blocks of `seq`).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a manager; a level above `KVPAGE_PRIORITY_PINNED`: `value` = level),
/// `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`.
///
/// # Safety
/// `manager` is null or a manager from `kvpage_manager_init`.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_set_priority(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    priority: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the pointer is checked by `manager_mut`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let p = priority_from_c(priority)?;
            let s = m.seq(seq);
            Ok(m.manager.set_priority(s, p)?)
        })
    }
}

/// Sets the priority of the blocks of `seq` holding tokens `first..end` (every block
/// with a token in the range) to `priority`, raises its blocks before the range to at
/// least it and lowers those after it to at most it (so a chain's tail never outlives
/// its head). An empty range changes nothing. O(blocks of `seq`).
///
/// # Errors
/// As `kvpage_manager_set_priority`, and `KVPAGE_ERR_BEYOND_LENGTH` (range reversed or
/// past the length: `needed` = `end`, `available` = length, `value` = `first`).
///
/// # Safety
/// `manager` is null or a manager from `kvpage_manager_init`.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_set_range_priority(
    manager: *mut kvpage_manager,
    seq: kvpage_seq,
    first: u32,
    end: u32,
    priority: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the pointer is checked by `manager_mut`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let p = priority_from_c(priority)?;
            let s = m.seq(seq);
            Ok(m.manager.set_range_priority(s, first, end, p)?)
        })
    }
}

/// Lowers every cached pinned block that no sequence holds to `KVPAGE_PRIORITY_NORMAL`
/// (so eviction may take it) and writes how many to `*out_unpinned` (NULL to ignore).
/// O(unpinned blocks).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER` (manager), `KVPAGE_ERR_MISALIGNED`,
/// `KVPAGE_ERR_INVALID_ARGUMENT` (not a manager).
///
/// # Safety
/// `manager` is null or a manager from `kvpage_manager_init`; `out_unpinned` null or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_unpin_cached(
    manager: *mut kvpage_manager,
    out_unpinned: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_mut` / `out_opt`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let dst = out_opt(out_unpinned, "out_unpinned")?;
            let n = m.manager.unpin_cached();
            if let Some(dst) = dst {
                dst.set(n);
            }
            Ok(())
        })
    }
}

/// Sets the quota of namespace `ns`: at most `max_blocks` blocks held or cached by its
/// sequences (an allocation at the limit evicts the namespace's own cached blocks
/// first, else fails with `KVPAGE_ERR_QUOTA_EXCEEDED`), and `reserved_blocks` kept for
/// it from other namespaces. The namespace takes one of the manager's
/// `max_namespaces` slots for good (`max_blocks` = `UINT32_MAX` and no reservation
/// lifts a quota). Lowering a limit evicts the namespace's own cached blocks down to
/// it. O(max_namespaces + evicted blocks).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a manager), `KVPAGE_ERR_QUOTA_REFUSED` (reservation above the limit, table
/// full, used blocks above the new limit: `needed` = held, `available` = limit; free
/// blocks short of the reservations: `needed`, `available` = free).
///
/// # Safety
/// `manager` is null or a manager from `kvpage_manager_init`.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_set_namespace_quota(
    manager: *mut kvpage_manager,
    ns: u64,
    max_blocks: u32,
    reserved_blocks: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the pointer is checked by `manager_mut`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let quota = NamespaceQuota {
                max_blocks,
                reserved_blocks,
            };
            Ok(m.manager.set_namespace_quota(ns, quota)?)
        })
    }
}

/// Blocks used or cached that are charged to namespace `ns` (0 without a quota), to
/// `*out_blocks`. O(max_namespaces).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a manager).
///
/// # Safety
/// `manager` is null or a manager from `kvpage_manager_init`; `out_blocks` null or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_namespace_blocks(
    manager: *const kvpage_manager,
    ns: u64,
    out_blocks: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_ref` / `out`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let dst = out(out_blocks, "out_blocks")?;
            dst.set(m.manager.namespace_blocks(ns));
            Ok(())
        })
    }
}
