//! [`RedisStore`]: records in Redis through a bb8 pool of bb8-redis connections.

use std::sync::LazyLock;
use std::time::Duration;

use bb8_redis::RedisConnectionManager;
use redis::{Script, Value};

use super::{BeginOutcome, Deletion, IdempotencyStore, LeaseToken, RecordSnapshot, StoreError};
use crate::fingerprint::Fingerprint;
use crate::record::{RECORD_VERSION, StoredResponse};
use crate::scope::StorageKey;

/// The pool type [`Idempotency::redis`](crate::Idempotency::redis) takes.
pub type RedisPool = bb8::Pool<RedisConnectionManager>;

/// Records in Redis, one hash per key, so every operation touches one key and the same
/// scripts are ready for Redis Cluster (this store itself talks to one Redis server).
///
/// Fields of a record: `v` (format version), `f` (fingerprint, 32 raw bytes), `s` (`i` in
/// flight, `c` completed), `t` (the lease token of the request that ran), `r` (the encoded
/// [`StoredResponse`], once completed). The key's expiry is the lease while in flight and
/// the TTL once completed. Records are read by their fields whatever their version, so two
/// versions of an app sharing Redis never take each other's keys; a response this version
/// cannot decode is a store error (503 when failing closed), never a second run.
///
/// Round trips: a new key costs two (`begin`, `commit`), a replay one; each is one
/// `EVALSHA` (plus a one-time `SCRIPT LOAD` per script and server). bb8 sends a `PING` on
/// every checkout unless the pool is built with `test_on_check_out(false)`;
/// [`RedisStore::pool`] builds it that way, and a broken connection is still detected by
/// the failing command and replaced.
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
#[derive(Debug, Clone)]
pub struct RedisStore {
    pool: RedisPool,
}

// Every script is safe to run twice with the same arguments (a retry after a connection
// dropped before the reply arrived): a repeated `begin` of the same token re-acquires, a
// repeated `commit` reports success without writing again, `renew` and `release` compare
// the token first.
//
// A record is read by its fields whatever its `v`: an in-flight record of another version
// is in flight, a completed one is completed (and its response decoded by the version that
// can), so instances of two versions during a rolling deploy never take each other's keys.

static BEGIN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local record = redis.call('HMGET', KEYS[1], 's', 'f', 'r', 't')
if record[1] then
  if record[1] == 'i' and record[4] == ARGV[3] then return {'acquired'} end
  if record[2] ~= ARGV[2] then return {'mismatch'} end
  if record[1] == 'c' then return {'completed', record[3]} end
  return {'in_flight'}
end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'f', ARGV[2], 's', 'i', 't', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {'acquired'}
",
    )
});

static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local record = redis.call('HMGET', KEYS[1], 's', 't')
if record[1] ~= 'i' or record[2] ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
",
    )
});

static COMMIT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local record = redis.call('HMGET', KEYS[1], 's', 't')
if record[2] ~= ARGV[1] then return 0 end
if record[1] == 'c' then return 1 end
redis.call('HSET', KEYS[1], 's', 'c', 'r', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
",
    )
});

static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local record = redis.call('HMGET', KEYS[1], 's', 't')
if record[1] ~= 'i' or record[2] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
",
    )
});

/// Inspection (not on the request path): the state, the stored response and the
/// remaining time to live, read in one atomic step.
static INSPECT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local record = redis.call('HMGET', KEYS[1], 's', 'r')
if not record[1] then return {} end
return {record[1], record[2] or '', redis.call('PTTL', KEYS[1])}
",
    )
});

/// Deletion by hand: 1 deleted, 0 not found, 2 in flight and not forced (nothing deleted).
static DELETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local state = redis.call('HGET', KEYS[1], 's')
if not state then return 0 end
if state == 'i' and ARGV[1] ~= '1' then return 2 end
redis.call('DEL', KEYS[1])
return 1
",
    )
});

impl RedisStore {
    /// A store on `pool`.
    pub fn new(pool: RedisPool) -> Self {
        Self { pool }
    }

    /// A pool for `url` with the settings this store wants: no `PING` on checkout (a dead
    /// connection fails its command and is replaced), 16 connections, and no connection made
    /// until the first request, so an app starts while Redis is still down and recovers by
    /// itself once it is up.
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
        &self.pool
    }

    async fn run(&self, invocation: &redis::ScriptInvocation<'_>) -> Result<Value, StoreError> {
        let mut connection = self.pool.get().await.map_err(unavailable)?;
        match invocation.invoke_async(&mut *connection).await {
            Ok(value) => Ok(value),
            // A multiplexed connection whose socket died stays dead, and bb8-redis never
            // reports it broken; without a PING per checkout it would go back to the pool
            // and fail every later request. Replace it in its pool slot with a fresh one and
            // retry once (every script is safe to run twice).
            // A timeout is not a dead connection (the reply may still come): no retry.
            Err(error)
                if !error.is_timeout()
                    && (error.is_unrecoverable_error() || error.is_io_error()) =>
            {
                tracing::debug!(%error, "idempotency: Redis connection lost; reconnecting");
                *connection = self
                    .pool
                    .dedicated_connection()
                    .await
                    .map_err(unavailable)?;
                invocation
                    .invoke_async(&mut *connection)
                    .await
                    .map_err(unavailable)
            }
            Err(error) => Err(unavailable(error)),
        }
    }

    async fn run_flag(&self, invocation: &redis::ScriptInvocation<'_>) -> Result<bool, StoreError> {
        match self.run(invocation).await? {
            Value::Int(flag) => Ok(flag == 1),
            other => Err(unexpected(&other)),
        }
    }
}

fn millis(duration: Duration) -> u64 {
    // PEXPIRE needs at least 1 ms; u64 milliseconds cover any sane duration.
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

fn unavailable(error: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

fn unexpected(value: &Value) -> StoreError {
    StoreError::Protocol(format!("unexpected script reply: {value:?}"))
}

impl IdempotencyStore for RedisStore {
    async fn begin(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<BeginOutcome, StoreError> {
        let mut invocation = BEGIN.prepare_invoke();
        invocation
            .key(key.as_str())
            .arg(RECORD_VERSION.to_string())
            .arg(fingerprint.as_bytes().as_slice())
            .arg(token.as_str())
            .arg(millis(lease));
        let reply = self.run(&invocation).await?;
        let Value::Array(items) = &reply else {
            return Err(unexpected(&reply));
        };
        match items.as_slice() {
            [Value::BulkString(tag)] if tag == b"acquired" => Ok(BeginOutcome::Acquired),
            [Value::BulkString(tag)] if tag == b"in_flight" => Ok(BeginOutcome::InFlight),
            [Value::BulkString(tag)] if tag == b"mismatch" => Ok(BeginOutcome::FingerprintMismatch),
            [Value::BulkString(tag), Value::BulkString(record)] if tag == b"completed" => {
                Ok(BeginOutcome::Completed(StoredResponse::decode(record)?))
            }
            _ => Err(unexpected(&reply)),
        }
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let mut invocation = RENEW.prepare_invoke();
        invocation
            .key(key.as_str())
            .arg(token.as_str())
            .arg(millis(lease));
        self.run_flag(&invocation).await
    }

    async fn commit(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let mut invocation = COMMIT.prepare_invoke();
        invocation
            .key(key.as_str())
            .arg(token.as_str())
            .arg(response.encode())
            .arg(millis(ttl));
        self.run_flag(&invocation).await
    }

    async fn release(&self, key: &StorageKey, token: &LeaseToken) -> Result<bool, StoreError> {
        let mut invocation = RELEASE.prepare_invoke();
        invocation.key(key.as_str()).arg(token.as_str());
        self.run_flag(&invocation).await
    }

    async fn inspect(
        &self,
        key: &StorageKey,
        with_body: bool,
    ) -> Result<Option<RecordSnapshot>, StoreError> {
        let mut invocation = INSPECT.prepare_invoke();
        invocation.key(key.as_str());
        let reply = self.run(&invocation).await?;
        let Value::Array(items) = &reply else {
            return Err(unexpected(&reply));
        };
        let expires_in = |millis: i64| u64::try_from(millis).ok().map(Duration::from_millis);
        match items.as_slice() {
            [] => Ok(None),
            [Value::BulkString(state), _, Value::Int(ttl)] if state == b"i" => {
                Ok(Some(RecordSnapshot::in_flight(expires_in(*ttl))))
            }
            [
                Value::BulkString(state),
                Value::BulkString(record),
                Value::Int(ttl),
            ] if state == b"c" => {
                let response = StoredResponse::decode(record)?;
                Ok(Some(RecordSnapshot::completed(
                    response,
                    expires_in(*ttl),
                    with_body,
                )))
            }
            _ => Err(unexpected(&reply)),
        }
    }

    async fn delete(&self, key: &StorageKey, force: bool) -> Result<Deletion, StoreError> {
        let mut invocation = DELETE.prepare_invoke();
        invocation
            .key(key.as_str())
            .arg(if force { "1" } else { "0" });
        match self.run(&invocation).await? {
            Value::Int(1) => Ok(Deletion::Deleted),
            Value::Int(0) => Ok(Deletion::NotFound),
            Value::Int(2) => Ok(Deletion::InFlight),
            other => Err(unexpected(&other)),
        }
    }
}
