//! The KV arena: one 64-byte-aligned allocation, made once, holding every block.
//!
//! Block-major layout (the design document's, shared with every backend): block `b` is
//! the element range `[b * elems_per_block, (b + 1) * elems_per_block)` and holds
//! `[layer][k|v][kv_head]` tiles of `[token_in_block][head_dim]` elements (for the 8-bit
//! dtypes followed by the tile's `[token_in_block]` f32 scales, 4 one-byte elements
//! each). A kernel for one layer and one KV head therefore reads one contiguous tile per
//! block (and for consecutive KV heads, as the CPU decode takes them, one contiguous
//! range of K tiles and one of V tiles), and a copy-on-write or swap of a block is a
//! single range copy covering all layers, scales included.
//!
//! The arena starts 64-byte aligned (a cache line, and the width of an AVX-512 load);
//! a block starts aligned whenever `bytes_per_block` is a multiple of 64, which holds for
//! every usual geometry (e.g. any `head_dim * dtype_size` multiple of 32 bytes with an
//! even token count). Kernels use unaligned loads, so odd geometries stay correct.

use kvpage_core::Geometry;

use crate::dtype::Element;
use crate::error::KernelError;
use crate::kernels::MAX_HEAD_DIM;

/// One cache line; the arena is a slice of these so that it is 64-byte aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Widest [`Element`] in bytes (`f32`). [`KvLayout::new`] keeps the arena's byte size
/// addressable for every element type, not only the geometry's dtype.
const MAX_ELEM_BYTES: u128 = 4;

/// Element-level shape of an arena: a core [`Geometry`] (layers, KV heads, head dim,
/// block size, dtype) and the number of blocks. It says which elements of the arena
/// belong to which block, layer, K/V, head and token; the per-block part is the
/// geometry's ([`Geometry::elems_per_block`], [`Geometry::tile_offset`]).
///
/// The geometry's dtype is the arena's storage type: [`Arena::for_layout`] sizes the
/// arena with it, and the kernels, which stay generic over the [`Element`] type `T`,
/// refuse a `T` whose [`Element::DTYPE`] differs from it
/// ([`KernelError::DTypeMismatch`]). [`crate::KvCache`] builds its layout from its
/// configured geometry; a caller of the kernels passes a geometry whose dtype is the
/// element type it uses.
///
/// Invariant (checked by [`KvLayout::new`], on top of the geometry's own: non-zero
/// dimensions, a block's size fits a `u64`): `num_blocks > 0`, `head_dim <=`
/// [`MAX_HEAD_DIM`], the arena's byte size for any element type (up to 4 bytes) fits an
/// `isize` (so every element and byte offset fits a `usize`), and every slot
/// (`block * block_size + offset`) fits a `u32`. All methods are O(1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    geometry: Geometry,
    num_blocks: u32,
}

impl KvLayout {
    /// Checks and builds the layout of `num_blocks` blocks of `geometry`. O(1).
    ///
    /// # Errors
    /// [`KernelError::BadLayout`] if `num_blocks` is zero;
    /// [`KernelError::HeadDimTooLarge`] if `head_dim > MAX_HEAD_DIM`;
    /// [`KernelError::BadLayout`] if the arena's byte size (at 4 bytes per element)
    /// overflows `isize`, or the slot count overflows `u32`. (Zero dimensions and a
    /// block too large for a `u64` are already refused by [`Geometry::new`].)
    pub const fn new(geometry: Geometry, num_blocks: u32) -> Result<Self, KernelError> {
        if num_blocks == 0 {
            return Err(KernelError::BadLayout);
        }
        let head_dim = geometry.head_dim();
        if head_dim as usize > MAX_HEAD_DIM {
            return Err(KernelError::HeadDimTooLarge { head_dim });
        }
        // Leave room for byte offsets of the widest (4-byte) elements.
        let arena_elems = geometry.elems_per_block() as u128 * num_blocks as u128;
        if arena_elems * MAX_ELEM_BYTES > isize::MAX as u128 {
            return Err(KernelError::BadLayout);
        }
        if geometry.block_size() as u64 * num_blocks as u64 > u32::MAX as u64 + 1 {
            return Err(KernelError::BadLayout);
        }
        Ok(Self {
            geometry,
            num_blocks,
        })
    }

    /// The geometry: layers, KV heads, head dim, block size and storage dtype.
    pub const fn geometry(&self) -> &Geometry {
        &self.geometry
    }
    /// Blocks in the arena.
    pub const fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    /// Token slots in the arena (`num_blocks * block_size`).
    pub const fn num_slots(&self) -> u64 {
        self.num_blocks as u64 * self.geometry.block_size() as u64
    }
    /// Elements of one tile ([`Geometry::tile_elems`]: `block_size * head_dim` values,
    /// then `block_size * 4` scale elements for the 8-bit dtypes).
    pub const fn tile_elems(&self) -> usize {
        self.geometry.tile_elems() as usize
    }
    /// Element offset, inside a tile, of its per-token scales: `block_size * head_dim`
    /// (meaningful for the 8-bit dtypes only). O(1).
    pub const fn scales_offset(&self) -> usize {
        self.geometry.block_size() as usize * self.geometry.head_dim() as usize
    }
    /// Elements of one block ([`Geometry::elems_per_block`]:
    /// `2 * layers * kv_heads * tile_elems`), as a `usize` (lossless by the invariant).
    pub const fn elems_per_block(&self) -> usize {
        self.geometry.elems_per_block() as usize
    }
    /// Elements of the whole arena (`num_blocks * elems_per_block`).
    pub const fn arena_elems(&self) -> usize {
        self.elems_per_block() * self.num_blocks as usize
    }
    /// Bytes of the whole arena in the geometry's dtype (`arena_elems * dtype size`).
    pub const fn arena_bytes(&self) -> usize {
        self.arena_elems() * self.geometry.dtype().size_bytes() as usize
    }
    /// Element offset of the `[token][head_dim]` tile of (`block`, `layer`, `kv` (0 = K,
    /// 1 = V), `kv_head`) in the arena: the block's start plus
    /// [`Geometry::tile_offset`]. Indices out of range (`block >= num_blocks`,
    /// `layer >= layers`, `kv > 1`, `kv_head >= kv_heads`) give `usize::MAX`, an offset
    /// past the arena, which `get` or slicing then rejects. O(1).
    #[inline]
    pub const fn tile_offset(&self, block: u32, layer: u32, kv: u32, kv_head: u32) -> usize {
        let g = &self.geometry;
        if block >= self.num_blocks || layer >= g.layers() || kv > 1 || kv_head >= g.kv_heads() {
            // The arithmetic below could overflow for such indices.
            return usize::MAX;
        }
        self.tile_offset_in_range(block, layer, kv, kv_head)
    }

    /// [`KvLayout::tile_offset`] for indices the caller has validated (the kernels'
    /// inner loops): in range, the offset is below `arena_elems` (layout invariant), so
    /// nothing overflows.
    #[inline(always)]
    pub(crate) const fn tile_offset_in_range(
        &self,
        block: u32,
        layer: u32,
        kv: u32,
        kv_head: u32,
    ) -> usize {
        block as usize * self.elems_per_block()
            + self.geometry.tile_offset(layer, kv, kv_head) as usize
    }

    /// Checks that `T` is the geometry's storage type. O(1).
    ///
    /// # Errors
    /// [`KernelError::DTypeMismatch`] if `T::DTYPE` differs from the geometry's dtype.
    pub const fn check_element<T: Element>(&self) -> Result<(), KernelError> {
        let layout = self.geometry.dtype();
        // `DType`'s `PartialEq` is not `const`; compare the discriminants.
        if layout as u8 != T::DTYPE as u8 {
            return Err(KernelError::DTypeMismatch {
                layout,
                element: T::DTYPE,
            });
        }
        Ok(())
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

/// Asks Linux to back the whole 2 MiB pages inside `[ptr, ptr + len)` with transparent
/// huge pages (`madvise(MADV_HUGEPAGE)`), before they are first touched. A kernel reads
/// each block's tiles from scattered places in the arena; with 4 KiB pages every tile
/// is a TLB miss and a page walk. Where huge pages are disabled the call fails, which
/// changes nothing, so its result is ignored. O(1) (the pages are backed as they are
/// touched).
#[cfg(all(target_os = "linux", not(miri)))]
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    const HUGE_PAGE: usize = 2 << 20;
    const MADV_HUGEPAGE: core::ffi::c_int = 14;
    extern "C" {
        fn madvise(
            addr: *mut core::ffi::c_void,
            len: usize,
            advice: core::ffi::c_int,
        ) -> core::ffi::c_int;
    }
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
    let end = (ptr as usize + len) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        // SAFETY: the range lies inside the caller's allocation and is page aligned;
        // MADV_HUGEPAGE changes how the kernel backs it, never its contents.
        unsafe { madvise(start as *mut core::ffi::c_void, end - start, MADV_HUGEPAGE) };
    }
}

impl Arena {
    /// Allocates and zeroes `bytes` bytes (rounded up to 64). O(bytes).
    ///
    /// # Errors
    /// [`ArenaAllocError`] if the allocator refuses (instead of aborting).
    pub fn new(bytes: usize) -> Result<Self, ArenaAllocError> {
        let n = bytes.div_ceil(64);
        let mut lines: Vec<Line> = Vec::new();
        lines
            .try_reserve_exact(n)
            .map_err(|_| ArenaAllocError { bytes })?;
        #[cfg(all(target_os = "linux", not(miri)))]
        advise_huge_pages(lines.as_mut_ptr().cast(), n * 64);
        lines.resize(n, Line([0; 64]));
        Ok(Self { lines, bytes })
    }

    /// Allocates the arena of a layout, in its geometry's dtype
    /// ([`KvLayout::arena_bytes`]). O(arena bytes).
    ///
    /// # Errors
    /// [`ArenaAllocError`] if the allocator refuses.
    pub fn for_layout(layout: &KvLayout) -> Result<Self, ArenaAllocError> {
        Self::new(layout.arena_bytes())
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

    /// The arena's bytes (`len_bytes` of them), e.g. to compare or checksum blocks. O(1).
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `lines` holds at least `bytes` initialised bytes; `u8` has alignment 1
        // and accepts every bit pattern.
        unsafe { core::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.bytes) }
    }

    /// The arena's bytes, mutable: whole blocks as a restore copies them, or the
    /// scales of 8-bit storage. Every byte pattern is a valid element of every dtype, so
    /// no write here is unsound; but bytes written past a cache's back change what it
    /// serves (values, and with 8-bit storage their scales), never its tables. O(1).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`, and `&mut self` makes the view unique.
        unsafe { core::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), self.bytes) }
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
