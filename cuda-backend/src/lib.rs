//! CUDA backend for kvpage.
//!
//! - The kernels (`kernels/*.cu`, CUDA C++), their ABI ([`params`]) and launch planning
//!   ([`launch`]). The kernel source compiles with `nvcc` for the GPU and, with the
//!   `emulation` feature, as host C++ against an emulation of the CUDA execution model
//!   (`emulation`), so the same kernels are checked against the CPU backend on machines
//!   without a GPU.
//! - [`driver`]: the driver entry points kvpage calls, declared here with plain integer
//!   results and loaded at run time (feature `cuda`), so every error is typed and a
//!   program built with the feature starts on a machine without a driver. Its result
//!   codes and errors are plain Rust, available without the feature.
//! - `device` (feature `cuda`): context, device and pinned memory, streams, events, the
//!   kernels' module, step buffers, host tier.
//! - [`fatbin`]: the kernels compiled by `nvcc` at build time, when it was found.
//! - [`sizing`], [`upload`], [`swap`]: host-side planning (arena size, metadata layout,
//!   upload ranges, swap runs), plain Rust.
//!
//! Without the `cuda` feature the crate needs no CUDA install and no driver.
//!
//! The `cuda` and `emulation` features need a 64-bit host, as CUDA does: the parameter
//! blocks ([`params`]) hold 64-bit device addresses at 8-byte alignment, which a 32-bit
//! host lays out otherwise (on i686, `u64` aligns to 4).

#![warn(missing_docs)]

#[cfg(all(
    any(feature = "cuda", feature = "emulation"),
    not(target_pointer_width = "64")
))]
compile_error!(
    "kvpage-cuda's `cuda` and `emulation` features need a 64-bit host, as CUDA does: the \
     kernels' parameter blocks hold 64-bit device addresses at 8-byte alignment"
);

pub use kvpage_core as core;

#[cfg(feature = "cuda")]
pub mod device;
pub mod driver;
#[cfg(feature = "emulation")]
pub mod emulation;
pub mod fatbin;
pub mod launch;
pub mod params;
pub mod sizing;
pub mod swap;
pub mod upload;
