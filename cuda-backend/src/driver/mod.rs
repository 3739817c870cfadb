//! The CUDA driver, called through our own declarations.
//!
//! `cust` 0.3.2 turns driver results into a Rust enum generated for CUDA 11.4: a newer
//! driver's code arriving there is undefined behaviour, many known codes collapse into
//! one, and its `Display` can panic. Here every entry point kvpage calls is declared
//! with a plain `i32` result ([`Code`]), loaded at run time from the driver library
//! (feature `cuda`, `Driver`), and every failure is a [`DriverError`] naming the call,
//! the raw code, and the code's name and message when the driver or CUDA 13's `cuda.h`
//! knows them.
//!
//! [`Code`] and [`DriverError`] are plain Rust and build without the feature.

mod code;
mod codes;
mod error;

#[cfg(feature = "cuda")]
mod api;

pub use code::{Code, KnownCode, TABLE_CUDA_VERSION};
pub use error::{CallError, DriverError};

#[cfg(feature = "cuda")]
pub use api::*;
