//! The block manager: block pool, page tables, sequences and prefix sharing over
//! caller-provided storage.
//!
//! # Invariants that make the rest panic-free
//! - Every block is in exactly one state: *free* (in the free bitset, refcount 0, not
//!   registered), *cached* (registered, refcount 0, in the LRU list) or *used*
//!   (refcount ≥ 1). So `free + cached + used == num_blocks`.
//! - A block's refcount equals the number of block-table entries of live sequences that
//!   name it.
//! - A live sequence of length `len` owns exactly `ceil(len / block_size)` entries at the
//!   start of its row, each naming a used block; `len ≤ max_blocks_per_seq * block_size`.
//! - Its committed blocks (`seq_committed`) are full and lie within its known-id prefix
//!   (`seq_known ≤ len`); only committed blocks are ever registered.
//! - Only a block with refcount 1 and not registered is ever written: appending into a
//!   shared or registered partial block copies it first (copy-on-write) or unregisters it.
//! - Every operation checks all its preconditions (handle, lengths, buffer sizes, free
//!   blocks) before it changes anything, so a failed operation leaves no trace.
//!
//! Indices into the internal arrays come from validated handles or from the tables this
//! module writes, so indexing cannot go out of bounds.

use crate::config::{Config, U32_PER_BLOCK, U32_PER_SEQ, U64_PER_BLOCK, U64_PER_SEQ};
use crate::error::{InitError, SeqError};
use crate::host_tier::{BlockMove, HostPool};
use crate::index_set::{words_for, IndexSet};
use crate::log::{debug, trace};
use crate::prefix::{Link, PrefixCache, PrefixStorage};
use crate::stats::Stats;
use crate::storage::Carver;

const LIVE: u32 = 1;
/// The sequence's blocks are in the host tier; its row holds host block ids.
const SWAPPED: u32 = 4;

/// Handle of a live sequence: its row in the block table, the generation of that row and
/// the tag of the manager that made it. A handle whose sequence was released is stale and
/// every operation refuses it; it never reaches another sequence's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct SeqId {
    index: u32,
    generation: u32,
    instance: u32,
}

impl SeqId {
    /// Row of this sequence in [`BlockManager::block_table`] and [`BlockManager::seq_lens`].
    pub const fn index(&self) -> u32 {
        self.index
    }
    /// Generation of the row when the handle was made.
    pub const fn generation(&self) -> u32 {
        self.generation
    }
    /// Tag of the manager that made the handle ([`Config::instance`]).
    pub const fn instance(&self) -> u32 {
        self.instance
    }
    /// Rebuilds a handle from its parts (for example after crossing an FFI boundary).
    /// Safe: a forged or outdated handle is refused by every operation.
    pub const fn from_parts(index: u32, generation: u32, instance: u32) -> Self {
        Self {
            index,
            generation,
            instance,
        }
    }
}

/// A whole-block copy the backend must perform before writing the new tokens: all
/// layers' K and V of physical block `src` into physical block `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
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
    free: IndexSet<'a>,
    refcount: &'a mut [u32],
    fill: &'a mut [u32],
    prefix: PrefixCache<'a>,
    seq_free: IndexSet<'a>,
    table: &'a mut [u32],
    seq_len: &'a mut [u32],
    seq_gen: &'a mut [u32],
    seq_flags: &'a mut [u32],
    /// Length of a swapped-out sequence (its `seq_len` reads 0 meanwhile).
    seq_swapped_len: &'a mut [u32],
    /// Leading tokens whose ids are known (appended with ids): only their full blocks can
    /// enter the prefix cache.
    seq_known: &'a mut [u32],
    /// Leading full blocks already offered to the prefix cache by [`BlockManager::commit`]
    /// (registered, or found registered already); the chain fields describe the last one.
    seq_committed: &'a mut [u32],
    seq_chain_block: &'a mut [u32],
    seq_chain_gen: &'a mut [u32],
    seq_namespace: &'a mut [u64],
    seq_chain_hash: &'a mut [u64],
    total_refs: u64,
    tokens_stored: u64,
    logical_tokens: u64,
    live_seqs: u32,
    prefix_hit_tokens: u64,
}

impl<'a> BlockManager<'a> {
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
        let n = config.num_blocks as usize;
        let s = config.max_seqs as usize;
        let mut carve = Carver::new(storage);
        let free = IndexSet::new(
            carve.u32s(words_for(config.num_blocks)),
            config.num_blocks,
            true,
        );
        let seq_free = IndexSet::new(
            carve.u32s(words_for(config.max_seqs)),
            config.max_seqs,
            true,
        );
        // Keep the counts in config.rs in step with what is carved here.
        const _: () = assert!(U32_PER_BLOCK == 10 && U64_PER_BLOCK == 2);
        const _: () = assert!(U32_PER_SEQ == 8 && U64_PER_SEQ == 2);
        let refcount = carve.u32s(n);
        let fill = carve.u32s(n);
        let prefix = PrefixCache::new(
            config.block_size,
            config.hash_key,
            PrefixStorage {
                hash: carve.words(n),
                namespace: carve.words(n),
                flags: carve.u32s(n),
                parent: carve.u32s(n),
                parent_gen: carve.u32s(n),
                gen: carve.u32s(n),
                link: carve.u32s(n),
                link_gen: carve.u32s(n),
                prev: carve.u32s(n),
                next: carve.u32s(n),
                tokens: carve.u32s(n * config.block_size as usize),
                table: carve.u32s(config.hash_capacity() as usize),
            },
        );
        let table = carve.u32s(s * config.max_blocks_per_seq as usize);
        let manager = Self {
            config,
            block_shift: if config.block_size.is_power_of_two() {
                config.block_size.trailing_zeros()
            } else {
                u32::MAX
            },
            free,
            refcount,
            fill,
            prefix,
            seq_free,
            table,
            seq_len: carve.u32s(s),
            seq_gen: carve.u32s(s),
            seq_flags: carve.u32s(s),
            seq_swapped_len: carve.u32s(s),
            seq_known: carve.u32s(s),
            seq_committed: carve.u32s(s),
            seq_chain_block: carve.u32s(s),
            seq_chain_gen: carve.u32s(s),
            seq_namespace: carve.words(s),
            seq_chain_hash: carve.words(s),
            total_refs: 0,
            tokens_stored: 0,
            logical_tokens: 0,
            live_seqs: 0,
            prefix_hit_tokens: 0,
        };
        debug!("kvpage: manager with {=u32} blocks", config.num_blocks);
        Ok(manager)
    }

    /// The configuration the manager was built with. O(1).
    pub fn config(&self) -> &Config {
        &self.config
    }

    // ----- block pool -------------------------------------------------------------------

    /// Blocks an allocation can take right now: free plus cached (evictable). O(1).
    pub fn available_blocks(&self) -> u32 {
        self.free.count() + self.prefix.lru_len()
    }

    /// Takes the lowest free block, or evicts the least recently used cached block when
    /// no free one is left. Precondition: `available_blocks() > 0`.
    fn alloc_block(&mut self) -> u32 {
        let b = match self.free.pop_first() {
            Some(b) => b,
            None => {
                let b = self.prefix.lru_pop_front().unwrap_or(0);
                debug_assert!(self.prefix.is_registered(b));
                self.prefix.unregister(b);
                b
            }
        };
        trace!("kvpage: alloc block {=u32}", b);
        self.prefix.clear(b);
        self.refcount[b as usize] = 1;
        self.fill[b as usize] = 0;
        self.total_refs += 1;
        b
    }

    /// Adds a reference to a used or cached block.
    fn retain_block(&mut self, b: u32) {
        let i = b as usize;
        if self.refcount[i] == 0 {
            self.prefix.lru_remove(b);
            self.tokens_stored += u64::from(self.fill[i]);
        }
        self.refcount[i] += 1;
        self.total_refs += 1;
    }

    /// Drops one reference to each of the blocks `from..to` of the row starting at `row`,
    /// deepest (last) first. Blocks whose count reaches zero enter the LRU list in that
    /// order, so eviction takes a chain's tail before its head: a lookup walks from the
    /// first block, and evicting a head would strand its still-cached descendants.
    fn release_row_blocks(&mut self, row: usize, from: usize, to: usize) {
        for k in (from..to).rev() {
            self.release_block(self.table[row + k]);
        }
    }

    /// Drops a reference; at zero the block becomes cached (if registered) or free.
    fn release_block(&mut self, b: u32) {
        let i = b as usize;
        self.refcount[i] -= 1;
        self.total_refs -= 1;
        if self.refcount[i] == 0 {
            self.tokens_stored -= u64::from(self.fill[i]);
            if self.prefix.is_registered(b) {
                self.prefix.lru_push_back(b);
            } else {
                self.fill[i] = 0;
                self.prefix.clear(b);
                self.free.insert(b);
            }
        }
    }

    /// Sets the stored-token count of a used block.
    fn set_fill(&mut self, b: u32, fill: u32) {
        let i = b as usize;
        self.tokens_stored = self.tokens_stored + u64::from(fill) - u64::from(self.fill[i]);
        self.fill[i] = fill;
    }

    /// Evicts up to `max_blocks` cached blocks, least recently used first, making them
    /// free. Returns how many were evicted. O(evicted).
    pub fn evict_cached(&mut self, max_blocks: u32) -> u32 {
        let mut evicted = 0;
        while evicted < max_blocks {
            let Some(b) = self.prefix.lru_pop_front() else {
                break;
            };
            self.prefix.unregister(b);
            self.prefix.clear(b);
            self.fill[b as usize] = 0;
            self.free.insert(b);
            evicted += 1;
        }
        evicted
    }

    /// References to block `b` from live sequences; `None` when `b` is out of range. O(1).
    pub fn refcount(&self, b: u32) -> Option<u32> {
        self.refcount.get(b as usize).copied()
    }

    /// Whether block `b` is registered in the prefix cache. O(1).
    pub fn is_registered(&self, b: u32) -> bool {
        b < self.config.num_blocks && self.prefix.is_registered(b)
    }

    // ----- sequences --------------------------------------------------------------------

    /// Index of live sequence `seq`, in either residency.
    fn check_any(&self, seq: SeqId) -> Result<usize, SeqError> {
        if seq.instance != self.config.instance {
            return Err(SeqError::ForeignHandle);
        }
        let i = seq.index as usize;
        match (self.seq_flags.get(i), self.seq_gen.get(i)) {
            (Some(&flags), Some(&gen)) if flags & LIVE != 0 && gen == seq.generation => Ok(i),
            _ => Err(SeqError::StaleHandle),
        }
    }

    /// Index of live, device-resident sequence `seq`.
    fn check(&self, seq: SeqId) -> Result<usize, SeqError> {
        let i = self.check_any(seq)?;
        if self.seq_flags[i] & SWAPPED != 0 {
            return Err(SeqError::Swapped);
        }
        Ok(i)
    }

    /// Index of live, swapped-out sequence `seq`, checking `host` belongs to this manager.
    fn check_swapped(&self, seq: SeqId, host: &HostPool<'_>) -> Result<usize, SeqError> {
        let i = self.check_any(seq)?;
        if host.instance() != self.config.instance {
            return Err(SeqError::ForeignHandle);
        }
        if self.seq_flags[i] & SWAPPED == 0 {
            return Err(SeqError::NotSwapped);
        }
        Ok(i)
    }

    fn handle(&self, i: usize) -> SeqId {
        SeqId {
            index: i as u32,
            generation: self.seq_gen[i],
            instance: self.config.instance,
        }
    }

    /// `(tokens / block_size, tokens % block_size)`: a shift for power-of-two sizes.
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

    fn row(&self, i: usize) -> usize {
        i * self.config.max_blocks_per_seq as usize
    }

    /// Takes a sequence slot and sets it up empty in `namespace`.
    fn open_seq(&mut self, i: usize, namespace: u64) {
        self.seq_free.remove(i as u32);
        self.seq_len[i] = 0;
        self.seq_flags[i] = LIVE;
        self.seq_known[i] = 0;
        self.seq_committed[i] = 0;
        self.seq_namespace[i] = namespace;
        self.seq_chain_hash[i] = self.prefix.hasher.root(namespace);
        self.seq_chain_block[i] = Link::ROOT.block;
        self.seq_chain_gen[i] = Link::ROOT.gen;
        self.live_seqs += 1;
    }

    /// Creates an empty sequence whose blocks will be shared through the prefix cache only
    /// with sequences of the same `namespace`. O(1).
    ///
    /// # Errors
    /// [`SeqError::NoFreeSequence`] when `max_seqs` sequences are live.
    pub fn create(&mut self, namespace: u64) -> Result<SeqId, SeqError> {
        let i = self.seq_free.first().ok_or(SeqError::NoFreeSequence)? as usize;
        self.open_seq(i, namespace);
        Ok(self.handle(i))
    }

    /// Creates a sequence holding the prompt `tokens`, sharing the longest run of whole
    /// leading blocks already in the prefix cache of `namespace` (verified token by token)
    /// and allocating the rest. At most `(len - 1) / block_size` blocks are reused, so at
    /// least one prompt token is always computed. `slots[..len - reused_tokens]` receives
    /// the physical slot of each prompt token after the reused ones. The new blocks
    /// become shareable once their K/V is written and [`BlockManager::commit`]ted.
    /// O(prompt length).
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
        let max_tokens = self.config.max_tokens_per_seq();
        let len = tokens.len() as u64;
        if len > max_tokens {
            return Err(SeqError::TooLong {
                tokens: len,
                max_tokens,
            });
        }
        let i = self.seq_free.first().ok_or(SeqError::NoFreeSequence)? as usize;
        // Look up, writing candidate block ids into the (free) row: free rows are scratch.
        let row = self.row(i);
        let (table, refcount) = (&mut *self.table, &*self.refcount);
        let mut idle_hits = 0u32;
        let walk = self.prefix.walk(namespace, tokens, |k, b| {
            table[row + k] = b;
            idle_hits += u32::from(refcount[b as usize] == 0);
        });
        let (hits, hash, parent) = (walk.blocks as usize, walk.hash, walk.last);
        let bs = self.config.block_size as usize;
        let needed = self.blocks_for(len as u32) - hits as u32;
        let available = self.available_blocks() - idle_hits;
        if needed > available {
            return Err(SeqError::OutOfBlocks { needed, available });
        }
        let reused = hits * bs;
        let new_tokens = tokens.len() - reused;
        if slots.len() < new_tokens {
            return Err(SeqError::SlotBufferTooSmall {
                needed: new_tokens,
                got: slots.len(),
            });
        }
        // Commit: nothing below can fail.
        self.open_seq(i, namespace);
        for k in 0..hits {
            let b = self.table[row + k];
            self.retain_block(b);
        }
        self.seq_len[i] = reused as u32;
        self.seq_known[i] = reused as u32;
        self.seq_committed[i] = hits as u32;
        self.logical_tokens += reused as u64;
        self.seq_chain_hash[i] = hash;
        self.seq_chain_block[i] = parent.block;
        self.seq_chain_gen[i] = parent.gen;
        self.prefix_hit_tokens += reused as u64;
        let appended = self.append_checked(i, new_tokens as u32, Some(&tokens[reused..]), slots)?;
        Ok(PromptStart {
            seq: self.handle(i),
            reused_tokens: reused as u32,
            appended,
        })
    }

    /// Appends `n` tokens whose ids are not known: allocates blocks as needed and writes
    /// the physical slot (`block * block_size + offset`) of each new token into
    /// `slots[..n]`. Blocks holding such tokens never enter the prefix cache, nor do later
    /// ones of this sequence (until it is truncated back before them). O(n) plus O(1) per
    /// new block.
    ///
    /// # Errors
    /// As [`BlockManager::append_tokens`].
    pub fn append(&mut self, seq: SeqId, n: u32, slots: &mut [u32]) -> Result<Appended, SeqError> {
        let i = self.check(seq)?;
        if n == 1 && self.append_one_in_place(i, None, slots) {
            return Ok(Appended::default());
        }
        self.append_checked(i, n, None, slots)
    }

    /// Appends `tokens`: like [`BlockManager::append`], and the ids are kept so that full
    /// blocks can enter the prefix cache once [`BlockManager::commit`] says their K/V is
    /// written. If the last block is partly filled and shared (after a fork or a prefix
    /// hit), it is copied first and the copy is returned: the backend must execute it
    /// before writing. O(n).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::TooLong`] past
    /// `max_blocks_per_seq`, [`SeqError::OutOfBlocks`], [`SeqError::SlotBufferTooSmall`].
    /// Nothing changes on error.
    pub fn append_tokens(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        slots: &mut [u32],
    ) -> Result<Appended, SeqError> {
        let i = self.check(seq)?;
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
    fn append_checked(
        &mut self,
        i: usize,
        n: u32,
        ids: Option<&[u32]>,
        slots: &mut [u32],
    ) -> Result<Appended, SeqError> {
        let bs = self.config.block_size;
        let len = self.seq_len[i];
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
        let (full_blocks, offset) = self.split(len);
        let old_blocks = (full_blocks + u32::from(offset != 0)) as usize;
        let grow = self.blocks_for(new_len as u32) - old_blocks as u32;
        let row = self.row(i);
        let partial = if offset != 0 && n > 0 {
            Some(self.table[row + old_blocks - 1])
        } else {
            None
        };
        let cow = partial.is_some_and(|b| self.refcount[b as usize] > 1);
        let needed = grow + u32::from(cow);
        let available = self.available_blocks();
        if needed > available {
            return Err(SeqError::OutOfBlocks { needed, available });
        }

        // Commit: nothing below can fail.
        let mut copy = None;
        if let Some(last) = partial {
            if cow {
                let dst = self.alloc_block();
                self.prefix.copy_tokens(last, dst, offset);
                self.set_fill(dst, offset);
                self.release_block(last);
                self.table[row + old_blocks - 1] = dst;
                copy = Some(BlockCopy { src: last, dst });
            } else if self.prefix.is_tracked(last) || self.fill[last as usize] != offset {
                self.claim_partial(last, offset);
            }
        }
        let mut block_index = full_blocks as usize;
        let mut off = offset;
        for (k, slot) in slots[..n as usize].iter_mut().enumerate() {
            if off == 0 {
                let b = self.alloc_block();
                self.table[row + block_index] = b;
            }
            let b = self.table[row + block_index];
            *slot = b * bs + off;
            if let Some(ids) = ids {
                self.prefix.tokens_mut(b)[off as usize] = ids[k];
            }
            if off + 1 > self.fill[b as usize] {
                self.set_fill(b, off + 1);
            }
            off += 1;
            if off == bs {
                off = 0;
                block_index += 1;
            }
        }
        if ids.is_some() && self.seq_known[i] == len {
            self.seq_known[i] = new_len as u32;
        }
        self.seq_len[i] = new_len as u32;
        self.logical_tokens += u64::from(n);
        Ok(Appended {
            copy,
            new_blocks: grow,
        })
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
        let len = self.seq_len[i];
        let (full, offset) = self.split(len);
        if offset == 0 {
            return false;
        }
        let b = self.table[self.row(i) + full as usize];
        let bi = b as usize;
        if self.refcount[bi] != 1 || self.fill[bi] != offset || self.prefix.is_tracked(b) {
            return false;
        }
        *slot = b * self.config.block_size + offset;
        if let Some(id) = id {
            self.prefix.tokens_mut(b)[offset as usize] = id;
            if self.seq_known[i] == len {
                self.seq_known[i] = len + 1;
            }
        }
        self.fill[bi] = offset + 1;
        self.tokens_stored += 1;
        self.seq_len[i] = len + 1;
        self.logical_tokens += 1;
        true
    }

    /// Makes exclusively held block `b` writable from token `offset` on: it leaves the
    /// prefix cache (its content is about to change) and stores `offset` tokens.
    fn claim_partial(&mut self, b: u32, offset: u32) {
        if self.prefix.is_registered(b) {
            self.prefix.unregister(b);
        }
        self.prefix.clear(b);
        self.set_fill(b, offset);
    }

    /// Hashes full block `b`, the next uncommitted one of sequence `i`, and registers it
    /// unless an identical one is registered already. Returns whether the sequence's chain
    /// is still intact (it breaks when the previous block's representative was evicted).
    fn commit_block(&mut self, i: usize, b: u32) -> bool {
        let namespace = self.seq_namespace[i];
        let parent = Link {
            block: self.seq_chain_block[i],
            gen: self.seq_chain_gen[i],
        };
        let tokens = self.prefix.tokens(b);
        let hash = self
            .prefix
            .hasher
            .chain(self.seq_chain_hash[i], namespace, tokens);
        let link = if self.prefix.is_registered(b) {
            // Committed already by a sequence sharing it (a fork): it represents itself.
            self.prefix.link_of(b)
        } else {
            match self.prefix.find(hash, namespace, parent, tokens) {
                Some(existing) => self.prefix.link_of(existing),
                None if self.prefix.link_alive(parent) => {
                    self.prefix.register(b, hash, namespace, parent)
                }
                // The previous block's representative left the cache: the chain is broken.
                None => return false,
            }
        };
        self.prefix.set_hashed(b, hash, link);
        self.seq_chain_hash[i] = hash;
        self.seq_chain_block[i] = link.block;
        self.seq_chain_gen[i] = link.gen;
        true
    }

    /// Creates a sequence sharing every block of `seq` (reference counts go up; nothing is
    /// copied until one of them appends into a shared partial block). O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::NoFreeSequence`].
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId, SeqError> {
        let src = self.check(seq)?;
        let dst = self.seq_free.first().ok_or(SeqError::NoFreeSequence)? as usize;
        self.seq_free.remove(dst as u32);
        let len = self.seq_len[src];
        let blocks = self.blocks_for(len) as usize;
        let (from, to) = (self.row(src), self.row(dst));
        self.table.copy_within(from..from + blocks, to);
        for k in 0..blocks {
            let b = self.table[to + k];
            self.refcount[b as usize] += 1;
        }
        self.total_refs += blocks as u64;
        self.seq_len[dst] = len;
        self.seq_flags[dst] = self.seq_flags[src];
        self.seq_known[dst] = self.seq_known[src];
        self.seq_committed[dst] = self.seq_committed[src];
        self.seq_namespace[dst] = self.seq_namespace[src];
        self.seq_chain_hash[dst] = self.seq_chain_hash[src];
        self.seq_chain_block[dst] = self.seq_chain_block[src];
        self.seq_chain_gen[dst] = self.seq_chain_gen[src];
        self.logical_tokens += u64::from(len);
        self.live_seqs += 1;
        Ok(self.handle(dst))
    }

    /// Shortens `seq` to `new_len` tokens (rolling back rejected speculative tokens, for
    /// example), releasing blocks no longer needed. O(released blocks).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::BeyondLength`].
    pub fn truncate(&mut self, seq: SeqId, new_len: u32) -> Result<(), SeqError> {
        let i = self.check(seq)?;
        let len = self.seq_len[i];
        if new_len > len {
            return Err(SeqError::BeyondLength {
                requested: new_len,
                len,
            });
        }
        let keep = self.blocks_for(new_len) as usize;
        let old = self.blocks_for(len) as usize;
        let row = self.row(i);
        self.release_row_blocks(row, keep, old);
        let (full, offset) = self.split(new_len);
        let full = full as usize;
        if offset != 0 {
            let b = self.table[row + keep - 1];
            if self.refcount[b as usize] == 1 {
                self.claim_partial(b, offset);
            }
        }
        self.seq_len[i] = new_len;
        self.logical_tokens -= u64::from(len - new_len);
        self.seq_known[i] = self.seq_known[i].min(new_len);
        if self.seq_committed[i] as usize > full {
            self.rewind_commit(i, full);
        }
        Ok(())
    }

    /// Sets the committed prefix of sequence `i` back to its first `blocks` blocks.
    fn rewind_commit(&mut self, i: usize, blocks: usize) {
        let row = self.row(i);
        let chain = match blocks {
            0 => None,
            k => self.prefix.hashed(self.table[row + k - 1]),
        };
        // Committed blocks keep their hash; without it, start over from the first block
        // (committing again finds the registered blocks, so nothing is lost).
        let (blocks, hash, link) = match chain {
            Some((hash, link)) => (blocks, hash, link),
            None => (
                0,
                self.prefix.hasher.root(self.seq_namespace[i]),
                Link::ROOT,
            ),
        };
        self.seq_committed[i] = blocks as u32;
        self.seq_chain_hash[i] = hash;
        self.seq_chain_block[i] = link.block;
        self.seq_chain_gen[i] = link.gen;
    }

    /// Declares that the K/V of the first `computed_tokens` tokens of `seq` is written:
    /// their full blocks whose token ids are known become shareable through the prefix
    /// cache of the sequence's namespace (a block identical to one registered already is
    /// linked to it instead). Until then no other sequence can hit them, so nobody reads
    /// K/V that is not there yet. Returns the blocks committed by this call.
    /// O(block_size) per newly committed block; committing the same tokens again is O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`],
    /// [`SeqError::BeyondLength`] when `computed_tokens` exceeds the length.
    pub fn commit(&mut self, seq: SeqId, computed_tokens: u32) -> Result<u32, SeqError> {
        let i = self.check(seq)?;
        let len = self.seq_len[i];
        if computed_tokens > len {
            return Err(SeqError::BeyondLength {
                requested: computed_tokens,
                len,
            });
        }
        let (target, _) = self.split(computed_tokens.min(self.seq_known[i]));
        let row = self.row(i);
        let start = self.seq_committed[i];
        let mut k = start;
        while k < target && self.commit_block(i, self.table[row + k as usize]) {
            k += 1;
        }
        self.seq_committed[i] = k;
        Ok(k.saturating_sub(start))
    }

    /// Releases `seq` and its references; its handle (and every copy) becomes stale.
    /// Full registered blocks nobody else holds stay cached for later prefix hits.
    /// O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`] (also on a second release), [`SeqError::ForeignHandle`],
    /// [`SeqError::Swapped`] (use [`BlockManager::release_swapped`]).
    pub fn release(&mut self, seq: SeqId) -> Result<(), SeqError> {
        let i = self.check(seq)?;
        let blocks = self.blocks_for(self.seq_len[i]) as usize;
        self.release_row_blocks(self.row(i), 0, blocks);
        self.logical_tokens -= u64::from(self.seq_len[i]);
        self.close_seq(i);
        Ok(())
    }

    /// Frees the slot of sequence `i`, whose blocks are already released.
    fn close_seq(&mut self, i: usize) {
        self.seq_len[i] = 0;
        self.seq_flags[i] = 0;
        self.seq_gen[i] = self.seq_gen[i].wrapping_add(1);
        self.seq_free.insert(i as u32);
        self.live_seqs -= 1;
    }

    /// Moves `seq` to the host tier: each of its blocks gets a host block, the pairs
    /// `(device, host)` are written to `moves[..blocks]` for the backend to copy, and the
    /// device references are dropped (registered blocks stay cached on the device). The
    /// handle stays valid; until [`BlockManager::swap_in`] every other operation on it
    /// returns [`SeqError::Swapped`] and its row of the block table reads length 0.
    /// O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`] (also for another
    /// manager's host pool), [`SeqError::Swapped`], [`SeqError::HostFull`],
    /// [`SeqError::MoveBufferTooSmall`]. Nothing changes on error.
    pub fn swap_out(
        &mut self,
        seq: SeqId,
        host: &mut HostPool<'_>,
        moves: &mut [BlockMove],
    ) -> Result<u32, SeqError> {
        let i = self.check(seq)?;
        if host.instance() != self.config.instance {
            return Err(SeqError::ForeignHandle);
        }
        let len = self.seq_len[i];
        let blocks = self.blocks_for(len);
        if host.free_blocks() < blocks {
            return Err(SeqError::HostFull {
                needed: blocks,
                available: host.free_blocks(),
            });
        }
        if moves.len() < blocks as usize {
            return Err(SeqError::MoveBufferTooSmall {
                needed: blocks as usize,
                got: moves.len(),
            });
        }
        let row = self.row(i);
        self.release_row_blocks(row, 0, blocks as usize);
        for (k, m) in moves[..blocks as usize].iter_mut().enumerate() {
            let b = self.table[row + k];
            let h = host.take();
            *m = BlockMove { from: b, to: h };
            self.table[row + k] = h;
        }
        self.seq_swapped_len[i] = len;
        self.seq_len[i] = 0;
        self.logical_tokens -= u64::from(len);
        self.seq_flags[i] |= SWAPPED;
        // The blocks come back as fresh copies the prefix cache knows nothing about.
        self.seq_known[i] = 0;
        self.rewind_commit(i, 0);
        Ok(blocks)
    }

    /// Brings swapped-out `seq` back: allocates a device block per host block, writes the
    /// pairs `(host, device)` to `moves[..blocks]` for the backend to copy, and frees the
    /// host blocks. The blocks come back unshared and unregistered, and the sequence's
    /// later blocks are not registered in the prefix cache. O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::NotSwapped`],
    /// [`SeqError::OutOfBlocks`], [`SeqError::MoveBufferTooSmall`]. Nothing changes on
    /// error.
    pub fn swap_in(
        &mut self,
        seq: SeqId,
        host: &mut HostPool<'_>,
        moves: &mut [BlockMove],
    ) -> Result<u32, SeqError> {
        let i = self.check_swapped(seq, host)?;
        let len = self.seq_swapped_len[i];
        let blocks = self.blocks_for(len);
        let available = self.available_blocks();
        if blocks > available {
            return Err(SeqError::OutOfBlocks {
                needed: blocks,
                available,
            });
        }
        if moves.len() < blocks as usize {
            return Err(SeqError::MoveBufferTooSmall {
                needed: blocks as usize,
                got: moves.len(),
            });
        }
        let row = self.row(i);
        let bs = self.config.block_size;
        for (k, m) in moves[..blocks as usize].iter_mut().enumerate() {
            let h = self.table[row + k];
            let b = self.alloc_block();
            *m = BlockMove { from: h, to: b };
            self.table[row + k] = b;
            host.give_back(h);
            self.set_fill(b, (len - k as u32 * bs).min(bs));
        }
        self.seq_len[i] = len;
        self.logical_tokens += u64::from(len);
        self.seq_flags[i] &= !SWAPPED;
        Ok(blocks)
    }

    /// Releases a swapped-out sequence, returning its host blocks. O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::NotSwapped`].
    pub fn release_swapped(&mut self, seq: SeqId, host: &mut HostPool<'_>) -> Result<(), SeqError> {
        let i = self.check_swapped(seq, host)?;
        let row = self.row(i);
        for k in 0..self.blocks_for(self.seq_swapped_len[i]) as usize {
            host.give_back(self.table[row + k]);
        }
        self.seq_swapped_len[i] = 0;
        self.close_seq(i);
        Ok(())
    }

    /// Whether `seq` is swapped out. O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`].
    pub fn is_swapped(&self, seq: SeqId) -> Result<bool, SeqError> {
        Ok(self.seq_flags[self.check_any(seq)?] & SWAPPED != 0)
    }

    /// Blocks of `seq` referenced by no other sequence: what preempting it frees.
    /// O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`].
    pub fn exclusive_blocks(&self, seq: SeqId) -> Result<u32, SeqError> {
        let blocks = self.blocks(seq)?;
        Ok(blocks
            .iter()
            .filter(|&&b| self.refcount[b as usize] == 1)
            .count() as u32)
    }

    /// Leading tokens of `tokens` that [`BlockManager::create_with_prompt`] would reuse
    /// from the prefix cache of `namespace` right now (whole blocks, at most
    /// `(len - 1) / block_size` of them). Changes nothing. O(prompt length).
    pub fn cached_prefix_tokens(&self, namespace: u64, tokens: &[u32]) -> u32 {
        self.prefix.walk(namespace, tokens, |_, _| {}).blocks * self.config.block_size
    }

    /// Tokens held by `seq`. O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`].
    pub fn len(&self, seq: SeqId) -> Result<u32, SeqError> {
        Ok(self.seq_len[self.check(seq)?])
    }

    /// Physical block ids of `seq` in logical order (its row of the block table, the used
    /// part). O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`].
    pub fn blocks(&self, seq: SeqId) -> Result<&[u32], SeqError> {
        let i = self.check(seq)?;
        let row = self.row(i);
        let blocks = self.blocks_for(self.seq_len[i]) as usize;
        Ok(&self.table[row..row + blocks])
    }

    /// The dense `max_seqs × max_blocks_per_seq` block table, row-major, row =
    /// [`SeqId::index`]: what attention kernels take, uploadable in one copy. Entries past
    /// a row's `ceil(len / block_size)` are unspecified. O(1).
    pub fn block_table(&self) -> &[u32] {
        self.table
    }

    /// Length in tokens of every row of [`BlockManager::block_table`] (0 for free rows).
    /// O(1).
    pub fn seq_lens(&self) -> &[u32] {
        self.seq_len
    }

    /// Counters of the pool and the sequences. O(1).
    pub fn stats(&self) -> Stats {
        let free_blocks = self.free.count();
        let cached_blocks = self.prefix.lru_len();
        let used_blocks = self.config.num_blocks - free_blocks - cached_blocks;
        Stats {
            total_blocks: self.config.num_blocks,
            free_blocks,
            cached_blocks,
            used_blocks,
            token_slots: u64::from(used_blocks) * u64::from(self.config.block_size),
            tokens_stored: self.tokens_stored,
            logical_tokens: self.logical_tokens,
            blocks_saved_by_sharing: self.total_refs - u64::from(used_blocks),
            live_seqs: self.live_seqs,
            prefix_hit_tokens: self.prefix_hit_tokens,
        }
    }
}
