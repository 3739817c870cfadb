//! Re-rotation of stored keys (`KvCache::rotate_keys`, the kernel `rotate_keys`): against
//! a plain f64 rotary embedding applied from scratch at the new positions, through
//! attention after a context shift (by hand, and the cache's
//! `KvCache::context_shift_rotated`), refusals that leave the arena unchanged, and the
//! round trip `delta` then `-delta`.
//!
//! Tolerances (relative L2 error of all rotated keys against the f64 reference at the new
//! position; stated from the roundings involved: the stored key's, one per re-rotation,
//! and `f32` arithmetic): f32 2e-7, f16 1e-3, bf16 8e-3 (measured at most 5e-8, 3e-4 and
//! 2.4e-3 over the cases here; angles computed in f32 would miss the f32 bound by four
//! orders of magnitude at position 30000). Attention after a shift uses the kernel
//! tolerances of the other tests (1e-5 f32, 1e-2 f16/bf16).

mod common;

use common::{cases, random_vec, reference_attention, rel_error, rng, tolerance};
use kvpage::kernels::{rotate_keys, BlockTable, KeyShift};
use kvpage::{
    bf16, f16, CacheConfig, CacheError, Capacity, DType, Element, Fp8E4m3, Geometry, Int8,
    KernelError, KvCache, RopeError, RopePairing, RopeParams, Seq, SeqError,
};
use proptest::prelude::*;
use rand::rngs::StdRng;

const LAYERS: u32 = 2;
const KV_HEADS: u32 = 2;
const Q_HEADS: u32 = 4;
const BLOCK: u32 = 16;

/// Rotary embedding at `pos` of one head's key, in f64, written for clarity: pair
/// `(a, b)` of the first `rotary_dims` dims turns by `pos · base^(-2j / rotary_dims)`.
fn rope_ref(key: &[f32], pos: f64, rope: RopeParams) -> Vec<f64> {
    let mut out: Vec<f64> = key.iter().map(|&x| f64::from(x)).collect();
    let rd = rope.rotary_dims as usize;
    for j in 0..rd / 2 {
        let (a, b) = match rope.pairing {
            RopePairing::Interleaved => (2 * j, 2 * j + 1),
            RopePairing::HalfSplit => (j, j + rd / 2),
        };
        let angle = pos * f64::from(rope.base).powf(-2.0 * j as f64 / rd as f64);
        let (x, y) = (out[a], out[b]);
        out[a] = x * angle.cos() - y * angle.sin();
        out[b] = x * angle.sin() + y * angle.cos();
    }
    out
}

/// Stated tolerance of a re-rotated key (see the module docs).
fn key_tolerance<T: Element>() -> f64 {
    match T::DTYPE {
        DType::F32 => 2e-7,
        DType::F16 => 1e-3,
        DType::Bf16 => 8e-3,
        // The codes' own rounding (one scale per row), measured against unrounded keys.
        DType::Int8 => 1.5e-2,
        DType::Fp8E4m3 => 6e-2,
    }
}

fn cache(dtype: DType, head_dim: u32, threads: usize) -> KvCache {
    let geometry = Geometry::new(LAYERS, KV_HEADS, head_dim, BLOCK, dtype).unwrap();
    KvCache::new(CacheConfig {
        geometry,
        // 64 blocks of up to 2 × 2 × 2 × 16 × 256 elements; under Miri, which
        // zeroes the arena element by element, what the Miri-sized cases need.
        capacity: Capacity::Blocks(if cfg!(miri) { 8 } else { 64 }),
        max_seqs: 4,
        max_seq_len: 512,
        threads,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .unwrap()
}

/// Raw (position-free) keys and values of a sequence: `[layer][token][kv_head][head_dim]`.
struct Raw {
    k: Vec<f32>,
    v: Vec<f32>,
    tokens: usize,
    hd: usize,
}

impl Raw {
    fn new(rng: &mut StdRng, tokens: usize, hd: usize) -> Self {
        let n = LAYERS as usize * tokens * KV_HEADS as usize * hd;
        Self {
            k: random_vec(rng, n),
            v: random_vec(rng, n),
            tokens,
            hd,
        }
    }

    /// Layer `layer`'s row of token `t`, head `h`, of `x` (`k` or `v`).
    fn row<'a>(&self, x: &'a [f32], layer: usize, t: usize, h: usize) -> &'a [f32] {
        let heads = KV_HEADS as usize;
        &x[((layer * self.tokens + t) * heads + h) * self.hd..][..self.hd]
    }

    /// Keys of `layer` with the rotary embedding of token `t` at `pos(t)`, f64.
    fn keys_at(&self, layer: usize, pos: impl Fn(usize) -> f64, rope: RopeParams) -> Vec<f64> {
        let mut out = Vec::new();
        for t in 0..self.tokens {
            for h in 0..KV_HEADS as usize {
                out.extend(rope_ref(self.row(&self.k, layer, t, h), pos(t), rope));
            }
        }
        out
    }

    /// Values of `layer`, `[token][kv_head][head_dim]`.
    fn values(&self, layer: usize) -> &[f32] {
        let n = self.tokens * KV_HEADS as usize * self.hd;
        &self.v[layer * n..][..n]
    }
}

/// A sequence of `raw.tokens` tokens whose keys are stored with the rotary embedding at
/// `pos(t)` (in f64, then rounded to the storage type by `write_kv`).
fn stored_seq(c: &mut KvCache, raw: &Raw, pos: impl Fn(usize) -> f64, rope: RopeParams) -> Seq {
    let seq = c.create(0).unwrap();
    c.append(seq, raw.tokens as u32).unwrap();
    for layer in 0..LAYERS as usize {
        let k: Vec<f32> = raw
            .keys_at(layer, &pos, rope)
            .iter()
            .map(|&x| x as f32)
            .collect();
        c.write_kv(seq, layer as u32, 0, &k, raw.values(layer))
            .unwrap();
    }
    seq
}

/// Stored K (`kv = 0`) or V (`kv = 1`) of layer `layer` of `seq`, widened:
/// `[token][kv_head][head_dim]`.
fn read<T: Element>(c: &KvCache, seq: Seq, layer: u32, kv: u32) -> Vec<f32> {
    let (layout, arena) = (c.layout(), c.arena().as_slice::<T>());
    let hd = layout.geometry().head_dim() as usize;
    let blocks = c.block_manager().blocks(seq.id()).unwrap();
    let mut out = Vec::new();
    for t in 0..c.len(seq).unwrap() {
        for h in 0..KV_HEADS {
            let tile = layout.tile_offset(blocks[(t / BLOCK) as usize], layer, kv, h);
            let row = &arena[tile + (t % BLOCK) as usize * hd..][..hd];
            // 8-bit storage: codes times the row's scale, stored after the tile's codes.
            let scale = if T::DTYPE.is_scaled() {
                let at = tile + layout.scales_offset() + (t % BLOCK) as usize * 4;
                let b = &c.arena().as_bytes()[at..at + 4];
                f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            } else {
                1.0
            };
            out.extend(row.iter().map(|x| x.to_f32() * scale));
        }
    }
    out
}

/// Every bit of the arena.
fn snapshot<T: Element>(c: &KvCache) -> Vec<u32> {
    let arena = c.arena().as_slice::<T>();
    arena.iter().map(|x| x.to_f32().to_bits()).collect()
}

fn params(base: f32, rotary_dims: u32, pairing: RopePairing) -> RopeParams {
    RopeParams {
        base,
        rotary_dims,
        pairing,
    }
}

/// (a): keys stored at `p0 + t`, re-rotated by `delta` over tokens `first..end`, equal
/// the keys rotated at their new positions from scratch; every other stored element
/// (the rest of the keys, the dims past `rotary_dims`, all values) is unchanged.
fn rerotation_matches_scratch<T: Element>(
    head_dim: u32,
    rope: RopeParams,
    p0: u32,
    delta: i64,
    threads: usize,
) {
    let tokens = 45;
    let (first, end) = (3u32, 41u32);
    let hd = head_dim as usize;
    let seed = u64::from(head_dim) * 7 + u64::from(rope.rotary_dims);
    let mut r = rng(seed.wrapping_add(delta as u64));
    let raw = Raw::new(&mut r, tokens, hd);
    let mut c = cache(T::DTYPE, head_dim, threads);
    let seq = stored_seq(&mut c, &raw, |t| f64::from(p0) + t as f64, rope);
    let before: Vec<Vec<f32>> = (0..LAYERS).map(|l| read::<T>(&c, seq, l, 0)).collect();
    let values: Vec<Vec<f32>> = (0..LAYERS).map(|l| read::<T>(&c, seq, l, 1)).collect();

    c.rotate_keys(seq, first, end, delta, rope).unwrap();

    let moved = |t: usize| (first as usize..end as usize).contains(&t);
    let new_pos = |t: usize| {
        let p = f64::from(p0) + t as f64;
        if moved(t) {
            p + delta as f64
        } else {
            p
        }
    };
    let row = KV_HEADS as usize * hd;
    let rd = rope.rotary_dims as usize;
    for layer in 0..LAYERS {
        let got = read::<T>(&c, seq, layer, 0);
        let want = raw.keys_at(layer as usize, new_pos, rope);
        let span = first as usize * row..end as usize * row;
        let err = rel_error(&got[span.clone()], &want[span]);
        let what = format!(
            "{:?} head dim {head_dim}, {rope:?}, positions {p0}+t moved by {delta}, layer {layer}",
            T::DTYPE
        );
        assert!(err <= key_tolerance::<T>(), "{what}: error {err:e}");
        // The same keys at the wrong sign are far off: the check has teeth.
        let wrong = raw.keys_at(
            layer as usize,
            |t| f64::from(p0) + t as f64 - delta as f64,
            rope,
        );
        let span = first as usize * row..end as usize * row;
        assert!(rel_error(&got[span.clone()], &wrong[span]) > 0.1, "{what}");
        let old = &before[layer as usize];
        for (i, (g, o)) in got.iter().zip(old).enumerate() {
            let (t, d) = (i / row, i % hd);
            // 8-bit storage keeps a rotated row's untouched dims only while its scale
            // still fits the rotated values; other rows are untouched either way.
            if !moved(t) || (d >= rd && !T::DTYPE.is_scaled()) {
                assert_eq!(g.to_bits(), o.to_bits(), "{what}: token {t} dim {d}");
            }
        }
        let v = read::<T>(&c, seq, layer, 1);
        assert_eq!(v, values[layer as usize], "{what}: values changed");
    }
}

fn every_shape<T: Element>(p0: u32, delta: i64) {
    for &head_dim in cases(&[64, 128, 256], 1) {
        for pairing in [RopePairing::Interleaved, RopePairing::HalfSplit] {
            for &rotary_dims in cases(&[head_dim, head_dim / 2, 2], 1) {
                let rope = params(10_000.0, rotary_dims, pairing);
                rerotation_matches_scratch::<T>(head_dim, rope, p0, delta, 1);
            }
        }
    }
}

#[test]
fn rerotation_matches_scratch_f32() {
    every_shape::<f32>(30_000, 4_000);
    every_shape::<f32>(30_000, -4_000);
    every_shape::<f32>(7, -5);
}

#[test]
fn rerotation_matches_scratch_f16() {
    every_shape::<f16>(30_000, 4_000);
    every_shape::<f16>(30_000, -4_000);
    every_shape::<f16>(7, -5);
}

#[test]
fn rerotation_matches_scratch_bf16() {
    every_shape::<bf16>(30_000, 4_000);
    every_shape::<bf16>(30_000, -4_000);
    every_shape::<bf16>(7, -5);
}

#[test]
fn rerotation_matches_scratch_int8() {
    every_shape::<Int8>(0, 300);
    every_shape::<Int8>(5000, -4000);
}

#[test]
fn rerotation_matches_scratch_fp8() {
    every_shape::<Fp8E4m3>(0, 300);
    every_shape::<Fp8E4m3>(5000, -4000);
}

#[test]
fn rerotation_with_llama3_base_and_far_positions() {
    let rope = params(500_000.0, 128, RopePairing::HalfSplit);
    rerotation_matches_scratch::<f32>(128, rope, 100_000, -60_000, 1);
    rerotation_matches_scratch::<bf16>(128, rope, 100_000, 27_123, 1);
}

/// The cache's workers split a large rotation by layer: the result equals the
/// calling thread's alone, bit for bit.
#[test]
#[cfg_attr(
    miri,
    ignore = "300 tokens to pass the parallel threshold; the lib test forces it on a tiny call"
)]
fn workers_rotate_like_one_thread() {
    let hd = 128;
    let rope = params(10_000.0, hd, RopePairing::HalfSplit);
    // 300 tokens × 2 layers × 2 heads × 64 pairs: above the kernel's parallel threshold.
    let tokens = 300;
    let raw = Raw::new(&mut rng(5), tokens, hd as usize);
    let mut results = Vec::new();
    for threads in [1, 2, 3] {
        let mut c = cache(DType::F16, hd, threads);
        let seq = stored_seq(&mut c, &raw, |t| 9_000.0 + t as f64, rope);
        c.rotate_keys(seq, 10, tokens as u32, -8_990, rope).unwrap();
        results.push(snapshot::<f16>(&c));
    }
    assert_eq!(results[0], results[1]);
    assert_eq!(results[0], results[2]);
}

/// (b): a context shift — keep `n_keep` tokens, discard `n_discard`, move the rest down —
/// done by storing the kept and the moved tokens' keys at their old positions, then
/// re-rotating the moved ones by `-n_discard`; decode attention through the cache equals
/// the f64 reference over keys rotated at the new positions from scratch.
fn attention_after_shift<T: Element>(n_keep: usize, rope: RopeParams, threads: usize) {
    let (moved, n_discard) = (37, 4_000);
    let tokens = n_keep + moved;
    let hd = 64;
    let mut r = rng(n_keep as u64 * 31 + u64::from(rope.rotary_dims));
    let raw = Raw::new(&mut r, tokens, hd);
    let mut c = cache(T::DTYPE, hd as u32, threads);
    let old = |t: usize| (if t < n_keep { t } else { t + n_discard }) as f64;
    let seq = stored_seq(&mut c, &raw, old, rope);
    c.rotate_keys(seq, n_keep as u32, tokens as u32, -(n_discard as i64), rope)
        .unwrap();

    let scale = 1.0 / (hd as f32).sqrt();
    for layer in 0..LAYERS {
        let q = random_vec(&mut r, Q_HEADS as usize * hd);
        let mut out = vec![f32::NAN; q.len()];
        c.decode(layer, &[seq], &q, &mut out, Q_HEADS, scale)
            .unwrap();
        let k: Vec<f32> = raw
            .keys_at(layer as usize, |t| t as f64, rope)
            .iter()
            .map(|&x| x as f32)
            .collect();
        let v = raw.values(layer as usize);
        let heads = KV_HEADS as usize;
        let want = reference_attention(&k, v, tokens, heads, hd, &q, Q_HEADS as usize, scale);
        let err = rel_error(&out, &want);
        assert!(
            err <= tolerance::<T>(),
            "{:?} keep {n_keep} {rope:?} layer {layer}: error {err:e}",
            T::DTYPE
        );
        // Without the re-rotation the keys of the moved tokens are wrong: attention
        // over the old keys differs by far more than the tolerance.
        let stale: Vec<f32> = raw
            .keys_at(layer as usize, old, rope)
            .iter()
            .map(|&x| x as f32)
            .collect();
        let off = reference_attention(&stale, v, tokens, heads, hd, &q, Q_HEADS as usize, scale);
        let off: Vec<f32> = off.iter().map(|&x| x as f32).collect();
        assert!(rel_error(&off, &want) > 10.0 * tolerance::<T>());
    }
}

#[test]
fn attention_after_context_shift_equals_scratch() {
    for pairing in [RopePairing::Interleaved, RopePairing::HalfSplit] {
        for &rotary_dims in cases(&[32, 64], 1) {
            let rope = params(10_000.0, rotary_dims, pairing);
            // Unaligned and block-aligned kept prefixes.
            for &n_keep in cases(&[5, 16], 1) {
                attention_after_shift::<f32>(n_keep, rope, 2);
                attention_after_shift::<f16>(n_keep, rope, 2);
                attention_after_shift::<bf16>(n_keep, rope, 1);
            }
        }
    }
}

/// (b'): the cache's own context shift with re-rotation
/// ([`KvCache::context_shift_rotated`]): a sequence stored at positions `0..` is shifted
/// (keep `n_keep`, discard `n_discard`: a page-table edit when block-aligned, row moves
/// otherwise, then the moved keys re-rotated); decode attention equals the f64 reference
/// over the kept tokens with keys rotated at their new positions from scratch. The same
/// shift without rotation misses it by far more than the tolerance.
fn attention_after_cache_shift<T: Element>(n_keep: usize, n_discard: usize, rope: RopeParams) {
    let moved = 37;
    let tokens = n_keep + n_discard + moved;
    let (hd, heads) = (64, KV_HEADS as usize);
    let mut r = rng((n_keep * 131 + n_discard) as u64 + u64::from(rope.rotary_dims));
    let raw = Raw::new(&mut r, tokens, hd);
    let mut c = cache(T::DTYPE, hd as u32, 2);
    let mut stale = cache(T::DTYPE, hd as u32, 1);
    let seq = stored_seq(&mut c, &raw, |t| t as f64, rope);
    let stale_seq = stored_seq(&mut stale, &raw, |t| t as f64, rope);

    // A fork shares every block: the shift copies what it rotates, the fork keeps its
    // keys (checked bit for bit below).
    let fork = c.fork(seq).unwrap();
    let scale = 1.0 / (hd as f32).sqrt();
    let fork_q = random_vec(&mut r, Q_HEADS as usize * hd);
    let fork_out = |c: &mut KvCache| {
        let mut out = vec![f32::NAN; fork_q.len()];
        c.decode(0, &[fork], &fork_q, &mut out, Q_HEADS, scale)
            .unwrap();
        out
    };
    let fork_before = fork_out(&mut c);

    let what = format!("{:?} keep {n_keep} discard {n_discard} {rope:?}", T::DTYPE);
    let shift = c
        .context_shift_rotated(seq, n_keep as u32, n_discard as u32, rope)
        .unwrap();
    let aligned = n_keep.is_multiple_of(BLOCK as usize) && n_discard.is_multiple_of(BLOCK as usize);
    assert_eq!(shift.edited.moves == 0, aligned, "{what}: row moves");
    assert!(shift.edited.copies > 0, "{what}: shared blocks copied");
    assert_eq!(
        (shift.rotate_first, shift.rotate_end, shift.delta),
        (n_keep as u32, (n_keep + moved) as u32, -(n_discard as i32)),
        "{what}"
    );
    stale
        .context_shift(stale_seq, n_keep as u32, n_discard as u32)
        .unwrap();
    let kept = n_keep + moved;
    assert_eq!(c.len(seq).unwrap(), kept as u32);
    assert_eq!(c.position_runs(seq).unwrap(), &[Default::default()]);

    // Old token of each kept one, and its keys rotated at the new position (its index).
    let old = |j: usize| if j < n_keep { j } else { j + n_discard };
    assert_eq!(
        fork_out(&mut c),
        fork_before,
        "{what}: the fork is untouched"
    );
    for layer in 0..LAYERS {
        let l = layer as usize;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for j in 0..kept {
            for h in 0..heads {
                let key = rope_ref(raw.row(&raw.k, l, old(j), h), j as f64, rope);
                k.extend(key.iter().map(|&x| x as f32));
                v.extend_from_slice(raw.row(&raw.v, l, old(j), h));
            }
        }
        let q = random_vec(&mut r, Q_HEADS as usize * hd);
        let want = reference_attention(&k, &v, kept, heads, hd, &q, Q_HEADS as usize, scale);
        let mut out = vec![f32::NAN; q.len()];
        c.decode(layer, &[seq], &q, &mut out, Q_HEADS, scale)
            .unwrap();
        let err = rel_error(&out, &want);
        assert!(
            err <= tolerance::<T>(),
            "{what} layer {layer}: error {err:e}"
        );
        stale
            .decode(layer, &[stale_seq], &q, &mut out, Q_HEADS, scale)
            .unwrap();
        assert!(
            rel_error(&out, &want) > 10.0 * tolerance::<T>(),
            "{what} layer {layer}: the unrotated shift should miss"
        );
    }
}

#[test]
fn cache_context_shift_with_rotation_equals_scratch() {
    for pairing in [RopePairing::Interleaved, RopePairing::HalfSplit] {
        for &rotary_dims in cases(&[64, 32], 1) {
            let rope = params(10_000.0, rotary_dims, pairing);
            // Block-aligned (a page-table edit), and unaligned keep or discard.
            for &(n_keep, n_discard) in cases(&[(16, 32), (5, 7), (16, 7), (5, 32)], 1) {
                attention_after_cache_shift::<f32>(n_keep, n_discard, rope);
                attention_after_cache_shift::<f16>(n_keep, n_discard, rope);
                attention_after_cache_shift::<bf16>(n_keep, n_discard, rope);
            }
        }
    }
}

/// A context shift with rope parameters that do not fit the head is refused before the
/// shift: length, positions and every arena bit stay as they were.
#[test]
fn context_shift_with_bad_rope_changes_nothing() {
    let hd = 64;
    let rope = params(10_000.0, hd, RopePairing::Interleaved);
    let raw = Raw::new(&mut rng(23), 40, hd as usize);
    let mut c = cache(DType::F16, hd, 1);
    let seq = stored_seq(&mut c, &raw, |t| t as f64, rope);
    let arena = snapshot::<f16>(&c);
    let stats = c.stats();
    for (bad, want) in [
        (
            params(10_000.0, 66, RopePairing::HalfSplit),
            RopeError::RotaryDimsExceedHeadDim {
                rotary_dims: 66,
                head_dim: 64,
            },
        ),
        (
            params(10_000.0, 31, RopePairing::Interleaved),
            RopeError::OddRotaryDims { rotary_dims: 31 },
        ),
        (
            params(10_000.0, 0, RopePairing::Interleaved),
            RopeError::ZeroRotaryDims,
        ),
        (params(1.0, 64, RopePairing::HalfSplit), RopeError::BadBase),
    ] {
        assert_eq!(
            c.context_shift_rotated(seq, 4, 16, bad),
            Err(KernelError::Rope(want).into())
        );
        assert_eq!(c.len(seq).unwrap(), 40);
        assert_eq!(c.position_runs(seq).unwrap(), &[Default::default()]);
        assert_eq!(c.stats(), stats);
        assert!(snapshot::<f16>(&c) == arena);
    }
    // Handle and range errors come from the shift itself, also unchanged.
    assert_eq!(
        c.context_shift_rotated(seq, 30, 11, rope).unwrap_err(),
        c.context_shift(seq, 30, 11).unwrap_err()
    );
    assert!(snapshot::<f16>(&c) == arena);
}

/// (d): rotating by `delta` then `-delta` gives back the stored keys within two
/// re-rotations' rounding.
fn round_trip<T: Element>(delta: i64) {
    let hd = 128;
    let rope = params(10_000.0, 96, RopePairing::Interleaved);
    let raw = Raw::new(&mut rng(delta as u64), 40, hd as usize);
    let mut c = cache(T::DTYPE, hd, 1);
    let seq = stored_seq(&mut c, &raw, |t| 20_000.0 + t as f64, rope);
    let before: Vec<Vec<f32>> = (0..LAYERS).map(|l| read::<T>(&c, seq, l, 0)).collect();
    c.rotate_keys(seq, 0, 40, delta, rope).unwrap();
    let moved = read::<T>(&c, seq, 0, 0);
    assert!(
        rel_error(
            &moved,
            &before[0].iter().map(|&x| f64::from(x)).collect::<Vec<_>>()
        ) > 0.1
    );
    c.rotate_keys(seq, 0, 40, -delta, rope).unwrap();
    for layer in 0..LAYERS {
        let after = read::<T>(&c, seq, layer, 0);
        let want: Vec<f64> = before[layer as usize]
            .iter()
            .map(|&x| f64::from(x))
            .collect();
        let err = rel_error(&after, &want);
        assert!(
            err <= 2.0 * key_tolerance::<T>(),
            "{:?} delta {delta}: error {err:e}",
            T::DTYPE
        );
    }
}

#[test]
fn rotation_by_delta_then_minus_delta_is_identity() {
    for &delta in cases(&[123_457, 1, -3, 4_000], 1) {
        round_trip::<f32>(delta);
        round_trip::<f16>(delta);
        round_trip::<bf16>(delta);
    }
}

/// (c): a rotation touching a block another sequence reads, or one registered in the
/// prefix cache, is refused before anything is written.
#[test]
fn shared_or_registered_blocks_are_refused_and_nothing_changes() {
    let hd = 64;
    let rope = params(10_000.0, hd, RopePairing::HalfSplit);
    let raw = Raw::new(&mut rng(11), 40, hd as usize);
    let mut c = cache(DType::Bf16, hd, 1);
    let a = stored_seq(&mut c, &raw, |t| t as f64, rope);
    // A fork shares all three blocks of `a` (16 + 16 + 8 tokens).
    let b = c.fork(a).unwrap();
    let blocks = c.block_manager().blocks(a.id()).unwrap().to_vec();
    let arena = snapshot::<bf16>(&c);
    for (seq, first, end) in [(a, 0, 40), (b, 39, 40), (a, 17, 18), (b, 0, 1)] {
        let e = c.rotate_keys(seq, first, end, 100, rope).unwrap_err();
        let block = blocks[(first / BLOCK) as usize];
        assert_eq!(
            e,
            CacheError::BlockShared {
                block,
                refcount: 2,
                registered: false
            }
        );
        assert!(snapshot::<bf16>(&c) == arena, "refused rotation wrote");
    }

    // `b` appends into the shared partial last block: copy-on-write gives it its own
    // copy, which it may rotate; its first two blocks stay shared.
    c.append(b, 1).unwrap();
    let k = random_vec(&mut rng(12), (KV_HEADS * hd) as usize);
    for layer in 0..LAYERS {
        c.write_kv(b, layer, 40, &k, &k).unwrap();
    }
    let arena = snapshot::<bf16>(&c);
    assert!(matches!(
        c.rotate_keys(b, 31, 41, 7, rope),
        Err(CacheError::BlockShared { refcount: 2, .. })
    ));
    assert!(snapshot::<bf16>(&c) == arena);
    c.rotate_keys(b, 32, 41, 7, rope).unwrap();
    assert!(snapshot::<bf16>(&c) != arena);

    // Registered in the prefix cache: a committed sequence with known token ids offers
    // its full blocks to future prompts, even while it holds them alone.
    c.release(b).unwrap();
    c.release(a).unwrap();
    let tokens: Vec<u32> = (0..20).collect();
    let p = c.create_with_prompt(3, &tokens).unwrap();
    let raw = Raw::new(&mut rng(13), 20, hd as usize);
    for layer in 0..LAYERS as usize {
        let k: Vec<f32> = raw
            .keys_at(layer, |t| t as f64, rope)
            .iter()
            .map(|&x| x as f32)
            .collect();
        c.write_kv(p.seq, layer as u32, 0, &k, raw.values(layer))
            .unwrap();
    }
    c.commit(p.seq).unwrap();
    let first_block = c.block_manager().blocks(p.seq.id()).unwrap()[0];
    let arena = snapshot::<bf16>(&c);
    assert_eq!(
        c.rotate_keys(p.seq, 0, 20, -1, rope),
        Err(CacheError::BlockShared {
            block: first_block,
            refcount: 1,
            registered: true
        })
    );
    assert!(snapshot::<bf16>(&c) == arena);
    // Its partial last block is not registered: rotating it alone is allowed.
    c.rotate_keys(p.seq, 16, 20, -1, rope).unwrap();
}

/// Bad ranges, bad parameters and bad handles are typed errors that write nothing.
#[test]
fn bad_inputs_are_refused_and_nothing_changes() {
    let hd = 64;
    let rope = params(10_000.0, hd, RopePairing::Interleaved);
    let raw = Raw::new(&mut rng(21), 20, hd as usize);
    let mut c = cache(DType::F16, hd, 1);
    let seq = stored_seq(&mut c, &raw, |t| t as f64, rope);
    let gone = stored_seq(&mut c, &raw, |t| t as f64, rope);
    c.release(gone).unwrap();
    let arena = snapshot::<f16>(&c);
    let cases: [(Seq, u32, u32, RopeParams, CacheError); 7] = [
        (
            seq,
            5,
            21,
            rope,
            CacheError::BadRange {
                first: 5,
                end: 21,
                len: 20,
            },
        ),
        (
            seq,
            6,
            5,
            rope,
            CacheError::BadRange {
                first: 6,
                end: 5,
                len: 20,
            },
        ),
        (
            seq,
            0,
            20,
            params(10_000.0, 66, RopePairing::Interleaved),
            KernelError::Rope(RopeError::RotaryDimsExceedHeadDim {
                rotary_dims: 66,
                head_dim: 64,
            })
            .into(),
        ),
        (
            seq,
            0,
            20,
            params(10_000.0, 31, RopePairing::HalfSplit),
            KernelError::Rope(RopeError::OddRotaryDims { rotary_dims: 31 }).into(),
        ),
        (
            seq,
            0,
            20,
            params(10_000.0, 0, RopePairing::HalfSplit),
            KernelError::Rope(RopeError::ZeroRotaryDims).into(),
        ),
        (
            seq,
            0,
            20,
            params(f32::NAN, 64, RopePairing::HalfSplit),
            KernelError::Rope(RopeError::BadBase).into(),
        ),
        (gone, 0, 1, rope, CacheError::Seq(SeqError::StaleHandle)),
    ];
    for (s, first, end, rope, want) in cases {
        assert_eq!(c.rotate_keys(s, first, end, 9, rope), Err(want));
        assert!(snapshot::<f16>(&c) == arena);
    }
    // An empty range, and a zero delta, are no-ops.
    c.rotate_keys(seq, 7, 7, 9, rope).unwrap();
    c.rotate_keys(seq, 0, 20, 0, rope).unwrap();
    assert!(snapshot::<f16>(&c) == arena);
}

/// The kernel over a caller's table: several shifts in one call (each with its own
/// delta) equal one call per shift, and bad shifts are refused before any is applied.
#[test]
fn kernel_runs_a_list_of_shifts() {
    let hd = 64u32;
    let rope = params(10_000.0, 48, RopePairing::HalfSplit);
    let raw = Raw::new(&mut rng(31), 50, hd as usize);
    let mut c = cache(DType::F32, hd, 1);
    let seq = stored_seq(&mut c, &raw, |t| 500.0 + t as f64, rope);
    let layout = *c.layout();
    let stride = c.block_manager().config().max_blocks_per_seq;
    let table = c.block_manager().block_table().to_vec();
    let table = BlockTable {
        table: &table,
        stride,
    };
    let row = seq.id().index();
    let shifts = [
        KeyShift {
            row,
            first: 0,
            end: 10,
            delta: -400,
        },
        KeyShift {
            row,
            first: 10,
            end: 33,
            delta: 77,
        },
        KeyShift {
            row,
            first: 40,
            end: 50,
            delta: 12_345,
        },
    ];
    let mut together = c.arena().as_slice::<f32>().to_vec();
    rotate_keys(&layout, &mut together, table, &shifts, rope, None).unwrap();
    let mut one_by_one = c.arena().as_slice::<f32>().to_vec();
    for s in &shifts {
        rotate_keys(
            &layout,
            &mut one_by_one,
            table,
            &[*s],
            rope,
            Some(c.workers()),
        )
        .unwrap();
    }
    assert!(together == one_by_one);
    assert!(together != c.arena().as_slice::<f32>());

    let untouched = c.arena().as_slice::<f32>().to_vec();
    let capacity = u64::from(stride) * u64::from(BLOCK);
    let bad = [
        (
            KeyShift {
                row,
                first: 9,
                end: 8,
                delta: 1,
            },
            KernelError::BadTokenRange { first: 9, end: 8 },
        ),
        (
            KeyShift {
                row: 4,
                first: 0,
                end: 1,
                delta: 1,
            },
            KernelError::RowOutOfRange { row: 4, rows: 4 },
        ),
        (
            KeyShift {
                row,
                first: 0,
                end: capacity as u32 + 1,
                delta: 1,
            },
            KernelError::ContextTooLong {
                context_len: capacity as u32 + 1,
                capacity,
            },
        ),
    ];
    for (shift, want) in bad {
        let mut arena = untouched.clone();
        let shifts = [shifts[0], shift];
        assert_eq!(
            rotate_keys(&layout, &mut arena, table, &shifts, rope, None),
            Err(want)
        );
        assert!(arena == untouched);
    }
    // A table entry outside the arena.
    let mut forged = table.table.to_vec();
    forged[row as usize * stride as usize + 1] = layout.num_blocks();
    let forged = BlockTable {
        table: &forged,
        stride,
    };
    let mut arena = untouched.clone();
    assert_eq!(
        rotate_keys(&layout, &mut arena, forged, &shifts, rope, None),
        Err(KernelError::BlockOutOfRange {
            block: layout.num_blocks(),
            blocks: layout.num_blocks()
        })
    );
    assert!(arena == untouched);
    // The wrong element type, and a short arena.
    let mut halves = vec![f16::ZERO; layout.arena_elems()];
    assert!(matches!(
        rotate_keys(&layout, &mut halves, table, &shifts, rope, None),
        Err(KernelError::DTypeMismatch { .. })
    ));
    let mut short = untouched[1..].to_vec();
    assert!(matches!(
        rotate_keys(&layout, &mut short, table, &shifts, rope, None),
        Err(KernelError::BufferLength { .. })
    ));
}

/// Property: any sequence of rotations of sub-ranges, with any deltas, leaves each key
/// equal to the reference rotated from scratch at its position in the model (its first
/// position plus the deltas of the rotations that covered it), within one tolerance per
/// rotation; dims past `rotary_dims` and all values are untouched.
fn rotations_match_model<T: Element>(
    hd: u32,
    rope: RopeParams,
    tokens: usize,
    p0: u32,
    ops: &[(u32, u32, i64)],
) -> Result<(), TestCaseError> {
    let raw = Raw::new(&mut rng(u64::from(hd) ^ u64::from(p0)), tokens, hd as usize);
    let mut c = cache(T::DTYPE, hd, 1);
    let seq = stored_seq(&mut c, &raw, |t| f64::from(p0) + t as f64, rope);
    let before: Vec<Vec<f32>> = (0..LAYERS).map(|l| read::<T>(&c, seq, l, 0)).collect();
    let values: Vec<Vec<f32>> = (0..LAYERS).map(|l| read::<T>(&c, seq, l, 1)).collect();
    let mut pos: Vec<f64> = (0..tokens).map(|t| f64::from(p0) + t as f64).collect();
    for &(first, end, delta) in ops {
        c.rotate_keys(seq, first, end, delta, rope).unwrap();
        for p in &mut pos[first as usize..end as usize] {
            *p += delta as f64;
        }
    }
    let row = KV_HEADS as usize * hd as usize;
    let (hd, rd) = (hd as usize, rope.rotary_dims as usize);
    let rotations = ops.iter().filter(|o| o.0 < o.1 && o.2 != 0).count().max(1);
    for layer in 0..LAYERS {
        let got = read::<T>(&c, seq, layer, 0);
        let want = raw.keys_at(layer as usize, |t| pos[t], rope);
        let err = rel_error(&got, &want);
        prop_assert!(
            err <= rotations as f64 * key_tolerance::<T>(),
            "{:?} {rope:?} {ops:?}: error {err:e}",
            T::DTYPE
        );
        for (i, (g, b)) in got.iter().zip(&before[layer as usize]).enumerate() {
            if i % hd >= rd {
                prop_assert_eq!(
                    g.to_bits(),
                    b.to_bits(),
                    "dim {} of token {}",
                    i % hd,
                    i / row
                );
            }
        }
        prop_assert_eq!(&read::<T>(&c, seq, layer, 1), &values[layer as usize]);
    }
    Ok(())
}

/// A head dim (even, up to 64), rotary dims (even, up to it), pairing and base.
fn rope_case() -> impl Strategy<Value = (u32, RopeParams)> {
    (
        1u32..=32,
        any::<bool>(),
        prop_oneof![Just(10_000.0f32), Just(500_000.0), 1.5f32..1e6],
    )
        .prop_flat_map(|(half, split, base)| {
            let pairing = if split {
                RopePairing::HalfSplit
            } else {
                RopePairing::Interleaved
            };
            (1..=half).prop_map(move |r| (2 * half, params(base, 2 * r, pairing)))
        })
}

/// Tokens, and up to four rotations `(first, end, delta)` of sub-ranges of them.
fn ops_case() -> impl Strategy<Value = (usize, Vec<(u32, u32, i64)>)> {
    (1usize..50).prop_flat_map(|tokens| {
        let range = (0..=tokens as u32, 0..=tokens as u32).prop_map(|(a, b)| (a.min(b), a.max(b)));
        let op = (range, -50_000i64..50_000).prop_map(|((a, b), d)| (a, b, d));
        (Just(tokens), proptest::collection::vec(op, 1..5))
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 2 } else { 96 },
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn rotations_compose_like_positions(
        (hd, rope) in rope_case(),
        (tokens, ops) in ops_case(),
        p0 in 0u32..60_000,
        dtype in 0u8..3,
    ) {
        match dtype {
            0 => rotations_match_model::<f32>(hd, rope, tokens, p0, &ops)?,
            1 => rotations_match_model::<f16>(hd, rope, tokens, p0, &ops)?,
            _ => rotations_match_model::<bf16>(hd, rope, tokens, p0, &ops)?,
        }
    }
}
