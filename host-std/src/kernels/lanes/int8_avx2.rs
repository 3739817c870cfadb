//! The scores of int8 keys in 16-bit integer arithmetic on AVX2: `vpmaddwd` adds, in
//! each of eight 32-bit lanes, two products of 16-bit integers, so one instruction does
//! 16 multiply-adds where an f32 FMA does 8, and 16 codes need one sign extension
//! (`vpmovsxbw`, folded into the load) where the f32 path needs four instructions
//! (`vpmovsxbd`, `vcvtdq2ps`, twice). AVX2 has no VNNI: each `vpmaddwd` is followed by
//! a `vpaddd` into its accumulator. Per 16 dimensions of a token and four rows: 13
//! instructions against the f32 path's 17.
//!
//! The query rows are put in 16-bit fixed point once per task ([`encode_query`],
//! [`super::fixed16`], as for VNNI in [`super::int8_vnni`]); products and sums are
//! exact in 32-bit lanes (which cannot overflow: see the assertion below), and the
//! row's scale is applied once per score. Nothing is reordered: a key's codes are
//! sign-extended in dimension order, so adjacent dimensions pair against the query's
//! codes, kept in dimension order.
//!
//! Only the scores: the weighted values stay in f32 ([`super::super::avx2`]'s
//! four-row accumulation). The same fixed point for the weights (two tokens'
//! codes interleaved per dimension, `vpunpck*bw`, against a pair of 16-bit weights)
//! measured no faster: per pair of tokens and 16 dimensions of four rows it took 33
//! instructions against the f32 path's 36, `vpmaddwd` and `vpaddd` being as many
//! instructions as the FMAs they replace. Decode on Zen 3, paired against these
//! scores with the f32 accumulation: 1.02 in cache (1 x 256 tokens), 1.24 out of cache
//! (32 x 2048), where the call per chunk it needs moves the values' prefetches into
//! the scores.
//!
//! Measured (AMD EPYC Zen 3, decode of 32 query heads over 8 KV heads, head dim 128,
//! paired against the f32 scores): 0.92, 0.91 and 0.92 of the time out of cache at
//! 512, 2048 and 8192 tokens (2 threads), 0.86 in cache (one thread, 1 x 256).

use core::arch::x86_64::*;

use super::bytes;
use super::fixed16::{fixed_point, pack_pairs};
use crate::dtype::{Element, Kind};
use crate::kernels::MAX_HEAD_DIM;

/// Dimensions per load of codes (16 bytes, sign-extended to one 256-bit vector).
pub(in crate::kernels) const GROUP: usize = 16;

// A lane adds `hd / 16` products of pairs, each at most `2 × 32767 × 128` in
// magnitude; the eight lanes' sum covers `hd / 2` pairs, below `2^31` up to
// `MAX_HEAD_DIM`.
const _: () = assert!((MAX_HEAD_DIM / 2) as u64 * 2 * 32767 * 128 < 1 << 31);

/// Whether storage `T` with head dimension `hd` takes this arithmetic. O(1).
#[inline(always)]
pub(in crate::kernels) fn applies<T: Element>(hd: usize) -> bool {
    T::KIND == Kind::Int8 && hd.is_multiple_of(GROUP) && hd > 0
}

/// Where an encoded query row of `hd` floats keeps its scale: right after its codes,
/// which fill its first `hd / 2` floats.
#[inline(always)]
fn scale_slot(hd: usize) -> usize {
    hd / 2
}

/// The largest element of `x` (8 lanes, not negative).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hmax(x: __m256) -> f32 {
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), x) };
    lanes.into_iter().fold(0.0, f32::max)
}

/// Whether every lane of `poison` (a sum of `x · 0` over the inputs) is zero, that is,
/// every input was finite.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn all_finite(poison: __m256) -> bool {
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), poison) };
    lanes.iter().all(|&x| x == 0.0)
}

/// The 16-bit codes `round(x · inv)` of the 16 floats at `p`, in order (saturating;
/// the callers' scales keep them within ±32767).
///
/// # Safety
/// The CPU has AVX2; `p` points to 16 readable floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn codes16(p: *const f32, inv: __m256) -> __m256i {
    // SAFETY: 16 floats are readable (caller).
    let (a, b) = unsafe { (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) };
    let a = _mm256_cvtps_epi32(_mm256_mul_ps(a, inv));
    let b = _mm256_cvtps_epi32(_mm256_mul_ps(b, inv));
    // `packs` works per 128-bit lane: a0-3 b0-3 a4-7 b4-7, put back in order.
    _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b))
}

/// The largest magnitude of `x` (a multiple of 8 long) and whether all its elements
/// are finite. O(x.len()).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn max_abs(x: &[f32]) -> (f32, bool) {
    let (zero, sign) = (_mm256_setzero_ps(), _mm256_set1_ps(-0.0));
    let (mut max, mut poison) = (zero, zero);
    for c in x.chunks_exact(8) {
        // SAFETY: `c` holds 8 floats.
        let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
        max = _mm256_max_ps(max, _mm256_andnot_ps(sign, v));
        // Stays 0 unless an element is NaN or infinite.
        poison = _mm256_fmadd_ps(v, zero, poison);
    }
    (hmax(max), all_finite(poison))
}

/// Puts a scaled query row (`row[..hd]`) into the form [`scores4`] and [`scores1`]
/// read: its first `hd / 2` floats hold the 16-bit codes of its dimensions as bits
/// (two per float, the lower dimension in the low half), and the next float the row's
/// scale. O(hd).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `applies` holds for `hd`, and `row.len() >= hd`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn encode_query(row: &mut [f32], hd: usize) {
    assert!(row.len() >= hd && hd <= MAX_HEAD_DIM && hd.is_multiple_of(GROUP));
    let (max, finite) = max_abs(&row[..hd]);
    let (scale, inv) = fixed_point(max, finite);
    let inv = _mm256_set1_ps(inv);
    let mut codes = [0i16; MAX_HEAD_DIM];
    for (d, out) in (0..hd).step_by(GROUP).zip(codes.chunks_exact_mut(GROUP)) {
        // SAFETY: `row[d..d + 16]` is readable (`d + 16 <= hd`, asserted); `out` holds
        // 16 codes.
        unsafe {
            let c = codes16(row.as_ptr().add(d), inv);
            _mm256_storeu_si256(out.as_mut_ptr().cast(), c);
        }
    }
    pack_pairs(&mut row[..hd / 2], &codes[..hd]);
    row[scale_slot(hd)] = scale;
}

/// The 16 codes of a key or value at `p`, sign-extended to 16 bits.
///
/// # Safety
/// The CPU has AVX2; `p` points to 16 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn widen16(p: *const u8) -> __m256i {
    // SAFETY: 16 bytes are readable (caller).
    _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(p.cast()) })
}

/// `[Σ a, Σ b, Σ c, Σ d]` of four vectors of 32-bit integers.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum4(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m128i {
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
}

/// [`crate::kernels::math::Simd::scores4`] over int8 codes: `q` holds four encoded
/// rows ([`encode_query`]); the scores are of the codes (the caller applies the keys'
/// scales). Per token and 16 dimensions: one sign extension, four `vpmaddwd`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `applies::<T>(hd)`.
#[target_feature(enable = "avx2,fma,f16c")]
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
    assert!(hd.is_multiple_of(GROUP));
    let (qp, kp) = (q.as_ptr().cast::<i16>(), bytes(k));
    let f: [f32; 4] = core::array::from_fn(|r| q[r * hd + scale_slot(hd)]);
    // SAFETY: `f` holds 4 floats.
    let factor = unsafe { _mm_loadu_ps(f.as_ptr()) };
    for t in 0..n {
        // SAFETY: reads the 16 codes at `k[t * hd + d..]` and the 16 query codes at
        // (16-bit) offset `2 r hd + d` (row `r`'s first `hd / 2` floats), `d + 16 <= hd`,
        // `t < n` (asserted lengths); `out` holds 4 floats.
        let out = unsafe {
            let kt = kp.add(t * hd);
            let mut a = [_mm256_setzero_si256(); 4];
            for d in (0..hd).step_by(GROUP) {
                let key = widen16(kt.add(d));
                for (r, ar) in a.iter_mut().enumerate() {
                    let qr = _mm256_loadu_si256(qp.add(2 * r * hd + d).cast());
                    *ar = _mm256_add_epi32(*ar, _mm256_madd_epi16(key, qr));
                }
            }
            let sums = _mm_cvtepi32_ps(hsum4(a[0], a[1], a[2], a[3]));
            let mut out = [0.0f32; 4];
            _mm_storeu_ps(out.as_mut_ptr(), _mm_mul_ps(sums, factor));
            out
        };
        for (r, o) in out.into_iter().enumerate() {
            s[r * stride + t] = o;
        }
    }
}

/// [`crate::kernels::math::Simd::scores1`] over int8 codes: `q` is one encoded row.
///
/// # Safety
/// As [`scores4`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn scores1<T: Element>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    s: &mut [f32],
) {
    assert!(q.len() >= hd && k.len() >= n * hd && s.len() >= n && hd.is_multiple_of(GROUP));
    let (qp, kp) = (q.as_ptr().cast::<i16>(), bytes(k));
    let f = q[scale_slot(hd)];
    for (t, st) in s[..n].iter_mut().enumerate() {
        // SAFETY: as in `scores4`, for one row.
        let sum = unsafe {
            let kt = kp.add(t * hd);
            let mut a = _mm256_setzero_si256();
            for d in (0..hd).step_by(GROUP) {
                let qv = _mm256_loadu_si256(qp.add(d).cast());
                a = _mm256_add_epi32(a, _mm256_madd_epi16(widen16(kt.add(d)), qv));
            }
            let zero = _mm256_setzero_si256();
            _mm_cvtsi128_si32(hsum4(a, zero, zero, zero))
        };
        *st = sum as f32 * f;
    }
}

#[cfg(test)]
mod tests {
    use super::super::pairs::test_values as values;
    use super::*;
    use crate::dtype::Int8;

    fn avx2() -> bool {
        !cfg!(miri)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }

    #[test]
    fn query_codes_are_within_half_a_step_in_dimension_order() {
        if !avx2() {
            eprintln!("skipped: this CPU has no AVX2 + FMA + F16C");
            return;
        }
        for hd in [16usize, 48, 128] {
            let q = values(hd, 3);
            let mut row = q.clone();
            // SAFETY: AVX2 checked above.
            unsafe { encode_query(&mut row, hd) };
            let scale = row[scale_slot(hd)];
            let max = q.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            assert_eq!(scale, max / 32767.0);
            for (d, &x) in q.iter().enumerate() {
                let bits = row[d / 2].to_bits() >> (16 * (d % 2));
                let code = bits as u16 as i16;
                assert!(
                    (f32::from(code) * scale - x).abs() <= 0.5 * scale * 1.0001,
                    "hd {hd} dim {d}: {x} vs code {code}"
                );
            }
        }
        let mut bad = values(32, 1);
        bad[7] = f32::NAN;
        // SAFETY: AVX2 checked above.
        unsafe { encode_query(&mut bad, 32) };
        assert!(bad[scale_slot(32)].is_nan());
    }

    /// The scores against f64 on the codes, with extreme codes (±127, and the unused
    /// −128) in the mix, for head dims 16, 48, 128 and 256. Two checks per score: the
    /// exact integer dot product of the row's codes, scaled once, within f32 rounding;
    /// and against the f32 row, within the fixed point's bound (each query element off
    /// by at most half a step, times the key's code) plus that rounding.
    #[test]
    fn scores_match_f64() {
        if !avx2() {
            eprintln!("skipped: this CPU has no AVX2 + FMA + F16C");
            return;
        }
        for (hd, n) in [(16usize, 3usize), (48, 11), (128, 9), (256, 5)] {
            let codes: Vec<Int8> = values(n * hd, 9)
                .into_iter()
                .enumerate()
                .map(|(i, x)| match i % 97 {
                    0 => Int8(127),
                    1 => Int8(-128),
                    2 => Int8(-127),
                    _ => Int8((x * 127.0).round() as i8),
                })
                .collect();
            let code = |t: usize, d: usize| i64::from(codes[t * hd + d].0);
            let q = values(4 * hd, 5);
            let mut qe = q.clone();
            for row in qe.chunks_exact_mut(hd) {
                // SAFETY: AVX2 checked above.
                unsafe { encode_query(row, hd) };
            }
            let stride = n + 3;
            let (mut s, mut s1) = (vec![f32::NAN; 4 * stride], vec![f32::NAN; n]);
            // SAFETY: AVX2 checked above; the lengths fit.
            unsafe {
                scores4::<Int8>(&qe, &codes, hd, n, &mut s, stride);
                scores1::<Int8>(&qe[2 * hd..], &codes, hd, n, &mut s1);
            }
            for r in 0..4 {
                let row = &qe[r * hd..(r + 1) * hd];
                let scale = f64::from(row[scale_slot(hd)]);
                let qcode =
                    |d: usize| i64::from((row[d / 2].to_bits() >> (16 * (d % 2))) as u16 as i16);
                for t in 0..n {
                    let exact = (0..hd).map(|d| qcode(d) * code(t, d)).sum::<i64>() as f64 * scale;
                    let terms = (0..hd).map(|d| f64::from(q[r * hd + d]) * code(t, d) as f64);
                    let (want, size) =
                        (terms.clone().sum::<f64>(), terms.map(f64::abs).sum::<f64>());
                    let step = 0.5 * scale * (0..hd).map(|d| code(t, d).abs() as f64).sum::<f64>();
                    let mut got = vec![f64::from(s[r * stride + t])];
                    if r == 2 {
                        got.push(f64::from(s1[t]));
                    }
                    for g in got {
                        assert!(
                            (g - exact).abs() <= 1e-6 * size,
                            "hd {hd} row {r} token {t}: {g} vs the codes' {exact}"
                        );
                        assert!(
                            (g - want).abs() <= step * 1.0001 + 1e-6 * size,
                            "hd {hd} row {r} token {t}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
