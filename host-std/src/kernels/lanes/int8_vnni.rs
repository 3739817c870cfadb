//! Int8 codes in integer arithmetic with AVX-512 VNNI: `vpdpwssd` adds, in each of
//! sixteen 32-bit lanes, two products of 16-bit integers, so one instruction does 32
//! multiply-adds where an f32 FMA does 16, and the codes need no conversion to float.
//!
//! Both operands of each product must be integers, so the f32 side is put in 16-bit
//! fixed point, exactly as the codes put K and V in 8-bit fixed point:
//!
//! - a **query row** once per task ([`encode_query`]): codes `round(q / s)` with `s =
//!   max |q| / 32767`, so each element is off by at most `2^-16 max |q|`;
//! - the **softmax weights** of each call ([`accumulate`]): per row, codes `round(p / w)`
//!   with `w = max p / 32767` over the call's tokens (weights are never negative).
//!
//! Products and sums are then exact (32-bit lanes; see [`BLOCK`] for why they cannot
//! overflow), and the scales are applied once per score and once per accumulated
//! vector. The rounding of those two conversions is the whole of the arithmetic's error:
//! about `1e-5` of the output, some thousand times smaller than what 8-bit storage
//! itself rounds away (`cargo bench -p kvpage --bench kv_quant_error`).
//!
//! Orders. The key codes are taken as even and odd bytes (two shifts each), so a query
//! row's codes are kept, per group of 64 dimensions, as the 32 even dimensions and then
//! the 32 odd ones. The values of two tokens are interleaved per dimension (`vpunpck*wd`,
//! within 128-bit lanes), so the accumulators hold each group's dimensions in the order
//! of [`pairs::acc_dim`]; [`pairs::from_acc_order`] puts them back, once per task.

use core::arch::x86_64::*;

use super::bytes;
use super::pairs::{self, GROUP};
use crate::dtype::{Element, Kind};
use crate::kernels::MAX_HEAD_DIM;

/// The largest 16-bit code of the queries and weights.
const ONE: f32 = 32767.0;

/// Tokens whose weighted values one set of 32-bit accumulators takes before it is
/// scaled into the f32 accumulators: 128 `vpdpwssd` per lane, each adding at most `2 ×
/// 32767 × 128` in magnitude, stay below `2^31`.
const BLOCK: usize = 256;

/// Whether storage `T` with head dimension `hd` takes this arithmetic. O(1).
#[inline(always)]
pub(in crate::kernels) fn applies<T: Element>(hd: usize) -> bool {
    T::KIND == Kind::Int8 && hd.is_multiple_of(GROUP) && hd > 0
}

/// The scale that makes `max` code 32767, and its inverse: `(max / 32767, 32767 /
/// max)`; `(0, 0)` for `max == 0`, and a NaN scale when `finite` is false (so that the
/// call's output is NaN, as the f32 arithmetic's would be).
#[inline(always)]
fn fixed_point(max: f32, finite: bool) -> (f32, f32) {
    if !finite || !max.is_finite() {
        (f32::NAN, 0.0)
    } else if max > 0.0 {
        (max / ONE, ONE / max)
    } else {
        (0.0, 0.0)
    }
}

/// Puts a scaled query row (`row[..hd]`, dimension order) into the form [`scores4`] and
/// [`scores1`] read: `row[..hd / 2]` hold its 16-bit codes as bits (two per float; per
/// group of 64 dimensions the even ones, then the odd ones) and `row[hd / 2]` its
/// scale. O(hd).
///
/// # Safety
/// The CPU has AVX-512F, BW and VNNI; `applies` holds for `hd`, and `row.len() >= hd`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn encode_query(row: &mut [f32], hd: usize) {
    assert!(row.len() >= hd && hd <= MAX_HEAD_DIM);
    let rp = row.as_ptr();
    let zero = _mm512_setzero_ps();
    let (mut max, mut poison) = (zero, zero);
    // SAFETY (this block and the next): loads of `row[d..+16]` with `d + 16 <= hd`
    // (asserted; `hd` is a multiple of 64), stores of 16 codes into `codes[..hd]`.
    unsafe {
        for d in (0..hd).step_by(16) {
            let x = _mm512_loadu_ps(rp.add(d));
            max = _mm512_max_ps(max, _mm512_abs_ps(x));
            // Stays 0 unless an element is NaN or infinite.
            poison = _mm512_fmadd_ps(x, zero, poison);
        }
    }
    let finite = _mm512_reduce_add_ps(poison) == 0.0;
    let (scale, inv) = fixed_point(_mm512_reduce_max_ps(max), finite);
    let inv = _mm512_set1_ps(inv);
    let mut codes = [0i16; MAX_HEAD_DIM];
    let cp = codes.as_mut_ptr();
    unsafe {
        for d in (0..hd).step_by(32) {
            let (a, b) = (_mm512_loadu_ps(rp.add(d)), _mm512_loadu_ps(rp.add(d + 16)));
            // Dimensions `d + 2e` and `d + 2e + 1` (e < 16): the even codes of the group
            // start at its first dimension, the odd ones 32 later.
            let (group, half) = (d / GROUP * GROUP, d % GROUP / 2);
            let (even, odd) = pairs::even_odd_ps(a, b);
            for (x, at) in [(even, group + half), (odd, group + GROUP / 2 + half)] {
                let x = _mm512_mul_ps(x, inv);
                let c = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    x,
                );
                _mm256_storeu_si256(cp.add(at).cast(), _mm512_cvtsepi32_epi16(c));
            }
        }
    }
    for (slot, pair) in row[..hd / 2].iter_mut().zip(codes[..hd].chunks_exact(2)) {
        *slot = f32::from_bits(u32::from(pair[0] as u16) | u32::from(pair[1] as u16) << 16);
    }
    row[hd / 2] = scale;
}

/// The 16-bit codes of `p[..m]` (`m <= BLOCK`, not negative) in fixed point of scale
/// `max p / 32767`, two tokens to a word (the first in the low half; an odd last token
/// pairs with 0), into `words`; returns the scale (NaN if some weight is not finite).
/// O(m).
///
/// # Safety
/// The CPU has AVX-512F, BW and VNNI; `p.len() >= m`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn encode_weights(p: &[f32], m: usize, words: &mut [u32; BLOCK / 2]) -> f32 {
    assert!(p.len() >= m && m <= BLOCK);
    let zero = _mm512_setzero_ps();
    let (mut max, mut poison) = (zero, zero);
    let mask = |c: usize| -> __mmask16 {
        let left = m - c;
        if left >= 16 {
            0xFFFF
        } else {
            (1u16 << left) - 1
        }
    };
    // SAFETY (this block and the next): masked loads of `p[c..c + 16]` read only
    // `p[c..m]`; the stores write 8 words at `words[c / 2..]`, `c < m <= BLOCK`.
    unsafe {
        for c in (0..m).step_by(16) {
            let x = _mm512_maskz_loadu_ps(mask(c), p.as_ptr().add(c));
            max = _mm512_max_ps(max, x);
            poison = _mm512_fmadd_ps(x, zero, poison);
        }
    }
    let finite = _mm512_reduce_add_ps(poison) == 0.0;
    let (scale, inv) = fixed_point(_mm512_reduce_max_ps(max), finite);
    let inv = _mm512_set1_ps(inv);
    unsafe {
        for c in (0..m).step_by(16) {
            let x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask(c), p.as_ptr().add(c)), inv);
            let codes =
                _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
            _mm256_storeu_si256(
                words.as_mut_ptr().add(c / 2).cast(),
                _mm512_cvtsepi32_epi16(codes),
            );
        }
    }
    scale
}

/// The 16-bit codes of the even and of the odd bytes of `x`, sign-extended.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
fn even_odd(x: __m512i) -> (__m512i, __m512i) {
    (
        _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(x)),
        _mm512_srai_epi16::<8>(x),
    )
}

/// Integer dot products of `R` encoded query rows (`q`, `hd` floats apart) with `TOK`
/// keys of codes at `kp`: `[row][token]`, 16 partial sums each.
///
/// # Safety
/// The CPU has AVX-512F, BW and VNNI; `q` points to `R` encoded rows of `hd` floats,
/// `kp` to `TOK` keys of `hd` codes; `hd` is a non-zero multiple of 64.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn dots<const R: usize, const TOK: usize>(
    q: *const f32,
    kp: *const u8,
    hd: usize,
) -> [[__m512i; TOK]; R] {
    let zero = _mm512_setzero_si512();
    let mut a = [[zero; TOK]; R];
    let mut d = 0;
    // SAFETY: reads the 64 codes of key `i < TOK` at dimension `d` and the 64 query
    // codes of row `r < R` of group `d / 64` (128 bytes at byte `2 d` of the row, inside
    // its first `hd / 2` floats), with `d + 64 <= hd` (caller).
    unsafe {
        while d < hd {
            let mut eo = [(zero, zero); TOK];
            for (i, x) in eo.iter_mut().enumerate() {
                *x = even_odd(_mm512_loadu_si512(kp.add(i * hd + d).cast()));
            }
            for (r, ar) in a.iter_mut().enumerate() {
                let qr = q.add(r * hd).cast::<i16>().add(d);
                let (qe, qo) = (
                    _mm512_loadu_si512(qr.cast()),
                    _mm512_loadu_si512(qr.add(GROUP / 2).cast()),
                );
                for (ai, &(e, o)) in ar.iter_mut().zip(&eo) {
                    *ai = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(*ai, e, qe), o, qo);
                }
            }
            d += GROUP;
        }
    }
    a
}

/// The scale an encoded query row keeps after its codes.
///
/// # Safety
/// `q` points to an encoded row of `hd` floats.
#[inline(always)]
unsafe fn query_scale(q: *const f32, hd: usize) -> f32 {
    // SAFETY: `hd / 2 < hd` (caller).
    unsafe { *q.add(hd / 2) }
}

/// [`crate::kernels::math::Simd::scores4`] for int8 storage: `q` holds four rows
/// encoded by [`encode_query`]; the scores are of the codes (the caller applies the
/// keys' scales). Four tokens at a time (16 accumulators, one transposing reduction),
/// then one at a time.
///
/// # Safety
/// The CPU has AVX-512F, BW and VNNI; `applies::<T>(hd)` holds.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn scores4<T: Element>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    s: &mut [f32],
    stride: usize,
) {
    assert!(q.len() >= 4 * hd && k.len() >= n * hd && (n == 0 || s.len() >= 3 * stride + n));
    let (qp, kp) = (q.as_ptr(), bytes(k));
    // SAFETY: four encoded rows of `hd` floats (asserted).
    let sc: [f32; 4] = core::array::from_fn(|r| unsafe { query_scale(qp.add(r * hd), hd) });
    // Lane `4 r + i` of the reduction is row `r`, token `i`.
    let lane_scale = _mm512_setr_ps(
        sc[0], sc[0], sc[0], sc[0], sc[1], sc[1], sc[1], sc[1], sc[2], sc[2], sc[2], sc[2], sc[3],
        sc[3], sc[3], sc[3],
    );
    let mut t0 = 0;
    while t0 + 4 <= n {
        // SAFETY: keys `t0..t0 + 4` lie inside the asserted length (one byte a code).
        let a = unsafe { dots::<4, 4>(qp, kp.add(t0 * hd), hd) };
        let sums = pairs::sum16(core::array::from_fn(|j| a[j / 4][j % 4]), |x, y| {
            _mm512_add_epi32(x, y)
        });
        let mut out = [0.0f32; 16];
        // SAFETY: `out` holds 16 floats.
        unsafe {
            _mm512_storeu_ps(
                out.as_mut_ptr(),
                _mm512_mul_ps(_mm512_cvtepi32_ps(sums), lane_scale),
            );
        }
        for (r, o) in out.chunks_exact(4).enumerate() {
            s[r * stride + t0..r * stride + t0 + 4].copy_from_slice(o);
        }
        t0 += 4;
    }
    for t in t0..n {
        // SAFETY: key `t < n` lies inside the asserted length.
        let [a0, a1, a2, a3] = unsafe { dots::<4, 1>(qp, kp.add(t * hd), hd) };
        for (r, a) in [a0[0], a1[0], a2[0], a3[0]].into_iter().enumerate() {
            s[r * stride + t] = _mm512_reduce_add_epi32(a) as f32 * sc[r];
        }
    }
}

/// [`crate::kernels::math::Simd::scores1`] for int8 storage: `q` is one row encoded
/// by [`encode_query`].
///
/// # Safety
/// The CPU has AVX-512F, BW and VNNI; `applies::<T>(hd)` holds.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn scores1<T: Element>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    s: &mut [f32],
) {
    assert!(q.len() >= hd && k.len() >= n * hd && s.len() >= n);
    let (qp, kp) = (q.as_ptr(), bytes(k));
    // SAFETY: one encoded row of `hd` floats (asserted).
    let scale = unsafe { query_scale(qp, hd) };
    for (t, st) in s[..n].iter_mut().enumerate() {
        // SAFETY: key `t < n` lies inside the asserted length.
        let [[a]] = unsafe { dots::<1, 1>(qp, kp.add(t * hd), hd) };
        *st = _mm512_reduce_add_epi32(a) as f32 * scale;
    }
}

/// `acc_r += Σ_{t<n} p[r][t] * code_t` for `R` rows of `acc` (`acc_r = acc[r * hd..]`,
/// in the order of [`pairs::acc_dim`]): per [`BLOCK`] of tokens, each row's weights in 16-bit
/// fixed point, two tokens' codes interleaved per dimension, 32-bit accumulators for 64
/// dimensions (`4 R` registers), then scaled into `acc`. The caller folds the values'
/// scales into the weights `p`, which are not negative.
///
/// # Safety
/// The CPU has AVX-512F, BW and VNNI; `applies::<T>(hd)` holds; `R <= 4`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn accumulate<T: Element, const R: usize>(
    acc: &mut [f32],
    p: [&[f32]; R],
    v: &[T],
    hd: usize,
    n: usize,
) {
    assert!(acc.len() >= R * hd && p.iter().all(|p| p.len() >= n) && v.len() >= n * hd);
    let (ap, vp) = (acc.as_mut_ptr(), bytes(v));
    let zero = _mm512_setzero_si512();
    let mut t0 = 0;
    while t0 < n {
        let m = (n - t0).min(BLOCK);
        let pairs = m.div_ceil(2);
        // Each row's weights as 16-bit codes, two tokens to a 32-bit word.
        let mut w = [[0u32; BLOCK / 2]; R];
        let mut w_scale = [0.0f32; R];
        for ((wr, ws), pr) in w.iter_mut().zip(&mut w_scale).zip(&p) {
            // SAFETY: the caller's CPU; `pr[t0..]` holds `m` weights.
            *ws = unsafe { encode_weights(&pr[t0..], m, wr) };
        }
        let mut d = 0;
        // SAFETY: reads the 64 codes of values `t < t0 + m <= n` at dimension `d` and
        // reads and writes `acc[r * hd + d..+64]` (r < R), with `d + 64 <= hd` (asserted
        // lengths above); the odd token of an odd block is a zero vector, not a load.
        unsafe {
            while d < hd {
                let mut x = [[zero; 4]; R];
                for j in 0..pairs {
                    let t = t0 + 2 * j;
                    let (e0, o0) = even_odd(_mm512_loadu_si512(vp.add(t * hd + d).cast()));
                    let (e1, o1) = if t + 1 < t0 + m {
                        even_odd(_mm512_loadu_si512(vp.add((t + 1) * hd + d).cast()))
                    } else {
                        (zero, zero)
                    };
                    let parts = pairs::interleave(e0, o0, e1, o1);
                    for (xr, wr) in x.iter_mut().zip(&w) {
                        let b = _mm512_set1_epi32(*wr.get_unchecked(j) as i32);
                        for (xk, &part) in xr.iter_mut().zip(&parts) {
                            *xk = _mm512_dpwssd_epi32(*xk, part, b);
                        }
                    }
                }
                for (r, (xr, &ws)) in x.iter().zip(&w_scale).enumerate() {
                    let scale = _mm512_set1_ps(ws);
                    for (k, &xk) in xr.iter().enumerate() {
                        let a = ap.add(r * hd + d + 16 * k);
                        let sum =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(xk), scale, _mm512_loadu_ps(a));
                        _mm512_storeu_ps(a, sum);
                    }
                }
                d += GROUP;
            }
        }
        t0 += m;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vnni() -> bool {
        !cfg!(miri)
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }

    /// A deterministic spread of values in (-1, 1).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
                x as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    }

    #[test]
    fn query_codes_are_within_half_a_step() {
        if !vnni() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        let hd = 128;
        let q = values(hd, 3);
        let mut row = q.clone();
        // SAFETY: VNNI checked above.
        unsafe { encode_query(&mut row, hd) };
        let scale = row[hd / 2];
        let max = q.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert_eq!(scale, max / ONE);
        let codes: Vec<i16> = row[..hd / 2]
            .iter()
            .flat_map(|f| [f.to_bits() as u16 as i16, (f.to_bits() >> 16) as u16 as i16])
            .collect();
        for g in 0..hd / GROUP {
            for e in 0..GROUP / 2 {
                for (code, d) in [
                    (codes[g * 64 + e], 2 * e),
                    (codes[g * 64 + 32 + e], 2 * e + 1),
                ] {
                    let x = q[g * 64 + d];
                    assert!(
                        (f32::from(code) * scale - x).abs() <= 0.5 * scale * 1.0001,
                        "{x}"
                    );
                }
            }
        }
        let mut bad = q.clone();
        bad[7] = f32::INFINITY;
        // SAFETY: VNNI checked above.
        unsafe { encode_query(&mut bad, hd) };
        assert!(bad[hd / 2].is_nan());
    }

    /// The scores and the accumulation against f64 on the codes, within the fixed-point
    /// rounding of the queries and weights.
    #[test]
    fn scores_and_values_match_f64_within_the_fixed_point_rounding() {
        if !vnni() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        use crate::dtype::Int8;
        for hd in [64usize, 128, 256] {
            let n = 11;
            let codes: Vec<Int8> = values(n * hd, 9)
                .iter()
                .map(|x| Int8((x * 127.0).round() as i8))
                .collect();
            let code = |t: usize, d: usize| f64::from(codes[t * hd + d].0);
            let q = values(4 * hd, 5);
            let mut qe = q.clone();
            for row in qe.chunks_exact_mut(hd) {
                // SAFETY: VNNI checked above.
                unsafe { encode_query(row, hd) };
            }
            let stride = 16;
            let mut s = vec![f32::NAN; 4 * stride];
            let mut s1 = vec![f32::NAN; n];
            // SAFETY: VNNI checked above; `applies` holds.
            unsafe {
                scores4(&qe, &codes, hd, n, &mut s, stride);
                scores1(&qe[hd..], &codes, hd, n, &mut s1);
            }
            for r in 0..4 {
                let max = q[r * hd..(r + 1) * hd]
                    .iter()
                    .fold(0.0f32, |m, x| m.max(x.abs()));
                for t in 0..n {
                    let want: f64 = (0..hd).map(|d| f64::from(q[r * hd + d]) * code(t, d)).sum();
                    // Each query code is off by at most half a step: 127 × hd of them.
                    let bound = 0.5 * f64::from(max / ONE) * 127.0 * hd as f64 + 1e-4;
                    let got = f64::from(s[r * stride + t]);
                    assert!(
                        (got - want).abs() <= bound,
                        "hd {hd} row {r} token {t}: {got} vs {want}"
                    );
                    if r == 1 {
                        assert_eq!(s1[t], s[stride + t]);
                    }
                }
            }

            let p: Vec<f32> = values(4 * n, 1).iter().map(|x| x.abs()).collect();
            let mut acc: Vec<f32> = values(4 * hd, 2);
            let start = acc.clone();
            // SAFETY: VNNI checked above; `applies` holds; `R == 4`.
            unsafe {
                let rows = [&p[..n], &p[n..2 * n], &p[2 * n..3 * n], &p[3 * n..]];
                accumulate::<Int8, 4>(&mut acc, rows, &codes, hd, n);
            }
            let mut got = acc.clone();
            let mut before = start.clone();
            pairs::from_acc_order(&mut got);
            pairs::from_acc_order(&mut before);
            for r in 0..4 {
                let pr = &p[r * n..(r + 1) * n];
                let max = pr.iter().fold(0.0f32, |m, &x| m.max(x));
                for d in 0..hd {
                    let want = f64::from(before[r * hd + d])
                        + (0..n).map(|t| f64::from(pr[t]) * code(t, d)).sum::<f64>();
                    let bound = 0.5 * f64::from(max / ONE) * 127.0 * n as f64 + 1e-4;
                    let g = f64::from(got[r * hd + d]);
                    assert!(
                        (g - want).abs() <= bound,
                        "hd {hd} row {r} dim {d}: {g} vs {want}"
                    );
                }
            }
        }
    }
}
