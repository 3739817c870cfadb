//! Choosing the next token from logits: greedy, or seeded sampling at a temperature.

use kvpage_examples::rng::SplitMix64;
use kvpage_examples::tiny_lm::argmax;

/// How tokens are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token. Parallel samples of one prompt take the 2nd, 3rd, ...
    /// most likely first token, then continue greedily.
    Greedy,
    /// A draw from `softmax(logits / temperature)`, reproducible from `seed`.
    Temperature {
        /// Above 0; lower is closer to greedy.
        temperature: f32,
        /// Seed of the draws.
        seed: u64,
    },
}

/// Picks tokens under a [`Sampling`]; the draws of one sampler follow one seeded stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    sampling: Sampling,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler whose draws start from the sampling's seed. O(1).
    pub fn new(sampling: Sampling) -> Self {
        let seed = match sampling {
            Sampling::Greedy => 0,
            Sampling::Temperature { seed, .. } => seed,
        };
        Self {
            sampling,
            rng: SplitMix64::new(seed),
        }
    }

    /// The token for `logits` (one per vocabulary entry). `alternative` is the number
    /// of the parallel sample (0 for the request itself): greedy decoding takes the
    /// `alternative + 1`-th most likely token (ties to the lower id), sampling takes a
    /// fresh draw. O(vocabulary), O(vocabulary log vocabulary) for a greedy alternative.
    pub fn pick(&mut self, logits: &[f32], alternative: usize) -> u32 {
        match self.sampling {
            Sampling::Greedy if alternative == 0 => argmax(logits),
            Sampling::Greedy => {
                let mut order: Vec<u32> = (0..logits.len() as u32).collect();
                order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
                order[alternative.min(order.len() - 1)]
            }
            Sampling::Temperature { temperature, .. } => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let weights: Vec<f64> = logits
                    .iter()
                    .map(|&l| f64::from((l - max) / temperature).exp())
                    .collect();
                let total: f64 = weights.iter().sum();
                // 53 random bits: a uniform draw in [0, total).
                let mut u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
                for (i, w) in weights.iter().enumerate() {
                    if u < *w {
                        return i as u32;
                    }
                    u -= w;
                }
                argmax(logits)
            }
        }
    }
}
