//! The device half of the cache (`DeviceKv`) and its resources on a real GPU: every
//! test that needs one is `#[ignore = "needs a CUDA device"]` and runs through
//! `cuda-backend/gpu-check.sh run`. The others run in CI (no driver there): creating a
//! device cache must then fail with a typed error, never a crash.
//!
//! The comparison with the CPU backend through one cache type (kvpage's `KvCache` on
//! either backend: writes, copy-on-write, decode, prefill, engine steps with swaps) is
//! in `host-std/tests/cuda.rs`.

#![cfg(feature = "cuda")]

use kvpage_core::{BlockCopy, DType, Geometry};
use kvpage_cuda::device::{
    Context, DeviceKv, DeviceKvConfig, DeviceKvError, DeviceMemory, DeviceSlice, Direction,
    HostTier, PinnedMemory, SeqSpan, Stream,
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
        .map(|b| BlockCopy {
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
        .map(|c| BlockCopy {
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
    let bad = [BlockCopy {
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

fn config(g: Geometry, blocks: u32, max_seq_len: u32, q_heads: u32) -> DeviceKvConfig {
    DeviceKvConfig {
        geometry: g,
        device: 0,
        arena: ArenaSize::Blocks(blocks),
        reserve_bytes: 0,
        max_seqs: 16,
        max_seq_len,
        max_step_tokens: 512,
        q_heads,
        host_blocks: 0,
    }
}

#[test]
fn without_a_driver_or_kernels_a_device_cache_is_a_typed_error() {
    let g = Geometry::new(1, 1, 64, 16, DType::F16).unwrap();
    match DeviceKv::new(config(g, 4, 64, 1)) {
        // A GPU machine.
        Ok(kv) => assert_eq!(kv.num_blocks(), 4),
        Err(DeviceKvError::Kernels(e)) => {
            assert!(e.to_string().contains("kernels"), "{e}")
        }
        Err(DeviceKvError::Driver(e)) => {
            assert!(
                matches!(e, DriverError::NotInstalled { .. } | DriverError::Call(_)),
                "{e}"
            );
            assert!(!e.to_string().is_empty());
        }
        Err(e) => panic!("unexpected error without a GPU: {e}"),
    }
}

/// One sequence of `len` tokens in blocks `0..`: the slots, and a block table of
/// `max_seqs` rows of `stride` blocks whose row 0 holds them.
fn one_sequence(len: u32, block_size: u32, stride: u32) -> (Vec<u32>, Vec<u32>) {
    let slots = (0..len).collect();
    let mut table = vec![0u32; 16 * stride as usize];
    for (i, b) in table
        .iter_mut()
        .take(len.div_ceil(block_size) as usize)
        .enumerate()
    {
        *b = i as u32;
    }
    (slots, table)
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_on_variants_queue_on_a_callers_stream_and_match_the_synchronous_ones() {
    let g = Geometry::new(2, 2, 128, 16, DType::F16).unwrap();
    let mut kv = DeviceKv::new(config(g, 256, 1024, 8)).unwrap();
    let ctx = std::sync::Arc::clone(kv.context());
    let theirs = Stream::new(&ctx).unwrap();
    let mut rng = Rng(5);
    let (slots, table) = one_sequence(300, 16, 64);
    let table = (&table[..], 64);
    let row = 2 * 128;
    let (k, v) = (rng.fill(300 * row), rng.fill(300 * row));
    // Layer 0 from host slices, layer 1 from device buffers on the caller's stream.
    kv.write_kv(0, &slots, &k, &v, None).unwrap();
    let mut pinned = PinnedMemory::new(&ctx, 2 * k.len() * 4).unwrap();
    for (d, x) in pinned
        .as_mut_slice()
        .chunks_exact_mut(4)
        .zip(k.iter().chain(&v))
    {
        d.copy_from_slice(&x.to_le_bytes());
    }
    let kvd = DeviceMemory::new(&ctx, pinned.len()).unwrap();
    let s = theirs.as_ref();
    let bytes = (k.len() * 4) as u64;
    // SAFETY: sizes match; every buffer lives until the synchronize below.
    unsafe {
        s.copy_to_device(kvd.ptr(), &pinned, 0, pinned.len())
            .unwrap();
        let ks = DeviceSlice {
            ptr: kvd.ptr(),
            len: k.len(),
        };
        let vs = DeviceSlice {
            ptr: kvd.ptr() + bytes,
            len: v.len(),
        };
        kv.write_kv_on(s, 1, &slots, ks, vs, None).unwrap();
    }
    let span = || {
        [SeqSpan {
            row: 0,
            context_len: 300,
            queries: 3,
        }]
        .into_iter()
    };
    let q = rng.fill(3 * 8 * 128);
    let mut out_sync = vec![0f32; q.len()];
    kv.attention(0, table, span(), &q, &mut out_sync, 8, 0.088)
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
        kv.attention_on(s, 0, table, span(), qs, os, 8, 0.088)
            .unwrap();
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
    kv.attention(1, table, span(), &q, &mut out1, 8, 0.088)
        .unwrap();
    assert_eq!(out_sync, out1);
    // Other query heads than configured: refused.
    assert!(matches!(
        kv.attention(1, table, span(), &q, &mut out1, 4, 0.088),
        Err(DeviceKvError::QHeads {
            got: 4,
            expected: 8
        })
    ));
}

#[test]
#[ignore = "needs a CUDA device"]
fn blocks_read_write_copy_and_swap_round_trip() {
    let g = Geometry::new(2, 2, 64, 16, DType::Bf16).unwrap();
    let mut kv = DeviceKv::new(DeviceKvConfig {
        host_blocks: 8,
        ..config(g, 16, 256, 4)
    })
    .unwrap();
    let bpb = g.bytes_per_block() as usize;
    let mut rng = Rng(9);
    let src: Vec<u8> = (0..bpb).map(|_| rng.next() as u8).collect();
    kv.write_block(3, &src).unwrap();
    kv.copy_blocks(&[BlockCopy { src: 3, dst: 5 }]).unwrap();
    let mut back = vec![0u8; bpb];
    kv.read_block(5, &mut back).unwrap();
    assert!(back == src);
    kv.swap(Direction::Out, &[BlockCopy { src: 5, dst: 7 }])
        .unwrap();
    kv.write_block(5, &vec![0u8; bpb]).unwrap();
    kv.swap(Direction::In, &[BlockCopy { src: 7, dst: 9 }])
        .unwrap();
    kv.read_block(9, &mut back).unwrap();
    assert!(back == src);
    // Refused before anything happens.
    assert!(matches!(
        kv.read_block(16, &mut back),
        Err(DeviceKvError::BadBlock { block: 16, .. })
    ));
    assert!(kv.read_block(0, &mut back[1..]).is_err());
    assert!(kv.copy_blocks(&[BlockCopy { src: 16, dst: 0 }]).is_err());
    let mut plain = DeviceKv::new(config(g, 16, 256, 4)).unwrap();
    assert!(matches!(
        plain.swap(Direction::Out, &[BlockCopy { src: 0, dst: 0 }]),
        Err(DeviceKvError::NoHostTier)
    ));
}
