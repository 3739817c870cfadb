//! The in-lane bf16 arithmetic on AVX2 + FMA: groups of 16 dimensions (8 even, then 8
//! odd), one 32-byte load widened by a shift and a mask. Register blocking as the
//! general AVX2 path: scores take four rows per token with two chains per row (even and
//! odd dimensions: 8 accumulators); accumulation keeps 8 registers of output lanes.

use core::arch::x86_64::*;

use super::bytes;
use crate::dtype::Element;
use crate::kernels::avx2::{hsum4, store_token_scores};

/// Dimensions per group of the split order.
pub(in crate::kernels) const GROUP: usize = 16;

/// Widens the 16 bf16 at `p` to (even elements, odd elements) as f32.
///
/// # Safety
/// `p` points to 32 readable bytes; the CPU has AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn split16(p: *const u8) -> (__m256, __m256) {
    // SAFETY: 32 readable bytes (caller).
    let x = unsafe { _mm256_loadu_si256(p.cast()) };
    let even = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(x));
    let odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(-65536)));
    (even, odd)
}

/// [`crate::kernels::math::Simd::scores4`] for bf16 storage: `q` (four rows) is in
/// split order. In a step of `passes`, two tokens at a time ([`scores4_token_pairs`]);
/// in decode, one.
///
/// # Safety
/// The CPU has AVX2 and FMA; `applies::<T>(hd, GROUP)` holds.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn scores4<T: Element>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    s: &mut [f32],
    stride: usize,
    passes: bool,
) {
    assert!(q.len() >= 4 * hd && k.len() >= n * hd && (n == 0 || s.len() >= 3 * stride + n));
    let (qp, kp) = (q.as_ptr(), bytes(k));
    let first = if passes {
        // SAFETY: the lengths asserted above; AVX2 + FMA (caller).
        unsafe { scores4_token_pairs(q, k, hd, n, s, stride) }
    } else {
        0
    };
    for t in first..n {
        // SAFETY: loads `q[r * hd + d..+16]` and the 32 bytes of key `t` at dimension
        // `d`, with `d + 16 <= hd`, `t < n` (asserted lengths above).
        let sums = unsafe {
            let mut a = [_mm256_setzero_ps(); 8];
            let mut d = 0;
            while d < hd {
                let (ke, ko) = split16(kp.add(2 * (t * hd + d)));
                for r in 0..4 {
                    let qr = qp.add(r * hd + d);
                    a[2 * r] = _mm256_fmadd_ps(_mm256_loadu_ps(qr), ke, a[2 * r]);
                    a[2 * r + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(qr.add(8)), ko, a[2 * r + 1]);
                }
                d += GROUP;
            }
            hsum4(
                _mm256_add_ps(a[0], a[1]),
                _mm256_add_ps(a[2], a[3]),
                _mm256_add_ps(a[4], a[5]),
                _mm256_add_ps(a[6], a[7]),
            )
        };
        for (r, sum) in sums.into_iter().enumerate() {
            s[r * stride + t] = sum;
        }
    }
}

/// [`scores4`] two tokens at a time, while two are left: each query vector loaded
/// (the even and the odd dimensions of a group) serves both tokens' keys, so a group
/// of 16 dimensions loads 2 keys and 8 query vectors for 16 FMAs, where one token at a
/// time loads 1 and 8 for 8. A token's even and odd products go into one accumulator
/// per row (8 in all, beside 4 key vectors and 2 query vectors). Returns the tokens
/// done (`n` rounded down to even).
///
/// Measured on Zen 3 (paired against one token at a time, chunked prefill of 512 new
/// tokens after 1536, 32 query heads over 8 KV heads, head dim 128): 0.89 and 0.92 of
/// the time on one thread (median of 5 and 4 rounds, 0.85-1.03 each), 0.95 on two.
/// Decode keeps one token at a time (two measured 0.95-1.00 there).
///
/// # Safety
/// The CPU has AVX2 and FMA; `applies::<T>(hd, GROUP)` holds; `q.len() >= 4 * hd`,
/// `k.len() >= n * hd`, `s.len() >= 3 * stride + n` (when `n > 0`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scores4_token_pairs<T: Element>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    s: &mut [f32],
    stride: usize,
) -> usize {
    let (qp, kp) = (q.as_ptr(), bytes(k));
    let mut t = 0;
    while t + 2 <= n {
        let mut a = [[_mm256_setzero_ps(); 4]; 2];
        // SAFETY: loads `q[r * hd + d..+16]` and the 32 bytes of keys `t` and `t + 1`
        // at dimension `d`, with `d + 16 <= hd`, `t + 1 < n` (caller's lengths).
        unsafe {
            let mut d = 0;
            while d < hd {
                let keys = [
                    split16(kp.add(2 * (t * hd + d))),
                    split16(kp.add(2 * ((t + 1) * hd + d))),
                ];
                for r in 0..4 {
                    let qr = qp.add(r * hd + d);
                    let (qe, qo) = (_mm256_loadu_ps(qr), _mm256_loadu_ps(qr.add(8)));
                    for (ag, (ke, ko)) in a.iter_mut().zip(keys) {
                        ag[r] = _mm256_fmadd_ps(qo, ko, _mm256_fmadd_ps(qe, ke, ag[r]));
                    }
                }
                d += GROUP;
            }
        }
        store_token_scores(&a, s, stride, t);
        t += 2;
    }
    t
}

/// [`crate::kernels::math::Simd::scores1`] for bf16 storage: `q` is in split order.
///
/// # Safety
/// The CPU has AVX2 and FMA; `applies::<T>(hd, GROUP)` holds.
#[target_feature(enable = "avx2,fma,f16c")]
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
        // SAFETY: loads `q[d..+16]` and the 32 bytes of key `t` at dimension `d`, with
        // `d + 16 <= hd`, `t < n`.
        *st = unsafe {
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut d = 0;
            while d < hd {
                let (ke, ko) = split16(kp.add(2 * (t * hd + d)));
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(d)), ke, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(d + 8)), ko, a1);
                d += GROUP;
            }
            let z = _mm256_setzero_ps();
            hsum4(_mm256_add_ps(a0, a1), z, z, z)[0]
        };
    }
}

/// `acc_r += Σ_{t<n} p[r][t] * v_t` for `R` rows of `acc` (`acc_r = acc[r * hd..]`,
/// split order): `G = 4 / R` groups of 16 dimensions at a time (8 registers of
/// accumulators), then single groups. Each stored vector is loaded and widened once.
///
/// # Safety
/// The CPU has AVX2 and FMA; `applies::<T>(hd, GROUP)` holds; `R` is 1, 2 or 4.
#[target_feature(enable = "avx2,fma,f16c")]
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
    let wide = GROUP * (4 / R);
    let mut d = 0;
    // SAFETY: each span reads and writes `acc[r * hd + d..+16 G]` (r < R), reads the
    // `32 G` bytes of values `t < n` at dimension `d` and `p[r][t]`, with
    // `d + 16 G <= hd` (asserted lengths above).
    unsafe {
        while d + wide <= hd {
            match R {
                1 => span::<R, 4>(ap.add(d), vp.add(2 * d), &p, hd, n),
                2 => span::<R, 2>(ap.add(d), vp.add(2 * d), &p, hd, n),
                _ => span::<R, 1>(ap.add(d), vp.add(2 * d), &p, hd, n),
            }
            d += wide;
        }
        while d < hd {
            span::<R, 1>(ap.add(d), vp.add(2 * d), &p, hd, n);
            d += GROUP;
        }
    }
}

/// [`accumulate`] over `G` groups of 16 dimensions starting at `ap` / `vp`.
///
/// # Safety
/// The CPU has AVX2 and FMA; `ap[r * hd..+16 G]` (r < R) are writable, the `32 G` bytes
/// at `vp + 2 t hd` readable and `p[r][t]` exists for `t < n`.
#[target_feature(enable = "avx2,fma,f16c")]
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
        let zero = _mm256_setzero_ps();
        let mut x = [[[zero; 2]; G]; R];
        for (r, xr) in x.iter_mut().enumerate() {
            for (g, xg) in xr.iter_mut().enumerate() {
                for (i, xi) in xg.iter_mut().enumerate() {
                    *xi = _mm256_loadu_ps(ap.add(r * hd + GROUP * g + 8 * i));
                }
            }
        }
        for t in 0..n {
            let mut vs = [(zero, zero); G];
            for (g, vg) in vs.iter_mut().enumerate() {
                *vg = split16(vp.add(2 * t * hd + 32 * g));
            }
            for (r, xr) in x.iter_mut().enumerate() {
                let b = _mm256_set1_ps(*p[r].get_unchecked(t));
                for (xg, (e, o)) in xr.iter_mut().zip(vs) {
                    xg[0] = _mm256_fmadd_ps(b, e, xg[0]);
                    xg[1] = _mm256_fmadd_ps(b, o, xg[1]);
                }
            }
        }
        for (r, xr) in x.iter().enumerate() {
            for (g, xg) in xr.iter().enumerate() {
                for (i, xi) in xg.iter().enumerate() {
                    _mm256_storeu_ps(ap.add(r * hd + GROUP * g + 8 * i), *xi);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split16_widens_even_and_odd_exactly() {
        if cfg!(miri) || !std::arch::is_x86_feature_detected!("avx2") {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        let vals: Vec<half::bf16> = (0..16)
            .map(|i| half::bf16::from_f32((i as f32 - 7.5) * 1.37e3))
            .collect();
        let mut out = [0.0f32; 16];
        // SAFETY: AVX2 present; `vals` holds 32 bytes; `out` 16 floats.
        unsafe {
            let (e, o) = split16(vals.as_ptr().cast());
            _mm256_storeu_ps(out.as_mut_ptr(), e);
            _mm256_storeu_ps(out.as_mut_ptr().add(8), o);
        }
        for i in 0..8 {
            assert_eq!(out[i], vals[2 * i].to_f32());
            assert_eq!(out[8 + i], vals[2 * i + 1].to_f32());
        }
    }
}
