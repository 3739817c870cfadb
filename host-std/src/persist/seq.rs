//! Saving a sequence of a [`KvCache`] into a blob, and restoring a blob into any free
//! blocks of a cache of the same geometry, dtype and model.
//!
//! A save copies the sequence's `ceil(len / block_size)` blocks whole (one range each in
//! the block-major layout), the tail block's rows past the end zeroed, so the blob of a
//! sequence depends on its tokens and K/V only. A restore verifies the whole blob
//! (header, geometry, dtype, fingerprint, lengths, every checksum, the zero tail rows,
//! the position runs) and that the cache has room, before it changes anything; then it
//! creates the sequence, appends its tokens (with their ids when the blob has them, so
//! its blocks can be committed to the prefix cache) and copies each block into whatever
//! block the pool handed out: no contiguous region is needed.

use std::path::Path;

use crate::cache::{CacheError, KvCache, Seq};
use kvpage_core::{DType, SeqError};

use super::error::{BlobGeometry, PersistError, Section};
use super::file;
use super::format::{
    blob_geometry, dtype_code, read_sections, u32s, write_header, BlobHeader, ModelFingerprint,
    SectionWriter, Sections, Sink, SliceSink,
};
use super::positions::{self, BlobRuns};

/// The token ids of a blob, read in place (little-endian `u32`s). `Copy`; O(1) to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobTokens<'b>(&'b [u8]);

impl<'b> BlobTokens<'b> {
    /// Number of ids. O(1).
    pub fn len(&self) -> usize {
        self.0.len() / 4
    }

    /// Whether there are none (the blob of an empty sequence). O(1).
    pub fn is_empty(&self) -> bool {
        self.0.len() < 4
    }

    /// Id `i`, `None` past the end. O(1).
    pub fn get(&self, i: usize) -> Option<u32> {
        let w = self.0.get(i.checked_mul(4)?..)?.get(..4)?;
        Some(u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
    }

    /// The ids in order. O(1) to make, O(1) per id.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = u32> + 'b {
        u32s(self.0)
    }

    /// Copies the ids into `out[..len]` and returns `len`; `None` (nothing written) when
    /// `out` is shorter. O(len).
    pub fn copy_to(&self, out: &mut [u32]) -> Option<usize> {
        let out = out.get_mut(..self.len())?;
        for (o, id) in out.iter_mut().zip(self.iter()) {
            *o = id;
        }
        Some(self.len())
    }

    /// The ids in a new vector. O(len).
    pub fn to_vec(&self) -> Vec<u32> {
        self.iter().collect()
    }
}

/// A sequence blob whose header, counts, framing and checksums were verified (by
/// [`SeqBlob::parse`]), without a cache: to look into a blob before restoring it.
#[derive(Debug, Clone, Copy)]
pub struct SeqBlob<'b> {
    header: BlobHeader,
    sections: Sections<'b>,
}

impl<'b> SeqBlob<'b> {
    /// Verifies `bytes` as a sequence blob: magic, version, header CRC, flags, counts
    /// (valid geometry of a known dtype, `ceil(tokens / block_size)` blocks), exact
    /// length, each section's framing and CRC, zero tail rows. O(blob bytes).
    ///
    /// # Errors
    /// [`PersistError::BadMagic`], [`PersistError::UnsupportedVersion`],
    /// [`PersistError::UnsupportedFlags`], [`PersistError::Truncated`],
    /// [`PersistError::TrailingBytes`], [`PersistError::Corrupt`].
    pub fn parse(bytes: &'b [u8]) -> Result<Self, PersistError> {
        Self::verify(BlobHeader::decode(bytes)?, bytes)
    }

    /// [`SeqBlob::parse`] after [`BlobHeader::decode`] (so a restore can compare the
    /// header with the cache before it reads the sections).
    fn verify(header: BlobHeader, bytes: &'b [u8]) -> Result<Self, PersistError> {
        header.check_counts()?;
        let sections = read_sections(&header, bytes)?;
        let blob = Self { header, sections };
        blob.check_tail_rows()?;
        Ok(blob)
    }

    /// Checks that the tail block's rows past the sequence's end are zero in every
    /// `[token][head_dim]` tile (the blob is canonical: restoring and saving it again
    /// gives the same bytes). O(block bytes).
    fn check_tail_rows(&self) -> Result<(), PersistError> {
        let g = &self.header.geometry;
        let used = self.header.tokens % g.block_size;
        let Some(dtype) = self.header.dtype() else {
            return Err(PersistError::Corrupt {
                section: Section::Header,
            });
        };
        if used == 0 {
            return Ok(());
        }
        // Counts are checked: the K/V payload is `blocks * bytes_per_block` bytes, a
        // tile is at most a block.
        let (tile, parts) = tile_parts(dtype, g.head_dim as usize, g.block_size as usize);
        let bpb = g.bytes_per_block as usize;
        let tail = self
            .sections
            .kv
            .len()
            .checked_sub(bpb)
            .and_then(|start| self.sections.kv.get(start..));
        let bs = g.block_size as usize;
        let clean = tail.is_some_and(|block| {
            block.chunks_exact(tile).all(|t| {
                parts.iter().all(|&(start, row)| {
                    t[start + used as usize * row..start + bs * row]
                        .iter()
                        .all(|&b| b == 0)
                })
            })
        });
        if clean {
            Ok(())
        } else {
            Err(PersistError::Corrupt {
                section: Section::Kv,
            })
        }
    }

    /// The header. O(1).
    pub fn header(&self) -> &BlobHeader {
        &self.header
    }

    /// The token ids, when the blob has them. O(1).
    pub fn tokens(&self) -> Option<BlobTokens<'b>> {
        self.header
            .has_tokens()
            .then_some(BlobTokens(self.sections.tokens))
    }
}

/// What [`KvCache::restore_seq`] restored besides the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoredInfo<'b> {
    /// Tokens of the sequence.
    pub len: u32,
    /// Its token ids, read in place from the blob, when the blob has them (the
    /// sequence then knows them too).
    pub tokens: Option<BlobTokens<'b>>,
}

/// What [`KvCache::restore_seq_from_file`] restored besides the sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoredFile {
    /// Tokens of the sequence.
    pub len: u32,
    /// Its token ids, when the file has them.
    pub tokens: Option<Vec<u32>>,
}

impl KvCache {
    /// Header of the blob of `seq`, after checking the handle and the ids.
    fn save_header(
        &self,
        seq: Seq,
        tokens: Option<usize>,
        fingerprint: &ModelFingerprint,
    ) -> Result<BlobHeader, CacheError> {
        let m = self.block_manager();
        let blocks = m.blocks(seq.id())?.len() as u32;
        let len = m.len(seq.id())?;
        if let Some(got) = tokens.filter(|&n| n != len as usize) {
            return Err(PersistError::TokenCountMismatch { expected: len, got }.into());
        }
        let runs = m.position_runs(seq.id())?.len() as u32;
        Ok(BlobHeader::new(
            self.geometry(),
            *fingerprint,
            len,
            blocks,
            tokens.is_some(),
            runs,
        ))
    }

    /// Bytes of the blob of `seq` (with its token ids when `with_tokens`): the buffer
    /// [`KvCache::save_seq`] needs. About `ceil(len / block_size) * bytes_per_block`
    /// plus 4 bytes per id, 156 bytes (header, framing) and 8 per position run. O(1).
    ///
    /// # Errors
    /// [`SeqError::StaleHandle`], [`SeqError::ForeignHandle`], [`SeqError::Swapped`];
    /// [`PersistError::BufferTooSmall`] (needed `usize::MAX`) if the size does not fit a
    /// `usize`.
    pub fn saved_seq_size(&self, seq: Seq, with_tokens: bool) -> Result<usize, CacheError> {
        let len = self.block_manager().len(seq.id())? as usize;
        let header = self.save_header(seq, with_tokens.then_some(len), &Default::default())?;
        Ok(blob_size(&header)?)
    }

    /// Saves `seq` into `out[..n]` and returns `n` ([`KvCache::saved_seq_size`]): header
    /// with the cache's geometry and `fingerprint`, the token ids if given (one per
    /// token, e.g. the engine's request tokens: the core does not keep them), the
    /// position runs, and the sequence's blocks. Reads the cache only.
    /// O(len + blocks × bytes_per_block): one copy and one checksum pass over the K/V.
    ///
    /// # Errors
    /// Nothing is written on error. [`SeqError::StaleHandle`],
    /// [`SeqError::ForeignHandle`], [`SeqError::Swapped`] (swap it in first);
    /// [`PersistError::TokenCountMismatch`], [`PersistError::BufferTooSmall`].
    pub fn save_seq(
        &self,
        seq: Seq,
        tokens: Option<&[u32]>,
        fingerprint: &ModelFingerprint,
        out: &mut [u8],
    ) -> Result<usize, CacheError> {
        let header = self.save_header(seq, tokens.map(<[u32]>::len), fingerprint)?;
        let size = blob_size(&header)?;
        let got = out.len();
        let out = out
            .get_mut(..size)
            .ok_or(PersistError::BufferTooSmall { needed: size, got })?;
        let mut sink = SliceSink::new(out);
        self.encode_seq(seq, &header, tokens, &mut sink)?;
        debug_assert_eq!(sink.len(), size);
        Ok(size)
    }

    /// [`KvCache::save_seq`] into the file at `path`, crash-consistently: written to a
    /// new temporary file beside it, flushed to disk (`fsync`), renamed over `path`, and
    /// the directory flushed, so `path` holds either its old content or the whole blob.
    /// Returns the blob's bytes. Streams: the blob is never held in memory.
    /// O(blob bytes) plus the file system's costs.
    ///
    /// # Errors
    /// As [`KvCache::save_seq`] (checked before the file is created), and
    /// [`PersistError::Io`]; the temporary file is removed on error.
    pub fn save_seq_to_file(
        &self,
        seq: Seq,
        tokens: Option<&[u32]>,
        fingerprint: &ModelFingerprint,
        path: impl AsRef<Path>,
    ) -> Result<u64, CacheError> {
        let header = self.save_header(seq, tokens.map(<[u32]>::len), fingerprint)?;
        let size = header.blob_len().ok_or(PersistError::BufferTooSmall {
            needed: usize::MAX,
            got: 0,
        })?;
        file::write_atomically(path.as_ref(), |sink| {
            self.encode_seq(seq, &header, tokens, sink)
        })?;
        Ok(size)
    }

    /// Writes the blob of `seq` (its header built by `save_header`) into `sink`.
    fn encode_seq<S: Sink>(
        &self,
        seq: Seq,
        header: &BlobHeader,
        tokens: Option<&[u32]>,
        sink: &mut S,
    ) -> Result<(), PersistError> {
        write_header(sink, header)?;
        let len = |s| header.payload_len(s).unwrap_or(0);
        let mut w = SectionWriter::begin(sink, Section::Tokens, len(Section::Tokens))?;
        w.put_u32s(tokens.unwrap_or(&[]).iter().copied())?;
        w.finish()?;
        let mut w = SectionWriter::begin(sink, Section::Positions, len(Section::Positions))?;
        let runs = self.block_manager().position_runs(seq.id()).unwrap_or(&[]);
        w.put_u32s(positions::words(runs))?;
        w.finish()?;
        let mut w = SectionWriter::begin(sink, Section::Kv, len(Section::Kv))?;
        self.encode_blocks(seq, header.tokens, &mut w)?;
        w.finish()
    }

    /// Writes the K/V of the blocks of `seq` (`len` tokens) whole, the tail block's rows
    /// past `len` as zeros.
    fn encode_blocks<S: Sink>(
        &self,
        seq: Seq,
        len: u32,
        w: &mut SectionWriter<'_, S>,
    ) -> Result<(), PersistError> {
        let g = self.geometry();
        let esize = g.dtype().size_bytes() as usize;
        let bs = g.block_size() as usize;
        let (tile, parts) = tile_parts(g.dtype(), g.head_dim() as usize, bs);
        let used = (len % g.block_size()) as usize;
        let blocks = self.block_manager().blocks(seq.id()).unwrap_or(&[]);
        // A device cache reads each block back into this buffer (one block).
        let mut buf = Vec::new();
        for (i, &b) in blocks.iter().enumerate() {
            let block = self.storage.block_bytes(&self.layout, b, &mut buf)?;
            if i + 1 < blocks.len() || used == 0 {
                w.put_elems(block, esize)?;
                continue;
            }
            // Block-major: the block is its tiles in a row; each tile keeps its first
            // `used` tokens' values (and scales) and zeroes the rest.
            for t in block.chunks_exact(tile) {
                for &(start, row) in &parts {
                    // Scales are little-endian f32 already: byte by byte.
                    let size = if start == 0 { esize } else { 1 };
                    w.put_elems(&t[start..start + used * row], size)?;
                    w.put_zeros((bs - used) * row)?;
                }
            }
        }
        Ok(())
    }

    /// Checks where saved bytes come from against this cache: dtype, geometry, and the
    /// saved fingerprint against the caller's `fingerprint`.
    pub(crate) fn check_origin(
        &self,
        saved_dtype: u32,
        saved_geometry: &BlobGeometry,
        saved_fingerprint: &ModelFingerprint,
        fingerprint: &ModelFingerprint,
    ) -> Result<(), PersistError> {
        let g = self.geometry();
        // The dtype first: with another dtype the bytes per block differ too.
        if saved_dtype != dtype_code(g.dtype()) {
            return Err(PersistError::DtypeMismatch {
                blob: saved_dtype,
                cache: g.dtype(),
            });
        }
        let cache = blob_geometry(g);
        if *saved_geometry != cache {
            return Err(PersistError::GeometryMismatch {
                blob: *saved_geometry,
                cache,
            });
        }
        if saved_fingerprint != fingerprint {
            return Err(PersistError::ModelMismatch);
        }
        Ok(())
    }

    /// Restores a saved sequence into any free blocks of this cache, as a new sequence
    /// of `namespace`, and returns it with what the blob said. Everything is checked
    /// before anything changes: the blob (magic, version, geometry, dtype,
    /// `fingerprint`, lengths, every checksum, zero tail rows, positions), the sequence's
    /// length against `max_seq_len`, and room (free or evictable blocks, a sequence
    /// slot). The blocks need not be contiguous: each saved block is copied into the
    /// block the pool hands out. With token ids in the blob the sequence knows them, so
    /// a [`KvCache::commit`] can offer its full blocks to the prefix cache; its K/V
    /// counts as written (like after a commit). O(blob bytes): one checksum pass, one
    /// copy. Allocates nothing.
    ///
    /// # Errors
    /// Nothing changes on error (statistics and every arena byte stay as they were).
    /// [`PersistError`]: [`BadMagic`](PersistError::BadMagic),
    /// [`UnsupportedVersion`](PersistError::UnsupportedVersion),
    /// [`UnsupportedFlags`](PersistError::UnsupportedFlags),
    /// [`GeometryMismatch`](PersistError::GeometryMismatch),
    /// [`DtypeMismatch`](PersistError::DtypeMismatch),
    /// [`ModelMismatch`](PersistError::ModelMismatch),
    /// [`Truncated`](PersistError::Truncated),
    /// [`TrailingBytes`](PersistError::TrailingBytes),
    /// [`Corrupt`](PersistError::Corrupt),
    /// [`NoSpace`](PersistError::NoSpace); [`SeqError::TooLong`],
    /// [`SeqError::NoFreeSequence`]; [`SeqError::BadPositions`] and
    /// [`SeqError::TooManyPositionRuns`] for position runs this cache would refuse
    /// (checked as [`kvpage_core::PositionRun::validate`] does, against the cache's
    /// `max_position_runs`).
    pub fn restore_seq<'b>(
        &mut self,
        blob: &'b [u8],
        namespace: u64,
        fingerprint: &ModelFingerprint,
    ) -> Result<(Seq, RestoredInfo<'b>), CacheError> {
        let header = BlobHeader::decode(blob)?;
        self.check_origin(
            header.dtype_code,
            &header.geometry,
            &header.fingerprint,
            fingerprint,
        )?;
        let blob = SeqBlob::verify(header, blob)?;
        let m = self.block_manager();
        let runs = BlobRuns::decode(
            blob.sections.positions,
            header.tokens,
            m.config().max_position_runs,
        )?;
        let max_tokens = m.config().max_tokens_per_seq();
        if u64::from(header.tokens) > max_tokens {
            return Err(SeqError::TooLong {
                tokens: header.tokens.into(),
                max_tokens,
            }
            .into());
        }
        let available = m.available_blocks();
        if header.blocks > available {
            return Err(PersistError::NoSpace {
                needed: header.blocks,
                available,
            }
            .into());
        }
        let seq = self.create(namespace)?;
        if let Err(e) = self.append_restored(seq, &blob) {
            // Unreachable after the checks above; undo the creation all the same.
            let _ = self.release(seq);
            return Err(e);
        }
        if let Err(e) = self.set_position_runs(seq, runs.as_slice()) {
            // Unreachable: the runs were validated for this length and capacity.
            let _ = self.release(seq);
            return Err(e);
        }
        if let Err(e) = self.copy_restored_blocks(seq, &blob) {
            // A device's driver error: the sequence goes (the device cache is unusable).
            let _ = self.release(seq);
            return Err(e);
        }
        self.mark_written(seq);
        Ok((
            seq,
            RestoredInfo {
                len: header.tokens,
                tokens: blob.tokens(),
            },
        ))
    }

    /// [`KvCache::restore_seq`] from the file at `path` (read whole into memory, then
    /// restored). O(file bytes).
    ///
    /// # Errors
    /// As [`KvCache::restore_seq`], and [`PersistError::Io`].
    pub fn restore_seq_from_file(
        &mut self,
        path: impl AsRef<Path>,
        namespace: u64,
        fingerprint: &ModelFingerprint,
    ) -> Result<(Seq, RestoredFile), CacheError> {
        let bytes = std::fs::read(path).map_err(PersistError::from)?;
        let (seq, info) = self.restore_seq(&bytes, namespace, fingerprint)?;
        Ok((
            seq,
            RestoredFile {
                len: info.len,
                tokens: info.tokens.map(|t| t.to_vec()),
            },
        ))
    }

    /// Appends the blob's tokens to the new, empty `seq`: with their ids (decoded a
    /// chunk at a time) when the blob has them.
    fn append_restored(&mut self, seq: Seq, blob: &SeqBlob<'_>) -> Result<(), CacheError> {
        match blob.tokens() {
            Some(tokens) => {
                let mut ids = [0u32; 256];
                for chunk in tokens.0.chunks(ids.len() * 4) {
                    let n = chunk.len() / 4;
                    for (d, id) in ids.iter_mut().zip(u32s(chunk)) {
                        *d = id;
                    }
                    self.append_tokens(seq, &ids[..n])?;
                }
                Ok(())
            }
            None if blob.header.tokens > 0 => self.append(seq, blob.header.tokens),
            None => Ok(()),
        }
    }

    /// Copies the blob's blocks into the blocks of `seq` (appended: as many, exclusive).
    ///
    /// # Errors
    /// [`CacheError::Device`] for a driver error (never on the CPU).
    fn copy_restored_blocks(&mut self, seq: Seq, blob: &SeqBlob<'_>) -> Result<(), CacheError> {
        let g = *self.geometry();
        let esize = g.dtype().size_bytes() as usize;
        let bpb = g.bytes_per_block() as usize;
        let blocks = self.tables.manager().blocks(seq.id()).unwrap_or(&[]);
        for (&b, src) in blocks.iter().zip(blob.sections.kv.chunks_exact(bpb)) {
            self.storage.write_block_le(&self.layout, b, src, esize)?;
        }
        Ok(())
    }
}

/// Bytes of the blob `header` describes, as a `usize`.
fn blob_size(header: &BlobHeader) -> Result<usize, PersistError> {
    header
        .blob_len()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or(PersistError::BufferTooSmall {
            needed: usize::MAX,
            got: 0,
        })
}

/// The bytes of one tile of a block, and its parts as `(start, bytes per token)`: the
/// values, then for 8-bit storage the per-token f32 scales. O(1).
fn tile_parts(dtype: DType, head_dim: usize, block_size: usize) -> (usize, Vec<(usize, usize)>) {
    let row = head_dim * dtype.size_bytes() as usize;
    let mut parts = vec![(0, row)];
    if dtype.is_scaled() {
        parts.push((block_size * row, dtype.scale_elems() as usize));
    }
    let tile = parts.iter().map(|&(_, r)| r * block_size).sum();
    (tile, parts)
}
