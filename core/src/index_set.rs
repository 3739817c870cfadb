//! A set of small integers `0..universe` as a hierarchical bitset over caller words.
//!
//! Words are `u32` so that every target, 32-bit microcontrollers included, works on its
//! native word; all bit operations are plain shifts and masks on those words. Level 0 holds one bit per index (set = member). Each higher level holds one
//! bit per word of the level below, set while that word is non-zero; the top level is a
//! single word. Finding the lowest member descends from the top with one `trailing_zeros` per
//! level: at most [`MAX_LEVELS`] steps for any `u32` universe. A hint remembers the lowest
//! level-0 word that may hold a member, so the common case of taking and returning
//! indices near the bottom touches one word.
//!
//! The hinted level-0 word lives in the set itself (`hint_bits`), not in the word array,
//! and is written back when the hint moves: taking and returning indices in that word
//! then touch one field at a fixed offset and no computed address, which takes the
//! store-to-load round trip through the array (and its bounds checks) off the common
//! path (`cargo bench -p kvpage-core --bench core -- alloc_free`, one pop + insert:
//! 4.0 ns with the word in the array, against 1.3 ns for a `Vec` pop + push). For the
//! same reason the size is not one counter that every pop and insert update: it is the
//! count of members outside the hinted word plus the hinted word's population, so the
//! common case writes `hint_bits` alone (one pop + insert 0.85 of the time of a build
//! that kept a counter, in alternating batches of one binary).
//!
//! Invariants: a bit of level `l + 1` is set iff the word it stands for at level `l` is
//! non-zero; `count_elsewhere` equals the number of set bits at level 0 outside word
//! `hint`; no level-0 word below `hint` has a set bit. Level-0 word `hint` is
//! `hint_bits`; the array's entry for it is stale until the hint moves.

/// Bits per word.
const BITS: usize = 32;

/// Levels needed for the largest `u32` universe (32^7 > 2^32).
pub const MAX_LEVELS: usize = 7;

/// `u32` words of storage a set over `universe` indices needs. O(levels).
pub const fn words_for(universe: u32) -> usize {
    let mut total = 0usize;
    let mut n = universe as usize;
    loop {
        let words = n.div_ceil(BITS);
        let words = if words == 0 { 1 } else { words };
        total += words;
        if words == 1 {
            return total;
        }
        n = words;
    }
}

/// Sets bits `0..bits` of `words` (bit `i` is bit `i % 32` of word `i / 32`); the words
/// are zero before. O(bits / 32).
fn set_low_bits(words: &mut [u32], bits: usize) {
    let (full, rest) = (bits / BITS, bits % BITS);
    words[..full].fill(u32::MAX);
    if rest != 0 {
        words[full] = (1 << rest) - 1;
    }
}

/// Hierarchical bitset over borrowed words. See the module docs for the invariants.
#[derive(Debug)]
pub struct IndexSet<'a> {
    words: &'a mut [u32],
    /// Start of each level in `words`, level 0 first.
    level_start: [u32; MAX_LEVELS],
    levels: u8,
    universe: u32,
    /// Members outside the hinted level-0 word; the set's size adds `hint_bits`'
    /// population, so taking and returning indices in the hinted word update no counter.
    count_elsewhere: u32,
    hint: u32,
    /// Level-0 word `hint` (the array's entry for it is stale).
    hint_bits: u32,
}

impl<'a> IndexSet<'a> {
    /// Builds a set over `words`, either empty or holding every index. O(words).
    ///
    /// # Panics
    /// If `words` is shorter than [`words_for`]`(universe)`: storage is sized by the
    /// caller's configuration, so this is a programming error, not caller input.
    pub fn new(words: &'a mut [u32], universe: u32, full: bool) -> Self {
        let mut level_start = [0u32; MAX_LEVELS];
        let mut level_words = [0usize; MAX_LEVELS];
        let mut levels = 0usize;
        let mut start = 0usize;
        let mut n = universe as usize;
        loop {
            let w = n.div_ceil(BITS).max(1);
            level_start[levels] = start as u32;
            level_words[levels] = w;
            levels += 1;
            start += w;
            if w == 1 {
                break;
            }
            n = w;
        }
        let words = &mut words[..start];
        words.fill(0);
        if full {
            // The members of each level are the words of the level below, all non-empty.
            let mut members = universe as usize;
            for level in 0..levels {
                let begin = level_start[level] as usize;
                set_low_bits(&mut words[begin..begin + level_words[level]], members);
                members = level_words[level];
            }
        }
        let hint_bits = words[0];
        let count = if full { universe } else { 0 };
        Self {
            words,
            level_start,
            levels: levels as u8,
            universe,
            count_elsewhere: count - hint_bits.count_ones(),
            hint: 0,
            hint_bits,
        }
    }

    fn word(&self, level: usize, index: usize) -> u32 {
        self.words[self.level_start[level] as usize + index]
    }

    fn word_mut(&mut self, level: usize, index: usize) -> &mut u32 {
        &mut self.words[self.level_start[level] as usize + index]
    }

    /// Number of members. O(1): a population count of the hinted word (a dozen
    /// instructions on targets without a `popcnt` instruction).
    pub fn count(&self) -> u32 {
        self.count_elsewhere + self.hint_bits.count_ones()
    }

    /// Whether the set has more than `n` members: `count() > n`, with no population
    /// count when the members outside the hinted word already exceed `n` (the common
    /// case of an allocator's check against a small reserve). O(1).
    #[inline]
    pub fn exceeds(&self, n: u32) -> bool {
        self.count_elsewhere > n || self.count() > n
    }

    /// Whether `i` is a member; `false` for indices outside the universe. O(1).
    pub fn contains(&self, i: u32) -> bool {
        i < self.universe && (self.level0(i as usize / BITS) >> (i % 32)) & 1 == 1
    }

    /// Level-0 word `index`, wherever it lives. O(1).
    #[inline(always)]
    fn level0(&self, index: usize) -> u32 {
        if index == self.hint as usize {
            self.hint_bits
        } else {
            self.words[index]
        }
    }

    /// Moves the hint to level-0 word `index`: writes the hinted word back to the array
    /// and takes word `index` out of it. O(1).
    fn move_hint(&mut self, index: usize) {
        self.words[self.hint as usize] = self.hint_bits;
        self.count_elsewhere += self.hint_bits.count_ones();
        self.hint = index as u32;
        self.hint_bits = self.words[index];
        self.count_elsewhere -= self.hint_bits.count_ones();
    }

    /// Adds `i`; returns whether it was absent. Indices outside the universe are ignored
    /// and return `false`. O(levels) worst case, O(1) when the word already had members.
    #[inline]
    pub fn insert(&mut self, i: u32) -> bool {
        if i >= self.universe {
            return false;
        }
        let word_index = i / BITS as u32;
        let mask = 1 << (i % BITS as u32);
        if word_index == self.hint {
            // The common case (a block returned next to the ones being handed out): one
            // field is read and written.
            let old = self.hint_bits;
            if old & mask != 0 {
                return false;
            }
            self.hint_bits = old | mask;
            if old == 0 {
                self.set_summary(word_index as usize);
            }
            return true;
        }
        self.insert_unhinted(word_index as usize, mask)
    }

    /// [`Self::insert`] into a level-0 word other than the hinted one. O(levels).
    fn insert_unhinted(&mut self, word_index: usize, mask: u32) -> bool {
        let old = self.words[word_index];
        if old & mask != 0 {
            return false;
        }
        self.words[word_index] = old | mask;
        self.count_elsewhere += 1;
        if word_index < self.hint as usize {
            self.move_hint(word_index);
        }
        if old == 0 {
            self.set_summary(word_index);
        }
        true
    }

    /// Writes level-0 word `index`, wherever it lives. O(1).
    #[inline(always)]
    fn set_level0(&mut self, index: usize, value: u32) {
        if index == self.hint as usize {
            self.hint_bits = value;
        } else {
            self.words[index] = value;
        }
    }

    /// Sets the summary bits above level-0 word `word`, which just became non-empty.
    /// O(levels).
    #[cold]
    fn set_summary(&mut self, word: usize) {
        let mut bit = word;
        for level in 1..self.levels as usize {
            let word = self.word_mut(level, bit / BITS);
            let was_empty = *word == 0;
            *word |= 1 << (bit % BITS);
            if !was_empty {
                break;
            }
            bit /= BITS;
        }
    }

    /// Removes `i`; returns whether it was present. O(levels) worst case.
    pub fn remove(&mut self, i: u32) -> bool {
        if !self.contains(i) {
            return false;
        }
        self.clear_present(i);
        true
    }

    /// Clears member `i` and the summary bits of the words that became empty.
    fn clear_present(&mut self, i: u32) {
        let word_index = i as usize / BITS;
        if word_index != self.hint as usize {
            self.count_elsewhere -= 1;
        }
        let word = self.level0(word_index) & !(1 << (i as usize % BITS));
        self.set_level0(word_index, word);
        if word == 0 {
            self.clear_summary(word_index);
        }
    }

    /// Lowest member, if any. O(levels): one `trailing_zeros` per level, O(1) when the
    /// hinted word holds a member.
    pub fn first(&mut self) -> Option<u32> {
        if self.hint_bits != 0 {
            return Some(self.hint * BITS as u32 + self.hint_bits.trailing_zeros());
        }
        if self.count_elsewhere == 0 {
            return None;
        }
        let mut index = 0usize;
        for level in (0..self.levels as usize).rev() {
            let w = if level == 0 {
                self.level0(index)
            } else {
                self.word(level, index)
            };
            debug_assert!(w != 0, "summary bit set over an empty word");
            index = index * BITS + w.trailing_zeros() as usize;
        }
        self.move_hint(index / BITS);
        Some(index as u32)
    }

    /// Removes and returns the lowest member. O(levels); O(1) when the hinted word holds
    /// a member.
    #[inline]
    pub fn pop_first(&mut self) -> Option<u32> {
        // Fast path: clearing the lowest set bit of the hinted word needs no search and
        // no membership test.
        let h = self.hint as usize;
        let w = self.hint_bits;
        if w != 0 {
            let rest = w & (w - 1);
            self.hint_bits = rest;
            if rest == 0 {
                self.clear_summary(h);
            }
            return Some(h as u32 * BITS as u32 + w.trailing_zeros());
        }
        self.pop_first_searching()
    }

    /// Removes the `out.len()` lowest members into `out`, in increasing order: what as
    /// many [`Self::pop_first`] calls return, with the members of each level-0 word taken
    /// in one loop over its bits. Returns `false`, having changed nothing, when the set
    /// holds fewer. O(out.len() + levels per level-0 word emptied).
    pub fn pop_first_into(&mut self, out: &mut [u32]) -> bool {
        if (self.count() as usize) < out.len() {
            return false;
        }
        let mut k = 0;
        while k < out.len() {
            let mut w = self.hint_bits;
            if w == 0 {
                // The next member lies past the hinted word: a descent moves the hint
                // to its word.
                out[k] = self.pop_first_searching().unwrap_or(0);
                k += 1;
                continue;
            }
            let base = self.hint * BITS as u32;
            while w != 0 && k < out.len() {
                out[k] = base + w.trailing_zeros();
                w &= w - 1;
                k += 1;
            }
            self.hint_bits = w;
            if w == 0 {
                self.clear_summary(self.hint as usize);
            }
        }
        true
    }

    /// [`Self::pop_first`] when the hinted word is empty: a descent from the top level.
    #[cold]
    fn pop_first_searching(&mut self) -> Option<u32> {
        let i = self.first()?;
        self.clear_present(i);
        Some(i)
    }

    /// Clears the summary bits above level-0 word `word`, which just became empty.
    /// O(levels).
    #[cold]
    fn clear_summary(&mut self, word: usize) {
        let mut bit = word;
        for level in 1..self.levels as usize {
            let word = self.word_mut(level, bit / BITS);
            *word &= !(1 << (bit % BITS));
            if *word != 0 {
                break;
            }
            bit /= BITS;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_for_counts_every_level() {
        assert_eq!(words_for(1), 1);
        assert_eq!(words_for(32), 1);
        assert_eq!(words_for(64), 2 + 1);
        assert_eq!(words_for(4096), 128 + 4 + 1);
        assert_eq!(words_for(1 << 20), 32768 + 1024 + 32 + 1);
        assert_eq!(
            words_for(u32::MAX),
            134_217_728 + 4_194_304 + 131_072 + 4096 + 128 + 4 + 1
        );
    }

    #[test]
    fn lowest_first_across_levels() {
        let n = 300_000u32;
        let mut words = [0u32; 9700];
        assert!(words_for(n) <= words.len());
        let mut set = IndexSet::new(&mut words, n, false);
        assert_eq!(set.first(), None);
        for i in [299_999, 70_000, 4_097, 64] {
            assert!(set.insert(i));
        }
        assert!(!set.insert(64));
        assert!(!set.insert(n));
        assert_eq!(set.count(), 4);
        assert_eq!(set.pop_first(), Some(64));
        assert_eq!(set.pop_first(), Some(4_097));
        assert!(set.insert(5));
        assert_eq!(set.pop_first(), Some(5));
        assert_eq!(set.pop_first(), Some(70_000));
        assert_eq!(set.pop_first(), Some(299_999));
        assert_eq!(set.pop_first(), None);
        assert_eq!(set.count(), 0);
    }

    #[test]
    #[cfg_attr(miri, ignore = "safe code over a local array; 16 s interpreted")]
    fn full_set_has_every_summary_bit() {
        let n = 40_000u32;
        let mut words = [0u32; 1300];
        let mut full = IndexSet::new(&mut words, n, true);
        assert_eq!(full.count(), n);
        for i in (0..n).rev() {
            assert!(full.remove(i));
            if i > 0 {
                assert_eq!(full.first(), Some(0));
            }
        }
        assert_eq!(full.first(), None);
    }

    #[test]
    fn full_set_pops_in_order() {
        let mut words = [0u32; 8];
        let mut set = IndexSet::new(&mut words, 200, true);
        for i in 0..200 {
            assert_eq!(set.pop_first(), Some(i));
        }
        assert_eq!(set.pop_first(), None);
    }
}
