//! KV cache events: replaying the event stream from sequence 0 rebuilds exactly the
//! prefix cache's registered blocks after random workloads (eviction, quotas, edits,
//! imports, clears), and a ring too small for the stream reports the gap.

mod common;

use std::collections::HashMap;

use kvpage_core::{
    BlockCopy, BlockManager, Config, EventError, KvEvent, NamespaceQuota, Priority, RowMove, SeqId,
};
use proptest::prelude::*;

const BS: u32 = 4;
const BLOCKS: u32 = 12;

fn config(event_capacity: u32) -> Config {
    Config {
        num_blocks: BLOCKS,
        block_size: BS,
        max_seqs: 4,
        max_blocks_per_seq: 6,
        instance: 1,
        hash_key: 0x5eed,
        prefix_cache: true,
        max_position_runs: 4,
        max_namespaces: 2,
        event_capacity,
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A prompt of `len` tokens drawn from a 2-letter alphabet (so prompts share
    /// prefixes), in namespace `ns`, committed up to `commit` tokens.
    Prompt {
        ns: u64,
        len: u32,
        seed: u32,
        commit: u32,
    },
    /// Appends `n` tokens to live sequence `k % live` and commits everything.
    Append {
        k: usize,
        n: u32,
        token: u32,
    },
    Release {
        k: usize,
    },
    Truncate {
        k: usize,
        to: u32,
    },
    Remove {
        k: usize,
        first: u32,
        n: u32,
    },
    Fork {
        k: usize,
    },
    Evict {
        n: u32,
    },
    Quota {
        ns: u64,
        max: u32,
    },
    /// Imports a chain of `blocks` blocks in namespace `ns`.
    Import {
        ns: u64,
        blocks: u32,
        token: u32,
    },
    Clear,
    Pin {
        k: usize,
    },
    Unpin,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..2, 1u32..22, any::<u32>(), 0u32..24)
            .prop_map(|(ns, len, seed, commit)| Op::Prompt { ns, len, seed, commit }),
        2 => (any::<usize>(), 1u32..9, 0u32..3).prop_map(|(k, n, token)| Op::Append { k, n, token }),
        3 => any::<usize>().prop_map(|k| Op::Release { k }),
        1 => (any::<usize>(), 0u32..20).prop_map(|(k, to)| Op::Truncate { k, to }),
        1 => (any::<usize>(), 0u32..20, 0u32..6).prop_map(|(k, first, n)| Op::Remove { k, first, n }),
        1 => any::<usize>().prop_map(|k| Op::Fork { k }),
        1 => (1u32..6).prop_map(|n| Op::Evict { n }),
        1 => (0u64..2, 2u32..12).prop_map(|(ns, max)| Op::Quota { ns, max }),
        1 => (0u64..2, 1u32..4, 0u32..3).prop_map(|(ns, blocks, token)| Op::Import { ns, blocks, token }),
        1 => Just(Op::Clear),
        1 => any::<usize>().prop_map(|k| Op::Pin { k }),
        1 => Just(Op::Unpin),
    ]
}

/// Runs `ops` on `kv`; errors are part of the workload (a refused op changes nothing).
fn run(kv: &mut BlockManager<'_>, ops: &[Op]) {
    let mut live: Vec<SeqId> = Vec::new();
    let mut slots = [0u32; 64];
    let mut copies = [BlockCopy { src: 0, dst: 0 }; 16];
    let mut moves = [RowMove::default(); 16];
    for op in ops {
        let pick = |k: usize, live: &[SeqId]| (!live.is_empty()).then(|| k % live.len());
        match *op {
            Op::Prompt {
                ns,
                len,
                seed,
                commit,
            } => {
                let tokens: Vec<u32> = (0..len).map(|t| (seed >> (t % 32)) & 1).collect();
                if let Ok(p) = kv.create_with_prompt(ns, &tokens, &mut slots) {
                    let _ = kv.commit(p.seq, commit.min(len));
                    live.push(p.seq);
                }
            }
            Op::Append { k, n, token } => {
                if let Some(i) = pick(k, &live) {
                    let ids = vec![token; n as usize];
                    if kv.append_tokens(live[i], &ids, &mut slots).is_ok() {
                        let len = kv.len(live[i]).unwrap();
                        kv.commit(live[i], len).unwrap();
                    }
                }
            }
            Op::Release { k } => {
                if let Some(i) = pick(k, &live) {
                    kv.release(live.swap_remove(i)).unwrap();
                }
            }
            Op::Truncate { k, to } => {
                if let Some(i) = pick(k, &live) {
                    let _ = kv.truncate(live[i], to);
                }
            }
            Op::Remove { k, first, n } => {
                if let Some(i) = pick(k, &live) {
                    let _ = kv.remove_range(live[i], first, first + n, &mut copies, &mut moves);
                }
            }
            Op::Fork { k } => {
                if let Some(i) = pick(k, &live) {
                    if let Ok(s) = kv.fork(live[i]) {
                        live.push(s);
                    }
                }
            }
            Op::Evict { n } => {
                kv.evict_cached(n);
            }
            Op::Quota { ns, max } => {
                let _ = kv.set_namespace_quota(
                    ns,
                    NamespaceQuota {
                        max_blocks: max,
                        reserved_blocks: 0,
                    },
                );
            }
            Op::Import { ns, blocks, token } => {
                let mut parent = None;
                for b in 0..blocks {
                    let ids = [token, b, token, b];
                    match kv.import_block(ns, parent, &ids, Priority::Normal) {
                        Ok(got) => parent = Some(got.block),
                        Err(_) => break,
                    }
                }
            }
            Op::Clear => {
                kv.clear_prefix_cache();
            }
            Op::Pin { k } => {
                if let Some(i) = pick(k, &live) {
                    kv.set_priority(live[i], Priority::Pinned).unwrap();
                }
            }
            Op::Unpin => {
                for &s in &live {
                    kv.set_priority(s, Priority::Normal).unwrap();
                }
                kv.unpin_cached();
            }
        }
    }
}

/// A registered block as the event stream describes it.
#[derive(Debug, Clone, PartialEq)]
struct Replayed {
    /// Sequence number of its stored event: identifies this registration.
    seq: u64,
    hash: u64,
    parent_hash: u64,
    /// Parent block and the sequence number of the parent's registration then.
    parent: Option<(u32, u64)>,
    namespace: u64,
    tokens: Vec<u32>,
}

/// Replays every event of `kv` from sequence 0 (the ring must still hold them all).
fn replay(kv: &BlockManager<'_>) -> HashMap<u32, Replayed> {
    let events = kv.events_since(0).unwrap();
    assert_eq!(events.lost(), 0, "the ring is sized to hold the whole test");
    let mut blocks: HashMap<u32, Replayed> = HashMap::new();
    let mut expect_seq = 0;
    for (seq, event) in events {
        assert_eq!(seq, expect_seq, "sequence numbers are consecutive");
        expect_seq += 1;
        match event {
            KvEvent::Stored(s) => {
                assert_eq!(s.tokens.len(), BS as usize);
                let parent = s.parent.map(|p| {
                    let r = &blocks[&p];
                    assert_eq!(r.hash, s.parent_hash, "parent hash is the parent's hash");
                    assert_eq!(r.namespace, s.namespace);
                    (p, r.seq)
                });
                let old = blocks.insert(
                    s.block,
                    Replayed {
                        seq,
                        hash: s.hash,
                        parent_hash: s.parent_hash,
                        parent,
                        namespace: s.namespace,
                        tokens: s.tokens.to_vec(),
                    },
                );
                assert!(old.is_none(), "block {} stored twice", s.block);
            }
            KvEvent::Removed(r) => {
                let old = blocks.remove(&r.block).expect("removed a stored block");
                assert_eq!((old.hash, old.namespace), (r.hash, r.namespace));
            }
            KvEvent::Cleared => blocks.clear(),
        }
    }
    assert_eq!(expect_seq, kv.next_event_seq());
    blocks
}

/// Whether replayed block `b`'s parent registration is still there (what
/// [`BlockManager::registered_block`] requires; following parents from such blocks
/// gives every chain a lookup can reach).
fn parent_alive(blocks: &HashMap<u32, Replayed>, b: u32) -> bool {
    blocks[&b]
        .parent
        .is_none_or(|(p, seq)| blocks.get(&p).is_some_and(|r| r.seq == seq))
}

fn check_replay(kv: &BlockManager<'_>) {
    let blocks = replay(kv);
    for b in 0..BLOCKS {
        let replayed = blocks.get(&b);
        assert_eq!(kv.is_registered(b), replayed.is_some(), "block {b}");
        let Some(r) = replayed else {
            assert_eq!(kv.stored_block(b), None);
            continue;
        };
        let stored = kv.stored_block(b).expect("registered");
        assert_eq!(
            (
                stored.hash,
                stored.parent_hash,
                stored.namespace,
                stored.tokens
            ),
            (r.hash, r.parent_hash, r.namespace, &r.tokens[..])
        );
        assert_eq!(stored.parent, r.parent.map(|p| p.0));
        let reg = kv.registered_block(b);
        assert_eq!(reg.is_some(), parent_alive(&blocks, b), "block {b}");
        if let Some(reg) = reg {
            assert_eq!(
                (
                    reg.hash,
                    reg.parent_hash,
                    reg.namespace,
                    reg.tokens,
                    reg.parent
                ),
                (
                    r.hash,
                    r.parent_hash,
                    r.namespace,
                    &r.tokens[..],
                    r.parent.map(|p| p.0)
                )
            );
        }
    }
}

proptest! {
    #![proptest_config(common::proptest_config(256))]

    #[test]
    fn replaying_events_rebuilds_the_registered_blocks(
        ops in prop::collection::vec(op(), 1..common::max_ops(60))
    ) {
        let config = config(4096);
        let mut storage = vec![0u64; config.storage_words()];
        let mut kv = BlockManager::new(config, &mut storage).unwrap();
        run(&mut kv, &ops);
        check_replay(&kv);
    }

    #[test]
    fn an_overflowing_ring_shows_the_gap(
        ops in prop::collection::vec(op(), 1..common::max_ops(60)),
        capacity in 1u32..6,
        from in 0u64..40,
    ) {
        let config = config(capacity);
        let mut storage = vec![0u64; config.storage_words()];
        let mut kv = BlockManager::new(config, &mut storage).unwrap();
        run(&mut kv, &ops);
        let next = kv.next_event_seq();
        let from = from.min(next);
        let events = kv.events_since(from).unwrap();
        let first = next.saturating_sub(u64::from(capacity)).max(from);
        prop_assert_eq!(events.lost(), first - from);
        prop_assert_eq!(events.next_seq(), first);
        prop_assert_eq!(events.end_seq(), next);
        let seqs: Vec<u64> = events.map(|(s, _)| s).collect();
        prop_assert_eq!(seqs, (first..next).collect::<Vec<_>>());
        prop_assert_eq!(
            kv.events_since(next + 1).err(),
            Some(EventError::FutureSeq { requested: next + 1, next })
        );
    }
}

/// The same workload with the ring on and off: events change nothing else.
#[test]
fn events_off_takes_no_storage_and_records_nothing() {
    let off = config(0);
    let on = config(8);
    assert!(on.storage_words() > off.storage_words());
    assert_eq!(
        on.storage_words() - off.storage_words(),
        8 * (5 + BS as usize / 2) + BLOCKS as usize
    );
    assert_eq!(
        config(8).without_prefix_cache().storage_words(),
        off.without_prefix_cache().storage_words()
    );
    let mut storage = vec![0u64; off.storage_words()];
    let mut kv = BlockManager::new(off, &mut storage).unwrap();
    let mut slots = [0u32; 16];
    let p = kv.create_with_prompt(0, &[1; 9], &mut slots).unwrap();
    assert_eq!(kv.commit(p.seq, 9).unwrap(), 2);
    assert_eq!(kv.next_event_seq(), 0);
    assert_eq!(kv.events_since(0).unwrap().count(), 0);
}

#[test]
fn a_chain_is_stored_parent_first_and_a_clear_is_one_event() {
    let mut storage = vec![0u64; config(16).storage_words()];
    let mut kv = BlockManager::new(config(16), &mut storage).unwrap();
    let mut slots = [0u32; 16];
    let prompt: Vec<u32> = (0..9).collect();
    let p = kv.create_with_prompt(3, &prompt, &mut slots).unwrap();
    kv.commit(p.seq, 9).unwrap();
    let events: Vec<_> = kv.events_since(0).unwrap().collect();
    let [(0, KvEvent::Stored(a)), (1, KvEvent::Stored(b))] = events[..] else {
        panic!("two stored events, got {events:?}");
    };
    assert_eq!((a.parent, a.tokens, a.namespace), (None, &prompt[..4], 3));
    assert_eq!(
        (b.parent, b.tokens, b.parent_hash),
        (Some(a.block), &prompt[4..8], a.hash)
    );
    let chain = [a.hash, b.hash];
    // Held blocks cannot be cleared: nothing happens.
    assert_eq!(kv.clear_prefix_cache(), 0);
    assert_eq!(kv.next_event_seq(), 2);
    kv.release(p.seq).unwrap();
    assert_eq!(kv.clear_prefix_cache(), 2);
    let events: Vec<_> = kv.events_since(2).unwrap().collect();
    assert_eq!(events, [(2, KvEvent::Cleared)]);
    // The same prompt in a fresh manager with the same key: the same hashes.
    let mut storage2 = vec![0u64; config(16).storage_words()];
    let mut kv2 = BlockManager::new(config(16), &mut storage2).unwrap();
    let p = kv2.create_with_prompt(3, &prompt, &mut slots).unwrap();
    kv2.commit(p.seq, 9).unwrap();
    let hashes: Vec<u64> = kv2
        .events_since(0)
        .unwrap()
        .filter_map(|(_, e)| match e {
            KvEvent::Stored(s) => Some(s.hash),
            _ => None,
        })
        .collect();
    assert_eq!(hashes, chain);
}
