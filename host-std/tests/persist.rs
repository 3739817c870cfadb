//! Saving and restoring a sequence: round trips on random K/V in every dtype and odd
//! lengths (after fork, truncate, copy-on-write), bit-identical attention after a
//! restore, restores into a fragmented cache, and every corruption class (each byte
//! flipped, every truncation, wrong geometry, dtype and model, no room) a typed error
//! that leaves the cache as it was, statistics and every arena byte.

mod common;

use common::{assert_same_output, cases, random_vec, rng};
use kvpage::persist::{format::HEADER_LEN, BlobHeader, PersistError, Section};
use kvpage::{
    CacheConfig, CacheError, Capacity, DType, Engine, EngineConfig, EngineError, Geometry, KvCache,
    ModelFingerprint, PositionRun, Preemption, Sampled, SchedulerConfig, SeqBlob, SeqError, Stats,
};
use kvpage::{PromptSeq, Seq};
use kvpage_core::SeqId;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::RngExt;

const MODEL: ModelFingerprint = ModelFingerprint::from_u64(0x6b76_7061_6765);

fn config(geometry: Geometry, blocks: u32) -> CacheConfig {
    CacheConfig {
        geometry,
        capacity: Capacity::Blocks(blocks),
        max_seqs: 16,
        max_seq_len: 256,
        threads: 1,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    }
}

fn geometry(layers: u32, kv_heads: u32, head_dim: u32, block_size: u32, dtype: DType) -> Geometry {
    Geometry::new(layers, kv_heads, head_dim, block_size, dtype).unwrap()
}

fn cache(geometry: Geometry, blocks: u32) -> KvCache {
    KvCache::new(config(geometry, blocks)).unwrap()
}

/// Writes random K/V for positions `from..len` of `seq` in every layer.
fn write_random(cache: &mut KvCache, seq: Seq, from: u32, r: &mut StdRng) {
    let g = *cache.geometry();
    let len = cache.len(seq).unwrap();
    let n = (len - from) as usize * (g.kv_heads() * g.head_dim()) as usize;
    for layer in 0..g.layers() {
        let (k, v) = (random_vec(r, n), random_vec(r, n));
        cache.write_kv(seq, layer, from, &k, &v).unwrap();
    }
}

/// A sequence of `len` random tokens with random K/V.
fn random_seq(cache: &mut KvCache, len: u32, r: &mut StdRng) -> (Seq, Vec<u32>) {
    let tokens: Vec<u32> = (0..len).map(|_| r.random_range(0..50_000)).collect();
    let seq = cache.create(0).unwrap();
    cache.append_tokens(seq, &tokens).unwrap();
    write_random(cache, seq, 0, r);
    (seq, tokens)
}

/// The stored bytes of every token of `seq`: per token, per layer, K then V, per head,
/// its `head_dim` elements. What the sequence reads, wherever its blocks are.
fn token_rows(cache: &KvCache, seq: Seq) -> Vec<u8> {
    token_rows_of(cache, seq.id())
}

/// [`token_rows`] of a core handle (an engine's sequence).
fn token_rows_of(cache: &KvCache, seq: SeqId) -> Vec<u8> {
    let g = *cache.geometry();
    let layout = cache.layout();
    let esize = g.dtype().size_bytes() as usize;
    let dim = g.head_dim() as usize;
    let blocks = cache.block_manager().blocks(seq).unwrap();
    let bytes = cache.arena().as_bytes();
    let mut out = Vec::new();
    for p in 0..cache.block_manager().len(seq).unwrap() {
        let (b, off) = (blocks[(p / g.block_size()) as usize], p % g.block_size());
        for layer in 0..g.layers() {
            for kv in 0..2 {
                for h in 0..g.kv_heads() {
                    let e = layout.tile_offset(b, layer, kv, h) + off as usize * dim;
                    out.extend_from_slice(&bytes[e * esize..(e + dim) * esize]);
                }
            }
        }
    }
    out
}

/// What must not change when an operation fails.
fn snapshot(cache: &KvCache) -> (Stats, Vec<u8>) {
    (cache.stats(), cache.arena().as_bytes().to_vec())
}

fn save(cache: &KvCache, seq: Seq, tokens: Option<&[u32]>) -> Vec<u8> {
    let mut blob = vec![0xa5u8; cache.saved_seq_size(seq, tokens.is_some()).unwrap()];
    let n = cache.save_seq(seq, tokens, &MODEL, &mut blob).unwrap();
    assert_eq!(n, blob.len());
    blob
}

/// Takes every other block of a cache with `blocks` blocks (one-block sequences,
/// released alternately), so its free blocks are scattered; returns the holders.
fn fragment(cache: &mut KvCache, r: &mut StdRng, holders: u32) -> Vec<Seq> {
    let bs = cache.geometry().block_size();
    let seqs: Vec<Seq> = (0..2 * holders)
        .map(|_| random_seq(cache, bs, r).0)
        .collect();
    let mut kept = Vec::new();
    for (i, s) in seqs.into_iter().enumerate() {
        if i % 2 == 0 {
            cache.release(s).unwrap();
        } else {
            kept.push(s);
        }
    }
    kept
}

fn persist_err(e: CacheError) -> PersistError {
    match e {
        CacheError::Persist(p) => p,
        other => panic!("expected a persist error, got {other:?}"),
    }
}

#[test]
fn round_trip_every_dtype_and_odd_length() {
    let mut r = rng(1);
    for &dtype in cases(
        &[
            DType::F16,
            DType::F32,
            DType::Bf16,
            DType::Int8,
            DType::Fp8E4m3,
        ],
        1,
    ) {
        for &bs in cases(&[3, 1, 4, 16], 1) {
            let g = geometry(2, 2, 8, bs, dtype);
            for &len in cases(&[2 * bs + 1, 0, 1, bs - 1, bs, bs + 1, 37], 2) {
                let mut a = cache(g, 64);
                let _other = random_seq(&mut a, 5, &mut r);
                let (seq, tokens) = random_seq(&mut a, len, &mut r);
                for with_ids in [false, true] {
                    let ids = with_ids.then_some(&tokens[..]);
                    let blob = save(&a, seq, ids);
                    assert_eq!(
                        blob.len() as u64,
                        SeqBlob::parse(&blob).unwrap().header().blob_len().unwrap()
                    );
                    let mut b = cache(g, 64);
                    let _held = fragment(&mut b, &mut r, 4);
                    let (restored, info) = b.restore_seq(&blob, 7, &MODEL).unwrap();
                    let what = format!("{dtype:?} bs {bs} len {len} ids {with_ids}");
                    assert_eq!(info.len, len, "{what}");
                    assert_eq!(b.len(restored).unwrap(), len, "{what}");
                    assert_eq!(info.tokens.map(|t| t.to_vec()), ids.map(<[u32]>::to_vec));
                    assert_eq!(token_rows(&b, restored), token_rows(&a, seq), "{what}");
                    // Canonical: saving the restored sequence gives the same bytes.
                    assert_eq!(save(&b, restored, ids), blob, "{what}");
                }
            }
        }
    }
}

#[test]
fn restored_decode_attention_is_bit_identical() {
    let mut r = rng(2);
    for &dtype in cases(
        &[
            DType::F16,
            DType::F32,
            DType::Bf16,
            DType::Int8,
            DType::Fp8E4m3,
        ],
        1,
    ) {
        let g = geometry(3, 2, 16, 16, dtype);
        let mut a = cache(g, 32);
        let (seq, tokens) = random_seq(&mut a, 45, &mut r);
        let blob = save(&a, seq, Some(&tokens));
        let mut b = cache(g, 64);
        let _held = fragment(&mut b, &mut r, 6);
        let (restored, _) = b.restore_seq(&blob, 0, &MODEL).unwrap();
        assert_ne!(
            a.block_manager().blocks(seq.id()).unwrap(),
            b.block_manager().blocks(restored.id()).unwrap(),
            "restored into other blocks"
        );
        let q = random_vec(&mut r, 4 * 16);
        for &layer in cases(&[2, 0, 1], 1) {
            let (mut x, mut y) = (vec![0.0f32; q.len()], vec![0.0f32; q.len()]);
            a.decode(layer, &[seq], &q, &mut x, 4, 0.25).unwrap();
            b.decode(layer, &[restored], &q, &mut y, 4, 0.25).unwrap();
            assert_same_output(&y, &x);
        }
    }
}

#[test]
fn round_trip_after_fork_truncate_and_copy_on_write() {
    let mut r = rng(3);
    let g = geometry(2, 1, 8, 4, DType::F16);
    let mut a = cache(g, 64);
    let (parent, mut tokens) = random_seq(&mut a, 10, &mut r);
    let child = a.fork(parent).unwrap();
    a.truncate(child, 7).unwrap();
    tokens.truncate(7);
    // Appending into the shared partial block copies it first.
    let more = [11, 12, 13];
    a.append_tokens(child, &more).unwrap();
    tokens.extend(more);
    write_random(&mut a, child, 7, &mut r);
    let blob = save(&a, child, Some(&tokens));
    let mut b = cache(g, 16);
    let (restored, info) = b.restore_seq(&blob, 0, &MODEL).unwrap();
    assert_eq!(info.tokens.unwrap().to_vec(), tokens);
    assert_eq!(token_rows(&b, restored), token_rows(&a, child));
    // The parent is untouched by the child's save, and saves on its own.
    let parent_blob = save(&a, parent, None);
    let (p2, _) = b.restore_seq(&parent_blob, 0, &MODEL).unwrap();
    assert_eq!(token_rows(&b, p2), token_rows(&a, parent));
}

#[test]
fn restores_into_scattered_free_blocks_only_when_they_suffice() {
    let mut r = rng(4);
    let g = geometry(1, 2, 8, 4, DType::Bf16);
    let mut a = cache(g, 16);
    let (seq, tokens) = random_seq(&mut a, 22, &mut r); // 6 blocks
    let blob = save(&a, seq, Some(&tokens));

    // 16 blocks: 8 one-block holders on the odd blocks, the even ones free: no two free
    // blocks are adjacent, yet 6 of them serve the sequence.
    let mut b = cache(g, 16);
    let held = fragment(&mut b, &mut r, 8);
    assert_eq!(b.stats().free_blocks, 8);
    let (restored, _) = b.restore_seq(&blob, 0, &MODEL).unwrap();
    let blocks = b.block_manager().blocks(restored.id()).unwrap().to_vec();
    assert!(blocks.windows(2).all(|w| w[1] > w[0] + 1), "{blocks:?}");
    assert_eq!(token_rows(&b, restored), token_rows(&a, seq));

    // Two free blocks left: a second copy needs six.
    let before = snapshot(&b);
    let e = b.restore_seq(&blob, 0, &MODEL).unwrap_err();
    assert_eq!(
        e,
        CacheError::Persist(PersistError::NoSpace {
            needed: 6,
            available: 2
        })
    );
    assert_eq!(snapshot(&b), before);
    drop(held);
}

#[test]
fn restore_evicts_cached_blocks_when_free_ones_run_out() {
    let mut r = rng(12);
    let g = geometry(1, 1, 8, 4, DType::F16);
    let mut a = cache(g, 16);
    let (big, big_ids) = random_seq(&mut a, 19, &mut r); // 5 blocks
    let (huge, _) = random_seq(&mut a, 27, &mut r); // 7 blocks
    let blob = save(&a, big, Some(&big_ids));
    let too_big = save(&a, huge, None);

    // 8 blocks: 2 held, 4 cached (a committed prompt, released), 2 free.
    let mut b = cache(g, 8);
    let _held = random_seq(&mut b, 8, &mut r);
    let (prompt, _) = random_seq(&mut b, 16, &mut r);
    assert_eq!(b.commit(prompt).unwrap(), 4);
    b.release(prompt).unwrap();
    let s = b.stats();
    assert_eq!((s.free_blocks, s.cached_blocks), (2, 4));
    let before = snapshot(&b);
    assert_eq!(
        b.restore_seq(&too_big, 0, &MODEL).unwrap_err(),
        CacheError::Persist(PersistError::NoSpace {
            needed: 7,
            available: 6
        })
    );
    assert_eq!(snapshot(&b), before);
    let (restored, _) = b.restore_seq(&blob, 0, &MODEL).unwrap();
    assert_eq!(token_rows(&b, restored), token_rows(&a, big));
    let s = b.stats();
    assert_eq!((s.free_blocks, s.cached_blocks, s.used_blocks), (0, 1, 7));
}

#[test]
fn restored_ids_reach_the_prefix_cache_once_committed() {
    let mut r = rng(5);
    let g = geometry(1, 1, 8, 4, DType::F32);
    let mut a = cache(g, 16);
    let (seq, tokens) = random_seq(&mut a, 9, &mut r);
    let blob = save(&a, seq, Some(&tokens));
    let mut b = cache(g, 16);
    let (restored, _) = b.restore_seq(&blob, 3, &MODEL).unwrap();
    // Its K/V counts as written: no write is allowed before new tokens.
    assert!(matches!(
        b.write_kv(restored, 0, 0, &[0.0; 8], &[0.0; 8]),
        Err(CacheError::NotWritable { .. })
    ));
    assert_eq!(b.commit(restored).unwrap(), 2);
    let PromptSeq { reused_tokens, .. } = b.create_with_prompt(3, &tokens).unwrap();
    assert_eq!(reused_tokens, 8);
    // Without ids nothing is shareable.
    let blob = save(&a, seq, None);
    let mut c = cache(g, 16);
    let (restored, _) = c.restore_seq(&blob, 3, &MODEL).unwrap();
    assert_eq!(c.commit(restored).unwrap(), 0);
}

#[test]
fn an_engine_request_saves_with_its_ids_and_restores_into_a_cache() {
    let mut r = rng(11);
    let g = geometry(2, 2, 8, 4, DType::F16);
    let mut engine = Engine::new(EngineConfig {
        cache: config(g, 16),
        max_requests: 2,
        scheduler: SchedulerConfig {
            token_budget: 16,
            max_running: 2,
            watermark_blocks: 0,
            preemption: Preemption::Recompute,
        },
        host_capacity: Capacity::Blocks(0),
    })
    .unwrap();
    let id = engine
        .add_request(&[5, 6, 7, 8, 9, 10, 11], 0, Some(20))
        .unwrap();
    let mut seq = None;
    for t in 0..4 {
        let step = engine.step().unwrap();
        let n = step.tokens() as usize * (2 * 8);
        seq = step.seqs().next().map(|s| s.seq);
        for layer in 0..2 {
            let (k, v) = (random_vec(&mut r, n), random_vec(&mut r, n));
            engine.write_kv(layer, &k, &v).unwrap();
        }
        let mut buf = vec![0u8; 4096];
        assert_eq!(
            engine.save_request(id, &MODEL, &mut buf),
            Err(CacheError::Engine(EngineError::StepInProgress))
        );
        let sample = Sampled {
            request: id,
            token: 100 + t,
            stop: false,
        };
        engine.commit_step(&[sample]).unwrap();
    }
    let mut blob = vec![0u8; engine.saved_request_size(id).unwrap()];
    engine.save_request(id, &MODEL, &mut blob).unwrap();
    let tokens = engine.tokens(id).unwrap();
    // Prompt and four samples; the last sample's K/V comes with the next step.
    assert_eq!(tokens.len(), 11);
    let mut b = cache(g, 16);
    let (restored, info) = b.restore_seq(&blob, 0, &MODEL).unwrap();
    assert_eq!(info.tokens.unwrap().to_vec(), &tokens[..10]);
    assert_eq!(
        token_rows(&b, restored),
        token_rows_of(engine.cache(), seq.unwrap())
    );
}

/// A small cache holding one other sequence, and the blob of a small sequence of the
/// same geometry with ids.
fn small_case() -> (KvCache, Vec<u8>) {
    let mut r = rng(6);
    let g = geometry(1, 2, 4, 4, DType::F16);
    let mut a = cache(g, 8);
    let (seq, tokens) = random_seq(&mut a, 5, &mut r);
    let blob = save(&a, seq, Some(&tokens));
    let mut b = cache(g, 8);
    let _ = random_seq(&mut b, 3, &mut r);
    (b, blob)
}

#[test]
fn every_flipped_byte_is_a_typed_error_and_changes_nothing() {
    let (mut cache, blob) = small_case();
    let before = snapshot(&cache);
    // Under Miri, a sample of the bytes (every header field and section still hit).
    let stride = if cfg!(miri) { 23 } else { 1 };
    for i in (0..blob.len()).step_by(stride) {
        for &mask in cases(&[0x01u8, 0x80, 0xff], 1) {
            let mut bad = blob.clone();
            bad[i] ^= mask;
            let e = persist_err(cache.restore_seq(&bad, 0, &MODEL).unwrap_err());
            let expected_kind = match i {
                0..8 => matches!(e, PersistError::BadMagic),
                8..10 => matches!(e, PersistError::UnsupportedVersion { .. }),
                _ => matches!(e, PersistError::Corrupt { .. }),
            };
            assert!(expected_kind, "byte {i} ^ {mask:#x}: {e:?}");
            assert_eq!(snapshot(&cache), before, "byte {i}");
        }
    }
    // The blob itself restores.
    cache.restore_seq(&blob, 0, &MODEL).unwrap();
}

#[test]
fn every_truncation_and_any_extra_byte_is_refused() {
    let (mut cache, blob) = small_case();
    let before = snapshot(&cache);
    let stride = if cfg!(miri) { 23 } else { 1 };
    for n in (0..blob.len()).step_by(stride) {
        let e = persist_err(cache.restore_seq(&blob[..n], 0, &MODEL).unwrap_err());
        assert!(
            matches!(e, PersistError::Truncated { got, .. } if got == n as u64),
            "length {n}: {e:?}"
        );
        assert_eq!(snapshot(&cache), before);
    }
    let mut long = blob.clone();
    long.push(0);
    assert_eq!(
        persist_err(cache.restore_seq(&long, 0, &MODEL).unwrap_err()),
        PersistError::TrailingBytes { extra: 1 }
    );
    assert_eq!(snapshot(&cache), before);
}

#[test]
fn other_geometry_dtype_model_or_capacity_is_refused() {
    let mut r = rng(7);
    let g = geometry(2, 2, 8, 4, DType::F16);
    let mut a = cache(g, 16);
    let (seq, tokens) = random_seq(&mut a, 9, &mut r);
    let blob = save(&a, seq, Some(&tokens));
    let others = [
        geometry(3, 2, 8, 4, DType::F16),
        geometry(2, 1, 8, 4, DType::F16),
        geometry(2, 2, 16, 4, DType::F16),
        geometry(2, 2, 8, 8, DType::F16),
    ];
    for other in others {
        let mut b = cache(other, 16);
        let before = snapshot(&b);
        let e = persist_err(b.restore_seq(&blob, 0, &MODEL).unwrap_err());
        assert!(matches!(e, PersistError::GeometryMismatch { .. }), "{e:?}");
        assert_eq!(snapshot(&b), before);
    }
    for dtype in [DType::F32, DType::Bf16] {
        let mut b = cache(geometry(2, 2, 8, 4, dtype), 16);
        let e = persist_err(b.restore_seq(&blob, 0, &MODEL).unwrap_err());
        assert_eq!(
            e,
            PersistError::DtypeMismatch {
                blob: 1,
                cache: dtype
            }
        );
    }
    let mut b = cache(g, 16);
    let before = snapshot(&b);
    let e = b.restore_seq(&blob, 0, &ModelFingerprint::from_u64(1));
    assert_eq!(
        e.unwrap_err(),
        CacheError::Persist(PersistError::ModelMismatch)
    );
    let mut other_bytes = MODEL;
    other_bytes.0[31] = 1;
    let e = b.restore_seq(&blob, 0, &other_bytes);
    assert_eq!(
        e.unwrap_err(),
        CacheError::Persist(PersistError::ModelMismatch)
    );
    assert_eq!(snapshot(&b), before);

    // Longer than the cache's max_seq_len.
    let short = KvCache::new(CacheConfig {
        max_seq_len: 8,
        ..config(g, 16)
    });
    let mut short = short.unwrap();
    assert!(matches!(
        short.restore_seq(&blob, 0, &MODEL),
        Err(CacheError::Seq(SeqError::TooLong { tokens: 9, .. }))
    ));
    // No free sequence slot.
    let mut full = KvCache::new(CacheConfig {
        max_seqs: 1,
        ..config(g, 16)
    })
    .unwrap();
    let _only = full.create(0).unwrap();
    let before = snapshot(&full);
    assert_eq!(
        full.restore_seq(&blob, 0, &MODEL).unwrap_err(),
        CacheError::Seq(SeqError::NoFreeSequence)
    );
    assert_eq!(snapshot(&full), before);
}

/// Offsets of the framed sections of a blob: `(frame start, payload length)` each.
fn sections(blob: &[u8]) -> Vec<(usize, usize)> {
    let mut at = HEADER_LEN;
    (0..3)
        .map(|_| {
            let len = u64::from_le_bytes(blob[at + 8..at + 16].try_into().unwrap()) as usize;
            let s = (at, len);
            at += 16 + len + 4;
            s
        })
        .collect()
}

/// Recomputes the CRCs of the header and of each section after an edit, so that the
/// checks behind them are reached.
fn reseal(blob: &mut [u8]) {
    let crc = |b: &[u8]| crc32fast::hash(b).to_le_bytes();
    let h = crc(&blob[..HEADER_LEN - 4]);
    blob[HEADER_LEN - 4..HEADER_LEN].copy_from_slice(&h);
    for (at, len) in sections(blob) {
        let c = crc(&blob[at..at + 16 + len]);
        blob[at + 16 + len..at + 20 + len].copy_from_slice(&c);
    }
}

#[test]
fn content_checks_behind_the_checksums() {
    let (mut cache, blob) = small_case();
    let before = snapshot(&cache);
    let secs = sections(&blob);
    let refuse = |cache: &mut KvCache, bad: &[u8], want: PersistError| {
        let e = persist_err(cache.restore_seq(bad, 0, &MODEL).unwrap_err());
        assert_eq!(e, want);
    };
    // A non-zero row past the end of the tail block.
    let (kv_at, kv_len) = secs[2];
    let mut bad = blob.clone();
    bad[kv_at + 16 + kv_len - 1] = 1;
    reseal(&mut bad);
    refuse(
        &mut cache,
        &bad,
        PersistError::Corrupt {
            section: Section::Kv,
        },
    );
    // Counts that disagree: one block too few.
    let mut bad = blob.clone();
    bad[88] -= 1;
    reseal(&mut bad);
    refuse(
        &mut cache,
        &bad,
        PersistError::Corrupt {
            section: Section::Header,
        },
    );
    // A section of another kind where the token ids belong.
    let mut bad = blob.clone();
    bad[secs[0].0] = 3;
    reseal(&mut bad);
    refuse(
        &mut cache,
        &bad,
        PersistError::Corrupt {
            section: Section::Tokens,
        },
    );
    // Unknown flags and versions.
    let mut bad = blob.clone();
    bad[12] |= 0x80;
    reseal(&mut bad);
    refuse(
        &mut cache,
        &bad,
        PersistError::UnsupportedFlags { flags: 0x81 },
    );
    let mut bad = blob.clone();
    bad[8] = 2;
    refuse(
        &mut cache,
        &bad,
        PersistError::UnsupportedVersion { found: 2 },
    );
    assert_eq!(snapshot(&cache), before);
    // Other token ids, resealed, are a valid blob: restored with those ids.
    let mut other = blob.clone();
    other[secs[0].0 + 16] ^= 0x40;
    reseal(&mut other);
    let (_, info) = cache.restore_seq(&other, 0, &MODEL).unwrap();
    let original = SeqBlob::parse(&blob).unwrap().tokens().unwrap().to_vec();
    assert_ne!(info.tokens.unwrap().to_vec(), original);
}

/// A sequence of 19 tokens with positions `[0..3) [9..19) [23..29)` (three runs, made by
/// two range removals then a context shift), saved with its ids.
fn gapped_case(dtype: DType, r: &mut StdRng) -> (KvCache, Seq, Vec<u8>) {
    let g = geometry(2, 2, 8, 4, dtype);
    let mut a = cache(g, 32);
    let (seq, mut tokens) = random_seq(&mut a, 30, r);
    a.remove_range(seq, 4, 10).unwrap();
    tokens.drain(4..10);
    a.remove_range(seq, 14, 18).unwrap();
    tokens.drain(14..18);
    a.context_shift(seq, 2, 1).unwrap();
    tokens.remove(2);
    let runs = a.position_runs(seq).unwrap().to_vec();
    assert_eq!(
        runs,
        [run(0, 0), run(3, 9), run(13, 23)],
        "positions with gaps"
    );
    let blob = save(&a, seq, Some(&tokens));
    (a, seq, blob)
}

fn run(first_index: u32, first_position: u32) -> PositionRun {
    PositionRun {
        first_index,
        first_position,
    }
}

#[test]
fn positions_with_gaps_round_trip_and_decode_bit_identically() {
    let mut r = rng(11);
    for &dtype in cases(
        &[
            DType::F16,
            DType::F32,
            DType::Bf16,
            DType::Int8,
            DType::Fp8E4m3,
        ],
        1,
    ) {
        let (mut a, seq, blob) = gapped_case(dtype, &mut r);
        assert_eq!(SeqBlob::parse(&blob).unwrap().header().position_runs, 3);
        let mut b = cache(*a.geometry(), 32);
        let _held = fragment(&mut b, &mut r, 3);
        let (restored, info) = b.restore_seq(&blob, 0, &MODEL).unwrap();
        assert_eq!(info.len, 19);
        assert_eq!(
            b.position_runs(restored).unwrap(),
            a.position_runs(seq).unwrap()
        );
        assert_eq!(b.pos_range(restored).unwrap(), a.pos_range(seq).unwrap());
        assert_eq!(token_rows(&b, restored), token_rows(&a, seq));
        assert_eq!(
            save(&b, restored, info.tokens.map(|t| t.to_vec()).as_deref()),
            blob
        );
        let q = random_vec(&mut r, 4 * 8);
        for layer in 0..2 {
            let (mut x, mut y) = (vec![0.0f32; q.len()], vec![0.0f32; q.len()]);
            a.decode(layer, &[seq], &q, &mut x, 4, 0.25).unwrap();
            b.decode(layer, &[restored], &q, &mut y, 4, 0.25).unwrap();
            assert_same_output(&y, &x);
        }
    }
}

#[test]
fn bad_position_runs_behind_valid_checksums_are_refused_and_change_nothing() {
    let mut r = rng(12);
    let (_, _, blob) = gapped_case(DType::F16, &mut r);
    let mut b = cache(geometry(2, 2, 8, 4, DType::F16), 32);
    let _ = random_seq(&mut b, 6, &mut r);
    let before = snapshot(&b);
    let at = sections(&blob)[1].0 + 16;
    let word = |blob: &mut [u8], k: usize, v: u32| {
        blob[at + 4 * k..at + 4 * k + 4].copy_from_slice(&v.to_le_bytes());
    };
    // Words: [0, 0, 3, 9, 13, 23] (index, position per run).
    let bad_runs: &[(&str, &[(usize, u32)])] = &[
        ("first run not at token 0", &[(0, 1)]),
        ("run starts not increasing", &[(4, 3)]),
        ("run start past the end", &[(4, 19)]),
        ("positions overlapping", &[(5, 12)]),
        ("positions decreasing", &[(3, 0), (5, 2)]),
        ("last position past u32", &[(5, u32::MAX - 2)]),
    ];
    for (what, edits) in bad_runs {
        let mut bad = blob.clone();
        for &(k, v) in *edits {
            word(&mut bad, k, v);
        }
        reseal(&mut bad);
        assert!(SeqBlob::parse(&bad).is_ok(), "{what}: checksums valid");
        assert_eq!(
            b.restore_seq(&bad, 0, &MODEL).unwrap_err(),
            CacheError::Seq(SeqError::BadPositions),
            "{what}"
        );
        assert_eq!(snapshot(&b), before, "{what}");
    }
    // More runs than the cache holds (4): five, each one a valid step.
    let mut bad = blob[..at].to_vec();
    for k in 0..5u32 {
        bad.extend(k.to_le_bytes());
        bad.extend((2 * k).to_le_bytes());
    }
    bad.extend(&blob[at + 24..]);
    bad[84..88].copy_from_slice(&5u32.to_le_bytes());
    bad[at - 8..at].copy_from_slice(&40u64.to_le_bytes());
    reseal(&mut bad);
    assert!(SeqBlob::parse(&bad).is_ok(), "checksums valid");
    assert_eq!(
        b.restore_seq(&bad, 0, &MODEL).unwrap_err(),
        CacheError::Seq(SeqError::TooManyPositionRuns {
            needed: 5,
            capacity: 4
        })
    );
    assert_eq!(snapshot(&b), before);
    // The untouched blob restores.
    b.restore_seq(&blob, 0, &MODEL).unwrap();
}

#[test]
fn save_checks_before_it_writes() {
    let mut r = rng(8);
    let g = geometry(1, 1, 4, 4, DType::F32);
    let mut a = cache(g, 8);
    let (seq, tokens) = random_seq(&mut a, 6, &mut r);
    let size = a.saved_seq_size(seq, true).unwrap();
    assert_eq!(size, a.saved_seq_size(seq, false).unwrap() + 4 * 6);
    // Two blocks of 2 x 4 x 4 f32 (128 bytes each), 164 bytes of header and framing.
    assert_eq!(a.saved_seq_size(seq, false).unwrap(), 2 * 128 + 164);
    let mut out = vec![0x5au8; size - 1];
    assert_eq!(
        a.save_seq(seq, Some(&tokens), &MODEL, &mut out),
        Err(CacheError::Persist(PersistError::BufferTooSmall {
            needed: size,
            got: size - 1
        }))
    );
    assert!(out.iter().all(|&b| b == 0x5a));
    let mut out = vec![0x5au8; size + 10];
    assert_eq!(
        a.save_seq(seq, Some(&tokens[..5]), &MODEL, &mut out),
        Err(CacheError::Persist(PersistError::TokenCountMismatch {
            expected: 6,
            got: 5
        }))
    );
    assert!(out.iter().all(|&b| b == 0x5a));
    // A larger buffer: the blob is its start, the rest untouched.
    assert_eq!(a.save_seq(seq, Some(&tokens), &MODEL, &mut out), Ok(size));
    assert!(out[size..].iter().all(|&b| b == 0x5a));
    a.release(seq).unwrap();
    assert_eq!(
        a.saved_seq_size(seq, true),
        Err(CacheError::Seq(SeqError::StaleHandle))
    );
    let header = BlobHeader::decode(&out).unwrap();
    assert_eq!(
        (header.tokens, header.blocks, header.fingerprint),
        (6, 2, MODEL)
    );
}

#[test]
#[cfg_attr(miri, ignore = "file system: Miri's isolation forbids it")]
fn file_round_trip_replaces_the_old_file_atomically() {
    let mut r = rng(9);
    let g = geometry(2, 2, 8, 4, DType::Bf16);
    let mut a = cache(g, 16);
    let (seq, tokens) = random_seq(&mut a, 13, &mut r);
    let dir = std::env::temp_dir().join(format!("kvpage-persist-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("chat.kvseq");
    std::fs::write(&path, b"an older save").unwrap();
    let n = a
        .save_seq_to_file(seq, Some(&tokens), &MODEL, &path)
        .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), save(&a, seq, Some(&tokens)));
    assert_eq!(n, std::fs::metadata(&path).unwrap().len());
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        1,
        "no temporary left"
    );
    let mut b = cache(g, 16);
    let (restored, info) = b.restore_seq_from_file(&path, 0, &MODEL).unwrap();
    assert_eq!(info.tokens, Some(tokens.clone()));
    assert_eq!(token_rows(&b, restored), token_rows(&a, seq));
    // A failed save (wrong ids) leaves the file as it was.
    let e = a.save_seq_to_file(seq, Some(&tokens[1..]), &MODEL, &path);
    assert!(matches!(
        e,
        Err(CacheError::Persist(PersistError::TokenCountMismatch { .. }))
    ));
    assert_eq!(std::fs::read(&path).unwrap(), save(&a, seq, Some(&tokens)));
    let missing = b.restore_seq_from_file(dir.join("missing"), 0, &MODEL);
    assert!(matches!(
        missing,
        Err(CacheError::Persist(PersistError::Io {
            kind: std::io::ErrorKind::NotFound,
            ..
        }))
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// 256 cases natively; under Miri 2, without failure persistence (regression files are
/// file-system access, which Miri's isolation forbids).
fn proptest_config() -> ProptestConfig {
    let mut config = ProptestConfig::with_cases(if cfg!(miri) { 2 } else { 256 });
    if cfg!(miri) {
        config.failure_persistence = None;
    }
    config
}

proptest! {
    #![proptest_config(proptest_config())]

    /// Arbitrary bytes, with or without the magic in front: never a panic, always an
    /// error, and the cache unchanged.
    #[test]
    fn arbitrary_bytes_are_refused_without_a_trace(
        bytes in proptest::collection::vec(any::<u8>(), 0..400),
        magic in any::<bool>(),
    ) {
        let (mut cache, _) = small_case();
        let before = snapshot(&cache);
        let mut blob = bytes;
        if magic {
            let mut with = b"KVPAGESQ\x01\x00".to_vec();
            with.extend_from_slice(&blob);
            blob = with;
        }
        prop_assert!(cache.restore_seq(&blob, 0, &MODEL).is_err());
        prop_assert!(snapshot(&cache) == before);
    }

    /// A valid blob with a header field overwritten and every checksum recomputed (so
    /// the count and length checks are reached with arbitrary numbers), or truncated
    /// anywhere: never a panic, and either a typed error leaving the cache unchanged or
    /// a restore of exactly what the blob says.
    #[test]
    fn resealed_header_fields_reach_the_count_checks(
        field in prop::sample::select(vec![16usize, 20, 24, 28, 32, 36, 40, 44, 80, 84, 88]),
        value in prop_oneof![any::<u32>(), 0u32..8, Just(u32::MAX)],
        cut in any::<prop::sample::Index>(),
    ) {
        let (mut cache, blob) = small_case();
        let mut before = snapshot(&cache);
        let mut bad = blob.clone();
        bad[field..field + 4].copy_from_slice(&value.to_le_bytes());
        reseal_header(&mut bad);
        let cut = HEADER_LEN + cut.index(bad.len() - HEADER_LEN + 1);
        for candidate in [&bad[..], &bad[..cut]] {
            match cache.restore_seq(candidate, 0, &MODEL) {
                Ok((seq, info)) => {
                    prop_assert_eq!(candidate, &blob[..]);
                    cache.release(seq).unwrap();
                    prop_assert_eq!(info.len, 5);
                    // The restore wrote blocks that are free again.
                    before = snapshot(&cache);
                }
                Err(CacheError::Persist(_)) | Err(CacheError::Seq(_)) => {
                    prop_assert!(snapshot(&cache) == before);
                }
                Err(e) => prop_assert!(false, "unexpected error {e:?}"),
            }
        }
    }
}

/// Recomputes the header's CRC only.
fn reseal_header(blob: &mut [u8]) {
    let crc = crc32fast::hash(&blob[..HEADER_LEN - 4]).to_le_bytes();
    blob[HEADER_LEN - 4..HEADER_LEN].copy_from_slice(&crc);
}

/// Writes the seed corpus of the `restore_seq` fuzz target (host-std/fuzz): valid blobs
/// of its cache's geometry and fingerprint, with and without ids, a few lengths, each
/// with mode byte 0 (as is) and 1 (checksums recomputed after mutation).
#[test]
#[ignore = "writes host-std/fuzz/corpus/restore_seq; run by hand"]
fn write_fuzz_seeds() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/restore_seq");
    std::fs::create_dir_all(&dir).unwrap();
    let g = geometry(2, 2, 8, 4, DType::F16);
    let model = ModelFingerprint::from_u64(0xf022);
    let mut r = rng(10);
    for len in [0, 1, 4, 6, 13] {
        let mut a = cache(g, 8);
        let (seq, tokens) = random_seq(&mut a, len, &mut r);
        for ids in [None, Some(&tokens[..])] {
            let mut blob = vec![0u8; a.saved_seq_size(seq, ids.is_some()).unwrap()];
            a.save_seq(seq, ids, &model, &mut blob).unwrap();
            for mode in [0u8, 1] {
                let name = format!("len{len}-ids{}-mode{mode}", u8::from(ids.is_some()));
                let mut seed = vec![mode];
                seed.extend_from_slice(&blob);
                std::fs::write(dir.join(name), seed).unwrap();
            }
        }
    }
}
