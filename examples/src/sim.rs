//! The replay engine: continuous batching over simulated time, with kvpage's scheduler
//! policy ([`kvpage_core::schedule`]) deciding every step, generic over the KV memory
//! policy.
//!
//! # The model
//! A request has `P` prompt tokens and `G` output tokens. Admitted, it computes its prompt
//! in chunks that fit the per-step token budget, each chunk taking KV memory from the
//! [`KvPolicy`] as it is computed; the step that completes the prefill emits the first
//! output token. Each later step decodes: the last output token's K/V is computed (one
//! more token of memory) and the next token is emitted. A request is done, and releases
//! its memory, when it has emitted `G` tokens; it then holds `P + G − 1` tokens of KV.
//!
//! # The scheduler
//! Every step the engine describes its running, swapped-out and waiting sequences to
//! [`kvpage_core::schedule`] — with the policy's free blocks, watermark and block size —
//! and executes the actions it returns, in order: preemptions (of the most recently
//! admitted, by swap when configured and the host tier has room, else by recompute:
//! memory freed, the sequence back at the front of the waiting queue to prefill prompt
//! and output so far again), runs (prefill chunks and decode tokens within the token
//! budget), swap-ins (they run from the next step) and first-come-first-served
//! admissions. The same scheduler drives every memory policy: the contiguous baseline
//! presents one `max_seq_len` region as its "block" and the regions its holes can still
//! hold as its free blocks, so it differs from the paged policies only in memory.
//!
//! Step time comes from a [`StepCost`]; memory and counts are sampled after the step's
//! actions (when its memory is allocated) and integrated over the step's duration. When
//! nothing runs, time jumps to the next arrival.
//!
//! Errors: a policy bug or a request that can never be admitted is a [`SimError`], not a
//! panic and not an endless loop.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

pub use kvpage_core::Preemption;
use kvpage_core::{
    schedule, Action, RunningSeq, SchedulerConfig, StepInput, SwappedSeq, WaitingSeq,
};

use crate::metrics::{percentile, Extra, Report};
use crate::rng::{mix, SplitMix64};
use crate::step_model::{BatchShape, StepCost};
use crate::trace::Request;

/// Why a policy could not do what was asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyError {
    /// Not enough memory now; the engine waits or preempts.
    NoRoom,
    /// A bug or an impossible request: the replay stops with this message.
    Internal(String),
}

/// A policy's memory, sampled once per step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// KV bytes reserved by running sequences.
    pub reserved_bytes: u64,
    /// Tokens stored in reserved memory (a shared block's tokens counted once).
    pub stored_tokens: u64,
    /// Token slots in reserved memory.
    pub slot_tokens: u64,
    /// Free bytes no sequence can use (holes too small for a region, the budget's tail
    /// below one block).
    pub unusable_free_bytes: u64,
    /// The largest amount one new sequence could get right now (largest hole, or all
    /// free and cached blocks).
    pub largest_free_bytes: u64,
    /// Bytes held in the host tier.
    pub host_bytes: u64,
}

/// A KV memory policy: how sequences get, grow, give back and swap their cache memory.
/// Sequence ids are the request ids of the replay (`0..n`). Memory is counted in blocks
/// of [`KvPolicy::block_tokens`] tokens for the scheduler.
pub trait KvPolicy {
    /// Whether token ids must be passed (prefix caching). Default: no.
    fn needs_tokens(&self) -> bool {
        false
    }
    /// Bytes of KV memory the policy manages.
    fn budget_bytes(&self) -> u64;
    /// Tokens per block, as the scheduler counts them.
    fn block_tokens(&self) -> u32;
    /// Blocks a new allocation could take now (free plus evictable).
    fn available_blocks(&self) -> u32;
    /// Blocks admissions and swap-ins must leave free. Default: 0.
    fn watermark_blocks(&self) -> u32 {
        0
    }
    /// Free blocks of the host tier. Default: 0 (no host tier).
    fn host_free_blocks(&self) -> u32 {
        0
    }
    /// Leading tokens of `tokens` an admission would find cached. Default: 0.
    fn cached_prefix_tokens(&self, _tokens: &[u32]) -> u32 {
        0
    }
    /// Blocks only sequence `id` references (what preempting it frees), given that it
    /// holds `blocks`. Default: `blocks`.
    fn exclusive_blocks(&self, _id: u32, blocks: u32) -> u32 {
        blocks
    }
    /// Creates sequence `id` holding `len` tokens (their ids in `tokens` if
    /// [`KvPolicy::needs_tokens`], else `tokens` is empty); returns how many leading ones
    /// came from a prefix cache and need no computing.
    fn admit(&mut self, id: u32, len: u32, tokens: &[u32]) -> Result<u32, PolicyError>;
    /// Grows sequence `id` by `n` tokens (their ids in `tokens` if asked for).
    fn grow(&mut self, id: u32, n: u32, tokens: &[u32]) -> Result<(), PolicyError>;
    /// Frees all memory of sequence `id`.
    fn release(&mut self, id: u32) -> Result<(), PolicyError>;
    /// Moves sequence `id` to the host tier and frees its device memory; returns the
    /// bytes to copy. [`PolicyError::NoRoom`] if there is no host tier or it is full.
    fn swap_out(&mut self, id: u32) -> Result<u64, PolicyError>;
    /// Brings sequence `id` back from the host tier; returns the bytes to copy.
    fn swap_in(&mut self, id: u32) -> Result<u64, PolicyError>;
    /// The memory now. Called every step: should be O(1) or close.
    fn usage(&self) -> Usage;
    /// The step ran: the K/V of the first `tokens` tokens of sequence `id` is computed, so
    /// a prefix cache may share its full blocks from now on. Default: nothing to do.
    fn computed(&mut self, _id: u32, _tokens: u32) -> Result<(), PolicyError> {
        Ok(())
    }
    /// Prompt tokens served from a prefix cache so far.
    fn prefix_hit_tokens(&self) -> u64 {
        0
    }
}

/// Engine limits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineConfig {
    /// Most sequences running at once.
    pub max_num_seqs: u32,
    /// Per-step token budget (prefill chunk tokens plus decode tokens), at least 1.
    pub max_batched_tokens: u32,
    /// How to preempt.
    pub preemption: Preemption,
    /// KV bytes per token (for waste and the memory series).
    pub kv_bytes_per_token: u64,
    /// Record the per-step series for plotting.
    pub record_series: bool,
}

/// Synthetic token ids: the trace has lengths, not text. A request's first
/// `min(shared_prefix_tokens, P)` tokens are the system prompt of its group (one of
/// `groups`, drawn from a seeded generator); every other token is unique to the request.
#[derive(Clone, Debug)]
pub struct TokenSource {
    groups: Vec<u32>,
    prefix_tokens: u32,
    seed: u64,
}

impl TokenSource {
    /// Assigns groups to `n` requests from `seed`. O(n). `groups == 0` or
    /// `prefix_tokens == 0` means no sharing.
    pub fn new(n: usize, prefix_tokens: u32, groups: u32, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let groups = if groups == 0 || prefix_tokens == 0 {
            Vec::new()
        } else {
            (0..n).map(|_| rng.range_u32(0, groups - 1)).collect()
        };
        Self {
            groups,
            prefix_tokens,
            seed,
        }
    }

    /// The group of request `id`, if prompts are shared. O(1).
    pub fn group(&self, id: u32) -> Option<u32> {
        self.groups.get(id as usize).copied()
    }

    /// Token id at position `pos` of request `req`. O(1).
    pub fn token(&self, req: &Request, pos: u32) -> u32 {
        let shared = pos < self.prefix_tokens.min(req.prompt_tokens);
        let stream = match self.group(req.id) {
            Some(g) if shared => u64::from(g) << 1,
            _ => (u64::from(req.id) << 1) | 1,
        };
        mix(self.seed ^ mix(stream.wrapping_add(1) << 32 | u64::from(pos))) as u32
    }
}

/// One step of the run, for observers (the incident table, invariant tests).
#[derive(Clone, Copy, Debug)]
pub struct StepView {
    /// 1-based step number.
    pub step: u64,
    /// Simulated time at the start of the step.
    pub start_s: f64,
    /// Its duration.
    pub dt_s: f64,
    /// Sequences holding device memory this step.
    pub running: usize,
    /// Requests arrived and not admitted.
    pub waiting: usize,
    /// Sequences in the host tier.
    pub swapped: usize,
    /// Memory after this step's allocations.
    pub usage: Usage,
    /// Requests finished before this step.
    pub finished: u64,
    /// Distinct requests admitted at least once, including this step.
    pub admitted: u64,
}

/// A point of the memory/running series.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SeriesPoint {
    /// Simulated time, s.
    pub t_s: f64,
    /// KV bytes reserved.
    pub reserved_bytes: u64,
    /// KV bytes holding tokens (a shared block's counted once).
    pub stored_bytes: u64,
    /// Running sequences.
    pub running: u32,
}

/// What happened to one request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Outcome {
    /// Times it finished (1 for every request after a complete run).
    pub completions: u32,
    /// Time of its first output token, s.
    pub first_token_s: f64,
    /// Time of its last output token, s.
    pub finish_s: f64,
    /// Times it was preempted.
    pub preempted: u32,
}

/// Everything a run produces.
#[derive(Clone, Debug)]
pub struct RunOutput {
    /// The table row.
    pub report: Report,
    /// Per request, by id.
    pub outcomes: Vec<Outcome>,
    /// Per step, if recorded.
    pub series: Vec<SeriesPoint>,
}

/// Why a run stopped.
#[derive(Clone, Debug, PartialEq)]
pub enum SimError {
    /// The policy failed.
    Policy(String),
    /// A request can never be admitted (nothing runs and it still does not fit).
    Stuck {
        /// Trace line of the request at the head of the queue.
        line: usize,
        /// Its prompt plus output tokens.
        tokens: u64,
    },
    /// Request ids must be `0..n` in arrival order.
    BadRequests,
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::Policy(m) => write!(f, "memory policy failed: {m}"),
            SimError::Stuck { line, tokens } => write!(
                f,
                "the request of trace line {line} ({tokens} tokens) cannot be admitted even into an empty cache"
            ),
            SimError::BadRequests => write!(f, "request ids must be 0..n in arrival order"),
        }
    }
}

impl std::error::Error for SimError {}

impl From<PolicyError> for SimError {
    fn from(e: PolicyError) -> Self {
        match e {
            PolicyError::NoRoom => SimError::Policy("out of memory where none was needed".into()),
            PolicyError::Internal(m) => SimError::Policy(m),
        }
    }
}

/// Per-sequence state.
#[derive(Clone, Copy, Debug, Default)]
struct Seq {
    /// Tokens to prefill on this admission (prompt plus output so far).
    target: u32,
    /// KV tokens held (computed or served by the prefix cache).
    held: u32,
    /// Output tokens emitted.
    generated: u32,
    admitted_once: bool,
}

impl Seq {
    fn pending(&self) -> u32 {
        if self.held < self.target {
            self.target - self.held
        } else {
            1
        }
    }
}

/// Optional hooks of a run.
#[derive(Default)]
pub struct Hooks<'a> {
    /// Incremented once per finished request (progress bars).
    pub progress: Option<&'a AtomicU64>,
    /// Called after every step's actions.
    pub observer: Option<&'a mut dyn FnMut(&StepView)>,
}

/// Fills `buf` with the token ids of positions `from..to` of `req`.
fn fill_tokens(buf: &mut Vec<u32>, tokens: &TokenSource, req: &Request, from: u32, to: u32) {
    buf.clear();
    buf.extend((from..to).map(|p| tokens.token(req, p)));
}

/// Replays `requests` (ids `0..n`, sorted by arrival) through `policy`, scheduled by
/// [`kvpage_core::schedule`]. O(steps × (running + admitted candidates)) plus the
/// policy's own costs.
///
/// # Errors
/// [`SimError`] if the policy or the scheduler fails, a request can never be admitted, or
/// the ids are not `0..n` in arrival order.
pub fn run(
    name: &str,
    requests: &[Request],
    policy: &mut dyn KvPolicy,
    cost: &dyn StepCost,
    cfg: &EngineConfig,
    tokens: &TokenSource,
    mut hooks: Hooks<'_>,
) -> Result<RunOutput, SimError> {
    let n = requests.len();
    if requests.iter().enumerate().any(|(i, r)| r.id as usize != i)
        || requests.windows(2).any(|w| w[1].arrival_s < w[0].arrival_s)
    {
        return Err(SimError::BadRequests);
    }
    let bt = policy.block_tokens();
    let sched = SchedulerConfig {
        token_budget: cfg.max_batched_tokens.max(1),
        max_running: cfg.max_num_seqs.max(1),
        watermark_blocks: policy.watermark_blocks(),
        preemption: cfg.preemption,
    };
    let needs_tokens = policy.needs_tokens();
    let mut seqs = vec![Seq::default(); n];
    let mut outcomes = vec![Outcome::default(); n];
    let mut waiting: VecDeque<u32> = VecDeque::new();
    let mut swapped: VecDeque<u32> = VecDeque::new();
    let mut running: Vec<u32> = Vec::new();
    let mut in_running: Vec<RunningSeq> = Vec::new();
    let mut in_swapped: Vec<SwappedSeq> = Vec::new();
    let mut in_waiting: Vec<WaitingSeq> = Vec::new();
    let mut actions: Vec<Action> = Vec::new();
    let mut emit: Vec<u32> = Vec::new(); // sequences that emit a token this step
    let mut preempted_ids: Vec<u32> = Vec::new();
    let mut joined: Vec<u32> = Vec::new();
    // (sequence, tokens it holds) for every sequence that computed tokens this step.
    let mut computed: Vec<(u32, u32)> = Vec::new();
    let mut tok_buf: Vec<u32> = Vec::new();
    let mut series = Vec::new();
    let mut next = 0usize;
    let mut now = 0.0f64;
    let mut finished = 0u64;
    let mut admitted = 0u64;
    let mut stalls = 0u32;
    let mut ex = Extra {
        budget_bytes: policy.budget_bytes(),
        ..Extra::default()
    };
    let (mut preemptions, mut peak_running) = (0u64, 0u64);
    let (mut i_running, mut i_stored, mut i_slots, mut i_waste) = (0.0, 0.0, 0.0, 0.0);
    let bpt = cfg.kv_bytes_per_token as f64;
    let policy_err = |e: PolicyError| SimError::from(e);

    while finished < n as u64 {
        while next < n && requests[next].arrival_s <= now {
            waiting.push_back(next as u32);
            next += 1;
        }

        // Describe the state to the scheduler.
        in_running.clear();
        for &id in &running {
            let s = &seqs[id as usize];
            let blocks = s.held.div_ceil(bt);
            in_running.push(RunningSeq {
                id,
                held_tokens: s.held,
                pending_tokens: s.pending(),
                exclusive_blocks: policy.exclusive_blocks(id, blocks),
                blocks,
                cow_blocks: 0,
            });
        }
        in_swapped.clear();
        in_swapped.extend(swapped.iter().map(|&id| SwappedSeq {
            id,
            blocks: seqs[id as usize].held.div_ceil(bt),
        }));
        // Only the head of the queue can be admitted this step: pass the requests that
        // could fit under optimistic bounds (all free blocks, the whole token budget), and
        // the first that could not, so the scheduler sees where admission stops.
        in_waiting.clear();
        let mut avail = u64::from(policy.available_blocks());
        let mut budget = u64::from(sched.token_budget);
        let room = (sched.max_running as usize).saturating_sub(running.len());
        for &id in waiting.iter().take(room.saturating_add(1)) {
            let req = &requests[id as usize];
            let s = &seqs[id as usize];
            let target = if s.admitted_once {
                s.target
            } else {
                req.prompt_tokens
            };
            let cached = if needs_tokens {
                fill_tokens(&mut tok_buf, tokens, req, 0, target);
                policy.cached_prefix_tokens(&tok_buf)
            } else {
                0
            };
            in_waiting.push(WaitingSeq {
                id,
                prompt_tokens: target,
                cached_tokens: cached,
                cached_idle_blocks: 0,
            });
            let cached = cached.min(target.saturating_sub(1));
            let whole = u64::from(target.div_ceil(bt) - cached / bt);
            let chunk = u64::from(target - cached).min(budget);
            if chunk == 0 || whole + u64::from(sched.watermark_blocks) > avail {
                break;
            }
            avail -= u64::from((cached + chunk as u32).div_ceil(bt) - cached / bt);
            budget -= chunk;
        }
        actions.resize(
            in_running.len() + in_swapped.len() + in_waiting.len(),
            Action::SwapIn { id: u32::MAX },
        );
        let plan = schedule(
            &sched,
            &StepInput {
                running: &in_running,
                swapped: &in_swapped,
                waiting: &in_waiting,
                block_size: bt,
                available_blocks: policy.available_blocks(),
                host_free_blocks: policy.host_free_blocks(),
                free_seqs: u32::MAX,
            },
            &mut actions,
        )
        .map_err(|e| SimError::Policy(format!("scheduler: {e}")))?;

        // Execute the plan.
        let mut shape = BatchShape::default();
        emit.clear();
        preempted_ids.clear();
        joined.clear();
        computed.clear();
        for &a in &actions[..plan.actions] {
            match a {
                Action::Preempt { id, mode } => {
                    preemptions += 1;
                    outcomes[id as usize].preempted += 1;
                    preempted_ids.push(id);
                    let mut done = false;
                    if mode == Preemption::Swap {
                        match policy.swap_out(id) {
                            Ok(bytes) => {
                                shape.swap_bytes += bytes;
                                ex.swap_bytes += bytes;
                                ex.swaps += 1;
                                swapped.push_front(id);
                                done = true;
                            }
                            Err(PolicyError::NoRoom) => {}
                            Err(e) => return Err(policy_err(e)),
                        }
                    }
                    if !done {
                        policy.release(id).map_err(policy_err)?;
                        let s = &mut seqs[id as usize];
                        s.target = requests[id as usize].prompt_tokens + s.generated;
                        s.held = 0;
                        waiting.push_front(id);
                    }
                }
                Action::Run { id, tokens: t } => {
                    let req = &requests[id as usize];
                    let s = seqs[id as usize];
                    tok_buf.clear();
                    if needs_tokens {
                        fill_tokens(&mut tok_buf, tokens, req, s.held, s.held + t);
                    }
                    match policy.grow(id, t, &tok_buf) {
                        Ok(()) => {}
                        // The plan counted on blocks a prefix hit or an eviction changed:
                        // the sequence skips this step.
                        Err(PolicyError::NoRoom) => continue,
                        Err(e) => return Err(policy_err(e)),
                    }
                    shape.add_run(u64::from(s.held), u64::from(t));
                    let s = &mut seqs[id as usize];
                    let was_prefill = s.held < s.target;
                    s.held += t;
                    computed.push((id, s.held));
                    if !was_prefill || s.held >= s.target {
                        emit.push(id);
                    }
                }
                Action::SwapIn { id } => {
                    let bytes = policy.swap_in(id).map_err(policy_err)?;
                    shape.swap_bytes += bytes;
                    ex.swap_bytes += bytes;
                    if let Some(pos) = swapped.iter().position(|&x| x == id) {
                        swapped.remove(pos);
                    }
                    joined.push(id);
                }
                Action::Admit { id, tokens: t } => {
                    let req = &requests[id as usize];
                    let s = seqs[id as usize];
                    let target = if s.admitted_once {
                        s.target
                    } else {
                        req.prompt_tokens
                    };
                    let predicted = in_waiting
                        .iter()
                        .find(|w| w.id == id)
                        .map_or(0, |w| w.cached_tokens.min(target.saturating_sub(1)));
                    let len = (predicted + t).min(target);
                    tok_buf.clear();
                    if needs_tokens {
                        fill_tokens(&mut tok_buf, tokens, req, 0, len);
                    }
                    let hit = match policy.admit(id, len, &tok_buf) {
                        Ok(h) => h.min(len),
                        // The plan's view of the cache went stale this step: wait.
                        Err(PolicyError::NoRoom) => break,
                        Err(e) => return Err(policy_err(e)),
                    };
                    if waiting.front() == Some(&id) {
                        waiting.pop_front();
                    } else if let Some(pos) = waiting.iter().position(|&x| x == id) {
                        waiting.remove(pos);
                    }
                    if s.admitted_once {
                        ex.recomputed_tokens += u64::from(len - hit);
                    } else {
                        admitted += 1;
                    }
                    seqs[id as usize] = Seq {
                        target,
                        held: len,
                        generated: s.generated,
                        admitted_once: true,
                    };
                    shape.add_run(u64::from(hit), u64::from(len - hit));
                    computed.push((id, len));
                    if len >= target {
                        emit.push(id);
                    }
                    joined.push(id);
                }
            }
        }
        if !preempted_ids.is_empty() {
            running.retain(|id| !preempted_ids.contains(id));
        }
        running.extend_from_slice(&joined);
        // The step's K/V is computed once the step has run: only now may other prompts
        // share it (a prefix hit within the same step would read K/V not yet written).
        for &(id, held) in &computed {
            if !preempted_ids.contains(&id) {
                policy.computed(id, held).map_err(policy_err)?;
            }
        }

        let usage = policy.usage();
        if shape.tokens == 0 && shape.swap_bytes == 0 {
            if running.is_empty() && swapped.is_empty() && waiting.is_empty() && next < n {
                // Idle: jump to the next arrival.
                let t = requests[next].arrival_s;
                i_waste += (t - now) * (usage.unusable_free_bytes as f64);
                now = t;
                stalls = 0;
                continue;
            }
            stalls += 1;
            if stalls > 2 {
                let id = waiting.front().or(swapped.front()).copied().unwrap_or(0);
                let r = &requests[id as usize];
                return Err(SimError::Stuck {
                    line: r.line,
                    tokens: r.total_tokens(),
                });
            }
            continue;
        }
        stalls = 0;

        let dt = cost.step_seconds(&shape);
        ex.steps += 1;
        peak_running = peak_running.max(running.len() as u64);
        ex.peak_reserved_bytes = ex.peak_reserved_bytes.max(usage.reserved_bytes);
        i_running += dt * running.len() as f64;
        i_stored += dt * usage.stored_tokens as f64;
        i_slots += dt * usage.slot_tokens as f64;
        let waste = (usage.slot_tokens.saturating_sub(usage.stored_tokens)) as f64 * bpt
            + usage.unusable_free_bytes as f64;
        i_waste += dt * waste;
        if let Some(obs) = hooks.observer.as_mut() {
            obs(&StepView {
                step: ex.steps,
                start_s: now,
                dt_s: dt,
                running: running.len(),
                waiting: waiting.len(),
                swapped: swapped.len(),
                usage,
                finished,
                admitted,
            });
        }
        if cfg.record_series {
            series.push(SeriesPoint {
                t_s: now,
                reserved_bytes: usage.reserved_bytes,
                stored_bytes: usage.stored_tokens * cfg.kv_bytes_per_token,
                running: running.len() as u32,
            });
        }
        now += dt;

        // Emitted tokens and completions.
        let mut any_done = false;
        for &id in &emit {
            let s = &mut seqs[id as usize];
            s.generated += 1;
            ex.generated_tokens += 1;
            let o = &mut outcomes[id as usize];
            if s.generated == 1 {
                o.first_token_s = now;
            }
            if s.generated >= requests[id as usize].output_tokens {
                policy.release(id).map_err(policy_err)?;
                o.completions += 1;
                o.finish_s = now;
                finished += 1;
                any_done = true;
                if let Some(p) = hooks.progress {
                    p.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if any_done {
            running.retain(|&id| seqs[id as usize].generated < requests[id as usize].output_tokens);
        }
    }

    if cfg.record_series {
        let u = policy.usage();
        series.push(SeriesPoint {
            t_s: now,
            reserved_bytes: u.reserved_bytes,
            stored_bytes: u.stored_tokens * cfg.kv_bytes_per_token,
            running: 0,
        });
    }
    let mut ttft: Vec<f64> = Vec::with_capacity(n);
    let mut lat: Vec<f64> = Vec::with_capacity(n);
    for (r, o) in requests.iter().zip(&outcomes) {
        ttft.push(o.first_token_s - r.arrival_s);
        lat.push(o.finish_s - r.arrival_s);
    }
    ttft.sort_by(f64::total_cmp);
    lat.sort_by(f64::total_cmp);
    ex.makespan_s = now;
    let span = if now > 0.0 { now } else { f64::NAN };
    let report = Report {
        policy: name.to_string(),
        completed: finished,
        tokens_per_s: ex.generated_tokens as f64 / span,
        peak_running,
        mean_running: i_running / span,
        kv_utilization: if i_slots > 0.0 {
            i_stored / i_slots
        } else {
            f64::NAN
        },
        waste_fraction: i_waste / (span * ex.budget_bytes.max(1) as f64),
        ttft_p50_s: percentile(&ttft, 50.0),
        ttft_p99_s: percentile(&ttft, 99.0),
        latency_p50_s: percentile(&lat, 50.0),
        latency_p99_s: percentile(&lat, 99.0),
        preemptions,
        prefix_hit_tokens: policy.prefix_hit_tokens(),
        extra: ex,
    };
    Ok(RunOutput {
        report,
        outcomes,
        series,
    })
}
