//! The transformer of a GGUF Llama, run with candle's quantized matrix products, whose
//! attention is delegated to an [`Attention`] — kvpage's engine step in this example.
//!
//! The model computes a flat batch of token rows (`[rows][hidden]`): every scheduled
//! sequence's new tokens, one after another, each with its own position. The matrix
//! products, norms and MLP treat rows independently, so a batch mixes prefill chunks and
//! decode tokens of many sequences freely; only attention needs to know which rows
//! belong to which sequence, and kvpage knows that from its step.

use std::fs::File;
use std::path::Path;

use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{Device, Module, Tensor};
use kvpage::{DType, Geometry};

use crate::rope::Rope;
use crate::Error;

/// The shape of the model, read from the GGUF metadata (`llama.*` keys).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hparams {
    /// Transformer layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: usize,
    /// Dimensions of one head.
    pub head_dim: usize,
    /// Width of the hidden state.
    pub hidden: usize,
    /// Epsilon of the RMS norms.
    pub rms_eps: f32,
    /// Base of the rotary embedding.
    pub rope_base: f32,
    /// Longest context the model was trained for.
    pub context_len: usize,
}

/// A GGUF metadata value by key, or [`Error::Metadata`].
pub(crate) fn metadata<'c>(
    content: &'c gguf_file::Content,
    key: &str,
) -> Result<&'c gguf_file::Value, Error> {
    content
        .metadata
        .get(key)
        .ok_or_else(|| Error::Metadata(format!("missing {key}")))
}

impl Hparams {
    /// Reads the shape of a `llama` model. O(1).
    ///
    /// # Errors
    /// [`Error::Metadata`] for another architecture or a missing key.
    pub fn read(content: &gguf_file::Content) -> Result<Self, Error> {
        let arch = metadata(content, "general.architecture")?.to_string()?;
        if arch != "llama" {
            return Err(Error::Metadata(format!("architecture {arch}, not llama")));
        }
        let u = |key: &str| -> Result<usize, Error> {
            Ok(metadata(content, &format!("llama.{key}"))?.to_u32()? as usize)
        };
        let heads = u("attention.head_count")?;
        let hidden = u("embedding_length")?;
        let head_dim = hidden / heads.max(1);
        if heads == 0 || head_dim * heads != hidden || head_dim % 2 != 0 {
            return Err(Error::Metadata(format!("{heads} heads of width {hidden}")));
        }
        if u("rope.dimension_count")? != head_dim {
            return Err(Error::Metadata("partial rotary embedding".into()));
        }
        let rope_base = match content.metadata.get("llama.rope.freq_base") {
            Some(v) => v.to_f32()?,
            None => 10_000.0,
        };
        Ok(Self {
            layers: u("block_count")?,
            heads,
            kv_heads: u("attention.head_count_kv")?,
            head_dim,
            hidden,
            rms_eps: metadata(content, "llama.attention.layer_norm_rms_epsilon")?.to_f32()?,
            rope_base,
            context_len: u("context_length")?,
        })
    }

    /// The KV geometry of this model in a cache of `block_size`-token blocks of `dtype`.
    ///
    /// # Errors
    /// [`Error::Metadata`] when kvpage refuses the geometry (a zero dimension).
    pub fn geometry(&self, block_size: u32, dtype: DType) -> Result<Geometry, Error> {
        Geometry::new(
            self.layers as u32,
            self.kv_heads as u32,
            self.head_dim as u32,
            block_size,
            dtype,
        )
        .map_err(|e| Error::Metadata(format!("geometry: {e:?}")))
    }

    /// The scale of the attention scores, `1 / sqrt(head_dim)`.
    pub fn attention_scale(&self) -> f32 {
        (self.head_dim as f32).sqrt().recip()
    }
}

/// How the weight matrices are multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Matmul {
    /// As stored (Q4_1, about 100 MB in memory): candle quantizes each input row to 8
    /// bits (Q8_1) and multiplies in integers, as llama.cpp does. The 8-bit rounding of
    /// activations makes the logits depend on the last bits of everything before
    /// (candle's own model differs from itself by about 1 logit between a prompt run
    /// whole and run token by token), so two implementations agree for a while, not for
    /// ever.
    #[default]
    Quantized,
    /// The file's weights dequantized once to `f32` (about 4× the memory), inputs kept
    /// in `f32` (candle's `CANDLE_DEQUANTIZE_ALL` mode): the same model without
    /// activation rounding, where implementations agree to about 1e-5. Its products are
    /// blocked matrix multiplications, so prompts run much faster than through the
    /// quantized products (measured on 2 cores: 229 against 13–25 prompt tokens/s).
    Dequantized,
}

/// Where the keys and values of a batch go and where attention over them comes from.
pub trait Attention {
    /// Stores `k` and `v` (`[rows][kv_heads][head_dim]`, rotated keys) of layer `layer`
    /// for the rows of the batch, then writes into `out` (`[rows][heads][head_dim]`) each
    /// row's attention over its sequence's context, causal, queries `q` (rotated).
    ///
    /// # Errors
    /// The implementation's; the forward pass stops at the first.
    fn attend(
        &mut self,
        layer: u32,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), Error>;
}

struct Layer {
    attn_norm: Tensor,
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    ffn_norm: Tensor,
    gate: QMatMul,
    up: QMatMul,
    down: QMatMul,
}

/// The weights (quantized as in the file; embeddings and norms dequantized) and the
/// rotary tables.
pub struct Model {
    hparams: Hparams,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    output: QMatMul,
    rope: Rope,
    device: Device,
}

impl Model {
    /// Loads the model of `path`, multiplying as `matmul` says, with rotary tables for
    /// `max_positions` positions (the cache's `max_seq_len`). Also returns the file's metadata, which holds the
    /// tokenizer. O(file size).
    ///
    /// # Errors
    /// [`Error::Io`] if the file cannot be read; [`Error::Candle`] for a malformed file
    /// or a missing tensor; [`Error::Metadata`] for a model that is not a Llama.
    pub fn load(
        path: &Path,
        max_positions: usize,
        matmul: Matmul,
    ) -> Result<(Self, gguf_file::Content), Error> {
        let mut file = File::open(path)?;
        let content = gguf_file::Content::read(&mut file)?;
        let hparams = Hparams::read(&content)?;
        let device = Device::Cpu;
        let mut tensor = |name: &str| content.tensor(&mut file, name, &device);
        let embed_q = tensor("token_embd.weight")?;
        let embed = embed_q.dequantize(&device)?;
        let norm = tensor("output_norm.weight")?.dequantize(&device)?;
        // Tied embeddings: without an output matrix, logits use the embedding table.
        let output = match tensor("output.weight") {
            Ok(t) => t,
            Err(_) => embed_q,
        };
        let product = |t: candle_core::quantized::QTensor| -> Result<QMatMul, Error> {
            Ok(match matmul {
                Matmul::Quantized => QMatMul::from_qtensor(t)?,
                Matmul::Dequantized => QMatMul::Tensor(t.dequantize(&device)?),
            })
        };
        let mut layers = Vec::with_capacity(hparams.layers);
        for l in 0..hparams.layers {
            let mut q = |name: &str| -> Result<QMatMul, Error> {
                product(tensor(&format!("blk.{l}.{name}.weight"))?)
            };
            layers.push(Layer {
                wq: q("attn_q")?,
                wk: q("attn_k")?,
                wv: q("attn_v")?,
                wo: q("attn_output")?,
                gate: q("ffn_gate")?,
                up: q("ffn_up")?,
                down: q("ffn_down")?,
                attn_norm: tensor(&format!("blk.{l}.attn_norm.weight"))?.dequantize(&device)?,
                ffn_norm: tensor(&format!("blk.{l}.ffn_norm.weight"))?.dequantize(&device)?,
            });
        }
        let model = Self {
            rope: Rope::new(hparams.head_dim, hparams.rope_base, max_positions),
            hparams,
            embed,
            layers,
            norm,
            output: product(output)?,
            device,
        };
        Ok((model, content))
    }

    /// Positions the rotary tables cover (the `max_positions` of [`Model::load`]). O(1).
    pub fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }

    /// The model's shape. O(1).
    pub fn hparams(&self) -> &Hparams {
        &self.hparams
    }

    /// Runs a batch: row `r` is token `tokens[r]` at position `positions[r]`; attention
    /// goes through `attention`. Returns the next-token logits after each row of
    /// `logit_rows`. O(rows × weights) plus attention.
    ///
    /// # Errors
    /// candle's, and the first of `attention`'s.
    ///
    /// # Panics
    /// If a position is not below the `max_positions` given to [`Model::load`].
    pub fn forward(
        &self,
        tokens: &[u32],
        positions: &[u32],
        attention: &mut dyn Attention,
        logit_rows: &[u32],
    ) -> Result<Vec<Vec<f32>>, Error> {
        let hp = &self.hparams;
        let eps = hp.rms_eps;
        let rows = tokens.len();
        let ids = Tensor::new(tokens, &self.device)?;
        let mut h = self.embed.index_select(&ids, 0)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let x = candle_nn::ops::rms_norm(&h, &layer.attn_norm, eps)?;
            let mut q = layer.wq.forward(&x)?.flatten_all()?.to_vec1::<f32>()?;
            let mut k = layer.wk.forward(&x)?.flatten_all()?.to_vec1::<f32>()?;
            let v = layer.wv.forward(&x)?.flatten_all()?.to_vec1::<f32>()?;
            self.rope.apply(&mut q, positions);
            self.rope.apply(&mut k, positions);
            let mut out = vec![0.0f32; q.len()];
            attention.attend(l as u32, &q, &k, &v, &mut out)?;
            let attn = Tensor::from_vec(out, (rows, hp.hidden), &self.device)?;
            h = (layer.wo.forward(&attn)? + h)?;
            let x = candle_nn::ops::rms_norm(&h, &layer.ffn_norm, eps)?;
            let gate = candle_nn::ops::silu(&layer.gate.forward(&x)?)?;
            let mlp = layer.down.forward(&(gate * layer.up.forward(&x)?)?)?;
            h = (mlp + h)?;
        }
        if logit_rows.is_empty() {
            return Ok(Vec::new());
        }
        let picked = h.index_select(&Tensor::new(logit_rows, &self.device)?, 0)?;
        let x = candle_nn::ops::rms_norm(&picked, &self.norm, eps)?;
        Ok(self.output.forward(&x)?.to_vec2::<f32>()?)
    }
}
