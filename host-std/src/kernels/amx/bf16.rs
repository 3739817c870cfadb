//! bf16 storage in AMX tiles (`tdpbf16ps`): the scores and the value accumulation of
//! four query rows, 16 tokens a call, the keys and values loaded as tiles straight
//! from the stored layout.
//!
//! The products are of bf16 numbers, so the f32 operands (scaled queries, softmax
//! weights) go in as two bf16 parts, `x ≈ hi + lo` with `hi` the nearest bf16 to `x`
//! and `lo` the nearest to `x - hi`: a relative error of at most 2^-16 per operand
//! (the tile products flush subnormal operands to zero, so below about 2^-118, where
//! `lo` is one, `hi` alone: 2^-8). The two parts are separate columns (scores) or rows
//! (accumulation) of one tile product and are added after it. On the attention
//! tests' shapes the outputs stay within 1e-5 of the f64 reference (the f32 arithmetic
//! within 1e-6; this one up to 1.1e-6 off).
//!
//! - **Scores**: `C[token][col] = Σ_d K[token][d] · B[d][col]`, A the keys as stored
//!   (16 tokens × 32 dimensions, a tile per 32 dimensions), B the four rows' query
//!   parts in the form [`to_query_tiles`] writes, 8 columns.
//! - **Accumulation**: `C[row][j] = Σ_t W[row][t] · V[t][j]`, B the values as stored
//!   (16 tokens × 32 dimensions, 16 pairs of dimensions), A the weights with each
//!   token's weight in one half of its pair and zero in the other: rows whose weight
//!   is in the low half sum the even dimensions, rows with it in the high half the
//!   odd ones, so the sums come out in [`super::super::lanes`]'s split order (16 even
//!   dimensions, then 16 odd, per group of 32). [`accumulate4`] takes 16 tokens a
//!   call; [`accumulate_runs4`] a chunk's (decode), the sums of each group kept in a
//!   tile across its 16-token tiles.

use core::arch::x86_64::*;

use super::runs::{self, ChunkTiles, StoredTile, CHUNK_TILES, TOKENS};
use super::tiles::{self, tmm};
use crate::dtype::Element;
use crate::kernels::MAX_HEAD_DIM;

/// Dimensions per tile of keys or values (64 bytes of bf16).
pub(in crate::kernels) const GROUP: usize = 32;
/// Query rows per call.
pub(in crate::kernels) const ROWS: usize = 4;
/// 32-bit words of one group's query tile: 16 dimension pairs × 8 columns.
const QUERY_TILE_WORDS: usize = (GROUP / 2) * 2 * ROWS;

/// Rewrites each group of four query rows (`rows`: a multiple of `4 * hd` floats, `hd`
/// a multiple of [`GROUP`]) as their B tiles for [`scores4`]: per group of 32
/// dimensions, 16 rows of pairs (dimensions `2i`, `2i + 1`) × 8 columns (the four
/// rows' high parts, then their low parts), 512 bytes, one after another; the four
/// rows' `4 * hd` floats hold exactly the `hd / 32` tiles. Rows past the last whole
/// group of four are left alone. O(rows.len()).
///
/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(in crate::kernels) unsafe fn to_query_tiles(rows: &mut [f32], hd: usize) {
    debug_assert!(hd.is_multiple_of(GROUP) && hd <= MAX_HEAD_DIM);
    for four in rows.chunks_exact_mut(ROWS * hd) {
        let mut src = [0.0f32; ROWS * MAX_HEAD_DIM];
        src[..ROWS * hd].copy_from_slice(four);
        for g in 0..hd / GROUP {
            // `cols[part * 4 + r][i]`: the pair `i` of row `r`'s part.
            let mut cols = [[0u32; 16]; 2 * ROWS];
            for r in 0..ROWS {
                let x = &src[r * hd + g * GROUP..][..GROUP];
                // SAFETY: `x` holds 32 floats; AVX-512F (caller).
                let (a, b) = unsafe {
                    (
                        _mm512_loadu_ps(x.as_ptr()),
                        _mm512_loadu_ps(x.as_ptr().add(16)),
                    )
                };
                // SAFETY: AVX-512F (caller).
                let (hi_a, hi_b) = unsafe { (nearest_bf16(a), nearest_bf16(b)) };
                // SAFETY: as above.
                let (lo_a, lo_b) = unsafe {
                    (
                        nearest_bf16(_mm512_sub_ps(a, _mm512_castsi512_ps(hi_a))),
                        nearest_bf16(_mm512_sub_ps(b, _mm512_castsi512_ps(hi_b))),
                    )
                };
                for (part, (pa, pb)) in [(hi_a, hi_b), (lo_a, lo_b)].into_iter().enumerate() {
                    // Each lane's bf16 (its top 16 bits) narrowed to 16: the pairs'
                    // words, even dimension low.
                    let words = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(pa))),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(pb)),
                    );
                    // SAFETY: 16 words into a row of `cols`.
                    unsafe {
                        _mm512_storeu_si512(cols[part * ROWS + r].as_mut_ptr().cast(), words)
                    };
                }
            }
            let tile = &mut four[g * QUERY_TILE_WORDS..(g + 1) * QUERY_TILE_WORDS];
            for (at, x) in tile.iter_mut().enumerate() {
                *x = f32::from_bits(cols[at % 8][at / 8]);
            }
        }
    }
}

/// 16 rows of 64 bytes, aligned to a cache line: a tile's worth of memory.
#[repr(C, align(64))]
pub(super) struct TileRows(pub(super) [[u32; 16]; TOKENS]);

/// The sums of the parts of tokens `2i` and `2i + 1` of the scores tile `c` (eight
/// columns: rows 0-3's high parts, then their low parts): a vector of blocks [token
/// `2i`, token `2i`, token `2i + 1`, token `2i + 1`], each a row per lane.
///
/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn pair_sums(c: &TileRows, i: usize) -> __m512 {
    // SAFETY: rows `2i` and `2i + 1` of `c` hold 16 floats each (`i < 8`, the caller's).
    let (a, b) = unsafe {
        (
            _mm256_loadu_pd(c.0[2 * i].as_ptr().cast()),
            _mm256_loadu_pd(c.0[2 * i + 1].as_ptr().cast()),
        )
    };
    let z = _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(a), b));
    // Blocks [t hi, t lo, t+1 hi, t+1 lo] + [t lo, t hi, t+1 lo, t+1 hi].
    _mm512_add_ps(z, _mm512_shuffle_f32x4::<0b10_11_00_01>(z, z))
}

/// `x` rounded to the nearest bf16 (ties to even), as f32 bits: finite weights, or NaN
/// (which stays NaN: a quiet NaN's top payload bit is set). O(1).
///
/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn nearest_bf16(x: __m512) -> __m512i {
    let b = _mm512_castps_si512(x);
    let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
    let up = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    _mm512_and_si512(up, _mm512_set1_epi32(-65536))
}

/// Scores of four query rows against `n` keys: `s[r * stride + t] = q_r · k_t`.
///
/// # Safety
/// [`tiles::configure`] ran on this thread (which implies AVX-512F and BW); `q` is four
/// rows in the form [`to_query_tiles`] writes; `k` holds `n` keys of `hd` bf16 (`T` is
/// bf16), `1 <= n <= 16`; `hd` is a non-zero multiple of 32 within `MAX_HEAD_DIM`;
/// `s` holds `3 * stride + n` floats.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn scores4<T: Element>(
    q: &[f32],
    k: &[T],
    hd: usize,
    n: usize,
    s: &mut [f32],
    stride: usize,
) {
    // The memory the tiles and vectors below touch (checked: a few comparisons a call).
    assert!((1..=TOKENS).contains(&n) && hd.is_multiple_of(GROUP) && hd <= MAX_HEAD_DIM);
    assert!(q.len() >= ROWS * hd && k.len() >= n * hd && s.len() >= 3 * stride + n);
    let mut copy = core::mem::MaybeUninit::uninit();
    let StoredTile {
        start: keys,
        stride: key_stride,
    } = runs::one_run(k, n, hd, &mut copy);
    let groups = hd / GROUP;
    let mut c = core::mem::MaybeUninit::<TileRows>::uninit();
    // SAFETY: configured (caller). Key tile `g`: 16 rows of 64 bytes at `keys + 64 g`,
    // inside the keys (or the copy); query tile `g`: 16 rows of 32 bytes at `q + 512
    // g`, inside the four rows' `4 * hd` floats (`hd / 32` tiles of 512 bytes); `c` is
    // 16 rows of 32 bytes at a stride of 64.
    unsafe {
        let (q, c) = (q.as_ptr().cast(), c.as_mut_ptr().cast());
        tiles::scores_tile::<false>(keys, key_stride, q, groups, c);
    }
    // SAFETY: the tile store wrote the first 32 bytes of each of `c`'s rows, the only
    // ones read below (integers and floats have no invalid bit patterns).
    let c = unsafe { c.assume_init_ref() };
    // `c[t]`: token `t`'s eight columns (rows 0-3 high parts, then low parts), the
    // parts summed two tokens a vector.
    // SAFETY: AVX-512F (caller); `i < 8`.
    let pairs = core::array::from_fn(|i| unsafe { pair_sums(c, i) });
    // SAFETY: AVX-512F (caller); `s` holds `3 * stride + n` floats (checked).
    unsafe { store_score_rows(&pairs, [1.0; ROWS], n, s, stride) };
}

/// Stores the scores of four rows over `n <= 16` tokens, row `r` times `scale[r]`,
/// into `s[r * stride..][..n]`, from `pairs[i]`: tokens `2i` and `2i + 1`'s four rows,
/// as 128-bit blocks [token `2i`, any, token `2i + 1`, any], a row per lane. The
/// tokens are gathered four to a vector (a row per lane of each block), then each
/// row's 16 picked out. O(1).
///
/// # Safety
/// AVX-512F; `s` holds `3 * stride + n` floats.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn store_score_rows(
    pairs: &[__m512; 8],
    scale: [f32; ROWS],
    n: usize,
    s: &mut [f32],
    stride: usize,
) {
    debug_assert!(n <= TOKENS && s.len() >= 3 * stride + n);
    // Tokens 4j .. 4j + 4, a block each.
    let sums: [__m512; 4] = core::array::from_fn(|j| {
        _mm512_shuffle_f32x4::<0b10_00_10_00>(pairs[2 * j], pairs[2 * j + 1])
    });
    let mask: __mmask16 = if n == TOKENS { 0xFFFF } else { (1 << n) - 1 };
    // Lane `r` of each block of two vectors: eight tokens (the two halves the same).
    let lanes = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    for (r, scale) in scale.into_iter().enumerate() {
        let pick = _mm512_add_epi32(lanes, _mm512_set1_epi32(r as i32));
        let low = _mm512_permutex2var_ps(sums[0], pick, sums[1]);
        let high = _mm512_permutex2var_ps(sums[2], pick, sums[3]);
        let row = _mm512_shuffle_f32x4::<0b01_00_01_00>(low, high);
        let row = _mm512_mul_ps(row, _mm512_set1_ps(scale));
        // SAFETY: `s` holds `r * stride + n` floats (caller); lanes past `n` are masked.
        unsafe { _mm512_mask_storeu_ps(s.as_mut_ptr().add(r * stride), mask, row) };
    }
}

/// Writes the weights tile of `n <= 16` tokens into `w`: row `8 · odd + 4 · part + r`,
/// token `t`'s pair holding the part of `p[r][t]` in its low half (even dimensions) or
/// high half (odd ones); tokens past `n` weigh zero. O(1).
///
/// # Safety
/// AVX-512F; each `p[r]` holds `n` weights.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn weights_tile(p: [&[f32]; ROWS], n: usize, w: &mut core::mem::MaybeUninit<TileRows>) {
    let mask: __mmask16 = if n == TOKENS { 0xFFFF } else { (1 << n) - 1 };
    let rows: *mut u32 = w.as_mut_ptr().cast();
    for (r, pr) in p.iter().enumerate() {
        // SAFETY: `n` weights readable (caller), the rest masked; AVX-512F (caller).
        let (hi, lo) = unsafe {
            let x = _mm512_maskz_loadu_ps(mask, pr.as_ptr());
            let hi = nearest_bf16(x);
            (hi, nearest_bf16(_mm512_sub_ps(x, _mm512_castsi512_ps(hi))))
        };
        for (row, part) in [(r, hi), (ROWS + r, lo)] {
            // SAFETY: 64 bytes into rows `row` and `8 + row` of `w` (every row of the
            // 16 is written, once, by this loop).
            unsafe {
                _mm512_storeu_si512(rows.add(16 * row).cast(), _mm512_srli_epi32::<16>(part));
                _mm512_storeu_si512(rows.add(16 * (2 * ROWS + row)).cast(), part);
            }
        }
    }
}

/// Adds the sums tile of group `g` (as stored from a product with a [`weights_tile`]:
/// each row's high and low parts, even and odd dimensions) into the four accumulator
/// rows of `acc` (`hd` floats each, split order). O(1).
///
/// # Safety
/// AVX-512F; `sums` is 16 rows of 16 floats, all written; `acc` holds four rows of
/// `hd`, and group `g` is inside them.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn add_sums(acc: &mut [f32], sums: *const f32, hd: usize, g: usize) {
    debug_assert!(acc.len() >= ROWS * hd && (g + 1) * GROUP <= hd);
    // SAFETY: as the caller promises; AVX-512F (caller).
    unsafe {
        for r in 0..ROWS {
            for odd in 0..2 {
                let (high, low) = (8 * odd + r, 8 * odd + ROWS + r);
                let sum = _mm512_add_ps(
                    _mm512_loadu_ps(sums.add(16 * high)),
                    _mm512_loadu_ps(sums.add(16 * low)),
                );
                let a = acc.as_mut_ptr().add(r * hd + g * GROUP + 16 * odd);
                _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), sum));
            }
        }
    }
}

/// `acc_r[d] += Σ_{t<n} p[r][t] · v_t[d]` for the four rows `acc_r = acc[r * hd..]`,
/// in split order.
///
/// # Safety
/// [`tiles::configure`] ran on this thread (which implies AVX-512F and BW); `v` holds
/// `n` values of `hd` bf16 (`T` is bf16), `1 <= n <= 16`; each `p[r]` holds `n`
/// weights; `hd` is a non-zero multiple of 32 within `MAX_HEAD_DIM`; `acc` holds four
/// rows.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn accumulate4<T: Element>(
    acc: &mut [f32],
    p: [&[f32]; ROWS],
    v: &[T],
    hd: usize,
    n: usize,
) {
    // The memory the tiles and vectors below touch (checked: a few comparisons a call).
    assert!((1..=TOKENS).contains(&n) && hd.is_multiple_of(GROUP) && hd <= MAX_HEAD_DIM);
    assert!(acc.len() >= ROWS * hd && v.len() >= n * hd && p.iter().all(|p| p.len() >= n));
    let mut w = core::mem::MaybeUninit::<TileRows>::uninit();
    // SAFETY: AVX-512F (caller); `n` weights a row (checked).
    unsafe { weights_tile(p, n, &mut w) };
    let mut copy = core::mem::MaybeUninit::uninit();
    let StoredTile {
        start: values,
        stride,
    } = runs::one_run(v, n, hd, &mut copy);
    let mut c = [const { core::mem::MaybeUninit::<TileRows>::uninit() }; 2];
    let sums: [*mut f32; 2] = [c[0].as_mut_ptr().cast(), c[1].as_mut_ptr().cast()];
    // The product of group `g` into `sums[g % 2]`, through the registers of its parity.
    // SAFETY (of each call): configured (caller); value tile `g` is 16 rows of 64 bytes
    // at `values + 64 g`, inside the values (or the padded copy); each `c` is 16 rows
    // of 64 bytes.
    let product = |g: usize| unsafe {
        let v = values.add(64 * g);
        if g.is_multiple_of(2) {
            tiles::zero::<{ tmm::SUMS[0] }>();
            tiles::load::<{ tmm::STORED[0] }>(v, stride);
            tiles::dot_bf16::<{ tmm::SUMS[0] }, { tmm::WEIGHTS }, { tmm::STORED[0] }>();
            tiles::store::<{ tmm::SUMS[0] }>(sums[0].cast(), 64);
        } else {
            tiles::zero::<{ tmm::SUMS[1] }>();
            tiles::load::<{ tmm::STORED[1] }>(v, stride);
            tiles::dot_bf16::<{ tmm::SUMS[1] }, { tmm::WEIGHTS }, { tmm::STORED[1] }>();
            tiles::store::<{ tmm::SUMS[1] }>(sums[1].cast(), 64);
        }
    };
    // SAFETY: configured (caller); `w` is 16 rows of 64 bytes, all written above.
    unsafe { tiles::load::<{ tmm::WEIGHTS }>(w.as_ptr().cast(), 64) };
    let groups = hd / GROUP;
    product(0);
    for g in 0..groups {
        // The next group's product goes ahead while this group's sums are added in.
        if g + 1 < groups {
            product(g + 1);
        }
        // SAFETY: every row of `sums[g % 2]` was written by group `g`'s tile store;
        // `acc` holds four rows of `hd` (checked); AVX-512F (caller).
        unsafe { add_sums(acc, sums[g % 2], hd, g) };
    }
}

/// `acc_r[d] += Σ_{t<n} p[r][t] · v_t[d]` for the four rows `acc_r = acc[r * hd..]`, in
/// split order, over the first `n <= 64` tokens of `runs` (runs of whole vectors of
/// `hd` bf16, in token order: a chunk's of one KV head), calling `step` after each 16.
///
/// The sums are chained: each group of dimensions has its own sums tile
/// ([`tmm::GROUP_SUMS`], four groups at a time), which adds up every 16 tokens of the
/// call and is stored and added into the accumulators once. [`accumulate4`] over each
/// 16 tokens stores and adds them once per 16 tokens, which took 14% of a bf16 decode's
/// samples (`tilestored` waits for its product). Paired medians, decode of 32 query
/// heads over 8 KV heads, head dim 128, blocks of 16, Emerald Rapids: 0.88 and 0.90 of
/// the time in cache (1 × 256 tokens, one thread, 15 and 11 rounds), 0.95 to 1.01 out
/// of cache (32 × 2048, two threads, three sets of 11 to 13 rounds; the host's
/// bandwidth swung between runs by 1.5 times).
///
/// A tile of 16 tokens inside one run is loaded where it is stored; a tile across runs
/// (blocks of fewer than 16 tokens, or a block boundary inside a tile), or the last,
/// partial one, is first copied onto the stack, rows past the tokens zero. O(n × hd).
///
/// # Safety
/// [`tiles::configure`] ran on this thread (which implies AVX-512F and BW); `T` is
/// bf16; `hd` is a non-zero multiple of 32 within `MAX_HEAD_DIM`; each `p[r]` holds
/// `n` weights; `acc` holds four rows.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
pub(in crate::kernels) unsafe fn accumulate_runs4<T: Element, F: FnMut()>(
    acc: &mut [f32],
    p: [&[f32]; ROWS],
    runs: &[&[T]],
    n: usize,
    hd: usize,
    step: &mut F,
) {
    // The memory the tiles and vectors below touch (checked: a few comparisons a call).
    assert!(n <= CHUNK_TILES * TOKENS && hd.is_multiple_of(GROUP) && hd <= MAX_HEAD_DIM);
    assert!(acc.len() >= ROWS * hd && p.iter().all(|p| p.len() >= n));
    let mut chunk = ChunkTiles::new();
    let (tiles, tokens) = chunk.gather(runs, n, hd);
    if tokens == 0 {
        return;
    }
    let count = tiles.len();
    let mut w = [const { core::mem::MaybeUninit::<TileRows>::uninit() }; CHUNK_TILES];
    for (i, w) in w.iter_mut().enumerate().take(count) {
        let m = (tokens - i * TOKENS).min(TOKENS);
        // SAFETY: AVX-512F (caller); `tokens <= n` weights a row (checked).
        unsafe { weights_tile(p.map(|p| &p[i * TOKENS..]), m, w) };
    }
    let mut c = core::mem::MaybeUninit::<TileRows>::uninit();
    let sums: *mut f32 = c.as_mut_ptr().cast();
    let groups = hd / GROUP;
    for g0 in (0..groups).step_by(4) {
        let chained = (groups - g0).min(4);
        // SAFETY: configured (caller). Value tile `i`'s group `g` is 16 rows of 64
        // bytes at `tiles[i].start + 64 g`: inside its run, or inside its copy (rows
        // with tokens copied, the rest zeroed above); weights tile `i` was written
        // above; `c` is 16 rows of 64 bytes.
        unsafe {
            for j in 0..chained {
                group_sums(j, GroupSums::Zero);
            }
            for (tile, w) in tiles.iter().zip(&w).take(count) {
                let (at, stride) = (tile.start.add(64 * g0), tile.stride);
                tiles::load::<{ tmm::WEIGHTS }>(w.as_ptr().cast(), 64);
                for j in 0..chained {
                    group_sums(j, GroupSums::Add(at.add(64 * j), stride));
                }
                if g0 == 0 {
                    step();
                }
            }
            for j in 0..chained {
                group_sums(j, GroupSums::Store(sums));
                add_sums(acc, sums, hd, g0 + j);
            }
        }
    }
}

/// What [`group_sums`] does with a sums tile of [`tmm::GROUP_SUMS`].
#[derive(Clone, Copy)]
enum GroupSums {
    /// Zeroes it.
    Zero,
    /// `S += W · V`, `V` the 16 rows of 64 bytes from the pointer, the stride apart,
    /// loaded into [`tmm::VALUES`], and `W` in [`tmm::WEIGHTS`].
    Add(*const u8, usize),
    /// Stores it as 16 rows of 64 bytes.
    Store(*mut f32),
}

/// `op` on sums tile `j < 4` of [`tmm::GROUP_SUMS`] (a tile register is named in the
/// instruction, so each is its own branch). O(1).
///
/// # Safety
/// [`tiles::configure`] ran on this thread; `Add`'s rows are readable, `Store`'s
/// writable.
#[inline(always)]
unsafe fn group_sums(j: usize, op: GroupSums) {
    /// `op` on sums tile `S`.
    #[inline(always)]
    unsafe fn on<const S: u8>(op: GroupSums) {
        // SAFETY: the caller's.
        unsafe {
            match op {
                GroupSums::Zero => tiles::zero::<S>(),
                GroupSums::Add(values, stride) => {
                    tiles::load::<{ tmm::VALUES }>(values, stride);
                    tiles::dot_bf16::<S, { tmm::WEIGHTS }, { tmm::VALUES }>();
                }
                GroupSums::Store(sums) => tiles::store::<S>(sums.cast(), 64),
            }
        }
    }
    // SAFETY: the caller's.
    unsafe {
        match j {
            0 => on::<{ tmm::GROUP_SUMS[0] }>(op),
            1 => on::<{ tmm::GROUP_SUMS[1] }>(op),
            2 => on::<{ tmm::GROUP_SUMS[2] }>(op),
            _ => on::<{ tmm::GROUP_SUMS[3] }>(op),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The two tile kernels against plain f64 sums on random inputs, at every head dim
    //! class (one group of 32, an odd number of groups, the largest) and tile fill (one
    //! token, a partial tile, a whole one), on CPUs that have the tiles.
    use super::*;
    use crate::kernels::amx::check::{
        accumulation_error, begun, chunk_runs, token_of, worst, CHUNK_SHAPES,
    };
    use half::bf16;
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};

    #[test]
    fn tiles_match_f64_sums() {
        let Some(amx) = begun() else { return };
        let mut rng = StdRng::seed_from_u64(11);
        for hd in [32, 96, 128, 256] {
            for n in [1, 7, 16] {
                let q: Vec<f32> = (0..ROWS * hd)
                    .map(|_| rng.random_range(-2.0..2.0))
                    .collect();
                let k: Vec<bf16> = (0..n * hd)
                    .map(|_| bf16::from_f32(rng.random_range(-3.0..3.0)))
                    .collect();
                let v: Vec<bf16> = (0..n * hd)
                    .map(|_| bf16::from_f32(rng.random_range(-3.0..3.0)))
                    .collect();
                let p: Vec<Vec<f32>> = (0..ROWS)
                    .map(|_| (0..n).map(|_| rng.random_range(0.0..1.0)).collect())
                    .collect();

                // Scores: `s[r * stride + t]`, against Σ q·k and its Σ |q·k| scale.
                let stride = 20;
                let mut tiles_q = q.clone();
                // SAFETY: `detect` found AVX-512F.
                unsafe { to_query_tiles(&mut tiles_q, hd) };
                let mut s = vec![f32::NAN; 3 * stride + 16];
                // SAFETY: configured above; the shapes are the kernel's.
                unsafe { scores4(&tiles_q, &k, hd, n, &mut s, stride) };
                let (mut want, mut scale, mut got) = (vec![], vec![], vec![]);
                for r in 0..ROWS {
                    for t in 0..n {
                        let terms =
                            (0..hd).map(|d| f64::from(q[r * hd + d]) * f64::from(k[t * hd + d]));
                        want.push(terms.clone().sum::<f64>());
                        scale.push(terms.map(f64::abs).sum::<f64>());
                        got.push(s[r * stride + t]);
                    }
                    // Past `n` tokens, nothing is written.
                    let past = if r < ROWS - 1 { stride } else { 16 };
                    assert!(s[r * stride + n..r * stride + past]
                        .iter()
                        .all(|x| x.is_nan()));
                }
                let err = worst(&got, &want, &scale);
                assert!(err < 4e-5, "scores hd {hd} n {n}: {err:e}");

                // Accumulation into random accumulators in split order, against
                // `acc + Σ p · v` (in dimension order) and its Σ |p · v| scale.
                let acc0: Vec<f32> = (0..ROWS * hd)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let mut acc = acc0.clone();
                crate::kernels::lanes::to_split_order::<GROUP, 2>(&mut acc);
                let rows = [&p[0][..], &p[1][..], &p[2][..], &p[3][..]];
                // SAFETY: configured above; the shapes are the kernel's.
                unsafe { accumulate4(&mut acc, rows, &v, hd, n) };
                crate::kernels::lanes::from_split_order::<GROUP, 2>(&mut acc);
                let value = |t: usize, d: usize| f64::from(v[t * hd + d]);
                let err = accumulation_error(&acc, &acc0, &p, value, n, hd, |r, t| p[r][t].into());
                assert!(err < 4e-5, "accumulation hd {hd} n {n}: {err:e}");
            }
        }
        amx.end();
    }

    /// The chained accumulation over runs of every shape a chunk can have
    /// ([`CHUNK_SHAPES`], the vectors past the tokens asked for NaN) at head dims of
    /// one, three, four and eight groups, against f64 sums; and one `step` per tile.
    #[test]
    fn chained_runs_match_f64_sums() {
        let Some(amx) = begun() else { return };
        let mut rng = StdRng::seed_from_u64(12);
        for hd in [32, 96, 128, 256] {
            for (lens, n) in CHUNK_SHAPES {
                // The vectors past the `n`th NaN.
                let fresh = || bf16::from_f32(rng.random_range(-3.0..3.0));
                let runs = chunk_runs(lens, n, hd, fresh, bf16::NAN);
                let p: Vec<Vec<f32>> = (0..ROWS)
                    .map(|_| (0..n).map(|_| rng.random_range(0.0..1.0)).collect())
                    .collect();
                let acc0: Vec<f32> = (0..ROWS * hd)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let mut acc = acc0.clone();
                crate::kernels::lanes::to_split_order::<GROUP, 2>(&mut acc);
                let slices: Vec<&[bf16]> = runs.iter().map(|r| &r[..]).collect();
                let rows = [&p[0][..], &p[1][..], &p[2][..], &p[3][..]];
                let mut steps = 0;
                // SAFETY: configured above; the shapes are the kernel's.
                unsafe { accumulate_runs4(&mut acc, rows, &slices, n, hd, &mut || steps += 1) };
                assert_eq!(steps, n.div_ceil(TOKENS), "hd {hd} runs {lens:?}");
                crate::kernels::lanes::from_split_order::<GROUP, 2>(&mut acc);
                let value = |t: usize, d: usize| f64::from(token_of(&runs, t, hd)[d]);
                let err = accumulation_error(&acc, &acc0, &p, value, n, hd, |r, t| p[r][t].into());
                assert!(err < 4e-5, "hd {hd} runs {lens:?} n {n}: {err:e}");
            }
        }
        amx.end();
    }
}
