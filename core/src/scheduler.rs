//! Scheduling policy for continuous batching: which sequences run this step, with how many
//! tokens, which waiting requests are admitted, which running ones are preempted, and
//! which swapped-out ones come back.
//!
//! The policy is a pure function over caller slices ([`schedule`]): it reads the state of
//! the sequences and the free-block count, writes [`Action`]s into a caller buffer, and
//! allocates nothing. [`crate::Engine`] executes the actions against a
//! [`crate::BlockManager`] (and a [`crate::HostPool`] for swaps); a plan made from the
//! manager's true state always executes (the engine's property tests check it). The
//! policy is easy to test by hand and to reuse with any backend.
//!
//! # The rules, in order
//! 1. **Running** sequences, oldest admission first, take their share of the per-step
//!    token budget: up to `pending_tokens` (a prefill chunk, or 1 to decode). When the
//!    blocks that share needs (new blocks plus a copy-on-write block) are not available,
//!    the most recently admitted running sequence is preempted, freeing its exclusive
//!    blocks: by swap when [`Preemption::Swap`] is configured and the host tier has
//!    room, otherwise by recompute. When the one asking is itself the most recent, it
//!    runs the tokens that fit instead, and is preempted only when not one fits.
//! 2. If nobody was preempted, **swapped-out** sequences come back oldest first, while
//!    their blocks plus one spare block fit above the watermark and the running limit
//!    allows. They run from the next step on.
//! 3. If nobody was preempted and nothing remains swapped out, **waiting** requests are
//!    admitted first come, first served: each needs the blocks of its whole prompt (less
//!    its cached prefix, plus the idle cached blocks it takes) above the free-block
//!    watermark, a running slot, a free sequence slot and some token budget; its first
//!    prefill chunk runs this step. The first request that does not fit
//!    stops admission (no overtaking).

use core::fmt;

/// How a running sequence gives its blocks back when another one needs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Preemption {
    /// Free the blocks; the sequence is prefilled again later (prompt + tokens so far).
    Recompute,
    /// Move the blocks to the host tier; the sequence resumes after a swap-in. Falls back
    /// to recompute when the host tier lacks room.
    Swap,
}

/// Limits of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct SchedulerConfig {
    /// Tokens computed per step at most (prefill chunks plus decode tokens).
    pub token_budget: u32,
    /// Sequences running at once at most.
    pub max_running: u32,
    /// Free blocks admission and swap-in must leave untouched, so running sequences can
    /// grow without immediate preemption.
    pub watermark_blocks: u32,
    /// What preemption does.
    pub preemption: Preemption,
}

/// A running sequence as the scheduler sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(C)]
pub struct RunningSeq {
    /// Caller's id, echoed in actions.
    pub id: u32,
    /// Tokens whose K/V the sequence holds now.
    pub held_tokens: u32,
    /// Tokens it wants computed: the rest of its prefill, or 1 to decode.
    pub pending_tokens: u32,
    /// Blocks only it references (freed if it is preempted).
    pub exclusive_blocks: u32,
    /// Blocks it holds in all (what a swap moves to the host).
    pub blocks: u32,
    /// 1 when its last block is partly filled and shared with another sequence, so the
    /// next append copies it first (copy-on-write takes one more block); else 0.
    pub cow_blocks: u32,
}

/// A swapped-out sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(C)]
pub struct SwappedSeq {
    /// Caller's id.
    pub id: u32,
    /// Device blocks a swap-in allocates: one per block it holds in the host tier.
    pub blocks: u32,
}

/// A request waiting for admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(C)]
pub struct WaitingSeq {
    /// Caller's id.
    pub id: u32,
    /// Tokens of its prompt (for a recomputed sequence: prompt plus tokens generated).
    pub prompt_tokens: u32,
    /// Leading prompt tokens already in the prefix cache (a multiple of the block size;
    /// see [`crate::BlockManager::prefix_lookup`]), 0 without a prefix cache.
    pub cached_tokens: u32,
    /// Blocks of that cached prefix that no sequence references now and are not pinned:
    /// they count as available (evictable) until the admission takes them, and then
    /// they do not.
    pub cached_idle_blocks: u32,
}

/// One decision of a step, in the order the caller should execute them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Action {
    /// Preempt running sequence `id`.
    Preempt {
        /// The sequence.
        id: u32,
        /// How.
        mode: Preemption,
    },
    /// Compute `tokens` more tokens of running sequence `id`.
    Run {
        /// The sequence.
        id: u32,
        /// Tokens this step.
        tokens: u32,
    },
    /// Bring swapped-out sequence `id` back to the device.
    SwapIn {
        /// The sequence.
        id: u32,
    },
    /// Admit waiting request `id`: create its sequence (reusing the cached prefix) and
    /// compute the first `tokens` of the rest of its prompt.
    Admit {
        /// The request.
        id: u32,
        /// Prompt tokens computed this step (after the cached ones).
        tokens: u32,
    },
}

/// What the scheduler is given each step: the state of the sequences and of the pool,
/// as the manager reports it.
#[derive(Debug, Clone, Copy)]
pub struct StepInput<'s> {
    /// Running sequences, oldest admission first.
    pub running: &'s [RunningSeq],
    /// Swapped-out sequences, in the order they should come back.
    pub swapped: &'s [SwappedSeq],
    /// Waiting requests, first come first.
    pub waiting: &'s [WaitingSeq],
    /// Tokens per block: the manager's ([`crate::Config::block_size`]).
    pub block_size: u32,
    /// Device blocks free or evictable ([`crate::BlockManager::available_blocks`]).
    pub available_blocks: u32,
    /// Free host-tier blocks (0 without a host tier).
    pub host_free_blocks: u32,
    /// Free sequence slots of the manager (`max_seqs` minus live sequences, swapped-out
    /// ones included): an admission takes one, a swap-in none.
    pub free_seqs: u32,
}

/// Summary of a planned step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct StepPlan {
    /// Actions written to the output buffer.
    pub actions: usize,
    /// Tokens computed this step.
    pub tokens: u32,
    /// Device blocks the step's growth, copy-on-write, swap-ins and admissions take
    /// (idle cached blocks an admission reuses included), not net of preemptions' frees.
    pub blocks_needed: u64,
    /// Preemptions in the plan.
    pub preemptions: u32,
}

/// Why no plan was produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum ScheduleError {
    /// The action buffer is too short; `running + swapped + waiting` entries always suffice.
    OutputTooSmall {
        /// Entries that suffice.
        needed: usize,
    },
    /// `block_size` or `token_budget` is zero.
    ZeroConfig,
}

impl fmt::Display for ScheduleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::OutputTooSmall { needed } => {
                write!(f, "action buffer too small: {needed} entries suffice")
            }
            Self::ZeroConfig => f.write_str("scheduler block size or token budget is zero"),
        }
    }
}

impl core::error::Error for ScheduleError {}

/// Plans one step; see the module docs for the rules. Writes the actions to `out` in
/// the order to execute them (runs and preemptions as decided, then swap-ins, then
/// admissions) and returns a summary.
///
/// Executed in order on the manager whose state `input` describes, every action
/// succeeds: growth counts copy-on-write blocks, admissions count the idle cached blocks
/// they take, swap-ins the blocks they allocate and admissions a sequence slot.
/// All arithmetic on the caller's counts is done in `u64` or saturates, so extreme
/// counts neither panic nor wrap. O(running + swapped + waiting); allocates nothing.
///
/// # Errors
/// [`ScheduleError::OutputTooSmall`] unless `out` has `running + swapped + waiting`
/// entries; [`ScheduleError::ZeroConfig`] for a zero block size or budget.
pub fn schedule(
    config: &SchedulerConfig,
    input: &StepInput<'_>,
    out: &mut [Action],
) -> Result<StepPlan, ScheduleError> {
    let needed = input.running.len() + input.swapped.len() + input.waiting.len();
    if out.len() < needed {
        return Err(ScheduleError::OutputTooSmall { needed });
    }
    let mut n = 0usize;
    let mut plan = schedule_with(config, input, |a| {
        out[n] = a;
        n += 1;
    })?;
    plan.actions = n;
    Ok(plan)
}

/// [`schedule`] handing each action to `emit`, in execution order, instead of writing a
/// buffer (the engine stores them in its own format). At most
/// `running + swapped + waiting` calls. O(running + swapped + waiting).
///
/// # Errors
/// [`ScheduleError::ZeroConfig`] for a zero block size or budget.
pub fn schedule_with(
    config: &SchedulerConfig,
    input: &StepInput<'_>,
    emit: impl FnMut(Action),
) -> Result<StepPlan, ScheduleError> {
    schedule_lazy(config, input, input.waiting.iter().copied(), emit)
}

/// Tokens a sequence holding `held` tokens can append with `available` blocks: the room
/// left in its last block (after copying it first when `cow` is 1) plus whole blocks.
/// O(1).
fn tokens_that_fit(held: u64, available: u64, cow: u64, bs: u64) -> u64 {
    if available < cow {
        return 0;
    }
    let room_in_last = (bs - held % bs) % bs;
    room_in_last + (available - cow) * bs
}

/// [`schedule_with`] taking the waiting requests from `waiting` instead of
/// `input.waiting` (which it ignores): admission is first come, first served and stops at
/// the first request that does not fit, so it draws only the requests it considers —
/// the engine looks up each one's cached prefix only when drawn.
/// O(running + swapped + requests drawn).
///
/// # Errors
/// [`ScheduleError::ZeroConfig`] for a zero block size or budget.
pub(crate) fn schedule_lazy(
    config: &SchedulerConfig,
    input: &StepInput<'_>,
    waiting: impl Iterator<Item = WaitingSeq>,
    mut emit: impl FnMut(Action),
) -> Result<StepPlan, ScheduleError> {
    let bs = u64::from(input.block_size);
    if bs == 0 || config.token_budget == 0 {
        return Err(ScheduleError::ZeroConfig);
    }
    let blocks_for = |tokens: u64| tokens.div_ceil(bs);
    let watermark = u64::from(config.watermark_blocks);
    let mut plan = StepPlan::default();
    let mut available = u64::from(input.available_blocks);
    let mut host_free = u64::from(input.host_free_blocks);
    let mut budget = config.token_budget;
    // Actions are emitted in the order they are decided, which is a valid execution
    // order: a run placed before a preemption only used blocks free at that point.
    let mut actions = 0usize;
    let mut preempted = 0u32;
    let mut end = input.running.len();
    let mut r = 0usize;
    while r < end {
        let seq = input.running[r];
        let mut tokens = seq.pending_tokens.min(budget);
        if tokens == 0 {
            break;
        }
        let held = u64::from(seq.held_tokens);
        let cow = u64::from(seq.cow_blocks.min(1));
        let grow_for = |tokens: u32| blocks_for(held + u64::from(tokens)) - blocks_for(held) + cow;
        let mut grow = grow_for(tokens);
        // Preempt the youngest until this sequence fits. The youngest itself runs the
        // tokens that do fit rather than preempting itself, when any does: a sequence
        // swapped back in with one spare block always advances (no swap ping-pong).
        while grow > available {
            if end - 1 == r {
                let fit = tokens_that_fit(held, available, cow, bs);
                if fit > 0 {
                    tokens = tokens.min(u32::try_from(fit).unwrap_or(u32::MAX));
                    grow = grow_for(tokens);
                    break;
                }
            }
            end -= 1;
            let victim = input.running[end];
            let mode =
                if config.preemption == Preemption::Swap && u64::from(victim.blocks) <= host_free {
                    host_free -= u64::from(victim.blocks);
                    Preemption::Swap
                } else {
                    Preemption::Recompute
                };
            emit(Action::Preempt {
                id: victim.id,
                mode,
            });
            actions += 1;
            preempted += 1;
            available += u64::from(victim.exclusive_blocks);
            if end == r {
                break;
            }
        }
        if end == r {
            break;
        }
        available -= grow;
        budget -= tokens;
        plan.tokens += tokens;
        plan.blocks_needed += grow;
        emit(Action::Run { id: seq.id, tokens });
        actions += 1;
        r += 1;
    }
    plan.preemptions = preempted;
    let mut running = end as u64;
    let max_running = u64::from(config.max_running);
    let mut free_seqs = input.free_seqs;
    if preempted == 0 {
        let mut swapped_left = input.swapped.len();
        for seq in input.swapped {
            let blocks = u64::from(seq.blocks);
            // Its blocks, one spare to grow into, and the watermark.
            if running >= max_running || blocks + 1 + watermark > available {
                break;
            }
            available -= blocks;
            plan.blocks_needed += blocks;
            running += 1;
            swapped_left -= 1;
            emit(Action::SwapIn { id: seq.id });
            actions += 1;
        }
        if swapped_left == 0 {
            for seq in waiting {
                let prompt = u64::from(seq.prompt_tokens);
                // At least one prompt token is always computed.
                let cached = u64::from(seq.cached_tokens).min(prompt.saturating_sub(1)) / bs * bs;
                let cached_blocks = cached / bs;
                let idle = u64::from(seq.cached_idle_blocks).min(cached_blocks);
                let whole = blocks_for(prompt) - cached_blocks;
                let tokens = (prompt - cached).min(u64::from(budget)) as u32;
                if tokens == 0
                    || running >= max_running
                    || free_seqs == 0
                    || whole + idle + watermark > available
                {
                    break;
                }
                let now = blocks_for(cached + u64::from(tokens)) - cached_blocks + idle;
                available -= now;
                budget -= tokens;
                plan.tokens += tokens;
                plan.blocks_needed += now;
                running += 1;
                free_seqs -= 1;
                emit(Action::Admit { id: seq.id, tokens });
                actions += 1;
            }
        }
    }
    plan.actions = actions;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: SchedulerConfig = SchedulerConfig {
        token_budget: 64,
        max_running: 8,
        watermark_blocks: 1,
        preemption: Preemption::Recompute,
    };

    fn running(id: u32, held: u32, pending: u32) -> RunningSeq {
        let blocks = held.div_ceil(16);
        RunningSeq {
            id,
            held_tokens: held,
            pending_tokens: pending,
            exclusive_blocks: blocks,
            blocks,
            cow_blocks: 0,
        }
    }

    fn plan(cfg: &SchedulerConfig, input: StepInput<'_>) -> (StepPlan, [Option<Action>; 8]) {
        let mut out = [Action::SwapIn { id: u32::MAX }; 8];
        let p = schedule(cfg, &input, &mut out).unwrap();
        let mut actions = [None; 8];
        for (a, o) in actions.iter_mut().zip(&out[..p.actions]) {
            *a = Some(*o);
        }
        (p, actions)
    }

    #[test]
    fn decode_then_chunked_prefill_within_the_budget() {
        let run = [running(0, 32, 1), running(1, 16, 1)];
        let wait = [
            WaitingSeq {
                id: 2,
                prompt_tokens: 100,
                cached_tokens: 0,
                cached_idle_blocks: 0,
            },
            WaitingSeq {
                id: 3,
                prompt_tokens: 10,
                cached_tokens: 0,
                cached_idle_blocks: 0,
            },
        ];
        let input = StepInput {
            running: &run,
            swapped: &[],
            waiting: &wait,
            available_blocks: 20,
            host_free_blocks: 0,
            block_size: 16,
            free_seqs: 64,
        };
        let (p, a) = plan(&CFG, input);
        // Two decodes (the second crosses into a new block), then 62 of the 100 prompt
        // tokens as a chunk: the budget is spent, so request 3 waits.
        assert_eq!(a[0], Some(Action::Run { id: 0, tokens: 1 }));
        assert_eq!(a[1], Some(Action::Run { id: 1, tokens: 1 }));
        assert_eq!(a[2], Some(Action::Admit { id: 2, tokens: 62 }));
        assert_eq!(a[3], None);
        assert_eq!((p.tokens, p.blocks_needed, p.preemptions), (64, 2 + 4, 0));
    }

    #[test]
    fn the_youngest_runs_what_fits_before_preempting_itself() {
        // 0 is mid-prefill: 30 tokens held (2 slots left in its second block), 40
        // pending; one block is available, so 2 + 16 tokens fit.
        let run = [running(0, 30, 40)];
        let input = StepInput {
            running: &run,
            swapped: &[],
            waiting: &[],
            available_blocks: 1,
            host_free_blocks: 0,
            block_size: 16,
            free_seqs: 64,
        };
        let (p, a) = plan(&CFG, input);
        assert_eq!(a[0], Some(Action::Run { id: 0, tokens: 18 }));
        assert_eq!(a[1], None);
        assert_eq!((p.tokens, p.blocks_needed, p.preemptions), (18, 1, 0));
        // A shared partial last block is copied first: that takes the available block,
        // leaving the 2 slots of the copy.
        let cow = [RunningSeq {
            cow_blocks: 1,
            ..running(0, 30, 40)
        }];
        let (p, a) = plan(
            &CFG,
            StepInput {
                running: &cow,
                ..input
            },
        );
        assert_eq!(a[0], Some(Action::Run { id: 0, tokens: 2 }));
        assert_eq!((p.tokens, p.blocks_needed, p.preemptions), (2, 1, 0));
        // Nothing fits (a full last block, no block): it is preempted.
        let full = [running(0, 32, 40)];
        let (p, a) = plan(
            &CFG,
            StepInput {
                running: &full,
                available_blocks: 0,
                ..input
            },
        );
        assert_eq!(
            a[0],
            Some(Action::Preempt {
                id: 0,
                mode: Preemption::Recompute
            })
        );
        assert_eq!(a[1], None);
        assert_eq!(p.preemptions, 1);
    }

    #[test]
    fn out_of_blocks_preempts_the_youngest() {
        // Three full-block sequences each need a new block; one block is free.
        let run = [running(0, 16, 1), running(1, 16, 1), running(2, 16, 1)];
        let input = StepInput {
            running: &run,
            swapped: &[],
            waiting: &[],
            available_blocks: 1,
            host_free_blocks: 5,
            block_size: 16,
            free_seqs: 64,
        };
        let (p, a) = plan(&CFG, input);
        // 0 takes the free block; 1 needs one: 2 (youngest) is preempted, freeing one.
        assert_eq!(a[0], Some(Action::Run { id: 0, tokens: 1 }));
        assert_eq!(
            a[1],
            Some(Action::Preempt {
                id: 2,
                mode: Preemption::Recompute
            })
        );
        assert_eq!(a[2], Some(Action::Run { id: 1, tokens: 1 }));
        assert_eq!(a[3], None);
        assert_eq!(p.preemptions, 1);
        // With swap configured and room on the host, the victim is swapped.
        let swap = SchedulerConfig {
            preemption: Preemption::Swap,
            ..CFG
        };
        let (_, a) = plan(&swap, input);
        assert_eq!(
            a[1],
            Some(Action::Preempt {
                id: 2,
                mode: Preemption::Swap
            })
        );
        // Without room on the host, swap falls back to recompute.
        let (_, a) = plan(
            &swap,
            StepInput {
                host_free_blocks: 0,
                ..input
            },
        );
        assert_eq!(
            a[1],
            Some(Action::Preempt {
                id: 2,
                mode: Preemption::Recompute
            })
        );
        // An exactly sized buffer is enough.
        let mut out = [Action::SwapIn { id: 0 }; 3];
        let p = schedule(&CFG, &input, &mut out).unwrap();
        assert_eq!(p.actions, 3);
        assert_eq!(out[2], Action::Run { id: 1, tokens: 1 });
    }

    #[test]
    fn a_lone_sequence_that_cannot_grow_preempts_itself() {
        let run = [running(7, 16, 1)];
        let input = StepInput {
            running: &run,
            swapped: &[],
            waiting: &[],
            available_blocks: 0,
            host_free_blocks: 0,
            block_size: 16,
            free_seqs: 64,
        };
        let (p, a) = plan(&CFG, input);
        assert_eq!(
            a[0],
            Some(Action::Preempt {
                id: 7,
                mode: Preemption::Recompute
            })
        );
        assert_eq!(a[1], None);
        assert_eq!(p.tokens, 0);
    }

    #[test]
    fn swapped_come_back_before_admission_and_block_it() {
        let swapped = [
            SwappedSeq { id: 4, blocks: 3 },
            SwappedSeq { id: 5, blocks: 6 },
        ];
        let wait = [WaitingSeq {
            id: 6,
            prompt_tokens: 5,
            cached_tokens: 0,
            cached_idle_blocks: 0,
        }];
        let input = StepInput {
            running: &[],
            swapped: &swapped,
            waiting: &wait,
            available_blocks: 8,
            host_free_blocks: 0,
            block_size: 16,
            free_seqs: 64,
        };
        let (_, a) = plan(&CFG, input);
        // 4 comes back (3 + 1 spare + 1 watermark <= 8); 5 does not fit, so 6 waits too.
        assert_eq!(a[0], Some(Action::SwapIn { id: 4 }));
        assert_eq!(a[1], None);
    }

    #[test]
    fn fcfs_admission_without_overtaking_and_with_cached_prefix() {
        let wait = [
            WaitingSeq {
                id: 0,
                prompt_tokens: 40,
                cached_tokens: 32,
                cached_idle_blocks: 0,
            },
            WaitingSeq {
                id: 1,
                prompt_tokens: 200,
                cached_tokens: 0,
                cached_idle_blocks: 0,
            },
            WaitingSeq {
                id: 2,
                prompt_tokens: 1,
                cached_tokens: 0,
                cached_idle_blocks: 0,
            },
        ];
        let input = StepInput {
            running: &[],
            swapped: &[],
            waiting: &wait,
            available_blocks: 6,
            host_free_blocks: 0,
            block_size: 16,
            free_seqs: 64,
        };
        let (p, a) = plan(&CFG, input);
        // 0 needs 1 block beyond its 2 cached ones and computes 8 tokens; 1 needs 13
        // blocks and does not fit; 2 would fit but may not overtake.
        assert_eq!(a[0], Some(Action::Admit { id: 0, tokens: 8 }));
        assert_eq!(a[1], None);
        assert_eq!(p.blocks_needed, 1);
    }

    #[test]
    fn errors() {
        let mut out = [Action::SwapIn { id: 0 }; 1];
        let run = [running(0, 1, 1), running(1, 1, 1)];
        let input = StepInput {
            running: &run,
            swapped: &[],
            waiting: &[],
            available_blocks: 9,
            host_free_blocks: 0,
            block_size: 16,
            free_seqs: 64,
        };
        assert_eq!(
            schedule(&CFG, &input, &mut out),
            Err(ScheduleError::OutputTooSmall { needed: 2 })
        );
        let zero = SchedulerConfig {
            token_budget: 0,
            ..CFG
        };
        assert_eq!(
            schedule(&zero, &input, &mut [Action::SwapIn { id: 0 }; 2]),
            Err(ScheduleError::ZeroConfig)
        );
    }

    #[test]
    fn copy_on_write_idle_hits_and_sequence_slots_are_counted() {
        // A decode into a shared partial block grows by no block but copies the block
        // first: with no block available it cannot run, with one it can.
        let mut cow = running(0, 20, 1);
        cow.cow_blocks = 1;
        let input = StepInput {
            running: &[cow],
            swapped: &[],
            waiting: &[],
            block_size: 16,
            available_blocks: 0,
            host_free_blocks: 0,
            free_seqs: 4,
        };
        let (p, a) = plan(&CFG, input);
        assert_eq!(
            a[0],
            Some(Action::Preempt {
                id: 0,
                mode: Preemption::Recompute
            })
        );
        assert_eq!(p.tokens, 0);
        let (p, a) = plan(
            &CFG,
            StepInput {
                available_blocks: 1,
                ..input
            },
        );
        assert_eq!(a[0], Some(Action::Run { id: 0, tokens: 1 }));
        assert_eq!(p.blocks_needed, 1);
        // Idle cached blocks a hit takes leave the available count.
        let wait = [
            WaitingSeq {
                id: 1,
                prompt_tokens: 40,
                cached_tokens: 32,
                cached_idle_blocks: 2,
            },
            WaitingSeq {
                id: 2,
                prompt_tokens: 8,
                cached_tokens: 0,
                cached_idle_blocks: 0,
            },
        ];
        let input = StepInput {
            running: &[],
            waiting: &wait,
            available_blocks: 4,
            ..input
        };
        let (p, a) = plan(&CFG, input);
        // 1 takes 2 idle + 1 new block (plus the watermark of 1 must stay): 4 - 3 = 1
        // left, which 2 cannot take above the watermark.
        assert_eq!(a[0], Some(Action::Admit { id: 1, tokens: 8 }));
        assert_eq!(a[1], None);
        assert_eq!(p.blocks_needed, 3);
        // Without a free sequence slot nobody is admitted.
        let (_, a) = plan(
            &CFG,
            StepInput {
                free_seqs: 0,
                available_blocks: 40,
                ..input
            },
        );
        assert_eq!(a[0], None);
    }

    #[test]
    fn extreme_counts_neither_panic_nor_wrap() {
        let big = RunningSeq {
            id: 0,
            held_tokens: u32::MAX,
            pending_tokens: u32::MAX,
            exclusive_blocks: u32::MAX,
            blocks: u32::MAX,
            cow_blocks: u32::MAX,
        };
        let swapped = [SwappedSeq {
            id: 1,
            blocks: u32::MAX,
        }];
        let wait = [WaitingSeq {
            id: 2,
            prompt_tokens: u32::MAX,
            cached_tokens: u32::MAX,
            cached_idle_blocks: u32::MAX,
        }];
        let cfg = SchedulerConfig {
            token_budget: u32::MAX,
            max_running: u32::MAX,
            watermark_blocks: u32::MAX,
            preemption: Preemption::Swap,
        };
        for available in [0, 1, u32::MAX] {
            let input = StepInput {
                running: &[big, big],
                swapped: &swapped,
                waiting: &wait,
                block_size: 1,
                available_blocks: available,
                host_free_blocks: u32::MAX,
                free_seqs: u32::MAX,
            };
            let mut out = [Action::SwapIn { id: 0 }; 4];
            let p = schedule(&cfg, &input, &mut out).unwrap();
            assert!(p.actions <= 4);
            let input = StepInput {
                running: &[],
                swapped: &[],
                ..input
            };
            schedule(&cfg, &input, &mut out).unwrap();
        }
    }
}
