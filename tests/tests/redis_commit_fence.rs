//! The Redis commit's fence: the function (Redis, every version) or `SET … IFEQ` (Valkey
//! ≥ 8.1) writes the completed record only where it finds, byte for byte, the in-flight
//! record that the `begin` of the same token and fingerprint wrote. Runs against the server
//! at `REDIS_URL` (default 127.0.0.1:6379), a private `valkey-server` and a private Redis
//! ≥ 8.4, under a key prefix of its own.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::{Method, StatusCode};
use actix_web::web::Bytes;
use idempotency_actix::{
    BeginOutcome, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken, RedisStore,
    StorageKey, StoredResponse,
};
use idempotency_actix_tests::{redis_pool, redis8_pool, unique_prefix, valkey_pool};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);

fn print(body: &[u8]) -> Fingerprint {
    Fingerprint::compute(&Method::POST, "/orders", "", body, [])
}

#[actix_web::test]
async fn a_commit_with_another_fingerprint_than_its_begin_writes_nothing() {
    a_commit_is_fenced_by_the_whole_in_flight_record(RedisStore::new(redis_pool().await)).await;
}

#[actix_web::test]
async fn on_valkey_a_commit_with_another_fingerprint_than_its_begin_writes_nothing() {
    a_commit_is_fenced_by_the_whole_in_flight_record(RedisStore::new(valkey_pool())).await;
}

#[actix_web::test]
async fn on_redis_8_a_commit_with_another_fingerprint_than_its_begin_writes_nothing() {
    a_commit_is_fenced_by_the_whole_in_flight_record(RedisStore::new(redis8_pool())).await;
}

async fn a_commit_is_fenced_by_the_whole_in_flight_record(store: RedisStore) {
    let key = StorageKey::new(
        &unique_prefix("commit-fence"),
        b"",
        &IdempotencyKey::parse(b"k").unwrap(),
    );
    let (ours, another) = (print(b"a"), print(b"b"));
    let token = LeaseToken::generate();
    let begun = store.begin(&key, &ours, &token, LEASE).await;
    assert_eq!(begun.unwrap(), BeginOutcome::Acquired);
    let response = StoredResponse::new(
        StatusCode::CREATED,
        Vec::new(),
        Some(Bytes::from_static(b"{\"id\":1}")),
    );

    // The right token with another fingerprint is not the record `begin` wrote.
    let mismatched = store.commit(&key, &another, &token, &response, TTL);
    assert!(!mismatched.await.unwrap());
    let other = LeaseToken::generate();
    let still = store.begin(&key, &ours, &other, LEASE).await;
    assert_eq!(still.unwrap(), BeginOutcome::InFlight);

    // With the fingerprint of its `begin`, the same commit completes the record.
    let matched = store.commit(&key, &ours, &token, &response, TTL);
    assert!(matched.await.unwrap());
    let replay = store.begin(&key, &ours, &other, LEASE).await;
    assert_eq!(replay.unwrap(), BeginOutcome::Completed(response));
}
