//! Shared pieces of the kvpage examples: trace parsing, model and device presets, the
//! roofline step model, the KV memory of each policy, the continuous-batching replay on
//! kvpage's engine and its reports; the tiny transformer and the script of `long_chat`.
#![forbid(unsafe_code)]

pub mod fleet;
pub mod incident;
pub mod long_chat;
pub mod memory;
pub mod metrics;
pub mod presets;
pub mod replay;
pub mod retention;
pub mod rng;
pub mod sim;
#[cfg(test)]
mod sim_tests;
pub mod step_model;
pub mod svg;
pub mod tiny_lm;
pub mod trace;
