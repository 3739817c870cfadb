//! The one inner routine of every attention kernel: a tile of query rows against the
//! K/V of one sequence and one or several consecutive KV heads, in token chunks, with an
//! online (running-max) softmax. Decode, chunked prefill and the contiguous baseline differ only in where the
//! chunks come from ([`KvSource`]) and which rows they hand in.
//!
//! Per chunk of `n <= MAX_CHUNK` tokens (the runs of one or more blocks): every row of
//! the task (all query heads of the GQA group, for one or several query tokens, of each
//! of the task's KV heads) takes its scores from the stored K tiles, four rows per vector load, each load widening
//! f16 / bf16 to `f32` in registers; then the V tiles are accumulated the same way — so
//! each stored K/V byte is read (and converted) once per group of rows, and never
//! copied.
//! A decode task takes several KV heads (up to `MAX_ROWS` rows in all), and walks each
//! run of tokens head after head: in the paged layout a block's heads are adjacent, so
//! the K (then V) tiles it reads, and prefetches, form one contiguous range per block
//! instead of one short tile per head.
//! Rows see tokens `t < limit(row)` (causal: a query at absolute position `p` sees
//! `0..=p`); the softmax keeps a running max `m`, sum `l` and output `acc` per row and
//! rescales them by `exp(m_old - m_new)`, so it never overflows, whatever the scores.
//!
//! The routine is compiled six times: with the portable arithmetic, and on x86-64
//! with the AVX2 + FMA ([`super::avx2`]) and AVX-512F ([`super::avx512`]) arithmetic,
//! for 8-bit storage with the AVX-512 dot-product extensions ([`super::dot`]), and for
//! bf16 and FP8 storage with AMX tiles ([`super::amx`]), chosen at run time per task
//! ([`attend`]).

#[cfg(target_arch = "x86_64")]
use super::amx::AmxBf16;
#[cfg(target_arch = "x86_64")]
use super::dot::{Avx512Dot, Bf16Dot, Vnni};
use super::math::{self, Simd};
#[cfg(target_arch = "x86_64")]
use crate::dtype::Kind;
use crate::dtype::{bytes_of, Element};

/// Query rows (query token × query head of one group) per task.
///
/// 32 rows (in a decode of four query heads per KV head, eight KV heads a task, so a
/// block's K and then V tiles are read as 32 KiB ranges instead of 16 KiB) took
/// 0.99-1.01 of the time for f16, bf16 and int8 (32 × 2048, 128 × 512 and 8 × 8192
/// tokens out of cache, 2-vCPU Zen 4, paired in one process as [`SCORE_STEP`] says),
/// for twice the scratch: 16 stays.
pub(crate) const MAX_ROWS: usize = 16;
/// Tokens per chunk, unless the arithmetic takes longer ones ([`Simd::chunk_tokens`]).
///
/// The chunk sets how far ahead each phase prefetches (a chunk's V tiles during its
/// scores, the next chunk's K tiles during its values). Chunks of 32 and 48 tokens
/// took 1.01-1.03 of the time of 64 (f16 decode out of cache, 2-vCPU Zen 4, paired in
/// one process as [`SCORE_STEP`] says), 128 and 256 0.995-1.010 for f16 and bf16 (and
/// 1.04 for f32 at 256), and 128 no less than 64 in cache.
pub(crate) const CHUNK: usize = 64;
/// Most tokens per chunk: the scratch's capacity, and its rows' stride.
pub(crate) const MAX_CHUNK: usize = 128;
const _: () = assert!(CHUNK <= MAX_CHUNK);
/// Rows of queries and scores past `MAX_ROWS`: a four-row pass over the last two or
/// three rows of a head also computes the next one or two rows' scores (see
/// [`score_rows`]), which past the task's last row land here, never read.
const SPARE_ROWS: usize = 3;

/// Where the K/V tiles of a task (one sequence, layer, and the task's KV heads) come from.
pub(crate) trait KvSource<T> {
    /// Tokens readable as one contiguous tile starting at token `t0` (at least 1), for
    /// every head of the task.
    fn run(&self, t0: usize) -> usize;
    /// The `[n][head_dim]` keys (`kv == 0`) or values (`kv == 1`) of tokens
    /// `t0..t0 + n` of the task's KV head `head` (counted from its first), where
    /// `n <= run(t0)`.
    fn tile(&self, head: usize, kv: usize, t0: usize, n: usize) -> &[T];
    /// For 8-bit storage: the scales of the same rows into `out[..n]` (stored value =
    /// scale · code). Only called when `T`'s dtype is scaled.
    fn scales(&self, head: usize, kv: usize, t0: usize, n: usize, out: &mut [f32]);
    /// For 8-bit storage: where the scales of the same rows are stored (the bytes
    /// [`KvSource::scales`] reads), for prefetching; empty if the source does not say.
    #[inline(always)]
    fn scale_bytes(&self, head: usize, kv: usize, t0: usize, n: usize) -> &[u8] {
        let _ = (head, kv, t0, n);
        &[]
    }
}

/// One task: rows `row0..row0 + head_rows` of a sequence's `queries * group` query rows
/// of each of the KV heads `kv_head..kv_head + heads` (row `r` of KV head `h` is query
/// token `r / group`, query head `h * group + r % group`). Task row `j` is row
/// `row0 + j % head_rows` of the task's head `j / head_rows`.
///
/// Invariants (the caller's): `rows == heads * head_rows <= MAX_ROWS`, and a task of
/// several heads has at most eight rows per head (a decode step; they go in passes of
/// four).
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
    /// The task's first KV head.
    pub kv_head: usize,
    /// KV heads of the task.
    pub heads: usize,
    /// First row of the task, in each head.
    pub row0: usize,
    /// Rows of the task per KV head (`heads * head_rows <= MAX_ROWS`).
    pub head_rows: usize,
    /// Elements per head (`<= MAX_HEAD_DIM`).
    pub head_dim: usize,
    /// Softmax scale applied to the scores.
    pub scale: f32,
}

impl RowTask<'_> {
    /// Rows of the task in all: `heads * head_rows`. O(1).
    #[inline(always)]
    pub(crate) fn rows(&self) -> usize {
        self.heads * self.head_rows
    }

    /// Query token and query head of row `j` of the task.
    #[inline(always)]
    pub(crate) fn row(&self, j: usize) -> (usize, usize) {
        debug_assert!(j < self.rows());
        let (h, r) = (j / self.head_rows, self.row0 + j % self.head_rows);
        (
            r / self.group,
            (self.kv_head + h) * self.group + r % self.group,
        )
    }

    /// Tokens the task reads: those its last row sees (a head's rows are ordered by
    /// query token, so later rows see at least as many tokens, and every head has the
    /// same rows). O(1).
    #[inline(always)]
    fn tokens(&self) -> usize {
        self.context_len - self.queries + self.row(self.rows() - 1).0 + 1
    }
}

/// The task a worker runs after the current one, and its K/V: the current task
/// prefetches its first chunk's K tiles while it computes its own last one
/// ([`attend`]).
pub(crate) struct Ahead<'a, S> {
    /// The next task.
    pub task: &'a RowTask<'a>,
    /// Its K/V.
    pub src: &'a S,
}

/// Per-worker scratch space (about 57 KiB), made once per worker per call, on its
/// stack: the kernels allocate nothing.
pub(crate) struct Scratch {
    q: [f32; (MAX_ROWS + SPARE_ROWS) * super::MAX_HEAD_DIM],
    /// After [`attend`]: the task's output rows, `[rows][head_dim]`.
    pub(crate) acc: [f32; MAX_ROWS * super::MAX_HEAD_DIM],
    s: [f32; (MAX_ROWS + SPARE_ROWS) * MAX_CHUNK],
    /// The chunk's per-token scales of K and V of one head (8-bit storage).
    scales: [[f32; MAX_CHUNK]; 2],
    /// One step of K or V tokens widened to f32, when a task has more rows than one
    /// pass of the arithmetic takes (see [`attend_body`]).
    wide: [f32; WIDE_STEP * super::MAX_HEAD_DIM],
    m: [f32; MAX_ROWS],
    l: [f32; MAX_ROWS],
    limit: [usize; MAX_ROWS],
    /// Per row, what its scores are multiplied by after their keys' scales: the
    /// arithmetic's key unit over the power of two its query row was lifted by
    /// ([`lift_query`]).
    key_unit: [f32; MAX_ROWS],
    /// Per row, the power of two (its exponent) by which its accumulator is below the
    /// weighted sum of values, which keeps the weights times their values' scales and
    /// the arithmetic's unit clear of overflow and of the subnormals ([`value_shift`]);
    /// [`NO_SHIFT`] before the row's first chunk.
    value_shift: [i32; MAX_ROWS],
}

impl Scratch {
    /// All zeros (every field is set per task before it is read): so the compiler
    /// zeroes a worker's scratch where it lives, where a scratch that was not all
    /// zeros (`key_unit` ones) was zeroed, filled, then copied into the worker's state,
    /// a `memcpy` of 57 KiB per worker and call that took a fifth of a decode of 16
    /// tokens. O(its size).
    pub(crate) fn new() -> Self {
        Self {
            q: [0.0; (MAX_ROWS + SPARE_ROWS) * super::MAX_HEAD_DIM],
            acc: [0.0; MAX_ROWS * super::MAX_HEAD_DIM],
            s: [0.0; (MAX_ROWS + SPARE_ROWS) * MAX_CHUNK],
            scales: [[0.0; MAX_CHUNK]; 2],
            wide: [0.0; WIDE_STEP * super::MAX_HEAD_DIM],
            m: [0.0; MAX_ROWS],
            l: [0.0; MAX_ROWS],
            limit: [0; MAX_ROWS],
            key_unit: [0.0; MAX_ROWS],
            value_shift: [0; MAX_ROWS],
        }
    }
}

/// Runs `task` over `src`, leaving the normalised output rows in `scratch.acc`
/// (`[task.rows()][task.head_dim]`). Uses the AVX2 + FMA arithmetic when the CPU has it.
/// With `ahead`, its last chunk also prefetches the K tiles of that next task's first
/// chunk; `primed` says that the previous task did so for this one, which then does
/// not prefetch them in one burst.
/// O(rows × limit × head_dim). The caller has validated the task (rows within
/// `MAX_ROWS`, head dim within `MAX_HEAD_DIM`, query rows inside `q`, `src` covering
/// `context_len` tokens).
#[inline]
pub(crate) fn attend<T: Element, S: KvSource<T>>(
    task: &RowTask<'_>,
    src: &S,
    ahead: Option<Ahead<'_, S>>,
    primed: bool,
    scratch: &mut Scratch,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if T::KIND == Kind::Int8 {
            if let Some(simd) = AmxBf16::detect() {
                if simd.takes_rows::<T>(task.head_dim, task.head_rows) {
                    // SAFETY: `detect` found AVX-512F, BW and the AMX tiles;
                    // `takes_rows` that the CPU has AMX-INT8.
                    unsafe { attend_amx(simd, task, src, ahead, primed, scratch) };
                    return;
                }
            }
            if let Some(simd) = Avx512Dot::<Vnni>::detect() {
                // SAFETY: `detect` found AVX-512F, BW, VNNI, AVX2, FMA and F16C.
                unsafe { attend_avx512_vnni(simd, task, src, ahead, primed, scratch) };
                return;
            }
        }
        if T::KIND == Kind::Fp8E4m3 {
            if let Some(simd) = Avx512Dot::<Bf16Dot>::detect() {
                if simd.takes_rows::<T>(task.head_dim, task.head_rows) {
                    // SAFETY: `detect` found AVX-512F, BW, BF16, AVX2, FMA and F16C.
                    unsafe { attend_avx512_bf16(simd, task, src, ahead, primed, scratch) };
                    return;
                }
            }
        }
        if T::KIND == Kind::Bf16 || T::KIND == Kind::Fp8E4m3 {
            if let Some(simd) = AmxBf16::detect() {
                if simd.takes_rows::<T>(task.head_dim, task.head_rows) {
                    // SAFETY: `detect` found AVX-512F, BW and the AMX tiles.
                    unsafe { attend_amx(simd, task, src, ahead, primed, scratch) };
                    return;
                }
            }
        }
        if let Some(simd) = super::avx512::Avx512::detect() {
            // SAFETY: `Avx512::detect` found AVX-512F, AVX2, FMA and F16C on this CPU.
            unsafe { attend_avx512(simd, task, src, ahead, primed, scratch) };
            return;
        }
        if let Some(simd) = super::avx2::Avx2::detect() {
            // SAFETY: `Avx2::detect` found AVX2, FMA and F16C on this CPU.
            unsafe { attend_avx2(simd, task, src, ahead, primed, scratch) };
            return;
        }
    }
    attend_body(math::Portable, task, src, ahead, primed, scratch);
}

/// [`attend_body`] compiled with AVX2 + FMA enabled, so that the whole body (not just
/// the intrinsics) uses them.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C (as the `Avx2` value proves).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2<T: Element, S: KvSource<T>>(
    simd: super::avx2::Avx2,
    task: &RowTask<'_>,
    src: &S,
    ahead: Option<Ahead<'_, S>>,
    primed: bool,
    scratch: &mut Scratch,
) {
    attend_body(simd, task, src, ahead, primed, scratch);
}

/// [`attend_body`] compiled with AVX-512F enabled.
///
/// # Safety
/// The CPU has AVX-512F, AVX2, FMA and F16C (as the `Avx512` value proves).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn attend_avx512<T: Element, S: KvSource<T>>(
    simd: super::avx512::Avx512,
    task: &RowTask<'_>,
    src: &S,
    ahead: Option<Ahead<'_, S>>,
    primed: bool,
    scratch: &mut Scratch,
) {
    attend_body(simd, task, src, ahead, primed, scratch);
}

/// [`attend_body`] compiled with AVX-512F, BW and VNNI enabled (int8 storage).
///
/// # Safety
/// The CPU has AVX-512F, BW, VNNI, AVX2, FMA and F16C (as the value proves).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn attend_avx512_vnni<T: Element, S: KvSource<T>>(
    simd: Avx512Dot<Vnni>,
    task: &RowTask<'_>,
    src: &S,
    ahead: Option<Ahead<'_, S>>,
    primed: bool,
    scratch: &mut Scratch,
) {
    attend_body(simd, task, src, ahead, primed, scratch);
}

/// [`attend_body`] compiled with AVX-512F, BW and BF16 enabled (FP8 storage).
///
/// # Safety
/// The CPU has AVX-512F, BW, BF16, AVX2, FMA and F16C (as the value proves).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn attend_avx512_bf16<T: Element, S: KvSource<T>>(
    simd: Avx512Dot<Bf16Dot>,
    task: &RowTask<'_>,
    src: &S,
    ahead: Option<Ahead<'_, S>>,
    primed: bool,
    scratch: &mut Scratch,
) {
    attend_body(simd, task, src, ahead, primed, scratch);
}

/// [`attend_body`] over AMX tiles (bf16 and FP8 storage), compiled with AVX-512F and BW
/// enabled: the tile configuration loaded before, the tiles released after.
///
/// # Safety
/// The CPU has AVX-512F, BW, AVX2, FMA and F16C (as the value proves).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn attend_amx<T: Element, S: KvSource<T>>(
    simd: AmxBf16,
    task: &RowTask<'_>,
    src: &S,
    ahead: Option<Ahead<'_, S>>,
    primed: bool,
    scratch: &mut Scratch,
) {
    simd.begin();
    attend_body(simd, task, src, ahead, primed, scratch);
    simd.end();
}

/// Most tokens per step of the scores loop (between two prefetch bursts), and the
/// default ([`Schedule::LONGEST`]).
///
/// Measured again on a 2-vCPU AMD EPYC Zen 4 (AVX-512 decode of 32 query heads over 8
/// KV heads, head dim 128, 32 x 2048 tokens, two threads, out of cache; separate
/// builds, processes alternating, ratios of median times): steps of 16 tokens for both
/// loops (bursts of 64 lines of f16) took 1.11-1.18 of the time for bf16 and 1.04-1.33
/// for f16 (`decode_bandwidth`: 1.12-1.30 and 0.99-1.34), although in cache they took
/// 0.93-0.96; steps of 2 and 4 tokens took 1.2-1.4 for the 16-bit and 8-bit types
/// (0.97 for f32); each step's prefetches split around its arithmetic, 0.95 for f32
/// and bf16 but 1.11 for f16. The same steps chosen at run time within one binary had
/// shown the longer steps 4-10% faster: that binary's baseline was not the shipped
/// code (its steps were not constants, and its prefetch loop read the knob), so only
/// separate builds measure this.
///
/// Measured once more in that one-binary way, but paired (Zen 4 as above, f16, 32 x
/// 2048 and 128 x 512 tokens; a switch read once per task picked the steps, calls of
/// the two alternating, 30 to 60 rounds, median of the rounds' ratios), where the
/// knob's cost falls on both sides alike and the host's slow spells cancel: against 4
/// and 8, scores in steps of 2 took 1.18-1.22 of the time, 6: 1.02-1.06, 8:
/// 0.98-1.01, 16: 1.07-1.08; values in steps of 4: 1.07-1.10, 6: 1.02-1.03, 16:
/// 1.07. So 4 and 8 stay, now with a measured neighbourhood around them.
pub(crate) const SCORE_STEP: usize = 4;
/// Most tokens per step of the value accumulation (unless the arithmetic takes a whole
/// chunk at once: [`Simd::gathers_values`]), and the default ([`Schedule::LONGEST`]).
pub(crate) const VALUE_STEP: usize = 8;
/// Most tokens per step of either loop in a task of several passes over each stored
/// vector ([`Simd::pass_schedule`]), which its arithmetic bounds.
pub(crate) const PASS_STEP: usize = 16;

/// How the attention loop paces a task's prefetches ([`Simd::schedule`]): each step of
/// the scores (prefetching the chunk's V tiles) and of the value accumulation (the next
/// chunk's K tiles) prefetches as many lines as it reads, so the steps set how long
/// each burst of prefetches is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Schedule {
    /// Tokens per step of the scores, `1..=SCORE_STEP`.
    pub(crate) score_step: usize,
    /// Tokens per step of the value accumulation, `1..=VALUE_STEP`.
    pub(crate) value_step: usize,
    /// Whether a step issues half of its prefetches before its arithmetic and half
    /// after (two shorter bursts), rather than all after.
    pub(crate) split: bool,
}

impl Schedule {
    /// The longest steps, each step's prefetches after its arithmetic: the least
    /// bookkeeping per token.
    pub(crate) const LONGEST: Self = Self {
        score_step: SCORE_STEP,
        value_step: VALUE_STEP,
        split: false,
    };

    /// Steps of [`PASS_STEP`] tokens, prefetches after the arithmetic: the least
    /// bookkeeping per token, for the tasks of several passes that the arithmetic
    /// bounds.
    #[cfg(target_arch = "x86_64")]
    pub(crate) const PASSES: Self = Self {
        score_step: PASS_STEP,
        value_step: PASS_STEP,
        split: false,
    };

    /// Steps of at most `score_lines` 64-byte lines of one head's K and `value_lines` of
    /// its V (storage `T`, head dim `hd`), within `1..=SCORE_STEP` and `2..=VALUE_STEP`
    /// tokens (a step of one token of values would load and store the accumulators for
    /// every token), with `split` bursts. O(1).
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn of_lines<T>(
        hd: usize,
        score_lines: usize,
        value_lines: usize,
        split: bool,
    ) -> Self {
        let lines = (hd * core::mem::size_of::<T>()).div_ceil(64).max(1);
        Self {
            score_step: (score_lines / lines).clamp(1, SCORE_STEP),
            value_step: (value_lines / lines).clamp(2, VALUE_STEP),
            split,
        }
    }

    /// Of a step's `lines` of prefetches, how many go before its arithmetic. O(1).
    #[inline(always)]
    fn before(&self, lines: usize) -> usize {
        if self.split {
            lines / 2
        } else {
            0
        }
    }
}

/// Tokens of the widened K or V step.
const WIDE_STEP: usize = PASS_STEP;
const _: () = assert!(SCORE_STEP <= PASS_STEP && VALUE_STEP <= PASS_STEP);

/// The runs of tokens `t0..t0 + n` that are contiguous in `src`, as `(first token,
/// tokens)`. O(1) per run.
#[inline(always)]
fn runs<T, S: KvSource<T>>(
    src: &S,
    t0: usize,
    n: usize,
) -> impl Iterator<Item = (usize, usize)> + '_ {
    let end = t0 + n;
    let mut t = t0;
    core::iter::from_fn(move || {
        (t < end).then(|| {
            let len = src.run(t).min(end - t);
            t += len;
            (t - len, len)
        })
    })
}

/// Cache-line prefetches of the K or V tiles of a run of tokens, issued a few at a time.
/// No effect except on x86-64 (where a prefetch never faults).
struct Prefetch<'a> {
    /// Keys (0) or values (1).
    kv: usize,
    /// KV heads of the task.
    heads: usize,
    /// The run whose tiles are being prefetched (first token, tokens), and the next
    /// head whose tile of it is not begun (`heads`: the run is done).
    run: (usize, usize),
    head: usize,
    /// The first token of the next run, and the end of the tokens.
    next: usize,
    end: usize,
    /// Bytes of the tokens' tiles in all (every head's).
    total: usize,
    /// The bytes of the tile being prefetched, and how many are done.
    tile: &'a [u8],
    done: usize,
}

impl<'a> Prefetch<'a> {
    /// Prefetches of tokens `t0..t0 + n` of `heads` KV heads (K or V, `hd` elements of
    /// `T` per token and head), run by run, each run's heads in order.
    fn new<T>(kv: usize, t0: usize, n: usize, hd: usize, heads: usize) -> Self {
        Self {
            kv,
            heads,
            run: (t0, 0),
            head: heads,
            next: t0,
            end: t0 + n,
            total: heads * n * hd * core::mem::size_of::<T>(),
            tile: &[],
            done: 0,
        }
    }

    /// Lines of the tiles (64 bytes each).
    fn lines(&self) -> usize {
        self.total.div_ceil(64)
    }

    /// Prefetches the next `lines` lines, moving on to the next head's tile of the run,
    /// or to the next run, when one is done.
    #[inline(always)]
    fn advance<T: Element, S: KvSource<T>>(&mut self, src: &'a S, lines: usize) {
        let mut left = lines * 64;
        while left > 0 {
            if self.done >= self.tile.len() {
                if self.head == self.heads {
                    if self.next >= self.end {
                        return;
                    }
                    let len = src.run(self.next).min(self.end - self.next);
                    self.run = (self.next, len);
                    self.next += len;
                    self.head = 0;
                }
                let (t, len) = self.run;
                if T::DTYPE.is_scaled() {
                    // The tile's scales: a line or two, read before the softmax.
                    prefetch_lines(src.scale_bytes(self.head, self.kv, t, len));
                }
                self.tile = bytes_of(src.tile(self.head, self.kv, t, len));
                self.head += 1;
                self.done = 0;
            }
            let end = self.tile.len().min(self.done + left);
            left -= end - self.done;
            prefetch_lines(&self.tile[self.done..end]);
            self.done = end;
        }
    }
}

/// Prefetches (into L2) every 64-byte line that `bytes` touches. No effect except on
/// x86-64 (where a prefetch never faults). O(lines).
///
/// Every line, not every other one: no hardware prefetcher fills in the rest, on Intel
/// (bf16 1.30, f32 1.22 of the time with every other line) as on the 2-vCPU Zen 4
/// (decode of 32 × 2048 out of cache, two threads, alternating builds: f16 2.0–2.2,
/// int8 1.4–1.5, where no prefetches at all took f16 2.3).
///
/// Into L2 (`T1`), not L1: on the 2-vCPU Zen 4 (f16 decode of 32 × 2048 and 128 × 512
/// tokens out of cache, two threads, paired in one process as [`SCORE_STEP`] says),
/// `T0` took 1.59-1.60 of the time and `NTA` 1.54-1.62; `T2` took 1.006-1.008, the
/// same as `T1` within the noise. (`T0` fills L1, whose 32 KiB a phase's 64 KiB of
/// tiles overrun before they are read; why `NTA` loses as much was not looked into.)
#[inline(always)]
fn prefetch_lines(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let (start, end) = (
            bytes.as_ptr() as usize,
            bytes.as_ptr() as usize + bytes.len(),
        );
        let mut line = start & !63;
        while line < end {
            // SAFETY: a prefetch never faults, whatever the address; `line` lies within
            // the line of an address inside `bytes`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line as *const i8) };
            line += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// The routine itself, over the arithmetic `simd`.
#[inline(always)]
fn attend_body<T: Element, S: KvSource<T>, V: Simd>(
    simd: V,
    task: &RowTask<'_>,
    src: &S,
    ahead: Option<Ahead<'_, S>>,
    primed: bool,
    sc: &mut Scratch,
) {
    let hd = task.head_dim;
    let rows = task.rows();
    // Rows per KV head, and KV heads: task row `j` belongs to head `j / hr`, and each
    // head's rows are `hr` consecutive ones of `sc.q`, `sc.s`, `sc.acc`, `sc.limit`.
    let (hr, heads) = (task.head_rows, task.heads);
    debug_assert!(heads * hr == rows && (heads == 1 || hr <= 8));
    debug_assert!(
        simd.takes_rows::<T>(hd, hr),
        "the arithmetic does not take these rows"
    );
    let chunk_max = simd.chunk_tokens::<T>(hd);
    debug_assert!((1..=MAX_CHUNK).contains(&chunk_max));
    let first_pos = task.context_len - task.queries;
    let end = task.tokens();

    // The first chunk's K tiles: each chunk prefetches the next one's while it
    // computes, but unless the previous task did (`primed`), nothing has fetched the
    // first. Started in one burst here, they arrive while the queries are loaded
    // (decode out of cache, paired: 0.99x at 2048 tokens, 0.97-0.98x at 512, with the
    // V tiles in the burst too; over K/V already in cache the prefetches are wasted
    // instructions: 1.02-1.03x on 1 x 256 tokens). Each chunk's V tiles are prefetched
    // during its own scores.
    if !primed {
        let mut first = Prefetch::new::<T>(0, 0, end.min(chunk_max), hd, heads);
        let lines = first.lines();
        first.advance(src, lines);
    }

    // A task of more rows per KV head than one pass of the arithmetic takes (decode of
    // groups of five or more query heads per KV head, chunked prefill) reads each
    // stored K and V vector once per four rows: it makes several `passes`. Where the
    // arithmetic asks for it ([`Simd::widens_storage`]: 8-bit storage in such a task
    // without AVX-512; f16 and 8-bit storage in every task of the portable
    // arithmetic), the task widens the storage once per step and head into `sc.wide`
    // and the arithmetic reads f32.
    let passes = hr > 4;
    let widen = simd.widens_storage::<T>(passes);
    // An arithmetic whose accumulation calls carry a fixed cost (8-bit storage in the
    // dot-product extensions, bf16 sums in the AMX tiles in decode) takes a chunk's
    // values of one head in one call, all of the chunk's runs ([`Simd::gathers_values`]),
    // and may step through it ([`Simd::gathered_step`]).
    let gather = !widen && simd.gathers_values::<T>(hd, passes);
    let paced = simd.gathered_step::<T>(hd);
    // The prefetch schedule: the arithmetic's ([`Simd::schedule`]) for a task of one
    // pass over each head's K/V (decode with up to four query heads per KV head), which
    // memory bounds; the longest steps for more passes (wider groups, chunked prefill),
    // bound by the arithmetic, which a step's fixed cost slows.
    let sched = if passes {
        simd.pass_schedule()
    } else {
        simd.schedule::<T>(hd)
    };
    debug_assert!((1..=PASS_STEP).contains(&sched.score_step));
    debug_assert!((1..=PASS_STEP).contains(&sched.value_step));
    let (score_step, value_step) = (sched.score_step, sched.value_step);

    // Load the scaled queries, reset the softmax state.
    let unit = simd.code_unit::<T>();
    let query_exponent = simd.query_exponent::<T>();
    let shifts = simd.shifts_weights::<T>();
    for j in 0..rows {
        let (qi, qh) = task.row(j);
        let src_q = &task.q[(qi * task.q_heads + qh) * hd..][..hd];
        for (d, s) in sc.q[j * hd..(j + 1) * hd].iter_mut().zip(src_q) {
            *d = s * task.scale;
        }
        sc.key_unit[j] = if unit == 1.0 {
            1.0
        } else {
            lift_query(&mut sc.q[j * hd..(j + 1) * hd], unit, query_exponent)
        };
        sc.value_shift[j] = NO_SHIFT;
        sc.limit[j] = first_pos + qi + 1;
        sc.m[j] = f32::NEG_INFINITY;
        sc.l[j] = 0.0;
        sc.acc[j * hd..(j + 1) * hd].fill(0.0);
    }
    if !widen {
        simd.enter_kernel_order::<T>(&mut sc.q[..rows * hd], hd);
    }
    debug_assert_eq!(end, sc.limit[rows - 1]);

    // Chunks of up to `chunk_max` tokens ([`Simd::chunk_tokens`]), each made of the runs
    // of tokens that are contiguous in the arena (a block's, in a paged layout): the
    // softmax bookkeeping (maxima, rescaling, and for 8-bit storage the scales) is paid
    // once per chunk, not once per block.
    let mut t0 = 0;
    while t0 < end {
        let n = (end - t0).min(chunk_max);
        let next = t0 + n;
        let next_n = (end - next).min(chunk_max);
        // Prefetches, a few lines at a time, each phase of the chunk fetching what the
        // next phase reads (a burst of prefetches would stall on the line-fill buffers
        // instead of overlapping): during the scores, this chunk's V tiles; during the
        // value accumulation, the next chunk's K tiles (the last chunk: the next
        // task's first, if there is one). Against prefetching the next chunk's K
        // during the scores and its V during the accumulation (twice the distance),
        // paired in the same process, calls alternating, median of the ratios,
        // Emerald Rapids, 2 threads out of cache: f32 0.96 (0.95-0.98 over contexts
        // 512, 2048 and 8192), f16 0.975 (0.97-0.985), bf16, int8 and FP8 0.99-1.0;
        // chunked prefill 0.96-1.02.
        let (pf_src, pf_t0, pf_n, pf_heads) = match &ahead {
            Some(a) if next_n == 0 => (a.src, 0, a.task.tokens().min(chunk_max), a.task.heads),
            _ => (src, next, next_n, heads),
        };
        let mut pf_values = Prefetch::new::<T>(1, t0, n, hd, heads);
        let mut pf_keys = Prefetch::new::<T>(0, pf_t0, pf_n, hd, pf_heads);

        // Scores from the K tiles, four rows at a time (each K vector loaded once for
        // four query rows), `score_step` tokens at a time. Scores past a row's limit
        // are computed (for the group's widest row) and zeroed after the exponentials.
        // Each run's tiles are taken head after head, the order in which a block
        // stores them.
        let steps = heads * n.div_ceil(score_step);
        let per_step = pf_values.lines().div_ceil(steps);
        // An accumulation of few steps (a gathered one takes the chunk in one per
        // head) would prefetch the next K tiles in one burst: they are spread over the
        // scores' steps instead (int8, 2048 x 32 out of cache: 9.3 -> 7.4 ms, measured
        // when these were the next chunk's V tiles). Nor are they spread over the
        // gathered accumulation itself, a few lines every few tokens from inside its
        // loop ([`Simd::gathered_step`]): for int8 on VNNI, a call every 4, 8 or 16
        // tokens took 1.12-1.13, 1.05-1.07 and 1.06-1.09 of the time (128 x 512 and
        // 32 x 2048 tokens, 2-vCPU Zen 4, paired in one process as [`SCORE_STEP`]
        // says).
        let per_step_k = if gather && paced == 0 {
            pf_keys.lines().div_ceil(steps)
        } else {
            0
        };
        // Of each step's prefetches, those issued before its arithmetic (the same for
        // every step of the chunk).
        let (v_before, k_before) = (sched.before(per_step), sched.before(per_step_k));
        for (t, len) in runs(src, t0, n) {
            for h in 0..heads {
                let k = src.tile(h, 0, t, len);
                let (q, limit) = (&sc.q[h * hr * hd..], &sc.limit[h * hr..(h + 1) * hr]);
                for ts in (0..len).step_by(score_step) {
                    let m = (len - ts).min(score_step);
                    let kt = &k[ts * hd..(ts + m) * hd];
                    let s = &mut sc.s[h * hr * MAX_CHUNK + t - t0 + ts..];
                    pf_values.advance(src, v_before);
                    pf_keys.advance(pf_src, k_before);
                    if widen {
                        simd.widen::<T>(kt, &mut sc.wide[..m * hd]);
                        let wide = &sc.wide[..m * hd];
                        score_rows(simd, q, s, limit, hd, t + ts, wide, m, passes);
                    } else {
                        score_rows(simd, q, s, limit, hd, t + ts, kt, m, passes);
                    }
                    pf_values.advance(src, per_step - v_before);
                    pf_keys.advance(pf_src, per_step_k - k_before);
                }
            }
        }

        // Online softmax, head by head: new running max, weights, rescale what was
        // accumulated. 8-bit storage: the scores so far are q · code; times each key's
        // scale, q · k.
        let scaled = T::DTYPE.is_scaled();
        for h in 0..heads {
            let mut shift = 0;
            if scaled {
                for (t, len) in runs(src, t0, n) {
                    src.scales(h, 0, t, len, &mut sc.scales[0][t - t0..]);
                    src.scales(h, 1, t, len, &mut sc.scales[1][t - t0..]);
                }
                if shifts {
                    shift = value_shift(&sc.scales[1][..n], unit);
                }
            }
            for j in h * hr..(h + 1) * hr {
                let vis = visible(sc.limit[j], t0, n);
                let s = &mut sc.s[j * MAX_CHUNK..(j + 1) * MAX_CHUNK];
                if vis > 0 {
                    if scaled {
                        // The score times the scale first: the arithmetic's unit can be
                        // large ([`Simd::code_unit`]).
                        let key_unit = sc.key_unit[j];
                        for (x, k) in s[..vis].iter_mut().zip(&sc.scales[0]) {
                            *x = *x * k * key_unit;
                        }
                    }
                    let m_new = sc.m[j].max(simd.max(&s[..vis]));
                    let corr = if m_new == sc.m[j] {
                        1.0
                    } else {
                        math::exp(sc.m[j] - m_new)
                    };
                    let sum = simd.exp_shifted_sum(&mut s[..vis], m_new);
                    sc.l[j] = sc.l[j] * corr + sum;
                    // A larger shift than the row's so far: its accumulator follows (the
                    // first chunk's is the row's, its accumulator being zero).
                    let rescale = if !shifts {
                        corr
                    } else if sc.value_shift[j] == NO_SHIFT {
                        sc.value_shift[j] = shift;
                        corr
                    } else {
                        let grow = (shift - sc.value_shift[j]).max(0);
                        sc.value_shift[j] += grow;
                        times_pow2(corr, -grow)
                    };
                    if rescale != 1.0 {
                        simd.scale(&mut sc.acc[j * hd..(j + 1) * hd], rescale);
                    }
                    sc.m[j] = m_new;
                    if scaled {
                        // The weights meet codes of V: fold each value's scale into its
                        // weight (after the sum, which is over the weights themselves),
                        // then the arithmetic's unit, less the row's shift.
                        let (value_unit, more) = if !shifts {
                            (1.0, 1.0)
                        } else {
                            pow2_parts(exponent(unit) - sc.value_shift[j])
                        };
                        for (w, v) in s[..vis].iter_mut().zip(&sc.scales[1]) {
                            *w = *w * v * value_unit * more;
                        }
                    }
                }
                s[vis..n].fill(0.0);
            }
        }

        // Weighted values from the V tiles, four rows at a time (then two, then one):
        // gathered, the chunk's tokens of one head at a time; else `value_step` tokens
        // at a time, each run's tiles head after head.
        if gather {
            // Prefetches of the next K tiles: spread over the scores' steps (above), or
            // issued at each of the accumulation's own steps.
            let per_call = if paced > 0 {
                pf_keys
                    .lines()
                    .div_ceil(heads * hr.div_ceil(4) * n.div_ceil(paced))
            } else {
                0
            };
            for h in 0..heads {
                let mut tiles: [&[T]; MAX_CHUNK] = [&[]; MAX_CHUNK];
                let mut count = 0;
                for (t, len) in runs(src, t0, n) {
                    tiles[count] = src.tile(h, 1, t, len);
                    count += 1;
                }
                let limit = &sc.limit[h * hr..(h + 1) * hr];
                let (acc, s) = (&mut sc.acc[h * hr * hd..], &sc.s[h * hr * MAX_CHUNK..]);
                let v = Values::Runs(&tiles[..count], n);
                value_rows(simd, acc, s, limit, hd, t0, v, &mut || {
                    pf_keys.advance(pf_src, per_call)
                });
            }
        } else {
            let per_step = pf_keys.lines().div_ceil(heads * n.div_ceil(value_step));
            let before = sched.before(per_step);
            for (t, len) in runs(src, t0, n) {
                for h in 0..heads {
                    let v = src.tile(h, 1, t, len);
                    let limit = &sc.limit[h * hr..(h + 1) * hr];
                    for ts in (0..len).step_by(value_step) {
                        let m = (len - ts).min(value_step);
                        let vt = &v[ts * hd..(ts + m) * hd];
                        let acc = &mut sc.acc[h * hr * hd..];
                        let s = &sc.s[h * hr * MAX_CHUNK + t - t0 + ts..];
                        pf_keys.advance(pf_src, before);
                        if widen {
                            simd.widen::<T>(vt, &mut sc.wide[..m * hd]);
                            let wide = Values::Tile(&sc.wide[..m * hd], m);
                            value_rows(simd, acc, s, limit, hd, t + ts, wide, &mut || {});
                        } else {
                            let vt = Values::Tile(vt, m);
                            value_rows(simd, acc, s, limit, hd, t + ts, vt, &mut || {});
                        }
                        pf_keys.advance(pf_src, per_step - before);
                    }
                }
            }
        }
        t0 = next;
    }

    // Normalise. Every row sees at least one token, whose weight is exp(0) = 1.
    for j in 0..rows {
        let norm = if !shifts || sc.value_shift[j] == NO_SHIFT {
            1.0 / sc.l[j]
        } else {
            1.0 / sc.l[j] * pow2(sc.value_shift[j])
        };
        simd.scale(&mut sc.acc[j * hd..(j + 1) * hd], norm);
        if !widen {
            simd.leave_kernel_order::<T>(&mut sc.acc[j * hd..(j + 1) * hd], hd);
        }
    }
}

/// Multiplies a query row whose largest magnitude is below `2^top` (`0 <= top <= 126`)
/// by the power of two `2^e` that brings it to `[2^top, 2^(top + 1))` (`2^e` at most
/// `unit`, a power of two), and returns `unit / 2^e`: what the row's scores are
/// multiplied by after their keys' scales. A row of larger (or no finite nonzero)
/// magnitude is left alone: `unit` itself. O(q.len()).
///
/// For an arithmetic whose codes decode in a large unit ([`Simd::code_unit`]: FP8 in
/// AVX2, AVX512_BF16 or the AMX tiles, 2^-120 of their values): a product of a small
/// query and a small decoded key falls among the f32 subnormals, or to zero, where the
/// lifted one keeps its precision ([`Simd::query_exponent`] says how far). Exact: both
/// factors are powers of two, and the lifted row stays below `2^(top + 1)`.
#[inline]
fn lift_query(q: &mut [f32], unit: f32, top: i32) -> f32 {
    debug_assert!((0..=126).contains(&top));
    // The largest magnitude but NaN's, infinity included.
    let max = largest_magnitude(q, INFINITY_BITS + 1);
    if !(max > 0.0 && max < pow2(top)) {
        return unit;
    }
    // `max` is `1.m · 2^e` for its exponent `e` (-127 for a subnormal, where the
    // largest lift applies), so `2^(top - e)` brings it to `[2^top, 2^(top + 1))`.
    let lift = (top - exponent(max)).min(exponent(unit));
    let factor = pow2(lift);
    for x in q.iter_mut() {
        *x *= factor;
    }
    pow2(exponent(unit) - lift)
}

/// The exponent `e` of a positive finite `x = 1.m · 2^e` (-127 for zero and the
/// subnormals). O(1).
#[inline(always)]
fn exponent(x: f32) -> i32 {
    ((x.to_bits() >> 23) & 0xFF) as i32 - 127
}

/// [`Scratch::value_shift`] of a row that has accumulated nothing yet.
const NO_SHIFT: i32 = i32::MIN;

/// The largest product of a weight and a code the weights' shift aims at: 2^64, in the
/// middle of the f32 exponents.
const PRODUCT_EXPONENT: i32 = 64;

/// The shift (an exponent, -126 to 126) of the weights of a chunk whose value scales
/// are `scales`, given the arithmetic's unit: a weight (at most 1) times a value's
/// scale (below `2^(e + 1)` for the largest's exponent `e`) times `unit / 2^shift`
/// stays within 2^126, finite, and its product with a decoded code (below `2^9 /
/// unit`, FP8's largest) within about 2^64 where that allows, so that sums of such
/// products neither overflow nor fall among the subnormals (which AMX flushes to zero,
/// and where f32 arithmetic keeps fewer bits). Non-finite scales are left out (their
/// values are NaN whatever the unit). For AVX2's FP8 (unit 2^120) the first bound
/// decides: 0 for scales in `[32, 64)`, values of magnitude up to 28672. An exact power
/// of two: the results are those of shift 0 unless that one overflows or underflows.
/// O(scales.len()).
///
/// The attention loop keeps, per row, the largest shift of the chunks so far: its
/// accumulator is the weighted sum of values over 2^shift, rescaled (exactly) when the
/// shift grows, and multiplied back when normalised. A part accumulated before a
/// growth of `g` that is below 2^(g - 126) of the sum falls among the subnormals
/// there, next to values at least 2^(126 - g) times larger.
#[inline]
fn value_shift(scales: &[f32], unit: f32) -> i32 {
    // The largest finite magnitude.
    let e = exponent(largest_magnitude(scales, INFINITY_BITS)) + 1;
    (e + exponent(unit) - 126)
        .max(e + 9 - PRODUCT_EXPONENT)
        .clamp(-126, 126)
}

/// The bits of an f32 infinity's magnitude; a magnitude's bits above them are a NaN's.
const INFINITY_BITS: u32 = 0x7F80_0000;

/// The largest magnitude in `xs` among those whose bits (sign cleared) are below
/// `below` (`INFINITY_BITS`: the finite ones; one more: infinity too), 0 if none: the
/// bits order as the magnitudes do, so an integer maximum, which vectorises. O(xs.len()).
///
/// A float maximum with its NaN test does not vectorise: in `value_shift` it took 4% of
/// an FP8 decode in cache; in `lift_query` (whose rows the bf16 dot products lift since
/// December 2026) the FP8 decode of 1 x 256 tokens in cache on Zen 4 read at 0.93-0.97
/// of its rate before the lift (median 0.96; best rates, 6 alternating pairs), and with
/// this function 1.00 (median of 12 pairs).
#[inline]
fn largest_magnitude(xs: &[f32], below: u32) -> f32 {
    let max = xs
        .iter()
        .map(|x| x.to_bits() & 0x7FFF_FFFF)
        .map(|b| if b < below { b } else { 0 })
        .max()
        .unwrap_or(0);
    f32::from_bits(max)
}

/// `2^e` as two factors, each within `2^-126..=2^127`, for `-252 <= e <= 254`. O(1).
#[inline(always)]
fn pow2_parts(e: i32) -> (f32, f32) {
    (pow2(e / 2), pow2(e - e / 2))
}

/// `x · 2^e`, exact unless the result is subnormal, for `-252 <= e <= 254`. O(1).
#[inline(always)]
fn times_pow2(x: f32, e: i32) -> f32 {
    let (a, b) = pow2_parts(e);
    x * a * b
}

/// `2^e` for `-126 <= e <= 127`. O(1).
#[inline(always)]
fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((127 + e) as u32) << 23)
}

/// Tokens `t..t + n` that a row seeing tokens `0..limit` sees, as a count.
#[inline(always)]
fn visible(limit: usize, t: usize, n: usize) -> usize {
    limit.saturating_sub(t).min(n)
}

/// Scores of every row (`limit.len()` of them, `q` holding them `hd` apart) against the
/// `m` keys `k` of context tokens `t..t + m`, into `s[j * MAX_CHUNK..]` (`s` starts at
/// the step's offset in the chunk): four rows at a time (each key vector loaded once for
/// four rows). Scores past a row's limit are computed for its group's widest row and
/// zeroed after the exponentials. `passes`: the task makes several passes over each
/// stored vector (see [`Simd::scores4`]). O(rows × m × hd).
///
/// A last group of two or three rows is one four-row pass too: it also writes the
/// scores of the one or two rows after `limit`'s, for the same tokens. In a task of
/// several KV heads those are the next head's first rows, whose own pass comes later in
/// the same run and overwrites them (the heads have the same rows, so it covers the
/// same tokens); after the last head they are `Scratch`'s spare rows. `q` and `s` must
/// hold those rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn score_rows<U: Element, V: Simd>(
    simd: V,
    q: &[f32],
    s: &mut [f32],
    limit: &[usize],
    hd: usize,
    t: usize,
    k: &[U],
    m: usize,
    passes: bool,
) {
    let rows = limit.len();
    let mut j = 0;
    while j < rows {
        let group = (rows - j).min(4);
        let cnt = visible(limit[j + group - 1], t, m);
        let st = &mut s[j * MAX_CHUNK..];
        if cnt > 0 && group == 1 {
            simd.scores1(&q[j * hd..(j + 1) * hd], k, hd, cnt, st);
        } else if cnt > 0 {
            simd.scores4(&q[j * hd..(j + 4) * hd], k, hd, cnt, st, MAX_CHUNK, passes);
        }
        j += group;
    }
}

/// The values one accumulation call reads: `Tile(v, m)`, `m` tokens stored one after
/// another; or `Runs(runs, n)`, `n` tokens in runs of such tiles, wherever each run is
/// stored.
#[derive(Clone, Copy)]
enum Values<'a, U> {
    Tile(&'a [U], usize),
    Runs(&'a [&'a [U]], usize),
}

impl<U> Values<'_, U> {
    /// How many tokens.
    #[inline(always)]
    fn len(&self) -> usize {
        match self {
            Values::Tile(_, m) | Values::Runs(_, m) => *m,
        }
    }
}

/// Weighted values of the tokens `v` (context tokens `t..t + v.len()`) added into every
/// row's accumulator (`acc[j * hd..]`), with the weights `s[j * MAX_CHUNK..]` (`s`
/// starts at the step's offset in the chunk): four rows at a time, then two, then one.
/// `step` goes to [`Simd::accumulate_runs`]. O(rows × m × hd).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn value_rows<U: Element, V: Simd, F: FnMut()>(
    simd: V,
    acc: &mut [f32],
    s: &[f32],
    limit: &[usize],
    hd: usize,
    t: usize,
    v: Values<'_, U>,
    step: &mut F,
) {
    let (rows, m) = (limit.len(), v.len());
    let weights = |j: usize| &s[j * MAX_CHUNK..j * MAX_CHUNK + m];
    let mut j = 0;
    while j + 4 <= rows {
        let cnt = visible(limit[j + 3], t, m);
        if cnt > 0 {
            let p = [weights(j), weights(j + 1), weights(j + 2), weights(j + 3)];
            let a = &mut acc[j * hd..(j + 4) * hd];
            match v {
                Values::Tile(v, _) => simd.accumulate4(a, p, v, hd, cnt),
                Values::Runs(v, _) => simd.accumulate_runs(a, p, v, cnt, hd, step),
            }
        }
        j += 4;
    }
    while j < rows {
        let pair = j + 1 < rows;
        let cnt = visible(limit[if pair { j + 1 } else { j }], t, m);
        if cnt > 0 && pair {
            let a = &mut acc[j * hd..(j + 2) * hd];
            match v {
                Values::Tile(v, _) => simd.accumulate2(a, weights(j), weights(j + 1), v, hd, cnt),
                Values::Runs(v, _) => {
                    simd.accumulate_runs(a, [weights(j), weights(j + 1)], v, cnt, hd, step)
                }
            }
        } else if cnt > 0 {
            let a = &mut acc[j * hd..(j + 1) * hd];
            match v {
                Values::Tile(v, _) => simd.accumulate1(a, weights(j), v, hd, cnt),
                Values::Runs(v, _) => simd.accumulate_runs(a, [weights(j)], v, cnt, hd, step),
            }
        }
        j += if pair { 2 } else { 1 };
    }
}

#[cfg(test)]
mod tests {
    //! Every arithmetic implementation this CPU can run, on the same tasks, against a
    //! plain f64 computation (the integration tests only reach the fastest one).
    use super::*;

    /// K/V `[heads][tokens][head_dim]` stored as `T`, with chunks of at most `run`
    /// tokens.
    struct Flat<T> {
        k: Vec<T>,
        v: Vec<T>,
        /// Per-token scales of K and V, `[heads][tokens]` (8-bit storage; ones
        /// otherwise).
        scales: [Vec<f32>; 2],
        hd: usize,
        ctx: usize,
        run: usize,
    }

    impl<T> KvSource<T> for Flat<T> {
        fn run(&self, t0: usize) -> usize {
            self.run - t0 % self.run
        }
        fn tile(&self, head: usize, kv: usize, t0: usize, n: usize) -> &[T] {
            let src = if kv == 0 { &self.k } else { &self.v };
            &src[(head * self.ctx + t0) * self.hd..][..n * self.hd]
        }
        fn scales(&self, head: usize, kv: usize, t0: usize, n: usize, out: &mut [f32]) {
            out[..n].copy_from_slice(&self.scales[kv][head * self.ctx + t0..][..n]);
        }
    }

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// `x` (`[tokens][hd]`) in storage `T`, and the per-token scales (8-bit storage:
    /// each row's largest magnitude onto the code's; ones otherwise).
    fn stored<T: Element>(x: &[f32], hd: usize) -> (Vec<T>, Vec<f32>) {
        let Some(code) = crate::quant::Code::of(T::DTYPE) else {
            return (
                x.iter().map(|&v| T::from_f32(v)).collect(),
                vec![1.0; x.len() / hd],
            );
        };
        let mut codes = Vec::with_capacity(x.len());
        let mut scales = Vec::new();
        let mut row_codes = vec![0u8; hd];
        for row in x.chunks(hd) {
            let s = code.quantize_row(row, &mut row_codes);
            scales.push(s);
            codes.extend(row_codes.iter().map(|&c| T::from_f32(code.decode(c))));
        }
        (codes, scales)
    }

    fn check_type<T: Element, V: Simd>(simd: V) {
        check_type_at::<T, V>(simd, [1.0; 4]);
    }

    /// [`check_type`] with the queries, keys and values multiplied by `mag[..3]`, and
    /// the values of the second half of the context by `mag[3]` too (the tolerance by
    /// the values' largest factor).
    fn check_type_at<T: Element, V: Simd>(simd: V, mag: [f32; 4]) {
        let scaled = |x: Vec<f32>, m: f32| -> Vec<f32> { x.into_iter().map(|x| x * m).collect() };
        // `[heads][ctx][hd]`: the tokens from `ctx / 2` on times `m`.
        let ramp = |x: Vec<f32>, hd: usize, ctx: usize, m: f32| -> Vec<f32> {
            let far = |i: usize| (i / hd) % ctx >= ctx / 2;
            x.into_iter()
                .enumerate()
                .map(|(i, x)| if far(i) { x * m } else { x })
                .collect()
        };
        // (head dim, context, queries, group, run length, KV heads per task).
        let shapes = [
            (7, 9, 9, 1, 1, 1),
            (12, 20, 1, 3, 7, 3),
            (12, 20, 3, 3, 7, 1),
            (40, 50, 5, 3, 7, 1),
            (128, 77, 1, 4, 16, 1),
            (64, 130, 3, 8, 32, 1),
            (256, 20, 2, 2, 64, 1),
            // Three rows (a pair, then one) and one row, at head dims of 32 multiples
            // that leave a last group of 32 (the bf16 in-lane path's tail).
            (96, 40, 1, 3, 16, 1),
            (32, 33, 1, 1, 8, 1),
            // Five rows and more: more than one pass takes (8-bit storage without
            // AVX-512 is widened per step), among them decode of groups of 7 and 8.
            (64, 21, 5, 1, 16, 1),
            (64, 50, 1, 7, 16, 1),
            (128, 77, 1, 8, 16, 1),
            // Decode tasks of several KV heads: 4 × 4 rows, 5 × 3, 16 × 1, 8 × 2 (two
            // query tokens of one head each).
            (128, 77, 1, 4, 16, 4),
            (96, 40, 1, 3, 16, 5),
            (32, 70, 1, 1, 16, 16),
            (64, 45, 2, 1, 8, 8),
            // Runs of odd lengths, so that a gathered accumulation (8-bit storage in
            // the dot-product extensions) pairs tokens of two runs.
            (64, 100, 1, 4, 7, 2),
            (128, 90, 2, 2, 5, 1),
            // Two heads a task of 8, 6 and 5 rows each (decode of groups of 5 to 8).
            (64, 45, 1, 8, 8, 2),
            (64, 33, 1, 6, 7, 2),
            (96, 40, 1, 5, 16, 2),
            // Four rows at head dims past a multiple of 16 and of 8 (the four-row
            // accumulation's narrower loops and scalar tail).
            (40, 30, 1, 4, 16, 1),
            (12, 30, 2, 2, 5, 1),
        ];
        // Miri runs two tiny shapes, which still cover partial runs, a task of several
        // heads and one of five rows per head, widened per step for 8-bit storage (the routine is safe code: what Miri adds here
        // is the byte views of the stored tiles; the two small shapes above took about
        // 50 s interpreted).
        let shapes: &[_] = if cfg!(miri) {
            &[(8, 6, 1, 2, 3, 2), (8, 7, 5, 1, 4, 1)]
        } else {
            &shapes[..]
        };
        // Int8 scores in integer arithmetic (AVX2's `vpmaddwd`, when the task is not
        // widened) round the queries to 16-bit fixed point, 2^-16 of each row's
        // largest: up to 3.3e-5 off on these shapes (the f32 arithmetics: 2.5e-7); an
        // indexing or masking mistake is off by the order of the outputs (0.1). FP8 in
        // bf16 dot products rounds each query element and weight to 2^-9 of itself:
        // its scores of up to 256 products move the weights, up to 2.2e-3 of the outputs
        // here, within four times that rounding.
        let base: f64 = if T::DTYPE == kvpage_core::DType::Int8 {
            1e-4
        } else {
            1e-5
        };
        let mut taken = 0;
        for &(hd, ctx, queries, group, run, heads) in shapes {
            let rounding = 4.0 * simd.f32_side_rounding::<T>(hd);
            let tolerance = base.max(rounding) * f64::from(mag[2] * mag[3].max(1.0));
            let ((k, ks), (v, vs)) = (
                stored::<T>(&scaled(values(heads * ctx * hd, 1), mag[1]), hd),
                stored::<T>(
                    &ramp(scaled(values(heads * ctx * hd, 2), mag[2]), hd, ctx, mag[3]),
                    hd,
                ),
            );
            let src: Flat<T> = Flat {
                k,
                v,
                scales: [ks, vs],
                hd,
                ctx,
                run,
            };
            // The values the storage holds: code times its row's scale.
            let exact = |x: &[T], s: &[f32]| -> Vec<f64> {
                x.iter()
                    .enumerate()
                    .map(|(i, c)| f64::from(c.to_f32()) * f64::from(s[i / hd]))
                    .collect()
            };
            let (k, v) = (exact(&src.k, &src.scales[0]), exact(&src.v, &src.scales[1]));
            let q_heads = heads * group;
            let q = scaled(values(queries * q_heads * hd, 3), mag[0]);
            let all_rows = queries * group;
            let mut sc = Scratch::new();
            let tile = |row0: usize| {
                (row0 < all_rows).then(|| RowTask {
                    q: &q,
                    context_len: ctx,
                    queries,
                    group,
                    q_heads,
                    kv_head: 0,
                    heads,
                    row0,
                    head_rows: (MAX_ROWS / heads).min(all_rows - row0),
                    head_dim: hd,
                    scale: 0.4,
                })
            };
            let mut row0 = 0;
            // Each tile prefetches the next one's first chunk (the workers' order).
            while let Some(task) = tile(row0) {
                let head_rows = task.head_rows;
                assert!(
                    heads == 1 || head_rows == all_rows,
                    "a shape of several heads is one task"
                );
                if !simd.takes_rows::<T>(hd, head_rows) {
                    // Another arithmetic's task (checked in that one's test).
                    row0 += head_rows;
                    continue;
                }
                taken += 1;
                let next = tile(row0 + head_rows);
                let ahead = next.as_ref().map(|task| Ahead { task, src: &src });
                attend_body(simd, &task, &src, ahead, row0 > 0, &mut sc);
                for j in 0..task.rows() {
                    let (qi, qh) = task.row(j);
                    let h = qh / group;
                    assert_eq!(h, j / head_rows);
                    let (k, v) = (&k[h * ctx * hd..], &v[h * ctx * hd..]);
                    let qr = &q[(qi * q_heads + qh) * hd..][..hd];
                    let limit = ctx - queries + qi + 1;
                    let s: Vec<f64> = (0..limit)
                        .map(|t| {
                            0.4 * (0..hd)
                                .map(|d| f64::from(qr[d]) * k[t * hd + d])
                                .sum::<f64>()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let total: f64 = w.iter().sum();
                    for d in 0..hd {
                        let want: f64 =
                            (0..limit).map(|t| w[t] * v[t * hd + d]).sum::<f64>() / total;
                        let got = f64::from(sc.acc[j * hd + d]);
                        assert!(
                            (got - want).abs() < tolerance,
                            "{} {mag:?} hd {hd} heads {heads} row {j} dim {d}: {got} vs {want}",
                            core::any::type_name::<T>()
                        );
                    }
                }
                row0 += head_rows;
            }
        }
        assert!(taken > 0, "no task was checked");
    }

    /// The scratch lives on each worker's stack (an embedder's threads may have small
    /// ones): the steps of [`PASS_STEP`] tokens grew its widening buffer to 16 KiB.
    #[test]
    fn scratch_stays_within_64_kib() {
        let size = core::mem::size_of::<Scratch>();
        assert!(size <= 64 << 10, "{size} bytes");
    }

    /// The two ranges a large code unit needs: a query row below 1 (or `2^top`) lifted
    /// into [1, 2) (or `[2^top, 2^(top + 1))`) by at most the unit, with what is left
    /// of the unit returned; a shift from 0 up to what keeps the largest scale finite,
    /// NaN scales left out.
    #[test]
    fn large_code_units_stay_in_range() {
        let unit = pow2(120);
        let mut row = [0.3f32, -0.1, 0.0];
        assert_eq!(lift_query(&mut row, unit, 0), pow2(118));
        assert_eq!(row, [1.2, -0.4, 0.0]);
        let mut row = [3.0f32, 0.001];
        assert_eq!(lift_query(&mut row, unit, 0), unit);
        assert_eq!(row, [3.0, 0.001]);
        let tiny = f32::from_bits(1);
        let mut row = [tiny, f32::NAN];
        assert_eq!(lift_query(&mut row, unit, 0), 1.0);
        assert_eq!(row[0], tiny * unit);
        // Lifted higher (FP8 with AVX512_BF16: 2^64), by at most the unit.
        let mut row = [0.3f32, -0.1];
        assert_eq!(lift_query(&mut row, unit, 64), pow2(54));
        assert_eq!(row, [0.3 * pow2(66), -0.1 * pow2(66)]);
        let mut row = [pow2(64), 1.0];
        assert_eq!(lift_query(&mut row, unit, 64), unit);
        assert_eq!(row, [pow2(64), 1.0]);
        let mut row = [1e-30f32, 3e-31];
        assert_eq!(lift_query(&mut row, unit, 64), 1.0);
        assert_eq!(row, [1e-30 * unit, 3e-31 * unit]);

        assert_eq!(value_shift(&[63.9, 1.0, 0.0], unit), 0);
        assert_eq!(value_shift(&[64.0], unit), 1);
        assert_eq!(value_shift(&[32.0], unit), 0);
        assert_eq!(value_shift(&[31.9], unit), -1);
        assert_eq!(value_shift(&[f32::NAN, 2.0, f32::INFINITY], unit), -4);
        // No finite scale (nothing to weigh), and the smallest: the least shift.
        assert_eq!(value_shift(&[], unit), -126);
        assert_eq!(value_shift(&[f32::from_bits(1)], unit), -126);
        // A small unit: the products' bound decides (2^64 for the largest code).
        assert_eq!(value_shift(&[1.0], 256.0), 1 + 9 - 64);
        assert_eq!(value_shift(&[1e30], 256.0), 100 + 9 - 64);
        assert_eq!(
            (pow2_parts(-252), pow2_parts(254)),
            ((pow2(-126), pow2(-126)), (pow2(127), pow2(127)))
        );
        assert_eq!(times_pow2(3.0, -130), 3.0 * pow2(-65) * pow2(-65));
        let largest = f32::MAX / 448.0;
        let shift = value_shift(&[largest], unit);
        // Within 2^127, and three steps short of the least shift that keeps it finite.
        assert!(largest * (unit * pow2(-shift)) < pow2(127));
        assert!((largest * (unit * pow2(3 - shift))).is_infinite());
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn schedules_of_lines_fit_the_lines_within_the_bounds() {
        use crate::dtype::Int8;
        let steps = |s: Schedule| (s.score_step, s.value_step);
        // 16 lines of K and 32 of V a step: f32 rows of 128 are 8 lines, f16 4, int8 2.
        assert_eq!(steps(Schedule::of_lines::<f32>(128, 16, 32, true)), (2, 4));
        assert_eq!(
            steps(Schedule::of_lines::<half::f16>(128, 16, 32, true)),
            (4, 8)
        );
        assert_eq!(steps(Schedule::of_lines::<Int8>(128, 16, 32, true)), (4, 8));
        // Bounded: at most the longest steps, at least one token of scores and two of
        // values; a row of a partial line counts as a whole line.
        assert_eq!(steps(Schedule::of_lines::<f32>(64, 16, 32, true)), (4, 8));
        assert_eq!(steps(Schedule::of_lines::<f32>(256, 16, 32, true)), (1, 2));
        assert_eq!(steps(Schedule::of_lines::<f32>(1024, 16, 32, true)), (1, 2));
        assert_eq!(steps(Schedule::of_lines::<Int8>(7, 16, 32, true)), (4, 8));
        assert_eq!(steps(Schedule::of_lines::<f32>(20, 1, 1, true)), (1, 2));
        // A split step issues the smaller half (none of one line) first.
        let split = Schedule::of_lines::<f32>(128, 16, 32, true);
        assert_eq!(
            (split.before(17), split.before(1), split.before(0)),
            (8, 0, 0)
        );
        assert_eq!(Schedule::LONGEST.before(17), 0);
        assert_eq!(steps(Schedule::LONGEST), (SCORE_STEP, VALUE_STEP));
    }

    fn check<V: Simd>(simd: V) {
        check_type::<f32, V>(simd);
        check_type::<half::f16, V>(simd);
        check_type::<half::bf16, V>(simd);
        check_type::<crate::dtype::Int8, V>(simd);
        check_type::<crate::dtype::Fp8E4m3, V>(simd);
        // Far from 1, where only f32 and the 8-bit types (whose scales take the
        // magnitude) hold the values: tiny queries against huge keys and the other way
        // round (the scores stay near 1), huge keys against queries near 1 (one token
        // takes all the weight), values near the largest and smallest normal
        // magnitudes, and values that grow tenfold, and 10^10-fold, halfway through
        // the context. An arithmetic that decodes codes in a unit far from 1 (AVX2's
        // FP8, 2^-120) must neither lose the scores' precision nor overflow.
        if !cfg!(miri) {
            for mag in [
                [1e-30, 1e30, 1.0, 1.0],
                [1e30, 1e-30, 1.0, 1.0],
                [1.0, 1e30, 1.0, 1.0],
                [1.0, 1.0, 1e36, 1.0],
                [1.0, 1.0, 1e-34, 1.0],
                [1.0, 1.0, 1e4, 10.0],
                [1.0, 1.0, 1e20, 1e10],
            ] {
                check_type_at::<f32, V>(simd, mag);
                check_type_at::<crate::dtype::Int8, V>(simd, mag);
                check_type_at::<crate::dtype::Fp8E4m3, V>(simd, mag);
            }
        }
    }

    #[test]
    fn portable_matches_f64() {
        check(math::Portable);
    }

    /// AVX2 with both of FP8's routes, whichever this CPU's vendor takes: through f16
    /// (in units of 2^8) and by moving a code's bits into an f32 (2^120).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_matches_f64() {
        match crate::kernels::avx2::Avx2::detect() {
            Some(simd) => {
                check(simd.with_fp8_route(true));
                check(simd.with_fp8_route(false));
            }
            None => eprintln!("skipped: AVX2 + FMA + F16C absent (or capped by the environment)"),
        }
    }

    /// AMX tiles for bf16, FP8 and (where the CPU has AMX-INT8) int8 (the other types
    /// go to AVX-512 unchanged), on the shapes of four or eight rows per KV head that
    /// the tiles take; FP8 and int8 at the far magnitudes too, where the tiles'
    /// flushing of subnormals (FP8) or the weights' fixed point (int8) would lose the
    /// values but for the weights' shift ([`value_shift`]).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn amx_matches_f64() {
        match AmxBf16::detect() {
            Some(simd) => {
                simd.begin();
                check(simd);
                simd.end();
            }
            None => eprintln!(
                "skipped: AMX-BF16 absent or not granted by the OS (or capped by the \
                 environment)"
            ),
        }
    }

    /// AVX-512 with its dot-product extensions (int8 on VNNI; FP8 on AVX512_BF16, also
    /// on Intel cores, whose kernels do not take it), the far magnitudes included.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_dot_matches_f64() {
        use crate::kernels::dot::{Avx512Dot, Bf16Dot, Vnni};
        match Avx512Dot::<Vnni>::supported() {
            Some(simd) => check(simd),
            None => eprintln!("skipped: AVX-512 VNNI absent (or capped by the environment)"),
        }
        match Avx512Dot::<Bf16Dot>::supported() {
            Some(simd) => check(simd),
            None => eprintln!("skipped: AVX512_BF16 absent (or capped by the environment)"),
        }
    }

    /// AVX-512F with both of FP8's routes, as [`avx2_matches_f64`].
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_matches_f64() {
        match crate::kernels::avx512::Avx512::detect() {
            Some(simd) => {
                check(simd.with_fp8_route(true));
                check(simd.with_fp8_route(false));
            }
            None => eprintln!("skipped: AVX-512F absent (or capped by the environment)"),
        }
    }
}
