//! Serialization failures: what the store's statements meet on a database whose default
//! isolation is `REPEATABLE READ` or `SERIALIZABLE`, and how they are run again.
//!
//! The store's protocol is written for READ COMMITTED, where a statement that finds a row
//! committed after its snapshot waits for it and reads it again (or the caller runs it
//! again, see `begin`). Under a stricter default (`default_transaction_isolation`, which an
//! app may set so that its transactional routes run serializable), PostgreSQL instead fails
//! such a statement with SQLSTATE 40001 ("could not serialize access due to concurrent
//! update"): a duplicate whose `begin` met the first request's record just committed got a
//! store error, a 503, or with fail-open a second run of the handler. Every statement of
//! the store is safe to run twice, and a new snapshot (a new statement outside a
//! transaction, a new transaction for a claim) sees the row that stopped the first.

use std::future::Future;

use tokio_postgres::error::SqlState;

use super::error::PostgresError;
use crate::store::StoreError;

/// How many times a step is tried while it fails to serialize: a new snapshot sees the row
/// that stopped the previous try, so a second one succeeds unless rows for the key come and
/// go in between again.
const SERIALIZATION_ATTEMPTS: usize = 4;

/// Whether `error` is PostgreSQL's serialization failure (SQLSTATE 40001).
pub(super) fn failed_to_serialize(error: &StoreError) -> bool {
    PostgresError::of(error).and_then(tokio_postgres::Error::code)
        == Some(&SqlState::T_R_SERIALIZATION_FAILURE)
}

/// Runs `step` (a statement outside a transaction, or a claim with its own transaction)
/// again while it fails to serialize, at most [`SERIALIZATION_ATTEMPTS`] times in all.
pub(super) async fn again_while_unserializable<T, F, Fut>(mut step: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut attempts = 1;
    loop {
        match step().await {
            Err(error) if failed_to_serialize(&error) && attempts < SERIALIZATION_ATTEMPTS => {
                tracing::debug!(%error, "idempotency: PostgreSQL statement failed to serialize; running it again");
                attempts += 1;
            }
            done => return done,
        }
    }
}
