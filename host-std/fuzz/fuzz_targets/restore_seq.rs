//! The sequence loader (`KvCache::restore_seq`) on arbitrary bytes: no panic; an error
//! is a persist or sequence error and leaves the cache as it was (statistics and every
//! arena byte); a success restores exactly what the blob holds, so saving the restored
//! sequence again gives the input bytes (the format is canonical), and `SeqBlob::parse`
//! agrees.
//!
//! Input: one mode byte, then the blob. Mode bit 0: recompute the header's and every
//! section's CRC first (following the blob's own framing, bounds checked), so mutations
//! reach the checks behind the checksums. Bits 1-2: the cache's geometry (0: the seeds'
//! f16, blocks of 4 tokens; 1: f32; 2: bf16; 3: f16, blocks of 3). Seeds
//! (corpus/restore_seq): valid blobs written by
//! `cargo test -p kvpage --test persist -- --ignored write_fuzz_seeds`.
#![no_main]

use kvpage::persist::format::HEADER_LEN;
use kvpage::{
    CacheConfig, CacheError, Capacity, DType, Geometry, KvCache, ModelFingerprint, SeqBlob,
};
use libfuzzer_sys::fuzz_target;

/// The fingerprint the seeds were saved with.
const MODEL: ModelFingerprint = ModelFingerprint::from_u64(0xf022);

fn cache(mode: u8) -> KvCache {
    let (dtype, block_size) = match (mode >> 1) & 3 {
        0 => (DType::F16, 4),
        1 => (DType::F32, 4),
        2 => (DType::Bf16, 4),
        _ => (DType::F16, 3),
    };
    let geometry = Geometry::new(2, 2, 8, block_size, dtype).expect("geometry");
    let mut cache = KvCache::new(CacheConfig {
        geometry,
        capacity: Capacity::Blocks(12),
        max_seqs: 3,
        max_seq_len: 32,
        threads: 1,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .expect("cache");
    // One sequence already there, its K/V written.
    let seq = cache.create(0).expect("create");
    cache.append_tokens(seq, &[1, 2, 3, 4, 5]).expect("append");
    let row: Vec<f32> = (0..5 * 2 * 8).map(|i| i as f32 * 0.25).collect();
    for layer in 0..2 {
        cache.write_kv(seq, layer, 0, &row, &row).expect("write");
    }
    cache
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Recomputes the header CRC and the CRC of each section the blob's framing describes,
/// as far as the bytes go.
fn reseal(blob: &mut [u8]) {
    if blob.len() < HEADER_LEN {
        return;
    }
    let crc = crc32fast::hash(&blob[..HEADER_LEN - 4]);
    blob[HEADER_LEN - 4..HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    let mut at = HEADER_LEN;
    for _ in 0..3 {
        let Some(len) = u64_at(blob, at + 8).and_then(|l| usize::try_from(l).ok()) else {
            return;
        };
        let Some(end) = at.checked_add(16).and_then(|x| x.checked_add(len)) else {
            return;
        };
        if end.checked_add(4).is_none_or(|e| e > blob.len()) {
            return;
        }
        let crc = crc32fast::hash(&blob[at..end]);
        blob[end..end + 4].copy_from_slice(&crc.to_le_bytes());
        at = end + 4;
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, blob)) = data.split_first() else {
        return;
    };
    let mut blob = blob.to_vec();
    if mode & 1 != 0 {
        reseal(&mut blob);
    }
    let mut cache = cache(mode);
    let stats = cache.stats();
    let arena = cache.arena().as_bytes().to_vec();
    match cache.restore_seq(&blob, 1, &MODEL) {
        Ok((seq, info)) => {
            let parsed = SeqBlob::parse(&blob).expect("restored, so it parses");
            assert_eq!(parsed.header().tokens, info.len);
            assert_eq!(cache.len(seq).expect("live"), info.len);
            let ids = info.tokens.map(|t| t.to_vec());
            assert_eq!(
                ids.as_ref().map(Vec::len),
                info.tokens.map(|_| info.len as usize)
            );
            let mut again = vec![0u8; cache.saved_seq_size(seq, ids.is_some()).expect("size")];
            let n = cache
                .save_seq(seq, ids.as_deref(), &MODEL, &mut again)
                .expect("save");
            assert_eq!(&again[..n], &blob[..], "restore then save is the identity");
            assert_eq!(u32_at(&blob, 36), Some(info.len));
        }
        Err(e) => {
            assert!(
                matches!(e, CacheError::Persist(_) | CacheError::Seq(_)),
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
