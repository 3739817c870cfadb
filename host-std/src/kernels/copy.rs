//! Copies of K/V inside and between arenas: whole blocks (copy-on-write, the host side of
//! swaps) and token rows (the moves of a sequence edit).

use super::attention::check_len;
use crate::arena::KvLayout;
use crate::dtype::Element;
use crate::error::{Buffer, KernelError};
use kvpage_core::{BlockCopy, RowMove};

/// Copies block `src` onto block `dst` for every [`BlockCopy`], in order — one range
/// copy of `elems_per_block` elements each, all layers at once. Run the copies the core
/// reports (a copy-on-write) before writing the new tokens.
/// O(copies × elems_per_block).
///
/// # Errors
/// Nothing is copied on error. [`KernelError::DTypeMismatch`] if `T` is not the
/// geometry's dtype, [`KernelError::BufferLength`] for a wrong `arena` length,
/// [`KernelError::BlockOutOfRange`], [`KernelError::CopyOntoItself`].
pub fn copy_blocks<T: Element>(
    layout: &KvLayout,
    arena: &mut [T],
    copies: &[BlockCopy],
) -> Result<(), KernelError> {
    layout.check_element::<T>()?;
    check_len(Buffer::Arena, layout.arena_elems(), arena.len())?;
    let blocks = layout.num_blocks();
    for &BlockCopy { src, dst } in copies {
        if let Some(block) = [src, dst].into_iter().find(|&b| b >= blocks) {
            return Err(KernelError::BlockOutOfRange { block, blocks });
        }
        if src == dst {
            return Err(KernelError::CopyOntoItself { block: src });
        }
    }
    let n = layout.elems_per_block();
    for &BlockCopy { src, dst } in copies {
        let s = src as usize * n;
        arena.copy_within(s..s + n, dst as usize * n);
    }
    Ok(())
}

/// Copies block `src` of `from` onto block `dst` of `to` for every copy, in order: the
/// two sides of a swap (device arena and host arena), which share one geometry.
/// O(copies × elems_per_block).
///
/// # Errors
/// Nothing is copied on error. [`KernelError::DTypeMismatch`] if `T` is not the
/// geometries' dtype, [`KernelError::BadLayout`] if the two layouts' geometries differ,
/// [`KernelError::BufferLength`] for a wrong arena length,
/// [`KernelError::BlockOutOfRange`] for a block outside its arena.
pub fn copy_blocks_between<T: Element>(
    from_layout: &KvLayout,
    from: &[T],
    to_layout: &KvLayout,
    to: &mut [T],
    copies: &[BlockCopy],
) -> Result<(), KernelError> {
    from_layout.check_element::<T>()?;
    if from_layout.geometry() != to_layout.geometry() {
        return Err(KernelError::BadLayout);
    }
    check_len(Buffer::Arena, from_layout.arena_elems(), from.len())?;
    check_len(Buffer::Arena, to_layout.arena_elems(), to.len())?;
    for c in copies {
        for (block, blocks) in [
            (c.src, from_layout.num_blocks()),
            (c.dst, to_layout.num_blocks()),
        ] {
            if block >= blocks {
                return Err(KernelError::BlockOutOfRange { block, blocks });
            }
        }
    }
    let n = from_layout.elems_per_block();
    for c in copies {
        let (s, d) = (c.src as usize * n, c.dst as usize * n);
        to[d..d + n].copy_from_slice(&from[s..s + n]);
    }
    Ok(())
}

/// Executes the row moves of a sequence edit ([`kvpage_core::BlockManager::remove_range`]
/// and the other edits), in order: each moves `count` token rows, in every layer, K and
/// V, every KV head, as one `memmove` of `count * head_dim` elements per
/// `[token][head_dim]` tile (overlapping rows within a block are fine). Execute an
/// edit's block copies first. O(moved rows × layers × kv_heads × head_dim).
///
/// # Errors
/// Nothing is moved on error. [`KernelError::DTypeMismatch`] if `T` is not the
/// geometry's dtype, [`KernelError::BufferLength`] for a wrong `arena` length,
/// [`KernelError::SlotOutOfRange`] for a slot past the arena,
/// [`KernelError::BadRowMove`] for a zero count or rows that leave their block.
pub fn move_rows<T: Element>(
    layout: &KvLayout,
    arena: &mut [T],
    moves: &[RowMove],
) -> Result<(), KernelError> {
    layout.check_element::<T>()?;
    check_len(Buffer::Arena, layout.arena_elems(), arena.len())?;
    let g = layout.geometry();
    let bs = g.block_size();
    for m in moves {
        if let Some(slot) = [m.src_slot, m.dst_slot]
            .into_iter()
            .find(|&s| u64::from(s) >= layout.num_slots())
        {
            return Err(KernelError::SlotOutOfRange {
                slot,
                slots: layout.num_slots(),
            });
        }
        let fits = |slot: u32| u64::from(slot % bs) + u64::from(m.count) <= u64::from(bs);
        if m.count == 0 || !fits(m.src_slot) || !fits(m.dst_slot) {
            return Err(KernelError::BadRowMove {
                src_slot: m.src_slot,
                dst_slot: m.dst_slot,
                count: m.count,
            });
        }
    }
    let hd = g.head_dim() as usize;
    let tiles = 2 * g.layers() as usize * g.kv_heads() as usize;
    let (per_block, tile) = (layout.elems_per_block(), layout.tile_elems());
    // The rows' values, and for 8-bit storage their scales (4 elements per row after
    // the tile's values).
    let mut parts = [(0, hd), (layout.scales_offset(), 4)];
    let parts = if g.dtype().is_scaled() {
        &mut parts[..]
    } else {
        &mut parts[..1]
    };
    for m in moves {
        for &mut (base, per_row) in parts.iter_mut() {
            let start = |slot: u32| {
                (slot / bs) as usize * per_block + base + (slot % bs) as usize * per_row
            };
            let (src, dst) = (start(m.src_slot), start(m.dst_slot));
            let n = m.count as usize * per_row;
            for t in 0..tiles {
                let s = src + t * tile;
                arena.copy_within(s..s + n, dst + t * tile);
            }
        }
    }
    Ok(())
}
