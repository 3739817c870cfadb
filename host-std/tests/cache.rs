//! The owned cache: fork, prefix cache and copy-on-write through `KvCache`, checked
//! against the f64 reference; handle and input errors.

mod common;

use common::{cases, random_vec, reference_attention, rel_error, rng, tolerance};
use kvpage::{
    bf16, f16, CacheConfig, CacheError, Capacity, DType, Element, Geometry, KernelError, KvCache,
    Seq, SeqError,
};
use rand::rngs::StdRng;
use rand::SeedableRng;

const LAYERS: u32 = 2;
const KV_HEADS: u32 = 2;
const Q_HEADS: u32 = 4;
const HEAD_DIM: u32 = 16;
const ROW: usize = (KV_HEADS * HEAD_DIM) as usize;

fn cache(dtype: DType, block_size: u32, blocks: u32) -> KvCache {
    cache_on(dtype, block_size, blocks, 2)
}

/// [`cache`] with `threads` threads for the kernels.
fn cache_on(dtype: DType, block_size: u32, blocks: u32, threads: usize) -> KvCache {
    let geometry = Geometry::new(LAYERS, KV_HEADS, HEAD_DIM, block_size, dtype).unwrap();
    KvCache::new(CacheConfig {
        geometry,
        capacity: Capacity::Blocks(blocks),
        max_seqs: 8,
        max_seq_len: 256,
        threads,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .unwrap()
}

/// K and V of token `token` at position `pos` in layer `layer`: a deterministic function
/// of the three, so that equal prefixes have equal K/V (as in a real model).
fn kv_of(token: u32, pos: usize, layer: u32) -> (Vec<f32>, Vec<f32>) {
    let mut r =
        StdRng::seed_from_u64(u64::from(token) << 32 | (pos as u64) << 4 | u64::from(layer));
    (random_vec(&mut r, ROW), random_vec(&mut r, ROW))
}

/// K/V `[len][kv_heads][head_dim]` of `tokens` in `layer`.
fn kv_seq(tokens: &[u32], layer: u32) -> (Vec<f32>, Vec<f32>) {
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for (p, &t) in tokens.iter().enumerate() {
        let (a, b) = kv_of(t, p, layer);
        k.extend(a);
        v.extend(b);
    }
    (k, v)
}

/// Writes the K/V of `tokens[from..]` of every layer.
fn write(cache: &mut KvCache, seq: Seq, tokens: &[u32], from: usize) {
    for layer in 0..LAYERS {
        let (k, v) = kv_seq(tokens, layer);
        cache
            .write_kv(seq, layer, from as u32, &k[from * ROW..], &v[from * ROW..])
            .unwrap();
    }
    // Every layer is written: the full blocks may now be shared.
    cache.commit(seq).unwrap();
}

/// Decodes the last token of every sequence in layer 1 and compares with the reference.
fn check_decode<T: Element>(cache: &mut KvCache, seqs: &[(Seq, &[u32])], rng: &mut StdRng) {
    let hd = HEAD_DIM as usize;
    let q = random_vec(rng, seqs.len() * Q_HEADS as usize * hd);
    let mut out = vec![f32::NAN; q.len()];
    let handles: Vec<Seq> = seqs.iter().map(|s| s.0).collect();
    cache
        .decode(1, &handles, &q, &mut out, Q_HEADS, 0.25)
        .unwrap();
    let per = Q_HEADS as usize * hd;
    for (i, (_, tokens)) in seqs.iter().enumerate() {
        let (k, v) = kv_seq(tokens, 1);
        let want = reference_attention(
            &k,
            &v,
            tokens.len(),
            KV_HEADS as usize,
            hd,
            &q[i * per..(i + 1) * per],
            Q_HEADS as usize,
            0.25,
        );
        let err = rel_error(&out[i * per..(i + 1) * per], &want);
        assert!(
            err <= tolerance::<T>(),
            "sequence {i}: relative error {err:e}"
        );
    }
}

fn fork_prefix_and_copy_on_write<T: Element>(block_size: u32) {
    let mut rng = rng(u64::from(block_size));
    // Under Miri a small arena: creating a cache zeroes and touches all of it.
    let mut c = cache(T::DTYPE, block_size, if cfg!(miri) { 16 } else { 200 });
    // Under Miri a shorter prompt: still whole blocks and a partial last one.
    let prompt_len: u32 = if cfg!(miri) { 21 } else { 70 };
    let prompt: Vec<u32> = (0..prompt_len).map(|i| (i * 7 + 3) % 50).collect();

    // A: the prompt, computed in full.
    let a = c.create_with_prompt(0, &prompt).unwrap();
    assert_eq!(a.reused_tokens, 0);
    write(&mut c, a.seq, &prompt, 0);

    // B: same prompt plus a suffix, in the same namespace: reuses A's whole blocks.
    let b_tokens: Vec<u32> = prompt.iter().copied().chain([44, 45, 46]).collect();
    let b = c.create_with_prompt(0, &b_tokens).unwrap();
    assert_eq!(
        b.reused_tokens,
        prompt_len / block_size * block_size,
        "block size {block_size}"
    );
    write(&mut c, b.seq, &b_tokens, b.reused_tokens as usize);
    let shared = b.reused_tokens.div_ceil(block_size) as usize;
    assert_eq!(
        c.block_manager().blocks(a.seq.id()).unwrap()[..shared],
        c.block_manager().blocks(b.seq.id()).unwrap()[..shared]
    );

    // Prefill of B's suffix only, over the shared prefix.
    let hd = HEAD_DIM as usize;
    let n = b_tokens.len() - b.reused_tokens as usize;
    let q = random_vec(&mut rng, n * Q_HEADS as usize * hd);
    let mut out = vec![f32::NAN; q.len()];
    c.prefill(0, &[(b.seq, n as u32)], &q, &mut out, Q_HEADS, 0.3)
        .unwrap();
    let (k, v) = kv_seq(&b_tokens, 0);
    let want = reference_attention(
        &k,
        &v,
        b_tokens.len(),
        KV_HEADS as usize,
        hd,
        &q,
        Q_HEADS as usize,
        0.3,
    );
    assert!(rel_error(&out, &want) <= tolerance::<T>());

    // C: a fork of A, sharing its partial last block; both append a different token.
    let fork = c.fork(a.seq).unwrap();
    let mut a_tokens = prompt.clone();
    let mut c_tokens = prompt.clone();
    a_tokens.push(7);
    c_tokens.push(9);
    c.append_tokens(a.seq, &[7]).unwrap();
    c.append_tokens(fork, &[9]).unwrap();
    write(&mut c, a.seq, &a_tokens, prompt.len());
    write(&mut c, fork, &c_tokens, prompt.len());
    let (la, lc) = (
        c.block_manager().blocks(a.seq.id()).unwrap(),
        c.block_manager().blocks(fork.id()).unwrap(),
    );
    assert_eq!(la.len(), lc.len());
    if !prompt.len().is_multiple_of(block_size as usize) {
        assert_ne!(
            la.last(),
            lc.last(),
            "copy-on-write gave the fork its own last block"
        );
    }
    check_decode::<T>(
        &mut c,
        &[(a.seq, &a_tokens), (fork, &c_tokens), (b.seq, &b_tokens)],
        &mut rng,
    );

    // Releasing A leaves the others intact.
    c.release(a.seq).unwrap();
    check_decode::<T>(&mut c, &[(fork, &c_tokens), (b.seq, &b_tokens)], &mut rng);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "minutes when interpreted; under Miri the arena casts and copies run in \
              ffi_cache and write_kv_as, the kernels' threads in concurrent_kernels"
)]
fn fork_prefix_and_copy_on_write_every_dtype_and_block_size() {
    // Miri: one block size that splits the prompt unevenly.
    for &bs in cases(&[8, 1, 16, 32, 256], 1) {
        fork_prefix_and_copy_on_write::<f32>(bs);
        fork_prefix_and_copy_on_write::<f16>(bs);
        fork_prefix_and_copy_on_write::<bf16>(bs);
    }
}

#[test]
fn arena_sized_in_bytes() {
    let geometry = Geometry::new(LAYERS, KV_HEADS, HEAD_DIM, 16, DType::F16).unwrap();
    let bytes = geometry.bytes_per_block() * 10 + 5;
    let c = KvCache::new(CacheConfig {
        geometry,
        capacity: Capacity::Bytes(bytes),
        max_seqs: 2,
        max_seq_len: 64,
        threads: 0,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .unwrap();
    assert_eq!(c.stats().total_blocks, 10);
    assert_eq!(
        c.arena().len_bytes() as u64,
        geometry.bytes_per_block() * 10
    );
    let tiny = CacheConfig {
        geometry,
        capacity: Capacity::Bytes(5),
        max_seqs: 2,
        max_seq_len: 64,
        threads: 0,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    };
    assert_eq!(KvCache::new(tiny).unwrap_err(), CacheError::BadConfig);
}

#[test]
fn stale_and_foreign_handles_are_refused() {
    let mut c1 = cache(DType::F32, 8, 16);
    let mut c2 = cache(DType::F32, 8, 16);
    let s1 = c1.create(0).unwrap();
    let s2 = c2.create(0).unwrap();
    assert_eq!(s1.id().index(), s2.id().index(), "same row in both caches");
    assert_eq!(
        c2.append(s1, 3),
        Err(CacheError::Seq(SeqError::ForeignHandle))
    );
    c1.append(s1, 3).unwrap();
    let kv = vec![0.5f32; 3 * ROW];
    assert_eq!(
        c2.write_kv(s1, 0, 0, &kv, &kv),
        Err(CacheError::Seq(SeqError::ForeignHandle))
    );
    let q = vec![0.5f32; Q_HEADS as usize * HEAD_DIM as usize];
    let mut out = vec![7.0f32; q.len()];
    assert_eq!(
        c2.decode(0, &[s1], &q, &mut out, Q_HEADS, 1.0),
        Err(CacheError::Seq(SeqError::ForeignHandle))
    );
    c1.release(s1).unwrap();
    assert_eq!(c1.release(s1), Err(CacheError::Seq(SeqError::StaleHandle)));
    assert_eq!(
        c1.decode(0, &[s1], &q, &mut out, Q_HEADS, 1.0),
        Err(CacheError::Seq(SeqError::StaleHandle))
    );
    let again = c1.create(0).unwrap();
    assert_eq!(again.id().index(), s1.id().index(), "row reused");
    assert_eq!(
        c1.write_kv(s1, 0, 0, &kv, &kv),
        Err(CacheError::Seq(SeqError::StaleHandle))
    );
    assert!(out.iter().all(|x| *x == 7.0));
}

#[test]
fn bad_inputs_write_nothing() {
    let mut rng = rng(3);
    let mut c = cache(DType::F16, 4, 16);
    let tokens: Vec<u32> = (0..6).collect();
    let p = c.create_with_prompt(0, &tokens).unwrap();
    write(&mut c, p.seq, &tokens, 0);
    let kv = random_vec(&mut rng, ROW);

    // Writes outside the pending range, wrong lengths, a layer out of range.
    assert_eq!(
        c.write_kv(p.seq, 0, 6, &kv, &kv),
        Err(CacheError::NotWritable {
            first: 6,
            tokens: 1,
            pending: 6,
            len: 6
        })
    );
    assert_eq!(
        c.write_kv(p.seq, 0, 0, &kv, &kv),
        Err(CacheError::NotWritable {
            first: 0,
            tokens: 1,
            pending: 6,
            len: 6
        }),
        "committed K/V may be shared: it is read-only"
    );
    let child = c.fork(p.seq).unwrap();
    assert_eq!(
        c.write_kv(p.seq, 0, 5, &kv, &kv),
        Err(CacheError::NotWritable {
            first: 5,
            tokens: 1,
            pending: 6,
            len: 6
        }),
        "after a fork the shared blocks are read-only"
    );
    c.append(child, 1).unwrap();
    let arena_before = c.arena().as_slice::<f16>().to_vec();
    assert_eq!(
        c.write_kv(child, 0, 6, &kv, &kv[..ROW - 1]),
        Err(CacheError::Kernel(KernelError::BufferLength {
            buffer: kvpage::Buffer::Values,
            expected: ROW,
            actual: ROW - 1
        }))
    );
    assert_eq!(
        c.write_kv(child, 2, 6, &kv, &kv),
        Err(CacheError::Kernel(KernelError::LayerOutOfRange {
            layer: 2,
            layers: 2
        }))
    );
    assert_eq!(
        c.arena().as_slice::<f16>(),
        &arena_before[..],
        "nothing written"
    );

    // Attention: heads that do not divide, wrong lengths, layer out of range, batch size.
    let hd = HEAD_DIM as usize;
    let q = random_vec(&mut rng, Q_HEADS as usize * hd);
    let mut out = vec![7.0f32; q.len()];
    let errs = [
        c.decode(0, &[p.seq], &q[..3 * hd], &mut out[..3 * hd], 3, 1.0),
        c.decode(0, &[p.seq], &q[..hd], &mut out, Q_HEADS, 1.0),
        c.decode(5, &[p.seq], &q, &mut out, Q_HEADS, 1.0),
        c.prefill(0, &[(p.seq, 7)], &q, &mut out, Q_HEADS, 1.0),
        c.decode(0, &[p.seq; 9], &q, &mut out, Q_HEADS, 1.0),
    ];
    assert_eq!(
        errs,
        [
            Err(CacheError::Kernel(KernelError::HeadsNotDivisible {
                q_heads: 3,
                kv_heads: 2
            })),
            Err(CacheError::Kernel(KernelError::BufferLength {
                buffer: kvpage::Buffer::Query,
                expected: 4 * hd,
                actual: hd
            })),
            Err(CacheError::Kernel(KernelError::LayerOutOfRange {
                layer: 5,
                layers: 2
            })),
            Err(CacheError::Kernel(KernelError::QueriesExceedContext {
                queries: 7,
                context_len: 6
            })),
            Err(CacheError::BatchTooLarge { seqs: 9, max: 8 }),
        ]
    );
    assert!(out.iter().all(|x| *x == 7.0), "output untouched");
    for e in errs {
        assert!(!e.unwrap_err().to_string().is_empty());
    }
    c.decode(0, &[p.seq], &q, &mut out, Q_HEADS, 1.0).unwrap();
    assert!(out.iter().all(|x| x.is_finite() && *x != 7.0));
}

/// The cache's workers, started once, give bit-identical results to the calling thread
/// alone over many consecutive prefill and decode calls (each output row is computed by
/// one task, whichever thread draws it).
#[test]
#[cfg_attr(
    miri,
    ignore = "minutes when interpreted; the workers' accesses are checked for races \
              under Miri by concurrent_kernels"
)]
fn workers_match_the_calling_thread_bit_for_bit_over_many_calls() {
    // Under Miri (which checks the workers' accesses for races) two threads.
    let workers = if cfg!(miri) { 2 } else { 4 };
    let blocks = if cfg!(miri) { 8 } else { 128 };
    let mut caches = [
        cache_on(DType::F16, 16, blocks, workers),
        cache_on(DType::F16, 16, blocks, 1),
    ];
    assert_eq!(caches[0].workers().threads(), workers);
    assert_eq!(caches[1].workers().threads(), 1);
    let mut r = rng(7);
    let row_q = (Q_HEADS * HEAD_DIM) as usize;
    // Miri: fewer and shorter prompts and steps, still several tasks per call.
    let (n_prompts, base_len, steps) = if cfg!(miri) { (2, 9, 1) } else { (6, 150, 20) };
    let prompts: Vec<Vec<u32>> = (0..n_prompts)
        .map(|s| (0..base_len + 20 * s).map(|t| t * 7 + s).collect())
        .collect();
    // Each cache's handles, in prompt order.
    let seqs: Vec<Vec<Seq>> = caches
        .iter_mut()
        .map(|c| {
            prompts
                .iter()
                .map(|p| {
                    let seq = c.create_with_prompt(0, p).unwrap().seq;
                    write(c, seq, p, 0);
                    seq
                })
                .collect()
        })
        .collect();
    let total: usize = prompts.iter().map(Vec::len).sum();
    let q = random_vec(&mut r, total * row_q);
    for layer in 0..LAYERS {
        let mut outs = [vec![0.0; q.len()], vec![0.0; q.len()]];
        for ((c, s), out) in caches.iter_mut().zip(&seqs).zip(&mut outs) {
            let batch: Vec<(Seq, u32)> = s
                .iter()
                .zip(&prompts)
                .map(|(&s, p)| (s, p.len() as u32))
                .collect();
            c.prefill(layer, &batch, &q, out, Q_HEADS, 0.25).unwrap();
        }
        assert_eq!(outs[0], outs[1], "prefill, layer {layer}");
    }
    for step in 0..steps {
        let q = random_vec(&mut r, prompts.len() * row_q);
        for layer in 0..LAYERS {
            let mut outs = [vec![0.0; q.len()], vec![0.0; q.len()]];
            for ((c, s), out) in caches.iter_mut().zip(&seqs).zip(&mut outs) {
                c.decode(layer, s, &q, out, Q_HEADS, 0.25).unwrap();
            }
            assert_eq!(outs[0], outs[1], "decode step {step}, layer {layer}");
        }
    }
}

/// K/V in the storage dtype is stored as given: the arena equals a write of the same
/// values through f32 (exact, since they widen and narrow back unchanged); another
/// element type is refused and writes nothing.
fn write_as_stores_the_storage_dtype<T: Element>() {
    let mut rng = rng(11);
    let tokens: Vec<u32> = (0..5).collect();
    let kv: Vec<T> = random_vec(&mut rng, 5 * ROW)
        .into_iter()
        .map(T::from_f32)
        .collect();
    let wide: Vec<f32> = kv.iter().map(|x| x.to_f32()).collect();
    let (mut a, mut b) = (cache(T::DTYPE, 4, 8), cache(T::DTYPE, 4, 8));
    let sa = a.create_with_prompt(0, &tokens).unwrap().seq;
    let sb = b.create_with_prompt(0, &tokens).unwrap().seq;
    for layer in 0..LAYERS {
        a.write_kv_as(sa, layer, 0, &kv, &kv).unwrap();
        b.write_kv(sb, layer, 0, &wide, &wide).unwrap();
    }
    assert_eq!(a.arena().as_slice::<T>(), b.arena().as_slice::<T>());
    let before = a.arena().as_slice::<T>().to_vec();
    let other = vec![0.5f32; 5 * ROW];
    let refused = match T::DTYPE {
        DType::F32 => a.write_kv_as(sa, 0, 0, &vec![f16::ONE; 5 * ROW], &[]),
        _ => a.write_kv_as(sa, 0, 0, &other, &other),
    };
    assert!(
        matches!(
            refused,
            Err(CacheError::Kernel(KernelError::DTypeMismatch { .. }))
        ),
        "{refused:?}"
    );
    assert_eq!(a.arena().as_slice::<T>(), &before[..]);
}

#[test]
fn write_kv_as_every_dtype() {
    write_as_stores_the_storage_dtype::<f32>();
    write_as_stores_the_storage_dtype::<f16>();
    write_as_stores_the_storage_dtype::<bf16>();
}
