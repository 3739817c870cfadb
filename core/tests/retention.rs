//! Retention priorities and namespace quotas, scenario by scenario.

use kvpage_core::{BlockManager, Config, NamespaceQuota, Priority, QuotaError, SeqError};

const CONFIG: Config = Config {
    num_blocks: 8,
    block_size: 4,
    max_seqs: 4,
    max_blocks_per_seq: 8,
    instance: 1,
    hash_key: 0,
    prefix_cache: true,
    max_position_runs: 4,
    max_namespaces: 2,
    event_capacity: 0,
};

/// A prompt of `blocks` full blocks plus one token, distinct per `base`.
fn prompt(base: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 4 + 1).map(|i| base * 1000 + i).collect()
}

/// Runs a prompt through: create, commit, release; its full blocks stay cached.
fn cache(kv: &mut BlockManager<'_>, ns: u64, p: Priority, tokens: &[u32]) -> Result<u32, SeqError> {
    let mut slots = [0u32; 64];
    let start = kv.create_with_prompt_at(ns, p, tokens, &mut slots)?;
    kv.commit(start.seq, tokens.len() as u32)?;
    kv.release(start.seq)?;
    Ok(start.reused_tokens)
}

#[test]
fn lower_priority_goes_first_and_pinned_never() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    let system = prompt(1, 2);
    cache(&mut kv, 0, Priority::Pinned, &system).unwrap();
    cache(&mut kv, 0, Priority::Low, &prompt(2, 2)).unwrap();
    cache(&mut kv, 0, Priority::Normal, &prompt(3, 2)).unwrap();
    assert_eq!((kv.stats().cached_blocks, kv.pinned_blocks()), (6, 2));
    assert_eq!(kv.available_blocks(), 8 - 2);
    // Evicting everything leaves the pinned prompt: the low one went first.
    assert_eq!(kv.evict_cached(2), 2);
    assert_eq!(kv.cached_prefix_tokens(0, &prompt(2, 2)), 0);
    assert_eq!(kv.cached_prefix_tokens(0, &prompt(3, 2)), 8);
    assert_eq!(kv.evict_cached(100), 2);
    assert_eq!(kv.cached_prefix_tokens(0, &system), 8);
    // A prompt needing the whole pool cannot take the pinned blocks.
    let mut slots = [0u32; 64];
    let big = prompt(4, 6);
    assert_eq!(
        kv.create_with_prompt(0, &big[..25], &mut slots)
            .unwrap_err(),
        SeqError::OutOfBlocks {
            needed: 7,
            available: 6
        }
    );
    // Unpinned, they go.
    assert_eq!(kv.unpin_cached(), 2);
    assert!(kv.create_with_prompt(0, &big[..25], &mut slots).is_ok());
    // Seven of eight blocks: the unpinned prompt lost its tail block, not its head.
    assert_eq!(kv.cached_prefix_tokens(0, &system), 4);
}

#[test]
fn a_range_priority_keeps_the_chain_order() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    let mut slots = [0u32; 64];
    let p = prompt(1, 3);
    let s = kv.create_with_prompt(0, &p, &mut slots).unwrap().seq;
    kv.commit(s, p.len() as u32).unwrap();
    // Pin the middle block: the first is raised with it, the last stays below.
    kv.set_range_priority(s, 4, 8, Priority::Pinned).unwrap();
    let prios: Vec<_> = kv
        .blocks(s)
        .unwrap()
        .iter()
        .map(|&b| kv.block_priority(b).unwrap())
        .collect();
    assert_eq!(
        prios,
        [
            Priority::Pinned,
            Priority::Pinned,
            Priority::Normal,
            Priority::Normal
        ]
    );
    assert_eq!(
        kv.set_range_priority(s, 2, 99, Priority::Low),
        Err(SeqError::BadRange {
            first: 2,
            end: 99,
            len: 13
        })
    );
    kv.release(s).unwrap();
    assert_eq!(kv.evict_cached(100), 1);
    assert_eq!(
        kv.cached_prefix_tokens(0, &p),
        8,
        "the pinned head is still served"
    );
}

#[test]
fn a_tenant_at_its_quota_evicts_its_own_blocks_only() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    kv.set_namespace_quota(
        7,
        NamespaceQuota {
            max_blocks: 3,
            reserved_blocks: 0,
        },
    )
    .unwrap();
    // Tenant 1 caches a prompt; tenant 7 churns through many prompts at its limit.
    cache(&mut kv, 1, Priority::Normal, &prompt(1, 2)).unwrap();
    for base in 10..20 {
        cache(&mut kv, 7, Priority::Normal, &prompt(base, 2)).unwrap();
        assert!(kv.namespace_blocks(7) <= 3);
    }
    assert_eq!(
        kv.cached_prefix_tokens(1, &prompt(1, 2)),
        8,
        "tenant 1's cache survived"
    );
    // A prompt above the quota is refused with a typed error, changing nothing.
    let before = kv.stats();
    let mut slots = [0u32; 64];
    assert_eq!(
        kv.create_with_prompt(7, &prompt(30, 4), &mut slots)
            .unwrap_err(),
        SeqError::QuotaExceeded {
            needed: 5,
            allowed: 3
        }
    );
    assert_eq!(kv.stats(), before);
    assert_eq!(kv.available_blocks_for(7), 3);
}

#[test]
fn reservations_are_kept_from_other_tenants() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    kv.set_namespace_quota(
        5,
        NamespaceQuota {
            max_blocks: 8,
            reserved_blocks: 3,
        },
    )
    .unwrap();
    assert_eq!(kv.available_blocks_for(1), 5);
    let mut slots = [0u32; 64];
    let big = prompt(2, 6);
    assert_eq!(
        kv.create_with_prompt(1, &big[..21], &mut slots)
            .unwrap_err(),
        SeqError::OutOfBlocks {
            needed: 6,
            available: 5
        }
    );
    let other = kv
        .create_with_prompt(1, &big[..20], &mut slots)
        .unwrap()
        .seq;
    assert_eq!(kv.available_blocks_for(1), 0);
    // Tenant 5 still gets its three blocks.
    assert_eq!(kv.available_blocks_for(5), 3);
    cache(&mut kv, 5, Priority::Normal, &prompt(5, 2)).unwrap();
    kv.release(other).unwrap();
    // Its cached blocks (within the reservation) are not evicted for tenant 1.
    assert_eq!(kv.available_blocks_for(1), 8 - 3);
    kv.create_with_prompt(1, &big[..20], &mut slots).unwrap();
    assert_eq!(kv.cached_prefix_tokens(5, &prompt(5, 2)), 8);
}

#[test]
fn quota_settings_are_checked() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    let q = |max, reserved| NamespaceQuota {
        max_blocks: max,
        reserved_blocks: reserved,
    };
    assert_eq!(
        kv.set_namespace_quota(1, q(2, 3)),
        Err(QuotaError::ReserveAboveLimit)
    );
    assert_eq!(
        kv.set_namespace_quota(1, q(9, 9)),
        Err(QuotaError::ReserveUnavailable { needed: 9, free: 8 })
    );
    kv.set_namespace_quota(1, q(4, 2)).unwrap();
    kv.set_namespace_quota(2, q(4, 2)).unwrap();
    assert_eq!(
        kv.set_namespace_quota(3, q(4, 0)),
        Err(QuotaError::TableFull)
    );
    assert_eq!(kv.namespace_quota(3), NamespaceQuota::UNLIMITED);
    // Lowering a limit evicts the tenant's own cached blocks; used ones block it.
    let mut slots = [0u32; 64];
    let s = kv
        .create_with_prompt(1, &prompt(1, 3)[..12], &mut slots)
        .unwrap()
        .seq;
    kv.commit(s, 12).unwrap();
    assert_eq!(
        kv.set_namespace_quota(1, q(2, 0)),
        Err(QuotaError::HeldAboveLimit { held: 3, limit: 2 })
    );
    kv.release(s).unwrap();
    kv.set_namespace_quota(1, q(1, 0)).unwrap();
    assert_eq!(kv.namespace_blocks(1), 1);
    assert_eq!(kv.stats().cached_blocks, 1);
}

mod engine {
    use super::*;
    use kvpage_core::{Engine, EngineConfig, Preemption, RequestId, Sampled, SchedulerConfig};

    const KV: Config = Config {
        num_blocks: 12,
        max_seqs: 4,
        ..CONFIG
    };
    const ENGINE: EngineConfig = EngineConfig {
        max_requests: 8,
        scheduler: SchedulerConfig {
            token_budget: 64,
            max_running: 4,
            watermark_blocks: 0,
            preemption: Preemption::Recompute,
        },
        host_blocks: 0,
    };

    /// Steps until every request finished, sampling a stop token at once.
    fn drain(engine: &mut Engine<'_>, kv: &mut BlockManager<'_>) -> Vec<RequestId> {
        let mut done = Vec::new();
        for _ in 0..50 {
            if engine.in_flight() == 0 {
                break;
            }
            let step = engine.step(kv, None).unwrap();
            let samples: Vec<Sampled> = step
                .seqs()
                .filter(|s| s.emits)
                .map(|s| Sampled {
                    request: s.request,
                    token: 1,
                    stop: true,
                })
                .collect();
            done.extend(
                engine
                    .commit_step(kv, &samples)
                    .unwrap()
                    .iter()
                    .map(|f| f.request),
            );
        }
        done
    }

    #[test]
    fn a_pinned_system_prompt_survives_other_traffic() {
        let mut kv_words = vec![0u64; KV.storage_words()];
        let mut kv = BlockManager::new(KV, &mut kv_words).unwrap();
        let mut words = vec![0u64; ENGINE.storage_words(&KV)];
        let mut engine = Engine::new(ENGINE, &KV, &mut words).unwrap();
        let system = prompt(1, 3);
        engine
            .add_request_at(&system, 0, Some(1), Priority::Pinned)
            .unwrap();
        drain(&mut engine, &mut kv);
        // Traffic of one-off prompts filling the pool many times over.
        for base in 10..30 {
            engine.add_request(&prompt(base, 4), 0, Some(1)).unwrap();
            drain(&mut engine, &mut kv);
        }
        assert_eq!(kv.cached_prefix_tokens(0, &system), 12);
        assert_eq!(kv.pinned_blocks(), 3);
    }

    #[test]
    fn a_tenant_at_its_quota_waits_while_another_runs() {
        let mut kv_words = vec![0u64; KV.storage_words()];
        let mut kv = BlockManager::new(KV, &mut kv_words).unwrap();
        kv.set_namespace_quota(
            1,
            NamespaceQuota {
                max_blocks: 4,
                reserved_blocks: 0,
            },
        )
        .unwrap();
        let mut words = vec![0u64; ENGINE.storage_words(&KV)];
        let mut engine = Engine::new(ENGINE, &KV, &mut words).unwrap();
        // Two tenant-1 requests of 3 blocks each: only one fits its quota at a time.
        let a = engine.add_request(&prompt(1, 3)[..12], 1, Some(2)).unwrap();
        let b = engine.add_request(&prompt(2, 3)[..12], 1, Some(2)).unwrap();
        let c = engine.add_request(&prompt(3, 3)[..12], 0, Some(2)).unwrap();
        let step = engine.step(&mut kv, None).unwrap();
        let scheduled: Vec<RequestId> = step.seqs().map(|s| s.request).collect();
        assert_eq!(
            scheduled,
            [a, c],
            "b waits for its namespace, c overtakes it"
        );
        let samples: Vec<Sampled> = step
            .seqs()
            .map(|s| Sampled {
                request: s.request,
                token: 1,
                stop: false,
            })
            .collect();
        engine.commit_step(&mut kv, &samples).unwrap();
        assert!(kv.namespace_blocks(1) <= 4);
        let done = drain(&mut engine, &mut kv);
        assert_eq!(done.len(), 3, "every request finishes");
        assert!(done.contains(&b));
        // A prompt longer than the namespace's limit is reported once nothing runs.
        let long = engine.add_request(&prompt(4, 5)[..20], 1, Some(1)).unwrap();
        assert_eq!(
            engine.step(&mut kv, None).unwrap_err(),
            kvpage_core::EngineError::Unschedulable {
                request: Some(long),
                needed_blocks: 5,
                total_blocks: 4
            }
        );
        engine.cancel(&mut kv, None, long).unwrap();
    }
}
