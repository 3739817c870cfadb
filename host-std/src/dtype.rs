//! Storage element types of the KV arena: `f32`, [`half::f16`], [`half::bf16`], and the
//! 8-bit codes [`Int8`] and [`Fp8E4m3`], whose values carry a scale per token and head
//! stored beside them in the tile (see [`kvpage_core::DType::is_scaled`]).
//!
//! Kernels are generic over [`Element`]; they widen a tile of stored elements into an
//! `f32` scratch buffer once and do all arithmetic in `f32`. The trait is sealed: the
//! arena reinterprets its aligned bytes as `[T]`, which is sound only for plain-old-data
//! types whose every bit pattern is valid, so only the three types here implement it.

use half::{bf16, f16, slice::HalfFloatSliceExt};

use crate::quant::{fp8, Code};

mod sealed {
    /// Which of the three storage types an element is, for SIMD loads that convert
    /// while they load.
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub enum Kind {
        /// `f32`.
        F32,
        /// `half::f16`.
        F16,
        /// `half::bf16`.
        Bf16,
        /// [`super::Int8`].
        Int8,
        /// [`super::Fp8E4m3`].
        Fp8E4m3,
    }

    /// Implemented only for `f32`, `f16`, `bf16`, `Int8` and `Fp8E4m3`.
    ///
    /// # Safety
    /// The implementor has no padding, every bit pattern is a valid value, its
    /// alignment divides 64 (the arena's alignment), and `KIND` names its type.
    pub unsafe trait Pod: Copy + Send + Sync + 'static {
        /// The type, as a value.
        const KIND: Kind;
    }
    // SAFETY: primitive float: no padding, all bit patterns valid, align 4.
    unsafe impl Pod for f32 {
        const KIND: Kind = Kind::F32;
    }
    // SAFETY: `f16` is `repr(transparent)` over `u16`.
    unsafe impl Pod for half::f16 {
        const KIND: Kind = Kind::F16;
    }
    // SAFETY: `bf16` is `repr(transparent)` over `u16`.
    unsafe impl Pod for half::bf16 {
        const KIND: Kind = Kind::Bf16;
    }
    // SAFETY: `Int8` is `repr(transparent)` over `i8`.
    unsafe impl Pod for super::Int8 {
        const KIND: Kind = Kind::Int8;
    }
    // SAFETY: `Fp8E4m3` is `repr(transparent)` over `u8`.
    unsafe impl Pod for super::Fp8E4m3 {
        const KIND: Kind = Kind::Fp8E4m3;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use sealed::Kind;
pub(crate) use sealed::Pod;

/// A storage type of the KV arena. Sealed: implemented for `f32`, `f16`, `bf16`,
/// [`Int8`] and [`Fp8E4m3`]. For the two 8-bit codes the conversions below are those of
/// the bare code, without its scale: the kernels apply the scales stored in the tile.
pub trait Element: Pod + Default + PartialEq + core::fmt::Debug {
    /// The core's name for this storage type.
    const DTYPE: kvpage_core::DType;

    /// Rounds an `f32` to this type (round to nearest even). O(1).
    fn from_f32(x: f32) -> Self;

    /// Widens to `f32` (exact). O(1).
    fn to_f32(self) -> f32;

    /// The value [`Element::to_f32`] gives (NaN for NaN), in as few operations as the
    /// type allows, so that the portable kernels' loops widen storage as they load it:
    /// `to_f32` unless overridden (bf16: the shift alone, without `to_f32`'s quieting of
    /// NaNs). O(1). Hidden: a detail of the kernels, not for callers (the trait is
    /// sealed).
    #[doc(hidden)]
    #[inline(always)]
    fn lane_to_f32(self) -> f32 {
        self.to_f32()
    }

    /// Widens `src` into `dst` (exact), vectorized where the CPU allows (F16C for f16).
    /// O(n). Converts `min(src.len(), dst.len())` elements.
    fn widen(src: &[Self], dst: &mut [f32]);

    /// Rounds `src` into `dst` (round to nearest even). O(n). Converts
    /// `min(src.len(), dst.len())` elements.
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Element for f32 {
    const DTYPE: kvpage_core::DType = kvpage_core::DType::F32;
    #[inline]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn widen(src: &[Self], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
    }
}

impl Element for f16 {
    const DTYPE: kvpage_core::DType = kvpage_core::DType::F16;
    #[inline]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn widen(src: &[Self], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        #[cfg(target_arch = "x86_64")]
        if f16c::available() {
            // SAFETY: F16C and AVX were detected on this CPU just above.
            unsafe { f16c::widen(&src[..n], &mut dst[..n]) };
            return;
        }
        #[cfg(target_arch = "aarch64")]
        {
            neon_f16::widen(&src[..n], &mut dst[..n]);
        }
        // `half` detects F16C / fp16 itself at run time (its `std` feature), but calls
        // a function per 4 or 8 elements, and on aarch64 takes the conversion only on
        // CPUs with half-precision arithmetic, which it does not need.
        #[cfg(not(target_arch = "aarch64"))]
        src[..n].convert_to_f32_slice(&mut dst[..n]);
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        let n = src.len().min(dst.len());
        #[cfg(target_arch = "x86_64")]
        if f16c::available() {
            // SAFETY: F16C and AVX were detected on this CPU just above.
            unsafe { f16c::narrow(&src[..n], &mut dst[..n]) };
            return;
        }
        // As in `widen`: one function instead of a call per 8 elements (the rotation of
        // keys narrows one row of up to 256 elements at a time).
        dst[..n].convert_from_f32_slice(&src[..n]);
    }
}

impl Element for bf16 {
    const DTYPE: kvpage_core::DType = kvpage_core::DType::Bf16;
    #[inline]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn lane_to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    #[inline]
    fn widen(src: &[Self], dst: &mut [f32]) {
        // bf16 is the top half of an f32: a shift, which the compiler vectorizes.
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        // Round to nearest even on the bits, NaN kept quiet: `bf16::from_f32`'s result,
        // written without branches so that the compiler vectorizes it (half's slice
        // conversion calls the branchy scalar one per element).
        for (d, s) in dst.iter_mut().zip(src) {
            let x = s.to_bits();
            let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
            let quiet_nan = (x >> 16) | 0x40;
            let nan = x & 0x7fff_ffff > 0x7f80_0000;
            *d = bf16::from_bits(if nan { quiet_nan } else { rounded } as u16);
        }
    }
}

/// The bytes of `x`. O(1). Sound for every [`Element`]: plain old data, no padding.
pub(crate) fn bytes_of<T: Element>(x: &[T]) -> &[u8] {
    // SAFETY: `T: Pod` has no padding and no invalid bit patterns (its contract), so
    // its memory is `size_of_val(x)` initialised bytes; `u8` has alignment 1.
    unsafe { core::slice::from_raw_parts(x.as_ptr().cast::<u8>(), core::mem::size_of_val(x)) }
}

/// The bytes of `x`, writable. O(1). Sound for every [`Element`]: every bit pattern is
/// a valid value, so any bytes written leave valid elements.
pub(crate) fn bytes_of_mut<T: Element>(x: &mut [T]) -> &mut [u8] {
    let len = core::mem::size_of_val(x);
    // SAFETY: as in `bytes_of`, and every byte pattern is a valid `T`; the borrow is
    // unique.
    unsafe { core::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<u8>(), len) }
}

/// An 8-bit integer code (−127..=127) of [`kvpage_core::DType::Int8`] storage: the value
/// is the code times its row's scale. The kernels treat −128, the code of a NaN, as the
/// integer it is: the row's NaN scale carries the NaN ([`crate::quant::Code::quantize_row`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Int8(pub i8);

/// An FP8 E4M3 code ([`crate::quant::fp8`]) of [`kvpage_core::DType::Fp8E4m3`] storage:
/// the value is the decoded code times its row's scale.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Fp8E4m3(pub u8);

impl Element for Int8 {
    const DTYPE: kvpage_core::DType = kvpage_core::DType::Int8;
    /// The nearest code, saturating at ±127 (NaN: the unused code −128).
    #[inline]
    fn from_f32(x: f32) -> Self {
        Self(Code::Int8.encode(x, 1.0) as i8)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        f32::from(self.0)
    }
    #[inline]
    fn widen(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from(s.0);
        }
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(s);
        }
    }
}

impl Element for Fp8E4m3 {
    const DTYPE: kvpage_core::DType = kvpage_core::DType::Fp8E4m3;
    /// The nearest code, saturating at ±448; NaN stays NaN.
    #[inline]
    fn from_f32(x: f32) -> Self {
        Self(fp8::encode(x))
    }
    #[inline]
    fn to_f32(self) -> f32 {
        fp8::decode(self.0)
    }
    #[inline]
    fn widen(src: &[Self], dst: &mut [f32]) {
        // By the code's bits (`fp8::decode_by_bits`, the table's values): a loop the
        // compiler vectorizes, where the table is read one code at a time.
        for (d, s) in dst.iter_mut().zip(src) {
            *d = fp8::decode_by_bits(s.0);
        }
    }
    #[inline]
    fn narrow(src: &[f32], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self(fp8::encode(s));
        }
    }
}

/// f16 → f32 with the conversion every aarch64 CPU has (Advanced SIMD's `fcvtl` and
/// `fcvtl2`), 8 elements per load. In `asm!`: the intrinsics' half-precision vector
/// types are stable only since Rust 1.94, after the crate's minimum.
#[cfg(target_arch = "aarch64")]
mod neon_f16 {
    use core::arch::aarch64::{float32x4_t, vld1q_u16, vst1q_f32};
    use core::arch::asm;
    use half::f16;

    /// Widens `src` into `dst` (as far as the shorter goes). O(n).
    pub(super) fn widen(src: &[f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let (src, dst) = (&src[..n], &mut dst[..n]);
        let mut halves = src.chunks_exact(8);
        let mut floats = dst.chunks_exact_mut(8);
        for (h, f) in (&mut halves).zip(&mut floats) {
            // SAFETY: NEON is part of every aarch64 target; the load reads the 8
            // elements of `h` (f16 is `repr(transparent)` over u16) and the stores
            // write the 8 of `f`, unaligned accesses all; the conversions only read and
            // write registers.
            unsafe {
                let bits = vld1q_u16(h.as_ptr().cast::<u16>());
                let (low, high): (float32x4_t, float32x4_t);
                asm!(
                    "fcvtl {low:v}.4s, {bits:v}.4h",
                    "fcvtl2 {high:v}.4s, {bits:v}.8h",
                    low = out(vreg) low,
                    high = lateout(vreg) high,
                    bits = in(vreg) bits,
                    options(pure, nomem, nostack, preserves_flags)
                );
                vst1q_f32(f.as_mut_ptr(), low);
                vst1q_f32(f.as_mut_ptr().add(4), high);
            }
        }
        for (f, h) in floats.into_remainder().iter_mut().zip(halves.remainder()) {
            *f = h.to_f32();
        }
    }
}

/// f16 ↔ f32 with the F16C instruction set, 8 elements per instruction.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use core::arch::x86_64::{
        __m128i, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps,
        _mm_loadu_si128, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };
    use half::f16;

    /// Whether the CPU has F16C and AVX. O(1) after the first call (cached by std).
    /// Always false under Miri, which then checks the portable conversion.
    #[inline]
    pub(super) fn available() -> bool {
        !cfg!(miri)
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("avx")
    }

    /// Widens `src` into `dst` (same length).
    ///
    /// # Safety
    /// The CPU supports F16C and AVX ([`available`] returned true).
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn widen(src: &[f16], dst: &mut [f32]) {
        debug_assert_eq!(src.len(), dst.len());
        let n = src.len().min(dst.len());
        let whole = n / 8 * 8;
        let mut i = 0;
        while i < whole {
            // SAFETY: i + 8 <= n for both slices; unaligned loads and stores.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for j in whole..n {
            dst[j] = src[j].to_f32();
        }
    }

    /// Rounds `src` into `dst` (same length) to nearest even, as `f16::from_f32` does.
    ///
    /// # Safety
    /// The CPU supports F16C and AVX ([`available`] returned true).
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn narrow(src: &[f32], dst: &mut [f16]) {
        debug_assert_eq!(src.len(), dst.len());
        let n = src.len().min(dst.len());
        let whole = n / 8 * 8;
        let mut i = 0;
        while i < whole {
            // SAFETY: i + 8 <= n for both slices; unaligned loads and stores.
            unsafe {
                let x = _mm256_loadu_ps(src.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
                _mm_storeu_si128(dst.as_mut_ptr().add(i).cast::<__m128i>(), h);
            }
            i += 8;
        }
        for j in whole..n {
            dst[j] = f16::from_f32(src[j]);
        }
    }
}

/// Runs `$body` with the type alias `$t` bound to the storage type of `$dtype`.
macro_rules! for_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            kvpage_core::DType::F32 => {
                type $t = f32;
                $body
            }
            kvpage_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            kvpage_core::DType::Bf16 => {
                type $t = half::bf16;
                $body
            }
            kvpage_core::DType::Int8 => {
                type $t = $crate::dtype::Int8;
                $body
            }
            kvpage_core::DType::Fp8E4m3 => {
                type $t = $crate::dtype::Fp8E4m3;
                $body
            }
        }
    };
}
pub(crate) use for_dtype;

#[cfg(test)]
mod tests {
    use super::*;

    /// The branch-free narrowing of bf16 equals `bf16::from_f32` bit for bit, NaN
    /// payloads included, over random bit patterns and the edge cases.
    #[test]
    fn bf16_narrow_equals_scalar_rounding() {
        let mut src: Vec<f32> = [
            0u32,
            0x8000_0000,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7f80_0001,
            0xffff_ffff,
            0x7fc0_0000,
            0x0000_8000,
        ]
        .iter()
        .map(|&b| f32::from_bits(b))
        .collect();
        let mut x = 0x9e37_79b9u32;
        for _ in 0..if cfg!(miri) { 500 } else { 20_000 } {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            src.push(f32::from_bits(x));
        }
        let mut got = vec![bf16::ZERO; src.len()];
        bf16::narrow(&src, &mut got);
        for (g, &s) in got.iter().zip(&src) {
            assert_eq!(
                g.to_bits(),
                bf16::from_f32(s).to_bits(),
                "{:#x}",
                s.to_bits()
            );
        }
    }

    /// `lane_to_f32` is `to_f32`, and the widening of a slice is `to_f32` per element
    /// (F16C on x86-64, `fcvtl` on aarch64, the table's values for FP8), for every bit
    /// pattern of every storage type: the same bits, NaN where `to_f32` gives NaN.
    #[test]
    fn widening_is_to_f32_for_every_pattern() {
        fn same<T: Element>(x: T, got: f32) {
            let want = x.to_f32();
            if want.is_nan() {
                assert!(got.is_nan(), "{x:?}: {got}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{x:?}: {got} vs {want}");
            }
        }
        fn check<T: Element>(all: &[T]) {
            for &x in all {
                same(x, x.lane_to_f32());
            }
            // Lengths with and without a partial vector.
            for len in [all.len(), all.len() - 3] {
                let mut wide = vec![0.0f32; len];
                T::widen(&all[..len], &mut wide);
                for (&x, &w) in all.iter().zip(&wide) {
                    same(x, w);
                }
            }
        }
        let step = if cfg!(miri) { 251 } else { 1 };
        let halves: Vec<u16> = (0..=u16::MAX).step_by(step).collect();
        check(
            &halves
                .iter()
                .map(|&b| f16::from_bits(b))
                .collect::<Vec<_>>(),
        );
        check(
            &halves
                .iter()
                .map(|&b| bf16::from_bits(b))
                .collect::<Vec<_>>(),
        );
        check(&(0..=u8::MAX).map(|c| Int8(c as i8)).collect::<Vec<_>>());
        check(&(0..=u8::MAX).map(Fp8E4m3).collect::<Vec<_>>());
        check(&[
            0.0f32,
            -0.0,
            1.5,
            -3.25e-30,
            f32::INFINITY,
            f32::MIN_POSITIVE / 8.0,
        ]);
    }

    /// The vector narrowing of f16 rounds exactly like the scalar one: ties to even,
    /// overflow to infinity, subnormals, signed zeros, NaN stays NaN; any length.
    #[test]
    fn f16_narrow_equals_scalar_rounding() {
        let mut src: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            65504.0,
            65520.0,
            -65520.0,
            1e9,
            6e-8,
            3e-8,
            2.9e-8,
            -6.1e-5,
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            2.0 - 1.0 / 4096.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
        ];
        let mut x = 0x1234_5678u32;
        for _ in 0..if cfg!(miri) { 200 } else { 4000 } {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let bits = 0x3000_0000 + x % 0x1800_0000;
            src.push(f32::from_bits(bits | (x & 0x8000_0000)));
        }
        for len in [0, 1, 7, 8, 9, src.len()] {
            let mut got = vec![f16::ZERO; len];
            f16::narrow(&src[..len], &mut got);
            for (g, &s) in got.iter().zip(&src) {
                let want = f16::from_f32(s);
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "{s:e}: {g:?} vs {want:?}"
                );
            }
        }
    }
}
