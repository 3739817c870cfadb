//! Storing the K and V of new tokens at their slots.

use super::attention::check_len;
use crate::arena::KvLayout;
use crate::dtype::{bytes_of_mut, Element};
use crate::error::{Buffer, KernelError};
use crate::quant::Code;

/// Writes the keys and values of `slots.len()` new tokens of one layer: token `i` goes
/// to slot `slots[i]` (block `slot / block_size`, offset `slot % block_size`, as the
/// core's slot mapping reports), rounded to the arena's storage type.
///
/// `k` and `v` are `[tokens][kv_heads][head_dim]` in `f32`. A slot listed twice ends up
/// holding the later token. With 8-bit storage ([`kvpage_core::DType::is_scaled`]) each
/// (token, head) row gets its own scale, its largest magnitude over the code's largest,
/// stored after the tile's codes; it never changes after. O(tokens × kv_heads ×
/// head_dim), single-threaded (it moves one token's worth of data per slot, far less
/// than attention reads).
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
    match Code::of(T::DTYPE) {
        None => write_with(layout, arena, layer, slots, k, v, |src, arena, row, _| {
            T::narrow(src, &mut arena[row..row + src.len()]);
        }),
        Some(code) => write_with(
            layout,
            arena,
            layer,
            slots,
            k,
            v,
            |src, arena, row, scale| {
                let absmax = src.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let s = code.scale_for(absmax);
                let bytes = bytes_of_mut(arena);
                for (b, &x) in bytes[row..row + src.len()].iter_mut().zip(src) {
                    *b = code.encode(x, s);
                }
                bytes[scale..scale + 4].copy_from_slice(&s.to_le_bytes());
            },
        ),
    }
}

/// [`write_kv`] with `k` and `v` already in the storage type `T` (e.g. an f16 model
/// writing an f16 arena): copied as they are, no rounding. O(tokens × kv_heads ×
/// head_dim), single-threaded.
///
/// # Errors
/// As [`write_kv`]; [`KernelError::DTypeMismatch`] if `T` is not the geometry's dtype;
/// [`KernelError::ScaledStorage`] for 8-bit storage (codes alone carry no scale).
pub fn write_kv_as<T: Element>(
    layout: &KvLayout,
    arena: &mut [T],
    layer: u32,
    slots: &[u32],
    k: &[T],
    v: &[T],
) -> Result<(), KernelError> {
    layout.check_element::<T>()?;
    if T::DTYPE.is_scaled() {
        return Err(KernelError::ScaledStorage { dtype: T::DTYPE });
    }
    write_with(layout, arena, layer, slots, k, v, |src, arena, row, _| {
        arena[row..row + src.len()].copy_from_slice(src);
    })
}

/// The checks and the scatter of [`write_kv`] for inputs of type `S`, stored into the
/// arena's `T` by `store(row, arena, at, scale_at)`: one head's `head_dim` inputs, to the
/// elements from `at` on (and, for 8-bit storage, the row's scale to the 4 elements at
/// `scale_at`).
fn write_with<T: Element, S>(
    layout: &KvLayout,
    arena: &mut [T],
    layer: u32,
    slots: &[u32],
    k: &[S],
    v: &[S],
    store: impl Fn(&[S], &mut [T], usize, usize),
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
                let tile = layout.tile_offset_in_range(block, layer, kv, h);
                let scale = tile + layout.scales_offset() + offset * 4;
                store(&input[src..src + hd], arena, tile + offset * hd, scale);
            }
        }
    }
    Ok(())
}
