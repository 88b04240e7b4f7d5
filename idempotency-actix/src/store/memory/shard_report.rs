//! [`ShardReport`]: what one operation on a shard has to say, said once the shard's lock is
//! released.

use std::time::Instant;

use crate::log_interval::LogInterval;
use crate::lost_record;

/// How a response was cut to fit in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Trimmed {
    /// Completed without its body.
    Body,
    /// Completed with its status alone (its headers did not fit either).
    Headers,
}

/// What happened under a shard's lock that is counted or logged: collected by the shard,
/// taken with [`Shard::take_report`](super::shard::Shard::take_report), and acted on after
/// the lock is released, so that no other request on the shard waits for a log line to be
/// written.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct ShardReport {
    /// Live completed records evicted before their ttl (markers of abandoned tokens are not
    /// records: no retry runs again for their loss).
    pub(super) evictions: u64,
    /// A response cut to fit.
    pub(super) trimmed: Option<Trimmed>,
    /// A completed record written anew where its in-flight record was gone.
    pub(super) written_anew: bool,
}

impl ShardReport {
    /// Logs what this report holds, but evictions (the store's
    /// [`EvictionLog`](super::eviction_log::EvictionLog) counts and rate-limits those); a
    /// response cut to fit is logged when `trimmed` admits it at `now` (with how many were
    /// not since the last).
    pub(super) fn log(&self, max_bytes: usize, trimmed: &LogInterval, now: Instant) {
        if let Some(cut) = self.trimmed
            && let Some(unlogged) = trimmed.admit(now)
        {
            match cut {
                Trimmed::Body => tracing::warn!(
                    max_bytes,
                    unlogged,
                    "idempotency: a response did not fit in the memory store; completed without its body"
                ),
                Trimmed::Headers => tracing::warn!(
                    max_bytes,
                    unlogged,
                    "idempotency: a response's headers did not fit in the memory store; completed with its status alone"
                ),
            }
        }
        if self.written_anew {
            lost_record::report_written_anew();
        }
    }
}
