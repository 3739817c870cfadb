//! The `long_chat` example: a scripted conversation with [`TinyLm`] that runs far past
//! the cache's per-sequence capacity by context shift, then is saved, restored into a
//! fresh cache, and continued there with the same outputs as in the original.
//!
//! The strategy is llama.cpp's: the system prompt stays (`n_keep`); when the next turn
//! would not fit in `max_seq_len`, the oldest half of the rest goes
//! ([`KvCache::context_shift`]), the later tokens move down and their keys are
//! re-rotated by the position change ([`KvCache::rotate_keys`]) — nothing is
//! recomputed. Here the discarded half is rounded down to whole blocks, so the shift is
//! a page-table edit: no K/V row is copied, only the moved keys are rotated.

use std::error::Error;

use kvpage::{CacheConfig, Capacity, KvCache, ModelFingerprint, Seq};

use crate::rng::SplitMix64;
use crate::tiny_lm::{argmax, DenseKv, TinyLm, KV_HEADS, LAYERS, ROPE, VOCAB};

/// The example's knobs (the defaults are what the binary runs).
#[derive(Debug, Clone, Copy)]
pub struct Script {
    /// Seed of the weights and of the user turns.
    pub seed: u64,
    /// Tokens per cache block.
    pub block_size: u32,
    /// Tokens one sequence may hold.
    pub max_seq_len: u32,
    /// Tokens of the system prompt, kept through every shift.
    pub system_tokens: u32,
    /// User turns.
    pub turns: u32,
    /// Tokens of a user turn: drawn in this range.
    pub user_tokens: (u32, u32),
    /// Tokens the model replies per turn: drawn in this range.
    pub reply_tokens: (u32, u32),
    /// Tokens generated after the restore, in the original and in the copies.
    pub continue_tokens: u32,
}

impl Default for Script {
    fn default() -> Self {
        Self {
            seed: 12,
            block_size: 16,
            max_seq_len: 256,
            system_tokens: 32,
            turns: 48,
            user_tokens: (6, 14),
            reply_tokens: (12, 20),
            continue_tokens: 40,
        }
    }
}

/// Largest relative difference of logits the paged cache may show against the dense
/// reference (`f32` kernels against `f64` attention).
const TOLERANCE: f64 = 1e-4;

/// The fingerprint the conversation is saved under: a restore with another is refused.
const FINGERPRINT: ModelFingerprint = ModelFingerprint::from_u64(0x7469_6e79_6c6d);

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// One conversation held in a cache.
struct Chat {
    seq: Seq,
    /// The token ids the cache holds, in order (what a save writes next to the K/V).
    tokens: Vec<u32>,
    /// Logits after the last token.
    logits: Vec<f32>,
    /// Un-rotated keys and values of every token, for the correctness check after the
    /// first shift; dropped after it.
    shadow: Option<DenseKv>,
}

/// What one context shift did.
struct Shift {
    len_before: u32,
    n_keep: u32,
    n_discard: u32,
    rows_moved: u32,
    rotated: u32,
    delta: i32,
    blocks_before: u32,
}

/// Totals of the conversation.
#[derive(Default)]
struct Totals {
    processed: u64,
    shifts: u32,
    discarded: u64,
    rotated: u64,
    recompute_alternative: u64,
    peak_blocks: u32,
}

/// Runs the model over `tokens` appended to `chat`. O(tokens × (weights + context)).
fn feed(model: &TinyLm, cache: &mut KvCache, chat: &mut Chat, tokens: &[u32]) -> Result<()> {
    cache.append_tokens(chat.seq, tokens)?;
    let out = model.forward(cache, chat.seq, tokens)?;
    if let Some(shadow) = &mut chat.shadow {
        shadow.extend(&out.kv);
    }
    chat.tokens.extend_from_slice(tokens);
    chat.logits = out.logits;
    Ok(())
}

/// Greedy decoding of `n` tokens; returns them.
fn reply(model: &TinyLm, cache: &mut KvCache, chat: &mut Chat, n: u32) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for _ in 0..n {
        let next = argmax(&chat.logits);
        feed(model, cache, chat, &[next])?;
        out.push(next);
    }
    Ok(out)
}

/// Makes room for `need` more tokens: if they do not fit in `max_seq_len`, keeps the
/// system prompt, discards the oldest half of the rest (rounded down to whole blocks)
/// and re-rotates the moved keys. Returns what the shift did, if one was needed.
fn make_room(
    script: &Script,
    cache: &mut KvCache,
    chat: &mut Chat,
    need: u32,
) -> Result<Option<Shift>> {
    let len = cache.len(chat.seq)?;
    if len + need <= script.max_seq_len {
        return Ok(None);
    }
    let n_keep = script.system_tokens;
    let bs = script.block_size;
    let n_discard = ((len - n_keep) / 2 / bs * bs).max(bs).min(len - n_keep);
    if len - n_discard + need > script.max_seq_len {
        return Err(format!("a turn of {need} tokens cannot fit after a shift").into());
    }
    let blocks_before = cache.stats().used_blocks;
    // The edit: a page-table change (plus row moves when not block-aligned), positions
    // of the moved tokens lowered by `n_discard`. Their keys still carry the rotation
    // of their old positions: turn them by the reported delta.
    let shift = cache.context_shift(chat.seq, n_keep, n_discard)?;
    cache.rotate_keys(
        chat.seq,
        shift.rotate_first,
        shift.rotate_end,
        shift.delta.into(),
        ROPE,
    )?;
    let (first, end) = (n_keep as usize, (n_keep + n_discard) as usize);
    chat.tokens.drain(first..end);
    if let Some(shadow) = &mut chat.shadow {
        shadow.remove(first, end);
    }
    Ok(Some(Shift {
        len_before: len,
        n_keep,
        n_discard,
        rows_moved: shift.edited.moves,
        rotated: shift.rotate_end - shift.rotate_first,
        delta: shift.delta,
        blocks_before,
    }))
}

/// Largest difference of `got` from `want`, absolute and relative to the largest
/// `|want|`.
fn max_diff(got: &[f32], want: &[f32]) -> (f64, f64) {
    let abs = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| f64::from(a - b).abs())
        .fold(0.0, f64::max);
    let scale = want.iter().map(|&b| f64::from(b).abs()).fold(0.0, f64::max);
    (abs, abs / scale.max(f64::MIN_POSITIVE))
}

fn kib(bytes: u64) -> String {
    format!("{:.0} KiB", bytes as f64 / 1024.0)
}

fn cache_config(script: &Script, seqs: u32) -> Result<CacheConfig> {
    // Room for each sequence's full length, plus one block for its next turn.
    let blocks = script.max_seq_len.div_ceil(script.block_size) + 1;
    Ok(CacheConfig {
        geometry: TinyLm::geometry(script.block_size)?,
        capacity: Capacity::Blocks(blocks * seqs),
        max_seqs: seqs,
        max_seq_len: script.max_seq_len,
        threads: 1,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
}

/// Runs the script and prints what happens; an error is a failed check (or a bug).
///
/// # Errors
/// The cache's errors, and a message when the shifted cache disagrees with the dense
/// reference or a restored conversation continues differently from the original.
pub fn run(script: &Script) -> Result<()> {
    let model = TinyLm::new(script.seed);
    let mut rng = SplitMix64::new(script.seed ^ 0x5eed);
    let mut draw = |(lo, hi): (u32, u32)| rng.range_u32(lo, hi);
    let config = cache_config(script, 1)?;
    let bpb = config.geometry.bytes_per_block();
    let mut cache = KvCache::new(config)?;
    println!(
        "tiny transformer: {LAYERS} layers, {KV_HEADS} KV heads, vocabulary {VOCAB}; cache: \
         {} tokens per sequence, blocks of {} tokens ({}), {} blocks",
        script.max_seq_len,
        script.block_size,
        kib(bpb),
        cache.stats().total_blocks
    );

    let seq = cache.create(1)?;
    let mut chat = Chat {
        seq,
        tokens: Vec::new(),
        logits: Vec::new(),
        shadow: Some(DenseKv::new()),
    };
    let system: Vec<u32> = (0..script.system_tokens)
        .map(|_| draw((0, VOCAB as u32 - 1)))
        .collect();
    feed(&model, &mut cache, &mut chat, &system)?;
    let mut totals = Totals {
        processed: system.len() as u64,
        ..Totals::default()
    };
    println!(
        "system prompt: {} tokens, kept through every shift (n_keep)\n",
        system.len()
    );
    println!(
        "shift  turn   tokens   kept  discarded  rows moved  keys re-rotated  recomputed  \
         recompute-on-overflow  blocks held"
    );

    for turn in 1..=script.turns {
        let user: Vec<u32> = (0..draw(script.user_tokens))
            .map(|_| draw((0, VOCAB as u32 - 1)))
            .collect();
        let reply_len = draw(script.reply_tokens);
        let shifted = make_room(script, &mut cache, &mut chat, user.len() as u32 + reply_len)?;
        if let Some(s) = &shifted {
            totals.shifts += 1;
            totals.discarded += u64::from(s.n_discard);
            totals.rotated += u64::from(s.rotated);
            // Recompute on overflow would rebuild the K/V of everything kept.
            let recompute = u64::from(s.len_before - s.n_discard);
            totals.recompute_alternative += recompute;
            println!(
                "{:>5}  {:>4}  {:>3}→{:<3}  {:>4}  {:>9}  {:>10}  {:>9} by {:<4}  {:>10}  {:>21}  {:>2} → {:<2} ({})",
                totals.shifts,
                turn,
                s.len_before,
                s.len_before - s.n_discard,
                s.n_keep,
                s.n_discard,
                s.rows_moved,
                s.rotated,
                s.delta,
                0,
                recompute,
                s.blocks_before,
                cache.stats().used_blocks,
                kib(u64::from(cache.stats().used_blocks) * bpb),
            );
        }
        if shifted.is_some() && chat.shadow.is_some() {
            check_after_shift(&model, &mut cache, &mut chat, &user)?;
        } else {
            feed(&model, &mut cache, &mut chat, &user)?;
        }
        reply(&model, &mut cache, &mut chat, reply_len)?;
        totals.processed += (user.len() as u32 + reply_len) as u64;
        totals.peak_blocks = totals.peak_blocks.max(cache.stats().used_blocks);
    }

    let len = cache.len(chat.seq)?;
    let whole = totals.processed.div_ceil(u64::from(script.block_size));
    println!(
        "\nconversation: {} turns, {} tokens processed through a {}-token sequence; {} now \
         in the cache",
        script.turns, totals.processed, script.max_seq_len, len
    );
    println!(
        "context shifts: {}, tokens discarded {}, keys re-rotated {} tokens; tokens \
         recomputed: 0 (recompute on overflow: {})",
        totals.shifts, totals.discarded, totals.rotated, totals.recompute_alternative
    );
    println!(
        "memory held: at most {} blocks = {} (the whole conversation: {} blocks = {})",
        totals.peak_blocks,
        kib(u64::from(totals.peak_blocks) * bpb),
        whole,
        kib(whole * bpb)
    );
    if totals.shifts == 0 {
        return Err("the script never needed a context shift".into());
    }

    save_restore_continue(script, &model, &mut cache, &mut chat)?;
    restart_with_prefix_cache(script, &model, &system)?;
    println!("\nlong_chat: all checks passed");
    Ok(())
}

/// The first turn after the first shift: the next token's logits from the shifted
/// paged cache against the dense reference over the same keys and values at their new
/// positions, rotated from scratch (must agree within [`TOLERANCE`]); and, for
/// information, against recomputing the shifted text from nothing.
fn check_after_shift(
    model: &TinyLm,
    cache: &mut KvCache,
    chat: &mut Chat,
    user: &[u32],
) -> Result<()> {
    let Some(context) = chat.shadow.take() else {
        return Ok(());
    };
    feed(model, cache, chat, user)?;
    let dense = model.forward_dense(&context, user);
    let (abs, rel) = max_diff(&chat.logits, &dense.logits);
    let recomputed = model.forward_dense(&DenseKv::new(), &chat.tokens);
    let (re_abs, _) = max_diff(&chat.logits, &recomputed.logits);
    println!(
        "       check: next-token logits after the shift vs dense attention over the same \
         K/V at the new positions: max |diff| {abs:.1e} (relative {rel:.1e}, tolerance \
         {TOLERANCE:.0e}) {}\n       (recomputing the shifted text from scratch differs by \
         {re_abs:.2}: its deeper layers no longer see the discarded turns; same next token: \
         {})",
        if rel <= TOLERANCE { "ok" } else { "MISMATCH" },
        if argmax(&chat.logits) == argmax(&recomputed.logits) {
            "yes"
        } else {
            "no"
        },
    );
    if rel > TOLERANCE {
        return Err(format!(
            "the shifted cache disagrees with the reference: relative error {rel:e}"
        )
        .into());
    }
    Ok(())
}

/// Saves the conversation to a buffer and to a file, restores both into a fresh cache,
/// and continues all three with one more user turn; their replies must be identical.
fn save_restore_continue(
    script: &Script,
    model: &TinyLm,
    cache: &mut KvCache,
    chat: &mut Chat,
) -> Result<()> {
    let mut blob = vec![0u8; cache.saved_seq_size(chat.seq, true)?];
    let n = cache.save_seq(chat.seq, Some(&chat.tokens), &FINGERPRINT, &mut blob)?;
    let dir = std::env::temp_dir().join(format!("kvpage-long-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("conversation.kvseq");
    let file_bytes = cache.save_seq_to_file(chat.seq, Some(&chat.tokens), &FINGERPRINT, &path)?;
    println!(
        "\nsaved: {} tokens, {} blocks: {} bytes into a buffer, {} bytes into {}",
        chat.tokens.len(),
        cache.block_manager().blocks(chat.seq.id())?.len(),
        n,
        file_bytes,
        path.display()
    );

    // A fresh cache, with another sequence already holding its first blocks: the
    // restores take whatever blocks are free.
    let mut fresh = KvCache::new(cache_config(script, 3)?)?;
    let other = fresh.create(2)?;
    fresh.append(other, script.block_size * 3)?;
    let refused = fresh.restore_seq(&blob, 1, &ModelFingerprint::from_u64(7));
    println!(
        "restore under another model's fingerprint: {}",
        match &refused {
            Ok(_) => "accepted (wrong)".to_owned(),
            Err(e) => format!("refused ({e})"),
        }
    );
    if refused.is_ok() {
        return Err("a blob of another model was restored".into());
    }
    let (from_buffer, info) = fresh.restore_seq(&blob[..n], 1, &FINGERPRINT)?;
    let buffer_tokens = info.tokens.map(|t| t.to_vec()).unwrap_or_default();
    let (from_file, file) = fresh.restore_seq_from_file(&path, 1, &FINGERPRINT)?;
    let _ = std::fs::remove_dir_all(&dir);
    for (what, seq, tokens) in [
        ("buffer", from_buffer, buffer_tokens),
        ("file", from_file, file.tokens.unwrap_or_default()),
    ] {
        println!(
            "restored from the {what}: {} tokens in blocks {:?} (the original's: {:?})",
            fresh.len(seq)?,
            fresh.block_manager().blocks(seq.id())?,
            cache.block_manager().blocks(chat.seq.id())?
        );
        if tokens != chat.tokens {
            return Err(format!("the {what} gave back other token ids").into());
        }
    }

    // One more user turn, and `continue_tokens` of reply, in all three (each shifting
    // first if they do not fit).
    let mut rng = SplitMix64::new(script.seed ^ 0xc0de);
    let user: Vec<u32> = (0..script.user_tokens.1)
        .map(|_| rng.range_u32(0, VOCAB as u32 - 1))
        .collect();
    let need = user.len() as u32 + script.continue_tokens;
    let mut restored: Vec<Chat> = [from_buffer, from_file]
        .into_iter()
        .map(|seq| Chat {
            seq,
            tokens: chat.tokens.clone(),
            logits: Vec::new(),
            shadow: None,
        })
        .collect();
    let continue_in = |cache: &mut KvCache, chat: &mut Chat| -> Result<Vec<u32>> {
        if let Some(s) = make_room(script, cache, chat, need)? {
            println!(
                "  (first a shift: {} → {} tokens, {} keys re-rotated)",
                s.len_before,
                s.len_before - s.n_discard,
                s.rotated
            );
        }
        feed(model, cache, chat, &user)?;
        reply(model, cache, chat, script.continue_tokens)
    };
    let original = continue_in(cache, chat)?;
    println!("continued the original: {original:?}");
    let bits = |c: &Chat| c.logits.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    for (what, c) in ["buffer", "file"].into_iter().zip(&mut restored) {
        let got = continue_in(&mut fresh, c)?;
        // The same K/V bytes through the same kernels: equal to the last bit.
        let same = got == original && c.tokens == chat.tokens && bits(c) == bits(chat);
        println!(
            "continued the restore from the {what}: {}",
            if same {
                "identical tokens, bit-identical logits"
            } else {
                "DIFFERENT"
            }
        );
        if !same {
            return Err(format!(
                "the conversation restored from the {what} continued differently: {got:?}"
            )
            .into());
        }
    }
    Ok(())
}

/// One request of a fresh conversation: the system prompt and a user turn through the
/// prefix cache, then `n` greedy tokens. Returns the prompt tokens reused from the
/// prefix cache, the logits after the prompt and the generated tokens.
fn first_request(
    model: &TinyLm,
    cache: &mut KvCache,
    prompt: &[u32],
    n: u32,
) -> Result<(u32, Vec<f32>, Vec<u32>)> {
    let start = cache.create_with_prompt(1, prompt)?;
    let out = model.forward(cache, start.seq, &prompt[start.reused_tokens as usize..])?;
    let mut chat = Chat {
        seq: start.seq,
        tokens: prompt.to_vec(),
        logits: out.logits.clone(),
        shadow: None,
    };
    let generated = reply(model, cache, &mut chat, n)?;
    cache.release(start.seq)?;
    Ok((start.reused_tokens, out.logits, generated))
}

/// A restart with a persistent prefix cache: a server that served the system prompt
/// saves its prefix cache at shutdown; the next run loads it, and its first request
/// hits the system prompt, computes only the rest, and continues exactly like a cold
/// start that computes everything.
fn restart_with_prefix_cache(script: &Script, model: &TinyLm, system: &[u32]) -> Result<()> {
    let config = cache_config(script, 2)?;
    let dir = std::env::temp_dir().join(format!("kvpage-long-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("prefix-cache.kvpc");
    let mut prompt = system.to_vec();
    prompt.extend((0..9).map(|i| (i * 37 + 5) % VOCAB as u32));
    let n = script.continue_tokens;

    let mut before = KvCache::new(config)?;
    let (cold_reused, cold_logits, cold) = first_request(model, &mut before, &prompt, n)?;
    let saved = before.save_prefix_cache_to_file(&FINGERPRINT, &path)?;
    drop(before);
    let mut after = KvCache::new(config)?;
    let report = after.load_prefix_cache_from_file(&path, &FINGERPRINT)?;
    let (warm_reused, warm_logits, warm) = first_request(model, &mut after, &prompt, n)?;
    std::fs::remove_dir_all(&dir)?;
    let (rel, _) = max_diff(&warm_logits, &cold_logits);
    println!(
        "\nrestart: the prefix cache saved at shutdown ({} blocks, {} bytes) and loaded at \
         start-up ({} loaded, {} damaged, {} without room)",
        saved.blocks, saved.bytes, report.loaded, report.damaged, report.no_room
    );
    println!(
        "first request after the restart: {} of {} prompt tokens from the loaded cache \
         (cold start: {}), {} computed; logits differ by {rel:.1e} (relative), the next {n} \
         tokens {}",
        warm_reused,
        prompt.len(),
        cold_reused,
        prompt.len() as u32 - warm_reused,
        if warm == cold { "identical" } else { "DIFFER" }
    );
    let system_blocks = script.system_tokens / script.block_size * script.block_size;
    if warm_reused < system_blocks || cold_reused != 0 {
        return Err(format!("the loaded prefix cache was not hit: {warm_reused} tokens").into());
    }
    if warm != cold || rel > TOLERANCE {
        return Err(format!("after the restart the model continued differently: {warm:?}").into());
    }
    Ok(())
}
