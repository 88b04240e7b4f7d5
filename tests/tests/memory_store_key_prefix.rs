//! A memory store under a key prefix longer than the 64 bytes its builder allows for: a
//! prefix its shards can hold serves new keys, and one they cannot is refused when it is set,
//! rather than leaving a store that answers 503 to every new key.

#![allow(clippy::unwrap_used)]

use std::panic::{AssertUnwindSafe, catch_unwind};

use actix_web::http::StatusCode;
use idempotency_actix::{Idempotency, MemoryStore};
use idempotency_actix_tests::post_twice;

/// A one-shard store of 2 KiB: above the least budget the builder accepts (about 1.2 KB),
/// so it is built, but its in-flight half holds no record under a prefix of 2 KiB.
fn small_store() -> MemoryStore {
    MemoryStore::builder().max_bytes(2048).shards(1).build()
}

#[actix_web::test]
async fn a_key_prefix_over_64_bytes_that_the_shards_hold_serves_new_keys() {
    let store = small_store();
    let (first, retry, replayed, runs) =
        post_twice(move || Idempotency::new(store.clone()).key_prefix("p".repeat(200))).await;
    assert_eq!(first, StatusCode::CREATED);
    assert_eq!(retry, StatusCode::CREATED);
    assert!(replayed, "the retry was not a replay");
    assert_eq!(runs, 1);
}

#[actix_web::test]
async fn a_key_prefix_the_shards_cannot_hold_is_refused_when_set() {
    let set = catch_unwind(AssertUnwindSafe(|| {
        Idempotency::new(small_store()).key_prefix("p".repeat(2048))
    }));
    match set {
        Err(panic) => {
            let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(
                message.contains("every new key would be refused"),
                "unclear message: {message}"
            );
        }
        Ok(_accepted) => {
            let store = small_store();
            let (first, ..) =
                post_twice(move || Idempotency::new(store.clone()).key_prefix("p".repeat(2048)))
                    .await;
            panic!("the prefix was accepted; a new key then got {first}");
        }
    }
}
