//! An in-flight record lost while its handler runs, on a private `redis-server` (Redis 7 or
//! 8, or a `valkey-server`) whose keys are all deleted meanwhile, where no request takes the key
//! before the handler ends: its commit finds the key free and writes the completed record
//! anew, so a retry gets the replay instead of running the handler a second time. (The case
//! where another request took the key is `redis_lost_record.rs`.)

#![allow(clippy::unwrap_used)]

use actix_web::http::StatusCode;
use idempotency_actix_tests::{FloodServer, PrivateRedis};

async fn a_lost_record_that_no_one_took_is_written_anew(redis: PrivateRedis) {
    let (server, first) = FloodServer::with_a_slow_run_losing_its_record(&redis).await;
    server.gate.open();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = server.post("/slow", "evicted").await;
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.body, first.body);
    assert_eq!(server.slow_runs.get(), 1, "the handler ran once");
}

/// On Redis 7 (a server without `SET … IFEQ`, whatever the `PATH`'s `redis-server` is),
/// after the function commit answered "not held".
#[actix_web::test]
async fn a_lost_record_that_no_one_took_is_written_anew_at_commit() {
    a_lost_record_that_no_one_took_is_written_anew(PrivateRedis::start_redis7(&[]).await).await;
}

/// On Valkey ≥ 8.1, after the `SET … IFEQ` commit wrote nothing.
#[actix_web::test]
async fn a_lost_record_that_no_one_took_is_written_anew_at_commit_on_valkey() {
    a_lost_record_that_no_one_took_is_written_anew(PrivateRedis::start_valkey(&[]).await).await;
}

/// On Redis 8.6, after the commit (by function there, though it has `SET … IFEQ`) wrote
/// nothing.
#[actix_web::test]
async fn a_lost_record_that_no_one_took_is_written_anew_at_commit_on_redis_8() {
    a_lost_record_that_no_one_took_is_written_anew(PrivateRedis::start_redis8(&[]).await).await;
}
