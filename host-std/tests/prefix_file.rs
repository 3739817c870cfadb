//! The persistent prefix cache: save at shutdown, load at start-up. Round trips in
//! every dtype with the loaded prefixes hit and their K/V bit-identical; every class
//! of damage (a flipped byte in each record, truncation, trailing bytes) skipped and
//! counted without serving wrong K/V; a wrong header, geometry, dtype or model refused
//! with the cache unchanged; loads into a smaller cache stop without evicting.

mod common;

use common::{random_vec, rng};
use kvpage::persist::{PersistError, PREFIX_HEADER_LEN};
use kvpage::{
    CacheConfig, CacheError, Capacity, DType, Geometry, KvCache, ModelFingerprint,
    PrefixLoadReport, Seq, Stats,
};
use rand::rngs::StdRng;

const MODEL: ModelFingerprint = ModelFingerprint::from_u64(0x7072_6566_6978);

fn cache(dtype: DType, blocks: u32) -> KvCache {
    let geometry = Geometry::new(2, 2, 8, 4, dtype).unwrap();
    KvCache::new(CacheConfig {
        geometry,
        capacity: Capacity::Blocks(blocks),
        max_seqs: 8,
        max_seq_len: 64,
        threads: 1,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .unwrap()
}

/// Runs `prompt` through `cache` in `namespace`: the prompt's K/V is random (written
/// past the reused prefix), then committed; the sequence is released unless `keep`.
fn serve(
    cache: &mut KvCache,
    namespace: u64,
    prompt: &[u32],
    keep: bool,
    r: &mut StdRng,
) -> (Seq, u32) {
    let g = *cache.geometry();
    let start = cache.create_with_prompt(namespace, prompt).unwrap();
    let from = start.reused_tokens;
    let n = (prompt.len() as u32 - from) as usize * (g.kv_heads() * g.head_dim()) as usize;
    for layer in 0..g.layers() {
        let (k, v) = (random_vec(r, n), random_vec(r, n));
        cache.write_kv(start.seq, layer, from, &k, &v).unwrap();
    }
    cache.commit(start.seq).unwrap();
    if !keep {
        cache.release(start.seq).unwrap();
    }
    (start.seq, start.reused_tokens)
}

/// The stored bytes of the first `tokens` tokens of `seq`, token by token.
fn rows(cache: &KvCache, seq: Seq, tokens: u32) -> Vec<u8> {
    let g = *cache.geometry();
    let esize = g.dtype().size_bytes() as usize;
    let dim = g.head_dim() as usize;
    let blocks = cache.block_manager().blocks(seq.id()).unwrap();
    let bytes = cache.arena().as_bytes();
    let mut out = Vec::new();
    for p in 0..tokens {
        let (b, off) = (blocks[(p / g.block_size()) as usize], p % g.block_size());
        for layer in 0..g.layers() {
            for kv in 0..2 {
                for h in 0..g.kv_heads() {
                    let e = cache.layout().tile_offset(b, layer, kv, h) + off as usize * dim;
                    out.extend_from_slice(&bytes[e * esize..(e + dim) * esize]);
                }
            }
        }
    }
    out
}

fn snapshot(cache: &KvCache) -> (Stats, Vec<u8>) {
    (cache.stats(), cache.arena().as_bytes().to_vec())
}

fn save(cache: &KvCache) -> Vec<u8> {
    let size = cache.saved_prefix_cache_size() as usize;
    let mut out = vec![0x5au8; size];
    let saved = cache.save_prefix_cache(&MODEL, &mut out).unwrap();
    assert_eq!(saved.bytes as usize, size);
    out
}

/// Prompts of a few shapes: a system prompt (3 blocks) and two branches below it in
/// namespace 0, the system prompt again in namespace 9. Returns the source cache and
/// the prompts with their namespace.
fn source(dtype: DType, r: &mut StdRng) -> (KvCache, Vec<(u64, Vec<u32>)>) {
    let mut a = cache(dtype, 32);
    let system: Vec<u32> = (0..13).map(|i| 100 + i).collect();
    let mut one = system[..12].to_vec();
    one.extend(500..507);
    let mut two = system[..12].to_vec();
    two.extend(600..610);
    let prompts = vec![(0, system.clone()), (0, one), (0, two), (9, system)];
    for (k, (ns, p)) in prompts.iter().enumerate() {
        // The last one stays live: a live sequence's registered blocks are saved too.
        serve(&mut a, *ns, p, k == 3, r);
    }
    (a, prompts)
}

#[test]
fn a_loaded_prefix_cache_hits_with_identical_kv_in_every_dtype() {
    for dtype in [
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::Int8,
        DType::Fp8E4m3,
    ] {
        let mut r = rng(7);
        let (mut a, prompts) = source(dtype, &mut r);
        let file = save(&a);
        // 3 system blocks, 1 + 2 branch blocks, 3 blocks in namespace 9.
        let records = 3 + 1 + 2 + 3;
        assert_eq!(
            file.len(),
            PREFIX_HEADER_LEN + records * (40 + 16 + a.geometry().bytes_per_block() as usize)
        );
        let mut b = cache(dtype, 32);
        let report = b.load_prefix_cache(&file, &MODEL).unwrap();
        assert_eq!(
            report,
            PrefixLoadReport {
                records: records as u32,
                loaded: records as u32,
                ..Default::default()
            }
        );
        assert_eq!(b.stats().cached_blocks, records as u32);
        // The same prompts hit as deep on the loaded cache, reading the same K/V.
        for (ns, p) in &prompts {
            let want = a.create_with_prompt(*ns, p).unwrap();
            let got = b.create_with_prompt(*ns, p).unwrap();
            assert_eq!(
                got.reused_tokens, want.reused_tokens,
                "{dtype:?} namespace {ns}"
            );
            assert!(got.reused_tokens >= 12);
            assert_eq!(
                rows(&b, got.seq, got.reused_tokens),
                rows(&a, want.seq, want.reused_tokens)
            );
            a.release(want.seq).unwrap();
            b.release(got.seq).unwrap();
        }
        // Saved again, the loaded cache gives the same file (same order, hashes, bytes).
        assert_eq!(save(&b).len(), file.len());
        // Loading twice loads nothing new.
        let again = b.load_prefix_cache(&file, &MODEL).unwrap();
        assert_eq!((again.loaded, again.already_cached), (0, records as u32));
    }
}

#[test]
fn a_damaged_record_costs_its_chain_below_and_nothing_else() {
    let mut r = rng(11);
    let (a, prompts) = source(DType::F16, &mut r);
    let file = save(&a);
    let rec = 40 + 16 + a.geometry().bytes_per_block() as usize;
    let records = (file.len() - PREFIX_HEADER_LEN) / rec;
    for k in 0..records {
        // A byte in the K/V, the token ids, the chain fields, the checksum.
        for off in [rec - 9, 40, 2, rec - 1] {
            let mut bad = file.clone();
            bad[PREFIX_HEADER_LEN + k * rec + off] ^= 0x20;
            let mut b = cache(DType::F16, 32);
            let report = b.load_prefix_cache(&bad, &MODEL).unwrap();
            assert_eq!(report.damaged, 1, "record {k} byte {off}");
            assert_eq!(
                report.loaded + report.damaged + report.orphaned,
                records as u32
            );
            assert_eq!(b.stats().cached_blocks, report.loaded);
            // Whatever loaded serves exactly the original K/V.
            for (ns, p) in &prompts {
                let mut a2 = source_rows(&a, *ns, p);
                let got = b.create_with_prompt(*ns, p).unwrap();
                a2.truncate(rows_len(&b, got.reused_tokens));
                assert_eq!(
                    rows(&b, got.seq, got.reused_tokens),
                    a2,
                    "record {k} byte {off}"
                );
                b.release(got.seq).unwrap();
            }
        }
    }
}

/// Bytes of `t` token rows in `cache`'s geometry.
fn rows_len(cache: &KvCache, t: u32) -> usize {
    let g = cache.geometry();
    t as usize
        * (2 * g.layers() * g.kv_heads() * g.head_dim()) as usize
        * g.dtype().size_bytes() as usize
}

/// The rows the source cache holds for the cached prefix of `p` in `ns`, found by
/// walking its registered chain (the source cache is only read).
fn source_rows(a: &KvCache, ns: u64, p: &[u32]) -> Vec<u8> {
    let m = a.block_manager();
    let bs = a.geometry().block_size() as usize;
    let mut blocks = Vec::new();
    let mut parent = None;
    for chunk in p.chunks_exact(bs).take((p.len() - 1) / bs) {
        let found = (0..m.config().num_blocks).find(|&b| {
            m.registered_block(b)
                .is_some_and(|r| r.namespace == ns && r.parent == parent && r.tokens == chunk)
        });
        let Some(b) = found else { break };
        blocks.push(b);
        parent = Some(b);
    }
    let g = *a.geometry();
    let esize = g.dtype().size_bytes() as usize;
    let dim = g.head_dim() as usize;
    let bytes = a.arena().as_bytes();
    let mut out = Vec::new();
    for p in 0..(blocks.len() * bs) as u32 {
        let (b, off) = (blocks[p as usize / bs], p % g.block_size());
        for layer in 0..g.layers() {
            for kv in 0..2 {
                for h in 0..g.kv_heads() {
                    let e = a.layout().tile_offset(b, layer, kv, h) + off as usize * dim;
                    out.extend_from_slice(&bytes[e * esize..(e + dim) * esize]);
                }
            }
        }
    }
    out
}

#[test]
fn truncation_and_trailing_bytes_are_counted() {
    let mut r = rng(3);
    let (a, _) = source(DType::F32, &mut r);
    let file = save(&a);
    let rec = 40 + 16 + a.geometry().bytes_per_block() as usize;
    let records = ((file.len() - PREFIX_HEADER_LEN) / rec) as u32;
    for cut in [
        PREFIX_HEADER_LEN,
        PREFIX_HEADER_LEN + 1,
        PREFIX_HEADER_LEN + rec + 7,
        file.len() - 1,
    ] {
        let mut b = cache(DType::F32, 32);
        let report = b.load_prefix_cache(&file[..cut], &MODEL).unwrap();
        let whole = ((cut - PREFIX_HEADER_LEN) / rec) as u32;
        assert_eq!(
            (report.missing, report.loaded),
            (records - whole, whole),
            "cut at {cut}"
        );
        assert_eq!(report.trailing_bytes, 0);
    }
    let mut longer = file.clone();
    longer.extend_from_slice(&[1, 2, 3]);
    let mut b = cache(DType::F32, 32);
    let report = b.load_prefix_cache(&longer, &MODEL).unwrap();
    assert_eq!((report.loaded, report.trailing_bytes), (records, 3));
}

#[test]
fn a_wrong_header_or_origin_is_refused_and_changes_nothing() {
    let mut r = rng(5);
    let (a, _) = source(DType::F16, &mut r);
    let file = save(&a);
    let mut b = cache(DType::F16, 32);
    serve(&mut b, 0, &[1, 2, 3, 4, 5, 6], false, &mut r);
    let before = snapshot(&b);
    let persist = |e: CacheError| match e {
        CacheError::Persist(p) => p,
        other => panic!("not a persist error: {other:?}"),
    };
    let mut magic = file.clone();
    magic[0] = b'X';
    assert_eq!(
        persist(b.load_prefix_cache(&magic, &MODEL).unwrap_err()),
        PersistError::BadMagic
    );
    let mut version = file.clone();
    version[8] = 9;
    assert!(matches!(
        persist(b.load_prefix_cache(&version, &MODEL).unwrap_err()),
        PersistError::UnsupportedVersion { found: 9 }
    ));
    for i in 12..PREFIX_HEADER_LEN {
        let mut h = file.clone();
        h[i] ^= 0x01;
        assert!(b.load_prefix_cache(&h, &MODEL).is_err(), "header byte {i}");
    }
    assert!(matches!(
        persist(b.load_prefix_cache(&file[..50], &MODEL).unwrap_err()),
        PersistError::Truncated { .. }
    ));
    assert_eq!(
        persist(
            b.load_prefix_cache(&file, &ModelFingerprint::from_u64(1))
                .unwrap_err()
        ),
        PersistError::ModelMismatch
    );
    assert_eq!(snapshot(&b), before);
    let mut f32_cache = cache(DType::F32, 32);
    assert!(matches!(
        persist(f32_cache.load_prefix_cache(&file, &MODEL).unwrap_err()),
        PersistError::DtypeMismatch { blob: 1, .. }
    ));
    let other = Geometry::new(2, 2, 16, 4, DType::F16).unwrap();
    let mut wide = KvCache::new(CacheConfig {
        geometry: other,
        capacity: Capacity::Blocks(8),
        max_seqs: 2,
        max_seq_len: 32,
        threads: 1,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .unwrap();
    assert!(matches!(
        persist(wide.load_prefix_cache(&file, &MODEL).unwrap_err()),
        PersistError::GeometryMismatch { .. }
    ));
}

#[test]
fn a_load_into_a_smaller_cache_stops_without_evicting() {
    let mut r = rng(9);
    let (a, prompts) = source(DType::Bf16, &mut r);
    let file = save(&a);
    let mut b = cache(DType::Bf16, 6);
    // Live traffic first: one cached block that the load must not evict.
    serve(&mut b, 0, &[9, 9, 9, 9, 9], false, &mut r);
    let report = b.load_prefix_cache(&file, &MODEL).unwrap();
    assert_eq!(report.loaded, 5);
    assert_eq!(report.loaded + report.no_room, report.records);
    assert_eq!(b.stats().free_blocks, 0);
    // Parents came first, level by level: both system prompts' first two blocks, and
    // one third block.
    let system = &prompts[0].1;
    let m = b.block_manager();
    let hits = [
        m.cached_prefix_tokens(0, system),
        m.cached_prefix_tokens(9, system),
    ];
    assert!(
        hits.iter().all(|&h| h >= 8) && hits[0] + hits[1] == 20,
        "{hits:?}"
    );
    // The live prompt's block is still there; taking a block for its next token
    // evicts the loaded chain's deepest block (loaded blocks are least recently used).
    let live = b.create_with_prompt(0, &[9, 9, 9, 9, 9]).unwrap();
    assert_eq!(live.reused_tokens, 4);
    let m = b.block_manager();
    assert_eq!(
        m.cached_prefix_tokens(0, system) + m.cached_prefix_tokens(9, system),
        16
    );
}

#[test]
#[cfg_attr(miri, ignore = "file system: Miri's isolation forbids it")]
fn a_file_round_trip_and_a_missing_file() {
    let mut r = rng(13);
    let (a, prompts) = source(DType::F16, &mut r);
    let dir = std::env::temp_dir().join(format!("kvpage-prefix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("prefix.kvpc");
    let saved = a.save_prefix_cache_to_file(&MODEL, &path).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), save(&a));
    assert_eq!(saved.bytes, std::fs::metadata(&path).unwrap().len());
    let mut b = cache(DType::F16, 32);
    let report = b.load_prefix_cache_from_file(&path, &MODEL).unwrap();
    assert_eq!(report.loaded, saved.blocks);
    assert_eq!(
        b.create_with_prompt(9, &prompts[3].1)
            .unwrap()
            .reused_tokens,
        12
    );
    std::fs::remove_dir_all(&dir).unwrap();
    match b.load_prefix_cache_from_file(&path, &MODEL) {
        Err(CacheError::Persist(PersistError::Io { kind, .. })) => {
            assert_eq!(kind, std::io::ErrorKind::NotFound)
        }
        other => panic!("{other:?}"),
    }
}

/// Writes the seed corpus of the `load_prefix` fuzz target (run by hand:
/// `cargo test -p kvpage --test prefix_file -- --ignored write_fuzz_seeds`): files of
/// the fuzzed cache's geometry, each with mode 0 and 1.
#[test]
#[ignore = "writes the fuzz seed corpus"]
fn write_fuzz_seeds() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/load_prefix");
    std::fs::create_dir_all(&dir).unwrap();
    let mut r = rng(21);
    let (a, _) = source(DType::F16, &mut r);
    let mut small = cache(DType::F16, 8);
    serve(&mut small, 3, &[7, 8, 9, 10, 11], false, &mut r);
    for (name, c) in [
        ("source", &a),
        ("small", &small),
        ("empty", &cache(DType::F16, 4)),
    ] {
        let file = save(c);
        for mode in [0u8, 1] {
            let mut seed = vec![mode];
            seed.extend_from_slice(&file);
            std::fs::write(dir.join(format!("{name}-mode{mode}")), seed).unwrap();
        }
    }
}
