//! The kernel ABI on the Rust side: `#[repr(C)]` mirrors of the parameter structs of
//! `kernels/params.h`, passed by value as the one argument of a kernel launch.
//!
//! Device pointers are `u64` (a device address on the GPU path, a host address in
//! emulation). Every struct has explicit padding fields, so its layout is the same in C,
//! C++ and Rust without packing; the emulated tests compare sizes and field offsets with
//! the C++ compiler's.

use kvpage_core::{DType, Geometry};

/// The storage dtype's code in `params.h` (`KVP_DTYPE_*`): its position in [`DType`]'s
/// declaration (a fieldless enum: `as` gives exactly that). O(1).
pub const fn dtype_code(dtype: DType) -> u32 {
    dtype as u32
}

/// `KvpGeometry`: a [`Geometry`] with the arena's block count, as the kernels read it.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvpGeometry {
    /// Elements of one block (all layers, K and V, scales included).
    pub elems_per_block: u64,
    /// Elements of one `(layer, K|V, head)` tile, scales included.
    pub tile_elems: u64,
    /// Layers.
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks of the arena.
    pub num_blocks: u32,
    /// [`dtype_code`] of the storage dtype.
    pub dtype: u32,
}

impl KvpGeometry {
    /// The kernels' view of `geometry` over an arena of `num_blocks` blocks. O(1).
    pub const fn new(geometry: &Geometry, num_blocks: u32) -> Self {
        Self {
            elems_per_block: geometry.elems_per_block(),
            tile_elems: geometry.tile_elems(),
            layers: geometry.layers(),
            kv_heads: geometry.kv_heads(),
            head_dim: geometry.head_dim(),
            block_size: geometry.block_size(),
            num_blocks,
            dtype: dtype_code(geometry.dtype()),
        }
    }
}

/// `KvpWriteParams` of `kvp_write_kv`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KvpWriteParams {
    /// Geometry of the arena.
    pub geo: KvpGeometry,
    /// The arena.
    pub arena: u64,
    /// Keys `[tokens][kv_heads][head_dim]`, f32.
    pub k: u64,
    /// Values, as `k`.
    pub v: u64,
    /// Slot of each token, `[tokens]` u32.
    pub slots: u64,
    /// New tokens.
    pub tokens: u32,
    /// Layer written.
    pub layer: u32,
    /// 8-bit storage: the fixed scale of the keys' codes, or 0 for a scale per row
    /// from its largest magnitude.
    pub k_scale: f32,
    /// As `k_scale`, for the values.
    pub v_scale: f32,
}

/// `KvpCopyParams` of `kvp_copy_blocks`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvpCopyParams {
    /// The arena.
    pub arena: u64,
    /// `[num_pairs]` `(src, dst)` u32 pairs (a slice of [`kvpage_core::BlockCopy`]).
    pub pairs: u64,
    /// Bytes of one block.
    pub bytes_per_block: u64,
    /// Copies.
    pub num_pairs: u32,
    /// Padding (0).
    pub pad0: u32,
}

/// `KvpSeqDesc`: one sequence of an attention launch.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvpSeqDesc {
    /// Block-table row.
    pub row: u32,
    /// Tokens of context, the new ones included.
    pub context_len: u32,
    /// New query tokens (the last `queries` of the context).
    pub queries: u32,
    /// First query token of the sequence in `q` / `out`: the sum of the queries of the
    /// sequences before it.
    pub q_start: u32,
}

/// `KvpAttentionParams` of `kvp_attention_*` and `kvp_attention_reduce`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KvpAttentionParams {
    /// Geometry of the arena.
    pub geo: KvpGeometry,
    /// The arena.
    pub arena: u64,
    /// Queries `[scratch_rows][q_heads][head_dim]`, f32.
    pub q: u64,
    /// Output, as `q`.
    pub out: u64,
    /// Block table, rows of `table_stride` u32 block ids.
    pub block_table: u64,
    /// `[num_seqs]` [`KvpSeqDesc`].
    pub seqs: u64,
    /// Partition scratch (floats, see `params.h`); unused with one partition.
    pub scratch: u64,
    /// Entries per block-table row.
    pub table_stride: u32,
    /// Sequences.
    pub num_seqs: u32,
    /// Layer read.
    pub layer: u32,
    /// Query heads.
    pub q_heads: u32,
    /// Factor on `q·k` before the softmax.
    pub scale: f32,
    /// Tokens per context partition (a multiple of the block size).
    pub partition_tokens: u32,
    /// Partitions (grid.y of the attention launch).
    pub num_partitions: u32,
    /// Row tiles per KV head (grid.x / kv_heads).
    pub row_tiles: u32,
    /// Sum of the queries over the sequences (rows of `q`, `out` and the scratch).
    pub scratch_rows: u32,
    /// Padding (0).
    pub pad0: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, size_of};

    #[test]
    fn sizes_match_the_header_comments() {
        assert_eq!(size_of::<KvpGeometry>(), 40);
        assert_eq!(size_of::<KvpWriteParams>(), 88);
        assert_eq!(size_of::<KvpCopyParams>(), 32);
        assert_eq!(size_of::<KvpSeqDesc>(), 16);
        assert_eq!(size_of::<KvpAttentionParams>(), 128);
        assert_eq!(align_of::<KvpAttentionParams>(), 8);
    }

    #[test]
    fn geometry_mirrors_the_core() {
        let g = Geometry::new(3, 2, 64, 16, DType::Int8).unwrap();
        let k = KvpGeometry::new(&g, 7);
        assert_eq!(k.elems_per_block, g.elems_per_block());
        assert_eq!(k.tile_elems, 16 * 68);
        assert_eq!((k.num_blocks, k.dtype), (7, 3));
        for (d, c) in [
            (DType::F32, 0),
            (DType::F16, 1),
            (DType::Bf16, 2),
            (DType::Int8, 3),
            (DType::Fp8E4m3, 4),
        ] {
            assert_eq!(dtype_code(d), c);
        }
    }

    /// The C++ compiler's layout of every params struct (through the emulation library)
    /// equals the Rust mirror's, field by field.
    #[cfg(feature = "emulation")]
    #[test]
    fn abi_layout_matches_the_rust_mirror() {
        use super::{
            KvpAttentionParams as A, KvpCopyParams as C, KvpGeometry as G, KvpSeqDesc as S,
            KvpWriteParams as W,
        };
        use core::mem::offset_of;
        let rust: Vec<u64> = [
            size_of::<G>(),
            offset_of!(G, tile_elems),
            offset_of!(G, layers),
            offset_of!(G, kv_heads),
            offset_of!(G, head_dim),
            offset_of!(G, block_size),
            offset_of!(G, num_blocks),
            offset_of!(G, dtype),
            size_of::<W>(),
            offset_of!(W, arena),
            offset_of!(W, k),
            offset_of!(W, v),
            offset_of!(W, slots),
            offset_of!(W, tokens),
            offset_of!(W, layer),
            size_of::<C>(),
            offset_of!(C, pairs),
            offset_of!(C, bytes_per_block),
            offset_of!(C, num_pairs),
            size_of::<S>(),
            offset_of!(S, context_len),
            offset_of!(S, queries),
            offset_of!(S, q_start),
            size_of::<A>(),
            offset_of!(A, arena),
            offset_of!(A, q),
            offset_of!(A, out),
            offset_of!(A, block_table),
            offset_of!(A, seqs),
            offset_of!(A, scratch),
            offset_of!(A, table_stride),
            offset_of!(A, num_seqs),
            offset_of!(A, layer),
            offset_of!(A, q_heads),
            offset_of!(A, scale),
            offset_of!(A, partition_tokens),
            offset_of!(A, num_partitions),
            offset_of!(A, row_tiles),
            offset_of!(A, scratch_rows),
        ]
        .into_iter()
        .map(|x| x as u64)
        .collect();
        assert_eq!(crate::emulation::abi_layout(), rust);
    }
}
