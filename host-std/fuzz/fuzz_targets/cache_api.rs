//! The owned `KvCache`'s API with random geometries (layers, heads, head dims, block
//! sizes, dtypes, capacities), random buffer sizes and random handles (live, released,
//! from another cache): no panic; every error is one of the variants the method
//! documents; a failed call changes nothing (stats, the length of every handle ever
//! issued, the arena's bytes, and the caller's output buffer are compared before and
//! after); a successful one has the documented effect on lengths and stats.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use kvpage::{
    bf16, f16, CacheConfig, CacheError, Capacity, DType, Geometry, KernelError, KvCache, Seq,
    SeqError,
};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Setup {
    layers: u8,
    kv_heads: u8,
    head_dim: u8,
    block_size: u8,
    dtype: u8,
    capacity: u8,
    by_bytes: bool,
    max_seqs: u8,
    max_seq_len: u8,
    two_threads: bool,
}

/// A length near `exact` (what the shapes require): exact, one off either way, 0 or
/// something else small.
#[derive(Debug, Clone, Copy, Arbitrary)]
enum Len {
    Exact,
    Less,
    More,
    Zero,
    Small(u8),
}

impl Len {
    fn get(self, exact: usize) -> usize {
        match self {
            Len::Exact => exact,
            Len::Less => exact.saturating_sub(1),
            Len::More => exact + 1,
            Len::Zero => 0,
            Len::Small(x) => usize::from(x),
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Num {
    Small(u8),
    Max,
    Any(u32),
}

impl Num {
    fn get(self) -> u32 {
        match self {
            Num::Small(x) => u32::from(x % 48),
            Num::Max => u32::MAX,
            Num::Any(x) => x,
        }
    }
}

#[derive(Debug, Arbitrary)]
enum Op {
    Create {
        ns: u8,
    },
    CreatePrompt {
        ns: u8,
        len: u8,
        base: u8,
    },
    AppendTokens {
        seq: u8,
        len: u8,
        base: u8,
    },
    Append {
        seq: u8,
        n: Num,
    },
    Commit {
        seq: u8,
    },
    Fork {
        seq: u8,
    },
    Truncate {
        seq: u8,
        to: Num,
    },
    Release {
        seq: u8,
    },
    Evict {
        n: Num,
    },
    WriteKv {
        seq: u8,
        layer: Num,
        first: Num,
        tokens: u8,
        k: Len,
        v: Len,
        as_dtype: u8,
    },
    Decode {
        layer: Num,
        seqs: Vec<u8>,
        q: Len,
        out: Len,
        q_heads: u8,
        scale: u8,
    },
    Prefill {
        layer: Num,
        seqs: Vec<(u8, u8)>,
        q: Len,
        out: Len,
        q_heads: u8,
        scale: u8,
    },
    Foreign {
        op: u8,
    },
}

fn geometry(s: &Setup) -> Result<Geometry, kvpage::GeometryError> {
    let dtype = match s.dtype % 5 {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Bf16,
        3 => DType::Int8,
        _ => DType::Fp8E4m3,
    };
    // Head dims past the kernels' maximum (256) are refused by `new`.
    let head_dim = match s.head_dim {
        255 => 257,
        d => u32::from(d % 9),
    };
    Geometry::new(
        u32::from(s.layers % 4),
        u32::from(s.kv_heads % 4),
        head_dim,
        u32::from(s.block_size % 6),
        dtype,
    )
}

/// Everything a failed call must leave as it was.
#[derive(Debug, PartialEq)]
struct Snapshot {
    stats: kvpage::Stats,
    lens: Vec<Result<u32, CacheError>>,
    arena: Vec<u16>,
}

fn snapshot(cache: &KvCache, issued: &[Seq]) -> Snapshot {
    Snapshot {
        stats: cache.stats(),
        lens: issued.iter().map(|&s| cache.len(s)).collect(),
        arena: cache
            .arena()
            .as_slice::<f16>()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
    }
}

/// A call's result, whether an error is one the method documents, and the caller's
/// output buffer before and after (attention calls).
type Outcome = (
    Result<(), CacheError>,
    fn(&CacheError) -> bool,
    Option<(Vec<f32>, Vec<f32>)>,
);

fn scale(x: u8) -> f32 {
    match x % 5 {
        0 => 0.5,
        1 => f32::NAN,
        2 => f32::INFINITY,
        3 => 0.0,
        _ => -1.0,
    }
}

fn handle_error(e: &CacheError) -> bool {
    matches!(
        e,
        CacheError::Seq(SeqError::StaleHandle | SeqError::ForeignHandle)
    )
}

fn kernel_input_error(e: &CacheError) -> bool {
    matches!(
        e,
        CacheError::Kernel(
            KernelError::BufferLength { .. }
                | KernelError::LayerOutOfRange { .. }
                | KernelError::HeadsNotDivisible { .. }
                | KernelError::BadScale
                | KernelError::QueriesExceedContext { .. }
        )
    )
}

fn write<T: kvpage::Element>(
    cache: &mut KvCache,
    seq: Seq,
    layer: u32,
    first: u32,
    k: usize,
    v: usize,
    value: fn(f32) -> T,
) -> Result<(), CacheError> {
    let kb: Vec<T> = (0..k).map(|i| value(i as f32 * 0.25)).collect();
    let vb: Vec<T> = (0..v).map(|i| value(1.0 - i as f32 * 0.5)).collect();
    cache.write_kv_as::<T>(seq, layer, first, &kb, &vb)
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(setup) = Setup::arbitrary(&mut u) else {
        return;
    };
    let geometry = match geometry(&setup) {
        Ok(g) => g,
        Err(_) => return,
    };
    let capacity = if setup.by_bytes {
        Capacity::Bytes(u64::from(setup.capacity) * 16 * geometry.bytes_per_token() / 8)
    } else {
        Capacity::Blocks(u32::from(setup.capacity % 25))
    };
    let config = CacheConfig {
        geometry,
        capacity,
        max_seqs: u32::from(setup.max_seqs % 6),
        max_seq_len: u32::from(setup.max_seq_len % 48),
        threads: 1 + usize::from(setup.two_threads),
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    };
    let mut cache = match KvCache::new(config) {
        Ok(c) => c,
        Err(e) => {
            assert!(
                matches!(
                    e,
                    CacheError::BadConfig
                        | CacheError::Init(_)
                        | CacheError::Kernel(
                            KernelError::HeadDimTooLarge { .. } | KernelError::BadLayout
                        )
                ),
                "{config:?}: {e:?}"
            );
            return;
        }
    };
    let row = (geometry.kv_heads() * geometry.head_dim()) as usize;
    let hd = geometry.head_dim() as usize;
    let mut issued: Vec<Seq> = Vec::new();
    let mut other: Option<(KvCache, Seq)> = None;
    let pick =
        |issued: &[Seq], k: u8| (!issued.is_empty()).then(|| issued[k as usize % issued.len()]);
    let mut steps = 0;
    while !u.is_empty() && steps < 48 {
        steps += 1;
        let Ok(op) = Op::arbitrary(&mut u) else {
            break;
        };
        let before = snapshot(&cache, &issued);
        // Result of the call, whether a failure is one it documents, and the caller's
        // output buffer (before, after) for the attention calls.
        let (result, documented, out): Outcome = match op {
            Op::Create { ns } => {
                let r = cache.create(u64::from(ns % 2));
                if let Ok(s) = r {
                    assert_eq!(cache.len(s), Ok(0));
                    issued.push(s);
                }
                (
                    r.map(|_| ()),
                    |e| matches!(e, CacheError::Seq(SeqError::NoFreeSequence)),
                    None,
                )
            }
            Op::CreatePrompt { ns, len, base } => {
                let prompt: Vec<u32> = (0..u32::from(len % 50))
                    .map(|i| u32::from(base % 3) * 100 + i % 5)
                    .collect();
                let r = cache.create_with_prompt(u64::from(ns % 2), &prompt);
                if let Ok(p) = r {
                    assert_eq!(cache.len(p.seq), Ok(prompt.len() as u32));
                    assert!(p.reused_tokens < prompt.len() as u32 || p.reused_tokens == 0);
                    assert_eq!(p.reused_tokens % geometry.block_size(), 0);
                    issued.push(p.seq);
                }
                (
                    r.map(|_| ()),
                    |e| {
                        matches!(
                            e,
                            CacheError::Seq(
                                SeqError::NoFreeSequence
                                    | SeqError::TooLong { .. }
                                    | SeqError::OutOfBlocks { .. }
                            )
                        )
                    },
                    None,
                )
            }
            Op::AppendTokens { seq, len, base } => match pick(&issued, seq) {
                None => continue,
                Some(s) => {
                    let tokens: Vec<u32> = (0..u32::from(len % 20))
                        .map(|i| u32::from(base % 3) * 100 + i % 5)
                        .collect();
                    let old = cache.len(s);
                    let r = cache.append_tokens(s, &tokens);
                    if r.is_ok() {
                        assert_eq!(cache.len(s), Ok(old.unwrap() + tokens.len() as u32));
                    }
                    (
                        r,
                        |e| {
                            handle_error(e)
                                || matches!(
                                    e,
                                    CacheError::Seq(
                                        SeqError::TooLong { .. } | SeqError::OutOfBlocks { .. }
                                    )
                                )
                        },
                        None,
                    )
                }
            },
            Op::Append { seq, n } => match pick(&issued, seq) {
                None => continue,
                Some(s) => {
                    let old = cache.len(s);
                    let r = cache.append(s, n.get());
                    if r.is_ok() {
                        assert_eq!(cache.len(s), Ok(old.unwrap() + n.get()));
                    }
                    (
                        r,
                        |e| {
                            handle_error(e)
                                || matches!(
                                    e,
                                    CacheError::Seq(
                                        SeqError::TooLong { .. } | SeqError::OutOfBlocks { .. }
                                    )
                                )
                        },
                        None,
                    )
                }
            },
            Op::Commit { seq } => match pick(&issued, seq) {
                None => continue,
                Some(s) => (cache.commit(s).map(|_| ()), handle_error, None),
            },
            Op::Fork { seq } => match pick(&issued, seq) {
                None => continue,
                Some(s) => {
                    let r = cache.fork(s);
                    if let Ok(c) = r {
                        assert_eq!(cache.len(c), cache.len(s));
                        issued.push(c);
                    }
                    (
                        r.map(|_| ()),
                        |e| {
                            handle_error(e)
                                || matches!(e, CacheError::Seq(SeqError::NoFreeSequence))
                        },
                        None,
                    )
                }
            },
            Op::Truncate { seq, to } => match pick(&issued, seq) {
                None => continue,
                Some(s) => {
                    let r = cache.truncate(s, to.get());
                    if r.is_ok() {
                        assert_eq!(cache.len(s), Ok(to.get()));
                    }
                    (
                        r,
                        |e| {
                            handle_error(e)
                                || matches!(e, CacheError::Seq(SeqError::BeyondLength { .. }))
                        },
                        None,
                    )
                }
            },
            Op::Release { seq } => match pick(&issued, seq) {
                None => continue,
                Some(s) => {
                    let r = cache.release(s);
                    if r.is_ok() {
                        assert_eq!(cache.len(s), Err(CacheError::Seq(SeqError::StaleHandle)));
                    }
                    (r, handle_error, None)
                }
            },
            Op::Evict { n } => {
                let cached = cache.stats().cached_blocks;
                let evicted = cache.evict_cached(n.get());
                assert_eq!(evicted, cached.min(n.get()));
                (Ok(()), |_| false, None)
            }
            Op::WriteKv {
                seq,
                layer,
                first,
                tokens,
                k,
                v,
                as_dtype,
            } => match pick(&issued, seq) {
                None => continue,
                Some(s) => {
                    let exact = usize::from(tokens % 12) * row;
                    let (k, v) = (k.get(exact), v.get(exact));
                    let (layer, first) = (layer.get() % 5, first.get());
                    let r = match as_dtype % 4 {
                        0 => {
                            let kb: Vec<f32> = (0..k).map(|i| i as f32).collect();
                            let vb: Vec<f32> = (0..v).map(|i| -(i as f32)).collect();
                            cache.write_kv(s, layer, first, &kb, &vb)
                        }
                        1 => write::<f32>(&mut cache, s, layer, first, k, v, |x| x),
                        2 => write::<f16>(&mut cache, s, layer, first, k, v, f16::from_f32),
                        _ => write::<bf16>(&mut cache, s, layer, first, k, v, bf16::from_f32),
                    };
                    (
                        r,
                        |e| {
                            handle_error(e)
                                || kernel_input_error(e)
                                || matches!(
                                    e,
                                    CacheError::NotWritable { .. }
                                        | CacheError::Kernel(KernelError::DTypeMismatch { .. })
                                )
                        },
                        None,
                    )
                }
            },
            Op::Decode {
                layer,
                seqs,
                q,
                out,
                q_heads,
                scale: sc,
            } => {
                let seqs: Vec<Seq> = seqs
                    .iter()
                    .take(8)
                    .filter_map(|&k| pick(&issued, k))
                    .collect();
                let q_heads = u32::from(q_heads % 9);
                let exact = seqs.len() * q_heads as usize * hd;
                let qb: Vec<f32> = (0..q.get(exact)).map(|i| (i % 7) as f32).collect();
                let mut ob = vec![f32::from_bits(0x7fc0_1234); out.get(exact)];
                let before_out = ob.clone();
                let r = cache.decode(layer.get() % 5, &seqs, &qb, &mut ob, q_heads, scale(sc));
                (
                    r,
                    |e| {
                        handle_error(e)
                            || kernel_input_error(e)
                            || matches!(e, CacheError::BatchTooLarge { .. })
                    },
                    Some((before_out, ob)),
                )
            }
            Op::Prefill {
                layer,
                seqs,
                q,
                out,
                q_heads,
                scale: sc,
            } => {
                let seqs: Vec<(Seq, u32)> = seqs
                    .iter()
                    .take(8)
                    .filter_map(|&(k, n)| pick(&issued, k).map(|s| (s, u32::from(n % 10))))
                    .collect();
                let q_heads = u32::from(q_heads % 9);
                let tokens: usize = seqs.iter().map(|&(_, n)| n as usize).sum();
                let exact = tokens * q_heads as usize * hd;
                let qb: Vec<f32> = (0..q.get(exact)).map(|i| (i % 5) as f32 * 0.1).collect();
                let mut ob = vec![f32::from_bits(0x7fc0_1234); out.get(exact)];
                let before_out = ob.clone();
                let r = cache.prefill(layer.get() % 5, &seqs, &qb, &mut ob, q_heads, scale(sc));
                (
                    r,
                    |e| {
                        handle_error(e)
                            || kernel_input_error(e)
                            || matches!(e, CacheError::BatchTooLarge { .. })
                    },
                    Some((before_out, ob)),
                )
            }
            Op::Foreign { op } => {
                // A handle of another cache is refused by every operation.
                if other.is_none() {
                    let mut c = KvCache::new(CacheConfig {
                        geometry,
                        capacity: Capacity::Blocks(4),
                        max_seqs: 2,
                        max_seq_len: 8,
                        threads: 1,
                        event_capacity: 0,
                        hash_key: None,
                        max_namespaces: kvpage::CACHE_NAMESPACES,
                    })
                    .expect("a small cache");
                    let s = c.create(0).expect("a sequence");
                    c.append(s, 3).expect("three tokens");
                    other = Some((c, s));
                }
                let s = other.as_ref().unwrap().1;
                let r = match op % 6 {
                    0 => cache.append(s, 1),
                    1 => cache.len(s).map(|_| ()),
                    2 => cache.fork(s).map(|_| ()),
                    3 => cache.release(s),
                    4 => cache.write_kv(s, 0, 0, &vec![0.0; row], &vec![0.0; row]),
                    _ => cache.commit(s).map(|_| ()),
                };
                assert!(r.is_err(), "a foreign handle was accepted");
                (
                    r,
                    |e| matches!(e, CacheError::Seq(SeqError::ForeignHandle)),
                    None,
                )
            }
        };
        if let Err(e) = result {
            assert!(documented(&e), "undocumented error {e:?}");
            assert_eq!(
                snapshot(&cache, &issued),
                before,
                "a failed call changed the state: {e:?}"
            );
            if let Some((a, b)) = out {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&a),
                    bits(&b),
                    "a failed attention call wrote its output: {e:?}"
                );
            }
        }
        let st = cache.stats();
        assert_eq!(
            st.free_blocks + st.cached_blocks + st.used_blocks,
            st.total_blocks
        );
    }
});
