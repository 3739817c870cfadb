// Index arithmetic of the block-major arena (DESIGN.md "KV data layout";
// kvpage_core::Geometry): host and device, all in 64-bit where an arena offset can pass
// 2^32. Tested directly on the host (`kvpage_emu_*` exports, emulated_kernels.rs) at
// sizes where 32-bit arithmetic would overflow.
#pragma once
#include "params.h"

namespace kvp {

// Element offset, inside one block, of the tile of (layer, kv, kv_head): as
// kvpage_core::Geometry::tile_offset.
KVP_HD uint64_t tile_offset(const KvpGeometry &g, uint32_t layer, uint32_t kv, uint32_t kv_head) {
    return (((uint64_t)layer * 2u + kv) * g.kv_heads + kv_head) * g.tile_elems;
}

// Element offset of block `block` in the arena.
KVP_HD uint64_t block_offset(const KvpGeometry &g, uint32_t block) {
    return (uint64_t)block * g.elems_per_block;
}

// Block of a slot (slot / block_size).
KVP_HD uint32_t slot_block(uint32_t slot, uint32_t block_size) { return slot / block_size; }

// Token row of a slot inside its block (slot % block_size).
KVP_HD uint32_t slot_offset(uint32_t slot, uint32_t block_size) { return slot % block_size; }

// Element offset in the arena of the first value of token row `row` of the tile of
// (block, layer, kv, kv_head).
KVP_HD uint64_t row_offset(const KvpGeometry &g, uint32_t block, uint32_t layer, uint32_t kv,
                           uint32_t kv_head, uint32_t row) {
    return block_offset(g, block) + tile_offset(g, layer, kv, kv_head) +
           (uint64_t)row * g.head_dim;
}

// Byte offset in the arena of the f32 scale of token row `row` of a tile, 8-bit dtypes
// only (one byte per element): after the tile's block_size * head_dim codes.
KVP_HD uint64_t scale_offset(const KvpGeometry &g, uint32_t block, uint32_t layer, uint32_t kv,
                             uint32_t kv_head, uint32_t row) {
    return block_offset(g, block) + tile_offset(g, layer, kv, kv_head) +
           (uint64_t)g.block_size * g.head_dim + (uint64_t)row * 4u;
}

// Index of the (max, sum) statistics of (query row, query head, partition) in each of
// the two statistics arrays of the attention scratch (params.h).
KVP_HD uint64_t scratch_stat(uint32_t q_row, uint32_t q_head, uint32_t partition,
                             uint32_t q_heads, uint32_t partitions) {
    return ((uint64_t)q_row * q_heads + q_head) * partitions + partition;
}

// Floats of one statistics array: rows * q_heads * partitions.
KVP_HD uint64_t scratch_stat_len(uint32_t rows, uint32_t q_heads, uint32_t partitions) {
    return (uint64_t)rows * q_heads * partitions;
}

// Element offset of (query token, query head) in q / out ([rows][q_heads][head_dim]).
KVP_HD uint64_t query_offset(uint32_t q_row, uint32_t q_head, uint32_t q_heads,
                             uint32_t head_dim) {
    return ((uint64_t)q_row * q_heads + q_head) * head_dim;
}

} // namespace kvp
