//! The driver entry points kvpage calls, declared here (not through `cust`'s bindings)
//! with a plain `i32` result, and loaded at run time from the driver library.
//!
//! Loading at run time (instead of linking `libcuda`) lets a program built with the
//! `cuda` feature start on a machine without an NVIDIA driver: [`Driver::get`] then
//! returns [`DriverError::NotInstalled`]. The library is loaded once per process and
//! never unloaded, so the function pointers stay valid for the program's lifetime.
//!
//! Each entry point is looked up under its current versioned symbol first (the name
//! `cuda.h` of CUDA 13 maps the plain name to, e.g. `cuMemAlloc_v2`), then under older
//! names where the ABI is the same.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use super::code::Code;
use super::error::{CallError, DriverError};

/// `CUdevice`.
pub type CuDevice = c_int;
/// `CUdeviceptr`: a device address.
pub type CuDevicePtr = u64;
/// `CUcontext`.
pub type CuContext = *mut c_void;
/// `CUmodule`.
pub type CuModule = *mut c_void;
/// `CUfunction`.
pub type CuFunction = *mut c_void;
/// `CUstream`.
pub type CuStream = *mut c_void;
/// `CUevent`.
pub type CuEvent = *mut c_void;

/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
pub const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`.
pub const ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR`.
pub const ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;
/// `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`.
pub const ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: c_int = 97;
/// `CU_STREAM_NON_BLOCKING`: no implicit synchronisation with the legacy default stream.
pub const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_DEFAULT` (timing enabled).
pub const EVENT_DEFAULT: c_uint = 0;
/// `CU_EVENT_DISABLE_TIMING`: a cheaper event for ordering only.
pub const EVENT_DISABLE_TIMING: c_uint = 2;
/// `CU_MEMHOSTALLOC_PORTABLE`: pinned memory usable from every context.
pub const MEMHOSTALLOC_PORTABLE: c_uint = 1;

/// Declares the table of entry points: field, symbol names tried in order, and the
/// parameter types (the result is always the raw `CUresult` as an `i32`).
macro_rules! entry_points {
    ($( $(#[$doc:meta])* $field:ident = [$($sym:literal),+] ($($arg:ty),*); )*) => {
        /// The driver's entry points, as plain function pointers.
        #[allow(non_snake_case)]
        struct EntryPoints {
            $( $(#[$doc])* $field: unsafe extern "system" fn($($arg),*) -> c_int, )*
        }

        impl EntryPoints {
            /// Looks every entry point up in `lib`.
            ///
            /// # Safety
            /// `lib` must be the CUDA driver library (or a stub with the same
            /// signatures), kept loaded as long as the pointers are used.
            unsafe fn load(lib: &libloading::Library) -> Result<Self, DriverError> {
                Ok(Self {
                    $( $field: {
                        const NAMES: &[&str] = &[$($sym),+];
                        // SAFETY: the caller's contract; the type is the symbol's
                        // declared signature in cuda.h.
                        unsafe {
                            lookup::<unsafe extern "system" fn($($arg),*) -> c_int>(lib, NAMES)
                        }
                        .ok_or(DriverError::MissingEntryPoint {
                            symbol: concat!($($sym, " "),+),
                        })?
                    }, )*
                })
            }
        }
    };
}

entry_points! {
    cuInit = ["cuInit"](c_uint);
    cuDeviceGetCount = ["cuDeviceGetCount"](*mut c_int);
    cuDeviceGet = ["cuDeviceGet"](*mut CuDevice, c_int);
    cuDeviceGetAttribute = ["cuDeviceGetAttribute"](*mut c_int, c_int, CuDevice);
    cuDeviceGetName = ["cuDeviceGetName"](*mut c_char, c_int, CuDevice);
    cuDevicePrimaryCtxRetain = ["cuDevicePrimaryCtxRetain"](*mut CuContext, CuDevice);
    cuDevicePrimaryCtxRelease =
        ["cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"](CuDevice);
    cuCtxSetCurrent = ["cuCtxSetCurrent"](CuContext);
    cuMemGetInfo = ["cuMemGetInfo_v2"](*mut usize, *mut usize);
    cuMemAlloc = ["cuMemAlloc_v2"](*mut CuDevicePtr, usize);
    cuMemFree = ["cuMemFree_v2"](CuDevicePtr);
    cuMemHostAlloc = ["cuMemHostAlloc"](*mut *mut c_void, usize, c_uint);
    cuMemFreeHost = ["cuMemFreeHost"](*mut c_void);
    cuMemcpyHtoDAsync = ["cuMemcpyHtoDAsync_v2"](CuDevicePtr, *const c_void, usize, CuStream);
    cuMemcpyDtoHAsync = ["cuMemcpyDtoHAsync_v2"](*mut c_void, CuDevicePtr, usize, CuStream);
    cuMemcpyDtoDAsync = ["cuMemcpyDtoDAsync_v2"](CuDevicePtr, CuDevicePtr, usize, CuStream);
    cuMemsetD8Async = ["cuMemsetD8Async"](CuDevicePtr, u8, usize, CuStream);
    cuModuleLoadData = ["cuModuleLoadData"](*mut CuModule, *const c_void);
    cuModuleUnload = ["cuModuleUnload"](CuModule);
    cuModuleGetFunction = ["cuModuleGetFunction"](*mut CuFunction, CuModule, *const c_char);
    cuFuncSetAttribute = ["cuFuncSetAttribute"](CuFunction, c_int, c_int);
    cuLaunchKernel = ["cuLaunchKernel"](
        CuFunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CuStream,
        *mut *mut c_void, *mut *mut c_void
    );
    cuStreamCreate = ["cuStreamCreate"](*mut CuStream, c_uint);
    cuStreamDestroy = ["cuStreamDestroy_v2", "cuStreamDestroy"](CuStream);
    cuStreamSynchronize = ["cuStreamSynchronize"](CuStream);
    cuStreamWaitEvent = ["cuStreamWaitEvent"](CuStream, CuEvent, c_uint);
    cuEventCreate = ["cuEventCreate"](*mut CuEvent, c_uint);
    cuEventRecord = ["cuEventRecord"](CuEvent, CuStream);
    cuEventQuery = ["cuEventQuery"](CuEvent);
    cuEventSynchronize = ["cuEventSynchronize"](CuEvent);
    cuEventElapsedTime = ["cuEventElapsedTime_v2", "cuEventElapsedTime"](*mut f32, CuEvent, CuEvent);
    cuEventDestroy = ["cuEventDestroy_v2", "cuEventDestroy"](CuEvent);
    cuGetErrorName = ["cuGetErrorName"](c_int, *mut *const c_char);
    cuGetErrorString = ["cuGetErrorString"](c_int, *mut *const c_char);
}

/// The first of `names` that `lib` exports, as a `T` (a function pointer type).
///
/// # Safety
/// `T` must be the symbol's real type, and `lib` must outlive every use of the result.
unsafe fn lookup<T: Copy>(lib: &libloading::Library, names: &[&str]) -> Option<T> {
    names.iter().find_map(|name| {
        // SAFETY: the caller's contract.
        unsafe { lib.get::<T>(name.as_bytes()) }.ok().map(|s| *s)
    })
}

/// The library names tried, in order.
#[cfg(unix)]
const LIBRARY_NAMES: &[&str] = &["libcuda.so.1", "libcuda.so"];
#[cfg(windows)]
const LIBRARY_NAMES: &[&str] = &["nvcuda.dll"];
#[cfg(not(any(unix, windows)))]
const LIBRARY_NAMES: &[&str] = &[];

/// The names of [`LIBRARY_NAMES`] for messages.
#[cfg(unix)]
const LIBRARY_LABEL: &str = "libcuda.so.1";
#[cfg(not(unix))]
const LIBRARY_LABEL: &str = "nvcuda.dll";

/// The loaded driver: its library (kept loaded) and entry points.
///
/// Every method is one driver call; its `i32` result is turned into a [`CallError`] by
/// [`Driver::check`], with the driver's own name and message for the code. Each is O(1)
/// on the host unless its doc says otherwise (the `_async` calls and launches only
/// queue work; synchronisations wait for it). Calls that read or write through raw pointers are `unsafe` with
/// the driver's own contract; the safe resource types in [`crate::device`] uphold it.
pub struct Driver {
    fns: EntryPoints,
    /// Keeps the function pointers valid; never dropped when loaded by [`Driver::get`].
    _lib: libloading::Library,
}

impl core::fmt::Debug for Driver {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Driver").finish_non_exhaustive()
    }
}

/// The process's driver, loaded on first use.
static DRIVER: OnceLock<Result<Driver, DriverError>> = OnceLock::new();

impl Driver {
    /// The process's driver: loads the library and looks every entry point up on the
    /// first call (then calls `cuInit(0)`), and returns the same result from then on.
    /// O(1) after the first call.
    ///
    /// # Errors
    /// [`DriverError::NotInstalled`] without a driver library,
    /// [`DriverError::MissingEntryPoint`] for a driver too old, and `cuInit`'s error
    /// (e.g. `CUDA_ERROR_NO_DEVICE`, or `CUDA_ERROR_STUB_LIBRARY` from a stub).
    pub fn get() -> Result<&'static Driver, DriverError> {
        DRIVER
            .get_or_init(|| {
                let mut reasons = Vec::new();
                for name in LIBRARY_NAMES {
                    match Self::load_from(name) {
                        Ok(d) => return Ok(d),
                        Err(DriverError::NotInstalled { reason, .. }) => reasons.push(reason),
                        Err(e) => return Err(e),
                    }
                }
                Err(DriverError::NotInstalled {
                    library: LIBRARY_LABEL,
                    reason: reasons.join("; "),
                })
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Loads the driver library at `path` (a file name searched the platform's way, or
    /// a path) and calls `cuInit(0)`, e.g. to test against a stub. The library stays
    /// loaded as long as the returned value lives. O(entry points).
    ///
    /// # Errors
    /// As [`Driver::get`].
    pub fn load_from(path: &str) -> Result<Driver, DriverError> {
        let d = Self::open(path)?;
        // SAFETY: cuInit takes flags (must be 0) and nothing else.
        d.check("cuInit", unsafe { (d.fns.cuInit)(0) })?;
        Ok(d)
    }

    /// Loads the library at `path` and looks every entry point up, without `cuInit`.
    fn open(path: &str) -> Result<Driver, DriverError> {
        // SAFETY: loading runs the library's initialisers; a CUDA driver's (or our
        // stub's) do nothing a Rust program can observe.
        let lib =
            unsafe { libloading::Library::new(path) }.map_err(|e| DriverError::NotInstalled {
                library: LIBRARY_LABEL,
                reason: format!("{path}: {e}"),
            })?;
        // SAFETY: it is the driver library, kept in the returned value with the pointers.
        let fns = unsafe { EntryPoints::load(&lib) }?;
        Ok(Driver { fns, _lib: lib })
    }

    /// `Ok` for `CUDA_SUCCESS`, else the [`CallError`] of `call` with the driver's name
    /// and message for the code where it knows them, the `cuda.h` table's otherwise.
    /// Never panics, whatever the code. O(length of the driver's strings).
    pub fn check(&self, call: &'static str, code: c_int) -> Result<(), DriverError> {
        if code == 0 {
            return Ok(());
        }
        let name = self.describe(self.fns.cuGetErrorName, code);
        let message = self.describe(self.fns.cuGetErrorString, code);
        Err(CallError::new(call, Code(code), name, message).into())
    }

    /// The string `f` (`cuGetErrorName` or `cuGetErrorString`) gives for `code`, if any.
    fn describe(
        &self,
        f: unsafe extern "system" fn(c_int, *mut *const c_char) -> c_int,
        code: c_int,
    ) -> Option<String> {
        let mut ptr: *const c_char = core::ptr::null();
        // SAFETY: the driver writes a pointer to a static NUL-terminated string, or
        // fails (unknown code) and writes NULL or nothing.
        let r = unsafe { f(code, &mut ptr) };
        if r != 0 || ptr.is_null() {
            return None;
        }
        // SAFETY: a non-null result is a static NUL-terminated string of the driver.
        let s = unsafe { CStr::from_ptr(ptr) };
        Some(s.to_string_lossy().into_owned())
    }

    /// `cuDeviceGetCount`. O(1).
    ///
    /// # Errors
    /// The driver's.
    pub fn device_count(&self) -> Result<u32, DriverError> {
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        self.check("cuDeviceGetCount", unsafe {
            (self.fns.cuDeviceGetCount)(&mut n)
        })?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    /// `cuDeviceGet`: the device of ordinal `ordinal`. O(1).
    ///
    /// # Errors
    /// `CUDA_ERROR_INVALID_DEVICE` for an ordinal past the device count;
    /// [`DriverError::BadArgument`] for one over `i32::MAX`.
    pub fn device(&self, ordinal: u32) -> Result<CuDevice, DriverError> {
        let ordinal = c_int::try_from(ordinal).map_err(|_| DriverError::BadArgument {
            call: "cuDeviceGet",
            what: "device ordinal over i32::MAX",
        })?;
        let mut d: CuDevice = 0;
        // SAFETY: writes one CUdevice.
        self.check("cuDeviceGet", unsafe {
            (self.fns.cuDeviceGet)(&mut d, ordinal)
        })?;
        Ok(d)
    }

    /// `cuDeviceGetAttribute`. O(1).
    ///
    /// # Errors
    /// The driver's (an unknown attribute is `CUDA_ERROR_INVALID_VALUE`).
    pub fn attribute(&self, device: CuDevice, attribute: c_int) -> Result<i32, DriverError> {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        let r = unsafe { (self.fns.cuDeviceGetAttribute)(&mut v, attribute, device) };
        self.check("cuDeviceGetAttribute", r)?;
        Ok(v)
    }

    /// `cuDeviceGetName`, as a `String` (lossy UTF-8). O(1).
    ///
    /// # Errors
    /// The driver's.
    pub fn device_name(&self, device: CuDevice) -> Result<String, DriverError> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated.
        let r = unsafe { (self.fns.cuDeviceGetName)(buf.as_mut_ptr(), 255, device) };
        self.check("cuDeviceGetName", r)?;
        // SAFETY: the last byte stays 0, so the buffer is NUL-terminated.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// `cuDevicePrimaryCtxRetain`. O(1) (the first retain creates the context).
    ///
    /// # Errors
    /// The driver's (e.g. `CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn primary_context_retain(&self, device: CuDevice) -> Result<CuContext, DriverError> {
        let mut c: CuContext = core::ptr::null_mut();
        // SAFETY: writes one CUcontext.
        let r = unsafe { (self.fns.cuDevicePrimaryCtxRetain)(&mut c, device) };
        self.check("cuDevicePrimaryCtxRetain", r)?;
        Ok(c)
    }

    /// `cuDevicePrimaryCtxRelease`.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// Balances one successful [`Driver::primary_context_retain`]; no resource of the
    /// context is used after the last release.
    pub unsafe fn primary_context_release(&self, device: CuDevice) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        let r = unsafe { (self.fns.cuDevicePrimaryCtxRelease)(device) };
        self.check("cuDevicePrimaryCtxRelease", r)
    }

    /// `cuCtxSetCurrent`: binds `ctx` to the calling thread. O(1).
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// `ctx` is a live context (or null to unbind).
    pub unsafe fn set_current(&self, ctx: CuContext) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        self.check("cuCtxSetCurrent", unsafe {
            (self.fns.cuCtxSetCurrent)(ctx)
        })
    }

    /// `cuMemGetInfo`: `(free, total)` bytes of the current context's device. O(1).
    ///
    /// # Errors
    /// The driver's (`CUDA_ERROR_INVALID_CONTEXT` without a current context).
    pub fn mem_info(&self) -> Result<(u64, u64), DriverError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two size_t.
        let r = unsafe { (self.fns.cuMemGetInfo)(&mut free, &mut total) };
        self.check("cuMemGetInfo", r)?;
        Ok((free as u64, total as u64))
    }

    /// `cuMemAlloc` of `bytes` (> 0) in the current context. O(1) on the host.
    ///
    /// # Errors
    /// `CUDA_ERROR_OUT_OF_MEMORY`, `CUDA_ERROR_INVALID_VALUE` for 0 bytes, and the
    /// driver's other codes.
    pub fn mem_alloc(&self, bytes: usize) -> Result<CuDevicePtr, DriverError> {
        let mut p: CuDevicePtr = 0;
        // SAFETY: writes one CUdeviceptr.
        self.check("cuMemAlloc", unsafe {
            (self.fns.cuMemAlloc)(&mut p, bytes)
        })?;
        Ok(p)
    }

    /// `cuMemFree`.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// `ptr` came from [`Driver::mem_alloc`] in the current context, is freed once, and
    /// no queued work uses it any more.
    pub unsafe fn mem_free(&self, ptr: CuDevicePtr) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        self.check("cuMemFree", unsafe { (self.fns.cuMemFree)(ptr) })
    }

    /// `cuMemHostAlloc` (portable): `bytes` (> 0) of pinned host memory. O(bytes): the
    /// pages are locked now.
    ///
    /// # Errors
    /// The driver's (`CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn mem_host_alloc(&self, bytes: usize) -> Result<*mut c_void, DriverError> {
        let mut p: *mut c_void = core::ptr::null_mut();
        // SAFETY: writes one pointer.
        let r = unsafe { (self.fns.cuMemHostAlloc)(&mut p, bytes, MEMHOSTALLOC_PORTABLE) };
        self.check("cuMemHostAlloc", r)?;
        Ok(p)
    }

    /// `cuMemFreeHost`.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// `ptr` came from [`Driver::mem_host_alloc`], is freed once, and no queued copy
    /// uses it any more.
    pub unsafe fn mem_free_host(&self, ptr: *mut c_void) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        self.check("cuMemFreeHost", unsafe { (self.fns.cuMemFreeHost)(ptr) })
    }

    /// `cuMemcpyHtoDAsync` of `bytes` on `stream`.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// `dst..dst + bytes` is device memory of the current context; `src..src + bytes`
    /// is readable (pinned for a truly asynchronous copy) and not written until the copy
    /// is complete on `stream`.
    pub unsafe fn memcpy_htod_async(
        &self,
        dst: CuDevicePtr,
        src: *const c_void,
        bytes: usize,
        stream: CuStream,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        let r = unsafe { (self.fns.cuMemcpyHtoDAsync)(dst, src, bytes, stream) };
        self.check("cuMemcpyHtoDAsync", r)
    }

    /// `cuMemcpyDtoHAsync` of `bytes` on `stream`.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// `src..src + bytes` is device memory; `dst..dst + bytes` is writable and neither
    /// read nor written by the host until the copy is complete on `stream`.
    pub unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut c_void,
        src: CuDevicePtr,
        bytes: usize,
        stream: CuStream,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        let r = unsafe { (self.fns.cuMemcpyDtoHAsync)(dst, src, bytes, stream) };
        self.check("cuMemcpyDtoHAsync", r)
    }

    /// `cuMemcpyDtoDAsync` of `bytes` on `stream`.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// Both ranges are device memory of the current context.
    pub unsafe fn memcpy_dtod_async(
        &self,
        dst: CuDevicePtr,
        src: CuDevicePtr,
        bytes: usize,
        stream: CuStream,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        let r = unsafe { (self.fns.cuMemcpyDtoDAsync)(dst, src, bytes, stream) };
        self.check("cuMemcpyDtoDAsync", r)
    }

    /// `cuMemsetD8Async`: sets `bytes` bytes at `dst` to `value` on `stream`.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// `dst..dst + bytes` is device memory of the current context.
    pub unsafe fn memset_d8_async(
        &self,
        dst: CuDevicePtr,
        value: u8,
        bytes: usize,
        stream: CuStream,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        let r = unsafe { (self.fns.cuMemsetD8Async)(dst, value, bytes, stream) };
        self.check("cuMemsetD8Async", r)
    }

    /// `cuModuleLoadData`: loads a fatbin, cubin or PTX image into the current context.
    /// O(image) (plus JIT time for PTX on a GPU without matching SASS).
    ///
    /// # Errors
    /// The driver's (e.g. `CUDA_ERROR_NO_BINARY_FOR_GPU` on a GPU the image has no code
    /// for).
    ///
    /// # Safety
    /// `image` points at a whole, valid image (the driver reads up to its own size
    /// field), alive during the call.
    pub unsafe fn module_load_data(&self, image: *const c_void) -> Result<CuModule, DriverError> {
        let mut m: CuModule = core::ptr::null_mut();
        // SAFETY: the caller's contract; writes one CUmodule.
        let r = unsafe { (self.fns.cuModuleLoadData)(&mut m, image) };
        self.check("cuModuleLoadData", r)?;
        Ok(m)
    }

    /// `cuModuleUnload`.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// `module` is loaded, and none of its functions is used or running afterwards.
    pub unsafe fn module_unload(&self, module: CuModule) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        self.check("cuModuleUnload", unsafe {
            (self.fns.cuModuleUnload)(module)
        })
    }

    /// `cuModuleGetFunction`: the kernel `name` of `module`.
    ///
    /// # Errors
    /// `CUDA_ERROR_NOT_FOUND` for a name the module lacks; the driver's.
    ///
    /// # Safety
    /// `module` is loaded.
    pub unsafe fn module_function(
        &self,
        module: CuModule,
        name: &CStr,
    ) -> Result<CuFunction, DriverError> {
        let mut f: CuFunction = core::ptr::null_mut();
        // SAFETY: the caller's contract; writes one CUfunction.
        let r = unsafe { (self.fns.cuModuleGetFunction)(&mut f, module, name.as_ptr()) };
        self.check("cuModuleGetFunction", r)?;
        Ok(f)
    }

    /// `cuFuncSetAttribute` (e.g. the dynamic shared memory a kernel may use).
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// `function` belongs to a loaded module.
    pub unsafe fn function_set_attribute(
        &self,
        function: CuFunction,
        attribute: c_int,
        value: c_int,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        let r = unsafe { (self.fns.cuFuncSetAttribute)(function, attribute, value) };
        self.check("cuFuncSetAttribute", r)
    }

    /// `cuLaunchKernel` with the kernel's parameters as an array of pointers.
    ///
    /// # Errors
    /// The driver's: `CUDA_ERROR_INVALID_VALUE` for a bad grid, block or shared size,
    /// `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`, or a sticky fault of earlier work. A kernel's
    /// own fault is reported by a later synchronisation, not here.
    ///
    /// # Safety
    /// `function` belongs to a loaded module of the current context, `params` points at
    /// one pointer per kernel parameter, each to a value of that parameter's exact type
    /// and layout, and every device address inside them stays valid until the kernel
    /// completes on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_kernel(
        &self,
        function: CuFunction,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        stream: CuStream,
        params: *mut *mut c_void,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        let r = unsafe {
            (self.fns.cuLaunchKernel)(
                function,
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                shared_bytes,
                stream,
                params,
                core::ptr::null_mut(),
            )
        };
        self.check("cuLaunchKernel", r)
    }

    /// `cuStreamCreate` (non-blocking). O(1).
    ///
    /// # Errors
    /// The driver's.
    pub fn stream_create(&self) -> Result<CuStream, DriverError> {
        let mut s: CuStream = core::ptr::null_mut();
        // SAFETY: writes one CUstream.
        let r = unsafe { (self.fns.cuStreamCreate)(&mut s, STREAM_NON_BLOCKING) };
        self.check("cuStreamCreate", r)?;
        Ok(s)
    }

    /// `cuStreamDestroy`.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// `stream` was created and is destroyed once (queued work still completes).
    pub unsafe fn stream_destroy(&self, stream: CuStream) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        self.check("cuStreamDestroy", unsafe {
            (self.fns.cuStreamDestroy)(stream)
        })
    }

    /// `cuStreamSynchronize`: waits for every queued operation of `stream`.
    ///
    /// # Errors
    /// The driver's, including the first error of work queued on `stream` (e.g.
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` from a kernel; such faults are sticky: the context
    /// is unusable afterwards).
    ///
    /// # Safety
    /// `stream` is live (or null: the legacy default stream).
    pub unsafe fn stream_synchronize(&self, stream: CuStream) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        let r = unsafe { (self.fns.cuStreamSynchronize)(stream) };
        self.check("cuStreamSynchronize", r)
    }

    /// `cuStreamWaitEvent`: later work on `stream` waits for `event`'s last record.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// Both are live.
    pub unsafe fn stream_wait_event(
        &self,
        stream: CuStream,
        event: CuEvent,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        let r = unsafe { (self.fns.cuStreamWaitEvent)(stream, event, 0) };
        self.check("cuStreamWaitEvent", r)
    }

    /// `cuEventCreate` with `flags` ([`EVENT_DEFAULT`] or [`EVENT_DISABLE_TIMING`]).
    ///
    /// # Errors
    /// The driver's.
    pub fn event_create(&self, flags: c_uint) -> Result<CuEvent, DriverError> {
        let mut e: CuEvent = core::ptr::null_mut();
        // SAFETY: writes one CUevent.
        self.check("cuEventCreate", unsafe {
            (self.fns.cuEventCreate)(&mut e, flags)
        })?;
        Ok(e)
    }

    /// `cuEventRecord` on `stream`.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// Both are live.
    pub unsafe fn event_record(&self, event: CuEvent, stream: CuStream) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        self.check("cuEventRecord", unsafe {
            (self.fns.cuEventRecord)(event, stream)
        })
    }

    /// `cuEventQuery`: `Ok(true)` when the work before the last record is complete,
    /// `Ok(false)` while it is pending (`CUDA_ERROR_NOT_READY`).
    ///
    /// # Errors
    /// The driver's other codes, including a fault of the work before the record.
    ///
    /// # Safety
    /// `event` is live.
    pub unsafe fn event_query(&self, event: CuEvent) -> Result<bool, DriverError> {
        // SAFETY: the caller's contract.
        let r = unsafe { (self.fns.cuEventQuery)(event) };
        if r == Code::NOT_READY.0 {
            return Ok(false);
        }
        self.check("cuEventQuery", r).map(|()| true)
    }

    /// `cuEventSynchronize`: waits for the work before the last record.
    ///
    /// # Errors
    /// The driver's, including the first error of the work before the record (sticky,
    /// as for [`Driver::stream_synchronize`]).
    ///
    /// # Safety
    /// `event` is live.
    pub unsafe fn event_synchronize(&self, event: CuEvent) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        self.check("cuEventSynchronize", unsafe {
            (self.fns.cuEventSynchronize)(event)
        })
    }

    /// `cuEventElapsedTime`: milliseconds between two completed records.
    ///
    /// # Errors
    /// `CUDA_ERROR_NOT_READY` while a record is pending, `CUDA_ERROR_INVALID_HANDLE`
    /// for an event without timing; the driver's.
    ///
    /// # Safety
    /// Both are live, created with timing.
    pub unsafe fn event_elapsed_ms(
        &self,
        start: CuEvent,
        end: CuEvent,
    ) -> Result<f32, DriverError> {
        let mut ms = 0f32;
        // SAFETY: the caller's contract; writes one float.
        let r = unsafe { (self.fns.cuEventElapsedTime)(&mut ms, start, end) };
        self.check("cuEventElapsedTime", r)?;
        Ok(ms)
    }

    /// `cuEventDestroy`.
    ///
    /// # Errors
    /// The driver's.
    ///
    /// # Safety
    /// `event` was created and is destroyed once.
    pub unsafe fn event_destroy(&self, event: CuEvent) -> Result<(), DriverError> {
        // SAFETY: the caller's contract.
        self.check("cuEventDestroy", unsafe {
            (self.fns.cuEventDestroy)(event)
        })
    }
}

impl CallError {
    /// The error of `call` returning `code` as the process's driver describes it: its
    /// own name and message (`cuGetErrorName`, `cuGetErrorString`) when [`Driver::get`]
    /// has loaded it and it knows the code, else the `cuda.h` table's
    /// ([`CallError::new`]). For errors kept as a bare code (e.g. host-std's `Copy`
    /// `DeviceFault`) and described later. Loads nothing and never panics, whatever the
    /// code (0 too). O(length of the driver's strings).
    pub fn from_process_driver(call: &'static str, code: Code) -> Self {
        if let Some(Ok(d)) = DRIVER.get() {
            if let Err(DriverError::Call(e)) = d.check(call, code.0) {
                return e;
            }
        }
        Self::new(call, code, None, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stub library of `tools/libcuda-stub.sh`, from `KVPAGE_CUDA_STUB_LIB`; CI sets
    /// `KVPAGE_REQUIRE_STUB=1` so that a missing stub fails instead of skipping.
    fn stub() -> Option<String> {
        let path = std::env::var("KVPAGE_CUDA_STUB_LIB").ok();
        if path.is_none() {
            assert!(
                std::env::var_os("KVPAGE_REQUIRE_STUB").is_none(),
                "KVPAGE_REQUIRE_STUB is set but KVPAGE_CUDA_STUB_LIB is not"
            );
            eprintln!("SKIPPED: set KVPAGE_CUDA_STUB_LIB to tools/libcuda-stub.sh's library");
        }
        path
    }

    #[test]
    fn a_stub_driver_fails_cuinit_with_a_typed_error() {
        let Some(path) = stub() else { return };
        let e = Driver::load_from(&path).expect_err("a stub cannot initialise");
        let DriverError::Call(c) = &e else {
            panic!("not a call error: {e}")
        };
        assert_eq!(c.call, "cuInit");
        assert_eq!(c.code, Code::STUB_LIBRARY);
        // The stub's cuGetErrorName fails too: the name comes from our table.
        assert_eq!(c.name.as_deref(), Some("CUDA_ERROR_STUB_LIBRARY"));
        assert!(e
            .to_string()
            .starts_with("cuInit failed: CUDA_ERROR_STUB_LIBRARY (34): "));
    }

    #[test]
    fn check_turns_every_code_into_a_typed_error() {
        let Some(path) = stub() else { return };
        let d = Driver::open(&path).expect("the stub exports every entry point");
        assert_eq!(d.check("cuMemAlloc", 0), Ok(()));
        for (code, name) in [
            (46, Some("CUDA_ERROR_DEVICE_UNAVAILABLE")),
            (226, Some("CUDA_ERROR_CONTAINED")),
            (2, Some("CUDA_ERROR_OUT_OF_MEMORY")),
            (9999, None),
            (-1, None),
            (i32::MIN, None),
        ] {
            let e = d.check("cuMemAlloc", code).expect_err("non-zero");
            assert_eq!(e.code(), Some(Code(code)));
            let DriverError::Call(c) = e else { panic!() };
            assert_eq!(c.name.as_deref(), name, "{code}");
        }
        // Entry points that go through `check` fail cleanly too.
        assert_eq!(d.mem_alloc(64).err().and_then(|e| e.code()), Some(Code(34)));
        assert_eq!(d.mem_info().err().and_then(|e| e.code()), Some(Code(34)));
        assert_eq!(
            d.device_count().err().and_then(|e| e.code()),
            Some(Code(34))
        );
    }

    #[test]
    fn a_bare_code_is_described_without_loading_a_driver() {
        // A fault kept as a bare code (700 from a kernel's bad access): named by the
        // process's driver when one is loaded (a GPU machine), else by the table.
        let e = CallError::from_process_driver("cuStreamSynchronize", Code(700));
        assert_eq!(e.call, "cuStreamSynchronize");
        assert_eq!(e.code, Code(700));
        assert_eq!(e.name.as_deref(), Some("CUDA_ERROR_ILLEGAL_ADDRESS"));
        assert!(e.message.as_deref().is_some_and(|m| !m.is_empty()), "{e}");
        assert!(e
            .to_string()
            .starts_with("cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS (700): "));
        for code in [0, 9999, -1, i32::MIN] {
            let e = CallError::from_process_driver("cuLaunchKernel", Code(code));
            assert_eq!(e.code, Code(code));
        }
    }

    #[test]
    fn a_missing_library_is_not_installed() {
        let e = Driver::load_from("libkvpage-no-such-driver.so.1").expect_err("no such file");
        assert!(matches!(e, DriverError::NotInstalled { .. }), "{e}");
        assert!(e.to_string().contains("no CUDA driver"), "{e}");
    }

    #[test]
    fn the_process_driver_answers_without_panicking() {
        // No GPU in CI: an error (no library, or no device); on a GPU machine, Ok.
        match Driver::get() {
            Ok(d) => assert!(d.device_count().is_ok()),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
}
