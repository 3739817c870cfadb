//! Retention priorities and namespace quotas on the owned cache and the engine, and
//! through the C API's tier 1.

use core::ptr::null_mut;

use kvpage::ffi::kvpage_result::*;
use kvpage::ffi::*;
use kvpage::{
    CacheConfig, CacheError, Capacity, DType, Geometry, InitError, KvCache, NamespaceQuota,
    Priority, QuotaError, SeqError, CACHE_NAMESPACES, MAX_NAMESPACES,
};

fn config(blocks: u32, max_namespaces: u32) -> CacheConfig {
    CacheConfig {
        geometry: Geometry::new(1, 1, 8, 4, DType::F32).unwrap(),
        capacity: Capacity::Blocks(blocks),
        max_seqs: 4,
        max_seq_len: 64,
        threads: 1,
        event_capacity: 0,
        hash_key: None,
        max_namespaces,
    }
}

fn cache(blocks: u32) -> KvCache {
    KvCache::new(config(blocks, CACHE_NAMESPACES)).unwrap()
}

const QUOTA_2: NamespaceQuota = NamespaceQuota {
    max_blocks: 2,
    reserved_blocks: 0,
};

fn prompt(base: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| base * 100 + i).collect()
}

/// Creates, commits (K/V left as zeros: only the block bookkeeping matters here) and
/// releases a sequence holding `p` at `priority`.
fn cached(c: &mut KvCache, ns: u64, priority: Priority, p: &[u32]) -> Result<u32, CacheError> {
    let start = c.create_with_prompt_at(ns, priority, p)?;
    c.commit(start.seq)?;
    c.release(start.seq)?;
    Ok(start.reused_tokens)
}

#[test]
fn pinned_prompts_survive_eviction_until_unpinned() {
    let mut c = cache(8);
    cached(&mut c, 0, Priority::Pinned, &prompt(1, 9)).unwrap();
    cached(&mut c, 0, Priority::Low, &prompt(2, 9)).unwrap();
    assert_eq!(c.pinned_blocks(), 2);
    assert_eq!(c.evict_cached(100), 2);
    assert_eq!(
        cached(&mut c, 0, Priority::Normal, &prompt(1, 9)).unwrap(),
        8
    );
    // Lowering a sequence's priority unpins its blocks.
    let s = c.create_with_prompt(0, &prompt(1, 9)).unwrap().seq;
    assert_eq!(c.priority(s).unwrap(), Priority::Normal);
    c.set_priority(s, Priority::Low).unwrap();
    c.release(s).unwrap();
    assert_eq!(c.pinned_blocks(), 0);
    assert_eq!(c.evict_cached(100), 2);
    // unpin_cached releases pinned prompts nobody holds.
    cached(&mut c, 0, Priority::Pinned, &prompt(3, 9)).unwrap();
    assert_eq!(c.unpin_cached(), 2);
    assert_eq!(c.evict_cached(100), 2);
    // A range priority.
    let s = c.create_with_prompt(0, &prompt(4, 13)).unwrap().seq;
    c.commit(s).unwrap();
    c.set_range_priority(s, 4, 8, Priority::Pinned).unwrap();
    c.release(s).unwrap();
    assert_eq!(c.pinned_blocks(), 2);
    assert!(matches!(
        c.set_range_priority(s, 0, 1, Priority::Low),
        Err(CacheError::Seq(SeqError::StaleHandle))
    ));
}

#[test]
fn a_quota_bounds_one_namespace_and_the_table_is_bounded() {
    let mut c = cache(12);
    c.set_namespace_quota(
        1,
        NamespaceQuota {
            max_blocks: 3,
            reserved_blocks: 1,
        },
    )
    .unwrap();
    assert_eq!(
        c.namespace_quota(1),
        NamespaceQuota {
            max_blocks: 3,
            reserved_blocks: 1
        }
    );
    assert!(matches!(
        c.create_with_prompt(1, &prompt(1, 17)),
        Err(CacheError::Seq(SeqError::QuotaExceeded { needed: 5, .. }))
    ));
    assert_eq!(c.stats().used_blocks, 0);
    let s = c.create_with_prompt(1, &prompt(1, 9)).unwrap().seq;
    assert_eq!(c.namespace_blocks(1), 3);
    // Other namespaces are unbounded by it.
    let t = c.create_with_prompt(0, &prompt(2, 33)).unwrap().seq;
    c.release(s).unwrap();
    c.release(t).unwrap();
    assert_eq!(
        c.set_namespace_quota(
            1,
            NamespaceQuota {
                max_blocks: 1,
                reserved_blocks: 2
            }
        ),
        Err(QuotaError::ReserveAboveLimit)
    );
    for ns in 2..=u64::from(CACHE_NAMESPACES) {
        c.set_namespace_quota(ns, NamespaceQuota::UNLIMITED)
            .unwrap();
    }
    assert_eq!(
        c.set_namespace_quota(99, NamespaceQuota::UNLIMITED),
        Err(QuotaError::TableFull)
    );
}

#[test]
fn a_cache_has_as_many_quota_slots_as_configured() {
    for slots in [0, 1, 9, 12, MAX_NAMESPACES] {
        let mut c = KvCache::new(config(12, slots)).unwrap();
        // Namespaces 1..=slots each take a slot; the last one's quota is enforced.
        for ns in 1..=u64::from(slots) {
            c.set_namespace_quota(ns, QUOTA_2).unwrap();
            assert_eq!(c.namespace_quota(ns), QUOTA_2);
        }
        assert_eq!(
            c.set_namespace_quota(u64::from(slots) + 1, QUOTA_2),
            Err(QuotaError::TableFull),
            "{slots} slots"
        );
        assert_eq!(
            c.namespace_quota(u64::from(slots) + 1),
            NamespaceQuota::UNLIMITED
        );
        if slots > 0 {
            let last = u64::from(slots);
            assert!(matches!(
                c.create_with_prompt(last, &prompt(1, 9)),
                Err(CacheError::Seq(SeqError::QuotaExceeded { needed: 3, .. }))
            ));
            let s = c.create_with_prompt(last, &prompt(1, 8)).unwrap().seq;
            assert_eq!(c.namespace_blocks(last), 2);
            c.release(s).unwrap();
        }
        // A namespace without a quota is unbounded whatever the slot count.
        let s = c.create_with_prompt(1000, &prompt(2, 33)).unwrap().seq;
        c.release(s).unwrap();
    }
}

#[test]
fn a_namespace_count_over_the_core_limit_is_refused_at_creation() {
    for slots in [MAX_NAMESPACES + 1, 1 << 20, u32::MAX] {
        assert_eq!(
            KvCache::new(config(12, slots)).err(),
            Some(CacheError::Init(InitError::TooLarge)),
            "{slots} slots"
        );
        assert_eq!(
            kvpage::Engine::new(engine_config(slots)).err(),
            Some(CacheError::Init(InitError::TooLarge)),
            "{slots} slots"
        );
    }
}

/// The C API's default cache parameters with an arena of 8 blocks of 4 tokens.
fn c_params() -> kvpage_cache_params {
    let mut p = kvpage_cache_default_params(kvpage_geometry {
        layers: 1,
        kv_heads: 1,
        head_dim: 8,
        block_size: 4,
        dtype: 0,
    });
    p.capacity_bytes = 0;
    p.capacity_blocks = 8;
    p
}

#[test]
fn the_c_api_sets_priorities_and_quotas_on_an_owned_cache() {
    let p = c_params();
    let mut c = null_mut();
    let mut s = KVPAGE_SEQ_NONE;
    let mut n = 0u32;
    let t = prompt(1, 9);
    // SAFETY: valid pointers throughout; the cache is freed at the end.
    unsafe {
        assert_eq!(kvpage_cache_new(&p, &mut c, null_mut()), KVPAGE_OK);
        let at = |level, s: &mut kvpage_seq, n: &mut u32| {
            kvpage_cache_create_with_prompt_at(c, 0, level, t.as_ptr(), t.len(), s, n, null_mut())
        };
        assert_eq!(at(4, &mut s, &mut n), KVPAGE_ERR_INVALID_ARGUMENT);
        assert_eq!(s, KVPAGE_SEQ_NONE);
        assert_eq!(at(KVPAGE_PRIORITY_PINNED, &mut s, &mut n), KVPAGE_OK);
        assert_eq!(kvpage_cache_commit(c, s, null_mut(), null_mut()), KVPAGE_OK);
        assert_eq!(
            kvpage_cache_set_range_priority(c, s, 0, 99, 1, null_mut()),
            KVPAGE_ERR_BEYOND_LENGTH
        );
        assert_eq!(
            kvpage_cache_set_priority(c, s, 9, null_mut()),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
        assert_eq!(kvpage_cache_release(c, s, null_mut()), KVPAGE_OK);
        assert_eq!(
            kvpage_cache_set_priority(c, s, 1, null_mut()),
            KVPAGE_ERR_STALE_SEQ
        );
        assert_eq!(kvpage_cache_unpin_cached(c, &mut n, null_mut()), KVPAGE_OK);
        assert_eq!(n, 2);
        assert_eq!(
            kvpage_cache_set_namespace_quota(c, 3, 2, 0, null_mut()),
            KVPAGE_OK
        );
        let r = kvpage_cache_create_with_prompt_at(
            c,
            3,
            1,
            t.as_ptr(),
            t.len(),
            &mut s,
            null_mut(),
            null_mut(),
        );
        assert_eq!(r, KVPAGE_ERR_QUOTA_EXCEEDED);
        assert_eq!(
            kvpage_cache_set_namespace_quota(c, 3, 2, 3, null_mut()),
            KVPAGE_ERR_QUOTA_REFUSED
        );
        assert_eq!(
            kvpage_cache_namespace_blocks(c, 3, &mut n, null_mut()),
            KVPAGE_OK
        );
        assert_eq!(n, 0);
        assert_eq!(
            kvpage_cache_namespace_blocks(c, 3, null_mut(), null_mut()),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            kvpage_cache_unpin_cached(null_mut(), null_mut(), null_mut()),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(kvpage_cache_free(c, null_mut()), KVPAGE_OK);
    }
}

#[test]
fn the_c_cache_params_size_the_quota_table() {
    let mut p = c_params();
    assert_eq!(p.max_namespaces, KVPAGE_CACHE_NAMESPACES);
    // SAFETY: valid pointers throughout; every cache created is freed.
    unsafe {
        for slots in [0, KVPAGE_CACHE_NAMESPACES, 9, 12] {
            p.max_namespaces = slots;
            let mut c = null_mut();
            assert_eq!(kvpage_cache_new(&p, &mut c, null_mut()), KVPAGE_OK);
            for ns in 1..=u64::from(slots) {
                assert_eq!(
                    kvpage_cache_set_namespace_quota(c, ns, 2, 0, null_mut()),
                    KVPAGE_OK
                );
            }
            assert_eq!(
                kvpage_cache_set_namespace_quota(c, u64::from(slots) + 1, 2, 0, null_mut()),
                KVPAGE_ERR_QUOTA_REFUSED,
                "{slots} slots"
            );
            assert_eq!(kvpage_cache_free(c, null_mut()), KVPAGE_OK);
        }
        for slots in [257, u32::MAX] {
            p.max_namespaces = slots;
            let mut c = null_mut();
            assert_eq!(
                kvpage_cache_new(&p, &mut c, null_mut()),
                KVPAGE_ERR_BAD_CONFIG,
                "{slots} slots"
            );
            assert!(c.is_null());
        }
    }
}

#[test]
fn an_engine_cache_with_more_than_the_default_slots_keeps_the_last_within_its_quota() {
    let mut e = engine(10);
    for ns in 1..10 {
        e.set_namespace_quota(ns, NamespaceQuota::UNLIMITED)
            .unwrap();
    }
    e.set_namespace_quota(
        10,
        NamespaceQuota {
            max_blocks: 4,
            reserved_blocks: 0,
        },
    )
    .unwrap();
    assert_eq!(
        e.set_namespace_quota(11, NamespaceQuota::UNLIMITED),
        Err(QuotaError::TableFull)
    );
    let big = e.add_request(&prompt(1, 30), 10, Some(2)).unwrap();
    let small = e.add_request(&prompt(2, 10), 0, Some(2)).unwrap();
    let step = e.step().unwrap();
    assert!(step.seqs().all(|q| q.request != big));
    assert!(step.seqs().any(|q| q.request == small));
}

#[test]
fn an_engine_cache_without_slots_refuses_quotas_and_still_schedules() {
    let mut e = engine(0);
    assert_eq!(
        e.set_namespace_quota(1, NamespaceQuota::UNLIMITED),
        Err(QuotaError::TableFull)
    );
    let r = e.add_request(&prompt(1, 30), 1, Some(2)).unwrap();
    assert!(e.step().unwrap().seqs().any(|q| q.request == r));
}

fn engine(max_namespaces: u32) -> kvpage::Engine {
    kvpage::Engine::new(engine_config(max_namespaces)).unwrap()
}

fn engine_config(max_namespaces: u32) -> kvpage::EngineConfig {
    kvpage::EngineConfig {
        cache: config(16, max_namespaces),
        max_requests: 4,
        scheduler: kvpage::SchedulerConfig {
            token_budget: 64,
            max_running: 4,
            watermark_blocks: 0,
            preemption: kvpage::Preemption::Recompute,
        },
        host_capacity: Capacity::Blocks(0),
    }
}

#[test]
fn the_engine_keeps_a_namespace_within_its_quota() {
    let mut e = engine(CACHE_NAMESPACES);
    e.set_namespace_quota(
        1,
        NamespaceQuota {
            max_blocks: 4,
            reserved_blocks: 0,
        },
    )
    .unwrap();
    let big = e.add_request(&prompt(1, 30), 1, Some(2)).unwrap();
    let small = e.add_request(&prompt(2, 10), 0, Some(2)).unwrap();
    // The namespace-1 request does not fit its limit: it waits, the other one runs.
    let step = e.step().unwrap();
    assert!(step.seqs().all(|q| q.request != big));
    assert!(step.seqs().any(|q| q.request == small));
    assert_eq!(e.unpin_cached(), 0);
}
