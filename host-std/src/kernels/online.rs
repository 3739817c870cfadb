//! The one inner routine of every attention kernel: a tile of query rows against the
//! K/V of one (sequence, KV head), in token chunks, with an online (running-max)
//! softmax. Decode, chunked prefill and the contiguous baseline differ only in where the
//! chunks come from ([`KvSource`]) and which rows they hand in.
//!
//! Per chunk of `n <= MAX_CHUNK` tokens: the K tile is widened once into an `f32`
//! scratch tile, every row of the task (all query heads of the GQA group, for one or
//! several query tokens) takes its scores from it, then the V tile is widened into the
//! same scratch and accumulated — so each stored K/V byte is read once per task.
//! Rows see tokens `t < limit(row)` (causal: a query at absolute position `p` sees
//! `0..=p`); the softmax keeps a running max `m`, sum `l` and output `acc` per row and
//! rescales them by `exp(m_old - m_new)`, so it never overflows, whatever the scores.
//!
//! The routine is compiled twice: portable, and for x86-64 with AVX2 + FMA + F16C,
//! chosen at run time per task ([`attend`]).

use super::math;
use crate::dtype::Element;

/// Query rows (query token × query head of one group) per task.
pub(crate) const MAX_ROWS: usize = 16;
/// Tokens per chunk.
pub(crate) const MAX_CHUNK: usize = 64;
/// Elements of the widened K or V scratch tile (`MAX_CHUNK * 128`).
pub(crate) const TILE_ELEMS: usize = MAX_CHUNK * 128;

/// Where the K/V tiles of one (sequence, KV head, layer) come from.
pub(crate) trait KvSource<T> {
    /// Tokens readable as one contiguous tile starting at token `t0` (at least 1).
    fn run(&self, t0: usize) -> usize;
    /// The `[n][head_dim]` keys (`kv == 0`) or values (`kv == 1`) of tokens
    /// `t0..t0 + n`, where `n <= run(t0)`.
    fn tile(&self, kv: usize, t0: usize, n: usize) -> &[T];
}

/// One task: rows `row0..row0 + rows` of a sequence's `queries * group` query rows
/// (row `r` is query token `r / group`, query head `kv_head * group + r % group`).
#[derive(Clone, Copy)]
pub(crate) struct RowTask<'a> {
    /// The sequence's queries `[queries][q_heads][head_dim]`.
    pub q: &'a [f32],
    /// Tokens of context, the new query tokens included (they are the last ones).
    pub context_len: usize,
    /// New query tokens.
    pub queries: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Query heads.
    pub q_heads: usize,
    /// The KV head.
    pub kv_head: usize,
    /// First row of the task.
    pub row0: usize,
    /// Rows of the task (`<= MAX_ROWS`).
    pub rows: usize,
    /// Elements per head (`<= MAX_HEAD_DIM`).
    pub head_dim: usize,
    /// Softmax scale applied to the scores.
    pub scale: f32,
}

impl RowTask<'_> {
    /// Query token and query head of row `j` of the task.
    #[inline(always)]
    pub(crate) fn row(&self, j: usize) -> (usize, usize) {
        let r = self.row0 + j;
        (r / self.group, self.kv_head * self.group + r % self.group)
    }
}

/// Per-worker scratch space (about 100 KiB), made once per worker per call, on its
/// stack: the kernels allocate nothing.
pub(crate) struct Scratch {
    q: [f32; MAX_ROWS * super::MAX_HEAD_DIM],
    /// After [`attend`]: the task's output rows, `[rows][head_dim]`.
    pub(crate) acc: [f32; MAX_ROWS * super::MAX_HEAD_DIM],
    tile: [f32; TILE_ELEMS],
    s: [f32; MAX_ROWS * MAX_CHUNK],
    m: [f32; MAX_ROWS],
    l: [f32; MAX_ROWS],
    limit: [usize; MAX_ROWS],
}

impl Scratch {
    pub(crate) fn new() -> Self {
        Self {
            q: [0.0; MAX_ROWS * super::MAX_HEAD_DIM],
            acc: [0.0; MAX_ROWS * super::MAX_HEAD_DIM],
            tile: [0.0; TILE_ELEMS],
            s: [0.0; MAX_ROWS * MAX_CHUNK],
            m: [0.0; MAX_ROWS],
            l: [0.0; MAX_ROWS],
            limit: [0; MAX_ROWS],
        }
    }
}

/// Runs `task` over `src`, leaving the normalised output rows in `scratch.acc`
/// (`[task.rows][task.head_dim]`). Picks the AVX2 + FMA build when the CPU has it.
/// O(rows × limit × head_dim). The caller has validated the task (rows within
/// `MAX_ROWS`, head dim within `MAX_HEAD_DIM`, query rows inside `q`, `src` covering
/// `context_len` tokens).
#[inline]
pub(crate) fn attend<T: Element, S: KvSource<T>>(
    task: &RowTask<'_>,
    src: &S,
    scratch: &mut Scratch,
) {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: AVX2, FMA and F16C were detected on this CPU just above.
        unsafe { x86::attend(task, src, scratch) };
        return;
    }
    attend_body::<T, S, false>(task, src, scratch);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{attend_body, KvSource, RowTask, Scratch};
    use crate::dtype::Element;

    /// Whether the CPU has AVX2, FMA and F16C. O(1) after the first call.
    #[inline]
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }

    /// [`attend_body`] compiled for AVX2 + FMA.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C ([`available`] returned true).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend<T: Element, S: KvSource<T>>(
        task: &RowTask<'_>,
        src: &S,
        scratch: &mut Scratch,
    ) {
        attend_body::<T, S, true>(task, src, scratch);
    }
}

/// The routine itself; `FUSED` selects fused multiply-add (see [`math::fma`]).
#[inline(always)]
fn attend_body<T: Element, S: KvSource<T>, const FUSED: bool>(
    task: &RowTask<'_>,
    src: &S,
    sc: &mut Scratch,
) {
    let hd = task.head_dim;
    let rows = task.rows;
    let chunk_max = MAX_CHUNK.min(TILE_ELEMS / hd).max(1);
    let first_pos = task.context_len - task.queries;

    // Load the scaled queries, reset the softmax state.
    for j in 0..rows {
        let (qi, qh) = task.row(j);
        let src_q = &task.q[(qi * task.q_heads + qh) * hd..][..hd];
        for (d, s) in sc.q[j * hd..(j + 1) * hd].iter_mut().zip(src_q) {
            *d = s * task.scale;
        }
        sc.limit[j] = first_pos + qi + 1;
        sc.m[j] = f32::NEG_INFINITY;
        sc.l[j] = 0.0;
        sc.acc[j * hd..(j + 1) * hd].fill(0.0);
    }
    // Rows are ordered by query token, so the last row sees the most tokens.
    let end = sc.limit[rows - 1];

    let mut t0 = 0;
    while t0 < end {
        let n = src.run(t0).min(chunk_max).min(end - t0);

        // Scores from the widened K tile.
        T::widen(src.tile(0, t0, n), &mut sc.tile[..n * hd]);
        for j in 0..rows {
            let vis = sc.limit[j].saturating_sub(t0).min(n);
            let q = &sc.q[j * hd..(j + 1) * hd];
            let s = &mut sc.s[j * MAX_CHUNK..j * MAX_CHUNK + vis];
            for (st, kt) in s.iter_mut().zip(sc.tile.chunks_exact(hd)) {
                *st = math::dot::<FUSED>(q, kt);
            }
            // Online softmax: new running max, rescale what was accumulated so far.
            if vis > 0 {
                let m_new = sc.m[j].max(math::max(s));
                let corr = math::exp(sc.m[j] - m_new);
                let sum = math::exp_shifted_sum(s, m_new);
                sc.l[j] = sc.l[j] * corr + sum;
                if corr != 1.0 {
                    math::scale(&mut sc.acc[j * hd..(j + 1) * hd], corr);
                }
                sc.m[j] = m_new;
            }
        }

        // Weighted values from the widened V tile.
        T::widen(src.tile(1, t0, n), &mut sc.tile[..n * hd]);
        for j in 0..rows {
            let vis = sc.limit[j].saturating_sub(t0).min(n);
            if vis > 0 {
                let p = &sc.s[j * MAX_CHUNK..j * MAX_CHUNK + vis];
                math::accumulate::<FUSED>(
                    &mut sc.acc[j * hd..(j + 1) * hd],
                    p,
                    &sc.tile[..vis * hd],
                );
            }
        }
        t0 += n;
    }

    // Normalise. Every row sees at least one token, whose weight is exp(0) = 1.
    for j in 0..rows {
        let inv = 1.0 / sc.l[j];
        math::scale(&mut sc.acc[j * hd..(j + 1) * hd], inv);
    }
}
