//! The KV event publisher (feature `events-zmq`): the owned cache's KV events sent the
//! way vLLM sends them, so KV-aware routers (Dynamo, llm-d and others) that consume
//! vLLM's stream consume kvpage's.
//!
//! - A ZeroMQ PUB socket sends each batch as three frames: the topic, the batch's
//!   sequence number (8 bytes, big-endian; one per batch, from 0) and the MessagePack
//!   payload ([`wire`], in the form [`PublisherConfig::format`] picks).
//! - A ROUTER socket (when [`PublisherConfig::replay_endpoint`] is set) answers replay
//!   requests: a request `[identity, "", start]` (`start` 8 bytes big-endian) gets every
//!   batch from `start` on that the publisher still keeps
//!   ([`PublisherConfig::replay_batches`]), each as `[identity, "", seq, payload]`,
//!   then `[identity, "", -1 (8 bytes), ""]`.
//! - Nothing waits on the network on the cache's side: [`EventPublisher::publish_from`]
//!   drains the cache's event ring into a batch and hands it to the publisher's own
//!   thread through a bounded queue without blocking. When the ring overflowed (the
//!   cache lost events before the drain) or an earlier batch found the queue full, the
//!   next batch resynchronises subscribers instead: `AllBlocksCleared` followed by a
//!   `BlockStored` for every registered block, parents first
//!   ([`crate::KvCache::events_snapshot`]). [`EventPublisher::publish_snapshot`] sends
//!   the same for a router that starts cold.
//!
//! Bind to the addresses your routers reach; the tests bind loopback only.

pub mod wire;

use std::collections::VecDeque;
use std::fmt;
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::cache::{CacheEvent, KvCache};
pub use wire::WireFormat;

/// How an [`EventPublisher`] sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherConfig {
    /// Address the PUB socket binds, e.g. `tcp://127.0.0.1:5557` (`tcp://127.0.0.1:*`
    /// picks a free port: see [`EventPublisher::endpoint`]).
    pub endpoint: String,
    /// Address the replay ROUTER socket binds; `None` for no replay.
    pub replay_endpoint: Option<String>,
    /// The first frame of every message (vLLM's default is empty).
    pub topic: String,
    /// The `data_parallel_rank` of every batch.
    pub data_parallel_rank: u32,
    /// The MessagePack form of the payload.
    pub format: WireFormat,
    /// Batches kept for replay requests.
    pub replay_batches: usize,
    /// Batches queued for the publisher thread before [`EventPublisher::publish_from`]
    /// stops queueing (and resynchronises once there is room again).
    pub queue_batches: usize,
}

impl PublisherConfig {
    /// PUB on `endpoint`, no replay, empty topic, rank 0, the tagged-map form, 10,000
    /// batches kept for replay and 1,024 queued. O(1).
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            data_parallel_rank: 0,
            format: WireFormat::TaggedMap,
            replay_batches: 10_000,
            queue_batches: 1_024,
        }
    }
}

/// Why [`EventPublisher::start`] failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishError {
    /// What was being done: "socket", "bind PUB", "bind ROUTER", "thread".
    pub action: &'static str,
    /// ZeroMQ's (or the OS's) message.
    pub message: String,
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KV event publisher: {}: {}", self.action, self.message)
    }
}

impl std::error::Error for PublishError {}

fn fail(action: &'static str) -> impl Fn(zmq::Error) -> PublishError {
    move |e| PublishError {
        action,
        message: e.to_string(),
    }
}

/// What one [`EventPublisher::publish_from`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Published {
    /// Events in the batch handed to the publisher thread (0: nothing to send).
    pub events: usize,
    /// The batch resynchronises (`AllBlocksCleared` and a snapshot).
    pub resync: bool,
    /// The queue was full: nothing was handed over, the next batch resynchronises.
    pub dropped: bool,
}

/// A running publisher: its sockets live on its own thread. Dropping it (or
/// [`EventPublisher::shutdown`]) sends what is queued and stops the thread.
#[derive(Debug)]
pub struct EventPublisher {
    queue: Option<SyncSender<Vec<CacheEvent>>>,
    thread: Option<JoinHandle<()>>,
    endpoint: String,
    replay_endpoint: Option<String>,
    /// The next batch must resynchronise subscribers.
    resync: bool,
    batches: u64,
}

impl EventPublisher {
    /// Binds the sockets (on the calling thread, so a bad address fails here) and
    /// starts the publisher thread. O(1).
    ///
    /// # Errors
    /// [`PublishError`] when a socket cannot be made or bound, or the thread cannot be
    /// started.
    pub fn start(config: PublisherConfig) -> Result<Self, PublishError> {
        let ctx = zmq::Context::new();
        let publisher = ctx.socket(zmq::PUB).map_err(fail("socket"))?;
        publisher.set_linger(1_000).map_err(fail("socket"))?;
        publisher.bind(&config.endpoint).map_err(fail("bind PUB"))?;
        let endpoint = last_endpoint(&publisher);
        let replay = match &config.replay_endpoint {
            None => None,
            Some(at) => {
                let s = ctx.socket(zmq::ROUTER).map_err(fail("socket"))?;
                s.set_linger(0).map_err(fail("socket"))?;
                s.bind(at).map_err(fail("bind ROUTER"))?;
                Some(s)
            }
        };
        let replay_endpoint = replay.as_ref().map(last_endpoint);
        let (queue, rx) = mpsc::sync_channel(config.queue_batches.max(1));
        let worker = Worker {
            publisher,
            replay,
            topic: config.topic.into_bytes(),
            rank: config.data_parallel_rank,
            format: config.format,
            keep: config.replay_batches,
            kept: VecDeque::new(),
            next_seq: 0,
            _ctx: ctx,
        };
        let thread = std::thread::Builder::new()
            .name("kvpage-events".into())
            .spawn(move || worker.run(rx))
            .map_err(|e| PublishError {
                action: "thread",
                message: e.to_string(),
            })?;
        Ok(Self {
            queue: Some(queue),
            thread: Some(thread),
            endpoint,
            replay_endpoint,
            resync: false,
            batches: 0,
        })
    }

    /// The address the PUB socket is bound to (with the port it picked). O(1).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The address the replay socket is bound to, if any. O(1).
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Batches handed to the publisher thread so far: the next one gets this sequence
    /// number. O(1).
    pub fn batches(&self) -> u64 {
        self.batches
    }

    /// Drains `cache`'s events and hands them to the publisher thread as one batch,
    /// never blocking: see the module docs for the resynchronising batch sent after an
    /// overflow of the cache's ring or of the queue. An empty drain sends nothing.
    /// O(events × block size), O(num_blocks × chain depth) when it resynchronises.
    pub fn publish_from(&mut self, cache: &mut KvCache) -> Published {
        let batch = cache.drain_events(usize::MAX);
        let resync = self.resync || batch.lost > 0;
        let events = match resync {
            true => resync_events(cache),
            false => batch.events,
        };
        self.send(events, resync)
    }

    /// Hands the publisher thread `AllBlocksCleared` and a `BlockStored` for every
    /// registered block of `cache`, parents first: for a router that starts cold.
    /// Moves `cache`'s drain past its pending events (the snapshot contains them).
    /// O(num_blocks × chain depth).
    pub fn publish_snapshot(&mut self, cache: &mut KvCache) -> Published {
        cache.drain_events(usize::MAX);
        let events = resync_events(cache);
        self.send(events, true)
    }

    fn send(&mut self, events: Vec<CacheEvent>, resync: bool) -> Published {
        let n = events.len();
        if n == 0 {
            return Published::default();
        }
        let Some(queue) = &self.queue else {
            return Published::default();
        };
        match queue.try_send(events) {
            Ok(()) => {
                self.resync = false;
                self.batches += 1;
                Published {
                    events: n,
                    resync,
                    dropped: false,
                }
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.resync = true;
                Published {
                    events: 0,
                    resync,
                    dropped: true,
                }
            }
        }
    }

    /// Sends what is queued, then stops the thread and closes the sockets (waiting up
    /// to a second for subscribers to take the last messages). O(queued batches).
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.queue = None;
        if let Some(t) = self.thread.take() {
            // A panic on the publisher thread has nothing left to report.
            let _ = t.join();
        }
    }
}

impl Drop for EventPublisher {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `AllBlocksCleared` and every registered block of `cache`, parents first.
fn resync_events(cache: &KvCache) -> Vec<CacheEvent> {
    let snapshot = cache.events_snapshot();
    let mut events = Vec::with_capacity(snapshot.len() + 1);
    events.push(CacheEvent::Cleared);
    events.extend(snapshot.into_iter().map(CacheEvent::Stored));
    events
}

fn last_endpoint(s: &zmq::Socket) -> String {
    match s.get_last_endpoint() {
        Ok(Ok(at)) => at,
        _ => String::new(),
    }
}

/// The publisher thread's state: the sockets, and the batches kept for replay.
struct Worker {
    publisher: zmq::Socket,
    replay: Option<zmq::Socket>,
    topic: Vec<u8>,
    rank: u32,
    format: WireFormat,
    keep: usize,
    kept: VecDeque<(u64, Vec<u8>)>,
    next_seq: u64,
    /// Outlives the sockets (declared last, dropped last).
    _ctx: zmq::Context,
}

/// The reply that ends a replay: sequence number -1.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

impl Worker {
    /// Publishes queued batches and answers replay requests until the queue closes.
    fn run(mut self, rx: mpsc::Receiver<Vec<CacheEvent>>) {
        loop {
            match rx.recv_timeout(Duration::from_millis(2)) {
                Ok(events) => self.publish(&events),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            self.serve_replays();
        }
        self.serve_replays();
    }

    fn publish(&mut self, events: &[CacheEvent]) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = wire::encode_batch(self.format, ts, events, self.rank);
        let seq = self.next_seq;
        self.next_seq += 1;
        let frames: [&[u8]; 3] = [&self.topic, &seq.to_be_bytes(), &payload];
        // A PUB socket drops what no subscriber takes; a failed send is a lost batch,
        // which subscribers see as a gap and replay.
        let _ = self.publisher.send_multipart(frames, 0);
        if self.keep > 0 {
            if self.kept.len() == self.keep {
                self.kept.pop_front();
            }
            self.kept.push_back((seq, payload));
        }
    }

    /// Answers every waiting replay request.
    fn serve_replays(&mut self) {
        let Some(replay) = &self.replay else {
            return;
        };
        while replay.poll(zmq::POLLIN, 0).unwrap_or(0) > 0 {
            let Ok(frames) = replay.recv_multipart(0) else {
                return;
            };
            let [id, _, start] = &frames[..] else {
                continue;
            };
            let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(u64::from_be_bytes) else {
                continue;
            };
            for (seq, payload) in self.kept.iter().filter(|(s, _)| *s >= start) {
                let frames: [&[u8]; 4] = [id, b"", &seq.to_be_bytes(), payload];
                let _ = replay.send_multipart(frames, 0);
            }
            let end: [&[u8]; 4] = [id, b"", &END_SEQ, b""];
            let _ = replay.send_multipart(end, 0);
        }
    }
}
