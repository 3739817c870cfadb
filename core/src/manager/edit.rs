//! Sequence edits in the spirit of `llama.h`'s sequence memory: remove a token range
//! (`seq_rm`), shift positions (`seq_add`), copy a range into a new sequence (`seq_cp`),
//! keep one sequence of a set (`seq_keep`), and the context shift built from them.
//!
//! A sequence is a run of token rows read through its block table, so removing tokens
//! closes the hole: when the removed count is a multiple of the block size and the range
//! starts on a block boundary the edit only drops block-table entries; otherwise the
//! token rows after the hole move down, and the edit reports those moves ([`RowMove`])
//! for the backend, with the copy-on-write [`BlockCopy`]s of shared blocks that must be
//! written, exactly as an append reports its copy. Moved tokens keep their positions
//! (their keys were rotated there), so a removal leaves a gap in the positions
//! ([`super::positions`]).
//!
//! Every edit checks everything (handle, range, buffers, free blocks, positions) before
//! it changes anything, and allocates nothing. After an edit that moves rows down to
//! token `first`, the sequence commits nothing from `first` on again (those rows sit at
//! other indices or positions than a prompt with the same ids would give them), and of
//! its blocks from the one holding `first` on, those it holds alone leave the prefix
//! cache's registry: written ones because their content changes, the others because
//! they now follow blocks of another chain, so once released they would sit cached
//! after their chain's head and could outlive it unreachable. Blocks other sequences
//! hold too keep their registration: their content is unchanged and valid for their
//! chain, which those sequences hold in order (a system prompt shared by many
//! conversations stays hot when one of them edits). Removing the tail is a
//! [`BlockManager::truncate`] and keeps its rules.
//!
//! The backend executes what an edit reports in this order: the block copies, then the
//! row moves in order (each a `memmove`), then, after a context shift, the key rotation.
//! It does so before the next operation that allocates: the rows of blocks the edit
//! released are read by the moves.

use super::positions::{position_in, RunEdit};
use super::{BlockCopy, BlockManager, SeqId};
use crate::error::SeqError;

/// `count` token rows the backend moves, in every layer, for K and V and every KV head:
/// from slots `src_slot..src_slot + count` to slots `dst_slot..dst_slot + count` (slot =
/// `block * block_size + offset`, as in the slot mapping). Both ranges lie within one
/// block, so in the block-major layout a move is, per `(layer, k|v, kv_head)` tile, one
/// contiguous range of `count * head_dim` elements. A move may overwrite rows an earlier
/// move of the same edit read: execute them in order, each as a `memmove` (the ranges of
/// one move may overlap within a block).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(C)]
pub struct RowMove {
    /// First slot to read.
    pub src_slot: u32,
    /// First slot to write.
    pub dst_slot: u32,
    /// Rows to move (1 to `block_size`).
    pub count: u32,
}

/// What an edit wrote into the caller's buffers and did to the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Edited {
    /// Copy-on-write copies written to the front of the copy buffer: execute first.
    pub copies: u32,
    /// Row moves written to the front of the move buffer: execute next, in order.
    pub moves: u32,
    /// Blocks allocated (copy-on-write destinations, blocks of a copied range).
    pub new_blocks: u32,
    /// Block references the edit dropped (removed whole blocks, the tail a removal
    /// emptied).
    pub released_blocks: u32,
}

/// Result of [`BlockManager::copy_range`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct CopiedRange {
    /// The new sequence.
    pub seq: SeqId,
    /// Its row moves (no block copies: shared blocks are copied when written).
    pub edited: Edited,
}

/// Result of [`BlockManager::context_shift`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct ContextShift {
    /// Copies and moves to execute, as for [`BlockManager::remove_range`].
    pub edited: Edited,
    /// Tokens `rotate_first..rotate_end` (indices after the shift) hold keys rotated at
    /// their old positions: rotate them by `delta` after executing the copies and moves.
    /// Their blocks are held by this sequence alone and registered nowhere. Empty when
    /// nothing moved.
    pub rotate_first: u32,
    /// End (exclusive) of the tokens to rotate.
    pub rotate_end: u32,
    /// Position change of those tokens: `-n_discard`.
    pub delta: i32,
}

/// How removing tokens `first..end` of a sequence of `len` tokens changes its rows.
#[derive(Debug, Clone, Copy)]
struct Removal {
    first: u32,
    end: u32,
    len: u32,
    /// Old logical blocks `drop_from..drop_to` are released; later entries move down.
    drop_from: usize,
    drop_to: usize,
    /// Tokens `end..move_end` move down by `end - first` rows.
    move_end: u32,
    /// Instead, the rows before `first` in its block move up into the block holding
    /// `end`, at the same offsets (a removed count that is a multiple of the block size,
    /// when that block has fewer rows to carry).
    pull_head: bool,
}

impl Removal {
    fn removed(&self) -> u32 {
        self.end - self.first
    }
    fn new_len(&self) -> u32 {
        self.len - self.removed()
    }
    /// End of the new logical blocks that receive rows (from the one holding `first`).
    fn written_end(&self, bs: u32) -> usize {
        let fb = (self.first / bs) as usize;
        if self.pull_head {
            fb + 1
        } else if self.move_end > self.end {
            (self.first + (self.move_end - self.end)).div_ceil(bs) as usize
        } else {
            fb
        }
    }

    /// Old logical index of new logical block `k`.
    fn old_block(&self, k: usize) -> usize {
        if k < self.drop_from {
            k
        } else {
            k + (self.drop_to - self.drop_from)
        }
    }
}

impl BlockManager<'_> {
    /// Live, resident sequence `seq` and a check that `first..end` lies within it.
    pub(super) fn check_range(&self, seq: SeqId, first: u32, end: u32) -> Result<usize, SeqError> {
        let i = self.seqs.check(seq)?;
        let len = self.seqs.len[i];
        if first > end || end > len {
            return Err(SeqError::BadRange { first, end, len });
        }
        Ok(i)
    }

    /// Plans removing tokens `first..end` of sequence `i` (within the length, `first <
    /// end < len`).
    fn plan_removal(&self, i: usize, first: u32, end: u32, len: u32) -> Removal {
        let bs = self.config.block_size;
        let (fb, fo) = self.split(first);
        let (whole, rest) = self.split(end - first);
        let mut pull_head = false;
        let (drop_from, drop_to, move_end) = if rest == 0 {
            // Offsets are kept: whole blocks go, and only the block holding `first`
            // merges with the one holding `end`: either takes the other's rows, whichever
            // costs fewer (counting a copy of a shared block as a block of rows).
            let from = (fb + u32::from(fo != 0)) as usize;
            let move_end = if fo == 0 {
                end
            } else {
                len.min((end - fo).saturating_add(bs))
            };
            let row = self.seqs.row(i);
            let copy_cost = |k: usize| match self.pool.is_exclusive(self.seqs.table[row + k]) {
                true => 0,
                false => bs,
            };
            let (head, tail) = (fb as usize, (fb + whole) as usize);
            pull_head = fo != 0 && fo + copy_cost(tail) < (move_end - end) + copy_cost(head);
            match pull_head {
                true => (head, head + whole as usize, end),
                false => (from, from + whole as usize, move_end),
            }
        } else {
            let new_blocks = self.blocks_for(len - (end - first)) as usize;
            (new_blocks, self.blocks_for(len) as usize, len)
        };
        Removal {
            pull_head,
            first,
            end,
            len,
            drop_from,
            drop_to,
            move_end,
        }
    }

    /// Calls `emit(src_index, dst_index, count)` for the runs of rows `from..to` moving
    /// down by `down` rows, each within one block on both sides. O(rows / block_size).
    fn row_runs(&self, from: u32, to: u32, down: u32, mut emit: impl FnMut(u32, u32, u32)) {
        let bs = self.config.block_size;
        let mut j = from;
        while j < to {
            let (_, so) = self.split(j);
            let (_, d) = self.split(j - down);
            let count = (bs - so).min(bs - d).min(to - j);
            emit(j, j - down, count);
            j += count;
        }
    }

    /// Number of runs [`Self::row_runs`] emits.
    fn row_run_count(&self, from: u32, to: u32, down: u32) -> u32 {
        let mut n = 0;
        self.row_runs(from, to, down, |_, _, _| n += 1);
        n
    }

    /// Slot of token `index` of block-table row `row`.
    fn slot_in(&self, row: usize, index: u32) -> u32 {
        let (k, off) = self.split(index);
        self.seqs.table[row + k as usize] * self.config.block_size + off
    }

    /// Blocks among logical blocks `from..to` of sequence `i` that others hold too.
    fn shared_blocks(&self, i: usize, from: usize, to: usize) -> u32 {
        let row = self.seqs.row(i);
        self.seqs.table[row + from..row + to]
            .iter()
            .filter(|&&b| !self.pool.is_exclusive(b))
            .count() as u32
    }

    /// Makes logical blocks `from..to` of sequence `i` writable: a shared one is replaced
    /// by a copy (written to `copies`, which has room for [`Self::shared_blocks`]), an
    /// exclusive one leaves the prefix cache. Precondition: that many blocks available.
    /// Returns the copies written.
    fn own_blocks(&mut self, i: usize, from: usize, to: usize, copies: &mut [BlockCopy]) -> u32 {
        let row = self.seqs.row(i);
        let slot = self.slot(i);
        let mut n = 0;
        for k in from..to {
            let b = self.seqs.table[row + k];
            if self.pool.is_exclusive(b) {
                if self.prefix.is_registered(b) {
                    self.prefix.unregister(b);
                }
                self.prefix.clear(b);
            } else {
                let dst = self.pool.alloc(slot, &mut self.prefix);
                self.pool.set_fill(dst, self.pool.fill(b));
                self.pool.release(b, &mut self.prefix);
                self.seqs.table[row + k] = dst;
                copies[n] = BlockCopy { src: b, dst };
                n += 1;
            }
        }
        n as u32
    }

    /// Removes tokens `first_index..end_index` of `seq` and moves the later ones down
    /// (llama's `seq_rm`; `end_index` = the length removes the tail, like
    /// [`BlockManager::truncate`]). Moved tokens keep their positions, so a new position
    /// run starts at `first_index` (see [`BlockManager::position_runs`]).
    ///
    /// When `first_index` is on a block boundary and the count a multiple of the block
    /// size, whole blocks leave the block table and nothing is copied. Otherwise token
    /// rows move: when the count is a multiple of the block size, only the rows of one of
    /// the two edge blocks, into the other (the rows after `end_index` in its block, or
    /// those before `first_index` in its block, whichever is cheaper counting a shared
    /// block's copy as a block of rows); else every row after `end_index` (offsets within
    /// blocks change). Moves are written to
    /// `moves[..edited.moves]`; a shared block that receives rows is first copied
    /// (`copies[..edited.copies]`, one more block each). Execute copies, then moves, in
    /// order, before the next allocation (module docs). Blocks from the one holding
    /// `first_index` on leave the prefix cache's registry. O(blocks of `seq` + runs).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`],
    /// [`SeqError::BadRange`] unless `first_index <= end_index <= len`,
    /// [`SeqError::OutOfBlocks`] ([`SeqError::QuotaExceeded`] under a namespace quota) for the copies, [`SeqError::MoveBufferTooSmall`] when
    /// `copies` or `moves` is too short, [`SeqError::TooManyPositionRuns`]. Nothing
    /// changes on error.
    pub fn remove_range(
        &mut self,
        seq: SeqId,
        first_index: u32,
        end_index: u32,
        copies: &mut [BlockCopy],
        moves: &mut [RowMove],
    ) -> Result<Edited, SeqError> {
        let i = self.check_range(seq, first_index, end_index)?;
        self.remove_checked(i, first_index, end_index, 0, copies, moves)
            .map(|(edited, _)| edited)
    }

    /// Removal of `first..end` from sequence `i` (range checked); `delta` is added to the
    /// positions of the moved tokens, whose blocks are then all made writable (a context
    /// shift) when `delta != 0`. Returns what was done and the new logical blocks from
    /// which tokens moved (for the rotation).
    fn remove_checked(
        &mut self,
        i: usize,
        first: u32,
        end: u32,
        delta: i64,
        copies: &mut [BlockCopy],
        moves: &mut [RowMove],
    ) -> Result<(Edited, u32), SeqError> {
        let len = self.seqs.len[i];
        if first == end {
            return Ok((Edited::default(), 0));
        }
        let runs = self.seqs.runs(i);
        let mut edit = RunEdit::new();
        edit.push_runs(runs, 0, first.max(1), 0, 0);
        if end < len {
            edit.push(first, position_in(runs, end) + delta);
        }
        edit.push_runs(runs, end.saturating_add(1), len, end - first, delta);
        edit.check(len - (end - first), self.config.max_position_runs)?;
        if end == len {
            let released = self.blocks_for(len) - self.blocks_for(first);
            self.truncate_checked(i, first);
            return Ok((
                Edited {
                    released_blocks: released,
                    ..Edited::default()
                },
                first,
            ));
        }
        let plan = self.plan_removal(i, first, end, len);
        let new_len = plan.new_len();
        let (fb, _) = self.split(first);
        let fb = fb as usize;
        // New logical blocks written: those receiving rows, or (shift) all from `fb` on.
        let write_to = match delta {
            0 => plan.written_end(self.config.block_size),
            _ => self.blocks_for(new_len) as usize,
        };
        // The written blocks in old logical indices: before and after the dropped ones.
        let low = (fb, write_to.min(plan.drop_from));
        let high = (
            plan.old_block(fb.max(plan.drop_from)),
            plan.old_block(write_to.max(plan.drop_from)),
        );
        let need_copies = self.shared_blocks(i, low.0, low.1.max(low.0))
            + self.shared_blocks(i, high.0, high.1.max(high.0));
        self.check_room(self.slot(i), need_copies, 0)?;
        if copies.len() < need_copies as usize {
            return Err(SeqError::MoveBufferTooSmall {
                needed: need_copies as usize,
                got: copies.len(),
            });
        }
        let need_moves = match plan.pull_head {
            true => 1,
            false => self.row_run_count(end, plan.move_end, end - first),
        };
        if moves.len() < need_moves as usize {
            return Err(SeqError::MoveBufferTooSmall {
                needed: need_moves as usize,
                got: moves.len(),
            });
        }

        // Commit: nothing below can fail.
        let mut n_copies = self.own_blocks(i, low.0, low.1.max(low.0), copies);
        n_copies += self.own_blocks(
            i,
            high.0,
            high.1.max(high.0),
            &mut copies[n_copies as usize..],
        );
        let row = self.seqs.row(i);
        // The moved rows' old and new places, in the old layout (the dropped blocks are
        // still in the row; rows land before them).
        let mut n_moves = 0u32;
        if plan.pull_head {
            // The rows before `first` in its block, to the same offsets of the block
            // holding `end` (which keeps its rows from `end` on).
            let head = fb as u32 * self.config.block_size;
            moves[0] = RowMove {
                src_slot: self.slot_in(row, head),
                dst_slot: self.slot_in(row, head + (end - first)),
                count: first - head,
            };
            n_moves = 1;
        }
        self.row_runs(end, plan.move_end, end - first, |src, dst, count| {
            moves[n_moves as usize] = RowMove {
                src_slot: self.slot_in(row, src),
                dst_slot: self.slot_in(row, dst),
                count,
            };
            n_moves += 1;
        });
        let old_blocks = self.blocks_for(len) as usize;
        self.release_blocks(i, plan.drop_from, plan.drop_to);
        self.seqs
            .table
            .copy_within(row + plan.drop_to..row + old_blocks, row + plan.drop_from);
        let new_blocks = self.blocks_for(new_len) as usize;
        for k in fb..new_blocks {
            let b = self.seqs.table[row + k];
            if k < write_to {
                let rows =
                    (new_len - k as u32 * self.config.block_size).min(self.config.block_size);
                self.pool.set_fill(b, rows);
            } else if self.prefix.is_registered(b) && self.pool.is_exclusive(b) {
                self.prefix.unregister(b);
            }
        }
        self.seqs.len[i] = new_len;
        self.seqs.logical_tokens -= u64::from(end - first);
        // Known prefix first: its rewind reads the unchanged blocks before `first`.
        self.limit_known(i, first);
        self.store_runs(i, &edit);
        Ok((
            Edited {
                copies: n_copies,
                moves: n_moves,
                new_blocks: n_copies,
                released_blocks: (plan.drop_to - plan.drop_from) as u32,
            },
            new_len,
        ))
    }

    /// Adds `delta` to the positions of tokens `first_index..end_index` of `seq` (llama's
    /// `seq_add`); token rows and keys stay where they are: the keys of those tokens are
    /// still rotated at the old positions. To re-rotate them in place, first make their
    /// blocks writable with [`BlockManager::make_exclusive`] (or use
    /// [`BlockManager::context_shift`], which does both). Tokens from `first_index` on are
    /// no longer offered to the prefix cache. O(runs).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`],
    /// [`SeqError::BadRange`] unless `first_index <= end_index <= len`,
    /// [`SeqError::BadPositions`] when positions would stop strictly increasing or leave
    /// the `u32` range, [`SeqError::TooManyPositionRuns`]. Nothing changes on error.
    pub fn shift_positions(
        &mut self,
        seq: SeqId,
        first_index: u32,
        end_index: u32,
        delta: i32,
    ) -> Result<(), SeqError> {
        let i = self.check_range(seq, first_index, end_index)?;
        if first_index == end_index || delta == 0 {
            return Ok(());
        }
        let (first, end, len) = (first_index, end_index, self.seqs.len[i]);
        let runs = self.seqs.runs(i);
        let delta = i64::from(delta);
        let mut edit = RunEdit::new();
        edit.push_runs(runs, 0, first.max(1), 0, 0);
        edit.push(first, position_in(runs, first) + delta);
        edit.push_runs(runs, first.saturating_add(1), end, 0, delta);
        if end < len {
            edit.push(end, position_in(runs, end));
        }
        edit.push_runs(runs, end.saturating_add(1), len, 0, 0);
        edit.check(len, self.config.max_position_runs)?;
        // Known prefix first: its rewind reads the unchanged blocks before `first`.
        self.limit_known(i, first);
        self.store_runs(i, &edit);
        Ok(())
    }

    /// Makes the blocks holding tokens `first_index..end_index` of `seq` safe to write in
    /// place (to re-rotate keys after [`BlockManager::shift_positions`], say): each one
    /// another sequence holds is replaced by a copy (`copies[..n]`, execute before
    /// writing; one new block each), and each leaves the prefix cache. Returns `n`.
    /// O(blocks in the range).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`],
    /// [`SeqError::BadRange`], [`SeqError::OutOfBlocks`] ([`SeqError::QuotaExceeded`] under a namespace quota),
    /// [`SeqError::MoveBufferTooSmall`] when `copies` is too short. Nothing changes on
    /// error.
    pub fn make_exclusive(
        &mut self,
        seq: SeqId,
        first_index: u32,
        end_index: u32,
        copies: &mut [BlockCopy],
    ) -> Result<u32, SeqError> {
        let i = self.check_range(seq, first_index, end_index)?;
        if first_index == end_index {
            return Ok(0);
        }
        let from = self.split(first_index).0 as usize;
        let to = self.blocks_for(end_index) as usize;
        let needed = self.shared_blocks(i, from, to);
        self.check_room(self.slot(i), needed, 0)?;
        if copies.len() < needed as usize {
            return Err(SeqError::MoveBufferTooSmall {
                needed: needed as usize,
                got: copies.len(),
            });
        }
        let n = self.own_blocks(i, from, to, copies);
        // Owned blocks are untracked; their stored rows are this sequence's.
        let (bs, len, row) = (self.config.block_size, self.seqs.len[i], self.seqs.row(i));
        for k in from..to {
            let rows = (len - k as u32 * bs).min(bs);
            self.pool.set_fill(self.seqs.table[row + k], rows);
        }
        self.limit_known(i, first_index);
        Ok(n)
    }

    /// Creates a sequence in `namespace` holding tokens `first_index..end_index` of `seq`
    /// at their positions (llama's `seq_cp` into a new sequence). When `first_index` is on
    /// a block boundary the new sequence shares the blocks (reference counts go up; a
    /// shared partial last block is copied on its first append, as after a fork) and
    /// nothing is copied; otherwise it gets new blocks and the rows are moved into them
    /// (`moves[..edited.moves]`, execute before the next allocation). Only a copy from
    /// token 0 in the same namespace keeps the source's place in the prefix cache.
    /// O(blocks of the range + runs).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`],
    /// [`SeqError::BadRange`], [`SeqError::NoFreeSequence`], [`SeqError::OutOfBlocks`] ([`SeqError::QuotaExceeded`] under a namespace quota),
    /// [`SeqError::MoveBufferTooSmall`]. Nothing changes on error.
    pub fn copy_range(
        &mut self,
        seq: SeqId,
        first_index: u32,
        end_index: u32,
        namespace: u64,
        moves: &mut [RowMove],
    ) -> Result<CopiedRange, SeqError> {
        let src = self.check_range(seq, first_index, end_index)?;
        let (first, end) = (first_index, end_index);
        let new_len = end - first;
        let dst = self.seqs.first_free()?;
        let runs = self.seqs.runs(src);
        let mut edit = RunEdit::new();
        edit.push(0, position_in(runs, first));
        edit.push_runs(runs, first.saturating_add(1), end, first, 0);
        // A sub-list of valid runs is valid; checked all the same.
        edit.check(new_len, self.config.max_position_runs)?;
        let (fb, fo) = self.split(first);
        let blocks = self.blocks_for(new_len);
        let mut edited = Edited::default();
        let slot = self.pool.tenants.slot_of(namespace);
        if fo != 0 {
            self.check_room(slot, blocks, 0)?;
            let needed = self.row_run_count(first, end, first) as usize;
            if moves.len() < needed {
                return Err(SeqError::MoveBufferTooSmall {
                    needed,
                    got: moves.len(),
                });
            }
        }

        // Commit: nothing below can fail.
        self.open_seq(dst, namespace);
        let (from, to) = (self.seqs.row(src), self.seqs.row(dst));
        if fo == 0 {
            let start = from + fb as usize;
            self.seqs
                .table
                .copy_within(start..start + blocks as usize, to);
            self.pool.share(&self.seqs.table[to..to + blocks as usize]);
        } else {
            let bs = self.config.block_size;
            for k in 0..blocks {
                let b = self.pool.alloc(slot, &mut self.prefix);
                self.pool.set_fill(b, (new_len - k * bs).min(bs));
                self.seqs.table[to + k as usize] = b;
            }
            let mut n = 0u32;
            self.row_runs(first, end, first, |s, d, count| {
                moves[n as usize] = RowMove {
                    src_slot: self.slot_in(from, s),
                    dst_slot: self.slot_in(to, d),
                    count,
                };
                n += 1;
            });
            edited.moves = n;
            edited.new_blocks = blocks;
        }
        self.seqs.len[dst] = new_len;
        self.seqs.logical_tokens += u64::from(new_len);
        self.store_runs(dst, &edit);
        if first == 0 && namespace == self.seqs.namespace[src] {
            // A prefix of the source: its known ids and committed blocks hold.
            let known = self.seqs.known[src].min(end);
            self.seqs.known[dst] = known;
            let committed = self.seqs.committed[src].min(self.split(known).0);
            self.rewind_commit(dst, committed as usize);
        }
        Ok(CopiedRange {
            seq: self.seqs.handle(dst),
            edited,
        })
    }

    /// Releases every sequence of `others` except `keep` (llama's `seq_keep` over the
    /// caller's set: sequences outside `others` are left alone; `keep` may appear in it or
    /// not, and a sequence listed twice is released once). `others` is walked twice:
    /// first to check every handle, then to release. Returns how many were released.
    /// O(others + their blocks).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`] for `keep` or any of
    /// `others`; [`SeqError::Swapped`] for a swapped-out one of `others` (release it with
    /// [`BlockManager::release_swapped`]). Nothing changes on error.
    pub fn release_all_except(
        &mut self,
        keep: SeqId,
        others: impl Iterator<Item = SeqId> + Clone,
    ) -> Result<u32, SeqError> {
        self.seqs.check_any(keep)?;
        for s in others.clone().filter(|&s| s != keep) {
            self.seqs.check(s)?;
        }
        let mut released = 0;
        for s in others.filter(|&s| s != keep) {
            // Only a duplicate, released earlier in this loop, fails.
            if self.release(s).is_ok() {
                released += 1;
            }
        }
        Ok(released)
    }

    /// Context shift: keeps the first `n_keep` tokens of `seq` (a system prompt), drops
    /// the next `n_discard` and moves the rest down, giving the moved tokens positions
    /// `n_discard` lower so positions stay as dense as before. Nothing is recomputed: the
    /// moved keys were rotated at their old positions, so the result names the tokens to
    /// re-rotate and by how much. Copies and moves are reported as for
    /// [`BlockManager::remove_range`]; every block holding a moved token is made
    /// exclusive first (a shared one is copied, one more block each) and leaves the
    /// prefix cache, so it can be rotated in place. Execute copies, then moves, then the
    /// rotation. O(blocks of `seq` + runs).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`],
    /// [`SeqError::BadRange`] when `n_keep + n_discard` exceeds the length or
    /// `n_discard` exceeds `i32::MAX`, [`SeqError::OutOfBlocks`] ([`SeqError::QuotaExceeded`] under a namespace quota),
    /// [`SeqError::MoveBufferTooSmall`], [`SeqError::TooManyPositionRuns`]. Nothing
    /// changes on error.
    pub fn context_shift(
        &mut self,
        seq: SeqId,
        n_keep: u32,
        n_discard: u32,
        copies: &mut [BlockCopy],
        moves: &mut [RowMove],
    ) -> Result<ContextShift, SeqError> {
        let end = n_keep.checked_add(n_discard).ok_or(SeqError::BadRange {
            first: n_keep,
            end: u32::MAX,
            len: 0,
        });
        let i = self.seqs.check(seq)?;
        let len = self.seqs.len[i];
        let bad = SeqError::BadRange {
            first: n_keep,
            end: end.unwrap_or(u32::MAX),
            len,
        };
        let end = end.map_err(|_| bad)?;
        let delta = i32::try_from(n_discard).map_err(|_| bad)?;
        if end > len {
            return Err(bad);
        }
        let (edited, rotate_end) =
            self.remove_checked(i, n_keep, end, -i64::from(delta), copies, moves)?;
        let moved = rotate_end > n_keep && n_discard > 0;
        Ok(ContextShift {
            edited,
            rotate_first: n_keep,
            rotate_end: if moved { rotate_end } else { n_keep },
            delta: if moved { -delta } else { 0 },
        })
    }
}
