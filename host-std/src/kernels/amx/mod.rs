//! [`Simd`] with AMX tiles for bf16 storage ([`bf16`]): the scores and the value
//! accumulation of four query rows, 16 tokens a call, as tile products. Everything
//! else (other storage types, head dims that are not a multiple of 32, the softmax)
//! goes to [`Avx512`] unchanged.
//!
//! The query rows of a task go into the tiles' form four at a time, so the arithmetic
//! takes only tasks whose rows per KV head are a multiple of four
//! ([`Simd::takes_rows`]): decode of groups of 4 or 8 query heads per KV head, and
//! chunked prefill of such groups. The attention loop then calls only
//! [`Simd::scores4`] and [`Simd::accumulate4`], on groups of four rows that start at
//! a multiple of four.

mod bf16;
mod tiles;

use super::avx512::{elementwise_of_avx512, Avx512};
use super::lanes;
use super::math::Simd;
use super::online::Schedule;
use crate::dtype::Element;

/// AMX-BF16 over AVX-512F. Only [`AmxBf16::detect`] makes one, so holding a value
/// proves the CPU has both and this process may use the tiles.
#[derive(Clone, Copy)]
pub(crate) struct AmxBf16 {
    avx512: Avx512,
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
        .then_some(Self { avx512 })
    }

    /// Loads the tile configuration on this thread: before the first call of the
    /// arithmetic on a thread, and again after [`AmxBf16::end`]. O(1).
    #[inline]
    pub(crate) fn begin(self) {
        // SAFETY: a value proves the tiles are permitted.
        unsafe { tiles::configure() }
    }

    /// Releases the tiles on this thread (a context switch then saves none of their
    /// state). O(1).
    #[inline]
    pub(crate) fn end(self) {
        // SAFETY: a value proves the tiles are permitted.
        unsafe { tiles::release() }
    }
}

/// Whether storage `T` with head dim `hd` takes the tiles. O(1).
#[inline(always)]
fn tiled<T: Element>(hd: usize) -> bool {
    lanes::applies::<T>(hd, bf16::GROUP)
}

// SAFETY (every method): an `AmxBf16` value exists only when `detect` found AVX-512F,
// BW and the tiles; the attention loop runs its calls between `begin` and `end` on the
// calling thread.
impl Simd for AmxBf16 {
    #[inline(always)]
    fn takes_rows<T: Element>(self, hd: usize, head_rows: usize) -> bool {
        !tiled::<T>(hd) || head_rows.is_multiple_of(bf16::ROWS)
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
        if tiled::<T>(hd) {
            for t in (0..n).step_by(bf16::TOKENS) {
                let m = (n - t).min(bf16::TOKENS);
                let (k, s) = (&k[t * hd..], &mut s[t..]);
                unsafe { bf16::scores4(q, k, hd, m, s, s_stride) }
            }
        } else {
            self.avx512.scores4(q, k, hd, n, s, s_stride, passes)
        }
    }
    /// Never reached over bf16 storage ([`Simd::takes_rows`]); [`Avx512`]'s otherwise.
    #[inline(always)]
    fn scores1<T: Element>(self, q: &[f32], k: &[T], hd: usize, n: usize, s: &mut [f32]) {
        debug_assert!(!tiled::<T>(hd), "single rows are not in the tiles' form");
        self.avx512.scores1(q, k, hd, n, s)
    }
    /// [`Avx512`]'s: the accumulators are in the same split order.
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
        if tiled::<T>(hd) {
            for t in (0..n).step_by(bf16::TOKENS) {
                let m = (n - t).min(bf16::TOKENS);
                let p = p.map(|p| &p[t..]);
                unsafe { bf16::accumulate4(acc, p, &v[t * hd..], hd, m) }
            }
        } else {
            self.avx512.accumulate4(acc, p, v, hd, n)
        }
    }
    #[inline(always)]
    fn accumulate1<T: Element>(self, acc: &mut [f32], p: &[f32], v: &[T], hd: usize, n: usize) {
        self.avx512.accumulate1(acc, p, v, hd, n)
    }
    /// bf16: each four rows as their query tiles ([`bf16::to_query_tiles`]).
    #[inline(always)]
    fn enter_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        if tiled::<T>(hd) {
            unsafe { bf16::to_query_tiles(rows, hd) };
        } else {
            self.avx512.enter_kernel_order::<T>(rows, hd)
        }
    }
    /// [`Avx512`]'s: bf16 accumulators come out in its split order.
    #[inline(always)]
    fn leave_kernel_order<T: Element>(self, rows: &mut [f32], hd: usize) {
        self.avx512.leave_kernel_order::<T>(rows, hd)
    }
    #[inline(always)]
    fn gathers_values<T: Element>(self, hd: usize) -> bool {
        self.avx512.gathers_values::<T>(hd)
    }
    elementwise_of_avx512!();
    #[inline(always)]
    fn code_unit<T: Element>(self) -> f32 {
        self.avx512.code_unit::<T>()
    }
    #[inline(always)]
    fn widens_for_passes<T: Element>(self) -> bool {
        self.avx512.widens_for_passes::<T>()
    }
    /// bf16: steps of a whole tile of tokens, each step's prefetches split around its
    /// arithmetic (a step of 16 tokens would otherwise issue them in bursts of 64
    /// lines). Measured on Emerald Rapids, decode of 32 × 2048 tokens out of cache, two
    /// threads, 15 rounds of three alternating runs, time over the same build capped at
    /// `avx512dot`: 1.12 with the bursts whole, 1.02 split (quartiles 0.91 and 1.08).
    #[inline(always)]
    fn schedule<T: Element>(self, hd: usize) -> Schedule {
        if tiled::<T>(hd) {
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
