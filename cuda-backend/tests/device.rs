//! The device cache against the CPU backend (host-std's `KvCache`) on a real GPU:
//! every test that needs one is `#[ignore = "needs a CUDA device"]` and runs through
//! `cuda-backend/gpu-check.sh run`. The others run in CI (no driver there): creating a
//! device cache must then fail with a typed error, never a crash.
//!
//! Storage dtypes: f32, f16, bf16, int8 and fp8 e4m3 (the 8-bit writes are bit-exact
//! too). The scenario drives both caches with the same operations (the core allocates
//! deterministically, so their block tables are equal): a fragmented pool (shuffled
//! block tables), sequences of odd lengths written in chunks, a fork whose append
//! copies a shared partial block, decode and chunked prefill. Writes and copies are
//! compared bit for bit (the whole arena), attention within a tolerance (the
//! accumulation order differs).

#![cfg(feature = "cuda")]

use kvpage::{CacheConfig, Capacity, DType, Geometry, KvCache, Seq};
use kvpage_core::SeqId;
use kvpage_cuda::device::{
    Context, DeviceCache, DeviceCacheConfig, DeviceCacheError, DeviceMemory, Direction, HostTier,
    PinnedMemory, Stream,
};
use kvpage_cuda::driver::DriverError;
use kvpage_cuda::sizing::ArenaSize;

/// xorshift64*: deterministic inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn fill(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
}

const Q_GROUP: [u32; 2] = [1, 4];

struct Pair<'a> {
    cpu: KvCache,
    gpu: DeviceCache<'a>,
    seqs: Vec<(Seq, SeqId)>,
    q_heads: u32,
}

fn config(g: Geometry, blocks: u32, max_seq_len: u32, q_heads: u32) -> DeviceCacheConfig {
    DeviceCacheConfig {
        geometry: g,
        device: 0,
        arena: ArenaSize::Blocks(blocks),
        reserve_bytes: 0,
        max_seqs: 16,
        max_seq_len,
        max_step_tokens: 512,
        q_heads,
    }
}

fn cpu_cache(g: Geometry, blocks: u32, max_seq_len: u32) -> KvCache {
    KvCache::new(CacheConfig {
        geometry: g,
        capacity: Capacity::Blocks(blocks),
        max_seqs: 16,
        max_seq_len,
        threads: 1,
        event_capacity: 0,
        hash_key: Some(7),
    })
    .expect("CPU cache")
}

impl Pair<'_> {
    fn create(&mut self) -> usize {
        let c = self.cpu.create(0).unwrap();
        let g = self.gpu.create(0).unwrap();
        assert_eq!(c.id().index(), g.index());
        self.seqs.push((c, g));
        self.seqs.len() - 1
    }

    fn append(&mut self, i: usize, n: u32) {
        let (c, g) = self.seqs[i];
        self.cpu.append(c, n).unwrap();
        self.gpu.append(g, n).unwrap();
        assert_eq!(
            self.cpu.block_manager().block_table(),
            self.gpu.block_manager().block_table()
        );
    }

    fn write(&mut self, rng: &mut Rng, i: usize, first: u32, end: u32) {
        let (c, g) = self.seqs[i];
        let geo = *self.gpu.geometry();
        let row = (geo.kv_heads() * geo.head_dim()) as usize;
        for layer in 0..geo.layers() {
            let mut at = first;
            while at < end {
                let n = (end - at).min(97); // odd chunks
                let k = rng.fill(n as usize * row);
                let v = rng.fill(n as usize * row);
                self.cpu.write_kv(c, layer, at, &k, &v).unwrap();
                self.gpu.write_kv(g, layer, at, &k, &v).unwrap();
                at += n;
            }
        }
        self.cpu.commit(c).unwrap();
        self.gpu.commit(g).unwrap();
    }

    fn arenas_equal(&self) {
        let ctx = self.gpu.context();
        let bytes = self.gpu.arena().len();
        let mut host = PinnedMemory::new(ctx, bytes).unwrap();
        let stream = Stream::new(ctx).unwrap();
        // SAFETY: the whole arena into a buffer of its size; waited for below.
        unsafe {
            stream
                .as_ref()
                .copy_to_host(&mut host, 0, self.gpu.arena().ptr(), bytes)
                .unwrap()
        };
        stream.as_ref().synchronize().unwrap();
        let cpu = self.cpu.arena().as_bytes();
        let first_diff = cpu.iter().zip(host.as_slice()).position(|(a, b)| a != b);
        assert_eq!(first_diff, None, "arenas differ (byte offset)");
    }

    fn attention(&mut self, rng: &mut Rng, layer: u32, queries: &[u32]) {
        let geo = *self.gpu.geometry();
        let per = (self.q_heads * geo.head_dim()) as usize;
        let total: u32 = queries.iter().sum();
        let q = rng.fill(total as usize * per);
        let mut out_cpu = vec![0f32; q.len()];
        let mut out_gpu = vec![f32::NAN; q.len()];
        let scale = 1.0 / (geo.head_dim() as f32).sqrt();
        let cpu_seqs: Vec<(Seq, u32)> = self
            .seqs
            .iter()
            .zip(queries)
            .map(|(s, &n)| (s.0, n))
            .collect();
        let gpu_seqs: Vec<(SeqId, u32)> = self
            .seqs
            .iter()
            .zip(queries)
            .map(|(s, &n)| (s.1, n))
            .collect();
        self.cpu
            .prefill(layer, &cpu_seqs, &q, &mut out_cpu, self.q_heads, scale)
            .unwrap();
        if queries.iter().all(|&n| n == 1) {
            let ids: Vec<SeqId> = gpu_seqs.iter().map(|s| s.0).collect();
            self.gpu
                .decode(layer, &ids, &q, &mut out_gpu, scale)
                .unwrap();
        } else {
            self.gpu
                .prefill(layer, &gpu_seqs, &q, &mut out_gpu, scale)
                .unwrap();
        }
        let max = out_cpu.iter().fold(0f32, |m, x| m.max(x.abs()));
        let tol = 1e-5
            + max
                * if geo.dtype() == DType::F32 {
                    2e-5
                } else {
                    1e-4
                };
        for (i, (a, b)) in out_cpu.iter().zip(&out_gpu).enumerate() {
            assert!(
                (a - b).abs() <= tol,
                "out[{i}]: cpu {a} gpu {b} (tol {tol})"
            );
        }
    }
}

/// The scenario for one point of the matrix.
fn scenario(dtype: DType, head_dim: u32, block_size: u32, group: u32, contexts: &[u32]) {
    let g = Geometry::new(2, 2, head_dim, block_size, dtype).unwrap();
    let max_len = contexts.iter().max().copied().unwrap_or(1) + 8;
    let blocks: u32 = contexts
        .iter()
        .map(|c| c.div_ceil(block_size) + 2)
        .sum::<u32>()
        + 64;
    let q_heads = 2 * group;
    let cfg = config(g, blocks, max_len, q_heads);
    let mut storage = vec![0u64; DeviceCache::storage_words(&cfg, blocks)];
    let mut pair = Pair {
        cpu: cpu_cache(g, blocks, max_len),
        gpu: DeviceCache::new(cfg, &mut storage).expect("device cache"),
        seqs: Vec::new(),
        q_heads,
    };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ u64::from(head_dim * block_size * group));
    // Fragment the pool: 8 sequences of random lengths, every other one released; the
    // others stay (unwritten: zeros on both sides) so the scenario's block tables are
    // scattered.
    for _ in 0..8 {
        let i = pair.create();
        let n = 1 + (rng.next() % (4 * u64::from(block_size))) as u32;
        pair.append(i, n);
    }
    for i in (0..8).step_by(2).rev() {
        let (c, s) = pair.seqs.remove(i);
        pair.cpu.release(c).unwrap();
        pair.gpu.release(s).unwrap();
    }
    let _kept: Vec<(Seq, SeqId)> = pair.seqs.drain(..).collect();
    for &ctx in contexts {
        let i = pair.create();
        pair.append(i, ctx);
        pair.write(&mut rng, i, 0, ctx);
    }
    // A fork appends into the shared partial block: copy-on-write on both.
    let parent = pair.seqs[0];
    let child = (
        pair.cpu.fork(parent.0).unwrap(),
        pair.gpu.fork(parent.1).unwrap(),
    );
    pair.seqs.push(child);
    let last = pair.seqs.len() - 1;
    let len = pair.gpu.len(child.1).unwrap();
    pair.append(last, 1);
    pair.write(&mut rng, last, len, len + 1);
    pair.arenas_equal();
    let n = pair.seqs.len();
    pair.attention(&mut rng, 1, &vec![1; n]);
    let queries: Vec<u32> = pair
        .seqs
        .iter()
        .map(|s| pair.gpu.len(s.1).unwrap().min(7))
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
                for group in Q_GROUP {
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
fn swaps_round_trip_bit_exact() {
    let ctx = Context::new(0).unwrap();
    let bpb = 64 << 10;
    let blocks = 64u32;
    let arena = DeviceMemory::new(&ctx, blocks as usize * bpb).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let mut rng = Rng(3);
    let mut src = PinnedMemory::new(&ctx, arena.len()).unwrap();
    for b in src.as_mut_slice() {
        *b = rng.next() as u8;
    }
    // SAFETY: sizes match; waited for below.
    unsafe {
        stream
            .as_ref()
            .copy_to_device(arena.ptr(), &src, 0, arena.len())
            .unwrap()
    };
    let mut tier = HostTier::new(&ctx, blocks, bpb as u64).unwrap();
    let out: Vec<_> = (0..blocks)
        .map(|b| kvpage_core::BlockCopy {
            src: b,
            dst: blocks - 1 - b,
        })
        .collect();
    tier.swap(Direction::Out, &arena, stream.as_ref(), &out)
        .unwrap();
    tier.synchronize().unwrap();
    for b in 0..blocks as usize {
        let h = (blocks as usize - 1 - b) * bpb;
        assert_eq!(
            &tier.arena().as_slice()[h..h + bpb],
            &src.as_slice()[b * bpb..(b + 1) * bpb]
        );
    }
    stream.as_ref().fill(&arena, 0).unwrap();
    let back: Vec<_> = out
        .iter()
        .map(|c| kvpage_core::BlockCopy {
            src: c.dst,
            dst: c.src,
        })
        .collect();
    tier.swap(Direction::In, &arena, stream.as_ref(), &back)
        .unwrap();
    let mut check = PinnedMemory::new(&ctx, arena.len()).unwrap();
    // SAFETY: as above; the stream waits for the swap's event.
    unsafe {
        stream
            .as_ref()
            .copy_to_host(&mut check, 0, arena.ptr(), arena.len())
            .unwrap()
    };
    stream.as_ref().synchronize().unwrap();
    assert!(check.as_slice() == src.as_slice());
    // Out of range: refused before anything is queued.
    let bad = [kvpage_core::BlockCopy {
        src: blocks,
        dst: 0,
    }];
    assert!(tier
        .swap(Direction::Out, &arena, stream.as_ref(), &bad)
        .is_err());
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_driver_error_is_typed() {
    let ctx = Context::new(0).unwrap();
    assert!(ctx.info().sm_count > 0, "{:?}", ctx.info());
    // More memory than any device has.
    let e = DeviceMemory::new(&ctx, usize::MAX / 2).unwrap_err();
    assert_eq!(e.code().map(|c| c.0), Some(2), "{e}");
    assert!(e.to_string().contains("cuMemAlloc"), "{e}");
    // An ordinal past the device count.
    assert!(Context::new(4096).is_err());
}

#[test]
fn without_a_driver_or_kernels_a_device_cache_is_a_typed_error() {
    let g = Geometry::new(1, 1, 64, 16, DType::F16).unwrap();
    let cfg = config(g, 4, 64, 1);
    let mut storage = vec![0u64; DeviceCache::storage_words(&cfg, 4)];
    let made = DeviceCache::new(cfg, &mut storage);
    match made {
        // A GPU machine.
        Ok(cache) => assert_eq!(cache.num_blocks(), 4),
        Err(DeviceCacheError::Kernels(e)) => {
            assert!(e.to_string().contains("kernels"), "{e}")
        }
        Err(DeviceCacheError::Driver(e)) => {
            assert!(
                matches!(e, DriverError::NotInstalled { .. } | DriverError::Call(_)),
                "{e}"
            );
            assert!(!e.to_string().is_empty());
        }
        Err(e) => panic!("unexpected error without a GPU: {e}"),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_on_variants_queue_on_a_callers_stream_and_match_the_synchronous_ones() {
    use kvpage_cuda::device::DeviceSlice;
    let g = Geometry::new(2, 2, 128, 16, DType::F16).unwrap();
    let cfg = config(g, 256, 1024, 8);
    let mut storage = vec![0u64; DeviceCache::storage_words(&cfg, 256)];
    let mut cache = DeviceCache::new(cfg, &mut storage).unwrap();
    let ctx = std::sync::Arc::clone(cache.context());
    let theirs = Stream::new(&ctx).unwrap();
    let mut rng = Rng(5);
    let seq = cache.create(0).unwrap();
    cache.append(seq, 300).unwrap();
    let row = 2 * 128;
    let (k, v) = (rng.fill(300 * row), rng.fill(300 * row));
    // Layer 0 from host slices, layer 1 from device buffers on the caller's stream.
    cache.write_kv(seq, 0, 0, &k, &v).unwrap();
    let mut pinned = PinnedMemory::new(&ctx, 2 * k.len() * 4).unwrap();
    for (d, x) in pinned
        .as_mut_slice()
        .chunks_exact_mut(4)
        .zip(k.iter().chain(&v))
    {
        d.copy_from_slice(&x.to_le_bytes());
    }
    let kv = DeviceMemory::new(&ctx, pinned.len()).unwrap();
    let s = theirs.as_ref();
    let bytes = (k.len() * 4) as u64;
    // SAFETY: sizes match; every buffer lives until the synchronize below.
    unsafe {
        s.copy_to_device(kv.ptr(), &pinned, 0, pinned.len())
            .unwrap();
        let ks = DeviceSlice {
            ptr: kv.ptr(),
            len: k.len(),
        };
        let vs = DeviceSlice {
            ptr: kv.ptr() + bytes,
            len: v.len(),
        };
        cache.write_kv_on(s, seq, 1, 0, ks, vs).unwrap();
    }
    cache.commit(seq).unwrap();
    let q = rng.fill(3 * 8 * 128);
    let mut out_sync = vec![0f32; q.len()];
    cache
        .prefill(0, &[(seq, 3)], &q, &mut out_sync, 0.088)
        .unwrap();
    let mut qp = PinnedMemory::new(&ctx, q.len() * 8).unwrap();
    for (d, x) in qp.as_mut_slice().chunks_exact_mut(4).zip(&q) {
        d.copy_from_slice(&x.to_le_bytes());
    }
    let qd = DeviceMemory::new(&ctx, q.len() * 4).unwrap();
    let od = DeviceMemory::new(&ctx, q.len() * 4).unwrap();
    // SAFETY: as above.
    unsafe {
        s.copy_to_device(qd.ptr(), &qp, 0, q.len() * 4).unwrap();
        let qs = DeviceSlice {
            ptr: qd.ptr(),
            len: q.len(),
        };
        let os = DeviceSlice {
            ptr: od.ptr(),
            len: q.len(),
        };
        // Layer 0 again, and layer 1, whose K/V came through the caller's stream.
        cache.prefill_on(s, 0, &[(seq, 3)], qs, os, 0.088).unwrap();
        s.copy_to_host(&mut qp, q.len() * 4, od.ptr(), q.len() * 4)
            .unwrap();
    }
    s.synchronize().unwrap();
    let out_async: Vec<f32> = qp.as_slice()[q.len() * 4..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(
        out_sync, out_async,
        "same kernel, same inputs: bit-identical"
    );
    // Layer 1 (written from device buffers) equals layer 0 (same K/V from the host).
    let mut out1 = vec![0f32; q.len()];
    cache.prefill(1, &[(seq, 3)], &q, &mut out1, 0.088).unwrap();
    assert_eq!(out_sync, out1);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_sequence_swapped_out_and_back_decodes_the_same() {
    let g = Geometry::new(2, 2, 64, 16, DType::Bf16).unwrap();
    let cfg = config(g, 64, 512, 4);
    let mut storage = vec![0u64; DeviceCache::storage_words(&cfg, 64)];
    let mut host_storage = vec![0u32; kvpage_core::HostPool::storage_words(64)];
    let mut cache = DeviceCache::with_host_tier(cfg, &mut storage, 64, &mut host_storage).unwrap();
    let mut rng = Rng(9);
    let a = cache.create(0).unwrap();
    let b = cache.create(0).unwrap();
    for s in [a, b] {
        cache.append(s, 200).unwrap();
        for layer in 0..2 {
            let (k, v) = (rng.fill(200 * 128), rng.fill(200 * 128));
            cache.write_kv(s, layer, 0, &k, &v).unwrap();
        }
        cache.commit(s).unwrap();
    }
    let q = rng.fill(4 * 64);
    let mut before = vec![0f32; q.len()];
    cache.decode(1, &[a], &q, &mut before, 0.125).unwrap();
    let used = cache.stats();
    assert_eq!(cache.swap_out(a).unwrap(), 13);
    // The freed blocks are reused by another sequence before `a` comes back.
    let c = cache.create(0).unwrap();
    cache.append(c, 100).unwrap();
    let (k, v) = (rng.fill(100 * 128), rng.fill(100 * 128));
    cache.write_kv(c, 0, 0, &k, &v).unwrap();
    cache.release(c).unwrap();
    assert_eq!(cache.swap_in(a).unwrap(), 13);
    let mut after = vec![0f32; q.len()];
    cache.decode(1, &[a], &q, &mut after, 0.125).unwrap();
    assert_eq!(before, after);
    assert_eq!(cache.stats().used_blocks, used.used_blocks);
    // No host tier: a typed error.
    let mut storage2 = vec![0u64; DeviceCache::storage_words(&cfg, 64)];
    let mut plain = DeviceCache::new(cfg, &mut storage2).unwrap();
    let s = plain.create(0).unwrap();
    assert!(matches!(
        plain.swap_out(s),
        Err(DeviceCacheError::NoHostTier)
    ));
}
