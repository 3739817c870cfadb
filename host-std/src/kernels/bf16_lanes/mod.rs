//! Arithmetic for bf16 storage that never moves data across lanes, on AVX-512F
//! ([`avx512`], 16 lanes) and AVX2 + FMA ([`avx2`], 8 lanes).
//!
//! A bf16 value is the high half of an f32, so the bf16 of one vector-wide load widen
//! with one instruction per half: the even elements (low halves of the 32-bit lanes)
//! shifted up by 16 bits, the odd ones (high halves) with the low halves masked off.
//! Both stay in their lanes, where the general paths' `vpmovzxwd` crosses them; on the
//! development CPU (AMD EPYC, AVX-512 executed as two 256-bit halves) that widening was
//! half the time of the scores.
//!
//! The price is the order of the dimensions: within each group of `2 × lanes`, the f32
//! rows the arithmetic reads and writes (scaled queries, output accumulators) hold the
//! even dimensions first, then the odd ones ([`to_split_order`]; [`from_split_order`]
//! undoes it). The dot products do not care, being sums; the accumulators are put back
//! in order once per task. Used when the head dimension is a multiple of the group
//! ([`applies`]); other head dims take the general path.

pub(super) mod avx2;
pub(super) mod avx512;

use crate::dtype::{Element, Kind};

/// Whether storage `T` with head dimension `hd` takes the path whose groups are `group`
/// dimensions wide. O(1).
#[inline(always)]
pub(super) fn applies<T: Element>(hd: usize, group: usize) -> bool {
    T::KIND == Kind::Bf16 && hd.is_multiple_of(group) && hd > 0
}

/// Reorders each group of `group` in `rows` (a multiple of `group` long; `group` even,
/// at most 32) to even dimensions first, then odd. O(rows.len()).
pub(super) fn to_split_order(rows: &mut [f32], group: usize) {
    let half = group / 2;
    for g in rows.chunks_exact_mut(group) {
        let mut src = [0.0f32; 32];
        src[..group].copy_from_slice(g);
        for i in 0..half {
            g[i] = src[2 * i];
            g[half + i] = src[2 * i + 1];
        }
    }
}

/// Inverse of [`to_split_order`]. O(rows.len()).
pub(super) fn from_split_order(rows: &mut [f32], group: usize) {
    let half = group / 2;
    for g in rows.chunks_exact_mut(group) {
        let mut src = [0.0f32; 32];
        src[..group].copy_from_slice(g);
        for i in 0..half {
            g[2 * i] = src[i];
            g[2 * i + 1] = src[half + i];
        }
    }
}

/// Bytes of `T`'s storage as a pointer to bytes (the bf16 bit patterns).
#[inline(always)]
fn bytes<T: Element>(x: &[T]) -> *const u8 {
    x.as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_order_round_trips() {
        for group in [16, 32] {
            let x: Vec<f32> = (0..96).map(|i| i as f32).collect();
            let mut y = x.clone();
            to_split_order(&mut y, group);
            assert_eq!(&y[..4], &[0.0, 2.0, 4.0, 6.0]);
            assert_eq!(&y[group / 2..group / 2 + 2], &[1.0, 3.0]);
            assert_eq!(&y[group..group + 2], &[group as f32, group as f32 + 2.0]);
            from_split_order(&mut y, group);
            assert_eq!(x, y);
        }
    }
}
