//! Engine tests: tiny hand-made traces whose outcome is computed by hand in the comments,
//! and invariants on larger random traces.

use kvpage_core::{DType, Geometry};

use crate::fleet::{prefix_aware, FleetSummary, RouterKind};
use crate::memory::MemoryConfig;
use crate::rng::SplitMix64;
use crate::sim::{
    run, run_fleet, Hooks, Outcome, Preemption, RunOutput, SimConfig, SimError, StepView,
    TokenSource,
};
use crate::step_model::UnitSteps;
use crate::trace::Request;

fn reqs(rows: &[(f64, u32, u32)]) -> Vec<Request> {
    rows.iter()
        .enumerate()
        .map(|(i, &(t, p, g))| Request {
            id: i as u32,
            line: i + 2,
            arrival_s: t,
            prompt_tokens: p,
            output_tokens: g,
        })
        .collect()
}

fn engine(preemption: Preemption, max_batched_tokens: u32) -> SimConfig {
    SimConfig {
        max_num_seqs: 64,
        max_batched_tokens,
        preemption,
        record_series: true,
        retention: Default::default(),
    }
}

fn go(
    r: &[Request],
    memory: &MemoryConfig,
    cfg: &SimConfig,
    tokens: &TokenSource,
    views: &mut Vec<StepView>,
) -> Result<RunOutput, SimError> {
    let mut obs = |v: &StepView| views.push(*v);
    run(
        "t",
        r,
        memory,
        &UnitSteps,
        cfg,
        tokens,
        Hooks {
            progress: None,
            observer: Some(&mut obs),
        },
    )
}

/// Replays `r` over the memory of `cfg`: the run and its per-step views.
fn go_paged(
    r: &[Request],
    cfg: MemoryConfig,
    engine: &SimConfig,
    tokens: &TokenSource,
) -> (RunOutput, Vec<StepView>) {
    let mut views = Vec::new();
    let out = go(r, &cfg, engine, tokens, &mut views).unwrap();
    (out, views)
}

fn outcome(ttft: f64, finish: f64, preempted: u32) -> Outcome {
    Outcome {
        completions: 1,
        first_token_s: ttft,
        finish_s: finish,
        preempted,
    }
}

/// Smallest geometry: 2 × 1 layer × 1 head × 1 dim × 2 B = 4 B per token.
fn tiny(block_size: u32) -> Geometry {
    Geometry::new(1, 1, 1, block_size, DType::F16).unwrap()
}

/// The contiguous baseline over `budget_bytes` of [`tiny`] memory (4 B per token).
fn contiguous(budget_bytes: u64, max_seq_len: u32) -> MemoryConfig {
    MemoryConfig::contiguous(tiny(1), budget_bytes, 64, max_seq_len).unwrap()
}

fn paged_cfg(block_size: u32, blocks: u64, prefix: bool, host_blocks: u64) -> MemoryConfig {
    let g = tiny(block_size);
    MemoryConfig {
        geometry: g,
        budget_bytes: blocks * g.bytes_per_block(),
        max_seqs: 64,
        max_seq_len: 8,
        watermark_blocks: 0,
        prefix,
        host_bytes: host_blocks * g.bytes_per_block(),
    }
}

#[test]
fn contiguous_hand_computed() {
    // 4 B per token, max_seq_len 10, 100 B: two 40-B regions fit, 20 B are a useless tail.
    // A(P3,G2) B(P2,G4) C(P1,G1), all at t=0.
    // step 1: A and B admitted and prefilled (first tokens at t=1); C finds no hole.
    // step 2: A decodes its 2nd token and finishes at t=2; B 2nd token.
    // step 3: C gets A's region, prefills, finishes at t=3 (G=1); B 3rd token.
    // step 4: B 4th token, finishes at t=4.
    let r = reqs(&[(0.0, 3, 2), (0.0, 2, 4), (0.0, 1, 1)]);
    let mut views = Vec::new();
    let out = go(
        &r,
        &contiguous(100, 10),
        &engine(Preemption::Recompute, 1000),
        &TokenSource::new(3, 0, 0, 0),
        &mut views,
    )
    .unwrap();
    assert_eq!(
        out.outcomes,
        vec![
            outcome(1.0, 2.0, 0),
            outcome(1.0, 4.0, 0),
            outcome(3.0, 3.0, 0)
        ]
    );
    let rep = &out.report;
    assert_eq!(
        (
            rep.completed,
            rep.extra.steps,
            rep.peak_running,
            rep.preemptions
        ),
        (3, 4, 2, 0)
    );
    assert_eq!(rep.extra.generated_tokens, 7);
    assert_eq!(rep.tokens_per_s, 7.0 / 4.0);
    assert_eq!(rep.mean_running, (2.0 + 2.0 + 2.0 + 1.0) / 4.0);
    // stored/slots per step: 5/20, 7/20, 5/20, 5/10.
    assert_eq!(rep.kv_utilization, 22.0 / 70.0);
    // waste = empty slots × 4 B + the 20 B tail (and at step 4 the free 40 B hole is
    // usable): 60+20, 52+20, 60+20, 20+20 = 272 B·steps over 100 B × 4 steps.
    assert_eq!(rep.waste_fraction, 272.0 / 400.0);
    assert_eq!((rep.ttft_p50_s, rep.ttft_p99_s), (1.0, 3.0));
    assert_eq!((rep.latency_p50_s, rep.latency_p99_s), (3.0, 4.0));
    let running: Vec<usize> = views.iter().map(|v| v.running).collect();
    assert_eq!(running, vec![2, 2, 2, 1]);
    assert_eq!(views[0].waiting, 1);
    // Both regions taken: the largest hole is the tail. At step 4 A's region (block 0)
    // is free, B's (block 1) separates it from the tail.
    assert_eq!(views[0].usage.largest_free_bytes, 20);
    assert_eq!(views[3].usage.largest_free_bytes, 40);
    assert!(views.iter().all(|v| v.usage.unusable_free_bytes == 20));
}

#[test]
fn paged_recompute_preemption_hand_computed() {
    // Block size 2, 4 blocks. A(P3,G4) B(P3,G4) at t=0.
    // step 1: both admitted (2 blocks each), prefilled: first tokens at t=1, lengths 3, 3.
    // step 2: both grow to 4 (still 2 blocks each): 2nd tokens.
    // step 3: A needs a 3rd block, none free: B (most recently admitted) is preempted by
    //         recompute, its 2 blocks freed; A grows to 5, 3rd token. No admission.
    // step 4: A grows to 6, 4th token, done at t=4. B needs ceil(5/2) = 3 blocks, 1 free.
    // step 5: B re-admitted, prefills 3 prompt + 2 generated = 5 tokens: 3rd token.
    // step 6: B 4th token, done at t=6.
    let r = reqs(&[(0.0, 3, 4), (0.0, 3, 4)]);
    let cfg = paged_cfg(2, 4, false, 0);
    let (out, views) = go_paged(
        &r,
        cfg,
        &engine(Preemption::Recompute, 1000),
        &TokenSource::new(2, 0, 0, 0),
    );
    assert_eq!(
        out.outcomes,
        vec![outcome(1.0, 4.0, 0), outcome(1.0, 6.0, 1)]
    );
    let rep = &out.report;
    assert_eq!(
        (rep.extra.steps, rep.preemptions, rep.extra.swaps),
        (6, 1, 0)
    );
    assert_eq!(rep.extra.recomputed_tokens, 5);
    assert_eq!(rep.extra.generated_tokens, 8);
    let running: Vec<usize> = views.iter().map(|v| v.running).collect();
    assert_eq!(running, vec![2, 2, 1, 1, 1, 1]);
    // Used blocks (8 B each) per step: 4, 4, 3, 3, 3, 3.
    let used: Vec<u64> = views.iter().map(|v| v.usage.reserved_bytes / 8).collect();
    assert_eq!(used, vec![4, 4, 3, 3, 3, 3]);
}

#[test]
fn paged_swap_preemption_hand_computed() {
    // As above, but B is swapped out at step 3 (2 blocks = 16 B). At step 4 it cannot come
    // back: the scheduler wants its 2 blocks plus a spare, 1 is free. At step 5 (A done)
    // it is swapped in (16 B) — a step of copying only, swapped-in sequences run from the
    // next step — and it decodes its 3rd and 4th tokens at steps 6 and 7: no prefill again.
    let r = reqs(&[(0.0, 3, 4), (0.0, 3, 4)]);
    let cfg = paged_cfg(2, 4, false, 8);
    let (out, views) = go_paged(
        &r,
        cfg,
        &engine(Preemption::Swap, 1000),
        &TokenSource::new(2, 0, 0, 0),
    );
    assert_eq!(
        out.outcomes,
        vec![outcome(1.0, 4.0, 0), outcome(1.0, 7.0, 1)]
    );
    let rep = &out.report;
    assert_eq!(
        (rep.extra.steps, rep.preemptions, rep.extra.swaps),
        (7, 1, 1)
    );
    assert_eq!((rep.extra.swap_bytes, rep.extra.recomputed_tokens), (32, 0));
    assert_eq!(rep.extra.generated_tokens, 8);
    let swapped: Vec<usize> = views.iter().map(|v| v.swapped).collect();
    assert_eq!(swapped, vec![0, 0, 1, 1, 0, 0, 0]);
    let running: Vec<usize> = views.iter().map(|v| v.running).collect();
    assert_eq!(running, vec![2, 2, 1, 1, 1, 1, 1]);
    assert_eq!(views[2].usage.host_bytes, 16);
}

#[test]
fn swap_falls_back_to_recompute_when_the_host_tier_is_full() {
    let r = reqs(&[(0.0, 3, 4), (0.0, 3, 4)]);
    let cfg = paged_cfg(2, 4, false, 1); // host holds 1 block, B needs 2
    let (out, _) = go_paged(
        &r,
        cfg,
        &engine(Preemption::Swap, 1000),
        &TokenSource::new(2, 0, 0, 0),
    );
    assert_eq!(
        (out.report.extra.swaps, out.report.extra.recomputed_tokens),
        (0, 5)
    );
    assert_eq!(out.outcomes[1], outcome(1.0, 6.0, 1));
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    // Budget 4 tokens per step. A(P10,G1), B(P1,G2) at t=0.
    // steps 1, 2: A prefills 4 + 4; the budget is spent, B is not admitted.
    // step 3: A prefills its last 2 and finishes (G=1) at t=3; B admitted with the 2
    //         tokens left, prefills 1: first token at t=3.
    // step 4: B decodes its 2nd token, done at t=4.
    let r = reqs(&[(0.0, 10, 1), (0.0, 1, 2)]);
    let out = go(
        &r,
        &contiguous(400, 16),
        &engine(Preemption::Recompute, 4),
        &TokenSource::new(2, 0, 0, 0),
        &mut Vec::new(),
    )
    .unwrap();
    assert_eq!(
        out.outcomes,
        vec![outcome(3.0, 3.0, 0), outcome(3.0, 4.0, 0)]
    );
    assert_eq!(out.report.extra.steps, 4);
}

#[test]
fn prefix_cache_shares_the_system_prompt_and_idle_time_is_skipped() {
    // Block size 2, shared prefix 4 tokens, one group. A(P5,G1) at t=0 registers blocks
    // [t0 t1] [t2 t3]; done at t=1, they stay cached. B(P5,G1) at t=10 (time jumps there)
    // reuses both blocks: 4 hit tokens, prefills only its 5th, done at t=11.
    let r = reqs(&[(0.0, 5, 1), (10.0, 5, 1)]);
    let cfg = paged_cfg(2, 8, true, 0);
    let ts = TokenSource::new(2, 4, 1, 9);
    assert_eq!(ts.token(&r[0], 3), ts.token(&r[1], 3));
    assert_ne!(ts.token(&r[0], 4), ts.token(&r[1], 4));
    let (out, _) = go_paged(&r, cfg, &engine(Preemption::Recompute, 1000), &ts);
    assert_eq!(
        out.outcomes,
        vec![outcome(1.0, 1.0, 0), outcome(11.0, 11.0, 0)]
    );
    let rep = &out.report;
    assert_eq!((rep.prefix_hit_tokens, rep.extra.steps), (4, 2));
    assert_eq!(rep.mean_running, 2.0 / 11.0);
    assert_eq!(rep.extra.makespan_s, 11.0);
}

#[test]
fn a_request_that_never_fits_is_an_error_not_a_hang() {
    let never = |r: &[Request], cfg: MemoryConfig| {
        go(
            r,
            &cfg,
            &engine(Preemption::Recompute, 100),
            &TokenSource::new(r.len(), 0, 0, 0),
            &mut Vec::new(),
        )
        .unwrap_err()
    };
    // The prompt alone (2 blocks of 2 tokens) exceeds the pool of 1 block: refused when
    // it is added.
    let e = never(&reqs(&[(0.0, 3, 2)]), paged_cfg(2, 1, false, 0));
    assert_eq!(e, SimError::Stuck { line: 2, tokens: 5 });
    assert!(e.to_string().contains("trace line 2"));
    // The prompt fits the 2 blocks, but its 5th token needs a 3rd: it preempts itself and
    // can never come back. A second request waits behind it.
    let e = never(
        &reqs(&[(0.0, 3, 4), (0.0, 1, 1)]),
        paged_cfg(2, 2, false, 0),
    );
    assert_eq!(e, SimError::Stuck { line: 2, tokens: 7 });
    // A budget below one region is a configuration error.
    let e = never(&reqs(&[(0.0, 3, 2)]), contiguous(20, 10));
    assert!(matches!(e, SimError::Engine(_)), "{e:?}");
}

fn random_trace(seed: u64, n: usize) -> Vec<Request> {
    let mut rng = SplitMix64::new(seed);
    let mut t = 0.0;
    let rows: Vec<(f64, u32, u32)> = (0..n)
        .map(|_| {
            t += f64::from(rng.range_u32(0, 3));
            let p = rng.range_u32(1, 60);
            let g = rng.range_u32(1, 64 - p);
            (t, p, g)
        })
        .collect();
    reqs(&rows)
}

#[test]
fn random_traces_keep_the_invariants() {
    let bs = 4u32;
    for seed in 0..4u64 {
        let r = random_trace(seed, 300);
        let ts = TokenSource::new(r.len(), 12, 3, seed);
        for (name, prefix, host, pre) in [
            ("paged", false, 0, Preemption::Recompute),
            ("paged-swap", false, 40, Preemption::Swap),
            ("paged-prefix", true, 0, Preemption::Recompute),
            ("paged-prefix-swap", true, 40, Preemption::Swap),
        ] {
            let g = tiny(bs);
            let cfg = MemoryConfig {
                geometry: g,
                budget_bytes: 40 * g.bytes_per_block() + 3, // 40 blocks and a 3 B tail
                max_seqs: 64,
                max_seq_len: 64,
                watermark_blocks: 1,
                prefix,
                host_bytes: host * g.bytes_per_block(),
            };
            let (out, views) = go_paged(&r, cfg, &engine(pre, 32), &ts);
            check(&r, &out, &views, cfg.budget_bytes, name);
            assert!(
                out.report.preemptions > 0,
                "{name}: the budget is meant to be tight"
            );
            for v in &views {
                let waste = v.usage.slot_tokens - v.usage.stored_tokens;
                assert!(
                    waste <= v.running as u64 * u64::from(bs - 1),
                    "{name}: waste {waste} slots with {} running",
                    v.running
                );
            }
            if host > 0 {
                assert!(out.report.extra.swaps > 0, "{name}: no swap happened");
            }
            if prefix {
                assert!(out.report.prefix_hit_tokens > 0);
            } else {
                // The same shared prompts, but every request is its own namespace.
                assert_eq!(out.report.prefix_hit_tokens, 0, "{name}");
            }
        }
        let mut views = Vec::new();
        let out = go(
            &r,
            &contiguous(400, 64), // 1 region of 256 B
            &engine(Preemption::Recompute, 32),
            &ts,
            &mut views,
        )
        .unwrap();
        check(&r, &out, &views, 400, "contiguous");
        assert_eq!(out.report.peak_running, 1);
    }
}

fn check(r: &[Request], out: &RunOutput, views: &[StepView], budget: u64, name: &str) {
    assert_eq!(out.report.completed, r.len() as u64, "{name}");
    for (req, o) in r.iter().zip(&out.outcomes) {
        assert_eq!(o.completions, 1, "{name}: request {} completions", req.id);
        assert!(o.first_token_s > req.arrival_s && o.finish_s >= o.first_token_s);
    }
    let want: u64 = r.iter().map(|q| u64::from(q.output_tokens)).sum();
    assert_eq!(out.report.extra.generated_tokens, want, "{name}");
    for v in views {
        assert!(v.usage.reserved_bytes <= budget, "{name}: over budget");
        assert!(v.usage.stored_tokens <= v.usage.slot_tokens);
    }
    assert!(out.report.kv_utilization > 0.0 && out.report.kv_utilization <= 1.0);
}

#[test]
fn chunked_prefill_takes_blocks_chunk_by_chunk_and_the_watermark_holds_admission() {
    // Block size 4, 5 blocks, watermark 1, budget 4 tokens per step.
    // A(P10,G1): needs 3 blocks + 1 watermark <= 5, admitted; its chunks of 4, 4, 2
    // tokens take 1, 2, 3 blocks at steps 1, 2, 3; it finishes at t=3.
    // B(P6,G1) at t=0 needs 2 blocks + 1 watermark: at step 3 A's 2-token chunk leaves 2
    // tokens of budget, but only 5 − 3 = 2 blocks are free (2 + 1 > 2): B waits, and is
    // admitted at step 4 (chunk 4 of 6), finishes at step 5.
    let r = reqs(&[(0.0, 10, 1), (0.0, 6, 1)]);
    let g = tiny(4);
    let cfg = MemoryConfig {
        geometry: g,
        budget_bytes: 5 * g.bytes_per_block(),
        max_seqs: 8,
        max_seq_len: 16,
        watermark_blocks: 1,
        prefix: false,
        host_bytes: 0,
    };
    let (out, views) = go_paged(
        &r,
        cfg,
        &engine(Preemption::Recompute, 4),
        &TokenSource::new(2, 0, 0, 0),
    );
    let blocks: Vec<u64> = views
        .iter()
        .map(|v| v.usage.reserved_bytes / g.bytes_per_block())
        .collect();
    assert_eq!(blocks, vec![1, 2, 3, 1, 2]);
    assert_eq!(
        out.outcomes,
        vec![outcome(3.0, 3.0, 0), outcome(5.0, 5.0, 0)]
    );
}

/// Paged memory with the prefix cache: `blocks` blocks of 4 tokens, sequences of up to
/// 64 tokens.
fn prefix_memory(blocks: u64) -> MemoryConfig {
    let g = tiny(4);
    MemoryConfig {
        geometry: g,
        budget_bytes: blocks * g.bytes_per_block(),
        max_seqs: 64,
        max_seq_len: 64,
        watermark_blocks: 0,
        prefix: true,
        host_bytes: 0,
    }
}

/// `n` requests, one per time unit, of 40 prompt tokens (the first 32 one of `groups`
/// shared prompts) and 4 output tokens.
fn grouped(n: usize, groups: u32) -> (Vec<Request>, TokenSource) {
    let rows: Vec<(f64, u32, u32)> = (0..n).map(|i| (i as f64, 40, 4)).collect();
    (reqs(&rows), TokenSource::new(n, 32, groups, 3))
}

fn fleet(
    r: &[Request],
    memory: &MemoryConfig,
    tokens: &TokenSource,
    replicas: usize,
    kind: RouterKind,
) -> (Vec<RunOutput>, FleetSummary) {
    let mut router = kind.build(replicas, 4);
    let outs = run_fleet(
        "t",
        r,
        memory,
        &UnitSteps,
        &engine(Preemption::Recompute, 64),
        tokens,
        replicas,
        router.as_mut(),
        Hooks::default(),
    )
    .unwrap();
    let sum = FleetSummary::new(kind, r, &outs, router.resyncs());
    (outs, sum)
}

#[test]
fn one_replica_fleets_are_the_single_engine_run() {
    let (r, ts) = grouped(120, 6);
    let memory = prefix_memory(40);
    let single = go(
        &r,
        &memory,
        &engine(Preemption::Recompute, 64),
        &ts,
        &mut Vec::new(),
    )
    .unwrap();
    for kind in [RouterKind::RoundRobin, RouterKind::PrefixAware] {
        let (outs, sum) = fleet(&r, &memory, &ts, 1, kind);
        assert_eq!(outs.len(), 1);
        assert_eq!(outs[0].report, single.report, "{kind:?}");
        assert_eq!(outs[0].outcomes, single.outcomes, "{kind:?}");
        assert_eq!(sum.prefix_hit_tokens, single.report.prefix_hit_tokens);
        assert_eq!(sum.per_replica, vec![120]);
    }
}

#[test]
fn prefix_aware_routing_hits_more_than_round_robin() {
    // 8 shared prompts of 8 blocks each (64 blocks) on 4 replicas of 40 blocks: a
    // round-robin replica sees every prompt and cannot keep them all; the prefix-aware
    // router sends each prompt where it is cached.
    let (r, ts) = grouped(240, 8);
    let memory = prefix_memory(40);
    let (rr_outs, rr) = fleet(&r, &memory, &ts, 4, RouterKind::RoundRobin);
    let (pa_outs, pa) = fleet(&r, &memory, &ts, 4, RouterKind::PrefixAware);
    for outs in [&rr_outs, &pa_outs] {
        let served: u64 = outs.iter().map(|o| o.report.completed).sum();
        assert_eq!(served, 240);
        // Every request ran on exactly one replica.
        for id in 0..r.len() {
            let ran: u32 = outs.iter().map(|o| o.outcomes[id].completions).sum();
            assert_eq!(ran, 1, "request {id}");
        }
    }
    assert_eq!(rr.per_replica, vec![60; 4]);
    // At the time of writing: 7400 hit tokens against 3604 (of 9600 prompt tokens; at
    // most 7424, every prompt but each group's first one hitting).
    assert!(
        pa.prefix_hit_tokens > rr.prefix_hit_tokens,
        "prefix-aware {} vs round-robin {}",
        pa.prefix_hit_tokens,
        rr.prefix_hit_tokens
    );
    assert_eq!(pa.resyncs, 0);
    assert!(
        pa.per_replica.iter().all(|&n| n > 0),
        "{:?}",
        pa.per_replica
    );
}

#[test]
fn a_router_that_loses_events_resyncs_from_a_snapshot_and_routes_the_same() {
    // A 2-event ring overflows on every prefill: each time the router rebuilds the
    // replica's index from `stored_block`, which is exactly what the events would have
    // built, so every routing decision and outcome is unchanged.
    let (r, ts) = grouped(120, 8);
    let memory = prefix_memory(40);
    let (full, sum) = fleet(&r, &memory, &ts, 3, RouterKind::PrefixAware);
    let mut tiny_ring = prefix_aware(3, 4, 2);
    let lossy = run_fleet(
        "t",
        &r,
        &memory,
        &UnitSteps,
        &engine(Preemption::Recompute, 64),
        &ts,
        3,
        tiny_ring.as_mut(),
        Hooks::default(),
    )
    .unwrap();
    assert!(tiny_ring.resyncs() > 0);
    assert_eq!(sum.resyncs, 0);
    for (a, b) in full.iter().zip(&lossy) {
        assert_eq!(a.report, b.report);
        assert_eq!(a.outcomes, b.outcomes);
    }
}
