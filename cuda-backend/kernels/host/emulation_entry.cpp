// The kernels of kvpage.cu compiled as host C++ against the emulation (compat.cuh ->
// emulation.hpp), exposed to Rust (cuda-backend/src/emulation.rs) through a C ABI: one
// launch entry by kernel id, the index and conversion functions the tests check
// directly, and the struct layouts for the ABI test.
#include "../kvpage.cu"

#include <cstddef>

namespace {

template <class P> int run(void (*kernel)(P), dim3 grid, dim3 block, std::size_t shared, const void *params) {
    return kvp_emu::launch(kernel, grid, block, shared, *static_cast<const P *>(params));
}

} // namespace

extern "C" {

#if defined(__SANITIZE_ADDRESS__)
// Under AddressSanitizer (build.rs instruments this library when the Rust build is): no
// fake stacks for stack-use-after-return. The emulator starts a fiber per CUDA thread of
// every CTA, and each fiber's fake stack is mapped and unmapped anew (4x slower, most of
// it in the kernel); every other check stays on. ASAN_OPTIONS still overrides it.
const char *__asan_default_options(void) { return "detect_stack_use_after_return=0"; }
#endif

// Runs kernel `id` (KVP_KERNEL_*) with `params` pointing at its params struct; returns
// 0, the emulation's error code, or -1 for an unknown id.
int kvpage_emu_launch(uint32_t id, uint32_t gx, uint32_t gy, uint32_t gz, uint32_t bx, uint32_t by,
                      uint32_t bz, uint32_t shared_bytes, const void *params) {
    const dim3 grid(gx, gy, gz), block(bx, by, bz);
    switch (id) {
    case KVP_KERNEL_WRITE_KV: return run(kvp_write_kv, grid, block, shared_bytes, params);
    case KVP_KERNEL_COPY_BLOCKS: return run(kvp_copy_blocks, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_REDUCE: return run(kvp_attention_reduce, grid, block, shared_bytes, params);
    case KVP_KERNEL_WRITE_KV_STORED: return run(kvp_write_kv_stored, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_F32_HD64_R4: return run(kvp_attention_f32_hd64_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_F32_HD64_R8: return run(kvp_attention_f32_hd64_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_F32_HD128_R4: return run(kvp_attention_f32_hd128_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_F32_HD128_R8: return run(kvp_attention_f32_hd128_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_F32_HD256_R4: return run(kvp_attention_f32_hd256_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_F32_HD256_R8: return run(kvp_attention_f32_hd256_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_F16_HD64_R4: return run(kvp_attention_f16_hd64_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_F16_HD64_R8: return run(kvp_attention_f16_hd64_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_F16_HD128_R4: return run(kvp_attention_f16_hd128_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_F16_HD128_R8: return run(kvp_attention_f16_hd128_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_F16_HD256_R4: return run(kvp_attention_f16_hd256_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_F16_HD256_R8: return run(kvp_attention_f16_hd256_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_BF16_HD64_R4: return run(kvp_attention_bf16_hd64_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_BF16_HD64_R8: return run(kvp_attention_bf16_hd64_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_BF16_HD128_R4: return run(kvp_attention_bf16_hd128_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_BF16_HD128_R8: return run(kvp_attention_bf16_hd128_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_BF16_HD256_R4: return run(kvp_attention_bf16_hd256_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_BF16_HD256_R8: return run(kvp_attention_bf16_hd256_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_INT8_HD64_R4: return run(kvp_attention_int8_hd64_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_INT8_HD64_R8: return run(kvp_attention_int8_hd64_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_INT8_HD128_R4: return run(kvp_attention_int8_hd128_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_INT8_HD128_R8: return run(kvp_attention_int8_hd128_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_INT8_HD256_R4: return run(kvp_attention_int8_hd256_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_INT8_HD256_R8: return run(kvp_attention_int8_hd256_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_FP8_HD64_R4: return run(kvp_attention_fp8_hd64_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_FP8_HD64_R8: return run(kvp_attention_fp8_hd64_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_FP8_HD128_R4: return run(kvp_attention_fp8_hd128_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_FP8_HD128_R8: return run(kvp_attention_fp8_hd128_r8, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_FP8_HD256_R4: return run(kvp_attention_fp8_hd256_r4, grid, block, shared_bytes, params);
    case KVP_KERNEL_ATTENTION_FP8_HD256_R8: return run(kvp_attention_fp8_hd256_r8, grid, block, shared_bytes, params);
    default: return -1;
    }
}

// Message of the last failed launch on this thread ("" after a good one).
const char *kvpage_emu_last_error(void) { return kvp_emu::last_error(); }

// Seed of the CTA and thread order on this thread (0: index order).
void kvpage_emu_set_seed(uint64_t seed) { kvp_emu::set_seed(seed); }

uint64_t kvpage_emu_tile_offset(const KvpGeometry *g, uint32_t layer, uint32_t kv, uint32_t head) {
    return kvp::tile_offset(*g, layer, kv, head);
}
uint64_t kvpage_emu_block_offset(const KvpGeometry *g, uint32_t block) { return kvp::block_offset(*g, block); }
uint64_t kvpage_emu_row_offset(const KvpGeometry *g, uint32_t block, uint32_t layer, uint32_t kv, uint32_t head,
                               uint32_t row) {
    return kvp::row_offset(*g, block, layer, kv, head, row);
}
uint64_t kvpage_emu_scale_offset(const KvpGeometry *g, uint32_t block, uint32_t layer, uint32_t kv, uint32_t head,
                                 uint32_t row) {
    return kvp::scale_offset(*g, block, layer, kv, head, row);
}
uint32_t kvpage_emu_slot_block(uint32_t slot, uint32_t block_size) { return kvp::slot_block(slot, block_size); }
uint32_t kvpage_emu_slot_offset(uint32_t slot, uint32_t block_size) { return kvp::slot_offset(slot, block_size); }
uint64_t kvpage_emu_scratch_stat(uint32_t q_row, uint32_t q_head, uint32_t part, uint32_t q_heads, uint32_t parts) {
    return kvp::scratch_stat(q_row, q_head, part, q_heads, parts);
}
uint64_t kvpage_emu_query_offset(uint32_t q_row, uint32_t q_head, uint32_t q_heads, uint32_t head_dim) {
    return kvp::query_offset(q_row, q_head, q_heads, head_dim);
}

uint16_t kvpage_emu_f32_to_f16(float x) { return kvp::f32_to_f16(x); }
float kvpage_emu_f16_to_f32(uint16_t h) { return kvp::f16_to_f32(h); }
uint16_t kvpage_emu_f32_to_bf16(float x) { return kvp::f32_to_bf16(x); }
uint8_t kvpage_emu_encode8(uint32_t dtype, float x, float scale) { return kvp::encode8(dtype, x, scale); }
float kvpage_emu_scale_for(uint32_t dtype, float absmax) { return kvp::scale_for(dtype, absmax); }
float kvpage_emu_decode8(uint32_t dtype, uint8_t code) {
    return dtype == KVP_DTYPE_INT8 ? kvp::int8_decode(code) : kvp::fp8_decode(code);
}

// Sizes and field offsets of the ABI structs, in the order of params.rs's test; returns
// the count written (at most cap).
uint32_t kvpage_emu_abi(uint64_t *out, uint32_t cap) {
#define KVP_OFF(S, f) (uint64_t) offsetof(S, f)
    const uint64_t v[] = {
        sizeof(KvpGeometry), KVP_OFF(KvpGeometry, tile_elems), KVP_OFF(KvpGeometry, layers),
        KVP_OFF(KvpGeometry, kv_heads), KVP_OFF(KvpGeometry, head_dim), KVP_OFF(KvpGeometry, block_size),
        KVP_OFF(KvpGeometry, num_blocks), KVP_OFF(KvpGeometry, dtype),
        sizeof(KvpWriteParams), KVP_OFF(KvpWriteParams, arena), KVP_OFF(KvpWriteParams, k),
        KVP_OFF(KvpWriteParams, v), KVP_OFF(KvpWriteParams, slots), KVP_OFF(KvpWriteParams, tokens),
        KVP_OFF(KvpWriteParams, layer),
        sizeof(KvpCopyParams), KVP_OFF(KvpCopyParams, pairs), KVP_OFF(KvpCopyParams, bytes_per_block),
        KVP_OFF(KvpCopyParams, num_pairs),
        sizeof(KvpSeqDesc), KVP_OFF(KvpSeqDesc, context_len), KVP_OFF(KvpSeqDesc, queries),
        KVP_OFF(KvpSeqDesc, q_start),
        sizeof(KvpAttentionParams), KVP_OFF(KvpAttentionParams, arena), KVP_OFF(KvpAttentionParams, q),
        KVP_OFF(KvpAttentionParams, out), KVP_OFF(KvpAttentionParams, block_table),
        KVP_OFF(KvpAttentionParams, seqs), KVP_OFF(KvpAttentionParams, scratch),
        KVP_OFF(KvpAttentionParams, table_stride), KVP_OFF(KvpAttentionParams, num_seqs),
        KVP_OFF(KvpAttentionParams, layer), KVP_OFF(KvpAttentionParams, q_heads),
        KVP_OFF(KvpAttentionParams, scale), KVP_OFF(KvpAttentionParams, partition_tokens),
        KVP_OFF(KvpAttentionParams, num_partitions), KVP_OFF(KvpAttentionParams, row_tiles),
        KVP_OFF(KvpAttentionParams, scratch_rows),
    };
#undef KVP_OFF
    const uint32_t n = (uint32_t)(sizeof(v) / sizeof(v[0]));
    for (uint32_t i = 0; i < n && i < cap; ++i) out[i] = v[i];
    return n;
}

} // extern "C"
