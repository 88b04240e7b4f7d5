//! The backend-agnostic acceptance suite: every store must pass every test here.
//!
//! Each test runs once per backend (`memory::…`, `redis::…`, `valkey::…`, `redis8::…`,
//! `redis_cluster::…`, `valkey_cluster::…`, `redis8_cluster::…`,
//! `redis_cluster_replicated::…`, `postgres::…`). The Redis runs use the server at
//! `REDIS_URL` (default 127.0.0.1:6379); the Valkey and Redis 8 runs (the same stores; the
//! single-server store commits by `SET … IFEQ` on Valkey ≥ 8.1, by function on Redis 8) a
//! private `valkey-server` ≥ 8.1 or Redis ≥ 8.4, or a cluster
//! of them, that this test binary starts; the cluster runs a local 6-node cluster this test
//! binary starts (the replicated run waits for each write to reach the primary's replica);
//! each test under its own key prefix. The PostgreSQL runs use the server at `DATABASE_URL`
//! (default postgres://postgres@127.0.0.1:5432/postgres), each test in a database of its
//! own.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::{Method, StatusCode, header::HeaderName, header::HeaderValue};
use actix_web::web::Bytes;
use idempotency_actix::{
    BeginOutcome, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken, StorageKey,
    StoredResponse,
};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);

fn key(prefix: &str, name: &str) -> StorageKey {
    StorageKey::new(
        prefix,
        b"",
        &IdempotencyKey::parse(name.as_bytes()).unwrap(),
    )
}

fn print(body: &[u8]) -> Fingerprint {
    Fingerprint::compute(&Method::POST, "/orders", "", body, [])
}

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse::new(
        StatusCode::CREATED,
        vec![(
            HeaderName::from_static("location"),
            HeaderValue::from_static("/orders/1"),
        )],
        Some(Bytes::from_static(body)),
    )
}

async fn acquire(
    store: &impl IdempotencyStore,
    key: &StorageKey,
    body: &[u8],
    lease: Duration,
) -> LeaseToken {
    let token = LeaseToken::generate();
    match store.begin(key, &print(body), &token, lease).await.unwrap() {
        BeginOutcome::Acquired => token,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// What a new request (a fresh token) with `body` finds.
async fn begin_new(
    store: &impl IdempotencyStore,
    key: &StorageKey,
    body: &[u8],
    lease: Duration,
) -> BeginOutcome {
    let token = LeaseToken::generate();
    store.begin(key, &print(body), &token, lease).await.unwrap()
}

/// Commits the response `body` of the request with `body` held by `token`, kept for `ttl`:
/// whether the store wrote it.
async fn commits(
    store: &impl IdempotencyStore,
    key: &StorageKey,
    token: &LeaseToken,
    body: &'static [u8],
    ttl: Duration,
) -> bool {
    store
        .commit(key, &print(body), token, &response(body), ttl)
        .await
        .unwrap()
}

async fn a_new_key_is_acquired_once(store: impl IdempotencyStore, prefix: String) {
    let key = key(&prefix, "k");
    acquire(&store, &key, b"a", LEASE).await;
    assert_eq!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::InFlight
    );
}

async fn another_fingerprint_is_a_mismatch_in_flight_and_completed(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "k");
    let token = acquire(&store, &key, b"a", LEASE).await;
    assert_eq!(
        begin_new(&store, &key, b"b", LEASE).await,
        BeginOutcome::FingerprintMismatch
    );
    assert!(
        store
            .commit(&key, &print(b"a"), &token, &response(b"done"), TTL)
            .await
            .unwrap()
    );
    assert_eq!(
        begin_new(&store, &key, b"b", LEASE).await,
        BeginOutcome::FingerprintMismatch
    );
}

async fn a_committed_response_is_replayed_exactly(store: impl IdempotencyStore, prefix: String) {
    let key = key(&prefix, "k");
    let token = acquire(&store, &key, b"a", LEASE).await;
    assert!(
        store
            .commit(&key, &print(b"a"), &token, &response(b"{\"id\":1}"), TTL)
            .await
            .unwrap()
    );
    for _ in 0..3 {
        assert_eq!(
            begin_new(&store, &key, b"a", LEASE).await,
            BeginOutcome::Completed(response(b"{\"id\":1}"))
        );
    }
}

async fn a_record_without_body_is_replayed_without_body(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "k");
    let token = acquire(&store, &key, b"a", LEASE).await;
    let mut omitted = response(b"");
    omitted.body = None;
    assert!(
        store
            .commit(&key, &print(b"a"), &token, &omitted, TTL)
            .await
            .unwrap()
    );
    assert_eq!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::Completed(omitted)
    );
}

async fn begin_is_idempotent_for_its_token(store: impl IdempotencyStore, prefix: String) {
    let key = key(&prefix, "k");
    let token = acquire(&store, &key, b"a", LEASE).await;
    // The same token again (a retry after a lost reply) still holds the lock...
    assert_eq!(
        store
            .begin(&key, &print(b"a"), &token, LEASE)
            .await
            .unwrap(),
        BeginOutcome::Acquired
    );
    // ...which another token cannot take.
    assert_eq!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::InFlight
    );
    assert!(store.release(&key, &token).await.unwrap());
}

async fn keys_are_independent(store: impl IdempotencyStore, prefix: String) {
    acquire(&store, &key(&prefix, "one"), b"a", LEASE).await;
    acquire(&store, &key(&prefix, "two"), b"a", LEASE).await;
}

async fn a_wrong_token_cannot_commit_renew_or_release(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "k");
    acquire(&store, &key, b"a", LEASE).await;
    let stranger = LeaseToken::generate();
    assert!(
        !store
            .commit(&key, &print(b"a"), &stranger, &response(b"x"), TTL)
            .await
            .unwrap()
    );
    assert!(!store.renew(&key, &stranger, LEASE).await.unwrap());
    assert!(!store.release(&key, &stranger).await.unwrap());
    assert_eq!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::InFlight
    );
}

async fn renew_and_release_on_a_missing_key_report_false(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "never-begun");
    let token = LeaseToken::generate();
    assert!(!store.renew(&key, &token, LEASE).await.unwrap());
    assert!(!store.release(&key, &token).await.unwrap());
    // Nothing was created by those calls.
    acquire(&store, &key, b"a", LEASE).await;
}

/// A commit whose in-flight record is gone (its lease lapsed, it was evicted or deleted)
/// where no request holds the key: the completed record is written anew, and a retry gets
/// the replay instead of a second run.
async fn a_commit_whose_record_is_gone_writes_it_anew_where_the_key_is_free(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "k");
    let token = acquire(&store, &key, b"a", Duration::from_millis(50)).await;
    actix_rt::time::sleep(Duration::from_millis(120)).await;
    assert!(!store.renew(&key, &token, LEASE).await.unwrap(), "lapsed");
    assert!(
        store
            .commit(&key, &print(b"a"), &token, &response(b"late"), TTL)
            .await
            .unwrap()
    );
    assert_eq!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::Completed(response(b"late"))
    );
    assert_eq!(
        begin_new(&store, &key, b"b", LEASE).await,
        BeginOutcome::FingerprintMismatch,
        "written with the request's fingerprint"
    );
    // Sent again (a retry after a lost reply): done, nothing written.
    assert!(
        store
            .commit(&key, &print(b"a"), &token, &response(b"again"), TTL)
            .await
            .unwrap()
    );
    assert_eq!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::Completed(response(b"late"))
    );
}

/// Another token's marker blocks no one, a commit included; the marker of the committing
/// token itself (its `begin` was abandoned, so it never ran) is kept.
async fn a_commit_writes_over_another_tokens_marker_only(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "k");
    let (abandoned, other) = (LeaseToken::generate(), LeaseToken::generate());
    assert!(store.abandon(&key, &abandoned, TTL).await.unwrap());
    assert!(
        !store
            .commit(&key, &print(b"a"), &abandoned, &response(b"x"), TTL)
            .await
            .unwrap()
    );
    assert!(
        store
            .commit(&key, &print(b"a"), &other, &response(b"other"), TTL)
            .await
            .unwrap()
    );
    assert_eq!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::Completed(response(b"other"))
    );
}

async fn release_frees_the_key(store: impl IdempotencyStore, prefix: String) {
    let key = key(&prefix, "k");
    let token = acquire(&store, &key, b"a", LEASE).await;
    assert!(store.release(&key, &token).await.unwrap());
    // Released: the next request runs, even with another body.
    acquire(&store, &key, b"b", LEASE).await;
}

async fn a_committed_record_cannot_be_released_renewed_or_overwritten(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "k");
    let token = acquire(&store, &key, b"a", LEASE).await;
    let first = response(b"first");
    assert!(
        store
            .commit(&key, &print(b"a"), &token, &first, TTL)
            .await
            .unwrap()
    );
    assert!(!store.release(&key, &token).await.unwrap());
    assert!(!store.renew(&key, &token, LEASE).await.unwrap());
    // A repeated commit (a retry after a lost reply) succeeds and writes nothing.
    let second = response(b"second");
    assert!(
        store
            .commit(&key, &print(b"a"), &token, &second, TTL)
            .await
            .unwrap()
    );
    let stranger = LeaseToken::generate();
    assert!(
        !store
            .commit(&key, &print(b"a"), &stranger, &second, TTL)
            .await
            .unwrap()
    );
    assert_eq!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::Completed(response(b"first"))
    );
}

async fn an_expired_lease_frees_the_key(store: impl IdempotencyStore, prefix: String) {
    let key = key(&prefix, "k");
    acquire(&store, &key, b"a", Duration::from_millis(50)).await;
    actix_rt::time::sleep(Duration::from_millis(120)).await;
    acquire(&store, &key, b"a", LEASE).await;
}

async fn renewal_keeps_the_lease(store: impl IdempotencyStore, prefix: String) {
    let key = key(&prefix, "k");
    // Wide margins: each renewal comes a quarter lease after the last, so a renewal may
    // take 1.2 s (a replicated cluster's waits for its replica, on a machine loaded by the
    // other tests) before the lease lapses.
    let lease = Duration::from_millis(1_600);
    let token = acquire(&store, &key, b"a", lease).await;
    for _ in 0..6 {
        actix_rt::time::sleep(Duration::from_millis(400)).await;
        assert!(store.renew(&key, &token, lease).await.unwrap());
    }
    // 2.4 s after the start, one and a half leases: still held.
    assert_eq!(
        begin_new(&store, &key, b"a", lease).await,
        BeginOutcome::InFlight
    );
}

async fn a_lost_lease_cannot_overwrite_the_new_holder(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "k");
    let slow = acquire(&store, &key, b"a", Duration::from_millis(50)).await;
    actix_rt::time::sleep(Duration::from_millis(120)).await;
    let fast = acquire(&store, &key, b"a", LEASE).await;
    assert!(!store.renew(&key, &slow, LEASE).await.unwrap());
    assert!(
        !store
            .commit(&key, &print(b"a"), &slow, &response(b"slow"), TTL)
            .await
            .unwrap()
    );
    assert!(!store.release(&key, &slow).await.unwrap());
    assert!(
        store
            .commit(&key, &print(b"a"), &fast, &response(b"fast"), TTL)
            .await
            .unwrap()
    );
    assert_eq!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::Completed(response(b"fast"))
    );
}

async fn a_completed_record_expires_after_its_ttl(store: impl IdempotencyStore, prefix: String) {
    let key = key(&prefix, "k");
    let token = acquire(&store, &key, b"a", LEASE).await;
    assert!(
        store
            .commit(
                &key,
                &print(b"a"),
                &token,
                &response(b"x"),
                Duration::from_millis(600)
            )
            .await
            .unwrap()
    );
    assert!(matches!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::Completed(_)
    ));
    actix_rt::time::sleep(Duration::from_millis(800)).await;
    acquire(&store, &key, b"a", LEASE).await;
}

async fn concurrent_begins_acquire_exactly_once(store: impl IdempotencyStore, prefix: String) {
    let key = key(&prefix, "k");
    let fingerprint = print(b"a");
    let tokens: Vec<LeaseToken> = (0..50).map(|_| LeaseToken::generate()).collect();
    let outcomes = futures_util::future::join_all(
        tokens
            .iter()
            .map(|token| store.begin(&key, &fingerprint, token, LEASE)),
    )
    .await;
    let acquired = outcomes
        .iter()
        .filter(|outcome| matches!(outcome, Ok(BeginOutcome::Acquired)))
        .count();
    let in_flight = outcomes
        .iter()
        .filter(|outcome| matches!(outcome, Ok(BeginOutcome::InFlight)))
        .count();
    assert_eq!((acquired, in_flight), (1, 49));
}

async fn an_abandoned_token_never_takes_the_key_later(
    store: impl IdempotencyStore,
    prefix: String,
) {
    // The abandon lands first (the `begin` it gives up on is still on its way).
    let key = key(&prefix, "k");
    let late = LeaseToken::generate();
    assert!(store.abandon(&key, &late, TTL).await.unwrap());
    assert_eq!(
        store.begin(&key, &print(b"a"), &late, LEASE).await.unwrap(),
        BeginOutcome::Abandoned
    );
    // The marker is no record and holds nothing...
    assert!(!store.renew(&key, &late, LEASE).await.unwrap());
    assert!(
        !store
            .commit(&key, &print(b"a"), &late, &response(b"x"), TTL)
            .await
            .unwrap()
    );
    assert!(!store.release(&key, &late).await.unwrap());
    // ...and blocks no one: a retry with another token, even another body, runs.
    let retry = acquire(&store, &key, b"b", LEASE).await;
    assert!(
        store
            .commit(&key, &print(b"b"), &retry, &response(b"b"), TTL)
            .await
            .unwrap()
    );
    assert_eq!(
        begin_new(&store, &key, b"b", LEASE).await,
        BeginOutcome::Completed(response(b"b"))
    );
}

async fn abandoning_a_begin_that_landed_frees_the_key(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "k");
    let token = acquire(&store, &key, b"a", LEASE).await;
    assert!(store.abandon(&key, &token, TTL).await.unwrap());
    // The same `begin` arriving once more (sent twice) creates nothing.
    assert_eq!(
        store
            .begin(&key, &print(b"a"), &token, LEASE)
            .await
            .unwrap(),
        BeginOutcome::Abandoned
    );
    acquire(&store, &key, b"a", LEASE).await;
}

async fn abandon_leaves_another_record_alone(store: impl IdempotencyStore, prefix: String) {
    let key = key(&prefix, "k");
    let holder = acquire(&store, &key, b"a", LEASE).await;
    // Another request holds the key: not done, the caller tries again later.
    assert!(
        !store
            .abandon(&key, &LeaseToken::generate(), TTL)
            .await
            .unwrap()
    );
    assert_eq!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::InFlight
    );
    assert!(
        store
            .commit(&key, &print(b"a"), &holder, &response(b"a"), TTL)
            .await
            .unwrap()
    );
    // A completed record keeps any late `begin` out by itself: done, and left as it is.
    assert!(store.abandon(&key, &holder, TTL).await.unwrap());
    assert!(
        store
            .abandon(&key, &LeaseToken::generate(), TTL)
            .await
            .unwrap()
    );
    assert_eq!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::Completed(response(b"a"))
    );
}

/// A token abandoned on a completed record (a retry completed the key before the abandon
/// landed) is kept out by that record for as long as its marker would have been kept: the
/// record lives at least `remember_for` from the abandon, even past its own ttl, so the
/// token's `begin`, should it land after that ttl, finds the replay instead of a free key
/// it would lock for a lease.
async fn a_completed_record_keeps_a_token_abandoned_on_it_out(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "k");
    let holder = acquire(&store, &key, b"a", LEASE).await;
    let ttl = Duration::from_millis(600);
    assert!(
        store
            .commit(&key, &print(b"a"), &holder, &response(b"a"), ttl)
            .await
            .unwrap()
    );
    let late = LeaseToken::generate();
    assert!(store.abandon(&key, &late, LEASE).await.unwrap());
    actix_rt::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        store.begin(&key, &print(b"a"), &late, LEASE).await.unwrap(),
        BeginOutcome::Completed(response(b"a"))
    );
    assert_eq!(
        begin_new(&store, &key, b"a", LEASE).await,
        BeginOutcome::Completed(response(b"a"))
    );
    // A record that outlives `remember_for` anyway keeps its own expiry.
    let long = key_with_ttl(&store, &prefix, TTL).await;
    assert!(
        store
            .abandon(&long, &LeaseToken::generate(), Duration::from_millis(100))
            .await
            .unwrap()
    );
    actix_rt::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(
        begin_new(&store, &long, b"a", LEASE).await,
        BeginOutcome::Completed(_)
    ));
}

/// A key `long` completed with `ttl`.
async fn key_with_ttl(store: &impl IdempotencyStore, prefix: &str, ttl: Duration) -> StorageKey {
    let long = key(prefix, "long");
    let token = acquire(store, &long, b"a", LEASE).await;
    assert!(
        store
            .commit(&long, &print(b"a"), &token, &response(b"a"), ttl)
            .await
            .unwrap()
    );
    long
}

async fn a_marker_remembers_every_token_abandoned_on_its_key(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "k");
    let tokens: Vec<LeaseToken> = (0..3).map(|_| LeaseToken::generate()).collect();
    for token in &tokens {
        assert!(store.abandon(&key, token, TTL).await.unwrap());
    }
    for token in &tokens {
        assert_eq!(
            store.begin(&key, &print(b"a"), token, LEASE).await.unwrap(),
            BeginOutcome::Abandoned
        );
    }
    acquire(&store, &key, b"a", LEASE).await;
}

/// A key taken over another token's marker and then released (the handler failed) gets the
/// marker back for the rest of its time: the abandoned token's `begin`, landing after the
/// release (a retried command on another connection), creates nothing, while a retry with a
/// new token takes the key at once. The key used to be left empty, and that late `begin`
/// locked it for a lease with no handler running.
async fn a_key_released_after_a_takeover_keeps_the_marker_s_tokens_out(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "k");
    let (late, earlier) = (LeaseToken::generate(), LeaseToken::generate());
    assert!(store.abandon(&key, &earlier, TTL).await.unwrap());
    assert!(store.abandon(&key, &late, TTL).await.unwrap());
    let taker = acquire(&store, &key, b"a", LEASE).await;
    assert!(store.renew(&key, &taker, LEASE).await.unwrap());
    assert!(store.release(&key, &taker).await.unwrap());
    for abandoned in [&late, &earlier] {
        assert_eq!(
            store
                .begin(&key, &print(b"a"), abandoned, LEASE)
                .await
                .unwrap(),
            BeginOutcome::Abandoned,
            "a late `begin` took the key after the release"
        );
    }
    // The retry runs at once, and completes the key as usual.
    let retry = acquire(&store, &key, b"b", LEASE).await;
    assert!(!store.release(&key, &taker).await.unwrap(), "released once");
    assert!(commits(&store, &key, &retry, b"b", TTL).await);
    assert_eq!(
        store.begin(&key, &print(b"b"), &late, LEASE).await.unwrap(),
        BeginOutcome::Completed(response(b"b"))
    );
}

/// A token that took a key over another token's marker and is then abandoned itself (its
/// `begin` landed, its reply did not) leaves a marker naming both tokens.
async fn abandoning_a_takeover_keeps_the_marker_s_tokens(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let key = key(&prefix, "k");
    let first = LeaseToken::generate();
    assert!(store.abandon(&key, &first, TTL).await.unwrap());
    let taker = acquire(&store, &key, b"a", LEASE).await;
    assert!(store.abandon(&key, &taker, TTL).await.unwrap());
    for abandoned in [&first, &taker] {
        assert_eq!(
            store
                .begin(&key, &print(b"a"), abandoned, LEASE)
                .await
                .unwrap(),
            BeginOutcome::Abandoned
        );
    }
    acquire(&store, &key, b"a", LEASE).await;
}

/// A key taken over another token's marker and completed with a ttl shorter than the
/// marker's time is kept for the marker's time, as an abandon that finds a completed record
/// keeps it: the abandoned token's `begin`, landing after the record's own ttl, finds the
/// replay instead of a free key it would lock for a lease. So is a record written anew over
/// a marker by a commit whose lease lapsed.
async fn a_key_completed_after_a_takeover_keeps_the_marker_s_tokens_out(
    store: impl IdempotencyStore,
    prefix: String,
) {
    let ttl = Duration::from_millis(600);
    let (taken, written_anew) = (key(&prefix, "taken"), key(&prefix, "anew"));
    let (late, late_too) = (LeaseToken::generate(), LeaseToken::generate());
    assert!(store.abandon(&taken, &late, LEASE).await.unwrap());
    let taker = acquire(&store, &taken, b"a", LEASE).await;
    assert!(commits(&store, &taken, &taker, b"a", ttl).await);
    let lapsed = acquire(&store, &written_anew, b"a", Duration::from_millis(50)).await;
    actix_rt::time::sleep(Duration::from_millis(120)).await;
    assert!(
        store
            .abandon(&written_anew, &late_too, LEASE)
            .await
            .unwrap()
    );
    assert!(commits(&store, &written_anew, &lapsed, b"a", ttl).await);
    actix_rt::time::sleep(Duration::from_millis(800)).await;
    for (key, abandoned) in [(&taken, &late), (&written_anew, &late_too)] {
        assert_eq!(
            store
                .begin(key, &print(b"a"), abandoned, LEASE)
                .await
                .unwrap(),
            BeginOutcome::Completed(response(b"a")),
            "the record was not kept for the marker's time"
        );
    }
}

/// One module per backend, each with every test of the suite (one list for all backends).
macro_rules! acceptance_suite {
    ($backend:ident, $($make_store:tt)+) => {
        mod $backend {
            acceptance_suite!(@each [$($make_store)+];
                a_new_key_is_acquired_once,
                another_fingerprint_is_a_mismatch_in_flight_and_completed,
                a_committed_response_is_replayed_exactly,
                a_record_without_body_is_replayed_without_body,
                keys_are_independent,
                begin_is_idempotent_for_its_token,
                a_wrong_token_cannot_commit_renew_or_release,
                renew_and_release_on_a_missing_key_report_false,
                a_commit_whose_record_is_gone_writes_it_anew_where_the_key_is_free,
                a_commit_writes_over_another_tokens_marker_only,
                release_frees_the_key,
                a_committed_record_cannot_be_released_renewed_or_overwritten,
                an_expired_lease_frees_the_key,
                renewal_keeps_the_lease,
                a_lost_lease_cannot_overwrite_the_new_holder,
                a_completed_record_expires_after_its_ttl,
                concurrent_begins_acquire_exactly_once,
                an_abandoned_token_never_takes_the_key_later,
                abandoning_a_begin_that_landed_frees_the_key,
                abandon_leaves_another_record_alone,
                a_marker_remembers_every_token_abandoned_on_its_key,
                a_completed_record_keeps_a_token_abandoned_on_it_out,
                a_key_released_after_a_takeover_keeps_the_marker_s_tokens_out,
                abandoning_a_takeover_keeps_the_marker_s_tokens,
                a_key_completed_after_a_takeover_keeps_the_marker_s_tokens_out,
            );
        }
    };
    // A backend that needs a database of the test's own: `$make_store` gets it.
    (@each [database => $make_store:expr]; $($test:ident),* $(,)?) => {
        $(
            #[actix_web::test]
            async fn $test() {
                let prefix = idempotency_actix_tests::unique_prefix(stringify!($test));
                let database = idempotency_actix_tests::TestDatabase::create().await;
                super::$test($make_store(&database).await, prefix).await;
            }
        )*
    };
    (@each [$make_store:expr]; $($test:ident),* $(,)?) => {
        $(
            #[actix_web::test]
            async fn $test() {
                let prefix = idempotency_actix_tests::unique_prefix(stringify!($test));
                super::$test($make_store, prefix).await;
            }
        )*
    };
}

acceptance_suite!(memory, idempotency_actix::MemoryStore::new());
acceptance_suite!(
    redis,
    idempotency_actix::RedisStore::new(idempotency_actix_tests::redis_pool().await)
);
// Valkey ≥ 8.1: the same store commits by `SET … IFEQ` instead of a function.
acceptance_suite!(
    valkey,
    idempotency_actix::RedisStore::new(idempotency_actix_tests::valkey_pool())
);
// Redis ≥ 8.4, from the server's own prefix (never the one on the PATH): it has
// `SET … IFEQ`, but the store commits by function there (docs/redis-8-set-ifeq.md).
acceptance_suite!(
    redis8,
    idempotency_actix::RedisStore::new(idempotency_actix_tests::redis8_pool())
);
acceptance_suite!(
    postgres,
    database => idempotency_actix_tests::TestDatabase::store
);
acceptance_suite!(
    redis_cluster,
    idempotency_actix::RedisClusterStore::new(
        idempotency_actix_tests::cluster::RedisCluster::shared().client()
    )
);
// Valkey ≥ 8.1 nodes (the cluster store commits by function on every server).
acceptance_suite!(
    valkey_cluster,
    idempotency_actix::RedisClusterStore::new(
        idempotency_actix_tests::cluster::RedisCluster::valkey_shared().client()
    )
);
// Redis ≥ 8.4 nodes: the same through the cluster connection.
acceptance_suite!(
    redis8_cluster,
    idempotency_actix::RedisClusterStore::new(
        idempotency_actix_tests::cluster::RedisCluster::redis8_shared().client()
    )
);
// A wide wait for the replica: each write is still acknowledged by it (strict), but on a
// loaded machine (cargo nextest runs each test in a process of its own, each starting a
// cluster of 6 nodes) an acknowledgement can take longer than the 500 ms an app would use.
acceptance_suite!(
    redis_cluster_replicated,
    idempotency_actix::RedisClusterStore::new(
        idempotency_actix_tests::cluster::RedisCluster::shared().client()
    )
    .replicated_writes(idempotency_actix::ReplicatedWrites::new(
        1,
        std::time::Duration::from_secs(3)
    ))
);
