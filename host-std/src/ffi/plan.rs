//! What a step asks of the caller, as C sees it: block copies, scheduled sequences,
//! sampled tokens, finished requests, and the scheduler's limits. Shared by the owned
//! engine (tier 1) and the scheduler over caller memory (tier 3); tier 2 returns block
//! copies too.

use kvpage_core::{
    BlockCopy, FinishReason, Finished, Preemption, Sampled, ScheduledSeq, SchedulerConfig,
};

use super::ids::{kvpage_request, kvpage_seq, request_from_c, request_to_c, seq_to_c};
use super::result::Fail;

/// A whole-block copy to execute: every layer's K and V of block `src` into block
/// `dst` (one block-sized byte range each in the block-major layout). For a swap-out
/// `src` is a device block and `dst` a host block; for a swap-in the reverse; for
/// copy-on-write both are device blocks.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[allow(non_camel_case_types)]
pub struct kvpage_block_copy {
    /// Block read.
    pub src: u32,
    /// Block written.
    pub dst: u32,
}

impl From<BlockCopy> for kvpage_block_copy {
    fn from(c: BlockCopy) -> Self {
        Self {
            src: c.src,
            dst: c.dst,
        }
    }
}

/// Token rows the caller's kernels move after a sequence edit (tier 2): `count` rows from
/// slots `src_slot..` to slots `dst_slot..` (slot = `block * block_size + offset`), in
/// every layer, K and V, every KV head. Both ranges lie within one block, so in the
/// block-major layout a move is one contiguous range of `count * head_dim` elements per
/// `[token][head_dim]` tile. Execute an edit's moves in order, each as a `memmove`, after
/// its block copies.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[allow(non_camel_case_types)]
pub struct kvpage_row_move {
    /// First slot read.
    pub src_slot: u32,
    /// First slot written.
    pub dst_slot: u32,
    /// Rows moved (1 to `block_size`).
    pub count: u32,
}

/// Preemption frees a victim's blocks; it is prefilled again later.
pub const KVPAGE_PREEMPT_RECOMPUTE: u32 = 0;
/// Preemption moves a victim's blocks to the host tier (recompute when it is full).
pub const KVPAGE_PREEMPT_SWAP: u32 = 1;

/// Limits of one step of an engine or scheduler.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct kvpage_scheduler_params {
    /// Tokens computed per step at most (prefill chunks plus decode tokens); > 0.
    pub token_budget: u32,
    /// Sequences running at once at most; > 0.
    pub max_running: u32,
    /// Free blocks admission and swap-in leave untouched so running sequences can grow.
    pub watermark_blocks: u32,
    /// `KVPAGE_PREEMPT_RECOMPUTE` or `KVPAGE_PREEMPT_SWAP`.
    pub preemption: u32,
}

impl kvpage_scheduler_params {
    /// The checked core configuration.
    pub(crate) fn to_core(self) -> Result<SchedulerConfig, Fail> {
        let preemption = match self.preemption {
            KVPAGE_PREEMPT_RECOMPUTE => Preemption::Recompute,
            KVPAGE_PREEMPT_SWAP => Preemption::Swap,
            other => {
                return Err(Fail::invalid("unknown preemption mode").with_value(u64::from(other)))
            }
        };
        Ok(SchedulerConfig {
            token_budget: self.token_budget,
            max_running: self.max_running,
            watermark_blocks: self.watermark_blocks,
            preemption,
        })
    }
}

/// One sequence the model computes this step.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[allow(non_camel_case_types)]
pub struct kvpage_step_seq {
    /// The request.
    pub request: kvpage_request,
    /// Its sequence; `seq_row` is its row of the block table.
    pub seq: kvpage_seq,
    /// Row of the sequence in the block table.
    pub seq_row: u32,
    /// Position of the first query token: queries are `first_pos..first_pos + tokens`,
    /// attention covers `0..first_pos + tokens` (causal).
    pub first_pos: u32,
    /// Query tokens this step (a prefill chunk, or 1 to decode).
    pub tokens: u32,
    /// Start of this sequence's entries in the step's slot and input-token arrays.
    pub offset: u32,
    /// 1 when the last query position produces a token to sample, else 0.
    pub emits: u32,
}

impl From<ScheduledSeq> for kvpage_step_seq {
    fn from(s: ScheduledSeq) -> Self {
        Self {
            request: request_to_c(s.request),
            seq: seq_to_c(s.seq),
            seq_row: s.seq.index(),
            first_pos: s.first_pos,
            tokens: s.tokens,
            offset: s.offset,
            emits: u32::from(s.emits),
        }
    }
}

/// A token the caller sampled for an emitting sequence of the step.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[allow(non_camel_case_types)]
pub struct kvpage_sampled {
    /// The request.
    pub request: kvpage_request,
    /// The token id.
    pub token: u32,
    /// Non-zero: the request ends with this token (end of sequence, a stop string).
    pub stop: u32,
}

impl From<kvpage_sampled> for Sampled {
    fn from(s: kvpage_sampled) -> Self {
        Sampled {
            request: request_from_c(s.request),
            token: s.token,
            stop: s.stop != 0,
        }
    }
}

/// The caller said stop with the sampled token.
pub const KVPAGE_FINISH_STOP: u32 = 0;
/// The request generated its `max_new_tokens`.
pub const KVPAGE_FINISH_MAX_TOKENS: u32 = 1;
/// The sequence is full; the last sampled token was reported but not stored.
pub const KVPAGE_FINISH_LENGTH: u32 = 2;

/// A request that finished in a commit; its id is now stale.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[allow(non_camel_case_types)]
pub struct kvpage_finished {
    /// The request.
    pub request: kvpage_request,
    /// `KVPAGE_FINISH_STOP`, `KVPAGE_FINISH_MAX_TOKENS` or `KVPAGE_FINISH_LENGTH`.
    pub reason: u32,
    /// Tokens it generated in all.
    pub generated: u32,
}

impl From<Finished> for kvpage_finished {
    fn from(f: Finished) -> Self {
        Self {
            request: request_to_c(f.request),
            reason: match f.reason {
                FinishReason::Stop => KVPAGE_FINISH_STOP,
                FinishReason::MaxTokens => KVPAGE_FINISH_MAX_TOKENS,
                FinishReason::Length => KVPAGE_FINISH_LENGTH,
            },
            generated: f.generated,
        }
    }
}
