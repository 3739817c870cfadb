//! Saving and restoring a sequence through the C API (`kvpage_cache_seq_*`): a round trip
//! through a buffer and a file gives a sequence whose decode equals the original's bit
//! for bit; every bad input and every damaged blob returns its code, fills the error
//! struct, writes no out-parameter and leaves the cache's statistics as they were.

mod common;

use core::ffi::{c_char, CStr};
use core::ptr::{null, null_mut};

use common::{assert_same_output, cases, random_vec, rng};
use kvpage::ffi::kvpage_result::*;
use kvpage::ffi::*;

const LAYERS: u32 = 2;
const KV_HEADS: u32 = 2;
const HEAD_DIM: u32 = 8;
const ROW: usize = (KV_HEADS * HEAD_DIM) as usize;

fn params(dtype: u32, block_size: u32) -> kvpage_cache_params {
    let mut p = kvpage_cache_default_params(kvpage_geometry {
        layers: LAYERS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        block_size,
        dtype,
    });
    p.capacity_bytes = 0;
    p.capacity_blocks = 16;
    p.max_seqs = 4;
    p.max_seq_len = 64;
    p.threads = 1;
    p
}

/// A live cache, freed on drop.
struct Cache(*mut kvpage_cache);

impl Cache {
    fn new(p: kvpage_cache_params) -> Self {
        let mut c = null_mut();
        // SAFETY: valid pointers.
        assert_eq!(
            unsafe { kvpage_cache_new(&p, &mut c, null_mut()) },
            KVPAGE_OK
        );
        Self(c)
    }

    fn stats(&self) -> kvpage_stats {
        // SAFETY: zeroed is a valid kvpage_stats (plain integers).
        let mut s = unsafe { core::mem::zeroed() };
        // SAFETY: live cache, writable out.
        assert_eq!(
            unsafe { kvpage_cache_stats(self.0, &mut s, null_mut()) },
            KVPAGE_OK
        );
        s
    }

    /// A sequence of `tokens` with random K/V, committed.
    fn seq(&self, tokens: &[u32], seed: u64) -> kvpage_seq {
        let mut s = 0;
        let mut r = rng(seed);
        // SAFETY: live cache, buffers of the lengths given.
        unsafe {
            assert_eq!(
                kvpage_cache_create(self.0, 0, &mut s, null_mut()),
                KVPAGE_OK
            );
            let code =
                kvpage_cache_append_tokens(self.0, s, tokens.as_ptr(), tokens.len(), null_mut());
            assert_eq!(code, KVPAGE_OK);
            for layer in 0..LAYERS {
                let n = tokens.len() * ROW;
                let (k, v) = (random_vec(&mut r, n), random_vec(&mut r, n));
                let code = kvpage_cache_write_kv(
                    self.0,
                    s,
                    layer,
                    0,
                    tokens.len() as u32,
                    k.as_ptr(),
                    n,
                    v.as_ptr(),
                    n,
                    null_mut(),
                );
                assert_eq!(code, KVPAGE_OK);
            }
        }
        s
    }

    fn decode(&self, s: kvpage_seq) -> Vec<f32> {
        let q: Vec<f32> = (0..ROW * 2)
            .map(|i| (i * 37 % 17) as f32 / 8.0 - 1.0)
            .collect();
        let mut out = vec![0.0f32; q.len()];
        // SAFETY: live cache, buffers of the lengths given.
        let code = unsafe {
            kvpage_cache_decode(
                self.0,
                1,
                &s,
                1,
                q.as_ptr(),
                q.len(),
                out.as_mut_ptr(),
                out.len(),
                4,
                0.3,
                null_mut(),
            )
        };
        assert_eq!(code, KVPAGE_OK);
        out
    }

    fn save(&self, s: kvpage_seq, tokens: Option<&[u32]>, model: &kvpage_fingerprint) -> Vec<u8> {
        let mut size = 0;
        let with = u32::from(tokens.is_some());
        // SAFETY: live cache, writable out.
        let code = unsafe { kvpage_cache_seq_save_size(self.0, s, with, &mut size, null_mut()) };
        assert_eq!(code, KVPAGE_OK);
        let mut blob = vec![0u8; size];
        let mut written = 0;
        let (ptr, n) = tokens.map_or((null(), 0), |t| (t.as_ptr(), t.len()));
        // SAFETY: live cache, buffers of the lengths given.
        let code = unsafe {
            kvpage_cache_seq_save(
                self.0,
                s,
                ptr,
                n,
                model,
                blob.as_mut_ptr(),
                blob.len(),
                &mut written,
                null_mut(),
            )
        };
        assert_eq!((code, written), (KVPAGE_OK, size));
        blob
    }

    /// Restores `blob`; returns the code, the error struct, and (seq, len, ids) as
    /// written (sentinels where not).
    fn restore(
        &self,
        blob: &[u8],
        model: *const kvpage_fingerprint,
        ids_room: usize,
    ) -> (
        kvpage_result,
        kvpage_error,
        (kvpage_seq, u32, Vec<u32>, usize),
    ) {
        let mut e = err();
        let (mut s, mut len, mut n) = (KVPAGE_SEQ_NONE, u32::MAX, usize::MAX);
        let mut ids = vec![u32::MAX; ids_room];
        // SAFETY: live cache, buffers of the lengths given.
        let code = unsafe {
            kvpage_cache_seq_restore(
                self.0,
                blob.as_ptr(),
                blob.len(),
                9,
                model,
                &mut s,
                &mut len,
                ids.as_mut_ptr(),
                ids.len(),
                &mut n,
                &mut e,
            )
        };
        (code, e, (s, len, ids, n))
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        // SAFETY: a live cache, freed once.
        unsafe { kvpage_cache_free(self.0, null_mut()) };
    }
}

fn err() -> kvpage_error {
    // SAFETY: all-zero is a valid kvpage_error.
    unsafe { core::mem::MaybeUninit::zeroed().assume_init() }
}

fn message(e: &kvpage_error) -> String {
    // SAFETY: NUL-terminated by the library.
    unsafe { CStr::from_ptr(e.message.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn round_trip_through_a_buffer_and_a_file() {
    let model = kvpage_fingerprint_from_u64(42);
    let tokens: Vec<u32> = (100..111).collect();
    for &dtype in cases(&[KVPAGE_DTYPE_F16, KVPAGE_DTYPE_F32, KVPAGE_DTYPE_BF16], 1) {
        let a = Cache::new(params(dtype, 4));
        let s = a.seq(&tokens, 1);
        let blob = a.save(s, Some(&tokens), &model);
        let b = Cache::new(params(dtype, 4));
        let _other = b.seq(&[1, 2, 3], 2);
        let (code, _, (r, len, ids, n)) = b.restore(&blob, &model, 16);
        assert_eq!(code, KVPAGE_OK);
        assert_eq!((len, n), (11, 11));
        assert_eq!(&ids[..11], &tokens[..]);
        assert!(ids[11..].iter().all(|&x| x == u32::MAX));
        assert_same_output(&b.decode(r), &a.decode(s));
        // Without ids: n is 0, nothing written to the id buffer.
        let blob = a.save(s, None, &model);
        let (code, _, (_, _, ids, n)) = b.restore(&blob, &model, 4);
        assert_eq!((code, n), (KVPAGE_OK, 0));
        assert!(ids.iter().all(|&x| x == u32::MAX));

        // A file (not under Miri, whose isolation forbids the file system).
        if cfg!(miri) {
            continue;
        }
        let dir =
            std::env::temp_dir().join(format!("kvpage-ffi-blob-{}-{dtype}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = std::ffi::CString::new(dir.join("s.kv").to_str().unwrap()).unwrap();
        // SAFETY: live caches, valid strings and buffers.
        unsafe {
            let code = kvpage_cache_seq_save_file(
                a.0,
                s,
                tokens.as_ptr(),
                tokens.len(),
                &model,
                path.as_ptr(),
                null_mut(),
            );
            assert_eq!(code, KVPAGE_OK);
            let c = Cache::new(params(dtype, 4));
            let (mut r, mut len) = (KVPAGE_SEQ_NONE, 0);
            let code = kvpage_cache_seq_restore_file(
                c.0,
                path.as_ptr(),
                0,
                &model,
                &mut r,
                &mut len,
                null_mut(),
                0,
                null_mut(),
                null_mut(),
            );
            assert_eq!((code, len), (KVPAGE_OK, 11));
            assert_same_output(&c.decode(r), &a.decode(s));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn bad_input_and_damaged_blobs_return_their_codes_and_change_nothing() {
    let model = kvpage_fingerprint_from_u64(42);
    let tokens: Vec<u32> = (0..9).collect();
    let a = Cache::new(params(KVPAGE_DTYPE_F16, 4));
    let s = a.seq(&tokens, 3);
    let blob = a.save(s, Some(&tokens), &model);
    let b = Cache::new(params(KVPAGE_DTYPE_F16, 4));
    let _held = b.seq(&[7; 5], 4);
    let before = b.stats();
    let check = |bad: &[u8], model: *const kvpage_fingerprint, room: usize, code, value| {
        let (got, e, (s, len, ids, n)) = b.restore(bad, model, room);
        assert_eq!(got, code, "{}", message(&e));
        assert_eq!(e.code, code);
        if let Some(v) = value {
            assert_eq!(e.value, v);
        }
        assert_eq!(
            (s, len, n),
            (KVPAGE_SEQ_NONE, u32::MAX, usize::MAX),
            "outs untouched"
        );
        assert!(ids.iter().all(|&x| x == u32::MAX));
        assert_eq!(b.stats(), before);
        e
    };
    let mut bad = blob.clone();
    bad[0] = b'X';
    check(&bad, &model, 16, KVPAGE_ERR_BLOB_FORMAT, None);
    let mut bad = blob.clone();
    bad[8] = 7;
    check(&bad, &model, 16, KVPAGE_ERR_BLOB_VERSION, Some(7));
    let mut bad = blob.clone();
    bad[20] ^= 1;
    check(&bad, &model, 16, KVPAGE_ERR_BLOB_CORRUPT, Some(0));
    let mut bad = blob.clone();
    let last = bad.len() - 30;
    bad[last] ^= 1;
    check(&bad, &model, 16, KVPAGE_ERR_BLOB_CORRUPT, Some(3));
    let e = check(
        &blob[..blob.len() - 1],
        &model,
        16,
        KVPAGE_ERR_BLOB_TRUNCATED,
        None,
    );
    assert_eq!(
        (e.needed, e.available),
        (blob.len() as u64, blob.len() as u64 - 1)
    );
    check(
        &blob,
        &kvpage_fingerprint_from_u64(43),
        16,
        KVPAGE_ERR_BLOB_MODEL,
        None,
    );
    check(&blob, null(), 16, KVPAGE_ERR_NULL_POINTER, None);
    let e = check(&blob, &model, 8, KVPAGE_ERR_BUFFER_TOO_SMALL, None);
    assert_eq!((e.needed, e.available), (9, 8));
    let other = Cache::new(params(KVPAGE_DTYPE_F16, 8));
    let (code, _, _) = other.restore(&blob, &model, 16);
    assert_eq!(code, KVPAGE_ERR_BLOB_GEOMETRY);
    let other = Cache::new(params(KVPAGE_DTYPE_BF16, 4));
    let (code, _, _) = other.restore(&blob, &model, 16);
    assert_eq!(code, KVPAGE_ERR_DTYPE_MISMATCH);

    // Saves: wrong id count, short buffer, null model, stale sequence: nothing written.
    let mut out = vec![0x77u8; blob.len()];
    let mut written = usize::MAX;
    let save = |toks: *const u32,
                n: usize,
                m: *const kvpage_fingerprint,
                out: &mut [u8],
                w: &mut usize| {
        let mut e = err();
        // SAFETY: live cache, buffers of the lengths given.
        let code = unsafe {
            kvpage_cache_seq_save(a.0, s, toks, n, m, out.as_mut_ptr(), out.len(), w, &mut e)
        };
        (code, e)
    };
    let (code, e) = save(tokens.as_ptr(), 8, &model, &mut out, &mut written);
    assert_eq!(
        (code, e.needed, e.available),
        (KVPAGE_ERR_INVALID_ARGUMENT, 9, 8)
    );
    let (code, _) = save(null(), 3, &model, &mut out, &mut written);
    assert_eq!(code, KVPAGE_ERR_NULL_POINTER);
    let (code, _) = save(tokens.as_ptr(), 9, null(), &mut out, &mut written);
    assert_eq!(code, KVPAGE_ERR_NULL_POINTER);
    let (code, e) = save(tokens.as_ptr(), 9, &model, &mut out[..10], &mut written);
    assert_eq!(
        (code, e.needed, e.available),
        (KVPAGE_ERR_BUFFER_TOO_SMALL, blob.len() as u64, 10)
    );
    assert!(out.iter().all(|&x| x == 0x77));
    assert_eq!(written, usize::MAX);

    assert_eq!(b.stats(), before);
    if cfg!(miri) {
        return;
    }
    // Files: a directory that does not exist; a path that is empty or null.
    let missing = c"/nonexistent-kvpage-dir/s.kv";
    let empty: &CStr = c"";
    for (path, code) in [
        (missing.as_ptr(), KVPAGE_ERR_IO),
        (empty.as_ptr(), KVPAGE_ERR_INVALID_ARGUMENT),
        (null::<c_char>(), KVPAGE_ERR_NULL_POINTER),
    ] {
        let mut e = err();
        // SAFETY: live caches; the path is null or a valid string.
        unsafe {
            let got = kvpage_cache_seq_save_file(a.0, s, null(), 0, &model, path, &mut e);
            assert_eq!(got, code, "{}", message(&e));
            let mut r = KVPAGE_SEQ_NONE;
            let got = kvpage_cache_seq_restore_file(
                b.0,
                path,
                0,
                &model,
                &mut r,
                null_mut(),
                null_mut(),
                0,
                null_mut(),
                &mut e,
            );
            assert_eq!((got, r), (code, KVPAGE_SEQ_NONE));
            if code == KVPAGE_ERR_IO {
                assert_eq!(e.value, 2, "ENOENT: {}", message(&e));
            }
        }
    }
    assert_eq!(b.stats(), before);
}
