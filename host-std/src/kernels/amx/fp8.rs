//! FP8 E4M3 storage in the bf16 tiles: each tile of 16 keys or values is decoded into
//! bf16 on the stack, then goes through [`super::bf16`]'s products unchanged.
//!
//! - **Decoding.** A code's bits `s eeee mmm` moved to `s 0000 eeee mmm 0000` are a
//!   bf16 worth `2^-120` of the code's value: the values' decoding, in the unit AVX2's
//!   FP8 keeps ([`UNIT`], which the attention loop applies to the scores and weights:
//!   [`crate::kernels::math::Simd::code_unit`]). Three instructions per 32 codes, which
//!   stay in their order, so the tiles of keys and values are laid out as bf16
//!   storage.
//! - **Keys** get 64 more in the exponent of every code but the subnormal ones (two
//!   instructions more), `2^-56` of their values, and the scores are multiplied by
//!   [`SCORE_FACTOR`] after the tile product: the tile products flush f32 subnormals
//!   to zero, and a query row lifted into `[1, 2)` ([`crate::kernels::online`]'s
//!   `lift_query`) times the smallest normal code at `2^-120` would be one. A score
//!   that the factor makes subnormal is rounded there once, at most `2^-149`: `2^-29`
//!   of its key's scale once the unit is applied.
//! - **What differs from the f32 arithmetic**: the tiles' bf16 rounding of the f32
//!   side ([`super::bf16`]), and the subnormal codes (values below `2^-6`, under
//!   `2^-6 / 448` of their token's largest), which read as 0, being bf16 subnormals.
//!   The NaN codes (which only a NaN input writes) read as ±480.

use core::arch::x86_64::*;
use core::mem::MaybeUninit;

use super::bf16;
use super::runs::TOKENS;
use crate::kernels::MAX_HEAD_DIM;

/// The unit of the decoded codes, 2^120 ([`crate::kernels::avx2::FP8_UNIT`]).
pub(in crate::kernels) const UNIT: f32 = crate::kernels::avx2::FP8_UNIT;

/// The exponent the keys' decoding adds.
const KEY_LIFT: i16 = 64;

/// What the tile products of keys decoded with [`KEY_LIFT`] are multiplied by, 2^-64.
pub(in crate::kernels) const SCORE_FACTOR: f32 = f32::from_bits((127 - KEY_LIFT as u32) << 23);

/// One tile's worth of decoded codes: up to 16 tokens × `MAX_HEAD_DIM` bf16.
pub(in crate::kernels) type Decoded = [half::bf16; TOKENS * MAX_HEAD_DIM];

/// Decodes `codes` (a multiple of 32 long, at most a [`Decoded`]) into the start of
/// `out` as bf16 worth their values over [`UNIT`], times `2^KEY_LIFT` for keys
/// (`KEYS`), the subnormal codes as bf16 subnormals; returns them. O(codes.len()).
///
/// # Safety
/// The CPU has AVX-512F and BW.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn decode<'a, const KEYS: bool>(
    codes: &[u8],
    out: &'a mut MaybeUninit<Decoded>,
) -> &'a [half::bf16] {
    let n = codes.len();
    assert!(n.is_multiple_of(32) && n <= TOKENS * MAX_HEAD_DIM);
    let bits = _mm512_set1_epi16(0x87F0u16 as i16);
    let (exponent, lift) = (_mm512_set1_epi16(0x0780), _mm512_set1_epi16(KEY_LIFT << 7));
    let (src, dst) = (codes.as_ptr(), out.as_mut_ptr().cast::<half::bf16>());
    // SAFETY: loads of `codes[i..i + 32]` and stores of 32 bf16 at `dst + i`, `i + 32
    // <= n`, inside `out` (asserted); the stores initialise `out[..n]`, which the
    // returned slice covers.
    unsafe {
        for i in (0..n).step_by(32) {
            // Sign-extended to 16 bits and shifted by four: the sign in bits 15..11,
            // the exponent and mantissa in 10..4; the mask keeps bit 15 of the sign.
            let x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(src.add(i).cast()));
            let mut b = _mm512_and_si512(_mm512_slli_epi16::<4>(x), bits);
            if KEYS {
                let normal = _mm512_test_epi16_mask(b, exponent);
                b = _mm512_mask_add_epi16(b, normal, b, lift);
            }
            _mm512_storeu_si512(dst.add(i).cast(), b);
        }
        core::slice::from_raw_parts(dst, n)
    }
}

/// Scores of four query rows against `n` keys of codes `k` (`n × hd` bytes), `s[r *
/// stride + t]`: [`super::bf16::scores4`] over each 16 keys decoded ([`decode`] with
/// the keys' lift), times [`SCORE_FACTOR`]. O(n × hd).
///
/// # Safety
/// As [`super::bf16::scores4`], for any `n >= 1`.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn scores4(
    q: &[f32],
    k: &[u8],
    hd: usize,
    n: usize,
    s: &mut [f32],
    stride: usize,
) {
    let mut decoded = MaybeUninit::uninit();
    for t in (0..n).step_by(TOKENS) {
        let m = (n - t).min(TOKENS);
        let s = &mut s[t..];
        // SAFETY: the caller's; `decode` needs AVX-512F and BW, which it implies.
        unsafe {
            let keys = decode::<true>(&k[t * hd..(t + m) * hd], &mut decoded);
            bf16::scores4(q, keys, hd, m, s, stride);
        }
        for r in 0..bf16::ROWS {
            for x in &mut s[r * stride..r * stride + m] {
                *x *= SCORE_FACTOR;
            }
        }
    }
}

/// `acc_r[d] += Σ_{t<n} p[r][t] · v_t[d]` over `n` values of codes `v` (`n × hd`
/// bytes), in [`UNIT`]: [`super::bf16::accumulate4`] over each 16 values decoded.
/// O(n × hd).
///
/// # Safety
/// As [`super::bf16::accumulate4`], for any `n >= 1`.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn accumulate4(
    acc: &mut [f32],
    p: [&[f32]; bf16::ROWS],
    v: &[u8],
    hd: usize,
    n: usize,
) {
    let mut decoded = MaybeUninit::uninit();
    for t in (0..n).step_by(TOKENS) {
        let m = (n - t).min(TOKENS);
        let p = p.map(|p| &p[t..]);
        // SAFETY: the caller's; `decode` needs AVX-512F and BW, which it implies.
        unsafe {
            let values = decode::<false>(&v[t * hd..(t + m) * hd], &mut decoded);
            bf16::accumulate4(acc, p, values, hd, m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::fp8;

    #[test]
    fn every_code_is_its_value_over_its_unit() {
        if cfg!(miri) || !std::arch::is_x86_feature_detected!("avx512bw") {
            eprintln!("skipped: this CPU has no AVX-512BW");
            return;
        }
        let codes: Vec<u8> = (0..=255u8).collect();
        let (mut values, mut keys) = (MaybeUninit::uninit(), MaybeUninit::uninit());
        // SAFETY: AVX-512BW checked above (it implies AVX-512F).
        let (values, keys) = unsafe {
            (
                decode::<false>(&codes, &mut values),
                decode::<true>(&codes, &mut keys),
            )
        };
        assert_eq!((values.len(), keys.len()), (256, 256));
        for ((&c, &b), &k) in codes.iter().zip(values).zip(keys) {
            let got = f64::from(b.to_f32()) * f64::from(UNIT);
            let key = f64::from(k.to_f32()) * f64::from(UNIT * SCORE_FACTOR);
            let (exponent, magnitude) = (c >> 3 & 15, c & 0x7F);
            let want = if magnitude == 0x7F {
                if c & 0x80 == 0 {
                    480.0
                } else {
                    -480.0
                }
            } else if exponent == 0 {
                // A bf16 subnormal (or zero), read as 0 by the tiles.
                assert!(b.to_f32().abs() < f32::MIN_POSITIVE, "code {c:#04x}: {b}");
                assert!(
                    k.to_f32().abs() < f32::MIN_POSITIVE,
                    "key code {c:#04x}: {k}"
                );
                continue;
            } else {
                f64::from(fp8::decode(c))
            };
            assert_eq!(got, want, "code {c:#04x}");
            assert_eq!(key, want, "key code {c:#04x}");
        }
    }
}
