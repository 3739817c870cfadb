//! The prefix cache's registered blocks one at a time, for a backend that saves the
//! prefix cache at shutdown and loads it into a later run: reading a registered block's
//! key (namespace, parent, token ids, priority), and registering a block from such a
//! key into a free block whose K/V the backend writes before anything can hit it.
//!
//! The hash of an imported block is computed here from its parent and its token ids,
//! never taken from outside, and a hit still verifies the namespace, the parent link and
//! every token id: a damaged or forged file can waste blocks but never make a lookup
//! serve a block under other tokens.

use super::BlockManager;
use crate::error::ImportError;
use crate::prefix::Link;
use crate::retention::Priority;

/// A block of the prefix cache as [`BlockManager::registered_block`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisteredBlock<'m> {
    /// The namespace whose prompts may hit it.
    pub namespace: u64,
    /// The registered block before it in its chain; `None` for a chain's first block.
    pub parent: Option<u32>,
    /// Its chain hash (stable for one [`crate::Config::hash_key`] on every run and
    /// machine).
    pub hash: u64,
    /// The parent's chain hash (the namespace's seed for a first block).
    pub parent_hash: u64,
    /// Its `block_size` token ids.
    pub tokens: &'m [u32],
    /// Its retention priority.
    pub priority: Priority,
    /// No sequence holds it (it waits in the eviction lists).
    pub cached: bool,
}

/// A block [`BlockManager::import_block`] registered or found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Imported {
    /// The physical block holding that content.
    pub block: u32,
    /// `true`: a free block was registered and the caller must now write its K/V;
    /// `false`: an identical block was registered already (write nothing).
    pub fresh: bool,
}

impl BlockManager<'_> {
    /// Block `block` as the prefix cache knows it, when it is registered and its parent
    /// still is (a block whose parent left the cache can never be hit again and is
    /// reported as `None`, like unregistered and out-of-range blocks). Walking the
    /// blocks with a `Some` answer and following `parent` gives every reachable chain.
    /// O(1).
    pub fn registered_block(&self, block: u32) -> Option<RegisteredBlock<'_>> {
        if block >= self.config.num_blocks || !self.prefix.is_registered(block) {
            return None;
        }
        let (namespace, hash, parent) = self.prefix.key_of(block);
        let (parent, parent_hash) = match parent {
            Link::ROOT => (None, self.prefix.hasher.root(namespace)),
            p if self.prefix.link_alive(p) => (Some(p.block), self.prefix.key_of(p.block).1),
            _ => return None,
        };
        Some(RegisteredBlock {
            namespace,
            parent,
            hash,
            parent_hash,
            tokens: self.prefix.tokens(block),
            priority: self.prefix.priority(block),
            cached: self.pool.refcount(block) == Some(0),
        })
    }

    /// Registers a full block of `namespace` with `tokens` after `parent` (a registered
    /// block of the same namespace, `None` to start a chain) at `priority`, taking a
    /// free block (an import never evicts). The new block is cached (no sequence holds
    /// it) and listed as *least* recently used, so imported chains yield to live
    /// traffic and, imported parent first, lose their deepest blocks first. The caller
    /// writes its K/V before the next lookup. If an identical block is registered
    /// already, that one is returned (`fresh: false`) and raised to at least
    /// `priority`. O(block_size) expected.
    ///
    /// # Errors
    /// [`ImportError::PrefixCacheOff`], [`ImportError::WrongTokenCount`],
    /// [`ImportError::BadParent`], [`ImportError::QuotaExceeded`] (the namespace's
    /// limit), [`ImportError::OutOfBlocks`] (no free block the namespace may take).
    /// Nothing changes on error.
    pub fn import_block(
        &mut self,
        namespace: u64,
        parent: Option<u32>,
        tokens: &[u32],
        priority: Priority,
    ) -> Result<Imported, ImportError> {
        if !self.prefix.enabled() {
            return Err(ImportError::PrefixCacheOff);
        }
        let bs = self.config.block_size;
        if tokens.len() != bs as usize {
            return Err(ImportError::WrongTokenCount {
                got: tokens.len(),
                expected: bs,
            });
        }
        let chain = match parent {
            None => self.prefix.root(namespace),
            Some(p) => match self.registered_block(p) {
                Some(r) if r.namespace == namespace => crate::prefix::Chain {
                    hash: r.hash,
                    last: self.prefix.link_of(p),
                },
                _ => return Err(ImportError::BadParent { block: p }),
            },
        };
        let hash = self.prefix.hasher.chain(chain.hash, namespace, tokens);
        if let Some(b) = self.prefix.find(hash, namespace, chain.last, tokens) {
            self.raise_priority(b, priority);
            return Ok(Imported {
                block: b,
                fresh: false,
            });
        }
        let s = self.pool.tenants.slot_of(namespace);
        if self.pool.tenants.at_limit(s) {
            return Err(ImportError::QuotaExceeded);
        }
        let b = self
            .pool
            .take_free_for_cache(s, bs, &mut self.prefix)
            .ok_or(ImportError::OutOfBlocks)?;
        self.prefix.set_tokens(b, 0, tokens);
        self.prefix.register(b, hash, namespace, chain.last);
        self.prefix.set_priority(b, priority, false);
        self.prefix.lru_push_front(b, s);
        Ok(Imported {
            block: b,
            fresh: true,
        })
    }

    /// Free blocks an import for `namespace` may take (imports never evict). O(max
    /// namespaces).
    pub fn importable_blocks(&self, namespace: u64) -> u32 {
        let s = self.pool.tenants.slot_of(namespace);
        match self.pool.tenants.at_limit(s) {
            true => 0,
            false => self.pool.free_for(s),
        }
    }
}
