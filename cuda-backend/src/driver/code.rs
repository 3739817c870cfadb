//! [`Code`]: a driver result as the plain integer the driver returned.
//!
//! The driver's `CUresult` is a C enum that grows with every CUDA release; a code the
//! program was not built with (46 and 226 are new since CUDA 11.4, and a later driver
//! adds more) must stay a number. `Code` is a transparent `i32`: every value is valid,
//! so nothing the driver returns can be undefined behaviour here, and [`Code::known`]
//! looks its name and documentation up in a table read from CUDA 13's `cuda.h`
//! ([`TABLE_CUDA_VERSION`]) without ever panicking.

use super::codes::KNOWN;
pub use super::codes::TABLE_CUDA_VERSION;

/// A driver result code (`CUresult`), kept as the raw `i32`. Every value is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct Code(pub i32);

/// A code's entry in the table read from `cuda.h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownCode {
    /// Its enumerator's name, e.g. `"CUDA_ERROR_OUT_OF_MEMORY"`.
    pub name: &'static str,
    /// The first sentence of its documentation in `cuda.h`.
    pub message: &'static str,
}

impl Code {
    /// `CUDA_SUCCESS`.
    pub const SUCCESS: Self = Self(0);
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub const INVALID_VALUE: Self = Self(1);
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: Self = Self(2);
    /// `CUDA_ERROR_NOT_INITIALIZED`.
    pub const NOT_INITIALIZED: Self = Self(3);
    /// `CUDA_ERROR_STUB_LIBRARY`: the driver library is a link-only stub.
    pub const STUB_LIBRARY: Self = Self(34);
    /// `CUDA_ERROR_NO_DEVICE`.
    pub const NO_DEVICE: Self = Self(100);
    /// `CUDA_ERROR_NOT_READY`: an event or stream query found work still pending (not
    /// an error for a query).
    pub const NOT_READY: Self = Self(600);
    /// `CUDA_ERROR_UNKNOWN`.
    pub const UNKNOWN: Self = Self(999);

    /// Whether this is `CUDA_SUCCESS`. O(1).
    pub const fn is_success(self) -> bool {
        self.0 == 0
    }

    /// Name and documentation of the code in CUDA 13's `cuda.h`, or `None` for a code
    /// that header does not know (a newer driver's, or garbage). O(log 101); never
    /// panics.
    pub fn known(self) -> Option<KnownCode> {
        KNOWN
            .binary_search_by_key(&self.0, |e| e.0)
            .ok()
            .and_then(|i| KNOWN.get(i))
            .map(|&(_, name, message)| KnownCode { name, message })
    }
}

impl core::fmt::Display for Code {
    /// The name when known (`CUDA_ERROR_OUT_OF_MEMORY (2)`), else `unknown CUresult N`.
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.known() {
            Some(k) => write!(f, "{} ({})", k.name, self.0),
            None => write!(f, "unknown CUresult {}", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_sorted_and_unique() {
        assert!(KNOWN.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(KNOWN.len() > 90, "{} codes", KNOWN.len());
        assert_eq!(TABLE_CUDA_VERSION, 13000);
    }

    #[test]
    fn known_codes_have_their_header_names() {
        for (code, name) in [
            (0, "CUDA_SUCCESS"),
            (1, "CUDA_ERROR_INVALID_VALUE"),
            (2, "CUDA_ERROR_OUT_OF_MEMORY"),
            (34, "CUDA_ERROR_STUB_LIBRARY"),
            (46, "CUDA_ERROR_DEVICE_UNAVAILABLE"),
            (100, "CUDA_ERROR_NO_DEVICE"),
            (209, "CUDA_ERROR_NO_BINARY_FOR_GPU"),
            (226, "CUDA_ERROR_CONTAINED"),
            (700, "CUDA_ERROR_ILLEGAL_ADDRESS"),
            (999, "CUDA_ERROR_UNKNOWN"),
        ] {
            let k = Code(code).known().expect("known code");
            assert_eq!(k.name, name);
            assert!(!k.message.is_empty());
            assert_eq!(Code(code).to_string(), format!("{name} ({code})"));
        }
    }

    #[test]
    fn unknown_codes_stay_numbers() {
        for code in [9999, -1, i32::MIN, i32::MAX, 47, 1000, 10_000] {
            assert_eq!(Code(code).known(), None, "{code}");
            assert_eq!(Code(code).to_string(), format!("unknown CUresult {code}"));
        }
    }

    #[test]
    fn every_i32_near_the_table_is_answered_without_panicking() {
        let mut known = 0;
        for code in -2000..2000 {
            known += usize::from(Code(code).known().is_some());
        }
        assert_eq!(known, KNOWN.len());
    }
}
