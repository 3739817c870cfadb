//! The in-lane bf16 arithmetic on AVX-512F: groups of 32 dimensions (16 even, then 16
//! odd), one 64-byte load widened by a shift and a mask.

use core::arch::x86_64::*;

use super::bytes;
use crate::dtype::Element;
use crate::kernels::avx2::hsum4;
use crate::kernels::reduce;

/// Dimensions per group of the split order.
pub(in crate::kernels) const GROUP: usize = 32;

/// Widens the 32 bf16 at `p` to (even elements, odd elements) as f32.
///
/// # Safety
/// `p` points to 64 readable bytes; the CPU has AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn split32(p: *const u8) -> (__m512, __m512) {
    // SAFETY: 64 readable bytes (caller).
    let x = unsafe { _mm512_loadu_si512(p.cast()) };
    let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(x));
    let odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(-65536)));
    (even, odd)
}

/// The 16 lanes of `a` folded to 8.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
fn fold(a: __m512) -> __m256 {
    let high = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a));
    _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(high))
}

/// Scores of the four rows of `qp` (split order) against `TOK` keys from `kp`:
/// `[token][row]`. `TOK` accumulators per row (16 for four tokens).
///
/// # Safety
/// The CPU has AVX-512F; `qp` points to 4 rows of `hd` floats, `kp` to `TOK` keys of
/// `hd` bf16 each; `hd` is a non-zero multiple of 32.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn score_block<const TOK: usize>(
    qp: *const f32,
    kp: *const u8,
    hd: usize,
) -> [[__m512; TOK]; 4] {
    let zero = _mm512_setzero_ps();
    let mut a = [[zero; TOK]; 4];
    let mut d = 0;
    // SAFETY: loads `qp[r * hd + d..+32]` and the 64 bytes of key `i` at dimension `d`,
    // with `d + 32 <= hd` (caller).
    unsafe {
        while d < hd {
            let mut ks = [(zero, zero); TOK];
            for (i, ki) in ks.iter_mut().enumerate() {
                *ki = split32(kp.add(2 * (i * hd + d)));
            }
            for (r, ar) in a.iter_mut().enumerate() {
                let qe = _mm512_loadu_ps(qp.add(r * hd + d));
                let qo = _mm512_loadu_ps(qp.add(r * hd + d + 16));
                for (ai, (ke, ko)) in ar.iter_mut().zip(ks) {
                    *ai = _mm512_fmadd_ps(qo, ko, _mm512_fmadd_ps(qe, ke, *ai));
                }
            }
            d += 32;
        }
    }
    a
}

/// [`crate::kernels::math::Simd::scores4`] for bf16 storage: `q` (four rows) is in split
/// order.
/// Four tokens at a time, then one at a time.
///
/// # Safety
/// The CPU has AVX-512F; `applies::<T>(hd, GROUP)` holds.
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
        // asserted lengths.
        if t0 + 4 <= n {
            let sums = unsafe { score_block::<4>(qp, kp.add(2 * t0 * hd), hd) };
            let sums = reduce::sums_4x4(sums);
            for (r, row) in sums.iter().enumerate() {
                s[r * stride + t0..r * stride + t0 + 4].copy_from_slice(row);
            }
            t0 += 4;
        } else {
            let [[a0], [a1], [a2], [a3]] = unsafe { score_block::<1>(qp, kp.add(2 * t0 * hd), hd) };
            let sums = hsum4(fold(a0), fold(a1), fold(a2), fold(a3));
            for (r, &sum) in sums.iter().enumerate() {
                s[r * stride + t0] = sum;
            }
            t0 += 1;
        }
    }
}

/// [`crate::kernels::math::Simd::scores1`] for bf16 storage: `q` is in split order.
///
/// # Safety
/// The CPU has AVX-512F; `applies::<T>(hd, GROUP)` holds.
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
        // SAFETY: loads `q[d..+32]` and the 64 bytes of key `t` at dimension `d`, with
        // `d + 32 <= hd`, `t < n`.
        *st = unsafe {
            let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut d = 0;
            while d < hd {
                let (ke, ko) = split32(kp.add(2 * (t * hd + d)));
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(d)), ke, a0);
                a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(d + 16)), ko, a1);
                d += 32;
            }
            _mm512_reduce_add_ps(_mm512_add_ps(a0, a1))
        };
    }
}

/// `acc_r += Σ_{t<n} p[r][t] * v_t` for `R` rows of `acc` (`acc_r = acc[r * hd..]`,
/// split order): 64 dimensions of the `R` rows at a time (`4 R` registers of
/// accumulators), then a last group of 32. Each stored vector is loaded and widened once.
///
/// # Safety
/// The CPU has AVX-512F; `applies::<T>(hd, GROUP)` holds.
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
    // SAFETY: each span reads and writes `acc[r * hd + d..+32 G]` (r < R), reads the
    // `64 G` bytes of values `t < n` at dimension `d` and `p[r][t]`, with
    // `d + 32 G <= hd` (asserted lengths above).
    unsafe {
        while d + 64 <= hd {
            span::<R, 2>(ap.add(d), vp.add(2 * d), &p, hd, n);
            d += 64;
        }
        if d < hd {
            span::<R, 1>(ap.add(d), vp.add(2 * d), &p, hd, n);
        }
    }
}

/// [`accumulate`] over `G` groups of 32 dimensions starting at `ap` / `vp`.
///
/// # Safety
/// The CPU has AVX-512F; `ap[r * hd..+32 G]` (r < R) are writable, the `64 G` bytes at
/// `vp + 2 t hd` readable and `p[r][t]` exists for `t < n`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn span<const R: usize, const G: usize>(
    ap: *mut f32,
    vp: *const u8,
    p: &[&[f32]; R],
    hd: usize,
    n: usize,
) {
    // SAFETY: the accesses the caller guarantees.
    unsafe {
        let zero = _mm512_setzero_ps();
        let mut x = [[[zero; 2]; G]; R];
        for (r, xr) in x.iter_mut().enumerate() {
            for (g, xg) in xr.iter_mut().enumerate() {
                for (i, xi) in xg.iter_mut().enumerate() {
                    *xi = _mm512_loadu_ps(ap.add(r * hd + 32 * g + 16 * i));
                }
            }
        }
        for t in 0..n {
            let mut vs = [(zero, zero); G];
            for (g, vg) in vs.iter_mut().enumerate() {
                *vg = split32(vp.add(2 * t * hd + 64 * g));
            }
            for (r, xr) in x.iter_mut().enumerate() {
                let b = _mm512_set1_ps(*p[r].get_unchecked(t));
                for (xg, (e, o)) in xr.iter_mut().zip(vs) {
                    xg[0] = _mm512_fmadd_ps(b, e, xg[0]);
                    xg[1] = _mm512_fmadd_ps(b, o, xg[1]);
                }
            }
        }
        for (r, xr) in x.iter().enumerate() {
            for (g, xg) in xr.iter().enumerate() {
                for (i, xi) in xg.iter().enumerate() {
                    _mm512_storeu_ps(ap.add(r * hd + 32 * g + 16 * i), *xi);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split32_widens_even_and_odd_exactly() {
        if cfg!(miri) || !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        let vals: Vec<half::bf16> = (0..32)
            .map(|i| half::bf16::from_f32((i as f32 - 15.5) * 1.37e3))
            .collect();
        let mut out = [0.0f32; 32];
        // SAFETY: AVX-512F present; `vals` holds 64 bytes; `out` 32 floats.
        unsafe {
            let (e, o) = split32(vals.as_ptr().cast());
            _mm512_storeu_ps(out.as_mut_ptr(), e);
            _mm512_storeu_ps(out.as_mut_ptr().add(16), o);
        }
        for i in 0..16 {
            assert_eq!(out[i], vals[2 * i].to_f32());
            assert_eq!(out[16 + i], vals[2 * i + 1].to_f32());
        }
    }
}
