//! The KV arena: one 64-byte-aligned allocation, made once, holding every block.
//!
//! Block-major layout (the design document's, shared with every backend): block `b` is
//! the element range `[b * elems_per_block, (b + 1) * elems_per_block)` and holds
//! `[layer][k|v][kv_head][token_in_block][head_dim]`. A kernel for one layer and one KV
//! head therefore reads one contiguous `[token][head_dim]` tile per block, and a
//! copy-on-write or swap of a block is a single range copy covering all layers.
//!
//! The arena starts 64-byte aligned (a cache line, and the width of an AVX-512 load);
//! a block starts aligned whenever `bytes_per_block` is a multiple of 64, which holds for
//! every usual geometry (e.g. any `head_dim * dtype_size` multiple of 32 bytes with an
//! even token count). Kernels use unaligned loads, so odd geometries stay correct.

use crate::dtype::Element;
use crate::error::KernelError;
use crate::kernels::MAX_HEAD_DIM;

/// One cache line; the arena is a slice of these so that it is 64-byte aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Element-level shape of an arena: which elements of the arena belong to which block,
/// layer, K/V, head and token.
///
/// Invariant (checked by [`KvLayout::new`]): every dimension is non-zero, `head_dim <=`
/// [`MAX_HEAD_DIM`], every element index of the arena fits in a `usize`, and every slot
/// (`block * block_size + offset`) fits in a `u32`. All methods are O(1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    num_blocks: u32,
}

impl KvLayout {
    /// Checks and builds a layout. O(1).
    ///
    /// # Errors
    /// [`KernelError::BadLayout`] if a dimension is zero, the arena's element count
    /// overflows `usize`, or the slot count overflows `u32`;
    /// [`KernelError::HeadDimTooLarge`] if `head_dim > MAX_HEAD_DIM`.
    pub const fn new(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        block_size: u32,
        num_blocks: u32,
    ) -> Result<Self, KernelError> {
        if layers == 0 || kv_heads == 0 || head_dim == 0 || block_size == 0 || num_blocks == 0 {
            return Err(KernelError::BadLayout);
        }
        if head_dim as usize > MAX_HEAD_DIM {
            return Err(KernelError::HeadDimTooLarge { head_dim });
        }
        let per_block =
            2u128 * layers as u128 * kv_heads as u128 * head_dim as u128 * block_size as u128;
        // Leave room for byte offsets of 4-byte elements as well.
        if per_block * num_blocks as u128 * 4 > isize::MAX as u128 {
            return Err(KernelError::BadLayout);
        }
        if block_size as u64 * num_blocks as u64 > u32::MAX as u64 + 1 {
            return Err(KernelError::BadLayout);
        }
        Ok(Self {
            layers,
            kv_heads,
            head_dim,
            block_size,
            num_blocks,
        })
    }

    /// The layout of `num_blocks` blocks of a core [`kvpage_core::Geometry`]. O(1).
    ///
    /// # Errors
    /// As [`KvLayout::new`].
    pub const fn from_geometry(
        geometry: &kvpage_core::Geometry,
        num_blocks: u32,
    ) -> Result<Self, KernelError> {
        Self::new(
            geometry.layers(),
            geometry.kv_heads(),
            geometry.head_dim(),
            geometry.block_size(),
            num_blocks,
        )
    }

    /// Transformer layers.
    pub const fn layers(&self) -> u32 {
        self.layers
    }
    /// KV heads per layer.
    pub const fn kv_heads(&self) -> u32 {
        self.kv_heads
    }
    /// Elements per head.
    pub const fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Tokens per block.
    pub const fn block_size(&self) -> u32 {
        self.block_size
    }
    /// Blocks in the arena.
    pub const fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    /// Token slots in the arena (`num_blocks * block_size`).
    pub const fn num_slots(&self) -> u64 {
        self.num_blocks as u64 * self.block_size as u64
    }
    /// Elements of one `[token][head_dim]` tile (`block_size * head_dim`).
    pub const fn tile_elems(&self) -> usize {
        self.block_size as usize * self.head_dim as usize
    }
    /// Elements of one block: `2 * layers * kv_heads * block_size * head_dim`.
    pub const fn elems_per_block(&self) -> usize {
        2 * self.layers as usize * self.kv_heads as usize * self.tile_elems()
    }
    /// Elements of the whole arena.
    pub const fn arena_elems(&self) -> usize {
        self.elems_per_block() * self.num_blocks as usize
    }
    /// Element offset of the `[token][head_dim]` tile of (`block`, `layer`, `kv` (0 = K,
    /// 1 = V), `kv_head`) in the arena. The caller keeps the indices in range (the
    /// kernels validate them first); out-of-range indices give an offset past the arena,
    /// which slicing then rejects.
    pub const fn tile_offset(&self, block: u32, layer: u32, kv: u32, kv_head: u32) -> usize {
        block as usize * self.elems_per_block()
            + ((layer as usize * 2 + kv as usize) * self.kv_heads as usize + kv_head as usize)
                * self.tile_elems()
    }
}

/// Why an arena could not be allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaAllocError {
    /// Bytes requested.
    pub bytes: usize,
}

impl core::fmt::Display for ArenaAllocError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "could not allocate a KV arena of {} bytes", self.bytes)
    }
}

impl std::error::Error for ArenaAllocError {}

/// Owned, zero-initialised, 64-byte-aligned storage for the KV arena.
///
/// Allocated once by [`Arena::new`] (every page is touched then, so no page fault
/// happens later on the hot path) and never resized. Viewed as a slice of any
/// [`Element`] type; the element count is `bytes / size_of::<T>()`.
pub struct Arena {
    lines: Vec<Line>,
    bytes: usize,
}

impl Arena {
    /// Allocates and zeroes `bytes` bytes (rounded up to 64). O(bytes).
    ///
    /// # Errors
    /// [`ArenaAllocError`] if the allocator refuses (instead of aborting).
    pub fn new(bytes: usize) -> Result<Self, ArenaAllocError> {
        let n = bytes.div_ceil(64);
        let mut lines = Vec::new();
        lines
            .try_reserve_exact(n)
            .map_err(|_| ArenaAllocError { bytes })?;
        lines.resize(n, Line([0; 64]));
        Ok(Self { lines, bytes })
    }

    /// Allocates the arena of a layout for storage type `T`. O(arena bytes).
    ///
    /// # Errors
    /// [`ArenaAllocError`] if the allocator refuses.
    pub fn for_layout<T: Element>(layout: &KvLayout) -> Result<Self, ArenaAllocError> {
        Self::new(layout.arena_elems() * core::mem::size_of::<T>())
    }

    /// Size in bytes as requested. O(1).
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// The arena as elements of `T` (`len_bytes / size_of::<T>()` of them). O(1).
    pub fn as_slice<T: Element>(&self) -> &[T] {
        let len = self.bytes / core::mem::size_of::<T>();
        // SAFETY: `lines` holds at least `bytes` initialised bytes, 64-byte aligned;
        // `T: Pod` (sealed) has alignment dividing 64 and accepts every bit pattern.
        unsafe { core::slice::from_raw_parts(self.lines.as_ptr().cast::<T>(), len) }
    }

    /// The arena as mutable elements of `T`. O(1).
    pub fn as_mut_slice<T: Element>(&mut self) -> &mut [T] {
        let len = self.bytes / core::mem::size_of::<T>();
        // SAFETY: as in `as_slice`, and `&mut self` makes the view unique.
        unsafe { core::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<T>(), len) }
    }
}

impl core::fmt::Debug for Arena {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Arena").field("bytes", &self.bytes).finish()
    }
}
