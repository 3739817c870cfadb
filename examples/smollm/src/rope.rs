//! The rotary position embedding of a GGUF Llama: the pairs are adjacent dimensions
//! `(2i, 2i + 1)` of a head (GGUF stores the query and key weights permuted for this
//! interleaved pairing; candle's reference applies it with `rope_i`), pair `i` turned by
//! `position · base^(-2i / head_dim)`.
//!
//! The angles are computed as candle's reference computes them (the inverse frequency in
//! `f32` as `1 / base^(2i / head_dim)`, times the position in `f32`, then `cos` and
//! `sin`), so the rotated keys that go into kvpage are the reference's to the last bit
//! or within an ulp.

/// Precomputed `cos` and `sin` of every position below `max_positions`.
#[derive(Debug, Clone)]
pub struct Rope {
    head_dim: usize,
    /// `[position][head_dim / 2]`.
    cos: Vec<f32>,
    /// `[position][head_dim / 2]`.
    sin: Vec<f32>,
}

impl Rope {
    /// The tables for heads of `head_dim` (even) at positions `0..max_positions`.
    /// O(max_positions × head_dim).
    pub fn new(head_dim: usize, base: f32, max_positions: usize) -> Self {
        let inv_freq: Vec<f32> = (0..head_dim)
            .step_by(2)
            .map(|i| 1.0 / base.powf(i as f32 / head_dim as f32))
            .collect();
        let angles: Vec<f32> = (0..max_positions)
            .flat_map(|p| inv_freq.iter().map(move |&f| p as f32 * f))
            .collect();
        Self {
            head_dim,
            cos: angles.iter().map(|a| a.cos()).collect(),
            sin: angles.iter().map(|a| a.sin()).collect(),
        }
    }

    /// Positions the tables cover. O(1).
    pub fn max_positions(&self) -> usize {
        self.cos.len() / (self.head_dim / 2)
    }

    /// Rotates every head of the rows of `x` (`[rows][heads][head_dim]`) in place, row
    /// `r` at position `positions[r]`. O(rows × heads × head_dim).
    ///
    /// # Panics
    /// If a position is not below [`Rope::max_positions`] (the caller sizes the tables
    /// from the cache's `max_seq_len`, which bounds every position).
    pub fn apply(&self, x: &mut [f32], positions: &[u32]) {
        if positions.is_empty() {
            return;
        }
        let half = self.head_dim / 2;
        for (row, &pos) in x.chunks_exact_mut(x.len() / positions.len()).zip(positions) {
            let cos = &self.cos[pos as usize * half..][..half];
            let sin = &self.sin[pos as usize * half..][..half];
            for head in row.chunks_exact_mut(self.head_dim) {
                for ((pair, &c), &s) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
                    let (a, b) = (pair[0], pair[1]);
                    pair[0] = a * c - b * s;
                    pair[1] = a * s + b * c;
                }
            }
        }
    }
}
