//! [`RedisClusterStore`]: records in Redis Cluster through one shared async cluster
//! connection, with the protocol of the single-server store.

use std::sync::Mutex;
use std::time::Duration;

use futures_util::lock::Mutex as AsyncMutex;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;

use super::conditional_set::ConditionalSet;
use super::exchange::{Exchange, Reply};
use super::missing_library::MissingLibrary;
use super::protocol;
use super::replication::ReplicatedWrites;
use super::spares::Spares;
use super::steps::{Steps, Transport, idempotency_store_on_steps};
use crate::store::StoreError;

/// The client [`Idempotency::redis_cluster`](crate::Idempotency::redis_cluster) takes: the
/// `redis` crate's cluster client (seed nodes and connection settings; it connects nothing
/// by itself). Build one with [`RedisClusterStore::client`].
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use idempotency_actix::{RedisClusterClient, RedisClusterStore};
///
/// // With the store's settings:
/// let client: RedisClusterClient = RedisClusterStore::client(["redis://127.0.0.1:7000"])?;
/// // With others (here a password), and a response timeout:
/// let client = RedisClusterClient::builder(["redis://127.0.0.1:7000"])
///     .password("secret".to_owned())
///     .response_timeout(Duration::from_secs(1))
///     .build()?;
/// let store = RedisClusterStore::new(client);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub type RedisClusterClient = ClusterClient;

/// How long one node may take to accept a connection.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);
/// How long one attempt of a request may wait for its reply.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a request may take with its retries (redirections during a resharding,
/// reconnections during a failover): the default store timeout, beyond which the
/// middleware gives up on it anyway.
const OVERALL_RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the first connection (to a seed node, then the slot map) may take.
const FIRST_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Records in Redis Cluster (≥ 7.0), with the protocol, round trips and guarantees of
/// [`RedisStore`](crate::RedisStore): every record is one key, every step touches that one
/// key, so each step goes to the primary that serves the key's slot.
///
/// The connection is the `redis` crate's async cluster connection: multiplexed (the
/// commands of concurrent requests share it), cloneable and reconnecting (it follows `MOVED`
/// and `ASK` redirections while slots move, and refreshes its slot map after a failover).
/// So the store shares one, made on first use, instead of pooling it: a pool would check
/// every primary on each checkout and rebuild the whole client when one failed. Each clone
/// of the store (one per worker, as `HttpServer::new` builds the app per worker) makes its
/// own on first use; its background task runs on that worker.
///
/// Bounds: the first connection may take 2 s (the app starts while the cluster is down and
/// connects once it is up; until then each request tries, for up to 2 s, and fails with a
/// store error: 503 when failing closed), each
/// node 1 s to accept a connection, each attempt of a request 1 s for its reply, and a
/// request with its retries 2 s (see [`client`](Self::client)).
///
/// The fenced steps are Redis functions (`FCALL`, routed by the key like every step).
/// Functions are replicated and kept with the data, so a replica promoted by a failover
/// has them. A primary without them (a new cluster, an empty node given slots) makes the
/// step load them with `FUNCTION LOAD`, which the cluster connection sends to every
/// primary (while one is unreachable, that load fails, and the step with it). A Redis user
/// that may not load them is refused as on [`RedisStore`](crate::RedisStore): keyed
/// requests get 503 before any handler runs until someone who may has loaded them, and the
/// store makes a new connection to look again once a second at most. Whether they are
/// there is asked of every primary that serves slots (`CLUSTER NODES`), so a primary
/// added with none, or restarted without them, refuses such a user as a cluster without
/// any does; where the user may not run `CLUSTER NODES`, of one node.
///
/// With [`replicated_writes`](Self::replicated_writes), `WAIT` is pipelined behind each
/// write on the connection of the key's primary, so it counts that primary's replicas.
/// Such a write goes on a cluster connection of its own, made from the seed nodes; where
/// none can be made (the seeds all gone since), on the shared one, which follows the nodes.
///
/// # Examples
///
/// ```no_run
/// use actix_web::{App, HttpServer};
/// use idempotency_actix::{Idempotency, RedisClusterStore};
///
/// # async fn run() -> std::io::Result<()> {
/// let client = RedisClusterStore::client(["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"])
///     .expect("valid Redis URLs");
/// HttpServer::new(move || App::new().wrap(Idempotency::redis_cluster(client.clone())))
///     .bind("127.0.0.1:8080")?
///     .run()
///     .await
/// # }
/// ```
pub struct RedisClusterStore {
    client: ClusterClient,
    connection: Mutex<Option<ClusterConnection>>,
    /// Held while the connection is made, so concurrent first requests make one.
    connecting: AsyncMutex<()>,
    /// Connections of their own for exchanges that block theirs (`WAIT`).
    spares: Spares<ClusterConnection>,
    /// Whether a connection found the functions missing lately: none is made meanwhile.
    library: MissingLibrary,
    replication: Option<ReplicatedWrites>,
    /// Commits by function, always (see [`RedisClusterStore::new`]).
    conditional_set: ConditionalSet,
}

impl RedisClusterStore {
    /// A cluster client for these seed nodes (any nodes of the cluster: the client learns
    /// the others from them) with the settings this store wants: 1 s to connect to a node,
    /// 1 s per attempt of a request, 2 s per request with its retries. Connects nothing.
    ///
    /// For other settings (TLS, credentials) build the client with
    /// `RedisClusterClient::builder` and set a response timeout: it has none by default,
    /// so a stalled node would hold requests until the store timeout.
    ///
    /// # Errors
    ///
    /// When a seed is not a Redis URL, or the seeds disagree on credentials.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::RedisClusterStore;
    ///
    /// assert!(RedisClusterStore::client(["redis://127.0.0.1:7000"]).is_ok());
    /// assert!(RedisClusterStore::client(["not a url"]).is_err());
    /// ```
    pub fn client<T: redis::IntoConnectionInfo>(
        seeds: impl IntoIterator<Item = T>,
    ) -> Result<RedisClusterClient, redis::RedisError> {
        ClusterClient::builder(seeds)
            .connection_timeout(CONNECTION_TIMEOUT)
            .response_timeout(RESPONSE_TIMEOUT)
            .overall_response_timeout(Some(OVERALL_RESPONSE_TIMEOUT))
            .build()
    }

    /// A store on `client`; connects on first use.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::App;
    /// use idempotency_actix::{Idempotency, RedisClusterStore};
    ///
    /// let seeds = ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"];
    /// let client = RedisClusterStore::client(seeds)?;
    /// let app = App::new().wrap(Idempotency::new(RedisClusterStore::new(client)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(client: RedisClusterClient) -> Self {
        // By function on every server: the cluster connection follows the nodes without
        // reopening, so it cannot ask each node it reaches which server it is (a Redis 8
        // primary among Valkey ones, mid-migration), and only Valkey is trusted with
        // `SET … IFEQ` (see `server_kind`).
        let conditional_set = ConditionalSet::default();
        conditional_set.by_function_only();
        Self {
            client,
            connection: Mutex::new(None),
            connecting: AsyncMutex::new(()),
            spares: Spares::new(),
            library: MissingLibrary::default(),
            replication: None,
            conditional_set,
        }
    }

    /// Waits until replicas hold each write (the lock in `begin`, and the commit) before
    /// going on; see [`ReplicatedWrites`] for what it guarantees and costs.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use actix_web::App;
    /// use idempotency_actix::{Idempotency, RedisClusterStore, ReplicatedWrites};
    ///
    /// let client = RedisClusterStore::client(["redis://127.0.0.1:7000"])?;
    /// let store = RedisClusterStore::new(client)
    ///     .replicated_writes(ReplicatedWrites::new(1, Duration::from_millis(200)));
    /// let app = App::new().wrap(Idempotency::new(store));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn replicated_writes(mut self, writes: ReplicatedWrites) -> Self {
        self.replication = Some(writes);
        self
    }

    /// The replication setting, if any.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::{RedisClusterStore, ReplicatedWrites};
    ///
    /// let store = RedisClusterStore::new(RedisClusterStore::client(["redis://127.0.0.1:7000"])?);
    /// assert_eq!(store.replication(), None);
    /// let writes = ReplicatedWrites::new(1, Duration::from_millis(200));
    /// assert_eq!(store.replicated_writes(writes).replication(), Some(writes));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn replication(&self) -> Option<ReplicatedWrites> {
        self.replication
    }

    /// The client this store connects with.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::RedisClusterStore;
    ///
    /// let store = RedisClusterStore::new(RedisClusterStore::client(["redis://127.0.0.1:7000"])?);
    /// // Another store (another worker's) on the same client:
    /// let another = RedisClusterStore::new(store.cluster_client().clone());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn cluster_client(&self) -> &RedisClusterClient {
        &self.client
    }

    fn steps(&self) -> Steps<'_, Self> {
        Steps {
            transport: self,
            replication: self.replication,
            conditional_set: &self.conditional_set,
        }
    }

    fn current(&self) -> Option<ClusterConnection> {
        self.connection
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The shared connection, made on first use (bounded; a failure is retried by the next
    /// request).
    async fn connection(&self) -> Result<ClusterConnection, StoreError> {
        if let Some(connection) = self.current() {
            return Ok(connection);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(connection) = self.current() {
            return Ok(connection);
        }
        let connection = self.open().await?;
        *self
            .connection
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(connection.clone());
        Ok(connection)
    }

    /// A new cluster connection, bounded by the first-connect timeout, with the functions
    /// loaded on every primary (`FUNCTION LOAD` goes to all of them). None while a
    /// connection that found the functions missing is recent (see [`MissingLibrary`]).
    async fn open(&self) -> Result<ClusterConnection, StoreError> {
        self.library
            .open(async {
                actix_rt::time::timeout(FIRST_CONNECT_TIMEOUT, self.client.get_async_connection())
                    .await
                    .map_err(|_| StoreError::Timeout(FIRST_CONNECT_TIMEOUT))?
                    .map_err(protocol::store_error)
            })
            .await
    }
}

impl Transport for RedisClusterStore {
    async fn send(&self, exchange: &Exchange) -> Result<Reply, StoreError> {
        if exchange.blocks() {
            // The shared connection is made first: it follows the cluster's nodes from then
            // on, so the exchange can go on it where no connection of its own can be made
            // (the seed nodes gone since; see `Spares::send`).
            let shared = self.connection().await.map_err(StoreError::not_sent)?;
            return self
                .spares
                .send(exchange, || self.open(), Some(shared), &self.library)
                .await;
        }
        // The connection reconnects and retries by itself (within its overall timeout).
        let mut connection = self.connection().await.map_err(StoreError::not_sent)?;
        match exchange.send(&mut connection).await {
            Ok(reply) => Ok(reply),
            Err(error) => {
                if exchange.calls_function()
                    && self.library.missing_after(&mut connection, &error).await
                {
                    // Dropped (and the idle spares with it, as `MissingLibrary` counts what
                    // it found): the next request makes a connection anew, which loads the
                    // functions on every primary or finds them missing.
                    *self
                        .connection
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
                }
                Err(protocol::store_error(error))
            }
        }
    }
}

impl Clone for RedisClusterStore {
    /// A store on the same client with a connection of its own (made on first use) and the
    /// same replication setting.
    fn clone(&self) -> Self {
        Self {
            replication: self.replication,
            ..Self::new(self.client.clone())
        }
    }
}

impl std::fmt::Debug for RedisClusterStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisClusterStore")
            .field("client", &self.client)
            .field("replication", &self.replication)
            .finish_non_exhaustive()
    }
}

idempotency_store_on_steps!(RedisClusterStore);
