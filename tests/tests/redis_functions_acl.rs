//! A Redis user that may not run `FUNCTION LOAD`, on a server of the test's own: while the
//! server lacks the store's functions, nothing could fence a commit, renew a lease or give a
//! key back, so a handler that ran would leave its key locked until the lease ran out and
//! then run again for a retry. So keyed requests are refused with 503 before any handler
//! runs; once someone who may loads the functions, the same user is served (it needs
//! `FCALL`, not `FUNCTION`). On Redis, Valkey, and a Redis Cluster of its own.

#![allow(clippy::unwrap_used)]

use actix_web::http::StatusCode;
use idempotency_actix::{Idempotency, RedisClusterStore, RedisStore};
use idempotency_actix_tests::cluster::RedisCluster;
use idempotency_actix_tests::{FloodServer, PrivateRedis};

/// The ACL of a user that may do everything but `FUNCTION` (so it may `FCALL`).
const NO_FUNCTION_LOAD: [&str; 7] = ["SETUSER", "app", "on", "nopass", "~*", "+@all", "-function"];

/// The URL of `user` (any password: the user has none) on `redis`.
fn url_of(redis: &PrivateRedis, user: &str) -> String {
    format!("redis://{user}:any@127.0.0.1:{}", redis.port())
}

#[actix_web::test]
async fn a_user_who_cannot_load_the_functions_is_refused_until_they_are_loaded() {
    refused_until_the_functions_are_loaded(PrivateRedis::start().await).await;
}

/// The same on Valkey ≥ 8.1, whose commits need no function (`SET … IFEQ`) but whose
/// renewals and releases do.
#[actix_web::test]
async fn a_valkey_user_who_cannot_load_the_functions_is_refused_until_they_are_loaded() {
    refused_until_the_functions_are_loaded(PrivateRedis::start_valkey(&[]).await).await;
}

async fn refused_until_the_functions_are_loaded(redis: PrivateRedis) {
    let mut admin = redis.connection().await;
    let _: () = redis::cmd("ACL")
        .arg(&NO_FUNCTION_LOAD[..])
        .query_async(&mut admin)
        .await
        .unwrap();

    let pool = RedisStore::pool(&url_of(&redis, "app")).unwrap();
    let app = FloodServer::start(move || Idempotency::redis(pool.clone()), 64);
    refused_with_no_run(&app).await;
    let keys: u64 = redis::cmd("DBSIZE").query_async(&mut admin).await.unwrap();
    assert_eq!(keys, 0, "refused requests left records behind");

    // An app connecting as the default user loads the functions on its first request.
    let admin_pool = RedisStore::pool(&redis.url()).unwrap();
    let loader = FloodServer::start(move || Idempotency::redis(admin_pool.clone()), 64);
    served_once_loaded(&app, &loader).await;
}

/// The same on a Redis Cluster of its own (3 primaries, 3 replicas), whose functions no
/// one has loaded yet.
#[actix_web::test]
async fn a_cluster_user_who_cannot_load_the_functions_is_refused_until_they_are_loaded() {
    let cluster = RedisCluster::start();
    for port in cluster.ports() {
        let _: () = redis::cmd("ACL")
            .arg(&NO_FUNCTION_LOAD[..])
            .query(&mut cluster.connection(port))
            .unwrap();
    }
    let app_urls: Vec<String> = cluster
        .ports()
        .iter()
        .map(|port| format!("redis://app:any@127.0.0.1:{port}"))
        .collect();
    let client = RedisClusterStore::client(app_urls).unwrap();
    let app = FloodServer::start(move || Idempotency::redis_cluster(client.clone()), 64);
    refused_with_no_run(&app).await;

    let admin_client = cluster.client();
    let loader = FloodServer::start(move || Idempotency::redis_cluster(admin_client.clone()), 64);
    served_once_loaded(&app, &loader).await;
}

/// Keyed requests to `app` get 503, and no handler runs.
async fn refused_with_no_run(app: &FloodServer) {
    for attempt in 0..3 {
        let refused = app.post("/orders", "charge-1").await;
        assert_eq!(
            refused.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "attempt {attempt}: {refused:?}"
        );
    }
    assert_eq!(app.runs.get(), 0, "a handler ran with nothing to fence it");
}

/// Once `loader` (a user who may) has loaded the functions with a request of its own, `app`
/// runs a new key once and replays it.
async fn served_once_loaded(app: &FloodServer, loader: &FloodServer) {
    assert_eq!(
        loader.post("/orders", "load").await.status,
        StatusCode::CREATED
    );
    let first = app.post("/orders", "charge-1").await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = app.post("/orders", "charge-1").await;
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(app.runs.get(), 1);
}
