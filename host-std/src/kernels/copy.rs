//! Whole-block copies (copy-on-write, and the host side of swaps).

use super::attention::check_len;
use crate::arena::KvLayout;
use crate::dtype::Element;
use crate::error::{Buffer, KernelError};
use kvpage_core::BlockCopy;

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
