//! The byte format of a saved sequence, version 1: a fixed header and three framed
//! sections, each with a CRC-32. Every field is encoded little-endian at a fixed offset
//! with `to_le_bytes` / `from_le_bytes`; nothing is transmuted, so the format is the
//! same on every target.
//!
//! ```text
//! header (96 bytes)
//!    0  magic             8 bytes   "KVPAGESQ"
//!    8  version           u16       1
//!   10  header length     u16       96
//!   12  flags             u32       bit 0: the token-id section holds one id per token
//!   16  layers            u32
//!   20  kv heads          u32
//!   24  head dim          u32
//!   28  block size        u32       tokens per block
//!   32  dtype             u32       0 f32, 1 f16, 2 bf16
//!   36  tokens            u32       length of the sequence
//!   40  bytes per block   u64
//!   48  fingerprint       32 bytes  the caller's model fingerprint
//!   80  token ids         u32       `tokens` with flag bit 0, else 0
//!   84  position runs     u32       >= 1
//!   88  blocks            u32       ceil(tokens / block size)
//!   92  header crc        u32       CRC-32 of bytes 0..92
//! three sections, in this order: token ids (u32 each), position runs (first index u32,
//! first position u32 each), K/V (the sequence's blocks in logical order, whole, each
//! `bytes per block` in the block-major layout [layer][k|v][kv head][token][head dim],
//! elements little-endian, the tail block's rows past the sequence's end zero). Each:
//!    0  kind              u32       1 token ids, 2 position runs, 3 K/V
//!    4  reserved          u32       0
//!    8  payload length    u64       bytes: what the header's counts give
//!   16  payload
//!   16 + length  crc      u32       CRC-32 of the 16 framing bytes and the payload
//! and nothing after the last section.
//! ```
//!
//! The CRC of a section follows its payload, so a writer streams a section in one pass
//! (a file is written without holding the blob in memory). CRC-32 is the IEEE polynomial
//! of zlib and PNG, computed by `crc32fast` (carry-less multiply where the CPU has it).
//!
//! A reader checks, before it trusts a number: the magic, the version and header
//! length, the header's CRC, the flags; then (against a cache) the geometry, dtype and
//! fingerprint; then that the counts agree with each other, the blob's exact length
//! (checked arithmetic), and each section's framing and CRC. Only then is anything
//! restored.

use crc32fast::Hasher;
use kvpage_core::{DType, Geometry};

use super::error::{BlobGeometry, PersistError, Section};

/// First bytes of every sequence blob.
pub const MAGIC: [u8; 8] = *b"KVPAGESQ";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u16 = 1;
/// Bytes of the version-1 header, its CRC included.
pub const HEADER_LEN: usize = 96;
/// Bytes framing a section: kind, reserved, payload length.
const FRAME_LEN: usize = 16;
/// Bytes of a section's CRC trailer.
const CRC_LEN: usize = 4;
/// Flag bit 0: the token-id section holds one id per token.
const FLAG_TOKENS: u32 = 1;
/// Flags this build knows.
const KNOWN_FLAGS: u32 = FLAG_TOKENS;
/// Bytes of one token id in the token section.
const TOKEN_ID_BYTES: u64 = 4;
/// Bytes of one position run (first index, first position).
const RUN_BYTES: u64 = 8;
/// Bytes a section writer hands on at once: a checksum and a copy of this much stay in
/// the core's cache.
const CHUNK: usize = 64 * 1024;

/// A caller's name for the model whose K/V a blob holds: 32 bytes, e.g. a SHA-256 of the
/// weights file, or a 64-bit id ([`ModelFingerprint::from_u64`]). Restore refuses a blob
/// saved under another fingerprint ([`PersistError::ModelMismatch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ModelFingerprint(pub [u8; 32]);

impl ModelFingerprint {
    /// A 64-bit fingerprint: its little-endian bytes, then 24 zero bytes. O(1).
    pub const fn from_u64(id: u64) -> Self {
        let le = id.to_le_bytes();
        let mut bytes = [0u8; 32];
        let mut i = 0;
        while i < 8 {
            bytes[i] = le[i];
            i += 1;
        }
        Self(bytes)
    }
}

impl From<u64> for ModelFingerprint {
    fn from(id: u64) -> Self {
        Self::from_u64(id)
    }
}

impl From<[u8; 32]> for ModelFingerprint {
    fn from(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }
}

/// The dtype's code in the header.
pub(crate) const fn dtype_code(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Bf16 => 2,
        DType::Int8 => 3,
        DType::Fp8E4m3 => 4,
    }
}

/// The dtype of a header code; `None` for a code this build does not know.
const fn dtype_of(code: u32) -> Option<DType> {
    match code {
        0 => Some(DType::F32),
        1 => Some(DType::F16),
        2 => Some(DType::Bf16),
        3 => Some(DType::Int8),
        4 => Some(DType::Fp8E4m3),
        _ => None,
    }
}

/// The shape of a geometry as a blob records it.
pub(crate) const fn blob_geometry(g: &Geometry) -> BlobGeometry {
    BlobGeometry {
        layers: g.layers(),
        kv_heads: g.kv_heads(),
        head_dim: g.head_dim(),
        block_size: g.block_size(),
        bytes_per_block: g.bytes_per_block(),
    }
}

/// The header of a sequence blob, decoded. [`BlobHeader::decode`] checked its integrity
/// (magic, version, CRC, flags); [`super::SeqBlob::parse`] also checked its counts and
/// the sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobHeader {
    /// Flag bits (bit 0: the blob holds the token ids).
    pub flags: u32,
    /// The saving cache's shape.
    pub geometry: BlobGeometry,
    /// The dtype code (0 f32, 1 f16, 2 bf16).
    pub dtype_code: u32,
    /// Tokens of the sequence.
    pub tokens: u32,
    /// The model fingerprint given at save.
    pub fingerprint: ModelFingerprint,
    /// Token ids in the blob: `tokens` or 0.
    pub token_ids: u32,
    /// Position runs in the blob.
    pub position_runs: u32,
    /// K/V blocks in the blob.
    pub blocks: u32,
}

/// `u16` at `off` of the header.
fn u16_at(h: &[u8; HEADER_LEN], off: usize) -> u16 {
    u16::from_le_bytes([h[off], h[off + 1]])
}

/// `u32` at `off` of the header.
fn u32_at(h: &[u8; HEADER_LEN], off: usize) -> u32 {
    u32::from_le_bytes([h[off], h[off + 1], h[off + 2], h[off + 3]])
}

/// `u64` at `off` of the header.
fn u64_at(h: &[u8; HEADER_LEN], off: usize) -> u64 {
    u64::from(u32_at(h, off)) | (u64::from(u32_at(h, off + 4)) << 32)
}

/// CRC-32 of `bytes`.
fn crc32(bytes: &[u8]) -> u32 {
    let mut h = Hasher::new();
    h.update(bytes);
    h.finalize()
}

impl BlobHeader {
    /// The header of a sequence of `tokens` tokens in `blocks` blocks of `geometry`,
    /// with or without its ids and with `position_runs` runs. O(1).
    pub(crate) fn new(
        geometry: &Geometry,
        fingerprint: ModelFingerprint,
        tokens: u32,
        blocks: u32,
        with_ids: bool,
        position_runs: u32,
    ) -> Self {
        Self {
            flags: if with_ids { FLAG_TOKENS } else { 0 },
            geometry: blob_geometry(geometry),
            dtype_code: dtype_code(geometry.dtype()),
            tokens,
            fingerprint,
            token_ids: if with_ids { tokens } else { 0 },
            position_runs,
            blocks,
        }
    }

    /// Whether the blob holds the sequence's token ids. O(1).
    pub const fn has_tokens(&self) -> bool {
        self.flags & FLAG_TOKENS != 0
    }

    /// The K/V dtype, `None` for a code this build does not know. O(1).
    pub const fn dtype(&self) -> Option<DType> {
        dtype_of(self.dtype_code)
    }

    /// Payload bytes of `section` by the header's counts; `None` on overflow (and for
    /// [`Section::Header`], which is no framed section). O(1).
    pub(crate) fn payload_len(&self, section: Section) -> Option<u64> {
        match section {
            Section::Header => None,
            Section::Tokens => u64::from(self.token_ids).checked_mul(TOKEN_ID_BYTES),
            Section::Positions => u64::from(self.position_runs).checked_mul(RUN_BYTES),
            Section::Kv => u64::from(self.blocks).checked_mul(self.geometry.bytes_per_block),
        }
    }

    /// Bytes of the whole blob by the header's counts; `None` on overflow. O(1).
    pub fn blob_len(&self) -> Option<u64> {
        let framing = (FRAME_LEN + CRC_LEN) as u64 * 3;
        let mut total = HEADER_LEN as u64 + framing;
        for s in [Section::Tokens, Section::Positions, Section::Kv] {
            total = total.checked_add(self.payload_len(s)?)?;
        }
        Some(total)
    }

    /// The header's bytes, its CRC included. O(1).
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        let g = &self.geometry;
        h[0..8].copy_from_slice(&MAGIC);
        h[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[10..12].copy_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        let words = [
            (12, self.flags),
            (16, g.layers),
            (20, g.kv_heads),
            (24, g.head_dim),
            (28, g.block_size),
            (32, self.dtype_code),
            (36, self.tokens),
            (80, self.token_ids),
            (84, self.position_runs),
            (88, self.blocks),
        ];
        for (off, w) in words {
            h[off..off + 4].copy_from_slice(&w.to_le_bytes());
        }
        h[40..48].copy_from_slice(&g.bytes_per_block.to_le_bytes());
        h[48..80].copy_from_slice(&self.fingerprint.0);
        let crc = crc32(&h[..HEADER_LEN - 4]);
        h[HEADER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Decodes and checks the header at the start of `bytes`: magic, version, header
    /// length, CRC, flags. Reads nothing past the header. O(1).
    ///
    /// # Errors
    /// [`PersistError::BadMagic`] when the bytes present differ from the magic;
    /// [`PersistError::Truncated`] when fewer than [`HEADER_LEN`] bytes are given;
    /// [`PersistError::UnsupportedVersion`]; [`PersistError::Corrupt`] (header) for a
    /// wrong header length or CRC; [`PersistError::UnsupportedFlags`].
    pub fn decode(bytes: &[u8]) -> Result<Self, PersistError> {
        let present = bytes.len().min(MAGIC.len());
        if bytes[..present] != MAGIC[..present] {
            return Err(PersistError::BadMagic);
        }
        let truncated = PersistError::Truncated {
            needed: HEADER_LEN as u64,
            got: bytes.len() as u64,
        };
        // The version first: a later version may have a longer header.
        if let Some(v) = bytes.get(8..10) {
            let found = u16::from_le_bytes([v[0], v[1]]);
            if found != FORMAT_VERSION {
                return Err(PersistError::UnsupportedVersion { found });
            }
        }
        let h: &[u8; HEADER_LEN] = bytes
            .get(..HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or(truncated)?;
        let corrupt = PersistError::Corrupt {
            section: Section::Header,
        };
        if u16_at(h, 10) as usize != HEADER_LEN
            || crc32(&h[..HEADER_LEN - 4]) != u32_at(h, HEADER_LEN - 4)
        {
            return Err(corrupt);
        }
        let flags = u32_at(h, 12);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(PersistError::UnsupportedFlags { flags });
        }
        let mut fingerprint = [0u8; 32];
        fingerprint.copy_from_slice(&h[48..80]);
        Ok(Self {
            flags,
            geometry: BlobGeometry {
                layers: u32_at(h, 16),
                kv_heads: u32_at(h, 20),
                head_dim: u32_at(h, 24),
                block_size: u32_at(h, 28),
                bytes_per_block: u64_at(h, 40),
            },
            dtype_code: u32_at(h, 32),
            tokens: u32_at(h, 36),
            fingerprint: ModelFingerprint(fingerprint),
            token_ids: u32_at(h, 80),
            position_runs: u32_at(h, 84),
            blocks: u32_at(h, 88),
        })
    }

    /// Checks that the counts agree with each other: the geometry is a valid one of a
    /// known dtype and `bytes per block` follows from it, `blocks` is
    /// `ceil(tokens / block_size)`, the token ids are `tokens` (flag set) or none, and
    /// there is at least one position run. O(1).
    ///
    /// # Errors
    /// [`PersistError::Corrupt`] (header).
    pub(crate) fn check_counts(&self) -> Result<(), PersistError> {
        let g = &self.geometry;
        let geometry = self
            .dtype()
            .and_then(|d| Geometry::new(g.layers, g.kv_heads, g.head_dim, g.block_size, d).ok());
        let ids = if self.has_tokens() { self.tokens } else { 0 };
        let consistent = geometry.is_some_and(|geo| geo.bytes_per_block() == g.bytes_per_block)
            && self.blocks == self.tokens.div_ceil(g.block_size.max(1))
            && self.token_ids == ids
            && self.position_runs >= 1;
        if consistent {
            Ok(())
        } else {
            Err(PersistError::Corrupt {
                section: Section::Header,
            })
        }
    }
}

/// The three payloads of a blob whose framing and checksums were verified.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sections<'a> {
    /// Token ids, `u32` little-endian each (empty without ids).
    pub(crate) tokens: &'a [u8],
    /// Position runs, two `u32` little-endian each.
    pub(crate) positions: &'a [u8],
    /// K/V blocks, `bytes_per_block` each.
    pub(crate) kv: &'a [u8],
}

/// Checks that `bytes` is exactly as long as `header` says (checked arithmetic), then
/// each section's framing and CRC, and returns the payloads. `header` was decoded from
/// `bytes` and its counts checked. O(blob bytes).
///
/// # Errors
/// [`PersistError::Truncated`], [`PersistError::TrailingBytes`], and
/// [`PersistError::Corrupt`] naming the first section whose kind, reserved field, length
/// or CRC is wrong (the header, if its counts overflow).
pub(crate) fn read_sections<'a>(
    header: &BlobHeader,
    bytes: &'a [u8],
) -> Result<Sections<'a>, PersistError> {
    let corrupt = |section| PersistError::Corrupt { section };
    let total = header.blob_len().ok_or(corrupt(Section::Header))?;
    let got = bytes.len() as u64;
    if got < total {
        return Err(PersistError::Truncated { needed: total, got });
    }
    if got > total {
        return Err(PersistError::TrailingBytes { extra: got - total });
    }
    let mut rest = bytes.get(HEADER_LEN..).unwrap_or(&[]);
    let mut section = |s: Section| -> Result<&'a [u8], PersistError> {
        let len = header.payload_len(s).ok_or(corrupt(Section::Header))?;
        let (frame, tail) = rest.split_at_checked(FRAME_LEN).ok_or(corrupt(s))?;
        let kind = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]);
        let reserved = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]);
        let mut framed_len = [0u8; 8];
        framed_len.copy_from_slice(&frame[8..16]);
        if kind != section_kind(s) || reserved != 0 || u64::from_le_bytes(framed_len) != len {
            return Err(corrupt(s));
        }
        let n = usize::try_from(len).map_err(|_| corrupt(s))?;
        let (payload, tail) = tail.split_at_checked(n).ok_or(corrupt(s))?;
        let (crc, tail) = tail.split_at_checked(CRC_LEN).ok_or(corrupt(s))?;
        let mut h = Hasher::new();
        h.update(frame);
        h.update(payload);
        if h.finalize().to_le_bytes() != crc {
            return Err(corrupt(s));
        }
        rest = tail;
        Ok(payload)
    };
    Ok(Sections {
        tokens: section(Section::Tokens)?,
        positions: section(Section::Positions)?,
        kv: section(Section::Kv)?,
    })
}

/// The kind code of a framed section (0 for the header, which has no frame).
const fn section_kind(s: Section) -> u32 {
    match s {
        Section::Header => 0,
        Section::Tokens => 1,
        Section::Positions => 2,
        Section::Kv => 3,
    }
}

/// Where an encoder puts bytes: a caller's buffer or a file.
pub(crate) trait Sink {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]) -> Result<(), PersistError>;
}

/// A sink over a caller buffer, filled from the start.
pub(crate) struct SliceSink<'a> {
    out: &'a mut [u8],
    len: usize,
}

impl<'a> SliceSink<'a> {
    /// An empty sink over `out`.
    pub(crate) fn new(out: &'a mut [u8]) -> Self {
        Self { out, len: 0 }
    }

    /// Bytes put so far.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Sink for SliceSink<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<(), PersistError> {
        let got = self.out.len();
        let end = self.len.saturating_add(bytes.len());
        let dst = self
            .out
            .get_mut(self.len..end)
            .ok_or(PersistError::BufferTooSmall { needed: end, got })?;
        dst.copy_from_slice(bytes);
        self.len = end;
        Ok(())
    }
}

/// A sink over a writer (a buffered file).
pub(crate) struct WriteSink<W: std::io::Write>(pub(crate) W);

impl<W: std::io::Write> Sink for WriteSink<W> {
    fn put(&mut self, bytes: &[u8]) -> Result<(), PersistError> {
        Ok(self.0.write_all(bytes)?)
    }
}

/// Writes the header.
pub(crate) fn write_header(sink: &mut impl Sink, header: &BlobHeader) -> Result<(), PersistError> {
    sink.put(&header.encode())
}

/// Writes one section: its frame, then the payload in any number of pieces, then its
/// CRC ([`SectionWriter::finish`]). The writer checks nothing about the payload's
/// length: the caller writes exactly what the frame announced.
pub(crate) struct SectionWriter<'s, S: Sink> {
    sink: &'s mut S,
    crc: Hasher,
}

impl<'s, S: Sink> SectionWriter<'s, S> {
    /// Writes the frame of `section` with a payload of `len` bytes.
    pub(crate) fn begin(sink: &'s mut S, section: Section, len: u64) -> Result<Self, PersistError> {
        let mut frame = [0u8; FRAME_LEN];
        frame[0..4].copy_from_slice(&section_kind(section).to_le_bytes());
        frame[8..16].copy_from_slice(&len.to_le_bytes());
        let mut w = Self {
            sink,
            crc: Hasher::new(),
        };
        w.put(&frame)?;
        Ok(w)
    }

    /// Appends payload bytes, in pieces small enough that the checksum and the copy
    /// read them from the cache.
    pub(crate) fn put(&mut self, bytes: &[u8]) -> Result<(), PersistError> {
        for piece in bytes.chunks(CHUNK) {
            self.crc.update(piece);
            self.sink.put(piece)?;
        }
        Ok(())
    }

    /// Appends `u32`s, little-endian.
    pub(crate) fn put_u32s(
        &mut self,
        words: impl IntoIterator<Item = u32>,
    ) -> Result<(), PersistError> {
        let mut buf = [0u8; 1024];
        let mut n = 0;
        for w in words {
            buf[n..n + 4].copy_from_slice(&w.to_le_bytes());
            n += 4;
            if n == buf.len() {
                self.put(&buf)?;
                n = 0;
            }
        }
        self.put(&buf[..n])
    }

    /// Appends elements of `elem` bytes from native to little-endian order (a copy on a
    /// little-endian target).
    pub(crate) fn put_elems(&mut self, bytes: &[u8], elem: usize) -> Result<(), PersistError> {
        if cfg!(target_endian = "little") {
            return self.put(bytes);
        }
        let mut buf = [0u8; 4096];
        for piece in bytes.chunks(buf.len()) {
            let out = &mut buf[..piece.len()];
            swap_elems(piece, elem, out);
            self.put(out)?;
        }
        Ok(())
    }

    /// Appends `n` zero bytes.
    pub(crate) fn put_zeros(&mut self, mut n: usize) -> Result<(), PersistError> {
        const ZEROS: [u8; 4096] = [0; 4096];
        while n > 0 {
            let k = n.min(ZEROS.len());
            self.put(&ZEROS[..k])?;
            n -= k;
        }
        Ok(())
    }

    /// Writes the CRC trailer.
    pub(crate) fn finish(self) -> Result<(), PersistError> {
        let crc = self.crc.finalize();
        self.sink.put(&crc.to_le_bytes())
    }
}

/// Copies elements of `elem` bytes from little-endian `src` into native-order `dst` (a
/// plain copy on a little-endian target). `dst` and `src` have the same length.
pub(crate) fn copy_elems_from_le(dst: &mut [u8], src: &[u8], elem: usize) {
    if cfg!(target_endian = "little") {
        dst.copy_from_slice(src);
    } else {
        swap_elems(src, elem, dst);
    }
}

/// Reverses the bytes of each `elem`-byte element of `src` into `dst` (same length, a
/// multiple of `elem`): little-endian to big-endian and back.
fn swap_elems(src: &[u8], elem: usize, dst: &mut [u8]) {
    for (d, s) in dst.chunks_exact_mut(elem).zip(src.chunks_exact(elem)) {
        for (x, y) in d.iter_mut().zip(s.iter().rev()) {
            *x = *y;
        }
    }
}

/// The `u32`s of a little-endian payload (a trailing partial word is ignored).
pub(crate) fn u32s(payload: &[u8]) -> impl ExactSizeIterator<Item = u32> + '_ {
    payload
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swap_reverses_each_element() {
        let src = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let mut dst = [0u8; 8];
        swap_elems(&src, 4, &mut dst);
        assert_eq!(dst, [4, 3, 2, 1, 8, 7, 6, 5]);
        swap_elems(&src, 2, &mut dst);
        assert_eq!(dst, [2, 1, 4, 3, 6, 5, 8, 7]);
    }

    #[test]
    fn header_round_trips_and_its_crc_covers_every_byte() {
        let g = Geometry::new(2, 3, 8, 4, DType::Bf16).unwrap();
        let h = BlobHeader::new(&g, ModelFingerprint::from_u64(7), 9, 3, true, 1);
        let bytes = h.encode();
        assert_eq!(BlobHeader::decode(&bytes), Ok(h));
        h.check_counts().unwrap();
        for i in 12..HEADER_LEN {
            let mut b = bytes;
            b[i] ^= 0x10;
            assert_eq!(
                BlobHeader::decode(&b),
                Err(PersistError::Corrupt {
                    section: Section::Header
                }),
                "byte {i}"
            );
        }
    }

    #[test]
    fn counts_that_disagree_are_corrupt() {
        let g = Geometry::new(1, 1, 4, 4, DType::F32).unwrap();
        let good = BlobHeader::new(&g, ModelFingerprint::default(), 5, 2, false, 1);
        good.check_counts().unwrap();
        let bad = [
            BlobHeader { blocks: 1, ..good },
            BlobHeader {
                token_ids: 5,
                ..good
            },
            BlobHeader {
                position_runs: 0,
                ..good
            },
            BlobHeader {
                dtype_code: 9,
                ..good
            },
            BlobHeader {
                geometry: BlobGeometry {
                    bytes_per_block: 1,
                    ..good.geometry
                },
                ..good
            },
        ];
        for h in bad {
            assert!(h.check_counts().is_err(), "{h:?}");
        }
    }

    #[test]
    fn a_length_that_overflows_is_refused_not_wrapped() {
        let g = Geometry::new(1, 1, 4, 4, DType::F32).unwrap();
        let mut h = BlobHeader::new(&g, ModelFingerprint::default(), 5, 2, false, 1);
        h.geometry.bytes_per_block = u64::MAX / 2;
        assert_eq!(h.blob_len(), None);
        assert!(read_sections(&h, &h.encode()).is_err());
    }
}
