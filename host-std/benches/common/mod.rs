//! Shared by the benchmarks: random fill of storage elements, an arena of random K/V
//! with its blocks in shuffled order, the median and best of a run's timings, and the
//! numbers given on the command line.
#![allow(dead_code)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvpage::kernels::{paged_attention, write_kv, AttentionParams, BlockTable, Executor, SeqQuery};
use kvpage::{Arena, Element, Geometry, KvLayout};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::RngExt;

/// Median and minimum.
pub fn stats(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    (v[v.len() / 2], v[0])
}

/// Fills `dst` with random values in [-1, 1), through an f32 buffer.
pub fn fill<T: Element>(rng: &mut StdRng, dst: &mut [T]) {
    let mut buf = vec![0.0f32; 1 << 16];
    for chunk in dst.chunks_mut(1 << 16) {
        for x in buf.iter_mut() {
            *x = rng.random_range(-1.0f32..1.0);
        }
        T::narrow(&buf, chunk);
    }
}

/// The numeric command-line arguments (`cargo bench` also passes `--bench`, skipped), or
/// `default` alone when there are none.
pub fn numeric_args(default: u32) -> Vec<u32> {
    let given: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if given.is_empty() {
        vec![default]
    } else {
        given
    }
}

/// An arena of `blocks` blocks of `geometry` in storage `T`, filled with random values,
/// and the block ids `0..blocks` shuffled: a block table whose logical order is not the
/// physical one, as after a while of serving.
pub fn shuffled_arena<T: Element>(
    geometry: Geometry,
    blocks: u32,
    rng: &mut StdRng,
) -> (KvLayout, Arena, Vec<u32>) {
    let layout = KvLayout::new(geometry, blocks).expect("layout");
    let mut arena = Arena::for_layout(&layout).expect("arena");
    fill(rng, arena.as_mut_slice::<T>());
    if geometry.dtype().is_scaled() {
        // Random codes over the whole range (a uniform value of ±1 rounds to ±1, 0 or
        // -1), and a sane scale for every token of every tile.
        let codes = arena.as_mut_slice::<T>();
        let mut buf = vec![0.0f32; codes.len().min(1 << 16)];
        for chunk in codes.chunks_mut(1 << 16) {
            for x in buf.iter_mut() {
                *x = rng.random_range(-127.0f32..127.0);
            }
            T::narrow(&buf, chunk);
        }
        let bytes = arena.as_bytes_mut();
        let tiles = 2 * geometry.layers() as usize * geometry.kv_heads() as usize;
        let bs = geometry.block_size() as usize;
        for b in 0..blocks {
            for t in 0..tiles {
                let at = layout.tile_offset(b, 0, 0, 0) + t * layout.tile_elems();
                for r in 0..bs {
                    let s = at + layout.scales_offset() + 4 * r;
                    bytes[s..s + 4].copy_from_slice(&(1.0f32 / 127.0).to_le_bytes());
                }
            }
        }
    }
    let mut physical: Vec<u32> = (0..blocks).collect();
    physical.shuffle(rng);
    (layout, arena, physical)
}

/// Time of one paged-attention call over layer 0 (its output kept alive).
pub fn timed_paged<T: Element>(
    layout: &KvLayout,
    arena: &[T],
    table: BlockTable<'_>,
    seqs: &[SeqQuery],
    q: &[f32],
    out: &mut [f32],
    params: AttentionParams<'_>,
) -> Duration {
    let t = Instant::now();
    paged_attention(layout, arena, 0, table, seqs, q, out, params).expect("paged");
    let elapsed = t.elapsed();
    black_box(&*out);
    elapsed
}

/// One paged-attention call set up to be timed again and again: one layer of `kv_heads`
/// heads of `head_dim` in storage `T`, blocks of `block_size` tokens in shuffled
/// physical order filled with random K/V; `seqs` sequences of `context` tokens whose last
/// `queries` are new, with random queries in [-1, 1) for `q_heads` query heads.
pub struct PagedCall<T> {
    layout: KvLayout,
    arena: Arena,
    physical: Vec<u32>,
    stride: u32,
    seqs: Vec<SeqQuery>,
    q: Vec<f32>,
    out: Vec<f32>,
    q_heads: u32,
    head_dim: u32,
    _storage: core::marker::PhantomData<T>,
}

impl<T: Element> PagedCall<T> {
    /// Builds the arena, table and queries. Shapes: see the type.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kv_heads: u32,
        head_dim: u32,
        block_size: u32,
        q_heads: u32,
        seqs: u32,
        context: u32,
        queries: u32,
        rng: &mut StdRng,
    ) -> Self {
        let stride = context.div_ceil(block_size);
        let geometry =
            Geometry::new(1, kv_heads, head_dim, block_size, T::DTYPE).expect("geometry");
        let (layout, arena, physical) = shuffled_arena::<T>(geometry, seqs * stride, rng);
        let seqs: Vec<SeqQuery> = (0..seqs)
            .map(|row| SeqQuery {
                row,
                context_len: context,
                queries,
            })
            .collect();
        let q: Vec<f32> = (0..seqs.len() as u32 * queries * q_heads * head_dim)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let out = vec![0.0f32; q.len()];
        Self {
            layout,
            arena,
            physical,
            stride,
            seqs,
            q,
            out,
            q_heads,
            head_dim,
            _storage: core::marker::PhantomData,
        }
    }

    /// Time of one call on `pool` (`None`: the calling thread alone).
    pub fn time(&mut self, pool: Option<&dyn Executor>) -> Duration {
        let table = BlockTable {
            table: &self.physical,
            stride: self.stride,
        };
        let params = AttentionParams {
            q_heads: self.q_heads,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
            pool,
        };
        let arena = self.arena.as_slice::<T>();
        timed_paged(
            &self.layout,
            arena,
            table,
            &self.seqs,
            &self.q,
            &mut self.out,
            params,
        )
    }

    /// Rewrites every token's K and V through [`write_kv`] from standard normal values
    /// with outliers as `kv_quant_error` has them: K channels 7, 33, 64 and 101 15 times
    /// larger, and one token in a hundred with V 10 times larger. In 8-bit storage the
    /// outliers set each row's scale and leave the other channels small codes; in FP8
    /// about one K code in 1600 and one V code in 14000 is then subnormal (under 2^-6),
    /// which the random codes of [`shuffled_arena`] almost never are. O(arena).
    pub fn with_outliers(mut self, rng: &mut StdRng) -> Self {
        let g = *self.layout.geometry();
        let (heads, hd) = (g.kv_heads() as usize, g.head_dim() as usize);
        let slots: Vec<u32> = (0..self.layout.num_blocks() * g.block_size()).collect();
        let mut normal = || {
            let (u, v): (f64, f64) = (rng.random(), rng.random());
            ((-2.0 * (1.0 - u).ln()).sqrt() * (core::f64::consts::TAU * v).cos()) as f32
        };
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for _ in 0..slots.len() {
            let loud = normal().abs() > 2.576; // one token in a hundred
            for _ in 0..heads {
                for d in 0..hd {
                    k.push(
                        normal()
                            * if [7, 33, 64, 101].contains(&d) {
                                15.0
                            } else {
                                1.0
                            },
                    );
                    v.push(normal() * if loud { 10.0 } else { 1.0 });
                }
            }
        }
        write_kv(
            &self.layout,
            self.arena.as_mut_slice::<T>(),
            0,
            &slots,
            &k,
            &v,
        )
        .expect("write");
        self
    }

    /// The arena's bytes: the K/V a decode reads.
    pub fn bytes(&self) -> &[u8] {
        self.arena.as_bytes()
    }

    /// The byte ranges of the arena that a decode reads, per task and in the order the
    /// task reads them, for tasks of `heads` consecutive KV heads (`heads` divides
    /// `kv_heads`): for each sequence and group of heads, block after block of the
    /// sequence's table row, the group's K tiles (adjacent in the block), then its V
    /// tiles. Whole tiles: the ranges cover the arena once when the context is a
    /// multiple of the block size (every sequence of a `PagedCall` has the same
    /// context, so the first one's block count serves for all).
    pub fn decode_ranges(&self, heads: u32) -> Vec<Vec<(usize, usize)>> {
        let g = self.layout.geometry();
        let size = g.dtype().size_bytes() as usize;
        let tile = self.layout.tile_elems() * size;
        let blocks = self
            .seqs
            .first()
            .map_or(0, |s| s.context_len.div_ceil(g.block_size()));
        let mut tasks = Vec::new();
        for s in &self.seqs {
            let row = &self.physical[(s.row * self.stride) as usize..][..blocks as usize];
            for group in (0..g.kv_heads()).step_by(heads as usize) {
                let mut ranges = Vec::with_capacity(2 * row.len());
                for &block in row {
                    for kv in 0..2 {
                        let start = self.layout.tile_offset(block, 0, kv, group) * size;
                        ranges.push((start, heads as usize * tile));
                    }
                }
                tasks.push(ranges);
            }
        }
        tasks
    }
}
