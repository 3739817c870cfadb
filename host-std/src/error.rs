//! Error types of the CPU backend.
//!
//! Every kernel checks all of its inputs before it writes a single element, so an
//! `Err` always means "nothing was written". The errors are `Copy` and carry the numbers
//! needed for a useful message on the far side of an FFI boundary.

use core::fmt;

use kvpage_core::DType;

use crate::kernels::RopeError;

/// Which buffer of a kernel call had the wrong length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    /// The KV arena.
    Arena,
    /// Query activations `[tokens][q_heads][head_dim]`.
    Query,
    /// Attention output `[tokens][q_heads][head_dim]`.
    Output,
    /// New keys `[tokens][kv_heads][head_dim]`.
    Keys,
    /// New values `[tokens][kv_heads][head_dim]`.
    Values,
    /// The dense block table.
    BlockTable,
    /// A contiguous (unpaged) K or V buffer.
    Contiguous,
}

impl fmt::Display for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Arena => "arena",
            Self::Query => "query",
            Self::Output => "output",
            Self::Keys => "keys",
            Self::Values => "values",
            Self::BlockTable => "block table",
            Self::Contiguous => "contiguous K/V",
        })
    }
}

/// Why a kernel refused its inputs. Nothing was read into or written to any output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelError {
    /// A buffer does not have the length the shapes require.
    BufferLength {
        /// Which buffer.
        buffer: Buffer,
        /// Elements required.
        expected: usize,
        /// Elements given.
        actual: usize,
    },
    /// `layer >= layers`.
    LayerOutOfRange {
        /// Layer asked for.
        layer: u32,
        /// Layers of the geometry.
        layers: u32,
    },
    /// Query heads are zero or not a multiple of the KV heads.
    HeadsNotDivisible {
        /// Query heads.
        q_heads: u32,
        /// KV heads.
        kv_heads: u32,
    },
    /// The head dimension exceeds [`crate::kernels::MAX_HEAD_DIM`].
    HeadDimTooLarge {
        /// Head dimension of the geometry.
        head_dim: u32,
    },
    /// A layout has zero blocks, or the arena's size (or a buffer size derived from the
    /// shapes) overflows `usize`, or its slots overflow `u32`.
    BadLayout,
    /// The kernel's element type is not the storage dtype of the layout's geometry.
    DTypeMismatch {
        /// The geometry's dtype.
        layout: DType,
        /// The dtype of the element type the kernel was called with.
        element: DType,
    },
    /// The softmax scale is not finite.
    BadScale,
    /// A slot (`block * block_size + offset`) is past the end of the arena.
    SlotOutOfRange {
        /// The slot.
        slot: u32,
        /// Slots in the arena.
        slots: u64,
    },
    /// A block id (in a block table or a copy) is past the end of the arena.
    BlockOutOfRange {
        /// The block id.
        block: u32,
        /// Blocks in the arena.
        blocks: u32,
    },
    /// A copy whose source and destination are the same block.
    CopyOntoItself {
        /// The block.
        block: u32,
    },
    /// A [`kvpage_core::RowMove`] whose count is zero or whose rows leave their block on
    /// either side.
    BadRowMove {
        /// First slot read.
        src_slot: u32,
        /// First slot written.
        dst_slot: u32,
        /// Rows moved.
        count: u32,
    },
    /// A sequence names a block-table row that does not exist.
    RowOutOfRange {
        /// The row.
        row: u32,
        /// Rows in the table.
        rows: u32,
    },
    /// A sequence's context needs more blocks than its block-table row holds.
    ContextTooLong {
        /// Tokens of context.
        context_len: u32,
        /// Tokens the row can address.
        capacity: u64,
    },
    /// A sequence has more new query tokens than tokens of context (the new tokens are
    /// part of the context: write their K/V first).
    QueriesExceedContext {
        /// New query tokens.
        queries: u32,
        /// Tokens of context.
        context_len: u32,
    },
    /// The rotary embedding parameters do not fit the geometry's head (see
    /// [`crate::kernels::RopeParams::check`]).
    Rope(RopeError),
    /// A token range whose start is past its end.
    BadTokenRange {
        /// First token index.
        first: u32,
        /// One past the last token index.
        end: u32,
    },
    /// An operation that cannot keep the per-token scales of 8-bit storage
    /// ([`DType::is_scaled`]): writing codes as they are (write from `f32` instead) or
    /// the contiguous baseline kernel, whose layout has no scales.
    ScaledStorage {
        /// The storage dtype.
        dtype: DType,
    },
    /// Fixed scales ([`crate::quant::KvScales`]) for storage that keeps no scales (the
    /// float dtypes).
    UnscaledStorage {
        /// The storage dtype.
        dtype: DType,
    },
    /// A fixed K or V scale ([`crate::quant::KvScales::new`]) that is not finite and
    /// positive.
    BadKvScale,
}

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::BufferLength {
                buffer,
                expected,
                actual,
            } => {
                write!(
                    f,
                    "{buffer} buffer has {actual} elements, expected {expected}"
                )
            }
            Self::LayerOutOfRange { layer, layers } => {
                write!(f, "layer {layer} out of range (model has {layers})")
            }
            Self::HeadsNotDivisible { q_heads, kv_heads } => {
                write!(
                    f,
                    "{q_heads} query heads are not a non-zero multiple of {kv_heads} KV heads"
                )
            }
            Self::HeadDimTooLarge { head_dim } => write!(
                f,
                "head dim {head_dim} exceeds the CPU kernels' maximum of {}",
                crate::kernels::MAX_HEAD_DIM
            ),
            Self::BadLayout => f.write_str("KV layout has zero blocks or an oversized arena"),
            Self::DTypeMismatch { layout, element } => write!(
                f,
                "kernel called with {element:?} elements on a {layout:?} layout"
            ),
            Self::BadScale => f.write_str("softmax scale is not finite"),
            Self::SlotOutOfRange { slot, slots } => {
                write!(f, "slot {slot} out of range (arena has {slots})")
            }
            Self::BlockOutOfRange { block, blocks } => {
                write!(f, "block {block} out of range (arena has {blocks})")
            }
            Self::CopyOntoItself { block } => write!(f, "copy of block {block} onto itself"),
            Self::BadRowMove {
                src_slot,
                dst_slot,
                count,
            } => write!(
                f,
                "row move of {count} rows from slot {src_slot} to {dst_slot} leaves a block"
            ),
            Self::RowOutOfRange { row, rows } => {
                write!(f, "block-table row {row} out of range ({rows} rows)")
            }
            Self::ContextTooLong {
                context_len,
                capacity,
            } => {
                write!(
                    f,
                    "context of {context_len} tokens exceeds the row's {capacity}"
                )
            }
            Self::QueriesExceedContext {
                queries,
                context_len,
            } => {
                write!(
                    f,
                    "{queries} query tokens exceed the context of {context_len}"
                )
            }
            Self::Rope(e) => write!(f, "rotary embedding: {e}"),
            Self::ScaledStorage { dtype } => write!(
                f,
                "{dtype:?} storage keeps a scale per token and head: write it from f32 values"
            ),
            Self::BadTokenRange { first, end } => {
                write!(f, "token range {first}..{end} is reversed")
            }
            Self::UnscaledStorage { dtype } => {
                write!(f, "{dtype:?} storage keeps no scales to fix")
            }
            Self::BadKvScale => f.write_str("a fixed K/V scale must be finite and positive"),
        }
    }
}

impl std::error::Error for KernelError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Rope(e) => Some(e),
            _ => None,
        }
    }
}
