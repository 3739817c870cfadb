//! Attention from several threads on different sequences of one cache.
//!
//! `KvCache::write_kv`, `decode` and `prefill` take `&mut self`: one thread at a time
//! writes K/V or runs the cache's own attention calls (the batch buffer is the cache's;
//! batch the sequences into one call, which the cache's worker pool spreads over its
//! threads). What `&KvCache` allows from any number of threads at once is reading: the
//! free kernel [`kernels::paged_attention`] over `layout()`, `arena()` and
//! `block_manager().block_table()`, on the cache's own `workers()` (a call that finds the
//! pool busy runs on its calling thread). This test runs that from several threads, each
//! on its own sequences, while the others do the same, and checks every output equals,
//! bit for bit, the single-threaded `KvCache::prefill` of the same sequence (tasks never
//! split a query row's context, so the arithmetic does not depend on the threads).

mod common;

use common::{random_vec, rng};
use kvpage::kernels::{self, AttentionParams, BlockTable, SeqQuery};
use kvpage::{bf16, CacheConfig, Capacity, DType, Element, Geometry, KvCache, Seq};

const LAYERS: u32 = 2;
const KV_HEADS: u32 = 2;
const Q_HEADS: u32 = 4;
/// Miri: the smallest head dim the kernels vectorize over, still several rows per block.
const HEAD_DIM: u32 = if cfg!(miri) { 8 } else { 16 };
const ROW: usize = (KV_HEADS * HEAD_DIM) as usize;
const QROW: usize = (Q_HEADS * HEAD_DIM) as usize;
/// Sequences, threads and rounds: under Miri (which checks the threads' accesses for
/// data races) fewer and shorter, still two threads on sequences sharing blocks.
const SEQS: usize = if cfg!(miri) { 3 } else { 8 };
const THREADS: usize = if cfg!(miri) { 2 } else { 4 };
const ROUNDS: usize = if cfg!(miri) { 1 } else { 20 };
/// Growth of the prompt length from one sequence to the next.
const LEN_STEP: usize = if cfg!(miri) { 2 } else { 23 };
/// Tokens of the prompt prefix the even sequences share.
const PREFIX: u32 = if cfg!(miri) { 9 } else { 24 };
/// Arena blocks: under Miri a small arena (zeroing and touching it is interpreted).
const BLOCKS: u32 = if cfg!(miri) { 24 } else { 256 };

/// A sequence, its query tokens per call, and the queries of each layer.
struct Case {
    seq: Seq,
    queries: u32,
    q: Vec<Vec<f32>>,
}

fn run<T: Element>(dtype: DType, kernel_threads: usize) {
    let geometry = Geometry::new(LAYERS, KV_HEADS, HEAD_DIM, 8, dtype).unwrap();
    let mut cache = KvCache::new(CacheConfig {
        geometry,
        capacity: Capacity::Blocks(BLOCKS),
        max_seqs: SEQS as u32,
        max_seq_len: 200,
        threads: kernel_threads,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .unwrap();
    let mut r = rng(dtype as u64);
    // Sequences of different lengths, some sharing a prompt prefix (and so blocks).
    let prefix: Vec<u32> = (0..PREFIX).collect();
    let mut cases = Vec::new();
    for s in 0..SEQS {
        let len = 9 + LEN_STEP * s;
        let mut prompt = if s % 2 == 0 { prefix.clone() } else { vec![] };
        prompt.extend((0..len as u32).map(|t| 1000 * s as u32 + t));
        let start = cache.create_with_prompt(0, &prompt).unwrap();
        let first = start.reused_tokens;
        let n = prompt.len() - first as usize;
        for layer in 0..LAYERS {
            let (k, v) = (random_vec(&mut r, n * ROW), random_vec(&mut r, n * ROW));
            cache.write_kv(start.seq, layer, first, &k, &v).unwrap();
        }
        cache.commit(start.seq).unwrap();
        let queries = 1 + (s as u32 % 3) * 4; // decode, and prefill chunks of 5 and 9
        let q = (0..LAYERS)
            .map(|_| random_vec(&mut r, queries as usize * QROW))
            .collect();
        cases.push(Case {
            seq: start.seq,
            queries,
            q,
        });
    }
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();

    // Single-threaded: the cache's own calls, one sequence at a time.
    let expected: Vec<Vec<Vec<f32>>> = cases
        .iter()
        .map(|c| {
            (0..LAYERS)
                .map(|layer| {
                    let q = &c.q[layer as usize];
                    let mut out = vec![0.0; q.len()];
                    let batch = [(c.seq, c.queries)];
                    cache
                        .prefill(layer, &batch, q, &mut out, Q_HEADS, scale)
                        .unwrap();
                    out
                })
                .collect()
        })
        .collect();

    // Several threads at once on `&cache`, each on its own sequences, many rounds.
    let cache = &cache;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (cases, expected) = (&cases, &expected);
            s.spawn(move || {
                let m = cache.block_manager();
                let table = BlockTable {
                    table: m.block_table(),
                    stride: m.config().max_blocks_per_seq,
                };
                let params = AttentionParams {
                    q_heads: Q_HEADS,
                    scale,
                    pool: Some(cache.workers()),
                };
                let arena = cache.arena().as_slice::<T>();
                for round in 0..ROUNDS {
                    for (i, c) in cases.iter().enumerate().filter(|(i, _)| i % THREADS == t) {
                        let layer = ((round + i) % LAYERS as usize) as u32;
                        let q = &c.q[layer as usize];
                        let row = c.seq.id().index();
                        let seq = SeqQuery {
                            row,
                            context_len: cache.len(c.seq).unwrap(),
                            queries: c.queries,
                        };
                        let mut out = vec![f32::NAN; q.len()];
                        let layout = cache.layout();
                        kernels::paged_attention(
                            layout,
                            arena,
                            layer,
                            table,
                            &[seq],
                            q,
                            &mut out,
                            params,
                        )
                        .unwrap();
                        let want = &expected[i][layer as usize];
                        let same = out
                            .iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "thread {t}, sequence {i}, layer {layer}: outputs differ"
                        );
                    }
                }
            });
        }
    });
}

#[test]
fn attention_from_several_threads_equals_single_threaded_f32() {
    run::<f32>(DType::F32, 2);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "the f32 test checks the threads' accesses under Miri; this one adds a dtype"
)]
fn attention_from_several_threads_equals_single_threaded_bf16_no_workers() {
    run::<bf16>(DType::Bf16, 1);
}
