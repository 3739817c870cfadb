//! [`HostTier`]: the pinned host arena and a second stream that executes the core's
//! swap plans, ordered against the compute stream by events.
//!
//! Swap-out: the copy stream waits for the compute work queued so far (the blocks'
//! last writes), copies device → host, and the compute stream waits for the copies
//! before anything may reuse the freed device blocks. Swap-in: the copy stream waits
//! for the compute work so far (the destination blocks' last readers), copies host →
//! device, and the compute stream waits before attention reads them. The host never
//! waits; copies overlap with unrelated compute work queued before them.

use std::sync::Arc;

use kvpage_core::BlockCopy;

use super::{Context, DeviceMemory, Event, PinnedMemory, Stream, StreamRef};
use crate::driver::DriverError;
use crate::swap::block_runs;

/// Why a swap was refused or failed.
#[derive(Debug, Clone, PartialEq)]
pub enum SwapError {
    /// A block's range lies outside its arena. Nothing was queued.
    OutOfArena {
        /// The block.
        block: u32,
    },
    /// The driver failed (copies before the failing one may be queued).
    Driver(DriverError),
}

impl core::fmt::Display for SwapError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::OutOfArena { block } => write!(f, "block {block} is outside its arena"),
            Self::Driver(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for SwapError {}

impl From<DriverError> for SwapError {
    fn from(e: DriverError) -> Self {
        Self::Driver(e)
    }
}

/// Direction of a swap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Device → host (`src` device block, `dst` host block).
    Out,
    /// Host → device (`src` host block, `dst` device block).
    In,
}

/// The host tier of a device cache.
pub struct HostTier {
    arena: PinnedMemory,
    bytes_per_block: u64,
    stream: Stream,
    /// Compute work before the swap.
    before: Event,
    /// The swap's copies.
    done: Event,
}

impl core::fmt::Debug for HostTier {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("HostTier")
            .field("bytes", &self.arena.len())
            .finish_non_exhaustive()
    }
}

impl HostTier {
    /// Allocates a pinned host arena of `blocks` blocks of `bytes_per_block` bytes and
    /// the copy stream. O(arena bytes) (pinned and zeroed now).
    ///
    /// # Errors
    /// [`SwapError::OutOfArena`] (block 0) if the size overflows; the driver's.
    pub fn new(ctx: &Arc<Context>, blocks: u32, bytes_per_block: u64) -> Result<Self, SwapError> {
        let bytes = u64::from(blocks)
            .checked_mul(bytes_per_block)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or(SwapError::OutOfArena { block: blocks })?;
        Ok(Self {
            arena: PinnedMemory::new(ctx, bytes)?,
            bytes_per_block,
            stream: Stream::new(ctx)?,
            before: Event::new(ctx)?,
            done: Event::new(ctx)?,
        })
    }

    /// Blocks the host arena holds. O(1).
    pub fn blocks(&self) -> u32 {
        u32::try_from(self.arena.len() as u64 / self.bytes_per_block.max(1)).unwrap_or(u32::MAX)
    }

    /// The host arena (read it only when no swap is in flight: after
    /// [`HostTier::synchronize`]). O(1).
    pub fn arena(&self) -> &PinnedMemory {
        &self.arena
    }

    /// Queues `copies` in `direction` between `device` (the device arena) and the host
    /// arena, ordered after the work queued on `compute` so far, and makes `compute`
    /// wait for them. Consecutive blocks are copied as one range. Returns the number
    /// of range copies. O(copies).
    ///
    /// # Errors
    /// [`SwapError::OutOfArena`] if a block lies outside its arena (checked for every
    /// copy before any is queued); the driver's.
    pub fn swap(
        &mut self,
        direction: Direction,
        device: &DeviceMemory,
        compute: StreamRef<'_>,
        copies: &[BlockCopy],
    ) -> Result<usize, SwapError> {
        let bpb = self.bytes_per_block;
        let (dev_blocks, host_blocks) = (
            device.len() as u64 / bpb.max(1),
            self.arena.len() as u64 / bpb.max(1),
        );
        for c in copies {
            let (d, h) = match direction {
                Direction::Out => (c.src, c.dst),
                Direction::In => (c.dst, c.src),
            };
            if u64::from(d) >= dev_blocks {
                return Err(SwapError::OutOfArena { block: d });
            }
            if u64::from(h) >= host_blocks {
                return Err(SwapError::OutOfArena { block: h });
            }
        }
        if copies.is_empty() {
            return Ok(0);
        }
        compute.record(&self.before)?;
        let copy = self.stream.as_ref();
        copy.wait(&self.before)?;
        let mut n = 0;
        for run in block_runs(copies) {
            // In range (checked above: every block of every run is in its arena).
            let (src, dst, bytes) = run
                .byte_range(bpb)
                .ok_or(SwapError::OutOfArena { block: run.src })?;
            let bytes = bytes as usize;
            match direction {
                Direction::Out => {
                    let from = device.ptr() + src;
                    // SAFETY: both ranges are inside their arenas (checked); the host
                    // arena is read by the host only after `synchronize`, and both
                    // outlive the copy (the cache's drop synchronises).
                    unsafe { copy.copy_to_host(&mut self.arena, dst as usize, from, bytes) }?;
                }
                Direction::In => {
                    let to = device.ptr() + dst;
                    // SAFETY: as above.
                    unsafe { copy.copy_to_device(to, &self.arena, src as usize, bytes) }?;
                }
            }
            n += 1;
        }
        copy.record(&self.done)?;
        compute.wait(&self.done)?;
        Ok(n)
    }

    /// Waits for every queued swap. O(1) host work.
    ///
    /// # Errors
    /// The driver's.
    pub fn synchronize(&self) -> Result<(), DriverError> {
        self.stream.as_ref().synchronize()
    }
}

impl Drop for HostTier {
    fn drop(&mut self) {
        let _ = self.synchronize();
    }
}
