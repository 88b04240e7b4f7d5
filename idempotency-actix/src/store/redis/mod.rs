//! [`RedisStore`]: records in Redis, reached through a bb8 pool of bb8-redis connections.
//!
//! The protocol (commands, functions, reply decoding) lives in `protocol` and the record
//! layout in `record`; `exchange` sends a request alone or pipelined with `WAIT`
//! (`replication`), and `steps` runs the four steps over any transport. Only the
//! connection differs between the stores: `connection` for this one, `cluster` for
//! `RedisClusterStore` (feature `redis-cluster`).

#[cfg(feature = "redis-cluster")]
mod cluster;
mod conditional_set;
mod connection;
mod direct;
#[cfg(feature = "redis-cluster")]
mod every_primary;
mod exchange;
mod inspection;
mod missing_library;
mod packed;
mod pool;
mod protocol;
mod record;
mod replication;
mod reply;
mod server_kind;
mod silence;
mod socket;
mod spares;
mod steps;

#[cfg(feature = "redis-cluster")]
pub use self::cluster::{RedisClusterClient, RedisClusterStore};
use self::connection::SharedConnection;
pub use self::pool::RedisPool;
pub use self::replication::ReplicatedWrites;
use self::steps::Steps;

/// Records in Redis (≥ 7.0) or Valkey, one string per key, so every operation touches one key
/// and the same protocol is ready for Redis Cluster (this store itself talks to one server).
///
/// A record holds its state (in flight or completed), the request's fingerprint, the lease
/// token of the request that runs or ran, and, once completed, its expiry and the encoded
/// [`StoredResponse`](crate::StoredResponse). The key's expiry is the lease while in flight and the TTL once
/// completed. Records of another format version are still recognised as in flight or
/// completed, so two versions of an app sharing Redis never take each other's keys; a
/// response this version cannot decode is a store error (503 when failing closed), never a
/// second run. So is a key that holds another type of value, such as a record in the hash
/// format of 0.1 development builds: it answers 503 until it expires.
///
/// Round trips: a new key costs two, a replay one, an unprotected request none. `begin` is
/// one plain `SET key record NX PX lease GET`. `commit` is one plain
/// `SET key <completed record> IFEQ <in-flight record> PX ttl` on Valkey ≥ 8.1, which each
/// connection learns with `HELLO` as it opens (a Valkey without `IFEQ` refuses the first
/// commit as a syntax error, writing nothing, and the store commits by function until its
/// connection is opened anew, as after a server's upgrade). On Redis, whatever its version,
/// `commit` is a function: Redis 8.6.3 was seen to write a `SET … IFEQ` into another key
/// (`docs/redis-8-set-ifeq.md`). `renew`,
/// `release`, and `commit` elsewhere, are each one `FCALL` of a short Lua function fenced by
/// the lease token (the library `idempotency_actix_2_r9`, which the store loads with
/// `FUNCTION LOAD` when it opens a connection, and again if a server lacks it later). A
/// Redis user that may not load it needs someone who may to load it first: until then a
/// connection that finds it missing is not used, and keyed requests get 503 before any
/// handler runs, since nothing could fence their commits. The store then opens no other
/// connection for 1 s, refusing keyed requests the same way meanwhile, so it tries (and
/// logs why it failed) once a second, not once per request, and serves requests within a
/// second of the library being loaded.
///
/// Connections: the store opens one multiplexed connection and shares it between all its
/// requests, so their commands go out together; it never holds a pool slot, so it neither
/// waits for one nor pays bb8's `PING` per checkout. For a pool from [`RedisStore::pool`]
/// with a `redis://` or Unix-socket URL it is a connection of the store's own (RESP2,
/// `AUTH` and `SELECT` from the URL; about 4 500 instructions less per round trip than
/// redis-rs's); otherwise (a bb8 pool the app built, `rediss://`) a redis-rs multiplexed
/// connection from the pool's connection manager. A connection whose socket died is replaced and the
/// command sent once more. Each clone of the store (one per worker, as `HttpServer::new`
/// builds the app per worker) opens its own connection, on its worker's thread.
///
/// With [`replicated_writes`](Self::replicated_writes), `WAIT` is pipelined behind the lock
/// and the commit on the same connection, in the same round trip.
///
/// # Examples
///
/// ```no_run
/// use actix_web::{App, HttpServer};
/// use idempotency_actix::{Idempotency, RedisStore};
///
/// # async fn run() -> std::io::Result<()> {
/// let pool = RedisStore::pool("redis://127.0.0.1:6379").expect("a valid Redis URL");
/// HttpServer::new(move || App::new().wrap(Idempotency::redis(pool.clone())))
///     .bind("127.0.0.1:8080")?
///     .run()
///     .await
/// # }
/// ```
pub struct RedisStore {
    connection: SharedConnection,
    replication: Option<ReplicatedWrites>,
}

impl RedisStore {
    /// A store on `pool`: a [`RedisPool`] from [`RedisStore::pool`], or a bb8 pool of the
    /// app's own.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::App;
    /// use idempotency_actix::{Idempotency, RedisStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // No connection is made until the first request:
    /// let store = RedisStore::new(RedisStore::pool("redis://127.0.0.1:6379")?);
    /// let app = App::new().wrap(Idempotency::new(store));
    /// // Or on a bb8 pool of the app's own:
    /// let manager = bb8_redis::RedisConnectionManager::new("redis://127.0.0.1:6379")?;
    /// let store = RedisStore::new(bb8::Pool::builder().max_size(32).build_unchecked(manager));
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(pool: impl Into<RedisPool>) -> Self {
        Self {
            connection: SharedConnection::new(pool.into()),
            replication: None,
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
    /// use idempotency_actix::{Idempotency, RedisStore, ReplicatedWrites};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = RedisStore::new(RedisStore::pool("redis://127.0.0.1:6379")?)
    ///     .replicated_writes(ReplicatedWrites::new(1, Duration::from_millis(200)));
    /// let app = App::new().wrap(Idempotency::new(store));
    /// # Ok(())
    /// # }
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
    /// use idempotency_actix::{RedisStore, ReplicatedWrites};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = RedisStore::new(RedisStore::pool("redis://127.0.0.1:6379")?);
    /// assert_eq!(store.replication(), None);
    /// let writes = ReplicatedWrites::new(1, Duration::from_millis(200)).or_warn();
    /// assert_eq!(store.replicated_writes(writes).replication(), Some(writes));
    /// # Ok(())
    /// # }
    /// ```
    pub fn replication(&self) -> Option<ReplicatedWrites> {
        self.replication
    }

    /// Commits (and rewrites records for replicated writes) by function from the start, as
    /// on Redis or a Valkey without `SET … IFEQ` (before 8.1), which this store otherwise
    /// learns from each connection's `HELLO` and the first commit such a Valkey refuses: for
    /// tests that run that protocol on a newer Valkey. This store only, not its clones.
    #[doc(hidden)]
    #[must_use]
    pub fn commits_by_function(self) -> Self {
        self.connection.conditional_set().by_function_only();
        self
    }

    fn steps(&self) -> Steps<'_, SharedConnection> {
        Steps {
            transport: &self.connection,
            replication: self.replication,
            conditional_set: self.connection.conditional_set(),
        }
    }

    /// A pool for `url` with the settings this store wants: no `PING` on checkout (for the
    /// app's own use of the pool; the store shares one connection per worker and never checks
    /// one out), 16 connections, and no connection made until the first request, so an app
    /// starts while Redis is still down and recovers by itself once it is up.
    ///
    /// `url` is `redis://[user:password@]host:port[/db]` or a Unix socket's
    /// `unix:///path/to/redis.sock?db=N&user=U&pass=P` (or `redis+unix://…`), both served by
    /// the store's own connection, or `rediss://` (TLS, which
    /// needs one of the `redis` crate's TLS features, `tokio-rustls-comp` or
    /// `tokio-native-tls-comp`, turned on by the app: this crate turns on none).
    ///
    /// # Errors
    ///
    /// When `url` is not a Redis URL, or is a `rediss://` one and no TLS feature of `redis`
    /// is on ("can't connect with TLS, the feature is not enabled").
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::RedisStore;
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = RedisStore::pool("redis://127.0.0.1:6379/2")?;
    /// assert_eq!(pool.state().connections, 0); // none until the first request
    /// assert!(RedisStore::pool("http://127.0.0.1:6379").is_err());
    /// # Ok(())
    /// # }
    /// ```
    pub fn pool(url: &str) -> Result<RedisPool, redis::RedisError> {
        RedisPool::for_url(url)
    }

    /// The pool this store uses.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::RedisStore;
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = RedisStore::new(RedisStore::pool("redis://127.0.0.1:6379")?);
    /// // The app's own commands can share it (a bb8 pool, through `Deref`):
    /// let pool = store.connection_pool().clone();
    /// assert_eq!(pool.state().connections, 0);
    /// # Ok(())
    /// # }
    /// ```
    pub fn connection_pool(&self) -> &RedisPool {
        self.connection.pool()
    }
}

impl Clone for RedisStore {
    /// A store on the same pool with a connection of its own (made on first use) and the
    /// same replication setting.
    fn clone(&self) -> Self {
        Self {
            connection: SharedConnection::new(self.connection.pool().clone()),
            replication: self.replication,
        }
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("pool", self.connection.pool())
            .field("replication", &self.replication)
            .finish_non_exhaustive()
    }
}

steps::idempotency_store_on_steps!(RedisStore);
