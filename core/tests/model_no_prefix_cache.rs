//! Property test (no prefix cache): random operation sequences against a reference model in std collections.
//!
//! The model keeps, for every live sequence, the value each of its tokens must read back
//! (token id and position), and a simulated KV arena that receives exactly the writes and
//! copy-on-write copies the manager tells a backend to do. After every step each live
//! sequence must read back its own tokens through its block table: a block handed to two
//! sequences that do not share content, a missed copy, or a wrong prefix hit all break
//! that. Failed operations must leave every observable part of the state unchanged.
//!
//! Not run under Miri: the core has no `unsafe` code, and Miri interprets the same
//! model code in `model.rs` / `engine_block_size_4.rs`; only the parameters differ here.
#![cfg(not(miri))]

const BLOCK_SIZE: u32 = 4;
const PREFIX_CACHE: bool = false;
const MAX_NAMESPACES: u32 = 0;
mod common;
include!("model/body.rs");
