//! Every kernel of `kernels/kvpage.cu`, run in emulation (the same CUDA source compiled
//! as host C++, each CUDA thread a fiber, shuffled scheduling) against the CPU backend
//! (`kvpage`, host-std) on random inputs: write and copy bit-exact, attention within
//! 1e-4 relative (f32 accumulation in a different order; 3e-4 over int8 storage, see
//! [`INT8_TOLERANCE`]). Outputs are poisoned with NaN
//! (0xFF bytes) first, so an element the kernel failed to write fails the comparison.
//! The launches use the planner's configurations (`kvpage_cuda::launch`), as on a GPU.

use kvpage::kernels::{self, AttentionParams, BlockTable, SeqQuery};
use kvpage::quant::{dequantize, quantize, Code};
use kvpage::{bf16, f16, Arena, Element, Fp8E4m3, Int8, KvLayout, KvScales};
use kvpage_core::{BlockCopy, DType, Geometry};
use kvpage_cuda::emulation::{self as emu, convert, index, EmuError};
use kvpage_cuda::launch::{pack_seqs, AttentionCall, LaunchError, Partitioning};
use kvpage_cuda::params::{dtype_code, KvpGeometry, KvpSeqDesc};
use proptest::prelude::*;

/// xorshift64*: reproducible inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n)) as u32
    }
    /// Uniform in [-1, 1), never exactly 0.
    fn value(&mut self) -> f32 {
        let x = (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        if x == 0.0 {
            0.5
        } else {
            x
        }
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u32 + 1) as usize);
        }
    }
}

const ALL_DTYPES: [DType; 5] = [
    DType::F32,
    DType::F16,
    DType::Bf16,
    DType::Int8,
    DType::Fp8E4m3,
];

/// Runs `$body` with `$t` the element type of `$dtype`.
macro_rules! with_element {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::Bf16 => {
                type $t = bf16;
                $body
            }
            DType::Int8 => {
                type $t = Int8;
                $body
            }
            DType::Fp8E4m3 => {
                type $t = Fp8E4m3;
                $body
            }
        }
    };
}

/// An arena of `layout` filled with 0xFF bytes (NaN in every float dtype).
fn poisoned(layout: &KvLayout) -> Arena {
    let mut a = Arena::for_layout(layout).unwrap();
    a.as_bytes_mut().fill(0xFF);
    a
}

/// Index of the first differing byte, if any.
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

// ---------------------------------------------------------------------------- write

fn check_write(g: Geometry, num_blocks: u32, tokens: u32, seed: u64) {
    check_write_at(g, num_blocks, tokens, seed, None);
}

/// [`check_write`], 8-bit rows at the fixed `scales` (`[k, v]`) where given.
fn check_write_at(g: Geometry, num_blocks: u32, tokens: u32, seed: u64, scales: Option<[f32; 2]>) {
    let mut rng = Rng::new(seed);
    let layout = KvLayout::new(g, num_blocks).unwrap();
    let mut slots: Vec<u32> = (0..num_blocks * g.block_size()).collect();
    rng.shuffle(&mut slots);
    slots.truncate(tokens as usize);
    let n = tokens as usize * (g.kv_heads() * g.head_dim()) as usize;
    // Scaled rows: values over several magnitudes, so scales differ row to row.
    let mut k: Vec<f32> = (0..n).map(|i| rng.value() * (1 + i % 7) as f32).collect();
    let mut v: Vec<f32> = (0..n).map(|_| rng.value() * 3.0).collect();
    if g.dtype().is_scaled() {
        // A few NaNs and infinities: their rows store a NaN scale, both writers.
        for (j, i) in (7..n).step_by(97).enumerate() {
            k[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][j % 3];
        }
        for i in (30..n).step_by(131) {
            v[i] = f32::NAN;
        }
    }
    let layer = rng.below(g.layers());
    let mut cpu = poisoned(&layout);
    let mut gpu = poisoned(&layout);
    emu::set_seed(seed);
    if let Some([ks, vs]) = scales {
        let fixed = KvScales::new(ks, vs).unwrap();
        with_element!(g.dtype(), T => kernels::write_kv_at_scales::<T>(
            &layout, cpu.as_mut_slice::<T>(), layer, &slots, &k, &v, fixed).unwrap());
        let kv = (&k[..], &v[..]);
        let arena = gpu.as_bytes_mut();
        emu::write_kv_at_scales(&g, num_blocks, arena, layer, &slots, kv, [ks, vs]).unwrap();
    } else {
        with_element!(g.dtype(), T => kernels::write_kv::<T>(
            &layout, cpu.as_mut_slice::<T>(), layer, &slots, &k, &v).unwrap());
        emu::write_kv(&g, num_blocks, gpu.as_bytes_mut(), layer, &slots, &k, &v).unwrap();
    }
    if let Some(i) = first_difference(cpu.as_bytes(), gpu.as_bytes()) {
        panic!("{g:?} tokens {tokens}: byte {i} differs");
    }
}

#[test]
fn write_is_bit_exact_for_every_dtype() {
    let mut seed = 1;
    for dtype in ALL_DTYPES {
        for (hd, bs) in [(64, 8), (128, 16), (256, 32), (20, 3)] {
            for (kv_heads, tokens) in [(1, 1), (3, 13), (2, 40)] {
                let g = Geometry::new(2, kv_heads, hd, bs, dtype).unwrap();
                check_write(g, 7, tokens.min(7 * bs), seed);
                seed += 1;
            }
        }
    }
}

/// Fixed scales: small ones (most values saturate), mixed, and large ones.
#[test]
fn fixed_scale_write_is_bit_exact() {
    let mut seed = 100;
    for dtype in [DType::Int8, DType::Fp8E4m3] {
        for scales in [[0.01, 0.002], [0.05, 3.0], [1e-30, 1e30]] {
            for (hd, bs, kv_heads, tokens) in [(64, 8, 2, 13), (128, 16, 3, 40), (20, 3, 1, 5)] {
                let g = Geometry::new(2, kv_heads, hd, bs, dtype).unwrap();
                check_write_at(g, 7, tokens, seed, Some(scales));
                seed += 1;
            }
        }
    }
}

#[test]
fn fixed_scale_write_rejects_bad_calls_before_running() {
    let row = vec![1.0f32; 128];
    for (dtype, scales, want) in [
        (
            DType::F16,
            [1.0, 1.0],
            LaunchError::UnscaledStorage { dtype: DType::F16 },
        ),
        (DType::Int8, [0.0, 1.0], LaunchError::BadKvScale),
        (DType::Fp8E4m3, [1.0, f32::NAN], LaunchError::BadKvScale),
        (DType::Int8, [-1.0, 1.0], LaunchError::BadKvScale),
        (DType::Int8, [1.0, f32::INFINITY], LaunchError::BadKvScale),
    ] {
        let g = Geometry::new(1, 2, 64, 8, dtype).unwrap();
        let layout = KvLayout::new(g, 2).unwrap();
        let mut a = poisoned(&layout);
        let arena = a.as_bytes_mut();
        let got = emu::write_kv_at_scales(&g, 2, arena, 0, &[3], (&row, &row), scales);
        assert_eq!(got, Err(EmuError::Launch(want)), "{dtype:?} {scales:?}");
        assert!(a.as_bytes().iter().all(|&b| b == 0xFF), "nothing written");
    }
}

/// The bytes of `x` (plain old data without padding: f32, f16, bf16).
fn bytes_of<T: Element>(x: &[T]) -> &[u8] {
    // SAFETY: the storage elements are plain old data of their size, no padding; u8 has
    // alignment 1.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
}

fn check_write_stored<T: Element>(g: Geometry, num_blocks: u32, tokens: u32, seed: u64) {
    let mut rng = Rng::new(seed);
    let layout = KvLayout::new(g, num_blocks).unwrap();
    let mut slots: Vec<u32> = (0..num_blocks * g.block_size()).collect();
    rng.shuffle(&mut slots);
    slots.truncate(tokens as usize);
    let n = tokens as usize * (g.kv_heads() * g.head_dim()) as usize;
    let k: Vec<T> = (0..n).map(|_| T::from_f32(rng.value())).collect();
    let v: Vec<T> = (0..n).map(|_| T::from_f32(rng.value() * 2.0)).collect();
    let layer = rng.below(g.layers());
    let mut cpu = poisoned(&layout);
    kernels::write_kv_as::<T>(&layout, cpu.as_mut_slice::<T>(), layer, &slots, &k, &v).unwrap();
    let mut gpu = poisoned(&layout);
    emu::set_seed(seed);
    emu::write_kv_stored(
        &g,
        num_blocks,
        gpu.as_bytes_mut(),
        layer,
        &slots,
        bytes_of(&k),
        bytes_of(&v),
    )
    .unwrap();
    if let Some(i) = first_difference(cpu.as_bytes(), gpu.as_bytes()) {
        panic!("{g:?} tokens {tokens}: byte {i} differs");
    }
}

#[test]
fn stored_dtype_write_is_bit_exact() {
    let mut seed = 50;
    for (hd, bs, heads, tokens) in [
        (64, 8, 2, 11),
        (128, 16, 1, 30),
        (256, 32, 3, 5),
        (20, 3, 2, 9),
    ] {
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            let g = Geometry::new(2, heads, hd, bs, dtype).unwrap();
            with_element!(dtype, T => check_write_stored::<T>(g, 6, tokens, seed));
            seed += 1;
        }
    }
    let g = Geometry::new(1, 1, 64, 8, DType::Fp8E4m3).unwrap();
    let layout = KvLayout::new(g, 1).unwrap();
    let mut a = poisoned(&layout);
    assert_eq!(
        emu::write_kv_stored(&g, 1, a.as_bytes_mut(), 0, &[0], &[0; 64], &[0; 64]),
        Err(EmuError::Launch(LaunchError::ScaledStorage {
            dtype: DType::Fp8E4m3
        }))
    );
}

#[test]
fn write_rejects_bad_calls_before_running() {
    let g = Geometry::new(1, 2, 64, 8, DType::F16).unwrap();
    let layout = KvLayout::new(g, 2).unwrap();
    let mut a = poisoned(&layout);
    let row = vec![1.0f32; 128];
    let err = emu::write_kv(&g, 2, a.as_bytes_mut(), 0, &[16], &row, &row).unwrap_err();
    assert_eq!(
        err,
        EmuError::Launch(LaunchError::SlotOutOfRange {
            slot: 16,
            slots: 16
        })
    );
    assert!(a.as_bytes().iter().all(|&b| b == 0xFF), "nothing written");
    let bytes = a.as_bytes_mut();
    let len = bytes.len();
    assert!(matches!(
        emu::write_kv(&g, 2, &mut bytes[..len - 2], 0, &[0], &row, &row),
        Err(EmuError::Launch(LaunchError::BufferLength { .. }))
    ));
}

// ----------------------------------------------------------------------------- copy

fn check_copy(g: Geometry, num_blocks: u32, pairs: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let layout = KvLayout::new(g, num_blocks).unwrap();
    let mut cpu = Arena::for_layout(&layout).unwrap();
    for b in cpu.as_bytes_mut() {
        *b = rng.next() as u8;
    }
    let mut gpu = Arena::for_layout(&layout).unwrap();
    gpu.as_bytes_mut().copy_from_slice(cpu.as_bytes());
    // Sources and destinations disjoint (one launch runs them concurrently); some
    // sources copied to several destinations (a fork's copy-on-write of a shared block).
    let mut blocks: Vec<u32> = (0..num_blocks).collect();
    rng.shuffle(&mut blocks);
    let (srcs, dsts) = blocks.split_at(num_blocks as usize / 2);
    let copies: Vec<BlockCopy> = (0..pairs)
        .map(|i| BlockCopy {
            src: srcs[rng.below(srcs.len() as u32) as usize],
            dst: dsts[i],
        })
        .collect();
    with_element!(g.dtype(), T => kernels::copy_blocks::<T>(
        &layout, cpu.as_mut_slice::<T>(), &copies).unwrap());
    emu::set_seed(seed);
    emu::copy_blocks(&g, num_blocks, gpu.as_bytes_mut(), &copies).unwrap();
    if let Some(i) = first_difference(cpu.as_bytes(), gpu.as_bytes()) {
        panic!("{g:?} {pairs} copies: byte {i} differs");
    }
}

#[test]
fn copy_is_bit_exact() {
    let mut seed = 100;
    for dtype in ALL_DTYPES {
        for (layers, heads, hd, bs) in [
            (2, 2, 64, 8),
            (1, 4, 128, 16),
            (3, 1, 256, 32),
            (1, 1, 5, 3),
        ] {
            let g = Geometry::new(layers, heads, hd, bs, dtype).unwrap();
            for pairs in [1, 5] {
                check_copy(g, 12, pairs, seed);
                seed += 1;
            }
        }
    }
}

#[test]
fn copy_rejects_conflicts() {
    let g = Geometry::new(1, 1, 64, 8, DType::F32).unwrap();
    let layout = KvLayout::new(g, 4).unwrap();
    let mut a = Arena::for_layout(&layout).unwrap();
    let chain = [BlockCopy { src: 0, dst: 1 }, BlockCopy { src: 1, dst: 2 }];
    assert_eq!(
        emu::copy_blocks(&g, 4, a.as_bytes_mut(), &chain),
        Err(EmuError::Launch(LaunchError::CopyConflict { block: 1 }))
    );
}

// ------------------------------------------------------------------------ attention

/// One attention case: shapes, sequences `(context_len, queries)`, partitioning.
#[derive(Debug, Clone)]
struct Case {
    dtype: DType,
    head_dim: u32,
    block_size: u32,
    kv_heads: u32,
    q_heads: u32,
    seqs: Vec<(u32, u32)>,
    /// Blocks of a shared prefix that the first two sequences both start with.
    shared_blocks: u32,
    partitioning: Partitioning,
    seed: u64,
}

/// The arena filled with random values: every element of a float dtype; for 8-bit
/// storage every token row of every layer written by the CPU kernel (codes and scales).
fn random_arena<T: Element>(layout: &KvLayout, rng: &mut Rng) -> (Arena, Option<F32Twin>) {
    let mut a = Arena::for_layout(layout).unwrap();
    let g = layout.geometry();
    let mut twin = (g.dtype() == DType::Fp8E4m3).then(|| {
        let g32 = Geometry::new(
            g.layers(),
            g.kv_heads(),
            g.head_dim(),
            g.block_size(),
            DType::F32,
        )
        .unwrap();
        let layout = KvLayout::new(g32, layout.num_blocks()).unwrap();
        let arena = Arena::for_layout(&layout).unwrap();
        F32Twin { layout, arena }
    });
    if g.dtype().is_scaled() {
        let slots: Vec<u32> = (0..layout.num_slots() as u32).collect();
        let n = slots.len() * (g.kv_heads() * g.head_dim()) as usize;
        for layer in 0..g.layers() {
            let k: Vec<f32> = (0..n).map(|i| rng.value() * (1 + i % 5) as f32).collect();
            let v: Vec<f32> = (0..n).map(|_| rng.value()).collect();
            kernels::write_kv::<T>(layout, a.as_mut_slice::<T>(), layer, &slots, &k, &v).unwrap();
            if let Some(t) = twin.as_mut() {
                let (k, v) = (held(g, &k), held(g, &v));
                let f = t.arena.as_mut_slice::<f32>();
                kernels::write_kv::<f32>(&t.layout, f, layer, &slots, &k, &v).unwrap();
            }
        }
    } else {
        for x in a.as_mut_slice::<T>() {
            *x = T::from_f32(rng.value());
        }
    }
    (a, twin)
}

/// The values 8-bit storage of geometry `g` holds for `x` (rows of a head dim): each
/// code times its row's scale, as [`kernels::write_kv`] writes them. O(x.len()).
fn held(g: &Geometry, x: &[f32]) -> Vec<f32> {
    let code = Code::of(g.dtype()).unwrap();
    let hd = g.head_dim() as usize;
    let (mut codes, mut scales) = (vec![0u8; x.len()], vec![0.0f32; x.len() / hd]);
    quantize(code, x, hd, &mut codes, &mut scales);
    let mut out = vec![0.0f32; x.len()];
    dequantize(code, &codes, &scales, hd, &mut out);
    out
}

/// An f32 arena of the same blocks as an FP8 one, holding the values its codes hold
/// ([`held`]): the CPU reference for FP8 attention takes them through its f32
/// arithmetic. The CPU's own FP8 route on AVX512_BF16 rounds queries and softmax
/// weights to bf16 (2^-9 of each), which [`TOLERANCE`] does not allow.
struct F32Twin {
    layout: KvLayout,
    arena: Arena,
}

/// Runs `c` in emulation (scheduled by `c.seed`) and on the CPU, checks the agreement
/// and returns the emulated output.
fn check_attention(c: &Case) -> Vec<f32> {
    check_attention_scheduled(c, c.seed)
}

/// Relative tolerance of attention (as an error norm over a row's norm): f32
/// accumulation in another order than the CPU reference's.
const TOLERANCE: f32 = 1e-4;

/// Relative tolerance of attention over int8 storage. The CPU reference's int8 scores
/// take integer products where the CPU has them (VNNI, AVX2's `vpmaddwd`), on queries
/// rounded to 16-bit fixed point (2^-16 of each row's largest), which host-std's own
/// tests allow 1e-4 absolute on outputs near 1. A random case of this file's proptest
/// differed from the emulated kernel by 1.006e-4 relative with the VNNI reference
/// ([`int8_case_at_the_old_tolerance`]), and by under 1e-4 with the reference capped to
/// f32 arithmetic (`KVPAGE_CPU_PATH=avx512f`).
const INT8_TOLERANCE: f32 = 3e-4;

/// [`check_attention`] with the emulator's CTA and thread order drawn from `schedule`.
fn check_attention_scheduled(c: &Case, schedule: u64) -> Vec<f32> {
    let mut rng = Rng::new(c.seed);
    let bs = c.block_size;
    let max_blocks = c
        .seqs
        .iter()
        .map(|s| s.0.div_ceil(bs))
        .max()
        .unwrap_or(1)
        .max(1);
    let rows = c.seqs.len() as u32 + 1;
    let num_blocks = rows * max_blocks + 3;
    let g = Geometry::new(2, c.kv_heads, c.head_dim, bs, c.dtype).unwrap();
    let layout = KvLayout::new(g, num_blocks).unwrap();
    let (arena, twin) = with_element!(c.dtype, T => random_arena::<T>(&layout, &mut rng));
    // Block table: a shuffled permutation of the blocks, one spare row first (rows are
    // used out of order); the first two sequences share a prefix of blocks.
    let mut ids: Vec<u32> = (0..num_blocks).collect();
    rng.shuffle(&mut ids);
    let stride = max_blocks;
    let mut table = ids[..(rows * stride) as usize].to_vec();
    if c.seqs.len() >= 2 {
        for b in 0..c.shared_blocks.min(stride) as usize {
            table[(2 * stride) as usize + b] = table[stride as usize + b];
        }
    }
    let mut descs = vec![KvpSeqDesc::default(); c.seqs.len()];
    let total = pack_seqs(
        c.seqs
            .iter()
            .enumerate()
            .map(|(i, &(ctx, q))| (i as u32 + 1, ctx, q)),
        &mut descs,
    )
    .unwrap();
    let n = (total * c.q_heads * c.head_dim) as usize;
    let q: Vec<f32> = (0..n).map(|_| rng.value()).collect();
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let layer = 1;

    let queries: Vec<SeqQuery> = descs
        .iter()
        .map(|d| SeqQuery {
            row: d.row,
            context_len: d.context_len,
            queries: d.queries,
        })
        .collect();
    let mut want = vec![f32::NAN; n];
    let params = AttentionParams {
        q_heads: c.q_heads,
        scale,
        pool: None,
    };
    let bt = BlockTable {
        table: &table,
        stride,
    };
    // The reference reads the FP8 arena's f32 twin where there is one.
    let (ref_layout, ref_arena) = twin
        .as_ref()
        .map_or((&layout, &arena), |t| (&t.layout, &t.arena));
    with_element!(ref_layout.geometry().dtype(), T => kernels::paged_attention::<T>(
        ref_layout, ref_arena.as_slice::<T>(), layer, bt, &queries, &q, &mut want, params).unwrap());

    let call = AttentionCall {
        geometry: g,
        num_blocks,
        layer,
        q_heads: c.q_heads,
        scale,
        table: &table,
        stride,
        seqs: &descs,
        q_len: n,
        out_len: n,
    };
    let mut got = vec![f32::NAN; n];
    emu::set_seed(schedule);
    let plan = emu::attention(&call, c.partitioning, arena.as_bytes(), &q, &mut got).unwrap();
    match (c.partitioning, plan) {
        (Partitioning::Tokens(p), Some(plan)) => assert_eq!(plan.partition_tokens, p),
        (_, None) => assert_eq!(n, 0, "no plan only without query rows"),
        _ => {}
    }
    let hd = c.head_dim as usize;
    let tolerance = if c.dtype == DType::Int8 {
        INT8_TOLERANCE
    } else {
        TOLERANCE
    };
    for (r, (a, b)) in got.chunks(hd).zip(want.chunks(hd)).enumerate() {
        let err: f32 = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y) * (x - y))
            .sum::<f32>()
            .sqrt();
        let norm: f32 = b.iter().map(|y| y * y).sum::<f32>().sqrt();
        assert!(
            a.iter().all(|x| x.is_finite()) && err <= tolerance * norm,
            "{c:?}: output row {r} (token {}, head {}): error {err} of {norm}; got {:?}.. want {:?}..",
            r / c.q_heads as usize,
            r % c.q_heads as usize,
            &a[..4],
            &b[..4]
        );
    }
    got
}

/// (kv_heads, q_heads): MHA and GQA 4 (4-row kernels), MQA with 8 query heads (8-row
/// kernels).
const GROUPS: [(u32, u32); 3] = [(2, 2), (2, 8), (1, 8)];

#[test]
fn decode_matches_cpu_across_dtypes_dims_blocks_groups() {
    let mut seed = 1000;
    for dtype in ALL_DTYPES {
        for (i, hd) in [64u32, 128, 256].into_iter().enumerate() {
            for (j, bs) in [8u32, 16, 32].into_iter().enumerate() {
                let (kv_heads, q_heads) = GROUPS[(i + j) % 3];
                // Odd lengths, one of them a single token; partitions of 1 and 2 blocks.
                let seqs = vec![(1, 1), (2 * bs + 3, 1), (45, 1)];
                for partitioning in [
                    Partitioning::Auto { sm_count: 132 },
                    Partitioning::Tokens(bs * (1 + (j as u32 % 2))),
                ] {
                    check_attention(&Case {
                        dtype,
                        head_dim: hd,
                        block_size: bs,
                        kv_heads,
                        q_heads,
                        seqs: seqs.clone(),
                        shared_blocks: 1,
                        partitioning,
                        seed,
                    });
                    seed += 1;
                }
            }
        }
    }
}

#[test]
fn decode_4k_context_auto_partitions() {
    // 4096 tokens on a 132-SM GPU: 16 partitions of 256 tokens, and the reduce.
    check_attention(&Case {
        dtype: DType::F16,
        head_dim: 128,
        block_size: 16,
        kv_heads: 1,
        q_heads: 4,
        seqs: vec![(4096, 1), (4001, 1)],
        shared_blocks: 100,
        partitioning: Partitioning::Auto { sm_count: 132 },
        seed: 2500,
    });
}

#[test]
fn decode_32k_context_split_128_ways() {
    // The split-K case: one sequence of 32k tokens fills a 132-SM GPU only through
    // partitions (128 of 256 tokens), combined by the reduce.
    check_attention(&Case {
        dtype: DType::Bf16,
        head_dim: 128,
        block_size: 32,
        kv_heads: 1,
        q_heads: 4,
        seqs: vec![(32_768, 1)],
        shared_blocks: 0,
        partitioning: Partitioning::Auto { sm_count: 132 },
        seed: 2600,
    });
}

#[test]
fn decode_long_contexts_with_many_partitions() {
    // A few long contexts (the case partitions are for), GQA 4 and MQA with 16 query
    // heads (two row tiles per KV head).
    for (seed, (dtype, hd, bs, kv, qh, part)) in [
        (
            DType::F16,
            128,
            16,
            2,
            8,
            Partitioning::Auto { sm_count: 132 },
        ),
        (DType::Bf16, 64, 32, 1, 16, Partitioning::Tokens(96)),
        (DType::F32, 256, 8, 1, 4, Partitioning::Tokens(512)),
        (DType::Int8, 128, 16, 2, 16, Partitioning::Tokens(256)),
    ]
    .into_iter()
    .enumerate()
    {
        check_attention(&Case {
            dtype,
            head_dim: hd,
            block_size: bs,
            kv_heads: kv,
            q_heads: qh,
            seqs: vec![(1531, 1), (700, 1)],
            shared_blocks: 10,
            partitioning: part,
            seed: 2000 + seed as u64,
        });
    }
}

#[test]
fn prefill_matches_cpu() {
    let mut seed = 3000;
    for dtype in ALL_DTYPES {
        for (i, (hd, bs)) in [(64, 8), (128, 16), (256, 32)].into_iter().enumerate() {
            let (kv_heads, q_heads) = GROUPS[i];
            // A chunk of new tokens over a cached context, a whole prompt, a decode row
            // in the same launch, a sequence with no queries.
            let seqs = vec![(50, 7), (19, 19), (33, 1), (9, 0)];
            for partitioning in [
                Partitioning::Auto { sm_count: 132 },
                Partitioning::Tokens(2 * bs),
            ] {
                check_attention(&Case {
                    dtype,
                    head_dim: hd,
                    block_size: bs,
                    kv_heads,
                    q_heads,
                    seqs: seqs.clone(),
                    shared_blocks: 2,
                    partitioning,
                    seed,
                });
                seed += 1;
            }
        }
    }
}

#[test]
fn output_does_not_depend_on_the_schedule() {
    // Every output element has one writer and a fixed order of arithmetic: any CTA and
    // thread order (the emulator's seed) gives the same bits, or a barrier is missing.
    let case = |seed| Case {
        dtype: DType::Bf16,
        head_dim: 64,
        block_size: 8,
        kv_heads: 2,
        q_heads: 8,
        seqs: vec![(77, 5), (150, 1)],
        shared_blocks: 2,
        partitioning: Partitioning::Tokens(32),
        seed,
    };
    let c = case(11);
    let first = check_attention(&c);
    for schedule in [0, 12, 13] {
        let again = check_attention_scheduled(&c, schedule);
        assert!(
            first
                .iter()
                .zip(&again)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "schedule {schedule} changed the output"
        );
    }
}

#[test]
fn long_prefill_chunk_with_partitions() {
    // 70 new tokens over 230 cached ones, GQA 4: 70 tiles of the 4-row kernel, split in partitions of 64 tokens (the reduce per row sees
    // only the partitions its causal limit reaches).
    for (seed, dtype) in [DType::F16, DType::Bf16, DType::Fp8E4m3]
        .into_iter()
        .enumerate()
    {
        check_attention(&Case {
            dtype,
            head_dim: 128,
            block_size: 16,
            kv_heads: 2,
            q_heads: 8,
            seqs: vec![(300, 70), (65, 64)],
            shared_blocks: 3,
            partitioning: Partitioning::Tokens(64),
            seed: 4000 + seed as u64,
        });
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Small random shapes: any mix of decode and prefill rows, any partitioning.
    #[test]
    fn attention_matches_cpu_on_random_shapes(
        dtype in prop::sample::select(ALL_DTYPES.to_vec()),
        hd in prop::sample::select(vec![64u32, 128, 256]),
        bs in prop::sample::select(vec![8u32, 16, 32]),
        group in prop::sample::select(vec![(1u32, 1u32), (2, 4), (1, 8), (4, 2)]),
        seqs in prop::collection::vec((1u32..200, 0u32..12), 1..5),
        blocks_per_part in 1u32..4,
        auto in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let (kv_heads, per_kv) = group;
        let seqs: Vec<(u32, u32)> = seqs.into_iter().map(|(ctx, q)| (ctx, q.min(ctx))).collect();
        let partitioning = if auto {
            Partitioning::Auto { sm_count: 8 }
        } else {
            Partitioning::Tokens(bs * blocks_per_part)
        };
        check_attention(&Case {
            dtype,
            head_dim: hd,
            block_size: bs,
            kv_heads,
            q_heads: kv_heads * per_kv,
            seqs,
            shared_blocks: 1,
            partitioning,
            seed,
        });
    }
}

// -------------------------------------------------------------- index and conversions

#[test]
fn index_functions_agree_with_the_core_past_32_bits() {
    // 80 layers x 8 heads x 128 x 32 tokens, f16: 5.2 M elements per block, so block
    // 900 000 starts past 2^32 elements (and bytes).
    for dtype in [DType::F16, DType::Int8] {
        let g = Geometry::new(80, 8, 128, 32, dtype).unwrap();
        let k = KvpGeometry::new(&g, u32::MAX);
        for (block, layer, kv, head, row) in [
            (0, 0, 0, 0, 0),
            (900_000, 79, 1, 7, 31),
            (u32::MAX - 1, 40, 0, 3, 17),
        ] {
            let tile = g.tile_offset(layer, kv, head);
            assert_eq!(index::tile_offset(&k, layer, kv, head), tile);
            let start = u64::from(block) * g.elems_per_block();
            assert!(block < 900_000 || start > u64::from(u32::MAX));
            assert_eq!(index::block_offset(&k, block), start);
            assert_eq!(
                index::row_offset(&k, block, layer, kv, head, row),
                start + tile + u64::from(row) * 128
            );
            assert_eq!(
                index::scale_offset(&k, block, layer, kv, head, row),
                start + tile + 32 * 128 + 4 * u64::from(row)
            );
        }
    }
    assert_eq!(index::slot(u32::MAX, 32), (u32::MAX / 32, 31));
    assert_eq!(index::slot(77, 16), (4, 13));
    let (rows, heads, parts) = (4_000_000u32, 64u32, 128u32);
    assert_eq!(
        index::scratch_stat(rows - 1, heads - 1, parts - 1, heads, parts),
        u64::from(rows) * u64::from(heads) * u64::from(parts) - 1
    );
    assert_eq!(
        index::query_offset(rows - 1, 3, heads, 256),
        (u64::from(rows - 1) * 64 + 3) * 256
    );
}

#[test]
fn f16_and_bf16_conversions_match_the_half_crate() {
    for h in 0..=u16::MAX {
        let want = f16::from_bits(h).to_f32();
        let got = convert::f16_to_f32(h);
        assert!(got.to_bits() == want.to_bits(), "f16 {h:#06x}");
    }
    let mut rng = Rng::new(7);
    let check = |x: f32| {
        assert_eq!(
            convert::f32_to_f16(x),
            f16::from_f32(x).to_bits(),
            "f16 of {x:e} ({:#010x})",
            x.to_bits()
        );
        let mut b = [bf16::ZERO];
        bf16::narrow(&[x], &mut b);
        assert_eq!(convert::f32_to_bf16(x), b[0].to_bits(), "bf16 of {x:e}");
    };
    for _ in 0..200_000 {
        check(f32::from_bits(rng.next() as u32));
    }
    // Halfway cases and the edges: every f16 value plus and minus half a step.
    for h in 0..0x7C00u16 {
        let x = f16::from_bits(h).to_f32();
        for d in [-1i32, 0, 1] {
            let bits = (x.to_bits() as i32 + d * 0x1000) as u32;
            check(f32::from_bits(bits));
            check(-f32::from_bits(bits));
        }
    }
    for x in [
        65504.0,
        65519.99,
        65520.0,
        f32::INFINITY,
        5.9604645e-8,
        2.9802322e-8,
        2.9802326e-8,
    ] {
        check(x);
        check(-x);
    }
}

#[test]
fn eight_bit_codes_match_the_cpu_codec() {
    let mut rng = Rng::new(9);
    for (dtype, code) in [(DType::Int8, Code::Int8), (DType::Fp8E4m3, Code::Fp8E4m3)] {
        let d = dtype_code(dtype);
        for _ in 0..100_000 {
            let absmax = rng.value().abs() * 100.0;
            let s = code.scale_for(absmax);
            assert_eq!(convert::scale_for(d, absmax).to_bits(), s.to_bits());
            let x = rng.value() * absmax * 1.01;
            assert_eq!(
                convert::encode8(d, x, s),
                code.encode(x, s),
                "{dtype:?} {x} / {s}"
            );
        }
        for c in 0..=255u8 {
            let (got, want) = (convert::decode8(d, c), code.decode(c));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{dtype:?} code {c:#04x}: {got} vs {want}"
            );
        }
        assert_eq!(convert::scale_for(d, 0.0), 1.0);
        assert_eq!(convert::scale_for(d, f32::INFINITY), 1.0);
        assert_eq!(
            convert::encode8(d, f32::NAN, 1.0),
            code.encode(f32::NAN, 1.0)
        );
    }
}

#[test]
fn unknown_dtype_and_head_dim_have_no_kernel() {
    let g = Geometry::new(1, 1, 96, 8, DType::F16).unwrap();
    let table = [0u32];
    let mut descs = [KvpSeqDesc::default()];
    pack_seqs([(0, 3, 1)], &mut descs).unwrap();
    let call = AttentionCall {
        geometry: g,
        num_blocks: 1,
        layer: 0,
        q_heads: 1,
        scale: 1.0,
        table: &table,
        stride: 1,
        seqs: &descs,
        q_len: 96,
        out_len: 96,
    };
    let layout = KvLayout::new(g, 1).unwrap();
    let arena = Arena::for_layout(&layout).unwrap();
    let mut out = vec![0.0; 96];
    assert_eq!(
        emu::attention(
            &call,
            Partitioning::Tokens(8),
            arena.as_bytes(),
            &[0.5; 96],
            &mut out
        ),
        Err(EmuError::Launch(LaunchError::UnsupportedHeadDim {
            head_dim: 96
        }))
    );
}

/// The case that failed CI (December 2026) at 1e-4: int8, the reference's 16-bit
/// queries 1.006e-4 relative off the emulated kernel's f32 ([`INT8_TOLERANCE`]).
#[test]
fn int8_case_at_the_old_tolerance() {
    check_attention(&Case {
        dtype: DType::Int8,
        head_dim: 64,
        block_size: 32,
        kv_heads: 4,
        q_heads: 8,
        seqs: vec![(11, 11), (121, 9)],
        shared_blocks: 1,
        partitioning: Partitioning::Tokens(32),
        seed: 16429788032277744302,
    });
}
