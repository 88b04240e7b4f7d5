//! [`SharedConnection`]: one multiplexed connection per store, shared by all its requests,
//! replaced when its socket dies.
//!
//! A bb8 pool hands a connection to one user at a time, so requests that each hold a pooled
//! connection for their command never share a write. A redis-rs multiplexed connection
//! carries any number of requests at once and writes all that are queued in one go; cloning
//! it is cheap. So the store opens one with the pool's connection manager and shares it:
//! the commands of concurrent requests coalesce on it.
//!
//! The connection is opened by the store itself, on the worker that uses it, rather than
//! taken from the pool: a pooled connection may have been opened on another thread (the
//! one that first asked the pool), and its driver task would then run there, so that every
//! command of this worker would cost a cross-thread wake-up and two context switches.
//!
//! It is the store's own [`DirectConnection`] when the pool knows its server's address (a
//! pool from [`RedisStore::pool`](crate::RedisStore::pool) with a `redis://` URL), else a
//! redis-rs multiplexed connection from the pool's connection manager.

use std::sync::{Arc, LazyLock, Mutex};
use std::time::Instant;

use futures_util::lock::Mutex as AsyncMutex;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisFuture, Value};

use super::RedisPool;
use super::conditional_set::ConditionalSet;
use super::direct::DirectConnection;
use super::exchange::{Exchange, Reply};
use super::missing_library::MissingLibrary;
use super::packed::{Carrier, PackedCommand};
use super::protocol::{self, LibraryProbe};
use super::server_kind::ServerKind;
use super::silence::SilenceWatch;
use super::spares::Spares;
use super::steps::Transport;
use crate::log_interval::LogInterval;
use crate::store::not_sent::unsent_by_the_deadline;
use crate::store::{StoreError, deadline};

/// The line of a connection found silent, logged at most once per interval for the process.
static SILENT: LazyLock<LogInterval> = LazyLock::new(LogInterval::new);

/// The connection a store shares between its requests.
pub(super) struct SharedConnection {
    pool: RedisPool,
    current: Mutex<Option<Generation>>,
    /// Held while a connection is made, so concurrent requests wait for one connection
    /// instead of each making their own.
    connecting: AsyncMutex<()>,
    /// Connections of their own for exchanges that block theirs (`WAIT`).
    spares: Spares<StoreConnection>,
    /// Whether a connection found the functions missing lately: none is opened meanwhile.
    library: MissingLibrary,
    /// Whether commits go by `SET … IFEQ`: on Valkey, as each connection opened learns, until
    /// it refuses it.
    conditional_set: ConditionalSet,
}

/// A connection and a number that tells it apart from the one it replaced.
#[derive(Clone)]
struct Generation {
    connection: StoreConnection,
    number: u64,
    /// Whether a redis-rs connection went silent (the store's own connection watches
    /// itself).
    silence: Option<Arc<SilenceWatch>>,
}

/// A connection of the store, and the server it reached.
#[derive(Clone)]
pub(super) struct StoreConnection {
    link: Link,
    /// Which server the connection reached, asked as it opened: only Valkey is sent
    /// `SET … IFEQ` (see `server_kind`).
    server: ServerKind,
}

/// The store's own connection, or redis-rs's.
#[derive(Clone)]
enum Link {
    Direct(DirectConnection),
    Multiplexed(MultiplexedConnection),
}

impl StoreConnection {
    /// `link`, to a server not asked yet (taken for one not trusted with `SET … IFEQ`).
    fn new(link: Link) -> Self {
        Self {
            link,
            server: ServerKind::Other,
        }
    }

    /// Whether the connection is known to have failed before anything more is sent on it
    /// (the store's own connection knows; redis-rs's is found out by sending).
    fn has_failed(&self) -> bool {
        match &self.link {
            Link::Direct(connection) => connection.has_failed(),
            Link::Multiplexed(_) => false,
        }
    }
}

impl LibraryProbe for StoreConnection {}

impl Carrier for StoreConnection {
    fn send_packed<'a>(&'a mut self, command: &'a PackedCommand) -> RedisFuture<'a, Value> {
        match &mut self.link {
            Link::Direct(connection) => connection.send_packed(command),
            Link::Multiplexed(connection) => connection.send_packed(command),
        }
    }

    fn trusts_conditional_set(&self) -> bool {
        self.server == ServerKind::Valkey
    }
}

impl ConnectionLike for StoreConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.link {
            Link::Direct(connection) => connection.req_packed_command(cmd),
            Link::Multiplexed(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.link {
            Link::Direct(connection) => connection.req_packed_commands(pipeline, offset, count),
            Link::Multiplexed(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
        }
    }

    fn get_db(&self) -> i64 {
        match &self.link {
            Link::Direct(connection) => connection.get_db(),
            Link::Multiplexed(connection) => connection.get_db(),
        }
    }
}

impl SharedConnection {
    pub(super) fn new(pool: RedisPool) -> Self {
        Self {
            pool,
            current: Mutex::new(None),
            connecting: AsyncMutex::new(()),
            spares: Spares::new(),
            library: MissingLibrary::default(),
            conditional_set: ConditionalSet::default(),
        }
    }

    pub(super) fn pool(&self) -> &RedisPool {
        &self.pool
    }

    /// How this connection's commits go (see [`ConditionalSet`]).
    pub(super) fn conditional_set(&self) -> &ConditionalSet {
        &self.conditional_set
    }

    /// Sends `request`; if the connection turns out dead (see
    /// [`protocol::connection_is_dead`]), replaces it and sends once more (every request of
    /// the protocol is safe to send twice). A redis-rs connection that went silent (see
    /// [`SilenceWatch`]) is replaced before the request is sent.
    ///
    /// Where no connection can be had for it, its error is marked as never sent
    /// ([`StoreError::not_sent`]), also where none could be made by the operation's
    /// deadline (a server that takes the connection and says nothing).
    pub(super) async fn send(&self, request: &Exchange) -> Result<Reply, StoreError> {
        let mut generation = match self.current() {
            Some(current) => current,
            None => unsent_by_the_deadline(self.connection()).await?,
        };
        if let Some(watch) = &generation.silence
            && watch.is_silent(Instant::now())
        {
            // Once per interval: while no new connection can be made, every request finds
            // the silent one still current.
            if let Some(unlogged) = SILENT.admit(Instant::now()) {
                tracing::warn!(
                    unlogged,
                    "idempotency: the Redis server has not answered a request past its \
                     deadline for a while; replacing the connection"
                );
            }
            generation = unsent_by_the_deadline(self.replace(generation.number)).await?;
        } else if generation.connection.has_failed() {
            // Failed under an earlier request (the server went away): replaced before this
            // request is sent, so that where no connection can be had it is known unsent.
            tracing::debug!("idempotency: Redis connection lost; reconnecting");
            generation = unsent_by_the_deadline(self.replace(generation.number)).await?;
        }
        // Not a `SET … IFEQ` to a server not trusted with it (one that replaced the server
        // the request was built for): the step sends its function instead.
        request
            .may_go_on(&generation.connection)
            .map_err(protocol::store_error)?;
        let Generation {
            connection,
            number,
            silence,
        } = generation;
        if let Some(watch) = &silence {
            watch.sent(deadline::current());
        }
        let mut watched = Watched {
            connection,
            silence,
        };
        let sent = request.send(&mut watched.connection).await;
        // A reply, or an error the server sent (it has a code): the server answers.
        if let Some(watch) = watched.silence.take()
            && sent
                .as_ref()
                .map_or_else(|error| error.code().is_some(), |_| true)
        {
            watch.answered();
        }
        match sent {
            Ok(value) => Ok(value),
            // bb8-redis never reports a multiplexed connection broken.
            Err(error) if protocol::connection_is_dead(&error) => {
                tracing::debug!(%error, "idempotency: Redis connection lost; reconnecting");
                let mut connection = self.replace(number).await?.connection;
                request
                    .send(&mut connection)
                    .await
                    .map_err(protocol::store_error)
            }
            Err(error) => {
                if request.calls_function()
                    && self
                        .library
                        .missing_after(&mut watched.connection, &error)
                        .await
                {
                    // Dropped (and the idle spares with it, as `MissingLibrary` counts what
                    // it found): the next request opens a connection anew, which looks for
                    // the functions again.
                    let mut current = self
                        .current
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    if current
                        .as_ref()
                        .is_some_and(|current| current.number == number)
                    {
                        *current = None;
                    }
                }
                Err(protocol::store_error(error))
            }
        }
    }

    fn current(&self) -> Option<Generation> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set(&self, connection: StoreConnection) -> Generation {
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let number = current.as_ref().map_or(0, |old| old.number + 1);
        let silence = match connection.link {
            Link::Direct(_) => None,
            Link::Multiplexed(_) => Some(Arc::default()),
        };
        let generation = Generation {
            connection,
            number,
            silence,
        };
        *current = Some(generation.clone());
        generation
    }

    /// The shared connection, opened by the first request that needs it.
    async fn connection(&self) -> Result<Generation, StoreError> {
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(current) = self.current() {
            return Ok(current);
        }
        // Boxed, here and wherever a connection is opened: opening is rare, and its future
        // (about 2 KB) would otherwise be part of every command's, moved with it.
        Ok(self.set(Box::pin(self.open()).await?))
    }

    /// Replaces the connection of generation `dead` (unless another request already did).
    async fn replace(&self, dead: u64) -> Result<Generation, StoreError> {
        let _connecting = self.connecting.lock().await;
        if let Some(current) = self.current()
            && current.number != dead
        {
            return Ok(current);
        }
        Ok(self.set(Box::pin(self.open()).await?))
    }

    /// A new connection, driven by this thread: the store's own when the pool knows its
    /// server's address, else one from the pool's connection manager. None while a
    /// connection that found the functions missing is recent (see [`MissingLibrary`]).
    /// Which server it reached, and so whether commits may try `SET … IFEQ`, is learnt
    /// again on each (perhaps another server, or the same one upgraded), the shared
    /// connection's and the spares' alike.
    async fn open(&self) -> Result<StoreConnection, StoreError> {
        let mut opened = self
            .library
            .open(async {
                Ok(StoreConnection::new(match self.pool.server() {
                    Some(server) => Link::Direct(
                        DirectConnection::open(server)
                            .await
                            .map_err(protocol::store_error)?,
                    ),
                    None => Link::Multiplexed(self.open_multiplexed().await?),
                }))
            })
            .await?;
        opened.server = ServerKind::of(&mut opened).await;
        self.conditional_set.reconsider(opened.server);
        Ok(opened)
    }

    /// A new redis-rs connection from the pool's connection manager, driven by this thread.
    async fn open_multiplexed(&self) -> Result<MultiplexedConnection, StoreError> {
        let mut connection = self
            .pool
            .dedicated_connection()
            .await
            .map_err(unavailable)?;
        // redis-rs bounds every reply by 500 ms unless told otherwise, which would cut the
        // engine's store timeout (2 s by default, set with `Idempotency::store_timeout`)
        // short: the engine's bound is the one that applies.
        connection.set_response_timeout(crate::MAX_DURATION);
        Ok(connection)
    }
}

impl Transport for SharedConnection {
    async fn send(&self, exchange: &Exchange) -> Result<Reply, StoreError> {
        if exchange.blocks() {
            return Box::pin(
                self.spares
                    .send(exchange, || self.open(), None, &self.library),
            )
            .await;
        }
        SharedConnection::send(self, exchange).await
    }
}

/// A request on its way over a connection, and the connection's silence watch until the
/// request has its answer.
struct Watched {
    connection: StoreConnection,
    silence: Option<Arc<SilenceWatch>>,
}

impl Drop for Watched {
    /// Given up on before its answer came (its deadline passed): the server may still
    /// answer it, only slow, and then it is not silent, however long nothing else is sent.
    /// A `PING` behind it is answered after it (replies come in order), and its reply tells
    /// the watch (see [`SilenceWatch::probe`]).
    fn drop(&mut self) {
        if let (Some(watch), Link::Multiplexed(connection)) =
            (self.silence.take(), &self.connection.link)
        {
            watch.probe(connection.clone());
        }
    }
}

fn unavailable(error: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}
