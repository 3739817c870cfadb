//! Horizontal sums on AVX-512F, sixteen at a time: a dot product accumulates partial
//! sums across the lanes of a register, and the scores loops end with 16 such
//! registers (four query rows × four keys). Reducing them together (a transposing
//! tree, 45 instructions) costs about half of reducing each row's four on its own
//! (`vhaddps` on 8-lane halves, about 80); on the f16 and f32 decode in cache that
//! was 10-12% of the time.

use core::arch::x86_64::*;

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

/// The sixteen horizontal sums of `a[r][i]` (f32 accumulators of four rows × four
/// tokens), as `[row][token]`: one [`sum16`]. O(1).
#[target_feature(enable = "avx512f")]
#[inline]
pub(in crate::kernels) fn sums_4x4(a: [[__m512; 4]; 4]) -> [[f32; 4]; 4] {
    // Lane `4 r + i` of the reduction is row `r`, token `i`.
    let v: [__m512i; 16] = core::array::from_fn(|j| _mm512_castps_si512(a[j / 4][j % 4]));
    let sums = sum16(v, |x, y| {
        _mm512_castps_si512(_mm512_add_ps(
            _mm512_castsi512_ps(x),
            _mm512_castsi512_ps(y),
        ))
    });
    let mut out = [0.0f32; 16];
    // SAFETY: `out` holds 16 floats.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_castsi512_ps(sums)) };
    core::array::from_fn(|r| core::array::from_fn(|i| out[4 * r + i]))
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn four_rows_of_four_sums_match_one_at_a_time() {
        if cfg!(miri) || !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        // Distinct lanes, exact in f32, so the order of the additions cannot matter.
        let lanes: Vec<f32> = (0..256u32).map(|i| (i * 37 % 256) as f32 - 100.0).collect();
        // SAFETY: AVX-512F checked above; 16 floats per load.
        let sums = unsafe {
            sums_4x4(core::array::from_fn(|r| {
                core::array::from_fn(|i| _mm512_loadu_ps(lanes[16 * (4 * r + i)..].as_ptr()))
            }))
        };
        for (r, row) in sums.iter().enumerate() {
            for (i, &x) in row.iter().enumerate() {
                let j = 4 * r + i;
                assert_eq!(
                    x,
                    lanes[16 * j..16 * (j + 1)].iter().sum::<f32>(),
                    "row {r} token {i}"
                );
            }
        }
    }
}
