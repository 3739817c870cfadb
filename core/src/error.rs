//! Error types of the core. Every misuse by a caller is one of these; nothing panics.
//!
//! Construction has its own errors ([`GeometryError`], [`InitError`]); every sequence
//! operation of [`crate::BlockManager`] returns a [`SeqError`], and each method's docs
//! list the variants it can produce. All of them are `Copy` and carry enough numbers to
//! write a useful message without a formatter on the other side of an FFI boundary.

use core::fmt;

/// A [`crate::Geometry`] that makes no sense or whose sizes overflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum GeometryError {
    /// A dimension (layers, KV heads, head dim or tokens per block) is zero.
    ZeroDimension,
    /// Bytes per block do not fit in a `u64`, or elements per block in a `u32` row.
    Overflow,
}

impl fmt::Display for GeometryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ZeroDimension => f.write_str("geometry has a zero dimension"),
            Self::Overflow => f.write_str("geometry sizes overflow"),
        }
    }
}

impl core::error::Error for GeometryError {}

/// Why a [`crate::BlockManager`] could not be built from a [`crate::Config`] and storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum InitError {
    /// `num_blocks`, `block_size`, `max_seqs` or `max_blocks_per_seq` is zero.
    ZeroSize,
    /// The configuration is too large to address: a token slot (`block * block_size +
    /// offset`) or a table index would not fit in a `u32`, or the storage in a `usize`.
    TooLarge,
    /// The storage slice is shorter than [`crate::Config::storage_words`].
    StorageTooSmall {
        /// Words the configuration needs.
        needed: usize,
        /// Words the caller passed.
        got: usize,
    },
}

impl fmt::Display for InitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ZeroSize => f.write_str("configuration has a zero size"),
            Self::TooLarge => f.write_str("configuration too large to address with u32 slots"),
            Self::StorageTooSmall { needed, got } => {
                write!(f, "storage too small: need {needed} words, got {got}")
            }
        }
    }
}

impl core::error::Error for InitError {}

/// Why a sequence operation failed. A failed operation changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum SeqError {
    /// The handle names a sequence that was released (or never existed).
    StaleHandle,
    /// The handle was made by another manager.
    ForeignHandle,
    /// All `max_seqs` sequence slots are in use.
    NoFreeSequence,
    /// The sequence would need more than `max_blocks_per_seq` blocks.
    TooLong {
        /// Tokens the sequence would hold.
        tokens: u64,
        /// Tokens a sequence can hold at most.
        max_tokens: u64,
    },
    /// Not enough free or evictable blocks.
    OutOfBlocks {
        /// Blocks the operation needs.
        needed: u32,
        /// Blocks that are free or cached (evictable).
        available: u32,
    },
    /// The slot output buffer is shorter than the number of new tokens.
    SlotBufferTooSmall {
        /// Slots the operation writes.
        needed: usize,
        /// Length of the buffer passed.
        got: usize,
    },
    /// The sequence is swapped out to the host tier: swap it in first.
    Swapped,
    /// `swap_in` / `release_swapped` of a sequence that is not swapped out.
    NotSwapped,
    /// The host tier has too few free blocks for a swap-out.
    HostFull {
        /// Blocks the swap needs.
        needed: u32,
        /// Free host blocks.
        available: u32,
    },
    /// The copy output buffer of a swap is shorter than the blocks of the sequence.
    MoveBufferTooSmall {
        /// Copies the operation writes.
        needed: usize,
        /// Length of the buffer passed.
        got: usize,
    },
    /// `truncate` to a length greater than the current one.
    BeyondLength {
        /// Requested length.
        requested: u32,
        /// Current length.
        len: u32,
    },
    /// A token range `first..end` of an edit that is reversed or reaches past the
    /// sequence's length.
    BadRange {
        /// First token index of the range.
        first: u32,
        /// End (exclusive) of the range.
        end: u32,
        /// Tokens the sequence holds.
        len: u32,
    },
    /// The positions an edit or [`crate::BlockManager::set_position_runs`] asks for are
    /// not strictly increasing in token order, do not start at token 0, or leave the
    /// `u32` range (also when an append would need a position past `u32::MAX`).
    BadPositions,
    /// The sequence's positions would need more runs than
    /// [`crate::Config::max_position_runs`].
    TooManyPositionRuns {
        /// Runs needed.
        needed: u32,
        /// Runs a sequence can hold.
        capacity: u32,
    },
    /// The sequence's namespace would hold more blocks than its
    /// [`crate::NamespaceQuota::max_blocks`], even after evicting its own cached blocks.
    QuotaExceeded {
        /// Blocks the operation needs.
        needed: u32,
        /// Blocks the quota still allows (its own evictable cached blocks included).
        allowed: u32,
    },
}

/// Why [`crate::BlockManager::set_namespace_quota`] failed. A failed call changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum QuotaError {
    /// `reserved_blocks` exceeds `max_blocks`.
    ReserveAboveLimit,
    /// The namespace has no slot and all [`crate::Config::max_namespaces`] are taken.
    TableFull,
    /// The namespace's used and pinned blocks alone exceed the new limit.
    HeldAboveLimit {
        /// Blocks the namespace holds that cannot be evicted.
        held: u32,
        /// The limit asked for.
        limit: u32,
    },
    /// The free blocks cannot cover the reservations (this one included): evict cached
    /// blocks or release sequences first.
    ReserveUnavailable {
        /// Free blocks all reservations would need.
        needed: u32,
        /// Free blocks (after evicting the namespace's own blocks above its limit).
        free: u32,
    },
}

impl fmt::Display for QuotaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ReserveAboveLimit => f.write_str("reserved blocks exceed the block limit"),
            Self::TableFull => f.write_str("namespace table full"),
            Self::HeldAboveLimit { held, limit } => {
                write!(f, "namespace holds {held} blocks, above the limit {limit}")
            }
            Self::ReserveUnavailable { needed, free } => {
                write!(f, "reservations need {needed} free blocks, {free} free")
            }
        }
    }
}

impl core::error::Error for QuotaError {}

impl fmt::Display for SeqError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::StaleHandle => f.write_str("stale sequence handle"),
            Self::ForeignHandle => f.write_str("sequence handle belongs to another manager"),
            Self::NoFreeSequence => f.write_str("no free sequence slot"),
            Self::TooLong { tokens, max_tokens } => {
                write!(
                    f,
                    "sequence of {tokens} tokens exceeds the maximum of {max_tokens}"
                )
            }
            Self::OutOfBlocks { needed, available } => {
                write!(f, "out of blocks: need {needed}, {available} available")
            }
            Self::SlotBufferTooSmall { needed, got } => {
                write!(f, "slot buffer too small: need {needed}, got {got}")
            }
            Self::Swapped => f.write_str("sequence is swapped out"),
            Self::NotSwapped => f.write_str("sequence is not swapped out"),
            Self::HostFull { needed, available } => {
                write!(f, "host tier full: need {needed} blocks, {available} free")
            }
            Self::MoveBufferTooSmall { needed, got } => {
                write!(f, "move buffer too small: need {needed}, got {got}")
            }
            Self::BeyondLength { requested, len } => {
                write!(
                    f,
                    "cannot truncate to {requested}: sequence holds {len} tokens"
                )
            }
            Self::BadRange { first, end, len } => {
                write!(
                    f,
                    "token range {first}..{end} is not within the sequence's {len} tokens"
                )
            }
            Self::BadPositions => f.write_str("positions not strictly increasing or out of range"),
            Self::TooManyPositionRuns { needed, capacity } => {
                write!(
                    f,
                    "positions need {needed} runs, a sequence holds {capacity}"
                )
            }
            Self::QuotaExceeded { needed, allowed } => {
                write!(
                    f,
                    "namespace quota exceeded: need {needed} blocks, {allowed} allowed"
                )
            }
        }
    }
}

impl core::error::Error for SeqError {}

/// Why [`crate::BlockManager::import_block`] refused a block. A refused import changes
/// nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum ImportError {
    /// The manager was configured without a prefix cache ([`crate::Config::prefix_cache`]).
    PrefixCacheOff,
    /// The token ids are not exactly one block's worth.
    WrongTokenCount {
        /// Ids given.
        got: usize,
        /// The block size.
        expected: u32,
    },
    /// The parent is not a registered block of the same namespace.
    BadParent {
        /// The block given as parent.
        block: u32,
    },
    /// No free block is left that the namespace may take (imports never evict).
    OutOfBlocks,
    /// The namespace is at its [`crate::NamespaceQuota::max_blocks`].
    QuotaExceeded,
}

impl fmt::Display for ImportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PrefixCacheOff => f.write_str("the prefix cache is off"),
            Self::WrongTokenCount { got, expected } => {
                write!(f, "a block holds {expected} token ids, got {got}")
            }
            Self::BadParent { block } => {
                write!(
                    f,
                    "parent block {block} is not registered in this namespace"
                )
            }
            Self::OutOfBlocks => f.write_str("no free block to import into"),
            Self::QuotaExceeded => f.write_str("the namespace is at its block limit"),
        }
    }
}

impl core::error::Error for ImportError {}

/// Why [`crate::BlockManager::events_since`] refused a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum EventError {
    /// The requested sequence number was never issued: it is past the next event's
    /// (a reader that followed another manager, or an earlier run of this one).
    FutureSeq {
        /// The sequence number asked for.
        requested: u64,
        /// The sequence number the next event gets.
        next: u64,
    },
}

impl fmt::Display for EventError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::FutureSeq { requested, next } => write!(
                f,
                "event {requested} was never issued (the next event is {next})"
            ),
        }
    }
}

impl core::error::Error for EventError {}
