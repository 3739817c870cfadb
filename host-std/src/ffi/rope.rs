//! The rotary position embedding of a model's keys, as C passes it to
//! `kvpage_cache_rotate_keys` (re-rotating stored keys after a context shift).

use crate::kernels::{RopePairing, RopeParams};

use super::result::Fail;

/// Pairing of the rotary dims: `(2j, 2j + 1)` (GPT-J; llama.cpp's
/// `LLAMA_ROPE_TYPE_NORM`).
pub const KVPAGE_ROPE_INTERLEAVED: u32 = 0;
/// Pairing of the rotary dims: `(j, j + rotary_dims / 2)` (GPT-NeoX, Hugging Face Llama;
/// llama.cpp's `LLAMA_ROPE_TYPE_NEOX`).
pub const KVPAGE_ROPE_HALF_SPLIT: u32 = 1;

/// The rotary embedding the model applies to its keys: pair `j` of the first
/// `rotary_dims` dims of a head turns by `position × base^(-2j / rotary_dims)`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
#[allow(non_camel_case_types)]
pub struct kvpage_rope_params {
    /// Frequency base (`rope_theta`), finite and above 1: 10000 for Llama 2, 500000
    /// for Llama 3.
    pub base: f32,
    /// Leading dims of each head that are rotated: even, non-zero, at most the head
    /// dim.
    pub rotary_dims: u32,
    /// `KVPAGE_ROPE_INTERLEAVED` or `KVPAGE_ROPE_HALF_SPLIT`.
    pub pairing: u32,
}

impl kvpage_rope_params {
    /// The Rust parameters; the pairing code checked here, the rest by the kernel
    /// against the head dim.
    pub(crate) fn to_rust(self) -> Result<RopeParams, Fail> {
        let pairing = match self.pairing {
            KVPAGE_ROPE_INTERLEAVED => RopePairing::Interleaved,
            KVPAGE_ROPE_HALF_SPLIT => RopePairing::HalfSplit,
            other => return Err(Fail::invalid("unknown rope pairing").with_value(u64::from(other))),
        };
        Ok(RopeParams {
            base: self.base,
            rotary_dims: self.rotary_dims,
            pairing,
        })
    }
}
