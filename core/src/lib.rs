//! # kvpage-core
//!
//! The `#![no_std]`, allocation-free heart of kvpage, a paged KV-cache runtime: model
//! [`Geometry`], a block pool with a hierarchical free bitset, dense page tables,
//! sequences with generation-checked handles, copy-on-write, and a verified prefix cache,
//! all over storage the caller provides.
//!
//! ```
//! use kvpage_core::{BlockManager, Config};
//! const CONFIG: Config = Config {
//!     num_blocks: 64,
//!     block_size: 16,
//!     max_seqs: 8,
//!     max_blocks_per_seq: 16,
//!     instance: 1,
//!     hash_key: 0,
//!     prefix_cache: true,
//!     max_position_runs: 4,
//!     max_namespaces: 0,
//!     event_capacity: 0,
//! };
//! let mut storage = [0u64; CONFIG.storage_words()];
//! let mut kv = BlockManager::new(CONFIG, &mut storage).unwrap();
//! let seq = kv.create(0).unwrap();
//! let mut slots = [0u32; 20];
//! kv.append_tokens(seq, &[7; 20], &mut slots).unwrap();
//! assert_eq!(kv.blocks(seq).unwrap(), &[0, 1]);
//! assert_eq!(slots[19], 1 * 16 + 3);
//! // ... the backend writes the K/V of those 20 slots, then:
//! kv.commit(seq, 20).unwrap(); // block 0 is full: now other prompts can share it
//! let other = kv.create_with_prompt(0, &[7; 18], &mut slots).unwrap();
//! assert_eq!(other.reused_tokens, 16);
//! ```
//!
//! A sequence's life: [`BlockManager::create_with_prompt`] (or [`BlockManager::create`]
//! and appends) returns the slot of each new token; the backend executes any reported
//! [`BlockCopy`] and writes the K/V there; [`BlockManager::commit`] then offers the full
//! blocks to the prefix cache; [`BlockManager::block_table`] and
//! [`BlockManager::seq_lens`] are what attention kernels read. Long conversations edit
//! their sequences in `llama.h`'s spirit ([`BlockManager::remove_range`],
//! [`BlockManager::shift_positions`], [`BlockManager::copy_range`],
//! [`BlockManager::release_all_except`], [`BlockManager::context_shift`]); the backend
//! executes the [`BlockCopy`]s and [`RowMove`]s they report, and each token's rotary
//! position is [`BlockManager::position`] (its index until an edit says otherwise).
//!
//! After [`BlockManager::new`] no operation allocates or panics on caller input; every
//! misuse is a typed error ([`SeqError`], [`InitError`], [`GeometryError`]) and a failed
//! operation changes nothing.

#![no_std]
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod config;
pub mod engine;
mod error;
mod events;
mod geometry;
mod host_tier;
pub mod index_set;
mod log;
mod manager;
mod prefix;
mod quota_plan;
mod retention;
pub mod scheduler;
mod shared;
mod stats;
mod storage;

pub use config::{Config, DEFAULT_POSITION_RUNS, MAX_NAMESPACES, MAX_POSITION_RUNS};
pub use engine::{
    Engine, EngineConfig, EngineError, EngineStats, FinishReason, Finished, FinishedRequests,
    RequestId, RequestState, Sampled, ScheduledSeq, Step,
};
pub use error::{EventError, GeometryError, ImportError, InitError, QuotaError, SeqError};
pub use events::{Events, KvEvent, RemovedBlock, StoredBlock};
pub use geometry::{DType, Geometry};
pub use host_tier::HostPool;
pub use index_set::IndexSet;
pub use manager::{
    Appended, BlockCopy, BlockManager, ContextShift, CopiedRange, Edited, Imported, NamespaceQuota,
    PositionRun, PrefixHit, PromptStart, RegisteredBlock, RowMove, SeqId,
};
pub use retention::Priority;
pub use scheduler::{
    schedule, schedule_with, Action, Preemption, RunningSeq, ScheduleError, SchedulerConfig,
    StepInput, StepPlan, SwappedSeq, WaitingSeq,
};
pub use shared::SharedManager;
pub use stats::Stats;
