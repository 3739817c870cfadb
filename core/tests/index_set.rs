//! Property test: `IndexSet` against a `BTreeSet` reference, over universes of one to
//! three levels, starting empty or full, under random inserts, removes and pops (one
//! at a time and into buffers).

mod common;

use kvpage_core::index_set::words_for;
use kvpage_core::IndexSet;
use proptest::prelude::*;
use std::collections::BTreeSet;

#[derive(Debug, Clone)]
enum Op {
    Insert(u32),
    Remove(u32),
    First,
    PopFirst,
    /// `pop_first_into` a buffer of this many.
    PopInto(usize),
}

/// An index in or just past the universe, clustered near word boundaries half the time.
fn index(universe: u32) -> impl Strategy<Value = u32> {
    prop_oneof![
        0..universe + 2,
        (0..universe / 32 + 1, 0..3u32).prop_map(|(w, b)| (w * 32 + b).saturating_sub(1)),
    ]
}

fn op(universe: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => index(universe).prop_map(Op::Insert),
        3 => index(universe).prop_map(Op::Remove),
        1 => Just(Op::First),
        3 => Just(Op::PopFirst),
        1 => (0..80usize).prop_map(Op::PopInto),
    ]
}

fn case() -> impl Strategy<Value = (u32, bool, Vec<Op>)> {
    let max: u32 = if cfg!(miri) { 1_200 } else { 40_000 };
    prop_oneof![1..64u32, 64..1_100u32, 1_100..max].prop_flat_map(|u| {
        (
            Just(u),
            any::<bool>(),
            proptest::collection::vec(op(u), 0..common::max_ops(300)),
        )
    })
}

proptest! {
    #![proptest_config(common::proptest_config(256))]

    #[test]
    fn matches_a_btreeset((universe, full, ops) in case()) {
        // One spare word past the set's storage must stay untouched.
        let mut words = vec![0xA5A5_A5A5u32; words_for(universe) + 1];
        let mut set = IndexSet::new(&mut words, universe, full);
        let mut model: BTreeSet<u32> = if full { (0..universe).collect() } else { BTreeSet::new() };
        for op in &ops {
            match *op {
                Op::Insert(i) => prop_assert_eq!(set.insert(i), i < universe && model.insert(i)),
                Op::Remove(i) => prop_assert_eq!(set.remove(i), model.remove(&i)),
                Op::First => prop_assert_eq!(set.first(), model.first().copied()),
                Op::PopFirst => prop_assert_eq!(set.pop_first(), model.pop_first()),
                Op::PopInto(k) => {
                    let mut out = vec![u32::MAX; k];
                    if model.len() < k {
                        prop_assert!(!set.pop_first_into(&mut out));
                        prop_assert!(out.iter().all(|&x| x == u32::MAX), "changed on refusal");
                    } else {
                        prop_assert!(set.pop_first_into(&mut out));
                        let want: Vec<u32> = (0..k).filter_map(|_| model.pop_first()).collect();
                        prop_assert_eq!(out, want);
                    }
                }
            }
            prop_assert_eq!(set.count() as usize, model.len());
            for n in [0, 1, 31, 32, 33, model.len() as u32, model.len().saturating_sub(1) as u32] {
                prop_assert_eq!(set.exceeds(n), model.len() > n as usize);
            }
        }
        for i in [0, universe / 2, universe.saturating_sub(1), universe, u32::MAX] {
            prop_assert_eq!(set.contains(i), model.contains(&i));
        }
        let drained: Vec<u32> = core::iter::from_fn(|| set.pop_first()).collect();
        prop_assert_eq!(drained, model.into_iter().collect::<Vec<_>>());
        prop_assert_eq!(words[words.len() - 1], 0xA5A5_A5A5);
    }
}
