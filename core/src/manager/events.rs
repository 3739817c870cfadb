//! Reading the KV event ring ([`crate::events`]), the stored form of a registered block
//! (a snapshot for a router that starts cold) and clearing the whole prefix cache.

use super::BlockManager;
use crate::error::EventError;
use crate::events::{Events, StoredBlock};
use crate::prefix::{Link, NIL};

impl BlockManager<'_> {
    /// The events ([`crate::KvEvent`]) from sequence number `seq` on, oldest first.
    /// Events `seq..` that the ring no longer holds are counted in [`Events::lost`] and
    /// the iterator starts at the oldest one it holds; read again from
    /// [`Events::end_seq`]. Nothing is consumed: any number of readers can follow.
    /// Always empty with [`crate::Config::event_capacity`] 0. O(1), and O(1) per event
    /// yielded.
    ///
    /// # Errors
    /// [`EventError::FutureSeq`] when `seq` is past [`BlockManager::next_event_seq`].
    pub fn events_since(&self, seq: u64) -> Result<Events<'_>, EventError> {
        self.prefix.events.since(seq)
    }

    /// The sequence number the next event gets: the number of events recorded so far.
    /// O(1).
    pub fn next_event_seq(&self) -> u64 {
        self.prefix.events.next_seq()
    }

    /// Registered block `block` in the form its [`crate::KvEvent::Stored`] event had:
    /// for a router that starts from a snapshot instead of from sequence 0. `None` when
    /// `block` is not registered, and for a registered block whose parent left the cache
    /// when events are off (its parent hash is then unknown). Unlike
    /// [`BlockManager::registered_block`] it reports blocks whose parent left the cache
    /// (unreachable by lookups, but still registered until evicted, and removed by an
    /// event when they are). O(1).
    pub fn stored_block(&self, block: u32) -> Option<StoredBlock<'_>> {
        if !self.prefix.is_registered(block) {
            return None;
        }
        let (namespace, hash, parent) = self.prefix.key_of(block);
        let parent_hash = match self.prefix.stored_parent_hash(block) {
            Some(h) => h,
            None if parent == Link::ROOT => self.prefix.hasher.root(namespace),
            None if self.prefix.link_alive(parent) => self.prefix.key_of(parent.block).1,
            None => return None,
        };
        Some(StoredBlock {
            block,
            hash,
            parent_hash,
            parent: (parent.block != NIL).then_some(parent.block),
            namespace,
            tokens: self.prefix.tokens(block),
        })
    }

    /// Evicts every cached block below [`crate::Priority::Pinned`] (as
    /// [`BlockManager::evict_cached`] with no limit) and returns how many. When that
    /// empties the prefix cache (no registered block is held by a sequence or pinned), it
    /// records one [`crate::KvEvent::Cleared`] instead of a removal per block.
    /// O(evicted * (max_namespaces + 1)).
    pub fn clear_prefix_cache(&mut self) -> u32 {
        let evictable = self.prefix.lru_len() - self.prefix.lru_pinned();
        let empties = self.prefix.registered_count() == evictable && evictable > 0;
        self.prefix.events.mute_removals(empties);
        let evicted = self.pool.evict(u32::MAX, &mut self.prefix);
        self.prefix.events.mute_removals(false);
        if empties {
            self.prefix.events.cleared();
        }
        evicted
    }
}
