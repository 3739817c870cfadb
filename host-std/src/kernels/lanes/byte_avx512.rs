//! The in-lane arithmetic for the 8-bit codes (int8, FP8 E4M3) on AVX-512F: groups of
//! 64 dimensions (four parts of 16: dimensions `4i`, then `4i + 1`, `4i + 2`, `4i + 3`),
//! one 64-byte load widened per part by two shifts (and, for FP8, the decode of
//! [`crate::kernels::avx512::fp8_16`]). The codes' scales are applied by the caller.

use core::arch::x86_64::*;

use super::bytes;
use crate::dtype::{Element, Kind};
use crate::kernels::avx2::hsum4;
use crate::kernels::avx512::fp8_16;
use crate::kernels::reduce;

/// Dimensions per group of the split order.
pub(in crate::kernels) const GROUP: usize = 64;
/// Parts of a group (codes per 32-bit lane).
pub(in crate::kernels) const PARTS: usize = 4;

/// Part `j` of the 64 codes in `x` (byte `j` of each 32-bit lane) as f32 codes.
///
/// # Safety
/// The CPU has AVX-512F; `T` is an 8-bit code type.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
fn part<T: Element>(x: __m512i, j: usize) -> __m512 {
    // Byte `j` to the top of the lane.
    let top = match j {
        0 => _mm512_slli_epi32::<24>(x),
        1 => _mm512_slli_epi32::<16>(x),
        2 => _mm512_slli_epi32::<8>(x),
        _ => x,
    };
    match T::KIND {
        Kind::Int8 => _mm512_cvtepi32_ps(_mm512_srai_epi32::<24>(top)),
        _ => fp8_16(_mm512_srli_epi32::<24>(top)),
    }
}

/// The 16 lanes of `a` folded to 8.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
fn fold(a: __m512) -> __m256 {
    let high = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a));
    _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(high))
}

/// Scores of the four rows of `qp` (split order) against `TOK` keys of codes at `kp`:
/// `[token][row]`, unscaled.
///
/// # Safety
/// The CPU has AVX-512F; `qp` points to 4 rows of `hd` floats, `kp` to `TOK` keys of
/// `hd` codes; `hd` is a non-zero multiple of 64; `T` is an 8-bit code type.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn score_block<T: Element, const TOK: usize>(
    qp: *const f32,
    kp: *const u8,
    hd: usize,
) -> [[__m512; TOK]; 4] {
    let zero = _mm512_setzero_ps();
    let mut a = [[zero; TOK]; 4];
    let mut d = 0;
    // SAFETY: loads `qp[r * hd + d..+64]` and the 64 codes of key `i` at dimension `d`,
    // with `d + 64 <= hd` (caller).
    unsafe {
        while d < hd {
            let mut raw = [_mm512_setzero_si512(); TOK];
            for (i, x) in raw.iter_mut().enumerate() {
                *x = _mm512_loadu_si512(kp.add(i * hd + d).cast());
            }
            for j in 0..PARTS {
                let mut ks = [zero; TOK];
                for (k, &x) in ks.iter_mut().zip(&raw) {
                    *k = part::<T>(x, j);
                }
                for (r, ar) in a.iter_mut().enumerate() {
                    let q = _mm512_loadu_ps(qp.add(r * hd + d + 16 * j));
                    for (ai, &k) in ar.iter_mut().zip(&ks) {
                        *ai = _mm512_fmadd_ps(q, k, *ai);
                    }
                }
            }
            d += GROUP;
        }
    }
    a
}

/// [`crate::kernels::math::Simd::scores4`] for 8-bit storage: `q` (four rows) is in
/// split order; the scores are of the codes (the caller scales them). Four tokens at a
/// time, then one at a time.
///
/// # Safety
/// The CPU has AVX-512F; `applies_bytes::<T>(hd)` holds.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
    let mut t0 = 0;
    while t0 < n {
        // SAFETY: four rows of `q` and keys `t0..t0 + 4` (or `t0`) lie inside the
        // asserted lengths; codes are one byte each.
        if t0 + 4 <= n {
            let sums = unsafe { score_block::<T, 4>(qp, kp.add(t0 * hd), hd) };
            let sums = reduce::sums_4x4(sums);
            for (r, row) in sums.iter().enumerate() {
                s[r * stride + t0..r * stride + t0 + 4].copy_from_slice(row);
            }
            t0 += 4;
        } else {
            let [[a0], [a1], [a2], [a3]] = unsafe { score_block::<T, 1>(qp, kp.add(t0 * hd), hd) };
            let sums = hsum4(fold(a0), fold(a1), fold(a2), fold(a3));
            for (r, &sum) in sums.iter().enumerate() {
                s[r * stride + t0] = sum;
            }
            t0 += 1;
        }
    }
}

/// [`crate::kernels::math::Simd::scores1`] for 8-bit storage: `q` is in split order.
///
/// # Safety
/// The CPU has AVX-512F; `applies_bytes::<T>(hd)` holds.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
    for (t, st) in s[..n].iter_mut().enumerate() {
        // SAFETY: loads `q[d..+64]` and the 64 codes of key `t` at dimension `d`, with
        // `d + 64 <= hd`, `t < n`.
        *st = unsafe {
            let mut a = [_mm512_setzero_ps(); PARTS];
            let mut d = 0;
            while d < hd {
                let x = _mm512_loadu_si512(kp.add(t * hd + d).cast());
                for (j, aj) in a.iter_mut().enumerate() {
                    let q = _mm512_loadu_ps(qp.add(d + 16 * j));
                    *aj = _mm512_fmadd_ps(q, part::<T>(x, j), *aj);
                }
                d += GROUP;
            }
            _mm512_reduce_add_ps(_mm512_add_ps(
                _mm512_add_ps(a[0], a[1]),
                _mm512_add_ps(a[2], a[3]),
            ))
        };
    }
}

/// `acc_r += Σ_{t<n} p[r][t] * code_t` for `R` rows of `acc` (`acc_r = acc[r * hd..]`,
/// split order), 64 dimensions at a time (`4 R` registers of accumulators); each
/// stored vector is loaded and widened once. The caller folds the values' scales into
/// the weights `p`.
///
/// # Safety
/// The CPU has AVX-512F; `applies_bytes::<T>(hd)` holds; `R <= 4`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
    let mut d = 0;
    // SAFETY: reads and writes `acc[r * hd + d..+64]` (r < R), reads the 64 codes of
    // value `t < n` at dimension `d` and `p[r][t]`, with `d + 64 <= hd` (asserted
    // lengths above).
    unsafe {
        while d < hd {
            let mut x = [[_mm512_setzero_ps(); PARTS]; R];
            for (r, xr) in x.iter_mut().enumerate() {
                for (j, xj) in xr.iter_mut().enumerate() {
                    *xj = _mm512_loadu_ps(ap.add(r * hd + d + 16 * j));
                }
            }
            for t in 0..n {
                let raw = _mm512_loadu_si512(vp.add(t * hd + d).cast());
                let vs = [
                    part::<T>(raw, 0),
                    part::<T>(raw, 1),
                    part::<T>(raw, 2),
                    part::<T>(raw, 3),
                ];
                for (r, xr) in x.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*p[r].get_unchecked(t));
                    for (xj, &vj) in xr.iter_mut().zip(&vs) {
                        *xj = _mm512_fmadd_ps(b, vj, *xj);
                    }
                }
            }
            for (r, xr) in x.iter().enumerate() {
                for (j, xj) in xr.iter().enumerate() {
                    _mm512_storeu_ps(ap.add(r * hd + d + 16 * j), *xj);
                }
            }
            d += GROUP;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{Fp8E4m3, Int8};

    fn widens_every_part<T: Element>(codes: &[u8; 64]) {
        let mut out = [0.0f32; 64];
        // SAFETY: AVX-512F present (checked by the caller); 64 readable bytes; 64 floats.
        unsafe {
            let x = _mm512_loadu_si512(codes.as_ptr().cast());
            for j in 0..PARTS {
                _mm512_storeu_ps(out.as_mut_ptr().add(16 * j), part::<T>(x, j));
            }
        }
        for i in 0..16 {
            for j in 0..PARTS {
                let c = codes[4 * i + j];
                let want = match T::KIND {
                    Kind::Int8 => f32::from(c as i8),
                    _ => crate::quant::fp8::decode(c),
                };
                let got = out[16 * j + i];
                assert!(
                    got == want || (got.is_nan() && want.is_nan()),
                    "code {c:#04x}"
                );
            }
        }
    }

    #[test]
    fn every_code_widens_exactly_in_every_part() {
        if cfg!(miri) || !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        for start in [0u8, 64, 128, 192] {
            let codes: [u8; 64] = core::array::from_fn(|i| start.wrapping_add(i as u8));
            widens_every_part::<Int8>(&codes);
            widens_every_part::<Fp8E4m3>(&codes);
        }
    }
}
