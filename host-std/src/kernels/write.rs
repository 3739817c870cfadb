//! Storing the K and V of new tokens at their slots.

use super::attention::check_len;
use crate::arena::KvLayout;
use crate::dtype::{bytes_of_mut, Element};
use crate::error::{Buffer, KernelError};
use crate::quant::{Code, KvScales};

/// Writes the keys and values of `slots.len()` new tokens of one layer: token `i` goes
/// to slot `slots[i]` (block `slot / block_size`, offset `slot % block_size`, as the
/// core's slot mapping reports), rounded to the arena's storage type.
///
/// `k` and `v` are `[tokens][kv_heads][head_dim]` in `f32`. A slot listed twice ends up
/// holding the later token. With 8-bit storage ([`kvpage_core::DType::is_scaled`]) each
/// (token, head) row gets its own scale, its largest magnitude over the code's largest,
/// stored after the tile's codes; it never changes after. A row with a NaN or an
/// infinity among its values stores a NaN scale, so all of it reads back as NaN and
/// attention's outputs that read it are NaN (with the float dtypes the value stays in
/// its element; either way it is never lost to a finite value). O(tokens × kv_heads ×
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
    write_rounded(layout, arena, layer, slots, k, v, None)
}

/// [`write_kv`] into 8-bit storage at the fixed `scales` of the layer: each value is
/// stored as the code of its ratio to its side's scale, saturating at the code's
/// largest magnitude, and the row's scale in the block is that one (NaN for a row with
/// a non-finite value, as in [`write_kv`]). O(tokens × kv_heads × head_dim),
/// single-threaded.
///
/// # Errors
/// As [`write_kv`]; [`KernelError::UnscaledStorage`] for the float dtypes, which keep
/// no scales. Nothing is written on error.
pub fn write_kv_at_scales<T: Element>(
    layout: &KvLayout,
    arena: &mut [T],
    layer: u32,
    slots: &[u32],
    k: &[f32],
    v: &[f32],
    scales: KvScales,
) -> Result<(), KernelError> {
    layout.check_element::<T>()?;
    if !T::DTYPE.is_scaled() {
        return Err(KernelError::UnscaledStorage { dtype: T::DTYPE });
    }
    write_rounded(layout, arena, layer, slots, k, v, Some(scales))
}

/// [`write_kv`] (`scales` `None`: each 8-bit row at the scale of its largest magnitude)
/// or [`write_kv_at_scales`] (8-bit storage only).
fn write_rounded<T: Element>(
    layout: &KvLayout,
    arena: &mut [T],
    layer: u32,
    slots: &[u32],
    k: &[f32],
    v: &[f32],
    scales: Option<KvScales>,
) -> Result<(), KernelError> {
    match Code::of(T::DTYPE) {
        None => write_with(
            layout,
            arena,
            layer,
            slots,
            k,
            v,
            |src, arena, row, _, _| {
                T::narrow(src, &mut arena[row..row + src.len()]);
            },
        ),
        Some(code) => write_with(
            layout,
            arena,
            layer,
            slots,
            k,
            v,
            |src, arena, row, scale, kv| {
                let bytes = bytes_of_mut(arena);
                let codes = &mut bytes[row..row + src.len()];
                let s = match scales {
                    None => code.quantize_row(src, codes),
                    Some(fixed) => code.quantize_row_at(src, codes, fixed.of(kv)),
                };
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
    write_with(
        layout,
        arena,
        layer,
        slots,
        k,
        v,
        |src, arena, row, _, _| {
            arena[row..row + src.len()].copy_from_slice(src);
        },
    )
}

/// The checks and the scatter of [`write_kv`] for inputs of type `S`, stored into the
/// arena's `T` by `store(row, arena, at, scale_at, kv)`: one head's `head_dim` inputs of
/// the keys (`kv` 0) or the values (1), to the elements from `at` on (and, for 8-bit
/// storage, the row's scale to the 4 bytes at `scale_at`).
fn write_with<T: Element, S>(
    layout: &KvLayout,
    arena: &mut [T],
    layer: u32,
    slots: &[u32],
    k: &[S],
    v: &[S],
    store: impl Fn(&[S], &mut [T], usize, usize, usize),
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
                store(
                    &input[src..src + hd],
                    arena,
                    tile + offset * hd,
                    scale,
                    kv as usize,
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! 8-bit storage through the kernels that touch its scales (write, attention, row
    //! moves, key rotation), small enough for Miri, which checks the byte views.
    use super::*;
    use crate::dtype::{bytes_of, Fp8E4m3, Int8};
    use crate::kernels::{
        move_rows, paged_attention, rotate_keys, AttentionParams, BlockTable, KeyShift,
        RopePairing, RopeParams, SeqQuery,
    };
    use kvpage_core::{Geometry, RowMove};

    fn scale_of(arena: &[u8], layout: &KvLayout, block: u32, kv: u32, head: u32, t: usize) -> f32 {
        let at = layout.tile_offset(block, 0, kv, head) + layout.scales_offset() + 4 * t;
        f32::from_le_bytes([arena[at], arena[at + 1], arena[at + 2], arena[at + 3]])
    }

    fn scaled_storage<T: Element>() {
        let code = Code::of(T::DTYPE).unwrap();
        let g = Geometry::new(1, 2, 4, 2, T::DTYPE).unwrap();
        let layout = KvLayout::new(g, 3).unwrap();
        let mut arena = vec![T::default(); layout.arena_elems()];
        // Two tokens into slots 2 and 3 (block 1), one row per head.
        let k = [
            1.0, -2.0, 0.5, 4.0, 3.0, 0.0, -1.0, 1.0, 0.25, 0.5, 8.0, -1.0, 2.0, 2.0, 2.0, 2.0,
        ];
        let v: Vec<f32> = k.iter().map(|x| x * -0.5).collect();
        write_kv(&layout, &mut arena, 0, &[2, 3], &k, &v).unwrap();
        let bytes = bytes_of(&arena).to_vec();
        // Token 1 of block 1, head 0 is [0.25, 0.5, 8.0, -1.0]: its scale maps 8 onto
        // the code's largest.
        let s = scale_of(&bytes, &layout, 1, 0, 0, 1);
        assert_eq!(s, 8.0 / code.max());
        let row = layout.tile_offset(1, 0, 0, 0) + 4;
        assert_eq!(code.decode(bytes[row + 2]) * s, 8.0);
        let raw = arena[..8].to_vec();
        assert_eq!(
            write_kv_as(&layout, &mut arena, 0, &[0], &raw, &raw),
            Err(KernelError::ScaledStorage { dtype: T::DTYPE })
        );

        // Attention of one query head per KV head over the two tokens equals the same
        // computation over the stored values (codes times scales).
        let q = [0.5, 0.25, -1.0, 0.125, -0.5, 1.0, 0.0, 2.0];
        let table = [1u32];
        let bt = BlockTable {
            table: &table,
            stride: 1,
        };
        let params = AttentionParams {
            q_heads: 2,
            scale: 0.5,
            pool: None,
        };
        let mut out = [f32::NAN; 8];
        paged_attention(
            &layout,
            &arena,
            0,
            bt,
            &[SeqQuery::decode(0, 2)],
            &q,
            &mut out,
            params,
        )
        .unwrap();
        for h in 0..2 {
            let stored = |kv: u32, t: usize| -> Vec<f32> {
                let tile = layout.tile_offset(1, 0, kv, h as u32);
                let s = scale_of(&bytes, &layout, 1, kv, h as u32, t);
                (0..4)
                    .map(|d| code.decode(bytes[tile + 4 * t + d]) * s)
                    .collect()
            };
            let score = |t: usize| -> f32 {
                0.5 * stored(0, t)
                    .iter()
                    .zip(&q[4 * h..4 * h + 4])
                    .map(|(a, b)| a * b)
                    .sum::<f32>()
            };
            let (s0, s1) = (score(0), score(1));
            let m = s0.max(s1);
            let (w0, w1) = ((s0 - m).exp(), (s1 - m).exp());
            let (v0, v1) = (stored(1, 0), stored(1, 1));
            for d in 0..4 {
                let want = (w0 * v0[d] + w1 * v1[d]) / (w0 + w1);
                assert!((out[4 * h + d] - want).abs() < 1e-5, "head {h} dim {d}");
            }
        }

        // Moving a row moves its scale; rotating keys keeps a scale that still fits.
        let mv = RowMove {
            src_slot: 3,
            dst_slot: 0,
            count: 1,
        };
        move_rows(&layout, &mut arena, &[mv]).unwrap();
        let moved = bytes_of(&arena).to_vec();
        assert_eq!(
            scale_of(&moved, &layout, 0, 1, 1, 0),
            scale_of(&bytes, &layout, 1, 1, 1, 1)
        );
        let rope = RopeParams {
            base: 10_000.0,
            rotary_dims: 4,
            pairing: RopePairing::Interleaved,
        };
        let shift = KeyShift {
            row: 0,
            first: 0,
            end: 2,
            delta: 3,
        };
        rotate_keys(&layout, &mut arena, bt, &[shift], rope, None).unwrap();
        let after = bytes_of(&arena);
        for t in 0..2 {
            let s = scale_of(after, &layout, 1, 0, 0, t);
            assert!(
                s >= scale_of(&bytes, &layout, 1, 0, 0, t),
                "a scale never shrinks"
            );
        }
    }

    /// A write at fixed scales stores each row's codes at its side's scale, saturated,
    /// and that scale (NaN for a row with a NaN); refused for float storage.
    fn fixed_scales<T: Element>() {
        let code = Code::of(T::DTYPE).unwrap();
        let g = Geometry::new(2, 2, 4, 2, T::DTYPE).unwrap();
        let layout = KvLayout::new(g, 2).unwrap();
        let mut arena = vec![T::default(); layout.arena_elems()];
        let scales = KvScales::new(0.01, 2.0).unwrap();
        // One token, two heads: head 1's keys reach past 0.01 × the code's largest.
        let k = [0.1, -0.2, 0.3, 0.0, 5.0, -9.0, 0.5, f32::NAN];
        let v = [1.0, 2.0, -3.0, 4.0, 100.0, 0.0, -1.0, 0.5];
        write_kv_at_scales(&layout, &mut arena, 1, &[3], &k, &v, scales).unwrap();
        let bytes = bytes_of(&arena).to_vec();
        let at = |kv: u32, h: u32| layout.tile_offset(1, 1, kv, h) + 4;
        let scale = |kv: u32, h: u32| {
            let s = layout.tile_offset(1, 1, kv, h) + layout.scales_offset() + 4;
            f32::from_le_bytes([bytes[s], bytes[s + 1], bytes[s + 2], bytes[s + 3]])
        };
        for h in 0..2u32 {
            for (kv, input, fixed) in [(0, &k, scales.k()), (1, &v, scales.v())] {
                let row = &input[4 * h as usize..4 * h as usize + 4];
                for (d, &x) in row.iter().enumerate() {
                    assert_eq!(bytes[at(kv, h) + d], code.encode(x, fixed), "{kv} {h} {d}");
                }
                let want = if row.iter().all(|x| x.is_finite()) {
                    fixed
                } else {
                    f32::NAN
                };
                assert_eq!(scale(kv, h).to_bits(), want.to_bits(), "{kv} {h}");
            }
        }
        // Head 1's 5 and -9 saturate: their codes are the largest of their sign.
        assert_eq!(code.decode(bytes[at(0, 1)]), code.max());
        assert_eq!(code.decode(bytes[at(0, 1) + 1]), -code.max());
        // The same call with a scale per row stores other scales.
        let mut own = vec![T::default(); layout.arena_elems()];
        write_kv(&layout, &mut own, 1, &[3], &k, &v).unwrap();
        assert_ne!(bytes_of(&own), &bytes[..]);
        assert_eq!(
            write_kv_at_scales(&layout, &mut arena, 2, &[3], &k, &v, scales),
            Err(KernelError::LayerOutOfRange {
                layer: 2,
                layers: 2
            })
        );
        let mut floats = vec![0.0f32; layout.arena_elems()];
        assert_eq!(
            write_kv_at_scales(&layout, &mut floats, 1, &[3], &k, &v, scales),
            Err(KernelError::DTypeMismatch {
                layout: T::DTYPE,
                element: kvpage_core::DType::F32
            })
        );
        let fg = Geometry::new(2, 2, 4, 2, kvpage_core::DType::F32).unwrap();
        let flayout = KvLayout::new(fg, 2).unwrap();
        let mut floats = vec![0.0f32; flayout.arena_elems()];
        assert_eq!(
            write_kv_at_scales(&flayout, &mut floats, 1, &[3], &k, &v, scales),
            Err(KernelError::UnscaledStorage {
                dtype: kvpage_core::DType::F32
            })
        );
        assert!(floats.iter().all(|&x| x == 0.0), "nothing written");
    }

    #[test]
    fn int8_fixed_scales_saturate() {
        fixed_scales::<Int8>();
    }

    #[test]
    fn fp8_fixed_scales_saturate() {
        fixed_scales::<Fp8E4m3>();
    }

    #[test]
    fn int8_storage_keeps_codes_and_scales() {
        scaled_storage::<Int8>();
    }

    #[test]
    fn fp8_storage_keeps_codes_and_scales() {
        scaled_storage::<Fp8E4m3>();
    }
}
