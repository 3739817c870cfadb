//! Asking for the CUDA backend where it cannot run is a typed error, never a crash: in a
//! build without the `cuda` feature ([`DeviceFault::NotCompiled`]), and on a machine
//! without an NVIDIA driver (CI: [`DeviceFault::NoDriver`], or `NoKernels` when the
//! build found no `nvcc`). On a GPU machine the cache is made and runs on the device.

use kvpage::{
    Backend, CacheConfig, CacheError, Capacity, CudaOptions, DType, DeviceFault, Engine,
    EngineConfig, Geometry, KvCache, Preemption, SchedulerConfig,
};

fn cache_config() -> CacheConfig {
    CacheConfig {
        geometry: Geometry::new(2, 2, 64, 16, DType::F16).unwrap(),
        capacity: Capacity::Blocks(32),
        max_seqs: 4,
        max_seq_len: 256,
        threads: 1,
        event_capacity: 0,
        hash_key: Some(1),
        max_namespaces: kvpage::CACHE_NAMESPACES,
    }
}

fn cuda() -> Backend {
    Backend::Cuda(CudaOptions {
        device: 0,
        memory_fraction: None,
        reserve_bytes: 0,
        q_heads: 4,
        max_step_tokens: 64,
    })
}

/// The faults a machine without a usable device may give.
fn expected_fault(e: CacheError) {
    let CacheError::Device(fault) = e else {
        panic!("not a device error: {e}");
    };
    if cfg!(feature = "cuda") {
        assert!(
            matches!(
                fault,
                DeviceFault::NoDriver | DeviceFault::NoKernels | DeviceFault::Driver { .. }
            ),
            "{fault}"
        );
    } else {
        assert_eq!(fault, DeviceFault::NotCompiled);
    }
    assert!(!e.to_string().is_empty());
}

#[test]
fn a_cuda_cache_where_cuda_cannot_run_is_a_typed_error() {
    match KvCache::with_backend(cache_config(), cuda()) {
        Ok(cache) => {
            assert_eq!(cache.backend(), "cuda");
            assert!(cache.arena().as_bytes().is_empty());
        }
        Err(e) => expected_fault(e),
    }
    let cpu = KvCache::with_backend(cache_config(), Backend::Cpu).unwrap();
    assert_eq!(cpu.backend(), "cpu");
    assert_eq!(cpu.stats(), KvCache::new(cache_config()).unwrap().stats());
}

#[test]
fn a_cuda_engine_where_cuda_cannot_run_is_a_typed_error() {
    let config = EngineConfig {
        cache: cache_config(),
        max_requests: 4,
        scheduler: SchedulerConfig {
            token_budget: 32,
            max_running: 4,
            watermark_blocks: 0,
            preemption: Preemption::Swap,
        },
        host_capacity: Capacity::Blocks(8),
    };
    match Engine::with_backend(config, cuda()) {
        Ok(engine) => assert_eq!(engine.cache().backend(), "cuda"),
        Err(e) => expected_fault(e),
    }
    assert!(Engine::with_backend(config, Backend::Cpu).is_ok());
}

#[test]
fn read_block_copies_one_block_of_the_cpu_arena() {
    let mut cache = KvCache::new(cache_config()).unwrap();
    let seq = cache.create(0).unwrap();
    cache.append(seq, 20).unwrap();
    let row = 2 * 64;
    let k: Vec<f32> = (0..20 * row).map(|i| i as f32 * 0.01).collect();
    cache.write_kv(seq, 1, 0, &k, &k).unwrap();
    let bpb = cache.geometry().bytes_per_block() as usize;
    let blocks = cache.block_manager().blocks(seq.id()).unwrap().to_vec();
    let mut out = vec![0u8; bpb];
    for b in blocks {
        cache.read_block(b, &mut out).unwrap();
        let start = b as usize * bpb;
        assert_eq!(out, cache.arena().as_bytes()[start..start + bpb]);
    }
    assert!(matches!(
        cache.read_block(32, &mut out),
        Err(CacheError::Kernel(
            kvpage::KernelError::BlockOutOfRange { .. }
        ))
    ));
    assert!(matches!(
        cache.read_block(0, &mut out[1..]),
        Err(CacheError::Kernel(kvpage::KernelError::BufferLength { .. }))
    ));
}
