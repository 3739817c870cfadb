//! Int8 codes in integer arithmetic with AVX-512 VNNI: `vpdpwssd` adds, in each of
//! sixteen 32-bit lanes, two products of 16-bit integers, so one instruction does 32
//! multiply-adds where an f32 FMA does 16, and the codes need no conversion to float.
//!
//! Both operands of each product must be integers, so the f32 side is put in 16-bit
//! fixed point, exactly as the codes put K and V in 8-bit fixed point:
//!
//! - a **query row** once per task ([`encode_query`]): codes `round(q / s)` with `s =
//!   max |q| / 32767`, so each element is off by at most `2^-16 max |q|`;
//! - the **softmax weights** of each block of tokens ([`pairs::accumulate`]): per row,
//!   codes `round(p / w)` with `w = max p / 32767` over the block (weights are never
//!   negative).
//!
//! Products and sums are then exact (32-bit lanes, which cannot overflow: see the
//! assertion on [`BLOCK`]), and the scales are applied once per score and once per
//! accumulated vector. The rounding of those two conversions is the whole of the
//! arithmetic's error: at most 3.4e-6 of the output in the kernel tests, invisible
//! beside what 8-bit storage itself rounds away (`cargo bench -p kvpage --bench
//! kv_quant_error`, its kernel table).
//!
//! Orders. The key codes are taken as even and odd bytes (two shifts each), so a query
//! row's codes are kept, per group of 64 dimensions, as the 32 even dimensions and then
//! the 32 odd ones. The values of two tokens are interleaved per dimension (`vpunpck*wd`,
//! within 128-bit lanes), so the accumulators hold each group's dimensions in the order
//! of [`pairs::acc_dim`]; [`pairs::from_acc_order`] puts them back, once per task.
//!
//! Fewer bits on the f32 side, measured and not taken (Zen 4, December 2026; decode of
//! 32 query heads over 8 KV heads, head dim 128, one thread, K/V in cache; best times
//! of alternating builds). Here the two loops of dot products take about 60% of an int8
//! decode (sampled: the scores with their reductions 32%, the value accumulation 29%),
//! the rest being the softmax and the per-chunk bookkeeping, so halving their products
//! moves the whole little:
//! - The **weights in 8 bits** against the values' bytes as they are stored, `vpdpbusd`
//!   (four tokens a lane, no widening of the codes). Rounded one by one: 0.90-0.95 of
//!   the time over 256 tokens, but biased, since beside one dominant weight (an
//!   attention sink) a flat tail of weights under half a step rounds to zero together.
//!   Rounded as differences of the rounded running sums (every prefix of a block's
//!   weights within half a step): 0.96-0.97 over 256 tokens, 0.94-0.95 over 2048. Either
//!   way an output of the online loop's test moved by 1e-3 (1% of it; 16-bit weights:
//!   up to 3.3e-5); diffused, int8's mean error through the kernel rose from 3.43e-2 to
//!   3.57e-2 (`kv_quant_error`).
//! - The **queries in 8 bits** as well (`vpdpbusd` scores, keys offset to unsigned):
//!   0.92-0.98 of the time in all. Each query element would be off by up to `2^-8` of
//!   its row's largest, as far as int8 storage rounds each key: twice the scores'
//!   rounding, for a few percent.

use core::arch::x86_64::*;

use super::fixed16::{fixed_point, pack_pairs};
use super::pairs::{self, BLOCK, GROUP};
use crate::dtype::{Element, Kind};
use crate::kernels::MAX_HEAD_DIM;

// The 32-bit accumulators of weighted values take a `BLOCK` of tokens before they are
// scaled into the f32 ones: `BLOCK / 2` `vpdpwssd` per lane, each adding at most `2 ×
// 32767 × 128` in magnitude, stay below `2^31` for a block of up to 256 tokens.
const _: () = assert!(BLOCK <= 256);

/// Whether storage `T` with head dimension `hd` takes this arithmetic. O(1).
#[inline(always)]
pub(in crate::kernels) fn applies<T: Element>(hd: usize) -> bool {
    T::KIND == Kind::Int8 && hd.is_multiple_of(GROUP) && hd > 0
}

/// The unit in which this arithmetic reads the codes of storage of kind `_kind`, and
/// the exponent its query rows are lifted to: none other than the plain arithmetic's
/// (the scores and sums are scaled in the kernels). O(1).
#[inline(always)]
pub(in crate::kernels) fn code_unit(_kind: Kind) -> Option<(f32, i32)> {
    None
}

/// Puts a scaled query row (`row[..hd]`, dimension order) into the form
/// [`pairs::scores4`] and [`pairs::scores1`] read: per group of 64 dimensions, its first
/// 32 floats hold the group's 16-bit codes as bits (two per float: the even dimensions,
/// then the odd ones), and `row[SCALE_SLOT]` holds the row's scale. O(hd).
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
    for (slots, group) in row[..hd]
        .chunks_exact_mut(GROUP)
        .zip(codes[..hd].chunks_exact(GROUP))
    {
        pack_pairs(slots, group);
    }
    row[SCALE_SLOT] = scale;
}

/// Where an encoded query row keeps its scale: the second half of its first group
/// (each group's 64 codes fill the first 32 of its 64 floats).
const SCALE_SLOT: usize = GROUP / 2;

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

/// The int8 arithmetic of [`pairs`]' loops.
pub(in crate::kernels) struct Int8Pairs;

/// `vpdpwssd`: `acc` plus, per 32-bit lane, the sum of the two products of the 16-bit
/// elements of `a` and `b`. Written as the instruction itself: LLVM otherwise rewrites
/// most of them (57 of 92 in the decode) into `vpmaddwd` + `vpaddd`, one instruction
/// more each, to shorten dependency chains that the loops already interleave.
///
/// # Safety
/// The CPU has AVX-512F and VNNI.
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut acc = acc;
    // SAFETY: the instruction exists (caller) and touches these registers only.
    unsafe {
        core::arch::asm!(
            "vpdpwssd {acc}, {a}, {b}",
            acc = inout(zmm_reg) acc,
            a = in(zmm_reg) a,
            b = in(zmm_reg) b,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    acc
}

// SAFETY (every method): the callers' (the CPU has AVX-512F, BW and VNNI; pointers as
// the trait says).
impl pairs::PairDots for Int8Pairs {
    /// The group's 32 even and 32 odd query codes.
    type Query = (__m512i, __m512i);
    #[inline(always)]
    unsafe fn even_odd(x: __m512i) -> (__m512i, __m512i) {
        unsafe { even_odd(x) }
    }
    #[inline(always)]
    unsafe fn load_query(q: *const f32) -> Self::Query {
        // The group's codes fill its first 32 floats: even, then odd.
        unsafe {
            (
                _mm512_loadu_si512(q.cast()),
                _mm512_loadu_si512(q.add(16).cast()),
            )
        }
    }
    #[inline(always)]
    unsafe fn dot_key(acc: __m512i, e: __m512i, o: __m512i, q: Self::Query) -> __m512i {
        unsafe { dpwssd(dpwssd(acc, e, q.0), o, q.1) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn to_f32(a: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(a) }
    }
    #[inline(always)]
    unsafe fn reduce(a: __m512i) -> f32 {
        unsafe { _mm512_reduce_add_epi32(a) as f32 }
    }
    #[inline(always)]
    unsafe fn score_factor(q: *const f32, hd: usize) -> f32 {
        debug_assert!(SCALE_SLOT < hd);
        unsafe { *q.add(SCALE_SLOT) }
    }
    #[inline(always)]
    unsafe fn encode_weights(p: &[f32], m: usize, words: &mut [u32; BLOCK / 2]) -> f32 {
        unsafe { encode_weights(p, m, words) }
    }
    #[inline(always)]
    unsafe fn dot_values(acc: &mut [__m512i; 4], parts: &[__m512i; 4], w: u32) {
        unsafe {
            let b = _mm512_set1_epi32(w as i32);
            for (a, &part) in acc.iter_mut().zip(parts) {
                *a = dpwssd(*a, part, b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixed16::ONE;
    use super::*;
    use crate::dtype::Int8;

    fn vnni() -> bool {
        !cfg!(miri)
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }

    #[test]
    fn query_codes_are_within_half_a_step() {
        if !vnni() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        let hd = 128;
        let q = pairs::test_values(hd, 3);
        let mut row = q.clone();
        // SAFETY: VNNI checked above.
        unsafe { encode_query(&mut row, hd) };
        let scale = row[SCALE_SLOT];
        let max = q.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert_eq!(scale, max / ONE);
        // Each group's codes fill the first half of its floats.
        let codes: Vec<i16> = row
            .chunks_exact(GROUP)
            .flat_map(|g| &g[..GROUP / 2])
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
        assert!(bad[SCALE_SLOT].is_nan());
    }

    /// The scores and the accumulation against f64 on the codes ([`pairs::check_loops`]).
    #[test]
    fn scores_and_values_match_f64() {
        if !vnni() {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
            return;
        }
        // SAFETY: the extension is checked above; the encoding is this module's.
        unsafe {
            pairs::check_loops::<Int8Pairs, Int8>(
                |x| Int8((x * 127.0).round() as i8),
                |c| f64::from(c.0),
                encode_query,
                1.0,
                1e-4,
            );
        }
    }
}
