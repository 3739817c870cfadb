//! CUDA backend for kvpage.
//!
//! Not built yet: this crate only re-exports the core so that the workspace layout of the
//! design document is in place. The device arena, the kernels and the `cuda` feature come
//! with their own issue.

#![no_std]

pub use kvpage_core as core;
