//! Caller inputs at the edges of their types: sizes whose products overflow, counts
//! near `u32::MAX`. Each must be a typed error with nothing written, never a panic
//! (debug overflow checks) or a wrapped size.

use kvpage::kernels::{
    contiguous_attention, paged_attention, write_kv, AttentionParams, BlockTable, ContiguousKv,
    SeqQuery,
};
use kvpage::{f16, Arena, Buffer, DType, Geometry, KernelError, KvLayout};

const PARAMS: AttentionParams<'static> = AttentionParams {
    q_heads: 1,
    scale: 1.0,
    pool: None,
};

/// `kv_heads * capacity * head_dim` = 2^64: used to panic (debug) or wrap to 0 and
/// divide by zero (release) while sizing a row of the contiguous cache.
#[test]
fn contiguous_row_size_overflow_is_an_error() {
    let empty: [f32; 0] = [];
    for (kv_heads, head_dim, capacity) in [
        (1u32 << 31, 4u32, 1u32 << 31),
        (u32::MAX, 256, u32::MAX),
        (u32::MAX, u32::MAX, u32::MAX),
    ] {
        let kv = ContiguousKv {
            k: &empty,
            v: &empty,
            kv_heads,
            head_dim,
            capacity,
        };
        let mut out = [7.0f32; 4];
        let r = contiguous_attention(
            kv,
            &[SeqQuery::decode(0, 1)],
            &[0.5; 4],
            &mut out,
            AttentionParams {
                q_heads: kv_heads,
                ..PARAMS
            },
        );
        assert_eq!(
            r,
            Err(KernelError::BadLayout),
            "{kv_heads} {head_dim} {capacity}"
        );
        assert_eq!(out, [7.0; 4]);
    }
}

/// Sequences of `u32::MAX` queries over `u32::MAX` tokens: the work estimate (queries
/// × context summed over sequences) overflowed a `u64` before the query buffer was
/// checked, and on 32 bits one sequence's query rows (queries × query heads per KV
/// head) overflowed `usize` in the count of tasks (a panic in debug builds). A block of
/// 2^16 tokens and a row of 2^16 entries address 2^32 tokens.
#[test]
#[cfg_attr(
    miri,
    ignore = "29 s interpreted over a row of 2^16 entries; what it checks is safe \
              arithmetic, run natively and under ASan (the arena's views run under Miri \
              in the cache tests)"
)]
fn huge_query_counts_are_a_buffer_error_not_an_overflow() {
    let geometry = Geometry::new(1, 1, 1, 1 << 16, DType::F16).unwrap();
    let layout = KvLayout::new(geometry, 1).unwrap();
    let arena = Arena::for_layout(&layout).unwrap();
    let table = vec![0u32; 1 << 16];
    let bt = BlockTable {
        table: &table,
        stride: 1 << 16,
    };
    let seq = SeqQuery {
        row: 0,
        context_len: u32::MAX,
        queries: u32::MAX,
    };
    // Three sequences of one query head each; one sequence of two query heads.
    for (seqs, q_heads) in [(3usize, 1u32), (1, 2)] {
        let mut out = [7.0f32; 1];
        let r = paged_attention(
            &layout,
            arena.as_slice::<f16>(),
            0,
            bt,
            &vec![seq; seqs],
            &[0.5],
            &mut out,
            AttentionParams { q_heads, ..PARAMS },
        );
        // The buffer they need (head dim 1), or, where it is past `usize` (32 bits), a
        // layout error.
        let need = (u32::MAX as usize)
            .checked_mul(seqs)
            .and_then(|rows| rows.checked_mul(q_heads as usize));
        let want = match need {
            Some(expected) => KernelError::BufferLength {
                buffer: Buffer::Query,
                expected,
                actual: 1,
            },
            None => KernelError::BadLayout,
        };
        assert_eq!(r, Err(want), "{seqs} x {q_heads}");
        assert_eq!(out, [7.0]);
    }
}

/// `slots × kv_heads × head_dim` past `usize`: u32::MAX KV heads of 256 dims are 2^40
/// elements per token (a valid layout), and 2^24 + 1 slots overflow (on 32 bits, 2^12
/// heads: 2^20 elements, and 2^12 + 1 slots). The size check comes before the arena's,
/// so no 8 TiB arena is needed to reach it.
#[test]
fn write_kv_size_overflow_is_an_error() {
    let kv_heads: u32 = if usize::BITS == 64 { u32::MAX } else { 1 << 12 };
    let geometry = Geometry::new(1, kv_heads, 256, 1, DType::F16).unwrap();
    let layout = KvLayout::new(geometry, 1).unwrap();
    let slots = vec![0u32; usize::MAX / (kv_heads as usize * 256) + 1];
    assert_eq!(
        write_kv::<f16>(&layout, &mut [], 0, &slots, &[], &[]),
        Err(KernelError::BadLayout)
    );
}

/// `KvLayout::tile_offset` is public: indices out of range give an offset past the arena
/// (`usize::MAX`), never an overflow panic in the offset arithmetic.
#[test]
fn tile_offset_out_of_range_is_past_the_arena() {
    // 2^39 elements per block (on 32 bits, 2^21): a valid layout whose offsets
    // overflow for a u32 block id.
    let (kv_heads, block) = if usize::BITS == 64 {
        (1 << 20, 1 << 10)
    } else {
        (1 << 8, 1 << 4)
    };
    let geometry = Geometry::new(1, kv_heads, 256, block, DType::F16).unwrap();
    let layout = KvLayout::new(geometry, 1).unwrap();
    let past = |block, layer, kv, head| {
        let off = layout.tile_offset(block, layer, kv, head);
        assert!(
            off >= layout.arena_elems(),
            "{block} {layer} {kv} {head}: {off}"
        );
    };
    past(u32::MAX, 0, 0, 0);
    past(0, u32::MAX, 1, 0);
    past(0, 0, u32::MAX, 0);
    past(0, 0, 0, u32::MAX);
    past(u32::MAX, u32::MAX, u32::MAX, u32::MAX);
    past(1, 0, 0, 0);
    // In range: the block's start plus the geometry's offset.
    assert_eq!(
        layout.tile_offset(0, 0, 1, 3),
        geometry.tile_offset(0, 1, 3) as usize
    );
}
