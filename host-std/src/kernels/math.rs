//! Vector arithmetic of the attention inner loops, behind the [`Simd`] trait: the
//! portable implementation here ([`Portable`]: lane arrays the compiler vectorizes,
//! which is what aarch64 and every architecture but x86-64 run), and the x86-64 ones in
//! [`super::avx2`], [`super::avx512`] and beyond. Also the branch-free scalar `exp`
//! they use.

use crate::dtype::Element;
use kvpage_core::DType;

/// The arithmetic of one chunk of attention, implemented per instruction set. Every
/// method is O(its inputs). Queries and accumulators are `f32`; keys and values are read
/// in their storage type `T` and widened as they are loaded.
pub(crate) trait Simd: Copy {
    /// `s[r * s_stride + t] = q_r · k_t` for the four rows `q_r = q[r * hd..(r + 1) * hd]`
    /// and tokens `t < n` (`k_t = k[t * hd..(t + 1) * hd]`). `passes`: the call is a step
    /// of a task that makes several passes over each stored vector (more than four rows
    /// per KV head: chunked prefill, wide groups), which its arithmetic bounds, so an
    /// implementation may take several tokens per query vector loaded (its steps are
    /// [`Simd::pass_schedule`]'s); otherwise a decode step, bound by memory.
    #[allow(clippy::too_many_arguments)]
    fn scores4<T: Element>(
        self,
        q: &[f32],
        k: &[T],
        hd: usize,
        n: usize,
        s: &mut [f32],
        s_stride: usize,
        passes: bool,
    );
    /// `s[t] = q · k_t` for tokens `t < n`.
    fn scores1<T: Element>(self, q: &[f32], k: &[T], hd: usize, n: usize, s: &mut [f32]);
    /// `acc_r[d] += Σ_{t<n} p_r[t] * v_t[d]` for the two rows `acc_r = acc[r * hd..]`
    /// with weights `p0`, `p1`.
    fn accumulate2<T: Element>(
        self,
        acc: &mut [f32],
        p0: &[f32],
        p1: &[f32],
        v: &[T],
        hd: usize,
        n: usize,
    );
    /// `acc_r[d] += Σ_{t<n} p[r][t] * v_t[d]` for the four rows `acc_r = acc[r * hd..]`:
    /// each stored value is widened once for the four rows. By default two
    /// [`Simd::accumulate2`] calls (which widen each value twice).
    #[inline(always)]
    fn accumulate4<T: Element>(
        self,
        acc: &mut [f32],
        p: [&[f32]; 4],
        v: &[T],
        hd: usize,
        n: usize,
    ) {
        accumulate4_by_pairs(self, acc, p, v, hd, n);
    }
    /// `acc[d] += Σ_{t<n} p[t] * v_t[d]`.
    fn accumulate1<T: Element>(self, acc: &mut [f32], p: &[f32], v: &[T], hd: usize, n: usize);
    /// Whether the arithmetic takes a task over storage `T` with head dim `hd` and
    /// `head_rows` query rows per KV head. True by default; AMX's tiles take bf16 rows
    /// only four at a time ([`super::amx`]). O(1).
    #[inline(always)]
    fn takes_rows<T: Element>(self, hd: usize, head_rows: usize) -> bool {
        let _ = (hd, head_rows);
        true
    }
    /// Puts rows of `hd` floats (the scaled queries: all of a task's rows, a head's rows
    /// consecutive) into the form this arithmetic reads for storage `T`: an order of
    /// dimensions, fixed-point codes with their scale (int8 storage on AVX-512 VNNI), or
    /// tiles of four rows (bf16 in AMX). The accumulators come out in this arithmetic's
    /// order of dimensions, until [`Simd::leave_kernel_order`]. Identity by default.
    /// O(rows.len()).
    #[inline(always)]
    fn enter_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        let _ = (rows, hd);
    }
    /// Puts accumulated rows back into dimension order (inverse of
    /// [`Simd::enter_kernel_order`]). O(rows.len()).
    #[inline(always)]
    fn leave_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        let _ = (rows, hd);
    }
    /// Whether [`Simd::accumulate_runs`] is this arithmetic's form of the accumulation
    /// for storage `T` with head dim `hd`, in a task of one pass over each stored
    /// vector or of several (`passes`: more than four rows per KV head): one whose
    /// calls carry a fixed cost (putting the weights in its form, scaling its sums into
    /// the accumulators), which the attention loop then calls once per chunk and KV
    /// head, with all the chunk's runs. False by default. O(1).
    ///
    /// Not for the f32 FMAs of the AVX-512 path: f16 gathered on the 2-vCPU Zen 4, its
    /// 16 accumulators in registers across the chunk's runs and the next K tiles'
    /// prefetches issued after each run of 16 tokens, took 0.97–0.98 of the time in
    /// cache (1 × 256 tokens, one thread) and 1.00–1.14 out of it (32 × 2048 and
    /// 128 × 512, two threads; five alternating pairs): the longer arithmetic between
    /// prefetch bursts costs more than reloading the accumulators each value step saves.
    #[inline(always)]
    fn gathers_values<T: Element>(self, hd: usize, passes: bool) -> bool {
        let _ = (hd, passes);
        false
    }
    /// `acc_r[d] += Σ_{t<n} p[r][t] * v_t[d]` for the `R <= 4` rows `acc_r = acc[r *
    /// hd..]`, over the first `n` tokens of `runs` (each run whole vectors of `hd`
    /// elements stored one after another, the runs in token order; [`first_tokens`]).
    /// By default one [`Simd::accumulate1`] per row and run. An arithmetic whose
    /// [`Simd::gathered_step`] is not zero calls `step` after each that many tokens
    /// (the attention loop prefetches in it); the others never call it.
    /// O(R × n × hd).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn accumulate_runs<T: Element, const R: usize, F: FnMut()>(
        self,
        acc: &mut [f32],
        p: [&[f32]; R],
        runs: &[&[T]],
        n: usize,
        hd: usize,
        step: &mut F,
    ) {
        let _ = step;
        for (t, run, len) in first_tokens(runs, n, hd) {
            for (r, pr) in p.iter().enumerate() {
                self.accumulate1(&mut acc[r * hd..(r + 1) * hd], &pr[t..], run, hd, len);
            }
        }
    }
    /// Tokens per chunk of the attention loop for storage `T` with head dim `hd`, at
    /// most [`super::online::MAX_CHUNK`]: the softmax's bookkeeping, and a gathered
    /// accumulation's fixed cost, are paid once per chunk. By default
    /// [`super::online::CHUNK`]. O(1).
    #[inline(always)]
    fn chunk_tokens<T: Element>(self, hd: usize) -> usize {
        let _ = hd;
        super::online::CHUNK
    }
    /// Tokens between two calls of [`Simd::accumulate_runs`]'s `step` for storage `T`
    /// with head dim `hd`, or 0 if it never calls it: the attention loop then
    /// prefetches the next chunk's keys during the scores. O(1).
    #[inline(always)]
    fn gathered_step<T: Element>(self, hd: usize) -> usize {
        let _ = hd;
        0
    }
    /// Maximum of `x` (`-inf` when empty).
    fn max(self, x: &[f32]) -> f32;
    /// `x[i] = exp(x[i] - shift)` (with [`exp`]'s accuracy), returns `Σ x[i]`.
    fn exp_shifted_sum(self, x: &mut [f32], shift: f32) -> f32;
    /// `x[i] *= c`.
    fn scale(self, x: &mut [f32], c: f32);
    /// Widens stored elements to f32 ([`Element::widen`], which it is by default;
    /// 8-bit codes in this arithmetic's unit, [`Simd::code_unit`]). O(src.len()).
    #[inline(always)]
    fn widen<T: Element>(self, src: &[T], dst: &mut [f32]) {
        T::widen(src, dst);
    }
    /// The unit in which this arithmetic decodes the codes of 8-bit storage `T`: its
    /// scores, accumulations and widening see a code's value divided by it, and the
    /// attention loop applies it to each score after the key's scale, and to each
    /// weight after the value's scale (see [`super::online`]'s `lift_query` and
    /// `value_shift`, which keep both in range). A power of two, at most 2^120, so the
    /// results are those of unit 1 bit for bit unless a product falls among the
    /// subnormals. 1 by default. O(1).
    #[inline(always)]
    fn code_unit<T: Element>(self) -> f32 {
        1.0
    }
    /// Where the attention loop lifts a query row whose codes' unit is not 1: a row
    /// whose largest magnitude is below `2^e` is multiplied by the power of two that
    /// brings it into `[2^e, 2^(e + 1))`, by at most the unit (see [`super::online`]'s
    /// `lift_query`). 0 by default: the row into `[1, 2)`. An arithmetic whose products
    /// of the query with the codes flush subnormals to zero may ask for more. O(1).
    #[inline(always)]
    fn query_exponent<T: Element>(self) -> i32 {
        0
    }
    /// Whether the attention loop shifts the weights that meet the codes of 8-bit
    /// storage `T` by a power of two per row ([`super::online`]'s `value_shift`), which
    /// keeps a weight times its value's scale near 2^55 whatever the values'
    /// magnitudes: where the unit is not 1 (by default), and for an arithmetic that puts
    /// the weights in fixed point, whose `32767 / max` overflows for weights below
    /// about 1e-34 (values of that magnitude). O(1).
    #[inline(always)]
    fn shifts_weights<T: Element>(self) -> bool {
        self.code_unit::<T>() != 1.0
    }
    /// Whether the attention loop should widen storage `T` to f32 once per step, into
    /// its scratch (zeroed once per call), so that this arithmetic reads f32 rather
    /// than the storage itself, in a task of one pass over each stored vector or of
    /// several (`passes`: more than four rows per KV head, each pass of four rows
    /// reading the storage again). By default, for the 8-bit storage types in tasks of
    /// several passes, whose widening costs this arithmetic most; an arithmetic with
    /// cheap widening or native 8-bit dot products says never, and one that would
    /// widen anyway may say always ([`Portable`]). O(1).
    ///
    /// Measured (paired, one thread in cache or two out of cache, 8 KV heads, head dim
    /// 128), passes over the storage against widening: AVX2 + FMA, decode of 64 query
    /// heads f16 0.93, bf16 0.86, int8 1.05, chunked prefill f16 0.99, bf16 0.87, int8
    /// 1.06; portable (before its rewrite for NEON, which widens f16 and 8-bit storage in
    /// every task: [`Portable::widens_storage`]), decode f16 0.95, int8 1.23, prefill
    /// f16 1.00, int8 1.28.
    #[inline(always)]
    fn widens_storage<T: Element>(self, passes: bool) -> bool {
        passes && T::DTYPE.is_scaled()
    }
    /// The relative rounding this arithmetic applies to each query element and softmax
    /// weight before its products with storage `T` at head dim `hd` (FP8 in bf16 dot
    /// products: `2^-9`), for the kernel tests' bounds; 0 where the f32 side stays f32
    /// (or, as int8's fixed point, is bounded per storage type). O(1).
    #[cfg(test)]
    fn f32_side_rounding<T: Element>(self, hd: usize) -> f64 {
        let _ = hd;
        0.0
    }
    /// How the attention loop paces the prefetches of a decode task over storage `T`
    /// with head dim `hd`: the tokens per step of the scores and of the value
    /// accumulation (unless [`Simd::gathers_values`]), each step prefetching as many
    /// lines as it reads (the scores this chunk's values, the accumulation the next
    /// chunk's keys), and whether a step's prefetches are split
    /// around its arithmetic. Shorter steps mean shorter bursts of prefetches, and more
    /// of the arithmetic's fixed cost per step (loading and storing its accumulators).
    /// By default [`super::online::Schedule::LONGEST`]. O(1).
    #[inline(always)]
    fn schedule<T: Element>(self, hd: usize) -> super::online::Schedule {
        let _ = hd;
        super::online::Schedule::LONGEST
    }
    /// The schedule of a task of several passes over each stored vector (more than four
    /// rows per KV head: wide groups, chunked prefill), bound by the arithmetic. By
    /// default [`super::online::Schedule::LONGEST`]. O(1).
    #[inline(always)]
    fn pass_schedule(self) -> super::online::Schedule {
        super::online::Schedule::LONGEST
    }
}

/// Widens `src` into `dst` (as far as the shorter goes) as each element's value over
/// `unit` (a power of two, so exact unless the quotient is subnormal): the
/// [`Simd::widen`] of an arithmetic that reads 8-bit codes in a unit other than 1.
/// O(src.len()).
#[cfg(target_arch = "x86_64")]
pub(super) fn widen_in_unit<T: Element>(src: &[T], dst: &mut [f32], unit: f32) {
    let inverse = 1.0 / unit;
    for (d, x) in dst.iter_mut().zip(src) {
        *d = x.to_f32() * inverse;
    }
}

/// `q[from..] · k[from..]` in scalar f32 arithmetic: the dimensions past a vector
/// loop's last whole vector. Out of line, and called only where such dimensions exist:
/// inlined as a closure per score, its environment was rebuilt on the stack for every
/// score, even at head dims with none (a fifth of the f16 decode on AVX-512, half of
/// the AVX2 scores' instructions). O(k.len() - from).
#[cfg(target_arch = "x86_64")]
#[inline(never)]
pub(super) fn tail_dot<T: Element>(q: &[f32], k: &[T], from: usize) -> f32 {
    q[from..]
        .iter()
        .zip(&k[from..])
        .map(|(a, b)| a * b.to_f32())
        .sum()
}

/// [`Simd::accumulate4`] as two [`Simd::accumulate2`] calls (rows 0-1, then 2-3). O(n ×
/// hd).
#[inline(always)]
pub(crate) fn accumulate4_by_pairs<V: Simd, T: Element>(
    simd: V,
    acc: &mut [f32],
    p: [&[f32]; 4],
    v: &[T],
    hd: usize,
    n: usize,
) {
    let (a01, a23) = acc[..4 * hd].split_at_mut(2 * hd);
    simd.accumulate2(a01, p[0], p[1], v, hd, n);
    simd.accumulate2(a23, p[2], p[3], v, hd, n);
}

/// The first `n` tokens of `runs` (runs of whole vectors of `hd` elements, in token
/// order), as `(first token, its run's slice of them, tokens)` per run: a run past the
/// `n`th token is cut, the runs after it left out. O(1) per run.
#[inline(always)]
pub(crate) fn first_tokens<'a, T>(
    runs: &'a [&'a [T]],
    n: usize,
    hd: usize,
) -> impl Iterator<Item = (usize, &'a [T], usize)> + 'a {
    let mut t = 0;
    runs.iter().map_while(move |run| {
        let len = (run.len() / hd.max(1)).min(n - t);
        (len > 0).then(|| {
            t += len;
            (t - len, &run[..len * hd], len)
        })
    })
}

/// The portable implementation (any CPU): lane arrays the compiler vectorizes for
/// whatever vector unit the target has. The scores read a token's key once for all the
/// rows of a call; the value accumulation keeps a block of dimensions of every row in
/// registers over all the call's tokens. f32 and bf16 (a shift) are widened as they
/// load; f16, FP8 and int8 by the attention loop first ([`Portable::widens_storage`];
/// [`Element::widen`]: two instructions per eight f16 elements on aarch64, F16C on
/// x86-64), so that each element is widened once, not once per row.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl Simd for Portable {
    #[inline(always)]
    fn scores4<T: Element>(
        self,
        q: &[f32],
        k: &[T],
        hd: usize,
        n: usize,
        s: &mut [f32],
        s_stride: usize,
        _passes: bool,
    ) {
        scores_rows::<T, 4, { per_row(4, 16) }>(q, k, hd, n, |t, scores| {
            for (r, score) in scores.into_iter().enumerate() {
                s[r * s_stride + t] = score;
            }
        });
    }
    #[inline(always)]
    fn scores1<T: Element>(self, q: &[f32], k: &[T], hd: usize, n: usize, s: &mut [f32]) {
        let n = n.min(s.len());
        scores_rows::<T, 1, { per_row(1, 16) }>(q, k, hd, n, |t, [score]| s[t] = score);
    }
    #[inline(always)]
    fn accumulate4<T: Element>(
        self,
        acc: &mut [f32],
        p: [&[f32]; 4],
        v: &[T],
        hd: usize,
        n: usize,
    ) {
        accumulate_rows::<T, 4, { per_row(4, 32) }>(acc, p, v, hd, n);
    }
    #[inline(always)]
    fn accumulate2<T: Element>(
        self,
        acc: &mut [f32],
        p0: &[f32],
        p1: &[f32],
        v: &[T],
        hd: usize,
        n: usize,
    ) {
        accumulate_rows::<T, 2, { per_row(2, 32) }>(acc, [p0, p1], v, hd, n);
    }
    #[inline(always)]
    fn accumulate1<T: Element>(self, acc: &mut [f32], p: &[f32], v: &[T], hd: usize, n: usize) {
        accumulate_rows::<T, 1, { per_row(1, 32) }>(acc, [p], v, hd, n);
    }
    #[inline(always)]
    fn max(self, x: &[f32]) -> f32 {
        max(x)
    }
    #[inline(always)]
    fn exp_shifted_sum(self, x: &mut [f32], shift: f32) -> f32 {
        exp_shifted_sum(x, shift)
    }
    #[inline(always)]
    fn scale(self, x: &mut [f32], c: f32) {
        scale(x, c)
    }
    /// Always for f16, FP8 and int8, in every task: widened as they load, an element
    /// is widened again for every row of a loop (the compiler repeats it), which costs
    /// more than storing and loading the floats. Measured in instructions executed on
    /// aarch64 (qemu, a decode of 1 × 512 tokens, 32 query heads over 8 KV heads, head
    /// dim 128), as they load against widened first: f16 (branch-free bit operations,
    /// a dozen per four elements; widened first, `fcvtl`) 18.6M against 6.0M, FP8 (as
    /// many bit operations) 17.8M against 8.2M, int8 (two widenings and a conversion)
    /// 7.0M against 6.2M; bf16, a shift, 5.6M against 5.9M, so it is not.
    ///
    /// In every task, not only those of several passes: the arithmetic had widened into
    /// buffers of its own, made (zeroed) in every call, 8 KiB for a step of 8 values and
    /// 1 KiB for one of 4 keys: about 5 MiB of stores per decode of 1 MiB of int8, and
    /// 5.6% of its instructions on aarch64 (`memset`). Into the loop's scratch instead,
    /// per decode call on aarch64 (same decode, musl): f16 6.22M → 5.73M instructions,
    /// int8 6.34M → 5.97M, FP8 9.59M → 9.19M (f32 4.90M, 4.89M); on x86-64
    /// (`KVPAGE_CPU_PATH=portable`, Zen 4, `decode_call`, three alternating rounds),
    /// median time against f32's: f16 1.11–1.14 → 1.04–1.10, int8 1.24–1.26 →
    /// 1.18–1.20, FP8 1.93–1.98 → 1.86–1.90. O(1).
    #[inline(always)]
    fn widens_storage<T: Element>(self, _passes: bool) -> bool {
        matches!(T::DTYPE, DType::F16 | DType::Fp8E4m3 | DType::Int8)
    }
}

/// Lanes of the running max and sum of exponentials: 16 `f32`, four registers of 128
/// bits (NEON, SSE), two of AVX2's or one of AVX-512's.
const LANES: usize = 16;

/// Floats of the vector registers the portable loops keep their accumulators in: half
/// of the register file of the vector unit every CPU of the target has (32 registers of
/// 128 bits on aarch64; 16 on x86-64 without AVX, and as a default), the other half
/// left to the operands. Spilled accumulators cost more than they save: with 16 128-bit
/// accumulators, four rows' dot products on x86-64 (SSE) ran at half their speed.
const ACC_FLOATS: usize = if cfg!(target_arch = "aarch64") {
    64
} else {
    32
};

/// What each of `rows` rows gets of [`ACC_FLOATS`], at most `cap`: the partial sums per
/// row of [`dot_rows`] (capped at 16, four chains of 128-bit multiply-adds, which hide
/// their latency) and the dimensions per row [`accumulate_rows`] keeps in registers
/// (capped at 32). O(1).
const fn per_row(rows: usize, cap: usize) -> usize {
    let share = ACC_FLOATS / rows;
    if share < cap {
        share
    } else {
        cap
    }
}

/// `a * b + c`, fused (one rounding) where every CPU of the target has the instruction
/// (aarch64; x86-64 built with `fma`), which `f32::mul_add` then is; elsewhere that
/// would be a library call per element, so a separate multiply and add. O(1).
#[inline(always)]
pub(crate) fn mul_add(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(any(target_arch = "aarch64", target_feature = "fma"))]
    {
        a.mul_add(b, c)
    }
    #[cfg(not(any(target_arch = "aarch64", target_feature = "fma")))]
    {
        a * b + c
    }
}

/// The sum of `L` partial sums (`L` a power of two), pairwise. O(L).
#[inline(always)]
fn reduce_lanes<const L: usize>(mut acc: [f32; L]) -> f32 {
    let mut w = L / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// `store(t, [q_r · k_t for r < R])` for the tokens `t < n` of `k`
/// (`k_t = k[t * hd..(t + 1) * hd]`), `q` holding the `R` rows: [`dot_rows`] on each
/// stored key. O(R × n × hd).
#[inline(always)]
fn scores_rows<T: Element, const R: usize, const L: usize>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    mut store: impl FnMut(usize, [f32; R]),
) {
    for (t, k_t) in k.chunks_exact(hd.max(1)).take(n).enumerate() {
        store(t, dot_rows::<T, R, L>(q, k_t));
    }
}

/// `[q_r · k for r < R]`, the rows `q_r = q[r * hd..(r + 1) * hd]` with `hd = k.len()`:
/// each stored element of `k` is read and widened once for the `R` rows, each row
/// accumulated in `L` partial sums (a power of two). O(R × hd).
///
/// Written so that the compiler's vectorizer takes it, and out of line for the same
/// reason: on aarch64 an array of the rows' slices, widening a chunk of `k` into an
/// array first, or iterators over the accumulators' rows left the loops scalar, and so
/// did inlining them into the attention loop, their sums kept in memory (an f32 decode
/// of 1 × 512 tokens took 13.1M instructions inlined, 5.2M out of line; the call is
/// once per token for four rows).
///
/// # Panics
/// If `q` holds fewer than `R` rows (the kernels' shapes are checked before).
#[inline(never)]
#[allow(clippy::needless_range_loop)]
pub(crate) fn dot_rows<T: Element, const R: usize, const L: usize>(q: &[f32], k: &[T]) -> [f32; R] {
    let hd = k.len();
    let (q, whole) = (&q[..R * hd], hd / L * L);
    let mut acc = [[0.0f32; L]; R];
    let mut d = 0;
    for kc in k[..whole].chunks_exact(L) {
        for r in 0..R {
            let qc = &q[r * hd + d..r * hd + d + L];
            for l in 0..L {
                acc[r][l] = mul_add(qc[l], kc[l].lane_to_f32(), acc[r][l]);
            }
        }
        d += L;
    }
    // A plain loop, not `core::array::from_fn`: its closure was compiled out of line on
    // aarch64, the partial sums stored and reloaded for every row (9% of an int8
    // decode's instructions).
    let mut dots = [0.0f32; R];
    for r in 0..R {
        let mut tail = 0.0;
        for d in whole..hd {
            tail = mul_add(q[r * hd + d], k[d].lane_to_f32(), tail);
        }
        dots[r] = reduce_lanes(acc[r]) + tail;
    }
    dots
}

/// `acc_r[d] += Σ_{t<n} p[r][t] * v_t[d]` for the `R` rows
/// `acc_r = acc[r * hd..(r + 1) * hd]`, `d < hd`, tokens
/// `v_t = v[t * hd..(t + 1) * hd]` (as far as `v` and each `p[r]` go; nothing when
/// `acc` is shorter than `R` rows). Register-blocked: a block of `B` dimensions of
/// every row stays in registers over all `n` tokens, and each stored element is read
/// and widened once for the `R` rows. O(R × n × hd).
///
/// Plain indices and out of line, as [`dot_rows`] and for the same reason.
#[inline(never)]
#[allow(clippy::needless_range_loop)]
pub(crate) fn accumulate_rows<T: Element, const R: usize, const B: usize>(
    acc: &mut [f32],
    p: [&[f32]; R],
    v: &[T],
    hd: usize,
    n: usize,
) {
    if hd == 0 || acc.len() < R * hd {
        return;
    }
    let n = p.iter().fold(n.min(v.len() / hd), |n, pr| n.min(pr.len()));
    // Cut to `n` so that the loops' indices need no bounds checks.
    let p = p.map(|pr| &pr[..n]);
    let (v, acc, whole) = (&v[..n * hd], &mut acc[..R * hd], hd / B * B);
    let mut d0 = 0;
    while d0 < whole {
        let mut a = [[0.0f32; B]; R];
        for r in 0..R {
            a[r].copy_from_slice(&acc[r * hd + d0..r * hd + d0 + B]);
        }
        for t in 0..n {
            let vc = &v[t * hd + d0..t * hd + d0 + B];
            for r in 0..R {
                let w = p[r][t];
                for l in 0..B {
                    a[r][l] = mul_add(w, vc[l].lane_to_f32(), a[r][l]);
                }
            }
        }
        for r in 0..R {
            acc[r * hd + d0..r * hd + d0 + B].copy_from_slice(&a[r]);
        }
        d0 += B;
    }
    for t in 0..n {
        for (r, pr) in p.iter().enumerate() {
            let w = pr[t];
            for d in whole..hd {
                acc[r * hd + d] = mul_add(w, v[t * hd + d].lane_to_f32(), acc[r * hd + d]);
            }
        }
    }
}

/// `x[i] *= c`. O(n).
#[inline(always)]
pub(crate) fn scale(x: &mut [f32], c: f32) {
    for v in x {
        *v *= c;
    }
}

/// Maximum of a slice (`-inf` when empty). O(n).
#[inline(always)]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut c = x.chunks_exact(LANES);
    for ch in &mut c {
        for l in 0..LANES {
            m[l] = m[l].max(ch[l]);
        }
    }
    let mut r = f32::NEG_INFINITY;
    for &v in m.iter().chain(c.remainder()) {
        r = r.max(v);
    }
    r
}

/// `x[i] = exp(x[i] - shift)` and returns `Σ x[i]` (after the update). For arguments
/// `<= 0` (every softmax term after the running max is subtracted). O(n).
#[inline(always)]
pub(crate) fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    let mut sum = [0.0f32; LANES];
    let mut c = x.chunks_exact_mut(LANES);
    for ch in &mut c {
        for l in 0..LANES {
            let e = exp(ch[l] - shift);
            ch[l] = e;
            sum[l] += e;
        }
    }
    let mut r = 0.0f32;
    for v in c.into_remainder() {
        let e = exp(*v - shift);
        *v = e;
        r += e;
    }
    r + sum.iter().sum::<f32>()
}

/// `ln 2` split into a part with few mantissa bits (exact products with small integers)
/// and the remainder (Cody–Waite).
pub(crate) const LN2_HI: f32 = 0.693_145_75;
/// See [`LN2_HI`].
pub(crate) const LN2_LO: f32 = 1.428_606_8e-6;
/// The Taylor coefficients of `e^r` that [`exp`] and its vector forms evaluate by
/// Horner's rule, highest degree first (`1/6!` down to `1/1!`; the constant term 1 is
/// added last).
pub(crate) const EXP_TAYLOR: [f32; 6] = [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0];

/// `1.5 * 2^23`: adding it rounds an `f32` to an integer held in the low mantissa bits.
pub(crate) const EXP_MAGIC: f32 = 12_582_912.0;

/// `e^x` for `x <= 0` (larger arguments are clamped to 0), relative error below
/// 2e-7; `0` for `x < -87` (including `-inf`). Branch-free so that it vectorizes:
/// `x = k ln2 + r` with `|r| <= ln2 / 2`, `e^r` by a degree-6 Taylor polynomial
/// (truncation error `r^7 / 7! < 1.3e-7`), `2^k` built in the exponent bits. O(1).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = core::f32::consts::LOG2_E;
    let xc = x.clamp(-87.0, 0.0);
    let t = xc * LOG2E + EXP_MAGIC;
    let k = t.to_bits() as i32 - EXP_MAGIC.to_bits() as i32;
    let kf = t - EXP_MAGIC;
    let r = xc - kf * LN2_HI - kf * LN2_LO;
    let [c6, rest @ ..] = EXP_TAYLOR;
    let p = 1.0 + r * rest.iter().fold(c6, |p, &c| p * r + c);
    let pow2 = f32::from_bits(((k + 127) as u32) << 23);
    // NaN-free select: below the clamp the result is 0 (also for x = -inf).
    if x < -87.0 {
        0.0
    } else {
        p * pow2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "safe arithmetic over 60k points: checked natively")]
    fn exp_matches_std_on_the_softmax_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let got = f64::from(exp(x));
            let want = f64::from(x).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    /// `dot_rows` and `accumulate_rows` against f64 loops over the widened elements, at
    /// head dims with and without a partial block, for every row count and block size
    /// the kernels use on either register file; f32 and bf16 (which the kernels read so)
    /// and int8 storage read as they load. Each result is within f32 rounding of the sum
    /// of its terms' magnitudes.
    #[test]
    #[cfg_attr(miri, ignore = "safe arithmetic, no unsafe: checked natively")]
    fn dot_and_accumulate_rows_match_f64_loops() {
        /// `(Σ terms, Σ |terms|)`.
        fn sum(terms: impl Iterator<Item = f64>) -> (f64, f64) {
            terms.fold((0.0, 0.0), |(s, m), x| (s + x, m + x.abs()))
        }
        fn close(got: &[f32], want: &[(f64, f64)]) -> bool {
            got.len() == want.len()
                && got
                    .iter()
                    .zip(want)
                    .all(|(&g, &(w, m))| (f64::from(g) - w).abs() <= 2e-6 * (1.0 + m))
        }
        fn check<T: Element>(scale: f32) {
            let wave = |i: usize, f: f32| (i as f32 * f).sin() * scale;
            let x = |e: T| f64::from(e.to_f32());
            for hd in [1usize, 15, 16, 31, 37, 64, 128] {
                let q: Vec<f32> = (0..4 * hd).map(|i| (i as f32 * 0.37).sin()).collect();
                let k: Vec<T> = (0..hd).map(|i| T::from_f32(wave(i, 0.11))).collect();
                let want: Vec<(f64, f64)> = (0..4)
                    .map(|r| sum((0..hd).map(|d| f64::from(q[r * hd + d]) * x(k[d]))))
                    .collect();
                assert!(
                    close(&dot_rows::<T, 4, 8>(&q, &k), &want),
                    "4 rows, hd {hd}"
                );
                assert!(
                    close(&dot_rows::<T, 4, 16>(&q, &k), &want),
                    "4 rows, hd {hd}"
                );
                assert!(
                    close(&dot_rows::<T, 1, 16>(&q[hd..], &k), &want[1..2]),
                    "1 row, hd {hd}"
                );

                for n in [0usize, 1, 5, 8] {
                    let v: Vec<T> = (0..n * hd).map(|i| T::from_f32(wave(i, 0.7))).collect();
                    let p: Vec<Vec<f32>> = (0..4)
                        .map(|r| (0..n).map(|t| 0.1 + (r * n + t) as f32 * 0.03).collect())
                        .collect();
                    let start: Vec<f32> = (0..4 * hd).map(|i| i as f32 * 0.01).collect();
                    let want: Vec<(f64, f64)> = (0..4 * hd)
                        .map(|i| {
                            let (r, d) = (i / hd, i % hd);
                            let terms = (0..n).map(|t| f64::from(p[r][t]) * x(v[t * hd + d]));
                            sum(core::iter::once(f64::from(start[i])).chain(terms))
                        })
                        .collect();
                    let rows = [&p[0][..], &p[1], &p[2], &p[3]];
                    // Each row count at the blocks of both register files (`per_row`),
                    // the rows past the call's left as they were.
                    let check_rows = |got: &[f32], r: usize, b: usize| {
                        let rest_kept = got[r * hd..] == start[r * hd..];
                        let ok = close(&got[..r * hd], &want[..r * hd]) && rest_kept;
                        assert!(ok, "{r} rows, block {b}, hd {hd}, {n} tokens");
                    };
                    let mut got = start.clone();
                    accumulate_rows::<T, 4, 8>(&mut got, rows, &v, hd, n);
                    check_rows(&got, 4, 8);
                    let mut got = start.clone();
                    accumulate_rows::<T, 4, 16>(&mut got, rows, &v, hd, n);
                    check_rows(&got, 4, 16);
                    let mut got = start.clone();
                    accumulate_rows::<T, 2, 16>(&mut got, [rows[0], rows[1]], &v, hd, n);
                    check_rows(&got, 2, 16);
                    let mut got = start.clone();
                    accumulate_rows::<T, 2, 32>(&mut got, [rows[0], rows[1]], &v, hd, n);
                    check_rows(&got, 2, 32);
                    let mut got = start.clone();
                    accumulate_rows::<T, 1, 32>(&mut got, [rows[0]], &v, hd, n);
                    check_rows(&got, 1, 32);
                }
            }
        }
        check::<f32>(1.0);
        check::<half::bf16>(1.0);
        check::<crate::dtype::Int8>(127.0);
    }
}
