//! Spreading a kernel's tasks over threads.
//!
//! `std::thread::scope` rather than rayon: kvpage is embedded in programs (games,
//! services) that own their threads, and a library-global pool that spins up on first
//! use is hidden global state the design rules out; scoped threads borrow the arena,
//! queries and outputs without `Arc` or `'static`, and need no dependency. The price is
//! a thread start per call (tens of microseconds), so small calls run on the calling
//! thread only. Tasks are handed out through one atomic counter, in order, so a worker
//! that draws a cheap task simply draws the next one (no static partition to unbalance).

use core::marker::PhantomData;
use core::sync::atomic::{AtomicUsize, Ordering};

/// Runs `work(state, task)` for every `task < tasks` on up to `threads` threads (the
/// calling thread is one of them). Each worker builds its own state with `init` once,
/// and receives its tasks in increasing order. O(tasks) calls of `work`.
pub(crate) fn for_each_task<W, I, F>(threads: usize, tasks: usize, init: I, work: F)
where
    I: Fn() -> W + Sync,
    F: Fn(&mut W, usize) + Sync,
{
    let threads = threads.clamp(1, tasks.max(1));
    if threads == 1 {
        let mut state = init();
        for t in 0..tasks {
            work(&mut state, t);
        }
        return;
    }
    let next = AtomicUsize::new(0);
    let worker = || {
        let mut state = init();
        loop {
            let t = next.fetch_add(1, Ordering::Relaxed);
            if t >= tasks {
                break;
            }
            work(&mut state, t);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(worker);
        }
        worker();
    });
}

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
