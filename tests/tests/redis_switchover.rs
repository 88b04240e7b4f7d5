//! A switchover that moves the address: the name the app connects to now leads to the new
//! primary, while the old primary stays up as its replica (a managed Redis's failover, a
//! DNS name or a proxy repointed, a manual `REPLICAOF`). The store's connection to the old
//! primary still answers, but only `READONLY` errors: the store must leave it for a new
//! connection to the address, or every protected request answers 503 until the app
//! restarts. Real sockets, two private `redis-server`s and a proxy of the test's own that
//! plays the moved address.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use idempotency_actix::{Idempotency, RedisPool, RedisStore, ReplicatedWrites};
use idempotency_actix_tests::keyed_app::{KeyedApp, RunsByKey};
use idempotency_actix_tests::{MovableAddress, PrivateRedis, unique_prefix};

async fn command(server: &PrivateRedis, args: &[&str]) -> redis::Value {
    let mut command = redis::cmd(args[0]);
    command.arg(&args[1..]);
    command
        .query_async(&mut server.connection().await)
        .await
        .unwrap()
}

/// Creates `k1` on the primary, switches over with the address, and checks that `k1` is
/// replayed and a new key runs, each once, through the app's existing store.
async fn the_store_follows_the_address(pool: impl Fn(&str) -> RedisPool, replicated: bool) {
    let old = PrivateRedis::start().await;
    let new = PrivateRedis::start_replica_of(&old).await;
    let address = MovableAddress::to(old.port());
    let runs = RunsByKey::default();
    let app = {
        let pool = pool(&format!("redis://127.0.0.1:{}", address.port()));
        let prefix = unique_prefix("switchover");
        KeyedApp::start(
            move || {
                let mut store = RedisStore::new(pool.clone());
                if replicated {
                    store =
                        store.replicated_writes(ReplicatedWrites::new(1, Duration::from_secs(1)));
                }
                Idempotency::new(store).key_prefix(prefix.clone())
            },
            runs.clone(),
        )
    };
    let first = app.post("k1").await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    // The record has reached the replica before it is promoted (it is the only key).
    for _ in 0..500 {
        if command(&new, &["DBSIZE"]).await == redis::Value::Int(1) {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(command(&new, &["DBSIZE"]).await, redis::Value::Int(1));

    command(&new, &["REPLICAOF", "NO", "ONE"]).await;
    command(&old, &["REPLICAOF", "127.0.0.1", &new.port().to_string()]).await;
    address.move_to(new.port());

    let replay = app.post("k1").await.unwrap();
    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    let fresh = app.post("k2").await.unwrap();
    assert_eq!(fresh.status, StatusCode::CREATED, "{fresh:?}");
    assert!(!fresh.is_replay(), "{fresh:?}");
    assert_eq!((runs.of("k1"), runs.of("k2")), (1, 1));
}

/// The store's own connection (a pool from `RedisStore::pool`).
#[actix_web::test]
async fn after_a_switchover_the_own_connection_follows_the_address() {
    the_store_follows_the_address(|url| RedisStore::pool(url).unwrap(), false).await;
}

/// redis-rs's multiplexed connection (a bb8 pool the app built).
#[actix_web::test]
async fn after_a_switchover_a_redis_rs_connection_follows_the_address() {
    let pool = |url: &str| {
        let manager = bb8_redis::RedisConnectionManager::new(url).unwrap();
        RedisPool::from(bb8::Pool::builder().build_unchecked(manager))
    };
    the_store_follows_the_address(pool, false).await;
}

/// With replicated writes, each write borrows a spare connection: an idle one left on the
/// old primary is replaced too.
#[actix_web::test]
async fn after_a_switchover_replicated_writes_follow_the_address() {
    the_store_follows_the_address(|url| RedisStore::pool(url).unwrap(), true).await;
}

/// The connection goes silent (a firewall or NAT drops the flow; nothing closes it): each
/// request gets 503 at the store timeout, and once one has gone unanswered for a while past
/// it, the store opens a new connection and new keys run again. redis-rs's connection was
/// kept until the kernel gave the socket up, about 15 minutes: every protected request got
/// 503 meanwhile (helper review).
async fn the_store_leaves_a_silent_connection(pool: impl Fn(&str) -> RedisPool) {
    let redis = PrivateRedis::start().await;
    let address = MovableAddress::to(redis.port());
    let runs = RunsByKey::default();
    let app = {
        let pool = pool(&format!("redis://127.0.0.1:{}", address.port()));
        let prefix = unique_prefix("silent");
        KeyedApp::start(
            move || {
                Idempotency::new(RedisStore::new(pool.clone()))
                    .key_prefix(prefix.clone())
                    .store_timeout(Duration::from_millis(500))
            },
            runs.clone(),
        )
    };
    let before = app.post("before").await.unwrap();
    assert_eq!(before.status, StatusCode::CREATED, "{before:?}");

    address.silence_open_connections();
    // Each attempt takes the store timeout at most: 40 of them, 20 s, where the store
    // leaves the connection about 2.5 s in.
    let mut refused = 0;
    let after = loop {
        let key = format!("after-{refused}");
        let reply = app.post(&key).await.unwrap();
        if reply.status != StatusCode::SERVICE_UNAVAILABLE {
            break (key, reply);
        }
        assert_eq!(runs.of(&key), 0, "a refused request ran its handler");
        refused += 1;
        assert!(
            refused < 40,
            "the store kept its silent connection for 20 s"
        );
    };
    let (key, reply) = after;
    assert!(refused > 0, "the connection never went silent");
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    assert_eq!(runs.of(&key), 1);
    let replay = app.post(&key).await.unwrap();
    assert!(replay.is_replay(), "{replay:?}");
}

/// The store's own connection (a pool from `RedisStore::pool`).
#[actix_web::test]
async fn the_own_connection_is_left_once_it_goes_silent() {
    the_store_leaves_a_silent_connection(|url| RedisStore::pool(url).unwrap()).await;
}

/// redis-rs's multiplexed connection (a bb8 pool the app built).
#[actix_web::test]
async fn a_redis_rs_connection_is_left_once_it_goes_silent() {
    the_store_leaves_a_silent_connection(|url| {
        let manager = bb8_redis::RedisConnectionManager::new(url).unwrap();
        RedisPool::from(bb8::Pool::builder().build_unchecked(manager))
    })
    .await;
}

/// A redis-rs connection whose server was only slow: a release (after an error response)
/// went unanswered past its deadline while the server was busy, and was answered 0.7 s
/// later, within the grace; nothing else was sent meanwhile. The connection answers, so the
/// store keeps it. It was taken for silent (only replies the store still awaited counted),
/// and the next request, 2.5 s later, replaced it: a reconnect and a warning for a healthy
/// server, and a 503 for every request while the server took no new connection (here at
/// its `maxclients`), its working connection left unused (helper review).
#[actix_web::test]
async fn a_redis_rs_connection_whose_server_answered_late_is_kept() {
    use actix_web::{App, HttpResponse, web};
    use idempotency_actix::IdempotentRoute;
    use idempotency_actix_tests::RunCounter;

    #[derive(serde::Deserialize)]
    struct Declined {
        declined: Option<u8>,
    }

    /// 201; with `?declined=1`, a 500 once the server is kept busy (`DEBUG SLEEP`) for the
    /// release that follows.
    async fn order(
        runs: web::Data<RunCounter>,
        admin: web::Data<redis::aio::MultiplexedConnection>,
        query: web::Query<Declined>,
    ) -> HttpResponse {
        runs.record();
        if query.declined != Some(1) {
            return HttpResponse::Created().body("created");
        }
        let mut admin = admin.get_ref().clone();
        actix_rt::spawn(async move {
            // Its reply may come after redis-rs's own timeout: the server sleeps all the same.
            let _slept: redis::RedisResult<()> = redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg("1.2")
                .query_async(&mut admin)
                .await;
        });
        actix_rt::time::sleep(Duration::from_millis(100)).await;
        HttpResponse::InternalServerError().body("declined")
    }

    let redis = PrivateRedis::start().await;
    let admin = redis.connection().await;
    let runs = RunCounter::default();
    let pool = {
        let manager =
            bb8_redis::RedisConnectionManager::new(redis.url()).expect("a connection manager");
        RedisPool::from(bb8::Pool::builder().build_unchecked(manager))
    };
    let prefix = unique_prefix("answered-late");
    let server = {
        let (runs, admin) = (runs.clone(), admin.clone());
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .app_data(web::Data::new(admin.clone()))
                .wrap(
                    Idempotency::new(RedisStore::new(pool.clone()))
                        .key_prefix(prefix.clone())
                        .store_timeout(Duration::from_millis(500)),
                )
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(order)),
                )
        })
    };
    let post = |path: &'static str, key: &'static str| {
        server
            .post(path)
            .insert_header(("idempotency-key", key))
            .timeout(Duration::from_secs(10))
            .send()
    };

    let first = post("/orders", "before").await.expect("an answer");
    assert_eq!(first.status(), StatusCode::CREATED);
    // The release after the 500 times out at 500 ms; the server answers it 0.7 s later.
    let declined = post("/orders?declined=1", "declined")
        .await
        .expect("an answer");
    assert_eq!(declined.status(), StatusCode::INTERNAL_SERVER_ERROR);
    actix_rt::time::sleep(Duration::from_millis(2500)).await;

    // The server is at its limit of clients: the connection it has must do.
    let mut admin = admin.clone();
    let connected: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(&mut admin)
        .await
        .expect("INFO clients");
    let connected = connected
        .lines()
        .find_map(|line| line.strip_prefix("connected_clients:"))
        .expect("connected_clients")
        .trim()
        .to_owned();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxclients")
        .arg(&connected)
        .query_async(&mut admin)
        .await
        .expect("CONFIG SET maxclients");

    let after = post("/orders", "after").await.expect("an answer");
    assert_eq!(
        after.status(),
        StatusCode::CREATED,
        "the store left a connection that answers"
    );
    assert_eq!(runs.get(), 3);
}
