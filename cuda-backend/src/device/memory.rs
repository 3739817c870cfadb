//! Owned allocations: [`DeviceMemory`] (`cuMemAlloc`) and [`PinnedMemory`]
//! (`cuMemHostAlloc`, page-locked host memory the GPU copies from and to
//! asynchronously).

use std::sync::Arc;

use super::Context;
use crate::driver::{CuDevicePtr, DriverError};

/// One device allocation of a fixed size, freed on drop.
///
/// Whoever queues work touching it must make sure that work completes before the drop
/// (the device cache synchronises its streams in its own drop).
pub struct DeviceMemory {
    ctx: Arc<Context>,
    ptr: CuDevicePtr,
    bytes: usize,
}

impl core::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl DeviceMemory {
    /// Allocates `bytes` (at least 1; 0 is rounded up) of device memory. Its contents are
    /// undefined. O(1) on the host.
    ///
    /// # Errors
    /// `CUDA_ERROR_OUT_OF_MEMORY` and the driver's other errors.
    pub fn new(ctx: &Arc<Context>, bytes: usize) -> Result<Self, DriverError> {
        ctx.make_current()?;
        let ptr = ctx.driver().mem_alloc(bytes.max(1))?;
        Ok(Self {
            ctx: Arc::clone(ctx),
            ptr,
            bytes,
        })
    }

    /// The device address of the first byte. O(1).
    pub fn ptr(&self) -> CuDevicePtr {
        self.ptr
    }

    /// Size in bytes. O(1).
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the size is 0. O(1).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The device address `offset` bytes in, if `offset + bytes` stays inside. O(1).
    pub fn range(&self, offset: usize, bytes: usize) -> Option<CuDevicePtr> {
        (offset.checked_add(bytes)? <= self.bytes).then(|| self.ptr + offset as u64)
    }

    /// The context it lives in. O(1).
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.ctx.make_current().is_ok() {
            // SAFETY: allocated by `new` in this context, freed once; the owner made
            // sure no queued work uses it (type docs).
            let _ = unsafe { self.ctx.driver().mem_free(self.ptr) };
        }
    }
}

/// Page-locked host memory of a fixed size, zeroed at allocation, freed on drop: the
/// staging buffer of the step metadata and the host tier's arena.
pub struct PinnedMemory {
    ctx: Arc<Context>,
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: plain host memory owned by this value; the pointer is not shared elsewhere.
unsafe impl Send for PinnedMemory {}
// SAFETY: `&PinnedMemory` only reads (`as_slice`); writes need `&mut`.
unsafe impl Sync for PinnedMemory {}

impl core::fmt::Debug for PinnedMemory {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PinnedMemory")
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl PinnedMemory {
    /// Allocates and zeroes `bytes` (at least 1; 0 is rounded up) of pinned host memory.
    /// O(bytes) (the pages are locked and zeroed now, never later).
    ///
    /// # Errors
    /// The driver's (`CUDA_ERROR_OUT_OF_MEMORY` when the OS refuses to lock so much).
    pub fn new(ctx: &Arc<Context>, bytes: usize) -> Result<Self, DriverError> {
        ctx.make_current()?;
        let ptr = ctx.driver().mem_host_alloc(bytes.max(1))?.cast::<u8>();
        // SAFETY: `bytes.max(1)` bytes were just allocated at `ptr`.
        unsafe { ptr.write_bytes(0, bytes.max(1)) };
        Ok(Self {
            ctx: Arc::clone(ctx),
            ptr,
            bytes,
        })
    }

    /// The bytes. O(1).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `bytes` initialised bytes owned by `self`.
        unsafe { core::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    /// The bytes, mutable. The caller must not write bytes that a queued copy still
    /// reads (wait for its event first). O(1).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the view unique.
        unsafe { core::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }

    /// The host address, for asynchronous copies. O(1).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The host address, mutable, for asynchronous copies into it. O(1).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// Size in bytes. O(1).
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the size is 0. O(1).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        if self.ctx.make_current().is_ok() {
            // SAFETY: allocated by `new`, freed once; no copy uses it (owner's duty).
            let _ = unsafe { self.ctx.driver().mem_free_host(self.ptr.cast()) };
        }
    }
}
