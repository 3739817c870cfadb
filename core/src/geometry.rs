//! Model geometry: how many bytes one token and one block of the KV cache take.
//!
//! Block-major layout shared by every backend: block `b` is one contiguous range of
//! [`Geometry::bytes_per_block`] bytes holding `[layer][k|v][kv_head][token][head_dim]`.

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
}

impl DType {
    /// Bytes of one element. O(1).
    pub const fn size_bytes(self) -> u32 {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
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
        // 2 (k|v) * layers * heads * dim * block * bytes: four u32 factors can overflow u64.
        let per_token = 2u128 * layers as u128 * kv_heads as u128 * head_dim as u128;
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
    /// Elements of K and V of one token over all layers: `2 * layers * kv_heads * head_dim`.
    pub const fn elems_per_token(&self) -> u64 {
        2 * self.layers as u64 * self.kv_heads as u64 * self.head_dim as u64
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
    /// Element offset, inside one block, of the `[token][head_dim]` tile of `layer`,
    /// `kv` (0 = keys, 1 = values) and `kv_head`. The tile holds `block_size * head_dim`
    /// contiguous elements. O(1). The caller keeps the indices in range.
    pub const fn tile_offset(&self, layer: u32, kv: u32, kv_head: u32) -> u64 {
        let tile = self.block_size as u64 * self.head_dim as u64;
        ((layer as u64 * 2 + kv as u64) * self.kv_heads as u64 + kv_head as u64) * tile
    }
}
