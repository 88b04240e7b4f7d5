//! Replicated writes on the single-server Redis store, against a private primary with one
//! replica: each write waits for the replica; when it is down, strict refuses new keys
//! (503, the handler does not run) while replays go on, and `or_warn` goes on. The
//! cluster store runs the same protocol in `redis_cluster_failover` and the acceptance
//! suite.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use idempotency_actix::{Idempotency, RedisStore, ReplicatedWrites};
use idempotency_actix_tests::keyed_app::{KeyedApp, RunsByKey};
use idempotency_actix_tests::{PrivateRedis, keys_under, unique_prefix};

fn app(primary: &PrivateRedis, writes: ReplicatedWrites, runs: &RunsByKey) -> (KeyedApp, String) {
    let pool = RedisStore::pool(&primary.url()).unwrap();
    let prefix = unique_prefix("replicated");
    let app = {
        let prefix = prefix.clone();
        KeyedApp::start(
            move || {
                let store = RedisStore::new(pool.clone()).replicated_writes(writes);
                Idempotency::new(store).key_prefix(prefix.clone())
            },
            runs.clone(),
        )
    };
    (app, prefix)
}

const WAIT: Duration = Duration::from_millis(200);

#[actix_web::test]
async fn with_the_replica_up_the_record_is_on_it_when_the_response_arrives() {
    let primary = PrivateRedis::start().await;
    let replica = PrivateRedis::start_replica_of(&primary).await;
    let runs = RunsByKey::default();
    let (app, prefix) = app(&primary, ReplicatedWrites::new(1, WAIT), &runs);

    for n in 0..20 {
        let key = format!("k{n}");
        let first = app.post(&key).await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(
            keys_under(&mut replica.connection().await, &prefix)
                .await
                .len(),
            n + 1,
            "the replica holds the record of {key} as its response arrives"
        );
        let replay = app.post(&key).await.unwrap();
        assert!(replay.is_replay());
        assert_eq!(replay.body, first.body);
    }
    assert_eq!(runs.total(), 20);
}

#[actix_web::test]
async fn strict_refuses_new_keys_while_the_replica_is_down_and_replays_go_on() {
    let primary = PrivateRedis::start().await;
    let mut replica = PrivateRedis::start_replica_of(&primary).await;
    let runs = RunsByKey::default();
    let (app, _prefix) = app(&primary, ReplicatedWrites::new(1, WAIT), &runs);
    let done = app.post("done").await.unwrap();
    assert_eq!(done.status, StatusCode::CREATED);

    replica.stop();
    let refused = app.post("new").await.unwrap();
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(refused.header("retry-after").is_some());
    assert_eq!(runs.of("new"), 0, "the handler did not run");
    let replay = app.post("done").await.unwrap();
    assert!(replay.is_replay(), "replays need no replica: {replay:?}");

    // Once a replica is back, the refused key runs (its lock was released).
    let _replica = PrivateRedis::start_replica_of(&primary).await;
    let created = app.create("new", 40).await.expect("served once replicated");
    assert!(!created.reply.is_replay());
    assert_eq!(runs.of("new"), 1);
}

#[actix_web::test]
async fn or_warn_goes_on_while_the_replica_is_down() {
    let primary = PrivateRedis::start().await;
    let mut replica = PrivateRedis::start_replica_of(&primary).await;
    replica.stop();
    let runs = RunsByKey::default();
    let (app, _prefix) = app(&primary, ReplicatedWrites::new(1, WAIT).or_warn(), &runs);

    let first = app.post("key").await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = app.post("key").await.unwrap();
    assert!(replay.is_replay());
    assert_eq!(replay.body, first.body);
    assert_eq!(runs.of("key"), 1);
}
