//! The engine step: the loop between the scheduler's plan and the model that every
//! embedder needs, over a [`BlockManager`] (and an optional [`HostPool`]) in caller
//! storage.
//!
//! # Use
//! 1. [`Engine::add_request`]: a prompt (token ids), a namespace (prefix-cache tenant)
//!    and a token limit (or none: until the caller says stop). The request waits.
//! 2. [`Engine::step`]: asks the scheduler ([`crate::schedule_with`]'s rules) for a plan and executes it on the manager
//!    — preemptions (recompute or swap-out), growth of running sequences (with
//!    copy-on-write), swap-ins, admissions through the prefix cache — and returns a
//!    [`Step`]: for every scheduled sequence the query positions, the input token ids, the
//!    slot of each new token (where the model writes its K/V), and its block-table row
//!    ([`SeqId::index`] into [`BlockManager::block_table`]); plus the block copies the
//!    backend executes *before* the model runs, in this order: [`Step::swap_out`] (device
//!    to host), [`Step::swap_in`] (host to device), [`Step::copies`] (device to device,
//!    copy-on-write).
//! 3. The model runs; the caller samples one token for every scheduled sequence that
//!    [`ScheduledSeq::emits`] and reports them with [`Engine::commit_step`], which
//!    offers the computed blocks to the prefix cache and returns the requests that
//!    finished (stop, token limit, or length limit).
//!
//! # Guarantees
//! - A plan always executes: the scheduler is told the copy-on-write block of a shared
//!   partial last block, the idle cached blocks an admission takes, the exact swap-in
//!   sizes and the free sequence slots, so every action succeeds on the manager. (A
//!   failure would be a bug; it is reported as [`EngineError::PlanFailed`].)
//! - The copy order above is safe: swap-outs read blocks before anything this step writes
//!   them; swap-ins and admissions only happen in a step without preemptions, so a
//!   swap-in never writes a block a copy-on-write of the same step reads.
//! - Namespace quotas ([`BlockManager::set_namespace_quota`]) hold: the scheduler is
//!   told [`BlockManager::shared_available_blocks`] (no reservation is counted), a
//!   running sequence whose growth its namespace's limit cannot take first preempts the
//!   namespace's youngest running sequence by recompute (itself when it is the
//!   youngest; such a preemption only frees blocks, so the copy order stays safe), and
//!   a swapped-out sequence or waiting request whose blocks the limit cannot take
//!   waits while other namespaces go ahead. When nothing runs and the next request in
//!   line is longer than its namespace's limit, [`Engine::step`] reports it
//!   [`EngineError::Unschedulable`] (with the limit as `total_blocks`): cancel it or
//!   raise the quota.
//! - A request's retention [`crate::Priority`] ([`Engine::add_request_at`]) applies to
//!   the prompt blocks it commits and reuses: `Pinned` keeps a hot system prompt cached
//!   for every later request.
//! - Each request finishes exactly once; its [`RequestId`] is stale afterwards.
//! - After [`Engine::new`] nothing allocates; every misuse is an [`EngineError`] and a
//!   refused call changes nothing.
//!
//! # Storage
//! One caller slice of [`EngineConfig::storage_words`] words holds the request table,
//! the token ids of every request (prompt and generated, up to the manager's
//! `max_tokens_per_seq` each, so a preempted request can be recomputed), the scheduler's
//! scratch and the step's outputs.

use core::fmt;

use crate::config::Config;
use crate::error::{InitError, SeqError};
use crate::host_tier::HostPool;
use crate::manager::{BlockCopy, BlockManager, SeqId};
use crate::quota_plan::QuotaPlan;
use crate::retention::Priority;
use crate::scheduler::{
    schedule_lazy, Action, Preemption, RunningSeq, ScheduleError, SchedulerConfig, StepInput,
    SwappedSeq, WaitingSeq,
};
use crate::storage::{words_for_pods, Carver};

/// Sizes and policy of an [`Engine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct EngineConfig {
    /// Requests in flight at once (waiting, running and swapped out).
    pub max_requests: u32,
    /// Budget, running limit, watermark and preemption mode of every step.
    pub scheduler: SchedulerConfig,
    /// Blocks of the host pool passed to [`Engine::step`] (0: no host tier); a larger
    /// pool is refused. Sizes the swap outputs of a step.
    pub host_blocks: u32,
}

/// Request slot states.
const FREE: u32 = 0;
const WAITING: u32 = 1;
const RUNNING: u32 = 2;
const SWAPPED: u32 = 3;

/// Request flags.
const ADMITTED_ONCE: u32 = 1;
const SCHEDULED: u32 = 2;
const EMITS: u32 = 4;
const SAMPLED: u32 = 8;

/// "No limit" in `max_new`.
const UNLIMITED: u32 = u32::MAX;

/// One request's bookkeeping, stored as plain words.
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct Slot {
    generation: u32,
    state: u32,
    flags: u32,
    seq_index: u32,
    seq_generation: u32,
    /// The prefix-cache namespace, in two words (the record is plain `u32`s).
    namespace_lo: u32,
    namespace_hi: u32,
    /// Token ids known: prompt plus generated (the last one may not be computed yet).
    total: u32,
    /// Tokens whose K/V the sequence holds.
    held: u32,
    generated: u32,
    max_new: u32,
    /// Retention [`Priority`] level of the request's sequence.
    priority: u32,
}

impl Slot {
    fn namespace(&self) -> u64 {
        u64::from(self.namespace_hi) << 32 | u64::from(self.namespace_lo)
    }
}

/// A scheduled sequence as stored.
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct ScheduledRecord {
    request: u32,
    request_generation: u32,
    seq_index: u32,
    seq_generation: u32,
    first_pos: u32,
    tokens: u32,
    offset: u32,
    emits: u32,
}

/// A planned action as stored: kind, id, tokens.
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct ActionRecord {
    kind: u32,
    id: u32,
    tokens: u32,
}

const PREEMPT_RECOMPUTE: u32 = 0;
const PREEMPT_SWAP: u32 = 1;
const RUN: u32 = 2;
const SWAP_IN: u32 = 3;
const ADMIT: u32 = 4;

impl ActionRecord {
    fn from_action(a: Action) -> Self {
        let (kind, id, tokens) = match a {
            Action::Preempt {
                id,
                mode: Preemption::Recompute,
            } => (PREEMPT_RECOMPUTE, id, 0),
            Action::Preempt {
                id,
                mode: Preemption::Swap,
            } => (PREEMPT_SWAP, id, 0),
            Action::Run { id, tokens } => (RUN, id, tokens),
            Action::SwapIn { id } => (SWAP_IN, id, 0),
            Action::Admit { id, tokens } => (ADMIT, id, tokens),
        };
        Self { kind, id, tokens }
    }
}

/// A request that left the engine, as stored.
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct PreemptRecord {
    request: u32,
    request_generation: u32,
    swap: u32,
}

/// Handle of a request: its slot and the slot's generation. Stale once the request
/// finished or was cancelled; every operation refuses a stale handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct RequestId {
    index: u32,
    generation: u32,
}

impl RequestId {
    /// Slot of the request (`< max_requests`): a dense index for the caller's own tables.
    pub const fn index(&self) -> u32 {
        self.index
    }
    /// Generation of the slot when the handle was made.
    pub const fn generation(&self) -> u32 {
        self.generation
    }
    /// Rebuilds a handle from its parts (after an FFI boundary). A forged or outdated
    /// handle is refused by every operation.
    pub const fn from_parts(index: u32, generation: u32) -> Self {
        Self { index, generation }
    }
}

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum RequestState {
    /// Not admitted yet, or preempted by recompute.
    Waiting,
    /// Holds device blocks.
    Running,
    /// Its blocks are in the host tier.
    Swapped,
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum FinishReason {
    /// The caller said stop with the sampled token.
    Stop,
    /// It generated its `max_new_tokens`.
    MaxTokens,
    /// The sequence is full (`max_tokens_per_seq` of the manager); the last sampled
    /// token was reported but not stored.
    Length,
}

/// A request that finished in [`Engine::commit_step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Finished {
    /// The request (now stale).
    pub request: RequestId,
    /// Why.
    pub reason: FinishReason,
    /// Tokens it generated in all.
    pub generated: u32,
}

/// Storage of [`Finished`] records.
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct FinishedRecord {
    request: u32,
    request_generation: u32,
    reason: u32,
    generated: u32,
}

/// One token sampled by the caller for a scheduled sequence that emits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Sampled {
    /// The request.
    pub request: RequestId,
    /// The token id.
    pub token: u32,
    /// The request ends with this token (end of sequence, a stop string, the caller's
    /// own limit).
    pub stop: bool,
}

/// What the model computes this step for one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct ScheduledSeq {
    /// The request.
    pub request: RequestId,
    /// Its sequence: [`SeqId::index`] is its row of [`BlockManager::block_table`].
    pub seq: SeqId,
    /// Position of the first query token; the queries are `first_pos..first_pos +
    /// tokens`, and attention covers positions `0..first_pos + tokens` (causal). It is
    /// also the token index: the engine never edits its sequences (and a sequence edited
    /// behind its back, with [`BlockManager::remove_range`] say, breaks its bookkeeping),
    /// so their positions are their indices ([`BlockManager::position_runs`] is `{0, 0}`).
    pub first_pos: u32,
    /// Query tokens this step (a prefill chunk, or 1 to decode).
    pub tokens: u32,
    /// Start of this sequence's entries in [`Step::slots`] and [`Step::input_tokens`].
    pub offset: u32,
    /// The last query position produces a token to sample (the prompt is complete).
    pub emits: bool,
}

/// The outcome of [`Engine::step`]: what the backend copies and the model computes.
/// Borrowed from the engine until the next call on it.
#[derive(Debug, Clone, Copy)]
pub struct Step<'e> {
    scheduled: &'e [ScheduledRecord],
    slots: &'e [u32],
    input_tokens: &'e [u32],
    copies: &'e [BlockCopy],
    swap_out: &'e [BlockCopy],
    swap_in: &'e [BlockCopy],
    preempted: &'e [PreemptRecord],
    instance: u32,
}

impl<'e> Step<'e> {
    /// Scheduled sequences, in execution order. O(1).
    pub fn len(&self) -> usize {
        self.scheduled.len()
    }

    /// Whether nothing is computed this step (there may still be copies). O(1).
    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }

    /// Scheduled sequence `i`, `None` past [`Step::len`]. O(1).
    pub fn seq(&self, i: usize) -> Option<ScheduledSeq> {
        self.scheduled.get(i).map(|r| self.view(r))
    }

    fn view(&self, r: &ScheduledRecord) -> ScheduledSeq {
        ScheduledSeq {
            request: RequestId::from_parts(r.request, r.request_generation),
            seq: SeqId::from_parts(r.seq_index, r.seq_generation, self.instance),
            first_pos: r.first_pos,
            tokens: r.tokens,
            offset: r.offset,
            emits: r.emits != 0,
        }
    }

    /// The scheduled sequences, in execution order. O(1) per item.
    pub fn seqs(&self) -> impl ExactSizeIterator<Item = ScheduledSeq> + '_ {
        self.scheduled.iter().map(|r| self.view(r))
    }

    /// Slot (`block * block_size + offset`) of every query token, sequence after
    /// sequence: where the model writes each token's K/V. O(1).
    pub fn slots(&self) -> &'e [u32] {
        self.slots
    }

    /// Input token id of every query token, in the order of [`Step::slots`]. O(1).
    pub fn input_tokens(&self) -> &'e [u32] {
        self.input_tokens
    }

    /// The slots of one scheduled sequence. O(1).
    pub fn slots_of(&self, s: &ScheduledSeq) -> &'e [u32] {
        let (a, b) = (s.offset as usize, (s.offset + s.tokens) as usize);
        self.slots.get(a..b).unwrap_or(&[])
    }

    /// The input token ids of one scheduled sequence. O(1).
    pub fn input_tokens_of(&self, s: &ScheduledSeq) -> &'e [u32] {
        let (a, b) = (s.offset as usize, (s.offset + s.tokens) as usize);
        self.input_tokens.get(a..b).unwrap_or(&[])
    }

    /// Tokens computed this step (the sum of the scheduled sequences' tokens). O(1).
    pub fn tokens(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Device-to-host copies of swap-outs (`src` device block, `dst` host block):
    /// execute first. O(1).
    pub fn swap_out(&self) -> &'e [BlockCopy] {
        self.swap_out
    }

    /// Host-to-device copies of swap-ins (`src` host block, `dst` device block):
    /// execute second. O(1).
    pub fn swap_in(&self) -> &'e [BlockCopy] {
        self.swap_in
    }

    /// Device-to-device copy-on-write copies: execute third, before the model writes
    /// K/V. O(1).
    pub fn copies(&self) -> &'e [BlockCopy] {
        self.copies
    }

    /// Requests preempted this step, with `true` for a swap-out (`false`: recompute, its
    /// K/V is gone and it waits to be prefilled again). O(1) per item.
    pub fn preempted(&self) -> impl ExactSizeIterator<Item = (RequestId, bool)> + '_ {
        self.preempted.iter().map(|p| {
            (
                RequestId::from_parts(p.request, p.request_generation),
                p.swap != 0,
            )
        })
    }
}

/// Counters of an [`Engine`] since construction. O(1) to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct EngineStats {
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

/// Why an engine operation failed. A refused operation changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum EngineError {
    /// The storage or the configuration does not fit (see [`InitError`]).
    Init(InitError),
    /// A zero `max_requests`, or a scheduler configuration with a zero budget.
    ZeroConfig,
    /// `max_requests` requests are in flight.
    QueueFull {
        /// The limit.
        max_requests: u32,
    },
    /// A prompt without tokens.
    EmptyPrompt,
    /// `max_new_tokens` of `Some(0)`.
    ZeroMaxTokens,
    /// The prompt is longer than a sequence can hold.
    TooLong {
        /// Prompt tokens.
        tokens: u64,
        /// Tokens a sequence holds at most.
        max_tokens: u64,
    },
    /// A request can never be scheduled: even with the whole pool free, its blocks (plus
    /// the watermark) do not fit. [`Engine::cancel`] it.
    Unschedulable {
        /// The request; `None` from [`Engine::add_request`], which queues nothing.
        request: Option<RequestId>,
        /// Blocks it needs, watermark included.
        needed_blocks: u64,
        /// Blocks of the pool.
        total_blocks: u32,
    },
    /// The handle names a request that finished or was cancelled (or never existed).
    StaleRequest,
    /// The request is not in the state the operation needs (e.g. fork of a request that
    /// is not running, a sample for a sequence that does not emit this step).
    WrongState {
        /// The request.
        request: RequestId,
    },
    /// Two samples for one request.
    DuplicateSample {
        /// The request.
        request: RequestId,
    },
    /// A scheduled sequence that emits got no sample.
    MissingSample {
        /// The request.
        request: RequestId,
    },
    /// [`Engine::step`] (or an edit) while a step waits for [`Engine::commit_step`].
    StepInProgress,
    /// [`Engine::commit_step`] without a step.
    NoStepInProgress,
    /// The manager is not the one the engine was built for, or the host pool is larger
    /// than [`EngineConfig::host_blocks`].
    ForeignManager,
    /// The manager has no free sequence slot (for a fork).
    NoFreeSequence,
    /// A swapped-out request was cancelled without the host pool holding its blocks.
    NoHostPool,
    /// A manager operation the engine checked failed: an internal bug, reported rather
    /// than hidden. The step is abandoned.
    PlanFailed(SeqError),
    /// The scheduler refused its input.
    Schedule(ScheduleError),
}

impl fmt::Display for EngineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Init(e) => write!(f, "engine storage: {e}"),
            Self::ZeroConfig => f.write_str("engine configuration has a zero size"),
            Self::QueueFull { max_requests } => {
                write!(f, "{max_requests} requests in flight already")
            }
            Self::EmptyPrompt => f.write_str("empty prompt"),
            Self::ZeroMaxTokens => f.write_str("max_new_tokens is zero"),
            Self::TooLong { tokens, max_tokens } => {
                write!(
                    f,
                    "prompt of {tokens} tokens exceeds the maximum of {max_tokens}"
                )
            }
            Self::Unschedulable {
                needed_blocks,
                total_blocks,
                ..
            } => write!(
                f,
                "request needs {needed_blocks} blocks, the pool has {total_blocks}"
            ),
            Self::StaleRequest => f.write_str("stale request handle"),
            Self::WrongState { .. } => f.write_str("request is not in a state that allows this"),
            Self::DuplicateSample { .. } => f.write_str("two samples for one request"),
            Self::MissingSample { .. } => f.write_str("a sequence that emits got no sample"),
            Self::StepInProgress => f.write_str("a step waits for commit_step"),
            Self::NoStepInProgress => f.write_str("commit_step without a step"),
            Self::ForeignManager => f.write_str("manager is not the engine's"),
            Self::NoFreeSequence => f.write_str("no free sequence slot"),
            Self::NoHostPool => f.write_str("the request is swapped out: pass the host pool"),
            Self::PlanFailed(e) => write!(f, "a planned action failed (bug): {e}"),
            Self::Schedule(e) => write!(f, "scheduler: {e}"),
        }
    }
}

impl core::error::Error for EngineError {}

impl EngineConfig {
    /// Words of storage [`Engine::new`] needs for this configuration next to a manager of
    /// `kv`; `usize::MAX` when it does not fit in memory. O(1), usable in `const`
    /// contexts.
    pub const fn storage_words(&self, kv: &Config) -> usize {
        let w = self.storage_words_u128(kv);
        if w > (isize::MAX as u128) / 8 {
            usize::MAX
        } else {
            w as usize
        }
    }

    const fn storage_words_u128(&self, kv: &Config) -> u128 {
        let r = self.max_requests as usize;
        let t = self.scheduler.token_budget as usize;
        let n = kv.num_blocks as usize;
        let h = self.host_blocks as usize;
        let tokens = self.max_requests as u128 * kv.max_tokens_per_seq() as u128;
        words_for_pods::<Slot>(r) as u128
            + tokens.div_ceil(2)
            // The free list, the waiting, running and swapped queues, the joined list.
            + 5 * words_for_pods::<u32>(r) as u128
            + words_for_pods::<RunningSeq>(r) as u128
            + words_for_pods::<SwappedSeq>(r) as u128
            + words_for_pods::<ActionRecord>(r) as u128
            + words_for_pods::<ScheduledRecord>(r) as u128
            + 2 * words_for_pods::<u32>(t) as u128
            + words_for_pods::<BlockCopy>(r) as u128
            + words_for_pods::<BlockCopy>(h) as u128
            + words_for_pods::<BlockCopy>(if h < n { h } else { n }) as u128
            + words_for_pods::<PreemptRecord>(r) as u128
            + words_for_pods::<FinishedRecord>(r) as u128
            + QuotaPlan::storage_words(kv.max_namespaces)
    }
}

/// A FIFO of request slots with removal anywhere, over a slice. O(1) push back and pop,
/// O(len) push front and removal (lengths are bounded by `max_requests`).
#[derive(Debug)]
struct Queue<'a> {
    items: &'a mut [u32],
    len: usize,
}

impl<'a> Queue<'a> {
    fn new(items: &'a mut [u32]) -> Self {
        Self { items, len: 0 }
    }
    fn as_slice(&self) -> &[u32] {
        &self.items[..self.len]
    }
    fn push_back(&mut self, x: u32) {
        self.items[self.len] = x;
        self.len += 1;
    }
    fn push_front(&mut self, x: u32) {
        self.items.copy_within(0..self.len, 1);
        self.items[0] = x;
        self.len += 1;
    }
    fn remove(&mut self, x: u32) -> bool {
        match self.as_slice().iter().position(|&y| y == x) {
            Some(p) => {
                self.items.copy_within(p + 1..self.len, p);
                self.len -= 1;
                true
            }
            None => false,
        }
    }
}

/// The engine. See the module docs.
#[derive(Debug)]
pub struct Engine<'a> {
    config: EngineConfig,
    /// The manager this engine drives: its configuration (instance tag included).
    kv: Config,
    slots: &'a mut [Slot],
    tokens: &'a mut [u32],
    free: Queue<'a>,
    waiting: Queue<'a>,
    running: Queue<'a>,
    swapped: Queue<'a>,
    in_running: &'a mut [RunningSeq],
    in_swapped: &'a mut [SwappedSeq],
    actions: &'a mut [ActionRecord],
    joined: &'a mut [u32],
    scheduled: &'a mut [ScheduledRecord],
    step_slots: &'a mut [u32],
    step_tokens: &'a mut [u32],
    copies: &'a mut [BlockCopy],
    swap_out: &'a mut [BlockCopy],
    swap_in: &'a mut [BlockCopy],
    preempted: &'a mut [PreemptRecord],
    finished: &'a mut [FinishedRecord],
    quota: QuotaPlan<'a>,
    counts: StepCounts,
    in_step: bool,
    stats: EngineStats,
}

/// Lengths of the step outputs.
#[derive(Debug, Default, Clone, Copy)]
struct StepCounts {
    scheduled: usize,
    tokens: usize,
    copies: usize,
    swap_out: usize,
    swap_in: usize,
    preempted: usize,
}

impl<'a> Engine<'a> {
    /// Builds an engine for the manager configured by `kv` over `storage` (at least
    /// [`EngineConfig::storage_words`] words; its contents are ignored). O(storage).
    ///
    /// # Errors
    /// [`EngineError::ZeroConfig`] for zero `max_requests` or token budget;
    /// [`EngineError::Init`] with [`InitError::TooLarge`] when the sizes do not fit in
    /// memory, or [`InitError::StorageTooSmall`].
    pub fn new(
        config: EngineConfig,
        kv: &Config,
        storage: &'a mut [u64],
    ) -> Result<Self, EngineError> {
        if config.max_requests == 0 || config.scheduler.token_budget == 0 {
            return Err(EngineError::ZeroConfig);
        }
        let needed = config.storage_words(kv);
        if needed == usize::MAX {
            return Err(EngineError::Init(InitError::TooLarge));
        }
        if storage.len() < needed {
            return Err(EngineError::Init(InitError::StorageTooSmall {
                needed,
                got: storage.len(),
            }));
        }
        let r = config.max_requests as usize;
        let t = config.scheduler.token_budget as usize;
        let n = kv.num_blocks as usize;
        let per_request = kv.max_tokens_per_seq() as usize;
        let mut carve = Carver::new(storage);
        let slots = carve.pods::<Slot>(r);
        let tokens = carve.u32s(r * per_request);
        let mut free = Queue::new(carve.pods::<u32>(r));
        for i in 0..config.max_requests {
            free.push_back(i);
        }
        Ok(Self {
            config,
            kv: *kv,
            slots,
            tokens,
            free,
            waiting: Queue::new(carve.pods::<u32>(r)),
            running: Queue::new(carve.pods::<u32>(r)),
            swapped: Queue::new(carve.pods::<u32>(r)),
            in_running: carve.pods::<RunningSeq>(r),
            in_swapped: carve.pods::<SwappedSeq>(r),
            actions: carve.pods::<ActionRecord>(r),
            joined: carve.pods::<u32>(r),
            scheduled: carve.pods::<ScheduledRecord>(r),
            step_slots: carve.pods::<u32>(t),
            step_tokens: carve.pods::<u32>(t),
            copies: carve.pods::<BlockCopy>(r),
            swap_out: carve.pods::<BlockCopy>(config.host_blocks as usize),
            swap_in: carve.pods::<BlockCopy>(n.min(config.host_blocks as usize)),
            preempted: carve.pods::<PreemptRecord>(r),
            finished: carve.pods::<FinishedRecord>(r),
            quota: QuotaPlan::new(
                carve.words(QuotaPlan::storage_words(kv.max_namespaces) as usize),
            ),
            counts: StepCounts::default(),
            in_step: false,
            stats: EngineStats::default(),
        })
    }

    /// The configuration. O(1).
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Counters since construction. O(1).
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Requests waiting (new or preempted by recompute). O(1).
    pub fn waiting_len(&self) -> usize {
        self.waiting.len
    }

    /// Requests holding device blocks. O(1).
    pub fn running_len(&self) -> usize {
        self.running.len
    }

    /// Requests swapped out to the host tier. O(1).
    pub fn swapped_len(&self) -> usize {
        self.swapped.len
    }

    /// Requests in flight (waiting, running, swapped). O(1).
    pub fn in_flight(&self) -> usize {
        self.waiting.len + self.running.len + self.swapped.len
    }

    /// Index of live request `id`.
    fn check(&self, id: RequestId) -> Result<usize, EngineError> {
        match self.slots.get(id.index as usize) {
            Some(s) if s.state != FREE && s.generation == id.generation => Ok(id.index as usize),
            _ => Err(EngineError::StaleRequest),
        }
    }

    fn handle(&self, i: usize) -> RequestId {
        RequestId::from_parts(i as u32, self.slots[i].generation)
    }

    fn seq_of(&self, i: usize) -> SeqId {
        let s = &self.slots[i];
        SeqId::from_parts(s.seq_index, s.seq_generation, self.kv.instance)
    }

    fn token_range(&self, i: usize) -> core::ops::Range<usize> {
        let per = self.kv.max_tokens_per_seq() as usize;
        i * per..(i + 1) * per
    }

    /// The token ids of request `id` known so far: its prompt, then the tokens sampled.
    /// O(1).
    ///
    /// # Errors
    /// [`EngineError::StaleRequest`].
    pub fn tokens(&self, id: RequestId) -> Result<&[u32], EngineError> {
        let i = self.check(id)?;
        let r = self.token_range(i);
        Ok(&self.tokens[r][..self.slots[i].total as usize])
    }

    /// Where request `id` is. O(1).
    ///
    /// # Errors
    /// [`EngineError::StaleRequest`].
    pub fn state(&self, id: RequestId) -> Result<RequestState, EngineError> {
        let i = self.check(id)?;
        Ok(match self.slots[i].state {
            WAITING => RequestState::Waiting,
            RUNNING => RequestState::Running,
            _ => RequestState::Swapped,
        })
    }

    /// Tokens request `id` has generated. O(1).
    ///
    /// # Errors
    /// [`EngineError::StaleRequest`].
    pub fn generated(&self, id: RequestId) -> Result<u32, EngineError> {
        Ok(self.slots[self.check(id)?].generated)
    }

    /// The sequence of a running request (its row of the block table). O(1).
    ///
    /// # Errors
    /// [`EngineError::StaleRequest`]; [`EngineError::WrongState`] unless it is running.
    pub fn seq(&self, id: RequestId) -> Result<SeqId, EngineError> {
        let i = self.check(id)?;
        if self.slots[i].state != RUNNING {
            return Err(EngineError::WrongState { request: id });
        }
        Ok(self.seq_of(i))
    }

    /// Blocks the request needs with the whole pool free: its tokens plus the watermark.
    fn blocks_needed(&self, tokens: u32) -> u64 {
        u64::from(tokens.div_ceil(self.kv.block_size))
            + u64::from(self.config.scheduler.watermark_blocks)
    }

    /// Queues a request: `prompt` (copied), its prefix-cache `namespace`, and at most
    /// `max_new_tokens` to generate (`None`: until a [`Sampled::stop`] or the sequence
    /// is full). It waits for admission by [`Engine::step`]. O(prompt).
    ///
    /// # Errors
    /// [`EngineError::StepInProgress`], [`EngineError::EmptyPrompt`],
    /// [`EngineError::ZeroMaxTokens`], [`EngineError::TooLong`] past the manager's
    /// `max_tokens_per_seq`, [`EngineError::Unschedulable`] when the prompt's blocks plus
    /// the watermark exceed the pool, [`EngineError::QueueFull`].
    pub fn add_request(
        &mut self,
        prompt: &[u32],
        namespace: u64,
        max_new_tokens: Option<u32>,
    ) -> Result<RequestId, EngineError> {
        self.add_request_at(prompt, namespace, max_new_tokens, Priority::Normal)
    }

    /// [`Engine::add_request`] for a sequence of retention `priority`: the prompt's
    /// blocks it commits or reuses are kept at least that long in the prefix cache
    /// ([`Priority::Pinned`]: never evicted, for a hot system prompt; see
    /// [`BlockManager::set_priority`]). O(prompt).
    ///
    /// # Errors
    /// As [`Engine::add_request`].
    pub fn add_request_at(
        &mut self,
        prompt: &[u32],
        namespace: u64,
        max_new_tokens: Option<u32>,
        priority: Priority,
    ) -> Result<RequestId, EngineError> {
        if self.in_step {
            return Err(EngineError::StepInProgress);
        }
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if max_new_tokens == Some(0) {
            return Err(EngineError::ZeroMaxTokens);
        }
        let max_tokens = self.kv.max_tokens_per_seq();
        if prompt.len() as u64 > max_tokens {
            return Err(EngineError::TooLong {
                tokens: prompt.len() as u64,
                max_tokens,
            });
        }
        let needed = self.blocks_needed(prompt.len() as u32);
        if needed > u64::from(self.kv.num_blocks) {
            return Err(EngineError::Unschedulable {
                request: None,
                needed_blocks: needed,
                total_blocks: self.kv.num_blocks,
            });
        }
        let Some(&i) = self.free.as_slice().last() else {
            return Err(EngineError::QueueFull {
                max_requests: self.config.max_requests,
            });
        };
        self.free.len -= 1;
        let i = i as usize;
        let r = self.token_range(i);
        self.tokens[r][..prompt.len()].copy_from_slice(prompt);
        let s = &mut self.slots[i];
        *s = Slot {
            generation: s.generation,
            state: WAITING,
            namespace_lo: namespace as u32,
            namespace_hi: (namespace >> 32) as u32,
            total: prompt.len() as u32,
            max_new: max_new_tokens.unwrap_or(UNLIMITED),
            priority: u32::from(priority.level()),
            ..Slot::default()
        };
        self.waiting.push_back(i as u32);
        Ok(self.handle(i))
    }

    /// Checks that `kv` (and `host`) are the ones this engine drives.
    fn check_manager(&self, kv: &BlockManager<'_>) -> Result<(), EngineError> {
        if *kv.config() != self.kv {
            return Err(EngineError::ForeignManager);
        }
        Ok(())
    }

    /// Checks that `host` fits the configured host tier.
    fn check_host(&self, host: Option<&HostPool<'_>>) -> Result<(), EngineError> {
        if host.is_some_and(|h| h.total_blocks() > self.config.host_blocks) {
            return Err(EngineError::ForeignManager);
        }
        Ok(())
    }

    /// Plans and executes one step on `kv` (and `host`, the host tier for swaps; `None`:
    /// preemption always recomputes). Returns what the backend copies and the model
    /// computes; then call [`Engine::commit_step`]. A step may schedule nothing (all
    /// requests wait for memory, or none is in flight). O(running + swapped + waiting
    /// candidates + their prompts' lookups + tokens and blocks touched).
    ///
    /// # Errors
    /// [`EngineError::StepInProgress`] before the previous step's commit;
    /// [`EngineError::ForeignManager`]; [`EngineError::Unschedulable`] when nothing runs
    /// and the next request in line can never fit (cancel it); nothing changes on these.
    /// [`EngineError::PlanFailed`] would be a bug.
    pub fn step(
        &mut self,
        kv: &mut BlockManager<'_>,
        mut host: Option<&mut HostPool<'_>>,
    ) -> Result<Step<'_>, EngineError> {
        if self.in_step {
            return Err(EngineError::StepInProgress);
        }
        self.check_manager(kv)?;
        self.check_host(host.as_deref())?;
        let bs = self.kv.block_size;
        let sched = self.config.scheduler;

        // Describe the state to the scheduler. With no block shared anywhere (O(1) to
        // know), every sequence's blocks are its own and need no walk.
        // Namespace quotas: running sequences whose growth their namespace's quota
        // cannot take are preempted first (youngest of the namespace first); a swapped
        // one or a waiting request whose blocks it cannot take stays out of the plan
        // and waits (see `quota_plan`).
        self.counts = StepCounts::default();
        self.preempt_for_quotas(kv)?;
        let stats = kv.stats();
        // Pinned blocks stay cached when released, so preempting frees less than a
        // sequence's blocks: count them then too.
        let shared = stats.blocks_saved_by_sharing > 0 || kv.any_pinned();
        let n_running = self.running.len;
        for (k, &r) in self.running.as_slice().iter().enumerate() {
            let s = self.slots[r as usize];
            let seq = SeqId::from_parts(s.seq_index, s.seq_generation, self.kv.instance);
            let blocks = s.held.div_ceil(bs);
            let cow_blocks = u32::from(kv.append_copies(seq).map_err(EngineError::PlanFailed)?);
            // Blocks of a namespace with a reservation may stay kept for it when
            // released: preempting such a sequence is counted as freeing nothing.
            let exclusive_blocks = match (shared, kv.namespace_quota(s.namespace()).reserved_blocks)
            {
                (_, 1..) => 0,
                (true, 0) => kv.exclusive_blocks(seq).map_err(EngineError::PlanFailed)?,
                (false, 0) => blocks,
            };
            self.in_running[k] = RunningSeq {
                id: r,
                held_tokens: s.held,
                pending_tokens: s.total - s.held,
                exclusive_blocks,
                blocks,
                cow_blocks,
            };
        }
        let mut n_swapped = 0;
        for &r in self.swapped.as_slice() {
            let s = self.slots[r as usize];
            let blocks = s.held.div_ceil(bs);
            if self.quota.take(kv, s.namespace(), u64::from(blocks)) {
                self.in_swapped[n_swapped] = SwappedSeq { id: r, blocks };
                n_swapped += 1;
            }
        }
        let input = StepInput {
            running: &self.in_running[..n_running],
            swapped: &self.in_swapped[..n_swapped],
            waiting: &[],
            block_size: bs,
            available_blocks: kv.shared_available_blocks(),
            host_free_blocks: host.as_ref().map_or(0, |h| h.free_blocks()),
            free_seqs: self.kv.max_seqs - stats.live_seqs,
        };
        // Waiting requests are described as the scheduler draws them: admission stops at
        // the first that does not fit, so only those prompts are looked up.
        let (kv_ref, slots, tokens) = (&*kv, &*self.slots, &*self.tokens);
        let quota = &mut self.quota;
        let per_request = self.kv.max_tokens_per_seq() as usize;
        let waiting = self.waiting.as_slice().iter().filter_map(|&r| {
            let s = slots[r as usize];
            let start = r as usize * per_request;
            let hit = kv_ref.prefix_lookup(s.namespace(), &tokens[start..start + s.total as usize]);
            let blocks = s.total.div_ceil(bs) - hit.tokens / bs + hit.idle_blocks;
            quota
                .take(kv_ref, s.namespace(), u64::from(blocks))
                .then_some(WaitingSeq {
                    id: r,
                    prompt_tokens: s.total,
                    cached_tokens: hit.tokens,
                    cached_idle_blocks: hit.idle_blocks,
                })
        });
        let mut n_actions = 0;
        let actions = &mut *self.actions;
        let plan = schedule_lazy(&sched, &input, waiting, |a| {
            actions[n_actions] = ActionRecord::from_action(a);
            n_actions += 1;
        })
        .map_err(EngineError::Schedule)?;
        if plan.actions == 0 && self.running.len == 0 && self.counts.preempted == 0 {
            // Nothing holds blocks: the pool is all free or cached. If the head still
            // does not fit, it never will.
            let head = self
                .swapped
                .as_slice()
                .first()
                .or(self.waiting.as_slice().first());
            if let Some(&r) = head {
                let s = self.slots[r as usize];
                let needed = self.blocks_needed(s.total) + u64::from(s.state == SWAPPED);
                // Its namespace's limit bounds it too (blocks of its own; no watermark).
                let own = u64::from(s.total.div_ceil(bs));
                let limit = kv.namespace_quota(s.namespace()).max_blocks;
                let (needed, total) = match own > u64::from(limit) {
                    true => (own, limit),
                    false => (needed, self.kv.num_blocks),
                };
                if needed > u64::from(total) {
                    return Err(EngineError::Unschedulable {
                        request: Some(self.handle(r as usize)),
                        needed_blocks: needed,
                        total_blocks: total,
                    });
                }
            }
        }

        // Execute the plan, in order.
        let mut joined = 0usize;
        for k in 0..n_actions {
            let a = self.actions[k];
            let i = a.id as usize;
            let result = match a.kind {
                PREEMPT_RECOMPUTE | PREEMPT_SWAP => {
                    self.preempt(kv, host.as_deref_mut(), i, a.kind == PREEMPT_SWAP)
                }
                RUN => self.run(kv, i, a.tokens),
                SWAP_IN => self.swap_in(kv, host.as_deref_mut(), i).map(|()| {
                    self.joined[joined] = i as u32;
                    joined += 1;
                }),
                _ => self.admit(kv, i, a.tokens).map(|()| {
                    self.joined[joined] = i as u32;
                    joined += 1;
                }),
            };
            if let Err(e) = result {
                // Leave the engine usable for cancel/inspection; the plan is abandoned.
                for &j in &self.joined[..joined] {
                    self.running.push_back(j);
                }
                return Err(EngineError::PlanFailed(e));
            }
        }
        for k in 0..joined {
            self.running.push_back(self.joined[k]);
        }
        self.stats.steps += 1;
        self.in_step = true;
        Ok(self.current_step())
    }

    /// The outputs of the step in progress.
    fn current_step(&self) -> Step<'_> {
        let c = self.counts;
        Step {
            scheduled: &self.scheduled[..c.scheduled],
            slots: &self.step_slots[..c.tokens],
            input_tokens: &self.step_tokens[..c.tokens],
            copies: &self.copies[..c.copies],
            swap_out: &self.swap_out[..c.swap_out],
            swap_in: &self.swap_in[..c.swap_in],
            preempted: &self.preempted[..c.preempted],
            instance: self.kv.instance,
        }
    }

    /// The step waiting for [`Engine::commit_step`], if any (e.g. to read it again after
    /// running the model). O(1).
    pub fn pending_step(&self) -> Option<Step<'_>> {
        self.in_step.then(|| self.current_step())
    }

    fn preempt(
        &mut self,
        kv: &mut BlockManager<'_>,
        host: Option<&mut HostPool<'_>>,
        i: usize,
        swap: bool,
    ) -> Result<(), SeqError> {
        let seq = self.seq_of(i);
        match (swap, host) {
            (true, Some(host)) => {
                let at = self.counts.swap_out;
                self.counts.swap_out += kv.swap_out(seq, host, &mut self.swap_out[at..])? as usize;
                self.slots[i].state = SWAPPED;
                self.running.remove(i as u32);
                self.swapped.push_front(i as u32);
                self.stats.swap_outs += 1;
            }
            _ => {
                kv.release(seq)?;
                let s = &mut self.slots[i];
                s.state = WAITING;
                s.held = 0;
                self.running.remove(i as u32);
                self.waiting.push_front(i as u32);
                self.stats.recomputes += 1;
            }
        }
        self.preempted[self.counts.preempted] = PreemptRecord {
            request: i as u32,
            request_generation: self.slots[i].generation,
            swap: u32::from(swap),
        };
        self.counts.preempted += 1;
        Ok(())
    }

    /// Blocks running request `i` takes when all its pending tokens run: new blocks
    /// plus a copy-on-write block.
    fn growth(&self, kv: &BlockManager<'_>, i: usize) -> Result<u64, EngineError> {
        let s = self.slots[i];
        let cow = kv
            .append_copies(self.seq_of(i))
            .map_err(EngineError::PlanFailed)?;
        let bs = self.kv.block_size;
        Ok(u64::from(s.total.div_ceil(bs) - s.held.div_ceil(bs)) + u64::from(cow))
    }

    /// Charges every running sequence's growth to its namespace's quota (oldest first),
    /// preempting by recompute the youngest running sequence of a namespace whose quota
    /// cannot take it (possibly the sequence itself), until all fit. Leaves the quota
    /// table charged with the running growth. O(running² + preempted blocks).
    fn preempt_for_quotas(&mut self, kv: &mut BlockManager<'_>) -> Result<(), EngineError> {
        self.quota.reset();
        if kv.config().max_namespaces == 0 {
            return Ok(());
        }
        let mut k = 0;
        while k < self.running.len {
            let i = self.running.as_slice()[k] as usize;
            let namespace = self.slots[i].namespace();
            let grow = self.growth(kv, i)?;
            if self.quota.take(kv, namespace, grow) {
                k += 1;
                continue;
            }
            let running = self.running.as_slice();
            let victim = running[k..]
                .iter()
                .rev()
                .map(|&j| j as usize)
                .find(|&j| self.slots[j].namespace() == namespace)
                .unwrap_or(i);
            self.preempt(kv, None, victim, false)
                .map_err(EngineError::PlanFailed)?;
            // Rooms changed: charge again from the oldest.
            self.quota.reset();
            k = 0;
        }
        Ok(())
    }

    /// Records a scheduled sequence whose slots were just written at the step's token
    /// offset.
    fn record_scheduled(&mut self, i: usize, first_pos: u32, tokens: u32) {
        let s = self.slots[i];
        let off = self.counts.tokens;
        let ids =
            &self.tokens[self.token_range(i)][first_pos as usize..(first_pos + tokens) as usize];
        self.step_tokens[off..off + tokens as usize].copy_from_slice(ids);
        let emits = first_pos + tokens == s.total;
        self.scheduled[self.counts.scheduled] = ScheduledRecord {
            request: i as u32,
            request_generation: s.generation,
            seq_index: s.seq_index,
            seq_generation: s.seq_generation,
            first_pos,
            tokens,
            offset: off as u32,
            emits: u32::from(emits),
        };
        self.counts.scheduled += 1;
        self.counts.tokens += tokens as usize;
        let s = &mut self.slots[i];
        s.held = first_pos + tokens;
        s.flags |= SCHEDULED | if emits { EMITS } else { 0 };
    }

    fn push_copy(&mut self, copy: Option<BlockCopy>) {
        if let Some(c) = copy {
            self.copies[self.counts.copies] = c;
            self.counts.copies += 1;
        }
    }

    fn run(&mut self, kv: &mut BlockManager<'_>, i: usize, tokens: u32) -> Result<(), SeqError> {
        let seq = self.seq_of(i);
        let held = self.slots[i].held;
        let off = self.counts.tokens;
        let range = self.token_range(i);
        let ids = &self.tokens[range][held as usize..(held + tokens) as usize];
        let appended =
            kv.append_tokens(seq, ids, &mut self.step_slots[off..off + tokens as usize])?;
        self.push_copy(appended.copy);
        self.record_scheduled(i, held, tokens);
        Ok(())
    }

    fn swap_in(
        &mut self,
        kv: &mut BlockManager<'_>,
        host: Option<&mut HostPool<'_>>,
        i: usize,
    ) -> Result<(), SeqError> {
        let host = host.ok_or(SeqError::NotSwapped)?;
        let at = self.counts.swap_in;
        self.counts.swap_in += kv.swap_in(self.seq_of(i), host, &mut self.swap_in[at..])? as usize;
        self.slots[i].state = RUNNING;
        self.swapped.remove(i as u32);
        self.stats.swap_ins += 1;
        Ok(())
    }

    fn admit(&mut self, kv: &mut BlockManager<'_>, i: usize, tokens: u32) -> Result<(), SeqError> {
        let s = self.slots[i];
        let range = self.token_range(i);
        let all = &self.tokens[range][..s.total as usize];
        // The cache may hold less than the plan saw (an earlier admission of this step
        // evicted part of it); computing `tokens` after what is there now takes no more
        // blocks than planned (see the module docs).
        let hit = kv.prefix_lookup(s.namespace(), all).tokens;
        let len = hit.saturating_add(tokens).min(s.total);
        let off = self.counts.tokens;
        let priority = Priority::from_level(s.priority as u8).unwrap_or_default();
        let start = kv.create_with_prompt_at(
            s.namespace(),
            priority,
            &all[..len as usize],
            &mut self.step_slots[off..],
        )?;
        self.push_copy(start.appended.copy);
        let seq = start.seq;
        let slot = &mut self.slots[i];
        slot.seq_index = seq.index();
        slot.seq_generation = seq.generation();
        slot.state = RUNNING;
        let computed = len - start.reused_tokens;
        if slot.flags & ADMITTED_ONCE != 0 {
            self.stats.recomputed_tokens += u64::from(computed);
        } else {
            slot.flags |= ADMITTED_ONCE;
            self.stats.admitted += 1;
        }
        self.waiting.remove(i as u32);
        self.record_scheduled(i, start.reused_tokens, computed);
        Ok(())
    }

    /// Ends the step: the model has written the K/V of every scheduled token, so their
    /// full blocks are offered to the prefix cache; `sampled` holds exactly one token for
    /// every scheduled sequence that [`ScheduledSeq::emits`]. Each sampled token is
    /// appended to its request (it is computed by the next step); a request finishes on
    /// [`Sampled::stop`], at its `max_new_tokens`, or when its sequence is full, and its
    /// blocks are released (full registered ones stay cached). Returns the finished
    /// requests. O(scheduled + sampled + blocks committed or released).
    ///
    /// # Errors
    /// [`EngineError::NoStepInProgress`], [`EngineError::ForeignManager`],
    /// [`EngineError::StaleRequest`], [`EngineError::WrongState`] (a sample for a request
    /// that does not emit this step), [`EngineError::DuplicateSample`],
    /// [`EngineError::MissingSample`]. Nothing changes on error.
    pub fn commit_step(
        &mut self,
        kv: &mut BlockManager<'_>,
        sampled: &[Sampled],
    ) -> Result<FinishedRequests<'_>, EngineError> {
        if !self.in_step {
            return Err(EngineError::NoStepInProgress);
        }
        self.check_manager(kv)?;
        // Validate, marking the samples; undo the marks on error.
        let mut marked = 0;
        let mut error = None;
        for s in sampled {
            match self.check(s.request) {
                Ok(i) if self.slots[i].flags & SAMPLED != 0 => {
                    error = Some(EngineError::DuplicateSample { request: s.request });
                }
                Ok(i) if self.slots[i].flags & EMITS == 0 => {
                    error = Some(EngineError::WrongState { request: s.request });
                }
                Ok(i) => {
                    self.slots[i].flags |= SAMPLED;
                    marked += 1;
                    continue;
                }
                Err(e) => error = Some(e),
            }
            break;
        }
        if error.is_none() {
            for r in &self.scheduled[..self.counts.scheduled] {
                if r.emits != 0 && self.slots[r.request as usize].flags & SAMPLED == 0 {
                    error = Some(EngineError::MissingSample {
                        request: RequestId::from_parts(r.request, r.request_generation),
                    });
                    break;
                }
            }
        }
        if let Some(e) = error {
            for s in &sampled[..marked] {
                self.slots[s.request.index as usize].flags &= !SAMPLED;
            }
            return Err(e);
        }

        // Commit: nothing below fails on valid input.
        for k in 0..self.counts.scheduled {
            let r = self.scheduled[k];
            let i = r.request as usize;
            let seq = self.seq_of(i);
            kv.commit(seq, self.slots[i].held)
                .map_err(EngineError::PlanFailed)?;
            self.slots[i].flags &= !(SCHEDULED | EMITS);
        }
        let max_tokens = self.kv.max_tokens_per_seq() as u32;
        let mut n_finished = 0;
        for s in sampled {
            let i = s.request.index as usize;
            let slot = &mut self.slots[i];
            slot.flags &= !SAMPLED;
            slot.generated += 1;
            let reason = if s.stop {
                Some(FinishReason::Stop)
            } else if slot.generated >= slot.max_new {
                Some(FinishReason::MaxTokens)
            } else if slot.total >= max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if slot.total < max_tokens {
                let pos = slot.total as usize;
                slot.total += 1;
                let r = self.token_range(i);
                self.tokens[r][pos] = s.token;
            }
            if let Some(reason) = reason {
                let generated = self.slots[i].generated;
                kv.release(self.seq_of(i))
                    .map_err(EngineError::PlanFailed)?;
                self.running.remove(i as u32);
                self.free_slot(i);
                self.finished[n_finished] = FinishedRecord {
                    request: s.request.index,
                    request_generation: s.request.generation,
                    reason: reason as u32,
                    generated,
                };
                n_finished += 1;
            }
        }
        self.stats.finished += n_finished as u64;
        self.in_step = false;
        Ok(FinishedRequests {
            records: &self.finished[..n_finished],
        })
    }

    /// Returns slot `i` to the free list; its handles become stale.
    fn free_slot(&mut self, i: usize) {
        let s = &mut self.slots[i];
        s.state = FREE;
        s.flags = 0;
        s.generation = s.generation.wrapping_add(1);
        self.free.push_back(i as u32);
    }

    /// Cancels request `id` in any state between steps: its sequence is released (or,
    /// swapped out, its host blocks returned through `host`) and its handle becomes
    /// stale. O(blocks of its sequence + requests in its queue).
    ///
    /// # Errors
    /// [`EngineError::StepInProgress`], [`EngineError::StaleRequest`],
    /// [`EngineError::ForeignManager`], [`EngineError::NoHostPool`] for a swapped-out
    /// request without `host` (or with another manager's pool). Nothing changes on error.
    pub fn cancel(
        &mut self,
        kv: &mut BlockManager<'_>,
        host: Option<&mut HostPool<'_>>,
        id: RequestId,
    ) -> Result<(), EngineError> {
        if self.in_step {
            return Err(EngineError::StepInProgress);
        }
        let i = self.check(id)?;
        self.check_manager(kv)?;
        match self.slots[i].state {
            WAITING => {
                self.waiting.remove(i as u32);
            }
            RUNNING => {
                kv.release(self.seq_of(i))
                    .map_err(EngineError::PlanFailed)?;
                self.running.remove(i as u32);
            }
            _ => {
                let host = host.ok_or(EngineError::NoHostPool)?;
                kv.release_swapped(self.seq_of(i), host)
                    .map_err(|_| EngineError::NoHostPool)?;
                self.swapped.remove(i as u32);
            }
        }
        self.free_slot(i);
        Ok(())
    }

    /// Forks running request `id` between steps (parallel sampling, beams): the child
    /// shares every computed block of the parent (copy-on-write on the first append into
    /// a shared partial block), has the same tokens, generated count, namespace and
    /// limit, and joins the running sequences as the youngest. With `last_token`, the
    /// child's last token — the one sampled and not yet computed — is replaced (a
    /// different sample from the same logits). O(blocks + tokens of the parent).
    ///
    /// # Errors
    /// [`EngineError::StepInProgress`], [`EngineError::StaleRequest`],
    /// [`EngineError::ForeignManager`], [`EngineError::WrongState`] unless the parent is
    /// running (and, with `last_token`, has a sampled token not yet computed),
    /// [`EngineError::QueueFull`], [`EngineError::NoFreeSequence`] when the manager has
    /// no free sequence slot. Nothing changes on error.
    pub fn fork(
        &mut self,
        kv: &mut BlockManager<'_>,
        id: RequestId,
        last_token: Option<u32>,
    ) -> Result<RequestId, EngineError> {
        if self.in_step {
            return Err(EngineError::StepInProgress);
        }
        let p = self.check(id)?;
        self.check_manager(kv)?;
        let parent = self.slots[p];
        if parent.state != RUNNING || (last_token.is_some() && parent.total == parent.held) {
            return Err(EngineError::WrongState { request: id });
        }
        let Some(&c) = self.free.as_slice().last() else {
            return Err(EngineError::QueueFull {
                max_requests: self.config.max_requests,
            });
        };
        let child = kv.fork(self.seq_of(p)).map_err(|e| match e {
            SeqError::NoFreeSequence => EngineError::NoFreeSequence,
            e => EngineError::PlanFailed(e),
        })?;
        self.free.len -= 1;
        let c = c as usize;
        let per = self.kv.max_tokens_per_seq() as usize;
        let n = parent.total as usize;
        self.tokens.copy_within(p * per..p * per + n, c * per);
        if let Some(t) = last_token {
            self.tokens[c * per + n - 1] = t;
        }
        let generation = self.slots[c].generation;
        self.slots[c] = Slot {
            generation,
            seq_index: child.index(),
            seq_generation: child.generation(),
            ..parent
        };
        self.running.push_back(c as u32);
        Ok(self.handle(c))
    }
}

/// The requests that finished in one [`Engine::commit_step`]; borrowed from the engine.
#[derive(Debug, Clone, Copy)]
pub struct FinishedRequests<'e> {
    records: &'e [FinishedRecord],
}

impl FinishedRequests<'_> {
    /// How many finished. O(1).
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether none finished. O(1).
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Finished request `i`, `None` past [`FinishedRequests::len`]. O(1).
    pub fn get(&self, i: usize) -> Option<Finished> {
        self.records.get(i).map(FinishedRecord::finished)
    }

    /// The finished requests, in the order of the samples. O(1) per item.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Finished> + '_ {
        self.records.iter().map(FinishedRecord::finished)
    }
}

impl FinishedRecord {
    fn finished(&self) -> Finished {
        let r = self;
        Finished {
            request: RequestId::from_parts(r.request, r.request_generation),
            reason: match r.reason {
                0 => FinishReason::Stop,
                1 => FinishReason::MaxTokens,
                _ => FinishReason::Length,
            },
            generated: r.generated,
        }
    }
}
