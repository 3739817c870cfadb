//! 100,000 random operations after construction (1,000 under Miri) allocate nothing: a
//! counting global allocator sees zero allocations between the end of set-up and the end
//! of the run.
//! Only the test's own thread is counted: the test harness allocates on its threads
//! while the test runs.

use kvpage_core::{BlockCopy, BlockManager, Config, NamespaceQuota, Priority, RowMove, SeqId};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

/// Runs are this many times shorter under Miri (the counts they check scale with them).
const MIRI_SCALE: u64 = if cfg!(miri) { 100 } else { 1 };
/// The engine loop's iterations, and the least finished requests, forks and swap-outs
/// (and swap-ins) they must show; a short run under Miri.
const ENGINE_RUN: (u64, [u64; 3]) = if cfg!(miri) {
    (400, [5, 1, 0])
} else {
    (20_000, [1000, 100, 10])
};

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
thread_local! {
    // `const` initialization: reading it never allocates, even inside the allocator.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

fn counting() -> bool {
    COUNTING.with(Cell::get)
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if counting() {
            ALLOCATIONS.fetch_add(1, Ordering::SeqCst);
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if counting() {
            ALLOCATIONS.fetch_add(1, Ordering::SeqCst);
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// xorshift64*: a generator that needs no allocation.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u32) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as u32 % n
    }
}

#[test]
fn random_operations_allocate_nothing() {
    const CONFIG: Config = Config {
        num_blocks: 512,
        block_size: 8,
        max_seqs: 32,
        max_blocks_per_seq: 32,
        instance: 0,
        hash_key: 0,
        prefix_cache: true,
        max_position_runs: 4,
        max_namespaces: 2,
        event_capacity: 64,
    };
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    let mut live: [Option<SeqId>; 32] = [None; 32];
    let mut slots = [0u32; 256];
    let mut prompt = [0u32; 200];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut done = [0u32; 10];
    let mut copies = [BlockCopy { src: 0, dst: 0 }; 32];
    let mut moves = [RowMove::default(); 80];

    COUNTING.with(|c| c.set(true));
    for _ in 0..100_000 / MIRI_SCALE {
        let k = rng.below(32) as usize;
        let op = rng.below(10);
        let ok = match (op, live[k]) {
            (0, None) => kv
                .create(u64::from(rng.below(2)))
                .map(|s| live[k] = Some(s))
                .is_ok(),
            (1, None) => {
                let len = rng.below(200) as usize;
                let base = rng.below(4);
                for (i, t) in prompt[..len].iter_mut().enumerate() {
                    *t = base * 1000 + i as u32;
                }
                let priority = Priority::from_level(rng.below(4) as u8).unwrap();
                kv.create_with_prompt_at(
                    u64::from(rng.below(3)),
                    priority,
                    &prompt[..len],
                    &mut slots,
                )
                .and_then(|p| {
                    live[k] = Some(p.seq);
                    kv.commit(p.seq, len as u32)
                })
                .is_ok()
            }
            (2, Some(s)) => kv.append(s, rng.below(40), &mut slots).is_ok(),
            (3, Some(s)) => {
                let n = rng.below(20) as usize;
                kv.append_tokens(s, &prompt[..n], &mut slots)
                    .and_then(|_| kv.commit(s, kv.len(s)?))
                    .is_ok()
            }
            (4, Some(s)) => {
                let slot = rng.below(32) as usize;
                live[slot].is_none() && kv.fork(s).map(|c| live[slot] = Some(c)).is_ok()
            }
            (5, Some(s)) => {
                let len = kv.len(s).unwrap();
                let level = Priority::from_level(rng.below(4) as u8).unwrap();
                kv.set_range_priority(s, rng.below(len + 1), len, level)
                    .unwrap();
                kv.truncate(s, rng.below(len + 1)).is_ok()
            }
            (6, Some(s)) => {
                live[k] = None;
                kv.release(s).is_ok()
            }
            (7, Some(s)) => {
                let len = kv.len(s).unwrap();
                let first = rng.below(len + 1);
                let end = first + rng.below(len - first + 1);
                kv.remove_range(s, first, end, &mut copies, &mut moves)
                    .is_ok()
            }
            (8, Some(s)) => {
                let len = kv.len(s).unwrap();
                let keep = rng.below(len + 1);
                let discard = rng.below(len - keep + 1);
                kv.context_shift(s, keep, discard, &mut copies, &mut moves)
                    .is_ok()
                    && kv.shift_positions(s, 0, keep, 0).is_ok()
            }
            (9, Some(s)) => {
                let slot = rng.below(32) as usize;
                let len = kv.len(s).unwrap();
                let first = rng.below(len + 1);
                live[slot].is_none()
                    && kv
                        .copy_range(s, first, len, 0, &mut moves)
                        .map(|c| live[slot] = Some(c.seq))
                        .is_ok()
            }
            _ => {
                kv.evict_cached(rng.below(4));
                let quota = NamespaceQuota {
                    max_blocks: 64 + rng.below(256),
                    reserved_blocks: rng.below(32),
                };
                let _ = kv.set_namespace_quota(u64::from(rng.below(3)), quota);
                if rng.below(16) == 0 {
                    kv.unpin_cached();
                }
                if rng.below(64) == 0 {
                    kv.clear_prefix_cache();
                }
                // Reading the event ring (a publisher's job) allocates nothing either.
                let from = kv
                    .next_event_seq()
                    .saturating_sub(u64::from(rng.below(100)));
                let events = kv.events_since(from).unwrap();
                let _ = events.lost() + events.map(|(s, _)| s).sum::<u64>();
                false
            }
        };
        if ok {
            done[op as usize] += 1;
        }
        let _ = kv.stats();
    }
    COUNTING.with(|c| c.set(false));

    assert_eq!(
        ALLOCATIONS.load(Ordering::SeqCst),
        0,
        "operations after construction allocated"
    );
    // The run exercised every operation many times.
    assert!(
        done.iter().all(|&d| d > if cfg!(miri) { 5 } else { 1000 }),
        "operation counts {done:?}"
    );
    assert!(kv.stats().prefix_hit_tokens > 0);
}

/// The engine's loop — add, step, commit with samples, fork, cancel, with preemption by
/// swap under memory pressure — allocates nothing after construction either.
#[test]
fn engine_steps_allocate_nothing() {
    use kvpage_core::{
        Engine, EngineConfig, HostPool, Preemption, RequestId, Sampled, SchedulerConfig,
    };
    const KV: Config = Config {
        num_blocks: 24,
        block_size: 4,
        max_seqs: 12,
        max_blocks_per_seq: 16,
        instance: 5,
        hash_key: 0,
        prefix_cache: true,
        max_position_runs: 4,
        max_namespaces: 0,
        event_capacity: 0,
    };
    const ENGINE: EngineConfig = EngineConfig {
        max_requests: 16,
        scheduler: SchedulerConfig {
            token_budget: 32,
            max_running: 8,
            watermark_blocks: 1,
            preemption: Preemption::Swap,
        },
        host_blocks: 48,
    };
    let mut kv_words = vec![0u64; KV.storage_words()];
    let mut kv = BlockManager::new(KV, &mut kv_words).unwrap();
    let mut host_words = vec![0u32; HostPool::storage_words(48)];
    let mut host = HostPool::new(48, 5, &mut host_words).unwrap();
    let mut words = vec![0u64; ENGINE.storage_words(&KV)];
    let mut engine = Engine::new(ENGINE, &KV, &mut words).unwrap();
    let mut live: [Option<RequestId>; 16] = [None; 16];
    let mut samples = [Sampled {
        request: RequestId::from_parts(0, 0),
        token: 0,
        stop: false,
    }; 16];
    let mut prompt = [0u32; 40];
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let (mut finished, mut forks) = (0u64, 0u64);

    COUNTING.with(|c| c.set(true));
    let (iterations, [least_finished, least_forks, least_swaps]) = ENGINE_RUN;
    for _ in 0..iterations {
        let k = rng.below(16) as usize;
        match rng.below(8) {
            0 | 1 => {
                let len = 1 + rng.below(40) as usize;
                let base = rng.below(3);
                for (i, t) in prompt[..len].iter_mut().enumerate() {
                    *t = if i < 16 {
                        base * 100 + i as u32
                    } else {
                        rng.below(1000)
                    };
                }
                if let Ok(r) = engine.add_request(&prompt[..len], 0, Some(1 + rng.below(50))) {
                    if let Some(slot) = live.iter_mut().find(|l| l.is_none()) {
                        *slot = Some(r);
                    }
                }
            }
            2 => {
                if let Some(r) = live[k] {
                    if let Ok(c) = engine.fork(&mut kv, r, Some(rng.below(1000))) {
                        forks += 1;
                        if let Some(slot) = live.iter_mut().find(|l| l.is_none()) {
                            *slot = Some(c);
                        } else {
                            engine.cancel(&mut kv, Some(&mut host), c).unwrap();
                        }
                    }
                }
            }
            3 if rng.below(8) == 0 => {
                if let Some(r) = live[k].take() {
                    let _ = engine.cancel(&mut kv, Some(&mut host), r);
                }
            }
            _ => {
                let step = engine.step(&mut kv, Some(&mut host)).unwrap();
                let mut n = 0;
                for s in step.seqs().filter(|s| s.emits) {
                    samples[n] = Sampled {
                        request: s.request,
                        token: rng.below(1000),
                        stop: rng.below(64) == 0,
                    };
                    n += 1;
                }
                let done = engine.commit_step(&mut kv, &samples[..n]).unwrap();
                for f in done.iter() {
                    finished += 1;
                    for l in live.iter_mut().filter(|l| **l == Some(f.request)) {
                        *l = None;
                    }
                }
            }
        }
    }
    COUNTING.with(|c| c.set(false));

    assert_eq!(
        ALLOCATIONS.load(Ordering::SeqCst),
        0,
        "engine steps allocated"
    );
    let stats = engine.stats();
    assert!(
        finished > least_finished && forks > least_forks,
        "finished {finished}, forks {forks}"
    );
    assert!(
        stats.swap_outs > least_swaps && stats.swap_ins > least_swaps,
        "{stats:?}"
    );
}
