//! Token positions: what rotary embedding a token's key was (or will be) computed at.
//!
//! A fresh sequence gives token `i` position `i`. Edits ([`super::edit`]) can leave gaps
//! or shift a range, so each sequence stores its positions as a short list of
//! [`PositionRun`]s in its row of the sequence table. Invariants of a stored list:
//! the first run starts at token 0; run starts are strictly increasing and below the
//! length (only the first run may start at the length, of an empty sequence); positions
//! are strictly increasing in token order and the last token's position fits a `u32`;
//! no run continues its predecessor (`first_position - first_index` differs between
//! neighbours), so the list is the shortest one; at most
//! [`crate::Config::max_position_runs`] runs.
//!
//! Edits build their new list in a [`RunEdit`] on the stack, check it, and only then
//! store it, so an edit whose positions would break an invariant changes nothing.

use super::{BlockManager, SeqId};
use crate::config::MAX_POSITION_RUNS;
use crate::error::SeqError;

/// Tokens `first_index..` (up to the next run) of a sequence have positions
/// `first_position..`, one apart: token `i` of the run is at `first_position + (i -
/// first_index)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(C)]
pub struct PositionRun {
    /// Token index where the run starts.
    pub first_index: u32,
    /// Position of that token.
    pub first_position: u32,
}

impl PositionRun {
    /// Checks `runs` as the positions of a sequence of `len` tokens holding at most
    /// `capacity` runs, with the rules of [`BlockManager::set_position_runs`] (which
    /// cannot fail on a handle it accepts once this passed for its length and the cache's
    /// [`crate::Config::max_position_runs`]). Pure: for a caller to check runs, e.g. of a
    /// saved sequence, before it changes anything. O(runs).
    ///
    /// # Errors
    /// [`SeqError::BadPositions`] unless the first run starts at token 0, run starts are
    /// strictly increasing and below `len` (the only run of an empty sequence starts at
    /// 0), positions strictly increase and the last fits a `u32`;
    /// [`SeqError::TooManyPositionRuns`] for more than `capacity` runs (after merging runs
    /// that continue their predecessor).
    pub fn validate(runs: &[PositionRun], len: u32, capacity: u32) -> Result<(), SeqError> {
        RunEdit::from_runs(runs, len, capacity).map(|_| ())
    }
}

/// Position of token `i` under the stored runs `runs` (non-empty): the last run starting
/// at or before `i` continues up to it. May exceed `u32` for `i` past the last token.
/// O(runs).
pub(crate) fn position_in(runs: &[PositionRun], i: u32) -> i64 {
    let run = runs
        .iter()
        .rev()
        .find(|r| r.first_index <= i)
        .copied()
        .unwrap_or_default();
    i64::from(run.first_position) + i64::from(i - run.first_index)
}

/// A list of runs under construction: pushes in increasing token order, positions as
/// `i64` so that an edit can overshoot and be refused instead of wrapping.
pub(crate) struct RunEdit {
    runs: [(u32, i64); MAX_POSITION_RUNS as usize + 2],
    n: usize,
    /// More runs were pushed than fit (then the edit is refused).
    overflowed: bool,
}

impl RunEdit {
    /// An empty list.
    pub(crate) fn new() -> Self {
        Self {
            runs: [(0, 0); MAX_POSITION_RUNS as usize + 2],
            n: 0,
            overflowed: false,
        }
    }

    /// Token `index` (not below the last pushed one) starts a run at `position`: a push at
    /// the index of the last run replaces it, a push continuing the last run is dropped.
    /// O(1).
    pub(crate) fn push(&mut self, index: u32, position: i64) {
        if let Some(last) = self.n.checked_sub(1).map(|k| self.runs[k]) {
            if last.0 == index {
                self.n -= 1;
                // The run before may now continue into this one.
                return self.push(index, position);
            }
            if last.1 - i64::from(last.0) == position - i64::from(index) {
                return;
            }
        }
        match self.runs.get_mut(self.n) {
            Some(slot) => {
                *slot = (index, position);
                self.n += 1;
            }
            None => self.overflowed = true,
        }
    }

    /// Pushes the runs of `runs` that start in `from..to`, their indices moved by
    /// `-index_shift` and their positions by `delta`. O(runs).
    pub(crate) fn push_runs(
        &mut self,
        runs: &[PositionRun],
        from: u32,
        to: u32,
        index_shift: u32,
        delta: i64,
    ) {
        for r in runs.iter().filter(|r| (from..to).contains(&r.first_index)) {
            self.push(
                r.first_index - index_shift,
                i64::from(r.first_position) + delta,
            );
        }
    }

    /// The list of `runs` as given by a caller (run starts must strictly increase),
    /// [`RunEdit::check`]ed for `len` tokens and `capacity` runs. O(runs).
    ///
    /// # Errors
    /// As [`PositionRun::validate`].
    fn from_runs(runs: &[PositionRun], len: u32, capacity: u32) -> Result<Self, SeqError> {
        let mut edit = RunEdit::new();
        let mut previous = None;
        for r in runs {
            if previous.is_some_and(|p| r.first_index <= p) {
                return Err(SeqError::BadPositions);
            }
            previous = Some(r.first_index);
            edit.push(r.first_index, i64::from(r.first_position));
        }
        edit.check(len, capacity)?;
        Ok(edit)
    }

    /// Checks the list against the invariants in the module docs for a sequence of `len`
    /// tokens holding at most `capacity` runs. O(runs).
    ///
    /// # Errors
    /// [`SeqError::BadPositions`], [`SeqError::TooManyPositionRuns`].
    pub(crate) fn check(&self, len: u32, capacity: u32) -> Result<(), SeqError> {
        let runs = &self.runs[..self.n];
        if self.overflowed || runs.len() > capacity as usize {
            return Err(SeqError::TooManyPositionRuns {
                needed: (self.n + usize::from(self.overflowed)) as u32,
                capacity,
            });
        }
        match runs.first() {
            Some(&(0, p)) if p >= 0 => {}
            _ => return Err(SeqError::BadPositions),
        }
        for (k, &(index, position)) in runs.iter().enumerate() {
            let end = runs.get(k + 1).map_or(len, |r| r.0);
            if index >= end && !(k == 0 && len == 0) {
                return Err(SeqError::BadPositions);
            }
            // Last position of this run, which must stay below the next run's first.
            let last = position + i64::from(end.max(index + 1) - index) - 1;
            let limit = runs.get(k + 1).map_or(i64::from(u32::MAX) + 1, |r| r.1);
            if last >= limit {
                return Err(SeqError::BadPositions);
            }
        }
        Ok(())
    }

    /// Writes the list, [`RunEdit::check`]ed, to `out`; returns the number of runs.
    fn write(&self, out: &mut [PositionRun]) -> u32 {
        for (slot, &(index, position)) in out.iter_mut().zip(&self.runs[..self.n]) {
            *slot = PositionRun {
                first_index: index,
                first_position: position as u32,
            };
        }
        self.n as u32
    }
}

impl BlockManager<'_> {
    /// The positions of `seq` as runs (see [`PositionRun`]): one run `{0, 0}` until an
    /// edit makes positions differ from token indices. An empty sequence has one run,
    /// whose position is the one its next token gets. O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`].
    pub fn position_runs(&self, seq: SeqId) -> Result<&[PositionRun], SeqError> {
        Ok(self.seqs.runs(self.seqs.check(seq)?))
    }

    /// Position of token `index` of `seq`. O(runs).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`],
    /// [`SeqError::BadRange`] when `index` is not below the length.
    pub fn position(&self, seq: SeqId, index: u32) -> Result<u32, SeqError> {
        let i = self.seqs.check(seq)?;
        let len = self.seqs.len[i];
        if index >= len {
            return Err(SeqError::BadRange {
                first: index,
                end: index.saturating_add(1),
                len,
            });
        }
        // Within the length, positions fit a `u32` (module invariant).
        Ok(position_in(self.seqs.runs(i), index) as u32)
    }

    /// Position of the first token of `seq`; `None` when it is empty (llama's
    /// `seq_pos_min`, which says -1). O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`].
    pub fn pos_min(&self, seq: SeqId) -> Result<Option<u32>, SeqError> {
        let i = self.seqs.check(seq)?;
        Ok((self.seqs.len[i] > 0).then(|| self.seqs.runs(i)[0].first_position))
    }

    /// Position of the last token of `seq`; `None` when it is empty (llama's
    /// `seq_pos_max`, which says -1). O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`].
    pub fn pos_max(&self, seq: SeqId) -> Result<Option<u32>, SeqError> {
        let i = self.seqs.check(seq)?;
        let len = self.seqs.len[i];
        let runs = self.seqs.runs(i);
        Ok(len
            .checked_sub(1)
            .map(|last| position_in(&runs[runs.len() - 1..], last) as u32))
    }

    /// Replaces the positions of `seq` by `runs` (for example when restoring a saved
    /// sequence). The runs are stored in their shortest form (a run continuing its
    /// predecessor is merged into it), so [`BlockManager::position_runs`] may read back
    /// fewer. Tokens from the first whose position differs from its index on are no
    /// longer offered to the prefix cache (their keys were rotated elsewhere). Keys are
    /// not touched: the caller has them at these positions. O(runs).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`];
    /// [`SeqError::BadPositions`] unless the first run starts at token 0, run starts are
    /// strictly increasing and below the length (the only run of an empty sequence starts
    /// at 0), positions strictly increase and the last fits a `u32`;
    /// [`SeqError::TooManyPositionRuns`]. Nothing changes on error.
    pub fn set_position_runs(&mut self, seq: SeqId, runs: &[PositionRun]) -> Result<(), SeqError> {
        let i = self.seqs.check(seq)?;
        let edit = RunEdit::from_runs(runs, self.seqs.len[i], self.config.max_position_runs)?;
        self.store_runs(i, &edit);
        Ok(())
    }

    /// Stores `edit`, [`RunEdit::check`]ed for the current length of sequence `i`; tokens
    /// from the first whose position is not its index on leave the prefix cache's reach.
    pub(super) fn store_runs(&mut self, i: usize, edit: &RunEdit) {
        let len = self.seqs.len[i];
        let n = edit.write(self.seqs.runs_storage(i));
        self.seqs.set_run_count(i, n);
        let runs = self.seqs.runs(i);
        let index_based = match runs {
            [r, ..] if r.first_position != 0 => 0,
            [_, next, ..] => next.first_index,
            _ => len,
        };
        self.limit_known(i, index_based);
    }

    /// Keeps the known-id prefix of sequence `i` (and so what it commits to the prefix
    /// cache) within its first `tokens` tokens: after an edit, later tokens sit at other
    /// positions or indices than a prompt with the same ids would give them.
    pub(super) fn limit_known(&mut self, i: usize, tokens: u32) {
        let known = self.seqs.known[i].min(tokens);
        self.seqs.known[i] = known;
        let (full, _) = self.split(known);
        if self.seqs.committed[i] > full {
            self.rewind_commit(i, full as usize);
        }
    }

    /// Whether `n` more tokens appended to sequence `i` still have positions that fit a
    /// `u32`. O(1).
    #[inline]
    pub(super) fn positions_fit(&self, i: usize, n: u32) -> bool {
        let runs = self.seqs.runs(i);
        let last = runs[runs.len() - 1];
        // One past the position of the last new token: the last run continued.
        u64::from(last.first_position) + u64::from(self.seqs.len[i]) + u64::from(n)
            - u64::from(last.first_index)
            <= u64::from(u32::MAX) + 1
    }
}
