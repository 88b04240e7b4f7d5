//! A PostgreSQL store under a key prefix its table cannot key: the longest prefix it can
//! (2 628 bytes, which the primary key's index holds with the 64-character digest) serves new
//! keys, and one with a NUL byte (which `text` cannot hold) or one byte longer is refused
//! when it is set, rather than leaving an app that answers 503 to every keyed request.
//! Each test runs in a database of its own on the server at `DATABASE_URL` (default
//! postgres://postgres@127.0.0.1:5432/postgres).

#![allow(clippy::unwrap_used)]

use std::panic::{AssertUnwindSafe, catch_unwind};

use actix_web::http::StatusCode;
use idempotency_actix::{Idempotency, PostgresStore};
use idempotency_actix_tests::{TestDatabase, post_twice};

/// The longest prefix the PostgreSQL store takes, in bytes.
const LONGEST: usize = 2628;

/// `len` printable ASCII characters that PostgreSQL cannot compress (a compressed key would
/// fit the index where the worst case does not).
fn incompressible(len: usize) -> String {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            // xorshift64: a fixed sequence that no compressor shortens.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            char::from(b'!' + (state % 94) as u8)
        })
        .collect()
}

/// Sets `prefix` on an app over `store`: refused with a message that contains `says`, or
/// accepted, when the test fails with what a keyed request then got.
async fn assert_refused(store: PostgresStore, prefix: String, says: &str) {
    let set = catch_unwind(AssertUnwindSafe(|| {
        Idempotency::postgres(store.clone()).key_prefix(prefix.clone())
    }));
    match set {
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|&text| text.to_owned()))
                .unwrap_or_default();
            assert!(message.contains(says), "unclear message: {message}");
        }
        Ok(_accepted) => {
            let (first, ..) =
                post_twice(move || Idempotency::postgres(store.clone()).key_prefix(prefix.clone()))
                    .await;
            panic!("the prefix was accepted; a new key then got {first}");
        }
    }
}

#[actix_web::test]
async fn the_longest_key_prefix_serves_new_keys() {
    let database = TestDatabase::create().await;
    let store = database.store().await;
    let (first, retry, replayed, runs) = post_twice(move || {
        Idempotency::postgres(store.clone()).key_prefix(incompressible(LONGEST))
    })
    .await;
    assert_eq!(first, StatusCode::CREATED);
    assert_eq!(retry, StatusCode::CREATED);
    assert!(replayed, "the retry was not a replay");
    assert_eq!(runs, 1);
}

#[actix_web::test]
async fn a_key_prefix_longer_than_the_index_holds_is_refused_when_set() {
    let database = TestDatabase::create().await;
    let prefix = incompressible(LONGEST + 1);
    assert_refused(database.store().await, prefix, "at most 2628 bytes").await;
}

#[actix_web::test]
async fn a_key_prefix_with_a_nul_byte_is_refused_when_set() {
    let database = TestDatabase::create().await;
    let prefix = "shop\0:".to_owned();
    assert_refused(database.store().await, prefix, "NUL").await;
}
