//! kvpage: the std facade of the paged KV cache — owned storage, CPU kernels.
//!
//! - [`Arena`] and [`KvLayout`]: one aligned allocation in the block-major layout of the
//!   design (`[layer][k|v][kv_head][token][head_dim]` per block).
//! - [`Element`]: storage types `f32`, `f16`, `bf16`; arithmetic is `f32`.
//! - [`kernels`]: write K/V through the slot mapping, paged decode / chunked-prefill
//!   attention with GQA, block copies — functions over plain slices.

#![warn(missing_docs)]

pub mod arena;
pub mod dtype;
pub mod error;
pub mod kernels;

pub use arena::{Arena, ArenaAllocError, KvLayout};
pub use dtype::Element;
pub use error::{Buffer, KernelError};
pub use half::{bf16, f16};
