//! CUDA backend for kvpage.
//!
//! - [`driver`]: the driver entry points kvpage calls, declared here with plain integer
//!   results and loaded at run time (feature `cuda`), so every error is typed and a
//!   program built with the feature starts on a machine without a driver. Its result
//!   codes and errors are plain Rust, available without the feature.
//! - `device` (feature `cuda`): context, device and pinned memory, streams, events, the
//!   kernels' module.
//! - [`fatbin`]: the kernels compiled by `nvcc` at build time, when it was found.
//!
//! Without the `cuda` feature the crate needs no CUDA install and no driver.

#[cfg(feature = "cuda")]
pub mod device;
pub mod driver;
pub mod fatbin;
pub mod sizing;
pub mod swap;
pub mod upload;

pub use kvpage_core as core;
