//! [`RedisStore`]: records in Redis, reached through a bb8 pool of bb8-redis connections.
//!
//! The protocol (commands, functions, reply decoding) lives in `protocol` and the record
//! layout in `record`, apart from the connection handling in `connection`, so a store on
//! another kind of connection runs the same protocol.

mod connection;
mod protocol;
mod record;

use std::time::Duration;

use bb8_redis::RedisConnectionManager;
use redis::Value;

use self::connection::SharedConnection;
use super::{BeginOutcome, IdempotencyStore, LeaseToken, StoreError};
use crate::fingerprint::Fingerprint;
use crate::record::StoredResponse;
use crate::scope::StorageKey;

/// The pool type [`Idempotency::redis`](crate::Idempotency::redis) takes.
pub type RedisPool = bb8::Pool<RedisConnectionManager>;

/// Records in Redis (≥ 7.0), one string per key, so every operation touches one key and the
/// same protocol is ready for Redis Cluster (this store itself talks to one Redis server).
///
/// A record holds its state (in flight or completed), the request's fingerprint, the lease
/// token of the request that runs or ran, and, once completed, its expiry and the encoded
/// [`StoredResponse`]. The key's expiry is the lease while in flight and the TTL once
/// completed. Records of another format version are still recognised as in flight or
/// completed, so two versions of an app sharing Redis never take each other's keys; a
/// response this version cannot decode is a store error (503 when failing closed), never a
/// second run. So is a key that holds another type of value, such as a record in the hash
/// format of 0.1 development builds: it answers 503 until it expires.
///
/// Round trips: a new key costs two, a replay one, an unprotected request none. `begin` is
/// one plain `SET key record NX PX lease GET`; `commit`, `renew` and `release` are each one
/// `FCALL` of a short Lua function fenced by the lease token (the library
/// `idempotency_actix_2_r2` is loaded by the store with `FUNCTION LOAD` when a server does not
/// have it yet).
///
/// Connections: the store opens one multiplexed connection with the pool's connection
/// manager (the pool gives the URL and settings) and shares it between all its requests, so
/// their commands go out together; it never holds a pool slot, so it neither waits for one
/// nor pays bb8's `PING` per checkout. A connection whose socket died is replaced and the
/// command sent once more. Each clone of the store (one per worker, as `HttpServer::new`
/// builds the app per worker) opens its own connection, on its worker's thread.
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
}

impl RedisStore {
    /// A store on `pool`.
    pub fn new(pool: RedisPool) -> Self {
        Self {
            connection: SharedConnection::new(pool),
        }
    }

    /// A pool for `url` with the settings this store wants: no `PING` on checkout (for the
    /// app's own use of the pool; the store shares one connection per worker and never checks
    /// one out), 16 connections, and no connection made until the first request, so an app
    /// starts while Redis is still down and recovers by itself once it is up.
    ///
    /// # Errors
    ///
    /// When `url` is not a Redis URL.
    pub fn pool(url: &str) -> Result<RedisPool, redis::RedisError> {
        Ok(bb8::Pool::builder()
            .max_size(16)
            .test_on_check_out(false)
            .connection_timeout(Duration::from_secs(2))
            .build_unchecked(RedisConnectionManager::new(url)?))
    }

    /// The pool this store uses.
    pub fn connection_pool(&self) -> &RedisPool {
        self.connection.pool()
    }
}

impl Clone for RedisStore {
    /// A store on the same pool with a connection of its own (made on first use).
    fn clone(&self) -> Self {
        Self::new(self.connection.pool().clone())
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("pool", self.connection.pool())
            .finish_non_exhaustive()
    }
}

impl IdempotencyStore for RedisStore {
    async fn begin(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<BeginOutcome, StoreError> {
        let (outcome, _) = self
            .begin_with_remaining_ttl(key, fingerprint, token, lease)
            .await?;
        Ok(outcome)
    }

    async fn begin_with_remaining_ttl(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<(BeginOutcome, Option<Duration>), StoreError> {
        let request = protocol::begin(key, fingerprint, token, lease);
        let reply = match self.connection.send(&request).await {
            // A full Redis (`noeviction`) refuses `SET` even where `NX` would write nothing:
            // read the record instead, so a key in flight still answers 409 and a completed
            // one replays; only a new key is refused (503 when failing closed).
            Err(error) if protocol::is_out_of_memory(&error) => {
                match self.connection.send(&protocol::read(key)).await? {
                    Value::Nil => return Err(error),
                    record => record,
                }
            }
            reply => reply?,
        };
        protocol::begin_outcome(reply, fingerprint, token)
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let request = protocol::renew(key, token, lease);
        protocol::held(self.connection.send(&request).await?)
    }

    async fn commit(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let request = protocol::commit(key, token, response, ttl);
        protocol::held(self.connection.send(&request).await?)
    }

    async fn release(&self, key: &StorageKey, token: &LeaseToken) -> Result<bool, StoreError> {
        let request = protocol::release(key, token);
        protocol::held(self.connection.send(&request).await?)
    }
}
