//! [`EvictionLog`]: counts evictions and warns about them at most once per interval.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::log_interval::LogInterval;

/// The eviction counter of one store and the rate limit of its warning.
pub(super) struct EvictionLog {
    total: AtomicU64,
    /// The total at the last warning: the next one says how many were evicted since.
    reported: AtomicU64,
    /// At most one warning per `LOG_INTERVAL`.
    warnings: LogInterval,
}

impl EvictionLog {
    pub(super) fn new() -> Self {
        Self {
            total: AtomicU64::new(0),
            reported: AtomicU64::new(0),
            warnings: LogInterval::new(),
        }
    }

    /// How many live completed records were evicted so far.
    pub(super) fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Counts `evicted` evictions and warns if no warning was logged in the last interval.
    /// Called after the shard's lock is released: logging never holds up other requests.
    pub(super) fn record(&self, evicted: u64, max_bytes: usize, now: Instant) {
        if evicted == 0 {
            return;
        }
        crate::instrument::record_evictions(crate::EvictionSource::MemoryStore, evicted);
        let total = self.total.fetch_add(evicted, Ordering::Relaxed) + evicted;
        if self.warnings.admit(now).is_none() {
            return;
        }
        let since_last = total.saturating_sub(self.reported.swap(total, Ordering::Relaxed));
        tracing::warn!(
            evicted = since_last,
            evicted_total = total,
            max_bytes,
            "idempotency: the memory store is full and evicted completed records before their \
             ttl; a retry of an evicted key runs its handler again (raise max_bytes)"
        );
    }
}
