//! Fixed scales of 8-bit K/V codes per layer (`KvCache::set_kv_scales`,
//! `Engine::set_kv_scales`): the rows written after the setting hold what the kernel at
//! those scales writes, rows written before keep theirs, and bad settings change
//! nothing.

use kvpage::kernels::{write_kv, write_kv_at_scales};
use kvpage::{
    Arena, CacheConfig, CacheError, Capacity, DType, Element, Engine, EngineConfig, Fp8E4m3,
    Geometry, Int8, KernelError, KvCache, KvScales, Preemption, SchedulerConfig,
};

const LAYERS: u32 = 2;
const HEADS: u32 = 2;
const DIM: u32 = 8;
const BLOCK: u32 = 4;
const ROW: usize = (HEADS * DIM) as usize;

fn config(dtype: DType) -> CacheConfig {
    CacheConfig {
        geometry: Geometry::new(LAYERS, HEADS, DIM, BLOCK, dtype).unwrap(),
        // One block: a sequence's first `BLOCK` tokens take slots 0..BLOCK in order.
        capacity: Capacity::Blocks(1),
        max_seqs: 2,
        max_seq_len: BLOCK,
        threads: 1,
        event_capacity: 0,
        hash_key: None,
        max_namespaces: kvpage::CACHE_NAMESPACES,
    }
}

/// K or V of `tokens` tokens, some values far past a scale of 0.01's range.
fn values(tokens: usize, seed: u32) -> Vec<f32> {
    (0..tokens * ROW)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
            (x as f32 / (1u32 << 24) as f32 - 0.5) * (1 + i % 5) as f32
        })
        .collect()
}

/// A cache's arena after `writes`, as the kernels alone write it into a fresh arena of
/// the same layout at slots `0..tokens`: `(layer, scales)` per write, K/V from
/// [`values`].
fn expected<T: Element>(
    cache: &KvCache,
    tokens: usize,
    writes: &[(u32, Option<KvScales>)],
) -> Vec<u8> {
    let layout = cache.layout();
    let mut arena = Arena::for_layout(layout).unwrap();
    let slots: Vec<u32> = (0..tokens as u32).collect();
    for &(layer, scales) in writes {
        let (k, v) = (values(tokens, layer), values(tokens, layer + 10));
        let a = arena.as_mut_slice::<T>();
        match scales {
            None => write_kv(layout, a, layer, &slots, &k, &v).unwrap(),
            Some(s) => write_kv_at_scales(layout, a, layer, &slots, &k, &v, s).unwrap(),
        }
    }
    arena.as_bytes().to_vec()
}

fn cache_writes_at_fixed_scales<T: Element>() {
    let mut cache = KvCache::new(config(T::DTYPE)).unwrap();
    let seq = cache.create(0).unwrap();
    let tokens = 3;
    cache.append(seq, tokens as u32).unwrap();
    let fixed = KvScales::new(0.01, 0.5).unwrap();
    assert_eq!(cache.kv_scales(0).unwrap(), None);
    cache.set_kv_scales(0, Some(fixed)).unwrap();
    assert_eq!(cache.kv_scales(0).unwrap(), Some(fixed));
    assert_eq!(cache.kv_scales(1).unwrap(), None, "per layer");
    let write = |cache: &mut KvCache, layer: u32| {
        let (k, v) = (values(tokens, layer), values(tokens, layer + 10));
        cache.write_kv(seq, layer, 0, &k, &v).unwrap();
    };
    write(&mut cache, 0);
    write(&mut cache, 1);
    let both = [(0, Some(fixed)), (1, None)];
    assert_eq!(
        cache.arena().as_bytes(),
        &expected::<T>(&cache, tokens, &both)[..]
    );
    // The default is another arena: the setting did something.
    let default = [(0, None), (1, None)];
    assert_ne!(
        cache.arena().as_bytes(),
        &expected::<T>(&cache, tokens, &default)[..]
    );

    // Cleared, layer 0 writes a scale per row again; layer 1 at its new fixed scales.
    cache.set_kv_scales(0, None).unwrap();
    cache.set_kv_scales(1, Some(fixed)).unwrap();
    write(&mut cache, 0);
    write(&mut cache, 1);
    let swapped = [(0, None), (1, Some(fixed))];
    assert_eq!(
        cache.arena().as_bytes(),
        &expected::<T>(&cache, tokens, &swapped)[..]
    );

    // Refused: nothing changes.
    assert!(matches!(
        cache.set_kv_scales(LAYERS, None),
        Err(CacheError::Kernel(KernelError::LayerOutOfRange {
            layer: LAYERS,
            ..
        }))
    ));
    assert!(matches!(
        cache.kv_scales(LAYERS),
        Err(CacheError::Kernel(KernelError::LayerOutOfRange { .. }))
    ));
    assert_eq!(cache.kv_scales(0).unwrap(), None);
    assert_eq!(cache.kv_scales(1).unwrap(), Some(fixed));
}

#[test]
fn int8_cache_writes_at_fixed_scales() {
    cache_writes_at_fixed_scales::<Int8>();
}

#[test]
fn fp8_cache_writes_at_fixed_scales() {
    cache_writes_at_fixed_scales::<Fp8E4m3>();
}

#[test]
fn float_storage_has_no_scales_to_fix() {
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        let mut cache = KvCache::new(config(dtype)).unwrap();
        let fixed = KvScales::new(1.0, 1.0).unwrap();
        let refused = Err(CacheError::Kernel(KernelError::UnscaledStorage { dtype }));
        assert_eq!(cache.set_kv_scales(0, Some(fixed)), refused);
        assert_eq!(cache.set_kv_scales(0, None), refused);
        assert_eq!(
            cache.kv_scales(0),
            Err(CacheError::Kernel(KernelError::UnscaledStorage { dtype }))
        );
    }
}

#[test]
fn an_engine_writes_at_its_cache_scales() {
    let mut engine = Engine::new(EngineConfig {
        cache: config(DType::Int8),
        max_requests: 2,
        scheduler: SchedulerConfig {
            token_budget: 16,
            max_running: 2,
            watermark_blocks: 0,
            preemption: Preemption::Recompute,
        },
        host_capacity: Capacity::Blocks(0),
    })
    .unwrap();
    let fixed = KvScales::new(0.01, 0.02).unwrap();
    engine.set_kv_scales(1, Some(fixed)).unwrap();
    assert_eq!(engine.kv_scales(1).unwrap(), Some(fixed));
    assert_eq!(engine.cache().kv_scales(1).unwrap(), Some(fixed));
    assert_eq!(engine.kv_scales(0).unwrap(), None);
    assert!(engine.set_kv_scales(LAYERS, Some(fixed)).is_err());
    engine.add_request(&[1, 2, 3], 0, Some(1)).unwrap();
    let step = engine.step().unwrap();
    let tokens = step.tokens() as usize;
    assert_eq!(tokens, 3);
    for layer in 0..LAYERS {
        let (k, v) = (values(tokens, layer), values(tokens, layer + 10));
        engine.write_kv(layer, &k, &v).unwrap();
    }
    let writes = [(0, None), (1, Some(fixed))];
    let want = expected::<Int8>(engine.cache(), tokens, &writes);
    assert_eq!(engine.cache().arena().as_bytes(), &want[..]);
}
