//! Storing the K and V of new tokens at their slots.

use super::attention::check_len;
use crate::arena::KvLayout;
use crate::dtype::Element;
use crate::error::{Buffer, KernelError};

/// Writes the keys and values of `slots.len()` new tokens of one layer: token `i` goes
/// to slot `slots[i]` (block `slot / block_size`, offset `slot % block_size`, as the
/// core's slot mapping reports), rounded to the arena's storage type.
///
/// `k` and `v` are `[tokens][kv_heads][head_dim]` in `f32`. A slot listed twice ends up
/// holding the later token. O(tokens × kv_heads × head_dim), single-threaded (it moves
/// one token's worth of data per slot, far less than attention reads).
///
/// # Errors
/// Nothing is written on error. [`KernelError::DTypeMismatch`] if `T` is not the
/// geometry's dtype, [`KernelError::BadLayout`] if `slots.len() × kv_heads × head_dim`
/// overflows `usize`, [`KernelError::BufferLength`] for a wrong `arena`, `k` or `v`
/// length, [`KernelError::LayerOutOfRange`], [`KernelError::SlotOutOfRange`].
pub fn write_kv<T: Element>(
    layout: &KvLayout,
    arena: &mut [T],
    layer: u32,
    slots: &[u32],
    k: &[f32],
    v: &[f32],
) -> Result<(), KernelError> {
    write_with(layout, arena, layer, slots, k, v, T::narrow)
}

/// [`write_kv`] with `k` and `v` already in the storage type `T` (e.g. an f16 model
/// writing an f16 arena): copied as they are, no rounding. O(tokens × kv_heads ×
/// head_dim), single-threaded.
///
/// # Errors
/// As [`write_kv`]; [`KernelError::DTypeMismatch`] if `T` is not the geometry's dtype.
pub fn write_kv_as<T: Element>(
    layout: &KvLayout,
    arena: &mut [T],
    layer: u32,
    slots: &[u32],
    k: &[T],
    v: &[T],
) -> Result<(), KernelError> {
    write_with(layout, arena, layer, slots, k, v, |src, dst: &mut [T]| {
        dst.copy_from_slice(src);
    })
}

/// The checks and the scatter of [`write_kv`] for inputs of type `S`, stored into the
/// arena's `T` by `store` (one head's `head_dim` elements at a time, equal lengths).
fn write_with<T: Element, S>(
    layout: &KvLayout,
    arena: &mut [T],
    layer: u32,
    slots: &[u32],
    k: &[S],
    v: &[S],
    store: impl Fn(&[S], &mut [T]),
) -> Result<(), KernelError> {
    layout.check_element::<T>()?;
    let g = layout.geometry();
    let hd = g.head_dim() as usize;
    let heads = g.kv_heads();
    // Up to 2^40 elements per token (u32 heads × 256 dims): times a caller's token count
    // it can overflow.
    let row = heads as usize * hd;
    let kv_len = slots.len().checked_mul(row).ok_or(KernelError::BadLayout)?;
    check_len(Buffer::Arena, layout.arena_elems(), arena.len())?;
    if layer >= g.layers() {
        return Err(KernelError::LayerOutOfRange {
            layer,
            layers: g.layers(),
        });
    }
    check_len(Buffer::Keys, kv_len, k.len())?;
    check_len(Buffer::Values, kv_len, v.len())?;
    if let Some(&slot) = slots.iter().find(|&&s| u64::from(s) >= layout.num_slots()) {
        return Err(KernelError::SlotOutOfRange {
            slot,
            slots: layout.num_slots(),
        });
    }
    let bs = g.block_size();
    for (i, &slot) in slots.iter().enumerate() {
        let (block, offset) = (slot / bs, (slot % bs) as usize);
        for h in 0..heads {
            let src = i * row + h as usize * hd;
            for (kv, input) in [(0, k), (1, v)] {
                let dst = layout.tile_offset_in_range(block, layer, kv, h) + offset * hd;
                store(&input[src..src + hd], &mut arena[dst..dst + hd]);
            }
        }
    }
    Ok(())
}
