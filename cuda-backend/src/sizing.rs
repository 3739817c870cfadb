//! Sizing of the device memory a cache reserves at start-up: the arena (a fraction of
//! free memory, a byte count or a block count) and the per-step metadata buffers at
//! their maximum size, so that no step allocates. Plain Rust, no driver.
//!
//! Every function here is O(1) and checked: sizes that overflow, a fraction outside
//! `(0, 1]` or an arena too small for one block are typed errors, never panics.

use kvpage_core::Geometry;

/// How large the device arena is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ArenaSize {
    /// This fraction of the device's free memory (after the metadata buffers and the
    /// caller's `reserve`), in `(0, 1]`.
    FractionOfFree(f64),
    /// As many whole blocks as fit in this many bytes.
    Bytes(u64),
    /// This many blocks.
    Blocks(u32),
}

/// Why the arena cannot be sized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SizingError {
    /// A fraction outside `(0, 1]` (or not a number).
    BadFraction(f64),
    /// Not one block fits (the free memory, the byte count or the block count is too
    /// small).
    TooSmall {
        /// Bytes available for the arena.
        available: u64,
        /// Bytes of one block.
        bytes_per_block: u64,
    },
    /// A count (rows, tokens, pairs) is zero, or a buffer's size overflows.
    BadLimits,
}

impl core::fmt::Display for SizingError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::BadFraction(x) => write!(f, "arena fraction {x} is not within (0, 1]"),
            Self::TooSmall {
                available,
                bytes_per_block,
            } => write!(
                f,
                "{available} bytes do not hold one block of {bytes_per_block} bytes"
            ),
            Self::BadLimits => f.write_str("step limits are zero or their buffers overflow"),
        }
    }
}

impl std::error::Error for SizingError {}

/// The most slots a `u32` slot index reaches: `num_blocks * block_size <= 2^32`.
const MAX_SLOTS: u64 = 1 << 32;
/// The core's largest pool (its prefix hash table is sized from it): 2^30 blocks.
const MAX_BLOCKS: u64 = 1 << 30;

/// The arena's block count for `size`, given the device's `free` bytes (from
/// `cuMemGetInfo`, read after the metadata buffers are allocated) and `reserve` bytes
/// to leave free (the caller's activations, other libraries). At most 2^30 blocks and
/// 2^32 slots (the core's and the kernels' index limits). O(1).
///
/// # Errors
/// [`SizingError::BadFraction`], [`SizingError::TooSmall`] when not one block fits.
pub fn arena_blocks(
    geometry: &Geometry,
    size: ArenaSize,
    free: u64,
    reserve: u64,
) -> Result<u32, SizingError> {
    let per_block = geometry.bytes_per_block();
    let (available, blocks) = match size {
        ArenaSize::Blocks(n) => (u64::from(n).saturating_mul(per_block), u64::from(n)),
        ArenaSize::Bytes(b) => (b, b / per_block),
        ArenaSize::FractionOfFree(f) => {
            if !(f > 0.0 && f <= 1.0) {
                return Err(SizingError::BadFraction(f));
            }
            let usable = free.saturating_sub(reserve);
            // f64 holds 53 bits: exact enough for byte counts; the product is <= usable.
            let bytes = ((usable as f64) * f).floor() as u64;
            let bytes = bytes.min(usable);
            (bytes, bytes / per_block)
        }
    };
    let max = MAX_BLOCKS.min(MAX_SLOTS / u64::from(geometry.block_size()));
    let blocks = blocks.min(max);
    if blocks == 0 {
        return Err(SizingError::TooSmall {
            available,
            bytes_per_block: per_block,
        });
    }
    // `max <= 2^30` keeps it in a `u32`.
    Ok(blocks as u32)
}

/// The most one step of a device cache can ask for: the metadata buffers are allocated
/// at this size once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLimits {
    /// Block-table rows (`max_seqs`).
    pub rows: u32,
    /// Block-table columns (`max_blocks_per_seq`).
    pub row_blocks: u32,
    /// Sequences in one attention launch (at most `rows`).
    pub batch_seqs: u32,
    /// Tokens whose K/V one write launch stores (slot mapping entries).
    pub step_tokens: u32,
    /// Block copies in one launch (copy-on-write, swaps).
    pub copy_pairs: u32,
}

/// One buffer inside the metadata area: `[offset, offset + bytes)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Section {
    /// Byte offset from the start of the area (a multiple of [`SECTION_ALIGN`]).
    pub offset: usize,
    /// Bytes reserved.
    pub bytes: usize,
}

impl Section {
    /// One past the last byte. O(1).
    pub const fn end(&self) -> usize {
        self.offset + self.bytes
    }
}

/// Alignment of every section (the driver's allocation granularity for a
/// `cuMemAlloc`, and more than any kernel's vector loads need).
pub const SECTION_ALIGN: usize = 256;

/// Bytes of one `KvpSeqDesc` (row, context length, queries, first query row: 4 `u32`).
pub const SEQ_DESC_BYTES: usize = 16;

/// Where each per-step buffer lives in the metadata area; the device buffer and the
/// pinned host staging buffer share it, so a range of one is the same range of the
/// other. Per-step sections come first and the block table last: the sequence
/// descriptors and the slot mapping of a step are uploaded by one copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetadataLayout {
    /// `KvpSeqDesc` per sequence of a launch.
    pub seqs: Section,
    /// One `u32` slot per token of a write.
    pub slots: Section,
    /// `(src, dst)` `u32` pairs of a copy launch.
    pub pairs: Section,
    /// The block table: `rows × row_blocks` `u32`, row-major (the core's).
    pub block_table: Section,
    /// Bytes of the whole area.
    pub bytes: usize,
}

impl MetadataLayout {
    /// Lays the sections out for `limits`. O(1).
    ///
    /// # Errors
    /// [`SizingError::BadLimits`] for a zero count or a size that overflows `usize`.
    pub fn new(limits: StepLimits) -> Result<Self, SizingError> {
        let StepLimits {
            rows,
            row_blocks,
            batch_seqs,
            step_tokens,
            copy_pairs,
        } = limits;
        if [rows, row_blocks, batch_seqs, step_tokens, copy_pairs].contains(&0) || batch_seqs > rows
        {
            return Err(SizingError::BadLimits);
        }
        let mut at = 0usize;
        let mut section = |count: u64, size: u64| -> Result<Section, SizingError> {
            let bytes = count
                .checked_mul(size)
                .and_then(|b| usize::try_from(b).ok())
                .ok_or(SizingError::BadLimits)?;
            let offset = at;
            at = offset
                .checked_add(bytes)
                .and_then(|e| e.checked_next_multiple_of(SECTION_ALIGN))
                .ok_or(SizingError::BadLimits)?;
            Ok(Section { offset, bytes })
        };
        let seqs = section(u64::from(batch_seqs), SEQ_DESC_BYTES as u64)?;
        let slots = section(u64::from(step_tokens), 4)?;
        let pairs = section(u64::from(copy_pairs), 8)?;
        let block_table = section(u64::from(rows) * u64::from(row_blocks), 4)?;
        Ok(Self {
            seqs,
            slots,
            pairs,
            block_table,
            bytes: at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpage_core::DType;

    fn llama() -> Geometry {
        // 32 layers, 8 KV heads, 128 dims, 16 tokens, f16: 2 MiB per block.
        Geometry::new(32, 8, 128, 16, DType::F16).unwrap()
    }

    #[test]
    fn fraction_of_free_memory_leaves_the_reserve() {
        let g = llama();
        assert_eq!(g.bytes_per_block(), 2 << 20);
        let gib = 1u64 << 30;
        // 80 GiB free, keep 8 GiB: 90% of 72 GiB = 64.8 GiB -> 32 * 1036.8 = 33177 blocks.
        let n = arena_blocks(&g, ArenaSize::FractionOfFree(0.9), 80 * gib, 8 * gib).unwrap();
        assert_eq!(n, 33177);
        assert!(u64::from(n) * g.bytes_per_block() <= 72 * gib);
        // The whole of it.
        let n = arena_blocks(&g, ArenaSize::FractionOfFree(1.0), 80 * gib, 0).unwrap();
        assert_eq!(n, 80 * 512);
    }

    #[test]
    fn bad_fractions_and_tiny_arenas_are_errors() {
        let g = llama();
        for f in [0.0, -0.5, 1.5, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                arena_blocks(&g, ArenaSize::FractionOfFree(f), 1 << 40, 0),
                Err(SizingError::BadFraction(_))
            ));
        }
        let small = arena_blocks(&g, ArenaSize::FractionOfFree(0.5), 3 << 20, 0);
        assert_eq!(
            small,
            Err(SizingError::TooSmall {
                available: 3 << 19,
                bytes_per_block: 2 << 20
            })
        );
        // The reserve takes everything.
        assert!(arena_blocks(&g, ArenaSize::FractionOfFree(1.0), 1 << 30, 2 << 30).is_err());
        assert!(arena_blocks(&g, ArenaSize::Bytes((2 << 20) - 1), 0, 0).is_err());
        assert!(arena_blocks(&g, ArenaSize::Blocks(0), 0, 0).is_err());
    }

    #[test]
    fn bytes_and_blocks_ignore_free_memory() {
        let g = llama();
        assert_eq!(arena_blocks(&g, ArenaSize::Bytes(5 << 20), 0, 0), Ok(2));
        assert_eq!(arena_blocks(&g, ArenaSize::Blocks(7), 0, 0), Ok(7));
    }

    #[test]
    fn block_counts_stop_at_the_slot_and_pool_limits() {
        // A tiny block (1 layer, 1 head, 1 dim, 256 tokens, f32: 2 KiB): 2^32 slots
        // are 2^24 blocks.
        let g = Geometry::new(1, 1, 1, 256, DType::F32).unwrap();
        assert_eq!(
            arena_blocks(&g, ArenaSize::Bytes(u64::MAX), 0, 0),
            Ok(1 << 24)
        );
        let g = Geometry::new(1, 1, 1, 1, DType::F32).unwrap();
        assert_eq!(
            arena_blocks(&g, ArenaSize::Blocks(u32::MAX), 0, 0),
            Ok(1 << 30)
        );
    }

    #[test]
    fn metadata_sections_are_aligned_disjoint_and_ordered() {
        let limits = StepLimits {
            rows: 256,
            row_blocks: 2048,
            batch_seqs: 256,
            step_tokens: 8192,
            copy_pairs: 2048,
        };
        let m = MetadataLayout::new(limits).unwrap();
        let all = [m.seqs, m.slots, m.pairs, m.block_table];
        for s in all {
            assert!(s.offset.is_multiple_of(SECTION_ALIGN));
        }
        for w in all.windows(2) {
            assert!(w[0].end() <= w[1].offset);
        }
        assert_eq!(m.seqs.bytes, 256 * 16);
        assert_eq!(m.slots.bytes, 8192 * 4);
        assert_eq!(m.block_table.bytes, 256 * 2048 * 4);
        assert!(m.bytes >= m.block_table.end() && m.bytes.is_multiple_of(SECTION_ALIGN));
    }

    #[test]
    fn bad_limits_are_refused() {
        let ok = StepLimits {
            rows: 4,
            row_blocks: 4,
            batch_seqs: 4,
            step_tokens: 4,
            copy_pairs: 4,
        };
        assert!(MetadataLayout::new(ok).is_ok());
        for bad in [
            StepLimits { rows: 0, ..ok },
            StepLimits {
                step_tokens: 0,
                ..ok
            },
            StepLimits {
                batch_seqs: 5,
                ..ok
            },
            StepLimits {
                rows: u32::MAX,
                row_blocks: u32::MAX,
                batch_seqs: 1,
                ..ok
            },
        ] {
            assert_eq!(
                MetadataLayout::new(bad),
                Err(SizingError::BadLimits),
                "{bad:?}"
            );
        }
    }
}
