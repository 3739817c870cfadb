//! Launch planning: which kernel, grid, block and shared memory for each call, the
//! context partitions of attention, scratch sizes, and the validation of a call — plain
//! Rust, no device, shared by the GPU path and the emulated tests (which therefore run
//! the kernels with exactly the configurations a GPU gets).
//!
//! Every `plan_*` function checks all of its inputs against the kernels' contracts
//! (`kernels/params.h`) and returns a typed [`LaunchError`] for any misuse; it never
//! panics and allocates nothing. A call with no work (no tokens, no copies, no query
//! rows) plans `None`: nothing to launch.

use core::fmt;

use kvpage_core::{BlockCopy, DType, Geometry};

use crate::params::{KvpAttentionParams, KvpGeometry, KvpSeqDesc};

/// Threads of a write CTA: one warp per `(kv head, K|V)` row (`KVP_WRITE_WARPS`).
pub const WRITE_WARPS: u32 = 4;
/// Threads of a copy CTA (`KVP_COPY_THREADS`).
pub const COPY_THREADS: u32 = 256;
/// 16-byte vectors each copy thread has in flight (`KVP_COPY_UNROLL`).
pub const COPY_UNROLL: u32 = 4;
/// Threads of an attention CTA (`KVP_ATT_THREADS`).
pub const ATT_THREADS: u32 = 128;
/// Most query rows of an attention CTA (`KVP_ATT_ROWS`): GQA groups up to this size
/// read each K/V byte once per query token.
pub const ATT_ROWS: u32 = 8;
/// Threads of a reduce CTA (`KVP_REDUCE_THREADS`).
pub const REDUCE_THREADS: u32 = 128;
/// Shortest automatic partition, in tokens (rounded up to the block size): shorter ones
/// would spend more on the reduce than they gain in parallelism.
pub const MIN_PARTITION_TOKENS: u32 = 256;
/// Attention CTAs per SM the automatic partitioning aims for (of 128 threads each).
pub const TARGET_CTAS_PER_SM: u32 = 8;
/// Largest grid.y and grid.z.
pub const MAX_GRID_YZ: u32 = 65_535;
/// Largest grid.x.
pub const MAX_GRID_X: u32 = i32::MAX as u32;

/// Symbols of the attention kernels, in id order (`KVP_KERNEL_ATTENTION_*`).
const ATTENTION_NAMES: [&str; 30] = [
    "kvp_attention_f32_hd64_r4",
    "kvp_attention_f32_hd64_r8",
    "kvp_attention_f32_hd128_r4",
    "kvp_attention_f32_hd128_r8",
    "kvp_attention_f32_hd256_r4",
    "kvp_attention_f32_hd256_r8",
    "kvp_attention_f16_hd64_r4",
    "kvp_attention_f16_hd64_r8",
    "kvp_attention_f16_hd128_r4",
    "kvp_attention_f16_hd128_r8",
    "kvp_attention_f16_hd256_r4",
    "kvp_attention_f16_hd256_r8",
    "kvp_attention_bf16_hd64_r4",
    "kvp_attention_bf16_hd64_r8",
    "kvp_attention_bf16_hd128_r4",
    "kvp_attention_bf16_hd128_r8",
    "kvp_attention_bf16_hd256_r4",
    "kvp_attention_bf16_hd256_r8",
    "kvp_attention_int8_hd64_r4",
    "kvp_attention_int8_hd64_r8",
    "kvp_attention_int8_hd128_r4",
    "kvp_attention_int8_hd128_r8",
    "kvp_attention_int8_hd256_r4",
    "kvp_attention_int8_hd256_r8",
    "kvp_attention_fp8_hd64_r4",
    "kvp_attention_fp8_hd64_r8",
    "kvp_attention_fp8_hd128_r4",
    "kvp_attention_fp8_hd128_r8",
    "kvp_attention_fp8_hd256_r4",
    "kvp_attention_fp8_hd256_r8",
];

/// One instance of the attention kernel: storage dtype (any), head dim (64, 128, 256)
/// and query rows per CTA (4 or 8), as an index `0..30` into the instances
/// (`6 * dtype + 2 * head-dim index + rows index`). Only [`Kernel::attention`] makes
/// one, so it always names a compiled kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionKernel(u8);

impl AttentionKernel {
    /// Query rows each CTA of this instance handles (4 or 8). O(1).
    pub const fn rows(self) -> u32 {
        if self.0 & 1 == 0 {
            4
        } else {
            8
        }
    }
}

/// The kernels of `kernels/kvpage.cu`, with the ids of `params.h`'s `KVP_KERNEL_*`
/// (the emulation entry's) and their symbols.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `kvp_write_kv`.
    WriteKv,
    /// `kvp_copy_blocks`.
    CopyBlocks,
    /// `kvp_attention_reduce`.
    AttentionReduce,
    /// `kvp_write_kv_stored`.
    WriteKvStored,
    /// `kvp_attention_<dtype>_hd<dim>_r<rows>`.
    Attention(AttentionKernel),
}

impl Kernel {
    /// Number of kernels in the module.
    pub const COUNT: usize = 34;

    /// Kernel `i` of `0..COUNT` (write, copy, reduce, stored write, then the attention
    /// instances), for
    /// loading every kernel of the module; `None` past the end. O(1).
    pub const fn nth(i: usize) -> Option<Self> {
        match i {
            0 => Some(Self::WriteKv),
            1 => Some(Self::CopyBlocks),
            2 => Some(Self::AttentionReduce),
            3 => Some(Self::WriteKvStored),
            4..=33 => Some(Self::Attention(AttentionKernel((i - 4) as u8))),
            _ => None,
        }
    }

    /// The attention kernel for a storage dtype and head dim, with 4 query rows per CTA
    /// for GQA groups of up to 4 heads (fewer registers, no idle rows) and 8 otherwise.
    /// O(1).
    ///
    /// # Errors
    /// [`LaunchError::UnsupportedHeadDim`] for a head dim other than 64, 128, 256.
    pub const fn attention(dtype: DType, head_dim: u32, group: u32) -> Result<Self, LaunchError> {
        let hd = match head_dim {
            64 => 0,
            128 => 1,
            256 => 2,
            _ => return Err(LaunchError::UnsupportedHeadDim { head_dim }),
        };
        let rows = if group <= 4 { 0 } else { 1 };
        let dt = crate::params::dtype_code(dtype) as u8;
        Ok(Self::Attention(AttentionKernel(6 * dt + 2 * hd + rows)))
    }

    /// The emulation entry's id (`KVP_KERNEL_*`). O(1).
    pub const fn id(self) -> u32 {
        match self {
            Self::WriteKv => 0,
            Self::CopyBlocks => 1,
            Self::AttentionReduce => 2,
            Self::WriteKvStored => 3,
            Self::Attention(a) => 16 + a.0 as u32,
        }
    }

    /// The kernel's symbol in the module (`extern "C"`). O(1).
    pub const fn name(self) -> &'static str {
        match self {
            Self::WriteKv => "kvp_write_kv",
            Self::CopyBlocks => "kvp_copy_blocks",
            Self::AttentionReduce => "kvp_attention_reduce",
            Self::WriteKvStored => "kvp_write_kv_stored",
            Self::Attention(a) => ATTENTION_NAMES[a.0 as usize],
        }
    }
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// The kernel.
    pub kernel: Kernel,
    /// CTAs `(x, y, z)`; all non-zero, within the device limits.
    pub grid: [u32; 3],
    /// Threads per CTA `(x, y, z)`.
    pub block: [u32; 3],
    /// Dynamic shared memory in bytes (the kernels use static shared memory only: 0).
    pub shared_bytes: u32,
}

/// Which buffer of a call had the wrong length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    /// New keys `[tokens][kv_heads][head_dim]`.
    Keys,
    /// New values `[tokens][kv_heads][head_dim]`.
    Values,
    /// Queries `[rows][q_heads][head_dim]`.
    Query,
    /// Output, as the queries.
    Output,
    /// Sequence descriptors (one per sequence).
    Seqs,
    /// The arena.
    Arena,
    /// The partition scratch.
    Scratch,
}

/// Why a call cannot be launched. Nothing was launched.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LaunchError {
    /// A buffer does not have the length the shapes require.
    BufferLength {
        /// Which buffer.
        buffer: Buffer,
        /// Elements required.
        expected: u64,
        /// Elements given.
        actual: u64,
    },
    /// `layer >= layers`.
    LayerOutOfRange {
        /// Layer asked for.
        layer: u32,
        /// Layers of the geometry.
        layers: u32,
    },
    /// A slot at or past `num_blocks * block_size`.
    SlotOutOfRange {
        /// The slot.
        slot: u32,
        /// Slots of the arena.
        slots: u64,
    },
    /// A block id at or past the arena's blocks.
    BlockOutOfRange {
        /// The block.
        block: u32,
        /// Blocks of the arena.
        blocks: u32,
    },
    /// A copy whose source is its destination.
    CopyOntoItself {
        /// The block.
        block: u32,
    },
    /// A block written by two copies of one launch, or written by one and read by
    /// another: the copies of a launch run concurrently.
    CopyConflict {
        /// The block.
        block: u32,
    },
    /// Query heads are zero or not a multiple of the KV heads.
    HeadsNotDivisible {
        /// Query heads.
        q_heads: u32,
        /// KV heads.
        kv_heads: u32,
    },
    /// Attention kernels exist for head dims 64, 128 and 256.
    UnsupportedHeadDim {
        /// Head dim of the geometry.
        head_dim: u32,
    },
    /// A write of values already in the storage dtype into 8-bit storage (codes alone
    /// carry no scale).
    ScaledStorage {
        /// Storage dtype of the geometry.
        dtype: DType,
    },
    /// Fixed scales for storage that keeps none (the float dtypes).
    UnscaledStorage {
        /// Storage dtype of the geometry.
        dtype: DType,
    },
    /// A fixed K or V scale that is not finite and positive.
    BadKvScale,
    /// 8-bit storage with an odd block size: its tiles (`block_size * (head_dim + 4)`
    /// bytes) would not keep the attention kernels' 8-byte loads aligned.
    OddBlockSize {
        /// Block size of the geometry.
        block_size: u32,
    },
    /// The softmax scale is not finite.
    BadScale,
    /// A sequence's block-table row is past the table.
    RowOutOfRange {
        /// The row.
        row: u32,
        /// Rows of the table.
        rows: u64,
    },
    /// A context longer than a block-table row holds.
    ContextTooLong {
        /// Tokens of context.
        context_len: u32,
        /// `stride * block_size`.
        capacity: u64,
    },
    /// More query tokens than context.
    QueriesExceedContext {
        /// Query tokens.
        queries: u32,
        /// Tokens of context.
        context_len: u32,
    },
    /// A sequence's `q_start` is not the sum of the queries before it.
    BadQueryStart {
        /// Index of the sequence in the call.
        seq: u32,
        /// `q_start` given.
        q_start: u32,
        /// The sum of the queries before it.
        expected: u64,
    },
    /// A partition length that is zero or not a multiple of the block size.
    BadPartition {
        /// Tokens asked for.
        partition_tokens: u32,
        /// Block size.
        block_size: u32,
    },
    /// A launch dimension past the device limits (or a count past `u32`).
    GridTooLarge {
        /// Which count (`"tokens"`, `"seqs"`, ...).
        what: &'static str,
        /// Its value.
        value: u64,
        /// The limit.
        max: u64,
    },
}

impl fmt::Display for LaunchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::BufferLength {
                buffer,
                expected,
                actual,
            } => write!(f, "{buffer:?} buffer holds {actual} elements, expected {expected}"),
            Self::LayerOutOfRange { layer, layers } => {
                write!(f, "layer {layer} out of range ({layers} layers)")
            }
            Self::SlotOutOfRange { slot, slots } => {
                write!(f, "slot {slot} out of range ({slots} slots)")
            }
            Self::BlockOutOfRange { block, blocks } => {
                write!(f, "block {block} out of range ({blocks} blocks)")
            }
            Self::CopyOntoItself { block } => write!(f, "copy of block {block} onto itself"),
            Self::CopyConflict { block } => write!(
                f,
                "block {block} is written by two copies, or written and read, in one launch"
            ),
            Self::HeadsNotDivisible { q_heads, kv_heads } => write!(
                f,
                "{q_heads} query heads is not a non-zero multiple of {kv_heads} KV heads"
            ),
            Self::UnsupportedHeadDim { head_dim } => write!(
                f,
                "no attention kernel for head dim {head_dim} (64, 128 and 256 exist)"
            ),
            Self::ScaledStorage { dtype } => write!(
                f,
                "values in the storage dtype cannot be written to {dtype:?} storage (no scale)"
            ),
            Self::UnscaledStorage { dtype } => {
                write!(f, "{dtype:?} storage keeps no scales to fix")
            }
            Self::BadKvScale => f.write_str("a fixed K/V scale must be finite and positive"),
            Self::OddBlockSize { block_size } => write!(
                f,
                "8-bit attention needs an even block size (got {block_size})"
            ),
            Self::BadScale => f.write_str("softmax scale is not finite"),
            Self::RowOutOfRange { row, rows } => {
                write!(f, "block-table row {row} out of range ({rows} rows)")
            }
            Self::ContextTooLong {
                context_len,
                capacity,
            } => write!(
                f,
                "context of {context_len} tokens exceeds a block-table row ({capacity})"
            ),
            Self::QueriesExceedContext {
                queries,
                context_len,
            } => write!(f, "{queries} queries exceed a context of {context_len}"),
            Self::BadQueryStart {
                seq,
                q_start,
                expected,
            } => write!(f, "sequence {seq} starts at query {q_start}, expected {expected}"),
            Self::BadPartition {
                partition_tokens,
                block_size,
            } => write!(
                f,
                "partition of {partition_tokens} tokens is not a non-zero multiple of the block size {block_size}"
            ),
            Self::GridTooLarge { what, value, max } => {
                write!(f, "{what} = {value} exceeds the launch limit {max}")
            }
        }
    }
}

impl std::error::Error for LaunchError {}

/// `Err(BufferLength)` unless `actual == expected`.
fn check_len(buffer: Buffer, expected: u64, actual: usize) -> Result<(), LaunchError> {
    if expected == actual as u64 {
        Ok(())
    } else {
        Err(LaunchError::BufferLength {
            buffer,
            expected,
            actual: actual as u64,
        })
    }
}

/// `Err(GridTooLarge)` unless `value <= max`.
fn check_dim(what: &'static str, value: u64, max: u32) -> Result<u32, LaunchError> {
    if value <= u64::from(max) {
        Ok(value as u32)
    } else {
        Err(LaunchError::GridTooLarge {
            what,
            value,
            max: u64::from(max),
        })
    }
}

/// Plans `kvp_write_kv` for the K/V of `slots.len()` new tokens of `layer`: `k` and `v`
/// hold `k_len` and `v_len` f32 (`[tokens][kv_heads][head_dim]` each). O(tokens) (each
/// slot is checked).
///
/// Slots must be distinct (as the core's slot mapping is); with a duplicate it is
/// unspecified which token ends up in the slot (the CPU kernel keeps the later one).
///
/// # Errors
/// [`LaunchError::LayerOutOfRange`], [`LaunchError::BufferLength`] for `k` / `v`,
/// [`LaunchError::SlotOutOfRange`], [`LaunchError::GridTooLarge`] for more than 2^31 − 1
/// tokens or more than 131 070 KV heads.
pub fn plan_write(
    geometry: &Geometry,
    num_blocks: u32,
    layer: u32,
    slots: &[u32],
    k_len: usize,
    v_len: usize,
) -> Result<Option<LaunchConfig>, LaunchError> {
    plan_scatter(
        Kernel::WriteKv,
        geometry,
        num_blocks,
        layer,
        slots,
        k_len,
        v_len,
    )
}

/// Plans `kvp_write_kv` with the 8-bit rows at fixed scales (`[k, v]`: the codes are
/// those of the values over their side's scale, saturating; the rows store that scale):
/// as [`plan_write`]. O(tokens).
///
/// # Errors
/// [`LaunchError::UnscaledStorage`] for the float dtypes, [`LaunchError::BadKvScale`]
/// unless both scales are finite and positive; otherwise as [`plan_write`].
pub fn plan_write_at_scales(
    geometry: &Geometry,
    num_blocks: u32,
    layer: u32,
    slots: &[u32],
    (k_len, v_len): (usize, usize),
    scales: [f32; 2],
) -> Result<Option<LaunchConfig>, LaunchError> {
    if !geometry.dtype().is_scaled() {
        return Err(LaunchError::UnscaledStorage {
            dtype: geometry.dtype(),
        });
    }
    if !scales.iter().all(|&s| s > 0.0 && s.is_finite()) {
        return Err(LaunchError::BadKvScale);
    }
    plan_write(geometry, num_blocks, layer, slots, k_len, v_len)
}

/// [`plan_write`], or [`plan_write_at_scales`] where `scales` are given. O(tokens).
/// Only the launching sides call it (the device's and the emulation's).
#[cfg(any(feature = "cuda", feature = "emulation"))]
pub(crate) fn plan_f32_write(
    geometry: &Geometry,
    num_blocks: u32,
    layer: u32,
    slots: &[u32],
    (k_len, v_len): (usize, usize),
    scales: Option<[f32; 2]>,
) -> Result<Option<LaunchConfig>, LaunchError> {
    match scales {
        None => plan_write(geometry, num_blocks, layer, slots, k_len, v_len),
        Some(s) => plan_write_at_scales(geometry, num_blocks, layer, slots, (k_len, v_len), s),
    }
}

/// Plans `kvp_write_kv_stored`: as [`plan_write`], with `k` and `v` holding `k_len` and
/// `v_len` elements of the storage dtype (f32, f16 or bf16), copied as they are. O(tokens).
///
/// # Errors
/// [`LaunchError::ScaledStorage`] for 8-bit storage; otherwise as [`plan_write`].
pub fn plan_write_stored(
    geometry: &Geometry,
    num_blocks: u32,
    layer: u32,
    slots: &[u32],
    k_len: usize,
    v_len: usize,
) -> Result<Option<LaunchConfig>, LaunchError> {
    if geometry.dtype().is_scaled() {
        return Err(LaunchError::ScaledStorage {
            dtype: geometry.dtype(),
        });
    }
    plan_scatter(
        Kernel::WriteKvStored,
        geometry,
        num_blocks,
        layer,
        slots,
        k_len,
        v_len,
    )
}

/// The checks and the configuration of both writes (`kernel`).
fn plan_scatter(
    kernel: Kernel,
    geometry: &Geometry,
    num_blocks: u32,
    layer: u32,
    slots: &[u32],
    k_len: usize,
    v_len: usize,
) -> Result<Option<LaunchConfig>, LaunchError> {
    if layer >= geometry.layers() {
        return Err(LaunchError::LayerOutOfRange {
            layer,
            layers: geometry.layers(),
        });
    }
    let row = u64::from(geometry.kv_heads()) * u64::from(geometry.head_dim());
    let tokens = check_dim("tokens", slots.len() as u64, MAX_GRID_X)?;
    let expected = row * u64::from(tokens);
    check_len(Buffer::Keys, expected, k_len)?;
    check_len(Buffer::Values, expected, v_len)?;
    let num_slots = u64::from(num_blocks) * u64::from(geometry.block_size());
    if let Some(&slot) = slots.iter().find(|&&s| u64::from(s) >= num_slots) {
        return Err(LaunchError::SlotOutOfRange {
            slot,
            slots: num_slots,
        });
    }
    let y = check_dim(
        "write row groups",
        (2 * u64::from(geometry.kv_heads())).div_ceil(u64::from(WRITE_WARPS)),
        MAX_GRID_YZ,
    )?;
    if tokens == 0 {
        return Ok(None);
    }
    Ok(Some(LaunchConfig {
        kernel,
        grid: [tokens, y, 1],
        block: [32 * WRITE_WARPS, 1, 1],
        shared_bytes: 0,
    }))
}

/// Plans `kvp_copy_blocks` for every copy in one launch, each copying a whole block
/// (`geometry.bytes_per_block()` bytes) in an arena of `num_blocks` blocks.
/// O(copies²) for the conflict check (a step's copies number at most its sequences).
///
/// # Errors
/// [`LaunchError::BlockOutOfRange`], [`LaunchError::CopyOntoItself`],
/// [`LaunchError::CopyConflict`] (a destination written twice, or also a source: the
/// copies of a launch run concurrently, so order-dependent lists must be split),
/// [`LaunchError::GridTooLarge`] for more than 2^31 − 1 copies.
pub fn plan_copy(
    geometry: &Geometry,
    num_blocks: u32,
    copies: &[BlockCopy],
) -> Result<Option<LaunchConfig>, LaunchError> {
    for (i, c) in copies.iter().enumerate() {
        if let Some(block) = [c.src, c.dst].into_iter().find(|&b| b >= num_blocks) {
            return Err(LaunchError::BlockOutOfRange {
                block,
                blocks: num_blocks,
            });
        }
        if c.src == c.dst {
            return Err(LaunchError::CopyOntoItself { block: c.src });
        }
        if let Some(o) = copies[..i]
            .iter()
            .find(|o| o.dst == c.dst || o.dst == c.src || o.src == c.dst)
        {
            let block = if o.dst == c.dst || o.src == c.dst {
                c.dst
            } else {
                c.src
            };
            return Err(LaunchError::CopyConflict { block });
        }
    }
    let pairs = check_dim("copies", copies.len() as u64, MAX_GRID_X)?;
    if pairs == 0 {
        return Ok(None);
    }
    let per_cta = u64::from(COPY_THREADS * COPY_UNROLL) * 16;
    let chunks = geometry.bytes_per_block().div_ceil(per_cta);
    Ok(Some(LaunchConfig {
        kernel: Kernel::CopyBlocks,
        grid: [pairs, chunks.clamp(1, u64::from(MAX_GRID_YZ)) as u32, 1],
        block: [COPY_THREADS, 1, 1],
        shared_bytes: 0,
    }))
}

/// How attention splits each context into partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Partitioning {
    /// Enough partitions that the launch has about [`TARGET_CTAS_PER_SM`] CTAs per SM
    /// of a GPU with `sm_count` SMs, none shorter than [`MIN_PARTITION_TOKENS`] (one
    /// partition when the sequences alone fill the GPU).
    Auto {
        /// Streaming multiprocessors of the device.
        sm_count: u32,
    },
    /// Partitions of exactly this many tokens (a non-zero multiple of the block size).
    Tokens(u32),
}

/// An attention call, as the planner checks it.
#[derive(Debug, Clone, Copy)]
pub struct AttentionCall<'a> {
    /// Geometry of the arena.
    pub geometry: Geometry,
    /// Blocks of the arena.
    pub num_blocks: u32,
    /// Layer read.
    pub layer: u32,
    /// Query heads (a non-zero multiple of the KV heads).
    pub q_heads: u32,
    /// Factor on `q·k` before the softmax (finite).
    pub scale: f32,
    /// The dense block table (rows of `stride` block ids).
    pub table: &'a [u32],
    /// Entries per block-table row.
    pub stride: u32,
    /// The sequences, with `q_start` the running sum of queries ([`pack_seqs`]).
    pub seqs: &'a [KvpSeqDesc],
    /// Elements of the query buffer.
    pub q_len: usize,
    /// Elements of the output buffer.
    pub out_len: usize,
}

/// Fills `out[i]` from `(row, context_len, queries)` of sequence `i`, with `q_start` the
/// sum of the queries before it, and returns the total queries. O(seqs).
///
/// # Errors
/// [`LaunchError::BufferLength`] (buffer `Seqs`) if `out` is shorter than the
/// sequences; [`LaunchError::GridTooLarge`] if the total passes `u32`.
pub fn pack_seqs(
    seqs: impl IntoIterator<Item = (u32, u32, u32)>,
    out: &mut [KvpSeqDesc],
) -> Result<u32, LaunchError> {
    let mut total: u64 = 0;
    for (n, (row, context_len, queries)) in seqs.into_iter().enumerate() {
        let Some(slot) = out.get_mut(n) else {
            return Err(LaunchError::BufferLength {
                buffer: Buffer::Seqs,
                expected: n as u64 + 1,
                actual: out.len() as u64,
            });
        };
        let q_start = check_dim("queries", total, u32::MAX)?;
        *slot = KvpSeqDesc {
            row,
            context_len,
            queries,
            q_start,
        };
        total += u64::from(queries);
    }
    check_dim("queries", total, u32::MAX)
}

/// A planned attention call: the attention launch, the reduce launch when there are
/// several partitions, and the scratch it needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionPlan {
    /// The `kvp_attention_*` launch.
    pub attention: LaunchConfig,
    /// The `kvp_attention_reduce` launch, after `attention`, when `num_partitions > 1`.
    pub reduce: Option<LaunchConfig>,
    /// Tokens per partition (a multiple of the block size).
    pub partition_tokens: u32,
    /// Partitions of the longest context (grid.y).
    pub num_partitions: u32,
    /// Tiles of query rows (4 or 8, the kernel's [`AttentionKernel::rows`]) per KV head,
    /// of the sequence with the most.
    pub row_tiles: u32,
    /// Total query tokens (rows of `q` and `out`).
    pub scratch_rows: u32,
    /// Floats of scratch the launch needs (0 with one partition).
    pub scratch_floats: u64,
    geo: KvpGeometry,
    layer: u32,
    q_heads: u32,
    scale: f32,
    stride: u32,
    num_seqs: u32,
}

/// Device addresses of an attention launch's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttentionBuffers {
    /// The arena.
    pub arena: u64,
    /// Queries.
    pub q: u64,
    /// Output.
    pub out: u64,
    /// Block table.
    pub block_table: u64,
    /// Sequence descriptors.
    pub seqs: u64,
    /// Scratch of at least [`AttentionPlan::scratch_floats`] floats (any when 0).
    pub scratch: u64,
}

impl AttentionPlan {
    /// The kernel parameters of both launches. O(1).
    pub const fn params(&self, buffers: AttentionBuffers) -> KvpAttentionParams {
        KvpAttentionParams {
            geo: self.geo,
            arena: buffers.arena,
            q: buffers.q,
            out: buffers.out,
            block_table: buffers.block_table,
            seqs: buffers.seqs,
            scratch: buffers.scratch,
            table_stride: self.stride,
            num_seqs: self.num_seqs,
            layer: self.layer,
            q_heads: self.q_heads,
            scale: self.scale,
            partition_tokens: self.partition_tokens,
            num_partitions: self.num_partitions,
            row_tiles: self.row_tiles,
            scratch_rows: self.scratch_rows,
            pad0: 0,
        }
    }
}

/// Validates an attention call (decode: one query per sequence; chunked prefill: runs
/// of query tokens, causal over the cached context — the CPU backend's `SeqQuery`
/// semantics) and plans its launches. O(seqs + block-table entries the contexts use).
///
/// # Errors
/// Nothing to launch on error.
/// - [`LaunchError::UnsupportedHeadDim`] — no kernel; [`LaunchError::OddBlockSize`] —
///   8-bit tiles not 8-byte aligned;
/// - [`LaunchError::LayerOutOfRange`], [`LaunchError::HeadsNotDivisible`],
///   [`LaunchError::BadScale`];
/// - [`LaunchError::RowOutOfRange`], [`LaunchError::ContextTooLong`],
///   [`LaunchError::QueriesExceedContext`], [`LaunchError::BadQueryStart`] — a bad
///   sequence;
/// - [`LaunchError::BlockOutOfRange`] — a block id the context needs is not in the arena;
/// - [`LaunchError::BufferLength`] — `q` or `out` not `Σ queries × q_heads × head_dim`;
/// - [`LaunchError::BadPartition`], [`LaunchError::GridTooLarge`] — the partitioning or
///   the counts exceed the launch limits.
pub fn plan_attention(
    call: &AttentionCall<'_>,
    partitioning: Partitioning,
) -> Result<Option<AttentionPlan>, LaunchError> {
    let g = &call.geometry;
    // The head dim first (no kernel at all), the group after the heads check.
    Kernel::attention(g.dtype(), g.head_dim(), 1)?;
    if g.dtype().is_scaled() && !g.block_size().is_multiple_of(2) {
        return Err(LaunchError::OddBlockSize {
            block_size: g.block_size(),
        });
    }
    if call.layer >= g.layers() {
        return Err(LaunchError::LayerOutOfRange {
            layer: call.layer,
            layers: g.layers(),
        });
    }
    if call.q_heads == 0 || !call.q_heads.is_multiple_of(g.kv_heads()) {
        return Err(LaunchError::HeadsNotDivisible {
            q_heads: call.q_heads,
            kv_heads: g.kv_heads(),
        });
    }
    if !call.scale.is_finite() {
        return Err(LaunchError::BadScale);
    }
    let group = call.q_heads / g.kv_heads();
    let kernel = Kernel::attention(g.dtype(), g.head_dim(), group)?;
    let rows_per_cta = match kernel {
        Kernel::Attention(a) => u64::from(a.rows()),
        _ => u64::from(ATT_ROWS),
    };
    let bs = g.block_size();
    let stride = call.stride as usize;
    let rows = call.table.len().checked_div(stride).unwrap_or(0) as u64;
    let capacity = u64::from(call.stride) * u64::from(bs);
    let (mut total, mut max_ctx, mut max_queries, mut row_tiles) = (0u64, 0u32, 0u32, 0u64);
    for (i, s) in call.seqs.iter().enumerate() {
        if u64::from(s.row) >= rows {
            return Err(LaunchError::RowOutOfRange { row: s.row, rows });
        }
        if u64::from(s.context_len) > capacity {
            return Err(LaunchError::ContextTooLong {
                context_len: s.context_len,
                capacity,
            });
        }
        if s.queries > s.context_len {
            return Err(LaunchError::QueriesExceedContext {
                queries: s.queries,
                context_len: s.context_len,
            });
        }
        if u64::from(s.q_start) != total {
            return Err(LaunchError::BadQueryStart {
                seq: i as u32,
                q_start: s.q_start,
                expected: total,
            });
        }
        let row = &call.table[s.row as usize * stride..][..stride];
        let used = s.context_len.div_ceil(bs) as usize;
        if let Some(&block) = row[..used].iter().find(|&&b| b >= call.num_blocks) {
            return Err(LaunchError::BlockOutOfRange {
                block,
                blocks: call.num_blocks,
            });
        }
        // Rows of a sequence (query tokens x group) are u32 in the kernels.
        check_dim(
            "query rows of a sequence",
            u64::from(s.queries) * u64::from(group),
            u32::MAX,
        )?;
        total += u64::from(s.queries);
        if s.queries > 0 {
            max_ctx = max_ctx.max(s.context_len);
        }
        max_queries = max_queries.max(s.queries);
        row_tiles = row_tiles.max((u64::from(s.queries) * u64::from(group)).div_ceil(rows_per_cta));
    }
    let scratch_rows = check_dim("queries", total, u32::MAX)?;
    let expected = total * u64::from(call.q_heads) * u64::from(g.head_dim());
    check_len(Buffer::Query, expected, call.q_len)?;
    check_len(Buffer::Output, expected, call.out_len)?;
    if total == 0 {
        return Ok(None);
    }
    let num_seqs = check_dim("seqs", call.seqs.len() as u64, MAX_GRID_YZ)?;
    let x = check_dim(
        "kv_heads * row_tiles",
        u64::from(g.kv_heads()) * row_tiles,
        MAX_GRID_X,
    )?;
    let partition_tokens = match partitioning {
        Partitioning::Tokens(p) => {
            if p == 0 || !p.is_multiple_of(bs) {
                return Err(LaunchError::BadPartition {
                    partition_tokens: p,
                    block_size: bs,
                });
            }
            p
        }
        Partitioning::Auto { sm_count } => auto_partition(
            max_ctx,
            bs,
            u64::from(x) * u64::from(num_seqs),
            u64::from(sm_count),
        ),
    };
    let parts = check_dim(
        "partitions",
        u64::from(max_ctx.div_ceil(partition_tokens)),
        MAX_GRID_YZ,
    )?;
    let block = [ATT_THREADS, 1, 1];
    let (reduce, scratch_floats) = if parts > 1 {
        let per_row = u64::from(g.head_dim()) + 2;
        let floats = total
            .checked_mul(u64::from(call.q_heads) * u64::from(parts))
            .and_then(|n| n.checked_mul(per_row))
            .ok_or(LaunchError::GridTooLarge {
                what: "scratch floats",
                value: u64::MAX,
                max: u64::MAX,
            })?;
        let reduce = LaunchConfig {
            kernel: Kernel::AttentionReduce,
            grid: [
                num_seqs,
                check_dim("queries per sequence", u64::from(max_queries), MAX_GRID_YZ)?,
                check_dim("q_heads", u64::from(call.q_heads), MAX_GRID_YZ)?,
            ],
            block: [REDUCE_THREADS, 1, 1],
            shared_bytes: 0,
        };
        (Some(reduce), floats)
    } else {
        (None, 0)
    };
    Ok(Some(AttentionPlan {
        attention: LaunchConfig {
            kernel,
            grid: [x, parts, num_seqs],
            block,
            shared_bytes: 0,
        },
        reduce,
        partition_tokens,
        num_partitions: parts,
        row_tiles: row_tiles as u32,
        scratch_rows,
        scratch_floats,
        geo: KvpGeometry::new(g, call.num_blocks),
        layer: call.layer,
        q_heads: call.q_heads,
        scale: call.scale,
        stride: call.stride,
        num_seqs,
    }))
}

/// Partition length for a longest context of `max_ctx` tokens when the launch has
/// `ctas` CTAs per partition: the fewest partitions that give about
/// [`TARGET_CTAS_PER_SM`] CTAs per SM, each at least [`MIN_PARTITION_TOKENS`] (rounded
/// up to the block size), at most [`MAX_GRID_YZ`] of them. O(1).
fn auto_partition(max_ctx: u32, bs: u32, ctas: u64, sm_count: u64) -> u32 {
    let round = |t: u64| -> u64 { t.div_ceil(u64::from(bs)) * u64::from(bs) };
    let ctx = u64::from(max_ctx.max(1));
    let min_part = round(u64::from(MIN_PARTITION_TOKENS));
    let target = sm_count.max(1) * u64::from(TARGET_CTAS_PER_SM);
    let want = target.div_ceil(ctas.max(1)).max(1);
    let fewest = round(ctx.div_ceil(u64::from(MAX_GRID_YZ)));
    let p = round(ctx.div_ceil(want)).max(min_part).max(fewest);
    // A partition never needs to be longer than the context: one partition.
    p.min(round(ctx)).min(u64::from(u32::MAX / bs * bs)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(dtype: DType, hd: u32, bs: u32) -> Geometry {
        Geometry::new(2, 4, hd, bs, dtype).unwrap()
    }

    #[test]
    fn kernels_by_dtype_and_head_dim() {
        let k = Kernel::attention(DType::F16, 128, 4).unwrap();
        assert_eq!(k.name(), "kvp_attention_f16_hd128_r4");
        assert_eq!(k.id(), 16 + 6 + 2);
        let k = Kernel::attention(DType::Bf16, 256, 8).unwrap();
        assert_eq!((k.name(), k.id()), ("kvp_attention_bf16_hd256_r8", 33));
        assert_eq!(
            Kernel::attention(DType::F32, 64, 5).unwrap().name(),
            "kvp_attention_f32_hd64_r8"
        );
        assert_eq!(
            Kernel::attention(DType::F16, 96, 1),
            Err(LaunchError::UnsupportedHeadDim { head_dim: 96 })
        );
        let k = Kernel::attention(DType::Fp8E4m3, 64, 2).unwrap();
        assert_eq!((k.name(), k.id()), ("kvp_attention_fp8_hd64_r4", 40));
        let all: Vec<Kernel> = (0..Kernel::COUNT).map_while(Kernel::nth).collect();
        assert_eq!(all.len(), Kernel::COUNT);
        assert_eq!(Kernel::nth(Kernel::COUNT), None);
        for (i, k) in all.iter().enumerate() {
            assert!(all[..i]
                .iter()
                .all(|o| o.id() != k.id() && o.name() != k.name()));
            // The name carries the row count the planner tiles by.
            if let Kernel::Attention(a) = k {
                assert!(k.name().ends_with(&format!("_r{}", a.rows())));
            }
        }
    }

    #[test]
    fn write_plan_and_checks() {
        let g = geo(DType::F16, 64, 16);
        let row = 4 * 64;
        let cfg = plan_write(&g, 10, 1, &[0, 159, 7], 3 * row, 3 * row)
            .unwrap()
            .unwrap();
        assert_eq!(cfg.grid, [3, 2, 1]);
        assert_eq!(cfg.block, [128, 1, 1]);
        assert_eq!(plan_write(&g, 10, 0, &[], 0, 0), Ok(None));
        assert_eq!(
            plan_write(&g, 10, 0, &[160], row, row),
            Err(LaunchError::SlotOutOfRange {
                slot: 160,
                slots: 160
            })
        );
        assert_eq!(
            plan_write(&g, 10, 2, &[0], row, row),
            Err(LaunchError::LayerOutOfRange {
                layer: 2,
                layers: 2
            })
        );
        let stored = plan_write_stored(&g, 10, 1, &[3], row, row)
            .unwrap()
            .unwrap();
        assert_eq!(stored.kernel.name(), "kvp_write_kv_stored");
        let g8 = Geometry::new(2, 4, 64, 16, DType::Int8).unwrap();
        assert_eq!(
            plan_write_stored(&g8, 10, 0, &[0], row, row),
            Err(LaunchError::ScaledStorage { dtype: DType::Int8 })
        );
        assert!(matches!(
            plan_write(&g, 10, 0, &[0], row, row - 1),
            Err(LaunchError::BufferLength {
                buffer: Buffer::Values,
                ..
            })
        ));
    }

    #[test]
    fn copy_plan_and_conflicts() {
        let g = geo(DType::F32, 128, 16);
        let c = |src, dst| BlockCopy { src, dst };
        let cfg = plan_copy(&g, 8, &[c(0, 1), c(0, 2)]).unwrap().unwrap();
        // 2 layers * 2 * 4 heads * 16 * 128 * 4 B = 128 KiB: 16 KiB per CTA.
        assert_eq!(cfg.grid, [2, 8, 1]);
        assert_eq!(plan_copy(&g, 8, &[]), Ok(None));
        assert_eq!(
            plan_copy(&g, 8, &[c(3, 3)]),
            Err(LaunchError::CopyOntoItself { block: 3 })
        );
        assert_eq!(
            plan_copy(&g, 8, &[c(0, 1), c(2, 1)]),
            Err(LaunchError::CopyConflict { block: 1 })
        );
        assert_eq!(
            plan_copy(&g, 8, &[c(0, 1), c(1, 2)]),
            Err(LaunchError::CopyConflict { block: 1 })
        );
        assert_eq!(
            plan_copy(&g, 8, &[c(0, 8)]),
            Err(LaunchError::BlockOutOfRange {
                block: 8,
                blocks: 8
            })
        );
    }

    fn call<'a>(
        g: Geometry,
        table: &'a [u32],
        seqs: &'a [KvpSeqDesc],
        q_heads: u32,
    ) -> AttentionCall<'a> {
        let total: u64 = seqs.iter().map(|s| u64::from(s.queries)).sum();
        let n = (total * u64::from(q_heads) * u64::from(g.head_dim())) as usize;
        AttentionCall {
            geometry: g,
            num_blocks: 64,
            layer: 0,
            q_heads,
            scale: 0.125,
            table,
            stride: 8,
            seqs,
            q_len: n,
            out_len: n,
        }
    }

    #[test]
    fn decode_partitions_fill_the_gpu() {
        let g = geo(DType::F16, 128, 16);
        let table: Vec<u32> = (0..64).collect();
        let mut seqs = [KvpSeqDesc::default(); 2];
        pack_seqs([(0, 128, 1), (3, 100, 1)], &mut seqs).unwrap();
        assert_eq!(seqs[1].q_start, 1);
        // One GPU of 132 SMs, 2 seqs x 4 KV heads: partitions of the minimum length.
        let plan = plan_attention(
            &call(g, &table, &seqs, 32),
            Partitioning::Auto { sm_count: 132 },
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            plan.num_partitions, 1,
            "128 tokens fit one 256-token partition"
        );
        assert_eq!(plan.attention.grid, [4, 1, 2]);
        assert!(plan.reduce.is_none());
        let plan = plan_attention(&call(g, &table, &seqs, 32), Partitioning::Tokens(32))
            .unwrap()
            .unwrap();
        assert_eq!(plan.num_partitions, 4);
        assert_eq!(plan.reduce.unwrap().grid, [2, 1, 32]);
        assert_eq!(plan.scratch_floats, 2 * 32 * 4 * 130);
        assert_eq!(
            plan_attention(&call(g, &table, &seqs, 32), Partitioning::Tokens(24)),
            Err(LaunchError::BadPartition {
                partition_tokens: 24,
                block_size: 16
            })
        );
    }

    #[test]
    fn auto_partition_lengths() {
        // 1 sequence x 32k tokens, 8 CTAs: 132 SMs want ~1056 CTAs -> 132 partitions of
        // 256 tokens (the minimum) at most; 32768 / 132 rounds to 256.
        assert_eq!(auto_partition(32_768, 16, 8, 132), 256);
        // 64 sequences x 8 KV heads = 512 CTAs want 1056: 3 partitions.
        assert_eq!(auto_partition(4096, 16, 64 * 8, 132), 1376);
        // Enough sequences to fill the GPU: one partition of the whole context.
        assert_eq!(auto_partition(4096, 16, 4096, 132), 4096);
        // Never past the grid limit, always a multiple of the block size.
        let p = auto_partition(u32::MAX, 32, 1, 132);
        assert!(p.is_multiple_of(32) && u64::from(u32::MAX).div_ceil(u64::from(p)) <= 65_535);
    }

    #[test]
    fn attention_checks() {
        let g = geo(DType::Bf16, 64, 8);
        let table: Vec<u32> = (0..16).collect();
        let mut seqs = [KvpSeqDesc::default(); 1];
        pack_seqs([(0, 20, 3)], &mut seqs).unwrap();
        let ok = call(g, &table, &seqs, 8);
        let auto = Partitioning::Auto { sm_count: 4 };
        let plan = plan_attention(&ok, auto).unwrap().unwrap();
        // 3 queries x group 2 = 6 rows: two tiles of the 4-row kernel.
        assert_eq!(plan.row_tiles, 2);
        assert_eq!(plan.attention.kernel.name(), "kvp_attention_bf16_hd64_r4");
        let bad = |c: AttentionCall<'_>| plan_attention(&c, auto).unwrap_err();
        assert_eq!(
            bad(AttentionCall {
                scale: f32::NAN,
                ..ok
            }),
            LaunchError::BadScale
        );
        assert!(matches!(
            bad(AttentionCall { q_heads: 6, ..ok }),
            LaunchError::HeadsNotDivisible { .. }
        ));
        assert!(matches!(
            bad(AttentionCall {
                num_blocks: 2,
                ..ok
            }),
            LaunchError::BlockOutOfRange { block: 2, .. }
        ));
        assert!(matches!(
            bad(AttentionCall { stride: 2, ..ok }),
            LaunchError::ContextTooLong { .. }
        ));
        assert!(matches!(
            bad(AttentionCall {
                out_len: ok.out_len - 1,
                ..ok
            }),
            LaunchError::BufferLength {
                buffer: Buffer::Output,
                ..
            }
        ));
        let desc = |row, context_len, queries, q_start| KvpSeqDesc {
            row,
            context_len,
            queries,
            q_start,
        };
        let wrong = [desc(0, 2, 3, 0)];
        assert!(matches!(
            bad(AttentionCall { seqs: &wrong, ..ok }),
            LaunchError::QueriesExceedContext { .. }
        ));
        let wrong = [desc(0, 20, 3, 1)];
        assert!(matches!(
            bad(AttentionCall { seqs: &wrong, ..ok }),
            LaunchError::BadQueryStart { .. }
        ));
        let wrong = [desc(2, 20, 3, 0)];
        assert_eq!(
            bad(AttentionCall { seqs: &wrong, ..ok }),
            LaunchError::RowOutOfRange { row: 2, rows: 2 }
        );
        let odd = AttentionCall {
            geometry: Geometry::new(2, 4, 64, 5, DType::Int8).unwrap(),
            ..ok
        };
        assert_eq!(bad(odd), LaunchError::OddBlockSize { block_size: 5 });
        let empty = [desc(0, 5, 0, 0)];
        let c = AttentionCall {
            seqs: &empty,
            q_len: 0,
            out_len: 0,
            ..ok
        };
        assert_eq!(plan_attention(&c, auto), Ok(None));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Any call: the planner returns (never panics), and an accepted plan keeps
            /// the kernels' contracts: grid within the limits, partitions a non-zero
            /// multiple of the block size covering the longest context, one tile row per
            /// 4 or 8 query rows, scratch for every (row, head, partition).
            #[test]
            fn plans_keep_the_kernel_contracts(
                dtype in prop::sample::select(vec![DType::F32, DType::F16, DType::Bf16, DType::Int8, DType::Fp8E4m3]),
                hd in prop::sample::select(vec![64u32, 128, 256, 80]),
                bs in 1u32..40,
                kv_heads in 1u32..5,
                group in 1u32..10,
                stride in 0u32..6,
                seqs in prop::collection::vec((0u32..4, 0u32..200, 0u32..20), 0..6),
                num_blocks in 1u32..30,
                tokens in prop::option::of(1u32..600),
                sm_count in 1u32..200,
                bad_len in any::<bool>(),
            ) {
                let g = Geometry::new(2, kv_heads, hd, bs, dtype).unwrap();
                let table: Vec<u32> = (0..4 * stride).map(|i| i % num_blocks).collect();
                let mut descs = vec![KvpSeqDesc::default(); seqs.len()];
                let total = pack_seqs(seqs.iter().copied(), &mut descs).unwrap();
                let q_heads = kv_heads * group;
                let n = (total * q_heads * hd) as usize + usize::from(bad_len);
                let call = AttentionCall {
                    geometry: g,
                    num_blocks,
                    layer: 1,
                    q_heads,
                    scale: 0.5,
                    table: &table,
                    stride,
                    seqs: &descs,
                    q_len: n,
                    out_len: n,
                };
                let partitioning = match tokens {
                    Some(t) => Partitioning::Tokens(t),
                    None => Partitioning::Auto { sm_count },
                };
                if let Ok(Some(plan)) = plan_attention(&call, partitioning) {
                    prop_assert!(!bad_len);
                    let [x, y, z] = plan.attention.grid;
                    prop_assert!((1..=MAX_GRID_X).contains(&x) && (1..=MAX_GRID_YZ).contains(&y));
                    prop_assert!((1..=MAX_GRID_YZ).contains(&z) && z as usize == seqs.len());
                    prop_assert!(plan.partition_tokens > 0 && plan.partition_tokens % bs == 0);
                    let rows = match plan.attention.kernel {
                        Kernel::Attention(a) => a.rows(),
                        _ => unreachable!("an attention plan launches an attention kernel"),
                    };
                    for d in &descs {
                        prop_assert!(d.context_len <= stride * bs);
                        // A sequence without queries has no rows: its CTAs do nothing,
                        // and the partitions need not cover its context.
                        if d.queries > 0 {
                            prop_assert!(u64::from(d.context_len) <= u64::from(y) * u64::from(plan.partition_tokens));
                        }
                        prop_assert!((d.queries * group).div_ceil(rows) <= plan.row_tiles);
                    }
                    prop_assert_eq!(x, kv_heads * plan.row_tiles);
                    prop_assert_eq!(plan.reduce.is_some(), y > 1);
                    if y > 1 {
                        prop_assert_eq!(
                            plan.scratch_floats,
                            u64::from(total) * u64::from(q_heads) * u64::from(y) * (u64::from(hd) + 2)
                        );
                    }
                }
            }
        }
    }
}
