//! The KV memory a replay runs on: kvpage's [`BlockManager`] (with a [`HostPool`] for
//! swapping), sized from a [`MemoryConfig`], for every policy.
//!
//! - **Paged** policies: blocks of `block_size` tokens taken as prefill chunks and decoded
//!   tokens need them, optionally a host tier for preemption by swap, and with `prefix`
//!   the prefix cache shares the full blocks of common prompt prefixes.
//! - **The contiguous baseline** ([`MemoryConfig::contiguous`]): one block is one whole
//!   `max_seq_len` region and a sequence holds exactly one, so a request reserves
//!   `max_seq_len` tokens at admission whatever it will use, and never grows out of it.
//!   The manager takes the lowest free block, and regions of one size sit at multiples of
//!   that size, so this is exactly a first-fit allocator of `max_seq_len` regions: its
//!   holes are runs of free regions, and only the budget's tail below one region is
//!   never usable.
//!
//! The engine always offers computed full blocks to the prefix cache. Without `prefix`
//! the replay gives every request its own namespace, so no request finds another's
//! blocks, and drops idle cached blocks after every step ([`BlockManager::evict_cached`]),
//! so a request recomputed after a preemption does not find its own old blocks either:
//! the memory behaves as if there were no prefix cache.

use kvpage_core::{BlockManager, Config, Geometry, HostPool};

/// Sizes of the KV memory of one policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryConfig {
    /// KV geometry; its block size is the allocation unit (for the contiguous baseline,
    /// `max_seq_len`).
    pub geometry: Geometry,
    /// KV bytes on the device.
    pub budget_bytes: u64,
    /// Most sequences live at once (rows of the block table): running plus swapped-out
    /// sequences never exceed the scheduler's running limit, so that limit suffices.
    pub max_seqs: u32,
    /// Longest sequence, tokens.
    pub max_seq_len: u32,
    /// Blocks that must stay available after an admission or a swap-in.
    pub watermark_blocks: u32,
    /// Keep the prefix cache: prompts share the full blocks of a common prefix.
    pub prefix: bool,
    /// Host-tier bytes for swapping (0: none).
    pub host_bytes: u64,
}

/// The memory, sampled once per step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// KV bytes of the blocks sequences hold.
    pub reserved_bytes: u64,
    /// Tokens stored in those blocks (a shared block's tokens counted once).
    pub stored_tokens: u64,
    /// Token slots of those blocks.
    pub slot_tokens: u64,
    /// Free bytes no sequence can use: the budget's tail below one block.
    pub unusable_free_bytes: u64,
    /// The most one new sequence could get right now: every free and cached block for
    /// paged memory; for one-block sequences (the contiguous baseline) the largest hole,
    /// a run of adjacent free regions (with the tail when it ends there).
    pub largest_free_bytes: u64,
    /// Bytes held in the host tier.
    pub host_bytes: u64,
}

impl MemoryConfig {
    /// The contiguous baseline over `budget_bytes`: `geometry` (its block size is
    /// ignored) with one block of `max_seq_len` tokens per sequence, no watermark, no
    /// prefix cache, no host tier.
    ///
    /// # Errors
    /// The core's [`kvpage_core::GeometryError`], as text, when a region's bytes do not
    /// fit in a `u64`.
    pub fn contiguous(
        geometry: Geometry,
        budget_bytes: u64,
        max_seqs: u32,
        max_seq_len: u32,
    ) -> Result<Self, String> {
        let g = &geometry;
        let region = Geometry::new(
            g.layers(),
            g.kv_heads(),
            g.head_dim(),
            max_seq_len,
            g.dtype(),
        )
        .map_err(|e| format!("a --max-seq-len region of {max_seq_len} tokens: {e}"))?;
        Ok(Self {
            geometry: region,
            budget_bytes,
            max_seqs,
            max_seq_len,
            watermark_blocks: 0,
            prefix: false,
            host_bytes: 0,
        })
    }

    /// The core configuration: the device blocks that fit the budget. O(1).
    pub fn core_config(&self) -> Config {
        let blocks = u32::try_from(self.geometry.blocks_in(self.budget_bytes)).unwrap_or(u32::MAX);
        let config = Config::for_geometry(&self.geometry, blocks, self.max_seqs, self.max_seq_len)
            .with_instance(1);
        match self.prefix {
            true => config,
            false => config.without_prefix_cache(),
        }
    }

    /// Host-tier blocks. O(1).
    pub fn host_blocks(&self) -> u32 {
        u32::try_from(self.host_bytes / self.geometry.bytes_per_block()).unwrap_or(u32::MAX)
    }

    /// The memory of `kv` (and `host`) now. O(1) for paged memory; O(blocks) for
    /// one-block sequences, whose blocks are the few regions of the budget.
    pub fn usage(&self, kv: &BlockManager<'_>, host: Option<&HostPool<'_>>) -> Usage {
        let s = kv.stats();
        let bpb = self.geometry.bytes_per_block();
        let tail = self
            .budget_bytes
            .saturating_sub(u64::from(s.total_blocks) * bpb);
        let largest_free_bytes = if kv.config().max_blocks_per_seq == 1 {
            largest_hole(kv, bpb, tail)
        } else {
            u64::from(s.free_blocks + s.cached_blocks) * bpb
        };
        Usage {
            reserved_bytes: u64::from(s.used_blocks) * bpb,
            stored_tokens: s.tokens_stored,
            slot_tokens: s.token_slots,
            unusable_free_bytes: tail,
            largest_free_bytes,
            host_bytes: host.map_or(0, |h| u64::from(h.total_blocks() - h.free_blocks()) * bpb),
        }
    }
}

/// The longest run of adjacent blocks no sequence holds, in bytes; a run that reaches
/// the last block continues into the `tail` bytes after it. O(blocks).
fn largest_hole(kv: &BlockManager<'_>, bytes_per_block: u64, tail: u64) -> u64 {
    let (mut best, mut run) = (0u64, 0u64);
    for b in 0..kv.config().num_blocks {
        run = if kv.refcount(b) == Some(0) {
            run + bytes_per_block
        } else {
            0
        };
        best = best.max(run);
    }
    best.max(run + tail)
}
