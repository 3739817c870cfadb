//! Shared by the benchmarks: random fill of storage elements, an arena of random K/V
//! with its blocks in shuffled order, the median and best of a run's timings, and the
//! numbers given on the command line.
#![allow(dead_code)]

use std::time::Duration;

use kvpage::{Arena, Element, Geometry, KvLayout};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::RngExt;

/// Median and minimum.
pub fn stats(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    (v[v.len() / 2], v[0])
}

/// Fills `dst` with random values in [-1, 1), through an f32 buffer.
pub fn fill<T: Element>(rng: &mut StdRng, dst: &mut [T]) {
    let mut buf = vec![0.0f32; 1 << 16];
    for chunk in dst.chunks_mut(1 << 16) {
        for x in buf.iter_mut() {
            *x = rng.random_range(-1.0f32..1.0);
        }
        T::narrow(&buf, chunk);
    }
}

/// The numeric command-line arguments (`cargo bench` also passes `--bench`, skipped), or
/// `default` alone when there are none.
pub fn numeric_args(default: u32) -> Vec<u32> {
    let given: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if given.is_empty() {
        vec![default]
    } else {
        given
    }
}

/// An arena of `blocks` blocks of `geometry` in storage `T`, filled with random values,
/// and the block ids `0..blocks` shuffled: a block table whose logical order is not the
/// physical one, as after a while of serving.
pub fn shuffled_arena<T: Element>(
    geometry: Geometry,
    blocks: u32,
    rng: &mut StdRng,
) -> (KvLayout, Arena, Vec<u32>) {
    let layout = KvLayout::new(geometry, blocks).expect("layout");
    let mut arena = Arena::for_layout(&layout).expect("arena");
    fill(rng, arena.as_mut_slice::<T>());
    let mut physical: Vec<u32> = (0..blocks).collect();
    physical.shuffle(rng);
    (layout, arena, physical)
}
