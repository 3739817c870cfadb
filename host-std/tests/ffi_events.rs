//! The C API's KV cache events (`kvpage_cache_events_drain`): drained through small
//! caller buffers they equal the Rust API's events of the same workload, a ring that
//! overflows reports what it lost, and bad input returns its code and changes nothing.

use core::ptr::null_mut;

use kvpage::ffi::kvpage_result::*;
use kvpage::ffi::*;
use kvpage::{CacheConfig, CacheEvent, Capacity, DType, Geometry, KvCache};

const BLOCK: u32 = 4;
const KEY: u64 = 0x00c0_ffee;

fn params(event_capacity: u32) -> kvpage_cache_params {
    let mut p = kvpage_cache_default_params(kvpage_geometry {
        layers: 1,
        kv_heads: 1,
        head_dim: 4,
        block_size: BLOCK,
        dtype: KVPAGE_DTYPE_F32,
    });
    p.capacity_bytes = 0;
    p.capacity_blocks = 8;
    p.max_seqs = 4;
    p.max_seq_len = 32;
    p.threads = 1;
    p.event_capacity = event_capacity;
    p.hash_key = KEY;
    p
}

fn rust_cache(event_capacity: u32) -> KvCache {
    KvCache::new(CacheConfig {
        geometry: Geometry::new(1, 1, 4, BLOCK, DType::F32).unwrap(),
        capacity: Capacity::Blocks(8),
        max_seqs: 4,
        max_seq_len: 32,
        threads: 1,
        event_capacity,
        hash_key: Some(KEY),
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .unwrap()
}

#[track_caller]
fn ok(code: kvpage_result) {
    assert_eq!(code, KVPAGE_OK);
}

const PROMPTS: [&[u32]; 4] = [
    &[1, 2, 3, 4, 5, 6, 7, 8, 9],
    &[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 0],
    &[9, 9, 9, 9, 9],
    &[7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
];

/// Serves every prompt (commit, release) through the C API, evicting 2 blocks after
/// each.
fn c_workload(c: *mut kvpage_cache) {
    for (ns, p) in PROMPTS.iter().enumerate() {
        let mut seq = 0;
        // SAFETY: a live cache and valid buffers.
        unsafe {
            ok(kvpage_cache_create_with_prompt(
                c,
                ns as u64 % 2,
                p.as_ptr(),
                p.len(),
                &mut seq,
                null_mut(),
                null_mut(),
            ));
            ok(kvpage_cache_commit(c, seq, null_mut(), null_mut()));
            ok(kvpage_cache_release(c, seq, null_mut()));
            ok(kvpage_cache_evict_cached(c, 2, null_mut(), null_mut()));
        }
    }
}

fn rust_workload(cache: &mut KvCache) {
    for (ns, p) in PROMPTS.iter().enumerate() {
        let s = cache.create_with_prompt(ns as u64 % 2, p).unwrap();
        cache.commit(s.seq).unwrap();
        cache.release(s.seq).unwrap();
        cache.evict_cached(2);
    }
}

/// The C events in the Rust API's form.
fn to_rust(e: &kvpage_kv_event, tokens: &[u32]) -> CacheEvent {
    match e.kind {
        KVPAGE_EVENT_STORED => CacheEvent::Stored(kvpage::StoredEvent {
            block: e.block,
            hash: e.hash,
            parent_hash: e.parent_hash,
            parent: (e.parent != KVPAGE_EVENT_NO_BLOCK).then_some(e.parent),
            namespace: e.namespace_id,
            tokens: tokens[e.tokens_offset as usize..][..e.token_count as usize].to_vec(),
        }),
        KVPAGE_EVENT_REMOVED => CacheEvent::Removed(kvpage::RemovedBlock {
            block: e.block,
            hash: e.hash,
            namespace: e.namespace_id,
        }),
        KVPAGE_EVENT_CLEARED => CacheEvent::Cleared,
        k => panic!("unknown kind {k}"),
    }
}

/// Drains `c` through buffers of 3 events and 6 token ids until nothing is pending.
fn drain_all(c: *mut kvpage_cache) -> (Vec<CacheEvent>, u64, u64) {
    let mut out = Vec::new();
    let (mut first, mut lost) = (None, 0);
    loop {
        let mut events = [kvpage_kv_event::default(); 3];
        let mut tokens = [0u32; 6];
        let mut report = kvpage_events_report::default();
        // SAFETY: a live cache and valid buffers.
        ok(unsafe {
            kvpage_cache_events_drain(
                c,
                events.as_mut_ptr(),
                3,
                tokens.as_mut_ptr(),
                6,
                &mut report,
                null_mut(),
            )
        });
        first.get_or_insert(report.first_seq);
        lost += report.lost;
        for (i, e) in events[..report.events].iter().enumerate() {
            assert_eq!(e.seq, report.first_seq + i as u64);
            out.push(to_rust(e, &tokens[..report.tokens]));
        }
        if report.pending == 0 {
            return (out, first.unwrap(), lost);
        }
        assert!(
            report.events > 0,
            "a drain with pending events makes progress"
        );
    }
}

#[test]
fn c_events_equal_the_rust_events() {
    let mut c = null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { kvpage_cache_new(&params(256), &mut c, null_mut()) });
    c_workload(c);
    let (events, first, lost) = drain_all(c);
    let mut rust = rust_cache(256);
    rust_workload(&mut rust);
    let expect = rust.drain_events(usize::MAX);
    assert_eq!((first, lost), (0, 0));
    assert!(events.iter().any(|e| matches!(e, CacheEvent::Removed(_))));
    assert_eq!(events, expect.events);
    // SAFETY: a live cache, freed once.
    ok(unsafe { kvpage_cache_free(c, null_mut()) });
}

#[test]
fn an_overflowing_ring_reports_what_it_lost() {
    let mut c = null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { kvpage_cache_new(&params(3), &mut c, null_mut()) });
    c_workload(c);
    let (events, first, lost) = drain_all(c);
    let mut rust = rust_cache(256);
    rust_workload(&mut rust);
    let all = rust.drain_events(usize::MAX).events;
    assert_eq!(events.len(), 3);
    assert_eq!(first, all.len() as u64 - 3);
    assert_eq!(lost, first);
    assert_eq!(events, all[all.len() - 3..]);
    // SAFETY: a live cache, freed once.
    ok(unsafe { kvpage_cache_free(c, null_mut()) });
}

#[test]
fn bad_input_changes_nothing() {
    let mut c = null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { kvpage_cache_new(&params(64), &mut c, null_mut()) });
    c_workload(c);
    let mut events = [kvpage_kv_event::default(); 4];
    let mut tokens = [0u32; 8];
    let mut report = kvpage_events_report::default();
    // SAFETY: all-zero is a valid kvpage_error.
    let mut e: kvpage_error = unsafe { core::mem::MaybeUninit::zeroed().assume_init() };
    // SAFETY: each call passes one bad pointer or size and otherwise valid buffers.
    unsafe {
        let d = kvpage_cache_events_drain;
        assert_eq!(
            d(
                null_mut(),
                events.as_mut_ptr(),
                4,
                tokens.as_mut_ptr(),
                8,
                &mut report,
                &mut e
            ),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            d(
                c,
                null_mut(),
                4,
                tokens.as_mut_ptr(),
                8,
                &mut report,
                &mut e
            ),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            d(
                c,
                events.as_mut_ptr(),
                4,
                null_mut(),
                8,
                &mut report,
                &mut e
            ),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            d(
                c,
                events.as_mut_ptr(),
                4,
                tokens.as_mut_ptr(),
                8,
                null_mut(),
                &mut e
            ),
            KVPAGE_ERR_NULL_POINTER
        );
        // The first event is a stored block: 3 token slots cannot take it.
        assert_eq!(
            d(
                c,
                events.as_mut_ptr(),
                4,
                tokens.as_mut_ptr(),
                3,
                &mut report,
                &mut e
            ),
            KVPAGE_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!((e.needed, e.available), (u64::from(BLOCK), 3));
        assert_eq!(
            report,
            kvpage_events_report::default(),
            "untouched on error"
        );
    }
    // Nothing was consumed: a full drain starts at sequence 0.
    let (events, first, lost) = drain_all(c);
    assert_eq!((first, lost), (0, 0));
    assert!(!events.is_empty());
    // SAFETY: a live cache, freed once.
    ok(unsafe { kvpage_cache_free(c, null_mut()) });
}
