//! Writing one output from several threads: [`DisjointOut`]. (The threads themselves
//! are a [`WorkerPool`](super::WorkerPool)'s, see `pool`.)

use core::marker::PhantomData;

/// An output slice written by several threads at disjoint ranges.
pub(crate) struct DisjointOut<'a> {
    ptr: *mut f32,
    len: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: the pointer comes from a `&mut [f32]` held for `'a`; `write`'s contract makes
// concurrent writes disjoint.
unsafe impl Send for DisjointOut<'_> {}
// SAFETY: as above.
unsafe impl Sync for DisjointOut<'_> {}

impl<'a> DisjointOut<'a> {
    /// Wraps an exclusive borrow of the output.
    pub(crate) fn new(out: &'a mut [f32]) -> Self {
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
    pub(crate) unsafe fn write(&self, offset: usize, src: &[f32]) {
        assert!(
            offset <= self.len && src.len() <= self.len - offset,
            "output range out of bounds"
        );
        // SAFETY: in bounds (checked above), no overlap with other writers (caller).
        unsafe { core::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) };
    }
}
