//! The persistent prefix cache: every reachable block of a [`KvCache`]'s prefix cache
//! (its chain, namespace, priority, token ids and K/V) saved into a buffer or a file,
//! and loaded into a later run's cache, so shipped or earlier system prompts hit on the
//! first request.
//!
//! # Format, version 1
//! ```text
//! header (96 bytes)
//!    0  magic             8 bytes   "KVPAGEPC"
//!    8  version           u16       1
//!   10  header length     u16       96
//!   12  flags             u32       0
//!   16  layers            u32
//!   20  kv heads          u32
//!   24  head dim          u32
//!   28  block size        u32
//!   32  dtype             u32       0 f32, 1 f16, 2 bf16
//!   36  records           u32
//!   40  bytes per block   u64
//!   48  fingerprint       32 bytes  the caller's model fingerprint
//!   80  record length     u64       40 + 4 * block size + bytes per block
//!   88  reserved          u32       0
//!   92  header crc        u32       CRC-32 of bytes 0..92
//! records, one per block, parents before children, each `record length` bytes:
//!    0  parent            u32       index of an earlier record; u32::MAX: first block
//!    4  priority          u32       0 low, 1 normal, 2 high, 3 pinned
//!    8  namespace         u64
//!   16  hash              u64       the saving cache's chain hash (informational)
//!   24  reserved          12 bytes  0
//!   36  token ids         block size × u32
//!   ..  K/V               bytes per block, the block-major layout, little-endian
//!   ..  crc               u32       CRC-32 of the record's bytes before it
//! ```
//!
//! Each record has its own CRC, so one damaged block costs that block and the chain
//! below it, not the file. A load checks the header (magic, version, CRC, geometry,
//! dtype, fingerprint) before it changes anything, and refuses the file as a whole if
//! the header is wrong; after that it skips and counts whatever is damaged, cut off or
//! orphaned ([`PrefixLoadReport`]). A loaded block's hash is computed by the core from
//! its parent and token ids (the file's hash is not trusted), and every later hit
//! verifies the namespace, the parent and each token id, so no damaged or forged file
//! can make the cache serve K/V under tokens it was not computed for. A file is written
//! crash-consistently (aside, fsync, rename, fsync the directory).

use std::path::Path;

use crc32fast::Hasher;
use kvpage_core::{ImportError, Priority};

use super::error::{BlobGeometry, PersistError, Section};
use super::file;
use super::format::{
    blob_geometry, copy_elems_from_le, dtype_code, ModelFingerprint, Sink, SliceSink,
};
use crate::cache::{CacheError, KvCache};

/// First bytes of every prefix-cache file.
pub const PREFIX_MAGIC: [u8; 8] = *b"KVPAGEPC";
/// The prefix-cache format version this build writes and reads.
pub const PREFIX_FORMAT_VERSION: u16 = 1;
/// Bytes of the header, its CRC included.
pub const PREFIX_HEADER_LEN: usize = 96;
/// Bytes of a record before its token ids.
const RECORD_HEAD: usize = 36;
/// The parent index of a chain's first block.
const NO_PARENT: u32 = u32::MAX;

/// What [`KvCache::save_prefix_cache`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavedPrefixCache {
    /// Blocks (records) saved.
    pub blocks: u32,
    /// Bytes written.
    pub bytes: u64,
}

/// What [`KvCache::load_prefix_cache`] did with each record of a file whose header was
/// sound. `loaded + already_cached + damaged + missing + orphaned + no_room == records`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixLoadReport {
    /// Records the header announces.
    pub records: u32,
    /// Blocks registered and written.
    pub loaded: u32,
    /// Records whose block the cache held already (nothing written).
    pub already_cached: u32,
    /// Records skipped for a wrong checksum or impossible fields.
    pub damaged: u32,
    /// Records cut off: the file ends before them.
    pub missing: u32,
    /// Records skipped because a block above them in the chain was damaged or missing.
    pub orphaned: u32,
    /// Records not loaded because no free block was left for their namespace (imports
    /// never evict), or below such a record.
    pub no_room: u32,
    /// Bytes after the last announced record (ignored).
    pub trailing_bytes: u64,
}

/// The decoded header of a prefix-cache file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PrefixHeader {
    geometry: BlobGeometry,
    dtype_code: u32,
    records: u32,
    fingerprint: ModelFingerprint,
    record_len: u64,
}

/// Bytes of one record of a cache with blocks of `block_size` tokens and
/// `bytes_per_block` bytes; `None` on overflow.
fn record_len(block_size: u32, bytes_per_block: u64) -> Option<u64> {
    (RECORD_HEAD as u64 + 4)
        .checked_add(u64::from(block_size).checked_mul(4)?)?
        .checked_add(bytes_per_block)
}

fn u32_le(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn u64_le(b: &[u8], off: usize) -> u64 {
    u64::from(u32_le(b, off)) | (u64::from(u32_le(b, off + 4)) << 32)
}

fn crc32(parts: &[&[u8]]) -> u32 {
    let mut h = Hasher::new();
    for p in parts {
        h.update(p);
    }
    h.finalize()
}

impl PrefixHeader {
    /// Bytes of the file this header announces (saturating).
    fn file_len(&self) -> u64 {
        (PREFIX_HEADER_LEN as u64)
            .saturating_add(u64::from(self.records).saturating_mul(self.record_len))
    }

    fn encode(&self) -> [u8; PREFIX_HEADER_LEN] {
        let mut h = [0u8; PREFIX_HEADER_LEN];
        let g = &self.geometry;
        h[0..8].copy_from_slice(&PREFIX_MAGIC);
        h[8..10].copy_from_slice(&PREFIX_FORMAT_VERSION.to_le_bytes());
        h[10..12].copy_from_slice(&(PREFIX_HEADER_LEN as u16).to_le_bytes());
        let words = [
            (16, g.layers),
            (20, g.kv_heads),
            (24, g.head_dim),
            (28, g.block_size),
            (32, self.dtype_code),
            (36, self.records),
        ];
        for (off, w) in words {
            h[off..off + 4].copy_from_slice(&w.to_le_bytes());
        }
        h[40..48].copy_from_slice(&g.bytes_per_block.to_le_bytes());
        h[48..80].copy_from_slice(&self.fingerprint.0);
        h[80..88].copy_from_slice(&self.record_len.to_le_bytes());
        let crc = crc32(&[&h[..PREFIX_HEADER_LEN - 4]]);
        h[PREFIX_HEADER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Decodes and checks the header: magic, version, length, CRC, flags, reserved
    /// field, and that the record length follows from the geometry. O(1).
    fn decode(bytes: &[u8]) -> Result<Self, PersistError> {
        let present = bytes.len().min(PREFIX_MAGIC.len());
        if bytes[..present] != PREFIX_MAGIC[..present] {
            return Err(PersistError::BadMagic);
        }
        if let Some(v) = bytes.get(8..10) {
            let found = u16::from_le_bytes([v[0], v[1]]);
            if found != PREFIX_FORMAT_VERSION {
                return Err(PersistError::UnsupportedVersion { found });
            }
        }
        let h = bytes
            .get(..PREFIX_HEADER_LEN)
            .ok_or(PersistError::Truncated {
                needed: PREFIX_HEADER_LEN as u64,
                got: bytes.len() as u64,
            })?;
        let corrupt = PersistError::Corrupt {
            section: Section::Header,
        };
        if u16::from_le_bytes([h[10], h[11]]) as usize != PREFIX_HEADER_LEN
            || crc32(&[&h[..PREFIX_HEADER_LEN - 4]]) != u32_le(h, PREFIX_HEADER_LEN - 4)
        {
            return Err(corrupt);
        }
        let flags = u32_le(h, 12);
        if flags != 0 {
            return Err(PersistError::UnsupportedFlags { flags });
        }
        let mut fingerprint = [0u8; 32];
        fingerprint.copy_from_slice(&h[48..80]);
        let header = Self {
            geometry: BlobGeometry {
                layers: u32_le(h, 16),
                kv_heads: u32_le(h, 20),
                head_dim: u32_le(h, 24),
                block_size: u32_le(h, 28),
                bytes_per_block: u64_le(h, 40),
            },
            dtype_code: u32_le(h, 32),
            records: u32_le(h, 36),
            fingerprint: ModelFingerprint(fingerprint),
            record_len: u64_le(h, 80),
        };
        let expected = record_len(header.geometry.block_size, header.geometry.bytes_per_block);
        if u32_le(h, 88) != 0 || expected != Some(header.record_len) {
            return Err(corrupt);
        }
        Ok(header)
    }
}

/// Why a record was not loaded, remembered so its descendants are counted alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Skipped {
    Damaged,
    NoRoom,
}

impl KvCache {
    /// The reachable registered blocks, parents before children, each with the index
    /// of its parent in the list ([`NO_PARENT`] for a chain's first block).
    /// O(num_blocks × chain depth) at worst, O(num_blocks) for shallow chains.
    pub(crate) fn prefix_blocks_in_order(&self) -> Vec<(u32, u32)> {
        let m = self.block_manager();
        let n = m.config().num_blocks;
        let parent_of: Vec<Option<Option<u32>>> = (0..n)
            .map(|b| m.registered_block(b).map(|r| r.parent))
            .collect();
        // Depth of each reachable block (a registered block's parent is registered).
        let mut depth: Vec<u32> = vec![u32::MAX; n as usize];
        let mut chain = Vec::new();
        for b in 0..n {
            // Walk up to a block of known depth or a chain's start; a block that is not
            // registered (or whose parent left the cache) ends the walk unreachable.
            chain.clear();
            let mut at = Some(b);
            let reachable = loop {
                let Some(x) = at else { break true };
                if depth[x as usize] != u32::MAX {
                    break true;
                }
                let Some(parent) = parent_of[x as usize] else {
                    break false;
                };
                // A chain is at most every block long (parent links carry registration
                // generations, so a cycle cannot be alive; this bounds the walk anyway).
                if chain.len() >= n as usize {
                    break false;
                }
                chain.push(x);
                at = parent;
            };
            if !reachable {
                continue;
            }
            let first = at.map_or(0, |x| depth[x as usize] + 1);
            for (d, &x) in (first..).zip(chain.iter().rev()) {
                depth[x as usize] = d;
            }
        }
        let mut order: Vec<u32> = (0..n).filter(|&b| depth[b as usize] != u32::MAX).collect();
        order.sort_by_key(|&b| (depth[b as usize], b));
        let mut index = vec![NO_PARENT; n as usize];
        for (i, &b) in order.iter().enumerate() {
            index[b as usize] = i as u32;
        }
        order
            .iter()
            .map(|&b| {
                let parent = parent_of[b as usize].flatten();
                (b, parent.map_or(NO_PARENT, |p| index[p as usize]))
            })
            .collect()
    }

    fn prefix_header(&self, records: u32, fingerprint: &ModelFingerprint) -> PrefixHeader {
        let g = self.geometry();
        PrefixHeader {
            geometry: blob_geometry(g),
            dtype_code: dtype_code(g.dtype()),
            records,
            fingerprint: *fingerprint,
            record_len: record_len(g.block_size(), g.bytes_per_block()).unwrap_or(u64::MAX),
        }
    }

    /// Bytes [`KvCache::save_prefix_cache`] needs now: 96 plus, per reachable
    /// registered block, 40 + 4 × block size + bytes per block.
    /// O(num_blocks × chain depth).
    pub fn saved_prefix_cache_size(&self) -> u64 {
        let records = self.prefix_blocks_in_order().len() as u32;
        self.prefix_header(records, &ModelFingerprint::default())
            .file_len()
    }

    /// Saves every reachable block of the prefix cache (cached, pinned, or held by live
    /// sequences: its K/V is complete once registered) into `out`, parents first, under
    /// `fingerprint`. Reads the cache only. O(num_blocks × chain depth + bytes).
    ///
    /// # Errors
    /// [`PersistError::BufferTooSmall`] (nothing written).
    pub fn save_prefix_cache(
        &self,
        fingerprint: &ModelFingerprint,
        out: &mut [u8],
    ) -> Result<SavedPrefixCache, CacheError> {
        let order = self.prefix_blocks_in_order();
        let header = self.prefix_header(order.len() as u32, fingerprint);
        let size = header.file_len();
        let got = out.len();
        let out = usize::try_from(size)
            .ok()
            .and_then(|n| out.get_mut(..n))
            .ok_or(PersistError::BufferTooSmall {
                needed: usize::try_from(size).unwrap_or(usize::MAX),
                got,
            })?;
        let mut sink = SliceSink::new(out);
        self.encode_prefix_cache(&header, &order, &mut sink)?;
        Ok(SavedPrefixCache {
            blocks: header.records,
            bytes: size,
        })
    }

    /// [`KvCache::save_prefix_cache`] into the file at `path`, crash-consistently
    /// (written aside, flushed, renamed over `path`, the directory flushed): after a
    /// crash `path` holds its old content or the whole new one. Streams; the cache is
    /// never copied whole into memory. O(num_blocks × chain depth + bytes).
    ///
    /// # Errors
    /// [`PersistError::Io`]; the temporary file is removed and `path` is as it was.
    pub fn save_prefix_cache_to_file(
        &self,
        fingerprint: &ModelFingerprint,
        path: impl AsRef<Path>,
    ) -> Result<SavedPrefixCache, CacheError> {
        let order = self.prefix_blocks_in_order();
        let header = self.prefix_header(order.len() as u32, fingerprint);
        file::write_atomically(path.as_ref(), |sink| {
            self.encode_prefix_cache(&header, &order, sink)
        })?;
        Ok(SavedPrefixCache {
            blocks: header.records,
            bytes: header.file_len(),
        })
    }

    fn encode_prefix_cache<S: Sink>(
        &self,
        header: &PrefixHeader,
        order: &[(u32, u32)],
        sink: &mut S,
    ) -> Result<(), PersistError> {
        sink.put(&header.encode())?;
        let m = self.block_manager();
        let g = self.geometry();
        let esize = g.dtype().size_bytes() as usize;
        // A device cache reads each block back into this buffer (one block).
        let mut buf = Vec::new();
        let mut ids = vec![0u8; 4 * g.block_size() as usize];
        for &(b, parent) in order {
            let r = m.registered_block(b).ok_or(PersistError::Corrupt {
                section: Section::Kv,
            })?;
            let mut head = [0u8; RECORD_HEAD];
            head[0..4].copy_from_slice(&parent.to_le_bytes());
            head[4..8].copy_from_slice(&u32::from(r.priority.level()).to_le_bytes());
            head[8..16].copy_from_slice(&r.namespace.to_le_bytes());
            head[16..24].copy_from_slice(&r.hash.to_le_bytes());
            for (d, t) in ids.chunks_exact_mut(4).zip(r.tokens) {
                d.copy_from_slice(&t.to_le_bytes());
            }
            let kv = self.storage.block_bytes(&self.layout, b, &mut buf)?;
            let mut crc = Hasher::new();
            crc.update(&head);
            crc.update(&ids);
            sink.put(&head)?;
            sink.put(&ids)?;
            put_le_elems(sink, &mut crc, kv, esize)?;
            sink.put(&crc.finalize().to_le_bytes())?;
        }
        Ok(())
    }

    /// Loads a saved prefix cache into this cache's free blocks, parents first: each
    /// sound record whose chain is intact becomes a cached block (least recently used,
    /// so live traffic evicts loaded blocks first) with its priority, unless an
    /// identical block is cached already. Damaged, cut-off and orphaned records are
    /// skipped and counted; loading stops taking blocks for a namespace when none is
    /// free for it (a load never evicts). Returns what happened to each record.
    /// O(bytes): one checksum pass, one copy of the loaded K/V.
    ///
    /// # Errors
    /// The file as a whole is refused, and nothing changes, for a wrong header:
    /// [`PersistError::BadMagic`], [`PersistError::UnsupportedVersion`],
    /// [`PersistError::UnsupportedFlags`], [`PersistError::Truncated`] (shorter than
    /// the header), [`PersistError::Corrupt`] (header), and for another origin:
    /// [`PersistError::DtypeMismatch`], [`PersistError::GeometryMismatch`],
    /// [`PersistError::ModelMismatch`].
    pub fn load_prefix_cache(
        &mut self,
        bytes: &[u8],
        fingerprint: &ModelFingerprint,
    ) -> Result<PrefixLoadReport, CacheError> {
        let header = PrefixHeader::decode(bytes)?;
        self.check_origin(
            header.dtype_code,
            &header.geometry,
            &header.fingerprint,
            fingerprint,
        )?;
        let body = &bytes[PREFIX_HEADER_LEN..];
        // The record length follows from a geometry equal to the cache's: it fits.
        let rec = header.record_len as usize;
        let present = (body.len() / rec).min(header.records as usize);
        let missing = header.records - present as u32;
        let mut report = PrefixLoadReport {
            records: header.records,
            missing,
            // A file cut short has a partial record at its end, no trailing bytes.
            trailing_bytes: match missing {
                0 => (body.len() - present * rec) as u64,
                _ => 0,
            },
            ..PrefixLoadReport::default()
        };
        let g = *self.geometry();
        let bs = g.block_size() as usize;
        let esize = g.dtype().size_bytes() as usize;
        let mut placed: Vec<Result<u32, Skipped>> = Vec::with_capacity(present);
        let mut tokens = vec![0u32; bs];
        for (i, r) in body.chunks_exact(rec).take(present).enumerate() {
            // Whether a skip is the record's own (else inherited from its chain).
            let (outcome, own) = match Record::parse(r, bs, i) {
                None => (Err(Skipped::Damaged), true),
                Some(record) => match record.parent.map(|p| placed[p]) {
                    Some(Err(why)) => (Err(why), false),
                    parent => {
                        for (t, w) in tokens.iter_mut().zip(record.tokens.chunks_exact(4)) {
                            *t = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                        }
                        let parent = parent.and_then(Result::ok);
                        (
                            self.import_record(&record, parent, &tokens, esize, &mut report),
                            true,
                        )
                    }
                },
            };
            match (outcome, own) {
                (Ok(_), _) => {}
                (Err(Skipped::Damaged), true) => report.damaged += 1,
                (Err(Skipped::Damaged), false) => report.orphaned += 1,
                (Err(Skipped::NoRoom), _) => report.no_room += 1,
            }
            placed.push(outcome);
        }
        Ok(report)
    }

    /// [`KvCache::load_prefix_cache`] from the file at `path` (read whole, then
    /// loaded). O(file bytes).
    ///
    /// # Errors
    /// As [`KvCache::load_prefix_cache`], and [`PersistError::Io`] (a missing file
    /// included: `kind` is `NotFound`).
    pub fn load_prefix_cache_from_file(
        &mut self,
        path: impl AsRef<Path>,
        fingerprint: &ModelFingerprint,
    ) -> Result<PrefixLoadReport, CacheError> {
        let bytes = std::fs::read(path).map_err(PersistError::from)?;
        self.load_prefix_cache(&bytes, fingerprint)
    }

    /// Registers one sound record after `parent` (a block) and writes its K/V.
    fn import_record(
        &mut self,
        record: &Record<'_>,
        parent: Option<u32>,
        tokens: &[u32],
        esize: usize,
        report: &mut PrefixLoadReport,
    ) -> Result<u32, Skipped> {
        let imported = self.tables.parts_mut().manager.import_block(
            record.namespace,
            parent,
            tokens,
            record.priority,
        );
        match imported {
            Ok(i) if i.fresh => {
                let written = self
                    .storage
                    .write_block_le(&self.layout, i.block, record.kv, esize);
                if written.is_err() {
                    // A device's driver error (never on the CPU): the device cache is
                    // unusable; the record counts as not loaded.
                    return Err(Skipped::Damaged);
                }
                report.loaded += 1;
                Ok(i.block)
            }
            Ok(i) => {
                report.already_cached += 1;
                Ok(i.block)
            }
            Err(ImportError::OutOfBlocks | ImportError::QuotaExceeded) => Err(Skipped::NoRoom),
            // The prefix cache of a `KvCache` is always on, the ids are a block's worth
            // and the parent was just imported: not reachable, counted as damage.
            Err(_) => Err(Skipped::Damaged),
        }
    }
}

/// One record whose checksum and fields were verified.
struct Record<'b> {
    parent: Option<usize>,
    priority: Priority,
    namespace: u64,
    tokens: &'b [u8],
    kv: &'b [u8],
}

impl<'b> Record<'b> {
    /// Verifies record `i` (CRC, reserved bytes, priority, a parent before it).
    fn parse(r: &'b [u8], bs: usize, i: usize) -> Option<Self> {
        let (body, crc) = r.split_at(r.len() - 4);
        if crc32(&[body]) != u32_le(crc, 0) || body[24..RECORD_HEAD].iter().any(|&b| b != 0) {
            return None;
        }
        let parent = match u32_le(body, 0) {
            NO_PARENT => None,
            p if (p as usize) < i => Some(p as usize),
            _ => return None,
        };
        let priority = u8::try_from(u32_le(body, 4))
            .ok()
            .and_then(Priority::from_level)?;
        let (tokens, kv) = body[RECORD_HEAD..].split_at(4 * bs);
        Some(Self {
            parent,
            priority,
            namespace: u64_le(body, 8),
            tokens,
            kv,
        })
    }
}

/// Puts native-order elements of `elem` bytes as little-endian, into the sink and the
/// checksum.
fn put_le_elems<S: Sink>(
    sink: &mut S,
    crc: &mut Hasher,
    bytes: &[u8],
    elem: usize,
) -> Result<(), PersistError> {
    let mut buf = [0u8; 4096];
    for piece in bytes.chunks(buf.len()) {
        let out = &mut buf[..piece.len()];
        copy_elems_from_le(out, piece, elem);
        crc.update(out);
        sink.put(out)?;
    }
    Ok(())
}
