//! Int8 storage in AMX-INT8 tiles: the scores and the value accumulation of four query
//! rows as byte products with 32-bit integer sums, the keys and values loaded as tiles
//! straight from the stored layout (16 tokens × 64 codes).
//!
//! The f32 side is put in 16-bit fixed point, as the VNNI arithmetic does
//! ([`crate::kernels::lanes::int8_vnni`]), and each 16-bit code goes in as its two
//! bytes, `c = 256 hi + lo`, the two parts summed after the tile product: every
//! product and sum is exact, so the arithmetic's only error is the rounding of the
//! queries and weights to their codes (at most `2^-16` of the row's largest), as on
//! VNNI.
//!
//! - **Scores**: `C[token][col] = Σ_d K[token][d] · B[d][col]` (`tdpbssd`), A the keys
//!   as stored, B the four rows' query bytes in the form [`to_query_tiles`] writes, 8
//!   columns: the rows' high bytes, then their low bytes, both signed (`lo` in
//!   `-128..=127`, so codes stop at `127 · 256 + 127` = 32639).
//! - **Accumulation**: `C[m][j] = Σ_t Σ_{i<4} W[m][4t + i] · V[t][4j + i]`
//!   (`tdpbusd`), B the values as stored (16 tokens × 16 quads of dimensions), A a
//!   weights tile whose row `4 · phase + r` holds row `r`'s weight byte of token `t`
//!   at `4t + phase` and zero at the three other bytes: so that row sums dimensions
//!   `4j + phase`, and the sums come out in the split order of four parts
//!   ([`crate::kernels::lanes::to_split_order`] `<64, 4>`). The weights' high and low
//!   bytes (both unsigned: codes up to 32767) are two tiles and two products.
//!   Three quarters of A's bytes are zero, which costs tile-product time only: the
//!   values need no reordering. (That time is small: a build without the low parts'
//!   products, half of them, took 0.97-1.0 of the time in cache.)
//!
//! The sums of a chunk's tiles (up to 64 tokens) stay in two sums tiles (the two
//! parts of one group of 64 dimensions, a group after another), stored and scaled into
//! the accumulators once a chunk, as bf16's chained sums
//! ([`super::bf16::accumulate_runs4`]). The two weight tiles and the values have
//! registers of their own ([`tmm::PART_WEIGHTS`], [`tmm::PART_VALUES`], alternating):
//! with one weights register for both parts, its loads waited on the products before
//! them, and took a fifth of the in-cache time. Within 32 bits: a high part's sum is
//! at most `64 · 127 · 128 < 2^20`, times 256 under `2^28`.

use core::arch::x86_64::*;
use core::mem::MaybeUninit;

use super::bf16::{store_score_rows, TileRows, ROWS};
use super::runs::{self, ChunkTiles, StoredTile, CHUNK_TILES, TOKENS};
use super::tiles::{self, tmm};
use crate::dtype::Element;
use crate::kernels::lanes::fixed16::fixed_point_to;
use crate::kernels::MAX_HEAD_DIM;

/// Dimensions per tile of keys or values (64 bytes of codes).
pub(in crate::kernels) const GROUP: usize = 64;
/// Dimensions a row of a values tile holds per column of sums (the split order's
/// parts).
pub(in crate::kernels) const PHASES: usize = 4;
/// The largest query code: both bytes signed.
const QUERY_ONE: f32 = 32639.0;
/// The largest weight code: both bytes unsigned.
const WEIGHT_ONE: f32 = 32767.0;
/// Floats of one group's query tile: 16 quads of dimensions × 8 columns of 4 bytes.
const QUERY_TILE_FLOATS: usize = GROUP / 4 * 8;

/// Rewrites each group of four query rows (`rows`: a multiple of `4 * hd` floats, `hd`
/// a multiple of [`GROUP`]) as the B tiles [`scores4`] reads: per group of 64
/// dimensions, 16 rows (dimensions `4i .. 4i + 4`) × 8 columns of 4 bytes (the four
/// rows' high bytes, then their low bytes), 512 bytes, one after another; then the
/// four rows' scales (NaN for a row with a non-finite element). The four rows' `4 *
/// hd` floats hold the `hd / 64` tiles and the scales with room to spare. Rows past
/// the last whole group of four are left alone. O(rows.len()).
///
/// # Safety
/// AVX-512F and BW.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(in crate::kernels) unsafe fn to_query_tiles(rows: &mut [f32], hd: usize) {
    assert!(hd.is_multiple_of(GROUP) && hd <= MAX_HEAD_DIM);
    let groups = hd / GROUP;
    for four in rows.chunks_exact_mut(ROWS * hd) {
        let mut words = [0u32; MAX_HEAD_DIM / 4 * 8];
        let mut scales = [0.0f32; ROWS];
        for (r, x) in four.chunks_exact(hd).enumerate() {
            // SAFETY: AVX-512F (caller).
            let (max, finite) = unsafe { largest::<true>(x) };
            let (scale, inv) = fixed_point_to(max, finite, QUERY_ONE);
            scales[r] = scale;
            let inv = _mm512_set1_ps(inv);
            for (at, d) in x.chunks_exact(16).enumerate() {
                // SAFETY: `d` holds 16 floats; AVX-512F (caller).
                let v = unsafe { _mm512_loadu_ps(d.as_ptr()) };
                let code = _mm512_cvt_roundps_epi32::<
                    { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                >(_mm512_mul_ps(v, inv));
                // Within ±32639: `lo` in -128..=127 and `hi` in -127..=127, each the
                // low byte of its lane.
                let low = _mm512_sub_epi32(
                    _mm512_and_si512(
                        _mm512_add_epi32(code, _mm512_set1_epi32(128)),
                        _mm512_set1_epi32(255),
                    ),
                    _mm512_set1_epi32(128),
                );
                let high = _mm512_srai_epi32::<8>(_mm512_sub_epi32(code, low));
                // Four quads of dimensions: a word each of high and of low bytes.
                let (mut hi, mut lo) = ([0u32; 4], [0u32; 4]);
                // SAFETY: 16 bytes into each.
                unsafe {
                    _mm_storeu_si128(hi.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(high));
                    _mm_storeu_si128(lo.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(low));
                }
                for i in 0..4 {
                    let quad = 4 * at + i;
                    words[quad * 8 + r] = hi[i];
                    words[quad * 8 + ROWS + r] = lo[i];
                }
            }
        }
        for (slot, word) in four.iter_mut().zip(&words[..groups * QUERY_TILE_FLOATS]) {
            *slot = f32::from_bits(*word);
        }
        four[groups * QUERY_TILE_FLOATS..][..ROWS].copy_from_slice(&scales);
    }
}

/// The scores of token `2i` and `2i + 1` from the stored scores tile `c` (eight
/// columns of 32-bit sums: rows 0-3's high parts, then their low parts): blocks
/// [token `2i`, any, token `2i + 1`, any] of `256 hi + lo`, a row per lane, as f32.
///
/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn pair_codes(c: &TileRows, i: usize) -> __m512 {
    // SAFETY: rows `2i` and `2i + 1` of `c` hold 16 words each (`i < 8`, the caller's).
    let (a, b) = unsafe {
        (
            _mm256_loadu_si256(c.0[2 * i].as_ptr().cast()),
            _mm256_loadu_si256(c.0[2 * i + 1].as_ptr().cast()),
        )
    };
    let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
    // Blocks [t hi, t lo, t+1 hi, t+1 lo] times 256, plus [t lo, t hi, t+1 lo, t+1 hi].
    let sum = _mm512_add_epi32(
        _mm512_slli_epi32::<8>(z),
        _mm512_shuffle_i32x4::<0b10_11_00_01>(z, z),
    );
    _mm512_cvtepi32_ps(sum)
}

/// Scores of four query rows against `n` keys of codes: `s[r * stride + t] = q_r ·
/// k_t` in code units (the key's scale is the caller's).
///
/// # Safety
/// [`tiles::configure`] ran on this thread and the CPU has AMX-INT8 (which implies
/// AVX-512F and BW); `q` is four rows in the form [`to_query_tiles`] writes; `k` holds
/// `n` keys of `hd` int8 codes, `1 <= n <= 16`; `hd` is a non-zero multiple of 64
/// within `MAX_HEAD_DIM`; `s` holds `3 * stride + n` floats.
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
    assert!(core::mem::size_of::<T>() == 1);
    let mut copy = MaybeUninit::uninit();
    let StoredTile {
        start: keys,
        stride: key_stride,
    } = runs::one_run(k, n, hd, &mut copy);
    let groups = hd / GROUP;
    let mut c = MaybeUninit::<TileRows>::uninit();
    // SAFETY: configured, AMX-INT8 (caller). Key tile `g`: 16 rows of 64 bytes at
    // `keys + 64 g`, inside the keys (or the copy); query tile `g`: 16 rows of 32 bytes
    // at `q + 512 g`, inside the four rows' `4 * hd` floats (`hd / 64` tiles of 512
    // bytes); `c` is 16 rows of 32 bytes at a stride of 64.
    unsafe {
        let (q, c) = (q.as_ptr().cast(), c.as_mut_ptr().cast());
        tiles::scores_tile::<true>(keys, key_stride, q, groups, c);
    }
    // SAFETY: the tile store wrote the first 32 bytes of each of `c`'s rows, the only
    // ones read below (integers have no invalid bit patterns).
    let c = unsafe { c.assume_init_ref() };
    // SAFETY: AVX-512F (caller); `i < 8`.
    let pairs = core::array::from_fn(|i| unsafe { pair_codes(c, i) });
    let scale: [f32; ROWS] = core::array::from_fn(|r| q[groups * QUERY_TILE_FLOATS + r]);
    // SAFETY: AVX-512F (caller); `s` holds `3 * stride + n` floats (checked).
    unsafe { store_score_rows(&pairs, scale, n, s, stride) };
}

/// The largest of `p` (of their magnitudes with `ABS`; without, none may be
/// negative), and whether all are finite. O(p.len()).
///
/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn largest<const ABS: bool>(p: &[f32]) -> (f32, bool) {
    let zero = _mm512_setzero_ps();
    let (mut max, mut poison) = (zero, zero);
    for c in (0..p.len()).step_by(16) {
        let left = p.len() - c;
        let mask: __mmask16 = if left >= 16 { 0xFFFF } else { (1 << left) - 1 };
        // SAFETY: the lanes loaded are `p[c..]`'s, the rest masked.
        let x = unsafe { _mm512_maskz_loadu_ps(mask, p.as_ptr().add(c)) };
        max = _mm512_max_ps(max, if ABS { _mm512_abs_ps(x) } else { x });
        // Stays 0 unless an element is NaN or infinite.
        poison = _mm512_fmadd_ps(x, zero, poison);
    }
    (
        _mm512_reduce_max_ps(max),
        _mm512_reduce_add_ps(poison) == 0.0,
    )
}

/// Writes row `r`'s weights of tile `i` (`m <= 16` tokens from `p`, times `inv`, as
/// codes) into the four rows `4 · phase + r` of `w[0]` (high bytes) and `w[1]` (low
/// bytes): each token's byte at `4t + phase`, zero elsewhere and past `m`. O(1).
///
/// # Safety
/// AVX-512F; `p` holds `m` weights.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn weight_rows(p: &[f32], m: usize, inv: f32, r: usize, w: [*mut u32; 2]) {
    let mask: __mmask16 = if m == TOKENS { 0xFFFF } else { (1 << m) - 1 };
    // SAFETY: `m` weights readable (caller), the rest masked.
    let x = unsafe { _mm512_maskz_loadu_ps(mask, p.as_ptr()) };
    let codes = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(inv)),
    );
    let mut parts = [
        _mm512_srli_epi32::<8>(codes),
        _mm512_and_si512(codes, _mm512_set1_epi32(255)),
    ];
    for phase in 0..PHASES {
        for (w, part) in w.iter().zip(&mut parts) {
            // SAFETY: row `4 · phase + r < 16` of a 16 × 64-byte tile (caller).
            unsafe { _mm512_storeu_si512(w.add(16 * (PHASES * phase + r)).cast(), *part) };
            *part = _mm512_slli_epi32::<8>(*part);
        }
    }
}

/// `acc_r[d] += Σ_{t<n} p[r][t] · v_t[d]` for the four rows `acc_r = acc[r * hd..]`, in
/// the split order of four parts, over the first `n <= 64` tokens of `runs` (runs of
/// whole vectors of `hd` int8 codes, in token order: a chunk's of one KV head), calling
/// `step` after each 16. The weights of each row are coded against the chunk's
/// largest. O(n × hd).
///
/// # Safety
/// [`tiles::configure`] ran on this thread and the CPU has AMX-INT8 (which implies
/// AVX-512F and BW); `T` is int8; `hd` is a non-zero multiple of 64 within
/// `MAX_HEAD_DIM`; each `p[r]` holds `n` weights, none negative; `acc` holds four
/// rows.
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
    assert!(core::mem::size_of::<T>() == 1);
    let mut chunk = ChunkTiles::new();
    let (tiles, tokens) = chunk.gather(runs, n, hd);
    if tokens == 0 {
        return;
    }
    let count = tiles.len();
    // `w[part][i]`: tile `i`'s high (0) and low (1) weight bytes.
    let mut w = [const { [const { MaybeUninit::<TileRows>::uninit() }; CHUNK_TILES] }; 2];
    let mut scale = [0.0f32; ROWS];
    for (r, pr) in p.iter().enumerate() {
        let pr = &pr[..tokens];
        // SAFETY: AVX-512F (caller).
        let (max, finite) = unsafe { largest::<false>(pr) };
        let inv;
        (scale[r], inv) = fixed_point_to(max, finite, WEIGHT_ONE);
        for i in 0..count {
            let m = (tokens - i * TOKENS).min(TOKENS);
            let rows = [w[0][i].as_mut_ptr().cast(), w[1][i].as_mut_ptr().cast()];
            // SAFETY: AVX-512F (caller); `m` weights from `i * 16` (`tokens <= n`).
            unsafe { weight_rows(&pr[i * TOKENS..], m, inv, r, rows) };
        }
    }
    let mut c = [const { MaybeUninit::<TileRows>::uninit() }; 2];
    for g in 0..hd / GROUP {
        // SAFETY: configured, AMX-INT8 (caller). Value tile `i`'s group `g` is 16 rows
        // of 64 bytes at `tiles[i].start + 64 g`: inside its run, or inside its copy
        // (rows with tokens copied, the rest zeroed); both weight tiles of tile `i`
        // were written above, every row (four phases × four rows); `c` is two tiles of
        // 16 rows of 64 bytes.
        unsafe {
            tiles::zero::<{ tmm::PART_SUMS[0] }>();
            tiles::zero::<{ tmm::PART_SUMS[1] }>();
            for (i, tile) in tiles.iter().enumerate().take(count) {
                let at = tile.start.add(GROUP * g);
                tiles::load::<{ tmm::PART_WEIGHTS[0] }>(w[0][i].as_ptr().cast(), 64);
                tiles::load::<{ tmm::PART_WEIGHTS[1] }>(w[1][i].as_ptr().cast(), 64);
                if i.is_multiple_of(2) {
                    tiles::load::<{ tmm::PART_VALUES[0] }>(at, tile.stride);
                    part_products::<{ tmm::PART_VALUES[0] }>();
                } else {
                    tiles::load::<{ tmm::PART_VALUES[1] }>(at, tile.stride);
                    part_products::<{ tmm::PART_VALUES[1] }>();
                }
                if g == 0 {
                    step();
                }
            }
            tiles::store::<{ tmm::PART_SUMS[0] }>(c[0].as_mut_ptr().cast(), 64);
            tiles::store::<{ tmm::PART_SUMS[1] }>(c[1].as_mut_ptr().cast(), 64);
            let [high, low] = [c[0].as_ptr().cast::<i32>(), c[1].as_ptr().cast::<i32>()];
            add_sums(acc, [high, low], scale, hd, g);
        }
    }
}

/// The products of both weight parts ([`tmm::PART_WEIGHTS`]) with the values in tile
/// `V`, into the parts' sums ([`tmm::PART_SUMS`]). O(1).
///
/// # Safety
/// [`tiles::configure`] ran on this thread and the CPU has AMX-INT8.
#[inline(always)]
unsafe fn part_products<const V: u8>() {
    // SAFETY: the caller's.
    unsafe {
        tiles::dot_u8i8::<{ tmm::PART_SUMS[0] }, { tmm::PART_WEIGHTS[0] }, V>();
        tiles::dot_u8i8::<{ tmm::PART_SUMS[1] }, { tmm::PART_WEIGHTS[1] }, V>();
    }
}

/// Adds the two stored sums tiles of group `g` (`256 · high + low`, row `4 · phase +
/// r`, times `scale[r]`) into the four accumulator rows of `acc` (`hd` floats each,
/// split order). O(1).
///
/// # Safety
/// AVX-512F; each of `sums` is 16 rows of 16 words, all written; `acc` holds four rows
/// of `hd`, and group `g` is inside them.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn add_sums(
    acc: &mut [f32],
    sums: [*const i32; 2],
    scale: [f32; ROWS],
    hd: usize,
    g: usize,
) {
    debug_assert!(acc.len() >= ROWS * hd && (g + 1) * GROUP <= hd);
    for (r, scale) in scale.into_iter().enumerate() {
        let scale = _mm512_set1_ps(scale);
        for phase in 0..PHASES {
            let row = 16 * (PHASES * phase + r);
            // SAFETY: as the caller promises.
            unsafe {
                let total = _mm512_add_epi32(
                    _mm512_slli_epi32::<8>(_mm512_loadu_si512(sums[0].add(row).cast())),
                    _mm512_loadu_si512(sums[1].add(row).cast()),
                );
                let a = acc.as_mut_ptr().add(r * hd + g * GROUP + 16 * phase);
                _mm512_storeu_ps(
                    a,
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale, _mm512_loadu_ps(a)),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The two tile kernels against plain f64 sums on random codes (the unused code
    //! −128 included) and queries with outlier channels, at head dims of one, three
    //! and four groups, one token, a partial tile and a whole one, and over runs of
    //! every shape a chunk can have; on CPUs that have AMX-INT8.
    use super::*;
    use crate::dtype::Int8;
    use crate::kernels::amx::check::{
        accumulation_error, begun, chunk_runs, token_of, worst, CHUNK_SHAPES,
    };
    use crate::kernels::amx::AmxBf16;
    use crate::kernels::lanes::{from_split_order, to_split_order};
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};

    /// The bound of both kernels' error: half a code of the f32 side (2^-16 of its
    /// largest, 1.5e-5) plus the f32 rounding of the sums and scales.
    const BOUND: f64 = 1.6e-5;

    /// The tiles with AMX-INT8, configured on this thread, or `None` (said on stderr).
    fn int8_tiles() -> Option<AmxBf16> {
        let amx = begun()?;
        if !amx.int8 {
            eprintln!("skipped: AMX-INT8 absent");
            amx.end();
            return None;
        }
        Some(amx)
    }

    fn code(rng: &mut StdRng) -> Int8 {
        Int8(rng.random_range(-128..=127))
    }

    /// Four rows of `n` softmax-like weights in `[0, 1)`, and `acc0`: four random
    /// accumulator rows.
    fn weights_and_acc(rng: &mut StdRng, n: usize, hd: usize) -> (Vec<Vec<f32>>, Vec<f32>) {
        let p = (0..ROWS)
            .map(|_| (0..n).map(|_| rng.random_range(0.0..1.0)).collect())
            .collect();
        let acc0 = (0..ROWS * hd)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        (p, acc0)
    }

    /// [`accumulation_error`] of `acc` (split order) over the `n` tokens of `runs`:
    /// each weight's rounding is relative to its row's largest.
    fn error_of(
        acc: &mut [f32],
        acc0: &[f32],
        p: &[Vec<f32>],
        runs: &[Vec<Int8>],
        n: usize,
    ) -> f64 {
        let hd = acc0.len() / ROWS;
        from_split_order::<GROUP, PHASES>(acc);
        let value = |t: usize, d: usize| f64::from(token_of(runs, t, hd)[d].0);
        let largest: Vec<f64> = p
            .iter()
            .map(|r| r.iter().fold(0.0f64, |m, &x| m.max(x.into())))
            .collect();
        accumulation_error(acc, acc0, p, value, n, hd, |r, _| largest[r])
    }

    #[test]
    fn tiles_match_f64_sums() {
        let Some(amx) = int8_tiles() else { return };
        let mut rng = StdRng::seed_from_u64(21);
        for hd in [64, 192, 256] {
            for n in [1, 7, 16] {
                // Every 37th channel 50 times the others.
                let q: Vec<f32> = (0..ROWS * hd)
                    .map(|i| rng.random_range(-2.0..2.0) * if i % 37 == 0 { 50.0 } else { 1.0 })
                    .collect();
                let k: Vec<Int8> = (0..n * hd).map(|_| code(&mut rng)).collect();

                // Scores: `s[r * stride + t]`, against Σ q·k, relative to the row's
                // largest |q| times Σ |k|.
                let stride = 20;
                let mut tiles_q = q.clone();
                // SAFETY: `int8_tiles` found AVX-512F and BW.
                unsafe { to_query_tiles(&mut tiles_q, hd) };
                let mut s = vec![f32::NAN; 3 * stride + 16];
                // SAFETY: configured above, AMX-INT8; the shapes are the kernel's.
                unsafe { scores4(&tiles_q, &k, hd, n, &mut s, stride) };
                let (mut want, mut scale, mut got) = (vec![], vec![], vec![]);
                for r in 0..ROWS {
                    let qr = &q[r * hd..(r + 1) * hd];
                    let largest = qr.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()));
                    for t in 0..n {
                        let kt = &k[t * hd..(t + 1) * hd];
                        want.push(
                            qr.iter()
                                .zip(kt)
                                .map(|(&a, b)| f64::from(a) * f64::from(b.0))
                                .sum(),
                        );
                        scale.push(largest * kt.iter().map(|b| f64::from(b.0).abs()).sum::<f64>());
                        got.push(s[r * stride + t]);
                    }
                    // Past `n` tokens, nothing is written.
                    let past = if r < ROWS - 1 { stride } else { 16 };
                    assert!(s[r * stride + n..r * stride + past]
                        .iter()
                        .all(|x| x.is_nan()));
                }
                let err = worst(&got, &want, &scale);
                assert!(err < BOUND, "scores hd {hd} n {n}: {err:e}");

                // Accumulation of one run.
                let runs = vec![(0..n * hd).map(|_| code(&mut rng)).collect::<Vec<_>>()];
                let (p, acc0) = weights_and_acc(&mut rng, n, hd);
                let mut acc = acc0.clone();
                to_split_order::<GROUP, PHASES>(&mut acc);
                let rows = [&p[0][..], &p[1][..], &p[2][..], &p[3][..]];
                let mut steps = 0;
                // SAFETY: configured above, AMX-INT8; the shapes are the kernel's.
                unsafe {
                    accumulate_runs4(&mut acc, rows, &[&runs[0][..]], n, hd, &mut || steps += 1)
                };
                assert_eq!(steps, 1);
                let err = error_of(&mut acc, &acc0, &p, &runs, n);
                assert!(err < BOUND, "accumulation hd {hd} n {n}: {err:e}");
            }
        }
        amx.end();
    }

    /// The accumulation over runs of every shape a chunk can have ([`CHUNK_SHAPES`],
    /// the codes past the tokens asked for −128) against f64 sums, one `step` per
    /// tile; and a row of weights with a NaN makes that row's outputs NaN, the other
    /// rows' unchanged.
    #[test]
    fn chained_runs_match_f64_sums() {
        let Some(amx) = int8_tiles() else { return };
        let mut rng = StdRng::seed_from_u64(22);
        for hd in [64, 192, 256] {
            for (lens, n) in CHUNK_SHAPES {
                let runs = chunk_runs(lens, n, hd, || code(&mut rng), Int8(-128));
                let (mut p, acc0) = weights_and_acc(&mut rng, n, hd);
                let mut acc = acc0.clone();
                to_split_order::<GROUP, PHASES>(&mut acc);
                let slices: Vec<&[Int8]> = runs.iter().map(|r| &r[..]).collect();
                let rows = [&p[0][..], &p[1][..], &p[2][..], &p[3][..]];
                let mut steps = 0;
                // SAFETY: configured above, AMX-INT8; the shapes are the kernel's.
                unsafe { accumulate_runs4(&mut acc, rows, &slices, n, hd, &mut || steps += 1) };
                assert_eq!(steps, n.div_ceil(TOKENS), "hd {hd} runs {lens:?}");
                let err = error_of(&mut acc, &acc0, &p, &runs, n);
                assert!(err < BOUND, "hd {hd} runs {lens:?} n {n}: {err:e}");

                p[2][n / 2] = f32::NAN;
                let mut acc = acc0.clone();
                to_split_order::<GROUP, PHASES>(&mut acc);
                let rows = [&p[0][..], &p[1][..], &p[2][..], &p[3][..]];
                // SAFETY: as above.
                unsafe { accumulate_runs4(&mut acc, rows, &slices, n, hd, &mut || {}) };
                from_split_order::<GROUP, PHASES>(&mut acc);
                assert!(acc[2 * hd..3 * hd].iter().all(|x| x.is_nan()));
                let mut clean = acc0.clone();
                to_split_order::<GROUP, PHASES>(&mut clean);
                let rows = [&p[0][..], &p[1][..], &p[3][..], &p[3][..]];
                // SAFETY: as above.
                unsafe { accumulate_runs4(&mut clean, rows, &slices, n, hd, &mut || {}) };
                from_split_order::<GROUP, PHASES>(&mut clean);
                assert_eq!(acc[..2 * hd], clean[..2 * hd]);
            }
        }
        amx.end();
    }
}
