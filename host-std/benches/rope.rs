//! Re-rotating the keys of tokens moved by a context shift, versus recomputing their K/V,
//! versus a plain copy of the same bytes.
//!
//! `cargo bench -p kvpage --bench rope` — the K/V geometry of a Llama-3-8B-class model
//! (32 layers, 8 KV heads, head dim 128, all 128 dims rotary, half-split pairing, base
//! 500000, f16 storage, blocks of 16 tokens in shuffled physical order), hidden size 4096;
//! 512 moved tokens, or the counts given as arguments (`-- 128 2048`). The three
//! measurements are interleaved in one run on the same `WorkerPool` (one thread per
//! core), each after 256 MiB of writes that push its data out of the caches (the keys a
//! shift moves are old); medians are printed, the best of the run beside them. A second
//! section repeats rotate and memcpy for f32 and bf16 storage.
//!
//! - **rotate**: `kernels::rotate_keys` over the moved tokens, all layers — what a
//!   context shift costs on top of its page-table edit.
//! - **recompute K/V**: the least a recompute of the same tokens must do, and far less
//!   than it really does: the K and V projections (`x · W_k`, `x · W_v`, `x` the tokens'
//!   hidden states, f32, a cache-tiled matmul on the same threads) and `write_kv` of the
//!   result, per layer. Not counted: everything else of the forward pass that produces
//!   `x` for each layer (attention over the kept context, the MLP, the other
//!   projections: ~2 × 8e9 FLOP per token in all, 30× the K/V projections), and RoPE of
//!   the new keys. One layer is timed and multiplied by the layer count (all layers would
//!   take seconds per round); the matmul's GFLOP/s are printed, since a tuned BLAS would
//!   run it several times faster than this plain loop.
//! - **memcpy**: a copy of as many bytes as the rotation reads (it writes as many), split
//!   over the same threads: the bandwidth bound of an in-place pass.
//! - **`KvCache::context_shift_rotated`** (f16 only, beside the recompute): the whole
//!   context shift a caller runs, on a `KvCache` of the same geometry with its own
//!   workers: keep 64 tokens, discard 256 (block-aligned), so the moved tokens' blocks
//!   slide down in the page table (no K/V row moved or copied: printed) and their keys
//!   are re-rotated. Its sequence is rebuilt and written before each measurement (not
//!   timed), then the caches are flushed as above.
//!
//! Machine-independent: the rotation moves `2 × layers × kv_heads × rotary_dims × 2 B`
//! = 128 KiB per token (read + write) and does 3 FLOP per element; the projections alone
//! are `2 × layers × hidden × 2 × kv_heads × head_dim` = 537 MFLOP per token, 4096 FLOP
//! per byte the rotation moves. So with both at their roofline, on a machine of balance
//! B FLOP per byte of bandwidth (about 5–20 for CPUs, 100–300 for GPUs), the rotation
//! costs B / 4096 of the projections alone (1/400 to 1/14), and less again of a real
//! recompute.
//!
//! Measured on the development VM (2 vCPUs of a Xeon with AVX-512, shared with three
//! other agents' builds, load average 4–5), 512 tokens, two runs of the final code:
//!
//! | storage | rotate (median) | memcpy (median) | rotate / memcpy |
//! |---|---|---|---|
//! | f16  | 5.9–6.1 ms (11 GB/s) | 2.7–3.6 ms | 1.7–2.2 |
//! | f32  | 9.1–9.7 ms (14–15 GB/s) | 6.0–6.3 ms | 1.5–1.55 |
//! | bf16 | 8.7–12.7 ms (5–8 GB/s) | 3.4–3.8 ms | 2.6–3.4 |
//!
//! The whole block-aligned `KvCache::context_shift_rotated` of 512 moved tokens (f16,
//! one later run on the same VM, load higher): 9.8 ms median (best 8.3 ms), the rotation
//! alone 11.8 ms median (best 3.3 ms) in that run, recompute K/V 25.8 s: the shift is
//! 1/2600 of the recompute's K/V projections; its page-table edit moved 0 bytes and is
//! lost in the rotation's noise (128 tokens: shift 1.41 ms, rotate 1.43 ms, 1/3070 of
//! the recompute).
//!
//! Recompute K/V (f16): 17.0–17.9 s (the matmul at 15–16 GFLOP/s, portable SSE2 code: a
//! tuned BLAS on these two cores would be ~10× faster), so rotate / recompute is
//! 1/2900 as measured, ~1/300 against a tuned BLAS. A context shift that re-rotates its
//! moved keys costs well under 1% of even the K/V projections of recomputing them, and
//! 1.5–3.4× a plain copy of the same bytes: each row is widened to f32, turned and
//! rounded back (f16 with F16C; bf16 with 4-wide SSE2 integer code, the slowest).

mod common;

use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{fill, numeric_args, shuffled_arena, stats};
use kvpage::kernels::{rotate_keys, write_kv, BlockTable, KeyShift, WorkerPool};
use kvpage::{
    bf16, f16, CacheConfig, Capacity, ContextShift, Element, Geometry, KvCache, KvLayout,
    RopePairing, RopeParams, Seq,
};
use rand::rngs::StdRng;
use rand::SeedableRng;

const LAYERS: u32 = 32;
const KV_HEADS: u32 = 8;
const HEAD_DIM: u32 = 128;
const HIDDEN: usize = 4096;
const BLOCK: u32 = 16;
const ROUNDS: usize = 7;
/// Output rows and columns of one matmul task: a 32 × 256 f32 accumulator (32 KiB).
const TILE_ROWS: usize = 32;
const TILE_COLS: usize = 256;

/// `out = x · w` (`x`: `[n][HIDDEN]`, `w`: `[HIDDEN][cols]`, `out`: `[n][cols]`), f32,
/// in tiles of `TILE_ROWS × TILE_COLS` outputs shared over `pool`: each task streams a
/// `HIDDEN × TILE_COLS` panel of `w` once for its `TILE_ROWS` rows.
fn matmul(pool: &WorkerPool, x: &[f32], w: &[f32], out: &mut [f32], cols: usize) {
    let n = x.len() / HIDDEN;
    let (row_tiles, col_tiles) = (n.div_ceil(TILE_ROWS), cols.div_ceil(TILE_COLS));
    let out = Mutex::new(out);
    pool.for_each_task(
        row_tiles * col_tiles,
        || vec![0.0f32; TILE_ROWS * TILE_COLS],
        |acc, task| {
            let (r0, c0) = (task / col_tiles * TILE_ROWS, task % col_tiles * TILE_COLS);
            let (rows, width) = (TILE_ROWS.min(n - r0), TILE_COLS.min(cols - c0));
            acc.fill(0.0);
            for k in 0..HIDDEN {
                let panel = &w[k * cols + c0..][..width];
                for r in 0..rows {
                    let a = x[(r0 + r) * HIDDEN + k];
                    let acc = &mut acc[r * TILE_COLS..][..width];
                    for (o, &b) in acc.iter_mut().zip(panel) {
                        *o += a * b;
                    }
                }
            }
            let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
            for r in 0..rows {
                out[(r0 + r) * cols + c0..][..width]
                    .copy_from_slice(&acc[r * TILE_COLS..][..width]);
            }
        },
    );
}

/// Copies `src` to `dst` in one chunk per thread of `pool`.
fn parallel_copy(pool: &WorkerPool, src: &[u8], dst: &mut [u8]) {
    let per = src.len().div_ceil(pool.threads());
    let chunks: Vec<Mutex<&mut [u8]>> = dst.chunks_mut(per).map(Mutex::new).collect();
    pool.for_each_task(
        chunks.len(),
        || (),
        |_, t| {
            let mut d = chunks[t].lock().unwrap_or_else(|e| e.into_inner());
            let len = d.len();
            d.copy_from_slice(&src[t * per..][..len]);
        },
    );
}

/// Bytes written between measurements so that none starts with its data in a cache
/// (the keys a context shift moves are old: long out of every cache).
const EVICT_BYTES: usize = 256 << 20;

/// Writes every byte of `buf` (larger than the last-level cache).
fn evict_caches(buf: &mut [u8], round: usize) {
    buf.fill(round as u8);
    black_box(&*buf);
}

fn timed(f: impl FnOnce()) -> Duration {
    let t = Instant::now();
    f();
    t.elapsed()
}

/// The tokens' hidden states and the K and V projection weights of a recompute, and its
/// outputs.
struct Recompute {
    x: Vec<f32>,
    w_k: Vec<f32>,
    w_v: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Recompute {
    fn new(tokens: usize, rng: &mut StdRng) -> Self {
        let kv_cols = (KV_HEADS * HEAD_DIM) as usize;
        let mut r = Self {
            x: vec![0.0; tokens * HIDDEN],
            w_k: vec![0.0; HIDDEN * kv_cols],
            w_v: vec![0.0; HIDDEN * kv_cols],
            k: vec![0.0; tokens * kv_cols],
            v: vec![0.0; tokens * kv_cols],
        };
        for m in [&mut r.x, &mut r.w_k, &mut r.w_v] {
            fill(rng, m);
        }
        r
    }

    /// One layer: both projections, then `write_kv` at `slots`.
    fn layer<T: Element>(
        &mut self,
        pool: &WorkerPool,
        layout: &KvLayout,
        arena: &mut [T],
        slots: &[u32],
    ) {
        let kv_cols = (KV_HEADS * HEAD_DIM) as usize;
        matmul(pool, &self.x, &self.w_k, &mut self.k, kv_cols);
        matmul(pool, &self.x, &self.w_v, &mut self.v, kv_cols);
        write_kv(layout, arena, 0, slots, &self.k, &self.v).expect("write");
    }
}

/// Tokens the cache's context shift keeps (a system prompt) and discards: whole blocks.
const SHIFT_KEEP: u32 = 4 * BLOCK;
const SHIFT_DISCARD: u32 = 16 * BLOCK;

/// The whole [`KvCache::context_shift_rotated`] of a block-aligned shift: a cache (own
/// workers, one per core) with one sequence of `SHIFT_KEEP + SHIFT_DISCARD + tokens`
/// tokens, rebuilt before each measurement (not timed), then shifted so that `tokens`
/// tokens move: the page-table edit, then the rotation of the moved keys.
struct CacheShift {
    cache: KvCache,
    len: u32,
    /// One layer's keys and values for every token (the same in each layer).
    k: Vec<f32>,
    v: Vec<f32>,
}

impl CacheShift {
    fn new(geometry: Geometry, tokens: u32, rng: &mut StdRng) -> Self {
        let len = SHIFT_KEEP + SHIFT_DISCARD + tokens;
        let cache = KvCache::new(CacheConfig {
            geometry,
            capacity: Capacity::Blocks(len.div_ceil(BLOCK)),
            max_seqs: 1,
            max_seq_len: len,
            threads: 0,
            event_capacity: 0,
            hash_key: None,
            max_namespaces: kvpage::CACHE_NAMESPACES,
        })
        .expect("cache");
        let mut k = vec![0.0; (len * KV_HEADS * HEAD_DIM) as usize];
        let mut v = k.clone();
        fill(rng, &mut k);
        fill(rng, &mut v);
        Self { cache, len, k, v }
    }

    /// A fresh sequence with every layer's K/V written (every arena page touched).
    fn prepare(&mut self) -> Seq {
        let seq = self.cache.create(0).expect("create");
        self.cache.append(seq, self.len).expect("append");
        for layer in 0..LAYERS {
            self.cache
                .write_kv(seq, layer, 0, &self.k, &self.v)
                .expect("write");
        }
        seq
    }

    fn shift(&mut self, seq: Seq, rope: RopeParams) -> ContextShift {
        self.cache
            .context_shift_rotated(seq, SHIFT_KEEP, SHIFT_DISCARD, rope)
            .expect("shift")
    }
}

/// Rotation of `tokens` moved tokens in storage `T`, memcpy of the same bytes, and the
/// recompute baseline and the cache's whole context shift when `recompute`, interleaved;
/// prints medians, bests and ratios.
fn run<T: Element>(tokens: u32, pool: &WorkerPool, rng: &mut StdRng, recompute: bool) {
    let blocks = tokens.div_ceil(BLOCK);
    let geometry = Geometry::new(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, T::DTYPE).expect("geometry");
    let (layout, mut arena, physical) = shuffled_arena::<T>(geometry, blocks, rng);
    let table = BlockTable {
        table: &physical,
        stride: blocks,
    };
    let rope = RopeParams {
        base: 500_000.0,
        rotary_dims: HEAD_DIM,
        pairing: RopePairing::HalfSplit,
    };
    let slots: Vec<u32> = (0..tokens)
        .map(|t| physical[(t / BLOCK) as usize] * BLOCK + t % BLOCK)
        .collect();
    let n = tokens as usize;
    let mut baseline = recompute.then(|| Recompute::new(n, rng));
    let mut cache_shift = recompute.then(|| CacheShift::new(geometry, tokens, rng));
    let mut last_shift = None;

    let elem = core::mem::size_of::<T>();
    let rotated_bytes = n * (LAYERS * KV_HEADS * HEAD_DIM) as usize * elem;
    let src = vec![0x5au8; rotated_bytes];
    let mut dst = vec![0u8; rotated_bytes];

    let mut evict = vec![0u8; EVICT_BYTES];
    let (mut rot, mut rec, mut cpy, mut ctx) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS + 1 {
        // Alternate the sign so the keys stay where they started, round after round.
        let delta = if round % 2 == 0 { -4096 } else { 4096 };
        let shift = [KeyShift {
            row: 0,
            first: 0,
            end: tokens,
            delta,
        }];
        evict_caches(&mut evict, round);
        let t_rot = timed(|| {
            let a = arena.as_mut_slice::<T>();
            rotate_keys(&layout, a, table, &shift, rope, Some(pool)).expect("rotate");
        });
        let t_rec = baseline
            .as_mut()
            .map(|b| timed(|| b.layer(pool, &layout, arena.as_mut_slice::<T>(), &slots)) * LAYERS);
        evict_caches(&mut evict, round);
        let t_cpy = timed(|| parallel_copy(pool, black_box(&src), &mut dst));
        black_box((&arena, &dst));
        let t_ctx = cache_shift.as_mut().map(|c| {
            let seq = c.prepare();
            evict_caches(&mut evict, round);
            let t = timed(|| last_shift = Some(c.shift(seq, rope)));
            c.cache.release(seq).expect("release");
            t
        });
        if round > 0 {
            rot.push(t_rot);
            rec.extend(t_rec);
            cpy.push(t_cpy);
            ctx.extend(t_ctx);
        }
    }
    let ((r, r_min), (m, m_min)) = (stats(rot), stats(cpy));
    let kv_cols = (KV_HEADS * HEAD_DIM) as usize;
    let proj_flop = 2.0 * n as f64 * HIDDEN as f64 * 2.0 * kv_cols as f64 * f64::from(LAYERS);
    let moved = 2 * rotated_bytes;
    println!(
        "context shift, {tokens} moved tokens: {LAYERS} layers x {KV_HEADS} kv heads x head dim {HEAD_DIM} (rotary {}), {:?}, block {BLOCK}, hidden {HIDDEN}, {} threads, median of {ROUNDS}",
        rope.rotary_dims,
        T::DTYPE,
        pool.threads()
    );
    println!(
        "  rotation reads + writes {moved} bytes ({:.1} KiB per token); K/V projections {:.1} GFLOP ({:.0} MFLOP per token)",
        moved as f64 / n as f64 / 1024.0,
        proj_flop / 1e9,
        proj_flop / 1e6 / n as f64
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let gbs = |d: Duration| moved as f64 / d.as_secs_f64() / 1e9;
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    println!(
        "  rotate:                     {:10.2} ms {:6.2} GB/s   (best {:10.2} ms)",
        ms(r),
        gbs(r),
        ms(r_min)
    );
    println!(
        "  memcpy of the same bytes:   {:10.2} ms {:6.2} GB/s   (best {:10.2} ms)",
        ms(m),
        gbs(m),
        ms(m_min)
    );
    if let (Some(shift), false) = (last_shift, ctx.is_empty()) {
        let (x, x_min) = stats(ctx);
        let row_bytes = u64::from(2 * LAYERS * KV_HEADS * HEAD_DIM) * elem as u64;
        println!(
            "  KvCache::context_shift_rotated, keep {SHIFT_KEEP} discard {SHIFT_DISCARD} (block-aligned): {:.2} ms (best {:.2} ms); the edit moved {} rows ({} bytes) and copied {} blocks, the rotation {} tokens ({moved} bytes read + written)",
            ms(x),
            ms(x_min),
            shift.edited.moves,
            u64::from(shift.edited.moves) * row_bytes,
            shift.edited.copies,
            shift.rotate_end - shift.rotate_first,
        );
        println!(
            "  context shift / rotate alone: {:.2} (best-of-run {:.2})",
            ratio(x, r),
            ratio(x_min, r_min)
        );
        if !rec.is_empty() {
            let (c, c_min) = stats(rec.clone());
            println!(
                "  context shift / recompute K/V: {:.4} (1/{:.0}; best-of-run {:.4})",
                ratio(x, c),
                ratio(c, x),
                ratio(x_min, c_min)
            );
        }
    }
    if !rec.is_empty() {
        let (c, c_min) = stats(rec);
        println!(
            "  recompute K/V (1 layer x{LAYERS}): {:10.2} ms {:6.2} GFLOP/s (best {:10.2} ms)",
            ms(c),
            proj_flop / c.as_secs_f64() / 1e9,
            ms(c_min)
        );
        println!(
            "  rotate / recompute K/V: {:.4} (1/{:.0}; best-of-run {:.4})",
            ratio(r, c),
            ratio(c, r),
            ratio(r_min, c_min)
        );
    }
    println!(
        "  rotate / memcpy:        {:.2} (best-of-run {:.2})",
        ratio(r, m),
        ratio(r_min, m_min)
    );
}

fn main() {
    let pool = WorkerPool::new(0);
    let mut rng = StdRng::seed_from_u64(7);
    // Numeric arguments pick the moved-token counts.
    let counts: Vec<u32> = numeric_args(512).into_iter().filter(|&t| t > 0).collect();
    for &tokens in &counts {
        run::<f16>(tokens, &pool, &mut rng, true);
    }
    // The other storage types: the rotation and its memcpy baseline only.
    for &tokens in &counts {
        run::<f32>(tokens, &pool, &mut rng, false);
        run::<bf16>(tokens, &pool, &mut rng, false);
    }
}
