//! The opt-in replay cache over real HTTP against a private `redis-server`: a cached replay
//! is byte-identical and costs no Redis command, a request with another fingerprint still
//! gets 422, and an entry is never served past its record's TTL. The same on the PostgreSQL
//! store, whose `begin` reports a completed record's remaining TTL too. A cached record
//! serves only its own scope, and a stored error response or a record kept without its body
//! replays from the cache as it does from Redis.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{App, HttpResponse, web};
use idempotency_actix::{
    Idempotency, IdempotencyPolicy, IdempotentRoute, KeyScope, RedisPool, RedisStore, ReplayCache,
};
use idempotency_actix_tests::{PrivateRedis, Reply, RunCounter, TestDatabase};

async fn create(runs: web::Data<RunCounter>, body: web::Bytes) -> HttpResponse {
    let seq = runs.record();
    HttpResponse::Created()
        .insert_header(("location", format!("/orders/{seq}")))
        .insert_header(("x-binary", "a\tb"))
        .json(serde_json::json!({ "seq": seq, "echo": String::from_utf8_lossy(&body) }))
}

fn start(pool: RedisPool, cache: ReplayCache, runs: RunCounter) -> actix_test::TestServer {
    start_on(move || Idempotency::redis(pool.clone()), cache, runs)
}

/// The app of these tests on the store `idempotency` makes, with `cache`.
fn start_on(
    idempotency: impl Fn() -> Idempotency + Clone + Send + 'static,
    cache: ReplayCache,
    runs: RunCounter,
) -> actix_test::TestServer {
    actix_test::start(move || {
        App::new()
            .app_data(web::Data::new(runs.clone()))
            .wrap(idempotency().replay_cache(cache.clone()))
            .service(
                web::resource("/orders")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(create)),
            )
            .service(
                web::resource("/short")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().ttl(Duration::from_secs(1)),
                    ))
                    .route(web::post().to(create)),
            )
    })
}

async fn post(server: &actix_test::TestServer, path: &str, key: &str, body: &str) -> Reply {
    send(server.post(path), key, body).await
}

/// Sends `request` with the idempotency key `key` and `body`.
async fn send(request: awc::ClientRequest, key: &str, body: &str) -> Reply {
    let response = request
        .insert_header(("idempotency-key", key))
        .send_body(body.to_owned())
        .await
        .unwrap();
    Reply::read(response).await.unwrap()
}

#[actix_web::test]
async fn a_cached_replay_is_byte_identical_and_sends_no_redis_command() {
    let redis = PrivateRedis::start().await;
    let runs = RunCounter::default();
    let cache = ReplayCache::with_max_bytes(1 << 20);
    let server = start(RedisStore::pool(&redis.url()).unwrap(), cache, runs.clone());

    let first = post(&server, "/orders", "k1", "book").await;
    assert_eq!(first.status, StatusCode::CREATED);
    // The first replay comes from Redis (one command) and fills the cache.
    redis.take_command_counts().await;
    let from_redis = post(&server, "/orders", "k1", "book").await;
    assert!(from_redis.is_replay());
    assert_eq!(
        redis.take_command_counts().await.get("set").copied(),
        Some(1),
        "the first replay asks Redis"
    );

    for _ in 0..3 {
        let cached = post(&server, "/orders", "k1", "book").await;
        assert_eq!(cached.status, StatusCode::CREATED);
        assert!(cached.is_replay());
        assert_eq!(cached.body, first.body, "byte-identical body");
        assert_eq!(cached.header("location"), first.header("location"));
        assert_eq!(cached.header("x-binary"), Some("a\tb"));
        assert_eq!(cached.header("content-type"), first.header("content-type"));
    }
    assert_eq!(
        redis.take_command_counts().await,
        Default::default(),
        "cached replays send no command to Redis"
    );
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn a_cached_record_still_refuses_another_fingerprint() {
    let redis = PrivateRedis::start().await;
    let runs = RunCounter::default();
    let cache = ReplayCache::with_max_bytes(1 << 20);
    let server = start(RedisStore::pool(&redis.url()).unwrap(), cache, runs.clone());

    assert_eq!(
        post(&server, "/orders", "k2", "book").await.status,
        StatusCode::CREATED
    );
    assert!(post(&server, "/orders", "k2", "book").await.is_replay());
    redis.take_command_counts().await;

    let other = post(&server, "/orders", "k2", "pen").await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        other.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(
        redis.take_command_counts().await,
        Default::default(),
        "answered from the cache"
    );
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn an_entry_is_not_served_after_its_ttl() {
    let redis = PrivateRedis::start().await;
    let runs = RunCounter::default();
    let cache = ReplayCache::with_max_bytes(1 << 20);
    let server = start(RedisStore::pool(&redis.url()).unwrap(), cache, runs.clone());

    // `/short` keeps its records 1 s.
    assert_eq!(
        post(&server, "/short", "k3", "book").await.status,
        StatusCode::CREATED
    );
    assert!(post(&server, "/short", "k3", "book").await.is_replay());
    redis.take_command_counts().await;
    assert!(post(&server, "/short", "k3", "book").await.is_replay());
    assert_eq!(
        redis.take_command_counts().await,
        Default::default(),
        "the entry is in the cache before its TTL ends"
    );
    assert_eq!(runs.get(), 1);

    actix_rt::time::sleep(Duration::from_millis(1_300)).await;
    let after = post(&server, "/short", "k3", "book").await;
    assert_eq!(after.status, StatusCode::CREATED);
    assert!(
        !after.is_replay(),
        "the record expired, in Redis and in the cache"
    );
    assert_eq!(runs.get(), 2);
}

#[actix_web::test]
async fn a_record_deleted_in_redis_stays_replayable_from_the_cache_until_its_ttl() {
    // What the cache trades (README "Performance"), shown rather than only said.
    let redis = PrivateRedis::start().await;
    let runs = RunCounter::default();
    let cache = ReplayCache::with_max_bytes(1 << 20);
    let server = start(RedisStore::pool(&redis.url()).unwrap(), cache, runs.clone());

    let first = post(&server, "/orders", "k4", "book").await;
    assert!(post(&server, "/orders", "k4", "book").await.is_replay());
    let mut connection = redis.connection().await;
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut connection)
        .await
        .unwrap();
    let cached = post(&server, "/orders", "k4", "book").await;
    assert!(cached.is_replay());
    assert_eq!(cached.body, first.body);
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn without_the_cache_every_replay_asks_redis() {
    let redis = PrivateRedis::start().await;
    let runs = RunCounter::default();
    let pool = RedisStore::pool(&redis.url()).unwrap();
    let server = actix_test::start({
        let runs = runs.clone();
        move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(Idempotency::redis(pool.clone()))
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(create)),
                )
        }
    });
    post(&server, "/orders", "k5", "book").await;
    redis.take_command_counts().await;
    for _ in 0..3 {
        assert!(post(&server, "/orders", "k5", "book").await.is_replay());
    }
    assert_eq!(
        redis.take_command_counts().await.get("set").copied(),
        Some(3)
    );
}

#[actix_web::test]
async fn on_postgres_a_replay_is_cached_and_not_served_after_its_ttl() {
    let database = TestDatabase::create().await;
    let store = database.store().await;
    let runs = RunCounter::default();
    let cache = ReplayCache::with_max_bytes(1 << 20);
    let server = start_on(
        move || Idempotency::postgres(store.clone()),
        cache,
        runs.clone(),
    );

    let first = post(&server, "/orders", "k6", "book").await;
    assert_eq!(first.status, StatusCode::CREATED);
    // The first replay reads the table and fills the cache.
    assert!(post(&server, "/orders", "k6", "book").await.is_replay());
    assert_eq!(
        post(&server, "/orders", "k6", "other").await.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "another fingerprint is still refused"
    );
    // With the row gone from the table, only the cache can answer.
    let client = database.connection().await;
    let deleted = client
        .execute("DELETE FROM idempotency_records", &[])
        .await
        .unwrap();
    assert!(deleted >= 1);
    let cached = post(&server, "/orders", "k6", "book").await;
    assert!(cached.is_replay(), "served from the cache");
    assert_eq!(cached.body, first.body);
    assert_eq!(runs.get(), 1);

    // `/short` keeps its records 1 s: the cache keeps them no longer.
    assert_eq!(
        post(&server, "/short", "k7", "book").await.status,
        StatusCode::CREATED
    );
    assert!(post(&server, "/short", "k7", "book").await.is_replay());
    actix_rt::time::sleep(Duration::from_millis(1_300)).await;
    let after = post(&server, "/short", "k7", "book").await;
    assert!(
        !after.is_replay(),
        "the record expired, in the table and in the cache"
    );
    assert_eq!(runs.get(), 3);
}

async fn failed(runs: web::Data<RunCounter>) -> HttpResponse {
    let seq = runs.record();
    HttpResponse::InternalServerError().json(serde_json::json!({ "seq": seq }))
}

async fn large(runs: web::Data<RunCounter>) -> HttpResponse {
    let seq = runs.record();
    HttpResponse::Created()
        .insert_header(("location", format!("/large/{seq}")))
        .body(vec![b'x'; 4096])
}

/// Sends `path` with `key` as `tenant` (a scope header of its own).
async fn post_as(server: &actix_test::TestServer, tenant: &str, key: &str, body: &str) -> Reply {
    send(
        server.post("/orders").insert_header(("x-tenant", tenant)),
        key,
        body,
    )
    .await
}

#[actix_web::test]
async fn a_cached_record_is_replayed_only_in_its_own_scope() {
    let redis = PrivateRedis::start().await;
    let runs = RunCounter::default();
    let cache = ReplayCache::with_max_bytes(1 << 20);
    let pool = RedisStore::pool(&redis.url()).unwrap();
    let server = actix_test::start({
        let runs = runs.clone();
        move || {
            let scope = KeyScope::header("x-tenant").unwrap();
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(
                    Idempotency::redis(pool.clone())
                        .scope(scope)
                        .replay_cache(cache.clone()),
                )
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(create)),
                )
        }
    });

    let acme = post_as(&server, "acme", "shared", "book").await;
    assert_eq!(acme.status, StatusCode::CREATED);
    // Cached on its first replay.
    assert!(post_as(&server, "acme", "shared", "book").await.is_replay());
    // Another tenant with the same key and body runs its own request.
    let globex = post_as(&server, "globex", "shared", "book").await;
    assert_eq!(globex.status, StatusCode::CREATED);
    assert!(!globex.is_replay(), "another tenant's cached response");
    assert_ne!(globex.body, acme.body);
    assert_eq!(runs.get(), 2);
    for _ in 0..2 {
        let (acme_again, globex_again) = (
            post_as(&server, "acme", "shared", "book").await,
            post_as(&server, "globex", "shared", "book").await,
        );
        assert!(acme_again.is_replay() && globex_again.is_replay());
        assert_eq!(acme_again.body, acme.body);
        assert_eq!(globex_again.body, globex.body);
    }
    // Another body under one tenant's key is refused from the cache, not the other's.
    let mismatch = post_as(&server, "globex", "shared", "pen").await;
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(runs.get(), 2);
}

#[actix_web::test]
async fn a_cached_error_and_a_cached_record_without_its_body_replay_as_the_store_does() {
    let redis = PrivateRedis::start().await;
    let runs = RunCounter::default();
    let cache = ReplayCache::with_max_bytes(1 << 20);
    let pool = RedisStore::pool(&redis.url()).unwrap();
    let server = actix_test::start({
        let runs = runs.clone();
        move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(Idempotency::redis(pool.clone()).replay_cache(cache.clone()))
                .service(
                    web::resource("/failed")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().store_errors(),
                        ))
                        .route(web::post().to(failed)),
                )
                .service(
                    web::resource("/large")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().max_stored_body(1024),
                        ))
                        .route(web::post().to(large)),
                )
        }
    });

    for (path, key) in [("/failed", "k-failed"), ("/large", "k-large")] {
        let first = post(&server, path, key, "").await;
        assert!(!first.is_replay());
        let from_redis = post(&server, path, key, "").await;
        assert!(from_redis.is_replay(), "{path}: {from_redis:?}");
        redis.take_command_counts().await;
        let cached = post(&server, path, key, "").await;
        assert_eq!(
            redis.take_command_counts().await,
            Default::default(),
            "{path}: served from the cache"
        );
        assert_eq!(cached.status, from_redis.status, "{path}");
        // Every header but `Date`, in order, as text.
        let without_date = |reply: &Reply| {
            let mut headers: Vec<(String, Vec<u8>)> = reply
                .headers
                .iter()
                .filter(|(name, _)| name.as_str() != "date")
                .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
                .collect();
            headers.sort();
            headers
        };
        assert_eq!(without_date(&cached), without_date(&from_redis), "{path}");
        assert_eq!(cached.body, from_redis.body, "{path}");
    }
    let cached_large = post(&server, "/large", "k-large", "").await;
    assert_eq!(cached_large.header("idempotent-body-omitted"), Some("true"));
    assert!(cached_large.body.is_empty());
    let cached_failed = post(&server, "/failed", "k-failed", "").await;
    assert_eq!(cached_failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(runs.get(), 2);
}
