//! 100,000 random operations after construction allocate nothing: a counting global
//! allocator sees zero allocations between the end of set-up and the end of the run.
//! Only the test's own thread is counted: the test harness allocates on its threads
//! while the test runs.

use kvpage_core::{BlockManager, Config, SeqId};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

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
    };
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    let mut live: [Option<SeqId>; 32] = [None; 32];
    let mut slots = [0u32; 256];
    let mut prompt = [0u32; 200];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut done = [0u32; 7];

    COUNTING.with(|c| c.set(true));
    for _ in 0..100_000 {
        let k = rng.below(32) as usize;
        let op = rng.below(7);
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
                kv.create_with_prompt(0, &prompt[..len], &mut slots)
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
                kv.truncate(s, rng.below(len + 1)).is_ok()
            }
            (6, Some(s)) => {
                live[k] = None;
                kv.release(s).is_ok()
            }
            _ => {
                kv.evict_cached(rng.below(4));
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
    assert!(done.iter().all(|&d| d > 1000), "operation counts {done:?}");
    assert!(kv.stats().prefix_hit_tokens > 0);
}
