//! Redis full under `maxmemory-policy noeviction` while handlers run (issue 13 item 1), on a
//! private `redis-server`: every client still gets its response; while Redis stays full its
//! commit is refused, yet the key stays locked (409, never a second run), even long after the
//! lease; new keys get 503; once memory frees, the commits retried in the background land and
//! retries are replayed.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use idempotency_actix::{
    Idempotency, IdempotencyKey, IdempotencyPolicy, IdempotencyStore, LeaseToken, RedisStore,
    StorageKey,
};
use idempotency_actix_tests::{FloodServer, PrivateRedis, Reply};

const LEASE: Duration = Duration::from_secs(1);

/// Bytes of the filler values, largest first: each size fills what the one before left.
const FILLER_BYTES: [usize; 3] = [16 * 1024, 1024, 64];

/// Sets filler keys until Redis refuses even the smallest as out of memory; returns their
/// names. Filling down to small values leaves no room for a record: Valkey, whose clients
/// share one query buffer, frees the last large value's buffer once it is refused.
async fn fill(connection: &mut redis::aio::MultiplexedConnection) -> Vec<String> {
    let mut names = Vec::new();
    for bytes in FILLER_BYTES {
        let value = vec![b'f'; bytes];
        for i in 0.. {
            assert!(
                i < 10_000,
                "10 000 fillers of {bytes} bytes never filled a 4 MB Redis"
            );
            let name = format!("filler:{bytes}:{i}");
            let set: redis::RedisResult<()> = redis::cmd("SET")
                .arg(&name)
                .arg(&value)
                .query_async(connection)
                .await;
            match set {
                Ok(()) => names.push(name),
                Err(error) => {
                    assert_eq!(error.code(), Some("OOM"), "filling Redis: {error}");
                    break;
                }
            }
        }
    }
    names
}

/// [`fill`]s Redis, then lowers its limit: Valkey frees some buffers of its own a moment
/// after the filling stops, room enough for a commit, and a lower limit keeps either server
/// full until the fillers are deleted.
async fn fill_and_keep_full(connection: &mut redis::aio::MultiplexedConnection) -> Vec<String> {
    let fillers = fill(connection).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("3mb")
        .query_async(connection)
        .await
        .unwrap();
    fillers
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

const FULL_AT_4_MB: [&str; 4] = ["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"];

#[actix_web::test]
async fn a_full_redis_keeps_keys_locked_until_their_commits_land() {
    keys_stay_locked_until_their_commits_land(PrivateRedis::start_with_args(&FULL_AT_4_MB).await)
        .await;
}

/// The same on Valkey ≥ 8.1, where the commit is `SET … IFEQ`: refused when full like the
/// function, and retried.
#[actix_web::test]
async fn a_full_valkey_keeps_keys_locked_until_their_commits_land() {
    keys_stay_locked_until_their_commits_land(PrivateRedis::start_valkey(&FULL_AT_4_MB).await)
        .await;
}

/// The same on Redis 8.6, which the store commits to by function though it has
/// `SET … IFEQ`: this test found Redis 8.6.3 writing such a `SET` into another key
/// (`docs/redis-8-set-ifeq.md`).
#[actix_web::test]
async fn a_full_redis_8_keeps_keys_locked_until_their_commits_land() {
    keys_stay_locked_until_their_commits_land(PrivateRedis::start_redis8(&FULL_AT_4_MB).await)
        .await;
}

async fn keys_stay_locked_until_their_commits_land(redis: PrivateRedis) {
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
    let fillers = fill_and_keep_full(&mut connection).await;
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

/// A new key that a full Redis refuses leaves nothing behind: its `begin` wrote nothing, so
/// there is no token to abandon. (Each refused key used to leave a marker for the route's
/// TTL, written past `maxmemory` by the `allow-oom` abandon function, so a flood of new keys
/// against a full Redis grew its memory for a day.)
#[actix_web::test]
async fn new_keys_refused_by_a_full_redis_leave_nothing_behind() {
    let redis = PrivateRedis::start_with_args(&FULL_AT_4_MB).await;
    let pool = RedisStore::pool(&redis.url()).unwrap();
    let server = FloodServer::start(move || Idempotency::redis(pool.clone()), 64);
    // The first request opens the worker's connection (and loads the functions) while
    // Redis has room.
    assert_eq!(
        server.post("/orders", "before").await.status,
        StatusCode::CREATED
    );
    let mut connection = redis.connection().await;
    fill_and_keep_full(&mut connection).await;
    let keys_before: u64 = redis::cmd("DBSIZE")
        .query_async(&mut connection)
        .await
        .unwrap();
    for i in 0..20 {
        let refused = server.post("/orders", &format!("new-{i}")).await;
        assert_eq!(
            refused.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "new-{i}: {refused:?}"
        );
    }
    // An abandon would run 50 ms after its refusal, and again up to the lease.
    actix_rt::time::sleep(Duration::from_secs(2)).await;
    let keys_after: u64 = redis::cmd("DBSIZE")
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(keys_after, keys_before, "refused keys left records behind");
    assert_eq!(server.runs.get(), 1);
}

/// A new key that meets another token's marker on a full Redis is refused as any new key
/// is, and the marker stays as it was: the `claim` a marker calls for is refused before it
/// runs, so this request's token holds nothing. (It used to be taken for a store failure,
/// whose abandon, flagged `allow-oom`, added the token to the marker on the full server.)
#[actix_web::test]
async fn a_new_key_over_a_marker_refused_by_a_full_redis_leaves_the_marker_as_it_was() {
    let redis = PrivateRedis::start_with_args(&FULL_AT_4_MB).await;
    let pool = RedisStore::pool(&redis.url()).unwrap();
    let store = RedisStore::new(pool.clone());
    // The storage key the server's default prefix and global scope give `marked`.
    let key = StorageKey::new(
        "idempotency:",
        b"",
        &IdempotencyKey::parse(b"marked").unwrap(),
    );
    store
        .abandon(&key, &LeaseToken::generate(), Duration::from_secs(60))
        .await
        .unwrap();
    let mut connection = redis.connection().await;
    let marker: Option<Vec<u8>> = redis::cmd("GET")
        .arg(key.as_str())
        .query_async(&mut connection)
        .await
        .unwrap();
    assert!(marker.is_some(), "the abandon left no marker");

    let server = FloodServer::start(move || Idempotency::redis(pool.clone()), 64);
    // The first request opens the worker's connection (and loads the functions) while
    // Redis has room.
    assert_eq!(
        server.post("/orders", "before").await.status,
        StatusCode::CREATED
    );
    fill_and_keep_full(&mut connection).await;
    let refused = server.post("/orders", "marked").await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    // An abandon would run 50 ms after the refusal, and again up to the lease.
    actix_rt::time::sleep(Duration::from_secs(2)).await;
    let after: Option<Vec<u8>> = redis::cmd("GET")
        .arg(key.as_str())
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(after, marker, "the refused request changed the marker");
    assert_eq!(server.runs.get(), 1);
}
