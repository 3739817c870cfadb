//! The paged policies: kvpage's [`BlockManager`] holds every sequence's KV in fixed-size
//! blocks allocated as tokens are computed, with an optional prefix cache and an optional
//! host tier ([`HostPool`]).
//!
//! - Blocks are taken as prefill chunks and decoded tokens need them; the scheduler
//!   admits a request only if its whole prompt (less its cached prefix) fits above the
//!   `watermark_blocks`.
//! - With `prefix`, prompts go through [`BlockManager::create_with_prompt`] and later
//!   tokens through [`BlockManager::append_tokens`], so full blocks are registered and
//!   later prompts with the same leading blocks share them.
//! - With a host tier, preemption by swap moves a sequence's blocks to the host pool
//!   ([`BlockManager::swap_out`]) and back ([`BlockManager::swap_in`]); the core plans
//!   the block copies, and the replay charges `blocks × bytes_per_block`
//!   over the host link for each direction.

use std::collections::HashMap;

use kvpage_core::{BlockCopy, BlockManager, Config, Geometry, HostPool, SeqError, SeqId};

use crate::sim::{KvPolicy, PolicyError, Usage};

/// Sizes of a paged policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PagedConfig {
    /// KV geometry (block size included).
    pub geometry: Geometry,
    /// KV bytes on the device.
    pub budget_bytes: u64,
    /// Most sequences live at once (rows of the block table); running plus swapped-out
    /// sequences never exceed the scheduler's running limit.
    pub max_seqs: u32,
    /// Longest sequence, tokens.
    pub max_seq_len: u32,
    /// Blocks that must stay available after an admission or a swap-in.
    pub watermark_blocks: u32,
    /// Share prompt blocks through the prefix cache.
    pub prefix: bool,
    /// Host-tier bytes for swapping (0: none).
    pub host_bytes: u64,
}

impl PagedConfig {
    /// The core configuration: the device blocks that fit the budget.
    pub fn core_config(&self) -> Config {
        let blocks = u32::try_from(self.geometry.blocks_in(self.budget_bytes)).unwrap_or(u32::MAX);
        let config = Config::for_geometry(&self.geometry, blocks, self.max_seqs, self.max_seq_len)
            .with_instance(1);
        match self.prefix {
            true => config,
            false => config.without_prefix_cache(),
        }
    }

    /// Host-tier blocks.
    pub fn host_blocks(&self) -> u32 {
        u32::try_from(self.host_bytes / self.geometry.bytes_per_block()).unwrap_or(u32::MAX)
    }
}

/// Storage a paged policy borrows: the block manager's words and the host pool's.
pub struct PagedStorage {
    /// [`BlockManager`] storage.
    pub manager: Vec<u64>,
    /// [`HostPool`] storage.
    pub host: Vec<u32>,
}

impl PagedStorage {
    /// Zeroed storage sized for `cfg`.
    pub fn for_config(cfg: &PagedConfig) -> Self {
        Self {
            manager: vec![0; cfg.core_config().storage_words()],
            host: vec![0; HostPool::storage_words(cfg.host_blocks())],
        }
    }
}

/// Paged KV memory over kvpage's block manager.
pub struct Paged<'s> {
    bm: BlockManager<'s>,
    host: Option<HostPool<'s>>,
    cfg: PagedConfig,
    seqs: HashMap<u32, SeqId>,
    slots: Vec<u32>,
    moves: Vec<BlockCopy>,
}

fn internal(what: &str, id: u32, e: SeqError) -> PolicyError {
    PolicyError::Internal(format!("{what} of sequence {id}: {e}"))
}

impl<'s> Paged<'s> {
    /// Builds the policy over `storage` (from [`PagedStorage::for_config`]).
    ///
    /// # Errors
    /// The core's [`kvpage_core::InitError`], as text.
    pub fn new(cfg: PagedConfig, storage: &'s mut PagedStorage) -> Result<Self, String> {
        let core = cfg.core_config();
        let bm = BlockManager::new(core, &mut storage.manager)
            .map_err(|e| format!("block manager: {e}"))?;
        let host = match cfg.host_blocks() {
            0 => None,
            blocks => Some(
                HostPool::new(blocks, core.instance, &mut storage.host)
                    .map_err(|e| format!("host pool: {e}"))?,
            ),
        };
        Ok(Self {
            bm,
            host,
            cfg,
            seqs: HashMap::new(),
            slots: vec![0; cfg.max_seq_len as usize + 1],
            moves: vec![BlockCopy { src: 0, dst: 0 }; core.max_blocks_per_seq as usize],
        })
    }

    /// The block manager, for statistics. O(1).
    pub fn manager(&self) -> &BlockManager<'s> {
        &self.bm
    }

    fn seq(&self, id: u32) -> Result<SeqId, PolicyError> {
        self.seqs
            .get(&id)
            .copied()
            .ok_or_else(|| PolicyError::Internal(format!("unknown sequence {id}")))
    }

    fn bytes(&self, blocks: u32) -> u64 {
        u64::from(blocks) * self.cfg.geometry.bytes_per_block()
    }
}

impl KvPolicy for Paged<'_> {
    fn needs_tokens(&self) -> bool {
        self.cfg.prefix
    }

    fn budget_bytes(&self) -> u64 {
        self.cfg.budget_bytes
    }

    fn block_tokens(&self) -> u32 {
        self.cfg.geometry.block_size()
    }

    fn available_blocks(&self) -> u32 {
        self.bm.available_blocks()
    }

    fn watermark_blocks(&self) -> u32 {
        self.cfg.watermark_blocks
    }

    fn host_free_blocks(&self) -> u32 {
        self.host.as_ref().map_or(0, HostPool::free_blocks)
    }

    fn cached_prefix_tokens(&self, tokens: &[u32]) -> u32 {
        if self.cfg.prefix {
            self.bm.cached_prefix_tokens(0, tokens)
        } else {
            0
        }
    }

    fn exclusive_blocks(&self, id: u32, blocks: u32) -> u32 {
        if !self.cfg.prefix {
            return blocks; // nothing is shared without the prefix cache
        }
        self.seqs
            .get(&id)
            .and_then(|&s| self.bm.exclusive_blocks(s).ok())
            .unwrap_or(blocks)
    }

    fn admit(&mut self, id: u32, len: u32, tokens: &[u32]) -> Result<u32, PolicyError> {
        if self.seqs.contains_key(&id) {
            return Err(PolicyError::Internal(format!(
                "sequence {id} admitted twice"
            )));
        }
        let (seq, hit) = if self.cfg.prefix {
            if tokens.len() != len as usize {
                return Err(PolicyError::Internal(format!(
                    "sequence {id}: prompt token ids missing"
                )));
            }
            match self.bm.create_with_prompt(0, tokens, &mut self.slots) {
                Ok(start) => (start.seq, start.reused_tokens),
                Err(SeqError::OutOfBlocks { .. } | SeqError::NoFreeSequence) => {
                    return Err(PolicyError::NoRoom)
                }
                Err(e) => return Err(internal("admission", id, e)),
            }
        } else {
            let seq = match self.bm.create(0) {
                Ok(s) => s,
                Err(SeqError::NoFreeSequence) => return Err(PolicyError::NoRoom),
                Err(e) => return Err(internal("admission", id, e)),
            };
            if let Err(e) = self.bm.append(seq, len, &mut self.slots) {
                self.bm
                    .release(seq)
                    .map_err(|e| internal("release", id, e))?;
                return match e {
                    SeqError::OutOfBlocks { .. } => Err(PolicyError::NoRoom),
                    e => Err(internal("admission", id, e)),
                };
            }
            (seq, 0)
        };
        self.seqs.insert(id, seq);
        Ok(hit)
    }

    fn grow(&mut self, id: u32, n: u32, tokens: &[u32]) -> Result<(), PolicyError> {
        let seq = self.seq(id)?;
        let r = if self.cfg.prefix {
            self.bm.append_tokens(seq, tokens, &mut self.slots)
        } else {
            self.bm.append(seq, n, &mut self.slots)
        };
        match r {
            Ok(_) => Ok(()),
            Err(SeqError::OutOfBlocks { .. }) => Err(PolicyError::NoRoom),
            Err(e) => Err(internal("growth", id, e)),
        }
    }

    fn computed(&mut self, id: u32, tokens: u32) -> Result<(), PolicyError> {
        if self.cfg.prefix {
            let seq = self.seq(id)?;
            self.bm
                .commit(seq, tokens)
                .map_err(|e| internal("commit", id, e))?;
        }
        Ok(())
    }

    fn release(&mut self, id: u32) -> Result<(), PolicyError> {
        let seq = self.seq(id)?;
        self.bm
            .release(seq)
            .map_err(|e| internal("release", id, e))?;
        self.seqs.remove(&id);
        Ok(())
    }

    fn swap_out(&mut self, id: u32) -> Result<u64, PolicyError> {
        let seq = self.seq(id)?;
        let Some(host) = self.host.as_mut() else {
            return Err(PolicyError::NoRoom);
        };
        match self.bm.swap_out(seq, host, &mut self.moves) {
            Ok(blocks) => Ok(self.bytes(blocks)),
            Err(SeqError::HostFull { .. }) => Err(PolicyError::NoRoom),
            Err(e) => Err(internal("swap-out", id, e)),
        }
    }

    fn swap_in(&mut self, id: u32) -> Result<u64, PolicyError> {
        let seq = self.seq(id)?;
        let Some(host) = self.host.as_mut() else {
            return Err(PolicyError::Internal(format!(
                "sequence {id}: swap-in without a host tier"
            )));
        };
        match self.bm.swap_in(seq, host, &mut self.moves) {
            Ok(blocks) => Ok(self.bytes(blocks)),
            Err(SeqError::OutOfBlocks { .. }) => Err(PolicyError::NoRoom),
            Err(e) => Err(internal("swap-in", id, e)),
        }
    }

    fn usage(&self) -> Usage {
        let s = self.bm.stats();
        let bpb = self.cfg.geometry.bytes_per_block();
        let pool = u64::from(s.total_blocks) * bpb;
        let host_used = self
            .host
            .as_ref()
            .map_or(0, |h| h.total_blocks() - h.free_blocks());
        Usage {
            reserved_bytes: u64::from(s.used_blocks) * bpb,
            stored_tokens: s.tokens_stored,
            slot_tokens: s.token_slots,
            unusable_free_bytes: self.cfg.budget_bytes.saturating_sub(pool),
            largest_free_bytes: u64::from(s.free_blocks + s.cached_blocks) * bpb,
            host_bytes: u64::from(host_used) * bpb,
        }
    }

    fn prefix_hit_tokens(&self) -> u64 {
        self.bm.stats().prefix_hit_tokens
    }
}
