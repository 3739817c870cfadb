//! Retention priorities and namespace quotas on the owned cache: the core's verbs
//! ([`BlockManager::set_priority`] and the rest) on the cache's manager. A `KvCache`
//! keeps quota slots for [`crate::CacheConfig::max_namespaces`] namespaces
//! ([`CACHE_NAMESPACES`] unless configured, at most [`kvpage_core::MAX_NAMESPACES`]).
//!
//! [`BlockManager::set_priority`]: kvpage_core::BlockManager::set_priority

use kvpage_core::{NamespaceQuota, Priority, QuotaError};

use super::{CacheError, KvCache, PromptSeq, Seq};

/// The usual [`crate::CacheConfig::max_namespaces`]: namespaces a [`KvCache`] can give
/// a quota ([`KvCache::set_namespace_quota`]), and the fixed number every cache had
/// before the field existed. Namespaces without a quota share the rest of the pool.
pub const CACHE_NAMESPACES: u32 = 8;

impl KvCache {
    /// [`KvCache::create_with_prompt`] for a sequence of retention `priority`: the
    /// cached blocks it reuses, and the blocks it commits, are raised to at least
    /// `priority` (`Pinned` keeps a hot system prompt cached for every later request).
    /// O(prompt).
    ///
    /// # Errors
    /// As [`KvCache::create_with_prompt`], and [`kvpage_core::SeqError::QuotaExceeded`]
    /// when the namespace's quota cannot take the prompt's blocks.
    pub fn create_with_prompt_at(
        &mut self,
        namespace: u64,
        priority: Priority,
        prompt: &[u32],
    ) -> Result<PromptSeq, CacheError> {
        self.create_with_prompt_as(namespace, priority, prompt)
    }

    /// The retention priority of `seq`. O(1).
    ///
    /// # Errors
    /// [`kvpage_core::SeqError::StaleHandle`], [`kvpage_core::SeqError::ForeignHandle`].
    pub fn priority(&self, seq: Seq) -> Result<Priority, CacheError> {
        Ok(self.block_manager().priority(seq.0)?)
    }

    /// Sets the retention priority of `seq` and of every block it holds now (exactly:
    /// lowering unpins); the blocks it commits later are raised to at least it.
    /// O(blocks of `seq`).
    ///
    /// # Errors
    /// [`kvpage_core::SeqError::StaleHandle`], [`kvpage_core::SeqError::ForeignHandle`].
    /// Nothing changes on error.
    pub fn set_priority(&mut self, seq: Seq, priority: Priority) -> Result<(), CacheError> {
        Ok(Self::with_manager(&mut self.tables, |m| {
            m.set_priority(seq.0, priority)
        })?)
    }

    /// Sets the priority of the blocks of `seq` holding tokens `first..end` to
    /// `priority`, raising the blocks before the range to at least it and lowering those
    /// after it to at most it (a chain's tail never outlives its head). O(blocks of
    /// `seq`).
    ///
    /// # Errors
    /// As [`KvCache::set_priority`], and [`kvpage_core::SeqError::BadRange`].
    pub fn set_range_priority(
        &mut self,
        seq: Seq,
        first: u32,
        end: u32,
        priority: Priority,
    ) -> Result<(), CacheError> {
        Ok(Self::with_manager(&mut self.tables, |m| {
            m.set_range_priority(seq.0, first, end, priority)
        })?)
    }

    /// Lowers every cached pinned block that no sequence holds to `Normal`, so eviction
    /// may take it; returns how many. O(unpinned × namespaces).
    pub fn unpin_cached(&mut self) -> u32 {
        Self::with_manager(&mut self.tables, |m| m.unpin_cached())
    }

    /// Cached pinned blocks (never evicted). O(1).
    pub fn pinned_blocks(&self) -> u32 {
        self.block_manager().pinned_blocks()
    }

    /// Sets the quota of `namespace`: at most `quota.max_blocks` blocks held or cached
    /// by its sequences (at its limit it evicts its own cached blocks first), and
    /// `quota.reserved_blocks` kept for it that other namespaces never take. Lowering a
    /// limit evicts the namespace's own cached blocks down to it. Takes one of the
    /// [`crate::CacheConfig::max_namespaces`] slots for good. O(max_namespaces +
    /// evicted).
    ///
    /// # Errors
    /// [`QuotaError::ReserveAboveLimit`], [`QuotaError::TableFull`] (all
    /// `max_namespaces` slots taken, or none configured), [`QuotaError::HeldAboveLimit`],
    /// [`QuotaError::ReserveUnavailable`]. Nothing changes on error.
    pub fn set_namespace_quota(
        &mut self,
        namespace: u64,
        quota: NamespaceQuota,
    ) -> Result<(), QuotaError> {
        Self::with_manager(&mut self.tables, |m| {
            m.set_namespace_quota(namespace, quota)
        })
    }

    /// The quota of `namespace` ([`NamespaceQuota::UNLIMITED`] without one). O(namespaces).
    pub fn namespace_quota(&self, namespace: u64) -> NamespaceQuota {
        self.block_manager().namespace_quota(namespace)
    }

    /// Blocks held or cached that are charged to `namespace` (0 without a quota).
    /// O(namespaces).
    pub fn namespace_blocks(&self, namespace: u64) -> u32 {
        self.block_manager().namespace_blocks(namespace)
    }
}
