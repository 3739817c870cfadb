//! [`Simd`] with AVX2 + FMA intrinsics (x86-64): the compiler's auto-vectorization of
//! the portable lane arrays gave 2-wide code for the dot products, so the hot loops are
//! written out. Each method checks its slice bounds once, then loads unaligned.
//!
//! Registers: scores take 4 query rows × 16 lanes per token (8 independent FMA chains,
//! enough to cover the FMA latency); accumulation keeps 2 rows × 32 output lanes in
//! registers across all tokens of a step, so each V vector loaded feeds two FMAs, or
//! for 8-bit storage 4 rows × 16 lanes, so each one widened feeds four. Int8 keys'
//! scores go to 16-bit integer products ([`super::lanes::int8_avx2`]), on queries put
//! in fixed point once per task.
//!
//! The kernels' const parameter `H` is FP8's decoding route ([`Avx2::half`]): through
//! f16 in units of 2^8 on Intel cores ([`fp8_half8`]), by moving a code's bits into an
//! f32's in units of 2^120 elsewhere ([`fp8_8`]); it changes nothing for other types.

use core::arch::x86_64::*;

use super::lanes::{self, bf16_avx2 as bf16, int8_avx2 as int8};
use super::math::{self, Simd};
use crate::dtype::{Element, Kind};

/// The AVX2 + FMA implementation. Only [`Avx2::detect`] makes one, so holding a value
/// proves the CPU has the instructions.
#[derive(Clone, Copy)]
pub(crate) struct Avx2 {
    /// FP8 decodes through f16 in units of 2^8 ([`fp8_half8`]) rather than by moving
    /// its bits into an f32's in units of [`FP8_UNIT`] ([`fp8_8`]): on Intel cores
    /// ([`super::intel_core`]), where the latter's subnormal codes, f32 subnormals,
    /// send every FMA that reads one through a microcode assist.
    fp8_half: bool,
}

impl Avx2 {
    /// `Some` if the CPU has AVX2, FMA and F16C (and [`super::CPU_PATH_ENV`] allows
    /// them). O(1) after the first call. Always `None` under Miri, which then checks the
    /// portable kernels every dispatcher falls back to.
    #[inline]
    pub(crate) fn detect() -> Option<Self> {
        let ok = !cfg!(miri)
            && super::path_ceiling() >= 1
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c");
        ok.then(|| Self {
            fp8_half: super::intel_core(),
        })
    }

    /// The same arithmetic with FP8's route given (`half`: through f16) rather than
    /// chosen by CPU vendor, so that the tests check both routes on any CPU with AVX2.
    /// O(1).
    #[cfg(test)]
    pub(crate) fn with_fp8_route(self, half: bool) -> Self {
        Self { fp8_half: half }
    }

    /// Whether FP8 decodes through f16 on this CPU (Intel cores), decided once by
    /// [`Avx2::detect`]; [`super::avx512::Avx512`] takes the same route from it. O(1).
    #[inline(always)]
    pub(super) fn fp8_through_f16(self) -> bool {
        self.fp8_half
    }

    /// The route `H` of this module's kernels for storage `T`: FP8 through f16 where
    /// `fp8_half` says so; every other type takes `false` (`H` changes only FP8's
    /// decoding). O(1).
    #[inline(always)]
    fn half<T: Element>(self) -> bool {
        T::KIND == Kind::Fp8E4m3 && self.fp8_half
    }
}

/// `$f::<$t, H>($args)`, with `H` the route [`Avx2::half`] gives: one instance per route
/// for FP8, the `false` one alone for the other types.
macro_rules! by_route {
    ($simd:expr, $f:ident::<$t:ty>($($arg:expr),* $(,)?)) => {
        if $simd.half::<$t>() {
            unsafe { $f::<$t, true>($($arg),*) }
        } else {
            unsafe { $f::<$t, false>($($arg),*) }
        }
    };
}

// SAFETY (every method): an `Avx2` value exists only when `detect` found AVX2, FMA and
// F16C; `int8::applies` is checked before each `int8` call.
impl Simd for Avx2 {
    #[inline(always)]
    fn scores4<T: Element>(
        self,
        q: &[f32],
        k: &[T],
        hd: usize,
        n: usize,
        s: &mut [f32],
        s_stride: usize,
        passes: bool,
    ) {
        if int8::applies::<T>(hd) {
            unsafe { int8::scores4(q, k, hd, n, s, s_stride) }
        } else if lanes::applies::<T>(hd, bf16::GROUP) {
            unsafe { bf16::scores4(q, k, hd, n, s, s_stride, passes) }
        } else {
            by_route!(self, scores4::<T>(q, k, hd, n, s, s_stride, passes))
        }
    }
    #[inline(always)]
    fn scores1<T: Element>(self, q: &[f32], k: &[T], hd: usize, n: usize, s: &mut [f32]) {
        if int8::applies::<T>(hd) {
            unsafe { int8::scores1(q, k, hd, n, s) }
        } else if lanes::applies::<T>(hd, bf16::GROUP) {
            unsafe { bf16::scores1(q, k, hd, n, s) }
        } else {
            by_route!(self, scores1::<T>(q, k, hd, n, s))
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
        } else {
            by_route!(self, accumulate2::<T>(acc, p0, p1, v, hd, n))
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
        } else if T::DTYPE.is_scaled() {
            // Measured (Zen 3, paired, against two pairs): fp8 0.81 in and out of cache,
            // int8 0.96 and 0.98; f32 and f16 0.99-1.00 in cache but 1.04 out of it.
            by_route!(self, accumulate4::<T>(acc, p, v, hd, n))
        } else {
            math::accumulate4_by_pairs(self, acc, p, v, hd, n);
        }
    }
    #[inline(always)]
    fn accumulate1<T: Element>(self, acc: &mut [f32], p: &[f32], v: &[T], hd: usize, n: usize) {
        if lanes::applies::<T>(hd, bf16::GROUP) {
            unsafe { bf16::accumulate::<T, 1>(acc, [p], v, hd, n) }
        } else {
            by_route!(self, accumulate1::<T>(acc, p, v, hd, n))
        }
    }
    #[inline(always)]
    fn enter_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        if int8::applies::<T>(hd) {
            for row in rows.chunks_exact_mut(hd) {
                unsafe { int8::encode_query(row, hd) };
            }
        } else if lanes::applies::<T>(hd, bf16::GROUP) {
            lanes::to_split_order::<{ bf16::GROUP }, 2>(rows);
        }
    }
    #[inline(always)]
    fn leave_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        if lanes::applies::<T>(hd, bf16::GROUP) {
            lanes::from_split_order::<{ bf16::GROUP }, 2>(rows);
        }
    }
    /// Steps of at most 16 lines of K and 32 of V per head (f32 at head dim 128: 2 and
    /// 4 tokens; the 16-bit and 8-bit types keep 4 and 8), each step's prefetches split
    /// around its arithmetic.
    ///
    /// Measured on AMD EPYC (Zen 3, AVX2, 512 KiB L2 per core), decode out of cache on
    /// 2 threads (32 x 2048 tokens unless said), paired:
    /// - f32, steps of 2 and 4 tokens against 4 and 8: 0.87 to 0.93 (512 to 8192
    ///   tokens); 2 and 2: 0.85; the same short steps with their prefetches issued every
    ///   fourth step: 1.58. In cache, one thread: 1.12 (2 and 2: 1.26), a step's fixed
    ///   cost. f16 and bf16 with value steps of 4: 0.89 to 1.00, and 1.05 to 1.07 in
    ///   cache, so they keep 8.
    /// - Split bursts against all after: f32 0.86 to 0.89, bf16 0.78 to 0.83, f16 0.94,
    ///   at 512, 2048 and 8192 tokens; int8 1.01 (its arithmetic bounds it); in cache
    ///   1.00 to 1.01. (Four prefetches an iteration instead of one, which issues a
    ///   burst faster: 1.22 to 1.27.)
    #[inline(always)]
    fn schedule<T: Element>(self, hd: usize) -> super::online::Schedule {
        super::online::Schedule::of_lines::<T>(hd, 16, 32, true)
    }
    #[inline(always)]
    fn pass_schedule(self) -> super::online::Schedule {
        super::online::Schedule::PASSES
    }
    /// Vector widening ([`load16`]): FP8 was decoded a code at a time by
    /// [`Element::widen`] before (paired, Zen 3, two threads: chunked prefill of 512
    /// new tokens in a context of 2048, two sequences, 0.74 of the time; decode of 64
    /// query heads over 8 KV heads, 32 × 2048 tokens, 0.63; int8 1.00, the compiler's
    /// loop was as fast).
    #[inline(always)]
    fn widen<T: Element>(self, src: &[T], dst: &mut [f32]) {
        by_route!(self, widen::<T>(src, dst))
    }
    /// [`FP8_UNIT`] for FP8 off Intel cores, 2^8 on them ([`fp8_unit`]), whatever the
    /// head dim (the tails decode in it too).
    ///
    /// Measured (Zen 3, decode of 32 query heads over 8 KV heads, head dim 128):
    /// - the f16 route in units of 2^8, against decoding to the values (which rescaled
    ///   each vector of 8): 0.93 of the time in cache (one thread, 1 × 256 tokens;
    ///   callgrind, the same calls: 7.31 → 7.01 M instructions) and 0.93 out of cache
    ///   (two threads, 32 × 2048);
    /// - keys by [`fp8_8`] in units of 2^120, values by the f16 route, against both by
    ///   it: 0.89 to 0.95 in cache (three runs), 0.88 and 0.92 out of cache;
    /// - values by [`fp8_8`] too, against keys only: 0.92 to 0.96 in cache (three
    ///   runs), 0.91 and 0.94 out of cache (two); callgrind 6.73 → 6.81 M instructions
    ///   (the shifts of the weights' unit), with no F16C conversion left. Against the
    ///   f16 route for both: 0.82 to 0.85 in cache, 0.83 and 0.85 out of it.
    ///
    /// On Intel cores the f16 route, in units of 2^8 ([`fp8_half8`]), for the
    /// subnormal codes, which [`fp8_8`] makes f32 subnormals and every FMA that reads
    /// one a microcode assist. Measured on Emerald Rapids (AVX2 path, decode of 32
    /// query heads over 8 KV heads, head dim 128, medians of the ratios of alternating
    /// runs), the f16 route's time over [`fp8_8`]'s: 0.29 in cache (1 × 256, one
    /// thread) and 0.28 out of it (32 × 2048, two threads) with one code in 301
    /// subnormal; 0.94 and 1.03 over random codes.
    #[inline(always)]
    fn code_unit<T: Element>(self) -> f32 {
        if T::KIND == Kind::Fp8E4m3 {
            fp8_unit(self.fp8_half)
        } else {
            1.0
        }
    }
    #[inline(always)]
    fn max(self, x: &[f32]) -> f32 {
        unsafe { max(x) }
    }
    #[inline(always)]
    fn exp_shifted_sum(self, x: &mut [f32], shift: f32) -> f32 {
        unsafe { exp_shifted_sum(x, shift) }
    }
    #[inline(always)]
    fn scale(self, x: &mut [f32], c: f32) {
        unsafe { scale(x, c) }
    }
}

/// Loads 8 stored elements from `p` as `f32` (converting f16 with F16C, bf16 by shift;
/// FP8 in units of [`fp8_unit`]`(H)`: through f16 with `H`, else by [`fp8_8`]).
///
/// # Safety
/// `p` points to 8 readable elements of type `T`; the CPU has AVX2 and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8<T: Element, const H: bool>(p: *const T) -> __m256 {
    // SAFETY: `T::KIND` names `T`, so the pointer casts read `T`'s bytes as what they
    // are; 8 elements are readable (caller).
    unsafe {
        match T::KIND {
            Kind::F32 => _mm256_loadu_ps(p.cast()),
            Kind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            Kind::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p.cast()),
            ))),
            Kind::Int8 => _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))),
            Kind::Fp8E4m3 if H => fp8_half8(_mm_loadl_epi64(p.cast())),
            Kind::Fp8E4m3 => fp8_8(_mm_loadl_epi64(p.cast())),
        }
    }
}

/// Loads 16 stored elements from `p` as two vectors of 8 `f32` (`p[..8]`, `p[8..16]`):
/// two [`load8`].
///
/// # Safety
/// `p` points to 16 readable elements of type `T`; the CPU has AVX2 and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load16<T: Element, const H: bool>(p: *const T) -> (__m256, __m256) {
    // SAFETY: 16 elements are readable (caller).
    unsafe { (load8::<T, H>(p), load8::<T, H>(p.add(8))) }
}

/// The unit in which this arithmetic decodes FP8 codes off Intel cores, 2^120: every
/// decoding of route `H = false` ([`load8`], [`load16`], [`decode1`], [`widen`]) gives
/// a code's value divided by it
/// ([`fp8_8`] puts a code's bits straight into an f32's, with no conversion), and the
/// attention loop applies it to the scores and weights ([`Simd::code_unit`]): each
/// score times its key's scale, then times the unit over the power of two its query
/// row was lifted by (into `[1, 2)`, when below 1), and each weight times its value's
/// scale, then times the unit over a power of two that keeps the product finite
/// (the accumulator being rescaled when that power grows).
///
/// A sum of decoded products falls among the f32 subnormals where code · query is
/// below 2^-6 (the query lifted): its error there is at most 2^-149 a rounding, 2^-29
/// of a scale once the unit is applied, far below a code's own step.
///
/// Before, FP8 went through f16 (a code's magnitude bits in an f16's exponent and
/// mantissa, `vcvtph2ps`), 2^-8 of the value, in units of 2^8 (which saved the
/// rescaling, two multiplications per 16 codes on the FMA ports, beside 8 FMAs).
pub(super) const FP8_UNIT: f32 = f32::from_bits((127 + 120) << 23);

/// The unit of FP8's decoding on route `H`: 2^8 through f16 ([`fp8_half8`]), else
/// [`FP8_UNIT`]. O(1).
#[inline(always)]
const fn fp8_unit(half: bool) -> f32 {
    if half {
        256.0
    } else {
        FP8_UNIT
    }
}

/// One stored element as this arithmetic decodes it on route `H`: its value, FP8 in
/// units of [`fp8_unit`]`(H)`. O(1).
#[inline(always)]
fn decode1<T: Element, const H: bool>(x: T) -> f32 {
    if T::KIND == Kind::Fp8E4m3 {
        x.to_f32() * (1.0 / fp8_unit(H))
    } else {
        x.to_f32()
    }
}

/// `Σ q[d] · k[d]` over `d >= from`, the stored elements as [`decode1`] gives them.
/// O(q.len() - from).
#[inline(always)]
fn tail_dot<T: Element, const H: bool>(q: &[f32], k: &[T], from: usize) -> f32 {
    q[from..]
        .iter()
        .zip(&k[from..])
        .map(|(a, &b)| a * decode1::<T, H>(b))
        .sum()
}

/// The 8 FP8 E4M3 codes in the low half of `codes` to f32, in units of [`FP8_UNIT`]:
/// each code sign-extended to 32 bits and shifted left by 20, so that its 4 exponent
/// bits are the low bits of an f32's exponent field (23..26) and its 3 mantissa bits
/// the top of the f32's mantissa (20..22), the sign's copies then cleared but for bit
/// 31. An exponent field of 1 to 15 is then an f32 normal 2^-120 of the code's value,
/// 0 an f32 subnormal (or zero) 2^-120 of it. Three instructions (the load
/// folded into the first) and no conversion unit.
///
/// The NaN codes `S.1111.111` decode to ±480 · 2^-120, a finite value no other code
/// has: a row holding one stores a NaN scale ([`crate::quant::Code::quantize_row`]),
/// which makes every value of the row NaN wherever the scale is applied, so no
/// per-element NaN test is needed here. (Leaving that test out of the f16 route that
/// came before measured 0.89 of the time in cache and 0.90 out of cache, Zen 3.)
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn fp8_8(codes: __m128i) -> __m256 {
    let bits = _mm256_slli_epi32::<20>(_mm256_cvtepi8_epi32(codes));
    _mm256_castsi256_ps(_mm256_and_si256(
        bits,
        _mm256_set1_epi32(0x87F0_0000u32 as i32),
    ))
}

/// The 8 FP8 E4M3 codes in the low half of `codes` to f32 in units of 2^8
/// ([`fp8_unit`]`(true)`), through f16: each code sign-extended to 16 bits and shifted
/// left by 7 has its exponent and mantissa bits where an f16's go; with the sign's
/// copies cleared but for bit 15 it is an f16 of 2^-8 of the code's value (subnormal
/// codes as f16 subnormals), which `vcvtph2ps` widens exactly to an f32 normal. Four
/// instructions (the load folded into the first). The NaN codes give ±480 over the
/// unit, as in [`fp8_8`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn fp8_half8(codes: __m128i) -> __m256 {
    let bits = _mm_and_si128(
        _mm_slli_epi16::<7>(_mm_cvtepi8_epi16(codes)),
        _mm_set1_epi16(0xBF80u16 as i16),
    );
    _mm256_cvtph_ps(bits)
}

/// Horizontal sums of four vectors: `[Σ a, Σ b, Σ c, Σ d]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> [f32; 4] {
    let h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
    let mut out = [0.0f32; 4];
    // SAFETY: `out` holds 4 floats.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), s) };
    out
}

/// Stores the scores of `G` tokens of four rows (`a[g][r]`: token `t + g`, row `r`,
/// eight partial sums each) into `s[r * stride + t + g]`. O(G).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn store_token_scores<const G: usize>(
    a: &[[__m256; 4]; G],
    s: &mut [f32],
    stride: usize,
    t: usize,
) {
    for (g, ag) in a.iter().enumerate() {
        for (r, sum) in hsum4(ag[0], ag[1], ag[2], ag[3]).into_iter().enumerate() {
            s[r * stride + t + g] = sum;
        }
    }
}

/// Horizontal sum of one vector.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum(a: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// See [`Simd::scores4`]: in a step of `passes`, three tokens at a time, then a pair;
/// in decode, pairs for f16 and FP8 and single tokens for f32
/// ([`scores4_token_groups`]).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scores4<T: Element, const H: bool>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    s: &mut [f32],
    stride: usize,
    passes: bool,
) {
    assert!(q.len() >= 4 * hd && k.len() >= n * hd && (n == 0 || s.len() >= 3 * stride + n));
    let (w16, w8) = (hd / 16 * 16, hd / 8 * 8);
    let qp = q.as_ptr();
    let first = if w8 != hd {
        0
    } else if passes {
        // SAFETY: the lengths asserted above; AVX2 + FMA + F16C (caller).
        let triples = unsafe { scores4_token_groups::<T, H, 3>(q, k, hd, n, s, stride) };
        triples
            + unsafe {
                scores4_token_groups::<T, H, 2>(
                    q,
                    &k[triples * hd..],
                    hd,
                    n - triples,
                    &mut s[triples..],
                    stride,
                )
            }
    } else if matches!(T::KIND, Kind::F16 | Kind::Fp8E4m3) {
        // SAFETY: as above.
        unsafe { scores4_token_groups::<T, H, 2>(q, k, hd, n, s, stride) }
    } else {
        0
    };
    for t in first..n {
        // SAFETY: every load below reads `qp[r * hd + d..+8]` or `kt[d..+8]` with
        // `d + 8 <= hd` (asserted lengths above).
        let sums = unsafe {
            let kt = k.as_ptr().add(t * hd);
            let mut a = [_mm256_setzero_ps(); 8];
            let mut d = 0;
            while d < w16 {
                let (k0, k1) = load16::<T, H>(kt.add(d));
                for r in 0..4 {
                    let qr = qp.add(r * hd + d);
                    a[2 * r] = _mm256_fmadd_ps(_mm256_loadu_ps(qr), k0, a[2 * r]);
                    a[2 * r + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(qr.add(8)), k1, a[2 * r + 1]);
                }
                d += 16;
            }
            if d < w8 {
                let k0 = load8::<T, H>(kt.add(d));
                for r in 0..4 {
                    a[2 * r] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(r * hd + d)), k0, a[2 * r]);
                }
            }
            hsum4(
                _mm256_add_ps(a[0], a[1]),
                _mm256_add_ps(a[2], a[3]),
                _mm256_add_ps(a[4], a[5]),
                _mm256_add_ps(a[6], a[7]),
            )
        };
        // The dimensions past the last multiple of 8 (none for the usual head dims).
        if w8 == hd {
            for (r, sum) in sums.into_iter().enumerate() {
                s[r * stride + t] = sum;
            }
        } else {
            for (r, sum) in sums.into_iter().enumerate() {
                let (qr, kt) = (&q[r * hd..(r + 1) * hd], &k[t * hd..(t + 1) * hd]);
                s[r * stride + t] = sum + tail_dot::<T, H>(qr, kt, w8);
            }
        }
    }
}

/// [`scores4`] `G` tokens at a time, while `G` are left: each query vector loaded
/// serves the `G` tokens' keys (`4 × G` accumulators), so 8 dimensions load `4 + G`
/// vectors for `4 × G` FMAs, where one token at a time loads 5 (four query vectors
/// and the key) for 4. Three tokens fill AVX2's 16 registers: 12 accumulators, 3 keys
/// and the query vector. `hd` is a multiple of 8. Returns the tokens done (`n` rounded
/// down to a multiple of `G`).
///
/// Measured on Zen 3 (AVX2; 32 query heads over 8 KV heads, head dim 128), paired
/// against one token at a time:
/// - pairs: decode f16 0.93-0.94 out of cache (two threads, 512, 2048 and 8192
///   tokens) and 0.94 in cache (one thread, 256 tokens), FP8 0.97-0.98 and 0.98;
///   chunked prefill (512 new tokens after 1536) f16 0.88, f32 0.94. f32 decode keeps
///   one token at a time: out of cache, bound by memory, it took 1.01-1.02 with pairs;
/// - triples (then a pair), in chunked prefill's steps of 16 tokens, against one
///   token at a time in steps of 4: f32 0.80 (one thread).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `q.len() >= 4 * hd`, `k.len() >= n * hd`,
/// `s.len() >= 3 * stride + n` (when `n > 0`), `hd % 8 == 0`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scores4_token_groups<T: Element, const H: bool, const G: usize>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    s: &mut [f32],
    stride: usize,
) -> usize {
    let qp = q.as_ptr();
    let mut t = 0;
    while t + G <= n {
        let mut a = [[_mm256_setzero_ps(); 4]; G];
        // SAFETY: tokens `t..t + G`'s `[d..+8]` and the rows' `q[r * hd + d..+8]` with
        // `d + 8 <= hd` and `t + G <= n` (caller's lengths).
        unsafe {
            let keys: [*const T; G] = core::array::from_fn(|g| k.as_ptr().add((t + g) * hd));
            let mut d = 0;
            while d < hd {
                let x: [__m256; G] = core::array::from_fn(|g| load8::<T, H>(keys[g].add(d)));
                for r in 0..4 {
                    let qv = _mm256_loadu_ps(qp.add(r * hd + d));
                    for (ag, xg) in a.iter_mut().zip(x) {
                        ag[r] = _mm256_fmadd_ps(qv, xg, ag[r]);
                    }
                }
                d += 8;
            }
        }
        store_token_scores(&a, s, stride, t);
        t += G;
    }
    t
}

/// See [`Simd::scores1`].
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scores1<T: Element, const H: bool>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    s: &mut [f32],
) {
    assert!(q.len() >= hd && k.len() >= n * hd && s.len() >= n);
    let w32 = hd / 32 * 32;
    let w8 = hd / 8 * 8;
    for t in 0..n {
        // SAFETY: loads of `q[d..+8]`, `kt[d..+8]` with `d + 8 <= hd`.
        let sum = unsafe {
            let (qp, kt) = (q.as_ptr(), k.as_ptr().add(t * hd));
            let mut a = [_mm256_setzero_ps(); 4];
            let mut d = 0;
            while d < w32 {
                for (i, pair) in a.chunks_exact_mut(2).enumerate() {
                    let o = d + 16 * i;
                    let (k0, k1) = load16::<T, H>(kt.add(o));
                    pair[0] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(o)), k0, pair[0]);
                    pair[1] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(o + 8)), k1, pair[1]);
                }
                d += 32;
            }
            while d < w8 {
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(d)), load8::<T, H>(kt.add(d)), a[0]);
                d += 8;
            }
            hsum(_mm256_add_ps(
                _mm256_add_ps(a[0], a[1]),
                _mm256_add_ps(a[2], a[3]),
            ))
        };
        s[t] = if w8 == hd {
            sum
        } else {
            sum + tail_dot::<T, H>(q, &k[t * hd..(t + 1) * hd], w8)
        };
    }
}

/// See [`Simd::accumulate2`].
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn accumulate2<T: Element, const H: bool>(
    acc: &mut [f32],
    p0: &[f32],
    p1: &[f32],
    v: &[T],
    hd: usize,
    n: usize,
) {
    assert!(acc.len() >= 2 * hd && p0.len() >= n && p1.len() >= n && v.len() >= n * hd);
    let (w32, w8) = (hd / 32 * 32, hd / 8 * 8);
    let (a0p, a1p) = (acc.as_mut_ptr(), acc[hd..].as_mut_ptr());
    let vp = v.as_ptr();
    let mut d = 0;
    // SAFETY: accesses `acc[d..+32]`, `acc[hd + d..+32]`, `v[t * hd + d..+32]` with
    // `d + 32 <= hd` and `t < n` (asserted lengths above); then the same with 8.
    unsafe {
        while d < w32 {
            let mut x0 = [_mm256_setzero_ps(); 4];
            let mut x1 = [_mm256_setzero_ps(); 4];
            for i in 0..4 {
                x0[i] = _mm256_loadu_ps(a0p.add(d + 8 * i));
                x1[i] = _mm256_loadu_ps(a1p.add(d + 8 * i));
            }
            for t in 0..n {
                let (b0, b1) = (_mm256_set1_ps(p0[t]), _mm256_set1_ps(p1[t]));
                let vt = vp.add(t * hd + d);
                let ((v0, v1), (v2, v3)) = (load16::<T, H>(vt), load16::<T, H>(vt.add(16)));
                for (i, x) in [v0, v1, v2, v3].into_iter().enumerate() {
                    x0[i] = _mm256_fmadd_ps(b0, x, x0[i]);
                    x1[i] = _mm256_fmadd_ps(b1, x, x1[i]);
                }
            }
            for i in 0..4 {
                _mm256_storeu_ps(a0p.add(d + 8 * i), x0[i]);
                _mm256_storeu_ps(a1p.add(d + 8 * i), x1[i]);
            }
            d += 32;
        }
        while d < w8 {
            let (mut x0, mut x1) = (_mm256_loadu_ps(a0p.add(d)), _mm256_loadu_ps(a1p.add(d)));
            for t in 0..n {
                let x = load8::<T, H>(vp.add(t * hd + d));
                x0 = _mm256_fmadd_ps(_mm256_set1_ps(p0[t]), x, x0);
                x1 = _mm256_fmadd_ps(_mm256_set1_ps(p1[t]), x, x1);
            }
            _mm256_storeu_ps(a0p.add(d), x0);
            _mm256_storeu_ps(a1p.add(d), x1);
            d += 8;
        }
    }
    for d in w8..hd {
        for t in 0..n {
            acc[d] += p0[t] * decode1::<T, H>(v[t * hd + d]);
            acc[hd + d] += p1[t] * decode1::<T, H>(v[t * hd + d]);
        }
    }
}

/// See [`Simd::accumulate4`]: 16 dimensions of the four rows at a time (8 registers of
/// accumulators), so each stored value is loaded and widened once for the four rows
/// (two [`accumulate2`] calls widen it twice): for the 8-bit types, whose widening
/// costs most.
///
/// Tried for chunked prefill's passes (steps of 16 tokens; f32, f16 and widened 8-bit
/// all routed here), and dropped: 24 dimensions at a time, 12 accumulators, so a
/// token's 3 vectors and 4 weights serve 12 FMAs where 16 dimensions load 6 for 8.
/// It needs all 16 registers, and took 1.15 (f32), 1.19 (int8) and 1.25 (f16) of the
/// time (paired, Zen 3, one thread, 512 new tokens after 1536).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn accumulate4<T: Element, const H: bool>(
    acc: &mut [f32],
    p: [&[f32]; 4],
    v: &[T],
    hd: usize,
    n: usize,
) {
    assert!(acc.len() >= 4 * hd && v.len() >= n * hd);
    let p = [&p[0][..n], &p[1][..n], &p[2][..n], &p[3][..n]];
    let (w16, w8) = (hd / 16 * 16, hd / 8 * 8);
    let (ap, vp) = (acc.as_mut_ptr(), v.as_ptr());
    let mut d = 0;
    // SAFETY: accesses `acc[r * hd + d..+16]` (r < 4) and `v[t * hd + d..+16]` with
    // `d + 16 <= hd`, `t < n` (asserted lengths above); then the same with 8.
    unsafe {
        while d < w16 {
            let mut x = [[_mm256_setzero_ps(); 2]; 4];
            for (r, xr) in x.iter_mut().enumerate() {
                for (i, xi) in xr.iter_mut().enumerate() {
                    *xi = _mm256_loadu_ps(ap.add(r * hd + d + 8 * i));
                }
            }
            for t in 0..n {
                let (v0, v1) = load16::<T, H>(vp.add(t * hd + d));
                for (xr, pr) in x.iter_mut().zip(p) {
                    let b = _mm256_set1_ps(pr[t]);
                    xr[0] = _mm256_fmadd_ps(b, v0, xr[0]);
                    xr[1] = _mm256_fmadd_ps(b, v1, xr[1]);
                }
            }
            for (r, xr) in x.iter().enumerate() {
                for (i, xi) in xr.iter().enumerate() {
                    _mm256_storeu_ps(ap.add(r * hd + d + 8 * i), *xi);
                }
            }
            d += 16;
        }
        while d < w8 {
            let mut x = [_mm256_setzero_ps(); 4];
            for (r, xr) in x.iter_mut().enumerate() {
                *xr = _mm256_loadu_ps(ap.add(r * hd + d));
            }
            for t in 0..n {
                let v0 = load8::<T, H>(vp.add(t * hd + d));
                for (xr, pr) in x.iter_mut().zip(p) {
                    *xr = _mm256_fmadd_ps(_mm256_set1_ps(pr[t]), v0, *xr);
                }
            }
            for (r, xr) in x.iter().enumerate() {
                _mm256_storeu_ps(ap.add(r * hd + d), *xr);
            }
            d += 8;
        }
    }
    for d in w8..hd {
        for (r, pr) in p.iter().enumerate() {
            for (t, &pt) in pr.iter().enumerate() {
                acc[r * hd + d] += pt * decode1::<T, H>(v[t * hd + d]);
            }
        }
    }
}

/// See [`Simd::accumulate1`].
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn accumulate1<T: Element, const H: bool>(
    acc: &mut [f32],
    p: &[f32],
    v: &[T],
    hd: usize,
    n: usize,
) {
    assert!(acc.len() >= hd && p.len() >= n && v.len() >= n * hd);
    let (w64, w8) = (hd / 64 * 64, hd / 8 * 8);
    let (ap, vp) = (acc.as_mut_ptr(), v.as_ptr());
    let mut d = 0;
    // SAFETY: accesses `acc[d..+64]` and `v[t * hd + d..+64]` with `d + 64 <= hd`,
    // `t < n`; then the same with 8.
    unsafe {
        while d < w64 {
            let mut x = [_mm256_setzero_ps(); 8];
            for (i, xi) in x.iter_mut().enumerate() {
                *xi = _mm256_loadu_ps(ap.add(d + 8 * i));
            }
            for (t, &pt) in p[..n].iter().enumerate() {
                let b = _mm256_set1_ps(pt);
                let vt = vp.add(t * hd + d);
                for (i, pair) in x.chunks_exact_mut(2).enumerate() {
                    let (v0, v1) = load16::<T, H>(vt.add(16 * i));
                    pair[0] = _mm256_fmadd_ps(b, v0, pair[0]);
                    pair[1] = _mm256_fmadd_ps(b, v1, pair[1]);
                }
            }
            for (i, xi) in x.iter().enumerate() {
                _mm256_storeu_ps(ap.add(d + 8 * i), *xi);
            }
            d += 64;
        }
        while d < w8 {
            let mut x = _mm256_loadu_ps(ap.add(d));
            for (t, &pt) in p[..n].iter().enumerate() {
                x = _mm256_fmadd_ps(_mm256_set1_ps(pt), load8::<T, H>(vp.add(t * hd + d)), x);
            }
            _mm256_storeu_ps(ap.add(d), x);
            d += 8;
        }
    }
    for d in w8..hd {
        for t in 0..n {
            acc[d] += p[t] * decode1::<T, H>(v[t * hd + d]);
        }
    }
}

/// See [`Simd::widen`]: 16 elements at a time through [`load16`], the rest by
/// [`decode1`] (FP8 in units of [`FP8_UNIT`], as everywhere in this arithmetic).
///
/// # Safety
/// The CPU has AVX2 and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn widen<T: Element, const H: bool>(src: &[T], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let w16 = n / 16 * 16;
    for (s16, d16) in src[..w16]
        .chunks_exact(16)
        .zip(dst[..w16].chunks_exact_mut(16))
    {
        // SAFETY: 16 elements are read and 16 floats written.
        unsafe {
            let (a, b) = load16::<T, H>(s16.as_ptr());
            _mm256_storeu_ps(d16.as_mut_ptr(), a);
            _mm256_storeu_ps(d16.as_mut_ptr().add(8), b);
        }
    }
    for (d, &x) in dst[w16..n].iter_mut().zip(&src[w16..n]) {
        *d = decode1::<T, H>(x);
    }
}

/// See [`Simd::max`].
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn max(x: &[f32]) -> f32 {
    let w8 = x.len() / 8 * 8;
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    for c in x[..w8].chunks_exact(8) {
        // SAFETY: `c` holds 8 floats.
        m = _mm256_max_ps(m, unsafe { _mm256_loadu_ps(c.as_ptr()) });
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
    lanes
        .iter()
        .chain(&x[w8..])
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// See [`Simd::exp_shifted_sum`]: [`math::exp`], eight lanes at a time.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    let w8 = x.len() / 8 * 8;
    let shift_v = _mm256_set1_ps(shift);
    let lo = _mm256_set1_ps(-87.0);
    let zero = _mm256_setzero_ps();
    let log2e = _mm256_set1_ps(core::f32::consts::LOG2_E);
    let magic = _mm256_set1_ps(math::EXP_MAGIC);
    let magic_bits = _mm256_set1_epi32(math::EXP_MAGIC.to_bits() as i32);
    let (ln2_hi, ln2_lo) = (_mm256_set1_ps(math::LN2_HI), _mm256_set1_ps(math::LN2_LO));
    let c: [__m256; 6] = math::EXP_TAYLOR.map(|x| _mm256_set1_ps(x));
    let mut sum = _mm256_setzero_ps();
    for ch in x[..w8].chunks_exact_mut(8) {
        // SAFETY: `ch` holds 8 floats.
        let xv = _mm256_sub_ps(unsafe { _mm256_loadu_ps(ch.as_ptr()) }, shift_v);
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(xv, lo);
        // Operand order: `max`/`min` return their second operand when one is NaN, so a
        // NaN score stays NaN (and its row's outputs with it) instead of clamping to 0.
        let xc = _mm256_min_ps(zero, _mm256_max_ps(lo, xv));
        let t = _mm256_fmadd_ps(xc, log2e, magic);
        let k = _mm256_sub_epi32(_mm256_castps_si256(t), magic_bits);
        let kf = _mm256_sub_ps(t, magic);
        let r = _mm256_fnmadd_ps(kf, ln2_lo, _mm256_fnmadd_ps(kf, ln2_hi, xc));
        let mut p = c[0];
        for ci in &c[1..] {
            p = _mm256_fmadd_ps(p, r, *ci);
        }
        p = _mm256_fmadd_ps(p, r, c[5]);
        let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            k,
            _mm256_set1_epi32(127),
        )));
        let e = _mm256_andnot_ps(under, _mm256_mul_ps(p, pow2));
        // SAFETY: `ch` holds 8 floats.
        unsafe { _mm256_storeu_ps(ch.as_mut_ptr(), e) };
        sum = _mm256_add_ps(sum, e);
    }
    let mut total = hsum(sum);
    for v in &mut x[w8..] {
        *v = math::exp(*v - shift);
        total += *v;
    }
    total
}

/// See [`Simd::scale`].
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scale(x: &mut [f32], c: f32) {
    let cv = _mm256_set1_ps(c);
    let w8 = x.len() / 8 * 8;
    for ch in x[..w8].chunks_exact_mut(8) {
        // SAFETY: `ch` holds 8 floats.
        unsafe {
            _mm256_storeu_ps(
                ch.as_mut_ptr(),
                _mm256_mul_ps(_mm256_loadu_ps(ch.as_ptr()), cv),
            )
        };
    }
    for v in &mut x[w8..] {
        *v *= c;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both FP8 routes' scores and accumulations (4 rows; 7 tokens: groups of 3, 2
    /// and 1) against f64 sums of the codes' values over the route's unit, at a head dim
    /// with whole vectors and one with a scalar tail; one code in 11 subnormal.
    #[test]
    fn both_fp8_routes_score_and_accumulate_in_their_units() {
        use crate::dtype::Fp8E4m3;
        if Avx2::detect().is_none() {
            eprintln!("skipped: AVX2 + FMA + F16C absent (or capped by the environment)");
            return;
        }
        let mut seed = 0x2545_f491_u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for hd in [64usize, 75] {
            let n = 7;
            let q: Vec<f32> = (0..4 * hd)
                .map(|_| next() as f32 / u32::MAX as f32 - 0.5)
                .collect();
            let codes: Vec<Fp8E4m3> = (0..n * hd)
                .map(|i| {
                    let c = (next() >> 24) as u8;
                    // No NaN codes; every 11th a subnormal one.
                    Fp8E4m3(if i % 11 == 0 {
                        c & 0x87
                    } else if c & 0x7F == 0x7F {
                        0
                    } else {
                        c
                    })
                })
                .collect();
            let p: Vec<Vec<f32>> = (0..4)
                .map(|_| (0..n).map(|_| next() as f32 / u32::MAX as f32).collect())
                .collect();
            for half in [false, true] {
                let unit = f64::from(fp8_unit(half));
                let value = |t: usize, d: usize| f64::from(codes[t * hd + d].to_f32()) / unit;
                let mut s = vec![0.0f32; 4 * n];
                let mut acc = vec![0.0f32; 4 * hd];
                let rows = [&p[0][..], &p[1][..], &p[2][..], &p[3][..]];
                // SAFETY: `detect` found AVX2, FMA and F16C; the lengths are those the
                // kernels assert.
                unsafe {
                    if half {
                        scores4::<Fp8E4m3, true>(&q, &codes, hd, n, &mut s, n, false);
                        accumulate4::<Fp8E4m3, true>(&mut acc, rows, &codes, hd, n);
                    } else {
                        scores4::<Fp8E4m3, false>(&q, &codes, hd, n, &mut s, n, false);
                        accumulate4::<Fp8E4m3, false>(&mut acc, rows, &codes, hd, n);
                    }
                }
                for r in 0..4 {
                    for t in 0..n {
                        let want: f64 = (0..hd)
                            .map(|d| f64::from(q[r * hd + d]) * value(t, d))
                            .sum();
                        let got = f64::from(s[r * n + t]);
                        assert!(
                            (got - want).abs() <= 1e-5 * want.abs().max(1.0 / unit),
                            "hd {hd}, half {half}, row {r}, token {t}: {got} vs {want}"
                        );
                    }
                    for d in 0..hd {
                        let want: f64 = (0..n).map(|t| f64::from(p[r][t]) * value(t, d)).sum();
                        let got = f64::from(acc[r * hd + d]);
                        assert!(
                            (got - want).abs() <= 1e-5 * want.abs().max(1.0 / unit),
                            "hd {hd}, half {half}, row {r}, dim {d}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// Every FP8 code through both vector decodings and the scalar ones, against the
    /// format's own decoding: the value over the route's unit, bit for bit (zeros keep
    /// their sign); the NaN codes give ±480 over the unit (vector) or NaN (scalar).
    #[test]
    fn fp8_decodes_every_code_in_its_unit() {
        if Avx2::detect().is_none() {
            eprintln!("skipped: AVX2 + FMA + F16C absent (or capped by the environment)");
            return;
        }
        for first in (0..=255u8).step_by(8) {
            let codes: [u8; 8] = core::array::from_fn(|i| first + i as u8);
            let (mut bits, mut half) = ([0.0f32; 8], [0.0f32; 8]);
            // SAFETY: `detect` found AVX2; 8 bytes are read, 8 floats written.
            unsafe {
                let x = _mm_loadl_epi64(codes.as_ptr().cast());
                _mm256_storeu_ps(bits.as_mut_ptr(), fp8_8(x));
                _mm256_storeu_ps(half.as_mut_ptr(), fp8_half8(x));
            }
            for (i, &code) in codes.iter().enumerate() {
                let want = crate::quant::fp8::decode(code);
                let c = crate::dtype::Fp8E4m3(code);
                let routes = [
                    (bits[i], decode1::<_, false>(c), fp8_unit(false)),
                    (half[i], decode1::<_, true>(c), fp8_unit(true)),
                ];
                for (got, one, unit) in routes {
                    if want.is_nan() {
                        let nan = if code & 0x80 != 0 { -480.0 } else { 480.0 };
                        assert_eq!(got, nan / unit, "code {code:#04x}, unit {unit}");
                        assert!(one.is_nan(), "code {code:#04x}");
                    } else {
                        let want = (want / unit).to_bits();
                        assert_eq!(got.to_bits(), want, "code {code:#04x}, unit {unit}");
                        assert_eq!(one.to_bits(), want, "code {code:#04x}, one by one");
                    }
                }
            }
        }
    }
}
