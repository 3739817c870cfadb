//! [`Module`]: the kernels' fatbin loaded into a context, and launches.

use std::ffi::{c_void, CString};
use std::sync::Arc;

pub use cust::memory::DeviceCopy;

use super::{Context, StreamRef};
use crate::driver::{CuFunction, CuModule, DriverError};

/// A loaded module, unloaded on drop (after its owner synchronised the streams that
/// run its kernels).
pub struct Module {
    ctx: Arc<Context>,
    raw: CuModule,
}

// SAFETY: a CUmodule is a driver handle usable from any thread.
unsafe impl Send for Module {}
// SAFETY: as above; looking functions up and launching are thread-safe in the driver.
unsafe impl Sync for Module {}

impl core::fmt::Debug for Module {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Module").finish_non_exhaustive()
    }
}

/// A kernel of a [`Module`], valid while the module lives (the borrow keeps it).
#[derive(Debug, Clone, Copy)]
pub struct Function<'m> {
    module: &'m Module,
    raw: CuFunction,
}

impl Module {
    /// Loads a fatbin (or cubin, or NUL-terminated PTX) image. O(image); a GPU newer
    /// than the image's SASS JITs its PTX now (once per process and image; the driver
    /// caches it on disk).
    ///
    /// # Errors
    /// `CUDA_ERROR_NO_BINARY_FOR_GPU` when neither SASS nor PTX fits the device,
    /// `CUDA_ERROR_INVALID_IMAGE`, and the driver's other errors.
    pub fn load(ctx: &Arc<Context>, image: &'static [u8]) -> Result<Self, DriverError> {
        if image.len() < 16 {
            return Err(DriverError::BadArgument {
                call: "cuModuleLoadData",
                what: "image shorter than a fatbin header",
            });
        }
        ctx.make_current()?;
        // SAFETY: a whole image (the build script's fatbin), alive for the program.
        let raw = unsafe { ctx.driver().module_load_data(image.as_ptr().cast()) }?;
        Ok(Self {
            ctx: Arc::clone(ctx),
            raw,
        })
    }

    /// The kernel `name` (an `extern "C"` symbol). O(symbols).
    ///
    /// # Errors
    /// `CUDA_ERROR_NOT_FOUND` for a name the module lacks; [`DriverError::BadArgument`]
    /// for a name with a NUL byte.
    pub fn function(&self, name: &str) -> Result<Function<'_>, DriverError> {
        let c = CString::new(name).map_err(|_| DriverError::BadArgument {
            call: "cuModuleGetFunction",
            what: "kernel name contains a NUL byte",
        })?;
        self.ctx.make_current()?;
        // SAFETY: the module is loaded while `self` lives.
        let raw = unsafe { self.ctx.driver().module_function(self.raw, &c) }?;
        Ok(Function { module: self, raw })
    }
}

impl Module {
    /// A function of this module from its raw handle (one [`Module::function`] gave).
    pub(crate) fn function_from_raw(&self, raw: CuFunction) -> Function<'_> {
        Function { module: self, raw }
    }
}

impl Function<'_> {
    /// The raw handle. O(1).
    pub fn raw(&self) -> CuFunction {
        self.raw
    }

    /// Queues the kernel on `stream` with grid `grid`, CTAs of `block` threads,
    /// `shared_bytes` of dynamic shared memory and its one parameter struct `params`,
    /// passed by value (the driver copies it at the launch).
    ///
    /// # Errors
    /// The driver's (`CUDA_ERROR_INVALID_VALUE` for a grid or block beyond the
    /// device's limits, `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`, ...).
    ///
    /// # Safety
    /// `P` is exactly the kernel's parameter type (same layout, as `params.h` and
    /// `params.rs` define it); every device address in `params` points at memory the
    /// kernel may read or write as the kernel's contract says, allocated until the
    /// kernel completes on `stream`; and the grid satisfies the kernel's launch
    /// contract (the launch planner's configs do).
    pub unsafe fn launch<P: DeviceCopy>(
        &self,
        stream: StreamRef<'_>,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        params: &P,
    ) -> Result<(), DriverError> {
        let ctx = &self.module.ctx;
        ctx.make_current()?;
        let mut args = [params as *const P as *mut c_void];
        // SAFETY: one parameter, pointed at for the duration of the call (the driver
        // copies it); the rest is the caller's contract.
        unsafe {
            ctx.driver().launch_kernel(
                self.raw,
                grid,
                block,
                shared_bytes,
                stream.raw(),
                args.as_mut_ptr(),
            )
        }
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.ctx.make_current().is_ok() {
            // SAFETY: loaded by `load`, unloaded once; `Function`s borrow `self`.
            let _ = unsafe { self.ctx.driver().module_unload(self.raw) };
        }
    }
}
