//! Benchmark: SmolLM2-135M through kvpage against candle's own quantized Llama in the
//! same run, at batch 1 and batch 16 (prefill and decode tokens/s), and the KV bytes
//! kvpage held against a contiguous `max_seq_len` reservation per sequence.
//!
//! ```sh
//! cargo run --release --manifest-path examples/smollm/Cargo.toml --bin bench
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use kvpage::DType;
use kvpage_smollm::chat::{Template, DEFAULT_SYSTEM};
use kvpage_smollm::model::{Matmul, Model};
use kvpage_smollm::model_file::default_path;
use kvpage_smollm::reference::Reference;
use kvpage_smollm::sample::{Sampler, Sampling};
use kvpage_smollm::serve::{serve, Request, ServeConfig};
use kvpage_smollm::tokenizer::Tokenizer;
use kvpage_smollm::Error;

/// The prompts of the batches (the first `batch` of them, cut to one token length so
/// candle's batched forward takes them).
const QUESTIONS: [&str; 16] = [
    "What is the capital of France?",
    "Why is the sky blue during the day?",
    "Give me three tips for better sleep.",
    "What does a compiler do, briefly?",
    "Name a famous painting and its painter.",
    "How do plants make their own food?",
    "What is the boiling point of water?",
    "Write one sentence about the ocean.",
    "What is two plus two, and why?",
    "Suggest a name for a small gray cat.",
    "What is the largest planet we know?",
    "Describe a rainy morning in a city.",
    "What language is spoken in Brazil?",
    "Why do leaves change color in fall?",
    "What is a prime number, in short?",
    "Tell me a fun fact about octopuses.",
];

/// kvpage against candle's quantized Llama at batch 1 and 16.
#[derive(Parser, Debug)]
struct Args {
    /// The GGUF file (default: $KVPAGE_MODEL_DIR or ~/.cache/kvpage/smollm2).
    model: Option<PathBuf>,
    /// Multiply with the weights dequantized to f32 (exact agreement with candle's
    /// reference; slower) instead of the stored Q4_1 products.
    #[arg(long)]
    dequantize: bool,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 64)]
    new_tokens: u32,
    /// The contiguous reservation compared against, tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    max_seq_len: u32,
    /// Batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    batches: Vec<usize>,
}

fn matmul(dequantize: bool) -> Matmul {
    if dequantize {
        Matmul::Dequantized
    } else {
        Matmul::Quantized
    }
}

fn run(args: &Args) -> Result<(), Error> {
    let path = args.model.clone().unwrap_or_else(default_path);
    if !path.is_file() {
        return Err(Error::MissingModel(path));
    }
    let (model, content) = Model::load(&path, args.max_seq_len as usize, matmul(args.dequantize))?;
    let tokenizer = Tokenizer::from_gguf(&content)?;
    let mut reference = Reference::load(&path)?;
    let new = args.new_tokens as usize;
    println!(
        "{:>5} {:<8} {:>15} {:>15} {:>13} {:>18} {:>10}",
        "batch",
        "impl",
        "prefill tok/s",
        "decode tok/s",
        "KV held MiB",
        "contiguous MiB",
        "alike %"
    );
    for &batch in &args.batches {
        let batch = batch.clamp(1, QUESTIONS.len());
        let mut prompts = QUESTIONS[..batch]
            .iter()
            .map(|q| tokenizer.encode(&Template::ChatMl.apply(DEFAULT_SYSTEM, q)))
            .collect::<Result<Vec<_>, _>>()?;
        let len = prompts.iter().map(Vec::len).min().unwrap_or(0);
        prompts.iter_mut().for_each(|p| p.truncate(len));
        let requests: Vec<Request> = prompts
            .iter()
            .map(|p| Request {
                prompt: p.clone(),
                max_new_tokens: args.new_tokens,
                samples: 1,
                arrival_step: 0,
            })
            .collect();
        let config = ServeConfig {
            block_size: 16,
            // What the batch needs, and a block of slack per sequence.
            blocks: batch as u32 * ((len as u32 + args.new_tokens).div_ceil(16) + 1),
            max_seqs: batch as u32,
            max_seq_len: args.max_seq_len,
            token_budget: (batch * len) as u32 + batch as u32,
            dtype: DType::F32,
            threads: 1,
            eos: None,
            keep_logits: false,
        };
        let report = serve(
            &model,
            config,
            &requests,
            &mut Sampler::new(Sampling::Greedy),
        )?;

        let start = Instant::now();
        let mut first = None;
        let generated = reference.generate(&prompts, new, None, |_, _, logits| {
            // The first choice comes right after the prompts' forward pass.
            if first.is_none() {
                first = Some(start.elapsed());
            }
            Sampler::new(Sampling::Greedy).pick(logits, 0)
        })?;
        let total = start.elapsed();
        let prefill = first.unwrap_or(total);
        // Leading tokens generated alike (all of them with --dequantize; with the
        // Q4_1 products, until a near tie flips, see tests/quantized.rs).
        let alike: usize = report
            .completions
            .iter()
            .zip(&generated)
            .map(|(c, g)| {
                c.tokens
                    .iter()
                    .zip(&g.tokens)
                    .take_while(|(a, b)| a == b)
                    .count()
            })
            .sum();
        let alike = 100.0 * alike as f64 / (batch * new) as f64;

        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let contiguous = batch as u64 * u64::from(args.max_seq_len) * report.bytes_per_token;
        let held = u64::from(report.peak_blocks) * report.bytes_per_block;
        let candle_held = (batch * (len + new)) as u64 * report.bytes_per_token;
        println!(
            "{batch:>5} {:<8} {:>15.1} {:>15.1} {:>13.2} {:>18.2} {:>10.1}",
            "kvpage",
            report.prefill_rate(),
            report.decode_rate(),
            mib(held),
            mib(contiguous),
            alike
        );
        println!(
            "{batch:>5} {:<8} {:>15.1} {:>15.1} {:>13.2} {:>18} {:>10}",
            "candle",
            (batch * len) as f64 / prefill.as_secs_f64(),
            (batch * (new - 1)) as f64 / (total - prefill).as_secs_f64(),
            mib(candle_held),
            "-",
            ""
        );
    }
    println!(
        "(prompts of one length per batch; greedy, {new} new tokens each; kvpage: f32 KV in \
         16-token blocks, 'KV held' its peak; candle: its concatenated cache at the end, \
         batched prompts read one position per pass; 'alike': leading tokens kvpage and \
         candle generated alike)"
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.dequantize {
        // candle's reference reads its switch when it loads, on this thread.
        std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e}");
            ExitCode::FAILURE
        }
    }
}
