//! The tokenizer of the model, built from the GGUF file alone: its vocabulary, merges and
//! token types (`tokenizer.ggml.*`) become a byte-level BPE of the `tokenizers` crate,
//! with the pre-tokenizer of SmolLM2 (digits split one by one, then GPT-2's byte-level
//! split) and the control tokens (`<|im_start|>`, ...) matched as whole special tokens.

use candle_core::quantized::gguf_file;
use serde_json::{json, Value};

use crate::model::metadata;
use crate::Error;

/// GGUF token type of a control token (llama.cpp's `LLAMA_TOKEN_TYPE_CONTROL`).
const CONTROL: i32 = 3;

/// Text to token ids and back.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// End-of-sequence token id.
    pub eos: u32,
}

impl Tokenizer {
    /// Builds the tokenizer of a `gpt2`-style GGUF vocabulary. O(vocabulary + merges).
    ///
    /// # Errors
    /// [`Error::Metadata`] for a missing key or another tokenizer model;
    /// [`Error::Tokenizer`] if the `tokenizers` crate refuses the result.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self, Error> {
        let kind = metadata(content, "tokenizer.ggml.model")?.to_string()?;
        if kind != "gpt2" {
            return Err(Error::Metadata(format!("tokenizer {kind}, not gpt2")));
        }
        let strings = |key: &str| -> Result<Vec<String>, Error> {
            metadata(content, key)?
                .to_vec()?
                .iter()
                .map(|v| Ok(v.to_string()?.clone()))
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<i32> = match content.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()?
                .iter()
                .map(|t| t.to_i32())
                .collect::<Result<_, _>>()?,
            None => Vec::new(),
        };
        let vocab: serde_json::Map<String, Value> = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| (t.clone(), json!(id)))
            .collect();
        let added: Vec<Value> = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, &ty))| ty == CONTROL)
            .map(|(id, (t, _))| {
                json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let spec = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                 "use_regex": true}
            ]},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                        "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges}
        });
        let inner: tokenizers::Tokenizer = spec
            .to_string()
            .parse()
            .map_err(|e| Error::Tokenizer(format!("{e}")))?;
        let eos = metadata(content, "tokenizer.ggml.eos_token_id")?.to_u32()?;
        Ok(Self { inner, eos })
    }

    /// The token ids of `text` (special tokens written out, e.g. `<|im_start|>`, become
    /// their ids). O(text).
    ///
    /// # Errors
    /// [`Error::Tokenizer`].
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, Error> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(format!("{e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens left out. O(ids).
    ///
    /// # Errors
    /// [`Error::Tokenizer`].
    pub fn decode(&self, ids: &[u32]) -> Result<String, Error> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(format!("{e}")))
    }
}
