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
//! run. A connection is opened on first use, replaced when it closes, and until one is
//! open (it opens on a task of its own; tried again after [`REOPEN_AFTER`]) renewals take a
//! pooled connection as before. While it opens, a renewal takes whichever comes first: a
//! pooled connection, or the new connection open ([`RenewalConnections::opened`]). Sent to
//! the pool alone, the first renewals of a burst of new keys waited there behind the burst's
//! `begin`s for their whole store timeout, and were sent again on the new connection behind
//! every other lease's, past their lease; waiting for the connection alone, they waited
//! for one that may never open.
//!
//! A connection is also replaced once a renewal on it gave up waiting for its answer (the
//! store timeout) while the server answered nothing on it for half that wait or more
//! ([`AwaitingAnswer`]): a connection that went silent (a
//! firewall or NAT dropping the flow) never looks closed until the kernel gives it up, many
//! minutes later, and every renewal of the thread would time out on it meanwhile, letting
//! every lease of the worker lapse. A connection that answered meanwhile is slow, not
//! silent, and is kept: its renewals queue behind each other (one worker renewing many
//! leases over slow writes), and a new connection would start the same queue afresh, with
//! the pool standing in for it until it opens. The renewals still waiting on a connection
//! given up on are abandoned ([`RenewalClient::abandon`]), and sent again on the pool.
//!
//! A renewal given up still lands: it was sent. So a lease has at most one renewal waiting
//! on a connection ([`RenewalClient::renew`]): the engine sends a renewal again at its next
//! tick once one gave up, and each of them queued as a statement of its own made the queue
//! longer the longer it was, until no renewal got through within a lease. The one sent again
//! waits for the answer of the one on its way instead, which the engine counts from when
//! the first was sent (`HeldLock::renew_counted`).

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use futures_util::future::{BoxFuture, FutureExt, Shared};
use futures_util::lock::Mutex as AsyncMutex;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio_postgres::Client;
use tokio_postgres::types::{ToSql, Type};

use super::{CONNECT_TIMEOUT, PostgresPool};
use crate::store::StoreError;

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
    /// How many attempts to open it are on their way (one may outlast [`REOPEN_AFTER`]).
    attempts: AtomicU32,
    /// Told when an attempt ends, the connection open or not.
    attempt_ended: Notify,
}

/// A renewal connection, whether it went silent, and the renewals waiting on it.
pub(super) struct RenewalClient {
    client: Client,
    /// A renewal on it gave up waiting while the server answered nothing on it.
    silent: AtomicBool,
    /// When it was opened: [`last_answer`](Self::last_answer) counts from there.
    opened_at: Instant,
    /// When the server last answered a renewal on it, in microseconds since `opened_at`.
    last_answer: AtomicU64,
    /// The renewals sent on it and not answered yet, by lease.
    unanswered: Mutex<HashMap<LeaseRenewal, Unanswered>>,
}

/// A renewal sent on a [`RenewalClient`] and not answered yet: its answer, and its task.
struct Unanswered {
    answer: SharedAnswer,
    task: AbortHandle,
}

/// What identifies a lease's renewal: the record's key, the lease's token, and the lease it
/// asks for (a route layer may change it meanwhile: a renewal of the old length does not
/// apply the new one).
type LeaseRenewal = (String, String, i64);

/// The answer to a renewal, shared by every renewal of its lease that waits for it.
type SharedAnswer = Shared<BoxFuture<'static, RenewalAnswer>>;

/// Whether a renewal found its lease still held, or why it failed.
pub(super) type RenewalAnswer = Result<bool, RenewalFailure>;

/// Why a renewal on a [`RenewalClient`] failed: an error of tokio-postgres (shared by every
/// renewal that waited for it), an answer that is not one flag, or a connection given up on
/// (silent, or its session lost) before it answered, or a runtime that stopped meanwhile.
#[derive(Clone, Debug)]
pub(super) enum RenewalFailure {
    Postgres(Arc<tokio_postgres::Error>),
    Protocol(String),
    Abandoned,
}

impl Deref for RenewalClient {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl RenewalClient {
    fn new(client: Client) -> Self {
        Self {
            client,
            silent: AtomicBool::new(false),
            opened_at: Instant::now(),
            last_answer: AtomicU64::new(0),
            unanswered: Mutex::default(),
        }
    }

    /// Whether renewals may still be sent on it: open, and not silent.
    fn usable(&self) -> bool {
        !self.client.is_closed() && !self.silent.load(Ordering::Relaxed)
    }

    /// Renews the lease of `token` on `key` for `lease_ms` with `statement` (the store's
    /// renewal: `$1` key, `$2` token, `$3` lease in milliseconds). Where a renewal of the
    /// same lease waits on this connection already, this one waits for its answer instead
    /// of queueing another behind it.
    ///
    /// The statement runs on a task of its own, so it is answered, and the lease's entry
    /// cleared, also when every renewal waiting for it has been given up (the store
    /// timeout); the connection's answers would otherwise stall behind the one nobody reads.
    /// Given up while the server answered nothing on the connection, a renewal marks it
    /// silent: the thread's next renewal opens another.
    pub(super) async fn renew(
        self: &Arc<Self>,
        statement: &str,
        key: &str,
        token: &str,
        lease_ms: i64,
    ) -> RenewalAnswer {
        let waiting = AwaitingAnswer {
            client: Some(Arc::clone(self)),
            since: self.elapsed_micros(),
        };
        let answer = match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                self.answer_of(&runtime, statement, key, token, lease_ms)
                    .await
            }
            // Outside a Tokio runtime (a caller of the store's own), where no task can be
            // spawned: sent by itself, as a pooled connection would.
            Err(_) => self.send(statement, key, token, lease_ms).await,
        };
        waiting.answered();
        answer
    }

    /// Sends the renewal, and reads its answer.
    async fn send(&self, statement: &str, key: &str, token: &str, lease_ms: i64) -> RenewalAnswer {
        let rows = self
            .client
            .query_typed(statement, &renewal_params(&key, &token, &lease_ms))
            .await;
        self.last_answer
            .fetch_max(self.elapsed_micros(), Ordering::Relaxed);
        match rows {
            Ok(rows) => flag(&rows),
            Err(error) => Err(RenewalFailure::Postgres(Arc::new(error))),
        }
    }

    /// The answer to the renewal of `token`'s lease for `lease_ms` waiting on this
    /// connection, sent now where there is none.
    fn answer_of(
        self: &Arc<Self>,
        runtime: &tokio::runtime::Handle,
        statement: &str,
        key: &str,
        token: &str,
        lease_ms: i64,
    ) -> SharedAnswer {
        let lease = (key.to_owned(), token.to_owned(), lease_ms);
        let mut unanswered = self.unanswered();
        if let Some(waiting) = unanswered.get(&lease) {
            return waiting.answer.clone();
        }
        let sent = runtime.spawn({
            let (client, lease) = (Arc::clone(self), lease.clone());
            let statement = statement.to_owned();
            async move {
                let answer = client.send(&statement, &lease.0, &lease.1, lease.2).await;
                client.unanswered().remove(&lease);
                answer
            }
        });
        let task = sent.abort_handle();
        let answer = async move { sent.await.unwrap_or(Err(RenewalFailure::Abandoned)) }
            .boxed()
            .shared();
        unanswered.insert(
            lease,
            Unanswered {
                answer: answer.clone(),
                task,
            },
        );
        answer
    }

    /// Stops waiting for the renewals sent on it: it is no longer used (silent, or its
    /// session lost), and a silent connection might not answer them for many minutes.
    /// Every renewal still waiting for one is told it was abandoned.
    fn abandon(&self) {
        for (_, waiting) in self.unanswered().drain() {
            waiting.task.abort();
        }
    }

    fn unanswered(&self) -> MutexGuard<'_, HashMap<LeaseRenewal, Unanswered>> {
        self.unanswered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Microseconds since it was opened.
    fn elapsed_micros(&self) -> u64 {
        u64::try_from(self.opened_at.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// The parameters of the store's renewal statement: `$1` key, `$2` token, `$3` lease in
/// milliseconds.
pub(super) fn renewal_params<'a>(
    key: &'a &str,
    token: &'a &str,
    lease_ms: &'a i64,
) -> [(&'a (dyn ToSql + Sync), Type); 3] {
    [
        (key, Type::TEXT),
        (token, Type::TEXT),
        (lease_ms, Type::INT8),
    ]
}

/// The flag a renewal's one row holds; `false` without a row (the lease is no longer held).
fn flag(rows: &[tokio_postgres::Row]) -> RenewalAnswer {
    super::flag(rows).map_err(|error| match error {
        StoreError::Protocol(message) => RenewalFailure::Protocol(message),
        other => RenewalFailure::Protocol(other.to_string()),
    })
}

/// A renewal waiting for its answer on a [`RenewalClient`]; dropped unanswered (given up
/// by the store timeout, or its caller) while the connection was quiet (the server answered
/// nothing on it) for half its wait or more, it marks the connection silent, so the
/// thread's next renewal opens another. Half, not all: a connection that went silent just
/// after answering another renewal, while this one waited, is still told by this one.
struct AwaitingAnswer {
    client: Option<Arc<RenewalClient>>,
    /// When it began to wait, in microseconds since the connection was opened.
    since: u64,
}

impl AwaitingAnswer {
    /// The server answered (a reply or an error): the connection is alive.
    fn answered(mut self) {
        self.client = None;
    }
}

impl Drop for AwaitingAnswer {
    fn drop(&mut self) {
        let Some(client) = self.client.take() else {
            return;
        };
        let now = client.elapsed_micros();
        let last_answer = client.last_answer.load(Ordering::Relaxed);
        let quiet = now.saturating_sub(last_answer.max(self.since));
        let waited = now.saturating_sub(self.since);
        if quiet >= waited / 2 {
            client.silent.store(true, Ordering::Relaxed);
        }
    }
}

/// An attempt to open a thread's renewal connection, counted in its `attempts` until it
/// ends (opened, failed, or its task dropped: a runtime that stops), which then tells the
/// renewals racing it ([`RenewalConnections::opened`]).
struct Attempt(Arc<ThreadConnection>);

impl Attempt {
    fn start(connection: &Arc<ThreadConnection>) -> Self {
        connection.attempts.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(connection))
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        self.0.attempts.fetch_sub(1, Ordering::SeqCst);
        self.0.attempt_ended.notify_waiters();
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
    /// renewal waits for it alone to open: one that did could be given up by the store
    /// timeout, and so could every renewal of the thread waiting behind it, while new
    /// connections hang (an overloaded server, a full firewall table) and the pool's open
    /// ones still answer. A renewal races the opening against a pooled connection instead
    /// ([`opened`](Self::opened)).
    pub(super) async fn client(&self, pool: &PostgresPool) -> Option<Arc<RenewalClient>> {
        let connection = self.of_this_thread();
        let mut state = connection.state.lock().await;
        if let Some(client) = state.client.as_ref().filter(|client| client.usable()) {
            return Some(Arc::clone(client));
        }
        if let Some(unusable) = state.client.take() {
            unusable.abandon();
        }
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
        let attempt = Attempt::start(&connection);
        // On this thread's runtime (an Actix worker's is single-threaded): the connection's
        // I/O runs there.
        drop(runtime.spawn(async move {
            let _attempt = attempt;
            let opened =
                actix_rt::time::timeout(CONNECT_TIMEOUT, pool.dedicated_connection()).await;
            match opened {
                Ok(Ok(client)) => {
                    let opened = Arc::new(RenewalClient::new(client));
                    // Another attempt's, opened meanwhile (an attempt may take longer than
                    // `REOPEN_AFTER`), is given up for this one.
                    if let Some(replaced) = connection.state.lock().await.client.replace(opened) {
                        replaced.abandon();
                    }
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

    /// Returns once an attempt to open this thread's renewal connection, on its way now,
    /// has ended (the connection open or not); never while none is on its way. A renewal
    /// that found no connection open races this against a pooled connection.
    pub(super) async fn opened(&self) {
        let connection = self.of_this_thread();
        let ended = connection.attempt_ended.notified();
        let mut ended = std::pin::pin!(ended);
        // Registered before the count is read, so that an attempt ending in between wakes it.
        ended.as_mut().enable();
        if connection.attempts.load(Ordering::SeqCst) == 0 {
            return std::future::pending().await;
        }
        ended.await;
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
        client.abandon();
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
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(connection) = by_thread.get(&this) {
            return Arc::clone(connection);
        }
        by_thread.retain(|_, connection| {
            let Some(mut state) = connection.state.try_lock() else {
                return true;
            };
            let kept = state.client.as_ref().is_some_and(|client| client.usable())
                || state
                    .tried_at
                    .is_some_and(|tried| tried.elapsed() < REOPEN_AFTER);
            if !kept && let Some(dropped) = state.client.take() {
                dropped.abandon();
            }
            kept
        });
        Arc::clone(by_thread.entry(this).or_default())
    }
}
