//! A [`BlockManager`] shared between threads behind a `spin::Mutex`.
//!
//! The core itself is `&mut self` and has no global state; this wrapper is for callers
//! that must share one manager. A spin lock suits the short critical sections of the
//! manager (every operation is O(blocks touched)) and needs no operating system.

use crate::manager::BlockManager;
use spin::{Mutex, MutexGuard};

/// A manager behind a spin lock. `Sync` when shared by reference.
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
