//! [`StepBuffers`]: the per-step metadata (sequence descriptors, slot mapping, copy
//! pairs, block table) in one device buffer and its pinned staging twin, both allocated
//! once at their maximum size ([`MetadataLayout`]), so a step allocates nothing on the
//! device or the host; uploads planned by [`crate::upload`].
//!
//! Protocol of a step: [`StepBuffers::begin`] (waits until the previous upload has
//! read the staging buffer), `stage_*`, [`StepBuffers::upload`] on the step's stream
//! (which first waits for the previous step's work on the buffer, whatever stream it
//! ran on), launches that read the device buffer, [`StepBuffers::end`] on the same
//! stream.

use std::sync::Arc;

use super::{Context, DeviceMemory, Event, PinnedMemory, StreamRef};
use crate::driver::{CuDevicePtr, DriverError};
use crate::params::KvpSeqDesc;
use crate::sizing::{MetadataLayout, Section, SizingError, StepLimits};
use crate::upload::{stage_block_table, RowChange, RowUse, StageError, UploadPlan};

/// Gaps up to this many bytes between changed ranges are copied rather than split
/// into another copy (an extra `cuMemcpyHtoDAsync` costs a few µs, as much as
/// ~64 KiB over PCIe).
pub const MERGE_GAP_BYTES: usize = 64 << 10;

/// Most copies one upload makes (further ranges widen the last one).
pub const MAX_UPLOAD_COPIES: usize = 16;

/// Why a step's metadata could not be staged or uploaded.
#[derive(Debug, Clone, PartialEq)]
pub enum StepError {
    /// More entries than the buffers were sized for.
    TooLarge {
        /// Which section (`"seqs"`, `"slots"`, `"pairs"`).
        section: &'static str,
        /// Entries given.
        entries: usize,
        /// Entries it holds.
        capacity: usize,
    },
    /// The limits are zero or their buffers overflow.
    Sizing(SizingError),
    /// A block-table row outside the table.
    Stage(StageError),
    /// The driver failed.
    Driver(DriverError),
}

impl core::fmt::Display for StepError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::TooLarge {
                section,
                entries,
                capacity,
            } => write!(f, "{entries} {section} in one step, at most {capacity}"),
            Self::Sizing(e) => e.fmt(f),
            Self::Stage(e) => e.fmt(f),
            Self::Driver(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for StepError {}

impl From<DriverError> for StepError {
    fn from(e: DriverError) -> Self {
        Self::Driver(e)
    }
}

impl From<StageError> for StepError {
    fn from(e: StageError) -> Self {
        Self::Stage(e)
    }
}

/// The metadata buffers of one cache. See the module docs for the protocol.
pub struct StepBuffers {
    layout: MetadataLayout,
    limits: StepLimits,
    device: DeviceMemory,
    staging: PinnedMemory,
    plan: UploadPlan,
    changed: Vec<RowChange>,
    /// Recorded after the last upload: the staging buffer may be written once done.
    uploaded: Event,
    /// Recorded after the last step's launches: the device buffer may be overwritten
    /// once done.
    used: Event,
}

impl core::fmt::Debug for StepBuffers {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("StepBuffers")
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

/// Writes `values` as little-endian `u32` into `bytes` (as long as `4 × values`).
fn put_u32s(bytes: &mut [u8], values: impl IntoIterator<Item = u32>) {
    for (dst, v) in bytes.chunks_exact_mut(4).zip(values) {
        dst.copy_from_slice(&v.to_le_bytes());
    }
}

impl StepBuffers {
    /// Allocates the device buffer and the pinned staging buffer for `limits`, zeroed
    /// (the device table's zero rows match the staging mirror). O(metadata bytes).
    ///
    /// # Errors
    /// [`StepError::Sizing`] for bad limits, the driver's errors.
    pub fn new(ctx: &Arc<Context>, limits: StepLimits) -> Result<Self, StepError> {
        let layout = MetadataLayout::new(limits).map_err(StepError::Sizing)?;
        let device = DeviceMemory::new(ctx, layout.bytes)?;
        let staging = PinnedMemory::new(ctx, layout.bytes)?;
        let uploaded = Event::new(ctx)?;
        let used = Event::new(ctx)?;
        let mut changed = Vec::new();
        changed.resize(limits.batch_seqs as usize, RowChange::default());
        let this = Self {
            layout,
            limits,
            device,
            staging,
            plan: UploadPlan::new(MAX_UPLOAD_COPIES, MERGE_GAP_BYTES),
            changed,
            uploaded,
            used,
        };
        // Zero the device buffer so it equals the (zeroed) staging mirror.
        ctx.make_current()?;
        // SAFETY: the legacy default stream of a current context (null handle).
        let stream = unsafe { StreamRef::from_raw(ctx, core::ptr::null_mut()) };
        stream.fill(&this.device, 0)?;
        stream.synchronize()?;
        Ok(this)
    }

    /// The layout of both buffers. O(1).
    pub fn layout(&self) -> &MetadataLayout {
        &self.layout
    }

    /// Device address of a section. O(1).
    pub fn device_ptr(&self, section: Section) -> CuDevicePtr {
        self.device.ptr() + section.offset as u64
    }

    /// The limits the buffers were sized for. O(1).
    pub fn limits(&self) -> &StepLimits {
        &self.limits
    }

    /// Waits until the previous upload has read the staging buffer. O(1) when it has.
    ///
    /// # Errors
    /// The driver's (an earlier asynchronous error included).
    pub fn begin(&mut self) -> Result<(), StepError> {
        self.uploaded.synchronize()?;
        Ok(())
    }

    /// Stages the sequence descriptors of an attention launch for upload. O(seqs).
    ///
    /// # Errors
    /// [`StepError::TooLarge`] beyond the batch limit; nothing staged.
    pub fn stage_seqs(&mut self, seqs: &[KvpSeqDesc]) -> Result<(), StepError> {
        let s = self.layout.seqs;
        self.check("seqs", seqs.len(), self.limits.batch_seqs)?;
        let bytes = seqs.len() * 16;
        put_u32s(
            &mut self.staging.as_mut_slice()[s.offset..s.offset + bytes],
            seqs.iter()
                .flat_map(|d| [d.row, d.context_len, d.queries, d.q_start]),
        );
        self.plan.add(s.offset, bytes);
        Ok(())
    }

    /// Stages a slot mapping. O(slots).
    ///
    /// # Errors
    /// [`StepError::TooLarge`] beyond the step's token limit; nothing staged.
    pub fn stage_slots(&mut self, slots: &[u32]) -> Result<(), StepError> {
        let s = self.layout.slots;
        self.check("slots", slots.len(), self.limits.step_tokens)?;
        let bytes = slots.len() * 4;
        put_u32s(
            &mut self.staging.as_mut_slice()[s.offset..s.offset + bytes],
            slots.iter().copied(),
        );
        self.plan.add(s.offset, bytes);
        Ok(())
    }

    /// Stages copy pairs `(src, dst)`. O(pairs).
    ///
    /// # Errors
    /// [`StepError::TooLarge`] beyond the copy limit; nothing staged.
    pub fn stage_pairs(&mut self, pairs: &[kvpage_core::BlockCopy]) -> Result<(), StepError> {
        let s = self.layout.pairs;
        self.check("pairs", pairs.len(), self.limits.copy_pairs)?;
        let bytes = pairs.len() * 8;
        put_u32s(
            &mut self.staging.as_mut_slice()[s.offset..s.offset + bytes],
            pairs.iter().flat_map(|c| [c.src, c.dst]),
        );
        self.plan.add(s.offset, bytes);
        Ok(())
    }

    /// Stages the entries of `rows` of the core's block `table` (rows of `stride`) that
    /// differ from what the device holds. Returns how many rows changed.
    /// O(Σ blocks of the rows).
    ///
    /// # Errors
    /// [`StepError::Stage`] for a row outside the table (nothing staged),
    /// [`StepError::TooLarge`] for more rows than the batch limit.
    pub fn stage_block_table(
        &mut self,
        table: &[u32],
        stride: usize,
        rows: &[RowUse],
    ) -> Result<usize, StepError> {
        self.check("rows", rows.len(), self.limits.batch_seqs)?;
        let s = self.layout.block_table;
        let entries = table.len();
        if stride != self.limits.row_blocks as usize || entries * 4 != s.bytes {
            return Err(StageError::OutOfTable { row: 0, blocks: 0 }.into());
        }
        let staged_bytes = &mut self.staging.as_mut_slice()[s.offset..s.end()];
        // The staging buffer is 256-byte aligned (pinned allocations are page aligned,
        // sections 256-byte aligned): a valid `[u32]` view.
        let (head, staged, tail) = {
            // SAFETY: every bit pattern is a valid u32; align_to_mut splits off any
            // misaligned ends (none here).
            unsafe { staged_bytes.align_to_mut::<u32>() }
        };
        if !head.is_empty() || !tail.is_empty() {
            return Err(StageError::OutOfTable { row: 0, blocks: 0 }.into());
        }
        let n = stage_block_table(
            staged,
            table,
            stride,
            rows,
            s.offset,
            &mut self.changed,
            &mut self.plan,
        )?;
        Ok(n)
    }

    /// Uploads everything staged since [`StepBuffers::begin`] on `stream`, after the
    /// previous step's work on the buffers (any stream). Returns the number of copies.
    /// O(copies).
    ///
    /// # Errors
    /// The driver's.
    pub fn upload(&mut self, stream: StreamRef<'_>) -> Result<usize, StepError> {
        stream.wait(&self.used)?;
        let n = self.plan.ranges().len();
        for r in self.plan.ranges() {
            let dst = self.device.ptr() + r.offset as u64;
            // SAFETY: the range lies inside both buffers (same layout); the staging
            // buffer is not written before `uploaded` completes (`begin` waits), and
            // the device buffer lives as long as `self`, whose drop synchronises.
            unsafe { stream.copy_to_device(dst, &self.staging, r.offset, r.bytes) }?;
        }
        stream.record(&self.uploaded)?;
        self.plan.clear();
        Ok(n)
    }

    /// Marks the end of the step's work on `stream`: the next upload waits for it.
    ///
    /// # Errors
    /// The driver's.
    pub fn end(&mut self, stream: StreamRef<'_>) -> Result<(), StepError> {
        stream.record(&self.used)?;
        Ok(())
    }

    /// Makes work queued on `stream` from now on wait (on the device) for the end of the
    /// last step's work, whatever stream it ran on: for work that uses no metadata but
    /// must follow the step (a swap). O(1).
    ///
    /// # Errors
    /// The driver's.
    pub fn after_last_step(&self, stream: StreamRef<'_>) -> Result<(), StepError> {
        stream.wait(&self.used)?;
        Ok(())
    }

    /// Waits for all work on the buffers. O(1) host work.
    ///
    /// # Errors
    /// The driver's.
    pub fn synchronize(&self) -> Result<(), StepError> {
        self.uploaded.synchronize()?;
        self.used.synchronize()?;
        Ok(())
    }

    fn check(&self, section: &'static str, entries: usize, capacity: u32) -> Result<(), StepError> {
        if entries > capacity as usize {
            return Err(StepError::TooLarge {
                section,
                entries,
                capacity: capacity as usize,
            });
        }
        Ok(())
    }
}

impl Drop for StepBuffers {
    fn drop(&mut self) {
        // Queued copies and kernels may still read the buffers.
        let _ = self.synchronize();
    }
}
