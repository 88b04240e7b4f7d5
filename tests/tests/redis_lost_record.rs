//! An in-flight record lost while its handler runs (issue 13 item 1), as Redis eviction
//! under `allkeys-lru` would lose it, simulated on a private `redis-server` by deleting every
//! key: the loss is counted (and logged as an error), and the first request, once its
//! handler ends, does not commit over the request that took the key meanwhile; where no
//! request took it, its commit writes the completed record anew, so a retry is replayed.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use idempotency_actix::{Idempotency, IdempotencyPolicy, RedisStore};
use idempotency_actix_tests::{FloodServer, PrivateRedis};

/// A server on `redis` (1 s leases) whose `/slow` request with key `evicted` is running (the
/// handle answers once released) when every key is deleted, its record included.
async fn lost_while_running(
    redis: &PrivateRedis,
) -> (
    FloodServer,
    actix_rt::task::JoinHandle<idempotency_actix_tests::Reply>,
) {
    let pool = RedisStore::pool(&redis.url()).unwrap();
    let server = FloodServer::start(
        move || {
            Idempotency::redis(pool.clone())
                .policy(IdempotencyPolicy::default().lease(Duration::from_secs(1)))
        },
        64,
    );
    let first = server.start_slow("evicted").await.unwrap();
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut redis.connection().await)
        .await
        .unwrap();
    (server, first)
}

#[actix_web::test]
async fn a_lost_record_is_counted_and_never_committed_over_its_new_holder() {
    let redis = PrivateRedis::start().await;
    let (server, first) = lost_while_running(&redis).await;
    // The record is gone, so a retry runs the handler again: the double run this incident is.
    let second = server.start_slow("evicted").await.unwrap();
    assert_eq!(server.slow_runs.get(), 2);

    // The first request's next renewal finds the key held by the second.
    lost_records_reach(1).await;

    // The first request ends while the second still holds the key: its commit meets the
    // second's in-flight record and must leave it alone.
    server.release_slow_run(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = server.post("/slow", "evicted").await;
    assert_eq!(
        retry.status,
        StatusCode::CONFLICT,
        "the second request still holds the key: {retry:?}"
    );
    assert_eq!(server.slow_runs.get(), 2);

    server.gate.open();
    let second = second.await.unwrap();
    assert_eq!(second.status, StatusCode::CREATED);
    assert_ne!(first.body, second.body);
    let replay = server.post("/slow", "evicted").await;
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(
        replay.body, second.body,
        "the second holder's record stands"
    );
    assert_eq!(server.slow_runs.get(), 2);
    assert_eq!(Idempotency::lost_records(), 1, "counted once per request");
}

/// Waits (10 s at most) until this process has noticed `count` lost records.
async fn lost_records_reach(count: u64) {
    for _ in 0..1_000 {
        if Idempotency::lost_records() >= count {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(Idempotency::lost_records(), count);
}

/// The record is lost while the handler runs and no request takes the key meanwhile: no
/// other run can have begun, so the commit writes the completed record anew, and a retry
/// gets the replay instead of running the handler a second time.
async fn a_lost_record_that_no_one_took_is_written_anew(redis: PrivateRedis) {
    let (server, first) = lost_while_running(&redis).await;
    // The next renewal finds the record gone: the loss is still counted.
    lost_records_reach(1).await;

    server.gate.open();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = server.post("/slow", "evicted").await;
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.body, first.body);
    assert_eq!(server.slow_runs.get(), 1, "the handler ran once");
}

/// On Redis 7, after the function commit answered "not held".
#[actix_web::test]
async fn a_lost_record_that_no_one_took_is_written_anew_at_commit() {
    a_lost_record_that_no_one_took_is_written_anew(PrivateRedis::start().await).await;
}

/// On Valkey ≥ 8.1, after the `SET … IFEQ` commit wrote nothing.
#[actix_web::test]
async fn a_lost_record_that_no_one_took_is_written_anew_at_commit_on_valkey() {
    a_lost_record_that_no_one_took_is_written_anew(PrivateRedis::start_valkey(&[]).await).await;
}
