//! Behaviour of the manager on hand-computed cases: errors on bad input (state unchanged),
//! copy-on-write, prefix reuse, namespaces, eviction order.

use kvpage_core::{
    BlockCopy, BlockManager, Config, DType, Geometry, GeometryError, HostPool, InitError, SeqError,
    Stats,
};

const CONFIG: Config = Config {
    num_blocks: 8,
    block_size: 4,
    max_seqs: 4,
    max_blocks_per_seq: 4,
    instance: 9,
    hash_key: 0,
    prefix_cache: true,
    max_position_runs: 4,
    max_namespaces: 0,
    event_capacity: 0,
};

fn with_manager(f: impl FnOnce(&mut BlockManager<'_>)) {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    f(&mut kv);
}

fn prompt(len: u32) -> Vec<u32> {
    (0..len).map(|i| 10 + i).collect()
}

#[test]
fn geometry_sizes_and_rejections() {
    // 7B: 32 layers, 32 heads, 128 dims, f16: 0.5 MiB per token.
    let g = Geometry::new(32, 32, 128, 16, DType::F16).unwrap();
    assert_eq!(g.bytes_per_token(), 2 * 32 * 32 * 128 * 2);
    assert_eq!(g.bytes_per_block(), g.bytes_per_token() * 16);
    assert_eq!(g.blocks_in(g.bytes_per_block() * 3 + 1), 3);
    assert_eq!(g.tile_offset(1, 1, 2), ((2 + 1) * 32 + 2) * 16 * 128);
    for zero in [(0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0)] {
        assert_eq!(
            Geometry::new(zero.0, zero.1, zero.2, zero.3, DType::F32),
            Err(GeometryError::ZeroDimension)
        );
    }
    assert_eq!(
        Geometry::new(u32::MAX, u32::MAX, u32::MAX, 2, DType::F32),
        Err(GeometryError::Overflow)
    );
}

#[test]
fn config_for_a_geometry() {
    let g = Geometry::new(2, 2, 8, 16, DType::F16).unwrap();
    let config = Config::for_geometry(&g, 64, 4, 250);
    assert_eq!(
        config,
        Config {
            num_blocks: 64,
            block_size: 16,
            max_seqs: 4,
            max_blocks_per_seq: 16,
            instance: 0,
            hash_key: 0,
            prefix_cache: true,
            max_position_runs: 4,
            max_namespaces: 0,
            event_capacity: 0,
        }
    );
    assert_eq!(Config::for_geometry(&g, 64, 4, 256).max_blocks_per_seq, 16);
    assert_eq!(Config::for_geometry(&g, 64, 4, 257).max_blocks_per_seq, 17);
    let set = config
        .with_instance(7)
        .with_hash_key(99)
        .without_prefix_cache();
    assert_eq!(
        (set.instance, set.hash_key, set.prefix_cache),
        (7, 99, false)
    );
    assert_eq!(Config { ..set }, set.with_instance(7));
}

#[test]
fn config_rejections() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let zero = Config {
        max_seqs: 0,
        ..CONFIG
    };
    assert_eq!(
        BlockManager::new(zero, &mut storage).err(),
        Some(InitError::ZeroSize)
    );
    let huge = Config {
        num_blocks: u32::MAX,
        block_size: 16,
        ..CONFIG
    };
    assert_eq!(
        BlockManager::new(huge, &mut storage).err(),
        Some(InitError::TooLarge)
    );
    let short = CONFIG.storage_words() - 1;
    assert_eq!(
        BlockManager::new(CONFIG, &mut storage[..short]).err(),
        Some(InitError::StorageTooSmall {
            needed: CONFIG.storage_words(),
            got: short
        })
    );
}

#[test]
fn storage_without_prefix_cache_leaves_out_every_prefix_array() {
    let with = Config {
        num_blocks: 1024,
        block_size: 16,
        max_seqs: 64,
        max_blocks_per_seq: 256,
        instance: 1,
        hash_key: 0,
        prefix_cache: true,
        max_position_runs: 4,
        max_namespaces: 0,
        event_capacity: 0,
    };
    let without = Config {
        prefix_cache: false,
        ..with
    };
    // Pool: free bitset (32 + 1 u32 = 17 words), refcount and fill (2 × 512 words), the
    // namespace table of slot 0 alone (limit, reserve, charged: 3 × 1 word).
    let pool = 17 + 2 * 512 + 3;
    // Sequences: free bitset (3 u32 = 2 words), table 64 × 256 u32, 9 u32 + 2 u64 a row,
    // 4 position runs (one word each) a row.
    let seqs = 2 + 64 * 256 / 2 + 9 * 32 + 2 * 64 + 4 * 64;
    // Prefix cache: hash and namespace (2 × 1024 words), 6 u32 a block (3072 words),
    // 16 token ids a block (8192 words), hash table of 2048 u32 (1024 words), eviction
    // lists: 3 u32 a block (1536 words) and 4 lists' head, tail, length (3 × 2 words).
    let prefix = 2 * 1024 + 6 * 512 + 1024 * 16 / 2 + 2048 / 2 + 3 * 512 + 3 * 2;
    assert_eq!((pool, seqs, prefix), (1044, 8866, 15878));
    assert_eq!(with.storage_words(), pool + seqs + prefix);
    assert_eq!(without.storage_words(), pool + seqs);
    // Per block: 132 bytes of metadata with the cache, 8 without.
    assert_eq!((pool + prefix) * 8 / 1024, 132);
    assert_eq!(pool * 8 / 1024, 8);
    // Exactly that much storage builds either manager.
    for config in [with, without] {
        let mut storage = vec![0u64; config.storage_words()];
        assert!(BlockManager::new(config, &mut storage).is_ok());
    }
}

#[test]
fn without_prefix_cache_prompts_work_and_never_hit() {
    let config = Config {
        prefix_cache: false,
        ..CONFIG
    };
    let mut storage = vec![0u64; config.storage_words()];
    let mut kv = BlockManager::new(config, &mut storage).unwrap();
    let mut slots = [0u32; 16];
    let p = prompt(10);
    let a = kv.create_with_prompt(0, &p, &mut slots).unwrap();
    assert_eq!((a.reused_tokens, a.appended.new_blocks), (0, 3));
    assert_eq!(&slots[..10], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert_eq!(kv.commit(a.seq, 10), Ok(0));
    assert!(kv.commit(a.seq, 11).is_err(), "arguments are checked");
    assert!(!kv.is_registered(0));
    assert_eq!(kv.cached_prefix_tokens(0, &p), 0);
    let b = kv.create_with_prompt(0, &p, &mut slots).unwrap();
    assert_eq!(b.reused_tokens, 0);
    assert_eq!(kv.blocks(b.seq).unwrap(), &[3, 4, 5]);
    // Forks still share, with copy-on-write of the partial block.
    let c = kv.fork(a.seq).unwrap();
    let step = kv.append_tokens(c, &[1], &mut slots).unwrap();
    assert_eq!(step.copy, Some(BlockCopy { src: 2, dst: 6 }));
    for s in [a.seq, b.seq, c] {
        kv.release(s).unwrap();
    }
    let s = kv.stats();
    assert_eq!(
        (s.free_blocks, s.cached_blocks, s.prefix_hit_tokens),
        (8, 0, 0)
    );
    assert_eq!(kv.evict_cached(8), 0);
}

#[test]
fn stale_foreign_and_double_release() {
    with_manager(|kv| {
        let mut slots = [0u32; 8];
        let a = kv.create(0).unwrap();
        kv.append(a, 5, &mut slots).unwrap();
        let before = kv.stats();
        let foreign = kvpage_core::SeqId::from_parts(a.index(), a.generation(), 1);
        assert_eq!(
            kv.append(foreign, 1, &mut slots),
            Err(SeqError::ForeignHandle)
        );
        assert_eq!(kv.release(foreign), Err(SeqError::ForeignHandle));
        let forged = kvpage_core::SeqId::from_parts(99, 0, CONFIG.instance);
        assert_eq!(kv.len(forged), Err(SeqError::StaleHandle));
        assert_eq!(kv.stats(), before);
        kv.release(a).unwrap();
        assert_eq!(kv.release(a), Err(SeqError::StaleHandle));
        // The row is reused by a new sequence; the old handle still cannot reach it.
        let b = kv.create(0).unwrap();
        assert_eq!(b.index(), a.index());
        assert_eq!(kv.append(a, 1, &mut slots), Err(SeqError::StaleHandle));
        assert_eq!(kv.len(b), Ok(0));
    });
}

#[test]
fn too_long_full_pool_and_short_buffers_change_nothing() {
    with_manager(|kv| {
        let mut slots = [0u32; 32];
        let a = kv.create(0).unwrap();
        kv.append(a, 10, &mut slots).unwrap();
        let before = (kv.stats(), kv.blocks(a).unwrap().to_vec());
        assert_eq!(
            kv.append(a, 7, &mut slots),
            Err(SeqError::TooLong {
                tokens: 17,
                max_tokens: 16
            })
        );
        assert_eq!(
            kv.append(a, 3, &mut slots[..2]),
            Err(SeqError::SlotBufferTooSmall { needed: 3, got: 2 })
        );
        assert_eq!((kv.stats(), kv.blocks(a).unwrap().to_vec()), before);
        // Fill the pool: 3 blocks used by `a`, 4 by `b`, one left.
        let b = kv.create(0).unwrap();
        kv.append(b, 16, &mut slots).unwrap();
        let c = kv.create(0).unwrap();
        let before = kv.stats();
        assert_eq!(before.free_blocks, 1);
        assert_eq!(
            kv.append(c, 5, &mut slots),
            Err(SeqError::OutOfBlocks {
                needed: 2,
                available: 1
            })
        );
        assert_eq!(kv.len(c), Ok(0));
        assert_eq!(kv.stats(), before);
        let long = prompt(9);
        assert_eq!(
            kv.create_with_prompt(0, &long, &mut slots).err(),
            Some(SeqError::OutOfBlocks {
                needed: 3,
                available: 1
            })
        );
        assert_eq!(kv.stats(), before);
        let d = kv.create(0).unwrap();
        assert_eq!(kv.create(0), Err(SeqError::NoFreeSequence));
        assert_eq!(kv.fork(d), Err(SeqError::NoFreeSequence));
        assert_eq!(
            kv.create_with_prompt(0, &[1], &mut slots).err(),
            Some(SeqError::NoFreeSequence)
        );
        assert_eq!(kv.stats().live_seqs, 4);
    });
}

#[test]
fn fork_then_append_copies_the_shared_partial_block() {
    with_manager(|kv| {
        let mut slots = [0u32; 8];
        let a = kv.create(0).unwrap();
        kv.append(a, 6, &mut slots).unwrap(); // blocks 0 (full) and 1 (2 of 4 tokens)
        let b = kv.fork(a).unwrap();
        assert_eq!(kv.blocks(b).unwrap(), &[0, 1]);
        assert_eq!(kv.refcount(1), Some(2));
        assert_eq!(kv.stats().blocks_saved_by_sharing, 2);
        let appended = kv.append(b, 1, &mut slots).unwrap();
        assert_eq!(appended.copy, Some(BlockCopy { src: 1, dst: 2 }));
        assert_eq!(slots[0], 2 * 4 + 2);
        assert_eq!(kv.blocks(b).unwrap(), &[0, 2]);
        assert_eq!(kv.refcount(1), Some(1));
        // `a` now holds block 1 alone: appending writes in place.
        let appended = kv.append(a, 1, &mut slots).unwrap();
        assert_eq!(appended.copy, None);
        assert_eq!(slots[0], 4 + 2);
        let s: Stats = kv.stats();
        assert_eq!(
            (
                s.used_blocks,
                s.tokens_stored,
                s.token_slots,
                s.logical_tokens
            ),
            (3, 4 + 3 + 3, 12, 14)
        );
    });
}

/// Decoding token by token stores every token's id, also the ones that open a new
/// block (the single-token new-block path), so the decoded blocks, once committed,
/// serve a later prompt that repeats them.
#[test]
fn decoded_tokens_enter_the_prefix_cache_one_by_one() {
    with_manager(|kv| {
        let mut slots = [0u32; 16];
        let p = prompt(13);
        let a = kv.create_with_prompt(5, &p[..2], &mut slots).unwrap();
        for (t, &id) in p.iter().enumerate().take(12).skip(2) {
            let step = kv.append_tokens(a.seq, &[id], &mut slots).unwrap();
            assert_eq!(step.new_blocks, u32::from(t % 4 == 0), "token {t}");
            assert_eq!(slots[0] % 4, t as u32 % 4, "token {t}");
        }
        assert_eq!(kv.commit(a.seq, 12), Ok(3));
        assert_eq!(kv.cached_prefix_tokens(5, &p), 12);
        let b = kv.create_with_prompt(5, &p, &mut slots).unwrap();
        assert_eq!(b.reused_tokens, 12);
        assert_eq!(
            kv.blocks(b.seq).unwrap()[..3],
            kv.blocks(a.seq).unwrap()[..3]
        );
    });
}

#[test]
fn prefix_reuse_namespaces_and_lru_eviction() {
    with_manager(|kv| {
        let mut slots = [0u32; 16];
        let p = prompt(10); // two full blocks + 2 tokens
        let a = kv.create_with_prompt(5, &p, &mut slots).unwrap();
        assert_eq!(a.reused_tokens, 0);
        assert_eq!(&slots[..10], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11][..10]);
        // Nothing is shared before the K/V is committed: a reader would see unwritten K/V.
        assert_eq!(kv.cached_prefix_tokens(5, &p), 0);
        assert!(!kv.is_registered(0));
        // Committing 7 tokens offers only the one full block among them.
        assert_eq!(kv.commit(a.seq, 7), Ok(1));
        assert_eq!(kv.cached_prefix_tokens(5, &p), 4);
        assert_eq!(kv.commit(a.seq, 10), Ok(1));
        assert_eq!(kv.commit(a.seq, 10), Ok(0));
        assert_eq!(
            kv.commit(a.seq, 11),
            Err(SeqError::BeyondLength {
                requested: 11,
                len: 10
            })
        );
        let b = kv.create_with_prompt(5, &p, &mut slots).unwrap();
        assert_eq!(b.reused_tokens, 8);
        assert_eq!(kv.blocks(b.seq).unwrap(), &[0, 1, 3]);
        assert_eq!(slots[..2], [12, 13]);
        // Another namespace never shares.
        let c = kv.create_with_prompt(6, &p, &mut slots).unwrap();
        assert_eq!(c.reused_tokens, 0);
        kv.commit(c.seq, 10).unwrap();
        assert_eq!(kv.stats().prefix_hit_tokens, 8);
        // A prompt of exactly two blocks reuses only one, so one token is computed.
        let d = kv.create_with_prompt(5, &p[..8], &mut slots).unwrap();
        assert_eq!(d.reused_tokens, 4);
        for s in [a.seq, b.seq, c.seq, d.seq] {
            kv.release(s).unwrap();
        }
        // Blocks 0, 1 (ns 5) and 4, 5 (ns 6) are cached; 7 free ones were never registered.
        let s = kv.stats();
        assert_eq!((s.cached_blocks, s.free_blocks, s.used_blocks), (4, 4, 0));
        // Allocation prefers never-registered blocks: a 16-token sequence takes the 4 free
        // ones and leaves the cache alone.
        let e = kv.create(0).unwrap();
        kv.append(e, 16, &mut slots).unwrap();
        assert_eq!(kv.blocks(e).unwrap(), &[2, 3, 6, 7]);
        assert_eq!(kv.stats().cached_blocks, 4);
        // Next allocation evicts the least recently used cached block. Reference counts
        // reached zero in the order 1 (when `b` left), 4, 5 (`c`), 0 (`d`): block 1 goes.
        let f = kv.create(0).unwrap();
        kv.append(f, 1, &mut slots).unwrap();
        assert_eq!(kv.blocks(f).unwrap(), &[1]);
        // The ns-5 chain now stops after block 0.
        kv.release(e).unwrap();
        let g = kv.create_with_prompt(5, &p, &mut slots).unwrap();
        assert_eq!(g.reused_tokens, 4);
        // The ns-6 chain still hits.
        let h = kv.create_with_prompt(6, &p[..9], &mut slots).unwrap();
        assert_eq!(h.reused_tokens, 8);
    });
}

/// Six blocks of four tokens, room for sequences of eight blocks: two cached 3-block
/// prompts fill the pool.
const TIGHT: Config = Config {
    num_blocks: 6,
    max_blocks_per_seq: 8,
    ..CONFIG
};

/// Two 12-token prompts (3 full blocks each) and, for each, the same prompt plus one
/// token: the query whose whole 3 blocks `cached_prefix_tokens` may report.
fn two_prompts() -> ([Vec<u32>; 2], [Vec<u32>; 2]) {
    let a: Vec<u32> = (0..12).map(|i| 10 + i).collect();
    let b: Vec<u32> = (0..12).map(|i| 100 + i).collect();
    let query = |p: &Vec<u32>| [&p[..], &[0]].concat();
    ([query(&a), query(&b)], [a, b])
}

/// Caches `prompt` (creates, commits every block) and returns the sequence's blocks.
fn cache_prompt(kv: &mut BlockManager<'_>, prompt: &[u32]) -> (kvpage_core::SeqId, Vec<u32>) {
    let mut slots = [0u32; 16];
    let seq = kv.create_with_prompt(0, prompt, &mut slots).unwrap().seq;
    assert_eq!(kv.commit(seq, prompt.len() as u32), Ok(3));
    (seq, kv.blocks(seq).unwrap().to_vec())
}

#[test]
fn eviction_under_pressure_takes_chain_tails_first() {
    let mut storage = vec![0u64; TIGHT.storage_words()];
    let mut kv = BlockManager::new(TIGHT, &mut storage).unwrap();
    let (queries, [pa, pb]) = two_prompts();
    let (a, blocks_a) = cache_prompt(&mut kv, &pa);
    kv.release(a).unwrap();
    let (b, blocks_b) = cache_prompt(&mut kv, &pb);
    kv.release(b).unwrap();
    assert_eq!((blocks_a, blocks_b), (vec![0, 1, 2], vec![3, 4, 5]));
    assert_eq!(kv.stats().cached_blocks, 6);
    // A sequence growing one block at a time evicts A's chain from its tail (2, 1, 0),
    // then B's (5, 4, 3): each prompt keeps a shorter, still reachable prefix.
    let c = kv.create(1).unwrap();
    let mut slots = [0u32; 4];
    let expected = [
        (2, [8, 12]),
        (1, [4, 12]),
        (0, [0, 12]),
        (5, [0, 8]),
        (4, [0, 4]),
        (3, [0, 0]),
    ];
    for (evicted, [cached_a, cached_b]) in expected {
        kv.append(c, 4, &mut slots).unwrap();
        assert_eq!(kv.blocks(c).unwrap().last(), Some(&evicted));
        assert_eq!(kv.cached_prefix_tokens(0, &queries[0]), cached_a);
        assert_eq!(kv.cached_prefix_tokens(0, &queries[1]), cached_b);
        // Every cached block is still reachable: none is held by the pool in vain.
        let reachable = (cached_a + cached_b) / TIGHT.block_size;
        assert_eq!(kv.stats().cached_blocks, reachable);
    }
}

#[test]
fn truncate_and_swap_out_also_cache_tails_first() {
    let mut storage = vec![0u64; TIGHT.storage_words()];
    let mut kv = BlockManager::new(TIGHT, &mut storage).unwrap();
    let mut host_storage = vec![0u32; HostPool::storage_words(4)];
    let mut host = HostPool::new(4, TIGHT.instance, &mut host_storage).unwrap();
    let (queries, [pa, pb]) = two_prompts();
    let (a, _) = cache_prompt(&mut kv, &pa);
    kv.truncate(a, 0).unwrap();
    let (b, _) = cache_prompt(&mut kv, &pb);
    let mut moves = [BlockCopy { src: 0, dst: 0 }; 3];
    assert_eq!(kv.swap_out(b, &mut host, &mut moves), Ok(3));
    // Host blocks are still assigned in logical order.
    let to: Vec<u32> = moves.iter().map(|m| m.dst).collect();
    assert_eq!(to, [0, 1, 2]);
    for [cached_a, cached_b] in [[8, 12], [4, 12], [0, 12], [0, 8], [0, 4], [0, 0]] {
        assert_eq!(kv.evict_cached(1), 1);
        assert_eq!(kv.cached_prefix_tokens(0, &queries[0]), cached_a);
        assert_eq!(kv.cached_prefix_tokens(0, &queries[1]), cached_b);
    }
}

#[test]
fn prefix_hits_under_any_hash_key() {
    for hash_key in [0, 1, 0x9e37_79b9_7f4a_7c15, u64::MAX] {
        let config = Config { hash_key, ..CONFIG };
        let mut storage = vec![0u64; config.storage_words()];
        let mut kv = BlockManager::new(config, &mut storage).unwrap();
        let mut slots = [0u32; 16];
        let p = prompt(13);
        let a = kv.create_with_prompt(2, &p, &mut slots).unwrap().seq;
        assert_eq!(kv.commit(a, 13), Ok(3));
        assert_eq!(kv.cached_prefix_tokens(2, &p), 12);
        let b = kv.create_with_prompt(2, &p, &mut slots).unwrap();
        assert_eq!(b.reused_tokens, 12);
        assert_eq!(&kv.blocks(b.seq).unwrap()[..3], &kv.blocks(a).unwrap()[..3]);
        assert_eq!(
            kv.cached_prefix_tokens(3, &p),
            0,
            "namespaces still never share"
        );
    }
}

#[test]
fn truncate_rolls_back_and_reregisters() {
    with_manager(|kv| {
        let mut slots = [0u32; 16];
        let p = prompt(9);
        let a = kv.create_with_prompt(0, &p, &mut slots).unwrap().seq;
        kv.commit(a, 9).unwrap();
        assert!(kv.is_registered(0) && kv.is_registered(1));
        kv.truncate(a, 6).unwrap();
        assert_eq!(kv.blocks(a).unwrap(), &[0, 1]);
        assert!(
            !kv.is_registered(1),
            "a partly kept exclusive block leaves the cache"
        );
        // Re-appending the same tokens and committing registers block 1 again, and a new
        // prompt hits it.
        kv.append_tokens(a, &p[6..9], &mut slots).unwrap();
        assert!(!kv.is_registered(1));
        assert_eq!(kv.commit(a, 9), Ok(1));
        assert!(kv.is_registered(1));
        let b = kv.create_with_prompt(0, &p, &mut slots).unwrap();
        assert_eq!(b.reused_tokens, 8);
        assert_eq!(
            kv.truncate(a, 10),
            Err(SeqError::BeyondLength {
                requested: 10,
                len: 9
            })
        );
        kv.truncate(a, 0).unwrap();
        assert_eq!(kv.blocks(a).unwrap(), &[] as &[u32]);
    });
}

#[test]
fn only_blocks_with_known_ids_are_committed() {
    with_manager(|kv| {
        let mut slots = [0u32; 16];
        let a = kv.create(0).unwrap();
        kv.append_tokens(a, &prompt(4), &mut slots).unwrap();
        kv.append(a, 4, &mut slots).unwrap(); // ids of block 1 unknown
        kv.append_tokens(a, &prompt(4), &mut slots).unwrap(); // block 2: after unknown ids
        assert_eq!(
            kv.commit(a, 12),
            Ok(1),
            "only block 0 has known ids from the start"
        );
        assert!(kv.is_registered(0) && !kv.is_registered(1) && !kv.is_registered(2));
        // Rolling back to the known part and appending with ids makes blocks committable.
        kv.truncate(a, 4).unwrap();
        kv.append_tokens(a, &[1, 2, 3, 4], &mut slots).unwrap();
        assert_eq!(kv.commit(a, 8), Ok(1));
        let mut p = prompt(4);
        p.extend_from_slice(&[1, 2, 3, 4, 0]);
        assert_eq!(kv.cached_prefix_tokens(0, &p), 8);
        // A fork shares the committed state; a swap forgets it.
        let b = kv.fork(a).unwrap();
        assert_eq!(kv.commit(b, 8), Ok(0));
    });
}

#[test]
fn shared_manager_serves_threads() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let shared = kvpage_core::SharedManager::new(BlockManager::new(CONFIG, &mut storage).unwrap());
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                let mut slots = [0u32; 2];
                for _ in 0..100 {
                    let mut kv = shared.lock();
                    let s = kv.create(0).unwrap();
                    kv.append(s, 2, &mut slots).unwrap();
                    kv.release(s).unwrap();
                }
            });
        }
    });
    let kv = shared.into_inner();
    assert_eq!(kv.stats().free_blocks, CONFIG.num_blocks);
    assert_eq!(kv.stats().live_seqs, 0);
}
