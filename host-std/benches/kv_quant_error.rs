//! How much decode attention loses when K/V are stored in 8 bits, by code and by scale
//! granularity, against f16 storage: the measurement behind the layout of quantized
//! blocks.
//!
//! `cargo bench -p kvpage --bench kv_quant_error` — one decode query per query head
//! (32 query heads over 8 KV heads, head dim 128) against 1024 tokens of random K/V
//! with realistic outliers: four fixed K channels per head 15× larger than the rest (the
//! channel outliers of real keys), and one token in a hundred with V 10× larger. Each
//! storage is dequantized and the attention computed in f64; the error is the relative
//! L2 error of each output row against the same computation on the unrounded K/V
//! (mean and worst row), beside the bytes one token of one head takes (codes plus
//! scales) and the capacity that gives against f16.
//!
//! Granularities: a scale per (token, head) (`per token`), per 32 channels of a token
//! (`per 32 ch`), per (block of 16 tokens, head) computed over the full block
//! (`per block`), and the same per-block scale as a cache fills it one token at a time
//! (`per block, streamed`): when a new token raises the block's largest magnitude, the
//! codes already stored are requantized to the new scale, rounding twice; and a scale per
//! channel over each block (`per channel in block`), alone and for K with V per token;
//! and a fixed scale for the whole layer (`fixed per layer`, what `KvScales` sets; the
//! layout still stores it in every row): `calibrated` from the largest magnitude of the
//! layer's K (and V) over the code's largest, as a calibration on this very data would
//! give it, and `1.0`, an engine's default where the checkpoint has none.
//! The bytes column is the mean of K's and V's.
//!
//! A second table takes the same K/V and queries through the shipped kernel: written
//! into a `KvCache` of each storage dtype (8-bit: a scale per token and head, or the
//! calibrated fixed scales) and decoded
//! by `KvCache::decode` on this CPU's instruction path (printed): the storage's error
//! and the arithmetic's together, against the same f64 reference. On AVX-512 with VNNI
//! and BF16 the 8-bit paths compute in 16-bit integer and bf16 dot products; the table
//! shows what that adds to what the codes lose.

use half::f16;
use kvpage::kernels::instruction_path;
use kvpage::quant::{dequantize, quantize, Code};
use kvpage::{CacheConfig, Capacity, DType, Geometry, KvCache, KvScales, CACHE_NAMESPACES};

const KV_HEADS: usize = 8;
const GROUP: usize = 4;
const HD: usize = 128;
const TOKENS: usize = 1024;
const BLOCK: usize = 16;

/// Deterministic normal-ish values (sum of uniforms).
struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        (0..6).map(|_| self.uniform()).sum::<f64>() - 3.0
    }
}

/// How one head's `[TOKENS][HD]` values are stored and read back.
#[derive(Clone, Copy)]
enum Storage {
    F16,
    PerToken(Code),
    PerChannels(Code, usize),
    PerBlock(Code),
    PerBlockStreamed(Code),
    PerChannelInBlock(Code),
    /// A fixed scale for the layer (codes saturate past it), as `KvScales` sets; the
    /// `&str` says where it comes from.
    Fixed(Code, f32, &'static str),
}

impl Storage {
    fn name(self) -> String {
        let code = |c: Code| match c {
            Code::Int8 => "int8",
            Code::Fp8E4m3 => "fp8 e4m3",
        };
        match self {
            Self::F16 => "f16".into(),
            Self::PerToken(c) => format!("{}, per token", code(c)),
            Self::PerChannels(c, g) => format!("{}, per {g} ch", code(c)),
            Self::PerBlock(c) => format!("{}, per block", code(c)),
            Self::PerBlockStreamed(c) => format!("{}, per block, streamed", code(c)),
            Self::PerChannelInBlock(c) => format!("{}, per channel in block", code(c)),
            Self::Fixed(c, _, from) => format!("{}, fixed per layer: {from}", code(c)),
        }
    }

    /// Bytes of one token of one head: codes and its share of the f32 scales.
    fn bytes_per_token(self) -> f64 {
        match self {
            Self::F16 => 2.0 * HD as f64,
            // A fixed scale is still stored in each row, as the layout keeps it.
            Self::PerToken(_) | Self::Fixed(..) => HD as f64 + 4.0,
            Self::PerChannels(_, g) => HD as f64 + 4.0 * (HD / g) as f64,
            Self::PerBlock(_) | Self::PerBlockStreamed(_) => HD as f64 + 4.0 / BLOCK as f64,
            Self::PerChannelInBlock(_) => HD as f64 + 4.0 * HD as f64 / BLOCK as f64,
        }
    }

    /// `x` (`[TOKENS][HD]`) as stored and read back.
    fn round_trip(self, x: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0f32; x.len()];
        let mut codes = vec![0u8; x.len()];
        let mut scales = vec![0.0f32; x.len()];
        match self {
            Self::F16 => {
                for (o, &v) in out.iter_mut().zip(x) {
                    *o = f16::from_f32(v).to_f32();
                }
            }
            Self::PerToken(c) => {
                quantize(c, x, HD, &mut codes, &mut scales);
                dequantize(c, &codes, &scales, HD, &mut out);
            }
            Self::Fixed(c, scale, _) => {
                for ((row, rc), ro) in x
                    .chunks(HD)
                    .zip(codes.chunks_mut(HD))
                    .zip(out.chunks_mut(HD))
                {
                    let s = c.quantize_row_at(row, rc, scale);
                    for (o, &code) in ro.iter_mut().zip(rc.iter()) {
                        *o = s * c.decode(code);
                    }
                }
            }
            Self::PerChannels(c, g) => {
                quantize(c, x, g, &mut codes, &mut scales);
                dequantize(c, &codes, &scales, g, &mut out);
            }
            Self::PerBlock(c) => {
                quantize(c, x, BLOCK * HD, &mut codes, &mut scales);
                dequantize(c, &codes, &scales, BLOCK * HD, &mut out);
            }
            Self::PerChannelInBlock(c) => {
                // Transpose each block to [channel][token], one group per channel.
                let mut column = vec![0.0f32; BLOCK * HD];
                for (b, block) in x.chunks(BLOCK * HD).enumerate() {
                    let n = block.len() / HD;
                    for (t, row) in block.chunks(HD).enumerate() {
                        for d in 0..HD {
                            column[d * n + t] = row[d];
                        }
                    }
                    let (cs, ss) = (&mut codes[..n * HD], &mut scales[..HD]);
                    quantize(c, &column[..n * HD], n, cs, ss);
                    let mut back = vec![0.0f32; n * HD];
                    dequantize(c, cs, ss, n, &mut back);
                    for t in 0..n {
                        for d in 0..HD {
                            out[b * BLOCK * HD + t * HD + d] = back[d * n + t];
                        }
                    }
                }
            }
            Self::PerBlockStreamed(c) => {
                for (b, block) in x.chunks(BLOCK * HD).enumerate() {
                    let (mut scale, mut stored) = (0.0f32, vec![0u8; block.len()]);
                    for t in 0..block.len() / HD {
                        let row = &block[t * HD..(t + 1) * HD];
                        let absmax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                        let wanted = c.scale_for(absmax);
                        if t == 0 || wanted > scale {
                            // Requantize what is stored to the larger scale.
                            for code in stored[..t * HD].iter_mut() {
                                *code = c.encode(scale * c.decode(*code), wanted);
                            }
                            scale = wanted;
                        }
                        for (code, &v) in stored[t * HD..].iter_mut().zip(row) {
                            *code = c.encode(v, scale);
                        }
                    }
                    let base = b * BLOCK * HD;
                    for (i, &code) in stored.iter().enumerate() {
                        out[base + i] = scale * c.decode(code);
                    }
                }
            }
        }
        out
    }
}

/// The relative L2 errors of the output rows `got` against `want` (`[rows][HD]`).
fn row_errors<'a>(got: &'a [f64], want: &'a [f64]) -> impl Iterator<Item = f64> + 'a {
    got.chunks(HD).zip(want.chunks(HD)).map(|(g, w)| {
        let num: f64 = g.iter().zip(w).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f64 = w.iter().map(|b| b * b).sum();
        (num / den).sqrt()
    })
}

/// Mean and worst row error of a decode through `KvCache` of `dtype` (one sequence of
/// `TOKENS` tokens, every head's K/V and queries of `heads`) against `exact`.
fn through_kernel(
    dtype: DType,
    scales: Option<KvScales>,
    heads: &[Head],
    exact: &[Vec<f64>],
) -> (f64, f64) {
    let geometry = Geometry::new(1, KV_HEADS as u32, HD as u32, BLOCK as u32, dtype).unwrap();
    let mut cache = KvCache::new(CacheConfig {
        geometry,
        capacity: Capacity::Blocks((TOKENS / BLOCK) as u32),
        max_seqs: 1,
        max_seq_len: TOKENS as u32,
        threads: 1,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: CACHE_NAMESPACES,
    })
    .unwrap();
    if scales.is_some() {
        cache.set_kv_scales(0, scales).unwrap();
    }
    let seq = cache.create(0).unwrap();
    cache.append(seq, TOKENS as u32).unwrap();
    // `[tokens][kv_heads][hd]`, and the queries `[1][kv_heads * GROUP][hd]`.
    let interleave = |part: fn(&Head) -> &[f32]| -> Vec<f32> {
        (0..TOKENS)
            .flat_map(|t| {
                heads
                    .iter()
                    .flat_map(move |h| &part(h)[t * HD..(t + 1) * HD])
            })
            .copied()
            .collect()
    };
    let (k, v) = (interleave(|h| &h.0), interleave(|h| &h.1));
    cache.write_kv(seq, 0, 0, &k, &v).unwrap();
    let q: Vec<f32> = heads
        .iter()
        .flat_map(|h| h.2.iter().map(|&x| x as f32))
        .collect();
    let mut out = vec![0.0f32; q.len()];
    let q_heads = (KV_HEADS * GROUP) as u32;
    let scale = 1.0 / (HD as f32).sqrt();
    cache
        .decode(0, &[seq], &q, &mut out, q_heads, scale)
        .unwrap();
    let got: Vec<f64> = out.iter().map(|&x| f64::from(x)).collect();
    let want: Vec<f64> = exact.concat();
    let errors: Vec<f64> = row_errors(&got, &want).collect();
    let worst = errors.iter().cloned().fold(0.0, f64::max);
    (errors.iter().sum::<f64>() / errors.len() as f64, worst)
}

/// One KV head's keys and values (`[TOKENS][HD]`) and its group's queries
/// (`[GROUP][HD]`).
type Head = (Vec<f32>, Vec<f32>, Vec<f64>);

/// Decode attention in f64 of `q` (`[GROUP][HD]`) over `k`, `v` (`[TOKENS][HD]`).
fn attend(q: &[f64], k: &[f32], v: &[f32]) -> Vec<f64> {
    let scale = 1.0 / (HD as f64).sqrt();
    let mut out = vec![0.0f64; GROUP * HD];
    for (r, qr) in q.chunks(HD).enumerate() {
        let s: Vec<f64> = k
            .chunks(HD)
            .map(|kt| {
                scale
                    * qr.iter()
                        .zip(kt)
                        .map(|(a, &b)| a * f64::from(b))
                        .sum::<f64>()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let total: f64 = w.iter().sum();
        for (t, vt) in v.chunks(HD).enumerate() {
            for d in 0..HD {
                out[r * HD + d] += w[t] / total * f64::from(vt[d]);
            }
        }
    }
    out
}

fn main() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let outlier_channels = [7, 33, 64, 101];
    let heads: Vec<Head> = (0..KV_HEADS)
        .map(|_| {
            let mut k = vec![0.0f32; TOKENS * HD];
            let mut v = vec![0.0f32; TOKENS * HD];
            for t in 0..TOKENS {
                let loud = rng.uniform() < 0.01;
                for d in 0..HD {
                    let kd = rng.normal()
                        * if outlier_channels.contains(&d) {
                            15.0
                        } else {
                            1.0
                        };
                    k[t * HD + d] = kd as f32;
                    v[t * HD + d] = (rng.normal() * if loud { 10.0 } else { 1.0 }) as f32;
                }
            }
            let q: Vec<f64> = (0..GROUP * HD).map(|_| rng.normal()).collect();
            (k, v, q)
        })
        .collect();
    let exact: Vec<Vec<f64>> = heads.iter().map(|(k, v, q)| attend(q, k, v)).collect();
    let same = |s: Storage| (s, s);
    // Fixed per-layer scales: calibrated (the largest magnitude of the layer's K, or V,
    // over all its heads and tokens, over the code's largest: what a calibration on
    // this very data would give), and 1.0 (an engine's default without calibration).
    let absmax = |part: fn(&Head) -> &[f32]| {
        heads
            .iter()
            .flat_map(|h| part(h).iter())
            .fold(0.0f32, |m, x| m.max(x.abs()))
    };
    let (k_max, v_max) = (absmax(|h| &h.0), absmax(|h| &h.1));
    let calibrated = |c: Code| {
        (
            Storage::Fixed(c, k_max / c.max(), "calibrated"),
            Storage::Fixed(c, v_max / c.max(), "calibrated"),
        )
    };
    let unit = |c: Code| same(Storage::Fixed(c, 1.0, "1.0"));

    let storages = [
        same(Storage::F16),
        same(Storage::PerToken(Code::Int8)),
        same(Storage::PerChannels(Code::Int8, 32)),
        same(Storage::PerBlock(Code::Int8)),
        same(Storage::PerBlockStreamed(Code::Int8)),
        same(Storage::PerChannelInBlock(Code::Int8)),
        (
            Storage::PerChannelInBlock(Code::Int8),
            Storage::PerToken(Code::Int8),
        ),
        calibrated(Code::Int8),
        unit(Code::Int8),
        same(Storage::PerToken(Code::Fp8E4m3)),
        same(Storage::PerChannels(Code::Fp8E4m3, 32)),
        same(Storage::PerBlock(Code::Fp8E4m3)),
        same(Storage::PerBlockStreamed(Code::Fp8E4m3)),
        same(Storage::PerChannelInBlock(Code::Fp8E4m3)),
        (
            Storage::PerChannelInBlock(Code::Fp8E4m3),
            Storage::PerToken(Code::Fp8E4m3),
        ),
        calibrated(Code::Fp8E4m3),
        unit(Code::Fp8E4m3),
    ];
    println!(
        "decode, {} query heads over {KV_HEADS} KV heads, head dim {HD}, {TOKENS} tokens, K outlier channels x15, 1% of V tokens x10",
        KV_HEADS * GROUP
    );
    println!(
        "{:<52} {:>10} {:>8} {:>13} {:>13}",
        "storage", "B/token/hd", "vs f16", "mean rel err", "worst rel err"
    );
    for (ks, vs) in storages {
        let (mut sum, mut worst, mut rows) = (0.0f64, 0.0f64, 0);
        for ((k, v, q), want) in heads.iter().zip(&exact) {
            let got = attend(q, &ks.round_trip(k), &vs.round_trip(v));
            for e in row_errors(&got, want) {
                sum += e;
                worst = worst.max(e);
                rows += 1;
            }
        }
        let name = if ks.name() == vs.name() {
            ks.name()
        } else {
            format!("K {}; V {}", ks.name(), vs.name())
        };
        let bytes = (ks.bytes_per_token() + vs.bytes_per_token()) / 2.0;
        println!(
            "{:<52} {:>10.2} {:>7.2}x {:>13.2e} {:>13.2e}",
            name,
            bytes,
            Storage::F16.bytes_per_token() / bytes,
            sum / rows as f64,
            worst
        );
    }
    println!(
        "\nthrough the CPU kernel (KvCache::decode, path {}), storage and arithmetic:",
        instruction_path()
    );
    println!(
        "{:<52} {:>10} {:>8} {:>13} {:>13}",
        "storage", "", "", "mean rel err", "worst rel err"
    );
    // `unwrap`, not `ok`: a refused scale would otherwise measure the default under the
    // fixed row's name.
    let fixed = |c: Code| Some(KvScales::new(k_max / c.max(), v_max / c.max()).unwrap());
    for (dtype, scales, name) in [
        (DType::F32, None, "f32"),
        (DType::F16, None, "f16"),
        (DType::Bf16, None, "bf16"),
        (DType::Int8, None, "int8, per token"),
        (
            DType::Int8,
            fixed(Code::Int8),
            "int8, fixed per layer: calibrated",
        ),
        (DType::Fp8E4m3, None, "fp8 e4m3, per token"),
        (
            DType::Fp8E4m3,
            fixed(Code::Fp8E4m3),
            "fp8 e4m3, fixed per layer: calibrated",
        ),
    ] {
        let (mean, worst) = through_kernel(dtype, scales, &heads, &exact);
        println!(
            "{:<52} {:>10} {:>8} {:>13.2e} {:>13.2e}",
            name, "", "", mean, worst
        );
    }
}
