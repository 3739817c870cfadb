//! kvpage serving SmolLM2-135M against candle's own quantized Llama
//! (`quantized_llama::ModelWeights`) on the same file, with the weights dequantized to
//! `f32` on both sides (candle's `CANDLE_DEQUANTIZE_ALL`; see [`Matmul::Dequantized`]):
//! greedy generations of 64 tokens are identical token for token, and every step's
//! logits agree within [`MAX_REL_DIFF`] of the largest logit, through chunked prefill
//! mixed with decode, the prefix cache and forks. `tests/quantized.rs` runs the Q4_1
//! products as stored.
//!
//! Needs the model file (`examples/smollm/fetch-model.sh`). Without it each test prints
//! a loud SKIPPED line and passes, unless `KVPAGE_REQUIRE_MODEL=1` (CI), where it fails.

mod common;

use std::path::Path;
use std::sync::Once;

use common::{chat, config, loaded, model_path, reference_runs, requests, Agreement, NEW_TOKENS};
use kvpage::DType;
use kvpage_smollm::model::Matmul;
use kvpage_smollm::sample::{Sampler, Sampling};
use kvpage_smollm::serve::{serve, Report, Request, ServeConfig};

/// Largest difference of a logit allowed, relative to the largest logit of the step
/// (measured: about 1e-6).
const MAX_REL_DIFF: f32 = 1e-4;

/// The same with an f16 cache (keys and values rounded to 11 significant bits).
const MAX_REL_DIFF_F16: f32 = 2e-2;

/// The same with an 8-bit cache (codes with one scale per token and head; measured on
/// the two prompts below: int8 4.3e-2, 76 of 128 tokens alike before the first
/// difference; fp8 e4m3, 3 mantissa bits, 9.2e-2 and 70 of 128; on a Zen 4, whose FP8
/// decode rounds queries and weights to bf16, int8 3.9e-2 and 128 of 128, fp8 7.6e-2
/// and 66 of 128).
const MAX_REL_DIFF_INT8: f32 = 1e-1;
const MAX_REL_DIFF_FP8: f32 = 1.5e-1;

/// Switches candle's reference to dequantized weights before anything of candle runs
/// (candle reads the variable once per thread; this binary runs nothing quantized).
fn dequantize_reference() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1"));
}

/// Every completion of `report` equals candle's; prints the agreement.
fn check(test: &str, path: &Path, requests: &[Request], report: &Report) {
    let runs = reference_runs(path, requests, report);
    let mut all = Agreement::default();
    for (c, want) in report.completions.iter().zip(&runs) {
        let a = Agreement::of(c, want);
        let label = format!("{test}: request {} sample {}", c.request, c.sample);
        assert_eq!(c.tokens, want.tokens, "{label}: generations differ ({a:?})");
        assert!(a.max_rel <= MAX_REL_DIFF, "{label}: logits differ: {a:?}");
        all = all.merge(a);
    }
    println!(
        "{test}: {} completions, {}/{} tokens identical to candle's quantized_llama \
         (dequantized); logits: max abs diff {:.2e}, max diff / largest logit {:.2e} \
         (tolerance {MAX_REL_DIFF:.0e})",
        report.completions.len(),
        all.same_tokens,
        all.tokens,
        all.max_abs,
        all.max_rel
    );
}

/// Several prompts of different lengths served together, the prefills chunked by a
/// token budget below their total and mixed with decode: each generation equals candle's.
#[test]
fn greedy_generations_equal_candle() {
    dequantize_reference();
    let Some(path) = model_path("greedy_generations_equal_candle") else {
        return;
    };
    let lm = loaded(&path, Matmul::Dequantized);
    let prompts = [
        "What is the capital of France?",
        "Write a haiku about memory pages.",
        "Explain in two sentences why the sky is blue, for a child who keeps asking why.",
    ];
    let requests = requests(&lm.tokenizer, &prompts, 1);
    let mut greedy = Sampler::new(Sampling::Greedy);
    let report = serve(&lm.model, config(16, 48), &requests, &mut greedy).unwrap();
    assert!(report.prefill_steps >= 3, "the prefills took several steps");
    for c in &report.completions {
        assert_eq!(c.tokens.len(), NEW_TOKENS as usize);
        println!("{:?}", lm.tokenizer.decode(&c.tokens).unwrap());
    }
    check("greedy_generations_equal_candle", &path, &requests, &report);
}

/// Requests with one system prompt arriving after the first one's prompt is computed:
/// they start from its cached blocks (prefix hits) and still generate what candle does.
#[test]
fn prefix_cache_hits_equal_candle() {
    dequantize_reference();
    let Some(path) = model_path("prefix_cache_hits_equal_candle") else {
        return;
    };
    let lm = loaded(&path, Matmul::Dequantized);
    let prompts = [
        "Name three colors.",
        "Count from one to five.",
        "What is a cat?",
    ];
    let mut requests = requests(&lm.tokenizer, &prompts, 1);
    for r in &mut requests[1..] {
        r.arrival_step = 2;
    }
    let mut greedy = Sampler::new(Sampling::Greedy);
    let report = serve(&lm.model, config(8, 256), &requests, &mut greedy).unwrap();
    assert_eq!(report.completions[0].prefix_hit_tokens, 0);
    let system_len = chat(&lm.tokenizer, "").len();
    for c in &report.completions[1..] {
        // The whole 8-token blocks of the prefix shared with the first prompt.
        let prompt = &requests[c.request].prompt;
        let common = prompt
            .iter()
            .zip(&requests[0].prompt)
            .take_while(|(a, b)| a == b)
            .count();
        assert!(common + 8 >= system_len, "the system turn is shared");
        let want = (common.min(prompt.len() - 1) / 8 * 8) as u32;
        assert_eq!(c.prefix_hit_tokens, want, "request {}", c.request);
    }
    check("prefix_cache_hits_equal_candle", &path, &requests, &report);
}

/// Parallel samples by fork: sample `s` of a prompt takes the `s + 1`-th most likely
/// first token and continues greedily, sharing the prompt's blocks; each equals
/// candle's run from that first token.
#[test]
fn forked_samples_equal_candle() {
    dequantize_reference();
    let Some(path) = model_path("forked_samples_equal_candle") else {
        return;
    };
    let lm = loaded(&path, Matmul::Dequantized);
    let prompts = ["Tell me a fact about the moon.", "Say hello."];
    let requests = requests(&lm.tokenizer, &prompts, 3);
    let mut greedy = Sampler::new(Sampling::Greedy);
    let report = serve(&lm.model, config(16, 512), &requests, &mut greedy).unwrap();
    assert_eq!(report.completions.len(), 6);
    for c in &report.completions {
        assert_eq!(c.tokens.len(), NEW_TOKENS as usize);
    }
    let firsts: Vec<u32> = report.completions.iter().map(|c| c.tokens[0]).collect();
    assert_ne!(firsts[0], firsts[2], "samples start differently");
    check("forked_samples_equal_candle", &path, &requests, &report);
}

/// The cache in `dtype` (f16: half the bytes of f32; int8 / fp8: a quarter, plus a
/// scale per token and head): keys and values are rounded, so the generations agree
/// with candle's f32 cache for a while, not for ever. States the agreement; bounds the
/// logits up to the first different token by `max_rel`.
fn cache_agrees_with_candle(test: &str, dtype: DType, max_rel: f32) {
    dequantize_reference();
    let Some(path) = model_path(test) else {
        return;
    };
    let lm = loaded(&path, Matmul::Dequantized);
    let prompts = [
        "What is the capital of France?",
        "Write a haiku about memory pages.",
    ];
    let requests = requests(&lm.tokenizer, &prompts, 1);
    let mut greedy = Sampler::new(Sampling::Greedy);
    let config = ServeConfig {
        dtype,
        ..config(16, 512)
    };
    let report = serve(&lm.model, config, &requests, &mut greedy).unwrap();
    let runs = reference_runs(&path, &requests, &report);
    let mut all = Agreement::default();
    for (c, want) in report.completions.iter().zip(&runs) {
        let a = Agreement::of(c, want);
        assert!(
            a.max_rel <= max_rel,
            "{dtype:?} request {}: {a:?}",
            c.request
        );
        all = all.merge(a);
    }
    println!(
        "{dtype:?} cache: {}/{} tokens generated alike before the first difference; logits \
         up to it: max abs diff {:.2e}, max diff / largest logit {:.2e} (tolerance {max_rel:.0e})",
        all.same_tokens, all.tokens, all.max_abs, all.max_rel
    );
}

#[test]
fn f16_cache_agrees_with_candle() {
    cache_agrees_with_candle("f16_cache_agrees_with_candle", DType::F16, MAX_REL_DIFF_F16);
}

#[test]
fn int8_cache_agrees_with_candle() {
    cache_agrees_with_candle(
        "int8_cache_agrees_with_candle",
        DType::Int8,
        MAX_REL_DIFF_INT8,
    );
}

#[test]
fn fp8_cache_agrees_with_candle() {
    cache_agrees_with_candle(
        "fp8_cache_agrees_with_candle",
        DType::Fp8E4m3,
        MAX_REL_DIFF_FP8,
    );
}
