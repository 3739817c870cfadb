//! The shared block manager under many threads: every thread hammers every operation
//! on its own sequences, shares prompt prefixes with the others through the prefix cache
//! of one namespace, and forks other threads' sequences (whose handles may be stale by
//! then). Each operation's outcome is checked under the same lock (lengths, slot
//! mappings, block-table rows, "a failed operation changes nothing"), and the whole
//! pool's counts and reference counts after. Run over both locks: the blocking
//! `kvpage::SharedManager` and the core's spinning `kvpage_core::SharedManager`.
//!
//! Outcomes are asserted, never times. Sized to run in about a second in a debug build.

mod common;

use std::cell::Cell;
use std::sync::{Barrier, Mutex};

use kvpage::SharedManager;
use kvpage_core::{Appended, BlockManager, Config, SeqError, SeqId, Stats};
use rand::rngs::StdRng;
use rand::RngExt;

/// Threads and operations each: under Miri (which checks the lock for data races and
/// the spin lock for a hang) three threads of a few dozen operations.
const THREADS: usize = if cfg!(miri) { 3 } else { 8 };
const OPS_PER_THREAD: usize = if cfg!(miri) { 40 } else { 6000 };
/// Sequences one thread keeps live at most (together more than `max_seqs`, so
/// `NoFreeSequence` happens too).
const OWN_MAX: usize = 6;
/// Tokens of each shared system prompt.
const SYSTEM_TOKENS: usize = 40;

const CONFIG: Config = Config {
    num_blocks: 320,
    block_size: 4,
    max_seqs: 40,
    max_blocks_per_seq: 24,
    instance: 3,
    hash_key: 0x5eed,
    prefix_cache: true,
    max_position_runs: 4,
    max_namespaces: 0,
    event_capacity: 0,
};
const BS: u32 = CONFIG.block_size;
const MAX_TOKENS: u32 = CONFIG.block_size * CONFIG.max_blocks_per_seq;
/// The namespace every thread shares prompts in; thread `t` also uses its own, `t + 1`.
const SHARED_NS: u64 = 0;

/// Runs `f` on the manager under the lock. The stress test only sees a lock this way.
type With<'m, 'a> = &'m (dyn Fn(&mut dyn FnMut(&mut BlockManager<'a>)) + Sync);

/// A sequence a thread owns, and the length it expects.
#[derive(Debug, Clone, Copy)]
struct Own {
    seq: SeqId,
    len: u32,
}

/// What a thread hands back: its live sequences and a few counters.
#[derive(Debug, Default)]
struct Outcome {
    live: Vec<Own>,
    foreign_forks: u32,
    stale_forks: u32,
    prefix_hits: u32,
    /// Operations refused as expected: no free sequence or block, too long.
    refused: u32,
}

fn system_prompt(group: u32) -> Vec<u32> {
    (0..SYSTEM_TOKENS as u32)
        .map(|i| group * 1000 + i)
        .collect()
}

/// Checks `slots` as the mapping of positions `first..` of `seq`, and, when a copy was
/// reported, that its destination is now the sequence's block. Under the lock.
fn check_slots(m: &BlockManager<'_>, seq: SeqId, first: u32, slots: &[u32], appended: Appended) {
    let blocks = m.blocks(seq).unwrap();
    for (j, &slot) in slots.iter().enumerate() {
        let pos = first + j as u32;
        assert_eq!(
            slot,
            blocks[(pos / BS) as usize] * BS + pos % BS,
            "slot of {pos}"
        );
    }
    if let Some(copy) = appended.copy {
        assert_eq!(blocks[(first / BS) as usize], copy.dst);
        assert_eq!(m.refcount(copy.dst), Some(1));
        assert_ne!(copy.src, copy.dst);
    }
}

/// The per-operation invariants: the counts add up, and `own`'s row is what its owner
/// expects. O(blocks of `own`). Under the lock.
fn check_seq(m: &BlockManager<'_>, own: Own) {
    assert_eq!(m.len(own.seq), Ok(own.len));
    let blocks = m.blocks(own.seq).unwrap();
    assert_eq!(blocks.len() as u32, own.len.div_ceil(BS));
    let row = own.seq.index() as usize * CONFIG.max_blocks_per_seq as usize;
    assert_eq!(&m.block_table()[row..row + blocks.len()], blocks);
    assert_eq!(m.seq_lens()[own.seq.index() as usize], own.len);
    for &b in blocks {
        assert!(
            m.refcount(b).unwrap() >= 1,
            "block {b} of a live sequence is unused"
        );
    }
}

fn check_counts(s: &Stats) {
    assert_eq!(s.total_blocks, CONFIG.num_blocks);
    assert_eq!(
        s.free_blocks + s.cached_blocks + s.used_blocks,
        s.total_blocks
    );
    assert!(s.live_seqs <= CONFIG.max_seqs);
    assert!(s.tokens_stored <= s.token_slots);
}

/// One thread's run: `OPS_PER_THREAD` random operations, each under one lock.
fn hammer(
    with: With<'_, '_>,
    t: usize,
    rng: &mut StdRng,
    published: &Mutex<Vec<SeqId>>,
) -> Outcome {
    let own_ns = t as u64 + 1;
    let mut out = Outcome::default();
    let mut slots = vec![0u32; MAX_TOKENS as usize];
    for _ in 0..OPS_PER_THREAD {
        let op = rng.random_range(0..12u32);
        let pick = if out.live.is_empty() {
            None
        } else {
            Some(rng.random_range(0..out.live.len()))
        };
        // Draws that need no lock, made before taking it.
        let ns = if rng.random_bool(0.7) {
            SHARED_NS
        } else {
            own_ns
        };
        let group = rng.random_range(0..3u32);
        let prompt_len = rng.random_range(1..=MAX_TOKENS as usize);
        let tail_seed = rng.random_range(0..4u32);
        let r = rng.random::<u32>();
        let foreign = published.lock().unwrap().get(r as usize % 64).copied();
        let mut forked = None;
        let refused = Cell::new(0);
        with(&mut |m| {
            let before = m.stats();
            check_counts(&before);
            // `e` is one of `allowed` and left the counts as they were (`then`).
            let failed_since =
                |m: &BlockManager<'_>, e: SeqError, allowed: &[SeqError], then: &Stats| {
                    let kind = core::mem::discriminant(&e);
                    assert!(
                        allowed.iter().any(|a| core::mem::discriminant(a) == kind),
                        "unexpected {e:?}"
                    );
                    assert_eq!(&m.stats(), then, "a failed {e:?} changed the counts");
                };
            let failed = |m: &BlockManager<'_>, e: SeqError, allowed: &[SeqError]| {
                refused.set(refused.get() + 1);
                failed_since(m, e, allowed, &before)
            };
            let full = SeqError::NoFreeSequence;
            let beyond_len = SeqError::BeyondLength {
                requested: 0,
                len: 0,
            };
            let no_blocks = SeqError::OutOfBlocks {
                needed: 0,
                available: 0,
            };
            match (op, pick) {
                (0, _) | (1, None) if out.live.len() < OWN_MAX => match m.create(ns) {
                    Ok(seq) => {
                        assert_eq!(m.len(seq), Ok(0));
                        out.live.push(Own { seq, len: 0 });
                    }
                    Err(e) => failed(m, e, &[full]),
                },
                (1, _) | (2, _) if out.live.len() < OWN_MAX => {
                    let mut prompt = system_prompt(group);
                    prompt.extend((0..MAX_TOKENS).map(|i| i * 7 + tail_seed));
                    prompt.truncate(prompt_len);
                    match m.create_with_prompt(ns, &prompt, &mut slots) {
                        Ok(start) => {
                            let reused = start.reused_tokens;
                            assert_eq!(reused % BS, 0);
                            assert!(reused < prompt.len() as u32);
                            if reused > 0 {
                                out.prefix_hits += 1;
                            }
                            let len = prompt.len() as u32;
                            let new = &slots[..(len - reused) as usize];
                            check_slots(m, start.seq, reused, new, start.appended);
                            // The K/V is "written": offer the blocks to everyone.
                            if op == 2 {
                                m.commit(start.seq, len).unwrap();
                            }
                            out.live.push(Own {
                                seq: start.seq,
                                len,
                            });
                        }
                        Err(e) => failed(m, e, &[full, no_blocks]),
                    }
                }
                (3, Some(k)) | (4, Some(k)) => {
                    let own = &mut out.live[k];
                    let room = MAX_TOKENS - own.len;
                    let n = if room == 0 { 1 } else { 1 + r % room.min(9) };
                    let tokens: Vec<u32> = (0..n).map(|i| own.len + i + tail_seed).collect();
                    let result = if op == 3 {
                        m.append(own.seq, n, &mut slots)
                    } else {
                        m.append_tokens(own.seq, &tokens, &mut slots)
                    };
                    match result {
                        Ok(appended) => {
                            check_slots(m, own.seq, own.len, &slots[..n as usize], appended);
                            own.len += n;
                        }
                        Err(e) if room == 0 => failed(
                            m,
                            e,
                            &[SeqError::TooLong {
                                tokens: 0,
                                max_tokens: 0,
                            }],
                        ),
                        Err(e) => failed(m, e, &[no_blocks]),
                    }
                }
                (5, Some(k)) => {
                    let own = out.live[k];
                    let computed = r % (own.len + 1);
                    m.commit(own.seq, computed).unwrap();
                    let then = m.stats();
                    let beyond = m.commit(own.seq, own.len + 1).unwrap_err();
                    failed_since(m, beyond, &[beyond_len], &then);
                }
                (6, Some(k)) if out.live.len() < OWN_MAX => {
                    // Fork one of ours, or a published one of any thread (maybe stale).
                    let (src, mine) = match foreign {
                        Some(seq) if r % 2 == 0 => (seq, false),
                        _ => (out.live[k].seq, true),
                    };
                    let src_len = m.len(src);
                    match m.fork(src) {
                        Ok(seq) => {
                            let len = src_len.unwrap();
                            assert_eq!(m.len(seq), Ok(len));
                            assert_eq!(m.blocks(seq).unwrap(), m.blocks(src).unwrap());
                            out.foreign_forks += u32::from(!mine);
                            forked = Some(Own { seq, len });
                        }
                        Err(SeqError::StaleHandle) if !mine => {
                            assert_eq!(src_len, Err(SeqError::StaleHandle));
                            out.stale_forks += 1;
                        }
                        Err(e) => failed(m, e, &[full]),
                    }
                }
                (7, Some(k)) => {
                    let own = &mut out.live[k];
                    let new_len = r % (own.len + 1);
                    m.truncate(own.seq, new_len).unwrap();
                    own.len = new_len;
                    let then = m.stats();
                    let e = m.truncate(own.seq, new_len + 1).unwrap_err();
                    failed_since(m, e, &[beyond_len], &then);
                }
                (8, Some(k)) => {
                    let own = out.live.swap_remove(k);
                    m.release(own.seq).unwrap();
                    assert_eq!(m.release(own.seq), Err(SeqError::StaleHandle));
                    assert_eq!(m.len(own.seq), Err(SeqError::StaleHandle));
                    assert_eq!(
                        m.stats(),
                        Stats {
                            live_seqs: before.live_seqs - 1,
                            logical_tokens: before.logical_tokens - u64::from(own.len),
                            ..m.stats()
                        }
                    );
                }
                (9, _) => {
                    let max = r % 8;
                    let evicted = m.evict_cached(max);
                    assert!(evicted <= max.min(before.cached_blocks));
                    let s = m.stats();
                    assert_eq!(s.cached_blocks, before.cached_blocks - evicted);
                    assert_eq!(s.free_blocks, before.free_blocks + evicted);
                }
                _ => {
                    // Reads: stats and every row of ours.
                    let s = m.stats();
                    assert_eq!(s, before);
                    assert_eq!(m.available_blocks(), s.free_blocks + s.cached_blocks);
                    for &own in &out.live {
                        check_seq(m, own);
                    }
                }
            }
            check_counts(&m.stats());
            if let Some(k) = pick.filter(|&k| k < out.live.len()) {
                check_seq(m, out.live[k]);
            }
        });
        out.refused += refused.get();
        if let Some(own) = forked {
            out.live.push(own);
        }
        if op == 0 || op == 2 {
            if let Some(own) = out.live.last() {
                let mut p = published.lock().unwrap();
                let slot = r as usize % 64;
                if slot < p.len() {
                    p[slot] = own.seq;
                } else {
                    p.push(own.seq);
                }
            }
        }
    }
    out
}

/// Reference counts and every counter against the handles the threads hold. Under the
/// lock, with no thread running.
fn check_quiescent(m: &BlockManager<'_>, live: &[Own]) {
    let s = m.stats();
    check_counts(&s);
    let mut refs = vec![0u32; CONFIG.num_blocks as usize];
    for own in live {
        check_seq(m, *own);
        for &b in m.blocks(own.seq).unwrap() {
            refs[b as usize] += 1;
        }
    }
    let mut used = 0;
    let mut cached = 0;
    for (b, &r) in refs.iter().enumerate() {
        assert_eq!(m.refcount(b as u32), Some(r), "refcount of block {b}");
        used += u32::from(r > 0);
        cached += u32::from(r == 0 && m.is_registered(b as u32));
    }
    assert_eq!(s.live_seqs as usize, live.len());
    assert_eq!(s.used_blocks, used);
    assert_eq!(s.cached_blocks, cached);
    assert_eq!(
        s.logical_tokens,
        live.iter().map(|o| u64::from(o.len)).sum::<u64>()
    );
    let total_refs: u64 = refs.iter().map(|&r| u64::from(r)).sum();
    assert_eq!(s.blocks_saved_by_sharing, total_refs - u64::from(used));
}

/// The whole run over one lock: hammer, check, release everything in parallel, check
/// that no block leaked.
fn stress(with: With<'_, '_>, seed: u64) {
    let published = Mutex::new(Vec::new());
    let barrier = Barrier::new(THREADS);
    let outcomes: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (published, barrier) = (&published, &barrier);
                s.spawn(move || {
                    let mut rng = common::rng(seed + t as u64);
                    barrier.wait();
                    hammer(with, t, &mut rng, published)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let live: Vec<Own> = outcomes
        .iter()
        .flat_map(|o| o.live.iter().copied())
        .collect();
    let sum = |f: fn(&Outcome) -> u32| outcomes.iter().map(f).sum::<u32>();
    // The run did what it is for: prompts shared across threads, forks of other threads'
    // sequences, and of handles released meanwhile. (Under Miri the run is a few dozen
    // operations, too short to promise each interleaving: there it checks the accesses
    // for data races and undefined behaviour, and the invariants below.)
    if !cfg!(miri) {
        assert!(sum(|o| o.prefix_hits) > 0, "no prefix hit");
        assert!(
            sum(|o| o.foreign_forks) > 0,
            "no fork of another thread's sequence"
        );
        assert!(sum(|o| o.stale_forks) > 0, "no fork of a stale handle");
        assert!(sum(|o| o.refused) > 0, "no refused operation");
    }
    with(&mut |m| {
        check_quiescent(m, &live);
        assert!(cfg!(miri) || m.stats().prefix_hit_tokens > 0);
    });

    // Every thread releases what it holds, concurrently.
    std::thread::scope(|s| {
        for o in &outcomes {
            s.spawn(move || {
                for own in &o.live {
                    with(&mut |m| m.release(own.seq).unwrap());
                }
            });
        }
    });
    with(&mut |m| {
        check_quiescent(m, &[]);
        let s = m.stats();
        assert_eq!((s.used_blocks, s.live_seqs, s.tokens_stored), (0, 0, 0));
        assert_eq!(m.evict_cached(u32::MAX), s.cached_blocks);
        assert_eq!(m.stats().free_blocks, CONFIG.num_blocks);
        assert!((0..CONFIG.num_blocks).all(|b| !m.is_registered(b)));
        // Every block and row is usable again.
        for _ in 0..CONFIG.num_blocks / CONFIG.max_blocks_per_seq {
            let seq = m.create(0).unwrap();
            m.append(seq, MAX_TOKENS, &mut vec![0; MAX_TOKENS as usize])
                .unwrap();
        }
    });
}

#[test]
fn blocking_shared_manager_under_many_threads() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let shared = SharedManager::new(BlockManager::new(CONFIG, &mut storage).unwrap());
    stress(
        &|f| match shared.try_lock() {
            Some(mut m) => f(&mut m),
            None => f(&mut shared.lock()),
        },
        1,
    );
}

#[test]
fn spinning_shared_manager_under_many_threads() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let shared = kvpage_core::SharedManager::new(BlockManager::new(CONFIG, &mut storage).unwrap());
    stress(
        &|f| match shared.try_lock() {
            Some(mut m) => f(&mut m),
            None => f(&mut shared.lock()),
        },
        2,
    );
}
