//! The engine's per-step quota bookkeeping: how many blocks each namespace with a quota
//! may still take while a step is planned.
//!
//! The scheduler counts blocks for the whole pool
//! ([`crate::BlockManager::shared_available_blocks`], which already leaves out the
//! reservations and is at most what any namespace can take); a namespace with a quota
//! is also bounded by its limit ([`crate::BlockManager::quota_room`]). The engine
//! charges each running sequence's growth (preempting the namespace's youngest
//! sequences until it fits), each swap-in and each admission it offers the scheduler
//! to its namespace here first, and holds back what does not fit: such a request waits
//! (other namespaces go ahead), so a plan never exceeds a quota. At most
//! [`crate::Config::max_namespaces`] namespaces have a quota, so the table (caller
//! storage, two words a namespace) never overflows.

use crate::manager::BlockManager;

/// `(namespace, blocks left)` pairs of the namespaces with a quota seen this step.
#[derive(Debug)]
pub(crate) struct QuotaPlan<'a> {
    entries: &'a mut [u64],
    len: usize,
}

impl<'a> QuotaPlan<'a> {
    /// Words for a manager with `max_namespaces` namespace slots. O(1).
    pub(crate) const fn storage_words(max_namespaces: u32) -> u128 {
        2 * max_namespaces as u128
    }

    /// An empty table over `words` (`storage_words` of them). O(1).
    pub(crate) fn new(words: &'a mut [u64]) -> Self {
        Self {
            entries: words,
            len: 0,
        }
    }

    /// Forgets the previous step. O(1).
    pub(crate) fn reset(&mut self) {
        self.len = 0;
    }

    /// Charges `blocks` to `namespace` if its quota allows them this step; namespaces
    /// without a quota always fit (the scheduler's pool count bounds them). Returns
    /// whether they fit; when not, nothing is charged and the namespace takes nothing
    /// more this step (so its requests keep their order). O(namespaces with a quota).
    pub(crate) fn take(&mut self, kv: &BlockManager<'_>, namespace: u64, blocks: u64) -> bool {
        if kv.namespace_quota(namespace).max_blocks == u32::MAX {
            return true;
        }
        let found = (0..self.len).find(|&k| self.entries[2 * k] == namespace);
        let k = match found {
            Some(k) => k,
            None if 2 * self.len + 1 < self.entries.len() => {
                self.entries[2 * self.len] = namespace;
                self.entries[2 * self.len + 1] = u64::from(kv.quota_room(namespace));
                self.len += 1;
                self.len - 1
            }
            // Unreachable (one entry per namespace slot); refusing is the safe answer.
            None => return false,
        };
        let left = &mut self.entries[2 * k + 1];
        if blocks <= *left {
            *left -= blocks;
            true
        } else {
            *left = 0;
            false
        }
    }
}
