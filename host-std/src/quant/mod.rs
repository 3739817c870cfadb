//! 8-bit codes for K/V with scales: the codecs of the storage dtypes
//! [`kvpage_core::DType::Int8`] and [`kvpage_core::DType::Fp8E4m3`] (one scale per
//! token and head), and reference functions over groups of any size, which back the
//! measurement of the scale granularity (`cargo bench -p kvpage --bench kv_quant_error`).
//!
//! A value `x` is stored as a code `c` and a scale `s` shared by a group of values:
//! `x ≈ s · decode(c)`. The scale maps the group's largest magnitude onto the code's
//! largest (127 for [`Code::Int8`], 448 for [`Code::Fp8E4m3`]), so nothing clips; or it
//! is fixed per layer by the caller ([`KvScales`]), and what lies beyond saturates.

pub mod fp8;

use crate::error::KernelError;

/// An 8-bit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// Symmetric integers −127..=127 (−128 unused, so the range is symmetric).
    Int8,
    /// FP8 E4M3 ([`fp8`]).
    Fp8E4m3,
}

impl Code {
    /// The code of a scaled storage dtype; `None` for the float dtypes (no error case).
    /// O(1).
    pub const fn of(dtype: kvpage_core::DType) -> Option<Self> {
        match dtype {
            kvpage_core::DType::Int8 => Some(Self::Int8),
            kvpage_core::DType::Fp8E4m3 => Some(Self::Fp8E4m3),
            _ => None,
        }
    }

    /// The largest magnitude a code holds: 127 for int8, 448 for FP8 E4M3. O(1).
    pub const fn max(self) -> f32 {
        match self {
            Self::Int8 => 127.0,
            Self::Fp8E4m3 => fp8::MAX,
        }
    }

    /// The code of `x / scale` (nearest; saturating). `scale > 0`. O(1).
    pub fn encode(self, x: f32, scale: f32) -> u8 {
        let y = x / scale;
        match self {
            Self::Int8 => {
                let r = y.round().clamp(-127.0, 127.0);
                // NaN rounds to 0 under the `as` conversion below; a NaN in the cache is
                // a caller's bug that the float dtypes would keep, so keep it visible.
                if y.is_nan() {
                    return 0x80;
                }
                (r as i8) as u8
            }
            Self::Fp8E4m3 => fp8::encode(y),
        }
    }

    /// The value of `code` before scaling (NaN for the NaN codes, −128 for Int8's
    /// unused code, which [`Code::encode`] writes only for NaN input). O(1).
    pub fn decode(self, code: u8) -> f32 {
        match self {
            Self::Int8 if code == 0x80 => f32::NAN,
            Self::Int8 => f32::from(code as i8),
            Self::Fp8E4m3 => fp8::decode(code),
        }
    }

    /// The scale for a group whose largest magnitude is `absmax`: `absmax / max`, or 1
    /// for an all-zero (or non-finite) group. O(1).
    pub fn scale_for(self, absmax: f32) -> f32 {
        if absmax > 0.0 && absmax.is_finite() {
            absmax / self.max()
        } else {
            1.0
        }
    }
}

impl Code {
    /// Quantizes one group `src` into `codes` (same length) with the scale of its
    /// largest magnitude ([`Code::scale_for`]), and returns the scale to store: the one
    /// rule by which the kernels write a row and the references quantize a group.
    /// O(src.len()).
    ///
    /// A group with a NaN or an infinity among its values stores a NaN scale (its codes
    /// are those of the finite scale of the other values): every value of the group
    /// then reads back as NaN, so a non-finite value written to the cache is never lost
    /// to a finite code (int8's NaN code, −128, is an integer to the kernels'
    /// arithmetic; an infinity would saturate) and the decoders need no per-element NaN
    /// test. The CUDA write kernel keeps the same rule.
    ///
    /// # Panics
    /// If `codes` is shorter than `src` (a caller's sizing error, never data).
    pub fn quantize_row(self, src: &[f32], codes: &mut [u8]) -> f32 {
        let absmax = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        self.quantize_row_at(src, codes, self.scale_for(absmax))
    }

    /// Quantizes one group `src` into `codes` (same length) at the fixed `scale` (a
    /// [`KvScales`] side), saturating: a value beyond `scale × max` ([`Code::max`])
    /// stores the largest code of its sign. Returns the scale to store: `scale`, or NaN
    /// for a group with a NaN or an infinity among its values, as [`Code::quantize_row`]
    /// (the one rule both follow). O(src.len()).
    ///
    /// # Panics
    /// If `codes` is shorter than `src` (a caller's sizing error, never data).
    pub fn quantize_row_at(self, src: &[f32], codes: &mut [u8], scale: f32) -> f32 {
        let mut non_finite = false;
        for (c, &v) in codes[..src.len()].iter_mut().zip(src) {
            *c = self.encode(v, scale);
            non_finite |= !v.is_finite();
        }
        if non_finite {
            f32::NAN
        } else {
            scale
        }
    }
}

/// Fixed scales for the 8-bit codes of one layer's keys and values, such as the
/// calibrated `k_scale` / `v_scale` a checkpoint ships: a value `x` is stored as the
/// code of `x / k` (or `/ v`), saturating at the code's largest magnitude, and reads
/// back as `code × k`, where by default each (token, head) row takes the scale of its
/// own largest magnitude and nothing saturates. Set per layer on a cache
/// ([`crate::KvCache::set_kv_scales`]); they apply to the rows written after, and the
/// scale of every row still goes into its block beside its codes, so rows written under
/// other scales keep theirs and every kernel reads them alike.
///
/// Invariant: both scales are finite and positive ([`KvScales::new`] checks it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvScales {
    k: f32,
    v: f32,
}

impl KvScales {
    /// The scales `k` for the keys and `v` for the values. O(1).
    ///
    /// # Errors
    /// [`KernelError::BadKvScale`] unless both are finite and positive.
    pub fn new(k: f32, v: f32) -> Result<Self, KernelError> {
        let good = |x: f32| x > 0.0 && x.is_finite();
        if good(k) && good(v) {
            Ok(Self { k, v })
        } else {
            Err(KernelError::BadKvScale)
        }
    }

    /// The keys' scale. O(1).
    pub const fn k(self) -> f32 {
        self.k
    }

    /// The values' scale. O(1).
    pub const fn v(self) -> f32 {
        self.v
    }

    /// The scale of the keys (`kv == 0`) or the values (`kv == 1`). O(1).
    pub(crate) const fn of(self, kv: usize) -> f32 {
        if kv == 0 {
            self.k
        } else {
            self.v
        }
    }
}

/// Quantizes `x` in groups of `group` consecutive values (the last may be shorter),
/// each group with its own scale: `codes[i]` and `scales[i / group]`. O(x.len()).
///
/// # Panics
/// If `codes` is shorter than `x` or `scales` than the number of groups, or `group`
/// is zero (a caller's sizing error in this reference code, not data).
pub fn quantize(code: Code, x: &[f32], group: usize, codes: &mut [u8], scales: &mut [f32]) {
    for (g, chunk) in x.chunks(group).enumerate() {
        scales[g] = code.quantize_row(chunk, &mut codes[g * group..]);
    }
}

/// Inverse of [`quantize`]: `out[i] = scales[i / group] · decode(codes[i])`. O(out.len()).
///
/// # Panics
/// If `codes` is shorter than `out`, `scales` than its number of groups, or `group` is
/// zero (a caller's sizing error in this reference code, not data).
pub fn dequantize(code: Code, codes: &[u8], scales: &[f32], group: usize, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = scales[i / group] * code.decode(codes[i]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_error_is_at_most_half_a_step() {
        let x: Vec<f32> = (0..300)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173)
            .collect();
        for group in [1, 7, 32, 300] {
            let (mut c, mut s) = (vec![0u8; 300], vec![0.0f32; 300]);
            quantize(Code::Int8, &x, group, &mut c, &mut s);
            let mut y = vec![0.0f32; 300];
            dequantize(Code::Int8, &c, &s, group, &mut y);
            for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                let step = s[i / group];
                assert!(
                    (a - b).abs() <= 0.5 * step * (1.0 + 1e-4),
                    "{i}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn fp8_relative_error_is_within_the_mantissa() {
        let x: Vec<f32> = (1..500).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let (mut c, mut s) = (vec![0u8; x.len()], vec![0.0f32; x.len()]);
        quantize(Code::Fp8E4m3, &x, 1, &mut c, &mut s);
        let mut y = vec![0.0f32; x.len()];
        dequantize(Code::Fp8E4m3, &c, &s, 1, &mut y);
        for (a, b) in x.iter().zip(&y) {
            // A group of one: the value maps onto ±448 exactly.
            assert!((a - b).abs() <= a.abs() * 1e-6, "{a} vs {b}");
        }
        quantize(Code::Fp8E4m3, &x, 64, &mut c, &mut s);
        dequantize(Code::Fp8E4m3, &c, &s, 64, &mut y);
        for (a, b) in x.iter().zip(&y) {
            // Normal codes keep 3 mantissa bits: relative error at most 2^-4; values
            // in the subnormal range (tiny against their group) lose more, absolutely
            // bounded by half the smallest step.
            let bound = (a.abs() / 16.0).max(s[0] * 2f32.powi(-10));
            assert!((a - b).abs() <= bound * 1.0001 + 1e-7, "{a} vs {b}");
        }
    }

    #[test]
    fn zero_and_nan_groups() {
        let (mut c, mut s) = ([0u8; 4], [0.0f32; 2]);
        quantize(Code::Int8, &[0.0, 0.0, f32::NAN, 1.0], 2, &mut c, &mut s);
        assert_eq!(s[0], 1.0);
        assert_eq!(&c[..2], &[0, 0]);
        // The NaN's group: its scale is NaN, its codes those of the finite values'
        // scale (1.0 → 127) and the NaN code.
        assert!(s[1].is_nan());
        assert_eq!(&c[2..], &[0x80, 127]);
        let mut y = [0.0f32; 4];
        dequantize(Code::Int8, &c, &s, 2, &mut y);
        assert_eq!(&y[..2], &[0.0, 0.0]);
        assert!(
            y[2].is_nan() && y[3].is_nan(),
            "NaN stays visible, group-wide"
        );
        for code in [Code::Int8, Code::Fp8E4m3] {
            let mut c = [0u8; 3];
            assert_eq!(
                code.quantize_row(&[1.0, -2.0, 0.5], &mut c),
                2.0 / code.max()
            );
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                assert!(code.quantize_row(&[1.0, bad, 0.5], &mut c).is_nan());
            }
        }
    }

    #[test]
    fn fixed_scales_saturate_and_keep_the_nan_rule() {
        for code in [Code::Int8, Code::Fp8E4m3] {
            let scale = 0.5;
            let x = [0.3, -0.2, 1000.0, -1000.0, 0.0, code.max() * scale];
            let mut c = [0u8; 6];
            assert_eq!(code.quantize_row_at(&x, &mut c, scale), scale);
            for (&ci, &xi) in c.iter().zip(&x) {
                assert_eq!(ci, code.encode(xi, scale), "{code:?} {xi}");
            }
            // Beyond the scale's range: the largest code of each sign.
            assert_eq!(code.decode(c[2]) * scale, code.max() * scale);
            assert_eq!(code.decode(c[3]) * scale, -code.max() * scale);
            assert_eq!(code.decode(c[5]), code.max());
            // The default rule is the fixed one at the row's own scale.
            let mut d = [0u8; 6];
            let s = code.quantize_row(&x, &mut d);
            let mut e = [0u8; 6];
            assert_eq!(code.quantize_row_at(&x, &mut e, s), s);
            assert_eq!(d, e);
            for bad in [f32::NAN, f32::INFINITY] {
                assert!(code.quantize_row_at(&[1.0, bad], &mut c, scale).is_nan());
            }
        }
    }

    #[test]
    fn kv_scales_must_be_finite_and_positive() {
        let s = KvScales::new(0.25, 3.0).unwrap();
        assert_eq!((s.k(), s.v(), s.of(0), s.of(1)), (0.25, 3.0, 0.25, 3.0));
        for bad in [0.0, -1.0, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert_eq!(KvScales::new(bad, 1.0), Err(KernelError::BadKvScale));
            assert_eq!(KvScales::new(1.0, bad), Err(KernelError::BadKvScale));
        }
        // The smallest positive values are scales too (a row's own can be as small).
        assert!(KvScales::new(f32::from_bits(1), f32::MIN_POSITIVE).is_ok());
    }
}
