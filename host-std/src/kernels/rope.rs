//! Re-rotation of stored keys by a position delta: the K/V side of a context shift.
//!
//! Keys are stored with rotary position embedding (RoPE) already applied at their
//! position `p`: each pair `(x, y)` of the first `rotary_dims` dimensions of a head is
//! rotated by the angle `p · θ_j`, `θ_j = base^(-2j / rotary_dims)`. Rotations compose,
//! so a key moved from position `p` to `p + delta` needs only one more rotation by
//! `delta · θ_j`, in place; the dimensions past `rotary_dims` do not depend on the
//! position and are left untouched (not even rewritten). Values carry no position and
//! are never touched.
//!
//! Accuracy: the angles are computed in `f64` (`delta · θ_j` and its cosine and sine,
//! accurate for any delta a context can have), rounded once to `f32`; each pair is
//! widened to `f32`, rotated, and rounded once back to the storage type. So a
//! re-rotated key differs from one rotated at the new position from scratch by the
//! storage type's rounding of the stored key plus one rounding of the result (about
//! 1e-7 relative in f32, 1e-3 in f16, 8e-3 in bf16, per element).

use super::attention::check_len;
use super::parallel::DisjointOut;
use super::pool::{for_each_task, Executor};
use super::{BlockTable, MAX_HEAD_DIM};
use crate::arena::KvLayout;
use crate::dtype::{bytes_of_mut, Element};
use crate::error::{Buffer, KernelError};
use crate::quant::Code;

/// Below this many rotated pairs (over all layers and heads) a shift runs on the
/// calling thread only: about 30 µs of work, on the order of waking a worker.
const PARALLEL_MIN_PAIRS: u64 = 1 << 15;

/// Which dimensions of a head form the pairs rotated together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopePairing {
    /// Pairs `(2j, 2j + 1)`: GPT-J, GPT-NeoX's `rotate_every_two`, llama.cpp's
    /// `LLAMA_ROPE_TYPE_NORM`.
    Interleaved,
    /// Pairs `(j, j + rotary_dims / 2)`: GPT-NeoX's `rotate_half`, Hugging Face Llama,
    /// llama.cpp's `LLAMA_ROPE_TYPE_NEOX`.
    HalfSplit,
}

/// The rotary embedding the model applied to its keys: pair `j` of the first
/// `rotary_dims` dimensions of a head turns by `position · base^(-2j / rotary_dims)`.
///
/// Valid for a head of `head_dim` dimensions when `rotary_dims` is even, non-zero and
/// at most `head_dim`, and `base` is finite and greater than 1
/// ([`RopeParams::check`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    /// The frequency base (`rope_theta`: 10000 for Llama 2, 500000 for Llama 3).
    pub base: f32,
    /// Leading dimensions of each head that are rotated (all of them for most models;
    /// fewer with partial rotary embedding, e.g. GPT-NeoX's 25%).
    pub rotary_dims: u32,
    /// How those dimensions pair up.
    pub pairing: RopePairing,
}

/// Why a [`RopeParams`] does not fit a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeError {
    /// `rotary_dims` is zero.
    ZeroRotaryDims,
    /// `rotary_dims` is odd: the dimensions cannot pair up.
    OddRotaryDims {
        /// The rotary dims asked for.
        rotary_dims: u32,
    },
    /// `rotary_dims` is larger than the head dimension.
    RotaryDimsExceedHeadDim {
        /// The rotary dims asked for.
        rotary_dims: u32,
        /// The geometry's head dimension.
        head_dim: u32,
    },
    /// `base` is not finite, or not greater than 1.
    BadBase,
}

impl core::fmt::Display for RopeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match *self {
            Self::ZeroRotaryDims => f.write_str("rotary dims are zero"),
            Self::OddRotaryDims { rotary_dims } => write!(f, "rotary dims {rotary_dims} are odd"),
            Self::RotaryDimsExceedHeadDim {
                rotary_dims,
                head_dim,
            } => write!(
                f,
                "rotary dims {rotary_dims} exceed the head dim {head_dim}"
            ),
            Self::BadBase => f.write_str("rotary base is not a finite number above 1"),
        }
    }
}

impl std::error::Error for RopeError {}

impl RopeParams {
    /// Checks the parameters against a head of `head_dim` dimensions. O(1).
    ///
    /// # Errors
    /// [`RopeError::ZeroRotaryDims`], [`RopeError::OddRotaryDims`],
    /// [`RopeError::RotaryDimsExceedHeadDim`], [`RopeError::BadBase`].
    pub fn check(&self, head_dim: u32) -> Result<(), RopeError> {
        let rotary_dims = self.rotary_dims;
        if rotary_dims == 0 {
            return Err(RopeError::ZeroRotaryDims);
        }
        if !rotary_dims.is_multiple_of(2) {
            return Err(RopeError::OddRotaryDims { rotary_dims });
        }
        if rotary_dims > head_dim {
            return Err(RopeError::RotaryDimsExceedHeadDim {
                rotary_dims,
                head_dim,
            });
        }
        // Written so that NaN fails too.
        if !(self.base.is_finite() && self.base > 1.0) {
            return Err(RopeError::BadBase);
        }
        Ok(())
    }
}

/// Keys of one sequence to re-rotate: tokens `first..end` of block-table row `row`
/// move by `delta` positions (negative: towards the start).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyShift {
    /// Row of the block table (the core's `SeqId::index()`).
    pub row: u32,
    /// First token index rotated.
    pub first: u32,
    /// One past the last token index rotated (`first == end`: nothing).
    pub end: u32,
    /// Positions the keys move by.
    pub delta: i64,
}

/// Rotates in place the stored keys of every [`KeyShift`], in all layers and KV heads,
/// by its `delta` under the rotary embedding `rope`; values are not touched.
///
/// Token `t` of a shift is at slot `table[row][t / block_size] * block_size +
/// t % block_size`. Shifts run in order; a row listed by two shifts (or a block that two
/// rows share) is rotated by both. The angles of a shift are computed once
/// (`rotary_dims / 2` cosines and sines, in `f64`); its work is split over `pool` by
/// layer, whose key tiles are disjoint whatever the table holds, when it is large
/// enough to repay waking workers (so at most `layers` threads work on one shift). A
/// task walks its blocks in order and, in each, the contiguous key tiles of every KV
/// head of its layer (`benches/rope.rs`, two alternating runs each on a loaded VM: best
/// of run 6.5–7.2 ms against 9.0–9.8 ms for a task per (layer, head), which jumps to
/// another block after each tile).
///
/// Complexity: O(Σ tokens × layers × kv_heads × rotary_dims) arithmetic, reading and
/// writing the rotary part of each key row once; O(shifts × rotary_dims) angles.
///
/// # Errors
/// Nothing is written on error.
/// - [`KernelError::DTypeMismatch`] — `T` is not the geometry's storage dtype;
/// - [`KernelError::BufferLength`] — `arena` is not `layout.arena_elems()` long;
/// - [`KernelError::Rope`] — `rope` does not fit the head dim ([`RopeParams::check`]);
/// - [`KernelError::BadTokenRange`] — a shift with `first > end`;
/// - [`KernelError::RowOutOfRange`], [`KernelError::ContextTooLong`] (`end` past what
///   the row addresses), [`KernelError::BlockOutOfRange`] (a block id the range needs
///   is not in the arena).
pub fn rotate_keys<T: Element>(
    layout: &KvLayout,
    arena: &mut [T],
    table: BlockTable<'_>,
    shifts: &[KeyShift],
    rope: RopeParams,
    pool: Option<&dyn Executor>,
) -> Result<(), KernelError> {
    layout.check_element::<T>()?;
    check_len(Buffer::Arena, layout.arena_elems(), arena.len())?;
    rope.check(layout.geometry().head_dim())
        .map_err(KernelError::Rope)?;
    for s in shifts {
        check_shift(layout, table, s)?;
    }
    rotate_checked(layout, arena, table, shifts, rope, pool, PARALLEL_MIN_PAIRS);
    Ok(())
}

/// The work of [`rotate_keys`] once every input is checked; a shift of fewer than
/// `parallel_min_pairs` pairs runs on the calling thread only.
fn rotate_checked<T: Element>(
    layout: &KvLayout,
    arena: &mut [T],
    table: BlockTable<'_>,
    shifts: &[KeyShift],
    rope: RopeParams,
    pool: Option<&dyn Executor>,
    parallel_min_pairs: u64,
) {
    let g = layout.geometry();
    let (layers, heads) = (g.layers() as usize, g.kv_heads() as usize);
    let (bs, hd, rd) = (
        g.block_size(),
        g.head_dim() as usize,
        rope.rotary_dims as usize,
    );
    let out = DisjointOut::new(arena);
    for s in shifts.iter().filter(|s| s.delta != 0 && s.first < s.end) {
        let turn = Turn::new(rope, s.delta);
        let row = &table.table[s.row as usize * table.stride as usize..];
        let pairs = u64::from(s.end - s.first) * (layers * heads * rd / 2) as u64;
        let pool = pool.filter(|_| pairs >= parallel_min_pairs);
        let init = || [0.0f32; MAX_HEAD_DIM];
        for_each_task(pool, layers, init, |scratch, layer| {
            let layer = layer as u32;
            let mut t = s.first;
            while t < s.end {
                let (logical, offset) = (t / bs, t % bs);
                let rows = (bs - offset).min(s.end - t);
                let block = row[logical as usize];
                for head in 0..heads as u32 {
                    let tile = layout.tile_offset_in_range(block, layer, 0, head);
                    for r in offset as usize..(offset + rows) as usize {
                        // SAFETY (both blocks): this task is the only one touching the
                        // key tiles of its layer in any block (the scales are inside
                        // them), and the other shifts run before or after this
                        // `for_each_task` returns.
                        if let Some(code) = Code::of(T::DTYPE) {
                            let (key, scale) = unsafe {
                                (
                                    out.range_mut(tile + r * hd, hd),
                                    out.range_mut(tile + layout.scales_offset() + r * 4, 4),
                                )
                            };
                            let (key, scale) = (bytes_of_mut(key), bytes_of_mut(scale));
                            rotate_codes(code, key, scale, &turn, rd, scratch);
                        } else {
                            let key = unsafe { out.range_mut(tile + r * hd, rd) };
                            T::widen(key, &mut scratch[..rd]);
                            turn.apply(&mut scratch[..rd]);
                            T::narrow(&scratch[..rd], key);
                        }
                    }
                }
                t += rows;
            }
        });
    }
}

/// Rotates the first `rd` dimensions of one key row of 8-bit storage: its `codes` and
/// its little-endian f32 `scale`. The row keeps its scale (so the dimensions outside the
/// rotation keep their codes exactly) unless a rotated value no longer fits it; then the
/// whole row is requantized to the scale of its new largest magnitude. O(head_dim).
fn rotate_codes(
    code: Code,
    codes: &mut [u8],
    scale: &mut [u8],
    turn: &Turn,
    rd: usize,
    scratch: &mut [f32],
) {
    let s = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]);
    let values = &mut scratch[..codes.len()];
    for (v, &c) in values.iter_mut().zip(codes.iter()) {
        *v = s * code.decode(c);
    }
    turn.apply(&mut values[..rd]);
    let rotated_max = values[..rd].iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let s = if rotated_max <= s * code.max() {
        for (c, &v) in codes.iter_mut().zip(values.iter()).take(rd) {
            *c = code.encode(v, s);
        }
        s
    } else {
        code.quantize_row(values, codes)
    };
    scale.copy_from_slice(&s.to_le_bytes());
}

/// Checks one shift against the table and the arena.
fn check_shift(layout: &KvLayout, table: BlockTable<'_>, s: &KeyShift) -> Result<(), KernelError> {
    if s.first > s.end {
        return Err(KernelError::BadTokenRange {
            first: s.first,
            end: s.end,
        });
    }
    let stride = table.stride as usize;
    let rows = table.table.len().checked_div(stride).unwrap_or(0);
    if s.row as usize >= rows {
        return Err(KernelError::RowOutOfRange {
            row: s.row,
            rows: u32::try_from(rows).unwrap_or(u32::MAX),
        });
    }
    let bs = layout.geometry().block_size();
    let capacity = stride as u64 * u64::from(bs);
    if u64::from(s.end) > capacity {
        return Err(KernelError::ContextTooLong {
            context_len: s.end,
            capacity,
        });
    }
    if s.first == s.end {
        return Ok(());
    }
    let row = &table.table[s.row as usize * stride..][..stride];
    let used = &row[(s.first / bs) as usize..s.end.div_ceil(bs) as usize];
    let blocks = layout.num_blocks();
    match used.iter().find(|&&b| b >= blocks) {
        Some(&block) => Err(KernelError::BlockOutOfRange { block, blocks }),
        None => Ok(()),
    }
}

/// The rotation of one delta: cosine and sine per pair, and the pairing.
struct Turn {
    cos: [f32; MAX_HEAD_DIM / 2],
    sin: [f32; MAX_HEAD_DIM / 2],
    pairs: usize,
    pairing: RopePairing,
}

impl Turn {
    /// Angles `delta · base^(-2j / rotary_dims)` for `j < rotary_dims / 2`, in `f64`
    /// (`sin_cos` reduces large arguments exactly), rounded to `f32`. `rope` is checked.
    /// O(rotary_dims).
    fn new(rope: RopeParams, delta: i64) -> Self {
        let pairs = rope.rotary_dims as usize / 2;
        let (base, dims, delta) = (
            f64::from(rope.base),
            f64::from(rope.rotary_dims),
            delta as f64,
        );
        let mut turn = Self {
            cos: [0.0; MAX_HEAD_DIM / 2],
            sin: [0.0; MAX_HEAD_DIM / 2],
            pairs,
            pairing: rope.pairing,
        };
        for j in 0..pairs {
            let inv_freq = base.powf(-2.0 * j as f64 / dims);
            let (sin, cos) = (delta * inv_freq).sin_cos();
            turn.cos[j] = cos as f32;
            turn.sin[j] = sin as f32;
        }
        turn
    }

    /// Rotates the `2 · pairs` leading dimensions of one key, `key.len() == 2 · pairs`.
    /// O(pairs).
    #[inline]
    fn apply(&self, key: &mut [f32]) {
        let (cos, sin) = (&self.cos[..self.pairs], &self.sin[..self.pairs]);
        let turn = |x: f32, y: f32, c: f32, s: f32| (x * c - y * s, x * s + y * c);
        match self.pairing {
            RopePairing::Interleaved => {
                for ((p, &c), &s) in key.chunks_exact_mut(2).zip(cos).zip(sin) {
                    (p[0], p[1]) = turn(p[0], p[1], c, s);
                }
            }
            RopePairing::HalfSplit => {
                let (xs, ys) = key.split_at_mut(self.pairs);
                for (((x, y), &c), &s) in xs.iter_mut().zip(ys).zip(cos).zip(sin) {
                    (*x, *y) = turn(*x, *y, c, s);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(rotary_dims: u32, base: f32) -> RopeParams {
        RopeParams {
            base,
            rotary_dims,
            pairing: RopePairing::HalfSplit,
        }
    }

    #[test]
    fn check_refuses_each_bad_parameter() {
        assert_eq!(params(0, 1e4).check(64), Err(RopeError::ZeroRotaryDims));
        assert_eq!(
            params(33, 1e4).check(64),
            Err(RopeError::OddRotaryDims { rotary_dims: 33 })
        );
        assert_eq!(
            params(66, 1e4).check(64),
            Err(RopeError::RotaryDimsExceedHeadDim {
                rotary_dims: 66,
                head_dim: 64
            })
        );
        for base in [1.0, 0.5, -1e4, f32::NAN, f32::INFINITY] {
            assert_eq!(params(64, base).check(64), Err(RopeError::BadBase));
        }
        assert_eq!(params(64, 1e4).check(64), Ok(()));
        assert_eq!(params(2, 1.0001).check(64), Ok(()));
    }

    /// The parallel path (forced for a tiny call, so Miri can run it:
    /// `cargo +nightly miri test -p kvpage --lib rope`) equals the calling thread's
    /// alone, bit for bit, with shifts sharing a block.
    #[test]
    fn workers_match_the_calling_thread() {
        use crate::kernels::WorkerPool;
        use kvpage_core::{DType, Geometry};

        let geometry = Geometry::new(2, 3, 4, 2, DType::F32).unwrap();
        let layout = KvLayout::new(geometry, 4).unwrap();
        let start: Vec<f32> = (0..layout.arena_elems())
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let rows = [3, 1, 0, 2];
        let table = BlockTable {
            table: &rows,
            stride: 4,
        };
        let shifts = [
            KeyShift {
                row: 0,
                first: 1,
                end: 7,
                delta: -9,
            },
            KeyShift {
                row: 0,
                first: 6,
                end: 8,
                delta: 1_000,
            },
        ];
        let rope = params(4, 1e4);
        let mut alone = start.clone();
        rotate_checked(&layout, &mut alone, table, &shifts, rope, None, 0);
        let pool = WorkerPool::new(3);
        let mut shared = start.clone();
        rotate_checked(&layout, &mut shared, table, &shifts, rope, Some(&pool), 0);
        assert!(alone
            .iter()
            .zip(&shared)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_ne!(alone, start);
    }

    #[test]
    fn turn_pairs_the_right_dimensions() {
        // Delta such that pair 0 turns by a quarter turn: (x, y) -> (-y, x).
        let quarter = core::f64::consts::FRAC_PI_2;
        for (pairing, pair_of_0) in [(RopePairing::Interleaved, 1), (RopePairing::HalfSplit, 2)] {
            let rope = RopeParams {
                base: 1e4,
                rotary_dims: 4,
                pairing,
            };
            let mut turn = Turn::new(rope, 1);
            (turn.cos[0], turn.sin[0]) = (quarter.cos() as f32, quarter.sin() as f32);
            let mut key = [1.0f32, 2.0, 3.0, 4.0];
            let before = key;
            turn.apply(&mut key);
            assert!(
                (key[0] + before[pair_of_0]).abs() < 1e-6,
                "{pairing:?}: {key:?}"
            );
            assert!(
                (key[pair_of_0] - before[0]).abs() < 1e-6,
                "{pairing:?}: {key:?}"
            );
        }
    }
}
