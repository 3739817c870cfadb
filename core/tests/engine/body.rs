// Shared body of the engine property tests; the including file defines `BLOCK_SIZE`.
use kvpage_core::{
    BlockManager, Config, Engine, EngineConfig, EngineError, HostPool, NamespaceQuota, Preemption, Priority,
    RequestId,
    Sampled, SchedulerConfig,
};
use proptest::prelude::*;
use std::collections::HashMap;

/// One random workload: sizes, then operations.
#[derive(Debug, Clone)]
struct Workload {
    num_blocks: u32,
    max_blocks_per_seq: u32,
    max_seqs: u32,
    max_requests: u32,
    token_budget: u32,
    max_running: u32,
    watermark: u32,
    host_blocks: u32,
    swap: bool,
    /// Blocks reserved for namespace 1 (what others may take shrinks while it holds
    /// fewer), and how far below the pool its limit is (a lone request of the longest
    /// length, plus a copy-on-write block, always fits it so the drain finishes).
    reserve: u32,
    limit_cut: u32,
    ops: Vec<Op>,
}

#[derive(Debug, Clone)]
enum Op {
    /// A request: shared prefix `group` (of 3, per namespace `ns`) of `shared` tokens,
    /// then `unique` tokens of its own; `max_new` 0 means "until stop".
    Add {
        ns: u8,
        group: u8,
        shared: u8,
        unique: u8,
        max_new: u8,
        /// Retention priority level (0..=3, 3 pins), else the plain `add_request`.
        level: u8,
    },
    /// A step; bit `k` of `stops` stops the k-th emitting sequence.
    Step { stops: u32 },
    Fork { pick: u8, replace: bool },
    Cancel { pick: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..2, 0u8..3, 0u8..40, 0u8..12, 0u8..40, 0u8..6).prop_map(|(ns, group, shared, unique, max_new, level)| {
            Op::Add { ns, group, shared, unique, max_new, level }
        }),
        8 => any::<u32>().prop_map(|stops| Op::Step { stops: stops & stops.rotate_left(7) & stops.rotate_left(13) }),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(pick, replace)| Op::Fork { pick, replace }),
        1 => any::<u8>().prop_map(|pick| Op::Cancel { pick }),
    ]
}

fn workload() -> impl Strategy<Value = Workload> {
    (6u32..24, 0u32..3, any::<bool>(), 0u32..40, 1u32..9, 2u32..12)
        .prop_flat_map(|(num_blocks, watermark, swap, host_blocks, max_seqs, max_requests)| {
            // A lone request of the longest length always fits: no request is stuck.
            let max_bps = (num_blocks - 1 - watermark).min(64 / BLOCK_SIZE + 2);
            (
                Just((num_blocks, watermark, swap, host_blocks, max_seqs, max_requests)),
                2u32..=max_bps.max(2),
                1u32..48,
                1u32..9,
                prop::collection::vec(op(), 1..common::max_ops(200)),
                0u32..4,
                0u32..8,
            )
        })
        .prop_map(
            |((num_blocks, watermark, swap, host_blocks, max_seqs, max_requests), bps, budget, running, ops, reserve, limit_cut)| {
                Workload {
                    num_blocks,
                    max_blocks_per_seq: bps,
                    max_seqs,
                    max_requests,
                    token_budget: budget,
                    max_running: running,
                    watermark,
                    host_blocks,
                    swap,
                    reserve,
                    limit_cut,
                    ops,
                }
            },
        )
}

/// What a position of a sequence holds after the model wrote it: a value that depends
/// on the namespace and every token up to and including that position (as K/V does).
fn content(ns: u64, tokens: &[u32], pos: usize) -> u64 {
    let mut h = ns.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x1234_5678;
    for &t in &tokens[..=pos] {
        h = (h ^ u64::from(t)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The request's token ids: shared group prefix, then its own.
fn prompt(id: u32, ns: u8, group: u8, shared: u8, unique: u8) -> Vec<u32> {
    let shared = (0..u32::from(shared)).map(|p| 1000 * u32::from(group + 1) + p);
    let own = (0..u32::from(unique)).map(|p| 1_000_000 + id * 100 + p);
    let mut v: Vec<u32> = shared.chain(own).collect();
    if v.is_empty() {
        v.push(7 + u32::from(ns));
    }
    v
}

struct Shadow {
    dev: Vec<Option<u64>>,
    host: Vec<Option<u64>>,
}

impl Shadow {
    fn copy_block(from: &[Option<u64>], to: &mut [Option<u64>], src: u32, dst: u32, bs: usize) {
        let (s, d) = (src as usize * bs, dst as usize * bs);
        to[d..d + bs].copy_from_slice(&from[s..s + bs]);
    }
}

fn run(w: Workload) -> Result<(), TestCaseError> {
    let bs = BLOCK_SIZE;
    let kv_config = Config {
        num_blocks: w.num_blocks,
        block_size: bs,
        max_seqs: w.max_seqs,
        max_blocks_per_seq: w.max_blocks_per_seq,
        instance: 9,
        hash_key: 0,
        prefix_cache: true,
        max_position_runs: 4,
        max_namespaces: 1,
        event_capacity: 0,
    };
    let max_tokens = kv_config.max_tokens_per_seq() as usize;
    let mut kv_words = vec![0u64; kv_config.storage_words()];
    let mut kv = BlockManager::new(kv_config, &mut kv_words).unwrap();
    // A lone request of the longest length must still fit next to the reservation.
    let reserve = w.reserve.min(w.num_blocks - 1 - w.watermark - w.max_blocks_per_seq.min(w.num_blocks - 1 - w.watermark));
    let limit = w.num_blocks.saturating_sub(w.limit_cut).max(w.max_blocks_per_seq + 1 + w.watermark).min(w.num_blocks);
    let quota = NamespaceQuota { max_blocks: limit, reserved_blocks: reserve.min(limit) };
    kv.set_namespace_quota(1, quota).unwrap();
    let mut host_words = vec![0u32; HostPool::storage_words(w.host_blocks.max(1))];
    let mut host = (w.host_blocks > 0)
        .then(|| HostPool::new(w.host_blocks, 9, &mut host_words).unwrap());
    let config = EngineConfig {
        max_requests: w.max_requests,
        scheduler: SchedulerConfig {
            token_budget: w.token_budget,
            max_running: w.max_running,
            watermark_blocks: w.watermark,
            preemption: if w.swap { Preemption::Swap } else { Preemption::Recompute },
        },
        host_blocks: w.host_blocks,
    };
    let mut words = vec![0u64; config.storage_words(&kv_config)];
    let mut engine = Engine::new(config, &kv_config, &mut words).unwrap();
    let mut shadow = Shadow {
        dev: vec![None; (w.num_blocks * bs) as usize],
        host: vec![None; (w.host_blocks * bs) as usize],
    };
    // Live requests: handle -> namespace. Finished: how often each id finished.
    let mut live: Vec<(RequestId, u64)> = Vec::new();
    let mut added = 0u32;
    let mut finished: HashMap<(u32, u32), u32> = HashMap::new();
    let mut cancelled = 0u32;
    let mut next_token = 5_000_000u32;

    let step = |engine: &mut Engine<'_>,
                    kv: &mut BlockManager<'_>,
                    host: &mut Option<HostPool<'_>>,
                    shadow: &mut Shadow,
                    live: &mut Vec<(RequestId, u64)>,
                    finished: &mut HashMap<(u32, u32), u32>,
                    next_token: &mut u32,
                    stops: u32|
     -> Result<bool, TestCaseError> {
        let plan = match engine.step(kv, host.as_mut()) {
            Ok(p) => p,
            Err(e) => return Err(TestCaseError::fail(format!("step failed: {e:?}"))),
        };
        prop_assert!(plan.tokens() <= w.token_budget);
        // The backend: copies in the documented order, then the model's writes.
        for c in plan.swap_out() {
            Shadow::copy_block(&shadow.dev, &mut shadow.host, c.src, c.dst, bs as usize);
        }
        for c in plan.swap_in() {
            Shadow::copy_block(&shadow.host, &mut shadow.dev, c.src, c.dst, bs as usize);
        }
        for c in plan.copies() {
            let dev = shadow.dev.clone();
            Shadow::copy_block(&dev, &mut shadow.dev, c.src, c.dst, bs as usize);
        }
        let scheduled: Vec<_> = plan.seqs().collect();
        let slots = plan.slots().to_vec();
        let inputs = plan.input_tokens().to_vec();
        let moved = !plan.swap_out().is_empty() || !plan.swap_in().is_empty();
        let ns_of: HashMap<RequestId, u64> = live.iter().copied().collect();
        let mut samples = Vec::new();
        for s in scheduled.iter().filter(|s| s.emits) {
            let stop = stops >> (samples.len() % 32) & 1 == 1;
            *next_token += 1;
            samples.push(Sampled { request: s.request, token: *next_token, stop });
        }
        // The model writes K/V: needs the request's tokens (the engine has them).
        for s in &scheduled {
            let tokens = engine.tokens(s.request).unwrap().to_vec();
            let ns = ns_of[&s.request];
            let (a, n) = (s.offset as usize, s.tokens as usize);
            prop_assert_eq!(&inputs[a..a + n], &tokens[s.first_pos as usize..s.first_pos as usize + n]);
            for k in 0..n {
                let pos = s.first_pos as usize + k;
                shadow.dev[slots[a + k] as usize] = Some(content(ns, &tokens, pos));
            }
        }
        let done = engine.commit_step(kv, &samples).map_err(|e| TestCaseError::fail(format!("commit: {e:?}")))?;
        for f in done.iter() {
            *finished.entry((f.request.index(), f.request.generation())).or_default() += 1;
            live.retain(|(r, _)| *r != f.request);
        }
        // Every running request reads back its own K/V through its block table.
        for &(r, ns) in live.iter() {
            let Ok(seq) = engine.seq(r) else { continue };
            let tokens = engine.tokens(r).unwrap();
            let blocks = kv.blocks(seq).unwrap();
            let len = kv.len(seq).unwrap() as usize;
            prop_assert!(len <= tokens.len());
            for pos in 0..len {
                let slot = blocks[pos / bs as usize] as usize * bs as usize + pos % bs as usize;
                prop_assert_eq!(shadow.dev[slot], Some(content(ns, tokens, pos)), "request {:?} position {}", r, pos);
            }
        }
        let stats = kv.stats();
        prop_assert_eq!(stats.free_blocks + stats.cached_blocks + stats.used_blocks, w.num_blocks);
        if let Some(h) = host.as_ref() {
            prop_assert!(h.free_blocks() <= h.total_blocks());
        }
        Ok(!scheduled.is_empty() || moved)
    };

    for op in &w.ops {
        match *op {
            Op::Add { ns, group, shared, unique, max_new, level } => {
                let p = prompt(added, ns, group, shared, unique);
                let p = &p[..p.len().min(max_tokens)];
                let max_new = (max_new > 0).then_some(u32::from(max_new));
                // Pinned prompts stay cached: a preempted sequence frees fewer blocks
                // (the drain below unpins them when it stalls).
                let added_request = match Priority::from_level(level) {
                    Some(priority) => engine.add_request_at(p, u64::from(ns), max_new, priority),
                    None => engine.add_request(p, u64::from(ns), max_new),
                };
                match added_request {
                    Ok(r) => {
                        live.push((r, u64::from(ns)));
                        added += 1;
                    }
                    Err(EngineError::QueueFull { .. }) => {}
                    Err(e) => return Err(TestCaseError::fail(format!("add: {e:?}"))),
                }
            }
            Op::Step { stops } => {
                step(&mut engine, &mut kv, &mut host, &mut shadow, &mut live, &mut finished, &mut next_token, stops)?;
            }
            Op::Fork { pick, replace } => {
                if live.is_empty() {
                    continue;
                }
                let (r, ns) = live[pick as usize % live.len()];
                next_token += 1;
                match engine.fork(&mut kv, r, replace.then_some(next_token)) {
                    Ok(child) => {
                        live.push((child, ns));
                        added += 1;
                    }
                    Err(
                        EngineError::WrongState { .. }
                        | EngineError::QueueFull { .. }
                        | EngineError::NoFreeSequence,
                    ) => {}
                    Err(e) => return Err(TestCaseError::fail(format!("fork: {e:?}"))),
                }
            }
            Op::Cancel { pick } => {
                if live.is_empty() {
                    continue;
                }
                let k = pick as usize % live.len();
                let (r, _) = live.remove(k);
                engine.cancel(&mut kv, host.as_mut(), r).map_err(|e| TestCaseError::fail(format!("cancel: {e:?}")))?;
                cancelled += 1;
            }
        }
    }
    // Drain: every request finishes (requests without a limit stop at the sequence
    // length at the latest).
    let mut idle = 0;
    let mut steps = 0;
    while engine.in_flight() > 0 {
        steps += 1;
        prop_assert!(steps < 20_000, "engine does not drain");
        let progressed = step(&mut engine, &mut kv, &mut host, &mut shadow, &mut live, &mut finished, &mut next_token, 0)?;
        idle = if progressed { 0 } else { idle + 1 };
        if !progressed {
            // Pinned prompts nobody uses may be what keeps the next request out.
            kv.unpin_cached();
        }
        prop_assert!(idle < 3, "no progress with {} requests in flight", engine.in_flight());
    }
    if std::env::var("ENGINE_TEST_STATS").is_ok() {
        eprintln!("{:?} prefix_hits={} host={}", engine.stats(), kv.stats().prefix_hit_tokens, w.host_blocks);
    }
    prop_assert!(live.is_empty());
    prop_assert!(finished.values().all(|&n| n == 1), "a request finished twice");
    prop_assert_eq!(finished.len() as u32 + cancelled, added);
    let stats = kv.stats();
    prop_assert_eq!(stats.used_blocks, 0);
    prop_assert_eq!(stats.live_seqs, 0);
    if let Some(h) = host.as_ref() {
        prop_assert_eq!(h.free_blocks(), h.total_blocks());
    }
    Ok(())
}


proptest! {
    #![proptest_config(common::proptest_config(300))]

    #[test]
    fn every_plan_executes_and_every_request_finishes_once(w in workload()) {
        run(w)?;
    }
}
