//! Swaps: moving a sequence's blocks to the host tier and back.

use super::{BlockCopy, BlockManager, SeqId};
use crate::error::SeqError;
use crate::host_tier::HostPool;

impl BlockManager<'_> {
    /// Moves `seq` to the host tier: each of its blocks gets a host block, the copies
    /// (`src` = device block, `dst` = host block) are written to `moves[..blocks]` in
    /// logical order for the backend to execute, and the
    /// device references are dropped, deepest block first (registered blocks stay cached
    /// on the device). The handle stays valid; until [`BlockManager::swap_in`] every other
    /// operation on it returns [`SeqError::Swapped`] and its row of the block table reads
    /// length 0. Returns the number of blocks moved. O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`] (also for another
    /// manager's host pool), [`SeqError::Swapped`], [`SeqError::HostFull`],
    /// [`SeqError::MoveBufferTooSmall`]. Nothing changes on error.
    pub fn swap_out(
        &mut self,
        seq: SeqId,
        host: &mut HostPool<'_>,
        moves: &mut [BlockCopy],
    ) -> Result<u32, SeqError> {
        let i = self.seqs.check(seq)?;
        self.seqs.check_host(host)?;
        let len = self.seqs.len[i];
        let blocks = self.blocks_for(len);
        if host.free_blocks() < blocks {
            return Err(SeqError::HostFull {
                needed: blocks,
                available: host.free_blocks(),
            });
        }
        let moves = moves_for(moves, blocks)?;
        self.release_blocks(i, 0, blocks as usize);
        let row = self.seqs.row(i);
        for (m, entry) in moves.iter_mut().zip(&mut self.seqs.table[row..]) {
            let h = host.take();
            *m = BlockCopy {
                src: *entry,
                dst: h,
            };
            *entry = h;
        }
        self.seqs.swapped_len[i] = len;
        self.seqs.len[i] = 0;
        self.seqs.logical_tokens -= u64::from(len);
        self.seqs.set_swapped(i, true);
        // The blocks come back as fresh copies the prefix cache knows nothing about.
        self.seqs.known[i] = 0;
        self.rewind_commit(i, 0);
        Ok(blocks)
    }

    /// Brings swapped-out `seq` back: allocates a device block per host block, writes the
    /// copies (`src` = host block, `dst` = device block) to `moves[..blocks]` in logical
    /// order for the backend to execute, and frees the host blocks. The blocks come back unshared and unregistered, and the sequence's
    /// later blocks are not registered in the prefix cache. Returns the number of blocks
    /// moved. O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`] (also for another
    /// manager's host pool), [`SeqError::NotSwapped`], [`SeqError::OutOfBlocks`] ([`SeqError::QuotaExceeded`] under a namespace quota),
    /// [`SeqError::MoveBufferTooSmall`]. Nothing changes on error.
    pub fn swap_in(
        &mut self,
        seq: SeqId,
        host: &mut HostPool<'_>,
        moves: &mut [BlockCopy],
    ) -> Result<u32, SeqError> {
        let i = self.seqs.check_swapped(seq, host)?;
        let len = self.seqs.swapped_len[i];
        let blocks = self.blocks_for(len);
        let slot = self.slot(i);
        self.check_room(slot, blocks, 0)?;
        let moves = moves_for(moves, blocks)?;
        let row = self.seqs.row(i);
        let bs = self.config.block_size;
        for (k, m) in moves.iter_mut().enumerate() {
            let h = self.seqs.table[row + k];
            let b = self.pool.alloc(slot, &mut self.prefix);
            *m = BlockCopy { src: h, dst: b };
            self.seqs.table[row + k] = b;
            host.give_back(h);
            self.pool.set_fill(b, (len - k as u32 * bs).min(bs));
        }
        self.seqs.len[i] = len;
        self.seqs.logical_tokens += u64::from(len);
        self.seqs.set_swapped(i, false);
        Ok(blocks)
    }

    /// Releases a swapped-out sequence, returning its host blocks; its handle becomes
    /// stale. O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`] (also for another
    /// manager's host pool), [`SeqError::NotSwapped`].
    pub fn release_swapped(&mut self, seq: SeqId, host: &mut HostPool<'_>) -> Result<(), SeqError> {
        let i = self.seqs.check_swapped(seq, host)?;
        let row = self.seqs.row(i);
        let blocks = self.blocks_for(self.seqs.swapped_len[i]) as usize;
        for &h in &self.seqs.table[row..row + blocks] {
            host.give_back(h);
        }
        self.seqs.close(i);
        Ok(())
    }

    /// Whether `seq` is swapped out. O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`].
    pub fn is_swapped(&self, seq: SeqId) -> Result<bool, SeqError> {
        Ok(self.seqs.is_swapped(self.seqs.check_any(seq)?))
    }
}

/// The first `blocks` entries of `moves`.
///
/// # Errors
/// [`SeqError::MoveBufferTooSmall`] when `moves` is shorter.
fn moves_for(moves: &mut [BlockCopy], blocks: u32) -> Result<&mut [BlockCopy], SeqError> {
    let got = moves.len();
    moves
        .get_mut(..blocks as usize)
        .ok_or(SeqError::MoveBufferTooSmall {
            needed: blocks as usize,
            got,
        })
}
