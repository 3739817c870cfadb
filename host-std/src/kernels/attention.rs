//! Paged attention (decode and chunked prefill) and the driver shared with the
//! contiguous baseline: validation of the call, task decomposition, threads.

use super::online::{self, KvSource, RowTask, Scratch, MAX_ROWS};
use super::parallel::DisjointOut;
use super::pool::{for_each_task_ahead, Executor};
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

/// Sequences of at most this many query rows (queries × group: a decode step) are run
/// several KV heads to a task, up to `MAX_ROWS` rows: the task reads each block's K
/// (then V) tiles of its heads as one contiguous range instead of one short tile per
/// head. Each head's rows go in passes of four. Eight, not four: decode of 5 to 8 query
/// heads per KV head then takes two heads a task (paired, 2048 x 32 out of cache,
/// against one: 64 query heads over 8, f16 0.965, bf16 0.989, int8 0.984, fp8 0.980;
/// 40 over 8, f16 0.984, int8 0.991; 56 over 8, f16 0.974, int8 0.980).
const HEAD_SPAN_ROWS: usize = 8;

/// With more than one thread, KV heads per task are halved until a call has at least
/// this many tasks per thread, or a whole number of tasks per thread, or one head per
/// task: tasks are drawn dynamically, and a few per thread even out sequences of
/// different lengths; a whole number per thread (sequences alike) ends together. One
/// sequence of 65536 tokens, 8 KV heads, 2 threads: 2 tasks of 4 heads took 0.90x the
/// time of 8 tasks of one head (f16, out of cache, paired).
const TASKS_PER_THREAD: usize = 4;

/// Attention of new query tokens over a paged KV cache, for one layer.
///
/// `q` and `out` are `[Σ queries][q_heads][head_dim]`, sequences in the order of `seqs`.
/// Each output row is `softmax(scale · q·Kᵀ) V` over the tokens the query may see
/// (causal), computed in `f32` with a running-max softmax. Tasks (sequence × KV head ×
/// tile of up to 16 query rows, or for a decode step sequence × several KV heads) run
/// on the calling thread and `params.pool`; all query heads of a GQA group share each
/// K/V tile, so each stored byte is read once per task.
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

    run(&shape, seqs, q, out, |seq, kv_head, _heads| PagedSource {
        arena,
        layout,
        blocks: &table.table[seq.row as usize * stride..][..stride],
        layer,
        kv_head: kv_head as u32,
    });
    Ok(())
}

/// The K/V of one (sequence, layer) from KV head `kv_head` on, read through the
/// sequence's block-table row: chunks never cross a block boundary. A block stores a
/// layer's K tiles of consecutive heads next to each other (then the V tiles).
struct PagedSource<'a, T> {
    arena: &'a [T],
    layout: &'a KvLayout,
    blocks: &'a [u32],
    layer: u32,
    kv_head: u32,
}

impl<T> PagedSource<'_, T> {
    /// Token `t`'s block-table entry and slot in its block. O(1): a shift and a mask
    /// for the usual power-of-two block sizes, where a division would cost 10-20 cycles
    /// and this runs several times per block and head.
    #[inline(always)]
    fn block_slot(&self, t: usize) -> (usize, usize) {
        let bs = self.layout.geometry().block_size() as usize;
        if bs.is_power_of_two() {
            (t >> bs.trailing_zeros(), t & (bs - 1))
        } else {
            (t / bs, t % bs)
        }
    }
}

impl<T: Element> KvSource<T> for PagedSource<'_, T> {
    #[inline(always)]
    fn run(&self, t0: usize) -> usize {
        let bs = self.layout.geometry().block_size() as usize;
        bs - self.block_slot(t0).1
    }
    #[inline(always)]
    fn tile(&self, head: usize, kv: usize, t0: usize, n: usize) -> &[T] {
        let hd = self.layout.geometry().head_dim() as usize;
        let (b, slot) = self.block_slot(t0);
        let block = self.blocks[b];
        let kv_head = self.kv_head + head as u32;
        let start = self
            .layout
            .tile_offset_in_range(block, self.layer, kv as u32, kv_head)
            + slot * hd;
        &self.arena[start..start + n * hd]
    }
    #[inline(always)]
    fn scales(&self, head: usize, kv: usize, t0: usize, n: usize, out: &mut [f32]) {
        let bytes = self.scale_bytes(head, kv, t0, n);
        for (o, b) in out[..n].iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
    #[inline(always)]
    fn scale_bytes(&self, head: usize, kv: usize, t0: usize, n: usize) -> &[u8] {
        let (b, slot) = self.block_slot(t0);
        let block = self.blocks[b];
        let kv_head = self.kv_head + head as u32;
        let start = self
            .layout
            .tile_offset_in_range(block, self.layer, kv as u32, kv_head)
            + self.layout.scales_offset()
            + slot * 4;
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
    /// Most KV heads a task of a decode step takes (see [`heads_per_task`]).
    head_cap: usize,
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
        let group = (params.q_heads / kv_heads) as usize;
        // Sequences by query rows, up to `HEAD_SPAN_ROWS` (they may share tasks among
        // heads), and the tasks of the others: what the head cap is chosen from.
        let mut by_rows = [0usize; HEAD_SPAN_ROWS + 1];
        let mut other_tasks: usize = 0;
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
            let rows = (s.queries as usize).saturating_mul(group);
            match by_rows.get_mut(rows) {
                Some(n) => *n += 1,
                None => {
                    other_tasks = other_tasks
                        .saturating_add(tiles(s, group).saturating_mul(kv_heads as usize))
                }
            }
        }
        let expected = (params.q_heads as usize)
            .checked_mul(head_dim as usize)
            .and_then(|row| row.checked_mul(total_q))
            .ok_or(KernelError::BadLayout)?;
        check_len(Buffer::Query, expected, q.len())?;
        check_len(Buffer::Output, expected, out.len())?;
        let work = work.saturating_mul(u64::from(params.q_heads));
        let pool = params.pool.filter(|_| work >= PARALLEL_MIN_WORK);
        let kv_heads = kv_heads as usize;
        let tasks_at = |cap: usize| {
            (1..=HEAD_SPAN_ROWS).fold(other_tasks, |acc, rows| {
                let per_seq = kv_heads / heads_per_task(rows, kv_heads, cap);
                acc.saturating_add(by_rows[rows].saturating_mul(per_seq))
            })
        };
        let mut head_cap = MAX_ROWS;
        if let Some(pool) = pool {
            let threads = pool.threads().max(1);
            let wanted = threads.saturating_mul(TASKS_PER_THREAD);
            let enough = |tasks: usize| {
                tasks >= wanted || (tasks >= threads && tasks.is_multiple_of(threads))
            };
            while head_cap > 1 && !enough(tasks_at(head_cap)) {
                head_cap /= 2;
            }
        }
        Ok(Self {
            kv_heads,
            q_heads: params.q_heads as usize,
            group,
            head_dim: head_dim as usize,
            scale: params.scale,
            head_cap,
            pool,
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
/// it only moves forward (O(seqs + tasks) per worker in all).
#[derive(Clone, Copy, Default)]
struct Position {
    seq: usize,
    task_base: usize,
    q_base: usize,
}

impl Position {
    /// Moves forward to the sequence holding `task` (not before the last task located)
    /// and returns the task and its sequence. O(sequences passed).
    fn locate<'s, 'q>(
        &mut self,
        task: usize,
        shape: &Shape<'_>,
        seqs: &'s [SeqQuery],
        q: &'q [f32],
    ) -> (RowTask<'q>, &'s SeqQuery) {
        // Advance to the sequence holding `task`; its KV heads per task.
        let heads = loop {
            let s = &seqs[self.seq];
            let (heads, n) = split(s, shape);
            if task < self.task_base + n {
                break heads;
            }
            self.task_base += n;
            self.q_base += s.queries as usize;
            self.seq += 1;
        };
        let seq = &seqs[self.seq];
        let local = task - self.task_base;
        let head_groups = shape.kv_heads / heads;
        let (kv_head, tile) = ((local % head_groups) * heads, local / head_groups);
        let all_rows = seq.queries as usize * shape.group;
        let row0 = tile * MAX_ROWS;
        let row_len = shape.q_heads * shape.head_dim;
        let task = RowTask {
            q: &q[self.q_base * row_len..(self.q_base + seq.queries as usize) * row_len],
            context_len: seq.context_len as usize,
            queries: seq.queries as usize,
            group: shape.group,
            q_heads: shape.q_heads,
            kv_head,
            heads,
            row0,
            head_rows: MAX_ROWS.min(all_rows - row0),
            head_dim: shape.head_dim,
            scale: shape.scale,
        };
        (task, seq)
    }
}

/// A worker's state: its scratch, where it is, and the task whose first K/V it has
/// prefetched (its next one).
struct Cursor {
    scratch: Scratch,
    at: Position,
    primed: Option<usize>,
}

/// Tiles of query rows of a sequence.
fn tiles(seq: &SeqQuery, group: usize) -> usize {
    (seq.queries as usize)
        .saturating_mul(group)
        .div_ceil(MAX_ROWS)
}

/// KV heads per task for a sequence of `rows` query rows (queries × group): 1 above
/// `HEAD_SPAN_ROWS` rows; otherwise the most that fit `MAX_ROWS` rows, at most `cap`,
/// dividing `kv_heads` (so every task of the sequence has as many). O(cap).
fn heads_per_task(rows: usize, kv_heads: usize, cap: usize) -> usize {
    if rows == 0 || rows > HEAD_SPAN_ROWS {
        return 1;
    }
    let most = (MAX_ROWS / rows).min(cap).min(kv_heads);
    (1..=most)
        .rev()
        .find(|&d| kv_heads.is_multiple_of(d))
        .unwrap_or(1)
}

/// How a sequence's tasks are cut: KV heads per task, and tasks.
fn split(seq: &SeqQuery, shape: &Shape<'_>) -> (usize, usize) {
    let rows = seq.queries as usize * shape.group;
    let heads = heads_per_task(rows, shape.kv_heads, shape.head_cap);
    (heads, tiles(seq, shape.group) * (shape.kv_heads / heads))
}

/// Runs every (sequence, KV heads, row tile) task of a validated call, reading K/V from
/// the source `source(seq, kv_head, heads)` builds for the task's KV heads
/// `kv_head..kv_head + heads`, and writes the output rows.
pub(super) fn run<'s, T, S, F>(
    shape: &Shape<'_>,
    seqs: &'s [SeqQuery],
    q: &[f32],
    out: &mut [f32],
    source: F,
) where
    T: Element,
    S: KvSource<T>,
    F: Fn(&'s SeqQuery, usize, usize) -> S + Sync,
{
    let total: usize = seqs.iter().map(|s| split(s, shape).1).sum();
    let row_len = shape.q_heads * shape.head_dim;
    let out = DisjointOut::new(out);
    let init = || Cursor {
        scratch: Scratch::new(),
        at: Position::default(),
        primed: None,
    };
    // Each task prefetches, while it computes its last chunk, the K tiles of the first
    // chunk of its thread's next task, which would otherwise start on K not yet
    // fetched.
    for_each_task_ahead(shape.pool, total, init, |c, task, next| {
        let (t, seq) = c.at.locate(task, shape, seqs, q);
        let src = source(seq, t.kv_head, t.heads);
        let ahead = next.map(|next| {
            let mut at = c.at;
            let (t, seq) = at.locate(next, shape, seqs, q);
            (t, source(seq, t.kv_head, t.heads))
        });
        let ahead = ahead
            .as_ref()
            .map(|(task, src)| online::Ahead { task, src });
        let primed = c.primed == Some(task);
        c.primed = next;
        online::attend(&t, &src, ahead, primed, &mut c.scratch);
        let hd = shape.head_dim;
        for j in 0..t.rows() {
            let (qi, qh) = t.row(j);
            let offset = (c.at.q_base + qi) * row_len + qh * hd;
            // SAFETY: (query token, query head) pairs are partitioned among tasks: each
            // row of each sequence belongs to exactly one (kv heads, tile) task.
            unsafe { out.write(offset, &c.scratch.acc[j * hd..(j + 1) * hd]) };
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_per_task_fills_the_rows_and_divides_the_heads() {
        // (rows, kv heads, cap) -> heads per task
        let cases = [
            ((4, 8, MAX_ROWS), 4),
            ((3, 8, MAX_ROWS), 4), // 5 would fit, 4 divides 8
            ((1, 8, MAX_ROWS), 8),
            ((1, 32, MAX_ROWS), 16),
            ((2, 6, MAX_ROWS), 6),
            ((3, 7, MAX_ROWS), 1), // 7 is prime and over 5
            ((4, 8, 2), 2),
            ((4, 8, 1), 1),
            ((5, 8, MAX_ROWS), 2), // 3 would fit, 2 divides 8
            ((8, 8, MAX_ROWS), 2),
            ((9, 8, MAX_ROWS), 1), // more than `HEAD_SPAN_ROWS`: one head
            ((0, 8, MAX_ROWS), 1),
        ];
        for ((rows, kv_heads, cap), want) in cases {
            assert_eq!(
                heads_per_task(rows, kv_heads, cap),
                want,
                "{rows} {kv_heads} {cap}"
            );
        }
    }

    /// An executor that only states its threads (its tasks all run on the caller).
    struct Threads(usize);
    impl Executor for Threads {
        fn execute(&self, _: usize, _: &(dyn Fn() + Sync)) {}
        fn threads(&self) -> usize {
            self.0
        }
    }

    #[test]
    fn the_head_cap_keeps_tasks_for_every_thread() {
        let decode = |seqs: usize| {
            let one = SeqQuery {
                row: 0,
                context_len: 4096,
                queries: 1,
            };
            vec![one; seqs]
        };
        let cap = |seqs: &[SeqQuery], pool: Option<&dyn Executor>| {
            let rows: usize = seqs.iter().map(|s| s.queries as usize).sum::<usize>() * 32 * 128;
            let (q, out) = (vec![0.0; rows], vec![0.0; rows]);
            let params = AttentionParams {
                q_heads: 32,
                scale: 1.0,
                pool,
            };
            Shape::check(8, 128, seqs, &q, &out, &params)
                .unwrap()
                .head_cap
        };
        let (two, three, many) = (Threads(2), Threads(3), Threads(64));
        let unknown = Threads(usize::MAX);
        // One thread: as many heads as fit.
        assert_eq!(cap(&decode(1), None), MAX_ROWS);
        // 32 sequences × 2 tasks of 4 heads = 64 tasks: enough for 2 threads.
        assert_eq!(cap(&decode(32), Some(&two)), MAX_ROWS);
        // One sequence, 2 threads: 2 tasks of 4 heads, one a thread.
        assert_eq!(cap(&decode(1), Some(&two)), MAX_ROWS);
        // One sequence, 3 threads: 2 tasks are too few, 4 of 2 heads do not divide
        // evenly, so 8 of one head.
        assert_eq!(cap(&decode(1), Some(&three)), 1);
        // 3 sequences, 3 threads: 6 tasks of 4 heads, two a thread.
        assert_eq!(cap(&decode(3), Some(&three)), MAX_ROWS);
        // 32 sequences, 64 threads: 64 tasks of 4 heads, one a thread.
        assert_eq!(cap(&decode(32), Some(&many)), MAX_ROWS);
        // 31 sequences, 64 threads: 62 tasks are too few; 124 of 2 heads do not divide;
        // 248 of one head are enough.
        assert_eq!(cap(&decode(31), Some(&many)), 1);
        assert_eq!(cap(&decode(32), Some(&unknown)), 1);
        // A prefill's tasks count too: 16 rows × 8 heads = 128 tasks of one head.
        let mut mixed = decode(1);
        mixed.push(SeqQuery {
            row: 0,
            context_len: 4096,
            queries: 64,
        });
        assert_eq!(cap(&mixed, Some(&many)), 1);
        assert_eq!(cap(&mixed, Some(&Threads(16))), MAX_ROWS);
    }
}
