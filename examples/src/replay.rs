//! The `replay` tool: options, set-up and output. `src/bin/replay.rs` only parses the
//! command line and calls [`main_with`].

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use kvpage_core::{Geometry, NamespaceQuota};

use crate::fleet::{self, FleetSummary, RouterKind};
use crate::memory::MemoryConfig;
use crate::metrics::Report;
use crate::presets::{self, DeviceSpec, ModelSpec};
use crate::retention::Retention;
use crate::sim::{run, run_fleet, Hooks, Preemption, RunOutput, SimConfig, TokenSource};
use crate::step_model::Roofline;
use crate::svg;
use crate::trace::{self, Request};

const AFTER_HELP: &str = "\
SIMULATED TIME (the step model)
  Each engine step runs every scheduled sequence once (a prefill chunk or one decode
  token) and takes
      max(bytes / memory bandwidth, FLOPs / peak FLOP/s) + overhead + swap bytes / host link
  bytes = weight bytes + Σ context tokens of the scheduled sequences × KV bytes per token
  FLOPs = 2 × params × tokens processed + 4 × layers × heads × head_dim × Σ keys attended
  with the device's peak bandwidth and dense f16 throughput (times --gpus). It ignores
  kernel efficiency and communication: absolute times are optimistic; the policies differ
  only in which sequences their memory lets run, and that is what the comparison shows.

ENGINE
  Every policy runs on kvpage's engine (kvpage_core::Engine), the step embedders use:
  requests enter as they arrive; each step the core scheduler plans and the engine
  executes on the block manager: running sequences take the token budget
  (--max-batched-tokens) in admission order (chunked prefill, one decode token each);
  when the blocks a sequence needs are not available, the most recently admitted one is
  preempted (by swap for `-swap` policies when the host tier of --swap-space-gb has
  room, else by recompute); swapped-out sequences come back when their blocks, a spare
  and --watermark fit (they run from the next step); then waiting requests are admitted
  first come, first served while their whole prompt fits above the watermark and
  --max-num-seqs allows. The contiguous baseline is a block manager whose block is one
  --max-seq-len region, so the policies differ only in memory.

POLICIES
  contiguous     reserve --max-seq-len tokens per request, first fit (one region per
                 request: equal regions never fragment beyond the budget's tail)
  paged          kvpage blocks of --block-size tokens, on demand; recompute preemption
  paged-swap     paged, preemption by swap to the host tier
  paged-prefix   paged plus the prefix cache: requests share one of --prefix-groups system
                 prompts of --shared-prefix-tokens tokens (drawn with --seed)
  paged-prefix-swap  both

RETENTION
  --tenants N sends request i as tenant i mod N (a prefix-cache namespace); only tenant
  0's requests carry the shared system prompt. --pin-prefix pins the whole blocks of the
  shared prompts (never evicted); --namespace-quota BLOCKS[:RESERVED] limits every
  tenant to BLOCKS blocks held or cached (a tenant at its quota evicts its own cached
  blocks first; RESERVED are kept for it; pinned prompts count against it). A variant
  that leaves a request no room reports it in its row. --retention-table replays the first
  prefix-cache policy four ways (baseline, pin-prefix, quota, both) and prints prefix
  hit tokens and the shared-prompt tokens computed, e.g.
      replay --limit 300 --policies paged-prefix --tenants 2 \
             --shared-prefix-tokens 1024 --kv-budget-gb 4 --retention-table

FLEET
  --replicas N (N > 1) replays the first prefix-cache policy on N replicas, each an
  engine with the whole KV budget and its own clock (they run in parallel), behind a
  router that assigns every request when it arrives; --router round-robin, prefix-aware
  or both (the default) side by side. The prefix-aware router knows each replica's cache
  only from that replica's KV cache events (drained after each of its steps; stored
  blocks indexed by parent hash and token ids, removals and clears applied; a ring that
  overflowed is rebuilt from a snapshot and counted as a resync): it sends a request to
  the replica with the longest cached prefix of its prompt, ties and misses to the one
  with the fewest requests in flight. The table shows fleet prefix-hit tokens and rate
  (of all prompt tokens), TTFT, tokens/s over the fleet's makespan and requests per
  replica, e.g.
      replay --replicas 4 --shared-prefix-tokens 2048 --prefix-groups 32 --kv-budget-gb 8

METRICS
  kv utilization = tokens stored / token slots reserved (time-integrated); waste = slots
  reserved but empty plus free bytes in holes too small for a request, over the budget
  (time-averaged); TTFT and latency are measured from arrival; tokens/s over the makespan.

The default trace is an excerpt of the Azure LLM inference trace 2023 (conversation),
CC-BY 4.0, Patel et al., \"Splitwise\", ISCA 2024 (see examples/traces/README.md).";

/// Replay a request trace through a contiguous baseline and kvpage's paged cache.
#[derive(Parser, Debug, Clone)]
#[command(name = "replay", version, after_long_help = AFTER_HELP)]
pub struct Args {
    /// Trace in the Azure format (TIMESTAMP,ContextTokens,GeneratedTokens); default: the
    /// excerpt shipped in examples/traces/
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,
    /// Replay only the first N requests
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Model preset (llama-2-7b, llama-2-13b, llama-3.1-8b, mistral-7b, llama-3.1-70b; or 7b, 13b, 8b, 70b)
    #[arg(long, default_value = "llama-2-13b")]
    pub model: String,
    /// Override: transformer layers
    #[arg(long)]
    pub layers: Option<u32>,
    /// Override: attention (query) heads
    #[arg(long)]
    pub heads: Option<u32>,
    /// Override: key/value heads
    #[arg(long)]
    pub kv_heads: Option<u32>,
    /// Override: head dimension
    #[arg(long)]
    pub head_dim: Option<u32>,
    /// Override: parameters, in billions
    #[arg(long, value_name = "B")]
    pub params_b: Option<f64>,
    /// KV cache element type: f16, bf16, f32, or 8-bit int8 / fp8 (E4M3), each with an
    /// f32 scale per token and head (about half the bytes of f16)
    #[arg(long, default_value = "f16")]
    pub kv_dtype: String,
    /// Device preset (a100-80gb, h100-80gb, h200-141gb; or a100, h100, h200)
    #[arg(long, default_value = "a100-80gb")]
    pub device: String,
    /// Devices (tensor parallel): memory, bandwidth and FLOP/s add up
    #[arg(long, default_value_t = 1)]
    pub gpus: u32,
    /// Share of device memory the engine may use (weights + KV)
    #[arg(long, default_value_t = 0.9)]
    pub mem_fraction: f64,
    /// KV budget in GB (1e9 B), instead of memory × mem-fraction − weights
    #[arg(long, value_name = "GB")]
    pub kv_budget_gb: Option<f64>,
    /// Override: memory bandwidth per device, GB/s
    #[arg(long, value_name = "GB/S")]
    pub mem_bw_gbs: Option<f64>,
    /// Override: peak dense f16 TFLOP/s per device
    #[arg(long)]
    pub tflops: Option<f64>,
    /// Fixed overhead per step, ms
    #[arg(long, default_value_t = 3.0)]
    pub step_overhead_ms: f64,
    /// Arrival speed-up: X replays X times faster than recorded; `inf` submits everything at t=0
    #[arg(long, default_value = "1")]
    pub rate: String,
    /// Longest sequence (prompt + output); the contiguous policy reserves this much per request
    #[arg(long, default_value_t = 4096)]
    pub max_seq_len: u32,
    /// Tokens per KV block (paged policies)
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Most sequences running at once
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: u32,
    /// Per-step token budget (prefill chunks plus decode tokens)
    #[arg(long, default_value_t = 2048)]
    pub max_batched_tokens: u32,
    /// Share of blocks kept free at admission (paged policies)
    #[arg(long, default_value_t = 0.01)]
    pub watermark: f64,
    /// Host tier for swapping, GB
    #[arg(long, default_value_t = 64.0)]
    pub swap_space_gb: f64,
    /// Policies to compare, comma-separated [default: contiguous,paged,paged-swap, plus
    /// paged-prefix when --shared-prefix-tokens > 0]
    #[arg(long, value_delimiter = ',')]
    pub policies: Option<Vec<String>>,
    /// Tokens of shared system prompt at the start of every prompt (paged-prefix)
    #[arg(long, default_value_t = 0)]
    pub shared_prefix_tokens: u32,
    /// Number of distinct shared system prompts
    #[arg(long, default_value_t = 1)]
    pub prefix_groups: u32,
    /// Seed for the prefix-group draw
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results as a JSON array to PATH
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Draw memory in use and running sequences over time to PATH.svg
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,
    /// No progress bar
    #[arg(long)]
    pub quiet: bool,
    /// Spread the requests over N tenants (prefix-cache namespaces), request i to tenant
    /// i mod N; only tenant 0's requests carry the shared system prompt, the others send
    /// one-off prompts competing for the same memory
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub tenants: u32,
    /// Pin the whole blocks of the shared system prompts: never evicted
    #[arg(long)]
    pub pin_prefix: bool,
    /// Quota of every tenant: at most BLOCKS blocks held or cached, RESERVED of them kept
    /// for it (a tenant at its quota evicts its own cached blocks first)
    #[arg(long, value_name = "BLOCKS[:RESERVED]")]
    pub namespace_quota: Option<String>,
    /// Compare retention on the first prefix-cache policy: baseline, --pin-prefix and
    /// --namespace-quota (default: all blocks but the shared prompts', per tenant),
    /// printing prefix hits and the tokens computed
    #[arg(long)]
    pub retention_table: bool,
    /// Replicas behind a router: N engines, each with the whole KV budget, on their own
    /// clocks; N > 1 replays the first prefix-cache policy (paged-prefix) per router and
    /// prints the fleet table
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub replicas: u32,
    /// Router of --replicas N > 1: round-robin, prefix-aware (from each replica's KV
    /// cache events) or both side by side
    #[arg(long, default_value = "both", value_name = "NAME")]
    pub router: String,
}

/// The routers `--router` names.
///
/// # Errors
/// A message naming `--router` and the known names.
pub fn routers(a: &Args) -> Result<Vec<RouterKind>, String> {
    match a.router.as_str() {
        "round-robin" => Ok(vec![RouterKind::RoundRobin]),
        "prefix-aware" => Ok(vec![RouterKind::PrefixAware]),
        "both" => Ok(vec![RouterKind::RoundRobin, RouterKind::PrefixAware]),
        other => Err(format!(
            "--router: unknown router {other:?}; known: round-robin, prefix-aware, both"
        )),
    }
}

/// The [`Retention`] the flags ask for.
///
/// # Errors
/// A message for a malformed `--namespace-quota`.
pub fn retention(a: &Args) -> Result<Retention, String> {
    let quota = a.namespace_quota.as_deref().map(parse_quota).transpose()?;
    Ok(Retention {
        tenants: a.tenants,
        pin_prefix: a.pin_prefix,
        quota,
    })
}

/// `BLOCKS[:RESERVED]` as a quota.
fn parse_quota(text: &str) -> Result<NamespaceQuota, String> {
    let bad = || {
        format!(
            "--namespace-quota {text:?}: expected BLOCKS or BLOCKS:RESERVED, RESERVED <= BLOCKS"
        )
    };
    let (max, reserved) = text.split_once(':').unwrap_or((text, "0"));
    let max_blocks: u32 = max.trim().parse().map_err(|_| bad())?;
    let reserved_blocks: u32 = reserved.trim().parse().map_err(|_| bad())?;
    if reserved_blocks > max_blocks {
        return Err(bad());
    }
    Ok(NamespaceQuota {
        max_blocks,
        reserved_blocks,
    })
}

/// A policy to run, parsed from its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicySpec {
    /// Its name in the table.
    pub name: String,
    /// Paged (else contiguous).
    pub paged: bool,
    /// Prefix cache.
    pub prefix: bool,
    /// Swap preemption.
    pub swap: bool,
}

/// Parses a policy name: `contiguous`, `paged`, `paged-prefix`, each paged one with an
/// optional `-swap`.
///
/// # Errors
/// A message naming `--policies` and the known names.
pub fn parse_policy(name: &str) -> Result<PolicySpec, String> {
    let n = name.trim().to_ascii_lowercase();
    let (base, swap) = match n.strip_suffix("-swap") {
        Some(b) => (b, true),
        None => (n.as_str(), false),
    };
    let (paged, prefix) = match base {
        "contiguous" if !swap => (false, false),
        "paged" => (true, false),
        "paged-prefix" => (true, true),
        _ => {
            return Err(format!(
                "--policies: unknown policy {name:?}; known: contiguous, paged, paged-swap, paged-prefix, paged-prefix-swap"
            ))
        }
    };
    Ok(PolicySpec {
        name: n.clone(),
        paged,
        prefix,
        swap,
    })
}

/// Everything derived from the options, ready to run.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The model.
    pub model: ModelSpec,
    /// The device (per GPU).
    pub device: DeviceSpec,
    /// KV geometry.
    pub geometry: Geometry,
    /// KV budget, bytes.
    pub budget_bytes: u64,
    /// Requests replayed (arrivals scaled by the rate), ids `0..n`.
    pub requests: Vec<Request>,
    /// Requests left out, with reasons (line: reason).
    pub skipped: Vec<String>,
    /// The trace's display name.
    pub trace_name: String,
    /// The policies.
    pub policies: Vec<PolicySpec>,
    /// Step model.
    pub roofline: Roofline,
    /// The rate as given.
    pub rate: f64,
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let t = s.trim().to_ascii_lowercase();
    if t == "inf" || t == "infinity" {
        return Ok(f64::INFINITY);
    }
    match t.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        _ => Err(format!(
            "--rate {s:?}: expected a positive number (speed-up over the recorded pace) or `inf`"
        )),
    }
}

fn positive(flag: &str, v: f64) -> Result<f64, String> {
    if v > 0.0 && v.is_finite() {
        Ok(v)
    } else {
        Err(format!("{flag} {v}: must be a positive number"))
    }
}

/// Checks the options, reads the trace and sizes everything. O(trace).
///
/// # Errors
/// A message naming the flag or the trace line at fault.
pub fn setup(a: &Args) -> Result<Setup, String> {
    let mut model = presets::model(&a.model).map_err(|e| e.to_string())?;
    let custom = a.layers.is_some()
        || a.heads.is_some()
        || a.kv_heads.is_some()
        || a.head_dim.is_some()
        || a.params_b.is_some();
    if let Some(v) = a.layers {
        model.layers = v;
    }
    if let Some(v) = a.heads {
        model.heads = v;
        if a.kv_heads.is_none() && v < model.kv_heads {
            model.kv_heads = v;
        }
    }
    if let Some(v) = a.kv_heads {
        model.kv_heads = v;
    }
    if let Some(v) = a.head_dim {
        model.head_dim = v;
    }
    if let Some(v) = a.params_b {
        model.params = positive("--params-b", v)? * 1e9;
    }
    if custom {
        model.name = format!("{} (custom)", model.name);
    }
    if model.heads == 0 || model.kv_heads == 0 || model.kv_heads > model.heads {
        return Err(format!(
            "--heads {} / --kv-heads {}: need 0 < kv heads <= heads",
            model.heads, model.kv_heads
        ));
    }
    let dtype = presets::kv_dtype(&a.kv_dtype)?;
    let geometry = Geometry::new(
        model.layers,
        model.kv_heads,
        model.head_dim,
        a.block_size,
        dtype,
    )
    .map_err(|e| {
        format!(
            "--layers/--kv-heads/--head-dim/--block-size ({}, {}, {}, {}): {e}",
            model.layers, model.kv_heads, model.head_dim, a.block_size
        )
    })?;
    let mut device = presets::device(&a.device).map_err(|e| e.to_string())?;
    if let Some(v) = a.mem_bw_gbs {
        device.mem_bw = positive("--mem-bw-gbs", v)? * 1e9;
        device.name = format!("{} (custom)", device.name);
    }
    if let Some(v) = a.tflops {
        device.flops = positive("--tflops", v)? * 1e12;
        device.name = format!("{} (custom)", device.name);
    }
    if a.gpus == 0 {
        return Err("--gpus 0: need at least one device".into());
    }
    if !(a.mem_fraction > 0.0 && a.mem_fraction <= 1.0) {
        return Err(format!(
            "--mem-fraction {}: must be in (0, 1]",
            a.mem_fraction
        ));
    }
    let budget = match a.kv_budget_gb {
        Some(gb) => positive("--kv-budget-gb", gb)? * 1e9,
        None => presets::kv_budget_bytes(&model, &device, a.gpus, a.mem_fraction).ok_or_else(|| {
            format!(
                "--model {} needs {:.1} GB of weights, more than {} × {} × --mem-fraction {} = {:.1} GB: raise --gpus or set --kv-budget-gb",
                model.name,
                model.weight_bytes() / 1e9,
                a.gpus,
                device.name,
                a.mem_fraction,
                device.memory_bytes * f64::from(a.gpus) * a.mem_fraction / 1e9
            )
        })?,
    };
    let budget_bytes = budget as u64;
    let region = geometry.bytes_per_token() * u64::from(a.max_seq_len);
    if a.max_seq_len == 0 || region > budget_bytes {
        return Err(format!(
            "--max-seq-len {}: one sequence needs {:.2} GB of KV, the budget is {:.2} GB",
            a.max_seq_len,
            region as f64 / 1e9,
            budget / 1e9
        ));
    }
    if a.max_batched_tokens == 0 || a.max_num_seqs == 0 {
        return Err("--max-batched-tokens and --max-num-seqs must be at least 1".into());
    }
    if !(0.0..0.5).contains(&a.watermark) {
        return Err(format!("--watermark {}: must be in [0, 0.5)", a.watermark));
    }
    if !(a.swap_space_gb >= 0.0 && a.swap_space_gb.is_finite()) {
        return Err(format!("--swap-space-gb {}: must be >= 0", a.swap_space_gb));
    }
    if a.shared_prefix_tokens > 0 && a.prefix_groups == 0 {
        return Err(
            "--prefix-groups 0: need at least one group when --shared-prefix-tokens > 0".into(),
        );
    }
    if !(a.step_overhead_ms >= 0.0 && a.step_overhead_ms.is_finite()) {
        return Err(format!(
            "--step-overhead-ms {}: must be >= 0",
            a.step_overhead_ms
        ));
    }
    let rate = parse_rate(&a.rate)?;
    let policies = match &a.policies {
        Some(list) => {
            let mut v = Vec::new();
            for n in list.iter().filter(|n| !n.trim().is_empty()) {
                let p = parse_policy(n)?;
                if !v.contains(&p) {
                    v.push(p);
                }
            }
            if v.is_empty() {
                return Err("--policies: empty list".into());
            }
            v
        }
        None => {
            let mut names = vec!["contiguous", "paged", "paged-swap"];
            if a.shared_prefix_tokens > 0 {
                names.push("paged-prefix");
            }
            names
                .into_iter()
                .map(|n| parse_policy(n).expect("known name"))
                .collect()
        }
    };

    let path = a.trace.clone().unwrap_or_else(trace::shipped_excerpt_path);
    let trace_name = match &a.trace {
        Some(p) => p.display().to_string(),
        None => "shipped excerpt (examples/traces/azure-conv-excerpt.csv)".into(),
    };
    let t = trace::load_trace(&path).map_err(|e| e.to_string())?;
    let mut skipped: Vec<String> = t
        .skipped
        .iter()
        .map(|s| format!("line {}: {}", s.line, s.reason))
        .collect();
    let mut requests = Vec::with_capacity(t.requests.len());
    for r in t.requests.iter().take(a.limit.unwrap_or(usize::MAX)) {
        if r.total_tokens() > u64::from(a.max_seq_len) {
            skipped.push(format!(
                "line {}: {} prompt + {} output tokens exceed --max-seq-len {}",
                r.line, r.prompt_tokens, r.output_tokens, a.max_seq_len
            ));
            continue;
        }
        requests.push(Request {
            id: requests.len() as u32,
            arrival_s: if rate.is_infinite() {
                0.0
            } else {
                r.arrival_s / rate
            },
            ..*r
        });
    }
    if requests.is_empty() {
        return Err(format!("{trace_name}: no request left to replay"));
    }
    let roofline = Roofline {
        weight_bytes: model.weight_bytes(),
        kv_bytes_per_token: geometry.bytes_per_token() as f64,
        params: model.params,
        attn_width: f64::from(model.layers) * f64::from(model.heads) * f64::from(model.head_dim),
        mem_bw: device.mem_bw * f64::from(a.gpus),
        flops: device.flops * f64::from(a.gpus),
        host_bw: device.host_bw * f64::from(a.gpus),
        overhead_s: a.step_overhead_ms / 1e3,
    };
    Ok(Setup {
        model,
        device,
        geometry,
        budget_bytes,
        requests,
        skipped,
        trace_name,
        policies,
        roofline,
        rate,
    })
}

/// Runs one policy of `setup`. O(steps × running).
///
/// # Errors
/// A message if the core refuses the configuration or the run fails.
pub fn run_policy(
    a: &Args,
    s: &Setup,
    p: &PolicySpec,
    tokens: &TokenSource,
    progress: Option<&AtomicU64>,
    record_series: bool,
) -> Result<RunOutput, String> {
    run_policy_with(a, s, p, tokens, progress, record_series, retention(a)?)
}

/// [`run_policy`] with the retention settings `retention` instead of the flags'.
///
/// # Errors
/// As [`run_policy`].
pub fn run_policy_with(
    a: &Args,
    s: &Setup,
    p: &PolicySpec,
    tokens: &TokenSource,
    progress: Option<&AtomicU64>,
    record_series: bool,
    retention: Retention,
) -> Result<RunOutput, String> {
    let (cfg, memory) = policy_config(a, s, p, record_series, retention)?;
    let hooks = Hooks {
        progress,
        observer: None,
    };
    let started = Instant::now();
    let mut out = run(
        &p.name,
        &s.requests,
        &memory,
        &s.roofline,
        &cfg,
        tokens,
        hooks,
    )
    .map_err(|e| format!("{}: {e}", p.name))?;
    out.report.extra.wall_s = started.elapsed().as_secs_f64();
    Ok(out)
}

/// The engine limits and the memory of policy `p` under the flags `a`.
///
/// # Errors
/// A message when the watermark leaves no room or the memory cannot be built.
fn policy_config(
    a: &Args,
    s: &Setup,
    p: &PolicySpec,
    record_series: bool,
    retention: Retention,
) -> Result<(SimConfig, MemoryConfig), String> {
    let cfg = SimConfig {
        retention,
        max_num_seqs: a.max_num_seqs,
        max_batched_tokens: a.max_batched_tokens,
        preemption: if p.swap {
            Preemption::Swap
        } else {
            Preemption::Recompute
        },
        record_series,
    };
    let memory = if p.paged {
        let m = MemoryConfig {
            geometry: s.geometry,
            budget_bytes: s.budget_bytes,
            max_seqs: a.max_num_seqs,
            max_seq_len: a.max_seq_len,
            watermark_blocks: (a.watermark * s.geometry.blocks_in(s.budget_bytes) as f64) as u32,
            prefix: p.prefix,
            host_bytes: if p.swap {
                (a.swap_space_gb * 1e9) as u64
            } else {
                0
            },
        };
        let core = m.core_config();
        let blocks_needed = u64::from(core.max_blocks_per_seq) + u64::from(m.watermark_blocks);
        if blocks_needed > u64::from(core.num_blocks) {
            return Err(format!(
                "--watermark {}: one --max-seq-len sequence ({} blocks) plus the watermark ({} blocks) exceed the {} blocks of the budget",
                a.watermark, core.max_blocks_per_seq, m.watermark_blocks, core.num_blocks
            ));
        }
        m
    } else {
        MemoryConfig::contiguous(s.geometry, s.budget_bytes, a.max_num_seqs, a.max_seq_len)
            .map_err(|e| format!("{}: {e}", p.name))?
    };
    Ok((cfg, memory))
}

/// The `--replicas N` run mode: the first prefix-cache policy of `s` on `a.replicas`
/// replicas behind each router of `--router`, in parallel threads; one summary per
/// router, in `--router` order. O(routers × fleet run).
///
/// # Errors
/// A message when no policy has a prefix cache, the flags are malformed or a run fails.
pub fn run_fleets(a: &Args, s: &Setup) -> Result<Vec<FleetSummary>, String> {
    let p = s
        .policies
        .iter()
        .find(|p| p.prefix)
        .ok_or("--replicas needs a prefix-cache policy: --shared-prefix-tokens T or --policies paged-prefix")?;
    let kinds = routers(a)?;
    let replicas = a.replicas.max(1) as usize;
    let (cfg, memory) = policy_config(a, s, p, false, retention(a)?)?;
    let tokens = TokenSource::new(
        s.requests.len(),
        a.shared_prefix_tokens,
        a.prefix_groups,
        a.seed,
    )
    .with_tenants(&cfg.retention);
    std::thread::scope(|scope| {
        let handles: Vec<_> = kinds
            .iter()
            .map(|&k| {
                let (cfg, memory, tokens) = (&cfg, &memory, &tokens);
                scope.spawn(move || {
                    let mut router = k.build(replicas, s.geometry.block_size());
                    let outs = run_fleet(
                        &p.name,
                        &s.requests,
                        memory,
                        &s.roofline,
                        cfg,
                        tokens,
                        replicas,
                        router.as_mut(),
                        Hooks::default(),
                    )
                    .map_err(|e| format!("{} ({}): {e}", p.name, k.name()))?;
                    Ok(FleetSummary::new(k, &s.requests, &outs, router.resyncs()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a replay thread panicked".into()))
            })
            .collect()
    })
}

/// Runs every policy of `setup`, in parallel threads, with a progress bar on stderr when
/// it is a terminal and `--quiet` is off. Results in policy order.
///
/// # Errors
/// The first policy's failure.
pub fn run_all(a: &Args, s: &Setup) -> Result<Vec<RunOutput>, String> {
    let tokens = TokenSource::new(
        s.requests.len(),
        a.shared_prefix_tokens,
        a.prefix_groups,
        a.seed,
    )
    .with_tenants(&retention(a)?);
    let counters: Vec<AtomicU64> = s.policies.iter().map(|_| AtomicU64::new(0)).collect();
    let done = AtomicBool::new(false);
    let total = (s.requests.len() * s.policies.len()) as u64;
    let show = !a.quiet && std::io::stderr().is_terminal();
    let record = a.plot.is_some();
    std::thread::scope(|scope| {
        let bar = show.then(|| {
            scope.spawn(|| {
                let start = Instant::now();
                while !done.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(150));
                    let n: u64 = counters.iter().map(|c| c.load(Ordering::Relaxed)).sum();
                    let frac = n as f64 / total.max(1) as f64;
                    let filled = (frac * 30.0) as usize;
                    eprint!(
                        "\rreplaying [{}{}] {:>3.0}%  {n}/{total} request completions  {:.1}s ",
                        "#".repeat(filled),
                        ".".repeat(30 - filled.min(30)),
                        frac * 100.0,
                        start.elapsed().as_secs_f64()
                    );
                }
                eprint!("\r{:79}\r", "");
            })
        });
        let handles: Vec<_> = s
            .policies
            .iter()
            .zip(&counters)
            .map(|(p, c)| {
                let tokens = &tokens;
                scope.spawn(move || run_policy(a, s, p, tokens, Some(c), record))
            })
            .collect();
        let results: Vec<Result<RunOutput, String>> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a replay thread panicked".into()))
            })
            .collect();
        done.store(true, Ordering::Relaxed);
        if let Some(b) = bar {
            let _ = b.join();
        }
        results.into_iter().collect()
    })
}

fn gb(b: f64) -> String {
    format!("{:.2} GB", b / 1e9)
}

/// The header lines: what was replayed on what.
pub fn describe(a: &Args, s: &Setup) -> String {
    let mut o = String::new();
    let g = &s.geometry;
    let m = &s.model;
    let _ = writeln!(
        o,
        "trace:   {} — {} requests replayed{}",
        s.trace_name,
        s.requests.len(),
        if s.skipped.is_empty() {
            String::new()
        } else {
            format!(", {} skipped", s.skipped.len())
        }
    );
    let _ = writeln!(
        o,
        "model:   {} — {} layers, {} heads, {} KV heads × {} dims, {:.2}B params; KV {} B/token ({:.3} MB), {} B/block of {} tokens",
        m.name, m.layers, m.heads, m.kv_heads, m.head_dim, m.params / 1e9,
        g.bytes_per_token(), g.bytes_per_token() as f64 / 1e6, g.bytes_per_block(), g.block_size()
    );
    let _ = writeln!(
        o,
        "device:  {}{} — {:.0} GB/s, {:.0} TFLOP/s; KV budget {} ({}), {} blocks, contiguous region {} ({} tokens)",
        if a.gpus > 1 { format!("{} × ", a.gpus) } else { String::new() },
        s.device.name,
        s.device.mem_bw / 1e9,
        s.device.flops / 1e12,
        gb(s.budget_bytes as f64),
        if a.kv_budget_gb.is_some() { "--kv-budget-gb".to_string() } else { format!("{:.0}% of memory − {} weights", a.mem_fraction * 100.0, gb(m.weight_bytes())) },
        g.blocks_in(s.budget_bytes),
        gb((g.bytes_per_token() * u64::from(a.max_seq_len)) as f64),
        a.max_seq_len
    );
    let _ = writeln!(
        o,
        "engine:  rate {}, max {} running, {} tokens/step, watermark {:.0}%, step overhead {} ms, swap space {} GB{}",
        if s.rate.is_infinite() { "inf (all at t=0)".to_string() } else { format!("{}× recorded", s.rate) },
        a.max_num_seqs, a.max_batched_tokens, a.watermark * 100.0, a.step_overhead_ms, a.swap_space_gb,
        if a.shared_prefix_tokens > 0 { format!(", shared prefix {} tokens in {} groups", a.shared_prefix_tokens, a.prefix_groups) } else { String::new() }
    );
    if !s.skipped.is_empty() {
        let first: Vec<&str> = s.skipped.iter().take(3).map(String::as_str).collect();
        let _ = writeln!(
            o,
            "skipped: {} (for every policy); first: {}",
            s.skipped.len(),
            first.join("; ")
        );
    }
    o
}

fn f(v: f64, digits: usize) -> String {
    if v.is_finite() {
        format!("{v:.digits$}")
    } else {
        "-".into()
    }
}

/// The side-by-side table: one column per policy.
pub fn table(reports: &[Report]) -> String {
    type Row = (&'static str, fn(&Report) -> String);
    let rows: [Row; 17] = [
        ("completed requests", |r| r.completed.to_string()),
        ("generated tokens/s", |r| f(r.tokens_per_s, 1)),
        ("peak running seqs", |r| r.peak_running.to_string()),
        ("mean running seqs", |r| f(r.mean_running, 1)),
        ("KV utilization", |r| {
            format!("{}%", f(r.kv_utilization * 100.0, 1))
        }),
        ("waste (of budget)", |r| {
            format!("{}%", f(r.waste_fraction * 100.0, 1))
        }),
        ("peak KV reserved", |r| {
            gb(r.extra.peak_reserved_bytes as f64)
        }),
        ("TTFT p50 (s)", |r| f(r.ttft_p50_s, 3)),
        ("TTFT p99 (s)", |r| f(r.ttft_p99_s, 3)),
        ("latency p50 (s)", |r| f(r.latency_p50_s, 2)),
        ("latency p99 (s)", |r| f(r.latency_p99_s, 2)),
        ("preemptions", |r| r.preemptions.to_string()),
        ("  of which swaps", |r| r.extra.swaps.to_string()),
        ("prefix hit tokens", |r| r.prefix_hit_tokens.to_string()),
        ("engine steps", |r| r.extra.steps.to_string()),
        ("makespan (sim s)", |r| f(r.extra.makespan_s, 1)),
        ("wall time, own thread (s)", |r| f(r.extra.wall_s, 2)),
    ];
    let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|(_, g)| reports.iter().map(g).collect())
        .collect();
    let widths: Vec<usize> = (0..reports.len())
        .map(|j| {
            cells
                .iter()
                .map(|c| c[j].len())
                .chain([reports[j].policy.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut o = String::new();
    let _ = write!(o, "{:w0$}", "");
    for (r, w) in reports.iter().zip(&widths) {
        let _ = write!(o, "  {:>w$}", r.policy);
    }
    o.push('\n');
    let _ = writeln!(
        o,
        "{}",
        "-".repeat(w0 + widths.iter().map(|w| w + 2).sum::<usize>())
    );
    for ((label, _), c) in rows.iter().zip(&cells) {
        let _ = write!(o, "{label:w0$}");
        for (v, w) in c.iter().zip(&widths) {
            let _ = write!(o, "  {v:>w$}");
        }
        o.push('\n');
    }
    o
}

/// The whole tool: set up, run, print, write `--json` and `--plot`. Returns the text
/// printed on stdout.
///
/// # Errors
/// A message naming the flag, the trace line or the file at fault.
pub fn main_with(a: &Args) -> Result<String, String> {
    let started = Instant::now();
    let s = setup(a)?;
    let mut out = describe(a, &s);
    if a.retention_table {
        out.push('\n');
        out.push_str(&retention_table(a, &s)?);
        let _ = writeln!(
            out,
            "\nreplay wall time: {:.2} s",
            started.elapsed().as_secs_f64()
        );
        return Ok(out);
    }
    if a.replicas == 0 {
        return Err("--replicas: at least 1".into());
    }
    routers(a)?;
    if a.replicas > 1 {
        if a.json.is_some() || a.plot.is_some() || a.retention_table {
            return Err(
                "--replicas N > 1 prints the fleet table; --json, --plot and --retention-table are for one replica"
                    .into(),
            );
        }
        let rows = run_fleets(a, &s)?;
        let _ = writeln!(
            out,
            "fleet:   {} replicas of {}, each with the KV budget above, routed per request\n",
            a.replicas,
            s.policies.iter().find(|p| p.prefix).map_or("", |p| &p.name)
        );
        out.push_str(&fleet::table(&rows));
        let _ = writeln!(
            out,
            "\nreplay wall time: {:.2} s",
            started.elapsed().as_secs_f64()
        );
        return Ok(out);
    }
    let results = run_all(a, &s)?;
    let reports: Vec<Report> = results.iter().map(|r| r.report.clone()).collect();
    out.push('\n');
    out.push_str(&table(&reports));
    if let Some(p) = &a.json {
        let text = serde_json::to_string_pretty(&reports).map_err(|e| format!("--json: {e}"))?;
        std::fs::write(p, text + "\n").map_err(|e| format!("--json {}: {e}", p.display()))?;
        let _ = writeln!(out, "\nwrote {}", p.display());
    }
    if let Some(p) = &a.plot {
        let lines: Vec<svg::Line<'_>> = results
            .iter()
            .map(|r| svg::Line {
                label: &r.report.policy,
                points: &r.series,
            })
            .collect();
        let title = format!(
            "{} on {}, {} requests of {}, rate {}",
            s.model.name,
            s.device.name,
            s.requests.len(),
            s.trace_name,
            if s.rate.is_infinite() {
                "inf".to_string()
            } else {
                s.rate.to_string()
            }
        );
        std::fs::write(p, svg::render(&title, &lines, s.budget_bytes))
            .map_err(|e| format!("--plot {}: {e}", p.display()))?;
        let _ = writeln!(
            out,
            "{}wrote {}",
            if a.json.is_some() { "" } else { "\n" },
            p.display()
        );
    }
    let _ = writeln!(
        out,
        "\nreplay wall time: {:.2} s",
        started.elapsed().as_secs_f64()
    );
    Ok(out)
}

/// The `--retention-table` run mode: the first prefix-cache policy of `s` replayed
/// without retention, with the shared prompts pinned, with every tenant under a quota
/// (`--namespace-quota`, or an equal share of the blocks) and with both, in parallel;
/// one row each (a variant that fails, say a request that no longer fits next to the
/// pinned prompts or within its quota, gets its error as its row).
///
/// # Errors
/// A message when no policy has a prefix cache or the flags are malformed.
pub fn retention_table(a: &Args, s: &Setup) -> Result<String, String> {
    let p = s
        .policies
        .iter()
        .find(|p| p.prefix)
        .ok_or("--retention-table needs a prefix-cache policy (paged-prefix)")?;
    let base = Retention {
        tenants: a.tenants,
        ..Retention::default()
    };
    // Default quota: every block but the shared prompts' (so no tenant can flush them),
    // and never less than one longest sequence.
    let bs = u64::from(s.geometry.block_size());
    let blocks = s.geometry.blocks_in(s.budget_bytes);
    let prompts = u64::from(a.shared_prefix_tokens).div_ceil(bs) * u64::from(a.prefix_groups);
    let longest = u64::from(a.max_seq_len).div_ceil(bs) + 1;
    let share = blocks.saturating_sub(prompts).max(longest);
    let quota = match retention(a)?.quota {
        Some(q) => q,
        None => NamespaceQuota {
            max_blocks: u32::try_from(share).unwrap_or(u32::MAX),
            reserved_blocks: 0,
        },
    };
    let variants = [
        ("baseline", base),
        (
            "pin-prefix",
            Retention {
                pin_prefix: true,
                ..base
            },
        ),
        (
            "quota",
            Retention {
                quota: Some(quota),
                ..base
            },
        ),
        (
            "pin+quota",
            Retention {
                pin_prefix: true,
                quota: Some(quota),
                ..base
            },
        ),
    ];
    let tokens = TokenSource::new(
        s.requests.len(),
        a.shared_prefix_tokens,
        a.prefix_groups,
        a.seed,
    )
    .with_tenants(&base);
    let results: Vec<Result<RunOutput, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = variants
            .iter()
            .map(|&(_, r)| {
                let tokens = &tokens;
                scope.spawn(move || run_policy_with(a, s, p, tokens, None, false, r))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a replay thread panicked".into()))
            })
            .collect()
    });
    let mut o = String::new();
    let _ = writeln!(
        o,
        "retention on {} ({} tenants; tenant 0 shares {} prompt(s) of {} tokens; quota {} blocks, {} reserved, per tenant)",
        p.name,
        base.tenant_count(),
        a.prefix_groups,
        a.shared_prefix_tokens,
        quota.max_blocks,
        quota.reserved_blocks
    );
    let _ = writeln!(
        o,
        "{:<11} {:>16} {:>22} {:>16} {:>18} {:>12} {:>10}",
        "variant",
        "prefix hit tok",
        "shared-prompt tok comp",
        "tokens computed",
        "recomputed tok",
        "preemptions",
        "TTFT p50"
    );
    for ((name, _), r) in variants.iter().zip(results) {
        let r = match r {
            Ok(out) => out.report,
            // A quota or pinned prompts can leave a request no room: say so in its row.
            Err(e) => {
                let _ = writeln!(o, "{name:<11} failed: {e}");
                continue;
            }
        };
        let _ = writeln!(
            o,
            "{:<11} {:>16} {:>22} {:>16} {:>18} {:>12} {:>9.2}s",
            name,
            r.prefix_hit_tokens,
            r.extra.shared_prompt_computed_tokens,
            r.extra.computed_tokens,
            r.extra.recomputed_tokens,
            r.preemptions,
            r.ttft_p50_s
        );
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut v = vec!["replay", "--quiet"];
        v.extend_from_slice(extra);
        Args::try_parse_from(v).unwrap()
    }

    fn err(extra: &[&str]) -> String {
        setup(&args(extra)).unwrap_err()
    }

    #[test]
    fn bad_options_name_the_flag() {
        assert!(err(&["--model", "gpt"]).starts_with("--model \"gpt\" is not a known preset"));
        assert!(err(&["--device", "tpu-v5"]).starts_with("--device \"tpu-v5\""));
        assert!(err(&["--rate", "fast"]).starts_with("--rate \"fast\""));
        assert!(err(&["--rate", "0"]).starts_with("--rate"));
        assert!(err(&["--policies", "paged,lru"]).starts_with("--policies: unknown policy \"lru\""));
        assert!(err(&["--policies", "contiguous-swap"]).starts_with("--policies"));
        assert!(err(&["--kv-dtype", "fp4"]).starts_with("--kv-dtype"));
        assert!(err(&["--model", "70b"]).contains("raise --gpus or set --kv-budget-gb"));
        assert!(err(&["--kv-budget-gb", "1"]).starts_with("--max-seq-len 4096"));
        assert!(err(&["--block-size", "0"]).contains("--block-size"));
        assert!(err(&["--kv-heads", "64"]).contains("--kv-heads"));
        assert!(err(&["--trace", "/nonexistent/t.csv"])
            .starts_with("cannot read trace /nonexistent/t.csv"));
        assert!(Args::try_parse_from(["replay", "--max-seq-len", "-3"]).is_err());
    }

    #[test]
    fn malformed_trace_names_the_line() {
        let dir = std::env::temp_dir().join(format!("kvpage-replay-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bad.csv");
        std::fs::write(
            &p,
            "TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\n1,ten,5\n",
        )
        .unwrap();
        let e = err(&["--trace", p.to_str().unwrap()]);
        assert!(e.starts_with("trace line 3: ContextTokens \"ten\""), "{e}");
        std::fs::write(
            &p,
            "TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\n1,5000,5\n2,0,3\n",
        )
        .unwrap();
        let s = setup(&args(&["--trace", p.to_str().unwrap()])).unwrap();
        assert_eq!(s.requests.len(), 1);
        assert_eq!(s.skipped.len(), 2);
        assert!(s
            .skipped
            .iter()
            .any(|m| m.starts_with("line 3:") && m.contains("--max-seq-len 4096")));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn presets_budget_and_rate() {
        let s = setup(&args(&[
            "--model", "8b", "--device", "h200", "--rate", "inf", "--limit", "50",
        ]))
        .unwrap();
        // Llama 3.1 8B: 2 × 32 × 8 × 128 × 2 B = 131072 B per token.
        assert_eq!(s.geometry.bytes_per_token(), 131_072);
        assert!(s.requests.iter().all(|r| r.arrival_s == 0.0));
        assert!(s.requests.len() <= 50);
        let s = setup(&args(&[
            "--rate",
            "2",
            "--kv-budget-gb",
            "40",
            "--limit",
            "10",
        ]))
        .unwrap();
        assert_eq!(s.budget_bytes, 40_000_000_000);
        let t = trace::load_trace(&trace::shipped_excerpt_path()).unwrap();
        let last = s.requests.last().unwrap();
        let orig = t.requests.iter().find(|r| r.line == last.line).unwrap();
        assert_eq!(last.arrival_s, orig.arrival_s / 2.0);
        let names: Vec<&str> = s.policies.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["contiguous", "paged", "paged-swap"]);
        let s = setup(&args(&["--shared-prefix-tokens", "64", "--limit", "1"])).unwrap();
        assert_eq!(s.policies.len(), 4);
    }

    #[test]
    fn retention_flags_parse_and_the_table_shows_pinning_and_quotas() {
        assert!(retention(&args(&["--namespace-quota", "10:11"])).is_err());
        assert!(retention(&args(&["--namespace-quota", "x"])).is_err());
        let r = retention(&args(&[
            "--tenants",
            "3",
            "--pin-prefix",
            "--namespace-quota",
            "300:20",
        ]))
        .unwrap();
        assert_eq!(
            r,
            Retention {
                tenants: 3,
                pin_prefix: true,
                quota: Some(NamespaceQuota {
                    max_blocks: 300,
                    reserved_blocks: 20
                }),
            }
        );
        // A hot shared prompt under memory pressure next to a tenant of one-off prompts.
        let a = args(&[
            "--limit",
            "300",
            "--policies",
            "paged-prefix",
            "--tenants",
            "2",
            "--shared-prefix-tokens",
            "1024",
            "--kv-budget-gb",
            "4",
            "--retention-table",
        ]);
        let s = setup(&a).unwrap();
        let text = retention_table(&a, &s).unwrap();
        let rows: Vec<Vec<&str>> = text
            .lines()
            .skip(2)
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            rows.iter().map(|r| r[0]).collect::<Vec<_>>(),
            ["baseline", "pin-prefix", "quota", "pin+quota"]
        );
        let shared_computed = |r: &Vec<&str>| r[2].parse::<u64>().unwrap();
        // Pinned, the shared prompt is computed far less often than without.
        assert!(
            shared_computed(&rows[1]) * 2 < shared_computed(&rows[0]),
            "{text}"
        );
        assert!(
            shared_computed(&rows[2]) < shared_computed(&rows[0]),
            "{text}"
        );
        // Without a prefix-cache policy the mode says so.
        let a = args(&["--limit", "10", "--policies", "paged", "--retention-table"]);
        assert!(retention_table(&a, &setup(&a).unwrap())
            .unwrap_err()
            .contains("prefix-cache policy"));
    }

    #[test]
    fn a_short_replay_writes_json_and_svg() {
        let dir = std::env::temp_dir().join(format!("kvpage-replay-out-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (j, p) = (dir.join("r.json"), dir.join("r.svg"));
        let a = args(&[
            "--limit",
            "300",
            "--model",
            "7b",
            "--shared-prefix-tokens",
            "128",
            "--prefix-groups",
            "2",
            "--policies",
            "contiguous,paged,paged-prefix,paged-prefix-swap",
            "--json",
            j.to_str().unwrap(),
            "--plot",
            p.to_str().unwrap(),
        ]);
        let text = main_with(&a).unwrap();
        assert!(text.contains("completed requests") && text.contains("replay wall time"));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
        let arr = v.as_array().unwrap();
        assert_eq!(arr.len(), 4);
        let n = setup(&a).unwrap().requests.len() as u64;
        for r in arr {
            assert_eq!(r["completed"].as_u64(), Some(n));
        }
        assert_eq!(arr[2]["policy"], "paged-prefix");
        assert!(arr[2]["prefix_hit_tokens"].as_u64().unwrap() > 0);
        assert_eq!(arr[1]["prefix_hit_tokens"].as_u64(), Some(0));
        let svg = std::fs::read_to_string(&p).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 12);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_whole_shipped_excerpt_replays_with_default_options() {
        let a = args(&[]);
        let s = setup(&a).unwrap();
        assert_eq!(s.requests.len() + s.skipped.len(), 2500);
        for r in run_all(&a, &s).unwrap() {
            assert_eq!(
                r.report.completed,
                s.requests.len() as u64,
                "{}",
                r.report.policy
            );
            assert!(r.outcomes.iter().all(|o| o.completions == 1));
            assert!(r.report.extra.peak_reserved_bytes <= s.budget_bytes);
        }
    }
}
