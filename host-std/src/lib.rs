//! kvpage: the std facade of the paged KV cache — owned storage, CPU kernels.
//!
//! - [`Arena`] and [`KvLayout`]: one aligned allocation in the block-major layout of the
//!   design (`[layer][k|v][kv_head][token][head_dim]` per block).
//! - [`KvCache`]: the owned cache — core manager, storage, arena and kernels in one
//!   type; handles checked per cache, copy-on-write executed for the caller.
//! - [`Element`]: storage types `f32`, `f16`, `bf16`; arithmetic is `f32`.
//! - [`kernels`]: write K/V through the slot mapping, paged decode / chunked-prefill
//!   attention with GQA, block copies — functions over plain slices.

#![warn(missing_docs)]

pub mod arena;
pub mod cache;
pub mod dtype;
pub mod error;
pub mod kernels;

pub use arena::{Arena, ArenaAllocError, KvLayout};
pub use cache::{CacheConfig, CacheError, Capacity, KvCache, PromptSeq, Seq};
pub use dtype::Element;
pub use error::{Buffer, KernelError};
pub use half::{bf16, f16};
pub use kvpage_core::{DType, Geometry, SeqError, Stats};
