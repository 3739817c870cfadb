//! [`Engine`]: the core's engine step over an owned [`KvCache`] — continuous batching
//! where kvpage also executes the swaps and copy-on-write copies and runs attention.
//!
//! One step, as a model runs it:
//! 1. [`Engine::step`] plans and executes the step on the block manager, then performs
//!    the block copies it reported (swap-outs to the host arena, swap-ins back,
//!    copy-on-write) and returns the [`Step`]: per scheduled sequence its query
//!    positions and input token ids, all of them flattened in one order.
//! 2. For each layer, the model computes q, k and v of the step's tokens as one batch
//!    (`[step tokens][heads][head_dim]`, in [`Step`] order), stores k and v with
//!    [`Engine::write_kv`] and attends with [`Engine::attention`] (causal over each
//!    sequence's cached context plus its new tokens; decode is one token).
//! 3. It samples a token for each sequence that emits and reports them with
//!    [`Engine::commit_step`], which returns the finished requests.
//!
//! Everything is allocated in [`Engine::new`]; no later call allocates.

use kvpage_core::{
    EngineConfig as CoreEngineConfig, EngineError, EngineStats, FinishedRequests, NamespaceQuota,
    Priority, QuotaError, RequestId, RequestState, Sampled, SchedulerConfig, Step,
};

use crate::cache::{CacheConfig, CacheError, Capacity, KvCache};
use crate::kernels::SeqQuery;
use crate::quant::KvScales;
use crate::storage::Backend;
use crate::tables::{EngineParts, Tables};

/// What an [`Engine`] is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// The cache: geometry, device capacity, sequences, longest sequence, threads.
    pub cache: CacheConfig,
    /// Requests in flight at once (waiting, running, swapped out).
    pub max_requests: u32,
    /// Per-step token budget, running limit, watermark, preemption mode.
    pub scheduler: SchedulerConfig,
    /// Host memory for swapped-out sequences (`Capacity::Blocks(0)`: none; preemption
    /// then always recomputes).
    pub host_capacity: Capacity,
}

/// Continuous batching over an owned [`KvCache`]. See the module docs.
#[derive(Debug)]
pub struct Engine {
    cache: KvCache,
}

impl Engine {
    /// Allocates the cache, its host tier and the request engine. O(arena bytes + host
    /// arena + tables).
    ///
    /// # Errors
    /// [`KvCache::new`]'s errors; [`CacheError::BadConfig`] for a host capacity of more
    /// than `u32::MAX` blocks; [`CacheError::Engine`] for a zero `max_requests` or token
    /// budget.
    pub fn new(config: EngineConfig) -> Result<Self, CacheError> {
        Self::with_backend(config, Backend::Cpu)
    }

    /// [`Engine::new`] on `backend` (see [`KvCache::with_backend`]): on a CUDA device
    /// the host tier is pinned host memory and swaps run on the device's copy stream.
    /// O(arena bytes + host arena + tables).
    ///
    /// # Errors
    /// As [`Engine::new`] and [`KvCache::with_backend`].
    pub fn with_backend(config: EngineConfig, backend: Backend) -> Result<Self, CacheError> {
        let host_blocks = match config.host_capacity {
            Capacity::Blocks(n) => u64::from(n),
            Capacity::Bytes(bytes) => config.cache.geometry.blocks_in(bytes),
        };
        let host_blocks = u32::try_from(host_blocks).map_err(|_| CacheError::BadConfig)?;
        let parts = EngineParts {
            host_blocks,
            engine: CoreEngineConfig {
                max_requests: config.max_requests,
                scheduler: config.scheduler,
                host_blocks,
            },
        };
        Ok(Self {
            cache: KvCache::build(config.cache, Some(parts), backend)?,
        })
    }

    /// The cache, read-only: geometry, statistics, block table. O(1).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// The cache, for the event drain of the C API (nothing else may change it behind
    /// the engine's back). O(1).
    pub(crate) fn cache_mut(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    /// The core's request engine. O(1).
    pub(crate) fn engine(&self) -> &kvpage_core::Engine<'_> {
        core_engine(&self.cache.tables)
    }

    /// Counters of the engine. O(1).
    pub fn stats(&self) -> EngineStats {
        self.engine().stats()
    }

    /// Requests in flight. O(1).
    pub fn in_flight(&self) -> usize {
        self.engine().in_flight()
    }

    /// The token ids of a request: prompt, then sampled tokens. O(1).
    ///
    /// # Errors
    /// [`EngineError::StaleRequest`].
    pub fn tokens(&self, id: RequestId) -> Result<&[u32], CacheError> {
        Ok(self.engine().tokens(id)?)
    }

    /// Where a request is. O(1).
    ///
    /// # Errors
    /// [`EngineError::StaleRequest`].
    pub fn state(&self, id: RequestId) -> Result<RequestState, CacheError> {
        Ok(self.engine().state(id)?)
    }

    /// Queues a request (see [`kvpage_core::Engine::add_request`]). O(prompt).
    ///
    /// # Errors
    /// As [`kvpage_core::Engine::add_request`], wrapped in [`CacheError::Engine`].
    pub fn add_request(
        &mut self,
        prompt: &[u32],
        namespace: u64,
        max_new_tokens: Option<u32>,
    ) -> Result<RequestId, CacheError> {
        self.add_request_at(prompt, namespace, max_new_tokens, Priority::Normal)
    }

    /// Queues a request of retention `priority` (see
    /// [`kvpage_core::Engine::add_request_at`]: `Pinned` keeps a hot system prompt
    /// cached). O(prompt).
    ///
    /// # Errors
    /// As [`kvpage_core::Engine::add_request`], wrapped in [`CacheError::Engine`].
    pub fn add_request_at(
        &mut self,
        prompt: &[u32],
        namespace: u64,
        max_new_tokens: Option<u32>,
        priority: Priority,
    ) -> Result<RequestId, CacheError> {
        let (engine, _, _) = core_parts(&mut self.cache.tables);
        Ok(engine.add_request_at(prompt, namespace, max_new_tokens, priority)?)
    }

    /// [`KvCache::set_namespace_quota`] on the engine's cache: the scheduler keeps each
    /// namespace within its quota (a request its limit cannot take waits while other
    /// namespaces go ahead). O(namespaces + evicted).
    ///
    /// # Errors
    /// As [`KvCache::set_namespace_quota`]. Nothing changes on error.
    pub fn set_namespace_quota(
        &mut self,
        namespace: u64,
        quota: NamespaceQuota,
    ) -> Result<(), QuotaError> {
        self.cache.set_namespace_quota(namespace, quota)
    }

    /// [`KvCache::unpin_cached`] on the engine's cache. O(unpinned × namespaces).
    pub fn unpin_cached(&mut self) -> u32 {
        self.cache.unpin_cached()
    }

    /// [`KvCache::drain_events`] on the engine's cache: the KV events since the last
    /// drain, for a router (size the ring with the cache's
    /// [`crate::CacheConfig::event_capacity`]; a snapshot is
    /// `engine.cache().events_snapshot()`). O(events × block_size).
    pub fn drain_events(&mut self, max: usize) -> crate::EventBatch {
        self.cache.drain_events(max)
    }

    /// Plans and executes one step, including its block copies (swap-out, swap-in,
    /// copy-on-write, in that order), and returns what the model computes. O(the core
    /// step + copied blocks × bytes per block).
    ///
    /// # Errors
    /// As [`kvpage_core::Engine::step`], wrapped in [`CacheError::Engine`]; a copy
    /// refused by the kernels would be an internal bug ([`CacheError::Kernel`]); on a
    /// CUDA device, [`CacheError::Device`] for a driver error of the swaps or copies
    /// (the step was planned: the engine is unusable, drop it).
    pub fn step(&mut self) -> Result<Step<'_>, CacheError> {
        let cache = &mut self.cache;
        let (engine, manager, host) = core_parts(&mut cache.tables);
        let step = engine.step(manager, host)?;
        let layout = &cache.layout;
        cache
            .storage
            .swap(layout, step.swap_out(), step.swap_in())?;
        cache.storage.copy_blocks(layout, step.copies())?;
        Ok(step)
    }

    /// The step waiting for [`Engine::commit_step`], if any. O(1).
    pub fn pending_step(&self) -> Option<Step<'_>> {
        self.engine().pending_step()
    }

    /// Stores the K and V of layer `layer` for every token of the pending step:
    /// `[step tokens][kv_heads][head_dim]` f32 each, in [`Step`] order (8-bit rows at
    /// the layer's fixed scales where [`Engine::set_kv_scales`] set them).
    /// O(step tokens × kv_heads × head_dim).
    ///
    /// # Errors
    /// [`EngineError::NoStepInProgress`]; the kernel's errors (buffer lengths, layer out
    /// of range). Nothing is written on error.
    pub fn write_kv(&mut self, layer: u32, k: &[f32], v: &[f32]) -> Result<(), CacheError> {
        let cache = &mut self.cache;
        let step = core_engine(&cache.tables)
            .pending_step()
            .ok_or(EngineError::NoStepInProgress)?;
        let scales = cache.kv_scales_of(layer);
        cache
            .storage
            .write_kv(&cache.layout, layer, step.slots(), k, v, scales)
    }

    /// Fixes the scales of layer `layer`'s 8-bit K and V codes for the rows written
    /// from now on, or goes back to a scale per row (see [`KvCache::set_kv_scales`]).
    /// O(1).
    ///
    /// # Errors
    /// As [`KvCache::set_kv_scales`]. Nothing changes on error.
    pub fn set_kv_scales(
        &mut self,
        layer: u32,
        scales: Option<KvScales>,
    ) -> Result<(), CacheError> {
        self.cache.set_kv_scales(layer, scales)
    }

    /// The fixed scales of layer `layer` (see [`KvCache::kv_scales`]). O(1).
    ///
    /// # Errors
    /// As [`KvCache::set_kv_scales`].
    pub fn kv_scales(&self, layer: u32) -> Result<Option<KvScales>, CacheError> {
        self.cache.kv_scales(layer)
    }

    /// Attention of layer `layer` for every sequence of the pending step: its new tokens
    /// are the queries, causal over its whole context (cached positions and this step's,
    /// whose K/V [`Engine::write_kv`] stored). `q` and `out` are `[step tokens][q_heads]
    /// [head_dim]` in [`Step`] order. See [`crate::kernels::paged_attention`] for the cost.
    ///
    /// # Errors
    /// [`EngineError::NoStepInProgress`]; the kernel's errors. Nothing is written on
    /// error.
    pub fn attention(
        &mut self,
        layer: u32,
        q: &[f32],
        out: &mut [f32],
        q_heads: u32,
        scale: f32,
    ) -> Result<(), CacheError> {
        let cache = &mut self.cache;
        let step = core_engine(&cache.tables)
            .pending_step()
            .ok_or(EngineError::NoStepInProgress)?;
        cache.batch.clear();
        // Scheduled sequences are live, so at most `max_seqs`: the batch's capacity.
        cache.batch.extend(step.seqs().map(|s| SeqQuery {
            row: s.seq.index(),
            context_len: s.first_pos + s.tokens,
            queries: s.tokens,
        }));
        cache.run_attention(layer, q, out, q_heads, scale)
    }

    /// Ends the step with the sampled tokens (see [`kvpage_core::Engine::commit_step`]).
    /// O(scheduled + sampled + blocks committed or released).
    ///
    /// # Errors
    /// As [`kvpage_core::Engine::commit_step`], wrapped in [`CacheError::Engine`].
    /// Nothing changes on error.
    pub fn commit_step(&mut self, sampled: &[Sampled]) -> Result<FinishedRequests<'_>, CacheError> {
        let (engine, manager, _) = core_parts(&mut self.cache.tables);
        Ok(engine.commit_step(manager, sampled)?)
    }

    /// Cancels a request in any state between steps. O(its blocks).
    ///
    /// # Errors
    /// As [`kvpage_core::Engine::cancel`], wrapped in [`CacheError::Engine`].
    pub fn cancel(&mut self, id: RequestId) -> Result<(), CacheError> {
        let (engine, manager, host) = core_parts(&mut self.cache.tables);
        Ok(engine.cancel(manager, host, id)?)
    }

    /// Forks a running request between steps (see [`kvpage_core::Engine::fork`]).
    /// O(blocks + tokens of the parent).
    ///
    /// # Errors
    /// As [`kvpage_core::Engine::fork`], wrapped in [`CacheError::Engine`].
    pub fn fork(
        &mut self,
        id: RequestId,
        last_token: Option<u32>,
    ) -> Result<RequestId, CacheError> {
        let (engine, manager, _) = core_parts(&mut self.cache.tables);
        Ok(engine.fork(manager, id, last_token)?)
    }
}

/// The request engine of an [`Engine`]'s cache tables. O(1).
fn core_engine(tables: &Tables) -> &kvpage_core::Engine<'_> {
    match &tables.get().engine {
        Some(e) => e,
        // `Engine::new` always builds its cache with an engine.
        None => unreachable!("an Engine's cache always has an engine"),
    }
}

/// The request engine, the manager and the host pool of an [`Engine`]'s cache tables,
/// borrowed apart so the engine can drive the other two. O(1).
fn core_parts(
    tables: &mut Tables,
) -> (
    &mut kvpage_core::Engine<'static>,
    &mut kvpage_core::BlockManager<'static>,
    Option<&mut kvpage_core::HostPool<'static>>,
) {
    let parts = tables.parts_mut();
    match parts.engine.as_mut() {
        Some(e) => (e, &mut parts.manager, parts.host.as_mut()),
        // `Engine::new` always builds its cache with an engine.
        None => unreachable!("an Engine's cache always has an engine"),
    }
}
