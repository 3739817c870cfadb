//! The block pool: which blocks are free, how many references each has and how many
//! tokens each stores.
//!
//! A block is *free* (in the bitset, refcount 0, unknown to the prefix cache), *cached*
//! (registered in the prefix cache, refcount 0, in its LRU list) or *used* (refcount ≥ 1).
//! The pool moves blocks between these states; the prefix cache it is handed keeps the
//! registration and the LRU list.

use crate::config::Config;
use crate::index_set::{words_for, IndexSet};
use crate::log::trace;
use crate::prefix::PrefixCache;
use crate::storage::{u32_words, Carver};

/// Free bitset, reference counts and fill counts of every block, and the totals derived
/// from them. Invariants: `total_refs` is the sum of the reference counts and
/// `tokens_stored` the sum of the fill counts of used blocks.
#[derive(Debug)]
pub(crate) struct BlockPool<'a> {
    free: IndexSet<'a>,
    refcount: &'a mut [u32],
    fill: &'a mut [u32],
    total_refs: u64,
    tokens_stored: u64,
}

impl<'a> BlockPool<'a> {
    /// `u64` words the pool of `config` takes: the free bitset and two `u32` per block.
    /// O(log num_blocks).
    pub(crate) const fn storage_words(config: &Config) -> u128 {
        let n = config.num_blocks as u128;
        u32_words(words_for(config.num_blocks) as u128) + 2 * u32_words(n)
    }

    /// Carves a pool with every block free. O(storage words).
    pub(crate) fn new(config: &Config, carve: &mut Carver<'a>) -> Self {
        let start = carve.taken();
        let n = config.num_blocks as usize;
        let pool = Self {
            free: IndexSet::new(
                carve.u32s(words_for(config.num_blocks)),
                config.num_blocks,
                true,
            ),
            refcount: carve.u32s(n),
            fill: carve.u32s(n),
            total_refs: 0,
            tokens_stored: 0,
        };
        debug_assert_eq!((carve.taken() - start) as u128, Self::storage_words(config));
        pool
    }

    /// Free blocks (not counting cached ones). O(1).
    #[inline]
    pub(crate) fn free_count(&self) -> u32 {
        self.free.count()
    }

    /// Blocks an allocation can take: free plus cached (evictable). O(1).
    #[inline]
    pub(crate) fn available(&self, prefix: &PrefixCache<'_>) -> u32 {
        self.free.count() + prefix.lru_len()
    }

    /// References to block `b`; `None` out of range. O(1).
    #[inline]
    pub(crate) fn refcount(&self, b: u32) -> Option<u32> {
        self.refcount.get(b as usize).copied()
    }

    /// Whether `b` is referenced by exactly one sequence (so that one may write it).
    #[inline]
    pub(crate) fn is_exclusive(&self, b: u32) -> bool {
        self.refcount[b as usize] == 1
    }

    /// Tokens stored in block `b`. O(1).
    #[inline]
    pub(crate) fn fill(&self, b: u32) -> u32 {
        self.fill[b as usize]
    }

    /// Sum of all reference counts. O(1).
    #[inline]
    pub(crate) fn total_refs(&self) -> u64 {
        self.total_refs
    }

    /// Tokens stored in used blocks. O(1).
    #[inline]
    pub(crate) fn tokens_stored(&self) -> u64 {
        self.tokens_stored
    }

    /// Takes the lowest free block, or evicts the least recently used cached block when
    /// no free one is left; the block comes back used (one reference), empty and unknown
    /// to the prefix cache. Precondition: `available(prefix) > 0`. O(1) amortized.
    #[inline]
    pub(crate) fn alloc(&mut self, prefix: &mut PrefixCache<'_>) -> u32 {
        let b = match self.free.pop_first() {
            Some(b) => b,
            None => {
                let b = prefix.lru_pop_front().unwrap_or(0);
                debug_assert!(prefix.is_registered(b));
                prefix.unregister(b);
                b
            }
        };
        trace!("kvpage: alloc block {=u32}", b);
        prefix.clear(b);
        self.refcount[b as usize] = 1;
        self.fill[b as usize] = 0;
        self.total_refs += 1;
        b
    }

    /// Adds a reference to a used or cached block (a cached one leaves the LRU list).
    /// O(1).
    #[inline]
    pub(crate) fn retain(&mut self, b: u32, prefix: &mut PrefixCache<'_>) {
        let i = b as usize;
        if self.refcount[i] == 0 {
            prefix.lru_remove(b);
            self.tokens_stored += u64::from(self.fill[i]);
        }
        self.refcount[i] += 1;
        self.total_refs += 1;
    }

    /// Adds a reference to each of `blocks`, all used (a fork). O(blocks).
    pub(crate) fn share(&mut self, blocks: &[u32]) {
        for &b in blocks {
            self.refcount[b as usize] += 1;
        }
        self.total_refs += blocks.len() as u64;
    }

    /// Drops a reference; at zero the block becomes cached (if registered: it enters the
    /// LRU list as most recently used) or free. O(1).
    #[inline]
    pub(crate) fn release(&mut self, b: u32, prefix: &mut PrefixCache<'_>) {
        let i = b as usize;
        self.refcount[i] -= 1;
        self.total_refs -= 1;
        if self.refcount[i] == 0 {
            self.tokens_stored -= u64::from(self.fill[i]);
            if prefix.is_registered(b) {
                prefix.lru_push_back(b);
            } else {
                self.make_free(b, prefix);
            }
        }
    }

    /// Evicts up to `max_blocks` cached blocks, least recently used first, making them
    /// free. Returns how many were evicted. O(evicted).
    pub(crate) fn evict(&mut self, max_blocks: u32, prefix: &mut PrefixCache<'_>) -> u32 {
        let mut evicted = 0;
        while evicted < max_blocks {
            let Some(b) = prefix.lru_pop_front() else {
                break;
            };
            prefix.unregister(b);
            self.make_free(b, prefix);
            evicted += 1;
        }
        evicted
    }

    /// Returns unreferenced, unregistered block `b` to the free set.
    fn make_free(&mut self, b: u32, prefix: &mut PrefixCache<'_>) {
        self.fill[b as usize] = 0;
        prefix.clear(b);
        self.free.insert(b);
    }

    /// Sets the stored-token count of used block `b`. O(1).
    #[inline]
    pub(crate) fn set_fill(&mut self, b: u32, fill: u32) {
        let i = b as usize;
        self.tokens_stored = self.tokens_stored + u64::from(fill) - u64::from(self.fill[i]);
        self.fill[i] = fill;
    }
}
