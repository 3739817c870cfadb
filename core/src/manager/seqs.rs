//! The sequence table: the dense block table and, per row, the length, generation,
//! flags and prefix-chain position of the sequence living there.
//!
//! Invariants: a row is in `free` iff its `LIVE` flag is clear; the generation of a row
//! changes whenever its sequence is released, so old handles go stale; a swapped-out
//! sequence's row holds host block ids and its `len` reads 0 (its length is kept in
//! `swapped_len`). Each row also holds the sequence's positions, `max_position_runs`
//! [`PositionRun`]s of which the first `run_count` are used (invariants in
//! [`super::positions`]).

use crate::config::Config;
use crate::error::SeqError;
use crate::host_tier::HostPool;
use crate::index_set::{words_for, IndexSet};
use crate::prefix::{Chain, Link};
use crate::retention::Priority;
use crate::storage::{u32_words, Carver};

use super::positions::PositionRun;

const LIVE: u32 = 1;
/// The sequence's blocks are in the host tier; its row holds host block ids.
const SWAPPED: u32 = 4;
/// The sequence's retention priority level, stored xor [`Priority::Normal`] in these
/// bits so a fresh row (flags `LIVE`) reads `Normal`.
const PRIO_SHIFT: u32 = 8;
const PRIO_MASK: u32 = 3 << PRIO_SHIFT;

/// Handle of a live sequence: its row in the block table, the generation of that row and
/// the tag of the manager that made it. A handle whose sequence was released is stale and
/// every operation refuses it; it never reaches another sequence's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct SeqId {
    index: u32,
    generation: u32,
    instance: u32,
}

impl SeqId {
    /// Row of this sequence in [`crate::BlockManager::block_table`] and
    /// [`crate::BlockManager::seq_lens`].
    pub const fn index(&self) -> u32 {
        self.index
    }
    /// Generation of the row when the handle was made.
    pub const fn generation(&self) -> u32 {
        self.generation
    }
    /// Tag of the manager that made the handle ([`Config::instance`]).
    pub const fn instance(&self) -> u32 {
        self.instance
    }
    /// Rebuilds a handle from its parts (for example after crossing an FFI boundary).
    /// Safe: a forged or outdated handle is refused by every operation.
    pub const fn from_parts(index: u32, generation: u32, instance: u32) -> Self {
        Self {
            index,
            generation,
            instance,
        }
    }
}

/// Rows of sequences. Fields are read and written by the manager's operations; the
/// invariants are in the module docs.
#[derive(Debug)]
pub(crate) struct SeqTable<'a> {
    max_blocks_per_seq: u32,
    max_position_runs: u32,
    instance: u32,
    free: IndexSet<'a>,
    pub(crate) table: &'a mut [u32],
    pub(crate) len: &'a mut [u32],
    gen: &'a mut [u32],
    flags: &'a mut [u32],
    /// Length of a swapped-out sequence (its `len` reads 0 meanwhile).
    pub(crate) swapped_len: &'a mut [u32],
    /// Leading tokens whose ids are known (appended with ids): only their full blocks can
    /// enter the prefix cache.
    pub(crate) known: &'a mut [u32],
    /// Leading full blocks already offered to the prefix cache by
    /// [`crate::BlockManager::commit`] (registered, or found registered already); the chain
    /// fields describe the last one.
    pub(crate) committed: &'a mut [u32],
    chain_block: &'a mut [u32],
    chain_gen: &'a mut [u32],
    pub(crate) namespace: &'a mut [u64],
    chain_hash: &'a mut [u64],
    /// `max_position_runs` runs per row, the first `run_count` used.
    runs: &'a mut [PositionRun],
    run_count: &'a mut [u32],
    /// Sum of the lengths of live sequences.
    pub(crate) logical_tokens: u64,
    live: u32,
}

impl<'a> SeqTable<'a> {
    /// `u64` words the table of `config` takes: the free-row bitset, the block table,
    /// nine `u32` and two `u64` per row, and `max_position_runs` runs (one word each) per
    /// row. O(log max_seqs).
    pub(crate) const fn storage_words(config: &Config) -> u128 {
        const { assert!(core::mem::size_of::<PositionRun>() == 8) };
        let s = config.max_seqs as u128;
        u32_words(words_for(config.max_seqs) as u128)
            + u32_words(s * config.max_blocks_per_seq as u128)
            + 9 * u32_words(s)
            + 2 * s
            + s * config.max_position_runs as u128
    }

    /// Carves a table with every row free. O(storage words).
    pub(crate) fn new(config: &Config, carve: &mut Carver<'a>) -> Self {
        let start = carve.taken();
        let s = config.max_seqs as usize;
        let table = Self {
            max_blocks_per_seq: config.max_blocks_per_seq,
            max_position_runs: config.max_position_runs,
            instance: config.instance,
            free: IndexSet::new(
                carve.u32s(words_for(config.max_seqs)),
                config.max_seqs,
                true,
            ),
            table: carve.u32s(s * config.max_blocks_per_seq as usize),
            len: carve.u32s(s),
            gen: carve.u32s(s),
            flags: carve.u32s(s),
            swapped_len: carve.u32s(s),
            known: carve.u32s(s),
            committed: carve.u32s(s),
            chain_block: carve.u32s(s),
            chain_gen: carve.u32s(s),
            namespace: carve.words(s),
            chain_hash: carve.words(s),
            runs: carve.pods(s * config.max_position_runs as usize),
            run_count: carve.u32s(s),
            logical_tokens: 0,
            live: 0,
        };
        debug_assert_eq!((carve.taken() - start) as u128, Self::storage_words(config));
        table
    }

    /// Live sequences. O(1).
    #[inline]
    pub(crate) fn live(&self) -> u32 {
        self.live
    }

    /// Index of live sequence `seq`, in either residency. O(1).
    #[inline]
    pub(crate) fn check_any(&self, seq: SeqId) -> Result<usize, SeqError> {
        if seq.instance != self.instance {
            return Err(SeqError::ForeignHandle);
        }
        let i = seq.index as usize;
        match (self.flags.get(i), self.gen.get(i)) {
            (Some(&flags), Some(&gen)) if flags & LIVE != 0 && gen == seq.generation => Ok(i),
            _ => Err(SeqError::StaleHandle),
        }
    }

    /// Index of live, device-resident sequence `seq`. O(1).
    #[inline]
    pub(crate) fn check(&self, seq: SeqId) -> Result<usize, SeqError> {
        let i = self.check_any(seq)?;
        if self.is_swapped(i) {
            return Err(SeqError::Swapped);
        }
        Ok(i)
    }

    /// Index of live, swapped-out sequence `seq`, checking `host` belongs to the same
    /// manager. O(1).
    pub(crate) fn check_swapped(&self, seq: SeqId, host: &HostPool<'_>) -> Result<usize, SeqError> {
        let i = self.check_any(seq)?;
        self.check_host(host)?;
        if !self.is_swapped(i) {
            return Err(SeqError::NotSwapped);
        }
        Ok(i)
    }

    /// Refuses a host pool made for another manager.
    pub(crate) fn check_host(&self, host: &HostPool<'_>) -> Result<(), SeqError> {
        match host.instance() == self.instance {
            true => Ok(()),
            false => Err(SeqError::ForeignHandle),
        }
    }

    /// Whether the sequence in row `i` is swapped out.
    #[inline]
    pub(crate) fn is_swapped(&self, i: usize) -> bool {
        self.flags[i] & SWAPPED != 0
    }

    /// Retention priority of live row `i`: what the blocks it commits or reuses get.
    /// O(1).
    pub(crate) fn priority(&self, i: usize) -> Priority {
        let bits = (self.flags[i] & PRIO_MASK) >> PRIO_SHIFT;
        Priority::ALL[(bits ^ Priority::Normal as u32) as usize]
    }

    /// Sets the retention priority of live row `i`. O(1).
    pub(crate) fn set_priority(&mut self, i: usize, p: Priority) {
        let bits = (p as u32 ^ Priority::Normal as u32) << PRIO_SHIFT;
        self.flags[i] = (self.flags[i] & !PRIO_MASK) | bits;
    }

    /// Marks row `i` swapped out (`true`) or resident.
    pub(crate) fn set_swapped(&mut self, i: usize, swapped: bool) {
        match swapped {
            true => self.flags[i] |= SWAPPED,
            false => self.flags[i] &= !SWAPPED,
        }
    }

    /// The handle of the sequence in row `i`.
    #[inline]
    pub(crate) fn handle(&self, i: usize) -> SeqId {
        SeqId {
            index: i as u32,
            generation: self.gen[i],
            instance: self.instance,
        }
    }

    /// Start of row `i` in the block table.
    #[inline]
    pub(crate) fn row(&self, i: usize) -> usize {
        i * self.max_blocks_per_seq as usize
    }

    /// The lowest free row, if any. O(1) usually.
    pub(crate) fn first_free(&mut self) -> Result<usize, SeqError> {
        self.free
            .first()
            .map(|i| i as usize)
            .ok_or(SeqError::NoFreeSequence)
    }

    /// Takes free row `i` for an empty sequence in `namespace` whose chain starts at
    /// `root` (the namespace's empty chain).
    pub(crate) fn open(&mut self, i: usize, namespace: u64, root: Chain) {
        self.free.remove(i as u32);
        self.len[i] = 0;
        self.flags[i] = LIVE;
        self.known[i] = 0;
        self.committed[i] = 0;
        self.namespace[i] = namespace;
        self.set_chain(i, root);
        self.runs_storage(i)[0] = PositionRun::default();
        self.run_count[i] = 1;
        self.live += 1;
    }

    /// Takes free row `dst` for a copy of the state of live row `src` (the caller copies
    /// the blocks and adds their references).
    pub(crate) fn open_copy(&mut self, src: usize, dst: usize) {
        self.free.remove(dst as u32);
        self.len[dst] = self.len[src];
        self.flags[dst] = self.flags[src];
        self.known[dst] = self.known[src];
        self.committed[dst] = self.committed[src];
        self.namespace[dst] = self.namespace[src];
        self.set_chain(dst, self.chain(src));
        let (from, to) = (self.runs_start(src), self.runs_start(dst));
        self.runs
            .copy_within(from..from + self.max_position_runs as usize, to);
        self.run_count[dst] = self.run_count[src];
        self.logical_tokens += u64::from(self.len[src]);
        self.live += 1;
    }

    /// Frees row `i`, whose blocks are released already; its handles go stale.
    pub(crate) fn close(&mut self, i: usize) {
        self.len[i] = 0;
        self.swapped_len[i] = 0;
        self.flags[i] = 0;
        self.gen[i] = self.gen[i].wrapping_add(1);
        self.free.insert(i as u32);
        self.live -= 1;
    }

    /// Where the committed prefix of row `i` ends.
    #[inline]
    pub(crate) fn chain(&self, i: usize) -> Chain {
        Chain {
            hash: self.chain_hash[i],
            last: Link {
                block: self.chain_block[i],
                gen: self.chain_gen[i],
            },
        }
    }

    /// Sets where the committed prefix of row `i` ends.
    #[inline]
    pub(crate) fn set_chain(&mut self, i: usize, chain: Chain) {
        self.chain_hash[i] = chain.hash;
        self.chain_block[i] = chain.last.block;
        self.chain_gen[i] = chain.last.gen;
    }

    /// Start of row `i`'s runs.
    #[inline]
    fn runs_start(&self, i: usize) -> usize {
        i * self.max_position_runs as usize
    }

    /// The used runs of row `i`. O(1).
    #[inline]
    pub(crate) fn runs(&self, i: usize) -> &[PositionRun] {
        let start = self.runs_start(i);
        &self.runs[start..start + self.run_count[i] as usize]
    }

    /// All `max_position_runs` runs of row `i`, to write (then [`Self::set_run_count`]).
    pub(crate) fn runs_storage(&mut self, i: usize) -> &mut [PositionRun] {
        let start = self.runs_start(i);
        &mut self.runs[start..start + self.max_position_runs as usize]
    }

    /// Sets how many runs of row `i` are used (1 to `max_position_runs`).
    pub(crate) fn set_run_count(&mut self, i: usize, n: u32) {
        self.run_count[i] = n;
    }

    /// Whether every token of row `i`, and the next one appended, has its index as its
    /// position (one run `{0, 0}`): only then may appended ids extend the known prefix.
    #[inline]
    pub(crate) fn positions_are_indices(&self, i: usize) -> bool {
        self.run_count[i] == 1 && self.runs[self.runs_start(i)].first_position == 0
    }
}
