//! One cache type, two backends: a CPU [`KvCache`] and a CUDA one driven through the
//! same API must agree — stored bytes bit for bit (every block read back with
//! [`KvCache::read_block`]), attention within a tolerance (the accumulation order
//! differs), engine steps with swaps and copy-on-write in lockstep. Every test needs a
//! GPU: `#[ignore = "needs a CUDA device"]`, run by `cuda-backend/gpu-check.sh run`.
//! The typed errors without one are in `tests/backend.rs`.
//!
//! The core allocates deterministically, so both caches get the same block tables.

#![cfg(feature = "cuda")]

mod common;

use common::{random_vec, rng};
use rand::rngs::StdRng;
use rand::RngExt;

use kvpage::{
    Backend, CacheConfig, CacheError, Capacity, CudaOptions, DType, Engine, EngineConfig, Geometry,
    KvCache, Preemption, RopeParams, Sampled, SchedulerConfig, Seq,
};

fn config(g: Geometry, blocks: u32, max_seq_len: u32) -> CacheConfig {
    CacheConfig {
        geometry: g,
        capacity: Capacity::Blocks(blocks),
        max_seqs: 16,
        max_seq_len,
        threads: 1,
        event_capacity: 0,
        hash_key: Some(7),
        max_namespaces: kvpage::CACHE_NAMESPACES,
    }
}

fn cuda(q_heads: u32) -> Backend {
    Backend::Cuda(CudaOptions {
        device: 0,
        memory_fraction: None,
        reserve_bytes: 0,
        q_heads,
        max_step_tokens: 512,
    })
}

/// `got` within the tolerance of the CPU's `want` for `dtype`.
fn assert_close(want: &[f32], got: &[f32], dtype: DType) {
    let max = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let tol = 1e-5 + max * if dtype == DType::F32 { 2e-5 } else { 1e-4 };
    for (i, (a, b)) in want.iter().zip(got).enumerate() {
        assert!(
            (a - b).abs() <= tol,
            "out[{i}]: cpu {a} gpu {b} (tol {tol})"
        );
    }
}

/// Every block of both caches equal, byte for byte.
fn assert_blocks_equal(cpu: &mut KvCache, gpu: &mut KvCache) {
    let bpb = cpu.geometry().bytes_per_block() as usize;
    let (mut a, mut b) = (vec![0u8; bpb], vec![0u8; bpb]);
    for block in 0..cpu.layout().num_blocks() {
        cpu.read_block(block, &mut a).unwrap();
        gpu.read_block(block, &mut b).unwrap();
        assert!(a == b, "block {block} differs");
    }
}

struct Pair {
    cpu: KvCache,
    gpu: KvCache,
    seqs: Vec<Seq>,
    q_heads: u32,
}

impl Pair {
    fn new(g: Geometry, blocks: u32, max_seq_len: u32, q_heads: u32) -> Self {
        let gpu = KvCache::with_backend(config(g, blocks, max_seq_len), cuda(q_heads))
            .expect("CUDA cache");
        Self {
            cpu: KvCache::new(config(g, blocks, max_seq_len)).unwrap(),
            gpu,
            seqs: Vec::new(),
            q_heads,
        }
    }

    fn create(&mut self) -> usize {
        let c = self.cpu.create(0).unwrap();
        assert_eq!(self.gpu.create(0).unwrap(), c, "same handles");
        self.seqs.push(c);
        self.seqs.len() - 1
    }

    fn append(&mut self, i: usize, n: u32) {
        let s = self.seqs[i];
        self.cpu.append(s, n).unwrap();
        self.gpu.append(s, n).unwrap();
        assert_eq!(
            self.cpu.block_manager().block_table(),
            self.gpu.block_manager().block_table()
        );
    }

    fn write(&mut self, rng: &mut StdRng, i: usize, first: u32, end: u32) {
        let s = self.seqs[i];
        let g = *self.cpu.geometry();
        let row = (g.kv_heads() * g.head_dim()) as usize;
        for layer in 0..g.layers() {
            let mut at = first;
            while at < end {
                let n = (end - at).min(97); // odd chunks
                let (k, v) = (
                    random_vec(rng, n as usize * row),
                    random_vec(rng, n as usize * row),
                );
                self.cpu.write_kv(s, layer, at, &k, &v).unwrap();
                self.gpu.write_kv(s, layer, at, &k, &v).unwrap();
                at += n;
            }
        }
        self.cpu.commit(s).unwrap();
        self.gpu.commit(s).unwrap();
    }

    fn attention(&mut self, rng: &mut StdRng, layer: u32, queries: &[u32]) {
        let g = *self.cpu.geometry();
        let per = (self.q_heads * g.head_dim()) as usize;
        let total: u32 = queries.iter().sum();
        let q = random_vec(rng, total as usize * per);
        let (mut want, mut got) = (vec![0f32; q.len()], vec![f32::NAN; q.len()]);
        let scale = 1.0 / (g.head_dim() as f32).sqrt();
        let h = self.q_heads;
        if queries.iter().all(|&n| n == 1) {
            let seqs = &self.seqs[..queries.len()];
            self.cpu
                .decode(layer, seqs, &q, &mut want, h, scale)
                .unwrap();
            self.gpu
                .decode(layer, seqs, &q, &mut got, h, scale)
                .unwrap();
        } else {
            let seqs: Vec<(Seq, u32)> = self
                .seqs
                .iter()
                .copied()
                .zip(queries.iter().copied())
                .collect();
            self.cpu
                .prefill(layer, &seqs, &q, &mut want, h, scale)
                .unwrap();
            self.gpu
                .prefill(layer, &seqs, &q, &mut got, h, scale)
                .unwrap();
        }
        assert_close(&want, &got, g.dtype());
    }
}

/// Both caches through one scenario: a fragmented pool, odd-length sequences written
/// in chunks, a fork whose append copies a shared partial block, decode and prefill.
fn scenario(dtype: DType, head_dim: u32, block_size: u32, group: u32, contexts: &[u32]) {
    let g = Geometry::new(2, 2, head_dim, block_size, dtype).unwrap();
    let max_len = contexts.iter().max().copied().unwrap_or(1) + 8;
    let blocks = contexts
        .iter()
        .map(|c| c.div_ceil(block_size) + 2)
        .sum::<u32>()
        + 64;
    let mut pair = Pair::new(g, blocks, max_len, 2 * group);
    let mut rng = rng(0x9e37_79b9_7f4a_7c15 ^ u64::from(head_dim * block_size * group));
    for _ in 0..8 {
        let i = pair.create();
        let n = 1 + rng.random_range(0..4 * block_size);
        pair.append(i, n);
    }
    for i in (0..8).step_by(2).rev() {
        let s = pair.seqs.remove(i);
        pair.cpu.release(s).unwrap();
        pair.gpu.release(s).unwrap();
    }
    pair.seqs.clear();
    for &ctx in contexts {
        let i = pair.create();
        pair.append(i, ctx);
        pair.write(&mut rng, i, 0, ctx);
    }
    let parent = pair.seqs[0];
    let child = pair.cpu.fork(parent).unwrap();
    assert_eq!(pair.gpu.fork(parent).unwrap(), child);
    pair.seqs.push(child);
    let last = pair.seqs.len() - 1;
    let len = pair.gpu.len(child).unwrap();
    pair.append(last, 1);
    pair.write(&mut rng, last, len, len + 1);
    assert_blocks_equal(&mut pair.cpu, &mut pair.gpu);
    let n = pair.seqs.len();
    pair.attention(&mut rng, 1, &vec![1; n]);
    let queries: Vec<u32> = pair
        .seqs
        .iter()
        .map(|&s| pair.gpu.len(s).unwrap().min(7))
        .collect();
    pair.attention(&mut rng, 0, &queries);
}

#[test]
#[ignore = "needs a CUDA device"]
fn matrix_of_dtypes_head_dims_block_sizes_and_groups() {
    for dtype in [
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::Int8,
        DType::Fp8E4m3,
    ] {
        for head_dim in [64, 128, 256] {
            for block_size in [8, 16, 32] {
                for group in [1, 4] {
                    scenario(dtype, head_dim, block_size, group, &[1, 13, 100, 257]);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn long_contexts_use_partitions() {
    for dtype in [DType::F16, DType::Bf16] {
        scenario(dtype, 128, 16, 4, &[32_768, 4_097, 1]);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn stored_dtype_writes_match() {
    let g = Geometry::new(2, 2, 64, 16, DType::F16).unwrap();
    let mut pair = Pair::new(g, 32, 256, 4);
    let i = pair.create();
    pair.append(i, 40);
    let s = pair.seqs[i];
    let mut rng = rng(11);
    let k: Vec<kvpage::f16> = random_vec(&mut rng, 40 * 128)
        .into_iter()
        .map(kvpage::f16::from_f32)
        .collect();
    for layer in 0..2 {
        pair.cpu.write_kv_as(s, layer, 0, &k, &k).unwrap();
        pair.gpu.write_kv_as(s, layer, 0, &k, &k).unwrap();
    }
    assert_blocks_equal(&mut pair.cpu, &mut pair.gpu);
    // The wrong dtype: refused alike, nothing written.
    let wrong = vec![0f32; 128];
    assert_eq!(
        pair.cpu.write_kv_as(s, 0, 0, &wrong, &wrong).unwrap_err(),
        pair.gpu.write_kv_as(s, 0, 0, &wrong, &wrong).unwrap_err()
    );
}

/// 8-bit writes at fixed per-layer scales (saturating: random values past 0.004 × the
/// code's largest) store the same bytes on both backends, and attend alike.
#[test]
#[ignore = "needs a CUDA device"]
fn fixed_scale_writes_match() {
    for dtype in [DType::Int8, DType::Fp8E4m3] {
        let g = Geometry::new(2, 2, 128, 16, dtype).unwrap();
        let mut pair = Pair::new(g, 32, 256, 4);
        let fixed = kvpage::KvScales::new(0.004, 0.002).unwrap();
        for cache in [&mut pair.cpu, &mut pair.gpu] {
            cache.set_kv_scales(1, Some(fixed)).unwrap();
        }
        let i = pair.create();
        pair.append(i, 40);
        let mut rng = rng(23);
        pair.write(&mut rng, i, 0, 40);
        assert_blocks_equal(&mut pair.cpu, &mut pair.gpu);
        for layer in 0..2 {
            pair.attention(&mut rng, layer, &[1]);
        }
    }
}

/// Re-rotating keys (alone and after a context shift) leaves the same blocks on both
/// backends; a shared block is refused alike, changing nothing.
#[test]
#[ignore = "needs a CUDA device"]
fn rotated_keys_match() {
    let g = Geometry::new(2, 2, 64, 16, DType::F16).unwrap();
    let mut pair = Pair::new(g, 32, 256, 4);
    let i = pair.create();
    pair.append(i, 70);
    let mut rng = rng(13);
    // Appended without token ids: committed blocks are not registered, so rotatable.
    pair.write(&mut rng, i, 0, 70);
    let s = pair.seqs[i];
    let rope = RopeParams {
        base: 10_000.0,
        rotary_dims: 64,
        pairing: kvpage::RopePairing::Interleaved,
    };
    pair.cpu.rotate_keys(s, 5, 41, -7, rope).unwrap();
    pair.gpu.rotate_keys(s, 5, 41, -7, rope).unwrap();
    assert_blocks_equal(&mut pair.cpu, &mut pair.gpu);
    assert_eq!(
        pair.cpu.context_shift_rotated(s, 4, 12, rope).unwrap(),
        pair.gpu.context_shift_rotated(s, 4, 12, rope).unwrap()
    );
    assert_blocks_equal(&mut pair.cpu, &mut pair.gpu);
    let child = pair.cpu.fork(s).unwrap();
    assert_eq!(pair.gpu.fork(s).unwrap(), child);
    let want = pair.cpu.rotate_keys(s, 0, 8, 2, rope).unwrap_err();
    let got = pair.gpu.rotate_keys(s, 0, 8, 2, rope).unwrap_err();
    assert!(matches!(got, CacheError::BlockShared { .. }), "{got}");
    assert_eq!(got, want);
    assert_blocks_equal(&mut pair.cpu, &mut pair.gpu);
}

/// The same requests through a CPU and a CUDA engine with too little memory for all of
/// them (swaps), prompts sharing a prefix (copy-on-write at the fork): in lockstep,
/// both sampling the CPU's argmax.
#[test]
#[ignore = "needs a CUDA device"]
fn engine_steps_with_swaps_match() {
    let g = Geometry::new(2, 2, 64, 8, DType::Bf16).unwrap();
    let q_heads = 4;
    let config = EngineConfig {
        cache: CacheConfig {
            max_seqs: 5,
            ..config(g, 14, 40)
        },
        max_requests: 8,
        scheduler: SchedulerConfig {
            token_budget: 12,
            max_running: 4,
            watermark_blocks: 0,
            preemption: Preemption::Swap,
        },
        host_capacity: Capacity::Blocks(40),
    };
    let mut cpu = Engine::new(config).unwrap();
    let mut gpu = Engine::with_backend(config, cuda(q_heads)).expect("CUDA engine");
    let shared = [3u32, 17, 5, 5, 22, 9, 31, 0, 12];
    let mut requests = Vec::new();
    for i in 0..6u32 {
        let mut prompt = if i % 2 == 0 {
            shared.to_vec()
        } else {
            vec![1 + i, 2, 3]
        };
        prompt.extend([i, i * 7]);
        let r = cpu.add_request(&prompt, 1, Some(10)).unwrap();
        assert_eq!(gpu.add_request(&prompt, 1, Some(10)).unwrap(), r);
        requests.push(r);
    }
    let mut rng = rng(17);
    let row = (g.kv_heads() * g.head_dim()) as usize;
    let per = (q_heads * g.head_dim()) as usize;
    let mut forked = false;
    for _ in 0..400 {
        if cpu.in_flight() == 0 {
            break;
        }
        let step = cpu.step().unwrap();
        let (tokens, emits): (usize, Vec<_>) = (
            step.slots().len(),
            step.seqs()
                .filter(|s| s.emits)
                .map(|s| (s.request, s.offset + s.tokens - 1))
                .collect(),
        );
        let gstep = gpu.step().unwrap();
        assert_eq!(gstep.slots().len(), tokens);
        let mut outs = Vec::new();
        for layer in 0..g.layers() {
            let (k, v) = (
                random_vec(&mut rng, tokens * row),
                random_vec(&mut rng, tokens * row),
            );
            let q = random_vec(&mut rng, tokens * per);
            cpu.write_kv(layer, &k, &v).unwrap();
            gpu.write_kv(layer, &k, &v).unwrap();
            let (mut want, mut got) = (vec![0f32; q.len()], vec![f32::NAN; q.len()]);
            cpu.attention(layer, &q, &mut want, q_heads, 0.125).unwrap();
            gpu.attention(layer, &q, &mut got, q_heads, 0.125).unwrap();
            assert_close(&want, &got, g.dtype());
            outs = want;
        }
        let samples: Vec<Sampled> = emits
            .iter()
            .map(|&(request, at)| {
                let o = &outs[at as usize * per..][..per];
                let token = o
                    .iter()
                    .enumerate()
                    .fold(0, |m, (i, &x)| if x > o[m] { i } else { m });
                Sampled {
                    request,
                    token: token as u32 % 40,
                    stop: false,
                }
            })
            .collect();
        let a: Vec<_> = cpu
            .commit_step(&samples)
            .unwrap()
            .iter()
            .map(|f| f.request)
            .collect();
        let b: Vec<_> = gpu
            .commit_step(&samples)
            .unwrap()
            .iter()
            .map(|f| f.request)
            .collect();
        assert_eq!(a, b);
        if !forked && cpu.tokens(requests[0]).is_ok_and(|t| t.len() > 11) {
            let child = cpu.fork(requests[0], Some(1)).unwrap();
            assert_eq!(gpu.fork(requests[0], Some(1)).unwrap(), child);
            forked = true;
        }
    }
    assert_eq!(cpu.in_flight(), 0);
    assert_eq!(cpu.stats(), gpu.stats());
    assert!(
        cpu.stats().swap_outs > 0 && cpu.stats().swap_ins > 0,
        "{:?}",
        cpu.stats()
    );
    assert!(forked);
}

/// Bad input gives the same typed error on both backends, and changes nothing.
#[test]
#[ignore = "needs a CUDA device"]
fn bad_input_gives_the_same_errors() {
    let g = Geometry::new(2, 2, 64, 16, DType::F16).unwrap();
    let mut pair = Pair::new(g, 32, 256, 4);
    let i = pair.create();
    pair.append(i, 20);
    let s = pair.seqs[i];
    let kv = vec![0.5f32; 20 * 128];
    let q = vec![0.5f32; 4 * 64];
    let mut out = vec![0f32; q.len()];
    type Call = fn(&mut KvCache, Seq, &[f32], &[f32], &mut [f32]) -> Result<(), CacheError>;
    let calls: [(&str, Call); 4] = [
        ("layer 9", |c, s, kv, _, _| c.write_kv(s, 9, 0, kv, kv)),
        ("short v", |c, s, kv, _, _| {
            c.write_kv(s, 0, 0, kv, &kv[1..])
        }),
        ("short out", |c, s, _, q, out| {
            c.decode(0, &[s], q, &mut out[1..], 4, 0.1)
        }),
        ("too many queries", |c, s, _, _, _| {
            let q = vec![0.5f32; 21 * 4 * 64];
            let mut out = vec![0f32; q.len()];
            c.prefill(0, &[(s, 21)], &q, &mut out, 4, 0.1)
        }),
    ];
    for (what, call) in calls {
        let want = call(&mut pair.cpu, s, &kv, &q, &mut out).unwrap_err();
        let got = call(&mut pair.gpu, s, &kv, &q, &mut out).unwrap_err();
        assert_eq!(got, want, "{what}");
    }
    assert_eq!(pair.gpu.stats(), pair.cpu.stats());
    assert_blocks_equal(&mut pair.cpu, &mut pair.gpu);
}

/// A sequence saved from either backend is the same blob, byte for byte, and restores
/// into either backend with the same blocks; a prefix-cache file too.
#[test]
#[ignore = "needs a CUDA device"]
fn save_and_restore_across_backends() {
    for dtype in [DType::F16, DType::Int8] {
        let g = Geometry::new(2, 2, 64, 16, dtype).unwrap();
        let mut pair = Pair::new(g, 64, 256, 4);
        let mut rng = rng(19);
        let i = pair.create();
        let tokens: Vec<u32> = (0..45).collect();
        let s = pair.seqs[i];
        pair.cpu.append_tokens(s, &tokens).unwrap();
        pair.gpu.append_tokens(s, &tokens).unwrap();
        pair.write(&mut rng, i, 0, 45);
        let fp = kvpage::ModelFingerprint::from_u64(5);
        let size = pair.cpu.saved_seq_size(s, true).unwrap();
        let (mut a, mut b) = (vec![0u8; size], vec![0u8; size]);
        pair.cpu.save_seq(s, Some(&tokens), &fp, &mut a).unwrap();
        pair.gpu.save_seq(s, Some(&tokens), &fp, &mut b).unwrap();
        assert!(a == b, "{dtype:?}: blobs differ");
        // Each backend restores the other's blob.
        let (rc, _) = pair.cpu.restore_seq(&b, 3, &fp).unwrap();
        let (rg, _) = pair.gpu.restore_seq(&a, 3, &fp).unwrap();
        assert_eq!(rc, rg);
        assert_blocks_equal(&mut pair.cpu, &mut pair.gpu);
        pair.seqs.push(rc);
        pair.attention(&mut rng, 1, &[1, 1]);
        // The prefix cache (the committed full blocks) saves the same file.
        let n = usize::try_from(pair.cpu.saved_prefix_cache_size()).unwrap();
        let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
        pair.cpu.save_prefix_cache(&fp, &mut a).unwrap();
        pair.gpu.save_prefix_cache(&fp, &mut b).unwrap();
        assert!(a == b, "{dtype:?}: prefix files differ");
    }
}

/// Edits (their block copies and row moves) leave the same blocks on both backends.
#[test]
#[ignore = "needs a CUDA device"]
fn edits_match() {
    for dtype in [DType::Bf16, DType::Fp8E4m3] {
        let g = Geometry::new(2, 2, 64, 8, dtype).unwrap();
        let mut pair = Pair::new(g, 64, 128, 4);
        let mut rng = rng(23);
        let i = pair.create();
        pair.append(i, 61);
        pair.write(&mut rng, i, 0, 61);
        let s = pair.seqs[i];
        let child = pair.cpu.fork(s).unwrap();
        assert_eq!(pair.gpu.fork(s).unwrap(), child);
        pair.seqs.push(child);
        // Unaligned: rows move down within and across blocks; the shared blocks of the
        // fork are copied first.
        assert_eq!(
            pair.cpu.remove_range(child, 5, 14).unwrap(),
            pair.gpu.remove_range(child, 5, 14).unwrap()
        );
        assert_eq!(
            pair.cpu.context_shift(s, 3, 10).unwrap(),
            pair.gpu.context_shift(s, 3, 10).unwrap()
        );
        let copy = pair.cpu.copy_range(child, 3, 30, 0).unwrap();
        assert_eq!(pair.gpu.copy_range(child, 3, 30, 0).unwrap(), copy);
        pair.seqs.push(copy);
        assert_eq!(
            pair.cpu.make_exclusive(copy, 0, 27).unwrap(),
            pair.gpu.make_exclusive(copy, 0, 27).unwrap()
        );
        assert_eq!(
            pair.cpu.block_manager().block_table(),
            pair.gpu.block_manager().block_table()
        );
        assert_blocks_equal(&mut pair.cpu, &mut pair.gpu);
        pair.attention(&mut rng, 1, &[1, 1, 1]);
    }
}
