//! A switchover that moves the address: the name the app connects to now leads to the new
//! primary, while the old primary stays up as its replica (a managed Redis's failover, a
//! DNS name or a proxy repointed, a manual `REPLICAOF`). The store's connection to the old
//! primary still answers, but only `READONLY` errors: the store must leave it for a new
//! connection to the address, or every protected request answers 503 until the app
//! restarts. Real sockets, two private `redis-server`s and a proxy of the test's own that
//! plays the moved address.

#![allow(clippy::unwrap_used)]

use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use actix_web::http::StatusCode;
use idempotency_actix::{Idempotency, RedisPool, RedisStore, ReplicatedWrites};
use idempotency_actix_tests::keyed_app::{KeyedApp, RunsByKey};
use idempotency_actix_tests::{PrivateRedis, unique_prefix};

/// A TCP proxy on a loopback port that sends each new connection to the port it is set to
/// now; connections already open stay where they are, as with a moved DNS name.
struct MovableAddress {
    port: u16,
    target: Arc<AtomicU16>,
}

impl MovableAddress {
    fn to(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(AtomicU16::new(target));
        let current = Arc::clone(&target);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", current.load(Ordering::SeqCst)))
                else {
                    continue;
                };
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(Shutdown::Write);
                    });
                }
            }
        });
        Self { port, target }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn move_to(&self, target: u16) {
        self.target.store(target, Ordering::SeqCst);
    }
}

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
        let pool = pool(&address.url());
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
