//! The replay engine: continuous batching over simulated time, generic over the KV
//! memory policy.
//!
//! # The model
//! A request has `P` prompt tokens and `G` output tokens. Admitted, it gets KV memory for
//! its prompt from the [`KvPolicy`] and prefills it, in chunks that fit the per-step token
//! budget; the step that finishes the prefill emits the first output token. Each later
//! step decodes: the sequence first grows by one KV slot (the last output token), then
//! emits the next token. A request is done, and releases its memory, when it has emitted
//! `G` tokens; it then holds `P + G − 1` tokens of KV.
//!
//! # The scheduler (examples-side)
//! Each step, in this order:
//! 1. **Running** sequences, oldest admission first, take their share of the token
//!    budget: a prefill chunk or one decode token. A decode that finds no free memory
//!    preempts the most recently admitted running sequence (possibly itself) and retries:
//!    by **swap** (its KV moves to the host tier; it resumes first when room returns) or,
//!    when swapping is off or the host tier is full, by **recompute** (its memory is freed
//!    and it goes back to the front of the waiting queue; prompt and tokens generated so
//!    far are prefilled again).
//! 2. If nobody was preempted this step, swapped-out sequences come back, oldest first.
//! 3. If nobody was preempted and nothing is swapped out, waiting requests are admitted
//!    first come, first served while the token budget, `max_num_seqs` and the policy's
//!    memory allow; the first that does not fit blocks the rest (no overtaking).
//!
//! Step time comes from a [`StepCost`]; memory and counts are sampled after scheduling
//! (when the step's memory is allocated) and integrated over the step's duration. When
//! nothing runs, time jumps to the next arrival.
//!
//! Errors: a policy bug or a request that can never be admitted is a [`SimError`], not a
//! panic and not an endless loop.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::metrics::{percentile, Extra, Report};
use crate::rng::{mix, SplitMix64};
use crate::step_model::{BatchShape, StepCost};
use crate::trace::Request;

/// How a running sequence gives back its memory when another needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preemption {
    /// Free its memory; prefill prompt and output so far again later.
    Recompute,
    /// Move its KV to the host tier; bring it back later. Falls back to recompute when the
    /// policy has no host tier or it is full.
    Swap,
}

/// Why a policy could not do what was asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyError {
    /// Not enough memory now; the engine waits or preempts.
    NoRoom,
    /// A bug or an impossible request: the replay stops with this message.
    Internal(String),
}

/// The prompt a sequence is admitted with.
#[derive(Clone, Copy, Debug)]
pub struct Prompt<'a> {
    /// Tokens to hold.
    pub len: u32,
    /// Their ids, if the policy asked for them ([`KvPolicy::needs_tokens`]); else empty.
    pub tokens: &'a [u32],
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
/// Sequence ids are the request ids of the replay (`0..n`).
pub trait KvPolicy {
    /// Whether [`Prompt::tokens`] must be filled (prefix caching). Default: no.
    fn needs_tokens(&self) -> bool {
        false
    }
    /// Bytes of KV memory the policy manages.
    fn budget_bytes(&self) -> u64;
    /// Reserves memory for a new sequence `id` holding `prompt.len` tokens; returns how
    /// many leading prompt tokens are already cached (need no prefill, at most `len − 1`).
    fn admit(&mut self, id: u32, prompt: Prompt<'_>) -> Result<u32, PolicyError>;
    /// Grows sequence `id` by one token, whose id is `token`.
    fn grow(&mut self, id: u32, token: u32) -> Result<(), PolicyError>;
    /// Frees all memory of sequence `id`.
    fn release(&mut self, id: u32) -> Result<(), PolicyError>;
    /// Moves sequence `id` to the host tier and frees its device memory; returns the
    /// bytes to copy. [`PolicyError::NoRoom`] if there is no host tier or it is full.
    fn swap_out(&mut self, id: u32) -> Result<u64, PolicyError>;
    /// Brings sequence `id` back from the host tier; returns the bytes to copy.
    fn swap_in(&mut self, id: u32) -> Result<u64, PolicyError>;
    /// The memory now. Called every step: should be O(1) or close.
    fn usage(&self) -> Usage;
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
    /// KV bytes per token (for the memory-over-time series).
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
    /// Of which done (or served by the prefix cache).
    prefilled: u32,
    /// KV tokens held.
    kv_len: u32,
    /// Output tokens emitted.
    generated: u32,
    admitted_once: bool,
}

/// Optional hooks of a run.
#[derive(Default)]
pub struct Hooks<'a> {
    /// Incremented once per finished request (progress bars).
    pub progress: Option<&'a AtomicU64>,
    /// Called after every step's scheduling.
    pub observer: Option<&'a mut dyn FnMut(&StepView)>,
}

/// Replays `requests` (ids `0..n`, sorted by arrival) through `policy`.
/// O(steps × running) plus the policy's own costs.
///
/// # Errors
/// [`SimError`] if the policy fails, a request can never be admitted, or the ids are not
/// `0..n` in arrival order.
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
    let budget_tokens = u64::from(cfg.max_batched_tokens.max(1));
    let mut seqs = vec![Seq::default(); n];
    let mut outcomes = vec![Outcome::default(); n];
    let mut waiting: VecDeque<u32> = VecDeque::new();
    let mut swapped: VecDeque<u32> = VecDeque::new();
    let mut running: Vec<u32> = Vec::new();
    let mut batch: Vec<(u32, u32, bool)> = Vec::new(); // (id, tokens, is_prefill)
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

    while finished < n as u64 {
        while next < n && requests[next].arrival_s <= now {
            waiting.push_back(next as u32);
            next += 1;
        }
        let mut budget = budget_tokens;
        let mut shape = BatchShape::default();
        let mut preempted = false;
        batch.clear();

        // 1. Running sequences.
        let mut i = 0;
        while i < running.len() && budget > 0 {
            let id = running[i];
            let s = seqs[id as usize];
            if s.prefilled < s.target {
                let c = (u64::from(s.target - s.prefilled)).min(budget) as u32;
                batch.push((id, c, true));
                shape.add_run(u64::from(s.prefilled), u64::from(c));
                budget -= u64::from(c);
                i += 1;
                continue;
            }
            let tok = tokens.token(&requests[id as usize], s.kv_len);
            match policy.grow(id, tok) {
                Ok(()) => {
                    batch.push((id, 1, false));
                    shape.add_run(u64::from(s.kv_len), 1);
                    seqs[id as usize].kv_len += 1;
                    budget -= 1;
                    i += 1;
                }
                Err(PolicyError::NoRoom) => {
                    let Some(victim) = running.pop() else { break };
                    preempted = true;
                    preemptions += 1;
                    outcomes[victim as usize].preempted += 1;
                    let mut done = false;
                    if cfg.preemption == Preemption::Swap {
                        match policy.swap_out(victim) {
                            Ok(bytes) => {
                                shape.swap_bytes += bytes;
                                ex.swap_bytes += bytes;
                                ex.swaps += 1;
                                swapped.push_front(victim);
                                done = true;
                            }
                            Err(PolicyError::NoRoom) => {}
                            Err(e) => return Err(e.into()),
                        }
                    }
                    if !done {
                        policy.release(victim)?;
                        let v = &mut seqs[victim as usize];
                        v.target = requests[victim as usize].prompt_tokens + v.generated;
                        v.prefilled = 0;
                        v.kv_len = 0;
                        waiting.push_front(victim);
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }

        // 2. Swapped-out sequences come back and run in this step if they can.
        if !preempted {
            while let Some(&id) = swapped.front() {
                if running.len() >= cfg.max_num_seqs as usize || budget == 0 {
                    break;
                }
                match policy.swap_in(id) {
                    Ok(bytes) => {
                        swapped.pop_front();
                        shape.swap_bytes += bytes;
                        ex.swap_bytes += bytes;
                        running.push(id);
                    }
                    Err(PolicyError::NoRoom) => break,
                    Err(e) => return Err(e.into()),
                }
                let s = seqs[id as usize];
                if s.prefilled < s.target {
                    let c = (u64::from(s.target - s.prefilled)).min(budget) as u32;
                    batch.push((id, c, true));
                    shape.add_run(u64::from(s.prefilled), u64::from(c));
                    budget -= u64::from(c);
                    continue;
                }
                let tok = tokens.token(&requests[id as usize], s.kv_len);
                match policy.grow(id, tok) {
                    Ok(()) => {
                        batch.push((id, 1, false));
                        shape.add_run(u64::from(s.kv_len), 1);
                        seqs[id as usize].kv_len += 1;
                        budget -= 1;
                    }
                    // No block for its next token yet: it waits on the device for the next
                    // step, like any running sequence that got no budget.
                    Err(PolicyError::NoRoom) => break,
                    Err(e) => return Err(e.into()),
                }
            }
        }

        // 3. Admissions, first come first served.
        if !preempted && swapped.is_empty() {
            while budget > 0 && running.len() < cfg.max_num_seqs as usize {
                let Some(&id) = waiting.front() else { break };
                let req = &requests[id as usize];
                let s = seqs[id as usize];
                let target = if s.admitted_once {
                    s.target
                } else {
                    req.prompt_tokens
                };
                tok_buf.clear();
                if policy.needs_tokens() {
                    tok_buf.extend((0..target).map(|p| tokens.token(req, p)));
                }
                match policy.admit(
                    id,
                    Prompt {
                        len: target,
                        tokens: &tok_buf,
                    },
                ) {
                    Ok(hit) => {
                        let hit = hit.min(target.saturating_sub(1));
                        waiting.pop_front();
                        if !s.admitted_once {
                            admitted += 1;
                        } else {
                            ex.recomputed_tokens += u64::from(target - hit);
                        }
                        let c = u64::from(target - hit).min(budget) as u32;
                        seqs[id as usize] = Seq {
                            target,
                            prefilled: hit,
                            kv_len: target,
                            generated: s.generated,
                            admitted_once: true,
                        };
                        running.push(id);
                        batch.push((id, c, true));
                        shape.add_run(u64::from(hit), u64::from(c));
                        budget -= u64::from(c);
                    }
                    Err(PolicyError::NoRoom) => break,
                    Err(e) => return Err(e.into()),
                }
            }
        }

        let usage = policy.usage();
        if batch.is_empty() && shape.swap_bytes == 0 {
            if running.is_empty() && swapped.is_empty() && waiting.is_empty() && next < n {
                // Idle: jump to the next arrival.
                let t = requests[next].arrival_s;
                let dt = t - now;
                i_waste += dt * (usage.unusable_free_bytes as f64);
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

        // Apply the step: prefill progress, emitted tokens, completions.
        let mut any_done = false;
        for &(id, c, is_prefill) in &batch {
            let s = &mut seqs[id as usize];
            if is_prefill {
                s.prefilled += c;
                if s.prefilled < s.target {
                    continue;
                }
            }
            s.generated += 1;
            ex.generated_tokens += 1;
            let o = &mut outcomes[id as usize];
            if s.generated == 1 {
                o.first_token_s = now;
            }
            if s.generated >= requests[id as usize].output_tokens {
                policy.release(id)?;
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
