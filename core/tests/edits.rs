//! Sequence edits and positions: the outcomes the docs promise, case by case (the
//! property tests in `model.rs` check them against a reference model at random).

use kvpage_core::{BlockCopy, BlockManager, Config, PositionRun, RowMove, SeqError};

const CONFIG: Config = Config {
    num_blocks: 32,
    block_size: 4,
    max_seqs: 4,
    max_blocks_per_seq: 8,
    instance: 9,
    hash_key: 0,
    prefix_cache: true,
    max_position_runs: 4,
    max_namespaces: 0,
    event_capacity: 0,
};

fn run(index: u32, position: u32) -> PositionRun {
    PositionRun {
        first_index: index,
        first_position: position,
    }
}

#[test]
fn block_aligned_removal_only_edits_the_table() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    let mut slots = [0u32; 32];
    let s = kv.create(0).unwrap();
    kv.append(s, 14, &mut slots).unwrap();
    let before = kv.blocks(s).unwrap().to_vec();
    let (mut copies, mut moves) = ([BlockCopy { src: 0, dst: 0 }; 4], [RowMove::default(); 8]);
    let edited = kv.remove_range(s, 4, 12, &mut copies, &mut moves).unwrap();
    assert_eq!(
        (edited.copies, edited.moves, edited.released_blocks),
        (0, 0, 2)
    );
    assert_eq!(kv.blocks(s).unwrap(), &[before[0], before[3]]);
    assert_eq!(kv.len(s), Ok(6));
    // Tokens 12 and 13 kept their positions: a gap of 8.
    assert_eq!(kv.position_runs(s).unwrap(), &[run(0, 0), run(4, 12)]);
    assert_eq!((kv.pos_min(s), kv.pos_max(s)), (Ok(Some(0)), Ok(Some(13))));
    // Appends continue from the last position.
    kv.append(s, 1, &mut slots).unwrap();
    assert_eq!(kv.position(s, 6), Ok(14));
    assert_eq!(kv.stats().used_blocks, 2);
}

#[test]
fn unaligned_removal_moves_only_the_rows_it_must() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    let mut slots = [0u32; 32];
    let s = kv.create(0).unwrap();
    kv.append(s, 14, &mut slots).unwrap();
    let b = kv.blocks(s).unwrap().to_vec();
    let (mut copies, mut moves) = ([BlockCopy { src: 0, dst: 0 }; 4], [RowMove::default(); 8]);
    // A multiple of the block size from offset 2: rows 10, 11 of block 2 move into block 0.
    let edited = kv.remove_range(s, 2, 10, &mut copies, &mut moves).unwrap();
    assert_eq!((edited.copies, edited.moves), (0, 1));
    assert_eq!(
        moves[0],
        RowMove {
            src_slot: b[2] * 4 + 2,
            dst_slot: b[0] * 4 + 2,
            count: 2
        }
    );
    assert_eq!(kv.blocks(s).unwrap(), &[b[0], b[3]]);
    // From offset 1 of a block, 8 tokens: the one row before the hole moves into the
    // block holding the rest (cheaper than moving 3 rows the other way).
    let mut s2_words = vec![0u64; CONFIG.storage_words()];
    let mut kv2 = BlockManager::new(CONFIG, &mut s2_words).unwrap();
    let s2 = kv2.create(0).unwrap();
    kv2.append(s2, 16, &mut slots).unwrap();
    let c = kv2.blocks(s2).unwrap().to_vec();
    let edited = kv2.remove_range(s2, 1, 9, &mut copies, &mut moves).unwrap();
    assert_eq!(
        (edited.copies, edited.moves, edited.released_blocks),
        (0, 1, 2)
    );
    assert_eq!(
        moves[0],
        RowMove {
            src_slot: c[0] * 4,
            dst_slot: c[2] * 4,
            count: 1
        }
    );
    assert_eq!(kv2.blocks(s2).unwrap(), &[c[2], c[3]]);
    assert_eq!(kv2.position_runs(s2).unwrap(), &[run(0, 0), run(1, 9)]);
    // One token: every later row shifts within its block, in runs split at block ends.
    let edited = kv.remove_range(s, 1, 2, &mut copies, &mut moves).unwrap();
    assert_eq!(edited.moves, 3);
    let moved: u32 = moves[..3].iter().map(|m| m.count).sum();
    assert_eq!(moved, 4);
    assert_eq!(kv.len(s), Ok(5));
    assert_eq!(kv.blocks(s).unwrap().len(), 2);
    // Too small a move buffer: a typed error and nothing changes.
    let len = kv.len(s).unwrap();
    assert!(matches!(
        kv.remove_range(s, 0, 1, &mut copies, &mut moves[..1]),
        Err(SeqError::MoveBufferTooSmall { .. })
    ));
    assert_eq!(kv.len(s), Ok(len));
    assert_eq!(
        kv.remove_range(s, 3, 2, &mut copies, &mut moves),
        Err(SeqError::BadRange {
            first: 3,
            end: 2,
            len
        })
    );
}

#[test]
fn context_shift_owns_shared_blocks_and_names_the_rotation() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    let mut slots = [0u32; 32];
    let prompt: Vec<u32> = (0..16).collect();
    let s = kv.create_with_prompt(0, &prompt, &mut slots).unwrap().seq;
    kv.commit(s, 16).unwrap();
    let other = kv.fork(s).unwrap();
    let shared = kv.blocks(s).unwrap().to_vec();
    let (mut copies, mut moves) = ([BlockCopy { src: 0, dst: 0 }; 4], [RowMove::default(); 8]);
    // Keep the 4-token "system prompt", drop 4: block-aligned, so no rows move, but the
    // two blocks to rotate are shared with the fork and get copied.
    let shift = kv.context_shift(s, 4, 4, &mut copies, &mut moves).unwrap();
    assert_eq!(
        (shift.rotate_first, shift.rotate_end, shift.delta),
        (4, 12, -4)
    );
    assert_eq!((shift.edited.copies, shift.edited.moves), (2, 0));
    assert_eq!(copies[0].src, shared[2]);
    assert_eq!(copies[1].src, shared[3]);
    let now = kv.blocks(s).unwrap().to_vec();
    assert_eq!(now[0], shared[0]);
    for &b in &now[1..] {
        assert_eq!(kv.refcount(b), Some(1));
        assert!(!kv.is_registered(b));
    }
    // Positions are dense again; the fork is untouched.
    assert_eq!(kv.position_runs(s).unwrap(), &[run(0, 0)]);
    assert_eq!(kv.pos_max(s), Ok(Some(11)));
    assert_eq!(kv.blocks(other).unwrap(), &shared[..]);
    assert_eq!(kv.pos_max(other), Ok(Some(15)));
    // The kept prefix is still shared and registered; the shifted tokens are not offered
    // to the prefix cache again.
    assert!(kv.is_registered(shared[0]));
    assert_eq!(kv.commit(s, 12), Ok(0));
}

#[test]
fn shift_positions_checks_order_and_range() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    let mut slots = [0u32; 32];
    let s = kv.create(0).unwrap();
    kv.append(s, 10, &mut slots).unwrap();
    assert_eq!(kv.shift_positions(s, 5, 10, 100), Ok(()));
    assert_eq!(kv.position_runs(s).unwrap(), &[run(0, 0), run(5, 105)]);
    // Token 4 is at 4: moving 5.. down by 101 would put 5 before it.
    assert_eq!(
        kv.shift_positions(s, 5, 10, -101),
        Err(SeqError::BadPositions)
    );
    assert_eq!(kv.shift_positions(s, 5, 10, -100), Ok(()));
    assert_eq!(kv.position_runs(s).unwrap(), &[run(0, 0)]);
    // Past u32::MAX, for the shift and for a later append.
    assert_eq!(kv.shift_positions(s, 0, 10, i32::MAX), Ok(()));
    assert_eq!(
        kv.shift_positions(s, 0, 10, i32::MAX),
        Err(SeqError::BadPositions)
    );
    assert_eq!(kv.shift_positions(s, 0, 10, i32::MAX - 9), Ok(()));
    assert_eq!(kv.shift_positions(s, 9, 10, 2), Err(SeqError::BadPositions));
    assert_eq!(kv.pos_max(s), Ok(Some(u32::MAX - 1)));
    kv.append(s, 1, &mut slots).unwrap();
    assert_eq!(kv.append(s, 1, &mut slots), Err(SeqError::BadPositions));
    assert_eq!(kv.len(s), Ok(11));
}

#[test]
fn set_position_runs_validates_and_normalises() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    let mut slots = [0u32; 32];
    let s = kv.create(0).unwrap();
    kv.append(s, 10, &mut slots).unwrap();
    let ok = [run(0, 7), run(3, 10), run(6, 50)];
    assert_eq!(kv.set_position_runs(s, &ok), Ok(()));
    // (3, 10) continues (0, 7): merged.
    assert_eq!(kv.position_runs(s).unwrap(), &[run(0, 7), run(6, 50)]);
    for bad in [
        &[run(1, 0)][..],
        &[run(0, 0), run(3, 2)],
        &[run(0, 0), run(10, 20)],
        &[run(0, 0), run(5, 9), run(5, 10)],
        &[run(0, u32::MAX - 5)],
        &[],
    ] {
        assert_eq!(
            kv.set_position_runs(s, bad),
            Err(SeqError::BadPositions),
            "{bad:?}"
        );
        // The pure check says the same, without a manager.
        assert_eq!(
            PositionRun::validate(bad, 10, 4),
            Err(SeqError::BadPositions),
            "{bad:?}"
        );
    }
    assert_eq!(PositionRun::validate(&ok, 10, 4), Ok(()));
    assert_eq!(PositionRun::validate(&ok, 10, 2), Ok(()), "merged to two");
    assert_eq!(PositionRun::validate(&[run(0, 3)], 0, 1), Ok(()), "empty");
    let many = [run(0, 0), run(1, 5), run(2, 10), run(3, 15), run(4, 20)];
    let too_many = Err(SeqError::TooManyPositionRuns {
        needed: 5,
        capacity: 4,
    });
    assert_eq!(kv.set_position_runs(s, &many), too_many);
    assert_eq!(PositionRun::validate(&many, 10, 4), too_many);
    assert_eq!(kv.position_runs(s).unwrap(), &[run(0, 7), run(6, 50)]);
    // Truncation trims runs; fork and copy carry them.
    let child = kv.fork(s).unwrap();
    assert_eq!(kv.position_runs(child).unwrap(), &[run(0, 7), run(6, 50)]);
    kv.truncate(s, 6).unwrap();
    assert_eq!(kv.position_runs(s).unwrap(), &[run(0, 7)]);
    let copy = kv.copy_range(child, 4, 8, 0, &mut []).unwrap();
    assert_eq!(copy.edited.moves, 0, "block-aligned copy shares");
    assert_eq!(
        kv.position_runs(copy.seq).unwrap(),
        &[run(0, 11), run(2, 50)]
    );
}

#[test]
fn release_all_except_keeps_one() {
    let mut storage = vec![0u64; CONFIG.storage_words()];
    let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
    let mut slots = [0u32; 32];
    let a = kv.create(0).unwrap();
    kv.append(a, 5, &mut slots).unwrap();
    let b = kv.fork(a).unwrap();
    let c = kv.create(1).unwrap();
    let d = kv.create(1).unwrap();
    kv.release(d).unwrap();
    // A stale handle in the set: refused, nothing released.
    assert_eq!(
        kv.release_all_except(b, [a, b, c, d].into_iter()),
        Err(SeqError::StaleHandle)
    );
    assert_eq!(kv.stats().live_seqs, 3);
    assert_eq!(kv.release_all_except(b, [a, c, a, b].into_iter()), Ok(2));
    assert_eq!(kv.stats().live_seqs, 1);
    assert_eq!(kv.len(b), Ok(5));
    assert_eq!(kv.len(a), Err(SeqError::StaleHandle));
}
