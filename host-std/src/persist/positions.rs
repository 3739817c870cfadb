//! The position runs of a saved sequence.
//!
//! TODO(edits): a stand-in until the core stores each sequence's runs
//! (`BlockManager::position_runs` / `set_position_runs`, shared interface of issue 12).
//! Today token `i` of every sequence is at position `i`: one run `{0, 0}`, which is what
//! a save writes and all that a restore accepts ([`PersistError::PositionsUnsupported`]
//! otherwise). Once the core has runs, a save writes `position_runs(seq)` and a restore
//! checks the blob's runs with the core's rules before it allocates, then sets them.

use super::error::PersistError;
use super::format::u32s;

/// One run: token `first_index + k` is at position `first_position + k`, up to the next
/// run. (The core's `PositionRun` of the shared interface, once it lands.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PositionRun {
    /// First token index of the run.
    pub(crate) first_index: u32,
    /// Position of that token.
    pub(crate) first_position: u32,
}

/// The runs of every sequence today: token `i` at position `i`.
pub(crate) const IDENTITY: [PositionRun; 1] = [PositionRun {
    first_index: 0,
    first_position: 0,
}];

/// The words of `runs` in the blob's order: first index, first position, per run.
pub(crate) fn words(runs: &[PositionRun]) -> impl Iterator<Item = u32> + '_ {
    runs.iter().flat_map(|r| [r.first_index, r.first_position])
}

/// Checks that a blob's position-run payload (framing and CRC verified) is one this
/// build can restore: the identity. O(runs).
///
/// # Errors
/// [`PersistError::PositionsUnsupported`].
pub(crate) fn check_restorable(payload: &[u8]) -> Result<(), PersistError> {
    let identity = words(&IDENTITY);
    if u32s(payload).eq(identity) {
        Ok(())
    } else {
        Err(PersistError::PositionsUnsupported)
    }
}
