//! The engine property test (see `engine_block_size_4.rs`) at an odd block size.
//!
//! Not run under Miri: the core has no `unsafe` code, and Miri interprets the same
//! model code in `model.rs` / `engine_block_size_4.rs`; only the parameters differ here.
#![cfg(not(miri))]

const BLOCK_SIZE: u32 = 3;
mod common;
include!("engine/body.rs");
