//! Tier 1: saving a sequence of the owned cache into a blob (a caller buffer or a file)
//! and restoring one into any free blocks of a cache of the same geometry, dtype and
//! model (`crate::persist`). A restore checks the whole blob and the cache's room before
//! it changes anything: a blob of another geometry, dtype or model, a truncated or
//! corrupted one, is an error code and the cache is as it was.

use core::ffi::{c_char, CStr};
use std::path::PathBuf;

use crate::persist::{BlobHeader, ModelFingerprint, PersistError};

use super::args::{obj, out, out_opt, slice, slice_mut, tagged, tagged_mut};
use super::cache::kvpage_cache;
use super::ids::{kvpage_seq, seq_to_c};
use super::result::{kvpage_error, kvpage_result, run, Fail};

/// The sequence blob format version this library writes and reads.
pub const KVPAGE_SEQ_BLOB_VERSION: u16 = 1;
const _: () = assert!(KVPAGE_SEQ_BLOB_VERSION == crate::persist::format::FORMAT_VERSION);

/// The caller's name for a model: 32 bytes (e.g. a SHA-256 of its weights), or a
/// 64-bit id made by `kvpage_fingerprint_from_u64`. A blob saved under one fingerprint
/// is refused under another (`KVPAGE_ERR_BLOB_MODEL`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct kvpage_fingerprint {
    /// The bytes, compared as they are.
    pub bytes: [u8; 32],
}

/// The fingerprint of a 64-bit model id: its 8 little-endian bytes, then 24 zero bytes.
/// O(1); cannot fail; thread-safe.
#[no_mangle]
pub extern "C" fn kvpage_fingerprint_from_u64(id: u64) -> kvpage_fingerprint {
    kvpage_fingerprint {
        bytes: ModelFingerprint::from_u64(id).0,
    }
}

/// The token ids of a save: NULL for none (then `n_tokens` must be 0), else one per
/// token of the sequence.
///
/// # Safety
/// `tokens` is null or readable for `n_tokens` ids.
unsafe fn save_tokens<'a>(tokens: *const u32, n_tokens: usize) -> Result<Option<&'a [u32]>, Fail> {
    if tokens.is_null() {
        if n_tokens != 0 {
            return Err(Fail::null("tokens"));
        }
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    unsafe { slice(tokens, n_tokens, "tokens").map(Some) }
}

/// A NUL-terminated path.
///
/// # Safety
/// `path` is null or a readable NUL-terminated string.
pub(super) unsafe fn path_from_c(path: *const c_char) -> Result<PathBuf, Fail> {
    if path.is_null() {
        return Err(Fail::null("path"));
    }
    // SAFETY: non-null; NUL-terminated and readable by the caller's contract.
    let bytes = unsafe { CStr::from_ptr(path) }.to_bytes();
    if bytes.is_empty() {
        return Err(Fail::invalid("path is empty"));
    }
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        Ok(PathBuf::from(std::ffi::OsStr::from_bytes(bytes)))
    }
    #[cfg(not(unix))]
    {
        core::str::from_utf8(bytes)
            .map(PathBuf::from)
            .map_err(|_| Fail::invalid("path is not UTF-8"))
    }
}

/// Writes the bytes of the blob of `seq` to `*out_size`: with its token ids
/// (`with_tokens` non-zero) or without. The buffer `kvpage_cache_seq_save` needs:
/// about `ceil(len / block_size) * bytes_per_block` plus 4 bytes per id and 164. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_FOREIGN_SEQ`.
///
/// # Safety
/// `cache` is null or a live cache; `out_size` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_seq_save_size(
    cache: *const kvpage_cache,
    seq: kvpage_seq,
    with_tokens: u32,
    out_size: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` / `out`.
    unsafe {
        run(err, || {
            let c = tagged(cache)?;
            let dst = out(out_size, "out_size")?;
            dst.set(c.cache.saved_seq_size(c.seq(seq), with_tokens != 0)?);
            Ok(())
        })
    }
}

/// Saves `seq` into `out[..n]` and writes `n` to `*out_written` when non-null: a header
/// with the cache's geometry and `*model`, the `n_tokens` ids of `tokens` (NULL: none;
/// else one per token, e.g. the prompt and the sampled tokens: the cache does not keep
/// them), the positions, and the sequence's blocks. Reads the cache only.
/// O(len + blocks × bytes_per_block).
///
/// # Errors
/// Nothing is written on error. `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`,
/// `KVPAGE_ERR_INVALID_ARGUMENT` (not a cache; `n_tokens` not the sequence's length:
/// `needed` = length, `available` = `n_tokens`), `KVPAGE_ERR_STALE_SEQ`,
/// `KVPAGE_ERR_FOREIGN_SEQ`, `KVPAGE_ERR_BUFFER_TOO_SMALL` (`needed`, `available`
/// bytes).
///
/// # Safety
/// `cache` is null or a live cache; `tokens` is null or readable for `n_tokens` ids;
/// `model` is null or readable; `out` is null or writable for `out_len` bytes;
/// `out_written` is null or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_cache_seq_save(
    cache: *const kvpage_cache,
    seq: kvpage_seq,
    tokens: *const u32,
    n_tokens: usize,
    model: *const kvpage_fingerprint,
    out: *mut u8,
    out_len: usize,
    out_written: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` / `save_tokens` / `obj` / `slice_mut` /
    // `out_opt`.
    unsafe {
        run(err, || {
            let c = tagged(cache)?;
            let tokens = save_tokens(tokens, n_tokens)?;
            let model = ModelFingerprint(obj(model, "model")?.bytes);
            let buf = slice_mut(out, out_len, "out")?;
            let written = out_opt(out_written, "out_written")?;
            let n = c.cache.save_seq(c.seq(seq), tokens, &model, buf)?;
            if let Some(w) = written {
                w.set(n);
            }
            Ok(())
        })
    }
}

/// `kvpage_cache_seq_save` into the file at `path` (NUL-terminated), crash-consistently:
/// written to a temporary file beside it, flushed to disk, renamed over `path`, the
/// directory flushed; `path` holds its old content or the whole blob, never a mix.
/// Streams (the blob is never held in memory). O(blob bytes) plus the file system's.
///
/// # Errors
/// As `kvpage_cache_seq_save` (checked before the file is created), and
/// `KVPAGE_ERR_INVALID_ARGUMENT` (empty path), `KVPAGE_ERR_IO` (`value` = the OS error
/// number); the temporary file is removed on error.
///
/// # Safety
/// `cache` is null or a live cache; `tokens` is null or readable for `n_tokens` ids;
/// `model` is null or readable; `path` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_seq_save_file(
    cache: *const kvpage_cache,
    seq: kvpage_seq,
    tokens: *const u32,
    n_tokens: usize,
    model: *const kvpage_fingerprint,
    path: *const c_char,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` / `save_tokens` / `obj` / `path_from_c`.
    unsafe {
        run(err, || {
            let c = tagged(cache)?;
            let tokens = save_tokens(tokens, n_tokens)?;
            let model = ModelFingerprint(obj(model, "model")?.bytes);
            let path = path_from_c(path)?;
            c.cache.save_seq_to_file(c.seq(seq), tokens, &model, path)?;
            Ok(())
        })
    }
}

/// Where a restore writes what it restored.
struct RestoreOut<'a> {
    seq: super::args::Out<kvpage_seq>,
    len: Option<super::args::Out<u32>>,
    tokens: &'a mut [u32],
    want_tokens: bool,
    n_tokens: Option<super::args::Out<usize>>,
}

impl RestoreOut<'_> {
    /// The checked out-parameters of a restore.
    ///
    /// # Safety
    /// `seq`, `len` and `n_tokens` are null or writable; `tokens.0` is null or writable
    /// for `tokens.1` ids.
    unsafe fn new(
        seq: *mut kvpage_seq,
        len: *mut u32,
        tokens: (*mut u32, usize),
        n_tokens: *mut usize,
    ) -> Result<Self, Fail> {
        // SAFETY: forwarded contract.
        unsafe {
            Ok(Self {
                seq: out(seq, "out_seq")?,
                len: out_opt(len, "out_len")?,
                want_tokens: !tokens.0.is_null(),
                tokens: slice_mut(tokens.0, tokens.1, "out_tokens")?,
                n_tokens: out_opt(n_tokens, "out_n_tokens")?,
            })
        }
    }
}

/// Restores `blob` into `c` and fills `o`: the token buffer is checked against the
/// blob's header before the cache changes.
fn restore_into(
    c: &mut kvpage_cache,
    blob: &[u8],
    namespace: u64,
    model: &ModelFingerprint,
    o: RestoreOut<'_>,
) -> Result<(), Fail> {
    if o.want_tokens {
        let header = BlobHeader::decode(blob).map_err(crate::CacheError::from)?;
        let ids = header.token_ids as usize;
        if o.tokens.len() < ids {
            return Err(Fail::short("out_tokens", ids, o.tokens.len()));
        }
    }
    let (seq, info) = c.cache.restore_seq(blob, namespace, model)?;
    let copied = info
        .tokens
        .filter(|_| o.want_tokens)
        .and_then(|t| t.copy_to(o.tokens))
        .unwrap_or(0);
    o.seq.set(seq_to_c(seq.id()));
    if let Some(len) = o.len {
        len.set(info.len);
    }
    if let Some(n) = o.n_tokens {
        n.set(copied);
    }
    Ok(())
}

/// Restores the `blob_len` bytes of `blob` into any free blocks of `cache` as a new
/// sequence of `namespace`, and writes its id to `*out_seq`, its length to `*out_len`
/// when non-null, and, when `out_tokens` is non-null, its token ids to
/// `out_tokens[..n]` and `n` to `*out_n_tokens` when non-null (`n` = 0 when the blob has
/// no ids). Everything is checked first: the blob (magic, version, geometry, dtype,
/// `*model`, lengths, every checksum, the position runs), the length against
/// `max_seq_len`, free blocks and a sequence slot, and the size of `out_tokens`. With
/// ids, the sequence knows
/// them (`kvpage_cache_commit` offers its full blocks to the prefix cache); its K/V
/// counts as written. O(blob bytes). Allocates nothing.
///
/// # Errors
/// Nothing changes on error. `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`,
/// `KVPAGE_ERR_INVALID_ARGUMENT` (not a cache), `KVPAGE_ERR_BLOB_FORMAT`,
/// `KVPAGE_ERR_BLOB_VERSION`, `KVPAGE_ERR_BLOB_GEOMETRY`, `KVPAGE_ERR_DTYPE_MISMATCH`,
/// `KVPAGE_ERR_BLOB_MODEL`, `KVPAGE_ERR_BLOB_TRUNCATED`, `KVPAGE_ERR_BLOB_CORRUPT`,
/// `KVPAGE_ERR_SEQ_TOO_LONG`, `KVPAGE_ERR_OUT_OF_BLOCKS`, `KVPAGE_ERR_NO_FREE_SEQ`,
/// `KVPAGE_ERR_BAD_POSITIONS` and `KVPAGE_ERR_TOO_MANY_POSITION_RUNS` (the blob's
/// position runs break the rules of the edits, or exceed the runs a sequence holds),
/// `KVPAGE_ERR_BUFFER_TOO_SMALL` (`out_tokens`: `needed` ids, `available` given).
///
/// # Safety
/// `cache` is null or a live cache; `blob` is null or readable for `blob_len` bytes;
/// `model` is null or readable; `out_tokens` is null or writable for `out_tokens_len`
/// ids; `out_seq`, `out_len` and `out_n_tokens` are null or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_cache_seq_restore(
    cache: *mut kvpage_cache,
    blob: *const u8,
    blob_len: usize,
    namespace: u64,
    model: *const kvpage_fingerprint,
    out_seq: *mut kvpage_seq,
    out_len: *mut u32,
    out_tokens: *mut u32,
    out_tokens_len: usize,
    out_n_tokens: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `slice` / `obj` / `RestoreOut::new`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let blob = slice(blob, blob_len, "blob")?;
            let model = ModelFingerprint(obj(model, "model")?.bytes);
            let o = RestoreOut::new(out_seq, out_len, (out_tokens, out_tokens_len), out_n_tokens)?;
            restore_into(c, blob, namespace, &model, o)
        })
    }
}

/// `kvpage_cache_seq_restore` from the file at `path` (NUL-terminated; read whole into
/// memory, then restored). O(file bytes).
///
/// # Errors
/// As `kvpage_cache_seq_restore`, and `KVPAGE_ERR_INVALID_ARGUMENT` (empty path),
/// `KVPAGE_ERR_IO` (`value` = the OS error number), `KVPAGE_ERR_OUT_OF_MEMORY`.
///
/// # Safety
/// `cache` is null or a live cache; `path` is null or a NUL-terminated string; `model`
/// is null or readable; `out_tokens` is null or writable for `out_tokens_len` ids;
/// `out_seq`, `out_len` and `out_n_tokens` are null or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvpage_cache_seq_restore_file(
    cache: *mut kvpage_cache,
    path: *const c_char,
    namespace: u64,
    model: *const kvpage_fingerprint,
    out_seq: *mut kvpage_seq,
    out_len: *mut u32,
    out_tokens: *mut u32,
    out_tokens_len: usize,
    out_n_tokens: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `path_from_c` / `obj` /
    // `RestoreOut::new`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let path = path_from_c(path)?;
            let model = ModelFingerprint(obj(model, "model")?.bytes);
            let o = RestoreOut::new(out_seq, out_len, (out_tokens, out_tokens_len), out_n_tokens)?;
            let bytes = read_file(&path)?;
            restore_into(c, &bytes, namespace, &model, o)
        })
    }
}

/// The whole file at `path`, its buffer reserved fallibly.
pub(super) fn read_file(path: &std::path::Path) -> Result<Vec<u8>, Fail> {
    use std::io::Read;
    let io = |e: std::io::Error| Fail::from(crate::CacheError::from(PersistError::from(e)));
    let mut file = std::fs::File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    let mut bytes = Vec::new();
    usize::try_from(size)
        .ok()
        .and_then(|n| bytes.try_reserve_exact(n).ok())
        .ok_or(
            Fail::new(
                kvpage_result::KVPAGE_ERR_OUT_OF_MEMORY,
                "file too large to read",
            )
            .with_sizes(size, 0),
        )?;
    file.read_to_end(&mut bytes).map_err(io)?;
    Ok(bytes)
}
