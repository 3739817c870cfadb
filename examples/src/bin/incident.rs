//! `cargo run --release -p kvpage-examples --bin incident`
//!
//! Replays the incident of the design document — a 13B-class model, 54 GB of KV memory,
//! 120 requests, `max_seq_len` 4096 — through a contiguous first-fit baseline and
//! kvpage's block manager, and prints what the simulation shows, side by side.
#![forbid(unsafe_code)]

use clap::Parser;

/// Replay the design document's incident: contiguous reservations vs. kvpage blocks.
#[derive(Parser)]
#[command(name = "incident", version)]
struct Args {
    /// Seed for prompt and output lengths
    #[arg(long, default_value_t = 2024)]
    seed: u64,
    /// KV cache element type: f16, bf16, f32, int8 or fp8 (the 8-bit ones with a scale
    /// per token and head): the same 54 GB hold more tokens
    #[arg(long, default_value = "f16")]
    kv_dtype: String,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let dtype = match kvpage_examples::presets::kv_dtype(&args.kv_dtype) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match kvpage_examples::incident::run_incident_in(args.seed, dtype) {
        Ok(inc) => {
            print!("{}", kvpage_examples::incident::render(&inc));
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(2)
        }
    }
}
