//! Tier 2: the block manager inside caller memory, for an engine that owns its K/V and
//! kernels (its own CUDA, FlashInfer). The caller asks the storage size and alignment
//! for a configuration, hands in one buffer, and nothing is allocated after that: the
//! `kvpage_manager` object itself lives at the start of that buffer, followed by the
//! core's tables and the host tier's free set. Freeing the buffer (after the last call)
//! is all the clean-up there is.

use core::ffi::c_void;
use core::mem::{align_of, size_of};

use kvpage_core::{BlockManager, Config, HostPool, SeqId};

use super::args::{obj, out, out_opt, tagged, tagged_mut, Tagged};
use super::geometry::kvpage_geometry;
use super::ids::{kvpage_seq, seq_from_c};
use super::result::{kvpage_error, kvpage_result, run, Fail};
use super::stats::kvpage_stats;

/// What a tier-2 manager is sized for (see the Rust `kvpage_core::Config`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct kvpage_manager_config {
    /// Physical blocks in the device pool.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Sequences live at once (rows of the block table).
    pub max_seqs: u32,
    /// Blocks one sequence may hold (columns of the dense block table).
    pub max_blocks_per_seq: u32,
    /// Tag of this manager in every sequence id it issues; give each manager its own.
    pub instance: u32,
    /// Non-zero: keep a prefix cache (prompt sharing). Zero saves its metadata.
    pub prefix_cache: u32,
    /// Key of the prefix cache's block hashes (a multi-tenant service picks a secret
    /// random one; the same key gives the same hashes on every run).
    pub hash_key: u64,
    /// Blocks of the host tier for swapped-out sequences; 0 for none.
    pub host_blocks: u32,
    /// Namespaces that can have a quota (`kvpage_manager_set_namespace_quota`), at most
    /// 256; 0 for none (eviction compares one list per namespace slot).
    pub max_namespaces: u32,
}

impl kvpage_manager_config {
    /// The core configuration (for a Rust program that builds the same manager with
    /// `kvpage_core::BlockManager`; the host tier is not part of it).
    pub fn to_core(self) -> Config {
        Config {
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            max_seqs: self.max_seqs,
            max_blocks_per_seq: self.max_blocks_per_seq,
            instance: self.instance,
            hash_key: self.hash_key,
            prefix_cache: self.prefix_cache != 0,
            max_position_runs: kvpage_core::DEFAULT_POSITION_RUNS,
            max_namespaces: self.max_namespaces,
            event_capacity: 0,
        }
    }
}

/// Marks a live manager, so a pointer to anything else is refused.
const MAGIC: u64 = u64::from_le_bytes(*b"kvpgMGR2");

/// The tier-2 manager: opaque to C, placed at the start of the caller's storage.
///
/// `repr(C)` with the magic word first, so a pointer to any 8 readable bytes is
/// checked safely; declared opaque in the header (cbindgen.toml), its fields are not
/// C types.
/// cbindgen:ignore
#[repr(C)]
pub struct kvpage_manager {
    magic: u64,
    /// The block manager over the storage after this struct.
    pub(crate) manager: BlockManager<'static>,
    /// The host tier's free set, when `host_blocks > 0`.
    pub(crate) host: Option<HostPool<'static>>,
}

impl kvpage_manager {
    /// The core handle the C id `id` names in this manager (checked by every core
    /// operation: an id of another manager reads as stale here).
    pub(crate) fn seq(&self, id: kvpage_seq) -> SeqId {
        seq_from_c(id, self.manager.config().instance)
    }
}

/// Bytes of the struct at the start of the storage, rounded to whole `u64` words.
const HEADER_BYTES: usize = size_of::<kvpage_manager>().next_multiple_of(8);

/// `(manager words, host words)` of `config`, each in `u64`s, checked.
fn words_of(config: &kvpage_manager_config) -> Result<(usize, usize), Fail> {
    let core = config.to_core();
    core.validate()?;
    let manager_words = core.storage_words();
    let host_words = if config.host_blocks == 0 {
        0
    } else {
        HostPool::storage_words(config.host_blocks).div_ceil(2)
    };
    Ok((manager_words, host_words))
}

/// Total bytes of storage for `config`.
fn storage_bytes(config: &kvpage_manager_config) -> Result<usize, Fail> {
    let (m, h) = words_of(config)?;
    m.checked_add(h)
        .and_then(|w| w.checked_mul(8))
        .and_then(|b| b.checked_add(HEADER_BYTES))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or(Fail::from(kvpage_core::InitError::TooLarge))
}

/// The configuration of a model's manager: `geometry`'s block size, `num_blocks`
/// blocks, `max_seqs` sequences of up to `max_seq_len` tokens, prefix cache on,
/// instance 0, hash key 0, no host tier. Change fields after. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_INVALID_ARGUMENT` (unknown dtype),
/// `KVPAGE_ERR_BAD_CONFIG` (zero dimension).
///
/// # Safety
/// `geometry` is null or readable; `out` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_config_for_geometry(
    geometry: *const kvpage_geometry,
    num_blocks: u32,
    max_seqs: u32,
    max_seq_len: u32,
    out_config: *mut kvpage_manager_config,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `obj` / `out`; the caller's contract covers the rest.
    unsafe {
        run(err, || {
            let g = obj(geometry, "geometry")?.to_core()?;
            let dst = out(out_config, "out_config")?;
            let c = Config::for_geometry(&g, num_blocks, max_seqs, max_seq_len);
            dst.set(kvpage_manager_config {
                num_blocks: c.num_blocks,
                block_size: c.block_size,
                max_seqs: c.max_seqs,
                max_blocks_per_seq: c.max_blocks_per_seq,
                instance: c.instance,
                prefix_cache: u32::from(c.prefix_cache),
                hash_key: c.hash_key,
                host_blocks: 0,
                max_namespaces: 0,
            });
            Ok(())
        })
    }
}

/// Alignment in bytes the storage of a manager needs. O(1); thread-safe.
#[no_mangle]
pub extern "C" fn kvpage_manager_storage_align() -> usize {
    align_of::<kvpage_manager>().max(8)
}

/// Bytes of storage a manager for `config` needs (to pass to `kvpage_manager_init`).
/// O(1); thread-safe.
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`; `KVPAGE_ERR_BAD_CONFIG` for a zero or unaddressable size.
///
/// # Safety
/// `config` is null or readable; `out_bytes` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_storage_size(
    config: *const kvpage_manager_config,
    out_bytes: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `obj` / `out`.
    unsafe {
        run(err, || {
            let config = obj(config, "config")?;
            let dst = out(out_bytes, "out_bytes")?;
            dst.set(storage_bytes(config)?);
            Ok(())
        })
    }
}

/// Builds a manager inside `storage` (`storage_bytes` long, aligned to
/// `kvpage_manager_storage_align()`; its contents are ignored) and writes its address
/// (= `storage`) to `*out_manager`. Every block starts free. The caller keeps the
/// storage alive and untouched while the manager is used, and frees it afterwards;
/// no other clean-up exists and nothing is allocated, now or later.
/// O(storage bytes / 8).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_BAD_CONFIG`,
/// `KVPAGE_ERR_STORAGE_TOO_SMALL` (`needed` / `available` bytes).
///
/// # Safety
/// `storage` is null or writable for `storage_bytes` bytes, used by nothing else while
/// the manager lives; `config` is null or readable; `out_manager` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_init(
    config: *const kvpage_manager_config,
    storage: *mut c_void,
    storage_bytes: usize,
    out_manager: *mut *mut kvpage_manager,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked before use; the storage contract is the caller's.
    unsafe {
        run(err, || {
            let config = *obj(config, "config")?;
            let dst = out(out_manager, "out_manager")?;
            let base = storage.cast::<u64>();
            if base.is_null() {
                return Err(Fail::null("storage"));
            }
            if !(base as usize).is_multiple_of(kvpage_manager_storage_align()) {
                return Err(Fail::new(kvpage_result::KVPAGE_ERR_MISALIGNED, "storage"));
            }
            let needed = self::storage_bytes(&config)?;
            if storage_bytes < needed {
                return Err(Fail::new(
                    kvpage_result::KVPAGE_ERR_STORAGE_TOO_SMALL,
                    "storage too small for the manager",
                )
                .with_sizes(needed as u64, storage_bytes as u64));
            }
            let (manager_words, host_words) = words_of(&config)?;
            // SAFETY: `needed` bytes from `base` are writable and exclusive (contract);
            // the words start after the header, 8-aligned since `base` is.
            let words: &'static mut [u64] = core::slice::from_raw_parts_mut(
                base.add(HEADER_BYTES / 8),
                manager_words + host_words,
            );
            let (manager_storage, host_storage) = words.split_at_mut(manager_words);
            let core = config.to_core();
            let manager = BlockManager::new(core, manager_storage)?;
            let host = match config.host_blocks {
                0 => None,
                blocks => Some(HostPool::new(
                    blocks,
                    core.instance,
                    bytemuck::cast_slice_mut(host_storage),
                )?),
            };
            let m = base.cast::<kvpage_manager>();
            // SAFETY: the header bytes are writable, aligned for the struct, and hold
            // no live value (their contents are ignored).
            m.write(kvpage_manager {
                magic: MAGIC,
                manager,
                host,
            });
            dst.set(m);
            Ok(())
        })
    }
}

// SAFETY: `repr(C)` with `magic: u64` first, holding MAGIC in every live object.
unsafe impl Tagged for kvpage_manager {
    const MAGIC: u64 = MAGIC;
    const WHAT: &'static str = "manager";
    const NOT_LIVE: &'static str = "not a kvpage_manager (uninitialised or corrupted)";
}

/// The manager behind a C pointer, checked for null, alignment and the magic word.
///
/// # Safety
/// A non-null, aligned `ptr` points to memory readable for the struct (a manager from
/// `kvpage_manager_init` whose storage is live, used by no other call now).
pub(crate) unsafe fn manager_mut<'a>(
    ptr: *mut kvpage_manager,
) -> Result<&'a mut kvpage_manager, Fail> {
    // SAFETY: forwarded contract.
    unsafe { tagged_mut(ptr) }
}

/// Read-only [`manager_mut`].
///
/// # Safety
/// As [`manager_mut`], not mutated during `'a`.
pub(crate) unsafe fn manager_ref<'a>(
    ptr: *const kvpage_manager,
) -> Result<&'a kvpage_manager, Fail> {
    // SAFETY: forwarded contract.
    unsafe { tagged(ptr) }
}

/// Blocks an allocation can take now: free plus cached (evictable) ones, to
/// `*out_blocks`. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a manager).
///
/// # Safety
/// `manager` is null or a manager from `kvpage_manager_init`; `out_blocks` is null or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_available_blocks(
    manager: *const kvpage_manager,
    out_blocks: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_ref` / `out`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let dst = out(out_blocks, "out_blocks")?;
            dst.set(m.manager.available_blocks());
            Ok(())
        })
    }
}

/// Evicts up to `max_blocks` blocks of the prefix cache that no sequence references,
/// least recently cached first, making them free; writes how many were evicted to
/// `*out_evicted` (NULL to ignore). Allocation evicts on its own when no block is free;
/// this is for a caller that wants free blocks now. O(evicted).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER` (manager), `KVPAGE_ERR_MISALIGNED`,
/// `KVPAGE_ERR_INVALID_ARGUMENT` (not a manager).
///
/// # Safety
/// `manager` is null or a manager from `kvpage_manager_init`; `out_evicted` is null or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_evict_cached(
    manager: *mut kvpage_manager,
    max_blocks: u32,
    out_evicted: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_mut` / `out_opt`.
    unsafe {
        run(err, || {
            let m = manager_mut(manager)?;
            let dst = out_opt(out_evicted, "out_evicted")?;
            let evicted = m.manager.evict_cached(max_blocks);
            if let Some(dst) = dst {
                dst.set(evicted);
            }
            Ok(())
        })
    }
}

/// Counters of the pool and the sequences, to `*out_stats`. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a manager).
///
/// # Safety
/// `manager` is null or a manager from `kvpage_manager_init`; `out_stats` is null or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_stats(
    manager: *const kvpage_manager,
    out_stats: *mut kvpage_stats,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_ref` / `out`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let dst = out(out_stats, "out_stats")?;
            dst.set(m.manager.stats().into());
            Ok(())
        })
    }
}
