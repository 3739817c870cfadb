//! CUDA backend for kvpage: the kernels (`kernels/*.cu`, CUDA C++), their ABI
//! ([`params`]) and launch planning ([`launch`]).
//!
//! The kernel source compiles with `nvcc` for the GPU and, with the `emulation` feature,
//! as host C++ against an emulation of the CUDA execution model (module `emulation`), so the
//! same kernels are checked against the CPU backend on machines without a GPU.

pub use kvpage_core as core;

#[cfg(feature = "emulation")]
pub mod emulation;
pub mod launch;
pub mod params;
