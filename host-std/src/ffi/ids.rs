//! Sequence and request ids as C sees them: plain `uint64_t`s, validated by the library.
//!
//! A sequence id packs the row (low 32 bits) and the row's generation (high 32 bits),
//! the generation mixed with a salt derived from the issuing cache's or manager's
//! instance tag, so an id of another cache almost always reads as stale there instead of
//! naming one of its sequences. A request id packs slot and generation the same way.
//! Every operation checks the generation: a stale, forged or never-issued id is an error
//! code, never another sequence's data. No issued id equals [`KVPAGE_SEQ_NONE`] or
//! [`KVPAGE_REQUEST_NONE`] (rows and slots are below `u32::MAX`).

use kvpage_core::{RequestId, SeqId};

/// A sequence id (see `kvpage_seq_*` / `kvpage_manager_*` functions).
#[allow(non_camel_case_types)]
pub type kvpage_seq = u64;

/// A request id of an engine or scheduler.
#[allow(non_camel_case_types)]
pub type kvpage_request = u64;

/// An id no sequence ever has, for "no sequence" in the caller's own tables.
pub const KVPAGE_SEQ_NONE: kvpage_seq = u64::MAX;

/// An id no request ever has.
pub const KVPAGE_REQUEST_NONE: kvpage_request = u64::MAX;

fn salt(instance: u32) -> u32 {
    // An odd multiplier spreads consecutive instance tags over all 32 bits.
    instance.wrapping_mul(0x9E37_79B9)
}

/// The C id of a sequence.
pub(crate) fn seq_to_c(id: SeqId) -> kvpage_seq {
    (u64::from(id.generation() ^ salt(id.instance())) << 32) | u64::from(id.index())
}

/// The handle a C id names in the cache or manager whose instance tag is `instance`.
pub(crate) fn seq_from_c(id: kvpage_seq, instance: u32) -> SeqId {
    let generation = (id >> 32) as u32 ^ salt(instance);
    SeqId::from_parts(id as u32, generation, instance)
}

/// The C id of a request.
pub(crate) fn request_to_c(id: RequestId) -> kvpage_request {
    (u64::from(id.generation()) << 32) | u64::from(id.index())
}

/// The handle a C request id names.
pub(crate) fn request_from_c(id: kvpage_request) -> RequestId {
    RequestId::from_parts(id as u32, (id >> 32) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_another_instance_reads_another_generation() {
        let s = SeqId::from_parts(7, 3, 11);
        assert_eq!(seq_from_c(seq_to_c(s), 11), s);
        assert_ne!(seq_from_c(seq_to_c(s), 12).generation(), 3);
        assert_ne!(
            seq_to_c(SeqId::from_parts(u32::MAX - 1, u32::MAX, 5)),
            KVPAGE_SEQ_NONE
        );
        let r = RequestId::from_parts(5, 9);
        assert_eq!(request_from_c(request_to_c(r)), r);
    }
}
