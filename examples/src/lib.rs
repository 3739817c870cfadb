//! Shared pieces of the kvpage examples: trace parsing, model and device presets, the
//! roofline step model, a first-fit byte allocator (the contiguous baseline), the
//! continuous-batching replay engine and its reports.

pub mod first_fit;
pub mod presets;
pub mod rng;
pub mod step_model;
pub mod trace;
