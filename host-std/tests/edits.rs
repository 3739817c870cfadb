//! Sequence edits on the owned cache: after random appends, forks, removals, context
//! shifts and range copies, every live sequence reads back through its block table
//! exactly the K/V rows a plain reference (one `Vec` of rows per sequence) says it holds,
//! at the positions the reference says — so the copies and row moves the core reports
//! are executed, completely and in order, by the CPU kernels.

use kvpage::kernels::move_rows;
use kvpage::{
    CacheConfig, Capacity, DType, Element, Geometry, KernelError, KvCache, KvLayout, RowMove, Seq,
};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const LAYERS: u32 = 2;
const KV_HEADS: u32 = 2;
const HEAD_DIM: u32 = 4;
const ROW: usize = (KV_HEADS * HEAD_DIM) as usize;

/// Element `d` of head `h` of K (`kv` 0) or V (1) in `layer` for the token tagged `tag`:
/// small integers, exact in every dtype, and different for neighbouring tags.
fn value(tag: u32, layer: u32, kv: u32, h: u32, d: u32) -> f32 {
    ((tag * 7 + layer * 11 + kv * 3 + h * 5 + d * 13) % 251) as f32
}

/// Reference content of a sequence: per token, its tag and position.
type Tokens = Vec<(u32, u32)>;

struct Harness {
    cache: KvCache,
    seqs: Vec<(Seq, Tokens)>,
    next_tag: u32,
}

impl Harness {
    fn append(&mut self, k: usize, n: u32) {
        let (seq, ref mut tokens) = self.seqs[k];
        let len = tokens.len() as u32;
        if self.cache.append(seq, n).is_err() {
            return;
        }
        let next = match tokens.last() {
            Some(&(_, p)) => p + 1,
            None => self.cache.position_runs(seq).unwrap()[0].first_position,
        };
        let tags: Vec<u32> = (0..n).map(|i| self.next_tag + i).collect();
        self.next_tag += n;
        for layer in 0..LAYERS {
            let row = |kv| {
                tags.iter()
                    .flat_map(|&t| {
                        (0..KV_HEADS).flat_map(move |h| {
                            (0..HEAD_DIM).map(move |d| value(t, layer, kv, h, d))
                        })
                    })
                    .collect::<Vec<f32>>()
            };
            self.cache
                .write_kv(seq, layer, len, &row(0), &row(1))
                .unwrap();
        }
        self.cache.commit(seq).unwrap();
        tokens.extend(tags.iter().enumerate().map(|(i, &t)| (t, next + i as u32)));
    }

    /// Every live sequence reads back its reference rows at its reference positions.
    fn check<T: Element + Into<f32>>(&self) {
        let layout = self.cache.layout();
        let arena = self.cache.arena().as_slice::<T>();
        let bs = layout.geometry().block_size();
        for (seq, tokens) in &self.seqs {
            let blocks = self.cache.block_manager().blocks(seq.id()).unwrap();
            assert_eq!(self.cache.len(*seq).unwrap() as usize, tokens.len());
            for (i, &(tag, pos)) in tokens.iter().enumerate() {
                let (b, off) = (blocks[i / bs as usize], i as u32 % bs);
                for layer in 0..LAYERS {
                    for kv in 0..2 {
                        for h in 0..KV_HEADS {
                            let start =
                                layout.tile_offset(b, layer, kv, h) + (off * HEAD_DIM) as usize;
                            for d in 0..HEAD_DIM {
                                let got: f32 = arena[start + d as usize].into();
                                assert_eq!(
                                    got,
                                    value(tag, layer, kv, h, d),
                                    "{seq:?} token {i} layer {layer} kv {kv} head {h}"
                                );
                            }
                        }
                    }
                }
                assert_eq!(self.cache.position(*seq, i as u32).unwrap(), pos);
            }
        }
    }
}

fn random_edits<T: Element + Into<f32>>(dtype: DType, block_size: u32, seed: u64) {
    let geometry = Geometry::new(LAYERS, KV_HEADS, HEAD_DIM, block_size, dtype).unwrap();
    let cache = KvCache::new(CacheConfig {
        geometry,
        capacity: Capacity::Blocks(40),
        max_seqs: 5,
        max_seq_len: 48,
        threads: 1,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .unwrap();
    let mut h = Harness {
        cache,
        seqs: Vec::new(),
        next_tag: 0,
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut edits = 0;
    for _ in 0..if cfg!(miri) { 30 } else { 600 } {
        let k = rng.random_range(0..h.seqs.len().max(1));
        let len = h.seqs.get(k).map_or(0, |s| s.1.len() as u32);
        let first = rng.random_range(0..=len);
        let end = rng.random_range(first..=len);
        match rng.random_range(0..8) {
            0 => {
                if let Ok(seq) = h.cache.create(0) {
                    h.seqs.push((seq, Vec::new()));
                }
            }
            _ if h.seqs.is_empty() => {}
            1 | 2 => h.append(k, rng.random_range(1..12)),
            3 => {
                let seq = h.seqs[k].0;
                if let Ok(child) = h.cache.fork(seq) {
                    let tokens = h.seqs[k].1.clone();
                    h.seqs.push((child, tokens));
                }
            }
            4 => {
                let seq = h.seqs[k].0;
                if h.cache.remove_range(seq, first, end).is_ok() {
                    h.seqs[k].1.drain(first as usize..end as usize);
                    edits += 1;
                }
            }
            5 => {
                let seq = h.seqs[k].0;
                if let Ok(shift) = h.cache.context_shift(seq, first, end - first) {
                    let tokens = &mut h.seqs[k].1;
                    tokens.drain(first as usize..end as usize);
                    for t in &mut tokens[shift.rotate_first as usize..shift.rotate_end as usize] {
                        t.1 = (i64::from(t.1) + i64::from(shift.delta)) as u32;
                    }
                    edits += 1;
                }
            }
            6 => {
                let seq = h.seqs[k].0;
                if let Ok(copy) = h.cache.copy_range(seq, first, end, 0) {
                    let tokens = h.seqs[k].1[first as usize..end as usize].to_vec();
                    h.seqs.push((copy, tokens));
                    edits += 1;
                }
            }
            _ => {
                let (seq, _) = h.seqs.swap_remove(k);
                h.cache.release(seq).unwrap();
            }
        }
        h.check::<T>();
    }
    assert!(
        edits > 50 / if cfg!(miri) { 20 } else { 1 },
        "{edits} edits"
    );
}

#[test]
fn edits_keep_every_sequence_reading_its_rows_f32() {
    random_edits::<f32>(DType::F32, 4, 1);
    random_edits::<f32>(DType::F32, 3, 2);
}

#[test]
fn edits_keep_every_sequence_reading_its_rows_f16() {
    random_edits::<kvpage::f16>(DType::F16, 4, 3);
}

#[test]
fn move_rows_refuses_moves_that_leave_a_block() {
    let g = Geometry::new(1, 1, 2, 4, DType::F32).unwrap();
    let layout = KvLayout::new(g, 2).unwrap();
    let mut arena: Vec<f32> = (0..layout.arena_elems()).map(|i| i as f32).collect();
    let before = arena.clone();
    let bad = RowMove {
        src_slot: 2,
        dst_slot: 4,
        count: 3,
    };
    assert!(matches!(
        move_rows(
            &layout,
            &mut arena,
            &[
                RowMove {
                    src_slot: 0,
                    dst_slot: 1,
                    count: 1
                },
                bad
            ]
        ),
        Err(KernelError::BadRowMove { .. })
    ));
    let past = RowMove {
        src_slot: 8,
        dst_slot: 0,
        count: 1,
    };
    assert!(matches!(
        move_rows(&layout, &mut arena, &[past]),
        Err(KernelError::SlotOutOfRange { slot: 8, .. })
    ));
    assert_eq!(arena, before, "nothing moved on error");
    // Overlapping rows within a block: a memmove, in K and in V.
    move_rows(
        &layout,
        &mut arena,
        &[RowMove {
            src_slot: 1,
            dst_slot: 0,
            count: 3,
        }],
    )
    .unwrap();
    assert_eq!(&arena[..8], &[2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 6.0, 7.0]);
    assert_eq!(
        &arena[8..16],
        &[10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 14.0, 15.0]
    );
}

#[test]
fn shift_then_own_then_positions() {
    let geometry = Geometry::new(LAYERS, KV_HEADS, HEAD_DIM, 4, DType::F32).unwrap();
    let mut cache = KvCache::new(CacheConfig {
        geometry,
        capacity: Capacity::Blocks(16),
        max_seqs: 2,
        max_seq_len: 32,
        threads: 1,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .unwrap();
    let a = cache.create(0).unwrap();
    cache.append(a, 10).unwrap();
    let b = cache.fork(a).unwrap();
    cache.shift_positions(a, 4, 10, 6).unwrap();
    assert_eq!(cache.pos_range(a).unwrap(), Some((0, 15)));
    assert_eq!(cache.pos_range(b).unwrap(), Some((0, 9)));
    // Blocks 1 and 2 hold the shifted tokens and are shared with the fork: copied.
    assert_eq!(cache.make_exclusive(a, 4, 10).unwrap(), 2);
    assert_eq!(cache.make_exclusive(a, 4, 10).unwrap(), 0);
    let _ = ROW;
}
