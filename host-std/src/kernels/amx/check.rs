//! What the tile kernels' tests share: errors against f64 sums, and the tiles
//! configured on the test's thread.

use super::bf16::ROWS;
use super::AmxBf16;

/// The worst error of `got` against `want`, relative to `scale` (a bound on the terms'
/// magnitudes). For the bf16 tiles, whose operands go in as two bf16 parts, about 2^-16
/// = 1.5e-5 plus the f32 sums' rounding; seen: 1.7e-6 (scores), 6.3e-6 (accumulation).
/// Dropping either low part makes it 1e-3 to 1e-2.
pub(super) fn worst(got: &[f32], want: &[f64], scale: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .zip(scale)
        .map(|((&g, &w), &s)| (f64::from(g) - w).abs() / s.max(f64::MIN_POSITIVE))
        .fold(0.0, f64::max)
}

/// The worst error ([`worst`]) of the four accumulator rows `acc` (dimension order)
/// against `acc0 + Σ_t p[r][t] · value(t, d)` over `n` tokens, relative to `|acc0| +
/// Σ_t weight(r, t) · |value(t, d)|` (`weight`: the magnitude the arithmetic's
/// rounding of `p[r][t]` is relative to); every output must be finite (`worst` passes
/// NaN over).
pub(super) fn accumulation_error(
    acc: &[f32],
    acc0: &[f32],
    p: &[Vec<f32>],
    value: impl Fn(usize, usize) -> f64,
    n: usize,
    hd: usize,
    weight: impl Fn(usize, usize) -> f64,
) -> f64 {
    assert!(acc.iter().all(|x| x.is_finite()), "a non-finite output");
    let (mut want, mut scale) = (vec![], vec![]);
    for r in 0..ROWS {
        for d in 0..hd {
            let sum: f64 = (0..n).map(|t| f64::from(p[r][t]) * value(t, d)).sum();
            let bound: f64 = (0..n).map(|t| weight(r, t) * value(t, d).abs()).sum();
            want.push(f64::from(acc0[r * hd + d]) + sum);
            scale.push(f64::from(acc0[r * hd + d].abs()) + bound);
        }
    }
    worst(acc, &want, &scale)
}

/// The tiles, configured on this thread; `None` (said on stderr) where the CPU or the
/// OS does not give them, or a cap rules them out.
pub(super) fn begun() -> Option<AmxBf16> {
    let amx = AmxBf16::detect();
    match amx {
        Some(amx) => amx.begin(),
        None => eprintln!("skipped: AMX tiles absent or not granted by the OS (or capped)"),
    }
    amx
}

/// The shapes a chunk's runs can have, as (run lengths, tokens asked for): whole tiles
/// in blocks of 16 and 48, blocks of 8 and 5 (copied), a block boundary inside a tile
/// or one token short of a tile's end, a last partial tile, fewer tokens asked for than
/// the runs hold.
pub(super) const CHUNK_SHAPES: [(&[usize], usize); 9] = [
    (&[16, 16, 16, 16], 64),
    (&[48, 16], 64),
    (&[20, 44], 64),
    (&[31, 33], 64),
    (&[15, 49], 64),
    (&[8, 8, 8, 8, 8], 40),
    (&[5, 5, 5, 5, 5, 5, 5], 33),
    (&[16, 16, 16], 37),
    (&[1], 1),
];

/// Runs of the lengths `lens`, each in its own allocation, of vectors of `hd` elements:
/// the first `n` tokens' from `fresh`, the rest `past`.
pub(super) fn chunk_runs<E: Copy>(
    lens: &[usize],
    n: usize,
    hd: usize,
    mut fresh: impl FnMut() -> E,
    past: E,
) -> Vec<Vec<E>> {
    assert!(lens.iter().sum::<usize>() >= n);
    let mut t = 0;
    let mut runs = vec![];
    for &len in lens {
        let run = (0..len * hd)
            .map(|i| if t + i / hd < n { fresh() } else { past })
            .collect();
        runs.push(run);
        t += len;
    }
    runs
}

/// Token `t`'s vector of `hd` elements in `runs`.
pub(super) fn token_of<E>(runs: &[Vec<E>], t: usize, hd: usize) -> &[E] {
    let (mut r, mut at) = (0, t);
    while at >= runs[r].len() / hd {
        at -= runs[r].len() / hd;
        r += 1;
    }
    &runs[r][at * hd..(at + 1) * hd]
}
