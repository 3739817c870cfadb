//! Planning block copies as few range copies: a swap moves whole blocks between the
//! device arena and the pinned host arena (one block is one contiguous range in the
//! block-major layout), and consecutive pairs (`src + 1`, `dst + 1`) form one range.
//! Plain Rust, no allocation.

use kvpage_core::BlockCopy;

/// `blocks` consecutive blocks from `src..` onto `dst..`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRun {
    /// First source block.
    pub src: u32,
    /// First destination block.
    pub dst: u32,
    /// Blocks in the run (at least 1).
    pub blocks: u32,
}

impl BlockRun {
    /// `(source byte offset, destination byte offset, bytes)` of the run for blocks of
    /// `bytes_per_block` bytes, or `None` if a value overflows `u64`. O(1).
    pub fn byte_range(&self, bytes_per_block: u64) -> Option<(u64, u64, u64)> {
        Some((
            u64::from(self.src).checked_mul(bytes_per_block)?,
            u64::from(self.dst).checked_mul(bytes_per_block)?,
            u64::from(self.blocks).checked_mul(bytes_per_block)?,
        ))
    }
}

/// The runs of `copies`, in order: each pair extends the current run when both its
/// blocks follow the run's last ones. Lazy; O(1) per item, O(copies) in all.
pub fn block_runs(copies: &[BlockCopy]) -> impl Iterator<Item = BlockRun> + '_ {
    let mut rest = copies;
    core::iter::from_fn(move || {
        let (first, tail) = rest.split_first()?;
        let mut run = BlockRun {
            src: first.src,
            dst: first.dst,
            blocks: 1,
        };
        let mut used = 0;
        for c in tail {
            let next = run
                .src
                .checked_add(run.blocks)
                .zip(run.dst.checked_add(run.blocks));
            if next != Some((c.src, c.dst)) {
                break;
            }
            run.blocks += 1;
            used += 1;
        }
        rest = &tail[used..];
        Some(run)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn c(src: u32, dst: u32) -> BlockCopy {
        BlockCopy { src, dst }
    }

    #[test]
    fn consecutive_pairs_form_one_run() {
        let copies = [c(4, 0), c(5, 1), c(6, 2), c(9, 3), c(10, 4), c(3, 5)];
        let runs: Vec<_> = block_runs(&copies).collect();
        assert_eq!(
            runs,
            [
                BlockRun {
                    src: 4,
                    dst: 0,
                    blocks: 3
                },
                BlockRun {
                    src: 9,
                    dst: 3,
                    blocks: 2
                },
                BlockRun {
                    src: 3,
                    dst: 5,
                    blocks: 1
                },
            ]
        );
        assert_eq!(block_runs(&[]).count(), 0);
        // No wrap-around at u32::MAX.
        let edge = [c(u32::MAX, 0), c(0, 1)];
        assert_eq!(block_runs(&edge).count(), 2);
        assert_eq!(
            BlockRun {
                src: 2,
                dst: 3,
                blocks: 4
            }
            .byte_range(100),
            Some((200, 300, 400))
        );
    }

    proptest! {
        /// Expanding the runs gives back the copies, in order.
        #[test]
        fn runs_expand_to_the_copies(pairs in proptest::collection::vec((0u32..8, 0u32..8), 0..40)) {
            let copies: Vec<BlockCopy> = pairs.iter().map(|&(s, d)| c(s, d)).collect();
            let expanded: Vec<BlockCopy> = block_runs(&copies)
                .flat_map(|r| (0..r.blocks).map(move |i| c(r.src + i, r.dst + i)))
                .collect();
            prop_assert_eq!(expanded, copies);
        }
    }
}
