//! What the tests against candle's quantized Llama share: finding the model file (a
//! loud skip without it, a failure with `KVPAGE_REQUIRE_MODEL=1`), loading it once per
//! test binary, and running what kvpage served through candle for comparison.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kvpage::DType;
use kvpage_smollm::chat::{Template, DEFAULT_SYSTEM};
use kvpage_smollm::model::{Matmul, Model};
use kvpage_smollm::model_file::{default_path, missing_help};
use kvpage_smollm::reference::{Generated, Reference};
use kvpage_smollm::sample::{Sampler, Sampling};
use kvpage_smollm::serve::{Completion, Report, Request, ServeConfig};
use kvpage_smollm::tokenizer::Tokenizer;

/// Tokens generated per prompt.
pub const NEW_TOKENS: u32 = 64;

/// The model file, or `None` after a loud message (a failure with
/// `KVPAGE_REQUIRE_MODEL=1`).
pub fn model_path(test: &str) -> Option<PathBuf> {
    let path = default_path();
    if path.is_file() {
        return Some(path);
    }
    let msg = missing_help(&path);
    if std::env::var("KVPAGE_REQUIRE_MODEL").is_ok_and(|v| v == "1") {
        panic!("{test}: KVPAGE_REQUIRE_MODEL=1 and {msg}");
    }
    // Straight to the process's stderr: the test harness captures `eprintln!`, and a
    // skip must be seen.
    let line = format!("\n!!!!! SKIPPED {test}: {msg} !!!!!\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    None
}

/// The model and its tokenizer.
pub struct Loaded {
    pub model: Model,
    pub tokenizer: Tokenizer,
}

/// The model multiplying as `matmul` says and its tokenizer, loaded once per test binary
/// (every test of one binary passes the same `matmul`).
pub fn loaded(path: &Path, matmul: Matmul) -> &'static Loaded {
    static LOADED: OnceLock<Loaded> = OnceLock::new();
    LOADED.get_or_init(|| {
        let (model, content) = Model::load(path, 1024, matmul).unwrap();
        let tokenizer = Tokenizer::from_gguf(&content).unwrap();
        Loaded { model, tokenizer }
    })
}

/// A cache of 512 blocks for 16 sequences of up to 1024 tokens, f32, one kernel thread,
/// no end-of-sequence stop, every step's logits kept.
pub fn config(block_size: u32, token_budget: u32) -> ServeConfig {
    ServeConfig {
        block_size,
        blocks: 512,
        max_seqs: 16,
        max_seq_len: 1024,
        token_budget,
        dtype: DType::F32,
        threads: 1,
        eos: None,
        keep_logits: true,
    }
}

/// `prompt` in the chat template with the default system turn, as token ids.
pub fn chat(tokenizer: &Tokenizer, prompt: &str) -> Vec<u32> {
    tokenizer
        .encode(&Template::ChatMl.apply(DEFAULT_SYSTEM, prompt))
        .unwrap()
}

/// Requests of `max_new_tokens` and `samples` for the chat prompts `prompts`, all
/// arriving at step 0.
pub fn requests(tokenizer: &Tokenizer, prompts: &[&str], samples: u32) -> Vec<Request> {
    prompts
        .iter()
        .map(|p| Request {
            prompt: chat(tokenizer, p),
            max_new_tokens: NEW_TOKENS,
            samples,
            arrival_step: 0,
        })
        .collect()
}

/// candle's generation for each completion of `report`: its request's prompt, as many
/// tokens, greedy, except that a parallel sample's first token is the sample's.
pub fn reference_runs(path: &Path, requests: &[Request], report: &Report) -> Vec<Generated> {
    let mut reference = Reference::load(path).unwrap();
    report
        .completions
        .iter()
        .map(|c| {
            let first = c.tokens[0];
            let prompt = [requests[c.request].prompt.clone()];
            let choose = |_: usize, step: usize, logits: &[f32]| {
                if step == 0 && c.sample > 0 {
                    first
                } else {
                    Sampler::new(Sampling::Greedy).pick(logits, 0)
                }
            };
            reference
                .generate(&prompt, c.tokens.len(), None, choose)
                .unwrap()
                .remove(0)
        })
        .collect()
}

/// How one kvpage completion agrees with candle's generation of it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Agreement {
    /// Leading tokens that are equal.
    pub same_tokens: usize,
    /// Tokens compared.
    pub tokens: usize,
    /// Largest absolute logit difference over the steps up to the first different token
    /// (afterwards the two continue different texts).
    pub max_abs: f32,
    /// Largest `difference / largest |logit|` of a step, over the same steps.
    pub max_rel: f32,
}

impl Agreement {
    /// Compares `got` with `want`. O(tokens × vocabulary).
    pub fn of(got: &Completion, want: &Generated) -> Self {
        let same_tokens = got
            .tokens
            .iter()
            .zip(&want.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        let mut out = Self {
            same_tokens,
            tokens: got.tokens.len(),
            ..Self::default()
        };
        let steps = (same_tokens + 1).min(got.tokens.len());
        for (g, w) in got.logits.iter().zip(&want.logits).take(steps) {
            let scale = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let d = g
                .iter()
                .zip(w)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            out.max_abs = out.max_abs.max(d);
            out.max_rel = out.max_rel.max(d / scale);
        }
        out
    }

    /// The worse of two agreements, token counts added.
    pub fn merge(self, other: Self) -> Self {
        Self {
            same_tokens: self.same_tokens + other.same_tokens,
            tokens: self.tokens + other.tokens,
            max_abs: self.max_abs.max(other.max_abs),
            max_rel: self.max_rel.max(other.max_rel),
        }
    }
}
