//! The engine property test (see `engine_block_size_4.rs`) at an odd block size.

const BLOCK_SIZE: u32 = 3;
mod common;
include!("engine/body.rs");
