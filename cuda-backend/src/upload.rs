//! Planning a step's metadata upload in as few copies as possible. Plain Rust.
//!
//! The pinned host staging buffer and the device metadata buffer share one layout
//! ([`crate::sizing::MetadataLayout`]), and the staging buffer's block-table section
//! mirrors the device's: after every upload the two hold the same bytes. A step then
//! copies the core's block-table rows of its sequences into the staging mirror, only
//! the columns that differ ([`stage_block_table`]), and uploads the byte ranges that
//! changed, merged when they are close ([`UploadPlan`]): a decode step that adds no
//! block uploads no block-table byte at all, one that adds a block to each of 64
//! sequences uploads those 64 words (merged into one copy when the rows are near).
//!
//! Invariant of an [`UploadPlan`]: the union of its ranges covers every range added
//! since the last [`UploadPlan::clear`], and copying more than was added is harmless
//! (outside the added ranges the staging buffer already equals the device buffer).

/// A byte range of the metadata area to copy host → device (same offset on both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CopyRange {
    /// First byte.
    pub offset: usize,
    /// Bytes.
    pub bytes: usize,
}

impl CopyRange {
    /// One past the last byte (saturating). O(1).
    pub const fn end(&self) -> usize {
        self.offset.saturating_add(self.bytes)
    }
}

/// The ranges of one upload, merged: a range that starts at most `merge_gap` bytes
/// after the end of the last one extends it (one copy of a few extra bytes is cheaper
/// than another copy's launch). Holds at most the capacity given at construction; a
/// range that does not fit widens the last range to cover it instead (still correct:
/// see the module's invariant). Allocates only in [`UploadPlan::new`].
#[derive(Debug, Clone)]
pub struct UploadPlan {
    ranges: Vec<CopyRange>,
    max_ranges: usize,
    merge_gap: usize,
}

impl UploadPlan {
    /// A plan of at most `max_ranges` (at least 1) copies, merging gaps up to
    /// `merge_gap` bytes. O(max_ranges) (its one allocation).
    pub fn new(max_ranges: usize, merge_gap: usize) -> Self {
        let max_ranges = max_ranges.max(1);
        Self {
            ranges: Vec::with_capacity(max_ranges),
            max_ranges,
            merge_gap,
        }
    }

    /// Forgets every range (after the upload). O(1).
    pub fn clear(&mut self) {
        self.ranges.clear();
    }

    /// The copies to make, in the order added (ascending when added ascending). O(1).
    pub fn ranges(&self) -> &[CopyRange] {
        &self.ranges
    }

    /// Bytes the copies move. O(ranges).
    pub fn bytes(&self) -> usize {
        self.ranges.iter().map(|r| r.bytes).sum()
    }

    /// Adds `[offset, offset + bytes)`; empty ranges are ignored. Cheapest when ranges
    /// come in ascending order (each merges with or follows the last). O(1); never
    /// allocates.
    pub fn add(&mut self, offset: usize, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let new = CopyRange { offset, bytes };
        let full = self.ranges.len() == self.max_ranges;
        if let Some(last) = self.ranges.last_mut() {
            let close = new.offset >= last.offset
                && new.offset <= last.end().saturating_add(self.merge_gap);
            if close || full {
                // The hull of both: covers the last range and the new one.
                let start = last.offset.min(new.offset);
                let end = last.end().max(new.end());
                *last = CopyRange {
                    offset: start,
                    bytes: end - start,
                };
                return;
            }
        }
        self.ranges.push(new);
    }
}

/// One block-table row of a step: the row and how many of its leading entries the
/// kernels read (`ceil(context_len / block_size)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowUse {
    /// Block-table row (the sequence's index).
    pub row: u32,
    /// Leading entries in use.
    pub blocks: u32,
}

/// Why a block table cannot be staged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageError {
    /// A row or its used entries lie outside the table (`row >= rows` or
    /// `blocks > stride`), or the tables' lengths differ. Nothing was staged.
    OutOfTable {
        /// The row.
        row: u32,
        /// Its entries in use.
        blocks: u32,
    },
    /// More distinct changed rows than the `changed` buffer holds. Nothing was staged.
    TooManyRows,
}

impl core::fmt::Display for StageError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::OutOfTable { row, blocks } => {
                write!(
                    f,
                    "block-table row {row} with {blocks} entries is outside the table"
                )
            }
            Self::TooManyRows => f.write_str("more changed rows than the step buffer holds"),
        }
    }
}

impl std::error::Error for StageError {}

/// A changed run of one row: columns `first..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct RowChange {
    /// The row.
    pub row: u32,
    /// First changed column.
    pub first: u32,
    /// One past the last changed column.
    pub end: u32,
}

/// Copies into `staged` (the staging mirror of the device block table, `stride` entries
/// a row, as long as `table`) the entries of `rows` that differ from the core's `table`,
/// and adds their byte ranges (the table section starts at `table_offset` in the
/// metadata area) to `plan` in ascending order. Only the first `blocks` entries of each
/// row are compared: the kernels read no others. `changed` is caller storage for one
/// entry per changed row of `rows` (preallocated: as many entries as a step has rows).
/// Returns the number of changed entries of `rows`. O(Σ blocks + changed × log
/// changed); never allocates.
///
/// # Errors
/// [`StageError::OutOfTable`], [`StageError::TooManyRows`]; all rows are checked before
/// anything is written, so on error `staged` and `plan` are unchanged.
pub fn stage_block_table(
    staged: &mut [u32],
    table: &[u32],
    stride: usize,
    rows: &[RowUse],
    table_offset: usize,
    changed: &mut [RowChange],
    plan: &mut UploadPlan,
) -> Result<usize, StageError> {
    let mut n = 0usize;
    for &RowUse { row, blocks } in rows {
        let start = (row as usize).checked_mul(stride);
        let range = start.and_then(|s| Some(s..s.checked_add(blocks as usize)?));
        let (Some(range), true) = (
            range,
            blocks as usize <= stride && staged.len() == table.len(),
        ) else {
            return Err(StageError::OutOfTable { row, blocks });
        };
        let (Some(old), Some(new)) = (staged.get(range.clone()), table.get(range)) else {
            return Err(StageError::OutOfTable { row, blocks });
        };
        let Some(first) = old.iter().zip(new).position(|(a, b)| a != b) else {
            continue;
        };
        let last = old
            .iter()
            .zip(new)
            .rposition(|(a, b)| a != b)
            .unwrap_or(first);
        let slot = changed.get_mut(n).ok_or(StageError::TooManyRows)?;
        *slot = RowChange {
            row,
            first: first as u32,
            end: last as u32 + 1,
        };
        n += 1;
    }
    let changed = &mut changed[..n];
    changed.sort_unstable();
    // A row listed twice has two entries, now adjacent: stage the hull of both.
    let mut i = 0;
    while let Some(&c) = changed.get(i) {
        let mut hull = c;
        i += 1;
        while let Some(d) = changed.get(i).filter(|d| d.row == c.row) {
            hull.first = hull.first.min(d.first);
            hull.end = hull.end.max(d.end);
            i += 1;
        }
        let at = hull.row as usize * stride;
        let cols = at + hull.first as usize..at + hull.end as usize;
        staged[cols.clone()].copy_from_slice(&table[cols.clone()]);
        plan.add(table_offset + cols.start * 4, cols.len() * 4);
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn adjacent_and_close_ranges_merge() {
        let mut p = UploadPlan::new(8, 16);
        p.add(0, 64);
        p.add(64, 32); // adjacent
        p.add(100, 4); // 4-byte gap
        p.add(1000, 4); // far
        p.add(0, 0); // empty: ignored
        assert_eq!(
            p.ranges(),
            &[
                CopyRange {
                    offset: 0,
                    bytes: 104
                },
                CopyRange {
                    offset: 1000,
                    bytes: 4
                }
            ]
        );
        p.clear();
        assert!(p.ranges().is_empty());
    }

    #[test]
    fn a_full_plan_widens_its_last_range() {
        let mut p = UploadPlan::new(2, 0);
        p.add(0, 4);
        p.add(100, 4);
        p.add(200, 4);
        p.add(50, 4); // out of order, full: the hull of [100, 204) and [50, 54)
        assert_eq!(
            p.ranges(),
            &[
                CopyRange {
                    offset: 0,
                    bytes: 4
                },
                CopyRange {
                    offset: 50,
                    bytes: 154
                }
            ]
        );
    }

    #[test]
    fn unchanged_rows_upload_nothing_and_bad_rows_change_nothing() {
        let table = vec![1u32, 2, 3, 4, 5, 6];
        let mut staged = table.clone();
        let mut changed = [RowChange::default(); 2];
        let mut plan = UploadPlan::new(4, 0);
        let rows = [RowUse { row: 0, blocks: 3 }, RowUse { row: 1, blocks: 2 }];
        let n = stage_block_table(&mut staged, &table, 3, &rows, 0, &mut changed, &mut plan);
        assert_eq!(n, Ok(0));
        assert!(plan.ranges().is_empty());
        let mut other = table.clone();
        other[0] = 9;
        for bad in [RowUse { row: 2, blocks: 1 }, RowUse { row: 0, blocks: 4 }] {
            let r = stage_block_table(
                &mut staged,
                &other,
                3,
                &[RowUse { row: 0, blocks: 1 }, bad],
                0,
                &mut changed,
                &mut plan,
            );
            assert_eq!(
                r,
                Err(StageError::OutOfTable {
                    row: bad.row,
                    blocks: bad.blocks
                })
            );
            assert_eq!(staged, table);
            assert!(plan.ranges().is_empty());
        }
    }

    #[test]
    fn too_small_a_change_buffer_stages_nothing() {
        let table = vec![1u32, 2, 3, 4];
        let mut staged = vec![0u32; 4];
        let mut changed = [RowChange::default(); 1];
        let mut plan = UploadPlan::new(4, 0);
        let rows = [RowUse { row: 0, blocks: 2 }, RowUse { row: 1, blocks: 2 }];
        let r = stage_block_table(&mut staged, &table, 2, &rows, 0, &mut changed, &mut plan);
        assert_eq!(r, Err(StageError::TooManyRows));
        assert_eq!(staged, [0; 4]);
        assert!(plan.ranges().is_empty());
    }

    #[test]
    fn a_decode_step_uploads_only_the_new_entries() {
        // 4 rows of 8; rows 1 and 3 got a new block in column 2.
        let stride = 8;
        let mut table = vec![0u32; 32];
        let mut staged = table.clone();
        table[stride + 2] = 7;
        table[3 * stride + 2] = 9;
        let rows: Vec<RowUse> = (0..4).map(|row| RowUse { row, blocks: 3 }).collect();
        let mut changed = [RowChange::default(); 4];
        let mut plan = UploadPlan::new(8, 0);
        let n = stage_block_table(
            &mut staged,
            &table,
            stride,
            &rows,
            4096,
            &mut changed,
            &mut plan,
        );
        assert_eq!(n, Ok(2));
        assert_eq!(staged, table);
        assert_eq!(
            plan.ranges(),
            &[
                CopyRange {
                    offset: 4096 + (stride + 2) * 4,
                    bytes: 4
                },
                CopyRange {
                    offset: 4096 + (3 * stride + 2) * 4,
                    bytes: 4
                }
            ]
        );
    }

    proptest! {
        /// Random tables and edits: after staging and applying the planned copies to a
        /// "device" copy of the old staging mirror, the device holds the core's
        /// entries for every used column of every listed row, no byte outside the
        /// table section is written, ranges ascend and do not overlap, and each
        /// changed row costs at most one range.
        #[test]
        fn planned_copies_bring_the_device_up_to_date(
            rows in 1usize..12,
            stride in 1usize..16,
            seed_table in proptest::collection::vec(0u32..6, 12 * 16),
            edits in proptest::collection::vec((0usize..12, 0usize..16, 0u32..6), 0..24),
            batch in proptest::collection::vec((0usize..12, 0usize..17), 0..16),
            gap in 0usize..64,
            max_ranges in 1usize..6,
        ) {
            let len = rows * stride;
            let old: Vec<u32> = seed_table[..len].to_vec();
            let mut table = old.clone();
            for (r, c, v) in edits {
                if r < rows && c < stride {
                    table[r * stride + c] = v;
                }
            }
            let batch: Vec<RowUse> = batch
                .into_iter()
                .filter(|&(r, b)| r < rows && b <= stride)
                .map(|(r, b)| RowUse { row: r as u32, blocks: b as u32 })
                .collect();
            let offset = 256;
            // The metadata area: 256 bytes before the table, 64 after.
            let area_len = offset + len * 4 + 64;
            let mut device = vec![0xEEu8; area_len];
            for (i, v) in old.iter().enumerate() {
                device[offset + 4 * i..offset + 4 * i + 4].copy_from_slice(&v.to_le_bytes());
            }
            let mut staged = old.clone();
            let mut changed = vec![RowChange::default(); batch.len()];
            let mut plan = UploadPlan::new(max_ranges, gap);
            let n = stage_block_table(&mut staged, &table, stride, &batch, offset, &mut changed, &mut plan)
                .expect("rows are in range");
            prop_assert!(plan.ranges().len() <= n.min(max_ranges));
            let staged_area = {
                let mut a = vec![0xEEu8; area_len];
                for (i, v) in staged.iter().enumerate() {
                    a[offset + 4 * i..offset + 4 * i + 4].copy_from_slice(&v.to_le_bytes());
                }
                a
            };
            let mut prev_end = 0;
            for r in plan.ranges() {
                prop_assert!(r.offset >= prev_end);
                prop_assert!(r.offset >= offset && r.end() <= offset + len * 4);
                prev_end = r.end();
                device[r.offset..r.end()].copy_from_slice(&staged_area[r.offset..r.end()]);
            }
            for u in &batch {
                for c in 0..u.blocks as usize {
                    let i = u.row as usize * stride + c;
                    let got = u32::from_le_bytes(device[offset + 4 * i..offset + 4 * i + 4].try_into().unwrap());
                    prop_assert_eq!(got, table[i]);
                }
            }
            // The device still equals the staging mirror everywhere (the invariant).
            prop_assert_eq!(&device, &staged_area);
        }
    }
}
