//! Live resharding: slots move between the primaries of a local Redis Cluster (this test
//! binary's own, each primary with a replica) while requests flow, with and without
//! replicated writes. No key runs twice, no record is lost, and refusals (503) stay few.

#![allow(clippy::unwrap_used)]
// Each test holds its turn on the cluster for its whole run (see `one_at_a_time`).
#![allow(clippy::await_holding_lock)]

use std::cell::Cell;
use std::collections::HashMap;
use std::time::Duration;

use actix_web::web::Bytes;
use idempotency_actix::{Idempotency, RedisClusterStore, ReplicatedWrites};
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
/// All the slots of a cluster.
const ALL_SLOTS: usize = 16_384;
/// Attempts per key before the test gives up on it (each waits 50 ms after a refusal).
const ATTEMPTS: usize = 40;

#[derive(Default)]
struct Traffic {
    bodies: HashMap<String, Bytes>,
    requests: usize,
    unavailable: usize,
    during_move: usize,
}

/// Held by each test for its whole run: `redis-cli --cluster reshard` refuses to start
/// while another move is under way, and each test counts where its own move put records.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[actix_web::test]
async fn slots_move_while_requests_flow() {
    let _turn = one_at_a_time();
    move_slots_under_traffic("resharding", |store| store).await;
}

/// Strict replicated writes: each lock and commit waits for the primary's replica, on
/// the source primary and then, once its slot has moved, on the receiving one.
#[actix_web::test]
async fn slots_move_while_requests_flow_under_replicated_writes() {
    let _turn = one_at_a_time();
    move_slots_under_traffic("resharding-replicated", |store| {
        store.replicated_writes(ReplicatedWrites::new(1, Duration::from_millis(500)))
    })
    .await;
}

/// Creates keys, then moves [`SLOTS`] slots from the primary that serves the most to the
/// one that serves the fewest while clients create new keys and replay old ones, through
/// the store that `configure` makes of a plain [`RedisClusterStore`]; then checks that
/// every key ran once and replays its response.
async fn move_slots_under_traffic(
    test: &str,
    configure: fn(RedisClusterStore) -> RedisClusterStore,
) {
    let cluster = RedisCluster::shared();
    let prefix = unique_prefix(test);
    let runs = RunsByKey::default();
    let client = cluster.client();
    let app = {
        let prefix = prefix.clone();
        KeyedApp::start(
            move || {
                Idempotency::new(configure(RedisClusterStore::new(client.clone())))
                    .key_prefix(prefix.clone())
            },
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
    // The other test of this binary may have moved slots already: take from the primary
    // that serves the most, give to the one that serves the fewest.
    let mut primaries = cluster.primaries();
    primaries.sort_by_key(|primary| slot_count(&primary.slots));
    let (from, to) = (primaries[primaries.len() - 1].port, primaries[0].port);
    let slots_before = slot_count(&primaries[0].slots);

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

    // The receiving primary now serves its slots plus the moved ones (12% of all), and
    // holds about that share of the keys: more than its share before the move plus half
    // the moved slots' only if the moved records reached it.
    let owners = cluster.count_keys_by_primary(&prefix);
    let received = owners.get(&to).copied().unwrap_or(0);
    assert!(
        received * ALL_SLOTS > traffic.bodies.len() * (slots_before + usize::from(SLOTS) / 2),
        "the moved slots' records are on the receiving primary {to}: {owners:?}"
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
        "{test}: {} keys, {} requests ({} while moving), {} refused",
        traffic.bodies.len(),
        traffic.requests,
        traffic.during_move,
        traffic.unavailable
    );
}

/// How many slots `ranges` (inclusive) hold.
fn slot_count(ranges: &[(u16, u16)]) -> usize {
    ranges
        .iter()
        .map(|&(first, last)| usize::from(last - first) + 1)
        .sum()
}
