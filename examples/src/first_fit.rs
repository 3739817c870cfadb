//! A first-fit byte allocator: the contiguous-reservation baseline.
//!
//! This is how an engine without paging hands out KV memory: each request gets one
//! contiguous byte range of an arena, taken from the lowest-addressed free hole that is
//! large enough (first fit); freeing a range merges it with free neighbours. It is a real
//! allocator over offsets (no memory is touched), so external fragmentation — free bytes
//! split into holes too small for the next request — shows up exactly as it would.
//!
//! Invariants (checked by the tests): holes never overlap or touch (adjacent holes are
//! always merged), live ranges never overlap, and `free_bytes + used_bytes == capacity`.

use std::collections::BTreeMap;
use std::fmt;

/// Why [`FirstFit::alloc`] failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocError {
    /// A zero-byte range was asked for.
    ZeroSize,
    /// No single hole is large enough, although `free` bytes may be in total.
    NoHole {
        /// Bytes asked for.
        size: u64,
        /// The largest hole.
        largest_hole: u64,
        /// All free bytes.
        free: u64,
    },
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::ZeroSize => write!(f, "zero-byte allocation"),
            AllocError::NoHole {
                size,
                largest_hole,
                free,
            } => write!(
                f,
                "no hole of {size} B (largest hole {largest_hole} B, {free} B free in total)"
            ),
        }
    }
}

impl std::error::Error for AllocError {}

/// [`FirstFit::free`] was given an offset that is not the start of a live range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotAllocated {
    /// The offending offset.
    pub offset: u64,
}

impl fmt::Display for NotAllocated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "offset {} is not the start of a live range", self.offset)
    }
}

impl std::error::Error for NotAllocated {}

/// First-fit allocator over `capacity` bytes. Allocation is O(h) in the number of holes,
/// freeing O(log n).
#[derive(Clone, Debug)]
pub struct FirstFit {
    capacity: u64,
    /// Free holes: offset -> length. Never adjacent, never empty.
    holes: BTreeMap<u64, u64>,
    /// Live ranges: offset -> length.
    live: BTreeMap<u64, u64>,
    used: u64,
}

impl FirstFit {
    /// An allocator with one hole spanning `capacity` bytes. O(1).
    pub fn new(capacity: u64) -> Self {
        let mut holes = BTreeMap::new();
        if capacity > 0 {
            holes.insert(0, capacity);
        }
        Self {
            capacity,
            holes,
            live: BTreeMap::new(),
            used: 0,
        }
    }

    /// Reserves `size` bytes from the lowest-addressed hole that fits and returns the
    /// offset of the range. O(h).
    ///
    /// # Errors
    /// [`AllocError::ZeroSize`] for `size == 0`; [`AllocError::NoHole`] if no hole fits.
    pub fn alloc(&mut self, size: u64) -> Result<u64, AllocError> {
        if size == 0 {
            return Err(AllocError::ZeroSize);
        }
        let Some((&off, &len)) = self.holes.iter().find(|(_, &len)| len >= size) else {
            return Err(AllocError::NoHole {
                size,
                largest_hole: self.largest_hole(),
                free: self.free_bytes(),
            });
        };
        self.holes.remove(&off);
        if len > size {
            self.holes.insert(off + size, len - size);
        }
        self.live.insert(off, size);
        self.used += size;
        Ok(off)
    }

    /// Frees the range starting at `offset`, merging it with adjacent holes, and returns
    /// its length. O(log n).
    ///
    /// # Errors
    /// [`NotAllocated`] if `offset` does not start a live range (nothing changes).
    pub fn free(&mut self, offset: u64) -> Result<u64, NotAllocated> {
        let size = self.live.remove(&offset).ok_or(NotAllocated { offset })?;
        self.used -= size;
        let mut start = offset;
        let mut len = size;
        if let Some((&prev_off, &prev_len)) = self.holes.range(..offset).next_back() {
            if prev_off + prev_len == offset {
                self.holes.remove(&prev_off);
                start = prev_off;
                len += prev_len;
            }
        }
        if let Some(next_len) = self.holes.remove(&(offset + size)) {
            len += next_len;
        }
        self.holes.insert(start, len);
        Ok(size)
    }

    /// Bytes managed. O(1).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes in live ranges. O(1).
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    /// Bytes in holes. O(1).
    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.used
    }

    /// Length of the largest hole (0 if full). O(h).
    pub fn largest_hole(&self) -> u64 {
        self.holes.values().copied().max().unwrap_or(0)
    }

    /// Number of holes. O(1).
    pub fn hole_count(&self) -> usize {
        self.holes.len()
    }

    /// Number of live ranges. O(1).
    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// How many ranges of `unit` bytes the holes could still serve, one after another
    /// (Σ over holes of `hole / unit`; exact for equal-sized requests). O(h). 0 when
    /// `unit == 0`.
    pub fn fit_count(&self, unit: u64) -> u64 {
        if unit == 0 {
            return 0;
        }
        self.holes.values().map(|&h| h / unit).sum()
    }

    /// Free bytes that cannot serve any range of `unit` bytes: for each hole, what is
    /// left after carving as many `unit` ranges as fit. External fragmentation, for
    /// equal-sized requests. O(h). Returns all free bytes when `unit == 0`.
    pub fn unusable_bytes(&self, unit: u64) -> u64 {
        if unit == 0 {
            return self.free_bytes();
        }
        self.holes.values().map(|&h| h % unit).sum()
    }

    /// The holes as `(offset, length)`, by address. O(h).
    pub fn holes(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.holes.iter().map(|(&o, &l)| (o, l))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn check(a: &FirstFit) {
        let mut end = 0;
        let mut prev_hole_end = None;
        let mut hole_sum = 0;
        for (o, l) in a.holes() {
            assert!(l > 0);
            assert!(o >= end, "holes overlap");
            assert_ne!(prev_hole_end, Some(o), "adjacent holes not merged");
            end = o + l;
            prev_hole_end = Some(end);
            hole_sum += l;
        }
        assert!(end <= a.capacity());
        assert_eq!(hole_sum, a.free_bytes());
        let mut live_end = 0;
        for (&o, &l) in &a.live {
            assert!(o >= live_end, "live ranges overlap");
            live_end = o + l;
            assert!(!a.holes().any(|(ho, hl)| ho < o + l && o < ho + hl));
        }
        assert_eq!(a.free_bytes() + a.used_bytes(), a.capacity());
    }

    #[test]
    fn first_fit_takes_the_lowest_hole_and_merges_on_free() {
        let mut a = FirstFit::new(100);
        assert_eq!(a.alloc(30), Ok(0));
        assert_eq!(a.alloc(30), Ok(30));
        assert_eq!(a.alloc(30), Ok(60));
        assert_eq!(
            a.alloc(30),
            Err(AllocError::NoHole {
                size: 30,
                largest_hole: 10,
                free: 10
            })
        );
        assert_eq!(a.free(0), Ok(30));
        assert_eq!(a.free(60), Ok(30));
        // Holes [0,30) and [60,100): 70 B free, but 40 is the largest.
        assert_eq!(a.largest_hole(), 40);
        assert_eq!(a.hole_count(), 2);
        assert_eq!(a.unusable_bytes(30), 10);
        assert_eq!(
            (a.fit_count(30), a.fit_count(20), a.fit_count(0)),
            (2, 3, 0)
        );
        assert!(matches!(
            a.alloc(50),
            Err(AllocError::NoHole { free: 70, .. })
        ));
        assert_eq!(a.alloc(20), Ok(0)); // lowest hole that fits
        assert_eq!(a.alloc(35), Ok(60));
        assert_eq!(a.free(30), Ok(30)); // merges with nothing on the left ([0,20) live)
        assert_eq!(a.holes().collect::<Vec<_>>(), vec![(20, 40), (95, 5)]);
        assert_eq!(a.free(0), Ok(20));
        assert_eq!(a.holes().collect::<Vec<_>>(), vec![(0, 60), (95, 5)]);
        assert_eq!(a.free(60), Ok(35));
        assert_eq!(a.holes().collect::<Vec<_>>(), vec![(0, 100)]);
        check(&a);
    }

    #[test]
    fn bad_frees_and_zero_sizes_are_errors() {
        let mut a = FirstFit::new(10);
        assert_eq!(a.alloc(0), Err(AllocError::ZeroSize));
        let o = a.alloc(4).unwrap();
        assert_eq!(a.free(o + 1), Err(NotAllocated { offset: o + 1 }));
        assert_eq!(a.free(o), Ok(4));
        assert_eq!(a.free(o), Err(NotAllocated { offset: o }));
        assert_eq!(
            FirstFit::new(0).alloc(1).unwrap_err().to_string(),
            "no hole of 1 B (largest hole 0 B, 0 B free in total)"
        );
    }

    #[test]
    fn random_alloc_free_keeps_invariants() {
        let mut rng = SplitMix64::new(42);
        let mut a = FirstFit::new(10_000);
        let mut live = Vec::new();
        for _ in 0..5_000 {
            if live.is_empty() || rng.range_u32(0, 2) > 0 {
                let size = u64::from(rng.range_u32(1, 900));
                if let Ok(o) = a.alloc(size) {
                    live.push(o);
                }
            } else {
                let i = rng.range_u32(0, live.len() as u32 - 1) as usize;
                a.free(live.swap_remove(i)).unwrap();
            }
            check(&a);
        }
        for o in live {
            a.free(o).unwrap();
        }
        assert_eq!(a.holes().collect::<Vec<_>>(), vec![(0, 10_000)]);
    }
}
