//! The memory store under more keys than it can hold: it stays within its byte budget, keeps
//! answering 201 for new keys and replays for recent ones by evicting completed records,
//! never evicts an in-flight one, and answers 503 only while in-flight records fill their
//! half of it.
//!
//! The million keys go through the store API directly (a million HTTP requests take minutes
//! in a debug build); what clients see is checked over HTTP with thousands.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::{Method, StatusCode};
use actix_web::web::Bytes;
use idempotency_actix::{
    BeginOutcome, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, LeaseToken,
    MemoryStore, StorageKey, StoredResponse,
};
use idempotency_actix_tests::FloodServer;

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(24 * 60 * 60);

fn storage_key(i: u64) -> StorageKey {
    let key = IdempotencyKey::parse(format!("key-{i}").as_bytes()).unwrap();
    StorageKey::new("bounds:", b"", &key)
}

fn stored(i: u64) -> StoredResponse {
    StoredResponse::new(
        StatusCode::CREATED,
        vec![(
            actix_web::http::header::LOCATION,
            format!("/orders/{i}").try_into().unwrap(),
        )],
        Some(Bytes::from(format!("{{\"id\":{i},\"item\":\"book\"}}"))),
    )
}

#[actix_web::test]
async fn a_million_keys_through_4_mib_are_all_acquired_and_recent_ones_replayed() {
    let store = MemoryStore::builder()
        .max_bytes(4 * 1024 * 1024)
        .shards(4)
        .build();
    let print = Fingerprint::compute(&Method::POST, "/orders", "", b"{}", []);
    // One token for every key: each key's record is held by it until committed.
    let token = LeaseToken::generate();
    for i in 0..1_000_000 {
        let key = storage_key(i);
        let begun = store.begin(&key, &print, &token, LEASE).await;
        assert!(
            matches!(begun, Ok(BeginOutcome::Acquired)),
            "key {i}: {begun:?}"
        );
        assert!(
            store
                .commit(&key, &print, &token, &stored(i), TTL)
                .await
                .unwrap()
        );
        if i % 1_000 == 999 {
            assert!(
                store.used_bytes() <= store.max_bytes(),
                "{} bytes used of {} after {i} keys",
                store.used_bytes(),
                store.max_bytes()
            );
            let recent = i - 100;
            let other_token = LeaseToken::generate();
            let replay = store
                .begin(&storage_key(recent), &print, &other_token, LEASE)
                .await
                .unwrap();
            assert_eq!(
                replay,
                BeginOutcome::Completed(stored(recent)),
                "key {recent}, 100 keys ago, is replayed after {i} keys"
            );
        }
    }
    assert!(
        store.evictions() > 900_000,
        "{} evictions",
        store.evictions()
    );
    assert!(store.len() < 100_000, "{} records held", store.len());
}

/// A flood server on `store`, with unpadded bodies.
fn server_on(store: &MemoryStore) -> FloodServer {
    let store = store.clone();
    FloodServer::start(move || Idempotency::new(store.clone()), 0)
}

#[actix_web::test]
async fn over_http_new_keys_get_201_and_recent_ones_replay_while_the_store_evicts() {
    let store = MemoryStore::builder().max_bytes(256 * 1024).build();
    let server = server_on(&store);
    server
        .flood("flood", 5_000, || {
            assert!(store.used_bytes() <= store.max_bytes());
        })
        .await;
    assert_eq!(server.runs.get(), 5_000);
    assert!(store.evictions() > 1_000, "{}", store.evictions());
}

#[actix_web::test]
async fn an_in_flight_record_is_never_evicted_a_duplicate_still_gets_409() {
    let store = MemoryStore::builder().max_bytes(64 * 1024).build();
    let server = server_on(&store);
    let first = server.start_slow("held").await.unwrap();
    server.flood("pressure", 1_000, || {}).await;
    assert!(store.evictions() > 500, "{}", store.evictions());

    let duplicate = server.post("/slow", "held").await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    server.gate.open();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = server.post("/slow", "held").await;
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(server.slow_runs.get(), 1);
}

#[actix_web::test]
async fn a_store_full_of_in_flight_records_answers_503_and_recovers() {
    let store = MemoryStore::builder().max_bytes(5_000).build();
    let server = server_on(&store);
    let mut held = Vec::new();
    let refused = loop {
        match server.start_slow(&format!("held-{}", held.len())).await {
            Ok(reply) => held.push(reply),
            Err(refused) => break refused,
        }
        assert!(held.len() < 50, "a 5 000-byte store never filled");
    };
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert!(refused.header("retry-after").is_some());
    assert!(!held.is_empty());
    let refused_key = format!("held-{}", held.len());

    // Nothing was evicted to make room: every held key is still in flight.
    for i in 0..held.len() {
        let duplicate = server.post("/slow", &format!("held-{i}")).await;
        assert_eq!(duplicate.status, StatusCode::CONFLICT, "held-{i}");
    }
    let new_key = server.post("/orders", "while-full").await;
    assert_eq!(new_key.status, StatusCode::SERVICE_UNAVAILABLE);

    server.gate.open();
    for reply in held {
        assert_eq!(reply.await.unwrap().status, StatusCode::CREATED);
    }
    let slow_runs = server.slow_runs.get();
    let retried = server.post("/slow", &refused_key).await;
    assert_eq!(retried.status, StatusCode::CREATED, "{retried:?}");
    assert_eq!(server.slow_runs.get(), slow_runs + 1);
    let new_key = server.post("/orders", "after-recovery").await;
    assert_eq!(new_key.status, StatusCode::CREATED);
}

#[actix_web::test]
async fn new_keys_refused_by_a_store_full_of_in_flight_records_evict_no_completed_record() {
    let store = MemoryStore::builder()
        .max_bytes(64 * 1024)
        .shards(1)
        .build();
    let server = server_on(&store);
    for i in 0..10 {
        let paid = server.post("/orders", &format!("paid-{i}")).await;
        assert_eq!(paid.status, StatusCode::CREATED);
    }
    let mut held = Vec::new();
    loop {
        match server.start_slow(&format!("held-{}", held.len())).await {
            Ok(reply) => held.push(reply),
            Err(refused) => {
                assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
                break;
            }
        }
        assert!(held.len() < 1_000, "a 64 KiB store never filled");
    }
    // A flood of new keys while the in-flight half is full: each is refused and runs
    // nothing, and leaves nothing behind that would take a completed record's room.
    for i in 0..300 {
        let refused = server.post("/orders", &format!("flood-{i}")).await;
        assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE, "flood-{i}");
    }
    // Time for what a refusal might leave in the background (an abandon starts after 50 ms).
    actix_rt::time::sleep(Duration::from_millis(500)).await;
    server.gate.open();
    for reply in held {
        assert_eq!(reply.await.unwrap().status, StatusCode::CREATED);
    }
    let runs = server.runs.get();
    for i in 0..10 {
        let retry = server.post("/orders", &format!("paid-{i}")).await;
        assert!(retry.is_replay(), "paid-{i}: {retry:?}");
    }
    assert_eq!(server.runs.get(), runs, "a completed payment ran again");
}

/// A response whose headers alone are larger than the store (10 000 bytes of header in a
/// store of 8 KiB): it used to be refused even without its body, the commit was
/// retried in the background for the whole ttl, and every retry of the request got 409
/// meanwhile, never its replay (helper review). It is now completed with its status alone:
/// the retry is a replay, marked `Idempotent-Body-Omitted`, and the handler ran once.
#[actix_web::test]
async fn a_response_whose_headers_outgrow_the_store_is_replayed_with_its_status_alone() {
    use actix_web::{App, HttpResponse, web};
    use idempotency_actix::{KeyScope, REPLAYED_HEADER};
    use idempotency_actix_tests::RunCounter;

    let store = MemoryStore::builder().max_bytes(8 * 1024).shards(1).build();
    let runs = RunCounter::default();
    let server = {
        let (store, runs) = (store.clone(), runs.clone());
        actix_test::start(move || {
            let runs = runs.clone();
            App::new()
                .wrap(
                    Idempotency::new(store.clone())
                        .scope(KeyScope::global())
                        .protect_methods([Method::POST]),
                )
                .route(
                    "/receipts",
                    web::post().to(move || {
                        let seq = runs.record();
                        async move {
                            HttpResponse::Created()
                                .insert_header(("x-receipt", "r".repeat(10_000)))
                                .body(format!("receipt {seq}"))
                        }
                    }),
                )
        })
    };
    let post = || async {
        let mut response = server
            .post("/receipts")
            .insert_header(("idempotency-key", "large-headers"))
            .send_body("{}")
            .await
            .unwrap();
        let body = response.body().await.unwrap();
        (response.status(), response.headers().clone(), body)
    };

    let (status, headers, body) = post().await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers.get("x-receipt").unwrap().len(), 10_000);
    assert_eq!(body, Bytes::from("receipt 1"));

    let (status, headers, body) = post().await;
    assert_eq!(status, StatusCode::CREATED, "{headers:?} {body:?}");
    assert_eq!(runs.get(), 1, "{headers:?} {body:?}");
    assert_eq!(headers.get(REPLAYED_HEADER).unwrap(), "true");
    assert_eq!(headers.get("idempotent-body-omitted").unwrap(), "true");
    assert!(body.is_empty(), "{body:?}");
    assert!(store.used_bytes() <= store.max_bytes());
}
