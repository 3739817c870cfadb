//! The model's KV shape and storage dtype as C passes them.

use kvpage_core::{DType, Geometry};

use super::result::Fail;

/// Storage dtype: 32-bit IEEE float.
pub const KVPAGE_DTYPE_F32: u32 = 0;
/// Storage dtype: 16-bit IEEE float.
pub const KVPAGE_DTYPE_F16: u32 = 1;
/// Storage dtype: bfloat16.
pub const KVPAGE_DTYPE_BF16: u32 = 2;
/// Storage dtype: symmetric 8-bit integers with one `float` scale per token and head
/// (stored in the block after the tile's codes): half the bytes of f16.
pub const KVPAGE_DTYPE_INT8: u32 = 3;
/// Storage dtype: FP8 E4M3 codes with one `float` scale per token and head.
pub const KVPAGE_DTYPE_FP8_E4M3: u32 = 4;

/// The KV geometry of a model: every dimension non-zero. Block `b` of the arena holds
/// `[layer][k|v][kv_head]` tiles of `[token][head_dim]` elements of `dtype`, contiguous;
/// with an 8-bit dtype each tile is followed by its `[token]` `float` scales.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct kvpage_geometry {
    /// Transformer layers.
    pub layers: u32,
    /// Key/value heads per layer (fewer than query heads under GQA/MQA).
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Tokens per block (16 is the usual choice).
    pub block_size: u32,
    /// `KVPAGE_DTYPE_F32`, `KVPAGE_DTYPE_F16`, `KVPAGE_DTYPE_BF16`, `KVPAGE_DTYPE_INT8` or
    /// `KVPAGE_DTYPE_FP8_E4M3`.
    pub dtype: u32,
}

/// The core dtype of a C dtype code.
pub(crate) fn dtype_from_c(code: u32) -> Result<DType, Fail> {
    match code {
        KVPAGE_DTYPE_F32 => Ok(DType::F32),
        KVPAGE_DTYPE_F16 => Ok(DType::F16),
        KVPAGE_DTYPE_BF16 => Ok(DType::Bf16),
        KVPAGE_DTYPE_INT8 => Ok(DType::Int8),
        KVPAGE_DTYPE_FP8_E4M3 => Ok(DType::Fp8E4m3),
        other => Err(Fail::invalid("unknown dtype").with_value(u64::from(other))),
    }
}

/// The C code of a dtype.
pub(crate) fn dtype_to_c(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => KVPAGE_DTYPE_F32,
        DType::F16 => KVPAGE_DTYPE_F16,
        DType::Bf16 => KVPAGE_DTYPE_BF16,
        DType::Int8 => KVPAGE_DTYPE_INT8,
        DType::Fp8E4m3 => KVPAGE_DTYPE_FP8_E4M3,
    }
}

impl kvpage_geometry {
    /// The checked core geometry.
    pub(crate) fn to_core(self) -> Result<Geometry, Fail> {
        let dtype = dtype_from_c(self.dtype)?;
        Ok(Geometry::new(
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.block_size,
            dtype,
        )?)
    }

    /// The C view of a core geometry.
    pub(crate) fn from_core(g: &Geometry) -> Self {
        Self {
            layers: g.layers(),
            kv_heads: g.kv_heads(),
            head_dim: g.head_dim(),
            block_size: g.block_size(),
            dtype: dtype_to_c(g.dtype()),
        }
    }
}
