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
/// calling thread is one of them; fewer if the OS refuses to start more: never a
/// panic). Each worker builds its own state with `init` once, and receives its tasks in
/// increasing order. O(tasks) calls of `work`.
pub(crate) fn for_each_task<W, I, F>(threads: usize, tasks: usize, init: I, work: F)
where
    I: Fn() -> W + Sync,
    F: Fn(&mut W, usize) + Sync,
{
    for_each_task_with(threads, tasks, None, init, work);
}

/// [`for_each_task`] with worker threads of `stack` bytes of stack (the platform's
/// default when `None`; tests use an impossible size to make every start fail).
fn for_each_task_with<W, I, F>(threads: usize, tasks: usize, stack: Option<usize>, init: I, work: F)
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
            let mut builder = std::thread::Builder::new();
            if let Some(bytes) = stack {
                builder = builder.stack_size(bytes);
            }
            // A thread the OS refuses (thread limit, memory for its stack) is not an
            // error of the call: the workers that did start, the calling thread among
            // them, draw every task. (`Scope::spawn` would panic here.)
            if builder.spawn_scoped(s, worker).is_err() {
                break;
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts how often each task ran.
    fn run_counting(threads: usize, tasks: usize, stack: Option<usize>) -> Vec<usize> {
        let runs: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
        for_each_task_with(
            threads,
            tasks,
            stack,
            || (),
            |_, t| {
                runs[t].fetch_add(1, Ordering::Relaxed);
            },
        );
        runs.into_iter().map(AtomicUsize::into_inner).collect()
    }

    #[test]
    fn every_task_runs_once() {
        for (threads, tasks) in [(0, 0), (1, 5), (4, 3), (3, 100), (usize::MAX, 7)] {
            assert!(run_counting(threads, tasks, None).iter().all(|&n| n == 1));
        }
    }

    /// A thread the OS refuses to start (its thread limit, a caller asking for
    /// `usize::MAX` threads on a large call, no memory for a stack) is no panic: the
    /// calling thread and whichever workers started run every task.
    #[test]
    fn refused_thread_starts_fall_back_to_the_started_workers() {
        // A 1 PiB stack: no address space holds it, so every start fails.
        let runs = run_counting(8, 50, Some(1 << 50));
        assert!(runs.iter().all(|&n| n == 1), "{runs:?}");
    }
}
