//! CPU kernels over the block-major arena, as functions over plain slices.
//!
//! Every kernel validates all of its inputs first and returns a [`KernelError`] without
//! writing anything when one is wrong; after validation nothing can fail or panic. The
//! kernels allocate no buffers: scratch (about 36 KiB) lives on each worker's stack;
//! the only allocation is the operating system's, for the worker threads of a call that
//! uses more than one (see `parallel`).
//!
//! - [`write_kv`]: store the K and V of new tokens of one layer at their slots.
//! - [`paged_attention`]: chunked-prefill attention (causal, over the cached context
//!   plus the new tokens); decode is the case of one query token per sequence
//!   ([`SeqQuery::decode`]). Grouped-query attention, any block size, any length.
//! - [`copy_blocks`]: copy whole blocks (copy-on-write).
//! - [`contiguous_attention`]: the same kernel over an unpaged layout, as a baseline.
//!
//! [`KernelError`]: crate::KernelError

mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod contiguous;
mod copy;
mod math;
mod online;
mod parallel;
mod write;

pub use attention::paged_attention;
pub use contiguous::{contiguous_attention, ContiguousKv};
pub use copy::{copy_blocks, copy_blocks_between};
pub use write::write_kv;

/// Largest head dimension the kernels accept (their scratch is sized for it).
pub const MAX_HEAD_DIM: usize = 256;

/// One sequence of an attention call.
///
/// Its last `queries` tokens of context are the new query tokens, at absolute positions
/// `context_len - queries .. context_len`; their K/V must already be written (with
/// [`write_kv`]). Query token `i` attends to tokens `0..=context_len - queries + i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqQuery {
    /// Row of the block table (the core's `SeqId::index()`).
    pub row: u32,
    /// Tokens of context, the new ones included.
    pub context_len: u32,
    /// New query tokens (1 for decode).
    pub queries: u32,
}

impl SeqQuery {
    /// Decode: one query token, the last of `context_len`. O(1).
    pub const fn decode(row: u32, context_len: u32) -> Self {
        Self {
            row,
            context_len,
            queries: 1,
        }
    }
}

/// A dense block table: row `r` is `table[r * stride .. (r + 1) * stride]`, holding the
/// physical block ids of logical blocks `0, 1, ..` of one sequence (exactly the core's
/// `BlockManager::block_table()` with `stride = max_blocks_per_seq`). Only the first
/// `ceil(context_len / block_size)` entries of a row are read.
#[derive(Debug, Clone, Copy)]
pub struct BlockTable<'a> {
    /// The table.
    pub table: &'a [u32],
    /// Entries per row (`> 0`).
    pub stride: u32,
}

/// Shape and scale of an attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    /// Query heads: a non-zero multiple of the layout's KV heads (equal: MHA; one KV
    /// head: MQA).
    pub q_heads: u32,
    /// Factor applied to `q·k` before the softmax (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Threads to use (the calling thread included); 0 or 1 run on the calling thread.
    /// At most one per task is started, and a thread the OS refuses to start is done
    /// without (its tasks run on the others).
    pub threads: usize,
}
