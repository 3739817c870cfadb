//! What the two dot-product arithmetics for 8-bit codes ([`super::int8_vnni`],
//! [`super::fp8_bf16`]) share: both widen a 64-byte load of codes to 16-bit elements
//! as its even and its odd bytes, and both take, per 32-bit lane, the products of two
//! 16-bit pairs (`vpdpwssd`, `vdpbf16ps`).
//!
//! - Scores: a query row's 16-bit elements are kept in the same even/odd order, so a
//!   key needs no reordering; 16 partial sums per (row, token) are then reduced
//!   sixteen at a time ([`sum16`]).
//! - Weighted values: the codes of two tokens are interleaved per dimension
//!   ([`interleave`]), so that each lane pairs token `t` and `t + 1` of one dimension
//!   against the pair of their weights. The accumulators then hold each group's 64
//!   dimensions in the order of [`acc_dim`]; [`from_acc_order`] puts them back.

use core::arch::x86_64::*;

/// Dimensions per group (one 64-byte load of codes).
pub(in crate::kernels) const GROUP: usize = 64;

/// The dimension (within its group of 64) that position `pos` of an accumulator group
/// holds: position `16 k + 4 l + i` holds `16 l + 8 (k & 1) + 2 i + (k >> 1)` (part `k`
/// of [`interleave`], 128-bit lane `l`, element `i`). O(1).
pub(in crate::kernels) const fn acc_dim(pos: usize) -> usize {
    let (k, l, i) = (pos / 16, pos % 16 / 4, pos % 4);
    16 * l + 8 * (k & 1) + 2 * i + (k >> 1)
}

/// Puts accumulated rows (a multiple of [`GROUP`] long) from the order of [`acc_dim`]
/// back into dimension order. O(rows.len()).
pub(in crate::kernels) fn from_acc_order(rows: &mut [f32]) {
    for g in rows.chunks_exact_mut(GROUP) {
        let mut src = [0.0f32; GROUP];
        src.copy_from_slice(g);
        for (pos, &x) in src.iter().enumerate() {
            g[acc_dim(pos)] = x;
        }
    }
}

/// The four vectors whose 32-bit lanes pair, per dimension, 16-bit elements of token
/// `t` (`e0`, `o0`: its even and odd elements) with those of token `t + 1` (`e1`,
/// `o1`): lane `4 l + i` of part `k` holds dimension [`acc_dim`]`(16 k + 4 l + i)`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(in crate::kernels) fn interleave(
    e0: __m512i,
    o0: __m512i,
    e1: __m512i,
    o1: __m512i,
) -> [__m512i; 4] {
    [
        _mm512_unpacklo_epi16(e0, e1),
        _mm512_unpackhi_epi16(e0, e1),
        _mm512_unpacklo_epi16(o0, o1),
        _mm512_unpackhi_epi16(o0, o1),
    ]
}

/// The 32 floats `a` (dimensions `0..16` of a half group) and `b` (`16..32`) as their
/// even dimensions and their odd ones (the order the arithmetics keep a query row in).
#[target_feature(enable = "avx512f")]
#[inline]
pub(in crate::kernels) fn even_odd_ps(a: __m512, b: __m512) -> (__m512, __m512) {
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    (
        _mm512_permutex2var_ps(a, even, b),
        _mm512_permutex2var_ps(a, odd, b),
    )
}

/// Sixteen horizontal sums at once: lane `j` of the result is the sum (by `add`, on
/// 32-bit lanes: integer or float bits) of the lanes of `v[j]`; a transposing
/// reduction, 45 instructions for 16 sums.
#[target_feature(enable = "avx512f")]
#[inline]
pub(in crate::kernels) fn sum16(
    v: [__m512i; 16],
    add: impl Fn(__m512i, __m512i) -> __m512i,
) -> __m512i {
    // Pairs: within each 128-bit lane, elements 0 and 2 belong to v[2m], 1 and 3 to
    // v[2m + 1].
    let w: [__m512i; 8] = core::array::from_fn(|m| {
        let (a, b) = (v[2 * m], v[2 * m + 1]);
        add(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
    });
    // Quads: element `p` of each 128-bit lane belongs to v[4m + p].
    let x: [__m512i; 4] = core::array::from_fn(|m| {
        let (a, b) = (w[2 * m], w[2 * m + 1]);
        add(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
    });
    // Then the four 128-bit lanes of each quad, two shuffles at a time.
    let pair = |a: __m512i, b: __m512i| {
        add(
            _mm512_shuffle_i32x4::<0x88>(a, b),
            _mm512_shuffle_i32x4::<0xDD>(a, b),
        )
    };
    let (z0, z1) = (pair(x[0], x[1]), pair(x[2], x[3]));
    pair(z0, z1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acc_order_is_a_permutation_and_round_trips() {
        let mut seen = [false; GROUP];
        for pos in 0..GROUP {
            assert!(!core::mem::replace(&mut seen[acc_dim(pos)], true));
        }
        let x: Vec<f32> = (0..128).map(|i| i as f32).collect();
        let mut y: Vec<f32> = (0..128)
            .map(|p| (p / 64 * 64 + acc_dim(p % 64)) as f32)
            .collect();
        from_acc_order(&mut y);
        assert_eq!(x, y);
    }

    #[test]
    fn interleave_pairs_tokens_per_dimension_in_acc_order() {
        if cfg!(miri) || !std::arch::is_x86_feature_detected!("avx512bw") {
            eprintln!("skipped: this CPU has no AVX-512BW");
            return;
        }
        // 16-bit elements: token `t`'s dimension `d` is `1000 t + d`, even and odd
        // elements of a group apart as the arithmetics keep them.
        let elems = |t: i16, odd: i16| -> [i16; 32] {
            core::array::from_fn(|e| 1000 * t + 2 * e as i16 + odd)
        };
        let mut out = [[0i32; 16]; 4];
        // SAFETY: AVX-512BW checked above; 64-byte loads and stores of 32 i16 / 16 i32.
        unsafe {
            let load = |x: [i16; 32]| _mm512_loadu_si512(x.as_ptr().cast());
            let parts = interleave(
                load(elems(0, 0)),
                load(elems(0, 1)),
                load(elems(1, 0)),
                load(elems(1, 1)),
            );
            for (o, p) in out.iter_mut().zip(parts) {
                _mm512_storeu_si512(o.as_mut_ptr().cast(), p);
            }
        }
        for (k, o) in out.iter().enumerate() {
            for (lane, &word) in o.iter().enumerate() {
                let d = acc_dim(16 * k + lane) as i32;
                assert_eq!(
                    (word as i16, (word >> 16) as i16),
                    (d as i16, 1000 + d as i16)
                );
            }
        }
    }

    #[test]
    fn sixteen_sums_at_once_match_one_at_a_time() {
        if cfg!(miri) || !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        // Large lanes of both signs, so a carry across lanes would show.
        let lanes: Vec<i32> = (0..256u32)
            .map(|i| i.wrapping_mul(2_654_435_761) as i32 / 16)
            .collect();
        // SAFETY: AVX-512F checked above; 16 ints per load and store.
        unsafe {
            let v: [__m512i; 16] =
                core::array::from_fn(|j| _mm512_loadu_si512(lanes[16 * j..].as_ptr().cast()));
            let mut out = [0i32; 16];
            let sums = sum16(v, |a, b| _mm512_add_epi32(a, b));
            _mm512_storeu_si512(out.as_mut_ptr().cast(), sums);
            for (j, &o) in out.iter().enumerate() {
                let want = lanes[16 * j..16 * (j + 1)]
                    .iter()
                    .fold(0i32, |a, &x| a.wrapping_add(x));
                assert_eq!(o, want, "sum {j}");
            }
        }
    }
}
