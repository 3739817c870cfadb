//! Retention in a replay: pinning the shared system prompts and per-tenant quotas.
//!
//! A replay with `tenants > 1` sends request `i` as tenant (namespace) `i % tenants`;
//! only tenant 0's requests start with the shared system prompt of their group (the hot
//! prompt), the other tenants send one-off prompts that compete for the same memory.
//! [`Retention::pin_prefix`] pins the whole blocks of every shared prompt once a
//! request has computed them ([`kvpage_core::Priority::Pinned`]: never evicted), and
//! [`Retention::quota`] gives every tenant the same [`NamespaceQuota`], so the one-off
//! traffic evicts its own cached blocks instead of the hot prompt's.

use kvpage_core::{BlockManager, Config, NamespaceQuota, Priority, QuotaError, SeqId};

/// Retention settings of a replay. The default changes nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Retention {
    /// Tenants the requests are spread over (0 and 1: one).
    pub tenants: u32,
    /// Pin the whole blocks of the shared system prompts.
    pub pin_prefix: bool,
    /// Quota of every tenant.
    pub quota: Option<NamespaceQuota>,
}

impl Retention {
    /// Tenants, at least 1. O(1).
    pub fn tenant_count(&self) -> u32 {
        self.tenants.max(1)
    }

    /// The namespace of request `id`. O(1).
    pub fn namespace(&self, id: u32) -> u64 {
        u64::from(id % self.tenant_count())
    }

    /// Whether request `id` may carry the shared system prompt (tenant 0's do). O(1).
    pub fn shares_prefix(&self, id: u32) -> bool {
        self.namespace(id) == 0
    }

    /// The block manager configuration `core` with room for the quotas. O(1).
    pub fn core_config(&self, core: Config) -> Config {
        Config {
            max_namespaces: if self.quota.is_some() {
                self.tenant_count()
            } else {
                0
            },
            ..core
        }
    }

    /// Sets every tenant's quota on a fresh manager. O(tenants).
    ///
    /// # Errors
    /// The manager's [`QuotaError`] (a reservation the pool cannot cover, say).
    pub fn apply(&self, kv: &mut BlockManager<'_>) -> Result<(), QuotaError> {
        if let Some(q) = self.quota {
            for ns in 0..self.tenant_count() {
                kv.set_namespace_quota(u64::from(ns), q)?;
            }
        }
        Ok(())
    }

    /// Pins the whole blocks of the first `prefix_tokens` tokens of `seq` (what it has
    /// of them so far) when pinning is on. O(blocks of `seq`).
    pub fn pin(&self, kv: &mut BlockManager<'_>, seq: SeqId, prefix_tokens: u32) {
        if !self.pin_prefix {
            return;
        }
        let bs = kv.config().block_size;
        let Ok(len) = kv.len(seq) else { return };
        let end = (prefix_tokens.min(len) / bs) * bs;
        if end > 0 {
            // A live sequence and a range within its length: cannot fail.
            let _ = kv.set_range_priority(seq, 0, end, Priority::Pinned);
        }
    }
}
