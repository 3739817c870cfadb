//! The one error type of the example: candle's, kvpage's, the tokenizer's, or a model
//! file that does not describe the model this example runs.

use core::fmt;

/// Why loading or running the model failed.
#[derive(Debug)]
pub enum Error {
    /// candle refused an operation (a tensor missing from the file, a shape mismatch).
    Candle(candle_core::Error),
    /// The KV cache or the engine refused an operation.
    Cache(kvpage::CacheError),
    /// The tokenizer could not be built or could not encode or decode.
    Tokenizer(String),
    /// The model file's metadata lacks a key or holds an unexpected value.
    Metadata(String),
    /// The model file could not be opened.
    Io(std::io::Error),
    /// The cache holds longer sequences than the model's rotary tables cover.
    TooLong {
        /// The cache's `max_seq_len`.
        max_seq_len: u32,
        /// Positions the model was loaded for.
        positions: usize,
    },
    /// No model file at this path (the message says how to fetch it).
    MissingModel(std::path::PathBuf),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Candle(e) => write!(f, "candle: {e}"),
            Self::Cache(e) => write!(f, "kvpage: {e}"),
            Self::Tokenizer(e) => write!(f, "tokenizer: {e}"),
            Self::Metadata(e) => write!(f, "model metadata: {e}"),
            Self::Io(e) => write!(f, "model file: {e}"),
            Self::TooLong {
                max_seq_len,
                positions,
            } => write!(
                f,
                "sequences of {max_seq_len} tokens, rotary tables for {positions} positions"
            ),
            Self::MissingModel(path) => f.write_str(&crate::model_file::missing_help(path)),
        }
    }
}

impl std::error::Error for Error {}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Self::Candle(e)
    }
}

impl From<kvpage::CacheError> for Error {
    fn from(e: kvpage::CacheError) -> Self {
        Self::Cache(e)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}
