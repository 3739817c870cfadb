//! The position runs of a saved sequence: what a save writes (the core's
//! [`BlockManager::position_runs`](kvpage_core::BlockManager::position_runs)) and how a
//! restore reads them back and checks them, with the core's rules
//! ([`PositionRun::validate`]), before it allocates anything.

use kvpage_core::{PositionRun, SeqError, MAX_POSITION_RUNS};

use super::format::u32s;

/// The words of `runs` in the blob's order: first index, first position, per run.
pub(crate) fn words(runs: &[PositionRun]) -> impl Iterator<Item = u32> + '_ {
    runs.iter().flat_map(|r| [r.first_index, r.first_position])
}

/// A blob's runs decoded on the stack (no allocation), checked for a sequence of `len`
/// tokens in a cache holding `capacity` runs per sequence.
pub(crate) struct BlobRuns {
    runs: [PositionRun; MAX_POSITION_RUNS as usize],
    n: usize,
}

impl BlobRuns {
    /// Decodes `payload` (the positions section, framing and CRC verified: two
    /// little-endian `u32` per run) and checks the runs with [`PositionRun::validate`].
    /// O(runs).
    ///
    /// # Errors
    /// [`SeqError::TooManyPositionRuns`] for more runs than `capacity`;
    /// [`SeqError::BadPositions`] for runs the core would refuse.
    pub(crate) fn decode(payload: &[u8], len: u32, capacity: u32) -> Result<Self, SeqError> {
        let count = payload.len() / 8;
        let capacity = capacity.min(MAX_POSITION_RUNS);
        if count > capacity as usize {
            return Err(SeqError::TooManyPositionRuns {
                needed: u32::try_from(count).unwrap_or(u32::MAX),
                capacity,
            });
        }
        let mut runs = [PositionRun::default(); MAX_POSITION_RUNS as usize];
        let mut words = u32s(payload);
        for r in &mut runs[..count] {
            r.first_index = words.next().unwrap_or(0);
            r.first_position = words.next().unwrap_or(0);
        }
        PositionRun::validate(&runs[..count], len, capacity)?;
        Ok(Self { runs, n: count })
    }

    /// The runs, validated. O(1).
    pub(crate) fn as_slice(&self) -> &[PositionRun] {
        &self.runs[..self.n]
    }
}
