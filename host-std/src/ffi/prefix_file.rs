//! Tier 1: the persistent prefix cache — saving every reachable block of the owned
//! cache's prefix cache into a buffer or a file at shutdown, and loading it at start-up
//! so earlier system prompts hit on the first request (`crate::persist`). A load refuses
//! a file with a wrong header, geometry, dtype or model as a whole (nothing changes);
//! past the header it skips and counts damaged, cut-off and orphaned blocks, and never
//! evicts to make room.

use core::ffi::c_char;

use crate::persist::{ModelFingerprint, PrefixLoadReport};

use super::args::{obj, out, out_opt, slice, slice_mut, tagged, tagged_mut};
use super::cache::kvpage_cache;
use super::result::{kvpage_error, kvpage_result, run};
use super::seq_blob::{kvpage_fingerprint, path_from_c, read_file};

/// The prefix-cache file format version this library writes and reads.
pub const KVPAGE_PREFIX_FILE_VERSION: u16 = 1;
const _: () = assert!(KVPAGE_PREFIX_FILE_VERSION == crate::persist::PREFIX_FORMAT_VERSION);

/// What a prefix-cache load did with each block (record) of a file whose header was
/// sound: `loaded + already_cached + damaged + missing + orphaned + no_room ==
/// records`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct kvpage_prefix_load_report {
    /// Blocks the file announces.
    pub records: u32,
    /// Blocks registered and written.
    pub loaded: u32,
    /// Blocks the cache held already (nothing written).
    pub already_cached: u32,
    /// Blocks skipped for a wrong checksum or impossible fields.
    pub damaged: u32,
    /// Blocks cut off by the end of the file.
    pub missing: u32,
    /// Blocks skipped because a block above them in their chain was damaged or missing.
    pub orphaned: u32,
    /// Blocks not loaded for want of a free block their namespace may take.
    pub no_room: u32,
    /// Bytes after the last block (ignored).
    pub trailing_bytes: u64,
}

impl From<PrefixLoadReport> for kvpage_prefix_load_report {
    fn from(r: PrefixLoadReport) -> Self {
        Self {
            records: r.records,
            loaded: r.loaded,
            already_cached: r.already_cached,
            damaged: r.damaged,
            missing: r.missing,
            orphaned: r.orphaned,
            no_room: r.no_room,
            trailing_bytes: r.trailing_bytes,
        }
    }
}

/// Loads `bytes` into `c` and writes the report to `report` when given.
fn load_into(
    c: &mut kvpage_cache,
    bytes: &[u8],
    model: &ModelFingerprint,
    report: Option<super::args::Out<kvpage_prefix_load_report>>,
) -> Result<(), super::result::Fail> {
    let r = c.cache.load_prefix_cache(bytes, model)?;
    if let Some(o) = report {
        o.set(r.into());
    }
    Ok(())
}

/// Writes the bytes `kvpage_cache_prefix_save` needs now to `*out_size`: 96 plus, per
/// reachable prefix-cache block, 40 + 4 × block size + bytes per block.
/// O(blocks × chain depth).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache).
///
/// # Safety
/// `cache` is null or a live cache; `out_size` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_prefix_save_size(
    cache: *const kvpage_cache,
    out_size: *mut u64,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` / `out`.
    unsafe {
        run(err, || {
            let c = tagged(cache)?;
            out(out_size, "out_size")?.set(c.cache.saved_prefix_cache_size());
            Ok(())
        })
    }
}

/// Saves every reachable prefix-cache block (cached, pinned, or held by live
/// sequences), parents first, under `*model`, into `out[..n]`; writes `n` to
/// `*out_written` and the number of blocks to `*out_blocks` when non-null. Reads the
/// cache only. O(blocks × chain depth + bytes).
///
/// # Errors
/// Nothing is written on error. `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`,
/// `KVPAGE_ERR_INVALID_ARGUMENT` (not a cache), `KVPAGE_ERR_BUFFER_TOO_SMALL`
/// (`needed`, `available` bytes).
///
/// # Safety
/// `cache` is null or a live cache; `model` is null or readable; `out` is null or
/// writable for `out_len` bytes; `out_written` and `out_blocks` are null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_prefix_save(
    cache: *const kvpage_cache,
    model: *const kvpage_fingerprint,
    out: *mut u8,
    out_len: usize,
    out_written: *mut usize,
    out_blocks: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` / `obj` / `slice_mut` / `out_opt`.
    unsafe {
        run(err, || {
            let c = tagged(cache)?;
            let model = ModelFingerprint(obj(model, "model")?.bytes);
            let buf = slice_mut(out, out_len, "out")?;
            let written = out_opt(out_written, "out_written")?;
            let blocks = out_opt(out_blocks, "out_blocks")?;
            let saved = c.cache.save_prefix_cache(&model, buf)?;
            if let Some(w) = written {
                // The bytes fit the caller's buffer, so a `usize`.
                w.set(saved.bytes as usize);
            }
            if let Some(b) = blocks {
                b.set(saved.blocks);
            }
            Ok(())
        })
    }
}

/// `kvpage_cache_prefix_save` into the file at `path` (NUL-terminated),
/// crash-consistently: written aside, flushed to disk, renamed over `path`, the
/// directory flushed; `path` holds its old content or the whole new one. Streams.
/// Writes the number of blocks to `*out_blocks` when non-null.
/// O(blocks × chain depth + bytes) plus the file system's.
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache, empty path), `KVPAGE_ERR_IO` (`value` = the OS error number); the
/// temporary file is removed on error.
///
/// # Safety
/// `cache` is null or a live cache; `model` is null or readable; `path` is null or a
/// NUL-terminated string; `out_blocks` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_prefix_save_file(
    cache: *const kvpage_cache,
    model: *const kvpage_fingerprint,
    path: *const c_char,
    out_blocks: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` / `obj` / `path_from_c` / `out_opt`.
    unsafe {
        run(err, || {
            let c = tagged(cache)?;
            let model = ModelFingerprint(obj(model, "model")?.bytes);
            let path = path_from_c(path)?;
            let blocks = out_opt(out_blocks, "out_blocks")?;
            let saved = c.cache.save_prefix_cache_to_file(&model, path)?;
            if let Some(b) = blocks {
                b.set(saved.blocks);
            }
            Ok(())
        })
    }
}

/// Loads the `len` bytes at `bytes`, a saved prefix cache, into `cache`'s free blocks
/// and writes what happened to `*out_report` when non-null. Sound blocks whose chain
/// is intact become cached (least recently used: live traffic evicts them first), with
/// their priority; a later prompt hit still verifies every token id. O(bytes).
///
/// # Errors
/// Nothing changes on error. `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`,
/// `KVPAGE_ERR_INVALID_ARGUMENT` (not a cache), `KVPAGE_ERR_BLOB_FORMAT` (bad magic or
/// flags), `KVPAGE_ERR_BLOB_VERSION`, `KVPAGE_ERR_BLOB_TRUNCATED` (shorter than the
/// header), `KVPAGE_ERR_BLOB_CORRUPT` (the header), `KVPAGE_ERR_BLOB_GEOMETRY`,
/// `KVPAGE_ERR_DTYPE_MISMATCH`, `KVPAGE_ERR_BLOB_MODEL`. Damage past the header is no
/// error: it is counted in the report.
///
/// # Safety
/// `cache` is null or a live cache; `bytes` is null or readable for `len` bytes;
/// `model` is null or readable; `out_report` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_prefix_load(
    cache: *mut kvpage_cache,
    bytes: *const u8,
    len: usize,
    model: *const kvpage_fingerprint,
    out_report: *mut kvpage_prefix_load_report,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `slice` / `obj` / `out_opt`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let bytes = slice(bytes, len, "bytes")?;
            let model = ModelFingerprint(obj(model, "model")?.bytes);
            let report = out_opt(out_report, "out_report")?;
            load_into(c, bytes, &model, report)
        })
    }
}

/// `kvpage_cache_prefix_load` from the file at `path` (NUL-terminated; read whole into
/// memory, then loaded). O(file bytes).
///
/// # Errors
/// As `kvpage_cache_prefix_load`, and `KVPAGE_ERR_INVALID_ARGUMENT` (empty path),
/// `KVPAGE_ERR_IO` (`value` = the OS error number, e.g. `ENOENT` when there is no file
/// yet), `KVPAGE_ERR_OUT_OF_MEMORY`.
///
/// # Safety
/// `cache` is null or a live cache; `path` is null or a NUL-terminated string; `model`
/// is null or readable; `out_report` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_prefix_load_file(
    cache: *mut kvpage_cache,
    path: *const c_char,
    model: *const kvpage_fingerprint,
    out_report: *mut kvpage_prefix_load_report,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `path_from_c` / `obj` / `out_opt`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let path = path_from_c(path)?;
            let model = ModelFingerprint(obj(model, "model")?.bytes);
            let report = out_opt(out_report, "out_report")?;
            let bytes = read_file(&path)?;
            load_into(c, &bytes, &model, report)
        })
    }
}
