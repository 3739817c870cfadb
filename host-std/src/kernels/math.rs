//! Vector arithmetic of the attention inner loops, behind the [`Simd`] trait: the
//! portable implementation here (lane arrays the compiler may vectorize, separate
//! multiply and add: `mul_add` is a library call on CPUs without FMA), and an AVX2 + FMA
//! one in [`super::avx2`]. Also the branch-free scalar `exp` both use.

use super::MAX_HEAD_DIM;
use crate::dtype::Element;

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
    /// Whether a task of more than four rows per KV head should widen storage `T` to
    /// f32 once per step, so that its passes of four rows read f32, rather than have
    /// each pass read the storage itself. True for the 8-bit storage types, whose
    /// widening costs this arithmetic most, by default; an arithmetic with cheap
    /// widening or native 8-bit dot products says no. O(1).
    ///
    /// Measured (paired, one thread in cache or two out of cache, 8 KV heads, head dim
    /// 128), passes over the storage against widening: AVX2 + FMA, decode of 64 query
    /// heads f16 0.93, bf16 0.86, int8 1.05, chunked prefill f16 0.99, bf16 0.87, int8
    /// 1.06; portable, decode f16 0.95, int8 1.23, prefill f16 1.00, int8 1.28.
    #[inline(always)]
    fn widens_for_passes<T: Element>(self) -> bool {
        T::DTYPE.is_scaled()
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

/// The portable implementation (any CPU): widens one token at a time into a stack
/// buffer, then lane-array loops.
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
        let mut kt = [0.0f32; MAX_HEAD_DIM];
        for (t, kr) in k.chunks_exact(hd).take(n).enumerate() {
            T::widen(kr, &mut kt[..hd]);
            for r in 0..4 {
                s[r * s_stride + t] = dot(&q[r * hd..(r + 1) * hd], &kt[..hd]);
            }
        }
    }
    #[inline(always)]
    fn scores1<T: Element>(self, q: &[f32], k: &[T], hd: usize, n: usize, s: &mut [f32]) {
        let mut kt = [0.0f32; MAX_HEAD_DIM];
        for (st, kr) in s[..n].iter_mut().zip(k.chunks_exact(hd)) {
            T::widen(kr, &mut kt[..hd]);
            *st = dot(&q[..hd], &kt[..hd]);
        }
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
        let (a0, a1) = acc[..2 * hd].split_at_mut(hd);
        let mut vt = [0.0f32; MAX_HEAD_DIM];
        for (t, vr) in v.chunks_exact(hd).take(n).enumerate() {
            T::widen(vr, &mut vt[..hd]);
            accumulate(a0, &p0[t..t + 1], &vt[..hd]);
            accumulate(a1, &p1[t..t + 1], &vt[..hd]);
        }
    }
    #[inline(always)]
    fn accumulate1<T: Element>(self, acc: &mut [f32], p: &[f32], v: &[T], hd: usize, n: usize) {
        let mut vt = [0.0f32; MAX_HEAD_DIM];
        for (t, vr) in v.chunks_exact(hd).take(n).enumerate() {
            T::widen(vr, &mut vt[..hd]);
            accumulate(&mut acc[..hd], &p[t..t + 1], &vt[..hd]);
        }
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
}

/// Lanes of the accumulators: 16 `f32`, two AVX2 registers or one AVX-512 register.
const LANES: usize = 16;

/// Width of the register-blocked accumulation in [`accumulate`].
const ACC_BLOCK: usize = 32;

/// Dot product of two equally long slices, accumulated in `LANES` partial sums. O(n).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let mut ac = a.chunks_exact(LANES);
    let mut bc = b.chunks_exact(LANES);
    for (x, y) in (&mut ac).zip(&mut bc) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ac.remainder().iter().zip(bc.remainder()) {
        tail += *x * *y;
    }
    // Pairwise reduction of the lanes.
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0] + tail
}

/// `acc[d] += Σ_t p[t] * v[t * dim + d]` for `t < p.len()`, `d < dim = acc.len()`.
/// Register-blocked: a block of `ACC_BLOCK` outputs stays in registers over all tokens.
/// O(p.len() * dim).
#[inline(always)]
pub(crate) fn accumulate(acc: &mut [f32], p: &[f32], v: &[f32]) {
    let dim = acc.len();
    if dim == 0 {
        return;
    }
    let n = p.len().min(v.len() / dim);
    let (p, v) = (&p[..n], &v[..n * dim]);
    let whole = dim / ACC_BLOCK * ACC_BLOCK;
    let mut d0 = 0;
    while d0 < whole {
        let mut a = [0.0f32; ACC_BLOCK];
        a.copy_from_slice(&acc[d0..d0 + ACC_BLOCK]);
        for (vt, &pt) in v.chunks_exact(dim).zip(p) {
            let vt = &vt[d0..d0 + ACC_BLOCK];
            for l in 0..ACC_BLOCK {
                a[l] += pt * vt[l];
            }
        }
        acc[d0..d0 + ACC_BLOCK].copy_from_slice(&a);
        d0 += ACC_BLOCK;
    }
    if whole < dim {
        for (vt, &pt) in v.chunks_exact(dim).zip(p) {
            for (a, &x) in acc[whole..].iter_mut().zip(&vt[whole..]) {
                *a += pt * x;
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

    #[test]
    fn dot_and_accumulate_match_scalar_loops() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - want).abs() < 1e-5);

        for dim in [1usize, 31, 32, 45, 64] {
            let n = 5;
            let v: Vec<f32> = (0..n * dim).map(|i| (i as f32 * 0.7).sin()).collect();
            let p: Vec<f32> = (0..n).map(|i| 0.1 + i as f32 * 0.2).collect();
            let mut acc: Vec<f32> = (0..dim).map(|i| i as f32 * 0.01).collect();
            let mut want = acc.clone();
            for t in 0..n {
                for d in 0..dim {
                    want[d] += p[t] * v[t * dim + d];
                }
            }
            accumulate(&mut acc, &p, &v);
            for (g, w) in acc.iter().zip(&want) {
                assert!((g - w).abs() < 1e-5);
            }
        }
    }
}
