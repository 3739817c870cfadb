//! Fixed scales of a layer's 8-bit K/V codes (the Rust [`crate::KvScales`]), on a cache
//! and on an engine: `kvpage_cache_set_kv_scales` fixes them for the rows written after
//! (a checkpoint's calibrated `k_scale` / `v_scale`; values beyond them saturate),
//! `kvpage_cache_clear_kv_scales` goes back to a scale per (token, head) row, and
//! `kvpage_cache_kv_scales` reads the setting. Rows already written keep the scale
//! stored beside their codes.

use crate::cache::KvCache;
use crate::quant::KvScales;

use super::args::{out, tagged, tagged_mut};
use super::cache::kvpage_cache;
use super::engine::kvpage_engine;
use super::result::{kvpage_error, kvpage_result, run, Fail};

/// Writes the setting of `layer` of `cache` to `out_k_scale` and `out_v_scale`: its
/// fixed scales, or 0 and 0 for a scale per row (0 is never a fixed scale).
///
/// # Safety
/// The pointers are null or writable (checked before use).
unsafe fn write_setting(
    cache: &KvCache,
    layer: u32,
    out_k_scale: *mut f32,
    out_v_scale: *mut f32,
) -> Result<(), Fail> {
    // SAFETY: the caller's.
    let (k, v) = unsafe {
        (
            out(out_k_scale, "out_k_scale")?,
            out(out_v_scale, "out_v_scale")?,
        )
    };
    let scales = cache.kv_scales(layer)?;
    k.set(scales.map_or(0.0, KvScales::k));
    v.set(scales.map_or(0.0, KvScales::v));
    Ok(())
}

/// Fixes the scales of layer `layer`'s 8-bit codes in `cache` for the rows written from
/// now on: a key `x` is stored as the code of `x / k_scale` (a value: `/ v_scale`),
/// saturating at the code's largest magnitude (127 for int8, 448 for FP8 E4M3), as
/// engines do with a checkpoint's calibrated scales. By default each row takes the scale
/// of its own largest magnitude and nothing saturates. Rows written before keep theirs.
/// The setting is the cache's: `kvpage_cache_prefix_save` and `kvpage_cache_seq_save`
/// do not carry it (the rows they save carry their scales). O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a cache), `KVPAGE_ERR_DTYPE_MISMATCH` (float storage keeps no scales; `value` is
/// its `KVPAGE_DTYPE_*`), `KVPAGE_ERR_BAD_LAYER`, `KVPAGE_ERR_BAD_SCALE` (a scale not
/// finite and positive). Nothing changes on error.
///
/// # Safety
/// `cache` is null or a live cache.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_set_kv_scales(
    cache: *mut kvpage_cache,
    layer: u32,
    k_scale: f32,
    v_scale: f32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut`.
    unsafe {
        run(err, || {
            let c = tagged_mut(cache)?;
            let scales = KvScales::new(k_scale, v_scale)?;
            c.cache.set_kv_scales(layer, Some(scales))?;
            Ok(())
        })
    }
}

/// Takes layer `layer` of `cache` back to the default: each 8-bit row written from now
/// on at the scale of its own largest magnitude. O(1).
///
/// # Errors
/// As `kvpage_cache_set_kv_scales`, but for the scales.
///
/// # Safety
/// `cache` is null or a live cache.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_clear_kv_scales(
    cache: *mut kvpage_cache,
    layer: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut`.
    unsafe {
        run(err, || {
            tagged_mut(cache)?.cache.set_kv_scales(layer, None)?;
            Ok(())
        })
    }
}

/// Writes layer `layer`'s fixed scales in `cache` to `*out_k_scale` and `*out_v_scale`,
/// or 0 and 0 where each row takes its own scale. O(1).
///
/// # Errors
/// As `kvpage_cache_clear_kv_scales`; `KVPAGE_ERR_NULL_POINTER` for the outputs.
///
/// # Safety
/// `cache` is null or a live cache; the outputs are null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_cache_kv_scales(
    cache: *const kvpage_cache,
    layer: u32,
    out_k_scale: *mut f32,
    out_v_scale: *mut f32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` and `write_setting`.
    unsafe {
        run(err, || {
            let c = tagged(cache)?;
            write_setting(&c.cache, layer, out_k_scale, out_v_scale)
        })
    }
}

/// `kvpage_cache_set_kv_scales` for the cache of `engine` (its `kvpage_engine_write_kv`
/// from then on). O(1).
///
/// # Errors
/// As `kvpage_cache_set_kv_scales` (`KVPAGE_ERR_INVALID_ARGUMENT`: not an engine).
///
/// # Safety
/// `engine` is null or a live engine.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_set_kv_scales(
    engine: *mut kvpage_engine,
    layer: u32,
    k_scale: f32,
    v_scale: f32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut`.
    unsafe {
        run(err, || {
            let e = tagged_mut(engine)?;
            let scales = KvScales::new(k_scale, v_scale)?;
            e.engine.set_kv_scales(layer, Some(scales))?;
            Ok(())
        })
    }
}

/// `kvpage_cache_clear_kv_scales` for the cache of `engine`. O(1).
///
/// # Errors
/// As `kvpage_cache_clear_kv_scales` (`KVPAGE_ERR_INVALID_ARGUMENT`: not an engine).
///
/// # Safety
/// `engine` is null or a live engine.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_clear_kv_scales(
    engine: *mut kvpage_engine,
    layer: u32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut`.
    unsafe {
        run(err, || {
            tagged_mut(engine)?.engine.set_kv_scales(layer, None)?;
            Ok(())
        })
    }
}

/// `kvpage_cache_kv_scales` for the cache of `engine`. O(1).
///
/// # Errors
/// As `kvpage_cache_kv_scales` (`KVPAGE_ERR_INVALID_ARGUMENT`: not an engine).
///
/// # Safety
/// `engine` is null or a live engine; the outputs are null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_engine_kv_scales(
    engine: *const kvpage_engine,
    layer: u32,
    out_k_scale: *mut f32,
    out_v_scale: *mut f32,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged` and `write_setting`.
    unsafe {
        run(err, || {
            let e = tagged(engine)?;
            write_setting(e.engine.cache(), layer, out_k_scale, out_v_scale)
        })
    }
}
