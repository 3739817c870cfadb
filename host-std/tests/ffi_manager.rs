//! Tier 2 of the C API, the block manager over caller memory, called through its
//! `extern "C"` functions with raw pointers:
//! 1. it makes the same slot mappings, copies, swap plans and block tables as the Rust
//!    core `BlockManager` over a few hundred random operations per seed;
//! 2. the dense and CSR exports and the in-place table agree with the blocks of every
//!    sequence (FlashInfer's `last_page_len` convention included);
//! 3. bad input gets its code, changes nothing, and the manager works afterwards;
//! 4. nothing allocates after init, failures included.

use std::mem::ManuallyDrop;
use std::ptr::{null, null_mut};

use kvpage::ffi::*;
use kvpage_core::{BlockCopy, BlockManager, HostPool, RowMove, SeqError, SeqId};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use kvpage_result::*;

/// The system allocator, counting the allocations of a thread while it is armed.
struct Counting;

thread_local! {
    static ARMED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static ALLOCS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

// SAFETY: forwards to the system allocator; the counters are const-initialised
// thread-locals, which allocate nothing.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if ARMED.with(|a| a.get()) {
            ALLOCS.with(|n| n.set(n.get() + 1));
        }
        // SAFETY: forwarded contract.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: forwarded contract.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Allocations `f` makes on this thread.
fn allocations(f: impl FnOnce()) -> u64 {
    ALLOCS.with(|n| n.set(0));
    ARMED.with(|a| a.set(true));
    f();
    ARMED.with(|a| a.set(false));
    ALLOCS.with(|n| n.get())
}

/// A manager inside a `Vec<u64>` (8-aligned, as the storage needs).
struct CManager {
    _storage: Vec<u64>,
    m: *mut kvpage_manager,
}

fn storage_bytes(config: &kvpage_manager_config) -> usize {
    let mut bytes = 0usize;
    // SAFETY: valid pointers.
    let r = unsafe { kvpage_manager_storage_size(config, &mut bytes, null_mut()) };
    assert_eq!(r, KVPAGE_OK);
    bytes
}

impl CManager {
    fn new(config: kvpage_manager_config) -> Self {
        assert_eq!(kvpage_manager_storage_align(), 8);
        let bytes = storage_bytes(&config);
        let mut storage = vec![0xA5A5_A5A5_A5A5_A5A5u64; bytes.div_ceil(8)];
        let mut m = null_mut();
        // SAFETY: the storage is `bytes` long, aligned, and lives in `Self`.
        let r = unsafe {
            kvpage_manager_init(
                &config,
                storage.as_mut_ptr().cast(),
                bytes,
                &mut m,
                null_mut(),
            )
        };
        assert_eq!(r, KVPAGE_OK);
        assert_eq!(m.cast::<u64>(), storage.as_mut_ptr());
        Self {
            _storage: storage,
            m,
        }
    }

    fn stats(&self) -> kvpage_stats {
        let mut s = kvpage_stats::default();
        // SAFETY: a live manager, a writable out-parameter.
        assert_eq!(
            unsafe { kvpage_manager_stats(self.m, &mut s, null_mut()) },
            KVPAGE_OK
        );
        s
    }

    fn blocks(&self, seq: kvpage_seq) -> Result<Vec<u32>, kvpage_result> {
        let mut buf = vec![0u32; 64];
        let mut n = 0usize;
        // SAFETY: a live manager, buffers of the lengths passed.
        let r = unsafe {
            kvpage_manager_blocks(self.m, seq, buf.as_mut_ptr(), buf.len(), &mut n, null_mut())
        };
        ok(r)?;
        buf.truncate(n);
        Ok(buf)
    }

    fn len(&self, seq: kvpage_seq) -> Result<u32, kvpage_result> {
        let mut len = 0;
        // SAFETY: as above.
        ok(unsafe { kvpage_manager_len(self.m, seq, &mut len, null_mut()) })?;
        Ok(len)
    }

    fn create(&self, ns: u64) -> kvpage_seq {
        let mut s = KVPAGE_SEQ_NONE;
        // SAFETY: as above.
        assert_eq!(
            unsafe { kvpage_manager_create(self.m, ns, &mut s, null_mut()) },
            KVPAGE_OK
        );
        s
    }

    fn append(&self, seq: kvpage_seq, n: u32) -> Vec<u32> {
        let mut slots = vec![0u32; n as usize];
        let mut a = kvpage_appended::default();
        // SAFETY: as above.
        let r = unsafe {
            kvpage_manager_append(
                self.m,
                seq,
                n,
                slots.as_mut_ptr(),
                slots.len(),
                &mut a,
                null_mut(),
            )
        };
        assert_eq!(r, KVPAGE_OK);
        slots
    }

    /// Everything observable: stats, available blocks, and per sequence of `seqs`
    /// its length and blocks (or the error reading them).
    fn snapshot(&self, seqs: &[kvpage_seq]) -> String {
        let mut avail = 0;
        // SAFETY: as above.
        assert_eq!(
            unsafe { kvpage_manager_available_blocks(self.m, &mut avail, null_mut()) },
            KVPAGE_OK
        );
        let per_seq: Vec<_> = seqs
            .iter()
            .map(|&s| (self.len(s), self.blocks(s)))
            .collect();
        format!("{:?} {avail} {per_seq:?}", self.stats())
    }
}

/// The Rust core manager and host pool over storage of their own (test only): the boxes
/// are turned into raw pointers for the `'static` borrows the two need and taken back
/// when both are dropped, so the test leaks nothing (LeakSanitizer and Miri check it).
struct RustManager {
    m: ManuallyDrop<BlockManager<'static>>,
    host: ManuallyDrop<HostPool<'static>>,
    storage: *mut [u64],
    host_storage: *mut [u32],
}

impl RustManager {
    fn new(c: &kvpage_manager_config) -> Self {
        let config = c.to_core();
        let storage = Box::into_raw(vec![0u64; config.storage_words()].into_boxed_slice());
        let host_storage =
            Box::into_raw(vec![0u32; HostPool::storage_words(c.host_blocks)].into_boxed_slice());
        // SAFETY: both pointers come from `Box::into_raw`, so they are valid and unique;
        // the borrows live in `m` and `host`, which `drop` ends before freeing the boxes.
        let (s, h) = unsafe { (&mut *storage, &mut *host_storage) };
        Self {
            m: ManuallyDrop::new(BlockManager::new(config, s).unwrap()),
            host: ManuallyDrop::new(HostPool::new(c.host_blocks, c.instance, h).unwrap()),
            storage,
            host_storage,
        }
    }
}

impl Drop for RustManager {
    fn drop(&mut self) {
        // SAFETY: the manager and the pool, the only users of the two boxes, are dropped
        // first and never touched again; the pointers came from `Box::into_raw` once.
        unsafe {
            ManuallyDrop::drop(&mut self.m);
            ManuallyDrop::drop(&mut self.host);
            drop(Box::from_raw(self.storage));
            drop(Box::from_raw(self.host_storage));
        }
    }
}

fn ok(r: kvpage_result) -> Result<(), kvpage_result> {
    match r {
        KVPAGE_OK => Ok(()),
        e => Err(e),
    }
}

/// The code the C API gives for a core error.
fn code(e: SeqError) -> kvpage_result {
    match e {
        SeqError::StaleHandle => KVPAGE_ERR_STALE_SEQ,
        SeqError::ForeignHandle => KVPAGE_ERR_FOREIGN_SEQ,
        SeqError::NoFreeSequence => KVPAGE_ERR_NO_FREE_SEQ,
        SeqError::TooLong { .. } => KVPAGE_ERR_SEQ_TOO_LONG,
        SeqError::OutOfBlocks { .. } => KVPAGE_ERR_OUT_OF_BLOCKS,
        SeqError::SlotBufferTooSmall { .. } | SeqError::MoveBufferTooSmall { .. } => {
            KVPAGE_ERR_BUFFER_TOO_SMALL
        }
        SeqError::Swapped => KVPAGE_ERR_SEQ_SWAPPED,
        SeqError::NotSwapped => KVPAGE_ERR_SEQ_NOT_SWAPPED,
        SeqError::HostFull { .. } => KVPAGE_ERR_HOST_FULL,
        SeqError::BeyondLength { .. } | SeqError::BadRange { .. } => KVPAGE_ERR_BEYOND_LENGTH,
        SeqError::BadPositions => KVPAGE_ERR_BAD_POSITIONS,
        SeqError::TooManyPositionRuns { .. } => KVPAGE_ERR_TOO_MANY_POSITION_RUNS,
        SeqError::QuotaExceeded { .. } => KVPAGE_ERR_QUOTA_EXCEEDED,
    }
}

fn same<T: PartialEq + std::fmt::Debug, U: PartialEq + std::fmt::Debug>(
    seen: &mut std::collections::BTreeMap<String, u32>,
    what: &str,
    c: Result<T, kvpage_result>,
    r: Result<U, SeqError>,
    conv: impl Fn(&U) -> T,
) -> Option<T> {
    let key = match &c {
        Ok(_) => what.to_string(),
        Err(e) => format!("{what} {e:?}"),
    };
    *seen.entry(key).or_default() += 1;
    match (c, r) {
        (Ok(c), Ok(r)) => {
            assert_eq!(c, conv(&r), "{what}: results differ");
            Some(c)
        }
        (Err(c), Err(r)) => {
            assert_eq!(c, code(r), "{what}: codes differ ({r:?})");
            None
        }
        (c, r) => panic!("{what}: C gave {c:?}, Rust {r:?}"),
    }
}

const SENTINEL: u32 = 0xDEAD_BEEF;

fn copies_eq(c: &[kvpage_block_copy], r: &[BlockCopy]) -> bool {
    c.len() == r.len()
        && c.iter()
            .zip(r)
            .all(|(c, r)| (c.src, c.dst) == (r.src, r.dst))
}

fn appended_c(a: &kvpage_core::Appended) -> kvpage_appended {
    kvpage_appended {
        has_copy: u32::from(a.copy.is_some()),
        copy: a
            .copy
            .map(|c| kvpage_block_copy {
                src: c.src,
                dst: c.dst,
            })
            .unwrap_or_default(),
        new_blocks: a.new_blocks,
    }
}

/// The two managers side by side and the ids each issued, pairwise.
struct Pair {
    c: CManager,
    r: RustManager,
    live: Vec<(kvpage_seq, SeqId)>,
    dead: Vec<(kvpage_seq, SeqId)>,
    /// Successful operations by name, copy-on-writes as "copy", failures by code.
    seen: std::collections::BTreeMap<String, u32>,
    /// The edits draw from their own generator, so the other operations' draws stay
    /// those of the runs before edits existed (whose prefix hits the tests count on).
    edit_rng: StdRng,
    /// Draws of the retention operations (their own stream, so the others' is kept).
    retain_rng: StdRng,
}

impl Pair {
    fn new(config: kvpage_manager_config) -> Self {
        Self {
            c: CManager::new(config),
            r: RustManager::new(&config),
            live: Vec::new(),
            dead: Vec::new(),
            seen: Default::default(),
            edit_rng: StdRng::seed_from_u64(u64::from(config.block_size) << 8 | 0xed),
            retain_rng: StdRng::seed_from_u64(u64::from(config.block_size) << 8 | 0x9e),
        }
    }

    fn issued(&mut self, c: kvpage_seq, r: SeqId) {
        assert_eq!(c as u32, r.index(), "rows differ");
        assert!(self.live.iter().all(|&(x, _)| x != c), "id issued twice");
        self.live.push((c, r));
    }

    fn retire(&mut self, c: kvpage_seq) {
        let k = self.live.iter().position(|&(x, _)| x == c).unwrap();
        self.dead.push(self.live.swap_remove(k));
    }

    /// Stats, lengths, blocks and both exports of every live sequence agree.
    fn check(&self) {
        let rs = self.r.m.stats();
        assert_eq!(self.c.stats(), kvpage_stats::from(rs));
        let mut device = Vec::new();
        for &(c, r) in &self.live {
            let mut sw = 9;
            // SAFETY: a live manager, a writable out-parameter.
            ok(unsafe { kvpage_manager_is_swapped(self.c.m, c, &mut sw, null_mut()) }).unwrap();
            assert_eq!(sw != 0, self.r.m.is_swapped(r).unwrap());
            let mut seen = Default::default();
            same(&mut seen, "len", self.c.len(c), self.r.m.len(r), |&x| x);
            same(
                &mut seen,
                "blocks",
                self.c.blocks(c),
                self.r.m.blocks(r),
                |x| x.to_vec(),
            );
            if sw == 0 {
                device.push((c, r));
            }
        }
        let ids: Vec<_> = device.iter().map(|&(c, _)| c).collect();
        let rows: Vec<_> = device
            .iter()
            .map(|&(_, r)| {
                (
                    self.r.m.blocks(r).unwrap().to_vec(),
                    self.r.m.len(r).unwrap(),
                )
            })
            .collect();
        check_exports(&self.c, &ids, &rows, self.r.m.config().block_size);
    }
}

/// The CSR, dense and in-place tables of `ids` hold `rows` (blocks, length).
fn check_exports(c: &CManager, ids: &[kvpage_seq], rows: &[(Vec<u32>, u32)], bs: u32) {
    let n = ids.len();
    let total: usize = rows.iter().map(|(b, _)| b.len()).sum();
    let longest = rows.iter().map(|(b, _)| b.len()).max().unwrap_or(0);
    let (mut indptr, mut indices, mut last) = (
        vec![SENTINEL; n + 1],
        vec![SENTINEL; total + 1],
        vec![SENTINEL; n],
    );
    // SAFETY: buffers of the lengths passed.
    let r = unsafe {
        kvpage_manager_block_table_csr(
            c.m,
            ids.as_ptr(),
            n,
            indptr.as_mut_ptr(),
            indptr.len(),
            indices.as_mut_ptr(),
            indices.len(),
            last.as_mut_ptr(),
            last.len(),
            null_mut(),
        )
    };
    assert_eq!(r, KVPAGE_OK);
    assert_eq!(indptr[0], 0);
    assert_eq!(indices[total], SENTINEL, "wrote past the total");
    for (k, (blocks, len)) in rows.iter().enumerate() {
        let (a, b) = (indptr[k] as usize, indptr[k + 1] as usize);
        assert_eq!(&indices[a..b], &blocks[..]);
        let want = if *len == 0 { 0 } else { (len - 1) % bs + 1 };
        assert_eq!(last[k], want, "last_page_len of len {len}, block size {bs}");
        assert!(last[k] <= bs);
    }

    let stride = longest.max(1) + 2;
    let pad = 0xFFFF_FFF0;
    let mut table = vec![SENTINEL; n * stride + 1];
    let mut lens = vec![SENTINEL; n];
    // SAFETY: buffers of the lengths passed.
    let r = unsafe {
        kvpage_manager_block_table_dense(
            c.m,
            ids.as_ptr(),
            n,
            stride as u32,
            pad,
            table.as_mut_ptr(),
            table.len(),
            lens.as_mut_ptr(),
            lens.len(),
            null_mut(),
        )
    };
    assert_eq!(r, KVPAGE_OK);
    assert_eq!(table[n * stride], SENTINEL);
    for (k, (blocks, len)) in rows.iter().enumerate() {
        let row = &table[k * stride..(k + 1) * stride];
        assert_eq!(&row[..blocks.len()], &blocks[..]);
        assert!(row[blocks.len()..].iter().all(|&x| x == pad));
        assert_eq!(lens[k], *len);
    }

    let (mut t, mut l, mut nrows, mut nstride) = (null(), null(), 0u32, 0u32);
    // SAFETY: writable out-parameters.
    let r = unsafe {
        kvpage_manager_block_table(c.m, &mut t, &mut l, &mut nrows, &mut nstride, null_mut())
    };
    assert_eq!(r, KVPAGE_OK);
    // SAFETY: the manager's table: `nrows * nstride` ids and `nrows` lengths, read
    // between calls.
    let (t, l) = unsafe {
        (
            std::slice::from_raw_parts(t, (nrows * nstride) as usize),
            std::slice::from_raw_parts(l, nrows as usize),
        )
    };
    for (&id, (blocks, len)) in ids.iter().zip(rows) {
        let mut row = u32::MAX;
        // SAFETY: a writable out-parameter.
        assert_eq!(
            unsafe { kvpage_manager_seq_row(c.m, id, &mut row, null_mut()) },
            KVPAGE_OK
        );
        let at = (row * nstride) as usize;
        assert_eq!(&t[at..at + blocks.len()], &blocks[..]);
        assert_eq!(l[row as usize], *len);
    }
}

fn config(block_size: u32, prefix_cache: bool, instance: u32) -> kvpage_manager_config {
    kvpage_manager_config {
        num_blocks: 28,
        block_size,
        max_seqs: 8,
        max_blocks_per_seq: 12,
        instance,
        prefix_cache: u32::from(prefix_cache),
        hash_key: 0x1234_5678,
        host_blocks: 20,
        max_namespaces: 2,
    }
}

/// One random operation on both managers, compared.
fn step(p: &mut Pair, rng: &mut StdRng, prefixes: &[Vec<u32>]) {
    let bs = p.r.m.config().block_size;
    let pick = |p: &Pair, rng: &mut StdRng| -> Option<(kvpage_seq, SeqId)> {
        if !p.dead.is_empty() && rng.random_ratio(1, 12) {
            return Some(p.dead[rng.random_range(0..p.dead.len())]);
        }
        (!p.live.is_empty()).then(|| p.live[rng.random_range(0..p.live.len())])
    };
    // Sometimes a buffer one short of what is needed.
    let short = |rng: &mut StdRng, n: usize| n.saturating_sub(usize::from(rng.random_ratio(1, 10)));
    let m = p.c.m;
    if p.retain_rng.random_ratio(1, 6) {
        let mut retain_rng = std::mem::replace(&mut p.retain_rng, StdRng::seed_from_u64(0));
        retain_step(p, &mut retain_rng);
        p.retain_rng = retain_rng;
    }
    match rng.random_range(0..15u32) {
        0 => {
            let ns = rng.random_range(0..2u64);
            let mut s = KVPAGE_SEQ_NONE;
            // SAFETY: live manager, writable out-parameter.
            let c = ok(unsafe { kvpage_manager_create(m, ns, &mut s, null_mut()) }).map(|_| s);
            let r = p.r.m.create(ns);
            if let Some(s) = same(&mut p.seen, "create", c, r, |_| s) {
                p.issued(s, r.unwrap());
            }
        }
        1 | 2 => {
            let ns = rng.random_range(0..2u64);
            let pre = &prefixes[rng.random_range(0..prefixes.len())];
            let keep = match rng.random_bool(0.5) {
                true => pre.len(),
                false => rng.random_range(0..=pre.len()),
            };
            let mut prompt = pre[..keep].to_vec();
            prompt.extend((0..rng.random_range(0..10)).map(|_| rng.random_range(0..50u32)));
            let slots_len = short(rng, prompt.len());
            let (mut cs, mut rs) = (vec![SENTINEL; slots_len], vec![SENTINEL; slots_len]);
            let mut out = kvpage_prompt_start::default();
            // SAFETY: buffers of the lengths passed.
            let c = ok(unsafe {
                kvpage_manager_create_with_prompt(
                    m,
                    ns,
                    prompt.as_ptr(),
                    prompt.len(),
                    cs.as_mut_ptr(),
                    cs.len(),
                    &mut out,
                    null_mut(),
                )
            });
            let r = p.r.m.create_with_prompt(ns, &prompt, &mut rs);
            assert_eq!(cs, rs, "prompt slots");
            match (c, r) {
                (Ok(()), Ok(r)) => {
                    assert_eq!(out.reused_tokens, r.reused_tokens);
                    assert_eq!(
                        out.slots_written as usize,
                        prompt.len() - r.reused_tokens as usize
                    );
                    let a = appended_c(&r.appended);
                    assert_eq!(
                        (out.has_copy, out.copy, out.new_blocks),
                        (a.has_copy, a.copy, a.new_blocks)
                    );
                    p.issued(out.seq, r.seq);
                    *p.seen.entry("prompt".into()).or_default() += 1;
                }
                (Err(c), Err(r)) => {
                    assert_eq!(c, code(r));
                    assert!(
                        cs.iter().all(|&x| x == SENTINEL),
                        "slots written on failure"
                    );
                }
                (c, r) => panic!("create_with_prompt: C {c:?}, Rust {r:?}"),
            }
        }
        3 | 4 => {
            let Some((c_id, r_id)) = pick(p, rng) else {
                return;
            };
            let n = rng.random_range(0..16u32);
            let with_ids = rng.random_bool(0.5);
            let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..50)).collect();
            let slots_len = short(rng, n as usize);
            let (mut cs, mut rs) = (vec![SENTINEL; slots_len], vec![SENTINEL; slots_len]);
            let mut a = kvpage_appended::default();
            // SAFETY: buffers of the lengths passed.
            let c = ok(unsafe {
                if with_ids {
                    kvpage_manager_append_tokens(
                        m,
                        c_id,
                        tokens.as_ptr(),
                        tokens.len(),
                        cs.as_mut_ptr(),
                        cs.len(),
                        &mut a,
                        null_mut(),
                    )
                } else {
                    kvpage_manager_append(m, c_id, n, cs.as_mut_ptr(), cs.len(), &mut a, null_mut())
                }
            })
            .map(|_| a);
            let r = if with_ids {
                p.r.m.append_tokens(r_id, &tokens, &mut rs)
            } else {
                p.r.m.append(r_id, n, &mut rs)
            };
            if let Some(a) = same(&mut p.seen, "append", c, r, appended_c) {
                if a.has_copy != 0 {
                    *p.seen.entry("copy".into()).or_default() += 1;
                }
            }
            assert_eq!(cs, rs, "append slots");
        }
        5 => {
            let Some((c_id, r_id)) = pick(p, rng) else {
                return;
            };
            let len = p.r.m.len(r_id).unwrap_or(0);
            let computed = match rng.random_bool(0.5) {
                true => len,
                false => rng.random_range(0..=len + 1),
            };
            let mut newly = SENTINEL;
            // SAFETY: writable out-parameter.
            let c = ok(unsafe { kvpage_manager_commit(m, c_id, computed, &mut newly, null_mut()) })
                .map(|_| newly);
            same(
                &mut p.seen,
                "commit",
                c,
                p.r.m.commit(r_id, computed),
                |&x| x,
            );
        }
        6 | 10 => {
            let Some((c_id, r_id)) = pick(p, rng) else {
                return;
            };
            let mut s = KVPAGE_SEQ_NONE;
            // SAFETY: writable out-parameter.
            let c = ok(unsafe { kvpage_manager_fork(m, c_id, &mut s, null_mut()) }).map(|_| s);
            let r = p.r.m.fork(r_id);
            if let Some(s) = same(&mut p.seen, "fork", c, r, |_| s) {
                p.issued(s, r.unwrap());
            }
        }
        7 => {
            let Some((c_id, r_id)) = pick(p, rng) else {
                return;
            };
            let len = p.r.m.len(r_id).unwrap_or(0);
            let to = rng.random_range(0..=len + 1);
            // SAFETY: live manager.
            let c = ok(unsafe { kvpage_manager_truncate(m, c_id, to, null_mut()) });
            same(&mut p.seen, "truncate", c, p.r.m.truncate(r_id, to), |_| ());
        }
        8 | 13 => {
            let Some((c_id, r_id)) = pick(p, rng) else {
                return;
            };
            let swapped = p.r.m.is_swapped(r_id).unwrap_or(false);
            let c = ok(unsafe {
                // SAFETY: live manager.
                if swapped {
                    kvpage_manager_release_swapped(m, c_id, null_mut())
                } else {
                    kvpage_manager_release(m, c_id, null_mut())
                }
            });
            let r = if swapped {
                p.r.m.release_swapped(r_id, &mut p.r.host)
            } else {
                p.r.m.release(r_id)
            };
            if same(&mut p.seen, "release", c, r, |_| ()).is_some() {
                p.retire(c_id);
            }
        }
        9 => {
            let Some((c_id, r_id)) = pick(p, rng) else {
                return;
            };
            let swap_in = rng.random_bool(match p.r.m.is_swapped(r_id) {
                Ok(true) => 0.9,
                _ => 0.1,
            });
            let need = p.r.m.blocks(r_id).map_or(12, |b| b.len());
            let len = short(rng, need);
            let mut cc = vec![
                kvpage_block_copy {
                    src: SENTINEL,
                    dst: SENTINEL
                };
                len
            ];
            let mut rc = vec![
                BlockCopy {
                    src: SENTINEL,
                    dst: SENTINEL
                };
                len
            ];
            let mut n = usize::MAX;
            // SAFETY: buffers of the lengths passed.
            let c = ok(unsafe {
                if swap_in {
                    kvpage_manager_swap_in(m, c_id, cc.as_mut_ptr(), cc.len(), &mut n, null_mut())
                } else {
                    kvpage_manager_swap_out(m, c_id, cc.as_mut_ptr(), cc.len(), &mut n, null_mut())
                }
            })
            .map(|_| n);
            let r = if swap_in {
                p.r.m.swap_in(r_id, &mut p.r.host, &mut rc)
            } else {
                p.r.m.swap_out(r_id, &mut p.r.host, &mut rc)
            };
            same(
                &mut p.seen,
                if swap_in { "swap_in" } else { "swap_out" },
                c,
                r,
                |&x| x as usize,
            );
            assert!(copies_eq(&cc, &rc), "swap plans differ");
        }
        11 => {
            let max = rng.random_range(0..4);
            let mut evicted = SENTINEL;
            // SAFETY: writable out-parameter.
            assert_eq!(
                unsafe { kvpage_manager_evict_cached(m, max, &mut evicted, null_mut()) },
                KVPAGE_OK
            );
            assert_eq!(evicted, p.r.m.evict_cached(max));
        }
        12 => {
            let ns = rng.random_range(0..2u64);
            let pre = &prefixes[rng.random_range(0..prefixes.len())];
            let mut hit = kvpage_prefix_hit::default();
            // SAFETY: buffers of the lengths passed.
            let r = unsafe {
                kvpage_manager_prefix_lookup(m, ns, pre.as_ptr(), pre.len(), &mut hit, null_mut())
            };
            assert_eq!(r, KVPAGE_OK);
            let want = p.r.m.prefix_lookup(ns, pre);
            assert_eq!(
                (hit.tokens, hit.idle_blocks),
                (want.tokens, want.idle_blocks)
            );
            assert_eq!(hit.tokens % bs, 0);
        }
        14 => {
            let mut edit_rng = std::mem::replace(&mut p.edit_rng, StdRng::seed_from_u64(0));
            edit_step(p, &mut edit_rng);
            p.edit_rng = edit_rng;
        }
        _ => {}
    }
}

/// One random retention operation on both managers, compared: a priority of a whole
/// sequence or a range (sometimes an invalid level), unpinning, a namespace quota.
fn retain_step(p: &mut Pair, rng: &mut StdRng) {
    let pick = |p: &Pair, rng: &mut StdRng| -> Option<(kvpage_seq, SeqId)> {
        if !p.dead.is_empty() && rng.random_ratio(1, 12) {
            return Some(p.dead[rng.random_range(0..p.dead.len())]);
        }
        (!p.live.is_empty()).then(|| p.live[rng.random_range(0..p.live.len())])
    };
    let m = p.c.m;
    match rng.random_range(0..3u32) {
        0 | 1 => {
            // A priority (sometimes out of range) of a whole sequence or a range of it.
            let Some((cs, rs)) = pick(p, rng) else { return };
            let level = [0u32, 1, 2, 4][rng.random_range(0..4usize)];
            let priority = kvpage_core::Priority::from_level(level as u8);
            let (first, end) = (rng.random_range(0..20u32), rng.random_range(0..30u32));
            let whole = rng.random_bool(0.5);
            // SAFETY: live manager.
            let c = ok(unsafe {
                match whole {
                    true => kvpage_manager_set_priority(m, cs, level, null_mut()),
                    false => {
                        kvpage_manager_set_range_priority(m, cs, first, end, level, null_mut())
                    }
                }
            });
            let Some(priority) = priority else {
                assert_eq!(c, Err(KVPAGE_ERR_INVALID_ARGUMENT));
                return;
            };
            let r = match whole {
                true => p.r.m.set_priority(rs, priority),
                false => p.r.m.set_range_priority(rs, first, end, priority),
            };
            same(&mut p.seen, "set priority", c, r, |_| ());
            // Pinned blocks left cached would fill the small pool: unpin them soon.
            if rng.random_ratio(1, 4) || p.r.m.pinned_blocks() > 4 {
                let mut n = 0;
                // SAFETY: live manager, writable out-parameter.
                assert_eq!(
                    unsafe { kvpage_manager_unpin_cached(m, &mut n, null_mut()) },
                    KVPAGE_OK
                );
                assert_eq!(n, p.r.m.unpin_cached());
            }
        }
        _ => {
            // Namespaces 2 and 3: no sequence lives there (a quota on the others would
            // change which prompts fit, and the run's prefix hits with them).
            let ns = rng.random_range(2..4u64);
            let (max, reserved) = (
                rng.random_range(0..40u32),
                u32::from(rng.random_ratio(1, 8)),
            );
            // SAFETY: live manager.
            let c = unsafe { kvpage_manager_set_namespace_quota(m, ns, max, reserved, null_mut()) };
            let quota = kvpage_core::NamespaceQuota {
                max_blocks: max,
                reserved_blocks: reserved,
            };
            let r = p.r.m.set_namespace_quota(ns, quota);
            assert_eq!(c == KVPAGE_OK, r.is_ok(), "{r:?}");
            assert!(r.is_ok() || c == KVPAGE_ERR_QUOTA_REFUSED);
            let mut held = 0;
            // SAFETY: live manager, writable out-parameter.
            assert_eq!(
                unsafe { kvpage_manager_namespace_blocks(m, ns, &mut held, null_mut()) },
                KVPAGE_OK
            );
            assert_eq!(held, p.r.m.namespace_blocks(ns));
        }
    }
}

/// One random edit on both managers (removal, context shift or range copy), compared:
/// results, block copies and row moves. A copy is released again at once.
fn edit_step(p: &mut Pair, rng: &mut StdRng) {
    let bs = p.r.m.config().block_size;
    let pick = |p: &Pair, rng: &mut StdRng| -> Option<(kvpage_seq, SeqId)> {
        (!p.live.is_empty()).then(|| p.live[rng.random_range(0..p.live.len())])
    };
    let short = |rng: &mut StdRng, n: usize| n.saturating_sub(usize::from(rng.random_ratio(1, 10)));
    let m = p.c.m;
    match rng.random_range(0..5u32) {
        0..=3 => {
            // Edits: removal or context shift; copies and moves as the Rust core's.
            let Some((c_id, r_id)) = pick(p, rng) else {
                return;
            };
            let len = p.r.m.len(r_id).unwrap_or(0);
            // Past the shared prompt prefixes (3 blocks): the runs' few prefix hits (which
            // the test counts on) stay as they were; the core's model tests edit anywhere.
            let first = rng.random_range(0..=len).max(len.min(3 * bs));
            let end = rng.random_range(first..=len + 1);
            let (n_copies, n_moves) = (short(rng, 8), short(rng, 20));
            let mut cc = vec![kvpage_block_copy::default(); n_copies];
            let mut cm = vec![kvpage_row_move::default(); n_moves];
            let mut rc = vec![BlockCopy { src: 0, dst: 0 }; n_copies];
            let mut rm = vec![RowMove::default(); n_moves];
            let (c, r, what) = if rng.random_bool(0.5) {
                let mut e = kvpage_edit::default();
                // SAFETY: buffers of the lengths passed, writable out-parameter.
                let c = ok(unsafe {
                    kvpage_manager_seq_rm(
                        m,
                        c_id,
                        first,
                        end,
                        cc.as_mut_ptr(),
                        cc.len(),
                        cm.as_mut_ptr(),
                        cm.len(),
                        &mut e,
                        null_mut(),
                    )
                })
                .map(|_| (e.copies, e.moves));
                let r = p.r.m.remove_range(r_id, first, end, &mut rc, &mut rm);
                (c, r.map(|e| (e.copies, e.moves)), "seq_rm")
            } else {
                let mut sh = kvpage_context_shift::default();
                // SAFETY: as above.
                let c = ok(unsafe {
                    kvpage_manager_context_shift(
                        m,
                        c_id,
                        first,
                        end - first,
                        cc.as_mut_ptr(),
                        cc.len(),
                        cm.as_mut_ptr(),
                        cm.len(),
                        &mut sh,
                        null_mut(),
                    )
                })
                .map(|_| (sh.copied_blocks, sh.row_moves));
                let r =
                    p.r.m
                        .context_shift(r_id, first, end - first, &mut rc, &mut rm);
                (
                    c,
                    r.map(|s| (s.edited.copies, s.edited.moves)),
                    "context_shift",
                )
            };
            if let Some((copies, moves)) = same(&mut p.seen, what, c, r, |&x| x) {
                assert!(copies_eq(&cc[..copies as usize], &rc[..copies as usize]));
                let moved = |m: &RowMove| (m.src_slot, m.dst_slot, m.count);
                let c_moves: Vec<_> = cm[..moves as usize]
                    .iter()
                    .map(|m| (m.src_slot, m.dst_slot, m.count))
                    .collect();
                let r_moves: Vec<_> = rm[..moves as usize].iter().map(moved).collect();
                assert_eq!(c_moves, r_moves, "row moves differ");
            }
        }
        _ => {
            let Some((c_id, r_id)) = pick(p, rng) else {
                return;
            };
            let len = p.r.m.len(r_id).unwrap_or(0);
            let first = rng.random_range(0..=len);
            let end = rng.random_range(first..=len);
            let n_moves = short(rng, 20);
            let mut cm = vec![kvpage_row_move::default(); n_moves];
            let mut rm = vec![RowMove::default(); n_moves];
            let (mut s, mut n) = (KVPAGE_SEQ_NONE, usize::MAX);
            // SAFETY: buffers of the lengths passed, writable out-parameters.
            let c = ok(unsafe {
                kvpage_manager_seq_cp(
                    m,
                    c_id,
                    first,
                    end,
                    0,
                    cm.as_mut_ptr(),
                    cm.len(),
                    &mut s,
                    &mut n,
                    null_mut(),
                )
            })
            .map(|_| n);
            let r = p.r.m.copy_range(r_id, first, end, 0, &mut rm);
            if same(&mut p.seen, "seq_cp", c, r, |c| c.edited.moves as usize).is_some() {
                let c_moves: Vec<_> = cm[..n]
                    .iter()
                    .map(|m| (m.src_slot, m.dst_slot, m.count))
                    .collect();
                let r_moves: Vec<_> = rm[..n]
                    .iter()
                    .map(|m| (m.src_slot, m.dst_slot, m.count))
                    .collect();
                assert_eq!(c_moves, r_moves, "row moves differ");
                // SAFETY: live manager.
                assert_eq!(
                    unsafe { kvpage_manager_release(m, s, null_mut()) },
                    KVPAGE_OK
                );
                p.r.m.release(r.unwrap().seq).unwrap();
            }
        }
    }
}

type Seen = std::collections::BTreeMap<String, u32>;

/// `ops` random operations on a C and a Rust manager, compared one by one; returns
/// the outcomes seen.
fn random_ops(seed: u64, block_size: u32, prefix_cache: bool, ops: usize) -> Seen {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut p = Pair::new(config(block_size, prefix_cache, 7));
    // Shared system prompts: prompts take a random prefix of one plus a random tail.
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            (0..3 * block_size + 5)
                .map(|_| rng.random_range(0..50))
                .collect()
        })
        .collect();
    for _ in 0..ops {
        step(&mut p, &mut rng, &prefixes);
        p.check();
    }
    if prefix_cache && !cfg!(miri) {
        assert!(
            p.r.m.stats().prefix_hit_tokens > 0,
            "no prefix hit in {ops} ops (seed {seed}, block size {block_size})"
        );
    }
    if std::env::var_os("KVPAGE_TEST_VERBOSE").is_some() {
        eprintln!(
            "seed {seed} bs {block_size} prefix {prefix_cache}: {:?}",
            p.seen
        );
    }
    p.seen
}

#[test]
fn the_c_manager_makes_the_rust_managers_slots_copies_and_plans() {
    let mut seen = Seen::new();
    // Under Miri (which checks the unsafe code of the C API on these calls) a short run.
    let (seeds, ops) = if cfg!(miri) { (1, 60) } else { (6, 400) };
    let shapes: &[(u32, bool)] = if cfg!(miri) {
        &[(4, true), (3, false)]
    } else {
        &[(4, true), (16, true), (3, true), (4, false)]
    };
    for seed in 0..seeds {
        for &(bs, prefix) in shapes {
            for (k, v) in random_ops(seed, bs, prefix, ops) {
                *seen.entry(k).or_default() += v;
            }
        }
    }
    if cfg!(miri) {
        return;
    }
    // The runs exercised every operation and every failure the manager can give.
    for what in [
        "create",
        "prompt",
        "append",
        "commit",
        "fork",
        "truncate",
        "release",
        "swap_in",
        "swap_out",
        "copy",
        "seq_rm",
        "context_shift",
        "seq_cp",
    ] {
        assert!(
            seen.get(what).copied().unwrap_or(0) > 10,
            "few {what}: {seen:?}"
        );
    }
    for code in [
        "STALE_SEQ",
        "NO_FREE_SEQ",
        "OUT_OF_BLOCKS",
        "BUFFER_TOO_SMALL",
        "SEQ_SWAPPED",
        "SEQ_NOT_SWAPPED",
        "SEQ_TOO_LONG",
        "HOST_FULL",
        "BEYOND_LENGTH",
    ] {
        assert!(seen.keys().any(|k| k.contains(code)), "no {code}: {seen:?}");
    }
}

#[test]
fn last_page_len_follows_flashinfer_at_block_boundaries_and_for_empty_sequences() {
    let c = CManager::new(config(4, true, 1));
    let lens = [0u32, 1, 3, 4, 5, 8, 9, 0];
    let ids: Vec<_> = lens
        .iter()
        .map(|&n| {
            let s = c.create(0);
            if n > 0 {
                c.append(s, n);
            }
            s
        })
        .collect();
    let rows: Vec<_> = ids
        .iter()
        .map(|&s| (c.blocks(s).unwrap(), c.len(s).unwrap()))
        .collect();
    check_exports(&c, &ids, &rows, 4);
    let mut last = [SENTINEL; 8];
    let mut indptr = [SENTINEL; 9];
    let mut indices = [SENTINEL; 16];
    // SAFETY: buffers of the lengths passed.
    let r = unsafe {
        kvpage_manager_block_table_csr(
            c.m,
            ids.as_ptr(),
            ids.len(),
            indptr.as_mut_ptr(),
            indptr.len(),
            indices.as_mut_ptr(),
            indices.len(),
            last.as_mut_ptr(),
            last.len(),
            null_mut(),
        )
    };
    assert_eq!(r, KVPAGE_OK);
    assert_eq!(last, [0, 1, 3, 4, 1, 4, 1, 0]);
    assert_eq!(indptr, [0, 0, 1, 2, 3, 5, 7, 10, 10]);
    // A repeated id and an empty batch are fine.
    check_exports(
        &c,
        &[ids[4], ids[4]],
        &[rows[4].clone(), rows[4].clone()],
        4,
    );
    check_exports(&c, &[], &[], 4);
}

fn zeroed_error() -> kvpage_error {
    // SAFETY: all-zero is a valid kvpage_error (code 0 = KVPAGE_OK, empty message).
    unsafe { std::mem::zeroed() }
}

/// Runs `call` with an error struct; checks the code, that the manager's observable
/// state is unchanged, and returns the struct.
fn refused(
    c: &CManager,
    seqs: &[kvpage_seq],
    want: kvpage_result,
    call: impl FnOnce(*mut kvpage_error) -> kvpage_result,
) -> kvpage_error {
    let before = c.snapshot(seqs);
    let mut e = zeroed_error();
    let got = call(&mut e);
    assert_eq!(got, want);
    assert_eq!(e.code, want);
    assert_ne!(e.message[0], 0, "no message");
    assert_eq!(
        c.snapshot(seqs),
        before,
        "a failed call changed the manager"
    );
    e
}

#[test]
fn bad_configs_and_storage_are_refused_with_the_numbers() {
    let good = config(4, true, 1);
    let mut bytes = usize::MAX;
    let mut e = zeroed_error();
    // SAFETY: each pointer is null or valid.
    unsafe {
        assert_eq!(
            kvpage_manager_storage_size(null(), &mut bytes, &mut e),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            kvpage_manager_storage_size(&good, null_mut(), null_mut()),
            KVPAGE_ERR_NULL_POINTER
        );
        for bad in [
            kvpage_manager_config {
                num_blocks: 0,
                ..good
            },
            kvpage_manager_config {
                block_size: 0,
                ..good
            },
            kvpage_manager_config {
                max_seqs: 0,
                ..good
            },
            kvpage_manager_config {
                max_seqs: u32::MAX,
                max_blocks_per_seq: u32::MAX,
                block_size: u32::MAX,
                ..good
            },
        ] {
            assert_eq!(
                kvpage_manager_storage_size(&bad, &mut bytes, &mut e),
                KVPAGE_ERR_BAD_CONFIG,
                "{bad:?}"
            );
        }
    }
    assert_eq!(bytes, usize::MAX, "out-parameter written on failure");

    let needed = storage_bytes(&good);
    let mut storage = vec![0u64; needed.div_ceil(8) + 1];
    let sentinel = 0x10 as *mut kvpage_manager;
    let mut m = sentinel;
    let base = storage.as_mut_ptr();
    // SAFETY: every storage pointer is inside `storage` with the length passed.
    unsafe {
        let mp: *mut *mut kvpage_manager = &mut m;
        let init = |ptr: *mut u64, len: usize, e: &mut kvpage_error| {
            kvpage_manager_init(&good, ptr.cast(), len, mp, e)
        };
        assert_eq!(init(null_mut(), needed, &mut e), KVPAGE_ERR_NULL_POINTER);
        let odd = base.cast::<u8>().add(4).cast::<u64>();
        assert_eq!(init(odd, needed, &mut e), KVPAGE_ERR_MISALIGNED);
        assert_eq!(init(base, needed - 1, &mut e), KVPAGE_ERR_STORAGE_TOO_SMALL);
        assert_eq!((e.needed, e.available), (needed as u64, needed as u64 - 1));
        assert_eq!(init(base, 0, &mut e), KVPAGE_ERR_STORAGE_TOO_SMALL);
        assert_eq!((e.needed, e.available), (needed as u64, 0));
        let bad = kvpage_manager_config {
            num_blocks: 0,
            ..good
        };
        assert_eq!(
            kvpage_manager_init(&bad, base.cast(), needed, mp, &mut e),
            KVPAGE_ERR_BAD_CONFIG
        );
        assert_eq!(
            kvpage_manager_init(null(), base.cast(), needed, mp, &mut e),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            kvpage_manager_init(&good, base.cast(), needed, null_mut(), &mut e),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(*mp, sentinel, "out_manager written on failure");
        // Exactly `needed` bytes suffice.
        assert_eq!(init(base, needed, &mut e), KVPAGE_OK);
        assert_eq!((*mp).cast::<u64>(), base);
    }

    // Something that is not a manager (zeroed memory) and a null manager.
    let mut junk = vec![0u64; 64];
    let mut s = KVPAGE_SEQ_NONE;
    // SAFETY: `junk` is readable memory larger than a manager.
    unsafe {
        let jm = junk.as_mut_ptr().cast::<kvpage_manager>();
        assert_eq!(
            kvpage_manager_create(jm, 0, &mut s, &mut e),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
        assert_eq!(
            kvpage_manager_create(null_mut(), 0, &mut s, &mut e),
            KVPAGE_ERR_NULL_POINTER
        );
        let mut st = kvpage_stats::default();
        assert_eq!(
            kvpage_manager_stats(jm, &mut st, null_mut()),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
    }
    assert_eq!(s, KVPAGE_SEQ_NONE);
}

#[test]
fn bad_ids_and_short_buffers_change_nothing_and_the_manager_works_after() {
    let c = CManager::new(config(4, true, 1));
    let other = CManager::new(config(4, true, 2));
    let a = c.create(0);
    c.append(a, 6);
    let b = c.create(0);
    let gone = c.create(0);
    c.append(gone, 3);
    // SAFETY: live manager.
    assert_eq!(
        unsafe { kvpage_manager_release(c.m, gone, null_mut()) },
        KVPAGE_OK
    );
    let foreign = other.create(0);
    other.append(foreign, 5);
    let live = [a, b];
    let never = (99u64 << 32) | 5;

    // Stale, never-issued, foreign and "none" ids, through every kind of call.
    for bad in [gone, never, foreign, KVPAGE_SEQ_NONE, a ^ (1 << 40)] {
        let e = refused(&c, &live, KVPAGE_ERR_STALE_SEQ, |e| unsafe {
            // SAFETY: live manager, buffers of the lengths passed.
            let mut slots = [0u32; 2];
            let mut ap = kvpage_appended::default();
            kvpage_manager_append(c.m, bad, 2, slots.as_mut_ptr(), 2, &mut ap, e)
        });
        assert_eq!(e.value, 0);
        // SAFETY: as above.
        unsafe {
            refused(&c, &live, KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_manager_release(c.m, bad, e)
            });
            refused(&c, &live, KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_manager_truncate(c.m, bad, 0, e)
            });
            refused(&c, &live, KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_manager_commit(c.m, bad, 0, null_mut(), e)
            });
            let mut s = KVPAGE_SEQ_NONE;
            refused(&c, &live, KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_manager_fork(c.m, bad, &mut s, e)
            });
            let mut copies = [kvpage_block_copy::default(); 4];
            refused(&c, &live, KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_manager_swap_out(c.m, bad, copies.as_mut_ptr(), 4, null_mut(), e)
            });
            // A bad id anywhere in a batch fails the export, naming it, writing nothing.
            let ids = [a, bad, b];
            let (mut ip, mut ix, mut lp) = ([SENTINEL; 4], [SENTINEL; 8], [SENTINEL; 3]);
            let e = refused(&c, &live, KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_manager_block_table_csr(
                    c.m,
                    ids.as_ptr(),
                    3,
                    ip.as_mut_ptr(),
                    4,
                    ix.as_mut_ptr(),
                    8,
                    lp.as_mut_ptr(),
                    3,
                    e,
                )
            });
            assert_eq!(e.value, bad);
            assert!(ip.iter().chain(&ix).chain(&lp).all(|&x| x == SENTINEL));
            let mut t = [SENTINEL; 12];
            refused(&c, &live, KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_manager_block_table_dense(
                    c.m,
                    ids.as_ptr(),
                    3,
                    4,
                    0,
                    t.as_mut_ptr(),
                    12,
                    null_mut(),
                    0,
                    e,
                )
            });
            assert!(t.iter().all(|&x| x == SENTINEL));
        }
    }
    // Double release.
    // SAFETY: live manager.
    unsafe {
        refused(&c, &live, KVPAGE_ERR_STALE_SEQ, |e| {
            kvpage_manager_release(c.m, gone, e)
        });
    }

    // Short buffers and null pointers.
    // SAFETY: every buffer has the length passed (or is null with length 0 / refused).
    unsafe {
        let mut slots = [SENTINEL; 3];
        let mut ap = kvpage_appended::default();
        let e = refused(&c, &live, KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            kvpage_manager_append(c.m, a, 4, slots.as_mut_ptr(), 3, &mut ap, e)
        });
        assert_eq!((e.needed, e.available), (4, 3));
        refused(&c, &live, KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_manager_append(c.m, a, 1, null_mut(), 1, &mut ap, e)
        });
        refused(&c, &live, KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_manager_append(c.m, a, 1, slots.as_mut_ptr(), 3, null_mut(), e)
        });
        let tokens = [1u32, 2, 3, 4];
        refused(&c, &live, KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_manager_append_tokens(c.m, a, null(), 4, slots.as_mut_ptr(), 3, &mut ap, e)
        });
        let e = refused(&c, &live, KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            kvpage_manager_append_tokens(
                c.m,
                a,
                tokens.as_ptr(),
                4,
                slots.as_mut_ptr(),
                3,
                &mut ap,
                e,
            )
        });
        assert_eq!((e.needed, e.available), (4, 3));
        assert_eq!(slots, [SENTINEL; 3]);
        let odd = slots.as_mut_ptr().cast::<u8>().add(1).cast::<u32>();
        refused(&c, &live, KVPAGE_ERR_MISALIGNED, |e| {
            kvpage_manager_append(c.m, a, 1, odd, 1, &mut ap, e)
        });
        let mut start = kvpage_prompt_start::default();
        let prompt: Vec<u32> = (0..9).collect();
        let e = refused(&c, &live, KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            kvpage_manager_create_with_prompt(
                c.m,
                0,
                prompt.as_ptr(),
                9,
                slots.as_mut_ptr(),
                3,
                &mut start,
                e,
            )
        });
        assert_eq!((e.needed, e.available), (9, 3));
        refused(&c, &live, KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_manager_create_with_prompt(
                c.m,
                0,
                null(),
                9,
                slots.as_mut_ptr(),
                3,
                &mut start,
                e,
            )
        });
        let mut blocks = [SENTINEL; 1];
        let mut n = usize::MAX;
        let e = refused(&c, &live, KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            kvpage_manager_blocks(c.m, a, blocks.as_mut_ptr(), 1, &mut n, e)
        });
        assert_eq!((e.needed, e.available, n), (2, 1, usize::MAX));
        // Length 0 with NULL asks the size.
        let e = refused(&c, &live, KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            kvpage_manager_blocks(c.m, a, null_mut(), 0, &mut n, e)
        });
        assert_eq!(e.needed, 2);
        refused(&c, &live, KVPAGE_ERR_BEYOND_LENGTH, |e| {
            kvpage_manager_truncate(c.m, a, 7, e)
        });
        refused(&c, &live, KVPAGE_ERR_BEYOND_LENGTH, |e| {
            kvpage_manager_commit(c.m, a, 7, null_mut(), e)
        });

        // Exports: a = 2 blocks, b = 0 blocks.
        let ids = [a, b];
        let (mut ip, mut ix, mut lp) = ([SENTINEL; 3], [SENTINEL; 2], [SENTINEL; 2]);
        let (ipp, ixp, lpp) = (ip.as_mut_ptr(), ix.as_mut_ptr(), lp.as_mut_ptr());
        let csr = |ip_len: usize, ix_len: usize, lp_len: usize, e| {
            kvpage_manager_block_table_csr(
                c.m,
                ids.as_ptr(),
                2,
                ipp,
                ip_len,
                ixp,
                ix_len,
                lpp,
                lp_len,
                e,
            )
        };
        let e = refused(&c, &live, KVPAGE_ERR_BUFFER_TOO_SMALL, |e| csr(3, 1, 2, e));
        assert_eq!((e.needed, e.available), (2, 1));
        let e = refused(&c, &live, KVPAGE_ERR_BUFFER_TOO_SMALL, |e| csr(2, 2, 2, e));
        assert_eq!((e.needed, e.available), (3, 2));
        let e = refused(&c, &live, KVPAGE_ERR_BUFFER_TOO_SMALL, |e| csr(3, 2, 1, e));
        assert_eq!((e.needed, e.available), (2, 1));
        refused(&c, &live, KVPAGE_ERR_NULL_POINTER, |e| {
            // The pointers taken above: a fresh `as_mut_ptr` here would retag the
            // arrays and invalidate them (Miri's Stacked Borrows caught that).
            kvpage_manager_block_table_csr(c.m, null(), 2, ipp, 3, ixp, 2, lpp, 2, e)
        });
        assert!(ip.iter().chain(&ix).chain(&lp).all(|&x| x == SENTINEL));
        assert_eq!(csr(3, 2, 2, null_mut()), KVPAGE_OK);
        assert_eq!((ip, lp), ([0, 2, 2], [2, 0]));

        let mut t = [SENTINEL; 8];
        let mut lens = [SENTINEL; 2];
        let (tp, lensp) = (t.as_mut_ptr(), lens.as_mut_ptr());
        let dense = |stride: u32, t_len: usize, lens_len: usize, e| {
            kvpage_manager_block_table_dense(
                c.m,
                ids.as_ptr(),
                2,
                stride,
                7,
                tp,
                t_len,
                lensp,
                lens_len,
                e,
            )
        };
        let e = refused(&c, &live, KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            dense(1, 8, 2, e)
        });
        assert_eq!((e.needed, e.available), (2, 1));
        refused(&c, &live, KVPAGE_ERR_INVALID_ARGUMENT, |e| {
            dense(0, 8, 2, e)
        });
        let e = refused(&c, &live, KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            dense(4, 7, 2, e)
        });
        assert_eq!((e.needed, e.available), (8, 7));
        let e = refused(&c, &live, KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            dense(3, 8, 1, e)
        });
        assert_eq!((e.needed, e.available), (2, 1));
        assert!(t.iter().chain(&lens).all(|&x| x == SENTINEL));
        assert_eq!(dense(3, 8, 2, null_mut()), KVPAGE_OK);
        assert_eq!(&t[3..6], &[7, 7, 7]);
        assert_eq!(lens, [6, 0]);
        assert_eq!(t[6], SENTINEL);

        let mut table = null();
        refused(&c, &live, KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_manager_block_table(c.m, null_mut(), null_mut(), null_mut(), null_mut(), e)
        });
        assert_eq!(
            kvpage_manager_block_table(
                c.m,
                &mut table,
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut()
            ),
            KVPAGE_OK
        );
        assert!(!table.is_null());

        // Swaps: a short copy array, and a manager without a host tier.
        let mut copies = [kvpage_block_copy {
            src: SENTINEL,
            dst: SENTINEL,
        }; 1];
        let e = refused(&c, &live, KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            kvpage_manager_swap_out(c.m, a, copies.as_mut_ptr(), 1, null_mut(), e)
        });
        assert_eq!((e.needed, e.available), (2, 1));
        refused(&c, &live, KVPAGE_ERR_SEQ_NOT_SWAPPED, |e| {
            kvpage_manager_swap_in(c.m, a, copies.as_mut_ptr(), 1, null_mut(), e)
        });
        refused(&c, &live, KVPAGE_ERR_SEQ_NOT_SWAPPED, |e| {
            kvpage_manager_release_swapped(c.m, a, e)
        });
        assert_eq!(copies[0].src, SENTINEL);
        let no_host = CManager::new(kvpage_manager_config {
            host_blocks: 0,
            ..config(4, true, 3)
        });
        let s = no_host.create(0);
        no_host.append(s, 2);
        refused(&no_host, &[s], KVPAGE_ERR_NO_HOST_POOL, |e| {
            kvpage_manager_swap_out(no_host.m, s, copies.as_mut_ptr(), 1, null_mut(), e)
        });
        refused(&no_host, &[s], KVPAGE_ERR_NO_HOST_POOL, |e| {
            kvpage_manager_host_blocks(no_host.m, null_mut(), null_mut(), e)
        });
        let mut sw = 9;
        assert_eq!(
            kvpage_manager_is_swapped(no_host.m, s, &mut sw, null_mut()),
            KVPAGE_OK
        );
        assert_eq!(sw, 0);
    }

    // Out of sequences and out of blocks.
    let full = CManager::new(kvpage_manager_config {
        num_blocks: 2,
        max_seqs: 2,
        ..config(4, true, 4)
    });
    let x = full.create(0);
    let _y = full.create(0);
    // SAFETY: live manager, writable out-parameters and buffers.
    unsafe {
        let mut s = KVPAGE_SEQ_NONE;
        refused(&full, &[x], KVPAGE_ERR_NO_FREE_SEQ, |e| {
            kvpage_manager_create(full.m, 0, &mut s, e)
        });
        let mut slots = [0u32; 12];
        let mut ap = kvpage_appended::default();
        let e = refused(&full, &[x], KVPAGE_ERR_OUT_OF_BLOCKS, |e| {
            kvpage_manager_append(full.m, x, 12, slots.as_mut_ptr(), 12, &mut ap, e)
        });
        assert_eq!((e.needed, e.available), (3, 2));
        // SAFETY: the message is NUL-terminated.
        let msg = std::ffi::CStr::from_ptr(e.message.as_ptr());
        assert_eq!(msg.to_str().unwrap(), "out of blocks: need 3, 2 available");
    }

    // Everything still works: the same sequences grow, fork, export and release.
    let slots = c.append(a, 3);
    assert_eq!(slots.len(), 3);
    assert_eq!(c.len(a), Ok(9));
    let mut f = KVPAGE_SEQ_NONE;
    // SAFETY: live manager, writable out-parameters.
    unsafe {
        assert_eq!(kvpage_manager_fork(c.m, a, &mut f, null_mut()), KVPAGE_OK);
        let mut ap = kvpage_appended::default();
        let mut slot = [0u32; 1];
        assert_eq!(
            kvpage_manager_append(c.m, f, 1, slot.as_mut_ptr(), 1, &mut ap, null_mut()),
            KVPAGE_OK
        );
        assert_eq!(
            ap.has_copy, 1,
            "a fork appending into a shared partial block copies it"
        );
        assert_eq!(ap.copy.src, c.blocks(a).unwrap()[2]);
        assert_eq!(ap.copy.dst, c.blocks(f).unwrap()[2]);
    }
    let rows: Vec<_> = [a, b, f]
        .iter()
        .map(|&s| (c.blocks(s).unwrap(), c.len(s).unwrap()))
        .collect();
    check_exports(&c, &[a, b, f], &rows, 4);
    for s in [a, b, f] {
        // SAFETY: live manager.
        assert_eq!(
            unsafe { kvpage_manager_release(c.m, s, null_mut()) },
            KVPAGE_OK
        );
    }
    assert_eq!(c.stats().live_seqs, 0);
}

#[test]
fn nothing_allocates_after_init() {
    let c = CManager::new(config(4, true, 1));
    let prompt: Vec<u32> = (0..11).collect();
    let mut slots = [0u32; 16];
    let mut copies = [kvpage_block_copy::default(); 8];
    let (mut indptr, mut indices, mut last) = ([0u32; 4], [0u32; 16], [0u32; 3]);
    let mut table = [0u32; 3 * 12];
    let mut e = zeroed_error();
    let n = allocations(|| {
        // SAFETY: a live manager; every buffer has the length passed.
        unsafe {
            let mut f = 0;
            let mut start = kvpage_prompt_start::default();
            let mut ap = kvpage_appended::default();
            let m = c.m;
            assert_eq!(
                kvpage_manager_create_with_prompt(
                    m,
                    0,
                    prompt.as_ptr(),
                    11,
                    slots.as_mut_ptr(),
                    16,
                    &mut start,
                    &mut e
                ),
                KVPAGE_OK
            );
            let a = start.seq;
            assert_eq!(
                kvpage_manager_commit(m, a, 11, null_mut(), &mut e),
                KVPAGE_OK
            );
            assert_eq!(
                kvpage_manager_create_with_prompt(
                    m,
                    0,
                    prompt.as_ptr(),
                    11,
                    slots.as_mut_ptr(),
                    16,
                    &mut start,
                    &mut e
                ),
                KVPAGE_OK
            );
            let b = start.seq;
            assert_eq!(start.reused_tokens, 8);
            assert_eq!(kvpage_manager_fork(m, a, &mut f, &mut e), KVPAGE_OK);
            assert_eq!(
                kvpage_manager_append(m, f, 1, slots.as_mut_ptr(), 16, &mut ap, &mut e),
                KVPAGE_OK
            );
            assert_eq!(ap.has_copy, 1);
            assert_eq!(
                kvpage_manager_append_tokens(
                    m,
                    b,
                    prompt.as_ptr(),
                    5,
                    slots.as_mut_ptr(),
                    16,
                    &mut ap,
                    &mut e
                ),
                KVPAGE_OK
            );
            assert_eq!(kvpage_manager_truncate(m, b, 12, &mut e), KVPAGE_OK);
            let ids = [a, b, f];
            assert_eq!(
                kvpage_manager_block_table_csr(
                    m,
                    ids.as_ptr(),
                    3,
                    indptr.as_mut_ptr(),
                    4,
                    indices.as_mut_ptr(),
                    16,
                    last.as_mut_ptr(),
                    3,
                    &mut e
                ),
                KVPAGE_OK
            );
            assert_eq!(
                kvpage_manager_block_table_dense(
                    m,
                    ids.as_ptr(),
                    3,
                    12,
                    0,
                    table.as_mut_ptr(),
                    36,
                    null_mut(),
                    0,
                    &mut e
                ),
                KVPAGE_OK
            );
            assert_eq!(
                kvpage_manager_swap_out(m, b, copies.as_mut_ptr(), 8, null_mut(), &mut e),
                KVPAGE_OK
            );
            assert_eq!(
                kvpage_manager_swap_in(m, b, copies.as_mut_ptr(), 8, null_mut(), &mut e),
                KVPAGE_OK
            );
            // Edits, with their plans in the caller's arrays.
            let mut moves = [kvpage_row_move::default(); 16];
            let mut ed = kvpage_edit::default();
            let mut shift = kvpage_context_shift::default();
            let mut pos = 0i64;
            assert_eq!(
                kvpage_manager_seq_rm(
                    m,
                    b,
                    1,
                    3,
                    copies.as_mut_ptr(),
                    8,
                    moves.as_mut_ptr(),
                    16,
                    &mut ed,
                    &mut e
                ),
                KVPAGE_OK
            );
            assert!(ed.moves > 0);
            assert_eq!(
                kvpage_manager_context_shift(
                    m,
                    f,
                    4,
                    4,
                    copies.as_mut_ptr(),
                    8,
                    moves.as_mut_ptr(),
                    16,
                    &mut shift,
                    &mut e
                ),
                KVPAGE_OK
            );
            assert_eq!(kvpage_manager_seq_add(m, b, 1, 2, -1, &mut e), KVPAGE_OK);
            assert_eq!(
                kvpage_manager_seq_pos_max(m, b, &mut pos, &mut e),
                KVPAGE_OK
            );
            // Failures write their message into the caller's struct, allocating nothing.
            assert_eq!(
                kvpage_manager_seq_add(m, b, 1, 2, -5, &mut e),
                KVPAGE_ERR_BAD_POSITIONS
            );
            assert_eq!(
                kvpage_manager_append(m, b, 9, slots.as_mut_ptr(), 1, &mut ap, &mut e),
                KVPAGE_ERR_BUFFER_TOO_SMALL
            );
            assert_eq!(
                kvpage_manager_truncate(m, b, 99, &mut e),
                KVPAGE_ERR_BEYOND_LENGTH
            );
            for s in ids {
                assert_eq!(kvpage_manager_release(m, s, &mut e), KVPAGE_OK);
            }
            assert_eq!(kvpage_manager_release(m, a, &mut e), KVPAGE_ERR_STALE_SEQ);
            let mut st = kvpage_stats::default();
            assert_eq!(kvpage_manager_stats(m, &mut st, &mut e), KVPAGE_OK);
            assert_eq!(st.live_seqs, 0);
        }
    });
    assert_eq!(n, 0, "allocations after init");
    // The counter counts.
    assert_eq!(allocations(|| drop(std::hint::black_box(vec![0u8; 8]))), 1);
}
