//! Redis full under `maxmemory-policy noeviction` while handlers run (issue 13 item 1), on a
//! private `redis-server`: every client still gets its response; while Redis stays full its
//! commit is refused, yet the key stays locked (409, never a second run), even long after the
//! lease; new keys get 503; once memory frees, the commits retried in the background land and
//! retries are replayed.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use idempotency_actix::{Idempotency, IdempotencyPolicy, RedisStore};
use idempotency_actix_tests::{FloodServer, PrivateRedis, Reply};

const LEASE: Duration = Duration::from_secs(1);

/// Bytes of each filler value.
const FILLER_BYTES: usize = 16 * 1024;

/// Sets filler keys until Redis refuses one as out of memory; returns their names.
async fn fill(connection: &mut redis::aio::MultiplexedConnection) -> Vec<String> {
    let value = vec![b'f'; FILLER_BYTES];
    let mut names = Vec::new();
    for i in 0..10_000 {
        let name = format!("filler:{i}");
        let set: redis::RedisResult<()> = redis::cmd("SET")
            .arg(&name)
            .arg(&value)
            .query_async(connection)
            .await;
        match set {
            Ok(()) => names.push(name),
            Err(error) => {
                assert_eq!(error.code(), Some("OOM"), "filling Redis: {error}");
                return names;
            }
        }
    }
    panic!("10 000 fillers of 16 KiB never filled a 4 MB Redis");
}

/// Retries `key` until it is replayed (each answer meanwhile must be 409), for 10 s at most.
async fn replay_once_committed(server: &FloodServer, key: &str) -> Reply {
    for _ in 0..200 {
        let retry = server.post("/slow", key).await;
        if retry.is_replay() {
            return retry;
        }
        assert_eq!(retry.status, StatusCode::CONFLICT, "{key}: {retry:?}");
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the commit of {key} never landed once memory was freed");
}

#[actix_web::test]
async fn a_full_redis_keeps_keys_locked_until_their_commits_land() {
    let redis =
        PrivateRedis::start_with_args(&["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"])
            .await;
    let pool = RedisStore::pool(&redis.url()).unwrap();
    let server = FloodServer::start(
        move || Idempotency::redis(pool.clone()).policy(IdempotencyPolicy::default().lease(LEASE)),
        64,
    );
    let keys: Vec<String> = (0..3).map(|i| format!("held-{i}")).collect();
    let mut held = Vec::new();
    for key in &keys {
        held.push(server.start_slow(key).await.unwrap());
    }

    let mut connection = redis.connection().await;
    let fillers = fill(&mut connection).await;
    server.gate.open();
    let mut firsts = Vec::new();
    for (key, first) in keys.iter().zip(held) {
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{key}: {first:?}");
        firsts.push(first);
    }

    // Well past the lease: the keys are still locked, by renewals Redis accepts when full.
    actix_rt::time::sleep(LEASE * 3).await;
    for key in &keys {
        let retry = server.post("/slow", key).await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{key}: {retry:?}");
    }
    let new_key = server.post("/orders", "new").await;
    assert_eq!(
        new_key.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{new_key:?}"
    );
    assert_eq!(server.runs.get(), 0);
    assert_eq!(server.slow_runs.get(), 3);

    let _: () = redis::cmd("DEL")
        .arg(&fillers)
        .query_async(&mut connection)
        .await
        .unwrap();
    for (key, first) in keys.iter().zip(&firsts) {
        let replay = replay_once_committed(&server, key).await;
        assert_eq!(replay.status, StatusCode::CREATED);
        assert_eq!(replay.body, first.body, "{key}");
    }
    assert_eq!(server.slow_runs.get(), 3, "no handler ran twice");
    assert_eq!(
        Idempotency::lost_records(),
        0,
        "a refused commit is no lost record"
    );
}
