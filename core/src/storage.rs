//! Carving one caller-provided `&mut [u64]` into the typed arrays of the manager.
//!
//! `u32` arrays are cast from whole `u64` words with `bytemuck` (same alignment or
//! stricter, no invalid bit patterns), so the core needs no `unsafe`. Each part of the
//! manager states the words it takes (a `storage_words` function counting its arrays
//! with [`u32_words`] and one word per `u64`) and carves exactly that much, checked by a
//! debug assertion against [`Carver::taken`].

/// Words [`Carver::u32s`] takes for `n` `u32`s. O(1).
pub(crate) const fn u32_words(n: u128) -> u128 {
    n.div_ceil(2)
}

/// Hands out consecutive pieces of a word slice. The caller has checked the total size
/// against [`crate::Config::storage_words`], so the splits cannot run out.
pub(crate) struct Carver<'a> {
    rest: &'a mut [u64],
    taken: usize,
}

impl<'a> Carver<'a> {
    pub(crate) fn new(words: &'a mut [u64]) -> Self {
        Self {
            rest: words,
            taken: 0,
        }
    }

    /// Words handed out so far.
    pub(crate) fn taken(&self) -> usize {
        self.taken
    }

    /// Next `n` words, zeroed.
    pub(crate) fn words(&mut self, n: usize) -> &'a mut [u64] {
        let rest = core::mem::take(&mut self.rest);
        let (head, tail) = rest.split_at_mut(n);
        self.rest = tail;
        self.taken += n;
        head.fill(0);
        head
    }

    /// Next `n` `u32`s, zeroed, taken as [`u32_words`]`(n)` words.
    pub(crate) fn u32s(&mut self, n: usize) -> &'a mut [u32] {
        let words = self.words(n.div_ceil(2));
        &mut bytemuck::cast_slice_mut::<u64, u32>(words)[..n]
    }

    /// Next `n` records of a plain-data type, zeroed, taken as
    /// [`words_for_pods`]`::<T>(n)` words.
    pub(crate) fn pods<T: bytemuck::Pod>(&mut self, n: usize) -> &'a mut [T] {
        let words = self.words(words_for_pods::<T>(n));
        let bytes = bytemuck::cast_slice_mut::<u64, u8>(words);
        // Word-aligned start and `align_of::<T>() <= 8` (checked below): the cast holds.
        const { assert!(core::mem::align_of::<T>() <= 8) };
        bytemuck::cast_slice_mut::<u8, T>(&mut bytes[..n * core::mem::size_of::<T>()])
    }
}

/// Words [`Carver::pods`] takes for `n` records of `T`. O(1).
pub(crate) const fn words_for_pods<T>(n: usize) -> usize {
    (n * core::mem::size_of::<T>()).div_ceil(8)
}
