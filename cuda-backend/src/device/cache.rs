//! [`DeviceCache`]: the core's block manager over a device arena, with the CPU cache's
//! API (create, append, commit, fork, truncate, release, write K/V, decode, prefill,
//! stats) running the CUDA kernels.
//!
//! Everything is allocated in [`DeviceCache::new`]: the step metadata buffers and their
//! pinned staging twin ([`StepBuffers`]), the K/V / query / output / partition-scratch
//! device buffers and a pinned I/O buffer at the configured step maximum, and then the
//! arena (a fraction of the free memory left, a byte count or a block count), zeroed. No
//! later operation allocates on the device or the host.
//!
//! The manager borrows caller storage (`&'a mut [u64]` of
//! [`DeviceCache::storage_words`] words), as the core always does.
//!
//! What the type enforces, as the CPU cache does: a handle of another cache is refused
//! (its own instance tag), a copy-on-write is executed inside the append that reports
//! it, and K/V is only written at positions appended since the sequence last became
//! shareable (`[pending, len)`).
//!
//! Operations that take host slices (`write_kv`, `decode`, `prefill`) are synchronous:
//! they copy through the pinned I/O buffer, launch on the cache's stream and wait. Their
//! `*_on` variants take device buffers and a stream of the caller's and return once the
//! work is queued, so a caller overlaps steps with its own work (the model's layers) on
//! its stream. Every launch of a cache is ordered after the previous one's, whatever
//! stream each ran on: the step metadata upload of a launch waits (on the device) for the
//! end of the previous launch's work ([`StepBuffers`]).

use core::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use kvpage_core::{
    BlockCopy, BlockManager, Config, Geometry, HostPool, InitError, Priority, PromptStart,
    SeqError, SeqId, Stats,
};

use super::{
    Context, DeviceMemory, Direction, HostTier, Kernels, KernelsError, PinnedMemory, StepBuffers,
    StepError, Stream, StreamRef, SwapError,
};
use crate::driver::{CuDevicePtr, DriverError};
use crate::launch::{
    plan_attention, plan_copy, plan_write, AttentionBuffers, AttentionCall, AttentionPlan,
    LaunchError, Partitioning, MIN_PARTITION_TOKENS,
};
use crate::params::{KvpCopyParams, KvpGeometry, KvpSeqDesc, KvpWriteParams};
use crate::sizing::{arena_blocks, ArenaSize, SizingError, StepLimits};
use crate::upload::RowUse;

/// Instance tags of device caches: a range apart from the CPU caches' small counters.
static NEXT_INSTANCE: AtomicU32 = AtomicU32::new(0x4000_0000);

/// `len` f32 in device memory at `ptr`: a caller's buffer for the `*_on` operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSlice {
    /// Device address of the first element.
    pub ptr: CuDevicePtr,
    /// Elements (f32).
    pub len: usize,
}

/// What a [`DeviceCache`] is built from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceCacheConfig {
    /// The model's KV geometry (a storage dtype and head dim the kernels support: see
    /// [`crate::launch::Kernel::attention`]).
    pub geometry: Geometry,
    /// The device's ordinal.
    pub device: u32,
    /// Size of the arena.
    pub arena: ArenaSize,
    /// Bytes of device memory to leave free (with [`ArenaSize::FractionOfFree`]).
    pub reserve_bytes: u64,
    /// Sequences live at once.
    pub max_seqs: u32,
    /// Tokens one sequence may hold.
    pub max_seq_len: u32,
    /// Tokens one `write_kv` / `prefill` call may carry (and sequences one decode).
    pub max_step_tokens: u32,
    /// Query heads of the model (a multiple of the KV heads).
    pub q_heads: u32,
}

/// Why a [`DeviceCache`] operation failed. Nothing changed in the cache's tables
/// (a driver error after a launch was queued leaves the device in an unknown state:
/// such errors are sticky in CUDA, and the cache should be dropped).
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceCacheError {
    /// No kernels: the build found no `nvcc`, or the driver refused them.
    Kernels(KernelsError),
    /// A driver call failed (no driver, no device, out of memory, ...).
    Driver(DriverError),
    /// The arena or the step buffers cannot be sized.
    Sizing(SizingError),
    /// The core refused the configuration.
    Init(InitError),
    /// Zero sizes, `q_heads` not a multiple of the KV heads, or sizes that overflow.
    BadConfig,
    /// A sequence operation failed (stale or foreign handle, out of blocks, ...).
    Seq(SeqError),
    /// The launch planner refused the call (shapes, layer, heads, dtype, ...).
    Launch(LaunchError),
    /// Staging or uploading the step metadata failed.
    Step(StepError),
    /// A swap between the device and the host tier failed.
    Swap(SwapError),
    /// A swap was asked of a cache built without a host tier.
    NoHostTier,
    /// K/V written outside the sequence's pending range `[pending, len)`.
    NotWritable {
        /// First position written.
        first: u32,
        /// Tokens written.
        tokens: u32,
        /// Start of the pending range.
        pending: u32,
        /// Length of the sequence.
        len: u32,
    },
    /// The cache's host bookkeeping buffers could not be allocated.
    HostAlloc {
        /// Bytes requested (saturated).
        bytes: usize,
    },
    /// More tokens, sequences or elements in one call than the cache was sized for.
    TooLarge {
        /// What (`"tokens"`, `"sequences"`, `"q_heads"`).
        what: &'static str,
        /// How many were passed.
        got: usize,
        /// The most allowed.
        max: usize,
    },
}

impl core::fmt::Display for DeviceCacheError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Kernels(e) => e.fmt(f),
            Self::Driver(e) => e.fmt(f),
            Self::Sizing(e) => e.fmt(f),
            Self::Init(e) => write!(f, "configuration: {e}"),
            Self::BadConfig => f.write_str("device cache configuration sizes do not fit"),
            Self::Seq(e) => e.fmt(f),
            Self::Launch(e) => e.fmt(f),
            Self::Step(e) => e.fmt(f),
            Self::Swap(e) => e.fmt(f),
            Self::NoHostTier => f.write_str("the device cache has no host tier"),
            Self::NotWritable {
                first,
                tokens,
                pending,
                len,
            } => write!(
                f,
                "positions {first}..{} are outside the writable range {pending}..{len}",
                u64::from(*first) + u64::from(*tokens)
            ),
            Self::HostAlloc { bytes } => {
                write!(f, "could not allocate {bytes} bytes of cache bookkeeping")
            }
            Self::TooLarge { what, got, max } => {
                write!(f, "{got} {what} in one call, at most {max}")
            }
        }
    }
}

impl std::error::Error for DeviceCacheError {}

macro_rules! from_errors {
    ($($ty:ty => $variant:ident),* $(,)?) => {
        $(impl From<$ty> for DeviceCacheError {
            fn from(e: $ty) -> Self {
                Self::$variant(e)
            }
        })*
    };
}

from_errors! {
    KernelsError => Kernels,
    DriverError => Driver,
    SizingError => Sizing,
    InitError => Init,
    SeqError => Seq,
    LaunchError => Launch,
    StepError => Step,
    SwapError => Swap,
}

/// The device-side buffers of one call's inputs and outputs, at the step maximum.
struct IoBuffers {
    /// New keys, then new values: `2 × step_tokens × kv_heads × head_dim` f32.
    kv: DeviceMemory,
    /// Queries: `step_tokens × q_heads × head_dim` f32.
    q: DeviceMemory,
    /// Attention output, as the queries.
    out: DeviceMemory,
    /// Partition scratch of a decode of `max_seqs` sequences at full length.
    scratch: DeviceMemory,
    /// Host side of every copy: as large as the largest of `kv` and `2 × q`.
    pinned: PinnedMemory,
}

/// The host tier of a device cache: the core's host pool (over caller storage), the
/// pinned host arena with its copy stream, and the buffer of a swap's moves.
struct HostSide<'a> {
    pool: HostPool<'a>,
    tier: HostTier,
    /// Moves of one swap (`max_blocks_per_seq` entries).
    moves: Vec<BlockCopy>,
}

/// The paged KV cache on a CUDA device. See the module docs.
///
/// Field order is drop order: buffers and kernels go before the context they hold.
pub struct DeviceCache<'a> {
    manager: BlockManager<'a>,
    geometry: Geometry,
    num_blocks: u32,
    q_heads: u32,
    step_tokens: u32,
    steps: StepBuffers,
    io: IoBuffers,
    host: Option<HostSide<'a>>,
    arena: DeviceMemory,
    kernels: Kernels,
    stream: Stream,
    ctx: Arc<Context>,
    /// Per block-table row: start of the range K/V may be written to.
    pending: Vec<u32>,
    /// Slot output of the core's appends (`max_seq_len` entries).
    slots: Vec<u32>,
    /// Sequence descriptors of one attention call (`max_seqs` entries).
    descs: Vec<KvpSeqDesc>,
    /// Block-table rows of one attention call (`max_seqs` entries).
    rows: Vec<RowUse>,
    /// Scratch floats `io.scratch` holds.
    scratch_floats: u64,
}

impl core::fmt::Debug for DeviceCache<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceCache")
            .field("device", self.ctx.info())
            .field("num_blocks", &self.num_blocks)
            .field("stats", &self.stats())
            .finish()
    }
}

/// `n` copies of `value`, or [`DeviceCacheError::HostAlloc`] when the allocator refuses
/// (instead of aborting). O(n).
fn filled<T: Clone>(n: usize, value: T) -> Result<Vec<T>, DeviceCacheError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| DeviceCacheError::HostAlloc {
            bytes: n.saturating_mul(core::mem::size_of::<T>()),
        })?;
    v.resize(n, value);
    Ok(v)
}

/// `a × b × c × 4` bytes as a `usize`, or `BadConfig`.
fn f32_bytes(a: u64, b: u64, c: u64) -> Result<usize, DeviceCacheError> {
    a.checked_mul(b)
        .and_then(|x| x.checked_mul(c))
        .and_then(|x| x.checked_mul(4))
        .and_then(|x| usize::try_from(x).ok())
        .ok_or(DeviceCacheError::BadConfig)
}

impl<'a> DeviceCache<'a> {
    /// The core configuration of `config` for an arena of `num_blocks` blocks. O(1).
    fn core_config(config: &DeviceCacheConfig, num_blocks: u32, instance: u32) -> Config {
        Config::for_geometry(
            &config.geometry,
            num_blocks,
            config.max_seqs,
            config.max_seq_len,
        )
        .with_instance(instance)
    }

    /// `u64` words of manager storage [`DeviceCache::new`] needs when the arena has at
    /// most `max_blocks` blocks (use `u32::MAX >> 2` or the device's memory divided by
    /// the block size for a fraction; the exact count is known only after the arena is
    /// reserved, and more storage than needed is fine). O(1).
    pub fn storage_words(config: &DeviceCacheConfig, max_blocks: u32) -> usize {
        Self::core_config(config, max_blocks.max(1), 1).storage_words()
    }

    /// Checks the configuration, loads the kernels, allocates the step buffers, then
    /// reserves the arena and builds the manager over `storage`. O(buffer bytes).
    ///
    /// # Errors
    /// [`DeviceCacheError::Kernels`] first when the crate was built without `nvcc`
    /// ("the CUDA kernels were not built (no nvcc found: set NVCC or CUDA_PATH)"),
    /// before any driver call; [`DeviceCacheError::BadConfig`],
    /// [`DeviceCacheError::Launch`] for an unsupported dtype or head dim,
    /// [`DeviceCacheError::Driver`] (no driver, no such device, out of memory),
    /// [`DeviceCacheError::Sizing`], [`DeviceCacheError::Init`] (e.g. storage too
    /// small for the arena's block count), [`DeviceCacheError::HostAlloc`].
    pub fn new(
        config: DeviceCacheConfig,
        storage: &'a mut [u64],
    ) -> Result<Self, DeviceCacheError> {
        crate::fatbin::image().map_err(|e| DeviceCacheError::Kernels(KernelsError::NotBuilt(e)))?;
        let g = config.geometry;
        if config.max_seqs == 0
            || config.max_seq_len == 0
            || config.max_step_tokens == 0
            || config.q_heads == 0
            || !config.q_heads.is_multiple_of(g.kv_heads())
        {
            return Err(DeviceCacheError::BadConfig);
        }
        let group = config.q_heads / g.kv_heads();
        crate::launch::Kernel::attention(g.dtype(), g.head_dim(), group)?;
        let row_blocks = config.max_seq_len.div_ceil(g.block_size());
        let limits = StepLimits {
            rows: config.max_seqs,
            row_blocks,
            batch_seqs: config.max_seqs,
            step_tokens: config.max_step_tokens.max(config.max_seqs),
            copy_pairs: row_blocks.max(config.max_seqs),
        };
        let (hd, kvh, qh) = (
            u64::from(g.head_dim()),
            u64::from(g.kv_heads()),
            u64::from(config.q_heads),
        );
        let tokens = u64::from(limits.step_tokens);
        let kv_bytes = f32_bytes(2 * tokens, kvh, hd)?;
        let q_bytes = f32_bytes(tokens, qh, hd)?;
        // A decode of every sequence at full length, in the smallest partitions.
        let parts = u64::from(config.max_seq_len.div_ceil(MIN_PARTITION_TOKENS));
        let scratch_floats = u64::from(config.max_seqs)
            .checked_mul(qh * parts)
            .and_then(|x| x.checked_mul(hd + 2))
            .ok_or(DeviceCacheError::BadConfig)?;
        let scratch_bytes = f32_bytes(scratch_floats, 1, 1)?;

        let ctx = Context::new(config.device)?;
        let kernels = Kernels::load(&ctx)?;
        let stream = Stream::new(&ctx)?;
        let steps = StepBuffers::new(&ctx, limits)?;
        let io = IoBuffers {
            kv: DeviceMemory::new(&ctx, kv_bytes)?,
            q: DeviceMemory::new(&ctx, q_bytes)?,
            out: DeviceMemory::new(&ctx, q_bytes)?,
            scratch: DeviceMemory::new(&ctx, scratch_bytes)?,
            pinned: PinnedMemory::new(&ctx, kv_bytes.max(2 * q_bytes))?,
        };
        let (free, _) = ctx.mem_info()?;
        let num_blocks = arena_blocks(&g, config.arena, free, config.reserve_bytes)?;
        let arena_bytes = usize::try_from(u64::from(num_blocks) * g.bytes_per_block())
            .map_err(|_| DeviceCacheError::BadConfig)?;
        let arena = DeviceMemory::new(&ctx, arena_bytes)?;
        // Zeroed, as the CPU arena: a block never written reads as zeros, never as a
        // previous process's data.
        stream.as_ref().fill(&arena, 0)?;
        stream.as_ref().synchronize()?;
        let instance = NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed);
        let core = Self::core_config(&config, num_blocks, instance);
        core.validate()?;
        let manager = BlockManager::new(core, storage)?;
        let max_seqs = config.max_seqs as usize;
        Ok(Self {
            manager,
            geometry: g,
            num_blocks,
            q_heads: config.q_heads,
            step_tokens: limits.step_tokens,
            steps,
            io,
            host: None,
            arena,
            kernels,
            stream,
            ctx,
            pending: filled(max_seqs, 0)?,
            slots: filled(core.max_tokens_per_seq() as usize, 0)?,
            descs: filled(max_seqs, KvpSeqDesc::default())?,
            rows: filled(max_seqs, RowUse { row: 0, blocks: 0 })?,
            scratch_floats,
        })
    }

    /// [`DeviceCache::new`] plus a host tier of `host_blocks` blocks: a pinned host
    /// arena (allocated and locked now) and the core's host pool over `host_storage`
    /// (`HostPool::storage_words(host_blocks)` words), for
    /// [`DeviceCache::swap_out`] / [`DeviceCache::swap_in`]. O(buffers + host arena).
    ///
    /// # Errors
    /// As [`DeviceCache::new`]; [`DeviceCacheError::Init`] for zero host blocks or too
    /// little storage; [`DeviceCacheError::Swap`] / [`DeviceCacheError::Driver`] when
    /// the pinned arena cannot be allocated.
    pub fn with_host_tier(
        config: DeviceCacheConfig,
        storage: &'a mut [u64],
        host_blocks: u32,
        host_storage: &'a mut [u32],
    ) -> Result<Self, DeviceCacheError> {
        let mut cache = Self::new(config, storage)?;
        let instance = cache.manager.config().instance;
        let pool = HostPool::new(host_blocks, instance, host_storage)?;
        let tier = HostTier::new(&cache.ctx, host_blocks, cache.geometry.bytes_per_block())?;
        let moves = filled(
            cache.manager.config().max_blocks_per_seq as usize,
            BlockCopy { src: 0, dst: 0 },
        )?;
        cache.host = Some(HostSide { pool, tier, moves });
        Ok(cache)
    }

    /// Swaps `seq` out: its blocks move to the host tier (queued on the copy stream,
    /// after every launch of the cache so far) and their device blocks are free for
    /// the next launches, which wait for the copies. Returns the blocks moved; returns
    /// once queued. O(blocks of `seq`).
    ///
    /// # Errors
    /// [`DeviceCacheError::NoHostTier`]; the core's ([`SeqError::HostFull`], handle
    /// errors; nothing changes); driver errors.
    pub fn swap_out(&mut self, seq: SeqId) -> Result<u32, DeviceCacheError> {
        let host = self.host.as_mut().ok_or(DeviceCacheError::NoHostTier)?;
        let n = self
            .manager
            .swap_out(seq, &mut host.pool, &mut host.moves)?;
        self.pending[seq.index() as usize] = 0;
        self.run_swap(Direction::Out, n)?;
        Ok(n)
    }

    /// Swaps `seq` back in: fresh device blocks, filled from the host tier before any
    /// later launch of the cache reads them. Its K/V counts as written. Returns the
    /// blocks moved; returns once queued. O(blocks of `seq`).
    ///
    /// # Errors
    /// [`DeviceCacheError::NoHostTier`]; the core's ([`SeqError::OutOfBlocks`], not
    /// swapped, handle errors; nothing changes); driver errors.
    pub fn swap_in(&mut self, seq: SeqId) -> Result<u32, DeviceCacheError> {
        let host = self.host.as_mut().ok_or(DeviceCacheError::NoHostTier)?;
        let n = self.manager.swap_in(seq, &mut host.pool, &mut host.moves)?;
        self.pending[seq.index() as usize] = self.manager.len(seq)?;
        self.run_swap(Direction::In, n)?;
        Ok(n)
    }

    /// Releases a swapped-out sequence (its host blocks return to the host pool).
    /// O(blocks of `seq`).
    ///
    /// # Errors
    /// [`DeviceCacheError::NoHostTier`]; the core's (not swapped, handle errors).
    pub fn release_swapped(&mut self, seq: SeqId) -> Result<(), DeviceCacheError> {
        let host = self.host.as_mut().ok_or(DeviceCacheError::NoHostTier)?;
        Ok(self.manager.release_swapped(seq, &mut host.pool)?)
    }

    /// Queues the first `n` moves of the host side in `direction`, after the last
    /// launch of the cache, and orders the next launches after them.
    fn run_swap(&mut self, direction: Direction, n: u32) -> Result<(), DeviceCacheError> {
        let Some(host) = self.host.as_mut() else {
            return Err(DeviceCacheError::NoHostTier);
        };
        let stream = self.stream.as_ref();
        self.steps.after_last_step(stream)?;
        let moves = &host.moves[..n as usize];
        host.tier.swap(direction, &self.arena, stream, moves)?;
        // `stream` now waits for the copies: the next launch (any stream) waits for it.
        self.steps.end(stream)?;
        Ok(())
    }

    /// The core's manager, read-only: block table, lengths, reference counts. O(1).
    pub fn block_manager(&self) -> &BlockManager<'a> {
        &self.manager
    }

    /// The geometry. O(1).
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Blocks in the arena. O(1).
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// The device context (device name, SM count). O(1).
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The arena's device memory (e.g. to read blocks back in tests). O(1).
    pub fn arena(&self) -> &DeviceMemory {
        &self.arena
    }

    /// The stream the cache queues its work on. O(1).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Counters of the pool and the sequences. O(1).
    pub fn stats(&self) -> Stats {
        self.manager.stats()
    }

    /// Tokens held by `seq`. O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`].
    pub fn len(&self, seq: SeqId) -> Result<u32, DeviceCacheError> {
        Ok(self.manager.len(seq)?)
    }

    /// Creates an empty sequence sharing prefix blocks only within `namespace`. O(1).
    ///
    /// # Errors
    /// [`SeqError::NoFreeSequence`].
    pub fn create(&mut self, namespace: u64) -> Result<SeqId, DeviceCacheError> {
        let id = self.manager.create(namespace)?;
        self.pending[id.index() as usize] = 0;
        Ok(id)
    }

    /// Creates a sequence holding `prompt`, reusing the longest verified run of cached
    /// whole blocks of `namespace`; returns it and the number of reused leading tokens
    /// (write K/V for positions `reused..` only). O(prompt).
    ///
    /// # Errors
    /// The core's ([`SeqError::NoFreeSequence`], [`SeqError::TooLong`],
    /// [`SeqError::OutOfBlocks`]); nothing changes on error. A driver error of the
    /// copy-on-write (none is reported for a new sequence).
    pub fn create_with_prompt(
        &mut self,
        namespace: u64,
        prompt: &[u32],
    ) -> Result<(SeqId, u32), DeviceCacheError> {
        let PromptStart {
            seq,
            reused_tokens,
            appended,
        } = self.manager.create_with_prompt_at(
            namespace,
            Priority::Normal,
            prompt,
            &mut self.slots,
        )?;
        self.pending[seq.index() as usize] = reused_tokens;
        if let Some(c) = appended.copy {
            self.copy_blocks(&[c])?;
        }
        Ok((seq, reused_tokens))
    }

    /// Appends `n` tokens whose ids are unknown, executing the copy-on-write the core
    /// reports on the device. O(n + one block copy launch).
    ///
    /// # Errors
    /// The core's ([`SeqError::TooLong`], [`SeqError::OutOfBlocks`], handle errors);
    /// the copy's driver errors.
    pub fn append(&mut self, seq: SeqId, n: u32) -> Result<(), DeviceCacheError> {
        let len = self.manager.len(seq)?;
        let done = self.manager.append(seq, n, &mut self.slots)?;
        self.after_append(seq, len, done.copy)
    }

    /// Appends `tokens` (ids known: once committed, full blocks are shared through the
    /// prefix cache); otherwise as [`DeviceCache::append`]. O(tokens + block copy).
    ///
    /// # Errors
    /// As [`DeviceCache::append`].
    pub fn append_tokens(&mut self, seq: SeqId, tokens: &[u32]) -> Result<(), DeviceCacheError> {
        let len = self.manager.len(seq)?;
        let done = self.manager.append_tokens(seq, tokens, &mut self.slots)?;
        self.after_append(seq, len, done.copy)
    }

    fn after_append(
        &mut self,
        seq: SeqId,
        len: u32,
        copy: Option<BlockCopy>,
    ) -> Result<(), DeviceCacheError> {
        let p = &mut self.pending[seq.index() as usize];
        *p = (*p).min(len);
        if let Some(c) = copy {
            self.copy_blocks(&[c])?;
        }
        Ok(())
    }

    /// Queues `kvp_copy_blocks` for `copies` on the cache's stream and waits. The core's
    /// copies are always valid, so only a driver error can fail here. O(copies).
    fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<(), DeviceCacheError> {
        let Some(cfg) = plan_copy(&self.geometry, self.num_blocks, copies)? else {
            return Ok(());
        };
        let stream = self.stream.as_ref();
        self.steps.begin()?;
        self.steps.stage_pairs(copies)?;
        self.steps.upload(stream)?;
        let params = KvpCopyParams {
            arena: self.arena.ptr(),
            pairs: self.steps.device_ptr(self.steps.layout().pairs),
            bytes_per_block: self.geometry.bytes_per_block(),
            num_pairs: cfg.grid[0],
            pad0: 0,
        };
        // SAFETY: the planner's config for these params; the pairs were uploaded on the
        // same stream before, and every buffer outlives the launch (we wait below).
        unsafe { self.kernels.launch(stream, &cfg, &params) }?;
        self.steps.end(stream)?;
        stream.synchronize()?;
        Ok(())
    }

    /// Declares the K/V of every token of `seq` written: full blocks with known ids
    /// become shareable through the prefix cache and the pending range closes. Returns
    /// the blocks newly offered. O(block_size) per such block.
    ///
    /// # Errors
    /// Handle errors.
    pub fn commit(&mut self, seq: SeqId) -> Result<u32, DeviceCacheError> {
        let len = self.manager.len(seq)?;
        let n = self.manager.commit(seq, len)?;
        self.pending[seq.index() as usize] = len;
        Ok(n)
    }

    /// Creates a sequence sharing every block of `seq`; closes both pending ranges.
    /// O(blocks of `seq`).
    ///
    /// # Errors
    /// Handle errors, [`SeqError::NoFreeSequence`].
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId, DeviceCacheError> {
        let len = self.manager.len(seq)?;
        let child = self.manager.fork(seq)?;
        self.pending[seq.index() as usize] = len;
        self.pending[child.index() as usize] = len;
        Ok(child)
    }

    /// Shortens `seq` to `new_len` tokens. O(released blocks).
    ///
    /// # Errors
    /// Handle errors, [`SeqError::BeyondLength`].
    pub fn truncate(&mut self, seq: SeqId, new_len: u32) -> Result<(), DeviceCacheError> {
        self.manager.truncate(seq, new_len)?;
        let p = &mut self.pending[seq.index() as usize];
        *p = (*p).min(new_len);
        Ok(())
    }

    /// Releases `seq`; its handle becomes stale. O(blocks of `seq`).
    ///
    /// # Errors
    /// Handle errors.
    pub fn release(&mut self, seq: SeqId) -> Result<(), DeviceCacheError> {
        Ok(self.manager.release(seq)?)
    }

    /// Writes the K and V (`[tokens][kv_heads][head_dim]`, f32, host memory) of layer
    /// `layer` for positions `first..first + tokens` of `seq`, which must lie in its
    /// pending range. Synchronous. O(tokens × kv_heads × head_dim).
    ///
    /// # Errors
    /// Nothing is written on error: handle errors, [`DeviceCacheError::NotWritable`],
    /// [`DeviceCacheError::TooLarge`] beyond `max_step_tokens`, the planner's
    /// ([`LaunchError::BufferLength`], [`LaunchError::LayerOutOfRange`]); driver errors.
    pub fn write_kv(
        &mut self,
        seq: SeqId,
        layer: u32,
        first: u32,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), DeviceCacheError> {
        let tokens = self.writable_slots(seq, first, k.len())?;
        plan_write(
            &self.geometry,
            self.num_blocks,
            layer,
            &self.slots[..tokens],
            k.len(),
            v.len(),
        )?;
        let bytes = k.len() * 4;
        let pinned = self.io.pinned.as_mut_slice();
        for (dst, x) in pinned[..bytes].chunks_exact_mut(4).zip(k) {
            dst.copy_from_slice(&x.to_le_bytes());
        }
        for (dst, x) in pinned[bytes..2 * bytes].chunks_exact_mut(4).zip(v) {
            dst.copy_from_slice(&x.to_le_bytes());
        }
        let stream = self.stream.as_ref();
        // SAFETY: 2 × bytes fit the pinned and device K/V buffers (tokens <= step_tokens,
        // and the planner checked k and v against tokens); both live until the
        // synchronize below, which also keeps the pinned buffer unwritten until then.
        unsafe { stream.copy_to_device(self.io.kv.ptr(), &self.io.pinned, 0, 2 * bytes) }?;
        let (kd, vd) = (self.io.kv.ptr(), self.io.kv.ptr() + bytes as u64);
        let (geo, num_blocks) = (self.geometry, self.num_blocks);
        Self::launch_write(
            &mut self.steps,
            &self.kernels,
            stream,
            (&geo, num_blocks, self.arena.ptr()),
            &self.slots[..tokens],
            layer,
            [kd, vd],
            [k.len(), v.len()],
        )?;
        stream.synchronize()?;
        Ok(())
    }

    /// [`DeviceCache::write_kv`] from device memory, queued on the caller's `stream`:
    /// `k` and `v` are f32 `[tokens][kv_heads][head_dim]`. Returns once queued.
    /// O(tokens) host work.
    ///
    /// # Errors
    /// As [`DeviceCache::write_kv`]; nothing is queued on error.
    ///
    /// # Safety
    /// `stream` belongs to this cache's context; `k` and `v` are device memory of that
    /// context, written before on `stream` (or complete),
    /// and neither freed nor written until the work queued on `stream` completes.
    pub unsafe fn write_kv_on(
        &mut self,
        stream: StreamRef<'_>,
        seq: SeqId,
        layer: u32,
        first: u32,
        k: DeviceSlice,
        v: DeviceSlice,
    ) -> Result<(), DeviceCacheError> {
        let tokens = self.writable_slots(seq, first, k.len)?;
        let (geo, num_blocks) = (self.geometry, self.num_blocks);
        Self::launch_write(
            &mut self.steps,
            &self.kernels,
            stream,
            (&geo, num_blocks, self.arena.ptr()),
            &self.slots[..tokens],
            layer,
            [k.ptr, v.ptr],
            [k.len, v.len],
        )
    }

    /// Checks that the tokens of `elems` K elements starting at position `first` lie
    /// in the pending range of `seq` and the step limit, and stores their slots in
    /// `self.slots[..tokens]`; returns `tokens`. O(tokens).
    fn writable_slots(
        &mut self,
        seq: SeqId,
        first: u32,
        elems: usize,
    ) -> Result<usize, DeviceCacheError> {
        let g = self.geometry;
        let row = g.kv_heads() as usize * g.head_dim() as usize;
        let tokens = elems / row;
        if tokens > self.step_tokens as usize {
            return Err(DeviceCacheError::TooLarge {
                what: "tokens",
                got: tokens,
                max: self.step_tokens as usize,
            });
        }
        let len = self.manager.len(seq)?;
        let blocks = self.manager.blocks(seq)?;
        let pending = self.pending[seq.index() as usize];
        let end = u64::from(first) + tokens as u64;
        if first < pending || end > u64::from(len) {
            return Err(DeviceCacheError::NotWritable {
                first,
                tokens: tokens as u32,
                pending,
                len,
            });
        }
        let bs = g.block_size();
        for (i, s) in self.slots[..tokens].iter_mut().enumerate() {
            let pos = first + i as u32;
            *s = blocks[(pos / bs) as usize] * bs + pos % bs;
        }
        Ok(tokens)
    }

    /// Plans `kvp_write_kv`, uploads the slots and queues the launch on `stream`.
    #[allow(clippy::too_many_arguments)]
    fn launch_write(
        steps: &mut StepBuffers,
        kernels: &Kernels,
        stream: StreamRef<'_>,
        (g, num_blocks, arena): (&Geometry, u32, CuDevicePtr),
        slots: &[u32],
        layer: u32,
        [k, v]: [CuDevicePtr; 2],
        [k_len, v_len]: [usize; 2],
    ) -> Result<(), DeviceCacheError> {
        let Some(cfg) = plan_write(g, num_blocks, layer, slots, k_len, v_len)? else {
            return Ok(());
        };
        steps.begin()?;
        steps.stage_slots(slots)?;
        steps.upload(stream)?;
        let params = KvpWriteParams {
            geo: KvpGeometry::new(g, num_blocks),
            arena,
            k,
            v,
            slots: steps.device_ptr(steps.layout().slots),
            tokens: cfg.grid[0],
            layer,
        };
        // SAFETY: the planner checked the shapes, the layer and every slot; the slots
        // were uploaded before on the same stream; the inputs are the callers' (see
        // their contracts); the arena lives as long as the cache, whose drop waits.
        unsafe { kernels.launch(stream, &cfg, &params) }?;
        steps.end(stream)?;
        Ok(())
    }

    /// Decode attention for layer `layer`: one query token per sequence (its last),
    /// `q` and `out` `[seqs][q_heads][head_dim]` f32 in host memory. Synchronous.
    ///
    /// # Errors
    /// As [`DeviceCache::prefill`].
    pub fn decode(
        &mut self,
        layer: u32,
        seqs: &[SeqId],
        q: &[f32],
        out: &mut [f32],
        scale: f32,
    ) -> Result<(), DeviceCacheError> {
        self.check_batch(seqs.len())?;
        for (i, &s) in seqs.iter().enumerate() {
            let len = self.manager.len(s)?;
            self.descs[i] = KvpSeqDesc {
                row: s.index(),
                context_len: len,
                queries: 1,
                q_start: i as u32,
            };
        }
        self.attention(layer, seqs.len(), q, out, scale)
    }

    /// Chunked-prefill attention for layer `layer`: for each `(seq, n)` the last `n`
    /// tokens of `seq` are queries, causal over the whole context; `q` and `out`
    /// `[Σ n][q_heads][head_dim]` f32. Decode is `n = 1`. Synchronous. O(launch +
    /// copies of q and out).
    ///
    /// # Errors
    /// Nothing is written on error: handle errors, [`DeviceCacheError::TooLarge`]
    /// (sequences over `max_seqs`, queries over `max_step_tokens`), the planner's
    /// (`QueriesExceedContext`, `BufferLength`, `LayerOutOfRange`, ...); driver errors.
    pub fn prefill(
        &mut self,
        layer: u32,
        seqs: &[(SeqId, u32)],
        q: &[f32],
        out: &mut [f32],
        scale: f32,
    ) -> Result<(), DeviceCacheError> {
        self.describe(seqs)?;
        self.attention(layer, seqs.len(), q, out, scale)
    }

    fn check_batch(&self, n: usize) -> Result<(), DeviceCacheError> {
        if n > self.descs.len() {
            return Err(DeviceCacheError::TooLarge {
                what: "sequences",
                got: n,
                max: self.descs.len(),
            });
        }
        Ok(())
    }

    /// [`DeviceCache::prefill`] (decode: `n = 1` each) on device buffers, queued on
    /// the caller's `stream`: `q` and `out` are f32 `[Σ n][q_heads][head_dim]`. Returns once queued. O(seqs + blocks of their
    /// contexts) host work.
    ///
    /// # Errors
    /// As [`DeviceCache::prefill`]; nothing is queued on error.
    ///
    /// # Safety
    /// `stream` belongs to this cache's context; `q` and `out` are device memory of
    /// that context (`q` written before on `stream` or complete),
    /// not freed, and `out` neither read nor written by other work, until the work
    /// queued on `stream` completes.
    pub unsafe fn prefill_on(
        &mut self,
        stream: StreamRef<'_>,
        layer: u32,
        seqs: &[(SeqId, u32)],
        q: DeviceSlice,
        out: DeviceSlice,
        scale: f32,
    ) -> Result<(), DeviceCacheError> {
        self.describe(seqs)?;
        if q.len != out.len {
            return Err(LaunchError::BufferLength {
                buffer: crate::launch::Buffer::Output,
                expected: q.len as u64,
                actual: out.len as u64,
            }
            .into());
        }
        // SAFETY: the caller's contract.
        unsafe { self.launch_attention(stream, layer, seqs.len(), [q.ptr, out.ptr], q.len, scale) }
    }

    /// Fills `self.descs[..seqs.len()]`. O(seqs).
    ///
    /// # Errors
    /// Handle errors; [`DeviceCacheError::TooLarge`] for too many sequences or query
    /// tokens.
    fn describe(&mut self, seqs: &[(SeqId, u32)]) -> Result<(), DeviceCacheError> {
        self.check_batch(seqs.len())?;
        let mut start = 0u64;
        for (i, &(s, n)) in seqs.iter().enumerate() {
            let len = self.manager.len(s)?;
            self.descs[i] = KvpSeqDesc {
                row: s.index(),
                context_len: len,
                queries: n,
                q_start: u32::try_from(start).unwrap_or(u32::MAX),
            };
            start += u64::from(n);
        }
        if start > u64::from(self.step_tokens) {
            return Err(DeviceCacheError::TooLarge {
                what: "tokens",
                got: usize::try_from(start).unwrap_or(usize::MAX),
                max: self.step_tokens as usize,
            });
        }
        Ok(())
    }

    /// Runs attention over `self.descs[..n]` from host `q` into host `out`, on the
    /// cache's stream, and waits.
    fn attention(
        &mut self,
        layer: u32,
        n: usize,
        q: &[f32],
        out: &mut [f32],
        scale: f32,
    ) -> Result<(), DeviceCacheError> {
        if q.len() != out.len() {
            return Err(LaunchError::BufferLength {
                buffer: crate::launch::Buffer::Output,
                expected: q.len() as u64,
                actual: out.len() as u64,
            }
            .into());
        }
        // Plan first: a refused call queues nothing and copies nothing.
        self.plan(layer, n, q.len(), scale)?;
        let q_bytes = q.len() * 4;
        let pinned = self.io.pinned.as_mut_slice();
        for (dst, x) in pinned[..q_bytes].chunks_exact_mut(4).zip(q) {
            dst.copy_from_slice(&x.to_le_bytes());
        }
        // A view of the cache's stream that does not borrow `self` (the stream lives
        // as long as `self`, past this call).
        let ctx = Arc::clone(&self.ctx);
        // SAFETY: the cache's own live stream, of its context.
        let stream = unsafe { StreamRef::from_raw(&ctx, self.stream.as_ref().raw()) };
        // SAFETY: the planner checked q against the queries (<= step_tokens), so
        // q_bytes fit both buffers; both live until the synchronize below.
        unsafe { stream.copy_to_device(self.io.q.ptr(), &self.io.pinned, 0, q_bytes) }?;
        let bufs = [self.io.q.ptr(), self.io.out.ptr()];
        // SAFETY: the cache's own buffers on its own stream, waited for below.
        unsafe { self.launch_attention(stream, layer, n, bufs, q.len(), scale) }?;
        // SAFETY: the output range lies in the pinned buffer (after q); waited below.
        unsafe { stream.copy_to_host(&mut self.io.pinned, q_bytes, self.io.out.ptr(), q_bytes) }?;
        stream.synchronize()?;
        let pinned = self.io.pinned.as_slice();
        for (o, b) in out
            .iter_mut()
            .zip(pinned[q_bytes..2 * q_bytes].chunks_exact(4))
        {
            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }

    /// Plans attention over `self.descs[..n]`: automatic partitions, or one partition
    /// per context when the scratch is too small for the automatic plan (many query
    /// rows). O(seqs + blocks of their contexts).
    fn plan(
        &self,
        layer: u32,
        n: usize,
        q_len: usize,
        scale: f32,
    ) -> Result<Option<AttentionPlan>, DeviceCacheError> {
        let g = self.geometry;
        let descs = &self.descs[..n];
        let call = AttentionCall {
            geometry: g,
            num_blocks: self.num_blocks,
            layer,
            q_heads: self.q_heads,
            scale,
            table: self.manager.block_table(),
            stride: self.manager.config().max_blocks_per_seq,
            seqs: descs,
            q_len,
            out_len: q_len,
        };
        let sm_count = self.ctx.info().sm_count.max(1);
        let Some(plan) = plan_attention(&call, Partitioning::Auto { sm_count })? else {
            return Ok(None);
        };
        if plan.scratch_floats <= self.scratch_floats {
            return Ok(Some(plan));
        }
        let max_ctx = descs.iter().map(|d| d.context_len).max().unwrap_or(1);
        let whole = max_ctx.div_ceil(g.block_size()).max(1) * g.block_size();
        Ok(plan_attention(&call, Partitioning::Tokens(whole))?)
    }

    /// Plans attention over `self.descs[..n]`, uploads the descriptors and the changed
    /// block-table entries, and queues the launches on `stream`.
    ///
    /// # Safety
    /// As [`DeviceCache::prefill_on`] for `q` and `out` (`q_len` f32 each).
    unsafe fn launch_attention(
        &mut self,
        stream: StreamRef<'_>,
        layer: u32,
        n: usize,
        [q, out]: [CuDevicePtr; 2],
        q_len: usize,
        scale: f32,
    ) -> Result<(), DeviceCacheError> {
        let Some(plan) = self.plan(layer, n, q_len, scale)? else {
            return Ok(());
        };
        let bs = self.geometry.block_size();
        for (r, d) in self.rows.iter_mut().zip(&self.descs[..n]) {
            *r = RowUse {
                row: d.row,
                blocks: d.context_len.div_ceil(bs),
            };
        }
        let stride = self.manager.config().max_blocks_per_seq as usize;
        self.steps.begin()?;
        self.steps.stage_seqs(&self.descs[..n])?;
        self.steps
            .stage_block_table(self.manager.block_table(), stride, &self.rows[..n])?;
        self.steps.upload(stream)?;
        let layout = *self.steps.layout();
        let params = plan.params(AttentionBuffers {
            arena: self.arena.ptr(),
            q,
            out,
            block_table: self.steps.device_ptr(layout.block_table),
            seqs: self.steps.device_ptr(layout.seqs),
            scratch: self.io.scratch.ptr(),
        });
        // SAFETY: the planner validated the call against the table and descriptors
        // just uploaded on this stream; the scratch holds `plan.scratch_floats`
        // (`plan` checks); q and out are the caller's contract; the next launch of
        // the cache waits for `end` before reusing the metadata and the scratch.
        unsafe {
            self.kernels.launch(stream, &plan.attention, &params)?;
            if let Some(reduce) = &plan.reduce {
                self.kernels.launch(stream, reduce, &params)?;
            }
        }
        self.steps.end(stream)?;
        Ok(())
    }
}

impl Drop for DeviceCache<'_> {
    fn drop(&mut self) {
        // Queued work may still use the buffers freed next.
        let _ = self.stream.as_ref().synchronize();
    }
}
