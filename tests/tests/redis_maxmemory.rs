//! Redis under more keys than its `maxmemory` holds, on a private `redis-server`: with the
//! setting the README recommends (`volatile-lru`), new keys keep getting 201 and requests
//! holding a lease still complete and commit while the flood turns Redis over more slowly
//! than its LRU clock's second; with Redis's default (`noeviction`), a full Redis refuses new
//! keys.
//!
//! Only what clients see is checked, so the tests hold whatever the record format.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use idempotency_actix::{Idempotency, IdempotencyPolicy, RedisStore};
use idempotency_actix_tests::{FloodServer, PrivateRedis};

/// The README's recommended setting, with a budget small enough to fill in seconds.
const RECOMMENDED: [&str; 6] = [
    "--maxmemory",
    "4mb",
    "--maxmemory-policy",
    "volatile-lru",
    "--maxmemory-samples",
    "10",
];

/// Responses of 1 KiB, so about 2 000 keys fill 4 MB.
const BODY_BYTES: usize = 1024;

/// The flood's pace: Redis's 4 MB then turn over in about 3.5 s. Redis's LRU clock counts
/// whole seconds, so a record renewed a moment ago is as old to its eviction as a key
/// written in the same second: an in-flight record is kept only while Redis holds keys
/// older than its last renewal by a second or more (unpaced, this flood turned Redis over
/// in under a second and evicted an in-flight record in 2 of 3 runs).
const FLOOD_KEYS_PER_SECOND: u32 = 600;

/// A flood server on `redis`. The lease is 2 s, renewed about every 667 ms, so the records
/// of requests in flight are touched far more often than the paced flood replaces what
/// Redis holds (as a 30 s lease is against a Redis sized for the ttl).
fn server_on(redis: &PrivateRedis) -> FloodServer {
    let pool = RedisStore::pool(&redis.url()).unwrap();
    FloodServer::start(
        move || {
            Idempotency::redis(pool.clone())
                .policy(IdempotencyPolicy::default().lease(Duration::from_secs(2)))
        },
        BODY_BYTES,
    )
}

#[actix_web::test]
async fn with_volatile_lru_new_keys_get_201_and_requests_in_flight_still_commit() {
    let redis = PrivateRedis::start_with_args(&RECOMMENDED).await;
    let server = server_on(&redis);
    let mut held = Vec::new();
    for i in 0..3 {
        held.push(server.start_slow(&format!("held-{i}")).await.unwrap());
    }

    server
        .flood_at_most("flood", 4_000, FLOOD_KEYS_PER_SECOND)
        .await;
    let evicted: u64 = redis.info_field("evicted_keys").await.parse().unwrap();
    assert!(
        evicted > 1_000,
        "the flood filled Redis: {evicted} keys evicted"
    );

    // Only a held record can expire (the flood's live for the ttl): an expiry means a renewal
    // came late, an eviction that the flood outpaced the LRU clock.
    let expired = redis.info_field("expired_keys").await;
    for i in 0..held.len() {
        let duplicate = server.post("/slow", &format!("held-{i}")).await;
        assert_eq!(
            duplicate.status,
            StatusCode::CONFLICT,
            "held-{i} ({expired} keys expired, {evicted} evicted): {duplicate:?}"
        );
    }
    server.gate.open();
    for (i, first) in held.into_iter().enumerate() {
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "held-{i}: {first:?}");
        let retry = server.post("/slow", &format!("held-{i}")).await;
        assert!(retry.is_replay(), "held-{i} was committed: {retry:?}");
        assert_eq!(retry.body, first.body);
    }
    assert_eq!(server.slow_runs.get(), 3);
}

#[actix_web::test]
async fn with_the_default_noeviction_a_full_redis_refuses_new_keys() {
    let redis = PrivateRedis::start_with_args(&["--maxmemory", "4mb"]).await;
    let server = server_on(&redis);
    for i in 0..20_000 {
        let reply = server.post("/orders", &format!("key-{i}")).await;
        if reply.status == StatusCode::SERVICE_UNAVAILABLE {
            assert!(i > 100, "refused after only {i} keys");
            return;
        }
        assert_eq!(reply.status, StatusCode::CREATED, "key-{i}: {reply:?}");
    }
    panic!("20 000 keys of 1 KiB never filled a 4 MB Redis");
}
