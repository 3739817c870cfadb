//! A [`BlockManager`] shared between threads behind a `spin::Mutex`.
//!
//! The core itself is `&mut self` and has no global state; this wrapper is for callers
//! that must share one manager. A spin lock suits the short critical sections of the
//! manager (every operation is O(blocks touched)) and needs no operating system, which
//! is why bare metal gets this one.
//!
//! Under an operating system that preempts threads, use `kvpage::SharedManager` (the
//! `std` crate) instead: the same wrapper over a blocking `std::sync::Mutex`. A spin
//! lock inverts priority there: when the holder is preempted, every waiter spins away its
//! time slice, delaying the holder further. On bare metal, share the manager only between
//! contexts that cannot preempt a holder forever (threads of one priority, or a lock taken
//! with the interrupts that also take it masked): an interrupt handler that spins on a
//! lock its own core holds never returns.

use crate::manager::BlockManager;
use spin::{Mutex, MutexGuard};

/// A manager behind a spin lock, for bare metal (see the module docs; on `std`, the
/// `kvpage` crate's blocking `SharedManager`). `Sync` when shared by reference.
#[derive(Debug)]
pub struct SharedManager<'a> {
    inner: Mutex<BlockManager<'a>>,
}

impl<'a> SharedManager<'a> {
    /// Wraps a manager. O(1).
    pub const fn new(manager: BlockManager<'a>) -> Self {
        Self {
            inner: Mutex::new(manager),
        }
    }

    /// Locks the manager, spinning while another thread holds it. Keep the guard for
    /// one step's worth of operations, not across blocking work.
    pub fn lock(&self) -> MutexGuard<'_, BlockManager<'a>> {
        self.inner.lock()
    }

    /// Locks the manager if nobody holds it. O(1).
    pub fn try_lock(&self) -> Option<MutexGuard<'_, BlockManager<'a>>> {
        self.inner.try_lock()
    }

    /// Unwraps the manager. O(1).
    pub fn into_inner(self) -> BlockManager<'a> {
        self.inner.into_inner()
    }
}
