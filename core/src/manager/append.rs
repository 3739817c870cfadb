//! Appends: the general path (checks everything, then copy-on-write, allocation and the
//! slot mapping) and the one-token fast path of decoding.

use super::{Appended, BlockCopy, BlockManager, SeqId};
use crate::error::SeqError;

impl BlockManager<'_> {
    /// Appends `n` tokens whose ids are not known: allocates blocks as needed and writes
    /// the physical slot (`block * block_size + offset`) of each new token into
    /// `slots[..n]`. Blocks holding such tokens never enter the prefix cache, nor do later
    /// ones of this sequence (until it is truncated back before them). If the last block
    /// is partly filled and shared, it is copied first and the copy is returned, as for
    /// [`BlockManager::append_tokens`]. O(n) plus O(1) per new block.
    ///
    /// # Errors
    /// As [`BlockManager::append_tokens`].
    pub fn append(&mut self, seq: SeqId, n: u32, slots: &mut [u32]) -> Result<Appended, SeqError> {
        let i = self.seqs.check(seq)?;
        if n == 1 && self.append_one_in_place(i, None, slots) {
            return Ok(Appended::default());
        }
        self.append_checked(i, n, None, slots)
    }

    /// Appends `tokens`: like [`BlockManager::append`], and the ids are kept so that full
    /// blocks can enter the prefix cache once [`BlockManager::commit`] says their K/V is
    /// written (with [`crate::Config::prefix_cache`] off the ids are not stored). If the
    /// last block is partly filled and shared (after a fork or a prefix hit), it is copied
    /// first and the copy is returned: the backend must execute it before writing. O(n),
    /// a block at a time: per block one allocation, a run of consecutive slots and one
    /// copy of its ids.
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`],
    /// [`SeqError::TooLong`] past `max_blocks_per_seq`, [`SeqError::OutOfBlocks`] ([`SeqError::QuotaExceeded`] under a namespace quota),
    /// [`SeqError::SlotBufferTooSmall`], [`SeqError::BadPositions`] when a new token's
    /// position (the last one's plus one) would pass `u32::MAX`. Nothing changes on error.
    pub fn append_tokens(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        slots: &mut [u32],
    ) -> Result<Appended, SeqError> {
        let i = self.seqs.check(seq)?;
        let max_tokens = self.config.max_tokens_per_seq();
        let n = u32::try_from(tokens.len()).map_err(|_| SeqError::TooLong {
            tokens: tokens.len() as u64,
            max_tokens,
        })?;
        if let [id] = *tokens {
            if self.append_one_in_place(i, Some(id), slots) {
                return Ok(Appended::default());
            }
        }
        self.append_checked(i, n, Some(tokens), slots)
    }

    /// Appends to live sequence `i`. Checks everything, then commits.
    pub(super) fn append_checked(
        &mut self,
        i: usize,
        n: u32,
        ids: Option<&[u32]>,
        slots: &mut [u32],
    ) -> Result<Appended, SeqError> {
        let bs = self.config.block_size;
        let len = self.seqs.len[i];
        let new_len = u64::from(len) + u64::from(n);
        let max_tokens = self.config.max_tokens_per_seq();
        if new_len > max_tokens {
            return Err(SeqError::TooLong {
                tokens: new_len,
                max_tokens,
            });
        }
        if slots.len() < n as usize {
            return Err(SeqError::SlotBufferTooSmall {
                needed: n as usize,
                got: slots.len(),
            });
        }
        if !self.positions_fit(i, n) {
            return Err(SeqError::BadPositions);
        }
        let (full_blocks, offset) = self.split(len);
        if n == 1 && offset == 0 {
            return self.append_one_new_block(i, len, full_blocks as usize, ids, slots);
        }
        let old_blocks = (full_blocks + u32::from(offset != 0)) as usize;
        let grow = self.blocks_for(new_len as u32) - old_blocks as u32;
        let row = self.seqs.row(i);
        let partial = if offset != 0 && n > 0 {
            Some(self.seqs.table[row + old_blocks - 1])
        } else {
            None
        };
        let cow = partial.is_some_and(|b| !self.pool.is_exclusive(b));
        let needed = grow + u32::from(cow);
        let owner = self.slot(i);
        self.check_room(owner, needed, 0)?;

        // Commit: nothing below can fail.
        let mut copy = None;
        if let Some(last) = partial {
            if cow {
                let dst = self.pool.alloc(owner, &mut self.prefix);
                self.prefix.copy_tokens(last, dst, offset);
                self.pool.set_fill(dst, offset);
                self.pool.release(last, &mut self.prefix);
                self.seqs.table[row + old_blocks - 1] = dst;
                copy = Some(BlockCopy { src: last, dst });
            } else if self.prefix.is_tracked(last) || self.pool.fill(last) != offset {
                self.claim_partial(last, offset);
            }
        }
        // The new blocks, in one run when there are several and the free set provides
        // them all (their eligibility checked once), else one by one (a single block:
        // `alloc` is the shorter path, ~110 instructions against the run's ~170).
        let new_blocks = &mut self.seqs.table[row + old_blocks..row + old_blocks + grow as usize];
        if new_blocks.len() < 2
            || !self
                .pool
                .alloc_free_run(owner, &mut self.prefix, new_blocks)
        {
            for b in new_blocks.iter_mut() {
                *b = self.pool.alloc(owner, &mut self.prefix);
            }
        }
        // A run of blocks at a time: a block, and the blocks after it in the table whose
        // indices follow on from its own (lowest-index-first allocation from a pool
        // that is not fragmented gives such runs), hold consecutive slots, and their
        // ids consecutive places in the prefix cache: one slot loop and one copy of ids
        // per run, one fill store per block.
        let bs_tokens = bs as usize;
        let mut block_index = full_blocks as usize;
        let mut off = offset as usize;
        let mut k = 0usize;
        let n = n as usize;
        while k < n {
            let b = self.seqs.table[row + block_index];
            let mut take = (bs_tokens - off).min(n - k);
            let mut blocks = 1u32;
            // Tokens left past the run's end means its last block is full and the
            // next block (allocated above, starting empty) exists.
            while k + take < n
                && Some(self.seqs.table[row + block_index + blocks as usize])
                    == b.checked_add(blocks)
            {
                take = (take + bs_tokens).min(n - k);
                blocks += 1;
            }
            let first_slot = b * bs + off as u32;
            for (slot, s) in slots[k..k + take].iter_mut().zip(first_slot..) {
                *slot = s;
            }
            if let Some(ids) = ids {
                self.prefix.set_tokens(b, off as u32, &ids[k..k + take]);
            }
            // Tokens of the run's blocks, counted from its first block's start.
            let mut left = off + take;
            for j in 0..blocks {
                let end = left.min(bs_tokens);
                left -= end;
                if end as u32 > self.pool.fill(b + j) {
                    self.pool.set_fill(b + j, end as u32);
                }
            }
            // The run's last block ends here.
            off = off + take - (blocks as usize - 1) * bs_tokens;
            k += take;
            block_index += blocks as usize - 1;
            if off == bs_tokens {
                off = 0;
                block_index += 1;
            }
        }
        self.finish_append(i, len, n as u32, ids.is_some());
        Ok(Appended {
            copy,
            new_blocks: grow,
        })
    }

    /// [`Self::append_checked`] of one token that opens a new block (the decode step
    /// at a block boundary), after its checks of length, slot buffer and positions:
    /// the one block's room, allocation, slot, id and fill without the general path's
    /// partial-block and run handling (callgrind, `cargo bench -p kvpage-core` one-token
    /// new-block append: 424 instructions a call against 567 through the general path).
    /// `len` is the sequence's length and `full` its block count, all of them full.
    /// Nothing changes on error.
    fn append_one_new_block(
        &mut self,
        i: usize,
        len: u32,
        full: usize,
        ids: Option<&[u32]>,
        slots: &mut [u32],
    ) -> Result<Appended, SeqError> {
        let owner = self.slot(i);
        self.check_room(owner, 1, 0)?;
        let b = self.pool.alloc(owner, &mut self.prefix);
        let row = self.seqs.row(i);
        self.seqs.table[row + full] = b;
        slots[0] = b * self.config.block_size;
        if let Some(ids) = ids {
            self.prefix.set_tokens(b, 0, &ids[..1]);
        }
        self.pool.set_fill(b, 1);
        self.finish_append(i, len, 1, ids.is_some());
        Ok(Appended {
            copy: None,
            new_blocks: 1,
        })
    }

    /// The sequence-level bookkeeping of an append of `n` tokens to live sequence `i`
    /// of `len` tokens before it, its blocks already written: the length, the known
    /// positions (when ids came with the tokens and the positions are the indices) and
    /// the token count. O(1).
    #[inline]
    fn finish_append(&mut self, i: usize, len: u32, n: u32, with_ids: bool) {
        if with_ids && self.seqs.known[i] == len && self.seqs.positions_are_indices(i) {
            self.seqs.known[i] = len + n;
        }
        self.seqs.len[i] = len + n;
        self.seqs.logical_tokens += u64::from(n);
    }

    /// The decode fast path: appends one token to sequence `i` when it lands inside the
    /// sequence's partly filled last block, which it holds alone and which the prefix
    /// cache does not track. Returns `false` (having changed nothing) in every other case,
    /// for the general path. Cannot exceed `max_blocks_per_seq`: the token goes into a
    /// block the sequence already has. (Filling the block needs nothing more: blocks
    /// enter the prefix cache on [`BlockManager::commit`].)
    #[inline]
    fn append_one_in_place(&mut self, i: usize, id: Option<u32>, slots: &mut [u32]) -> bool {
        let Some(slot) = slots.first_mut() else {
            return false;
        };
        let len = self.seqs.len[i];
        let (full, offset) = self.split(len);
        if offset == 0 {
            return false;
        }
        let b = self.seqs.table[self.seqs.row(i) + full as usize];
        if !self.pool.is_exclusive(b)
            || self.pool.fill(b) != offset
            || self.prefix.is_tracked(b)
            || !self.positions_fit(i, 1)
        {
            return false;
        }
        *slot = b * self.config.block_size + offset;
        // The bookkeeping of `finish_append`, written out: called here it cost 4 more
        // instructions a call (callgrind, 152.4 against 156.7) on the hottest path.
        if let Some(id) = id {
            self.prefix.set_token(b, offset, id);
            if self.seqs.known[i] == len && self.seqs.positions_are_indices(i) {
                self.seqs.known[i] = len + 1;
            }
        }
        self.pool.set_fill(b, offset + 1);
        self.seqs.len[i] = len + 1;
        self.seqs.logical_tokens += 1;
        true
    }

    /// Makes exclusively held block `b` writable from token `offset` on: it leaves the
    /// prefix cache (its content is about to change) and stores `offset` tokens.
    pub(super) fn claim_partial(&mut self, b: u32, offset: u32) {
        if self.prefix.is_registered(b) {
            self.prefix.unregister(b);
        }
        self.prefix.clear(b);
        self.pool.set_fill(b, offset);
    }
}
