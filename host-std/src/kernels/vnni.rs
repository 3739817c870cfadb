//! [`Simd`] with AVX-512 VNNI: int8 storage's scores and accumulation in 16-bit
//! integer arithmetic ([`super::lanes::int8_vnni`]); every other storage type, and head
//! dims that are not a multiple of 64, exactly as [`Avx512`].

use super::avx512::Avx512;
use super::lanes::int8_vnni as int8;
use super::math::Simd;
use crate::dtype::Element;

/// The AVX-512 VNNI implementation. Only [`Avx512Vnni::detect`] makes one, so holding a
/// value proves the CPU has AVX-512F, BW and VNNI (and what [`Avx512`] needs).
#[derive(Clone, Copy)]
pub(crate) struct Avx512Vnni {
    avx512: Avx512,
}

impl Avx512Vnni {
    /// `Some` if the CPU has AVX-512F, BW and VNNI besides AVX2, FMA and F16C, and
    /// [`super::CPU_PATH_ENV`] allows them. O(1) after the first call.
    #[inline]
    pub(crate) fn detect() -> Option<Self> {
        let avx512 = Avx512::detect()?;
        (super::path_ceiling() >= 3
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni"))
        .then_some(Self { avx512 })
    }
}

// SAFETY (every method): an `Avx512Vnni` value exists only when `detect` found
// AVX-512F, BW and VNNI; `int8::applies` is checked before each `int8` call.
impl Simd for Avx512Vnni {
    #[inline(always)]
    fn scores4<T: Element>(
        self,
        q: &[f32],
        k: &[T],
        hd: usize,
        n: usize,
        s: &mut [f32],
        s_stride: usize,
    ) {
        if int8::applies::<T>(hd) {
            unsafe { int8::scores4(q, k, hd, n, s, s_stride) }
        } else {
            self.avx512.scores4(q, k, hd, n, s, s_stride)
        }
    }
    #[inline(always)]
    fn scores1<T: Element>(self, q: &[f32], k: &[T], hd: usize, n: usize, s: &mut [f32]) {
        if int8::applies::<T>(hd) {
            unsafe { int8::scores1(q, k, hd, n, s) }
        } else {
            self.avx512.scores1(q, k, hd, n, s)
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
        if int8::applies::<T>(hd) {
            unsafe { int8::accumulate::<T, 2>(acc, [p0, p1], v, hd, n) }
        } else {
            self.avx512.accumulate2(acc, p0, p1, v, hd, n)
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
        if int8::applies::<T>(hd) {
            unsafe { int8::accumulate::<T, 4>(acc, p, v, hd, n) }
        } else {
            self.avx512.accumulate4(acc, p, v, hd, n)
        }
    }
    #[inline(always)]
    fn accumulate1<T: Element>(self, acc: &mut [f32], p: &[f32], v: &[T], hd: usize, n: usize) {
        if int8::applies::<T>(hd) {
            unsafe { int8::accumulate::<T, 1>(acc, [p], v, hd, n) }
        } else {
            self.avx512.accumulate1(acc, p, v, hd, n)
        }
    }
    #[inline(always)]
    fn enter_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        if int8::applies::<T>(hd) {
            for row in rows.chunks_exact_mut(hd) {
                unsafe { int8::encode_query(row, hd) };
            }
        } else {
            self.avx512.enter_kernel_order::<T>(rows, hd)
        }
    }
    #[inline(always)]
    fn leave_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        if int8::applies::<T>(hd) {
            int8::from_acc_order(rows);
        } else {
            self.avx512.leave_kernel_order::<T>(rows, hd)
        }
    }
    /// A whole chunk for int8: each call puts its weights in fixed point and scales its
    /// integer sums into the accumulators once (measured in cache, 1 × 256 tokens: 8
    /// tokens a call 7.9 GB/s per thread, 16: 9.0, 64: 10.5).
    #[inline(always)]
    fn value_step<T: Element>(self, hd: usize, default: usize) -> usize {
        if int8::applies::<T>(hd) {
            super::online::MAX_CHUNK
        } else {
            default
        }
    }
    #[inline(always)]
    fn max(self, x: &[f32]) -> f32 {
        self.avx512.max(x)
    }
    #[inline(always)]
    fn exp_shifted_sum(self, x: &mut [f32], shift: f32) -> f32 {
        self.avx512.exp_shifted_sum(x, shift)
    }
    #[inline(always)]
    fn scale(self, x: &mut [f32], c: f32) {
        self.avx512.scale(x, c)
    }
}
