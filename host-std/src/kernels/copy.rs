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
