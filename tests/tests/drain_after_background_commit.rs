//! `Idempotency::drain` behind a commit that landed in the background while the store then
//! stopped answering renewals: the commit is looked at again (a renewal) for a lease at
//! most, so the drain is not held for the record's ttl (24 h here).
//!
//! One test in a binary of its own: a drain is for the whole process and for good.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::Ordering;
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{App, HttpResponse, web};
use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute, KeyScope};
use idempotency_actix_tests::{FaultyStore, Reply, RunCounter};

async fn create(runs: web::Data<RunCounter>) -> HttpResponse {
    let seq = runs.record();
    HttpResponse::Created().body(format!("run {seq}"))
}

#[actix_web::test]
async fn a_commit_that_landed_holds_the_drain_for_a_lease_at_most() {
    let store = FaultyStore {
        failed_commits: std::sync::Arc::new(1.into()),
        ..FaultyStore::default()
    };
    let runs = RunCounter::default();
    let server = actix_test::start({
        let (store, runs) = (store.clone(), runs.clone());
        move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(Idempotency::new(store.clone()).scope(KeyScope::global()))
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().lease(Duration::from_millis(1_500)),
                        ))
                        .route(web::post().to(create)),
                )
        }
    });
    let post = || {
        let request = server
            .post("/orders")
            .insert_header(("idempotency-key", "k"));
        async move { Reply::read(request.send().await.unwrap()).await.unwrap() }
    };

    // The commit fails, goes to the background and lands there 50 ms later; from now on no
    // renewal answers, so the look at it gets no answer either.
    let first = post().await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    store.failed_renewals.store(u32::MAX, Ordering::SeqCst);

    // A lease (1.5 s) at most after the commit landed, with room for a loaded machine: a
    // drain bounded by 10 s also passed with the look held for 8 s (test review).
    assert_eq!(
        Idempotency::drain(Duration::from_secs(4)).await,
        0,
        "the background commit still counted as work in progress 4 s later, more than its \
         1.5 s lease after it landed"
    );
    let replay = post().await;
    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(runs.get(), 1);
}
