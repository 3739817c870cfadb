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
//! # Fleets
//! [`run_fleet`] runs N such engines (replicas), each on its own clock, and a [`Router`]
//! assigns every request to one when it arrives (see [`crate::fleet`]); [`run`] is the
//! fleet of one.
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

/// The memory a replica's manager, host pool and engine live in.
struct Storage {
    kv: Vec<u64>,
    host: Vec<u32>,
    engine: Vec<u64>,
}

/// One engine over its own memory, with its own clock: the whole replay for a single
/// engine, one replica of a fleet ([`run_fleet`]). Requests routed to it wait in its
/// queue until its engine has room.
struct Replica<'s, 'r, 'h> {
    requests: &'r [Request],
    memory: &'r MemoryConfig,
    cost: &'r dyn StepCost,
    cfg: &'r SimConfig,
    tokens: &'r TokenSource,
    hooks: Hooks<'h>,
    kv: BlockManager<'s>,
    host: Option<HostPool<'s>>,
    engine: Engine<'s>,
    max_requests: usize,
    bpb: u64,
    bpt: f64,
    outcomes: Vec<Outcome>,
    generated: Vec<u32>,
    // Trace request of each engine request slot (`RequestId::index`).
    by_slot: Vec<u32>,
    arrived: VecDeque<u32>,
    // Requests routed here, in arrival order.
    assigned: Vec<u32>,
    prompt: Vec<u32>,
    samples: Vec<Sampled>,
    // Requests computing their shared prompt this step, and its length.
    prefilled: Vec<(kvpage_core::RequestId, u32)>,
    series: Vec<SeriesPoint>,
    now: f64,
    finished: u64,
    stalls: u32,
    ex: Extra,
    peak_running: u64,
    sums: Integrals,
}

/// What one [`Replica::step`] did.
enum Stepped {
    /// Computed or swapped something; time advanced.
    Ran,
    /// Nothing to run.
    Empty,
}

impl<'s, 'r, 'h> Replica<'s, 'r, 'h> {
    /// Requests routed to it and not finished. O(1).
    pub fn in_flight(&self) -> usize {
        self.assigned.len() - self.finished as usize
    }

    /// Queues request `id` (it arrives now or earlier). O(1) amortised.
    fn push(&mut self, id: u32) {
        self.arrived.push_back(id);
        self.assigned.push(id);
    }

    /// Adds what fits of the queue to the engine and runs one engine step.
    fn step(&mut self) -> Result<Stepped, SimError> {
        let (requests, tokens, cfg) = (self.requests, self.tokens, self.cfg);
        while self.engine.in_flight() < self.max_requests {
            let Some(&id) = self.arrived.front() else {
                break;
            };
            let req = &requests[id as usize];
            self.prompt.clear();
            self.prompt
                .extend((0..req.prompt_tokens).map(|p| tokens.token(req, p)));
            // Without a prefix cache (`Config::prefix_cache` off) nothing is shared,
            // whatever the token ids.
            let namespace = cfg.retention.namespace(req.id);
            match self
                .engine
                .add_request(&self.prompt, namespace, Some(req.output_tokens))
            {
                Ok(r) => self.by_slot[r.index() as usize] = id,
                Err(EngineError::TooLong { .. } | EngineError::Unschedulable { .. }) => {
                    return Err(stuck(req))
                }
                Err(e) => return Err(e.into()),
            }
            self.arrived.pop_front();
        }

        let step = match self.engine.step(&mut self.kv, self.host.as_mut()) {
            Ok(s) => s,
            Err(EngineError::Unschedulable {
                request: Some(request),
                ..
            }) => {
                return Err(stuck(
                    &requests[self.by_slot[request.index() as usize] as usize],
                ))
            }
            Err(e) => return Err(e.into()),
        };
        let mut shape = BatchShape::default();
        self.samples.clear();
        self.prefilled.clear();
        for s in step.seqs() {
            shape.add_run(u64::from(s.first_pos), u64::from(s.tokens));
            let req = &requests[self.by_slot[s.request.index() as usize] as usize];
            let shared = tokens.shared_tokens(req);
            let (a, b) = (s.first_pos, s.first_pos + s.tokens);
            self.ex.shared_prompt_computed_tokens += u64::from(b.min(shared).saturating_sub(a));
            if a < shared {
                self.prefilled.push((s.request, shared));
            }
            if s.emits {
                let id = self.by_slot[s.request.index() as usize] as usize;
                let req = &requests[id];
                self.samples.push(Sampled {
                    request: s.request,
                    token: tokens.token(req, req.prompt_tokens + self.generated[id]),
                    stop: false,
                });
            }
        }
        shape.swap_bytes = (step.swap_out().len() + step.swap_in().len()) as u64 * self.bpb;
        for (r, _) in step.preempted() {
            self.outcomes[self.by_slot[r.index() as usize] as usize].preempted += 1;
        }

        for &(r, shared) in &self.prefilled {
            if let Ok(seq) = self.engine.seq(r) {
                cfg.retention.pin(&mut self.kv, seq, shared);
            }
        }
        self.ex.computed_tokens += shape.tokens;
        let usage = self.memory.usage(&self.kv, self.host.as_ref());
        let waiting = self.engine.waiting_len() + self.arrived.len();
        if shape.tokens == 0 && shape.swap_bytes == 0 {
            self.engine.commit_step(&mut self.kv, &[])?;
            return Ok(Stepped::Empty);
        }
        self.stalls = 0;

        let dt = self.cost.step_seconds(&shape);
        let running = self.engine.running_len();
        let (ex, sums) = (&mut self.ex, &mut self.sums);
        ex.steps += 1;
        ex.swap_bytes += shape.swap_bytes;
        self.peak_running = self.peak_running.max(running as u64);
        ex.peak_reserved_bytes = ex.peak_reserved_bytes.max(usage.reserved_bytes);
        sums.running += dt * running as f64;
        sums.stored += dt * usage.stored_tokens as f64;
        sums.slots += dt * usage.slot_tokens as f64;
        let waste = (usage.slot_tokens.saturating_sub(usage.stored_tokens)) as f64 * self.bpt
            + usage.unusable_free_bytes as f64;
        sums.waste += dt * waste;
        if let Some(obs) = self.hooks.observer.as_mut() {
            obs(&StepView {
                step: ex.steps,
                start_s: self.now,
                dt_s: dt,
                running,
                waiting,
                swapped: self.engine.swapped_len(),
                usage,
                finished: self.finished,
                admitted: self.engine.stats().admitted,
            });
        }
        if cfg.record_series {
            self.series.push(SeriesPoint {
                t_s: self.now,
                reserved_bytes: usage.reserved_bytes,
                stored_bytes: usage.stored_tokens * self.memory.geometry.bytes_per_token(),
                running: running as u32,
            });
        }
        self.now += dt;

        // Emitted tokens and completions.
        for s in &self.samples {
            let id = self.by_slot[s.request.index() as usize] as usize;
            self.generated[id] += 1;
            self.ex.generated_tokens += 1;
            if self.generated[id] == 1 {
                self.outcomes[id].first_token_s = self.now;
            }
        }
        let done = self.engine.commit_step(&mut self.kv, &self.samples)?;
        for f in done.iter() {
            let id = self.by_slot[f.request.index() as usize] as usize;
            if f.reason != FinishReason::MaxTokens {
                return Err(SimError::Engine(format!(
                    "the request of trace line {} ended early ({:?}) after {} tokens",
                    requests[id].line, f.reason, f.generated
                )));
            }
            let o = &mut self.outcomes[id];
            o.completions += 1;
            o.finish_s = self.now;
            self.finished += 1;
            if let Some(p) = self.hooks.progress {
                p.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(Stepped::Ran)
    }

    /// Steps until the clock reaches `until` (the next arrival; infinite: until every
    /// request routed here is done), calling `after_step` after every step. An idle
    /// replica jumps to `until`.
    fn advance(
        &mut self,
        until: f64,
        after_step: &mut dyn FnMut(&BlockManager<'s>),
    ) -> Result<(), SimError> {
        loop {
            let done = match until.is_finite() {
                true => self.now >= until,
                false => self.finished == self.assigned.len() as u64,
            };
            if done {
                return Ok(());
            }
            let stepped = self.step()?;
            after_step(&self.kv);
            if let Stepped::Ran = stepped {
                continue;
            }
            if self.engine.in_flight() == 0 && self.arrived.is_empty() && until.is_finite() {
                // Idle: jump to the next arrival.
                let usage = self.memory.usage(&self.kv, self.host.as_ref());
                self.sums.waste += (until - self.now) * (usage.unusable_free_bytes as f64);
                self.now = until;
                self.stalls = 0;
                return Ok(());
            }
            self.stalls += 1;
            if self.stalls > 2 {
                let head = self
                    .assigned
                    .iter()
                    .find(|&&id| self.outcomes[id as usize].completions == 0)
                    .copied()
                    .unwrap_or(0);
                return Err(stuck(&self.requests[head as usize]));
            }
        }
    }

    /// The report over the requests routed here, their outcomes (indexed by trace id;
    /// the others' stay default) and the series.
    fn finish(mut self, name: &str) -> RunOutput {
        let now = self.now;
        if self.cfg.record_series {
            let u = self.memory.usage(&self.kv, self.host.as_ref());
            self.series.push(SeriesPoint {
                t_s: now,
                reserved_bytes: u.reserved_bytes,
                stored_bytes: u.stored_tokens * self.memory.geometry.bytes_per_token(),
                running: 0,
            });
        }
        let stats = self.engine.stats();
        let mut ex = self.ex;
        ex.swaps = stats.swap_outs;
        ex.recomputed_tokens = stats.recomputed_tokens;
        let n = self.assigned.len();
        let mut ttft: Vec<f64> = Vec::with_capacity(n);
        let mut lat: Vec<f64> = Vec::with_capacity(n);
        for &id in &self.assigned {
            let (r, o) = (&self.requests[id as usize], &self.outcomes[id as usize]);
            ttft.push(o.first_token_s - r.arrival_s);
            lat.push(o.finish_s - r.arrival_s);
        }
        ttft.sort_by(f64::total_cmp);
        lat.sort_by(f64::total_cmp);
        ex.makespan_s = now;
        let span = if now > 0.0 { now } else { f64::NAN };
        let sums = &self.sums;
        let report = Report {
            policy: name.to_string(),
            completed: self.finished,
            tokens_per_s: ex.generated_tokens as f64 / span,
            peak_running: self.peak_running,
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
            prefix_hit_tokens: self.kv.stats().prefix_hit_tokens,
            extra: ex,
        };
        RunOutput {
            report,
            outcomes: self.outcomes,
            series: self.series,
        }
    }
}

/// Assigns each arriving request to a replica of a fleet ([`run_fleet`]).
pub trait Router {
    /// Entries of the KV event ring each replica's manager needs
    /// ([`kvpage_core::Config::event_capacity`]); 0 for a router that reads no events.
    fn event_capacity(&self) -> u32;
    /// Called after every step of replica `replica` with its manager (to drain events).
    fn observe(&mut self, replica: usize, kv: &BlockManager<'_>);
    /// The replica for a request with prompt token ids `prompt` in `namespace`, given
    /// every replica's requests in flight (`loads`). Must be `< loads.len()`.
    fn route(&mut self, prompt: &[u32], namespace: u64, loads: &[usize]) -> usize;
    /// Times the router lost events and rebuilt its view of a replica from a snapshot.
    /// O(1).
    fn resyncs(&self) -> u64 {
        0
    }
}

/// Builds the storage of one replica.
fn storage_for(
    core: &kvpage_core::Config,
    host_blocks: u32,
    engine_cfg: &EngineConfig,
) -> Result<Storage, SimError> {
    Ok(Storage {
        kv: storage::<u64>(core.storage_words(), "block manager")?,
        host: storage::<u32>(HostPool::storage_words(host_blocks), "host pool")?,
        engine: storage::<u64>(engine_cfg.storage_words(core), "engine")?,
    })
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
    hooks: Hooks<'_>,
) -> Result<RunOutput, SimError> {
    let mut one = SingleReplica;
    let mut out = run_fleet(
        name, requests, memory, cost, cfg, tokens, 1, &mut one, hooks,
    )?;
    out.pop()
        .ok_or_else(|| SimError::Engine("no replica ran".into()))
}

/// The router of a one-replica run.
struct SingleReplica;

impl Router for SingleReplica {
    fn event_capacity(&self) -> u32 {
        0
    }
    fn observe(&mut self, _: usize, _: &BlockManager<'_>) {}
    fn route(&mut self, _: &[u32], _: u64, _: &[usize]) -> usize {
        0
    }
}

/// Replays `requests` on `replicas` engines, each with the memory of `memory` and its
/// own clock (they run in parallel, as a fleet does), `router` assigning each request
/// when it arrives: every replica first steps up to the arrival time, its events going
/// to [`Router::observe`] after each step. One [`RunOutput`] per replica (its report over
/// the requests it served; outcomes indexed by trace id, default for the others'); with
/// one replica, exactly [`run`]. O(steps × engine step) plus O(requests × route).
/// `hooks` go to replica 0.
///
/// # Errors
/// As [`run`]; also when `replicas` is 0.
#[allow(clippy::too_many_arguments)]
pub fn run_fleet(
    name: &str,
    requests: &[Request],
    memory: &MemoryConfig,
    cost: &dyn StepCost,
    cfg: &SimConfig,
    tokens: &TokenSource,
    replicas: usize,
    router: &mut dyn Router,
    hooks: Hooks<'_>,
) -> Result<Vec<RunOutput>, SimError> {
    let n = requests.len();
    if requests.iter().enumerate().any(|(i, r)| r.id as usize != i)
        || requests.windows(2).any(|w| w[1].arrival_s < w[0].arrival_s)
    {
        return Err(SimError::BadRequests);
    }
    if replicas == 0 {
        return Err(SimError::Engine(
            "a fleet needs at least one replica".into(),
        ));
    }
    let mut core = cfg.retention.core_config(memory.core_config());
    if router.event_capacity() > 0 {
        core = core.with_events(router.event_capacity());
    }
    core.validate()
        .map_err(|e| SimError::Engine(format!("block manager configuration {core:?}: {e}")))?;
    let host_blocks = memory.host_blocks();
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
    let mut stores = (0..replicas)
        .map(|_| storage_for(&core, host_blocks, &engine_cfg))
        .collect::<Result<Vec<_>, _>>()?;
    let mut hooks = Some(hooks);
    let mut fleet = Vec::with_capacity(replicas);
    for st in stores.iter_mut() {
        let mut kv = BlockManager::new(core, &mut st.kv)
            .map_err(|e| SimError::Engine(format!("block manager: {e}")))?;
        cfg.retention
            .apply(&mut kv)
            .map_err(|e| SimError::Engine(format!("namespace quota: {e}")))?;
        let host = match host_blocks {
            0 => None,
            b => Some(
                HostPool::new(b, core.instance, &mut st.host)
                    .map_err(|e| SimError::Engine(format!("host pool: {e}")))?,
            ),
        };
        let engine = Engine::new(engine_cfg, &core, &mut st.engine)?;
        fleet.push(Replica {
            requests,
            memory,
            cost,
            cfg,
            tokens,
            hooks: hooks.take().unwrap_or_default(),
            kv,
            host,
            engine,
            max_requests: engine_cfg.max_requests as usize,
            bpb: memory.geometry.bytes_per_block(),
            bpt: memory.geometry.bytes_per_token() as f64,
            outcomes: vec![Outcome::default(); n],
            generated: vec![0u32; n],
            by_slot: vec![0u32; engine_cfg.max_requests as usize],
            arrived: VecDeque::new(),
            assigned: Vec::new(),
            prompt: Vec::new(),
            samples: Vec::new(),
            prefilled: Vec::new(),
            series: Vec::new(),
            now: 0.0,
            finished: 0,
            stalls: 0,
            ex: Extra {
                budget_bytes: memory.budget_bytes,
                ..Extra::default()
            },
            peak_running: 0,
            sums: Integrals::default(),
        });
    }

    let mut prompt: Vec<u32> = Vec::new();
    let mut loads = vec![0usize; replicas];
    for req in requests {
        for (k, r) in fleet.iter_mut().enumerate() {
            r.advance(req.arrival_s, &mut |kv| router.observe(k, kv))?;
            loads[k] = r.in_flight();
        }
        prompt.clear();
        prompt.extend((0..req.prompt_tokens).map(|p| tokens.token(req, p)));
        let k = router.route(&prompt, cfg.retention.namespace(req.id), &loads);
        fleet[k.min(replicas - 1)].push(req.id);
    }
    for (k, r) in fleet.iter_mut().enumerate() {
        r.advance(f64::INFINITY, &mut |kv| router.observe(k, kv))?;
    }
    Ok(fleet.into_iter().map(|r| r.finish(name)).collect())
}
