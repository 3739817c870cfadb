//! FP8 E4M3 codes in bf16 dot products with AVX512_BF16: `vdpbf16ps` adds, in each of
//! sixteen f32 lanes, the products of two bf16 pairs, so one instruction does 32
//! multiply-adds, and the codes need no conversion to f32.
//!
//! An E4M3 code is a bf16 whose exponent is 120 short: its bits `s eeee mmm` moved to
//! `s 0000 eeee mmm 0000` (two or three shifts and a mask for 32 codes) are a bf16 worth
//! `2^-120` times the code's value: the codes are read in the unit [`UNIT`], which the
//! attention loop applies ([`crate::kernels::math::Simd::code_unit`]), as for AVX2's
//! FP8 and the AMX tiles'. `vdpbf16ps` flushes denormal inputs and products to zero,
//! so the loop keeps the f32 side in range whatever the magnitudes of the stored
//! values: it lifts each query row whose largest magnitude is below `2^64` into
//! `[2^64, 2^65)` ([`QUERY_EXPONENT`]; by at most the unit), so that its products with
//! the smallest normal code, `2^-126` in the unit, stay far above the denormals; and it
//! shifts each chunk's weights (times their values' scales) by a power of two that
//! keeps their products with the codes near `2^16`. Before (fixed factors of 2^64 in
//! the kernel, unit 1), queries near 1e-30 against keys near 1e30 lost every product,
//! and queries near 1e30 overflowed.
//!
//! The f32 side, the query rows and the softmax weights, is rounded to bf16 (to
//! nearest): 8 bits of mantissa, a relative error of at most `2^-9` on each product,
//! against the 4 bits of mantissa of the codes themselves: the precision at which GPU
//! engines' FP8 attention kernels commonly compute (codes widened to bf16 or f16 beside
//! queries of that type, sums in f32). Until December
//! 2026 each was split into two bf16, `hi = bf16(x)` and `lo = bf16(x - hi)` (16 bits of
//! mantissa, at most 4.7e-6 of the output in the kernel tests), at twice the dot
//! products. Measured on a 2-vCPU Zen 4 (AVX512_BF16, no AMX), against that form:
//! - `kv_quant_error`'s kernel table (decode through `KvCache::decode` of data with
//!   outlier channels): FP8 with a scale per token 3.69e-2 mean relative error both
//!   ways (worst 5.22e-2 against 5.34e-2); with a fixed calibrated scale 5.51e-2
//!   against 5.46e-2 (worst 1.06e-1 against 1.02e-1);
//! - decode time, the two builds alternating: 0.70–0.78 in cache (1 × 256 tokens, one
//!   thread), 0.74–0.84 out of cache (32 × 2048, two threads); in two alternating
//!   `decode_bandwidth` runs each, FP8 read at 47–61% of the probe against 37–48%,
//!   level with int8 (48–61% in the same runs), and its chunked prefill ran at 83–89%
//!   of the FMA peak against 54–62%;
//! - SmolLM2-135M (head dim 64) against candle (`examples/smollm`, `tests/exact.rs`):
//!   an FP8 cache generated 66 of 128 tokens alike before the first difference, logits
//!   within 7.6e-2 of the largest up to it, against 70 and 7.3e-2.
//!
//! So the rounding adds little to the codes' own error: about 2e-3 of the outputs in
//! the kernel tests, where the codes lose 4e-2.
//!
//! Where the result differs from the f32 arithmetic's: that rounding; subnormal codes
//! (values below `2^-6`, under `2^-6 / 448` of their row's largest value) read as 0,
//! since `vdpbf16ps` treats denormal inputs as zero; and the NaN codes (which only a
//! NaN input writes) read as ±480 instead of NaN.
//!
//! Orders as in [`super::pairs`]: a query row's bf16 are kept per group of 64
//! dimensions as its even dimensions', then its odd ones' (32 each: the first 32
//! floats of the group's 64).

use core::arch::x86_64::*;

use super::pairs::{self, BLOCK, GROUP};
use crate::dtype::{Element, Kind};
use crate::kernels::MAX_HEAD_DIM;

/// The unit of the decoded codes, 2^120 ([`crate::kernels::avx2::FP8_UNIT`]).
pub(in crate::kernels) const UNIT: f32 = crate::kernels::avx2::FP8_UNIT;

/// Where the loop lifts the query rows ([`crate::kernels::math::Simd::query_exponent`]).
pub(in crate::kernels) const QUERY_EXPONENT: i32 = 64;

/// The unit in which this arithmetic reads the codes of storage of kind `kind`, and the
/// exponent its query rows are lifted to: [`UNIT`] and [`QUERY_EXPONENT`] for FP8,
/// `None` for the storage types it does not take. O(1).
#[inline(always)]
pub(in crate::kernels) fn code_unit(kind: Kind) -> Option<(f32, i32)> {
    (kind == Kind::Fp8E4m3).then_some((UNIT, QUERY_EXPONENT))
}

/// Whether storage `T` with head dimension `hd` takes this arithmetic. O(1).
#[inline(always)]
pub(in crate::kernels) fn applies<T: Element>(hd: usize) -> bool {
    T::KIND == Kind::Fp8E4m3 && hd.is_multiple_of(GROUP) && hd > 0
}

/// The bits of a 512-bit integer vector as 32 bf16.
#[inline(always)]
fn bh(x: __m512i) -> __m512bh {
    // SAFETY: both are 64 bytes of plain bits, every pattern valid.
    unsafe { core::mem::transmute::<__m512i, __m512bh>(x) }
}

/// The bits of 16 bf16 as a 256-bit integer vector.
#[inline(always)]
fn bits256(x: __m256bh) -> __m256i {
    // SAFETY: both are 32 bytes of plain bits, every pattern valid.
    unsafe { core::mem::transmute::<__m256bh, __m256i>(x) }
}

/// The relative rounding of the f32 side: each query element and weight is within
/// `2^-9` of itself ([`to_bf16`]).
#[cfg(test)]
pub(in crate::kernels) const ROUNDING: f64 = 1.0 / 512.0;

/// `x` (16 floats) as bf16, rounded to nearest: within `2^-9 |x|` of `x`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
#[inline]
fn to_bf16(x: __m512) -> __m256i {
    bits256(_mm512_cvtneps_pbh(x))
}

/// Puts a scaled query row (`row[..hd]`, dimension order) into the form
/// [`pairs::scores4`] and [`pairs::scores1`] read: per group of 64 dimensions, the bf16
/// of its even dimensions, then of its odd ones, in the group's first 32 floats (the
/// other 32 are zero), the row as the loop lifted it (see the module). O(hd).
///
/// # Safety
/// The CPU has AVX-512F, BW and BF16; `applies` holds for `hd`, and `row.len() >= hd`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn encode_query(row: &mut [f32], hd: usize) {
    assert!(row.len() >= hd && hd <= MAX_HEAD_DIM);
    let mut out = [0u16; 2 * MAX_HEAD_DIM];
    let (rp, op) = (row.as_ptr(), out.as_mut_ptr());
    // SAFETY: loads of `row[d..+32]` with `d + 32 <= hd`; stores of 16 bf16 at
    // `out[2 group + half + 32 j..]` (j < 2), inside `out[..2 hd]`.
    unsafe {
        for d in (0..hd).step_by(32) {
            let (a, b) = (_mm512_loadu_ps(rp.add(d)), _mm512_loadu_ps(rp.add(d + 16)));
            let (group, half) = (d / GROUP * GROUP, d % GROUP / 2);
            let (even, odd) = pairs::even_odd_ps(a, b);
            for (j, x) in [to_bf16(even), to_bf16(odd)].into_iter().enumerate() {
                _mm256_storeu_si256(op.add(2 * group + half + 32 * j).cast(), x);
            }
        }
    }
    for (slot, pair) in row[..hd].iter_mut().zip(out[..2 * hd].chunks_exact(2)) {
        *slot = f32::from_bits(u32::from(pair[0]) | u32::from(pair[1]) << 16);
    }
}

/// The bf16 of the even and of the odd codes of `x` (times `2^-120`: see the module).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
#[inline]
fn even_odd(x: __m512i) -> (__m512i, __m512i) {
    // Sign to bit 15 (copied into bits 14..11 by the arithmetic shift, then masked
    // off), exponent and mantissa to bits 10..4.
    let mask = _mm512_set1_epi16(0x87F0u16 as i16);
    (
        _mm512_and_si512(_mm512_srai_epi16::<4>(_mm512_slli_epi16::<8>(x)), mask),
        _mm512_and_si512(_mm512_srai_epi16::<4>(x), mask),
    )
}

/// The weights `p[..m]` (`m <= BLOCK`, in the unit's range: see the module) as bf16,
/// two tokens to a word (the first in the low half; an odd last token pairs with 0).
/// O(m).
///
/// # Safety
/// The CPU has AVX-512F, BW and BF16; `p.len() >= m`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
#[inline]
unsafe fn encode_weights(p: &[f32], m: usize, words: &mut [u32; BLOCK / 2]) {
    assert!(p.len() >= m && m <= BLOCK);
    for c in (0..m).step_by(16) {
        let left = m - c;
        let mask: __mmask16 = if left >= 16 {
            0xFFFF
        } else {
            (1u16 << left) - 1
        };
        // SAFETY: the masked load reads only `p[c..m]`; the stores write 8 words at
        // `[c / 2..]`, `c < m <= BLOCK`.
        unsafe {
            let x = to_bf16(_mm512_maskz_loadu_ps(mask, p.as_ptr().add(c)));
            _mm256_storeu_si256(words.as_mut_ptr().add(c / 2).cast(), x);
        }
    }
}

/// The FP8 arithmetic of [`pairs`]' loops.
pub(in crate::kernels) struct Fp8Pairs;

// SAFETY (every method): the callers' (the CPU has AVX-512F, BW and BF16; pointers as
// the trait says).
impl pairs::PairDots for Fp8Pairs {
    /// The group's even and odd dimensions (32 bf16 each).
    type Query = [__m512i; 2];
    #[inline(always)]
    unsafe fn even_odd(x: __m512i) -> (__m512i, __m512i) {
        unsafe { even_odd(x) }
    }
    #[inline(always)]
    unsafe fn load_query(q: *const f32) -> Self::Query {
        core::array::from_fn(|j| unsafe { _mm512_loadu_si512(q.add(16 * j).cast()) })
    }
    #[inline(always)]
    unsafe fn dot_key(acc: __m512i, e: __m512i, o: __m512i, q: Self::Query) -> __m512i {
        unsafe {
            let [qe, qo] = q.map(bh);
            let acc = _mm512_dpbf16_ps(_mm512_castsi512_ps(acc), bh(e), qe);
            _mm512_castps_si512(_mm512_dpbf16_ps(acc, bh(o), qo))
        }
    }
    #[inline(always)]
    unsafe fn add(a: __m512i, b: __m512i) -> __m512i {
        unsafe {
            _mm512_castps_si512(_mm512_add_ps(
                _mm512_castsi512_ps(a),
                _mm512_castsi512_ps(b),
            ))
        }
    }
    #[inline(always)]
    unsafe fn to_f32(a: __m512i) -> __m512 {
        unsafe { _mm512_castsi512_ps(a) }
    }
    #[inline(always)]
    unsafe fn reduce(a: __m512i) -> f32 {
        unsafe { _mm512_reduce_add_ps(_mm512_castsi512_ps(a)) }
    }
    #[inline(always)]
    unsafe fn score_factor(_q: *const f32, _hd: usize) -> f32 {
        1.0
    }
    #[inline(always)]
    unsafe fn encode_weights(p: &[f32], m: usize, words: &mut [u32; BLOCK / 2]) -> f32 {
        unsafe { encode_weights(p, m, words) };
        1.0
    }
    #[inline(always)]
    unsafe fn dot_values(acc: &mut [__m512i; 4], parts: &[__m512i; 4], w: u32) {
        unsafe {
            let b = bh(_mm512_set1_epi32(w as i32));
            for (a, &part) in acc.iter_mut().zip(parts) {
                *a = _mm512_castps_si512(_mm512_dpbf16_ps(_mm512_castsi512_ps(*a), bh(part), b));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Fp8E4m3;
    use crate::quant::fp8;

    fn bf16_dot() -> bool {
        !cfg!(miri)
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }

    #[test]
    fn every_normal_code_is_its_value_times_2_to_the_minus_120() {
        if !bf16_dot() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        for start in [0usize, 64, 128, 192] {
            let codes: [u8; 64] = core::array::from_fn(|i| (start + i) as u8);
            let mut out = [[0u16; 32]; 2];
            // SAFETY: AVX-512BW checked above; 64-byte load and stores.
            unsafe {
                let (e, o) = even_odd(_mm512_loadu_si512(codes.as_ptr().cast()));
                _mm512_storeu_si512(out[0].as_mut_ptr().cast(), e);
                _mm512_storeu_si512(out[1].as_mut_ptr().cast(), o);
            }
            for (i, &c) in codes.iter().enumerate() {
                let bits = out[i % 2][i / 2];
                let got = f64::from(f32::from_bits(u32::from(bits) << 16)) * 2f64.powi(120);
                let want = fp8::decode(c);
                let (exponent, magnitude) = (c >> 3 & 15, c & 0x7F);
                if exponent == 0 || magnitude == 0x7F {
                    // Subnormal codes become bf16 denormals (read as 0 by vdpbf16ps),
                    // and the NaN codes a finite value: see the module.
                    continue;
                }
                assert_eq!(got, f64::from(want), "code {c:#04x}");
            }
        }
    }

    /// The scores and the accumulation against f64 on the codes ([`pairs::check_loops`]).
    #[test]
    fn scores_and_values_match_f64() {
        if !bf16_dot() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        // SAFETY: the extension is checked above; the encoding is this module's.
        unsafe {
            pairs::check_loops::<Fp8Pairs, Fp8E4m3>(
                |x| Fp8E4m3(fp8::encode(x * 400.0 + 0.5f32.copysign(x))),
                |c| f64::from(fp8::decode(c.0)),
                encode_query,
                UNIT,
                ROUNDING,
            );
        }
    }
}
