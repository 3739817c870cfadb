//! Counters of the pool and the sequences as C reads them.

use kvpage_core::{EngineStats, Stats};

/// A snapshot of the block pool and the sequences (see the Rust `Stats`).
/// Invariant: `free_blocks + cached_blocks + used_blocks == total_blocks`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[allow(non_camel_case_types)]
pub struct kvpage_stats {
    /// Blocks in the pool.
    pub total_blocks: u32,
    /// Blocks holding nothing.
    pub free_blocks: u32,
    /// Blocks of the prefix cache referenced by no sequence (reusable, evictable).
    pub cached_blocks: u32,
    /// Blocks referenced by at least one sequence.
    pub used_blocks: u32,
    /// Live sequences.
    pub live_seqs: u32,
    /// Token slots of the used blocks (`used_blocks * block_size`).
    pub token_slots: u64,
    /// Tokens stored in used blocks, each shared block counted once.
    pub tokens_stored: u64,
    /// Sum of the lengths of live sequences (shared tokens counted per sequence).
    pub logical_tokens: u64,
    /// Block references beyond one per used block: what sharing saved.
    pub blocks_saved_by_sharing: u64,
    /// Prompt tokens served from the prefix cache since construction.
    pub prefix_hit_tokens: u64,
}

impl From<Stats> for kvpage_stats {
    fn from(s: Stats) -> Self {
        Self {
            total_blocks: s.total_blocks,
            free_blocks: s.free_blocks,
            cached_blocks: s.cached_blocks,
            used_blocks: s.used_blocks,
            live_seqs: s.live_seqs,
            token_slots: s.token_slots,
            tokens_stored: s.tokens_stored,
            logical_tokens: s.logical_tokens,
            blocks_saved_by_sharing: s.blocks_saved_by_sharing,
            prefix_hit_tokens: s.prefix_hit_tokens,
        }
    }
}

/// Counters of an engine or scheduler since construction.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[allow(non_camel_case_types)]
pub struct kvpage_engine_counters {
    /// Steps taken.
    pub steps: u64,
    /// Requests admitted for the first time.
    pub admitted: u64,
    /// Requests finished.
    pub finished: u64,
    /// Preemptions by recompute.
    pub recomputes: u64,
    /// Preemptions by swap-out.
    pub swap_outs: u64,
    /// Swap-ins.
    pub swap_ins: u64,
    /// Tokens computed again after preemptions by recompute.
    pub recomputed_tokens: u64,
}

impl From<EngineStats> for kvpage_engine_counters {
    fn from(s: EngineStats) -> Self {
        Self {
            steps: s.steps,
            admitted: s.admitted,
            finished: s.finished,
            recomputes: s.recomputes,
            swap_outs: s.swap_outs,
            swap_ins: s.swap_ins,
            recomputed_tokens: s.recomputed_tokens,
        }
    }
}
