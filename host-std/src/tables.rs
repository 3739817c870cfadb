//! The core's state over one owned allocation: the block manager and, for an engine,
//! the host pool and the request engine — the only self-referential type of the crate.
//!
//! The core's types borrow caller storage (`BlockManager<'a>` over `&'a mut [u64]`). To
//! keep them and their storage in one owned value, the storage is turned into a raw
//! pointer (`Box::into_raw`) and the parts are built over a `'static` reborrow of it.
//! The `'static` never leaves this module's users: [`Tables::get`] shortens it to
//! `&self`'s lifetime, and [`Tables::parts_mut`] is only used to call the parts'
//! methods, never to move a part in or out. `Drop` drops the parts first and frees the
//! storage after. (`self_cell` only lends the owner immutably, which the core's
//! `&mut [u64]` storage cannot use.)

use core::mem::ManuallyDrop;

use kvpage_core::{BlockManager, Config, Engine, EngineConfig, HostPool};

use crate::cache::CacheError;

/// The core parts one [`Tables`] owns.
#[derive(Debug)]
pub(crate) struct CoreParts<'a> {
    /// The block manager.
    pub(crate) manager: BlockManager<'a>,
    /// The host tier's free set (engines with swap space only).
    pub(crate) host: Option<HostPool<'a>>,
    /// The request engine (engines only).
    pub(crate) engine: Option<Engine<'a>>,
}

/// What an engine adds to the manager: host blocks (0: none) and the engine's sizes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EngineParts {
    pub(crate) host_blocks: u32,
    pub(crate) engine: EngineConfig,
}

/// The parts together with the storage they borrow. See the module docs.
pub(crate) struct Tables {
    parts: ManuallyDrop<CoreParts<'static>>,
    storage: *mut [u64],
}

// SAFETY: `Tables` owns the storage exclusively (nothing else holds the pointer); the
// parts are plain data over that storage, so moving them to another thread is sound.
unsafe impl Send for Tables {}
// SAFETY: `&Tables` only gives out `&CoreParts`, whose `&self` methods only read.
unsafe impl Sync for Tables {}

impl Tables {
    /// Allocates the storage of a manager for `config` (plus a host pool and an engine
    /// when `engine` is given), zeroed, and builds the parts over it.
    /// O(storage words).
    ///
    /// # Errors
    /// [`CacheError::TablesAlloc`] if the allocator refuses the storage (instead of
    /// aborting) or its size overflows; [`CacheError::Init`] if the core refuses the
    /// configuration; [`CacheError::Engine`] if the engine refuses its own.
    pub(crate) fn new(config: Config, engine: Option<EngineParts>) -> Result<Self, CacheError> {
        let manager_words = config.storage_words();
        let host_words = engine.map_or(0, |e| HostPool::storage_words(e.host_blocks).div_ceil(2));
        let engine_words = engine.map_or(0, |e| e.engine.storage_words(&config));
        let total = manager_words
            .checked_add(host_words)
            .and_then(|w| w.checked_add(engine_words))
            .ok_or(CacheError::TablesAlloc { bytes: usize::MAX })?;
        let words = try_filled(total, 0u64)?;
        let storage = Box::into_raw(words.into_boxed_slice());
        // SAFETY: `storage` comes from `Box::into_raw`, so it is valid and unique; it
        // stays allocated until `Drop` (or the error path below) frees it, after the
        // parts borrowing it are gone.
        let words: &'static mut [u64] = unsafe { &mut *storage };
        match Self::build(config, engine, words, manager_words, host_words) {
            Ok(parts) => Ok(Self {
                parts: ManuallyDrop::new(parts),
                storage,
            }),
            Err(e) => {
                // SAFETY: the failed build dropped its borrows; nothing else points here.
                drop(unsafe { Box::from_raw(storage) });
                Err(e)
            }
        }
    }

    fn build(
        config: Config,
        engine: Option<EngineParts>,
        words: &'static mut [u64],
        manager_words: usize,
        host_words: usize,
    ) -> Result<CoreParts<'static>, CacheError> {
        let (manager_words, rest) = words.split_at_mut(manager_words);
        let (host_words, engine_words) = rest.split_at_mut(host_words);
        let manager = BlockManager::new(config, manager_words).map_err(CacheError::Init)?;
        let (host, engine) = match engine {
            None => (None, None),
            Some(e) => {
                let host = match e.host_blocks {
                    0 => None,
                    blocks => Some(
                        HostPool::new(
                            blocks,
                            config.instance,
                            bytemuck::cast_slice_mut(host_words),
                        )
                        .map_err(CacheError::Init)?,
                    ),
                };
                let engine =
                    Engine::new(e.engine, &config, engine_words).map_err(CacheError::Engine)?;
                (host, Some(engine))
            }
        };
        Ok(CoreParts {
            manager,
            host,
            engine,
        })
    }

    /// The parts, read-only. O(1).
    pub(crate) fn get(&self) -> &CoreParts<'_> {
        &self.parts
    }

    /// The manager, read-only. O(1).
    pub(crate) fn manager(&self) -> &BlockManager<'_> {
        &self.parts.manager
    }

    /// Only for calling the parts' methods (see the module docs). O(1).
    pub(crate) fn parts_mut(&mut self) -> &mut CoreParts<'static> {
        &mut self.parts
    }
}

impl Drop for Tables {
    fn drop(&mut self) {
        // SAFETY: the parts are dropped exactly once, here, before their storage is
        // freed; the storage pointer came from `Box::into_raw` and is freed exactly once.
        unsafe {
            ManuallyDrop::drop(&mut self.parts);
            drop(Box::from_raw(self.storage));
        }
    }
}

/// An empty vector with room for exactly `n` elements, or [`CacheError::TablesAlloc`]
/// if the allocator refuses (or `n` elements overflow `isize::MAX` bytes) instead of
/// aborting. O(1) plus the allocator's cost.
pub(crate) fn try_with_capacity<T>(n: usize) -> Result<Vec<T>, CacheError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| CacheError::TablesAlloc {
            bytes: n.saturating_mul(core::mem::size_of::<T>()),
        })?;
    Ok(v)
}

/// `n` copies of `value`, allocated as [`try_with_capacity`] does. O(n).
///
/// # Errors
/// [`CacheError::TablesAlloc`] if the allocator refuses.
pub(crate) fn try_filled<T: Clone>(n: usize, value: T) -> Result<Vec<T>, CacheError> {
    let mut v = try_with_capacity(n)?;
    v.resize(n, value);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::SeqQuery;

    #[test]
    #[cfg_attr(
        miri,
        ignore = "Miri aborts on an allocation past its memory instead of failing it"
    )]
    fn impossible_table_sizes_are_typed_errors() {
        // Not validated (`KvCache::new` validates first): more words than a `usize` holds.
        let config = Config {
            num_blocks: u32::MAX,
            block_size: u32::MAX,
            max_seqs: u32::MAX,
            max_blocks_per_seq: u32::MAX,
            instance: 1,
            hash_key: 0,
            prefix_cache: true,
            max_position_runs: 4,
            max_namespaces: 0,
            event_capacity: 0,
        };
        assert_eq!(config.storage_words(), usize::MAX);
        assert!(matches!(
            Tables::new(config, None),
            Err(CacheError::TablesAlloc { bytes: usize::MAX })
        ));
        // A byte count that fits an `isize` but no address space: the allocator refuses.
        let words = isize::MAX as usize / 8;
        assert_eq!(
            try_filled(words, 0u64).err(),
            Some(CacheError::TablesAlloc { bytes: words * 8 })
        );
        assert_eq!(
            try_with_capacity::<SeqQuery>(usize::MAX).err(),
            Some(CacheError::TablesAlloc { bytes: usize::MAX })
        );
        // A possible size still works, with exactly the requested capacity.
        let v = try_filled(5, 7u32).unwrap();
        assert_eq!((v.len(), v.capacity(), v[4]), (5, 5, 7));
    }
}
