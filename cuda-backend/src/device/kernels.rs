//! [`Kernels`]: the fatbin's module with every kernel of [`crate::launch::Kernel`]
//! ([`Kernel::nth`]) looked up once, launched from the launch planner's configs.

use std::sync::Arc;

use super::{Context, DeviceCopy, Module, StreamRef};
use crate::driver::{CuFunction, DriverError};
use crate::fatbin::{self, NotBuilt};
use crate::launch::{Kernel, LaunchConfig};
use crate::params::{KvpAttentionParams, KvpCopyParams, KvpWriteParams};

// SAFETY: `#[repr(C)]` plain data (integers, floats, device addresses as u64) with
// explicit padding, mirroring params.h: valid to copy to the device bit for bit.
unsafe impl DeviceCopy for KvpWriteParams {}
// SAFETY: as above.
unsafe impl DeviceCopy for KvpCopyParams {}
// SAFETY: as above.
unsafe impl DeviceCopy for KvpAttentionParams {}

/// Why the kernels could not be loaded.
#[derive(Debug, Clone, PartialEq)]
pub enum KernelsError {
    /// The build found no `nvcc`: there is no fatbin.
    NotBuilt(NotBuilt),
    /// The driver refused the module or a kernel (e.g. `CUDA_ERROR_NO_BINARY_FOR_GPU`
    /// on a GPU older than sm_80).
    Driver(DriverError),
}

impl core::fmt::Display for KernelsError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NotBuilt(e) => e.fmt(f),
            Self::Driver(e) => write!(f, "loading the kernels: {e}"),
        }
    }
}

impl std::error::Error for KernelsError {}

/// The loaded kernels.
pub struct Kernels {
    module: Module,
    /// One function per kernel, in [`Kernel::nth`] order.
    functions: [CuFunction; Kernel::COUNT],
}

// SAFETY: CUfunction handles are driver objects usable from any thread.
unsafe impl Send for Kernels {}
// SAFETY: as above; launching is thread-safe in the driver.
unsafe impl Sync for Kernels {}

impl core::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Kernels").finish_non_exhaustive()
    }
}

impl Kernels {
    /// Loads the embedded fatbin into `ctx` and looks every kernel up. O(image).
    ///
    /// # Errors
    /// [`KernelsError::NotBuilt`] without a fatbin (checked first, before any driver
    /// call); the driver's errors.
    pub fn load(ctx: &Arc<Context>) -> Result<Self, KernelsError> {
        let image = fatbin::image().map_err(KernelsError::NotBuilt)?;
        let module = Module::load(ctx, image).map_err(KernelsError::Driver)?;
        let mut functions = [core::ptr::null_mut(); Kernel::COUNT];
        for (i, f) in functions.iter_mut().enumerate() {
            if let Some(k) = Kernel::nth(i) {
                *f = module
                    .function(k.name())
                    .map_err(KernelsError::Driver)?
                    .raw();
            }
        }
        Ok(Self { module, functions })
    }

    /// Queues `config`'s kernel with `params` on `stream`.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// `P` is the kernel's parameter struct (`KvpWriteParams` for `WriteKv`,
    /// `KvpCopyParams` for `CopyBlocks`, `KvpAttentionParams` for the others), `config`
    /// comes from the launch planner for these parameters, and every buffer they point
    /// at is allocated, of the planned size, until the kernel completes on `stream`.
    pub unsafe fn launch<P: DeviceCopy>(
        &self,
        stream: StreamRef<'_>,
        config: &LaunchConfig,
        params: &P,
    ) -> Result<(), DriverError> {
        // Every kernel is one of the `Kernel::COUNT` (O(COUNT) compares, no allocation).
        let i = (0..Kernel::COUNT)
            .find(|&i| Kernel::nth(i) == Some(config.kernel))
            .ok_or(DriverError::BadArgument {
                call: "cuLaunchKernel",
                what: "kernel not in the module",
            })?;
        let f = self.module.function_from_raw(self.functions[i]);
        // SAFETY: the caller's contract.
        unsafe {
            f.launch(
                stream,
                config.grid,
                config.block,
                config.shared_bytes,
                params,
            )
        }
    }
}
