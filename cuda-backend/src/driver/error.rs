//! [`DriverError`]: every way a driver call can fail, typed, with the call's name, the
//! raw code, its name and its message.

use std::borrow::Cow;

use super::code::Code;

/// A driver call that returned something other than `CUDA_SUCCESS`.
///
/// `name` and `message` come from the loaded driver (`cuGetErrorName`,
/// `cuGetErrorString`) when it can describe the code, else from the table of CUDA 13's
/// `cuda.h` ([`Code::known`]); a code neither knows has neither (it is still kept as a
/// number in `code`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallError {
    /// The driver entry point, e.g. `"cuMemAlloc"`.
    pub call: &'static str,
    /// The raw result.
    pub code: Code,
    /// The code's enumerator name, e.g. `"CUDA_ERROR_OUT_OF_MEMORY"`.
    pub name: Option<Cow<'static, str>>,
    /// What the code means.
    pub message: Option<Cow<'static, str>>,
}

impl CallError {
    /// The error of `call` returning `code`, described by the driver's own strings where
    /// it gave them (`driver_name`, `driver_message`) and by the `cuda.h` table
    /// otherwise. O(log table).
    pub fn new(
        call: &'static str,
        code: Code,
        driver_name: Option<String>,
        driver_message: Option<String>,
    ) -> Self {
        let known = code.known();
        let name = driver_name
            .map(Cow::Owned)
            .or_else(|| known.map(|k| Cow::Borrowed(k.name)));
        let message = driver_message
            .map(Cow::Owned)
            .or_else(|| known.map(|k| Cow::Borrowed(k.message)));
        Self {
            call,
            code,
            name,
            message,
        }
    }
}

impl core::fmt::Display for CallError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{} failed: ", self.call)?;
        match &self.name {
            Some(name) => write!(f, "{name} ({})", self.code.0)?,
            None => write!(f, "unknown CUresult {}", self.code.0)?,
        }
        match &self.message {
            Some(m) => write!(f, ": {m}"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for CallError {}

/// Why the driver could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverError {
    /// No driver library could be loaded: no NVIDIA driver is installed (the usual case
    /// on a machine without an NVIDIA GPU).
    NotInstalled {
        /// The library names tried, e.g. `"libcuda.so.1"`.
        library: &'static str,
        /// The loader's message.
        reason: String,
    },
    /// The driver library lacks an entry point kvpage calls (a driver too old).
    MissingEntryPoint {
        /// The symbol names tried.
        symbol: &'static str,
    },
    /// A driver call failed.
    Call(CallError),
    /// An argument does not fit the driver's types (e.g. a size over `i32::MAX` for a
    /// name buffer, or a host buffer shorter than the copy). Nothing was called.
    BadArgument {
        /// The driver entry point that was not called.
        call: &'static str,
        /// What is wrong.
        what: &'static str,
    },
}

impl DriverError {
    /// The raw code of a failed call, `None` for the other kinds. O(1).
    pub fn code(&self) -> Option<Code> {
        match self {
            Self::Call(c) => Some(c.code),
            _ => None,
        }
    }
}

impl core::fmt::Display for DriverError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NotInstalled { library, reason } => write!(
                f,
                "no CUDA driver: {library} could not be loaded ({reason}); \
                 is an NVIDIA driver installed?"
            ),
            Self::MissingEntryPoint { symbol } => write!(
                f,
                "the CUDA driver lacks {symbol}: the installed driver is too old"
            ),
            Self::Call(e) => e.fmt(f),
            Self::BadArgument { call, what } => write!(f, "{call} not called: {what}"),
        }
    }
}

impl std::error::Error for DriverError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Call(e) => Some(e),
            _ => None,
        }
    }
}

impl From<CallError> for DriverError {
    fn from(e: CallError) -> Self {
        Self::Call(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_codes_without_a_driver_keep_the_raw_number() {
        for code in [46 + 10_000, 9999, -1, -46, i32::MIN, i32::MAX] {
            let e = CallError::new("cuMemAlloc", Code(code), None, None);
            assert_eq!(e.code, Code(code));
            assert_eq!(e.name, None);
            assert_eq!(e.message, None);
            assert_eq!(
                e.to_string(),
                format!("cuMemAlloc failed: unknown CUresult {code}")
            );
            let d = DriverError::from(e);
            assert_eq!(d.code(), Some(Code(code)));
        }
    }

    #[test]
    fn codes_newer_than_cuda_11_4_are_named_from_the_table() {
        // 46 and 226 are the examples: unknown to cust's CUDA 11.4 enum.
        for (code, name) in [
            (46, "CUDA_ERROR_DEVICE_UNAVAILABLE"),
            (226, "CUDA_ERROR_CONTAINED"),
            (2, "CUDA_ERROR_OUT_OF_MEMORY"),
            (34, "CUDA_ERROR_STUB_LIBRARY"),
        ] {
            let e = CallError::new("cuLaunchKernel", Code(code), None, None);
            assert_eq!(e.name.as_deref(), Some(name));
            let text = e.to_string();
            assert!(
                text.starts_with(&format!("cuLaunchKernel failed: {name} ({code}): ")),
                "{text}"
            );
            assert!(text.len() > 40, "{text}");
        }
    }

    #[test]
    fn the_drivers_own_strings_win_over_the_table() {
        let e = CallError::new(
            "cuInit",
            Code(9999),
            Some("CUDA_ERROR_FROM_THE_FUTURE".into()),
            Some("a newer driver's explanation".into()),
        );
        assert_eq!(
            e.to_string(),
            "cuInit failed: CUDA_ERROR_FROM_THE_FUTURE (9999): a newer driver's explanation"
        );
        // A driver that names a code but has no message for it: the table's message.
        let e = CallError::new("cuInit", Code(2), Some("OOM".into()), None);
        assert_eq!(e.name.as_deref(), Some("OOM"));
        assert!(e.message.as_deref().is_some_and(|m| m.contains("memory")));
    }

    #[test]
    fn other_kinds_display_their_cause() {
        let e = DriverError::NotInstalled {
            library: "libcuda.so.1",
            reason: "not found".into(),
        };
        assert!(e.to_string().contains("libcuda.so.1"));
        assert_eq!(e.code(), None);
        let e = DriverError::MissingEntryPoint {
            symbol: "cuMemAlloc_v2",
        };
        assert!(e.to_string().contains("cuMemAlloc_v2"));
    }
}
