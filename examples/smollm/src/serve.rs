//! Serving requests with kvpage's [`Engine`]: continuous batching with chunked prefill,
//! the prefix cache (requests whose prompts start alike share those blocks) and fork
//! (parallel samples of one prompt share the prompt's blocks, copy-on-write).
//!
//! Each step, the engine plans which sequences compute which tokens; the model runs all
//! of them as one batch of rows ([`Model::forward`]), storing K/V and attending through
//! the engine ([`Engine::write_kv`], [`Engine::attention`]); the sampled tokens go back
//! with [`Engine::commit_step`].

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvpage::{
    CacheConfig, Capacity, DType, Engine, EngineConfig, EngineError, Preemption, RequestId,
    Sampled, SchedulerConfig,
};

use crate::model::{Attention, Model};
use crate::sample::Sampler;
use crate::Error;

/// The cache and scheduler around the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks in the arena.
    pub blocks: u32,
    /// Sequences live at once (requests and their parallel samples).
    pub max_seqs: u32,
    /// Tokens one sequence may hold (prompt and generation).
    pub max_seq_len: u32,
    /// Tokens computed per step at most (prefill chunks and decode tokens together).
    pub token_budget: u32,
    /// Storage type of the cache.
    pub dtype: DType,
    /// Threads of kvpage's attention kernels (0: one per core).
    pub threads: usize,
    /// A token that ends a generation (the model's end of sequence), if any.
    pub eos: Option<u32>,
    /// Keep the logits every token was chosen from (for comparisons; 200 KB a token).
    pub keep_logits: bool,
}

/// One prompt to serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_new_tokens: u32,
    /// Parallel samples (1: just the request): forks after the first token.
    pub samples: u32,
    /// The engine step before which the request arrives (0: queued at the start). A
    /// request that arrives after another's prompt is computed finds that prompt's
    /// whole blocks in the prefix cache.
    pub arrival_step: u64,
}

/// One generation: a request, or a parallel sample of one.
#[derive(Debug, Clone, Default)]
pub struct Completion {
    /// Index of its request.
    pub request: usize,
    /// Which parallel sample (0: the request itself).
    pub sample: u32,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache (0 for a fork).
    pub prefix_hit_tokens: u32,
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// The logits each generated token was chosen from (with `keep_logits`).
    pub logits: Vec<Vec<f32>>,
    /// From the start of [`serve`] to its first token.
    pub time_to_first_token: Duration,
}

/// What [`serve`] did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Per request, then its parallel samples.
    pub completions: Vec<Completion>,
    /// Most KV blocks in use after any step.
    pub peak_blocks: u32,
    /// Bytes of one KV block.
    pub bytes_per_block: u64,
    /// Bytes of one token's K/V in every layer.
    pub bytes_per_token: u64,
    /// Prompt tokens computed (prefix-cache hits excluded).
    pub prefill_tokens: u64,
    /// Time of the steps that computed prompt tokens.
    pub prefill_time: Duration,
    /// Steps that computed prompt tokens.
    pub prefill_steps: u64,
    /// Tokens decoded in steps without prompt tokens.
    pub decode_tokens: u64,
    /// Time of the steps without prompt tokens.
    pub decode_time: Duration,
    /// Engine steps.
    pub steps: u64,
}

impl Report {
    /// Prompt tokens computed per second.
    pub fn prefill_rate(&self) -> f64 {
        self.prefill_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    /// Tokens decoded per second (in decode-only steps).
    pub fn decode_rate(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// The engine as the model's attention: K/V of the step's rows into the cache, paged
/// attention over each sequence's context.
struct EngineAttention<'e> {
    engine: &'e mut Engine,
    heads: u32,
    scale: f32,
}

impl Attention for EngineAttention<'_> {
    fn attend(
        &mut self,
        layer: u32,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<(), Error> {
        self.engine.write_kv(layer, k, v)?;
        self.engine
            .attention(layer, q, out, self.heads, self.scale)?;
        Ok(())
    }
}

/// A request or a parallel sample in flight.
struct Live {
    completion: usize,
    prompt_len: u32,
    scheduled: bool,
    max_new: u32,
}

/// Serves `requests` (in order of arrival) to the end; the engine batches them.
/// O(steps × (batch rows × weights + attention)).
///
/// # Errors
/// [`Error::TooLong`] for a `max_seq_len` beyond the model's rotary tables; the
/// engine's (e.g. a prompt longer than `max_seq_len`), candle's.
pub fn serve(
    model: &Model,
    config: ServeConfig,
    requests: &[Request],
    sampler: &mut Sampler,
) -> Result<Report, Error> {
    let hp = *model.hparams();
    if config.max_seq_len as usize > model.max_positions() {
        return Err(Error::TooLong {
            max_seq_len: config.max_seq_len,
            positions: model.max_positions(),
        });
    }
    let geometry = hp.geometry(config.block_size, config.dtype)?;
    let mut engine = Engine::new(EngineConfig {
        cache: CacheConfig {
            geometry,
            capacity: Capacity::Blocks(config.blocks),
            max_seqs: config.max_seqs,
            max_seq_len: config.max_seq_len,
            threads: config.threads,
            event_capacity: 0,
            hash_key: None,
            max_namespaces: kvpage::CACHE_NAMESPACES,
        },
        max_requests: config.max_seqs,
        scheduler: SchedulerConfig {
            token_budget: config.token_budget,
            max_running: config.max_seqs,
            watermark_blocks: 0,
            preemption: Preemption::Recompute,
        },
        host_capacity: Capacity::Blocks(0),
    })?;
    let mut report = Report {
        bytes_per_block: geometry.bytes_per_block(),
        bytes_per_token: geometry.bytes_per_token(),
        ..Report::default()
    };
    let mut live: HashMap<RequestId, Live> = HashMap::new();
    report.completions = (0..requests.len())
        .map(|i| Completion {
            request: i,
            prompt_tokens: requests[i].prompt.len(),
            ..Completion::default()
        })
        .collect();
    let start = Instant::now();
    let mut arrived = 0;
    while arrived < requests.len() || engine.in_flight() > 0 {
        // An idle engine takes the next request at once.
        while let Some(r) = requests
            .get(arrived)
            .filter(|r| r.arrival_step <= report.steps || engine.in_flight() == 0)
        {
            let id = engine.add_request(&r.prompt, 0, Some(r.max_new_tokens))?;
            let state = Live {
                completion: arrived,
                prompt_len: r.prompt.len() as u32,
                scheduled: false,
                max_new: r.max_new_tokens,
            };
            live.insert(id, state);
            arrived += 1;
        }
        let t0 = Instant::now();
        engine.step()?;
        // The step's blocks are all allocated now; a finished request frees its own at
        // the commit.
        let used = engine.cache().stats().used_blocks;
        // (A successful step is pending until its commit.)
        let step = engine
            .pending_step()
            .ok_or(kvpage::CacheError::from(EngineError::NoStepInProgress))?;
        let tokens = step.input_tokens().to_vec();
        let mut positions = Vec::with_capacity(tokens.len());
        let mut emitting = Vec::new();
        let mut prompt_rows = 0u64;
        for s in step.seqs() {
            positions.extend(s.first_pos..s.first_pos + s.tokens);
            if let Some(l) = live.get_mut(&s.request) {
                if !l.scheduled {
                    l.scheduled = true;
                    let c = &mut report.completions[l.completion];
                    if c.sample == 0 {
                        c.prefix_hit_tokens = s.first_pos;
                    }
                }
                prompt_rows += u64::from(l.prompt_len.saturating_sub(s.first_pos).min(s.tokens));
            }
            if s.emits {
                emitting.push((s.request, s.offset + s.tokens - 1));
            }
        }
        let rows: Vec<u32> = emitting.iter().map(|&(_, row)| row).collect();
        let mut attention = EngineAttention {
            engine: &mut engine,
            heads: hp.heads as u32,
            scale: hp.attention_scale(),
        };
        let logits = if tokens.is_empty() {
            Vec::new()
        } else {
            model.forward(&tokens, &positions, &mut attention, &rows)?
        };
        report.peak_blocks = report.peak_blocks.max(used);
        let mut sampled = Vec::with_capacity(emitting.len());
        let mut fork_from = Vec::new();
        for ((request, _), l) in emitting.iter().zip(logits) {
            let Some(state) = live.get(request) else {
                continue;
            };
            let c = &mut report.completions[state.completion];
            // A parallel sample differs from its request by its first token only.
            let token = sampler.pick(&l, 0);
            if c.tokens.is_empty() {
                c.time_to_first_token = start.elapsed();
                if c.sample == 0 && requests[c.request].samples > 1 {
                    fork_from.push((*request, l.clone()));
                }
            }
            c.tokens.push(token);
            if config.keep_logits {
                c.logits.push(l);
            }
            let stop = config.eos == Some(token) || c.tokens.len() as u32 >= state.max_new;
            sampled.push(Sampled {
                request: *request,
                token,
                stop,
            });
        }
        let finished: Vec<RequestId> = engine
            .commit_step(&sampled)?
            .iter()
            .map(|f| f.request)
            .collect();
        let elapsed = t0.elapsed();
        report.steps += 1;
        if prompt_rows > 0 {
            report.prefill_tokens += prompt_rows;
            report.prefill_time += elapsed;
            report.prefill_steps += 1;
        } else {
            report.decode_tokens += tokens.len() as u64;
            report.decode_time += elapsed;
        }
        for id in finished {
            live.remove(&id);
        }
        // Parallel samples: fork each request that just chose its first token.
        // (A request that stopped at its first token has no samples.)
        for (parent, logits) in fork_from {
            let Some(state) = live.get(&parent) else {
                continue;
            };
            let request = report.completions[state.completion].request;
            let (prompt_len, max_new) = (state.prompt_len, state.max_new);
            for sample in 1..requests[request].samples {
                // Another choice from the logits the parent's first token came from.
                let token = sampler.pick(&logits, sample as usize);
                let child = engine.fork(parent, Some(token))?;
                live.insert(
                    child,
                    Live {
                        completion: report.completions.len(),
                        prompt_len,
                        scheduled: true,
                        max_new,
                    },
                );
                report.completions.push(Completion {
                    request,
                    sample,
                    prompt_tokens: prompt_len as usize,
                    tokens: vec![token],
                    logits: if config.keep_logits {
                        vec![logits.clone()]
                    } else {
                        Vec::new()
                    },
                    time_to_first_token: start.elapsed(),
                    ..Completion::default()
                });
            }
        }
    }
    Ok(report)
}
