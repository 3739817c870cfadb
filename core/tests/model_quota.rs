//! Property test with namespace quotas: the reference model of `model.rs` over a manager
//! with a namespace table of two, so quota operations succeed and every allocation runs
//! under a hold limit and the reservations of other namespaces.

const BLOCK_SIZE: u32 = 4;
const PREFIX_CACHE: bool = true;
const MAX_NAMESPACES: u32 = 2;
mod common;
include!("model/body.rs");
