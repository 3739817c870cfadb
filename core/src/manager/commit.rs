//! Commits: offering a sequence's full, written blocks to the prefix cache, and rewinding
//! the committed prefix when a sequence shrinks or leaves the device.

use super::{BlockManager, SeqId};
use crate::error::SeqError;
use crate::prefix::Chain;

impl BlockManager<'_> {
    /// Declares that the K/V of the first `computed_tokens` tokens of `seq` is written:
    /// their full blocks whose token ids are known become shareable through the prefix
    /// cache of the sequence's namespace (a block identical to one registered already is
    /// linked to it instead). Until then no other sequence can hit them, so nobody reads
    /// K/V that is not there yet. Returns the blocks committed by this call.
    /// O(block_size) per newly committed block; committing the same tokens again is O(1).
    /// With [`crate::Config::prefix_cache`] off it only checks its arguments and returns
    /// 0. O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`],
    /// [`SeqError::BeyondLength`] when `computed_tokens` exceeds the length.
    pub fn commit(&mut self, seq: SeqId, computed_tokens: u32) -> Result<u32, SeqError> {
        let i = self.seqs.check(seq)?;
        let len = self.seqs.len[i];
        if computed_tokens > len {
            return Err(SeqError::BeyondLength {
                requested: computed_tokens,
                len,
            });
        }
        if !self.prefix.enabled() {
            return Ok(0);
        }
        let (target, _) = self.split(computed_tokens.min(self.seqs.known[i]));
        let row = self.seqs.row(i);
        let start = self.seqs.committed[i];
        let mut k = start;
        while k < target && self.commit_block(i, self.seqs.table[row + k as usize]) {
            k += 1;
        }
        self.seqs.committed[i] = k;
        Ok(k.saturating_sub(start))
    }

    /// Hashes full block `b`, the next uncommitted one of sequence `i`, and registers it
    /// unless an identical one is registered already. Returns whether the sequence's chain
    /// is still intact (it breaks when the previous block's representative was evicted).
    fn commit_block(&mut self, i: usize, b: u32) -> bool {
        let namespace = self.seqs.namespace[i];
        let parent = self.seqs.chain(i);
        let tokens = self.prefix.tokens(b);
        let hash = self.prefix.hasher.chain(parent.hash, namespace, tokens);
        let last = if self.prefix.is_registered(b) {
            // Committed already by a sequence sharing it (a fork): it represents itself.
            self.prefix.link_of(b)
        } else {
            match self.prefix.find(hash, namespace, parent.last, tokens) {
                Some(existing) => self.prefix.link_of(existing),
                None if self.prefix.link_alive(parent.last) => {
                    self.prefix.register(b, hash, namespace, parent.last)
                }
                // The previous block's representative left the cache: the chain is broken.
                None => return false,
            }
        };
        self.prefix.set_hashed(b, hash, last);
        self.seqs.set_chain(i, Chain { hash, last });
        let priority = self.seqs.priority(i);
        self.raise_priority(b, priority);
        if last.block != b {
            self.raise_priority(last.block, priority);
        }
        true
    }

    /// Sets the committed prefix of sequence `i` back to its first `blocks` blocks.
    pub(super) fn rewind_commit(&mut self, i: usize, blocks: usize) {
        let row = self.seqs.row(i);
        let chain = match blocks {
            0 => None,
            k => self.prefix.hashed(self.seqs.table[row + k - 1]),
        };
        // Committed blocks keep their hash; without it, start over from the first block
        // (committing again finds the registered blocks, so nothing is lost).
        let (blocks, chain) = match chain {
            Some(chain) => (blocks, chain),
            None => (0, self.prefix.root(self.seqs.namespace[i])),
        };
        self.seqs.committed[i] = blocks as u32;
        self.seqs.set_chain(i, chain);
    }
}
