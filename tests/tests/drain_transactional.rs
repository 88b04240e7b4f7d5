//! `Idempotency::drain` on a transactional route (PostgreSQL): a new key, claimed inside its
//! transaction while the process drains, is rolled back instead of run (503
//! `shutting-down`, no row written, no record, the key free), while a completed key is
//! still replayed. In a database of its own on the server at `DATABASE_URL` (default
//! 127.0.0.1:5432).
//!
//! One test in a binary of its own: a drain is for the whole process and for good.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{App, HttpResponse, post, web};
use idempotency_actix::{Idempotency, IdempotentTransaction, Inspector, idempotent};
use idempotency_actix_tests::{Reply, RunCounter, TestDatabase};

/// Writes one ledger row through the request's transaction.
#[idempotent(transactional)]
#[post("/ledger")]
async fn book(transaction: IdempotentTransaction, runs: web::Data<RunCounter>) -> HttpResponse {
    runs.record();
    transaction
        .execute("INSERT INTO ledger (amount) VALUES (1)", &[])
        .await
        .unwrap();
    HttpResponse::Created().body("booked")
}

#[actix_web::test]
async fn a_transactional_claim_made_while_draining_is_rolled_back_not_run() {
    let database = TestDatabase::create().await;
    let rows = || async {
        let count: i64 = database
            .connection()
            .await
            .query_one("SELECT count(*) FROM ledger", &[])
            .await
            .unwrap()
            .get(0);
        count
    };
    database
        .connection()
        .await
        .batch_execute("CREATE TABLE ledger (amount bigint NOT NULL)")
        .await
        .unwrap();
    let store = database.store().await;
    let runs = RunCounter::default();
    let server = {
        let (store, runs) = (store.clone(), runs.clone());
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(Idempotency::postgres(store.clone()))
                .service(book)
        })
    };
    let post = |key: &'static str| {
        let request = server
            .post("/ledger")
            .insert_header(("idempotency-key", key));
        async move { Reply::read(request.send().await.unwrap()).await.unwrap() }
    };

    let done = post("done").await;
    assert_eq!(done.status, StatusCode::CREATED, "{done:?}");
    // Nothing is in progress: the drain ends at once.
    assert_eq!(Idempotency::drain(Duration::from_secs(10)).await, 0);

    let refused = post("new").await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert_eq!(
        refused.json()["type"],
        "tag:idempotency-actix,2026:shutting-down"
    );
    let replay = post("done").await;
    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.body, "booked");

    assert_eq!(runs.get(), 1, "the refused request ran its handler");
    assert_eq!(rows().await, 1);
    // The claim was rolled back with its transaction: no record holds the key.
    let inspector = Inspector::new(store);
    let mut record = inspector.lookup(b"", "new").await.unwrap();
    for _ in 0..100 {
        if record.is_none() {
            break;
        }
        // The rollback runs on a task of its own once the transaction is dropped.
        actix_rt::time::sleep(Duration::from_millis(20)).await;
        record = inspector.lookup(b"", "new").await.unwrap();
    }
    assert!(record.is_none(), "{record:?}");
}
