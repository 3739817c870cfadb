//! The block manager: block pool, page tables, sequences and prefix sharing over
//! caller-provided storage.
//!
//! The manager is split along its seams. Three parts own storage carved from the
//! caller's words and state their own size (`storage_words`), which
//! [`Config::storage_words`] sums: the block pool ([`pool`]), the sequence table
//! ([`seqs`]) and the prefix cache ([`crate::prefix`], no storage at all when
//! [`Config::prefix_cache`] is off). The operations live beside them: sequence life
//! (this module), appends ([`append`]), commits to the prefix cache ([`commit`]),
//! swaps to the host tier ([`swap`]), token positions ([`positions`]) and the
//! `llama.h`-style sequence edits ([`edit`]).
//!
//! # Invariants that make the rest panic-free
//! - Every block is in exactly one state: *free* (in the free bitset, refcount 0, not
//!   registered), *cached* (registered, refcount 0, in the eviction list of its
//!   namespace slot and priority) or *used* (refcount ≥ 1). So `free + cached + used ==
//!   num_blocks`. Used and cached blocks are charged to the namespace slot that
//!   allocated them, never beyond its quota, and the free blocks cover every
//!   reservation ([`quota`]; retention priorities in [`retain`]).
//! - A block's refcount equals the number of block-table entries of live sequences that
//!   name it.
//! - A live sequence of length `len` owns exactly `ceil(len / block_size)` entries at the
//!   start of its row, each naming a used block; `len ≤ max_blocks_per_seq * block_size`.
//! - Its committed blocks (`committed`) are full and lie within its known-id prefix
//!   (`known ≤ len`); only committed blocks are ever registered. Within the known-id
//!   prefix every token's position is its index (an edit shortens the prefix to the
//!   edit point), so a registered block always holds keys at the positions a prompt with
//!   its ids would give them.
//! - Only a block with refcount 1 and not registered is ever written: appending into a
//!   shared or registered partial block copies it first (copy-on-write) or unregisters it.
//! - A chain's blocks become cached deepest first (a sequence releases its blocks last to
//!   first), so eviction, least recently cached first within a priority, takes a
//!   chain's tail before its head and every cached block stays reachable by a lookup
//!   from the first block. Across priorities the order holds because a sequence's
//!   block priorities never increase along its chain (see [`retain`]). (One
//!   exception, harmless: a registered block that an edited sequence kept past its edit
//!   point while others held it too, and that the edited sequence releases last, may
//!   become cached after its chain's head; once the head is evicted no lookup reaches it,
//!   so it is never served and waits for eviction like any cached block. See [`edit`].)
//! - Every operation checks all its preconditions (handle, lengths, buffer sizes, free
//!   blocks) before it changes anything, so a failed operation leaves no trace.
//!
//! Indices into the internal arrays come from validated handles or from the tables this
//! module writes, so indexing cannot go out of bounds.

mod append;
mod commit;
mod edit;
mod events;
pub(crate) mod pool;
mod positions;
mod quota;
mod registered;
mod retain;
pub(crate) mod seqs;
mod swap;

use crate::config::Config;
use crate::error::{InitError, SeqError};
use crate::log::debug;
use crate::prefix::PrefixCache;
use crate::retention::Priority;
use crate::stats::Stats;
use crate::storage::Carver;
pub use edit::{ContextShift, CopiedRange, Edited, RowMove};
use pool::BlockPool;
pub use positions::PositionRun;
pub use quota::NamespaceQuota;
pub use registered::{Imported, RegisteredBlock};
pub use seqs::SeqId;
use seqs::SeqTable;

/// A whole-block copy the backend must perform: all layers' K and V of physical block
/// `src` into physical block `dst`, one block-sized range in the block-major layout.
///
/// The one type for every block copy the core plans:
/// - copy-on-write ([`Appended::copy`]): both are device blocks; execute it before
///   writing the new tokens;
/// - swap-out ([`BlockManager::swap_out`]): `src` is the device block, `dst` the host
///   block;
/// - swap-in ([`BlockManager::swap_in`]): `src` is the host block, `dst` the device block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(C)]
pub struct BlockCopy {
    /// Block to read.
    pub src: u32,
    /// Block to write.
    pub dst: u32,
}

/// What an append did besides writing the slot mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Appended {
    /// Copy-on-write the backend must execute before writing K/V into the new slots.
    pub copy: Option<BlockCopy>,
    /// Blocks newly allocated for the tokens (not counting the copy's destination).
    pub new_blocks: u32,
}

/// Result of [`BlockManager::prefix_lookup`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PrefixHit {
    /// Leading prompt tokens found cached (a multiple of the block size).
    pub tokens: u32,
    /// Blocks of them that no sequence references now.
    pub idle_blocks: u32,
}

/// Result of [`BlockManager::create_with_prompt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PromptStart {
    /// The new sequence, holding the whole prompt.
    pub seq: SeqId,
    /// Leading prompt tokens whose K/V came from the prefix cache (a multiple of the block
    /// size); the slots written cover only the tokens after them.
    pub reused_tokens: u32,
    /// Allocation done for the remaining tokens.
    pub appended: Appended,
}

/// The paged KV-cache block manager. See the module docs for its invariants.
///
/// Built once over caller storage; no operation allocates and none panics on caller input.
#[derive(Debug)]
pub struct BlockManager<'a> {
    config: Config,
    /// `log2(block_size)` when the block size is a power of two (the usual case), so
    /// token-to-block arithmetic is a shift; `u32::MAX` otherwise.
    block_shift: u32,
    pool: BlockPool<'a>,
    prefix: PrefixCache<'a>,
    seqs: SeqTable<'a>,
    prefix_hit_tokens: u64,
}

impl<'a> BlockManager<'a> {
    /// `u64` words the parts of a manager for `config` take: the sum of the pool's, the
    /// sequence table's and the prefix cache's own counts. O(1).
    pub(crate) const fn storage_words(config: &Config) -> u128 {
        BlockPool::storage_words(config)
            + SeqTable::storage_words(config)
            + PrefixCache::storage_words(config)
    }

    /// Builds a manager over `storage`, which must hold at least
    /// [`Config::storage_words`] words (its previous contents are ignored). Every block
    /// starts free, every sequence slot unused. O(storage words).
    ///
    /// # Errors
    /// [`InitError::ZeroSize`] / [`InitError::TooLarge`] from [`Config::validate`];
    /// [`InitError::StorageTooSmall`] when `storage` is too short.
    pub fn new(config: Config, storage: &'a mut [u64]) -> Result<Self, InitError> {
        config.validate()?;
        let needed = config.storage_words();
        if storage.len() < needed {
            return Err(InitError::StorageTooSmall {
                needed,
                got: storage.len(),
            });
        }
        let mut carve = Carver::new(storage);
        let manager = Self {
            config,
            block_shift: if config.block_size.is_power_of_two() {
                config.block_size.trailing_zeros()
            } else {
                u32::MAX
            },
            pool: BlockPool::new(&config, &mut carve),
            prefix: PrefixCache::new(&config, &mut carve),
            seqs: SeqTable::new(&config, &mut carve),
            prefix_hit_tokens: 0,
        };
        debug_assert_eq!(carve.taken(), needed);
        debug!("kvpage: manager with {=u32} blocks", config.num_blocks);
        Ok(manager)
    }

    /// The configuration the manager was built with. O(1).
    pub fn config(&self) -> &Config {
        &self.config
    }

    // ----- block pool -------------------------------------------------------------------

    /// Blocks an allocation can take right now, ignoring namespace quotas: free plus
    /// cached below [`crate::Priority::Pinned`] (evictable). O(1). See
    /// [`BlockManager::available_blocks_for`] with quotas.
    pub fn available_blocks(&self) -> u32 {
        self.pool.available(&self.prefix)
    }

    /// Blocks allocations for `namespace` can take right now: free blocks not reserved
    /// for other namespaces, plus the cached blocks it may evict (its own, and those of
    /// namespaces above their reservation), capped by its quota. Equals
    /// [`BlockManager::available_blocks`] without quotas. O(max_namespaces).
    pub fn available_blocks_for(&self, namespace: u64) -> u32 {
        let room = self
            .pool
            .room(self.pool.tenants.slot_of(namespace), &self.prefix);
        room.blocks.min(room.quota)
    }

    /// Checks that allocations for namespace slot `s` can take `needed` more blocks
    /// after the operation retains `taken` of the cached blocks counted as room.
    fn check_room(&self, s: usize, needed: u32, taken: u32) -> Result<(), SeqError> {
        // The common case, enough free blocks, without walking the slots for `room`.
        if needed
            .checked_add(taken)
            .is_some_and(|n| self.pool.fits_free(s, n))
        {
            return Ok(());
        }
        let room = self.pool.room(s, &self.prefix);
        let blocks = room.blocks.saturating_sub(taken);
        let allowed = room.quota.saturating_sub(taken);
        if needed > allowed && allowed < blocks {
            return Err(SeqError::QuotaExceeded { needed, allowed });
        }
        if needed > blocks {
            return Err(SeqError::OutOfBlocks {
                needed,
                available: blocks,
            });
        }
        Ok(())
    }

    /// Namespace slot of live row `i`. O(max_namespaces).
    fn slot(&self, i: usize) -> usize {
        self.pool.tenants.slot_of(self.seqs.namespace[i])
    }

    /// Evicts up to `max_blocks` cached blocks, lowest [`crate::Priority`] first and
    /// least recently cached within a priority (so a chain's deepest blocks before its
    /// first ones), never pinned ones, making them free. Returns how many were evicted.
    /// O(evicted * (max_namespaces + 1)).
    pub fn evict_cached(&mut self, max_blocks: u32) -> u32 {
        self.pool.evict(max_blocks, &mut self.prefix)
    }

    /// References to block `b` from live sequences; `None` when `b` is out of range. O(1).
    pub fn refcount(&self, b: u32) -> Option<u32> {
        self.pool.refcount(b)
    }

    /// Whether block `b` is registered in the prefix cache (always `false` with
    /// [`Config::prefix_cache`] off). O(1).
    pub fn is_registered(&self, b: u32) -> bool {
        self.prefix.is_registered(b)
    }

    /// Drops one reference to each of the blocks `from..to` of row `i`, deepest (last)
    /// first. Blocks whose count reaches zero enter the LRU list in that order, so
    /// eviction takes a chain's tail before its head: a lookup walks from the first
    /// block, and evicting a head would strand its still-cached descendants.
    fn release_blocks(&mut self, i: usize, from: usize, to: usize) {
        let row = self.seqs.row(i);
        for k in (from..to).rev() {
            self.pool
                .release(self.seqs.table[row + k], &mut self.prefix);
        }
    }

    // ----- sequences --------------------------------------------------------------------

    /// `(tokens / block_size, tokens % block_size)`: a shift for power-of-two sizes.
    #[inline]
    fn split(&self, tokens: u32) -> (u32, u32) {
        if self.block_shift != u32::MAX {
            (
                tokens >> self.block_shift,
                tokens & (self.config.block_size - 1),
            )
        } else {
            (
                tokens / self.config.block_size,
                tokens % self.config.block_size,
            )
        }
    }

    /// Blocks that hold `tokens` tokens.
    fn blocks_for(&self, tokens: u32) -> u32 {
        let (full, rest) = self.split(tokens);
        full + u32::from(rest != 0)
    }

    /// Takes free row `i` for an empty sequence in `namespace`.
    fn open_seq(&mut self, i: usize, namespace: u64) {
        self.seqs.open(i, namespace, self.prefix.root(namespace));
    }

    /// Creates an empty sequence whose blocks will be shared through the prefix cache only
    /// with sequences of the same `namespace`. O(1).
    ///
    /// # Errors
    /// [`SeqError::NoFreeSequence`] when `max_seqs` sequences are live.
    pub fn create(&mut self, namespace: u64) -> Result<SeqId, SeqError> {
        let i = self.seqs.first_free()?;
        self.open_seq(i, namespace);
        Ok(self.seqs.handle(i))
    }

    /// Creates a sequence holding the prompt `tokens`, sharing the longest run of whole
    /// leading blocks already in the prefix cache of `namespace` (verified token by token)
    /// and allocating the rest. At most `(len - 1) / block_size` blocks are reused, so at
    /// least one prompt token is always computed (none with [`Config::prefix_cache`]
    /// off). `slots[..len - reused_tokens]` receives the physical slot of each prompt
    /// token after the reused ones. The new blocks become shareable once their K/V is
    /// written and [`BlockManager::commit`]ted. O(prompt length).
    ///
    /// # Errors
    /// [`SeqError::NoFreeSequence`], [`SeqError::TooLong`], [`SeqError::OutOfBlocks`] (the
    /// cached blocks being reused do not count as available),
    /// [`SeqError::SlotBufferTooSmall`]. Nothing changes on error.
    pub fn create_with_prompt(
        &mut self,
        namespace: u64,
        tokens: &[u32],
        slots: &mut [u32],
    ) -> Result<PromptStart, SeqError> {
        self.create_with_prompt_at(namespace, Priority::Normal, tokens, slots)
    }

    /// [`BlockManager::create_with_prompt`] for a sequence of retention `priority`
    /// (see [`BlockManager::set_priority`]): the cached blocks it reuses are raised to
    /// at least `priority`, and so are the blocks it commits. O(prompt length).
    ///
    /// # Errors
    /// As [`BlockManager::create_with_prompt`], and [`SeqError::QuotaExceeded`] when
    /// the namespace's quota does not allow the new blocks. Nothing changes on error.
    pub fn create_with_prompt_at(
        &mut self,
        namespace: u64,
        priority: Priority,
        tokens: &[u32],
        slots: &mut [u32],
    ) -> Result<PromptStart, SeqError> {
        let max_tokens = self.config.max_tokens_per_seq();
        let len = tokens.len() as u64;
        if len > max_tokens {
            return Err(SeqError::TooLong {
                tokens: len,
                max_tokens,
            });
        }
        let i = self.seqs.first_free()?;
        // Look up, writing candidate block ids into the (free) row: free rows are scratch.
        let row = self.seqs.row(i);
        let (table, pool) = (&mut *self.seqs.table, &self.pool);
        let mut idle_hits = 0u32;
        let prefix = &self.prefix;
        let walk = self.prefix.walk(namespace, tokens, |k, b| {
            table[row + k] = b;
            idle_hits +=
                u32::from(pool.refcount(b) == Some(0) && prefix.priority(b) != Priority::Pinned);
        });
        let hits = walk.blocks as usize;
        let needed = self.blocks_for(len as u32) - walk.blocks;
        let slot = self.pool.tenants.slot_of(namespace);
        self.check_room(slot, needed, idle_hits)?;
        let reused = hits * self.config.block_size as usize;
        let new_tokens = tokens.len() - reused;
        if slots.len() < new_tokens {
            return Err(SeqError::SlotBufferTooSmall {
                needed: new_tokens,
                got: slots.len(),
            });
        }
        // Commit: nothing below can fail.
        self.open_seq(i, namespace);
        self.seqs.set_priority(i, priority);
        for k in 0..hits {
            let b = self.seqs.table[row + k];
            self.pool.retain(b, &mut self.prefix);
            self.raise_priority(b, priority);
        }
        self.seqs.len[i] = reused as u32;
        self.seqs.known[i] = reused as u32;
        self.seqs.committed[i] = walk.blocks;
        self.seqs.logical_tokens += reused as u64;
        self.seqs.set_chain(i, walk.end);
        self.prefix_hit_tokens += reused as u64;
        let appended = self.append_checked(i, new_tokens as u32, Some(&tokens[reused..]), slots)?;
        Ok(PromptStart {
            seq: self.seqs.handle(i),
            reused_tokens: reused as u32,
            appended,
        })
    }

    /// Creates a sequence sharing every block of `seq` (reference counts go up; nothing is
    /// copied until one of them appends into a shared partial block). O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`],
    /// [`SeqError::NoFreeSequence`].
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId, SeqError> {
        let src = self.seqs.check(seq)?;
        let dst = self.seqs.first_free()?;
        let blocks = self.blocks_for(self.seqs.len[src]) as usize;
        let (from, to) = (self.seqs.row(src), self.seqs.row(dst));
        self.seqs.table.copy_within(from..from + blocks, to);
        self.pool.share(&self.seqs.table[to..to + blocks]);
        self.seqs.open_copy(src, dst);
        Ok(self.seqs.handle(dst))
    }

    /// Shortens `seq` to `new_len` tokens (rolling back rejected speculative tokens, for
    /// example), releasing blocks no longer needed, deepest first. O(released blocks).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`],
    /// [`SeqError::BeyondLength`].
    pub fn truncate(&mut self, seq: SeqId, new_len: u32) -> Result<(), SeqError> {
        let i = self.seqs.check(seq)?;
        let len = self.seqs.len[i];
        if new_len > len {
            return Err(SeqError::BeyondLength {
                requested: new_len,
                len,
            });
        }
        self.truncate_checked(i, new_len);
        Ok(())
    }

    /// Truncation of live sequence `i` to `new_len` (at most its length): blocks, length,
    /// known and committed prefixes, position runs.
    fn truncate_checked(&mut self, i: usize, new_len: u32) {
        let len = self.seqs.len[i];
        let keep = self.blocks_for(new_len) as usize;
        self.release_blocks(i, keep, self.blocks_for(len) as usize);
        let (full, offset) = self.split(new_len);
        if offset != 0 {
            let b = self.seqs.table[self.seqs.row(i) + keep - 1];
            if self.pool.is_exclusive(b) {
                self.claim_partial(b, offset);
            }
        }
        self.seqs.len[i] = new_len;
        self.seqs.logical_tokens -= u64::from(len - new_len);
        self.seqs.known[i] = self.seqs.known[i].min(new_len);
        if self.seqs.committed[i] > full {
            self.rewind_commit(i, full as usize);
        }
        let runs = self.seqs.runs(i);
        let kept = runs.iter().filter(|r| r.first_index < new_len).count();
        self.seqs.set_run_count(i, kept.max(1) as u32);
    }

    /// Releases `seq` and its references, deepest block first; its handle (and every
    /// copy) becomes stale. Full registered blocks nobody else holds stay cached for later
    /// prefix hits. O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`] (also on a second release), [`SeqError::ForeignHandle`],
    /// [`SeqError::Swapped`] (use [`BlockManager::release_swapped`]).
    pub fn release(&mut self, seq: SeqId) -> Result<(), SeqError> {
        let i = self.seqs.check(seq)?;
        let len = self.seqs.len[i];
        self.release_blocks(i, 0, self.blocks_for(len) as usize);
        self.seqs.logical_tokens -= u64::from(len);
        self.seqs.close(i);
        Ok(())
    }

    /// Blocks of `seq` referenced by no other sequence, less the registered pinned ones
    /// (released, those stay cached and are not available): what preempting it makes
    /// available. O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`].
    pub fn exclusive_blocks(&self, seq: SeqId) -> Result<u32, SeqError> {
        let blocks = self.blocks(seq)?;
        Ok(blocks
            .iter()
            .filter(|&&b| self.pool.is_exclusive(b) && !self.prefix.stays_pinned(b))
            .count() as u32)
    }

    /// Whether any block has priority [`Priority::Pinned`] (held, cached or awaiting
    /// reuse): when none has, every exclusive block of a sequence becomes available on
    /// release. O(1).
    pub(crate) fn any_pinned(&self) -> bool {
        self.prefix.pinned_marked() > 0
    }

    /// Leading tokens of `tokens` that [`BlockManager::create_with_prompt`] would reuse
    /// from the prefix cache of `namespace` right now (whole blocks, at most
    /// `(len - 1) / block_size` of them; 0 with [`Config::prefix_cache`] off). Changes
    /// nothing. O(prompt length).
    pub fn cached_prefix_tokens(&self, namespace: u64, tokens: &[u32]) -> u32 {
        self.prefix_lookup(namespace, tokens).tokens
    }

    /// What [`BlockManager::create_with_prompt`] would reuse from the prefix cache of
    /// `namespace` for the prompt `tokens` right now: the leading tokens (as
    /// [`BlockManager::cached_prefix_tokens`]) and how many of those blocks no sequence
    /// references and are not pinned (cached, idle: they count in
    /// [`BlockManager::available_blocks`] until the new sequence takes them). Changes
    /// nothing. O(prompt length).
    pub fn prefix_lookup(&self, namespace: u64, tokens: &[u32]) -> PrefixHit {
        let mut idle_blocks = 0u32;
        let walk = self.prefix.walk(namespace, tokens, |_, b| {
            idle_blocks += u32::from(
                self.pool.refcount(b) == Some(0) && self.prefix.priority(b) != Priority::Pinned,
            );
        });
        PrefixHit {
            tokens: walk.blocks * self.config.block_size,
            idle_blocks,
        }
    }

    /// Whether the next append to `seq` copies its last block first: the block is
    /// partly filled and shared with another sequence (copy-on-write takes one more
    /// block). O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`].
    pub fn append_copies(&self, seq: SeqId) -> Result<bool, SeqError> {
        let i = self.seqs.check(seq)?;
        let (full, offset) = self.split(self.seqs.len[i]);
        if offset == 0 {
            return Ok(false);
        }
        let b = self.seqs.table[self.seqs.row(i) + full as usize];
        Ok(!self.pool.is_exclusive(b))
    }

    /// Tokens held by `seq`. O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`].
    pub fn len(&self, seq: SeqId) -> Result<u32, SeqError> {
        Ok(self.seqs.len[self.seqs.check(seq)?])
    }

    /// Physical block ids of `seq` in logical order (its row of the block table, the used
    /// part). O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`].
    pub fn blocks(&self, seq: SeqId) -> Result<&[u32], SeqError> {
        let i = self.seqs.check(seq)?;
        let row = self.seqs.row(i);
        let blocks = self.blocks_for(self.seqs.len[i]) as usize;
        Ok(&self.seqs.table[row..row + blocks])
    }

    /// The dense `max_seqs × max_blocks_per_seq` block table, row-major, row =
    /// [`SeqId::index`]: what attention kernels take, uploadable in one copy. Entries past
    /// a row's `ceil(len / block_size)` are unspecified. O(1).
    pub fn block_table(&self) -> &[u32] {
        self.seqs.table
    }

    /// Length in tokens of every row of [`BlockManager::block_table`] (0 for free rows
    /// and swapped-out sequences). O(1).
    pub fn seq_lens(&self) -> &[u32] {
        self.seqs.len
    }

    /// Counters of the pool and the sequences. O(1).
    pub fn stats(&self) -> Stats {
        let free_blocks = self.pool.free_count();
        let cached_blocks = self.prefix.lru_len();
        let used_blocks = self.config.num_blocks - free_blocks - cached_blocks;
        Stats {
            total_blocks: self.config.num_blocks,
            free_blocks,
            cached_blocks,
            used_blocks,
            token_slots: u64::from(used_blocks) * u64::from(self.config.block_size),
            tokens_stored: self.pool.tokens_stored(),
            logical_tokens: self.seqs.logical_tokens,
            blocks_saved_by_sharing: self.pool.total_refs() - u64::from(used_blocks),
            live_seqs: self.seqs.live(),
            prefix_hit_tokens: self.prefix_hit_tokens,
        }
    }
}
