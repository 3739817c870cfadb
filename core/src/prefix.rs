//! The prefix cache: full blocks registered under a chained hash, verified on every hit,
//! and an LRU list of registered blocks nobody references.
//!
//! A block's key is `(hash, namespace, parent link, token ids)`. The hash chains the
//! parent's hash, the namespace and the block's token ids under a per-instance key
//! ([`BlockHasher`]); it only picks candidates. A hit
//! is accepted only when the namespace, the stored token ids and the parent link (the
//! parent's block id and its registration generation) all match, so by induction from the
//! first block the whole prefix matches exactly: a hash collision can never hand back
//! another prompt's blocks, and namespaces never share.
//!
//! The hash table is open addressing with linear probing over a power-of-two array of
//! block ids (`id + 1`, 0 = empty) with backward-shift deletion, at most half full, so
//! lookup, insert and remove are O(1) expected and never scan the pool. Cached blocks
//! wait in the eviction lists of [`crate::retention`] (intrusive, per namespace slot and
//! priority), so touch is O(1) and evict O(namespace slots). A block's [`Priority`] is
//! kept in its flags while the cache knows it.
//!
//! Invariants: a block is in the table iff its `REGISTERED` flag is set; a block is in the
//! LRU list iff it is registered and its reference count is zero (kept by the manager).
//! With [`Config::prefix_cache`] off every array is empty: nothing is tracked or
//! registered, lookups miss, and the accessors that the append paths call on every block
//! do nothing.

use crate::config::Config;
use crate::events::{EventRing, RemovedBlock, StoredBlock};
use crate::retention::{LruLists, Priority};
use crate::storage::{u32_words, Carver};

/// "No block" in links and list pointers.
pub(crate) const NIL: u32 = u32::MAX;

const REGISTERED: u32 = 1;
/// The block was committed (full, token ids known): `hash` and `link` are valid.
const HASHED: u32 = 2;
/// The block's priority level, stored xor [`Priority::Normal`] in these flag bits so a
/// cleared block (flags 0) reads `Normal`.
const PRIO_SHIFT: u32 = 8;
const PRIO_MASK: u32 = 3 << PRIO_SHIFT;

/// Identity of a registered block at one moment: its id and registration generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Link {
    pub(crate) block: u32,
    pub(crate) gen: u32,
}

impl Link {
    /// The parent link of a sequence's first block.
    pub(crate) const ROOT: Link = Link { block: NIL, gen: 0 };
}

/// Where a chain of committed blocks ends: the chain hash after its last block and that
/// block's registered representative (the namespace's seed and [`Link::ROOT`] for an
/// empty chain).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chain {
    pub(crate) hash: u64,
    pub(crate) last: Link,
}

/// How far a prompt's leading blocks are cached: see [`PrefixCache::walk`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Walk {
    /// Whole leading blocks found.
    pub(crate) blocks: u32,
    /// Where the run of blocks found ends.
    pub(crate) end: Chain,
}

/// The keyed block hash: every block's hash depends on [`crate::Config::hash_key`], so
/// without the key nobody can craft prompts whose blocks pile up on one probe run of the
/// table. The same key gives the same hashes on every run and machine (fixed constants,
/// 64-bit arithmetic only).
///
/// Per four token ids (two 64-bit words `w0`, `w1`), the state becomes
/// `fold(state ^ w0 ^ k0, w1 ^ k1)`, where `fold` multiplies to 128 bits and xors the
/// halves (one multiplication per four tokens, about 40% faster than the unkeyed
/// per-token FNV step it replaced) and `k0`, `k1` are subkeys derived from the key.
/// The chain starts from the parent's hash and the namespace, both keyed, and ends with
/// the splitmix64 finalizer so every state bit reaches the table index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockHasher {
    k0: u64,
    k1: u64,
}

impl BlockHasher {
    /// Derives the subkeys of `key`. O(1).
    pub(crate) const fn new(key: u64) -> Self {
        Self {
            k0: mix(key ^ 0x6b76_7061_6765_0001),
            // Odd, so the multiplier never clears low bits of the state.
            k1: mix(key ^ 0x243f_6a88_85a3_08d3) | 1,
        }
    }

    /// Seed of the hash chain of a namespace. O(1).
    pub(crate) fn root(&self, namespace: u64) -> u64 {
        mix(fold(namespace ^ self.k0, self.k1))
    }

    /// Hash of one block's token ids chained from its parent's hash and the namespace.
    /// O(block_size).
    pub(crate) fn chain(&self, parent: u64, namespace: u64, tokens: &[u32]) -> u64 {
        let mut h = fold(parent ^ self.k0, namespace.rotate_left(29) ^ self.k1);
        let mut quads = tokens.chunks_exact(4);
        for q in &mut quads {
            h = self.step(h, [q[0], q[1], q[2], q[3]]);
        }
        let rest = quads.remainder();
        if !rest.is_empty() {
            // Zero padding is unambiguous: every block of one cache has the same length.
            let mut q = [0u32; 4];
            q[..rest.len()].copy_from_slice(rest);
            h = self.step(h, q);
        }
        mix(h)
    }

    /// Mixes four token ids into the state: one keyed 64×64→128-bit multiplication.
    #[inline(always)]
    fn step(&self, h: u64, q: [u32; 4]) -> u64 {
        let w0 = u64::from(q[0]) | u64::from(q[1]) << 32;
        let w1 = u64::from(q[2]) | u64::from(q[3]) << 32;
        fold(h ^ w0 ^ self.k0, w1 ^ self.k1)
    }
}

/// The 128-bit product of `a` and `b`, its halves xored.
const fn fold(a: u64, b: u64) -> u64 {
    let p = a as u128 * b as u128;
    p as u64 ^ (p >> 64) as u64
}

/// The splitmix64 finalizer: spreads every input bit over the output.
const fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Per-block registration data, the hash table and the LRU list.
#[derive(Debug)]
pub(crate) struct PrefixCache<'a> {
    pub(crate) block_size: u32,
    /// The keyed hash of block contents.
    pub(crate) hasher: BlockHasher,
    hash: &'a mut [u64],
    namespace: &'a mut [u64],
    flags: &'a mut [u32],
    parent: &'a mut [u32],
    parent_gen: &'a mut [u32],
    /// Registration generation, bumped whenever the block leaves the cache.
    gen: &'a mut [u32],
    /// Registered block standing for this block's content when it was committed.
    link: &'a mut [u32],
    link_gen: &'a mut [u32],
    tokens: &'a mut [u32],
    table: &'a mut [u32],
    lru: LruLists<'a>,
    /// Blocks whose priority is `Pinned`, in any state.
    pinned_marked: u32,
    /// Registered blocks.
    registered: u32,
    /// Each registered block's parent hash as registered (only with events on, so a
    /// block whose parent left can still be reported in its stored form).
    parent_hash: &'a mut [u64],
    /// Every registration and unregistration, for routers ([`crate::events`]).
    pub(crate) events: EventRing<'a>,
}

impl<'a> PrefixCache<'a> {
    /// `u64` words the prefix cache of `config` takes: per block a hash, a namespace,
    /// six `u32` fields and `block_size` token ids, the hash table and the eviction
    /// lists; none at all when [`Config::prefix_cache`] is off. O(1).
    pub(crate) const fn storage_words(config: &Config) -> u128 {
        if !config.prefix_cache {
            return 0;
        }
        let n = config.num_blocks as u128;
        2 * n
            + 6 * u32_words(n)
            + u32_words(n * config.block_size as u128)
            + u32_words(config.hash_capacity() as u128)
            + LruLists::storage_words(config.num_blocks, config.namespace_slots(), true)
            + Self::parent_hash_words(config)
            + EventRing::storage_words(config)
    }

    /// Words of the parent-hash array: one per block with events on, else none.
    const fn parent_hash_words(config: &Config) -> u128 {
        match EventRing::capacity(config) {
            0 => 0,
            _ => config.num_blocks as u128,
        }
    }

    /// Carves the arrays counted by [`PrefixCache::storage_words`]: all empty when the
    /// prefix cache is off, so every lookup misses and nothing is ever registered.
    /// O(storage words).
    pub(crate) fn new(config: &Config, carve: &mut Carver<'a>) -> Self {
        let start = carve.taken();
        let (n, tokens, table) = if config.prefix_cache {
            let n = config.num_blocks as usize;
            let tokens = n * config.block_size as usize;
            (n, tokens, config.hash_capacity() as usize)
        } else {
            (0, 0, 0)
        };
        debug_assert!(table == 0 || table.is_power_of_two());
        let cache = Self {
            block_size: config.block_size,
            hasher: BlockHasher::new(config.hash_key),
            hash: carve.words(n),
            namespace: carve.words(n),
            flags: carve.u32s(n),
            parent: carve.u32s(n),
            parent_gen: carve.u32s(n),
            gen: carve.u32s(n),
            link: carve.u32s(n),
            link_gen: carve.u32s(n),
            tokens: carve.u32s(tokens),
            table: carve.u32s(table),
            lru: LruLists::new(
                config.num_blocks,
                config.namespace_slots(),
                config.prefix_cache,
                carve,
            ),
            pinned_marked: 0,
            registered: 0,
            parent_hash: carve.words(Self::parent_hash_words(config) as usize),
            events: EventRing::new(config, carve),
        };
        debug_assert_eq!((carve.taken() - start) as u128, Self::storage_words(config));
        cache
    }

    /// The empty chain of `namespace`: its seed hash and [`Link::ROOT`]. O(1).
    pub(crate) fn root(&self, namespace: u64) -> Chain {
        Chain {
            hash: self.hasher.root(namespace),
            last: Link::ROOT,
        }
    }

    /// Whether the cache has storage (see [`Config::prefix_cache`]). O(1).
    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        !self.table.is_empty()
    }

    #[inline]
    fn token_range(&self, b: u32) -> core::ops::Range<usize> {
        let start = b as usize * self.block_size as usize;
        start..start + self.block_size as usize
    }

    /// Token ids stored for block `b` (only the filled part is meaningful).
    #[inline]
    pub(crate) fn tokens(&self, b: u32) -> &[u32] {
        &self.tokens[self.token_range(b)]
    }

    /// Stores the id of token `offset` of block `b` (nothing when the cache is off). O(1).
    #[inline]
    pub(crate) fn set_token(&mut self, b: u32, offset: u32, id: u32) {
        let i = b as usize * self.block_size as usize + offset as usize;
        if let Some(t) = self.tokens.get_mut(i) {
            *t = id;
        }
    }

    /// Copies the first `n` token ids of `src` to `dst` (copy-on-write); nothing when
    /// the cache is off. O(n).
    pub(crate) fn copy_tokens(&mut self, src: u32, dst: u32, n: u32) {
        if self.enabled() {
            let s = self.token_range(src).start;
            let d = self.token_range(dst).start;
            self.tokens.copy_within(s..s + n as usize, d);
        }
    }

    /// Whether the cache knows anything about `b` (registered or hashed). O(1).
    #[inline]
    pub(crate) fn is_tracked(&self, b: u32) -> bool {
        self.flags
            .get(b as usize)
            .is_some_and(|&f| f & (REGISTERED | HASHED) != 0)
    }

    /// Whether `b` is registered (always `false` when the cache is off). O(1).
    #[inline]
    pub(crate) fn is_registered(&self, b: u32) -> bool {
        self.flags
            .get(b as usize)
            .is_some_and(|&f| f & REGISTERED != 0)
    }

    /// Where the chain ends at `b` (its hash and registered representative) if `b` was
    /// committed.
    pub(crate) fn hashed(&self, b: u32) -> Option<Chain> {
        let i = b as usize;
        (self.flags[i] & HASHED != 0).then(|| Chain {
            hash: self.hash[i],
            last: Link {
                block: self.link[i],
                gen: self.link_gen[i],
            },
        })
    }

    /// Forgets everything about `b`'s content: it is being reused or overwritten. The
    /// caller has unregistered it first.
    pub(crate) fn clear(&mut self, b: u32) {
        debug_assert!(!self.is_registered(b));
        self.pinned_marked -= u32::from(self.priority(b) == Priority::Pinned);
        if let Some(f) = self.flags.get_mut(b as usize) {
            *f = 0;
        }
    }

    /// The namespace, hash and parent link a registered block was registered with.
    /// O(1).
    pub(crate) fn key_of(&self, b: u32) -> (u64, u64, Link) {
        let i = b as usize;
        let parent = Link {
            block: self.parent[i],
            gen: self.parent_gen[i],
        };
        (self.namespace[i], self.hash[i], parent)
    }

    /// Stores `ids` as the token ids of block `b` from token `offset` on; past the
    /// block size they run on into blocks `b + 1`, `b + 2`, ... (whose places follow
    /// `b`'s), which must exist. Nothing when the cache is off. O(ids).
    #[inline]
    pub(crate) fn set_tokens(&mut self, b: u32, offset: u32, ids: &[u32]) {
        if self.enabled() {
            let start = self.token_range(b).start + offset as usize;
            self.tokens[start..start + ids.len()].copy_from_slice(ids);
        }
    }

    /// Lists cached block `b` as least recently used among the blocks of namespace slot
    /// `slot` at its priority. O(1).
    pub(crate) fn lru_push_front(&mut self, b: u32, slot: usize) {
        let level = self.priority(b);
        self.lru.push_front(b, slot, level);
    }

    /// Current link of a registered block.
    #[inline]
    pub(crate) fn link_of(&self, b: u32) -> Link {
        Link {
            block: b,
            gen: self.gen[b as usize],
        }
    }

    /// Is the block a parent link points at still the one that was linked?
    pub(crate) fn link_alive(&self, link: Link) -> bool {
        link.block == NIL
            || (self.is_registered(link.block) && self.gen[link.block as usize] == link.gen)
    }

    /// Finds the registered block with exactly this content, verifying namespace, token ids
    /// and parent. O(block_size) expected.
    pub(crate) fn find(
        &self,
        hash: u64,
        namespace: u64,
        parent: Link,
        tokens: &[u32],
    ) -> Option<u32> {
        if !self.enabled() || !self.link_alive(parent) {
            return None;
        }
        let mask = self.table.len() - 1;
        let mut pos = hash as usize & mask;
        loop {
            let entry = self.table[pos];
            if entry == 0 {
                return None;
            }
            let b = entry - 1;
            let i = b as usize;
            if self.hash[i] == hash
                && self.namespace[i] == namespace
                && self.parent[i] == parent.block
                && self.parent_gen[i] == parent.gen
                && self.tokens(b) == tokens
            {
                return Some(b);
            }
            pos = (pos + 1) & mask;
        }
    }

    /// Finds the longest run of registered blocks matching the leading whole blocks of
    /// `tokens` in `namespace`, stopping one token short of the end (at most
    /// `(len - 1) / block_size` blocks, so a prompt always leaves a token to compute).
    /// Calls `hit(k, block)` for logical block `k` of the run, in order.
    /// O(prompt length).
    pub(crate) fn walk(
        &self,
        namespace: u64,
        tokens: &[u32],
        mut hit: impl FnMut(usize, u32),
    ) -> Walk {
        let bs = self.block_size as usize;
        let max_blocks = match self.enabled() {
            true => tokens.len().saturating_sub(1) / bs,
            false => 0,
        };
        let mut walk = Walk {
            blocks: 0,
            end: self.root(namespace),
        };
        for (k, chunk) in tokens.chunks_exact(bs).take(max_blocks).enumerate() {
            let hash = self.hasher.chain(walk.end.hash, namespace, chunk);
            let Some(b) = self.find(hash, namespace, walk.end.last, chunk) else {
                break;
            };
            hit(k, b);
            walk = Walk {
                blocks: walk.blocks + 1,
                end: Chain {
                    hash,
                    last: self.link_of(b),
                },
            };
        }
        walk
    }

    /// Records that full block `b` has `hash` and stands for content whose registered
    /// representative is `link` (itself when it gets registered). O(1).
    pub(crate) fn set_hashed(&mut self, b: u32, hash: u64, link: Link) {
        let i = b as usize;
        self.hash[i] = hash;
        self.link[i] = link.block;
        self.link_gen[i] = link.gen;
        self.flags[i] |= HASHED;
    }

    /// Registers full, hashed block `b` under its hash. O(1) expected.
    pub(crate) fn register(&mut self, b: u32, hash: u64, namespace: u64, parent: Link) -> Link {
        let i = b as usize;
        debug_assert!(!self.is_registered(b));
        self.namespace[i] = namespace;
        self.parent[i] = parent.block;
        self.parent_gen[i] = parent.gen;
        self.flags[i] |= REGISTERED;
        self.registered += 1;
        let link = self.link_of(b);
        self.set_hashed(b, hash, link);
        let mask = self.table.len() - 1;
        let mut pos = hash as usize & mask;
        while self.table[pos] != 0 {
            pos = (pos + 1) & mask;
        }
        self.table[pos] = b + 1;
        if self.events.enabled() {
            // The parent is registered (callers check its link), so its hash is current.
            let (parent_block, parent_hash) = match parent.block {
                NIL => (None, self.hasher.root(namespace)),
                p => (Some(p), self.hash[p as usize]),
            };
            self.parent_hash[i] = parent_hash;
            let tokens = self.token_range(b);
            self.events.stored(StoredBlock {
                block: b,
                hash,
                parent_hash,
                parent: parent_block,
                namespace,
                tokens: &self.tokens[tokens],
            });
        }
        link
    }

    /// Registered blocks (used and cached). O(1).
    #[inline]
    pub(crate) fn registered_count(&self) -> u32 {
        self.registered
    }

    /// The parent hash registered block `b` was registered with, when events are on
    /// (`None` otherwise). O(1).
    pub(crate) fn stored_parent_hash(&self, b: u32) -> Option<u64> {
        self.parent_hash.get(b as usize).copied()
    }

    /// Removes registered block `b` from the table (not from the LRU list) and bumps its
    /// generation so links to it die. O(1) expected.
    pub(crate) fn unregister(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(self.is_registered(b));
        self.flags[i] &= !REGISTERED;
        self.registered -= 1;
        self.gen[i] = self.gen[i].wrapping_add(1);
        self.events.removed(RemovedBlock {
            block: b,
            hash: self.hash[i],
            namespace: self.namespace[i],
        });
        let mask = self.table.len() - 1;
        let mut pos = self.hash[i] as usize & mask;
        while self.table[pos] != b + 1 {
            pos = (pos + 1) & mask;
        }
        // Backward-shift deletion: pull later entries of the probe run into the hole.
        let mut hole = pos;
        let mut probe = (pos + 1) & mask;
        loop {
            let entry = self.table[probe];
            if entry == 0 {
                break;
            }
            let home = self.hash[(entry - 1) as usize] as usize & mask;
            // Move the entry if its home is not in (hole, probe] cyclically.
            let dist_home = probe.wrapping_sub(home) & mask;
            let dist_hole = probe.wrapping_sub(hole) & mask;
            if dist_home >= dist_hole {
                self.table[hole] = entry;
                hole = probe;
            }
            probe = (probe + 1) & mask;
        }
        self.table[hole] = 0;
    }

    /// Registered blocks with no references (cached), pinned ones included. O(1).
    #[inline]
    pub(crate) fn lru_len(&self) -> u32 {
        self.lru.len()
    }

    /// Blocks whose priority is [`Priority::Pinned`], whatever their state (used,
    /// cached, or unregistered awaiting reuse). O(1).
    #[inline]
    pub(crate) fn pinned_marked(&self) -> u32 {
        self.pinned_marked
    }

    /// Whether block `b` stays cached, unavailable, when its last holder releases it:
    /// registered and pinned. O(1).
    #[inline]
    pub(crate) fn stays_pinned(&self, b: u32) -> bool {
        self.is_registered(b) && self.priority(b) == Priority::Pinned
    }

    /// Cached blocks at [`Priority::Pinned`] (never evicted). O(1).
    #[inline]
    pub(crate) fn lru_pinned(&self) -> u32 {
        self.lru.pinned()
    }

    /// The eviction lists (read-only). O(1).
    pub(crate) fn lru(&self) -> &LruLists<'a> {
        &self.lru
    }

    /// Lists cached block `b` as most recently used among the blocks of namespace slot
    /// `slot` at its priority. O(1).
    pub(crate) fn lru_push_back(&mut self, b: u32, slot: usize) {
        let level = self.priority(b);
        self.lru.push_back(b, slot, level);
    }

    /// Unlinks cached block `b` from its list. O(1).
    pub(crate) fn lru_remove(&mut self, b: u32) {
        self.lru.remove(b);
    }

    /// Unlinks and returns the block eviction takes next among the slots `eligible`
    /// accepts (see [`LruLists::pop_lowest`]); never a pinned one. O(slots).
    pub(crate) fn lru_pop(&mut self, eligible: impl Fn(usize) -> bool) -> Option<u32> {
        self.lru.pop_lowest(eligible)
    }

    /// The priority of block `b` (`Normal` for a block the cache knows nothing of, and
    /// with the cache off). O(1).
    #[inline]
    pub(crate) fn priority(&self, b: u32) -> Priority {
        let bits = self
            .flags
            .get(b as usize)
            .map_or(0, |f| (f & PRIO_MASK) >> PRIO_SHIFT);
        Priority::ALL[(bits ^ Priority::Normal as u32) as usize]
    }

    /// Sets the priority of block `b` (nothing with the cache off). A cached block
    /// (`listed`) moves to the back of the list of its new level. O(1).
    pub(crate) fn set_priority(&mut self, b: u32, p: Priority, listed: bool) {
        let old = self.priority(b);
        if old == p {
            return;
        }
        let slot = listed.then(|| self.lru.list_of(b).0);
        if slot.is_some() {
            self.lru.remove(b);
        }
        if let Some(f) = self.flags.get_mut(b as usize) {
            *f = (*f & !PRIO_MASK) | ((p as u32 ^ Priority::Normal as u32) << PRIO_SHIFT);
            self.pinned_marked += u32::from(p == Priority::Pinned);
            self.pinned_marked -= u32::from(old == Priority::Pinned);
        }
        if let Some(slot) = slot {
            self.lru.push_back(b, slot, p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: u32 = 8;
    const BS: u32 = 2;
    /// Storage of a cache of 8 blocks of 2 tokens (a 16-entry table).
    type Arrays = [u64; 74];

    fn config(key: u64) -> Config {
        Config {
            num_blocks: N,
            block_size: BS,
            max_seqs: 1,
            max_blocks_per_seq: 1,
            instance: 0,
            hash_key: key,
            prefix_cache: true,
            max_position_runs: 4,
            max_namespaces: 0,
            event_capacity: 0,
        }
    }

    fn arrays() -> Arrays {
        assert_eq!(PrefixCache::storage_words(&config(0)), 74);
        [0; 74]
    }

    fn cache(a: &mut Arrays) -> PrefixCache<'_> {
        keyed_cache(a, 0)
    }

    fn keyed_cache(a: &mut Arrays, key: u64) -> PrefixCache<'_> {
        PrefixCache::new(&config(key), &mut Carver::new(a))
    }

    #[test]
    fn a_colliding_hash_never_returns_other_content() {
        let mut a = arrays();
        let mut c = cache(&mut a);
        c.set_tokens(0, 0, &[1, 2]);
        let root = c.register(0, 42, 7, Link::ROOT);
        // Same hash, other tokens / namespace / parent: all refused.
        assert_eq!(c.find(42, 7, Link::ROOT, &[1, 3]), None);
        assert_eq!(c.find(42, 8, Link::ROOT, &[1, 2]), None);
        assert_eq!(c.find(42, 7, root, &[1, 2]), None);
        assert_eq!(c.find(42, 7, Link::ROOT, &[1, 2]), Some(0));
        // A second block under the same hash with other tokens is found by its own tokens.
        c.set_tokens(1, 0, &[1, 3]);
        c.register(1, 42, 7, Link::ROOT);
        assert_eq!(c.find(42, 7, Link::ROOT, &[1, 3]), Some(1));
        assert_eq!(c.find(42, 7, Link::ROOT, &[1, 2]), Some(0));
    }

    #[test]
    fn a_child_of_an_evicted_parent_is_unreachable() {
        let mut a = arrays();
        let mut c = cache(&mut a);
        c.set_tokens(0, 0, &[1, 2]);
        let parent = c.register(0, 10, 0, Link::ROOT);
        c.set_tokens(1, 0, &[3, 4]);
        c.register(1, 11, 0, parent);
        assert_eq!(c.find(11, 0, parent, &[3, 4]), Some(1));
        c.unregister(0);
        c.set_tokens(0, 0, &[1, 2]);
        let reborn = c.register(0, 10, 0, Link::ROOT);
        assert_ne!(reborn, parent, "generation moves on");
        assert_eq!(c.find(11, 0, parent, &[3, 4]), None);
        assert_eq!(c.find(11, 0, reborn, &[3, 4]), None);
    }

    #[test]
    fn removal_keeps_probe_runs_intact() {
        let mut a = arrays();
        let mut c = cache(&mut a);
        // Blocks 0..6 all hash to slot 15 or 0 so their probe runs wrap around.
        let hashes = [15u64, 15, 0, 15, 0, 1];
        for (b, &h) in hashes.iter().enumerate() {
            c.set_tokens(b as u32, 0, &[b as u32, 0]);
            c.register(b as u32, h, 0, Link::ROOT);
        }
        for remove in [1u32, 0, 4] {
            c.unregister(remove);
        }
        for (b, &h) in hashes.iter().enumerate() {
            let found = c.find(h, 0, Link::ROOT, &[b as u32, 0]);
            let expect = (![1, 0, 4].contains(&b)).then_some(b as u32);
            assert_eq!(found, expect, "block {b}");
        }
    }

    /// The chain hashes of a 4-block prompt of 16-token blocks under `key`.
    fn chain_of(key: u64) -> [u64; 4] {
        let hasher = BlockHasher::new(key);
        let prompt: [u32; 64] = core::array::from_fn(|i| (i as u32).wrapping_mul(2_654_435_761));
        let mut h = hasher.root(7);
        core::array::from_fn(|k| {
            h = hasher.chain(h, 7, &prompt[k * 16..k * 16 + 16]);
            h
        })
    }

    #[test]
    fn keys_change_every_hash_and_table_position() {
        let keys = [0u64, 1, 2, 1 << 63, 0x0123_4567_89ab_cdef];
        let chains = keys.map(chain_of);
        for (a, ca) in chains.iter().enumerate() {
            for cb in &chains[a + 1..] {
                for (ha, hb) in ca.iter().zip(cb) {
                    assert_ne!(ha, hb);
                }
                // Positions in a 1024-entry table: the whole probe pattern moves.
                let pos = |c: &[u64; 4]| c.map(|h| h as usize & 1023);
                assert_ne!(pos(ca), pos(cb));
            }
        }
        // Stable across runs and machines: the same key, the same hashes (pinned, so a
        // change to the function is a conscious one: KV events and persisted caches
        // carry these values).
        assert_eq!(chain_of(1), chain_of(1));
        assert_eq!(chain_of(0)[0], GOLDEN_KEY0_BLOCK0);
        // Token order, namespace and parent all matter.
        let hasher = BlockHasher::new(5);
        let root = hasher.root(0);
        let base = hasher.chain(root, 0, &[1, 2, 3]);
        assert_ne!(base, hasher.chain(root, 0, &[2, 1, 3]));
        assert_ne!(base, hasher.chain(root, 1, &[1, 2, 3]));
        assert_ne!(base, hasher.chain(root ^ 1, 0, &[1, 2, 3]));
        assert_ne!(root, hasher.root(1));
    }

    const GOLDEN_KEY0_BLOCK0: u64 = 0x9978_a963_1688_d365;

    #[test]
    fn a_keyed_cache_finds_what_it_registered() {
        for key in [0, 1, u64::MAX] {
            let mut a = arrays();
            let mut c = keyed_cache(&mut a, key);
            let tokens = [[5u32, 6], [7, 8], [9, 10]];
            let mut hash = c.hasher.root(3);
            let mut parent = Link::ROOT;
            for (b, t) in tokens.iter().enumerate() {
                c.set_tokens(b as u32, 0, t);
                hash = c.hasher.chain(hash, 3, t);
                parent = c.register(b as u32, hash, 3, parent);
            }
            let hits = c.walk(3, &[5, 6, 7, 8, 9, 10, 0], |_, _| {});
            assert_eq!(
                (hits.blocks, hits.end.hash, hits.end.last),
                (3, hash, parent)
            );
            assert_eq!(c.walk(4, &[5, 6, 7, 8, 9, 10, 0], |_, _| {}).blocks, 0);
        }
    }
}
