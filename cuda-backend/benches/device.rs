//! Device benchmark of the CUDA backend (feature `cuda`, needs a GPU; harness-less,
//! prints one table). Run through `cuda-backend/gpu-check.sh run`, or
//! `cargo bench -p kvpage-cuda --features cuda --bench device` on a GPU machine.
//!
//! - decode: 64 sequences × 4096 tokens, 8 KV heads, 32 query heads, head dim 128,
//!   f16, block size 16, at 1 and 32 layers (a block holds all layers, so one layer's
//!   pass strides through the arena; the timed passes walk the layers), through a
//!   shuffled block table ("paged") and an identity one ("contiguous" addressing, the
//!   same kernel); bandwidth over the K/V bytes read, beside a device-to-device copy
//!   measured in the same run (its read + write bytes);
//! - split-K: 1 and 4 sequences × 32k tokens, automatic partitions against one;
//! - write (f32 in, f16 stored) and block-copy throughput;
//! - swap bandwidth, device → pinned host and back (block-scattered, as the core plans);
//! - the latency of a small step (stage + upload metadata, one decode launch, wait).
//!
//! Every kernel time is taken with events over repeated launches, after warm-up.

use std::error::Error;
use std::time::Instant;

use kvpage_core::{BlockCopy, DType, Geometry};
use kvpage_cuda::device::{
    Context, DeviceMemory, Direction, Event, HostTier, Kernels, PinnedMemory, StepBuffers, Stream,
    StreamRef,
};
use kvpage_cuda::launch::{
    plan_attention, plan_copy, plan_write, AttentionBuffers, AttentionCall, Partitioning,
};
use kvpage_cuda::params::{KvpCopyParams, KvpGeometry, KvpSeqDesc, KvpWriteParams};
use kvpage_cuda::sizing::StepLimits;
use kvpage_cuda::upload::RowUse;

type Res<T> = Result<T, Box<dyn Error>>;

const KV_HEADS: u32 = 8;
const Q_HEADS: u32 = 32;
const HEAD_DIM: u32 = 128;
const BLOCK: u32 = 16;
const ITERS: u32 = 20;

/// One line of the table.
struct Row {
    case: String,
    config: String,
    ms: f64,
    gbs: Option<f64>,
    note: String,
}

struct Bench {
    ctx: std::sync::Arc<Context>,
    kernels: Kernels,
    stream: Stream,
    start: Event,
    end: Event,
    rows: Vec<Row>,
    copy_gbs: f64,
}

/// A deterministic permutation of `0..n` (xorshift Fisher-Yates).
fn shuffled(n: u32, mut seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    for i in (1..v.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    v
}

/// `u32`s as little-endian bytes into a new pinned buffer.
fn pinned_u32s(ctx: &std::sync::Arc<Context>, v: &[u32]) -> Res<PinnedMemory> {
    let mut p = PinnedMemory::new(ctx, v.len() * 4)?;
    for (d, x) in p.as_mut_slice().chunks_exact_mut(4).zip(v) {
        d.copy_from_slice(&x.to_le_bytes());
    }
    Ok(p)
}

/// A device buffer holding `v`.
fn device_u32s(b: &Bench, v: &[u32]) -> Res<DeviceMemory> {
    let p = pinned_u32s(&b.ctx, v)?;
    let d = DeviceMemory::new(&b.ctx, p.len())?;
    // SAFETY: same sizes; waited for before `p` is dropped.
    unsafe { b.s().copy_to_device(d.ptr(), &p, 0, p.len()) }?;
    b.s().synchronize()?;
    Ok(d)
}

fn descs_bytes(descs: &[KvpSeqDesc]) -> Vec<u32> {
    descs
        .iter()
        .flat_map(|d| [d.row, d.context_len, d.queries, d.q_start])
        .collect()
}

impl Bench {
    fn s(&self) -> StreamRef<'_> {
        self.stream.as_ref()
    }

    /// Milliseconds per call of `f`, timed with events over `iters` calls after 3.
    fn time(&self, iters: u32, mut f: impl FnMut(u32) -> Res<()>) -> Res<f64> {
        for i in 0..3 {
            f(i)?;
        }
        self.s().record(&self.start)?;
        for i in 0..iters {
            f(i)?;
        }
        self.s().record(&self.end)?;
        self.end.synchronize()?;
        Ok(f64::from(self.end.elapsed_ms_since(&self.start)?) / f64::from(iters))
    }

    fn push(&mut self, case: &str, config: String, ms: f64, bytes: Option<f64>, note: String) {
        let gbs = bytes.map(|b| b / (ms * 1e-3) / 1e9);
        self.rows.push(Row {
            case: case.into(),
            config,
            ms,
            gbs,
            note,
        });
    }

    fn copy_bandwidth(&mut self) -> Res<()> {
        let bytes = 1usize << 30;
        let buf = DeviceMemory::new(&self.ctx, 2 * bytes)?;
        self.s().fill(&buf, 1)?;
        let ms = self.time(ITERS, |_| {
            // SAFETY: two disjoint halves of one allocation that outlives the timing.
            unsafe {
                self.s()
                    .copy_device(buf.ptr() + bytes as u64, buf.ptr(), bytes)
            }?;
            Ok(())
        })?;
        let total = 2.0 * bytes as f64;
        self.copy_gbs = total / (ms * 1e-3) / 1e9;
        self.push(
            "d2d copy",
            "1 GiB (read + write bytes)".into(),
            ms,
            Some(total),
            "reference".into(),
        );
        Ok(())
    }

    /// Decode of `seqs` × `ctx` tokens at `layers` layers; `partition` None = automatic.
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &mut self,
        case: &str,
        layers: u32,
        seqs: u32,
        ctx: u32,
        paged: bool,
        partition: Option<u32>,
    ) -> Res<f64> {
        let g = Geometry::new(layers, KV_HEADS, HEAD_DIM, BLOCK, DType::F16)?;
        let stride = ctx / BLOCK;
        let num_blocks = seqs * stride;
        let arena_bytes = u64::from(num_blocks) * g.bytes_per_block();
        let (free, _) = self.ctx.mem_info()?;
        if arena_bytes > free / 10 * 9 {
            let config = format!("{seqs}x{ctx} tok, {layers} layers");
            let note = format!(
                "skipped: needs {} GiB, {} GiB free",
                arena_bytes >> 30,
                free >> 30
            );
            self.push(case, config, f64::NAN, None, note);
            return Ok(f64::NAN);
        }
        let arena = DeviceMemory::new(&self.ctx, arena_bytes as usize)?;
        self.s().fill(&arena, 0x3c)?; // f16 0x3c3c ≈ 1.06: finite values
        let table: Vec<u32> = if paged {
            shuffled(num_blocks, 0x5eed)
        } else {
            (0..num_blocks).collect()
        };
        let descs: Vec<KvpSeqDesc> = (0..seqs)
            .map(|i| KvpSeqDesc {
                row: i,
                context_len: ctx,
                queries: 1,
                q_start: i,
            })
            .collect();
        let table_dev = device_u32s(self, &table)?;
        let descs_dev = device_u32s(self, &descs_bytes(&descs))?;
        let q_elems = (seqs * Q_HEADS * HEAD_DIM) as usize;
        let q = DeviceMemory::new(&self.ctx, q_elems * 4)?;
        let out = DeviceMemory::new(&self.ctx, q_elems * 4)?;
        self.s().fill(&q, 0)?;
        let sm_count = self.ctx.info().sm_count;
        let partitioning = match partition {
            Some(p) => Partitioning::Tokens(p),
            None => Partitioning::Auto { sm_count },
        };
        let mut plans = Vec::new();
        for layer in 0..layers {
            let call = AttentionCall {
                geometry: g,
                num_blocks,
                layer,
                q_heads: Q_HEADS,
                scale: 1.0 / (HEAD_DIM as f32).sqrt(),
                table: &table,
                stride,
                seqs: &descs,
                q_len: q_elems,
                out_len: q_elems,
            };
            plans.push(plan_attention(&call, partitioning)?.ok_or("nothing to launch")?);
        }
        let scratch = DeviceMemory::new(&self.ctx, (plans[0].scratch_floats * 4).max(4) as usize)?;
        let buffers = AttentionBuffers {
            arena: arena.ptr(),
            q: q.ptr(),
            out: out.ptr(),
            block_table: table_dev.ptr(),
            seqs: descs_dev.ptr(),
            scratch: scratch.ptr(),
        };
        let ms = self.time(ITERS, |i| {
            let plan = &plans[(i % layers) as usize];
            let params = plan.params(buffers);
            // SAFETY: planned for these buffers, which outlive the timing.
            unsafe {
                self.kernels.launch(self.s(), &plan.attention, &params)?;
                if let Some(r) = &plan.reduce {
                    self.kernels.launch(self.s(), r, &params)?;
                }
            }
            Ok(())
        })?;
        let bytes = f64::from(seqs) * f64::from(ctx) * f64::from(KV_HEADS * HEAD_DIM) * 2.0 * 2.0;
        let gbs = bytes / (ms * 1e-3) / 1e9;
        let note = format!(
            "{:.0}% of copy, {} partitions of {} tokens",
            100.0 * gbs / self.copy_gbs,
            plans[0].num_partitions,
            plans[0].partition_tokens
        );
        self.push(
            case,
            format!(
                "{seqs}x{ctx} tok, {layers} layer{}, {}",
                if layers == 1 { "" } else { "s" },
                if paged { "paged" } else { "contiguous" }
            ),
            ms,
            Some(bytes),
            note,
        );
        self.s().synchronize()?;
        Ok(gbs)
    }

    fn write_and_copy(&mut self) -> Res<()> {
        let g = Geometry::new(32, KV_HEADS, HEAD_DIM, BLOCK, DType::F16)?;
        let num_blocks = 1024u32;
        let arena = DeviceMemory::new(
            &self.ctx,
            (u64::from(num_blocks) * g.bytes_per_block()) as usize,
        )?;
        let tokens = 4096u32;
        let slots = shuffled(num_blocks * BLOCK, 7)[..tokens as usize].to_vec();
        let slots_dev = device_u32s(self, &slots)?;
        let elems = (tokens * KV_HEADS * HEAD_DIM) as usize;
        let kv = DeviceMemory::new(&self.ctx, 2 * elems * 4)?;
        self.s().fill(&kv, 0)?;
        let cfg = plan_write(&g, num_blocks, 0, &slots, elems, elems)?.ok_or("no write")?;
        let ms = self.time(ITERS, |i| {
            let params = KvpWriteParams {
                geo: KvpGeometry::new(&g, num_blocks),
                arena: arena.ptr(),
                k: kv.ptr(),
                v: kv.ptr() + (elems * 4) as u64,
                slots: slots_dev.ptr(),
                tokens,
                layer: i % 32,
                k_scale: 0.0,
                v_scale: 0.0,
            };
            // SAFETY: planned for these buffers (every layer has the same shape).
            unsafe { self.kernels.launch(self.s(), &cfg, &params) }?;
            Ok(())
        })?;
        let bytes = elems as f64 * 2.0 * (4.0 + 2.0);
        self.push(
            "write_kv",
            format!("{tokens} tok f32 -> f16, scattered slots"),
            ms,
            Some(bytes),
            "read + write bytes".into(),
        );

        let pairs = 256u32;
        let copies: Vec<BlockCopy> = (0..pairs)
            .map(|i| BlockCopy {
                src: i * 2,
                dst: i * 2 + 1,
            })
            .collect();
        let flat: Vec<u32> = copies.iter().flat_map(|c| [c.src, c.dst]).collect();
        let pairs_dev = device_u32s(self, &flat)?;
        let cfg = plan_copy(&g, num_blocks, &copies)?.ok_or("no copy")?;
        let params = KvpCopyParams {
            arena: arena.ptr(),
            pairs: pairs_dev.ptr(),
            bytes_per_block: g.bytes_per_block(),
            num_pairs: pairs,
            pad0: 0,
        };
        // SAFETY: planned for these buffers.
        let ms = self.time(ITERS, |_| {
            Ok(unsafe { self.kernels.launch(self.s(), &cfg, &params) }?)
        })?;
        let bytes = 2.0 * f64::from(pairs) * g.bytes_per_block() as f64;
        self.push(
            "copy_blocks",
            format!("{pairs} pairs x {} MiB", g.bytes_per_block() >> 20),
            ms,
            Some(bytes),
            format!(
                "{:.0}% of copy",
                100.0 * bytes / (ms * 1e-3) / 1e9 / self.copy_gbs
            ),
        );
        self.s().synchronize()?;
        Ok(())
    }

    fn swaps(&mut self) -> Res<()> {
        let g = Geometry::new(32, KV_HEADS, HEAD_DIM, BLOCK, DType::F16)?;
        let blocks = 256u32;
        let bpb = g.bytes_per_block();
        let arena = DeviceMemory::new(&self.ctx, (u64::from(blocks) * bpb) as usize)?;
        let mut tier = HostTier::new(&self.ctx, blocks, bpb)?;
        let order = shuffled(blocks, 11);
        let out: Vec<BlockCopy> = order
            .iter()
            .enumerate()
            .map(|(i, &b)| BlockCopy {
                src: b,
                dst: i as u32,
            })
            .collect();
        let back: Vec<BlockCopy> = out
            .iter()
            .map(|c| BlockCopy {
                src: c.dst,
                dst: c.src,
            })
            .collect();
        let bytes = f64::from(blocks) * bpb as f64;
        for (dir, copies, name) in [
            (Direction::Out, &out, "swap out (d -> pinned h)"),
            (Direction::In, &back, "swap in (pinned h -> d)"),
        ] {
            let ms = self.time(5, |_| {
                tier.swap(dir, &arena, self.s(), copies)?;
                Ok(())
            })?;
            self.push(
                name,
                format!("{blocks} scattered blocks x {} MiB", bpb >> 20),
                ms,
                Some(bytes),
                String::new(),
            );
        }
        tier.synchronize()?;
        Ok(())
    }

    fn small_step(&mut self) -> Res<()> {
        let g = Geometry::new(1, KV_HEADS, HEAD_DIM, BLOCK, DType::F16)?;
        let (seqs, stride) = (64u32, 256u32);
        let num_blocks = seqs * stride;
        let arena = DeviceMemory::new(
            &self.ctx,
            (u64::from(num_blocks) * g.bytes_per_block()) as usize,
        )?;
        self.s().fill(&arena, 0x3c)?;
        let mut steps = StepBuffers::new(
            &self.ctx,
            StepLimits {
                rows: seqs,
                row_blocks: stride,
                batch_seqs: seqs,
                step_tokens: seqs,
                copy_pairs: seqs,
            },
        )?;
        let mut table: Vec<u32> = (0..num_blocks).collect();
        let q_elems = (seqs * Q_HEADS * HEAD_DIM) as usize;
        let q = DeviceMemory::new(&self.ctx, q_elems * 4)?;
        let out = DeviceMemory::new(&self.ctx, q_elems * 4)?;
        self.s().fill(&q, 0)?;
        let scratch = DeviceMemory::new(&self.ctx, 4)?;
        let mut times = Vec::with_capacity(500);
        let mut descs = vec![KvpSeqDesc::default(); seqs as usize];
        let mut rows = vec![RowUse { row: 0, blocks: 0 }; seqs as usize];
        for it in 0..520u32 {
            let ctx_len = 16 + (it % 64); // grows a block every 16 steps, as decode does
            for i in 0..seqs {
                descs[i as usize] = KvpSeqDesc {
                    row: i,
                    context_len: ctx_len,
                    queries: 1,
                    q_start: i,
                };
                rows[i as usize] = RowUse {
                    row: i,
                    blocks: ctx_len.div_ceil(BLOCK),
                };
            }
            // Two rows trade their first block each step: two entries to upload.
            let r = (it % (seqs - 1)) as usize * stride as usize;
            table.swap(r, r + stride as usize);
            let t0 = Instant::now();
            let call = AttentionCall {
                geometry: g,
                num_blocks,
                layer: 0,
                q_heads: Q_HEADS,
                scale: 0.088,
                table: &table,
                stride,
                seqs: &descs,
                q_len: q_elems,
                out_len: q_elems,
            };
            let plan =
                plan_attention(&call, Partitioning::Tokens(stride * BLOCK))?.ok_or("no plan")?;
            steps.begin()?;
            steps.stage_seqs(&descs)?;
            steps.stage_block_table(&table, stride as usize, &rows)?;
            steps.upload(self.s())?;
            let layout = *steps.layout();
            let params = plan.params(AttentionBuffers {
                arena: arena.ptr(),
                q: q.ptr(),
                out: out.ptr(),
                block_table: steps.device_ptr(layout.block_table),
                seqs: steps.device_ptr(layout.seqs),
                scratch: scratch.ptr(),
            });
            // SAFETY: planned for the uploaded table and descriptors; waited below.
            unsafe { self.kernels.launch(self.s(), &plan.attention, &params) }?;
            steps.end(self.s())?;
            self.s().synchronize()?;
            if it >= 20 {
                times.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        times.sort_by(f64::total_cmp);
        let p50 = times[times.len() / 2];
        let p99 = times[times.len() * 99 / 100];
        self.push(
            "small step",
            format!("{seqs} seqs x <=80 tok: plan+stage+upload+decode+wait"),
            p50,
            None,
            format!(
                "p50 {:.1} us, p99 {:.1} us (host wall)",
                p50 * 1e3,
                p99 * 1e3
            ),
        );
        Ok(())
    }

    fn print(&self) {
        let info = self.ctx.info();
        println!(
            "kvpage-cuda device benchmark on {} ({} SMs, sm_{}{})",
            info.name, info.sm_count, info.compute_capability.0, info.compute_capability.1
        );
        println!(
            "{:<26} {:<46} {:>9} {:>9}  note",
            "case", "config", "ms", "GB/s"
        );
        for r in &self.rows {
            let gbs = r.gbs.map_or("-".into(), |g| format!("{g:.0}"));
            println!(
                "{:<26} {:<46} {:>9.4} {:>9}  {}",
                r.case, r.config, r.ms, gbs, r.note
            );
        }
    }
}

fn run() -> Res<()> {
    let ctx = Context::new(0)?;
    let kernels = Kernels::load(&ctx)?;
    let stream = Stream::new(&ctx)?;
    let (start, end) = (Event::new(&ctx)?, Event::new(&ctx)?);
    let mut b = Bench {
        ctx,
        kernels,
        stream,
        start,
        end,
        rows: Vec::new(),
        copy_gbs: 1.0,
    };
    b.copy_bandwidth()?;
    for layers in [1, 32] {
        let paged = b.decode("decode", layers, 64, 4096, true, None)?;
        let contiguous = b.decode("decode", layers, 64, 4096, false, None)?;
        let last = b.rows.len() - 1;
        b.rows[last].note += &format!(", paged/contiguous {:.2}", paged / contiguous);
    }
    for seqs in [1, 4] {
        b.decode("split-K auto", 1, seqs, 32_768, true, None)?;
        b.decode("split-K off", 1, seqs, 32_768, true, Some(32_768))?;
    }
    b.write_and_copy()?;
    b.swaps()?;
    b.small_step()?;
    b.print();
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("device benchmark: {e}");
        std::process::exit(1);
    }
}
