//! Shared by the integration tests: the plain f64 reference and random inputs.
#![allow(dead_code)]

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// Deterministic generator for a test.
pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `n` values uniform in [-1, 1) (never all zero).
pub fn random_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Reference attention, f64, contiguous, written for clarity.
///
/// `k`, `v`: `[context_len][kv_heads][head_dim]`; `q`: `[queries][q_heads][head_dim]`,
/// the queries being the last `queries` tokens of the context. Returns
/// `[queries][q_heads][head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn reference_attention(
    k: &[f32],
    v: &[f32],
    context_len: usize,
    kv_heads: usize,
    head_dim: usize,
    q: &[f32],
    q_heads: usize,
    scale: f32,
) -> Vec<f64> {
    let queries = q.len() / (q_heads * head_dim);
    let group = q_heads / kv_heads;
    let mut out = vec![0.0f64; q.len()];
    for i in 0..queries {
        let position = context_len - queries + i;
        for h in 0..q_heads {
            let kvh = h / group;
            let qrow = &q[(i * q_heads + h) * head_dim..][..head_dim];
            let key = |t: usize| &k[(t * kv_heads + kvh) * head_dim..][..head_dim];
            let value = |t: usize| &v[(t * kv_heads + kvh) * head_dim..][..head_dim];
            let scores: Vec<f64> = (0..=position)
                .map(|t| {
                    let dot: f64 = qrow
                        .iter()
                        .zip(key(t))
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum();
                    dot * f64::from(scale)
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            let o = &mut out[(i * q_heads + h) * head_dim..][..head_dim];
            for (t, w) in weights.iter().enumerate() {
                for (od, vd) in o.iter_mut().zip(value(t)) {
                    *od += w / total * f64::from(*vd);
                }
            }
        }
    }
    out
}

/// ‖got − want‖ / ‖want‖.
pub fn rel_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    assert!(den > 0.0, "reference output is zero");
    (num / den).sqrt()
}

/// Tolerance of the issue: 1e-5 for f32, 1e-2 for f16 / bf16.
pub fn tolerance<T: kvpage::Element>() -> f64 {
    if core::mem::size_of::<T>() == 4 {
        1e-5
    } else {
        1e-2
    }
}

/// The cases a test runs: all of `cases` natively, the first `under_miri` under Miri
/// (which interprets every step thousands of times slower and is there for the unsafe
/// code the cases share, not for their numerical spread). List the most telling cases
/// first.
pub fn cases<T>(cases: &[T], under_miri: usize) -> &[T] {
    if cfg!(miri) {
        &cases[..under_miri.min(cases.len())]
    } else {
        cases
    }
}

/// Asserts that two runs of the same attention over the same K/V agree: bit for bit
/// natively; under Miri, which perturbs the last bits of each call of a math function
/// such as `exp`, within 1e-5 relative.
#[track_caller]
pub fn assert_same_output(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    if cfg!(miri) {
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{g} vs {w}");
        }
    } else {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(got), bits(want));
    }
}
