//! Where the tiles of stored keys and values are loaded from: 16 vectors of one
//! storage type, whose rows a tile load reads from one start at one stride. Vectors
//! stored one after another (a run: the tokens of one block) are loaded where they
//! are; fewer than 16, or 16 across runs, are first copied onto the stack, rows past
//! the tokens zero. Shared by the bf16 ([`super::bf16`]) and int8 ([`super::int8`])
//! tiles, whose vectors are `hd` elements of 2 and 1 bytes.

use crate::dtype::Element;
use crate::kernels::math::first_tokens;
use crate::kernels::MAX_HEAD_DIM;

/// Vectors (tokens) per tile.
pub(in crate::kernels) const TOKENS: usize = 16;

/// Tiles of 16 tokens in a chunk.
pub(super) const CHUNK_TILES: usize = crate::kernels::online::CHUNK / TOKENS;

/// Bytes of a copied row: room for the widest vector (`MAX_HEAD_DIM` bf16).
pub(super) const COPY_ROW: usize = 2 * MAX_HEAD_DIM;

/// 16 copied vectors, a row each.
pub(super) type TileCopy = [[u8; COPY_ROW]; TOKENS];

/// One tile of stored vectors: rows `stride` bytes apart from `start`.
#[derive(Clone, Copy)]
pub(super) struct StoredTile {
    /// The first row.
    pub(super) start: *const u8,
    /// Bytes from one row to the next.
    pub(super) stride: usize,
}

impl StoredTile {
    /// No tile yet (a placeholder in an array of them).
    pub(super) const NONE: Self = Self {
        start: core::ptr::null(),
        stride: 0,
    };
}

/// The bytes of `n` vectors of `hd` elements `T`, checked against [`COPY_ROW`]. O(1).
#[inline(always)]
fn vector_bytes<T: Element>(hd: usize) -> usize {
    let bytes = hd * core::mem::size_of::<T>();
    assert!(bytes <= COPY_ROW, "a vector wider than a copied row");
    bytes
}

/// The tile of the `n <= 16` vectors of `hd` elements at the start of `v`: where they
/// are when `n == 16`, otherwise copied into `copy`, zero past them. O(n × hd).
#[inline(always)]
pub(super) fn one_run<T: Element>(
    v: &[T],
    n: usize,
    hd: usize,
    copy: &mut core::mem::MaybeUninit<TileCopy>,
) -> StoredTile {
    let bytes = vector_bytes::<T>(hd);
    assert!(n <= TOKENS && v.len() >= n * hd);
    if n == TOKENS {
        return StoredTile {
            start: v.as_ptr().cast(),
            stride: bytes,
        };
    }
    let rows = copy.write([[0; COPY_ROW]; TOKENS]);
    for (row, x) in rows.iter_mut().zip(v[..n * hd].chunks_exact(hd)) {
        // SAFETY: `x` is `hd` elements, `bytes` bytes (plain data), inside `v`.
        let x = unsafe { core::slice::from_raw_parts(x.as_ptr().cast::<u8>(), bytes) };
        row[..bytes].copy_from_slice(x);
    }
    StoredTile {
        start: rows.as_ptr().cast(),
        stride: COPY_ROW,
    }
}

/// The tiles of a chunk's tokens ([`ChunkTiles::gather`]), and the stack copies that
/// some of them point into: the tiles are valid while this value is borrowed by the
/// slice `gather` returns (it cannot move meanwhile).
pub(super) struct ChunkTiles {
    /// Copies of the tiles that do not lie inside one run.
    copies: [core::mem::MaybeUninit<TileCopy>; CHUNK_TILES],
    /// Where each tile's rows are.
    tiles: [StoredTile; CHUNK_TILES],
}

impl ChunkTiles {
    /// Room for a chunk's tiles, nothing gathered (the copies uninitialised). O(1).
    pub(super) const fn new() -> Self {
        Self {
            copies: [const { core::mem::MaybeUninit::uninit() }; CHUNK_TILES],
            tiles: [StoredTile::NONE; CHUNK_TILES],
        }
    }

    /// The tiles of the first `n <= 64` tokens of `runs` (each run whole vectors of
    /// `hd` elements stored one after another, the runs in token order: a chunk's of
    /// one KV head): a tile inside one run where it is stored, the others (across
    /// runs, or the last partial one) copied, rows past the tokens zero. Returns the
    /// tiles, `div_ceil(tokens, 16)` of them, and the tokens the runs hold (`n` unless
    /// they hold fewer). O(n × hd).
    pub(super) fn gather<T: Element>(
        &mut self,
        runs: &[&[T]],
        n: usize,
        hd: usize,
    ) -> (&[StoredTile], usize) {
        let tokens = chunk_tiles(runs, n, hd, &mut self.copies, &mut self.tiles);
        (&self.tiles[..tokens.div_ceil(TOKENS)], tokens)
    }
}

/// [`ChunkTiles::gather`] into `copies` and `tiles`; returns the tokens. O(n × hd).
fn chunk_tiles<T: Element>(
    runs: &[&[T]],
    n: usize,
    hd: usize,
    copies: &mut [core::mem::MaybeUninit<TileCopy>; CHUNK_TILES],
    tiles: &mut [StoredTile; CHUNK_TILES],
) -> usize {
    let bytes = vector_bytes::<T>(hd);
    assert!(n <= CHUNK_TILES * TOKENS);
    // Every copied row's pointer, those the tiles keep included, derives from this one
    // (another borrow of `copies` would invalidate the pointers taken before it:
    // Miri's Stacked Borrows found that in the first version). Copy `i`'s row `r` is
    // row `16 i + r`.
    let copy_rows: *mut [u8; COPY_ROW] = copies.as_mut_ptr().cast();
    let (mut count, mut tokens) = (0, 0);
    for (t, run, len) in first_tokens(runs, n, hd) {
        let mut at = 0;
        while at < len {
            let (tile, row) = ((t + at) / TOKENS, (t + at) % TOKENS);
            if row == 0 && len - at >= TOKENS {
                tiles[tile] = StoredTile {
                    start: run[at * hd..].as_ptr().cast(),
                    stride: bytes,
                };
                at += TOKENS;
            } else {
                let m = (len - at).min(TOKENS - row);
                // SAFETY: copy `tile < CHUNK_TILES` is inside `copies`.
                let copy = unsafe { copy_rows.add(tile * TOKENS) };
                for (i, x) in run[at * hd..(at + m) * hd].chunks_exact(hd).enumerate() {
                    // SAFETY: row `row + i < 16` of the copy holds `COPY_ROW >= bytes`
                    // bytes; `x` holds `bytes`.
                    unsafe {
                        core::ptr::copy_nonoverlapping(
                            x.as_ptr().cast::<u8>(),
                            copy.add(row + i).cast(),
                            bytes,
                        )
                    };
                }
                tiles[tile] = StoredTile {
                    start: copy.cast_const().cast(),
                    stride: COPY_ROW,
                };
                at += m;
            }
            count = tile + 1;
        }
        tokens = t + len;
    }
    let last = tokens.saturating_sub(count.saturating_sub(1) * TOKENS);
    if tokens > 0 && last < TOKENS {
        // The last tile's rows past the tokens: zero, so that their zero weights
        // multiply numbers (a copy's rows are those of the tokens only).
        // SAFETY: copy `count - 1 < CHUNK_TILES` is inside `copies`.
        let copy = unsafe { copy_rows.add((count - 1) * TOKENS) };
        for row in last..TOKENS {
            // SAFETY: row `row < 16` of the copy, its first `bytes` bytes.
            unsafe { copy.add(row).cast::<u8>().write_bytes(0, bytes) };
        }
    }
    tokens
}

#[cfg(test)]
mod tests {
    //! Where the tiles' rows point, checked byte by byte (no tile instruction: this
    //! runs under Miri too, which checks that every row read is inside its run or its
    //! copy).
    use super::*;
    use crate::dtype::Int8;
    use crate::kernels::amx::check::{chunk_runs, token_of, CHUNK_SHAPES};

    /// The 16 rows of `tile`, `bytes` each.
    fn rows(tile: StoredTile, bytes: usize) -> Vec<Vec<u8>> {
        (0..TOKENS)
            .map(|j| {
                // SAFETY: the function under test promises 16 readable rows.
                unsafe { core::slice::from_raw_parts(tile.start.add(j * tile.stride), bytes) }
                    .to_vec()
            })
            .collect()
    }

    /// Token `t`'s bytes in `runs` (vectors of `hd` elements `E`).
    fn token_bytes<E: Element>(runs: &[Vec<E>], t: usize, hd: usize) -> Vec<u8> {
        let v = token_of(runs, t, hd);
        // SAFETY: `v` is `hd` plain-data elements.
        unsafe { core::slice::from_raw_parts(v.as_ptr().cast::<u8>(), core::mem::size_of_val(v)) }
            .to_vec()
    }

    fn check_type<E: Element>(code: impl Fn(u32) -> E) {
        for hd in [3, 64] {
            let bytes = hd * core::mem::size_of::<E>();
            for (lens, n) in CHUNK_SHAPES {
                let mut next = 0u32;
                let runs = chunk_runs(
                    lens,
                    n,
                    hd,
                    || {
                        next += 1;
                        code(next)
                    },
                    code(0),
                );
                let slices: Vec<&[E]> = runs.iter().map(|r| &r[..]).collect();
                let mut chunk = ChunkTiles::new();
                let (tiles, tokens) = chunk.gather(&slices, n, hd);
                assert_eq!(
                    (tokens, tiles.len()),
                    (n, n.div_ceil(TOKENS)),
                    "runs {lens:?}"
                );
                for (i, tile) in tiles.iter().enumerate() {
                    for (j, row) in rows(*tile, bytes).iter().enumerate() {
                        let t = i * TOKENS + j;
                        let want = if t < n {
                            token_bytes(&runs, t, hd)
                        } else {
                            vec![0; bytes]
                        };
                        assert_eq!(*row, want, "hd {hd} runs {lens:?} token {t}");
                    }
                }
            }
            // One run of fewer than 16 vectors, or 16.
            for n in [1, 7, 16] {
                let v: Vec<E> = (0..n * hd).map(|i| code(i as u32 + 1)).collect();
                let mut copy = core::mem::MaybeUninit::uninit();
                let tile = one_run(&v, n, hd, &mut copy);
                for (t, row) in rows(tile, bytes).iter().enumerate() {
                    let want = if t < n {
                        token_bytes(core::slice::from_ref(&v), t, hd)
                    } else {
                        vec![0; bytes]
                    };
                    assert_eq!(*row, want, "hd {hd} n {n} token {t}");
                }
            }
        }
    }

    #[test]
    fn tiles_point_at_their_tokens_and_zero_past_them() {
        check_type(|x| half::bf16::from_bits(x as u16 | 0x100));
        check_type(|x| Int8((x % 251) as i8 | 1));
    }
}
