//! Model geometry: how many bytes one token and one block of the KV cache take.
//!
//! Block-major layout shared by every backend: block `b` is one contiguous range of
//! [`Geometry::bytes_per_block`] bytes holding `[layer][k|v][kv_head]` tiles. A tile is
//! `[token][head_dim]` elements; for the 8-bit dtypes ([`DType::is_scaled`]) it is
//! followed by one little-endian `f32` scale per token (`[token]`), so that every
//! operation on whole blocks (copy-on-write, swap, save, restore) moves the scales with
//! the codes and no side table exists.

use crate::error::GeometryError;

/// Storage type of keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    Bf16,
    /// Symmetric 8-bit integers (−127..=127) with one `f32` scale per token and head:
    /// the value is `scale · code`, the scale mapping the row's largest magnitude onto
    /// 127. A row's scale is set when it is written and never changes after.
    Int8,
    /// FP8 E4M3 codes (OCP `e4m3fn`: no infinities, largest 448) with one `f32` scale
    /// per token and head, as [`DType::Int8`] (largest magnitude onto 448).
    Fp8E4m3,
}

impl DType {
    /// Bytes of one element. O(1).
    pub const fn size_bytes(self) -> u32 {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Int8 | Self::Fp8E4m3 => 1,
        }
    }

    /// Whether values are codes with a scale per token and head (the 8-bit dtypes).
    /// O(1).
    pub const fn is_scaled(self) -> bool {
        matches!(self, Self::Int8 | Self::Fp8E4m3)
    }

    /// Elements after each tile's values that hold its per-token scales, per token: 4
    /// (one `f32` in four 1-byte elements) for the scaled dtypes, 0 otherwise. O(1).
    pub const fn scale_elems(self) -> u32 {
        if self.is_scaled() {
            4
        } else {
            0
        }
    }
}

/// Shape of the KV cache of one model.
///
/// Invariant: every dimension is non-zero and [`Geometry::bytes_per_block`] fits in a
/// `u64` (checked by [`Geometry::new`]), so the accessors never overflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Geometry {
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    dtype: DType,
}

impl Geometry {
    /// Checks and builds a geometry. O(1).
    ///
    /// # Errors
    /// [`GeometryError::ZeroDimension`] if any count is zero; [`GeometryError::Overflow`]
    /// if the elements of one block do not fit in a `u64`.
    pub const fn new(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        block_size: u32,
        dtype: DType,
    ) -> Result<Self, GeometryError> {
        if layers == 0 || kv_heads == 0 || head_dim == 0 || block_size == 0 {
            return Err(GeometryError::ZeroDimension);
        }
        // 2 (k|v) * layers * heads * (dim + scale) * block * bytes: four u32 factors can
        // overflow u64.
        let row = head_dim as u128 + dtype.scale_elems() as u128;
        let per_token = 2u128 * layers as u128 * kv_heads as u128 * row;
        let per_block = per_token * block_size as u128 * dtype.size_bytes() as u128;
        if per_block > u64::MAX as u128 {
            return Err(GeometryError::Overflow);
        }
        Ok(Self {
            layers,
            kv_heads,
            head_dim,
            block_size,
            dtype,
        })
    }

    /// Transformer layers. O(1).
    pub const fn layers(&self) -> u32 {
        self.layers
    }
    /// Key/value heads per layer. O(1).
    pub const fn kv_heads(&self) -> u32 {
        self.kv_heads
    }
    /// Elements per head. O(1).
    pub const fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Tokens per block. O(1).
    pub const fn block_size(&self) -> u32 {
        self.block_size
    }
    /// Storage type. O(1).
    pub const fn dtype(&self) -> DType {
        self.dtype
    }
    /// Elements of K and V of one token over all layers, its scales included:
    /// `2 * layers * kv_heads * (head_dim + dtype.scale_elems())`. O(1).
    pub const fn elems_per_token(&self) -> u64 {
        2 * self.layers as u64 * self.kv_heads as u64 * self.row_elems() as u64
    }
    /// Elements one token takes in one tile: its values and its scale. O(1).
    pub const fn row_elems(&self) -> u32 {
        self.head_dim + self.dtype.scale_elems()
    }
    /// Elements of one tile: `block_size * (head_dim + scale elems)`; the values are the
    /// first `block_size * head_dim`, the scales (if any) follow. O(1).
    pub const fn tile_elems(&self) -> u64 {
        self.block_size as u64 * self.row_elems() as u64
    }
    /// Bytes of K and V of one token over all layers. O(1).
    pub const fn bytes_per_token(&self) -> u64 {
        self.elems_per_token() * self.dtype.size_bytes() as u64
    }
    /// Elements of one block. O(1).
    pub const fn elems_per_block(&self) -> u64 {
        self.elems_per_token() * self.block_size as u64
    }
    /// Bytes of one block (the unit of copy-on-write and swap). O(1).
    pub const fn bytes_per_block(&self) -> u64 {
        self.bytes_per_token() * self.block_size as u64
    }
    /// Whole blocks that fit in `bytes`. O(1).
    pub const fn blocks_in(&self, bytes: u64) -> u64 {
        bytes / self.bytes_per_block()
    }
    /// Element offset, inside one block, of the tile of `layer`, `kv` (0 = keys, 1 =
    /// values) and `kv_head`: [`Geometry::tile_elems`] contiguous elements, the
    /// `[token][head_dim]` values first. O(1). The caller keeps the indices in range.
    pub const fn tile_offset(&self, layer: u32, kv: u32, kv_head: u32) -> u64 {
        ((layer as u64 * 2 + kv as u64) * self.kv_heads as u64 + kv_head as u64) * self.tile_elems()
    }
}
