//! Retention priorities and namespace quotas: the manager's verbs over
//! [`crate::retention`] and [`super::quota`].
//!
//! # Which priority a block has
//! A sequence has a [`Priority`] ([`BlockManager::create_with_prompt_at`],
//! [`BlockManager::set_priority`]; `Normal` by default, inherited by a fork). The blocks
//! it commits and the cached blocks it reuses are raised to at least that priority: a
//! block's priority is the highest of the sequences that committed or reused it since
//! it was allocated. An explicit [`BlockManager::set_priority`] or
//! [`BlockManager::set_range_priority`] sets the blocks it names to exactly the priority
//! given (so unpinning works) until a holder raises them again.
//!
//! # The chain order across priorities
//! Eviction takes a chain's tail before its head within one priority (blocks become
//! cached deepest first). Across priorities it holds because along one sequence's chain
//! block priorities never increase: a raise by a holder covers all its blocks from the
//! first, and [`BlockManager::set_range_priority`] raises the blocks before its range to
//! at least, and lowers the blocks after it to at most, the priority it sets. Sequences
//! that share a prefix and then diverge can still set their own tails above the shared
//! head's priority through an explicit lowering of the shared blocks by one of them; the
//! stranded tail is then unreachable (never served) until evicted, and a stranded
//! *pinned* tail is released by [`BlockManager::unpin_cached`].

use super::{BlockManager, NamespaceQuota, SeqId};
use crate::error::{QuotaError, SeqError};
use crate::retention::Priority;

impl BlockManager<'_> {
    /// Raises block `b` to at least `p` (a cached block moves to its new list).
    pub(super) fn raise_priority(&mut self, b: u32, p: Priority) {
        if self.prefix.priority(b) < p {
            self.set_block_priority(b, p);
        }
    }

    /// Sets block `b`'s priority to `p`, moving it between lists if cached.
    fn set_block_priority(&mut self, b: u32, p: Priority) {
        let listed = self.pool.refcount(b) == Some(0) && self.prefix.is_registered(b);
        self.prefix.set_priority(b, p, listed);
    }

    /// The retention priority of `seq`. O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`].
    pub fn priority(&self, seq: SeqId) -> Result<Priority, SeqError> {
        Ok(self.seqs.priority(self.seqs.check(seq)?))
    }

    /// Sets the retention priority of `seq` and of every block it holds now (exactly
    /// `priority`, lowering included: see [`Priority`]). The blocks it
    /// commits or reuses later are raised to at least `priority`. `Pinned` blocks are
    /// never evicted while registered; unpin by setting a lower priority (or
    /// [`BlockManager::unpin_cached`] once no sequence holds them). O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`].
    pub fn set_priority(&mut self, seq: SeqId, priority: Priority) -> Result<(), SeqError> {
        let i = self.seqs.check(seq)?;
        self.seqs.set_priority(i, priority);
        let blocks = self.blocks_for(self.seqs.len[i]) as usize;
        for k in 0..blocks {
            let b = self.seqs.table[self.seqs.row(i) + k];
            self.set_block_priority(b, priority);
        }
        Ok(())
    }

    /// Sets the priority of the blocks of `seq` holding tokens `first_index..end_index`
    /// (block granularity: every block with a token in the range) to exactly `priority`,
    /// raises its blocks before the range to at least `priority` and lowers its blocks
    /// after it to at most `priority`, so priorities never increase along its chain.
    /// The sequence's own priority (for later commits) is unchanged. An empty range
    /// changes nothing. O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`],
    /// [`SeqError::BadRange`] when the range is reversed or past the length.
    pub fn set_range_priority(
        &mut self,
        seq: SeqId,
        first_index: u32,
        end_index: u32,
        priority: Priority,
    ) -> Result<(), SeqError> {
        let i = self.check_range(seq, first_index, end_index)?;
        if first_index == end_index {
            return Ok(());
        }
        let from = self.split(first_index).0 as usize;
        let to = self.blocks_for(end_index) as usize;
        let blocks = self.blocks_for(self.seqs.len[i]) as usize;
        for k in 0..blocks {
            let b = self.seqs.table[self.seqs.row(i) + k];
            let now = self.prefix.priority(b);
            let p = match k {
                k if k < from => now.max(priority),
                k if k < to => priority,
                _ => now.min(priority),
            };
            self.set_block_priority(b, p);
        }
        Ok(())
    }

    /// The priority of block `b` (`Normal` for a block the prefix cache knows nothing
    /// of); `None` out of range. O(1).
    pub fn block_priority(&self, b: u32) -> Option<Priority> {
        (b < self.config.num_blocks).then(|| self.prefix.priority(b))
    }

    /// Cached blocks at [`Priority::Pinned`]: counted in
    /// [`crate::Stats::cached_blocks`], never evicted, not in
    /// [`BlockManager::available_blocks`]. O(1).
    pub fn pinned_blocks(&self) -> u32 {
        self.prefix.lru_pinned()
    }

    /// Lowers every cached pinned block (held by no sequence) to `Normal`, so eviction
    /// may take it: the way to drop pinned prompts nobody uses any more. Pinned blocks
    /// that sequences hold stay pinned. Returns how many were unpinned. O(unpinned *
    /// (max_namespaces + 1)).
    pub fn unpin_cached(&mut self) -> u32 {
        let mut n = 0;
        for s in 0..self.pool.tenants.slots() {
            loop {
                let Some(b) = self.prefix.lru().iter(s, Priority::Pinned).next() else {
                    break;
                };
                self.prefix.set_priority(b, Priority::Normal, true);
                n += 1;
            }
        }
        n
    }

    /// Sets the quota of `namespace`: at most `quota.max_blocks` blocks used or cached
    /// by its sequences, and `quota.reserved_blocks` kept for it (other namespaces never
    /// take the free blocks it needs to reach that many, nor evict its cached blocks
    /// while it holds no more). A namespace without a quota takes a slot of the
    /// [`crate::Config::max_namespaces`] table and keeps it (set
    /// [`NamespaceQuota::UNLIMITED`] to lift a quota). Lowering the limit evicts the
    /// namespace's own cached blocks down to it. Blocks a namespace allocated before it
    /// got a slot are not charged to it. O(max_namespaces + evicted).
    ///
    /// # Errors
    /// [`QuotaError::ReserveAboveLimit`], [`QuotaError::TableFull`],
    /// [`QuotaError::HeldAboveLimit`] when its used and pinned blocks exceed the new
    /// limit, [`QuotaError::ReserveUnavailable`] when the free blocks cannot cover all
    /// reservations. Nothing changes on error.
    pub fn set_namespace_quota(
        &mut self,
        namespace: u64,
        quota: NamespaceQuota,
    ) -> Result<(), QuotaError> {
        self.pool.set_quota(namespace, quota, &mut self.prefix)
    }

    /// The quota of `namespace` ([`NamespaceQuota::UNLIMITED`] without one).
    /// O(max_namespaces).
    pub fn namespace_quota(&self, namespace: u64) -> NamespaceQuota {
        match self.pool.tenants.slot_of(namespace) {
            0 => NamespaceQuota::UNLIMITED,
            s => self.pool.tenants.quota(s),
        }
    }

    /// Blocks `namespace`'s quota still allows right now, its own evictable cached
    /// blocks included (`u32::MAX` without a quota): the limit part of
    /// [`BlockManager::available_blocks_for`], which also bounds it by the pool.
    /// O(max_namespaces).
    pub fn quota_room(&self, namespace: u64) -> u32 {
        self.pool
            .room(self.pool.tenants.slot_of(namespace), &self.prefix)
            .quota
    }

    /// Blocks allocations for every namespace can take right now: free blocks not kept
    /// for reservations plus the cached blocks any namespace may evict. At most
    /// [`BlockManager::available_blocks_for`] of every namespace, equal to
    /// [`BlockManager::available_blocks`] without reservations, and each block
    /// allocated (for any namespace) lowers it by at most one, so a plan whose blocks
    /// fit in it fits whichever namespaces take them (quota limits aside). O(max_namespaces).
    pub fn shared_available_blocks(&self) -> u32 {
        self.pool.shared_room(&self.prefix)
    }

    /// Blocks used or cached that are charged to `namespace` (0 without a quota: those
    /// are not counted per namespace). O(max_namespaces).
    pub fn namespace_blocks(&self, namespace: u64) -> u32 {
        match self.pool.tenants.slot_of(namespace) {
            0 => 0,
            s => self.pool.tenants.charged(s),
        }
    }
}
