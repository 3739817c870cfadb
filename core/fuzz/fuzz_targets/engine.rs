//! Random workloads through the engine step over a live manager, checked by the engine
//! property tests' own harness (`core/tests/engine/body.rs`, included as it is):
//! requests with shared prefixes in two namespaces, steps with random stops, forks and
//! cancels, with tight memory and swap space on and off. Every step executes (no
//! `PlanFailed`), every request finishes exactly once, the simulated arena that
//! receives exactly the copies and writes the engine hands out reads back every
//! running request's own K/V, and the pool is empty at the end.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;

/// The property tests' helpers (`max_ops`, `proptest_config`) the harness calls.
#[allow(dead_code)]
#[path = "../../tests/common/mod.rs"]
mod common;

#[derive(Debug, Clone, Copy, Arbitrary)]
enum FuzzOp {
    Add {
        ns: u8,
        group: u8,
        shared: u8,
        unique: u8,
        max_new: u8,
    },
    Step {
        stops: u32,
    },
    Fork {
        pick: u8,
        replace: bool,
    },
    Cancel {
        pick: u8,
    },
}

/// Sizes, in the ranges of the property tests' strategy (which keeps a lone request of
/// the longest length schedulable, so that the harness may expect every request to
/// finish).
#[derive(Debug, Arbitrary)]
struct Sizes {
    block_size: u8,
    num_blocks: u8,
    watermark: u8,
    swap: bool,
    host_blocks: u8,
    max_seqs: u8,
    max_requests: u8,
    bps: u8,
    budget: u8,
    running: u8,
}

macro_rules! engine_model {
    ($name:ident, $block_size:expr) => {
        #[allow(dead_code, unused_imports, clippy::all)]
        mod $name {
            const BLOCK_SIZE: u32 = $block_size;
            use super::common;
            include!("../../tests/engine/body.rs");

            pub fn check(s: &super::Sizes, ops: &[super::FuzzOp]) {
                use super::FuzzOp as F;
                let num_blocks = 6 + u32::from(s.num_blocks) % 18;
                let watermark = u32::from(s.watermark) % 3;
                let max_bps = (num_blocks - 1 - watermark).min(64 / BLOCK_SIZE + 2).max(2);
                let ops = ops
                    .iter()
                    .map(|&o| match o {
                        F::Add {
                            ns,
                            group,
                            shared,
                            unique,
                            max_new,
                        } => Op::Add {
                            ns: ns % 2,
                            group: group % 3,
                            shared: shared % 40,
                            unique: unique % 12,
                            max_new: max_new % 40,
                            // From the byte's otherwise unused high part, so the
                            // committed corpus decodes as before.
                            level: unique / 12 % 6,
                        },
                        F::Step { stops } => Op::Step {
                            stops: stops & stops.rotate_left(7) & stops.rotate_left(13),
                        },
                        F::Fork { pick, replace } => Op::Fork { pick, replace },
                        F::Cancel { pick } => Op::Cancel { pick },
                    })
                    .collect();
                let w = Workload {
                    num_blocks,
                    max_blocks_per_seq: 2 + u32::from(s.bps) % (max_bps - 1),
                    max_seqs: 1 + u32::from(s.max_seqs) % 8,
                    max_requests: 2 + u32::from(s.max_requests) % 10,
                    token_budget: 1 + u32::from(s.budget) % 47,
                    max_running: 1 + u32::from(s.running) % 8,
                    watermark,
                    host_blocks: u32::from(s.host_blocks) % 40,
                    swap: s.swap,
                    // As `level`: from bits the other sizes leave unused.
                    reserve: u32::from(s.host_blocks / 40) % 4,
                    limit_cut: u32::from(s.num_blocks / 18) % 8,
                    ops,
                };
                if let Err(e) = run(w) {
                    panic!("{e}");
                }
            }
        }
    };
}

engine_model!(bs1, 1);
engine_model!(bs3, 3);
engine_model!(bs4, 4);

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(sizes) = Sizes::arbitrary(&mut u) else {
        return;
    };
    let mut ops = Vec::new();
    while ops.len() < 100 && !u.is_empty() {
        match FuzzOp::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    match sizes.block_size % 3 {
        0 => bs1::check(&sizes, &ops),
        1 => bs3::check(&sizes, &ops),
        _ => bs4::check(&sizes, &ops),
    }
});
