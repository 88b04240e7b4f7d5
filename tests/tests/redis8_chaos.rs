//! The store on a current Redis (8.6, which has `SET … IFEQ`, though the store commits by
//! function there: see `docs/redis-8-set-ifeq.md`), under what a payments app must
//! survive, on servers of the test's own.
//!
//! A Redis user that may not call functions (`-@scripting`), or that may call them
//! (`+fcall`) while no one has loaded them, has its keyed requests refused with 503 before
//! any handler runs, on Redis 8.6 as on Redis 7 and Valkey. Where the commit is `SET … IFEQ`
//! (Valkey ≥ 8.1) its `begin`, commits and replays would work, but no lease could be renewed
//! (a duplicate runs the handler again once a slow request outlives its lease) and no key
//! given back.
//! Once the user is granted `FCALL` (or someone loads the functions), the same app is
//! served.
//!
//! A record overwritten by hand with bytes this version cannot read is refused for good
//! (503), never freed for a retry to run the handler again; an in-flight record replaced by
//! a key of another type is reported lost once, not retried for a day, and a retry's `begin`
//! that finds it sends nothing after it.
//!
//! The Redis 8.6 server is `REDIS8_SERVER`, else `/opt/redis-8.6/bin/redis-server` (see
//! `idempotency_actix_tests::redis8_server`).

use std::time::{Duration, Instant};

use actix_web::http::StatusCode;
use idempotency_actix::{FailMode, Idempotency, RedisStore};
use idempotency_actix_tests::{FloodServer, PrivateRedis, keys_under};

/// A Redis ≥ 8.4 server of the test's own (see [`redis8_server`]), checked to take
/// `SET … IFEQ`.
///
/// # Panics
///
/// When no Redis ≥ 8.4 is found (with the install hint), or it does not answer within 10 s.
///
/// [`redis8_server`]: idempotency_actix_tests::redis8_server
async fn redis8() -> PrivateRedis {
    let redis = PrivateRedis::start_redis8(&[]).await;
    assert!(
        redis.takes_conditional_set().await,
        "the Redis 8 at {} has no SET … IFEQ",
        redis.url()
    );
    redis
}

/// How long a store refusing a user may take to serve it once it may: its retry interval
/// (1 s), with room.
const SERVED_WITHIN: Duration = Duration::from_secs(5);

/// Sets the ACL of user `app` (no password) on the server of `connection`.
async fn set_app_user(connection: &mut redis::aio::MultiplexedConnection, rules: &[&str]) {
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "app", "on", "nopass", "~*", "+@all"][..])
        .arg(rules)
        .query_async(connection)
        .await
        .expect("ACL SETUSER");
}

/// An app on the server on `port`, connecting as user `app`.
fn app_of(port: u16) -> FloodServer {
    let pool =
        RedisStore::pool(&format!("redis://app:any@127.0.0.1:{port}")).expect("a pool for app");
    FloodServer::start(move || Idempotency::redis(pool.clone()), 64)
}

/// An app on `url` as the default user serves a key: the functions are loaded.
async fn load_the_functions(url: String) {
    let pool = RedisStore::pool(&url).expect("a pool for the default user");
    let loader = FloodServer::start(move || Idempotency::redis(pool.clone()), 64);
    let loaded = loader.post("/orders", "load").await;
    assert_eq!(loaded.status, StatusCode::CREATED, "{loaded:?}");
}

/// Keyed requests to `app` get 503 and no handler runs.
async fn refused_with_no_run(app: &FloodServer) {
    let mut statuses = Vec::new();
    for key in ["refused-1", "refused-2", "refused-3"] {
        statuses.push(app.post("/orders", key).await.status);
    }
    assert_eq!(statuses, [StatusCode::SERVICE_UNAVAILABLE; 3]);
    assert_eq!(
        app.runs.get(),
        0,
        "handlers ran with no renewal or release possible"
    );
}

/// `app` runs a new key once (within its retry interval; until then it is refused, with no
/// run) and replays it.
async fn served(app: &FloodServer) {
    let since = Instant::now();
    let first = loop {
        let reply = app.post("/orders", "charge-1").await;
        if reply.status != StatusCode::SERVICE_UNAVAILABLE || since.elapsed() > SERVED_WITHIN {
            break reply;
        }
        assert_eq!(app.runs.get(), 0, "a refused request ran");
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = app.post("/orders", "charge-1").await;
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(app.runs.get(), 1);
}

/// A user without `@scripting` on a server that has the functions: refused (on Valkey its
/// `SET`s alone would serve, replays included, with no lease renewed), then served once granted
/// `FCALL` (though still not `FCALL_RO` nor `FUNCTION`).
#[actix_web::test]
async fn a_user_who_may_not_call_functions_is_refused_until_granted_fcall() {
    let redis = redis8().await;
    refused_until_granted_fcall(redis.url(), redis.port(), redis.connection().await).await;
}

/// The same on Redis 7 (a server without `SET … IFEQ`, whatever the `PATH`'s `redis-server`
/// is), where the commit is a function call too.
#[actix_web::test]
async fn a_redis_7_user_who_may_not_call_functions_is_refused_until_granted_fcall() {
    let redis = PrivateRedis::start_redis7(&[]).await;
    refused_until_granted_fcall(redis.url(), redis.port(), redis.connection().await).await;
}

/// The same on Valkey (≥ 8.1, which has `SET … IFEQ` too).
#[actix_web::test]
async fn a_valkey_user_who_may_not_call_functions_is_refused_until_granted_fcall() {
    let redis = PrivateRedis::start_valkey(&[]).await;
    refused_until_granted_fcall(redis.url(), redis.port(), redis.connection().await).await;
}

/// The functions loaded on the server at `url` (port `port`), then an app connecting as a
/// user without `@scripting` refused with no run, and served once the user may `FCALL`.
async fn refused_until_granted_fcall(
    url: String,
    port: u16,
    mut admin: redis::aio::MultiplexedConnection,
) {
    load_the_functions(url).await;
    set_app_user(&mut admin, &["-@scripting"]).await;
    let app = app_of(port);
    refused_with_no_run(&app).await;
    set_app_user(&mut admin, &["-@scripting", "+fcall"]).await;
    served(&app).await;
}

/// A user who may call the functions but neither load them nor ask for them read-only
/// (`-@scripting +fcall`), while no one has loaded them: refused, then served once someone
/// who may loads them.
#[actix_web::test]
async fn a_user_who_may_only_fcall_is_refused_until_the_functions_are_loaded() {
    let redis = redis8().await;
    let mut admin = redis.connection().await;
    set_app_user(&mut admin, &["-@scripting", "+fcall"]).await;

    let app = app_of(redis.port());
    refused_with_no_run(&app).await;
    load_the_functions(redis.url()).await;
    served(&app).await;
}

/// A completed record overwritten by hand (`SET key garbage`) with bytes this version cannot
/// read whose second byte happens to be `a`, the state byte of the store's markers of
/// abandoned tokens: every retry is refused (503), as for any unreadable record, and the
/// handler never runs again (an unreadable record is never a free key).
#[actix_web::test]
async fn a_record_overwritten_with_unreadable_bytes_is_never_a_free_key() {
    let redis = redis8().await;
    let pool = RedisStore::pool(&redis.url()).expect("a pool");
    let app = FloodServer::start(move || Idempotency::redis(pool.clone()), 64);
    let first = app.post("/orders", "charge-1").await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");

    let mut admin = redis.connection().await;
    let keys = keys_under(&mut admin, "idempotency:").await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    let _: () = redis::cmd("SET")
        .arg(&keys[0])
        .arg("garbage")
        .query_async(&mut admin)
        .await
        .expect("SET");

    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(app.post("/orders", "charge-1").await.status);
    }
    assert_eq!(statuses, [StatusCode::SERVICE_UNAVAILABLE; 3]);
    assert_eq!(app.runs.get(), 1, "the handler ran again for the key");
}

/// An in-flight record replaced by hand with a key of another type (`DEL`, then `HSET`)
/// while its handler runs: the client gets its response, the commit answers that the record
/// is lost (counted), and the store then leaves the key alone; it does not renew and retry
/// the commit for the record's whole ttl. Retries are refused (503), with no second run.
#[actix_web::test]
async fn an_in_flight_record_replaced_by_another_type_is_lost_not_retried_for_a_day() {
    let redis = redis8().await;
    let pool = RedisStore::pool(&redis.url()).expect("a pool");
    let app = FloodServer::start(move || Idempotency::redis(pool.clone()), 64);
    let Ok(running) = app.start_slow("charge-1").await else {
        panic!("the slow request was refused");
    };
    let mut admin = redis.connection().await;
    replace_the_record_with_a_hash(&mut admin).await;

    let lost_before = Idempotency::lost_records();
    app.gate.open();
    let first = running.await.expect("the slow request's reply");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let since = Instant::now();
    while Idempotency::lost_records() == lost_before {
        assert!(
            since.elapsed() < SERVED_WITHIN,
            "the commit never answered that the record is lost: the store retries it"
        );
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
    // Nothing more is sent for the key: no renewal, no commit retried.
    let before = commands_sent(&mut admin).await;
    actix_rt::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(commands_sent(&mut admin).await, before);

    // A retry's `begin` finds the key of another type: it wrote nothing, so nothing is
    // given back (no `abandon` after it).
    let before = commands_sent(&mut admin).await;
    let retry = app.post("/slow", "charge-1").await;
    assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE, "{retry:?}");
    assert_eq!(
        commands_sent(&mut admin).await - before,
        1,
        "the refused retry sent more than its `begin`"
    );
    assert_eq!(app.slow_runs.get(), 1);
}

/// Failing open, a request whose key holds a key of another type runs the handler
/// unprotected, as for any store error; its `begin` wrote nothing, so no commit and no
/// abandon follow it (it used to commit under its token and then abandon it, retried about
/// once a second for the lease: about 30 commands per request).
#[actix_web::test]
async fn failing_open_a_key_of_another_type_sends_nothing_after_its_begin() {
    let redis = redis8().await;
    let pool = RedisStore::pool(&redis.url()).expect("a pool");
    let app = FloodServer::start(
        move || Idempotency::redis(pool.clone()).on_store_error(FailMode::Open),
        64,
    );
    // A first request (the store connects and loads its functions) leaves its record,
    // which is then replaced by a key of another type.
    assert_eq!(
        app.post("/orders", "other").await.status,
        StatusCode::CREATED
    );
    let mut admin = redis.connection().await;
    replace_the_record_with_a_hash(&mut admin).await;

    let before = commands_sent(&mut admin).await;
    let reply = app.post("/orders", "other").await;
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    assert_eq!(app.runs.get(), 2);
    // Room for a background commit or abandon to show (the first retry comes after 50 ms).
    actix_rt::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        commands_sent(&mut admin).await - before,
        1,
        "more than the `begin` was sent for a key of another type"
    );
}

/// Replaces the one record on the server of `admin` with a key of another type (`DEL`, then
/// `HSET`, as another program could).
async fn replace_the_record_with_a_hash(admin: &mut redis::aio::MultiplexedConnection) {
    let keys = keys_under(admin, "idempotency:").await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    let _: () = redis::pipe()
        .cmd("DEL")
        .arg(&keys[0])
        .cmd("HSET")
        .arg(&keys[0])
        .arg("field")
        .arg("value")
        .query_async(admin)
        .await
        .expect("DEL, HSET");
}

/// How many commands the server ran, `INFO` and `CONFIG` (the test's own) left out.
async fn commands_sent(admin: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .expect("INFO commandstats");
    info.lines()
        .filter(|line| !line.starts_with("cmdstat_info:") && !line.starts_with("cmdstat_config"))
        .filter_map(|line| {
            line.split_once("calls=")?
                .1
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}
