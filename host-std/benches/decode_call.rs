//! One decode call after another on the calling thread, per storage dtype: a figure for
//! the machines the x86-64 kernels do not cover (aarch64 and the other architectures
//! run the portable arithmetic), and the unit of work whose instructions are counted
//! under an emulator where no such machine is at hand.
//!
//! `cargo bench -p kvpage --bench decode_call` — a decode of 1 sequence of 512 tokens, 32
//! query heads over 8 KV heads, head dim 128, blocks of 16 tokens in shuffled physical
//! order, random K/V and queries, on the calling thread (no worker pool), for each
//! storage dtype in turn: the median and best time per call over `calls` calls (200,
//! or the number given: `-- 1000`), the K/V bytes a call reads per second, and the time
//! against f32's in the same run (the baseline: same arithmetic, no widening). Names
//! among the arguments (`f32 f16 bf16 int8 fp8`) run those dtypes only. The kernel path
//! taken is printed (`KVPAGE_CPU_PATH=portable` runs the portable arithmetic on x86-64).
//!
//! Instructions executed on aarch64 under qemu-user, where no ARM machine is at hand
//! (the musl target links with rustc's own `rust-lld` and brings its C runtime, so no
//! cross gcc is needed; CI runs the kernels' unit tests the same way):
//! ```sh
//! rustup target add aarch64-unknown-linux-musl
//! CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_LINKER=rust-lld \
//!     cargo bench -p kvpage --bench decode_call --no-run --target aarch64-unknown-linux-musl
//! qemu-aarch64 -singlestep -d nochain,exec -D /dev/stdout \
//!     target/aarch64-unknown-linux-musl/release/deps/decode_call-* f16 1 | grep -c '^Trace'
//! ```
//! once with 1 call and once with 2: the difference is one call's instructions (the
//! setup and printing are the same in both). Counted so with qemu 7.2 (December 2026),
//! before and after the portable arithmetic's rewrite for NEON, on an equivalent
//! program (glibc): f32 7.41M → 4.91M instructions per call, f16 12.47M → 6.05M, bf16
//! 7.54M → 5.63M, int8 8.39M → 6.19M, FP8 12.91M → 9.44M; then with the widening in
//! the attention loop's scratch (`widens_storage` of `kernels::math::Portable`;
//! this program, musl): f16 6.22M → 5.73M, int8 6.34M → 5.97M, FP8 9.59M → 9.19M.
//! A count is not a time: an emulator says nothing about how fast those instructions
//! run.
mod common;

use std::time::Duration;

use common::{stats, PagedCall};
use kvpage::{bf16, f16, Element, Fp8E4m3, Int8};
use rand::rngs::StdRng;
use rand::SeedableRng;

const KV_HEADS: u32 = 8;
const Q_HEADS: u32 = 32;
const HEAD_DIM: u32 = 128;
const BLOCK_SIZE: u32 = 16;
const CONTEXT: u32 = 512;

/// Median and best time per call of `calls` decode calls over storage `T`, each on the
/// calling thread.
fn run<T: Element>(calls: u32, rng: &mut StdRng) -> (Duration, Duration) {
    let mut call = PagedCall::<T>::new(KV_HEADS, HEAD_DIM, BLOCK_SIZE, Q_HEADS, 1, CONTEXT, 1, rng);
    stats((0..calls.max(1)).map(|_| call.time(None)).collect())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let calls = args
        .iter()
        .find_map(|a| a.parse::<u32>().ok())
        .unwrap_or(200);
    let names = ["f32", "f16", "bf16", "int8", "fp8"];
    let picked: Vec<&str> = names
        .into_iter()
        .filter(|n| args.iter().any(|a| a == n))
        .collect();
    let picked = if picked.is_empty() {
        names.to_vec()
    } else {
        picked
    };
    println!(
        "kernel path: {}; decode of 1 x {CONTEXT} tokens, {Q_HEADS} q heads / {KV_HEADS} kv heads, \
         head dim {HEAD_DIM}, calling thread, {calls} calls",
        kvpage::kernels::instruction_path()
    );
    let mut rng = StdRng::seed_from_u64(11);
    let mut f32_median = None;
    println!("dtype     median µs    best µs   GB/s of K/V   time / f32's");
    for name in picked {
        let (bytes_per, (median, best)) = match name {
            "f32" => (4.0, run::<f32>(calls, &mut rng)),
            "f16" => (2.0, run::<f16>(calls, &mut rng)),
            "bf16" => (2.0, run::<bf16>(calls, &mut rng)),
            "int8" => (1.0, run::<Int8>(calls, &mut rng)),
            _ => (1.0, run::<Fp8E4m3>(calls, &mut rng)),
        };
        // K and V of every token and KV head (the 8-bit scales left out).
        let bytes = f64::from(2 * CONTEXT * KV_HEADS * HEAD_DIM) * bytes_per;
        if name == "f32" {
            f32_median = Some(median);
        }
        let ratio = f32_median.map_or("-".to_string(), |b| {
            format!("{:.2}", median.as_secs_f64() / b.as_secs_f64())
        });
        println!(
            "{name:<6} {:>12.1} {:>10.1} {:>13.2} {:>14}",
            median.as_secs_f64() * 1e6,
            best.as_secs_f64() * 1e6,
            bytes / median.as_secs_f64() / 1e9,
            ratio
        );
    }
}
