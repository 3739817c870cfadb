//! How long one engine step takes: a roofline model.
//!
//! One step runs every scheduled sequence once: a decode sequence processes one token, a
//! prefilling sequence a chunk of its prompt. Its time is
//!
//! ```text
//! t = max(bytes / bandwidth, flops / peak) + overhead + swap_bytes / host_bandwidth
//! bytes = weight bytes                                  (every step reads all weights once)
//!       + Σ_seq context_after_step × kv_bytes_per_token (attention reads each sequence's KV once)
//! flops = 2 × params × tokens                           (matmuls)
//!       + 4 × layers × heads × head_dim × Σ_token keys_attended   (QKᵀ and PV)
//! ```
//!
//! with the device's peak memory bandwidth and peak dense f16 tensor throughput (over
//! `gpus` devices when tensor parallel). Small decode batches are bandwidth-bound (the
//! weights dominate), long prefills compute-bound. It ignores kernel efficiency,
//! communication between GPUs and sampling: absolute times are optimistic, the comparison
//! between memory policies — which differ only in how many sequences run — is what counts.

/// What one step processes, summed over its sequences.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BatchShape {
    /// Tokens processed (prefill chunk tokens plus one per decode sequence).
    pub tokens: u64,
    /// Σ over scheduled sequences of their context length at the end of the step.
    pub kv_tokens_read: u64,
    /// Σ over processed tokens of the number of keys each attends to (causal).
    pub attended_keys: u64,
    /// Bytes moved between device and host tier (swaps) before the step.
    pub swap_bytes: u64,
}

impl BatchShape {
    /// Adds a run of `n` tokens at positions `start..start + n` of one sequence. O(1).
    pub fn add_run(&mut self, start: u64, n: u64) {
        self.tokens += n;
        self.kv_tokens_read += start + n;
        // Token at position p attends to p + 1 keys: Σ_{p=start}^{start+n-1} (p + 1).
        self.attended_keys += n * start + n * (n + 1) / 2;
    }
}

/// Turns a step's shape into seconds.
pub trait StepCost {
    /// Seconds the step takes. Must be positive for a non-empty batch.
    fn step_seconds(&self, batch: &BatchShape) -> f64;
}

/// The roofline model described in the module docs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Roofline {
    /// Bytes of weights read every step.
    pub weight_bytes: f64,
    /// KV bytes per token (all layers, keys and values).
    pub kv_bytes_per_token: f64,
    /// Model parameters.
    pub params: f64,
    /// `layers × heads × head_dim` (query heads).
    pub attn_width: f64,
    /// Memory bandwidth, B/s.
    pub mem_bw: f64,
    /// Peak FLOP/s.
    pub flops: f64,
    /// Host link bandwidth for swaps, B/s.
    pub host_bw: f64,
    /// Fixed per-step overhead (scheduling, launches, sampling), seconds.
    pub overhead_s: f64,
}

impl Roofline {
    /// Bytes the step reads from device memory.
    pub fn bytes(&self, b: &BatchShape) -> f64 {
        self.weight_bytes + b.kv_tokens_read as f64 * self.kv_bytes_per_token
    }

    /// Floating-point operations of the step.
    pub fn flop(&self, b: &BatchShape) -> f64 {
        2.0 * self.params * b.tokens as f64 + 4.0 * self.attn_width * b.attended_keys as f64
    }
}

impl StepCost for Roofline {
    fn step_seconds(&self, b: &BatchShape) -> f64 {
        let compute = if b.tokens == 0 {
            0.0
        } else {
            (self.bytes(b) / self.mem_bw).max(self.flop(b) / self.flops) + self.overhead_s
        };
        compute + b.swap_bytes as f64 / self.host_bw
    }
}

/// Every step takes one time unit, whatever it processes: "one token per step".
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UnitSteps;

impl StepCost for UnitSteps {
    fn step_seconds(&self, _: &BatchShape) -> f64 {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a100_13b() -> Roofline {
        Roofline {
            weight_bytes: 26e9,
            kv_bytes_per_token: 819_200.0,
            params: 13e9,
            attn_width: 40.0 * 40.0 * 128.0,
            mem_bw: 2e12,
            flops: 300e12,
            host_bw: 25e9,
            overhead_s: 0.002,
        }
    }

    #[test]
    fn runs_accumulate_causal_attention() {
        let mut b = BatchShape::default();
        b.add_run(0, 4); // prefill of 4 tokens: keys 1 + 2 + 3 + 4
        b.add_run(9, 1); // decode at position 9: 10 keys
        assert_eq!(
            b,
            BatchShape {
                tokens: 5,
                kv_tokens_read: 14,
                attended_keys: 20,
                swap_bytes: 0
            }
        );
    }

    #[test]
    fn decode_is_bandwidth_bound_and_prefill_compute_bound() {
        let m = a100_13b();
        let mut d = BatchShape::default();
        d.add_run(999, 1); // one sequence, 1000 tokens of context
                           // bytes: 26e9 + 1000 × 819200 = 26.8192e9 → 13.41 ms; flops tiny.
        let t = m.step_seconds(&d);
        assert!((t - (26.8192e9 / 2e12 + 0.002)).abs() < 1e-9, "{t}");
        let mut p = BatchShape::default();
        p.add_run(0, 2048);
        // flops: 2 × 13e9 × 2048 + 4 × 204800 × 2048 × 2049 / 2 = 5.3248e13 + 1.7188e12
        let flop = 2.0 * 13e9 * 2048.0 + 4.0 * 204_800.0 * (2048.0 * 2049.0 / 2.0);
        assert!((m.step_seconds(&p) - (flop / 300e12 + 0.002)).abs() < 1e-9);
        p.swap_bytes = 25_000_000;
        assert!((m.step_seconds(&p) - (flop / 300e12 + 0.003)).abs() < 1e-9);
        assert_eq!(m.step_seconds(&BatchShape::default()), 0.0);
        assert_eq!(UnitSteps.step_seconds(&p), 1.0);
    }
}
