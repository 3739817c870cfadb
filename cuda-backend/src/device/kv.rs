//! [`DeviceKv`]: the device half of a paged KV cache — the arena, the kernels, the step
//! metadata buffers, the pinned I/O buffer, the stream and the host tier — with no block
//! manager. The bookkeeping (which blocks a sequence holds, lengths, slots, pending
//! ranges, copy-on-write) stays with the caller's manager (`kvpage::KvCache` with its
//! CUDA backend): every operation takes what the manager knows (slots, block table,
//! lengths, block copies).
//!
//! Everything is allocated in [`DeviceKv::new`]: the step metadata buffers and their
//! pinned staging twin ([`StepBuffers`]), the K/V / query / output / partition-scratch
//! device buffers and a pinned I/O buffer at the configured step maximum, the arena (a
//! fraction of the free memory left, a byte count or a block count, zeroed) and the
//! optional host tier. No later operation allocates on the device or the host.
//!
//! Operations that take host slices are synchronous: they copy through the pinned I/O
//! buffer, launch on the cache's stream and wait. [`DeviceKv::write_kv_on`] and
//! [`DeviceKv::attention_on`] take device buffers and a stream of the caller's and
//! return once the work is queued, so a caller overlaps steps with its own work on its
//! stream. Every launch is ordered after the previous one's, whatever stream each ran
//! on: the step metadata upload of a launch waits (on the device) for the end of the
//! previous launch's work ([`StepBuffers`]).

use std::sync::Arc;

use kvpage_core::{BlockCopy, Geometry};

use super::{
    Context, DeviceMemory, Direction, HostTier, Kernels, KernelsError, PinnedMemory, StepBuffers,
    StepError, Stream, StreamRef, SwapError,
};
use crate::driver::{CuDevicePtr, CuStream, DriverError};
use crate::launch::{
    plan_attention, plan_copy, plan_f32_write, plan_write_stored, AttentionBuffers, AttentionCall,
    AttentionPlan, Buffer, LaunchConfig, LaunchError, Partitioning, MIN_PARTITION_TOKENS,
};
use crate::params::{KvpCopyParams, KvpGeometry, KvpSeqDesc, KvpWriteParams};
use crate::sizing::{arena_blocks, ArenaSize, SizingError, StepLimits};
use crate::upload::RowUse;

/// `len` f32 in device memory at `ptr`: a caller's buffer for the `*_on` operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSlice {
    /// Device address of the first element.
    pub ptr: CuDevicePtr,
    /// Elements (f32).
    pub len: usize,
}

/// One sequence of an attention call: its block-table row, the tokens of its context
/// (K/V written) and how many of the last ones are queries (decode: 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SeqSpan {
    /// Row of the block table.
    pub row: u32,
    /// Tokens of the context, the queries' included.
    pub context_len: u32,
    /// Query tokens: the last ones of the context.
    pub queries: u32,
}

/// What a [`DeviceKv`] is built from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceKvConfig {
    /// The model's KV geometry (a storage dtype and head dim the kernels support: see
    /// [`crate::launch::Kernel::attention`]).
    pub geometry: Geometry,
    /// The device's ordinal.
    pub device: u32,
    /// Size of the arena.
    pub arena: ArenaSize,
    /// Bytes of device memory to leave free (with [`ArenaSize::FractionOfFree`]).
    pub reserve_bytes: u64,
    /// Rows of the caller's block table (sequences live at once).
    pub max_seqs: u32,
    /// Tokens one sequence may hold: the table's row stride is
    /// `max_seq_len.div_ceil(block_size)` blocks.
    pub max_seq_len: u32,
    /// Query tokens one attention call may carry (write calls are split at this size).
    pub max_step_tokens: u32,
    /// Query heads of the model (a multiple of the KV heads).
    pub q_heads: u32,
    /// Blocks of the pinned host tier for swaps (0: none).
    pub host_blocks: u32,
}

/// Why a [`DeviceKv`] operation failed. Nothing changed in the arena when the error is
/// found before a launch (every error but a driver error of a queued launch; such
/// errors are sticky in CUDA, and the cache should be dropped).
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceKvError {
    /// No kernels: the build found no `nvcc`, or the driver refused them.
    Kernels(KernelsError),
    /// A driver call failed (no driver, no device, out of memory, ...).
    Driver(DriverError),
    /// The arena or the step buffers cannot be sized.
    Sizing(SizingError),
    /// Zero sizes, `q_heads` not a multiple of the KV heads, or sizes that overflow.
    BadConfig,
    /// The launch planner refused the call (shapes, layer, heads, dtype, ...).
    Launch(LaunchError),
    /// Staging or uploading the step metadata failed.
    Step(StepError),
    /// A swap between the device and the host tier failed.
    Swap(SwapError),
    /// A swap was asked of a cache built without a host tier.
    NoHostTier,
    /// An attention call with other query heads than the cache was sized for.
    QHeads {
        /// Query heads passed.
        got: u32,
        /// Query heads of the configuration.
        expected: u32,
    },
    /// A block id outside the arena, or a buffer that is not one block long.
    BadBlock {
        /// The block.
        block: u32,
        /// Bytes of the buffer passed.
        bytes: usize,
    },
    /// The cache's host bookkeeping buffers could not be allocated.
    HostAlloc {
        /// Bytes requested (saturated).
        bytes: usize,
    },
    /// More tokens, sequences or elements in one call than the cache was sized for.
    TooLarge {
        /// What (`"tokens"`, `"sequences"`).
        what: &'static str,
        /// How many were passed.
        got: usize,
        /// The most allowed.
        max: usize,
    },
}

impl core::fmt::Display for DeviceKvError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Kernels(e) => e.fmt(f),
            Self::Driver(e) => e.fmt(f),
            Self::Sizing(e) => e.fmt(f),
            Self::BadConfig => f.write_str("device cache configuration sizes do not fit"),
            Self::Launch(e) => e.fmt(f),
            Self::Step(e) => e.fmt(f),
            Self::Swap(e) => e.fmt(f),
            Self::NoHostTier => f.write_str("the device cache has no host tier"),
            Self::QHeads { got, expected } => {
                write!(
                    f,
                    "{got} query heads, the device cache was sized for {expected}"
                )
            }
            Self::BadBlock { block, bytes } => {
                write!(
                    f,
                    "block {block} with a buffer of {bytes} bytes: not a block of the arena"
                )
            }
            Self::HostAlloc { bytes } => {
                write!(f, "could not allocate {bytes} bytes of cache bookkeeping")
            }
            Self::TooLarge { what, got, max } => {
                write!(f, "{got} {what} in one call, at most {max}")
            }
        }
    }
}

impl std::error::Error for DeviceKvError {}

macro_rules! from_errors {
    ($($ty:ty => $variant:ident),* $(,)?) => {
        $(impl From<$ty> for DeviceKvError {
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
    /// Host side of every copy: as large as the largest of `kv`, `2 × q` and a block.
    pinned: PinnedMemory,
}

/// The device half of a paged KV cache. See the module docs.
///
/// Field order is drop order: buffers and kernels go before the context they hold.
pub struct DeviceKv {
    geometry: Geometry,
    num_blocks: u32,
    q_heads: u32,
    step_tokens: u32,
    steps: StepBuffers,
    io: IoBuffers,
    tier: Option<HostTier>,
    arena: DeviceMemory,
    kernels: Kernels,
    stream: Stream,
    ctx: Arc<Context>,
    /// Sequence descriptors of one attention call (`max_seqs` entries).
    descs: Vec<KvpSeqDesc>,
    /// Block-table rows of one attention call (`max_seqs` entries).
    rows: Vec<RowUse>,
    /// Scratch floats `io.scratch` holds.
    scratch_floats: u64,
}

impl core::fmt::Debug for DeviceKv {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceKv")
            .field("device", self.ctx.info())
            .field("num_blocks", &self.num_blocks)
            .field("host_tier", &self.tier.is_some())
            .finish()
    }
}

/// `n` copies of `value`, or [`DeviceKvError::HostAlloc`] when the allocator refuses
/// (instead of aborting). O(n).
fn filled<T: Clone>(n: usize, value: T) -> Result<Vec<T>, DeviceKvError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| DeviceKvError::HostAlloc {
            bytes: n.saturating_mul(core::mem::size_of::<T>()),
        })?;
    v.resize(n, value);
    Ok(v)
}

/// `a × b × c × 4` bytes as a `usize`, or `BadConfig`.
fn f32_bytes(a: u64, b: u64, c: u64) -> Result<usize, DeviceKvError> {
    a.checked_mul(b)
        .and_then(|x| x.checked_mul(c))
        .and_then(|x| x.checked_mul(4))
        .and_then(|x| usize::try_from(x).ok())
        .ok_or(DeviceKvError::BadConfig)
}

/// Little-endian bytes of `src` into `dst` (as many as both hold). O(len).
fn put_f32s(dst: &mut [u8], src: &[f32]) {
    for (d, x) in dst.chunks_exact_mut(4).zip(src) {
        d.copy_from_slice(&x.to_le_bytes());
    }
}

impl DeviceKv {
    /// Checks the configuration, loads the kernels, allocates the step buffers, then
    /// reserves the arena (zeroed) and the host tier. O(buffer bytes).
    ///
    /// # Errors
    /// [`DeviceKvError::Kernels`] first when the crate was built without `nvcc`
    /// ("the CUDA kernels were not built (no nvcc found: set NVCC or CUDA_PATH)"),
    /// before any driver call; [`DeviceKvError::BadConfig`],
    /// [`DeviceKvError::Launch`] for an unsupported dtype or head dim,
    /// [`DeviceKvError::Driver`] (no driver, no such device, out of memory),
    /// [`DeviceKvError::Sizing`], [`DeviceKvError::Swap`] for the host tier,
    /// [`DeviceKvError::HostAlloc`].
    pub fn new(config: DeviceKvConfig) -> Result<Self, DeviceKvError> {
        crate::fatbin::image().map_err(|e| DeviceKvError::Kernels(KernelsError::NotBuilt(e)))?;
        let g = config.geometry;
        if config.max_seqs == 0
            || config.max_seq_len == 0
            || config.max_step_tokens == 0
            || config.q_heads == 0
            || !config.q_heads.is_multiple_of(g.kv_heads())
        {
            return Err(DeviceKvError::BadConfig);
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
        let block_bytes =
            usize::try_from(g.bytes_per_block()).map_err(|_| DeviceKvError::BadConfig)?;
        // A decode of every sequence at full length, in the smallest partitions.
        let parts = u64::from(config.max_seq_len.div_ceil(MIN_PARTITION_TOKENS));
        let scratch_floats = u64::from(config.max_seqs)
            .checked_mul(qh * parts)
            .and_then(|x| x.checked_mul(hd + 2))
            .ok_or(DeviceKvError::BadConfig)?;
        let scratch_bytes = f32_bytes(scratch_floats, 1, 1)?;
        let max_seqs = config.max_seqs as usize;
        let descs = filled(max_seqs, KvpSeqDesc::default())?;
        let rows = filled(max_seqs, RowUse { row: 0, blocks: 0 })?;

        let ctx = Context::new(config.device)?;
        let kernels = Kernels::load(&ctx)?;
        let stream = Stream::new(&ctx)?;
        let steps = StepBuffers::new(&ctx, limits)?;
        let pinned_bytes = kv_bytes.max(2 * q_bytes).max(block_bytes);
        let io = IoBuffers {
            kv: DeviceMemory::new(&ctx, kv_bytes)?,
            q: DeviceMemory::new(&ctx, q_bytes)?,
            out: DeviceMemory::new(&ctx, q_bytes)?,
            scratch: DeviceMemory::new(&ctx, scratch_bytes)?,
            pinned: PinnedMemory::new(&ctx, pinned_bytes)?,
        };
        let tier = match config.host_blocks {
            0 => None,
            n => Some(HostTier::new(&ctx, n, g.bytes_per_block())?),
        };
        let (free, _) = ctx.mem_info()?;
        let num_blocks = arena_blocks(&g, config.arena, free, config.reserve_bytes)?;
        let arena_bytes = usize::try_from(u64::from(num_blocks) * g.bytes_per_block())
            .map_err(|_| DeviceKvError::BadConfig)?;
        let arena = DeviceMemory::new(&ctx, arena_bytes)?;
        // Zeroed, as the CPU arena: a block never written reads as zeros, never as a
        // previous process's data.
        stream.as_ref().fill(&arena, 0)?;
        stream.as_ref().synchronize()?;
        Ok(Self {
            geometry: g,
            num_blocks,
            q_heads: config.q_heads,
            step_tokens: limits.step_tokens,
            steps,
            io,
            tier,
            arena,
            kernels,
            stream,
            ctx,
            descs,
            rows,
            scratch_floats,
        })
    }

    /// The geometry. O(1).
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Blocks in the arena (the caller's manager is sized with it). O(1).
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Blocks of the host tier (0: none). O(1).
    pub fn host_blocks(&self) -> u32 {
        self.tier.as_ref().map_or(0, HostTier::blocks)
    }

    /// Query heads the cache was sized for. O(1).
    pub fn q_heads(&self) -> u32 {
        self.q_heads
    }

    /// The device context (device name, SM count). O(1).
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The arena's device memory. O(1).
    pub fn arena(&self) -> &DeviceMemory {
        &self.arena
    }

    /// The stream the cache queues its work on. O(1).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// A view of the cache's stream that does not borrow `self`: the stream lives as
    /// long as `self`, past any call that uses the view.
    fn own_stream(&self) -> (Arc<Context>, CuStream) {
        (Arc::clone(&self.ctx), self.stream.as_ref().raw())
    }

    /// Writes the K and V (`[tokens][kv_heads][head_dim]`, f32, host memory) of layer
    /// `layer` into the arena slots `slots` (one per token, from the caller's manager),
    /// in launches of at most the step's token limit. Synchronous.
    /// O(tokens × kv_heads × head_dim).
    ///
    /// 8-bit storage: each row at the scale of its largest magnitude, or with `scales`
    /// (`[k, v]`) at those fixed scales, its codes saturating
    /// ([`crate::launch::plan_write_at_scales`]).
    ///
    /// # Errors
    /// Nothing is written on error: the planner's ([`LaunchError::BufferLength`],
    /// [`LaunchError::LayerOutOfRange`], [`LaunchError::SlotOutOfRange`], and with
    /// `scales` [`LaunchError::UnscaledStorage`], [`LaunchError::BadKvScale`]); driver
    /// errors.
    pub fn write_kv(
        &mut self,
        layer: u32,
        slots: &[u32],
        k: &[f32],
        v: &[f32],
        scales: Option<[f32; 2]>,
    ) -> Result<(), DeviceKvError> {
        let (g, n) = (self.geometry, self.num_blocks);
        plan_f32_write(&g, n, layer, slots, (k.len(), v.len()), scales)?;
        let kv = [KvBytes::F32(k), KvBytes::F32(v)];
        self.write_chunks(layer, slots, kv, 4, WriteKind::F32(scales))
    }

    /// [`DeviceKv::write_kv`] with `k` and `v` already in the storage dtype (f32, f16 or
    /// bf16), as little-endian bytes, copied as they are. Synchronous. O(bytes).
    ///
    /// # Errors
    /// [`LaunchError::ScaledStorage`] for 8-bit storage, [`LaunchError::BufferLength`]
    /// for lengths that are not whole elements of the tokens; otherwise as
    /// [`DeviceKv::write_kv`].
    pub fn write_kv_stored(
        &mut self,
        layer: u32,
        slots: &[u32],
        k: &[u8],
        v: &[u8],
    ) -> Result<(), DeviceKvError> {
        let (g, n) = (self.geometry, self.num_blocks);
        let esize = g.dtype().size_bytes() as usize;
        for (buffer, len) in [(Buffer::Keys, k.len()), (Buffer::Values, v.len())] {
            if !len.is_multiple_of(esize) {
                return Err(LaunchError::BufferLength {
                    buffer,
                    expected: (len / esize * esize) as u64,
                    actual: len as u64,
                }
                .into());
            }
        }
        plan_write_stored(&g, n, layer, slots, k.len() / esize, v.len() / esize)?;
        self.write_chunks(
            layer,
            slots,
            [KvBytes::Raw(k), KvBytes::Raw(v)],
            esize,
            WriteKind::Stored,
        )
    }

    /// Copies `[k, v]` through the pinned buffer in chunks of at most `step_tokens`
    /// tokens and launches the write of each; waits at the end. The whole call was
    /// planned (validated) by the caller.
    fn write_chunks(
        &mut self,
        layer: u32,
        slots: &[u32],
        [k, v]: [KvBytes<'_>; 2],
        esize: usize,
        kind: WriteKind,
    ) -> Result<(), DeviceKvError> {
        let g = self.geometry;
        let row = g.kv_heads() as usize * g.head_dim() as usize * esize;
        let (ctx, raw) = self.own_stream();
        // SAFETY: the cache's own live stream, of its context.
        let stream = unsafe { StreamRef::from_raw(&ctx, raw) };
        for (i, chunk) in slots.chunks(self.step_tokens as usize).enumerate() {
            let start = i * self.step_tokens as usize * row;
            let bytes = chunk.len() * row;
            let pinned = self.io.pinned.as_mut_slice();
            k.put(&mut pinned[..bytes], start, esize);
            v.put(&mut pinned[bytes..2 * bytes], start, esize);
            // SAFETY: 2 × bytes fit the pinned and device K/V buffers (chunk <=
            // step_tokens; the device buffer holds f32, the widest dtype); both live
            // until the synchronize below.
            unsafe { stream.copy_to_device(self.io.kv.ptr(), &self.io.pinned, 0, 2 * bytes) }?;
            let (kd, vd) = (self.io.kv.ptr(), self.io.kv.ptr() + bytes as u64);
            let elems = bytes / esize;
            let (plan, scales) = match kind {
                WriteKind::Stored => (
                    plan_write_stored(&g, self.num_blocks, layer, chunk, elems, elems)?,
                    None,
                ),
                WriteKind::F32(scales) => {
                    let n = self.num_blocks;
                    let plan = plan_f32_write(&g, n, layer, chunk, (elems, elems), scales)?;
                    (plan, scales)
                }
            };
            self.launch_write(stream, plan, chunk, layer, [kd, vd], scales)?;
            stream.synchronize()?;
        }
        Ok(())
    }

    /// [`DeviceKv::write_kv`] from device memory, queued on the caller's `stream`: `k`
    /// and `v` are f32 `[slots][kv_heads][head_dim]`, at most the step's token limit.
    /// Returns once queued. O(tokens) host work.
    ///
    /// # Errors
    /// As [`DeviceKv::write_kv`], [`DeviceKvError::TooLarge`] beyond the step limit;
    /// nothing is queued on error.
    ///
    /// # Safety
    /// `stream` belongs to this cache's context; `k` and `v` are device memory of that
    /// context, written before on `stream` (or complete), and neither freed nor written
    /// until the work queued on `stream` completes.
    pub unsafe fn write_kv_on(
        &mut self,
        stream: StreamRef<'_>,
        layer: u32,
        slots: &[u32],
        k: DeviceSlice,
        v: DeviceSlice,
        scales: Option<[f32; 2]>,
    ) -> Result<(), DeviceKvError> {
        self.check_tokens(slots.len())?;
        let (g, n) = (&self.geometry, self.num_blocks);
        let plan = plan_f32_write(g, n, layer, slots, (k.len, v.len), scales)?;
        self.launch_write(stream, plan, slots, layer, [k.ptr, v.ptr], scales)
    }

    fn check_tokens(&self, tokens: usize) -> Result<(), DeviceKvError> {
        if tokens > self.step_tokens as usize {
            return Err(DeviceKvError::TooLarge {
                what: "tokens",
                got: tokens,
                max: self.step_tokens as usize,
            });
        }
        Ok(())
    }

    /// Uploads the slots and queues the planned write on `stream`.
    fn launch_write(
        &mut self,
        stream: StreamRef<'_>,
        plan: Option<LaunchConfig>,
        slots: &[u32],
        layer: u32,
        [k, v]: [CuDevicePtr; 2],
        scales: Option<[f32; 2]>,
    ) -> Result<(), DeviceKvError> {
        let Some(cfg) = plan else {
            return Ok(());
        };
        let [k_scale, v_scale] = scales.unwrap_or([0.0; 2]);
        let steps = &mut self.steps;
        steps.begin()?;
        steps.stage_slots(slots)?;
        steps.upload(stream)?;
        let params = KvpWriteParams {
            geo: KvpGeometry::new(&self.geometry, self.num_blocks),
            arena: self.arena.ptr(),
            k,
            v,
            slots: steps.device_ptr(steps.layout().slots),
            tokens: cfg.grid[0],
            layer,
            k_scale,
            v_scale,
        };
        // SAFETY: the planner checked the shapes, the layer and every slot; the slots
        // were uploaded before on the same stream; the inputs are the callers' (see
        // their contracts); the arena lives as long as the cache, whose drop waits.
        unsafe { self.kernels.launch(stream, &cfg, &params) }?;
        steps.end(stream)?;
        Ok(())
    }

    /// Attention of layer `layer` over the caller's block table (`table`, rows of
    /// `stride` blocks: the manager's): for each of `seqs` its last `queries` tokens
    /// are queries, causal over its whole context; `q` and `out` `[Σ queries][q_heads]
    /// [head_dim]` f32 in host memory; `seqs` at most `max_seqs`. Synchronous. O(launch + copies of q and out).
    ///
    /// # Errors
    /// Nothing is written on error: [`DeviceKvError::QHeads`] for `q_heads` other than
    /// the configured, [`DeviceKvError::TooLarge`] (sequences over `max_seqs`, queries
    /// over `max_step_tokens`), the planner's (`QueriesExceedContext`, `BufferLength`,
    /// `LayerOutOfRange`, ...); the metadata's ([`StepError`] for a table of another
    /// shape); driver errors.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &mut self,
        layer: u32,
        (table, stride): (&[u32], u32),
        seqs: impl ExactSizeIterator<Item = SeqSpan>,
        q: &[f32],
        out: &mut [f32],
        q_heads: u32,
        scale: f32,
    ) -> Result<(), DeviceKvError> {
        let n = self.describe(seqs, q_heads)?;
        check_out(q.len(), out.len())?;
        // Plan first: a refused call queues nothing and copies nothing.
        self.plan(layer, (table, stride), n, q.len(), scale)?;
        let q_bytes = q.len() * 4;
        put_f32s(&mut self.io.pinned.as_mut_slice()[..q_bytes], q);
        let (ctx, raw) = self.own_stream();
        // SAFETY: the cache's own live stream, of its context.
        let stream = unsafe { StreamRef::from_raw(&ctx, raw) };
        // SAFETY: `describe` checked the queries (<= step_tokens at q_heads), so
        // q_bytes fit both buffers; both live until the synchronize below.
        unsafe { stream.copy_to_device(self.io.q.ptr(), &self.io.pinned, 0, q_bytes) }?;
        let bufs = [self.io.q.ptr(), self.io.out.ptr()];
        // SAFETY: the cache's own buffers on its own stream, waited for below.
        unsafe { self.launch_attention(stream, layer, (table, stride), n, bufs, q.len(), scale) }?;
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

    /// [`DeviceKv::attention`] on device buffers, queued on the caller's `stream`: `q`
    /// and `out` are f32 `[Σ queries][q_heads][head_dim]`. Returns once queued.
    /// O(seqs + blocks of their contexts) host work.
    ///
    /// # Errors
    /// As [`DeviceKv::attention`]; nothing is queued on error.
    ///
    /// # Safety
    /// `stream` belongs to this cache's context; `q` and `out` are device memory of
    /// that context (`q` written before on `stream` or complete), not freed, and `out`
    /// neither read nor written by other work, until the work queued on `stream`
    /// completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attention_on(
        &mut self,
        stream: StreamRef<'_>,
        layer: u32,
        (table, stride): (&[u32], u32),
        seqs: impl ExactSizeIterator<Item = SeqSpan>,
        q: DeviceSlice,
        out: DeviceSlice,
        q_heads: u32,
        scale: f32,
    ) -> Result<(), DeviceKvError> {
        let n = self.describe(seqs, q_heads)?;
        check_out(q.len, out.len)?;
        // SAFETY: the caller's contract.
        unsafe {
            self.launch_attention(
                stream,
                layer,
                (table, stride),
                n,
                [q.ptr, out.ptr],
                q.len,
                scale,
            )
        }
    }

    /// Fills `self.descs[..n]` from the `n` spans of `seqs`; returns `n`. O(seqs).
    ///
    /// # Errors
    /// [`DeviceKvError::QHeads`], [`DeviceKvError::TooLarge`] for too many sequences or
    /// query tokens.
    fn describe(
        &mut self,
        seqs: impl ExactSizeIterator<Item = SeqSpan>,
        q_heads: u32,
    ) -> Result<usize, DeviceKvError> {
        if q_heads != self.q_heads {
            return Err(DeviceKvError::QHeads {
                got: q_heads,
                expected: self.q_heads,
            });
        }
        let n = seqs.len();
        if n > self.descs.len() {
            return Err(DeviceKvError::TooLarge {
                what: "sequences",
                got: n,
                max: self.descs.len(),
            });
        }
        let mut start = 0u64;
        for (d, s) in self.descs.iter_mut().zip(seqs) {
            *d = KvpSeqDesc {
                row: s.row,
                context_len: s.context_len,
                queries: s.queries,
                q_start: u32::try_from(start).unwrap_or(u32::MAX),
            };
            start += u64::from(s.queries);
        }
        self.check_tokens(usize::try_from(start).unwrap_or(usize::MAX))?;
        Ok(n)
    }

    /// Plans attention over `self.descs[..n]`: automatic partitions, or one partition
    /// per context when the scratch is too small for the automatic plan (many query
    /// rows). O(seqs + blocks of their contexts).
    fn plan(
        &self,
        layer: u32,
        (table, stride): (&[u32], u32),
        n: usize,
        q_len: usize,
        scale: f32,
    ) -> Result<Option<AttentionPlan>, DeviceKvError> {
        let g = self.geometry;
        let descs = &self.descs[..n];
        let call = AttentionCall {
            geometry: g,
            num_blocks: self.num_blocks,
            layer,
            q_heads: self.q_heads,
            scale,
            table,
            stride,
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
    /// As [`DeviceKv::attention_on`] for `q` and `out` (`q_len` f32 each).
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_attention(
        &mut self,
        stream: StreamRef<'_>,
        layer: u32,
        (table, stride): (&[u32], u32),
        n: usize,
        [q, out]: [CuDevicePtr; 2],
        q_len: usize,
        scale: f32,
    ) -> Result<(), DeviceKvError> {
        let Some(plan) = self.plan(layer, (table, stride), n, q_len, scale)? else {
            return Ok(());
        };
        let bs = self.geometry.block_size();
        for (r, d) in self.rows.iter_mut().zip(&self.descs[..n]) {
            *r = RowUse {
                row: d.row,
                blocks: d.context_len.div_ceil(bs),
            };
        }
        self.steps.begin()?;
        self.steps.stage_seqs(&self.descs[..n])?;
        self.steps
            .stage_block_table(table, stride as usize, &self.rows[..n])?;
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

    /// Copies whole blocks (`src` to `dst` for each pair: the manager's copy-on-write
    /// and edit copies) with `kvp_copy_blocks`, in launches of at most the metadata's
    /// pair limit, and waits. O(pairs × bytes per block) on the device.
    ///
    /// # Errors
    /// Nothing is copied on error: [`LaunchError::BlockOutOfRange`] (any pair checked
    /// first); driver errors.
    pub fn copy_blocks(&mut self, pairs: &[BlockCopy]) -> Result<(), DeviceKvError> {
        plan_copy(&self.geometry, self.num_blocks, pairs)?;
        let max = self.steps.limits().copy_pairs.max(1) as usize;
        let stream = self.stream.as_ref();
        for chunk in pairs.chunks(max) {
            let Some(cfg) = plan_copy(&self.geometry, self.num_blocks, chunk)? else {
                continue;
            };
            self.steps.begin()?;
            self.steps.stage_pairs(chunk)?;
            self.steps.upload(stream)?;
            let params = KvpCopyParams {
                arena: self.arena.ptr(),
                pairs: self.steps.device_ptr(self.steps.layout().pairs),
                bytes_per_block: self.geometry.bytes_per_block(),
                num_pairs: cfg.grid[0],
                pad0: 0,
            };
            // SAFETY: the planner's config for these params; the pairs were uploaded
            // on the same stream before, and every buffer outlives the launch (we wait
            // below).
            unsafe { self.kernels.launch(stream, &cfg, &params) }?;
            self.steps.end(stream)?;
        }
        stream.synchronize()?;
        Ok(())
    }

    /// Queues the swap of `moves` in `direction` (out: `src` a device block, `dst` a
    /// host-tier block; in: the reverse), after every launch of the cache so far; the
    /// next launches wait for the copies. Returns once queued. O(moves).
    ///
    /// # Errors
    /// [`DeviceKvError::NoHostTier`]; [`SwapError::OutOfArena`] for a block outside
    /// either arena (every move checked before any is queued); driver errors.
    pub fn swap(&mut self, direction: Direction, moves: &[BlockCopy]) -> Result<(), DeviceKvError> {
        let Some(tier) = self.tier.as_mut() else {
            return Err(DeviceKvError::NoHostTier);
        };
        if moves.is_empty() {
            return Ok(());
        }
        let stream = self.stream.as_ref();
        self.steps.after_last_step(stream)?;
        tier.swap(direction, &self.arena, stream, moves)?;
        // `stream` now waits for the copies: the next launch (any stream) waits for it.
        self.steps.end(stream)?;
        Ok(())
    }

    /// The device range of `block` for a buffer of `bytes` bytes, or
    /// [`DeviceKvError::BadBlock`].
    fn block_range(&self, block: u32, bytes: usize) -> Result<CuDevicePtr, DeviceKvError> {
        let bpb = self.geometry.bytes_per_block();
        if block >= self.num_blocks || bytes as u64 != bpb {
            return Err(DeviceKvError::BadBlock { block, bytes });
        }
        self.arena
            .range(block as usize * bytes, bytes)
            .ok_or(DeviceKvError::BadBlock { block, bytes })
    }

    /// Reads the bytes of `block` (the block-major layout, little-endian) into `dst`
    /// (exactly one block long, ordinary host memory), after every launch queued so
    /// far. Takes `&self`: concurrent reads of a cache are fine (each waits for the
    /// cache's stream). Synchronous. O(bytes per block).
    ///
    /// # Errors
    /// [`DeviceKvError::BadBlock`]; driver errors.
    pub fn read_block(&self, block: u32, dst: &mut [u8]) -> Result<(), DeviceKvError> {
        let src = self.block_range(block, dst.len())?;
        let stream = self.stream.as_ref();
        self.steps.after_last_step(stream)?;
        // SAFETY: the range lies in the arena (checked), which lives as long as `self`.
        unsafe { stream.read_to_host(dst, src) }?;
        Ok(())
    }

    /// Writes `src` (one block's bytes, the block-major layout, little-endian) into
    /// `block`, after every launch queued so far; later launches see it. Synchronous.
    /// O(bytes per block).
    ///
    /// # Errors
    /// [`DeviceKvError::BadBlock`] (nothing written); driver errors.
    pub fn write_block(&mut self, block: u32, src: &[u8]) -> Result<(), DeviceKvError> {
        let dst = self.block_range(block, src.len())?;
        let stream = self.stream.as_ref();
        self.steps.after_last_step(stream)?;
        self.io.pinned.as_mut_slice()[..src.len()].copy_from_slice(src);
        // SAFETY: as in `read_block`; the pinned buffer is not reused before the wait.
        unsafe { stream.copy_to_device(dst, &self.io.pinned, 0, src.len()) }?;
        self.steps.end(stream)?;
        stream.synchronize()?;
        Ok(())
    }
}

/// `q` and `out` of one attention call must be as long.
fn check_out(q: usize, out: usize) -> Result<(), DeviceKvError> {
    if q != out {
        return Err(LaunchError::BufferLength {
            buffer: Buffer::Output,
            expected: q as u64,
            actual: out as u64,
        }
        .into());
    }
    Ok(())
}

/// What a write launches: `kvp_write_kv` from f32 (8-bit rows at the fixed `[k, v]`
/// scales where given), or `kvp_write_kv_stored`.
#[derive(Clone, Copy)]
enum WriteKind {
    F32(Option<[f32; 2]>),
    Stored,
}

/// K or V of a write: f32 to convert to little-endian bytes, or bytes as they are.
#[derive(Clone, Copy)]
enum KvBytes<'a> {
    F32(&'a [f32]),
    Raw(&'a [u8]),
}

impl KvBytes<'_> {
    /// Copies `dst.len()` bytes starting at byte `start` of the data into `dst`.
    fn put(&self, dst: &mut [u8], start: usize, esize: usize) {
        match self {
            Self::F32(x) => put_f32s(dst, &x[start / esize..]),
            Self::Raw(b) => dst.copy_from_slice(&b[start..start + dst.len()]),
        }
    }
}

impl Drop for DeviceKv {
    fn drop(&mut self) {
        // Queued work may still use the buffers freed next.
        let _ = self.stream.as_ref().synchronize();
    }
}
