//! [`Simd`] with AVX-512F intrinsics (x86-64): the scores and the accumulation, the two
//! loops that do all the multiply-adds, on 16-lane registers; `max`, `exp` and `scale`
//! (a small share of the work) come from [`super::avx2`]. Scores take 4 query rows × 4
//! tokens (16 accumulators), accumulation 4 rows × 64 lanes. bf16 storage with a head
//! dim that is a multiple of 32 goes to [`super::lanes`], which widens in lanes.

use core::arch::x86_64::*;

use super::avx2::{hsum4, Avx2};
use super::lanes::{self, bf16_avx512 as bf16, byte_avx512 as bytes};
use super::math::{self, Simd};
use super::reduce;
use crate::dtype::{Element, Kind};

/// The AVX-512F implementation. Only [`Avx512::detect`] makes one, so holding a value
/// proves the CPU has AVX-512F (and the AVX2 set [`Avx2`] needs).
#[derive(Clone, Copy)]
pub(crate) struct Avx512 {
    avx2: Avx2,
}

impl Avx512 {
    /// `Some` if the CPU has AVX-512F, AVX2, FMA and F16C (and [`super::CPU_PATH_ENV`]
    /// allows them). O(1) after the first call.
    #[inline]
    pub(crate) fn detect() -> Option<Self> {
        let avx2 = Avx2::detect()?;
        (super::path_ceiling() >= 2 && std::arch::is_x86_feature_detected!("avx512f"))
            .then_some(Self { avx2 })
    }

    /// The same arithmetic with FP8's route given ([`Avx2::with_fp8_route`]). O(1).
    #[cfg(test)]
    pub(crate) fn with_fp8_route(self, half: bool) -> Self {
        Self {
            avx2: self.avx2.with_fp8_route(half),
        }
    }

    /// Whether storage `T` with head dim `hd` takes the in-lane 8-bit route
    /// ([`lanes::applies_bytes`]), FP8's route as the held [`Avx2`] decided it (no
    /// CPUID read per call). O(1).
    #[inline(always)]
    fn bytes<T: Element>(self, hd: usize) -> bool {
        lanes::applies_bytes::<T>(hd, self.avx2.fp8_through_f16())
    }
}

/// The element-wise methods of [`Simd`] on f32 (`max`, `exp_shifted_sum`, `scale`)
/// for an arithmetic that holds an [`Avx512`] in its field `avx512` and keeps that
/// one's: the dot-product extensions ([`super::dot`]) and AMX ([`super::amx`]).
macro_rules! elementwise_of_avx512 {
    () => {
        #[inline(always)]
        fn max(self, x: &[f32]) -> f32 {
            self.avx512.max(x)
        }
        #[inline(always)]
        fn exp_shifted_sum(self, x: &mut [f32], shift: f32) -> f32 {
            self.avx512.exp_shifted_sum(x, shift)
        }
        #[inline(always)]
        fn scale(self, x: &mut [f32], c: f32) {
            self.avx512.scale(x, c)
        }
    };
}
pub(super) use elementwise_of_avx512;

// SAFETY (every method): an `Avx512` value exists only when `detect` found AVX-512F.
impl Simd for Avx512 {
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
        if lanes::applies::<T>(hd, bf16::GROUP) {
            unsafe { bf16::scores4(q, k, hd, n, s, s_stride) }
        } else if self.bytes::<T>(hd) {
            unsafe { bytes::scores4(q, k, hd, n, s, s_stride) }
        } else {
            unsafe { scores4(q, k, hd, n, s, s_stride) }
        }
    }
    #[inline(always)]
    fn scores1<T: Element>(self, q: &[f32], k: &[T], hd: usize, n: usize, s: &mut [f32]) {
        if lanes::applies::<T>(hd, bf16::GROUP) {
            unsafe { bf16::scores1(q, k, hd, n, s) }
        } else if self.bytes::<T>(hd) {
            unsafe { bytes::scores1(q, k, hd, n, s) }
        } else {
            unsafe { scores1(q, k, hd, n, s) }
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
        if lanes::applies::<T>(hd, bf16::GROUP) {
            unsafe { bf16::accumulate::<T, 2>(acc, [p0, p1], v, hd, n) }
        } else if self.bytes::<T>(hd) {
            unsafe { bytes::accumulate::<T, 2>(acc, [p0, p1], v, hd, n) }
        } else {
            unsafe { accumulate2(acc, p0, p1, v, hd, n) }
        }
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
        if lanes::applies::<T>(hd, bf16::GROUP) {
            unsafe { bf16::accumulate::<T, 4>(acc, p, v, hd, n) }
        } else if self.bytes::<T>(hd) {
            unsafe { bytes::accumulate::<T, 4>(acc, p, v, hd, n) }
        } else {
            unsafe { accumulate4(acc, p, v, hd, n) }
        }
    }
    #[inline(always)]
    fn accumulate1<T: Element>(self, acc: &mut [f32], p: &[f32], v: &[T], hd: usize, n: usize) {
        if lanes::applies::<T>(hd, bf16::GROUP) {
            unsafe { bf16::accumulate::<T, 1>(acc, [p], v, hd, n) }
        } else if self.bytes::<T>(hd) {
            unsafe { bytes::accumulate::<T, 1>(acc, [p], v, hd, n) }
        } else {
            unsafe { accumulate1(acc, p, v, hd, n) }
        }
    }
    #[inline(always)]
    fn enter_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        if lanes::applies::<T>(hd, bf16::GROUP) {
            lanes::to_split_order::<{ bf16::GROUP }, 2>(rows);
        } else if self.bytes::<T>(hd) {
            lanes::to_split_order::<{ bytes::GROUP }, { bytes::PARTS }>(rows);
        }
    }
    #[inline(always)]
    fn leave_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        if lanes::applies::<T>(hd, bf16::GROUP) {
            lanes::from_split_order::<{ bf16::GROUP }, 2>(rows);
        } else if self.bytes::<T>(hd) {
            lanes::from_split_order::<{ bytes::GROUP }, { bytes::PARTS }>(rows);
        }
    }
    #[inline(always)]
    fn max(self, x: &[f32]) -> f32 {
        let w16 = x.len() / 16 * 16;
        // SAFETY: an `Avx512` value proves AVX-512F.
        unsafe { max16(&x[..w16]) }.max(self.avx2.max(&x[w16..]))
    }
    #[inline(always)]
    fn exp_shifted_sum(self, x: &mut [f32], shift: f32) -> f32 {
        let w16 = x.len() / 16 * 16;
        let (wide, rest) = x.split_at_mut(w16);
        // SAFETY: an `Avx512` value proves AVX-512F.
        let sum = unsafe { exp_shifted_sum16(wide, shift) };
        sum + self.avx2.exp_shifted_sum(rest, shift)
    }
    #[inline(always)]
    fn scale(self, x: &mut [f32], c: f32) {
        self.avx2.scale(x, c)
    }
    #[inline(always)]
    fn widen<T: Element>(self, src: &[T], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let w16 = n / 16 * 16;
        for (s16, d16) in src[..w16]
            .chunks_exact(16)
            .zip(dst[..w16].chunks_exact_mut(16))
        {
            // SAFETY: an `Avx512` value proves AVX-512F; 16 elements are read and written.
            unsafe { _mm512_storeu_ps(d16.as_mut_ptr(), load16(s16.as_ptr())) };
        }
        T::widen(&src[w16..n], &mut dst[w16..n]);
    }
    /// Never: passes over the storage beat widening it for every type (paired, decode
    /// of 64 query heads over 8 KV heads, 2048 x 32 out of cache, AVX-512F alone: f16
    /// 0.69, bf16 0.66, int8 0.72; chunked prefill f16 0.93, bf16 0.88, int8 1.02).
    #[inline(always)]
    fn widens_storage<T: Element>(self, _passes: bool) -> bool {
        false
    }
}

/// The maximum of `x` (a multiple of 16 long; `-inf` when empty), 16 lanes at a time.
/// O(x.len()).
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn max16(x: &[f32]) -> f32 {
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    for c in x.chunks_exact(16) {
        // SAFETY: `c` holds 16 floats.
        m = _mm512_max_ps(m, unsafe { _mm512_loadu_ps(c.as_ptr()) });
    }
    _mm512_reduce_max_ps(m)
}

/// [`Simd::exp_shifted_sum`] of `x` (a multiple of 16 long): [`math::exp`]'s
/// arithmetic on 16 lanes (the same operations as the AVX2 form, so the same values;
/// `2^k` applied by `vscalefps`). Half the instructions per element of the 8-lane
/// form, which was 7-8% of a decode in cache. O(x.len()).
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn exp_shifted_sum16(x: &mut [f32], shift: f32) -> f32 {
    let shift_v = _mm512_set1_ps(shift);
    let lo = _mm512_set1_ps(-87.0);
    let zero = _mm512_setzero_ps();
    let log2e = _mm512_set1_ps(core::f32::consts::LOG2_E);
    let magic = _mm512_set1_ps(math::EXP_MAGIC);
    let (ln2_hi, ln2_lo) = (_mm512_set1_ps(math::LN2_HI), _mm512_set1_ps(math::LN2_LO));
    let c: [__m512; 6] = math::EXP_TAYLOR.map(|x| _mm512_set1_ps(x));
    let mut sum = _mm512_setzero_ps();
    for ch in x.chunks_exact_mut(16) {
        // SAFETY: `ch` holds 16 floats.
        let xv = _mm512_sub_ps(unsafe { _mm512_loadu_ps(ch.as_ptr()) }, shift_v);
        // Zero below -87 (as the AVX2 form's `andnot`: not for NaN).
        let kept = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(xv, lo);
        // Operand order: `max`/`min` return their second operand when one is NaN, so a
        // NaN score stays NaN (and its row's outputs with it) instead of clamping to 0.
        let xc = _mm512_min_ps(zero, _mm512_max_ps(lo, xv));
        let kf = _mm512_sub_ps(_mm512_fmadd_ps(xc, log2e, magic), magic);
        let r = _mm512_fnmadd_ps(kf, ln2_lo, _mm512_fnmadd_ps(kf, ln2_hi, xc));
        let mut p = c[0];
        for ci in &c[1..] {
            p = _mm512_fmadd_ps(p, r, *ci);
        }
        p = _mm512_fmadd_ps(p, r, c[5]);
        let e = _mm512_maskz_scalef_ps(kept, p, kf);
        // SAFETY: `ch` holds 16 floats.
        unsafe { _mm512_storeu_ps(ch.as_mut_ptr(), e) };
        sum = _mm512_add_ps(sum, e);
    }
    _mm512_reduce_add_ps(sum)
}

/// Loads 16 stored elements from `p` as `f32` (converting f16 with the AVX-512 form of
/// F16C, bf16 by shift, FP8 through f16: [`fp8_half16`]).
///
/// f16 stays with `vcvtph2ps` rather than bf16's in-lane route ([`lanes`]). Decoded
/// there by shifts and a mask (each half's sign, exponent and mantissa moved to an
/// f32's places, which then reads `2^-112` times the f16) and multiplied back by
/// `2^112`, a decode of 32 query heads over 8 KV heads, head dim 128, took 1.09 of the
/// time in cache (1 × 512 tokens, one thread) and 1.04-1.09 out of cache (128 × 512
/// and 32 × 2048 tokens, two threads), paired in one process on the 2-vCPU Zen 4
/// (as [`super::online`]'s `SCORE_STEP` says); with `2^112` folded into the query rows
/// and the weights instead, 1.02 in cache and 1.00-1.02 out of cache. The in-lane
/// route's five integer operations per 32 elements (bf16's takes two) cost what the
/// two `vcvtph2ps` do. That decoding is what f16 pays over bf16 there: paired the same
/// way, an f16 decode took 1.07-1.14 of a bf16 one's time in cache (1 × 512 and 1 ×
/// 2048 tokens) and 1.07-1.08 out of cache, the same with no element near zero (so no
/// f16 subnormal in the data).
///
/// # Safety
/// `p` points to 16 readable elements of type `T`; the CPU has AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn load16<T: Element>(p: *const T) -> __m512 {
    // SAFETY: `T::KIND` names `T`, so the pointer casts read `T`'s bytes as what they
    // are; 16 elements are readable (caller).
    unsafe {
        match T::KIND {
            Kind::F32 => _mm512_loadu_ps(p.cast()),
            Kind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            Kind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            ))),
            Kind::Int8 => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))),
            Kind::Fp8E4m3 => fp8_half16(p.cast()),
        }
    }
}

/// Decodes 16 FP8 E4M3 codes (one per 32-bit lane) to f32: the exponent and mantissa
/// bits shifted into an f32's place and multiplied by 2^120 (which rebiases the exponent
/// and turns subnormal codes into exact values), then NaN for the NaN codes and the sign.
/// The in-lane route's decoding ([`super::lanes::byte_avx512`]), taken off Intel cores.
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) fn fp8_16(codes: __m512i) -> __m512 {
    let mag = _mm512_and_si512(codes, _mm512_set1_epi32(0x7F));
    let value = _mm512_mul_ps(
        _mm512_castsi512_ps(_mm512_slli_epi32::<20>(mag)),
        _mm512_set1_ps(f32::from_bits((127 + 120) << 23)),
    );
    let nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F));
    let value = _mm512_mask_mov_ps(value, nan, _mm512_set1_ps(f32::NAN));
    let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(codes, _mm512_set1_epi32(0x80)));
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign))
}

/// Loads 16 FP8 E4M3 codes from `p` as f32, through f16: each code sign-extended to 16
/// bits and shifted left by 7 has its exponent and mantissa bits where an f16's go;
/// with the sign's copies cleared but for bit 15 it is an f16 of 2^-8 of the code's
/// value (subnormal codes as f16 subnormals), which `vcvtph2ps` widens exactly and a
/// multiplication by 2^8 of a normal f32 makes the value. Five instructions, the load
/// folded into the first. The general route's decoding, and FP8's on Intel cores
/// ([`super::lanes::applies_bytes`]).
///
/// No arithmetic touches an f32 subnormal, as [`fp8_16`]'s multiplication does for
/// each subnormal code: Intel cores run that through a microcode assist (on Emerald
/// Rapids a `vmulps` with a subnormal input took 7 times as long as with a normal one,
/// where `vcvtph2ps` of an f16 subnormal took no longer than of a normal one). The NaN
/// codes `S.1111.111` decode to ±480, a value no other code has: a row holding one
/// stores a NaN scale ([`crate::quant::Code::quantize_row`]), which makes the whole
/// row NaN wherever it is applied, as in the AVX2 decoding and the bf16 dot products.
///
/// Decoding in units of 2^8 instead (no multiplication here, the unit applied by the
/// attention loop, as for AVX2) was tried: that loop's per-token range check of the
/// value scales (`value_shift`) then took 12% of the samples of an FP8 decode in cache.
///
/// # Safety
/// `p` points to 16 readable bytes; the CPU has AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn fp8_half16(p: *const u8) -> __m512 {
    // SAFETY: 16 bytes are readable (caller).
    let codes = unsafe { _mm_loadu_si128(p.cast()) };
    let bits = _mm256_and_si256(
        _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(codes)),
        _mm256_set1_epi16(0xBF80u16 as i16),
    );
    _mm512_mul_ps(_mm512_cvtph_ps(bits), _mm512_set1_ps(256.0))
}

/// `a + b` folded to 8 lanes (high half added to the low half).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
fn fold8(a: __m512, b: __m512) -> __m256 {
    let v = _mm512_add_ps(a, b);
    let high = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v));
    _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(high))
}

/// See [`Simd::scores4`].
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn scores4<T: Element>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    s: &mut [f32],
    stride: usize,
) {
    assert!(q.len() >= 4 * hd && k.len() >= n * hd && (n == 0 || s.len() >= 3 * stride + n));
    let (w32, w16) = (hd / 32 * 32, hd / 16 * 16);
    let qp = q.as_ptr();
    // The dimensions past the last multiple of 16, in scalar arithmetic; none for the
    // usual head dims, where the check alone remains (a closure here cost a fifth of
    // the f16 decode: its environment was rebuilt on the stack for every score).
    let tail = |r: usize, t: usize| -> f32 {
        if w16 == hd {
            return 0.0;
        }
        math::tail_dot(&q[r * hd..(r + 1) * hd], &k[t * hd..(t + 1) * hd], w16)
    };
    // Four tokens at a time: 16 accumulators (row × token), so each query vector is
    // loaded once per four tokens and each key vector once per four rows.
    let mut t0 = 0;
    while t0 + 4 <= n {
        // SAFETY: every load reads `qp[r * hd + d..+16]` or `k[(t0 + i) * hd + d..+16]`
        // with `d + 16 <= hd`, `t0 + i < n` (asserted lengths above).
        let sums = unsafe {
            let kp = k.as_ptr().add(t0 * hd);
            let mut a = [[_mm512_setzero_ps(); 4]; 4];
            let mut d = 0;
            while d < w16 {
                let kv = [
                    load16(kp.add(d)),
                    load16(kp.add(hd + d)),
                    load16(kp.add(2 * hd + d)),
                    load16(kp.add(3 * hd + d)),
                ];
                for (r, ar) in a.iter_mut().enumerate() {
                    let qv = _mm512_loadu_ps(qp.add(r * hd + d));
                    for (ai, ki) in ar.iter_mut().zip(kv) {
                        *ai = _mm512_fmadd_ps(qv, ki, *ai);
                    }
                }
                d += 16;
            }
            // One transposing reduction of all sixteen.
            reduce::sums_4x4(a)
        };
        for (r, row) in sums.iter().enumerate() {
            let dst = &mut s[r * stride + t0..r * stride + t0 + 4];
            dst.copy_from_slice(row);
            if w16 < hd {
                for (i, x) in dst.iter_mut().enumerate() {
                    *x += tail(r, t0 + i);
                }
            }
        }
        t0 += 4;
    }
    for t in t0..n {
        // SAFETY: every load reads `qp[r * hd + d..+16]` or `kt[d..+16]` with
        // `d + 16 <= hd` (asserted lengths above).
        let sums = unsafe {
            let kt = k.as_ptr().add(t * hd);
            let mut a = [_mm512_setzero_ps(); 8];
            let mut d = 0;
            while d < w32 {
                let k0 = load16(kt.add(d));
                let k1 = load16(kt.add(d + 16));
                for r in 0..4 {
                    let qr = qp.add(r * hd + d);
                    a[2 * r] = _mm512_fmadd_ps(_mm512_loadu_ps(qr), k0, a[2 * r]);
                    a[2 * r + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(qr.add(16)), k1, a[2 * r + 1]);
                }
                d += 32;
            }
            if d < w16 {
                let k0 = load16(kt.add(d));
                for r in 0..4 {
                    a[2 * r] = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(r * hd + d)), k0, a[2 * r]);
                }
            }
            // Fold each row to 8 lanes, then one transposing reduction for all four.
            hsum4(
                fold8(a[0], a[1]),
                fold8(a[2], a[3]),
                fold8(a[4], a[5]),
                fold8(a[6], a[7]),
            )
        };
        for (r, sum) in sums.into_iter().enumerate() {
            s[r * stride + t] = sum + tail(r, t);
        }
    }
}

/// See [`Simd::scores1`].
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn scores1<T: Element>(q: &[f32], k: &[T], hd: usize, n: usize, s: &mut [f32]) {
    assert!(q.len() >= hd && k.len() >= n * hd && s.len() >= n);
    let (w64, w16) = (hd / 64 * 64, hd / 16 * 16);
    for t in 0..n {
        // SAFETY: loads of `q[d..+16]`, `kt[d..+16]` with `d + 16 <= hd`.
        let sum = unsafe {
            let (qp, kt) = (q.as_ptr(), k.as_ptr().add(t * hd));
            let mut a = [_mm512_setzero_ps(); 4];
            let mut d = 0;
            while d < w64 {
                for (i, acc) in a.iter_mut().enumerate() {
                    let o = d + 16 * i;
                    *acc = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(o)), load16(kt.add(o)), *acc);
                }
                d += 64;
            }
            while d < w16 {
                a[0] = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(d)), load16(kt.add(d)), a[0]);
                d += 16;
            }
            _mm512_reduce_add_ps(_mm512_add_ps(
                _mm512_add_ps(a[0], a[1]),
                _mm512_add_ps(a[2], a[3]),
            ))
        };
        s[t] = if w16 == hd {
            sum
        } else {
            sum + math::tail_dot(q, &k[t * hd..(t + 1) * hd], w16)
        };
    }
}

/// See [`Simd::accumulate2`].
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn accumulate2<T: Element>(
    acc: &mut [f32],
    p0: &[f32],
    p1: &[f32],
    v: &[T],
    hd: usize,
    n: usize,
) {
    assert!(acc.len() >= 2 * hd && p0.len() >= n && p1.len() >= n && v.len() >= n * hd);
    let (w64, w16) = (hd / 64 * 64, hd / 16 * 16);
    let (a0p, a1p) = (acc.as_mut_ptr(), acc[hd..].as_mut_ptr());
    let vp = v.as_ptr();
    let mut d = 0;
    // SAFETY: accesses `acc[d..+64]`, `acc[hd + d..+64]`, `v[t * hd + d..+64]` with
    // `d + 64 <= hd` and `t < n` (asserted lengths above); then the same with 16.
    unsafe {
        while d < w64 {
            let mut x0 = [_mm512_setzero_ps(); 4];
            let mut x1 = [_mm512_setzero_ps(); 4];
            for i in 0..4 {
                x0[i] = _mm512_loadu_ps(a0p.add(d + 16 * i));
                x1[i] = _mm512_loadu_ps(a1p.add(d + 16 * i));
            }
            for t in 0..n {
                let (b0, b1) = (_mm512_set1_ps(p0[t]), _mm512_set1_ps(p1[t]));
                let vt = vp.add(t * hd + d);
                for i in 0..4 {
                    let x = load16(vt.add(16 * i));
                    x0[i] = _mm512_fmadd_ps(b0, x, x0[i]);
                    x1[i] = _mm512_fmadd_ps(b1, x, x1[i]);
                }
            }
            for i in 0..4 {
                _mm512_storeu_ps(a0p.add(d + 16 * i), x0[i]);
                _mm512_storeu_ps(a1p.add(d + 16 * i), x1[i]);
            }
            d += 64;
        }
        while d < w16 {
            let (mut x0, mut x1) = (_mm512_loadu_ps(a0p.add(d)), _mm512_loadu_ps(a1p.add(d)));
            for t in 0..n {
                let x = load16(vp.add(t * hd + d));
                x0 = _mm512_fmadd_ps(_mm512_set1_ps(p0[t]), x, x0);
                x1 = _mm512_fmadd_ps(_mm512_set1_ps(p1[t]), x, x1);
            }
            _mm512_storeu_ps(a0p.add(d), x0);
            _mm512_storeu_ps(a1p.add(d), x1);
            d += 16;
        }
    }
    for d in w16..hd {
        for t in 0..n {
            acc[d] += p0[t] * v[t * hd + d].to_f32();
            acc[hd + d] += p1[t] * v[t * hd + d].to_f32();
        }
    }
}

/// See [`Simd::accumulate4`]: 64 dimensions of the four rows at a time (16 registers
/// of accumulators), so each stored vector is loaded and widened once.
///
/// Per step of tokens, not gathered over a chunk ([`Simd::gathers_values`]), measured
/// for f16 on the 2-vCPU Zen 4 (decode of 32 query heads over 8 KV heads, head dim
/// 128). The gathered form (one call per head and chunk, the 16 accumulators held
/// across the chunk's runs, the next chunk's K prefetched from inside the token loop)
/// took 0.88 of the time in cache without those prefetches (`decode_call`, 1 × 512
/// tokens, best of 1000 calls: 112 µs against 123-128), but out of cache (128 × 512,
/// 32 × 2048 and 8 × 8192 tokens, two threads, paired in one process as
/// [`super::online`]'s `SCORE_STEP` says) 1.04-1.05 with a prefetch call every 4
/// tokens, 1.14-1.19 every 8 and 1.22-1.25 every 2; with those keys prefetched during
/// the scores instead, the value phase left memory idle (53% of the probe against
/// 83-87%); with the scores and both prefetches walked head by head to match the
/// gathered order, 1.10-1.29. Out of cache the arithmetic saved did not buy time.
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn accumulate4<T: Element>(acc: &mut [f32], p: [&[f32]; 4], v: &[T], hd: usize, n: usize) {
    assert!(acc.len() >= 4 * hd && p.iter().all(|p| p.len() >= n) && v.len() >= n * hd);
    let (w64, w16) = (hd / 64 * 64, hd / 16 * 16);
    let ap = acc.as_mut_ptr();
    let vp = v.as_ptr();
    let mut d = 0;
    // SAFETY: accesses `acc[r * hd + d..+64]` (r < 4), `v[t * hd + d..+64]` and
    // `p[r][t]` with `d + 64 <= hd`, `t < n` (asserted lengths above); then the same
    // with 16.
    unsafe {
        while d < w64 {
            let mut x = [[_mm512_setzero_ps(); 4]; 4];
            for (r, xr) in x.iter_mut().enumerate() {
                for (i, xi) in xr.iter_mut().enumerate() {
                    *xi = _mm512_loadu_ps(ap.add(r * hd + d + 16 * i));
                }
            }
            for t in 0..n {
                let vt = vp.add(t * hd + d);
                let vs = [
                    load16(vt),
                    load16(vt.add(16)),
                    load16(vt.add(32)),
                    load16(vt.add(48)),
                ];
                for (r, xr) in x.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*p[r].get_unchecked(t));
                    for (xi, vi) in xr.iter_mut().zip(vs) {
                        *xi = _mm512_fmadd_ps(b, vi, *xi);
                    }
                }
            }
            for (r, xr) in x.iter().enumerate() {
                for (i, xi) in xr.iter().enumerate() {
                    _mm512_storeu_ps(ap.add(r * hd + d + 16 * i), *xi);
                }
            }
            d += 64;
        }
        while d < w16 {
            let mut x = [_mm512_setzero_ps(); 4];
            for (r, xr) in x.iter_mut().enumerate() {
                *xr = _mm512_loadu_ps(ap.add(r * hd + d));
            }
            for t in 0..n {
                let vt = load16(vp.add(t * hd + d));
                for (r, xr) in x.iter_mut().enumerate() {
                    *xr = _mm512_fmadd_ps(_mm512_set1_ps(*p[r].get_unchecked(t)), vt, *xr);
                }
            }
            for (r, xr) in x.iter().enumerate() {
                _mm512_storeu_ps(ap.add(r * hd + d), *xr);
            }
            d += 16;
        }
    }
    for d in w16..hd {
        for t in 0..n {
            let x = v[t * hd + d].to_f32();
            for (r, pr) in p.iter().enumerate() {
                acc[r * hd + d] += pr[t] * x;
            }
        }
    }
}

/// See [`Simd::accumulate1`].
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn accumulate1<T: Element>(acc: &mut [f32], p: &[f32], v: &[T], hd: usize, n: usize) {
    assert!(acc.len() >= hd && p.len() >= n && v.len() >= n * hd);
    let (w128, w16) = (hd / 128 * 128, hd / 16 * 16);
    let (ap, vp) = (acc.as_mut_ptr(), v.as_ptr());
    let mut d = 0;
    // SAFETY: accesses `acc[d..+128]` and `v[t * hd + d..+128]` with `d + 128 <= hd`,
    // `t < n`; then the same with 16.
    unsafe {
        while d < w128 {
            let mut x = [_mm512_setzero_ps(); 8];
            for (i, xi) in x.iter_mut().enumerate() {
                *xi = _mm512_loadu_ps(ap.add(d + 16 * i));
            }
            for (t, &pt) in p[..n].iter().enumerate() {
                let b = _mm512_set1_ps(pt);
                let vt = vp.add(t * hd + d);
                for (i, xi) in x.iter_mut().enumerate() {
                    *xi = _mm512_fmadd_ps(b, load16(vt.add(16 * i)), *xi);
                }
            }
            for (i, xi) in x.iter().enumerate() {
                _mm512_storeu_ps(ap.add(d + 16 * i), *xi);
            }
            d += 128;
        }
        while d < w16 {
            let mut x = _mm512_loadu_ps(ap.add(d));
            for (t, &pt) in p[..n].iter().enumerate() {
                x = _mm512_fmadd_ps(_mm512_set1_ps(pt), load16(vp.add(t * hd + d)), x);
            }
            _mm512_storeu_ps(ap.add(d), x);
            d += 16;
        }
    }
    for d in w16..hd {
        for t in 0..n {
            acc[d] += p[t] * v[t * hd + d].to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every FP8 code decodes through f16 to its value exactly (the subnormal codes
    /// included), the NaN codes to ±480, in every lane.
    #[test]
    fn every_fp8_code_decodes_exactly_through_f16() {
        if Avx512::detect().is_none() {
            eprintln!("skipped: this CPU has no AVX-512F (or the path is capped)");
            return;
        }
        for start in (0..256).step_by(16) {
            let codes: [u8; 16] = core::array::from_fn(|i| (start + i) as u8);
            let mut out = [0.0f32; 16];
            // SAFETY: AVX-512F present (checked above); 16 readable bytes, 16 floats.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), fp8_half16(codes.as_ptr())) };
            for (&c, &got) in codes.iter().zip(&out) {
                let value = crate::quant::fp8::decode(c);
                let want = if value.is_nan() {
                    480.0f32.copysign(if c & 0x80 != 0 { -1.0 } else { 1.0 })
                } else {
                    value
                };
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "code {c:#04x}: {got} vs {want}"
                );
            }
        }
    }

    /// The 16-lane softmax pieces give the AVX2 form's values exactly (bit for bit, also
    /// for `-inf`, arguments under -87, and NaN), and the maximum, over lengths with and
    /// without an 8-lane or scalar rest.
    #[test]
    fn sixteen_lane_softmax_matches_the_avx2_arithmetic() {
        let Some(simd) = Avx512::detect() else {
            eprintln!("skipped: this CPU has no AVX-512F (or the path is capped)");
            return;
        };
        for n in [0, 5, 16, 24, 47, 64] {
            let mut x: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 200) as f32 * -0.5 + 3.0)
                .collect();
            if n > 20 {
                x[3] = f32::NEG_INFINITY;
                x[17] = -100.0;
                x[19] = f32::NAN;
            }
            let want_max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            assert_eq!(simd.max(&x), want_max, "max, n {n}");
            let shift = 2.5;
            let mut want = x.clone();
            let want_sum = simd.avx2.exp_shifted_sum(&mut want, shift);
            let total = simd.exp_shifted_sum(&mut x, shift);
            for (i, (a, b)) in x.iter().zip(&want).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "exp, n {n}, element {i}: {a} vs {b}"
                );
            }
            // A NaN element makes both sums NaN (the lengths over 20 hold one).
            assert_eq!(total.is_nan(), want_sum.is_nan(), "sum, n {n}: NaN in one");
            assert!(
                want_sum.is_nan() || (total - want_sum).abs() <= 1e-6 * want_sum.max(1.0),
                "sum, n {n}: {total} vs {want_sum}"
            );
        }
    }
}
