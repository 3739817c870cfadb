//! Random operation sequences on the block manager, checked against the reference model
//! of the property tests (`core/tests/model/body.rs`, included as it is): after every
//! operation each live sequence reads back its own tokens through its block table,
//! refcounts and stats match the model, new slots are never slots another live token
//! reads, sharing only happens within a namespace or a fork family, and a failed
//! operation changes nothing observable. The first input byte picks one of several
//! configurations (block sizes 1, 3, 4, 8; prefix cache on and off).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;

/// An operation with raw fields; each configuration's model maps it to its `Op` in the
/// ranges the property tests' strategy draws from (the model relies on them: e.g. at
/// most 31 prompt tokens and 10 appended tokens fit its slot buffer).
#[derive(Debug, Clone, Copy, Arbitrary)]
enum FuzzOp {
    Create {
        ns: u8,
    },
    CreatePrompt {
        ns: u8,
        base: u8,
        len: u8,
        tail: u8,
    },
    Append {
        seq: u8,
        n: u8,
        with_ids: bool,
        alphabet: u8,
    },
    Fork {
        seq: u8,
    },
    Truncate {
        seq: u8,
        keep_percent: u8,
    },
    Release {
        seq: u8,
    },
    Evict {
        n: u8,
    },
    UseStale {
        which: u8,
    },
    SwapOut {
        seq: u8,
    },
    Commit {
        seq: u8,
        percent: u8,
    },
    SwapIn {
        which: u8,
    },
}

#[derive(Debug, Arbitrary)]
struct Input {
    config: u8,
    ops: Vec<FuzzOp>,
}

macro_rules! model {
    ($name:ident, $block_size:expr, $prefix_cache:expr) => {
        #[allow(dead_code, unused_imports, clippy::all)]
        mod $name {
            const BLOCK_SIZE: u32 = $block_size;
            const PREFIX_CACHE: bool = $prefix_cache;
            const MAX_NAMESPACES: u32 = 0;
            include!("../../tests/model/body.rs");

            fn convert(op: super::FuzzOp) -> Op {
                use super::FuzzOp as F;
                match op {
                    F::Create { ns } => Op::Create { ns: ns % 2 },
                    F::CreatePrompt {
                        ns,
                        base,
                        len,
                        tail,
                    } => Op::CreatePrompt {
                        ns: ns % 2,
                        base: base % 3,
                        len: len % 30,
                        tail,
                        // The retention level comes from the tail byte's high bits, so the
                        // committed corpus decodes as before.
                        level: tail >> 4,
                    },
                    F::Append {
                        seq,
                        n,
                        with_ids,
                        alphabet,
                    } => Op::Append {
                        seq,
                        n: n % 11,
                        with_ids,
                        alphabet: 1 + alphabet % 3,
                    },
                    F::Fork { seq } => Op::Fork { seq },
                    F::Truncate { seq, keep_percent } => Op::Truncate {
                        seq,
                        keep_percent: keep_percent % 101,
                    },
                    F::Release { seq } => Op::Release { seq },
                    F::Evict { n } => Op::Evict { n: n % 5 },
                    F::UseStale { which } => Op::UseStale { which },
                    F::SwapOut { seq } => Op::SwapOut { seq },
                    F::Commit { seq, percent } => Op::Commit {
                        seq,
                        percent: percent % 101,
                    },
                    F::SwapIn { which } => Op::SwapIn { which },
                }
            }

            pub fn check(ops: &[super::FuzzOp]) {
                let ops: Vec<Op> = ops.iter().map(|&o| convert(o)).collect();
                run(&ops);
            }
        }
    };
}

model!(bs4, 4, true);
model!(bs4_no_cache, 4, false);
model!(bs3, 3, true);
model!(bs1, 1, true);
model!(bs8_no_cache, 8, false);

fuzz_target!(|input: Input| {
    // Long enough to fill the pool, swap and reuse many times; short enough to be fast.
    let ops = &input.ops[..input.ops.len().min(256)];
    match input.config % 5 {
        0 => bs4::check(ops),
        1 => bs4_no_cache::check(ops),
        2 => bs3::check(ops),
        3 => bs1::check(ops),
        _ => bs8_no_cache::check(ops),
    }
});
