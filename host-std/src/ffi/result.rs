//! Result codes and the error out-struct of the C API, and the one wrapper every
//! exported function runs its body in (`run`): it catches panics and writes the error
//! struct on failure only.

use core::ffi::c_char;
use core::fmt::{self, Write as _};
use std::panic::{self, AssertUnwindSafe};

use kvpage_core::{EngineError, GeometryError, InitError, QuotaError, SeqError};

use crate::cache::CacheError;
use crate::error::KernelError;
use crate::kernels::RopeError;
use crate::persist::{PersistError, Section};
use crate::storage::DeviceFault;

/// What a call of the C API did. `KVPAGE_OK` (0) is success; every other code is a
/// failure that changed nothing, and its number never changes between versions (new
/// codes get new numbers). `kvpage_result_str` gives a static message for each.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum kvpage_result {
    /// Success.
    KVPAGE_OK = 0,
    /// A pointer the function needs was null.
    KVPAGE_ERR_NULL_POINTER = 1,
    /// A pointer is not aligned for its type (storage of tier 2 needs
    /// `kvpage_manager_align()`).
    KVPAGE_ERR_MISALIGNED = 2,
    /// An argument is out of its domain: a zero count, an unknown dtype or preemption
    /// mode, a length whose byte size overflows.
    KVPAGE_ERR_INVALID_ARGUMENT = 3,
    /// A caller buffer is shorter than needed (`needed` elements, `available` given).
    KVPAGE_ERR_BUFFER_TOO_SMALL = 4,
    /// The configuration cannot be built (zero or oversized limits, capacity of zero
    /// blocks or more than 2^32-1, head dim over the kernels' maximum).
    KVPAGE_ERR_BAD_CONFIG = 5,
    /// Memory was refused (`needed` bytes when known).
    KVPAGE_ERR_OUT_OF_MEMORY = 6,
    /// Caller-provided storage is too small (`needed` bytes, `available` given).
    KVPAGE_ERR_STORAGE_TOO_SMALL = 7,
    /// The sequence id is stale (released) or was never issued by this object.
    KVPAGE_ERR_STALE_SEQ = 8,
    /// The sequence id was issued by another cache or manager.
    KVPAGE_ERR_FOREIGN_SEQ = 9,
    /// All `max_seqs` sequence slots are in use.
    KVPAGE_ERR_NO_FREE_SEQ = 10,
    /// The sequence would exceed its maximum length (`needed` tokens, `available` max).
    KVPAGE_ERR_SEQ_TOO_LONG = 11,
    /// Not enough free or evictable blocks (`needed`, `available`).
    KVPAGE_ERR_OUT_OF_BLOCKS = 12,
    /// The sequence is swapped out to the host tier: swap it in first.
    KVPAGE_ERR_SEQ_SWAPPED = 13,
    /// The sequence is not swapped out.
    KVPAGE_ERR_SEQ_NOT_SWAPPED = 14,
    /// The host tier has too few free blocks (`needed`, `available`).
    KVPAGE_ERR_HOST_FULL = 15,
    /// Truncation beyond the current length (`needed` = requested, `available` = len),
    /// or an edit's token range reversed or past it (`needed` = range end, `available` =
    /// len, `value` = range start).
    KVPAGE_ERR_BEYOND_LENGTH = 16,
    /// K/V written outside the positions appended since the last commit.
    KVPAGE_ERR_NOT_WRITABLE = 17,
    /// The layer is out of range (`value` = layer, `available` = layers).
    KVPAGE_ERR_BAD_LAYER = 18,
    /// Query heads are zero or not a multiple of the KV heads.
    KVPAGE_ERR_BAD_HEADS = 19,
    /// The storage dtype of the cache is not the dtype of the call, or the call writes
    /// values as they are into 8-bit storage, whose per-token scales only a write from
    /// `float` sets, or it fixes scales of float storage, which keeps none.
    KVPAGE_ERR_DTYPE_MISMATCH = 20,
    /// The softmax scale is not finite, or a fixed K/V scale is not finite and
    /// positive.
    KVPAGE_ERR_BAD_SCALE = 21,
    /// More sequences in one call than `max_seqs` (`needed`, `available`).
    KVPAGE_ERR_BATCH_TOO_LARGE = 22,
    /// More query tokens than tokens of context for a sequence.
    KVPAGE_ERR_QUERIES_EXCEED_CONTEXT = 23,
    /// `max_requests` requests are in flight.
    KVPAGE_ERR_QUEUE_FULL = 24,
    /// A request can never fit in the pool (`needed` blocks, `available` = pool).
    KVPAGE_ERR_UNSCHEDULABLE = 25,
    /// The request id is stale (finished, cancelled) or was never issued.
    KVPAGE_ERR_STALE_REQUEST = 26,
    /// The request is not in the state the operation needs (`value` = request id).
    KVPAGE_ERR_WRONG_STATE = 27,
    /// Two samples for one request in one commit (`value` = request id).
    KVPAGE_ERR_DUPLICATE_SAMPLE = 28,
    /// An emitting sequence got no sample (`value` = request id).
    KVPAGE_ERR_MISSING_SAMPLE = 29,
    /// A step waits for its commit.
    KVPAGE_ERR_STEP_IN_PROGRESS = 30,
    /// Commit without a step.
    KVPAGE_ERR_NO_STEP_IN_PROGRESS = 31,
    /// The manager or host pool passed is not the one the scheduler was built for.
    KVPAGE_ERR_FOREIGN_MANAGER = 32,
    /// The operation needs the host tier and there is none.
    KVPAGE_ERR_NO_HOST_POOL = 33,
    /// A block or slot id is out of range of the arena.
    KVPAGE_ERR_OUT_OF_RANGE = 34,
    /// A bug inside kvpage was caught (a panic, a failed internal check); the object
    /// is in an unknown state: free it.
    KVPAGE_ERR_INTERNAL = 35,
    /// Positions an edit asks for are not strictly increasing in token order or leave the
    /// `u32` range (also an append past position `u32::MAX`).
    KVPAGE_ERR_BAD_POSITIONS = 36,
    /// An edit would need more position runs than a sequence holds.
    KVPAGE_ERR_TOO_MANY_POSITION_RUNS = 37,
    /// A block the operation would change in place is shared with another sequence or
    /// registered in the prefix cache (`value` = block, `needed` = its reference count).
    KVPAGE_ERR_BLOCK_SHARED = 38,
    /// The bytes are not a kvpage sequence blob (wrong magic).
    KVPAGE_ERR_BLOB_FORMAT = 39,
    /// The blob's format version (`value`) or flags are newer than this library reads.
    KVPAGE_ERR_BLOB_VERSION = 40,
    /// The blob was saved from a cache of another geometry (layers, KV heads, head dim,
    /// block size).
    KVPAGE_ERR_BLOB_GEOMETRY = 41,
    /// The blob was saved under another model fingerprint.
    KVPAGE_ERR_BLOB_MODEL = 42,
    /// The blob is shorter than its header says (`needed` bytes, `available` given).
    KVPAGE_ERR_BLOB_TRUNCATED = 43,
    /// A checksum, a length or a framing field of the blob is wrong, or bytes follow
    /// its end (`value`: 0 header, 1 token ids, 2 positions, 3 K/V, 4 trailing bytes).
    KVPAGE_ERR_BLOB_CORRUPT = 44,
    /// A file could not be written or read (`value` = the OS error number, 0 if none).
    KVPAGE_ERR_IO = 45,
    /// The sequence's namespace would exceed its block quota even after evicting its
    /// own cached blocks (`needed` blocks, `available` = what the quota still allows).
    KVPAGE_ERR_QUOTA_EXCEEDED = 46,
    /// A namespace quota cannot be set: the reservation exceeds the limit, the
    /// namespace table is full, the namespace holds more than the new limit (`needed` =
    /// held, `available` = limit), or the free blocks cannot cover the reservations
    /// (`needed`, `available` = free).
    KVPAGE_ERR_QUOTA_REFUSED = 47,
    /// This build of the library lacks the feature the call needs (e.g. the KV event
    /// publisher without `events-zmq`, a CUDA backend without `cuda`).
    KVPAGE_ERR_UNSUPPORTED = 48,
    /// The CUDA device failed or is not available: no NVIDIA driver, no such device, no
    /// kernels in this build, a driver error (`value` = the driver's result code), or
    /// sizes the device backend refuses. A driver error of queued work leaves the
    /// object unusable: free it.
    KVPAGE_ERR_DEVICE = 49,
}

/// The highest result code (for tables of messages and tests that walk every code).
pub const KVPAGE_RESULT_LAST: u32 = KVPAGE_ERR_DEVICE as u32;

use kvpage_result::*;

/// A static, NUL-terminated English message for `code`, e.g. "out of blocks". Unknown
/// codes give "unknown result code". Never null; the string lives forever.
/// O(1); thread-safe.
#[no_mangle]
pub extern "C" fn kvpage_result_str(code: u32) -> *const c_char {
    let s: &'static core::ffi::CStr = match code {
        0 => c"ok",
        1 => c"null pointer",
        2 => c"misaligned pointer",
        3 => c"invalid argument",
        4 => c"buffer too small",
        5 => c"bad configuration",
        6 => c"out of memory",
        7 => c"storage too small",
        8 => c"stale sequence id",
        9 => c"sequence id of another cache",
        10 => c"no free sequence slot",
        11 => c"sequence too long",
        12 => c"out of blocks",
        13 => c"sequence is swapped out",
        14 => c"sequence is not swapped out",
        15 => c"host tier full",
        16 => c"truncation beyond the length",
        17 => c"positions not writable",
        18 => c"layer out of range",
        19 => c"query heads not a multiple of the KV heads",
        20 => c"dtype mismatch",
        21 => c"softmax scale not finite",
        22 => c"batch too large",
        23 => c"more queries than context",
        24 => c"request queue full",
        25 => c"request can never be scheduled",
        26 => c"stale request id",
        27 => c"request in the wrong state",
        28 => c"duplicate sample",
        29 => c"missing sample",
        30 => c"step in progress",
        31 => c"no step in progress",
        32 => c"foreign manager or host pool",
        33 => c"no host tier",
        34 => c"block or slot out of range",
        35 => c"internal error",
        36 => c"positions not increasing or out of range",
        37 => c"too many position runs",
        38 => c"block shared or in the prefix cache",
        39 => c"not a kvpage sequence blob",
        40 => c"unsupported blob version",
        41 => c"blob geometry differs from the cache",
        42 => c"blob saved for another model",
        43 => c"blob truncated",
        44 => c"blob corrupt",
        45 => c"i/o error",
        46 => c"namespace quota exceeded",
        47 => c"namespace quota refused",
        48 => c"not supported by this build",
        49 => c"CUDA device failed or unavailable",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

/// Bytes of `kvpage_error.message`, the terminating NUL included.
pub const KVPAGE_ERROR_MESSAGE_LEN: usize = 160;

/// Details of a failure, written by a function that fails when the caller passes a
/// non-null pointer to one (every function takes it as its last argument; pass NULL to
/// ignore details). Untouched on success.
#[repr(C)]
#[allow(non_camel_case_types)]
pub struct kvpage_error {
    /// The code the function returned.
    pub code: kvpage_result,
    /// What the operation needed: blocks, tokens, elements or bytes (see the code);
    /// 0 when not applicable.
    pub needed: u64,
    /// What was available or given, in the same unit; 0 when not applicable.
    pub available: u64,
    /// The offending value: a length, a layer, a sequence or request id; 0 when not
    /// applicable.
    pub value: u64,
    /// A NUL-terminated English message with the numbers, e.g. "out of blocks: need 3,
    /// 1 available" (truncated to fit).
    pub message: [c_char; KVPAGE_ERROR_MESSAGE_LEN],
}

/// What goes wrong inside the C API before it reaches the caller as a code and an
/// error struct.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fail {
    pub(crate) code: kvpage_result,
    pub(crate) needed: u64,
    pub(crate) available: u64,
    pub(crate) value: u64,
    detail: Detail,
}

#[derive(Debug, Clone, Copy)]
enum Detail {
    Text(&'static str),
    Cache(CacheError),
}

impl fmt::Display for Detail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Text(s) => f.write_str(s),
            Self::Cache(e) => e.fmt(f),
        }
    }
}

impl Fail {
    /// A failure with a static message (e.g. the name of the null argument).
    pub(crate) const fn new(code: kvpage_result, message: &'static str) -> Self {
        Self {
            code,
            needed: 0,
            available: 0,
            value: 0,
            detail: Detail::Text(message),
        }
    }

    /// The same failure with `needed` / `available` numbers.
    pub(crate) const fn with_sizes(mut self, needed: u64, available: u64) -> Self {
        self.needed = needed;
        self.available = available;
        self
    }

    /// The same failure naming the offending value.
    pub(crate) const fn with_value(mut self, value: u64) -> Self {
        self.value = value;
        self
    }

    /// A null pointer passed for the argument `what`.
    pub(crate) const fn null(what: &'static str) -> Self {
        Self::new(KVPAGE_ERR_NULL_POINTER, what)
    }

    /// An argument out of its domain.
    pub(crate) const fn invalid(what: &'static str) -> Self {
        Self::new(KVPAGE_ERR_INVALID_ARGUMENT, what)
    }

    /// A caller buffer `what` of `got` elements where `needed` are required.
    pub(crate) const fn short(what: &'static str, needed: usize, got: usize) -> Self {
        Self::new(KVPAGE_ERR_BUFFER_TOO_SMALL, what).with_sizes(needed as u64, got as u64)
    }

    fn write_message(&self, out: &mut [c_char; KVPAGE_ERROR_MESSAGE_LEN]) {
        let mut w = MessageWriter { buf: out, len: 0 };
        // A full buffer ends the message early; that is the truncation documented.
        let _ = write!(w, "{}", self.detail);
        let end = w.len;
        out[end] = 0;
    }

    fn to_c(self) -> kvpage_error {
        let mut e = kvpage_error {
            code: self.code,
            needed: self.needed,
            available: self.available,
            value: self.value,
            message: [0; KVPAGE_ERROR_MESSAGE_LEN],
        };
        self.write_message(&mut e.message);
        e
    }
}

/// Writes UTF-8 into a C char buffer, leaving room for the NUL and cutting at a
/// character boundary.
struct MessageWriter<'a> {
    buf: &'a mut [c_char; KVPAGE_ERROR_MESSAGE_LEN],
    len: usize,
}

impl fmt::Write for MessageWriter<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = KVPAGE_ERROR_MESSAGE_LEN - 1 - self.len;
        let mut take = s.len().min(room);
        while !s.is_char_boundary(take) {
            take -= 1;
        }
        for (d, &b) in self.buf[self.len..].iter_mut().zip(&s.as_bytes()[..take]) {
            *d = b as c_char;
        }
        self.len += take;
        if take < s.len() {
            Err(fmt::Error)
        } else {
            Ok(())
        }
    }
}

impl From<CacheError> for Fail {
    fn from(e: CacheError) -> Self {
        let (code, needed, available, value) = classify(&e);
        Self {
            code,
            needed,
            available,
            value,
            detail: Detail::Cache(e),
        }
    }
}

impl From<SeqError> for Fail {
    fn from(e: SeqError) -> Self {
        CacheError::Seq(e).into()
    }
}

impl From<EngineError> for Fail {
    fn from(e: EngineError) -> Self {
        CacheError::Engine(e).into()
    }
}

impl From<QuotaError> for Fail {
    fn from(e: QuotaError) -> Self {
        let fail = |message| Fail::new(KVPAGE_ERR_QUOTA_REFUSED, message);
        match e {
            QuotaError::ReserveAboveLimit => fail("reserved blocks exceed the block limit"),
            QuotaError::TableFull => fail("namespace table full (max_namespaces)"),
            QuotaError::HeldAboveLimit { held, limit } => {
                fail("namespace holds more blocks than the new limit")
                    .with_sizes(u64::from(held), u64::from(limit))
            }
            QuotaError::ReserveUnavailable { needed, free } => {
                fail("free blocks cannot cover the reservations")
                    .with_sizes(u64::from(needed), u64::from(free))
            }
        }
    }
}

impl From<KernelError> for Fail {
    fn from(e: KernelError) -> Self {
        CacheError::Kernel(e).into()
    }
}

impl From<InitError> for Fail {
    fn from(e: InitError) -> Self {
        CacheError::Init(e).into()
    }
}

impl From<GeometryError> for Fail {
    fn from(e: GeometryError) -> Self {
        CacheError::Geometry(e).into()
    }
}

/// Code and numbers of a Rust error: `(code, needed, available, value)`.
fn classify(e: &CacheError) -> (kvpage_result, u64, u64, u64) {
    let n = |x: usize| x as u64;
    match *e {
        CacheError::Geometry(_) | CacheError::BadConfig => (KVPAGE_ERR_BAD_CONFIG, 0, 0, 0),
        CacheError::Init(InitError::StorageTooSmall { needed, got }) => (
            KVPAGE_ERR_STORAGE_TOO_SMALL,
            n(needed).saturating_mul(8),
            n(got).saturating_mul(8),
            0,
        ),
        CacheError::Init(_) => (KVPAGE_ERR_BAD_CONFIG, 0, 0, 0),
        CacheError::Alloc(_) => (KVPAGE_ERR_OUT_OF_MEMORY, 0, 0, 0),
        CacheError::TablesAlloc { bytes } => (KVPAGE_ERR_OUT_OF_MEMORY, n(bytes), 0, 0),
        CacheError::Seq(s) => classify_seq(s),
        CacheError::Engine(en) => classify_engine(en),
        CacheError::Kernel(k) => classify_kernel(k),
        CacheError::NotWritable {
            first,
            tokens,
            pending,
            len,
        } => (
            KVPAGE_ERR_NOT_WRITABLE,
            u64::from(first) + u64::from(tokens),
            u64::from(len),
            u64::from(first.min(pending)),
        ),
        CacheError::BatchTooLarge { seqs, max } => (KVPAGE_ERR_BATCH_TOO_LARGE, n(seqs), n(max), 0),
        CacheError::BadRange { first, end, .. } if first > end => (
            KVPAGE_ERR_INVALID_ARGUMENT,
            0,
            u64::from(end),
            u64::from(first),
        ),
        CacheError::BadRange { end, len, .. } => {
            (KVPAGE_ERR_BEYOND_LENGTH, u64::from(end), u64::from(len), 0)
        }
        CacheError::BlockShared {
            block, refcount, ..
        } => (
            KVPAGE_ERR_BLOCK_SHARED,
            u64::from(refcount),
            0,
            u64::from(block),
        ),
        CacheError::Persist(p) => classify_persist(p),
        CacheError::Device(DeviceFault::NotCompiled) => (KVPAGE_ERR_UNSUPPORTED, 0, 0, 0),
        CacheError::Device(DeviceFault::Driver { code, .. }) => {
            (KVPAGE_ERR_DEVICE, 0, 0, u64::from(code as u32))
        }
        CacheError::Device(_) => (KVPAGE_ERR_DEVICE, 0, 0, 0),
    }
}

fn classify_persist(e: PersistError) -> (kvpage_result, u64, u64, u64) {
    let n = |x: usize| x as u64;
    match e {
        PersistError::BadMagic => (KVPAGE_ERR_BLOB_FORMAT, 0, 0, 0),
        PersistError::Device(f) => classify(&CacheError::Device(f)),
        PersistError::UnsupportedVersion { found } => {
            (KVPAGE_ERR_BLOB_VERSION, 0, 0, u64::from(found))
        }
        PersistError::UnsupportedFlags { flags } => {
            (KVPAGE_ERR_BLOB_VERSION, 0, 0, u64::from(flags))
        }
        PersistError::GeometryMismatch { .. } => (KVPAGE_ERR_BLOB_GEOMETRY, 0, 0, 0),
        PersistError::DtypeMismatch { blob, .. } => {
            (KVPAGE_ERR_DTYPE_MISMATCH, 0, 0, u64::from(blob))
        }
        PersistError::ModelMismatch => (KVPAGE_ERR_BLOB_MODEL, 0, 0, 0),
        PersistError::Truncated { needed, got } => (KVPAGE_ERR_BLOB_TRUNCATED, needed, got, 0),
        PersistError::Corrupt { section } => {
            let code = match section {
                Section::Header => 0,
                Section::Tokens => 1,
                Section::Positions => 2,
                Section::Kv => 3,
            };
            (KVPAGE_ERR_BLOB_CORRUPT, 0, 0, code)
        }
        PersistError::TrailingBytes { extra } => (KVPAGE_ERR_BLOB_CORRUPT, 0, extra, 4),
        PersistError::TokenCountMismatch { expected, got } => {
            (KVPAGE_ERR_INVALID_ARGUMENT, u64::from(expected), n(got), 0)
        }
        PersistError::BufferTooSmall { needed, got } => {
            (KVPAGE_ERR_BUFFER_TOO_SMALL, n(needed), n(got), 0)
        }
        PersistError::NoSpace { needed, available } => (
            KVPAGE_ERR_OUT_OF_BLOCKS,
            u64::from(needed),
            u64::from(available),
            0,
        ),
        PersistError::Io { os_error, .. } => (
            KVPAGE_ERR_IO,
            0,
            0,
            os_error.map_or(0, |c| u64::from(c as u32)),
        ),
    }
}

fn classify_seq(e: SeqError) -> (kvpage_result, u64, u64, u64) {
    match e {
        SeqError::StaleHandle => (KVPAGE_ERR_STALE_SEQ, 0, 0, 0),
        SeqError::ForeignHandle => (KVPAGE_ERR_FOREIGN_SEQ, 0, 0, 0),
        SeqError::NoFreeSequence => (KVPAGE_ERR_NO_FREE_SEQ, 0, 0, 0),
        SeqError::TooLong { tokens, max_tokens } => {
            (KVPAGE_ERR_SEQ_TOO_LONG, tokens, max_tokens, 0)
        }
        SeqError::OutOfBlocks { needed, available } => (
            KVPAGE_ERR_OUT_OF_BLOCKS,
            u64::from(needed),
            u64::from(available),
            0,
        ),
        SeqError::SlotBufferTooSmall { needed, got }
        | SeqError::MoveBufferTooSmall { needed, got } => {
            (KVPAGE_ERR_BUFFER_TOO_SMALL, needed as u64, got as u64, 0)
        }
        SeqError::Swapped => (KVPAGE_ERR_SEQ_SWAPPED, 0, 0, 0),
        SeqError::NotSwapped => (KVPAGE_ERR_SEQ_NOT_SWAPPED, 0, 0, 0),
        SeqError::HostFull { needed, available } => (
            KVPAGE_ERR_HOST_FULL,
            u64::from(needed),
            u64::from(available),
            0,
        ),
        SeqError::BeyondLength { requested, len } => (
            KVPAGE_ERR_BEYOND_LENGTH,
            u64::from(requested),
            u64::from(len),
            0,
        ),
        // A range past the length: `value` is its first token.
        SeqError::BadRange { first, end, len } => (
            KVPAGE_ERR_BEYOND_LENGTH,
            u64::from(end),
            u64::from(len),
            u64::from(first),
        ),
        SeqError::BadPositions => (KVPAGE_ERR_BAD_POSITIONS, 0, 0, 0),
        SeqError::TooManyPositionRuns { needed, capacity } => (
            KVPAGE_ERR_TOO_MANY_POSITION_RUNS,
            u64::from(needed),
            u64::from(capacity),
            0,
        ),
        SeqError::QuotaExceeded { needed, allowed } => (
            KVPAGE_ERR_QUOTA_EXCEEDED,
            u64::from(needed),
            u64::from(allowed),
            0,
        ),
    }
}

fn classify_engine(e: EngineError) -> (kvpage_result, u64, u64, u64) {
    let id = |r: kvpage_core::RequestId| crate::ffi::ids::request_to_c(r);
    match e {
        EngineError::Init(i) => classify(&CacheError::Init(i)),
        EngineError::ZeroConfig => (KVPAGE_ERR_BAD_CONFIG, 0, 0, 0),
        EngineError::QueueFull { max_requests } => {
            (KVPAGE_ERR_QUEUE_FULL, 0, u64::from(max_requests), 0)
        }
        EngineError::EmptyPrompt | EngineError::ZeroMaxTokens => {
            (KVPAGE_ERR_INVALID_ARGUMENT, 0, 0, 0)
        }
        EngineError::TooLong { tokens, max_tokens } => {
            (KVPAGE_ERR_SEQ_TOO_LONG, tokens, max_tokens, 0)
        }
        EngineError::Unschedulable {
            request,
            needed_blocks,
            total_blocks,
        } => (
            KVPAGE_ERR_UNSCHEDULABLE,
            needed_blocks,
            u64::from(total_blocks),
            request.map_or(0, id),
        ),
        EngineError::StaleRequest => (KVPAGE_ERR_STALE_REQUEST, 0, 0, 0),
        EngineError::WrongState { request } => (KVPAGE_ERR_WRONG_STATE, 0, 0, id(request)),
        EngineError::DuplicateSample { request } => {
            (KVPAGE_ERR_DUPLICATE_SAMPLE, 0, 0, id(request))
        }
        EngineError::MissingSample { request } => (KVPAGE_ERR_MISSING_SAMPLE, 0, 0, id(request)),
        EngineError::StepInProgress => (KVPAGE_ERR_STEP_IN_PROGRESS, 0, 0, 0),
        EngineError::NoStepInProgress => (KVPAGE_ERR_NO_STEP_IN_PROGRESS, 0, 0, 0),
        EngineError::ForeignManager => (KVPAGE_ERR_FOREIGN_MANAGER, 0, 0, 0),
        EngineError::NoFreeSequence => (KVPAGE_ERR_NO_FREE_SEQ, 0, 0, 0),
        EngineError::NoHostPool => (KVPAGE_ERR_NO_HOST_POOL, 0, 0, 0),
        EngineError::PlanFailed(_) | EngineError::Schedule(_) => (KVPAGE_ERR_INTERNAL, 0, 0, 0),
    }
}

fn classify_kernel(e: KernelError) -> (kvpage_result, u64, u64, u64) {
    let n = |x: usize| x as u64;
    match e {
        KernelError::BufferLength {
            expected, actual, ..
        } => (KVPAGE_ERR_BUFFER_TOO_SMALL, n(expected), n(actual), 0),
        KernelError::LayerOutOfRange { layer, layers } => {
            (KVPAGE_ERR_BAD_LAYER, 0, u64::from(layers), u64::from(layer))
        }
        KernelError::HeadsNotDivisible { q_heads, kv_heads } => (
            KVPAGE_ERR_BAD_HEADS,
            0,
            u64::from(kv_heads),
            u64::from(q_heads),
        ),
        KernelError::HeadDimTooLarge { head_dim } => {
            (KVPAGE_ERR_BAD_CONFIG, 0, 0, u64::from(head_dim))
        }
        KernelError::BadLayout => (KVPAGE_ERR_BAD_CONFIG, 0, 0, 0),
        KernelError::DTypeMismatch { .. } => (KVPAGE_ERR_DTYPE_MISMATCH, 0, 0, 0),
        KernelError::ScaledStorage { dtype } => (
            KVPAGE_ERR_DTYPE_MISMATCH,
            0,
            0,
            u64::from(super::geometry::dtype_to_c(dtype)),
        ),
        KernelError::BadScale | KernelError::BadKvScale => (KVPAGE_ERR_BAD_SCALE, 0, 0, 0),
        KernelError::UnscaledStorage { dtype } => (
            KVPAGE_ERR_DTYPE_MISMATCH,
            0,
            0,
            u64::from(super::geometry::dtype_to_c(dtype)),
        ),
        KernelError::SlotOutOfRange { slot, slots } => {
            (KVPAGE_ERR_OUT_OF_RANGE, 0, slots, u64::from(slot))
        }
        KernelError::BlockOutOfRange { block, blocks } => (
            KVPAGE_ERR_OUT_OF_RANGE,
            0,
            u64::from(blocks),
            u64::from(block),
        ),
        KernelError::CopyOntoItself { block } => {
            (KVPAGE_ERR_INVALID_ARGUMENT, 0, 0, u64::from(block))
        }
        KernelError::BadRowMove { src_slot, .. } => {
            (KVPAGE_ERR_INVALID_ARGUMENT, 0, 0, u64::from(src_slot))
        }
        KernelError::RowOutOfRange { row, rows } => {
            (KVPAGE_ERR_OUT_OF_RANGE, 0, u64::from(rows), u64::from(row))
        }
        KernelError::ContextTooLong {
            context_len,
            capacity,
        } => (KVPAGE_ERR_SEQ_TOO_LONG, u64::from(context_len), capacity, 0),
        KernelError::QueriesExceedContext {
            queries,
            context_len,
        } => (
            KVPAGE_ERR_QUERIES_EXCEED_CONTEXT,
            u64::from(queries),
            u64::from(context_len),
            0,
        ),
        KernelError::Rope(RopeError::OddRotaryDims { rotary_dims }) => {
            (KVPAGE_ERR_INVALID_ARGUMENT, 0, 0, u64::from(rotary_dims))
        }
        KernelError::Rope(RopeError::RotaryDimsExceedHeadDim {
            rotary_dims,
            head_dim,
        }) => (
            KVPAGE_ERR_INVALID_ARGUMENT,
            0,
            u64::from(head_dim),
            u64::from(rotary_dims),
        ),
        KernelError::Rope(RopeError::ZeroRotaryDims | RopeError::BadBase) => {
            (KVPAGE_ERR_INVALID_ARGUMENT, 0, 0, 0)
        }
        KernelError::BadTokenRange { first, end } => (
            KVPAGE_ERR_INVALID_ARGUMENT,
            0,
            u64::from(end),
            u64::from(first),
        ),
    }
}

/// Runs the body of an exported function: a panic becomes [`KVPAGE_ERR_INTERNAL`]
/// (it never unwinds into C), a failure is written to `err` when it is non-null and
/// aligned, and the code is returned. `err` is not touched on success.
///
/// # Safety
/// `err` is null or points to writable memory for one [`kvpage_error`].
pub(crate) unsafe fn run(
    err: *mut kvpage_error,
    body: impl FnOnce() -> Result<(), Fail>,
) -> kvpage_result {
    let outcome = panic::catch_unwind(AssertUnwindSafe(body)).unwrap_or(Err(Fail::new(
        KVPAGE_ERR_INTERNAL,
        "internal error: a panic was caught at the C boundary",
    )));
    match outcome {
        Ok(()) => KVPAGE_OK,
        Err(fail) => {
            if !err.is_null() && err.is_aligned() {
                // SAFETY: non-null and aligned; the caller promises it is writable.
                unsafe { err.write(fail.to_c()) };
            }
            fail.code
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::ffi::CStr;

    #[test]
    fn every_code_has_its_own_message() {
        let mut seen = std::collections::HashSet::new();
        for code in 0..=KVPAGE_RESULT_LAST {
            // SAFETY: kvpage_result_str returns a static C string.
            let s = unsafe { CStr::from_ptr(kvpage_result_str(code)) };
            assert!(seen.insert(s.to_owned()), "code {code} repeats {s:?}");
            assert_ne!(s.to_bytes(), b"unknown result code");
        }
        // SAFETY: as above.
        let s = unsafe { CStr::from_ptr(kvpage_result_str(9999)) };
        assert_eq!(s.to_bytes(), b"unknown result code");
    }

    #[test]
    fn a_failure_fills_the_struct_and_truncates_at_a_char_boundary() {
        let mut e = core::mem::MaybeUninit::<kvpage_error>::uninit();
        let fail = Fail::from(SeqError::OutOfBlocks {
            needed: 3,
            available: 1,
        });
        // SAFETY: e is writable for one kvpage_error.
        let code = unsafe { run(e.as_mut_ptr(), || Err(fail)) };
        assert_eq!(code, KVPAGE_ERR_OUT_OF_BLOCKS);
        // SAFETY: run wrote it on failure.
        let e = unsafe { e.assume_init() };
        assert_eq!((e.code, e.needed, e.available), (code, 3, 1));
        // SAFETY: the message is NUL-terminated.
        let msg = unsafe { CStr::from_ptr(e.message.as_ptr()) };
        assert_eq!(msg.to_str().unwrap(), "out of blocks: need 3, 1 available");

        let mut buf = [0 as c_char; KVPAGE_ERROR_MESSAGE_LEN];
        let long = Fail::new(KVPAGE_ERR_INVALID_ARGUMENT, "ééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééé");
        long.write_message(&mut buf);
        // SAFETY: NUL-terminated by write_message.
        let msg = unsafe { CStr::from_ptr(buf.as_ptr()) };
        let s = msg.to_str().expect("cut at a char boundary");
        assert!(s.len() < KVPAGE_ERROR_MESSAGE_LEN && s.len() >= KVPAGE_ERROR_MESSAGE_LEN - 3);
    }

    #[test]
    fn a_driver_fault_reaches_c_with_its_call_and_code() {
        let fault = DeviceFault::Driver {
            call: "cuStreamSynchronize",
            code: 700,
        };
        let e = Fail::from(CacheError::Device(fault)).to_c();
        assert_eq!((e.code, e.value), (KVPAGE_ERR_DEVICE, 700));
        // SAFETY: the message is NUL-terminated.
        let msg = unsafe { CStr::from_ptr(e.message.as_ptr()) };
        let msg = msg.to_str().expect("UTF-8");
        assert!(
            msg.starts_with("CUDA backend: cuStreamSynchronize failed: "),
            "{msg}"
        );
        #[cfg(feature = "cuda")]
        assert!(msg.contains("CUDA_ERROR_ILLEGAL_ADDRESS (700): "), "{msg}");
    }

    #[test]
    fn a_panic_becomes_a_code_and_success_leaves_the_struct_alone() {
        let mut e = core::mem::MaybeUninit::<kvpage_error>::zeroed();
        // SAFETY: writable.
        let code = unsafe { run(e.as_mut_ptr(), || panic!("boom")) };
        assert_eq!(code, KVPAGE_ERR_INTERNAL);
        let mut untouched = core::mem::MaybeUninit::<kvpage_error>::zeroed();
        // SAFETY: writable; null is allowed too.
        unsafe {
            assert_eq!(run(untouched.as_mut_ptr(), || Ok(())), KVPAGE_OK);
            assert_eq!(
                run(core::ptr::null_mut(), || Err(Fail::null("x"))),
                KVPAGE_ERR_NULL_POINTER
            );
        }
        // SAFETY: zeroed is a valid kvpage_error (code 0 = KVPAGE_OK).
        let untouched = unsafe { untouched.assume_init() };
        assert_eq!(untouched.code, KVPAGE_OK);
        assert_eq!(untouched.message[0], 0);
    }
}
