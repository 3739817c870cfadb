//! [`Simd`] with the AVX-512 dot-product extensions, for 8-bit storage: int8 in 16-bit
//! integer dot products with VNNI ([`super::lanes::int8_vnni`]), FP8 E4M3 in bf16 dot
//! products with AVX512_BF16 ([`super::lanes::fp8_bf16`]). Every other storage type, and
//! head dims that are not a multiple of 64, go to [`Avx512`] unchanged.

use core::marker::PhantomData;

use super::avx512::Avx512;
use super::lanes::{fp8_bf16, int8_vnni, pairs};
use super::math::{first_tokens, Simd};
use super::online::MAX_CHUNK;
use crate::dtype::{Element, Kind};

/// One dot-product arithmetic for 8-bit codes: the kernels of [`super::lanes`] it
/// routes to. Implemented by [`Vnni`] and [`Bf16Dot`].
pub(crate) trait DotKernels: Copy {
    /// Whether the CPU has the extension (and [`super::CPU_PATH_ENV`] allows it). O(1)
    /// after the first call.
    fn supported() -> bool;
    /// Whether the kernels take the arithmetic on this CPU: it is
    /// [`DotKernels::supported`] and, on this CPU's vendor, faster than the route
    /// without it. O(1) after the first call.
    fn detect() -> bool;
    /// Whether storage `T` with head dimension `hd` takes the arithmetic. O(1).
    fn applies<T: Element>(hd: usize) -> bool;
    /// [`Simd::f32_side_rounding`] for storage `T` at head dimension `hd`. O(1).
    #[cfg(test)]
    fn f32_side_rounding<T: Element>(hd: usize) -> f64;
    /// The unit in which the arithmetic reads storage `T`'s codes
    /// ([`Simd::code_unit`]) and the exponent the loop lifts its query rows to
    /// ([`Simd::query_exponent`]), where they differ from [`Avx512`]'s: then a task
    /// over `T` at a head dim the arithmetic does not take goes elsewhere whole
    /// ([`Simd::takes_rows`]). O(1).
    fn code_unit<T: Element>() -> Option<(f32, i32)>;
    /// Puts one scaled query row into the arithmetic's form. O(hd).
    ///
    /// # Safety
    /// The CPU has the extension; `applies::<T>(hd)`; `row.len() >= hd`.
    unsafe fn encode_query(row: &mut [f32], hd: usize);
    /// [`Simd::scores4`] on encoded rows.
    ///
    /// # Safety
    /// As [`DotKernels::encode_query`].
    unsafe fn scores4<T: Element>(
        q: &[f32],
        k: &[T],
        hd: usize,
        n: usize,
        s: &mut [f32],
        stride: usize,
    );
    /// [`Simd::scores1`] on an encoded row.
    ///
    /// # Safety
    /// As [`DotKernels::encode_query`].
    unsafe fn scores1<T: Element>(q: &[f32], k: &[T], hd: usize, n: usize, s: &mut [f32]);
    /// The accumulation of `R <= 4` rows over the tokens `v` (one slice each), in the
    /// order of [`pairs::acc_dim`].
    ///
    /// # Safety
    /// As [`DotKernels::encode_query`].
    unsafe fn accumulate<T: Element, const R: usize>(
        acc: &mut [f32],
        p: [&[f32]; R],
        v: &[&[T]],
        hd: usize,
    );
}

/// Tokens per chunk of the attention loop for 8-bit storage in these arithmetics
/// ([`Avx512Dot`]'s `chunk_tokens`, where the measurements are). Within the scratch's
/// capacity, [`MAX_CHUNK`].
const CODE_CHUNK: usize = 128;
const _: () = assert!(CODE_CHUNK <= MAX_CHUNK);

/// Int8 with AVX-512 VNNI ([`int8_vnni`]).
#[derive(Clone, Copy)]
pub(crate) struct Vnni;

/// FP8 E4M3 with AVX512_BF16 ([`fp8_bf16`]).
#[derive(Clone, Copy)]
pub(crate) struct Bf16Dot;

/// Implements [`DotKernels`] for `$marker`: the query encoding of module `$module`, the
/// loops of [`pairs`] over its arithmetic `$pairs`. Everything is inlined into the
/// caller, whose target features (those `detect` checks) the instructions need.
macro_rules! dot_kernels {
    ($marker:ty, $module:ident, $pairs:ty, [$($feature:tt),+], $worth:expr, $rounding:expr) => {
        impl DotKernels for $marker {
            fn supported() -> bool {
                super::path_ceiling() >= 3
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    $(&& std::arch::is_x86_feature_detected!($feature))+
            }
            fn detect() -> bool {
                Self::supported() && $worth
            }
            #[inline(always)]
            fn applies<T: Element>(hd: usize) -> bool {
                $module::applies::<T>(hd)
            }
            #[cfg(test)]
            fn f32_side_rounding<T: Element>(hd: usize) -> f64 {
                if Self::applies::<T>(hd) {
                    $rounding
                } else {
                    0.0
                }
            }
            #[inline(always)]
            fn code_unit<T: Element>() -> Option<(f32, i32)> {
                $module::code_unit(T::KIND)
            }
            #[inline(always)]
            unsafe fn encode_query(row: &mut [f32], hd: usize) {
                // SAFETY: the caller's.
                unsafe { $module::encode_query(row, hd) }
            }
            #[inline(always)]
            unsafe fn scores4<T: Element>(
                q: &[f32],
                k: &[T],
                hd: usize,
                n: usize,
                s: &mut [f32],
                stride: usize,
            ) {
                // SAFETY: the caller's.
                unsafe { pairs::scores4::<$pairs, T>(q, k, hd, n, s, stride) }
            }
            #[inline(always)]
            unsafe fn scores1<T: Element>(q: &[f32], k: &[T], hd: usize, n: usize, s: &mut [f32]) {
                // SAFETY: the caller's.
                unsafe { pairs::scores1::<$pairs, T>(q, k, hd, n, s) }
            }
            #[inline(always)]
            unsafe fn accumulate<T: Element, const R: usize>(
                acc: &mut [f32],
                p: [&[f32]; R],
                v: &[&[T]],
                hd: usize,
            ) {
                // SAFETY: the caller's.
                unsafe { pairs::accumulate::<$pairs, T, R>(acc, p, v, hd) }
            }
        }
    };
}

// Int8's 16-bit fixed point is relative to each row's largest magnitude, not to each
// element: the kernel tests bound it for int8 storage on every path.
dot_kernels!(
    Vnni,
    int8_vnni,
    int8_vnni::Int8Pairs,
    ["avx512vnni"],
    true,
    0.0
);
// Not on Intel cores: they run `vdpbf16ps` at half the rate of `vfmadd231ps` (on
// Emerald Rapids, 12 independent chains: 2.1 cycles an instruction against 0.5), so
// its 32 multiply-adds cost what 8 FMAs do. FP8 through f16 in f32 FMAs
// ([`super::avx512`]'s `fp8_half16`) took 0.67 of its time in cache and 0.68 out of
// it (decode of 32 query heads over 8 KV heads, head dim 128; 1 × 256 tokens on one
// thread, 32 × 2048 on two; medians of the ratios of alternating runs). That was with
// queries and weights in two bf16 parts; in one (since December 2026) a token and KV
// head of 128 dimensions and four rows takes 32 `vdpbf16ps` there, still about twice
// the time of the f16 route's 64 FMAs (not measured on Intel since).
dot_kernels!(
    Bf16Dot,
    fp8_bf16,
    fp8_bf16::Fp8Pairs,
    ["avx512bf16"],
    !super::intel_core(),
    fp8_bf16::ROUNDING
);

/// `K::accumulate` over `n` tokens stored one after another in `v`, up to a chunk of
/// them a call. O(R × n × hd).
///
/// # Safety
/// As [`DotKernels::encode_query`]; `v.len() >= n * hd`, and every `p[r].len() >= n`.
#[inline(always)]
unsafe fn accumulate_tile<K: DotKernels, T: Element, const R: usize>(
    acc: &mut [f32],
    p: [&[f32]; R],
    v: &[T],
    hd: usize,
    n: usize,
) {
    let mut t0 = 0;
    while t0 < n {
        let m = (n - t0).min(MAX_CHUNK);
        let tokens: [&[T]; MAX_CHUNK] = core::array::from_fn(|i| {
            if i < m {
                &v[(t0 + i) * hd..][..hd]
            } else {
                &[]
            }
        });
        // SAFETY: the caller's.
        unsafe { K::accumulate::<T, R>(acc, p.map(|pr| &pr[t0..]), &tokens[..m], hd) };
        t0 += m;
    }
}

/// [`Avx512`] with the dot-product arithmetic `K` for its storage type. Only
/// [`Avx512Dot::detect`] makes one, so holding a value proves the CPU has AVX-512F and
/// `K`'s extension.
#[derive(Clone, Copy)]
pub(crate) struct Avx512Dot<K> {
    avx512: Avx512,
    kernels: PhantomData<K>,
}

impl<K: DotKernels> Avx512Dot<K> {
    /// `Some` if the CPU has AVX-512F, BW and `K`'s extension besides AVX2, FMA and F16C,
    /// and [`super::CPU_PATH_ENV`] allows them. O(1) after the first call.
    #[inline]
    pub(crate) fn detect() -> Option<Self> {
        let avx512 = Avx512::detect()?;
        K::detect().then_some(Self {
            avx512,
            kernels: PhantomData,
        })
    }

    /// `Some` wherever the CPU has the instructions ([`DotKernels::supported`]), even
    /// where the kernels do not take them (FP8 in bf16 dot products on Intel cores), so
    /// that the tests check the arithmetic on every CPU that can run it. O(1).
    #[cfg(test)]
    pub(crate) fn supported() -> Option<Self> {
        let avx512 = Avx512::detect()?;
        K::supported().then_some(Self {
            avx512,
            kernels: PhantomData,
        })
    }
}

// SAFETY (every method): an `Avx512Dot<K>` value exists only when `detect` found the
// CPU features `K` needs; `K::applies` is checked before each `K` call.
impl<K: DotKernels> Simd for Avx512Dot<K> {
    /// Every task but one over storage that `K` reads in its own unit
    /// ([`DotKernels::code_unit`]: FP8 with AVX512_BF16) at a head dim `K` does not
    /// take: [`Avx512`] would read those codes in another unit.
    #[inline(always)]
    fn takes_rows<T: Element>(self, hd: usize, head_rows: usize) -> bool {
        (K::applies::<T>(hd) || K::code_unit::<T>().is_none())
            && self.avx512.takes_rows::<T>(hd, head_rows)
    }
    #[inline(always)]
    fn scores4<T: Element>(
        self,
        q: &[f32],
        k: &[T],
        hd: usize,
        n: usize,
        s: &mut [f32],
        s_stride: usize,
        passes: bool,
    ) {
        if K::applies::<T>(hd) {
            unsafe { K::scores4(q, k, hd, n, s, s_stride) }
        } else {
            self.avx512.scores4(q, k, hd, n, s, s_stride, passes)
        }
    }
    #[inline(always)]
    fn scores1<T: Element>(self, q: &[f32], k: &[T], hd: usize, n: usize, s: &mut [f32]) {
        if K::applies::<T>(hd) {
            unsafe { K::scores1(q, k, hd, n, s) }
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
        if K::applies::<T>(hd) {
            unsafe { accumulate_tile::<K, T, 2>(acc, [p0, p1], v, hd, n) }
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
        if K::applies::<T>(hd) {
            unsafe { accumulate_tile::<K, T, 4>(acc, p, v, hd, n) }
        } else {
            self.avx512.accumulate4(acc, p, v, hd, n)
        }
    }
    #[inline(always)]
    fn accumulate1<T: Element>(self, acc: &mut [f32], p: &[f32], v: &[T], hd: usize, n: usize) {
        if K::applies::<T>(hd) {
            unsafe { accumulate_tile::<K, T, 1>(acc, [p], v, hd, n) }
        } else {
            self.avx512.accumulate1(acc, p, v, hd, n)
        }
    }
    #[inline(always)]
    fn enter_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        if K::applies::<T>(hd) {
            for row in rows.chunks_exact_mut(hd) {
                unsafe { K::encode_query(row, hd) };
            }
        } else {
            self.avx512.enter_kernel_order::<T>(rows, hd)
        }
    }
    #[inline(always)]
    fn leave_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        if K::applies::<T>(hd) {
            // SAFETY: an `Avx512Dot` exists only where AVX-512F was detected.
            unsafe { pairs::from_acc_order(rows) };
        } else {
            self.avx512.leave_kernel_order::<T>(rows, hd)
        }
    }
    /// 8-bit storage: each call puts its weights in the arithmetic's form and scales
    /// its sums into the accumulators once, so a call takes a whole chunk (measured for
    /// int8 in cache, 1 × 256 tokens: 8 tokens a call 7.9 GB/s per thread, 16: 9.0,
    /// 64: 10.5).
    #[inline(always)]
    fn gathers_values<T: Element>(self, hd: usize, _passes: bool) -> bool {
        K::applies::<T>(hd)
    }
    /// 8-bit storage: chunks of [`CODE_CHUNK`] tokens, twice the default, which halves
    /// the per-chunk softmax bookkeeping and accumulation calls. Measured on the 2-vCPU
    /// Zen 4 (decode of 32 query heads over 8 KV heads, head dim 128, 128 × 512 and 32 ×
    /// 2048 tokens out of cache, two threads, paired in one process as
    /// [`super::online`]'s `SCORE_STEP` says): 128 tokens took 0.95-0.96 of the time of
    /// 64 for int8 and 0.95-0.97 for FP8; 256 took 0.88-0.90 and 0.90-0.91, but would
    /// grow the scratch past the 64 KiB a worker's stack is allowed (see `Scratch`).
    #[inline(always)]
    fn chunk_tokens<T: Element>(self, hd: usize) -> usize {
        if K::applies::<T>(hd) {
            CODE_CHUNK
        } else {
            self.avx512.chunk_tokens::<T>(hd)
        }
    }
    /// The runs' first `n` tokens, one slice each, in one [`DotKernels::accumulate`].
    #[inline(always)]
    fn accumulate_runs<T: Element, const R: usize, F: FnMut()>(
        self,
        acc: &mut [f32],
        p: [&[f32]; R],
        runs: &[&[T]],
        n: usize,
        hd: usize,
        step: &mut F,
    ) {
        if K::applies::<T>(hd) {
            let mut tokens: [&[T]; MAX_CHUNK] = [&[]; MAX_CHUNK];
            let mut at = 0;
            for (_, run, _) in first_tokens(runs, n, hd) {
                for vt in run.chunks_exact(hd) {
                    tokens[at] = vt;
                    at += 1;
                }
            }
            unsafe { K::accumulate::<T, R>(acc, p, &tokens[..at], hd) }
        } else {
            self.avx512.accumulate_runs(acc, p, runs, n, hd, step)
        }
    }
    super::avx512::elementwise_of_avx512!();
    /// In `K`'s unit ([`DotKernels::code_unit`]), exact: FP8's largest code over 2^120
    /// is an f32 normal, its smallest a subnormal with bits to spare.
    #[inline(always)]
    fn widen<T: Element>(self, src: &[T], dst: &mut [f32]) {
        match K::code_unit::<T>() {
            Some((unit, _)) => super::math::widen_in_unit(src, dst, unit),
            None => self.avx512.widen(src, dst),
        }
    }
    #[inline(always)]
    fn code_unit<T: Element>(self) -> f32 {
        K::code_unit::<T>().map_or_else(|| self.avx512.code_unit::<T>(), |(unit, _)| unit)
    }
    #[inline(always)]
    fn query_exponent<T: Element>(self) -> i32 {
        K::code_unit::<T>().map_or_else(|| self.avx512.query_exponent::<T>(), |(_, e)| e)
    }
    /// Int8: its weights go in 16-bit fixed point. FP8 with AVX512_BF16: its unit is
    /// not 1 (the default's rule).
    #[inline(always)]
    fn shifts_weights<T: Element>(self) -> bool {
        T::KIND == Kind::Int8 || self.code_unit::<T>() != 1.0
    }
    /// Never: passes over the storage beat widening it (paired, decode of 64 query
    /// heads over 8 KV heads, 2048 x 32 out of cache: f16 0.71, bf16 0.69, int8 0.48,
    /// fp8 0.63; chunked prefill f16 0.95, int8 0.62).
    #[inline(always)]
    fn widens_storage<T: Element>(self, _passes: bool) -> bool {
        false
    }
    #[cfg(test)]
    fn f32_side_rounding<T: Element>(self, hd: usize) -> f64 {
        K::f32_side_rounding::<T>(hd)
    }
}
