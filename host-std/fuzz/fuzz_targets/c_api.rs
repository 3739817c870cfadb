//! Sequences of C API calls (`kvpage::ffi`) on a tier-1 cache and a tier-2 manager with
//! random arguments: null, short, long and misaligned buffers, null out-parameters,
//! garbage and stale ids, ids of the other tier, and pointers to garbage objects (any 8
//! readable bytes are checked safely by the magic word). Every call returns a code and
//! nothing crashes; no call reports `KVPAGE_ERR_INTERNAL` (a caught panic or a failed
//! internal check); on failure the `kvpage_error` holds the returned code, no
//! out-parameter or output buffer is written, and the objects are unchanged (stats and
//! the length of every id ever issued, compared before and after); on success the
//! `kvpage_error` is untouched.
#![no_main]

use std::ptr::{null, null_mut};

use arbitrary::{Arbitrary, Unstructured};
use kvpage::ffi::*;
use kvpage_result::*;
use libfuzzer_sys::fuzz_target;

/// A caller buffer for an array whose required length is known: null, exact, shorter,
/// longer, or misaligned (one byte past an aligned buffer of the exact length).
#[derive(Debug, Clone, Copy, Arbitrary)]
enum Buf {
    Null { len: u8 },
    Exact,
    Short(u8),
    Long(u8),
    Misaligned,
    Len(u8),
}

/// A buffer of `T` per a [`Buf`] choice: the storage (kept alive by the caller), the
/// pointer and the length passed.
struct Arg<T> {
    _store: Vec<u64>,
    ptr: *mut T,
    len: usize,
}

impl<T: Copy> Arg<T> {
    fn new(choice: Buf, exact: usize, fill: impl Fn(usize) -> T) -> Self {
        let len = match choice {
            Buf::Null { len } => {
                return Self {
                    _store: Vec::new(),
                    ptr: null_mut(),
                    len: usize::from(len % 3),
                }
            }
            Buf::Exact | Buf::Misaligned => exact,
            Buf::Short(k) => exact.saturating_sub(1 + usize::from(k % 4)),
            Buf::Long(k) => exact + 1 + usize::from(k % 4),
            Buf::Len(k) => usize::from(k % 64),
        };
        let size = core::mem::size_of::<T>();
        let mut store = vec![0u64; (len * size).div_ceil(8) + 1];
        let base = store.as_mut_ptr() as *mut u8;
        // SAFETY: `store` holds `len * size + 8` bytes, 8-aligned (T's alignment is at
        // most 8 here); the misaligned view starts 1 byte in and holds `len` elements.
        unsafe {
            let ptr = if matches!(choice, Buf::Misaligned) && core::mem::align_of::<T>() > 1 {
                base.add(1) as *mut T
            } else {
                base as *mut T
            };
            if ptr.is_aligned() {
                for i in 0..len {
                    ptr.add(i).write(fill(i));
                }
            }
            Self {
                _store: store,
                ptr,
                len,
            }
        }
    }

    /// The contents, when aligned (a misaligned buffer is never written by the library).
    fn contents(&self) -> Vec<T> {
        if self.ptr.is_null() || !self.ptr.is_aligned() {
            return Vec::new();
        }
        // SAFETY: `len` initialised elements at an aligned `ptr` (see `new`).
        unsafe { core::slice::from_raw_parts(self.ptr, self.len).to_vec() }
    }
}

/// An id argument: one issued by this object (possibly released since), one issued by
/// the other tier, or a garbage value.
#[derive(Debug, Clone, Copy, Arbitrary)]
enum Id {
    Issued(u8),
    OtherTier(u8),
    Garbage(u64),
    None,
}

#[derive(Debug, Clone, Copy, Arbitrary)]
struct Outs {
    /// Pass NULL for the (first) out-parameter.
    null_out: bool,
    /// Pass NULL for `err`.
    null_err: bool,
}

#[derive(Debug, Arbitrary)]
enum Call {
    CacheStats,
    CacheGeometry,
    CacheEvict {
        n: u8,
    },
    CacheCreate {
        ns: u8,
    },
    CacheCreatePrompt {
        ns: u8,
        prompt: Buf,
        len: u8,
    },
    CacheAppendTokens {
        id: Id,
        tokens: Buf,
        len: u8,
    },
    CacheAppend {
        id: Id,
        n: u32,
    },
    CacheCommit {
        id: Id,
    },
    CacheFork {
        id: Id,
    },
    CacheTruncate {
        id: Id,
        to: u32,
    },
    CacheRelease {
        id: Id,
    },
    CacheLen {
        id: Id,
    },
    CacheWriteKv {
        id: Id,
        layer: u8,
        first: u8,
        n: u8,
        k: Buf,
        v: Buf,
    },
    CacheWriteKvRaw {
        id: Id,
        layer: u8,
        first: u8,
        n: u8,
        dtype: u8,
        k: Buf,
        v: Buf,
    },
    CacheDecode {
        layer: u8,
        seqs: Buf,
        ids: [Id; 3],
        q: Buf,
        out: Buf,
        q_heads: u8,
        scale: u8,
    },
    CachePrefill {
        layer: u8,
        seqs: Buf,
        ids: [Id; 3],
        counts: Buf,
        n: [u8; 3],
        q: Buf,
        out: Buf,
        q_heads: u8,
    },
    MgrAvailable,
    MgrEvict {
        n: u8,
    },
    MgrStats,
    MgrCreate {
        ns: u8,
    },
    MgrCreatePrompt {
        ns: u8,
        prompt: Buf,
        len: u8,
        slots: Buf,
    },
    MgrAppend {
        id: Id,
        n: u8,
        slots: Buf,
    },
    MgrAppendTokens {
        id: Id,
        tokens: Buf,
        len: u8,
        slots: Buf,
    },
    MgrCommit {
        id: Id,
        upto: u32,
    },
    MgrFork {
        id: Id,
    },
    MgrTruncate {
        id: Id,
        to: u32,
    },
    MgrRelease {
        id: Id,
    },
    MgrLen {
        id: Id,
    },
    MgrBlocks {
        id: Id,
        out: Buf,
    },
    MgrPrefixLookup {
        ns: u8,
        prompt: Buf,
        len: u8,
    },
    MgrSwapOut {
        id: Id,
        copies: Buf,
    },
    MgrSwapIn {
        id: Id,
        copies: Buf,
    },
    MgrReleaseSwapped {
        id: Id,
    },
    MgrIsSwapped {
        id: Id,
    },
    MgrHostBlocks,
    MgrDense {
        seqs: Buf,
        ids: [Id; 3],
        stride: u8,
        table: Buf,
        lens: Buf,
    },
    MgrCsr {
        seqs: Buf,
        ids: [Id; 3],
        indptr: Buf,
        indices: Buf,
        last: Buf,
    },
    MgrTable,
    MgrSeqRow {
        id: Id,
    },
    Garbage {
        kind: u8,
        word: u64,
    },
    ResultStr {
        code: u32,
    },
    CacheSetKvScales {
        layer: u8,
        k: u8,
        v: u8,
    },
    CacheClearKvScales {
        layer: u8,
    },
    CacheKvScales {
        layer: u8,
    },
    CacheEventsDrain {
        events: Buf,
        tokens: Buf,
    },
}

#[derive(Debug, Arbitrary)]
struct Setup {
    layers: u8,
    kv_heads: u8,
    head_dim: u8,
    block_size: u8,
    dtype: u8,
    blocks: u8,
    max_seqs: u8,
    max_seq_len: u8,
    null_params: bool,
    mgr_blocks: u8,
    mgr_block_size: u8,
    mgr_seqs: u8,
    mgr_bps: u8,
    prefix_cache: bool,
    host_blocks: u8,
    storage: Buf,
}

fn new_err() -> kvpage_error {
    // SAFETY: every field of `kvpage_error` (a code whose 0 is KVPAGE_OK, integers, a
    // char array) accepts all-zero bytes.
    let mut e: kvpage_error = unsafe { core::mem::zeroed() };
    // A code no function returns on success: it must stay on success.
    e.code = KVPAGE_ERR_OUT_OF_RANGE;
    e
}

/// Cache stats, (code, length) of every cache id, manager stats, the same for every
/// manager id, and the host tier's (free, total) blocks.
type Snapshot = (
    Option<kvpage_stats>,
    Vec<(u32, u32)>,
    Option<kvpage_stats>,
    Vec<(u32, u32)>,
    (u32, u32),
    // Each layer's K/V scales setting (bits), as `kvpage_cache_kv_scales` reads it.
    Vec<(u32, u32, u32)>,
);

struct World {
    cache: *mut kvpage_cache,
    cache_ids: Vec<u64>,
    mgr: *mut kvpage_manager,
    _mgr_storage: Vec<u64>,
    mgr_ids: Vec<u64>,
    garbage: Vec<u64>,
}

impl World {
    fn id(&self, id: Id, mine: &[u64], other: &[u64]) -> u64 {
        let pick = |v: &[u64], k: u8| {
            if v.is_empty() {
                0
            } else {
                v[k as usize % v.len()]
            }
        };
        match id {
            Id::Issued(k) => pick(mine, k),
            Id::OtherTier(k) => pick(other, k),
            Id::Garbage(x) => x,
            Id::None => KVPAGE_SEQ_NONE,
        }
    }
    fn cid(&self, id: Id) -> u64 {
        self.id(id, &self.cache_ids, &self.mgr_ids)
    }
    fn mid(&self, id: Id) -> u64 {
        self.id(id, &self.mgr_ids, &self.cache_ids)
    }

    /// Everything a failed call must leave unchanged.
    fn snapshot(&self) -> Snapshot {
        // SAFETY: the objects are live (or null); out-parameters are locals.
        unsafe {
            let mut cs = kvpage_stats::default();
            let cs =
                (kvpage_cache_stats(self.cache, &mut cs, null_mut()) == KVPAGE_OK).then_some(cs);
            let clens = self
                .cache_ids
                .iter()
                .map(|&s| {
                    let mut l = u32::MAX;
                    (
                        kvpage_cache_len(self.cache, s, &mut l, null_mut()) as u32,
                        l,
                    )
                })
                .collect();
            let mut ms = kvpage_stats::default();
            let ms =
                (kvpage_manager_stats(self.mgr, &mut ms, null_mut()) == KVPAGE_OK).then_some(ms);
            let mlens = self
                .mgr_ids
                .iter()
                .map(|&s| {
                    let mut l = u32::MAX;
                    (
                        kvpage_manager_len(self.mgr, s, &mut l, null_mut()) as u32,
                        l,
                    )
                })
                .collect();
            let (mut f, mut t) = (0, 0);
            kvpage_manager_host_blocks(self.mgr, &mut f, &mut t, null_mut());
            let scales = (0..MAX_LAYERS)
                .map(|layer| {
                    let (mut k, mut v) = (f32::NAN, f32::NAN);
                    let c = kvpage_cache_kv_scales(self.cache, layer, &mut k, &mut v, null_mut());
                    (c as u32, k.to_bits(), v.to_bits())
                })
                .collect();
            (cs, clens, ms, mlens, (f, t), scales)
        }
    }
}

/// Layers a fuzzed cache can have (`Setup::layers % 3`), and one past.
const MAX_LAYERS: u32 = 3;

/// A fixed K/V scale to pass: valid ones (tiny, ordinary, huge) and refused ones.
fn kv_scale(x: u8) -> f32 {
    [
        0.01,
        1.0,
        1e30,
        f32::from_bits(1),
        0.0,
        -0.5,
        f32::NAN,
        f32::INFINITY,
    ][usize::from(x % 8)]
}

fn scale(x: u8) -> f32 {
    [0.5, f32::NAN, f32::INFINITY, 0.0][usize::from(x % 4)]
}

const SENT32: u32 = 0xDEAD_BEEF;
const SENT64: u64 = 0xDEAD_BEEF_F00D_CAFE;

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(s) = Setup::arbitrary(&mut u) else {
        return;
    };
    // SAFETY: every pointer passed below is null, a local, or an `Arg` buffer kept alive
    // for the call with its true length; object pointers are null, live objects, or
    // 8-aligned garbage words that are not the magic of any object.
    unsafe {
        let geometry = kvpage_geometry {
            layers: u32::from(s.layers % 3),
            kv_heads: u32::from(s.kv_heads % 3),
            head_dim: if s.head_dim == 255 {
                300
            } else {
                u32::from(s.head_dim % 9)
            },
            block_size: u32::from(s.block_size % 5),
            dtype: u32::from(s.dtype % 5),
        };
        let mut params = kvpage_cache_default_params(geometry);
        params.capacity_blocks = u32::from(s.blocks % 20);
        params.capacity_bytes = 0;
        params.max_seqs = u32::from(s.max_seqs % 5);
        params.max_seq_len = u32::from(s.max_seq_len % 40);
        params.threads = 1;
        params.event_capacity = u32::from(s.blocks % 7);
        let mut cache: *mut kvpage_cache = null_mut();
        let pp = if s.null_params {
            null()
        } else {
            &params as *const _
        };
        let code = kvpage_cache_new(pp, &mut cache, null_mut());
        assert_ne!(code, KVPAGE_ERR_INTERNAL);
        assert_eq!(code == KVPAGE_OK, !cache.is_null());

        let config = kvpage_manager_config {
            num_blocks: u32::from(s.mgr_blocks % 24),
            block_size: u32::from(s.mgr_block_size % 5),
            max_seqs: u32::from(s.mgr_seqs % 6),
            max_blocks_per_seq: u32::from(s.mgr_bps % 9),
            instance: 77,
            prefix_cache: u32::from(s.prefix_cache),
            hash_key: 5,
            host_blocks: u32::from(s.host_blocks % 12),
            max_namespaces: 0,
        };
        let mut bytes = usize::MAX;
        let code = kvpage_manager_storage_size(&config, &mut bytes, null_mut());
        assert_ne!(code, KVPAGE_ERR_INTERNAL);
        let mut mgr: *mut kvpage_manager = null_mut();
        let mut storage = Vec::new();
        if code == KVPAGE_OK {
            let arg = Arg::<u8>::new(s.storage, bytes, |_| 0xAB);
            let mut e = new_err();
            let code = kvpage_manager_init(&config, arg.ptr.cast(), arg.len, &mut mgr, &mut e);
            assert_ne!(code, KVPAGE_ERR_INTERNAL);
            assert_eq!(code == KVPAGE_OK, !mgr.is_null());
            if code != KVPAGE_OK {
                assert_eq!(e.code, code);
            }
            storage = arg._store;
        } else {
            assert_eq!(bytes, usize::MAX, "storage size written on failure");
        }
        let mut w = World {
            cache,
            cache_ids: Vec::new(),
            mgr,
            _mgr_storage: storage,
            mgr_ids: Vec::new(),
            garbage: vec![0u64; 4],
        };
        let hd = geometry.head_dim as usize;
        let row = (geometry.kv_heads * geometry.head_dim) as usize;
        let mut calls = 0;
        while !u.is_empty() && calls < 64 {
            calls += 1;
            let Ok(call) = Call::arbitrary(&mut u) else {
                break;
            };
            let Ok(outs) = Outs::arbitrary(&mut u) else {
                break;
            };
            let before = w.snapshot();
            let mut e = new_err();
            let err = if outs.null_err {
                null_mut()
            } else {
                &mut e as *mut kvpage_error
            };
            // Out-parameters start as sentinels; `unwritten` collects whether each one
            // still holds it after the call (checked on failure).
            let mut unwritten: Vec<bool> = Vec::new();
            macro_rules! out {
                ($t:ty, $sent:expr) => {{
                    let v: $t = $sent;
                    v
                }};
            }
            macro_rules! optr {
                ($v:ident) => {
                    if outs.null_out {
                        null_mut()
                    } else {
                        &mut $v as *mut _
                    }
                };
            }
            let code: kvpage_result = match call {
                Call::CacheStats => {
                    let mut o = out!(
                        kvpage_stats,
                        kvpage_stats {
                            total_blocks: SENT32,
                            ..Default::default()
                        }
                    );
                    let c = kvpage_cache_stats(w.cache, optr!(o), err);
                    unwritten.push(o.total_blocks == SENT32);
                    if c == KVPAGE_OK {
                        assert_eq!(
                            o.free_blocks + o.cached_blocks + o.used_blocks,
                            o.total_blocks
                        );
                    }
                    c
                }
                Call::CacheGeometry => {
                    let mut o = kvpage_geometry {
                        layers: SENT32,
                        kv_heads: 0,
                        head_dim: 0,
                        block_size: 0,
                        dtype: 0,
                    };
                    let c = kvpage_cache_geometry(w.cache, optr!(o), err);
                    unwritten.push(o.layers == SENT32);
                    if c == KVPAGE_OK {
                        assert_eq!(o, geometry);
                    }
                    c
                }
                Call::CacheEvict { n } => {
                    let mut o = SENT32;
                    let c = kvpage_cache_evict_cached(w.cache, u32::from(n), optr!(o), err);
                    unwritten.push(o == SENT32);
                    c
                }
                Call::CacheCreate { ns } => {
                    let mut o = SENT64;
                    let c = kvpage_cache_create(w.cache, u64::from(ns % 2), optr!(o), err);
                    unwritten.push(o == SENT64);
                    if c == KVPAGE_OK {
                        w.cache_ids.push(o);
                    }
                    c
                }
                Call::CacheCreatePrompt { ns, prompt, len } => {
                    let p = Arg::<u32>::new(prompt, usize::from(len % 48), |i| (i % 5) as u32);
                    let (mut o, mut r) = (SENT64, SENT32);
                    let c = kvpage_cache_create_with_prompt(
                        w.cache,
                        u64::from(ns % 2),
                        p.ptr,
                        p.len,
                        optr!(o),
                        &mut r,
                        err,
                    );
                    unwritten.push(o == SENT64 && r == SENT32);
                    if c == KVPAGE_OK {
                        w.cache_ids.push(o);
                    }
                    c
                }
                Call::CacheAppendTokens { id, tokens, len } => {
                    let t = Arg::<u32>::new(tokens, usize::from(len % 20), |i| (i % 5) as u32);
                    kvpage_cache_append_tokens(w.cache, w.cid(id), t.ptr, t.len, err)
                }
                Call::CacheAppend { id, n } => kvpage_cache_append(w.cache, w.cid(id), n, err),
                Call::CacheCommit { id } => {
                    let mut o = SENT32;
                    let c = kvpage_cache_commit(w.cache, w.cid(id), optr!(o), err);
                    unwritten.push(o == SENT32);
                    c
                }
                Call::CacheFork { id } => {
                    let mut o = SENT64;
                    let c = kvpage_cache_fork(w.cache, w.cid(id), optr!(o), err);
                    unwritten.push(o == SENT64);
                    if c == KVPAGE_OK {
                        w.cache_ids.push(o);
                    }
                    c
                }
                Call::CacheTruncate { id, to } => {
                    kvpage_cache_truncate(w.cache, w.cid(id), to % 64, err)
                }
                Call::CacheRelease { id } => kvpage_cache_release(w.cache, w.cid(id), err),
                Call::CacheLen { id } => {
                    let mut o = SENT32;
                    let c = kvpage_cache_len(w.cache, w.cid(id), optr!(o), err);
                    unwritten.push(o == SENT32);
                    c
                }
                Call::CacheWriteKv {
                    id,
                    layer,
                    first,
                    n,
                    k,
                    v,
                } => {
                    let n = u32::from(n % 12);
                    let exact = n as usize * row;
                    let k = Arg::<f32>::new(k, exact, |i| i as f32);
                    let v = Arg::<f32>::new(v, exact, |i| -(i as f32));
                    kvpage_cache_write_kv(
                        w.cache,
                        w.cid(id),
                        u32::from(layer % 4),
                        u32::from(first % 48),
                        n,
                        k.ptr,
                        k.len,
                        v.ptr,
                        v.len,
                        err,
                    )
                }
                Call::CacheWriteKvRaw {
                    id,
                    layer,
                    first,
                    n,
                    dtype,
                    k,
                    v,
                } => {
                    let n = u32::from(n % 12);
                    let exact = n as usize * row;
                    let dtype = u32::from(dtype % 4);
                    // Elements of the call's dtype (f32 or 16-bit; an unknown dtype is
                    // refused before any read).
                    if dtype == 0 {
                        let k = Arg::<f32>::new(k, exact, |i| i as f32);
                        let v = Arg::<f32>::new(v, exact, |i| i as f32);
                        kvpage_cache_write_kv_raw(
                            w.cache,
                            w.cid(id),
                            u32::from(layer % 4),
                            u32::from(first % 48),
                            n,
                            dtype,
                            k.ptr.cast(),
                            k.len,
                            v.ptr.cast(),
                            v.len,
                            err,
                        )
                    } else {
                        let k = Arg::<u16>::new(k, exact, |i| i as u16);
                        let v = Arg::<u16>::new(v, exact, |i| i as u16);
                        kvpage_cache_write_kv_raw(
                            w.cache,
                            w.cid(id),
                            u32::from(layer % 4),
                            u32::from(first % 48),
                            n,
                            dtype,
                            k.ptr.cast(),
                            k.len,
                            v.ptr.cast(),
                            v.len,
                            err,
                        )
                    }
                }
                Call::CacheDecode {
                    layer,
                    seqs,
                    ids,
                    q,
                    out,
                    q_heads,
                    scale: sc,
                } => {
                    let ids: Vec<u64> = ids.iter().map(|&i| w.cid(i)).collect();
                    let sq = Arg::<u64>::new(seqs, 2, |i| ids[i % 3]);
                    let q_heads = u32::from(q_heads % 7);
                    let exact = sq.len * q_heads as usize * hd;
                    let qb = Arg::<f32>::new(q, exact, |i| (i % 3) as f32);
                    let ob = Arg::<f32>::new(out, exact, |_| f32::from_bits(SENT32));
                    let before_out = ob.contents();
                    let c = kvpage_cache_decode(
                        w.cache,
                        u32::from(layer % 4),
                        sq.ptr,
                        sq.len,
                        qb.ptr,
                        qb.len,
                        ob.ptr,
                        ob.len,
                        q_heads,
                        scale(sc),
                        err,
                    );
                    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    unwritten.push(bits(ob.contents()) == bits(before_out));
                    c
                }
                Call::CachePrefill {
                    layer,
                    seqs,
                    ids,
                    counts,
                    n,
                    q,
                    out,
                    q_heads,
                } => {
                    let ids: Vec<u64> = ids.iter().map(|&i| w.cid(i)).collect();
                    let sq = Arg::<u64>::new(seqs, 2, |i| ids[i % 3]);
                    // The counts array has `n_seqs` entries like `seqs` (a shorter one
                    // would break the caller's side of the contract): null or not.
                    let counts = match counts {
                        Buf::Null { len } => Buf::Null { len },
                        Buf::Misaligned => Buf::Misaligned,
                        _ => Buf::Exact,
                    };
                    let cn = Arg::<u32>::new(counts, sq.len, |i| u32::from(n[i % 3] % 6));
                    let q_heads = u32::from(q_heads % 7);
                    let tokens: usize = cn.contents().iter().map(|&x| x as usize).sum();
                    let exact = tokens * q_heads as usize * hd;
                    let qb = Arg::<f32>::new(q, exact, |i| (i % 3) as f32);
                    let ob = Arg::<f32>::new(out, exact, |_| f32::from_bits(SENT32));
                    let before_out = ob.contents();
                    let c = kvpage_cache_prefill(
                        w.cache,
                        u32::from(layer % 4),
                        sq.ptr,
                        cn.ptr,
                        sq.len,
                        qb.ptr,
                        qb.len,
                        ob.ptr,
                        ob.len,
                        q_heads,
                        0.5,
                        err,
                    );
                    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    unwritten.push(bits(ob.contents()) == bits(before_out));
                    c
                }
                Call::MgrAvailable => {
                    let mut o = SENT32;
                    let c = kvpage_manager_available_blocks(w.mgr, optr!(o), err);
                    unwritten.push(o == SENT32);
                    c
                }
                Call::MgrEvict { n } => {
                    let mut o = SENT32;
                    let c = kvpage_manager_evict_cached(w.mgr, u32::from(n), optr!(o), err);
                    unwritten.push(o == SENT32);
                    c
                }
                Call::MgrStats => {
                    let mut o = kvpage_stats {
                        total_blocks: SENT32,
                        ..Default::default()
                    };
                    let c = kvpage_manager_stats(w.mgr, optr!(o), err);
                    unwritten.push(o.total_blocks == SENT32);
                    c
                }
                Call::MgrCreate { ns } => {
                    let mut o = SENT64;
                    let c = kvpage_manager_create(w.mgr, u64::from(ns % 2), optr!(o), err);
                    unwritten.push(o == SENT64);
                    if c == KVPAGE_OK {
                        w.mgr_ids.push(o);
                    }
                    c
                }
                Call::MgrCreatePrompt {
                    ns,
                    prompt,
                    len,
                    slots,
                } => {
                    let p = Arg::<u32>::new(prompt, usize::from(len % 40), |i| (i % 5) as u32);
                    let sl = Arg::<u32>::new(slots, p.len, |_| SENT32);
                    let before_slots = sl.contents();
                    let mut o = kvpage_prompt_start {
                        seq: SENT64,
                        ..Default::default()
                    };
                    let c = kvpage_manager_create_with_prompt(
                        w.mgr,
                        u64::from(ns % 2),
                        p.ptr,
                        p.len,
                        sl.ptr,
                        sl.len,
                        optr!(o),
                        err,
                    );
                    unwritten.push(o.seq == SENT64 && sl.contents() == before_slots);
                    if c == KVPAGE_OK {
                        w.mgr_ids.push(o.seq);
                    }
                    c
                }
                Call::MgrAppend { id, n, slots } => {
                    let n = u32::from(n % 16);
                    let sl = Arg::<u32>::new(slots, n as usize, |_| SENT32);
                    let before_slots = sl.contents();
                    let mut o = kvpage_appended {
                        new_blocks: SENT32,
                        ..Default::default()
                    };
                    let c =
                        kvpage_manager_append(w.mgr, w.mid(id), n, sl.ptr, sl.len, optr!(o), err);
                    unwritten.push(o.new_blocks == SENT32 && sl.contents() == before_slots);
                    c
                }
                Call::MgrAppendTokens {
                    id,
                    tokens,
                    len,
                    slots,
                } => {
                    let t = Arg::<u32>::new(tokens, usize::from(len % 16), |i| (i % 5) as u32);
                    let sl = Arg::<u32>::new(slots, t.len, |_| SENT32);
                    let before_slots = sl.contents();
                    let mut o = kvpage_appended {
                        new_blocks: SENT32,
                        ..Default::default()
                    };
                    let c = kvpage_manager_append_tokens(
                        w.mgr,
                        w.mid(id),
                        t.ptr,
                        t.len,
                        sl.ptr,
                        sl.len,
                        optr!(o),
                        err,
                    );
                    unwritten.push(o.new_blocks == SENT32 && sl.contents() == before_slots);
                    c
                }
                Call::MgrCommit { id, upto } => {
                    let mut o = SENT32;
                    let c = kvpage_manager_commit(w.mgr, w.mid(id), upto % 80, optr!(o), err);
                    unwritten.push(o == SENT32);
                    c
                }
                Call::MgrFork { id } => {
                    let mut o = SENT64;
                    let c = kvpage_manager_fork(w.mgr, w.mid(id), optr!(o), err);
                    unwritten.push(o == SENT64);
                    if c == KVPAGE_OK {
                        w.mgr_ids.push(o);
                    }
                    c
                }
                Call::MgrTruncate { id, to } => {
                    kvpage_manager_truncate(w.mgr, w.mid(id), to % 80, err)
                }
                Call::MgrRelease { id } => kvpage_manager_release(w.mgr, w.mid(id), err),
                Call::MgrLen { id } => {
                    let mut o = SENT32;
                    let c = kvpage_manager_len(w.mgr, w.mid(id), optr!(o), err);
                    unwritten.push(o == SENT32);
                    c
                }
                Call::MgrBlocks { id, out } => {
                    let ob = Arg::<u32>::new(out, 4, |_| SENT32);
                    let before_out = ob.contents();
                    let mut n = usize::MAX;
                    let c = kvpage_manager_blocks(w.mgr, w.mid(id), ob.ptr, ob.len, optr!(n), err);
                    unwritten.push(n == usize::MAX && ob.contents() == before_out);
                    c
                }
                Call::MgrPrefixLookup { ns, prompt, len } => {
                    let p = Arg::<u32>::new(prompt, usize::from(len % 40), |i| (i % 5) as u32);
                    let mut o = kvpage_prefix_hit {
                        tokens: SENT32,
                        ..Default::default()
                    };
                    let c = kvpage_manager_prefix_lookup(
                        w.mgr,
                        u64::from(ns % 2),
                        p.ptr,
                        p.len,
                        optr!(o),
                        err,
                    );
                    unwritten.push(o.tokens == SENT32);
                    c
                }
                Call::MgrSwapOut { id, copies } | Call::MgrSwapIn { id, copies } => {
                    let cb = Arg::<kvpage_block_copy>::new(copies, 4, |_| kvpage_block_copy {
                        src: SENT32,
                        dst: SENT32,
                    });
                    let before_out = cb.contents();
                    let mut n = usize::MAX;
                    let c = if matches!(call, Call::MgrSwapOut { .. }) {
                        kvpage_manager_swap_out(w.mgr, w.mid(id), cb.ptr, cb.len, optr!(n), err)
                    } else {
                        kvpage_manager_swap_in(w.mgr, w.mid(id), cb.ptr, cb.len, optr!(n), err)
                    };
                    unwritten.push(n == usize::MAX && cb.contents() == before_out);
                    c
                }
                Call::MgrReleaseSwapped { id } => {
                    kvpage_manager_release_swapped(w.mgr, w.mid(id), err)
                }
                Call::MgrIsSwapped { id } => {
                    let mut o = SENT32;
                    let c = kvpage_manager_is_swapped(w.mgr, w.mid(id), optr!(o), err);
                    unwritten.push(o == SENT32);
                    c
                }
                Call::MgrHostBlocks => {
                    let (mut f, mut t) = (SENT32, SENT32);
                    let c = kvpage_manager_host_blocks(w.mgr, optr!(f), &mut t, err);
                    unwritten.push(f == SENT32 && t == SENT32);
                    c
                }
                Call::MgrDense {
                    seqs,
                    ids,
                    stride,
                    table,
                    lens,
                } => {
                    let ids: Vec<u64> = ids.iter().map(|&i| w.mid(i)).collect();
                    let sq = Arg::<u64>::new(seqs, 2, |i| ids[i % 3]);
                    let stride = u32::from(stride % 10);
                    let tb = Arg::<u32>::new(table, sq.len * stride as usize, |_| SENT32);
                    let lb = Arg::<u32>::new(lens, sq.len, |_| SENT32);
                    let (bt, bl) = (tb.contents(), lb.contents());
                    let c = kvpage_manager_block_table_dense(
                        w.mgr,
                        sq.ptr,
                        sq.len,
                        stride,
                        u32::MAX,
                        tb.ptr,
                        tb.len,
                        lb.ptr,
                        lb.len,
                        err,
                    );
                    unwritten.push(tb.contents() == bt && lb.contents() == bl);
                    c
                }
                Call::MgrCsr {
                    seqs,
                    ids,
                    indptr,
                    indices,
                    last,
                } => {
                    let ids: Vec<u64> = ids.iter().map(|&i| w.mid(i)).collect();
                    let sq = Arg::<u64>::new(seqs, 2, |i| ids[i % 3]);
                    let ip = Arg::<u32>::new(indptr, sq.len + 1, |_| SENT32);
                    let ix = Arg::<u32>::new(indices, 8, |_| SENT32);
                    let lp = Arg::<u32>::new(last, sq.len, |_| SENT32);
                    let (a, b, d) = (ip.contents(), ix.contents(), lp.contents());
                    let c = kvpage_manager_block_table_csr(
                        w.mgr, sq.ptr, sq.len, ip.ptr, ip.len, ix.ptr, ix.len, lp.ptr, lp.len, err,
                    );
                    unwritten.push(ip.contents() == a && ix.contents() == b && lp.contents() == d);
                    c
                }
                Call::MgrTable => {
                    let (mut t, mut l) = (null::<u32>(), null::<u32>());
                    let (mut rows, mut stride) = (SENT32, SENT32);
                    let c = kvpage_manager_block_table(
                        w.mgr,
                        optr!(t),
                        &mut l,
                        &mut rows,
                        &mut stride,
                        err,
                    );
                    unwritten
                        .push(t.is_null() && l.is_null() && rows == SENT32 && stride == SENT32);
                    if c == KVPAGE_OK && rows > 0 && stride > 0 {
                        // The exported table is readable: every row of a live id.
                        let table = core::slice::from_raw_parts(t, (rows * stride) as usize);
                        let lens = core::slice::from_raw_parts(l, rows as usize);
                        let _ = (table.iter().sum::<u32>(), lens.iter().sum::<u32>());
                    }
                    c
                }
                Call::MgrSeqRow { id } => {
                    let mut o = SENT32;
                    let c = kvpage_manager_seq_row(w.mgr, w.mid(id), optr!(o), err);
                    unwritten.push(o == SENT32);
                    c
                }
                Call::Garbage { kind, word } => {
                    // A pointer to 32 readable bytes that are not a live object.
                    let magics = [*b"kvpgCACH", *b"kvpgENG1", *b"kvpgMGR2", *b"kvpgSCH3"];
                    if magics.iter().any(|m| u64::from_le_bytes(*m) == word) {
                        continue;
                    }
                    w.garbage[0] = word;
                    let g = w.garbage.as_mut_ptr();
                    let mut st = kvpage_stats::default();
                    let c = match kind % 6 {
                        0 => kvpage_cache_stats(g.cast(), &mut st, err),
                        1 => kvpage_cache_append(g.cast(), 0, 1, err),
                        2 => kvpage_manager_stats(g.cast(), &mut st, err),
                        3 => kvpage_manager_release(g.cast(), 0, err),
                        4 => kvpage_engine_cancel(g.cast(), 0, err),
                        _ => kvpage_scheduler_cancel(g.cast(), w.mgr, 0, err),
                    };
                    assert_ne!(c, KVPAGE_OK, "a garbage object was accepted");
                    c
                }
                Call::CacheEventsDrain { events, tokens } => {
                    let ev = Arg::<kvpage_kv_event>::new(events, 4, |_| kvpage_kv_event::default());
                    let tk = Arg::<u32>::new(tokens, 8, |_| SENT32);
                    let mut o = kvpage_events_report {
                        first_seq: SENT64,
                        ..kvpage_events_report::default()
                    };
                    let c = kvpage_cache_events_drain(
                        w.cache,
                        ev.ptr,
                        ev.len,
                        tk.ptr,
                        tk.len,
                        optr!(o),
                        err,
                    );
                    unwritten
                        .push(o.first_seq == SENT64 && tk.contents().iter().all(|&t| t == SENT32));
                    if c == KVPAGE_OK {
                        assert!(o.events <= ev.len && o.tokens <= tk.len);
                    }
                    c
                }
                Call::CacheSetKvScales { layer, k, v } => {
                    let (layer, k, v) = (
                        u32::from(layer) % (MAX_LAYERS + 1),
                        kv_scale(k),
                        kv_scale(v),
                    );
                    let c = kvpage_cache_set_kv_scales(w.cache, layer, k, v, err);
                    if c == KVPAGE_OK {
                        let (mut gk, mut gv) = (0.0, 0.0);
                        let got =
                            kvpage_cache_kv_scales(w.cache, layer, &mut gk, &mut gv, null_mut());
                        assert_eq!((got, gk, gv), (KVPAGE_OK, k, v));
                    }
                    c
                }
                Call::CacheClearKvScales { layer } => {
                    let layer = u32::from(layer) % (MAX_LAYERS + 1);
                    kvpage_cache_clear_kv_scales(w.cache, layer, err)
                }
                Call::CacheKvScales { layer } => {
                    let layer = u32::from(layer) % (MAX_LAYERS + 1);
                    let (mut k, mut v) = (f32::NAN, f32::NAN);
                    let c = kvpage_cache_kv_scales(w.cache, layer, optr!(k), &mut v, err);
                    unwritten.push(k.is_nan() && v.is_nan());
                    if c == KVPAGE_OK {
                        assert!((k == 0.0) == (v == 0.0), "both fixed or neither");
                    }
                    c
                }
                Call::ResultStr { code } => {
                    let p = kvpage_result_str(code);
                    assert!(!p.is_null());
                    let _ = std::ffi::CStr::from_ptr(p).to_bytes().len();
                    continue;
                }
            };
            assert_ne!(code, KVPAGE_ERR_INTERNAL, "{call:?}");
            if code == KVPAGE_OK {
                if !outs.null_err {
                    assert_eq!(
                        e.code, KVPAGE_ERR_OUT_OF_RANGE,
                        "kvpage_error written on success"
                    );
                }
            } else {
                if !outs.null_err {
                    assert_eq!(e.code, code, "kvpage_error holds another code");
                    assert!(e.message.contains(&0), "message not NUL-terminated");
                }
                assert!(
                    unwritten.iter().all(|&x| x),
                    "{call:?} failed with {code:?} and wrote an output"
                );
                assert_eq!(
                    w.snapshot(),
                    before,
                    "{call:?} failed with {code:?} and changed the state"
                );
            }
        }
        if !w.cache.is_null() {
            assert_eq!(kvpage_cache_free(w.cache, null_mut()), KVPAGE_OK);
        }
    }
});
