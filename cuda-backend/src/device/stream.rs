//! [`Stream`], [`StreamRef`] (an owned or a caller's stream, borrowed) and [`Event`].

use std::sync::Arc;

use super::{Context, DeviceMemory, PinnedMemory};
use crate::driver::{CuDevicePtr, CuEvent, CuStream, DriverError, EVENT_DEFAULT};

/// An owned non-blocking stream, destroyed on drop (work queued on it still completes).
pub struct Stream {
    ctx: Arc<Context>,
    raw: CuStream,
}

// SAFETY: a CUstream is a driver handle usable from any thread of the process.
unsafe impl Send for Stream {}
// SAFETY: as above; enqueueing from several threads is allowed by the driver.
unsafe impl Sync for Stream {}

impl core::fmt::Debug for Stream {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Stream").finish_non_exhaustive()
    }
}

impl Stream {
    /// Creates a non-blocking stream (no implicit ordering with the legacy default
    /// stream). O(1).
    ///
    /// # Errors
    /// The driver's.
    pub fn new(ctx: &Arc<Context>) -> Result<Self, DriverError> {
        ctx.make_current()?;
        let raw = ctx.driver().stream_create()?;
        Ok(Self {
            ctx: Arc::clone(ctx),
            raw,
        })
    }

    /// A borrowed view to queue work with. O(1).
    pub fn as_ref(&self) -> StreamRef<'_> {
        StreamRef {
            ctx: &self.ctx,
            raw: self.raw,
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.ctx.make_current().is_ok() {
            // SAFETY: created by `new`, destroyed once.
            let _ = unsafe { self.ctx.driver().stream_destroy(self.raw) };
        }
    }
}

/// A stream to queue work on: one of ours ([`Stream::as_ref`]) or the caller's own
/// ([`StreamRef::from_raw`]), so a caller can overlap its steps with its other work.
#[derive(Clone, Copy)]
pub struct StreamRef<'a> {
    ctx: &'a Context,
    raw: CuStream,
}

impl core::fmt::Debug for StreamRef<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("StreamRef").field("raw", &self.raw).finish()
    }
}

impl<'a> StreamRef<'a> {
    /// A caller's stream (`CUstream`, or the `cudaStream_t` of the runtime API, which
    /// is the same handle), or null for the legacy default stream. O(1).
    ///
    /// # Safety
    /// `raw` is a live stream of `ctx`'s context (or null) for `'a`.
    pub unsafe fn from_raw(ctx: &'a Context, raw: CuStream) -> Self {
        Self { ctx, raw }
    }

    /// The raw handle. O(1).
    pub fn raw(&self) -> CuStream {
        self.raw
    }

    /// The context. O(1).
    pub fn context(&self) -> &'a Context {
        self.ctx
    }

    /// Waits for everything queued so far (`cuStreamSynchronize`).
    ///
    /// # Errors
    /// The driver's, including a previous kernel's error (e.g.
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`).
    pub fn synchronize(&self) -> Result<(), DriverError> {
        self.ctx.make_current()?;
        // SAFETY: the stream is live for 'a.
        unsafe { self.ctx.driver().stream_synchronize(self.raw) }
    }

    /// Records `event` after the work queued so far.
    ///
    /// # Errors
    /// The driver's.
    pub fn record(&self, event: &Event) -> Result<(), DriverError> {
        self.ctx.make_current()?;
        // SAFETY: both are live.
        unsafe { self.ctx.driver().event_record(event.raw, self.raw) }
    }

    /// Makes work queued from now on wait for `event`'s last record (from any stream).
    ///
    /// # Errors
    /// The driver's.
    pub fn wait(&self, event: &Event) -> Result<(), DriverError> {
        self.ctx.make_current()?;
        // SAFETY: both are live.
        unsafe { self.ctx.driver().stream_wait_event(self.raw, event.raw) }
    }

    /// Queues a copy of `bytes` bytes from `src[src_offset..]` (pinned host memory) to
    /// device address `dst`.
    ///
    /// # Errors
    /// [`DriverError::BadArgument`] if the host range is outside `src`; the driver's.
    ///
    /// # Safety
    /// `dst..dst + bytes` is device memory that stays allocated until the copy is done;
    /// `src` is neither written nor dropped before then (record an event and wait).
    pub unsafe fn copy_to_device(
        &self,
        dst: CuDevicePtr,
        src: &PinnedMemory,
        src_offset: usize,
        bytes: usize,
    ) -> Result<(), DriverError> {
        let ok = src_offset
            .checked_add(bytes)
            .is_some_and(|e| e <= src.len());
        if !ok {
            return Err(DriverError::BadArgument {
                call: "cuMemcpyHtoDAsync",
                what: "host range outside the pinned buffer",
            });
        }
        self.ctx.make_current()?;
        // SAFETY: the host range is inside `src` (checked); the rest is the caller's.
        unsafe {
            let host = src.as_ptr().add(src_offset).cast();
            self.ctx
                .driver()
                .memcpy_htod_async(dst, host, bytes, self.raw)
        }
    }

    /// Queues a copy of `bytes` bytes from device address `src` into
    /// `dst[dst_offset..]` (pinned host memory).
    ///
    /// # Errors
    /// [`DriverError::BadArgument`] if the host range is outside `dst`; the driver's.
    ///
    /// # Safety
    /// `src..src + bytes` is device memory that stays allocated until the copy is done;
    /// `dst` is neither read, written nor dropped before then.
    pub unsafe fn copy_to_host(
        &self,
        dst: &mut PinnedMemory,
        dst_offset: usize,
        src: CuDevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError> {
        let ok = dst_offset
            .checked_add(bytes)
            .is_some_and(|e| e <= dst.len());
        if !ok {
            return Err(DriverError::BadArgument {
                call: "cuMemcpyDtoHAsync",
                what: "host range outside the pinned buffer",
            });
        }
        self.ctx.make_current()?;
        // SAFETY: the host range is inside `dst` (checked); the rest is the caller's.
        unsafe {
            let host = dst.as_mut_ptr().add(dst_offset).cast();
            self.ctx
                .driver()
                .memcpy_dtoh_async(host, src, bytes, self.raw)
        }
    }

    /// Copies `dst.len()` bytes from device address `src` into `dst` (ordinary, pageable
    /// host memory), after the work queued on this stream so far, and waits for the
    /// stream. For occasional reads (a block to save); steps use pinned buffers.
    /// O(bytes).
    ///
    /// # Errors
    /// The driver's (an earlier asynchronous error of the stream included).
    ///
    /// # Safety
    /// `src..src + dst.len()` is device memory of this context that stays allocated
    /// until the call returns.
    pub unsafe fn read_to_host(&self, dst: &mut [u8], src: CuDevicePtr) -> Result<(), DriverError> {
        self.ctx.make_current()?;
        // SAFETY: `dst` is writable for its length and outlives the copy (waited for
        // below, before the borrow ends); the device range is the caller's.
        unsafe {
            self.ctx
                .driver()
                .memcpy_dtoh_async(dst.as_mut_ptr().cast(), src, dst.len(), self.raw)
        }?;
        self.synchronize()
    }

    /// Queues a device-to-device copy of `bytes` bytes.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// Both ranges are device memory of this context, allocated until the copy is done.
    pub unsafe fn copy_device(
        &self,
        dst: CuDevicePtr,
        src: CuDevicePtr,
        bytes: usize,
    ) -> Result<(), DriverError> {
        self.ctx.make_current()?;
        // SAFETY: the caller's contract.
        unsafe {
            self.ctx
                .driver()
                .memcpy_dtod_async(dst, src, bytes, self.raw)
        }
    }

    /// Queues filling all of `mem` with `value`.
    ///
    /// # Errors
    /// The driver's.
    pub fn fill(&self, mem: &DeviceMemory, value: u8) -> Result<(), DriverError> {
        self.ctx.make_current()?;
        // SAFETY: the whole allocation, which `&mem` keeps alive now; the memset is
        // ordered before any later free through the owner's synchronisation.
        unsafe {
            self.ctx
                .driver()
                .memset_d8_async(mem.ptr(), value, mem.len(), self.raw)
        }
    }
}

/// An event (with timing), destroyed on drop.
pub struct Event {
    ctx: Arc<Context>,
    raw: CuEvent,
}

// SAFETY: a CUevent is a driver handle usable from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl core::fmt::Debug for Event {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Event").finish_non_exhaustive()
    }
}

impl Event {
    /// Creates an event with timing enabled. O(1).
    ///
    /// # Errors
    /// The driver's.
    pub fn new(ctx: &Arc<Context>) -> Result<Self, DriverError> {
        ctx.make_current()?;
        let raw = ctx.driver().event_create(EVENT_DEFAULT)?;
        Ok(Self {
            ctx: Arc::clone(ctx),
            raw,
        })
    }

    /// Waits until the work before its last record is done (at once if never recorded).
    ///
    /// # Errors
    /// The driver's, including an asynchronous error of that work.
    pub fn synchronize(&self) -> Result<(), DriverError> {
        self.ctx.make_current()?;
        // SAFETY: live.
        unsafe { self.ctx.driver().event_synchronize(self.raw) }
    }

    /// Whether the work before its last record is done, without waiting.
    ///
    /// # Errors
    /// The driver's.
    pub fn is_done(&self) -> Result<bool, DriverError> {
        self.ctx.make_current()?;
        // SAFETY: live.
        unsafe { self.ctx.driver().event_query(self.raw) }
    }

    /// Milliseconds from `start`'s last record to this one's (both complete).
    ///
    /// # Errors
    /// The driver's (`CUDA_ERROR_NOT_READY` when one is still pending).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32, DriverError> {
        self.ctx.make_current()?;
        // SAFETY: both live, created with timing.
        unsafe { self.ctx.driver().event_elapsed_ms(start.raw, self.raw) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.ctx.make_current().is_ok() {
            // SAFETY: created by `new`, destroyed once.
            let _ = unsafe { self.ctx.driver().event_destroy(self.raw) };
        }
    }
}
