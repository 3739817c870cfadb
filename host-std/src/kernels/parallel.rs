//! Writing one output from several threads: [`DisjointOut`]. (The threads themselves
//! are a [`WorkerPool`](super::WorkerPool)'s, see `pool`.)

use core::marker::PhantomData;

/// An output slice written by several threads at disjoint ranges (the attention
/// output in `f32`, the arena's elements for in-place kernels).
pub(crate) struct DisjointOut<'a, T = f32> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: the pointer comes from a `&mut [T]` held for `'a`; the contracts of `write`
// and `range_mut` make concurrent accesses disjoint, and `T: Send` may be written from
// any thread.
unsafe impl<T: Send> Send for DisjointOut<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for DisjointOut<'_, T> {}

impl<'a, T: Copy> DisjointOut<'a, T> {
    /// Wraps an exclusive borrow of the output.
    pub(crate) fn new(out: &'a mut [T]) -> Self {
        Self {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            _borrow: PhantomData,
        }
    }

    /// Copies `src` to `out[offset..offset + src.len()]`.
    ///
    /// # Panics
    /// If the range is outside the output (an internal bug: the kernels validate shapes
    /// before they start).
    ///
    /// # Safety
    /// No other thread writes an overlapping range during this `DisjointOut`'s life.
    pub(crate) unsafe fn write(&self, offset: usize, src: &[T]) {
        assert!(
            offset <= self.len && src.len() <= self.len - offset,
            "output range out of bounds"
        );
        // SAFETY: in bounds (checked above), no overlap with other writers (caller).
        unsafe { core::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) };
    }

    /// The range `out[offset..offset + len]`, to read and write in place.
    ///
    /// # Panics
    /// If the range is outside the output (an internal bug, as for `write`).
    ///
    /// # Safety
    /// No other thread reads or writes an overlapping range while the returned slice
    /// lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range_mut(&self, offset: usize, len: usize) -> &mut [T] {
        assert!(
            offset <= self.len && len <= self.len - offset,
            "output range out of bounds"
        );
        // SAFETY: in bounds (checked above), borrowed for `'a` from a `&mut [T]`, and
        // exclusive for the slice's life (caller).
        unsafe { core::slice::from_raw_parts_mut(self.ptr.add(offset), len) }
    }
}
