//! Sequence edits and positions on the owned cache: the core's edits
//! ([`BlockManager::remove_range`] and the rest), with the block copies and row moves they
//! report executed on the arena before the call returns, so the caller cannot forget or
//! reorder them.
//!
//! Pending ranges follow the tokens: a token that could be written before an edit can be
//! written after it at its new index (its block is still held by this sequence alone, or
//! was copied for it), and nothing else becomes writable.

use kvpage_core::{BlockManager, ContextShift, Edited, PositionRun, SeqError};

use super::{CacheError, KvCache, Seq};
use crate::error::KernelError;
use crate::kernels::RopeParams;

/// Where pending start `pending` lands after tokens `first..end` are removed.
fn pending_after_removal(pending: u32, first: u32, end: u32) -> u32 {
    match pending {
        p if p <= first => p,
        p if p <= end => first,
        p => p - (end - first),
    }
}

impl KvCache {
    /// Executes what an edit reported, from the cache's edit buffers: the block copies,
    /// then the row moves in order. The core's ids are in range and its moves stay within
    /// blocks, so this cannot fail on the CPU; on a device only a driver error can
    /// ([`CacheError::Device`]: the device cache is then unusable).
    fn execute_edit(&mut self, edited: Edited) -> Result<(), CacheError> {
        let (layout, copies, moves) = (
            &self.layout,
            &self.edit_copies[..edited.copies as usize],
            &self.edit_moves[..edited.moves as usize],
        );
        let done = self
            .storage
            .copy_blocks(layout, copies)
            .and_then(|()| self.storage.move_rows(layout, moves));
        debug_assert!(
            !matches!(done, Err(CacheError::Kernel(_))),
            "core reported an invalid edit: {done:?}"
        );
        done
    }

    /// Runs a core edit on `seq` with the cache's copy and move buffers, executes what it
    /// reports, and moves the pending range of `seq` past the removed tokens
    /// `first..end`.
    fn edit_with<R>(
        &mut self,
        seq: Seq,
        (first, end): (u32, u32),
        edit: impl FnOnce(
            &mut BlockManager<'static>,
            &mut [kvpage_core::BlockCopy],
            &mut [kvpage_core::RowMove],
        ) -> Result<R, SeqError>,
        edited: impl Fn(&R) -> Edited,
    ) -> Result<R, CacheError> {
        let (copies, moves) = (&mut self.edit_copies, &mut self.edit_moves);
        let done = Self::with_manager(&mut self.tables, |m| edit(m, copies, moves))?;
        self.execute_edit(edited(&done))?;
        let p = &mut self.pending[seq.0.index() as usize];
        *p = pending_after_removal(*p, first, end);
        Ok(done)
    }

    /// Removes tokens `first..end` of `seq` and moves the later ones down, executing the
    /// copies and row moves the core reports ([`BlockManager::remove_range`]: a
    /// block-aligned removal copies nothing). The moved tokens keep their positions.
    /// O(blocks of `seq` + moved rows × layers × kv_heads × head_dim).
    ///
    /// # Errors
    /// The core's ([`SeqError::StaleHandle`], [`SeqError::ForeignHandle`],
    /// [`SeqError::BadRange`], [`SeqError::OutOfBlocks`],
    /// [`SeqError::TooManyPositionRuns`]). Nothing changes on error.
    pub fn remove_range(&mut self, seq: Seq, first: u32, end: u32) -> Result<Edited, CacheError> {
        self.edit_with(
            seq,
            (first, end),
            |m, c, mv| m.remove_range(seq.0, first, end, c, mv),
            |e| *e,
        )
    }

    /// Context shift ([`BlockManager::context_shift`]): keeps the first `n_keep` tokens,
    /// drops the next `n_discard`, moves the rest down and lowers their positions by
    /// `n_discard`, executing the copies and moves. The keys of tokens
    /// `rotate_first..rotate_end` of the result are still rotated at their old positions:
    /// rotate them by `delta` (their blocks are this sequence's alone), or call
    /// [`KvCache::context_shift_rotated`], which does both. O(blocks of `seq` + moved rows
    /// × layers × kv_heads × head_dim).
    ///
    /// # Errors
    /// As [`KvCache::remove_range`]. Nothing changes on error.
    pub fn context_shift(
        &mut self,
        seq: Seq,
        n_keep: u32,
        n_discard: u32,
    ) -> Result<ContextShift, CacheError> {
        self.edit_with(
            seq,
            (n_keep, n_keep.saturating_add(n_discard)),
            |m, c, mv| m.context_shift(seq.0, n_keep, n_discard, c, mv),
            |s| s.edited,
        )
    }

    /// [`KvCache::context_shift`], then the moved keys re-rotated to their new positions
    /// under the rotary embedding `rope` ([`KvCache::rotate_keys`] of
    /// `rotate_first..rotate_end` by `delta`): afterwards the sequence reads as if its
    /// keys had been computed at their new positions, without recomputing any token. The
    /// returned range says which keys were rotated (nothing is left to do). One call
    /// from the caller's view: `rope` is checked against the head dim before anything
    /// changes, and the rotation cannot fail after a shift that succeeded (the moved
    /// blocks are this sequence's alone and registered nowhere). O(blocks of `seq` +
    /// moved rows × layers × kv_heads × head_dim + rotated tokens × layers × kv_heads ×
    /// rotary_dims).
    ///
    /// # Errors
    /// [`crate::KernelError::Rope`] for parameters that do not fit
    /// the head dim; otherwise as [`KvCache::context_shift`]. Nothing changes on error.
    pub fn context_shift_rotated(
        &mut self,
        seq: Seq,
        n_keep: u32,
        n_discard: u32,
        rope: RopeParams,
    ) -> Result<ContextShift, CacheError> {
        rope.check(self.layout.geometry().head_dim())
            .map_err(KernelError::Rope)?;
        let shift = self.context_shift(seq, n_keep, n_discard)?;
        // Cannot fail: the core made the moved blocks this sequence's alone. Were that
        // invariant ever broken, the error is returned (the shift stands, the keys are
        // not rotated) rather than hidden.
        self.rotate_keys(
            seq,
            shift.rotate_first,
            shift.rotate_end,
            i64::from(shift.delta),
            rope,
        )?;
        Ok(shift)
    }

    /// Adds `delta` to the positions of tokens `first..end` of `seq` (llama's `seq_add`;
    /// [`BlockManager::shift_positions`]). Only positions change: re-rotate the keys
    /// after [`KvCache::make_exclusive`]. O(runs).
    ///
    /// # Errors
    /// The core's ([`SeqError::BadRange`], [`SeqError::BadPositions`],
    /// [`SeqError::TooManyPositionRuns`], handle errors). Nothing changes on error.
    pub fn shift_positions(
        &mut self,
        seq: Seq,
        first: u32,
        end: u32,
        delta: i32,
    ) -> Result<(), CacheError> {
        Ok(Self::with_manager(&mut self.tables, |m| {
            m.shift_positions(seq.0, first, end, delta)
        })?)
    }

    /// Makes the blocks holding tokens `first..end` of `seq` its own
    /// ([`BlockManager::make_exclusive`]), executing the copies; returns how many blocks
    /// were copied. O(blocks in the range × block bytes).
    ///
    /// # Errors
    /// The core's ([`SeqError::BadRange`], [`SeqError::OutOfBlocks`], handle errors).
    /// Nothing changes on error.
    pub fn make_exclusive(&mut self, seq: Seq, first: u32, end: u32) -> Result<u32, CacheError> {
        self.edit_with(
            seq,
            (first, first),
            |m, c, _| m.make_exclusive(seq.0, first, end, c),
            |&n| Edited {
                copies: n,
                ..Edited::default()
            },
        )
    }

    /// Creates a sequence in `namespace` holding tokens `first..end` of `seq` at their
    /// positions ([`BlockManager::copy_range`]: shares blocks when `first` is on a block
    /// boundary, else copies the rows into new blocks, here). Both sequences' pending
    /// ranges close, as after a fork. O(blocks of the range, + rows copied).
    ///
    /// # Errors
    /// The core's ([`SeqError::BadRange`], [`SeqError::NoFreeSequence`],
    /// [`SeqError::OutOfBlocks`], handle errors). Nothing changes on error.
    pub fn copy_range(
        &mut self,
        seq: Seq,
        first: u32,
        end: u32,
        namespace: u64,
    ) -> Result<Seq, CacheError> {
        let moves = &mut self.edit_moves;
        let (copied, len) = Self::with_manager(&mut self.tables, |m| {
            let copied = m.copy_range(seq.0, first, end, namespace, moves)?;
            m.len(seq.0).map(|len| (copied, len))
        })?;
        self.execute_edit(copied.edited)?;
        self.pending[seq.0.index() as usize] = len;
        self.pending[copied.seq.index() as usize] = end - first;
        Ok(Seq(copied.seq))
    }

    /// Releases every sequence of `others` except `keep` (llama's `seq_keep` over a set;
    /// [`BlockManager::release_all_except`]: `others` is walked twice, to check and to
    /// release); returns how many were released. O(others + their blocks).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`] for any handle. Nothing
    /// changes on error.
    pub fn release_all_except(
        &mut self,
        keep: Seq,
        others: impl Iterator<Item = Seq> + Clone,
    ) -> Result<u32, CacheError> {
        Ok(Self::with_manager(&mut self.tables, |m| {
            m.release_all_except(keep.0, others.map(|s| s.0))
        })?)
    }

    /// The positions of `seq` as runs ([`BlockManager::position_runs`]). O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`].
    pub fn position_runs(&self, seq: Seq) -> Result<&[PositionRun], CacheError> {
        Ok(self.manager().position_runs(seq.0)?)
    }

    /// Replaces the positions of `seq` ([`BlockManager::set_position_runs`]). O(runs).
    ///
    /// # Errors
    /// The core's ([`SeqError::BadPositions`], [`SeqError::TooManyPositionRuns`], handle
    /// errors). Nothing changes on error.
    pub fn set_position_runs(&mut self, seq: Seq, runs: &[PositionRun]) -> Result<(), CacheError> {
        Ok(Self::with_manager(&mut self.tables, |m| {
            m.set_position_runs(seq.0, runs)
        })?)
    }

    /// Position of token `index` of `seq` ([`BlockManager::position`]). O(runs).
    ///
    /// # Errors
    /// [`SeqError::BadRange`] past the length, handle errors.
    pub fn position(&self, seq: Seq, index: u32) -> Result<u32, CacheError> {
        Ok(self.manager().position(seq.0, index)?)
    }

    /// First and last position of `seq`, `None` when it is empty (llama's
    /// `seq_pos_min` / `seq_pos_max`). O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`].
    pub fn pos_range(&self, seq: Seq) -> Result<Option<(u32, u32)>, CacheError> {
        let m = self.manager();
        Ok(m.pos_min(seq.0)?.zip(m.pos_max(seq.0)?))
    }
}

#[cfg(test)]
mod tests {
    use super::pending_after_removal;

    #[test]
    fn pending_follows_the_tokens() {
        assert_eq!(pending_after_removal(3, 4, 8), 3);
        assert_eq!(pending_after_removal(6, 4, 8), 4);
        assert_eq!(pending_after_removal(10, 4, 8), 6);
    }
}
