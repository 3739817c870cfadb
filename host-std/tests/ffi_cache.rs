//! Tier 1 of the C API, the owned cache, called through its `extern "C"` functions with
//! raw pointers: attention equals the Rust API's bit for bit; bad input of every kind
//! returns its code and changes nothing; running out of blocks reports the numbers.

mod common;

use core::ffi::{c_void, CStr};
use core::ptr::{null, null_mut};

use common::{random_vec, rng};
use kvpage::ffi::kvpage_result::*;
use kvpage::ffi::*;
use kvpage::{bf16, f16, CacheConfig, Capacity, DType, Element, Geometry, KvCache, Seq};
use rand::rngs::StdRng;

const LAYERS: u32 = 2;
const KV_HEADS: u32 = 2;
const Q_HEADS: u32 = 4;
const HEAD_DIM: u32 = 16;
const BLOCK: u32 = 4;
const ROW: usize = (KV_HEADS * HEAD_DIM) as usize;
const QROW: usize = (Q_HEADS * HEAD_DIM) as usize;
const THREADS: u32 = 2;
const MAX_SEQS: u32 = 6;
const SCALE: f32 = 0.25;

fn dtype_code(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => KVPAGE_DTYPE_F32,
        DType::F16 => KVPAGE_DTYPE_F16,
        DType::Bf16 => KVPAGE_DTYPE_BF16,
        DType::Int8 => KVPAGE_DTYPE_INT8,
        DType::Fp8E4m3 => KVPAGE_DTYPE_FP8_E4M3,
    }
}

fn params(dtype: DType, blocks: u32) -> kvpage_cache_params {
    let mut p = kvpage_cache_default_params(kvpage_geometry {
        layers: LAYERS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        block_size: BLOCK,
        dtype: dtype_code(dtype),
    });
    p.capacity_bytes = 0;
    p.capacity_blocks = blocks;
    p.max_seqs = MAX_SEQS;
    p.max_seq_len = 64;
    p.threads = THREADS;
    p
}

/// An error struct to pass; zeroed is `KVPAGE_OK` with an empty message.
fn err() -> kvpage_error {
    // SAFETY: all-zero is a valid kvpage_error (code 0 = KVPAGE_OK, numbers, chars).
    unsafe { core::mem::MaybeUninit::zeroed().assume_init() }
}

fn message(e: &kvpage_error) -> String {
    // SAFETY: the library NUL-terminates the message.
    unsafe { CStr::from_ptr(e.message.as_ptr()) }
        .to_str()
        .unwrap()
        .to_owned()
}

#[track_caller]
fn ok(code: kvpage_result) {
    assert_eq!(code, KVPAGE_OK);
}

fn new_cache(p: &kvpage_cache_params) -> *mut kvpage_cache {
    let mut c = null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { kvpage_cache_new(p, &mut c, null_mut()) });
    assert!(!c.is_null());
    c
}

fn free(c: *mut kvpage_cache) {
    // SAFETY: a live cache, freed once.
    ok(unsafe { kvpage_cache_free(c, null_mut()) });
}

/// `n` random values exactly representable in `T` (so f32 and `T` writes store the
/// same bits).
fn values<T: Element>(rng: &mut StdRng, n: usize) -> Vec<f32> {
    random_vec(rng, n)
        .into_iter()
        .map(|x| T::from_f32(x).to_f32())
        .collect()
}

/// The same operations on a Rust `KvCache` and a C `kvpage_cache` of equal
/// configuration, each result compared.
struct Twin {
    rust: KvCache,
    c: *mut kvpage_cache,
}

impl Drop for Twin {
    fn drop(&mut self) {
        free(self.c);
    }
}

impl Twin {
    fn new(dtype: DType, blocks: u32) -> Self {
        let p = params(dtype, blocks);
        let geometry = Geometry::new(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, dtype).unwrap();
        let rust = KvCache::new(CacheConfig {
            geometry,
            capacity: Capacity::Blocks(blocks),
            max_seqs: MAX_SEQS,
            max_seq_len: 64,
            threads: THREADS as usize,
            event_capacity: 0,
            hash_key: None,
            max_namespaces: kvpage::CACHE_NAMESPACES,
        })
        .unwrap();
        Self {
            rust,
            c: new_cache(&p),
        }
    }

    fn check_len_and_stats(&self, s: (Seq, kvpage_seq)) {
        let (mut len, mut stats) = (0u32, kvpage_stats::default());
        // SAFETY: live cache, writable outs.
        unsafe {
            ok(kvpage_cache_len(self.c, s.1, &mut len, null_mut()));
            ok(kvpage_cache_stats(self.c, &mut stats, null_mut()));
        }
        assert_eq!(len, self.rust.len(s.0).unwrap());
        assert_eq!(stats, kvpage_stats::from(self.rust.stats()));
    }

    fn create_with_prompt(&mut self, ns: u64, prompt: &[u32]) -> ((Seq, kvpage_seq), u32) {
        let r = self.rust.create_with_prompt(ns, prompt).unwrap();
        let (mut id, mut reused) = (KVPAGE_SEQ_NONE, u32::MAX);
        // SAFETY: live cache, readable prompt, writable outs.
        ok(unsafe {
            kvpage_cache_create_with_prompt(
                self.c,
                ns,
                prompt.as_ptr(),
                prompt.len(),
                &mut id,
                &mut reused,
                null_mut(),
            )
        });
        assert_eq!(reused, r.reused_tokens);
        let s = (r.seq, id);
        self.check_len_and_stats(s);
        (s, reused)
    }

    fn fork(&mut self, s: (Seq, kvpage_seq)) -> (Seq, kvpage_seq) {
        let child = self.rust.fork(s.0).unwrap();
        let mut id = KVPAGE_SEQ_NONE;
        // SAFETY: live cache, writable out.
        ok(unsafe { kvpage_cache_fork(self.c, s.1, &mut id, null_mut()) });
        (child, id)
    }

    fn append_tokens(&mut self, s: (Seq, kvpage_seq), tokens: &[u32]) {
        self.rust.append_tokens(s.0, tokens).unwrap();
        // SAFETY: live cache, readable tokens.
        ok(unsafe {
            kvpage_cache_append_tokens(self.c, s.1, tokens.as_ptr(), tokens.len(), null_mut())
        });
        self.check_len_and_stats(s);
    }

    fn append(&mut self, s: (Seq, kvpage_seq), n: u32) {
        self.rust.append(s.0, n).unwrap();
        // SAFETY: live cache.
        ok(unsafe { kvpage_cache_append(self.c, s.1, n, null_mut()) });
        self.check_len_and_stats(s);
    }

    /// Writes random K/V (representable in `T`) for positions `first..len` of every
    /// layer on both sides, through `write_kv_raw` in `T` on the C side when `raw`,
    /// then commits.
    fn write<T: Element>(&mut self, s: (Seq, kvpage_seq), first: u32, raw: bool, rng: &mut StdRng) {
        let n = self.rust.len(s.0).unwrap() - first;
        for layer in 0..LAYERS {
            let (k, v) = (
                values::<T>(rng, n as usize * ROW),
                values::<T>(rng, n as usize * ROW),
            );
            self.rust.write_kv(s.0, layer, first, &k, &v).unwrap();
            let code = if raw {
                let kt: Vec<T> = k.iter().map(|&x| T::from_f32(x)).collect();
                let vt: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
                // SAFETY: live cache, readable buffers of the lengths given.
                unsafe {
                    kvpage_cache_write_kv_raw(
                        self.c,
                        s.1,
                        layer,
                        first,
                        n,
                        dtype_code(T::DTYPE),
                        kt.as_ptr().cast::<c_void>(),
                        kt.len(),
                        vt.as_ptr().cast::<c_void>(),
                        vt.len(),
                        null_mut(),
                    )
                }
            } else {
                // SAFETY: as above.
                unsafe {
                    kvpage_cache_write_kv(
                        self.c,
                        s.1,
                        layer,
                        first,
                        n,
                        k.as_ptr(),
                        k.len(),
                        v.as_ptr(),
                        v.len(),
                        null_mut(),
                    )
                }
            };
            ok(code);
        }
        let want = self.rust.commit(s.0).unwrap();
        let mut got = u32::MAX;
        // SAFETY: live cache, writable out.
        ok(unsafe { kvpage_cache_commit(self.c, s.1, &mut got, null_mut()) });
        assert_eq!(got, want);
        self.check_len_and_stats(s);
    }

    /// Decode of `seqs` in `layer` on both sides: the outputs are equal bit for bit.
    fn decode(&mut self, layer: u32, seqs: &[(Seq, kvpage_seq)], rng: &mut StdRng) {
        let q = random_vec(rng, seqs.len() * QROW);
        let rust_seqs: Vec<Seq> = seqs.iter().map(|s| s.0).collect();
        let ids: Vec<kvpage_seq> = seqs.iter().map(|s| s.1).collect();
        let mut want = vec![f32::NAN; q.len()];
        self.rust
            .decode(layer, &rust_seqs, &q, &mut want, Q_HEADS, SCALE)
            .unwrap();
        // A longer output buffer than needed: only the needed prefix is written.
        let mut got = vec![f32::NAN; q.len() + 3];
        // SAFETY: live cache, buffers of the lengths given.
        ok(unsafe {
            kvpage_cache_decode(
                self.c,
                layer,
                ids.as_ptr(),
                ids.len(),
                q.as_ptr(),
                q.len(),
                got.as_mut_ptr(),
                got.len(),
                Q_HEADS,
                SCALE,
                null_mut(),
            )
        });
        same_bits(&got[..q.len()], &want);
        assert!(got[q.len()..].iter().all(|x| x.is_nan()));
    }

    /// Prefill of `(seq, queries)` in `layer` on both sides, compared bit for bit.
    fn prefill(&mut self, layer: u32, seqs: &[((Seq, kvpage_seq), u32)], rng: &mut StdRng) {
        let total: u32 = seqs.iter().map(|s| s.1).sum();
        let q = random_vec(rng, total as usize * QROW);
        let rust_seqs: Vec<(Seq, u32)> = seqs.iter().map(|s| (s.0 .0, s.1)).collect();
        let ids: Vec<kvpage_seq> = seqs.iter().map(|s| s.0 .1).collect();
        let counts: Vec<u32> = seqs.iter().map(|s| s.1).collect();
        let mut want = vec![f32::NAN; q.len()];
        self.rust
            .prefill(layer, &rust_seqs, &q, &mut want, Q_HEADS, SCALE)
            .unwrap();
        let mut got = vec![f32::NAN; q.len()];
        // SAFETY: live cache, buffers of the lengths given.
        ok(unsafe {
            kvpage_cache_prefill(
                self.c,
                layer,
                ids.as_ptr(),
                counts.as_ptr(),
                ids.len(),
                q.as_ptr(),
                q.len(),
                got.as_mut_ptr(),
                got.len(),
                Q_HEADS,
                SCALE,
                null_mut(),
            )
        });
        same_bits(&got, &want);
    }
}

#[track_caller]
fn same_bits(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "element {i}: {g} vs {w}");
    }
}

/// A shared prompt through the prefix cache, a fork with copy-on-write, decode and
/// prefill: the C API's outputs are the Rust API's, bit for bit.
fn c_equals_rust<T: Element>() {
    let mut rng = rng(u64::from(T::DTYPE as u8) + 40);
    let mut t = Twin::new(T::DTYPE, 40);
    let prompt: Vec<u32> = (0..11).map(|i| (i * 5 + 1) % 17).collect();

    let (a, reused) = t.create_with_prompt(7, &prompt);
    assert_eq!(reused, 0);
    t.write::<T>(a, 0, false, &mut rng);

    // B shares A's two whole blocks through the prefix cache of namespace 7.
    let b_prompt: Vec<u32> = prompt.iter().copied().chain([3, 4, 5]).collect();
    let (b, reused) = t.create_with_prompt(7, &b_prompt);
    assert_eq!(reused, 8);
    t.write::<T>(b, reused, true, &mut rng);
    // Another namespace shares nothing.
    let (d, reused) = t.create_with_prompt(8, &prompt);
    assert_eq!(reused, 0);
    t.write::<T>(d, 0, true, &mut rng);

    // C forks B; its first append copies the shared partial block.
    let c = t.fork(b);
    t.append_tokens(c, &[9]);
    t.write::<T>(c, 14, true, &mut rng);
    t.append_tokens(a, &[2]);
    t.write::<T>(a, 11, false, &mut rng);
    t.append(b, 2);
    t.write::<T>(b, 14, false, &mut rng);

    for layer in 0..LAYERS {
        t.decode(layer, &[a, b, c, d], &mut rng);
        t.prefill(layer, &[(b, 8), (c, 1), (a, 4), (d, 11)], &mut rng);
    }
    t.decode(1, &[], &mut rng);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "minutes per dtype when interpreted; the kernels' unsafe code runs under Miri \
              in concurrent_kernels and cache, the C entry points in the bad-input tests"
)]
fn c_attention_equals_rust_bit_for_bit_every_dtype() {
    c_equals_rust::<f32>();
    c_equals_rust::<f16>();
    c_equals_rust::<bf16>();
}

/// Re-rotating keys through the C API equals the Rust API bit for bit (checked through
/// decode); every bad input returns its code and changes nothing, the arena included.
fn c_rotate_keys_equals_rust<T: Element>() {
    let mut rng = rng(u64::from(T::DTYPE as u8) + 60);
    let mut t = Twin::new(T::DTYPE, 40);
    // Token ids unknown: committed blocks are not registered in the prefix cache.
    let rust = t.rust.create(0).unwrap();
    let mut id = KVPAGE_SEQ_NONE;
    // SAFETY: live cache, writable out.
    ok(unsafe { kvpage_cache_create(t.c, 0, &mut id, null_mut()) });
    let a = (rust, id);
    t.append(a, 11);
    t.write::<T>(a, 0, false, &mut rng);
    let rope = kvpage_rope_params {
        base: 10_000.0,
        rotary_dims: 12,
        pairing: KVPAGE_ROPE_HALF_SPLIT,
    };
    let rust_rope = kvpage::RopeParams {
        base: 10_000.0,
        rotary_dims: 12,
        pairing: kvpage::RopePairing::HalfSplit,
    };
    t.rust.rotate_keys(a.0, 2, 11, -3_000, rust_rope).unwrap();
    // SAFETY: live cache, readable params.
    ok(unsafe { kvpage_cache_rotate_keys(t.c, a.1, 2, 11, -3_000, &rope, null_mut()) });
    for layer in 0..LAYERS {
        t.decode(layer, &[a], &mut rng);
    }

    // A fork shares every block of `a`; a released sequence is stale.
    let b = t.fork(a);
    let mut gone = KVPAGE_SEQ_NONE;
    // SAFETY: live cache, writable out.
    unsafe {
        ok(kvpage_cache_create(t.c, 0, &mut gone, null_mut()));
        ok(kvpage_cache_release(t.c, gone, null_mut()));
    }
    let chk = Checker::new(t.c, &[a.1, b.1]);
    let with = |f: fn(&mut kvpage_rope_params)| {
        let mut p = rope;
        f(&mut p);
        p
    };
    let c = t.c;
    // SAFETY: every pointer is valid, or deliberately null / misaligned, which the
    // library refuses before any access.
    unsafe {
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_rotate_keys(null_mut(), a.1, 0, 1, 1, &rope, e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_rotate_keys(c, a.1, 0, 1, 1, null(), e)
        });
        let misaligned = (&rope as *const kvpage_rope_params)
            .cast::<u8>()
            .add(1)
            .cast::<kvpage_rope_params>();
        chk.fails(KVPAGE_ERR_MISALIGNED, |e| {
            kvpage_cache_rotate_keys(c, a.1, 0, 1, 1, misaligned, e)
        });
        let e = chk.fails(KVPAGE_ERR_INVALID_ARGUMENT, |e| {
            kvpage_cache_rotate_keys(c, a.1, 0, 1, 1, &with(|p| p.pairing = 2), e)
        });
        assert_eq!(e.value, 2);
        let e = chk.fails(KVPAGE_ERR_INVALID_ARGUMENT, |e| {
            kvpage_cache_rotate_keys(c, a.1, 0, 1, 1, &with(|p| p.rotary_dims = 7), e)
        });
        assert_eq!(e.value, 7);
        let e = chk.fails(KVPAGE_ERR_INVALID_ARGUMENT, |e| {
            kvpage_cache_rotate_keys(c, a.1, 0, 1, 1, &with(|p| p.rotary_dims = 18), e)
        });
        assert_eq!((e.value, e.available), (18, u64::from(HEAD_DIM)));
        for f in [
            (|p: &mut kvpage_rope_params| p.rotary_dims = 0) as fn(&mut kvpage_rope_params),
            |p| p.base = f32::NAN,
            |p| p.base = 1.0,
            |p| p.base = f32::INFINITY,
        ] {
            chk.fails(KVPAGE_ERR_INVALID_ARGUMENT, |e| {
                kvpage_cache_rotate_keys(c, a.1, 0, 1, 1, &with(f), e)
            });
        }
        let e = chk.fails(KVPAGE_ERR_INVALID_ARGUMENT, |e| {
            kvpage_cache_rotate_keys(c, a.1, 5, 4, 1, &rope, e)
        });
        assert_eq!((e.value, e.available), (5, 4));
        let e = chk.fails(KVPAGE_ERR_BEYOND_LENGTH, |e| {
            kvpage_cache_rotate_keys(c, a.1, 0, 12, 1, &rope, e)
        });
        assert_eq!((e.needed, e.available), (12, 11));
        for bad in [gone, KVPAGE_SEQ_NONE] {
            chk.fails(KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_cache_rotate_keys(c, bad, 0, 1, 1, &rope, e)
            });
        }
        for (s, first) in [(a.1, 0), (b.1, 10)] {
            let e = chk.fails(KVPAGE_ERR_BLOCK_SHARED, |e| {
                kvpage_cache_rotate_keys(c, s, first, first + 1, 1, &rope, e)
            });
            assert_eq!(e.needed, 2);
            assert!(message(&e).contains("shared"), "{}", message(&e));
        }
        // Nothing to do: an empty range touches no block, shared or not.
        ok(kvpage_cache_rotate_keys(c, a.1, 4, 4, 1, &rope, null_mut()));
        ok(kvpage_cache_rotate_keys(
            c,
            b.1,
            11,
            11,
            1,
            &rope,
            null_mut(),
        ));
    }
    // The failures wrote nothing: both sides still decode alike.
    for layer in 0..LAYERS {
        t.decode(layer, &[a, b], &mut rng);
    }

    // A context shift with rope parameters: checked before anything moves, then the same
    // shift and rotation as the Rust API's (the fork's shared blocks are copied first).
    // SAFETY: as above.
    unsafe {
        let mut shift = kvpage_context_shift::default();
        let misaligned = (&rope as *const kvpage_rope_params)
            .cast::<u8>()
            .add(1)
            .cast::<kvpage_rope_params>();
        chk.fails(KVPAGE_ERR_MISALIGNED, |e| {
            kvpage_cache_context_shift(c, b.1, 3, 4, misaligned, &mut shift, e)
        });
        let e = chk.fails(KVPAGE_ERR_INVALID_ARGUMENT, |e| {
            kvpage_cache_context_shift(c, b.1, 3, 4, &with(|p| p.pairing = 2), &mut shift, e)
        });
        assert_eq!(e.value, 2);
        let e = chk.fails(KVPAGE_ERR_INVALID_ARGUMENT, |e| {
            kvpage_cache_context_shift(c, b.1, 3, 4, &with(|p| p.rotary_dims = 18), &mut shift, e)
        });
        assert_eq!(e.value, 18);
        chk.fails(KVPAGE_ERR_BEYOND_LENGTH, |e| {
            kvpage_cache_context_shift(c, b.1, 8, 4, &rope, &mut shift, e)
        });
        let want = t.rust.context_shift_rotated(b.0, 3, 4, rust_rope).unwrap();
        ok(kvpage_cache_context_shift(
            c,
            b.1,
            3,
            4,
            &rope,
            &mut shift,
            null_mut(),
        ));
        assert_eq!(
            (shift.rotate_first, shift.rotate_end, shift.delta),
            (want.rotate_first, want.rotate_end, want.delta)
        );
        assert_eq!(
            (shift.copied_blocks, shift.row_moves),
            (want.edited.copies, want.edited.moves)
        );
        assert_eq!(
            (shift.rotate_first, shift.rotate_end, shift.delta),
            (3, 7, -4)
        );
    }
    for layer in 0..LAYERS {
        t.decode(layer, &[a, b], &mut rng);
    }
}

#[test]
#[cfg_attr(
    miri,
    ignore = "a minute when interpreted; the rotation kernel's unsafe code is the arena \
              view the cache tests run under Miri"
)]
fn c_rotate_keys_equals_rust_and_bad_input_changes_nothing() {
    c_rotate_keys_equals_rust::<f16>();
    c_rotate_keys_equals_rust::<f32>();
    c_rotate_keys_equals_rust::<bf16>();
}

/// What a failed call must leave unchanged: the counters and every length.
fn snapshot(c: *mut kvpage_cache, seqs: &[kvpage_seq]) -> (kvpage_stats, Vec<u32>) {
    let mut stats = kvpage_stats::default();
    // SAFETY: live cache, writable outs.
    unsafe {
        ok(kvpage_cache_stats(c, &mut stats, null_mut()));
        let lens = seqs
            .iter()
            .map(|&s| {
                let mut len = 0;
                ok(kvpage_cache_len(c, s, &mut len, null_mut()));
                len
            })
            .collect();
        (stats, lens)
    }
}

/// Asserts a failed call returned `want`, filled `err` with it, and changed nothing.
struct Checker {
    c: *mut kvpage_cache,
    live: Vec<kvpage_seq>,
    before: (kvpage_stats, Vec<u32>),
}

impl Checker {
    fn new(c: *mut kvpage_cache, live: &[kvpage_seq]) -> Self {
        Self {
            c,
            live: live.to_vec(),
            before: snapshot(c, live),
        }
    }

    /// Runs `call` with a fresh error struct; checks code, struct and state.
    #[track_caller]
    fn fails(
        &self,
        want: kvpage_result,
        call: impl FnOnce(*mut kvpage_error) -> kvpage_result,
    ) -> kvpage_error {
        let mut e = err();
        let got = call(&mut e);
        assert_eq!(got, want, "{}", message(&e));
        assert_eq!(e.code, want);
        assert!(!message(&e).is_empty());
        assert_eq!(
            snapshot(self.c, &self.live),
            self.before,
            "a failed call changed the cache"
        );
        e
    }
}

/// A change of good parameters that makes them bad.
type Change = fn(&mut kvpage_cache_params);

#[test]
fn bad_configs_are_refused() {
    let good = params(DType::F16, 16);
    let cases: [(&str, Change, kvpage_result); 10] = [
        (
            "both capacities",
            |p| p.capacity_bytes = 1 << 20,
            KVPAGE_ERR_INVALID_ARGUMENT,
        ),
        (
            "no capacity",
            |p| p.capacity_blocks = 0,
            KVPAGE_ERR_INVALID_ARGUMENT,
        ),
        (
            "under one block",
            |p| {
                p.capacity_blocks = 0;
                p.capacity_bytes = 100;
            },
            KVPAGE_ERR_BAD_CONFIG,
        ),
        (
            "head dim 4096",
            |p| p.geometry.head_dim = 4096,
            KVPAGE_ERR_BAD_CONFIG,
        ),
        (
            "zero layers",
            |p| p.geometry.layers = 0,
            KVPAGE_ERR_BAD_CONFIG,
        ),
        (
            "zero block size",
            |p| p.geometry.block_size = 0,
            KVPAGE_ERR_BAD_CONFIG,
        ),
        (
            "unknown dtype",
            |p| p.geometry.dtype = 7,
            KVPAGE_ERR_INVALID_ARGUMENT,
        ),
        ("zero max_seqs", |p| p.max_seqs = 0, KVPAGE_ERR_BAD_CONFIG),
        (
            "zero max_seq_len",
            |p| p.max_seq_len = 0,
            KVPAGE_ERR_BAD_CONFIG,
        ),
        (
            "over 2^32-1 blocks",
            |p| {
                p.capacity_blocks = 0;
                p.capacity_bytes = u64::MAX;
            },
            KVPAGE_ERR_BAD_CONFIG,
        ),
    ];
    let sentinel = 0x40 as *mut kvpage_cache;
    for (what, change, want) in cases {
        let mut p = good;
        change(&mut p);
        let (mut out, mut e) = (sentinel, err());
        // SAFETY: valid pointers.
        let got = unsafe { kvpage_cache_new(&p, &mut out, &mut e) };
        assert_eq!((got, e.code), (want, want), "{what}: {}", message(&e));
        assert_eq!(out, sentinel, "{what}: out written on failure");
        if what == "unknown dtype" {
            assert_eq!(e.value, 7);
        }
    }
    let mut out = sentinel;
    // SAFETY: null and misaligned pointers are refused before any access.
    unsafe {
        assert_eq!(
            kvpage_cache_new(null(), &mut out, null_mut()),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            kvpage_cache_new(&good, null_mut(), null_mut()),
            KVPAGE_ERR_NULL_POINTER
        );
        let bytes = [0u64; 16];
        let odd = bytes
            .as_ptr()
            .cast::<u8>()
            .add(1)
            .cast::<kvpage_cache_params>();
        assert_eq!(
            kvpage_cache_new(odd, &mut out, null_mut()),
            KVPAGE_ERR_MISALIGNED
        );
    }
    assert_eq!(out, sentinel);

    // The defaults build, sized in bytes.
    let d = kvpage_cache_default_params(good.geometry);
    assert_eq!(
        (
            d.capacity_blocks,
            d.capacity_bytes,
            d.max_seqs,
            d.max_seq_len,
            d.threads
        ),
        (0, 256 << 20, 64, 4096, 0)
    );
    // Under Miri, which would touch the 256 MiB arena byte by byte, the same defaults
    // with a 1 MiB capacity.
    let built = kvpage_cache_params {
        capacity_bytes: if cfg!(miri) {
            1 << 20
        } else {
            d.capacity_bytes
        },
        ..d
    };
    let c = new_cache(&built);
    let mut g = kvpage_geometry {
        layers: 0,
        kv_heads: 0,
        head_dim: 0,
        block_size: 0,
        dtype: 9,
    };
    let mut stats = kvpage_stats::default();
    // SAFETY: live cache, writable outs.
    unsafe {
        ok(kvpage_cache_geometry(c, &mut g, null_mut()));
        ok(kvpage_cache_stats(c, &mut stats, null_mut()));
    }
    assert_eq!(g, good.geometry);
    let block_bytes = u64::from(LAYERS * 2 * KV_HEADS * BLOCK * HEAD_DIM) * 2;
    assert_eq!(
        u64::from(stats.total_blocks),
        built.capacity_bytes / block_bytes
    );
    free(c);
}

#[test]
fn objects_that_are_not_caches_are_refused() {
    let junk = [0u64; 512];
    let not_cache = junk.as_ptr().cast_mut().cast::<kvpage_cache>();
    // SAFETY: null, misaligned or junk pointers to readable memory are refused before
    // use.
    unsafe {
        ok(kvpage_cache_free(null_mut(), null_mut()));
        let mut e = err();
        assert_eq!(
            kvpage_cache_free(not_cache, &mut e),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
        assert!(
            message(&e).contains("not a kvpage_cache"),
            "{}",
            message(&e)
        );
        let odd = junk
            .as_ptr()
            .cast::<u8>()
            .add(1)
            .cast_mut()
            .cast::<kvpage_cache>();
        assert_eq!(kvpage_cache_free(odd, null_mut()), KVPAGE_ERR_MISALIGNED);
        let mut stats = kvpage_stats::default();
        assert_eq!(
            kvpage_cache_stats(not_cache, &mut stats, null_mut()),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
        assert_eq!(
            kvpage_cache_stats(null(), &mut stats, null_mut()),
            KVPAGE_ERR_NULL_POINTER
        );
        let mut id = 0;
        assert_eq!(
            kvpage_cache_create(not_cache, 0, &mut id, null_mut()),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
        assert_eq!(
            kvpage_cache_create(null_mut(), 0, &mut id, null_mut()),
            KVPAGE_ERR_NULL_POINTER
        );
    }
    assert!(junk.iter().all(|&w| w == 0));
}

#[test]
fn bad_input_returns_its_code_and_changes_nothing() {
    let mut rng = rng(5);
    let c = new_cache(&params(DType::F16, 16));
    let prompt: Vec<u32> = (0..6).collect();
    let (mut s, mut reused) = (KVPAGE_SEQ_NONE, 0u32);
    let kv = values::<f16>(&mut rng, 2 * ROW);
    let kv16: Vec<f16> = kv.iter().map(|&x| f16::from_f32(x)).collect();
    // SAFETY: every pointer below is valid for the length passed, or deliberately
    // null / misaligned / junk, which the library refuses before any access.
    unsafe {
        ok(kvpage_cache_create_with_prompt(
            c,
            1,
            prompt.as_ptr(),
            6,
            &mut s,
            &mut reused,
            null_mut(),
        ));
        for layer in 0..LAYERS {
            ok(kvpage_cache_write_kv(
                c,
                s,
                layer,
                0,
                6,
                values::<f16>(&mut rng, 6 * ROW).as_ptr(),
                6 * ROW,
                values::<f16>(&mut rng, 6 * ROW).as_ptr(),
                6 * ROW,
                null_mut(),
            ));
        }
        ok(kvpage_cache_commit(c, s, null_mut(), null_mut()));
        // A second, released sequence: its id is stale.
        let mut gone = KVPAGE_SEQ_NONE;
        ok(kvpage_cache_create(c, 1, &mut gone, null_mut()));
        ok(kvpage_cache_release(c, gone, null_mut()));
        // Two tokens pending on `s` (positions 6 and 7).
        ok(kvpage_cache_append_tokens(
            c,
            s,
            [6, 7].as_ptr(),
            2,
            null_mut(),
        ));

        let chk = Checker::new(c, &[s]);
        let never = 12_345u64;
        let mut id = KVPAGE_SEQ_NONE;
        let mut n = 0u32;

        // Stale, never-issued and NONE ids, in every function taking one; double release.
        for bad in [gone, never, KVPAGE_SEQ_NONE, s ^ (1 << 40)] {
            chk.fails(KVPAGE_ERR_STALE_SEQ, |e| kvpage_cache_release(c, bad, e));
            chk.fails(KVPAGE_ERR_STALE_SEQ, |e| kvpage_cache_append(c, bad, 1, e));
            chk.fails(KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_cache_append_tokens(c, bad, [1].as_ptr(), 1, e)
            });
            chk.fails(KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_cache_commit(c, bad, &mut n, e)
            });
            chk.fails(KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_cache_fork(c, bad, &mut id, e)
            });
            chk.fails(KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_cache_truncate(c, bad, 0, e)
            });
            chk.fails(KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_cache_len(c, bad, &mut n, e)
            });
            chk.fails(KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_cache_write_kv(
                    c,
                    bad,
                    0,
                    6,
                    2,
                    kv.as_ptr(),
                    kv.len(),
                    kv.as_ptr(),
                    kv.len(),
                    e,
                )
            });
            let q = vec![0.5f32; 2 * QROW];
            let mut out = vec![f32::NAN; 2 * QROW];
            chk.fails(KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_cache_decode(
                    c,
                    0,
                    [s, bad].as_ptr(),
                    2,
                    q.as_ptr(),
                    q.len(),
                    out.as_mut_ptr(),
                    out.len(),
                    Q_HEADS,
                    SCALE,
                    e,
                )
            });
            chk.fails(KVPAGE_ERR_STALE_SEQ, |e| {
                kvpage_cache_prefill(
                    c,
                    0,
                    [bad].as_ptr(),
                    [1].as_ptr(),
                    1,
                    q.as_ptr(),
                    q.len(),
                    out.as_mut_ptr(),
                    out.len(),
                    Q_HEADS,
                    SCALE,
                    e,
                )
            });
            assert!(out.iter().all(|x| x.is_nan()), "out written on failure");
        }
        assert_eq!(
            (id, n),
            (KVPAGE_SEQ_NONE, 0),
            "out-params written on failure"
        );

        // Null pointers in every pointer position.
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_create(c, 0, null_mut(), e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_create_with_prompt(c, 0, null(), 3, &mut id, null_mut(), e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_create_with_prompt(c, 0, prompt.as_ptr(), 3, null_mut(), &mut n, e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_create_with_prompt(null_mut(), 0, prompt.as_ptr(), 3, &mut id, &mut n, e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_append_tokens(c, s, null(), 1, e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_append(null_mut(), s, 1, e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_commit(null_mut(), s, &mut n, e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_fork(c, s, null_mut(), e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_truncate(null_mut(), s, 0, e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_release(null_mut(), s, e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_len(c, s, null_mut(), e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_stats(c, null_mut(), e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_geometry(c, null_mut(), e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_evict_cached(null_mut(), 1, &mut n, e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_write_kv(c, s, 0, 6, 2, null(), kv.len(), kv.as_ptr(), kv.len(), e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_write_kv(c, s, 0, 6, 2, kv.as_ptr(), kv.len(), null(), kv.len(), e)
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_write_kv_raw(
                c,
                s,
                0,
                6,
                2,
                KVPAGE_DTYPE_F16,
                null(),
                kv16.len(),
                kv16.as_ptr().cast(),
                kv16.len(),
                e,
            )
        });
        let q = vec![0.5f32; QROW];
        let mut out = vec![f32::NAN; QROW];
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_decode(
                c,
                0,
                null(),
                1,
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_decode(
                c,
                0,
                [s].as_ptr(),
                1,
                null(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_decode(
                c,
                0,
                [s].as_ptr(),
                1,
                q.as_ptr(),
                q.len(),
                null_mut(),
                out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_decode(
                null_mut(),
                0,
                [s].as_ptr(),
                1,
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_prefill(
                c,
                0,
                [s].as_ptr(),
                null(),
                1,
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });

        // Misaligned pointers.
        let words = [0u64; 64];
        let odd = words.as_ptr().cast::<u8>().add(1);
        chk.fails(KVPAGE_ERR_MISALIGNED, |e| {
            kvpage_cache_append_tokens(c, s, odd.cast(), 1, e)
        });
        chk.fails(KVPAGE_ERR_MISALIGNED, |e| {
            kvpage_cache_len(c, s, odd.cast_mut().cast(), e)
        });
        chk.fails(KVPAGE_ERR_MISALIGNED, |e| {
            kvpage_cache_write_kv(c, s, 0, 6, 1, odd.cast(), ROW, kv.as_ptr(), kv.len(), e)
        });
        chk.fails(KVPAGE_ERR_MISALIGNED, |e| {
            kvpage_cache_write_kv_raw(
                c,
                s,
                0,
                6,
                1,
                KVPAGE_DTYPE_F16,
                odd.cast(),
                ROW,
                kv16.as_ptr().cast(),
                kv16.len(),
                e,
            )
        });
        chk.fails(KVPAGE_ERR_MISALIGNED, |e| {
            kvpage_cache_decode(
                c,
                0,
                odd.cast(),
                1,
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });
        chk.fails(KVPAGE_ERR_MISALIGNED, |e| {
            kvpage_cache_decode(
                c,
                0,
                [s].as_ptr(),
                1,
                q.as_ptr(),
                q.len(),
                odd.cast_mut().cast(),
                out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });

        // Buffers too short: the numbers are in elements.
        let e = chk.fails(KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            kvpage_cache_write_kv(
                c,
                s,
                0,
                6,
                2,
                kv.as_ptr(),
                kv.len() - 1,
                kv.as_ptr(),
                kv.len(),
                e,
            )
        });
        assert_eq!(
            (e.needed, e.available),
            (2 * ROW as u64, 2 * ROW as u64 - 1)
        );
        let e = chk.fails(KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            kvpage_cache_write_kv(c, s, 0, 6, 2, kv.as_ptr(), kv.len(), kv.as_ptr(), ROW, e)
        });
        assert_eq!((e.needed, e.available), (2 * ROW as u64, ROW as u64));
        let e = chk.fails(KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            kvpage_cache_write_kv_raw(
                c,
                s,
                0,
                6,
                2,
                KVPAGE_DTYPE_F16,
                kv16.as_ptr().cast(),
                0,
                kv16.as_ptr().cast(),
                kv16.len(),
                e,
            )
        });
        assert_eq!((e.needed, e.available), (2 * ROW as u64, 0));
        let e = chk.fails(KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            kvpage_cache_decode(
                c,
                0,
                [s].as_ptr(),
                1,
                q.as_ptr(),
                QROW - 1,
                out.as_mut_ptr(),
                out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });
        assert_eq!((e.needed, e.available), (QROW as u64, QROW as u64 - 1));
        let e = chk.fails(KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            kvpage_cache_decode(
                c,
                0,
                [s].as_ptr(),
                1,
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                7,
                Q_HEADS,
                SCALE,
                e,
            )
        });
        assert_eq!((e.needed, e.available), (QROW as u64, 7));
        let e = chk.fails(KVPAGE_ERR_BUFFER_TOO_SMALL, |e| {
            kvpage_cache_prefill(
                c,
                0,
                [s].as_ptr(),
                [2].as_ptr(),
                1,
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });
        assert_eq!((e.needed, e.available), (2 * QROW as u64, QROW as u64));
        // Too few sequence ids: a batch of 2 from a buffer of 0 is a null pointer...
        chk.fails(KVPAGE_ERR_NULL_POINTER, |e| {
            kvpage_cache_decode(
                c,
                0,
                null(),
                2,
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });
        // ...and more than max_seqs is too large a batch.
        let many = vec![s; MAX_SEQS as usize + 1];
        let e = chk.fails(KVPAGE_ERR_BATCH_TOO_LARGE, |e| {
            kvpage_cache_decode(
                c,
                0,
                many.as_ptr(),
                many.len(),
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });
        assert_eq!(
            (e.needed, e.available),
            (u64::from(MAX_SEQS) + 1, u64::from(MAX_SEQS))
        );

        // Dtypes: wrong, unknown.
        chk.fails(KVPAGE_ERR_DTYPE_MISMATCH, |e| {
            kvpage_cache_write_kv_raw(
                c,
                s,
                0,
                6,
                2,
                KVPAGE_DTYPE_BF16,
                kv16.as_ptr().cast(),
                kv16.len(),
                kv16.as_ptr().cast(),
                kv16.len(),
                e,
            )
        });
        chk.fails(KVPAGE_ERR_DTYPE_MISMATCH, |e| {
            kvpage_cache_write_kv_raw(
                c,
                s,
                0,
                6,
                2,
                KVPAGE_DTYPE_F32,
                kv.as_ptr().cast(),
                kv.len(),
                kv.as_ptr().cast(),
                kv.len(),
                e,
            )
        });
        let e = chk.fails(KVPAGE_ERR_INVALID_ARGUMENT, |e| {
            kvpage_cache_write_kv_raw(
                c,
                s,
                0,
                6,
                2,
                99,
                kv16.as_ptr().cast(),
                kv16.len(),
                kv16.as_ptr().cast(),
                kv16.len(),
                e,
            )
        });
        assert_eq!(e.value, 99);

        // Positions, layers, heads, scale, lengths.
        chk.fails(KVPAGE_ERR_NOT_WRITABLE, |e| {
            kvpage_cache_write_kv(
                c,
                s,
                0,
                5,
                2,
                kv.as_ptr(),
                kv.len(),
                kv.as_ptr(),
                kv.len(),
                e,
            )
        });
        chk.fails(KVPAGE_ERR_NOT_WRITABLE, |e| {
            kvpage_cache_write_kv(
                c,
                s,
                0,
                7,
                2,
                kv.as_ptr(),
                kv.len(),
                kv.as_ptr(),
                kv.len(),
                e,
            )
        });
        let e = chk.fails(KVPAGE_ERR_BAD_LAYER, |e| {
            kvpage_cache_write_kv(
                c,
                s,
                LAYERS,
                6,
                2,
                kv.as_ptr(),
                kv.len(),
                kv.as_ptr(),
                kv.len(),
                e,
            )
        });
        assert_eq!(
            (e.value, e.available),
            (u64::from(LAYERS), u64::from(LAYERS))
        );
        chk.fails(KVPAGE_ERR_BAD_LAYER, |e| {
            kvpage_cache_decode(
                c,
                9,
                [s].as_ptr(),
                1,
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });
        chk.fails(KVPAGE_ERR_BAD_HEADS, |e| {
            kvpage_cache_decode(
                c,
                0,
                [s].as_ptr(),
                1,
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                0,
                SCALE,
                e,
            )
        });
        chk.fails(KVPAGE_ERR_BAD_HEADS, |e| {
            kvpage_cache_decode(
                c,
                0,
                [s].as_ptr(),
                1,
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                3,
                SCALE,
                e,
            )
        });
        chk.fails(KVPAGE_ERR_BAD_SCALE, |e| {
            kvpage_cache_decode(
                c,
                0,
                [s].as_ptr(),
                1,
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                Q_HEADS,
                f32::NAN,
                e,
            )
        });
        let big = vec![0.5f32; 9 * QROW];
        let mut big_out = vec![f32::NAN; 9 * QROW];
        let e = chk.fails(KVPAGE_ERR_QUERIES_EXCEED_CONTEXT, |e| {
            kvpage_cache_prefill(
                c,
                0,
                [s].as_ptr(),
                [9].as_ptr(),
                1,
                big.as_ptr(),
                big.len(),
                big_out.as_mut_ptr(),
                big_out.len(),
                Q_HEADS,
                SCALE,
                e,
            )
        });
        assert_eq!((e.needed, e.available), (9, 8));
        let e = chk.fails(KVPAGE_ERR_BEYOND_LENGTH, |e| {
            kvpage_cache_truncate(c, s, 9, e)
        });
        assert_eq!((e.needed, e.available), (9, 8));
        let long: Vec<u32> = (0..65).collect();
        let e = chk.fails(KVPAGE_ERR_SEQ_TOO_LONG, |e| {
            kvpage_cache_create_with_prompt(c, 0, long.as_ptr(), long.len(), &mut id, null_mut(), e)
        });
        assert_eq!((e.needed, e.available), (65, 64));
        chk.fails(KVPAGE_ERR_SEQ_TOO_LONG, |e| {
            kvpage_cache_append(c, s, 57, e)
        });
        assert!(
            out.iter().chain(&big_out).all(|x| x.is_nan()),
            "out written on failure"
        );
        assert_eq!(
            (id, n),
            (KVPAGE_SEQ_NONE, 0),
            "out-params written on failure"
        );

        // Zero sizes are no-ops that succeed (arrays of length 0 may be NULL).
        ok(kvpage_cache_append(c, s, 0, null_mut()));
        ok(kvpage_cache_append_tokens(c, s, null(), 0, null_mut()));
        ok(kvpage_cache_write_kv(
            c,
            s,
            0,
            6,
            0,
            null(),
            0,
            null(),
            0,
            null_mut(),
        ));
        ok(kvpage_cache_decode(
            c,
            0,
            null(),
            0,
            null(),
            0,
            null_mut(),
            0,
            Q_HEADS,
            SCALE,
            null_mut(),
        ));
        ok(kvpage_cache_prefill(
            c,
            0,
            null(),
            null(),
            0,
            null(),
            0,
            null_mut(),
            0,
            Q_HEADS,
            SCALE,
            null_mut(),
        ));
        ok(kvpage_cache_evict_cached(c, 0, null_mut(), null_mut()));
        let (mut empty, mut reused) = (KVPAGE_SEQ_NONE, u32::MAX);
        ok(kvpage_cache_create_with_prompt(
            c,
            1,
            null(),
            0,
            &mut empty,
            &mut reused,
            null_mut(),
        ));
        let mut len = u32::MAX;
        ok(kvpage_cache_len(c, empty, &mut len, null_mut()));
        assert_eq!((len, reused), (0, 0));
        ok(kvpage_cache_release(c, empty, null_mut()));
        assert_eq!(snapshot(c, &[s]), chk.before);

        // The cache works normally afterwards: write the pending tokens, decode, fork.
        for layer in 0..LAYERS {
            ok(kvpage_cache_write_kv_raw(
                c,
                s,
                layer,
                6,
                2,
                KVPAGE_DTYPE_F16,
                kv16.as_ptr().cast(),
                kv16.len(),
                kv16.as_ptr().cast(),
                kv16.len(),
                null_mut(),
            ));
        }
        let mut blocks = u32::MAX;
        ok(kvpage_cache_commit(c, s, &mut blocks, null_mut()));
        assert_eq!(blocks, 1, "the block of positions 4..8 is now full");
        ok(kvpage_cache_decode(
            c,
            1,
            [s].as_ptr(),
            1,
            q.as_ptr(),
            q.len(),
            out.as_mut_ptr(),
            out.len(),
            Q_HEADS,
            SCALE,
            null_mut(),
        ));
        assert!(out.iter().all(|x| x.is_finite()));
        ok(kvpage_cache_fork(c, s, &mut id, null_mut()));
        let mut len = 0;
        ok(kvpage_cache_len(c, id, &mut len, null_mut()));
        assert_eq!(len, 8);
        ok(kvpage_cache_release(c, id, null_mut()));
        ok(kvpage_cache_release(c, s, null_mut()));
        let mut stats = kvpage_stats::default();
        ok(kvpage_cache_stats(c, &mut stats, null_mut()));
        assert_eq!(
            (stats.live_seqs, stats.used_blocks, stats.cached_blocks),
            (0, 0, 2)
        );
        ok(kvpage_cache_evict_cached(c, 5, &mut n, null_mut()));
        assert_eq!(n, 2);
    }
    free(c);
}

#[test]
fn out_of_blocks_reports_needed_and_available() {
    let c = new_cache(&params(DType::F32, 6));
    let (mut a, mut b) = (KVPAGE_SEQ_NONE, KVPAGE_SEQ_NONE);
    let prompt: Vec<u32> = (0..16).collect();
    // SAFETY: valid pointers and lengths throughout.
    unsafe {
        ok(kvpage_cache_create_with_prompt(
            c,
            0,
            prompt.as_ptr(),
            16,
            &mut a,
            null_mut(),
            null_mut(),
        ));
        ok(kvpage_cache_create(c, 0, &mut b, null_mut()));
        ok(kvpage_cache_append(c, b, 8, null_mut()));
        let chk = Checker::new(c, &[a, b]);
        assert_eq!(chk.before.0.free_blocks, 0);
        let e = chk.fails(KVPAGE_ERR_OUT_OF_BLOCKS, |e| {
            kvpage_cache_append(c, a, 1, e)
        });
        assert_eq!((e.needed, e.available), (1, 0));
        assert_eq!(message(&e), "out of blocks: need 1, 0 available");
        let mut id = KVPAGE_SEQ_NONE;
        let e = chk.fails(KVPAGE_ERR_OUT_OF_BLOCKS, |e| {
            kvpage_cache_create_with_prompt(c, 1, prompt.as_ptr(), 9, &mut id, null_mut(), e)
        });
        assert_eq!((e.needed, e.available), (3, 0));
        assert_eq!(id, KVPAGE_SEQ_NONE);
        // Freeing B's two blocks makes room for two, not three.
        ok(kvpage_cache_release(c, b, null_mut()));
        let mut e = err();
        assert_eq!(
            kvpage_cache_create_with_prompt(c, 1, prompt.as_ptr(), 9, &mut id, null_mut(), &mut e),
            KVPAGE_ERR_OUT_OF_BLOCKS
        );
        assert_eq!((e.needed, e.available), (3, 2));
        ok(kvpage_cache_create_with_prompt(
            c,
            1,
            prompt.as_ptr(),
            8,
            &mut id,
            null_mut(),
            null_mut(),
        ));
        ok(kvpage_cache_release(c, id, null_mut()));
        ok(kvpage_cache_release(c, a, null_mut()));
    }
    free(c);
}

#[test]
fn ids_of_another_cache_are_refused() {
    let (one, two) = (
        new_cache(&params(DType::F32, 8)),
        new_cache(&params(DType::F32, 8)),
    );
    let (mut a, mut b, mut len) = (KVPAGE_SEQ_NONE, KVPAGE_SEQ_NONE, 0);
    // SAFETY: live caches, valid pointers.
    unsafe {
        ok(kvpage_cache_create(one, 0, &mut a, null_mut()));
        ok(kvpage_cache_create(two, 0, &mut b, null_mut()));
        ok(kvpage_cache_append(one, a, 3, null_mut()));
        // Same row, same generation, another cache: the salt makes it stale there.
        assert_eq!(a as u32, b as u32);
        assert_eq!(
            kvpage_cache_len(two, a, &mut len, null_mut()),
            KVPAGE_ERR_STALE_SEQ
        );
        assert_eq!(
            kvpage_cache_release(two, a, null_mut()),
            KVPAGE_ERR_STALE_SEQ
        );
        ok(kvpage_cache_len(two, b, &mut len, null_mut()));
        assert_eq!(len, 0);
        ok(kvpage_cache_len(one, a, &mut len, null_mut()));
        assert_eq!(len, 3);
    }
    free(one);
    free(two);
}

/// The edit verbs through C: lengths, positions, the context shift's report and the
/// set release agree with what the Rust API promises.
#[test]
fn sequence_edits_through_c() {
    let mut e = err();
    let mut c: *mut kvpage_cache = null_mut();
    let p = params(DType::F32, 32);
    // SAFETY: valid pointers to locals; every object is freed at the end.
    unsafe {
        assert_eq!(kvpage_cache_new(&p, &mut c, &mut e), KVPAGE_OK);
        let prompt: Vec<u32> = (0..14).collect();
        let mut s = KVPAGE_SEQ_NONE;
        let ok =
            kvpage_cache_create_with_prompt(c, 0, prompt.as_ptr(), 14, &mut s, null_mut(), &mut e);
        assert_eq!(ok, KVPAGE_OK);
        let (mut len, mut pos) = (0u32, 0i64);
        // Remove 4..8: tokens 8.. keep positions 8..
        assert_eq!(kvpage_cache_seq_rm(c, s, 4, 8, &mut e), KVPAGE_OK);
        assert_eq!(kvpage_cache_len(c, s, &mut len, &mut e), KVPAGE_OK);
        assert_eq!(len, 10);
        assert_eq!(kvpage_cache_seq_pos_max(c, s, &mut pos, &mut e), KVPAGE_OK);
        assert_eq!(pos, 13);
        // Close the gap: positions 4.. drop by 4.
        assert_eq!(kvpage_cache_seq_add(c, s, 4, 10, -4, &mut e), KVPAGE_OK);
        assert_eq!(kvpage_cache_seq_pos_max(c, s, &mut pos, &mut e), KVPAGE_OK);
        assert_eq!(pos, 9);
        // Copy from an unaligned start; then a context shift of the original.
        let mut copy = KVPAGE_SEQ_NONE;
        assert_eq!(
            kvpage_cache_seq_cp(c, s, 2, 10, 0, &mut copy, &mut e),
            KVPAGE_OK
        );
        assert_eq!(
            kvpage_cache_seq_pos_min(c, copy, &mut pos, &mut e),
            KVPAGE_OK
        );
        assert_eq!(pos, 2);
        let mut shift = kvpage_context_shift::default();
        assert_eq!(
            kvpage_cache_context_shift(c, s, 1, 3, std::ptr::null(), &mut shift, &mut e),
            KVPAGE_OK
        );
        assert_eq!(
            (shift.rotate_first, shift.rotate_end, shift.delta),
            (1, 7, -3)
        );
        assert!(shift.row_moves > 0);
        // Keep `s`: the copy goes.
        let mut released = 0u32;
        let set = [s, copy, s];
        assert_eq!(
            kvpage_cache_seq_keep(c, s, set.as_ptr(), 3, &mut released, &mut e),
            KVPAGE_OK
        );
        assert_eq!(released, 1);
        assert_eq!(
            kvpage_cache_len(c, copy, &mut len, &mut e),
            KVPAGE_ERR_STALE_SEQ
        );
        // An empty sequence: -1 both ends.
        assert_eq!(kvpage_cache_seq_rm(c, s, 0, 7, &mut e), KVPAGE_OK);
        assert_eq!(kvpage_cache_seq_pos_min(c, s, &mut pos, &mut e), KVPAGE_OK);
        assert_eq!(pos, -1);
        assert_eq!(kvpage_cache_free(c, &mut e), KVPAGE_OK);
    }
}

/// The backend selection of the parameters: CPU by default, unknown backends and
/// incomplete CUDA selections refused as invalid, and CUDA itself refused with a typed
/// code where it cannot run (`KVPAGE_ERR_UNSUPPORTED` in a build without the `cuda`
/// feature, `KVPAGE_ERR_DEVICE` with it on a machine without a driver); nothing written.
#[test]
fn backend_selection_is_checked() {
    let good = params(DType::F16, 16);
    assert_eq!(
        (good.backend, good.device, good.device_q_heads),
        (KVPAGE_BACKEND_CPU, 0, 0)
    );
    let sentinel = 0x40 as *mut kvpage_cache;
    let try_new = |p: &kvpage_cache_params| {
        let (mut out, mut e) = (sentinel, err());
        // SAFETY: valid pointers.
        let got = unsafe { kvpage_cache_new(p, &mut out, &mut e) };
        (got, e, out)
    };
    let mut p = good;
    p.backend = 7;
    let (got, e, out) = try_new(&p);
    assert_eq!(
        (got, e.value, out),
        (KVPAGE_ERR_INVALID_ARGUMENT, 7, sentinel)
    );
    p.backend = KVPAGE_BACKEND_CUDA;
    let (got, e, out) = try_new(&p);
    assert_eq!((got, out), (KVPAGE_ERR_INVALID_ARGUMENT, sentinel));
    assert!(message(&e).contains("device_q_heads"), "{}", message(&e));
    p.device_q_heads = 4;
    for bad in [-0.5, 1.5, f64::NAN] {
        p.device_memory_fraction = bad;
        assert_eq!(try_new(&p).0, KVPAGE_ERR_INVALID_ARGUMENT, "{bad}");
    }
    p.device_memory_fraction = 0.0;
    let (got, e, out) = try_new(&p);
    if cfg!(feature = "cuda") {
        if got == KVPAGE_OK {
            free(out); // a GPU machine
        } else {
            assert_eq!((got, out), (KVPAGE_ERR_DEVICE, sentinel), "{}", message(&e));
        }
    } else {
        assert_eq!(
            (got, out),
            (KVPAGE_ERR_UNSUPPORTED, sentinel),
            "{}",
            message(&e)
        );
        assert!(message(&e).contains("cuda"), "{}", message(&e));
    }
    // The device fields are ignored on the CPU.
    p.backend = KVPAGE_BACKEND_CPU;
    free(new_cache(&p));
}

/// Fixed K/V scales set through C and through Rust: the same writes give the same
/// attention outputs, bit for bit; reading, clearing and every refusal through C.
fn c_kv_scales_equal_rust<T: Element>() {
    let mut rng = rng(u64::from(T::DTYPE as u8) + 90);
    let mut t = Twin::new(T::DTYPE, 40);
    let (k_scale, v_scale) = (0.004, 0.002);
    let fixed = kvpage::KvScales::new(k_scale, v_scale).unwrap();
    t.rust.set_kv_scales(1, Some(fixed)).unwrap();
    let (mut e, mut k, mut v) = (err(), f32::NAN, f32::NAN);
    // SAFETY: a live cache and writable locals throughout.
    unsafe {
        ok(kvpage_cache_set_kv_scales(t.c, 1, k_scale, v_scale, &mut e));
        ok(kvpage_cache_kv_scales(t.c, 1, &mut k, &mut v, &mut e));
        assert_eq!((k, v), (k_scale, v_scale));
        ok(kvpage_cache_kv_scales(t.c, 0, &mut k, &mut v, &mut e));
        assert_eq!((k, v), (0.0, 0.0), "layer 0: a scale per row");
        // Refused, and the setting stays.
        let refusals = [
            (
                kvpage_cache_set_kv_scales(t.c, LAYERS, 1.0, 1.0, &mut e),
                KVPAGE_ERR_BAD_LAYER,
            ),
            (
                kvpage_cache_set_kv_scales(t.c, 1, 0.0, 1.0, &mut e),
                KVPAGE_ERR_BAD_SCALE,
            ),
            (
                kvpage_cache_set_kv_scales(t.c, 1, 1.0, f32::NAN, &mut e),
                KVPAGE_ERR_BAD_SCALE,
            ),
            (
                kvpage_cache_set_kv_scales(t.c, 1, -2.0, 1.0, &mut e),
                KVPAGE_ERR_BAD_SCALE,
            ),
            (
                kvpage_cache_clear_kv_scales(t.c, LAYERS, &mut e),
                KVPAGE_ERR_BAD_LAYER,
            ),
            (
                kvpage_cache_kv_scales(t.c, 1, null_mut(), &mut v, &mut e),
                KVPAGE_ERR_NULL_POINTER,
            ),
            (
                kvpage_cache_kv_scales(t.c, 1, &mut k, null_mut(), &mut e),
                KVPAGE_ERR_NULL_POINTER,
            ),
            (
                kvpage_cache_set_kv_scales(null_mut(), 1, 1.0, 1.0, &mut e),
                KVPAGE_ERR_NULL_POINTER,
            ),
        ];
        for (i, (got, want)) in refusals.into_iter().enumerate() {
            assert_eq!(got, want, "refusal {i}");
        }
        ok(kvpage_cache_kv_scales(t.c, 1, &mut k, &mut v, &mut e));
        assert_eq!((k, v), (k_scale, v_scale));
    }
    let prompt: Vec<u32> = (0..9).collect();
    let (a, _) = t.create_with_prompt(1, &prompt);
    t.write::<T>(a, 0, false, &mut rng);
    for layer in 0..LAYERS {
        t.decode(layer, &[a], &mut rng);
    }
    // Cleared on both sides: later rows take their own scales again.
    t.rust.set_kv_scales(1, None).unwrap();
    // SAFETY: as above.
    unsafe {
        ok(kvpage_cache_clear_kv_scales(t.c, 1, &mut e));
        ok(kvpage_cache_kv_scales(t.c, 1, &mut k, &mut v, &mut e));
    }
    assert_eq!((k, v), (0.0, 0.0));
    t.append(a, 3);
    t.write::<T>(a, 9, false, &mut rng);
    for layer in 0..LAYERS {
        t.decode(layer, &[a], &mut rng);
    }
}

#[test]
fn c_kv_scales_equal_rust_for_8_bit_storage() {
    c_kv_scales_equal_rust::<kvpage::Int8>();
    c_kv_scales_equal_rust::<kvpage::Fp8E4m3>();
}

#[test]
fn c_kv_scales_are_refused_for_float_storage() {
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        let c = new_cache(&params(dtype, 8));
        let (mut e, mut k, mut v) = (err(), 5.0f32, 5.0f32);
        // SAFETY: a live cache and writable locals.
        unsafe {
            let code = kvpage_cache_set_kv_scales(c, 0, 1.0, 1.0, &mut e);
            assert_eq!(code, KVPAGE_ERR_DTYPE_MISMATCH);
            assert_eq!(e.value, u64::from(dtype_code(dtype)));
            assert!(message(&e).contains("no scales"), "{}", message(&e));
            let code = kvpage_cache_clear_kv_scales(c, 0, &mut e);
            assert_eq!(code, KVPAGE_ERR_DTYPE_MISMATCH);
            let code = kvpage_cache_kv_scales(c, 0, &mut k, &mut v, &mut e);
            assert_eq!(code, KVPAGE_ERR_DTYPE_MISMATCH);
        }
        assert_eq!((k, v), (5.0, 5.0), "outputs untouched");
        free(c);
    }
}
