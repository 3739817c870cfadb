//! The replay's multi-replica mode: routers that assign each arriving request to one of
//! N replicas ([`crate::sim::run_fleet`]), and the fleet's summary.
//!
//! The prefix-aware router knows what each replica caches only from that replica's KV
//! cache events ([`BlockManager::events_since`]), the stream a KV-aware router of a real
//! fleet consumes: it never hashes a token. Per replica it keeps an index from (parent,
//! block token ids) to the block's hash, where the parent is the chain root of the
//! request's namespace for a chain's first block (`StoredBlock::parent` is `None`) and the
//! parent block's hash otherwise. A request's whole prompt blocks are walked through
//! every replica's index; the longest cached prefix wins, ties go to the replica with
//! fewer requests in flight, and with no match anywhere the least-loaded replica (lowest
//! index among equals) gets it.
//!
//! Timing: each replica steps on its own clock up to a request's arrival before the
//! request is routed, so the router sees every step that started before the arrival
//! (a step in progress at the arrival counts as done: its blocks are already in the
//! events, a step's length early).

use std::collections::HashMap;

use kvpage_core::{BlockManager, KvEvent};

use crate::metrics::percentile;
use crate::sim::{Router, RunOutput};
use crate::trace::Request;

/// Which router a fleet runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterKind {
    /// Request `i` to replica `i mod N`.
    RoundRobin,
    /// To the replica caching the longest prefix of the prompt (from its KV events).
    PrefixAware,
}

impl RouterKind {
    /// Its command-line name. O(1).
    pub fn name(self) -> &'static str {
        match self {
            RouterKind::RoundRobin => "round-robin",
            RouterKind::PrefixAware => "prefix-aware",
        }
    }

    /// A router of this kind for `replicas` replicas whose prefix cache blocks hold
    /// `block_size` tokens. O(replicas).
    pub fn build(self, replicas: usize, block_size: u32) -> Box<dyn Router> {
        match self {
            RouterKind::RoundRobin => Box::new(RoundRobin { next: 0 }),
            RouterKind::PrefixAware => prefix_aware(replicas, block_size, EVENT_CAPACITY),
        }
    }
}

/// The prefix-aware router for `replicas` replicas with `block_size`-token blocks, each
/// replica's manager keeping `event_capacity` events (at least 1; a ring that overflows
/// between two steps costs a snapshot, counted by [`Router::resyncs`]). O(replicas).
pub fn prefix_aware(replicas: usize, block_size: u32, event_capacity: u32) -> Box<dyn Router> {
    Box::new(PrefixAware {
        replicas: (0..replicas).map(|_| ReplicaIndex::default()).collect(),
        block_size: block_size.max(1) as usize,
        event_capacity: event_capacity.max(1),
        resyncs: 0,
    })
}

/// Request `i` to replica `i mod N`.
struct RoundRobin {
    next: usize,
}

impl Router for RoundRobin {
    fn event_capacity(&self) -> u32 {
        0
    }

    fn observe(&mut self, _: usize, _: &BlockManager<'_>) {}

    fn route(&mut self, _: &[u32], _: u64, loads: &[usize]) -> usize {
        let k = self.next % loads.len().max(1);
        self.next = k + 1;
        k
    }
}

/// Where a block hangs in a replica's index: a chain root (its namespace) or after the
/// block with this hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Parent {
    Root(u64),
    Block(u64),
}

/// What one replica caches, rebuilt from its events alone.
#[derive(Default)]
struct ReplicaIndex {
    /// (parent, token ids) → (block hash, blocks registered with that key).
    children: HashMap<Parent, HashMap<Vec<u32>, (u64, u32)>>,
    /// Physical block → where it sits in `children` (removals name only the block).
    blocks: HashMap<u32, (Parent, Vec<u32>)>,
    /// Next event sequence number to read.
    next_seq: u64,
}

impl ReplicaIndex {
    fn store(&mut self, block: u32, parent: Parent, tokens: &[u32], hash: u64) {
        self.remove(block);
        let e = self
            .children
            .entry(parent)
            .or_default()
            .entry(tokens.to_vec())
            .or_insert((hash, 0));
        *e = (hash, e.1 + 1);
        self.blocks.insert(block, (parent, tokens.to_vec()));
    }

    fn remove(&mut self, block: u32) {
        let Some((parent, tokens)) = self.blocks.remove(&block) else {
            return;
        };
        if let Some(m) = self.children.get_mut(&parent) {
            if let Some(e) = m.get_mut(&tokens) {
                e.1 -= 1;
                if e.1 == 0 {
                    m.remove(&tokens);
                }
            }
            if m.is_empty() {
                self.children.remove(&parent);
            }
        }
    }

    fn clear(&mut self) {
        self.children.clear();
        self.blocks.clear();
    }

    /// Whole blocks of `prompt` (blocks of `block_size`) cached from its start.
    /// O(blocks).
    fn matched_blocks(&self, prompt: &[u32], namespace: u64, block_size: usize) -> usize {
        let mut parent = Parent::Root(namespace);
        let mut n = 0;
        for chunk in prompt.chunks_exact(block_size) {
            match self.children.get(&parent).and_then(|m| m.get(chunk)) {
                Some(&(hash, _)) => {
                    parent = Parent::Block(hash);
                    n += 1;
                }
                None => break,
            }
        }
        n
    }
}

fn parent_of(namespace: u64, parent: Option<u32>, parent_hash: u64) -> Parent {
    match parent {
        None => Parent::Root(namespace),
        Some(_) => Parent::Block(parent_hash),
    }
}

/// The prefix-aware router (see the module documentation).
struct PrefixAware {
    replicas: Vec<ReplicaIndex>,
    block_size: usize,
    event_capacity: u32,
    /// Times a replica's ring had overwritten events before they were read and its index
    /// was rebuilt from a snapshot ([`BlockManager::stored_block`]).
    resyncs: u64,
}

/// Event ring entries per replica: more than one step ever records (a step registers
/// at most its token budget's worth of blocks, plus as many evictions).
const EVENT_CAPACITY: u32 = 1 << 14;

impl Router for PrefixAware {
    fn event_capacity(&self) -> u32 {
        self.event_capacity
    }

    fn observe(&mut self, replica: usize, kv: &BlockManager<'_>) {
        let Some(ix) = self.replicas.get_mut(replica) else {
            return;
        };
        let events = match kv.events_since(ix.next_seq) {
            Ok(e) if e.lost() == 0 => e,
            _ => {
                // Missed events: start again from the cache's current state.
                self.resyncs += 1;
                ix.clear();
                for b in 0..kv.config().num_blocks {
                    if let Some(s) = kv.stored_block(b) {
                        let p = parent_of(s.namespace, s.parent, s.parent_hash);
                        ix.store(s.block, p, s.tokens, s.hash);
                    }
                }
                ix.next_seq = kv.next_event_seq();
                return;
            }
        };
        ix.next_seq = events.end_seq();
        for (_, ev) in events {
            match ev {
                KvEvent::Stored(s) => {
                    let p = parent_of(s.namespace, s.parent, s.parent_hash);
                    ix.store(s.block, p, s.tokens, s.hash);
                }
                KvEvent::Removed(r) => ix.remove(r.block),
                KvEvent::Cleared => ix.clear(),
            }
        }
    }

    fn resyncs(&self) -> u64 {
        self.resyncs
    }

    fn route(&mut self, prompt: &[u32], namespace: u64, loads: &[usize]) -> usize {
        let bs = self.block_size;
        (0..loads.len())
            .map(|k| {
                let m = self
                    .replicas
                    .get(k)
                    .map_or(0, |ix| ix.matched_blocks(prompt, namespace, bs));
                (k, m)
            })
            // Longest match, then fewest in flight, then lowest index.
            .min_by_key(|&(k, m)| (std::cmp::Reverse(m), loads[k], k))
            .map_or(0, |(k, _)| k)
    }
}

/// A fleet run, summed over its replicas.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetSummary {
    /// The router.
    pub router: RouterKind,
    /// Prompt tokens served from the replicas' prefix caches.
    pub prefix_hit_tokens: u64,
    /// Prompt tokens of every request.
    pub prompt_tokens: u64,
    /// Mean time to first token (s).
    pub ttft_mean_s: f64,
    /// Median TTFT (s).
    pub ttft_p50_s: f64,
    /// 99th percentile TTFT (s).
    pub ttft_p99_s: f64,
    /// Generated tokens over the fleet's makespan (the last replica's).
    pub tokens_per_s: f64,
    /// Requests each replica served.
    pub per_replica: Vec<u64>,
    /// Times a replica's event ring overflowed and the router rebuilt that replica's
    /// index from a snapshot.
    pub resyncs: u64,
}

impl FleetSummary {
    /// Sums the replicas' outputs of a run of `requests`. O(replicas × requests).
    pub fn new(router: RouterKind, requests: &[Request], outs: &[RunOutput], resyncs: u64) -> Self {
        let mut ttft: Vec<f64> = requests
            .iter()
            .map(|r| {
                let first = outs
                    .iter()
                    .map(|o| o.outcomes[r.id as usize])
                    .find(|o| o.completions > 0)
                    .map_or(f64::NAN, |o| o.first_token_s);
                first - r.arrival_s
            })
            .collect();
        ttft.sort_by(f64::total_cmp);
        let makespan = outs
            .iter()
            .map(|o| o.report.extra.makespan_s)
            .fold(0.0, f64::max);
        let generated: u64 = outs.iter().map(|o| o.report.extra.generated_tokens).sum();
        Self {
            router,
            prefix_hit_tokens: outs.iter().map(|o| o.report.prefix_hit_tokens).sum(),
            prompt_tokens: requests.iter().map(|r| u64::from(r.prompt_tokens)).sum(),
            ttft_mean_s: ttft.iter().sum::<f64>() / ttft.len().max(1) as f64,
            ttft_p50_s: percentile(&ttft, 50.0),
            ttft_p99_s: percentile(&ttft, 99.0),
            tokens_per_s: generated as f64 / makespan,
            per_replica: outs.iter().map(|o| o.report.completed).collect(),
            resyncs,
        }
    }
}

/// The side-by-side table of fleet runs.
pub fn table(rows: &[FleetSummary]) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = write!(o, "{:<26}", "router");
    for r in rows {
        let _ = write!(o, "{:>20}", r.router.name());
    }
    o.push('\n');
    o.push_str(&"-".repeat(26 + 20 * rows.len()));
    o.push('\n');
    let mut line = |label: &str, f: &dyn Fn(&FleetSummary) -> String| {
        let _ = write!(o, "{label:<26}");
        for r in rows {
            let _ = write!(o, "{:>20}", f(r));
        }
        o.push('\n');
    };
    line("prefix hit tokens", &|r| r.prefix_hit_tokens.to_string());
    line("prefix hit rate", &|r| {
        format!(
            "{:.1}%",
            100.0 * r.prefix_hit_tokens as f64 / r.prompt_tokens.max(1) as f64
        )
    });
    line("TTFT mean (s)", &|r| format!("{:.3}", r.ttft_mean_s));
    line("TTFT p50 (s)", &|r| format!("{:.3}", r.ttft_p50_s));
    line("TTFT p99 (s)", &|r| format!("{:.3}", r.ttft_p99_s));
    line("generated tokens/s", &|r| format!("{:.1}", r.tokens_per_s));
    line("requests per replica", &|r| {
        r.per_replica
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join("/")
    });
    line("event ring resyncs", &|r| r.resyncs.to_string());
    o
}
