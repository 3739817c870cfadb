//! Tier 2, block tables: the physical blocks of a batch of sequences, in the layouts
//! attention kernels take, written into caller buffers, or the manager's own dense
//! table read in place.
//!
//! - Dense (vLLM's `block_tables`): `[n][stride]` block ids, row `k` for `seqs[k]`,
//!   unused columns set to a pad value; optionally the lengths (`seq_lens`).
//! - CSR (FlashInfer's paged KV: `kv_indptr`, `kv_indices`, `kv_last_page_len`):
//!   `indptr[0..=n]` offsets into `indices`, which lists each sequence's blocks in
//!   order, and `last_page_len[k]` the tokens in its last block.
//!
//! The arrays are `uint32_t`; FlashInfer's and vLLM's `int32` tensors take the same
//! bits as long as every value is below 2^31 (block ids are below `num_blocks`, offsets
//! below the total), so the caller can copy them to a device tensor as they are.
//!
//! Every id of the batch is validated before anything is written: a bad one fails the
//! call with its code and the id in `kvpage_error::value`, and no buffer changes. A
//! sequence may appear more than once. Swapped-out sequences are refused
//! (`KVPAGE_ERR_SEQ_SWAPPED`): their blocks are on the host.

use super::args::{out, out_opt, slice, slice_mut};
use super::ids::{kvpage_seq, seq_from_c};
use super::manager::{kvpage_manager, manager_ref};
use super::result::{kvpage_error, kvpage_result, run, Fail};

/// The rows of sequences [`check_batch`] validated, read straight from the manager's
/// dense table: a live sequence of `len` tokens holds the first `ceil(len /
/// block_size)` entries of its row (an invariant of the core manager). The write passes
/// use it, so validation costs the only per-id checks.
struct Rows<'a> {
    table: &'a [u32],
    lens: &'a [u32],
    stride: usize,
    block_size: u32,
    instance: u32,
}

impl<'a> Rows<'a> {
    fn new(m: &'a kvpage_manager) -> Self {
        let config = m.manager.config();
        Self {
            table: m.manager.block_table(),
            lens: m.manager.seq_lens(),
            stride: config.max_blocks_per_seq as usize,
            block_size: config.block_size,
            instance: config.instance,
        }
    }

    /// Blocks and length of validated sequence `id`.
    #[inline]
    fn get(&self, id: kvpage_seq) -> (&'a [u32], u32) {
        let i = seq_from_c(id, self.instance).index() as usize;
        let len = self.lens[i];
        let n = len.div_ceil(self.block_size) as usize;
        (&self.table[i * self.stride..][..n], len)
    }
}

/// Validates every id of a batch: `(total blocks, most blocks of one sequence)`.
fn check_batch(m: &kvpage_manager, seqs: &[kvpage_seq]) -> Result<(usize, usize), Fail> {
    let (mut total, mut longest) = (0usize, 0usize);
    for &id in seqs {
        match m.manager.blocks(m.seq(id)) {
            Ok(b) => {
                total += b.len();
                longest = longest.max(b.len());
            }
            Err(e) => return Err(Fail::from(e).with_value(id)),
        }
    }
    Ok((total, longest))
}

/// Writes the dense block table of the batch `seqs[0..n_seqs]` into
/// `out_table[0..n_seqs * stride]`, row-major: row `k` holds the blocks of `seqs[k]` in
/// logical order, then `pad` up to `stride` columns (vLLM's `block_tables`, which pads
/// with 0: pass any id, the kernels read only `ceil(len / block_size)` columns). When
/// `out_seq_lens` is non-null, `out_seq_lens[k]` receives the length of `seqs[k]` in
/// tokens. vLLM's and FlashInfer's `int32` tensors take these `uint32_t` values bit for
/// bit (every block id is below 2^31 for any pool they can address). O(n_seqs * stride).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a manager; `stride` 0; `n_seqs * stride` overflows), `KVPAGE_ERR_STALE_SEQ` /
/// `KVPAGE_ERR_SEQ_SWAPPED` (`value` = the id), `KVPAGE_ERR_BUFFER_TOO_SMALL`: `stride`
/// below the longest sequence's block count (`needed` = that count, `available` =
/// stride), or `out_table_len` / `out_seq_lens_len` short (`needed`, `available`
/// elements).
///
/// # Safety
/// `manager` is null or a manager; `seqs` readable for `n_seqs` ids, `out_table`
/// writable for `out_table_len` values, `out_seq_lens` null or writable for
/// `out_seq_lens_len` values.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_block_table_dense(
    manager: *const kvpage_manager,
    seqs: *const kvpage_seq,
    n_seqs: usize,
    stride: u32,
    pad: u32,
    out_table: *mut u32,
    out_table_len: usize,
    out_seq_lens: *mut u32,
    out_seq_lens_len: usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers and lengths checked by `args`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let seqs = slice(seqs, n_seqs, "seqs")?;
            let table = slice_mut(out_table, out_table_len, "out_table")?;
            let lens = match out_seq_lens.is_null() {
                true => None,
                false => Some(slice_mut(out_seq_lens, out_seq_lens_len, "out_seq_lens")?),
            };
            if stride == 0 {
                return Err(Fail::invalid("stride is 0"));
            }
            let stride = stride as usize;
            let (_, longest) = check_batch(m, seqs)?;
            if longest > stride {
                return Err(Fail::short("stride (blocks per row)", longest, stride));
            }
            let cells = seqs
                .len()
                .checked_mul(stride)
                .ok_or(Fail::invalid("n_seqs * stride overflows").with_value(stride as u64))?;
            let table =
                table
                    .get_mut(..cells)
                    .ok_or(Fail::short("out_table", cells, out_table_len))?;
            let mut lens = match lens {
                Some(l) => Some(l.get_mut(..seqs.len()).ok_or(Fail::short(
                    "out_seq_lens",
                    seqs.len(),
                    out_seq_lens_len,
                ))?),
                None => None,
            };
            let rows = Rows::new(m);
            for (k, (&id, dst)) in seqs.iter().zip(table.chunks_exact_mut(stride)).enumerate() {
                let (blocks, len) = rows.get(id);
                let (used, rest) = dst.split_at_mut(blocks.len());
                used.copy_from_slice(blocks);
                rest.fill(pad);
                if let Some(lens) = lens.as_deref_mut() {
                    lens[k] = len;
                }
            }
            Ok(())
        })
    }
}

/// Writes the block table of the batch `seqs[0..n_seqs]` as FlashInfer's CSR triple:
/// `out_indptr[0..=n_seqs]` (`indptr[0] = 0`, `indptr[k + 1] - indptr[k]` = blocks of
/// `seqs[k]`), `out_indices[0..indptr[n_seqs]]` (the blocks of each sequence in order)
/// and `out_last_page_len[0..n_seqs]` (tokens in the sequence's last block, in
/// `1..=block_size`; 0 for an empty sequence, which has no blocks, a case FlashInfer's
/// kernels do not take: leave such sequences out of its batches). FlashInfer's `int32`
/// tensors take these `uint32_t` values bit for bit while they are below 2^31 (block
/// ids always are for a pool it can address; offsets are below the total). The ids are
/// validated first, then the arrays written in one pass. O(total blocks).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a manager; more than 2^32-1 blocks in all), `KVPAGE_ERR_STALE_SEQ` /
/// `KVPAGE_ERR_SEQ_SWAPPED` (`value` = the id), `KVPAGE_ERR_BUFFER_TOO_SMALL`
/// (`needed` / `available` elements: `n_seqs + 1` for `out_indptr`, the total block
/// count for `out_indices`, `n_seqs` for `out_last_page_len`).
///
/// # Safety
/// `manager` is null or a manager; `seqs` readable for `n_seqs` ids; each out array
/// writable for its length (null when 0).
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_block_table_csr(
    manager: *const kvpage_manager,
    seqs: *const kvpage_seq,
    n_seqs: usize,
    out_indptr: *mut u32,
    out_indptr_len: usize,
    out_indices: *mut u32,
    out_indices_len: usize,
    out_last_page_len: *mut u32,
    out_last_page_len_len: usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers and lengths checked by `args`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let seqs = slice(seqs, n_seqs, "seqs")?;
            let indptr = slice_mut(out_indptr, out_indptr_len, "out_indptr")?;
            let indices = slice_mut(out_indices, out_indices_len, "out_indices")?;
            let last = slice_mut(
                out_last_page_len,
                out_last_page_len_len,
                "out_last_page_len",
            )?;
            let (total, _) = check_batch(m, seqs)?;
            if u32::try_from(total).is_err() {
                return Err(
                    Fail::invalid("more than 2^32-1 blocks in the batch").with_value(total as u64)
                );
            }
            let n = seqs.len();
            let indptr =
                indptr
                    .get_mut(..=n)
                    .ok_or(Fail::short("out_indptr", n + 1, out_indptr_len))?;
            let indices = indices.get_mut(..total).ok_or(Fail::short(
                "out_indices",
                total,
                out_indices_len,
            ))?;
            let last = last.get_mut(..n).ok_or(Fail::short(
                "out_last_page_len",
                n,
                out_last_page_len_len,
            ))?;
            let rows = Rows::new(m);
            let mut at = 0usize;
            indptr[0] = 0;
            for (k, &id) in seqs.iter().enumerate() {
                let (blocks, len) = rows.get(id);
                indices[at..at + blocks.len()].copy_from_slice(blocks);
                at += blocks.len();
                // `total` fits in u32, so every offset does.
                indptr[k + 1] = at as u32;
                // The tokens past the full blocks (a multiply, not a division).
                last[k] = match blocks.len() as u32 {
                    0 => 0,
                    n => len - (n - 1) * rows.block_size,
                };
            }
            Ok(())
        })
    }
}

/// The manager's own dense block table, read in place (zero copy, e.g. for one upload
/// per step): `*out_table` receives a pointer to `rows * stride` block ids, row-major,
/// row `r` for the sequence whose row is `r` (`kvpage_manager_seq_row`); columns past a
/// sequence's `ceil(len / block_size)` blocks, and rows of free or swapped-out
/// sequences, hold stale values. `*out_seq_lens` (NULL to ignore) receives a pointer to
/// `rows` lengths in tokens (0 for free rows and swapped-out sequences). `rows` =
/// `max_seqs`, `stride` = `max_blocks_per_seq` (each NULL to ignore). O(1).
///
/// Ownership: both arrays live in the manager's storage, at addresses that never
/// change; they are valid until the storage is freed and read-only to the caller. Their
/// contents change with every call that changes a sequence: read them between calls,
/// never during one.
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER` (manager, `out_table`), `KVPAGE_ERR_MISALIGNED`,
/// `KVPAGE_ERR_INVALID_ARGUMENT` (not a manager).
///
/// # Safety
/// `manager` is null or a manager; each out-parameter is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_block_table(
    manager: *const kvpage_manager,
    out_table: *mut *const u32,
    out_seq_lens: *mut *const u32,
    out_rows: *mut u32,
    out_stride: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_ref` / `out` / `out_opt`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let table = out(out_table, "out_table")?;
            let lens = out_opt(out_seq_lens, "out_seq_lens")?;
            let rows = out_opt(out_rows, "out_rows")?;
            let stride = out_opt(out_stride, "out_stride")?;
            let config = m.manager.config();
            table.set(m.manager.block_table().as_ptr());
            if let Some(lens) = lens {
                lens.set(m.manager.seq_lens().as_ptr());
            }
            if let Some(rows) = rows {
                rows.set(config.max_seqs);
            }
            if let Some(stride) = stride {
                stride.set(config.max_blocks_per_seq);
            }
            Ok(())
        })
    }
}

/// The row of `seq` in the table of `kvpage_manager_block_table`, to `*out_row`. A
/// row is reused by a later sequence once `seq` is released. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a manager), `KVPAGE_ERR_STALE_SEQ`, `KVPAGE_ERR_SEQ_SWAPPED`.
///
/// # Safety
/// `manager` is null or a manager; `out_row` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_manager_seq_row(
    manager: *const kvpage_manager,
    seq: kvpage_seq,
    out_row: *mut u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `manager_ref` / `out`.
    unsafe {
        run(err, || {
            let m = manager_ref(manager)?;
            let dst = out(out_row, "out_row")?;
            let s = m.seq(seq);
            m.manager.len(s)?;
            dst.set(s.index());
            Ok(())
        })
    }
}
