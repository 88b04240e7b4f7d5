//! [`Spares`]: connections lent to one exchange at a time, for exchanges that block their
//! connection.
//!
//! `WAIT` blocks the connection it runs on until the replicas acknowledge: Redis reads
//! nothing else from that connection meanwhile. On the store's shared connection, the
//! replicated writes of concurrent requests would then reach the replicas one replica
//! round trip after another. So a replicated exchange borrows a connection of its own:
//! an idle one kept from an earlier exchange, or a new one; concurrent `WAIT`s then
//! overlap, and all answer with the same acknowledgement from the replicas.

use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::exchange::{Exchange, Reply};
use super::missing_library::MissingLibrary;
use super::packed::Carrier;
use super::protocol::LibraryProbe;
use super::{missing_library, protocol};
use crate::store::StoreError;

/// How many idle connections are kept for the next exchanges; more are closed after use.
/// Above the concurrency a worker usually sees, so that steady traffic reuses connections
/// instead of opening and closing them (a cluster connection connects to every node).
const MAX_IDLE: usize = 64;

/// Idle connections, each lent to one exchange at a time.
pub(crate) struct Spares<C> {
    idle: Mutex<Vec<C>>,
    /// [`MissingLibrary::times_found`] when the idle connections were last looked at: a
    /// connection kept or lent before the functions were found missing (by any connection
    /// of the store) is not used or kept after.
    times_found: AtomicU64,
}

impl<C: Carrier + LibraryProbe> Spares<C> {
    pub(crate) fn new() -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
            times_found: AtomicU64::new(0),
        }
    }

    /// Sends `exchange` on an idle connection, or on a new one from `open`. An idle one
    /// that turns out dead (Redis restarted or failed over since it was last used; see
    /// [`protocol::connection_is_dead`]) is dropped, and the exchange sent once more on a
    /// new one (every exchange of the protocol is safe to send twice). The connection is
    /// kept for later exchanges unless it failed or enough are kept.
    ///
    /// Where `open` fails and a `fallback` is given (the store's shared connection), the
    /// exchange is sent on that instead, which is not kept: a cluster connection follows the
    /// cluster's nodes once made, while `open` can only ask the seed nodes, which may all be
    /// gone since.
    ///
    /// A function step that finds the store's functions missing (see
    /// [`MissingLibrary::missing_after`]) drops every idle connection: the next exchanges
    /// open theirs anew, which refuses them while the functions are missing; so do those
    /// after any other connection of the store found them missing, and a connection lent
    /// meanwhile is not kept.
    pub(crate) async fn send<Open, Opened>(
        &self,
        exchange: &Exchange,
        open: Open,
        fallback: Option<C>,
        library: &MissingLibrary,
    ) -> Result<Reply, StoreError>
    where
        Open: Fn() -> Opened,
        Opened: Future<Output = Result<C, StoreError>>,
    {
        let (idle, times_found) = {
            let mut idle = self.lock();
            let times_found = library.times_found();
            if self.times_found.swap(times_found, Ordering::Relaxed) != times_found {
                idle.clear();
            }
            (idle.pop(), times_found)
        };
        let (mut connection, reused) = match idle {
            Some(connection) => (connection, true),
            // Nothing sent yet: an error without a fallback is marked so.
            None => match open().await {
                Ok(connection) => (connection, false),
                Err(error) => {
                    return Self::send_on_fallback(exchange, fallback, error.not_sent()).await;
                }
            },
        };
        let mut reply = exchange.send(&mut connection).await;
        if reused && reply.as_ref().is_err_and(protocol::connection_is_dead) {
            connection = match open().await {
                Ok(connection) => connection,
                Err(error) => return Self::send_on_fallback(exchange, fallback, error).await,
            };
            reply = exchange.send(&mut connection).await;
        }
        // One that timed out is not kept either: it may still be blocked in a `WAIT`.
        let broken = reply
            .as_ref()
            .is_err_and(|error| error.is_timeout() || protocol::connection_is_dead(error));
        // Functions found missing here are counted by `library`: this connection is then
        // not kept, and the idle ones are dropped by the next exchange.
        if let Err(error) = &reply
            && !broken
            && exchange.calls_function()
        {
            library.missing_after(&mut connection, error).await;
        }
        if !broken {
            let mut idle = self.lock();
            if idle.len() < MAX_IDLE && library.times_found() == times_found {
                idle.push(connection);
            }
        }
        reply.map_err(protocol::store_error)
    }

    /// Sends `exchange` on `fallback` where no connection could be opened (`error`), unless
    /// the server lacks the store's functions: that refusal stands, however the request
    /// would go (see [`MissingLibrary`](super::missing_library::MissingLibrary)).
    async fn send_on_fallback(
        exchange: &Exchange,
        fallback: Option<C>,
        error: StoreError,
    ) -> Result<Reply, StoreError> {
        let Some(mut connection) = fallback.filter(|_| !missing_library::is_missing(&error)) else {
            return Err(error);
        };
        exchange
            .send(&mut connection)
            .await
            .map_err(protocol::store_error)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<C>> {
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
