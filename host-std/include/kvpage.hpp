// kvpage.hpp: header-only C++17 RAII wrappers over kvpage's C API (kvpage.h).
//
// No exceptions are thrown and none are required: every operation returns a
// kvpage::Status (the C result code plus the error details), and objects are created
// by a static `create` that reports a Status too. Owners are move-only and free their
// C object in the destructor. `get()` gives the C pointer for any function not wrapped.
//
//   kvpage::Engine engine;
//   kvpage::Status s = kvpage::Engine::create(params, engine);
//   if (!s) { std::fprintf(stderr, "%s\n", s.message()); return 1; }
//
// Thread safety is the C API's: calls on one object must not overlap.
#ifndef KVPAGE_HPP
#define KVPAGE_HPP

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <utility>

#include "kvpage.h"

namespace kvpage {

/// The outcome of a call: `ok()`, or a failure code with its details (numbers and a
/// message). Testing it in a condition means "succeeded".
class Status {
 public:
  Status() noexcept : error_() { error_.code = KVPAGE_OK; }

  bool ok() const noexcept { return error_.code == KVPAGE_OK; }
  explicit operator bool() const noexcept { return ok(); }
  kvpage_result code() const noexcept { return error_.code; }
  /// The details of a failure (`needed`, `available`, `value`, `message`).
  const kvpage_error &error() const noexcept { return error_; }
  /// A message with the numbers, or "ok".
  const char *message() const noexcept { return ok() ? "ok" : error_.message; }

  /// Runs `call(kvpage_error *)` and captures its result.
  template <class Call>
  static Status of(Call &&call) noexcept {
    Status s;
    kvpage_result r = call(&s.error_);
    if (r == KVPAGE_OK) {
      s.error_.code = KVPAGE_OK;
      s.error_.message[0] = '\0';
    } else if (s.error_.code != r) {  // a function that could not fill it in
      s.error_.code = r;
      s.error_.needed = s.error_.available = s.error_.value = 0;
      s.error_.message[0] = '\0';
    }
    return s;
  }

 private:
  kvpage_error error_;
};

namespace detail {

/// A move-only owner of a C object freed by `Free`.
template <class T, void (*Free)(T *)>
class Owner {
 public:
  Owner() noexcept = default;
  explicit Owner(T *p) noexcept : p_(p) {}
  Owner(Owner &&o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  Owner &operator=(Owner &&o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  Owner(const Owner &) = delete;
  Owner &operator=(const Owner &) = delete;
  ~Owner() { reset(); }

  T *get() const noexcept { return p_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }
  void reset() noexcept {
    if (p_) Free(std::exchange(p_, nullptr));
  }

 private:
  T *p_ = nullptr;
};

inline void free_cache(kvpage_cache *c) { kvpage_cache_free(c, nullptr); }
inline void free_engine(kvpage_engine *e) { kvpage_engine_free(e, nullptr); }
inline void free_storage(void *p) { std::free(p); }

/// Caller storage for tier 2 and 3 objects: `bytes` aligned to `align`, or null.
inline void *aligned_storage(std::size_t bytes, std::size_t align) {
  std::size_t rounded = (bytes + align - 1) / align * align;
  return std::aligned_alloc(align, rounded);
}

}  // namespace detail

/// Tier 1: the owned cache (kvpage runs attention). See `kvpage_cache_*`.
class Cache {
 public:
  static Status create(const kvpage_cache_params &params, Cache &out) noexcept {
    kvpage_cache *c = nullptr;
    Status s = Status::of([&](kvpage_error *e) { return kvpage_cache_new(&params, &c, e); });
    if (s) out.c_ = Handle(c);
    return s;
  }

  kvpage_cache *get() const noexcept { return c_.get(); }

  Status create_seq(uint64_t ns, const uint32_t *prompt, std::size_t n, kvpage_seq &seq,
                    uint32_t &reused) noexcept {
    return call(kvpage_cache_create_with_prompt, ns, prompt, n, &seq, &reused);
  }
  Status append_tokens(kvpage_seq seq, const uint32_t *tokens, std::size_t n) noexcept {
    return call(kvpage_cache_append_tokens, seq, tokens, n);
  }
  Status write_kv(kvpage_seq seq, uint32_t layer, uint32_t first, uint32_t n, const float *k,
                  std::size_t k_len, const float *v, std::size_t v_len) noexcept {
    return call(kvpage_cache_write_kv, seq, layer, first, n, k, k_len, v, v_len);
  }
  Status decode(uint32_t layer, const kvpage_seq *seqs, std::size_t n, const float *q,
                std::size_t q_len, float *out, std::size_t out_len, uint32_t q_heads,
                float scale) noexcept {
    return call(kvpage_cache_decode, layer, seqs, n, q, q_len, out, out_len, q_heads, scale);
  }
  Status commit(kvpage_seq seq) noexcept {
    return call(kvpage_cache_commit, seq, static_cast<uint32_t *>(nullptr));
  }
  Status fork(kvpage_seq seq, kvpage_seq &child) noexcept {
    return call(kvpage_cache_fork, seq, &child);
  }
  Status release(kvpage_seq seq) noexcept { return call(kvpage_cache_release, seq); }
  /// Fixes layer `layer`'s 8-bit K/V scales for the rows written from now on
  /// (`kvpage_cache_set_kv_scales`); `clear_kv_scales` goes back to a scale per row.
  Status set_kv_scales(uint32_t layer, float k_scale, float v_scale) noexcept {
    return call(kvpage_cache_set_kv_scales, layer, k_scale, v_scale);
  }
  Status clear_kv_scales(uint32_t layer) noexcept {
    return call(kvpage_cache_clear_kv_scales, layer);
  }
  /// Layer `layer`'s fixed scales, 0 and 0 for a scale per row (`kvpage_cache_kv_scales`).
  Status kv_scales(uint32_t layer, float &k_scale, float &v_scale) const noexcept {
    return Status::of([&](kvpage_error *e) {
      return kvpage_cache_kv_scales(c_.get(), layer, &k_scale, &v_scale, e);
    });
  }
  Status stats(kvpage_stats &out) const noexcept {
    return Status::of([&](kvpage_error *e) { return kvpage_cache_stats(c_.get(), &out, e); });
  }
  /// Bytes of the blob of `seq` (with its ids when `with_tokens`).
  Status seq_save_size(kvpage_seq seq, bool with_tokens, std::size_t &size) const noexcept {
    return Status::of([&](kvpage_error *e) {
      return kvpage_cache_seq_save_size(c_.get(), seq, with_tokens ? 1u : 0u, &size, e);
    });
  }
  /// Saves `seq` (ids: `tokens`, or null for none) into `out`; `written` bytes.
  Status seq_save(kvpage_seq seq, const uint32_t *tokens, std::size_t n_tokens,
                  const kvpage_fingerprint &model, uint8_t *out, std::size_t out_len,
                  std::size_t &written) const noexcept {
    return Status::of([&](kvpage_error *e) {
      return kvpage_cache_seq_save(c_.get(), seq, tokens, n_tokens, &model, out, out_len,
                                   &written, e);
    });
  }
  /// Saves `seq` into the file at `path`, crash-consistently.
  Status seq_save_file(kvpage_seq seq, const uint32_t *tokens, std::size_t n_tokens,
                       const kvpage_fingerprint &model, const char *path) const noexcept {
    return Status::of([&](kvpage_error *e) {
      return kvpage_cache_seq_save_file(c_.get(), seq, tokens, n_tokens, &model, path, e);
    });
  }
  /// Restores a blob as a new sequence of `ns`; its ids into `tokens[..n_tokens]`.
  Status seq_restore(const uint8_t *blob, std::size_t len, uint64_t ns,
                     const kvpage_fingerprint &model, kvpage_seq &seq, uint32_t *tokens,
                     std::size_t tokens_len, std::size_t &n_tokens) noexcept {
    return call(kvpage_cache_seq_restore, blob, len, ns, &model, &seq,
                static_cast<uint32_t *>(nullptr), tokens, tokens_len, &n_tokens);
  }
  /// Restores the blob in the file at `path`, as `seq_restore`.
  Status seq_restore_file(const char *path, uint64_t ns, const kvpage_fingerprint &model,
                          kvpage_seq &seq, uint32_t *tokens, std::size_t tokens_len,
                          std::size_t &n_tokens) noexcept {
    return call(kvpage_cache_seq_restore_file, path, ns, &model, &seq,
                static_cast<uint32_t *>(nullptr), tokens, tokens_len, &n_tokens);
  }
  /// Bytes of the prefix-cache file `prefix_save` writes now.
  Status prefix_save_size(uint64_t &size) const noexcept {
    return Status::of([&](kvpage_error *e) { return kvpage_cache_prefix_save_size(c_.get(), &size, e); });
  }
  /// Saves every reachable prefix-cache block into `out`: `written` bytes, `blocks` blocks.
  Status prefix_save(const kvpage_fingerprint &model, uint8_t *out, std::size_t out_len,
                     std::size_t &written, uint32_t &blocks) const noexcept {
    return Status::of([&](kvpage_error *e) {
      return kvpage_cache_prefix_save(c_.get(), &model, out, out_len, &written, &blocks, e);
    });
  }
  /// Saves the prefix cache into the file at `path`, crash-consistently.
  Status prefix_save_file(const kvpage_fingerprint &model, const char *path,
                          uint32_t &blocks) const noexcept {
    return Status::of([&](kvpage_error *e) {
      return kvpage_cache_prefix_save_file(c_.get(), &model, path, &blocks, e);
    });
  }
  /// Loads a saved prefix cache (damaged blocks are skipped and counted in `report`).
  Status prefix_load(const uint8_t *bytes, std::size_t len, const kvpage_fingerprint &model,
                     kvpage_prefix_load_report &report) noexcept {
    return call(kvpage_cache_prefix_load, bytes, len, &model, &report);
  }
  /// Loads the prefix-cache file at `path`, as `prefix_load`.
  Status prefix_load_file(const char *path, const kvpage_fingerprint &model,
                          kvpage_prefix_load_report &report) noexcept {
    return call(kvpage_cache_prefix_load_file, path, &model, &report);
  }
  /// A sequence holding `prompt` at retention `priority` (a `KVPAGE_PRIORITY_*` level).
  Status create_seq_at(uint64_t ns, uint32_t priority, const uint32_t *prompt, std::size_t n,
                       kvpage_seq &seq, uint32_t &reused) noexcept {
    return call(kvpage_cache_create_with_prompt_at, ns, priority, prompt, n, &seq, &reused);
  }
  Status set_priority(kvpage_seq seq, uint32_t priority) noexcept {
    return call(kvpage_cache_set_priority, seq, priority);
  }
  Status set_namespace_quota(uint64_t ns, uint32_t max_blocks, uint32_t reserved) noexcept {
    return call(kvpage_cache_set_namespace_quota, ns, max_blocks, reserved);
  }
  /// Drains KV cache events into `events` (token ids of stored blocks into `tokens`).
  Status events_drain(kvpage_kv_event *events, std::size_t events_len, uint32_t *tokens,
                      std::size_t tokens_len, kvpage_events_report &report) noexcept {
    return call(kvpage_cache_events_drain, events, events_len, tokens, tokens_len, &report);
  }

 private:
  using Handle = detail::Owner<kvpage_cache, detail::free_cache>;
  template <class F, class... A>
  Status call(F f, A... a) noexcept {
    return Status::of([&](kvpage_error *e) { return f(c_.get(), a..., e); });
  }
  Handle c_;
};

/// Tier 1: the engine step over an owned cache. See `kvpage_engine_*`.
class Engine {
 public:
  static Status create(const kvpage_engine_params &params, Engine &out) noexcept {
    kvpage_engine *p = nullptr;
    Status s = Status::of([&](kvpage_error *e) { return kvpage_engine_new(&params, &p, e); });
    if (s) out.e_ = Handle(p);
    return s;
  }

  kvpage_engine *get() const noexcept { return e_.get(); }

  Status add_request(uint64_t ns, const uint32_t *prompt, std::size_t n, uint32_t max_new_tokens,
                     kvpage_request &out) noexcept {
    return call(kvpage_engine_add_request, ns, prompt, n, max_new_tokens, &out);
  }
  Status step(kvpage_step &out) noexcept { return call(kvpage_engine_step, &out); }
  Status step_seqs(kvpage_step_seq *out, std::size_t len, std::size_t &n) const noexcept {
    return Status::of(
        [&](kvpage_error *e) { return kvpage_engine_step_seqs(e_.get(), out, len, &n, e); });
  }
  Status write_kv(uint32_t layer, const float *k, std::size_t k_len, const float *v,
                  std::size_t v_len) noexcept {
    return call(kvpage_engine_write_kv, layer, k, k_len, v, v_len);
  }
  /// `Cache::set_kv_scales` for the engine's cache (`kvpage_engine_set_kv_scales`).
  Status set_kv_scales(uint32_t layer, float k_scale, float v_scale) noexcept {
    return call(kvpage_engine_set_kv_scales, layer, k_scale, v_scale);
  }
  /// `Cache::clear_kv_scales` for the engine's cache (`kvpage_engine_clear_kv_scales`).
  Status clear_kv_scales(uint32_t layer) noexcept {
    return call(kvpage_engine_clear_kv_scales, layer);
  }
  /// `Cache::kv_scales` for the engine's cache (`kvpage_engine_kv_scales`).
  Status kv_scales(uint32_t layer, float &k_scale, float &v_scale) const noexcept {
    return Status::of([&](kvpage_error *e) {
      return kvpage_engine_kv_scales(e_.get(), layer, &k_scale, &v_scale, e);
    });
  }
  Status attention(uint32_t layer, const float *q, std::size_t q_len, float *out,
                   std::size_t out_len, uint32_t q_heads, float scale) noexcept {
    return call(kvpage_engine_attention, layer, q, q_len, out, out_len, q_heads, scale);
  }
  Status commit_step(const kvpage_sampled *sampled, std::size_t n, kvpage_finished *finished,
                     std::size_t len, std::size_t &n_finished) noexcept {
    return call(kvpage_engine_commit_step, sampled, n, finished, len, &n_finished);
  }
  Status fork(kvpage_request request, kvpage_request &out) noexcept {
    return call(kvpage_engine_fork, request, 0u, 0u, &out);
  }
  Status fork(kvpage_request request, uint32_t last_token, kvpage_request &out) noexcept {
    return call(kvpage_engine_fork, request, 1u, last_token, &out);
  }
  Status cancel(kvpage_request request) noexcept { return call(kvpage_engine_cancel, request); }
  Status request_tokens(kvpage_request request, uint32_t *out, std::size_t len,
                        std::size_t &n) const noexcept {
    return Status::of([&](kvpage_error *e) {
      return kvpage_engine_request_tokens(e_.get(), request, out, len, &n, e);
    });
  }
  Status stats(kvpage_engine_counters &engine, kvpage_stats &cache) const noexcept {
    return Status::of(
        [&](kvpage_error *e) { return kvpage_engine_stats(e_.get(), &engine, &cache, e); });
  }

 private:
  using Handle = detail::Owner<kvpage_engine, detail::free_engine>;
  template <class F, class... A>
  Status call(F f, A... a) noexcept {
    return Status::of([&](kvpage_error *e) { return f(e_.get(), a..., e); });
  }
  Handle e_;
};

/// Tier 2: the block manager in storage this object allocates once (aligned), for an
/// engine that owns its K/V and kernels. See `kvpage_manager_*`; call them on `get()`.
class Manager {
 public:
  static Status create(const kvpage_manager_config &config, Manager &out) noexcept {
    std::size_t bytes = 0;
    Status s = Status::of(
        [&](kvpage_error *e) { return kvpage_manager_storage_size(&config, &bytes, e); });
    if (!s) return s;
    Storage storage(detail::aligned_storage(bytes, kvpage_manager_storage_align()));
    if (!storage) return out_of_memory(bytes);
    kvpage_manager *m = nullptr;
    s = Status::of([&](kvpage_error *e) {
      return kvpage_manager_init(&config, storage.get(), bytes, &m, e);
    });
    if (s) {
      out.storage_ = std::move(storage);
      out.m_ = m;
    }
    return s;
  }

  kvpage_manager *get() const noexcept { return m_; }

 private:
  using Storage = detail::Owner<void, detail::free_storage>;
  static Status out_of_memory(std::size_t bytes) noexcept {
    return Status::of([&](kvpage_error *e) {
      e->code = KVPAGE_ERR_OUT_OF_MEMORY;
      e->needed = bytes;
      e->available = e->value = 0;
      e->message[0] = '\0';
      return e->code;
    });
  }
  friend class Scheduler;
  Storage storage_;
  kvpage_manager *m_ = nullptr;
};

/// Tier 3: the engine step over a `Manager`, in storage this object allocates once.
/// See `kvpage_scheduler_*`; call them on `get()` with the manager's `get()`.
class Scheduler {
 public:
  static Status create(const Manager &manager, const kvpage_manager_config &manager_config,
                       const kvpage_scheduler_config &config, Scheduler &out) noexcept {
    std::size_t bytes = 0;
    Status s = Status::of([&](kvpage_error *e) {
      return kvpage_scheduler_storage_size(&manager_config, &config, &bytes, e);
    });
    if (!s) return s;
    Manager::Storage storage(detail::aligned_storage(bytes, kvpage_scheduler_storage_align()));
    if (!storage) return Manager::out_of_memory(bytes);
    kvpage_scheduler *p = nullptr;
    s = Status::of([&](kvpage_error *e) {
      return kvpage_scheduler_init(manager.get(), &config, storage.get(), bytes, &p, e);
    });
    if (s) {
      out.storage_ = std::move(storage);
      out.s_ = p;
    }
    return s;
  }

  kvpage_scheduler *get() const noexcept { return s_; }

 private:
  Manager::Storage storage_;
  kvpage_scheduler *s_ = nullptr;
};

}  // namespace kvpage

#endif  // KVPAGE_HPP
