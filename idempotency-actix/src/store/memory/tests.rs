//! The memory store's own bookkeeping: expiry, eviction order, byte counts, shard indices.

use std::time::Duration;

use actix_web::http::{Method, StatusCode};
use actix_web::web::Bytes;

use super::*;
use crate::key::IdempotencyKey;

const LONG: Duration = Duration::from_secs(3600);

fn key(name: &str) -> StorageKey {
    StorageKey::new("t:", b"", &IdempotencyKey::parse(name.as_bytes()).unwrap())
}

fn print() -> Fingerprint {
    Fingerprint::compute(&Method::POST, "/", "", b"", [])
}

fn response(body_len: usize) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: Vec::new(),
        body: Some(Bytes::from(vec![b'x'; body_len])),
    }
}

/// Held for its whole run by each test whose store logs a warning (a completed record
/// evicted, a response too large to keep), and by the one that captures those warnings. A
/// callsite's interest is cached for the process: a test's first warning, registering the
/// callsite while the capturing test installs its subscriber (`cargo test` runs this crate's
/// tests side by side in one process), may store an interest computed without that
/// subscriber after tracing rebuilt it with it, and the warning is then lost to it (seen:
/// `one warning of each: [true]`, about one run in fifty of `store::memory` with
/// `--test-threads=8`).
static WARNING_TESTS: std::sync::LazyLock<futures_util::lock::Mutex<()>> =
    std::sync::LazyLock::new(|| futures_util::lock::Mutex::new(()));

/// A store of one shard, so that every record competes for the same budget.
fn one_shard(max_bytes: usize) -> MemoryStore {
    MemoryStore::builder()
        .max_bytes(max_bytes)
        .shards(1)
        .build()
}

fn consistent(store: &MemoryStore) -> bool {
    store.shards().all(|shard| shard.is_consistent())
}

async fn begin(store: &MemoryStore, name: &str, lease: Duration) -> Result<LeaseToken, StoreError> {
    let token = LeaseToken::generate();
    match store.begin(&key(name), &print(), &token, lease).await? {
        BeginOutcome::Acquired => Ok(token),
        other => panic!("{name}: expected Acquired, got {other:?}"),
    }
}

async fn complete(store: &MemoryStore, name: &str, body_len: usize, ttl: Duration) {
    let token = begin(store, name, LONG).await.unwrap();
    let committed = store
        .commit(&key(name), &print(), &token, &response(body_len), ttl)
        .await;
    assert!(committed.unwrap(), "{name} committed");
}

async fn outcome(store: &MemoryStore, name: &str) -> BeginOutcome {
    let token = LeaseToken::generate();
    let outcome = store
        .begin(&key(name), &print(), &token, LONG)
        .await
        .unwrap();
    if outcome == BeginOutcome::Acquired {
        store.release(&key(name), &token).await.unwrap();
    }
    outcome
}

#[actix_web::test]
async fn expired_records_are_reclaimed_by_later_operations() {
    let store = one_shard(MemoryStoreBuilder::DEFAULT_MAX_BYTES);
    for i in 0..1_000 {
        begin(&store, &format!("k{i}"), Duration::from_millis(1))
            .await
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(5));
    for i in 0..300 {
        complete(&store, &format!("live{i}"), 10, LONG).await;
    }
    // 600 operations reclaim up to 4 expired records each: all 1 000 are gone.
    assert_eq!(store.len(), 300);
    assert!(consistent(&store));
}

#[actix_web::test]
async fn eviction_takes_the_completed_record_soonest_to_expire() {
    let _warns = WARNING_TESTS.lock().await;
    let store = one_shard(60_000);
    complete(&store, "long", 10_000, LONG).await;
    complete(&store, "short", 10_000, Duration::from_secs(60)).await;
    complete(&store, "middle", 10_000, Duration::from_secs(600)).await;
    complete(&store, "newest", 30_000, LONG).await;
    assert_eq!(store.evictions(), 1);
    for kept in ["long", "middle", "newest"] {
        assert!(
            matches!(outcome(&store, kept).await, BeginOutcome::Completed(_)),
            "{kept} kept"
        );
    }
    assert_eq!(outcome(&store, "short").await, BeginOutcome::Acquired);
    assert!(store.used_bytes() <= store.max_bytes());
    assert!(consistent(&store));
}

#[actix_web::test]
async fn in_flight_records_are_never_evicted_and_a_full_store_recovers() {
    let store = one_shard(4_000);
    let mut held = Vec::new();
    let refused = loop {
        match begin(&store, &format!("held{}", held.len()), LONG).await {
            Ok(token) => held.push(token),
            Err(error) => break error,
        }
        assert!(held.len() < 100, "a 4 000-byte store never fills");
    };
    assert!(matches!(refused, StoreError::Refused(_)), "{refused}");
    assert!(held.len() >= 2);
    for (i, _) in held.iter().enumerate() {
        assert_eq!(
            outcome(&store, &format!("held{i}")).await,
            BeginOutcome::InFlight
        );
    }
    // Releasing one makes room for exactly one new key.
    let first = key("held0");
    assert!(store.release(&first, &held[0]).await.unwrap());
    begin(&store, "after-release", LONG).await.unwrap();
    assert!(begin(&store, "one-too-many", LONG).await.is_err());
    assert_eq!(store.evictions(), 0);
    assert!(consistent(&store));
}

#[actix_web::test]
async fn a_store_full_of_in_flight_records_can_complete_them_all() {
    let _warns = WARNING_TESTS.lock().await;
    let store = one_shard(4_000);
    let mut held = Vec::new();
    while let Ok(token) = begin(&store, &format!("held{}", held.len()), LONG).await {
        held.push(token);
    }
    for (i, token) in held.iter().enumerate() {
        let committed = store
            .commit(
                &key(&format!("held{i}")),
                &print(),
                token,
                &response(100),
                LONG,
            )
            .await;
        assert!(committed.unwrap(), "held{i} committed");
    }
    assert!(store.used_bytes() <= store.max_bytes());
    assert!(consistent(&store));
}

#[actix_web::test]
async fn a_response_larger_than_the_store_is_completed_without_its_body() {
    let _warns = WARNING_TESTS.lock().await;
    let store = one_shard(4_000);
    let token = begin(&store, "big", LONG).await.unwrap();
    assert!(
        store
            .commit(&key("big"), &print(), &token, &response(10_000), LONG)
            .await
            .unwrap()
    );
    match outcome(&store, "big").await {
        BeginOutcome::Completed(stored) => {
            assert_eq!(stored.status, StatusCode::CREATED);
            assert_eq!(stored.body, None);
        }
        other => panic!("expected Completed, got {other:?}"),
    }
    assert!(store.used_bytes() <= store.max_bytes());
}

#[actix_web::test]
async fn renewals_commits_releases_and_abandons_keep_the_indices_exact() {
    let _warns = WARNING_TESTS.lock().await;
    let store = one_shard(50_000);
    for round in 0..300 {
        let name = format!("k{}", round % 37);
        let token = LeaseToken::generate();
        if round % 5 == 4 {
            // A token abandoned before its `begin` lands: a marker, or one more token in it.
            store.abandon(&key(&name), &token, LONG).await.unwrap();
            assert!(consistent(&store), "after round {round}");
            continue;
        }
        if store
            .begin(&key(&name), &print(), &token, LONG)
            .await
            .unwrap()
            != BeginOutcome::Acquired
        {
            continue;
        }
        store.renew(&key(&name), &token, LONG * 2).await.unwrap();
        match round % 4 {
            0 => {
                store.release(&key(&name), &token).await.unwrap();
            }
            1 => {
                assert!(store.abandon(&key(&name), &token, LONG).await.unwrap());
            }
            _ => {
                store
                    .commit(&key(&name), &print(), &token, &response(round * 7), LONG)
                    .await
                    .unwrap();
            }
        }
        assert!(consistent(&store), "after round {round}");
    }
}

#[actix_web::test]
async fn shared_settings_give_one_store_per_configuration() {
    let settings = MemoryStore::builder().max_bytes(3 * 1024 * 1024 + 17);
    let (a, b) = (settings.shared(), settings.shared());
    let other = MemoryStore::builder()
        .max_bytes(3 * 1024 * 1024 + 18)
        .shared();
    begin(&a, "shared", LONG).await.unwrap();
    assert_eq!(b.len(), 1);
    assert_eq!(other.len(), 0);
    assert!(Arc::ptr_eq(&a.inner, &b.inner));
}

#[actix_web::test]
async fn a_marker_remembers_the_latest_abandoned_tokens_in_bounded_memory() {
    let store = one_shard(50_000);
    let tokens: Vec<LeaseToken> = (0..20).map(|_| LeaseToken::generate()).collect();
    for token in &tokens {
        assert!(store.abandon(&key("k"), token, LONG).await.unwrap());
    }
    let used = store.used_bytes();
    assert!(consistent(&store));
    for token in &tokens[4..] {
        assert_eq!(
            store.begin(&key("k"), &print(), token, LONG).await.unwrap(),
            BeginOutcome::Abandoned
        );
    }
    // One more abandon costs nothing more: the oldest token is forgotten.
    assert!(
        store
            .abandon(&key("k"), &LeaseToken::generate(), LONG)
            .await
            .unwrap()
    );
    assert_eq!(store.used_bytes(), used);
    assert_eq!(
        store
            .begin(&key("k"), &print(), &tokens[0], LONG)
            .await
            .unwrap(),
        BeginOutcome::Acquired
    );
    assert!(consistent(&store));
}

#[actix_web::test]
async fn a_store_whose_shards_cannot_hold_one_record_is_refused_when_built() {
    // 1 KiB a shard: its in-flight half is less than one in-flight record, so every new key
    // would be refused (503) as if the empty store were full of them.
    let too_small = std::panic::catch_unwind(|| {
        MemoryStore::builder()
            .max_bytes(16 * 1024)
            .shards(16)
            .build()
    });
    assert!(
        too_small.is_err(),
        "a store that can hold no record was built"
    );
    // The least share accepted takes a new key under a 64-byte prefix.
    let least = one_shard(entry::MIN_SHARD_BUDGET);
    let prefixed = StorageKey::new(&"p".repeat(64), b"", &IdempotencyKey::parse(b"k").unwrap());
    let token = LeaseToken::generate();
    let begun = least.begin(&prefixed, &print(), &token, LONG).await;
    assert_eq!(begun.unwrap(), BeginOutcome::Acquired);
}

#[actix_web::test]
async fn a_marker_makes_room_without_counting_as_an_eviction() {
    let store = one_shard(30_000);
    // The marker of an abandoned token, soonest to expire.
    let remember_for = Duration::from_secs(60);
    let abandoned = LeaseToken::generate();
    assert!(
        store
            .abandon(&key("marker"), &abandoned, remember_for)
            .await
            .unwrap()
    );
    let marker_bytes = store.used_bytes();
    complete(&store, "first", 10_000, LONG).await;
    let record_overhead = store.used_bytes() - marker_bytes - 10_000;
    // A second record that fits once the marker is gone, and only then.
    let room = store.max_bytes() - store.used_bytes();
    complete(
        &store,
        "second",
        room + marker_bytes / 2 - record_overhead,
        LONG,
    )
    .await;

    assert_eq!(store.evictions(), 0, "no record was lost");
    assert!(
        store
            .inspect(&key("marker"), false)
            .await
            .unwrap()
            .is_none(),
        "the marker was evicted"
    );
    for kept in ["first", "second"] {
        assert!(
            matches!(outcome(&store, kept).await, BeginOutcome::Completed(_)),
            "{kept} kept"
        );
    }
    assert!(consistent(&store));
}

/// A subscriber that notes, at each event, whether the store's one shard could be locked.
struct ShardLockProbe {
    store: MemoryStore,
    free_at_events: Arc<Mutex<Vec<bool>>>,
}

impl ShardLockProbe {
    /// A probe of `store` as this thread's subscriber while the guard lives, and what it
    /// notes.
    fn log_to(store: &MemoryStore) -> (tracing::subscriber::DefaultGuard, Arc<Mutex<Vec<bool>>>) {
        let free_at_events = Arc::new(Mutex::new(Vec::new()));
        let probe = Self {
            store: store.clone(),
            free_at_events: Arc::clone(&free_at_events),
        };
        (tracing::subscriber::set_default(probe), free_at_events)
    }
}

impl tracing::Subscriber for ShardLockProbe {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {
        let free = self.store.inner.shards[0].try_lock().is_ok();
        self.free_at_events.lock().unwrap().push(free);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[actix_web::test]
async fn what_a_commit_logs_is_logged_once_the_shard_is_unlocked() {
    let _warns = WARNING_TESTS.lock().await;
    let store = one_shard(20_000);
    let (_logging, free_at_events) = ShardLockProbe::log_to(&store);
    // A response too large for the store: completed without its body, with a warning.
    complete(&store, "large", 100_000, LONG).await;
    // Records evicted before their ttl, with a warning (at most one a minute).
    for i in 0..4 {
        complete(&store, &format!("filler{i}"), 5_000, LONG).await;
    }
    assert!(store.evictions() > 0);

    let free_at_events = free_at_events.lock().unwrap();
    assert_eq!(
        free_at_events.len(),
        2,
        "one warning of each: {free_at_events:?}"
    );
    assert!(
        free_at_events.iter().all(|free| *free),
        "another request on the shard waited for a log line: {free_at_events:?}"
    );
}

/// A store whose shards are small for its responses cuts every one to fit: one warning
/// per 10 s, not one per request (helper review), as evictions and store failures are.
#[actix_web::test]
async fn responses_cut_to_fit_are_warned_of_at_most_once_per_interval() {
    let _warns = WARNING_TESTS.lock().await;
    let store = one_shard(20_000);
    let (_logging, events) = ShardLockProbe::log_to(&store);
    for i in 0..10 {
        complete(&store, &format!("large{i}"), 100_000, LONG).await;
    }
    assert_eq!(
        events.lock().unwrap().len(),
        1,
        "ten responses cut to fit, one warning"
    );
}

/// A small deterministic generator (xorshift64*), so that the run below is the same on every
/// machine and needs no dependency.
struct Xorshift(u64);

impl Xorshift {
    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % bound
    }
}

/// What the test knows a key holds: the live in-flight record of a token it acquired.
#[derive(Clone, Copy)]
struct Held {
    token: LeaseToken,
    until: std::time::Instant,
}

/// Random operations on one shard, on a clock the test moves (leases and ttls of a few
/// ticks, so records expire, are reclaimed and evicted all the time, in a budget that holds
/// a handful of them): after each, the map, the indices and the byte counts agree, the
/// bytes stay within the budget, and no live in-flight record is ever lost, evicted or
/// taken by another token.
#[test]
fn random_operations_on_a_clock_keep_the_shard_exact_and_in_flight_records_held() {
    use super::shard::{Begun, HashedKey, Shard};
    let tick = Duration::from_millis(1);
    let mut random = Xorshift(0x9e37_79b9_7f4a_7c15);
    let keys: Vec<StorageKey> = (0..12).map(|i| key(&format!("k{i}"))).collect();
    let hasher = foldhash::quality::RandomState::default();
    let hashed = |i: usize| HashedKey {
        key: keys[i].as_str(),
        hash: std::hash::BuildHasher::hash_one(&hasher, keys[i].as_str()),
    };
    let prints = [print(), Fingerprint::from_bytes([7; 32])];
    for budget in [entry::MIN_SHARD_BUDGET, 4_000, 9_000, 40_000] {
        let mut shard = Shard::new(budget);
        let mut now = std::time::Instant::now();
        let mut held: Vec<Option<Held>> = vec![None; keys.len()];
        let mut tokens: Vec<Vec<LeaseToken>> = vec![Vec::new(); keys.len()];
        for round in 0..20_000 {
            now += tick * u32::try_from(random.below(3)).unwrap();
            let i = usize::try_from(random.below(keys.len() as u64)).unwrap();
            let key = hashed(i);
            if held[i].is_some_and(|held| held.until <= now) {
                held[i] = None;
            }
            // A token of this key's past, or a new one.
            let token = match random.below(3) {
                0 if !tokens[i].is_empty() => {
                    let at = random.below(tokens[i].len() as u64);
                    tokens[i][usize::try_from(at).unwrap()]
                }
                _ => {
                    let token = LeaseToken::generate();
                    tokens[i].push(token);
                    token
                }
            };
            let token = match (random.below(2), held[i]) {
                (0, Some(held)) => held.token,
                _ => token,
            };
            let lease = tick * (1 + u32::try_from(random.below(20)).unwrap());
            let ttl = tick * (1 + u32::try_from(random.below(40)).unwrap());
            let fingerprint = prints[usize::try_from(random.below(4)).unwrap().min(1)];
            let body = usize::try_from(random.below(3_000)).unwrap();
            let operation = random.below(7);
            match operation {
                0 | 1 => {
                    let begun = shard.begin(key, &fingerprint, &token, lease, now);
                    let acquired = matches!(begun, Ok(Begun::Decided(BeginOutcome::Acquired)));
                    match held[i] {
                        Some(holder) if holder.token != token => assert!(
                            !acquired,
                            "round {round}: another token took a live in-flight record"
                        ),
                        None if acquired => {
                            held[i] = Some(Held {
                                token,
                                until: now + lease,
                            });
                        }
                        _ => {}
                    }
                }
                2 => {
                    let renewed = shard.renew(key, &token, lease, now);
                    match held[i] {
                        Some(holder) if holder.token == token => {
                            assert!(renewed, "round {round}: a live in-flight record was lost");
                            held[i] = Some(Held {
                                token,
                                until: now + lease,
                            });
                        }
                        _ => assert!(!renewed, "round {round}: renewed a record not held"),
                    }
                }
                3 => {
                    let committed =
                        shard.commit(key, &fingerprint, &token, &response(body), ttl, now);
                    if held[i].is_some_and(|holder| holder.token == token) {
                        assert!(
                            matches!(committed, Ok(true)),
                            "round {round}: the holder's commit failed"
                        );
                        held[i] = None;
                    } else if held[i].is_some() {
                        assert!(
                            matches!(committed, Ok(false)),
                            "round {round}: a commit over another token's in-flight record"
                        );
                    }
                }
                4 => {
                    let released = shard.release(key, &token, now);
                    let holds = held[i].is_some_and(|holder| holder.token == token);
                    assert_eq!(released, holds, "round {round}: release");
                    if holds {
                        held[i] = None;
                    }
                }
                5 => {
                    let abandoned = shard.abandon(key, &token, ttl, now);
                    match held[i] {
                        Some(holder) if holder.token != token => {
                            assert!(!abandoned, "round {round}: abandoned over another token");
                        }
                        _ => {
                            assert!(abandoned, "round {round}: abandon");
                            held[i] = None;
                        }
                    }
                }
                _ => {
                    let force = random.below(4) == 0;
                    let deleted = shard.delete(key, force, now);
                    if held[i].is_some() {
                        if force {
                            assert_eq!(deleted, Deletion::Deleted, "round {round}: forced");
                            held[i] = None;
                        } else {
                            assert_eq!(deleted, Deletion::InFlight, "round {round}: delete");
                        }
                    }
                    let _ = shard.inspect(key, now);
                }
            }
            let _ = shard.take_report();
            assert!(
                shard.is_consistent(),
                "round {round} (operation {operation}, budget {budget}): the shard disagrees \
                 with itself"
            );
        }
    }
}
