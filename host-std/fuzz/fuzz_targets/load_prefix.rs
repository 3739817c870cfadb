//! The prefix-cache loader (`KvCache::load_prefix_cache`) on arbitrary bytes: no panic;
//! an error is a persist error and leaves the cache as it was (statistics and every
//! arena byte); a success accounts for every record (the report's counts add up) and
//! never makes the cache hold a block that no sound record of the input holds: saving
//! the loaded cache gives only (namespace, token ids, K/V) triples of input records
//! whose checksum was right.
//!
//! Input: one mode byte, then the file. Mode bit 0: recompute the header's and every
//! record's CRC first (for the cache's record length), so mutations reach the checks
//! behind the checksums. Seeds (corpus/load_prefix): valid files written by
//! `cargo test -p kvpage --test prefix_file -- --ignored write_fuzz_seeds`.
#![no_main]

use std::collections::HashSet;

use kvpage::persist::PREFIX_HEADER_LEN;
use kvpage::{CacheConfig, CacheError, Capacity, DType, Geometry, KvCache, ModelFingerprint};
use libfuzzer_sys::fuzz_target;

/// The fingerprint the seeds were saved with.
const MODEL: ModelFingerprint = ModelFingerprint::from_u64(0x7072_6566_6978);
const BLOCK_SIZE: usize = 4;

fn cache() -> KvCache {
    let geometry = Geometry::new(2, 2, 8, BLOCK_SIZE as u32, DType::F16).expect("geometry");
    let mut cache = KvCache::new(CacheConfig {
        geometry,
        capacity: Capacity::Blocks(10),
        max_seqs: 3,
        max_seq_len: 32,
        threads: 1,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .expect("cache");
    // One prompt cached already, so loads also meet blocks that are there.
    let p = cache
        .create_with_prompt(0, &[100, 101, 102, 103, 104])
        .expect("prompt");
    let row: Vec<f32> = (0..5 * 2 * 8).map(|i| i as f32 * 0.25).collect();
    for layer in 0..2 {
        cache.write_kv(p.seq, layer, 0, &row, &row).expect("write");
    }
    cache.commit(p.seq).expect("commit");
    cache.release(p.seq).expect("release");
    cache
}

/// Bytes of one record of the fuzzed cache.
fn record_len(cache: &KvCache) -> usize {
    40 + 4 * BLOCK_SIZE + cache.geometry().bytes_per_block() as usize
}

/// Recomputes the header's CRC and each whole record's.
fn reseal(file: &mut [u8], rec: usize) {
    if file.len() < PREFIX_HEADER_LEN {
        return;
    }
    let crc = crc32fast::hash(&file[..PREFIX_HEADER_LEN - 4]);
    file[PREFIX_HEADER_LEN - 4..PREFIX_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    for r in file[PREFIX_HEADER_LEN..].chunks_exact_mut(rec) {
        let crc = crc32fast::hash(&r[..rec - 4]);
        r[rec - 4..].copy_from_slice(&crc.to_le_bytes());
    }
}

/// (namespace, token ids, K/V) of each record whose CRC is right.
fn sound_records(file: &[u8], rec: usize) -> HashSet<Vec<u8>> {
    file.get(PREFIX_HEADER_LEN..)
        .unwrap_or(&[])
        .chunks_exact(rec)
        .filter(|r| crc32fast::hash(&r[..rec - 4]).to_le_bytes() == r[rec - 4..])
        .map(|r| [&r[8..16], &r[36..rec - 4]].concat())
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, file)) = data.split_first() else {
        return;
    };
    let mut cache = cache();
    let rec = record_len(&cache);
    let mut file = file.to_vec();
    if mode & 1 != 0 {
        reseal(&mut file, rec);
    }
    let stats = cache.stats();
    let arena = cache.arena().as_bytes().to_vec();
    let mut before = vec![0u8; cache.saved_prefix_cache_size() as usize];
    cache
        .save_prefix_cache(&MODEL, &mut before)
        .expect("save before");
    match cache.load_prefix_cache(&file, &MODEL) {
        Ok(r) => {
            let accounted =
                r.loaded + r.already_cached + r.damaged + r.missing + r.orphaned + r.no_room;
            assert_eq!(accounted, r.records, "{r:?}");
            assert_eq!(cache.stats().cached_blocks, stats.cached_blocks + r.loaded);
            let mut after = vec![0u8; cache.saved_prefix_cache_size() as usize];
            cache
                .save_prefix_cache(&MODEL, &mut after)
                .expect("save after");
            let allowed: HashSet<Vec<u8>> = sound_records(&file, rec)
                .union(&sound_records(&before, rec))
                .cloned()
                .collect();
            for held in sound_records(&after, rec) {
                assert!(allowed.contains(&held), "a block no sound record holds");
            }
        }
        Err(e) => {
            assert!(
                matches!(e, CacheError::Persist(_)),
                "unexpected error {e:?}"
            );
            assert_eq!(cache.stats(), stats, "{e:?} changed the statistics");
            assert!(
                cache.arena().as_bytes() == &arena[..],
                "{e:?} changed the arena"
            );
        }
    }
});
