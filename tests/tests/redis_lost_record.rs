//! An in-flight record lost while its handler runs (issue 13 item 1), as Redis eviction
//! under `allkeys-lru` would lose it, simulated on a private `redis-server` by deleting every
//! key: the loss is counted (and logged as an error), and the first request, once its
//! handler ends, does not commit over the request that took the key meanwhile (where none
//! did, see `redis_lost_record_written_anew.rs`). One test per file: the count of lost
//! records is the process's.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use idempotency_actix::Idempotency;
use idempotency_actix_tests::{FloodServer, PrivateRedis};

#[actix_web::test]
async fn a_lost_record_is_counted_and_never_committed_over_its_new_holder() {
    let redis = PrivateRedis::start().await;
    let (server, first) = FloodServer::with_a_slow_run_losing_its_record(&redis).await;
    // The record is gone, so a retry runs the handler again: the double run this incident is.
    let second = server.start_slow("evicted").await.unwrap();
    assert_eq!(server.slow_runs.get(), 2);

    // The first request's next renewal finds the key held by the second.
    for _ in 0..1_000 {
        if Idempotency::lost_records() > 0 {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(Idempotency::lost_records(), 1);

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
