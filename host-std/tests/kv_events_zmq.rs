//! The KV event publisher against a real subscriber written only against vLLM's
//! published format (`tests/kv_events_subscriber.py`: Python, pyzmq, msgpack): after a
//! scripted workload, with batches it drops on purpose (so it asks the replay socket)
//! and a cache ring small enough to overflow (so the publisher resynchronises), and
//! after a restart with a persisted prefix cache, the subscriber's set of cached blocks
//! equals the cache's own. Loopback addresses only.
//!
//! Needs `--features events-zmq` and `python3 -m pip install pyzmq msgpack`; without
//! the Python modules each test prints a loud SKIPPED message and passes.
#![cfg(feature = "events-zmq")]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use kvpage::publish::{EventPublisher, PublisherConfig, WireFormat};
use kvpage::{CacheConfig, Capacity, DType, Geometry, KvCache, ModelFingerprint, Seq};

const KEY: u64 = 0x6b76_7061_6765;

fn cache(event_capacity: u32) -> KvCache {
    KvCache::new(CacheConfig {
        geometry: Geometry::new(1, 1, 4, 4, DType::F32).unwrap(),
        capacity: Capacity::Blocks(24),
        max_seqs: 6,
        max_seq_len: 48,
        threads: 1,
        event_capacity,
        hash_key: Some(KEY),
        max_namespaces: kvpage::CACHE_NAMESPACES,
    })
    .unwrap()
}

/// Whether `python3` can import pyzmq and msgpack; prints why not.
fn python_ready() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import zmq, msgpack"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    // CI installs the modules and sets this: there a missing module is a failure.
    assert!(
        ok || std::env::var_os("KVPAGE_REQUIRE_SUBSCRIBER").is_none(),
        "KVPAGE_REQUIRE_SUBSCRIBER is set but python3 cannot import zmq and msgpack"
    );
    if !ok {
        eprintln!(
            "\n***** SKIPPED: python3 with pyzmq and msgpack is not available; the KV event \
             subscriber test did not run. Install: python3 -m pip install pyzmq msgpack *****\n"
        );
    }
    ok
}

fn start(format: WireFormat) -> EventPublisher {
    EventPublisher::start(PublisherConfig {
        replay_endpoint: Some("tcp://127.0.0.1:*".into()),
        format,
        ..PublisherConfig::new("tcp://127.0.0.1:*")
    })
    .unwrap()
}

/// A subscriber process on `publisher`, dropping batches `drop`, once it is ready.
fn subscribe(publisher: &EventPublisher, format: &str, drop: &str) -> std::process::Child {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/kv_events_subscriber.py");
    let mut child = Command::new("python3")
        .arg(script)
        .arg(publisher.endpoint())
        .arg(publisher.replay_endpoint().unwrap())
        .args([format, drop])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    child
}

/// Tells the subscriber the expected end state and returns its verdict line.
fn finish(mut child: std::process::Child, publisher: &EventPublisher, cache: &KvCache) -> String {
    let hashes: Vec<String> = cache
        .events_snapshot()
        .iter()
        .map(|s| s.hash.to_string())
        .collect();
    let expected = format!(
        "{{\"last_seq\": {}, \"hashes\": [{}]}}\n",
        publisher.batches() - 1,
        hashes.join(", ")
    );
    child
        .stdin
        .take()
        .unwrap()
        .write_all(expected.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let verdict = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(out.status.success(), "subscriber: {verdict}");
    eprintln!("subscriber: {verdict}");
    verdict
}

/// Prompts over a small alphabet (shared prefixes), appends, releases and evictions,
/// publishing after every operation. Returns how many batches resynchronised.
fn workload(cache: &mut KvCache, publisher: &mut EventPublisher, steps: u32) -> u32 {
    let mut live: Vec<Seq> = Vec::new();
    let mut resyncs = 0;
    let mut x = 0x2545_f491_u64;
    let mut next = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for step in 0..steps {
        match next(8) {
            0..=2 => {
                let len = 1 + next(30) as usize;
                let prompt: Vec<u32> = (0..len).map(|i| (i as u32 % 5) * next(2) as u32).collect();
                if let Ok(p) = cache.create_with_prompt(next(2), &prompt) {
                    cache.commit(p.seq).unwrap();
                    live.push(p.seq);
                }
            }
            3 if !live.is_empty() => {
                let i = next(live.len() as u64) as usize;
                if cache.append_tokens(live[i], &[7, 7, 7, 7, 7]).is_ok() {
                    cache.commit(live[i]).unwrap();
                }
            }
            4 | 5 if !live.is_empty() => {
                let i = next(live.len() as u64) as usize;
                cache.release(live.swap_remove(i)).unwrap();
            }
            6 => {
                cache.evict_cached(1 + next(3) as u32);
            }
            _ => {}
        }
        // Publishing every third step lets the 16-entry ring overflow now and then.
        if step % 3 == 2 {
            resyncs += u32::from(publisher.publish_from(cache).resync);
        }
    }
    publisher.publish_from(cache);
    resyncs
}

fn run(format: WireFormat, name: &str) {
    if !python_ready() {
        return;
    }
    let mut publisher = start(format);
    let child = subscribe(&publisher, name, "2,3,9");
    let mut c = cache(16);
    let resyncs = workload(&mut c, &mut publisher, 400);
    assert!(resyncs > 0, "the ring overflowed at least once");
    assert!(publisher.batches() > 10);
    let verdict = finish(child, &publisher, &c);
    assert!(verdict.starts_with("OK"), "{verdict}");
    assert!(!verdict.contains("replays 0"), "{verdict}");
}

#[test]
fn a_python_subscriber_rebuilds_the_cached_blocks_from_tagged_maps() {
    run(WireFormat::TaggedMap, "map");
}

#[test]
fn a_python_subscriber_rebuilds_the_cached_blocks_from_positional_arrays() {
    run(WireFormat::PositionalArray, "array");
}

#[test]
fn after_a_restart_with_a_persisted_cache_a_snapshot_matches() {
    if !python_ready() {
        return;
    }
    let model = ModelFingerprint::from_u64(3);
    let mut first = cache(4096);
    let mut publisher = start(WireFormat::TaggedMap);
    workload(&mut first, &mut publisher, 120);
    let before: Vec<u64> = first.events_snapshot().iter().map(|s| s.hash).collect();
    let mut bytes = vec![0u8; first.saved_prefix_cache_size() as usize];
    first.save_prefix_cache(&model, &mut bytes).unwrap();
    drop((first, publisher));

    // The restarted replica: same hash key, the persisted cache loaded, a new publisher
    // whose first batch is a snapshot for the router.
    let mut second = cache(4096);
    let mut publisher = start(WireFormat::TaggedMap);
    let child = subscribe(&publisher, "map", "-");
    let report = second.load_prefix_cache(&bytes, &model).unwrap();
    assert!(report.loaded > 0);
    assert!(publisher.publish_snapshot(&mut second).resync);
    // Every loaded block has the hash it had before the restart.
    let after: Vec<u64> = second.events_snapshot().iter().map(|s| s.hash).collect();
    assert!(after.iter().all(|h| before.contains(h)));
    workload(&mut second, &mut publisher, 60);
    let verdict = finish(child, &publisher, &second);
    assert!(verdict.starts_with("OK"), "{verdict}");
}

/// The publisher through the C API: start on a picked loopback port, publish a C
/// cache's events and a snapshot to a real SUB socket, free; bad arguments refused.
#[test]
fn the_c_api_starts_and_feeds_a_publisher() {
    use core::ptr::null_mut;
    use kvpage::ffi::kvpage_result::*;
    use kvpage::ffi::*;

    let mut params = kvpage_cache_default_params(kvpage_geometry {
        layers: 1,
        kv_heads: 1,
        head_dim: 4,
        block_size: 4,
        dtype: KVPAGE_DTYPE_F32,
    });
    params.capacity_bytes = 0;
    params.capacity_blocks = 16;
    params.event_capacity = 64;
    let endpoint = c"tcp://127.0.0.1:*";
    let mut pp = kvpage_publisher_params {
        endpoint: endpoint.as_ptr(),
        replay_endpoint: core::ptr::null(),
        topic: core::ptr::null(),
        data_parallel_rank: 0,
        format: KVPAGE_WIRE_TAGGED_MAP,
        replay_batches: 0,
        queue_batches: 0,
    };
    let (mut c, mut p) = (null_mut(), null_mut());
    let mut addr = [0 as core::ffi::c_char; 64];
    let mut n = 0usize;
    let mut done = kvpage_published::default();
    let prompt: Vec<u32> = (0..9).collect();
    let mut seq = KVPAGE_SEQ_NONE;
    // SAFETY: valid pointers throughout; both objects are freed at the end.
    unsafe {
        assert_eq!(kvpage_cache_new(&params, &mut c, null_mut()), KVPAGE_OK);
        assert_eq!(kvpage_publisher_start(&pp, &mut p, null_mut()), KVPAGE_OK);
        assert_eq!(
            kvpage_publisher_endpoint(p, addr.as_mut_ptr(), 3, &mut n, null_mut()),
            KVPAGE_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(
            kvpage_publisher_endpoint(p, addr.as_mut_ptr(), addr.len(), &mut n, null_mut()),
            KVPAGE_OK
        );
        let bound = core::ffi::CStr::from_ptr(addr.as_ptr())
            .to_str()
            .unwrap()
            .to_owned();
        assert!(
            bound.starts_with("tcp://127.0.0.1:") && n == bound.len() + 1,
            "{bound}"
        );
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.set_rcvtimeo(5_000).unwrap();
        sub.connect(&bound).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert_eq!(
            kvpage_cache_create_with_prompt(
                c,
                0,
                prompt.as_ptr(),
                prompt.len(),
                &mut seq,
                null_mut(),
                null_mut()
            ),
            KVPAGE_OK
        );
        assert_eq!(
            kvpage_cache_commit(c, seq, null_mut(), null_mut()),
            KVPAGE_OK
        );
        assert_eq!(
            kvpage_publisher_publish(p, c, 0, &mut done, null_mut()),
            KVPAGE_OK
        );
        assert_eq!((done.events, done.resync, done.dropped), (2, 0, 0));
        let frames = sub.recv_multipart(0).unwrap();
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[1], 0u64.to_be_bytes());
        assert_eq!(
            kvpage_publisher_publish(p, c, 1, &mut done, null_mut()),
            KVPAGE_OK
        );
        assert_eq!(
            (done.events, done.resync),
            (3, 1),
            "AllBlocksCleared and 2 stored"
        );
        assert_eq!(sub.recv_multipart(0).unwrap()[1], 1u64.to_be_bytes());
        // Bad arguments.
        assert_eq!(
            kvpage_publisher_publish(p, null_mut(), 0, &mut done, null_mut()),
            KVPAGE_ERR_NULL_POINTER
        );
        pp.format = 5;
        assert_eq!(
            kvpage_publisher_start(&pp, &mut p, null_mut()),
            KVPAGE_ERR_INVALID_ARGUMENT
        );
        pp.format = KVPAGE_WIRE_TAGGED_MAP;
        pp.endpoint = c"not-an-address".as_ptr();
        let mut other = null_mut();
        assert_eq!(
            kvpage_publisher_start(&pp, &mut other, null_mut()),
            KVPAGE_ERR_IO
        );
        assert!(other.is_null());
        assert_eq!(kvpage_publisher_free(p, null_mut()), KVPAGE_OK);
        assert_eq!(kvpage_cache_free(c, null_mut()), KVPAGE_OK);
    }
}
