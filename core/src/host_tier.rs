//! The host tier: a second pool of blocks standing for pinned host memory.
//!
//! Swapping a sequence out moves each of its blocks to a host block and frees the device
//! block; swapping in does the reverse. The manager plans the moves
//! ([`crate::BlockManager::swap_out`], [`crate::BlockManager::swap_in`]) as
//! [`crate::BlockCopy`] pairs (`src` = device block and `dst` = host block on swap-out,
//! the reverse on swap-in); a backend copies the bytes (one block-sized range each, all
//! layers at once in the block-major layout). Host blocks belong to exactly one swapped
//! sequence, so they need no reference counts.

use crate::error::InitError;
use crate::index_set::{words_for, IndexSet};

/// Free set of host-tier blocks, lowest index first.
#[derive(Debug)]
pub struct HostPool<'a> {
    free: IndexSet<'a>,
    blocks: u32,
    instance: u32,
}

impl<'a> HostPool<'a> {
    /// `u32` words of storage a pool of `blocks` needs. O(1).
    pub const fn storage_words(blocks: u32) -> usize {
        words_for(blocks)
    }

    /// Builds a pool of `blocks` free host blocks for the manager whose
    /// [`crate::Config::instance`] is `instance`. O(blocks / 32).
    ///
    /// # Errors
    /// [`InitError::ZeroSize`] for zero blocks; [`InitError::StorageTooSmall`].
    pub fn new(blocks: u32, instance: u32, storage: &'a mut [u32]) -> Result<Self, InitError> {
        if blocks == 0 {
            return Err(InitError::ZeroSize);
        }
        let needed = Self::storage_words(blocks);
        if storage.len() < needed {
            return Err(InitError::StorageTooSmall {
                needed,
                got: storage.len(),
            });
        }
        Ok(Self {
            free: IndexSet::new(storage, blocks, true),
            blocks,
            instance,
        })
    }

    /// Blocks in the pool. O(1).
    pub fn total_blocks(&self) -> u32 {
        self.blocks
    }

    /// Free blocks. O(1).
    pub fn free_blocks(&self) -> u32 {
        self.free.count()
    }

    pub(crate) fn instance(&self) -> u32 {
        self.instance
    }

    /// Takes the lowest free block. Precondition: `free_blocks() > 0`.
    pub(crate) fn take(&mut self) -> u32 {
        self.free.pop_first().unwrap_or(0)
    }

    /// Returns block `b` to the pool.
    pub(crate) fn give_back(&mut self, b: u32) {
        self.free.insert(b);
    }
}
