//! Paged attention (decode and chunked prefill) and the driver shared with the
//! contiguous baseline: validation of the call, task decomposition, threads.

use super::online::{self, KvSource, RowTask, Scratch, MAX_ROWS};
use super::parallel::DisjointOut;
use super::pool::{for_each_task, Executor};
use super::{AttentionParams, BlockTable, SeqQuery, MAX_HEAD_DIM};
use crate::arena::KvLayout;
use crate::dtype::{bytes_of, Element};
use crate::error::{Buffer, KernelError};

/// Below this many (query row × context token) products a call runs on the calling
/// thread only: waking a worker would cost more than it saves. 4096 products are about
/// 50 µs of work on one core; a parked worker wakes in about 20 µs (development VM), and
/// with 2 threads a decode of 1 × 64 tokens (2048 products) already took 0.76× the time
/// of one thread. (With a thread spawned per call the threshold had to be 8× higher.)
const PARALLEL_MIN_WORK: u64 = 1 << 12;

/// Attention of new query tokens over a paged KV cache, for one layer.
///
/// `q` and `out` are `[Σ queries][q_heads][head_dim]`, sequences in the order of `seqs`.
/// Each output row is `softmax(scale · q·Kᵀ) V` over the tokens the query may see
/// (causal), computed in `f32` with a running-max softmax. Tasks (sequence × KV head ×
/// tile of up to 16 query rows) run on the calling thread and `params.pool`; all query
/// heads of a GQA group share each K/V tile, so each stored byte is read once per task.
///
/// Complexity: O(Σ queries × q_heads × context_len × head_dim) arithmetic; reads each
/// sequence's K/V of this layer `ceil(queries × group / 16)` times.
///
/// # Errors
/// Nothing is written on error.
/// - [`KernelError::DTypeMismatch`] — `T` is not the storage dtype of the layout's
///   geometry;
/// - [`KernelError::BufferLength`] — `arena` is not `layout.arena_elems()` long, or
///   `q` / `out` not `Σ queries × q_heads × head_dim`;
/// - [`KernelError::LayerOutOfRange`], [`KernelError::HeadsNotDivisible`],
///   [`KernelError::BadScale`];
/// - [`KernelError::BadLayout`] — `Σ queries × q_heads × head_dim` overflows `usize`;
/// - [`KernelError::RowOutOfRange`], [`KernelError::ContextTooLong`],
///   [`KernelError::QueriesExceedContext`] — a bad [`SeqQuery`];
/// - [`KernelError::BlockOutOfRange`] — a block id the context needs is not in the arena.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<T: Element>(
    layout: &KvLayout,
    arena: &[T],
    layer: u32,
    table: BlockTable<'_>,
    seqs: &[SeqQuery],
    q: &[f32],
    out: &mut [f32],
    params: AttentionParams<'_>,
) -> Result<(), KernelError> {
    layout.check_element::<T>()?;
    check_len(Buffer::Arena, layout.arena_elems(), arena.len())?;
    let g = layout.geometry();
    if layer >= g.layers() {
        return Err(KernelError::LayerOutOfRange {
            layer,
            layers: g.layers(),
        });
    }
    let stride = table.stride as usize;
    let rows = table.table.len().checked_div(stride).unwrap_or(0);
    let bs = g.block_size() as usize;
    for s in seqs {
        if s.row as usize >= rows {
            return Err(KernelError::RowOutOfRange {
                row: s.row,
                rows: u32::try_from(rows).unwrap_or(u32::MAX),
            });
        }
        let capacity = stride as u64 * bs as u64;
        if u64::from(s.context_len) > capacity {
            return Err(KernelError::ContextTooLong {
                context_len: s.context_len,
                capacity,
            });
        }
        let row = &table.table[s.row as usize * stride..][..stride];
        let used = (s.context_len as usize).div_ceil(bs);
        if let Some(&block) = row[..used].iter().find(|&&b| b >= layout.num_blocks()) {
            return Err(KernelError::BlockOutOfRange {
                block,
                blocks: layout.num_blocks(),
            });
        }
    }
    let shape = Shape::check(g.kv_heads(), g.head_dim(), seqs, q, out, &params)?;

    run(&shape, seqs, q, out, |seq, kv_head| PagedSource {
        arena,
        layout,
        blocks: &table.table[seq.row as usize * stride..][..stride],
        layer,
        kv_head: kv_head as u32,
    });
    Ok(())
}

/// The K/V of one (sequence, layer, KV head), read through the sequence's block-table
/// row: chunks never cross a block boundary.
struct PagedSource<'a, T> {
    arena: &'a [T],
    layout: &'a KvLayout,
    blocks: &'a [u32],
    layer: u32,
    kv_head: u32,
}

impl<T: Element> KvSource<T> for PagedSource<'_, T> {
    #[inline(always)]
    fn run(&self, t0: usize) -> usize {
        let bs = self.layout.geometry().block_size() as usize;
        bs - t0 % bs
    }
    #[inline(always)]
    fn tile(&self, kv: usize, t0: usize, n: usize) -> &[T] {
        let g = self.layout.geometry();
        let (bs, hd) = (g.block_size() as usize, g.head_dim() as usize);
        let block = self.blocks[t0 / bs];
        let start = self
            .layout
            .tile_offset_in_range(block, self.layer, kv as u32, self.kv_head)
            + (t0 % bs) * hd;
        &self.arena[start..start + n * hd]
    }
    #[inline(always)]
    fn scales(&self, kv: usize, t0: usize, n: usize, out: &mut [f32]) {
        let bytes = self.scale_bytes(kv, t0, n);
        for (o, b) in out[..n].iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
    #[inline(always)]
    fn scale_bytes(&self, kv: usize, t0: usize, n: usize) -> &[u8] {
        let bs = self.layout.geometry().block_size() as usize;
        let block = self.blocks[t0 / bs];
        let start = self
            .layout
            .tile_offset_in_range(block, self.layer, kv as u32, self.kv_head)
            + self.layout.scales_offset()
            + (t0 % bs) * 4;
        // Scaled elements are one byte each: element offsets are byte offsets.
        &bytes_of(self.arena)[start..start + 4 * n]
    }
}

/// Checked shape of an attention call.
pub(super) struct Shape<'p> {
    kv_heads: usize,
    q_heads: usize,
    group: usize,
    head_dim: usize,
    scale: f32,
    /// Where the tasks run: `None` for the calling thread only.
    pool: Option<&'p dyn Executor>,
}

impl<'p> Shape<'p> {
    /// Validates heads, scale and the lengths of `q` and `out` against `seqs`; checks
    /// `queries <= context_len` for every sequence. O(seqs).
    pub(super) fn check(
        kv_heads: u32,
        head_dim: u32,
        seqs: &[SeqQuery],
        q: &[f32],
        out: &[f32],
        params: &AttentionParams<'p>,
    ) -> Result<Self, KernelError> {
        if params.q_heads == 0 || !params.q_heads.is_multiple_of(kv_heads) {
            return Err(KernelError::HeadsNotDivisible {
                q_heads: params.q_heads,
                kv_heads,
            });
        }
        if head_dim as usize > MAX_HEAD_DIM {
            return Err(KernelError::HeadDimTooLarge { head_dim });
        }
        if !params.scale.is_finite() {
            return Err(KernelError::BadScale);
        }
        // Counts are caller data: sums and products are checked (the buffer size) or
        // saturated (the work estimate, which only picks the thread count).
        let mut total_q: usize = 0;
        let mut work: u64 = 0;
        for s in seqs {
            if s.queries > s.context_len {
                return Err(KernelError::QueriesExceedContext {
                    queries: s.queries,
                    context_len: s.context_len,
                });
            }
            total_q = total_q
                .checked_add(s.queries as usize)
                .ok_or(KernelError::BadLayout)?;
            work = work.saturating_add(u64::from(s.queries) * u64::from(s.context_len));
        }
        let expected = (params.q_heads as usize)
            .checked_mul(head_dim as usize)
            .and_then(|row| row.checked_mul(total_q))
            .ok_or(KernelError::BadLayout)?;
        check_len(Buffer::Query, expected, q.len())?;
        check_len(Buffer::Output, expected, out.len())?;
        let work = work.saturating_mul(u64::from(params.q_heads));
        Ok(Self {
            kv_heads: kv_heads as usize,
            q_heads: params.q_heads as usize,
            group: (params.q_heads / kv_heads) as usize,
            head_dim: head_dim as usize,
            scale: params.scale,
            pool: params.pool.filter(|_| work >= PARALLEL_MIN_WORK),
        })
    }
}

/// `Err(BufferLength)` unless `actual == expected`.
pub(super) fn check_len(buffer: Buffer, expected: usize, actual: usize) -> Result<(), KernelError> {
    if expected == actual {
        Ok(())
    } else {
        Err(KernelError::BufferLength {
            buffer,
            expected,
            actual,
        })
    }
}

/// Where a worker is in the list of sequences: tasks are drawn in increasing order, so
/// the cursor only moves forward (O(seqs + tasks) per worker in all).
struct Cursor {
    scratch: Scratch,
    seq: usize,
    task_base: usize,
    q_base: usize,
}

/// Tiles of query rows of a sequence.
fn tiles(seq: &SeqQuery, group: usize) -> usize {
    (seq.queries as usize * group).div_ceil(MAX_ROWS)
}

/// Runs every (sequence, KV head, row tile) task of a validated call, reading K/V from
/// the source `source(seq, kv_head)` builds, and writes the output rows.
pub(super) fn run<'s, T, S, F>(
    shape: &Shape<'_>,
    seqs: &'s [SeqQuery],
    q: &[f32],
    out: &mut [f32],
    source: F,
) where
    T: Element,
    S: KvSource<T>,
    F: Fn(&'s SeqQuery, usize) -> S + Sync,
{
    let total: usize = seqs
        .iter()
        .map(|s| tiles(s, shape.group) * shape.kv_heads)
        .sum();
    let row_len = shape.q_heads * shape.head_dim;
    let out = DisjointOut::new(out);
    let init = || Cursor {
        scratch: Scratch::new(),
        seq: 0,
        task_base: 0,
        q_base: 0,
    };
    for_each_task(shape.pool, total, init, |c, task| {
        // Advance to the sequence holding `task`.
        loop {
            let s = &seqs[c.seq];
            let n = tiles(s, shape.group) * shape.kv_heads;
            if task < c.task_base + n {
                break;
            }
            c.task_base += n;
            c.q_base += s.queries as usize;
            c.seq += 1;
        }
        let seq = &seqs[c.seq];
        let local = task - c.task_base;
        let (kv_head, tile) = (local % shape.kv_heads, local / shape.kv_heads);
        let all_rows = seq.queries as usize * shape.group;
        let row0 = tile * MAX_ROWS;
        let t = RowTask {
            q: &q[c.q_base * row_len..(c.q_base + seq.queries as usize) * row_len],
            context_len: seq.context_len as usize,
            queries: seq.queries as usize,
            group: shape.group,
            q_heads: shape.q_heads,
            kv_head,
            row0,
            rows: MAX_ROWS.min(all_rows - row0),
            head_dim: shape.head_dim,
            scale: shape.scale,
        };
        online::attend(&t, &source(seq, kv_head), &mut c.scratch);
        let hd = shape.head_dim;
        for j in 0..t.rows {
            let (qi, qh) = t.row(j);
            let offset = (c.q_base + qi) * row_len + qh * hd;
            // SAFETY: (query token, query head) pairs are partitioned among tasks: each
            // row of each sequence belongs to exactly one (kv head, tile) task.
            unsafe { out.write(offset, &c.scratch.acc[j * hd..(j + 1) * hd]) };
        }
    });
}
