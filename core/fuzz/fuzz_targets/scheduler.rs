//! Arbitrary step inputs, extreme counts included, through `schedule` and
//! `schedule_with`: no panic, no overflow (debug assertions are on), the two agree, and
//! every plan is consistent with its input — replayed action by action against the
//! counts it was given, as a manager in exactly that state would execute it:
//! - runs go to running sequences in order, each its full share of pending tokens and
//!   the budget, and only while their growth (copy-on-write block included) is
//!   available; only the youngest sequence left runs less: exactly the tokens that fit;
//! - preemptions take the youngest not yet run, add back its exclusive blocks, and swap
//!   only with `Preemption::Swap` and room left on the host;
//! - swap-ins and admissions only in a step without preemptions, in order, within the
//!   running limit, above the watermark; admissions only once nothing is swapped out,
//!   each with a free sequence slot and its whole prompt's blocks (less the cached
//!   prefix, plus the idle cached blocks it takes) above the watermark;
//! - the summary (actions, tokens, blocks, preemptions) matches the actions.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use kvpage_core::{
    schedule, schedule_with, Action, Preemption, RunningSeq, ScheduleError, SchedulerConfig,
    StepInput, SwappedSeq, WaitingSeq,
};
use libfuzzer_sys::fuzz_target;

/// A count biased towards the interesting values: small ones and the top of `u32`.
#[derive(Debug, Clone, Copy, Arbitrary)]
enum Count {
    Small(u8),
    Max,
    BelowMax(u8),
    Any(u32),
}

impl Count {
    fn get(self) -> u32 {
        match self {
            Count::Small(x) => u32::from(x % 40),
            Count::Max => u32::MAX,
            Count::BelowMax(x) => u32::MAX - u32::from(x),
            Count::Any(x) => x,
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Input {
    token_budget: Count,
    max_running: Count,
    watermark: Count,
    swap: bool,
    block_size: Count,
    available: Count,
    host_free: Count,
    free_seqs: Count,
    /// How much shorter than needed the action buffer is (0: exact; the rest of the
    /// values mostly give a long enough buffer).
    out_short: u8,
    running: Vec<[Count; 6]>,
    swapped: Vec<Count>,
    waiting: Vec<[Count; 4]>,
}

fn blocks_for(tokens: u64, bs: u64) -> u64 {
    tokens.div_ceil(bs)
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    // Ids are the position in their list (offset per list), so an action names exactly
    // one entry of the input.
    let running: Vec<RunningSeq> = input
        .running
        .iter()
        .take(64)
        .enumerate()
        .map(|(i, c)| RunningSeq {
            id: i as u32,
            held_tokens: c[0].get(),
            pending_tokens: c[1].get(),
            exclusive_blocks: c[2].get(),
            blocks: c[3].get(),
            cow_blocks: c[4].get() % 3,
        })
        .collect();
    let swapped: Vec<SwappedSeq> = input
        .swapped
        .iter()
        .take(64)
        .enumerate()
        .map(|(i, c)| SwappedSeq {
            id: 1000 + i as u32,
            blocks: c.get(),
        })
        .collect();
    let waiting: Vec<WaitingSeq> = input
        .waiting
        .iter()
        .take(64)
        .enumerate()
        .map(|(i, c)| WaitingSeq {
            id: 2000 + i as u32,
            prompt_tokens: c[0].get(),
            cached_tokens: c[1].get(),
            cached_idle_blocks: c[2].get(),
        })
        .collect();
    let config = SchedulerConfig {
        token_budget: input.token_budget.get(),
        max_running: input.max_running.get(),
        watermark_blocks: input.watermark.get(),
        preemption: if input.swap {
            Preemption::Swap
        } else {
            Preemption::Recompute
        },
    };
    let step = StepInput {
        running: &running,
        swapped: &swapped,
        waiting: &waiting,
        block_size: input.block_size.get(),
        available_blocks: input.available.get(),
        host_free_blocks: input.host_free.get(),
        free_seqs: input.free_seqs.get(),
    };
    let needed = running.len() + swapped.len() + waiting.len();
    let short = match input.out_short {
        s @ 0..=3 => usize::from(s),
        _ => 0,
    };
    let mut out = vec![Action::SwapIn { id: u32::MAX }; needed.saturating_sub(short)];
    let result = schedule(&config, &step, &mut out);
    let mut emitted = Vec::new();
    let with = schedule_with(&config, &step, |a| emitted.push(a));

    if out.len() < needed {
        assert_eq!(result, Err(ScheduleError::OutputTooSmall { needed }));
        return;
    }
    if step.block_size == 0 || config.token_budget == 0 {
        assert_eq!(result, Err(ScheduleError::ZeroConfig));
        assert_eq!(with, Err(ScheduleError::ZeroConfig));
        assert!(emitted.is_empty());
        return;
    }
    let plan = result.expect("a valid input gets a plan");
    let actions = &out[..plan.actions];
    assert_eq!(with.expect("schedule_with agrees").actions, plan.actions);
    assert_eq!(
        emitted.as_slice(),
        actions,
        "schedule and schedule_with disagree"
    );
    assert!(plan.actions <= needed);

    // Replay the plan against the counts it was given.
    let bs = u64::from(step.block_size);
    let watermark = u64::from(config.watermark_blocks);
    let mut available = u64::from(step.available_blocks);
    let mut host_free = u64::from(step.host_free_blocks);
    let mut budget = u64::from(config.token_budget);
    let mut free_seqs = step.free_seqs;
    let (mut next_run, mut end) = (0usize, running.len());
    let (mut next_swap, mut next_wait) = (0usize, 0usize);
    let (mut tokens, mut blocks, mut preemptions) = (0u64, 0u64, 0u32);
    let mut phase = 0; // 0: runs and preemptions, 1: swap-ins, 2: admissions.
    for (k, a) in actions.iter().enumerate() {
        match *a {
            Action::Run { id, tokens: t } => {
                assert_eq!(phase, 0, "action {k}: run after swap-ins or admissions");
                assert!(next_run < end, "action {k}: run of a preempted sequence");
                let s = running[next_run];
                assert_eq!(id, s.id, "action {k}: runs out of order");
                assert!(t >= 1 && t <= s.pending_tokens && u64::from(t) <= budget);
                let held = u64::from(s.held_tokens);
                let cow = u64::from(s.cow_blocks.min(1));
                let grow_for = |t: u64| blocks_for(held + t, bs) - blocks_for(held, bs) + cow;
                let share = u64::from(s.pending_tokens).min(budget);
                if u64::from(t) < share {
                    // Only the youngest left runs less than its share: exactly what fits
                    // (the room in its last block, after copying it, plus whole blocks).
                    assert_eq!(
                        next_run + 1,
                        end,
                        "action {k}: a short run not the youngest"
                    );
                    assert!(
                        grow_for(share) > available,
                        "action {k}: a short run that fit"
                    );
                    let room = (bs - held % bs) % bs;
                    let fit = room + (available - cow) * bs;
                    assert_eq!(u64::from(t), fit, "action {k}: not what fits");
                }
                let grow = grow_for(u64::from(t));
                assert!(
                    grow <= available,
                    "action {k}: growth {grow} > {available} available"
                );
                available -= grow;
                budget -= u64::from(t);
                tokens += u64::from(t);
                blocks += grow;
                next_run += 1;
            }
            Action::Preempt { id, mode } => {
                assert_eq!(
                    phase, 0,
                    "action {k}: preemption after swap-ins or admissions"
                );
                assert!(end > next_run, "action {k}: preempts a sequence that ran");
                end -= 1;
                let victim = running[end];
                assert_eq!(id, victim.id, "action {k}: not the youngest");
                let fits = u64::from(victim.blocks) <= host_free;
                let expect = if config.preemption == Preemption::Swap && fits {
                    Preemption::Swap
                } else {
                    Preemption::Recompute
                };
                assert_eq!(mode, expect, "action {k}: preemption mode");
                if mode == Preemption::Swap {
                    host_free -= u64::from(victim.blocks);
                }
                available += u64::from(victim.exclusive_blocks);
                preemptions += 1;
            }
            Action::SwapIn { id } => {
                assert!(phase <= 1, "action {k}: swap-in after an admission");
                phase = 1;
                assert_eq!(
                    preemptions, 0,
                    "action {k}: swap-in in a step with preemptions"
                );
                let s = swapped[next_swap];
                assert_eq!(id, s.id, "action {k}: swap-ins out of order");
                let running_now = end + next_swap + next_wait;
                assert!((running_now as u64) < u64::from(config.max_running));
                let b = u64::from(s.blocks);
                assert!(
                    b + 1 + watermark <= available,
                    "action {k}: swap-in does not fit"
                );
                available -= b;
                blocks += b;
                next_swap += 1;
            }
            Action::Admit { id, tokens: t } => {
                phase = 2;
                assert_eq!(
                    preemptions, 0,
                    "action {k}: admission in a step with preemptions"
                );
                assert_eq!(
                    next_swap,
                    swapped.len(),
                    "action {k}: admission while swapped out"
                );
                let w = waiting[next_wait];
                assert_eq!(id, w.id, "action {k}: admissions out of order");
                let running_now = end + next_swap + next_wait;
                assert!((running_now as u64) < u64::from(config.max_running));
                assert!(
                    free_seqs > 0,
                    "action {k}: admission without a sequence slot"
                );
                free_seqs -= 1;
                let prompt = u64::from(w.prompt_tokens);
                let cached = u64::from(w.cached_tokens).min(prompt.saturating_sub(1)) / bs * bs;
                let cached_blocks = cached / bs;
                let idle = u64::from(w.cached_idle_blocks).min(cached_blocks);
                assert!(t >= 1 && u64::from(t) <= budget && u64::from(t) <= prompt - cached);
                let whole = blocks_for(prompt, bs) - cached_blocks;
                assert!(
                    whole + idle + watermark <= available,
                    "action {k}: prompt does not fit"
                );
                let now = blocks_for(cached + u64::from(t), bs) - cached_blocks + idle;
                available -= now;
                budget -= u64::from(t);
                tokens += u64::from(t);
                blocks += now;
                next_wait += 1;
            }
        }
    }
    assert_eq!(u64::from(plan.tokens), tokens);
    assert!(tokens <= u64::from(config.token_budget));
    assert_eq!(plan.blocks_needed, blocks);
    assert_eq!(plan.preemptions, preemptions);
    // Running sequences stop only for lack of budget (or a sequence with nothing to do).
    if preemptions == 0 && next_run < end {
        assert_eq!(u64::from(running[next_run].pending_tokens).min(budget), 0);
    }
});
