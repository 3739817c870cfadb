//! [`KvCache`]: the owned paged KV cache — the core's block manager, its storage, the
//! arena and the kernels behind one type.
//!
//! Everything is allocated once in [`KvCache::new`]: the manager's tables, the arena,
//! four small buffers (a slot buffer of `max_seq_len` entries, a batch buffer of
//! `max_seqs` entries, and an edit's copy and row-move buffers of about two entries per
//! block a sequence can hold), and the kernels' [`WorkerPool`] threads. Each but the
//! threads is fallible: a size the allocator refuses is a typed error
//! ([`CacheError::TablesAlloc`], [`CacheError::Alloc`]), never an abort; a worker thread
//! the OS refuses means fewer workers (the pool's own bookkeeping is a few hundred
//! bytes). No later operation allocates or starts a thread.
//!
//! What the type enforces, beyond the core's own checks:
//! - A [`Seq`] from another cache is refused: each cache gets its own instance tag from a
//!   process-wide counter, and the core refuses handles with another tag
//!   ([`SeqError::ForeignHandle`]). A released handle is stale ([`SeqError::StaleHandle`]).
//! - Copy-on-write is executed inside the append that reports it, and an edit's copies
//!   and row moves inside the edit ([`KvCache::remove_range`] and the others); the caller
//!   cannot forget them.
//! - K/V can only be written at positions appended since the sequence last became
//!   shareable (the pending range `[pending, len)`): never into a block another sequence
//!   reads. A fork closes the pending range of both sequences, and so does
//!   [`KvCache::commit`], which is also what lets other prompts share the blocks through
//!   the prefix cache: a block is never shared before its K/V is written.

mod edit;
mod events;
mod retain;

pub use events::{CacheEvent, Drained, EventBatch, StoredEvent};
pub use retain::CACHE_NAMESPACES;

use core::sync::atomic::{AtomicU32, Ordering};

use kvpage_core::{
    BlockCopy, BlockManager, Config, EngineError, Geometry, GeometryError, InitError, Priority,
    RowMove, SeqError, SeqId, Stats,
};

use crate::arena::{Arena, ArenaAllocError, KvLayout};
use crate::dtype::Element;
use crate::error::KernelError;
use crate::kernels::{BlockTable, KeyShift, RopeParams, SeqQuery, WorkerPool};
use crate::persist::PersistError;
use crate::quant::KvScales;
use crate::storage::{Backend, DeviceFault, Storage};
use crate::tables::{try_filled, try_with_capacity, EngineParts, Tables};

/// Instance tags handed to caches; 0 is never used.
static NEXT_INSTANCE: AtomicU32 = AtomicU32::new(1);

/// A secret key for the prefix cache's block hash of the cache tagged `instance`: std's
/// randomly seeded SipHash of the tag, so crafted prompts cannot aim at the hash table.
fn random_hash_key(instance: u32) -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(instance)
}

/// How large the arena is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capacity {
    /// This many blocks.
    Blocks(u32),
    /// As many whole blocks as fit in this many bytes.
    Bytes(u64),
}

/// What a [`KvCache`] is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// The model's KV geometry (layers, KV heads, head dim, block size, storage dtype).
    pub geometry: Geometry,
    /// Size of the arena.
    pub capacity: Capacity,
    /// Sequences live at once.
    pub max_seqs: u32,
    /// Tokens one sequence may hold.
    pub max_seq_len: u32,
    /// Threads the attention kernels use (the calling thread included); 0 = one per
    /// available core. [`KvCache::new`] starts `threads - 1` workers once (see
    /// [`WorkerPool::new`]); they are parked between calls and joined on drop.
    ///
    /// A program that runs its own thread pool on the same cores (a model's matrix
    /// products, a game's job system) should not stack a second one on top: set 1 (the
    /// calling thread only), or call [`crate::kernels::paged_attention`] over
    /// [`KvCache::arena`] and the block table with its own pool as the
    /// [`Executor`](crate::kernels::Executor). Two pools contending for two cores made
    /// SmolLM2's decode 4× slower (`examples/smollm` defaults to 1 for that reason).
    pub threads: usize,
    /// Entries of the KV event ring ([`KvCache::drain_events`]), for KV-aware routers;
    /// 0 = no events. Each takes about `40 + 4 × block_size` bytes (see
    /// [`kvpage_core::Config::event_capacity`]).
    pub event_capacity: u32,
    /// Key of the prefix cache's block hash. `None`: a random secret key per cache, so
    /// crafted prompts cannot aim at the hash table. `Some(key)`: that key, so block
    /// hashes (in KV events and persisted caches) are the same on every run and
    /// machine; keep it secret in a multi-tenant service.
    pub hash_key: Option<u64>,
    /// Namespaces that can have a quota ([`KvCache::set_namespace_quota`]): the size of
    /// the core's namespace table ([`kvpage_core::Config::max_namespaces`]).
    /// [`CACHE_NAMESPACES`] (8) is the usual choice and what caches had before this was
    /// configurable; 0 means no quota slots (every quota is refused with
    /// [`kvpage_core::QuotaError::TableFull`], and blocks carry no owner or LRU stamp);
    /// at most [`kvpage_core::MAX_NAMESPACES`] (a larger value is
    /// [`CacheError::Init`]`(`[`InitError::TooLarge`]`)` from [`KvCache::new`], before
    /// the tables or a host arena are allocated). Namespaces without a quota share the rest of the pool
    /// and need no slot. Eviction compares one list head per slot, so it costs
    /// O(max_namespaces + 1) per evicted block; the table costs a few words per slot and,
    /// when not 0, 12 bytes per block.
    pub max_namespaces: u32,
}

/// Handle of a sequence of one [`KvCache`]. `Copy`; stale once released, refused by
/// every other cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Seq(SeqId);

impl Seq {
    /// The core's handle (row, generation, instance tag), e.g. to cross an FFI boundary.
    pub const fn id(&self) -> SeqId {
        self.0
    }

    /// The handle of a core id that crossed an FFI boundary. Every operation checks it
    /// (a forged, stale or foreign id is an error, never another sequence's data).
    pub(crate) const fn from_id(id: SeqId) -> Self {
        Self(id)
    }
}

/// A sequence created from a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptSeq {
    /// The sequence; it holds the whole prompt.
    pub seq: Seq,
    /// Leading prompt tokens whose K/V came from the prefix cache. Write K/V (and run
    /// attention) for positions `reused_tokens..prompt_len` only.
    pub reused_tokens: u32,
}

/// Why a [`KvCache`] operation failed. Nothing changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheError {
    /// The geometry is invalid.
    Geometry(GeometryError),
    /// The core refused the configuration.
    Init(InitError),
    /// Capacity, lengths or counts do not fit (e.g. more than `u32::MAX` blocks, or a
    /// zero `max_seq_len`).
    BadConfig,
    /// The arena could not be allocated.
    Alloc(ArenaAllocError),
    /// The core's tables or the cache's bookkeeping buffers (everything but the arena)
    /// could not be allocated.
    TablesAlloc {
        /// Bytes requested (saturated at `usize::MAX`).
        bytes: usize,
    },
    /// A sequence operation failed (stale or foreign handle, out of blocks, ...).
    Seq(SeqError),
    /// An engine operation failed (see [`crate::Engine`]).
    Engine(EngineError),
    /// A kernel refused its inputs (buffer lengths, layer, heads, ...).
    Kernel(KernelError),
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
    /// More sequences in one attention call than `max_seqs`.
    BatchTooLarge {
        /// Sequences passed.
        seqs: usize,
        /// `max_seqs`.
        max: usize,
    },
    /// A token range that is reversed or reaches past the sequence's length.
    BadRange {
        /// First token index.
        first: u32,
        /// One past the last token index.
        end: u32,
        /// Length of the sequence.
        len: u32,
    },
    /// An operation that changes K/V in place (re-rotating keys) would change a block
    /// that other sequences read (reference count above 1) or that the prefix cache
    /// offers to future prompts (registered).
    BlockShared {
        /// The first such block.
        block: u32,
        /// Its reference count.
        refcount: u32,
        /// Whether it is registered in the prefix cache.
        registered: bool,
    },
    /// Saving or restoring a sequence failed (see [`crate::persist`]).
    Persist(PersistError),
    /// The CUDA backend failed or is not available (see [`DeviceFault`]). A driver
    /// failure of work already queued leaves the device cache unusable (CUDA errors are
    /// sticky): drop it.
    Device(DeviceFault),
}

impl core::fmt::Display for CacheError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Geometry(e) => write!(f, "geometry: {e}"),
            Self::Init(e) => write!(f, "configuration: {e}"),
            Self::BadConfig => f.write_str("configuration sizes are zero or do not fit"),
            Self::Alloc(e) => e.fmt(f),
            Self::TablesAlloc { bytes } => {
                write!(f, "could not allocate {bytes} bytes of cache tables")
            }
            Self::Seq(e) => e.fmt(f),
            Self::Engine(e) => e.fmt(f),
            Self::Kernel(e) => e.fmt(f),
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
            Self::BatchTooLarge { seqs, max } => {
                write!(f, "{seqs} sequences in one call, at most {max}")
            }
            Self::BadRange { first, end, len } => {
                write!(f, "token range {first}..{end} is not within 0..{len}")
            }
            Self::BlockShared {
                block,
                refcount,
                registered,
            } => write!(
                f,
                "block {block} is shared (refcount {refcount}, {}in the prefix cache)",
                if *registered { "" } else { "not " }
            ),
            Self::Persist(e) => e.fmt(f),
            Self::Device(e) => write!(f, "CUDA backend: {e}"),
        }
    }
}

impl std::error::Error for CacheError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Geometry(e) => Some(e),
            Self::Init(e) => Some(e),
            Self::Alloc(e) => Some(e),
            Self::Seq(e) => Some(e),
            Self::Engine(e) => Some(e),
            Self::Kernel(e) => Some(e),
            Self::Persist(e) => Some(e),
            _ => None,
        }
    }
}

impl From<SeqError> for CacheError {
    fn from(e: SeqError) -> Self {
        Self::Seq(e)
    }
}

impl From<EngineError> for CacheError {
    fn from(e: EngineError) -> Self {
        Self::Engine(e)
    }
}

impl From<KernelError> for CacheError {
    fn from(e: KernelError) -> Self {
        Self::Kernel(e)
    }
}

impl From<PersistError> for CacheError {
    fn from(e: PersistError) -> Self {
        Self::Persist(e)
    }
}

// A cache can move to, and be read from, other threads.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<KvCache>();
};

/// The owned paged KV cache. See the module docs for what it enforces.
///
/// # Threads
/// `Send + Sync`. Every operation that changes the cache takes `&mut self`, and so do
/// the kernels: [`KvCache::write_kv`] writes the arena, and [`KvCache::decode`] /
/// [`KvCache::prefill`] fill the cache's batch buffer. So one thread at a time writes
/// K/V or runs the cache's attention, even on different sequences; to run many
/// sequences at once, put them in one `decode` / `prefill` call, which the cache's
/// [`WorkerPool`] spreads over its threads. To share a cache between threads, guard it
/// with a mutex. Through `&KvCache` any number of threads may read at once: the
/// statistics and lengths, and attention by the free kernel
/// [`crate::kernels::paged_attention`] over [`KvCache::layout`], [`KvCache::arena`] and
/// `block_manager().block_table()` (on [`KvCache::workers`] if you like: a call that
/// finds the pool busy runs on its own thread), whose results equal the cache's own
/// calls bit for bit (tested in `tests/concurrent_kernels.rs`).
pub struct KvCache {
    pub(crate) tables: Tables,
    /// The K/V: the CPU arena (and an engine's host tier) or a CUDA device.
    pub(crate) storage: Storage,
    /// The arena's layout; its geometry is the configured one.
    pub(crate) layout: KvLayout,
    /// The attention kernels' workers (none started for a device cache).
    pool: WorkerPool,
    /// Per block-table row: start of the range K/V may be written to.
    pending: Vec<u32>,
    /// Slot output of the core's appends (`max_seq_len` entries).
    slots: Vec<u32>,
    /// Batch of one attention call (`max_seqs` entries).
    pub(crate) batch: Vec<SeqQuery>,
    /// Block copies of one edit (`max_blocks_per_seq` entries).
    edit_copies: Vec<BlockCopy>,
    /// Row moves of one edit ([`Config::max_row_moves`] entries).
    edit_moves: Vec<RowMove>,
    /// Sequence number of the next event [`KvCache::drain_events`] reads.
    event_cursor: u64,
    /// Per layer: the fixed scales of its 8-bit rows ([`KvCache::set_kv_scales`]), or
    /// `None` for a scale per row.
    kv_scales: Vec<Option<KvScales>>,
}

impl core::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("KvCache")
            .field("layout", &self.layout)
            .field("stats", &self.stats())
            .finish()
    }
}

impl KvCache {
    /// Allocates everything: the core's tables, the arena (zeroed, every page touched),
    /// and the small buffers, and starts the kernels' worker threads (a thread the OS
    /// refuses is no error: fewer workers). O(arena bytes + tables + threads).
    ///
    /// # Errors
    /// [`CacheError::BadConfig`] (zero `max_seq_len`, a capacity of zero blocks or more
    /// than `u32::MAX`), [`CacheError::Init`] from the core (e.g. [`InitError::TooLarge`]
    /// for `max_namespaces` over [`kvpage_core::MAX_NAMESPACES`]), [`CacheError::Kernel`] if
    /// the layout is unsupported (head dim over [`crate::kernels::MAX_HEAD_DIM`]),
    /// [`CacheError::TablesAlloc`] if memory for the core's tables or the small buffers
    /// is refused, [`CacheError::Alloc`] if memory for the arena is refused.
    pub fn new(config: CacheConfig) -> Result<Self, CacheError> {
        Self::build(config, None, Backend::Cpu)
    }

    /// [`KvCache::new`] on `backend`: the CPU, or a CUDA device whose arena takes the
    /// configured capacity (or a fraction of its free memory: [`crate::CudaOptions`]).
    /// A device cache has the same API and gives the same results (stored bytes bit for
    /// bit, attention within the kernels' tolerance); an edit's row moves,
    /// [`KvCache::rotate_keys`], saving and restoring read the blocks concerned into
    /// the host and write them back (one block at a time); no kernel threads are
    /// started (`threads` is for the CPU), and [`KvCache::arena`] is empty (its K/V
    /// lives on the device: [`KvCache::read_block`] reads a block). O(arena bytes +
    /// tables).
    ///
    /// # Errors
    /// As [`KvCache::new`]; for CUDA, [`CacheError::Device`]: [`DeviceFault::NotCompiled`]
    /// in a build without the `cuda` feature, [`DeviceFault::NoDriver`] on a machine
    /// without an NVIDIA driver, [`DeviceFault::NoKernels`], [`DeviceFault::Driver`],
    /// [`DeviceFault::Refused`] (an unsupported dtype or head dim, `q_heads` not a
    /// multiple of the KV heads, zero sizes).
    pub fn with_backend(config: CacheConfig, backend: Backend) -> Result<Self, CacheError> {
        Self::build(config, None, backend)
    }

    /// [`KvCache::new`], with the host tier and the request engine of an
    /// [`crate::Engine`] when `engine` is given. O(arena bytes + host arena + tables).
    ///
    /// # Errors
    /// As [`KvCache::with_backend`], plus [`CacheError::Engine`] from the engine's sizes
    /// and [`CacheError::Alloc`] for the host arena.
    pub(crate) fn build(
        config: CacheConfig,
        engine: Option<EngineParts>,
        backend: Backend,
    ) -> Result<Self, CacheError> {
        let g = config.geometry;
        let num_blocks = match config.capacity {
            Capacity::Blocks(n) => u64::from(n),
            Capacity::Bytes(bytes) => g.blocks_in(bytes),
        };
        let num_blocks = u32::try_from(num_blocks).map_err(|_| CacheError::BadConfig)?;
        if num_blocks == 0 || config.max_seq_len == 0 {
            return Err(CacheError::BadConfig);
        }
        if config.max_namespaces > kvpage_core::MAX_NAMESPACES {
            // The core's own check (below), made before a device arena is reserved.
            return Err(CacheError::Init(InitError::TooLarge));
        }
        let host_blocks = engine.map_or(0, |e| e.host_blocks);
        // A device arena is reserved first: its block count sizes the manager.
        let device = match backend {
            Backend::Cpu => None,
            Backend::Cuda(options) => {
                Some(Storage::cuda(&config, num_blocks, host_blocks, options)?)
            }
        };
        let num_blocks = device
            .as_ref()
            .and_then(Storage::device_blocks)
            .unwrap_or(num_blocks);
        let layout = KvLayout::new(g, num_blocks)?;
        let instance = NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed).max(1);
        let core_config = Config {
            max_namespaces: config.max_namespaces,
            event_capacity: config.event_capacity,
            ..Config::for_geometry(&g, num_blocks, config.max_seqs, config.max_seq_len)
        }
        .with_instance(instance)
        .with_hash_key(config.hash_key.unwrap_or_else(|| random_hash_key(instance)));
        core_config.validate().map_err(CacheError::Init)?;
        let tables = Tables::new(core_config, engine)?;
        let storage = match device {
            Some(device) => device,
            None => Storage::cpu(&layout, host_blocks)?,
        };
        let max_seqs = config.max_seqs as usize;
        let max_tokens = core_config.max_tokens_per_seq() as usize;
        let (pending, slots) = (try_filled(max_seqs, 0)?, try_filled(max_tokens, 0)?);
        let batch = try_with_capacity(max_seqs)?;
        let edit_copies = try_filled(
            core_config.max_blocks_per_seq as usize,
            BlockCopy { src: 0, dst: 0 },
        )?;
        let max_moves = usize::try_from(core_config.max_row_moves()).unwrap_or(usize::MAX);
        let edit_moves = try_filled(max_moves, RowMove::default())?;
        let kv_scales = try_filled(g.layers() as usize, None)?;
        // Last: no thread is started for a construction that fails; a device cache
        // runs no CPU kernel.
        let threads = match storage {
            Storage::Cpu { .. } => config.threads,
            #[cfg(feature = "cuda")]
            Storage::Cuda { .. } => 1,
        };
        let pool = WorkerPool::new(threads);
        Ok(Self {
            tables,
            storage,
            layout,
            pool,
            pending,
            slots,
            batch,
            edit_copies,
            edit_moves,
            event_cursor: 0,
            kv_scales,
        })
    }

    fn with_manager<R>(tables: &mut Tables, f: impl FnOnce(&mut BlockManager<'static>) -> R) -> R {
        f(&mut tables.parts_mut().manager)
    }

    fn manager(&self) -> &BlockManager<'_> {
        self.tables.manager()
    }

    /// The core's manager, read-only: block table, lengths, reference counts. O(1).
    pub fn block_manager(&self) -> &BlockManager<'_> {
        self.manager()
    }

    /// The model geometry. O(1).
    pub fn geometry(&self) -> &Geometry {
        self.layout.geometry()
    }

    /// The arena's element layout. O(1).
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The attention kernels' worker threads, e.g. to run
    /// [`crate::kernels::contiguous_attention`] or the caller's own
    /// [`WorkerPool::for_each_task`] on them. O(1).
    pub fn workers(&self) -> &WorkerPool {
        &self.pool
    }

    /// The arena, read-only (e.g. to swap or upload blocks). O(1).
    ///
    /// For a cache on a CUDA device ([`KvCache::with_backend`]) this is an empty arena:
    /// its K/V lives in device memory.
    pub fn arena(&self) -> &Arena {
        self.storage.arena()
    }

    /// Copies the K/V bytes of arena block `block` (the block-major layout of
    /// [`KvCache::layout`], as [`KvCache::arena`] holds it on the CPU) into `out`,
    /// which must be exactly one block long: on either backend (a device cache reads
    /// it back after every launch so far). O(bytes per block).
    ///
    /// # Errors
    /// [`KernelError::BlockOutOfRange`], [`KernelError::BufferLength`] (nothing
    /// written); [`CacheError::Device`] for a driver error.
    pub fn read_block(&self, block: u32, out: &mut [u8]) -> Result<(), CacheError> {
        self.storage.read_block(&self.layout, block, out)
    }

    /// The backend the cache runs on: `"cpu"` or `"cuda"`. O(1).
    pub fn backend(&self) -> &'static str {
        self.storage.backend()
    }

    /// Counters of the pool and the sequences. O(1).
    pub fn stats(&self) -> Stats {
        self.manager().stats()
    }

    /// Tokens held by `seq`. O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`].
    pub fn len(&self, seq: Seq) -> Result<u32, CacheError> {
        Ok(self.manager().len(seq.0)?)
    }

    /// Creates an empty sequence sharing prefix blocks only within `namespace`. O(1).
    ///
    /// # Errors
    /// [`SeqError::NoFreeSequence`].
    pub fn create(&mut self, namespace: u64) -> Result<Seq, CacheError> {
        let id = Self::with_manager(&mut self.tables, |m| m.create(namespace))?;
        self.pending[id.index() as usize] = 0;
        Ok(Seq(id))
    }

    /// Creates a sequence holding `prompt`, reusing the longest verified run of cached
    /// whole blocks of `namespace`; the caller then writes K/V for positions
    /// `reused_tokens..` only. O(prompt).
    ///
    /// # Errors
    /// The core's ([`SeqError::NoFreeSequence`], [`SeqError::TooLong`],
    /// [`SeqError::OutOfBlocks`]). Nothing changes on error.
    pub fn create_with_prompt(
        &mut self,
        namespace: u64,
        prompt: &[u32],
    ) -> Result<PromptSeq, CacheError> {
        self.create_with_prompt_as(namespace, Priority::Normal, prompt)
    }

    /// [`KvCache::create_with_prompt`] at `priority`.
    fn create_with_prompt_as(
        &mut self,
        namespace: u64,
        priority: Priority,
        prompt: &[u32],
    ) -> Result<PromptSeq, CacheError> {
        let slots = &mut self.slots;
        let start = Self::with_manager(&mut self.tables, |m| {
            m.create_with_prompt_at(namespace, priority, prompt, slots)
        })?;
        // A new sequence's last block is never shared (the core computes >= 1 token).
        self.execute_copy(start.appended.copy)?;
        self.pending[start.seq.index() as usize] = start.reused_tokens;
        Ok(PromptSeq {
            seq: Seq(start.seq),
            reused_tokens: start.reused_tokens,
        })
    }

    /// Appends `tokens` (ids known: once committed, full blocks are shared through the
    /// prefix cache), executing the copy-on-write the core reports. Their K/V must then
    /// be written with [`KvCache::write_kv`] in every layer, then
    /// [`KvCache::commit`]ted. O(tokens + block copy).
    ///
    /// # Errors
    /// The core's ([`SeqError::StaleHandle`], [`SeqError::ForeignHandle`],
    /// [`SeqError::TooLong`], [`SeqError::OutOfBlocks`]). Nothing changes on error.
    pub fn append_tokens(&mut self, seq: Seq, tokens: &[u32]) -> Result<(), CacheError> {
        self.append_with(seq, |m, slots| m.append_tokens(seq.0, tokens, slots))
    }

    /// Appends `n` tokens whose ids are unknown (not registered in the prefix cache);
    /// otherwise as [`KvCache::append_tokens`]. O(n + block copy).
    ///
    /// # Errors
    /// As [`KvCache::append_tokens`].
    pub fn append(&mut self, seq: Seq, n: u32) -> Result<(), CacheError> {
        self.append_with(seq, |m, slots| m.append(seq.0, n, slots))
    }

    /// Runs one core append on `seq`, executes the copy-on-write it reports and opens the
    /// pending range at the old length.
    fn append_with(
        &mut self,
        seq: Seq,
        append: impl FnOnce(
            &mut BlockManager<'static>,
            &mut [u32],
        ) -> Result<kvpage_core::Appended, SeqError>,
    ) -> Result<(), CacheError> {
        let slots = &mut self.slots;
        let (len, done) = Self::with_manager(&mut self.tables, |m| {
            let len = m.len(seq.0)?;
            append(m, slots).map(|a| (len, a))
        })?;
        self.execute_copy(done.copy)?;
        let p = &mut self.pending[seq.0.index() as usize];
        *p = (*p).min(len);
        Ok(())
    }

    /// Performs a copy-on-write the core reported. The core's block ids are always in
    /// range and distinct, so this cannot fail on the CPU; on a device only a driver
    /// error can ([`CacheError::Device`]: the device cache is then unusable).
    fn execute_copy(&mut self, copy: Option<kvpage_core::BlockCopy>) -> Result<(), CacheError> {
        let Some(c) = copy else {
            return Ok(());
        };
        let done = self.storage.copy_blocks(&self.layout, &[c]);
        debug_assert!(
            !matches!(done, Err(CacheError::Kernel(_))),
            "core reported an invalid copy: {done:?}"
        );
        done
    }

    /// Declares the K/V of every token of `seq` written in every layer: its full blocks
    /// (with known ids) become shareable through the prefix cache of its namespace, and
    /// its pending range closes, since other sequences may now read those positions.
    /// Call it once a step, after the last layer's [`KvCache::write_kv`]. Returns the
    /// blocks newly offered to the cache. O(block_size) per such block.
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`].
    pub fn commit(&mut self, seq: Seq) -> Result<u32, CacheError> {
        let (len, blocks) = Self::with_manager(&mut self.tables, |m| {
            let len = m.len(seq.0)?;
            m.commit(seq.0, len).map(|n| (len, n))
        })?;
        self.pending[seq.0.index() as usize] = len;
        Ok(blocks)
    }

    /// Creates a sequence sharing every block of `seq` (nothing is copied now; the first
    /// append into a shared partial block copies it). Closes the pending range of both.
    /// O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::NoFreeSequence`].
    pub fn fork(&mut self, seq: Seq) -> Result<Seq, CacheError> {
        let (child, len) = Self::with_manager(&mut self.tables, |m| {
            m.fork(seq.0).map(|c| (c, m.len(seq.0)))
        })?;
        let len = len?;
        self.pending[seq.0.index() as usize] = len;
        self.pending[child.index() as usize] = len;
        Ok(Seq(child))
    }

    /// Closes the pending range of `seq` (its K/V is written, as after a commit, without
    /// offering blocks to the prefix cache): a restored sequence. O(1).
    pub(crate) fn mark_written(&mut self, seq: Seq) {
        if let Ok(len) = self.manager().len(seq.0) {
            self.pending[seq.0.index() as usize] = len;
        }
    }

    /// Shortens `seq` to `new_len` tokens. O(released blocks).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::BeyondLength`].
    pub fn truncate(&mut self, seq: Seq, new_len: u32) -> Result<(), CacheError> {
        Self::with_manager(&mut self.tables, |m| m.truncate(seq.0, new_len))?;
        let p = &mut self.pending[seq.0.index() as usize];
        *p = (*p).min(new_len);
        Ok(())
    }

    /// Releases `seq`; its handle becomes stale. O(blocks of `seq`).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`].
    pub fn release(&mut self, seq: Seq) -> Result<(), CacheError> {
        Ok(Self::with_manager(&mut self.tables, |m| m.release(seq.0))?)
    }

    /// Evicts up to `max_blocks` cached (unreferenced, registered) blocks; returns how
    /// many. O(evicted).
    pub fn evict_cached(&mut self, max_blocks: u32) -> u32 {
        Self::with_manager(&mut self.tables, |m| m.evict_cached(max_blocks))
    }

    /// Writes the K and V (`[tokens][kv_heads][head_dim]`, f32) of layer `layer` for
    /// positions `first..first + tokens` of `seq`, which must lie in its pending range
    /// (appended since it last became shareable); 8-bit rows at the layer's fixed scales
    /// where [`KvCache::set_kv_scales`] set them. O(tokens × kv_heads × head_dim).
    ///
    /// # Errors
    /// Nothing is written on error. Handle errors ([`SeqError`]),
    /// [`CacheError::NotWritable`], and [`KernelError::BufferLength`] /
    /// [`KernelError::LayerOutOfRange`].
    pub fn write_kv(
        &mut self,
        seq: Seq,
        layer: u32,
        first: u32,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), CacheError> {
        let tokens = self.writable_slots(seq, first, k.len())?;
        let (layout, slots) = (&self.layout, &self.slots[..tokens]);
        let scales = self.kv_scales_of(layer);
        self.storage.write_kv(layout, layer, slots, k, v, scales)
    }

    /// Fixes the scales of layer `layer`'s 8-bit K and V codes for the rows written from
    /// now on ([`KvCache::write_kv`], and an engine's writes), or with `None` goes back
    /// to the default, a scale per (token, head) row from its largest magnitude. With
    /// fixed scales, values beyond `scale × 127` (int8) or `scale × 448` (FP8) saturate:
    /// a checkpoint's calibrated `k_scale` / `v_scale` give the numerics of engines that
    /// use them; the default never clips. Rows already written keep the scale stored
    /// beside their codes, so nothing written before changes, and copies, edits, swaps,
    /// saves and the kernels treat every row alike (the key rotation of a context shift
    /// keeps a row's scale unless its rotated values outgrow it, as for any row). The
    /// setting is the cache's, not its data's: [`crate::persist`] files do not carry it.
    /// O(1).
    ///
    /// # Errors
    /// [`KernelError::UnscaledStorage`] for the float dtypes,
    /// [`KernelError::LayerOutOfRange`]. Nothing changes on error.
    pub fn set_kv_scales(
        &mut self,
        layer: u32,
        scales: Option<KvScales>,
    ) -> Result<(), CacheError> {
        let at = self.kv_scales_index(layer)?;
        self.kv_scales[at] = scales;
        Ok(())
    }

    /// The fixed scales of layer `layer` ([`KvCache::set_kv_scales`]), `None` for a
    /// scale per row. O(1).
    ///
    /// # Errors
    /// As [`KvCache::set_kv_scales`].
    pub fn kv_scales(&self, layer: u32) -> Result<Option<KvScales>, CacheError> {
        Ok(self.kv_scales[self.kv_scales_index(layer)?])
    }

    /// The index of `layer`'s setting, checked: 8-bit storage and a layer in range.
    /// O(1).
    fn kv_scales_index(&self, layer: u32) -> Result<usize, KernelError> {
        let g = self.layout.geometry();
        if !g.dtype().is_scaled() {
            return Err(KernelError::UnscaledStorage { dtype: g.dtype() });
        }
        let layers = g.layers();
        if layer >= layers {
            return Err(KernelError::LayerOutOfRange { layer, layers });
        }
        Ok(layer as usize)
    }

    /// The scales writes of `layer` take: its fixed ones, or `None` (a layer out of
    /// range: the kernel refuses it). O(1).
    pub(crate) fn kv_scales_of(&self, layer: u32) -> Option<KvScales> {
        self.kv_scales.get(layer as usize).copied().flatten()
    }

    /// [`KvCache::write_kv`] with `k` and `v` already in the storage dtype `T` (e.g. an
    /// f16 model writing an f16 cache): copied as they are, without converting through
    /// f32. O(tokens × kv_heads × head_dim).
    ///
    /// # Errors
    /// As [`KvCache::write_kv`], and [`KernelError::DTypeMismatch`] if `T` is not the
    /// geometry's dtype, [`KernelError::ScaledStorage`] for 8-bit storage (codes carry
    /// no scale: write those caches from f32). Nothing is written on error.
    pub fn write_kv_as<T: Element>(
        &mut self,
        seq: Seq,
        layer: u32,
        first: u32,
        k: &[T],
        v: &[T],
    ) -> Result<(), CacheError> {
        self.layout.check_element::<T>()?;
        let tokens = self.writable_slots(seq, first, k.len())?;
        let (layout, slots) = (&self.layout, &self.slots[..tokens]);
        self.storage.write_kv_as(layout, layer, slots, k, v)
    }

    /// Checks that the tokens of `elems` K elements (`[tokens][kv_heads][head_dim]`)
    /// starting at position `first` lie in the pending range of `seq`, and stores their
    /// slots in `self.slots[..tokens]`; returns `tokens`. O(tokens).
    fn writable_slots(&mut self, seq: Seq, first: u32, elems: usize) -> Result<usize, CacheError> {
        let m = self.tables.manager();
        let len = m.len(seq.0)?;
        let blocks = m.blocks(seq.0)?;
        let g = self.layout.geometry();
        // In `usize`: `kv_heads * head_dim` can pass `u32::MAX` (heads are a `u32`).
        let row = g.kv_heads() as usize * g.head_dim() as usize;
        let tokens = elems / row;
        let pending = self.pending[seq.0.index() as usize];
        let end = u64::from(first) + tokens as u64;
        if first < pending || end > u64::from(len) {
            return Err(CacheError::NotWritable {
                first,
                tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
                pending,
                len,
            });
        }
        // `tokens <= len - first <= max_seq_len`, the slot buffer's length.
        let bs = g.block_size();
        for (i, s) in self.slots[..tokens].iter_mut().enumerate() {
            let pos = first + i as u32;
            *s = blocks[(pos / bs) as usize] * bs + pos % bs;
        }
        Ok(tokens)
    }

    /// Rotates in place the keys of tokens `first..end` of `seq`, in every layer and KV
    /// head, by `delta` positions under the rotary embedding `rope` (see
    /// [`crate::kernels::rotate_keys`]): after a context shift moved those tokens by `delta`,
    /// their keys read as if computed at the new positions. Values are not touched;
    /// the sequence's length, tokens and pending range do not change.
    ///
    /// Every block holding one of the tokens must belong to `seq` alone: rotating a
    /// block another sequence reads, or one the prefix cache offers under its token ids,
    /// would corrupt those readers (a sequence whose full blocks were committed with
    /// known token ids has them registered: they must leave the prefix cache before
    /// they can be rotated). All checks come before the first write, and apply to a
    /// zero `delta` too; an empty range touches no block. Runs on the cache's workers
    /// when large enough. O(blocks of the range) checks, then
    /// O((end - first) × layers × kv_heads × rotary_dims).
    ///
    /// # Errors
    /// Nothing is written on error. Handle errors ([`SeqError::StaleHandle`],
    /// [`SeqError::ForeignHandle`], [`SeqError::Swapped`]), [`CacheError::BadRange`]
    /// (`first > end` or `end > len`), [`KernelError::Rope`] for parameters that do not
    /// fit the head dim, [`CacheError::BlockShared`] for the first block of the range
    /// with a reference count above 1 or registered in the prefix cache.
    pub fn rotate_keys(
        &mut self,
        seq: Seq,
        first: u32,
        end: u32,
        delta: i64,
        rope: RopeParams,
    ) -> Result<(), CacheError> {
        let m = self.tables.manager();
        let len = m.len(seq.0)?;
        let blocks = m.blocks(seq.0)?;
        if first > end || end > len {
            return Err(CacheError::BadRange { first, end, len });
        }
        let g = self.layout.geometry();
        rope.check(g.head_dim()).map_err(KernelError::Rope)?;
        let bs = g.block_size();
        let range = if first == end {
            &[][..]
        } else {
            &blocks[(first / bs) as usize..end.div_ceil(bs) as usize]
        };
        for &block in range {
            // Every block of a live sequence is allocated: its count is at least 1.
            let refcount = m.refcount(block).unwrap_or(0);
            let registered = m.is_registered(block);
            if refcount > 1 || registered {
                return Err(CacheError::BlockShared {
                    block,
                    refcount,
                    registered,
                });
            }
        }
        let table = BlockTable {
            table: m.block_table(),
            stride: m.config().max_blocks_per_seq,
        };
        let shift = KeyShift {
            row: seq.0.index(),
            first,
            end,
            delta,
        };
        self.storage
            .rotate_keys(&self.layout, (table, blocks), shift, rope, &self.pool)
    }

    /// Decode attention for layer `layer`: one query token per sequence (its last one,
    /// whose K/V is written), `q` and `out` `[seqs][q_heads][head_dim]`. See
    /// [`crate::kernels::paged_attention`] for the computation and complexity.
    ///
    /// # Errors
    /// Nothing is written on error. Handle errors ([`SeqError`]) of any sequence,
    /// [`CacheError::BatchTooLarge`], and the kernel's errors.
    pub fn decode(
        &mut self,
        layer: u32,
        seqs: &[Seq],
        q: &[f32],
        out: &mut [f32],
        q_heads: u32,
        scale: f32,
    ) -> Result<(), CacheError> {
        self.batch.clear();
        self.check_batch(seqs.len())?;
        for s in seqs {
            let len = self.manager().len(s.0)?;
            self.batch.push(SeqQuery::decode(s.0.index(), len));
        }
        self.run_attention(layer, q, out, q_heads, scale)
    }

    /// Chunked-prefill attention for layer `layer`: for each `(seq, n)` the last `n`
    /// tokens of `seq` are queries (causal over the whole context), `q` and `out`
    /// `[Σ n][q_heads][head_dim]`. Decode is the case `n = 1`.
    ///
    /// # Errors
    /// As [`KvCache::decode`], plus [`KernelError::QueriesExceedContext`].
    pub fn prefill(
        &mut self,
        layer: u32,
        seqs: &[(Seq, u32)],
        q: &[f32],
        out: &mut [f32],
        q_heads: u32,
        scale: f32,
    ) -> Result<(), CacheError> {
        self.batch.clear();
        self.check_batch(seqs.len())?;
        for &(s, n) in seqs {
            let len = self.manager().len(s.0)?;
            self.batch.push(SeqQuery {
                row: s.0.index(),
                context_len: len,
                queries: n,
            });
        }
        self.run_attention(layer, q, out, q_heads, scale)
    }

    fn check_batch(&self, n: usize) -> Result<(), CacheError> {
        let max = self.batch.capacity();
        if n > max {
            return Err(CacheError::BatchTooLarge { seqs: n, max });
        }
        Ok(())
    }

    pub(crate) fn run_attention(
        &mut self,
        layer: u32,
        q: &[f32],
        out: &mut [f32],
        q_heads: u32,
        scale: f32,
    ) -> Result<(), CacheError> {
        let m = self.tables.manager();
        let table = BlockTable {
            table: m.block_table(),
            stride: m.config().max_blocks_per_seq,
        };
        self.storage.attention(
            &self.layout,
            layer,
            table,
            &self.batch,
            (q, out),
            (q_heads, scale),
            &self.pool,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cache_gets_its_own_hash_key() {
        assert_ne!(random_hash_key(1), random_hash_key(1));
    }
}
