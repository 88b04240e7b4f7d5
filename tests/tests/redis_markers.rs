//! The marker abandoned tokens leave on Redis (`IdempotencyStore::abandon`): it remembers
//! the latest 16 tokens abandoned on its key and no more, so a flood of requests that go away
//! during `begin` cannot grow one key without bound. On the test Redis, under a key prefix of
//! its own.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::Method;
use idempotency_actix::{
    BeginOutcome, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken, RedisStore, StorageKey,
};
use idempotency_actix_tests::{redis_connection, redis_pool, unique_prefix};

const LONG: Duration = Duration::from_secs(60);

#[actix_web::test]
async fn a_marker_remembers_the_latest_sixteen_abandoned_tokens_and_no_more() {
    let store = RedisStore::new(redis_pool().await);
    let prefix = unique_prefix("markers");
    let key = StorageKey::new(&prefix, b"", &IdempotencyKey::parse(b"k").unwrap());
    let print = Fingerprint::compute(&Method::POST, "/orders", "", b"{}", []);
    let tokens: Vec<LeaseToken> = (0..40).map(|_| LeaseToken::generate()).collect();
    for token in &tokens {
        assert!(store.abandon(&key, token, LONG).await.unwrap());
    }
    let mut connection = redis_connection().await;
    let bytes: usize = redis::cmd("STRLEN")
        .arg(key.as_str())
        .query_async(&mut connection)
        .await
        .unwrap();
    // The header (format, state, fingerprint) and 16 token fields of 1 + 32 bytes.
    assert_eq!(bytes, 2 + 32 + 16 * 33);
    for token in &tokens[24..] {
        assert_eq!(
            store.begin(&key, &print, token, LONG).await.unwrap(),
            BeginOutcome::Abandoned
        );
    }
    // Forgotten: the oldest takes the key as any other token would.
    assert_eq!(
        store.begin(&key, &print, &tokens[0], LONG).await.unwrap(),
        BeginOutcome::Acquired
    );
}
