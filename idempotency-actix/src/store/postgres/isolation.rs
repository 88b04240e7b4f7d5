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
//! produce, switches to the stricter statements, and the stricter `begin` reports its
//! transaction's isolation, which switches back under READ COMMITTED.

use std::sync::atomic::{AtomicBool, Ordering};

use super::serialization::failed_to_serialize;
use crate::store::StoreError;

/// Whether the store's sessions run a stricter isolation than READ COMMITTED, shared by the
/// clones of a store.
#[derive(Debug, Default)]
pub(super) struct Isolation(AtomicBool);

impl Isolation {
    /// Whether to send the statements for a stricter isolation.
    pub(super) fn strict(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Takes `level` (a value of `transaction_isolation`) as the sessions' isolation.
    pub(super) fn observe(&self, level: &str) {
        // READ UNCOMMITTED runs as READ COMMITTED in PostgreSQL.
        let strict = !matches!(level, "read committed" | "read uncommitted");
        self.0.store(strict, Ordering::Relaxed);
    }

    /// `result`, after taking a serialization failure in it as a sign of a stricter
    /// isolation.
    pub(super) fn noting<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if matches!(&result, Err(error) if failed_to_serialize(error)) {
            self.0.store(true, Ordering::Relaxed);
        }
        result
    }
}
