//! The library's version, at compile time (macros of the header) and at run time (what
//! was linked), so a program can refuse a library it was not built against.

use core::ffi::c_char;

/// Major version of the header.
pub const KVPAGE_VERSION_MAJOR: u32 = 0;
/// Minor version of the header.
pub const KVPAGE_VERSION_MINOR: u32 = 1;
/// Patch version of the header.
pub const KVPAGE_VERSION_PATCH: u32 = 0;

/// The linked library's version as `major * 10000 + minor * 100 + patch`; compare it
/// with `KVPAGE_VERSION_MAJOR` etc. of the header. O(1); thread-safe.
#[no_mangle]
pub extern "C" fn kvpage_version() -> u32 {
    KVPAGE_VERSION_MAJOR * 10_000 + KVPAGE_VERSION_MINOR * 100 + KVPAGE_VERSION_PATCH
}

/// The linked library's version as a static NUL-terminated string, e.g. "0.1.0".
/// Never null. O(1); thread-safe.
#[no_mangle]
pub extern "C" fn kvpage_version_string() -> *const c_char {
    const V: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
    V.as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_version_is_the_crate_version() {
        let part = |s: &str| s.parse::<u32>().unwrap();
        assert_eq!(KVPAGE_VERSION_MAJOR, part(env!("CARGO_PKG_VERSION_MAJOR")));
        assert_eq!(KVPAGE_VERSION_MINOR, part(env!("CARGO_PKG_VERSION_MINOR")));
        assert_eq!(KVPAGE_VERSION_PATCH, part(env!("CARGO_PKG_VERSION_PATCH")));
        // SAFETY: a static NUL-terminated string.
        let s = unsafe { core::ffi::CStr::from_ptr(kvpage_version_string()) };
        assert_eq!(s.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
        assert_eq!(kvpage_version(), 100);
    }
}
