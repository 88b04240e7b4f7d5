//! A memory store under a key prefix longer than the 64 bytes its builder allows for: a
//! prefix its shards can hold serves new keys, and one they cannot is refused when it is set,
//! rather than leaving a store that answers 503 to every new key.

#![allow(clippy::unwrap_used)]

use std::panic::{AssertUnwindSafe, catch_unwind};

use actix_web::http::{Method, StatusCode};
use actix_web::{App, HttpResponse, test, web};
use idempotency_actix::{Idempotency, KeyScope, MemoryStore};
use idempotency_actix_tests::RunCounter;

/// A one-shard store of 2 KiB: above the least budget the builder accepts (about 1.2 KB),
/// so it is built, but its in-flight half holds no record under a prefix of 2 KiB.
fn small_store() -> MemoryStore {
    MemoryStore::builder().max_bytes(2048).shards(1).build()
}

/// What a keyed `POST /orders` gets from an app on `idempotency`, and how many times its
/// handler ran.
async fn post_twice(idempotency: Idempotency) -> (StatusCode, StatusCode, bool, usize) {
    let runs = RunCounter::default();
    let counted = runs.clone();
    let app = test::init_service(
        App::new()
            .wrap(
                idempotency
                    .scope(KeyScope::global())
                    .protect_methods([Method::POST]),
            )
            .route(
                "/orders",
                web::post().to(move || {
                    counted.record();
                    async { HttpResponse::Created().body("made") }
                }),
            ),
    )
    .await;
    let request = || {
        test::TestRequest::post()
            .uri("/orders")
            .insert_header(("Idempotency-Key", "order-1"))
            .to_request()
    };
    let first = test::call_service(&app, request()).await;
    let first_status = first.status();
    // The record is committed once the body has been read.
    test::read_body(first).await;
    let retry = test::call_service(&app, request()).await;
    let replayed = retry.headers().contains_key("idempotent-replayed");
    (first_status, retry.status(), replayed, runs.get())
}

#[actix_web::test]
async fn a_key_prefix_over_64_bytes_that_the_shards_hold_serves_new_keys() {
    let idempotency = Idempotency::new(small_store()).key_prefix("p".repeat(200));
    let (first, retry, replayed, runs) = post_twice(idempotency).await;
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
        Ok(idempotency) => {
            let (first, ..) = post_twice(idempotency).await;
            panic!("the prefix was accepted; a new key then got {first}");
        }
    }
}
