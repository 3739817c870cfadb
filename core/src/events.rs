//! KV cache events: what entered and left the prefix cache, in order, for KV-aware
//! request routers (the stream vLLM publishes and Dynamo, llm-d and others consume).
//!
//! Every registration of a block in the prefix cache becomes a [`KvEvent::Stored`],
//! every unregistration (eviction, quota eviction, reuse of a cached block by an
//! allocation, an edit or append that rewrites a registered block) a
//! [`KvEvent::Removed`], and [`crate::BlockManager::clear_prefix_cache`] emptying the
//! cache a single [`KvEvent::Cleared`]. Events go into a bounded ring in the caller's
//! storage ([`crate::Config::event_capacity`] entries, each with room for one block's
//! token ids), so recording is O(block_size), never allocates and never fails: when the
//! ring is full the oldest event is overwritten.
//!
//! Every event has a sequence number, one more than the previous event's (the first is
//! 0). A reader keeps the number it wants next and asks
//! [`crate::BlockManager::events_since`]; events already overwritten are reported as
//! [`Events::lost`], never skipped silently. Reading changes nothing, so any number of
//! readers can follow the ring at their own pace.
//!
//! A stored event carries everything a router needs without our hash function: the
//! block's token ids, its chain hash, its parent's chain hash (stable for one
//! [`crate::Config::hash_key`] on every run and machine), the namespace and the physical
//! block id. Replaying the stream from sequence 0 gives exactly the registered blocks
//! (see `core/tests/events.rs`).
//!
//! Invariant: the ring holds the events `next_seq - held .. next_seq`, where `held =
//! min(next_seq, capacity)`, event `s` at record `s % capacity`.

use crate::config::Config;
use crate::error::EventError;
use crate::prefix::NIL;
use crate::storage::{u32_words, words_for_pods, Carver};

/// A block that entered the prefix cache, as an event reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct StoredBlock<'r> {
    /// The physical block now holding it.
    pub block: u32,
    /// Its chain hash.
    pub hash: u64,
    /// The chain hash of the block before it (the namespace's seed hash for a chain's
    /// first block).
    pub parent_hash: u64,
    /// The physical block before it in its chain when it was registered; `None` for a
    /// chain's first block.
    pub parent: Option<u32>,
    /// The namespace whose prompts may hit it.
    pub namespace: u64,
    /// Its `block_size` token ids.
    pub tokens: &'r [u32],
}

/// A block that left the prefix cache, as an event reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct RemovedBlock {
    /// The physical block it occupied.
    pub block: u32,
    /// Its chain hash.
    pub hash: u64,
    /// Its namespace.
    pub namespace: u64,
}

/// One change of the prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum KvEvent<'r> {
    /// A block was registered: prompts of its namespace can now hit it.
    Stored(StoredBlock<'r>),
    /// A registered block left the cache.
    Removed(RemovedBlock),
    /// Every registered block left the cache at once
    /// ([`crate::BlockManager::clear_prefix_cache`]).
    Cleared,
}

const STORED: u32 = 1;
const REMOVED: u32 = 2;
const CLEARED: u32 = 3;

/// One event in the ring (its token ids live in the ring's token array).
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct Record {
    hash: u64,
    parent_hash: u64,
    namespace: u64,
    block: u32,
    /// Parent block id, [`NIL`] for none.
    parent: u32,
    kind: u32,
    _pad: u32,
}

/// The bounded ring of events over caller storage. See the module docs.
#[derive(Debug)]
pub(crate) struct EventRing<'a> {
    records: &'a mut [Record],
    tokens: &'a mut [u32],
    block_size: usize,
    next_seq: u64,
    /// While set, removals are not recorded (a clear records one [`KvEvent::Cleared`]).
    muted: bool,
}

impl<'a> EventRing<'a> {
    /// Entries the ring of `config` holds: [`Config::event_capacity`], or 0 without a
    /// prefix cache (nothing to report). O(1).
    pub(crate) const fn capacity(config: &Config) -> u32 {
        match config.prefix_cache {
            true => config.event_capacity,
            false => 0,
        }
    }

    /// `u64` words the ring of `config` takes: per entry a 40-byte record and
    /// `block_size` token ids. O(1).
    pub(crate) const fn storage_words(config: &Config) -> u128 {
        let cap = Self::capacity(config) as u128;
        cap * (words_for_pods::<Record>(1) as u128) + u32_words(cap * config.block_size as u128)
    }

    /// Carves an empty ring. O(storage words).
    pub(crate) fn new(config: &Config, carve: &mut Carver<'a>) -> Self {
        let start = carve.taken();
        let cap = Self::capacity(config) as usize;
        let ring = Self {
            records: carve.pods(cap),
            tokens: carve.u32s(cap * config.block_size as usize),
            block_size: config.block_size as usize,
            next_seq: 0,
            muted: false,
        };
        debug_assert_eq!((carve.taken() - start) as u128, Self::storage_words(config));
        ring
    }

    /// Whether events are recorded at all. O(1).
    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        !self.records.is_empty()
    }

    /// The sequence number the next event gets. O(1).
    pub(crate) fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The oldest sequence number still held. O(1).
    fn first_seq(&self) -> u64 {
        self.next_seq.saturating_sub(self.records.len() as u64)
    }

    /// Stops (`true`) or resumes recording removals. O(1).
    pub(crate) fn mute_removals(&mut self, muted: bool) {
        self.muted = muted;
    }

    /// Writes `record` (and, for a stored block, its `tokens`) as the next event,
    /// overwriting the oldest when full. O(block_size).
    fn push(&mut self, record: Record, tokens: Option<&[u32]>) {
        if !self.enabled() {
            return;
        }
        let at = (self.next_seq % self.records.len() as u64) as usize;
        self.records[at] = record;
        if let Some(t) = tokens {
            let start = at * self.block_size;
            let n = t.len().min(self.block_size);
            self.tokens[start..start + n].copy_from_slice(&t[..n]);
        }
        self.next_seq += 1;
    }

    /// Records that `block` was registered. O(block_size).
    pub(crate) fn stored(&mut self, block: StoredBlock<'_>) {
        let record = Record {
            hash: block.hash,
            parent_hash: block.parent_hash,
            namespace: block.namespace,
            block: block.block,
            parent: block.parent.unwrap_or(NIL),
            kind: STORED,
            _pad: 0,
        };
        self.push(record, Some(block.tokens));
    }

    /// Records that `block` was unregistered (unless muted). O(1).
    pub(crate) fn removed(&mut self, block: RemovedBlock) {
        if self.muted {
            return;
        }
        let record = Record {
            hash: block.hash,
            parent_hash: 0,
            namespace: block.namespace,
            block: block.block,
            parent: NIL,
            kind: REMOVED,
            _pad: 0,
        };
        self.push(record, None);
    }

    /// Records that the cache was emptied. O(1).
    pub(crate) fn cleared(&mut self) {
        let record = Record {
            hash: 0,
            parent_hash: 0,
            namespace: 0,
            block: NIL,
            parent: NIL,
            kind: CLEARED,
            _pad: 0,
        };
        self.push(record, None);
    }

    /// The events from `seq` on. O(1); the iterator yields each in O(1).
    pub(crate) fn since(&self, seq: u64) -> Result<Events<'_>, EventError> {
        if seq > self.next_seq {
            return Err(EventError::FutureSeq {
                requested: seq,
                next: self.next_seq,
            });
        }
        let first = self.first_seq();
        Ok(Events {
            records: self.records,
            tokens: self.tokens,
            block_size: self.block_size,
            next: seq.max(first),
            end: self.next_seq,
            lost: first.saturating_sub(seq),
        })
    }
}

/// The events of the ring from a requested sequence number on, oldest first, with their
/// sequence numbers: what [`crate::BlockManager::events_since`] returns. Borrows the
/// manager, so the ring cannot change while it is read.
#[derive(Debug, Clone)]
pub struct Events<'r> {
    records: &'r [Record],
    tokens: &'r [u32],
    block_size: usize,
    next: u64,
    end: u64,
    lost: u64,
}

impl<'r> Events<'r> {
    /// Events between the requested sequence number and the oldest one the ring still
    /// holds: overwritten before they were read. 0 when nothing was missed. O(1).
    pub fn lost(&self) -> u64 {
        self.lost
    }

    /// The sequence number of the next event this iterator yields (the first one when
    /// nothing has been read yet). O(1).
    pub fn next_seq(&self) -> u64 {
        self.next
    }

    /// The sequence number after the last event (where the next read should start).
    /// O(1).
    pub fn end_seq(&self) -> u64 {
        self.end
    }

    /// Event `seq`, which the ring holds.
    fn get(&self, seq: u64) -> KvEvent<'r> {
        let at = (seq % self.records.len() as u64) as usize;
        let r = &self.records[at];
        match r.kind {
            STORED => KvEvent::Stored(StoredBlock {
                block: r.block,
                hash: r.hash,
                parent_hash: r.parent_hash,
                parent: (r.parent != NIL).then_some(r.parent),
                namespace: r.namespace,
                tokens: &self.tokens[at * self.block_size..(at + 1) * self.block_size],
            }),
            REMOVED => KvEvent::Removed(RemovedBlock {
                block: r.block,
                hash: r.hash,
                namespace: r.namespace,
            }),
            _ => KvEvent::Cleared,
        }
    }
}

impl<'r> Iterator for Events<'r> {
    type Item = (u64, KvEvent<'r>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.next >= self.end {
            return None;
        }
        let seq = self.next;
        self.next += 1;
        Some((seq, self.get(seq)))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = (self.end - self.next) as usize;
        (n, Some(n))
    }
}

impl ExactSizeIterator for Events<'_> {}
