//! What the two dot-product arithmetics for 8-bit codes ([`super::int8_vnni`],
//! [`super::fp8_bf16`]) share: both widen a 64-byte load of codes to 16-bit elements
//! as its even and its odd bytes, and both take, per 32-bit lane, the products of two
//! 16-bit pairs (`vpdpwssd`, `vdpbf16ps`).
//!
//! - Scores: a query row's 16-bit elements are kept in the same even/odd order, so a
//!   key needs no reordering; 16 partial sums per (row, token) are then reduced
//!   sixteen at a time ([`sum16`]).
//! - Weighted values: the codes of two tokens are interleaved per dimension
//!   ([`interleave`]), so that each lane pairs token `t` and `t + 1` of one dimension
//!   against the pair of their weights. The accumulators then hold each group's 64
//!   dimensions in the order of [`acc_dim`]; [`from_acc_order`] puts them back.
//!
//! The loops themselves ([`scores4`], [`scores1`], [`accumulate`]) are written once,
//! over [`PairDots`]: what differs between the two is how a load of codes becomes
//! 16-bit elements, the dot-product instruction, and the form of the f32 side.

use core::arch::x86_64::*;

use super::bytes;
use crate::dtype::Element;
use crate::kernels::reduce::sum16;

/// Dimensions per group (one 64-byte load of codes).
pub(in crate::kernels) const GROUP: usize = 64;

/// The dimension (within its group of 64) that position `pos` of an accumulator group
/// holds: position `16 k + 4 l + i` holds `16 l + 8 (k & 1) + 2 i + (k >> 1)` (part `k`
/// of [`interleave`], 128-bit lane `l`, element `i`). O(1).
pub(in crate::kernels) const fn acc_dim(pos: usize) -> usize {
    let (k, l, i) = (pos / 16, pos % 16 / 4, pos % 4);
    16 * l + 8 * (k & 1) + 2 * i + (k >> 1)
}

/// For each 16 dimensions `16 l..16 l + 16` of a group: the positions that hold them
/// (the inverse of [`acc_dim`]), as indices into the 32 floats of a pair of accumulator
/// vectors (`[0, 1]` or `[2, 3]`), and a mask of those in the second pair.
const ACC_GATHER: [([i32; 16], u16); 4] = {
    let mut out = [([0i32; 16], 0u16); 4];
    let mut pos = 0;
    while pos < GROUP {
        let d = acc_dim(pos);
        out[d / 16].0[d % 16] = (pos % 32) as i32;
        if pos >= 32 {
            out[d / 16].1 |= 1 << (d % 16);
        }
        pos += 1;
    }
    out
};

/// Puts accumulated rows (a multiple of [`GROUP`] long) from the order of [`acc_dim`]
/// back into dimension order. O(rows.len()): per 16 dimensions, two two-source
/// permutes and a blend (as 64 scalar moves per group this took 4-8% of an int8
/// decode of 256 tokens). Needs AVX-512F: callers outside such code call it in `unsafe`,
/// holding the proof (an `Avx512Dot`).
#[target_feature(enable = "avx512f")]
pub(in crate::kernels) fn from_acc_order(rows: &mut [f32]) {
    for g in rows.chunks_exact_mut(GROUP) {
        // SAFETY: `g` holds 64 floats: four vectors of 16 are read, then written.
        unsafe {
            let p = g.as_mut_ptr();
            let x: [__m512; 4] = core::array::from_fn(|k| _mm512_loadu_ps(p.add(16 * k)));
            for (l, (idx, upper)) in ACC_GATHER.iter().enumerate() {
                let idx = _mm512_loadu_si512(idx.as_ptr().cast());
                let lower = _mm512_permutex2var_ps(x[0], idx, x[1]);
                let higher = _mm512_permutex2var_ps(x[2], idx, x[3]);
                _mm512_storeu_ps(p.add(16 * l), _mm512_mask_blend_ps(*upper, lower, higher));
            }
        }
    }
}

/// The four vectors whose 32-bit lanes pair, per dimension, 16-bit elements of token
/// `t` (`e0`, `o0`: its even and odd elements) with those of token `t + 1` (`e1`,
/// `o1`): lane `4 l + i` of part `k` holds dimension [`acc_dim`]`(16 k + 4 l + i)`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(in crate::kernels) fn interleave(
    e0: __m512i,
    o0: __m512i,
    e1: __m512i,
    o1: __m512i,
) -> [__m512i; 4] {
    [
        _mm512_unpacklo_epi16(e0, e1),
        _mm512_unpackhi_epi16(e0, e1),
        _mm512_unpacklo_epi16(o0, o1),
        _mm512_unpackhi_epi16(o0, o1),
    ]
}

/// The 32 floats `a` (dimensions `0..16` of a half group) and `b` (`16..32`) as their
/// even dimensions and their odd ones (the order the arithmetics keep a query row in).
#[target_feature(enable = "avx512f")]
#[inline]
pub(in crate::kernels) fn even_odd_ps(a: __m512, b: __m512) -> (__m512, __m512) {
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    (
        _mm512_permutex2var_ps(a, even, b),
        _mm512_permutex2var_ps(a, odd, b),
    )
}

/// Tokens whose weights one accumulation encodes at a time.
pub(in crate::kernels) const BLOCK: usize = 64;

/// The arithmetic of one 8-bit code type on pairs of 16-bit elements. Accumulators
/// are 512-bit vectors of 16 lanes (integer or f32 bits); every method is O(1) and
/// needs the CPU extension of its implementation.
pub(in crate::kernels) trait PairDots {
    /// One group of an encoded query row, loaded.
    type Query: Copy;
    /// The 16-bit elements of the even and of the odd codes of a 64-byte load.
    ///
    /// # Safety
    /// The CPU has the implementation's extension.
    unsafe fn even_odd(x: __m512i) -> (__m512i, __m512i);
    /// The group of an encoded query row starting at `q` (its group's first float).
    ///
    /// # Safety
    /// As [`PairDots::even_odd`]; `q` points to the 64 floats of the group.
    unsafe fn load_query(q: *const f32) -> Self::Query;
    /// `acc` plus the dot products of a key's elements `(e, o)` with the query group.
    ///
    /// # Safety
    /// As [`PairDots::even_odd`].
    unsafe fn dot_key(acc: __m512i, e: __m512i, o: __m512i, q: Self::Query) -> __m512i;
    /// Lane-wise sum of two accumulators.
    ///
    /// # Safety
    /// As [`PairDots::even_odd`].
    unsafe fn add(a: __m512i, b: __m512i) -> __m512i;
    /// An accumulator's lanes as f32.
    ///
    /// # Safety
    /// As [`PairDots::even_odd`].
    unsafe fn to_f32(a: __m512i) -> __m512;
    /// The sum of an accumulator's lanes, as f32 (rounded once).
    ///
    /// # Safety
    /// As [`PairDots::even_odd`].
    unsafe fn reduce(a: __m512i) -> f32;
    /// What the dot products of the encoded row `q` (`hd` floats) are multiplied by to
    /// give scores of the codes.
    ///
    /// # Safety
    /// `q` points to an encoded row of `hd` floats.
    unsafe fn score_factor(q: *const f32, hd: usize) -> f32;
    /// Encodes the weights `p[..m]` (`m <= BLOCK`, not negative) two tokens to a word
    /// (the first in the low half; an odd last token pairs with 0) into `words`, and
    /// returns what the accumulated sums are multiplied by.
    ///
    /// # Safety
    /// As [`PairDots::even_odd`]; `p.len() >= m`.
    unsafe fn encode_weights(p: &[f32], m: usize, words: &mut [u32; BLOCK / 2]) -> f32;
    /// `acc[k]` plus the products of the interleaved codes `parts[k]` with one pair's
    /// weights (`words[j]`).
    ///
    /// # Safety
    /// As [`PairDots::even_odd`].
    unsafe fn dot_values(acc: &mut [__m512i; 4], parts: &[__m512i; 4], w: u32);
}

/// Dot products of `R` encoded query rows (`q`, `hd` floats apart) with `TOK` keys of
/// codes at `kp`: `[row][token]`, 16 partial sums each. Inlined into its caller, whose
/// target features it takes.
///
/// # Safety
/// The CPU has `K`'s extension; `q` points to `R` encoded rows of `hd` floats, `kp` to
/// `TOK` keys of `hd` codes; `hd` is a non-zero multiple of 64.
#[inline(always)]
unsafe fn dots<K: PairDots, const R: usize, const TOK: usize>(
    q: *const f32,
    kp: *const u8,
    hd: usize,
) -> [[__m512i; TOK]; R] {
    // SAFETY: reads the 64 codes of key `i < TOK` at dimension `d` and the 64 floats of
    // row `r < R`'s group `d / 64`, with `d + 64 <= hd` (caller).
    unsafe {
        let zero = _mm512_setzero_si512();
        let mut a = [[zero; TOK]; R];
        let mut d = 0;
        while d < hd {
            let mut eo = [(zero, zero); TOK];
            for (i, x) in eo.iter_mut().enumerate() {
                *x = K::even_odd(_mm512_loadu_si512(kp.add(i * hd + d).cast()));
            }
            for (r, ar) in a.iter_mut().enumerate() {
                let qg = K::load_query(q.add(r * hd + d));
                for (ai, &(e, o)) in ar.iter_mut().zip(&eo) {
                    *ai = K::dot_key(*ai, e, o, qg);
                }
            }
            d += GROUP;
        }
        a
    }
}

/// [`crate::kernels::math::Simd::scores4`] for `K`'s codes: `q` holds four encoded
/// rows; the scores are of the codes (the caller applies the keys' scales). Four tokens
/// at a time (16 accumulators, one transposing reduction), then one at a time.
///
/// # Safety
/// The CPU has `K`'s extension; `T` is `K`'s code type; `hd` is a non-zero multiple
/// of 64.
#[inline(always)]
pub(in crate::kernels) unsafe fn scores4<K: PairDots, T: Element>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    s: &mut [f32],
    stride: usize,
) {
    assert!(q.len() >= 4 * hd && k.len() >= n * hd && (n == 0 || s.len() >= 3 * stride + n));
    let (qp, kp) = (q.as_ptr(), bytes(k));
    // SAFETY: four encoded rows of `hd` floats (asserted); keys `t0..t0 + 4` and `t < n`
    // lie inside the asserted length (one byte a code); `out` holds 16 floats.
    unsafe {
        let f: [f32; 4] = core::array::from_fn(|r| K::score_factor(qp.add(r * hd), hd));
        // Lane `4 r + i` of the reduction is row `r`, token `i`.
        let lane_factor = _mm512_setr_ps(
            f[0], f[0], f[0], f[0], f[1], f[1], f[1], f[1], f[2], f[2], f[2], f[2], f[3], f[3],
            f[3], f[3],
        );
        let mut t0 = 0;
        while t0 + 4 <= n {
            let a = dots::<K, 4, 4>(qp, kp.add(t0 * hd), hd);
            let sums = sum16(core::array::from_fn(|j| a[j / 4][j % 4]), |x, y| {
                K::add(x, y)
            });
            let mut out = [0.0f32; 16];
            _mm512_storeu_ps(
                out.as_mut_ptr(),
                _mm512_mul_ps(K::to_f32(sums), lane_factor),
            );
            for (r, o) in out.chunks_exact(4).enumerate() {
                s[r * stride + t0..r * stride + t0 + 4].copy_from_slice(o);
            }
            t0 += 4;
        }
        for t in t0..n {
            let [a0, a1, a2, a3] = dots::<K, 4, 1>(qp, kp.add(t * hd), hd);
            for (r, a) in [a0[0], a1[0], a2[0], a3[0]].into_iter().enumerate() {
                s[r * stride + t] = K::reduce(a) * f[r];
            }
        }
    }
}

/// [`crate::kernels::math::Simd::scores1`] for `K`'s codes: `q` is one encoded row.
///
/// # Safety
/// As [`scores4`].
#[inline(always)]
pub(in crate::kernels) unsafe fn scores1<K: PairDots, T: Element>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    s: &mut [f32],
) {
    assert!(q.len() >= hd && k.len() >= n * hd && s.len() >= n);
    let (qp, kp) = (q.as_ptr(), bytes(k));
    // SAFETY: one encoded row of `hd` floats (asserted); key `t < n` lies inside the
    // asserted length.
    unsafe {
        let f = K::score_factor(qp, hd);
        for (t, st) in s[..n].iter_mut().enumerate() {
            let [[a]] = dots::<K, 1, 1>(qp, kp.add(t * hd), hd);
            *st = K::reduce(a) * f;
        }
    }
}

/// `acc_r += Σ_t p[r][t] * code_t` over the tokens `v` (each slice one token's `hd`
/// codes, wherever it is stored: the tokens of a chunk come from several blocks) for
/// `R` rows of `acc` (`acc_r = acc[r * hd..]`, in the order of [`acc_dim`]): per
/// [`BLOCK`] of tokens, each row's weights encoded in pairs, two tokens' codes
/// interleaved per dimension ([`interleave`]), accumulators for 64 dimensions (`4 R`
/// registers), then scaled into `acc`. The caller folds the values' scales into the
/// weights `p`, which are not negative. The encoding and the scaling are paid once per
/// call, so the attention loop hands in a whole chunk, across blocks (paired against a
/// call per block of 16 tokens: int8 0.82× the time in cache, 1 × 256 tokens, and 0.85×
/// out of cache, 32 × 2048; FP8 0.89× and 0.90×).
///
/// # Safety
/// As [`scores4`]; `R <= 4`.
#[inline(always)]
pub(in crate::kernels) unsafe fn accumulate<K: PairDots, T: Element, const R: usize>(
    acc: &mut [f32],
    p: [&[f32]; R],
    v: &[&[T]],
    hd: usize,
) {
    let n = v.len();
    assert!(acc.len() >= R * hd && p.iter().all(|p| p.len() >= n));
    assert!(v.iter().all(|t| t.len() >= hd));
    let ap = acc.as_mut_ptr();
    let mut t0 = 0;
    while t0 < n {
        let m = (n - t0).min(BLOCK);
        let mut words = [[0u32; BLOCK / 2]; R];
        let mut factor = [0.0f32; R];
        // SAFETY: reads the 64 codes at dimension `d` of tokens `t < t0 + m <= n`, each
        // of at least `hd` codes, and reads and writes `acc[r * hd + d..+64]` (r < R),
        // with `d + 64 <= hd` (asserted lengths above); the odd token of an odd block
        // is a zero vector, not a load; `pr[t0..]` holds `m` weights.
        unsafe {
            for ((wr, f), pr) in words.iter_mut().zip(&mut factor).zip(&p) {
                *f = K::encode_weights(&pr[t0..], m, wr);
            }
            let zero = _mm512_setzero_si512();
            let mut d = 0;
            while d < hd {
                let mut x = [[zero; 4]; R];
                for j in 0..m.div_ceil(2) {
                    let t = t0 + 2 * j;
                    let (e0, o0) = K::even_odd(_mm512_loadu_si512(bytes(v[t]).add(d).cast()));
                    let (e1, o1) = if t + 1 < t0 + m {
                        K::even_odd(_mm512_loadu_si512(bytes(v[t + 1]).add(d).cast()))
                    } else {
                        (zero, zero)
                    };
                    let parts = interleave(e0, o0, e1, o1);
                    for (xr, wr) in x.iter_mut().zip(&words) {
                        K::dot_values(xr, &parts, wr[j]);
                    }
                }
                for (r, (xr, &f)) in x.iter().zip(&factor).enumerate() {
                    let f = _mm512_set1_ps(f);
                    for (k, &xk) in xr.iter().enumerate() {
                        let a = ap.add(r * hd + d + 16 * k);
                        _mm512_storeu_ps(a, _mm512_fmadd_ps(K::to_f32(xk), f, _mm512_loadu_ps(a)));
                    }
                }
                d += GROUP;
            }
        }
        t0 += m;
    }
}

/// A deterministic spread of `n` values in (-1, 1).
#[cfg(test)]
pub(super) fn test_values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
            x as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// Checks [`scores4`], [`scores1`] and [`accumulate`] (its tokens out of storage
/// order) over `K` against f64 on the codes (`value` of each), for head dims 64, 128
/// and 256 and an odd token count: every score and every accumulated dimension within
/// `bound` of the sum of its terms' magnitudes (1% more, for the f32 sums): `K`'s
/// rounding of the f32 side, queries and weights (int8's 16-bit fixed point: `1e-4`;
/// FP8's bf16: `2^-9` of each product); an indexing or reduction mistake is off by the
/// order of the terms themselves. `unit`: the unit `K` reads the codes in
/// ([`crate::kernels::math::Simd::code_unit`]), which the scores are multiplied by and
/// the weights divided by, as the attention loop does.
///
/// # Safety
/// The CPU has `K`'s extension; `encode_query` is `K`'s, `T` its code type.
#[cfg(test)]
pub(super) unsafe fn check_loops<K: PairDots, T: Element>(
    code_of: impl Fn(f32) -> T,
    value: impl Fn(T) -> f64,
    encode_query: unsafe fn(&mut [f32], usize),
    unit: f32,
    bound: f64,
) {
    const N: usize = 11;
    let close = |got: f64, want: f64, size: f64| (got - want).abs() <= bound * 1.01 * size + 1e-9;
    for hd in [64usize, 128, 256] {
        let codes: Vec<T> = test_values(N * hd, 9).into_iter().map(&code_of).collect();
        let code = |t: usize, d: usize| value(codes[t * hd + d]);
        let q = test_values(4 * hd, 5);
        let mut qe = q.clone();
        for row in qe.chunks_exact_mut(hd) {
            // SAFETY: the caller's.
            unsafe { encode_query(row, hd) };
        }
        let stride = 16;
        let (mut s, mut s1) = (vec![f32::NAN; 4 * stride], vec![f32::NAN; N]);
        // SAFETY: the caller's; the lengths fit.
        unsafe {
            scores4::<K, T>(&qe, &codes, hd, N, &mut s, stride);
            scores1::<K, T>(&qe[hd..], &codes, hd, N, &mut s1);
        }
        for r in 0..4 {
            for t in 0..N {
                let terms = (0..hd).map(|d| f64::from(q[r * hd + d]) * code(t, d));
                let (want, size) = (terms.clone().sum(), terms.map(f64::abs).sum());
                let got = f64::from(s[r * stride + t]) * f64::from(unit);
                assert!(
                    close(got, want, size),
                    "hd {hd} row {r} token {t}: {got} vs {want}"
                );
                if r == 1 {
                    let got = f64::from(s1[t]) * f64::from(unit);
                    assert!(close(got, want, size), "scores1, token {t}");
                }
            }
        }

        let p: Vec<f32> = test_values(4 * N, 1)
            .iter()
            .map(|x| x.abs() * 1e-3)
            .collect();
        let start = test_values(4 * hd, 2);
        let mut acc = start.clone();
        // The tokens stored in reverse order: the accumulation follows the slices.
        let reversed: Vec<T> = codes.chunks_exact(hd).rev().flatten().copied().collect();
        let tokens: Vec<&[T]> = reversed.chunks_exact(hd).rev().collect();
        // In the unit's range (exact: a power of two).
        let p_unit: Vec<f32> = p.iter().map(|x| x * unit).collect();
        // SAFETY: the caller's; `R == 4`, the lengths fit.
        unsafe {
            let p = &p_unit;
            let rows = [&p[..N], &p[N..2 * N], &p[2 * N..3 * N], &p[3 * N..]];
            accumulate::<K, T, 4>(&mut acc, rows, &tokens, hd);
        }
        let (mut got, mut before) = (acc, start);
        from_acc_order(&mut got);
        from_acc_order(&mut before);
        for r in 0..4 {
            let pr = &p[r * N..(r + 1) * N];
            for d in 0..hd {
                let terms = (0..N).map(|t| f64::from(pr[t]) * code(t, d));
                let want = f64::from(before[r * hd + d]) + terms.clone().sum::<f64>();
                let size =
                    terms.map(f64::abs).sum::<f64>() + f64::from(before[r * hd + d]).abs() * 1e-3;
                let g = f64::from(got[r * hd + d]);
                assert!(
                    close(g, want, size),
                    "hd {hd} row {r} dim {d}: {g} vs {want}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acc_order_is_a_permutation_and_round_trips() {
        let mut seen = [false; GROUP];
        for pos in 0..GROUP {
            assert!(!core::mem::replace(&mut seen[acc_dim(pos)], true));
        }
        if cfg!(miri) || !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped from_acc_order: this CPU has no AVX-512F");
            return;
        }
        let x: Vec<f32> = (0..128).map(|i| i as f32).collect();
        let mut y: Vec<f32> = (0..128)
            .map(|p| (p / 64 * 64 + acc_dim(p % 64)) as f32)
            .collect();
        // SAFETY: AVX-512F checked above.
        unsafe { from_acc_order(&mut y) };
        assert_eq!(x, y);
    }

    #[test]
    fn interleave_pairs_tokens_per_dimension_in_acc_order() {
        if cfg!(miri) || !std::arch::is_x86_feature_detected!("avx512bw") {
            eprintln!("skipped: this CPU has no AVX-512BW");
            return;
        }
        // 16-bit elements: token `t`'s dimension `d` is `1000 t + d`, even and odd
        // elements of a group apart as the arithmetics keep them.
        let elems = |t: i16, odd: i16| -> [i16; 32] {
            core::array::from_fn(|e| 1000 * t + 2 * e as i16 + odd)
        };
        let mut out = [[0i32; 16]; 4];
        // SAFETY: AVX-512BW checked above; 64-byte loads and stores of 32 i16 / 16 i32.
        unsafe {
            let load = |x: [i16; 32]| _mm512_loadu_si512(x.as_ptr().cast());
            let parts = interleave(
                load(elems(0, 0)),
                load(elems(0, 1)),
                load(elems(1, 0)),
                load(elems(1, 1)),
            );
            for (o, p) in out.iter_mut().zip(parts) {
                _mm512_storeu_si512(o.as_mut_ptr().cast(), p);
            }
        }
        for (k, o) in out.iter().enumerate() {
            for (lane, &word) in o.iter().enumerate() {
                let d = acc_dim(16 * k + lane) as i32;
                assert_eq!(
                    (word as i16, (word >> 16) as i16),
                    (d as i16, 1000 + d as i16)
                );
            }
        }
    }
}
