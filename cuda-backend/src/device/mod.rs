//! The device side over [`crate::driver::Driver`] (feature `cuda`):
//! - resources: a [`Context`] on a chosen device, owned [`DeviceMemory`] and
//!   [`PinnedMemory`], [`Stream`]s (or a caller's, borrowed as a [`StreamRef`]),
//!   [`Event`]s, the kernels' [`Module`] and [`Kernels`];
//! - [`StepBuffers`]: the per-step metadata, preallocated, uploaded in few copies;
//! - [`HostTier`]: the pinned host arena and the swaps' copy stream;
//! - [`DeviceKv`]: the device half of a paged KV cache (arena, kernels, step buffers,
//!   host tier), driven by the caller's block manager (`kvpage::KvCache`'s CUDA backend).
//!
//! Every resource holds an `Arc` of its [`Context`] and makes it current before its
//! driver calls, so it can be used and dropped from any thread, and the context (the
//! device's primary context, retained once per [`Context`]) outlives everything made in
//! it. Drops never panic: a failing free (only possible after a sticky device error,
//! when the context is lost anyway) is ignored.

mod context;
mod kernels;
mod kv;
mod memory;
mod module;
mod step;
mod stream;
mod tier;

pub use context::{Context, DeviceInfo};
pub use kernels::{Kernels, KernelsError};
pub use kv::{DeviceKv, DeviceKvConfig, DeviceKvError, DeviceSlice, SeqSpan};
pub use memory::{DeviceMemory, PinnedMemory};
pub use module::{DeviceCopy, Function, Module};
pub use step::{StepBuffers, StepError, MAX_UPLOAD_COPIES, MERGE_GAP_BYTES};
pub use stream::{Event, Stream, StreamRef};
pub use tier::{Direction, HostTier, SwapError};
