//! Retention of cached blocks: the [`Priority`] levels and the eviction lists.
//!
//! Every cached block (registered, no references) sits in exactly one intrusive list,
//! chosen by its namespace slot (see [`crate::NamespaceQuota`]; slot 0 holds every
//! namespace without one) and its priority level. A block enters its list at the back
//! (most recently used) and stamps the moment, so each list is in least-recently-used
//! order. Eviction takes the lowest level that has an eligible block and, within it, the
//! oldest head among the eligible slots: lower priority first, LRU within a priority,
//! [`Priority::Pinned`] never. That costs O(slots) per evicted block — O(1) with no
//! namespace table — and never allocates: the links, stamps and list heads live in the
//! caller's storage.

use crate::storage::{u32_words, Carver};

/// "No block" in the list links.
const NIL: u32 = u32::MAX;

/// How long a block stays in the prefix cache once no sequence references it.
///
/// A block's priority is the highest priority of the sequences that committed it or
/// reused it from the cache since it was last allocated, unless
/// [`crate::BlockManager::set_priority`] set it explicitly afterwards (an explicit set,
/// lowering included, wins until the next holder raises it again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[repr(u8)]
pub enum Priority {
    /// Evicted before anything else (a one-off prompt).
    Low = 0,
    /// The default.
    #[default]
    Normal = 1,
    /// Evicted only when no `Low` or `Normal` block is cached.
    High = 2,
    /// Never evicted while registered (a hot system prompt). A pinned cached block still
    /// counts in [`crate::Stats::cached_blocks`] but not in
    /// [`crate::BlockManager::available_blocks`].
    Pinned = 3,
}

impl Priority {
    /// The levels, lowest (evicted first) to highest.
    pub const ALL: [Priority; 4] = [
        Priority::Low,
        Priority::Normal,
        Priority::High,
        Priority::Pinned,
    ];

    /// The priority of level `level` (0 = `Low` … 3 = `Pinned`); `None` above 3. O(1).
    pub const fn from_level(level: u8) -> Option<Priority> {
        match level {
            0 => Some(Priority::Low),
            1 => Some(Priority::Normal),
            2 => Some(Priority::High),
            3 => Some(Priority::Pinned),
            _ => None,
        }
    }

    /// The level of this priority (0 = `Low` … 3 = `Pinned`). O(1).
    pub const fn level(self) -> u8 {
        self as u8
    }
}

/// Priority levels, so lists per slot.
pub(crate) const LEVELS: usize = 4;
/// Levels eviction may take from (all but `Pinned`).
const EVICTABLE_LEVELS: usize = LEVELS - 1;

/// Where the back and front stamps of [`LruLists`] start, moving apart.
const MID_CLOCK: u64 = 1 << 63;

/// The eviction lists: one intrusive doubly linked list per (slot, level).
#[derive(Debug)]
pub(crate) struct LruLists<'a> {
    prev: &'a mut [u32],
    next: &'a mut [u32],
    /// List index (`slot * LEVELS + level`) of each listed block.
    list: &'a mut [u32],
    /// When each listed block entered its list (only kept with more than one slot: the
    /// heads of one level are compared across slots).
    stamp: &'a mut [u64],
    head: &'a mut [u32],
    tail: &'a mut [u32],
    len: &'a mut [u32],
    /// Stamp of the next block listed at the back; counts up from [`MID_CLOCK`].
    clock: u64,
    /// Stamp of the next block listed at the front; counts down from below
    /// [`MID_CLOCK`], so fronts stay older than every back (2^63 of each).
    front_clock: u64,
    total: u32,
    pinned: u32,
}

impl<'a> LruLists<'a> {
    /// `u64` words the lists of `blocks` blocks and `slots` slots take (none when
    /// `enabled` is false). O(1).
    pub(crate) const fn storage_words(blocks: u32, slots: u32, enabled: bool) -> u128 {
        if !enabled {
            return 0;
        }
        let n = blocks as u128;
        let lists = slots as u128 * LEVELS as u128;
        let stamps = if slots > 1 { n } else { 0 };
        3 * u32_words(n) + stamps + 3 * u32_words(lists)
    }

    /// Carves empty lists (all arrays empty when `enabled` is false). O(storage words).
    pub(crate) fn new(blocks: u32, slots: u32, enabled: bool, carve: &mut Carver<'a>) -> Self {
        let (n, lists, stamps) = match enabled {
            true => (
                blocks as usize,
                slots as usize * LEVELS,
                if slots > 1 { blocks as usize } else { 0 },
            ),
            false => (0, 0, 0),
        };
        let lru = Self {
            prev: carve.u32s(n),
            next: carve.u32s(n),
            list: carve.u32s(n),
            stamp: carve.words(stamps),
            head: carve.u32s(lists),
            tail: carve.u32s(lists),
            len: carve.u32s(lists),
            clock: MID_CLOCK,
            front_clock: MID_CLOCK - 1,
            total: 0,
            pinned: 0,
        };
        lru.head.fill(NIL);
        lru.tail.fill(NIL);
        lru
    }

    /// Listed blocks (cached, pinned included). O(1).
    #[inline]
    pub(crate) fn len(&self) -> u32 {
        self.total
    }

    /// Listed blocks at [`Priority::Pinned`]. O(1).
    #[inline]
    pub(crate) fn pinned(&self) -> u32 {
        self.pinned
    }

    /// Listed blocks of `slot` below `Pinned`: those eviction may take. O(1).
    pub(crate) fn evictable_in(&self, slot: usize) -> u32 {
        let base = slot * LEVELS;
        self.len
            .get(base..base + EVICTABLE_LEVELS)
            .map_or(0, |l| l.iter().sum())
    }

    /// The list (slot and level) `b` is in; `b` is listed. O(1).
    pub(crate) fn list_of(&self, b: u32) -> (usize, Priority) {
        let l = self.list[b as usize] as usize;
        (l / LEVELS, Priority::ALL[l % LEVELS])
    }

    /// Appends `b` as most recently used to the list of (`slot`, `level`). O(1).
    pub(crate) fn push_back(&mut self, b: u32, slot: usize, level: Priority) {
        let l = slot * LEVELS + level as usize;
        let i = b as usize;
        self.list[i] = l as u32;
        if let Some(s) = self.stamp.get_mut(i) {
            *s = self.clock;
        }
        self.clock += 1;
        self.prev[i] = self.tail[l];
        self.next[i] = NIL;
        match self.tail[l] {
            NIL => self.head[l] = b,
            t => self.next[t as usize] = b,
        }
        self.tail[l] = b;
        self.len[l] += 1;
        self.total += 1;
        self.pinned += u32::from(level == Priority::Pinned);
    }

    /// Prepends `b` as least recently used to the list of (`slot`, `level`): it is
    /// evicted before every block listed so far (at its level, across slots too). O(1).
    pub(crate) fn push_front(&mut self, b: u32, slot: usize, level: Priority) {
        let l = slot * LEVELS + level as usize;
        let i = b as usize;
        self.list[i] = l as u32;
        if let Some(s) = self.stamp.get_mut(i) {
            *s = self.front_clock;
        }
        self.front_clock -= 1;
        self.next[i] = self.head[l];
        self.prev[i] = NIL;
        match self.head[l] {
            NIL => self.tail[l] = b,
            h => self.prev[h as usize] = b,
        }
        self.head[l] = b;
        self.len[l] += 1;
        self.total += 1;
        self.pinned += u32::from(level == Priority::Pinned);
    }

    /// Unlinks listed block `b`. O(1).
    pub(crate) fn remove(&mut self, b: u32) {
        let i = b as usize;
        let l = self.list[i] as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        match p {
            NIL => self.head[l] = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail[l] = p,
            n => self.prev[n as usize] = p,
        }
        self.len[l] -= 1;
        self.total -= 1;
        self.pinned -= u32::from(l % LEVELS == Priority::Pinned as usize);
    }

    /// The block eviction takes next among the slots `eligible` accepts: the lowest
    /// level with an eligible block, then the least recently listed head among those
    /// slots. Unlinks and returns it; `None` when every eligible block is pinned (or
    /// there is none). O(slots).
    pub(crate) fn pop_lowest(&mut self, eligible: impl Fn(usize) -> bool) -> Option<u32> {
        let slots = self.head.len() / LEVELS;
        for level in 0..EVICTABLE_LEVELS {
            let mut best: Option<(u64, u32)> = None;
            for slot in (0..slots).filter(|&s| eligible(s)) {
                let h = self.head[slot * LEVELS + level];
                if h == NIL {
                    continue;
                }
                let stamp = self.stamp.get(h as usize).copied().unwrap_or(0);
                if best.is_none_or(|(s, _)| stamp < s) {
                    best = Some((stamp, h));
                }
            }
            if let Some((_, b)) = best {
                self.remove(b);
                return Some(b);
            }
        }
        None
    }

    /// The blocks of the list of (`slot`, `level`), least recently used first (tests
    /// and debugging). O(listed blocks).
    pub(crate) fn iter(&self, slot: usize, level: Priority) -> impl Iterator<Item = u32> + '_ {
        let mut b = self
            .head
            .get(slot * LEVELS + level as usize)
            .copied()
            .unwrap_or(NIL);
        core::iter::from_fn(move || {
            let cur = b;
            (cur != NIL).then(|| {
                b = self.next[cur as usize];
                cur
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_levels_go_first_then_the_oldest_head_across_slots() {
        let mut words = [0u64; 64];
        assert!(LruLists::storage_words(8, 2, true) <= 64);
        let mut carve = Carver::new(&mut words);
        let mut l = LruLists::new(8, 2, true, &mut carve);
        l.push_back(0, 0, Priority::High);
        l.push_back(1, 1, Priority::Normal);
        l.push_back(2, 0, Priority::Normal);
        l.push_back(3, 0, Priority::Pinned);
        l.push_back(4, 1, Priority::Low);
        assert_eq!((l.len(), l.pinned(), l.evictable_in(0)), (5, 1, 2));
        assert_eq!(l.pop_lowest(|_| true), Some(4));
        assert_eq!(l.pop_lowest(|s| s == 0), Some(2));
        assert_eq!(l.pop_lowest(|_| true), Some(1));
        assert_eq!(l.pop_lowest(|_| true), Some(0));
        assert_eq!(l.pop_lowest(|_| true), None, "pinned stays");
        let mut pinned = l.iter(0, Priority::Pinned);
        assert_eq!((pinned.next(), pinned.next()), (Some(3), None));
    }
}
