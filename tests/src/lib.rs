//! Shared helpers of the end-to-end tests: Redis connections with clear failure messages,
//! unique key prefixes, and handler-run counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency_actix::{RedisPool, RedisStore};

/// How to start Redis, printed whenever a test cannot reach it.
pub const START_REDIS: &str = "start it with: redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no (or set REDIS_URL)";

/// The Redis the tests use: `REDIS_URL`, or `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A plain connection to the test Redis, for inspecting what the store wrote.
///
/// # Panics
///
/// When Redis does not answer, with a message that says how to start it.
pub async fn redis_connection() -> redis::aio::MultiplexedConnection {
    let url = redis_url();
    let client = redis::Client::open(url.as_str())
        .unwrap_or_else(|error| panic!("REDIS_URL {url:?} is not a Redis URL: {error}"));
    let mut connection = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|error| panic!("Redis at {url} is not reachable ({error}); {START_REDIS}"));
    let pong: String = redis::cmd("PING")
        .query_async(&mut connection)
        .await
        .unwrap_or_else(|error| {
            panic!("Redis at {url} does not answer PING ({error}); {START_REDIS}")
        });
    assert_eq!(pong, "PONG");
    connection
}

/// A bb8 pool on the test Redis, checked to answer.
///
/// # Panics
///
/// When Redis does not answer, with a message that says how to start it.
pub async fn redis_pool() -> RedisPool {
    redis_connection().await;
    RedisStore::pool(&redis_url()).expect("valid Redis URL")
}

/// A key prefix no other test (or earlier run) uses.
pub fn unique_prefix(test: &str) -> String {
    format!("test:{test}:{}:", uuid::Uuid::new_v4().simple())
}

/// The keys under `prefix` (with SCAN, never KEYS).
pub async fn keys_under(
    connection: &mut redis::aio::MultiplexedConnection,
    prefix: &str,
) -> Vec<String> {
    let mut keys = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(connection)
            .await
            .expect("SCAN");
        keys.extend(batch);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
}

/// Counts how many times a handler ran; clones share the count.
#[derive(Debug, Clone, Default)]
pub struct RunCounter(Arc<AtomicUsize>);

impl RunCounter {
    /// Records one run and returns the count after it.
    pub fn record(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// How many runs were recorded.
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}
