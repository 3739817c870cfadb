//! The engine step through the C API: tier 1 (`kvpage_engine_*`) against the Rust
//! `kvpage::Engine`, tier 3 (`kvpage_scheduler_*` over a tier-2 `kvpage_manager`)
//! against the core `Engine` over a core `BlockManager`, and bad input to both.

mod common;

use core::ptr::null_mut;

use kvpage::ffi::*;
use kvpage::{
    CacheConfig, Capacity, DType, Engine, EngineConfig, Geometry, Preemption, RequestId, Sampled,
    SchedulerConfig, Step,
};
use kvpage_core::{BlockManager, Config, HostPool};

use common::{random_vec, rng};

// ---------------------------------------------------------------------------------
// Shared helpers: one plain record of a step, from either side.

/// `n` elements at `p` (NULL allowed for 0).
///
/// # Safety
/// `p` is readable for `n` elements when `n > 0`.
unsafe fn arr<T: Copy>(p: *const T, n: usize) -> Vec<T> {
    if n == 0 {
        return Vec::new();
    }
    assert!(!p.is_null());
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(p, n) }.to_vec()
}

fn rid(id: RequestId) -> kvpage_request {
    (u64::from(id.generation()) << 32) | u64::from(id.index())
}

/// What a step asks, comparable across the two sides.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Rec {
    /// (request, row, first_pos, tokens, offset, emits)
    seqs: Vec<(u64, u32, u32, u32, u32, bool)>,
    slots: Vec<u32>,
    tokens: Vec<u32>,
    copies: Vec<(u32, u32)>,
    swap_out: Vec<(u32, u32)>,
    swap_in: Vec<(u32, u32)>,
    preempted: usize,
}

fn rec_of_core(step: &Step<'_>) -> Rec {
    let pairs = |c: &[kvpage::BlockCopy]| c.iter().map(|c| (c.src, c.dst)).collect();
    Rec {
        seqs: step
            .seqs()
            .map(|s| {
                (
                    rid(s.request),
                    s.seq.index(),
                    s.first_pos,
                    s.tokens,
                    s.offset,
                    s.emits,
                )
            })
            .collect(),
        slots: step.slots().to_vec(),
        tokens: step.input_tokens().to_vec(),
        copies: pairs(step.copies()),
        swap_out: pairs(step.swap_out()),
        swap_in: pairs(step.swap_in()),
        preempted: step.preempted().len(),
    }
}

fn rec_of_c(step: &kvpage_step, seqs: &[kvpage_step_seq]) -> Rec {
    assert_eq!(step.num_seqs, seqs.len());
    // SAFETY: the step's arrays are live until the next mutating call.
    unsafe {
        let pairs = |p: *const kvpage_block_copy, n| {
            arr(p, n)
                .into_iter()
                .map(|c: kvpage_block_copy| (c.src, c.dst))
                .collect()
        };
        Rec {
            seqs: seqs
                .iter()
                .map(|s| {
                    (
                        s.request,
                        s.seq_row,
                        s.first_pos,
                        s.tokens,
                        s.offset,
                        s.emits != 0,
                    )
                })
                .collect(),
            slots: arr(step.slots, step.num_tokens),
            tokens: arr(step.input_tokens, step.num_tokens),
            copies: pairs(step.copies, step.num_copies),
            swap_out: pairs(step.swap_out, step.num_swap_out),
            swap_in: pairs(step.swap_in, step.num_swap_in),
            preempted: step.num_preempted,
        }
    }
}

/// The token sampled for request `r` whose context is `len` tokens: deterministic.
fn sample_token(r: u64, len: u32) -> u32 {
    ((r as u32).wrapping_mul(2_654_435_761) ^ len.wrapping_mul(40_503)) % 1000
}

/// Samples for the emitting sequences of a step; a request stops when its token is a
/// multiple of 97 (some do).
fn samples_for(rec: &Rec) -> Vec<kvpage_sampled> {
    rec.seqs
        .iter()
        .filter(|s| s.5)
        .map(|s| {
            let token = sample_token(s.0, s.2 + s.3);
            kvpage_sampled {
                request: s.0,
                token,
                stop: u32::from(token.is_multiple_of(97)),
            }
        })
        .collect()
}

fn to_rust(s: &kvpage_sampled) -> Sampled {
    Sampled {
        request: RequestId::from_parts(s.request as u32, (s.request >> 32) as u32),
        token: s.token,
        stop: s.stop != 0,
    }
}

fn ok(code: kvpage_result) {
    assert_eq!(code, kvpage_result::KVPAGE_OK);
}

// ---------------------------------------------------------------------------------
// Tier 1

const LAYERS: u32 = 2;
const KV_HEADS: u32 = 2;
const Q_HEADS: u32 = 4;
const HEAD_DIM: u32 = 8;

fn geometry_c() -> kvpage_geometry {
    kvpage_geometry {
        layers: LAYERS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        block_size: 4,
        dtype: KVPAGE_DTYPE_F32,
    }
}

fn engine_params() -> kvpage_engine_params {
    let mut p = kvpage_engine_default_params(geometry_c());
    p.cache.capacity_bytes = 0;
    p.cache.capacity_blocks = 48;
    p.cache.max_seqs = 8;
    p.cache.max_seq_len = 64;
    p.cache.threads = 1;
    p.max_requests = 8;
    p.scheduler = kvpage_scheduler_params {
        token_budget: 24,
        max_running: 8,
        watermark_blocks: 1,
        preemption: KVPAGE_PREEMPT_RECOMPUTE,
    };
    p
}

fn rust_engine() -> Engine {
    Engine::new(EngineConfig {
        cache: CacheConfig {
            geometry: Geometry::new(LAYERS, KV_HEADS, HEAD_DIM, 4, DType::F32).unwrap(),
            capacity: Capacity::Blocks(48),
            max_seqs: 8,
            max_seq_len: 64,
            threads: 1,
            event_capacity: 0,
            hash_key: None,
            max_namespaces: kvpage::CACHE_NAMESPACES,
        },
        max_requests: 8,
        scheduler: SchedulerConfig {
            token_budget: 24,
            max_running: 8,
            watermark_blocks: 1,
            preemption: Preemption::Recompute,
        },
        host_capacity: Capacity::Blocks(0),
    })
    .unwrap()
}

fn new_c_engine(p: &kvpage_engine_params) -> *mut kvpage_engine {
    let mut e = null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { kvpage_engine_new(p, &mut e, null_mut()) });
    e
}

fn c_step(e: *mut kvpage_engine) -> (kvpage_step, Vec<kvpage_step_seq>) {
    // SAFETY: live engine; buffers sized as passed.
    unsafe {
        let mut step = std::mem::zeroed::<kvpage_step>();
        ok(kvpage_engine_step(e, &mut step, null_mut()));
        let mut seqs = vec![kvpage_step_seq::default(); step.num_seqs];
        let mut n = usize::MAX;
        ok(kvpage_engine_step_seqs(
            e,
            seqs.as_mut_ptr(),
            seqs.len(),
            &mut n,
            null_mut(),
        ));
        assert_eq!(n, step.num_seqs);
        (step, seqs)
    }
}

fn c_commit(e: *mut kvpage_engine, samples: &[kvpage_sampled]) -> Vec<kvpage_finished> {
    let mut fin = vec![kvpage_finished::default(); samples.len()];
    let mut n = usize::MAX;
    // SAFETY: live engine; buffers sized as passed.
    ok(unsafe {
        kvpage_engine_commit_step(
            e,
            samples.as_ptr(),
            samples.len(),
            fin.as_mut_ptr(),
            fin.len(),
            &mut n,
            null_mut(),
        )
    });
    fin.truncate(n);
    fin
}

fn c_add(e: *mut kvpage_engine, ns: u64, prompt: &[u32], max_new: u32) -> kvpage_request {
    let mut r = KVPAGE_REQUEST_NONE;
    // SAFETY: live engine; prompt readable.
    ok(unsafe {
        kvpage_engine_add_request(
            e,
            ns,
            prompt.as_ptr(),
            prompt.len(),
            max_new,
            &mut r,
            null_mut(),
        )
    });
    r
}

#[test]
#[cfg_attr(
    miri,
    ignore = "minutes when interpreted (a whole engine run's attention); the engine's C \
              entry points run under Miri in the bad-input and tier-3 tests"
)]
fn tier1_c_engine_equals_the_rust_engine_bit_for_bit() {
    let p = engine_params();
    let ce = new_c_engine(&p);
    let mut re = rust_engine();
    let mut g = rng(8);
    let system: Vec<u32> = (1..=10).collect();
    let prompt = |tail: &[u32]| [system.as_slice(), tail].concat();
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();

    let add_both = |ce, re: &mut Engine, ns, pr: &[u32], max_new: u32| {
        let c = c_add(ce, ns, pr, max_new);
        let r = re
            .add_request(pr, ns, (max_new != 0).then_some(max_new))
            .unwrap();
        assert_eq!(c, rid(r));
        c
    };
    let a = add_both(ce, &mut re, 1, &prompt(&[100, 101]), 6);
    add_both(ce, &mut re, 1, &prompt(&[200]), 0);

    let (mut finished, mut forked, mut reused, mut copied, mut steps) = (0, false, false, false, 0);
    while steps < 100 {
        steps += 1;
        if steps == 3 {
            // Same namespace, same system prompt: served by the prefix cache.
            add_both(ce, &mut re, 1, &prompt(&[300, 301, 302]), 4);
        }
        let (cstep, cseqs) = c_step(ce);
        let crec = rec_of_c(&cstep, &cseqs);
        let rrec = rec_of_core(&re.step().unwrap());
        assert_eq!(crec, rrec, "step {steps}");
        copied |= !crec.copies.is_empty();
        if steps == 3 || steps == 4 {
            reused |= crec.seqs.iter().any(|s| s.0 != a && s.2 > 0 && s.3 > 1);
        }
        // The C block table is the cache's.
        let table = re.cache().block_manager().block_table();
        assert_eq!(
            cstep.block_table_rows as usize * cstep.block_table_stride as usize,
            table.len()
        );
        let n = crec.tokens.len();
        for layer in 0..LAYERS {
            let kv_len = n * (KV_HEADS * HEAD_DIM) as usize;
            let q_len = n * (Q_HEADS * HEAD_DIM) as usize;
            let (k, v, q) = (
                random_vec(&mut g, kv_len),
                random_vec(&mut g, kv_len),
                random_vec(&mut g, q_len),
            );
            let mut cout = vec![0.0f32; q_len];
            let mut rout = vec![0.0f32; q_len];
            // SAFETY: live engine; buffers of the lengths passed.
            unsafe {
                ok(kvpage_engine_write_kv(
                    ce,
                    layer,
                    k.as_ptr(),
                    k.len(),
                    v.as_ptr(),
                    v.len(),
                    null_mut(),
                ));
                ok(kvpage_engine_attention(
                    ce,
                    layer,
                    q.as_ptr(),
                    q.len(),
                    cout.as_mut_ptr(),
                    cout.len(),
                    Q_HEADS,
                    scale,
                    null_mut(),
                ));
            }
            re.write_kv(layer, &k, &v).unwrap();
            re.attention(layer, &q, &mut rout, Q_HEADS, scale).unwrap();
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&cout), bits(&rout), "step {steps} layer {layer}");
        }
        let samples = samples_for(&crec);
        let rs: Vec<Sampled> = samples.iter().map(to_rust).collect();
        let cf = c_commit(ce, &samples);
        let rf: Vec<kvpage_finished> = re
            .commit_step(&rs)
            .unwrap()
            .iter()
            .map(|f| kvpage_finished {
                request: rid(f.request),
                reason: f.reason as u32,
                generated: f.generated,
            })
            .collect();
        assert_eq!(cf, rf, "step {steps}");
        finished += cf.len();
        if steps == 4 {
            // Fork the first request with another last token.
            let mut child = 0;
            // SAFETY: live engine.
            ok(unsafe { kvpage_engine_fork(ce, a, 1, 7, &mut child, null_mut()) });
            let rchild = re
                .fork(RequestId::from_parts(a as u32, (a >> 32) as u32), Some(7))
                .unwrap();
            assert_eq!(child, rid(rchild));
            let mut toks = vec![0u32; 64];
            let mut nt = 0;
            // SAFETY: live engine; buffer of 64.
            ok(unsafe {
                kvpage_engine_request_tokens(ce, child, toks.as_mut_ptr(), 64, &mut nt, null_mut())
            });
            assert_eq!(&toks[..nt], re.tokens(rchild).unwrap());
            assert_eq!(toks[nt - 1], 7);
            forked = true;
        }
        let mut st = kvpage_engine_counters::default();
        let mut cs = kvpage_stats::default();
        // SAFETY: live engine.
        ok(unsafe { kvpage_engine_stats(ce, &mut st, &mut cs, null_mut()) });
        assert_eq!(st, re.stats().into_c());
        assert_eq!(cs.used_blocks, re.cache().stats().used_blocks);
        if re.in_flight() == 0 {
            break;
        }
    }
    assert!(
        forked && reused && copied,
        "the run forked, reused the prefix cache and copied on write"
    );
    assert_eq!(
        finished, 4,
        "all four requests (a fork included) finished in {steps} steps"
    );
    // SAFETY: from kvpage_engine_new, freed once.
    unsafe { ok(kvpage_engine_free(ce, null_mut())) };
}

/// The C record of Rust engine counters.
trait IntoC {
    fn into_c(self) -> kvpage_engine_counters;
}

impl IntoC for kvpage::EngineStats {
    fn into_c(self) -> kvpage_engine_counters {
        kvpage_engine_counters {
            steps: self.steps,
            admitted: self.admitted,
            finished: self.finished,
            recomputes: self.recomputes,
            swap_outs: self.swap_outs,
            swap_ins: self.swap_ins,
            recomputed_tokens: self.recomputed_tokens,
        }
    }
}

// ---------------------------------------------------------------------------------
// Tier 3

fn manager_config(host_blocks: u32, instance: u32) -> kvpage_manager_config {
    kvpage_manager_config {
        num_blocks: 14,
        block_size: 4,
        max_seqs: 6,
        max_blocks_per_seq: 8,
        instance,
        prefix_cache: 1,
        hash_key: 42,
        host_blocks,
        max_namespaces: 0,
    }
}

fn sched_config(preemption: u32) -> kvpage_scheduler_config {
    kvpage_scheduler_config {
        max_requests: 6,
        scheduler: kvpage_scheduler_params {
            token_budget: 16,
            max_running: 6,
            watermark_blocks: 1,
            preemption,
        },
    }
}

/// A C manager and a C scheduler in their own storage (kept alive by the vectors).
struct CTier3 {
    _mstore: Vec<u64>,
    _sstore: Vec<u64>,
    m: *mut kvpage_manager,
    s: *mut kvpage_scheduler,
}

fn c_manager(mc: &kvpage_manager_config) -> (Vec<u64>, *mut kvpage_manager) {
    // SAFETY: valid pointers; storage of the size asked.
    unsafe {
        let mut bytes = 0;
        ok(kvpage_manager_storage_size(mc, &mut bytes, null_mut()));
        let mut store = vec![0u64; bytes.div_ceil(8)];
        let mut m = null_mut();
        ok(kvpage_manager_init(
            mc,
            store.as_mut_ptr().cast(),
            bytes,
            &mut m,
            null_mut(),
        ));
        (store, m)
    }
}

fn c_tier3(mc: &kvpage_manager_config, sc: &kvpage_scheduler_config) -> CTier3 {
    let (mstore, m) = c_manager(mc);
    // SAFETY: valid pointers; storage of the size asked.
    unsafe {
        let mut bytes = 0;
        ok(kvpage_scheduler_storage_size(
            mc,
            sc,
            &mut bytes,
            null_mut(),
        ));
        assert_eq!(kvpage_scheduler_storage_align(), 8);
        let mut sstore = vec![0u64; bytes.div_ceil(8)];
        let mut s = null_mut();
        ok(kvpage_scheduler_init(
            m,
            sc,
            sstore.as_mut_ptr().cast(),
            bytes,
            &mut s,
            null_mut(),
        ));
        CTier3 {
            _mstore: mstore,
            _sstore: sstore,
            m,
            s,
        }
    }
}

fn run_tier3_against_core(preemption: u32) -> kvpage_engine_counters {
    let host_blocks = 16;
    let mc = manager_config(host_blocks, 7);
    let sc = sched_config(preemption);
    let c = c_tier3(&mc, &sc);

    let config = Config {
        num_blocks: mc.num_blocks,
        block_size: mc.block_size,
        max_seqs: mc.max_seqs,
        max_blocks_per_seq: mc.max_blocks_per_seq,
        instance: mc.instance,
        hash_key: mc.hash_key,
        prefix_cache: true,
        max_position_runs: 4,
        max_namespaces: 0,
        event_capacity: 0,
    };
    let mut mwords = vec![0u64; config.storage_words()];
    let mut kv = BlockManager::new(config, &mut mwords).unwrap();
    let mut hwords = vec![0u32; HostPool::storage_words(host_blocks)];
    let mut host = HostPool::new(host_blocks, mc.instance, &mut hwords).unwrap();
    let ecfg = kvpage_core::EngineConfig {
        max_requests: sc.max_requests,
        scheduler: SchedulerConfig {
            token_budget: 16,
            max_running: 6,
            watermark_blocks: 1,
            preemption: if preemption == KVPAGE_PREEMPT_SWAP {
                Preemption::Swap
            } else {
                Preemption::Recompute
            },
        },
        host_blocks,
    };
    let mut ewords = vec![0u64; ecfg.storage_words(&config)];
    let mut core = kvpage_core::Engine::new(ecfg, &config, &mut ewords).unwrap();

    // Five requests of 9..13 prompt tokens generating 10 each: more than 14 blocks of
    // 4 tokens, so running sequences grow into preemption.
    for r in 0..5u32 {
        let prompt: Vec<u32> = (0..9 + r).map(|t| 1000 * r + t).collect();
        let mut cid = 0;
        // SAFETY: live scheduler; prompt readable.
        ok(unsafe {
            kvpage_scheduler_add_request(
                c.s,
                u64::from(r % 2),
                prompt.as_ptr(),
                prompt.len(),
                10,
                &mut cid,
                null_mut(),
            )
        });
        let id = core
            .add_request(&prompt, u64::from(r % 2), Some(10))
            .unwrap();
        assert_eq!(cid, rid(id));
    }
    let mut steps = 0;
    while core.in_flight() > 0 {
        steps += 1;
        assert!(steps < 200, "the run ends");
        // SAFETY: live scheduler and manager; buffers sized as passed.
        let (cstep, cseqs) = unsafe {
            let mut step = std::mem::zeroed::<kvpage_step>();
            ok(kvpage_scheduler_step(c.s, c.m, &mut step, null_mut()));
            let mut seqs = vec![kvpage_step_seq::default(); step.num_seqs];
            let mut n = 0;
            ok(kvpage_scheduler_step_seqs(
                c.s,
                seqs.as_mut_ptr(),
                seqs.len(),
                &mut n,
                null_mut(),
            ));
            (step, seqs)
        };
        let crec = rec_of_c(&cstep, &cseqs);
        let rstep = core.step(&mut kv, Some(&mut host)).unwrap();
        let rrec = rec_of_core(&rstep);
        assert_eq!(crec, rrec, "step {steps}");
        // The step's block table is the manager's and equals the core's.
        // SAFETY: rows × stride entries, live until the next mutating call.
        let table = unsafe {
            arr(
                cstep.block_table,
                (cstep.block_table_rows * cstep.block_table_stride) as usize,
            )
        };
        let stride = cstep.block_table_stride as usize;
        for s in &crec.seqs {
            let blocks = (s.2 + s.3).div_ceil(mc.block_size) as usize;
            let row = s.1 as usize * stride;
            assert_eq!(
                table[row..row + blocks],
                kv.block_table()[row..row + blocks]
            );
        }
        let samples = samples_for(&crec);
        let rs: Vec<Sampled> = samples.iter().map(to_rust).collect();
        let mut fin = vec![kvpage_finished::default(); samples.len()];
        let mut nf = 0;
        // SAFETY: live scheduler and manager; buffers sized as passed.
        ok(unsafe {
            kvpage_scheduler_commit_step(
                c.s,
                c.m,
                samples.as_ptr(),
                samples.len(),
                fin.as_mut_ptr(),
                fin.len(),
                &mut nf,
                null_mut(),
            )
        });
        let rf: Vec<_> = core
            .commit_step(&mut kv, &rs)
            .unwrap()
            .iter()
            .map(|f| (rid(f.request), f.reason as u32, f.generated))
            .collect();
        let cf: Vec<_> = fin[..nf]
            .iter()
            .map(|f| (f.request, f.reason, f.generated))
            .collect();
        assert_eq!(cf, rf, "step {steps}");
    }
    let mut st = kvpage_engine_counters::default();
    // SAFETY: live scheduler.
    ok(unsafe { kvpage_scheduler_stats(c.s, &mut st, null_mut()) });
    assert_eq!(st, core.stats().into_c());
    st
}

#[test]
fn tier3_c_scheduler_equals_the_core_engine_with_recompute() {
    let st = run_tier3_against_core(KVPAGE_PREEMPT_RECOMPUTE);
    assert!(st.recomputes > 0 && st.finished == 5, "{st:?}");
}

#[test]
fn tier3_c_scheduler_equals_the_core_engine_with_swap() {
    let st = run_tier3_against_core(KVPAGE_PREEMPT_SWAP);
    assert!(
        st.swap_outs > 0 && st.swap_ins > 0 && st.finished == 5,
        "{st:?}"
    );
}

// ---------------------------------------------------------------------------------
// Bad input

use kvpage_result::*;

/// Runs `f` with an error struct and returns the code and the struct.
fn call(f: impl FnOnce(*mut kvpage_error) -> kvpage_result) -> (kvpage_result, kvpage_error) {
    // SAFETY: zeroed is a valid kvpage_error (code 0, empty message).
    let mut e = unsafe { std::mem::zeroed::<kvpage_error>() };
    let code = f(&mut e);
    if code != KVPAGE_OK {
        assert_eq!(e.code, code, "the error struct carries the code");
    }
    (code, e)
}

fn code(f: impl FnOnce(*mut kvpage_error) -> kvpage_result) -> kvpage_result {
    call(f).0
}

/// Steps and commits `n` times with the deterministic samples; the steps' records and
/// finished lists.
fn drive_engine(e: *mut kvpage_engine, n: usize) -> Vec<(Rec, Vec<kvpage_finished>)> {
    (0..n)
        .map(|_| {
            let (step, seqs) = c_step(e);
            let rec = rec_of_c(&step, &seqs);
            let fin = c_commit(e, &samples_for(&rec));
            (rec, fin)
        })
        .collect()
}

#[test]
fn tier1_bad_input_is_refused_with_its_code_and_changes_nothing() {
    let p = engine_params();
    let mut engine = null_mut();
    // SAFETY: every pointer is null, valid, or deliberately wrong in a checked way.
    unsafe {
        assert_eq!(
            code(|e| kvpage_engine_new(null_mut(), &mut engine, e)),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            code(|e| kvpage_engine_new(&p, null_mut(), e)),
            KVPAGE_ERR_NULL_POINTER
        );
        let d = kvpage_engine_default_params(kvpage_geometry {
            layers: 0,
            ..geometry_c()
        });
        assert_eq!(
            code(|e| kvpage_engine_new(&d, &mut engine, e)),
            KVPAGE_ERR_BAD_CONFIG
        );
        for bad in [
            kvpage_engine_params {
                cache: kvpage_cache_params {
                    capacity_blocks: 1 << 30,
                    ..p.cache
                },
                ..p
            },
            kvpage_engine_params {
                max_requests: 0,
                ..p
            },
            kvpage_engine_params {
                scheduler: kvpage_scheduler_params {
                    max_running: 0,
                    ..p.scheduler
                },
                ..p
            },
        ] {
            assert_eq!(
                code(|e| kvpage_engine_new(&bad, &mut engine, e)),
                KVPAGE_ERR_BAD_CONFIG
            );
        }
        let bad = kvpage_engine_params {
            scheduler: kvpage_scheduler_params {
                preemption: 9,
                ..p.scheduler
            },
            ..p
        };
        assert_eq!(
            code(|e| kvpage_engine_new(&bad, &mut engine, e)),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
        for bad in [
            kvpage_engine_params {
                cache: kvpage_cache_params {
                    geometry: kvpage_geometry {
                        dtype: 7,
                        ..p.cache.geometry
                    },
                    ..p.cache
                },
                ..p
            },
            kvpage_engine_params {
                cache: kvpage_cache_params {
                    capacity_bytes: 1 << 20,
                    ..p.cache
                },
                ..p
            },
            kvpage_engine_params {
                cache: kvpage_cache_params {
                    capacity_blocks: 0,
                    ..p.cache
                },
                ..p
            },
            kvpage_engine_params {
                host_capacity_blocks: 4,
                host_capacity_bytes: 4096,
                ..p
            },
        ] {
            assert_eq!(
                code(|e| kvpage_engine_new(&bad, &mut engine, e)),
                KVPAGE_ERR_INVALID_ARGUMENT
            );
        }
        assert!(engine.is_null(), "no out-parameter written on failure");
        ok(kvpage_engine_free(null_mut(), null_mut()));
    }

    let ce = new_c_engine(&p);
    let clean = new_c_engine(&p);
    let prompts: [Vec<u32>; 2] = [(1..7).collect(), (1..31).collect()];
    let mut ids = vec![];
    for (i, pr) in prompts.iter().enumerate() {
        ids.push(c_add(ce, 3, pr, 3 + i as u32));
        c_add(clean, 3, pr, 3 + i as u32);
    }
    let stale = ids[0] ^ (1 << 40);
    let mut toks = [0u32; 64];
    let mut n = 777usize;
    let mut state = 9u32;
    let mut st = kvpage_engine_counters::default();
    // SAFETY: as above; `garbage` is readable memory without the magic word.
    unsafe {
        let garbage = [0u64; 64];
        let fake = garbage.as_ptr() as *mut kvpage_engine;
        let mut step = std::mem::zeroed::<kvpage_step>();
        assert_eq!(
            code(|e| kvpage_engine_step(null_mut(), &mut step, e)),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            code(|e| kvpage_engine_step(fake, &mut step, e)),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
        assert_eq!(
            code(|e| kvpage_engine_step(ce, null_mut(), e)),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            code(|e| kvpage_engine_stats(ce, null_mut(), null_mut(), e)),
            KVPAGE_ERR_NULL_POINTER
        );
        // Without a step.
        let s = [kvpage_sampled {
            request: ids[0],
            token: 1,
            stop: 0,
        }];
        let mut fin = [kvpage_finished::default(); 4];
        assert_eq!(
            code(|e| kvpage_engine_commit_step(ce, s.as_ptr(), 1, fin.as_mut_ptr(), 4, &mut n, e)),
            KVPAGE_ERR_NO_STEP_IN_PROGRESS
        );
        let mut seqs = [kvpage_step_seq::default(); 8];
        assert_eq!(
            code(|e| kvpage_engine_step_seqs(ce, seqs.as_mut_ptr(), 8, &mut n, e)),
            KVPAGE_ERR_NO_STEP_IN_PROGRESS
        );
        let kv = [0.0f32; 1024];
        let mut out = [0.0f32; 1024];
        assert_eq!(
            code(|e| kvpage_engine_write_kv(ce, 0, kv.as_ptr(), 0, kv.as_ptr(), 0, e)),
            KVPAGE_ERR_NO_STEP_IN_PROGRESS
        );
        assert_eq!(
            code(|e| kvpage_engine_attention(
                ce,
                0,
                kv.as_ptr(),
                0,
                out.as_mut_ptr(),
                0,
                4,
                1.0,
                e
            )),
            KVPAGE_ERR_NO_STEP_IN_PROGRESS
        );
        // Prompts and ids.
        let mut r = KVPAGE_REQUEST_NONE;
        assert_eq!(
            code(|e| kvpage_engine_add_request(ce, 0, toks.as_ptr(), 0, 0, &mut r, e)),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
        assert_eq!(
            code(|e| kvpage_engine_add_request(ce, 0, null_mut(), 3, 0, &mut r, e)),
            KVPAGE_ERR_NULL_POINTER
        );
        let long = [1u32; 65];
        assert_eq!(
            code(|e| kvpage_engine_add_request(ce, 0, long.as_ptr(), 65, 0, &mut r, e)),
            KVPAGE_ERR_SEQ_TOO_LONG
        );
        assert_eq!(r, KVPAGE_REQUEST_NONE);
        for bad_id in [stale, KVPAGE_REQUEST_NONE, 5] {
            assert_eq!(
                code(|e| kvpage_engine_request_state(ce, bad_id, &mut state, e)),
                KVPAGE_ERR_STALE_REQUEST
            );
            assert_eq!(
                code(|e| kvpage_engine_cancel(ce, bad_id, e)),
                KVPAGE_ERR_STALE_REQUEST
            );
            assert_eq!(
                code(|e| kvpage_engine_fork(ce, bad_id, 0, 0, &mut r, e)),
                KVPAGE_ERR_STALE_REQUEST
            );
            assert_eq!(
                code(|e| kvpage_engine_request_tokens(
                    ce,
                    bad_id,
                    toks.as_mut_ptr(),
                    64,
                    &mut n,
                    e
                )),
                KVPAGE_ERR_STALE_REQUEST
            );
        }
        assert_eq!(state, 9);
        ok(kvpage_engine_request_state(
            ce,
            ids[0],
            &mut state,
            null_mut(),
        ));
        assert_eq!(state, KVPAGE_REQUEST_WAITING);
        assert_eq!(
            code(|e| kvpage_engine_fork(ce, ids[0], 0, 0, &mut r, e)),
            KVPAGE_ERR_WRONG_STATE
        );
        let (c, err) =
            call(|e| kvpage_engine_request_tokens(ce, ids[0], toks.as_mut_ptr(), 3, &mut n, e));
        assert_eq!(
            (c, err.needed, err.available, n),
            (KVPAGE_ERR_BUFFER_TOO_SMALL, 6, 3, 777)
        );

        // A step, then everything that must wait for its commit.
        ok(kvpage_engine_step(ce, &mut step, null_mut()));
        assert_eq!(step.num_seqs, 2);
        let mut again = std::mem::zeroed::<kvpage_step>();
        assert_eq!(
            code(|e| kvpage_engine_step(ce, &mut again, e)),
            KVPAGE_ERR_STEP_IN_PROGRESS
        );
        assert_eq!(
            code(|e| kvpage_engine_add_request(ce, 0, toks.as_ptr(), 2, 0, &mut r, e)),
            KVPAGE_ERR_STEP_IN_PROGRESS
        );
        assert_eq!(
            code(|e| kvpage_engine_cancel(ce, ids[0], e)),
            KVPAGE_ERR_STEP_IN_PROGRESS
        );
        let (c, err) = call(|e| kvpage_engine_step_seqs(ce, seqs.as_mut_ptr(), 1, &mut n, e));
        assert_eq!(
            (c, err.needed, err.available, n),
            (KVPAGE_ERR_BUFFER_TOO_SMALL, 2, 1, 777)
        );
        let tokens = step.num_tokens;
        let kv_len = tokens * (KV_HEADS * HEAD_DIM) as usize;
        let q_len = tokens * (Q_HEADS * HEAD_DIM) as usize;
        assert!(q_len <= out.len());
        assert_eq!(
            code(|e| kvpage_engine_write_kv(
                ce,
                0,
                kv.as_ptr(),
                kv_len - 1,
                kv.as_ptr(),
                kv_len,
                e
            )),
            KVPAGE_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(
            code(|e| kvpage_engine_write_kv(ce, 0, null_mut(), kv_len, kv.as_ptr(), kv_len, e)),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            code(|e| kvpage_engine_write_kv(
                ce,
                LAYERS,
                kv.as_ptr(),
                kv_len,
                kv.as_ptr(),
                kv_len,
                e
            )),
            KVPAGE_ERR_BAD_LAYER
        );
        out.fill(5.0);
        assert_eq!(
            code(|e| kvpage_engine_attention(
                ce,
                0,
                kv.as_ptr(),
                q_len - 1,
                out.as_mut_ptr(),
                q_len,
                Q_HEADS,
                1.0,
                e
            )),
            KVPAGE_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(
            code(|e| kvpage_engine_attention(
                ce,
                0,
                kv.as_ptr(),
                q_len,
                out.as_mut_ptr(),
                q_len - 1,
                Q_HEADS,
                1.0,
                e
            )),
            KVPAGE_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(
            code(|e| kvpage_engine_attention(
                ce,
                0,
                kv.as_ptr(),
                q_len,
                out.as_mut_ptr(),
                q_len,
                3,
                1.0,
                e
            )),
            KVPAGE_ERR_BAD_HEADS
        );
        assert_eq!(
            code(|e| kvpage_engine_attention(
                ce,
                0,
                kv.as_ptr(),
                q_len,
                out.as_mut_ptr(),
                q_len,
                Q_HEADS,
                f32::NAN,
                e
            )),
            KVPAGE_ERR_BAD_SCALE
        );
        assert!(out.iter().all(|&x| x == 5.0), "no output written on error");
        // Commits that must be refused before anything is committed.
        ok(kvpage_engine_step_seqs(
            ce,
            seqs.as_mut_ptr(),
            8,
            &mut n,
            null_mut(),
        ));
        let rec = rec_of_c(&step, &seqs[..n]);
        let good = samples_for(&rec);
        assert_eq!(
            good.len(),
            1,
            "the long prompt is a chunk that does not emit"
        );
        let (c, err) = call(|e| {
            kvpage_engine_commit_step(ce, good.as_ptr(), 1, fin.as_mut_ptr(), 0, &mut n, e)
        });
        assert_eq!(
            (c, err.needed, err.available),
            (KVPAGE_ERR_BUFFER_TOO_SMALL, 1, 0)
        );
        assert_eq!(
            code(|e| kvpage_engine_commit_step(
                ce,
                good.as_ptr(),
                0,
                fin.as_mut_ptr(),
                4,
                &mut n,
                e
            )),
            KVPAGE_ERR_MISSING_SAMPLE
        );
        let twice = [good[0], good[0]];
        assert_eq!(
            code(|e| kvpage_engine_commit_step(
                ce,
                twice.as_ptr(),
                2,
                fin.as_mut_ptr(),
                4,
                &mut n,
                e
            )),
            KVPAGE_ERR_DUPLICATE_SAMPLE
        );
        let other = [kvpage_sampled {
            request: rec.seqs.iter().find(|s| !s.5).unwrap().0,
            token: 1,
            stop: 0,
        }];
        assert_eq!(
            code(|e| kvpage_engine_commit_step(
                ce,
                other.as_ptr(),
                1,
                fin.as_mut_ptr(),
                4,
                &mut n,
                e
            )),
            KVPAGE_ERR_WRONG_STATE
        );
        let stale_sample = [kvpage_sampled {
            request: stale,
            ..good[0]
        }];
        assert_eq!(
            code(|e| kvpage_engine_commit_step(
                ce,
                stale_sample.as_ptr(),
                1,
                fin.as_mut_ptr(),
                4,
                &mut n,
                e
            )),
            KVPAGE_ERR_STALE_REQUEST
        );
        assert_eq!(
            code(|e| kvpage_engine_commit_step(ce, null_mut(), 1, fin.as_mut_ptr(), 4, &mut n, e)),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            code(|e| kvpage_engine_commit_step(
                ce,
                good.as_ptr(),
                1,
                fin.as_mut_ptr(),
                4,
                null_mut(),
                e
            )),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(n, 2, "n_finished untouched by the refused commits");
        ok(kvpage_engine_stats(ce, &mut st, null_mut(), null_mut()));
        assert_eq!(st.steps, 1);
        // The step the clean engine took is the same; finish it on both.
        let (cstep, cseqs) = c_step(clean);
        assert_eq!(rec_of_c(&cstep, &cseqs), rec);
        assert_eq!(c_commit(ce, &good), c_commit(clean, &good));
    }
    // Works afterwards, exactly as the engine that saw no bad call.
    assert_eq!(drive_engine(ce, 8), drive_engine(clean, 8));
    // SAFETY: live engine, then both freed once.
    unsafe {
        ok(kvpage_engine_stats(ce, &mut st, null_mut(), null_mut()));
        assert_eq!(st.finished, 2);
        ok(kvpage_engine_free(ce, null_mut()));
        ok(kvpage_engine_free(clean, null_mut()));
    }
}

fn drive_scheduler(c: &CTier3, n: usize) -> Vec<(Rec, Vec<kvpage_finished>)> {
    (0..n)
        .map(|_| {
            // SAFETY: live scheduler and manager; buffers sized as passed.
            unsafe {
                let mut step = std::mem::zeroed::<kvpage_step>();
                ok(kvpage_scheduler_step(c.s, c.m, &mut step, null_mut()));
                let mut seqs = vec![kvpage_step_seq::default(); step.num_seqs];
                let mut k = 0;
                ok(kvpage_scheduler_step_seqs(
                    c.s,
                    seqs.as_mut_ptr(),
                    seqs.len(),
                    &mut k,
                    null_mut(),
                ));
                let rec = rec_of_c(&step, &seqs);
                let samples = samples_for(&rec);
                let mut fin = vec![kvpage_finished::default(); samples.len()];
                let mut nf = 0;
                ok(kvpage_scheduler_commit_step(
                    c.s,
                    c.m,
                    samples.as_ptr(),
                    samples.len(),
                    fin.as_mut_ptr(),
                    fin.len(),
                    &mut nf,
                    null_mut(),
                ));
                fin.truncate(nf);
                (rec, fin)
            }
        })
        .collect()
}

#[test]
fn tier3_bad_input_and_a_foreign_manager_are_refused_and_change_nothing() {
    let mc = manager_config(8, 3);
    let sc = sched_config(KVPAGE_PREEMPT_SWAP);
    let mut bytes = 0usize;
    let mut s = null_mut();
    let (_mstore, m) = c_manager(&mc);
    // SAFETY: every pointer is null, valid, or deliberately wrong in a checked way.
    unsafe {
        assert_eq!(
            code(|e| kvpage_scheduler_storage_size(null_mut(), &sc, &mut bytes, e)),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            code(|e| kvpage_scheduler_storage_size(&mc, null_mut(), &mut bytes, e)),
            KVPAGE_ERR_NULL_POINTER
        );
        let zero = kvpage_scheduler_config {
            max_requests: 0,
            ..sc
        };
        assert_eq!(
            code(|e| kvpage_scheduler_storage_size(&mc, &zero, &mut bytes, e)),
            KVPAGE_ERR_BAD_CONFIG
        );
        let zero = kvpage_scheduler_config {
            scheduler: kvpage_scheduler_params {
                token_budget: 0,
                ..sc.scheduler
            },
            ..sc
        };
        assert_eq!(
            code(|e| kvpage_scheduler_storage_size(&mc, &zero, &mut bytes, e)),
            KVPAGE_ERR_BAD_CONFIG
        );
        let bad_mc = kvpage_manager_config {
            num_blocks: 0,
            ..mc
        };
        assert_eq!(
            code(|e| kvpage_scheduler_storage_size(&bad_mc, &sc, &mut bytes, e)),
            KVPAGE_ERR_BAD_CONFIG
        );
        assert_eq!(bytes, 0);
        ok(kvpage_scheduler_storage_size(
            &mc,
            &sc,
            &mut bytes,
            null_mut(),
        ));
        let mut store = vec![0u64; bytes / 8 + 1];
        let base = store.as_mut_ptr().cast::<core::ffi::c_void>();
        let (c, err) = call(|e| kvpage_scheduler_init(m, &sc, base, bytes - 1, &mut s, e));
        assert_eq!(
            (c, err.needed, err.available),
            (KVPAGE_ERR_STORAGE_TOO_SMALL, bytes as u64, bytes as u64 - 1)
        );
        let odd = base.cast::<u8>().add(4).cast();
        assert_eq!(
            code(|e| kvpage_scheduler_init(m, &sc, odd, bytes, &mut s, e)),
            KVPAGE_ERR_MISALIGNED
        );
        assert_eq!(
            code(|e| kvpage_scheduler_init(m, &sc, null_mut(), bytes, &mut s, e)),
            KVPAGE_ERR_NULL_POINTER
        );
        let not_manager = [0u64; 256];
        assert_eq!(
            code(|e| kvpage_scheduler_init(
                not_manager.as_ptr().cast(),
                &sc,
                base,
                bytes,
                &mut s,
                e
            )),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
        assert!(s.is_null());
    }

    let c = c_tier3(&mc, &sc);
    let clean = c_tier3(&mc, &sc);
    // A twin: same configuration, instance tag included; and a manager of another.
    let (_twin_store, twin) = c_manager(&mc);
    let (_other_store, other) = c_manager(&manager_config(8, 4));
    let prompts: [Vec<u32>; 3] = [(1..14).collect(), (1..10).collect(), (20..31).collect()];
    let mut ids = vec![];
    for pr in &prompts {
        let mut r = 0;
        // SAFETY: live schedulers; prompt readable.
        unsafe {
            ok(kvpage_scheduler_add_request(
                c.s,
                0,
                pr.as_ptr(),
                pr.len(),
                12,
                &mut r,
                null_mut(),
            ));
            ids.push(r);
            ok(kvpage_scheduler_add_request(
                clean.s,
                0,
                pr.as_ptr(),
                pr.len(),
                12,
                &mut r,
                null_mut(),
            ));
        }
    }
    // SAFETY: live objects, or deliberately wrong ones the checks refuse.
    unsafe {
        let mut step = std::mem::zeroed::<kvpage_step>();
        let mut r = 0;
        let mut n = 777;
        let mut state = 0u32;
        for wrong in [twin, other] {
            assert_eq!(
                code(|e| kvpage_scheduler_step(c.s, wrong, &mut step, e)),
                KVPAGE_ERR_FOREIGN_MANAGER
            );
            assert_eq!(
                code(|e| kvpage_scheduler_cancel(c.s, wrong, ids[0], e)),
                KVPAGE_ERR_FOREIGN_MANAGER
            );
            assert_eq!(
                code(|e| kvpage_scheduler_fork(c.s, wrong, ids[0], 0, 0, &mut r, e)),
                KVPAGE_ERR_FOREIGN_MANAGER
            );
        }
        assert_eq!(
            code(|e| kvpage_scheduler_step(c.s, null_mut(), &mut step, e)),
            KVPAGE_ERR_NULL_POINTER
        );
        assert_eq!(
            code(|e| kvpage_scheduler_step(null_mut(), c.m, &mut step, e)),
            KVPAGE_ERR_NULL_POINTER
        );
        let garbage = [0u64; 128];
        assert_eq!(
            code(|e| kvpage_scheduler_step(garbage.as_ptr() as *mut _, c.m, &mut step, e)),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
        let mut fin = [kvpage_finished::default(); 8];
        assert_eq!(
            code(|e| kvpage_scheduler_commit_step(
                c.s,
                c.m,
                null_mut(),
                0,
                fin.as_mut_ptr(),
                8,
                &mut n,
                e
            )),
            KVPAGE_ERR_NO_STEP_IN_PROGRESS
        );
        assert_eq!(
            code(|e| kvpage_scheduler_request_state(c.s, ids[0] ^ (1 << 33), &mut state, e)),
            KVPAGE_ERR_STALE_REQUEST
        );

        ok(kvpage_scheduler_step(c.s, c.m, &mut step, null_mut()));
        assert_eq!(
            code(|e| kvpage_scheduler_step(c.s, c.m, &mut step, e)),
            KVPAGE_ERR_STEP_IN_PROGRESS
        );
        let mut seqs = [kvpage_step_seq::default(); 8];
        let (code_, err) =
            call(|e| kvpage_scheduler_step_seqs(c.s, seqs.as_mut_ptr(), 0, &mut n, e));
        assert_eq!(
            (code_, err.needed, n),
            (KVPAGE_ERR_BUFFER_TOO_SMALL, step.num_seqs as u64, 777)
        );
        ok(kvpage_scheduler_step_seqs(
            c.s,
            seqs.as_mut_ptr(),
            8,
            &mut n,
            null_mut(),
        ));
        let rec = rec_of_c(&step, &seqs[..n]);
        let good = samples_for(&rec);
        assert!(!good.is_empty());
        for wrong in [twin, other] {
            assert_eq!(
                code(|e| kvpage_scheduler_commit_step(
                    c.s,
                    wrong,
                    good.as_ptr(),
                    good.len(),
                    fin.as_mut_ptr(),
                    8,
                    &mut n,
                    e
                )),
                KVPAGE_ERR_FOREIGN_MANAGER
            );
        }
        assert_eq!(
            code(|e| kvpage_scheduler_commit_step(
                c.s,
                c.m,
                good.as_ptr(),
                good.len(),
                fin.as_mut_ptr(),
                good.len() - 1,
                &mut n,
                e
            )),
            KVPAGE_ERR_BUFFER_TOO_SMALL
        );
        let too_many = [good[0]; 7];
        assert_eq!(
            code(|e| kvpage_scheduler_commit_step(
                c.s,
                c.m,
                too_many.as_ptr(),
                7,
                fin.as_mut_ptr(),
                8,
                &mut n,
                e
            )),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
        let mut toks = [0u32; 4];
        let (code_, err) =
            call(|e| kvpage_scheduler_request_tokens(c.s, ids[0], toks.as_mut_ptr(), 4, &mut n, e));
        assert_eq!((code_, err.needed), (KVPAGE_ERR_BUFFER_TOO_SMALL, 13));
        // The clean pair took the same step.
        let first_clean = drive_scheduler(&clean, 1);
        assert_eq!(first_clean[0].0, rec);
        let mut nf = 0;
        ok(kvpage_scheduler_commit_step(
            c.s,
            c.m,
            good.as_ptr(),
            good.len(),
            fin.as_mut_ptr(),
            8,
            &mut nf,
            null_mut(),
        ));
        assert_eq!(fin[..nf].to_vec(), first_clean[0].1);
    }
    // Works afterwards, exactly as the pair that saw no bad call.
    assert_eq!(drive_scheduler(&c, 30), drive_scheduler(&clean, 30));

    // The core refuses a manager of another configuration by itself (the C binding
    // also refuses a twin of identical configuration, which the core cannot tell).
    let cfg = |instance| Config {
        num_blocks: 8,
        block_size: 4,
        max_seqs: 2,
        max_blocks_per_seq: 4,
        instance,
        hash_key: 0,
        prefix_cache: true,
        max_position_runs: 4,
        max_namespaces: 0,
        event_capacity: 0,
    };
    let mut w1 = vec![0u64; cfg(1).storage_words()];
    let mut w2 = vec![0u64; cfg(2).storage_words()];
    let mut other_kv = BlockManager::new(cfg(2), &mut w2).unwrap();
    let _kv = BlockManager::new(cfg(1), &mut w1).unwrap();
    let ecfg = kvpage_core::EngineConfig {
        max_requests: 2,
        scheduler: SchedulerConfig {
            token_budget: 8,
            max_running: 2,
            watermark_blocks: 0,
            preemption: Preemption::Recompute,
        },
        host_blocks: 0,
    };
    let mut ew = vec![0u64; ecfg.storage_words(&cfg(1))];
    let mut core = kvpage_core::Engine::new(ecfg, &cfg(1), &mut ew).unwrap();
    assert_eq!(
        core.step(&mut other_kv, None).err(),
        Some(kvpage::EngineError::ForeignManager)
    );
}

/// An engine's fixed K/V scales through C: set, read and cleared on an int8 engine,
/// refused on an f32 one and for a bad layer or scale (the setting then stays).
#[test]
fn engine_kv_scales_through_c() {
    let mut p = engine_params();
    p.cache.geometry.dtype = KVPAGE_DTYPE_INT8;
    let e = new_c_engine(&p);
    let floats = new_c_engine(&engine_params());
    let (mut k, mut v) = (f32::NAN, f32::NAN);
    // SAFETY: live engines and writable locals.
    unsafe {
        ok(kvpage_engine_set_kv_scales(e, 1, 0.5, 0.25, null_mut()));
        ok(kvpage_engine_kv_scales(e, 1, &mut k, &mut v, null_mut()));
        assert_eq!((k, v), (0.5, 0.25));
        let set = |layer, k, v| code(|err| kvpage_engine_set_kv_scales(e, layer, k, v, err));
        assert_eq!(set(LAYERS, 1.0, 1.0), KVPAGE_ERR_BAD_LAYER);
        assert_eq!(set(0, f32::INFINITY, 1.0), KVPAGE_ERR_BAD_SCALE);
        assert_eq!(
            code(|err| kvpage_engine_set_kv_scales(floats, 0, 1.0, 1.0, err)),
            KVPAGE_ERR_DTYPE_MISMATCH
        );
        assert_eq!(
            code(|err| kvpage_engine_kv_scales(floats, 0, &mut k, &mut v, err)),
            KVPAGE_ERR_DTYPE_MISMATCH
        );
        ok(kvpage_engine_kv_scales(e, 1, &mut k, &mut v, null_mut()));
        assert_eq!((k, v), (0.5, 0.25));
        ok(kvpage_engine_clear_kv_scales(e, 1, null_mut()));
        ok(kvpage_engine_kv_scales(e, 1, &mut k, &mut v, null_mut()));
        assert_eq!((k, v), (0.0, 0.0));
        assert_eq!(
            code(|err| kvpage_engine_clear_kv_scales(e, LAYERS, err)),
            KVPAGE_ERR_BAD_LAYER
        );
        ok(kvpage_engine_free(e, null_mut()));
        ok(kvpage_engine_free(floats, null_mut()));
    }
}
