//! [`post_twice`]: a keyed `POST /orders` sent twice to an app on an `Idempotency`.

use actix_web::http::{Method, StatusCode};
use actix_web::{App, HttpResponse, test, web};
use idempotency_actix::{Idempotency, KeyScope};

use crate::RunCounter;

/// What a keyed `POST /orders` gets from an app on `idempotency`, sent twice with one key:
/// the first status, the retry's, whether the retry was a replay, and how many times the
/// handler ran.
pub async fn post_twice(idempotency: Idempotency) -> (StatusCode, StatusCode, bool, usize) {
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
