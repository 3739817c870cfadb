//! The replay: continuous batching over simulated time on kvpage's [`Engine`] — the
//! engine step embedders use — for every policy; this module keeps only the time model
//! and the accounting.
//!
//! # The model
//! A request has `P` prompt tokens and `G` output tokens. It is added to the engine when
//! it arrives (prompt token ids from a [`TokenSource`], at most `G` new tokens). Admitted,
//! it computes its prompt in chunks that fit the per-step token budget, each chunk taking
//! KV blocks as it is computed; the step that completes the prefill emits the first
//! output token. Each later step decodes: the last output token's K/V is computed (one
//! more token of memory) and the next token is emitted. A request is done, and releases
//! its memory, when it has emitted `G` tokens; it then holds `P + G − 1` tokens of KV.
//! Every sampled token is the [`TokenSource`] id of its position, so a recomputed
//! sequence and the prefix cache see the same ids as before.
//!
//! # The engine
//! Every step [`Engine::step`] asks kvpage's scheduler policy for a plan and executes it
//! on the [`BlockManager`] (and the [`HostPool`] of swap policies): preemptions of the
//! most recently admitted (by swap when configured and the host tier has room, else by
//! recompute: blocks freed, the request back at the front of the waiting queue to
//! prefill prompt and output so far again), runs (prefill chunks and decode tokens within
//! the token budget), swap-ins (they run from the next step) and first-come-first-served
//! admissions through the prefix cache. The same engine drives every policy; only the
//! memory differs ([`MemoryConfig`]): the contiguous baseline is a manager whose block is
//! one whole `max_seq_len` region.
//!
//! Step time comes from a [`StepCost`] over the scheduled sequences' query positions and
//! the blocks the step swaps; memory and counts are sampled after the step's actions
//! (when its memory is allocated) and integrated over the step's duration. When nothing
//! is in flight, time jumps to the next arrival.
//!
//! Errors: an engine failure or a request that can never be admitted is a [`SimError`],
//! not a panic and not an endless loop.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

pub use kvpage_core::Preemption;
use kvpage_core::{
    BlockManager, Engine, EngineConfig, EngineError, FinishReason, HostPool, Sampled,
    SchedulerConfig,
};

use crate::memory::{MemoryConfig, Usage};
use crate::metrics::{percentile, Extra, Report};
use crate::retention::Retention;
use crate::rng::{mix, SplitMix64};
use crate::step_model::{BatchShape, StepCost};
use crate::trace::Request;

/// Limits of a replay's engine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimConfig {
    /// Most sequences running at once.
    pub max_num_seqs: u32,
    /// Per-step token budget (prefill chunk tokens plus decode tokens), at least 1.
    pub max_batched_tokens: u32,
    /// How to preempt.
    pub preemption: Preemption,
    /// Record the per-step series for plotting.
    pub record_series: bool,
    /// Tenants, pinning of the shared prompts and quotas (the default: none).
    pub retention: Retention,
}

impl SimConfig {
    /// Requests in the engine at once ([`EngineConfig::max_requests`]); later arrivals
    /// wait outside it. The scheduler looks at the running limit's worth of waiting
    /// requests plus one, and running, swapped-out and preempted requests never exceed
    /// the running limit together, so twice the limit plus one lets the engine see what
    /// an unbounded queue would; four times leaves room. O(1).
    pub fn max_requests(&self) -> u32 {
        self.max_num_seqs.max(1).saturating_mul(4)
    }
}

/// Synthetic token ids: the trace has lengths, not text. A request's first
/// `min(shared_prefix_tokens, P)` tokens are the system prompt of its group (one of
/// `groups`, drawn from a seeded generator); every other token is unique to the request.
#[derive(Clone, Debug)]
pub struct TokenSource {
    groups: Vec<u32>,
    prefix_tokens: u32,
    seed: u64,
    /// Which requests share a prompt ([`Retention::shares_prefix`]).
    retention: Retention,
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
            retention: Retention::default(),
        }
    }

    /// The same source with the requests spread over `retention`'s tenants: only tenant
    /// 0's requests share a system prompt (see [`crate::retention`]). O(1).
    pub fn with_tenants(self, retention: &Retention) -> Self {
        Self {
            retention: *retention,
            ..self
        }
    }

    /// The group of request `id`, if prompts are shared. O(1).
    pub fn group(&self, id: u32) -> Option<u32> {
        match self.retention.shares_prefix(id) {
            true => self.groups.get(id as usize).copied(),
            false => None,
        }
    }

    /// Leading tokens of request `req` that are its group's shared prompt (0 without a
    /// group). O(1).
    pub fn shared_tokens(&self, req: &Request) -> u32 {
        match self.group(req.id) {
            Some(_) => self.prefix_tokens.min(req.prompt_tokens),
            None => 0,
        }
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
    /// The engine or the memory configuration failed.
    Engine(String),
    /// A request can never be admitted (nothing runs and it still does not fit).
    Stuck {
        /// Trace line of the request.
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
            SimError::Engine(m) => write!(f, "engine failed: {m}"),
            SimError::Stuck { line, tokens } => write!(
                f,
                "the request of trace line {line} ({tokens} tokens) cannot be admitted even into an empty cache (or within its namespace quota)"
            ),
            SimError::BadRequests => write!(f, "request ids must be 0..n in arrival order"),
        }
    }
}

impl std::error::Error for SimError {}

impl From<EngineError> for SimError {
    fn from(e: EngineError) -> Self {
        SimError::Engine(e.to_string())
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

fn stuck(r: &Request) -> SimError {
    SimError::Stuck {
        line: r.line,
        tokens: r.total_tokens(),
    }
}

/// Zeroed storage of `words` words, or an error naming `what` when it cannot be sized.
fn storage<T: Clone + Default>(words: usize, what: &str) -> Result<Vec<T>, SimError> {
    if words == usize::MAX {
        return Err(SimError::Engine(format!("{what}: too large to address")));
    }
    Ok(vec![T::default(); words])
}

/// Time-integrated sums of a run.
#[derive(Default)]
struct Integrals {
    running: f64,
    stored: f64,
    slots: f64,
    waste: f64,
}

/// Replays `requests` (ids `0..n`, sorted by arrival) on a kvpage [`Engine`] over the
/// memory of `memory`. O(steps × engine step) plus O(requests).
///
/// # Errors
/// [`SimError`] if the memory cannot be built, the engine fails, a request can never be
/// admitted, or the ids are not `0..n` in arrival order.
pub fn run(
    name: &str,
    requests: &[Request],
    memory: &MemoryConfig,
    cost: &dyn StepCost,
    cfg: &SimConfig,
    tokens: &TokenSource,
    mut hooks: Hooks<'_>,
) -> Result<RunOutput, SimError> {
    let n = requests.len();
    if requests.iter().enumerate().any(|(i, r)| r.id as usize != i)
        || requests.windows(2).any(|w| w[1].arrival_s < w[0].arrival_s)
    {
        return Err(SimError::BadRequests);
    }
    let core = cfg.retention.core_config(memory.core_config());
    core.validate()
        .map_err(|e| SimError::Engine(format!("block manager configuration {core:?}: {e}")))?;
    let mut kv_words = storage::<u64>(core.storage_words(), "block manager")?;
    let mut kv = BlockManager::new(core, &mut kv_words)
        .map_err(|e| SimError::Engine(format!("block manager: {e}")))?;
    cfg.retention
        .apply(&mut kv)
        .map_err(|e| SimError::Engine(format!("namespace quota: {e}")))?;
    let host_blocks = memory.host_blocks();
    let mut host_words = storage::<u32>(HostPool::storage_words(host_blocks), "host pool")?;
    let mut host = match host_blocks {
        0 => None,
        b => Some(
            HostPool::new(b, core.instance, &mut host_words)
                .map_err(|e| SimError::Engine(format!("host pool: {e}")))?,
        ),
    };
    let engine_cfg = EngineConfig {
        max_requests: cfg.max_requests(),
        scheduler: SchedulerConfig {
            token_budget: cfg.max_batched_tokens.max(1),
            max_running: cfg.max_num_seqs.max(1),
            watermark_blocks: memory.watermark_blocks,
            preemption: cfg.preemption,
        },
        host_blocks,
    };
    let mut engine_words = storage::<u64>(engine_cfg.storage_words(&core), "engine")?;
    let mut engine = Engine::new(engine_cfg, &core, &mut engine_words)?;
    let max_requests = engine_cfg.max_requests as usize;
    let bpb = memory.geometry.bytes_per_block();
    let bpt = memory.geometry.bytes_per_token() as f64;

    let mut outcomes = vec![Outcome::default(); n];
    let mut generated = vec![0u32; n];
    // Trace request of each engine request slot (`RequestId::index`).
    let mut by_slot = vec![0u32; max_requests];
    let mut arrived: VecDeque<u32> = VecDeque::new();
    let mut prompt: Vec<u32> = Vec::new();
    let mut samples: Vec<Sampled> = Vec::new();
    // Requests computing their shared prompt this step, and its length.
    let mut prefilled: Vec<(kvpage_core::RequestId, u32)> = Vec::new();
    let mut series = Vec::new();
    let mut next = 0usize;
    let mut now = 0.0f64;
    let mut finished = 0u64;
    let mut stalls = 0u32;
    let mut ex = Extra {
        budget_bytes: memory.budget_bytes,
        ..Extra::default()
    };
    let mut peak_running = 0u64;
    let mut sums = Integrals::default();

    while finished < n as u64 {
        while next < n && requests[next].arrival_s <= now {
            arrived.push_back(next as u32);
            next += 1;
        }
        while engine.in_flight() < max_requests {
            let Some(&id) = arrived.front() else { break };
            let req = &requests[id as usize];
            prompt.clear();
            prompt.extend((0..req.prompt_tokens).map(|p| tokens.token(req, p)));
            // Without a prefix cache (`Config::prefix_cache` off) nothing is shared,
            // whatever the token ids.
            let namespace = cfg.retention.namespace(req.id);
            match engine.add_request(&prompt, namespace, Some(req.output_tokens)) {
                Ok(r) => by_slot[r.index() as usize] = id,
                Err(EngineError::TooLong { .. } | EngineError::Unschedulable { .. }) => {
                    return Err(stuck(req))
                }
                Err(e) => return Err(e.into()),
            }
            arrived.pop_front();
        }

        let step = match engine.step(&mut kv, host.as_mut()) {
            Ok(s) => s,
            Err(EngineError::Unschedulable {
                request: Some(request),
                ..
            }) => return Err(stuck(&requests[by_slot[request.index() as usize] as usize])),
            Err(e) => return Err(e.into()),
        };
        let mut shape = BatchShape::default();
        samples.clear();
        prefilled.clear();
        for s in step.seqs() {
            shape.add_run(u64::from(s.first_pos), u64::from(s.tokens));
            let req = &requests[by_slot[s.request.index() as usize] as usize];
            let shared = tokens.shared_tokens(req);
            let (a, b) = (s.first_pos, s.first_pos + s.tokens);
            ex.shared_prompt_computed_tokens += u64::from(b.min(shared).saturating_sub(a));
            if a < shared {
                prefilled.push((s.request, shared));
            }
            if s.emits {
                let id = by_slot[s.request.index() as usize] as usize;
                let req = &requests[id];
                samples.push(Sampled {
                    request: s.request,
                    token: tokens.token(req, req.prompt_tokens + generated[id]),
                    stop: false,
                });
            }
        }
        shape.swap_bytes = (step.swap_out().len() + step.swap_in().len()) as u64 * bpb;
        for (r, _) in step.preempted() {
            outcomes[by_slot[r.index() as usize] as usize].preempted += 1;
        }

        for &(r, shared) in &prefilled {
            if let Ok(seq) = engine.seq(r) {
                cfg.retention.pin(&mut kv, seq, shared);
            }
        }
        ex.computed_tokens += shape.tokens;
        let usage = memory.usage(&kv, host.as_ref());
        let waiting = engine.waiting_len() + arrived.len();
        if shape.tokens == 0 && shape.swap_bytes == 0 {
            engine.commit_step(&mut kv, &[])?;
            if engine.in_flight() == 0 && arrived.is_empty() && next < n {
                // Idle: jump to the next arrival.
                let t = requests[next].arrival_s;
                sums.waste += (t - now) * (usage.unusable_free_bytes as f64);
                now = t;
                stalls = 0;
                continue;
            }
            stalls += 1;
            if stalls > 2 {
                let head = outcomes
                    .iter()
                    .position(|o| o.completions == 0)
                    .unwrap_or(0);
                return Err(stuck(&requests[head]));
            }
            continue;
        }
        stalls = 0;

        let dt = cost.step_seconds(&shape);
        let running = engine.running_len();
        ex.steps += 1;
        ex.swap_bytes += shape.swap_bytes;
        peak_running = peak_running.max(running as u64);
        ex.peak_reserved_bytes = ex.peak_reserved_bytes.max(usage.reserved_bytes);
        sums.running += dt * running as f64;
        sums.stored += dt * usage.stored_tokens as f64;
        sums.slots += dt * usage.slot_tokens as f64;
        let waste = (usage.slot_tokens.saturating_sub(usage.stored_tokens)) as f64 * bpt
            + usage.unusable_free_bytes as f64;
        sums.waste += dt * waste;
        if let Some(obs) = hooks.observer.as_mut() {
            obs(&StepView {
                step: ex.steps,
                start_s: now,
                dt_s: dt,
                running,
                waiting,
                swapped: engine.swapped_len(),
                usage,
                finished,
                admitted: engine.stats().admitted,
            });
        }
        if cfg.record_series {
            series.push(SeriesPoint {
                t_s: now,
                reserved_bytes: usage.reserved_bytes,
                stored_bytes: usage.stored_tokens * memory.geometry.bytes_per_token(),
                running: running as u32,
            });
        }
        now += dt;

        // Emitted tokens and completions.
        for s in &samples {
            let id = by_slot[s.request.index() as usize] as usize;
            generated[id] += 1;
            ex.generated_tokens += 1;
            if generated[id] == 1 {
                outcomes[id].first_token_s = now;
            }
        }
        let done = engine.commit_step(&mut kv, &samples)?;
        for f in done.iter() {
            let id = by_slot[f.request.index() as usize] as usize;
            if f.reason != FinishReason::MaxTokens {
                return Err(SimError::Engine(format!(
                    "the request of trace line {} ended early ({:?}) after {} tokens",
                    requests[id].line, f.reason, f.generated
                )));
            }
            let o = &mut outcomes[id];
            o.completions += 1;
            o.finish_s = now;
            finished += 1;
            if let Some(p) = hooks.progress {
                p.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    if cfg.record_series {
        let u = memory.usage(&kv, host.as_ref());
        series.push(SeriesPoint {
            t_s: now,
            reserved_bytes: u.reserved_bytes,
            stored_bytes: u.stored_tokens * memory.geometry.bytes_per_token(),
            running: 0,
        });
    }
    let stats = engine.stats();
    ex.swaps = stats.swap_outs;
    ex.recomputed_tokens = stats.recomputed_tokens;
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
        mean_running: sums.running / span,
        kv_utilization: if sums.slots > 0.0 {
            sums.stored / sums.slots
        } else {
            f64::NAN
        },
        waste_fraction: sums.waste / (span * ex.budget_bytes.max(1) as f64),
        ttft_p50_s: percentile(&ttft, 50.0),
        ttft_p99_s: percentile(&ttft, 99.0),
        latency_p50_s: percentile(&lat, 50.0),
        latency_p99_s: percentile(&lat, 99.0),
        preemptions: stats.recomputes + stats.swap_outs,
        prefix_hit_tokens: kv.stats().prefix_hit_tokens,
        extra: ex,
    };
    Ok(RunOutput {
        report,
        outcomes,
        series,
    })
}
