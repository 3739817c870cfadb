//! Generates text with SmolLM2-135M-Instruct through kvpage: several prompts at once
//! through the engine step, then a table of what each request cost.
//!
//! ```sh
//! examples/smollm/fetch-model.sh
//! cargo run --release --manifest-path examples/smollm/Cargo.toml --bin generate -- \
//!     --chat-template --prompt "What is the capital of France?" --prompt "Say hello."
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kvpage::DType;
use kvpage_smollm::chat::{Template, DEFAULT_SYSTEM};
use kvpage_smollm::model::{Matmul, Model};
use kvpage_smollm::model_file::default_path;
use kvpage_smollm::sample::{Sampler, Sampling};
use kvpage_smollm::serve::{serve, Report, Request, ServeConfig};
use kvpage_smollm::tokenizer::Tokenizer;
use kvpage_smollm::Error;

/// SmolLM2-135M-Instruct (GGUF) generating text with its KV cache in kvpage.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The GGUF file (default: $KVPAGE_MODEL_DIR or ~/.cache/kvpage/smollm2, filled by
    /// examples/smollm/fetch-model.sh).
    model: Option<PathBuf>,
    /// A prompt (repeat the flag for several).
    #[arg(long = "prompt")]
    prompts: Vec<String>,
    /// A file of prompts, one per line (empty lines skipped).
    #[arg(long)]
    prompts_file: Option<PathBuf>,
    /// Wrap each prompt in the model's chat template (system, user, assistant turns).
    #[arg(long)]
    chat_template: bool,
    /// The system turn of the chat template; shared by every prompt, so its blocks are
    /// computed once and then hit in the prefix cache.
    #[arg(long, default_value = DEFAULT_SYSTEM)]
    system: String,
    /// Multiply with the weights dequantized to f32 (exact agreement with candle's
    /// reference; slower) instead of the stored Q4_1 products.
    #[arg(long)]
    dequantize: bool,
    /// Tokens to generate per prompt at most.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Sample at --temperature from this seed (default: greedy).
    #[arg(long)]
    seed: Option<u64>,
    /// Temperature of seeded sampling.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Parallel samples per prompt, forked from the request after its first token
    /// (greedy: the 2nd, 3rd, ... most likely first token).
    #[arg(long, default_value_t = 1)]
    samples: u32,
    /// Queue every prompt at once (default: the first prompt runs one step ahead, so the
    /// others find its prefix in the cache).
    #[arg(long)]
    all_at_once: bool,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// KV blocks in the arena.
    #[arg(long, default_value_t = 1024)]
    blocks: u32,
    /// Tokens one sequence may hold.
    #[arg(long, default_value_t = 2048)]
    max_seq_len: u32,
    /// Storage type of the KV cache: f32, f16 or bf16 (half the bytes), int8 or fp8 (a
    /// quarter, plus a scale per token and head); attention accumulates in f32.
    #[arg(long, default_value = "f32", value_parser = kvpage_examples::presets::kv_dtype)]
    kv_dtype: DType,
    /// Tokens computed per engine step at most.
    #[arg(long, default_value_t = 512)]
    token_budget: u32,
    /// Threads of kvpage's attention kernels (0: one per core). candle's products use
    /// every core already; at this model's size attention is a small share of a step,
    /// and more kernel threads only compete with candle's for the cores.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Also print each prompt's token ids (`prompt-ids PROMPT: id id ...`) and each
    /// generation's (`ids PROMPT SAMPLE: id id ...`), as examples/c/smollm.c prints them
    /// (examples/c/check_smollm.sh compares the two).
    #[arg(long)]
    print_ids: bool,
}

fn prompts(args: &Args) -> Result<Vec<String>, Error> {
    let mut prompts = args.prompts.clone();
    if let Some(file) = &args.prompts_file {
        let text = std::fs::read_to_string(file)?;
        prompts.extend(
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(String::from),
        );
    }
    if prompts.is_empty() {
        prompts.push("What is a paged KV cache?".into());
    }
    Ok(prompts)
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
    let template = if args.chat_template {
        Template::ChatMl
    } else {
        Template::Raw
    };
    let texts = prompts(args)?;
    let requests = texts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            Ok(Request {
                prompt: tokenizer.encode(&template.apply(&args.system, p))?,
                max_new_tokens: args.max_tokens,
                samples: args.samples.max(1),
                arrival_step: u64::from(i > 0 && !args.all_at_once),
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    let sampling = match args.seed {
        Some(seed) => Sampling::Temperature {
            temperature: args.temperature,
            seed,
        },
        None => Sampling::Greedy,
    };
    let config = ServeConfig {
        block_size: args.block_size,
        blocks: args.blocks,
        max_seqs: (requests.len() as u32 * args.samples.max(1)).max(1),
        max_seq_len: args.max_seq_len,
        token_budget: args.token_budget,
        dtype: args.kv_dtype,
        threads: args.threads,
        eos: Some(tokenizer.eos),
        keep_logits: false,
    };
    if args.print_ids {
        for (i, r) in requests.iter().enumerate() {
            let ids: Vec<String> = r.prompt.iter().map(u32::to_string).collect();
            println!("prompt-ids {i}: {}", ids.join(" "));
        }
    }
    let report = serve(&model, config, &requests, &mut Sampler::new(sampling))?;
    for c in &report.completions {
        println!(
            "--- prompt {} sample {}: {}\n{}\n",
            c.request,
            c.sample,
            texts[c.request],
            tokenizer.decode(&c.tokens)?
        );
        if args.print_ids {
            let ids: Vec<String> = c.tokens.iter().map(u32::to_string).collect();
            println!("ids {} {}: {}\n", c.request, c.sample, ids.join(" "));
        }
    }
    print_table(&texts, &report, args.max_seq_len);
    Ok(())
}

fn print_table(texts: &[String], report: &Report, max_seq_len: u32) {
    println!(
        "{:>3} {:>6} {:<32} {:>7} {:>9} {:>10} {:>8}",
        "#", "sample", "prompt", "prompt", "generated", "prefix-hit", "TTFT ms"
    );
    for c in &report.completions {
        let text: String = texts[c.request].chars().take(32).collect();
        println!(
            "{:>3} {:>6} {:<32} {:>7} {:>9} {:>10} {:>8.1}",
            c.request,
            c.sample,
            text,
            c.prompt_tokens,
            c.tokens.len(),
            c.prefix_hit_tokens,
            c.time_to_first_token.as_secs_f64() * 1e3
        );
    }
    let peak = report.peak_blocks as u64 * report.bytes_per_block;
    let contiguous =
        report.completions.len() as u64 * u64::from(max_seq_len) * report.bytes_per_token;
    println!(
        "peak KV: {} blocks, {:.2} MiB (a contiguous {max_seq_len}-token reservation per \
         sequence: {:.2} MiB)",
        report.peak_blocks,
        peak as f64 / (1 << 20) as f64,
        contiguous as f64 / (1 << 20) as f64
    );
    println!(
        "prefill: {} tokens, {:.1} tokens/s; decode: {} tokens, {:.1} tokens/s; {} engine steps",
        report.prefill_tokens,
        report.prefill_rate(),
        report.decode_tokens,
        report.decode_rate(),
        report.steps
    );
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("generate: {e}");
            ExitCode::FAILURE
        }
    }
}
