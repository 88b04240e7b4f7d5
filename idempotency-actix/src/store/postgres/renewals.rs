//! [`RenewalConnections`]: the connections a [`PostgresStore`](super::PostgresStore) renews
//! leases on, one per thread, outside its pool.
//!
//! A renewal keeps a running handler's key locked. Taken from the pool, it waited behind
//! every `begin` queued there: with the pool saturated (a retry storm, slow writes), a
//! renewal could spend its whole store timeout in the queue and never reach the database,
//! unlike a Redis renewal, which is sent at once and lands even when its answer is late. A
//! lease that no renewal reached lapsed while its handler ran, and a duplicate ran the
//! handler a second time. So renewals go over a connection of the store's own, opened with
//! the pool's connection manager (`dedicated_connection`) but never part of the pool:
//! tokio-postgres pipelines the concurrent renewals of a thread on it, and none waits for a
//! pooled connection.
//!
//! One connection per thread: its I/O runs on a task of the runtime that opened it, and
//! each Actix worker is a single-threaded runtime of its own, so a connection opened on one
//! worker would make the renewals of every other worker depend on that worker being free to
//! run. A connection is opened on first use, replaced when it closes, and until one is open
//! (it opens on a task of its own, which no renewal waits for; tried again after
//! [`REOPEN_AFTER`]) renewals take a pooled connection as before.
//!
//! A connection is also replaced once a renewal on it gave up waiting for its answer (the
//! store timeout): a connection that went silent (a firewall or NAT dropping the flow) never
//! looks closed until the kernel gives it up, many minutes later, and every renewal of the
//! thread would time out on it meanwhile, letting every lease of the worker lapse. A slow
//! server costs a reconnection per timed-out renewal instead, a few a minute at most.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use futures_util::lock::Mutex as AsyncMutex;
use tokio_postgres::Client;

use super::{CONNECT_TIMEOUT, PostgresPool};

/// How long after a failed (or abandoned) attempt to open a thread's renewal connection its
/// renewals take pooled connections before the next attempt.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// The renewal connections of a store and its clones, by the thread that opened each.
#[derive(Default)]
pub(super) struct RenewalConnections {
    by_thread: Mutex<HashMap<ThreadId, Arc<ThreadConnection>>>,
}

/// The renewal connection of one thread.
#[derive(Default)]
struct ThreadConnection {
    /// The connection, and when one was last tried: `tried_at` lets one attempt at a time
    /// open it, in the background (see [`RenewalConnections::client`]).
    state: AsyncMutex<ConnectionState>,
}

/// A renewal connection, and whether a renewal on it gave up waiting for its answer.
pub(super) struct RenewalClient {
    client: Client,
    gave_up: AtomicBool,
}

impl Deref for RenewalClient {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl RenewalClient {
    /// Whether renewals may still be sent on it: open, and no renewal on it gave up.
    fn usable(&self) -> bool {
        !self.client.is_closed() && !self.gave_up.load(Ordering::Relaxed)
    }

    /// Marks it given up on unless [`answered`](AwaitingAnswer::answered) is called first:
    /// hold it while a renewal on it waits for its answer, whose future the store timeout
    /// may drop.
    pub(super) fn awaiting_answer(self: &Arc<Self>) -> AwaitingAnswer {
        AwaitingAnswer {
            client: Some(Arc::clone(self)),
        }
    }
}

/// A renewal waiting for its answer on a [`RenewalClient`]; dropped unanswered, it marks
/// the connection given up on, so the thread's next renewal opens another.
pub(super) struct AwaitingAnswer {
    client: Option<Arc<RenewalClient>>,
}

impl AwaitingAnswer {
    /// The server answered (a reply or an error): the connection is alive.
    pub(super) fn answered(mut self) {
        self.client = None;
    }
}

impl Drop for AwaitingAnswer {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            client.gave_up.store(true, Ordering::Relaxed);
        }
    }
}

/// A thread's connection, and when one was last tried.
#[derive(Default)]
struct ConnectionState {
    client: Option<Arc<RenewalClient>>,
    /// Set when an attempt to open starts, so that an attempt that failed, or whose renewal
    /// gave up on it (the store timeout), holds back the next for [`REOPEN_AFTER`].
    tried_at: Option<Instant>,
}

impl RenewalConnections {
    /// This thread's renewal connection; `None` while there is none open (the caller takes
    /// a pooled connection), one being then opened on a task of this thread's own. No
    /// renewal waits for it to open: one that did could be given up by the store timeout
    /// before it fell back to the pool, and so could every renewal of the thread waiting
    /// behind it, while new connections hang (an overloaded server, a full firewall table)
    /// and the pool's open ones still answer.
    pub(super) async fn client(&self, pool: &PostgresPool) -> Option<Arc<RenewalClient>> {
        let connection = self.of_this_thread();
        let mut state = connection.state.lock().await;
        if let Some(client) = state.client.as_ref().filter(|client| client.usable()) {
            return Some(Arc::clone(client));
        }
        state.client = None;
        if state
            .tried_at
            .is_some_and(|tried| tried.elapsed() < REOPEN_AFTER)
        {
            return None;
        }
        state.tried_at = Some(Instant::now());
        drop(state);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return None;
        };
        let pool = pool.clone();
        // On this thread's runtime (an Actix worker's is single-threaded): the connection's
        // I/O runs there.
        drop(runtime.spawn(async move {
            let opened =
                actix_rt::time::timeout(CONNECT_TIMEOUT, pool.dedicated_connection()).await;
            match opened {
                Ok(Ok(client)) => {
                    connection.state.lock().await.client = Some(Arc::new(RenewalClient {
                        client,
                        gave_up: AtomicBool::new(false),
                    }));
                }
                Ok(Err(error)) => {
                    tracing::debug!(%error, "idempotency: cannot open a PostgreSQL connection for renewals; renewing on the pool");
                }
                Err(_) => {
                    tracing::debug!(
                        "idempotency: opening a PostgreSQL connection for renewals timed out; renewing on the pool"
                    );
                }
            }
        }));
        None
    }

    /// Drops `client`, this thread's connection, which lost its session: the next renewal
    /// opens another.
    pub(super) async fn forget(&self, client: &Arc<RenewalClient>) {
        let connection = self.of_this_thread();
        let mut state = connection.state.lock().await;
        if state
            .client
            .as_ref()
            .is_some_and(|current| Arc::ptr_eq(current, client))
        {
            state.client = None;
        }
    }

    /// The entry of this thread, made on first use; the entries of other threads whose
    /// connection closed (a stopped worker's, whose runtime ended) or that have none and
    /// tried none for [`REOPEN_AFTER`] are dropped meanwhile, so that the map stays as large
    /// as the threads that renew. One that tried lately is kept: dropped, its thread would
    /// try again at its next renewal, and while connections are refused two workers that
    /// renew in turn would each drop the other's entry and try once per renewal.
    fn of_this_thread(&self) -> Arc<ThreadConnection> {
        let this = std::thread::current().id();
        let mut by_thread = self
            .by_thread
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(connection) = by_thread.get(&this) {
            return Arc::clone(connection);
        }
        by_thread.retain(|_, connection| {
            connection.state.try_lock().is_none_or(|state| {
                state.client.as_ref().is_some_and(|client| client.usable())
                    || state
                        .tried_at
                        .is_some_and(|tried| tried.elapsed() < REOPEN_AFTER)
            })
        });
        Arc::clone(by_thread.entry(this).or_default())
    }
}
