//! Why saving or restoring a sequence failed ([`PersistError`]); reported through
//! [`crate::CacheError::Persist`]. A failed save wrote nothing to the caller's buffer
//! (a failed file save leaves no file behind); a failed restore left the cache as it was.

use core::fmt;

use kvpage_core::DType;

/// A part of a sequence blob, named by [`PersistError::Corrupt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Section {
    /// The fixed header: its checksum, a reserved field, or counts that contradict each
    /// other (e.g. a block count that is not `ceil(tokens / block_size)`).
    Header,
    /// The token ids.
    Tokens,
    /// The position runs.
    Positions,
    /// The K/V blocks.
    Kv,
}

impl fmt::Display for Section {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Header => "header",
            Self::Tokens => "token ids",
            Self::Positions => "position runs",
            Self::Kv => "K/V blocks",
        })
    }
}

/// The shape a blob was saved with or a cache has: the geometry without the dtype, and
/// the bytes of one block that follow from it with the dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlobGeometry {
    /// Transformer layers.
    pub layers: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Bytes of one block (all layers' K and V).
    pub bytes_per_block: u64,
}

impl fmt::Display for BlobGeometry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers x {} kv heads x {} dims, blocks of {} tokens ({} bytes)",
            self.layers, self.kv_heads, self.head_dim, self.block_size, self.bytes_per_block
        )
    }
}

/// Why a sequence could not be saved or restored. Nothing changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PersistError {
    /// The bytes do not start with the sequence blob's magic: not a kvpage sequence.
    BadMagic,
    /// A format version this build cannot read.
    UnsupportedVersion {
        /// The blob's version.
        found: u16,
    },
    /// Flags this build does not know (a newer writer's feature).
    UnsupportedFlags {
        /// The blob's flags.
        flags: u32,
    },
    /// The blob was saved from a cache of another shape.
    GeometryMismatch {
        /// The blob's.
        blob: BlobGeometry,
        /// The cache's.
        cache: BlobGeometry,
    },
    /// The blob's K/V is stored in another dtype than the cache's.
    DtypeMismatch {
        /// The blob's dtype code (0 f32, 1 f16, 2 bf16; other codes are unknown).
        blob: u32,
        /// The cache's dtype.
        cache: DType,
    },
    /// The blob was saved under another model fingerprint.
    ModelMismatch,
    /// The blob ends before its header says it does.
    Truncated {
        /// Bytes the blob must have.
        needed: u64,
        /// Bytes given.
        got: u64,
    },
    /// Bytes follow the last section.
    TrailingBytes {
        /// How many.
        extra: u64,
    },
    /// A checksum does not match, or a section's framing or content contradicts the
    /// header.
    Corrupt {
        /// Where.
        section: Section,
    },
    /// Save: the token ids given are not one per token of the sequence.
    TokenCountMismatch {
        /// Tokens of the sequence.
        expected: u32,
        /// Ids given.
        got: usize,
    },
    /// The CUDA device failed reading or writing a block (see
    /// [`crate::DeviceFault`]); a device cache is unusable after a driver error.
    Device(crate::DeviceFault),
    /// Save: the output buffer is shorter than the blob.
    BufferTooSmall {
        /// Bytes of the blob.
        needed: usize,
        /// Bytes given.
        got: usize,
    },
    /// Restore: fewer free or evictable blocks than the sequence needs.
    NoSpace {
        /// Blocks the sequence needs.
        needed: u32,
        /// Blocks free or evictable.
        available: u32,
    },
    /// A file operation failed.
    Io {
        /// Its kind.
        kind: std::io::ErrorKind,
        /// The OS error number, when there is one.
        os_error: Option<i32>,
    },
}

impl From<std::io::Error> for PersistError {
    fn from(e: std::io::Error) -> Self {
        Self::Io {
            kind: e.kind(),
            os_error: e.raw_os_error(),
        }
    }
}

impl fmt::Display for PersistError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadMagic => f.write_str("not a kvpage sequence blob (bad magic)"),
            Self::Device(e) => write!(f, "CUDA backend: {e}"),
            Self::UnsupportedVersion { found } => {
                write!(f, "unsupported sequence blob version {found}")
            }
            Self::UnsupportedFlags { flags } => {
                write!(f, "unsupported sequence blob flags {flags:#x}")
            }
            Self::GeometryMismatch { blob, cache } => {
                write!(
                    f,
                    "blob geometry ({blob}) differs from the cache's ({cache})"
                )
            }
            Self::DtypeMismatch { blob, cache } => {
                write!(
                    f,
                    "blob dtype code {blob} differs from the cache's {cache:?}"
                )
            }
            Self::ModelMismatch => f.write_str("blob was saved for another model fingerprint"),
            Self::Truncated { needed, got } => {
                write!(f, "blob truncated: {got} bytes, needs {needed}")
            }
            Self::TrailingBytes { extra } => write!(f, "{extra} bytes after the blob's end"),
            Self::Corrupt { section } => write!(f, "blob corrupt: {section}"),
            Self::TokenCountMismatch { expected, got } => {
                write!(f, "{got} token ids for a sequence of {expected} tokens")
            }
            Self::BufferTooSmall { needed, got } => {
                write!(f, "blob buffer too small: need {needed} bytes, got {got}")
            }
            Self::NoSpace { needed, available } => {
                write!(f, "no space: need {needed} blocks, {available} available")
            }
            Self::Io { kind, os_error } => match os_error {
                Some(code) => write!(f, "i/o error: {kind} (os error {code})"),
                None => write!(f, "i/o error: {kind}"),
            },
        }
    }
}

impl std::error::Error for PersistError {}
