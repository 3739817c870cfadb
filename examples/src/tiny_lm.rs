//! A tiny decoder-only transformer that keeps its keys and values in kvpage's paged cache:
//! the model of the `long_chat` example.
//!
//! Three pre-norm layers (RMS norm, grouped-query attention with rotary position
//! embedding on queries and keys, a ReLU MLP), a 64-token vocabulary, random weights from
//! a seed. It computes nothing meaningful, but it uses the cache exactly as a real model
//! does: the keys it writes are rotated at their positions, so a context shift that moves
//! tokens must re-rotate them ([`KvCache::rotate_keys`] with [`ROPE`]).
//!
//! [`TinyLm::forward`] runs through the cache; [`TinyLm::forward_dense`] is the
//! reference: the same layers over plain vectors of un-rotated keys and values, rotated
//! at their positions from scratch, attention in `f64`.

use kvpage::{CacheError, DType, Geometry, GeometryError, KvCache, RopePairing, RopeParams, Seq};

use crate::rng::SplitMix64;

/// Token ids are `0..VOCAB`.
pub const VOCAB: usize = 64;
/// Width of the hidden state.
const D_MODEL: usize = 48;
/// Transformer layers.
pub const LAYERS: usize = 3;
/// Query heads.
const Q_HEADS: usize = 4;
/// Key/value heads: two query heads share one (grouped-query attention).
pub const KV_HEADS: usize = 2;
/// Dimensions of one head.
pub const HEAD_DIM: usize = 16;
/// Width of the MLP.
const FF: usize = 96;
/// Elements of the keys (or values) of one token in one layer.
const KV_ROW: usize = KV_HEADS * HEAD_DIM;

/// The rotary embedding of the model: every dimension of a head rotated, base 10000,
/// pairs `(j, j + HEAD_DIM / 2)` (the Llama convention). The cache needs the same
/// parameters to re-rotate keys after a context shift.
pub const ROPE: RopeParams = RopeParams {
    base: 10_000.0,
    rotary_dims: HEAD_DIM as u32,
    pairing: RopePairing::HalfSplit,
};

/// Rotates every head of the rows `x` (`[tokens][heads][HEAD_DIM]`) in place, row `i` at
/// position `positions[i]`: pair `j` turns by `position · base^(-2j / HEAD_DIM)`, the
/// convention of [`ROPE`]. Angles in `f64`.
fn apply_rope(x: &mut [f32], positions: &[u32]) {
    if positions.is_empty() {
        return;
    }
    let half = HEAD_DIM / 2;
    let freqs: Vec<f64> = (0..half)
        .map(|j| f64::from(ROPE.base).powf(-2.0 * j as f64 / HEAD_DIM as f64))
        .collect();
    for (row, &pos) in x.chunks_exact_mut(x.len() / positions.len()).zip(positions) {
        for head in row.chunks_exact_mut(HEAD_DIM) {
            for (j, &freq) in freqs.iter().enumerate() {
                let (sin, cos) = (f64::from(pos) * freq).sin_cos();
                let (a, b) = (f64::from(head[j]), f64::from(head[j + half]));
                head[j] = (a * cos - b * sin) as f32;
                head[j + half] = (a * sin + b * cos) as f32;
            }
        }
    }
}

/// `x` (`[n][rows]`) times `w` (`[rows][cols]`).
fn matmul(x: &[f32], w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; x.len() / rows * cols];
    for (xi, yi) in x.chunks_exact(rows).zip(y.chunks_exact_mut(cols)) {
        for (&a, wr) in xi.iter().zip(w.chunks_exact(cols)) {
            for (o, &b) in yi.iter_mut().zip(wr) {
                *o += a * b;
            }
        }
    }
    y
}

/// Each `D_MODEL` row of `x` scaled to unit root mean square.
fn rms_norm(x: &[f32]) -> Vec<f32> {
    x.chunks_exact(D_MODEL)
        .flat_map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / D_MODEL as f32;
            let inv = (ms + 1e-5).sqrt().recip();
            row.iter().map(move |v| v * inv)
        })
        .collect()
}

/// Keys (before rotation) and values of a run of tokens, per layer: what the dense
/// reference attends to. Token `i` is at position `i`.
#[derive(Debug, Clone, Default)]
pub struct DenseKv {
    /// Per layer: keys `[tokens][KV_HEADS][HEAD_DIM]`, values likewise.
    layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl DenseKv {
    /// No tokens.
    pub fn new() -> Self {
        Self {
            layers: vec![(Vec::new(), Vec::new()); LAYERS],
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |(k, _)| k.len() / KV_ROW)
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the tokens of `other` after these.
    pub fn extend(&mut self, other: &DenseKv) {
        for ((k, v), (ok, ov)) in self.layers.iter_mut().zip(&other.layers) {
            k.extend_from_slice(ok);
            v.extend_from_slice(ov);
        }
    }

    /// Removes tokens `first..end`; the later ones move down (and so take positions
    /// `end - first` lower), as in a context shift.
    pub fn remove(&mut self, first: usize, end: usize) {
        for (k, v) in &mut self.layers {
            k.drain(first * KV_ROW..end * KV_ROW);
            v.drain(first * KV_ROW..end * KV_ROW);
        }
    }
}

/// What a forward pass returns.
#[derive(Debug, Clone)]
pub struct Forward {
    /// Next-token logits after the last input token, `VOCAB` long.
    pub logits: Vec<f32>,
    /// Keys (before rotation) and values of the input tokens, per layer.
    pub kv: DenseKv,
}

struct Layer {
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
}

/// The model: an embedding table, [`LAYERS`] layers, an output projection.
pub struct TinyLm {
    embed: Vec<f32>,
    layers: Vec<Layer>,
    unembed: Vec<f32>,
}

impl TinyLm {
    /// A model with weights drawn from `seed` (uniform in ±3 / sqrt(fan_in): large enough
    /// that greedy decoding does not settle into a two-token loop at once):
    /// the same seed gives the same model.
    pub fn new(seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let mut matrix = |rows: usize, cols: usize| -> Vec<f32> {
            let scale = 6.0 / (rows as f32).sqrt();
            (0..rows * cols)
                .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale)
                .collect()
        };
        let embed = matrix(VOCAB, D_MODEL);
        let layers = (0..LAYERS)
            .map(|_| Layer {
                wq: matrix(D_MODEL, Q_HEADS * HEAD_DIM),
                wk: matrix(D_MODEL, KV_ROW),
                wv: matrix(D_MODEL, KV_ROW),
                wo: matrix(Q_HEADS * HEAD_DIM, D_MODEL),
                w_up: matrix(D_MODEL, FF),
                w_down: matrix(FF, D_MODEL),
            })
            .collect();
        let unembed = matrix(D_MODEL, VOCAB);
        Self {
            embed,
            layers,
            unembed,
        }
    }

    /// The KV geometry of this model in a cache of `block_size`-token blocks, f32.
    ///
    /// # Errors
    /// [`GeometryError::ZeroDimension`] for a zero block size.
    pub fn geometry(block_size: u32) -> Result<Geometry, GeometryError> {
        Geometry::new(
            LAYERS as u32,
            KV_HEADS as u32,
            HEAD_DIM as u32,
            block_size,
            DType::F32,
        )
    }

    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        tokens
            .iter()
            .flat_map(|&t| &self.embed[t as usize * D_MODEL..][..D_MODEL])
            .copied()
            .collect()
    }

    /// Everything of layer `l` after attention: output projection and residual, then the
    /// MLP and its residual, on `h` in place.
    fn finish_layer(&self, l: usize, h: &mut [f32], attn: &[f32]) {
        let layer = &self.layers[l];
        for (a, b) in h
            .iter_mut()
            .zip(matmul(attn, &layer.wo, Q_HEADS * HEAD_DIM, D_MODEL))
        {
            *a += b;
        }
        let mut up = matmul(&rms_norm(h), &layer.w_up, D_MODEL, FF);
        up.iter_mut().for_each(|v| *v = v.max(0.0));
        for (a, b) in h.iter_mut().zip(matmul(&up, &layer.w_down, FF, D_MODEL)) {
            *a += b;
        }
    }

    fn logits(&self, h: &[f32]) -> Vec<f32> {
        let last = &h[h.len() - D_MODEL..];
        matmul(&rms_norm(last), &self.unembed, D_MODEL, VOCAB)
    }

    /// Runs `tokens`, the last `tokens.len()` tokens of `seq` (appended, their K/V not
    /// yet written), through the model: in every layer their keys and values go into the
    /// cache (keys rotated at the positions the cache gives those tokens) and attention
    /// reads the whole sequence through the page table. Commits the sequence at the end.
    /// O(tokens × (weights + context)).
    ///
    /// # Errors
    /// The cache's, e.g. [`CacheError::NotWritable`] if `tokens` were not just appended.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        seq: Seq,
        tokens: &[u32],
    ) -> Result<Forward, CacheError> {
        let n = tokens.len() as u32;
        // More tokens than the sequence holds: `write_kv` refuses them below.
        let first = cache.len(seq)?.saturating_sub(n);
        let positions = (first..first + n)
            .map(|i| cache.position(seq, i))
            .collect::<Result<Vec<u32>, _>>()?;
        let scale = (HEAD_DIM as f32).sqrt().recip();
        let mut h = self.embed(tokens);
        let mut kv = DenseKv::new();
        for (l, layer) in self.layers.iter().enumerate() {
            let x = rms_norm(&h);
            let mut q = matmul(&x, &layer.wq, D_MODEL, Q_HEADS * HEAD_DIM);
            let mut k = matmul(&x, &layer.wk, D_MODEL, KV_ROW);
            let v = matmul(&x, &layer.wv, D_MODEL, KV_ROW);
            kv.layers[l] = (k.clone(), v.clone());
            apply_rope(&mut q, &positions);
            apply_rope(&mut k, &positions);
            cache.write_kv(seq, l as u32, first, &k, &v)?;
            let mut attn = vec![0.0f32; q.len()];
            cache.prefill(l as u32, &[(seq, n)], &q, &mut attn, Q_HEADS as u32, scale)?;
            self.finish_layer(l, &mut h, &attn);
        }
        cache.commit(seq)?;
        Ok(Forward {
            logits: self.logits(&h),
            kv,
        })
    }

    /// The reference for [`TinyLm::forward`], without the paged cache: `tokens` follow
    /// `context` (token `i` at position `i`, the new ones after it); every layer attends
    /// causally over the context's stored keys and values and the new tokens' own, all
    /// keys rotated at their positions from scratch, scores and softmax in `f64`.
    /// With an empty context this recomputes `tokens` from nothing.
    /// O(tokens × (weights + context)) plus O(context) rotations per layer.
    pub fn forward_dense(&self, context: &DenseKv, tokens: &[u32]) -> Forward {
        let past = context.len();
        let total = past + tokens.len();
        let positions: Vec<u32> = (0..total as u32).collect();
        let group = Q_HEADS / KV_HEADS;
        let scale = 1.0 / (HEAD_DIM as f64).sqrt();
        let mut h = self.embed(tokens);
        let mut kv = DenseKv::new();
        for (l, layer) in self.layers.iter().enumerate() {
            let x = rms_norm(&h);
            let mut q = matmul(&x, &layer.wq, D_MODEL, Q_HEADS * HEAD_DIM);
            let k_new = matmul(&x, &layer.wk, D_MODEL, KV_ROW);
            let v_new = matmul(&x, &layer.wv, D_MODEL, KV_ROW);
            let (ck, cv) = &context.layers[l];
            let mut keys = [&ck[..], &k_new].concat();
            let values = [&cv[..], &v_new].concat();
            apply_rope(&mut keys, &positions);
            apply_rope(&mut q, &positions[past..]);
            kv.layers[l] = (k_new, v_new);
            let mut attn = vec![0.0f32; q.len()];
            for (i, (qi, out)) in q
                .chunks_exact(Q_HEADS * HEAD_DIM)
                .zip(attn.chunks_exact_mut(Q_HEADS * HEAD_DIM))
                .enumerate()
            {
                let visible = past + i + 1;
                for head in 0..Q_HEADS {
                    let qh = &qi[head * HEAD_DIM..][..HEAD_DIM];
                    let kvh = head / group * HEAD_DIM;
                    let scores: Vec<f64> = (0..visible)
                        .map(|t| {
                            let kt = &keys[t * KV_ROW + kvh..][..HEAD_DIM];
                            qh.iter()
                                .zip(kt)
                                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = weights.iter().sum();
                    for d in 0..HEAD_DIM {
                        let acc: f64 = weights
                            .iter()
                            .enumerate()
                            .map(|(t, w)| w * f64::from(values[t * KV_ROW + kvh + d]))
                            .sum();
                        out[head * HEAD_DIM + d] = (acc / sum) as f32;
                    }
                }
            }
            self.finish_layer(l, &mut h, &attn);
        }
        Forward {
            logits: self.logits(&h),
            kv,
        }
    }
}

/// The token with the largest logit (the first of equals): greedy decoding.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpage::{CacheConfig, Capacity};

    /// A cache of `blocks` blocks of 4 tokens for one sequence of up to 32 tokens.
    fn one_seq_cache(blocks: u32) -> KvCache {
        KvCache::new(CacheConfig {
            geometry: TinyLm::geometry(4).unwrap(),
            capacity: Capacity::Blocks(blocks),
            max_seqs: 1,
            max_seq_len: 32,
            threads: 1,
            event_capacity: 0,
            hash_key: None,
            max_namespaces: kvpage::CACHE_NAMESPACES,
        })
        .unwrap()
    }

    /// Without any edit, the paged forward pass equals the dense reference.
    #[test]
    fn paged_equals_dense() {
        let model = TinyLm::new(1);
        let mut cache = one_seq_cache(8);
        let seq = cache.create(0).unwrap();
        let prompt = [5, 9, 63, 0, 17, 17, 2];
        cache.append_tokens(seq, &prompt).unwrap();
        let paged = model.forward(&mut cache, seq, &prompt).unwrap();
        let dense = model.forward_dense(&DenseKv::new(), &prompt);
        let diff = paged
            .logits
            .iter()
            .zip(&dense.logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(diff < 1e-4, "{diff}");
        assert_eq!(dense.kv.len(), prompt.len());
        // One more token, decoded over the cache and over the dense context.
        let next = argmax(&paged.logits);
        cache.append_tokens(seq, &[next]).unwrap();
        let paged = model.forward(&mut cache, seq, &[next]).unwrap();
        let dense = model.forward_dense(&dense.kv, &[next]);
        assert_eq!(argmax(&paged.logits), argmax(&dense.logits));
    }

    /// An unaligned context shift (rows moved inside blocks, keys re-rotated): the next
    /// token through the cache equals the dense reference over the same K/V at the new
    /// positions. (`long_chat` shifts by whole blocks, which moves no row.)
    #[test]
    fn unaligned_shift_equals_dense() {
        let model = TinyLm::new(2);
        let mut cache = one_seq_cache(10);
        let seq = cache.create(0).unwrap();
        let prompt: Vec<u32> = (0..19).map(|i| (i * 7 + 3) % VOCAB as u32).collect();
        cache.append_tokens(seq, &prompt).unwrap();
        let mut context = model.forward(&mut cache, seq, &prompt).unwrap().kv;
        let shift = cache.context_shift(seq, 3, 5).unwrap();
        assert!(shift.edited.moves > 0, "{shift:?}");
        cache
            .rotate_keys(
                seq,
                shift.rotate_first,
                shift.rotate_end,
                shift.delta.into(),
                ROPE,
            )
            .unwrap();
        context.remove(3, 8);
        cache.append_tokens(seq, &[11]).unwrap();
        let paged = model.forward(&mut cache, seq, &[11]).unwrap();
        let dense = model.forward_dense(&context, &[11]);
        let scale = dense.logits.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let diff = paged
            .logits
            .iter()
            .zip(&dense.logits)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= 1e-4 * scale, "{diff} of {scale}");
        // Positions stay dense: the new token sits at its index.
        assert_eq!(cache.position(seq, 14).unwrap(), 14);
    }
}
