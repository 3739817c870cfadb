//! The contiguous baseline: every sequence reserves `max_seq_len` tokens of KV in one
//! contiguous range of a [`FirstFit`] byte allocator, at admission, whatever it will use.
//! A request waits until a hole fits; a sequence never grows out of its range, so it is
//! never preempted.
//!
//! For the scheduler, one region is one "block" of `max_seq_len` tokens, and the free
//! blocks are the regions the holes can still hold ([`FirstFit::fit_count`]).

use std::collections::HashMap;

use crate::first_fit::{AllocError, FirstFit};
use crate::sim::{KvPolicy, PolicyError, Usage};

/// Contiguous `max_seq_len` reservations in a first-fit allocator.
#[derive(Clone, Debug)]
pub struct Contiguous {
    alloc: FirstFit,
    region_bytes: u64,
    max_seq_len: u32,
    /// id -> (offset, tokens held).
    seqs: HashMap<u32, (u64, u32)>,
    stored: u64,
}

impl Contiguous {
    /// A policy over `budget_bytes`, reserving `max_seq_len × bytes_per_token` per
    /// sequence. O(1).
    pub fn new(budget_bytes: u64, bytes_per_token: u64, max_seq_len: u32) -> Self {
        Self {
            alloc: FirstFit::new(budget_bytes),
            region_bytes: bytes_per_token * u64::from(max_seq_len),
            max_seq_len,
            seqs: HashMap::new(),
            stored: 0,
        }
    }

    /// The allocator, for hole statistics. O(1).
    pub fn allocator(&self) -> &FirstFit {
        &self.alloc
    }

    /// Bytes of one reservation. O(1).
    pub fn region_bytes(&self) -> u64 {
        self.region_bytes
    }
}

impl KvPolicy for Contiguous {
    fn budget_bytes(&self) -> u64 {
        self.alloc.capacity()
    }

    fn block_tokens(&self) -> u32 {
        self.max_seq_len
    }

    fn available_blocks(&self) -> u32 {
        u32::try_from(self.alloc.fit_count(self.region_bytes)).unwrap_or(u32::MAX)
    }

    fn admit(&mut self, id: u32, len: u32, _tokens: &[u32]) -> Result<u32, PolicyError> {
        if len > self.max_seq_len {
            return Err(PolicyError::Internal(format!(
                "sequence {id}: {len} tokens exceed max_seq_len {}",
                self.max_seq_len
            )));
        }
        if self.seqs.contains_key(&id) {
            return Err(PolicyError::Internal(format!(
                "sequence {id} admitted twice"
            )));
        }
        match self.alloc.alloc(self.region_bytes) {
            Ok(off) => {
                self.seqs.insert(id, (off, len));
                self.stored += u64::from(len);
                Ok(0)
            }
            Err(AllocError::NoHole { .. }) => Err(PolicyError::NoRoom),
            Err(e) => Err(PolicyError::Internal(e.to_string())),
        }
    }

    fn grow(&mut self, id: u32, n: u32, _tokens: &[u32]) -> Result<(), PolicyError> {
        let max = self.max_seq_len;
        let (_, len) = self
            .seqs
            .get_mut(&id)
            .ok_or_else(|| PolicyError::Internal(format!("grow of unknown sequence {id}")))?;
        if u64::from(*len) + u64::from(n) > u64::from(max) {
            return Err(PolicyError::Internal(format!(
                "sequence {id} outgrew max_seq_len {max}"
            )));
        }
        *len += n;
        self.stored += u64::from(n);
        Ok(())
    }

    fn release(&mut self, id: u32) -> Result<(), PolicyError> {
        let (off, len) = self
            .seqs
            .remove(&id)
            .ok_or_else(|| PolicyError::Internal(format!("release of unknown sequence {id}")))?;
        self.stored -= u64::from(len);
        self.alloc
            .free(off)
            .map(|_| ())
            .map_err(|e| PolicyError::Internal(e.to_string()))
    }

    fn swap_out(&mut self, _id: u32) -> Result<u64, PolicyError> {
        Err(PolicyError::NoRoom)
    }

    fn swap_in(&mut self, id: u32) -> Result<u64, PolicyError> {
        Err(PolicyError::Internal(format!(
            "sequence {id}: the contiguous policy has no host tier"
        )))
    }

    fn usage(&self) -> Usage {
        Usage {
            reserved_bytes: self.alloc.used_bytes(),
            stored_tokens: self.stored,
            slot_tokens: self.seqs.len() as u64 * u64::from(self.max_seq_len),
            unusable_free_bytes: self.alloc.unusable_bytes(self.region_bytes),
            largest_free_bytes: self.alloc.largest_hole(),
            host_bytes: 0,
        }
    }
}
