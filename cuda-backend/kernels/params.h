/* kvpage CUDA kernel ABI: the parameter structs every kernel takes BY VALUE as its only
 * argument, shared by nvcc (device code), the host C++ emulation and the Rust mirror
 * (`cuda-backend/src/params.rs`, `#[repr(C)]`, pointers as u64; a test compares sizes and
 * offsets through the emulation library).
 *
 * Rules: only stdint types and plain pointers; every struct is naturally aligned with
 * explicit padding fields, so C, C++ and Rust agree on the layout without packing.
 *
 * Launch contracts (the Rust planner `cuda-backend/src/launch.rs` computes them; a
 * kernel relies on them and checks nothing else):
 *
 * kvp_write_kv(KvpWriteParams)
 *   grid  (tokens, ceil(2 * kv_heads / KVP_WRITE_WARPS), 1)
 *   block (32 * KVP_WRITE_WARPS, 1, 1), no dynamic shared memory.
 *   One warp per (token, kv head, K|V) row: slot -> (block, offset), f32 -> storage dtype
 *   (RNE for f16/bf16; 8-bit: per-row scale = absmax / code max, or the fixed k_scale /
 *   v_scale where nonzero (codes saturate), stored little-endian after the tile's codes). Slots must be < num_blocks * block_size and distinct (with a
 *   duplicate slot it is unspecified which token ends up there).
 *
 * kvp_write_kv_stored(KvpWriteParams)
 *   As kvp_write_kv, with k and v in the storage dtype (f32, f16, bf16; not the 8-bit
 *   ones, whose codes carry no scale): elements copied as they are.
 *
 * kvp_copy_blocks(KvpCopyParams)
 *   grid  (num_pairs, chunks, 1) with chunks <= 65535, any chunks >= 1 (grid-stride),
 *   block (KVP_COPY_THREADS, 1, 1), no dynamic shared memory.
 *   Copies block pairs[2i] onto block pairs[2i+1], 16-byte vectors when bytes_per_block
 *   is a multiple of 16. All pairs run concurrently: sources != destinations, and no
 *   destination appears twice or as a source (checked by the planner).
 *
 * kvp_attention_<dtype>_hd<64|128|256>_r<4|8>(KvpAttentionParams)
 *   dtype f32 | f16 | bf16 | int8 | fp8 (8-bit: block_size even, so rows are 8-aligned)
 *   grid  (kv_heads * row_tiles, num_partitions, num_seqs), num_partitions and num_seqs
 *   <= 65535; block (KVP_ATT_THREADS, 1, 1); static shared memory only (see
 *   attention.cuh: rows * (head_dim + chunk) floats and the chunk's token locations,
 *   <= 11 KiB).
 *   One CTA per (sequence, KV head, tile of R = 4 or 8 query rows, context partition);
 *   row_tiles = max over sequences of ceil(queries * group / R).
 *   Rows of a sequence are (query token, query head of the GQA group) pairs, row r =
 *   token r / group, head kv_head * group + r % group: all heads of a group share each
 *   K/V load. Partition p covers tokens [p * partition_tokens, (p + 1) *
 *   partition_tokens) of the context. num_partitions == 1: writes `out` directly;
 *   otherwise writes (max, sum, unnormalised output) per (row, partition) into `scratch`
 *   and kvp_attention_reduce must run next.
 *
 * kvp_attention_reduce(KvpAttentionParams)
 *   grid (num_seqs, max_queries, q_heads), block (KVP_REDUCE_THREADS, 1, 1), no shared.
 *
 * Scratch (floats, num_partitions > 1): with R = scratch_rows (sum of queries) and
 * NP = num_partitions, stat index i = ((q_row * q_heads) + q_head) * NP + partition:
 *   max at scratch[i], sum at scratch[R*q_heads*NP + i], output at
 *   scratch[2*R*q_heads*NP + i*head_dim + d].
 */
#ifndef KVPAGE_PARAMS_H
#define KVPAGE_PARAMS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Storage dtype codes: kvpage_core::DType in declaration order. */
enum {
    KVP_DTYPE_F32 = 0,
    KVP_DTYPE_F16 = 1,
    KVP_DTYPE_BF16 = 2,
    KVP_DTYPE_INT8 = 3,
    KVP_DTYPE_FP8_E4M3 = 4
};

/* Launch constants the planner mirrors. */
enum {
    KVP_WRITE_WARPS = 4,
    KVP_COPY_THREADS = 256,
    KVP_COPY_UNROLL = 4,
    KVP_ATT_THREADS = 128,
    KVP_ATT_ROWS = 8,  /* most query rows per CTA (instances of 4 and 8 rows) */
    KVP_ATT_UNROLL = 2, /* tokens per thread group whose loads are in flight together */
    KVP_ATT_CHUNK = 64,
    KVP_REDUCE_THREADS = 128
};

/* Kernel ids of the emulation entry (kvpage_emu_launch); stable numbers. Attention:
 * KVP_KERNEL_ATTENTION_F32_HD64_R4 + 6 * dtype + 2 * (0 | 1 | 2 for head dim 64 | 128 |
 * 256) + (0 | 1 for 4 | 8 rows per CTA). */
enum {
    KVP_KERNEL_WRITE_KV = 0,
    KVP_KERNEL_COPY_BLOCKS = 1,
    KVP_KERNEL_ATTENTION_REDUCE = 2,
    KVP_KERNEL_WRITE_KV_STORED = 3,
    KVP_KERNEL_ATTENTION_F32_HD64_R4 = 16,
    KVP_KERNEL_ATTENTION_F32_HD64_R8 = 17,
    KVP_KERNEL_ATTENTION_F32_HD128_R4 = 18,
    KVP_KERNEL_ATTENTION_F32_HD128_R8 = 19,
    KVP_KERNEL_ATTENTION_F32_HD256_R4 = 20,
    KVP_KERNEL_ATTENTION_F32_HD256_R8 = 21,
    KVP_KERNEL_ATTENTION_F16_HD64_R4 = 22,
    KVP_KERNEL_ATTENTION_F16_HD64_R8 = 23,
    KVP_KERNEL_ATTENTION_F16_HD128_R4 = 24,
    KVP_KERNEL_ATTENTION_F16_HD128_R8 = 25,
    KVP_KERNEL_ATTENTION_F16_HD256_R4 = 26,
    KVP_KERNEL_ATTENTION_F16_HD256_R8 = 27,
    KVP_KERNEL_ATTENTION_BF16_HD64_R4 = 28,
    KVP_KERNEL_ATTENTION_BF16_HD64_R8 = 29,
    KVP_KERNEL_ATTENTION_BF16_HD128_R4 = 30,
    KVP_KERNEL_ATTENTION_BF16_HD128_R8 = 31,
    KVP_KERNEL_ATTENTION_BF16_HD256_R4 = 32,
    KVP_KERNEL_ATTENTION_BF16_HD256_R8 = 33,
    KVP_KERNEL_ATTENTION_INT8_HD64_R4 = 34,
    KVP_KERNEL_ATTENTION_INT8_HD64_R8 = 35,
    KVP_KERNEL_ATTENTION_INT8_HD128_R4 = 36,
    KVP_KERNEL_ATTENTION_INT8_HD128_R8 = 37,
    KVP_KERNEL_ATTENTION_INT8_HD256_R4 = 38,
    KVP_KERNEL_ATTENTION_INT8_HD256_R8 = 39,
    KVP_KERNEL_ATTENTION_FP8_HD64_R4 = 40,
    KVP_KERNEL_ATTENTION_FP8_HD64_R8 = 41,
    KVP_KERNEL_ATTENTION_FP8_HD128_R4 = 42,
    KVP_KERNEL_ATTENTION_FP8_HD128_R8 = 43,
    KVP_KERNEL_ATTENTION_FP8_HD256_R4 = 44,
    KVP_KERNEL_ATTENTION_FP8_HD256_R8 = 45
};

/* The geometry (kvpage_core::Geometry) plus the arena's block count. 40 bytes. */
typedef struct KvpGeometry {
    uint64_t elems_per_block; /* elements of one block, all layers, K and V, scales */
    uint64_t tile_elems;      /* elements of one (layer, K|V, head) tile, scales included */
    uint32_t layers;
    uint32_t kv_heads;
    uint32_t head_dim;
    uint32_t block_size;
    uint32_t num_blocks;
    uint32_t dtype; /* KVP_DTYPE_* */
} KvpGeometry;

/* kvp_write_kv, kvp_write_kv_stored. k and v: [tokens][kv_heads][head_dim], f32 (or the
 * storage dtype for _stored); slots: [tokens]. 88 bytes. */
typedef struct KvpWriteParams {
    KvpGeometry geo;
    void *arena;
    const float *k; /* kvp_write_kv_stored: storage-dtype elements */
    const float *v;
    const uint32_t *slots;
    uint32_t tokens;
    uint32_t layer;
    float k_scale; /* 8-bit storage: the keys' fixed scale, 0 for a scale per row */
    float v_scale; /* the values', as k_scale */
} KvpWriteParams;

/* kvp_copy_blocks. pairs: [num_pairs][2] block ids (src, dst). 32 bytes. */
typedef struct KvpCopyParams {
    void *arena;
    const uint32_t *pairs;
    uint64_t bytes_per_block;
    uint32_t num_pairs;
    uint32_t pad0;
} KvpCopyParams;

/* One sequence of an attention launch (the CPU backend's SeqQuery plus where its query
 * rows start in q / out: the sum of the queries of the sequences before it). */
typedef struct KvpSeqDesc {
    uint32_t row;         /* block-table row */
    uint32_t context_len; /* tokens of context, the new ones included */
    uint32_t queries;     /* new query tokens (the last ones of the context) */
    uint32_t q_start;     /* first query token of this sequence in q / out */
} KvpSeqDesc;

/* kvp_attention_* and kvp_attention_reduce. q, out: [scratch_rows][q_heads][head_dim];
 * block_table: rows of table_stride u32 block ids. 128 bytes. */
typedef struct KvpAttentionParams {
    KvpGeometry geo;
    const void *arena;
    const float *q;
    float *out;
    const uint32_t *block_table;
    const KvpSeqDesc *seqs;
    float *scratch;
    uint32_t table_stride;
    uint32_t num_seqs;
    uint32_t layer;
    uint32_t q_heads;
    float scale;
    uint32_t partition_tokens; /* multiple of block_size */
    uint32_t num_partitions;   /* grid.y of the attention launch */
    uint32_t row_tiles;        /* grid.x / kv_heads */
    uint32_t scratch_rows;     /* sum of queries over the sequences */
    uint32_t pad0;
} KvpAttentionParams;

#ifdef __cplusplus
}
#endif

#endif /* KVPAGE_PARAMS_H */
