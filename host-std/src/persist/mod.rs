//! Saving a sequence — its token ids, positions and K/V blocks — into a caller buffer or
//! a file, and restoring it into any free blocks of a cache of the same geometry, dtype
//! and model ([`KvCache::save_seq`], [`KvCache::restore_seq`] and their file variants);
//! and saving the whole prefix cache at shutdown to load it at the next start-up
//! ([`KvCache::save_prefix_cache`], [`KvCache::load_prefix_cache`]).
//!
//! - [`format`](mod@format): the versioned byte format (header, framed sections, CRC-32s), encoded
//!   field by field, little-endian.
//! - `seq`: the [`KvCache`] methods, [`SeqBlob`] to look into a blob without a cache.
//! - `request`: [`crate::Engine::save_request`], a request's sequence with the engine's
//!   token ids.
//! - `file`: crash-consistent writes (aside, fsync, rename, fsync the directory).
//! - `positions`: the blob's position runs, checked with the core's rules on restore.
//! - `prefix_file`: the persistent prefix cache (its own format, one checksum per block).
//!
//! A restore checks everything before it changes anything: a blob from another
//! geometry, dtype or model, a truncated or corrupted one, or a cache without room is a
//! typed [`PersistError`] (inside [`crate::CacheError::Persist`]), and the cache is as it
//! was, every arena byte included.
//!
//! ```
//! use kvpage::{CacheConfig, Capacity, DType, Geometry, KvCache, ModelFingerprint};
//!
//! let geometry = Geometry::new(2, 2, 8, 16, DType::F16)?;
//! let config = CacheConfig {
//!     geometry,
//!     capacity: Capacity::Blocks(16),
//!     max_seqs: 4,
//!     max_seq_len: 128,
//!     threads: 1,
//!     event_capacity: 0,
//!     hash_key: None,
//!     max_namespaces: kvpage::CACHE_NAMESPACES,
//! };
//! let model = ModelFingerprint::from_u64(0x5eed);
//! let mut cache = KvCache::new(config)?;
//! let prompt: Vec<u32> = (0..20).collect();
//! let seq = cache.create_with_prompt(0, &prompt)?.seq;
//! // ... write K/V ...
//! let mut blob = vec![0u8; cache.saved_seq_size(seq, true)?];
//! cache.save_seq(seq, Some(&prompt), &model, &mut blob)?;
//!
//! let mut other = KvCache::new(config)?;
//! let (restored, info) = other.restore_seq(&blob, 0, &model)?;
//! assert_eq!(other.len(restored)?, 20);
//! assert_eq!(info.tokens.map(|t| t.to_vec()), Some(prompt));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`KvCache`]: crate::KvCache
//! [`KvCache::save_seq`]: crate::KvCache::save_seq
//! [`KvCache::restore_seq`]: crate::KvCache::restore_seq
//! [`KvCache::save_prefix_cache`]: crate::KvCache::save_prefix_cache
//! [`KvCache::load_prefix_cache`]: crate::KvCache::load_prefix_cache

mod error;
mod file;
pub mod format;
mod positions;
mod prefix_file;
mod request;
mod seq;

pub use error::{BlobGeometry, PersistError, Section};
pub use format::{BlobHeader, ModelFingerprint};
pub use prefix_file::{
    PrefixLoadReport, SavedPrefixCache, PREFIX_FORMAT_VERSION, PREFIX_HEADER_LEN, PREFIX_MAGIC,
};
pub use seq::{BlobTokens, RestoredFile, RestoredInfo, SeqBlob};
