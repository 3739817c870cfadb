//! Saving the sequence of an [`Engine`]'s request with the engine's record of its token
//! ids (the cache itself keeps no ids), for [`KvCache::restore_seq`] later.
//!
//! [`KvCache::restore_seq`]: crate::KvCache::restore_seq

use kvpage_core::{EngineError, RequestId};

use crate::cache::{CacheError, Seq};
use crate::engine::Engine;

use super::format::ModelFingerprint;

impl Engine {
    /// The sequence of running request `id` and its token ids whose K/V it holds (the
    /// last sampled token is not in the sequence until the next step).
    fn request_seq(&self, id: RequestId) -> Result<(Seq, &[u32]), CacheError> {
        if self.pending_step().is_some() {
            return Err(EngineError::StepInProgress.into());
        }
        let seq = Seq::from_id(self.engine().seq(id)?);
        let len = self.cache().len(seq)? as usize;
        let tokens = self.tokens(id)?;
        Ok((seq, tokens.get(..len).unwrap_or(tokens)))
    }

    /// Bytes of the blob [`Engine::save_request`] writes for request `id`. O(1).
    ///
    /// # Errors
    /// As [`Engine::save_request`], without the buffer's.
    pub fn saved_request_size(&self, id: RequestId) -> Result<usize, CacheError> {
        let (seq, _) = self.request_seq(id)?;
        self.cache().saved_seq_size(seq, true)
    }

    /// Saves the sequence of running request `id` with its token ids (prompt and
    /// sampled tokens, those whose K/V the sequence holds) into `out[..n]` and returns
    /// `n`; see [`crate::KvCache::save_seq`]. Call it between steps.
    /// O(len + blocks × bytes_per_block).
    ///
    /// # Errors
    /// Nothing is written on error. [`EngineError::StepInProgress`] between
    /// [`Engine::step`] and [`Engine::commit_step`] (the step's K/V is not written yet);
    /// [`EngineError::StaleRequest`]; [`EngineError::WrongState`] unless it is running
    /// (a swapped or waiting request has no sequence in the device pool); and
    /// [`crate::PersistError::BufferTooSmall`].
    pub fn save_request(
        &self,
        id: RequestId,
        fingerprint: &ModelFingerprint,
        out: &mut [u8],
    ) -> Result<usize, CacheError> {
        let (seq, tokens) = self.request_seq(id)?;
        self.cache().save_seq(seq, Some(tokens), fingerprint, out)
    }
}
