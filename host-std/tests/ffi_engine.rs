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
                stop: u32::from(token % 97 == 0),
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
    let mut p = kvpage_engine_params_default();
    p.geometry = geometry_c();
    p.capacity_blocks = 48;
    p.max_seqs = 8;
    p.max_seq_len = 64;
    p.threads = 1;
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
        let mut st = kvpage_engine_stats::default();
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
    unsafe { kvpage_engine_free(ce) };
}

/// The C record of Rust engine counters.
trait IntoC {
    fn into_c(self) -> kvpage_engine_stats;
}

impl IntoC for kvpage::EngineStats {
    fn into_c(self) -> kvpage_engine_stats {
        kvpage_engine_stats {
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

fn run_tier3_against_core(preemption: u32) -> kvpage_engine_stats {
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
    let mut st = kvpage_engine_stats::default();
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
