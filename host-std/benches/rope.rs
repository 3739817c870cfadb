//! Re-rotating the keys of tokens moved by a context shift, versus recomputing their K/V,
//! versus a plain copy of the same bytes.
//!
//! `cargo bench -p kvpage --bench rope` — the K/V geometry of a Llama-3-8B-class model
//! (32 layers, 8 KV heads, head dim 128, all 128 dims rotary, half-split pairing, base
//! 500000, f16 storage, blocks of 16 tokens in shuffled physical order), hidden size 4096;
//! 512 moved tokens, or the counts given as arguments (`-- 128 2048`). The three
//! measurements are interleaved in one run on the same `WorkerPool` (one thread per
//! core); medians are printed, the best of the run beside them.
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
//! other agents' builds: load average 4–6, so medians move by 2× between runs), 512
//! tokens, five runs: rotate 7.3–13.0 ms median (best of run 4.6–11.4; 5–9 GB/s of keys
//! read + written), memcpy of the same bytes 3.5–9.9 ms, rotate / memcpy 1.25–2.6;
//! recompute K/V 17.7–28.0 s (the matmul at 10–16 GFLOP/s, portable SSE2 code: a tuned
//! BLAS on these two cores would be ~10× faster), rotate / recompute 1/1400–1/2200 as
//! measured, so ~1/150 against a tuned BLAS. A context shift that re-rotates its moved
//! keys costs well under 1% of even the K/V projections of recomputing them, and
//! 1.3–2.6× a plain copy of the same bytes (each f16 row is widened, turned and
//! narrowed on the CPU). Those runs predate the F16C narrowing of f16 (`dtype.rs`);
//! with it, `-- 32 512` alternated with the previous code twice: 32 tokens (4 MiB,
//! cache-resident) 0.36–0.38 ms against 0.46 (memcpy 0.24, so 1.5×), 512 tokens best of
//! run 10.2–11.5 ms against 13.8–15.4 (medians 14–16 ms both: load average 5.6).

mod common;

use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{fill, numeric_args, stats};
use kvpage::kernels::{rotate_keys, write_kv, BlockTable, KeyShift, WorkerPool};
use kvpage::{f16, Arena, Element, Geometry, KvLayout, RopePairing, RopeParams};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
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

fn timed(f: impl FnOnce()) -> Duration {
    let t = Instant::now();
    f();
    t.elapsed()
}

fn run(tokens: u32, pool: &WorkerPool, rng: &mut StdRng) {
    let blocks = tokens.div_ceil(BLOCK);
    let geometry = Geometry::new(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, f16::DTYPE).expect("geometry");
    let layout = KvLayout::new(geometry, blocks).expect("layout");
    let mut arena = Arena::for_layout(&layout).expect("arena");
    fill(rng, arena.as_mut_slice::<f16>());
    let mut physical: Vec<u32> = (0..blocks).collect();
    physical.shuffle(rng);
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
    let kv_cols = (KV_HEADS * HEAD_DIM) as usize;
    let mut x = vec![0.0f32; n * HIDDEN];
    fill(rng, &mut x);
    let mut w_k = vec![0.0f32; HIDDEN * kv_cols];
    let mut w_v = vec![0.0f32; HIDDEN * kv_cols];
    fill(rng, &mut w_k);
    fill(rng, &mut w_v);
    let (mut k, mut v) = (vec![0.0f32; n * kv_cols], vec![0.0f32; n * kv_cols]);

    let elem = core::mem::size_of::<f16>();
    let rotated_bytes = n * (LAYERS * KV_HEADS * HEAD_DIM) as usize * elem;
    let src = vec![0x5au8; rotated_bytes];
    let mut dst = vec![0u8; rotated_bytes];

    let (mut rot, mut rec, mut cpy) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS + 1 {
        // Alternate the sign so the keys stay where they started, round after round.
        let delta = if round % 2 == 0 { -4096 } else { 4096 };
        let shift = [KeyShift {
            row: 0,
            first: 0,
            end: tokens,
            delta,
        }];
        let t_rot = timed(|| {
            let a = arena.as_mut_slice::<f16>();
            rotate_keys(&layout, a, table, &shift, rope, Some(pool)).expect("rotate");
        });
        let t_rec = timed(|| {
            matmul(pool, &x, &w_k, &mut k, kv_cols);
            matmul(pool, &x, &w_v, &mut v, kv_cols);
            let a = arena.as_mut_slice::<f16>();
            write_kv(&layout, a, 0, &slots, &k, &v).expect("write");
        });
        let t_cpy = timed(|| parallel_copy(pool, black_box(&src), &mut dst));
        black_box((&arena, &dst));
        if round > 0 {
            rot.push(t_rot);
            rec.push(t_rec * LAYERS);
            cpy.push(t_cpy);
        }
    }
    let ((r, r_min), (c, c_min), (m, m_min)) = (stats(rot), stats(rec), stats(cpy));
    let proj_flop = 2.0 * n as f64 * HIDDEN as f64 * 2.0 * kv_cols as f64 * f64::from(LAYERS);
    let moved = 2 * rotated_bytes;
    println!(
        "context shift, {tokens} moved tokens: {LAYERS} layers x {KV_HEADS} kv heads x head dim {HEAD_DIM} (rotary {}), f16, block {BLOCK}, hidden {HIDDEN}, {} threads, median of {ROUNDS}",
        rope.rotary_dims,
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
    println!(
        "  rotate:                     {:10.2} ms {:6.2} GB/s   (best {:10.2} ms)",
        ms(r),
        gbs(r),
        ms(r_min)
    );
    println!(
        "  recompute K/V (1 layer x{LAYERS}): {:10.2} ms {:6.2} GFLOP/s (best {:10.2} ms)",
        ms(c),
        proj_flop / c.as_secs_f64() / 1e9,
        ms(c_min)
    );
    println!(
        "  memcpy of the same bytes:   {:10.2} ms {:6.2} GB/s   (best {:10.2} ms)",
        ms(m),
        gbs(m),
        ms(m_min)
    );
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    println!(
        "  rotate / recompute K/V: {:.4} (1/{:.0}; best-of-run {:.4})",
        ratio(r, c),
        ratio(c, r),
        ratio(r_min, c_min)
    );
    println!(
        "  rotate / memcpy:        {:.2} (best-of-run {:.2})",
        ratio(r, m),
        ratio(r_min, m_min)
    );
}

fn main() {
    // Numeric arguments pick the moved-token counts.
    let pool = WorkerPool::new(0);
    let mut rng = StdRng::seed_from_u64(7);
    for tokens in numeric_args(512).into_iter().filter(|&t| t > 0) {
        run(tokens, &pool, &mut rng);
    }
}
