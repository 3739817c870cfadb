//! `cargo run --release -p kvpage-examples --bin replay -- --help`
//!
//! Replays a request trace through a contiguous baseline and kvpage's paged KV cache and
//! prints a table per policy. With no arguments it replays the excerpt of the Azure LLM
//! inference trace shipped in `examples/traces/`.
#![forbid(unsafe_code)]

use clap::Parser;
use kvpage_examples::replay::{main_with, Args};

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match main_with(&args) {
        Ok(text) => {
            print!("{text}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(2)
        }
    }
}
