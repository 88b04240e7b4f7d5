//! Live resharding: slots move between the primaries of a local Redis Cluster (this test
//! binary's own) while requests flow. No key runs twice, no record is lost, and refusals
//! (503) stay few.

#![allow(clippy::unwrap_used)]

use std::cell::Cell;
use std::collections::HashMap;

use actix_web::web::Bytes;
use idempotency_actix::Idempotency;
use idempotency_actix_tests::cluster::RedisCluster;
use idempotency_actix_tests::keyed_app::{KeyedApp, RunsByKey};
use idempotency_actix_tests::unique_prefix;

/// Keys created before the move: their records are migrated while they are replayed.
const KEYS_BEFORE: usize = 150;
/// Concurrent clients during the move.
const CLIENTS: usize = 8;
/// New keys each client creates at most (the traffic is bounded even if the move is slow).
const KEYS_PER_CLIENT: usize = 400;
/// Slots moved: about 2/5 of a primary's, so many records move.
const SLOTS: u16 = 2_000;
/// Attempts per key before the test gives up on it (each waits 50 ms after a refusal).
const ATTEMPTS: usize = 40;

#[derive(Default)]
struct Traffic {
    bodies: HashMap<String, Bytes>,
    requests: usize,
    unavailable: usize,
    during_move: usize,
}

#[actix_web::test]
async fn slots_move_while_requests_flow() {
    let cluster = RedisCluster::shared();
    let prefix = unique_prefix("resharding");
    let runs = RunsByKey::default();
    let client = cluster.client();
    let app = {
        let prefix = prefix.clone();
        KeyedApp::start(
            move || Idempotency::redis_cluster(client.clone()).key_prefix(prefix.clone()),
            runs.clone(),
        )
    };

    let mut traffic = Traffic::default();
    for n in 0..KEYS_BEFORE {
        let key = format!("before-{n}");
        let created = app
            .create(&key, ATTEMPTS)
            .await
            .expect("created before the move");
        traffic.bodies.insert(key, created.reply.body);
    }
    let primaries = cluster.primaries();
    let (from, to) = (primaries[0].port, primaries[1].port);

    let moving = Cell::new(true);
    let mover = async {
        actix_rt::task::spawn_blocking(move || cluster.move_slots(from, to, SLOTS))
            .await
            .unwrap();
        moving.set(false);
    };
    let before: Vec<(String, Bytes)> = traffic.bodies.clone().into_iter().collect();
    let clients = futures_util::future::join_all((0..CLIENTS).map(|client| {
        let (app, moving, before) = (&app, &moving, &before);
        async move {
            let mut seen = Traffic::default();
            for n in 0..KEYS_PER_CLIENT {
                if !moving.get() {
                    break;
                }
                // A new key, then a replay of a key created before the move.
                let key = format!("during-{client}-{n}");
                let created = app
                    .create(&key, ATTEMPTS)
                    .await
                    .unwrap_or_else(|| panic!("{key} never got a 201 while slots moved"));
                seen.requests += 1 + created.unavailable + created.conflicts;
                seen.unavailable += created.unavailable;
                seen.during_move += usize::from(moving.get());
                seen.bodies.insert(key, created.reply.body);

                let (old, body) = &before[(client * KEYS_PER_CLIENT + n) % before.len()];
                let replay = app
                    .create(old, ATTEMPTS)
                    .await
                    .unwrap_or_else(|| panic!("{old} was not replayed while slots moved"));
                seen.requests += 1 + replay.unavailable + replay.conflicts;
                seen.unavailable += replay.unavailable;
                assert!(replay.reply.is_replay(), "{old} is replayed, not run again");
                assert_eq!(&replay.reply.body, body, "{old} replays its own response");
            }
            seen
        }
    }));
    let ((), seen) = futures_util::future::join(mover, clients).await;
    for client in seen {
        traffic.bodies.extend(client.bodies);
        traffic.requests += client.requests;
        traffic.unavailable += client.unavailable;
        traffic.during_move += client.during_move;
    }

    // The receiving primary now serves a third of the slots plus the moved ones (about
    // 45% of the keys); without the move it would hold about a third.
    let owners = cluster.count_keys_by_primary(&prefix);
    let received = owners.get(&to).copied().unwrap_or(0);
    assert!(
        received * 100 > traffic.bodies.len() * 40,
        "the moved slots' records are on the receiving primary: {owners:?}"
    );
    assert!(
        traffic.during_move > 0,
        "requests flowed while the slots moved"
    );
    assert_eq!(runs.ran_twice(), Vec::new(), "no key ran twice");
    assert!(
        traffic.unavailable * 20 <= traffic.requests,
        "at most 5% of requests refused: {} of {}",
        traffic.unavailable,
        traffic.requests
    );
    // Every record survived the move: each key replays the response of its one run.
    for (key, body) in &traffic.bodies {
        let replay = app.create(key, ATTEMPTS).await.unwrap();
        assert!(replay.reply.is_replay(), "{key} is replayed after the move");
        assert_eq!(&replay.reply.body, body, "{key} replays its own response");
    }
    assert_eq!(runs.total(), traffic.bodies.len(), "one run per key");
    eprintln!(
        "resharding: {} keys, {} requests ({} while moving), {} refused",
        traffic.bodies.len(),
        traffic.requests,
        traffic.during_move,
        traffic.unavailable
    );
}
