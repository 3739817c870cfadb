//! Per-policy results of a replay and the statistics behind them.

use serde::Serialize;

/// The nearest-rank percentile `p` (0–100) of `sorted` (ascending): the smallest value
/// with at least `p`% of the values at or below it. NaN for an empty slice. O(1).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One row of the results table; serialised as one object of the `--json` array, with
/// exactly these keys.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// Policy name (`contiguous`, `paged`, `paged-swap`, `paged-prefix`, ...).
    pub policy: String,
    /// Requests that finished.
    pub completed: u64,
    /// Generated tokens over the makespan (first arrival to last completion).
    pub tokens_per_s: f64,
    /// Most sequences running (holding KV on the device) in one step.
    pub peak_running: u64,
    /// Running sequences, time-averaged over the makespan.
    pub mean_running: f64,
    /// Tokens stored over token slots reserved, both time-integrated.
    pub kv_utilization: f64,
    /// Wasted KV bytes over the KV budget, time-averaged: slots reserved but holding no
    /// token, plus free bytes that no request can use (holes smaller than one region).
    pub waste_fraction: f64,
    /// Time to first token, median (s).
    pub ttft_p50_s: f64,
    /// Time to first token, 99th percentile (s).
    pub ttft_p99_s: f64,
    /// Arrival to last token, median (s).
    pub latency_p50_s: f64,
    /// Arrival to last token, 99th percentile (s).
    pub latency_p99_s: f64,
    /// Sequences preempted (by recompute or by swap).
    pub preemptions: u64,
    /// Prompt tokens served from the prefix cache (no prefill needed).
    pub prefix_hit_tokens: u64,
    /// Further numbers shown in the table but not in the JSON.
    #[serde(skip)]
    pub extra: Extra,
}

/// Numbers of a run beyond the JSON keys.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Extra {
    /// Engine steps.
    pub steps: u64,
    /// Simulated seconds from the first arrival to the last completion.
    pub makespan_s: f64,
    /// Output tokens generated (each counted once, even if its KV was recomputed).
    pub generated_tokens: u64,
    /// Peak KV bytes reserved.
    pub peak_reserved_bytes: u64,
    /// KV budget in bytes.
    pub budget_bytes: u64,
    /// Preemptions that swapped to the host tier (the rest recomputed).
    pub swaps: u64,
    /// Bytes copied between device and host tier, both ways.
    pub swap_bytes: u64,
    /// Prompt tokens prefilled again after a recompute preemption.
    pub recomputed_tokens: u64,
    /// Tokens computed (prefill and decode), over all steps.
    pub computed_tokens: u64,
    /// Tokens of the shared system prompts computed (every computation after a group's
    /// first is one the prefix cache missed).
    pub shared_prompt_computed_tokens: u64,
    /// Wall-clock seconds the replay of this policy took (its own thread; policies run
    /// concurrently).
    pub wall_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&[3.0, 7.0], 50.0), 3.0);
        assert_eq!(percentile(&[3.0, 7.0], 99.0), 7.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn json_has_exactly_the_documented_keys() {
        let r = Report {
            policy: "paged".into(),
            ..Report::default()
        };
        let v = serde_json::to_value(&r).unwrap();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut want = vec![
            "policy",
            "completed",
            "tokens_per_s",
            "peak_running",
            "mean_running",
            "kv_utilization",
            "waste_fraction",
            "ttft_p50_s",
            "ttft_p99_s",
            "latency_p50_s",
            "latency_p99_s",
            "preemptions",
            "prefix_hit_tokens",
        ];
        want.sort_unstable();
        assert_eq!(keys, want);
    }
}
