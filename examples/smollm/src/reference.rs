//! candle's own quantized Llama (`candle_transformers::models::quantized_llama`) on the
//! same file: the implementation the tests and the benchmark compare kvpage's against.
//! It keeps a contiguous K/V tensor per layer that grows by concatenation.

use std::fs::File;
use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;

use crate::Error;

/// candle's model, with its own per-layer KV cache.
pub struct Reference {
    weights: ModelWeights,
}

/// A generation of the reference: the tokens and the logits each was chosen from.
#[derive(Debug, Clone)]
pub struct Generated {
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// `logits[i]`: the logits token `i` was chosen from.
    pub logits: Vec<Vec<f32>>,
}

impl Reference {
    /// Loads `path`. O(file size).
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::Candle`].
    pub fn load(path: &Path) -> Result<Self, Error> {
        let mut file = File::open(path)?;
        let content = gguf_file::Content::read(&mut file)?;
        let weights = ModelWeights::from_gguf(content, &mut file, &Device::Cpu)?;
        Ok(Self { weights })
    }

    /// Runs `prompts` (a batch: all of one length, at least one token; a batch of several
    /// reads them one position per forward pass) and then `max_new` tokens each, the
    /// token of step `i` of sequence `b` chosen by `choose(b, i, logits)`; stops early
    /// when every sequence chose `eos`. O(batch × (prompt + max_new) × (weights +
    /// context)).
    ///
    /// # Errors
    /// [`Error::Candle`], e.g. for prompts of different lengths.
    pub fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        max_new: usize,
        eos: Option<u32>,
        mut choose: impl FnMut(usize, usize, &[f32]) -> u32,
    ) -> Result<Vec<Generated>, Error> {
        self.weights.clear_kv_cache();
        let mut out = vec![
            Generated {
                tokens: Vec::new(),
                logits: Vec::new(),
            };
            prompts.len()
        ];
        // candle's forward refuses a batch of several prompt tokens per sequence (the
        // last position of a [batch, tokens] hidden state is not contiguous for its
        // output product), so a batch reads its prompts one position per pass.
        let len = prompts.first().map_or(0, Vec::len);
        let chunk = if prompts.len() > 1 { 1 } else { len.max(1) };
        let mut pos = 0;
        while pos + chunk < len {
            let part: Vec<Vec<u32>> = prompts
                .iter()
                .map(|p| p[pos..pos + chunk].to_vec())
                .collect();
            self.weights
                .forward(&Tensor::new(part, &Device::Cpu)?, pos)?;
            pos += chunk;
        }
        let last: Vec<Vec<u32>> = prompts.iter().map(|p| p[pos..].to_vec()).collect();
        let mut input = Tensor::new(last, &Device::Cpu)?;
        for step in 0..max_new {
            let logits = self.weights.forward(&input, pos)?.to_vec2::<f32>()?;
            pos += input.dim(1)?;
            let mut next = Vec::with_capacity(prompts.len());
            for (b, (l, g)) in logits.into_iter().zip(&mut out).enumerate() {
                let t = choose(b, step, &l);
                g.tokens.push(t);
                g.logits.push(l);
                next.push(vec![t]);
            }
            if eos.is_some_and(|e| next.iter().all(|t| t[0] == e)) {
                break;
            }
            input = Tensor::new(next, &Device::Cpu)?;
        }
        Ok(out)
    }

    /// The next-token logits after `prompt`, run in forward passes of `chunk` tokens
    /// (`chunk = 1`: token by token). Compares candle with itself: the logits of one
    /// prompt depend on how it is split. O(prompt × (weights + prompt)).
    ///
    /// # Errors
    /// [`Error::Candle`].
    pub fn prompt_logits(&mut self, prompt: &[u32], chunk: usize) -> Result<Vec<f32>, Error> {
        self.weights.clear_kv_cache();
        let mut logits = Vec::new();
        for (i, part) in prompt.chunks(chunk.max(1)).enumerate() {
            let input = Tensor::new(part, &Device::Cpu)?.unsqueeze(0)?;
            logits = self
                .weights
                .forward(&input, i * chunk.max(1))?
                .flatten_all()?
                .to_vec1()?;
        }
        Ok(logits)
    }
}
