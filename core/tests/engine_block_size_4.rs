//! Property test: the engine step over a live `BlockManager` on random workloads
//! (prefix sharing in two namespaces, forks, cancels, tight memory, swap space on and
//! off). Every planned action must execute, every request must finish exactly once, and
//! a simulated arena that receives exactly the copies and writes the engine hands out
//! must read back every running request's own K/V through its block table.

const BLOCK_SIZE: u32 = 4;
mod common;
include!("engine/body.rs");
