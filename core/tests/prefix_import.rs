//! Exporting the prefix cache's registered blocks and importing them into another
//! manager (what a persistent prefix cache does across runs), scenario by scenario and
//! against random workloads.

mod common;

use kvpage_core::{BlockManager, Config, ImportError, NamespaceQuota, Priority, SeqError};
use proptest::prelude::*;

const BS: u32 = 4;

fn config(num_blocks: u32) -> Config {
    Config {
        num_blocks,
        block_size: BS,
        max_seqs: 4,
        max_blocks_per_seq: 8,
        instance: 1,
        hash_key: 0x5eed,
        prefix_cache: true,
        max_position_runs: 4,
        max_namespaces: 2,
        event_capacity: 0,
    }
}

/// One registered block, owned.
#[derive(Debug, Clone, PartialEq)]
struct Exported {
    block: u32,
    namespace: u64,
    parent: Option<u32>,
    tokens: Vec<u32>,
    priority: Priority,
}

/// Every reachable registered block, parents before children.
fn export(kv: &BlockManager<'_>) -> Vec<Exported> {
    let all: Vec<Exported> = (0..kv.config().num_blocks)
        .filter_map(|b| {
            kv.registered_block(b).map(|r| Exported {
                block: b,
                namespace: r.namespace,
                parent: r.parent,
                tokens: r.tokens.to_vec(),
                priority: r.priority,
            })
        })
        .collect();
    let mut out: Vec<Exported> = Vec::new();
    let mut placed = vec![false; kv.config().num_blocks as usize];
    // Depth by depth: a block goes once its parent went (at most one pass per depth).
    while out.len() < all.len() {
        let before = out.len();
        for e in &all {
            if !placed[e.block as usize] && e.parent.is_none_or(|p| placed[p as usize]) {
                placed[e.block as usize] = true;
                out.push(e.clone());
            }
        }
        assert!(
            out.len() > before,
            "a registered block's parent is not reachable"
        );
    }
    out
}

/// Imports `blocks` in order into `kv`, translating parents; returns how many were
/// fresh, and stops at the first refusal.
fn import(kv: &mut BlockManager<'_>, blocks: &[Exported]) -> Result<u32, ImportError> {
    let mut map = std::collections::HashMap::new();
    let mut fresh = 0;
    for e in blocks {
        let parent = e.parent.map(|p| map[&p]);
        let got = kv.import_block(e.namespace, parent, &e.tokens, e.priority)?;
        fresh += u32::from(got.fresh);
        map.insert(e.block, got.block);
    }
    Ok(fresh)
}

/// Runs `tokens` through a sequence of `ns` (create, commit all, release).
fn cache(kv: &mut BlockManager<'_>, ns: u64, p: Priority, tokens: &[u32]) -> Result<u32, SeqError> {
    let mut slots = [0u32; 64];
    let start = kv.create_with_prompt_at(ns, p, tokens, &mut slots)?;
    kv.commit(start.seq, tokens.len() as u32)?;
    kv.release(start.seq)?;
    Ok(start.reused_tokens)
}

fn prompt(base: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| base * 1000 + i).collect()
}

#[test]
fn an_imported_cache_serves_the_same_prefixes() {
    let mut a_words = vec![0u64; config(16).storage_words()];
    let mut a = BlockManager::new(config(16), &mut a_words).unwrap();
    let system = prompt(1, 9);
    let mut branch = system[..8].to_vec();
    branch.extend(prompt(2, 5));
    cache(&mut a, 0, Priority::Pinned, &system).unwrap();
    cache(&mut a, 0, Priority::Normal, &branch).unwrap();
    cache(&mut a, 7, Priority::Low, &system).unwrap();
    // A live sequence's registered blocks are exported too.
    let mut slots = [0u32; 64];
    let live = a
        .create_with_prompt(7, &prompt(3, 13), &mut slots)
        .unwrap()
        .seq;
    a.commit(live, 13).unwrap();
    let blocks = export(&a);
    // system: 2 blocks; branch adds 1 below them; namespace 7: 2 + 3.
    assert_eq!(blocks.len(), 2 + 1 + 2 + 3);
    assert!(blocks
        .iter()
        .any(|e| !a.registered_block(e.block).unwrap().cached));

    let mut b_words = vec![0u64; config(16).storage_words()];
    let mut b = BlockManager::new(config(16), &mut b_words).unwrap();
    assert_eq!(import(&mut b, &blocks), Ok(8));
    assert_eq!(b.stats().cached_blocks, 8);
    assert_eq!(b.stats().used_blocks, 0);
    assert_eq!(b.pinned_blocks(), 2);
    for (ns, p) in [
        (0, &system),
        (0, &branch),
        (7, &system),
        (7, &prompt(3, 13)),
    ] {
        // As deep; idle (evictable) wherever the original's were, and the live
        // sequence's blocks too: no sequence holds an imported block.
        let (hit, there) = (b.prefix_lookup(ns, p), a.prefix_lookup(ns, p));
        assert_eq!(hit.tokens, there.tokens, "namespace {ns}");
        assert!(hit.idle_blocks >= there.idle_blocks, "namespace {ns}");
    }
    // Namespaces never share: namespace 0's blocks are no hit for namespace 3.
    assert_eq!(b.prefix_lookup(3, &system).tokens, 0);
    // The same hashes on both sides (same key): a router's index matches.
    let again = export(&b);
    let hashes = |kv: &BlockManager<'_>, e: &[Exported]| -> Vec<u64> {
        let mut h: Vec<u64> = e
            .iter()
            .map(|x| kv.registered_block(x.block).unwrap().hash)
            .collect();
        h.sort_unstable();
        h
    };
    assert_eq!(hashes(&a, &blocks), hashes(&b, &again));
    // Importing twice registers nothing new.
    assert_eq!(import(&mut b, &blocks), Ok(0));
    assert_eq!(b.stats().cached_blocks, 8);
}

#[test]
fn refused_imports_change_nothing() {
    let mut words = vec![0u64; config(4).storage_words()];
    let mut kv = BlockManager::new(config(4), &mut words).unwrap();
    let t = prompt(1, 4);
    let first = kv.import_block(0, None, &t, Priority::Normal).unwrap();
    assert!(first.fresh);
    let before = (kv.stats(), kv.importable_blocks(0));
    assert_eq!(
        kv.import_block(0, None, &t[..3], Priority::Normal),
        Err(ImportError::WrongTokenCount {
            got: 3,
            expected: BS
        })
    );
    // Not registered, out of range, or another namespace's block: no parent.
    for (ns, parent) in [(0, 3), (0, 99), (1, first.block)] {
        assert_eq!(
            kv.import_block(ns, Some(parent), &t, Priority::Normal),
            Err(ImportError::BadParent { block: parent })
        );
    }
    assert_eq!((kv.stats(), kv.importable_blocks(0)), before);
    // Fill the pool: the next import is refused, and nothing cached is evicted.
    let mut parent = first.block;
    for k in 2..5 {
        parent = kv
            .import_block(0, Some(parent), &prompt(k, 4), Priority::Normal)
            .unwrap()
            .block;
    }
    assert_eq!(kv.importable_blocks(0), 0);
    let full = kv.stats();
    assert_eq!(
        kv.import_block(0, None, &prompt(9, 4), Priority::Normal),
        Err(ImportError::OutOfBlocks)
    );
    assert_eq!(kv.stats(), full);
    assert_eq!(
        kv.cached_prefix_tokens(0, &prompt_chain(&[1, 2, 3, 4], 1)),
        16
    );

    // Without a prefix cache nothing can be imported.
    let off = Config {
        prefix_cache: false,
        ..config(4)
    };
    let mut off_words = vec![0u64; off.storage_words()];
    let mut off_kv = BlockManager::new(off, &mut off_words).unwrap();
    assert_eq!(
        off_kv.import_block(0, None, &t, Priority::Normal),
        Err(ImportError::PrefixCacheOff)
    );
    assert!(off_kv.registered_block(0).is_none());
}

/// The blocks `prompt(k, 4)` for each `k`, then `tail` more tokens.
fn prompt_chain(ks: &[u32], tail: u32) -> Vec<u32> {
    let mut v: Vec<u32> = ks.iter().flat_map(|&k| prompt(k, 4)).collect();
    v.extend(prompt(77, tail));
    v
}

#[test]
fn quotas_bound_imports_and_reservations_are_kept() {
    let mut words = vec![0u64; config(6).storage_words()];
    let mut kv = BlockManager::new(config(6), &mut words).unwrap();
    kv.set_namespace_quota(
        1,
        NamespaceQuota {
            max_blocks: 2,
            reserved_blocks: 0,
        },
    )
    .unwrap();
    kv.set_namespace_quota(
        2,
        NamespaceQuota {
            max_blocks: 6,
            reserved_blocks: 3,
        },
    )
    .unwrap();
    let a = kv
        .import_block(1, None, &prompt(1, 4), Priority::Normal)
        .unwrap()
        .block;
    kv.import_block(1, Some(a), &prompt(2, 4), Priority::Normal)
        .unwrap();
    assert_eq!(kv.importable_blocks(1), 0);
    assert_eq!(
        kv.import_block(1, None, &prompt(3, 4), Priority::Normal),
        Err(ImportError::QuotaExceeded)
    );
    // Namespace 0 may take 4 - 3 reserved for namespace 2 = 1 block.
    assert_eq!(kv.importable_blocks(0), 1);
    kv.import_block(0, None, &prompt(4, 4), Priority::Normal)
        .unwrap();
    assert_eq!(
        kv.import_block(0, None, &prompt(5, 4), Priority::Normal),
        Err(ImportError::OutOfBlocks)
    );
    assert_eq!(kv.importable_blocks(2), 3);
}

#[test]
fn imported_chains_yield_to_live_traffic_deepest_block_first() {
    let mut words = vec![0u64; config(6).storage_words()];
    let mut kv = BlockManager::new(config(6), &mut words).unwrap();
    // A chain of three imported blocks, then live traffic caches two blocks of its own.
    let mut parent = None;
    for k in 1..4 {
        parent = Some(
            kv.import_block(0, parent, &prompt(k, 4), Priority::Normal)
                .unwrap()
                .block,
        );
    }
    let live = prompt_chain(&[8, 9], 1);
    cache(&mut kv, 0, Priority::Normal, &live).unwrap();
    // One block evicted: the imported chain's tail, not the live prompt's blocks.
    assert_eq!(kv.evict_cached(1), 1);
    assert_eq!(kv.cached_prefix_tokens(0, &prompt_chain(&[1, 2, 3], 1)), 8);
    assert_eq!(kv.cached_prefix_tokens(0, &live), 8);
    assert_eq!(kv.evict_cached(2), 2);
    assert_eq!(kv.cached_prefix_tokens(0, &prompt_chain(&[1, 2, 3], 1)), 0);
    assert_eq!(kv.cached_prefix_tokens(0, &live), 8);
}

#[test]
fn a_hit_on_an_imported_block_verifies_every_token() {
    let mut words = vec![0u64; config(4).storage_words()];
    let mut kv = BlockManager::new(config(4), &mut words).unwrap();
    let b = kv
        .import_block(0, None, &prompt(1, 4), Priority::Normal)
        .unwrap()
        .block;
    let mut other = prompt(1, 5);
    other[3] += 1;
    assert_eq!(kv.cached_prefix_tokens(0, &other), 0);
    // A hit takes the imported block itself into the sequence.
    let mut slots = [0u32; 8];
    let start = kv.create_with_prompt(0, &prompt(1, 5), &mut slots).unwrap();
    assert_eq!(start.reused_tokens, 4);
    assert_eq!(kv.blocks(start.seq).unwrap()[0], b);
}

/// A random workload: prompts from a few shared prefixes in two namespaces, some kept
/// live, at random priorities.
#[derive(Debug, Clone)]
struct Workload {
    blocks: u32,
    prompts: Vec<(u64, u8, u8, u8, bool, u8)>,
}

fn workload() -> impl Strategy<Value = Workload> {
    (
        4u32..24,
        prop::collection::vec(
            (0u64..2, 0u8..3, 0u8..14, 0u8..10, any::<bool>(), 0u8..4),
            1..common::max_ops(24),
        ),
    )
        .prop_map(|(blocks, prompts)| Workload { blocks, prompts })
}

proptest! {
    #![proptest_config(common::proptest_config(128))]

    /// Export then import into an empty manager of the same size: every reachable
    /// registered block comes back (none fresh twice), every lookup hits as deep as on
    /// the original, and the counts add up.
    #[test]
    fn export_then_import_preserves_every_lookup(w in workload()) {
        let cfg = config(w.blocks);
        let mut a_words = vec![0u64; cfg.storage_words()];
        let mut a = BlockManager::new(cfg, &mut a_words).unwrap();
        let mut slots = [0u32; 64];
        let mut asked = Vec::new();
        for (k, &(ns, group, shared, own, keep, level)) in w.prompts.iter().enumerate() {
            let mut p = prompt(u32::from(group) + 1, u32::from(shared));
            p.extend(prompt(100 + k as u32, u32::from(own) + 1));
            let priority = Priority::from_level(level).unwrap();
            let Ok(start) = a.create_with_prompt_at(ns, priority, &p, &mut slots) else { continue };
            a.commit(start.seq, p.len() as u32).unwrap();
            if !keep {
                a.release(start.seq).unwrap();
            }
            asked.push((ns, p));
        }
        let blocks = export(&a);
        let mut b_words = vec![0u64; cfg.storage_words()];
        let mut b = BlockManager::new(cfg, &mut b_words).unwrap();
        prop_assert_eq!(import(&mut b, &blocks), Ok(blocks.len() as u32));
        prop_assert_eq!(b.stats().cached_blocks, blocks.len() as u32);
        prop_assert_eq!(b.stats().free_blocks, w.blocks - blocks.len() as u32);
        for (ns, p) in &asked {
            prop_assert_eq!(b.prefix_lookup(*ns, p).tokens, a.prefix_lookup(*ns, p).tokens);
        }
        let pinned = blocks.iter().filter(|e| e.priority == Priority::Pinned).count() as u32;
        prop_assert_eq!(b.pinned_blocks(), pinned);
        prop_assert_eq!(import(&mut b, &blocks), Ok(0));
    }
}
