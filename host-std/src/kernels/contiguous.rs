//! The attention kernel over a contiguous (unpaged) K/V layout: the baseline against
//! which paging is measured, and a convenience for callers with a classic cache. Same
//! inner routine, same tasks and pool as [`super::paged_attention`]; only the
//! addressing differs.

use super::attention::{check_len, run, Shape};
use super::online::KvSource;
use super::{AttentionParams, SeqQuery};
use crate::dtype::Element;
use crate::error::{Buffer, KernelError};

/// A contiguous cache of one layer: sequence `r` reserves `capacity` tokens, and
/// `k` / `v` are each `[rows][kv_heads][capacity][head_dim]`.
#[derive(Debug, Clone, Copy)]
pub struct ContiguousKv<'a, T> {
    /// Keys.
    pub k: &'a [T],
    /// Values.
    pub v: &'a [T],
    /// KV heads.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Tokens reserved per sequence.
    pub capacity: u32,
}

/// [`super::paged_attention`] over a contiguous cache; `SeqQuery::row` selects the
/// sequence's region. Same complexity.
///
/// # Errors
/// Nothing is written on error. [`KernelError::BadLayout`] if a count is zero or
/// `kv_heads * capacity * head_dim` overflows `usize`; [`KernelError::BufferLength`] if
/// `k`, `v`, `q` or `out` has the wrong length (`k` and `v` must hold a whole number of
/// rows),
/// [`KernelError::RowOutOfRange`], [`KernelError::ContextTooLong`] (over `capacity`),
/// and the shape errors of [`super::paged_attention`].
pub fn contiguous_attention<T: Element>(
    kv: ContiguousKv<'_, T>,
    seqs: &[SeqQuery],
    q: &[f32],
    out: &mut [f32],
    params: AttentionParams<'_>,
) -> Result<(), KernelError> {
    if T::DTYPE.is_scaled() {
        return Err(KernelError::ScaledStorage { dtype: T::DTYPE });
    }
    if kv.kv_heads == 0 || kv.head_dim == 0 || kv.capacity == 0 {
        return Err(KernelError::BadLayout);
    }
    // Three caller-given u32 factors: the product can overflow (and wrap to zero).
    let per_row = (kv.kv_heads as usize)
        .checked_mul(kv.capacity as usize)
        .and_then(|n| n.checked_mul(kv.head_dim as usize))
        .ok_or(KernelError::BadLayout)?;
    let rows = kv.k.len() / per_row;
    check_len(Buffer::Contiguous, rows * per_row, kv.k.len())?;
    check_len(Buffer::Contiguous, kv.k.len(), kv.v.len())?;
    for s in seqs {
        if s.row as usize >= rows {
            return Err(KernelError::RowOutOfRange {
                row: s.row,
                rows: u32::try_from(rows).unwrap_or(u32::MAX),
            });
        }
        if s.context_len > kv.capacity {
            return Err(KernelError::ContextTooLong {
                context_len: s.context_len,
                capacity: u64::from(kv.capacity),
            });
        }
    }
    let shape = Shape::check(kv.kv_heads, kv.head_dim, seqs, q, out, &params)?;
    let head_len = kv.capacity as usize * kv.head_dim as usize;
    run(&shape, seqs, q, out, |seq, kv_head, heads| {
        let start = (seq.row as usize * kv.kv_heads as usize + kv_head) * head_len;
        let len = heads * head_len;
        ContiguousSource {
            k: &kv.k[start..start + len],
            v: &kv.v[start..start + len],
            head_len,
            head_dim: kv.head_dim as usize,
        }
    });
    Ok(())
}

/// The `[heads][capacity][head_dim]` K and V of one sequence's consecutive KV heads.
struct ContiguousSource<'a, T> {
    k: &'a [T],
    v: &'a [T],
    /// `capacity * head_dim`: elements of one head.
    head_len: usize,
    head_dim: usize,
}

impl<T> KvSource<T> for ContiguousSource<'_, T> {
    #[inline(always)]
    fn run(&self, _t0: usize) -> usize {
        usize::MAX
    }
    #[inline(always)]
    fn tile(&self, head: usize, kv: usize, t0: usize, n: usize) -> &[T] {
        let src = if kv == 0 { self.k } else { self.v };
        &src[head * self.head_len + t0 * self.head_dim..][..n * self.head_dim]
    }
    /// Never called: [`contiguous_attention`] refuses 8-bit storage.
    fn scales(&self, _head: usize, _kv: usize, _t0: usize, n: usize, out: &mut [f32]) {
        out[..n].fill(1.0);
    }
}
