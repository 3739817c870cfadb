//! kvpage: the std facade of the paged KV cache — owned storage, CPU kernels.
//!
//! - [`Arena`] and [`KvLayout`]: one aligned allocation in the block-major layout of the
//!   design (`[layer][k|v][kv_head][token][head_dim]` per block); a layout is a core
//!   [`Geometry`] (whose dtype is the arena's storage type) and a number of blocks.
//! - [`KvCache`]: the owned cache — core manager, storage, arena and kernels in one
//!   type; handles checked per cache, copy-on-write executed for the caller.
//! - [`Element`]: storage types `f32`, `f16`, `bf16`; arithmetic is `f32`.
//! - [`kernels`]: write K/V through the slot mapping, paged decode / chunked-prefill
//!   attention with GQA, block copies — functions over plain slices; attention runs on
//!   a [`WorkerPool`] of threads started once (a cache owns one); re-rotation of stored
//!   keys by a position delta ([`RopeParams`]) for a context shift.
//! - [`quant`]: the 8-bit codes (int8, FP8 E4M3) of the scaled storage dtypes, whose
//!   tiles keep one `f32` scale per token and head after the codes, by default the
//!   row's own, or a layer's fixed [`KvScales`] ([`KvCache::set_kv_scales`]).
//! - [`persist`]: save a sequence (token ids, positions, K/V blocks) into a buffer or a
//!   file and restore it into any free blocks of a cache of the same geometry and model.
//! - [`SharedManager`]: the core's block manager shared between threads behind a
//!   blocking [`std::sync::Mutex`] (the core's own wrapper spins, for bare metal).
//!
//! ```
//! use kvpage::{CacheConfig, Capacity, DType, Geometry, KvCache};
//!
//! // 2 layers, 2 KV heads of 8 dims, blocks of 16 tokens, f16 storage.
//! let geometry = Geometry::new(2, 2, 8, 16, DType::F16)?;
//! let config = CacheConfig {
//!     geometry,
//!     capacity: Capacity::Blocks(64),
//!     max_seqs: 4,
//!     max_seq_len: 256,
//!     threads: 0,
//!     event_capacity: 0,
//!     hash_key: None,
//!     max_namespaces: kvpage::CACHE_NAMESPACES,
//! };
//! let mut cache = KvCache::new(config)?;
//!
//! // A prompt of 20 tokens: append it, store its K/V (here constant) in every layer,
//! // then attend with 4 query heads (GQA, 2 per KV head) from its 20 positions.
//! let prompt: Vec<u32> = (0..20).collect();
//! let start = cache.create_with_prompt(0, &prompt)?;
//! let kv = vec![0.5f32; 20 * 2 * 8];
//! for layer in 0..2 {
//!     cache.write_kv(start.seq, layer, 0, &kv, &kv)?;
//! }
//! let q = vec![0.25f32; 20 * 4 * 8];
//! let mut out = vec![0.0f32; q.len()];
//! cache.prefill(1, &[(start.seq, 20)], &q, &mut out, 4, 1.0 / 8f32.sqrt())?;
//! assert!(out.iter().all(|x| (x - 0.5).abs() < 1e-3));
//!
//! // Next token: append, write its K/V, decode.
//! cache.append_tokens(start.seq, &[20])?;
//! let kv1 = vec![0.5f32; 2 * 8];
//! for layer in 0..2 {
//!     cache.write_kv(start.seq, layer, 20, &kv1, &kv1)?;
//! }
//! let mut out1 = vec![0.0f32; 4 * 8];
//! cache.decode(0, &[start.seq], &q[..4 * 8], &mut out1, 4, 1.0 / 8f32.sqrt())?;
//! cache.release(start.seq)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]

pub mod arena;
pub mod cache;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod kernels;
pub mod persist;
#[cfg(feature = "events-zmq")]
pub mod publish;
pub mod quant;
mod shared;
mod storage;
mod tables;

pub use arena::{Arena, ArenaAllocError, KvLayout};
pub use cache::{
    CacheConfig, CacheError, CacheEvent, Capacity, Drained, EventBatch, KvCache, PromptSeq, Seq,
    StoredEvent, CACHE_NAMESPACES,
};
pub use dtype::{Element, Fp8E4m3, Int8};
pub use engine::{Engine, EngineConfig};
pub use error::{Buffer, KernelError};
pub use half::{bf16, f16};
pub use kernels::{Executor, RopeError, RopePairing, RopeParams, WorkerPool};
pub use kvpage_core::{
    BlockCopy, ContextShift, DType, Edited, EngineError, EngineStats, EventError, FinishReason,
    Finished, FinishedRequests, Geometry, GeometryError, InitError, KvEvent, NamespaceQuota,
    PositionRun, Preemption, Priority, QuotaError, RemovedBlock, RequestId, RequestState, RowMove,
    Sampled, ScheduledSeq, SchedulerConfig, SeqError, Stats, Step, MAX_NAMESPACES,
};
pub use persist::{
    ModelFingerprint, PersistError, PrefixLoadReport, RestoredInfo, SavedPrefixCache, SeqBlob,
};
pub use quant::KvScales;
pub use shared::SharedManager;
pub use storage::{Backend, CudaOptions, DeviceFault};
