//! [`Simd`] with AMX tiles for bf16 storage ([`bf16`]), FP8 E4M3 storage decoded
//! into bf16 ([`fp8`]) and, where the CPU has AMX-INT8, int8 storage in byte products
//! ([`int8`]): the scores and the value accumulation of four query rows, 16 tokens a
//! tile, as tile products. Everything else (other storage types, head dims that are
//! not a multiple of 32, or of 64 for int8, the softmax) goes to [`Avx512`] unchanged.
//!
//! The query rows of a task go into the tiles' form four at a time, so the arithmetic
//! takes only tasks whose rows per KV head are a multiple of four
//! ([`Simd::takes_rows`]): decode of groups of 4 or 8 query heads per KV head, and
//! chunked prefill of such groups; for int8 only groups of four. The attention loop
//! then calls only [`Simd::scores4`], [`Simd::accumulate4`] and (bf16 and int8
//! decode, whose accumulation takes a chunk's blocks at once and keeps its sums in
//! the tiles across them) [`Simd::accumulate_runs`], on groups of four rows that
//! start at a multiple of four. FP8 and int8 tasks the tiles do not take go elsewhere
//! whole: FP8's to [`Avx512`], whose codes decode in another unit
//! ([`Simd::code_unit`]), int8's to the VNNI arithmetic.
//!
//! FP8 through the tiles, against the AVX-512 route of f16 decoding and f32 FMAs
//! (Emerald Rapids, decode of 32 query heads over 8 KV heads, head dim 128; medians of
//! 9 to 11 paired ratios on a loaded host): in cache (1 × 256 tokens, one thread)
//! 0.80 and 0.90 of its time, out of cache (32 × 2048, two threads) 0.96 and 1.00,
//! chunked prefill 1.06 times the FLOP rate. Decoding into a zeroed buffer took 13% of
//! the in-cache time in `memset`: the buffer is left uninitialised, and only what is
//! decoded is read.
//!
//! Int8 through the tiles, against VNNI's 16-bit dot products (the same shapes and
//! host, both in one binary, 41 or 15 alternating pairs of calls, medians of the
//! ratios): in cache 0.81 of the time (1 × 256 tokens) and 0.84 (1 × 2048), out of
//! cache 0.92-0.94 (32 × 2048, two threads, three sets, two of them before the query
//! rows' coding was vectorised, which took a tenth of the in-cache time).

mod bf16;
#[cfg(test)]
mod check;
mod fp8;
mod int8;
mod runs;
mod tiles;

use super::avx512::{elementwise_of_avx512, Avx512};
use super::lanes;
use super::math::Simd;
use super::online::{Schedule, CHUNK};
use crate::dtype::{bytes_of, Element, Kind};

/// AMX-BF16 over AVX-512F, with AMX-INT8 where the CPU has it (`int8`). Only
/// [`AmxBf16::detect`] makes one, so holding a value proves the CPU has AMX-BF16 and
/// AVX-512F and this process may use the tiles.
#[derive(Clone, Copy)]
pub(crate) struct AmxBf16 {
    avx512: Avx512,
    /// The CPU has AMX-INT8 too: int8 storage takes the tiles ([`int8`]).
    int8: bool,
}

impl AmxBf16 {
    /// `Some` if the CPU has AVX-512F and BW, AMX-TILE and AMX-BF16, Linux granted this
    /// process the tile state, and [`super::CPU_PATH_ENV`] allows it. O(1) after the
    /// first call.
    #[inline]
    pub(crate) fn detect() -> Option<Self> {
        let avx512 = Avx512::detect()?;
        (super::path_ceiling() >= 4
            && std::arch::is_x86_feature_detected!("avx512bw")
            && tiles::permitted())
        .then_some(Self {
            avx512,
            int8: tiles::has_int8(),
        })
    }

    /// Loads the tile configuration on this thread: before the first call of the
    /// arithmetic on a thread, and again after [`AmxBf16::end`]. O(1).
    #[inline]
    pub(crate) fn begin(self) {
        // SAFETY: a value proves the tiles are permitted.
        unsafe { tiles::configure() }
    }

    /// Whether int8 storage takes the tiles at all (the CPU has AMX-INT8), at head dims
    /// that are a multiple of 64. O(1).
    #[inline]
    pub(crate) fn takes_int8(self) -> bool {
        self.int8
    }

    /// Whether int8 storage `T` with head dim `hd` takes the tiles ([`int8`]): the CPU
    /// has AMX-INT8 and `hd` is a non-zero multiple of 64. O(1).
    #[inline(always)]
    fn int8_tiled<T: Element>(self, hd: usize) -> bool {
        self.int8 && T::KIND == Kind::Int8 && hd.is_multiple_of(int8::GROUP) && hd > 0
    }

    /// Releases the tiles on this thread (a context switch then saves none of their
    /// state). O(1).
    #[inline]
    pub(crate) fn end(self) {
        // SAFETY: a value proves the tiles are permitted.
        unsafe { tiles::release() }
    }
}

/// Whether storage `T` with head dim `hd` takes the tiles: bf16, and FP8 decoded into
/// bf16 ([`fp8`]), with a head dim that is a multiple of 32. O(1).
#[inline(always)]
fn tiled<T: Element>(hd: usize) -> bool {
    matches!(T::KIND, Kind::Bf16 | Kind::Fp8E4m3) && hd.is_multiple_of(bf16::GROUP) && hd > 0
}

/// Whether storage `T` with head dim `hd` takes the chained accumulation
/// ([`bf16::accumulate_runs4`]): bf16 in the tiles. FP8 decodes a tile at a time and
/// stores its sums after each: chained (December 2026, both forms in one binary,
/// calls alternating) it took longer, decoding the chunk's four tiles first 1.02-1.03
/// in cache and 1.04 out of cache, decoding each right before its products 1.07-1.09
/// and 1.09. O(1).
#[inline(always)]
fn chained<T: Element>(hd: usize) -> bool {
    T::KIND == Kind::Bf16 && tiled::<T>(hd)
}

// SAFETY (every method): an `AmxBf16` value exists only when `detect` found AVX-512F,
// BW and the tiles; the attention loop runs its calls between `begin` and `end` on the
// calling thread.
impl Simd for AmxBf16 {
    /// bf16 and FP8 in the tiles: any multiple of four rows per KV head. Int8: four
    /// exactly (decode of groups of four), one pass over each stored vector; a task of
    /// several passes goes to AVX-512 VNNI, which took less time (December 2026,
    /// Emerald Rapids, head dim 128, one thread, separate processes alternating, the
    /// fastest call of each): decode of groups of 8 over 2048 tokens 0.90-0.94 of
    /// the tiles' time, chunked prefill of 512 after 1536 0.87.
    #[inline(always)]
    fn takes_rows<T: Element>(self, hd: usize, head_rows: usize) -> bool {
        if self.int8_tiled::<T>(hd) {
            head_rows == bf16::ROWS
        } else if tiled::<T>(hd) {
            head_rows.is_multiple_of(bf16::ROWS)
        } else {
            !matches!(T::KIND, Kind::Fp8E4m3 | Kind::Int8)
        }
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
        if T::KIND == Kind::Fp8E4m3 {
            unsafe { fp8::scores4(q, bytes_of(&k[..n * hd]), hd, n, s, s_stride) }
        } else if self.int8_tiled::<T>(hd) {
            for t in (0..n).step_by(runs::TOKENS) {
                let m = (n - t).min(runs::TOKENS);
                let (k, s) = (&k[t * hd..], &mut s[t..]);
                unsafe { int8::scores4(q, k, hd, m, s, s_stride) }
            }
        } else if tiled::<T>(hd) {
            for t in (0..n).step_by(runs::TOKENS) {
                let m = (n - t).min(runs::TOKENS);
                let (k, s) = (&k[t * hd..], &mut s[t..]);
                unsafe { bf16::scores4(q, k, hd, m, s, s_stride) }
            }
        } else {
            self.avx512.scores4(q, k, hd, n, s, s_stride, passes)
        }
    }
    /// Never reached over the storage the tiles take ([`Simd::takes_rows`]);
    /// [`Avx512`]'s otherwise.
    #[inline(always)]
    fn scores1<T: Element>(self, q: &[f32], k: &[T], hd: usize, n: usize, s: &mut [f32]) {
        debug_assert!(!tiled::<T>(hd), "single rows are not in the tiles' form");
        self.avx512.scores1(q, k, hd, n, s)
    }
    /// [`Avx512`]'s: the accumulators are in the same split order. Never reached over
    /// FP8 ([`Simd::takes_rows`]), whose codes [`Avx512`] decodes in another unit.
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
        debug_assert!(T::KIND != Kind::Fp8E4m3, "FP8 rows come four at a time");
        self.avx512.accumulate2(acc, p0, p1, v, hd, n)
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
        if T::KIND == Kind::Fp8E4m3 {
            unsafe { fp8::accumulate4(acc, p, bytes_of(&v[..n * hd]), hd, n) }
        } else if self.int8_tiled::<T>(hd) {
            for t in (0..n).step_by(CHUNK) {
                let m = (n - t).min(CHUNK);
                let p = p.map(|p| &p[t..]);
                unsafe { int8::accumulate_runs4(acc, p, &[&v[t * hd..]], m, hd, &mut || {}) }
            }
        } else if tiled::<T>(hd) {
            for t in (0..n).step_by(runs::TOKENS) {
                let m = (n - t).min(runs::TOKENS);
                let p = p.map(|p| &p[t..]);
                unsafe { bf16::accumulate4(acc, p, &v[t * hd..], hd, m) }
            }
        } else {
            self.avx512.accumulate4(acc, p, v, hd, n)
        }
    }
    /// [`Avx512`]'s; never reached over FP8, as [`Simd::accumulate2`].
    #[inline(always)]
    fn accumulate1<T: Element>(self, acc: &mut [f32], p: &[f32], v: &[T], hd: usize, n: usize) {
        debug_assert!(T::KIND != Kind::Fp8E4m3, "FP8 rows come four at a time");
        self.avx512.accumulate1(acc, p, v, hd, n)
    }
    /// bf16 and FP8: each four rows as their query tiles ([`bf16::to_query_tiles`]);
    /// int8 in the tiles: as its byte tiles ([`int8::to_query_tiles`]).
    #[inline(always)]
    fn enter_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        if self.int8_tiled::<T>(hd) {
            unsafe { int8::to_query_tiles(rows, hd) };
        } else if tiled::<T>(hd) {
            unsafe { bf16::to_query_tiles(rows, hd) };
        } else {
            self.avx512.enter_kernel_order::<T>(rows, hd)
        }
    }
    /// FP8: out of the tiles' split order (16 even dimensions, then 16 odd, per 32).
    /// The rest [`Avx512`]'s: bf16 accumulators come out in its split order.
    #[inline(always)]
    fn leave_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        if T::KIND == Kind::Fp8E4m3 {
            lanes::from_split_order::<{ bf16::GROUP }, 2>(rows);
        } else if self.int8_tiled::<T>(hd) {
            lanes::from_split_order::<{ int8::GROUP }, { int8::PHASES }>(rows);
        } else {
            self.avx512.leave_kernel_order::<T>(rows, hd)
        }
    }
    /// bf16 through the tiles, in a task of one pass (decode): a chunk's values of a
    /// KV head in one call, whose sums stay in the tiles across its blocks
    /// ([`bf16::accumulate_runs4`]; decode in cache 0.88 of the time). Not in a task of
    /// several passes: gathered, chunked prefill took 0.98 to 1.04 of the time. Int8
    /// through the tiles always ([`int8::accumulate_runs4`]), as on VNNI.
    #[inline(always)]
    fn gathers_values<T: Element>(self, hd: usize, passes: bool) -> bool {
        (chained::<T>(hd) && !passes)
            || self.int8_tiled::<T>(hd)
            || self.avx512.gathers_values::<T>(hd, passes)
    }
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
        if chained::<T>(hd) && R == bf16::ROWS {
            let p = core::array::from_fn(|r| p[r]);
            unsafe { bf16::accumulate_runs4(acc, p, runs, n, hd, step) }
        } else if self.int8_tiled::<T>(hd) && R == bf16::ROWS {
            let p = core::array::from_fn(|r| p[r]);
            unsafe { int8::accumulate_runs4(acc, p, runs, n, hd, step) }
        } else {
            self.avx512.accumulate_runs(acc, p, runs, n, hd, step)
        }
    }
    /// bf16 and int8: a step a tile of 16 tokens. (Int8 with the next chunk's keys
    /// prefetched during the scores instead, as VNNI's: 1.05 and 1.08 of the time out
    /// of cache, 32 × 2048, two sets of 15 alternating pairs.)
    #[inline(always)]
    fn gathered_step<T: Element>(self, hd: usize) -> usize {
        if chained::<T>(hd) || self.int8_tiled::<T>(hd) {
            runs::TOKENS
        } else {
            self.avx512.gathered_step::<T>(hd)
        }
    }
    elementwise_of_avx512!();
    /// FP8 in the tiles' unit ([`fp8::UNIT`], exact: a code over
    /// 2^120 is at least 2^-129, an f32 subnormal with bits to spare).
    #[inline(always)]
    fn widen<T: Element>(self, src: &[T], dst: &mut [f32]) {
        if T::KIND == Kind::Fp8E4m3 {
            super::math::widen_in_unit(src, dst, fp8::UNIT);
        } else {
            self.avx512.widen(src, dst)
        }
    }
    #[inline(always)]
    fn code_unit<T: Element>(self) -> f32 {
        if T::KIND == Kind::Fp8E4m3 {
            fp8::UNIT
        } else {
            self.avx512.code_unit::<T>()
        }
    }
    /// Int8 in the tiles: its weights go in 16-bit fixed point.
    #[inline(always)]
    fn shifts_weights<T: Element>(self) -> bool {
        T::KIND == Kind::Int8 || self.code_unit::<T>() != 1.0
    }
    /// Never for FP8, whose passes decode their own tiles ([`fp8`]), nor for int8,
    /// whose tasks of several passes the tiles do not take ([`Simd::takes_rows`]: they
    /// go to VNNI, which does not widen either).
    #[inline(always)]
    fn widens_storage<T: Element>(self, passes: bool) -> bool {
        T::KIND != Kind::Fp8E4m3 && T::KIND != Kind::Int8 && self.avx512.widens_storage::<T>(passes)
    }
    /// bf16: steps of a whole tile of tokens, each step's prefetches split around its
    /// arithmetic (a step of 16 tokens would otherwise issue them in bursts of 64
    /// lines). Measured on Emerald Rapids, decode of 32 × 2048 tokens out of cache, two
    /// threads, 15 rounds of three alternating runs, time over the same build capped at
    /// `avx512dot`: 1.12 with the bursts whole, 1.02 split (quartiles 0.91 and 1.08).
    /// Int8 in the tiles takes the same (not measured against another).
    #[inline(always)]
    fn schedule<T: Element>(self, hd: usize) -> Schedule {
        if tiled::<T>(hd) || self.int8_tiled::<T>(hd) {
            Schedule {
                split: true,
                ..Schedule::PASSES
            }
        } else {
            self.avx512.schedule::<T>(hd)
        }
    }
    #[inline(always)]
    fn pass_schedule(self) -> Schedule {
        Schedule::PASSES
    }
}
