//! Failover: a primary of a local Redis Cluster (this test binary's own) is killed with
//! SIGKILL while requests flow, with strict replicated writes (1 replica). Requests are
//! refused (503) during the election and, on the failed shard, until it has a replica
//! again (its only replica became its primary; the killed node then rejoins as the new
//! replica); then every request is served again. Every key that got its response, before
//! the kill or after, replays it afterwards, and none runs twice.

#![allow(clippy::unwrap_used)]

use std::cell::Cell;
use std::collections::HashMap;
use std::time::Duration;

use actix_web::web::Bytes;
use idempotency_actix::{Idempotency, RedisClusterStore, ReplicatedWrites};
use idempotency_actix_tests::cluster::RedisCluster;
use idempotency_actix_tests::keyed_app::{KeyedApp, RunsByKey};
use idempotency_actix_tests::unique_prefix;

/// Concurrent clients.
const CLIENTS: usize = 6;
/// Keys created before the kill.
const KEYS_BEFORE_KILL: usize = 120;
/// Keys each client creates at most (the traffic is bounded even if the election is slow).
const KEYS_PER_CLIENT: usize = 300;
/// Keys each client creates once the cluster settled again.
const KEYS_AFTER: usize = 10;
/// Attempts per key (each refusal takes up to the 2 s store timeout, then 50 ms): enough
/// to outlast the election (node timeout 3 s, then the vote).
const ATTEMPTS: usize = 400;

#[derive(Default)]
struct Seen {
    /// Each key's response, and whether it arrived before the kill.
    responses: HashMap<String, (Bytes, bool)>,
    unavailable_after_kill: usize,
}

#[actix_web::test]
async fn a_killed_primary_loses_no_replicated_record() {
    let cluster = RedisCluster::shared();
    let prefix = unique_prefix("failover");
    let runs = RunsByKey::default();
    let client = cluster.client();
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

    let created = Cell::new(0_usize);
    let killed = Cell::new(false);
    let settled = Cell::new(false);
    let victim = cluster.primaries()[0].port;
    let killer = async {
        while created.get() < KEYS_BEFORE_KILL {
            actix_rt::time::sleep(Duration::from_millis(10)).await;
        }
        killed.set(true);
        cluster.kill(victim);
        actix_rt::task::spawn_blocking(move || {
            // The replica takes over; then the killed node comes back as its replica.
            cluster.wait_until_settled();
            cluster.restart(victim);
            cluster.wait_until_settled();
        })
        .await
        .unwrap();
        settled.set(true);
    };
    let clients = futures_util::future::join_all((0..CLIENTS).map(|client| {
        let (app, created, killed, settled) = (&app, &created, &killed, &settled);
        async move {
            let mut seen = Seen::default();
            let mut after = 0;
            for n in 0..KEYS_PER_CLIENT {
                if after == KEYS_AFTER {
                    break;
                }
                let key = format!("key-{client}-{n}");
                let answer = app
                    .create(&key, ATTEMPTS)
                    .await
                    .unwrap_or_else(|| panic!("{key} never got a 201"));
                if killed.get() {
                    seen.unavailable_after_kill += answer.unavailable;
                }
                assert!(!answer.reply.is_replay(), "{key} is new");
                seen.responses
                    .insert(key, (answer.reply.body, !killed.get()));
                created.set(created.get() + 1);
                if settled.get() {
                    after += 1;
                }
            }
            seen
        }
    }));
    let ((), seen) = futures_util::future::join(killer, clients).await;
    let mut responses = HashMap::new();
    let mut unavailable = 0;
    for client in seen {
        responses.extend(client.responses);
        unavailable += client.unavailable_after_kill;
    }

    assert!(settled.get(), "the traffic outlasted the election");
    assert!(
        unavailable > 0,
        "requests were refused during the election (fail closed)"
    );
    let before = responses.values().filter(|(_, before)| *before).count();
    assert!(
        before >= KEYS_BEFORE_KILL,
        "{before} keys answered before the kill"
    );
    // Service is back: every client created its last keys after the election.
    assert!(responses.len() >= before + CLIENTS * KEYS_AFTER);
    // Every response sent, before the kill or after, replays: no record was lost, and no
    // key ran a second time.
    for (key, (body, _)) in &responses {
        let replay = app.create(key, ATTEMPTS).await.unwrap();
        assert!(
            replay.reply.is_replay(),
            "{key} is replayed after the failover"
        );
        assert_eq!(&replay.reply.body, body, "{key} replays its own response");
    }
    assert_eq!(runs.ran_twice(), Vec::new(), "no key ran twice");
    assert_eq!(runs.total(), responses.len());
    eprintln!(
        "failover: {} keys ({before} before the kill), {unavailable} refusals after it",
        responses.len()
    );
}
