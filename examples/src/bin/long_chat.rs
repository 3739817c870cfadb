//! `cargo run --release -p kvpage-examples --bin long_chat`
//!
//! A scripted conversation with a tiny transformer on the CPU that runs far past the
//! cache's per-sequence capacity by context shift (no token recomputed), checked against
//! a dense reference; then saved, restored into a fresh cache, and continued there with
//! outputs identical to the original's. Exits 1 if a check fails.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    match kvpage_examples::long_chat::run(&kvpage_examples::long_chat::Script::default()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
