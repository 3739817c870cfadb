//! Counters of a [`crate::BlockManager`], kept incrementally so reading them is O(1).

/// A snapshot of the pool and the sequences. Reading it costs a few loads: cheap enough
/// every step.
///
/// Invariant: `free_blocks + cached_blocks + used_blocks == total_blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Stats {
    /// Blocks in the pool.
    pub total_blocks: u32,
    /// Blocks never registered in the prefix cache and referenced by no sequence.
    pub free_blocks: u32,
    /// Registered blocks referenced by no sequence: reusable on a prefix hit, evictable
    /// unless pinned ([`crate::BlockManager::pinned_blocks`] of them are).
    pub cached_blocks: u32,
    /// Blocks referenced by at least one sequence.
    pub used_blocks: u32,
    /// Token slots of the used blocks: `used_blocks * block_size`.
    pub token_slots: u64,
    /// Tokens physically stored in used blocks (each shared block counted once).
    pub tokens_stored: u64,
    /// Sum of the lengths of live sequences (shared tokens counted per sequence).
    pub logical_tokens: u64,
    /// Block references beyond one per used block: what sharing saved.
    pub blocks_saved_by_sharing: u64,
    /// Live sequences.
    pub live_seqs: u32,
    /// Prompt tokens served from the prefix cache since construction.
    pub prefix_hit_tokens: u64,
}

impl Stats {
    /// Token slots allocated but holding no token: internal fragmentation. O(1).
    pub const fn wasted_slots(&self) -> u64 {
        self.token_slots - self.tokens_stored
    }
}
