//! The store's errors as they reach a log line or the app: what the server said
//! ([`PostgresError`]), and why the pool gave no connection ([`no_connection`]).
//!
//! tokio-postgres displays an error the server sent as "db error", its words (a missing
//! table, a refused right, a lock timeout) left in the error's source, which neither a log
//! line (`%error`) nor `to_string()` shows; bb8 displays a checkout that timed out as "Timed
//! out in bb8", whether every connection was in use or none could be opened. Every 503 and
//! every error of the inspector or the reaper said "store unavailable: db error" or that.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

use bb8::RunError;

use super::PostgresPool;
use crate::store::StoreError;

/// A tokio-postgres error that displays what the server said: severity, message, SQLSTATE,
/// and the detail and hint where there are some; any other error with its causes. Its
/// source is the tokio-postgres error, which the store's own checks downcast to
/// ([`PostgresError::of`]). Shared: a renewal's error reaches every renewal of its lease that
/// waited for it.
#[derive(Debug)]
pub(super) struct PostgresError(pub(super) Arc<tokio_postgres::Error>);

impl PostgresError {
    /// The tokio-postgres error inside a [`StoreError`] of the store, if there is one.
    pub(super) fn of(error: &StoreError) -> Option<&tokio_postgres::Error> {
        match error {
            StoreError::Unavailable(source) => source
                .downcast_ref::<Self>()
                .map(|PostgresError(error)| &**error),
            _ => None,
        }
    }
}

impl fmt::Display for PostgresError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(db) = self.0.as_db_error() else {
            write!(f, "{}", self.0)?;
            let mut source = self.0.source();
            while let Some(cause) = source {
                write!(f, ": {cause}")?;
                source = cause.source();
            }
            return Ok(());
        };
        write!(
            f,
            "{}: {} (SQLSTATE {})",
            db.severity(),
            db.message(),
            db.code().code()
        )?;
        if let Some(detail) = db.detail() {
            write!(f, "; detail: {detail}")?;
        }
        if let Some(hint) = db.hint() {
            write!(f, "; hint: {hint}")?;
        }
        Ok(())
    }
}

impl Error for PostgresError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.0)
    }
}

/// A store error of a statement that failed with `error`.
pub(super) fn unavailable(error: tokio_postgres::Error) -> StoreError {
    shared_unavailable(Arc::new(error))
}

/// [`unavailable`], for an error shared by several steps (the renewals of one lease).
pub(super) fn shared_unavailable(error: Arc<tokio_postgres::Error>) -> StoreError {
    StoreError::Unavailable(Box::new(PostgresError(error)))
}

/// A store error of a checkout of `pool` that failed with `error`; one that timed out says
/// whether every connection was in use (a pool too small for the transactional requests
/// that hold one each) or none could be opened.
pub(super) fn no_connection(
    pool: &PostgresPool,
    error: RunError<tokio_postgres::Error>,
) -> StoreError {
    match error {
        RunError::User(error) => unavailable(error),
        RunError::TimedOut => {
            let (config, state) = (pool.config(), pool.state());
            let why = if state.connections >= config.max_size && state.idle_connections == 0 {
                format!(
                    "all {} of its connections were in use (a transactional request holds \
                     one for its whole run: make the pool larger than the transactional \
                     requests that can run at once)",
                    config.max_size
                )
            } else {
                "no new one opened in time (the database is unreachable, refuses \
                 connections, or is slow to accept them)"
                    .to_owned()
            };
            StoreError::Unavailable(
                format!(
                    "no PostgreSQL connection from the pool within {:?}: {why}",
                    config.connection_timeout
                )
                .into(),
            )
        }
    }
}
