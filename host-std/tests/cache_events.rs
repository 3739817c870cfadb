//! KV cache events of the owned cache: a subscriber that folds drained events into its
//! own index of registered blocks always matches the cache's snapshot, also when the
//! ring overflows (it resynchronises from a snapshot), and a restart with a persisted
//! prefix cache under a fixed hash key stores the same hashes again.

mod common;

use std::collections::{BTreeMap, HashSet};

use common::rng;
use kvpage::{
    CacheConfig, CacheEvent, Capacity, DType, Engine, EngineConfig, EventBatch, EventError,
    Geometry, KvCache, ModelFingerprint, Preemption, Sampled, SchedulerConfig, Seq, StoredEvent,
};
use rand::rngs::StdRng;
use rand::RngExt;

const BS: u32 = 4;

fn config(blocks: u32, event_capacity: u32, hash_key: Option<u64>) -> CacheConfig {
    CacheConfig {
        geometry: Geometry::new(1, 1, 4, BS, DType::F32).unwrap(),
        capacity: Capacity::Blocks(blocks),
        max_seqs: 6,
        max_seq_len: 32,
        threads: 1,
        event_capacity,
        hash_key,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    }
}

/// What a router knows: the registered blocks by physical block id.
#[derive(Debug, Default)]
struct Subscriber {
    blocks: BTreeMap<u32, StoredEvent>,
    next_seq: u64,
}

impl Subscriber {
    /// Folds a batch in; `false` when it shows a gap (the subscriber must resync).
    fn apply(&mut self, batch: &EventBatch) -> bool {
        if batch.lost > 0 || batch.first_seq != self.next_seq {
            return false;
        }
        for e in &batch.events {
            match e {
                CacheEvent::Stored(s) => {
                    assert!(self.blocks.insert(s.block, s.clone()).is_none());
                }
                CacheEvent::Removed(r) => {
                    let old = self
                        .blocks
                        .remove(&r.block)
                        .expect("removes a stored block");
                    assert_eq!(old.hash, r.hash);
                }
                CacheEvent::Cleared => self.blocks.clear(),
            }
        }
        self.next_seq = batch.end_seq();
        true
    }

    /// Starts over from a snapshot taken when the cache's next event was `next_seq`.
    fn resync(&mut self, snapshot: Vec<StoredEvent>, next_seq: u64) {
        self.blocks = snapshot.into_iter().map(|s| (s.block, s)).collect();
        self.next_seq = next_seq;
    }
}

fn state(cache: &KvCache) -> BTreeMap<u32, StoredEvent> {
    cache
        .events_snapshot()
        .into_iter()
        .map(|s| (s.block, s))
        .collect()
}

/// One random operation: prompts over a 2-token alphabet (shared prefixes), appends,
/// releases, evictions, clears.
fn step(cache: &mut KvCache, live: &mut Vec<Seq>, r: &mut StdRng) {
    match r.random_range(0..10) {
        0..4 => {
            let len = r.random_range(1..24);
            let prompt: Vec<u32> = (0..len).map(|_| r.random_range(0..2)).collect();
            if let Ok(p) = cache.create_with_prompt(r.random_range(0..2), &prompt) {
                cache.commit(p.seq).unwrap();
                live.push(p.seq);
            }
        }
        4 | 5 if !live.is_empty() => {
            let i = r.random_range(0..live.len());
            let ids: Vec<u32> = (0..r.random_range(1..6))
                .map(|_| r.random_range(0..2))
                .collect();
            if cache.append_tokens(live[i], &ids).is_ok() {
                cache.commit(live[i]).unwrap();
            }
        }
        6 | 7 if !live.is_empty() => {
            let i = r.random_range(0..live.len());
            cache.release(live.swap_remove(i)).unwrap();
        }
        8 => {
            cache.evict_cached(r.random_range(1..4));
        }
        _ => {
            if r.random_range(0..4) == 0 {
                cache.clear_prefix_cache();
            }
        }
    }
}

#[test]
fn drained_events_rebuild_the_snapshot() {
    for seed in 0..20 {
        let mut r = rng(seed);
        let mut cache = KvCache::new(config(16, 4096, None)).unwrap();
        let mut live = Vec::new();
        let mut sub = Subscriber::default();
        for _ in 0..300 {
            step(&mut cache, &mut live, &mut r);
            if r.random_range(0..3) == 0 {
                let batch = cache.drain_events(r.random_range(1..8));
                assert!(sub.apply(&batch), "no gap with a large ring");
            }
        }
        let batch = cache.drain_events(usize::MAX);
        assert!(sub.apply(&batch));
        assert_eq!(sub.next_seq, cache.next_event_seq());
        assert_eq!(sub.blocks, state(&cache), "seed {seed}");
        // The snapshot lists a block lookups can reach after its parent.
        let m = cache.block_manager();
        let reachable = |mut b: u32| loop {
            match m.registered_block(b) {
                None => break false,
                Some(r) => match r.parent {
                    None => break true,
                    Some(p) => b = p,
                },
            }
        };
        let mut seen = HashSet::new();
        for s in cache.events_snapshot() {
            if let (Some(p), true) = (s.parent, reachable(s.block)) {
                assert!(
                    seen.contains(&p),
                    "block {} listed before its parent",
                    s.block
                );
            }
            seen.insert(s.block);
        }
    }
}

#[test]
fn an_overflowing_ring_is_noticed_and_a_snapshot_resyncs() {
    let mut r = rng(7);
    let mut cache = KvCache::new(config(16, 4, None)).unwrap();
    let mut live = Vec::new();
    let mut sub = Subscriber::default();
    let (mut gaps, mut lost) = (0, 0);
    for _ in 0..600 {
        step(&mut cache, &mut live, &mut r);
        if r.random_range(0..6) == 0 {
            let batch = cache.drain_events(usize::MAX);
            lost += batch.lost;
            if !sub.apply(&batch) {
                gaps += 1;
                let next = cache.next_event_seq();
                sub.resync(cache.events_snapshot(), next);
            }
            assert_eq!(sub.blocks, state(&cache));
        }
    }
    assert!(
        gaps > 0 && lost > 0,
        "the workload overflows a 4-entry ring"
    );
    // Replay requests do not move the drain: everything since an old sequence number
    // reports what it lost.
    let next = cache.next_event_seq();
    let since = cache.events_since(0).unwrap();
    assert_eq!(
        (since.lost, since.first_seq, since.end_seq()),
        (next - 4, next - 4, next)
    );
    assert_eq!(
        cache.events_since(next + 1),
        Err(EventError::FutureSeq {
            requested: next + 1,
            next
        })
    );
}

#[test]
fn events_off_drain_nothing() {
    let mut cache = KvCache::new(config(8, 0, None)).unwrap();
    let p = cache.create_with_prompt(0, &[1; 9]).unwrap();
    assert_eq!(cache.commit(p.seq).unwrap(), 2);
    let batch = cache.drain_events(usize::MAX);
    assert_eq!((batch.lost, batch.events.len()), (0, 0));
    // The snapshot still lists the reachable blocks.
    assert_eq!(cache.events_snapshot().len(), 2);
}

#[test]
fn a_restart_with_a_persisted_cache_stores_the_same_hashes() {
    let model = ModelFingerprint::from_u64(0x6576_656e_7473);
    let key = Some(0x5ec2_e7e5);
    let mut first = KvCache::new(config(16, 64, key)).unwrap();
    for prompt in [
        &[1u32, 2, 3, 4, 5, 6, 7, 8, 9][..],
        &[1, 2, 3, 4, 9, 9, 9, 9, 9],
    ] {
        let p = first.create_with_prompt(0, prompt).unwrap();
        first.commit(p.seq).unwrap();
        first.release(p.seq).unwrap();
    }
    let before: HashSet<u64> = first.events_snapshot().iter().map(|s| s.hash).collect();
    assert_eq!(before.len(), 3);
    let mut bytes = vec![0u8; first.saved_prefix_cache_size() as usize];
    first.save_prefix_cache(&model, &mut bytes).unwrap();

    let mut second = KvCache::new(config(16, 64, key)).unwrap();
    second.load_prefix_cache(&bytes, &model).unwrap();
    let batch = second.drain_events(usize::MAX);
    let stored: HashSet<u64> = batch
        .events
        .iter()
        .map(|e| match e {
            CacheEvent::Stored(s) => s.hash,
            other => panic!("a load only stores, got {other:?}"),
        })
        .collect();
    assert_eq!(stored, before);
    // Another key: other hashes for the same blocks.
    let mut third = KvCache::new(config(16, 64, Some(1))).unwrap();
    third.load_prefix_cache(&bytes, &model).unwrap();
    let other: HashSet<u64> = third.events_snapshot().iter().map(|s| s.hash).collect();
    assert!(other.is_disjoint(&before));
}

#[test]
fn an_engine_drains_its_cache_events() {
    let mut engine = Engine::new(EngineConfig {
        cache: config(16, 64, Some(3)),
        max_requests: 4,
        scheduler: SchedulerConfig {
            token_budget: 64,
            max_running: 4,
            watermark_blocks: 0,
            preemption: Preemption::Recompute,
        },
        host_capacity: Capacity::Blocks(0),
    })
    .unwrap();
    let id = engine.add_request(&[5; 10], 0, Some(4)).unwrap();
    for t in 0..3 {
        let step = engine.step().unwrap();
        let n = step.tokens() as usize * 4;
        engine.write_kv(0, &vec![0.5; n], &vec![0.5; n]).unwrap();
        let sample = Sampled {
            request: id,
            token: 7 + t,
            stop: false,
        };
        engine.commit_step(&[sample]).unwrap();
    }
    let batch = engine.drain_events(usize::MAX);
    assert_eq!(batch.first_seq, 0);
    let stored: Vec<u64> = batch
        .events
        .iter()
        .filter_map(|e| match e {
            CacheEvent::Stored(s) => Some(s.hash),
            _ => None,
        })
        .collect();
    // Ten prompt tokens and two computed samples: three full blocks.
    assert_eq!(stored.len(), 3);
    let snapshot: Vec<u64> = engine
        .cache()
        .events_snapshot()
        .iter()
        .map(|s| s.hash)
        .collect();
    assert_eq!(stored, snapshot);
}
