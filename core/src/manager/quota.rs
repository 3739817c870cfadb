//! Per-namespace quotas: a bounded table of namespaces, each with a hold limit and a
//! reservation, and the charge of every block to the namespace slot that allocated it.
//!
//! Slot 0 stands for every namespace without a table entry: no limit, no reservation.
//! A block is *charged* to its owner slot while it is used or cached; it stops being
//! charged when it becomes free. Invariants (kept by [`super::pool::BlockPool`]):
//! - `charged[s]` is the number of used or cached blocks whose owner is `s`;
//! - `charged[s] <= limit[s]` for every slot;
//! - the free blocks cover the reservations: `free >= Σ_s max(0, reserve[s] -
//!   charged[s])` (`shortfall_total`), so a namespace below its reservation can always
//!   get a block, and blocks another namespace may take never cut into it.
//!
//! A namespace keeps its slot for the manager's life (set its quota to
//! [`NamespaceQuota::UNLIMITED`] to lift it). Blocks a namespace allocated before it got
//! a slot stay charged to slot 0.

use crate::storage::{u32_words, Carver};

/// The quota of one namespace (tenant), see [`crate::BlockManager::set_namespace_quota`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(C)]
pub struct NamespaceQuota {
    /// Most blocks the namespace may hold or keep cached at once. When an allocation
    /// would exceed it, the namespace's own cached blocks are evicted first (lowest
    /// priority, least recently used); when they do not suffice the allocation fails
    /// with [`crate::SeqError::QuotaExceeded`].
    pub max_blocks: u32,
    /// Blocks kept for the namespace: other namespaces never take the free blocks it
    /// needs to reach this many, nor evict its cached blocks while it holds no more.
    /// At most `max_blocks`.
    pub reserved_blocks: u32,
}

impl NamespaceQuota {
    /// No limit, no reservation: what every namespace without a quota has.
    pub const UNLIMITED: NamespaceQuota = NamespaceQuota {
        max_blocks: u32::MAX,
        reserved_blocks: 0,
    };
}

/// The namespace table and the per-block owner slots. See the module docs.
#[derive(Debug)]
pub(crate) struct Tenants<'a> {
    ids: &'a mut [u64],
    limit: &'a mut [u32],
    reserve: &'a mut [u32],
    charged: &'a mut [u32],
    /// Owner slot of each block (empty without a table: every block is slot 0's).
    owner: &'a mut [u32],
    /// Slots `1..=taken` are in use.
    taken: u32,
    /// `Σ_s max(0, reserve[s] - charged[s])`.
    shortfall_total: u32,
}

impl<'a> Tenants<'a> {
    /// `u64` words for `max_namespaces` namespaces over `blocks` blocks. O(1).
    pub(crate) const fn storage_words(blocks: u32, max_namespaces: u32) -> u128 {
        let m = max_namespaces as u128;
        let owners = if max_namespaces > 0 {
            blocks as u128
        } else {
            0
        };
        m + 3 * u32_words(m + 1) + u32_words(owners)
    }

    /// Carves an empty table (slot 0 unlimited). O(storage words).
    pub(crate) fn new(blocks: u32, max_namespaces: u32, carve: &mut Carver<'a>) -> Self {
        let m = max_namespaces as usize;
        let owners = if m > 0 { blocks as usize } else { 0 };
        let tenants = Self {
            ids: carve.words(m),
            limit: carve.u32s(m + 1),
            reserve: carve.u32s(m + 1),
            charged: carve.u32s(m + 1),
            owner: carve.u32s(owners),
            taken: 0,
            shortfall_total: 0,
        };
        tenants.limit.fill(u32::MAX);
        tenants
    }

    /// Slots (table entries plus slot 0). O(1).
    #[inline]
    pub(crate) fn slots(&self) -> usize {
        self.limit.len()
    }

    /// The slot of `namespace`: its table entry, or 0. O(max_namespaces).
    pub(crate) fn slot_of(&self, namespace: u64) -> usize {
        self.ids[..self.taken as usize]
            .iter()
            .position(|&id| id == namespace)
            .map_or(0, |k| k + 1)
    }

    /// The slot `namespace` would get: its own, or the next unused one; `None` when the
    /// table is full. O(max_namespaces).
    pub(crate) fn slot_for_new(&self, namespace: u64) -> Option<usize> {
        match self.slot_of(namespace) {
            0 => ((self.taken as usize) < self.ids.len()).then_some(self.taken as usize + 1),
            s => Some(s),
        }
    }

    /// The quota of slot `s`. O(1).
    pub(crate) fn quota(&self, s: usize) -> NamespaceQuota {
        NamespaceQuota {
            max_blocks: self.limit[s],
            reserved_blocks: self.reserve[s],
        }
    }

    /// Blocks charged to slot `s`. O(1).
    #[inline]
    pub(crate) fn charged(&self, s: usize) -> u32 {
        self.charged[s]
    }

    /// Blocks slot `s` still lacks to reach its reservation. O(1).
    #[inline]
    pub(crate) fn shortfall(&self, s: usize) -> u32 {
        self.reserve[s].saturating_sub(self.charged[s])
    }

    /// Charged blocks of slot `s` above its reservation (what others may evict). O(1).
    #[inline]
    pub(crate) fn excess(&self, s: usize) -> u32 {
        self.charged[s].saturating_sub(self.reserve[s])
    }

    /// Free blocks kept for slots other than `s`. O(1).
    #[inline]
    pub(crate) fn reserved_for_others(&self, s: usize) -> u32 {
        self.shortfall_total - self.shortfall(s)
    }

    /// Whether slot `s` is at its limit (its next block must be one of its own cached
    /// blocks). O(1).
    #[inline]
    pub(crate) fn at_limit(&self, s: usize) -> bool {
        self.charged[s] >= self.limit[s]
    }

    /// Blocks slot `s` may still be charged before it reaches its limit. O(1).
    #[inline]
    pub(crate) fn below_limit(&self, s: usize) -> u32 {
        self.limit[s].saturating_sub(self.charged[s])
    }

    /// The owner slot of block `b`. O(1).
    #[inline]
    pub(crate) fn owner(&self, b: u32) -> usize {
        self.owner.get(b as usize).map_or(0, |&s| s as usize)
    }

    /// Charges newly used blocks `blocks` to slot `s` (each one's owner, then the
    /// slot's count and the reservations' shortfall once). O(blocks.len()).
    #[inline]
    pub(crate) fn charge_run(&mut self, blocks: &[u32], s: usize) {
        for &b in blocks {
            if let Some(o) = self.owner.get_mut(b as usize) {
                *o = s as u32;
            }
        }
        let k = blocks.len() as u32;
        self.shortfall_total -= self.shortfall(s).min(k);
        self.charged[s] += k;
    }

    /// Charges newly used block `b` to slot `s`. O(1).
    #[inline]
    pub(crate) fn charge(&mut self, b: u32, s: usize) {
        self.charge_run(core::slice::from_ref(&b), s);
    }

    /// Stops charging block `b` (it became free). O(1).
    #[inline]
    pub(crate) fn uncharge(&mut self, b: u32) {
        let s = self.owner(b);
        self.charged[s] -= 1;
        self.shortfall_total += u32::from(self.charged[s] < self.reserve[s]);
    }

    /// Free blocks the reservations would need with slot `s` at `quota` and `evicted`
    /// of its blocks uncharged. O(1).
    pub(crate) fn shortfall_with(&self, s: usize, quota: NamespaceQuota, evicted: u32) -> u32 {
        let own = quota
            .reserved_blocks
            .saturating_sub(self.charged[s] - evicted);
        self.shortfall_total - self.shortfall(s) + own
    }

    /// Gives `namespace` slot `s` (from [`Tenants::slot_for_new`]) with `quota`.
    /// O(1).
    pub(crate) fn set(&mut self, s: usize, namespace: u64, quota: NamespaceQuota) {
        if s > self.taken as usize {
            self.ids[s - 1] = namespace;
            self.taken += 1;
        }
        self.shortfall_total -= self.shortfall(s);
        self.limit[s] = quota.max_blocks;
        self.reserve[s] = quota.reserved_blocks;
        self.shortfall_total += self.shortfall(s);
    }
}
