//! The CPU kernels against the f64 reference, over plain slices (no core involved):
//! every dtype, block sizes 1 to 256, contexts that are not multiples of the block size,
//! block tables in shuffled physical order, GQA / MQA / MHA, decode and prefill, shared
//! prefix blocks, block copies, and every input error.

mod common;

use common::{cases, random_vec, reference_attention, rel_error, rng, tolerance};
use kvpage::kernels::{
    contiguous_attention, copy_blocks, paged_attention, write_kv, AttentionParams, BlockTable,
    ContiguousKv, Executor, SeqQuery, WorkerPool,
};
use kvpage::quant::{dequantize, quantize, Code};
use kvpage::{
    bf16, f16, Arena, BlockCopy, Buffer, DType, Element, Fp8E4m3, Geometry, GeometryError, Int8,
    KernelError, KvLayout,
};
use rand::seq::SliceRandom;

/// The copy of block `src` onto block `dst`.
fn cp(src: u32, dst: u32) -> BlockCopy {
    BlockCopy { src, dst }
}

/// A host's own threads lent to the kernels (here scoped threads started per call):
/// `helpers` besides the caller; `says_threads` whether it tells the kernels how many
/// (they then size their tasks by it; otherwise they cut them as finely as they can).
struct HostThreads {
    helpers: usize,
    says_threads: bool,
}

impl Executor for HostThreads {
    fn execute(&self, helpers: usize, job: &(dyn Fn() + Sync)) {
        std::thread::scope(|s| {
            for _ in 0..helpers.min(self.helpers) {
                s.spawn(job);
            }
            job();
        });
    }

    fn threads(&self) -> usize {
        if self.says_threads {
            self.helpers + 1
        } else {
            usize::MAX
        }
    }
}

/// The layout of `num_blocks` blocks of a geometry whose dtype is `T`'s.
fn layout_of<T: Element>(
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    num_blocks: u32,
) -> Result<KvLayout, KernelError> {
    let geometry = Geometry::new(layers, kv_heads, head_dim, block_size, T::DTYPE).unwrap();
    KvLayout::new(geometry, num_blocks)
}

/// One test case: `lens[i]` tokens of context of which `queries[i]` are new.
struct Case {
    block_size: u32,
    kv_heads: u32,
    q_heads: u32,
    head_dim: u32,
    lens: Vec<usize>,
    queries: Vec<usize>,
    seed: u64,
}

/// Builds a shuffled paged cache holding random K/V, runs paged attention, compares
/// with the reference; also checks the contiguous kernel on the same data.
fn check<T: Element>(case: &Case) {
    let mut rng = rng(case.seed);
    let (bs, kvh, qh, hd) = (
        case.block_size as usize,
        case.kv_heads as usize,
        case.q_heads as usize,
        case.head_dim as usize,
    );
    let blocks_per_seq: Vec<usize> = case.lens.iter().map(|l| l.div_ceil(bs)).collect();
    let stride = *blocks_per_seq.iter().max().unwrap() + 1;
    let num_blocks = blocks_per_seq.iter().sum::<usize>() + 3;
    let layers = 2;
    let layer = 1;
    let layout = layout_of::<T>(
        layers,
        case.kv_heads,
        case.head_dim,
        case.block_size,
        num_blocks as u32,
    )
    .unwrap();
    let mut arena = Arena::for_layout(&layout).unwrap();

    // Physical blocks in shuffled order; unused table entries hold a poison id.
    let mut physical: Vec<u32> = (0..num_blocks as u32).collect();
    physical.shuffle(&mut rng);
    let mut table = vec![u32::MAX; case.lens.len() * stride];
    let mut next = 0;
    for (s, &n) in blocks_per_seq.iter().enumerate() {
        table[s * stride..s * stride + n].copy_from_slice(&physical[next..next + n]);
        next += n;
    }

    // Random K/V of every sequence, written token by token through the slot mapping,
    // in two steps (cached context, then the new tokens), plus noise in layer 0.
    let mut kvs = Vec::new();
    for (s, &len) in case.lens.iter().enumerate() {
        let k = random_vec(&mut rng, len * kvh * hd);
        let v = random_vec(&mut rng, len * kvh * hd);
        let slots: Vec<u32> = (0..len)
            .map(|t| table[s * stride + t / bs] * bs as u32 + (t % bs) as u32)
            .collect();
        let split = len - case.queries[s];
        let a = arena.as_mut_slice::<T>();
        let row = kvh * hd;
        write_kv(
            &layout,
            a,
            layer,
            &slots[..split],
            &k[..split * row],
            &v[..split * row],
        )
        .unwrap();
        write_kv(
            &layout,
            a,
            layer,
            &slots[split..],
            &k[split * row..],
            &v[split * row..],
        )
        .unwrap();
        let noise = random_vec(&mut rng, len * row);
        write_kv(&layout, a, 0, &slots, &noise, &noise).unwrap();
        kvs.push((k, v));
    }

    let total_q: usize = case.queries.iter().sum();
    let q = random_vec(&mut rng, total_q * qh * hd);
    let seqs: Vec<SeqQuery> = (0..case.lens.len())
        .map(|s| SeqQuery {
            row: s as u32,
            context_len: case.lens[s] as u32,
            queries: case.queries[s] as u32,
        })
        .collect();
    let scale = 1.0 / (hd as f32).sqrt();
    let pool = WorkerPool::new(3);
    let params = AttentionParams {
        q_heads: case.q_heads,
        scale,
        pool: Some(&pool),
    };
    let mut out = vec![f32::NAN; q.len()];
    let bt = BlockTable {
        table: &table,
        stride: stride as u32,
    };
    paged_attention(
        &layout,
        arena.as_slice::<T>(),
        layer,
        bt,
        &seqs,
        &q,
        &mut out,
        params,
    )
    .unwrap();
    // The calling thread alone, and a host's threads, give the same bits: each output
    // row is one task's, whichever thread runs it, and a row's arithmetic is the same
    // whether its task takes one KV head or several (the calling thread alone takes
    // the most; a host that does not say its threads, one).
    let host = HostThreads {
        helpers: 2,
        says_threads: true,
    };
    let opaque = HostThreads {
        helpers: 2,
        says_threads: false,
    };
    for pool in [None, Some(&host as &dyn Executor), Some(&opaque)] {
        let mut again = vec![f32::NAN; q.len()];
        let arena = arena.as_slice::<T>();
        let params = AttentionParams { pool, ..params };
        paged_attention(&layout, arena, layer, bt, &seqs, &q, &mut again, params).unwrap();
        assert_eq!(
            again.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    // 8-bit storage holds each (token, head) row as codes and a scale: the reference
    // attends over exactly those values (what the codes lose is measured by the
    // kv_quant_error benchmark, not here).
    let code = Code::of(T::DTYPE);
    if let Some(code) = code {
        for (k, v) in kvs.iter_mut() {
            for x in [k, v] {
                let (mut codes, mut scales) = (vec![0u8; x.len()], vec![0.0f32; x.len() / hd]);
                quantize(code, x, hd, &mut codes, &mut scales);
                dequantize(code, &codes, &scales, hd, x);
            }
        }
    }
    // 8-bit storage on AVX-512 VNNI computes on queries and softmax weights rounded to
    // 16 bits (weights to 2^-16 of a block's largest): over a few hundred near-uniform
    // weights the output is an average of random values, far smaller than each, and
    // that rounding comes to up to 1.8e-5 of it (int8, decode of 300 tokens, 24 or 32
    // query heads over 4; the f32 arithmetic of the same codes: 2e-7). FP8 in bf16 dot
    // products (AVX512_BF16 without AMX) rounds them to bf16, 2^-9 of each: up to
    // 2.1e-3 here. The codes themselves lose about 4e-2.
    let tol = match T::DTYPE {
        DType::Fp8E4m3 => 8e-3,
        _ if code.is_some() => 4e-5,
        _ => tolerance::<T>(),
    };
    let mut want = Vec::new();
    let mut q0 = 0;
    for (s, (k, v)) in kvs.iter().enumerate() {
        let n = case.queries[s] * qh * hd;
        want.extend(reference_attention(
            k,
            v,
            case.lens[s],
            kvh,
            hd,
            &q[q0..q0 + n],
            qh,
            scale,
        ));
        q0 += n;
    }
    let err = rel_error(&out, &want);
    assert!(
        err <= tol,
        "paged: relative error {err:e} (bs {bs}, {}, kvh {kvh} qh {qh})",
        core::any::type_name::<T>()
    );

    // The contiguous kernel on the same (rounded) values gives the same result; it has
    // no place for scales, so it refuses 8-bit storage.
    let cap = *case.lens.iter().max().unwrap();
    let mut ck = vec![T::default(); case.lens.len() * kvh * cap * hd];
    let mut cv = ck.clone();
    for (s, (k, v)) in kvs.iter().enumerate() {
        for t in 0..case.lens[s] {
            for h in 0..kvh {
                let dst = ((s * kvh + h) * cap + t) * hd;
                let src = (t * kvh + h) * hd;
                T::narrow(&k[src..src + hd], &mut ck[dst..dst + hd]);
                T::narrow(&v[src..src + hd], &mut cv[dst..dst + hd]);
            }
        }
    }
    let mut out2 = vec![f32::NAN; q.len()];
    let kv = ContiguousKv {
        k: &ck,
        v: &cv,
        kv_heads: case.kv_heads,
        head_dim: case.head_dim,
        capacity: cap as u32,
    };
    if code.is_some() {
        assert_eq!(
            contiguous_attention(kv, &seqs, &q, &mut out2, params),
            Err(KernelError::ScaledStorage { dtype: T::DTYPE })
        );
        return;
    }
    contiguous_attention(kv, &seqs, &q, &mut out2, params).unwrap();
    let err2 = rel_error(&out2, &want);
    assert!(
        err2 <= tolerance::<T>(),
        "contiguous: relative error {err2:e}"
    );
}

fn all_dtypes(case: &Case) {
    check::<f32>(case);
    check::<f16>(case);
    check::<bf16>(case);
    check::<Int8>(case);
    check::<Fp8E4m3>(case);
}

#[test]
fn decode_every_block_size_and_dtype() {
    // Block size 8 splits every length unevenly; Miri runs it alone, on short contexts.
    for (i, &bs) in cases(&[8u32, 1, 16, 32, 256], 1).iter().enumerate() {
        all_dtypes(&Case {
            block_size: bs,
            kv_heads: 2,
            q_heads: 8,
            head_dim: 64,
            lens: cases(&[37, 1, 300, 129], 2).to_vec(),
            queries: cases(&[1, 1, 1, 1], 2).to_vec(),
            seed: 10 + i as u64,
        });
    }
}

#[test]
// Safe routing over the same unsafe paths as the decode above; under Miri even one
// short case took 78 s (the online routine's own tests run a task of several heads).
#[cfg_attr(miri, ignore)]
fn decode_of_groups_of_five_to_eight_query_heads() {
    // Two KV heads a task, each in passes of four rows (8 = 4 + 4, 6 = 4 + 2, 5 = 4 + 1).
    for (i, &(kvh, qh)) in [(2u32, 10u32), (4, 32), (4, 24)].iter().enumerate() {
        all_dtypes(&Case {
            block_size: 16,
            kv_heads: kvh,
            q_heads: qh,
            head_dim: 64,
            lens: vec![5, 37, 300],
            queries: vec![1, 1, 1],
            seed: 15 + i as u64,
        });
    }
}

#[test]
fn prefill_every_block_size_and_dtype() {
    for (i, &bs) in cases(&[8u32, 1, 16, 32, 256], 1).iter().enumerate() {
        all_dtypes(&Case {
            block_size: bs,
            kv_heads: 2,
            q_heads: 4,
            head_dim: 32,
            // A whole prompt, a single token, a suffix after a cached prefix (Miri: the
            // first two, shortened).
            lens: cases(&[if cfg!(miri) { 13 } else { 45 }, 17, 270], 2).to_vec(),
            queries: cases(&[if cfg!(miri) { 13 } else { 45 }, 1, 23], 2).to_vec(),
            seed: 20 + i as u64,
        });
    }
}

#[test]
fn head_shapes_mqa_mha_and_odd_head_dims() {
    let shapes = [
        (4u32, 8u32, 7u32),
        (1, 8, 40),
        (3, 3, 24),
        (2, 34, 16),
        (1, 1, 256),
    ];
    for (i, &(kvh, qh, hd)) in cases(&shapes, 1).iter().enumerate() {
        all_dtypes(&Case {
            block_size: 16,
            kv_heads: kvh,
            q_heads: qh,
            head_dim: hd,
            lens: vec![if cfg!(miri) { 21 } else { 70 }, 5],
            queries: vec![3, 5],
            seed: 30 + i as u64,
        });
    }
}

#[test]
fn large_scores_stay_finite_with_the_running_max() {
    // Scale 40: scores around ±40 * |q·k| would overflow a naive exp.
    let mut rng = rng(5);
    let layout = layout_of::<f32>(1, 1, 16, 8, 8).unwrap();
    let mut arena = Arena::for_layout(&layout).unwrap();
    let len = 50;
    let k = random_vec(&mut rng, len * 16);
    let v = random_vec(&mut rng, len * 16);
    let table: Vec<u32> = (0..8).rev().collect();
    let slots: Vec<u32> = (0..len as u32)
        .map(|t| table[(t / 8) as usize] * 8 + t % 8)
        .collect();
    write_kv(&layout, arena.as_mut_slice::<f32>(), 0, &slots, &k, &v).unwrap();
    let q: Vec<f32> = random_vec(&mut rng, 16).iter().map(|x| x * 10.0).collect();
    let mut out = vec![0.0; 16];
    let params = AttentionParams {
        q_heads: 1,
        scale: 40.0,
        pool: None,
    };
    let bt = BlockTable {
        table: &table,
        stride: 8,
    };
    paged_attention(
        &layout,
        arena.as_slice::<f32>(),
        0,
        bt,
        &[SeqQuery::decode(0, len as u32)],
        &q,
        &mut out,
        params,
    )
    .unwrap();
    let want = reference_attention(&k, &v, len, 1, 16, &q, 1, 40.0);
    assert!(out.iter().all(|x| x.is_finite()));
    assert!(rel_error(&out, &want) < 1e-5);
}

/// A NaN or an infinity written into one key or one value makes the outputs of the
/// query heads that read its KV head non-finite, and only those, for every dtype: the
/// 8-bit dtypes keep it as the row's NaN scale (int8's NaN code alone would be the
/// integer −128 to the kernels, an infinity would saturate), the float dtypes in the
/// element. Decode and a prefill of 3 queries, head dim 64 (the SIMD paths' full-width
/// loops).
fn non_finite_reaches_the_outputs<T: Element>() {
    let (kv_heads, q_heads, hd, bs, len) = (2usize, 4usize, 64usize, 4u32, 11usize);
    let layout = layout_of::<T>(1, kv_heads as u32, hd as u32, bs, 4).unwrap();
    let table: Vec<u32> = vec![2, 0, 3, 1];
    let slots: Vec<u32> = (0..len as u32)
        .map(|t| table[(t / bs) as usize] * bs + t % bs)
        .collect();
    let bt = BlockTable {
        table: &table,
        stride: table.len() as u32,
    };
    let mut rng = rng(41);
    let row = |t: usize, h: usize| (t * kv_heads + h) * hd;
    // (K or V, token, KV head, dimension, value) of the non-finite value.
    let cases = [
        (false, 3, 0, 5, f32::NAN),
        (true, 6, 1, 40, f32::NAN),
        (false, 10, 1, 63, f32::NAN),
        (true, 2, 0, 0, f32::INFINITY),
    ];
    for (in_v, t, h, d, bad) in cases {
        let mut k = random_vec(&mut rng, len * kv_heads * hd);
        let mut v = random_vec(&mut rng, len * kv_heads * hd);
        let poisoned = if in_v { &mut v } else { &mut k };
        poisoned[row(t, h) + d] = bad;
        let mut arena = Arena::for_layout(&layout).unwrap();
        write_kv(&layout, arena.as_mut_slice::<T>(), 0, &slots, &k, &v).unwrap();
        for queries in [1usize, 3] {
            let q = random_vec(&mut rng, queries * q_heads * hd);
            let mut out = vec![0.0; q.len()];
            let params = AttentionParams {
                q_heads: q_heads as u32,
                scale: 0.125,
                pool: None,
            };
            let seq = SeqQuery {
                row: 0,
                context_len: len as u32,
                queries: queries as u32,
            };
            paged_attention(
                &layout,
                arena.as_slice::<T>(),
                0,
                bt,
                &[seq],
                &q,
                &mut out,
                params,
            )
            .unwrap();
            // Causal: query i sees tokens up to len - queries + i.
            for (i, per_query) in out.chunks_exact(q_heads * hd).enumerate() {
                let sees = t < len - queries + i + 1;
                for (qh, o) in per_query.chunks_exact(hd).enumerate() {
                    let reads = qh / (q_heads / kv_heads) == h;
                    assert_eq!(
                        o.iter().any(|x| !x.is_finite()),
                        sees && reads,
                        "{:?}, {bad} in {} of token {t} head {h}: query {i} head {qh}",
                        T::DTYPE,
                        if in_v { "V" } else { "K" }
                    );
                }
            }
        }
    }
}

#[test]
fn a_non_finite_value_in_the_cache_reaches_the_outputs_that_read_it() {
    non_finite_reaches_the_outputs::<f32>();
    non_finite_reaches_the_outputs::<f16>();
    non_finite_reaches_the_outputs::<bf16>();
    non_finite_reaches_the_outputs::<Int8>();
    non_finite_reaches_the_outputs::<Fp8E4m3>();
}

#[test]
fn shared_prefix_blocks_and_copy_on_write() {
    // Two sequences share their first two blocks (as after a fork or a prefix-cache
    // hit); the second then diverges inside a copied third block.
    let mut rng = rng(6);
    let (bs, hd) = (4usize, 8usize);
    let layout = layout_of::<f32>(1, 1, hd as u32, bs as u32, 16).unwrap();
    let mut arena = Arena::for_layout(&layout).unwrap();
    let len = 10; // two full blocks + 2 tokens in a shared partial block
    let k = random_vec(&mut rng, len * hd);
    let v = random_vec(&mut rng, len * hd);
    let parent = [9u32, 2, 13];
    let slots: Vec<u32> = (0..len)
        .map(|t| parent[t / bs] * bs as u32 + (t % bs) as u32)
        .collect();
    write_kv(&layout, arena.as_mut_slice::<f32>(), 0, &slots, &k, &v).unwrap();
    // Copy-on-write of the partial block 13 -> 5 for the child, then each appends.
    copy_blocks(&layout, arena.as_mut_slice::<f32>(), &[cp(13, 5)]).unwrap();
    let child = [9u32, 2, 5];
    let (kp, vp) = (random_vec(&mut rng, hd), random_vec(&mut rng, hd));
    let (kc, vc) = (random_vec(&mut rng, hd), random_vec(&mut rng, hd));
    write_kv(
        &layout,
        arena.as_mut_slice::<f32>(),
        0,
        &[13 * 4 + 2],
        &kp,
        &vp,
    )
    .unwrap();
    write_kv(
        &layout,
        arena.as_mut_slice::<f32>(),
        0,
        &[5 * 4 + 2],
        &kc,
        &vc,
    )
    .unwrap();

    let stride = 4;
    let mut table = vec![u32::MAX; 2 * stride];
    table[..3].copy_from_slice(&parent);
    table[stride..stride + 3].copy_from_slice(&child);
    let q = random_vec(&mut rng, 2 * hd);
    let mut out = vec![0.0; 2 * hd];
    let pool = WorkerPool::new(3);
    let params = AttentionParams {
        q_heads: 1,
        scale: 0.3,
        pool: Some(&pool),
    };
    let seqs = [SeqQuery::decode(0, 11), SeqQuery::decode(1, 11)];
    let bt = BlockTable {
        table: &table,
        stride: stride as u32,
    };
    paged_attention(
        &layout,
        arena.as_slice::<f32>(),
        0,
        bt,
        &seqs,
        &q,
        &mut out,
        params,
    )
    .unwrap();
    for (i, (kn, vn)) in [(&kp, &vp), (&kc, &vc)].into_iter().enumerate() {
        let kk = [&k[..], kn].concat();
        let vv = [&v[..], vn].concat();
        let want = reference_attention(&kk, &vv, 11, 1, hd, &q[i * hd..(i + 1) * hd], 1, 0.3);
        assert!(
            rel_error(&out[i * hd..(i + 1) * hd], &want) < 1e-5,
            "sequence {i}"
        );
    }
}

/// A small valid setup for the error tests.
struct Setup {
    layout: KvLayout,
    arena: Arena,
    table: Vec<u32>,
    q: Vec<f32>,
}

fn setup() -> Setup {
    let layout = layout_of::<f16>(2, 2, 8, 4, 6).unwrap();
    let mut arena = Arena::for_layout(&layout).unwrap();
    let mut rng = rng(7);
    let table = vec![3, 1, 4, 0, 2, 5];
    let slots: Vec<u32> = (0..9).map(|t| table[t / 4] * 4 + (t % 4) as u32).collect();
    let k = random_vec(&mut rng, 9 * 16);
    write_kv(&layout, arena.as_mut_slice::<f16>(), 1, &slots, &k, &k).unwrap();
    Setup {
        layout,
        arena,
        q: random_vec(&mut rng, 4 * 8),
        table,
    }
}

/// A kernel call writing into the given output.
type Call<'a> = dyn Fn(&mut Vec<f32>) -> Result<(), KernelError> + 'a;

#[test]
fn attention_errors_write_nothing() {
    let s = setup();
    let arena = s.arena.as_slice::<f16>();
    let bt = BlockTable {
        table: &s.table,
        stride: 3,
    };
    let pool = WorkerPool::new(3);
    let ok = AttentionParams {
        q_heads: 4,
        scale: 0.5,
        pool: Some(&pool),
    };
    let one = [SeqQuery::decode(0, 9)];
    let cases: Vec<(KernelError, Box<Call>)> = vec![
        (
            KernelError::LayerOutOfRange {
                layer: 2,
                layers: 2,
            },
            Box::new(|o| paged_attention(&s.layout, arena, 2, bt, &one, &s.q, o, ok)),
        ),
        (
            KernelError::HeadsNotDivisible {
                q_heads: 3,
                kv_heads: 2,
            },
            Box::new(|o| {
                paged_attention(
                    &s.layout,
                    arena,
                    1,
                    bt,
                    &one,
                    &s.q[..24],
                    &mut o[..24],
                    AttentionParams { q_heads: 3, ..ok },
                )
            }),
        ),
        (
            KernelError::HeadsNotDivisible {
                q_heads: 0,
                kv_heads: 2,
            },
            Box::new(|o| {
                paged_attention(
                    &s.layout,
                    arena,
                    1,
                    bt,
                    &one,
                    &s.q,
                    o,
                    AttentionParams { q_heads: 0, ..ok },
                )
            }),
        ),
        (
            KernelError::BadScale,
            Box::new(|o| {
                paged_attention(
                    &s.layout,
                    arena,
                    1,
                    bt,
                    &one,
                    &s.q,
                    o,
                    AttentionParams {
                        scale: f32::NAN,
                        ..ok
                    },
                )
            }),
        ),
        (
            KernelError::BufferLength {
                buffer: Buffer::Query,
                expected: 32,
                actual: 31,
            },
            Box::new(|o| paged_attention(&s.layout, arena, 1, bt, &one, &s.q[..31], o, ok)),
        ),
        (
            KernelError::BufferLength {
                buffer: Buffer::Output,
                expected: 32,
                actual: 33,
            },
            Box::new(|o| {
                o.push(1.5);
                let r = paged_attention(&s.layout, arena, 1, bt, &one, &s.q, o, ok);
                o.pop();
                r
            }),
        ),
        (
            KernelError::BufferLength {
                buffer: Buffer::Arena,
                expected: s.layout.arena_elems(),
                actual: 10,
            },
            Box::new(|o| paged_attention(&s.layout, &arena[..10], 1, bt, &one, &s.q, o, ok)),
        ),
        (
            KernelError::RowOutOfRange { row: 2, rows: 2 },
            Box::new(|o| {
                paged_attention(
                    &s.layout,
                    arena,
                    1,
                    bt,
                    &[SeqQuery::decode(2, 1)],
                    &s.q,
                    o,
                    ok,
                )
            }),
        ),
        (
            KernelError::ContextTooLong {
                context_len: 13,
                capacity: 12,
            },
            Box::new(|o| {
                paged_attention(
                    &s.layout,
                    arena,
                    1,
                    bt,
                    &[SeqQuery::decode(0, 13)],
                    &s.q,
                    o,
                    ok,
                )
            }),
        ),
        (
            KernelError::QueriesExceedContext {
                queries: 2,
                context_len: 1,
            },
            Box::new(|o| {
                let q = [s.q.clone(), s.q.clone()].concat();
                let mut o2 = [o.clone(), o.clone()].concat();
                let r = paged_attention(
                    &s.layout,
                    arena,
                    1,
                    bt,
                    &[SeqQuery {
                        row: 0,
                        context_len: 1,
                        queries: 2,
                    }],
                    &q,
                    &mut o2,
                    ok,
                );
                assert!(o2.iter().all(|x| *x == 7.0));
                r
            }),
        ),
        (
            KernelError::BlockOutOfRange {
                block: 9,
                blocks: 6,
            },
            Box::new(|o| {
                let t = [3, 1, 9];
                let bt = BlockTable {
                    table: &t,
                    stride: 3,
                };
                paged_attention(&s.layout, arena, 1, bt, &one, &s.q, o, ok)
            }),
        ),
    ];
    for (want, call) in cases {
        let mut out = vec![7.0f32; 32];
        assert_eq!(call(&mut out), Err(want));
        assert!(out.iter().all(|x| *x == 7.0), "{want}: output was written");
        assert!(!want.to_string().is_empty());
    }
    // And the valid call does write.
    let mut out = vec![7.0f32; 32];
    paged_attention(&s.layout, arena, 1, bt, &one, &s.q, &mut out, ok).unwrap();
    assert!(out.iter().all(|x| *x != 7.0 && x.is_finite()));
}

#[test]
fn write_and_copy_errors_write_nothing() {
    let mut s = setup();
    let before: Vec<f16> = s.arena.as_slice::<f16>().to_vec();
    let layout = s.layout;
    let a = s.arena.as_mut_slice::<f16>();
    let kv = vec![0.25f32; 16];
    assert_eq!(
        write_kv(&layout, a, 2, &[0], &kv, &kv),
        Err(KernelError::LayerOutOfRange {
            layer: 2,
            layers: 2
        })
    );
    assert_eq!(
        write_kv(&layout, a, 0, &[0, 1], &kv, &kv),
        Err(KernelError::BufferLength {
            buffer: Buffer::Keys,
            expected: 32,
            actual: 16
        })
    );
    assert_eq!(
        write_kv(&layout, a, 0, &[0], &kv, &kv[..15]),
        Err(KernelError::BufferLength {
            buffer: Buffer::Values,
            expected: 16,
            actual: 15
        })
    );
    let two = [kv.clone(), kv.clone()].concat();
    assert_eq!(
        write_kv(&layout, a, 0, &[0, 24], &two, &two),
        Err(KernelError::SlotOutOfRange {
            slot: 24,
            slots: 24
        })
    );
    assert_eq!(
        copy_blocks(&layout, a, &[cp(0, 1), cp(6, 1)]),
        Err(KernelError::BlockOutOfRange {
            block: 6,
            blocks: 6
        })
    );
    assert_eq!(
        copy_blocks(&layout, a, &[cp(0, 1), cp(2, 2)]),
        Err(KernelError::CopyOntoItself { block: 2 })
    );
    assert_eq!(s.arena.as_slice::<f16>(), &before[..], "arena was written");
    assert_eq!(
        layout_of::<f16>(1, 1, 300, 4, 4),
        Err(KernelError::HeadDimTooLarge { head_dim: 300 })
    );
    // Zero dimensions are the geometry's to refuse; zero blocks are the layout's.
    assert_eq!(
        Geometry::new(1, 0, 8, 4, DType::F16),
        Err(GeometryError::ZeroDimension)
    );
    assert_eq!(layout_of::<f16>(1, 1, 8, 4, 0), Err(KernelError::BadLayout));
}

#[test]
fn kernels_refuse_an_element_type_other_than_the_layouts() {
    let mut s = setup(); // an f16 layout
    let before: Vec<f16> = s.arena.as_slice::<f16>().to_vec();
    let layout = s.layout;
    let mismatch = |element| KernelError::DTypeMismatch {
        layout: DType::F16,
        element,
    };
    let kv = vec![0.25f32; 16];
    assert_eq!(
        write_kv(&layout, s.arena.as_mut_slice::<f32>(), 0, &[0], &kv, &kv),
        Err(mismatch(DType::F32))
    );
    assert_eq!(
        copy_blocks(&layout, s.arena.as_mut_slice::<bf16>(), &[cp(0, 1)]),
        Err(mismatch(DType::Bf16))
    );
    let mut out = vec![7.0f32; 32];
    let bt = BlockTable {
        table: &s.table,
        stride: 3,
    };
    let params = AttentionParams {
        q_heads: 4,
        scale: 0.5,
        pool: None,
    };
    let one = [SeqQuery::decode(0, 9)];
    let arena = s.arena.as_slice::<bf16>();
    assert_eq!(
        paged_attention(&layout, arena, 1, bt, &one, &s.q, &mut out, params),
        Err(mismatch(DType::Bf16))
    );
    assert!(out.iter().all(|x| *x == 7.0), "output was written");
    assert_eq!(s.arena.as_slice::<f16>(), &before[..], "arena was written");
    assert!(!mismatch(DType::F32).to_string().is_empty());
    // The same call with the layout's own type works.
    let arena = s.arena.as_slice::<f16>();
    paged_attention(&layout, arena, 1, bt, &one, &s.q, &mut out, params).unwrap();
}

#[test]
fn layout_delegates_its_shape_to_the_geometry() {
    let g = Geometry::new(3, 2, 8, 4, DType::Bf16).unwrap();
    let layout = KvLayout::new(g, 5).unwrap();
    assert_eq!(layout.geometry(), &g);
    assert_eq!(layout.num_blocks(), 5);
    assert_eq!(layout.num_slots(), 20);
    assert_eq!(layout.tile_elems(), 32);
    assert_eq!(layout.elems_per_block() as u64, g.elems_per_block());
    assert_eq!(layout.arena_elems(), 5 * 384);
    assert_eq!(layout.arena_bytes(), 5 * 384 * 2);
    assert_eq!(Arena::for_layout(&layout).unwrap().len_bytes(), 5 * 384 * 2);
    assert_eq!(
        layout.tile_offset(4, 2, 1, 1),
        4 * 384 + g.tile_offset(2, 1, 1) as usize
    );
    assert_eq!(
        layout.tile_offset(4, 2, 1, 1),
        4 * 384 + (2 * 2 + 1) * 2 * 32 + 32
    );
    assert_eq!(layout.check_element::<bf16>(), Ok(()));
    // 2^16 tokens per block of 2^20 elements.
    let g = Geometry::new(1, 1, 8, 1 << 16, DType::F16).unwrap();
    if usize::BITS == 64 {
        // Slots past `u32`: 2^16 + 1 blocks.
        assert!(KvLayout::new(g, 1 << 16).is_ok());
        assert_eq!(KvLayout::new(g, (1 << 16) + 1), Err(KernelError::BadLayout));
        // An arena past `isize` bytes (for 4-byte elements), though each block fits a
        // `u64`. 2^39 elements per block; 4 bytes each: 2^22 blocks reach 2^63 bytes.
        let g = Geometry::new(1 << 20, 1 << 10, 256, 1, DType::F16).unwrap();
        assert!(KvLayout::new(g, (1 << 22) - 1).is_ok());
        assert_eq!(KvLayout::new(g, 1 << 22), Err(KernelError::BadLayout));
    } else {
        // On 32 bits `isize` comes first: 4 bytes each, 512 blocks reach 2^31 bytes.
        assert!(KvLayout::new(g, 511).is_ok());
        assert_eq!(KvLayout::new(g, 512), Err(KernelError::BadLayout));
    }
}

#[test]
fn copy_blocks_copies_every_layer() {
    let mut rng = rng(8);
    let layout = layout_of::<bf16>(3, 2, 8, 4, 5).unwrap();
    let mut arena = Arena::for_layout(&layout).unwrap();
    let n = layout.elems_per_block();
    let vals = random_vec(&mut rng, layout.arena_elems());
    bf16::narrow(&vals, arena.as_mut_slice::<bf16>());
    let before = arena.as_slice::<bf16>().to_vec();
    copy_blocks(&layout, arena.as_mut_slice::<bf16>(), &[cp(1, 3), cp(3, 0)]).unwrap();
    let after = arena.as_slice::<bf16>();
    assert_eq!(&after[3 * n..4 * n], &before[n..2 * n]);
    assert_eq!(&after[..n], &before[n..2 * n]);
    assert_eq!(&after[n..3 * n], &before[n..3 * n]);
    assert_eq!(&after[4 * n..], &before[4 * n..]);
}

/// The arithmetic the kernels report stays within the cap `KVPAGE_CPU_PATH` sets
/// (`avx512dot` takes no AMX tiles, `avx512f` no dot-product extension either, `avx2`
/// no AVX-512, `portable` neither), and is printed: CI reruns the kernel tests under
/// each cap that changes it.
#[test]
fn instruction_path_stays_within_the_cap() {
    let path = kvpage::kernels::instruction_path();
    const NO_AMX: &[&str] = &[
        "avx512f+vnni+bf16",
        "avx512f+vnni",
        "avx512f+bf16",
        "avx512f",
        "avx2+fma",
        "portable",
    ];
    const ANY: &[&str] = &[
        "avx512f+vnni+bf16+amx+amx-int8",
        "avx512f+vnni+amx+amx-int8",
        "avx512f+bf16+amx+amx-int8",
        "avx512f+amx+amx-int8",
        "avx512f+vnni+bf16+amx",
        "avx512f+vnni+amx",
        "avx512f+bf16+amx",
        "avx512f+amx",
        "avx512f+vnni+bf16",
        "avx512f+vnni",
        "avx512f+bf16",
        "avx512f",
        "avx2+fma",
        "portable",
    ];
    let allowed: &[&str] = match std::env::var(kvpage::kernels::CPU_PATH_ENV).as_deref() {
        Ok("avx512dot") => NO_AMX,
        Ok("avx512f") => &["avx512f", "avx2+fma", "portable"],
        Ok("avx2") => &["avx2+fma", "portable"],
        Ok("portable") => &["portable"],
        _ => ANY,
    };
    assert!(allowed.contains(&path), "{path} is not one of {allowed:?}");
    println!("instruction path: {path}");
}
