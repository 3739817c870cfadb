//! Arithmetic for 16-bit and 8-bit storage that never moves data across lanes: bf16 on
//! AVX-512F ([`bf16_avx512`], 16 lanes) and AVX2 + FMA ([`bf16_avx2`], 8 lanes), the
//! 8-bit codes on AVX-512F ([`byte_avx512`]), and the 8-bit codes in the dot-product
//! extensions' arithmetic: int8 with VNNI ([`int8_vnni`]), FP8 with AVX512_BF16
//! ([`fp8_bf16`]), on what they share ([`pairs`]); and int8 keys' scores in AVX2's
//! 16-bit integer products ([`int8_avx2`]).
//!
//! One vector-wide load holds 2 bf16 (or 4 codes) in each 32-bit lane; each of them
//! widens with shifts and masks inside its lane, where the general paths' `vpmovzxwd` /
//! `vpmovsxbd` cross lanes; on the development CPU (AMD EPYC, AVX-512 executed as two
//! 256-bit halves) that widening was half the time of the scores.
//!
//! The price is the order of the dimensions: within each group of `parts × lanes`
//! dimensions, the f32 rows the arithmetic reads and writes (scaled queries, output
//! accumulators) hold the dimensions `parts · i + 0` first, then `parts · i + 1`, and so
//! on ([`to_split_order`]; [`from_split_order`] undoes it). The dot products do not
//! care, being sums; the accumulators are put back in order once per task. Used when
//! the head dimension is a multiple of the group; other head dims take the general path.

pub(super) mod bf16_avx2;
pub(super) mod bf16_avx512;
pub(super) mod byte_avx512;
pub(super) mod fixed16;
pub(super) mod fp8_bf16;
pub(super) mod int8_avx2;
pub(super) mod int8_vnni;
pub(super) mod pairs;

use crate::dtype::{Element, Kind};

/// Whether storage `T` with head dimension `hd` takes the path whose groups are `group`
/// dimensions wide. O(1).
#[inline(always)]
pub(super) fn applies<T: Element>(hd: usize, group: usize) -> bool {
    T::KIND == Kind::Bf16 && hd.is_multiple_of(group) && hd > 0
}

/// Whether 8-bit storage `T` with head dimension `hd` takes [`byte_avx512`]: int8, and
/// FP8 unless it decodes through f16 (`fp8_through_f16`, which the caller holds: on
/// Intel cores, [`super::avx2::Avx2::fp8_through_f16`]), where FP8 takes the general
/// route's decoding ([`super::avx512`]'s `fp8_half16`). There the in-lane decoding's shifts all queue on
/// the one port that runs 512-bit shifts, and its multiplication takes a microcode
/// assist for every subnormal code. Measured on Emerald Rapids (decode of 32 query heads
/// over 8 KV heads, head dim 128, AVX-512F without the dot-product extensions; medians
/// of the ratios of alternating runs), the general route's time over the in-lane
/// route's: 0.84 in cache (1 × 256 tokens, one thread) and 0.95 out of it (32 × 2048,
/// two threads) over random codes; 0.51 and 0.60 when one code in 301 is subnormal.
/// O(1).
#[inline(always)]
pub(super) fn applies_bytes<T: Element>(hd: usize, fp8_through_f16: bool) -> bool {
    (T::KIND == Kind::Int8 || (T::KIND == Kind::Fp8E4m3 && !fp8_through_f16))
        && hd.is_multiple_of(byte_avx512::GROUP)
        && hd > 0
}

/// Reorders each group of `GROUP` in `rows` (a multiple of `GROUP` long; `GROUP` a
/// multiple of `PARTS`, at most 64) so that dimension `PARTS · i + j` goes to
/// `j · GROUP / PARTS + i`. O(rows.len()); the sizes are constants so that the moves
/// unroll (with run-time sizes this took 4% of a bf16 decode of 256 tokens).
pub(super) fn to_split_order<const GROUP: usize, const PARTS: usize>(rows: &mut [f32]) {
    for g in rows.chunks_exact_mut(GROUP) {
        let src: [f32; GROUP] = core::array::from_fn(|k| g[k]);
        for (k, x) in g.iter_mut().enumerate() {
            // Position `k = j · lanes + i` takes dimension `PARTS · i + j`.
            let (j, i) = (k / (GROUP / PARTS), k % (GROUP / PARTS));
            *x = src[PARTS * i + j];
        }
    }
}

/// Inverse of [`to_split_order`]. O(rows.len()).
pub(super) fn from_split_order<const GROUP: usize, const PARTS: usize>(rows: &mut [f32]) {
    for g in rows.chunks_exact_mut(GROUP) {
        let src: [f32; GROUP] = core::array::from_fn(|k| g[k]);
        for (d, x) in g.iter_mut().enumerate() {
            // Dimension `d = PARTS · i + j` comes from position `j · lanes + i`.
            let (i, j) = (d / PARTS, d % PARTS);
            *x = src[j * (GROUP / PARTS) + i];
        }
    }
}

/// Bytes of `T`'s storage as a pointer to bytes (the stored bit patterns).
#[inline(always)]
fn bytes<T: Element>(x: &[T]) -> *const u8 {
    x.as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_order_round_trips() {
        let x: Vec<f32> = (0..96).map(|i| i as f32).collect();
        let mut y = x.clone();
        to_split_order::<16, 2>(&mut y);
        assert_eq!(&y[..4], &[0.0, 2.0, 4.0, 6.0]);
        assert_eq!(&y[8..10], &[1.0, 3.0]);
        assert_eq!(&y[16..18], &[16.0, 18.0]);
        from_split_order::<16, 2>(&mut y);
        assert_eq!(x, y);
        to_split_order::<32, 2>(&mut y);
        assert_eq!(&y[..4], &[0.0, 2.0, 4.0, 6.0]);
        assert_eq!(&y[16..18], &[1.0, 3.0]);
        assert_eq!(&y[32..34], &[32.0, 34.0]);
        from_split_order::<32, 2>(&mut y);
        assert_eq!(x, y);
        let x: Vec<f32> = (0..128).map(|i| i as f32).collect();
        let mut y = x.clone();
        to_split_order::<64, 4>(&mut y);
        assert_eq!(&y[..3], &[0.0, 4.0, 8.0]);
        assert_eq!(&y[16..18], &[1.0, 5.0]);
        assert_eq!(&y[48..50], &[3.0, 7.0]);
        assert_eq!(&y[64..66], &[64.0, 68.0]);
        from_split_order::<64, 4>(&mut y);
        assert_eq!(x, y);
    }
}
