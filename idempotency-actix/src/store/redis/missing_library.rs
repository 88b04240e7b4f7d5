//! [`MissingLibrary`]: what a store remembers of a connection that found the functions
//! missing and could not load them, so that it opens another once per
//! [`RETRY_INTERVAL`] at most, not once per request.
//!
//! Such a connection is not used (see [`protocol::load_library_ahead`]): the request that
//! opened it is refused (503 when failing closed) before any handler runs. Every keyed
//! request needs a connection, so without a memory of that failure each one would open a
//! connection of its own, send `FUNCTION LOAD` and the probe again, and log the error: under
//! traffic, a storm of connections against the server and a flood in the log. With it, the
//! requests of the next interval are refused the same way at once, with no connection
//! opened, no command sent and nothing logged by the store; the first request after it
//! opens a connection again, so requests are served within one interval of someone
//! loading the functions.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::protocol::{self, Library, LibraryProbe};
use crate::store::StoreError;

/// How long a store refuses keyed requests without opening a connection after one found
/// the functions missing and could not load them: about one connection, `FUNCTION LOAD`
/// and error line per second for each store (one per worker), and requests served at most
/// a second after the functions are loaded.
pub(crate) const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// Why a connection was not used: the server lacks the store's functions and the
/// connection may not load them, or its user may not call them at all. The error of every
/// request refused for it.
#[derive(Clone, Debug)]
pub(crate) struct LibraryMissing(Arc<str>);

impl LibraryMissing {
    /// The server lacks the functions and `error` was this connection's `FUNCTION LOAD` (or
    /// the step that needed them): logged once here, for whoever must load them.
    pub(crate) fn found(error: &redis::RedisError) -> Self {
        tracing::error!(
            %error,
            "idempotency: the Redis server lacks this crate's functions and this connection may \
             not load them (FUNCTION LOAD): keyed requests are refused until they are loaded \
             (the store looks again once a second); grant the user FUNCTION LOAD, or connect \
             once as a user who has it"
        );
        Self(
            format!(
                "the Redis server lacks the store's functions and FUNCTION LOAD failed: {error}"
            )
            .into(),
        )
    }

    /// The connection's user may not call functions (`FCALL`, refused with `error`), so no
    /// step could be fenced whether the server has them or not: logged once here.
    pub(crate) fn forbidden(error: &redis::RedisError) -> Self {
        tracing::error!(
            %error,
            "idempotency: this connection's Redis user may not call this crate's functions \
             (FCALL): no commit, lease renewal or release could be fenced, so keyed requests \
             are refused (the store looks again once a second); grant the user FCALL"
        );
        Self(format!("the Redis user may not call the store's functions: {error}").into())
    }

    fn store_error(&self) -> StoreError {
        StoreError::Unavailable(Box::new(self.clone()))
    }
}

/// Whether `error` is the refusal of a connection that found the functions missing (see
/// [`MissingLibrary::open`]), marked as never sent or not.
pub(crate) fn is_missing(error: &StoreError) -> bool {
    error
        .unavailable_source()
        .is_some_and(|source| source.is::<LibraryMissing>())
}

impl std::fmt::Display for LibraryMissing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LibraryMissing {}

/// The last time a connection of a store found the functions missing, and why.
#[derive(Default)]
pub(crate) struct MissingLibrary {
    found: Mutex<Option<(Instant, LibraryMissing)>>,
    /// How many times a connection found the functions missing: connections kept from
    /// before (spares) are not used after.
    times_found: AtomicU64,
}

impl MissingLibrary {
    /// A connection from `open` with the functions loaded ahead
    /// ([`protocol::load_library_ahead`]); or, within [`RETRY_INTERVAL`] of a connection
    /// that found them missing and could not load them, that connection's error at once,
    /// with `open` left unpolled (no connection opened).
    pub(crate) async fn open<C, Opened>(&self, open: Opened) -> Result<C, StoreError>
    where
        C: LibraryProbe,
        Opened: Future<Output = Result<C, StoreError>>,
    {
        if let Some(missing) = self.recent(Instant::now()) {
            return Err(missing.store_error());
        }
        let mut connection = open.await?;
        match protocol::load_library_ahead(&mut connection).await {
            Ok(()) => {
                *self.lock() = None;
                Ok(connection)
            }
            Err(missing) => {
                let error = missing.store_error();
                *self.lock() = Some((Instant::now(), missing));
                self.times_found.fetch_add(1, Ordering::Relaxed);
                Err(error)
            }
        }
    }

    /// After a function step failed with `error` on a connection already in use: whether
    /// the server lacks the functions (deleted under the connection, by `FUNCTION FLUSH`
    /// say, for a user who may not load them again), or its user may no longer call them
    /// (its ACL changed). If so, that is logged and remembered as when a connection finds
    /// them missing as it opens, and the caller drops the connection: keyed requests are
    /// refused before any handler runs, rather than each running its handler with nothing
    /// to fence its commit, renew its lease or give its key back. A refusal for memory
    /// (`OOM`) or for a key of another type (`WRONGTYPE`) is not looked into.
    pub(crate) async fn missing_after(
        &self,
        connection: &mut impl LibraryProbe,
        error: &redis::RedisError,
    ) -> bool {
        if error
            .code()
            .is_none_or(|code| code == "OOM" || code == "WRONGTYPE")
        {
            return false;
        }
        let missing = match connection.probe_library().await {
            Library::Missing => LibraryMissing::found(error),
            Library::Forbidden(refusal) => LibraryMissing::forbidden(&refusal),
            Library::Callable => return false,
        };
        *self.lock() = Some((Instant::now(), missing));
        self.times_found.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// How many times a connection found the functions missing so far.
    pub(crate) fn times_found(&self) -> u64 {
        self.times_found.load(Ordering::Relaxed)
    }

    /// The error of a connection that found the functions missing less than
    /// [`RETRY_INTERVAL`] before `now`.
    fn recent(&self, now: Instant) -> Option<LibraryMissing> {
        match &*self.lock() {
            Some((found, missing)) if now.saturating_duration_since(*found) < RETRY_INTERVAL => {
                Some(missing.clone())
            }
            _ => None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(Instant, LibraryMissing)>> {
        self.found
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_remembered_for_the_retry_interval() {
        let memory = MissingLibrary::default();
        let found = Instant::now();
        assert!(memory.recent(found).is_none(), "nothing found yet");
        *memory.lock() = Some((found, LibraryMissing("missing".into())));
        let recent = memory
            .recent(found + RETRY_INTERVAL / 2)
            .expect("remembered");
        assert_eq!(recent.to_string(), "missing");
        assert!(memory.recent(found + RETRY_INTERVAL).is_none(), "forgotten");
    }
}
