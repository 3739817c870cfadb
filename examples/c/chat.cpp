// Two conversations with one system prompt through kvpage's engine step (tier 1 of the
// C API, through the RAII wrappers of kvpage.hpp): kvpage schedules the requests
// (chunked prefill within a token budget, decode, the prefix cache), the program plays
// the model — it computes q, k, v of each step's tokens, lets kvpage store K/V and run
// attention, checks every output against a plain reference, and samples the next
// tokens. One answer is forked into a second answer.
//
// The "model" is the same stand-in as chat.c's: a hash of (token, position, layer,
// head, dim). Output is compared with expected/chat_cpp.txt by the tests.
#include <kvpage.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr uint32_t kLayers = 2, kKvHeads = 2, kHeadDim = 16, kBlock = 4, kQHeads = 4;
constexpr uint32_t kMaxLen = 64;
constexpr float kScale = 0.25f;       // 1 / sqrt(kHeadDim)
constexpr double kTolerance = 2e-2;  // K/V are stored as bf16

float model(uint32_t token, uint32_t pos, uint32_t layer, uint32_t kind, uint32_t head,
            uint32_t dim) {
  uint32_t h = token * 2654435761u ^ pos * 40503u ^ layer * 97u ^ kind * 7919u ^ head * 131u ^
               dim * 17u;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  return static_cast<float>(h & 0xffffu) / 32768.0f - 1.0f;
}

bool check(const kvpage::Status &s, const char *what) {
  if (!s) std::fprintf(stderr, "%s failed: %s\n", what, s.message());
  return s.ok();
}

// Largest difference between kvpage's output for query position `pos` of a request
// whose tokens are `tokens`, and causal attention over positions 0..=pos from scratch.
double reference_error(const std::vector<uint32_t> &tokens, uint32_t layer, uint32_t pos,
                       const float *q, const float *out) {
  double worst = 0.0;
  for (uint32_t h = 0; h < kQHeads; h++) {
    uint32_t kvh = h / (kQHeads / kKvHeads);
    std::vector<double> p(pos + 1);
    double max = -1e300, sum = 0.0;
    for (uint32_t j = 0; j <= pos; j++) {
      double s = 0.0;
      for (uint32_t d = 0; d < kHeadDim; d++)
        s += q[h * kHeadDim + d] * model(tokens[j], j, layer, 0, kvh, d);
      p[j] = s * kScale;
      max = p[j] > max ? p[j] : max;
    }
    for (double &x : p) sum += (x = std::exp(x - max));
    for (uint32_t d = 0; d < kHeadDim; d++) {
      double want = 0.0;
      for (uint32_t j = 0; j <= pos; j++) want += p[j] / sum * model(tokens[j], j, layer, 1, kvh, d);
      double diff = std::fabs(want - out[h * kHeadDim + d]);
      worst = diff > worst ? diff : worst;
    }
  }
  return worst;
}

const char *reason_name(uint32_t reason) {
  switch (reason) {
    case KVPAGE_FINISH_STOP: return "stop";
    case KVPAGE_FINISH_MAX_TOKENS: return "max tokens";
    default: return "length";
  }
}

}  // namespace

int main() {
  const kvpage_geometry g = {kLayers, kKvHeads, kHeadDim, kBlock, KVPAGE_DTYPE_BF16};
  kvpage_engine_params params = kvpage_engine_default_params(g);
  params.cache.capacity_bytes = 0;
  params.cache.capacity_blocks = 64;
  params.cache.max_seqs = 8;
  params.cache.max_seq_len = kMaxLen;
  params.cache.threads = 2;
  params.max_requests = 8;
  params.scheduler.token_budget = 12;  // long prompts are prefilled in chunks
  kvpage::Engine engine;
  if (!check(kvpage::Engine::create(params, engine), "engine")) return 1;
  std::printf("engine: %u blocks of %u tokens (bf16), %u tokens a step\n",
              params.cache.capacity_blocks, kBlock, params.scheduler.token_budget);

  const std::vector<uint32_t> system_prompt = {101, 7, 42, 9, 300, 12, 5, 88, 61, 2, 17, 640};
  std::vector<uint32_t> a = system_prompt, b = system_prompt;
  for (uint32_t t : {400u, 401u, 402u, 403u, 404u}) a.push_back(t);
  for (uint32_t t : {500u, 501u, 502u, 503u, 504u, 505u}) b.push_back(t);
  kvpage_request ra = 0, rb = 0, rc = KVPAGE_REQUEST_NONE;
  if (!check(engine.add_request(1, a.data(), a.size(), 6, ra), "add A") ||
      !check(engine.add_request(1, b.data(), b.size(), 6, rb), "add B"))
    return 1;
  std::printf("requests: A (%zu prompt tokens), B (%zu prompt tokens), 6 new tokens each\n",
              a.size(), b.size());
  auto name = [&](kvpage_request r) { return r == ra ? "A" : r == rb ? "B" : "C"; };

  std::vector<kvpage_step_seq> seqs(8);
  std::vector<kvpage_sampled> samples;
  std::vector<kvpage_finished> finished(8);
  std::vector<std::vector<uint32_t>> history(8);  // tokens of each scheduled sequence
  std::vector<float> k, v, q, out;
  uint32_t done = 0;
  for (uint32_t step_no = 1; done < 3 && step_no <= 40; step_no++) {
    kvpage_step step;
    std::size_t n = 0;
    if (!check(engine.step(step), "step") ||
        !check(engine.step_seqs(seqs.data(), seqs.size(), n), "step_seqs"))
      return 1;
    // Each sequence's tokens so far (its prompt and the tokens sampled for it).
    for (std::size_t i = 0; i < n; i++) {
      history[i].resize(kMaxLen);
      std::size_t len = 0;
      if (!check(engine.request_tokens(seqs[i].request, history[i].data(), kMaxLen, len),
                 "request_tokens"))
        return 1;
      history[i].resize(len);
    }
    const std::size_t t = step.num_tokens;
    k.assign(t * kKvHeads * kHeadDim, 0.0f);
    v.assign(k.size(), 0.0f);
    q.assign(t * kQHeads * kHeadDim, 0.0f);
    out.assign(q.size(), 0.0f);
    double worst = 0.0;
    for (uint32_t layer = 0; layer < kLayers; layer++) {
      for (std::size_t i = 0; i < n; i++)
        for (uint32_t j = 0; j < seqs[i].tokens; j++) {
          std::size_t row = seqs[i].offset + j;
          uint32_t pos = seqs[i].first_pos + j, tok = step.input_tokens[row];
          for (uint32_t h = 0; h < kKvHeads; h++)
            for (uint32_t d = 0; d < kHeadDim; d++) {
              k[(row * kKvHeads + h) * kHeadDim + d] = model(tok, pos, layer, 0, h, d);
              v[(row * kKvHeads + h) * kHeadDim + d] = model(tok, pos, layer, 1, h, d);
            }
          for (uint32_t h = 0; h < kQHeads; h++)
            for (uint32_t d = 0; d < kHeadDim; d++)
              q[(row * kQHeads + h) * kHeadDim + d] = model(tok, pos, layer, 2, h, d);
        }
      if (!check(engine.write_kv(layer, k.data(), k.size(), v.data(), v.size()), "write_kv") ||
          !check(engine.attention(layer, q.data(), q.size(), out.data(), out.size(), kQHeads,
                                  kScale),
                 "attention"))
        return 1;
      for (std::size_t i = 0; i < n; i++)
        for (uint32_t j = 0; j < seqs[i].tokens; j++) {
          std::size_t at = (seqs[i].offset + j) * kQHeads * kHeadDim;
          double e = reference_error(history[i], layer, seqs[i].first_pos + j, &q[at], &out[at]);
          worst = e > worst ? e : worst;
        }
    }
    std::printf("step %2u:", step_no);
    samples.clear();
    for (std::size_t i = 0; i < n; i++) {
      std::printf(" %s[%u..%u)", name(seqs[i].request), seqs[i].first_pos,
                  seqs[i].first_pos + seqs[i].tokens);
      if (seqs[i].emits) {
        uint32_t last = step.input_tokens[seqs[i].offset + seqs[i].tokens - 1];
        uint32_t next = (last * 31u + (seqs[i].first_pos + seqs[i].tokens) * 7u + 3u) % 1000u;
        samples.push_back({seqs[i].request, next, 0});
      }
    }
    std::printf("  copies %zu, attention matches the reference: %s\n", step.num_copies,
                worst < kTolerance ? "yes" : "NO");
    std::size_t n_finished = 0;
    if (!check(engine.commit_step(samples.data(), samples.size(), finished.data(),
                                  finished.size(), n_finished),
               "commit_step"))
      return 1;
    for (std::size_t i = 0; i < n_finished; i++, done++) {
      std::printf("  %s finished (%s) after %u new tokens\n", name(finished[i].request),
                  reason_name(finished[i].reason), finished[i].generated);
    }
    // Once A has its first answer token, fork a second answer with another token.
    if (rc == KVPAGE_REQUEST_NONE && !samples.empty() && samples[0].request == ra) {
      if (!check(engine.fork(ra, 777, rc), "fork")) return 1;
      std::printf("  C forked from A, its last token replaced by 777\n");
    }
  }
  kvpage_engine_counters es;
  kvpage_stats cs;
  if (!check(engine.stats(es, cs), "stats")) return 1;
  std::printf("engine: %llu steps, %llu admitted, %llu finished, %llu preempted\n",
              static_cast<unsigned long long>(es.steps), static_cast<unsigned long long>(es.admitted),
              static_cast<unsigned long long>(es.finished),
              static_cast<unsigned long long>(es.recomputes + es.swap_outs));
  std::printf("cache: %u used, %u cached, %u free blocks; prefix-cache hits %llu tokens\n",
              cs.used_blocks, cs.cached_blocks, cs.free_blocks,
              static_cast<unsigned long long>(cs.prefix_hit_tokens));
  return done == 3 ? 0 : 1;
}
