//! The KV event publisher from C: start one over ZeroMQ (vLLM's wire format, see
//! `crate::publish`), hand it an owned cache's drained events, free it. The functions
//! exist in every build; a library built without the `events-zmq` feature answers
//! `kvpage_publisher_start` with `KVPAGE_ERR_UNSUPPORTED` (a C++ service that publishes
//! itself drains the ring with `kvpage_cache_events_drain` instead).

use core::ffi::{c_char, CStr};

use super::args::{free_boxed, obj, out, out_opt, slice_mut, tagged_mut, Tagged};
use super::cache::kvpage_cache;
use super::result::{kvpage_error, kvpage_result, run, Fail};

/// Wire form: vLLM's current tagged maps (`{"type": "BlockStored", ...}`).
pub const KVPAGE_WIRE_TAGGED_MAP: u32 = 0;
/// Wire form: the older positional arrays (`["BlockStored", ...]`).
pub const KVPAGE_WIRE_POSITIONAL_ARRAY: u32 = 1;

/// How `kvpage_publisher_start` sends. Strings are NUL-terminated and copied.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvpage_publisher_params {
    /// Address the PUB socket binds, e.g. "tcp://127.0.0.1:5557" ("…:*" picks a port:
    /// see `kvpage_publisher_endpoint`). Required.
    pub endpoint: *const c_char,
    /// Address the replay ROUTER socket binds; NULL for no replay.
    pub replay_endpoint: *const c_char,
    /// First frame of every message; NULL for the empty topic (vLLM's default).
    pub topic: *const c_char,
    /// `data_parallel_rank` of every batch.
    pub data_parallel_rank: u32,
    /// `KVPAGE_WIRE_TAGGED_MAP` or `KVPAGE_WIRE_POSITIONAL_ARRAY`.
    pub format: u32,
    /// Batches kept for replay requests (0: 10,000).
    pub replay_batches: u32,
    /// Batches queued for the publisher thread before publishing stops queueing and
    /// resynchronises later (0: 1,024).
    pub queue_batches: u32,
}

/// What one `kvpage_publisher_publish` did.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct kvpage_published {
    /// Events in the batch handed to the publisher thread (0: nothing to send).
    pub events: u64,
    /// Non-zero: the batch resynchronises subscribers (`AllBlocksCleared`, a snapshot).
    pub resync: u32,
    /// Non-zero: the queue was full, nothing was handed over; the next batch resyncs.
    pub dropped: u32,
}

const MAGIC: u64 = u64::from_le_bytes(*b"kvpgPUB1");

/// A running publisher (opaque).
#[repr(C)]
pub struct kvpage_publisher {
    magic: u64,
    #[cfg(feature = "events-zmq")]
    publisher: crate::publish::EventPublisher,
}

// SAFETY: `repr(C)` with `magic: u64` first, holding MAGIC in every live object.
unsafe impl Tagged for kvpage_publisher {
    const MAGIC: u64 = MAGIC;
    const WHAT: &'static str = "publisher";
    const NOT_LIVE: &'static str = "not a kvpage_publisher (uninitialised, freed or corrupted)";
}

/// A NUL-terminated string argument as UTF-8; `None` for NULL.
///
/// # Safety
/// `s` is null or a readable NUL-terminated string.
unsafe fn opt_str(s: *const c_char, what: &'static str) -> Result<Option<String>, Fail> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null, NUL-terminated and readable by the caller's contract.
    let bytes = unsafe { CStr::from_ptr(s) }.to_bytes();
    core::str::from_utf8(bytes)
        .map(|s| Some(s.to_owned()))
        .map_err(|_| Fail::invalid(what))
}

/// Starts a publisher: binds its sockets (a bad or taken address fails here) and starts
/// its thread; writes it to `*out_publisher`. O(1).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER` (`params`, `params->endpoint`, `out_publisher`),
/// `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT` (a string not UTF-8, an
/// unknown `format`: `value` = format), `KVPAGE_ERR_IO` (a socket cannot be made or
/// bound: the message says which), `KVPAGE_ERR_UNSUPPORTED` (built without the
/// `events-zmq` feature).
///
/// # Safety
/// `params` is null or readable, its strings null or NUL-terminated; `out_publisher` is
/// null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_publisher_start(
    params: *const kvpage_publisher_params,
    out_publisher: *mut *mut kvpage_publisher,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `obj` / `out` / `opt_str`.
    unsafe {
        run(err, || {
            let p = obj(params, "params")?;
            let dst = out(out_publisher, "out_publisher")?;
            let endpoint = opt_str(p.endpoint, "endpoint is not UTF-8")?
                .ok_or(Fail::null("params->endpoint"))?;
            let replay = opt_str(p.replay_endpoint, "replay_endpoint is not UTF-8")?;
            let topic = opt_str(p.topic, "topic is not UTF-8")?.unwrap_or_default();
            if p.format > KVPAGE_WIRE_POSITIONAL_ARRAY {
                return Err(Fail::invalid("unknown wire format").with_value(p.format.into()));
            }
            start(p, endpoint, replay, topic).map(|publisher| dst.set(publisher))
        })
    }
}

#[cfg(feature = "events-zmq")]
fn start(
    p: &kvpage_publisher_params,
    endpoint: String,
    replay_endpoint: Option<String>,
    topic: String,
) -> Result<*mut kvpage_publisher, Fail> {
    use crate::publish::{EventPublisher, PublisherConfig, WireFormat};
    let defaults = PublisherConfig::new(endpoint);
    let config = PublisherConfig {
        replay_endpoint,
        topic,
        data_parallel_rank: p.data_parallel_rank,
        format: match p.format {
            KVPAGE_WIRE_TAGGED_MAP => WireFormat::TaggedMap,
            _ => WireFormat::PositionalArray,
        },
        replay_batches: match p.replay_batches {
            0 => defaults.replay_batches,
            n => n as usize,
        },
        queue_batches: match p.queue_batches {
            0 => defaults.queue_batches,
            n => n as usize,
        },
        ..defaults
    };
    let publisher = EventPublisher::start(config).map_err(|e| {
        let message = match e.action {
            "bind PUB" => "KV event publisher: the PUB address cannot be bound",
            "bind ROUTER" => "KV event publisher: the replay address cannot be bound",
            "thread" => "KV event publisher: its thread cannot be started",
            _ => "KV event publisher: a socket cannot be made",
        };
        Fail::new(kvpage_result::KVPAGE_ERR_IO, message)
    })?;
    Ok(Box::into_raw(Box::new(kvpage_publisher {
        magic: MAGIC,
        publisher,
    })))
}

#[cfg(not(feature = "events-zmq"))]
fn start(
    _: &kvpage_publisher_params,
    _: String,
    _: Option<String>,
    _: String,
) -> Result<*mut kvpage_publisher, Fail> {
    Err(Fail::new(
        kvpage_result::KVPAGE_ERR_UNSUPPORTED,
        "built without the events-zmq feature",
    ))
}

/// Writes the address the PUB socket is bound to (with the port it picked), NUL
/// included, into `out[..n]`, and `n` to `*out_len` when non-null. O(address).
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a publisher), `KVPAGE_ERR_BUFFER_TOO_SMALL` (`needed` bytes).
///
/// # Safety
/// `publisher` is null or a live publisher; `out` is null or writable for `len` bytes;
/// `out_len` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_publisher_endpoint(
    publisher: *mut kvpage_publisher,
    out: *mut c_char,
    len: usize,
    out_len: *mut usize,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `slice_mut` / `out_opt`.
    unsafe {
        run(err, || {
            let p = tagged_mut(publisher)?;
            let buf = slice_mut(out.cast::<u8>(), len, "out")?;
            let written = out_opt(out_len, "out_len")?;
            let address = endpoint_of(p);
            let n = address.len() + 1;
            let dst = buf.get_mut(..n).ok_or(Fail::short("out", n, len))?;
            dst[..n - 1].copy_from_slice(address.as_bytes());
            dst[n - 1] = 0;
            if let Some(w) = written {
                w.set(n);
            }
            Ok(())
        })
    }
}

#[cfg(feature = "events-zmq")]
fn endpoint_of(p: &kvpage_publisher) -> &str {
    p.publisher.endpoint()
}

#[cfg(not(feature = "events-zmq"))]
fn endpoint_of(_: &kvpage_publisher) -> &str {
    ""
}

/// Drains `cache`'s KV events and hands them to the publisher's thread as one batch,
/// never blocking on the network (after an overflow of the cache's ring or of the
/// queue, the batch resynchronises subscribers with `AllBlocksCleared` and a snapshot).
/// With `snapshot` non-zero it sends that resynchronising batch now, for a router that
/// starts cold. Writes what it did to `*out_published` when non-null.
/// O(events × block size), O(blocks × chain depth) when it resynchronises.
///
/// # Errors
/// `KVPAGE_ERR_NULL_POINTER`, `KVPAGE_ERR_MISALIGNED`, `KVPAGE_ERR_INVALID_ARGUMENT`
/// (not a publisher or not a cache).
///
/// # Safety
/// `publisher` is null or a live publisher; `cache` is null or a live cache;
/// `out_published` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn kvpage_publisher_publish(
    publisher: *mut kvpage_publisher,
    cache: *mut kvpage_cache,
    snapshot: u32,
    out_published: *mut kvpage_published,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: pointers checked by `tagged_mut` / `out_opt`.
    unsafe {
        run(err, || {
            let p = tagged_mut(publisher)?;
            let c = tagged_mut(cache)?;
            let dst = out_opt(out_published, "out_published")?;
            let done = publish(p, &mut c.cache, snapshot != 0);
            if let Some(d) = dst {
                d.set(done);
            }
            Ok(())
        })
    }
}

#[cfg(feature = "events-zmq")]
fn publish(
    p: &mut kvpage_publisher,
    cache: &mut crate::KvCache,
    snapshot: bool,
) -> kvpage_published {
    let done = match snapshot {
        true => p.publisher.publish_snapshot(cache),
        false => p.publisher.publish_from(cache),
    };
    kvpage_published {
        events: done.events as u64,
        resync: u32::from(done.resync),
        dropped: u32::from(done.dropped),
    }
}

#[cfg(not(feature = "events-zmq"))]
fn publish(_: &mut kvpage_publisher, _: &mut crate::KvCache, _: bool) -> kvpage_published {
    kvpage_published::default()
}

/// Sends what is queued, stops the publisher's thread and frees it (waiting up to a
/// second for subscribers to take the last messages). NULL is a no-op returning
/// `KVPAGE_OK`. O(queued batches).
///
/// # Errors
/// `KVPAGE_ERR_MISALIGNED`; `KVPAGE_ERR_INVALID_ARGUMENT` for a pointer that is not a
/// live publisher (nothing is freed).
///
/// # Safety
/// `publisher` is null or a publisher from `kvpage_publisher_start` not yet freed,
/// used by no other call now or later.
#[no_mangle]
pub unsafe extern "C" fn kvpage_publisher_free(
    publisher: *mut kvpage_publisher,
    err: *mut kvpage_error,
) -> kvpage_result {
    // SAFETY: the caller's contract is `free_boxed`'s; `_start` boxed the publisher.
    unsafe { run(err, || free_boxed(publisher)) }
}
