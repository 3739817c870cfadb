//! The kernels' fatbin, compiled by `nvcc` in the build script (SASS for sm_80, sm_89
//! and sm_90, PTX for compute_90 so newer GPUs JIT it) and embedded in the crate.
//!
//! When the build found no `nvcc` (neither `NVCC`, `$CUDA_PATH/bin/nvcc` nor `nvcc` on
//! `PATH`), the crate still builds: [`FATBIN`] is `None`, and creating a device cache
//! fails with [`NotBuilt`].

/// Why there are no kernels: the build script found no `nvcc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotBuilt;

impl core::fmt::Display for NotBuilt {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("the CUDA kernels were not built (no nvcc found: set NVCC or CUDA_PATH)")
    }
}

impl std::error::Error for NotBuilt {}

/// A fatbin image, aligned as the driver's loader wants it (8 bytes for the fatbin
/// header's 64-bit fields).
#[cfg(kvpage_fatbin)]
#[repr(C, align(8))]
struct Aligned<T: ?Sized>(T);

#[cfg(kvpage_fatbin)]
static IMAGE: &Aligned<[u8]> =
    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin")));

/// The embedded fatbin, or `None` when the build found no `nvcc`.
#[cfg(kvpage_fatbin)]
pub const FATBIN: Option<&[u8]> = Some(&IMAGE.0);
/// The embedded fatbin, or `None` when the build found no `nvcc`.
#[cfg(not(kvpage_fatbin))]
pub const FATBIN: Option<&[u8]> = None;

/// The embedded fatbin. O(1).
///
/// # Errors
/// [`NotBuilt`] when the build found no `nvcc`.
pub fn image() -> Result<&'static [u8], NotBuilt> {
    FATBIN.ok_or(NotBuilt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_matches_the_build() {
        match image() {
            Ok(bytes) => {
                // A fatbin starts with its magic 0xBA55ED50 (little-endian).
                assert_eq!(bytes.get(..4), Some(&[0x50, 0xED, 0x55, 0xBA][..]));
                assert_eq!(bytes.as_ptr() as usize % 8, 0);
            }
            Err(e) => assert!(e.to_string().contains("set NVCC or CUDA_PATH")),
        }
    }
}
