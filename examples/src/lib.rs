//! Shared pieces of the kvpage examples: trace parsing, model and device presets, the
//! roofline step model, a first-fit byte allocator (the contiguous baseline), the
//! continuous-batching replay engine and its reports.

pub mod contiguous;
pub mod first_fit;
pub mod incident;
pub mod metrics;
pub mod paged;
pub mod presets;
pub mod replay;
pub mod rng;
pub mod sim;
#[cfg(test)]
mod sim_tests;
pub mod step_model;
pub mod svg;
pub mod trace;
