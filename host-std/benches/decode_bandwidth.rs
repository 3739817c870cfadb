//! Decode attention against the machine's read bandwidth, per storage dtype and context
//! length, all measured in one run.
//!
//! `cargo bench -p kvpage --bench decode_bandwidth` — for each context length (512, 2048
//! and 8192 tokens; others can be given as arguments) and each storage dtype (f32, f16,
//! bf16, and the 8-bit int8 and fp8 e4m3 with their per-token scales): a decode of
//! `65536 / context` sequences (so every call reads the same number of tokens: 64 MiB
//! of K/V per byte of element size, far past the last-level cache), 32
//! query heads over 8 KV heads, head dim 128, blocks of 16 tokens in shuffled physical
//! order, on one thread per core. Beside each call, interleaved with it, a read probe
//! streams the same arena's bytes on the same threads: the kernel's figure is its share
//! of that probe's bandwidth (`of probe`: the median over the rounds of the probe's time
//! over the kernel's in the same round; `(best)`: best time over best time). The probe itself is checked against `memcpy` (the C
//! library's, on the same threads and bytes): it prints both, so a probe that does not
//! reach the machine's read speed shows.
//!
//! Two probes read the same bytes, both in the widest vector loads the CPU has and with
//! software prefetches a fixed distance ahead: `probe` streams them (the arena in
//! address order, a contiguous half per thread), `paged` reads them in the decode's own
//! order (task by task, each block's K tiles of a task's heads, then its V tiles): what
//! the layout's access pattern gets from memory with no arithmetic in the way. `of
//! paged` is the kernel's share of that.
//!
//! `arithmetic` is the most any schedule of memory could give: the threads times the
//! kernel's best rate over K/V held in cache (timed on every thread between the row's
//! own calls), as a share of the probe. Where it is under a target share, the
//! arithmetic itself (instructions per byte on this CPU), not the memory access, is
//! what falls short.
//!
//! `ceiling` is what a kernel of that arithmetic reaches on this machine when its memory
//! access is the simplest there is: the overlap ceiling, a curve measured in the same
//! run from a synthetic kernel (the probe's streaming loop with a set number of
//! multiply-adds on each line it reads; printed before the table) and read at the
//! row's `arithmetic`. A kernel near its ceiling loses nothing to its memory access;
//! the way up from there is less arithmetic per byte. With `KVPAGE_BENCH_CEILINGS`
//! set, the bench prints the probe check and the ceiling twice, streaming and in a
//! decode's paged order, and runs no kernel.
//!
//! A shared host takes arithmetic away, not memory: on the development VM each vCPU
//! ran at full speed or at half, switching every few seconds while the probe stayed
//! where it was ([`QUIET_WITHIN`]). So every round times each thread's in-cache call
//! right before and after the kernel's call, all threads side by side
//! ([`compute_check`]), and the curve's points are measured the same way:
//! - `loaded` is the median of the rounds' own arithmetic (the threads' summed
//!   in-cache rate in that round, over the round's probe), where `arithmetic` is the
//!   best any thread did;
//! - `of ceil.` is the median over the rounds of the kernel's share over the curve read
//!   at the round's own arithmetic: what the kernel's structure loses, whatever the
//!   host left it;
//! - `quiet` is the share over the rounds in which no thread was slowed (each thread's
//!   in-cache call within [`QUIET_WITHIN`] of the dtype's fastest), with their count:
//!   "-" where there were fewer than [`MIN_QUIET`].
//!
//! The machine-independent quantity is the bytes of K/V each call must read (printed);
//! the figure to compare across machines is the fraction of the probe.

mod common;

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{numeric_args, stats, PagedCall};
use kvpage::kernels::{instruction_path, WorkerPool};
use kvpage::{bf16, f16, Element, Fp8E4m3, Int8};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const TOKENS_PER_CALL: u32 = 65536;
const KV_HEADS: u32 = 8;
const Q_HEADS: u32 = 32;
const HEAD_DIM: u32 = 128;
const BLOCK: u32 = 16;
const ITERS: usize = 21;

/// Adds the eight `u64` words of a 64-byte `line` into the eight accumulators (the
/// probes' loads, independent chains so that the loop is bound by loads).
#[inline(always)]
fn add_line(acc: &mut [u64; 8], line: &[u8]) {
    for (a, w) in acc.iter_mut().zip(line.chunks_exact(8)) {
        *a = a.wrapping_add(u64::from_ne_bytes(w.try_into().unwrap()));
    }
}

/// Sums `bytes` as `u64` words, one contiguous chunk per thread of `pool`, eight
/// independent accumulators per thread (so the loop is bound by loads, not by one add
/// chain), in the widest vector loads the CPU has, prefetching [`PROBE_AHEAD`] lines
/// ahead ([`read_ranges`]). On the Xeon (Emerald Rapids, 2 threads) where the plain
/// `u64` loop read at 12.5 GB/s, 0.77 of `memcpy`'s read rate, 64-byte loads read at
/// 15.7 GB/s and 64-byte loads with the prefetches at 23.3 GB/s, 1.37 times `memcpy`'s
/// read rate. That loop still fell short: the ceiling's synthetic kernel with no
/// arithmetic ([`synthetic`], one load a line, prefetches by address) read the same
/// bytes 1.20 to 1.45 times as fast, in the same rounds. Its prefetch cursor looked up
/// its range and sliced `bytes` (a bounds check) for every line; the cursor in
/// [`sum_ranges`] is now a line and an end, and the probe reads as fast as the
/// synthetic kernel (1.02 to 1.03 of its time), 1.46 to 1.51 times `memcpy`'s read
/// rate.
fn read_probe(bytes: &[u8], pool: &WorkerPool) -> u64 {
    let total = AtomicU64::new(0);
    pool.for_each_task(
        pool.threads(),
        || (),
        |_, t| {
            let (start, len) = thread_part(bytes.len(), pool.threads(), t);
            let lines = len / 64 * 64;
            let tail = bytes[start + lines..start + len]
                .iter()
                .map(|&b| u64::from(b))
                .sum::<u64>();
            let s = read_ranges(bytes, &[(start, lines)]);
            total.fetch_add(s.wrapping_add(tail), Ordering::Relaxed);
        },
    );
    total.into_inner()
}

/// Thread `t`'s contiguous part of `len` bytes split over `threads`, `(start, len)`:
/// parts of a whole number of 64-byte lines but the last, empty past the end. O(1).
fn thread_part(len: usize, threads: usize, t: usize) -> (usize, usize) {
    let per = len.div_ceil(threads).next_multiple_of(64);
    let start = (t * per).min(len);
    (start, per.min(len - start))
}

/// Lines that the probes ([`read_ranges`]) prefetch ahead of their reads (16 KiB). In a
/// stand-alone test on the development VM (2 threads reading shuffled 16 KiB pieces of
/// 256 MiB), distances of 128 to 512 lines read at 86% of a sequential read, and
/// prefetching the next piece while reading one at 72%.
const PROBE_AHEAD: usize = 256;

/// Heads per task of [`paged_probe`]: those of the kernel's decode tasks in this
/// benchmark (16 rows a task over groups of 4 query heads per KV head).
const PROBE_HEADS: u32 = 4;

/// The read probe in a decode's order: the byte ranges of each task
/// ([`PagedCall::decode_ranges`]) read in turn as `u64` words, eight accumulators per
/// line, with prefetches [`PROBE_AHEAD`] lines ahead in the same order; the tasks spread
/// over the pool's threads. What memory gives to the layout's access pattern with no
/// arithmetic in the way.
fn paged_probe(bytes: &[u8], tasks: &[Vec<(usize, usize)>], pool: &WorkerPool) -> u64 {
    let total = AtomicU64::new(0);
    pool.for_each_task(
        tasks.len(),
        || (),
        |_, t| {
            total.fetch_add(read_ranges(bytes, &tasks[t]), Ordering::Relaxed);
        },
    );
    total.into_inner()
}

/// Sums the `u64` words of `ranges` of `bytes` (each a whole number of 64-byte lines),
/// in order, prefetching [`PROBE_AHEAD`] lines ahead, in the widest vector loads
/// the CPU has: the loop is compiled for AVX-512F or AVX2 where the CPU has them. Plain
/// `u64` code compiled for the baseline x86-64 target takes 16-byte loads; see
/// [`read_probe`] for what that cost.
fn read_ranges(bytes: &[u8], ranges: &[(usize, usize)]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        /// # Safety
        /// The CPU has AVX-512F.
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512(bytes: &[u8], ranges: &[(usize, usize)]) -> u64 {
            sum_ranges(bytes, ranges)
        }
        /// # Safety
        /// The CPU has AVX2.
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(bytes: &[u8], ranges: &[(usize, usize)]) -> u64 {
            sum_ranges(bytes, ranges)
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F.
            return unsafe { avx512(bytes, ranges) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { avx2(bytes, ranges) };
        }
    }
    sum_ranges(bytes, ranges)
}

/// The probes' prefetch cursor over the lines of a list of byte ranges, in order.
struct Cursor<'a> {
    /// The ranges after the current one.
    after: core::slice::Iter<'a, (usize, usize)>,
    /// The next line to prefetch (an offset into the bytes), and its range's end.
    next: usize,
    end: usize,
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `ranges`, [`PROBE_AHEAD`] lines of them prefetched
    /// from `base` (the bytes' start).
    #[inline(always)]
    fn ahead_of(ranges: &'a [(usize, usize)], base: *const u8) -> Self {
        let mut cursor = Self {
            after: ranges.iter(),
            next: 0,
            end: 0,
        };
        for _ in 0..PROBE_AHEAD {
            cursor.prefetch(base);
        }
        cursor
    }

    /// Prefetches the next line (none past the last range) and moves past it. A line
    /// and an end to compare per line: a cursor that looked up its range and sliced the
    /// bytes (a bounds check) for every line held the probe 15-30% under the machine's
    /// read rate ([`read_probe`]).
    #[inline(always)]
    fn prefetch(&mut self, base: *const u8) {
        while self.next >= self.end {
            let Some(&(start, len)) = self.after.next() else {
                return;
            };
            (self.next, self.end) = (start, start + len);
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(self.next).cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = base;
        self.next += 64;
    }
}

/// The loop of [`read_ranges`], inlined into each of its target-feature variants.
#[inline(always)]
fn sum_ranges(bytes: &[u8], ranges: &[(usize, usize)]) -> u64 {
    let mut cursor = Cursor::ahead_of(ranges, bytes.as_ptr());
    let mut acc = [0u64; 8];
    for &(start, len) in ranges {
        for line in bytes[start..start + len].chunks_exact(64) {
            cursor.prefetch(bytes.as_ptr());
            add_line(&mut acc, line);
        }
    }
    acc.iter().fold(0, |x, &y| x.wrapping_add(y))
}

/// The synthetic kernel: the probes' loop over `ranges` of `bytes` (each a whole
/// number of 64-byte lines; prefetches [`PROBE_AHEAD`] lines ahead through the same
/// [`Cursor`], a 64-byte load a line, added into one accumulator) with `W` 16-float
/// multiply-adds `acc = acc · c + x` per line, taking the other accumulators in turn
/// (seven independent chains in AVX-512F; three pairs of 8-float ones in AVX2 with
/// FMA); `None` on a CPU with neither. Each line's bytes are made floats in `[1, 2)`
/// first (two instructions: whatever the bytes, no multiply-add meets a subnormal or a
/// NaN). The rounds are constants, so the accumulators stay in registers at every
/// `W`. Returns their sum.
fn synthetic<const W: usize>(bytes: &[u8], ranges: &[(usize, usize)]) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        /// # Safety
        /// The CPU has AVX-512F.
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512<const W: usize>(bytes: &[u8], ranges: &[(usize, usize)]) -> f32 {
            let base = bytes.as_ptr();
            let mut cursor = Cursor::ahead_of(ranges, base);
            let (mut acc, c) = ([_mm512_setzero_ps(); 8], _mm512_set1_ps(0.999));
            let (mantissa, one) = (
                _mm512_set1_epi32(0x007F_FFFF),
                _mm512_set1_epi32(0x3F80_0000),
            );
            for &(start, len) in ranges {
                for line in bytes[start..start + len].chunks_exact(64) {
                    cursor.prefetch(base);
                    // SAFETY: `line` holds 64 bytes.
                    let raw = unsafe { _mm512_loadu_si512(line.as_ptr().cast()) };
                    let x =
                        _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(raw, mantissa), one));
                    acc[0] = _mm512_add_ps(acc[0], x);
                    for round in 0..W.div_ceil(7) {
                        for a in &mut acc[1..=(W - 7 * round).min(7)] {
                            *a = _mm512_fmadd_ps(*a, c, x);
                        }
                    }
                }
            }
            acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
        }
        /// # Safety
        /// The CPU has AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<const W: usize>(bytes: &[u8], ranges: &[(usize, usize)]) -> f32 {
            let base = bytes.as_ptr();
            let mut cursor = Cursor::ahead_of(ranges, base);
            let (mut acc, c) = ([_mm256_setzero_ps(); 8], _mm256_set1_ps(0.999));
            let (mantissa, one) = (
                _mm256_set1_epi32(0x007F_FFFF),
                _mm256_set1_epi32(0x3F80_0000),
            );
            let float = |raw: __m256i| {
                _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(raw, mantissa), one))
            };
            for &(start, len) in ranges {
                for line in bytes[start..start + len].chunks_exact(64) {
                    cursor.prefetch(base);
                    // SAFETY: `line` holds 64 bytes.
                    let (x, y) = unsafe {
                        let p = line.as_ptr().cast::<__m256i>();
                        (
                            float(_mm256_loadu_si256(p)),
                            float(_mm256_loadu_si256(p.add(1))),
                        )
                    };
                    acc[0] = _mm256_add_ps(acc[0], x);
                    acc[1] = _mm256_add_ps(acc[1], y);
                    for round in 0..W.div_ceil(3) {
                        for a in acc[2..2 + 2 * (W - 3 * round).min(3)].chunks_exact_mut(2) {
                            a[0] = _mm256_fmadd_ps(a[0], c, x);
                            a[1] = _mm256_fmadd_ps(a[1], c, y);
                        }
                    }
                }
            }
            let mut lanes = [0.0f32; 8];
            let sum = acc
                .iter()
                .fold(_mm256_setzero_ps(), |s, &a| _mm256_add_ps(s, a));
            // SAFETY: 8 floats into `lanes`.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
            lanes.iter().sum()
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F.
            return Some(unsafe { avx512::<W>(bytes, ranges) });
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA.
            return Some(unsafe { avx2::<W>(bytes, ranges) });
        }
    }
    let _ = (bytes, ranges);
    None
}

/// [`ceiling_point`] at one number of multiply-adds per line.
type PointFn =
    fn(&[u8], &[Vec<(usize, usize)>], &dyn Fn() -> u64, &[u8], &WorkerPool) -> Option<(f64, f64)>;

/// The points of [`overlap_ceiling`]'s curve, by multiply-adds per 64-byte line of the
/// synthetic kernel: from arithmetic several times the probe's bandwidth (memory-bound)
/// down to under half of it (bound by the arithmetic), to bracket the kernels'
/// `arithmetic` column.
const CEILING_POINTS: [(usize, PointFn); 12] = [
    (0, ceiling_point::<0>),
    (2, ceiling_point::<2>),
    (4, ceiling_point::<4>),
    (6, ceiling_point::<6>),
    (8, ceiling_point::<8>),
    (12, ceiling_point::<12>),
    (16, ceiling_point::<16>),
    (20, ceiling_point::<20>),
    (24, ceiling_point::<24>),
    (32, ceiling_point::<32>),
    (40, ceiling_point::<40>),
    (48, ceiling_point::<48>),
];

/// One point of an overlap ceiling's curve, `(arithmetic, share)`: the synthetic
/// kernel of `W` multiply-adds per line over `tasks` (lists of ranges of `big`, spread
/// over the threads of `pool`), its share of `probe` (over the same bytes) timed in
/// the same rounds; and `arithmetic`, the median over the rounds of its in-cache rate
/// over `small` on all threads at once ([`compute_check`], right before and after the
/// round's call) over the round's probe: measured as the rows' `loaded` column is, so
/// that a round on a loaded host moves both coordinates together. `None` where the CPU
/// has no synthetic kernel.
fn ceiling_point<const W: usize>(
    big: &[u8],
    tasks: &[Vec<(usize, usize)>],
    probe: &dyn Fn() -> u64,
    small: &[u8],
    pool: &WorkerPool,
) -> Option<(f64, f64)> {
    synthetic::<W>(small, &[(0, small.len())])?;
    let in_cache = |_| {
        let t = Instant::now();
        black_box(synthetic::<W>(black_box(small), &[(0, small.len())]));
        t.elapsed()
    };
    let bytes: usize = tasks.iter().flatten().map(|r| r.1).sum();
    let (mut kernel, mut probes, mut arithmetic) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..ITERS + 2 {
        let before = compute_check(pool, &in_cache);
        let t = Instant::now();
        pool.for_each_task(
            tasks.len(),
            || (),
            |_, h| {
                black_box(synthetic::<W>(black_box(big), &tasks[h]));
            },
        );
        let tk = t.elapsed();
        let after = compute_check(pool, &in_cache);
        let t = Instant::now();
        black_box(probe());
        let tp = t.elapsed();
        if i >= 2 {
            kernel.push(tk);
            probes.push(tp);
            let probe_rate = bytes as f64 / tp.as_secs_f64();
            let a = round_arithmetic(&before, &after, small.len() as f64, probe_rate);
            arithmetic.extend(a);
        }
    }
    Some((median(arithmetic)?, paired_share(&probes, &kernel)))
}

/// The overlap ceiling of this machine: what share of the probe a kernel of a given
/// `arithmetic` (its in-cache rate on all threads at once over the probe, as the rows'
/// `loaded` column) reaches when its memory access is as simple as can be: the probe's
/// stream and prefetches, with [`CEILING_POINTS`]' multiply-adds per line
/// ([`synthetic`]). A kernel whose arithmetic were free would read at 100%; one whose
/// arithmetic and memory did not overlap at all at `1 / (1 + 1 / arithmetic)`.
/// Printed as a curve; returned sorted by arithmetic (empty where the CPU has neither
/// AVX-512F nor AVX2). O(`CEILING_POINTS` × `ITERS + 2` rounds × (the synthetic kernel
/// and the probe over `big`, and two [`compute_check`]s)): about 10 s over 256 MiB at
/// 25 GB/s.
fn overlap_ceiling(
    pool: &WorkerPool,
    big: &[u8],
    tasks: &[Vec<(usize, usize)>],
    probe: &dyn Fn() -> u64,
    small: &[u8],
) -> Vec<(f64, f64)> {
    let mut curve = Vec::new();
    for (w, point) in CEILING_POINTS {
        let point = point(big, tasks, probe, small, pool);
        let Some(point) = point else {
            println!("  (no synthetic kernel without AVX-512F or AVX2: no ceiling)");
            return Vec::new();
        };
        println!(
            "  {w:>3} multiply-adds per line: arithmetic {:>6.1}%, {:>5.1}% of probe (no overlap at all: {:.1}%)",
            100.0 * point.0,
            100.0 * point.1,
            100.0 / (1.0 + 1.0 / point.0)
        );
        curve.push(point);
    }
    curve.sort_by(|a, b| a.0.total_cmp(&b.0));
    curve
}

/// The ceiling `curve` read at `arithmetic`: linear between its two nearest points,
/// its end points beyond them.
fn ceiling_at(curve: &[(f64, f64)], arithmetic: f64) -> f64 {
    let above = curve.partition_point(|p| p.0 < arithmetic);
    match (curve.get(above.wrapping_sub(1)), curve.get(above)) {
        (Some(&(a0, s0)), Some(&(a1, s1))) if a1 > a0 => {
            s0 + (s1 - s0) * (arithmetic - a0) / (a1 - a0)
        }
        (_, Some(&(_, s))) | (Some(&(_, s)), None) => s,
        (None, None) => f64::NAN,
    }
}

/// Copies `src` into `dst` with the C library's `memcpy` (`copy_from_slice`), one chunk
/// per thread of `pool`.
fn memcpy_probe(src: &[u8], dst: &mut [u8], pool: &WorkerPool) {
    let per = src.len().div_ceil(pool.threads()).next_multiple_of(64);
    let chunks: Vec<Mutex<&mut [u8]>> = dst.chunks_mut(per).map(Mutex::new).collect();
    pool.for_each_task(
        chunks.len(),
        || (),
        |_, t| {
            let s = &src[t * per..(t * per + per).min(src.len())];
            chunks[t].lock().unwrap().copy_from_slice(s);
        },
    );
}

/// A round of a row is quiet when every thread's in-cache check ([`compute_check`])
/// before and after its kernel call took at most this many times the fastest thread's
/// median over all rows of the dtype: no thread shared its core with a busy neighbour
/// then. On the development VM (2 vCPUs) each vCPU's in-cache bf16 decode took either
/// 44-50 µs or 85-117 µs, twice as long, switching every few seconds, each vCPU on its
/// own (both pinned, side by side: 92 and 49, 48 and 107, 47 and 49 µs), while the read
/// probe did not move (10.5-11.2 ms in the same rounds): the host takes half of a
/// vCPU's arithmetic, not its memory. In a 31-round bf16 row both threads were slow in
/// 27 rounds (54% of the probe) and one fast in 4 (72-80%); no round had both fast.
const QUIET_WITHIN: f64 = 1.3;

/// Fewest quiet rounds whose median share `quiet` prints. A round's share pairs the
/// kernel's call with the probe right after it, and a quiet round is judged by the
/// threads' arithmetic alone, not by the probe: on the Zen 4 VM a bf16 row of two quiet
/// rounds printed 423%, the probe of one of them four times its usual time. Three
/// rounds outvote one such probe.
const MIN_QUIET: usize = 3;

/// In-cache calls each thread times in one [`compute_check`].
const CHECK_CALLS: usize = 25;

/// What one [`compute_check`] saw.
struct Check {
    /// Each check's median time of one call (a check per thread).
    medians: Vec<Duration>,
    /// Whether every check ran on a thread of its own (not so when a worker did not
    /// wake in time and another thread ran two).
    apart: bool,
    /// The fastest single call.
    best: Duration,
}

impl Check {
    /// The in-cache rate of all threads at once, `bytes` per call: the sum over the
    /// threads of `bytes / median`. `None` unless the checks ran apart.
    fn rate(&self, bytes: f64) -> Option<f64> {
        let rates = self.medians.iter().map(|m| bytes / m.as_secs_f64());
        self.apart.then(|| rates.sum())
    }

    /// The slowest thread's median, `None` unless the checks ran apart.
    fn slowest(&self) -> Option<Duration> {
        self.apart.then(|| *self.medians.iter().max().unwrap())
    }

    /// The fastest thread's median.
    fn fastest(&self) -> Duration {
        *self.medians.iter().min().unwrap()
    }
}

/// The round's arithmetic from the checks `before` and `after` its kernel call: their
/// mean in-cache rate of all threads (`bytes` per call) over `probe_rate`. `None`
/// unless both checks ran apart.
fn round_arithmetic(before: &Check, after: &Check, bytes: f64, probe_rate: f64) -> Option<f64> {
    let (b, a) = (before.rate(bytes)?, after.rate(bytes)?);
    Some((b + a) / 2.0 / probe_rate)
}

/// One in-cache check of every thread of `pool` at once: thread `t` times
/// [`CHECK_CALLS`] calls of `call(t)` (each returns the time of one call over data of
/// its own, in cache). All threads run side by side, as a kernel's call runs them: a
/// thread whose core a neighbour shares is timed as the kernel would find it.
/// O(threads × CHECK_CALLS) calls.
fn compute_check(pool: &WorkerPool, call: &(dyn Fn(usize) -> Duration + Sync)) -> Check {
    let threads = pool.threads();
    let started = AtomicUsize::new(0);
    let results = Mutex::new(Vec::new());
    pool.for_each_task(
        threads,
        || (),
        |_, t| {
            // Each check starts once all have (or after 2 ms).
            started.fetch_add(1, Ordering::SeqCst);
            let wait = Instant::now();
            while started.load(Ordering::SeqCst) < threads
                && wait.elapsed() < Duration::from_millis(2)
            {
                std::hint::spin_loop();
            }
            let times: Vec<Duration> = (0..CHECK_CALLS).map(|_| call(t)).collect();
            let id = std::thread::current().id();
            results.lock().unwrap().push((id, stats(times)));
        },
    );
    let results = results.into_inner().unwrap();
    Check {
        medians: results.iter().map(|r| r.1 .0).collect(),
        apart: results
            .iter()
            .all(|(id, _)| results.iter().filter(|r| r.0 == *id).count() == 1),
        best: results.iter().map(|r| r.1 .1).min().unwrap(),
    }
}

/// One (context, dtype) row's rounds, printed once every row is measured
/// ([`Row::print`]): a round is quiet against the fastest thread of all rows of its
/// dtype.
struct Row {
    dtype: kvpage::DType,
    context: u32,
    seqs: u32,
    /// Bytes of K/V the kernel's call reads.
    bytes: f64,
    /// Per round: the kernel's time, the streaming and the paged probe's.
    kernel: Vec<Duration>,
    probe: Vec<Duration>,
    paged: Vec<Duration>,
    /// Per round: the slowest thread's median of the checks before and after the
    /// kernel (`None`: not every thread checked apart), and the round's arithmetic
    /// ([`round_arithmetic`]).
    slowest: Vec<Option<Duration>>,
    arithmetic: Vec<Option<f64>>,
    /// The fastest thread's median over the row's checks: a thread's in-cache speed
    /// with no neighbour, the yardstick of a quiet round.
    quiet_median: Duration,
    /// The threads times the fastest in-cache call of the row's checks, in bytes per
    /// second: the arithmetic with no neighbour on any core.
    unloaded_rate: f64,
}

/// One (context, dtype) row: [`ITERS`] rounds (after two of warm-up), each the kernel's
/// call between two [`compute_check`]s of the same decode over one sequence of 256
/// tokens (1 MiB of f32) in each thread's cache, then the two probes. O(rounds) calls.
fn row<T: Element>(context: u32, pool: &WorkerPool, rng: &mut StdRng) -> Row {
    let seqs = (TOKENS_PER_CALL / context).max(1);
    let mut call = PagedCall::<T>::new(KV_HEADS, HEAD_DIM, BLOCK, Q_HEADS, seqs, context, 1, rng);
    let cached: Vec<Mutex<PagedCall<T>>> = (0..pool.threads())
        .map(|_| {
            let c = PagedCall::<T>::new(KV_HEADS, HEAD_DIM, BLOCK, Q_HEADS, 1, 256, 1, rng);
            Mutex::new(c)
        })
        .collect();
    let cached_bytes = cached[0].lock().unwrap().bytes().len() as f64;
    let check = || compute_check(pool, &|t| cached[t].lock().unwrap().time(None));
    let tasks = call.decode_ranges(PROBE_HEADS);
    if context.is_multiple_of(BLOCK) {
        let read: usize = tasks.iter().flatten().map(|r| r.1).sum();
        assert_eq!(
            read,
            call.bytes().len(),
            "the paged probe reads the arena once"
        );
    }
    let mut row = Row {
        dtype: T::DTYPE,
        context,
        seqs,
        bytes: call.bytes().len() as f64,
        kernel: Vec::new(),
        probe: Vec::new(),
        paged: Vec::new(),
        slowest: Vec::new(),
        arithmetic: Vec::new(),
        quiet_median: Duration::MAX,
        unloaded_rate: 0.0,
    };
    for i in 0..ITERS + 2 {
        let before = check();
        let tk = call.time(Some(pool));
        let after = check();
        let t = Instant::now();
        black_box(read_probe(black_box(call.bytes()), pool));
        let tp = t.elapsed();
        let t = Instant::now();
        black_box(paged_probe(black_box(call.bytes()), &tasks, pool));
        let tg = t.elapsed();
        for c in [&before, &after] {
            row.quiet_median = row.quiet_median.min(c.fastest());
            let rate = pool.threads() as f64 * cached_bytes / c.best.as_secs_f64();
            row.unloaded_rate = row.unloaded_rate.max(rate);
        }
        if i >= 2 {
            row.kernel.push(tk);
            row.probe.push(tp);
            row.paged.push(tg);
            let slowest = before.slowest().zip(after.slowest());
            row.slowest.push(slowest.map(|(b, a)| b.max(a)));
            let probe_rate = row.bytes / tp.as_secs_f64();
            let a = round_arithmetic(&before, &after, cached_bytes, probe_rate);
            row.arithmetic.push(a);
        }
    }
    row
}

/// The median of `v` (of an even count, the mean of the middle two), `None` if it is
/// empty. O(n log n).
fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

impl Row {
    /// Prints the row:
    /// - median decode time, its bandwidth and the probe's; its share of each probe;
    /// - `arithmetic`: the threads × the best rate of an in-cache call over the probe:
    ///   what the arithmetic gets through with memory out of the way and no
    ///   neighbour on any core; `ceiling`: the overlap `curve` read there;
    /// - `loaded`: the median of the rounds' own arithmetic (every thread's in-cache
    ///   rate, timed side by side right around the round's call); `of ceil.`: the
    ///   median over the rounds of the kernel's share over the curve read at the
    ///   round's arithmetic: what the kernel's structure loses, whatever the host
    ///   left of the arithmetic;
    /// - `quiet`: the share over the rounds whose every thread's checks took at most
    ///   [`QUIET_WITHIN`] times `quiet_median` (the fastest thread's median over all
    ///   rows of the dtype), and how many rounds those were; "-" under
    ///   [`MIN_QUIET`] of them.
    fn print(&self, curve: &[(f64, f64)], quiet_median: Duration) {
        let limit = QUIET_WITHIN * quiet_median.as_secs_f64();
        let quiet: Vec<usize> = (0..self.slowest.len())
            .filter(|&i| self.slowest[i].is_some_and(|c| c.as_secs_f64() <= limit))
            .collect();
        let of_quiet = (quiet.len() >= MIN_QUIET).then(|| {
            let pick = |v: &[Duration]| quiet.iter().map(|&i| v[i]).collect::<Vec<_>>();
            paired_share(&pick(&self.probe), &pick(&self.kernel))
        });
        let of_probe = paired_share(&self.probe, &self.kernel);
        let of_paged = paired_share(&self.paged, &self.kernel);
        let (k, k_best) = stats(self.kernel.clone());
        let (p, p_best) = stats(self.probe.clone());
        let (g, _) = stats(self.paged.clone());
        let gbs = |d: Duration| self.bytes / d.as_secs_f64() / 1e9;
        let arithmetic = self.unloaded_rate / 1e9 / gbs(p);
        let rounds = (0..self.kernel.len()).filter_map(|i| Some((i, self.arithmetic[i]?)));
        let loaded = median(rounds.clone().map(|(_, a)| a).collect());
        let of_ceiling = median(
            rounds
                .map(|(i, a)| {
                    let share = self.probe[i].as_secs_f64() / self.kernel[i].as_secs_f64();
                    share / ceiling_at(curve, a)
                })
                .collect(),
        );
        let percent = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{:.1}%", 100.0 * x));
        println!(
            "{:<7} {:>7} {:>5} {:>9.1} {:>10.2} {:>9.2} {:>9.2} {:>8.1}% {:>8.1}% {:>9.2} {:>8.1}% {:>10.1}% {:>8.1}% {:>8} {:>8} {:>7} {:>6}",
            format!("{:?}", self.dtype),
            self.context,
            self.seqs,
            self.bytes / (1 << 20) as f64,
            k.as_secs_f64() * 1e3,
            gbs(k),
            gbs(p),
            100.0 * of_probe,
            100.0 * p_best.as_secs_f64() / k_best.as_secs_f64(),
            gbs(g),
            100.0 * of_paged,
            100.0 * arithmetic,
            100.0 * ceiling_at(curve, arithmetic),
            percent(loaded),
            percent(of_ceiling),
            percent(of_quiet),
            format!("{}/{}", quiet.len(), self.kernel.len()),
        );
    }
}

/// The median over the rounds of `probe[i] / kernel[i]`: the kernel's share of a probe
/// timed in the same round, right after it. On a shared host whose load drifts over
/// the run, a slow spell slows both of a round, where the ratio of the two medians
/// could pair a kernel round and a probe round far apart.
/// Panics on no rounds (every caller has some).
fn paired_share(probe: &[Duration], kernel: &[Duration]) -> f64 {
    let r = probe.iter().zip(kernel);
    median(r.map(|(p, k)| p.as_secs_f64() / k.as_secs_f64()).collect()).expect("rounds")
}

/// The same decode on one thread over K/V that stay in the cache (one sequence of 256
/// tokens: 1 MiB of f32), repeated: the kernel's arithmetic rate, with memory out of the
/// way. A kernel is bound by memory only while this rate per thread, times the threads,
/// is well above the probe's bandwidth.
fn in_cache<T: Element>(rng: &mut StdRng) {
    let call = PagedCall::<T>::new(KV_HEADS, HEAD_DIM, BLOCK, Q_HEADS, 1, 256, 1, rng);
    in_cache_of(call, "");
}

/// [`in_cache`] of `call`, its line labelled with `what` after the dtype.
fn in_cache_of<T: Element>(mut call: PagedCall<T>, what: &str) {
    let times: Vec<Duration> = (0..1010).map(|_| call.time(None)).skip(10).collect();
    let (m, best) = stats(times);
    let bytes = call.bytes().len() as f64;
    println!(
        "  {:<7} {:>8.1} µs per call, {:>6.2} GB/s of K/V per thread (best {:.2}){what}",
        format!("{:?}", T::DTYPE),
        m.as_secs_f64() * 1e6,
        bytes / m.as_secs_f64() / 1e9,
        bytes / best.as_secs_f64() / 1e9
    );
}

/// [`in_cache`] over K/V written from data with outliers ([`PagedCall::with_outliers`]).
fn for_outliers<T: Element>(rng: &mut StdRng) {
    let call = PagedCall::<T>::new(KV_HEADS, HEAD_DIM, BLOCK, Q_HEADS, 1, 256, 1, rng);
    in_cache_of(call.with_outliers(rng), ", written from data with outliers");
}

/// The probe against `memcpy` on 256 MiB, interleaved, medians.
fn probe_check(pool: &WorkerPool, rng: &mut StdRng) {
    let n = 256 << 20;
    let src: Vec<u8> = (0..n).map(|_| rng.random()).collect();
    let mut dst = vec![0u8; n];
    let (mut read, mut copy) = (Vec::new(), Vec::new());
    for i in 0..ITERS + 2 {
        let t = Instant::now();
        black_box(read_probe(black_box(&src), pool));
        let tr = t.elapsed();
        let t = Instant::now();
        memcpy_probe(black_box(&src), &mut dst, pool);
        black_box(&dst);
        let tc = t.elapsed();
        if i >= 2 {
            read.push(tr);
            copy.push(tc);
        }
    }
    let ((r, _), (c, _)) = (stats(read), stats(copy));
    let gbs = |d: Duration| n as f64 / d.as_secs_f64() / 1e9;
    println!(
        "read probe {:.2} GB/s; memcpy reads at {:.2} GB/s (and writes as much): probe / memcpy read rate {:.2}",
        gbs(r),
        gbs(c),
        c.as_secs_f64() / r.as_secs_f64()
    );
}

/// Peak f32 multiply-add rate of one thread: independent 16-lane FMA chains (AVX-512F,
/// else 8-lane AVX2 + FMA), in FLOP/s (2 per lane per FMA). The yardstick of the
/// prefill section. Zero where the CPU has neither.
///
/// Each chain starts from its own opaque value: chains that start alike are the same
/// computation, which the compiler merges into one (twelve identical chains became a
/// single latency-bound one, and the rate counted for twelve read 1.5 times the
/// machine's peak on Zen 3: 153.9 GFLOP/s at 3.2 GHz, whose two FMA pipes give 102.4).
fn fma_peak() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        /// # Safety
        /// The CPU has AVX-512F.
        #[target_feature(enable = "avx512f")]
        unsafe fn chains512(rounds: u64) -> f32 {
            let mut a: [__m512; 12] =
                core::array::from_fn(|i| _mm512_set1_ps(black_box(1.0 + i as f32 / 64.0)));
            let b = _mm512_set1_ps(black_box(0.999_999));
            let c = _mm512_set1_ps(black_box(1e-6));
            for _ in 0..rounds {
                for x in a.iter_mut() {
                    *x = _mm512_fmadd_ps(*x, b, c);
                }
            }
            _mm512_reduce_add_ps(
                a.iter()
                    .fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x)),
            )
        }
        /// # Safety
        /// The CPU has AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn chains256(rounds: u64) -> f32 {
            let mut a: [__m256; 12] =
                core::array::from_fn(|i| _mm256_set1_ps(black_box(1.0 + i as f32 / 64.0)));
            let b = _mm256_set1_ps(black_box(0.999_999));
            let c = _mm256_set1_ps(black_box(1e-6));
            for _ in 0..rounds {
                for x in a.iter_mut() {
                    *x = _mm256_fmadd_ps(*x, b, c);
                }
            }
            // Every chain reaches the result, so none is dead code.
            let sum = a
                .iter()
                .fold(_mm256_setzero_ps(), |s, &x| _mm256_add_ps(s, x));
            let mut out = [0.0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), sum);
            out.iter().sum()
        }
        let rounds = black_box(20_000_000u64);
        let (lanes, seconds) = if is_x86_feature_detected!("avx512f") {
            let t = Instant::now();
            // SAFETY: AVX-512F detected.
            black_box(unsafe { chains512(rounds) });
            (16.0, t.elapsed().as_secs_f64())
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            let t = Instant::now();
            // SAFETY: AVX2 and FMA detected.
            black_box(unsafe { chains256(rounds) });
            (8.0, t.elapsed().as_secs_f64())
        } else {
            return 0.0;
        };
        12.0 * rounds as f64 * lanes * 2.0 / seconds
    }
    #[cfg(not(target_arch = "x86_64"))]
    0.0
}

/// The rates of the 512-bit dot-product instructions the 8-bit kernels use, each
/// against `vfmadd231ps` timed in the same loop on the same thread: twelve independent
/// accumulators, each instruction once per accumulator per round, from zeroed registers
/// (no subnormal ever meets the float ones), the best of three timings of each.
/// `(name, instructions per FMA's time)` for
/// each the CPU has; empty without AVX-512F. On the 2-vCPU Zen 4 of December 2026 all
/// three ran at the FMA's rate, so `vpdpwssd` (32 multiply-adds) and `vdpbf16ps` (32)
/// do twice an FMA's (16) and `vpdpbusd` (64) four times.
fn dot_rates() -> Vec<(&'static str, f64)> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::asm;
        /// Seconds for `rounds` rounds of `$insn zmmN, zmm12, zmm13` over N in 0..12.
        macro_rules! rounds_of {
            ($insn:literal, $features:literal) => {{
                /// # Safety
                /// The CPU has the features.
                #[target_feature(enable = $features)]
                unsafe fn run(rounds: u64) -> f64 {
                    let t = Instant::now();
                    // SAFETY: the caller's; registers only, declared clobbered.
                    unsafe {
                        asm!(
                            // Zero the accumulators zmm0-11 and the operands zmm12-13.
                            ".irp n, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13",
                            "vpxord zmm\\n, zmm\\n, zmm\\n",
                            ".endr",
                            "2:",
                            ".irp n, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11",
                            concat!($insn, " zmm\\n, zmm12, zmm13"),
                            ".endr",
                            "dec rcx",
                            "jnz 2b",
                            inout("rcx") rounds => _,
                            // Every vector register the asm writes is caller-saved.
                            clobber_abi("C"),
                            options(nomem, nostack),
                        );
                    }
                    t.elapsed().as_secs_f64()
                }
                run
            }};
        }
        if !is_x86_feature_detected!("avx512f") {
            return Vec::new();
        }
        /// The best of three timings of `run`: a shared host slows a vCPU for seconds
        /// at a time ([`QUIET_WITHIN`]), which one timing of either side would take
        /// for the rate.
        ///
        /// # Safety
        /// The CPU has the features `run` was compiled for.
        unsafe fn best(run: unsafe fn(u64) -> f64) -> f64 {
            (0..3)
                // SAFETY: the caller's.
                .map(|_| unsafe { run(black_box(20_000_000)) })
                .fold(f64::INFINITY, f64::min)
        }
        // SAFETY: AVX-512F detected.
        let fma = unsafe { best(rounds_of!("vfmadd231ps", "avx512f")) };
        let mut rates = Vec::new();
        if is_x86_feature_detected!("avx512vnni") {
            // SAFETY: AVX-512F and VNNI detected.
            let t = unsafe { best(rounds_of!("vpdpwssd", "avx512f,avx512vnni")) };
            rates.push(("vpdpwssd", fma / t));
            // SAFETY: as above.
            let t = unsafe { best(rounds_of!("vpdpbusd", "avx512f,avx512vnni")) };
            rates.push(("vpdpbusd", fma / t));
        }
        if is_x86_feature_detected!("avx512bf16") {
            // SAFETY: AVX-512F and BF16 detected.
            let t = unsafe { best(rounds_of!("vdpbf16ps", "avx512f,avx512bf16")) };
            rates.push(("vdpbf16ps", fma / t));
        }
        rates
    }
    #[cfg(not(target_arch = "x86_64"))]
    Vec::new()
}

/// The AMX bf16 tile product's rate on one thread, in FLOP/s (`tdpbf16ps`: 16 × 16
/// outputs, each 32 products and sums), where the kernels take AMX (the path names it,
/// and so the process already holds the tile permission): six independent accumulators
/// over the same operands. `None` elsewhere.
fn amx_peak() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if instruction_path().contains("amx") {
        use std::arch::asm;
        /// The `ldtilecfg` operand: palette 1, eight tiles of 16 rows × 64 bytes.
        #[repr(C, align(64))]
        struct Config([u8; 64]);
        #[repr(C, align(64))]
        struct Rows([u16; 512]);
        let mut config = Config([0; 64]);
        config.0[0] = 1;
        for t in 0..8 {
            config.0[16 + 2 * t] = 64;
            config.0[48 + t] = 16;
        }
        let ones = Rows([0x3F80; 512]);
        let rounds = black_box(2_000_000u64);
        let t = Instant::now();
        // SAFETY: the kernels' path takes AMX, so the CPU has AMX-TILE and AMX-BF16 and
        // the OS granted this process the tile state; the configuration is valid, and
        // the tile loads read 1 KiB of `ones`.
        unsafe {
            asm!(
                "ldtilecfg [{config}]",
                "tileloadd tmm6, [{ones} + {stride}*1]",
                "tileloadd tmm7, [{ones} + {stride}*1]",
                "tilezero tmm0", "tilezero tmm1", "tilezero tmm2",
                "tilezero tmm3", "tilezero tmm4", "tilezero tmm5",
                "2:",
                "tdpbf16ps tmm0, tmm6, tmm7", "tdpbf16ps tmm1, tmm6, tmm7",
                "tdpbf16ps tmm2, tmm6, tmm7", "tdpbf16ps tmm3, tmm6, tmm7",
                "tdpbf16ps tmm4, tmm6, tmm7", "tdpbf16ps tmm5, tmm6, tmm7",
                "dec {rounds}",
                "jnz 2b",
                "tilerelease",
                config = in(reg) &config,
                ones = in(reg) ones.0.as_ptr(),
                stride = in(reg) 64usize,
                rounds = inout(reg) rounds => _,
                options(nostack),
            );
        }
        let seconds = t.elapsed().as_secs_f64();
        return Some(6.0 * rounds as f64 * (16.0 * 16.0 * 32.0 * 2.0) / seconds);
    }
    None
}

/// Chunked prefill: one sequence of 2048 tokens whose last 512 are new queries (causal),
/// per dtype, on the pool's threads; its FLOP rate (`4 hd` per query head and visible
/// token: the scores and the weighted values) against `threads × fma_peak()` measured
/// just before, and for bf16 and FP8 where the kernels take AMX tiles, against
/// `threads × amx_peak()` too.
fn prefill<T: Element>(pool: &WorkerPool, peak: f64, amx: Option<f64>, rng: &mut StdRng) {
    let (context, queries) = (2048u32, 512u32);
    let mut call =
        PagedCall::<T>::new(KV_HEADS, HEAD_DIM, BLOCK, Q_HEADS, 1, context, queries, rng);
    let times: Vec<Duration> = (0..ITERS + 2)
        .map(|_| call.time(Some(pool)))
        .skip(2)
        .collect();
    let (m, _) = stats(times);
    let visible: u64 = (0..u64::from(queries))
        .map(|i| u64::from(context - queries) + i + 1)
        .sum();
    let flops = (visible * u64::from(Q_HEADS) * 4 * u64::from(HEAD_DIM)) as f64;
    let rate = flops / m.as_secs_f64();
    let threads = pool.threads() as f64;
    let tiles = match amx {
        Some(amx) if matches!(T::DTYPE, kvpage::DType::Bf16 | kvpage::DType::Fp8E4m3) => {
            format!(" ({:.1}% of the AMX peak)", 100.0 * rate / (amx * threads))
        }
        _ => String::new(),
    };
    println!(
        "  {:<7} {:>8.2} ms per call, {:>6.1} GFLOP/s = {:>5.1}% of {} threads x the FMA peak{tiles}",
        format!("{:?}", T::DTYPE),
        m.as_secs_f64() * 1e3,
        rate / 1e9,
        100.0 * rate / (peak * threads),
        pool.threads()
    );
}

/// The CPU's model name and its vector extensions, from `/proc/cpuinfo` where there is one.
fn cpu() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split(':').nth(1))
            .map(str::trim)
            .unwrap_or("?")
            .to_string()
    };
    let flags = field("flags");
    let vector: Vec<&str> = flags
        .split_whitespace()
        .filter(|f| f.starts_with("avx") || *f == "f16c" || *f == "fma" || f.starts_with("amx"))
        .collect();
    format!("{} [{}]", field("model name"), vector.join(" "))
}

/// Set (to anything), the bench prints only the probe check and the two overlap
/// ceilings ([`streaming_ceiling`], [`paged_ceiling`]), and runs no kernel.
const CEILINGS_ONLY_ENV: &str = "KVPAGE_BENCH_CEILINGS";

/// The kernels' arithmetic sections: each dtype's decode in cache on one thread, the
/// rates of the dot-product instructions against the FMA's ([`dot_rates`]), and
/// chunked prefill against the FMA (and AMX) peak.
fn in_cache_and_prefill(pool: &WorkerPool, rng: &mut StdRng) {
    println!("in cache, one thread (1 seq x 256 tokens, repeated):");
    in_cache::<f32>(rng);
    in_cache::<f16>(rng);
    in_cache::<bf16>(rng);
    in_cache::<Int8>(rng);
    in_cache::<Fp8E4m3>(rng);
    // The 8-bit types again over codes written from data with outliers (some subnormal
    // FP8 codes, which cost a microcode assist wherever an f32 subnormal is computed on).
    for_outliers::<Int8>(rng);
    for_outliers::<Fp8E4m3>(rng);
    let dots = dot_rates();
    if !dots.is_empty() {
        let each: Vec<String> = dots.iter().map(|(n, r)| format!("{n} {r:.2}")).collect();
        println!(
            "dot products, one thread, instructions per vfmadd231ps's time (the same loop): {}",
            each.join(", ")
        );
    }
    let (peak, amx) = (fma_peak(), amx_peak());
    println!(
        "chunked prefill, 512 new tokens after 1536 (causal); FMA peak {:.1} GFLOP/s per thread{}:",
        peak / 1e9,
        amx.map(|a| format!(", AMX bf16 peak {:.0}", a / 1e9))
            .unwrap_or_default()
    );
    prefill::<f32>(pool, peak, amx, rng);
    prefill::<f16>(pool, peak, amx, rng);
    prefill::<bf16>(pool, peak, amx, rng);
    prefill::<Int8>(pool, peak, amx, rng);
    prefill::<Fp8E4m3>(pool, peak, amx, rng);
}

/// [`overlap_ceiling`] of a stream: 256 MiB of random bytes, a contiguous part per
/// thread, against the read probe over them. The curve the table's rows are read
/// against.
fn streaming_ceiling(pool: &WorkerPool, rng: &mut StdRng) -> Vec<(f64, f64)> {
    println!(
        "overlap ceiling: the probe's streaming loop with arithmetic on what it reads, out of cache against the probe in the same rounds:"
    );
    let big: Vec<u8> = (0..256 << 20).map(|_| rng.random()).collect();
    let small: Vec<u8> = (0..512 << 10).map(|_| rng.random()).collect();
    // The probe's own parts, whole lines of them.
    let parts: Vec<Vec<(usize, usize)>> = (0..pool.threads())
        .map(|t| thread_part(big.len(), pool.threads(), t))
        .map(|(start, len)| vec![(start, len / 64 * 64)])
        .collect();
    overlap_ceiling(pool, &big, &parts, &|| read_probe(&big, pool), &small)
}

/// [`overlap_ceiling`] in a decode's order: the synthetic kernel over the tiles of a
/// bf16 decode of 32 × 2048 tokens, task by task ([`PagedCall::decode_ranges`]), against
/// the streaming probe over the same arena. On the development VM the two curves,
/// read at the same arithmetic, lay within about 4 points of each other, either way
/// (for example 77% at arithmetic 0.97 paged, 78% streaming; 51% at 0.56 and 0.58): the
/// paged layout's 4 KiB tiles in shuffled order cost the overlap nothing, and a kernel
/// under the streaming curve loses its points to its own structure.
fn paged_ceiling(pool: &WorkerPool, rng: &mut StdRng) {
    println!(
        "overlap ceiling in the decode's order (bf16, 32 x 2048), against the streaming probe:"
    );
    let call = PagedCall::<bf16>::new(KV_HEADS, HEAD_DIM, BLOCK, Q_HEADS, 32, 2048, 1, rng);
    let tasks = call.decode_ranges(PROBE_HEADS);
    let small: Vec<u8> = (0..512 << 10).map(|_| rng.random()).collect();
    overlap_ceiling(
        pool,
        call.bytes(),
        &tasks,
        &|| read_probe(call.bytes(), pool),
        &small,
    );
}

fn main() {
    let threads = std::env::var("KVPAGE_BENCH_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    let pool = WorkerPool::new(threads);
    let mut rng = StdRng::seed_from_u64(7);
    println!("cpu: {}", cpu());
    println!(
        "kernel path: {}; {} threads; {Q_HEADS} q heads / {KV_HEADS} kv heads, head dim {HEAD_DIM}, block size {BLOCK}, {TOKENS_PER_CALL} tokens per call, median of {ITERS}",
        instruction_path(),
        pool.threads()
    );
    // The ceilings alone (no kernel): a quick look at how this machine overlaps
    // arithmetic with memory, streaming and in a decode's paged order.
    let ceilings_only = std::env::var_os(CEILINGS_ONLY_ENV).is_some();
    if !ceilings_only {
        in_cache_and_prefill(&pool, &mut rng);
    }
    probe_check(&pool, &mut rng);
    let curve = streaming_ceiling(&pool, &mut rng);
    if ceilings_only {
        paged_ceiling(&pool, &mut rng);
        return;
    }
    println!(
        "{:<7} {:>7} {:>5} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11} {:>9} {:>8} {:>8} {:>7} {:>6}",
        "dtype",
        "context",
        "seqs",
        "MiB",
        "decode ms",
        "GB/s",
        "probe",
        "of probe",
        "(best)",
        "paged",
        "of paged",
        "arithmetic",
        "ceiling",
        "loaded",
        "of ceil.",
        "quiet",
        "rounds"
    );
    let contexts = numeric_args(0);
    let contexts = if contexts == [0] {
        vec![512, 2048, 8192]
    } else {
        contexts
    };
    let mut rows = Vec::new();
    for context in contexts {
        rows.push(row::<f32>(context, &pool, &mut rng));
        rows.push(row::<f16>(context, &pool, &mut rng));
        rows.push(row::<bf16>(context, &pool, &mut rng));
        rows.push(row::<Int8>(context, &pool, &mut rng));
        rows.push(row::<Fp8E4m3>(context, &pool, &mut rng));
    }
    for r in &rows {
        let same = rows.iter().filter(|o| o.dtype == r.dtype);
        let quiet_median = same.map(|o| o.quiet_median).min().unwrap();
        r.print(&curve, quiet_median);
    }
}
