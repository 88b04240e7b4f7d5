//! The Redis Cluster store on a local 6-node cluster (3 primaries, 3 replicas) that this
//! test binary starts: records land on every primary, duplicates run once across app
//! instances, a record lost while its handler runs is written anew, and a primary added
//! without the functions loads them when its slots' keys need them. The acceptance
//! suite and the HTTP contract run on it in their own files; resharding and failover in
//! `redis_cluster_resharding` and `redis_cluster_failover`.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use idempotency_actix::{
    Idempotency, IdempotencyPolicy, Inspector, MemoryStore, RedisClusterStore, ReplicatedWrites,
};
use idempotency_actix_tests::cluster::RedisCluster;
use idempotency_actix_tests::keyed_app::{KeyedApp, RunsByKey};
use idempotency_actix_tests::{FloodServer, unique_prefix};

fn app(prefix: &str, runs: &RunsByKey) -> KeyedApp {
    let client = RedisCluster::shared().client();
    let prefix = prefix.to_owned();
    KeyedApp::start(
        move || Idempotency::redis_cluster(client.clone()).key_prefix(prefix.clone()),
        runs.clone(),
    )
}

/// A server on `cluster` under `prefix` with 1 s leases, for `/slow` runs that outlast
/// them.
fn slow_server(cluster: &RedisCluster, prefix: &str) -> FloodServer {
    let (client, prefix) = (cluster.client(), prefix.to_owned());
    FloodServer::start(
        move || {
            Idempotency::redis_cluster(client.clone())
                .key_prefix(prefix.clone())
                .policy(IdempotencyPolicy::default().lease(Duration::from_secs(1)))
        },
        64,
    )
}

#[actix_web::test]
async fn records_spread_over_all_three_primaries() {
    let cluster = RedisCluster::shared();
    let prefix = unique_prefix("spread");
    let runs = RunsByKey::default();
    let app = app(&prefix, &runs);
    for n in 0..30 {
        let reply = app.post(&format!("spread-{n}")).await.unwrap();
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let per_primary = cluster.count_keys_by_primary(&prefix);
    assert_eq!(per_primary.len(), 3, "{per_primary:?}");
    assert!(
        per_primary.values().all(|&keys| keys > 0),
        "every primary holds records: {per_primary:?}"
    );
    assert_eq!(per_primary.values().sum::<usize>(), 30);
    // And each is replayed from wherever it lives.
    for n in 0..30 {
        let reply = app.post(&format!("spread-{n}")).await.unwrap();
        assert!(reply.is_replay(), "spread-{n} is replayed");
    }
    assert_eq!(runs.total(), 30);
}

/// A record lost from its primary while its handler runs (deleted here, as an eviction or
/// a failover that lost the write would), where no request takes the key meanwhile: the
/// commit writes the completed record anew on the key's primary, and a retry gets the
/// replay instead of running the handler a second time.
#[actix_web::test]
async fn a_lost_record_that_no_one_took_is_written_anew() {
    let cluster = RedisCluster::shared();
    let prefix = unique_prefix("written_anew");
    let server = slow_server(cluster, &prefix);
    let Ok(first) = server.start_slow("lost").await else {
        panic!("the slow run of `lost` was refused");
    };
    assert_eq!(cluster.delete_keys(&prefix), 1, "the in-flight record");
    server.gate.open();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let records = cluster
        .count_keys_by_primary(&prefix)
        .into_values()
        .sum::<usize>();
    assert_eq!(records, 1, "the completed record, written anew");
    let retry = server.post("/slow", "lost").await;
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.body, first.body);
    assert_eq!(server.slow_runs.get(), 1, "the handler ran once");
}

#[actix_web::test]
async fn two_app_instances_run_a_key_once() {
    let prefix = unique_prefix("two_instances");
    let runs = RunsByKey::default();
    let (first, second) = (app(&prefix, &runs), app(&prefix, &runs));
    for n in 0..10 {
        let key = format!("shared-{n}");
        let replies = futures_util::future::join_all((0..20).map(|i| {
            let instance = if i % 2 == 0 { &first } else { &second };
            instance.post(&key)
        }))
        .await;
        let created: Vec<_> = replies
            .iter()
            .flatten()
            .filter(|reply| reply.status == StatusCode::CREATED)
            .collect();
        assert!(!created.is_empty());
        assert!(
            replies
                .iter()
                .flatten()
                .all(|reply| matches!(reply.status, StatusCode::CREATED | StatusCode::CONFLICT)),
            "only 201s and 409s"
        );
        for reply in &created {
            assert_eq!(reply.body, created[0].body, "one run's body for {key}");
        }
        assert_eq!(runs.of(&key), 1, "{key} ran once across both instances");
    }
}

#[actix_web::test]
async fn an_app_starts_while_the_cluster_is_down_and_answers_503() {
    let unused = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .unwrap()
        .port();
    let client = RedisClusterStore::client([format!("redis://127.0.0.1:{unused}")]).unwrap();
    let runs = RunsByKey::default();
    let app = KeyedApp::start(
        move || Idempotency::redis_cluster(client.clone()),
        runs.clone(),
    );
    for _ in 0..2 {
        let reply = app.post("down").await.unwrap();
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(reply.header("retry-after").is_some());
    }
    assert_eq!(runs.total(), 0, "fail closed: the handler did not run");
}

/// A primary added by hand (`CLUSTER MEET`: no functions copied to it) and given slots
/// while an app is connected (a cluster of this test's own): its first fenced steps find
/// no library there and load it (`FUNCTION LOAD` on every primary), so a slow run on one of
/// its keys keeps its lease by renewals (a duplicate meanwhile gets 409) and commits, and
/// new keys commit there; each is replayed. (On Redis before 8.4 every commit is a
/// function call.)
#[actix_web::test]
async fn a_primary_added_without_the_functions_serves_the_slots_it_receives() {
    let cluster = RedisCluster::start();
    let prefix = unique_prefix("added_primary");
    let server = slow_server(&cluster, &prefix);
    // Connected, the library loaded on the three primaries.
    let before = server.post("/orders", "before").await;
    assert_eq!(before.status, StatusCode::CREATED);

    let added = cluster.add_empty_primary();
    let from = cluster.primaries()[0].port;
    cluster.move_slots(from, added, 200);
    let libraries = |port: u16| -> Vec<redis::Value> {
        redis::cmd("FUNCTION")
            .arg("LIST")
            .query(&mut cluster.connection(port))
            .unwrap()
    };
    assert!(
        libraries(added).is_empty(),
        "the added primary has no functions"
    );

    let inspector = Inspector::new(MemoryStore::new()).key_prefix(prefix.clone());
    let on_added =
        |key: &str| cluster.primary_of(inspector.storage_key(b"", key).unwrap().as_str()) == added;
    let keys: Vec<String> = (0..2_000)
        .map(|n| format!("key-{n}"))
        .filter(|key| on_added(key))
        .take(4)
        .collect();
    assert_eq!(keys.len(), 4, "keys on the added primary");

    let Ok(first) = server.start_slow(&keys[0]).await else {
        panic!("the slow run of {} was refused", keys[0]);
    };
    // Past two leases: only renewals kept the key.
    actix_rt::time::sleep(Duration::from_millis(2_500)).await;
    let duplicate = server.post("/slow", &keys[0]).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    server.gate.open();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = server.post("/slow", &keys[0]).await;
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(server.slow_runs.get(), 1, "the slow handler ran once");

    for key in &keys[1..] {
        let reply = server.post("/orders", key).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
        let replay = server.post("/orders", key).await;
        assert!(replay.is_replay(), "{key}: {replay:?}");
        assert_eq!(replay.body, reply.body);
    }
    assert!(
        !libraries(added).is_empty(),
        "the library is loaded there now"
    );
}

/// With replicated writes, an app whose only seed node dies (a cluster of this test's
/// own): once a replica took over its slots, keys of the other primaries are served again,
/// as they are without replicated writes (the cluster connection learnt the other nodes).
/// The connections of their own that replicated writes use (a failed one is replaced by a
/// new one, made from the seeds) must not leave the store unable to make any.
#[actix_web::test]
async fn replicated_writes_go_on_once_the_only_seed_node_is_gone() {
    let cluster = RedisCluster::start();
    let prefix = unique_prefix("seed_gone");
    let seed = cluster.primaries()[0].port;
    let client =
        RedisClusterStore::client([format!("redis://127.0.0.1:{seed}")]).expect("a valid seed URL");
    let runs = RunsByKey::default();
    let app = {
        let prefix = prefix.clone();
        KeyedApp::start(
            move || {
                let store = RedisClusterStore::new(client.clone())
                    .replicated_writes(ReplicatedWrites::new(1, Duration::from_millis(500)));
                Idempotency::new(store).key_prefix(prefix.clone())
            },
            runs.clone(),
        )
    };
    let inspector = Inspector::new(MemoryStore::new()).key_prefix(prefix.clone());
    let primary_of = |key: &str| {
        cluster.primary_of(
            inspector
                .storage_key(b"", key)
                .expect("a valid key")
                .as_str(),
        )
    };
    let on_seed = (0..1_000)
        .map(|n| format!("on-seed-{n}"))
        .find(|key| primary_of(key) == seed)
        .expect("a key on the seed's primary");
    // The app's first replicated write opens its connections (the shared one, then one of
    // its own) within the store timeout: on a busy machine it may take a retry or two.
    let before = app.create("before", 20).await;
    assert!(
        before.is_some(),
        "a first key is served before the seed dies"
    );

    cluster.kill(seed);
    // A request on the dead primary's slots meanwhile fails (503) after its retries.
    let during = app.post(&on_seed).await.expect("an answer");
    assert_eq!(during.status, StatusCode::SERVICE_UNAVAILABLE, "{during:?}");
    // A replica takes over (the app runs on a thread of its own meanwhile).
    cluster.wait_until_settled();
    // Keys of the two primaries that still have a replica (the promoted one has none: its
    // new keys are refused, as documented).
    let promoted = primary_of(&on_seed);
    let keys: Vec<String> = (0..1_000)
        .map(|n| format!("after-{n}"))
        .filter(|key| primary_of(key) != promoted)
        .take(4)
        .collect();
    for key in &keys {
        let created = app.create(key, 20).await;
        assert!(
            created.is_some(),
            "{key} was refused 20 times after the cluster settled"
        );
    }
    assert_eq!(runs.total(), 1 + keys.len());
}
