//! Round trips per request (DESIGN §6, §10), counted by a private `redis-server`'s
//! `INFO commandstats`: 2 for a new key, 1 for a replay, 0 for unprotected requests. The
//! counts are compared whole, the commands the functions run inside Redis included, so any
//! extra command a change sends shows up, and so would a `PING` per pool checkout.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use actix_web::http::Method;
use actix_web::{App, HttpResponse, web};
use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute, RedisPool, RedisStore};
use idempotency_actix_tests::cluster::RedisCluster;
use idempotency_actix_tests::{FloodServer, PrivateRedis, command_counts_in};

async fn create() -> HttpResponse {
    HttpResponse::Created().body("created")
}

fn start(pool: RedisPool) -> actix_test::TestServer {
    actix_test::start(move || {
        App::new()
            .wrap(Idempotency::redis(pool.clone()))
            .service(
                web::resource("/orders")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(create))
                    .route(web::get().to(create)),
            )
            .route("/untagged", web::post().to(create))
    })
}

async fn post(server: &actix_test::TestServer, method: Method, key: Option<&str>) -> u16 {
    send(server, method, "/orders", key).await
}

async fn send(
    server: &actix_test::TestServer,
    method: Method,
    path: &str,
    key: Option<&str>,
) -> u16 {
    let mut request = server.request(method, server.url(path));
    if let Some(key) = key {
        request = request.insert_header(("idempotency-key", key));
    }
    request.send_body("{}").await.unwrap().status().as_u16()
}

fn counts(commands: &[(&str, u64)]) -> BTreeMap<String, u64> {
    commands
        .iter()
        .map(|(name, calls)| ((*name).to_owned(), *calls))
        .collect()
}

/// The commands of a new key on Redis (and on a Valkey without `SET … IFEQ`): `begin`'s
/// `SET`, then one FCALL whose function reads the in-flight record (GET) and completes it
/// (SET).
const NEW_KEY_BY_FUNCTION: [(&str, u64); 3] = [("set", 2), ("fcall", 1), ("get", 1)];

/// The commands of a new key on Valkey ≥ 8.1, the one server the store commits to by
/// `SET … IFEQ`: `begin`'s `SET`, then the commit, one plain `SET`, no function.
const NEW_KEY_BY_CONDITIONAL_SET: [(&str, u64); 1] = [("set", 2)];

/// The commands of a new key on `redis`, the `redis-server` on the `PATH`: by function on
/// Redis (the commit by function has no other test of its count), by `SET … IFEQ` where
/// that server is Valkey (≥ 8.1, as the `PATH` may hold with Debian's compatibility
/// package).
async fn new_key_on(redis: &PrivateRedis) -> &'static [(&'static str, u64)] {
    if redis.is_valkey().await && redis.takes_conditional_set().await {
        &NEW_KEY_BY_CONDITIONAL_SET
    } else {
        &NEW_KEY_BY_FUNCTION
    }
}

#[actix_web::test]
async fn new_key_costs_two_round_trips_replay_one_unprotected_none() {
    let redis = PrivateRedis::start().await;
    let new_key = new_key_on(&redis).await;
    round_trips_on(redis, new_key).await;
}

#[actix_web::test]
async fn on_valkey_a_new_key_costs_two_plain_sets() {
    let valkey = PrivateRedis::start_valkey(&[]).await;
    round_trips_on(valkey, &NEW_KEY_BY_CONDITIONAL_SET).await;
}

/// Redis 8.6 takes `SET … IFEQ`, but was seen to write it into another key (see
/// `docs/redis-8-set-ifeq.md`): the store commits by function there, as on Redis 7.
#[actix_web::test]
async fn on_redis_8_a_new_key_commits_by_function() {
    let redis = PrivateRedis::start_redis8(&[]).await;
    assert!(redis.takes_conditional_set().await, "no Redis ≥ 8.4");
    round_trips_on(redis, &NEW_KEY_BY_FUNCTION).await;
}

/// A Valkey whose `HELLO` was renamed away (`rename-command`; an ACL cannot refuse it, as
/// it cannot refuse `AUTH`): the store cannot tell Valkey from Redis, and commits by
/// function, as on Redis.
#[actix_web::test]
async fn on_a_valkey_without_hello_a_new_key_commits_by_function() {
    let valkey = PrivateRedis::start_valkey(&["--rename-command", "HELLO", ""]).await;
    let server = start(RedisStore::pool(&valkey.url()).unwrap());
    assert_eq!(post(&server, Method::POST, Some("warm-up")).await, 201);
    valkey.take_command_counts().await;
    assert_eq!(post(&server, Method::POST, Some("new")).await, 201);
    assert_eq!(
        valkey.take_command_counts().await,
        counts(&NEW_KEY_BY_FUNCTION),
        "new key on a Valkey without HELLO"
    );
}

/// A commit built for Valkey (`SET … IFEQ`) whose connection finds Valkey gone and Redis
/// 8.6 in its place (replaced underneath while the handler ran): the new connection learns
/// it reached Redis before anything is sent, and the commit goes by function. (It was
/// sent as built: a `SET … IFEQ` to Redis.) The record the `begin` wrote went with Valkey,
/// so the commit finds the key free and writes the record anew: one `FCALL` of `commit`
/// (a `GET`), the store's read of the key, one `FCALL` of `claim` (a `GET` and the `SET`),
/// and no `SET` sent by the store itself.
#[actix_web::test]
async fn a_commit_built_for_valkey_goes_by_function_to_the_redis_that_replaced_it() {
    let mut redis = PrivateRedis::start_valkey(&[]).await;
    let pool = RedisStore::pool(&redis.url()).unwrap();
    // A lease no renewal falls due in while the server is replaced, however slowly: a
    // renewal on the new server would find no record and add an `FCALL`.
    let lease = IdempotencyPolicy::default().lease(Duration::from_secs(600));
    let server = FloodServer::start(
        move || Idempotency::redis(pool.clone()).policy(lease.clone()),
        16,
    );
    assert_eq!(server.post("/orders", "warm-up").await.status, 201);
    let held = server.start_slow("replaced").await.unwrap();
    redis
        .replace_with(idempotency_actix_tests::redis8_server())
        .await;
    redis.take_command_counts().await;
    server.gate.open();
    let first = held.await.unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    let replay = server.post("/slow", "replaced").await;
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    let counted = redis.take_command_counts().await;
    let calls = |name: &str| counted.get(name).copied().unwrap_or(0);
    assert_eq!(
        (calls("set"), calls("fcall")),
        (2, 2),
        "the commit and the replay's begin on Redis 8: {counted:?}"
    );
}

/// The cluster store on Redis 8.6 nodes commits by function too, as it does on every
/// server (its connection cannot ask each node it reaches). Counted over every primary of
/// a cluster of the test's own: a new key's commit is one `FCALL` (whose function runs a
/// `GET` and a `SET`).
#[actix_web::test]
async fn on_a_redis_8_cluster_a_new_key_commits_by_function() {
    let cluster = RedisCluster::start_redis8();
    let client = cluster.client();
    let server = actix_test::start(move || {
        App::new()
            .wrap(Idempotency::redis_cluster(client.clone()))
            .service(
                web::resource("/orders")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(create)),
            )
    });
    assert_eq!(post(&server, Method::POST, Some("warm-up")).await, 201);
    let ports = cluster.ports();
    cluster_command_counts(&cluster, &ports);
    assert_eq!(post(&server, Method::POST, Some("new")).await, 201);
    assert_eq!(
        cluster_command_counts(&cluster, &ports),
        counts(&NEW_KEY_BY_FUNCTION),
        "new key on a Redis 8 cluster"
    );
}

/// The commands each node of `cluster` ran since the last call, summed (what replicas apply
/// from their primaries is not counted: a replica counts no client commands), then resets
/// the counts; the cluster's own bookkeeping left out.
fn cluster_command_counts(cluster: &RedisCluster, ports: &[u16]) -> BTreeMap<String, u64> {
    let mut counted = BTreeMap::new();
    for &port in ports {
        let mut connection = cluster.connection(port);
        let role: String = redis::cmd("ROLE")
            .query::<Vec<redis::Value>>(&mut connection)
            .ok()
            .and_then(|role| match role.first() {
                Some(redis::Value::BulkString(role)) => {
                    Some(String::from_utf8_lossy(role).into_owned())
                }
                _ => None,
            })
            .unwrap_or_default();
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut connection)
            .unwrap();
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query(&mut connection)
            .unwrap();
        if role != "master" {
            continue;
        }
        // The cluster's own traffic: the bus, slot maps, and the replicas' `REPLCONF ACK`s
        // to their primary.
        let cluster_bookkeeping = [
            "cluster", "ping", "role", "function", "readonly", "command", "replconf",
        ];
        for (name, calls) in command_counts_in(&info, &cluster_bookkeeping) {
            *counted.entry(name).or_insert(0) += calls;
        }
    }
    counted
}

/// A server replaced underneath a running app (stopped, and another started on its port):
/// the store asks each new connection which server it reached. Redis 7 commits by
/// function; Valkey, started in its place, by `SET … IFEQ`; Redis 8.6 after it by function
/// again, though it takes `SET … IFEQ`.
#[actix_web::test]
async fn a_server_replaced_underneath_is_asked_again_how_to_commit() {
    let mut redis = PrivateRedis::start_redis7(&[]).await;
    let server = start(RedisStore::pool(&redis.url()).unwrap());
    let replaced_by = [
        (None, "redis-7", &NEW_KEY_BY_FUNCTION[..]),
        (
            Some(idempotency_actix_tests::valkey_server()),
            "valkey",
            &NEW_KEY_BY_CONDITIONAL_SET[..],
        ),
        (
            Some(idempotency_actix_tests::redis8_server()),
            "redis-8",
            &NEW_KEY_BY_FUNCTION[..],
        ),
    ];
    for (binary, name, new_key) in replaced_by {
        if let Some(binary) = binary {
            redis.replace_with(binary).await;
        }
        // The first request finds the connection dead (after a replacement) and reconnects.
        let warm_up = format!("{name}-warm-up");
        assert_eq!(post(&server, Method::POST, Some(&warm_up)).await, 201);
        redis.take_command_counts().await;
        assert_eq!(post(&server, Method::POST, Some(name)).await, 201);
        let counted = redis.take_command_counts().await;
        assert_eq!(counted, counts(new_key), "new key on {name}");
    }
}

/// Counts the commands of a new key (`new_key`: `begin`'s plain `SET … NX PX … GET`, then
/// the commit), a replay and unprotected requests on `redis`.
async fn round_trips_on(redis: PrivateRedis, new_key: &[(&str, u64)]) {
    let server = start(RedisStore::pool(&redis.url()).unwrap());

    // Warm up: the store connects, learns whether the server takes `SET … IFEQ`, and loads
    // its functions where it does not.
    assert_eq!(post(&server, Method::POST, Some("warm-up")).await, 201);
    redis.take_command_counts().await;

    // A new key: two round trips.
    assert_eq!(post(&server, Method::POST, Some("new")).await, 201);
    let counted = redis.take_command_counts().await;
    assert_eq!(counted, counts(new_key), "new key");

    // A replay: one round trip, the same `SET … NX … GET`, which finds the record.
    assert_eq!(post(&server, Method::POST, Some("new")).await, 201);
    let replay = redis.take_command_counts().await;
    assert_eq!(replay, counts(&[("set", 1)]), "replay");

    // Unprotected: a keyed GET, an unkeyed POST, a keyed POST to an untagged route.
    assert_eq!(post(&server, Method::GET, Some("new")).await, 201);
    assert_eq!(post(&server, Method::POST, None).await, 201);
    assert_eq!(
        send(&server, Method::POST, "/untagged", Some("new")).await,
        201
    );
    let unprotected = redis.take_command_counts().await;
    assert_eq!(unprotected, counts(&[]), "unprotected: no traffic");
}

/// A route whose layer sets a lease of its own (10 s) under an App layer that claims every
/// `POST` with its own (30 s): a new key costs one renewal more, the route layer's, which
/// applies its lease before the handler runs (one FCALL: `GET`, then `PEXPIRE`), and no
/// other. The lease renewals, which sleep until a renewal is due, took the lease changed but
/// not yet applied (the route layer's renewal on its way) for a failed renewal and sent one
/// of their own at once: two renewals per new key on such a route.
#[actix_web::test]
async fn a_route_s_own_lease_costs_one_renewal() {
    let redis = PrivateRedis::start_valkey(&[]).await;
    let pool = RedisStore::pool(&redis.url()).unwrap();
    let server = actix_test::start(move || {
        App::new()
            .wrap(Idempotency::redis(pool.clone()).protect_methods([Method::POST]))
            .service(
                web::resource("/orders")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().lease(Duration::from_secs(10)),
                    ))
                    .route(web::post().to(create)),
            )
    });
    assert_eq!(post(&server, Method::POST, Some("warm-up")).await, 201);
    redis.take_command_counts().await;

    assert_eq!(post(&server, Method::POST, Some("new")).await, 201);
    let mut expected = counts(&NEW_KEY_BY_CONDITIONAL_SET);
    expected.extend(counts(&[("fcall", 1), ("get", 1), ("pexpire", 1)]));
    assert_eq!(redis.take_command_counts().await, expected, "new key");
}

#[actix_web::test]
async fn a_default_bb8_pool_costs_no_ping_per_request() {
    let redis = PrivateRedis::start().await;
    let new_key = new_key_on(&redis).await;
    // bb8's default `test_on_check_out(true)`: what users get from `Pool::builder().build(..)`.
    // The store checks a connection out once and shares it, so the PING of a checkout is
    // paid once, not per operation.
    let manager = bb8_redis::RedisConnectionManager::new(redis.url()).unwrap();
    let pool = bb8::Pool::builder().build(manager).await.unwrap();
    let server = start(pool.into());
    assert_eq!(post(&server, Method::POST, Some("warm-up")).await, 201);
    redis.take_command_counts().await;

    assert_eq!(post(&server, Method::POST, Some("new")).await, 201);
    assert_eq!(post(&server, Method::POST, Some("new")).await, 201);
    // The new key's commands and the replay's `SET`, no `PING`.
    let mut expected = counts(new_key);
    *expected.get_mut("set").expect("a new key sends SET") += 1;
    assert_eq!(redis.take_command_counts().await, expected);
}
