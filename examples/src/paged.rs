//! The paged policies: kvpage's [`BlockManager`] holds every sequence's KV in fixed-size
//! blocks allocated on demand, with an optional prefix cache and an optional host tier.
//!
//! - Admission takes `ceil(prompt / block_size)` blocks (fewer on a prefix hit) and only
//!   if at least `watermark` blocks stay available afterwards, so running sequences keep
//!   room to grow.
//! - Growth takes a block every `block_size` tokens.
//! - With `prefix`, prompts go through [`BlockManager::create_with_prompt`] and decoded
//!   tokens through [`BlockManager::append_tokens`], so full blocks are registered and
//!   later prompts with the same leading blocks share them.
//! - The host tier (examples-side stopgap until the core's lands) is a block budget
//!   standing for pinned host memory: swapping out records the sequence's length, counts
//!   its blocks against the host budget and releases them on the device; swapping in
//!   allocates them again. The bytes moved are `blocks × bytes_per_block` each way.

use std::collections::HashMap;

use kvpage_core::{BlockManager, Config, Geometry, SeqError, SeqId};

use crate::sim::{KvPolicy, PolicyError, Prompt, Usage};

/// Sizes of a paged policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PagedConfig {
    /// KV geometry (block size included).
    pub geometry: Geometry,
    /// KV bytes on the device.
    pub budget_bytes: u64,
    /// Most sequences live at once (rows of the block table).
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
        let bs = self.geometry.block_size();
        Config {
            num_blocks: u32::try_from(self.geometry.blocks_in(self.budget_bytes))
                .unwrap_or(u32::MAX),
            block_size: bs,
            max_seqs: self.max_seqs,
            max_blocks_per_seq: self.max_seq_len.div_ceil(bs),
            instance: 1,
        }
    }
}

/// Paged KV memory over kvpage's block manager.
pub struct Paged<'s> {
    bm: BlockManager<'s>,
    cfg: PagedConfig,
    seqs: HashMap<u32, SeqId>,
    /// Swapped-out sequences: id -> (tokens, blocks).
    host: HashMap<u32, (u32, u32)>,
    host_capacity_blocks: u64,
    host_used_blocks: u64,
    slots: Vec<u32>,
}

fn internal(what: &str, id: u32, e: SeqError) -> PolicyError {
    PolicyError::Internal(format!("{what} of sequence {id}: {e}"))
}

impl<'s> Paged<'s> {
    /// Storage words the core needs for `cfg`.
    pub fn storage_words(cfg: &PagedConfig) -> usize {
        cfg.core_config().storage_words()
    }

    /// Builds the policy over `storage` (at least [`Paged::storage_words`] words).
    ///
    /// # Errors
    /// The core's [`kvpage_core::InitError`], as text.
    pub fn new(cfg: PagedConfig, storage: &'s mut [u64]) -> Result<Self, String> {
        let core = cfg.core_config();
        let bm = BlockManager::new(core, storage).map_err(|e| format!("block manager: {e}"))?;
        Ok(Self {
            bm,
            cfg,
            seqs: HashMap::new(),
            host: HashMap::new(),
            host_capacity_blocks: cfg.host_bytes / cfg.geometry.bytes_per_block(),
            host_used_blocks: 0,
            slots: vec![0; cfg.max_seq_len as usize + 1],
        })
    }

    /// The block manager, for statistics. O(1).
    pub fn manager(&self) -> &BlockManager<'s> {
        &self.bm
    }

    fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.cfg.geometry.block_size())
    }

    fn seq(&self, id: u32) -> Result<SeqId, PolicyError> {
        self.seqs
            .get(&id)
            .copied()
            .ok_or_else(|| PolicyError::Internal(format!("unknown sequence {id}")))
    }

    /// Room for `blocks` more blocks with the watermark kept.
    fn fits(&self, blocks: u32) -> bool {
        u64::from(blocks) + u64::from(self.cfg.watermark_blocks)
            <= u64::from(self.bm.available_blocks())
    }
}

impl KvPolicy for Paged<'_> {
    fn needs_tokens(&self) -> bool {
        self.cfg.prefix
    }

    fn budget_bytes(&self) -> u64 {
        self.cfg.budget_bytes
    }

    fn admit(&mut self, id: u32, prompt: Prompt<'_>) -> Result<u32, PolicyError> {
        if self.seqs.contains_key(&id) {
            return Err(PolicyError::Internal(format!(
                "sequence {id} admitted twice"
            )));
        }
        // Conservative: a prefix hit needs fewer blocks than this.
        if !self.fits(self.blocks_for(prompt.len)) {
            return Err(PolicyError::NoRoom);
        }
        let (seq, hit) = if self.cfg.prefix {
            if prompt.tokens.len() != prompt.len as usize {
                return Err(PolicyError::Internal(format!(
                    "sequence {id}: prompt tokens missing"
                )));
            }
            match self
                .bm
                .create_with_prompt(0, prompt.tokens, &mut self.slots)
            {
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
            match self.bm.append(seq, prompt.len, &mut self.slots) {
                Ok(_) => (seq, 0),
                Err(e) => {
                    self.bm
                        .release(seq)
                        .map_err(|e| internal("release", id, e))?;
                    return match e {
                        SeqError::OutOfBlocks { .. } => Err(PolicyError::NoRoom),
                        e => Err(internal("admission", id, e)),
                    };
                }
            }
        };
        self.seqs.insert(id, seq);
        Ok(hit)
    }

    fn grow(&mut self, id: u32, token: u32) -> Result<(), PolicyError> {
        let seq = self.seq(id)?;
        let r = if self.cfg.prefix {
            self.bm.append_tokens(seq, &[token], &mut self.slots)
        } else {
            self.bm.append(seq, 1, &mut self.slots)
        };
        match r {
            Ok(_) => Ok(()),
            Err(SeqError::OutOfBlocks { .. }) => Err(PolicyError::NoRoom),
            Err(e) => Err(internal("growth", id, e)),
        }
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
        let len = self.bm.len(seq).map_err(|e| internal("swap-out", id, e))?;
        let blocks = self.blocks_for(len);
        if self.host_used_blocks + u64::from(blocks) > self.host_capacity_blocks {
            return Err(PolicyError::NoRoom);
        }
        self.release(id)?;
        self.host_used_blocks += u64::from(blocks);
        self.host.insert(id, (len, blocks));
        Ok(u64::from(blocks) * self.cfg.geometry.bytes_per_block())
    }

    fn swap_in(&mut self, id: u32) -> Result<u64, PolicyError> {
        let &(len, blocks) = self
            .host
            .get(&id)
            .ok_or_else(|| PolicyError::Internal(format!("sequence {id} is not swapped out")))?;
        if !self.fits(blocks) {
            return Err(PolicyError::NoRoom);
        }
        let seq = match self.bm.create(0) {
            Ok(s) => s,
            Err(SeqError::NoFreeSequence) => return Err(PolicyError::NoRoom),
            Err(e) => return Err(internal("swap-in", id, e)),
        };
        if let Err(e) = self.bm.append(seq, len, &mut self.slots) {
            self.bm
                .release(seq)
                .map_err(|e| internal("release", id, e))?;
            return match e {
                SeqError::OutOfBlocks { .. } => Err(PolicyError::NoRoom),
                e => Err(internal("swap-in", id, e)),
            };
        }
        self.host.remove(&id);
        self.host_used_blocks -= u64::from(blocks);
        self.seqs.insert(id, seq);
        Ok(u64::from(blocks) * self.cfg.geometry.bytes_per_block())
    }

    fn usage(&self) -> Usage {
        let s = self.bm.stats();
        let bpb = self.cfg.geometry.bytes_per_block();
        let pool = u64::from(s.total_blocks) * bpb;
        Usage {
            reserved_bytes: u64::from(s.used_blocks) * bpb,
            stored_tokens: s.tokens_stored,
            slot_tokens: s.token_slots,
            unusable_free_bytes: self.cfg.budget_bytes.saturating_sub(pool),
            largest_free_bytes: u64::from(s.free_blocks + s.cached_blocks) * bpb,
            host_bytes: self.host_used_blocks * bpb,
        }
    }

    fn prefix_hit_tokens(&self) -> u64 {
        self.bm.stats().prefix_hit_tokens
    }
}
