//! [`SharedManager`]: a [`BlockManager`] shared between threads behind a blocking lock.
//!
//! The core's [`kvpage_core::SharedManager`] uses a spin lock, the only lock bare metal
//! has. Under an operating system a spin lock inverts priority: when the thread holding
//! it is preempted, every thread waiting for it burns its whole time slice spinning,
//! which delays the holder further (with more threads than cores, a waiter can spin
//! while the holder waits for its core). This type is the same wrapper over
//! [`std::sync::Mutex`], which parks waiters in the kernel (a futex on Linux) after a
//! short spin, so on `std` use this one.
//!
//! Both wrappers hand out the manager itself (`&mut BlockManager` through the guard): the
//! manager's operations are the core's, never duplicated here. Like the core's wrapper,
//! it shares a manager over caller storage (`BlockManager<'a>` over `&'a mut [u64]`); an
//! owned manager is [`crate::KvCache`], which is used by one thread at a time.

use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use kvpage_core::BlockManager;

/// A manager behind a blocking mutex. `Send + Sync`: share it by reference (or in an
/// `Arc`) and lock it for each group of operations.
///
/// Poisoning is not surfaced: every manager operation either completes or changes
/// nothing, and none panics, so a panic of the caller's code while it held the guard
/// leaves the manager consistent, and the next [`SharedManager::lock`] takes it.
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

    /// Locks the manager, sleeping while another thread holds it. Keep the guard for one
    /// step's worth of operations, not across blocking work (a kernel call, I/O). O(1)
    /// plus the wait.
    pub fn lock(&self) -> MutexGuard<'_, BlockManager<'a>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks the manager if nobody holds it. O(1).
    pub fn try_lock(&self) -> Option<MutexGuard<'_, BlockManager<'a>>> {
        match self.inner.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Unwraps the manager. O(1).
    pub fn into_inner(self) -> BlockManager<'a> {
        self.inner
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpage_core::Config;

    const CONFIG: Config = Config {
        num_blocks: 8,
        block_size: 4,
        max_seqs: 2,
        max_blocks_per_seq: 4,
        instance: 1,
        hash_key: 0,
        prefix_cache: true,
        max_position_runs: 4,
        max_namespaces: 0,
        event_capacity: 0,
    };

    #[test]
    fn a_panic_while_locked_does_not_lock_out_others() {
        let mut storage = vec![0u64; CONFIG.storage_words()];
        let shared = SharedManager::new(BlockManager::new(CONFIG, &mut storage).unwrap());
        let seq = shared.lock().create(0).unwrap();
        std::thread::scope(|s| {
            let caught = s
                .spawn(|| {
                    let mut m = shared.lock();
                    m.append(seq, 5, &mut [0; 5]).unwrap();
                    panic!("caller code panics while holding the guard");
                })
                .join();
            assert!(caught.is_err());
        });
        assert_eq!(shared.try_lock().unwrap().len(seq), Ok(5));
        let guard = shared.lock();
        assert!(shared.try_lock().is_none());
        drop(guard);
        let m = shared.into_inner();
        assert_eq!(m.stats().used_blocks, 2);
    }
}
