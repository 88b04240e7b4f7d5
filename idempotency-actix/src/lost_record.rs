//! A lost in-flight record: the incident of a request whose handler ran while its record
//! vanished from the store (evicted under memory pressure, deleted by hand, or expired while
//! the store was unreachable). A retry may then run the handler a second time, so it is
//! logged as an error and counted, once per request, in this one place. Where the key is
//! free when the commit comes (no request holds it), the stores write the completed record
//! anew, which is logged here too.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::scope::StorageKey;

/// Lost in-flight records noticed by this process, every app and worker included.
static LOST_RECORDS: AtomicU64 = AtomicU64::new(0);

/// The step that noticed the loss.
#[derive(Debug, Clone, Copy)]
pub(crate) enum NoticedBy {
    /// A lease renewal answered "not held".
    Renewal,
    /// The commit answered "not held".
    Commit,
}

impl NoticedBy {
    fn as_str(self) -> &'static str {
        match self {
            Self::Renewal => "renewal",
            Self::Commit => "commit",
        }
    }
}

/// Logs and counts one lost record. The key digest is logged at debug level only, like
/// every other storage key.
pub(crate) fn report(storage_key: &StorageKey, noticed_by: NoticedBy) {
    LOST_RECORDS.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(
        key = storage_key.as_str(),
        "idempotency: the lost record's storage key"
    );
    tracing::error!(
        noticed_by = noticed_by.as_str(),
        "idempotency: in-flight record lost while its handler ran (evicted or deleted); \
         a retry may run the handler again. On Redis: run it with `maxmemory-policy \
         noeviction` and memory headroom (see the README)"
    );
}

/// Logs a commit that found its in-flight record lost and the key free (nothing there, an
/// expired record, or another token's marker), and wrote the completed record anew: a retry
/// gets the replay.
pub(crate) fn report_written_anew() {
    tracing::warn!(
        "idempotency: in-flight record lost while its handler ran, and the key was free at \
         its commit: the completed record is written anew, so a retry gets the replay"
    );
}

/// How many lost records this process has noticed since it started.
pub(crate) fn total() -> u64 {
    LOST_RECORDS.load(Ordering::Relaxed)
}
