//! Which `begin` and completion the store sends: the ones written for READ COMMITTED, or
//! the ones for a stricter isolation (`default_transaction_isolation` set to `repeatable
//! read` or `serializable`, for the database, the role or the connection).
//!
//! Under SERIALIZABLE, every read of a transaction is a predicate lock: a claim that read
//! the key's index page even where it had just acquired the key, and a completion that
//! looked the key up again, each locked a page into which the claims of other keys wrote,
//! and most transactional requests for different keys at once failed to serialize at their
//! commit (a 503 after the handler ran). The stricter statements read the record only where
//! the claim did not acquire the key, and complete the claimed row by its `ctid`; under READ
//! COMMITTED they made new keys and replays about 10 % slower, so that path keeps its own.
//!
//! Both sets are correct under either isolation: the choice only weighs speed against
//! serialization failures. It is read with the table's resolution (no round trip of its own),
//! and kept right when sessions change: a serialization failure, which READ COMMITTED does not
//! produce, switches to the stricter statements, and so does a stricter `begin` that reports
//! a stricter transaction. It switches back only once no sign of a stricter isolation has
//! come for [`STRICT_FOR`]: a database made stricter while the app runs keeps the sessions
//! its pool opened before for up to their lifetime, so READ COMMITTED sessions and stricter
//! ones serve side by side meanwhile. Going back at the first READ COMMITTED one met sent the
//! faster statements to the stricter sessions too, and most of their transactional requests
//! for different keys at once failed to serialize at their commit (503s after the handlers
//! ran) until the last old session was replaced.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::serialization::failed_to_serialize;
use crate::store::StoreError;

/// How long the stricter statements stay chosen after the last sign of a stricter isolation:
/// a pooled session's longest life (bb8's `max_lifetime`, 30 min), by which every session
/// opened before the database changed has been replaced.
const STRICT_FOR: Duration = Duration::from_secs(30 * 60);

/// Whether the store's sessions run a stricter isolation than READ COMMITTED, shared by the
/// clones of a store: the time of the last sign of one.
#[derive(Debug)]
pub(super) struct Isolation {
    started: Instant,
    /// When the last sign of a stricter isolation came, in milliseconds since `started`,
    /// plus one; 0 while none has.
    strict_seen_at: AtomicU64,
}

impl Default for Isolation {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            strict_seen_at: AtomicU64::new(0),
        }
    }
}

impl Isolation {
    /// Whether to send the statements for a stricter isolation.
    pub(super) fn strict(&self) -> bool {
        self.strict_at(Instant::now())
    }

    /// Takes `level` (a value of `transaction_isolation`) as a session's isolation.
    pub(super) fn observe(&self, level: &str) {
        // READ UNCOMMITTED runs as READ COMMITTED in PostgreSQL.
        if !matches!(level, "read committed" | "read uncommitted") {
            self.strict_seen(Instant::now());
        }
    }

    /// `result`, after taking a serialization failure in it as a sign of a stricter
    /// isolation.
    pub(super) fn noting<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if matches!(&result, Err(error) if failed_to_serialize(error)) {
            self.strict_seen(Instant::now());
        }
        result
    }

    fn strict_seen(&self, now: Instant) {
        self.strict_seen_at
            .fetch_max(self.millis(now) + 1, Ordering::Relaxed);
    }

    fn strict_at(&self, now: Instant) -> bool {
        match self.strict_seen_at.load(Ordering::Relaxed) {
            0 => false,
            // Saturating: another thread may have seen one a moment after `now`.
            seen => (self.millis(now) + 1).saturating_sub(seen) <= STRICT_FOR.as_millis() as u64,
        }
    }

    fn millis(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.started).as_millis()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stricter_session_keeps_the_stricter_statements_beside_read_committed_ones() {
        let isolation = Isolation::default();
        let start = isolation.started;
        assert!(!isolation.strict_at(start));
        isolation.observe("read committed");
        assert!(
            !isolation.strict(),
            "READ COMMITTED alone keeps the faster statements"
        );
        isolation.strict_seen(start + Duration::from_secs(1));
        // A READ COMMITTED session met next (one the pool opened before) does not undo it.
        isolation.observe("read committed");
        assert!(isolation.strict_at(start + Duration::from_secs(2)));
        assert!(isolation.strict_at(start + Duration::from_secs(1) + STRICT_FOR));
        // Only a whole session lifetime without a sign of a stricter one does.
        assert!(!isolation.strict_at(start + Duration::from_secs(2) + STRICT_FOR));
    }
}
