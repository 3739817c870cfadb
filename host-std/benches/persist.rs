//! Save and restore throughput of one sequence, beside a plain `memcpy` of the same bytes
//! in the same run.
//!
//! `cargo bench -p kvpage --bench persist` — a sequence of 3000 tokens (187 full blocks
//! and a tail of 8) of a 1B-class model's KV geometry: 16 layers, 8 KV heads, head dim
//! 64, f16, blocks of 16 tokens (32 KiB per token, 94 MiB of K/V), with its token ids.
//! Per round, interleaved so that load from other processes hits them alike: `save_seq`
//! into a buffer; `restore_seq` of that blob into a second cache whose free blocks are
//! scattered (then released, untimed); a `copy_from_slice` of a buffer of the blob's
//! size; and a CRC-32 of the blob alone (the checksum's share). All on one thread.
//! Medians of the rounds are printed, the best beside them, as GB/s of blob bytes and
//! as the ratio to the memcpy's time.
//!
//! Bytes moved per call: the memcpy reads and writes the blob's size once; a save reads
//! the K/V from the arena, checksums it and writes the blob (one read pass and one
//! write pass, the checksum reading each 64 KiB piece again from the cache); a restore
//! reads the blob twice (checksums first, before it changes anything, then the copy)
//! and writes the arena once.
//!
//! Measured on the development VM (2 vCPUs of a Xeon with AVX-512, shared with other
//! jobs, load average 3.2), 94.0 MiB blob: memcpy 9.9 ms (9.9 GB/s); save 13.8 ms
//! (7.1 GB/s, 1.39x the memcpy); restore 15.8 ms (6.2 GB/s, 1.60x); the CRC-32 alone
//! 4.0 ms (24.5 GB/s, 0.41x). So a save costs a copy plus a checksum pass, and a
//! restore a checksum pass, a copy and ~0.2 memcpy of bookkeeping (creating the
//! sequence and appending 3000 ids, and the copy going to 188 scattered blocks): the
//! checksum is compute-bound at ~2.5x the copy bandwidth, and the restore's two passes
//! are the price of verifying everything before the arena is touched.
use std::hint::black_box;
use std::time::{Duration, Instant};

use kvpage::{
    f16, CacheConfig, Capacity, DType, Element, Geometry, KvCache, ModelFingerprint, Seq,
};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const LAYERS: u32 = 16;
const KV_HEADS: u32 = 8;
const HEAD_DIM: u32 = 64;
const BLOCK: u32 = 16;
const TOKENS: u32 = 3000;
const ROUNDS: usize = 15;
const MODEL: ModelFingerprint = ModelFingerprint::from_u64(0x1b);

/// Median and minimum.
fn stats(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    (v[v.len() / 2], v[0])
}

fn new_cache(blocks: u32) -> KvCache {
    let geometry = Geometry::new(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, DType::F16).expect("geometry");
    KvCache::new(CacheConfig {
        geometry,
        capacity: Capacity::Blocks(blocks),
        max_seqs: 2 * blocks,
        max_seq_len: TOKENS,
        threads: 1,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .expect("cache")
}

/// A sequence of `TOKENS` random tokens with random K/V in every layer.
fn filled_seq(cache: &mut KvCache, rng: &mut StdRng) -> (Seq, Vec<u32>) {
    let tokens: Vec<u32> = (0..TOKENS).map(|_| rng.random_range(0..128_000)).collect();
    let seq = cache.create(0).expect("create");
    cache.append_tokens(seq, &tokens).expect("append");
    let n = (TOKENS * KV_HEADS * HEAD_DIM) as usize;
    let mut buf = vec![f16::ZERO; n];
    for layer in 0..LAYERS {
        for x in buf.iter_mut() {
            *x = f16::from_f32(rng.random_range(-1.0f32..1.0));
        }
        cache.write_kv_as(seq, layer, 0, &buf, &buf).expect("write");
    }
    (seq, tokens)
}

fn main() {
    let mut rng = StdRng::seed_from_u64(12);
    let blocks = TOKENS.div_ceil(BLOCK);
    let mut src = new_cache(blocks);
    let (seq, tokens) = filled_seq(&mut src, &mut rng);
    let size = src.saved_seq_size(seq, true).expect("size");
    let mut blob = vec![0u8; size];

    // The destination: twice the blocks, every other one held, so the restored blocks
    // are scattered over the arena.
    let mut dst = new_cache(2 * blocks);
    let held: Vec<Seq> = (0..2 * blocks)
        .map(|_| {
            let s = dst.create(0).expect("create");
            dst.append(s, BLOCK).expect("append");
            s
        })
        .collect();
    for s in held.iter().step_by(2) {
        dst.release(*s).expect("release");
    }

    let copy_src: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let mut copy_dst = vec![0u8; size];

    let (mut save, mut restore, mut copy, mut crc) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS + 2 {
        let t = Instant::now();
        src.save_seq(seq, Some(&tokens), &MODEL, &mut blob)
            .expect("save");
        let ts = t.elapsed();
        black_box(&blob);

        let t = Instant::now();
        let (restored, _) = dst.restore_seq(&blob, 0, &MODEL).expect("restore");
        let tr = t.elapsed();
        dst.release(restored).expect("release");

        let t = Instant::now();
        black_box(&mut copy_dst).copy_from_slice(black_box(&copy_src));
        let tc = t.elapsed();

        let t = Instant::now();
        black_box(crc32fast::hash(black_box(&blob)));
        let th = t.elapsed();

        if round >= 2 {
            save.push(ts);
            restore.push(tr);
            copy.push(tc);
            crc.push(th);
        }
    }
    let (c, c_min) = stats(copy);
    let gbs = |d: Duration| size as f64 / d.as_secs_f64() / 1e9;
    println!(
        "persist: 1 seq x {TOKENS} tokens, {LAYERS} layers x {KV_HEADS} kv heads x {HEAD_DIM} dims, {:?}, blocks of {BLOCK}, 1 thread, median of {ROUNDS}",
        f16::DTYPE
    );
    println!(
        "  blob bytes: {size} ({:.1} MiB, {} blocks + ids and framing)",
        size as f64 / (1 << 20) as f64,
        blocks
    );
    let line = |name: &str, (median, best): (Duration, Duration)| {
        println!(
            "  {name:<9} {:>11} ns {:6.2} GB/s  {:5.2}x memcpy   (best {:>11} ns {:6.2} GB/s {:5.2}x)",
            median.as_nanos(),
            gbs(median),
            median.as_secs_f64() / c.as_secs_f64(),
            best.as_nanos(),
            gbs(best),
            best.as_secs_f64() / c_min.as_secs_f64(),
        );
    };
    line("memcpy:", (c, c_min));
    line("save:", stats(save));
    line("restore:", stats(restore));
    line("crc32:", stats(crc));
    println!(
        "  bytes moved per call: memcpy {size} read + {size} written; save {size} read + {size} written (+ checksum re-read from cache); restore {} read + {size} written",
        2 * size
    );
}
