//! CPU kernels over the block-major arena, as functions over plain slices.
//!
//! Every kernel validates all of its inputs first and returns a [`KernelError`] without
//! writing anything when one is wrong; after validation nothing can fail or panic. The
//! kernels allocate nothing and start no threads: scratch (about 57 KiB) lives on each
//! participating thread's stack, and the threads are those of a [`WorkerPool`], started
//! once when it is made and parked between calls.
//!
//! - [`write_kv`]: store the K and V of new tokens of one layer at their slots
//!   ([`write_kv_at_scales`]: 8-bit storage at fixed scales).
//! - [`paged_attention`]: chunked-prefill attention (causal, over the cached context
//!   plus the new tokens); decode is the case of one query token per sequence
//!   ([`SeqQuery::decode`]). Grouped-query attention, any block size, any length.
//! - [`copy_blocks`]: copy whole blocks (copy-on-write).
//! - [`rotate_keys`]: re-rotate stored keys by a position delta (rotary embedding), in
//!   place — what a context shift needs instead of recomputing the moved tokens.
//! - [`contiguous_attention`]: the same kernel over an unpaged layout, as a baseline.
//! - [`WorkerPool`]: the threads an attention call runs on (or none: the calling thread).
//!
//! [`KernelError`]: crate::KernelError

#[cfg(target_arch = "x86_64")]
mod amx;
mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod contiguous;
mod copy;
#[cfg(target_arch = "x86_64")]
mod dot;
#[cfg(target_arch = "x86_64")]
mod lanes;
mod math;
mod online;
mod parallel;
mod pool;
#[cfg(target_arch = "x86_64")]
mod reduce;
mod rope;
mod write;

pub use attention::paged_attention;
pub use contiguous::{contiguous_attention, ContiguousKv};
pub use copy::{copy_blocks, copy_blocks_between, move_rows};
pub use pool::{Executor, WorkerPool, MAX_THREADS};
pub use rope::{rotate_keys, KeyShift, RopeError, RopePairing, RopeParams};
pub use write::{write_kv, write_kv_as, write_kv_at_scales};

/// Name of the environment variable that caps the instruction set the kernels take:
/// `avx512dot` (AVX-512 with its dot-product extensions, without AMX tiles),
/// `avx512f` (AVX-512F without its dot-product extensions: 8-bit storage in f32
/// arithmetic), `avx2` (never AVX-512) or `portable` (no x86 vector extensions); unset,
/// or any other value, lets them take the widest the CPU has. Read once, at the first kernel call. For measuring
/// and testing the narrower paths on a machine that has the wider ones.
pub const CPU_PATH_ENV: &str = "KVPAGE_CPU_PATH";

/// Whether the CPU is an Intel core (CPUID vendor `GenuineIntel`), where FP8 storage
/// takes other routes than on AMD's: f32 FMAs over codes decoded through f16, not bf16
/// dot products ([`dot`]'s `Bf16Dot`) nor the in-lane decoding
/// ([`lanes::applies_bytes`], through the route [`avx2::Avx2`] holds); both measured
/// slower there. Read once; O(1) after the first call.
#[cfg(target_arch = "x86_64")]
pub(crate) fn intel_core() -> bool {
    static INTEL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INTEL.get_or_init(|| {
        // SAFETY: CPUID leaf 0 exists on every x86-64 CPU (`__cpuid` is an unsafe
        // function in Rust 1.89, the minimum supported, and safe in later releases).
        #[allow(unused_unsafe)]
        let id = unsafe { core::arch::x86_64::__cpuid(0) };
        [id.ebx, id.edx, id.ecx] == [*b"Genu", *b"ineI", *b"ntel"].map(u32::from_le_bytes)
    })
}

/// The widest instruction set the environment allows (see [`CPU_PATH_ENV`]): 4 any, 3
/// AVX-512 with its dot-product extensions, 2 AVX-512F, 1 AVX2, 0 portable. O(1) after
/// the first call.
#[cfg(target_arch = "x86_64")]
pub(crate) fn path_ceiling() -> u8 {
    static CEILING: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
    *CEILING.get_or_init(|| match std::env::var(CPU_PATH_ENV).as_deref() {
        Ok("avx512dot") => 3,
        Ok("avx512f") => 2,
        Ok("avx2") => 1,
        Ok("portable") => 0,
        _ => 4,
    })
}

/// The arithmetic the attention kernels take on this CPU (chosen at run time, the widest
/// it has, within [`CPU_PATH_ENV`]): `"avx512f"`, with `+vnni` when int8 storage takes
/// 16-bit integer dot products, `+bf16` when FP8 storage takes bf16 dot products
/// (never on Intel cores, which run them at half rate), `+amx` when bf16 and FP8
/// storage take AMX tiles (decode and prefill of groups of 4 or 8 query heads per KV
/// head) and `+amx-int8` when int8 storage does too (decode of groups of 4, where the
/// CPU has AMX-INT8); `"avx2+fma"`; or `"portable"`. O(1) after the first call.
pub fn instruction_path() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        let amx = amx::AmxBf16::detect();
        match (
            dot::Avx512Dot::<dot::Vnni>::detect().is_some(),
            dot::Avx512Dot::<dot::Bf16Dot>::detect().is_some(),
            amx.is_some(),
            amx.is_some_and(|amx| amx.takes_int8()),
        ) {
            (true, true, true, true) => return "avx512f+vnni+bf16+amx+amx-int8",
            (true, true, true, false) => return "avx512f+vnni+bf16+amx",
            (true, true, false, _) => return "avx512f+vnni+bf16",
            (true, false, true, true) => return "avx512f+vnni+amx+amx-int8",
            (true, false, true, false) => return "avx512f+vnni+amx",
            (true, false, false, _) => return "avx512f+vnni",
            (false, true, true, true) => return "avx512f+bf16+amx+amx-int8",
            (false, true, true, false) => return "avx512f+bf16+amx",
            (false, true, false, _) => return "avx512f+bf16",
            (false, false, true, true) => return "avx512f+amx+amx-int8",
            (false, false, true, false) => return "avx512f+amx",
            (false, false, false, _) => {}
        }
        if avx512::Avx512::detect().is_some() {
            return "avx512f";
        }
        if avx2::Avx2::detect().is_some() {
            return "avx2+fma";
        }
    }
    "portable"
}

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

/// Shape, scale and threads of an attention call.
#[derive(Clone, Copy)]
pub struct AttentionParams<'p> {
    /// Query heads: a non-zero multiple of the layout's KV heads (equal: MHA; one KV
    /// head: MQA).
    pub q_heads: u32,
    /// Factor applied to `q·k` before the softmax (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// The threads that share the call's tasks with the calling thread: a
    /// [`WorkerPool`] or the host's own [`Executor`]; `None`: the calling thread only.
    /// A call too small to repay waking a worker runs on the calling thread either way,
    /// and so does a call that finds a `WorkerPool` busy.
    pub pool: Option<&'p dyn Executor>,
}

impl core::fmt::Debug for AttentionParams<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("AttentionParams")
            .field("q_heads", &self.q_heads)
            .field("scale", &self.scale)
            .field("pool", &self.pool.map(|_| "dyn Executor"))
            .finish()
    }
}
