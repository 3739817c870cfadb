//! [`Context`]: the primary context of one device.

use std::sync::Arc;

use crate::driver::{
    CuContext, CuDevice, Driver, DriverError, ATTR_COMPUTE_CAPABILITY_MAJOR,
    ATTR_COMPUTE_CAPABILITY_MINOR, ATTR_MULTIPROCESSOR_COUNT,
};

/// What kvpage reads about a device once, at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's ordinal.
    pub ordinal: u32,
    /// Its name (`cuDeviceGetName`), e.g. `"NVIDIA H100 80GB HBM3"`.
    pub name: String,
    /// Streaming multiprocessors (sizes the attention partitions).
    pub sm_count: u32,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (u32, u32),
}

/// The retained primary context of one device, shared (`Arc`) by every resource made
/// in it; released when the last one is dropped.
///
/// `Send + Sync`: the driver's contexts may be made current on any thread, and every
/// method makes this one current on the calling thread first.
pub struct Context {
    driver: &'static Driver,
    device: CuDevice,
    raw: CuContext,
    info: DeviceInfo,
}

// SAFETY: a CUDA context is a process-wide driver object; binding it to several
// threads at once is allowed (each thread's current context is thread-local state).
unsafe impl Send for Context {}
// SAFETY: as above; `Context` has no interior mutability of its own.
unsafe impl Sync for Context {}

impl core::fmt::Debug for Context {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Context").field("info", &self.info).finish()
    }
}

impl Context {
    /// Loads the driver (once per process), retains the primary context of device
    /// `ordinal`, makes it current on this thread and reads the device's info.
    /// O(1) driver calls (the first retain creates the context: tens of ms).
    ///
    /// # Errors
    /// [`DriverError::NotInstalled`] without a driver, and the driver's errors (e.g.
    /// `CUDA_ERROR_NO_DEVICE`, `CUDA_ERROR_INVALID_DEVICE` for an ordinal past the
    /// device count).
    pub fn new(ordinal: u32) -> Result<Arc<Self>, DriverError> {
        let driver = Driver::get()?;
        let device = driver.device(ordinal)?;
        let raw = driver.primary_context_retain(device)?;
        // From here on, `ctx`'s drop releases the retain on any error.
        let mut ctx = Self {
            driver,
            device,
            raw,
            info: DeviceInfo {
                ordinal,
                name: String::new(),
                sm_count: 0,
                compute_capability: (0, 0),
            },
        };
        ctx.make_current()?;
        let attr = |a| {
            driver
                .attribute(device, a)
                .map(|v| u32::try_from(v).unwrap_or(0))
        };
        ctx.info = DeviceInfo {
            ordinal,
            name: driver.device_name(device)?,
            sm_count: attr(ATTR_MULTIPROCESSOR_COUNT)?,
            compute_capability: (
                attr(ATTR_COMPUTE_CAPABILITY_MAJOR)?,
                attr(ATTR_COMPUTE_CAPABILITY_MINOR)?,
            ),
        };
        Ok(Arc::new(ctx))
    }

    /// Binds the context to the calling thread (`cuCtxSetCurrent`). O(1).
    ///
    /// # Errors
    /// The driver's.
    pub fn make_current(&self) -> Result<(), DriverError> {
        // SAFETY: `raw` is retained until `self` is dropped.
        unsafe { self.driver.set_current(self.raw) }
    }

    /// The driver. O(1).
    pub fn driver(&self) -> &'static Driver {
        self.driver
    }

    /// The device's info. O(1).
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// `(free, total)` bytes of device memory now (`cuMemGetInfo`). O(1).
    ///
    /// # Errors
    /// The driver's.
    pub fn mem_info(&self) -> Result<(u64, u64), DriverError> {
        self.make_current()?;
        self.driver.mem_info()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain of `new`; every resource of the context holds an
        // `Arc` of it, so none is alive now.
        let _ = unsafe { self.driver.primary_context_release(self.device) };
    }
}
