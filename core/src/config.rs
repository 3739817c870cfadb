//! Sizes of a [`crate::BlockManager`] and the storage they need.

use crate::error::InitError;
use crate::geometry::Geometry;

/// What a [`crate::BlockManager`] is sized for. Everything it stores is derived from
/// these numbers once, at construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Config {
    /// Physical blocks in the device pool.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Sequences that can be live at once (rows of the block table).
    pub max_seqs: u32,
    /// Blocks one sequence may hold (columns of the block table).
    pub max_blocks_per_seq: u32,
    /// Tag written into every handle this manager makes; a handle with another tag is
    /// refused with [`crate::SeqError::ForeignHandle`]. Give each manager its own.
    pub instance: u32,
    /// Key of the prefix cache's block hash. Every block hash depends on it, so prompts
    /// crafted without knowing it cannot pile up on one probe run of the hash table: a
    /// multi-tenant service should pick a secret random key. The same key gives the same
    /// hashes on every run and machine, which KV events for routers and persisted caches
    /// rely on; a fixed key (0 is fine) suits single-tenant and firmware use.
    pub hash_key: u64,
    /// Whether the manager keeps a prefix cache (sharing of identical prompt prefixes
    /// between sequences). Off, [`Config::storage_words`] leaves out all of its storage
    /// (per block: hash, namespace, flags, parent, generations, links, LRU list, token
    /// ids; and the hash table), [`crate::BlockManager::create_with_prompt`] never hits,
    /// [`crate::BlockManager::commit`] returns 0 and appends store no token ids. Forks
    /// still share blocks. Off suits firmware and single-sequence apps.
    pub prefix_cache: bool,
    /// Position runs one sequence can hold (see [`crate::PositionRun`]): a fresh sequence
    /// uses one, each edit that leaves a gap in its positions
    /// ([`crate::BlockManager::remove_range`], [`crate::BlockManager::shift_positions`])
    /// may add one, and an edit that would need more fails with
    /// [`crate::SeqError::TooManyPositionRuns`]. Between 1 and [`MAX_POSITION_RUNS`];
    /// [`Config::for_geometry`] picks [`DEFAULT_POSITION_RUNS`]. Costs `2 * max_seqs` `u32` per run.
    pub max_position_runs: u32,
    /// Namespaces that can have a quota ([`crate::BlockManager::set_namespace_quota`]):
    /// the size of the namespace table, at most [`MAX_NAMESPACES`]. 0 (the default of
    /// [`Config::for_geometry`]) means no quotas. Eviction compares one list head per
    /// namespace slot, so it costs O(max_namespaces + 1) per evicted block; the table
    /// costs a few words per namespace plus, when not 0, one `u32` (owner) and one `u64`
    /// (LRU stamp) per block.
    pub max_namespaces: u32,
    /// Entries of the KV event ring ([`crate::BlockManager::events_since`]): every block
    /// that enters or leaves the prefix cache becomes an event there, for KV-aware
    /// routers. When full, the oldest events are overwritten (readers see the gap).
    /// 0 (the default of [`Config::for_geometry`]) means no events and no storage; so
    /// does [`Config::prefix_cache`] off. Costs `5 + block_size / 2` words per entry and,
    /// when not 0, one word per block (each registered block's parent hash).
    pub event_capacity: u32,
}

/// The largest [`Config::max_namespaces`] [`Config::validate`] accepts (eviction scans
/// one list head per namespace slot).
pub const MAX_NAMESPACES: u32 = 256;

/// The [`Config::max_position_runs`] of [`Config::for_geometry`] (and of the C API's
/// configurations): enough for a context shift or two edits between compactions.
pub const DEFAULT_POSITION_RUNS: u32 = 4;

/// The largest [`Config::max_position_runs`] [`Config::validate`] accepts: edits work on
/// a copy of a sequence's runs on the stack, `(MAX_POSITION_RUNS + 2) * 8` bytes.
pub const MAX_POSITION_RUNS: u32 = 64;

impl Config {
    /// The configuration for a model of `geometry`: its block size, `num_blocks` blocks,
    /// `max_seqs` sequences of up to `max_seq_len` tokens (`max_blocks_per_seq =
    /// ceil(max_seq_len / block_size)`), the prefix cache on, instance 0 and hash key 0.
    /// Set the rest with [`Config::with_instance`], [`Config::with_hash_key`] and
    /// [`Config::without_prefix_cache`] (or struct update syntax). O(1). Checks nothing:
    /// [`Config::validate`] (and [`crate::BlockManager::new`]) does.
    pub const fn for_geometry(
        geometry: &Geometry,
        num_blocks: u32,
        max_seqs: u32,
        max_seq_len: u32,
    ) -> Config {
        let block_size = geometry.block_size();
        Config {
            num_blocks,
            block_size,
            max_seqs,
            max_blocks_per_seq: max_seq_len.div_ceil(block_size),
            instance: 0,
            hash_key: 0,
            prefix_cache: true,
            max_position_runs: DEFAULT_POSITION_RUNS,
            max_namespaces: 0,
            event_capacity: 0,
        }
    }

    /// This configuration with [`Config::instance`] set to `instance`. O(1).
    pub const fn with_instance(self, instance: u32) -> Config {
        Config { instance, ..self }
    }

    /// This configuration with [`Config::hash_key`] set to `hash_key`. O(1).
    pub const fn with_hash_key(self, hash_key: u64) -> Config {
        Config { hash_key, ..self }
    }

    /// This configuration with [`Config::event_capacity`] set to `event_capacity`. O(1).
    pub const fn with_events(self, event_capacity: u32) -> Config {
        Config {
            event_capacity,
            ..self
        }
    }

    /// This configuration with the prefix cache off ([`Config::prefix_cache`]). O(1).
    pub const fn without_prefix_cache(self) -> Config {
        Config {
            prefix_cache: false,
            ..self
        }
    }

    /// Checks that every size is non-zero and addressable. O(1).
    ///
    /// # Errors
    /// [`InitError::ZeroSize`] for a zero size field (`max_position_runs` included);
    /// [`InitError::TooLarge`] when `max_position_runs` exceeds [`MAX_POSITION_RUNS`] or
    /// `max_namespaces` exceeds [`MAX_NAMESPACES`], when a
    /// token slot `num_blocks * block_size`, the block table `max_seqs *
    /// max_blocks_per_seq`, or the tokens of one sequence do not fit in a `u32`, when
    /// `num_blocks` exceeds 2^30 (the prefix cache's hash table would not fit a `u32`),
    /// or when the storage would exceed `isize::MAX` bytes.
    pub const fn validate(&self) -> Result<(), InitError> {
        if self.num_blocks == 0
            || self.block_size == 0
            || self.max_seqs == 0
            || self.max_blocks_per_seq == 0
            || self.max_position_runs == 0
        {
            return Err(InitError::ZeroSize);
        }
        let slots = self.num_blocks as u64 * self.block_size as u64;
        let table = self.max_seqs as u64 * self.max_blocks_per_seq as u64;
        let seq_tokens = self.max_blocks_per_seq as u64 * self.block_size as u64;
        // The hash table has the next power of two >= 2 * num_blocks entries.
        if slots > u32::MAX as u64
            || table > u32::MAX as u64
            || seq_tokens > u32::MAX as u64
            || self.num_blocks > (1 << 30)
            || self.max_position_runs > MAX_POSITION_RUNS
            || self.max_namespaces > MAX_NAMESPACES
        {
            return Err(InitError::TooLarge);
        }
        if self.storage_words_u128() > isize::MAX as u128 / 8 {
            return Err(InitError::TooLarge);
        }
        Ok(())
    }

    /// The most [`crate::RowMove`]s one edit reports (`2 * max_blocks_per_seq + 1`: runs
    /// of rows are cut at every block boundary of the source and of the destination):
    /// a move buffer this long never gets [`crate::SeqError::MoveBufferTooSmall`]. The
    /// most [`crate::BlockCopy`]s one edit reports is `max_blocks_per_seq`. O(1).
    pub const fn max_row_moves(&self) -> u64 {
        2 * self.max_blocks_per_seq as u64 + 1
    }

    /// Tokens one sequence can hold: `max_blocks_per_seq * block_size`. O(1).
    pub const fn max_tokens_per_seq(&self) -> u64 {
        self.max_blocks_per_seq as u64 * self.block_size as u64
    }

    /// Entries of the prefix-cache hash table (when there is one): the next power of two
    /// at least twice the number of blocks, so linear probing stays short.
    pub(crate) const fn hash_capacity(&self) -> u32 {
        let want = (self.num_blocks as u64 * 2).next_power_of_two();
        if want > u32::MAX as u64 {
            1 << 31
        } else {
            want as u32
        }
    }

    /// Namespace slots: one per [`Config::max_namespaces`] plus slot 0, shared by every
    /// namespace without a quota.
    pub(crate) const fn namespace_slots(&self) -> u32 {
        self.max_namespaces + 1
    }

    const fn storage_words_u128(&self) -> u128 {
        crate::manager::BlockManager::storage_words(self)
    }

    /// `u64` words of storage [`crate::BlockManager::new`] needs for this configuration;
    /// `usize::MAX` when the configuration is too large to address (which `new` then
    /// rejects). O(1), usable in `const` contexts to size a `static` array.
    ///
    /// With the prefix cache, about `num_blocks * (7.5 + block_size / 2) + max_seqs *
    /// (6 + max_blocks_per_seq / 2)` words plus a hash table of one `u32` per two to four
    /// blocks: 1M blocks of 16 tokens take about 126 MiB, small next to their KV bytes.
    /// Without it ([`Config::prefix_cache`] off), about `num_blocks * 1.03 + max_seqs *
    /// (6 + max_blocks_per_seq / 2)` words: a block costs 8 bytes of metadata instead of
    /// 64 plus its token ids (and, with [`Config::max_namespaces`], 12 more per block).
    pub const fn storage_words(&self) -> usize {
        let w = self.storage_words_u128();
        if w > usize::MAX as u128 {
            usize::MAX
        } else {
            w as usize
        }
    }
}
