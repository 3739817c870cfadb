//! KV cache events of the owned cache, for KV-aware routers: the core's event ring
//! ([`kvpage_core::BlockManager::events_since`], sized by
//! [`super::CacheConfig::event_capacity`]) read into owned values, a drain that
//! remembers where it stopped, and a full-state snapshot for a router that starts
//! cold.
//!
//! Draining copies events out of the ring and never waits for anyone: a publisher
//! drains on the cache's thread, hands the batch to its own thread, and the cache goes
//! on. Events the ring overwrote before a drain reached them are counted in
//! [`EventBatch::lost`]: a subscriber that sees a gap asks for a snapshot.

use kvpage_core::{EventError, Events, KvEvent, RemovedBlock, StoredBlock};

use super::KvCache;

/// A block that entered the prefix cache, owned (see [`kvpage_core::StoredBlock`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StoredEvent {
    /// The physical block now holding it.
    pub block: u32,
    /// Its chain hash (stable for one hash key on every run and machine).
    pub hash: u64,
    /// Its parent's chain hash (the namespace's seed hash for a chain's first block).
    pub parent_hash: u64,
    /// The parent block when it was registered; `None` for a chain's first block.
    pub parent: Option<u32>,
    /// The namespace whose prompts may hit it.
    pub namespace: u64,
    /// Its `block_size` token ids.
    pub tokens: Vec<u32>,
}

impl From<StoredBlock<'_>> for StoredEvent {
    fn from(s: StoredBlock<'_>) -> Self {
        Self {
            block: s.block,
            hash: s.hash,
            parent_hash: s.parent_hash,
            parent: s.parent,
            namespace: s.namespace,
            tokens: s.tokens.to_vec(),
        }
    }
}

/// One change of the prefix cache, owned (see [`kvpage_core::KvEvent`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CacheEvent {
    /// A block was registered.
    Stored(StoredEvent),
    /// A registered block left the cache.
    Removed(RemovedBlock),
    /// Every registered block left the cache at once.
    Cleared,
}

impl From<KvEvent<'_>> for CacheEvent {
    fn from(e: KvEvent<'_>) -> Self {
        match e {
            KvEvent::Stored(s) => Self::Stored(s.into()),
            KvEvent::Removed(r) => Self::Removed(r),
            KvEvent::Cleared => Self::Cleared,
        }
    }
}

/// Consecutive events: `events[i]` has sequence number `first_seq + i`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventBatch {
    /// Sequence number of the first event (where the read started when there is none).
    pub first_seq: u64,
    /// Events before `first_seq` that were asked for but overwritten in the ring.
    pub lost: u64,
    /// The events, oldest first.
    pub events: Vec<CacheEvent>,
}

impl EventBatch {
    /// The sequence number after the last event: where the next read starts. O(1).
    pub fn end_seq(&self) -> u64 {
        self.first_seq + self.events.len() as u64
    }

    /// Every event of `events`, owned.
    fn read(events: Events<'_>) -> Self {
        Self {
            first_seq: events.next_seq(),
            lost: events.lost(),
            events: events.map(|(_, e)| e.into()).collect(),
        }
    }
}

/// What [`KvCache::drain_events_with`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Drained {
    /// Sequence number of the first event offered (where the drain started).
    pub first_seq: u64,
    /// Events before `first_seq` that the ring overwrote before this drain reached them.
    pub lost: u64,
    /// Events taken: the drain moved past `first_seq + taken`.
    pub taken: u64,
    /// Events still in the ring after them.
    pub pending: u64,
}

impl KvCache {
    /// Copies up to `max` events from where the previous drain stopped (sequence 0 for
    /// the first) and moves past them. Events the ring overwrote since are counted in
    /// [`EventBatch::lost`] and skipped. Always empty with
    /// [`super::CacheConfig::event_capacity`] 0. O(events × block_size); allocates the
    /// batch.
    pub fn drain_events(&mut self, max: usize) -> EventBatch {
        let mut events = Vec::new();
        let d = self.drain_events_with(|_, e| {
            let more = events.len() < max;
            if more {
                events.push(e.into());
            }
            more
        });
        EventBatch {
            first_seq: d.first_seq,
            lost: d.lost,
            events,
        }
    }

    /// Offers the events from where the previous drain stopped to `take`, oldest first
    /// with their sequence numbers, until it returns `false` (that event stays for the
    /// next drain), and moves past the ones it took. Events the ring overwrote since are
    /// counted in [`Drained::lost`] and skipped (also when `take` takes none).
    /// Allocates nothing. O(events offered) plus `take`.
    pub fn drain_events_with(&mut self, mut take: impl FnMut(u64, KvEvent<'_>) -> bool) -> Drained {
        let events = match self.block_manager().events_since(self.event_cursor) {
            Ok(events) => events,
            // The cursor only ever holds sequence numbers the ring issued.
            Err(EventError::FutureSeq { next, .. }) => {
                self.event_cursor = next;
                return Drained {
                    first_seq: next,
                    ..Drained::default()
                };
            }
        };
        let (first_seq, lost, end) = (events.next_seq(), events.lost(), events.end_seq());
        let mut taken = 0;
        for (seq, e) in events {
            if !take(seq, e) {
                break;
            }
            taken += 1;
        }
        self.event_cursor = first_seq + taken;
        Drained {
            first_seq,
            lost,
            taken,
            pending: end - self.event_cursor,
        }
    }

    /// Sequence number of the next event a drain offers (before skipping overwritten
    /// ones). O(1).
    pub fn event_cursor(&self) -> u64 {
        self.event_cursor
    }

    /// The events from sequence number `seq` on, without moving the drain's cursor:
    /// what a replay request ("everything since `seq`") answers. O(events ×
    /// block_size).
    ///
    /// # Errors
    /// [`EventError::FutureSeq`] when `seq` was never issued.
    pub fn events_since(&self, seq: u64) -> Result<EventBatch, EventError> {
        Ok(EventBatch::read(self.block_manager().events_since(seq)?))
    }

    /// The sequence number the next event gets. O(1).
    pub fn next_event_seq(&self) -> u64 {
        self.block_manager().next_event_seq()
    }

    /// Every registered block in its stored-event form: the blocks lookups can reach,
    /// parents before children, then those whose chain an eviction broke (still
    /// registered until evicted, and removed by an event when they are). Replaying it
    /// and then the events from [`KvCache::next_event_seq`] at the time of the call
    /// gives the registered blocks at any later moment. Blocks whose parent left are
    /// left out when events are off (their parent hash is not kept).
    /// O(num_blocks × chain depth).
    pub fn events_snapshot(&self) -> Vec<StoredEvent> {
        let m = self.block_manager();
        let reachable = self.prefix_blocks_in_order();
        let mut placed = vec![false; m.config().num_blocks as usize];
        let mut out = Vec::with_capacity(reachable.len());
        for &(b, _) in &reachable {
            placed[b as usize] = true;
            out.extend(m.stored_block(b).map(StoredEvent::from));
        }
        for b in 0..m.config().num_blocks {
            if !placed[b as usize] {
                out.extend(m.stored_block(b).map(StoredEvent::from));
            }
        }
        out
    }

    /// Evicts every cached block below [`kvpage_core::Priority::Pinned`]; when that
    /// empties the prefix cache it records one [`CacheEvent::Cleared`] (see
    /// [`kvpage_core::BlockManager::clear_prefix_cache`]). Returns the blocks evicted.
    /// O(evicted).
    pub fn clear_prefix_cache(&mut self) -> u32 {
        Self::with_manager(&mut self.tables, |m| m.clear_prefix_cache())
    }
}
