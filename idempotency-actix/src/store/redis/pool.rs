//! [`RedisPool`]: the pool the Redis store is given, and where its URL points.

use std::sync::Arc;
use std::time::Duration;

use bb8_redis::RedisConnectionManager;
use redis::{ConnectionAddr, IntoConnectionInfo};

use super::socket::Endpoint;

/// The pool [`Idempotency::redis`](crate::Idempotency::redis) and
/// [`RedisStore::new`](crate::RedisStore::new) take: a bb8 pool of bb8-redis connections
/// (it dereferences to [`bb8::Pool`], for the app's own commands), and, when
/// [`RedisStore::pool`](crate::RedisStore::pool) made it from a `redis://` or Unix-socket
/// URL, where that URL points.
///
/// With the address, the store opens a connection of its own to that server (a lighter
/// multiplexed connection than redis-rs's: about 4 500 instructions less per round trip,
/// `docs/performance.md` in the repository). Without it (a pool built with
/// `bb8::Pool::builder()`, or a `rediss://` URL), the store shares a redis-rs multiplexed
/// connection from the pool's connection manager. Both behave the same; only the cost
/// differs.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{RedisPool, RedisStore};
///
/// // bb8 builds its pools inside a Tokio runtime, as an Actix app's `main` has.
/// actix_rt::System::new().block_on(async {
///     // The usual way: from a URL, with the store's settings (no connection is made yet).
///     let pool: RedisPool = RedisStore::pool("redis://127.0.0.1:6379").expect("a valid URL");
///
///     // A bb8 pool built by the app converts too (the store then goes through redis-rs).
///     let manager = bb8_redis::RedisConnectionManager::new("redis://127.0.0.1:6379")
///         .expect("a valid URL");
///     let own: RedisPool = bb8::Pool::builder().build_unchecked(manager).into();
///     # let _ = (pool, own);
/// });
/// ```
#[derive(Clone)]
pub struct RedisPool {
    pool: bb8::Pool<RedisConnectionManager>,
    server: Option<Arc<ServerAddress>>,
}

/// Where a `redis://` or Unix-socket URL points, and how to log in.
pub(super) struct ServerAddress {
    pub(super) endpoint: Endpoint,
    pub(super) db: i64,
    pub(super) username: Option<String>,
    pub(super) password: Option<String>,
}

impl RedisPool {
    /// A pool for `url` with the store's settings (see
    /// [`RedisStore::pool`](crate::RedisStore::pool)).
    pub(super) fn for_url(url: &str) -> Result<Self, redis::RedisError> {
        let info = url.into_connection_info()?;
        let endpoint = match info.addr() {
            ConnectionAddr::Tcp(host, port) => Some(Endpoint::Tcp {
                host: host.clone(),
                port: *port,
            }),
            #[cfg(unix)]
            ConnectionAddr::Unix(path) => Some(Endpoint::Unix(path.clone())),
            _ => None,
        };
        let server = endpoint.map(|endpoint| {
            Arc::new(ServerAddress {
                endpoint,
                db: info.redis_settings().db(),
                username: info.redis_settings().username().map(str::to_owned),
                password: info.redis_settings().password().map(str::to_owned),
            })
        });
        let pool = bb8::Pool::builder()
            .max_size(16)
            .test_on_check_out(false)
            .connection_timeout(Duration::from_secs(2))
            .build_unchecked(RedisConnectionManager::new(info)?);
        Ok(Self { pool, server })
    }

    /// The server the store may connect to itself, if the pool was made from its URL.
    pub(super) fn server(&self) -> Option<&ServerAddress> {
        self.server.as_deref()
    }
}

impl From<bb8::Pool<RedisConnectionManager>> for RedisPool {
    /// A pool the app built: the store shares a redis-rs connection from its manager.
    fn from(pool: bb8::Pool<RedisConnectionManager>) -> Self {
        Self { pool, server: None }
    }
}

impl std::ops::Deref for RedisPool {
    type Target = bb8::Pool<RedisConnectionManager>;

    fn deref(&self) -> &Self::Target {
        &self.pool
    }
}

impl std::fmt::Debug for RedisPool {
    /// The pool and the server's address, never the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisPool")
            .field("pool", &self.pool)
            .field(
                "server",
                &self
                    .server
                    .as_ref()
                    .map(|server| format!("{}/{}", server.endpoint, server.db)),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the pool made from `url` points, as its `Debug` shows it.
    fn server_of(url: &str) -> Option<String> {
        actix_rt::System::new().block_on(async {
            let pool = RedisPool::for_url(url).expect("a valid URL");
            pool.server()
                .map(|server| format!("{}/{}", server.endpoint, server.db))
        })
    }

    #[test]
    fn a_redis_url_and_a_unix_socket_url_get_the_stores_own_connection() {
        assert_eq!(
            server_of("redis://127.0.0.1:6380/2").as_deref(),
            Some("127.0.0.1:6380/2")
        );
        #[cfg(unix)]
        {
            assert_eq!(
                server_of("unix:///run/redis/redis.sock?db=3").as_deref(),
                Some("/run/redis/redis.sock/3")
            );
            assert_eq!(
                server_of("redis+unix:///tmp/r.sock").as_deref(),
                Some("/tmp/r.sock/0")
            );
        }
    }
}
