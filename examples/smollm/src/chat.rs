//! Prompt templates: the text as it is, or SmolLM2's chat template (ChatML, the
//! template in the GGUF file's `tokenizer.chat_template`): a system turn, a user turn and
//! the opening of the assistant's turn.

/// How a prompt becomes the model's input text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Template {
    /// The prompt as it is (text completion).
    #[default]
    Raw,
    /// `<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n
    /// <|im_start|>assistant\n`.
    ChatMl,
}

/// The system prompt SmolLM2's template uses when none is given.
pub const DEFAULT_SYSTEM: &str =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

impl Template {
    /// The model input for `prompt` with `system` as the system turn (ignored by
    /// [`Template::Raw`]). Every prompt with the same system turn starts with the same
    /// text, so their first blocks are shared through the prefix cache. O(text).
    pub fn apply(self, system: &str, prompt: &str) -> String {
        match self {
            Self::Raw => prompt.to_string(),
            Self::ChatMl => format!(
                "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
            ),
        }
    }
}
