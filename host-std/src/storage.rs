//! Where a [`crate::KvCache`] keeps its K/V and runs its kernels: the CPU arena (with
//! the host tier of an engine) or, with the `cuda` feature, a CUDA device
//! (`kvpage_cuda::device::DeviceKv`). The cache's bookkeeping (the core's manager,
//! pending ranges, slots) is the same for both; every access to K/V bytes goes through
//! [`Storage`], so the two backends share one cache type.
//!
//! The device runs the write, copy and attention kernels; what has no kernel there (an
//! edit's row moves, re-rotating keys) and persistence read the blocks concerned into
//! the host, work on them with the CPU kernels and write them back.

#[cfg(feature = "cuda")]
use kvpage_cuda::device::{DeviceKv, DeviceKvError, Direction, SeqSpan};

use kvpage_core::BlockCopy;

use crate::arena::{Arena, KvLayout};
use crate::cache::CacheError;
use crate::dtype::{for_dtype, Element};
use crate::error::{Buffer, KernelError};
use crate::kernels::{
    self, AttentionParams, BlockTable, KeyShift, RopeParams, SeqQuery, WorkerPool,
};
use crate::persist::format::copy_elems_from_le;
use crate::persist::{PersistError, Section};
use crate::quant::KvScales;

// The device's arena is little-endian; the persistence code reads block bytes as the
// host's native elements, which are the same bytes only on a little-endian host.
#[cfg(all(feature = "cuda", target_endian = "big"))]
compile_error!("the CUDA backend needs a little-endian host");

/// Which backend a cache or engine runs on.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Backend {
    /// The CPU kernels over a host arena (the default).
    #[default]
    Cpu,
    /// A CUDA device (needs the `cuda` feature; without it, asking for it is
    /// [`CacheError::Device`] with [`DeviceFault::NotCompiled`]).
    Cuda(CudaOptions),
}

/// How a CUDA-backed cache is sized. The arena's size is the cache config's
/// [`crate::Capacity`] unless `memory_fraction` is set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CudaOptions {
    /// The device's ordinal.
    pub device: u32,
    /// `Some(f)`: the arena takes this fraction (in `(0, 1]`) of the device's free
    /// memory, less `reserve_bytes`, instead of the configured capacity (which is
    /// still checked as on the CPU: at least one block).
    pub memory_fraction: Option<f64>,
    /// Bytes of device memory to leave free with `memory_fraction`.
    pub reserve_bytes: u64,
    /// Query heads of the model (every attention call must pass this many): the
    /// device's query and output buffers and its kernel are sized for it.
    pub q_heads: u32,
    /// Query tokens one attention call may carry (writes are split at this size).
    pub max_step_tokens: u32,
}

/// Why the CUDA backend failed, summarised (the cache's errors are `Copy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceFault {
    /// kvpage was built without the `cuda` feature.
    NotCompiled,
    /// The CUDA kernels were not built (no `nvcc` at build time) or were refused.
    NoKernels,
    /// No NVIDIA driver could be loaded (or it lacks an entry point kvpage calls).
    /// Displayed with the loader's reason (the process's driver load, which is made
    /// once and kept: the library paths tried and what the loader said, or the missing
    /// entry point).
    NoDriver,
    /// A driver call failed. Displayed with the code's name and the driver's own
    /// message for it (`cuGetErrorName` / `cuGetErrorString` of the loaded driver, else
    /// CUDA 13's `cuda.h`), e.g. `cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS
    /// (700): an illegal memory access was encountered`.
    Driver {
        /// The driver entry point, e.g. `"cuLaunchKernel"`.
        call: &'static str,
        /// The driver's raw result code (0 when the call was not made: an argument did
        /// not fit the driver's types).
        code: i32,
    },
    /// The device backend refused the configuration or the call's sizes or shapes
    /// (an unsupported dtype or head dim, more than it was sized for, a device arena
    /// of zero blocks, ...).
    Refused,
}

impl core::fmt::Display for DeviceFault {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NotCompiled => f.write_str("kvpage was built without the `cuda` feature"),
            Self::NoKernels => f.write_str("the CUDA kernels were not built or not loaded"),
            #[cfg(feature = "cuda")]
            Self::NoDriver => match kvpage_cuda::driver::Driver::get() {
                Err(e) => write!(f, "no usable NVIDIA driver: {e}"),
                Ok(_) => f.write_str("no usable NVIDIA driver"),
            },
            #[cfg(not(feature = "cuda"))]
            Self::NoDriver => f.write_str("no usable NVIDIA driver"),
            Self::Driver { call, code: 0 } => {
                write!(
                    f,
                    "{call} not called: an argument does not fit the driver's types"
                )
            }
            #[cfg(feature = "cuda")]
            Self::Driver { call, code } => {
                let code = kvpage_cuda::driver::Code(*code);
                kvpage_cuda::driver::CallError::from_process_driver(call, code).fmt(f)
            }
            #[cfg(not(feature = "cuda"))]
            Self::Driver { call, code } => write!(f, "{call} failed: CUresult {code}"),
            Self::Refused => f.write_str("the CUDA backend refused the sizes or shapes"),
        }
    }
}

#[cfg(feature = "cuda")]
impl From<DeviceKvError> for CacheError {
    fn from(e: DeviceKvError) -> Self {
        use kvpage_cuda::device::{KernelsError, StepError, SwapError};
        use kvpage_cuda::driver::DriverError;
        let fault = match e {
            DeviceKvError::Kernels(KernelsError::Driver(d))
            | DeviceKvError::Driver(d)
            | DeviceKvError::Step(StepError::Driver(d))
            | DeviceKvError::Swap(SwapError::Driver(d)) => match d {
                DriverError::NotInstalled { .. } | DriverError::MissingEntryPoint { .. } => {
                    DeviceFault::NoDriver
                }
                DriverError::Call(c) => DeviceFault::Driver {
                    call: c.call,
                    code: c.code.0,
                },
                DriverError::BadArgument { call, .. } => DeviceFault::Driver { call, code: 0 },
            },
            DeviceKvError::Kernels(_) => DeviceFault::NoKernels,
            DeviceKvError::Launch(l) => match kernel_error_of(l) {
                Some(k) => return Self::Kernel(k),
                None => DeviceFault::Refused,
            },
            _ => DeviceFault::Refused,
        };
        Self::Device(fault)
    }
}

/// The CPU kernels' error for a refusal of the device's planner that has one, so a
/// cache gives the same error on both backends (a wrong layer, buffer length, query
/// count). O(1).
#[cfg(feature = "cuda")]
fn kernel_error_of(e: kvpage_cuda::launch::LaunchError) -> Option<KernelError> {
    use kvpage_cuda::launch::{Buffer as B, LaunchError as L};
    let len = |x: u64| usize::try_from(x).unwrap_or(usize::MAX);
    Some(match e {
        L::BufferLength {
            buffer,
            expected,
            actual,
        } => KernelError::BufferLength {
            buffer: match buffer {
                B::Keys => Buffer::Keys,
                B::Values => Buffer::Values,
                B::Query => Buffer::Query,
                B::Output => Buffer::Output,
                B::Arena => Buffer::Arena,
                B::Seqs | B::Scratch => return None,
            },
            expected: len(expected),
            actual: len(actual),
        },
        L::LayerOutOfRange { layer, layers } => KernelError::LayerOutOfRange { layer, layers },
        L::SlotOutOfRange { slot, slots } => KernelError::SlotOutOfRange { slot, slots },
        L::BlockOutOfRange { block, blocks } => KernelError::BlockOutOfRange { block, blocks },
        L::CopyOntoItself { block } => KernelError::CopyOntoItself { block },
        L::HeadsNotDivisible { q_heads, kv_heads } => {
            KernelError::HeadsNotDivisible { q_heads, kv_heads }
        }
        L::ScaledStorage { dtype } => KernelError::ScaledStorage { dtype },
        L::UnscaledStorage { dtype } => KernelError::UnscaledStorage { dtype },
        L::BadKvScale => KernelError::BadKvScale,
        L::BadScale => KernelError::BadScale,
        L::ContextTooLong {
            context_len,
            capacity,
        } => KernelError::ContextTooLong {
            context_len,
            capacity,
        },
        L::QueriesExceedContext {
            queries,
            context_len,
        } => KernelError::QueriesExceedContext {
            queries,
            context_len,
        },
        // The device's table counts its rows in a u64; no table holds 2^32 of them, and
        // a count past that would only be displayed.
        L::RowOutOfRange { row, rows } => KernelError::RowOutOfRange {
            row,
            rows: u32::try_from(rows).unwrap_or(u32::MAX),
        },
        _ => return None,
    })
}

/// The K/V storage of a cache. See the module docs.
pub(crate) enum Storage {
    /// The CPU arena and, for an engine with swap space, the host tier.
    Cpu {
        arena: Arena,
        host: Option<(KvLayout, Arena)>,
    },
    /// A CUDA device; `empty` is what [`crate::KvCache::arena`] returns; `stage` is
    /// where the CPU kernels work on blocks the device has no kernel for.
    #[cfg(feature = "cuda")]
    Cuda {
        kv: Box<DeviceKv>,
        empty: Arena,
        stage: Stage,
    },
}

/// Two blocks of host arena: blocks of a device cache are read in, changed by a CPU
/// kernel and written back (an edit's row moves, re-rotated keys).
#[cfg(feature = "cuda")]
pub(crate) struct Stage {
    arena: Arena,
    layout: KvLayout,
}

#[cfg(feature = "cuda")]
impl Stage {
    /// Reads `blocks` (one or two) of `kv` into the stage's blocks `0..`, runs `f` on
    /// the stage, and writes stage block `back` to `blocks[back]`. O(bytes per block ×
    /// blocks) of copies.
    ///
    /// # Errors
    /// `f`'s (nothing written), the device's.
    fn run(
        &mut self,
        kv: &mut DeviceKv,
        blocks: &[u32],
        back: usize,
        f: impl FnOnce(&KvLayout, &mut Arena) -> Result<(), KernelError>,
    ) -> Result<(), CacheError> {
        let bpb = self.layout.geometry().bytes_per_block() as usize;
        for (i, &b) in blocks.iter().enumerate() {
            kv.read_block(b, &mut self.arena.as_bytes_mut()[i * bpb..(i + 1) * bpb])?;
        }
        f(&self.layout, &mut self.arena)?;
        kv.write_block(
            blocks[back],
            &self.arena.as_bytes()[back * bpb..(back + 1) * bpb],
        )?;
        Ok(())
    }
}

impl Storage {
    /// The CPU arena of `layout`, zeroed, and a host tier of `host_blocks` blocks (0:
    /// none). O(arena bytes + host arena).
    ///
    /// # Errors
    /// [`CacheError::Alloc`] if memory is refused; [`CacheError::Kernel`] for a host
    /// layout that does not fit.
    pub(crate) fn cpu(layout: &KvLayout, host_blocks: u32) -> Result<Self, CacheError> {
        let arena = Arena::for_layout(layout).map_err(CacheError::Alloc)?;
        let host = match host_blocks {
            0 => None,
            blocks => {
                let host_layout = KvLayout::new(*layout.geometry(), blocks)?;
                let host_arena = Arena::for_layout(&host_layout).map_err(CacheError::Alloc)?;
                Some((host_layout, host_arena))
            }
        };
        Ok(Self::Cpu { arena, host })
    }

    /// A device storage for `config` on the CUDA device of `options`: an arena of
    /// `num_blocks` blocks (or `options.memory_fraction` of the free memory) and a
    /// pinned host tier of `host_blocks` blocks. O(device buffers + host tier).
    ///
    /// # Errors
    /// [`CacheError::Device`]: [`DeviceFault::NotCompiled`] without the `cuda` feature,
    /// otherwise the device's errors summarised.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn cuda(
        config: &crate::CacheConfig,
        num_blocks: u32,
        host_blocks: u32,
        options: CudaOptions,
    ) -> Result<Self, CacheError> {
        #[cfg(feature = "cuda")]
        {
            use kvpage_cuda::device::DeviceKvConfig;
            use kvpage_cuda::sizing::ArenaSize;
            let arena = match options.memory_fraction {
                Some(f) => ArenaSize::FractionOfFree(f),
                None => ArenaSize::Blocks(num_blocks),
            };
            let kv = DeviceKv::new(DeviceKvConfig {
                geometry: config.geometry,
                device: options.device,
                arena,
                reserve_bytes: options.reserve_bytes,
                max_seqs: config.max_seqs,
                max_seq_len: config.max_seq_len,
                max_step_tokens: options.max_step_tokens,
                q_heads: options.q_heads,
                host_blocks,
            })?;
            let empty = Arena::new(0).map_err(CacheError::Alloc)?;
            let layout = KvLayout::new(config.geometry, 2)?;
            let arena = Arena::for_layout(&layout).map_err(CacheError::Alloc)?;
            Ok(Self::Cuda {
                kv: Box::new(kv),
                empty,
                stage: Stage { arena, layout },
            })
        }
        #[cfg(not(feature = "cuda"))]
        Err(CacheError::Device(DeviceFault::NotCompiled))
    }

    /// Blocks of a device arena (`None` on the CPU, where the config decides). O(1).
    pub(crate) fn device_blocks(&self) -> Option<u32> {
        match self {
            Self::Cpu { .. } => None,
            #[cfg(feature = "cuda")]
            Self::Cuda { kv, .. } => Some(kv.num_blocks()),
        }
    }

    /// The backend's name: `"cpu"` or `"cuda"`. O(1).
    pub(crate) fn backend(&self) -> &'static str {
        match self {
            Self::Cpu { .. } => "cpu",
            #[cfg(feature = "cuda")]
            Self::Cuda { .. } => "cuda",
        }
    }

    /// The CPU arena; an empty one for a device cache. O(1).
    pub(crate) fn arena(&self) -> &Arena {
        match self {
            Self::Cpu { arena, .. } => arena,
            #[cfg(feature = "cuda")]
            Self::Cuda { empty, .. } => empty,
        }
    }

    /// Copies the bytes of `block` (the block-major layout) into `out`, which must be
    /// one block long. O(bytes per block).
    ///
    /// # Errors
    /// [`KernelError::BlockOutOfRange`], [`KernelError::BufferLength`] (nothing
    /// written); the device's.
    pub(crate) fn read_block(
        &self,
        layout: &KvLayout,
        block: u32,
        out: &mut [u8],
    ) -> Result<(), CacheError> {
        let bpb = layout.geometry().bytes_per_block();
        if block >= layout.num_blocks() {
            return Err(KernelError::BlockOutOfRange {
                block,
                blocks: layout.num_blocks(),
            }
            .into());
        }
        if out.len() as u64 != bpb {
            return Err(KernelError::BufferLength {
                buffer: Buffer::Arena,
                expected: bpb as usize,
                actual: out.len(),
            }
            .into());
        }
        match self {
            Self::Cpu { arena, .. } => {
                // The layout's invariant: every byte offset of the arena fits a `usize`.
                let start = block as usize * out.len();
                out.copy_from_slice(&arena.as_bytes()[start..start + out.len()]);
            }
            #[cfg(feature = "cuda")]
            Self::Cuda { kv, .. } => kv.read_block(block, out)?,
        }
        Ok(())
    }

    /// The bytes of `block` for a save (the block-major layout, native = little-endian
    /// elements): a view of the CPU arena, or the block read back from the device into
    /// `buf` (resized to one block). O(bytes per block) on a device, O(1) on the CPU.
    ///
    /// # Errors
    /// [`PersistError::Corrupt`] for a block outside the arena (not reachable for a
    /// sequence's blocks), [`PersistError::Device`] for a driver error.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables, clippy::ptr_arg))]
    pub(crate) fn block_bytes<'a>(
        &'a self,
        layout: &KvLayout,
        block: u32,
        buf: &'a mut Vec<u8>,
    ) -> Result<&'a [u8], PersistError> {
        let corrupt = PersistError::Corrupt {
            section: Section::Kv,
        };
        // The layout's invariant: every byte offset of the arena fits a `usize`.
        let bpb = layout.geometry().bytes_per_block() as usize;
        match self {
            Self::Cpu { arena, .. } => {
                let start = block as usize * bpb;
                arena.as_bytes().get(start..start + bpb).ok_or(corrupt)
            }
            #[cfg(feature = "cuda")]
            Self::Cuda { kv, .. } => {
                buf.resize(bpb, 0);
                kv.read_block(block, buf)
                    .map_err(|e| match CacheError::from(e) {
                        CacheError::Device(f) => PersistError::Device(f),
                        _ => corrupt,
                    })?;
                Ok(buf)
            }
        }
    }

    /// Writes one block's bytes `src` (little-endian elements of `esize` bytes, as a
    /// saved blob holds them) into `block`. O(bytes per block).
    ///
    /// # Errors
    /// [`CacheError::Device`] for a driver error; a block outside the arena is ignored
    /// on the CPU (not reachable: the core's blocks) and refused on a device.
    pub(crate) fn write_block_le(
        &mut self,
        layout: &KvLayout,
        block: u32,
        src: &[u8],
        esize: usize,
    ) -> Result<(), CacheError> {
        match self {
            Self::Cpu { arena, .. } => {
                let bpb = layout.geometry().bytes_per_block() as usize;
                let start = block as usize * bpb;
                let dst = arena.as_bytes_mut().get_mut(start..start + bpb);
                if let Some(dst) = dst.filter(|d| d.len() == src.len()) {
                    copy_elems_from_le(dst, src, esize);
                }
            }
            // Little-endian already: the device's layout.
            #[cfg(feature = "cuda")]
            Self::Cuda { kv, .. } => kv.write_block(block, src)?,
        }
        Ok(())
    }

    /// Writes f32 K/V of `layer` into `slots`, 8-bit rows at the fixed `scales` where
    /// given (the caller passes them for 8-bit storage only). O(tokens × kv_heads ×
    /// head_dim).
    ///
    /// # Errors
    /// The kernel's (lengths, layer, slots) or the device's; nothing is written.
    pub(crate) fn write_kv(
        &mut self,
        layout: &KvLayout,
        layer: u32,
        slots: &[u32],
        k: &[f32],
        v: &[f32],
        scales: Option<KvScales>,
    ) -> Result<(), CacheError> {
        match self {
            Self::Cpu { arena, .. } => for_dtype!(layout.geometry().dtype(), T => {
                let arena = arena.as_mut_slice::<T>();
                match scales {
                    None => kernels::write_kv(layout, arena, layer, slots, k, v),
                    Some(s) => kernels::write_kv_at_scales(layout, arena, layer, slots, k, v, s),
                }
            })?,
            #[cfg(feature = "cuda")]
            Self::Cuda { kv, .. } => {
                let fixed = scales.map(|s| [s.k(), s.v()]);
                kv.write_kv(layer, slots, k, v, fixed)?
            }
        }
        Ok(())
    }

    /// Writes K/V already in the storage dtype `T` (checked by the caller).
    /// O(tokens × kv_heads × head_dim).
    ///
    /// # Errors
    /// As [`Storage::write_kv`], and the kernels' refusal of 8-bit storage.
    pub(crate) fn write_kv_as<T: Element>(
        &mut self,
        layout: &KvLayout,
        layer: u32,
        slots: &[u32],
        k: &[T],
        v: &[T],
    ) -> Result<(), CacheError> {
        match self {
            Self::Cpu { arena, .. } => {
                kernels::write_kv_as(layout, arena.as_mut_slice::<T>(), layer, slots, k, v)?;
            }
            #[cfg(feature = "cuda")]
            Self::Cuda { kv, .. } => {
                // As the CPU kernel: codes carry no scale.
                if T::DTYPE.is_scaled() {
                    return Err(KernelError::ScaledStorage { dtype: T::DTYPE }.into());
                }
                // The device's layout is little-endian, as every host kvpage supports.
                let (k, v) = (crate::dtype::bytes_of(k), crate::dtype::bytes_of(v));
                kv.write_kv_stored(layer, slots, k, v)?;
            }
        }
        Ok(())
    }

    /// Copies whole blocks (copy-on-write, edits). O(copies × bytes per block).
    ///
    /// # Errors
    /// A block out of range (an internal bug: the core's copies are valid) or the
    /// device's errors; nothing is copied on a range error.
    pub(crate) fn copy_blocks(
        &mut self,
        layout: &KvLayout,
        copies: &[BlockCopy],
    ) -> Result<(), CacheError> {
        match self {
            Self::Cpu { arena, .. } => for_dtype!(layout.geometry().dtype(), T => {
                kernels::copy_blocks(layout, arena.as_mut_slice::<T>(), copies)
            })?,
            #[cfg(feature = "cuda")]
            Self::Cuda { kv, .. } => kv.copy_blocks(copies)?,
        }
        Ok(())
    }

    /// Rotates the keys of `shift` (a row of `table` whose blocks are `blocks`, checked
    /// by the caller: in range, this sequence's alone) by its delta under `rope`. On a
    /// device each block of the range is read into the host stage, rotated there by the
    /// CPU kernel (a rotation by `delta` does not depend on the token's position) and
    /// written back. See [`kernels::rotate_keys`] for the cost on the CPU.
    ///
    /// # Errors
    /// The kernel's (nothing written), the device's.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn rotate_keys(
        &mut self,
        layout: &KvLayout,
        (table, blocks): (BlockTable<'_>, &[u32]),
        shift: KeyShift,
        rope: RopeParams,
        pool: &WorkerPool,
    ) -> Result<(), CacheError> {
        match self {
            Self::Cpu { arena, .. } => for_dtype!(layout.geometry().dtype(), T => {
                let arena = arena.as_mut_slice::<T>();
                kernels::rotate_keys(layout, arena, table, &[shift], rope, Some(pool))
            })?,
            #[cfg(feature = "cuda")]
            Self::Cuda { kv, stage, .. } => {
                let bs = layout.geometry().block_size();
                let one = BlockTable {
                    table: &[0],
                    stride: 1,
                };
                let mut t = shift.first;
                while t < shift.end {
                    let i = t / bs;
                    let block = *blocks.get(i as usize).ok_or(KernelError::ContextTooLong {
                        context_len: shift.end,
                        capacity: blocks.len() as u64 * u64::from(bs),
                    })?;
                    let stop = ((i + 1) * bs).min(shift.end);
                    let local = KeyShift {
                        row: 0,
                        first: t - i * bs,
                        end: stop - i * bs,
                        delta: shift.delta,
                    };
                    stage.run(kv, &[block], 0, |l, a| {
                        for_dtype!(l.geometry().dtype(), T => {
                            kernels::rotate_keys(l, a.as_mut_slice::<T>(), one, &[local], rope, None)
                        })
                    })?;
                    t = stop;
                }
            }
        }
        Ok(())
    }

    /// Executes an edit's row moves, in order (after its block copies). On a device each
    /// move's blocks are read into the host stage, moved there by the CPU kernel and
    /// the destination block written back: O(moves × bytes per block) of copies, for
    /// edits, which are rare. O(moved rows × layers × kv_heads × head_dim) on the CPU.
    ///
    /// # Errors
    /// The kernel's for a move that leaves its block (an internal bug: the core's moves
    /// are valid), the device's; on the CPU nothing is moved on error.
    pub(crate) fn move_rows(
        &mut self,
        layout: &KvLayout,
        moves: &[kvpage_core::RowMove],
    ) -> Result<(), CacheError> {
        match self {
            Self::Cpu { arena, .. } => for_dtype!(layout.geometry().dtype(), T => {
                kernels::move_rows(layout, arena.as_mut_slice::<T>(), moves)
            })?,
            #[cfg(feature = "cuda")]
            Self::Cuda { kv, stage, .. } => {
                let bs = layout.geometry().block_size();
                for m in moves {
                    let pair = [m.src_slot / bs, m.dst_slot / bs];
                    // The destination is stage block 1 unless the move stays in one block.
                    let at = usize::from(pair[0] != pair[1]);
                    let local = kvpage_core::RowMove {
                        src_slot: m.src_slot % bs,
                        dst_slot: at as u32 * bs + m.dst_slot % bs,
                        count: m.count,
                    };
                    stage.run(kv, &pair[..=at], at, |l, a| {
                        for_dtype!(l.geometry().dtype(), T => {
                            kernels::move_rows(l, a.as_mut_slice::<T>(), &[local])
                        })
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Executes an engine step's swaps: `out` moves device blocks to the host tier,
    /// then `into` moves host blocks back. Nothing to do without a host tier (the
    /// core plans no swap then). O(moved blocks × bytes per block).
    ///
    /// # Errors
    /// A block out of range (an internal bug) or the device's errors.
    pub(crate) fn swap(
        &mut self,
        layout: &KvLayout,
        out: &[BlockCopy],
        into: &[BlockCopy],
    ) -> Result<(), CacheError> {
        match self {
            Self::Cpu { arena, host } => {
                let Some((host_layout, host_arena)) = host.as_mut() else {
                    return Ok(());
                };
                for_dtype!(layout.geometry().dtype(), T => {
                    let arena = arena.as_mut_slice::<T>();
                    let host_arena = host_arena.as_mut_slice::<T>();
                    kernels::copy_blocks_between(layout, arena, host_layout, host_arena, out)?;
                    kernels::copy_blocks_between(host_layout, host_arena, layout, arena, into)?;
                });
            }
            #[cfg(feature = "cuda")]
            Self::Cuda { kv, .. } => {
                if kv.host_blocks() > 0 {
                    kv.swap(Direction::Out, out)?;
                    kv.swap(Direction::In, into)?;
                }
            }
        }
        Ok(())
    }

    /// Attention of `layer` over `batch` through `table`. See
    /// [`kernels::paged_attention`] for the computation and cost.
    ///
    /// # Errors
    /// The kernel's or the device's; nothing is written.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention(
        &mut self,
        layout: &KvLayout,
        layer: u32,
        table: BlockTable<'_>,
        batch: &[SeqQuery],
        (q, out): (&[f32], &mut [f32]),
        (q_heads, scale): (u32, f32),
        pool: &WorkerPool,
    ) -> Result<(), CacheError> {
        match self {
            Self::Cpu { arena, .. } => {
                let params = AttentionParams {
                    q_heads,
                    scale,
                    pool: Some(pool),
                };
                for_dtype!(layout.geometry().dtype(), T => {
                    let arena = arena.as_slice::<T>();
                    kernels::paged_attention(layout, arena, layer, table, batch, q, out, params)
                })?;
            }
            #[cfg(feature = "cuda")]
            Self::Cuda { kv, .. } => {
                // The device copies the spans into its own descriptors.
                let spans = batch.iter().map(|s| SeqSpan {
                    row: s.row,
                    context_len: s.context_len,
                    queries: s.queries,
                });
                kv.attention(
                    layer,
                    (table.table, table.stride),
                    spans,
                    q,
                    out,
                    q_heads,
                    scale,
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_fault_names_its_call() {
        let e = CacheError::Device(DeviceFault::Driver {
            call: "cuDeviceGet",
            code: 0,
        });
        assert_eq!(
            e.to_string(),
            "CUDA backend: cuDeviceGet not called: an argument does not fit the driver's types"
        );
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn a_device_fault_keeps_the_call_and_is_shown_with_the_drivers_strings() {
        use kvpage_cuda::device::StepError;
        use kvpage_cuda::driver::{CallError, Code, DriverError};
        let call = |call, code| DriverError::Call(CallError::new(call, Code(code), None, None));
        // A kernel's bad access, reported by the next synchronisation.
        let e = CacheError::from(DeviceKvError::Driver(call("cuStreamSynchronize", 700)));
        assert_eq!(
            e,
            CacheError::Device(DeviceFault::Driver {
                call: "cuStreamSynchronize",
                code: 700
            })
        );
        // Named by the loaded driver (a GPU machine) or by cuda.h's table (here).
        let text = e.to_string();
        assert!(
            text.starts_with(
                "CUDA backend: cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS (700): "
            ),
            "{text}"
        );
        assert!(text.len() > 85, "{text}");
        // A code neither knows stays a number; the call is kept through StepError too.
        let e = CacheError::from(DeviceKvError::Step(StepError::Driver(call(
            "cuLaunchKernel",
            9999,
        ))));
        assert_eq!(
            e.to_string(),
            "CUDA backend: cuLaunchKernel failed: unknown CUresult 9999"
        );
        let e = CacheError::from(DeviceKvError::Driver(DriverError::BadArgument {
            call: "cuDeviceGet",
            what: "device ordinal over i32::MAX",
        }));
        assert_eq!(
            e,
            CacheError::Device(DeviceFault::Driver {
                call: "cuDeviceGet",
                code: 0
            })
        );
        let e = CacheError::from(DeviceKvError::Driver(DriverError::NotInstalled {
            library: "libcuda.so.1",
            reason: String::new(),
        }));
        assert_eq!(e, CacheError::Device(DeviceFault::NoDriver));
        // A block-table row past the device's table is the CPU kernels' error too.
        let e = CacheError::from(DeviceKvError::Launch(
            kvpage_cuda::launch::LaunchError::RowOutOfRange { row: 5, rows: 2 },
        ));
        assert_eq!(
            e,
            CacheError::Kernel(KernelError::RowOutOfRange { row: 5, rows: 2 })
        );
        // The display carries the process's own load failure, where there is one.
        let shown = DeviceFault::NoDriver.to_string();
        assert!(shown.starts_with("no usable NVIDIA driver"), "{shown}");
        if let Err(load) = kvpage_cuda::driver::Driver::get() {
            assert!(shown.ends_with(&load.to_string()), "{shown}");
        }
    }
}
